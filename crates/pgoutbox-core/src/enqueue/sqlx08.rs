//! The sqlx 0.8 adapter (feature `sqlx08`, on by default): the driver the relay itself uses.
//!
//! Pass the caller's transaction as `&mut *tx` (or a plain connection for autocommit).

use sqlx::PgConnection;
use uuid::Uuid;

use super::{Columns, Event, Outbox, TypedEvent};
use crate::error::Result;

impl Outbox {
    /// Inserts one event using the caller's connection or transaction (`&mut *tx`); returns its id.
    pub async fn enqueue(&self, conn: &mut PgConnection, event: &Event) -> Result<Uuid> {
        let id = sqlx::query_scalar(&self.table.sql.insert_one)
            .bind(&event.topic)
            .bind(&event.payload)
            .bind(&event.key)
            .bind(event.headers_json())
            .bind(super::new_id())
            .fetch_one(conn)
            .await?;
        Ok(id)
    }

    /// Inserts many events in one statement, in order; returns their ids in the same order.
    pub async fn enqueue_many(
        &self,
        conn: &mut PgConnection,
        events: &[Event],
    ) -> Result<Vec<Uuid>> {
        if events.is_empty() {
            return Ok(Vec::new());
        }
        let c = Columns::of(events);
        let ids = sqlx::query_scalar(&self.table.sql.insert_many)
            .bind(c.topics)
            .bind(c.payloads)
            .bind(c.keys)
            .bind(c.headers)
            .bind(c.ids)
            .fetch_all(conn)
            .await?;
        Ok(ids)
    }

    /// Inserts one [`TypedEvent`] (topic and key from its type) in the caller's transaction.
    pub async fn enqueue_typed<T: TypedEvent>(
        &self,
        conn: &mut PgConnection,
        value: &T,
    ) -> Result<Uuid> {
        self.enqueue(conn, &Event::typed(value)?).await
    }
}
