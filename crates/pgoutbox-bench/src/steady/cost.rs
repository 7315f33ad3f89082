//! What producers pay, the second half of `bench steady`: the commit rate of unthrottled
//! single-event producers on the pgoutbox table against the minimal table (the schema's cost),
//! with no relay, with the relay polling (fixed and adaptive) and with a statement-level NOTIFY
//! trigger (the alternative wake-up); for the WAL source, with the WAL relay and with
//! pg_recvlogical streaming against no relay, and `outbox_emit()` against plain INSERTs.
//!
//! Each setting runs once per round, in rounds rotating which goes first, and a setting's cost is
//! the median of its per-round ratios to the reference: on a shared machine whose speed moves by
//! a third within minutes, only runs taken side by side compare.

use std::process::Stdio;
use std::time::{Duration, Instant};

use super::args::Args;
use crate::latency::median;
use crate::output::{rate, Output, Row};
use crate::process::{RelayProcess, RelaySpec};
use crate::producer::{Producer, Spec, Statement};
use crate::receiver::Receiver;
use crate::recvlogical::{pg_recvlogical, recvlogical_command};
use crate::scratch::{Scratch, Source};
use crate::sql;

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
    sql::setup::checkpoint(&scratch.pool).await?;
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

/// One setting of the producer-cost runs: what the producers write and what runs beside them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Setup {
    /// Plain INSERTs into the article's minimal table, no relay, no slot.
    Minimal,
    /// The producers' statement on the pgoutbox table, no relay, no slot.
    Alone(Statement),
    /// INSERTs while a polling relay delivers them to the receiver; `fixed`: every idle wait is
    /// 250 ms, else the relay's default adaptive polling.
    PollRelay { fixed: bool },
    /// INSERTs into a table with a statement-level `pg_notify` trigger, no relay.
    Notify,
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
                sql::setup::drop_minimal_copy(&scratch.pool).await?;
                rate
            }
            Self::Alone(statement) => {
                scratch.fresh_source(Source::Poll).await?;
                unthrottled_with(scratch, args, "outbox", statement).await
            }
            Self::PollRelay { fixed } => {
                scratch.fresh_source(Source::Poll).await?;
                let mut spec = RelaySpec {
                    null_sink: args.cost_sink == "null",
                    batch_wait: args.relay_batch_wait.as_deref(),
                    ..RelaySpec::new(&receiver.url)
                };
                let setting = if fixed {
                    // Fixed: the first wait after an empty claim is the longest one (min = max).
                    spec.min_poll = "250ms";
                    spec.poll_interval = Some("250ms");
                    spec.batch_wait = None;
                    "fixed 250 ms polling"
                } else {
                    "adaptive polling"
                };
                let mut relay = RelayProcess::spawn(scratch, &spec)?;
                tokio::time::sleep(Duration::from_millis(300)).await;
                running(&mut relay, setting)?;
                let rate = unthrottled(scratch, args, "outbox").await?;
                running(&mut relay, setting)?;
                Ok(rate)
            }
            Self::Notify => {
                scratch.fresh_source(Source::Poll).await?;
                sql::load::create_notify_trigger(&scratch.pool).await?;
                let rate = unthrottled(scratch, args, "outbox").await;
                sql::load::drop_notify_trigger(&scratch.pool).await?;
                rate
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
                while !pgoutbox::sources::wal::slot::status(&scratch.pool, &names)
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

/// Commit rate of unthrottled single-event producers: the pgoutbox table against the minimal one
/// (the schema's cost), alone, beside a relay, and with a NOTIFY trigger; for the WAL source,
/// with the WAL relay against no relay (see [`wal_producer_cost`]).
pub(super) async fn producer_cost(
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
    sql::setup::drop_minimal_copy(&scratch.pool).await?;
    let schema_ratio = median(&ratios);
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

    let settings = [
        (Setup::Alone(Statement::Insert), "no relay (reference)", ""),
        (
            Setup::PollRelay { fixed: true },
            "relay, fixed 250 ms polling",
            "relay with fixed 250 ms polling vs no relay",
        ),
        (
            Setup::PollRelay { fixed: false },
            "relay, adaptive polling (default)",
            "relay with adaptive polling (default) vs no relay",
        ),
        (
            Setup::Notify,
            "NOTIFY trigger per statement",
            "NOTIFY trigger vs no relay",
        ),
    ];
    let setups: Vec<Setup> = settings.iter().map(|s| s.0).collect();
    let rates = rounds(scratch, args, receiver, &setups).await?;
    report(out, args, &settings, &rates, "× no relay");
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
        Statement::Insert | Statement::InsertKeyed => vec![
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
    let unit = match args.producer {
        Statement::Insert | Statement::InsertKeyed => "× no relay",
        Statement::Emit => "× minimal INSERT",
    };
    report(out, args, &settings, &rates, unit);
    Ok(())
}

/// The rows of producer-cost rounds: each setting's median commits/s, then each setting's median
/// ratio (of its run to the reference's, round by round) in `unit`. `settings`: (setting, its
/// row, its ratio's row), the first the reference; `rates`: each setting's runs, in that order.
fn report(
    out: &Output,
    args: &Args,
    settings: &[(Setup, &str, &str)],
    rates: &[Vec<f64>],
    unit: &'static str,
) {
    let n = args.cost_connections;
    for (i, runs) in rates.iter().enumerate() {
        let value = median(runs);
        let reference = median(&rates[0]);
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
                    Setup::WalRelay(_) | Setup::PollRelay { .. } =>
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
            value: median(&ratios),
            unit,
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
}

/// Fails the run when the relay of its `setting` is not running: producers measured beside a relay
/// that exited (a configuration it refused) would be measured alone.
fn running(relay: &mut RelayProcess, setting: &str) -> anyhow::Result<()> {
    match relay.exited() {
        Some(why) => anyhow::bail!("the relay of the {setting} run stopped: {why}"),
        None => Ok(()),
    }
}
