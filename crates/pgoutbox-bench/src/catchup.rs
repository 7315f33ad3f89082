//! `bench catchup`: how fast the WAL source reads a backlog from its replication slot, against
//! `pg_recvlogical` reading the same WAL with the same output plugin and publication (the floor of
//! any logical decoding client: the walsender reads, decodes and serialises; pg_recvlogical only
//! writes what it gets to /dev/null).
//!
//! In the scratch database (the server needs wal_level = logical), the relay's slot is created
//! (as `pgoutbox slot create` does) and copied to a second slot at the same position; the backlog
//! is written (many events per transaction, for writing speed), and `pg_current_wal_lsn()` after
//! it is the end. Then, one after the other: pg_recvlogical streams the copy to /dev/null with
//! `--endpos` at the end (timed to its exit), and the relay process (`source = "wal"`, null sink)
//! streams its slot, timed from its start until the slot's `confirmed_flush_lsn` reaches the end
//! (polled every 50 ms; the relay confirms a position only once the events before it are
//! published and settled).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;

use super::metrics::counter;
use super::output::{rate, Output, Row};
use super::process::{proc_cpu, RelayProcess, RelaySpec};
use super::producer::Statement;
use super::recvlogical::{pg_recvlogical, recvlogical_command};
use super::scratch::{Scratch, Source};
use super::sql;

/// Arguments of `bench catchup`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Events in the backlog.
    #[arg(long, default_value_t = 1_000_000)]
    events: u64,
    /// How the backlog is written: outbox rows (insert) or `outbox_emit()` messages (emit).
    #[arg(long, value_enum, default_value_t = Statement::Insert)]
    producer: Statement,
    /// Events per backlog transaction (one INSERT … SELECT generate_series, or one SELECT of
    /// that many emit() calls, each).
    #[arg(long, default_value_t = 1000)]
    per_transaction: u64,
    /// `relay.batch_size` of the relay; several (comma-separated) run one round each, every round
    /// on a new backlog with its own pg_recvlogical run.
    #[arg(long, value_delimiter = ',', default_value = "1000")]
    batch_size: Vec<usize>,
    /// How the relay settles outbox rows: delete (retention 0) or keep (mark published).
    #[arg(long, default_value = "delete", value_parser = ["delete", "keep"])]
    settle: String,
    /// `wal.status_interval` of the relay: how often it reports its confirmed position, which is
    /// when the bench sees that it is done.
    #[arg(long, default_value = "100ms")]
    status_interval: String,
    /// Run the relay before pg_recvlogical (by default it runs after), to see whether the
    /// order moves the numbers.
    #[arg(long)]
    relay_first: bool,
    /// The pg_recvlogical program (default: the server's major version under
    /// /usr/lib/postgresql, else the newest there, else PATH).
    #[arg(long)]
    pg_recvlogical: Option<PathBuf>,
}

/// Runs `bench catchup`: one round (a new backlog, pg_recvlogical and the relay) per
/// `--batch-size`.
pub async fn run(scratch: &Scratch, out: &Output, args: &Args) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.events > 0 && args.per_transaction > 0,
        "--events and --per-transaction must be more than 0"
    );
    pgoutbox::sources::wal::slot::check_server(&scratch.pool)
        .await
        .context("bench catchup reads a backlog from a logical replication slot")?;
    let program = match &args.pg_recvlogical {
        Some(p) => p.clone(),
        None => pg_recvlogical(&scratch.pool).await?,
    };
    for &batch_size in &args.batch_size {
        round(scratch, out, args, &program, batch_size).await?;
    }
    Ok(())
}

/// One backlog, pg_recvlogical then the relay at `batch_size`.
async fn round(
    scratch: &Scratch,
    out: &Output,
    args: &Args,
    program: &Path,
    batch_size: usize,
) -> anyhow::Result<()> {
    let (table, names) = scratch.wal_names();
    // The second slot, read by pg_recvlogical (slot names are the server's: this run's own).
    let second = format!("{}_recvlogical", names.slot);
    scratch.fresh_source(Source::Wal).await?;
    // The copy starts where the relay's slot does: both read exactly the same WAL.
    sql::setup::copy_replication_slot(&scratch.pool, &names.slot, &second)
        .await
        .context("cannot copy the relay's replication slot for pg_recvlogical")?;
    let start = sql::watch::confirmed_flush_lsn(&scratch.pool, &names.slot).await?;

    // The backlog: the same events as `bench drain`'s prefill, as rows or as emit() messages.
    let written = Instant::now();
    let (insert, what) = match args.producer {
        Statement::Insert | Statement::InsertKeyed => {
            (sql::load::backlog_rows(&table), "outbox rows")
        }
        Statement::Emit => (sql::load::backlog_emits(&table), "emit() messages"),
    };
    scratch
        .generate(&insert, args.events, args.per_transaction, "backlog", out)
        .await?;
    let write_time = written.elapsed();
    let end = sql::watch::current_wal_lsn(&scratch.pool).await?;
    let wal_bytes = sql::watch::wal_bytes(&scratch.pool, &end, &start).await?;
    // Neither run should meet a checkpoint the other did not (the backlog's dirty pages).
    sql::setup::checkpoint(&scratch.pool).await?;
    let transactions = args.events.div_ceil(args.per_transaction);
    out.row(Row {
        scenario: "catchup".into(),
        variant: format!("backlog, {}", args.producer.as_str()),
        value: args.events as f64,
        unit: "events",
        detail: format!(
            "{what} in {transactions} transactions of up to {}; {:.0} MiB of WAL from {start} to {end}; written in {:.1} s",
            args.per_transaction,
            wal_bytes as f64 / 1_048_576.0,
            write_time.as_secs_f64()
        ),
    });

    let backlog = Backlog {
        start: &start,
        end: &end,
        bytes: wal_bytes,
    };
    let recv = async {
        let run = recvlogical(scratch, out, program, &second, &names.publication, &backlog).await?;
        // Its slot holds WAL back and has done its part.
        sql::setup::drop_replication_slot(&scratch.pool, &second).await?;
        Ok::<_, anyhow::Error>(run)
    };
    let relay = relay(scratch, out, args, batch_size, &names.slot, &backlog);
    // One after the other (they share the cores), in the order asked.
    let (recv, relay) = if args.relay_first {
        let relay = relay.await?;
        (recv.await?, relay)
    } else {
        let recv = recv.await?;
        (recv, relay.await?)
    };
    let order = if args.relay_first {
        "relay first"
    } else {
        "pg_recvlogical first"
    };
    let recv_rate = rate(args.events, recv.elapsed);
    out.row(Row {
        scenario: "catchup".into(),
        variant: "pg_recvlogical → /dev/null".into(),
        value: recv_rate,
        unit: "ev/s",
        detail: format!(
            "{:.2} s to --endpos {end}; pg_recvlogical CPU {:.0} %{}; pgoutput proto_version 1, messages=true, publication {}",
            recv.elapsed.as_secs_f64(),
            recv.cpu.as_secs_f64() / recv.elapsed.as_secs_f64() * 100.0,
            walsender_cpu(recv.walsender, recv.elapsed),
            names.publication
        ),
    });

    let relay_rate = rate(args.events, relay.elapsed);
    out.row(Row {
        scenario: "catchup".into(),
        variant: format!("relay wal → null, batch {batch_size}, {}", args.settle),
        value: relay_rate,
        unit: "ev/s",
        detail: format!(
            "{:.2} s from start until confirmed_flush_lsn ≥ end; {} events published (its counter); relay CPU {:.0} %{}, peak RSS {} MiB; wal.status_interval {}",
            relay.elapsed.as_secs_f64(),
            relay.published,
            relay.cpu.as_secs_f64() / relay.elapsed.as_secs_f64() * 100.0,
            walsender_cpu(relay.walsender, relay.elapsed),
            relay.peak_rss_kib / 1024,
            args.status_interval
        ),
    });
    out.row(Row {
        scenario: "catchup".into(),
        variant: format!("relay / pg_recvlogical, batch {batch_size}"),
        value: relay_rate / recv_rate,
        unit: "× pg_recvlogical",
        detail: format!(
            "{} {}, {transactions} transactions; {order}",
            args.events,
            args.producer.as_str()
        ),
    });
    Ok(())
}

/// What pg_recvlogical's run measured.
struct RecvRun {
    elapsed: Duration,
    cpu: Duration,
    walsender: Option<Duration>,
}

/// The WAL each run streams: from `start` to `end`, `bytes` of it.
struct Backlog<'a> {
    start: &'a str,
    end: &'a str,
    bytes: i64,
}

/// pg_recvlogical streams its slot to /dev/null up to the backlog's end.
async fn recvlogical(
    scratch: &Scratch,
    out: &Output,
    program: &Path,
    slot: &str,
    publication: &str,
    backlog: &Backlog<'_>,
) -> anyhow::Result<RecvRun> {
    let Backlog {
        start,
        end,
        bytes: wal_bytes,
    } = *backlog;
    let mut command = recvlogical_command(&scratch.url, program, slot, publication, Some(end))?;
    let bar = out.bar(wal_bytes.max(0) as u64, "recvlogical");
    let started = Instant::now();
    let mut child = command
        .spawn()
        .with_context(|| format!("cannot run {}", program.display()))?;
    let mut cpu = CpuWatch::new(child.id());
    let mut walsender = CpuWatch::default();
    let mut stderr = child.stderr.take();
    let errors = tokio::spawn(async move {
        let mut text = String::new();
        if let Some(stderr) = stderr.as_mut() {
            let _ = tokio::io::AsyncReadExt::read_to_string(stderr, &mut text).await;
        }
        text
    });
    let status = loop {
        tokio::select! {
            status = child.wait() => break status?,
            _ = tokio::time::sleep(Duration::from_millis(200)) => {
                cpu.sample();
                walsender.find(scratch, slot).await;
                walsender.sample();
                bar.set_position(sent(scratch, slot, start).await);
            }
        }
    };
    let elapsed = started.elapsed();
    bar.finish_and_clear();
    let errors = errors.await.unwrap_or_default();
    anyhow::ensure!(
        status.success(),
        "pg_recvlogical failed ({status}): {}",
        errors.trim()
    );
    Ok(RecvRun {
        elapsed,
        cpu: cpu.last,
        walsender: walsender.pid.map(|_| walsender.last),
    })
}

/// The CPU time of a process of this machine, sampled while it runs (the last sample stands for
/// its total: up to one sampling interval is missed).
#[derive(Debug, Default)]
struct CpuWatch {
    pid: Option<u32>,
    last: Duration,
}

impl CpuWatch {
    fn new(pid: Option<u32>) -> Self {
        Self {
            pid,
            last: Duration::ZERO,
        }
    }

    /// Takes the walsender of `slot` once it streams, when it runs on this machine (its
    /// /proc entry is a PostgreSQL walsender; a remote server's pid means nothing here).
    async fn find(&mut self, scratch: &Scratch, slot: &str) {
        if self.pid.is_some() {
            return;
        }
        let pid = sql::watch::slot_active_pid(&scratch.pool, slot)
            .await
            .ok()
            .flatten()
            .flatten();
        self.pid = pid.map(|p| p as u32).filter(|p| {
            std::fs::read(format!("/proc/{p}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains("walsender"))
        });
    }

    fn sample(&mut self) {
        if let Some(cpu) = self.pid.and_then(proc_cpu) {
            self.last = cpu;
        }
    }
}

/// What the relay's run measured.
struct RelayRun {
    elapsed: Duration,
    cpu: Duration,
    walsender: Option<Duration>,
    peak_rss_kib: u64,
    published: f64,
}

/// ", its walsender's N %" when the walsender's CPU could be read (a server on this machine).
fn walsender_cpu(cpu: Option<Duration>, elapsed: Duration) -> String {
    cpu.map(|c| {
        format!(
            ", its walsender's {:.0} %",
            c.as_secs_f64() / elapsed.as_secs_f64().max(1e-9) * 100.0
        )
    })
    .unwrap_or_default()
}

/// The relay process streams its slot until the slot's confirmed position reaches the backlog's
/// end.
async fn relay(
    scratch: &Scratch,
    out: &Output,
    args: &Args,
    batch_size: usize,
    slot: &str,
    backlog: &Backlog<'_>,
) -> anyhow::Result<RelayRun> {
    let Backlog {
        start,
        end,
        bytes: wal_bytes,
    } = *backlog;
    let bar = out.bar(wal_bytes.max(0) as u64, "relay");
    let started = Instant::now();
    let mut relay = RelayProcess::spawn(
        scratch,
        &RelaySpec {
            source: Source::Wal,
            null_sink: true,
            batch_size: Some(batch_size),
            wal_status_interval: Some(&args.status_interval),
            retention: if args.settle == "keep" { "7d" } else { "0s" },
            ..RelaySpec::new("")
        },
    )?;
    let mut last_move = (Instant::now(), None::<String>);
    let mut walsender = CpuWatch::default();
    loop {
        walsender.find(scratch, slot).await;
        walsender.sample();
        // The relay's confirmed position, as the server has it.
        let (confirmed, done) = sql::watch::slot_confirmed(&scratch.pool, slot, end).await?;
        if done == Some(true) {
            break;
        }
        if let Some(why) = relay.exited() {
            anyhow::bail!("the relay process stopped before catching up ({why})");
        }
        if confirmed != last_move.1 {
            last_move = (Instant::now(), confirmed);
        } else if last_move.0.elapsed() > Duration::from_secs(120) {
            anyhow::bail!(
                "the relay confirmed nothing for 2 minutes (at {}); its log: {}",
                last_move.1.as_deref().unwrap_or("none"),
                relay.log_tail()
            );
        }
        bar.set_position(sent(scratch, slot, start).await);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let elapsed = started.elapsed();
    bar.finish_and_clear();
    let published = counter(
        &relay.metrics().await,
        pgoutbox::model::metric::PUBLISHED_TOTAL,
    );
    Ok(RelayRun {
        elapsed,
        cpu: relay.cpu(),
        walsender: walsender.pid.map(|_| walsender.last),
        peak_rss_kib: relay.peak_rss_kib(),
        published,
    })
}

/// WAL bytes the walsender of `slot` has sent since `start` (0 when it is not streaming): the
/// progress shown while waiting.
async fn sent(scratch: &Scratch, slot: &str, start: &str) -> u64 {
    sql::watch::sent_bytes(&scratch.pool, slot, start)
        .await
        .ok()
        .flatten()
        .flatten()
        .unwrap_or(0)
        .max(0) as u64
}
