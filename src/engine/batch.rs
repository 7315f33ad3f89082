//! A batch being published: its items, the slot each item's outcome goes into as soon as its
//! destination answers, and each lane's budget in the batch.
//!
//! While the lanes publish, the engine watches them ([`Watch`]) and decides in one pure function
//! ([`lagging`]) which lanes to hand over: a lane that has not finished when another lane of the
//! batch has, within as long again as that lane took (and at least [`MIN_LINGER`]), or a lane
//! whose last few requests stalled. A lane handed over stops starting requests; the batch
//! settles without waiting for it, its unsent items and its requests still out becoming pairs of
//! the deliveries table.

use std::time::Duration;

use tokio::time::Instant;

use super::items::{Dispatch, Items};
use super::lane::Lane;
use crate::gate::Counted;
use crate::model::event::OutboxEvent;
use crate::model::outcome::Outcome;
use crate::sinks::{Budget, Slot};

/// How often a batch looks at its lanes' progress.
pub(super) const WATCH_EVERY: Duration = Duration::from_millis(10);

/// The least a lane that is behind is waited for once another lane of its batch finished: a
/// destination a little slower than another is not handed over for a few milliseconds.
pub(super) const MIN_LINGER: Duration = Duration::from_millis(50);

/// How long a lane's last answer must be past before its last few unanswered items count as
/// stalled (a request that hangs, a slow answer).
pub(super) const STRAGGLER_PATIENCE: Duration = Duration::from_millis(200);

/// One lane's progress in a batch, as [`lagging`] sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) struct LaneProgress {
    /// Items it has to publish in the batch.
    pub(super) items: usize,
    /// Items answered so far.
    pub(super) answered: usize,
    /// When its last item was answered (all of them).
    pub(super) done_at: Option<Instant>,
    /// When its last answer came.
    pub(super) last_answer_at: Option<Instant>,
}

impl LaneProgress {
    fn done(&self) -> bool {
        self.items > 0 && self.answered == self.items
    }

    fn unfinished(&self) -> bool {
        self.answered < self.items
    }
}

/// The lanes of a batch (started at `started`) to hand over at `now`: the unfinished ones, once
/// another lane finished and they have had as long again as it took (at least [`MIN_LINGER`]);
/// and a lane whose few remaining items (at most one in twenty) have had no answer for
/// [`STRAGGLER_PATIENCE`].
pub(super) fn lagging(lanes: &[LaneProgress], started: Instant, now: Instant) -> Vec<usize> {
    let first_done = lanes
        .iter()
        .filter(|l| l.done())
        .filter_map(|l| l.done_at)
        .min();
    let behind = first_done.is_some_and(|done| {
        let linger = done.saturating_duration_since(started).max(MIN_LINGER);
        now >= done + linger
    });
    (0..lanes.len())
        .filter(|&d| {
            let l = &lanes[d];
            if !l.unfinished() {
                return false;
            }
            let left = l.items - l.answered;
            let stalled = l.answered > 0
                && left <= (l.items / 20).max(1)
                && l.last_answer_at
                    .is_some_and(|t| now.saturating_duration_since(t) >= STRAGGLER_PATIENCE);
            behind || stalled
        })
        .collect()
}

/// One batch being published.
pub(super) struct Run<'a> {
    /// The batch's events.
    pub(super) events: &'a [OutboxEvent],
    /// Its items.
    pub(super) items: &'a Items,
    /// Per item: its outcome once answered, and whether its request started.
    pub(super) slots: Vec<Slot>,
    /// Per lane: its budget in this batch.
    pub(super) budgets: Vec<Budget>,
    /// When publishing began.
    pub(super) started: Instant,
}

impl<'a> Run<'a> {
    /// A batch of `items` over `lanes` lanes, publishing until `deadline`.
    pub(super) fn new(
        events: &'a [OutboxEvent],
        items: &'a Items,
        lanes: usize,
        deadline: Instant,
    ) -> Self {
        Self {
            events,
            items,
            slots: items.list.iter().map(|_| Slot::default()).collect(),
            budgets: (0..lanes).map(|_| Budget::until(deadline)).collect(),
            started: Instant::now(),
        }
    }

    /// A probe's run: its one item goes whatever the breaker says.
    pub(super) fn probe(
        events: &'a [OutboxEvent],
        items: &'a Items,
        lanes: usize,
        deadline: Instant,
    ) -> Self {
        Self {
            budgets: (0..lanes).map(|_| Budget::probe(deadline)).collect(),
            ..Self::new(events, items, lanes, deadline)
        }
    }

    /// The event of item `i`.
    pub(super) fn event(&self, i: usize) -> &'a OutboxEvent {
        &self.events[self.items.list[i].event]
    }

    /// Stops the lanes `lanes`: none of their requests starts from now on.
    pub(super) fn stop(&self, lanes: &[usize], gates: &[Lane]) {
        for &d in lanes {
            self.budgets[d].stop();
            gates[d].gate.wake();
        }
    }

    /// Which lanes have stopped.
    pub(super) fn stopped(&self) -> Vec<bool> {
        self.budgets.iter().map(Budget::is_stopped).collect()
    }

    /// The answers so far, and which items' requests started.
    pub(super) fn snapshot(&self) -> (Vec<Option<(Outcome, Counted)>>, Vec<bool>) {
        (
            self.slots.iter().map(|s| s.answer().cloned()).collect(),
            self.slots.iter().map(Slot::started).collect(),
        )
    }

    /// The answers at the end. A lane that started requests and got no answer at all within the
    /// whole budget is not making progress: its unanswered requests count as failed (counted on
    /// its breaker), or it would be retried at no cost forever — unless shutdown cut the batch
    /// short or the lane was handed over.
    pub(super) fn finish(
        &self,
        aborted: bool,
        lanes: &[Lane],
        publish_timeout: Duration,
    ) -> (Vec<Option<(Outcome, Counted)>>, Vec<bool>) {
        let (mut answers, started) = self.snapshot();
        let stopped = self.stopped();
        let mine = |d: usize| {
            let items = &self.items.list;
            (0..items.len())
                .filter(move |&i| items[i].lane == Some(d) && items[i].dispatch == Dispatch::Send)
        };
        let stalled = (0..lanes.len()).filter(|&d| {
            !aborted
                && !stopped[d]
                && mine(d).any(|i| started[i])
                && mine(d).all(|i| answers[i].is_none())
        });
        for d in stalled.collect::<Vec<_>>() {
            for i in mine(d).filter(|&i| started[i]) {
                let outcome = Outcome::retry(format!(
                    "no answer within publish_timeout ({})",
                    humantime::format_duration(publish_timeout)
                ));
                let counted = lanes[d].gate.answered(&outcome);
                answers[i] = Some((outcome, counted));
            }
        }
        (answers, started)
    }
}

/// What a batch has seen of its lanes, kept up to date at each look ([`Watch::look`]).
pub(super) struct Watch {
    lanes: Vec<LaneProgress>,
}

impl Watch {
    /// The watch of `run` over `lanes` lanes.
    pub(super) fn new(run: &Run<'_>, lanes: usize) -> Self {
        let mut progress = vec![LaneProgress::default(); lanes];
        for i in run.items.sendable() {
            if let Some(d) = run.items.list[i].lane {
                progress[d].items += 1;
            }
        }
        Self { lanes: progress }
    }

    /// Updates the lanes' progress from `run`'s slots at `now`.
    pub(super) fn look(&mut self, run: &Run<'_>, now: Instant) {
        let mut answered = vec![0; self.lanes.len()];
        for i in run.items.sendable() {
            if let (Some(d), Some(_)) = (run.items.list[i].lane, run.slots[i].answer()) {
                answered[d] += 1;
            }
        }
        for (lane, n) in self.lanes.iter_mut().zip(answered) {
            if n != lane.answered {
                lane.answered = n;
                lane.last_answer_at = Some(now);
                if lane.done() {
                    lane.done_at = Some(now);
                }
            }
        }
    }

    /// Whether some lane finished while another has not.
    pub(super) fn some_lane_behind(&self) -> bool {
        self.lanes.iter().any(LaneProgress::done) && self.lanes.iter().any(LaneProgress::unfinished)
    }

    /// The lanes to hand over now (see [`lagging`]).
    pub(super) fn lagging(&self, started: Instant, now: Instant) -> Vec<usize> {
        lagging(&self.lanes, started, now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(start: Instant, ms: u64) -> Instant {
        start + Duration::from_millis(ms)
    }

    fn lane(
        items: usize,
        answered: usize,
        done_ms: Option<u64>,
        last_ms: Option<u64>,
        t0: Instant,
    ) -> LaneProgress {
        LaneProgress {
            items,
            answered,
            done_at: done_ms.map(|ms| at(t0, ms)),
            last_answer_at: last_ms.map(|ms| at(t0, ms)),
        }
    }

    /// (lanes as (items, answered, done at, last answer at), now) → lanes handed over.
    #[test]
    fn lagging_table() {
        let t0 = Instant::now();
        let l = |items, answered, done, last| lane(items, answered, done, last, t0);
        let cases: Vec<(Vec<LaneProgress>, u64, Vec<usize>)> = vec![
            // Every lane done: nothing to hand over.
            (
                vec![l(10, 10, Some(5), Some(5)), l(10, 10, Some(8), Some(8))],
                100,
                vec![],
            ),
            // One lane alone, still going (not stalled): wait, whatever the time.
            (vec![l(100, 40, None, Some(990))], 1_000, vec![]),
            // A fast lane done at 5 ms: the slow one gets MIN_LINGER (50 ms) from then.
            (
                vec![l(10, 10, Some(5), Some(5)), l(10, 2, None, Some(30))],
                40,
                vec![],
            ),
            (
                vec![l(10, 10, Some(5), Some(5)), l(10, 2, None, Some(30))],
                55,
                vec![1],
            ),
            // A lane done at 300 ms: the other gets as long again, 300 ms.
            (
                vec![l(10, 10, Some(300), Some(300)), l(10, 9, None, Some(400))],
                590,
                vec![],
            ),
            (
                vec![l(10, 10, Some(300), Some(300)), l(10, 9, None, Some(550))],
                600,
                vec![1],
            ),
            // A lane with no items to publish (all held or filtered) is neither done nor behind.
            (
                vec![l(0, 0, None, None), l(10, 3, None, Some(10))],
                1_000,
                vec![],
            ),
            // Stragglers: one of forty left, no answer for 200 ms.
            (vec![l(40, 39, None, Some(100))], 250, vec![]),
            (vec![l(40, 39, None, Some(100))], 300, vec![0]),
            // Too many left to be stragglers.
            (vec![l(40, 30, None, Some(100))], 5_000, vec![]),
            // Nothing answered yet: not stalled, the budget decides.
            (vec![l(10, 0, None, None)], 5_000, vec![]),
            // Two slow lanes behind a fast one: both handed over.
            (
                vec![
                    l(5, 5, Some(2), Some(2)),
                    l(5, 1, None, Some(3)),
                    l(5, 0, None, None),
                ],
                60,
                vec![1, 2],
            ),
        ];
        for (i, (lanes, now, expected)) in cases.iter().enumerate() {
            assert_eq!(&lagging(lanes, t0, at(t0, *now)), expected, "case {i}");
        }
    }
}
