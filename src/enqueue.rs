//! Enqueue: writing events into the outbox inside the caller's transaction.
//!
//! The event commits with the business data or not at all: pass the same transaction (or
//! connection) the application writes with.
//!
//! ```no_run
//! # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! use pgoutbox::{Event, Outbox};
//! let outbox = Outbox::default();
//! let mut tx = pool.begin().await?;
//! sqlx::query("INSERT INTO orders (id, total) VALUES (1, 42)").execute(&mut *tx).await?;
//! outbox
//!     .enqueue(&mut *tx, &Event::new("order.created", &serde_json::json!({"order_id": 1}))?.key("order-1"))
//!     .await?;
//! tx.commit().await?;
//! # Ok(()) }
//! ```

use std::collections::BTreeMap;

use serde::Serialize;
use sqlx::PgConnection;
use uuid::Uuid;

use crate::error::{Error, Result};
use crate::table::OutboxTable;

/// An event to enqueue: topic, JSON payload, optional key and headers.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    topic: String,
    payload: String,
    key: Option<String>,
    headers: BTreeMap<String, String>,
}

impl Event {
    /// An event with `payload` serialized to JSON.
    pub fn new(topic: impl Into<String>, payload: &impl Serialize) -> Result<Self> {
        let payload = serde_json::to_string(payload).map_err(Error::Payload)?;
        Self::build(topic.into(), payload)
    }

    /// An event whose payload is already JSON text; it is validated, not re-encoded.
    pub fn from_json_str(topic: impl Into<String>, json: &str) -> Result<Self> {
        serde_json::from_str::<serde::de::IgnoredAny>(json).map_err(Error::Payload)?;
        Self::build(topic.into(), json.to_owned())
    }

    fn build(topic: String, payload: String) -> Result<Self> {
        if topic.trim().is_empty() {
            return Err(Error::EmptyTopic);
        }
        Ok(Self {
            topic,
            payload,
            key: None,
            headers: BTreeMap::new(),
        })
    }

    /// Sets the message key (per-key ordering, broker partitioning).
    pub fn key(mut self, key: impl Into<String>) -> Self {
        self.key = Some(key.into());
        self
    }

    /// Adds a header, forwarded by every sink.
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.insert(name.into(), value.into());
        self
    }

    /// The topic.
    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// The payload as JSON text.
    pub fn payload(&self) -> &str {
        &self.payload
    }

    fn headers_json(&self) -> String {
        // A map of strings always serializes.
        serde_json::to_string(&self.headers).unwrap_or_else(|_| "{}".into())
    }
}

/// Writes events into one outbox table.
#[derive(Debug, Clone)]
pub struct Outbox {
    table: OutboxTable,
}

impl Default for Outbox {
    /// The outbox at `public.outbox`.
    fn default() -> Self {
        Self {
            table: OutboxTable::default_table(),
        }
    }
}

impl Outbox {
    /// An outbox writer for a specific table.
    pub fn new(table: OutboxTable) -> Self {
        Self { table }
    }

    /// The table written to.
    pub fn table(&self) -> &OutboxTable {
        &self.table
    }

    /// Inserts one event using the caller's connection or transaction (`&mut *tx`); returns its id.
    pub async fn enqueue(&self, conn: &mut PgConnection, event: &Event) -> Result<Uuid> {
        let id = sqlx::query_scalar(&self.table.sql.insert_one)
            .bind(&event.topic)
            .bind(&event.payload)
            .bind(&event.key)
            .bind(event.headers_json())
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
        let topics: Vec<&str> = events.iter().map(|e| e.topic.as_str()).collect();
        let payloads: Vec<&str> = events.iter().map(|e| e.payload.as_str()).collect();
        let keys: Vec<Option<&str>> = events.iter().map(|e| e.key.as_deref()).collect();
        let headers: Vec<String> = events.iter().map(Event::headers_json).collect();
        let ids = sqlx::query_scalar(&self.table.sql.insert_many)
            .bind(topics)
            .bind(payloads)
            .bind(keys)
            .bind(headers)
            .fetch_all(conn)
            .await?;
        Ok(ids)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn non_json_payload_is_a_clear_error() {
        let err = Event::from_json_str("t", "{not json").expect_err("must fail");
        assert!(matches!(err, Error::Payload(_)));
        assert_eq!(err.to_string(), "event payload is not valid JSON");
        // A map with non-string keys cannot be JSON.
        let mut m = std::collections::HashMap::new();
        m.insert(vec![1u8], 1);
        assert!(matches!(Event::new("t", &m), Err(Error::Payload(_))));
        assert!(matches!(Event::new(" ", &1), Err(Error::EmptyTopic)));
    }
}
