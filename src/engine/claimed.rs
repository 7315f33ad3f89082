//! A claimed batch: claimed, routed into items, published, settled.

use std::collections::HashSet;
use std::sync::atomic::Ordering as AtomicOrdering;
use std::time::Instant;

use opentelemetry::KeyValue;
use tracing::debug;
use uuid::Uuid;

use super::batch::{BatchRun, Items, Route, STRAGGLER_CHECK};
use super::report::BatchReport;
use super::Relay;
use crate::breaker::Gate;
use crate::config::Ordering;
use crate::error::Result;
use crate::model::event::OutboxEvent;
use crate::model::metric;
use crate::sources::poll::{claim_due, ClaimOptions, ClaimedBatch, Hold};
use crate::store::deliveries;

impl Relay {
    /// Claims, publishes and settles one batch.
    pub async fn run_batch(&self) -> Result<BatchReport> {
        Ok(self.process_batch(None).await?.0)
    }

    /// Where an item for destination `d` goes now: sent, or held while `d` is paused or open.
    pub(super) fn gate(&self, d: usize) -> Route {
        match self.health[d].gate() {
            Gate::Send => Route::Send(d),
            Gate::Hold => Route::Hold(d),
        }
    }

    /// The batch's items: one per event and destination that takes it (one `Unroutable` item for
    /// an event none takes). With ordered destinations, an item whose key still has an undelivered
    /// pair for its destination waits behind it (DeliveriesKeysWaiting).
    pub(super) async fn items(&self, events: &[OutboxEvent]) -> Result<Items> {
        let mut items = Items::default();
        for (e, targets) in self.router.route_all(events).into_iter().enumerate() {
            let start = items.routes.len();
            if targets.is_empty() {
                items.owner.push(e);
                items.routes.push(Route::Unroutable);
            }
            for d in targets {
                items.owner.push(e);
                items.routes.push(self.gate(d));
            }
            items.spans.push(start..items.routes.len());
        }
        if !self.ordered.is_empty() {
            let keyed: Vec<(usize, usize, &str)> = (0..items.routes.len())
                .filter_map(
                    |i| match (items.routes[i], events[items.owner[i]].key.as_deref()) {
                        (Route::Send(d), Some(key))
                            if self.config.destinations[d].ordering == Ordering::Key =>
                        {
                            Some((i, d, key))
                        }
                        _ => None,
                    },
                )
                .collect();
            if !keyed.is_empty() {
                let names: Vec<&str> = keyed
                    .iter()
                    .map(|(_, d, _)| self.destinations[*d].name.as_str())
                    .collect();
                let keys: Vec<&str> = keyed.iter().map(|(_, _, k)| *k).collect();
                let waiting =
                    deliveries::keys_waiting(&self.store, (&names, &keys), &self.blocking).await?;
                if !waiting.is_empty() {
                    let waiting: HashSet<(&str, &str)> = waiting
                        .iter()
                        .map(|(d, k)| (d.as_str(), k.as_str()))
                        .collect();
                    for (i, d, key) in keyed {
                        if waiting.contains(&(self.destinations[d].name.as_str(), key)) {
                            items.routes[i] = Route::Defer(d);
                        }
                    }
                }
            }
        }
        Ok(items)
    }

    /// One batch; also returns the ids scheduled for another attempt.
    ///
    /// Everything the claim holds is bounded by `publish_timeout` from the claim: each
    /// destination's share publishes within that budget, recording each event's outcome as it
    /// comes; at the deadline the relay stops waiting, settles what finished and gives the rest
    /// back untouched (no attempt counted), so an event a destination accepted is never marked
    /// failed and sent again because a slower one in its batch ran out of time.
    ///
    /// With `detach`, a batch whose events have all finished but a few stragglers settles what
    /// finished at once, moves the stragglers under a lease, and signals `detach`, so that the
    /// worker claims its next batch while this one waits for them: a stalled request holds back
    /// only its own event (and, ordered, its own key).
    pub(super) async fn process_batch(
        &self,
        detach: Option<tokio::sync::oneshot::Sender<()>>,
    ) -> Result<(BatchReport, Vec<Uuid>)> {
        let claim_started = Instant::now();
        let claim_wall = std::time::SystemTime::now();
        let deadline = tokio::time::Instant::now() + self.settings.publish_timeout;
        let options = ClaimOptions {
            heads: self.heads.load(AtomicOrdering::Relaxed),
            followers: self.followers.load(AtomicOrdering::Relaxed),
            window: self.window.load(AtomicOrdering::Relaxed),
            ..self.claim
        };
        let ClaimedBatch {
            events,
            poison,
            held_back,
            hold,
            found,
        } = claim_due(&self.store, &options, &self.blocking).await?;
        metrics::histogram!(metric::CLAIM_SECONDS).record(claim_started.elapsed().as_secs_f64());
        if self.claim.ordered {
            self.adapt_claim(found, (options.heads, options.followers));
        }
        if events.is_empty() && poison.is_empty() {
            crate::sources::poll::release(&self.store, hold, &held_back).await?;
            return Ok((BatchReport::default(), Vec::new()));
        }
        metrics::histogram!(metric::BATCH_SIZE).record((events.len() + poison.len()) as f64);
        crate::otlp::batch_span("claim", claim_wall, || {
            vec![
                KeyValue::new("pgoutbox.events", events.len() as i64),
                KeyValue::new("pgoutbox.poison", poison.len() as i64),
                KeyValue::new("pgoutbox.table", self.table.to_string()),
            ]
        });
        let items = match self.items(&events).await {
            Ok(items) => items,
            Err(e) => {
                crate::sources::poll::release(&self.store, hold, &held_back).await?;
                return Err(e);
            }
        };

        let run = BatchRun::new(&events, &items, &self.destinations, deadline);
        let mut detach = detach;
        let mut last_progress = (run.finished(), tokio::time::Instant::now());
        let mut early: Option<(BatchReport, Vec<Uuid>, Uuid, HashSet<usize>)> = None;
        let mut hold = Some(hold);
        let aborted = {
            let publish = tokio::time::timeout_at(deadline, self.publish_chains(&run));
            tokio::pin!(publish);
            loop {
                tokio::select! {
                    _ = &mut publish => break false,
                    _ = self.abort.cancelled() => break true,
                    _ = tokio::time::sleep(STRAGGLER_CHECK), if detach.is_some() => {
                        let most = (events.len() / 20).max(1);
                        let Some(stragglers) = run.only_stragglers(&mut last_progress, most) else {
                            continue;
                        };
                        // Settle what finished now; the stragglers go on under a lease.
                        let Some(claim_hold) = hold.take() else {
                            continue;
                        };
                        let token = match &claim_hold {
                            Hold::Lease(token) => *token,
                            // A claimed batch is never unheld; a new token as for a transaction.
                            Hold::Transaction(_) | Hold::Nothing => Uuid::new_v4(),
                        };
                        // Settled per event: an event waits for all its items.
                        let straggling: HashSet<usize> =
                            stragglers.iter().map(|&i| items.owner[i]).collect();
                        let snapshot = run.snapshot();
                        let lease = (
                            straggling.iter().map(|&e| events[e].id).collect::<Vec<_>>(),
                            token,
                            deadline.saturating_duration_since(tokio::time::Instant::now())
                                + self.settings.publish_timeout,
                        );
                        let (report, retried) = self
                            .settle_part(
                                &events,
                                &items,
                                &snapshot,
                                &|i| !straggling.contains(&i),
                                (&poison, &held_back),
                                claim_hold,
                                Some(lease),
                                false,
                                None,
                            )
                            .await?;
                        debug!(stragglers = stragglers.len(), "batch settled but for its stragglers; the worker goes on");
                        early = Some((report, retried, token, straggling));
                        if let Some(signal) = detach.take() {
                            let _ = signal.send(());
                        }
                        break tokio::select! {
                            _ = &mut publish => false,
                            _ = self.abort.cancelled() => true,
                        };
                    }
                }
            }
        };
        let outcomes = run.finish(aborted, self.settings.publish_timeout);
        match (early, hold) {
            (None, Some(hold)) => {
                self.settle_part(
                    &events,
                    &items,
                    &outcomes,
                    &|_| true,
                    (&poison, &held_back),
                    hold,
                    None,
                    aborted,
                    None,
                )
                .await
            }
            (None, None) => Ok((BatchReport::default(), Vec::new())),
            (Some((mut report, mut retried, token, straggling)), _) => {
                let (late, late_retried) = self
                    .settle_part(
                        &events,
                        &items,
                        &outcomes,
                        &|i| straggling.contains(&i),
                        (&[], &[]),
                        Hold::Lease(token),
                        None,
                        aborted,
                        None,
                    )
                    .await?;
                report += late;
                retried.extend(late_retried);
                Ok((report, retried))
            }
        }
    }
}
