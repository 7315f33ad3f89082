//! The publish stage: a batch's items published lane by lane while the batch is watched (a lane
//! that lags behind the others is handed over, [`super::watch`]), and what publishing left of each item —
//! its [`Attempt`] — built in one place ([`Answers::attempts`]).
//!
//! Each lane's unordered items go in one call to its sink, each ordered key's items as a chain,
//! one after the other. Every call goes through the lane's gate ([`crate::sinks::Share`]), so
//! `concurrency` holds for the whole process; each answer goes to its item's slot as soon as it
//! comes. A [`Run`] owns its batch, so that what a lane handed over still has out goes on after
//! the stage returns, and settles when its answers come ([`Published::late`]).

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use futures::future::join_all;
use futures::stream::{FuturesUnordered, StreamExt};
use futures::FutureExt;
use tracing::warn;

use super::context::Context;
use super::watch::{drive, drive_rest, Stop, Watched};
use crate::model::event::OutboxEvent;
use crate::model::metric;
use crate::model::outcome::Outcome;
use crate::model::transform::Transform;
use crate::route::{Dispatch, Items};
use crate::settle::{Attempt, Attempts};
use crate::sinks::gate::Counted;
use crate::sinks::{Budget, Share, Slot};

/// The publishing still going on after a hand-over: the requests of the lanes handed over.
type Rest = Pin<Box<dyn Future<Output = ()> + Send>>;

/// A batch's publish stage, ended: its run (the events, their items and answers), why it ended,
/// each item with its attempt, and the publishing still going on for the requests of lanes
/// handed over.
pub(super) struct Published {
    /// The batch, its items and their answers.
    pub(super) run: Arc<Run>,
    /// Why publishing ended.
    pub(super) stop: Stop,
    /// Each item with its attempt.
    pub(super) attempts: Attempts,
    rest: Rest,
}

/// Publishes `items` of `events` until `deadline`, watched: a lane that lags behind is handed
/// over, and `detach` is called once the claim loop may go on while the batch waits (see
/// `watch::may_detach`).
pub(super) async fn publish(
    ctx: &Arc<Context>,
    events: Vec<OutboxEvent>,
    items: Items,
    deadline: tokio::time::Instant,
    detach: impl FnMut(),
) -> Published {
    let run = Arc::new(Run::new(ctx, events, items, Budget::until(deadline)));
    let mut rest = run.publishing();
    let stop = drive(&*run, rest.as_mut(), &ctx.abort, detach).await;
    let attempts = match &stop {
        Stop::Done | Stop::Aborted => run.finish(stop == Stop::Aborted).attempts(&run, &[], None),
        Stop::HandOver(lanes) => {
            // None of their requests starts from now on; what the batch has seen is settled
            // without them.
            run.stop(lanes);
            run.snapshot().attempts(&run, &run.stopped(), None)
        }
    };
    Published {
        run,
        stop,
        attempts,
        rest,
    }
}

/// Publishes `items` of `events` whole, within `publish_timeout` (released at once when
/// shutdown's grace period is over): a batch of one lane's pairs or a replay's step, which hands
/// nothing on.
pub(super) async fn publish_whole(
    ctx: &Arc<Context>,
    events: Vec<OutboxEvent>,
    items: Items,
) -> Published {
    let deadline = tokio::time::Instant::now() + ctx.config.relay.publish_timeout;
    let run = Arc::new(Run::new(ctx, events, items, Budget::until(deadline)));
    let rest = run.publishing();
    let aborted = drive_rest(rest, &ctx.abort).await;
    let stop = if aborted { Stop::Aborted } else { Stop::Done };
    let attempts = run.finish(aborted).attempts(&run, &[], None);
    Published {
        run,
        stop,
        attempts,
        rest: Box::pin(std::future::ready(())),
    }
}

/// Publishes `event` to lane `d` as a probe: its one request goes whatever the breaker says,
/// within `publish_timeout`. Its attempt.
pub(super) async fn probe(ctx: &Arc<Context>, event: OutboxEvent, d: usize) -> Attempts {
    let items = Items::pairs([d], |_| true);
    let deadline = tokio::time::Instant::now() + ctx.config.relay.publish_timeout;
    let run = Arc::new(Run::new(ctx, vec![event], items, Budget::probe(deadline)));
    let probe = {
        let run = Arc::clone(&run);
        let deadline = run.deadline;
        Box::pin(async move {
            let _ = tokio::time::timeout_at(deadline, run.publish_share(d, &[0])).await;
        })
    };
    drive_rest(probe, &ctx.abort).await;
    run.snapshot().attempts(&run, &[], None)
}

impl Published {
    /// The items whose requests were still out when their lane was handed over.
    pub(super) fn in_flight(&self) -> Vec<usize> {
        let attempts = self.attempts.list.iter().enumerate();
        attempts
            .filter(|(_, (_, a))| matches!(a, Attempt::InFlight))
            .map(|(i, _)| i)
            .collect()
    }

    /// After a hand-over: waits for the requests still out (bounded by the budget, or cut short
    /// by shutdown), then the items `in_flight` with their attempts.
    pub(super) async fn late(self, in_flight: &[usize]) -> (Arc<Run>, Attempts) {
        let aborted = drive_rest(self.rest, &self.run.ctx.abort).await;
        let attempts = self
            .run
            .finish(aborted)
            .attempts(&self.run, &[], Some(in_flight));
        (self.run, attempts)
    }
}

/// One batch being published: its events and items, the slot each item's answer goes into, and
/// each lane's budget in the batch.
pub(super) struct Run {
    ctx: Arc<Context>,
    /// The batch's events.
    pub(super) events: Vec<OutboxEvent>,
    /// Its items.
    pub(super) items: Items,
    /// Per item: its answer once it comes, and whether its request started.
    pub(super) slots: Vec<Slot>,
    /// Per lane: its budget in this batch.
    budgets: Vec<Budget>,
    /// When publishing began.
    pub(super) started: tokio::time::Instant,
    /// When the budget ends.
    deadline: tokio::time::Instant,
}

/// What a batch's items got, at one moment: each item's answer and whether its request started.
pub(super) struct Answers {
    answers: Vec<Option<(Outcome, Counted)>>,
    started: Vec<bool>,
}

impl Watched for Run {
    fn items(&self) -> &Items {
        &self.items
    }

    fn lanes(&self) -> usize {
        self.budgets.len()
    }

    fn started(&self) -> tokio::time::Instant {
        self.started
    }

    fn answered(&self, i: usize) -> bool {
        self.slots[i].answer().is_some()
    }

    fn silent_for(&self, d: usize) -> std::time::Duration {
        self.ctx.lanes[d].gate.silent_for(std::time::Instant::now())
    }
}

impl Run {
    /// A batch of `items` of `events` over `ctx`'s lanes, each lane's budget a copy of `budget`.
    fn new(ctx: &Arc<Context>, events: Vec<OutboxEvent>, items: Items, budget: Budget) -> Self {
        Self {
            slots: items.list.iter().map(|_| Slot::default()).collect(),
            budgets: (0..ctx.lanes.len()).map(|_| budget.copy()).collect(),
            started: tokio::time::Instant::now(),
            deadline: budget.deadline(),
            ctx: Arc::clone(ctx),
            events,
            items,
        }
    }

    /// The publishing of the whole batch, bounded by its budget, as a future of its own.
    fn publishing(self: &Arc<Self>) -> Rest {
        let run = Arc::clone(self);
        Box::pin(async move {
            let _ = tokio::time::timeout_at(run.deadline, run.publish()).await;
        })
    }

    /// The event of item `i`.
    fn event(&self, i: usize) -> &OutboxEvent {
        &self.events[self.items.list[i].event]
    }

    /// Stops the lanes `lanes`: none of their requests starts from now on.
    fn stop(&self, lanes: &[usize]) {
        for &d in lanes {
            self.budgets[d].stop();
            self.ctx.lanes[d].gate.wake();
        }
    }

    /// Which lanes have stopped (handed over).
    fn stopped(&self) -> Vec<bool> {
        self.budgets.iter().map(Budget::is_stopped).collect()
    }

    /// The answers so far.
    fn snapshot(&self) -> Answers {
        Answers {
            answers: self.slots.iter().map(|s| s.answer().cloned()).collect(),
            started: self.slots.iter().map(Slot::started).collect(),
        }
    }

    /// The answers at the end. A lane that started requests and got no answer at all within the
    /// whole budget is not making progress: its unanswered requests count as failed (counted on
    /// its breaker), or it would be retried at no cost forever — unless shutdown cut the batch
    /// short or the lane was handed over.
    fn finish(&self, aborted: bool) -> Answers {
        let mut end = self.snapshot();
        let stopped = self.stopped();
        let items = &self.items.list;
        let sent = |i: usize| items[i].dispatch == Dispatch::Send;
        // One pass over the items, not one per lane: a batch may span thousands of lanes.
        let mut lanes: HashMap<usize, (bool, bool)> = HashMap::new();
        for i in (0..items.len()).filter(|&i| sent(i)) {
            if let Some(d) = items[i].lane {
                let (started, unanswered) = lanes.entry(d).or_insert((false, true));
                *started |= end.started[i];
                *unanswered &= end.answers[i].is_none();
            }
        }
        let stalled: Vec<usize> = lanes
            .into_iter()
            .filter(|&(d, (started, unanswered))| !aborted && !stopped[d] && started && unanswered)
            .map(|(d, _)| d)
            .collect();
        let publish_timeout = self.ctx.config.relay.publish_timeout;
        for d in stalled {
            let mine = (0..items.len()).filter(|&i| items[i].lane == Some(d) && sent(i));
            for i in mine.filter(|&i| end.started[i]) {
                let outcome = Outcome::retry(format!(
                    "no answer within publish_timeout ({})",
                    humantime::format_duration(publish_timeout)
                ));
                let counted = self.ctx.lanes[d].gate.answered(&outcome);
                end.answers[i] = Some((outcome, counted));
            }
        }
        end
    }

    /// Publishes the batch, each item's answer going into its slot as it comes.
    ///
    /// Items of an ordered lane that share a key form a chain, published one after the other; a
    /// chain stops at its first failure, so a later event of a key is never published before an
    /// earlier one succeeded, and when its lane's budget is over (the rest of the key goes on
    /// later, in order). Chains run side by side, each at its own pace: a slow request holds back
    /// only its own key. Every other item of a lane goes out in one publish; the lanes run side
    /// by side.
    async fn publish(&self) {
        let mut singles: Vec<Vec<usize>> = vec![Vec::new(); self.ctx.lanes.len()];
        let mut chains: Vec<(usize, Vec<usize>)> = Vec::new();
        let mut chain_of_key: HashMap<(usize, &str), usize> = HashMap::new();
        for i in self.items.sendable() {
            let Some(d) = self.items.list[i].lane else {
                continue;
            };
            let event = self.event(i);
            if !self.ctx.lanes[d].keeps_order_of(event) {
                singles[d].push(i);
                continue;
            }
            let key = (d, event.key.as_deref().unwrap_or_default());
            let c = *chain_of_key.entry(key).or_insert_with(|| {
                chains.push((d, Vec::new()));
                chains.len() - 1
            });
            chains[c].1.push(i);
        }
        // A key with one event here needs no sequencing: it joins its lane's singles.
        chains.retain(|(d, chain)| match chain.as_slice() {
            [only] => {
                singles[*d].push(*only);
                false
            }
            _ => true,
        });
        let lanes = singles
            .iter()
            .enumerate()
            .filter(|(_, items)| !items.is_empty())
            .map(|(d, items)| self.publish_share(d, items));
        let chains = chains
            .iter()
            .map(|(d, chain)| self.publish_chain(*d, chain));
        futures::future::join(join_all(lanes), join_all(chains)).await;
    }

    /// Publishes one key's chain in order, stopping at the first event that neither was delivered
    /// nor may be skipped (`on_dead = "skip"` lets a rejected event's successors go on), or when
    /// the lane's budget is over.
    async fn publish_chain(&self, d: usize, chain: &[usize]) {
        for &i in chain {
            if self.budgets[d].is_over() {
                break;
            }
            self.publish_share(d, &[i]).await;
            let go_on = match self.slots[i].outcome() {
                Some(Outcome::Delivered) => true,
                Some(Outcome::Rejected { .. }) => self.ctx.lanes[d].skips_dead(),
                Some(Outcome::Retry { .. }) | None => false,
            };
            if !go_on {
                break;
            }
        }
    }

    /// Publishes the items `indexes` of lane `d` in one call to its sink, each as the lane's
    /// `transform` makes it (an item it fails on is dead-lettered unsent). A sink that panics
    /// fails the items it left without an outcome.
    async fn publish_share(&self, d: usize, indexes: &[usize]) {
        let lane = &self.ctx.lanes[d];
        let Some(transform) = &lane.config.transform else {
            let events: Vec<&OutboxEvent> = indexes.iter().map(|&i| self.event(i)).collect();
            return self.publish_paced(d, indexes, &events).await;
        };
        let root = Transform::root();
        let refused = Share::new(&lane.gate, &self.budgets[d], &self.slots, indexes);
        let mut sent = Vec::with_capacity(indexes.len());
        let mut events = Vec::with_capacity(indexes.len());
        for (n, &i) in indexes.iter().enumerate() {
            match transform.event(&root, self.event(i)) {
                Ok(event) => {
                    sent.push(i);
                    events.push(event);
                }
                Err(reason) => refused.refuse(n, reason),
            }
        }
        let events: Vec<&OutboxEvent> = events.iter().collect();
        if !events.is_empty() {
            self.publish_paced(d, &sent, &events).await;
        }
    }

    /// Publishes `events` (the items `indexes` of lane `d`) as fast as the lane's `rate_limit`
    /// lets them: each slice of tokens taken goes out at once, beside the slices still in flight
    /// (the limit paces starts; `concurrency` still bounds requests in flight). What has no token
    /// by the budget's deadline, or when shutdown begins, is left without an outcome: it goes on
    /// later, not an attempt.
    async fn publish_paced(&self, d: usize, indexes: &[usize], events: &[&OutboxEvent]) {
        let Some(rate) = &self.ctx.lanes[d].rate else {
            return self.publish_events(d, indexes, events).await;
        };
        let budget = &self.budgets[d];
        let mut sending = FuturesUnordered::new();
        let mut from = 0;
        while from < events.len() && !budget.is_stopped() {
            let take = rate.take(events.len() - from, budget.deadline());
            tokio::pin!(take);
            let granted = loop {
                tokio::select! {
                    granted = &mut take => break granted,
                    Some(()) = sending.next(), if !sending.is_empty() => {}
                    _ = self.ctx.stopping.cancelled() => break 0,
                }
            };
            if granted == 0 {
                break;
            }
            let to = (from + granted).min(events.len());
            sending.push(self.publish_events(d, &indexes[from..to], &events[from..to]));
            from = to;
        }
        while sending.next().await.is_some() {}
    }

    /// Publishes `events`, the items `indexes` of lane `d` as the lane sends them.
    async fn publish_events(&self, d: usize, indexes: &[usize], events: &[&OutboxEvent]) {
        let lane = &self.ctx.lanes[d];
        let share = Share::new(&lane.gate, &self.budgets[d], &self.slots, indexes);
        let started = Instant::now();
        let wall = std::time::SystemTime::now();
        let sink = match lane.sink() {
            Ok(sink) => sink,
            Err(reason) => {
                // Each event counts an attempt, so that the breaker opens and the reason shows.
                if let Some(_permit) = share.admit_all().await {
                    for i in 0..events.len() {
                        share.record(i, Outcome::retry(reason.clone()));
                    }
                }
                return;
            }
        };
        let publish = sink.publish_until(events, &share);
        if let Err(panic) = std::panic::AssertUnwindSafe(publish).catch_unwind().await {
            let reason = format!("the sink panicked: {}", panic_message(&*panic));
            warn!(destination = %lane.name(), error = %reason, "sink panicked; its unfinished events will be retried");
            for (i, &item) in indexes.iter().enumerate() {
                if self.slots[item].started() {
                    share.record(i, Outcome::retry(reason.clone()));
                }
            }
        }
        metrics::histogram!(metric::PUBLISH_SECONDS, "destination" => lane.series().to_owned())
            .record(started.elapsed().as_secs_f64());
        if crate::otlp::enabled() {
            for &i in indexes {
                crate::otlp::publish_span(
                    self.event(i),
                    lane.name(),
                    self.slots[i].outcome(),
                    wall,
                );
            }
        }
    }
}

impl Answers {
    /// Each item of `run` (or only those in `only`) with its attempt: what publishing left of it,
    /// its lane handed over when `handed[lane]`. The one place where what publishing did becomes
    /// the attempts the settle judges.
    fn attempts(&self, run: &Run, handed: &[bool], only: Option<&[usize]>) -> Attempts {
        let attempt = |i: usize| {
            let item = run.items.list[i];
            let handed_over = item
                .lane
                .is_some_and(|d| handed.get(d).copied().unwrap_or(false));
            let started = self.started[i];
            let attempt = match (item.dispatch, &self.answers[i]) {
                (Dispatch::Unroutable, _) => Attempt::Unroutable,
                (Dispatch::Hold, _) => Attempt::Held,
                (Dispatch::Behind, _) => Attempt::Behind,
                (Dispatch::Send, Some((outcome, counted))) => {
                    Attempt::Answered(outcome.clone(), *counted)
                }
                (Dispatch::Send, None) if handed_over && started => Attempt::InFlight,
                (Dispatch::Send, None) if handed_over => Attempt::HandedOver,
                (Dispatch::Send, None) => Attempt::NotSent,
            };
            (item, attempt)
        };
        match only {
            Some(only) => Attempts {
                list: only.iter().map(|&i| attempt(i)).collect(),
                spans: Vec::new(),
            },
            None => Attempts {
                list: (0..run.items.list.len()).map(attempt).collect(),
                spans: run.items.spans.clone(),
            },
        }
    }
}

/// The text of a panic's payload.
pub(super) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into())
}
