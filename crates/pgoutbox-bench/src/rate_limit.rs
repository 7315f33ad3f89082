//! `bench rate-limit`: the rate a webhook receiver sees from a destination with `rate_limit`,
//! served by 1 relay and by several (each with its own pool, as separate processes would be),
//! over a backlog that lasts the whole run. One row per window (events/s and the error against
//! the limit), then the worst window and the run's mean per relay count.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pgoutbox::config::Config;
use pgoutbox::model::rate::RateLimit;
use tokio_util::sync::CancellationToken;

use super::output::{Output, Row};
use super::process::in_process_relays;
use super::receiver::Receiver;
use super::scratch::Scratch;
use super::sql;

/// Arguments of `bench rate-limit`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// The destination's `rate_limit`.
    #[arg(long, default_value = "200/s")]
    rate: String,
    /// Its burst (default: one second's events).
    #[arg(long)]
    burst: Option<u32>,
    /// Relay counts to run, one run each.
    #[arg(long, value_delimiter = ',', default_value = "1,4")]
    relays: Vec<usize>,
    /// Length of one measured window.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    window: Duration,
    /// Windows measured per run.
    #[arg(long, default_value_t = 6)]
    windows: u32,
    /// Time before the first window: relays start, the burst goes out.
    #[arg(long, default_value = "3s", value_parser = humantime::parse_duration)]
    warmup: Duration,
}

/// Runs `bench rate-limit`: one run per relay count.
pub async fn run(scratch: &Scratch, out: &Output, args: &Args) -> anyhow::Result<()> {
    let limit = RateLimit::parse(&args.rate, args.burst).map_err(anyhow::Error::msg)?;
    if args.relays.is_empty() || args.relays.contains(&0) {
        anyhow::bail!("--relays: give relay counts of 1 or more, e.g. 1,4");
    }
    for &relays in &args.relays {
        let (rates, dead, attempted) = measure(scratch, out, args, limit, relays).await?;
        let target = limit.per_second;
        let error = |r: f64| (r - target) / target * 100.0;
        for (i, r) in rates.iter().enumerate() {
            out.row(Row {
                scenario: "rate-limit".into(),
                variant: format!("{relays} relays, window {}", i + 1),
                value: *r,
                unit: "ev/s",
                detail: format!(
                    "{:+.1} % of {} ({:?} windows)",
                    error(*r),
                    args.rate,
                    args.window
                ),
            });
        }
        let worst = rates
            .iter()
            .copied()
            .max_by(|a, b| error(*a).abs().total_cmp(&error(*b).abs()))
            .unwrap_or(0.0);
        let mean = rates.iter().sum::<f64>() / rates.len().max(1) as f64;
        out.row(Row {
            scenario: "rate-limit".into(),
            variant: format!("{relays} relays, worst window"),
            value: worst,
            unit: "ev/s",
            detail: format!(
                "{:+.1} % of {}; mean {mean:.1} ev/s ({:+.1} %), burst {}; {dead} dead, {attempted} attempted",
                error(worst),
                args.rate,
                error(mean),
                limit.burst
            ),
        });
    }
    Ok(())
}

/// Events per second the receiver saw in each window, with `relays` relays draining a backlog;
/// then the events dead and attempted (both should be 0: waiting for a token is neither).
async fn measure(
    scratch: &Scratch,
    out: &Output,
    args: &Args,
    limit: RateLimit,
    relays: usize,
) -> anyhow::Result<(Vec<f64>, i64, i64)> {
    let total = args.warmup + args.window * args.windows;
    // Half as much again as the run can send: the backlog never runs out.
    let events =
        (limit.per_second * total.as_secs_f64() * 1.5).ceil() as u64 + u64::from(limit.burst);
    scratch.fresh_outbox().await?;
    scratch.prefill(events, out).await?;
    let arrivals = Arc::new(Mutex::new(Vec::<Instant>::with_capacity(events as usize)));
    let seen = arrivals.clone();
    let receiver = Receiver::with_hook(move |_| {
        seen.lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(Instant::now());
    })
    .await?;
    let text = format!(
        "retention = \"0s\"\n[[destinations]]\nname = \"limited\"\ntype = \"webhook\"\nurl = \"{}\"\n\
         rate_limit = {{ rate = \"{}\", burst = {} }}\n",
        receiver.url, args.rate, limit.burst
    );
    let config = Config::parse(&text, |_| None)?;
    let stop = CancellationToken::new();
    let tasks = in_process_relays(scratch, &config, relays, &stop).await?;
    let bar = out.bar(total.as_secs(), &format!("{relays} relays"));
    let started = Instant::now();
    while started.elapsed() < total {
        tokio::time::sleep(Duration::from_secs(1)).await;
        bar.set_position(started.elapsed().as_secs());
    }
    stop.cancel();
    for t in tasks {
        t.await??;
    }
    bar.finish_and_clear();
    let arrivals = arrivals.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let (dead, attempted) = sql::watch::dead_and_attempted(&scratch.pool).await?;
    Ok((
        windows(&arrivals, started + args.warmup, args.window, args.windows),
        dead,
        attempted,
    ))
}

/// Arrivals per second in each of `n` windows of `width` from `from`.
fn windows(arrivals: &[Instant], from: Instant, width: Duration, n: u32) -> Vec<f64> {
    (0..n)
        .map(|i| {
            let start = from + width * i;
            let end = start + width;
            let count = arrivals.iter().filter(|&&a| a >= start && a < end).count();
            count as f64 / width.as_secs_f64()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arrivals_are_counted_per_window() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let arrivals = [
            at(0),
            at(500),
            at(999),
            at(1000),
            at(1500),
            at(2500),
            at(9000),
        ];
        let rates = windows(&arrivals, t0, Duration::from_secs(1), 3);
        assert_eq!(rates, vec![3.0, 2.0, 1.0]);
    }
}
