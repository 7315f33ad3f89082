//! Status: what is pending, failing, dead and how far behind the relay is, per destination and topic.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;

use crate::error::Result;
use crate::route::Router;
use crate::table::OutboxTable;

/// OutboxStatus. One pass over the table grouped by (destination, topic), plus one over the
/// deliveries (the undelivered pairs of split events, each counted for its own destination) and
/// one over the partitioned history (`history = "partitions"`; empty otherwise). It reads
/// published history too (for the published counts), so it is an operator's query, not a
/// hot-path one.
const STATUS: &str = "
SELECT destination, topic,
  count(*) FILTER (WHERE published_at IS NULL AND dead_at IS NULL AND next_attempt_at <= now()) AS due,
  count(*) FILTER (WHERE published_at IS NULL AND dead_at IS NULL AND next_attempt_at > now()
                   AND next_attempt_at <> 'infinity' AND lease_token IS NULL) AS backoff,
  count(*) FILTER (WHERE published_at IS NULL AND dead_at IS NULL
                   AND next_attempt_at = 'infinity') AS held,
  count(*) FILTER (WHERE published_at IS NULL AND dead_at IS NULL AND next_attempt_at > now()
                   AND lease_token IS NOT NULL) AS in_flight,
  count(*) FILTER (WHERE published_at IS NULL AND dead_at IS NULL AND attempts > 0) AS failing,
  count(*) FILTER (WHERE dead_at IS NOT NULL) AS dead,
  extract(epoch FROM now() - min(created_at) FILTER (WHERE published_at IS NULL AND dead_at IS NULL))::float8
    AS oldest_pending_age_seconds,
  count(*) FILTER (WHERE published_at > now() - interval '1 minute') AS published_last_minute,
  count(*) FILTER (WHERE published_at > now() - interval '1 hour') AS published_last_hour,
  count(*) FILTER (WHERE published_at IS NOT NULL) AS published_retained
FROM {outbox}
GROUP BY destination, topic
UNION ALL
SELECT destination, topic,
  count(*) FILTER (WHERE dead_at IS NULL AND next_attempt_at <= now()),
  count(*) FILTER (WHERE dead_at IS NULL AND next_attempt_at > now()
                   AND next_attempt_at <> 'infinity' AND lease_token IS NULL),
  count(*) FILTER (WHERE dead_at IS NULL AND next_attempt_at = 'infinity'),
  count(*) FILTER (WHERE dead_at IS NULL AND next_attempt_at > now() AND lease_token IS NOT NULL),
  count(*) FILTER (WHERE dead_at IS NULL AND attempts > 0),
  count(*) FILTER (WHERE dead_at IS NOT NULL),
  extract(epoch FROM now() - min(created_at) FILTER (WHERE dead_at IS NULL))::float8,
  0, 0, 0
FROM {qname:deliveries}
GROUP BY destination, topic
UNION ALL
SELECT b.destination, t.topic, 0, 0, sum(t.n::bigint)::bigint, 0, 0, 0,
  extract(epoch FROM now() - min(b.oldest))::float8, 0, 0, 0
FROM {qname:held_batches} b, jsonb_each_text(b.topics) AS t(topic, n)
GROUP BY b.destination, t.topic
UNION ALL
SELECT destination, coalesce(topic, ''), 0, 0, 0, 0, 0, 0, NULL,
  count(*) FILTER (WHERE published_at > now() - interval '1 minute'),
  count(*) FILTER (WHERE published_at > now() - interval '1 hour'),
  count(*)
FROM {qname:history}
GROUP BY 1, 2";

/// One (destination, topic) line of the status.
#[derive(Debug, Clone, Default, Serialize, PartialEq, sqlx::FromRow)]
pub struct StatusRow {
    /// The destination: recorded by the relay, or from the configuration's routing; `null` if unknown.
    pub destination: Option<String>,
    /// The topic.
    pub topic: String,
    /// Pending events due now.
    pub due: i64,
    /// Pending events waiting for a retry.
    pub backoff: i64,
    /// Pending events held until their destination is back (paused, breaker open) or until a
    /// dead event ahead of them in their key is retried or discarded.
    pub held: i64,
    /// Events leased by a relay right now (lease mode).
    pub in_flight: i64,
    /// Pending events that have failed at least once.
    pub failing: i64,
    /// Dead-lettered events.
    pub dead: i64,
    /// Age of the oldest pending event: the lag.
    pub oldest_pending_age_seconds: Option<f64>,
    /// Events published in the last minute (still retained).
    pub published_last_minute: i64,
    /// Events published in the last hour (still retained).
    pub published_last_hour: i64,
    /// Published events still in the table (delete mode keeps none).
    pub published_retained: i64,
}

/// The whole status.
#[derive(Debug, Clone, Serialize)]
pub struct Status {
    /// The table looked at.
    pub table: String,
    /// When it was read.
    pub generated_at: DateTime<Utc>,
    /// Sums over every row.
    pub totals: StatusRow,
    /// Per destination and topic.
    pub rows: Vec<StatusRow>,
    /// Each destination's shared state: paused, circuit breaker.
    pub destinations: Vec<crate::store::destinations::DestinationState>,
}

/// Reads the status; with a router, rows not yet tried (and fanned-out rows) are counted for each
/// destination whose topics match. The totals count each row and each pair once.
pub async fn read(
    pool: &PgPool,
    table: &OutboxTable,
    routing: Option<(&Router, &[String])>,
) -> Result<Status> {
    let raw: Vec<StatusRow> = sqlx::query_as(&table.render(STATUS))
        .fetch_all(pool)
        .await?;
    let mut totals = StatusRow {
        topic: "*".into(),
        ..StatusRow::default()
    };
    for row in &raw {
        add(&mut totals, row);
    }
    let raw = match routing {
        None => raw,
        Some((router, names)) => raw
            .into_iter()
            .flat_map(|row| {
                let targets: Vec<String> = match row.destination {
                    Some(_) => Vec::new(),
                    None => router
                        .by_topic(&row.topic)
                        .into_iter()
                        .filter_map(|i| names.get(i).cloned())
                        .collect(),
                };
                if targets.is_empty() {
                    return vec![row];
                }
                targets
                    .into_iter()
                    .map(|d| StatusRow {
                        destination: Some(d),
                        ..row.clone()
                    })
                    .collect()
            })
            .collect(),
    };
    // Merge rows that routing made identical.
    let mut rows: Vec<StatusRow> = Vec::with_capacity(raw.len());
    for row in raw {
        match rows
            .iter_mut()
            .find(|r| r.destination == row.destination && r.topic == row.topic)
        {
            Some(existing) => add(existing, &row),
            None => rows.push(row),
        }
    }
    rows.sort_by(|a, b| (&a.destination, &a.topic).cmp(&(&b.destination, &b.topic)));
    Ok(Status {
        table: table.to_string(),
        generated_at: Utc::now(),
        totals,
        rows,
        destinations: crate::store::destinations::read(&crate::store::Store::new(
            pool.clone(),
            table.clone(),
        ))
        .await?,
    })
}

fn add(into: &mut StatusRow, row: &StatusRow) {
    into.due += row.due;
    into.backoff += row.backoff;
    into.held += row.held;
    into.in_flight += row.in_flight;
    into.failing += row.failing;
    into.dead += row.dead;
    into.published_last_minute += row.published_last_minute;
    into.published_last_hour += row.published_last_hour;
    into.published_retained += row.published_retained;
    into.oldest_pending_age_seconds = match (
        into.oldest_pending_age_seconds,
        row.oldest_pending_age_seconds,
    ) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    };
}
