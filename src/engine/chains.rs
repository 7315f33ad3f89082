//! Publishing a batch's items, lane by lane: each lane's unordered items in one call to its sink,
//! each ordered key's items as a chain, one after the other. Every call goes through the lane's
//! gate ([`crate::sinks::Share`]), so `concurrency` holds for the whole process.

use std::collections::HashMap;
use std::time::Instant;

use futures::future::join_all;
use futures::stream::{FuturesUnordered, StreamExt};
use futures::FutureExt;
use tracing::warn;

use super::batch::Run;
use super::items::Items;
use super::report::panic_message;
use super::Relay;
use crate::gate::Counted;
use crate::model::event::OutboxEvent;
use crate::model::metric;
use crate::model::outcome::Outcome;
use crate::model::transform::Transform;
use crate::sinks::Share;

impl Relay {
    /// Publishes the `items` of `events` whole, within `publish_timeout` (released at once when
    /// shutdown aborts): a batch of one lane's pairs or of a replay's step, which hands nothing
    /// on. Each item's answer (`None` when it got none), and whether shutdown aborted it.
    pub(super) async fn publish_whole(
        &self,
        events: &[OutboxEvent],
        items: &Items,
    ) -> (Vec<Option<(Outcome, Counted)>>, bool) {
        let timeout = self.config.relay.publish_timeout;
        let deadline = tokio::time::Instant::now() + timeout;
        let run = Run::new(events, items, self.lanes.len(), deadline);
        let aborted = tokio::select! {
            _ = tokio::time::timeout_at(deadline, self.publish_run(&run)) => false,
            _ = self.abort.cancelled() => true,
        };
        (run.finish(aborted, &self.lanes, timeout).0, aborted)
    }

    /// Publishes a batch, each item's outcome going into `run` as it comes.
    ///
    /// Items of an ordered lane that share a key form a chain, published one after the other; a
    /// chain stops at its first failure, so a later event of a key is never published before an
    /// earlier one succeeded, and when its lane's budget is over (the rest of the key goes on
    /// later, in order). Chains run side by side, each at its own pace: a slow request holds back
    /// only its own key. Every other item of a lane goes out in one publish; the lanes run side
    /// by side.
    pub(super) async fn publish_run(&self, run: &Run<'_>) {
        let mut singles: Vec<Vec<usize>> = vec![Vec::new(); self.lanes.len()];
        let mut chains: Vec<(usize, Vec<usize>)> = Vec::new();
        let mut chain_of_key: HashMap<(usize, &str), usize> = HashMap::new();
        for i in run.items.sendable() {
            let Some(d) = run.items.list[i].lane else {
                continue;
            };
            let event = run.event(i);
            if !self.lanes[d].keeps_order_of(event) {
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
            .map(|(d, items)| self.publish_share(run, d, items));
        futures::future::join(
            join_all(lanes),
            join_all(
                chains
                    .iter()
                    .map(|(d, chain)| self.publish_chain(run, *d, chain)),
            ),
        )
        .await;
    }

    /// Publishes one key's chain in order, stopping at the first event that neither was delivered
    /// nor may be skipped (`on_dead = "skip"` lets a rejected event's successors go on), or when
    /// the lane's budget is over.
    async fn publish_chain(&self, run: &Run<'_>, d: usize, chain: &[usize]) {
        for &i in chain {
            if run.budgets[d].is_over() {
                break;
            }
            self.publish_share(run, d, &[i]).await;
            let go_on = match run.slots[i].outcome() {
                Some(Outcome::Delivered) => true,
                Some(Outcome::Rejected { .. }) => self.lanes[d].skips_dead(),
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
    pub(super) async fn publish_share(&self, run: &Run<'_>, d: usize, indexes: &[usize]) {
        let lane = &self.lanes[d];
        let Some(transform) = &lane.config.transform else {
            let events: Vec<&OutboxEvent> = indexes.iter().map(|&i| run.event(i)).collect();
            return self.publish_paced(run, d, indexes, &events).await;
        };
        let root = Transform::root();
        let refused = Share::new(&lane.gate, &run.budgets[d], &run.slots, indexes);
        let mut sent = Vec::with_capacity(indexes.len());
        let mut events = Vec::with_capacity(indexes.len());
        for (n, &i) in indexes.iter().enumerate() {
            match transform.event(&root, run.event(i)) {
                Ok(event) => {
                    sent.push(i);
                    events.push(event);
                }
                Err(reason) => refused.refuse(n, reason),
            }
        }
        let events: Vec<&OutboxEvent> = events.iter().collect();
        if !events.is_empty() {
            self.publish_paced(run, d, &sent, &events).await;
        }
    }

    /// Publishes `events` (the items `indexes` of lane `d`) as fast as the lane's `rate_limit`
    /// lets them: each slice of tokens taken goes out at once, beside the slices still in flight
    /// (the limit paces starts; `concurrency` still bounds requests in flight). What has no token
    /// by the budget's deadline, or when shutdown begins, is left without an outcome: handed on,
    /// not an attempt.
    async fn publish_paced(
        &self,
        run: &Run<'_>,
        d: usize,
        indexes: &[usize],
        events: &[&OutboxEvent],
    ) {
        let Some(rate) = &self.lanes[d].rate else {
            return self.publish_events(run, d, indexes, events).await;
        };
        let budget = &run.budgets[d];
        let mut sending = FuturesUnordered::new();
        let mut from = 0;
        while from < events.len() && !budget.is_stopped() {
            let take = rate.take(events.len() - from, budget.deadline());
            tokio::pin!(take);
            let granted = loop {
                tokio::select! {
                    granted = &mut take => break granted,
                    Some(()) = sending.next(), if !sending.is_empty() => {}
                    _ = self.stopping.cancelled() => break 0,
                }
            };
            if granted == 0 {
                break;
            }
            let to = (from + granted).min(events.len());
            sending.push(self.publish_events(run, d, &indexes[from..to], &events[from..to]));
            from = to;
        }
        while sending.next().await.is_some() {}
    }

    /// Publishes `events`, the items `indexes` of lane `d` as the lane sends them.
    async fn publish_events(
        &self,
        run: &Run<'_>,
        d: usize,
        indexes: &[usize],
        events: &[&OutboxEvent],
    ) {
        let lane = &self.lanes[d];
        let share = Share::new(&lane.gate, &run.budgets[d], &run.slots, indexes);
        let started = Instant::now();
        let wall = std::time::SystemTime::now();
        let publish = lane.sink.publish_until(events, &share);
        if let Err(panic) = std::panic::AssertUnwindSafe(publish).catch_unwind().await {
            let reason = format!("the sink panicked: {}", panic_message(&*panic));
            warn!(destination = %lane.name, error = %reason, "sink panicked; its unfinished events will be retried");
            for (i, &item) in indexes.iter().enumerate() {
                if run.slots[item].started() {
                    share.record(i, Outcome::retry(reason.clone()));
                }
            }
        }
        metrics::histogram!(metric::PUBLISH_SECONDS, "destination" => lane.name.clone())
            .record(started.elapsed().as_secs_f64());
        if crate::otlp::enabled() {
            for &i in indexes {
                crate::otlp::publish_span(run.event(i), &lane.name, run.slots[i].outcome(), wall);
            }
        }
    }
}
