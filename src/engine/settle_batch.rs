//! Settling a batch: turning its items' outcomes into the writes of one settle.

use std::time::{Duration, Instant};

use opentelemetry::KeyValue;
use tracing::{debug, warn};
use uuid::Uuid;

use super::batch::{Items, Route};
use super::report::{record_outcomes, retry_reason, warn_failed, BatchReport, PairCounts};
use super::wal::WalSettle;
use super::Relay;
use crate::breaker::Counted;
use crate::config::Ordering;
use crate::error::Result;
use crate::model::event::OutboxEvent;
use crate::model::metric;
use crate::model::outcome::Outcome;
use crate::settle;
use crate::sources::poll::Hold;
use crate::store::outbox;

impl Relay {
    /// Settles the events of a batch that `include` selects (by event index), given their items'
    /// outcomes, under `hold`; with `lease_rest`, first moves those ids under a lease (token,
    /// length) so that they can be settled later, fenced by the token. `extra`: the claim's poison
    /// rows and held-back rows (given to one settle only).
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn settle_part(
        &self,
        events: &[OutboxEvent],
        items: &Items,
        outcomes: &[Option<Outcome>],
        include: &(dyn Fn(usize) -> bool + Sync),
        extra: (&[(Uuid, String)], &[Uuid]),
        hold: Hold,
        lease_rest: Option<(Vec<Uuid>, Uuid, Duration)>,
        aborted: bool,
        mut wal: Option<&mut WalSettle>,
    ) -> Result<(BatchReport, Vec<Uuid>)> {
        let (poison, held_back) = extra;
        let started = Instant::now();
        let now = chrono::Utc::now();
        let mut tripped: Vec<(usize, String)> = Vec::new();
        let mut attempted = Vec::new();
        let mut held: Vec<(usize, usize, Option<String>)> = Vec::new();
        let mut untouched: Vec<Uuid> = Vec::new();
        let mut split: Vec<usize> = Vec::new();
        for (e, event) in events.iter().enumerate() {
            if !include(e) {
                continue;
            }
            let span = items.spans[e].clone();
            // WAL: anything but a delivery of a routed event goes on as a pair.
            let wal_split = wal.is_some()
                && !matches!(
                    (items.routes[span.start], &outcomes[span.start]),
                    (Route::Unroutable, _) | (Route::Send(_), Some(Outcome::Delivered))
                );
            if items.is_split(e) || wal_split {
                let mut sends = span.filter(|&i| matches!(items.routes[i], Route::Send(_)));
                // From the WAL nothing is given back: the slot moves past it.
                if wal.is_none()
                    && sends.clone().next().is_some()
                    && sends.all(|i| outcomes[i].is_none())
                {
                    // Not one destination answered before the batch's time ran out: as it was.
                    untouched.push(event.id);
                } else {
                    split.push(e);
                }
                continue;
            }
            let i = span.start;
            match (items.routes[i], &outcomes[i]) {
                (Route::Unroutable, _) => attempted.push((event, None, &self.unroutable)),
                (Route::Hold(d), _) => held.push((e, d, None)),
                (Route::Send(_) | Route::Defer(_), None) => untouched.push(event.id),
                (Route::Send(d) | Route::Defer(d), Some(outcome)) => {
                    match self.count(d, outcome, &mut tripped) {
                        Counted::Held => held.push((e, d, retry_reason(outcome))),
                        _ => {
                            let dest = &self.destinations[d];
                            attempted.push((
                                event,
                                Some((dest.name.as_str(), &dest.retry)),
                                outcome,
                            ));
                        }
                    }
                }
            }
        }
        // Send, unlike ThreadRng: the batch future crosses threads.
        let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::from_entropy();
        let mut plan = settle::plan(attempted, now, &mut rng);
        if let Some(wal) = &wal {
            plan.rowless = wal.rowless.clone();
            plan.defer_delivered = true;
        }
        for (e, d, reason) in held {
            let (event, dest) = (&events[e], &self.destinations[d]);
            match settle::expired_hold(event, &dest.name, &dest.retry, now) {
                Some(dead) => plan.failed.push(dead),
                None => plan.hold(event.id, &dest.name, reason.as_deref()),
            }
        }
        let mut pairs = PairCounts::default();
        // Per destination: its held pairs that go into one held batch.
        let mut bundled: Vec<Vec<&OutboxEvent>> = vec![Vec::new(); self.destinations.len()];
        for e in split {
            let event = &events[e];
            plan.fanned.push(event.id);
            for i in items.spans[e].clone() {
                let (d, outcome) = match (items.routes[i], &outcomes[i]) {
                    (Route::Unroutable, _) => continue,
                    (Route::Send(d), outcome) => (d, outcome.as_ref()),
                    (Route::Hold(d) | Route::Defer(d), _) => (d, None),
                };
                let dest = &self.destinations[d];
                let counted = outcome.map(|o| (o, self.count(d, o, &mut tripped)));
                match (items.routes[i], counted) {
                    (Route::Defer(_), _) => {
                        let note = format!(
                            "waiting for an earlier event of key {:?} to reach {}",
                            event.key.as_deref().unwrap_or_default(),
                            dest.name
                        );
                        plan.pair_waiting(event, &dest.name, false, Some(note));
                    }
                    (Route::Hold(_), _) | (_, Some((_, Counted::Held))) => {
                        match settle::expired_hold(event, &dest.name, &dest.retry, now) {
                            Some(dead) => plan.pair_failed(event.attempts, dead),
                            // No per-key order to keep: with the others of its batch, in one row.
                            None if !(event.key.is_some()
                                && self.config.destinations[d].ordering == Ordering::Key) =>
                            {
                                bundled[d].push(event);
                            }
                            None => {
                                let note = outcome.and_then(retry_reason).map(|r| {
                                    format!(
                                        "{r} [held: {} is unavailable, not counted as an attempt]",
                                        dest.name
                                    )
                                });
                                plan.pair_waiting(event, &dest.name, true, note);
                            }
                        }
                        pairs.held += 1;
                    }
                    (_, None) => {
                        plan.pair_waiting(event, &dest.name, false, None);
                        // WAL: a straggler's request is still out; its pair waits until it is over.
                        let linger = wal.as_ref().and_then(|w| w.linger);
                        if let (Some(linger), Some(pair)) = (linger, plan.pairs.last_mut()) {
                            pair.delay_secs = linger.as_secs_f64();
                        }
                    }
                    (_, Some((outcome, _))) => {
                        match settle::decide(event, &dest.name, &dest.retry, outcome, now, &mut rng)
                        {
                            None => {
                                pairs.delivered += 1;
                                plan.pairs_delivered
                                    .entry(dest.name.clone())
                                    .or_default()
                                    .push(event.id);
                            }
                            Some(failed) => {
                                if failed.dead {
                                    pairs.dead += 1;
                                } else {
                                    pairs.retried += 1;
                                }
                                warn_failed(event, &failed);
                                plan.pair_failed(event.attempts + 1, failed);
                            }
                        }
                    }
                }
            }
        }
        for (d, held) in bundled.iter().enumerate() {
            if !held.is_empty() {
                plan.bundles
                    .push(settle::HeldBatch::encode(&self.destinations[d].name, held)?);
            }
        }
        for (id, reason) in poison {
            warn!(event_id = %id, error = %reason, "dead-lettering a row that cannot be read as an event");
            plan.poison(*id, reason);
        }
        for failed in &plan.failed {
            if let Some(event) = events.iter().find(|e| e.id == failed.id) {
                warn_failed(event, failed);
            }
        }
        if aborted && !untouched.is_empty() {
            // Shutdown grace is over: what finished is settled, the rest goes back untouched.
            warn!(
                released = untouched.len(),
                "shutdown grace period over: released an unfinished batch"
            );
        }
        // Events not attempted (behind a failure of their key, or left when the batch's time was
        // up) and held-back rows go back as they were.
        untouched.extend(held_back);
        let settle_started = Instant::now();
        let settle_wall = std::time::SystemTime::now();
        let hold = match (lease_rest, hold) {
            (None, hold) => hold,
            (Some((ids, token, length)), Hold::Transaction(mut tx)) => {
                outbox::lease_many(&self.store, &mut tx, &ids, (length, token)).await?;
                Hold::Transaction(tx)
            }
            // Lease mode: the stragglers are leased already, for longer than the batch may last.
            (Some(_), hold @ Hold::Lease(_)) => hold,
            // WAL batches have no lease to move rows under.
            (Some(_), hold @ Hold::Nothing) => hold,
        };
        // WAL: no claim reads the rows, so there are no followers to park.
        let park = (self.claim.ordered && wal.is_none()).then_some(self.blocking.as_slice());
        if let Some(wal) = &mut wal {
            wal.rows = plan.delivered_rows();
        }
        let settled =
            settle::apply(&self.store, hold, &plan, self.settle_mode, &untouched, park).await?;
        metrics::histogram!(metric::SETTLE_SECONDS).record(settle_started.elapsed().as_secs_f64());
        record_outcomes(events, &plan);
        self.open_breakers(tripped).await;
        if settled.fenced > 0 {
            warn!(
                fenced = settled.fenced,
                "lease lost before settle: another relay re-claimed these events"
            );
        }
        let report = BatchReport {
            claimed: (0..events.len()).filter(|&i| include(i)).count() + poison.len(),
            delivered: plan.delivered_count() + pairs.delivered,
            retried: plan.retry_count() + pairs.retried,
            dead: plan.dead_count() + pairs.dead,
            held: plan.held.len() + pairs.held,
            fenced: settled.fenced,
            released: untouched.len(),
        };
        crate::otlp::batch_span("settle", settle_wall, || {
            vec![
                KeyValue::new("pgoutbox.delivered", report.delivered as i64),
                KeyValue::new("pgoutbox.retried", report.retried as i64),
                KeyValue::new("pgoutbox.dead", report.dead as i64),
                KeyValue::new("pgoutbox.held", report.held as i64),
                KeyValue::new("pgoutbox.fenced", report.fenced as i64),
            ]
        });
        debug!(
            claimed = report.claimed,
            delivered = report.delivered,
            retried = report.retried,
            dead = report.dead,
            held = report.held,
            released = report.released,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "batch settled"
        );
        let retried = plan
            .failed
            .iter()
            .filter(|f| !f.dead)
            .map(|f| f.id)
            .collect();
        Ok((report, retried))
    }
}
