//! The destinations loop: each second, the shared state of every destination is read (pauses,
//! breakers opened or closed by other relays), breakers this relay opened are stored, a flapping
//! destination's failures are summed up in one line an interval, and open breakers are probed.
//!
//! A probe sends one held event — through a fresh connection: the sink drops what it kept first,
//! so a client that hands back its last failed reconnect cannot fail the probe of a destination
//! that is back. An answer closes the breaker and releases the held events; a failure counts no
//! attempt and schedules the next probe, later each time.

use std::time::{Duration, Instant};

use chrono::Utc;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::batch::Run;
use super::items::Items;
use super::report::record_outcomes;
use super::Relay;
use crate::error::Result;
use crate::gate::BreakerState;
use crate::model::event::OutboxEvent;
use crate::model::metric;
use crate::model::outcome::Outcome;
use crate::settle::verdict::{verdict, Attempt, Pair, Verdict};
use crate::settle::{self, SettlePlan};
use crate::sources::poll::claim_delivery_probe;
use crate::store::outbox::Guard;
use crate::store::{destinations, waiting};

/// How often each relay re-reads the shared destination state.
pub(super) const SYNC_INTERVAL: Duration = Duration::from_secs(1);

/// How often a destination whose attempts fail (without its breaker opening) is summed up in the
/// log: the log grows with trouble, not with traffic.
pub(super) const SUMMARY_INTERVAL: Duration = Duration::from_secs(30);

/// When a lane's failures were last summed up in the log, and last counted.
#[derive(Debug, Clone, Copy)]
struct SummaryClock {
    logged: Option<Instant>,
    taken: Instant,
}

impl SummaryClock {
    fn new() -> Self {
        Self {
            logged: None,
            taken: Instant::now(),
        }
    }
}

impl Relay {
    /// Registers every configured destination's row, with whether its dead events block.
    pub(super) async fn register(&self) -> Result<()> {
        let names: Vec<&str> = self.lanes.iter().map(|l| l.name.as_str()).collect();
        let blocks: Vec<bool> = self.lanes.iter().map(|l| l.config.dead_blocks()).collect();
        destinations::register(&self.store, &names, &blocks).await
    }

    /// Re-reads the shared state into each lane's gate. When a destination this relay held is
    /// free again (resumed, or closed by another relay's probe), the events held for it are made
    /// due: a batch of this relay may have held some again just before it saw the change.
    pub(super) async fn sync(&self) -> Result<()> {
        let stored = destinations::read(&self.store).await?;
        let mut freed = false;
        for lane in &self.lanes {
            if let Some(s) = stored.iter().find(|s| s.name == lane.name) {
                freed |= lane.gate.adopt(s);
            }
            let (breaker, paused) = lane.gate.state();
            metrics::gauge!(metric::DESTINATION_STATE, "destination" => lane.name.clone())
                .set(breaker.gauge());
            metrics::gauge!(metric::DESTINATION_PAUSED, "destination" => lane.name.clone())
                .set(if paused { 1.0 } else { 0.0 });
        }
        if freed {
            waiting::unpark_followers(&self.store).await?;
            for lane in &self.lanes {
                lane.handed.notify_one();
            }
        }
        Ok(())
    }

    /// Stores the breakers this relay opened, so every relay holds those destinations' events;
    /// one line each, as the state changes.
    pub(super) async fn store_tripped(&self) {
        for lane in &self.lanes {
            let Some(reason) = lane.gate.take_tripped() else {
                continue;
            };
            warn!(
                destination = %lane.name,
                failures = lane.gate.config().failures,
                error = %reason,
                "circuit breaker open: holding this destination's events, probing until it answers"
            );
            let probe_interval = lane.gate.config().probe_interval;
            if let Err(e) =
                destinations::open(&self.store, &lane.name, &reason, probe_interval).await
            {
                warn!(destination = %lane.name, error = %crate::error_chain(&e), "cannot store the breaker state");
            }
        }
    }

    /// Every [`SYNC_INTERVAL`] until shutdown: the shared state, the breakers to store, the
    /// summaries due, held batches to release, and the probes due.
    pub(super) async fn destinations_loop(&self, shutdown: CancellationToken) {
        let mut summaries = vec![SummaryClock::new(); self.lanes.len()];
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(SYNC_INTERVAL) => {}
            }
            self.store_tripped().await;
            self.log_summaries(&mut summaries);
            if let Err(e) = self.sync().await {
                warn!(error = %crate::error_chain(&e), "cannot read the destinations' state; will try again");
                continue;
            }
            // Held batches written by a batch that began before its destination came back.
            if let Err(e) = waiting::unbundle(&self.store, None, None).await {
                warn!(error = %crate::error_chain(&e), "cannot release held batches; will try again");
            }
            for d in 0..self.lanes.len() {
                let (state, paused) = self.lanes[d].gate.state();
                if paused || state == BreakerState::Closed {
                    continue;
                }
                if let Err(e) = self.probe(d).await {
                    warn!(destination = %self.lanes[d].name, error = %crate::error_chain(&e), "probe failed on a database error; will try again");
                }
            }
        }
    }

    /// One line for a destination whose attempts failed while its breaker stayed closed (an open
    /// breaker has its own lines): how many failed, of how many, and the last error — at once
    /// when failures start, then at most once per [`SUMMARY_INTERVAL`] while they go on.
    /// Each failed attempt is also in the attempt history.
    fn log_summaries(&self, clocks: &mut [SummaryClock]) {
        for (lane, clock) in self.lanes.iter().zip(clocks.iter_mut()) {
            if clock
                .logged
                .is_some_and(|at| at.elapsed() < SUMMARY_INTERVAL)
            {
                continue;
            }
            let summary = lane.gate.take_summary();
            let since = clock.taken.elapsed().as_secs().max(1);
            clock.taken = Instant::now();
            if summary.failed == 0 {
                continue;
            }
            clock.logged = Some(clock.taken);
            warn!(
                destination = %lane.name,
                failed = summary.failed,
                delivered = summary.delivered,
                last_error = summary.last_error.as_deref().unwrap_or("-"),
                "destination failing: {} of {} attempts failed in the last {since} s (each retried per its policy; `pgoutbox dead list` and the console show the events)",
                summary.failed,
                summary.failed + summary.delivered,
            );
        }
    }

    /// Sends one held event to lane `d` if its probe is due and this relay takes it: a held event
    /// row, or else a held pair from the deliveries table.
    async fn probe(&self, d: usize) -> Result<()> {
        let lane = &self.lanes[d];
        let hold_for = self.config.relay.publish_timeout * 2;
        let Some(failed_probes) =
            destinations::take_probe(&self.store, &lane.name, hold_for).await?
        else {
            return Ok(());
        };
        // A fresh connection: whatever the sink kept may be the failed one.
        lane.sink.reconnect();
        let mut tx = self.store.pool().begin().await?;
        let row = waiting::claim_probe(&self.store, &mut tx, &lane.name).await?;
        let event = match row.map(|row| (row.id, row.event)) {
            Some((_, Ok(event))) => event,
            Some((id, Err(reason))) => {
                // A poison row: dead-lettered; the next probe takes another, as scheduled.
                let mut plan = SettlePlan::default();
                plan.poison(id, &reason);
                let guard = Guard::Transaction(tx);
                settle::apply(&self.store, guard, &plan, self.settle_mode, &[], None).await?;
                return self.probe_skipped(d, failed_probes).await;
            }
            None => {
                tx.rollback().await?;
                return self.probe_pair(d, failed_probes).await;
            }
        };
        match self.probe_once(d, &event).await {
            Some(v @ (Verdict::Delivered | Verdict::Failed(_))) => {
                let mut plan = SettlePlan::default();
                plan.single(&event, Some(&lane.name), v);
                let guard = Guard::Transaction(tx);
                settle::apply(&self.store, guard, &plan, self.settle_mode, &[], None).await?;
                record_outcomes(std::slice::from_ref(&event), &plan);
                self.probe_answered(d).await
            }
            failed => {
                tx.rollback().await?;
                self.probe_failed(d, failed_probes, failed).await
            }
        }
    }

    /// The probe of lane `d` found no held event row: it takes a held pair from the deliveries
    /// table (turning one held batch into held pairs first, if that is all there is).
    async fn probe_pair(&self, d: usize, failed_probes: i32) -> Result<()> {
        let lane = &self.lanes[d];
        let lease = self.claim.lease;
        let mut claimed = claim_delivery_probe(&self.store, &lane.name, lease).await?;
        if claimed.deliveries.is_empty() && claimed.poison.is_empty() {
            waiting::unbundle(&self.store, Some((&lane.name, 1)), None).await?;
            claimed = claim_delivery_probe(&self.store, &lane.name, lease).await?;
        }
        let token = claimed.token;
        if let Some((id, name, reason)) = claimed.poison.into_iter().next() {
            let mut plan = SettlePlan::default();
            plan.poison_pair(id, &name, &reason);
            settle::apply_deliveries(&self.store, token, &plan, &[]).await?;
            return self.probe_skipped(d, failed_probes).await;
        }
        let Some(delivery) = claimed.deliveries.into_iter().next() else {
            // Nothing held yet: the next events routed to the destination will be.
            return self.probe_skipped(d, failed_probes).await;
        };
        let event = delivery.event;
        let mut plan = SettlePlan::default();
        match self.probe_once(d, &event).await {
            Some(v @ (Verdict::Delivered | Verdict::Failed(_))) => {
                plan.single(&event, Some(&lane.name), v);
                settle::apply_deliveries(&self.store, token, &plan, &[]).await?;
                record_outcomes(std::slice::from_ref(&event), &plan);
                self.probe_answered(d).await
            }
            failed => {
                // Back to held, no attempt counted.
                plan.single(&event, Some(&lane.name), Verdict::Held(None));
                settle::apply_deliveries(&self.store, token, &plan, &[]).await?;
                self.probe_failed(d, failed_probes, failed).await
            }
        }
    }

    /// Publishes `event` to lane `d` as a probe (whatever its breaker says) within one
    /// `publish_timeout`. `Some(Delivered | Failed)`: the destination answered (a delivery, or a
    /// permanent rejection); `Some(Held(reason))`: a failure, not counted; `None`: no answer.
    async fn probe_once(&self, d: usize, event: &OutboxEvent) -> Option<Verdict> {
        let lane = &self.lanes[d];
        let events = std::slice::from_ref(event);
        let items = Items::route(vec![vec![d]], |_| true);
        let deadline = tokio::time::Instant::now() + self.config.relay.publish_timeout;
        let run = Run::probe(events, &items, self.lanes.len(), deadline);
        tokio::select! {
            _ = tokio::time::timeout_at(deadline, self.publish_share(&run, d, &[0])) => {}
            _ = self.abort.cancelled() => {}
        }
        let answer = run.slots[0].answer().cloned()?;
        match answer.0 {
            Outcome::Retry { reason, .. } => Some(Verdict::Held(Some(reason))),
            outcome => {
                let pair = Pair {
                    event,
                    destination: Some((lane.name.as_str(), &lane.retry)),
                };
                let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::from_entropy();
                Some(verdict(
                    pair,
                    Attempt::Answered(&outcome, answer.1),
                    Utc::now(),
                    &mut rng,
                ))
            }
        }
    }

    /// A probe found nothing to send (or a poison row): the next probe comes as scheduled.
    async fn probe_skipped(&self, d: usize, failed_probes: i32) -> Result<()> {
        let lane = &self.lanes[d];
        let delay = lane.gate.probe_delay(failed_probes);
        destinations::probe_failed(&self.store, &lane.name, None, delay).await
    }

    /// The destination answered its probe: the breaker closes and its held events are due again.
    async fn probe_answered(&self, d: usize) -> Result<()> {
        let lane = &self.lanes[d];
        lane.gate.close();
        destinations::close(&self.store, &lane.name).await?;
        let released = waiting::unpark_followers(&self.store).await?;
        lane.handed.notify_one();
        info!(destination = %lane.name, released, "probe answered: circuit breaker closed, held events are due again");
        Ok(())
    }

    /// The probe failed (`Some(Held(reason))`) or got no answer (`None`): the breaker stays open,
    /// the next probe later.
    async fn probe_failed(
        &self,
        d: usize,
        failed_probes: i32,
        failed: Option<Verdict>,
    ) -> Result<()> {
        let lane = &self.lanes[d];
        let reason = match failed {
            Some(Verdict::Held(Some(reason))) => reason,
            _ => "no answer within publish_timeout".to_owned(),
        };
        let delay = lane.gate.probe_delay(failed_probes + 1);
        info!(destination = %lane.name, error = %reason, next_probe_in_ms = delay.as_millis() as u64, "probe failed: circuit breaker stays open");
        destinations::probe_failed(&self.store, &lane.name, Some(&reason), delay).await
    }
}
