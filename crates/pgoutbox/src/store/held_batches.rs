//! `<table>_held_batches`: the held pairs of one batch for one destination that is down or
//! paused, written as one row instead of a row each, and turned back into pairs when it is back.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};

use super::Store;
use crate::error::{Error, Result};
use crate::model::event::OutboxEvent;
use crate::table::OutboxTable;

/// DeliveriesUnbundle. Turns up to `$1` held batches into deliveries rows, oldest first, each batch
/// once (`FOR UPDATE SKIP LOCKED`, then deleted in the same statement). Which batches: with `$2`
/// NULL, those of destinations that are neither paused nor open (their pairs are due now); with
/// `$2` a destination, that destination's, as held pairs (`$3`: at 'infinity', for its probe or
/// for `max_age`), only those holding an event older than `$4` seconds when `$4` is set.
/// `{name:held_batches_destination_idx}`, then primary keys. The events' field names are those
/// `settle::HeldBatch` writes. Returns batches and pairs moved.
const DELIVERIES_UNBUNDLE: &str = "
WITH h AS MATERIALIZED (
    SELECT coalesce(array_agg(name) FILTER (WHERE paused_at IS NOT NULL OR breaker <> 'closed'), '{}') AS held
    FROM {qname:destinations}
),
taken AS (
    DELETE FROM {qname:held_batches} AS b
    WHERE b.id IN (
        SELECT c.id FROM {qname:held_batches} c, h
        WHERE CASE WHEN $2::text IS NULL THEN NOT (c.destination = ANY(h.held))
                   ELSE c.destination = $2 END
          AND ($4::float8 IS NULL OR c.oldest < now() - make_interval(secs => $4))
        ORDER BY c.id
        LIMIT $1
        FOR UPDATE SKIP LOCKED)
    RETURNING b.destination, b.events
),
moved AS (
    INSERT INTO {qname:deliveries} (event_id, destination, seq, topic, key, payload, headers,
                                    created_at, attempts, next_attempt_at)
    SELECT (e->>'i')::uuid, t.destination, (e->>'s')::bigint, e->>'t', e->>'k', e->'p',
           coalesce(e->'h', '{}'::jsonb),
           'epoch'::timestamptz + ((e->>'c') || ' microseconds')::interval, 0,
           CASE WHEN $3 THEN 'infinity'::timestamptz ELSE now() END
    FROM taken t, jsonb_array_elements(convert_from(t.events, 'UTF8')::jsonb) AS e
    ON CONFLICT (event_id, destination) DO NOTHING
    RETURNING 1
)
SELECT (SELECT count(*) FROM taken) AS batches, (SELECT count(*) FROM moved) AS pairs";

/// The held batches' statements, rendered.
pub(super) struct Sql {
    unbundle: String,
}

impl Sql {
    pub(super) fn render(table: &OutboxTable) -> Self {
        Self {
            unbundle: table.render(DELIVERIES_UNBUNDLE),
        }
    }
}

/// A destination's held pairs of one batch, as one `<table>_held_batches` row.
#[derive(Debug, Clone, PartialEq)]
pub struct HeldBatch {
    /// The destination that is down or paused.
    pub destination: String,
    /// The oldest event's creation time (`max_age`).
    pub oldest: DateTime<Utc>,
    /// How many events.
    pub count: i32,
    /// Events per topic, as a JSON object (status, gauges).
    pub topics: String,
    /// The events, one JSON array (DeliveriesUnbundle reads it back).
    pub events: Vec<u8>,
}

impl HeldBatch {
    /// Encodes `events` held for `destination`.
    pub fn encode(destination: &str, events: &[&OutboxEvent]) -> Result<Self> {
        let mut topics: BTreeMap<&str, u64> = BTreeMap::new();
        let mut body = Vec::with_capacity(events.len() * 192);
        body.push(b'[');
        for (i, e) in events.iter().enumerate() {
            if i > 0 {
                body.push(b',');
            }
            *topics.entry(e.topic.as_str()).or_default() += 1;
            serde_json::to_writer(&mut body, &Held(e)).map_err(Error::Payload)?;
        }
        body.push(b']');
        Ok(Self {
            destination: destination.to_owned(),
            oldest: events
                .iter()
                .map(|e| e.created_at)
                .min()
                .unwrap_or_else(Utc::now),
            count: i32::try_from(events.len()).unwrap_or(i32::MAX),
            topics: serde_json::to_string(&topics).map_err(Error::Payload)?,
            events: body,
        })
    }
}

/// An event as a held batch stores it: the columns of a deliveries row, under one-letter names
/// (`i` id, `s` seq, `t` topic, `k` key, `p` payload, `h` headers, `c` created_at in microseconds
/// since the epoch), an absent key and empty headers left out: the batch is written on the settle
/// path of the other destinations, so every byte counts (DeliveriesUnbundle reads it back).
struct Held<'a>(&'a OutboxEvent);

impl serde::Serialize for Held<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let e = self.0;
        let mut m = s.serialize_map(None)?;
        m.serialize_entry("i", &e.id)?;
        m.serialize_entry("s", &e.seq)?;
        m.serialize_entry("t", &e.topic)?;
        if let Some(key) = &e.key {
            m.serialize_entry("k", key)?;
        }
        m.serialize_entry("p", &e.payload)?;
        if !e.headers.is_empty() {
            m.serialize_entry("h", &Headers(&e.headers))?;
        }
        m.serialize_entry("c", &e.created_at.timestamp_micros())?;
        m.end()
    }
}

/// Headers as the JSON object they came from.
struct Headers<'a>(&'a [(String, String)]);

impl serde::Serialize for Headers<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in self.0 {
            m.serialize_entry(k, v)?;
        }
        m.end()
    }
}

/// Which held batches one DeliveriesUnbundle takes.
#[derive(Debug, Clone, Copy)]
pub struct Unbundle<'a> {
    /// Most batches.
    pub limit: i64,
    /// `None`: those of every destination that is back (due now); `Some`: that destination's,
    /// still held.
    pub destination: Option<&'a str>,
    /// Only batches holding an event older than this.
    pub older_than: Option<Duration>,
}

/// DeliveriesUnbundle: held batches become deliveries rows; returns (batches, pairs) moved.
pub async fn unbundle(store: &Store, u: &Unbundle<'_>) -> Result<(i64, i64)> {
    Ok(sqlx::query_as(&store.sql.held_batches.unbundle)
        .bind(u.limit)
        .bind(u.destination)
        .bind(u.destination.is_some())
        .bind(u.older_than.map(|d| d.as_secs_f64()))
        .fetch_one(store.pool())
        .await?)
}
