//! The server's settings and the session's identity, as the commands report and check them.
//!
//! Each reads the server, not the outbox table: they take any executor (the pool, or a
//! connection the caller holds), not a [`super::Store`].

use sqlx::PgExecutor;

use crate::error::Result;

/// CurrentDatabase. The session's database.
const CURRENT_DATABASE: &str = "SELECT current_database()::text";

/// CurrentDatabase: the database the session is in.
pub async fn current_database<'c>(db: impl PgExecutor<'c>) -> Result<String> {
    Ok(sqlx::query_scalar(CURRENT_DATABASE).fetch_one(db).await?)
}
