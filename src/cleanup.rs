//! Cleanup: deleting published rows older than `retention` (and dead rows older than
//! `dead_retention`, when set), in short bounded batches.
//!
//! The walk follows the `seq` index in chunks; each chunk is one autocommit DELETE, so no
//! transaction or lock lasts longer than one chunk. Pending rows are never deleted, whatever their
//! age, and dead rows only under their own retention. Inside the relay, a session advisory lock
//! makes sure one instance at a time does it; it is held by a connection that is closed, never
//! pooled again, when the run ends in any way.

use std::time::{Duration, Instant};

use sqlx::PgPool;
use tracing::debug;

use crate::config::Config;
use crate::error::Result;
use crate::table::OutboxTable;

/// Advisory lock key of the cleanup leader (one per database; cleanup is cheap to serialize).
const CLEANUP_LOCK_KEY: i64 = 0x7067_6f62_636c_6e75;

/// What to delete and how.
#[derive(Debug, Clone)]
pub struct CleanupOptions {
    /// Published rows older than this are deleted.
    pub retention: Duration,
    /// Dead rows older than this are deleted; `None` keeps them.
    pub dead_retention: Option<Duration>,
    /// Rows looked at per chunk (each chunk is one short statement).
    pub chunk_rows: i64,
    /// Count instead of deleting.
    pub dry_run: bool,
}

impl CleanupOptions {
    /// The configuration's retention settings.
    pub fn from_config(config: &Config) -> Self {
        Self {
            retention: config.retention,
            dead_retention: config.dead_retention,
            chunk_rows: 5_000,
            dry_run: false,
        }
    }
}

/// What a cleanup run did (or would do, on a dry run).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct CleanupReport {
    /// Published rows deleted.
    pub deleted_published: u64,
    /// Dead rows deleted.
    pub deleted_dead: u64,
    /// Chunks (statements) run.
    pub batches: u64,
    /// The longest chunk: the longest any cleanup transaction lasted.
    pub longest_batch: Duration,
}

impl CleanupReport {
    /// Rows deleted in all.
    pub fn deleted(&self) -> u64 {
        self.deleted_published + self.deleted_dead
    }
}

/// OutboxCleanupChunk. Index scan of `{name:seq_idx}` for the next chunk's upper bound; the
/// creation time of its oldest row tells the walk when it has passed the retention horizon.
const CHUNK_END: &str = "
SELECT max(seq), min(created_at) < now() - make_interval(secs => $3)
FROM (SELECT seq, created_at FROM {outbox} WHERE seq > $1 ORDER BY seq LIMIT $2) chunk";

/// OutboxDeleteExpiredRange. Range scan of `{name:seq_idx}`; deletes published rows past retention
/// and, when `$4` is set, dead rows past dead retention. Pending rows are never matched.
const DELETE_RANGE: &str = "
DELETE FROM {outbox}
WHERE seq > $1 AND seq <= $2
  AND (published_at < now() - make_interval(secs => $3)
       OR ($4::float8 IS NOT NULL AND dead_at < now() - make_interval(secs => $4)))
RETURNING published_at IS NOT NULL";

/// OutboxCountExpiredRange. The dry-run twin of OutboxDeleteExpiredRange.
const COUNT_RANGE: &str = "
SELECT published_at IS NOT NULL
FROM {outbox}
WHERE seq > $1 AND seq <= $2
  AND (published_at < now() - make_interval(secs => $3)
       OR ($4::float8 IS NOT NULL AND dead_at < now() - make_interval(secs => $4)))";

/// Runs cleanup unless another instance holds the cleanup lock; `None` when it was skipped.
pub async fn run_if_leader(
    pool: &PgPool,
    table: &OutboxTable,
    options: &CleanupOptions,
) -> Result<Option<CleanupReport>> {
    let mut conn = pool.acquire().await?;
    // The lock is the session's, so the session ends with the run: this connection never goes
    // back to the pool (where it would keep the lock and leave every relay a follower), whether
    // the run ends, fails, or is dropped mid-way (the relay aborts cleanup at shutdown). Marked
    // before asking for the lock, as a future dropped while the answer is on its way would
    // otherwise return it to the pool holding it. The price is one new connection per interval.
    conn.close_on_drop();
    let leader: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
        .bind(CLEANUP_LOCK_KEY)
        .fetch_one(&mut *conn)
        .await?;
    if !leader {
        return Ok(None);
    }
    let report = run(pool, table, options, |_| {}).await?;
    // Closing ends the session and so releases the lock; no separate unlock to forget.
    conn.close().await?;
    Ok(Some(report))
}

/// Runs cleanup now; `progress` is called after every chunk with the running totals.
pub async fn run(
    pool: &PgPool,
    table: &OutboxTable,
    options: &CleanupOptions,
    mut progress: impl FnMut(&CleanupReport),
) -> Result<CleanupReport> {
    let chunk_end = table.render(CHUNK_END);
    let statement = table.render(if options.dry_run {
        COUNT_RANGE
    } else {
        DELETE_RANGE
    });
    let retention = options.retention.as_secs_f64();
    let dead_retention = options.dead_retention.map(|d| d.as_secs_f64());
    // The horizon: nothing created after the older of the two cutoffs can be due for deletion.
    let horizon = dead_retention.map_or(retention, |d| d.min(retention));

    let mut report = CleanupReport::default();
    let mut cursor: i64 = i64::MIN;
    loop {
        let (end, before_horizon): (Option<i64>, Option<bool>) = sqlx::query_as(&chunk_end)
            .bind(cursor)
            .bind(options.chunk_rows)
            .bind(horizon)
            .fetch_one(pool)
            .await?;
        let Some(end) = end else { break };
        let started = Instant::now();
        let flags: Vec<bool> = sqlx::query_scalar(&statement)
            .bind(cursor)
            .bind(end)
            .bind(retention)
            .bind(dead_retention)
            .fetch_all(pool)
            .await?;
        let elapsed = started.elapsed();
        let published = flags.iter().filter(|p| **p).count() as u64;
        report.deleted_published += published;
        report.deleted_dead += flags.len() as u64 - published;
        report.batches += 1;
        report.longest_batch = report.longest_batch.max(elapsed);
        debug!(
            rows = flags.len(),
            elapsed_ms = elapsed.as_millis() as u64,
            "cleanup chunk"
        );
        progress(&report);
        cursor = end;
        if before_horizon != Some(true) {
            // Even this chunk's oldest row is younger than retention: so is everything after it.
            break;
        }
    }
    if let Some(dead_retention) = dead_retention {
        // Dead pairs of split events: a table as small as the current failures, one statement.
        let statement = table.render(if options.dry_run {
            COUNT_DEAD_DELIVERIES
        } else {
            DELETE_DEAD_DELIVERIES
        });
        let (deleted,): (i64,) = sqlx::query_as(&statement)
            .bind(dead_retention)
            .fetch_one(pool)
            .await?;
        report.deleted_dead += deleted as u64;
        if deleted > 0 {
            progress(&report);
        }
    }
    Ok(report)
}

/// CleanupDeadDeliveries. Dead pairs past dead retention (`{name:deliveries_dead_idx}`).
const DELETE_DEAD_DELIVERIES: &str = "
WITH gone AS (
    DELETE FROM {qname:deliveries}
    WHERE dead_at < now() - make_interval(secs => $1)
    RETURNING 1)
SELECT count(*) FROM gone";

/// See DELETE_DEAD_DELIVERIES (dry run).
const COUNT_DEAD_DELIVERIES: &str = "
SELECT count(*) FROM {qname:deliveries} WHERE dead_at < now() - make_interval(secs => $1)";
