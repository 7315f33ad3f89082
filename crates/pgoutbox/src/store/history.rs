//! History: published events kept in partitions (`history = "partitions"`).
//!
//! With it, settle moves each delivered row out of the outbox into `<table>_history`
//! (OutboxMoveMany), which is range-partitioned by `published_at`. This module keeps partitions
//! ready ahead of the clock, so that a settle always has one to land in, and drops those wholly
//! past `retention`. Dropping a partition gives its space back at once and leaves no dead tuples,
//! vacuum work or index creep behind, which row-by-row cleanup of a kept outbox cannot promise
//! under a steady load (docs/performance.md, "Soak").
//!
//! A partition is named `<table>_h<YYYYMMDDHHMM>_<minutes>` (its UTC start and width): the name is
//! all cleanup needs to know its range, and a table of any other name is never dropped. Its width
//! follows `retention` ([`width_minutes`]). Each partition is created or dropped in its own short
//! transaction under a lock timeout: the DDL locks the parent table, so settles wait for it, and
//! it must not queue for long behind a reader of the history.

use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};
use tracing::{debug, info};

use super::Store;
use crate::error::Result;
use crate::table::OutboxTable;

/// Advisory lock key serializing partition creation (relays starting together, cleanup).
const PARTITIONS_LOCK_KEY: i64 = 0x7067_6f62_6869_7374;

/// Partition widths, in minutes: each divides a day, so partitions line up on the clock.
const WIDTHS_MINUTES: [i64; 6] = [1, 5, 15, 60, 360, 1440];

/// How long a partition's DDL may wait for its lock before giving up until the next run. Short:
/// while it waits, every settle queues behind it (the DDL locks the parent), and partitions are
/// kept far enough ahead that a few missed runs are harmless.
const DDL_LOCK_TIMEOUT: &str = "250ms";

/// HistoryLock. Serializes partition creation ([`PARTITIONS_LOCK_KEY`]) until the transaction
/// ends.
const PARTITIONS_LOCK: &str = "SELECT pg_advisory_xact_lock($1)";

/// The database's clock, which partition bounds are taken from (never the relay's).
const NOW: &str = "SELECT statement_timestamp()";

/// The width of new partitions for `retention`: the widest of [`WIDTHS_MINUTES`] no wider than a
/// quarter of it, so that at most about a quarter of a retention period's rows outlive it.
pub fn width_minutes(retention: Duration) -> i64 {
    let quarter = (retention.as_secs() / 60 / 4) as i64;
    WIDTHS_MINUTES
        .iter()
        .copied()
        .filter(|w| *w <= quarter)
        .max()
        .unwrap_or(WIDTHS_MINUTES[0])
}

/// One partition of the history, as its name gives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Partition {
    /// The table name (unqualified, unquoted).
    pub name: String,
    /// Where its range starts (inclusive).
    pub start: DateTime<Utc>,
    /// Where its range ends (exclusive).
    pub end: DateTime<Utc>,
}

impl Partition {
    /// The partition of `table` covering `[start, start + minutes)`.
    fn new(table: &OutboxTable, start: DateTime<Utc>, minutes: i64) -> Self {
        Self {
            name: format!(
                "{}_h{}_{minutes}",
                table.table().as_str(),
                start.format("%Y%m%d%H%M")
            ),
            start,
            end: start + chrono::Duration::minutes(minutes),
        }
    }

    /// Reads a partition name of `table`; `None` for any other name (not one of ours).
    fn parse(table: &OutboxTable, name: &str) -> Option<Self> {
        let rest = name.strip_prefix(&format!("{}_h", table.table().as_str()))?;
        let (stamp, minutes) = rest.split_once('_')?;
        if stamp.len() != 12 || !stamp.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let minutes: i64 = minutes.parse().ok()?;
        if !(1..=WIDTHS_MINUTES[WIDTHS_MINUTES.len() - 1]).contains(&minutes) {
            return None;
        }
        let start = chrono::NaiveDateTime::parse_from_str(stamp, "%Y%m%d%H%M").ok()?;
        Some(Self::new(table, Utc.from_utc_datetime(&start), minutes))
    }

    /// `"schema"."name"`, ready for SQL.
    fn qualified(&self, table: &OutboxTable) -> String {
        format!("{}.\"{}\"", table.schema().quoted(), self.name)
    }
}

/// HistoryPartitions. The partitions of `{qname:history}`, from the catalog (`pg_inherits`).
const PARTITIONS: &str = "
SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
WHERE i.inhparent = '{qname:history}'::regclass";

/// HistoryDefaultNewest. The newest row that fell into the default partition (no partition
/// covered its time): no partition may be created over it. `{name:history_published_seq_idx}`.
const DEFAULT_NEWEST: &str = "SELECT max(published_at) FROM {qname:history_default}";

/// This module's statements, rendered (partition DDL names a partition: it is built per call).
pub(super) struct Sql {
    partitions: String,
    default_newest: String,
    delete_expired_default: String,
}

impl Sql {
    pub(super) fn render(table: &OutboxTable) -> Self {
        Self {
            partitions: table.render(PARTITIONS),
            default_newest: table.render(DEFAULT_NEWEST),
            delete_expired_default: table.render(DELETE_EXPIRED_DEFAULT),
        }
    }
}

/// HistoryPartitions: the history's partitions (ours only), oldest first, on `conn` (in its
/// transaction, if one is open).
pub async fn partitions(store: &Store, conn: &mut sqlx::PgConnection) -> Result<Vec<Partition>> {
    let names: Vec<String> = sqlx::query_scalar(&store.sql.history.partitions)
        .fetch_all(&mut *conn)
        .await?;
    let mut found: Vec<Partition> = names
        .iter()
        .filter_map(|n| Partition::parse(store.table(), n))
        .collect();
    found.sort_by_key(|p| p.start);
    Ok(found)
}

/// Runs a partition's DDL in the open transaction `tx`, waiting at most [`DDL_LOCK_TIMEOUT`] for
/// its lock.
async fn ddl_in(tx: &mut sqlx::PgConnection, ddl: &str) -> Result<()> {
    sqlx::query(&format!("SET LOCAL lock_timeout = '{DDL_LOCK_TIMEOUT}'"))
        .execute(&mut *tx)
        .await?;
    sqlx::query(ddl).execute(&mut *tx).await?;
    Ok(())
}

/// The start of the `minutes`-wide slot holding `at`.
fn slot_start(at: DateTime<Utc>, minutes: i64) -> DateTime<Utc> {
    let width = minutes * 60;
    let secs = at.timestamp().div_euclid(width) * width;
    Utc.timestamp_opt(secs, 0).single().unwrap_or(at)
}

/// Creates the partitions missing from now to `ahead` from now, `retention`'s width each, one
/// transaction per partition; returns how many were created. New partitions start after every
/// existing one (so a change of width never overlaps) and after any row of the default
/// partition.
pub async fn ensure(store: &Store, retention: Duration, ahead: Duration) -> Result<u64> {
    let table = store.table();
    let minutes = width_minutes(retention);
    let mut created = 0;
    loop {
        let mut tx = store.pool().begin().await?;
        sqlx::query(PARTITIONS_LOCK)
            .bind(PARTITIONS_LOCK_KEY)
            .execute(&mut *tx)
            .await?;
        let now: DateTime<Utc> = sqlx::query_scalar(NOW).fetch_one(&mut *tx).await?;
        let horizon = now + chrono::Duration::from_std(ahead).unwrap_or_default();
        let existing = partitions(store, &mut tx).await?;
        let newest_default: Option<DateTime<Utc>> =
            sqlx::query_scalar(&store.sql.history.default_newest)
                .fetch_one(&mut *tx)
                .await?;
        let mut from = slot_start(now, minutes);
        if let Some(end) = existing.iter().map(|p| p.end).max() {
            from = from.max(end);
        }
        if let Some(newest) = newest_default.filter(|n| *n >= from) {
            // The next whole minute: the partition then runs to its slot's end (below), so that
            // settles leave the default partition within a minute whatever the width.
            from = slot_start(newest, 1) + chrono::Duration::minutes(1);
        }
        if from >= horizon {
            tx.commit().await?;
            return Ok(created);
        }
        // A start left unaligned by an older width runs to the next slot boundary (whole
        // minutes: every width is).
        let end = slot_start(from, minutes) + chrono::Duration::minutes(minutes);
        let next = Partition::new(table, from, (end - from).num_minutes().max(1));
        // Bounds are formatted from the database's own clock, never from input.
        let ddl = format!(
            "CREATE TABLE IF NOT EXISTS {} PARTITION OF {} FOR VALUES FROM ('{}') TO ('{}')",
            next.qualified(table),
            table.derived("history"),
            from.format("%Y-%m-%d %H:%M:%S+00"),
            end.format("%Y-%m-%d %H:%M:%S+00"),
        );
        ddl_in(&mut tx, &ddl).await?;
        tx.commit().await?;
        debug!(partition = %next.name, "history partition created");
        created += 1;
    }
}

/// HistoryDeleteDefault. One chunk of default-partition rows past retention (rare: only rows
/// published while no partition covered their time land there), by row address.
const DELETE_EXPIRED_DEFAULT: &str = "
WITH gone AS (
    DELETE FROM {qname:history_default}
    WHERE ctid = ANY (ARRAY(
        SELECT ctid FROM {qname:history_default}
        WHERE published_at < now() - make_interval(secs => $1)
        LIMIT $2))
    RETURNING 1)
SELECT count(*) FROM gone";

/// What [`expire`] did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Expired {
    /// Partitions dropped (or, on a dry run, that would be).
    pub partitions: u64,
    /// Rows deleted from the default partition.
    pub default_rows: u64,
}

/// Drops the partitions whose whole range is older than `retention`, each in its own short
/// transaction, then deletes the default partition's expired rows in chunks of `chunk_rows`. A
/// dry run only counts the partitions.
pub async fn expire(
    store: &Store,
    retention: Duration,
    chunk_rows: i64,
    dry_run: bool,
) -> Result<Expired> {
    let table = store.table();
    let mut done = Expired::default();
    let mut conn = store.pool().acquire().await?;
    let now: DateTime<Utc> = sqlx::query_scalar(NOW).fetch_one(&mut *conn).await?;
    let cutoff = now - chrono::Duration::from_std(retention).unwrap_or_default();
    for p in partitions(store, &mut conn).await? {
        if p.end > cutoff {
            break;
        }
        done.partitions += 1;
        if dry_run {
            continue;
        }
        let mut tx = sqlx::Connection::begin(&mut *conn).await?;
        ddl_in(
            &mut tx,
            &format!("DROP TABLE IF EXISTS {}", p.qualified(table)),
        )
        .await?;
        tx.commit().await?;
        info!(partition = %p.name, "history partition dropped (past retention)");
    }
    if dry_run {
        return Ok(done);
    }
    drop(conn);
    let statement = &store.sql.history.delete_expired_default;
    (done.default_rows, _) =
        super::delete_in_chunks(store, statement, retention, chunk_rows).await?;
    Ok(done)
}

/// How far ahead of the clock partitions are kept: two cleanup intervals (a missed run is
/// harmless) plus two partitions.
pub fn ahead(retention: Duration, cleanup_interval: Duration) -> Duration {
    cleanup_interval * 2 + Duration::from_secs(width_minutes(retention) as u64 * 60 * 2)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn width_follows_retention() {
        let m = |secs| width_minutes(Duration::from_secs(secs));
        assert_eq!(m(1), 1);
        assert_eq!(m(300), 1);
        assert_eq!(m(3600), 15);
        assert_eq!(m(4 * 3600), 60);
        assert_eq!(m(7 * 86400), 1440);
    }

    #[test]
    fn names_round_trip_and_others_are_ignored() {
        let t = OutboxTable::default_table();
        let start = Utc.with_ymd_and_hms(2026, 12, 2, 23, 45, 0).unwrap();
        let p = Partition::new(&t, start, 15);
        assert_eq!(p.name, "outbox_h202612022345_15");
        assert_eq!(Partition::parse(&t, &p.name), Some(p.clone()));
        assert_eq!(p.end, start + chrono::Duration::minutes(15));
        for other in [
            "outbox_history_default",
            "outbox_h2026120223_15",
            "outbox_h202612022345_0",
            "outbox_h202612022345_x",
            "orders_h202612022345_15",
        ] {
            assert_eq!(Partition::parse(&t, other), None, "{other}");
        }
    }

    #[test]
    fn slots_line_up_on_the_clock() {
        let at = Utc.with_ymd_and_hms(2026, 12, 2, 23, 47, 31).unwrap();
        assert_eq!(
            slot_start(at, 15),
            Utc.with_ymd_and_hms(2026, 12, 2, 23, 45, 0).unwrap()
        );
        assert_eq!(
            slot_start(at, 1440),
            Utc.with_ymd_and_hms(2026, 12, 2, 0, 0, 0).unwrap()
        );
    }
}
