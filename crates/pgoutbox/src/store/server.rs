//! The server's settings and the session's identity, as the commands report and check them:
//! the role, the database, autovacuum, the WAL a slot may keep.
//!
//! Each reads the server, not the outbox table: they take any executor (the pool, or a
//! connection the caller holds), not a [`super::Store`].

use sqlx::PgExecutor;

use crate::error::Result;

/// CurrentUser. The session's role.
const CURRENT_USER: &str = "SELECT current_user::text";

/// CurrentUser: the role the session runs as.
pub async fn current_user<'c>(db: impl PgExecutor<'c>) -> Result<String> {
    Ok(sqlx::query_scalar(CURRENT_USER).fetch_one(db).await?)
}

/// CurrentDatabase. The session's database.
const CURRENT_DATABASE: &str = "SELECT current_database()::text";

/// CurrentDatabase: the database the session is in.
pub async fn current_database<'c>(db: impl PgExecutor<'c>) -> Result<String> {
    Ok(sqlx::query_scalar(CURRENT_DATABASE).fetch_one(db).await?)
}

/// Autovacuum. The server's `autovacuum` setting (`on` or `off`).
const AUTOVACUUM: &str = "SHOW autovacuum";

/// Autovacuum: the server's `autovacuum` setting, as it writes it.
pub async fn autovacuum<'c>(db: impl PgExecutor<'c>) -> Result<String> {
    Ok(sqlx::query_scalar(AUTOVACUUM).fetch_one(db).await?)
}

/// SlotWalKeepSize. `max_slot_wal_keep_size` as the server writes it (`-1`: unbounded).
const MAX_SLOT_WAL_KEEP_SIZE: &str = "SELECT current_setting('max_slot_wal_keep_size')";

/// SlotWalKeepSize: how much WAL a slot may hold back, as the server writes it.
pub async fn max_slot_wal_keep_size<'c>(db: impl PgExecutor<'c>) -> Result<String> {
    Ok(sqlx::query_scalar(MAX_SLOT_WAL_KEEP_SIZE)
        .fetch_one(db)
        .await?)
}

/// ServerRole. Whether the server is a standby, and whether a new session is read-only: what
/// `target_session_attrs` weighs.
const SERVER_ROLE: &str =
    "SELECT pg_is_in_recovery(), current_setting('transaction_read_only') = 'on'";

/// ServerRole: what the server says of itself, for choosing among a URL's hosts.
pub async fn role<'c>(db: impl PgExecutor<'c>) -> Result<crate::config::ServerRole> {
    let (in_recovery, read_only): (bool, bool) = sqlx::query_as(SERVER_ROLE).fetch_one(db).await?;
    Ok(crate::config::ServerRole {
        in_recovery,
        read_only,
    })
}
