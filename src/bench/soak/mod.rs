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

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use super::latency::{follow_producer, timed_receiver, Summary, Times};
use super::metrics::Histogram;
use super::output::{Output, Row};
use super::process::{RelayProcess, RelaySpec};
use super::producer::{Spec, Statement};
use super::scratch::Scratch;

/// Arguments of `bench soak`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Events per mode.
    #[arg(long, default_value_t = 5_000_000)]
    events: u64,
    /// Commits per second, all producers together.
    #[arg(long, default_value_t = 3000)]
    rate: u64,
    /// Producer connections.
    #[arg(long, default_value_t = 8)]
    producers: usize,
    /// Settle modes to run, in order: keep (published_at, with cleanup), delete, partitions (kept
    /// in the partitioned history, partitions dropped by cleanup).
    #[arg(long, value_delimiter = ',', default_value = "keep,delete")]
    modes: Vec<String>,
    /// Keep mode: published rows older than this are deleted by cleanup.
    #[arg(long, default_value = "5m", value_parser = crate::flags::parse_duration)]
    retention: Duration,
    /// Keep mode: how often cleanup runs.
    #[arg(long, default_value = "1m", value_parser = crate::flags::parse_duration)]
    cleanup_interval: Duration,
    /// How often a line is printed.
    #[arg(long, default_value = "60s", value_parser = crate::flags::parse_duration)]
    every: Duration,
    /// Write every interval's figures to this CSV file.
    #[arg(long)]
    csv: Option<PathBuf>,
    /// Draw the curves into this SVG file.
    #[arg(long)]
    plot: Option<PathBuf>,
}

/// One interval's figures.
#[derive(Debug, Clone)]
struct Sample {
    mode: String,
    minute: f64,
    delivered: usize,
    claim_p99_ms: Option<f64>,
    latency: Summary,
    table_mb: f64,
    indexes_mb: f64,
    dead_tuples: i64,
    live_tuples: i64,
    machine: Machine,
}

/// What the machine and the relay did during one interval (Linux /proc; zeros elsewhere).
#[derive(Debug, Clone)]
struct Machine {
    /// CPU busy (not idle, not waiting on I/O), % of all cores.
    busy_pct: f64,
    /// CPU time the hypervisor gave to others, % of all cores.
    steal_pct: f64,
    /// The relay process's CPU, % of one core.
    relay_cpu_pct: f64,
    /// The relay's resident memory at the interval's end, MiB.
    relay_rss_mb: f64,
    /// Checkpoints the server started (timed or requested).
    checkpoints: i64,
    /// Autovacuum runs on the outbox (and its history).
    vacuums: i64,
}

/// Cumulative counters read at each interval's end; `Machine` is the difference of two.
#[derive(Debug, Clone, Copy)]
struct Counters {
    cpu_total: u64,
    cpu_idle: u64,
    cpu_steal: u64,
    relay_cpu: Duration,
    relay_rss_kib: u64,
    at: Instant,
    checkpoints: i64,
    vacuums: i64,
}

impl Counters {
    /// Reads /proc/stat's first line, the relay's CPU time and memory and the server's
    /// checkpoint count; `vacuums` is the outbox's autovacuum count, read with its sizes.
    async fn read(pool: &sqlx::PgPool, relay: &RelayProcess, vacuums: i64) -> Self {
        let (mut cpu_total, mut cpu_idle, mut cpu_steal) = (0, 0, 0);
        if let Some(line) = std::fs::read_to_string("/proc/stat")
            .ok()
            .and_then(|s| s.lines().next().map(str::to_owned))
        {
            // cpu user nice system idle iowait irq softirq steal (guest time is inside user).
            let v: Vec<u64> = line
                .split_whitespace()
                .skip(1)
                .take(8)
                .filter_map(|x| x.parse().ok())
                .collect();
            if v.len() == 8 {
                cpu_total = v.iter().sum();
                cpu_idle = v[3] + v[4];
                cpu_steal = v[7];
            }
        }
        // pg_stat_bgwriter holds the checkpoint counts up to PostgreSQL 16, pg_stat_checkpointer
        // from 17.
        let mut checkpoints = 0;
        for query in [CHECKPOINTS_TO_16, CHECKPOINTS_FROM_17] {
            if let Ok(n) = sqlx::query_scalar::<_, i64>(query).fetch_one(pool).await {
                checkpoints = n;
                break;
            }
        }
        Self {
            cpu_total,
            cpu_idle,
            cpu_steal,
            relay_cpu: relay.cpu(),
            relay_rss_kib: relay.rss_kib(),
            at: Instant::now(),
            checkpoints,
            vacuums,
        }
    }

    /// What happened between `before` and `self`.
    fn since(&self, before: &Self) -> Machine {
        let total = self.cpu_total.saturating_sub(before.cpu_total).max(1) as f64;
        let idle = self.cpu_idle.saturating_sub(before.cpu_idle) as f64;
        let steal = self.cpu_steal.saturating_sub(before.cpu_steal) as f64;
        let wall = self.at.duration_since(before.at).as_secs_f64().max(1e-3);
        Machine {
            busy_pct: 100.0 * (total - idle - steal).max(0.0) / total,
            steal_pct: 100.0 * steal / total,
            relay_cpu_pct: 100.0
                * self
                    .relay_cpu
                    .saturating_sub(before.relay_cpu)
                    .as_secs_f64()
                / wall,
            relay_rss_mb: self.relay_rss_kib as f64 / 1024.0,
            checkpoints: self.checkpoints - before.checkpoints,
            vacuums: self.vacuums - before.vacuums,
        }
    }
}

/// CheckpointsStarted (PostgreSQL ≤ 16).
const CHECKPOINTS_TO_16: &str =
    "SELECT (checkpoints_timed + checkpoints_req)::bigint FROM pg_stat_bgwriter";
/// CheckpointsStarted (PostgreSQL ≥ 17, where the counts moved to their own view).
const CHECKPOINTS_FROM_17: &str =
    "SELECT (num_timed + num_requested)::bigint FROM pg_stat_checkpointer";

/// OutboxSizes. Heap and index sizes, the statistics' tuple counts and the autovacuum runs so far
/// of the outbox and of its history's partitions (empty unless `history = "partitions"`); a
/// partition dropped meanwhile counts for nothing.
const SIZES: &str = "
WITH t AS (SELECT 'outbox'::regclass AS relid
           UNION ALL SELECT relid FROM pg_partition_tree('outbox_history') WHERE isleaf)
SELECT coalesce(sum(pg_relation_size(t.relid)), 0)::float8 / 1048576,
       coalesce(sum(pg_indexes_size(t.relid)), 0)::float8 / 1048576,
       coalesce(sum(s.n_dead_tup), 0)::bigint, coalesce(sum(s.n_live_tup), 0)::bigint,
       coalesce(sum(s.autovacuum_count), 0)::bigint
FROM t LEFT JOIN pg_stat_user_tables s ON s.relid = t.relid";

/// One reading of [`SIZES`]: table MB, indexes MB, dead and live tuples, autovacuum runs.
type Sizes = (f64, f64, i64, i64, i64);

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
    let mut samples = Vec::new();
    let mut metrics = Histogram::parse(&relay.metrics().await, pgoutbox::observe::CLAIM_SECONDS);
    let mut delivered_total = 0;
    let (.., vacuums): Sizes = sqlx::query_as(SIZES).fetch_one(&scratch.pool).await?;
    let mut counters = Counters::read(&scratch.pool, &relay, vacuums).await;
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + args.every, args.every);
    let mut producer = Some(producer);
    let mut quiet_since: Option<Instant> = None;
    loop {
        tick.tick().await;
        let latencies = take_delivered(&committed, &received);
        delivered_total += latencies.len();
        bar.set_position(delivered_total as u64);
        let now = Histogram::parse(&relay.metrics().await, pgoutbox::observe::CLAIM_SECONDS);
        let claims = now.since(&metrics);
        metrics = now;
        let (table_mb, indexes_mb, dead_tuples, live_tuples, vacuums): Sizes =
            sqlx::query_as(SIZES).fetch_one(&scratch.pool).await?;
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
    Ok(samples)
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

fn row(s: &Sample) -> Row {
    Row {
        scenario: "soak".into(),
        variant: format!("{} minute {:>5.1}", s.mode, s.minute),
        value: s.latency.p99,
        unit: "ms p99",
        detail: format!(
            "claim p99 {}, max {:.1} ms, {} delivered; table {:.0} MB + indexes {:.0} MB, {} live, {} dead tuples; CPU {:.0} % busy, {:.1} % stolen, relay {:.0} % of a core, {:.0} MiB; {} checkpoints, {} vacuums",
            s.claim_p99_ms
                .map_or("n/a".to_owned(), |ms| format!("≤ {ms} ms")),
            s.latency.max,
            s.delivered,
            s.table_mb,
            s.indexes_mb,
            s.live_tuples,
            s.dead_tuples,
            s.machine.busy_pct,
            s.machine.steal_pct,
            s.machine.relay_cpu_pct,
            s.machine.relay_rss_mb,
            s.machine.checkpoints,
            s.machine.vacuums
        ),
    }
}

/// The verdict lines: p99 drift, size growth after the first retention period, missing events.
fn summarize(out: &Output, args: &Args, mode: &str, samples: &[Sample], delivered: usize) {
    // Full intervals only: the first is the start-up, the tail is the drain after the producers.
    let full: Vec<&Sample> = samples.iter().filter(|s| s.delivered > 0).collect();
    let (Some(first), Some(last)) = (full.first(), full.iter().rev().nth(1).or(full.last())) else {
        return;
    };
    let settled = match mode {
        "keep" => args.retention.as_secs_f64() / 60.0 + args.cleanup_interval.as_secs_f64() / 60.0,
        // Plus one partition: the oldest is dropped once its whole range is past retention.
        "partitions" => {
            args.retention.as_secs_f64() / 60.0
                + args.cleanup_interval.as_secs_f64() / 60.0
                + pgoutbox::history::width_minutes(args.retention) as f64
        }
        _ => 1.0,
    };
    // Dropping whole partitions makes the sizes a saw-tooth (one partition's worth): compare the
    // largest of the first and the last few intervals rather than two points of it.
    let size = |s: &Sample| s.table_mb + s.indexes_mb;
    // Retention keeps a varying number of rows (cleanup's phase, a partition more or less): the
    // space each retained row takes is what grows when a table bloats.
    let per_row = |s: &Sample| size(s) * 1_048_576.0 / s.live_tuples.max(1) as f64;
    let running: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.minute >= settled && s.delivered > 0)
        .collect();
    let window = 5.min(running.len());
    let largest = |w: &[&Sample]| -> Option<Sample> {
        w.iter()
            .max_by(|a, b| size(a).total_cmp(&size(b)))
            .map(|s| (*s).clone())
    };
    let after = largest(&running[..window]);
    let end = largest(&running[running.len() - window..]);
    out.row(Row {
        scenario: "soak".into(),
        variant: format!("{mode}: last / first interval p99"),
        value: last.latency.p99 / first.latency.p99,
        unit: "×",
        detail: format!(
            "commit→publish p99 {:.1} → {:.1} ms (target ≤ 1.5×); in those intervals {} → {} delivered, CPU {:.0} → {:.0} % busy, {:.1} → {:.1} % stolen, relay {:.0} → {:.0} % of a core; {delivered} of {} delivered",
            first.latency.p99,
            last.latency.p99,
            first.delivered,
            last.delivered,
            first.machine.busy_pct,
            last.machine.busy_pct,
            first.machine.steal_pct,
            last.machine.steal_pct,
            first.machine.relay_cpu_pct,
            last.machine.relay_cpu_pct,
            args.events
        ),
    });
    if let (Some(after), Some(end)) = (after, end) {
        out.row(Row {
            scenario: "soak".into(),
            variant: format!("{mode}: size growth after minute {settled:.0}"),
            value: size(&end) / size(&after).max(0.001),
            unit: "×",
            detail: format!(
                "largest table + indexes of {window} intervals: {:.0} MB at minute {:.1} → {:.0} MB at minute {:.1}; {:.0} → {:.0} bytes per live row; dead tuples {} → {}",
                size(&after),
                after.minute,
                size(&end),
                end.minute,
                per_row(&after),
                per_row(&end),
                after.dead_tuples,
                end.dead_tuples
            ),
        });
    }
}

fn csv(samples: &[Sample]) -> String {
    let mut s = String::from(
        "mode,minute,delivered,claim_p99_ms,latency_p50_ms,latency_p99_ms,latency_max_ms,table_mb,indexes_mb,dead_tuples,live_tuples,cpu_busy_pct,cpu_steal_pct,relay_cpu_pct,relay_rss_mb,checkpoints,vacuums\n",
    );
    for x in samples {
        let _ = writeln!(
            s,
            "{},{:.2},{},{},{:.3},{:.3},{:.3},{:.1},{:.1},{},{},{:.1},{:.2},{:.1},{:.1},{},{}",
            x.mode,
            x.minute,
            x.delivered,
            x.claim_p99_ms.map_or(String::new(), |v| v.to_string()),
            x.latency.p50,
            x.latency.p99,
            x.latency.max,
            x.table_mb,
            x.indexes_mb,
            x.dead_tuples,
            x.live_tuples,
            x.machine.busy_pct,
            x.machine.steal_pct,
            x.machine.relay_cpu_pct,
            x.machine.relay_rss_mb,
            x.machine.checkpoints,
            x.machine.vacuums
        );
    }
    s
}

/// Stacked charts over minutes: commit→publish p99, events delivered, CPU stolen, claim p99,
/// table + index size, dead tuples; one colour per mode.
fn plot(samples: &[Sample], args: &Args) -> String {
    type Metric = fn(&Sample) -> Option<f64>;
    let panels: [(&str, Metric); 6] = [
        ("commit→publish p99 (ms)", |s| {
            (s.delivered > 0).then_some(s.latency.p99)
        }),
        ("events delivered per interval (thousands)", |s| {
            Some(s.delivered as f64 / 1000.0)
        }),
        ("CPU stolen by the hypervisor (% of all cores)", |s| {
            Some(s.machine.steal_pct)
        }),
        ("claim p99 (ms, bucket bound)", |s| s.claim_p99_ms),
        ("table + indexes (MB)", |s| Some(s.table_mb + s.indexes_mb)),
        ("dead tuples (thousands)", |s| {
            Some(s.dead_tuples as f64 / 1000.0)
        }),
    ];
    let (w, h, margin) = (760.0, 170.0, 50.0);
    let colours = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"];
    let max_minute = samples.iter().map(|s| s.minute).fold(1.0, f64::max);
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{}\" font-family=\"sans-serif\" font-size=\"11\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"{margin}\" y=\"18\" font-size=\"13\">pgoutbox bench soak: {} events per mode at {}/s</text>\n",
        30.0 + panels.len() as f64 * (h + 30.0),
        args.events,
        args.rate
    );
    for (i, (title, metric)) in panels.iter().enumerate() {
        let top = 30.0 + i as f64 * (h + 30.0);
        let max_y = samples
            .iter()
            .filter_map(metric)
            .fold(0.0f64, f64::max)
            .max(1e-9);
        let _ = writeln!(
            svg,
            "<text x=\"{margin}\" y=\"{}\">{title} — max {max_y:.1}</text><rect x=\"{margin}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"#999\"/>",
            top + 12.0,
            top + 16.0,
            w - 2.0 * margin,
            h - 16.0
        );
        let mut modes: Vec<&str> = samples.iter().map(|s| s.mode.as_str()).collect();
        modes.dedup();
        for (m, mode) in modes.iter().enumerate() {
            let points: Vec<String> = samples
                .iter()
                .filter(|s| s.mode == *mode)
                .filter_map(|s| metric(s).map(|v| (s.minute, v)))
                .map(|(x, y)| {
                    format!(
                        "{:.1},{:.1}",
                        margin + x / max_minute * (w - 2.0 * margin),
                        top + h - y / max_y * (h - 20.0)
                    )
                })
                .collect();
            let colour = colours[m % colours.len()];
            let _ = writeln!(
                svg,
                "<polyline fill=\"none\" stroke=\"{colour}\" stroke-width=\"1.5\" points=\"{}\"/><text x=\"{}\" y=\"{}\" fill=\"{colour}\">{mode}</text>",
                points.join(" "),
                w - margin - 60.0,
                top + 30.0 + m as f64 * 13.0
            );
        }
    }
    let _ = writeln!(
        svg,
        "<text x=\"{margin}\" y=\"{}\">minutes since the mode's start (0 – {max_minute:.0})</text>\n</svg>",
        30.0 + panels.len() as f64 * (h + 30.0) - 8.0
    );
    svg
}
