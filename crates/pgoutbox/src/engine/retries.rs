//! Each lane's retry loop: its own due pairs of the deliveries table — failed attempts whose
//! backoff is over, pairs its batches handed over, held pairs of a destination that is back —
//! claimed, published through the lane's gate, judged and settled like any batch, at the lane's
//! own pace.
//!
//! One loop per destination, so a destination with a long backlog (a slow one, one that was down
//! for an hour) never stands in front of another's retries. A batch that hands pairs over wakes
//! the loop at once; otherwise it polls, backing off while it finds nothing.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::warn;

use super::context::Context;
use super::pacing::{db_reachable, retry_claim, Pacing};
use super::publish::publish_whole;
use super::watch::Stop;
use crate::error::Result;
use crate::model::metric;
use crate::model::report::BatchReport;
use crate::route::Items;
use crate::settle::Pairs;
use crate::sources::poll::claim_pairs;

/// A retry loop's longest idle wait (or `poll_interval` if longer). Its rows are retries and
/// held pairs, due after a backoff of seconds, and pairs handed over wake it directly, so it need
/// not poll as often as the claim loops that carry fresh events.
const RETRIES_POLL_INTERVAL: Duration = Duration::from_millis(250);

/// Claims, publishes and settles one batch of lane `d`'s due pairs. Each pair is its
/// destination's alone: it is published, retried, held and dead-lettered like an event with that
/// one destination.
pub(super) async fn lane_batch(ctx: &Arc<Context>, d: usize) -> Result<BatchReport> {
    let lane = &ctx.lanes[d];
    let settings = &ctx.config.relay;
    let limit = retry_claim(
        settings.batch_size,
        lane.gate.concurrency(),
        lane.gate.in_flight(),
    );
    let claimed = claim_pairs(&ctx.store, &lane.config, limit, ctx.claim.lease).await?;
    if claimed.events.is_empty() && claimed.poison.is_empty() {
        return Ok(BatchReport::default());
    }
    let events = claimed.events;
    let open = lane.gate.is_open();
    let items = Items::pairs(events.iter().map(|_| d), |_| open);
    let published = publish_whole(ctx, events, items).await;
    let aborted = published.stop == Stop::Aborted;
    let pairs = Pairs {
        events: &published.run.events,
        poison: &claimed.poison,
        token: claimed.token,
    };
    let settled = ctx
        .settler
        .pairs(&pairs, published.attempts, &ctx.lanes, aborted);
    let report = settled.await?;
    ctx.progressed();
    Ok(report)
}

/// Claims, publishes and settles one batch of due pairs of every lane, one lane after the other
/// (`relay --once`, tests).
pub(super) async fn every_lane_once(ctx: &Arc<Context>) -> Result<BatchReport> {
    let mut total = BatchReport::default();
    for d in 0..ctx.lanes.len() {
        total += lane_batch(ctx, d).await?;
    }
    Ok(total)
}

/// Lane `d`'s retry loop, until shutdown: at once again while it finds pairs, backing off to
/// [`RETRIES_POLL_INTERVAL`] (or `poll_interval`) while it finds none or the database fails;
/// woken at once when a batch hands pairs over to the lane.
pub(super) async fn retries_loop(
    ctx: &Arc<Context>,
    d: usize,
    shutdown: CancellationToken,
) -> BatchReport {
    let mut total = BatchReport::default();
    let settings = &ctx.config.relay;
    let mut pacing = Pacing::between(
        settings.min_poll_interval,
        settings.poll_interval.max(RETRIES_POLL_INTERVAL),
    );
    let mut db_down = false;
    let lane = &ctx.lanes[d];
    let what = format!("retries of {}", lane.name);
    while !shutdown.is_cancelled() {
        let pause = match lane_batch(ctx, d).await {
            Ok(report) if report.claimed > 0 => {
                db_reachable(&what, &mut db_down);
                total += report;
                pacing.busy();
                continue;
            }
            Ok(_) => {
                db_reachable(&what, &mut db_down);
                pacing.idle()
            }
            Err(e) => {
                db_down = true;
                metrics::counter!(metric::DB_ERRORS_TOTAL).increment(1);
                let pause = pacing.failed();
                warn!(destination = %lane.name, error = %crate::error_chain(&e), retry_in_ms = pause.as_millis() as u64, "claim or settle of retries failed; retrying");
                pause
            }
        };
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = lane.handed.notified() => pacing.busy(),
            _ = tokio::time::sleep(pause) => {}
        }
    }
    total
}
