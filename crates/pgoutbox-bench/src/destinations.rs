//! `bench destinations`: what one relay costs as its destinations grow. N webhook destinations,
//! each on its own topic (`t.<i>`), all pointing at the bench's local receiver, as a SaaS's
//! customers' endpoints would: all but the first managed at runtime (in the database, as
//! `destinations add` writes them), or all in the configuration file with `--in-file`. For each
//! count, in a fresh outbox: the relay's start until
//! `/readyz` answers 200, then, idle for `--idle`, its CPU and its PostgreSQL backends' (from
//! /proc), the transactions it commits per second (`pg_stat_database`), the connections it
//! holds, its resident memory and the size of a `/metrics` scrape (again after the drain); then `--events` events spread
//! evenly over the topics, inserted at once, and the time until none is pending, with the
//! relay's resident memory at that moment, 3 s later, and at its peak (VmHWM); then a second
//! relay beside it, and `--changes` changes to a destination managed at runtime (added, then its
//! URL changed), each timed from its commit until both relays run with it (their log says so).
//! Every figure is also given as a ratio to the first count's.
//!
//! Run it on a server whose `max_connections` is not the limit being measured: the relay's pool
//! is `workers * 2 + 5` whatever the count. Routing alone is `bench routing`.

use std::time::{Duration, Instant};

use super::output::{rate, Output, Row};
use super::process::{proc_cpu, RelayProcess, RelaySpec};
use super::receiver::Receiver;
use super::scratch::Scratch;
use super::sql;

/// Arguments of `bench destinations`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Destination counts, one run each (the first is the reference of the ratios).
    #[arg(long, value_delimiter = ',', default_value = "1,100,1000")]
    counts: Vec<usize>,
    /// Events spread over the destinations' topics for the drain.
    #[arg(long, default_value_t = 100_000)]
    events: u64,
    /// How long the idle relay is watched.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    idle: Duration,
    /// Changes timed from commit to applied by two relays (the first adds a destination, the
    /// others change its URL); 0: none.
    #[arg(long, default_value_t = 20)]
    changes: usize,
    /// Define the destinations in the configuration file, not at runtime (in the database, as
    /// `pgoutbox destinations add` does, the default): each one is then also checked by
    /// `/readyz` and has series of its own in `/metrics`.
    #[arg(long)]
    in_file: bool,

    /// How long the relay may take to become ready.
    #[arg(long, default_value = "120s", value_parser = humantime::parse_duration)]
    ready_within: Duration,
}

/// One count's figures.
#[derive(Debug, Clone, Copy)]
struct Figures {
    ready: Duration,
    idle_cpu: f64,
    idle_xacts: f64,
    connections: usize,
    rss_idle_mib: f64,
    rss_after_mib: f64,
    rss_settled_mib: f64,
    rss_peak_mib: f64,
    scrape_kib: f64,
    scrape_after_kib: f64,
    drain: f64,
    applied_p50: Duration,
    applied_max: Duration,
}

/// The `[[destinations]]` tables after the first (`d0`, which the relay spec names): `d<i>` on
/// topic `t.<i>`, a webhook to `url`.
fn more_destinations(count: usize, url: &str) -> String {
    (1..count)
        .map(|i| {
            format!("[[destinations]]\nname = \"d{i}\"\ntype = \"webhook\"\nurl = \"{url}\"\ntopics = [\"t.{i}\"]\n")
        })
        .collect()
}

/// Runs `bench destinations`: one run per count, its rows, and each figure's ratio to the first.
pub async fn run(scratch: &Scratch, out: &Output, args: &Args) -> anyhow::Result<()> {
    if args.counts.is_empty() || args.counts.contains(&0) {
        anyhow::bail!("--counts: give destination counts of 1 or more, e.g. 1,100,1000");
    }
    let receiver = Receiver::start().await?;
    let mut first: Option<Figures> = None;
    for &count in &args.counts {
        let figures = measure(scratch, out, args, &receiver.url, count).await?;
        let base = *first.get_or_insert(figures);
        print(out, count, &figures, &base);
    }
    Ok(())
}

impl Figures {
    /// Each figure: what it is, its value and its unit.
    fn named(&self) -> [(&'static str, f64, &'static str); 13] {
        [
            ("start → ready", self.ready.as_secs_f64(), "s"),
            ("idle CPU (relay + backends)", self.idle_cpu, "% of a core"),
            ("idle transactions", self.idle_xacts, "/s"),
            ("connections held", self.connections as f64, ""),
            ("RSS idle", self.rss_idle_mib, "MiB"),
            ("RSS at the drain's end", self.rss_after_mib, "MiB"),
            ("RSS 3 s after the drain", self.rss_settled_mib, "MiB"),
            ("RSS peak", self.rss_peak_mib, "MiB"),
            ("/metrics scrape, idle", self.scrape_kib, "KiB"),
            (
                "/metrics scrape after the drain",
                self.scrape_after_kib,
                "KiB",
            ),
            ("drain", self.drain, "ev/s"),
            (
                "change → applied by 2 relays, p50",
                self.applied_p50.as_secs_f64(),
                "s",
            ),
            (
                "change → applied by 2 relays, max (p99)",
                self.applied_max.as_secs_f64(),
                "s",
            ),
        ]
    }
}

/// Prints one count's rows, with their ratios to `base`.
fn print(out: &Output, count: usize, f: &Figures, base: &Figures) {
    for ((what, value, unit), (_, first, _)) in f.named().into_iter().zip(base.named()) {
        let detail = if first > 0.0 {
            format!("{:.2}× the first count", value / first)
        } else {
            "the first count measured 0".to_owned()
        };
        out.row(Row {
            scenario: "destinations".into(),
            variant: format!("{count}: {what}"),
            value,
            unit,
            detail,
        });
    }
}

/// CPU time of the relay's PostgreSQL backends (the pids given), from /proc.
fn backends_cpu(pids: &[i32]) -> Duration {
    pids.iter()
        .filter_map(|&pid| u32::try_from(pid).ok().and_then(proc_cpu))
        .sum()
}

/// One run: a relay with `count` destinations, from start to drained.
async fn measure(
    scratch: &Scratch,
    out: &Output,
    args: &Args,
    url: &str,
    count: usize,
) -> anyhow::Result<Figures> {
    scratch.fresh_outbox().await?;
    // `d0`, which the relay spec names, is in the file either way.
    let extra = if args.in_file {
        more_destinations(count, url)
    } else {
        sql::load::runtime_destinations(&scratch.pool, count as i64, url).await?;
        String::new()
    };
    let mut spec = RelaySpec::new(url);
    spec.destination_name = "d0";
    spec.destination_keys = "topics = [\"t.0\"]\n";
    spec.extra_destinations = &extra;
    spec.min_poll = "1ms";
    let started = Instant::now();
    let mut relay = RelayProcess::spawn(scratch, &spec)?;
    let what = format!("the relay with {count} destinations");
    let ready = relay.wait_ready(started, args.ready_within, &what).await?;
    // Start-up work (registering destinations, first probes) is over before the idle window.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let pids = sql::watch::relay_backends(&scratch.pool).await?;
    let (cpu0, backends0, xacts0) = (
        relay.cpu(),
        backends_cpu(&pids),
        sql::watch::transactions(&scratch.pool).await?,
    );
    let window = Instant::now();
    tokio::time::sleep(args.idle).await;
    let seconds = window.elapsed().as_secs_f64();
    let pids_after = sql::watch::relay_backends(&scratch.pool).await?;
    let busy = (relay.cpu() + backends_cpu(&pids)).saturating_sub(cpu0 + backends0);
    // The bench's own two statements above are in the count: take them off.
    let xacts = (sql::watch::transactions(&scratch.pool).await? - xacts0 - 2).max(0);
    let rss_idle_mib = relay.rss_kib() as f64 / 1024.0;
    let scrape_kib = relay.metrics().await.len() as f64 / 1024.0;

    let bar = out.bar(args.events, &format!("drain over {count} destinations"));
    let drain_started = Instant::now();
    sql::load::insert_spread(&scratch.pool, args.events as i64, count as i64).await?;
    scratch.wait_drained(&bar, args.events).await?;
    let drain = rate(args.events, drain_started.elapsed());
    bar.finish_and_clear();
    if let Some(why) = relay.exited() {
        anyhow::bail!("the relay with {count} destinations stopped during the drain ({why})");
    }
    let rss_after_mib = relay.rss_kib() as f64 / 1024.0;
    // What the relay keeps once the drain's connections and buffers are given back (an idle
    // connection past what a client keeps closes when it comes back; the allocator returns
    // freed pages within a second or so).
    tokio::time::sleep(AFTER_SETTLE).await;
    let rss_settled_mib = relay.rss_kib() as f64 / 1024.0;
    let rss_peak_mib = relay.peak_rss_kib() as f64 / 1024.0;
    // Every destination has had events by now: the series a scrape holds when all are in use.
    let scrape_after_kib = relay.metrics().await.len() as f64 / 1024.0;
    let applied = if args.changes > 0 {
        let mut second = RelayProcess::spawn(scratch, &spec)?;
        while !second.ready().await {
            if let Some(why) = second.exited() {
                anyhow::bail!("the second relay stopped before it was ready ({why})");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        change_to_applied(scratch, out, args.changes, url, [&relay, &second]).await?
    } else {
        Vec::new()
    };
    Ok(Figures {
        ready,
        idle_cpu: busy.as_secs_f64() / seconds * 100.0,
        idle_xacts: xacts as f64 / seconds,
        connections: pids_after.len(),
        rss_idle_mib,
        rss_after_mib,
        rss_settled_mib,
        rss_peak_mib,
        scrape_kib,
        scrape_after_kib,
        drain,
        applied_p50: applied.get(applied.len() / 2).copied().unwrap_or_default(),
        applied_max: applied.last().copied().unwrap_or_default(),
    })
}

/// How long after the drain the settled RSS is read.
const AFTER_SETTLE: Duration = Duration::from_secs(3);

/// How long after a change's commit to wait for both relays to run with it.
const APPLIED_WITHIN: Duration = Duration::from_secs(60);

/// `changes` changes to the destination `applied` (added, then its URL changed each time), each
/// timed from its commit until every relay of `relays` logs that it started with that version;
/// the times, sorted.
async fn change_to_applied(
    scratch: &Scratch,
    out: &Output,
    changes: usize,
    url: &str,
    relays: [&RelayProcess; 2],
) -> anyhow::Result<Vec<Duration>> {
    use pgoutbox::definitions::{Actor, Catalog};
    let store = pgoutbox::store::Store::new(scratch.pool.clone(), scratch.wal_names().0);
    let catalog = Catalog::new(store, None, Default::default());
    let by = Actor {
        who: "bench",
        via: "cli",
    };
    let bar = out.bar(changes as u64, "changes applied by two relays");
    let mut times = Vec::with_capacity(changes);
    for k in 0..changes {
        let started = Instant::now();
        let version = if k == 0 {
            let definition = serde_json::json!({
                "name": "applied", "type": "webhook", "url": url, "topics": ["applied"],
            });
            let serde_json::Value::Object(definition) = definition else {
                anyhow::bail!("a definition is an object");
            };
            catalog.add(definition, by).await?
        } else {
            // A new path: a query would count as a credential, and be sealed.
            let patch =
                serde_json::json!({ "url": format!("{}/change-{k}", url.trim_end_matches('/')) });
            catalog.update("applied", &patch, by).await?
        };
        let started_line = format!("version={version}");
        loop {
            let applied = relays.iter().all(|r| {
                r.log()
                    .lines()
                    .any(|l| l.contains("relay started") && l.contains(&started_line))
            });
            if applied {
                break;
            }
            anyhow::ensure!(
                started.elapsed() < APPLIED_WITHIN,
                "change {k} (version {version}) was not applied by both relays within {} s: {}",
                APPLIED_WITHIN.as_secs(),
                relays[0].log_tail()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        times.push(started.elapsed());
        bar.inc(1);
    }
    bar.finish_and_clear();
    // The definitions outlive the bench's fresh outbox: the next count starts without it.
    catalog.remove("applied", true, by).await?;
    times.sort();
    Ok(times)
}
