//! The deliveries loop: the undelivered pairs of split events, claimed, published and settled.

use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::warn;
use uuid::Uuid;

use super::batch::Route;
use super::pacing::{db_reachable, Pacing};
use super::report::{record_outcomes, retry_reason, warn_failed, BatchReport};
use super::Relay;
use crate::breaker::Counted;
use crate::error::Result;
use crate::model::event::OutboxEvent;
use crate::model::metric;
use crate::settle;

/// The deliveries loop's longest idle wait (or `poll_interval` if longer). Its rows are retries
/// and held pairs, due after a backoff of seconds, so it need not poll as often as the claim loops
/// that carry fresh events.
pub(super) const DELIVERIES_POLL_INTERVAL: Duration = Duration::from_millis(250);

impl Relay {
    /// Claims, publishes and settles one batch of due deliveries (the undelivered pairs of split
    /// events). Each pair is its destination's alone: it is published, retried, held and
    /// dead-lettered like an event with that one destination.
    pub async fn run_deliveries_batch(&self) -> Result<BatchReport> {
        let claimed = crate::sources::poll::claim_deliveries(
            &self.store,
            self.settings.batch_size,
            self.claim.lease,
            &self.ordered,
            &self.blocking,
        )
        .await?;
        let token = claimed.token;
        let mut plan = settle::SettlePlan::default();
        for (id, name, reason) in &claimed.poison {
            warn!(event_id = %id, destination = %name, error = %reason, "dead-lettering a delivery that cannot be read as an event");
            plan.poison_pair(*id, name, reason);
        }
        if claimed.deliveries.is_empty() && plan.failed.is_empty() {
            return Ok(BatchReport::default());
        }
        let (names, events): (Vec<String>, Vec<OutboxEvent>) = claimed
            .deliveries
            .into_iter()
            .map(|c| (c.destination, c.event))
            .unzip();
        let routes: Vec<Route> = names
            .iter()
            .map(
                |name| match self.destinations.iter().position(|d| &d.name == name) {
                    Some(d) => self.gate(d),
                    None => Route::Unroutable,
                },
            )
            .collect();
        let (outcomes, aborted) = self.publish_each(&events, routes.clone()).await;
        let now = chrono::Utc::now();
        // Send, unlike ThreadRng: the batch future crosses threads.
        let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::from_entropy();
        let mut tripped = Vec::new();
        let mut untouched: Vec<(Uuid, String)> = Vec::new();
        for (i, event) in events.iter().enumerate() {
            let name = &names[i];
            match (routes[i], &outcomes[i]) {
                (Route::Unroutable, _) => plan.failed.push(settle::FailedRow {
                    id: event.id,
                    error: format!("destination {name:?} is no longer configured: add it back, then `pgoutbox dead retry --destination {name}`, or `dead discard` [dead: no such destination]"),
                    destination: Some(name.clone()),
                    delay_secs: 0.0,
                    dead: true,
                }),
                (Route::Hold(d), _) => {
                    match settle::expired_hold(event, name, &self.destinations[d].retry, now) {
                        Some(dead) => plan.failed.push(dead),
                        None => plan.hold(event.id, name, None),
                    }
                }
                (Route::Send(_) | Route::Defer(_), None) => untouched.push((event.id, name.clone())),
                (Route::Send(d) | Route::Defer(d), Some(outcome)) => {
                    match self.count(d, outcome, &mut tripped) {
                        Counted::Held => {
                            plan.hold(event.id, name, retry_reason(outcome).as_deref())
                        }
                        _ => {
                            let dest = &self.destinations[d];
                            match settle::decide(event, name, &dest.retry, outcome, now, &mut rng) {
                                None => plan.delivered.entry(name.clone()).or_default().push(event.id),
                                Some(failed) => {
                                    warn_failed(event, &failed);
                                    plan.failed.push(failed);
                                }
                            }
                        }
                    }
                }
            }
        }
        let settled = settle::apply_deliveries(&self.store, token, &plan, &untouched).await?;
        record_outcomes(&events, &plan);
        self.open_breakers(tripped).await;
        if settled.fenced > 0 {
            warn!(
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

    /// Claims due deliveries until shutdown: at once again while there are some, backing off to
    /// [`DELIVERIES_POLL_INTERVAL`] (or `poll_interval`) while there are none, and on database
    /// errors.
    pub(super) async fn deliveries_loop(&self, shutdown: CancellationToken) -> BatchReport {
        let mut total = BatchReport::default();
        let mut pacing = Pacing {
            max: self.settings.poll_interval.max(DELIVERIES_POLL_INTERVAL),
            ..Pacing::new(&self.settings)
        };
        let mut db_down = false;
        while !shutdown.is_cancelled() {
            let pause = match self.run_deliveries_batch().await {
                Ok(report) if report.claimed > 0 => {
                    db_reachable(None, &mut db_down);
                    total += report;
                    pacing.busy();
                    continue;
                }
                Ok(_) => {
                    db_reachable(None, &mut db_down);
                    pacing.idle()
                }
                Err(e) => {
                    db_down = true;
                    metrics::counter!(metric::DB_ERRORS_TOTAL).increment(1);
                    let pause = pacing.failed();
                    warn!(error = %crate::error_chain(&e), retry_in_ms = pause.as_millis() as u64, "deliveries claim or settle failed; retrying");
                    pause
                }
            };
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep(pause) => {}
            }
        }
        total
    }
}
