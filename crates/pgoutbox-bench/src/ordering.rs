//! `bench ordering`: what per-key ordering costs. The same keyed backlog is drained by several
//! relays, once with `ordering = "none"` and once with `ordering = "key"`.

use std::time::Instant;

use pgoutbox::config::Config;
use tokio_util::sync::CancellationToken;

use super::output::{rate, Output, Row};
use super::process::in_process_relays;
use super::scratch::Scratch;
use super::sql;

/// Arguments of `bench ordering`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Events prefilled.
    #[arg(long, default_value_t = 200_000)]
    events: u64,
    /// Distinct keys, spread round-robin.
    #[arg(long, default_value_t = 1000)]
    keys: u64,
    /// Relay instances (each with its own pool and workers).
    #[arg(long, default_value_t = 4)]
    relays: usize,
    /// Rows per claim.
    #[arg(long, default_value_t = 500)]
    batch_size: usize,
}

impl Args {
    /// Small sizes for `bench quick`.
    pub fn quick() -> Self {
        Self {
            events: 20_000,
            keys: 1000,
            relays: 4,
            batch_size: 500,
        }
    }
}

/// Runs `bench ordering`: the keyed backlog drained unordered, then ordered by key.
pub async fn run(scratch: &Scratch, out: &Output, args: &Args) -> anyhow::Result<()> {
    let unordered = drain(scratch, out, args, "none").await?;
    let ordered = drain(scratch, out, args, "key").await?;
    for (variant, value) in [("none", unordered), ("key", ordered)] {
        out.row(Row {
            scenario: "ordering".into(),
            variant: format!(
                "ordering = {variant}, {} relays, {} keys",
                args.relays, args.keys
            ),
            value,
            unit: "ev/s",
            detail: format!(
                "null sink, delete mode, {} events; {:.0} % of unordered",
                args.events,
                value / unordered * 100.0
            ),
        });
    }
    Ok(())
}

async fn drain(
    scratch: &Scratch,
    out: &Output,
    args: &Args,
    ordering: &str,
) -> anyhow::Result<f64> {
    scratch.fresh_outbox().await?;
    let bar = out.bar(args.events, "prefill");
    sql::load::fill_keyed(&scratch.pool, args.events as i64, args.keys as i64).await?;
    bar.finish_and_clear();
    sql::setup::vacuum_analyze(&scratch.pool, "outbox").await?;
    let text = format!(
        "retention = \"0s\"\n[relay]\nbatch_size = {}\n[[destinations]]\nname = \"null\"\ntype = \"null\"\nordering = \"{ordering}\"\n",
        args.batch_size
    );
    let config = Config::parse(&text, |_| None)?;
    let stop = CancellationToken::new();
    let started = Instant::now();
    let tasks = in_process_relays(scratch, &config, args.relays, &stop).await?;
    let bar = out.bar(args.events, &format!("ordering={ordering}"));
    scratch.wait_drained(&bar, args.events).await?;
    let elapsed = started.elapsed();
    stop.cancel();
    for t in tasks {
        t.await??;
    }
    bar.finish_and_clear();
    Ok(rate(args.events, elapsed))
}
