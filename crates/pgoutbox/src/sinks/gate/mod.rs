//! The gate of a destination: whether its events go out now, and how many at once.
//!
//! Three things hold a destination's events at its gate: an operator's pause (`pgoutbox
//! destination pause`), its circuit breaker, and its `concurrency`. The breaker counts the
//! destination's answers in this relay as they come; after `breaker.failures` failures in a row it
//! opens, and the events not yet sent are *held*: they wait at 'infinity' with no attempt counted,
//! so an outage of a day or a revoked credential moves nothing toward the dead letters (`max_age`
//! still applies). One probe at a time, across every relay, sends one held event; the first the
//! destination answers closes the breaker. The pause and the breaker are shared through the
//! `<table>_destinations` table (the engine re-reads it about once a second); the count of
//! requests in flight is this process's, for every batch, retry and probe together.
//!
//! Whether one more request may start is one pure function ([`may_start`]): besides the pause, the
//! breaker and `concurrency`, a destination that has not answered well since it started (or
//! whose last answers failed) gets no more requests in flight than the failures it has left before
//! its breaker opens, so a destination that is down from the start costs `breaker.failures`
//! requests, not a whole batch.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering as AtomicOrdering};
use std::sync::Mutex;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use tokio::sync::Notify;

use crate::model::breaker::BreakerPolicy;
use crate::model::outcome::Outcome;
use crate::store::destinations::DestinationState;

/// A circuit breaker's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum BreakerState {
    /// The destination takes events.
    #[default]
    Closed,
    /// The destination is failing: its events are held, probes decide when it is back.
    Open,
    /// A probe is out.
    HalfOpen,
}

impl BreakerState {
    fn parse(s: &str) -> Self {
        match s {
            "open" => Self::Open,
            "half_open" => Self::HalfOpen,
            _ => Self::Closed,
        }
    }

    /// The value of the `pgoutbox_destination_state` gauge: 0 closed, 1 half-open, 2 open.
    pub fn gauge(self) -> f64 {
        match self {
            Self::Closed => 0.0,
            Self::HalfOpen => 1.0,
            Self::Open => 2.0,
        }
    }
}

impl fmt::Display for BreakerState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Closed => "closed",
            Self::Open => "open",
            Self::HalfOpen => "half_open",
        })
    }
}

/// How an answer counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counted {
    /// As an attempt, per the retry policy.
    Attempt,
    /// This failure opened the breaker (it counts as an attempt; the state must be stored).
    Tripped,
    /// Not at all: the breaker was already open, the event is held.
    Held,
}

/// What [`may_start`] decides on: the gate's state when a request asks to start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Admission {
    /// Requests of this destination in flight in this process.
    pub in_flight: usize,
    /// Most requests in flight at once (`concurrency`; `usize::MAX` when the sink has none).
    pub concurrency: usize,
    /// Failed answers in a row.
    pub failures_in_a_row: u32,
    /// `breaker.failures` (0: no breaker).
    pub breaker_failures: u32,
    /// Whether the destination answered well since this relay started or its breaker closed.
    pub proven: bool,
    /// Paused, or the breaker is not closed.
    pub held: bool,
}

/// Whether one more request may start. While the destination is unproven (nothing answered well
/// since this relay started or its breaker closed), or halfway to opening its breaker, no more
/// requests are in flight than the failures left before the breaker opens: each one that fails
/// brings the breaker one step closer, and none starts that the breaker would have stopped. A
/// destination that fails now and then keeps its whole `concurrency`.
pub fn may_start(a: &Admission) -> bool {
    if a.held {
        return false;
    }
    let mut cap = a.concurrency;
    let at_risk = !a.proven || a.failures_in_a_row.saturating_mul(2) >= a.breaker_failures;
    if a.breaker_failures > 0 && at_risk {
        let left = a.breaker_failures.saturating_sub(a.failures_in_a_row);
        cap = cap.min(usize::try_from(left).unwrap_or(usize::MAX));
    }
    a.in_flight < cap
}

/// Failed attempts of one destination since the last summary (see [`Gate::take_summary`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Summary {
    /// Attempts that failed (retried or dead-lettered).
    pub failed: u64,
    /// Attempts delivered.
    pub delivered: u64,
    /// The last failure's reason.
    pub last_error: Option<String>,
}

#[derive(Debug, Default)]
struct Local {
    breaker: BreakerState,
    paused: bool,
    failures_in_a_row: u32,
    proven: bool,
    in_flight: usize,
    /// Since when requests have been out without a break (none out: `None`).
    busy_since: Option<std::time::Instant>,
    /// When the last answer came.
    last_answer: Option<std::time::Instant>,
    /// When the first request started that ended with no answer (it timed out) since the last
    /// answer: the destination stays silent from then on, requests out or not, until it answers.
    unanswered_since: Option<std::time::Instant>,
    /// When the breaker last closed: a failure of a request started before that is the outage's,
    /// not news.
    closed_at: Option<std::time::Instant>,
    since: Option<DateTime<Utc>>,
    last_error: Option<String>,
    /// A breaker this relay opened, not yet stored (the engine stores it).
    tripped: Option<String>,
    summary: Summary,
}

/// One destination's gate in this relay: a mirror of the shared state (pause, breaker), the
/// answers in a row, and the requests in flight.
#[derive(Debug)]
pub struct Gate {
    name: String,
    policy: BreakerPolicy,
    concurrency: usize,
    local: Mutex<Local>,
    /// Woken whenever a request may have become startable (or never will).
    changed: Notify,
    /// Set by every use of the gate (under its lock), cleared by [`Gate::hush`]: the relay's
    /// once-a-second looks at its destinations (breakers to store, failures to sum up, state to
    /// report, probes) skip a gate that is quiet, so that their cost follows the destinations in
    /// use, not the configured ones.
    stirred: AtomicBool,
    /// Whether a breaker this relay opened waits to be stored ([`Gate::take_tripped`]), readable
    /// without the lock: every settle looks.
    tripped: AtomicBool,
}

/// One request in flight; dropping it makes room for the next.
#[derive(Debug)]
pub struct Permit<'a> {
    gate: &'a Gate,
}

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        {
            let mut l = self.gate.local();
            l.in_flight = l.in_flight.saturating_sub(1);
            if l.in_flight == 0 {
                l.busy_since = None;
            }
        }
        self.gate.changed.notify_waiters();
    }
}

impl Gate {
    /// A closed, running destination that takes `concurrency` requests at once (`None`: no limit).
    pub fn new(name: &str, policy: BreakerPolicy, concurrency: Option<usize>) -> Self {
        Self {
            name: name.to_owned(),
            policy,
            concurrency: concurrency.unwrap_or(usize::MAX).max(1),
            local: Mutex::new(Local::default()),
            changed: Notify::new(),
            stirred: AtomicBool::new(true),
            tripped: AtomicBool::new(false),
        }
    }

    /// The gate's state, locked; the gate is stirred (set under the lock, so that [`Gate::hush`]
    /// never clears what a use set after it looked).
    fn local(&self) -> std::sync::MutexGuard<'_, Local> {
        let l = self.local.lock().unwrap_or_else(|e| e.into_inner());
        self.stirred.store(true, AtomicOrdering::Relaxed);
        l
    }

    /// The gate's state, locked to be read: the gate is not stirred.
    fn peek(&self) -> std::sync::MutexGuard<'_, Local> {
        self.local.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether nothing has used the gate since [`Gate::hush`] found it closed, running and with
    /// nothing to report: the relay's looks at its destinations may skip it.
    pub fn is_quiet(&self) -> bool {
        !self.stirred.load(AtomicOrdering::Relaxed)
    }

    /// Marks the gate quiet if it is closed, running, and has no breaker to store nor answers
    /// to sum up; returns whether it is quiet now.
    pub fn hush(&self) -> bool {
        let l = self.peek();
        let quiet = l.breaker == BreakerState::Closed
            && !l.paused
            && l.tripped.is_none()
            && l.summary == Summary::default();
        if quiet {
            self.stirred.store(false, AtomicOrdering::Relaxed);
        }
        quiet
    }

    /// Whether a breaker this relay opened waits to be stored.
    pub fn has_tripped(&self) -> bool {
        self.tripped.load(AtomicOrdering::Relaxed)
    }

    /// The destination's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its breaker policy.
    pub fn policy(&self) -> &BreakerPolicy {
        &self.policy
    }

    /// Whether its events go out now (not paused, breaker closed).
    pub fn is_open(&self) -> bool {
        let l = self.peek();
        !l.paused && l.breaker == BreakerState::Closed
    }

    /// The breaker state and whether paused, as this relay last saw them.
    pub fn state(&self) -> (BreakerState, bool) {
        let l = self.peek();
        (l.breaker, l.paused)
    }

    /// Requests in flight now.
    pub fn in_flight(&self) -> usize {
        self.peek().in_flight
    }

    /// The most requests that may be in flight at once.
    pub fn concurrency(&self) -> usize {
        self.concurrency
    }

    /// Takes a slot for one request if [`may_start`] allows it now. `probe`: the one request a
    /// probe sends, whatever the breaker says.
    pub fn try_admit(&self, probe: bool) -> Option<Permit<'_>> {
        let mut l = self.local();
        let admission = Admission {
            in_flight: l.in_flight,
            concurrency: self.concurrency,
            failures_in_a_row: l.failures_in_a_row,
            breaker_failures: self.policy.failures,
            proven: l.proven,
            held: l.paused || l.breaker != BreakerState::Closed,
        };
        if !probe && !may_start(&admission) {
            return None;
        }
        if l.in_flight == 0 {
            l.busy_since = Some(std::time::Instant::now());
        }
        l.in_flight += 1;
        Some(Permit { gate: self })
    }

    /// How long the destination has been silent: it has had requests out with no answer (since
    /// its last answer, or since the first of them started, whichever is later), or a request of
    /// it timed out with no answer since (from when that request started, requests out or not);
    /// zero otherwise. A destination that accepts requests and never answers is silent for ever
    /// longer, whichever batch sent them, and stays so between its timeouts, so that each new
    /// batch finds it silent at its first look.
    pub fn silent_for(&self, now: std::time::Instant) -> Duration {
        let l = self.local();
        let busy = l
            .busy_since
            .map(|busy| l.last_answer.map_or(busy, |answer| answer.max(busy)));
        let since = match (busy, l.unanswered_since) {
            (Some(busy), Some(unanswered)) => Some(busy.min(unanswered)),
            (busy, unanswered) => busy.or(unanswered),
        };
        since.map_or(Duration::ZERO, |since| now.saturating_duration_since(since))
    }

    /// A future that completes at the gate's next change (a request ended, an answer changed what
    /// may start, the breaker or pause changed, or [`Gate::wake`] was called). Create it before
    /// checking the state it waits for, so that no change between the check and the wait is
    /// missed.
    pub fn changed(&self) -> tokio::sync::futures::Notified<'_> {
        self.changed.notified()
    }

    /// Wakes everything waiting at the gate (a batch stopped publishing to this destination).
    pub fn wake(&self) {
        self.changed.notify_waiters();
    }

    /// A line for `/readyz`: `None` when the destination takes events.
    pub fn problem(&self) -> Option<String> {
        let l = self.local();
        let since = l
            .since
            .map(|t| {
                format!(
                    " since {}",
                    t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
                )
            })
            .unwrap_or_default();
        let error = l
            .last_error
            .as_deref()
            .map(|e| format!(" (last error: {e})"))
            .unwrap_or_default();
        match (l.paused, l.breaker) {
            (true, _) => Some(format!("paused by an operator{since}")),
            (false, BreakerState::Closed) => None,
            (false, state) => Some(format!("circuit breaker {state}{since}{error}")),
        }
    }

    /// Counts one answer, as it comes. A delivery, or any answer that proves the destination is
    /// up (a permanent rejection), resets the failures in a row. A failure while the breaker is
    /// open is held, not counted.
    pub fn answered(&self, outcome: &Outcome) -> Counted {
        self.answered_to(outcome, None)
    }

    /// [`Gate::answered`] for a request that started at `started`: a failure of a request that
    /// started before the breaker last closed (one handed over during an outage, whose timeout
    /// comes after the destination is back) is retried as any failure but not counted on the
    /// breaker, so that it cannot open again a breaker that a later answer closed.
    pub fn answered_to(&self, outcome: &Outcome, started: Option<std::time::Instant>) -> Counted {
        self.count(outcome, started, true)
    }

    /// Counts the failure of a request that started at `started` and ended with no answer (its
    /// timeout): on the breaker as [`Gate::answered_to`] does, but the destination is not heard
    /// from, so it stays silent ([`Gate::silent_for`]) until it answers.
    pub fn timed_out(&self, outcome: &Outcome, started: Option<std::time::Instant>) -> Counted {
        self.count(outcome, started, false)
    }

    fn count(
        &self,
        outcome: &Outcome,
        started: Option<std::time::Instant>,
        heard: bool,
    ) -> Counted {
        let (counted, changed) = {
            let mut l = self.local();
            let now = std::time::Instant::now();
            if heard {
                l.last_answer = Some(now);
                l.unanswered_since = None;
            } else {
                let start = started.unwrap_or(now);
                l.unanswered_since = Some(l.unanswered_since.map_or(start, |u| u.min(start)));
            }
            let before = (l.failures_in_a_row, l.proven, l.breaker);
            let stale = started.is_some_and(|s| l.closed_at.is_some_and(|closed| s < closed));
            let counted = match outcome {
                Outcome::Delivered | Outcome::Rejected { .. } => {
                    l.failures_in_a_row = 0;
                    l.proven = true;
                    if matches!(outcome, Outcome::Delivered) {
                        l.summary.delivered += 1;
                    } else {
                        l.summary.failed += 1;
                    }
                    Counted::Attempt
                }
                Outcome::Retry { reason, .. } => {
                    if l.breaker != BreakerState::Closed {
                        Counted::Held
                    } else {
                        l.summary.failed += 1;
                        l.summary.last_error = Some(reason.clone());
                        if stale {
                            // Retried per its policy, but no news of the destination.
                            Counted::Attempt
                        } else {
                            l.failures_in_a_row = l.failures_in_a_row.saturating_add(1);
                            if self.policy.failures > 0
                                && l.failures_in_a_row >= self.policy.failures
                            {
                                l.breaker = BreakerState::Open;
                                l.since = Some(Utc::now());
                                l.last_error = Some(reason.clone());
                                l.failures_in_a_row = 0;
                                l.proven = false;
                                l.tripped = Some(reason.clone());
                                self.tripped.store(true, AtomicOrdering::Relaxed);
                                Counted::Tripped
                            } else {
                                Counted::Attempt
                            }
                        }
                    }
                }
            };
            if let Outcome::Rejected { reason } = outcome {
                l.summary.last_error = Some(reason.clone());
            }
            (
                counted,
                before != (l.failures_in_a_row, l.proven, l.breaker),
            )
        };
        // Waiters wait to be admitted ([`may_start`]): only these three change that. A delivery
        // to a proven destination with no failures changes nothing, and most answers are that.
        if changed {
            self.changed.notify_waiters();
        }
        counted
    }

    /// The reason of a breaker this relay opened since the last call, to be stored.
    pub fn take_tripped(&self) -> Option<String> {
        if !self.has_tripped() {
            return None;
        }
        let mut l = self.local();
        self.tripped.store(false, AtomicOrdering::Relaxed);
        l.tripped.take()
    }

    /// The failures and deliveries counted since the last call.
    pub fn take_summary(&self) -> Summary {
        std::mem::take(&mut self.local().summary)
    }

    /// Takes the stored state over (another relay opened or closed the breaker, an operator
    /// paused). Returns whether the destination was held and is free now.
    pub fn adopt(&self, stored: &DestinationState) -> bool {
        let freed = {
            let mut l = self.local();
            let was_held = l.paused || l.breaker != BreakerState::Closed;
            let breaker = BreakerState::parse(&stored.breaker);
            if breaker != l.breaker {
                l.failures_in_a_row = 0;
                l.proven = false;
                if breaker == BreakerState::Closed {
                    l.closed_at = Some(std::time::Instant::now());
                }
            }
            l.breaker = breaker;
            l.paused = stored.paused_at.is_some();
            l.since = Some(stored.paused_at.unwrap_or(stored.breaker_since));
            l.last_error = stored.last_error.clone();
            was_held && !l.paused && l.breaker == BreakerState::Closed
        };
        self.changed.notify_waiters();
        freed
    }

    /// Closes the breaker here (this relay's probe was answered).
    pub fn close(&self) {
        {
            let mut l = self.local();
            l.breaker = BreakerState::Closed;
            l.closed_at = Some(std::time::Instant::now());
            l.failures_in_a_row = 0;
            l.proven = true;
            l.since = Some(Utc::now());
        }
        self.changed.notify_waiters();
    }

    /// The wait before the probe after `failed_probes` failed ones: doubling, capped.
    pub fn probe_delay(&self, failed_probes: i32) -> Duration {
        let doublings = u32::try_from(failed_probes.clamp(0, 30)).unwrap_or(0);
        self.policy
            .probe_interval
            .saturating_mul(1u32 << doublings.min(20))
            .min(self.policy.max_probe_interval)
    }
}

#[cfg(test)]
mod tests;
