//! What a sink is handed besides its events: a [`Share`] of one lane's work — when it must be
//! done by, where each event's outcome goes as soon as it is known, and the destination's
//! [`Gate`], which every request passes.
//!
//! A request starts only through [`Share::admit`]: it waits for room under the destination's
//! `concurrency` (for the whole process), and gives up when the budget is over, when the
//! destination's breaker opened or it was paused meanwhile, or when the engine stopped this share
//! (it handed the rest over to the deliveries table). Each outcome is counted on the breaker the
//! moment it is recorded, so a failing destination stops being sent to mid-batch.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use tokio::time::Instant;

use super::gate::{Counted, Gate, Permit};
use crate::model::outcome::Outcome;

/// Time kept between a request's own timeout and the budget's deadline, so that a request cut by
/// its own timeout reports an outcome before the engine stops waiting for it.
const DEADLINE_SLACK: Duration = Duration::from_millis(50);

/// How long one lane's part of a batch may take and whether it may still start requests: the
/// batch's deadline (its claim time plus `publish_timeout`), shared by every publish of that lane
/// in the batch (chain steps too).
#[derive(Debug)]
pub struct Budget {
    deadline: Instant,
    started: AtomicBool,
    stopped: AtomicBool,
    probe: bool,
}

impl Budget {
    /// A budget ending at `deadline`.
    pub fn until(deadline: Instant) -> Self {
        Self {
            deadline,
            started: AtomicBool::new(false),
            stopped: AtomicBool::new(false),
            probe: false,
        }
    }

    /// The budget of a probe: its one request goes whatever the breaker says.
    pub fn probe(deadline: Instant) -> Self {
        Self {
            probe: true,
            ..Self::until(deadline)
        }
    }

    /// A fresh budget like this one: the same deadline, nothing started or stopped yet.
    pub fn copy(&self) -> Self {
        Self {
            probe: self.probe,
            ..Self::until(self.deadline)
        }
    }

    /// When the engine stops waiting.
    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    /// Whether the deadline has passed or the share was stopped.
    pub fn is_over(&self) -> bool {
        self.stopped.load(Ordering::Acquire) || Instant::now() >= self.deadline
    }

    /// No request starts from now on (the engine hands what is left over).
    pub fn stop(&self) {
        self.stopped.store(true, Ordering::Release);
    }

    /// Whether [`Budget::stop`] was called.
    pub fn is_stopped(&self) -> bool {
        self.stopped.load(Ordering::Acquire)
    }

    /// How long a request started now may last: up to just before the deadline.
    pub fn request_limit(&self, own_timeout: Duration) -> Duration {
        let left = self
            .deadline
            .saturating_duration_since(Instant::now())
            .saturating_sub(DEADLINE_SLACK)
            .max(Duration::from_millis(1));
        own_timeout.min(left)
    }

    /// Whether a request expected to take `expected` may start now, by the clock: only if it
    /// should end before the deadline (with half again as much to spare), so that the receiver
    /// is not sent what the engine would stop waiting for and send again. The budget's first
    /// request always may: a destination slower than `publish_timeout` still gets one event per
    /// batch (and its timeout).
    fn in_time(&self, expected: Duration) -> bool {
        let now = Instant::now();
        if now >= self.deadline {
            return false;
        }
        !self.started.load(Ordering::Relaxed) || now + expected.mul_f64(1.5) <= self.deadline
    }
}

/// One item's outcome, with how its destination's breaker counted it, and whether its request
/// started.
#[derive(Debug, Default)]
pub struct Slot {
    answer: OnceLock<(Outcome, Counted)>,
    /// When its request started (the breaker tells an outage's late failures by it).
    started_at: OnceLock<std::time::Instant>,
}

impl Slot {
    /// The outcome and how it counted, once recorded.
    pub fn answer(&self) -> Option<&(Outcome, Counted)> {
        self.answer.get()
    }

    /// The outcome, once recorded.
    pub fn outcome(&self) -> Option<&Outcome> {
        self.answer.get().map(|(o, _)| o)
    }

    /// Whether its request started (it may be in flight).
    pub fn started(&self) -> bool {
        self.started_at.get().is_some()
    }
}

/// A sink's view of one publish call: its events' slots in the lane's batch, the lane's budget in
/// that batch, and the destination's gate.
pub struct Share<'a> {
    gate: &'a Gate,
    budget: &'a Budget,
    slots: &'a [Slot],
    at: &'a [usize],
}

impl<'a> Share<'a> {
    /// A share whose `i`-th event writes into `slots[at[i]]`.
    pub fn new(gate: &'a Gate, budget: &'a Budget, slots: &'a [Slot], at: &'a [usize]) -> Self {
        Self {
            gate,
            budget,
            slots,
            at,
        }
    }

    /// When the engine stops waiting for this share.
    pub fn deadline(&self) -> Instant {
        self.budget.deadline()
    }

    fn slot(&self, i: usize) -> Option<&'a Slot> {
        self.at.get(i).and_then(|&g| self.slots.get(g))
    }

    /// Waits until the call's `i`-th event may be sent, expecting its request to take `expected`;
    /// `None` when it must not be sent now (the budget is over or stopped, or the destination is
    /// held). The permit holds the request's place under `concurrency`: drop it once the outcome
    /// is recorded.
    pub async fn admit(&self, i: usize, expected: Duration) -> Option<Permit<'a>> {
        loop {
            let changed = self.gate.changed();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if self.budget.is_stopped() || !self.budget.in_time(expected) {
                return None;
            }
            if let Some(permit) = self.gate.try_admit(self.budget.probe) {
                self.budget.started.store(true, Ordering::Relaxed);
                if let Some(slot) = self.slot(i) {
                    let _ = slot.started_at.set(std::time::Instant::now());
                }
                return Some(permit);
            }
            if !self.gate.is_open() {
                return None;
            }
            tokio::select! {
                _ = &mut changed => {}
                _ = tokio::time::sleep_until(self.budget.deadline) => return None,
            }
        }
    }

    /// [`Share::admit`] for the whole call at once (sinks that publish a batch in one go): every
    /// event counts as started when it returns a permit.
    pub async fn admit_all(&self) -> Option<Permit<'a>> {
        let permit = self.admit(0, Duration::ZERO).await?;
        let now = std::time::Instant::now();
        for i in 0..self.at.len() {
            if let Some(slot) = self.slot(i) {
                let _ = slot.started_at.set(now);
            }
        }
        Some(permit)
    }

    /// Records the outcome of the call's `i`-th event, counting it on the destination's breaker;
    /// the first outcome recorded for it stands.
    pub fn record(&self, i: usize, outcome: Outcome) {
        self.record_as(i, outcome, true);
    }

    /// Records the failure of the call's `i`-th event whose request timed out: counted on the
    /// breaker as [`Share::record`] does, but the destination did not answer, so it stays silent
    /// ([`Gate::timed_out`]).
    pub fn record_timeout(&self, i: usize, outcome: Outcome) {
        self.record_as(i, outcome, false);
    }

    fn record_as(&self, i: usize, outcome: Outcome, heard: bool) {
        let Some(slot) = self.slot(i) else { return };
        if slot.answer.get().is_some() {
            return;
        }
        let started = slot.started_at.get().copied();
        let counted = if heard {
            self.gate.answered_to(&outcome, started)
        } else {
            self.gate.timed_out(&outcome, started)
        };
        let _ = slot.answer.set((outcome, counted));
    }

    /// Records the outcomes of one call that carried several of the share's events (a batch API
    /// call), by position: the destination answered once, so its breaker counts one answer
    /// ([`call_answer`]), and each event's failure counts as that answer did (held when the
    /// breaker was already open). The first outcome recorded for an event stands.
    pub fn record_call(&self, outcomes: Vec<(usize, Outcome)>) {
        let fresh: Vec<(usize, Outcome)> = outcomes
            .into_iter()
            .filter(|(i, _)| !self.has(*i))
            .collect();
        let Some(answer) = call_answer(fresh.iter().map(|(_, o)| o)) else {
            return;
        };
        let started = fresh
            .iter()
            .filter_map(|(i, _)| self.slot(*i).and_then(|s| s.started_at.get().copied()))
            .min();
        let counted = self.gate.answered_to(answer, started);
        for (i, outcome) in fresh {
            let counted = match outcome {
                Outcome::Retry { .. } => counted,
                Outcome::Delivered | Outcome::Rejected { .. } => Counted::Attempt,
            };
            self.set(i, outcome, counted);
        }
    }

    /// Records the outcome of the call's `i`-th event, which was not sent (an earlier event of its
    /// key failed, its transform failed): the destination was not asked, so its breaker does not
    /// count it.
    pub fn record_unsent(&self, i: usize, outcome: Outcome) {
        self.set(i, outcome, Counted::Attempt);
    }

    /// Dead-letters the call's `i`-th event without sending it (its transform failed).
    pub fn refuse(&self, i: usize, reason: String) {
        self.record_unsent(i, Outcome::Rejected { reason });
    }

    fn set(&self, i: usize, outcome: Outcome, counted: Counted) {
        if let Some(slot) = self.slot(i) {
            let _ = slot.answer.set((outcome, counted));
        }
    }

    /// Whether the call's `i`-th event has an outcome.
    pub fn has(&self, i: usize) -> bool {
        self.slot(i).is_some_and(|s| s.answer.get().is_some())
    }

    /// How many events the call has.
    pub fn len(&self) -> usize {
        self.at.len()
    }

    /// Whether the call has no event.
    pub fn is_empty(&self) -> bool {
        self.at.is_empty()
    }

    /// How long a request started now may last (see [`Budget::request_limit`]).
    pub fn request_limit(&self, own_timeout: Duration) -> Duration {
        self.budget.request_limit(own_timeout)
    }
}

/// The one answer a call carrying several events gives its destination's breaker: delivered if
/// any of them was (the destination is up), else failed if any is to be retried, else rejected
/// (which proves it up too); `None` for a call with no event.
pub fn call_answer<'o>(outcomes: impl IntoIterator<Item = &'o Outcome>) -> Option<&'o Outcome> {
    let mut answer: Option<&Outcome> = None;
    for outcome in outcomes {
        let rank = |o: &Outcome| match o {
            Outcome::Delivered => 2,
            Outcome::Retry { .. } => 1,
            Outcome::Rejected { .. } => 0,
        };
        if answer.is_none_or(|a| rank(outcome) > rank(a)) {
            answer = Some(outcome);
        }
    }
    answer
}

/// A moving average of a destination's request latency, for [`Share::admit`].
#[derive(Debug, Default)]
pub struct Latency {
    micros: AtomicU64,
}

impl Latency {
    /// Records one request's duration (exponentially weighted: recent requests count most).
    pub fn observe(&self, took: Duration) {
        let sample = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
        let old = self.micros.load(Ordering::Relaxed);
        let new = if old == 0 {
            sample
        } else {
            (old / 5).saturating_mul(4).saturating_add(sample / 5)
        };
        self.micros.store(new.max(1), Ordering::Relaxed);
    }

    /// The current estimate (zero before the first request).
    pub fn estimate(&self) -> Duration {
        Duration::from_micros(self.micros.load(Ordering::Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::breaker::BreakerPolicy;
    use crate::sinks::gate::BreakerState;

    #[tokio::test]
    async fn a_share_waits_for_room_under_concurrency_and_stops_when_told() {
        let gate = Gate::new("d", BreakerPolicy::default(), Some(1));
        let budget = Budget::until(Instant::now() + Duration::from_secs(5));
        let slots: Vec<Slot> = (0..3).map(|_| Slot::default()).collect();
        let at = [0, 1, 2];
        let share = Share::new(&gate, &budget, &slots, &at);
        // A delivery proves the destination: concurrency (1) is then the only limit.
        let first = share.admit(0, Duration::ZERO).await.expect("room");
        share.record(0, Outcome::Delivered);
        assert!(slots[0].started() && share.has(0));
        let second = async {
            let p = share.admit(1, Duration::ZERO).await;
            (p.is_some(), slots[1].started())
        };
        let release = async {
            tokio::time::sleep(Duration::from_millis(20)).await;
            assert!(!slots[1].started(), "waits while the one slot is taken");
            drop(first);
        };
        let ((admitted, started), ()) = tokio::join!(second, release);
        assert!(admitted && started);
        budget.stop();
        assert!(share.admit(2, Duration::ZERO).await.is_none());
        assert!(!slots[2].started());
    }

    #[test]
    fn a_call_is_one_answer() {
        let (ok, retry, no) = (
            Outcome::Delivered,
            Outcome::retry("503"),
            Outcome::Rejected {
                reason: "too big".into(),
            },
        );
        // outcomes of one call's events → the one answer its breaker counts
        let cases: &[(&[&Outcome], Option<&Outcome>)] = &[
            (&[], None),
            (&[&retry, &retry, &retry], Some(&retry)),
            (&[&retry, &ok, &retry], Some(&ok)),
            (&[&no, &retry], Some(&retry)),
            (&[&no, &no], Some(&no)),
        ];
        for (outcomes, expected) in cases {
            assert_eq!(
                call_answer(outcomes.iter().copied()),
                *expected,
                "{outcomes:?}"
            );
        }
    }

    #[tokio::test]
    async fn a_failed_call_of_ten_events_counts_one_failure() {
        let policy = BreakerPolicy {
            failures: 3,
            ..BreakerPolicy::default()
        };
        let gate = Gate::new("d", policy.clone(), None);
        let budget = Budget::until(Instant::now() + Duration::from_secs(5));
        let slots: Vec<Slot> = (0..30).map(|_| Slot::default()).collect();
        let at: Vec<usize> = (0..30).collect();
        let share = Share::new(&gate, &budget, &slots, &at);
        let failed = |from: usize| {
            (from..from + 10)
                .map(|i| (i, Outcome::retry("500")))
                .collect()
        };
        share.record_call(failed(0));
        share.record_call(failed(10));
        let breaker = |gate: &Gate| gate.state().0;
        assert_eq!(
            breaker(&gate),
            BreakerState::Closed,
            "two failed calls are two failures, not twenty"
        );
        assert!(slots[..20]
            .iter()
            .all(|s| matches!(s.answer(), Some((Outcome::Retry { .. }, Counted::Attempt)))));
        share.record_call(failed(20));
        assert_eq!(
            breaker(&gate),
            BreakerState::Open,
            "the third failed call opens the breaker"
        );
        // Events held back behind their key's failure were never sent: no answer at all.
        let gate = Gate::new("d", policy.clone(), None);
        let slots: Vec<Slot> = (0..30).map(|_| Slot::default()).collect();
        let share = Share::new(&gate, &budget, &slots, &at);
        for i in 0..30 {
            share.record_unsent(i, Outcome::retry("an earlier event of its key failed"));
        }
        assert_eq!(breaker(&gate), BreakerState::Closed);
        assert!(slots.iter().all(|s| s.outcome().is_some()));
    }

    #[tokio::test]
    async fn a_request_that_cannot_end_in_time_does_not_start_but_the_first_always_does() {
        let gate = Gate::new("d", BreakerPolicy::default(), None);
        let budget = Budget::until(Instant::now() + Duration::from_millis(100));
        let slots: Vec<Slot> = (0..2).map(|_| Slot::default()).collect();
        let at = [0, 1];
        let share = Share::new(&gate, &budget, &slots, &at);
        let slow = Duration::from_secs(1);
        assert!(
            share.admit(0, slow).await.is_some(),
            "the first request goes"
        );
        assert!(
            share.admit(1, slow).await.is_none(),
            "the next would outlive the budget"
        );
    }
}
