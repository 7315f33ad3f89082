//! A batch being published: its items (one per event and destination), the outcome slots sinks
//! fill as they go, and each destination's time budget.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering as AtomicOrdering};
use std::sync::OnceLock;
use std::time::Duration;

use uuid::Uuid;

use super::report::BatchReport;
use super::Destination;
use crate::error::{Error, Result};
use crate::model::event::OutboxEvent;
use crate::model::outcome::Outcome;
use crate::sinks::Budget;

/// How often a batch looks whether only stragglers are left (see [`Relay::process_batch`]).
pub(super) const STRAGGLER_CHECK: Duration = Duration::from_millis(50);

/// How long a batch's last outcome must be past before its unfinished events count as stragglers.
pub(super) const STRAGGLER_PATIENCE: Duration = Duration::from_millis(200);

/// Where one (event, destination) item of a batch goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Route {
    /// Published to destination `d`.
    Send(usize),
    /// Held for destination `d` (paused, or its breaker is open).
    Hold(usize),
    /// Ordered destination `d` still has an undelivered pair of this key: not published now, the
    /// pair waits behind it in the deliveries table.
    Defer(usize),
    /// No destination takes its topic.
    Unroutable,
}

/// A batch's items: one per (event, destination), what publishing works on.
#[derive(Debug, Default)]
pub(super) struct Items {
    /// Per item: its event's index in the batch.
    pub(super) owner: Vec<usize>,
    /// Per item: where it goes.
    pub(super) routes: Vec<Route>,
    /// Per event: its items (contiguous).
    pub(super) spans: Vec<std::ops::Range<usize>>,
}
impl Items {
    /// One item per event, for batches whose events each have one destination already (a batch of
    /// deliveries, a probe).
    pub(super) fn single(routes: Vec<Route>) -> Self {
        Self {
            owner: (0..routes.len()).collect(),
            spans: (0..routes.len()).map(|i| i..i + 1).collect(),
            routes,
        }
    }

    /// Whether event `e` settles through the deliveries table: several destinations, or one item
    /// that waits behind its key there.
    pub(super) fn is_split(&self, e: usize) -> bool {
        let span = self.spans[e].clone();
        span.len() > 1
            || self.routes[span]
                .iter()
                .any(|r| matches!(r, Route::Defer(_)))
    }
}

/// One batch being published: its items, the outcome slots sinks fill as they go, and each
/// destination's time budget.
pub(super) struct BatchRun<'a> {
    pub(super) events: &'a [OutboxEvent],
    pub(super) owner: &'a [usize],
    pub(super) routes: &'a [Route],
    pub(super) slots: Vec<OnceLock<Outcome>>,
    /// Items handed to a sink (their publish started, or was queued to start).
    pub(super) handed: Vec<AtomicBool>,
    pub(super) budgets: Vec<Budget>,
}
impl<'a> BatchRun<'a> {
    pub(super) fn new(
        events: &'a [OutboxEvent],
        items: &'a Items,
        destinations: &[Destination],
        deadline: tokio::time::Instant,
    ) -> Self {
        Self {
            events,
            owner: &items.owner,
            routes: &items.routes,
            slots: items.routes.iter().map(|_| OnceLock::new()).collect(),
            handed: items
                .routes
                .iter()
                .map(|_| AtomicBool::new(false))
                .collect(),
            budgets: destinations
                .iter()
                .map(|_| Budget::until(deadline))
                .collect(),
        }
    }

    /// The event of item `i`.
    pub(super) fn event(&self, i: usize) -> &'a OutboxEvent {
        &self.events[self.owner[i]]
    }

    /// How many items have an outcome so far.
    pub(super) fn finished(&self) -> usize {
        self.slots.iter().filter(|s| s.get().is_some()).count()
    }

    /// The stragglers, when they are all that is left of the batch: something finished, at most
    /// `most` items have no outcome, and none has come for [`STRAGGLER_PATIENCE`]. `last_progress`
    /// (finished count, when it last changed) is kept up to date by the calls.
    pub(super) fn only_stragglers(
        &self,
        last_progress: &mut (usize, tokio::time::Instant),
        most: usize,
    ) -> Option<Vec<usize>> {
        let finished = self.finished();
        if finished != last_progress.0 {
            *last_progress = (finished, tokio::time::Instant::now());
            return None;
        }
        let stragglers = self.stragglers();
        (!stragglers.is_empty()
            && finished > 0
            && stragglers.len() <= most
            && last_progress.1.elapsed() >= STRAGGLER_PATIENCE)
            .then_some(stragglers)
    }

    /// Items to publish that have no outcome yet.
    pub(super) fn stragglers(&self) -> Vec<usize> {
        (0..self.slots.len())
            .filter(|&i| matches!(self.routes[i], Route::Send(_)) && self.slots[i].get().is_none())
            .collect()
    }

    /// The outcomes known so far.
    pub(super) fn snapshot(&self) -> Vec<Option<Outcome>> {
        self.slots.iter().map(|s| s.get().cloned()).collect()
    }

    /// The outcomes: `None` for events that have none (not attempted, or unfinished at the
    /// deadline: given back untouched). A destination that finished nothing at all within the
    /// whole budget is not making progress: its unfinished events count as failed attempts (it
    /// would otherwise be retried at no cost forever), unless the batch was aborted by shutdown.
    pub(super) fn finish(self, aborted: bool, publish_timeout: Duration) -> Vec<Option<Outcome>> {
        let mut outcomes: Vec<Option<Outcome>> =
            self.slots.into_iter().map(OnceLock::into_inner).collect();
        if aborted {
            return outcomes;
        }
        let stalled: HashSet<usize> = (0..self.budgets.len())
            .filter(|&d| {
                let mine =
                    || (0..outcomes.len()).filter(move |&i| self.routes[i] == Route::Send(d));
                mine().any(|i| self.handed[i].load(AtomicOrdering::Relaxed))
                    && mine().all(|i| outcomes[i].is_none())
            })
            .collect();
        for (i, outcome) in outcomes.iter_mut().enumerate() {
            if let Route::Send(d) = self.routes[i] {
                if outcome.is_none()
                    && stalled.contains(&d)
                    && self.handed[i].load(AtomicOrdering::Relaxed)
                {
                    *outcome = Some(Outcome::retry(format!(
                        "no answer within publish_timeout ({})",
                        humantime::format_duration(publish_timeout)
                    )));
                }
            }
        }
        outcomes
    }
}

/// A batch's report and the ids it scheduled for another attempt.
pub(super) type BatchResult = Result<(BatchReport, Vec<Uuid>)>;

/// A batch task's result; a panic inside it goes on up to the worker (and stops the relay).
pub(super) fn joined_batch(
    joined: std::result::Result<BatchResult, tokio::task::JoinError>,
) -> BatchResult {
    match joined {
        Ok(result) => result,
        Err(e) => match e.try_into_panic() {
            Ok(panic) => std::panic::resume_unwind(panic),
            Err(e) => Err(Error::WorkerPanicked(format!("a batch was cancelled: {e}"))),
        },
    }
}
