//! `bench replay`: a replay of a large retained history to one destination while live events
//! flow to it and to another, against the same live load without the replay.
//!
//! One relay process, two webhook destinations (`replayed`, `other`), `--events` published
//! events retained in the outbox (1,000 keys). A replay of the whole history to `replayed` is
//! created paused; then, `--rounds` times, the live load alone (`--live-rate` events/s for
//! `--duration`: commit→publish p99 at each destination) and the same load with the replay
//! resumed. The replay then runs to its end alone (its rate and total time running); with `--ordered` the destination keeps per-key order and every key's replayed and live
//! events are checked for order. Last (unless `--no-kill`), the history is replayed again with no
//! live load and no rate of its own, the relay is killed (SIGKILL) half-way and a new one
//! started: the replay must end with every event of its range sent at least once.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context;
use pgoutbox::store::replays::{self, Change, NewReplay};
use pgoutbox::store::Store;
use uuid::Uuid;

use super::latency::{follow_producer, median, Latencies, Summary};
use super::output::{Output, Row};
use super::process::{RelayProcess, RelaySpec};
use super::producer::{unix_micros, Spec, Statement};
use super::receiver::Receiver;
use super::scratch::Scratch;
use super::sql;

/// Arguments of `bench replay`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Retained events to replay.
    #[arg(long, default_value_t = 1_000_000)]
    events: u64,
    /// Live events a second, to both destinations.
    #[arg(long, default_value_t = 3_000)]
    live_rate: u64,
    /// How long the live load runs, alone and beside the replay.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// Producer connections.
    #[arg(long, default_value_t = 16)]
    producers: usize,
    /// The replayed destination keeps per-key order (`ordering = "key"`); order is checked.
    #[arg(long)]
    ordered: bool,
    /// The replay's own rate (e.g. `5000/s`; default: as fast as the lane takes it).
    #[arg(long)]
    rate: Option<String>,
    /// Rounds of the live load alone then beside the replay (interleaved A/B).
    #[arg(long, default_value_t = 2)]
    rounds: u32,
    /// Skip the replay with a relay killed half-way.
    #[arg(long)]
    no_kill: bool,
}

/// Each request's event id and arrival time (µs since the epoch), in arrival order.
type Log = Arc<Mutex<Vec<(String, u64)>>>;

/// A receiver logging every arrival.
async fn logging_receiver() -> anyhow::Result<(Receiver, Log)> {
    let log: Log = Arc::default();
    let sink = log.clone();
    let receiver = Receiver::with_hook(move |id| {
        let at = unix_micros(SystemTime::now());
        if let Ok(mut l) = sink.lock() {
            l.push((id.to_owned(), at));
        }
    })
    .await?;
    Ok((receiver, log))
}

/// The arrivals logged from `from` on (first arrival per id).
fn since(log: &Log, from: usize) -> HashMap<String, u64> {
    let l = log.lock().unwrap_or_else(|p| p.into_inner());
    let mut first = HashMap::new();
    for (id, at) in l.iter().skip(from) {
        first.entry(id.clone()).or_insert(*at);
    }
    first
}

fn mark(log: &Log) -> usize {
    log.lock().unwrap_or_else(|p| p.into_inner()).len()
}

/// Runs `bench replay`.
pub async fn run(scratch: &Scratch, out: &Output, args: &Args) -> anyhow::Result<()> {
    anyhow::ensure!(args.events > 0, "--events: give at least 1");
    anyhow::ensure!(args.live_rate > 0, "--live-rate: give at least 1 event/s");
    anyhow::ensure!(args.rounds > 0, "--rounds: give at least 1");
    scratch.fresh_outbox().await?;
    scratch
        .generate(sql::load::RETAINED, args.events, 100_000, "retained", out)
        .await?;
    sql::setup::vacuum_analyze(&scratch.pool, "outbox").await?;
    let (a, a_log) = logging_receiver().await?;
    let (b, b_log) = logging_receiver().await?;
    let other = format!(
        "[[destinations]]\nname = \"other\"\ntype = \"webhook\"\nurl = \"{}\"\nconcurrency = 128\n",
        b.url
    );
    let spec = RelaySpec {
        retention: "7d",
        destination_name: "replayed",
        destination_keys: if args.ordered {
            "ordering = \"key\"\n"
        } else {
            ""
        },
        extra_destinations: &other,
        ..RelaySpec::new(&a.url)
    };
    let mut relay = RelayProcess::spawn(scratch, &spec)?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let store = Store::new(scratch.pool.clone(), pgoutbox::OutboxTable::default_table());
    let variant = if args.ordered { "ordered" } else { "unordered" };

    // Interleaved: the live load alone (the replay paused), then beside the replay, per round,
    // so that both halves of a round meet the same machine.
    let from = mark(&a_log);
    let id = start(&store, args).await?;
    replays::change(&store, id, Change::Pause).await?;
    let mut ratios: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    let mut live_ids = HashSet::new();
    let mut beside = Duration::ZERO;
    for round in 1..=args.rounds {
        let alone = live(scratch, args, (&a_log, &b_log)).await?;
        replays::change(&store, id, Change::Resume).await?;
        let started = Instant::now();
        let with = live(scratch, args, (&a_log, &b_log)).await?;
        replays::change(&store, id, Change::Pause).await?;
        beside += started.elapsed();
        live_ids.extend(alone.2);
        live_ids.extend(with.2);
        for (d, (dest, before, after)) in
            [("replayed", alone.0, with.0), ("other", alone.1, with.1)]
                .into_iter()
                .enumerate()
        {
            ratios[d].push(after.p99 / before.p99);
            out.row(Row {
                scenario: "replay".into(),
                variant: format!("{variant}, round {round}, live p99 at {dest}"),
                value: after.p99,
                unit: "ms",
                detail: format!(
                    "{:.2}x the live load alone ({:.1} ms → {:.1} ms; p50 {:.1} → {:.1}; live {:.0} → {:.0} events/s)",
                    after.p99 / before.p99,
                    before.p99,
                    after.p99,
                    before.p50,
                    after.p50,
                    before.count as f64 / args.duration.as_secs_f64(),
                    after.count as f64 / args.duration.as_secs_f64()
                ),
            });
        }
    }
    for (d, dest) in ["replayed", "other"].into_iter().enumerate() {
        out.row(Row {
            scenario: "replay".into(),
            variant: format!("{variant}, live p99 at {dest}, median ratio"),
            value: median(&ratios[d]),
            unit: "x",
            detail: format!(
                "with the replay / without, over {} interleaved rounds of {:?}",
                args.rounds, args.duration
            ),
        });
    }
    // With a rate of its own, the rest would take as long as the rate says: the replay's own
    // figures are those beside the live load (the kill run below times a whole one).
    let took = if args.rate.is_some() {
        replays::change(&store, id, Change::Cancel).await?;
        beside
    } else {
        replays::change(&store, id, Change::Resume).await?;
        let started = Instant::now();
        beside + wait_done(&store, id, out, &mut relay, started).await?
    };
    let r = replays::get(&store, id)
        .await?
        .context("the replay vanished")?;
    out.row(Row {
        scenario: "replay".into(),
        variant: format!("{variant}, {} events replayed", r.queued),
        value: r.queued as f64 / took.as_secs_f64(),
        unit: "ev/s",
        detail: format!(
            "in {:.1} s running ({:.1} s of it beside the live load; cancelled then when it has a rate); {} dead, own rate {}",
            took.as_secs_f64(),
            beside.as_secs_f64(),
            r.dead,
            args.rate.as_deref().unwrap_or("none")
        ),
    });
    if args.ordered {
        let violations = order_violations(scratch, &a_log, from, &live_ids).await?;
        out.row(Row {
            scenario: "replay".into(),
            variant: "ordered, per-key order violations".into(),
            value: violations as f64,
            unit: "",
            detail: "replayed and live events at the ordered destination, each stream by key"
                .into(),
        });
    }
    if !args.no_kill {
        killed(scratch, out, &store, args, &spec, relay, &a_log).await?;
    }
    Ok(())
}

async fn start(store: &Store, args: &Args) -> anyhow::Result<Uuid> {
    let new = NewReplay {
        destination: "replayed".into(),
        rate: args.rate.clone(),
        created_by: Some("bench".into()),
        ..NewReplay::default()
    };
    replays::create(store, &new)
        .await?
        .context("the replay was not created")
}

/// Waits for replay `id` to be done, with a progress bar; how long it took from `started`.
async fn wait_done(
    store: &Store,
    id: Uuid,
    out: &Output,
    relay: &mut RelayProcess,
    started: Instant,
) -> anyhow::Result<Duration> {
    let r = replays::get(store, id).await?.context("no replay")?;
    let bar = out.bar(r.total.max(0) as u64, "replay");
    loop {
        let r = replays::get(store, id)
            .await?
            .context("the replay vanished")?;
        bar.set_position(r.delivered().max(0) as u64);
        if r.state != "running" {
            anyhow::ensure!(r.state == "done", "the replay ended {}", r.state);
            break;
        }
        if let Some(why) = relay.exited() {
            anyhow::bail!("the relay exited during the replay: {why}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    bar.finish_and_clear();
    Ok(started.elapsed())
}

/// Runs the live load; commit→publish latency at each destination, and the live events' ids.
async fn live(
    scratch: &Scratch,
    args: &Args,
    logs: (&Log, &Log),
) -> anyhow::Result<(Summary, Summary, HashSet<String>)> {
    let marks = (mark(logs.0), mark(logs.1));
    let (producer, committed) = follow_producer(&Spec {
        url: &scratch.url,
        table: "outbox",
        connections: args.producers,
        rate: Some(args.live_rate),
        duration: args.duration,
        events: None,
        report: true,
        statement: if args.ordered {
            Statement::InsertKeyed
        } else {
            Statement::Insert
        },
    })?;
    let count = producer.await?? as usize;
    let committed = committed.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let arrived = |log: &Log, from: usize| {
        let seen = since(log, from);
        committed.keys().filter(|id| seen.contains_key(*id)).count()
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while (arrived(logs.0, marks.0) < count || arrived(logs.1, marks.1) < count)
        && Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let at_a = Latencies::join(&committed, &since(logs.0, marks.0)).summary();
    let at_b = Latencies::join(&committed, &since(logs.1, marks.1)).summary();
    Ok((at_a, at_b, committed.into_keys().collect()))
}

/// Per key, replayed events and live ones (those of `live`) each in seq order, first arrivals
/// from `from` on: how many arrived before one with a lower seq of their stream.
async fn order_violations(
    scratch: &Scratch,
    log: &Log,
    from: usize,
    live: &HashSet<String>,
) -> anyhow::Result<usize> {
    let rows = sql::watch::keys_and_seqs(&scratch.pool).await?;
    let by_id: HashMap<String, (Option<String>, i64)> =
        rows.into_iter().map(|(id, k, s)| (id, (k, s))).collect();
    let l = log.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let mut seen = HashSet::new();
    let mut last: HashMap<(String, bool), i64> = HashMap::new();
    let mut violations = 0;
    for (id, _) in l.iter().skip(from) {
        if !seen.insert(id.clone()) {
            continue;
        }
        let Some((Some(key), seq)) = by_id.get(id) else {
            continue;
        };
        let is_live = live.contains(id);
        let prev = last.entry((key.clone(), is_live)).or_insert(i64::MIN);
        if *seq < *prev {
            if violations == 0 {
                let stream = if is_live { "live" } else { "replayed" };
                eprintln!("first order violation: key {key}, {stream} seq {seq} after seq {prev}");
            }
            violations += 1;
        }
        *prev = (*prev).max(*seq);
    }
    Ok(violations)
}

/// The history replayed again, the relay killed half-way and another started: every event of
/// the replay's range must reach the destination at least once.
async fn killed(
    scratch: &Scratch,
    out: &Output,
    store: &Store,
    args: &Args,
    spec: &RelaySpec<'_>,
    relay: RelayProcess,
    log: &Log,
) -> anyhow::Result<()> {
    let from = mark(log);
    let unlimited = Args {
        rate: None,
        ..args.clone()
    };
    let id = start(store, &unlimited).await?;
    let total = replays::get(store, id).await?.context("no replay")?.total;
    let started = Instant::now();
    loop {
        let r = replays::get(store, id)
            .await?
            .context("the replay vanished")?;
        if r.read * 2 >= total || r.state != "running" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(relay); // SIGKILL
    let killed_at = replays::get(store, id).await?.context("no replay")?.read;
    let mut relay = RelayProcess::spawn(scratch, spec)?;
    let took = wait_done(store, id, out, &mut relay, started).await?;
    let arrived: HashSet<String> = since(log, from).into_keys().collect();
    let expected: HashSet<String> = sql::watch::keys_and_seqs(&scratch.pool)
        .await?
        .into_iter()
        .map(|(id, _, _)| id)
        .collect();
    let missing = expected.iter().filter(|id| !arrived.contains(*id)).count();
    out.row(Row {
        scenario: "replay".into(),
        variant: "relay killed half-way, events missing".into(),
        value: missing as f64,
        unit: "",
        detail: format!(
            "{} of {total} events arrived; killed at {killed_at} read, done {:.1} s after the start (a new relay took the replay over; its own rate none)",
            expected.len() - missing,
            took.as_secs_f64()
        ),
    });
    Ok(())
}
