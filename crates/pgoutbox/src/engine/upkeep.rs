//! Upkeep, on the cleanup interval: cleanup of old rows (one relay at a time), partitions of the
//! published history kept ahead, `max_age` of held events, pairs no running relay serves, and
//! rows whose wait is over made due again.

use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::context::Context;
use crate::error::Result;
use crate::store::SettleMode;
use crate::store::{cleanup, deliveries, held, history};

/// How long past their due time pairs of an unconfigured destination must have waited, unclaimed,
/// before cleanup dead-letters them: a relay that serves the destination claims its due pairs
/// within seconds.
const GONE_AFTER: Duration = Duration::from_secs(600);

/// Runs upkeep on every `cleanup_interval` until shutdown.
pub(super) async fn cleanup_loop(ctx: &Context, shutdown: CancellationToken) {
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(ctx.config.cleanup_interval) => {}
        }
        upkeep(ctx).await;
    }
}

/// One round of upkeep; each part logs its own failure and the others go on.
async fn upkeep(ctx: &Context) {
    ensure_history(ctx).await;
    let options = cleanup::CleanupOptions::from_config(&ctx.config);
    match cleanup::run_if_leader(&ctx.store, &options).await {
        Ok(Some(r)) if r.deleted() + r.dropped_partitions > 0 => info!(
            published = r.deleted_published,
            dead = r.deleted_dead,
            partitions = r.dropped_partitions,
            batches = r.batches,
            longest_batch_ms = r.longest_batch.as_millis() as u64,
            "cleanup deleted old rows"
        ),
        Ok(_) => {}
        Err(e) => warn!(error = %crate::error_chain(&e), "cleanup failed; will try again"),
    }
    // Held events of a destination that stays unavailable still reach their max_age.
    for lane in ctx.lanes.iter() {
        let Some(max_age) = lane.retry().max_age else {
            continue;
        };
        let rows = held::expire_held(&ctx.store, lane.name(), max_age).await;
        expired(lane.name(), rows, "held events");
        let expiring = Some((lane.name(), i64::MAX));
        if let Err(e) = held::unbundle(&ctx.store, expiring, Some(max_age)).await {
            warn!(error = %crate::error_chain(&e), "expiring held batches failed; will try again");
        }
        let pairs = deliveries::expire_held(&ctx.store, lane.name(), max_age).await;
        expired(lane.name(), pairs, "held deliveries");
    }
    let configured: Vec<String> = ctx.lanes.iter().map(|l| l.name().to_owned()).collect();
    match deliveries::expire_gone(&ctx.store, &configured, GONE_AFTER).await {
        Ok(n) if n > 0 => warn!(
            pairs = n,
            "dead-lettered pairs of destinations no running relay is configured with"
        ),
        Ok(_) => {}
        Err(e) => {
            warn!(error = %crate::error_chain(&e), "expiring pairs of unconfigured destinations failed; will try again")
        }
    }
    // Rows whose wait is over (a dead row ahead was retried, discarded or cleaned up; an
    // `on_dead` that is now "skip"; a destination resumed) are due again.
    match held::unpark_followers(&ctx.store).await {
        Ok(n) if n > 0 => info!(rows = n, "rows no longer held back are due again"),
        Ok(_) => {}
        Err(e) => warn!(error = %crate::error_chain(&e), "unparking failed; will try again"),
    }
}

/// `history = "partitions"`: partitions ready ahead of the clock. At start-up and on every
/// cleanup tick, in every instance (idempotent, serialized in the database), so that a dead
/// cleanup leader does not leave the others without one. A failure is not fatal: a settle
/// with no partition for its time lands in the default partition.
pub(super) async fn ensure_history(ctx: &Context) {
    if ctx.settler.mode() != SettleMode::Move {
        return;
    }
    let ahead = history::ahead(ctx.config.retention, ctx.config.cleanup_interval);
    let ensured = history::ensure(&ctx.store, ctx.config.retention, ahead).await;
    if let Err(e) = ensured {
        warn!(error = %crate::error_chain(&e), "cannot create the history's next partitions (the relay's role must own the history, or run `pgoutbox cleanup` as its owner); settles land in its default partition until then");
    }
}

/// Logs what an expiry (OutboxExpireHeld, DeliveriesExpireHeld) of `destination`'s held `what`
/// did: those older than `max_age` were dead-lettered.
fn expired(destination: &str, done: Result<u64>, what: &str) {
    match done {
        Ok(rows) if rows > 0 => {
            warn!(destination, rows, "{what} reached max_age: dead-lettered")
        }
        Ok(_) => {}
        Err(e) => {
            warn!(error = %crate::error_chain(&e), "expiring {what} failed; will try again")
        }
    }
}
