//! `bench memory`: the relay's resident memory while one of its two destinations is down, with a
//! large backlog due (and optionally producers writing at a steady rate for a long time). The
//! promise measured: memory is bounded by the relay's batches and queues, never by the backlog or
//! by how long a destination stays down.
//!
//! Per source (poll, then WAL): a fresh outbox (and slot), `--events` written at once, then the
//! relay process with a null destination (`up`) and a webhook destination whose address refuses
//! connections (`down`: it fails, its breaker opens, its pairs are held). Its VmRSS is sampled
//! every second until `up` has published the backlog and whatever the producers wrote, and for
//! `--hold` after that (or for `--duration` with `--rate`). The line gives the peak, the median
//! of the first and the last quarter of the samples, and the growth between them.

use std::time::{Duration, Instant};

use super::metrics::{counter, counter_with};
use super::output::{Output, Row};
use super::process::{RelayProcess, RelaySpec};
use super::producer::{Producer, Spec, Statement};
use super::scratch::{Scratch, Source};
use super::sql;

/// Arguments of `bench memory`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Events due when the relay starts.
    #[arg(long, default_value_t = 1_000_000)]
    events: u64,
    /// Sources to run, in order (WAL needs wal_level = logical).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "poll,wal")]
    source: Vec<Source>,
    /// Producers write this many events a second beside the backlog (0: none), for `--duration`.
    #[arg(long, default_value_t = 0)]
    rate: u64,
    /// How long producers write (with `--rate`): e.g. 1h for the hour-long run.
    #[arg(long, default_value = "10m", value_parser = pgoutbox::config::parse_duration)]
    duration: Duration,
    /// How long memory is still sampled once `up` has published everything.
    #[arg(long, default_value = "30s", value_parser = pgoutbox::config::parse_duration)]
    hold: Duration,
}

/// What the samples of one run say.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Summary {
    /// The highest sample, MiB.
    pub peak: f64,
    /// Median of the first quarter of the samples, MiB.
    pub early: f64,
    /// Median of the last quarter, MiB.
    pub late: f64,
}

impl Summary {
    /// Summarises RSS samples in KiB (at least one).
    pub fn of(samples_kib: &[u64]) -> Self {
        let mib = |k: u64| k as f64 / 1024.0;
        let quarter = (samples_kib.len() / 4).max(1);
        let median = |part: &[u64]| {
            let mut part = part.to_vec();
            part.sort_unstable();
            part.get(part.len() / 2).copied().map_or(0.0, mib)
        };
        Self {
            peak: samples_kib.iter().copied().max().map_or(0.0, mib),
            early: median(&samples_kib[..quarter.min(samples_kib.len())]),
            late: median(&samples_kib[samples_kib.len().saturating_sub(quarter)..]),
        }
    }
}

/// Runs `bench memory`: one run per `--source`.
pub async fn run(scratch: &Scratch, out: &Output, args: &Args) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.events > 0 || args.rate > 0,
        "--events or --rate must be more than 0"
    );
    for &source in &args.source {
        one(scratch, out, args, source).await?;
    }
    Ok(())
}

async fn one(scratch: &Scratch, out: &Output, args: &Args, source: Source) -> anyhow::Result<()> {
    scratch.fresh_source(source).await?;
    let (table, _) = scratch.wal_names();
    scratch
        .generate(
            &sql::load::backlog_rows(&table),
            args.events,
            100_000,
            "backlog",
            out,
        )
        .await?;
    sql::setup::vacuum_analyze(&scratch.pool, "outbox").await?;
    // Nothing listens on a port just released: the `down` destination's connections are refused.
    let refused = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let down = format!(
        "[[destinations]]\nname = \"down\"\ntype = \"webhook\"\nurl = \"http://127.0.0.1:{refused}/\"\n"
    );
    let spec = RelaySpec {
        source,
        null_sink: true,
        destination_name: "up",
        extra_destinations: &down,
        retention: "7d",
        ..RelaySpec::new("")
    };
    let mut relay = RelayProcess::spawn(scratch, &spec)?;
    let mut producers = (args.rate > 0).then(|| {
        let (url, rate, duration) = (scratch.url.clone(), args.rate, args.duration);
        tokio::spawn(async move {
            let spec = Spec {
                url: &url,
                table: "outbox",
                connections: 4,
                rate: Some(rate),
                duration,
                events: None,
                report: false,
                statement: Statement::Insert,
            };
            Producer::run(&spec).await
        })
    });
    let started = Instant::now();
    let bar = out.bar(
        args.events + args.rate * args.duration.as_secs(),
        &format!("memory {}", source.as_str()),
    );
    let mut samples = Vec::new();
    let mut done_at: Option<Instant> = None;
    let mut written_total = None;
    let mut scrape;
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        if let Some(why) = relay.exited() {
            anyhow::bail!("the relay process stopped ({why})");
        }
        samples.push(relay.rss_kib());
        scrape = relay.metrics().await;
        let published = counter_with(
            &scrape,
            pgoutbox::model::metric::PUBLISHED_TOTAL,
            "destination=\"up\"",
        ) as u64;
        bar.set_position(published);
        if let Some(task) = producers.take_if(|task| task.is_finished()) {
            written_total = Some(task.await??);
        }
        // Producers still writing: not done, whatever `up` has published so far.
        let due = args.events + written_total.unwrap_or(0);
        if done_at.is_none() && producers.is_none() && published >= due {
            done_at = Some(Instant::now());
        }
        if done_at.is_some_and(|at| at.elapsed() >= args.hold) {
            break;
        }
    }
    bar.finish_and_clear();
    let held = counter(&scrape, pgoutbox::model::metric::HELD_TOTAL);
    let summary = Summary::of(&samples);
    out.row(Row {
        scenario: "memory".into(),
        variant: format!(
            "{}, 1 of 2 destinations down{}",
            source.as_str(),
            if args.rate > 0 { format!(", {}/s for {}", args.rate, humantime::format_duration(args.duration)) } else { String::new() }
        ),
        value: summary.peak,
        unit: "MiB peak",
        detail: format!(
            "{} events due at start, {} written during the run; RSS median {:.1} MiB in the first quarter, {:.1} MiB in the last ({:+.1} MiB), {} samples over {:.0} s; up published everything in {:.0} s; {held} events held for down",
            args.events,
            written_total.unwrap_or(0),
            summary.early,
            summary.late,
            summary.late - summary.early,
            samples.len(),
            started.elapsed().as_secs_f64(),
            done_at.map_or(0.0, |at| at.duration_since(started).as_secs_f64()),
        ),
    });
    drop(relay);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summary_weighs_the_first_and_last_quarters() {
        let cases: &[(&[u64], Summary)] = &[
            (
                &[1024],
                Summary {
                    peak: 1.0,
                    early: 1.0,
                    late: 1.0,
                },
            ),
            (
                &[1024, 2048, 2048, 2048, 2048, 2048, 2048, 4096],
                Summary {
                    peak: 4.0,
                    early: 2.0,
                    late: 4.0,
                },
            ),
            (
                &[10240, 10240, 10240, 10240, 10240, 10240, 10240, 10240],
                Summary {
                    peak: 10.0,
                    early: 10.0,
                    late: 10.0,
                },
            ),
        ];
        for (samples, expected) in cases {
            assert_eq!(Summary::of(samples), *expected, "{samples:?}");
        }
    }
}
