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

use std::process::Stdio;
use std::time::{Duration, Instant};

use super::checkpoints::CheckpointWatch;
use super::latency::{follow_producer, timed_receiver, Latencies};
use super::metrics::Histogram;
use super::output::{rate, Output, Row};
use super::process::{RelayProcess, RelaySpec};
use super::producer::{Producer, Spec, Statement};
use super::receiver::Receiver;
use super::recvlogical::{pg_recvlogical, recvlogical_command};
use super::scratch::{Scratch, Source};

/// Arguments of `bench steady`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Target commits per second, all producers together.
    #[arg(long, default_value_t = 3000)]
    rate: u64,
    /// Producer connections.
    #[arg(long, default_value_t = 8)]
    producers: usize,
    /// How long producers run.
    #[arg(long, default_value = "20s", value_parser = crate::flags::parse_duration)]
    duration: Duration,
    /// Producer connections for the producer-cost measurement (0 skips it).
    #[arg(long, default_value_t = 32)]
    cost_connections: usize,
    /// Where the relays of the producer-cost runs deliver: the webhook receiver in this process
    /// (its CPU is taken from the same cores), or the null sink (the relay's own cost only).
    #[arg(long, default_value = "webhook", value_parser = ["webhook", "null"])]
    cost_sink: String,
    /// How long each producer-cost run lasts.
    #[arg(long, default_value = "10s", value_parser = crate::flags::parse_duration)]
    cost_duration: Duration,
    /// Pairs of (minimal table, pgoutbox table) runs for the schema cost; the median ratio is
    /// reported.
    #[arg(long, default_value_t = 3)]
    cost_pairs: usize,
    /// How long the idle relay's CPU is measured (0s skips it).
    #[arg(long, default_value = "60s", value_parser = crate::flags::parse_duration)]
    idle: Duration,
    /// `relay.synchronous_commit` of the measured relay (on: every settle waits for the disk).
    #[arg(long, default_value = "on", value_parser = ["on", "off"])]
    relay_synchronous_commit: String,
    /// `relay.poll_interval` of the measured relay (its default when absent).
    #[arg(long)]
    relay_poll_interval: Option<String>,
    /// `wal.batch_wait` of the measured relay with --source wal (its default when absent).
    #[arg(long)]
    wal_batch_wait: Option<String>,
    /// Print the per-second timeline (p99 and max of each second).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    timeline: bool,
    /// Where the relay takes events from: claimed from the table (poll), or read from a logical
    /// replication slot (wal: needs wal_level = logical; the slot is created in the scratch
    /// database before the relay starts).
    #[arg(long, value_enum, default_value_t = Source::Poll)]
    source: Source,
    /// What the producers write: a plain INSERT, or `SELECT outbox_emit(...)` (a logical decoding
    /// message and no row, which only the WAL relay reads: --source wal only).
    #[arg(long, value_enum, default_value_t = Statement::Insert)]
    producer: Statement,
}

impl Args {
    /// Small sizes for `bench quick`.
    pub fn quick() -> Self {
        Self {
            rate: 1000,
            producers: 8,
            duration: Duration::from_secs(5),
            cost_connections: 32,
            cost_duration: Duration::from_secs(3),
            cost_sink: "webhook".into(),
            cost_pairs: 1,
            idle: Duration::from_secs(5),
            relay_synchronous_commit: "on".into(),
            relay_poll_interval: None,
            wal_batch_wait: None,
            timeline: false,
            source: Source::Poll,
            producer: Statement::Insert,
        }
    }

    /// Refuses combinations that cannot run.
    pub fn validate(&self) -> anyhow::Result<()> {
        if self.producer == Statement::Emit && self.source == Source::Poll {
            anyhow::bail!(
                "--producer emit needs --source wal: outbox_emit() writes a logical decoding \
                 message and no row, so a polling relay would never see those events"
            );
        }
        Ok(())
    }

    /// What the run measures, at the head of its rows: nothing for the polling relay and plain
    /// INSERTs (the historical variant names), else the source and the producers' statement.
    fn label(&self) -> String {
        match (self.source, self.producer) {
            (Source::Poll, Statement::Insert) => String::new(),
            (source, Statement::Insert) => format!("{}, ", source.as_str()),
            (source, Statement::Emit) => format!("{}, emit(), ", source.as_str()),
        }
    }
}

pub async fn run(scratch: &Scratch, out: &Output, args: &Args) -> anyhow::Result<()> {
    args.validate()?;
    scratch.fresh_source(args.source).await?;
    let (receiver, received) = timed_receiver().await?;
    let mut relay = RelayProcess::spawn(
        scratch,
        &RelaySpec {
            synchronous_commit: &args.relay_synchronous_commit,
            poll_interval: args.relay_poll_interval.as_deref(),
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
    let claim = Histogram::parse(&metrics_after, pgoutbox::observe::CLAIM_SECONDS).since(
        &Histogram::parse(&metrics_before, pgoutbox::observe::CLAIM_SECONDS),
    );
    let settle = Histogram::parse(&metrics_after, pgoutbox::observe::SETTLE_SECONDS).since(
        &Histogram::parse(&metrics_before, pgoutbox::observe::SETTLE_SECONDS),
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
            let batches = Histogram::parse(&metrics_after, pgoutbox::observe::BATCH_SIZE)
                .since(&Histogram::parse(
                    &metrics_before,
                    pgoutbox::observe::BATCH_SIZE,
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

/// Commit rate of unthrottled single-event INSERT producers on `table`.
async fn unthrottled(scratch: &Scratch, args: &Args, table: &str) -> anyhow::Result<f64> {
    unthrottled_with(scratch, args, table, Statement::Insert).await
}

/// Commit rate of unthrottled single-event producers running `statement` on `table`.
async fn unthrottled_with(
    scratch: &Scratch,
    args: &Args,
    table: &str,
    statement: Statement,
) -> anyhow::Result<f64> {
    sqlx::query("CHECKPOINT").execute(&scratch.pool).await?;
    let n = Producer::run(&Spec {
        url: &scratch.url,
        table,
        connections: args.cost_connections,
        rate: None,
        duration: args.cost_duration,
        events: None,
        report: false,
        statement,
    })
    .await?;
    Ok(rate(n, args.cost_duration))
}

/// One setting of the WAL source's producer-cost runs: what the producers write and what runs
/// beside them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Setup {
    /// Plain INSERTs into the article's minimal table, no relay, no slot.
    Minimal,
    /// The producers' statement on the pgoutbox table, no relay, no slot.
    Alone(Statement),
    /// The producers' statement while a WAL relay streams its slot to the receiver.
    WalRelay(Statement),
    /// The producers' statement while pg_recvlogical streams the slot to /dev/null: the floor
    /// of any logical decoding client.
    RecvLogical(Statement),
}

impl Setup {
    /// Commits/s of unthrottled producers in this setting, on fresh tables.
    async fn measure(
        self,
        scratch: &Scratch,
        args: &Args,
        receiver: &Receiver,
    ) -> anyhow::Result<f64> {
        match self {
            Self::Minimal => {
                scratch.fresh_source(Source::Poll).await?;
                scratch.minimal_table("outbox_minimal").await?;
                let rate = unthrottled(scratch, args, "outbox_minimal").await;
                sqlx::query("DROP TABLE IF EXISTS outbox_minimal")
                    .execute(&scratch.pool)
                    .await?;
                rate
            }
            Self::Alone(statement) => {
                scratch.fresh_source(Source::Poll).await?;
                unthrottled_with(scratch, args, "outbox", statement).await
            }
            Self::WalRelay(statement) => {
                scratch.fresh_source(Source::Wal).await?;
                let mut relay = RelayProcess::spawn(
                    scratch,
                    &RelaySpec {
                        source: Source::Wal,
                        null_sink: args.cost_sink == "null",
                        ..RelaySpec::new(&receiver.url)
                    },
                )?;
                relay.wait_streaming(scratch).await?;
                tokio::time::sleep(Duration::from_millis(300)).await;
                let rate = unthrottled_with(scratch, args, "outbox", statement).await;
                drop(relay);
                rate
            }
            Self::RecvLogical(statement) => {
                scratch.fresh_source(Source::Wal).await?;
                let (_, names) = scratch.wal_names();
                let program = pg_recvlogical(&scratch.pool).await?;
                let mut child = recvlogical_command(
                    &scratch.url,
                    &program,
                    &names.slot,
                    &names.publication,
                    None,
                )?
                .stderr(Stdio::null())
                .spawn()?;
                let deadline = Instant::now() + Duration::from_secs(30);
                while !pgoutbox::wal::slot::status(&scratch.pool, &names)
                    .await?
                    .is_some_and(|s| s.active)
                {
                    if let Some(status) = child.try_wait()? {
                        anyhow::bail!("pg_recvlogical stopped before streaming ({status})");
                    }
                    anyhow::ensure!(
                        Instant::now() < deadline,
                        "pg_recvlogical did not stream within 30 s"
                    );
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                tokio::time::sleep(Duration::from_millis(300)).await;
                let rate = unthrottled_with(scratch, args, "outbox", statement).await;
                let _ = child.kill().await;
                rate
            }
        }
    }
}

/// Runs `setups` `args.cost_pairs` times each, rotating which goes first; returns each setup's
/// commits/s, one vector per setup in `setups`' order.
async fn rounds(
    scratch: &Scratch,
    args: &Args,
    receiver: &Receiver,
    setups: &[Setup],
) -> anyhow::Result<Vec<Vec<f64>>> {
    let mut rates = vec![Vec::new(); setups.len()];
    for round in 0..args.cost_pairs.max(1) {
        for k in 0..setups.len() {
            let i = (round + k) % setups.len();
            rates[i].push(setups[i].measure(scratch, args, receiver).await?);
        }
    }
    Ok(rates)
}

/// The median of some ratios.
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Commit rate of unthrottled single-event producers: the pgoutbox table against the minimal one
/// (the schema's cost), alone, beside a relay, and with a NOTIFY trigger; for the WAL source,
/// with the WAL relay against no relay (see [`wal_producer_cost`]).
async fn producer_cost(
    scratch: &Scratch,
    out: &Output,
    args: &Args,
    receiver: &Receiver,
) -> anyhow::Result<()> {
    if args.source == Source::Wal {
        return wal_producer_cost(scratch, out, args, receiver).await;
    }
    let n = args.cost_connections;
    // Schema cost: A/B pairs on fresh tables, alternating which goes first.
    let mut ratios = Vec::new();
    let mut pairs = Vec::new();
    for pair in 0..args.cost_pairs.max(1) {
        let run = |minimal_first: bool| async move {
            let mut minimal = 0.0;
            let mut ours = 0.0;
            for minimal_turn in [minimal_first, !minimal_first] {
                if minimal_turn {
                    scratch.minimal_table("outbox_minimal").await?;
                    minimal = unthrottled(scratch, args, "outbox_minimal").await?;
                } else {
                    scratch.fresh_outbox().await?;
                    ours = unthrottled(scratch, args, "outbox").await?;
                }
            }
            Ok::<_, anyhow::Error>((minimal, ours))
        };
        let (minimal, ours) = run(pair % 2 == 0).await?;
        ratios.push(ours / minimal);
        pairs.push(format!("{ours:.0}/{minimal:.0}"));
    }
    sqlx::query("DROP TABLE IF EXISTS outbox_minimal")
        .execute(&scratch.pool)
        .await?;
    let schema_ratio = median(ratios);
    out.row(Row {
        scenario: "producers".into(),
        variant: format!("{n} conns, schema cost vs minimal table"),
        value: schema_ratio,
        unit: "× minimal",
        detail: format!(
            "median of {} A/B pairs (pgoutbox/minimal commits/s: {}); no relay running",
            pairs.len(),
            pairs.join(", ")
        ),
    });

    scratch.fresh_outbox().await?;
    let alone = unthrottled(scratch, args, "outbox").await?;

    scratch.fresh_outbox().await?;
    let mut spec = RelaySpec {
        null_sink: args.cost_sink == "null",
        ..RelaySpec::new(&receiver.url)
    };
    spec.min_poll = "250ms";
    let relay = RelayProcess::spawn(scratch, &spec)?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let fixed_poll = unthrottled(scratch, args, "outbox").await?;
    drop(relay);

    scratch.fresh_outbox().await?;
    let relay = RelayProcess::spawn(
        scratch,
        &RelaySpec {
            null_sink: args.cost_sink == "null",
            ..RelaySpec::new(&receiver.url)
        },
    )?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let with_relay = unthrottled(scratch, args, "outbox").await?;
    drop(relay);

    scratch.fresh_outbox().await?;
    sqlx::raw_sql(
        "CREATE FUNCTION bench_notify() RETURNS trigger LANGUAGE plpgsql AS
           $$ BEGIN PERFORM pg_notify('pgoutbox', ''); RETURN NULL; END $$;
         CREATE TRIGGER bench_notify AFTER INSERT ON outbox FOR EACH STATEMENT EXECUTE FUNCTION bench_notify();",
    )
    .execute(&scratch.pool)
    .await?;
    let with_notify = unthrottled(scratch, args, "outbox").await?;
    sqlx::raw_sql("DROP TRIGGER bench_notify ON outbox; DROP FUNCTION bench_notify();")
        .execute(&scratch.pool)
        .await?;

    for (variant, value) in [
        ("no relay (reference)", alone),
        ("relay, fixed 250 ms polling", fixed_poll),
        ("relay, adaptive polling (default)", with_relay),
        ("NOTIFY trigger per statement", with_notify),
    ] {
        out.row(Row {
            scenario: "producers".into(),
            variant: format!("{n} conns, {variant}"),
            value,
            unit: "commits/s",
            detail: format!(
                "{:.0} % of the reference, {:.0} % of the relay with fixed polling{}",
                value / alone * 100.0,
                value / fixed_poll * 100.0,
                match args.cost_sink.as_str() {
                    "webhook" => String::new(),
                    sink => format!("; relays deliver to the {sink} sink"),
                }
            ),
        });
    }
    Ok(())
}

/// The WAL source's producer cost, from rounds of unthrottled runs (each setting once per round,
/// rotating which goes first, on fresh tables; ratios are medians of the rounds' ratios).
/// INSERT producers: with the WAL relay streaming, and with pg_recvlogical streaming (the floor),
/// against no relay and no slot. emit() producers: alone, with the WAL relay and with
/// pg_recvlogical, against plain INSERTs into the minimal table with no relay.
async fn wal_producer_cost(
    scratch: &Scratch,
    out: &Output,
    args: &Args,
    receiver: &Receiver,
) -> anyhow::Result<()> {
    let n = args.cost_connections;
    // pg_recvlogical streaming the same slot is the floor of the WAL relay's cost, measured
    // when the program is there.
    let floor = match pg_recvlogical(&scratch.pool).await {
        Ok(_) => true,
        Err(e) => {
            eprintln!("pg_recvlogical floor not measured: {e:#}");
            false
        }
    };
    // (setting, its row, its ratio's row); the first is the reference.
    let mut settings: Vec<(Setup, &str, &str)> = match args.producer {
        Statement::Insert => vec![
            (
                Setup::Alone(Statement::Insert),
                "INSERT, no relay, no slot (reference)",
                "",
            ),
            (
                Setup::WalRelay(Statement::Insert),
                "INSERT, wal relay running",
                "wal relay vs no relay",
            ),
            (
                Setup::RecvLogical(Statement::Insert),
                "INSERT, pg_recvlogical running",
                "pg_recvlogical vs no relay (floor)",
            ),
        ],
        Statement::Emit => vec![
            (
                Setup::Minimal,
                "INSERT into minimal table, no relay (reference)",
                "",
            ),
            (
                Setup::Alone(Statement::Emit),
                "emit(), no relay, no slot",
                "emit() vs minimal INSERT, no relay",
            ),
            (
                Setup::WalRelay(Statement::Emit),
                "emit(), wal relay running",
                "emit() + wal relay vs minimal INSERT",
            ),
            (
                Setup::RecvLogical(Statement::Emit),
                "emit(), pg_recvlogical running",
                "emit() + pg_recvlogical vs minimal INSERT",
            ),
        ],
    };
    settings.retain(|s| floor || !matches!(s.0, Setup::RecvLogical(_)));
    let setups: Vec<Setup> = settings.iter().map(|s| s.0).collect();
    let rates = rounds(scratch, args, receiver, &setups).await?;
    for (i, runs) in rates.iter().enumerate() {
        let value = median(runs.clone());
        let reference = median(rates[0].clone());
        out.row(Row {
            scenario: "producers".into(),
            variant: format!("{n} conns, {}", settings[i].1),
            value,
            unit: "commits/s",
            detail: format!(
                "median of {} runs ({}); {:.0} % of the reference{}",
                runs.len(),
                runs.iter()
                    .map(|r| format!("{r:.0}"))
                    .collect::<Vec<_>>()
                    .join(", "),
                value / reference * 100.0,
                match settings[i].0 {
                    Setup::WalRelay(_) =>
                        format!("; relay delivers to the {} sink", args.cost_sink),
                    _ => String::new(),
                }
            ),
        });
    }
    for (i, runs) in rates.iter().enumerate().skip(1) {
        let ratios: Vec<f64> = runs
            .iter()
            .zip(&rates[0])
            .map(|(r, base)| r / base)
            .collect();
        out.row(Row {
            scenario: "producers".into(),
            variant: format!("{n} conns, {}", settings[i].2),
            value: median(ratios.clone()),
            unit: match args.producer {
                Statement::Insert => "× no relay",
                Statement::Emit => "× minimal INSERT",
            },
            detail: format!(
                "median of {} rounds (ratios {})",
                ratios.len(),
                ratios
                    .iter()
                    .map(|r| format!("{r:.2}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        });
    }
    Ok(())
}
