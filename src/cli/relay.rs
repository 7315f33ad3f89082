//! `pgoutbox relay`: the long-running relay, or one pass with `--once`.

use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{bail, Context};
use pgoutbox::relay::Relay;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::Cli;

/// Exit status of `relay --once` when some events were not delivered.
pub const EXIT_SOME_FAILED: u8 = 3;

/// Arguments of `relay`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Process everything due now, print a summary and exit: 0 when all were delivered,
    /// 3 when some failed (they stay scheduled for retry or dead-lettered), 1 on error.
    #[arg(long)]
    once: bool,
}

pub async fn run(cli: &Cli, args: &Args) -> anyhow::Result<ExitCode> {
    let config = cli.load_config()?;
    if config.destinations.is_empty() {
        bail!("no destinations configured: add a [[destinations]] table to the config file (see README)");
    }
    let workers = config.relay.workers as u32;
    let pool = super::connect_checked(&config, workers + 2).await?;
    super::check_relay_privileges(&pool, &config).await?;
    // Every settle leaves a dead row version and dead index entries behind; only vacuum removes
    // them, and without it claims slow down as they pile up.
    if let Ok(off) = sqlx::query_scalar::<_, String>("SHOW autovacuum")
        .fetch_one(&pool)
        .await
    {
        if off == "off" {
            tracing::warn!(
                "autovacuum is off on this server: the outbox's dead rows and index entries will pile up and claims will slow down; turn autovacuum on or VACUUM the outbox regularly"
            );
        }
    }
    // The recorder goes first: metrics registered while the relay is built must reach it.
    let metrics = match config.observability.listen {
        Some(_) => Some(pgoutbox::observe::install_recorder().map_err(anyhow::Error::msg)?),
        None => None,
    };
    let relay = Arc::new(Relay::new(pool, &config).context("cannot set up the destinations")?);

    if args.once {
        let report = relay.run_once().await?;
        eprintln!(
            "relay --once: claimed {}, delivered {}, scheduled for retry {}, dead-lettered {}, held for an unavailable destination {}",
            report.claimed, report.delivered, report.retried, report.dead, report.held
        );
        return Ok(if report.retried + report.dead + report.held == 0 {
            ExitCode::SUCCESS
        } else {
            ExitCode::from(EXIT_SOME_FAILED)
        });
    }

    info!(
        table = %config.table,
        destinations = config.destinations.len(),
        workers,
        claim = ?config.relay.claim,
        "relay started"
    );
    let shutdown = CancellationToken::new();
    tokio::spawn(watch_signals(shutdown.clone()));
    if let (Some(addr), Some(handle)) = (config.observability.listen, metrics) {
        let names = config.destinations.iter().map(|d| d.name.clone()).collect();
        tokio::spawn(pgoutbox::observe::refresh_gauges(
            relay.pool().clone(),
            config.table.clone(),
            pgoutbox::route::Router::new(&config.destinations),
            names,
            config.observability.gauge_interval,
            shutdown.clone(),
        ));
        // Bind before relaying, so a taken port is an error at start rather than a silent loss.
        let listener_check = std::net::TcpListener::bind(addr)
            .with_context(|| format!("cannot listen on {addr} for metrics and health"))?;
        drop(listener_check);
        let (relay, stop) = (Arc::clone(&relay), shutdown.clone());
        tokio::spawn(async move {
            if let Err(e) = pgoutbox::observe::serve(addr, handle, relay, stop).await {
                warn!(error = %e, "metrics and health endpoint stopped");
            }
        });
        info!(%addr, "serving /metrics, /healthz and /readyz");
    }
    let total = relay.run(shutdown).await?;
    info!(
        delivered = total.delivered,
        retried = total.retried,
        dead = total.dead,
        "relay stopped"
    );
    Ok(ExitCode::SUCCESS)
}

/// First SIGINT/SIGTERM: stop claiming and let in-flight batches settle. Second: exit at once
/// (still safe: unsettled events are claimed again, at least once).
async fn watch_signals(shutdown: CancellationToken) {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        warn!("cannot install signal handlers");
        return;
    };
    tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
    info!("shutting down: no new claims, finishing in-flight batches (signal again to exit now)");
    shutdown.cancel();
    tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
    warn!("second signal: exiting now; unsettled events will be delivered again");
    std::process::exit(130);
}
