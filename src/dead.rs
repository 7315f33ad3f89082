//! Dead letters: listing, inspecting, redriving and discarding events the relay gave up on.
//!
//! A dead event stays in the outbox table with `dead_at` set, its payload, headers, attempts, last
//! error and destination intact. It is outside the pending index, so it never blocks or slows the
//! claim of other events.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;
use uuid::Uuid;

use crate::error::Result;
use crate::table::OutboxTable;

/// A dead event as listed.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct DeadEvent {
    /// Event id.
    pub id: Uuid,
    /// Insert order.
    pub seq: i64,
    /// Topic.
    pub topic: String,
    /// Key.
    pub key: Option<String>,
    /// The destination that gave up (none for an unroutable event).
    pub destination: Option<String>,
    /// Attempts made.
    pub attempts: i32,
    /// The last error.
    pub last_error: Option<String>,
    /// When it was written.
    pub created_at: DateTime<Utc>,
    /// When it was dead-lettered.
    pub dead_at: DateTime<Utc>,
    /// Payload (only filled by `show`).
    #[sqlx(default)]
    pub payload: Option<serde_json::Value>,
    /// Headers (only filled by `show`).
    #[sqlx(default)]
    pub headers: Option<serde_json::Value>,
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

/// The shared WHERE clause of every dead-letter statement; uses `{name:dead_idx}`.
const DEAD_WHERE: &str = "dead_at IS NOT NULL
  AND ($1::uuid[] IS NULL OR id = ANY($1))
  AND ($2::text IS NULL OR topic = $2)
  AND ($3::text IS NULL OR destination = $3)
  AND ($4::float8 IS NULL OR dead_at > now() - make_interval(secs => $4))";

fn bind_filter<'q, O>(
    q: sqlx::query::QueryAs<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments>,
    f: &'q DeadFilter,
) -> sqlx::query::QueryAs<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments> {
    q.bind(f.ids.as_deref())
        .bind(f.topic.as_deref())
        .bind(f.destination.as_deref())
        .bind(f.since.map(|d| d.as_secs_f64()))
}

/// DeadList: newest first, at most `limit`.
pub async fn list(
    pool: &PgPool,
    table: &OutboxTable,
    filter: &DeadFilter,
    limit: i64,
) -> Result<Vec<DeadEvent>> {
    let sql = table.render(&format!(
        "SELECT id, seq, topic, key, destination, attempts, last_error, created_at, dead_at
         FROM {{outbox}} WHERE {DEAD_WHERE} ORDER BY dead_at DESC, seq DESC LIMIT $5"
    ));
    Ok(bind_filter(sqlx::query_as(&sql), filter)
        .bind(limit)
        .fetch_all(pool)
        .await?)
}

/// DeadShow: one dead event with its payload and headers.
pub async fn show(pool: &PgPool, table: &OutboxTable, id: Uuid) -> Result<Option<DeadEvent>> {
    let sql = table.render(
        "SELECT id, seq, topic, key, destination, attempts, last_error, created_at, dead_at, payload, headers
         FROM {outbox} WHERE id = $1 AND dead_at IS NOT NULL",
    );
    Ok(sqlx::query_as(&sql).bind(id).fetch_optional(pool).await?)
}

/// DeadRetry: puts matching dead events back as due now with attempts reset (last error kept).
/// With `dry_run`, only counts them. Returns the number of events.
pub async fn retry(
    pool: &PgPool,
    table: &OutboxTable,
    filter: &DeadFilter,
    dry_run: bool,
) -> Result<u64> {
    let statement = "UPDATE {outbox} SET dead_at = NULL, attempts = 0, next_attempt_at = now(), lease_token = NULL";
    apply(pool, table, filter, dry_run, statement).await
}

/// DeadDiscard: deletes matching dead events for good. With `dry_run`, only counts them.
pub async fn discard(
    pool: &PgPool,
    table: &OutboxTable,
    filter: &DeadFilter,
    dry_run: bool,
) -> Result<u64> {
    apply(pool, table, filter, dry_run, "DELETE FROM {outbox}").await
}

/// Runs `statement` (an UPDATE or DELETE head) on the dead events `filter` matches.
async fn apply(
    pool: &PgPool,
    table: &OutboxTable,
    filter: &DeadFilter,
    dry_run: bool,
    statement: &str,
) -> Result<u64> {
    if dry_run {
        return count(pool, table, filter).await;
    }
    let sql = table.render(&format!("{statement} WHERE {DEAD_WHERE} RETURNING 1"));
    let rows: Vec<(i32,)> = bind_filter(sqlx::query_as(&sql), filter)
        .fetch_all(pool)
        .await?;
    // Ordered keys: rows parked behind these dead events are due again (retry: behind them).
    crate::settle::unpark_followers(table, pool).await?;
    Ok(rows.len() as u64)
}

/// Counts matching dead events.
pub async fn count(pool: &PgPool, table: &OutboxTable, filter: &DeadFilter) -> Result<u64> {
    let sql = table.render(&format!(
        "SELECT count(*) FROM {{outbox}} WHERE {DEAD_WHERE}"
    ));
    let (n,): (i64,) = bind_filter(sqlx::query_as(&sql), filter)
        .fetch_one(pool)
        .await?;
    Ok(n as u64)
}
