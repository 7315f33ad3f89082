//! A settle plan: what one settle writes, gathered from its pairs' verdicts.
//!
//! An event settled on its own row ([`SettlePlan::single`]) becomes delivered, failed or held in
//! one statement each for the whole batch; a split event (several destinations, or a pair that
//! must go on alone) has its row settled and each undelivered pair written to the deliveries
//! table ([`SettlePlan::pair`]) in the same statement. A batch of pairs claimed from the
//! deliveries table is planned the same way, pair by pair with [`SettlePlan::single`].

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use rand::Rng;
use uuid::Uuid;

use super::verdict::{truncate, verdict, Attempt, Pair, Verdict};
use crate::gate::Counted;
use crate::model::event::OutboxEvent;
use crate::model::outcome::Outcome;
use crate::model::retry::RetryPolicy;
use crate::store::deliveries::PairRow;
use crate::store::held_batches::HeldBatch;
use crate::store::outbox::FailedRow;
use crate::store::waiting::HeldRow;

/// What a batch's settle writes.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct SettlePlan {
    /// Delivered event ids (or pairs, in a deliveries batch), per destination name.
    pub delivered: BTreeMap<String, Vec<Uuid>>,
    /// Failures, retried or dead.
    pub failed: Vec<FailedRow>,
    /// Events held for their destination.
    pub held: Vec<HeldRow>,
    /// Split events: settled, their undelivered pairs going to the deliveries table.
    pub fanned: Vec<Uuid>,
    /// The undelivered pairs of the split events.
    pub pairs: Vec<PairRow>,
    /// The split events' delivered pairs, per destination (metrics; nothing to write).
    pub pairs_delivered: BTreeMap<String, Vec<Uuid>>,
    /// Held pairs of split events written in bulk: one held batch per destination instead of a
    /// row each. Only pairs that need no per-key order.
    pub bundles: Vec<HeldBatch>,
    /// The lease token of pairs handed over with their request still out.
    pub in_flight: Option<Uuid>,
    /// Delivered events that have no table row (WAL `emit()` messages): counted, never written.
    pub rowless: std::collections::HashSet<Uuid>,
    /// WAL: the delivered rows are not written with the rest of the plan but handed back
    /// ([`SettlePlan::delivered_rows`]) and written later with other batches'
    /// ([`super::write_delivered`]).
    pub defer_delivered: bool,
}

/// Rows that WAL batches delivered everywhere, per destination, gathered from several batches to be
/// deleted (or marked published) in one statement per destination: a slot's events each cost one
/// row write instead of one settle transaction per batch (see `wal::Confirmer`).
#[derive(Debug, Default, Clone, PartialEq)]
pub struct DeliveredRows(pub(crate) BTreeMap<String, Vec<Uuid>>);

impl DeliveredRows {
    /// How many rows.
    pub fn len(&self) -> usize {
        self.0.values().map(Vec::len).sum()
    }

    /// No rows.
    pub fn is_empty(&self) -> bool {
        self.0.values().all(Vec::is_empty)
    }

    /// Adds `other`'s rows.
    pub fn append(&mut self, other: DeliveredRows) {
        for (destination, mut ids) in other.0 {
            self.0.entry(destination).or_default().append(&mut ids);
        }
    }
}

/// How long a pair handed over with its request still out is leased to the batch that sent it.
#[derive(Debug, Clone, Copy)]
pub struct InFlightLease(pub Duration);

impl SettlePlan {
    /// The delivered events that have a row, for [`super::write_delivered`].
    pub fn delivered_rows(&self) -> DeliveredRows {
        DeliveredRows(
            self.delivered
                .iter()
                .map(|(destination, ids)| {
                    let ids = ids.iter().filter(|id| !self.rowless.contains(id));
                    (destination.clone(), ids.copied().collect::<Vec<_>>())
                })
                .filter(|(_, ids)| !ids.is_empty())
                .collect(),
        )
    }

    /// Nothing for [`super::apply`] to write (delivered rows aside when they are deferred).
    pub(crate) fn writes_nothing(&self) -> bool {
        (self.defer_delivered || self.delivered_rows().is_empty())
            && self.failed.is_empty()
            && self.held.is_empty()
            && self.fanned.iter().all(|id| self.rowless.contains(id))
    }

    /// Number of delivered events.
    pub fn delivered_count(&self) -> usize {
        self.delivered.values().map(Vec::len).sum()
    }

    /// Number of events dead-lettered by this plan.
    pub fn dead_count(&self) -> usize {
        self.failed.iter().filter(|f| f.dead).count()
    }

    /// Number of events scheduled for another attempt.
    pub fn retry_count(&self) -> usize {
        self.failed.len() - self.dead_count()
    }

    /// Records the verdict of an event settled on its own row (or of a pair claimed from the
    /// deliveries table, settled on its pair row): delivered, failed or held. Returns `false`
    /// when nothing is written for it: it is given back as it was (the caller releases it).
    pub fn single(&mut self, event: &OutboxEvent, destination: Option<&str>, v: Verdict) -> bool {
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
    pub fn pair(
        &mut self,
        event: &OutboxEvent,
        destination: &str,
        v: Verdict,
        lease: InFlightLease,
    ) {
        if matches!(v, Verdict::Delivered) {
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
        let mut row = PairRow {
            event_id: event.id,
            destination: destination.to_owned(),
            attempts: event.attempts,
            delay_secs: 0.0,
            error: None,
            dead: false,
            held: false,
            failed: false,
            leased: false,
        };
        match v {
            Verdict::Delivered => return,
            Verdict::Failed(f) => {
                row.attempts += i32::from(f.counted);
                row.delay_secs = f.delay_secs;
                row.error = Some(f.error);
                row.dead = f.dead;
                row.failed = true;
            }
            Verdict::Held(note) => {
                row.held = true;
                row.error = note;
            }
            Verdict::Waiting(note) => row.error = note.map(truncate),
            Verdict::InFlight => {
                row.leased = true;
                row.delay_secs = lease.0.as_secs_f64();
            }
        }
        self.pairs.push(row);
    }

    /// Dead-letters a row the relay could not read (a poison row), with the reason.
    pub fn poison(&mut self, id: Uuid, reason: &str) {
        self.failed.push(unreadable(id, None, reason));
    }

    /// Dead-letters a pair of the deliveries table that cannot be read as an event.
    pub fn poison_pair(&mut self, id: Uuid, destination: &str, reason: &str) {
        self.failed
            .push(unreadable(id, Some(destination.to_owned()), reason));
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

/// The destination an event was routed to, with its policy; `None` for an unroutable event.
pub type Routed<'a> = Option<(&'a str, &'a RetryPolicy)>;

/// Turns the answers of events that were each sent to one destination (or to none) into writes.
pub fn plan<'a>(
    answered: impl IntoIterator<Item = (&'a OutboxEvent, Routed<'a>, &'a Outcome)>,
    now: DateTime<Utc>,
    rng: &mut impl Rng,
) -> SettlePlan {
    let mut plan = SettlePlan::default();
    for (event, destination, outcome) in answered {
        let attempt = match destination {
            Some(_) => Attempt::Answered(outcome, Counted::Attempt),
            None => Attempt::Unroutable,
        };
        let v = verdict(Pair { event, destination }, attempt, now, rng);
        plan.single(event, destination.map(|(d, _)| d), v);
    }
    plan
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::SeedableRng;
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

    #[test]
    fn outcomes_become_one_plan() {
        let policy = RetryPolicy {
            schedule: vec![Duration::from_secs(1), Duration::from_secs(30)],
            max_attempts: Some(3),
            max_age: None,
            jitter: 0.0,
        };
        let events = [event(0), event(0), event(2), event(0), event(0)];
        let route = Some(("billing", &policy));
        let routes = vec![route, route, route, route, None];
        let outcomes = vec![
            Outcome::Delivered,
            Outcome::retry("HTTP 503"),
            Outcome::retry("HTTP 503"),
            Outcome::Rejected {
                reason: "HTTP 400: bad".into(),
            },
            Outcome::Delivered,
        ];
        let attempted = events
            .iter()
            .zip(routes)
            .zip(&outcomes)
            .map(|((e, r), o)| (e, r, o));
        let plan = plan(attempted, Utc::now(), &mut StdRng::seed_from_u64(1));
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
