//! Settling a batch: each item's attempt, judged by [`verdict`], written where its event's state
//! lives — the event's own row when it has one destination and nothing to carry on, or else the
//! row settled and each undelivered pair written to the deliveries table (a *split* event), held
//! pairs of a lane that is down in bulk. Items of a lane handed over with their request still out
//! become pairs leased to the batch, which settles them when the answers come ([`Relay::settle_late`]).

use std::collections::HashSet;
use std::time::Instant;

use chrono::Utc;
use opentelemetry::KeyValue;
use tracing::{debug, warn};
use uuid::Uuid;

use super::items::{Dispatch, Items};
use super::report::{log_failed, record_outcomes, BatchReport};
use super::Relay;
use crate::error::Result;
use crate::gate::Counted;
use crate::model::event::OutboxEvent;
use crate::model::metric;
use crate::model::outcome::Outcome;
use crate::settle::plan::InFlightLease;
use crate::settle::verdict::{verdict, Attempt, Pair, Verdict};
use crate::settle::{self, SettlePlan};
use crate::store::held_batches::HeldBatch;
use crate::store::outbox;
use crate::store::outbox::Guard;

/// Where a batch came from, which decides how its events settle.
#[derive(Debug, Clone, Copy)]
pub(super) enum Origin<'a> {
    /// Claimed from the table: an event nobody answered is given back as it was.
    Claimed,
    /// Read from the WAL: nothing is given back (the slot moves past it), every event that was
    /// not delivered everywhere goes on as pairs; `rowless` events (`emit()`) have no row.
    Wal {
        /// Events that have no table row.
        rowless: &'a HashSet<Uuid>,
    },
}

/// What publishing a batch came to, at the time it settles.
pub(super) struct Results<'a> {
    /// The batch's events.
    pub(super) events: &'a [OutboxEvent],
    /// Its items.
    pub(super) items: &'a Items,
    /// Per item: its answer, if any.
    pub(super) answers: &'a [Option<(Outcome, Counted)>],
    /// Per item: whether its request started.
    pub(super) started: &'a [bool],
    /// Per lane: whether it was handed over (its unanswered items go on as pairs).
    pub(super) handed: &'a [bool],
}

impl Results<'_> {
    /// What happened to item `i`.
    fn attempt(&self, i: usize) -> Attempt<'_> {
        let item = &self.items.list[i];
        match item.dispatch {
            Dispatch::Unroutable => Attempt::Unroutable,
            Dispatch::Hold => Attempt::Held,
            Dispatch::Behind => Attempt::Behind,
            Dispatch::Send => match &self.answers[i] {
                Some((outcome, counted)) => Attempt::Answered(outcome, *counted),
                None if self.handed_over(i) && self.started[i] => Attempt::InFlight,
                None => Attempt::NotSent,
            },
        }
    }

    /// Whether item `i` has no answer and its lane was handed over.
    fn handed_over(&self, i: usize) -> bool {
        let item = &self.items.list[i];
        item.dispatch == Dispatch::Send
            && self.answers[i].is_none()
            && item.lane.is_some_and(|d| self.handed[d])
    }

    /// The items whose requests were still out when their lane was handed over.
    pub(super) fn in_flight(&self) -> Vec<usize> {
        (0..self.items.list.len())
            .filter(|&i| self.handed_over(i) && self.started[i])
            .collect()
    }
}

/// A batch's settle, planned.
pub(super) struct Planned {
    /// What to write.
    pub(super) plan: SettlePlan,
    /// Rows given back as they were (nobody answered them).
    pub(super) untouched: Vec<Uuid>,
    /// Counts of the pairs of split events, for the report.
    pub(super) pairs: BatchReport,
    /// Claimed events of one destination whose request was still out when their lane was handed
    /// over: their rows go under the batch's lease, and are settled when the answer comes.
    pub(super) leased_rows: Vec<Uuid>,
    /// The token and length of that lease (and of in-flight pairs).
    pub(super) lease: (Uuid, std::time::Duration),
}

impl Relay {
    /// Plans the settle of `r`: one verdict per item, written on the event's row or as pairs.
    /// In-flight pairs are leased to `token` for `lease`.
    pub(super) fn plan_batch(
        &self,
        r: &Results<'_>,
        origin: Origin<'_>,
        (token, lease): (Uuid, InFlightLease),
    ) -> Result<Planned> {
        let now = Utc::now();
        // Send, unlike ThreadRng: the batch future crosses threads.
        let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::from_entropy();
        let mut planned = Planned {
            plan: SettlePlan::default(),
            untouched: Vec::new(),
            pairs: BatchReport::default(),
            leased_rows: Vec::new(),
            lease: (token, lease.0),
        };
        let wal = matches!(origin, Origin::Wal { .. });
        // Per lane: its held pairs that go into one held batch.
        let mut bundled: Vec<Vec<&OutboxEvent>> = vec![Vec::new(); self.lanes.len()];
        for (e, event) in r.events.iter().enumerate() {
            let span = r.items.spans[e].clone();
            let first = span.start;
            let single_done = span.len() == 1
                && matches!(
                    r.attempt(first),
                    Attempt::Unroutable | Attempt::Answered(Outcome::Delivered, _)
                );
            // A claimed event of one destination keeps its state on its row when its lane is
            // handed over (given back if unsent, leased if its request is out); anything else
            // that must go on alone becomes pairs.
            let split = span.len() > 1
                || span
                    .clone()
                    .any(|i| r.items.list[i].dispatch == Dispatch::Behind)
                || (wal && (!single_done || r.handed_over(first)));
            if !split && r.handed_over(first) && r.started[first] {
                planned.leased_rows.push(event.id);
                continue;
            }
            if !split {
                let v = self.verdict_of(r, first, now, &mut rng);
                let destination = r.items.list[first]
                    .lane
                    .map(|d| self.lanes[d].name.as_str());
                log_failed(event, destination, &v);
                if !planned.plan.single(event, destination, v) {
                    planned.untouched.push(event.id);
                }
                continue;
            }
            let mut sends = span
                .clone()
                .filter(|&i| r.items.list[i].dispatch == Dispatch::Send)
                .peekable();
            if !wal
                && sends.peek().is_some()
                && sends.all(|i| r.answers[i].is_none() && !r.handed_over(i))
            {
                // Not one destination answered before the batch's time ran out: as it was.
                planned.untouched.push(event.id);
                continue;
            }
            planned.plan.fanned.push(event.id);
            for i in span {
                let Some(d) = r.items.list[i].lane else {
                    continue;
                };
                let v = self.verdict_of(r, i, now, &mut rng);
                let lane = &self.lanes[d];
                log_failed(event, Some(&lane.name), &v);
                count_pair(&mut planned.pairs, &v);
                match v {
                    // No per-key order to keep: with the others of its batch, in one row.
                    Verdict::Held(_) if !lane.keeps_order_of(event) => bundled[d].push(event),
                    v => planned.plan.pair(event, &lane.name, v, lease),
                }
            }
        }
        for (d, held) in bundled.iter().enumerate() {
            if !held.is_empty() {
                planned
                    .plan
                    .bundles
                    .push(HeldBatch::encode(&self.lanes[d].name, held)?);
            }
        }
        if planned.plan.pairs.iter().any(|p| p.leased) {
            planned.plan.in_flight = Some(token);
        }
        if let Origin::Wal { rowless } = origin {
            planned.plan.rowless = rowless.clone();
            planned.plan.defer_delivered = true;
        }
        Ok(planned)
    }

    /// The verdict of item `i` of `r`.
    fn verdict_of(
        &self,
        r: &Results<'_>,
        i: usize,
        now: chrono::DateTime<Utc>,
        rng: &mut impl rand::Rng,
    ) -> Verdict {
        let item = &r.items.list[i];
        let destination = item
            .lane
            .map(|d| (self.lanes[d].name.as_str(), &self.lanes[d].retry));
        let pair = Pair {
            event: &r.events[item.event],
            destination,
        };
        verdict(pair, r.attempt(i), now, rng)
    }

    /// Writes a planned settle under `guard`; `poison` rows are dead-lettered and `behind` rows
    /// (cut off their key's chain by the claim) given back with the untouched ones.
    pub(super) async fn settle_planned(
        &self,
        events: &[OutboxEvent],
        mut planned: Planned,
        guard: Guard,
        (poison, behind): (&[(Uuid, String)], &[Uuid]),
        aborted: bool,
    ) -> Result<(BatchReport, Vec<Uuid>)> {
        for (id, reason) in poison {
            warn!(event_id = %id, error = %reason, "dead-lettering a row that cannot be read as an event");
            planned.plan.poison(*id, reason);
        }
        if aborted && !planned.untouched.is_empty() {
            // Shutdown grace is over: what finished is settled, the rest goes back untouched.
            warn!(
                released = planned.untouched.len(),
                "shutdown grace period over: released an unfinished batch"
            );
        }
        planned.untouched.extend(behind);
        let settle_started = Instant::now();
        let settle_wall = std::time::SystemTime::now();
        // WAL: no claim reads the rows, so there are no followers to park.
        let park = (self.claim.ordered && !planned.plan.defer_delivered)
            .then_some(self.blocking.as_slice());
        let guard = match guard {
            Guard::Transaction(mut tx) if !planned.leased_rows.is_empty() => {
                // The rows whose request is out go under a lease, settled later by its token.
                let rows = &planned.leased_rows;
                outbox::lease_many(
                    &self.store,
                    &mut tx,
                    rows,
                    (planned.lease.1, planned.lease.0),
                )
                .await?;
                Guard::Transaction(tx)
            }
            // Lease mode: the rows are leased already (the batch's token), for longer than the
            // batch may last.
            guard => guard,
        };
        let plan = &planned.plan;
        let settled = settle::apply(
            &self.store,
            guard,
            plan,
            self.settle_mode,
            &planned.untouched,
            park,
        )
        .await?;
        metrics::histogram!(metric::SETTLE_SECONDS).record(settle_started.elapsed().as_secs_f64());
        self.progressed();
        record_outcomes(events, plan);
        self.store_tripped().await;
        if settled.fenced > 0 {
            warn!(
                fenced = settled.fenced,
                "lease lost before settle: another relay re-claimed these events"
            );
        }
        let pairs = planned.pairs;
        let report = BatchReport {
            claimed: events.len() + poison.len(),
            delivered: plan.delivered_count() + pairs.delivered,
            retried: plan.retry_count() + pairs.retried,
            dead: plan.dead_count() + pairs.dead,
            held: plan.held.len() + pairs.held,
            fenced: settled.fenced,
            released: planned.untouched.len(),
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

    /// Settles what a batch handed over with its request still out, once the answers came (or
    /// the budget ran out), under the batch's `token`: rows in `leased_rows` on the outbox table
    /// (given back due now when unanswered), the others as pairs of the deliveries table
    /// (deleted when delivered, due again when unanswered). What the token no longer holds (its
    /// lease ran out and another relay took it) is left alone.
    pub(super) async fn settle_late(
        &self,
        r: &Results<'_>,
        late: &[usize],
        (token, leased_rows): (Uuid, &[Uuid]),
    ) -> Result<BatchReport> {
        let now = Utc::now();
        let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::from_entropy();
        let (mut rows, mut pairs) = (SettlePlan::default(), SettlePlan::default());
        let mut untouched_rows: Vec<Uuid> = Vec::new();
        let mut untouched_pairs: Vec<(Uuid, String)> = Vec::new();
        let mut events = Vec::with_capacity(late.len());
        for &i in late {
            let item = &r.items.list[i];
            let (Some(d), event) = (item.lane, &r.events[item.event]) else {
                continue;
            };
            let lane = &self.lanes[d];
            let attempt = match &r.answers[i] {
                Some((outcome, counted)) => Attempt::Answered(outcome, *counted),
                None => Attempt::NotSent,
            };
            let pair = Pair {
                event,
                destination: Some((lane.name.as_str(), &lane.retry)),
            };
            let v = verdict(pair, attempt, now, &mut rng);
            log_failed(event, Some(&lane.name), &v);
            if leased_rows.contains(&event.id) {
                if !rows.single(event, Some(&lane.name), v) {
                    untouched_rows.push(event.id);
                }
            } else if !pairs.single(event, Some(&lane.name), v) {
                untouched_pairs.push((event.id, lane.name.clone()));
            }
            events.push(event.clone());
        }
        if events.is_empty() {
            return Ok(BatchReport::default());
        }
        let mut fenced = 0;
        if !leased_rows.is_empty() {
            let park = self.claim.ordered.then_some(self.blocking.as_slice());
            let guard = Guard::Lease(token);
            let settled = settle::apply(
                &self.store,
                guard,
                &rows,
                self.settle_mode,
                &untouched_rows,
                park,
            )
            .await?;
            fenced += settled.fenced;
        }
        if !pairs.failed.is_empty()
            || !pairs.delivered.is_empty()
            || !pairs.held.is_empty()
            || !untouched_pairs.is_empty()
        {
            let settled =
                settle::apply_deliveries(&self.store, token, &pairs, &untouched_pairs).await?;
            fenced += settled.fenced;
        }
        for plan in [&rows, &pairs] {
            record_outcomes(&events, plan);
        }
        self.store_tripped().await;
        if fenced > 0 {
            warn!(
                fenced,
                "lease lost before settle: another relay re-claimed these events"
            );
        }
        let count = |f: &dyn Fn(&SettlePlan) -> usize| f(&rows) + f(&pairs);
        Ok(BatchReport {
            delivered: count(&|p| p.delivered_count()),
            retried: count(&|p| p.retry_count()),
            dead: count(&|p| p.dead_count()),
            held: count(&|p| p.held.len()),
            fenced,
            released: untouched_rows.len(),
            ..BatchReport::default()
        })
    }
}

/// Counts one pair's verdict into a report.
fn count_pair(report: &mut BatchReport, v: &Verdict) {
    match v {
        Verdict::Delivered => report.delivered += 1,
        Verdict::Failed(f) if f.dead => report.dead += 1,
        Verdict::Failed(_) => report.retried += 1,
        Verdict::Held(_) => report.held += 1,
        Verdict::Waiting(_) | Verdict::InFlight => {}
    }
}
