//! The parent's side of the producer process (`bench produce`, see `produce.rs`): what it is
//! asked to run ([`Spec`], [`Statement`]), starting it, and reading the commits it reports.

use std::io::{BufRead, BufReader};
use std::process::{Child, ChildStdout, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context;

/// What each producer transaction runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Statement {
    /// A single-row INSERT into the outbox table.
    Insert,
    /// `SELECT <table>_emit(topic, payload)`: the event as a logical decoding message, no row
    /// (read only by a `source = "wal"` relay).
    Emit,
    /// A single-row INSERT with one of 1,000 keys (`bench replay --ordered`).
    InsertKeyed,
}

impl Statement {
    /// Its name on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Insert => "insert",
            Self::Emit => "emit",
            Self::InsertKeyed => "insert-keyed",
        }
    }
}

/// Microseconds since the Unix epoch: the clock both processes share.
pub fn unix_micros(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

/// A running producer process.
pub struct Producer {
    child: Child,
    stdout: Option<BufReader<ChildStdout>>,
}

/// What the parent asks of a producer process.
pub struct Spec<'a> {
    /// Database URL.
    pub url: &'a str,
    /// Table name.
    pub table: &'a str,
    /// Connections.
    pub connections: usize,
    /// Target rate, or unthrottled.
    pub rate: Option<u64>,
    /// How long.
    pub duration: Duration,
    /// Stop after this many commits.
    pub events: Option<u64>,
    /// Report every commit.
    pub report: bool,
    /// What each transaction runs.
    pub statement: Statement,
}

impl Producer {
    /// Starts `pgoutbox bench produce` with `spec`.
    pub fn spawn(spec: &Spec<'_>) -> anyhow::Result<Self> {
        let mut command = std::process::Command::new(std::env::current_exe()?);
        command
            .args(["bench", "produce", "--url", spec.url, "--table", spec.table])
            .args(["--statement", spec.statement.as_str()])
            .arg("--connections")
            .arg(spec.connections.to_string())
            .arg("--duration")
            .arg(format!("{}ms", spec.duration.as_millis()));
        if let Some(rate) = spec.rate {
            command.arg("--rate").arg(rate.to_string());
        }
        if let Some(events) = spec.events {
            command.arg("--events").arg(events.to_string());
        }
        if spec.report {
            command.arg("--report");
        }
        let mut child = command
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("cannot start the producer process")?;
        let stdout = child.stdout.take().map(BufReader::new);
        Ok(Self { child, stdout })
    }

    /// Reads the producer's output until it exits, calling `commit` for each reported commit;
    /// returns the total number of commits. Blocking: run it on a blocking thread.
    pub fn follow(mut self, mut commit: impl FnMut(&str, u64)) -> anyhow::Result<u64> {
        let mut total = None;
        if let Some(stdout) = self.stdout.take() {
            for line in stdout.lines() {
                let line = line?;
                if let Some(n) = line.strip_prefix("total ") {
                    total = n.parse().ok();
                } else if let Some((id, at)) = line.split_once(' ') {
                    commit(id, at.parse().unwrap_or(0));
                }
            }
        }
        let status = self.child.wait()?;
        anyhow::ensure!(status.success(), "the producer process failed ({status})");
        total.context("the producer process printed no total")
    }

    /// Runs a producer to its end and returns its commits (no per-commit report).
    pub async fn run(spec: &Spec<'_>) -> anyhow::Result<u64> {
        let producer = Self::spawn(spec)?;
        tokio::task::spawn_blocking(move || producer.follow(|_, _| {})).await?
    }
}

impl Drop for Producer {
    fn drop(&mut self) {
        if self.stdout.is_some() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
