//! `bench baseline`: the minimal design pgoutbox starts from, measured on the same machine.
//!
//! One transaction per 10 rows, `SELECT … WHERE published_at IS NULL ORDER BY created_at LIMIT 10
//! FOR UPDATE SKIP LOCKED` with no index, one UPDATE per event, a null publisher.

use std::time::{Duration, Instant};

use sqlx::Row as _;

use super::output::{rate, Output, Row};
use super::scratch::Scratch;
use super::sql;

/// Arguments of `bench baseline`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Events prefilled.
    #[arg(long, default_value_t = 200_000)]
    events: u64,
    /// How long to measure (the minimal design would take very long to drain a big backlog).
    #[arg(long, default_value = "10s", value_parser = pgoutbox::config::parse_duration)]
    seconds: Duration,
}

/// Runs `bench baseline`: one row, the minimal design's events per second.
pub async fn run(scratch: &Scratch, out: &Output, args: &Args) -> anyhow::Result<()> {
    let r = measure(scratch, out, args.events, args.seconds).await?;
    out.row(Row {
        scenario: "baseline".into(),
        variant: "minimal design, 10/tx, per-row UPDATE".into(),
        value: r,
        unit: "ev/s",
        detail: format!(
            "no index, ORDER BY created_at, {} events, {:?} sample",
            args.events, args.seconds
        ),
    });
    Ok(())
}

/// Prefills the minimal table with `events` rows and measures how many it settles per second.
pub async fn measure(
    scratch: &Scratch,
    out: &Output,
    events: u64,
    sample: Duration,
) -> anyhow::Result<f64> {
    scratch.minimal_table("baseline_outbox").await?;
    sql::load::fill_baseline(&scratch.pool, events as i64).await?;
    sql::setup::vacuum_analyze(&scratch.pool, "baseline_outbox").await?;

    let bar = out.bar(sample.as_secs(), "baseline");
    let started = Instant::now();
    let mut done = 0u64;
    while started.elapsed() < sample {
        let mut tx = scratch.pool.begin().await?;
        let rows = sql::load::claim_baseline(&mut *tx).await?;
        if rows.is_empty() {
            break;
        }
        for row in &rows {
            let id: uuid::Uuid = row.try_get("id")?;
            sql::load::settle_baseline(&mut *tx, id).await?;
        }
        tx.commit().await?;
        done += rows.len() as u64;
        bar.set_position(started.elapsed().as_secs());
    }
    let elapsed = started.elapsed();
    bar.finish_and_clear();
    Ok(rate(done, elapsed))
}
