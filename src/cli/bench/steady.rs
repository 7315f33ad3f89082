//! `bench steady`: producers commit single-event transactions at a target rate while a relay
//! process delivers them to a local webhook receiver. Reports commit→publish latency, the relay's
//! CPU, its CPU when idle, and what the wake-up mechanism costs producers.
//!
//! Wake-up: the relay polls adaptively (at once after a non-empty claim, then 1 ms doubling up to
//! `poll_interval` when idle). The producer-cost part compares the producers' commit rate with no
//! relay, with the relay running, and with a statement-level NOTIFY trigger (the alternative).

use std::collections::HashMap;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sqlx::postgres::PgPoolOptions;

use super::drain::Receiver;
use super::{rate, Output, Row, Scratch};

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
    #[arg(long, default_value = "20s", value_parser = crate::cli::parse_duration)]
    duration: Duration,
    /// Producer connections for the producer-cost measurement (0 skips it).
    #[arg(long, default_value_t = 32)]
    cost_connections: usize,
    /// How long each producer-cost run lasts.
    #[arg(long, default_value = "10s", value_parser = crate::cli::parse_duration)]
    cost_duration: Duration,
    /// How long the idle relay's CPU is measured (0s skips it).
    #[arg(long, default_value = "60s", value_parser = crate::cli::parse_duration)]
    idle: Duration,
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
            idle: Duration::from_secs(5),
        }
    }
}

/// A relay child process and its /proc counters.
struct RelayProcess {
    child: std::process::Child,
    _dir: tempfile::TempDir,
}

impl RelayProcess {
    fn spawn(scratch: &Scratch, receiver_url: &str, min_poll: &str) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("bench.toml");
        std::fs::write(
            &path,
            format!(
                "database_url = \"{}\"\nretention = \"0s\"\n[relay]\nmin_poll_interval = \"{min_poll}\"\n[[destinations]]\nname = \"bench\"\ntype = \"webhook\"\nurl = \"{receiver_url}\"\nconcurrency = 128\n",
                scratch.url
            ),
        )?;
        let child = std::process::Command::new(std::env::current_exe()?)
            .args(["relay", "--config"])
            .arg(&path)
            .env_remove("DATABASE_URL")
            .env_remove("PGOUTBOX_DATABASE_URL")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        Ok(Self { child, _dir: dir })
    }

    /// User + system CPU time so far.
    fn cpu(&self) -> Duration {
        proc_cpu(self.child.id()).unwrap_or_default()
    }

    /// Peak resident memory in KiB.
    fn peak_rss_kib(&self) -> u64 {
        proc_peak_rss_kib(self.child.id()).unwrap_or(0)
    }
}

impl Drop for RelayProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// CPU time of a process from /proc (Linux).
pub fn proc_cpu(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces) start after the last ')'.
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    // Clock ticks are 100 per second on Linux.
    Some(Duration::from_millis((utime + stime) * 10))
}

/// Peak resident set size of a process from /proc (Linux), KiB.
pub fn proc_peak_rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

pub async fn run(scratch: &Scratch, out: &Output, args: &Args) -> anyhow::Result<()> {
    scratch.fresh_outbox().await?;
    let received: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let rec = received.clone();
    let receiver = Receiver::with_hook(move |id| {
        if let Ok(mut m) = rec.lock() {
            m.entry(id.to_owned()).or_insert_with(Instant::now);
        }
    })
    .await?;
    let relay = RelayProcess::spawn(scratch, &receiver.url, "1ms")?;
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
            variant: "relay process, empty outbox".into(),
            value: cpu,
            unit: "% CPU",
            detail: format!(
                "over {:?} (adaptive polling, poll_interval 250ms)",
                args.idle
            ),
        });
    }

    // Steady load.
    let committed: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let cpu_before = relay.cpu();
    let started = Instant::now();
    let count = produce(
        scratch,
        args.producers,
        Some(args.rate),
        args.duration,
        Some(committed.clone()),
    )
    .await?;
    let produce_elapsed = started.elapsed();
    let wait_until = Instant::now() + Duration::from_secs(30);
    while received.lock().map(|m| m.len()).unwrap_or(0) < count as usize
        && Instant::now() < wait_until
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let cpu = (relay.cpu() - cpu_before).as_secs_f64() / started.elapsed().as_secs_f64() * 100.0;
    let mut latencies: Vec<Duration> = {
        let committed = committed.lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
        let received = received.lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
        committed
            .iter()
            .filter_map(|(id, c)| received.get(id).map(|r| r.saturating_duration_since(*c)))
            .collect()
    };
    latencies.sort();
    let pct = |p: f64| {
        latencies
            .get(((latencies.len() as f64 * p) as usize).min(latencies.len().saturating_sub(1)))
            .map(|d| d.as_secs_f64() * 1000.0)
            .unwrap_or(f64::NAN)
    };
    let variant = format!("{} producers, target {}/s", args.producers, args.rate);
    out.row(Row {
        scenario: "steady".into(),
        variant: variant.clone(),
        value: pct(0.50),
        unit: "ms p50",
        detail: format!(
            "p95 {:.1} ms, p99 {:.1} ms, max {:.1} ms; achieved {:.0} commits/s, {} delivered of {}; relay CPU {:.0} %, peak RSS {} MiB",
            pct(0.95),
            pct(0.99),
            latencies.last().map(|d| d.as_secs_f64() * 1000.0).unwrap_or(f64::NAN),
            rate(count, produce_elapsed),
            latencies.len(),
            count,
            cpu,
            relay.peak_rss_kib() / 1024
        ),
    });
    drop(relay);

    if args.cost_connections > 0 {
        producer_cost(scratch, out, args, &receiver).await?;
    }
    Ok(())
}

/// Commit rate of unthrottled single-event producers: alone, beside a relay, and with a NOTIFY trigger.
async fn producer_cost(
    scratch: &Scratch,
    out: &Output,
    args: &Args,
    receiver: &Receiver,
) -> anyhow::Result<()> {
    let n = args.cost_connections;
    let d = args.cost_duration;
    scratch.fresh_outbox().await?;
    let alone = rate(produce(scratch, n, None, d, None).await?, d);

    scratch.fresh_outbox().await?;
    let relay = RelayProcess::spawn(scratch, &receiver.url, "250ms")?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let fixed_poll = rate(produce(scratch, n, None, d, None).await?, d);
    drop(relay);

    scratch.fresh_outbox().await?;
    let relay = RelayProcess::spawn(scratch, &receiver.url, "1ms")?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let with_relay = rate(produce(scratch, n, None, d, None).await?, d);
    drop(relay);

    scratch.fresh_outbox().await?;
    sqlx::raw_sql(
        "CREATE FUNCTION bench_notify() RETURNS trigger LANGUAGE plpgsql AS
           $$ BEGIN PERFORM pg_notify('pgoutbox', ''); RETURN NULL; END $$;
         CREATE TRIGGER bench_notify AFTER INSERT ON outbox FOR EACH STATEMENT EXECUTE FUNCTION bench_notify();",
    )
    .execute(&scratch.pool)
    .await?;
    let with_notify = rate(produce(scratch, n, None, d, None).await?, d);
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
                "{:.0} % of the reference, {:.0} % of the relay with fixed polling",
                value / alone * 100.0,
                value / fixed_poll * 100.0
            ),
        });
    }
    Ok(())
}

/// Runs `producers` connections committing one-event transactions for `duration`, at `rate` in
/// total if given (else as fast as they can); records commit times when asked. Returns commits.
async fn produce(
    scratch: &Scratch,
    producers: usize,
    rate_limit: Option<u64>,
    duration: Duration,
    committed: Option<Arc<Mutex<HashMap<String, Instant>>>>,
) -> anyhow::Result<u64> {
    let pool = PgPoolOptions::new()
        .max_connections(producers as u32)
        .connect(&scratch.url)
        .await?;
    let total = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for _ in 0..producers {
        let (pool, total, stop, committed) =
            (pool.clone(), total.clone(), stop.clone(), committed.clone());
        let period =
            rate_limit.map(|r| Duration::from_secs_f64(producers as f64 / r.max(1) as f64));
        tasks.push(tokio::spawn(async move {
            let mut ticker = period.map(|p| {
                let mut t = tokio::time::interval(p);
                t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                t
            });
            while !stop.load(Ordering::Relaxed) {
                if let Some(t) = ticker.as_mut() {
                    t.tick().await;
                }
                let id: uuid::Uuid = sqlx::query_scalar(
                    "INSERT INTO outbox (topic, payload) VALUES ('bench.steady', '{\"order_id\": 1}') RETURNING id",
                )
                .fetch_one(&pool)
                .await?;
                let now = Instant::now();
                total.fetch_add(1, Ordering::Relaxed);
                if let Some(c) = &committed {
                    if let Ok(mut m) = c.lock() {
                        m.insert(id.to_string(), now);
                    }
                }
            }
            Ok::<_, sqlx::Error>(())
        }));
    }
    tokio::time::sleep(duration).await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await??;
    }
    pool.close().await;
    Ok(total.load(Ordering::Relaxed))
}
