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

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use super::drain::Receiver;
use super::output::{rate, Output, Row};
use super::produce::{unix_micros, Producer, Spec, Statement};
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

/// How the bench's relay process is configured.
pub struct RelaySpec<'a> {
    /// Webhook receiver URL.
    pub receiver_url: &'a str,
    /// `relay.min_poll_interval`.
    pub min_poll: &'a str,
    /// `relay.poll_interval` (None: the relay's default).
    pub poll_interval: Option<&'a str>,
    /// `retention` ("0s": delete at settle).
    pub retention: &'a str,
    /// `history` ("outbox" or "partitions").
    pub history: &'a str,
    /// `cleanup_interval`.
    pub cleanup_interval: &'a str,
    /// `relay.synchronous_commit`.
    pub synchronous_commit: &'a str,
    /// `source`.
    pub source: Source,
    /// `relay.batch_size` (None: the relay's default).
    pub batch_size: Option<usize>,
    /// `wal.status_interval` (None: the relay's default).
    pub wal_status_interval: Option<&'a str>,
    /// `wal.batch_wait` (None: the relay's default).
    pub wal_batch_wait: Option<&'a str>,
    /// The null sink instead of the webhook receiver.
    pub null_sink: bool,
}

impl<'a> RelaySpec<'a> {
    /// Delete mode, adaptive polling from 1 ms.
    pub fn new(receiver_url: &'a str) -> Self {
        Self {
            receiver_url,
            min_poll: "1ms",
            poll_interval: None,
            retention: "0s",
            history: "outbox",
            cleanup_interval: "1m",
            synchronous_commit: "on",
            source: Source::Poll,
            batch_size: None,
            wal_status_interval: None,
            wal_batch_wait: None,
            null_sink: false,
        }
    }
}

/// A relay child process, its /proc counters and its metrics endpoint.
pub struct RelayProcess {
    child: std::process::Child,
    metrics_url: String,
    dir: tempfile::TempDir,
}

impl RelayProcess {
    /// Starts `pgoutbox relay` on the scratch database with one webhook destination.
    pub fn spawn(scratch: &Scratch, spec: &RelaySpec<'_>) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("bench.toml");
        // A free port for the metrics endpoint: bound, then released for the relay to take.
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let destination = if spec.null_sink {
            "type = \"null\"\n".to_owned()
        } else {
            format!(
                "type = \"webhook\"\nurl = \"{}\"\nconcurrency = 128\n",
                spec.receiver_url
            )
        };
        std::fs::write(
            &path,
            format!(
                "database_url = \"{url}\"\nsource = \"{source}\"\nretention = \"{retention}\"\nhistory = \"{history}\"\ncleanup_interval = \"{cleanup}\"\n\
                 [relay]\nmin_poll_interval = \"{min_poll}\"\nsynchronous_commit = \"{sync}\"\n{poll}{batch}\
                 [wal]\nslot = \"{slot}\"\n{status}{batch_wait}\
                 [observability]\nlisten = \"127.0.0.1:{port}\"\n\
                 [[destinations]]\nname = \"bench\"\n{destination}",
                url = scratch.url,
                source = spec.source.as_str(),
                slot = scratch.wal_names().1.slot,
                retention = spec.retention,
                history = spec.history,
                cleanup = spec.cleanup_interval,
                min_poll = spec.min_poll,
                sync = spec.synchronous_commit,
                poll = spec
                    .poll_interval
                    .map(|p| format!("poll_interval = \"{p}\"\n"))
                    .unwrap_or_default(),
                batch = spec
                    .batch_size
                    .map(|b| format!("batch_size = {b}\n"))
                    .unwrap_or_default(),
                status = spec
                    .wal_status_interval
                    .map(|s| format!("status_interval = \"{s}\"\n"))
                    .unwrap_or_default(),
                batch_wait = spec
                    .wal_batch_wait
                    .map(|w| format!("batch_wait = \"{w}\"\n"))
                    .unwrap_or_default(),
            ),
        )?;
        // Its log is kept beside the config, to explain a relay that stops early.
        let log = dir.path().join("relay.log");
        let child = std::process::Command::new(std::env::current_exe()?)
            .args(["relay", "--config"])
            .arg(&path)
            .env_remove("DATABASE_URL")
            .env_remove("PGOUTBOX_DATABASE_URL")
            .env_remove("PGOUTBOX_SOURCE")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log)?)
            .spawn()?;
        Ok(Self {
            child,
            metrics_url: format!("http://127.0.0.1:{port}/metrics"),
            dir,
        })
    }

    /// Why the relay process is gone (its exit status and the end of its log), `None` while it
    /// runs.
    pub fn exited(&mut self) -> Option<String> {
        let status = self.child.try_wait().ok().flatten()?;
        Some(format!("{status}: {}", self.log_tail()))
    }

    /// The last lines of the relay's log, on one line.
    pub fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.dir.path().join("relay.log")).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(5).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        tail.join(" | ")
    }

    /// Waits until the relay streams its replication slot (`source = "wal"`), at most 30 s.
    pub async fn wait_streaming(&mut self, scratch: &Scratch) -> anyhow::Result<()> {
        let pool = &scratch.pool;
        let (_, names) = scratch.wal_names();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let status = pgoutbox::wal::slot::status(pool, &names).await?;
            if status.is_some_and(|s| s.active) {
                return Ok(());
            }
            if let Some(why) = self.exited() {
                anyhow::bail!("the relay process stopped before streaming its slot ({why})");
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "the relay did not stream slot {} within 30 s",
                names.slot
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// User + system CPU time so far.
    pub fn cpu(&self) -> Duration {
        proc_cpu(self.child.id()).unwrap_or_default()
    }

    /// Peak resident memory in KiB.
    pub fn peak_rss_kib(&self) -> u64 {
        proc_peak_rss_kib(self.child.id()).unwrap_or(0)
    }

    /// Resident memory now, in KiB.
    pub fn rss_kib(&self) -> u64 {
        proc_status_kib(self.child.id(), "VmRSS:").unwrap_or(0)
    }

    /// The relay's Prometheus scrape (empty when it cannot be read).
    pub async fn metrics(&self) -> String {
        match reqwest::get(&self.metrics_url).await {
            Ok(r) => r.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        }
    }
}

impl Drop for RelayProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A histogram from a Prometheus scrape: cumulative bucket counts by upper bound, summed over
/// label sets.
#[derive(Debug, Clone, Default)]
pub struct Histogram {
    buckets: BTreeMap<u64, f64>,
}

impl Histogram {
    /// Reads `<name>_bucket` lines from `scrape`.
    pub fn parse(scrape: &str, name: &str) -> Self {
        let prefix = format!("{name}_bucket{{");
        let mut buckets = BTreeMap::new();
        for line in scrape.lines().filter(|l| l.starts_with(&prefix)) {
            let Some((labels, value)) = line.rsplit_once(' ') else {
                continue;
            };
            let Some(le) = labels
                .split("le=\"")
                .nth(1)
                .and_then(|r| r.split('"').next())
            else {
                continue;
            };
            let bound = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().unwrap_or(f64::INFINITY)
            };
            // Bounds as ordered keys: microseconds (the buckets are ≥ 0.5 ms apart).
            let key = if bound.is_finite() {
                (bound * 1e6) as u64
            } else {
                u64::MAX
            };
            *buckets.entry(key).or_insert(0.0) += value.parse::<f64>().unwrap_or(0.0);
        }
        Self { buckets }
    }

    /// What was observed since `earlier` (bucket by bucket).
    pub fn since(&self, earlier: &Self) -> Self {
        let buckets = self
            .buckets
            .iter()
            .map(|(k, v)| (*k, v - earlier.buckets.get(k).copied().unwrap_or(0.0)))
            .collect();
        Self { buckets }
    }

    /// Observations in all.
    pub fn count(&self) -> f64 {
        self.buckets.get(&u64::MAX).copied().unwrap_or(0.0)
    }

    /// The upper bound of the bucket holding quantile `q`, in the metric's own unit (events for
    /// the batch size); `None` when empty or past the last finite bucket.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        self.quantile_ms(q).map(|ms| ms / 1000.0)
    }

    /// The upper bound (ms) of the bucket holding quantile `q`: "at most this"; `None` when empty
    /// or past the last finite bucket.
    pub fn quantile_ms(&self, q: f64) -> Option<f64> {
        let total = self.count();
        if total <= 0.0 {
            return None;
        }
        let rank = total * q;
        self.buckets
            .iter()
            .find(|(_, c)| **c >= rank)
            .and_then(|(k, _)| (*k != u64::MAX).then(|| *k as f64 / 1000.0))
    }
}

/// Commit→publish latencies, by commit time.
#[derive(Debug, Default)]
pub struct Latencies {
    /// (commit time µs since the epoch, latency µs).
    samples: Vec<(u64, u64)>,
}

/// Percentiles of a set of latencies, in ms.
#[derive(Debug, Clone, Copy)]
pub struct Summary {
    /// Samples.
    pub count: usize,
    /// Median.
    pub p50: f64,
    /// 95th percentile.
    pub p95: f64,
    /// 99th percentile.
    pub p99: f64,
    /// 99.9th percentile.
    pub p999: f64,
    /// Largest.
    pub max: f64,
}

impl Summary {
    /// Percentiles of `latencies` (µs).
    pub fn of(mut latencies: Vec<u64>) -> Self {
        latencies.sort_unstable();
        let pct = |p: f64| {
            latencies
                .get(((latencies.len() as f64 * p) as usize).min(latencies.len().saturating_sub(1)))
                .map(|us| *us as f64 / 1000.0)
                .unwrap_or(f64::NAN)
        };
        Self {
            count: latencies.len(),
            p50: pct(0.50),
            p95: pct(0.95),
            p99: pct(0.99),
            p999: pct(0.999),
            max: latencies
                .last()
                .map(|us| *us as f64 / 1000.0)
                .unwrap_or(f64::NAN),
        }
    }
}

impl Latencies {
    /// Pairs commits with arrivals (both µs since the epoch) by event id.
    pub fn join(committed: &HashMap<String, u64>, received: &HashMap<String, u64>) -> Self {
        let samples = committed
            .iter()
            .filter_map(|(id, c)| received.get(id).map(|r| (*c, r.saturating_sub(*c))))
            .collect();
        Self { samples }
    }

    /// All of them.
    pub fn summary(&self) -> Summary {
        Summary::of(self.samples.iter().map(|(_, l)| *l).collect())
    }

    /// Per second of commit time (seconds since the epoch), in order.
    pub fn per_second(&self) -> BTreeMap<u64, Summary> {
        let mut by_second: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
        for (at, l) in &self.samples {
            by_second.entry(at / 1_000_000).or_default().push(*l);
        }
        by_second
            .into_iter()
            .map(|(s, v)| (s, Summary::of(v)))
            .collect()
    }
}

/// What the checkpointer did, second by second (since the epoch): its wait events other than
/// `CheckpointerMain` (idle), sampled every 100 ms. A spread checkpoint shows as
/// `CheckpointWriteDelay` for minutes; its sync phase (`DataFileSync`, `DataFileFlush`) is when
/// commits may wait on the disk. Stops when dropped.
pub struct CheckpointWatch {
    seconds: Arc<Mutex<BTreeMap<u64, BTreeSet<String>>>>,
    task: tokio::task::JoinHandle<()>,
}

impl CheckpointWatch {
    /// Starts sampling on `pool`.
    pub fn start(pool: &sqlx::PgPool) -> Self {
        let seconds: Arc<Mutex<BTreeMap<u64, BTreeSet<String>>>> = Arc::default();
        let (pool, out) = (pool.clone(), seconds.clone());
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(100));
            loop {
                tick.tick().await;
                let event: Option<String> = sqlx::query_scalar(
                    "SELECT coalesce(wait_event, 'running') FROM pg_stat_activity
                     WHERE backend_type = 'checkpointer'",
                )
                .fetch_optional(&pool)
                .await
                .ok()
                .flatten();
                if let Some(event) = event.filter(|e| e != "CheckpointerMain") {
                    if let Ok(mut s) = out.lock() {
                        s.entry(unix_micros(SystemTime::now()) / 1_000_000)
                            .or_default()
                            .insert(event);
                    }
                }
            }
        });
        Self { seconds, task }
    }

    /// What the checkpointer was doing during second `s` ("" when idle).
    pub fn during(&self, s: u64) -> String {
        self.seconds
            .lock()
            .ok()
            .and_then(|x| {
                x.get(&s)
                    .map(|e| e.iter().cloned().collect::<Vec<_>>().join("+"))
            })
            .unwrap_or_default()
    }

    /// Seconds in which the checkpointer was not idle.
    pub fn count(&self) -> usize {
        self.seconds.lock().map(|x| x.len()).unwrap_or(0)
    }
}

impl Drop for CheckpointWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A receiver that records each event's arrival time (µs since the epoch) by id.
pub async fn timed_receiver() -> anyhow::Result<(Receiver, Times)> {
    let received: Arc<Mutex<HashMap<String, u64>>> = Arc::default();
    let rec = received.clone();
    let receiver = Receiver::with_hook(move |id| {
        let at = unix_micros(SystemTime::now());
        if let Ok(mut m) = rec.lock() {
            m.entry(id.to_owned()).or_insert(at);
        }
    })
    .await?;
    Ok((receiver, received))
}

/// Event ids with a time in µs since the epoch (commit or arrival).
pub type Times = Arc<Mutex<HashMap<String, u64>>>;

/// Starts a reporting producer process and collects its commits (id → µs) on a blocking thread;
/// the handle ends with the producer and gives its commit count.
pub fn follow_producer(
    spec: &Spec<'_>,
) -> anyhow::Result<(tokio::task::JoinHandle<anyhow::Result<u64>>, Times)> {
    let committed: Arc<Mutex<HashMap<String, u64>>> = Arc::default();
    let sink = committed.clone();
    let producer = Producer::spawn(spec)?;
    let handle = tokio::task::spawn_blocking(move || {
        producer.follow(|id, at| {
            if let Ok(mut m) = sink.lock() {
                m.insert(id.to_owned(), at);
            }
        })
    });
    Ok((handle, committed))
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
    proc_status_kib(pid, "VmHWM:")
}

/// One `kB` line of /proc/<pid>/status (Linux), e.g. `VmRSS:`.
fn proc_status_kib(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    line.split_whitespace().nth(1)?.parse().ok()
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
                let program = super::catchup::pg_recvlogical(&scratch.pool).await?;
                let mut child = super::catchup::recvlogical_command(
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
    let floor = match super::catchup::pg_recvlogical(&scratch.pool).await {
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

#[cfg(test)]
mod tests {
    use super::*;

    const SCRAPE: &str = r#"# TYPE pgoutbox_claim_duration_seconds histogram
pgoutbox_claim_duration_seconds_bucket{le="0.001"} 50
pgoutbox_claim_duration_seconds_bucket{le="0.005"} 98
pgoutbox_claim_duration_seconds_bucket{le="0.01"} 99
pgoutbox_claim_duration_seconds_bucket{le="+Inf"} 100
pgoutbox_claim_duration_seconds_sum 0.2
pgoutbox_claim_duration_seconds_count 100
"#;

    #[test]
    fn a_histogram_quantile_is_the_bound_of_its_bucket() {
        let h = Histogram::parse(SCRAPE, "pgoutbox_claim_duration_seconds");
        assert_eq!(h.count(), 100.0);
        assert_eq!(h.quantile_ms(0.5), Some(1.0));
        assert_eq!(h.quantile_ms(0.98), Some(5.0));
        assert_eq!(h.quantile_ms(0.99), Some(10.0));
        // Past the last finite bound: unknown, not a number that looks measured.
        assert_eq!(h.quantile_ms(1.0), None);
        // What was observed between two scrapes.
        let empty = Histogram::parse("", "pgoutbox_claim_duration_seconds");
        assert_eq!(h.since(&h).quantile_ms(0.5), None);
        assert_eq!(h.since(&empty).count(), 100.0);
    }

    #[test]
    fn latencies_are_summarised_overall_and_per_second() {
        // Commits in two seconds; latencies 1..=100 ms in the first, 500 ms once in the second.
        let mut committed = HashMap::new();
        let mut received = HashMap::new();
        for i in 1..=100u64 {
            committed.insert(format!("a{i}"), 10_000_000 + i);
            received.insert(format!("a{i}"), 10_000_000 + i + i * 1000);
        }
        committed.insert("b".into(), 11_000_000);
        received.insert("b".into(), 11_500_000);
        committed.insert("lost".into(), 11_000_001);
        let l = Latencies::join(&committed, &received);
        let all = l.summary();
        assert_eq!(all.count, 101);
        assert_eq!(all.max, 500.0);
        let seconds = l.per_second();
        assert_eq!(seconds.len(), 2);
        assert_eq!(seconds[&10].max, 100.0);
        assert_eq!(seconds[&10].p50, 51.0);
        assert_eq!(seconds[&11].count, 1);
    }
}
