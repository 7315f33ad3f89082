//! What one attempt means for one (event, destination) pair: the one place that decides it.
//!
//! Every path that settles — a claimed batch's rows, a split event's pairs, a batch of pairs from
//! the deliveries table, a probe, a batch read from the WAL — describes what happened to each item
//! as an [`Attempt`] (built in one place, at the end of publishing) and has [`judge`] ask
//! [`verdict`] what follows: delivered, failed (retried after a delay, or dead), held
//! for its destination, waiting without an attempt counted, or in flight. Where the verdict is
//! written (the event's row, a pair, a held batch) is the plan's business ([`super::plan`]).

use std::ops::Range;

use chrono::{DateTime, Utc};
use rand::Rng;

use super::Lanes;
use crate::model::event::OutboxEvent;
use crate::model::outcome::Outcome;
use crate::model::retry::{Decision, Failure, RetryPolicy};
use crate::route::Item;
use crate::sinks::gate::Counted;

/// Longest `last_error` kept, so a chatty receiver cannot bloat the table.
const MAX_ERROR_LEN: usize = 1024;

/// What happened to one pair in a batch.
#[derive(Debug, Clone, PartialEq)]
pub enum Attempt {
    /// No destination takes the event.
    Unroutable,
    /// The pair's destination is no longer configured.
    Gone,
    /// Its destination was paused or its breaker open when the batch was routed: not sent.
    Held,
    /// An earlier event of its key still waits for this (ordered) destination: not sent.
    Behind,
    /// Not sent (the budget ran out first, or shutdown): given back as it was.
    NotSent,
    /// Not sent: its lane was handed over before its request started; it goes on as a pair.
    HandedOver,
    /// Handed over while its request is still out: the answer is awaited.
    InFlight,
    /// The destination answered, counted by its breaker as given.
    Answered(Outcome, Counted),
}

impl Attempt {
    /// Whether the item was to be published (answered or not).
    pub fn was_sent(&self) -> bool {
        matches!(
            self,
            Self::NotSent | Self::HandedOver | Self::InFlight | Self::Answered(..)
        )
    }

    /// Whether its lane was handed over before it was answered.
    pub fn handed_over(&self) -> bool {
        matches!(self, Self::HandedOver | Self::InFlight)
    }

    /// Whether it was delivered.
    pub fn delivered(&self) -> bool {
        matches!(self, Self::Answered(Outcome::Delivered, _))
    }
}

/// One item judged: the item, what happened to it and what follows for its pair.
#[derive(Debug, Clone, PartialEq)]
pub struct Judged {
    /// The item: its event's index in the batch, its lane, what routing did with it.
    pub item: Item,
    /// What happened to it.
    pub attempt: Attempt,
    /// What follows.
    pub verdict: Verdict,
}

/// What publishing left of a batch's items, grouped by event as its items were: each item with
/// its attempt. What the publish stage passes on, and what [`judge`] takes.
#[derive(Debug, Default)]
pub struct Attempts {
    /// Every item with its attempt, in the items' order.
    pub list: Vec<(Item, Attempt)>,
    /// Per event: its items (contiguous); empty when the items are not a whole batch's (the
    /// late answers of a batch that handed lanes over).
    pub spans: Vec<Range<usize>>,
}

/// A batch's items judged, grouped by event as its items were.
#[derive(Debug, Default)]
pub struct Verdicts {
    /// Every item's verdict, in the items' order.
    pub list: Vec<Judged>,
    /// Per event: its items (contiguous).
    pub spans: Vec<Range<usize>>,
}

impl Verdicts {
    /// The judged items of event `e`.
    pub fn of_event(&self, e: usize) -> &[Judged] {
        &self.list[self.spans[e].clone()]
    }
}

/// Judges a batch's items now: each item of `events` with its attempt, by [`verdict`] under its
/// lane's retry policy. The one place a batch's attempts become verdicts.
pub fn judge(events: &[OutboxEvent], attempts: Attempts, lanes: &dyn Lanes) -> Verdicts {
    let Attempts { list, spans } = attempts;
    // Send, unlike ThreadRng: a batch's future crosses threads.
    let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::from_entropy();
    let now = Utc::now();
    let list = list
        .into_iter()
        .map(|(item, attempt)| {
            let pair = Pair {
                event: &events[item.event],
                destination: item.lane.map(|d| (lanes.name(d), lanes.policy(d))),
            };
            let verdict = verdict(pair, &attempt, now, &mut rng);
            log_failed(&pair, &verdict);
            Judged {
                item,
                attempt,
                verdict,
            }
        })
        .collect();
    Verdicts { list, spans }
}

/// A failed attempt's consequence.
#[derive(Debug, Clone, PartialEq)]
pub struct Failed {
    /// What went wrong, for `last_error` (with the attempt number and, if dead, why).
    pub error: String,
    /// Delay until the next attempt (ignored when dead).
    pub delay_secs: f64,
    /// Dead-lettered instead of retried.
    pub dead: bool,
    /// Whether this counts as an attempt (an expired hold dead-letters without one).
    pub counted: bool,
}

/// What follows for the pair.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// Delivered: done.
    Delivered,
    /// Failed: retried after a delay, or dead.
    Failed(Failed),
    /// Held for its destination (at 'infinity', no attempt counted), with the failure that was
    /// not counted, if any.
    Held(Option<String>),
    /// Due again without an attempt counted, with a note for `last_error`, if any.
    Waiting(Option<String>),
    /// Its request is out: the pair waits for the answer under a lease.
    InFlight,
}

/// The pair being settled: its event, its destination and that destination's retry policy
/// (`None` for an event no destination takes).
#[derive(Debug, Clone, Copy)]
pub struct Pair<'a> {
    /// The event (its `attempts` are the pair's so far).
    pub event: &'a OutboxEvent,
    /// The destination, with its retry policy.
    pub destination: Option<(&'a str, &'a RetryPolicy)>,
}

/// Logs a failed attempt, at debug: per-event failures would make the log scale with traffic;
/// every attempt is in the attempt history, and each destination's failures are summed up in one
/// line an interval (the engine's destinations loop).
fn log_failed(pair: &Pair<'_>, v: &Verdict) {
    if let Verdict::Failed(f) = v {
        tracing::debug!(
            event_id = %pair.event.id,
            topic = %pair.event.topic,
            destination = pair.destination.map_or("-", |(d, _)| d),
            attempt = pair.event.attempts + 1,
            dead = f.dead,
            error = %f.error,
            "publish failed"
        );
    }
}

/// What `attempt` means for `pair` at `now`.
pub fn verdict(
    pair: Pair<'_>,
    attempt: &Attempt,
    now: DateTime<Utc>,
    rng: &mut impl Rng,
) -> Verdict {
    let event = pair.event;
    let Some((destination, policy)) = pair.destination else {
        return Verdict::Failed(unroutable(event));
    };
    match attempt {
        Attempt::Unroutable => Verdict::Failed(unroutable(event)),
        Attempt::Gone => Verdict::Failed(Failed {
            error: format!("destination {destination:?} is no longer configured: add it back, then `pgoutbox dead retry --destination {destination}`, or `dead discard` [dead: no such destination]"),
            delay_secs: 0.0,
            dead: true,
            counted: false,
        }),
        Attempt::Held => held(event, destination, policy, None, now),
        Attempt::Answered(outcome, Counted::Held) => {
            held(event, destination, policy, retry_reason(outcome), now)
        }
        Attempt::Behind => Verdict::Waiting(Some(format!(
            "waiting for an earlier event of key {:?} to reach {destination}",
            event.key.as_deref().unwrap_or_default()
        ))),
        Attempt::NotSent | Attempt::HandedOver => Verdict::Waiting(None),
        Attempt::InFlight => Verdict::InFlight,
        Attempt::Answered(outcome, _) => match decide(event, destination, policy, outcome, now, rng) {
            None => Verdict::Delivered,
            Some(failed) => Verdict::Failed(failed),
        },
    }
}

/// Held: waits for `destination`, unless `max_age` is past (then dead, no attempt counted).
fn held(
    event: &OutboxEvent,
    destination: &str,
    policy: &RetryPolicy,
    uncounted: Option<&str>,
    now: DateTime<Utc>,
) -> Verdict {
    match policy.expired(event.created_at, now) {
        Some(why) => Verdict::Failed(Failed {
            error: format!("held for {destination}: {why}"),
            delay_secs: 0.0,
            dead: true,
            counted: false,
        }),
        None => Verdict::Held(uncounted.map(|e| {
            truncate(format!(
                "{e} [held: {destination} is unavailable, not counted as an attempt]"
            ))
        })),
    }
}

/// The dead letter of an event no destination takes.
fn unroutable(event: &OutboxEvent) -> Failed {
    Failed {
        error: format!(
            "no destination takes topic {:?} (by its `topics` and `filter`): make one take it, then `pgoutbox dead retry`",
            event.topic
        ),
        delay_secs: 0.0,
        dead: true,
        counted: true,
    }
}

/// The failure an outcome reports, if it is a retryable one.
fn retry_reason(outcome: &Outcome) -> Option<&str> {
    match outcome {
        Outcome::Retry { reason, .. } => Some(reason),
        _ => None,
    }
}

/// One answer for `destination` under its policy: `None` when delivered, else the failure's
/// consequence (retried after a delay, or dead).
fn decide(
    event: &OutboxEvent,
    destination: &str,
    policy: &RetryPolicy,
    outcome: &Outcome,
    now: DateTime<Utc>,
    rng: &mut impl Rng,
) -> Option<Failed> {
    let attempt = event.attempts + 1;
    let (error, decision) = match outcome {
        Outcome::Delivered => return None,
        Outcome::Rejected { reason } => (reason, Decision::Dead("permanent failure".into())),
        Outcome::Retry {
            reason,
            retry_after,
        } => {
            let failure = Failure {
                previous_attempts: event.attempts,
                created_at: event.created_at,
                retry_after: *retry_after,
            };
            (reason, policy.decide(&failure, now, rng))
        }
    };
    let (delay_secs, dead, suffix) = match decision {
        Decision::Retry(delay) => (delay.as_secs_f64(), false, String::new()),
        Decision::Dead(why) => (0.0, true, format!(" [dead: {why}]")),
    };
    Some(Failed {
        error: truncate(format!(
            "attempt {attempt} to {destination}: {error}{suffix}"
        )),
        delay_secs,
        dead,
        counted: true,
    })
}

/// `s` cut to [`MAX_ERROR_LEN`] bytes (at a character boundary), marked when cut.
pub fn truncate(mut s: String) -> String {
    if s.len() > MAX_ERROR_LEN {
        let mut cut = MAX_ERROR_LEN;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push('…');
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::SeedableRng;
    use serde_json::value::RawValue;
    use std::time::Duration;
    use uuid::Uuid;

    fn event(attempts: i32, age_secs: i64, key: Option<&str>) -> OutboxEvent {
        OutboxEvent {
            id: Uuid::new_v4(),
            seq: 1,
            topic: "order.created".into(),
            key: key.map(str::to_owned),
            payload: RawValue::from_string("{}".into()).expect("json"),
            headers: vec![],
            created_at: Utc::now() - chrono::Duration::seconds(age_secs),
            attempts,
        }
    }

    /// Each kind of attempt against the same policy: the verdict, and for failures the delay, the
    /// dead flag, whether an attempt counted and a piece of the error.
    #[test]
    fn verdict_table() {
        let policy = RetryPolicy {
            schedule: vec![Duration::from_secs(1), Duration::from_secs(30)],
            max_attempts: Some(3),
            max_age: Some(Duration::from_secs(3600)),
            jitter: 0.0,
        };
        let retry = Outcome::retry("HTTP 503");
        let rejected = Outcome::Rejected {
            reason: "HTTP 400: bad".into(),
        };
        let throttled = Outcome::Retry {
            reason: "HTTP 429".into(),
            retry_after: Some(Duration::from_secs(7)),
        };
        enum Want {
            Delivered,
            Failed(f64, bool, bool, &'static str),
            Held(Option<&'static str>),
            Waiting(Option<&'static str>),
            InFlight,
        }
        use Want as W;
        let cases: Vec<(OutboxEvent, Attempt, Want)> = vec![
            (
                event(0, 1, None),
                Attempt::Answered(Outcome::Delivered, Counted::Attempt),
                W::Delivered,
            ),
            (
                event(0, 1, None),
                Attempt::Answered(retry.clone(), Counted::Attempt),
                W::Failed(1.0, false, true, "attempt 1 to d: HTTP 503"),
            ),
            (
                event(1, 1, None),
                Attempt::Answered(retry.clone(), Counted::Tripped),
                W::Failed(30.0, false, true, "attempt 2 to d"),
            ),
            (
                event(2, 1, None),
                Attempt::Answered(retry.clone(), Counted::Attempt),
                W::Failed(0.0, true, true, "max_attempts = 3"),
            ),
            (
                event(0, 1, None),
                Attempt::Answered(rejected.clone(), Counted::Attempt),
                W::Failed(0.0, true, true, "HTTP 400: bad [dead: permanent failure]"),
            ),
            (
                event(0, 1, None),
                Attempt::Answered(throttled.clone(), Counted::Attempt),
                W::Failed(7.0, false, true, "HTTP 429"),
            ),
            (
                event(0, 7200, None),
                Attempt::Answered(retry.clone(), Counted::Attempt),
                W::Failed(0.0, true, true, "max_age"),
            ),
            // A failure after the breaker opened is held, not counted.
            (
                event(0, 1, None),
                Attempt::Answered(retry.clone(), Counted::Held),
                W::Held(Some(
                    "HTTP 503 [held: d is unavailable, not counted as an attempt]",
                )),
            ),
            (event(0, 1, None), Attempt::Held, W::Held(None)),
            // Held past max_age: dead, with no attempt counted.
            (
                event(0, 7200, None),
                Attempt::Held,
                W::Failed(0.0, true, false, "held for d: gave up"),
            ),
            (
                event(0, 1, Some("k-1")),
                Attempt::Behind,
                W::Waiting(Some(
                    "waiting for an earlier event of key \"k-1\" to reach d",
                )),
            ),
            (event(3, 1, None), Attempt::NotSent, W::Waiting(None)),
            (event(0, 1, None), Attempt::InFlight, W::InFlight),
            (
                event(0, 1, None),
                Attempt::Gone,
                W::Failed(0.0, true, false, "no longer configured"),
            ),
            (
                event(0, 1, None),
                Attempt::Unroutable,
                W::Failed(0.0, true, true, "no destination takes topic"),
            ),
        ];
        let mut rng = StdRng::seed_from_u64(1);
        for (i, (e, attempt, want)) in cases.iter().enumerate() {
            let pair = Pair {
                event: e,
                destination: Some(("d", &policy)),
            };
            let got = verdict(pair, attempt, Utc::now(), &mut rng);
            let ok = match (&got, want) {
                (Verdict::Delivered, W::Delivered) | (Verdict::InFlight, W::InFlight) => true,
                (Verdict::Failed(f), W::Failed(delay, dead, counted, says)) => {
                    f.delay_secs == *delay
                        && f.dead == *dead
                        && f.counted == *counted
                        && f.error.contains(says)
                }
                (Verdict::Held(note), W::Held(says))
                | (Verdict::Waiting(note), W::Waiting(says)) => note.as_deref() == *says,
                _ => false,
            };
            assert!(ok, "case {i}: {attempt:?} gave {got:?}");
        }
        let unroutable = verdict(
            Pair {
                event: &event(0, 1, None),
                destination: None,
            },
            &Attempt::Answered(Outcome::Delivered, Counted::Attempt),
            Utc::now(),
            &mut rng,
        );
        assert!(
            matches!(unroutable, Verdict::Failed(f) if f.dead && f.error.contains("no destination"))
        );
    }

    #[test]
    fn long_errors_are_cut_at_a_character_boundary() {
        let long = "é".repeat(MAX_ERROR_LEN);
        let cut = truncate(long);
        assert!(cut.len() <= MAX_ERROR_LEN + '…'.len_utf8());
        assert!(cut.ends_with('…'));
    }
}
