//! The status's statements: the outbox's counts per (destination, topic) (`pgoutbox status`, the
//! console's status view) and the newest failures (`status --watch`). Merging the counts with the
//! routing, which names the destination of rows not yet tried, is the caller's
//! ([`crate::status`]).

use chrono::{DateTime, Utc};
use serde::Serialize;

use super::Store;
use crate::error::Result;
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
SELECT destination, topic, 0, 0, 0, 0, 0, 0, NULL,
  count(*) FILTER (WHERE published_at > now() - interval '1 minute'),
  count(*) FILTER (WHERE published_at > now() - interval '1 hour'),
  count(*)
FROM {qname:history}
GROUP BY 1, 2";

/// RecentErrors. Newest failures first: backing-off rows by due time (a backwards scan of the
/// pending index), dead rows by dead_at (the dead index).
const RECENT_ERRORS: &str = "
(SELECT coalesce(destination, '-'), topic, last_error, 'retrying' AS state, next_attempt_at AS at
   FROM {outbox} WHERE published_at IS NULL AND dead_at IS NULL AND attempts > 0
   ORDER BY next_attempt_at DESC LIMIT 5)
UNION ALL
(SELECT coalesce(destination, '-'), topic, last_error, 'dead', dead_at
   FROM {outbox} WHERE dead_at IS NOT NULL ORDER BY dead_at DESC LIMIT 5)
ORDER BY at DESC LIMIT 5";

/// This module's statements, rendered.
pub(super) struct Sql {
    status: String,
    recent_errors: String,
}

impl Sql {
    pub(super) fn render(table: &OutboxTable) -> Self {
        Self {
            status: table.render(STATUS),
            recent_errors: table.render(RECENT_ERRORS),
        }
    }
}

/// One (destination, topic) line of the status.
#[derive(Debug, Clone, Default, Serialize, PartialEq, sqlx::FromRow)]
pub struct StatusRow {
    /// The destination: recorded by the relay, or from the configuration's routing; `null` if unknown.
    pub destination: Option<String>,
    /// The topic (`None`: rows without one; `*` in the totals).
    pub topic: Option<String>,
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

impl std::ops::AddAssign<&StatusRow> for StatusRow {
    /// Counts summed; the lag is the oldest of the two.
    fn add_assign(&mut self, row: &StatusRow) {
        self.due += row.due;
        self.backoff += row.backoff;
        self.held += row.held;
        self.in_flight += row.in_flight;
        self.failing += row.failing;
        self.dead += row.dead;
        self.published_last_minute += row.published_last_minute;
        self.published_last_hour += row.published_last_hour;
        self.published_retained += row.published_retained;
        self.oldest_pending_age_seconds = match (
            self.oldest_pending_age_seconds,
            row.oldest_pending_age_seconds,
        ) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
    }
}

/// OutboxStatus: the counts as recorded, one row per (destination, topic) and part of the
/// statement (the caller merges them).
pub async fn rows(store: &Store) -> Result<Vec<StatusRow>> {
    Ok(sqlx::query_as(&store.sql.status.status)
        .fetch_all(store.pool())
        .await?)
}

/// One recent failure.
#[derive(Debug, Clone, PartialEq)]
pub struct RecentError {
    /// The destination (`-` when the row was never routed).
    pub destination: String,
    /// The topic (`None`: the row has none).
    pub topic: Option<String>,
    /// The error.
    pub error: Option<String>,
    /// `retrying` or `dead`.
    pub state: String,
    /// When it is retried, or when it was dead-lettered.
    pub at: DateTime<Utc>,
}

/// RecentErrors: the five newest failures, newest first.
pub async fn recent_errors(store: &Store) -> Result<Vec<RecentError>> {
    type Row = (
        String,
        Option<String>,
        Option<String>,
        String,
        DateTime<Utc>,
    );
    let rows: Vec<Row> = sqlx::query_as(&store.sql.status.recent_errors)
        .fetch_all(store.pool())
        .await?;
    Ok(rows
        .into_iter()
        .map(|(destination, topic, error, state, at)| RecentError {
            destination,
            topic,
            error,
            state,
            at,
        })
        .collect())
}
