//! Upkeep: cleanup, `max_age` of held events, rows no longer held back, history partitions.

use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::Relay;
use crate::error::Result;
use crate::store::{cleanup, deliveries, waiting};

impl Relay {
    pub(super) async fn cleanup_loop(&self, shutdown: CancellationToken) {
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(self.config.cleanup_interval) => {}
            }
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
            for dest in &self.destinations {
                let Some(max_age) = dest.retry.max_age else {
                    continue;
                };
                let rows = waiting::expire_held(&self.store, &dest.name, max_age).await;
                expired(&dest.name, rows, "held events");
                let expiring = Some((dest.name.as_str(), i64::MAX));
                if let Err(e) = waiting::unbundle(&self.store, expiring, Some(max_age)).await {
                    warn!(error = %crate::error_chain(&e), "expiring held batches failed; will try again");
                }
                let pairs = deliveries::expire_held(&self.store, &dest.name, max_age).await;
                expired(&dest.name, pairs, "held deliveries");
            }
            // Rows whose wait is over (a dead row ahead was retried, discarded or cleaned up; an
            // `on_dead` that is now "skip"; a destination resumed) are due again.
            match waiting::unpark_followers(&self.store).await {
                Ok(n) if n > 0 => {
                    info!(rows = n, "rows no longer held back are due again")
                }
                Ok(_) => {}
                Err(e) => {
                    warn!(error = %crate::error_chain(&e), "unparking failed; will try again")
                }
            }
        }
    }
}

/// Logs what an expiry (OutboxExpireHeld, DeliveriesExpireHeld) of `destination`'s held `what`
/// did: those older than `max_age` were dead-lettered.
pub(super) fn expired(destination: &str, done: Result<u64>, what: &str) {
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
