//! Dead letters: listing, inspecting, redriving and discarding events the relay gave up on.
//!
//! A dead event stays in the outbox table with `dead_at` set, its payload, headers, attempts, last
//! error and destination intact. It is outside the pending index, so it never blocks or slows the
//! claim of other events. A dead *pair* of a split event (one destination of several gave up) is
//! its row in the deliveries table, with the same columns; every operation here covers both, and
//! `--destination` picks one destination's.
//!
//! Every statement here is rendered once per table (`Sql`); the filter's values are bound
//! (`$1..$4`, see `DEAD_WHERE`), so none is assembled per call.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use uuid::Uuid;

use super::Store;
use crate::error::Result;
use crate::model::event::StoredJson;
use crate::table::OutboxTable;

/// A dead event as listed.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct DeadEvent {
    /// Event id.
    pub id: Uuid,
    /// Insert order.
    pub seq: i64,
    /// Topic (`None`: the row has none).
    pub topic: Option<String>,
    /// Key.
    pub key: Option<String>,
    /// The destination that gave up (none for an unroutable event).
    pub destination: Option<String>,
    /// Attempts made.
    pub attempts: i32,
    /// The last error.
    pub last_error: Option<String>,
    /// When it was written (`None`: the row has no time).
    pub created_at: Option<DateTime<Utc>>,
    /// When it was dead-lettered.
    pub dead_at: DateTime<Utc>,
    /// Payload, any depth (only filled by `show`).
    #[sqlx(default)]
    pub payload: Option<StoredJson>,
    /// Headers (only filled by `show`).
    #[sqlx(default)]
    pub headers: Option<StoredJson>,
}

/// Which dead events an operation applies to.
#[derive(Debug, Clone, Default)]
pub struct DeadFilter {
    /// Only these ids (`None`: all, further narrowed by the other fields).
    pub ids: Option<Vec<Uuid>>,
    /// Only this topic.
    pub topic: Option<String>,
    /// Only this destination.
    pub destination: Option<String>,
    /// Only events dead-lettered within this long.
    pub since: Option<Duration>,
}

impl DeadFilter {
    /// The filter as the audit log records it: only the fields given.
    pub fn to_json(&self) -> serde_json::Value {
        let mut o = serde_json::Map::new();
        if let Some(ids) = &self.ids {
            o.insert("ids".into(), serde_json::json!(ids));
        }
        if let Some(topic) = &self.topic {
            o.insert("topic".into(), topic.clone().into());
        }
        if let Some(destination) = &self.destination {
            o.insert("destination".into(), destination.clone().into());
        }
        if let Some(since) = self.since {
            o.insert("since_seconds".into(), since.as_secs_f64().into());
        }
        serde_json::Value::Object(o)
    }
}

/// The shared WHERE clause of every dead-letter statement; `{id}` is the event id column. Uses
/// `{name:dead_idx}` on the outbox, `{name:deliveries_dead_idx}` on the deliveries.
const DEAD_WHERE: &str = "dead_at IS NOT NULL
  AND ($1::uuid[] IS NULL OR {id} = ANY($1))
  AND ($2::text IS NULL OR topic = $2)
  AND ($3::text IS NULL OR destination = $3)
  AND ($4::float8 IS NULL OR dead_at > now() - make_interval(secs => $4))";

/// The WHERE clause for the outbox table (dead event rows).
fn rows_where() -> String {
    DEAD_WHERE.replace("{id}", "id")
}

/// The WHERE clause for the deliveries table (dead pairs of split events).
fn pairs_where() -> String {
    DEAD_WHERE.replace("{id}", "event_id")
}

/// DeadList. Dead rows (`{name:dead_idx}`) and dead pairs (`{name:deliveries_dead_idx}`), newest
/// first, at most `$5`. Reads only: no locks beyond a snapshot.
fn dead_list() -> String {
    format!(
        "SELECT id, seq, topic, key, destination, attempts, last_error, created_at, dead_at
         FROM {{outbox}} WHERE {rows}
         UNION ALL
         SELECT event_id, seq, topic, key, destination, attempts, last_error, created_at, dead_at
         FROM {{qname:deliveries}} WHERE {pairs}
         ORDER BY dead_at DESC, seq DESC, destination DESC LIMIT $5",
        rows = rows_where(),
        pairs = pairs_where()
    )
}

/// DeadShow. One event's dead row (primary key) and dead pairs (the deliveries'
/// `(event_id, destination)` key), with payload and headers.
const DEAD_SHOW: &str =
    "SELECT id, seq, topic, key, destination, attempts, last_error, created_at, dead_at,
           payload::text AS payload, headers::text AS headers
         FROM {outbox} WHERE id = $1 AND dead_at IS NOT NULL
         UNION ALL
         SELECT event_id, seq, topic, key, destination, attempts, last_error, created_at, dead_at,
           payload::text AS payload, headers::text AS headers
         FROM {qname:deliveries} WHERE event_id = $1 AND dead_at IS NOT NULL
         ORDER BY destination";

/// DeadCount. Index-only counts over the two dead indexes.
fn dead_count() -> String {
    format!(
        "SELECT (SELECT count(*) FROM {{outbox}} WHERE {rows})
              + (SELECT count(*) FROM {{qname:deliveries}} WHERE {pairs})",
        rows = rows_where(),
        pairs = pairs_where()
    )
}

/// DeadRetry's SET: due now, attempts reset, lease dropped (the last error is kept).
const RETRY_RESET: &str =
    "SET dead_at = NULL, attempts = 0, next_attempt_at = now(), lease_token = NULL";

/// DeadRetry and DeadDiscard: `head` (an UPDATE or DELETE of one table) on the dead rows the
/// filter matches, found by the dead index; each matched row is row-locked until the commit.
fn apply_statement(head: &str, where_clause: &str) -> String {
    format!("{head} WHERE {where_clause} RETURNING 1")
}

/// This module's statements, rendered.
pub(super) struct Sql {
    list: String,
    show: String,
    count: String,
    /// DeadRetry: the outbox's rows, then the deliveries' pairs.
    retry: [String; 2],
    /// DeadDiscard: the same.
    discard: [String; 2],
}

impl Sql {
    pub(super) fn render(table: &OutboxTable) -> Self {
        let both = |rows: String, pairs: String| {
            [
                table.render(&apply_statement(&rows, &rows_where())),
                table.render(&apply_statement(&pairs, &pairs_where())),
            ]
        };
        Self {
            list: table.render(&dead_list()),
            show: table.render(DEAD_SHOW),
            count: table.render(&dead_count()),
            retry: both(
                format!("UPDATE {{outbox}} {RETRY_RESET}"),
                format!("UPDATE {{qname:deliveries}} {RETRY_RESET}"),
            ),
            discard: both(
                "DELETE FROM {outbox}".to_owned(),
                "DELETE FROM {qname:deliveries}".to_owned(),
            ),
        }
    }
}

fn bind_filter<'q, O>(
    q: sqlx::query::QueryAs<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments>,
    f: &'q DeadFilter,
) -> sqlx::query::QueryAs<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments> {
    q.bind(f.ids.as_deref())
        .bind(f.topic.as_deref())
        .bind(f.destination.as_deref())
        .bind(f.since.map(|d| d.as_secs_f64()))
}

/// DeadList: dead event rows and dead pairs (one per event and destination), newest first, at most
/// `limit`.
pub async fn list(store: &Store, filter: &DeadFilter, limit: i64) -> Result<Vec<DeadEvent>> {
    Ok(bind_filter(sqlx::query_as(&store.sql.dead.list), filter)
        .bind(limit)
        .fetch_all(store.pool())
        .await?)
}

/// DeadShow: one dead event with its payload and headers: its row, or each of its dead pairs.
pub async fn show(store: &Store, id: Uuid) -> Result<Vec<DeadEvent>> {
    Ok(sqlx::query_as(&store.sql.dead.show)
        .bind(id)
        .fetch_all(store.pool())
        .await?)
}

/// DeadRetry: puts matching dead events (rows and pairs) back as due now with attempts reset (last
/// error kept). With `dry_run`, only counts them. Returns the number of events.
pub async fn retry(store: &Store, filter: &DeadFilter, dry_run: bool) -> Result<u64> {
    apply(store, filter, dry_run, &store.sql.dead.retry).await
}

/// DeadDiscard: deletes matching dead events (rows and pairs) for good. With `dry_run`, only
/// counts them.
pub async fn discard(store: &Store, filter: &DeadFilter, dry_run: bool) -> Result<u64> {
    apply(store, filter, dry_run, &store.sql.dead.discard).await
}

/// Runs `statements` (the outbox's, then the deliveries') on the dead events `filter` matches, in
/// one transaction.
async fn apply(
    store: &Store,
    filter: &DeadFilter,
    dry_run: bool,
    statements: &[String; 2],
) -> Result<u64> {
    if dry_run {
        return count(store, filter).await;
    }
    let mut tx = store.pool().begin().await?;
    let mut n = 0;
    for sql in statements {
        let done: Vec<(i32,)> = bind_filter(sqlx::query_as(sql), filter)
            .fetch_all(&mut *tx)
            .await?;
        n += done.len() as u64;
    }
    tx.commit().await?;
    // Ordered keys: rows parked behind these dead events are due again (retry: behind them).
    crate::store::held::unpark_followers(store).await?;
    Ok(n)
}

/// DeadCount: counts matching dead events (rows and pairs).
pub async fn count(store: &Store, filter: &DeadFilter) -> Result<u64> {
    let (n,): (i64,) = bind_filter(sqlx::query_as(&store.sql.dead.count), filter)
        .fetch_one(store.pool())
        .await?;
    Ok(n as u64)
}
