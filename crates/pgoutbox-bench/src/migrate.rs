//! `bench migrate`: how long `migrate` blocks producers while it upgrades a large minimal outbox
//! table in place. Producers insert single rows (one autocommit INSERT each) in a loop throughout;
//! the result is the longest INSERT and the time they spent in INSERTs slower than a threshold,
//! during the migrate and, for comparison, while the producers ran alone just before.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use sqlx::{Connection, PgConnection};
use tracing::{debug, warn};

use super::output::{Output, Row};
use super::scratch::Scratch;
use super::sql;

/// Arguments of `bench migrate`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Rows in the minimal table before the upgrade.
    #[arg(long, default_value_t = 1_000_000)]
    rows: u64,
    /// One row in this many is pending; the others are published history.
    #[arg(long, default_value_t = 100)]
    pending_every: u64,
    /// Producer connections inserting single rows throughout.
    #[arg(long, default_value_t = 4)]
    producers: usize,
    /// Pause between one producer's INSERTs.
    #[arg(long, default_value = "5ms", value_parser = pgoutbox::config::parse_duration)]
    interval: Duration,
    /// How long the producers run alone before migrate starts (their latency without it).
    #[arg(long, default_value = "10s", value_parser = pgoutbox::config::parse_duration)]
    alone: Duration,
    /// An INSERT slower than this counts as stalled.
    #[arg(long, default_value = "50ms", value_parser = pgoutbox::config::parse_duration)]
    stall: Duration,
}

/// How often the lock waits of the producers are sampled.
const LOCK_SAMPLE: Duration = Duration::from_millis(5);

/// The producers' lock waits, sampled from `pg_stat_activity` every [`LOCK_SAMPLE`]: on the
/// table's lock (what migrate's DDL could cause), and on other locks (extending the table, which
/// every writer does, a row, a transaction).
#[derive(Debug, Default)]
struct LockWaits {
    samples: u64,
    /// Producers seen waiting on the table's lock, each for the time since the previous sample,
    /// summed.
    table: Duration,
    /// The longest a producer's INSERT was seen waiting on the table's lock.
    table_longest: Duration,
    /// The same for the other lock waits.
    other: Duration,
    other_longest: Duration,
}

/// One producer's INSERTs: when each started, how long it took.
type Inserts = Vec<(Instant, Duration)>;

/// What the producers saw in a window of time.
struct Window {
    inserts: usize,
    longest: Duration,
    /// The most stalled producer's INSERTs slower than the threshold, summed.
    worst_stalled: Duration,
    stalled_inserts: usize,
    median: Duration,
    p99: Duration,
}

impl Window {
    fn of(producers: &[Inserts], from: Instant, to: Instant, threshold: Duration) -> Self {
        let within = |p: &Inserts| -> Vec<Duration> {
            p.iter()
                .filter(|(at, _)| *at >= from && *at < to)
                .map(|(_, took)| *took)
                .collect()
        };
        let mut all: Vec<Duration> = producers.iter().flat_map(within).collect();
        all.sort();
        let pct = |p: f64| {
            all.get(((all.len() as f64 * p) as usize).min(all.len().saturating_sub(1)))
                .copied()
                .unwrap_or_default()
        };
        let stalled =
            |p: &Inserts| -> Duration { within(p).into_iter().filter(|t| *t > threshold).sum() };
        Self {
            inserts: all.len(),
            longest: all.last().copied().unwrap_or_default(),
            worst_stalled: producers.iter().map(stalled).max().unwrap_or_default(),
            stalled_inserts: all.iter().filter(|t| **t > threshold).count(),
            median: pct(0.5),
            p99: pct(0.99),
        }
    }

    fn ms(d: Duration) -> f64 {
        d.as_secs_f64() * 1000.0
    }
}

/// Runs `bench migrate`: builds the minimal table, runs the producers alone, then migrate beside
/// them, and checks that every row is kept.
pub async fn run(scratch: &Scratch, out: &Output, args: &Args) -> anyhow::Result<()> {
    sql::setup::drop_migrations_record(&scratch.pool).await?;
    scratch.minimal_table("outbox").await?;
    // A month of history, oldest first, with pending rows spread through it.
    let insert = sql::load::minimal_history(args.pending_every.max(1));
    scratch
        .generate(&insert, args.rows, 100_000, "minimal", out)
        .await?;
    sql::setup::vacuum_analyze(&scratch.pool, "outbox").await?;
    // Start from a clean buffer pool, so that writing out the table just built is not part of
    // the measurement (needs superuser or pg_checkpoint: without, a checkpoint may come during it).
    if let Err(e) = sql::setup::checkpoint(&scratch.pool).await {
        warn!(error = %e, "cannot CHECKPOINT before the measurement");
    }

    let stop = Arc::new(AtomicBool::new(false));
    let mut producers = Vec::new();
    for _ in 0..args.producers {
        let mut conn = PgConnection::connect(&scratch.url)
            .await
            .context("producer connection")?;
        let (stop, interval) = (stop.clone(), args.interval);
        producers.push(tokio::spawn(async move {
            let mut inserts = Inserts::new();
            while !stop.load(Ordering::Relaxed) {
                let started = Instant::now();
                sql::load::insert_live(&mut conn).await?;
                inserts.push((started, started.elapsed()));
                tokio::time::sleep(interval).await;
            }
            conn.close().await?;
            Ok::<_, sqlx::Error>(inserts)
        }));
    }

    // Lock waits, as PostgreSQL reports them: an INSERT slower than usual may be waiting for a
    // lock (what migrate must avoid) or for the disk and the CPUs (which migrate shares).
    let monitor = {
        let (url, stop) = (scratch.url.clone(), stop.clone());
        let mut conn = PgConnection::connect(&url)
            .await
            .context("monitor connection")?;
        tokio::spawn(async move {
            let mut waits = LockWaits::default();
            let mut last = Instant::now();
            while !stop.load(Ordering::Relaxed) {
                let waiting = sql::watch::lock_waits(&mut conn).await?;
                waits.samples += 1;
                let since = last.elapsed();
                last = Instant::now();
                for (on_table, secs) in waiting {
                    let seen = Duration::from_secs_f64(secs.max(0.0));
                    let (waited, longest) = if on_table {
                        (&mut waits.table, &mut waits.table_longest)
                    } else {
                        (&mut waits.other, &mut waits.other_longest)
                    };
                    *waited += since;
                    *longest = (*longest).max(seen);
                }
                tokio::time::sleep(LOCK_SAMPLE).await;
            }
            Ok::<_, sqlx::Error>(waits)
        })
    };

    // The producers alone first: what this machine's INSERT latency is without a migrate.
    let alone_from = Instant::now();
    tokio::time::sleep(args.alone).await;
    let started = Instant::now();
    let report =
        pgoutbox::schema::migrate(&scratch.pool, &pgoutbox::OutboxTable::default_table()).await?;
    let ended = Instant::now();
    let took = ended - started;
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.store(true, Ordering::Relaxed);
    let mut all = Vec::new();
    for p in producers {
        all.push(p.await??);
    }
    let waits = monitor.await??;
    for (at, took) in all.iter().flatten() {
        if *took > args.stall && *at >= started {
            debug!(
                at_ms = (*at - started).as_millis() as u64,
                took_ms = took.as_millis() as u64,
                "slow INSERT during migrate"
            );
        }
    }
    let alone = Window::of(&all, alone_from, started, args.stall);
    let during = Window::of(&all, started, ended, args.stall);

    // The upgrade kept every row and numbered the old ones before the new ones.
    let (total, old_max, new_min) = sql::watch::upgrade_check(&scratch.pool).await?;
    let inserts: u64 = all.iter().map(|p| p.len() as u64).sum();
    anyhow::ensure!(
        total as u64 == args.rows + inserts,
        "rows lost: {total} in the table, {} expected",
        args.rows + inserts
    );
    anyhow::ensure!(
        old_max < new_min || new_min.is_none(),
        "old rows not numbered before new ones ({old_max:?} vs {new_min:?})"
    );

    let variant = format!("{} rows, {} producers", args.rows, args.producers);
    out.row(Row {
        scenario: "migrate".into(),
        variant,
        value: took.as_secs_f64(),
        unit: "s",
        detail: format!(
            "migrate's total time ({} versions applied, now at {})",
            report.applied.len(),
            report.version
        ),
    });
    out.row(Row {
        scenario: "migrate".into(),
        variant: "longest INSERT".into(),
        value: Window::ms(during.longest),
        unit: "ms",
        detail: format!(
            "{} single-row INSERTs during migrate: median {:.1} ms, p99 {:.1} ms (alone for {} s before: longest {:.0} ms, median {:.1} ms, p99 {:.1} ms)",
            during.inserts,
            Window::ms(during.median),
            Window::ms(during.p99),
            args.alone.as_secs(),
            Window::ms(alone.longest),
            Window::ms(alone.median),
            Window::ms(alone.p99),
        ),
    });
    out.row(Row {
        scenario: "migrate".into(),
        variant: format!("INSERT time above {} ms", args.stall.as_millis()),
        value: Window::ms(during.worst_stalled),
        unit: "ms",
        detail: format!(
            "the most stalled producer's INSERTs slower than {} ms during migrate, summed ({} such INSERTs in all; alone before: {:.0} ms, {} INSERTs)",
            args.stall.as_millis(),
            during.stalled_inserts,
            Window::ms(alone.worst_stalled),
            alone.stalled_inserts,
        ),
    });
    out.row(Row {
        scenario: "migrate".into(),
        variant: "INSERT waiting on the table lock".into(),
        value: Window::ms(waits.table_longest),
        unit: "ms",
        detail: format!(
            "the longest an INSERT was seen waiting for the table; all producers: about {:.0} ms in all; other lock waits (extending the table…): longest {:.0} ms, {:.0} ms in all (pg_stat_activity every {} ms, {} samples)",
            Window::ms(waits.table),
            Window::ms(waits.other_longest),
            Window::ms(waits.other),
            LOCK_SAMPLE.as_millis(),
            waits.samples
        ),
    });
    Ok(())
}
