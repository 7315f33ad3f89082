//! Watching a batch while its lanes publish: waiting for the publish, for shutdown, or for lanes
//! to hand over ([`drive`]).
//!
//! The watch ([`Watch`]) decides in one pure function ([`lagging`]) which lanes to hand over: a
//! lane that has not finished when another lane of the batch has, within as long again as that
//! lane took (and at least [`MIN_LINGER`]), a lane whose last few requests stalled, or a lane
//! that has had no answer for [`SILENCE`], or whose destination has not answered anyone for that
//! long, alone in its batch or not. A destination that accepts requests and never answers would
//! otherwise hold each batch with an event for it, and its claim loop, until the batch's budget
//! ends, while the other destinations' events wait behind it; once it is known silent, its lanes
//! are handed over at the first look. A lane
//! handed over stops starting requests; the batch settles without waiting for it, its unsent
//! items and its requests still out becoming pairs of the deliveries table. And as soon as one
//! lane of the batch is done while another is not, or once the batch has run
//! [`STRAGGLER_PATIENCE`], the claim loop may go on to its next batch ([`may_detach`]).

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::route::Items;

/// How often a batch looks at its lanes' progress.
const WATCH_EVERY: Duration = Duration::from_millis(10);

/// How long past the batch's deadline a pair (or row) handed over with its request out stays
/// leased to the batch: the request ends by the deadline, and its settle needs a moment.
const IN_FLIGHT_MARGIN: Duration = Duration::from_secs(5);

/// How long what a batch with budget until `deadline` hands over with its request out stays
/// leased to it.
pub(super) fn in_flight_lease(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now()) + IN_FLIGHT_MARGIN
}

/// The least a lane that is behind is waited for once another lane of its batch finished: a
/// destination a little slower than another is not handed over for a few milliseconds.
const MIN_LINGER: Duration = Duration::from_millis(50);

/// How long a lane's last answer must be past before its last few unanswered items count as
/// stalled (a request that hangs, a slow answer).
const STRAGGLER_PATIENCE: Duration = Duration::from_millis(200);

/// How long a lane may go without an answer (since the batch began, or since its last answer)
/// before it is handed over, whatever the other lanes do. Longer than most endpoints take to
/// answer, so that a merely slow one keeps its batches whole.
const SILENCE: Duration = Duration::from_secs(1);

/// One lane's progress in a batch, as [`lagging`] sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct LaneProgress {
    /// Items it has to publish in the batch.
    items: usize,
    /// Items answered so far.
    answered: usize,
    /// When its last item was answered (all of them).
    done_at: Option<Instant>,
    /// When its last answer came.
    last_answer_at: Option<Instant>,
    /// How long its destination has had requests out and no answer, from this batch or any.
    destination_silent: Duration,
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
/// a lane whose few remaining items (at most one in twenty) have had no answer for
/// [`STRAGGLER_PATIENCE`]; and a lane with no answer for [`SILENCE`], or whose destination has
/// had none for that long.
fn lagging(lanes: &[LaneProgress], started: Instant, now: Instant) -> Vec<usize> {
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
            let silent = l.destination_silent >= SILENCE
                || now.saturating_duration_since(l.last_answer_at.unwrap_or(started)) >= SILENCE;
            behind || stalled || silent
        })
        .collect()
}

/// Whether the claim loop may go on while the batch (started at `started`) waits, at `now`: some
/// lane finished while another has not, or the batch has run [`STRAGGLER_PATIENCE`] (a batch
/// whose only lane is slow, or silent and not yet known so, holds its claim loop no longer than
/// that; the loop still waits for it before it goes on from another).
fn may_detach(lanes: &[LaneProgress], started: Instant, now: Instant) -> bool {
    let unfinished = lanes.iter().any(LaneProgress::unfinished);
    unfinished
        && (lanes.iter().any(LaneProgress::done)
            || now.saturating_duration_since(started) >= STRAGGLER_PATIENCE)
}

/// What a batch has seen of its lanes, kept up to date at each look ([`Watch::look`]).
struct Watch {
    lanes: Vec<LaneProgress>,
}

/// What the watch reads of a batch being published: its items, over how many lanes, when it
/// began, and which of its items have an answer so far.
pub(super) trait Watched {
    /// The batch's items.
    fn items(&self) -> &Items;

    /// How many lanes it spans.
    fn lanes(&self) -> usize;

    /// When publishing began.
    fn started(&self) -> Instant;

    /// Whether item `i` has its answer.
    fn answered(&self, i: usize) -> bool;

    /// How long lane `d`'s destination has had requests out and no answer (see
    /// [`crate::sinks::gate::Gate::silent_for`]).
    fn silent_for(&self, d: usize) -> Duration;
}

impl Watch {
    /// The watch of `batch`.
    fn new(batch: &impl Watched) -> Self {
        let mut progress = vec![LaneProgress::default(); batch.lanes()];
        let items = batch.items();
        for i in items.sendable() {
            if let Some(d) = items.list[i].lane {
                progress[d].items += 1;
            }
        }
        Self { lanes: progress }
    }

    /// Updates the lanes' progress from `batch`'s answers at `now`.
    fn look(&mut self, batch: &impl Watched, now: Instant) {
        let mut answered = vec![0; self.lanes.len()];
        let items = batch.items();
        for i in items.sendable() {
            if let (Some(d), true) = (items.list[i].lane, batch.answered(i)) {
                answered[d] += 1;
            }
        }
        for (d, (lane, n)) in self.lanes.iter_mut().zip(answered).enumerate() {
            if lane.unfinished() {
                lane.destination_silent = batch.silent_for(d);
            }
            if n != lane.answered {
                lane.answered = n;
                lane.last_answer_at = Some(now);
                if lane.done() {
                    lane.done_at = Some(now);
                }
            }
        }
    }

    /// Whether the claim loop may go on while the batch waits (see [`may_detach`]).
    fn may_detach(&self, started: Instant, now: Instant) -> bool {
        may_detach(&self.lanes, started, now)
    }

    /// The lanes to hand over now (see [`lagging`]).
    fn lagging(&self, started: Instant, now: Instant) -> Vec<usize> {
        lagging(&self.lanes, started, now)
    }
}

/// Why [`drive`] returned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Stop {
    /// Every lane finished, or the budget ran out.
    Done,
    /// The shutdown grace period is over.
    Aborted,
    /// These lanes lag behind the others: hand them over.
    HandOver(Vec<usize>),
}

/// Waits for `publish` (the publishing of `batch`) to end, for `abort`, or for lanes to hand over.
/// `detach` is called once [`may_detach`] says so: the claim loop may then claim its next batch
/// while this one waits.
pub(super) async fn drive<F: Future + ?Sized>(
    batch: &impl Watched,
    mut publish: Pin<&mut F>,
    abort: &CancellationToken,
    mut detach: impl FnMut(),
) -> Stop {
    let mut watch = Watch::new(batch);
    loop {
        tokio::select! {
            _ = &mut publish => return Stop::Done,
            _ = abort.cancelled() => return Stop::Aborted,
            _ = tokio::time::sleep(WATCH_EVERY) => {
                let now = Instant::now();
                watch.look(batch, now);
                if watch.may_detach(batch.started(), now) {
                    detach();
                }
                let lagging = watch.lagging(batch.started(), now);
                if !lagging.is_empty() {
                    return Stop::HandOver(lagging);
                }
            }
        }
    }
}

/// Waits for `publish` (bounded by its budget) or `abort`, watching nothing: a batch that hands
/// nothing over, or the requests still out after a hand-over. `true` when shutdown cut it short.
pub(super) async fn drive_rest<F: Future>(publish: F, abort: &CancellationToken) -> bool {
    tokio::select! {
        _ = publish => false,
        _ = abort.cancelled() => true,
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
            destination_silent: Duration::ZERO,
        }
    }

    /// (lanes, now) → whether the claim loop may go on.
    #[test]
    fn detach_table() {
        let t0 = Instant::now();
        let l = |items, answered, done, last| lane(items, answered, done, last, t0);
        let cases: Vec<(Vec<LaneProgress>, u64, bool)> = vec![
            // One lane, going: not before STRAGGLER_PATIENCE.
            (vec![l(10, 3, None, Some(5))], 199, false),
            (vec![l(10, 3, None, Some(5))], 200, true),
            // One done, one not: at once.
            (
                vec![l(1, 1, Some(2), Some(2)), l(1, 0, None, None)],
                3,
                true,
            ),
            // All done: nothing to wait for.
            (vec![l(1, 1, Some(2), Some(2))], 500, false),
        ];
        for (i, (lanes, now, expected)) in cases.iter().enumerate() {
            assert_eq!(may_detach(lanes, t0, at(t0, *now)), *expected, "case {i}");
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
            // One lane alone, still answering: wait.
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
            // Too many left to be stragglers, and answering.
            (vec![l(40, 30, None, Some(100))], 1_000, vec![]),
            // Nothing answered yet: not stalled, but silent from a second on, even alone (a
            // destination that never answers does not hold the batch until its budget ends).
            (vec![l(10, 0, None, None)], 999, vec![]),
            (vec![l(10, 0, None, None)], 1_000, vec![0]),
            // No answer for a second since the last one: silent.
            (vec![l(40, 30, None, Some(100))], 1_100, vec![0]),
            // A destination silent for a second already (its requests of earlier batches hang):
            // its lane is handed over at once, alone or not.
            (
                vec![LaneProgress {
                    destination_silent: Duration::from_secs(1),
                    ..l(10, 0, None, None)
                }],
                10,
                vec![0],
            ),
            (
                vec![LaneProgress {
                    destination_silent: Duration::from_millis(999),
                    ..l(10, 0, None, None)
                }],
                10,
                vec![],
            ),
            // A lane done and one silent (not yet behind by the linger rule): the silent one.
            (
                vec![l(1, 1, Some(900), Some(900)), l(1, 0, None, None)],
                1_000,
                vec![1],
            ),
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
