//! `bench baseline`: the minimal design pgoutbox starts from, measured on the same machine.
//!
//! One transaction per 10 rows, `SELECT … WHERE published_at IS NULL ORDER BY created_at LIMIT 10
//! FOR UPDATE SKIP LOCKED` with no index, one UPDATE per event, a null publisher.

use std::time::{Duration, Instant};

use sqlx::Row as _;

use super::output::{rate, Output, Row};
use super::scratch::Scratch;

/// Arguments of `bench baseline`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Events prefilled.
    #[arg(long, default_value_t = 200_000)]
    events: u64,
    /// How long to measure (the minimal design would take very long to drain a big backlog).
    #[arg(long, default_value = "10s", value_parser = crate::flags::parse_duration)]
    seconds: Duration,
}

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
    sqlx::query(
        "INSERT INTO baseline_outbox (topic, payload, created_at)
         SELECT 'bench.event', jsonb_build_object('n', g), now() + g * interval '1 microsecond'
         FROM generate_series(1, $1) g",
    )
    .bind(events as i64)
    .execute(&scratch.pool)
    .await?;
    sqlx::query("VACUUM ANALYZE baseline_outbox")
        .execute(&scratch.pool)
        .await?;

    let bar = out.bar(sample.as_secs(), "baseline");
    let started = Instant::now();
    let mut done = 0u64;
    while started.elapsed() < sample {
        let mut tx = scratch.pool.begin().await?;
        let rows = sqlx::query(
            "SELECT id, topic, payload FROM baseline_outbox WHERE published_at IS NULL
             ORDER BY created_at LIMIT 10 FOR UPDATE SKIP LOCKED",
        )
        .fetch_all(&mut *tx)
        .await?;
        if rows.is_empty() {
            break;
        }
        for row in &rows {
            let id: uuid::Uuid = row.try_get("id")?;
            sqlx::query("UPDATE baseline_outbox SET published_at = now() WHERE id = $1")
                .bind(id)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        done += rows.len() as u64;
        bar.set_position(started.elapsed().as_secs());
    }
    let elapsed = started.elapsed();
    bar.finish_and_clear();
    Ok(rate(done, elapsed))
}
