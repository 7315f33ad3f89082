//! `bench history`: does a batch's cost (claim and settle, nothing to publish) grow with retained
//! published history? (It should not: the claim reads a partial index of pending rows only.)

use std::time::Duration;

use super::claim_settle::{claim_and_settle, relay};
use super::output::{Output, Row};
use super::scratch::Scratch;
use super::sql;

/// Arguments of `bench history`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Published rows retained in the second run.
    #[arg(long, default_value_t = 10_000_000)]
    history_rows: u64,
    /// Pending events claimed in each run.
    #[arg(long, default_value_t = 100_000)]
    events: u64,
    /// Rows per claim.
    #[arg(long, default_value_t = 1000)]
    batch_size: usize,
}

impl Args {
    /// Small sizes for `bench quick`.
    pub fn quick() -> Self {
        Self {
            history_rows: 1_000_000,
            events: 20_000,
            batch_size: 1000,
        }
    }
}

/// Runs `bench history`: the median claim with no history, then with `--history-rows` retained.
pub async fn run(scratch: &Scratch, out: &Output, args: &Args) -> anyhow::Result<()> {
    scratch.fresh_outbox().await?;
    scratch.prefill(args.events, out).await?;
    let empty = claim_times(scratch, args).await?;

    scratch.fresh_outbox().await?;
    scratch
        .generate(
            sql::load::HISTORY,
            args.history_rows,
            1_000_000,
            "history",
            out,
        )
        .await?;
    scratch.prefill(args.events, out).await?;
    let with_history = claim_times(scratch, args).await?;

    for (variant, t) in [
        ("0 published rows retained".to_owned(), empty),
        (
            format!("{} published rows retained", args.history_rows),
            with_history,
        ),
    ] {
        out.row(Row {
            scenario: "history".into(),
            variant,
            value: t.as_secs_f64() * 1000.0,
            unit: "ms/batch",
            detail: format!(
                "median claim and settle of {} rows, keep mode",
                args.batch_size
            ),
        });
    }
    out.row(Row {
        scenario: "history".into(),
        variant: "ratio".into(),
        value: with_history.as_secs_f64() / empty.as_secs_f64().max(1e-9),
        unit: "x",
        detail: "batch cost with history / empty".into(),
    });
    Ok(())
}

/// Drains the pending rows batch by batch (keep mode) and returns the median batch duration.
async fn claim_times(scratch: &Scratch, args: &Args) -> anyhow::Result<Duration> {
    let mark = pgoutbox::store::SettleMode::Mark;
    let relay = relay(scratch.pool.clone(), args.batch_size, mark)?;
    let mut times = Vec::new();
    loop {
        let (n, claim_time) = claim_and_settle(&relay).await?;
        times.push(claim_time);
        if n == 0 {
            break;
        }
    }
    times.sort();
    Ok(times[times.len() / 2])
}
