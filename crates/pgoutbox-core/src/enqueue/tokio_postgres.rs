//! The tokio-postgres adapter (feature `tokio-postgres`).
//!
//! Takes any `GenericClient`, so the caller's `Transaction` works as well as a plain `Client`.
//! Statements are prepared through the client's statement cache on each call; applications that
//! enqueue in tight loops should prefer the batch form.

use tokio_postgres::types::ToSql;
use tokio_postgres::GenericClient;
use uuid::Uuid;

use super::{Columns, Event, Outbox};
use crate::error::Result;

impl Outbox {
    /// Inserts one event with a tokio-postgres client or transaction; returns its id.
    pub async fn enqueue_pg<C: GenericClient>(&self, client: &C, event: &Event) -> Result<Uuid> {
        let headers = event.headers_json();
        let id = super::new_id();
        let params: [&(dyn ToSql + Sync); 5] =
            [&event.topic, &event.payload, &event.key, &headers, &id];
        let row = client
            .query_one(self.table.sql.insert_one.as_str(), &params)
            .await?;
        Ok(row.try_get(0)?)
    }

    /// Inserts many events in one statement with tokio-postgres, in order; returns their ids in
    /// order.
    pub async fn enqueue_many_pg<C: GenericClient>(
        &self,
        client: &C,
        events: &[Event],
    ) -> Result<Vec<Uuid>> {
        if events.is_empty() {
            return Ok(Vec::new());
        }
        let c = Columns::of(events);
        let params: [&(dyn ToSql + Sync); 5] =
            [&c.topics, &c.payloads, &c.keys, &c.headers, &c.ids];
        let rows = client
            .query(self.table.sql.insert_many.as_str(), &params)
            .await?;
        rows.iter()
            .map(|row| row.try_get(0).map_err(Into::into))
            .collect()
    }
}
