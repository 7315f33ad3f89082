//! Enqueue: writing events into the outbox inside the caller's transaction.
//!
//! The event commits with the business data or not at all: pass the same transaction (or
//! connection) the application writes with. One [`Event`] type serves every driver; each driver
//! adapter only binds parameters to the statements rendered in [`crate::table`] (`OutboxInsert`,
//! `OutboxInsertMany`), so there is one definition of the INSERT:
//!
//! | driver | one event | a batch | module |
//! |---|---|---|---|
//! | sqlx 0.8 (always) | [`Outbox::enqueue`] | [`Outbox::enqueue_many`] | `sqlx08` |
//! | sqlx 0.9 (feature `sqlx09`) | `Outbox::enqueue_sqlx09` | `Outbox::enqueue_many_sqlx09` | `sqlx09` |
//! | tokio-postgres (feature `tokio-postgres`) | `Outbox::enqueue_pg` | `Outbox::enqueue_many_pg` | `tokio_postgres` |
//!
//! Typed events: implement [`TypedEvent`] on a `Serialize` struct and build the event with
//! [`Event::typed`] (or call [`Outbox::enqueue_typed`]).
//!
//! ```no_run
//! # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! use pgoutbox_core::{Event, Outbox};
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

use crate::error::{Error, Result};
use crate::table::OutboxTable;

#[cfg(feature = "sqlx08")]
mod sqlx08;
#[cfg(feature = "sqlx09")]
mod sqlx09;
#[cfg(feature = "tokio-postgres")]
mod tokio_postgres;

/// A payload type that knows its topic (and optionally its key), so it enqueues directly.
///
/// ```
/// #[derive(serde::Serialize)]
/// struct OrderCreated { order_id: i64, total: i64 }
///
/// impl pgoutbox_core::TypedEvent for OrderCreated {
///     const TOPIC: &'static str = "order.created";
///     fn key(&self) -> Option<String> { Some(format!("order-{}", self.order_id)) }
/// }
///
/// let event = pgoutbox_core::Event::typed(&OrderCreated { order_id: 1, total: 42 }).unwrap();
/// assert_eq!(event.topic(), "order.created");
/// assert_eq!(event.key_str(), Some("order-1"));
/// ```
pub trait TypedEvent: Serialize {
    /// The topic every value of this type is published under.
    const TOPIC: &'static str;

    /// The message key (per-key ordering, broker partitioning); none by default.
    fn key(&self) -> Option<String> {
        None
    }
}

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

    /// An event from a [`TypedEvent`]: its topic, its key, the value serialized as the payload.
    pub fn typed<T: TypedEvent>(value: &T) -> Result<Self> {
        let event = Self::new(T::TOPIC, value)?;
        Ok(match value.key() {
            Some(key) => event.key(key),
            None => event,
        })
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
        // The producer's trace continues through the relay to the consumer (see crate::trace).
        let mut headers = BTreeMap::new();
        if let Some((traceparent, tracestate)) = crate::trace::current() {
            headers.insert(crate::trace::TRACEPARENT.to_owned(), traceparent);
            if let Some(state) = tracestate {
                headers.insert(crate::trace::TRACESTATE.to_owned(), state);
            }
        }
        Ok(Self {
            topic,
            payload,
            key: None,
            headers,
        })
    }

    /// Drops the trace context recorded from the current OpenTelemetry span (opt-out).
    pub fn without_trace_context(mut self) -> Self {
        self.headers.remove(crate::trace::TRACEPARENT);
        self.headers.remove(crate::trace::TRACESTATE);
        self
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

    /// The message key, if any.
    pub fn key_str(&self) -> Option<&str> {
        self.key.as_deref()
    }

    /// The headers.
    pub fn headers(&self) -> &BTreeMap<String, String> {
        &self.headers
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
}

/// The parameters of `OutboxInsertMany`, one array per column, shared by every adapter.
struct Columns<'a> {
    ids: Vec<uuid::Uuid>,
    topics: Vec<&'a str>,
    payloads: Vec<&'a str>,
    keys: Vec<Option<&'a str>>,
    headers: Vec<String>,
}

impl<'a> Columns<'a> {
    fn of(events: &'a [Event]) -> Self {
        Self {
            ids: events.iter().map(|_| new_id()).collect(),
            topics: events.iter().map(|e| e.topic.as_str()).collect(),
            payloads: events.iter().map(|e| e.payload.as_str()).collect(),
            keys: events.iter().map(|e| e.key.as_deref()).collect(),
            headers: events.iter().map(Event::headers_json).collect(),
        }
    }
}

/// A new event id: a UUIDv7 (time-ordered; monotonic within this process), so the events an
/// application writes land at the right edge of the primary key, whatever the server version
/// (the column default makes one only on PostgreSQL 18+; see docs/performance.md, "Write path").
pub(crate) fn new_id() -> uuid::Uuid {
    uuid::Uuid::now_v7()
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

    #[derive(Serialize)]
    struct Shipped {
        order_id: i64,
    }

    impl TypedEvent for Shipped {
        const TOPIC: &'static str = "order.shipped";
    }

    #[test]
    fn typed_events_carry_their_topic_and_key() {
        let e = Event::typed(&Shipped { order_id: 7 }).expect("json");
        assert_eq!(e.topic(), "order.shipped");
        assert_eq!(e.payload(), r#"{"order_id":7}"#);
        assert_eq!(e.key_str(), None);
    }
}
