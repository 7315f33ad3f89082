//! `bench steady`: producers commit single-event transactions at a target rate while a relay
//! process delivers them to a local webhook receiver. Reports commit→publish latency (with p99.9,
//! max and a per-second timeline of p99 and max, each second marked when a checkpoint was
//! running), the relay's own claim and settle times, its CPU, its CPU when idle, and what the
//! schema and the wake-up mechanism cost producers.
//!
//! Three processes, as in production: the producers (`bench produce`, pgbench-like), the relay,
//! and this one, which only receives and measures. Latency = the producer's commit returned →
//! the receiver got the request, both read from the same system clock.
//!
//! Wake-up: the relay polls adaptively (at once after a non-empty claim, then 1 ms doubling up to
//! `poll_interval` when idle). The producer-cost part compares the producers' commit rate on the
//! pgoutbox table with the minimal table (the schema's cost), and with no relay, with the relay
//! running, and with a statement-level NOTIFY trigger (the alternative wake-up).
//!
//! With `--source wal` the relay reads a logical replication slot instead (created in the scratch
//! database before the relay starts), and the producer-cost part compares the producers' commit
//! rate with the WAL relay streaming against no relay (and no slot), and against pg_recvlogical
//! streaming the same slot to /dev/null (the floor of any logical decoding client). With
//! `--producer emit` the producers call `outbox_emit()` (a logical decoding message, no row), and
//! the producer-cost part compares them, alone, with the WAL relay and with pg_recvlogical,
//! against plain INSERTs into the minimal table with no relay.

mod args;
mod cost;

use std::time::{Duration, Instant};

use crate::checkpoints::CheckpointWatch;
use crate::latency::{follow_producer, timed_receiver, Latencies};
use crate::metrics::Histogram;
use crate::output::{rate, Output, Row};
use crate::process::{RelayProcess, RelaySpec};
use crate::producer::Spec;
use crate::scratch::{Scratch, Source};

pub use args::Args;
use cost::producer_cost;

/// Runs `bench steady`: the idle relay's CPU, the steady load, then what producers pay.
pub async fn run(scratch: &Scratch, out: &Output, args: &Args) -> anyhow::Result<()> {
    args.validate()?;
    scratch.fresh_source(args.source).await?;
    let (receiver, received) = timed_receiver().await?;
    let mut relay = RelayProcess::spawn(
        scratch,
        &RelaySpec {
            synchronous_commit: &args.relay_synchronous_commit,
            poll_interval: args.relay_poll_interval.as_deref(),
            batch_wait: args.relay_batch_wait.as_deref(),
            wal_batch_wait: args.wal_batch_wait.as_deref(),
            source: args.source,
            ..RelaySpec::new(&receiver.url)
        },
    )?;
    if args.source == Source::Wal {
        relay.wait_streaming(scratch).await?;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;

    // Idle CPU first: the relay has nothing to do.
    if !args.idle.is_zero() {
        let bar = out.bar(args.idle.as_secs(), "idle");
        let before = relay.cpu();
        let started = Instant::now();
        while started.elapsed() < args.idle {
            tokio::time::sleep(Duration::from_millis(250)).await;
            bar.set_position(started.elapsed().as_secs());
        }
        bar.finish_and_clear();
        let cpu = (relay.cpu() - before).as_secs_f64() / started.elapsed().as_secs_f64() * 100.0;
        out.row(Row {
            scenario: "idle".into(),
            variant: format!("{}relay process, empty outbox", args.label()),
            value: cpu,
            unit: "% CPU",
            detail: match args.source {
                Source::Poll => format!(
                    "over {:?} (adaptive polling, poll_interval {})",
                    args.idle,
                    args.relay_poll_interval.as_deref().unwrap_or("default")
                ),
                Source::Wal => format!(
                    "over {:?} (streaming the slot, heartbeat and status intervals default)",
                    args.idle
                ),
            },
        });
    }

    // Steady load.
    let metrics_before = relay.metrics().await;
    let checkpoints = CheckpointWatch::start(&scratch.pool);
    let cpu_before = relay.cpu();
    let started = Instant::now();
    let (producer, committed) = follow_producer(&Spec {
        url: &scratch.url,
        table: "outbox",
        connections: args.producers,
        rate: Some(args.rate),
        duration: args.duration,
        events: None,
        report: true,
        statement: args.producer,
    })?;
    let count = producer.await??;
    let produce_elapsed = started.elapsed();
    let wait_until = Instant::now() + Duration::from_secs(30);
    while received.lock().map(|m| m.len()).unwrap_or(0) < count as usize
        && Instant::now() < wait_until
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let cpu = (relay.cpu() - cpu_before).as_secs_f64() / started.elapsed().as_secs_f64() * 100.0;
    let metrics_after = relay.metrics().await;
    let latencies = {
        let committed = committed.lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
        let received = received.lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
        Latencies::join(&committed, &received)
    };
    let all = latencies.summary();
    let variant = format!(
        "{}{} producers, {}/s, relay sync commit {}",
        args.label(),
        args.producers,
        args.rate,
        args.relay_synchronous_commit
    );
    out.row(Row {
        scenario: "steady".into(),
        variant: variant.clone(),
        value: all.p50,
        unit: "ms p50",
        detail: format!(
            "p95 {:.1} ms, p99 {:.1} ms, p99.9 {:.1} ms, max {:.1} ms; achieved {:.0} commits/s, {} delivered of {}; relay CPU {:.0} %, peak RSS {} MiB",
            all.p95,
            all.p99,
            all.p999,
            all.max,
            rate(count, produce_elapsed),
            all.count,
            count,
            cpu,
            relay.peak_rss_kib() / 1024
        ),
    });
    let claim = Histogram::parse(&metrics_after, pgoutbox::model::metric::CLAIM_SECONDS).since(
        &Histogram::parse(&metrics_before, pgoutbox::model::metric::CLAIM_SECONDS),
    );
    let settle = Histogram::parse(&metrics_after, pgoutbox::model::metric::SETTLE_SECONDS).since(
        &Histogram::parse(&metrics_before, pgoutbox::model::metric::SETTLE_SECONDS),
    );
    let bound = |h: &Histogram, q: f64| {
        h.quantile_ms(q)
            .map_or_else(|| "n/a".to_owned(), |ms| format!("≤ {ms} ms"))
    };
    match args.source {
        Source::Poll => out.row(Row {
            scenario: "steady".into(),
            variant: "relay claim / settle (its histograms)".into(),
            value: claim.count(),
            unit: "claims",
            detail: format!(
                "claim p50 {}, p99 {}, p99.9 {}; settle p99 {}, p99.9 {}; checkpointer busy {} s of the run",
                bound(&claim, 0.5),
                bound(&claim, 0.99),
                bound(&claim, 0.999),
                bound(&settle, 0.99),
                bound(&settle, 0.999),
                checkpoints.count()
            ),
        }),
        // No claims: batches come from the stream (the batch-size histogram counts them).
        Source::Wal => {
            let batches = Histogram::parse(&metrics_after, pgoutbox::model::metric::BATCH_SIZE)
                .since(&Histogram::parse(
                    &metrics_before,
                    pgoutbox::model::metric::BATCH_SIZE,
                ));
            let events = |q: f64| {
                batches
                    .quantile(q)
                    .map_or_else(|| "n/a".to_owned(), |n| format!("≤ {n}"))
            };
            out.row(Row {
                scenario: "steady".into(),
                variant: format!("{}relay batches / settle (histograms)", args.label()),
                value: batches.count(),
                unit: "batches",
                detail: format!(
                    "events per batch p50 {}, p99 {}; settle p50 {}, p99 {}, p99.9 {}; checkpointer busy {} s of the run",
                    events(0.5),
                    events(0.99),
                    bound(&settle, 0.5),
                    bound(&settle, 0.99),
                    bound(&settle, 0.999),
                    checkpoints.count()
                ),
            });
        }
    }
    if args.timeline {
        let seconds = latencies.per_second();
        let first = seconds.keys().next().copied().unwrap_or(0);
        for (second, s) in seconds {
            out.row(Row {
                scenario: "timeline".into(),
                variant: format!(
                    "second {:>3} {}",
                    second - first,
                    checkpoints.during(second)
                ),
                value: s.p99,
                unit: "ms p99",
                detail: format!("max {:.1} ms, {} events", s.max, s.count),
            });
        }
    }
    drop(checkpoints);
    drop(relay);

    if args.cost_connections > 0 {
        producer_cost(scratch, out, args, &receiver).await?;
    }
    Ok(())
}
