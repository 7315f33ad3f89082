//! The settle plans of batches: a batch's attempts judged ([`judge`]), then gathered by one
//! constructor per kind of batch into what one settle writes ([`SettlePlan`], which the store
//! writes in one unit of work).
//!
//! A batch of events ([`Planned::batch`]): an event settled on its own row becomes delivered,
//! failed or held in one statement each for the whole batch; a split event (several
//! destinations, or a pair that must go on alone) has its row settled and each undelivered pair
//! written to the deliveries table in the same statement. What a batch handed over with its
//! request out is planned when the answers came ([`Planned::late`]), and a batch of pairs claimed
//! from the deliveries table pair by pair ([`PairsPlan::of`]).

use std::collections::{BTreeMap, HashSet};

use uuid::Uuid;

use super::verdict::{judge, truncate, Attempt, Attempts, Judged, Verdict, Verdicts};
use super::Lanes;
use crate::error::Result;
use crate::model::event::OutboxEvent;
use crate::model::report::BatchReport;
use crate::store::deliveries::{PairRow, PairState};
use crate::store::held::HeldRow;
use crate::store::held_batches::HeldBatch;
use crate::store::settle::{FailedRow, SettlePlan};
use crate::store::Lease;

/// Where a batch of events came from, which decides how they settle.
#[derive(Debug, Clone, Copy)]
pub enum Origin<'a> {
    /// Claimed from the table: an event nobody answered is given back as it was, and an event of
    /// one destination whose request is out when its lane is handed over keeps its state on its
    /// row, leased.
    Claimed,
    /// Read from the WAL: nothing is given back (the slot moves past it), every event that was
    /// not delivered everywhere goes on as pairs; `rowless` events (`emit()`) have no row, and
    /// delivered rows are written later, with other batches'.
    Wal {
        /// Its events that have no table row.
        rowless: &'a HashSet<Uuid>,
    },
}

/// A batch of events as its settle sees it.
#[derive(Debug, Clone, Copy)]
pub struct Batch<'a> {
    /// Its events, in order.
    pub events: &'a [OutboxEvent],
    /// Rows that could not be read as events, with the reason: dead-lettered.
    pub poison: &'a [(Uuid, String)],
    /// Rows an ordered claim took and cut off behind their key's first row that is not due:
    /// given back.
    pub cut_off: &'a [Uuid],
    /// Where it came from.
    pub origin: Origin<'a>,
    /// The lease of what it hands over with its request still out.
    pub lease: Lease,
}

/// A batch's settle, planned.
#[derive(Debug)]
pub struct Planned {
    /// What to write.
    pub plan: SettlePlan,
    /// Rows given back as they were (nobody answered them, or cut off behind their key).
    pub untouched: Vec<Uuid>,
    /// Counts of the pairs of split events, for the report.
    pub pairs: BatchReport,
    /// Claimed events of one destination whose request was still out when their lane was handed
    /// over: their rows go under the batch's lease, and are settled when the answer comes.
    pub leased_rows: Vec<Uuid>,
    /// That lease (and the in-flight pairs').
    pub lease: Lease,
}

impl Planned {
    /// Plans the settle of `batch` from what publishing left of its items (`attempts`), judged
    /// here: each event on its own row, or split into pairs, as its origin and its items ask.
    pub fn batch(batch: &Batch<'_>, attempts: Attempts, lanes: &dyn Lanes) -> Result<Self> {
        let verdicts = judge(batch.events, attempts, lanes);
        let wal = matches!(batch.origin, Origin::Wal { .. });
        let (rowless, materialize) = match batch.origin {
            Origin::Wal { rowless } => rowless_rows(batch.events, &verdicts, rowless),
            Origin::Claimed => (HashSet::new(), Vec::new()),
        };
        let mut planned = Planned {
            plan: SettlePlan {
                rowless,
                materialize,
                defer_delivered: wal,
                ..SettlePlan::default()
            },
            untouched: Vec::new(),
            pairs: BatchReport::default(),
            leased_rows: Vec::new(),
            lease: batch.lease,
        };
        for (id, reason) in batch.poison {
            planned.plan.failed.push(unreadable(*id, None, reason));
        }
        // Per lane: its held pairs that go into one held batch.
        let mut bundled: BTreeMap<usize, Vec<&OutboxEvent>> = BTreeMap::new();
        for (e, event) in batch.events.iter().enumerate() {
            let items = verdicts.of_event(e);
            match settles_as(items, wal) {
                Settles::Leased => planned.leased_rows.push(event.id),
                Settles::Untouched => planned.untouched.push(event.id),
                Settles::Row(judged) => {
                    let destination = judged.item.lane.map(|d| lanes.name(d));
                    if !planned
                        .plan
                        .single(event, destination, judged.verdict.clone())
                    {
                        planned.untouched.push(event.id);
                    }
                }
                Settles::Split => {
                    planned.plan.fanned.push(event.id);
                    for judged in items {
                        let Some(d) = judged.item.lane else { continue };
                        count_pair(&mut planned.pairs, &judged.verdict);
                        match &judged.verdict {
                            // No per-key order to keep: with the others of its batch, in one row.
                            Verdict::Held(_) if !lanes.keeps_order_of(d, event) => {
                                bundled.entry(d).or_default().push(event)
                            }
                            v => planned
                                .plan
                                .pair(event, lanes.name(d), v.clone(), batch.lease),
                        }
                    }
                }
            }
        }
        for (d, held) in bundled {
            planned
                .plan
                .bundles
                .push(HeldBatch::encode(lanes.name(d), &held)?);
        }
        if planned
            .plan
            .pairs
            .iter()
            .any(|p| p.state == PairState::InFlight)
        {
            planned.plan.in_flight = Some(batch.lease.token);
        }
        planned.untouched.extend(batch.cut_off);
        Ok(planned)
    }

    /// Plans the settle of the items a batch handed over with their request out, judged here
    /// once their answers came (or the budget ended): those of events in `leased_rows` on their
    /// rows, the others on their pairs.
    pub fn late(
        events: &[OutboxEvent],
        attempts: Attempts,
        leased_rows: &[Uuid],
        lanes: &dyn Lanes,
    ) -> Late {
        let verdicts = judge(events, attempts, lanes);
        let mut late = Late::default();
        for judged in &verdicts.list {
            let Some(d) = judged.item.lane else { continue };
            let event = &events[judged.item.event];
            let name = lanes.name(d);
            if leased_rows.contains(&event.id) {
                if !late.rows.single(event, Some(name), judged.verdict.clone()) {
                    late.untouched_rows.push(event.id);
                }
            } else if !late.pairs.single(event, Some(name), judged.verdict.clone()) {
                late.untouched_pairs.push((event.id, name.to_owned()));
            }
        }
        late
    }
}

/// WAL: of `rowless` events, those delivered everywhere (they never get a row) and the others
/// (they get one first, in the settle's transaction, for their pairs and dead letters).
fn rowless_rows(
    events: &[OutboxEvent],
    verdicts: &Verdicts,
    rowless: &HashSet<Uuid>,
) -> (HashSet<Uuid>, Vec<OutboxEvent>) {
    let mut done = HashSet::new();
    let mut materialize = Vec::new();
    for (e, event) in events.iter().enumerate() {
        if !rowless.contains(&event.id) {
            continue;
        }
        if verdicts.of_event(e).iter().all(|j| j.attempt.delivered()) {
            done.insert(event.id);
        } else {
            materialize.push(event.clone());
        }
    }
    (done, materialize)
}

/// How one event of a batch settles.
enum Settles<'a> {
    /// On its own row, by the verdict of its one item.
    Row(&'a Judged),
    /// Its row is settled and its undelivered pairs go on alone.
    Split,
    /// Claimed, one destination, its request out when its lane was handed over: its row waits
    /// under the batch's lease.
    Leased,
    /// Claimed and not one destination answered before the batch's time ran out: as it was.
    Untouched,
}

/// How an event whose items were judged `items` settles (`wal`: read from the WAL, where nothing
/// is given back). A claimed event of one destination keeps its state on its row when its lane is
/// handed over (given back if unsent, leased if its request is out); anything else that must go
/// on alone becomes pairs.
fn settles_as(items: &[Judged], wal: bool) -> Settles<'_> {
    let [only] = items else {
        return split_or_untouched(items, wal);
    };
    let done = matches!(only.attempt, Attempt::Unroutable) || only.attempt.delivered();
    let behind = matches!(only.attempt, Attempt::Behind);
    if behind || (wal && (!done || only.attempt.handed_over())) {
        return split_or_untouched(items, wal);
    }
    match only.attempt {
        Attempt::InFlight => Settles::Leased,
        _ => Settles::Row(only),
    }
}

/// A split event, unless it was claimed and none of its items was answered or handed over.
fn split_or_untouched(items: &[Judged], wal: bool) -> Settles<'_> {
    let mut sent = items.iter().filter(|j| j.attempt.was_sent()).peekable();
    if !wal && sent.peek().is_some() && sent.all(|j| matches!(j.attempt, Attempt::NotSent)) {
        Settles::Untouched
    } else {
        Settles::Split
    }
}

/// The two settles of what a batch handed over with its request out.
#[derive(Debug, Default)]
pub struct Late {
    /// Events of one destination whose rows wait under the batch's lease.
    pub rows: SettlePlan,
    /// Of those, the rows given back (unanswered).
    pub untouched_rows: Vec<Uuid>,
    /// Pairs of split events leased to the batch.
    pub pairs: SettlePlan,
    /// Of those, the pairs given back (event id, destination).
    pub untouched_pairs: Vec<(Uuid, String)>,
}

/// The settle of a batch of pairs claimed from the deliveries table.
#[derive(Debug, Default)]
pub struct PairsPlan {
    /// What to write.
    pub plan: SettlePlan,
    /// Pairs given back as they were (event id, destination).
    pub untouched: Vec<(Uuid, String)>,
}

impl PairsPlan {
    /// Plans the settle of pairs of `events` from their `attempts`, judged here, each on its own
    /// pair row, and of `poison` pairs (event id, destination, why) that cannot be read as events.
    pub fn of(
        events: &[OutboxEvent],
        attempts: Attempts,
        poison: &[(Uuid, String, String)],
        lanes: &dyn Lanes,
    ) -> Self {
        let verdicts = judge(events, attempts, lanes);
        let mut planned = Self::default();
        for (id, destination, reason) in poison {
            let row = unreadable(*id, Some(destination.clone()), reason);
            planned.plan.failed.push(row);
        }
        for judged in &verdicts.list {
            let Some(d) = judged.item.lane else { continue };
            let event = &events[judged.item.event];
            if !planned
                .plan
                .single(event, Some(lanes.name(d)), judged.verdict.clone())
            {
                planned.untouched.push((event.id, lanes.name(d).to_owned()));
            }
        }
        planned
    }
}

impl SettlePlan {
    /// The plan of one event settled alone on its row (or one pair on its pair row) with verdict
    /// `v` for `destination`: a probe's.
    pub fn of_one(event: &OutboxEvent, destination: &str, v: Verdict) -> Self {
        let mut plan = Self::default();
        plan.single(event, Some(destination), v);
        plan
    }

    /// The dead letter of a row (`destination`: a pair) that cannot be read as an event.
    pub fn of_unreadable(id: Uuid, destination: Option<&str>, reason: &str) -> Self {
        Self {
            failed: vec![unreadable(id, destination.map(str::to_owned), reason)],
            ..Self::default()
        }
    }

    /// Records the verdict of an event settled on its own row (or of a pair claimed from the
    /// deliveries table, settled on its pair row): delivered, failed or held. Returns `false`
    /// when nothing is written for it: it is given back as it was (the caller releases it).
    fn single(&mut self, event: &OutboxEvent, destination: Option<&str>, v: Verdict) -> bool {
        match v {
            Verdict::Delivered => {
                let destination = destination.unwrap_or_default();
                // No String per event: the destination is looked up, inserted once.
                match self.delivered.get_mut(destination) {
                    Some(ids) => ids.push(event.id),
                    None => {
                        self.delivered
                            .insert(destination.to_owned(), vec![event.id]);
                    }
                }
            }
            Verdict::Failed(f) => self.failed.push(FailedRow {
                id: event.id,
                error: f.error,
                destination: destination.map(str::to_owned),
                delay_secs: f.delay_secs,
                dead: f.dead,
            }),
            Verdict::Held(error) => self.held.push(HeldRow {
                id: event.id,
                destination: destination.unwrap_or_default().to_owned(),
                error,
            }),
            Verdict::Waiting(_) | Verdict::InFlight => return false,
        }
        true
    }

    /// Records the verdict of one pair of a split event (whose row this settle settles):
    /// delivered (nothing to write), or a row in the deliveries table — failed, held, waiting, or
    /// in flight under `lease` (the batch's token, [`SettlePlan::in_flight`]).
    fn pair(&mut self, event: &OutboxEvent, destination: &str, v: Verdict, lease: Lease) {
        let mut row = PairRow {
            event_id: event.id,
            destination: destination.to_owned(),
            attempts: event.attempts,
            delay_secs: 0.0,
            error: None,
            state: PairState::Waiting,
        };
        match v {
            Verdict::Delivered => {
                // The common case, once per destination per event: no String per pair.
                match self.pairs_delivered.get_mut(destination) {
                    Some(ids) => ids.push(event.id),
                    None => {
                        self.pairs_delivered
                            .insert(destination.to_owned(), vec![event.id]);
                    }
                }
                return;
            }
            Verdict::Failed(f) => {
                row.attempts += i32::from(f.counted);
                row.delay_secs = f.delay_secs;
                row.error = Some(f.error);
                row.state = PairState::Failed { dead: f.dead };
            }
            Verdict::Held(note) => {
                row.state = PairState::Held;
                row.error = note;
            }
            Verdict::Waiting(note) => row.error = note.map(truncate),
            Verdict::InFlight => {
                row.state = PairState::InFlight;
                row.delay_secs = lease.length.as_secs_f64();
            }
        }
        self.pairs.push(row);
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

/// The dead letter of a row (or pair) that cannot be read as an event.
fn unreadable(id: Uuid, destination: Option<String>, reason: &str) -> FailedRow {
    FailedRow {
        id,
        error: truncate(format!(
            "cannot relay this row: {reason} [dead: unreadable row]"
        )),
        destination,
        delay_secs: 0.0,
        dead: true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::outcome::Outcome;
    use crate::model::retry::RetryPolicy;
    use crate::route::{Dispatch, Item};
    use crate::sinks::gate::Counted;
    use chrono::Utc;
    use serde_json::value::RawValue;
    use std::time::Duration;

    fn event(attempts: i32) -> OutboxEvent {
        OutboxEvent {
            id: Uuid::new_v4(),
            seq: 1,
            topic: "order.created".into(),
            key: None,
            payload: RawValue::from_string("{}".into()).expect("json"),
            headers: vec![],
            created_at: Utc::now(),
            attempts,
        }
    }

    use crate::settle::testing::OneLane;

    #[test]
    fn outcomes_become_one_plan() {
        let policy = RetryPolicy {
            schedule: vec![Duration::from_secs(1), Duration::from_secs(30)],
            max_attempts: Some(3),
            max_age: None,
            jitter: 0.0,
        };
        let events = [event(0), event(0), event(2), event(0), event(0)];
        let outcomes = [
            Some(Outcome::Delivered),
            Some(Outcome::retry("HTTP 503")),
            Some(Outcome::retry("HTTP 503")),
            Some(Outcome::Rejected {
                reason: "HTTP 400: bad".into(),
            }),
            None,
        ];
        let attempts = outcomes
            .iter()
            .enumerate()
            .map(|(e, outcome)| match outcome {
                Some(o) => (
                    Item {
                        event: e,
                        lane: Some(0),
                        dispatch: Dispatch::Send,
                    },
                    Attempt::Answered(o.clone(), Counted::Attempt),
                ),
                None => (
                    Item {
                        event: e,
                        lane: None,
                        dispatch: Dispatch::Unroutable,
                    },
                    Attempt::Unroutable,
                ),
            })
            .collect();
        let lanes = OneLane(policy);
        let spans = (0..events.len()).map(|e| e..e + 1).collect();
        let attempts = Attempts {
            list: attempts,
            spans,
        };
        let lease = Lease {
            token: Uuid::nil(),
            length: Duration::ZERO,
        };
        let batch = Batch {
            events: &events,
            poison: &[],
            cut_off: &[],
            origin: Origin::Claimed,
            lease,
        };
        let plan = Planned::batch(&batch, attempts, &lanes)
            .expect("planned")
            .plan;
        assert_eq!(plan.delivered["billing"], vec![events[0].id]);
        assert_eq!(plan.failed.len(), 4);
        assert_eq!(
            (plan.failed[0].dead, plan.failed[0].delay_secs),
            (false, 1.0)
        );
        assert!(plan.failed[1].dead, "third attempt of max 3 dead-letters");
        assert!(plan.failed[2].dead && plan.failed[2].error.contains("HTTP 400: bad"));
        assert!(plan.failed[3].dead && plan.failed[3].error.contains("no destination"));
        assert_eq!(
            (
                plan.delivered_count(),
                plan.retry_count(),
                plan.dead_count()
            ),
            (1, 1, 3)
        );
    }
}
