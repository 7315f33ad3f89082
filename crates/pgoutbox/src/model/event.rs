//! An outbox event as the relay and sinks see it, and how its stored headers read.

use chrono::{DateTime, Utc};
use serde_json::value::RawValue;
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
    // The column's default, and what most rows hold: jsonb prints an empty object as `{}`.
    if text == "{}" {
        return Ok(Vec::new());
    }
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

/// How operator views show an event without a topic (a table that allows NULL topics may hold
/// one; the relay dead-letters it with its reason).
pub const NO_TOPIC: &str = "(no topic)";

/// A topic as operator views print it.
pub fn topic_label(topic: Option<&str>) -> &str {
    topic.unwrap_or(NO_TOPIC)
}

/// JSON as stored, carried as its text: reading it has no depth limit (an operator must see any
/// payload a table holds, however deeply nested), and it serializes as the JSON it is. Selected
/// as `column::text`.
#[derive(Debug, Clone)]
pub struct StoredJson(Box<RawValue>);

impl StoredJson {
    /// JSON text, checked (at any depth).
    pub fn parse(text: String) -> Result<Self, serde_json::Error> {
        RawValue::from_string(text).map(Self)
    }

    /// The JSON text.
    pub fn get(&self) -> &str {
        self.0.get()
    }
}

impl serde::Serialize for StoredJson {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(s)
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_json_has_no_depth_limit() {
        let deep = format!("{}1{}", "[".repeat(10_000), "]".repeat(10_000));
        let raw = RawValue::from_string(deep.clone()).expect("any depth");
        let stored = StoredJson(raw);
        assert_eq!(serde_json::to_string(&stored).expect("serialize"), deep);
        assert!(
            serde_json::from_str::<serde_json::Value>(&deep).is_err(),
            "Value stops at 128"
        );
    }

    /// Stored headers (jsonb's text) → the headers, or the start of the error.
    #[test]
    fn headers_table() {
        type Expected = Result<&'static [(&'static str, &'static str)], &'static str>;
        let cases: Vec<(&str, Expected)> = vec![
            ("{}", Ok(&[])),
            ("{ }", Ok(&[])),
            ("null", Ok(&[])),
            (r#"{"a": "1"}"#, Ok(&[("a", "1")])),
            (
                r#"{"n": 2, "o": {"x": null}}"#,
                Ok(&[("n", "2"), ("o", r#"{"x":null}"#)]),
            ),
            ("[]", Err("headers must be a JSON object")),
            (r#""{}""#, Err("headers must be a JSON object")),
            ("{", Err("headers are not JSON")),
        ];
        for (text, expected) in cases {
            match (parse_headers(text), expected) {
                (Ok(got), Ok(want)) => {
                    let want: Vec<(String, String)> = want
                        .iter()
                        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                        .collect();
                    assert_eq!(got, want, "{text}");
                }
                (Err(got), Err(want)) => assert!(got.starts_with(want), "{text}: {got}"),
                (got, want) => panic!("{text}: {got:?}, expected {want:?}"),
            }
        }
    }
}
