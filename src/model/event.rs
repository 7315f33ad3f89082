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
        let headers = match headers.as_deref() {
            Some(text) => parse_headers(text).map_err(|message| sqlx::Error::ColumnDecode {
                index: "headers".into(),
                source: message.into(),
            })?,
            None => Vec::new(),
        };
        Ok(Self {
            id: row.try_get("id")?,
            seq: row.try_get("seq")?,
            topic: row.try_get("topic")?,
            key: row.try_get("key")?,
            payload,
            headers,
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

/// Headers come from a jsonb object (JSON `null` counts as none). Anything else, written by hand in
/// SQL, is an error: the row is dead-lettered with it rather than sent without its headers.
pub(crate) fn parse_headers(text: &str) -> Result<Vec<(String, String)>, String> {
    match serde_json::from_str::<serde_json::Value>(text) {
        Ok(serde_json::Value::Object(map)) => Ok(map
            .into_iter()
            .map(|(k, v)| {
                let v = match v {
                    serde_json::Value::String(s) => s,
                    other => other.to_string(),
                };
                (k, v)
            })
            .collect()),
        Ok(serde_json::Value::Null) => Ok(Vec::new()),
        Ok(other) => Err(format!(
            "headers must be a JSON object of names to values, not {}",
            match other {
                serde_json::Value::Array(_) => "an array",
                serde_json::Value::String(_) => "a string",
                serde_json::Value::Number(_) => "a number",
                _ => "a boolean",
            }
        )),
        Err(e) => Err(format!("headers are not JSON: {e}")),
    }
}

/// Events for the unit tests of the modules that read them.
#[cfg(test)]
pub(crate) mod testing {
    use super::OutboxEvent;

    /// An event of `topic`, with `key` and `headers`, an empty payload, never attempted.
    pub(crate) fn event(topic: &str, key: Option<&str>, headers: &[(&str, &str)]) -> OutboxEvent {
        OutboxEvent {
            id: uuid::Uuid::new_v4(),
            seq: 1,
            topic: topic.into(),
            key: key.map(str::to_owned),
            payload: serde_json::value::RawValue::from_string("{}".into()).expect("json"),
            headers: headers
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            created_at: chrono::Utc::now(),
            attempts: 0,
        }
    }
}
