//! Upkeep, on the cleanup interval: cleanup of old rows (one relay at a time), partitions of the
//! published history kept ahead, `max_age` of held events, pairs no running relay serves, and
//! rows whose wait is over made due again.

use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::Relay;
use crate::error::Result;
use crate::settle::SettleMode;
use crate::store::{cleanup, deliveries, history, waiting};

/// How long past their due time pairs of an unconfigured destination must have waited, unclaimed,
/// before cleanup dead-letters them: a relay that serves the destination claims its due pairs
/// within seconds.
const GONE_AFTER: Duration = Duration::from_secs(600);

impl Relay {
    /// Runs upkeep on every `cleanup_interval` until shutdown.
    pub(super) async fn cleanup_loop(&self, shutdown: CancellationToken) {
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(self.config.cleanup_interval) => {}
            }
            self.upkeep().await;
        }
    }

    /// One round of upkeep; each part logs its own failure and the others go on.
    async fn upkeep(&self) {
        self.ensure_history().await;
        let options = cleanup::CleanupOptions::from_config(&self.config);
        match cleanup::run_if_leader(&self.store, &options).await {
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
        for lane in &self.lanes {
            let Some(max_age) = lane.retry.max_age else {
                continue;
            };
            let rows = waiting::expire_held(&self.store, &lane.name, max_age).await;
            expired(&lane.name, rows, "held events");
            let expiring = Some((lane.name.as_str(), i64::MAX));
            if let Err(e) = waiting::unbundle(&self.store, expiring, Some(max_age)).await {
                warn!(error = %crate::error_chain(&e), "expiring held batches failed; will try again");
            }
            let pairs = deliveries::expire_held(&self.store, &lane.name, max_age).await;
            expired(&lane.name, pairs, "held deliveries");
        }
        let configured: Vec<String> = self.lanes.iter().map(|l| l.name.clone()).collect();
        match deliveries::expire_gone(&self.store, &configured, GONE_AFTER).await {
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
        match waiting::unpark_followers(&self.store).await {
            Ok(n) if n > 0 => info!(rows = n, "rows no longer held back are due again"),
            Ok(_) => {}
            Err(e) => warn!(error = %crate::error_chain(&e), "unparking failed; will try again"),
        }
    }

    /// `history = "partitions"`: partitions ready ahead of the clock. At start-up and on every
    /// cleanup tick, in every instance (idempotent, serialized in the database), so that a dead
    /// cleanup leader does not leave the others without one. A failure is not fatal: a settle
    /// with no partition for its time lands in the default partition.
    pub(super) async fn ensure_history(&self) {
        if self.settle_mode != SettleMode::Move {
            return;
        }
        let ahead = history::ahead(self.config.retention, self.config.cleanup_interval);
        let ensured = history::ensure(&self.store, self.config.retention, ahead).await;
        if let Err(e) = ensured {
            warn!(error = %crate::error_chain(&e), "cannot create the history's next partitions (the relay's role must own the history, or run `pgoutbox cleanup` as its owner); settles land in its default partition until then");
        }
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
