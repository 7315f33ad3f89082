//! `bench soak`: a long steady load, to see whether anything grows or slows down over time.
//!
//! Producers (their own process) commit `--events` single-event transactions at `--rate`; a
//! relay delivers them to a local receiver. Each mode runs on a fresh table: keep mode with
//! cleanup running (`retention`, `cleanup_interval`), then delete mode; `partitions` (keep mode
//! with `history = "partitions"`) on request. Every `--every` it prints the claim p99 (from the
//! relay's histogram), the commit→publish p99 (measured here), the table and index sizes (the
//! outbox plus its history's partitions) and dead tuples; at the end, the last interval's p99
//! against the first's and the size growth after the first retention period. Beside them, what
//! the machine did in the interval (CPU busy and stolen by the hypervisor, the relay's own CPU and
//! memory, checkpoints, vacuums of the outbox), so that a p99 that moves can be laid next to its
//! cause. `--csv` writes the rows, `--plot` draws them as an SVG.

mod args;
mod machine;
mod report;

use std::time::{Duration, Instant};

use crate::latency::{follow_producer, timed_receiver, Summary, Times};
use crate::metrics::Histogram;
use crate::output::Output;
use crate::process::{RelayProcess, RelaySpec};
use crate::producer::{Spec, Statement};
use crate::scratch::Scratch;
use crate::sql;

pub use args::Args;
use machine::Counters;
use report::{csv, plot, row, summarize, Sample};

/// Runs `bench soak`: each mode in turn, then writes the CSV and the plot when asked.
pub async fn run(scratch: &Scratch, out: &Output, args: &Args) -> anyhow::Result<()> {
    let mut samples = Vec::new();
    for mode in &args.modes {
        anyhow::ensure!(
            ["keep", "delete", "partitions"].contains(&mode.as_str()),
            "unknown mode {mode:?}: expected keep, delete or partitions"
        );
        samples.extend(run_mode(scratch, out, args, mode).await?);
    }
    if let Some(path) = &args.csv {
        std::fs::write(path, csv(&samples))?;
        eprintln!("wrote {}", path.display());
    }
    if let Some(path) = &args.plot {
        std::fs::write(path, plot(&samples, args))?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

async fn run_mode(
    scratch: &Scratch,
    out: &Output,
    args: &Args,
    mode: &str,
) -> anyhow::Result<Vec<Sample>> {
    scratch.fresh_outbox().await?;
    let (receiver, received) = timed_receiver().await?;
    let retention = if mode != "delete" {
        format!("{}s", args.retention.as_secs())
    } else {
        "0s".to_owned()
    };
    let cleanup = format!("{}s", args.cleanup_interval.as_secs().max(1));
    let relay = RelayProcess::spawn(
        scratch,
        &RelaySpec {
            retention: &retention,
            history: if mode == "partitions" {
                "partitions"
            } else {
                "outbox"
            },
            cleanup_interval: &cleanup,
            ..RelaySpec::new(&receiver.url)
        },
    )?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let expected = Duration::from_secs_f64(args.events as f64 / args.rate.max(1) as f64);
    let (producer, committed) = follow_producer(&Spec {
        url: &scratch.url,
        table: "outbox",
        connections: args.producers,
        rate: Some(args.rate),
        duration: expected * 2 + Duration::from_secs(60),
        events: Some(args.events),
        report: true,
        statement: Statement::Insert,
    })?;
    let bar = out.bar(args.events, mode);
    let started = Instant::now();
    let held = args
        .hold_xmin
        .map(|hold| tokio::spawn(hold_xmin(scratch.url.clone(), args.hold_xmin_at, hold)));
    let mut samples = Vec::new();
    let mut metrics = Histogram::parse(
        &relay.metrics().await,
        pgoutbox::model::metric::CLAIM_SECONDS,
    );
    let mut delivered_total = 0;
    let (.., vacuums) = sql::watch::outbox_sizes(&scratch.pool).await?;
    let mut counters = Counters::read(&scratch.pool, &relay, vacuums).await;
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + args.every, args.every);
    let mut producer = Some(producer);
    let mut quiet_since: Option<Instant> = None;
    loop {
        tick.tick().await;
        let latencies = take_delivered(&committed, &received);
        delivered_total += latencies.len();
        bar.set_position(delivered_total as u64);
        let now = Histogram::parse(
            &relay.metrics().await,
            pgoutbox::model::metric::CLAIM_SECONDS,
        );
        let claims = now.since(&metrics);
        metrics = now;
        let (table_mb, indexes_mb, dead_tuples, live_tuples, vacuums) =
            sql::watch::outbox_sizes(&scratch.pool).await?;
        let now_counters = Counters::read(&scratch.pool, &relay, vacuums).await;
        let machine = now_counters.since(&counters);
        counters = now_counters;
        let sample = Sample {
            mode: mode.to_owned(),
            minute: started.elapsed().as_secs_f64() / 60.0,
            delivered: latencies.len(),
            claim_p99_ms: claims.quantile_ms(0.99),
            latency: Summary::of(latencies),
            table_mb,
            indexes_mb,
            dead_tuples,
            live_tuples,
            machine,
        };
        bar.suspend(|| out.row(row(&sample)));
        samples.push(sample);
        if producer.as_ref().is_some_and(|p| p.is_finished()) {
            if let Some(p) = producer.take() {
                p.await??;
            }
        }
        if producer.is_none() {
            if delivered_total as u64 >= args.events {
                break;
            }
            // Whatever did not arrive within two intervals (at least 30 s) of the producers' end
            // is reported as missing.
            let since = *quiet_since.get_or_insert_with(Instant::now);
            if since.elapsed() > (args.every * 2).max(Duration::from_secs(30)) {
                break;
            }
        }
    }
    bar.finish_and_clear();
    drop(relay);
    summarize(out, args, mode, &samples, delivered_total);
    if let Some(held) = held {
        let (from, to) = held.await??;
        report::held_xmin(out, mode, &samples, from, to);
    }
    Ok(samples)
}

/// Holds a REPEATABLE READ transaction open on the outbox from `at` after now for `hold`;
/// returns when it began and ended, in minutes since now.
async fn hold_xmin(url: String, at: Duration, hold: Duration) -> anyhow::Result<(f64, f64)> {
    use sqlx::Connection;
    let start = Instant::now();
    tokio::time::sleep(at).await;
    let mut conn = sqlx::PgConnection::connect(&url).await?;
    sql::setup::hold_snapshot(&mut conn).await?;
    let from = start.elapsed().as_secs_f64() / 60.0;
    tokio::time::sleep(hold).await;
    sql::setup::release_snapshot(&mut conn).await?;
    Ok((from, start.elapsed().as_secs_f64() / 60.0))
}

/// Moves the events both committed and received out of the two maps; returns their latencies (µs).
///
/// The maps are swapped out and matched outside their locks: the receiver records every arrival
/// under the same lock, and matching a minute of events (~180,000) while holding it stalled the
/// receiver for up to ~200 ms each interval, a spike the relay did not cause.
fn take_delivered(committed: &Times, received: &Times) -> Vec<u64> {
    let take = |times: &Times| {
        times
            .lock()
            .map(|mut m| std::mem::take(&mut *m))
            .unwrap_or_default()
    };
    let (mut sent, mut arrived) = (take(committed), take(received));
    let mut out = Vec::with_capacity(sent.len());
    sent.retain(|id, at| match arrived.remove(id) {
        Some(r) => {
            out.push(r.saturating_sub(*at));
            false
        }
        None => true,
    });
    // What is still in flight (committed, not yet received) or not yet read from the producer
    // (received first) goes back for the next interval: a few hundred entries.
    for (times, rest) in [(committed, sent), (received, arrived)] {
        if let Ok(mut m) = times.lock() {
            m.extend(rest);
        }
    }
    out
}
