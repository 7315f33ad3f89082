//! Destination state and breaker probes: each second, the shared state is read and open
//! breakers are probed.

use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::batch::Route;
use super::report::record_outcomes;
use super::Relay;
use crate::breaker::{self, BreakerState};
use crate::error::Result;
use crate::model::outcome::Outcome;
use crate::settle;
use crate::sources::poll::Hold;
use crate::store::{destinations, waiting};

impl Relay {
    /// Every [`breaker::SYNC_INTERVAL`]: re-reads the shared destination state (pauses,
    /// breakers opened or closed by other relays), then probes each open destination whose probe is
    /// due, if this relay wins it.
    pub(super) async fn destinations_loop(&self, shutdown: CancellationToken) {
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(breaker::SYNC_INTERVAL) => {}
            }
            if let Err(e) = breaker::sync(&self.store, &self.health).await {
                warn!(error = %crate::error_chain(&e), "cannot read the destinations' state; will try again");
                continue;
            }
            // Held batches written by a batch that began before its destination came back.
            if let Err(e) = waiting::unbundle(&self.store, None, None).await {
                warn!(error = %crate::error_chain(&e), "cannot release held batches; will try again");
            }
            for d in 0..self.destinations.len() {
                let (state, paused) = self.health[d].state();
                if paused || state == BreakerState::Closed {
                    continue;
                }
                if let Err(e) = self.probe(d).await {
                    warn!(destination = %self.destinations[d].name, error = %crate::error_chain(&e), "probe failed on a database error; will try again");
                }
            }
        }
    }

    /// Sends one held event to destination `d` if its probe is due and this relay takes it: a held
    /// event row, or else a held pair from the deliveries table. An answer (delivered, or a
    /// permanent rejection) closes the breaker and releases the held events; a failure counts no
    /// attempt and schedules the next probe, later each time.
    pub(super) async fn probe(&self, d: usize) -> Result<()> {
        let dest = &self.destinations[d];
        let hold_for = self.settings.publish_timeout * 2;
        let Some(failed_probes) =
            destinations::take_probe(&self.store, &dest.name, hold_for).await?
        else {
            return Ok(());
        };
        let mut tx = self.store.pool().begin().await?;
        let row = waiting::claim_probe(&self.store, &mut tx, &dest.name).await?;
        let event = match row.map(|row| (row.id, row.event)) {
            Some((_, Ok(event))) => event,
            Some((id, Err(reason))) => {
                // A poison row: dead-lettered; the next probe takes another, as scheduled.
                let mut plan = settle::SettlePlan::default();
                plan.poison(id, &reason);
                let hold = Hold::Transaction(tx);
                settle::apply(&self.store, hold, &plan, self.settle_mode, &[], None).await?;
                return self.probe_skipped(d, failed_probes).await;
            }
            None => {
                tx.rollback().await?;
                return self.probe_delivery(d, failed_probes).await;
            }
        };
        let (outcome, _) = self
            .publish_each(std::slice::from_ref(&event), vec![Route::Send(d)])
            .await;
        match outcome.into_iter().next().flatten() {
            Some(outcome @ (Outcome::Delivered | Outcome::Rejected { .. })) => {
                let plan = settle::plan(
                    [(&event, Some((dest.name.as_str(), &dest.retry)), &outcome)],
                    chrono::Utc::now(),
                    &mut rand::thread_rng(),
                );
                settle::apply(
                    &self.store,
                    Hold::Transaction(tx),
                    &plan,
                    self.settle_mode,
                    &[],
                    None,
                )
                .await?;
                record_outcomes(std::slice::from_ref(&event), &plan);
                self.probe_answered(d).await
            }
            failed => {
                tx.rollback().await?;
                self.probe_failed(d, failed_probes, failed).await
            }
        }
    }

    /// The probe of `d` found no held event row: it takes a held pair from the deliveries table.
    pub(super) async fn probe_delivery(&self, d: usize, failed_probes: i32) -> Result<()> {
        let dest = &self.destinations[d];
        let claimed =
            crate::sources::poll::claim_delivery_probe(&self.store, &dest.name, self.claim.lease)
                .await?;
        // Its held pairs may all be in held batches: one becomes held rows to take the probe from.
        let claimed = if claimed.deliveries.is_empty() && claimed.poison.is_empty() {
            waiting::unbundle(&self.store, Some((&dest.name, 1)), None).await?;
            crate::sources::poll::claim_delivery_probe(&self.store, &dest.name, self.claim.lease)
                .await?
        } else {
            claimed
        };
        let token = claimed.token;
        if let Some((id, name, reason)) = claimed.poison.into_iter().next() {
            let mut plan = settle::SettlePlan::default();
            plan.poison_pair(id, &name, &reason);
            settle::apply_deliveries(&self.store, token, &plan, &[]).await?;
            return self.probe_skipped(d, failed_probes).await;
        }
        let Some(delivery) = claimed.deliveries.into_iter().next() else {
            // Nothing held yet: the next events routed to the destination will be.
            return self.probe_skipped(d, failed_probes).await;
        };
        let event = delivery.event;
        let (outcome, _) = self
            .publish_each(std::slice::from_ref(&event), vec![Route::Send(d)])
            .await;
        let mut plan = settle::SettlePlan::default();
        match outcome.into_iter().next().flatten() {
            Some(outcome @ (Outcome::Delivered | Outcome::Rejected { .. })) => {
                let now = chrono::Utc::now();
                // Send, unlike ThreadRng: the batch future crosses threads.
                let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::from_entropy();
                match settle::decide(&event, &dest.name, &dest.retry, &outcome, now, &mut rng) {
                    None => {
                        plan.delivered.insert(dest.name.clone(), vec![event.id]);
                    }
                    Some(failed) => plan.failed.push(failed),
                }
                settle::apply_deliveries(&self.store, token, &plan, &[]).await?;
                record_outcomes(std::slice::from_ref(&event), &plan);
                self.probe_answered(d).await
            }
            failed => {
                // Back to held, no attempt counted.
                plan.hold(event.id, &dest.name, None);
                settle::apply_deliveries(&self.store, token, &plan, &[]).await?;
                self.probe_failed(d, failed_probes, failed).await
            }
        }
    }

    /// A probe found nothing to send (or a poison row): the next probe comes as scheduled.
    pub(super) async fn probe_skipped(&self, d: usize, failed_probes: i32) -> Result<()> {
        let delay = self.health[d].probe_delay(failed_probes);
        let name = &self.destinations[d].name;
        destinations::probe_failed(&self.store, name, None, delay).await
    }

    /// The destination answered its probe: the breaker closes and its held events are due again.
    pub(super) async fn probe_answered(&self, d: usize) -> Result<()> {
        let name = &self.destinations[d].name;
        self.health[d].close();
        let released = breaker::store_closed(&self.store, name).await?;
        info!(destination = %name, released, "probe answered: circuit breaker closed, held events are due again");
        Ok(())
    }

    /// The probe failed: the breaker stays open, the next probe later.
    pub(super) async fn probe_failed(
        &self,
        d: usize,
        failed_probes: i32,
        failed: Option<Outcome>,
    ) -> Result<()> {
        let name = &self.destinations[d].name;
        let reason = match failed {
            Some(Outcome::Retry { reason, .. }) => reason,
            _ => "no answer within publish_timeout".to_owned(),
        };
        let delay = self.health[d].probe_delay(failed_probes + 1);
        info!(destination = %name, error = %reason, next_probe_in_ms = delay.as_millis() as u64, "probe failed: circuit breaker stays open");
        destinations::probe_failed(&self.store, name, Some(&reason), delay).await
    }
}
