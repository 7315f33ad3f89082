//! Publishing a batch's items: each destination's share together, ordered keys as chains.

use std::collections::HashMap;
use std::sync::atomic::Ordering as AtomicOrdering;
use std::time::Instant;

use futures::future::join_all;
use futures::FutureExt;
use tracing::warn;

use super::batch::{BatchRun, Items, Route};
use super::report::{panic_message, retry_reason};
use super::Relay;
use crate::breaker::{self, Counted};
use crate::config::{OnDead, Ordering};
use crate::model::event::OutboxEvent;
use crate::model::metric;
use crate::model::outcome::Outcome;
use crate::sinks::Recorder;

impl Relay {
    /// Publishes a batch, recording an outcome per event into `run` as each finishes.
    ///
    /// Events of an ordered destination that share a key form a chain, published one event after
    /// the other; a chain stops at its first failure, so a later event of a key is never published
    /// before an earlier one succeeded, and at the batch's deadline, leaving the rest of its key to
    /// the next claim, in order. Chains run side by side, each at its own pace: a slow request
    /// holds back only its own key. Every other event is a chain of one; those all go out together
    /// in one publish per destination.
    pub(super) async fn publish_chains(&self, run: &BatchRun<'_>) {
        let mut singles: Vec<usize> = Vec::new();
        let mut chains: Vec<Vec<usize>> = Vec::new();
        let sendable = (0..run.routes.len()).filter(|&i| matches!(run.routes[i], Route::Send(_)));
        if !self.claim.ordered {
            // No ordered destination: no chains to build.
            singles = sendable.collect();
        } else {
            let mut chain_of_key: HashMap<(usize, &str), usize> = HashMap::new();
            for i in sendable {
                let ordered_key = match (run.routes[i], run.event(i).key.as_deref()) {
                    (Route::Send(d), Some(key))
                        if self.config.destinations[d].ordering == Ordering::Key =>
                    {
                        (d, key)
                    }
                    _ => {
                        singles.push(i);
                        continue;
                    }
                };
                let c = *chain_of_key.entry(ordered_key).or_insert_with(|| {
                    chains.push(Vec::new());
                    chains.len() - 1
                });
                chains[c].push(i);
            }
            // A key with one event here needs no sequencing: it joins the singles.
            chains.retain(|chain| match chain.as_slice() {
                [only] => {
                    singles.push(*only);
                    false
                }
                _ => true,
            });
        }
        futures::future::join(
            self.publish_together(run, &singles),
            join_all(chains.iter().map(|chain| self.publish_chain(run, chain))),
        )
        .await;
    }

    /// Publishes one key's chain in order, stopping at the first event that neither was delivered
    /// nor may be skipped (`on_dead = "skip"` lets a rejected event's successors go on), or when
    /// the batch's time is up.
    pub(super) async fn publish_chain(&self, run: &BatchRun<'_>, chain: &[usize]) {
        for &i in chain {
            let Route::Send(d) = run.routes[i] else {
                break;
            };
            if run.budgets[d].is_over() {
                break;
            }
            self.publish_together(run, &[i]).await;
            let go_on = match run.slots[i].get() {
                Some(Outcome::Delivered) => true,
                Some(Outcome::Rejected { .. }) => {
                    self.config.destinations[d].on_dead == OnDead::Skip
                }
                Some(Outcome::Retry { .. }) | None => false,
            };
            if !go_on {
                break;
            }
        }
    }

    /// Publishes the events at `indexes`: each destination's share concurrently, within the
    /// destination's budget. A sink that panics fails the events it left without an outcome.
    pub(super) async fn publish_together(&self, run: &BatchRun<'_>, indexes: &[usize]) {
        let publishes = self
            .destinations
            .iter()
            .enumerate()
            .filter_map(|(d, dest)| {
                let members: Vec<usize> = indexes
                    .iter()
                    .copied()
                    .filter(|&i| run.routes[i] == Route::Send(d))
                    .collect();
                if members.is_empty() {
                    return None;
                }
                Some(async move {
                    for &i in &members {
                        run.handed[i].store(true, AtomicOrdering::Relaxed);
                    }
                    let batch: Vec<&OutboxEvent> = members.iter().map(|&i| run.event(i)).collect();
                    let recorder = Recorder::new(&run.slots, &members);
                    let started = Instant::now();
                    let wall = std::time::SystemTime::now();
                    let publish = dest
                        .sink
                        .publish_until(&batch, &run.budgets[d], &recorder);
                    if let Err(panic) = std::panic::AssertUnwindSafe(publish).catch_unwind().await {
                        let reason = format!("the sink panicked: {}", panic_message(&*panic));
                        warn!(destination = %dest.name, error = %reason, "sink panicked; its unfinished events will be retried");
                        for i in 0..members.len() {
                            recorder.record(i, Outcome::retry(reason.clone()));
                        }
                    }
                    metrics::histogram!(metric::PUBLISH_SECONDS, "destination" => dest.name.clone())
                        .record(started.elapsed().as_secs_f64());
                    if crate::otlp::enabled() {
                        for &i in &members {
                            crate::otlp::publish_span(run.event(i), &dest.name, run.slots[i].get(), wall);
                        }
                    }
                })
            });
        join_all(publishes).await;
    }

    /// Publishes events that have one item each (`routes`) within one `publish_timeout`; returns
    /// their outcomes and whether shutdown cut the publish short.
    pub(super) async fn publish_each(
        &self,
        events: &[OutboxEvent],
        routes: Vec<Route>,
    ) -> (Vec<Option<Outcome>>, bool) {
        let items = Items::single(routes);
        let deadline = tokio::time::Instant::now() + self.settings.publish_timeout;
        let run = BatchRun::new(events, &items, &self.destinations, deadline);
        let aborted = tokio::select! {
            _ = tokio::time::timeout_at(deadline, self.publish_chains(&run)) => false,
            _ = self.abort.cancelled() => true,
        };
        (run.finish(aborted, self.settings.publish_timeout), aborted)
    }

    /// Records an outcome of destination `d` on its breaker; a failure that opens it joins
    /// `tripped` (stored once the batch is settled).
    pub(super) fn count(
        &self,
        d: usize,
        outcome: &Outcome,
        tripped: &mut Vec<(usize, String)>,
    ) -> Counted {
        let counted = self.health[d].record(outcome);
        if counted == Counted::Tripped {
            if let Some(reason) = retry_reason(outcome) {
                tripped.push((d, reason));
            }
        }
        counted
    }

    /// Stores the breakers a batch opened, so every relay holds those destinations' events.
    pub(super) async fn open_breakers(&self, tripped: Vec<(usize, String)>) {
        for (d, reason) in tripped {
            let health = &self.health[d];
            warn!(
                destination = health.name(),
                failures = health.config().failures,
                error = %reason,
                "circuit breaker open: holding this destination's events, probing until it answers"
            );
            if let Err(e) = breaker::store_open(&self.store, health, &reason).await {
                warn!(destination = health.name(), error = %crate::error_chain(&e), "cannot store the breaker state");
            }
        }
    }
}
