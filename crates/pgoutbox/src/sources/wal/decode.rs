//! Decoding what the slot sends: `pgoutput` Relation and Insert messages of the outbox table, and
//! the table's logical decoding messages (`<table>_emit()`), into [`OutboxEvent`]s.
//!
//! The replication client parses the stream's framing and the Begin, Commit and Message records;
//! row changes arrive as raw `pgoutput` bytes (protocol version 1, text format), decoded here. The
//! format is PostgreSQL's "Logical Replication Message Formats" chapter; only the two messages the
//! relay needs are read, everything else is skipped.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use serde::Deserialize;
use serde_json::value::RawValue;
use uuid::Uuid;

use crate::model::event::{parse_headers, OutboxEvent};
use crate::table::OutboxTable;

/// What one record of the stream holds for the relay.
#[derive(Debug)]
pub enum Decoded {
    /// An event to publish.
    Event(OutboxEvent),
    /// An outbox row that cannot be read as an event (a NULL where a value is needed, headers that
    /// are not an object): dead-lettered with the reason, never published.
    Poison(Uuid, String),
    /// A message of this table that is not an event (written by hand, not by `emit()`): nothing
    /// to dead-letter it in, so it is logged and counted.
    Undecodable(String),
}

/// A `pgoutput` stream that cannot be followed (a truncated or unknown message): the session ends.
#[derive(Debug, thiserror::Error)]
#[error("malformed pgoutput message: {0}")]
pub struct ProtocolError(pub String);

/// The outbox table's columns the relay reads, by position in the Relation message.
#[derive(Debug, Clone, Default)]
struct Columns {
    id: Option<usize>,
    seq: Option<usize>,
    topic: Option<usize>,
    key: Option<usize>,
    payload: Option<usize>,
    headers: Option<usize>,
    created_at: Option<usize>,
    attempts: Option<usize>,
    published_at: Option<usize>,
}

/// Follows the stream's Relation messages and turns the outbox table's inserts into events.
pub struct Decoder {
    schema: String,
    table: String,
    prefix: String,
    /// Relation id → the outbox table's columns; other tables map to `None`.
    relations: HashMap<u32, Option<Columns>>,
}

impl Decoder {
    /// A decoder for `table`'s rows and messages.
    pub fn new(table: &OutboxTable) -> Self {
        Self {
            schema: table.schema().as_str().to_owned(),
            table: table.table().as_str().to_owned(),
            prefix: table.message_prefix(),
            relations: HashMap::new(),
        }
    }

    /// The logical decoding message prefix this decoder takes.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// One `pgoutput` change message (the XLogData payload). `Ok(None)` for everything that is not
    /// an insert into the outbox table.
    pub fn change(&mut self, data: &[u8]) -> Result<Option<Decoded>, ProtocolError> {
        let mut r = Reader(data);
        match r.u8()? {
            b'R' => {
                let id = r.u32()?;
                let schema = r.cstr()?;
                let name = r.cstr()?;
                let _identity = r.u8()?;
                let n = r.i16()?;
                let mut columns = Columns::default();
                for i in 0..n.max(0) as usize {
                    let _flags = r.u8()?;
                    let column = r.cstr()?;
                    let _type = r.u32()?;
                    let _typmod = r.u32()?;
                    let slot = match column {
                        "id" => &mut columns.id,
                        "seq" => &mut columns.seq,
                        "topic" => &mut columns.topic,
                        "key" => &mut columns.key,
                        "payload" => &mut columns.payload,
                        "headers" => &mut columns.headers,
                        "created_at" => &mut columns.created_at,
                        "attempts" => &mut columns.attempts,
                        "published_at" => &mut columns.published_at,
                        _ => continue,
                    };
                    *slot = Some(i);
                }
                let ours = schema == self.schema && name == self.table;
                self.relations.insert(id, ours.then_some(columns));
                Ok(None)
            }
            b'I' => {
                let id = r.u32()?;
                let Some(Some(columns)) = self.relations.get(&id) else {
                    return Ok(None);
                };
                if r.u8()? != b'N' {
                    return Err(ProtocolError("insert without a new tuple".into()));
                }
                let values = r.tuple()?;
                // A row inserted already published is not an event: the relay's own rows for
                // `emit()` events it settles (see WalMaterialize) come back through the slot so.
                if columns
                    .published_at
                    .and_then(|i| values.get(i).copied().flatten())
                    .is_some()
                {
                    return Ok(None);
                }
                Ok(Some(row_event(columns, &values)))
            }
            // Begin, Commit and Message come parsed by the client; Origin, Type, Update, Delete,
            // Truncate carry nothing for the relay (the publication publishes inserts only).
            _ => Ok(None),
        }
    }

    /// One transactional logical decoding message: an event when it carries this table's prefix,
    /// `None` otherwise (another table's, a heartbeat, another program's).
    pub fn message(&self, prefix: &str, lsn: u64, content: &[u8]) -> Option<Decoded> {
        if prefix != self.prefix {
            return None;
        }
        Some(match message_event(lsn, content) {
            Ok(event) => Decoded::Event(event),
            Err(reason) => Decoded::Undecodable(reason),
        })
    }
}

/// The JSON that `<table>_emit()` writes.
#[derive(Deserialize)]
struct Message {
    id: Uuid,
    topic: String,
    key: Option<String>,
    payload: Box<RawValue>,
    headers: Option<Box<RawValue>>,
    created_at: DateTime<Utc>,
}

fn message_event(lsn: u64, content: &[u8]) -> Result<OutboxEvent, String> {
    let m: Message = serde_json::from_slice(content)
        .map_err(|e| format!("not an event written by emit(): {e}"))?;
    let headers = match &m.headers {
        Some(raw) => parse_headers(raw.get())?,
        None => Vec::new(),
    };
    Ok(OutboxEvent {
        id: m.id,
        // No row, no seq: the message's WAL position orders it (only within the batch).
        seq: i64::try_from(lsn).unwrap_or(i64::MAX),
        topic: m.topic,
        key: m.key,
        payload: m.payload,
        headers,
        created_at: m.created_at,
        attempts: 0,
    })
}

/// A column's text value (`None` for NULL).
type Value<'a> = Option<&'a str>;

fn row_event(columns: &Columns, values: &[Value<'_>]) -> Decoded {
    let get = |c: Option<usize>| c.and_then(|i| values.get(i).copied().flatten());
    let Some(id) = get(columns.id).and_then(|v| Uuid::parse_str(v).ok()) else {
        return Decoded::Undecodable("an outbox row without a readable id".into());
    };
    let event = (|| -> Result<OutboxEvent, String> {
        let required = |c: Option<usize>, name: &str| {
            get(c).ok_or_else(|| format!("column {name} is NULL or missing"))
        };
        let payload = RawValue::from_string(required(columns.payload, "payload")?.to_owned())
            .map_err(|e| format!("payload is not JSON: {e}"))?;
        let headers = match get(columns.headers) {
            Some(text) => parse_headers(text)?,
            None => Vec::new(),
        };
        let created_at = required(columns.created_at, "created_at")?;
        Ok(OutboxEvent {
            id,
            seq: required(columns.seq, "seq")?
                .parse()
                .map_err(|e| format!("seq: {e}"))?,
            topic: required(columns.topic, "topic")?.to_owned(),
            key: get(columns.key).map(str::to_owned),
            payload,
            headers,
            created_at: parse_timestamp(created_at)
                .ok_or_else(|| format!("created_at: cannot read {created_at:?}"))?,
            attempts: get(columns.attempts)
                .and_then(|v| v.parse().ok())
                .unwrap_or(0),
        })
    })();
    match event {
        Ok(event) => Decoded::Event(event),
        Err(reason) => Decoded::Poison(id, reason),
    }
}

/// A `timestamptz` in the text form of a session with `DateStyle = ISO` (the relay's replication
/// session sets it): `2026-12-02 09:15:01.123456+00`, offsets possibly with minutes.
fn parse_timestamp(text: &str) -> Option<DateTime<Utc>> {
    DateTime::parse_from_str(text, "%Y-%m-%d %H:%M:%S%.f%#z")
        .ok()
        .map(|t| t.with_timezone(&Utc))
}

/// A cursor over one message's bytes (network byte order).
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], ProtocolError> {
        if self.0.len() < n {
            return Err(ProtocolError(format!(
                "needed {n} more bytes, {} left",
                self.0.len()
            )));
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Ok(head)
    }

    fn u8(&mut self) -> Result<u8, ProtocolError> {
        Ok(self.take(1)?[0])
    }

    fn i16(&mut self) -> Result<i16, ProtocolError> {
        let b = self.take(2)?;
        Ok(i16::from_be_bytes([b[0], b[1]]))
    }

    fn u32(&mut self) -> Result<u32, ProtocolError> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn cstr(&mut self) -> Result<&'a str, ProtocolError> {
        let end = self
            .0
            .iter()
            .position(|&b| b == 0)
            .ok_or_else(|| ProtocolError("unterminated string".into()))?;
        let s = std::str::from_utf8(&self.0[..end])
            .map_err(|_| ProtocolError("a name that is not UTF-8".into()))?;
        self.0 = &self.0[end + 1..];
        Ok(s)
    }

    /// TupleData: the column count, then per column `n` (NULL), `u` (unchanged TOAST, never in an
    /// insert) or `t` + length + text.
    fn tuple(&mut self) -> Result<Vec<Value<'a>>, ProtocolError> {
        let n = self.i16()?;
        let mut values = Vec::with_capacity(n.max(0) as usize);
        for _ in 0..n.max(0) {
            match self.u8()? {
                b'n' | b'u' => values.push(None),
                b't' => {
                    let len = self.u32()? as usize;
                    let text = std::str::from_utf8(self.take(len)?)
                        .map_err(|_| ProtocolError("a text value that is not UTF-8".into()))?;
                    values.push(Some(text));
                }
                other => {
                    return Err(ProtocolError(format!(
                        "column kind {:?} (binary format is not requested)",
                        other as char
                    )))
                }
            }
        }
        Ok(values)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn relation(id: u32, schema: &str, table: &str, columns: &[&str]) -> Vec<u8> {
        let mut m = vec![b'R'];
        m.extend(id.to_be_bytes());
        for s in [schema, table] {
            m.extend(s.as_bytes());
            m.push(0);
        }
        m.push(b'd');
        m.extend((columns.len() as i16).to_be_bytes());
        for c in columns {
            m.push(0);
            m.extend(c.as_bytes());
            m.push(0);
            m.extend(25u32.to_be_bytes());
            m.extend((-1i32).to_be_bytes());
        }
        m
    }

    fn insert(id: u32, values: &[Option<&str>]) -> Vec<u8> {
        let mut m = vec![b'I'];
        m.extend(id.to_be_bytes());
        m.push(b'N');
        m.extend((values.len() as i16).to_be_bytes());
        for v in values {
            match v {
                None => m.push(b'n'),
                Some(t) => {
                    m.push(b't');
                    m.extend((t.len() as u32).to_be_bytes());
                    m.extend(t.as_bytes());
                }
            }
        }
        m
    }

    const COLUMNS: &[&str] = &[
        "id",
        "created_at",
        "published_at",
        "topic",
        "payload",
        "attempts",
        "seq",
        "key",
        "headers",
    ];

    #[test]
    fn an_outbox_insert_is_an_event_and_other_tables_are_skipped() {
        let mut d = Decoder::new(&OutboxTable::default_table());
        assert!(d
            .change(&relation(7, "public", "outbox", COLUMNS))
            .unwrap()
            .is_none());
        assert!(d
            .change(&relation(8, "public", "orders", &["id"]))
            .unwrap()
            .is_none());
        let id = "0190e1d2-7a4b-7c3d-8e5f-0123456789ab";
        let row = insert(
            7,
            &[
                Some(id),
                Some("2026-12-02 09:15:01.123456+00"),
                None,
                Some("order.created"),
                Some(r#"{"n": 1}"#),
                Some("0"),
                Some("42"),
                Some("customer-1"),
                Some(r#"{"trace": "t", "n": 2}"#),
            ],
        );
        let Some(Decoded::Event(e)) = d.change(&row).unwrap() else {
            panic!("not an event");
        };
        assert_eq!(e.id.to_string(), id);
        assert_eq!((e.seq, e.topic.as_str()), (42, "order.created"));
        assert_eq!(e.key.as_deref(), Some("customer-1"));
        assert_eq!(e.payload.get(), r#"{"n": 1}"#);
        assert_eq!(e.header("n"), Some("2"));
        assert_eq!(e.created_at.timestamp_subsec_micros(), 123456);
        assert!(d.change(&insert(8, &[Some("1")])).unwrap().is_none());
        let published = insert(
            7,
            &[
                Some(id),
                Some("2026-12-02 09:15:01+00"),
                Some("2026-12-02 09:15:02+00"),
                Some("t"),
                Some("{}"),
                Some("0"),
                Some("43"),
                None,
                None,
            ],
        );
        assert!(
            d.change(&published).unwrap().is_none(),
            "a row inserted published is skipped"
        );
    }

    #[test]
    fn a_row_that_is_not_an_event_is_poison_and_a_short_message_an_error() {
        let mut d = Decoder::new(&OutboxTable::default_table());
        d.change(&relation(7, "public", "outbox", COLUMNS)).unwrap();
        let id = "0190e1d2-7a4b-7c3d-8e5f-0123456789ab";
        let row = insert(
            7,
            &[
                Some(id),
                Some("2026-12-02 09:15:01+00"),
                None,
                Some("t"),
                Some("{}"),
                Some("0"),
                Some("1"),
                None,
                Some("[1]"),
            ],
        );
        assert!(
            matches!(d.change(&row).unwrap(), Some(Decoded::Poison(_, r)) if r.contains("object"))
        );
        assert!(d.change(&insert(7, &[Some(id)])[..12]).is_err());
    }

    #[test]
    fn messages_of_this_table_are_events() {
        let d = Decoder::new(&OutboxTable::default_table());
        assert_eq!(d.prefix(), "pgoutbox:public.outbox");
        let content = br#"{"id":"0190e1d2-7a4b-7c3d-8e5f-0123456789ab","topic":"a","key":null,
            "payload":{"x":[1,2]},"headers":{},"created_at":"2026-12-02T09:15:01.5+00:00"}"#;
        let Some(Decoded::Event(e)) = d.message("pgoutbox:public.outbox", 99, content) else {
            panic!("not an event");
        };
        assert_eq!((e.seq, e.payload.get()), (99, r#"{"x":[1,2]}"#));
        assert!(d.message("pgoutbox:public.other", 1, content).is_none());
        assert!(matches!(
            d.message("pgoutbox:public.outbox", 1, b"hello"),
            Some(Decoded::Undecodable(_))
        ));
    }
}
