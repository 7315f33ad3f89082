//! Running the relay: its loops until shutdown, or one pass (`relay --once`).
//!
//! The loops, each its own service over the shared [`Context`]: the source (claim workers, or
//! the WAL reader), the retry scheduler (every lane's due pairs), the destinations loop (shared
//! state and probes), upkeep, and the replays loop.

use std::collections::HashSet;
use std::sync::Arc;

use tokio_util::sync::CancellationToken;
use tracing::{error, warn};
use uuid::Uuid;

use super::claimer::{Claimers, Signals};
use super::context::Context;
use super::publish::panic_message;
use super::{destinations, replays, retries, upkeep};
use crate::config::Source;
use crate::error::{Error, Result};
use crate::model::report::BatchReport;
use crate::store::held;

/// Runs until `shutdown` is cancelled (see [`super::Relay::run`]).
pub(super) async fn run(
    ctx: Arc<Context>,
    claimers: Arc<Claimers>,
    shutdown: CancellationToken,
) -> Result<BatchReport> {
    prepare(&ctx).await;
    let grace_timer = {
        let (shutdown, stopping, abort, grace) = (
            shutdown.clone(),
            ctx.stopping.clone(),
            ctx.abort.clone(),
            ctx.config.relay.shutdown_grace,
        );
        tokio::spawn(async move {
            shutdown.cancelled().await;
            stopping.cancel();
            tokio::time::sleep(grace).await;
            abort.cancel();
        })
    };
    let mut workers = tokio::task::JoinSet::new();
    match ctx.config.source {
        Source::Poll => {
            let (watermark, stop) = (Arc::clone(&claimers), shutdown.clone());
            workers.spawn(async move {
                watermark.watermark_loop(stop).await;
                BatchReport::default()
            });
            for worker in 0..ctx.config.relay.workers {
                let (claimers, stop) = (Arc::clone(&claimers), shutdown.clone());
                workers.spawn(async move { claimers.worker(worker, stop).await });
            }
        }
        // One reader per slot: the WAL source replaces the claim workers.
        Source::Wal => {
            let (ctx, stop) = (Arc::clone(&ctx), shutdown.clone());
            workers.spawn(async move { crate::sources::wal::run(ctx, stop).await });
        }
    }
    {
        let (ctx, stop) = (Arc::clone(&ctx), shutdown.clone());
        workers.spawn(async move { retries::retries_loop(&ctx, stop).await });
    }
    let maintenance = {
        let (ctx, stop) = (Arc::clone(&ctx), shutdown.clone());
        tokio::spawn(async move {
            tokio::join!(
                upkeep::cleanup_loop(&ctx, stop.clone()),
                replays::replays_loop(&ctx, stop.clone()),
                destinations::destinations_loop(&ctx, stop)
            )
        })
    };
    let mut total = BatchReport::default();
    let mut panicked = None;
    while let Some(joined) = workers.join_next().await {
        match joined {
            Ok(report) => total += report,
            Err(e) => {
                let why = match e.try_into_panic() {
                    Ok(panic) => format!("a claim worker panicked: {}", panic_message(&*panic)),
                    Err(e) => format!("a claim worker was cancelled: {e}"),
                };
                error!(error = %why, "stopping the relay");
                ctx.fail(&why);
                shutdown.cancel();
                panicked.get_or_insert(why);
            }
        }
    }
    maintenance.abort();
    grace_timer.abort();
    match panicked {
        Some(why) => Err(Error::WorkerPanicked(why)),
        None => Ok(total),
    }
}

/// Before the first claim: creates the backfills of new destinations, registers the
/// destinations and reads their shared state (an operator's pause, an open breaker), and
/// releases rows whose wait is over.
pub(super) async fn prepare(ctx: &Context) {
    let steps = async {
        replays::create_backfills(ctx).await?;
        destinations::register(ctx).await?;
        destinations::sync(ctx).await?;
        held::unpark_followers(&ctx.store).await
    };
    if let Err(e) = steps.await {
        warn!(error = %crate::error_chain(&e), "cannot read the destinations' state yet; will try again");
    }
    upkeep::ensure_history(ctx).await;
}

/// Processes everything due now, then returns (see [`super::Relay::run_once`]).
pub(super) async fn run_once(ctx: &Arc<Context>, claimers: &Claimers) -> Result<BatchReport> {
    destinations::register(ctx).await?;
    destinations::sync(ctx).await?;
    held::unpark_followers(&ctx.store).await?;
    upkeep::ensure_history(ctx).await;
    let mut total = BatchReport::default();
    let mut failed_before: HashSet<Uuid> = HashSet::new();
    let mut unbounded_tried = false;
    loop {
        let settled = claimers.batch(Signals::none()).await?;
        let (report, retried) = (settled.report, settled.retried);
        total += report;
        let only_repeats = report.delivered == 0
            && report.dead == 0
            && !retried.is_empty()
            && retried.iter().all(|id| failed_before.contains(id));
        if report.claimed == 0 && ctx.claim.ordered && !unbounded_tried {
            // Ordered: an empty claim only saw the window; make sure nothing further on is due.
            unbounded_tried = true;
            claimers.unbounded();
            continue;
        }
        if report.claimed == 0 || only_repeats {
            break;
        }
        unbounded_tried = false;
        failed_before.extend(retried);
    }
    // Then every lane's due pairs, until none is due or a round only failed again.
    loop {
        let report = retries::every_lane_once(ctx).await?;
        total += report;
        if report.claimed == 0 || report.delivered + report.dead == 0 {
            return Ok(total);
        }
    }
}
