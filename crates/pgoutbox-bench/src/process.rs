//! The relay under measurement as its own process: `pgoutbox relay` started on the scratch
//! database with a config written for the run ([`RelaySpec`]), killed when dropped; and what /proc
//! tells about a process of this machine (CPU time, resident memory), for the relay and others.

use std::process::Stdio;
use std::time::{Duration, Instant};

use super::scratch::{Scratch, Source};

/// How the bench's relay process is configured.
pub struct RelaySpec<'a> {
    /// Webhook receiver URL.
    pub receiver_url: &'a str,
    /// `relay.min_poll_interval`.
    pub min_poll: &'a str,
    /// `relay.poll_interval` (None: the relay's default).
    pub poll_interval: Option<&'a str>,
    /// `relay.batch_wait` (None: the relay's default).
    pub batch_wait: Option<&'a str>,
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
    /// The destination's name.
    pub destination_name: &'a str,
    /// More keys of the destination, as TOML lines (empty: none).
    pub destination_keys: &'a str,
    /// More `[[destinations]]` tables, as TOML (empty: none).
    pub extra_destinations: &'a str,
}

impl<'a> RelaySpec<'a> {
    /// Delete mode, adaptive polling from 1 ms.
    pub fn new(receiver_url: &'a str) -> Self {
        Self {
            receiver_url,
            min_poll: "1ms",
            poll_interval: None,
            batch_wait: None,
            retention: "0s",
            history: "outbox",
            cleanup_interval: "1m",
            synchronous_commit: "on",
            source: Source::Poll,
            batch_size: None,
            wal_status_interval: None,
            wal_batch_wait: None,
            null_sink: false,
            destination_name: "bench",
            destination_keys: "",
            extra_destinations: "",
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
                 [relay]\nmin_poll_interval = \"{min_poll}\"\nsynchronous_commit = \"{sync}\"\n{poll}{batch}{fill}\
                 [wal]\nslot = \"{slot}\"\n{status}{batch_wait}\
                 [observability]\nlisten = \"127.0.0.1:{port}\"\n\
                 [[destinations]]\nname = \"{name}\"\n{destination}{keys}\n{extra}",
                keys = spec.destination_keys,
                name = spec.destination_name,
                extra = spec.extra_destinations,
                url = scratch.url,
                source = spec.source.as_str(),
                slot = scratch.wal_names().1.slot,
                retention = spec.retention,
                history = spec.history,
                cleanup = spec.cleanup_interval,
                min_poll = spec.min_poll,
                sync = spec.synchronous_commit,
                poll = optional("poll_interval", spec.poll_interval),
                fill = optional("batch_wait", spec.batch_wait),
                batch = spec
                    .batch_size
                    .map(|b| format!("batch_size = {b}\n"))
                    .unwrap_or_default(),
                status = optional("status_interval", spec.wal_status_interval),
                batch_wait = optional("batch_wait", spec.wal_batch_wait),
            ),
        )?;
        // Its log is kept beside the config, to explain a relay that stops early.
        let log = dir.path().join("relay.log");
        let child = std::process::Command::new(relay_binary()?)
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

    /// The relay's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("relay.log")).unwrap_or_default()
    }

    /// The last lines of the relay's log, on one line.
    pub fn log_tail(&self) -> String {
        let log = self.log();
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
            let status = pgoutbox::sources::wal::slot::status(pool, &names).await?;
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

    /// Whether the relay answers `/readyz` with 200 (the database answers, each destination takes
    /// events, nothing is stalled).
    pub async fn ready(&self) -> bool {
        let url = self.metrics_url.replace("/metrics", "/readyz");
        reqwest::get(&url)
            .await
            .is_ok_and(|r| r.status().is_success())
    }

    /// Waits until [`RelayProcess::ready`], at most until `within` after `started`; how long
    /// since `started`. `what` names the relay in the error when it stops first or is late.
    pub async fn wait_ready(
        &mut self,
        started: Instant,
        within: Duration,
        what: &str,
    ) -> anyhow::Result<Duration> {
        while !self.ready().await {
            if let Some(why) = self.exited() {
                anyhow::bail!("{what} stopped before it was ready ({why})");
            }
            anyhow::ensure!(
                started.elapsed() < within,
                "{what} was not ready within {}",
                humantime::format_duration(within)
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(started.elapsed())
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

/// The `pgoutbox` binary the bench runs as its relay: this one, or the one `PGOUTBOX_BENCH_RELAY`
/// names (another build, for an A/B of two relays under the same bench).
fn relay_binary() -> anyhow::Result<std::path::PathBuf> {
    match std::env::var_os("PGOUTBOX_BENCH_RELAY") {
        Some(path) => Ok(path.into()),
        None => Ok(std::env::current_exe()?),
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
    proc_status_kib(pid, "VmHWM:")
}

/// One `kB` line of `/proc/<pid>/status` (Linux), e.g. `VmRSS:`.
fn proc_status_kib(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// Starts `relays` relays of `config` in this process, each with a pool of its own (4
/// connections), as separate processes would have; they run until `stop` is cancelled.
pub async fn in_process_relays(
    scratch: &Scratch,
    config: &pgoutbox::config::Config,
    relays: usize,
    stop: &tokio_util::sync::CancellationToken,
) -> anyhow::Result<Vec<tokio::task::JoinHandle<pgoutbox::Result<pgoutbox::engine::BatchReport>>>> {
    let mut tasks = Vec::with_capacity(relays);
    for _ in 0..relays {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(4)
            .connect(&scratch.url)
            .await?;
        let relay = std::sync::Arc::new(pgoutbox::engine::Relay::new(pool, config)?);
        tasks.push(tokio::spawn(relay.run(stop.clone())));
    }
    Ok(tasks)
}

/// A configuration line `key = "value"`, or nothing when the value is not given.
fn optional(key: &str, value: Option<&str>) -> String {
    value
        .map(|v| format!("{key} = \"{v}\"\n"))
        .unwrap_or_default()
}
