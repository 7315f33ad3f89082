//! The backlog: pending, held, in-flight, failing and dead events per (destination, topic), read
//! from the pending and dead indexes only, for the gauges and the console's overview. Which
//! destination an untried row counts for is the routing's, the caller's ([`crate::observe`]).

use super::Store;
use crate::error::Result;
use crate::table::OutboxTable;

/// ObserveBacklog. Reads only pending rows (the claim index) and dead rows (the dead index):
/// cheap whatever the published history. Two parts, each with the WHERE of one partial index, so
/// that each is served by it: the pending part by `{name:pending_idx}` (its predicate is exactly
/// that part's WHERE), the dead part by `{name:dead_idx}`; a single `WHERE published_at IS NULL`
/// matches neither and reads the whole table. A (destination, topic) may come back from both
/// parts: the caller merges them. Untried rows have no destination yet; routing names them (each
/// destination whose topics match counts them). The deliveries part (undelivered pairs of split
/// events, a table as small as the current failures) is read whole.
const BACKLOG: &str = "
SELECT destination, topic,
  count(*) FILTER (WHERE next_attempt_at <= now()) AS due,
  count(*) FILTER (WHERE next_attempt_at > now()) AS backoff,
  count(*) FILTER (WHERE next_attempt_at = 'infinity') AS held,
  count(*) FILTER (WHERE lease_token IS NOT NULL AND next_attempt_at > now()
                   AND next_attempt_at <> 'infinity') AS in_flight,
  count(*) FILTER (WHERE attempts > 0) AS failing,
  0::bigint AS dead,
  coalesce(extract(epoch FROM now() - min(created_at)), 0)::float8 AS lag
FROM {outbox}
WHERE published_at IS NULL AND dead_at IS NULL
GROUP BY destination, topic
UNION ALL
SELECT destination, topic, 0, 0, 0, 0, 0, count(*), 0
FROM {outbox}
WHERE dead_at IS NOT NULL AND published_at IS NULL
GROUP BY destination, topic
UNION ALL
SELECT destination, topic,
  count(*) FILTER (WHERE dead_at IS NULL AND next_attempt_at <= now()),
  count(*) FILTER (WHERE dead_at IS NULL AND next_attempt_at > now()),
  count(*) FILTER (WHERE dead_at IS NULL AND next_attempt_at = 'infinity'),
  count(*) FILTER (WHERE dead_at IS NULL AND lease_token IS NOT NULL AND next_attempt_at > now()
                   AND next_attempt_at <> 'infinity'),
  count(*) FILTER (WHERE dead_at IS NULL AND attempts > 0),
  count(*) FILTER (WHERE dead_at IS NOT NULL),
  coalesce(extract(epoch FROM now() - min(created_at) FILTER (WHERE dead_at IS NULL)), 0)::float8
FROM {qname:deliveries}
GROUP BY destination, topic
UNION ALL
SELECT b.destination, t.topic, 0, sum(t.n::bigint)::bigint, sum(t.n::bigint)::bigint, 0, 0, 0,
  coalesce(extract(epoch FROM now() - min(b.oldest)), 0)::float8
FROM {qname:held_batches} b, jsonb_each_text(b.topics) AS t(topic, n)
GROUP BY b.destination, t.topic";

/// OldestDue. How long the longest-waiting due event has been due: the first entry of the pending
/// index in due order, and of the deliveries' pairs (a table as small as the current failures).
/// Held rows wait at 'infinity' and leased ones until their lease ends: neither is due.
const OLDEST_DUE: &str = "
SELECT extract(epoch FROM now() - min(due))::float8 FROM (
  (SELECT next_attempt_at AS due FROM {outbox}
    WHERE published_at IS NULL AND dead_at IS NULL AND next_attempt_at <= now()
    ORDER BY next_attempt_at LIMIT 1)
  UNION ALL
  (SELECT next_attempt_at FROM {qname:deliveries}
    WHERE dead_at IS NULL AND next_attempt_at <= now()
    ORDER BY next_attempt_at LIMIT 1)) AS d";

/// This module's statements, rendered.
pub(super) struct Sql {
    backlog: String,
    oldest_due: String,
}

impl Sql {
    pub(super) fn render(table: &OutboxTable) -> Self {
        Self {
            backlog: table.render(BACKLOG),
            oldest_due: table.render(OLDEST_DUE),
        }
    }
}

/// OldestDue: seconds the longest-waiting due event (row or pair) has been due; `None` when none is.
pub async fn oldest_due_seconds(store: &Store) -> Result<Option<f64>> {
    Ok(sqlx::query_scalar(&store.sql.backlog.oldest_due)
        .fetch_one(store.pool())
        .await?)
}

/// One (destination, topic)'s backlog, as the gauges and the console show it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Backlog {
    /// Pending events due now.
    pub due: i64,
    /// Pending events not due yet (retry backoff, leased, or held for their destination).
    pub backoff: i64,
    /// Of those, held: their destination is paused or down, or a dead event of their key blocks.
    pub held: i64,
    /// Of those, leased by a relay right now (lease mode).
    pub in_flight: i64,
    /// Pending events that failed at least once.
    pub failing: i64,
    /// Dead-lettered events.
    pub dead: i64,
    /// Age of the oldest pending event, in seconds (0 when none).
    pub lag: f64,
}

impl std::ops::AddAssign for Backlog {
    /// Counts summed; the lag is the oldest of the two.
    fn add_assign(&mut self, b: Self) {
        self.due += b.due;
        self.backoff += b.backoff;
        self.held += b.held;
        self.in_flight += b.in_flight;
        self.failing += b.failing;
        self.dead += b.dead;
        self.lag = self.lag.max(b.lag);
    }
}

/// One row of ObserveBacklog: a (destination, topic) from one of its parts.
#[derive(Debug, Clone, PartialEq)]
pub struct BacklogRow {
    /// The destination; `None` for rows not yet routed.
    pub destination: Option<String>,
    /// The topic (`None`: rows without one).
    pub topic: Option<String>,
    /// The counts.
    pub backlog: Backlog,
}

/// ObserveBacklog: the rows of every part, unmerged.
pub async fn rows(store: &Store) -> Result<Vec<BacklogRow>> {
    type Row = (
        Option<String>,
        Option<String>,
        i64,
        i64,
        i64,
        i64,
        i64,
        i64,
        f64,
    );
    let rows = sqlx::query_as::<_, Row>(&store.sql.backlog.backlog)
        .fetch_all(store.pool())
        .await?;
    Ok(rows
        .into_iter()
        .map(
            |(destination, topic, due, backoff, held, in_flight, failing, dead, lag)| BacklogRow {
                destination,
                topic,
                backlog: Backlog {
                    due,
                    backoff,
                    held,
                    in_flight,
                    failing,
                    dead,
                    lag,
                },
            },
        )
        .collect())
}
