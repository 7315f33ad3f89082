//! The sqlx 0.9 adapter (feature `sqlx09`), for applications on sqlx 0.9 while the relay stays on
//! 0.8: the crate is renamed `sqlx09` so both versions link side by side.
//!
//! ```ignore
//! let mut tx = pool.begin().await?;          // a sqlx 0.9 PgPool
//! outbox.enqueue_sqlx09(&mut tx, &event).await?;
//! tx.commit().await?;
//! ```

use sqlx09::{AssertSqlSafe, PgConnection};
use uuid::Uuid;

use super::{Columns, Event, Outbox};
use crate::error::Result;

impl Outbox {
    /// Inserts one event with a sqlx 0.9 connection or transaction (`&mut tx`); returns its id.
    pub async fn enqueue_sqlx09(&self, conn: &mut PgConnection, event: &Event) -> Result<Uuid> {
        // The statement is rendered from validated, quoted identifiers (see `crate::table`).
        let sql = AssertSqlSafe(self.table.sql.insert_one.clone());
        let id = sqlx09::query_scalar(sql)
            .bind(event.topic.clone())
            .bind(event.payload.clone())
            .bind(event.key.clone())
            .bind(event.headers_json())
            .bind(super::new_id())
            .fetch_one(conn)
            .await?;
        Ok(id)
    }

    /// Inserts many events in one statement with sqlx 0.9, in order; returns their ids in order.
    pub async fn enqueue_many_sqlx09(
        &self,
        conn: &mut PgConnection,
        events: &[Event],
    ) -> Result<Vec<Uuid>> {
        if events.is_empty() {
            return Ok(Vec::new());
        }
        let c = Columns::of(events);
        let sql = AssertSqlSafe(self.table.sql.insert_many.clone());
        let ids = sqlx09::query_scalar(sql)
            .bind(c.topics)
            .bind(c.payloads)
            .bind(c.keys)
            .bind(c.headers)
            .bind(c.ids)
            .fetch_all(conn)
            .await?;
        Ok(ids)
    }
}
