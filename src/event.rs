//! A claimed outbox row as the relay and sinks see it.

use chrono::{DateTime, Utc};
use serde_json::value::RawValue;
use sqlx::postgres::PgRow;
use sqlx::Row;
use uuid::Uuid;

/// One event read from the outbox table, ready to publish.
#[derive(Debug, Clone)]
pub struct OutboxEvent {
    /// The event id: stable across retries, what consumers dedupe by.
    pub id: Uuid,
    /// Insert order.
    pub seq: i64,
    /// The topic (event type), e.g. `order.created`.
    pub topic: String,
    /// The message key, if any (ordering, partitioning).
    pub key: Option<String>,
    /// The payload as JSON text, forwarded without re-encoding.
    pub payload: Box<RawValue>,
    /// Event headers; non-string JSON values are rendered as JSON text.
    pub headers: Vec<(String, String)>,
    /// When the event was written.
    pub created_at: DateTime<Utc>,
    /// Failed attempts so far.
    pub attempts: i32,
}

impl OutboxEvent {
    /// Decodes a row selected with the table's event columns.
    pub fn from_row(row: &PgRow) -> Result<Self, sqlx::Error> {
        let payload: String = row.try_get("payload")?;
        let payload = RawValue::from_string(payload).map_err(|e| sqlx::Error::ColumnDecode {
            index: "payload".into(),
            source: Box::new(e),
        })?;
        let headers: Option<String> = row.try_get("headers")?;
        Ok(Self {
            id: row.try_get("id")?,
            seq: row.try_get("seq")?,
            topic: row.try_get("topic")?,
            key: row.try_get("key")?,
            payload,
            headers: headers.as_deref().map(parse_headers).unwrap_or_default(),
            created_at: row.try_get("created_at")?,
            attempts: row.try_get("attempts")?,
        })
    }

    /// The value of header `name`, if present.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// Headers come from a jsonb object; anything else (written by hand in SQL) is treated as empty.
fn parse_headers(text: &str) -> Vec<(String, String)> {
    match serde_json::from_str::<serde_json::Value>(text) {
        Ok(serde_json::Value::Object(map)) => map
            .into_iter()
            .map(|(k, v)| {
                let v = match v {
                    serde_json::Value::String(s) => s,
                    other => other.to_string(),
                };
                (k, v)
            })
            .collect(),
        _ => Vec::new(),
    }
}
