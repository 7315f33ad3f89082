//! Cleanup: deleting published rows older than `retention` (and dead rows older than
//! `dead_retention`, when set), in short bounded batches, and dropping the partitions of the
//! published history that are past `retention` ([`super::history`]).
//!
//! The walk follows the index of published rows (and the dead-letter index) oldest first, in
//! chunks; each chunk is one autocommit DELETE, so no transaction or lock lasts longer than one
//! chunk. Pending rows are never deleted, whatever their
//! age, and dead rows only under their own retention. Inside the relay, a session advisory lock
//! makes sure one instance at a time does it; it is held by a connection that is closed, never
//! pooled again, when the run ends in any way.

use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use tracing::debug;

use super::Store;
use crate::config::Config;
use crate::error::Result;
use crate::table::OutboxTable;

/// Advisory lock key of the cleanup leader (one per database; cleanup is cheap to serialize).
const CLEANUP_LOCK_KEY: i64 = 0x7067_6f62_636c_6e75;

/// CleanupLeader. The session-level advisory lock `$1` ([`CLEANUP_LOCK_KEY`]), if free: held
/// until the session ends.
const TRY_LEADER: &str = "SELECT pg_try_advisory_lock($1)";

/// What to delete and how.
#[derive(Debug, Clone)]
pub struct CleanupOptions {
    /// Published rows older than this are deleted.
    pub retention: Duration,
    /// Dead rows older than this are deleted; `None` keeps them.
    pub dead_retention: Option<Duration>,
    /// Failed-attempt history older than this is deleted.
    pub attempts_retention: Duration,
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
            attempts_retention: config.attempts_retention,
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
    /// Failed-attempt history rows deleted (not counted in [`CleanupReport::deleted`]).
    pub deleted_attempts: u64,
    /// Rate buckets of ended replays deleted (not counted in [`CleanupReport::deleted`]).
    pub deleted_buckets: u64,
    /// Partitions of the published history dropped whole (`history = "partitions"`).
    pub dropped_partitions: u64,
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

/// OutboxDeleteExpired, for one `{stamp}` column: `published_at` (published rows past
/// retention, `{name:published_seq_idx}`) or `dead_at` (dead rows past dead retention,
/// `{name:dead_idx}`). The oldest such rows, at most `$1`: a range scan of that partial index from
/// the cursor `$3`, the newest stamp the previous chunk deleted, so no chunk walks again over what
/// an earlier one removed (those index entries stay until vacuum). Deleted by their row addresses
/// (a TID scan: no primary-key lookups, which with random ids cost one index page each and doubled
/// the run; a join to the chunk was planned as a sequential scan). A row updated meanwhile has a
/// new address and is left for the next run; the cutoff is checked again on the row itself.
/// Pending rows are in neither index, so they are never matched.
const DELETE_EXPIRED: &str = "
DELETE FROM {outbox} o
WHERE o.ctid = ANY (ARRAY(
        SELECT ctid FROM {outbox}
        WHERE {stamp} >= coalesce($3, '-infinity') AND {stamp} < now() - make_interval(secs => $2)
        ORDER BY {stamp}
        LIMIT $1))
  AND o.{stamp} < now() - make_interval(secs => $2)
RETURNING o.{stamp}";

/// OutboxCountExpired. The dry-run twin of OutboxDeleteExpired: an index-only count over the same
/// partial index.
const COUNT_EXPIRED: &str = "
SELECT count(*) FROM {outbox} WHERE {stamp} < now() - make_interval(secs => $1)";

/// The two kinds of expired rows, by the column that dates them.
#[derive(Clone, Copy)]
enum Stamp {
    Published,
    Dead,
}

impl Stamp {
    /// `template` for this kind of row, rendered for `table`.
    fn render(self, table: &OutboxTable, template: &str) -> String {
        let column = match self {
            Self::Published => "published_at",
            Self::Dead => "dead_at",
        };
        table.render(&template.replace("{stamp}", column))
    }

    /// Its index in [`Sql`]'s per-stamp statements.
    fn at(self) -> usize {
        self as usize
    }
}

/// This module's statements, rendered.
pub(super) struct Sql {
    /// OutboxDeleteExpired, per [`Stamp`].
    delete_expired: [String; 2],
    /// OutboxCountExpired, per [`Stamp`].
    count_expired: [String; 2],
    delete_old_attempts: String,
    delete_dead_deliveries: String,
    count_dead_deliveries: String,
    delete_ended_replay_buckets: String,
}

impl Sql {
    pub(super) fn render(table: &OutboxTable) -> Self {
        let stamps = |template: &str| {
            [Stamp::Published, Stamp::Dead].map(|stamp| stamp.render(table, template))
        };
        Self {
            delete_expired: stamps(DELETE_EXPIRED),
            count_expired: stamps(COUNT_EXPIRED),
            delete_old_attempts: table.render(DELETE_OLD_ATTEMPTS),
            delete_dead_deliveries: table.render(DELETE_DEAD_DELIVERIES),
            count_dead_deliveries: table.render(COUNT_DEAD_DELIVERIES),
            delete_ended_replay_buckets: table.render(DELETE_ENDED_REPLAY_BUCKETS),
        }
    }
}

/// Runs cleanup unless another instance holds the cleanup lock; `None` when it was skipped.
pub async fn run_if_leader(
    store: &Store,
    options: &CleanupOptions,
) -> Result<Option<CleanupReport>> {
    let mut conn = store.pool().acquire().await?;
    // The lock is the session's, so the session ends with the run: this connection never goes
    // back to the pool (where it would keep the lock and leave every relay a follower), whether
    // the run ends, fails, or is dropped mid-way (the relay aborts cleanup at shutdown). Marked
    // before asking for the lock, as a future dropped while the answer is on its way would
    // otherwise return it to the pool holding it. The price is one new connection per interval.
    conn.close_on_drop();
    let leader: bool = sqlx::query_scalar(TRY_LEADER)
        .bind(CLEANUP_LOCK_KEY)
        .fetch_one(&mut *conn)
        .await?;
    if !leader {
        return Ok(None);
    }
    let report = run(store, options, |_| {}).await?;
    // Closing ends the session and so releases the lock; no separate unlock to forget.
    conn.close().await?;
    Ok(Some(report))
}

/// Runs cleanup now; `progress` is called after every chunk with the running totals.
pub async fn run(
    store: &Store,
    options: &CleanupOptions,
    mut progress: impl FnMut(&CleanupReport),
) -> Result<CleanupReport> {
    let sql = &store.sql.cleanup;
    let mut report = CleanupReport::default();
    let retention = options.retention.as_secs_f64();
    let dead_retention = options.dead_retention.map(|d| d.as_secs_f64());
    if options.dry_run {
        let count = |stamp: Stamp, secs: f64| {
            let statement = &sql.count_expired[stamp.at()];
            async move {
                let (n,): (i64,) = sqlx::query_as(statement)
                    .bind(secs)
                    .fetch_one(store.pool())
                    .await?;
                Ok::<_, sqlx::Error>(n.max(0) as u64)
            }
        };
        report.deleted_published = count(Stamp::Published, retention).await?;
        report.batches += 1;
        if let Some(d) = dead_retention {
            report.deleted_dead = count(Stamp::Dead, d).await?;
            report.batches += 1;
        }
        progress(&report);
    } else {
        walk(
            store,
            options,
            Stamp::Published,
            retention,
            &mut report,
            &mut progress,
        )
        .await?;
        if let Some(d) = dead_retention {
            walk(store, options, Stamp::Dead, d, &mut report, &mut progress).await?;
        }
    }
    // The partitioned history (`history = "partitions"`, or left from it): whole partitions. Run
    // whatever the setting, so that switching back to the outbox still expires them.
    let expired = super::history::expire(
        store,
        options.retention,
        options.chunk_rows,
        options.dry_run,
    )
    .await?;
    report.dropped_partitions = expired.partitions;
    report.deleted_published += expired.default_rows;
    if expired.partitions + expired.default_rows > 0 {
        progress(&report);
    }
    if let Some(dead_retention) = dead_retention {
        // Dead pairs of split events: a table as small as the current failures, one statement.
        let statement = if options.dry_run {
            &sql.count_dead_deliveries
        } else {
            &sql.delete_dead_deliveries
        };
        let (deleted,): (i64,) = sqlx::query_as(statement)
            .bind(dead_retention)
            .fetch_one(store.pool())
            .await?;
        report.deleted_dead += deleted as u64;
        if deleted > 0 {
            progress(&report);
        }
    }
    if !options.dry_run {
        // The attempt history: small rows, chunk after chunk by age (`{name:attempts_at_idx}`).
        let (deleted, chunks) = super::delete_in_chunks(
            store,
            &sql.delete_old_attempts,
            options.attempts_retention,
            options.chunk_rows,
        )
        .await?;
        report.deleted_attempts += deleted;
        report.batches += chunks;
        let (buckets,): (i64,) = sqlx::query_as(&sql.delete_ended_replay_buckets)
            .fetch_one(store.pool())
            .await?;
        report.deleted_buckets += buckets.max(0) as u64;
        report.batches += 1;
    }
    Ok(report)
}

/// CleanupAttempts. One chunk of failed-attempt history older than `$1` seconds, oldest first
/// (`{name:attempts_at_idx}`); returns how many rows went.
const DELETE_OLD_ATTEMPTS: &str = "
WITH gone AS (
    DELETE FROM {qname:attempts}
    WHERE ctid = ANY (ARRAY(
        SELECT ctid FROM {qname:attempts}
        WHERE at < now() - make_interval(secs => $1)
        ORDER BY at LIMIT $2))
    RETURNING 1)
SELECT count(*) FROM gone";

/// Runs OutboxDeleteExpired for `stamp` chunk after chunk, each one short autocommit statement,
/// until a chunk comes back short: nothing older than the cutoff is left.
async fn walk(
    store: &Store,
    options: &CleanupOptions,
    stamp: Stamp,
    retention_secs: f64,
    report: &mut CleanupReport,
    progress: &mut impl FnMut(&CleanupReport),
) -> Result<()> {
    let statement = &store.sql.cleanup.delete_expired[stamp.at()];
    let mut cursor: Option<DateTime<Utc>> = None;
    loop {
        let started = Instant::now();
        let stamps: Vec<DateTime<Utc>> = sqlx::query_scalar(statement)
            .bind(options.chunk_rows)
            .bind(retention_secs)
            .bind(cursor)
            .fetch_all(store.pool())
            .await?;
        let elapsed = started.elapsed();
        match stamp {
            Stamp::Published => report.deleted_published += stamps.len() as u64,
            Stamp::Dead => report.deleted_dead += stamps.len() as u64,
        }
        report.batches += 1;
        report.longest_batch = report.longest_batch.max(elapsed);
        debug!(
            rows = stamps.len(),
            elapsed_ms = elapsed.as_millis() as u64,
            "cleanup chunk"
        );
        progress(report);
        if (stamps.len() as i64) < options.chunk_rows {
            return Ok(());
        }
        cursor = stamps.into_iter().max().or(cursor);
    }
}

/// CleanupDeadDeliveries. Dead pairs past dead retention (`{name:deliveries_dead_idx}`).
const DELETE_DEAD_DELIVERIES: &str = "
WITH gone AS (
    DELETE FROM {qname:deliveries}
    WHERE dead_at < now() - make_interval(secs => $1)
    RETURNING 1)
SELECT count(*) FROM gone";

/// CleanupReplayBuckets. The rate buckets of replays that ended (cancelled, done, failed) or are
/// gone: nothing takes from them again. A few rows; the replays' primary key.
const DELETE_ENDED_REPLAY_BUCKETS: &str = "
WITH gone AS (
    DELETE FROM {qname:rates} AS r
    WHERE r.destination LIKE 'replay:%'
      AND NOT EXISTS (SELECT 1 FROM {qname:replays} AS p
                      WHERE r.destination = 'replay:' || p.id::text
                        AND p.state IN ('running', 'paused'))
    RETURNING 1)
SELECT count(*) FROM gone";

/// See DELETE_DEAD_DELIVERIES (dry run).
const COUNT_DEAD_DELIVERIES: &str = "
SELECT count(*) FROM {qname:deliveries} WHERE dead_at < now() - make_interval(secs => $1)";
