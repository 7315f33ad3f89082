//! Producers as their own process, the way pgbench runs: `bench steady` and `bench soak` start
//! `pgoutbox bench produce` as a child so that the producers' scheduling never lands in the
//! latency the parent measures (the parent only receives events and reads this process's output).
//!
//! Each connection commits one single-row INSERT per transaction (autocommit), or with
//! `--statement emit` one `<table>_emit()` call (a logical decoding message, no row: what
//! `source = "wal"` producers may write instead), at a share of the target rate or as fast as it
//! can. With `--report`, every commit is printed on stdout as
//! `<event id> <unix time in microseconds when the commit returned>`; at the end a last line
//! `total <commits>` is printed in every case.

use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use anyhow::Context;
use sqlx::Connection as _;

use super::producer::{unix_micros, Statement};
use super::sql;

/// Arguments of the hidden `bench produce` (run by other scenarios, not by hand).
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Database to insert into.
    #[arg(long)]
    url: String,
    /// Table to insert into (quoted as an identifier).
    #[arg(long, default_value = "outbox")]
    table: String,
    /// Connections, each committing one event per transaction.
    #[arg(long, default_value_t = 8)]
    connections: usize,
    /// Commits per second, all connections together; unthrottled when absent.
    #[arg(long)]
    rate: Option<u64>,
    /// How long to run.
    #[arg(long, value_parser = pgoutbox::config::parse_duration)]
    duration: Duration,
    /// Stop after this many commits in all (the soak's fixed event count).
    #[arg(long)]
    events: Option<u64>,
    /// Print each commit's event id and time.
    #[arg(long)]
    report: bool,
    /// What each transaction runs.
    #[arg(long, value_enum, default_value_t = Statement::Insert)]
    statement: Statement,
}

/// The statement every producer runs: what an application in any language writes. Both return
/// the event's id, which the sinks forward (the receiver matches arrivals by it).
fn statement(table: &str, statement: Statement) -> anyhow::Result<String> {
    match statement {
        Statement::Insert => sql::load::producer_insert(table),
        Statement::Emit => sql::load::producer_emit(table),
        Statement::InsertKeyed => sql::load::producer_insert_keyed(table),
    }
}

/// Runs the producers (in the child process).
pub async fn run(args: &Args) -> anyhow::Result<()> {
    let statement = statement(&args.table, args.statement)?;
    // One connection per producer, held for the run, as pgbench holds its clients': a pool's
    // acquire and release on every commit is work a client of the outbox need not do, and the
    // producers are the instrument here, not the subject.
    let mut connections = Vec::with_capacity(args.connections);
    for _ in 0..args.connections {
        connections.push(
            sqlx::PgConnection::connect(&args.url)
                .await
                .context("producer cannot connect")?,
        );
    }
    let total = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let (lines, mut rx) = tokio::sync::mpsc::unbounded_channel::<(uuid::Uuid, u64)>();
    let mut tasks = Vec::new();
    for mut connection in connections {
        let (total, stop, statement) = (total.clone(), stop.clone(), statement.clone());
        let lines = args.report.then(|| lines.clone());
        let period = args
            .rate
            .map(|r| Duration::from_secs_f64(args.connections as f64 / r.max(1) as f64));
        let limit = args.events;
        tasks.push(tokio::spawn(async move {
            let mut ticker = period.map(|p| {
                let mut t = tokio::time::interval(p);
                // A late commit does not make the next ones burst: the rate is a steady rate.
                t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                t
            });
            while !stop.load(Ordering::Relaxed) {
                if let Some(t) = ticker.as_mut() {
                    t.tick().await;
                }
                // Counted before the commit, so `--events` is never overshot; a stop lets the
                // commit in flight finish, so the count is exact (capped at `--events` below).
                let n = total.fetch_add(1, Ordering::Relaxed);
                if limit.is_some_and(|l| n >= l) {
                    break;
                }
                let id = sql::load::commit_event(&mut connection, &statement).await?;
                let at = unix_micros(SystemTime::now());
                if let Some(lines) = &lines {
                    let _ = lines.send((id, at));
                }
            }
            connection.close().await?;
            Ok::<_, sqlx::Error>(())
        }));
    }
    drop(lines);
    let orphaned = stop.clone();
    let writer = tokio::task::spawn_blocking(move || {
        let stdout = std::io::stdout();
        let mut out = std::io::BufWriter::new(stdout.lock());
        while let Some((id, at)) = rx.blocking_recv() {
            // A write fails once the parent is gone (a killed bench): stop producing.
            if writeln!(out, "{id} {at}").is_err() {
                orphaned.store(true, Ordering::Relaxed);
                break;
            }
        }
        let _ = out.flush();
    });
    let deadline = tokio::time::sleep(args.duration);
    tokio::pin!(deadline);
    let mut all = futures::future::join_all(tasks);
    let finished = tokio::select! {
        _ = &mut deadline => None,
        r = &mut all => Some(r),
    };
    stop.store(true, Ordering::Relaxed);
    let results = match finished {
        Some(r) => r,
        None => all.await,
    };
    for r in results {
        r??;
    }
    writer.await?;
    let commits = total.load(Ordering::Relaxed);
    let commits = args.events.map_or(commits, |l| commits.min(l));
    println!("total {commits}");
    Ok(())
}
