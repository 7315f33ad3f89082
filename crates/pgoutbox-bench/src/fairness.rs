//! `bench fairness`: whether destinations that fail, hang or have a backlog cost the healthy ones
//! anything. One relay with N webhook destinations (`d<i>` on topic `t.<i>`) and one more,
//! `backlog`; a steady `--rate` of events spread over the N topics; and the commit → delivery
//! latency of the events of the healthy destinations. It runs twice, each time in a fresh outbox:
//! once with every destination healthy and nothing waiting, then with `--failing` percent of the N
//! failing (half answer 503, half accept the connection and never answer) and `--backlog` due
//! (event, destination) pairs waiting for `backlog` (a destination that was down and is back).
//! The figure is the ratio of the healthy destinations' p99s, with them to without.

use std::collections::HashMap;
use std::time::{Duration, Instant, SystemTime};

use super::latency::{timed_receiver, Summary, Times};
use super::output::{Output, Row};
use super::process::{RelayProcess, RelaySpec};
use super::producer::unix_micros;
use super::scratch::Scratch;
use super::sql;

/// Arguments of `bench fairness`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Webhook destinations, each on its own topic.
    #[arg(long, default_value_t = 10_000)]
    destinations: usize,
    /// Percent of them failing in the second run: half answer 503, half never answer (0 to 50).
    #[arg(long, default_value_t = 1.0)]
    failing: f64,
    /// Due pairs waiting for the `backlog` destination in the second run.
    #[arg(long, default_value_t = 1_000_000)]
    backlog: u64,
    /// Events committed per second, spread over the destinations' topics.
    #[arg(long, default_value_t = 1_000)]
    rate: u64,
    /// How long events are committed in each run.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// How long, after the last commit, the healthy destinations' events may take to arrive.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    grace: Duration,
    /// How long the relay may take to become ready.
    #[arg(long, default_value = "120s", value_parser = humantime::parse_duration)]
    ready_within: Duration,
    /// Also print each second's p99 and max (by commit time), to see when a run slowed down.
    #[arg(long)]
    per_second: bool,
}

impl Args {
    /// Refuses arguments that cannot run, naming the flag.
    pub fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.destinations >= 2,
            "--destinations: give at least 2 (healthy ones beside the failing ones)"
        );
        anyhow::ensure!(
            (0.0..=50.0).contains(&self.failing),
            "--failing: give a percent from 0 to 50"
        );
        anyhow::ensure!(self.rate > 0, "--rate: give at least 1 event per second");
        anyhow::ensure!(
            self.duration >= Duration::from_millis(10),
            "--duration: give at least 10ms"
        );
        Ok(())
    }
}

/// How a failing destination fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fail {
    /// Answers 503.
    Unavailable,
    /// Accepts the connection and never answers.
    Hang,
}

/// Whether destination `i` fails when `percent` of them do, and how: one in every `100 /
/// percent`, in the middle of its stride (never `d0`), alternately 503 and no answer.
fn failing(i: usize, percent: f64) -> Option<Fail> {
    if percent <= 0.0 {
        return None;
    }
    let stride = ((100.0 / percent).round() as usize).max(2);
    (i % stride == stride / 2).then(|| {
        if (i / stride).is_multiple_of(2) {
            Fail::Unavailable
        } else {
            Fail::Hang
        }
    })
}

/// The first seconds of a run, reported apart: while the relay finds out which destinations fail
/// (a breaker opens after `breaker.failures`, a silent destination after a second).
const FINDING_OUT: Duration = Duration::from_secs(5);

/// What one run measured.
struct Figures {
    healthy: Summary,
    /// The events committed in the first [`FINDING_OUT`], and those after.
    early: Summary,
    late: Summary,
    committed: usize,
    backlog_delivered: u64,
}

/// Runs `bench fairness`: the healthy run, the run with failing destinations and a backlog, and
/// the ratio of their p99s.
pub async fn run(scratch: &Scratch, out: &Output, args: &Args) -> anyhow::Result<()> {
    let (receiver, arrivals) = timed_receiver().await?;
    let base = receiver.url.trim_end_matches("/events").to_owned();
    let without = measure(scratch, out, args, &base, &arrivals, false).await?;
    report(out, "without", &without, None);
    let with = measure(scratch, out, args, &base, &arrivals, true).await?;
    report(out, "with", &with, Some(&without));
    Ok(())
}

/// Prints one run's rows; `base` (the healthy run) gives the ratios.
fn report(out: &Output, run: &str, f: &Figures, base: Option<&Figures>) {
    let ratio = |value: f64, of: fn(&Summary) -> f64| match base {
        Some(b) if of(&b.healthy) > 0.0 => {
            format!("{:.2}× the healthy run", value / of(&b.healthy))
        }
        _ => String::new(),
    };
    let split = |s: &Summary, of: &Summary| match base {
        Some(_) if of.p99 > 0.0 => format!("{:.2}× the healthy run's", s.p99 / of.p99),
        _ => String::new(),
    };
    let rows = [
        ("p50", f.healthy.p50, ratio(f.healthy.p50, |s| s.p50)),
        ("p99", f.healthy.p99, ratio(f.healthy.p99, |s| s.p99)),
        ("max", f.healthy.max, ratio(f.healthy.max, |s| s.max)),
        (
            "p99, first 5 s",
            f.early.p99,
            split(&f.early, base.map_or(&f.early, |b| &b.early)),
        ),
        (
            "p99, after 5 s",
            f.late.p99,
            split(&f.late, base.map_or(&f.late, |b| &b.late)),
        ),
    ];
    for (what, value, detail) in rows {
        // A run of 5 s or less has no events after its first 5 s: no row rather than NaN.
        if value.is_nan() {
            continue;
        }
        out.row(Row {
            scenario: "fairness".into(),
            variant: format!("{run}: healthy commit→delivery {what}"),
            value,
            unit: "ms",
            detail,
        });
    }
    out.row(Row {
        scenario: "fairness".into(),
        variant: format!("{run}: healthy events delivered"),
        value: f.healthy.count as f64,
        unit: "",
        detail: format!("of {} committed", f.committed),
    });
    if base.is_some() {
        out.row(Row {
            scenario: "fairness".into(),
            variant: format!("{run}: backlog delivered meanwhile"),
            value: f.backlog_delivered as f64,
            unit: "",
            detail: "pairs of the backlog destination".into(),
        });
    }
}

/// The `[[destinations]]` tables after `d0`: `d<i>` on `t.<i>`, failing ones (when `faults`) at
/// the receiver's failing paths; then `backlog`.
fn destinations(count: usize, base: &str, percent: f64, faults: bool) -> String {
    let mut toml = String::new();
    for i in 1..count {
        let path = match failing(i, percent).filter(|_| faults) {
            None => "events",
            Some(Fail::Unavailable) => "unavailable",
            Some(Fail::Hang) => "hang",
        };
        toml.push_str(&format!(
            "[[destinations]]\nname = \"d{i}\"\ntype = \"webhook\"\nurl = \"{base}/{path}\"\ntopics = [\"t.{i}\"]\n"
        ));
    }
    toml.push_str(&format!(
        "[[destinations]]\nname = \"backlog\"\ntype = \"webhook\"\nurl = \"{base}/events\"\ntopics = [\"backlog\"]\n"
    ));
    toml
}

/// One run in a fresh outbox; `faults`: with the failing destinations and the backlog.
async fn measure(
    scratch: &Scratch,
    out: &Output,
    args: &Args,
    base: &str,
    arrivals: &Times,
    faults: bool,
) -> anyhow::Result<Figures> {
    scratch.fresh_outbox().await?;
    if let Ok(mut m) = arrivals.lock() {
        m.clear();
    }
    let backlog = if faults { args.backlog } else { 0 };
    if backlog > 0 {
        let bar = out.bar(backlog, "backlog pairs");
        sql::load::due_pairs(&scratch.pool, "backlog", i64::try_from(backlog)?).await?;
        bar.finish_and_clear();
    }
    let extra = destinations(args.destinations, base, args.failing, faults);
    let url = format!("{base}/events");
    let mut spec = RelaySpec::new(&url);
    spec.destination_name = "d0";
    spec.destination_keys = "topics = [\"t.0\"]\n";
    spec.extra_destinations = &extra;
    let started = Instant::now();
    let mut relay = RelayProcess::spawn(scratch, &spec)?;
    relay
        .wait_ready(started, args.ready_within, "the relay")
        .await?;
    let committed = produce(scratch, out, args).await?;
    let bar = out.bar(committed.len() as u64, "healthy events arriving");
    let deadline = Instant::now() + args.grace;
    loop {
        let arrived = arrived_count(&committed, arrivals);
        bar.set_position(arrived as u64);
        if arrived == committed.len() || Instant::now() >= deadline {
            break;
        }
        if let Some(why) = relay.exited() {
            anyhow::bail!("the relay stopped during the run ({why})");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bar.finish_and_clear();
    let left = sql::watch::pairs_left(&scratch.pool, "backlog").await?;
    // (commit time, latency), µs.
    let latencies: Vec<(u64, u64)> = {
        let arrivals = arrivals
            .lock()
            .map_err(|_| anyhow::anyhow!("the receiver's record was poisoned"))?;
        committed
            .iter()
            .filter_map(|(id, at)| arrivals.get(id).map(|r| (*at, r.saturating_sub(*at))))
            .collect()
    };
    let first = latencies.iter().map(|(at, _)| *at).min().unwrap_or(0);
    if args.per_second {
        let mut by_second: std::collections::BTreeMap<u64, Vec<u64>> = Default::default();
        for (at, l) in &latencies {
            by_second
                .entry(at.saturating_sub(first) / 1_000_000)
                .or_default()
                .push(*l);
        }
        let run = if faults { "with" } else { "without" };
        for (second, values) in by_second {
            let s = Summary::of(values);
            out.row(Row {
                scenario: "fairness".into(),
                variant: format!("{run}: second {second}, p99"),
                value: s.p99,
                unit: "ms",
                detail: format!("max {:.1} ms, {} events", s.max, s.count),
            });
        }
    }
    let split = first + FINDING_OUT.as_micros() as u64;
    let part = |early: bool| {
        Summary::of(
            latencies
                .iter()
                .filter(|(at, _)| (*at < split) == early)
                .map(|(_, l)| *l)
                .collect(),
        )
    };
    Ok(Figures {
        early: part(true),
        late: part(false),
        healthy: Summary::of(latencies.iter().map(|(_, l)| *l).collect()),
        committed: committed.len(),
        backlog_delivered: backlog.saturating_sub(u64::try_from(left).unwrap_or(0)),
    })
}

/// How many of `committed` have arrived.
fn arrived_count(committed: &HashMap<String, u64>, arrivals: &Times) -> usize {
    arrivals.lock().map_or(0, |m| {
        committed.keys().filter(|id| m.contains_key(*id)).count()
    })
}

/// Commits `--rate` events a second for `--duration`, a few per statement every 10 ms, spread
/// over the topics; returns the healthy destinations' events with their commit times (µs since
/// the epoch, the receiver's clock).
async fn produce(
    scratch: &Scratch,
    out: &Output,
    args: &Args,
) -> anyhow::Result<HashMap<String, u64>> {
    const TICK: Duration = Duration::from_millis(10);
    let ticks = (args.duration.as_millis() / TICK.as_millis()).max(1) as u64;
    let per_tick = args.rate as f64 * TICK.as_secs_f64();
    let bar = out.bar(ticks, "steady events");
    let mut interval = tokio::time::interval(TICK);
    let mut committed = HashMap::new();
    let mut next = 0usize;
    let mut owed = 0.0;
    for tick in 0..ticks {
        interval.tick().await;
        owed += per_tick;
        let n = owed as usize;
        owed -= n as f64;
        if n == 0 {
            continue;
        }
        // Consecutive events go to destinations far apart (a prime stride).
        let topics: Vec<i32> = (0..n)
            .map(|k| ((next + k).wrapping_mul(7_919) % args.destinations) as i32)
            .collect();
        next += n;
        let rows = sql::load::spread_events(&scratch.pool, &topics).await?;
        let at = unix_micros(SystemTime::now());
        for (id, topic) in rows {
            // The same destinations are measured in both runs: the ones that fail in the second
            // are left out of the first too.
            if failing(topic as usize, args.failing).is_none() {
                committed.insert(id, at);
            }
        }
        bar.set_position(tick + 1);
    }
    bar.finish_and_clear();
    Ok(committed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_percent_fail_alternately_and_never_the_first() {
        let fails: Vec<(usize, Fail)> = (0..400)
            .filter_map(|i| failing(i, 1.0).map(|f| (i, f)))
            .collect();
        assert_eq!(
            fails,
            vec![
                (50, Fail::Unavailable),
                (150, Fail::Hang),
                (250, Fail::Unavailable),
                (350, Fail::Hang)
            ]
        );
        assert_eq!(failing(0, 50.0), None);
        assert_eq!(failing(1, 50.0), Some(Fail::Unavailable));
        assert_eq!(failing(3, 50.0), Some(Fail::Hang));
        assert_eq!(failing(50, 0.0), None);
        let count = (0..10_000).filter(|&i| failing(i, 1.0).is_some()).count();
        assert_eq!(count, 100);
    }
}
