//! Each lane's retry loop: its own due pairs of the deliveries table — failed attempts whose
//! backoff is over, pairs its batches handed over, held pairs of a destination that is back —
//! claimed, published through the lane's gate and settled, at the lane's own pace.
//!
//! One loop per destination, so a destination with a long backlog (a slow one, one that was down
//! for an hour) never stands in front of another's retries. A batch that hands pairs over wakes
//! the loop at once; otherwise it polls, backing off while it finds nothing.

use std::time::Duration;

use chrono::Utc;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use super::items::Items;
use super::pacing::{db_reachable, retry_claim, Pacing};
use super::report::{log_failed, record_outcomes, BatchReport};
use super::Relay;
use crate::error::Result;
use crate::model::event::OutboxEvent;
use crate::model::metric;
use crate::settle::verdict::{verdict, Attempt, Pair};
use crate::settle::{self, SettlePlan};
use crate::sources::poll::claim_deliveries;

/// A retry loop's longest idle wait (or `poll_interval` if longer). Its rows are retries and
/// held pairs, due after a backoff of seconds, and pairs handed over wake it directly, so it need
/// not poll as often as the claim loops that carry fresh events.
const RETRIES_POLL_INTERVAL: Duration = Duration::from_millis(250);

impl Relay {
    /// Claims, publishes and settles one batch of due pairs of every lane, one lane after the
    /// other (`relay --once`, tests).
    pub async fn run_deliveries_batch(&self) -> Result<BatchReport> {
        let mut total = BatchReport::default();
        for d in 0..self.lanes.len() {
            total += self.lane_batch(d).await?;
        }
        Ok(total)
    }

    /// Claims, publishes and settles one batch of lane `d`'s due pairs. Each pair is its
    /// destination's alone: it is published, retried, held and dead-lettered like an event with
    /// that one destination.
    pub(super) async fn lane_batch(&self, d: usize) -> Result<BatchReport> {
        let lane = &self.lanes[d];
        let settings = &self.config.relay;
        let limit = retry_claim(
            settings.batch_size,
            lane.gate.concurrency(),
            lane.gate.in_flight(),
        );
        let claimed = claim_deliveries(&self.store, &lane.config, limit, self.claim.lease).await?;
        let token = claimed.token;
        let mut plan = SettlePlan::default();
        for (id, name, reason) in &claimed.poison {
            warn!(event_id = %id, destination = %name, error = %reason, "dead-lettering a delivery that cannot be read as an event");
            plan.poison_pair(*id, name, reason);
        }
        if claimed.deliveries.is_empty() && plan.failed.is_empty() {
            return Ok(BatchReport::default());
        }
        let events: Vec<OutboxEvent> = claimed.deliveries.into_iter().map(|c| c.event).collect();
        let targets = events.iter().map(|_| vec![d]).collect();
        let items = Items::route(targets, |lane| self.lanes[lane].gate.is_open());
        let (answers, aborted) = self.publish_whole(&events, &items).await;
        let now = Utc::now();
        // Send, unlike ThreadRng: the batch future crosses threads.
        let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::from_entropy();
        let mut untouched: Vec<(uuid::Uuid, String)> = Vec::new();
        for (i, event) in events.iter().enumerate() {
            let attempt = match (&items.list[i].dispatch, &answers[i]) {
                (super::items::Dispatch::Hold, _) => Attempt::Held,
                (_, Some((outcome, counted))) => Attempt::Answered(outcome, *counted),
                (_, None) => Attempt::NotSent,
            };
            let pair = Pair {
                event,
                destination: Some((lane.name.as_str(), &lane.retry)),
            };
            let v = verdict(pair, attempt, now, &mut rng);
            log_failed(event, Some(&lane.name), &v);
            if !plan.single(event, Some(&lane.name), v) {
                untouched.push((event.id, lane.name.clone()));
            }
        }
        let settled = settle::apply_deliveries(&self.store, token, &plan, &untouched).await?;
        self.progressed();
        record_outcomes(&events, &plan);
        self.store_tripped().await;
        if settled.fenced > 0 {
            warn!(
                destination = %lane.name,
                fenced = settled.fenced,
                "delivery lease lost before settle: another relay re-claimed these pairs"
            );
        }
        if aborted && !untouched.is_empty() {
            warn!(
                released = untouched.len(),
                "shutdown grace period over: released unfinished deliveries"
            );
        }
        Ok(BatchReport {
            claimed: events.len() + claimed.poison.len(),
            delivered: plan.delivered_count(),
            retried: plan.retry_count(),
            dead: plan.dead_count(),
            held: plan.held.len(),
            fenced: settled.fenced,
            released: untouched.len(),
        })
    }

    /// Lane `d`'s retry loop, until shutdown: at once again while it finds pairs, backing off to
    /// [`RETRIES_POLL_INTERVAL`] (or `poll_interval`) while it finds none or the database fails;
    /// woken at once when a batch hands pairs over to the lane.
    pub(super) async fn retries_loop(&self, d: usize, shutdown: CancellationToken) -> BatchReport {
        let mut total = BatchReport::default();
        let settings = &self.config.relay;
        let mut pacing = Pacing::between(
            settings.min_poll_interval,
            settings.poll_interval.max(RETRIES_POLL_INTERVAL),
        );
        let mut db_down = false;
        let what = format!("retries of {}", self.lanes[d].name);
        while !shutdown.is_cancelled() {
            let pause = match self.lane_batch(d).await {
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
                    warn!(destination = %self.lanes[d].name, error = %crate::error_chain(&e), retry_in_ms = pause.as_millis() as u64, "claim or settle of retries failed; retrying");
                    pause
                }
            };
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = self.lanes[d].handed.notified() => pacing.busy(),
                _ = tokio::time::sleep(pause) => {}
            }
        }
        total
    }
}
