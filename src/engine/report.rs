//! What batches did: their counts, their metrics and their log lines.

use std::collections::HashMap;

use tracing::debug;
use uuid::Uuid;

use crate::model::event::OutboxEvent;
use crate::model::metric;
use crate::settle;
use crate::settle::verdict::Verdict;
pub use crate::settle::BatchReport;

/// Logs a failed attempt, at debug: per-event failures would make the log scale with traffic;
/// every attempt is in the attempt history, and each destination's failures are summed up in one
/// line an interval (see `probe.rs`).
pub(super) fn log_failed(event: &OutboxEvent, destination: Option<&str>, v: &Verdict) {
    if let Verdict::Failed(f) = v {
        debug!(
            event_id = %event.id,
            topic = %event.topic,
            destination = destination.unwrap_or("-"),
            attempt = event.attempts + 1,
            dead = f.dead,
            error = %f.error,
            "publish failed"
        );
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

/// How far [`ById::find`] looks ahead of its walk before it asks the map: a destination's ids
/// come in its batch's order, with gaps where it took no event (filtered, held, failed).
const LOOK_AHEAD: usize = 32;

/// A batch's events found by id: walking ahead when the ids come in the events' order (no
/// hashing: this runs for every delivered pair), by a map built on the first id out of order.
struct ById<'a> {
    events: &'a [OutboxEvent],
    map: std::cell::OnceCell<HashMap<Uuid, usize>>,
}

impl<'a> ById<'a> {
    fn new(events: &'a [OutboxEvent]) -> Self {
        Self {
            events,
            map: std::cell::OnceCell::new(),
        }
    }

    /// The event `id`, looked for from `walk` on (which moves past it).
    fn find(&self, walk: &mut usize, id: &Uuid) -> Option<&'a OutboxEvent> {
        let ahead = self.events.get(*walk..).unwrap_or_default();
        let at = match ahead.iter().take(LOOK_AHEAD).position(|e| e.id == *id) {
            Some(offset) => *walk + offset,
            None => *self
                .map
                .get_or_init(|| {
                    self.events
                        .iter()
                        .enumerate()
                        .map(|(i, e)| (e.id, i))
                        .collect()
                })
                .get(id)?,
        };
        *walk = at + 1;
        self.events.get(at)
    }
}

/// Counts by key, for the few distinct keys of a batch (topics, destinations): a look at the
/// last key, then a short list, instead of hashing each entry.
struct Tally<K>(Vec<(K, u64)>);

impl<K: PartialEq> Tally<K> {
    fn add(&mut self, key: K, n: u64) {
        match self.0.iter_mut().rev().find(|(k, _)| *k == key) {
            Some((_, count)) => *count += n,
            None => self.0.push((key, n)),
        }
    }
}

/// Counts a settled batch's outcomes per (destination, topic): one metric update per group, not
/// per event, to keep the hot path cheap.
pub(super) fn record_outcomes(events: &[OutboxEvent], plan: &settle::SettlePlan) {
    let by_id = ById::new(events);
    let now = chrono::Utc::now();
    for (destination, ids) in plan.delivered.iter().chain(&plan.pairs_delivered) {
        let mut per_topic = Tally(Vec::new());
        let latency = metrics::histogram!(metric::COMMIT_TO_PUBLISH_SECONDS, "destination" => destination.clone());
        let mut walk = 0;
        for id in ids {
            if let Some(e) = by_id.find(&mut walk, id) {
                per_topic.add(e.topic.as_str(), 1);
                latency.record(
                    (now - e.created_at).num_microseconds().unwrap_or(0).max(0) as f64 / 1e6,
                );
            }
        }
        metric::count_delivered(destination, ids.len() as u64);
        for (topic, n) in per_topic.0 {
            metrics::counter!(metric::PUBLISHED_TOTAL, "destination" => destination.clone(), "topic" => topic.to_owned())
                .increment(n);
        }
    }
    let mut held = Tally(Vec::new());
    for h in &plan.held {
        held.add(h.destination.as_str(), 1);
    }
    for p in plan.pairs.iter().filter(|p| p.held) {
        held.add(p.destination.as_str(), 1);
    }
    for b in &plan.bundles {
        held.add(b.destination.as_str(), b.count as u64);
    }
    for (destination, n) in held.0 {
        metrics::counter!(metric::HELD_TOTAL, "destination" => destination.to_owned()).increment(n);
    }
    let mut failures = Tally(Vec::new());
    let mut walk = 0;
    for f in &plan.failed {
        if let Some(e) = by_id.find(&mut walk, &f.id) {
            let destination = f.destination.as_deref().unwrap_or("(unrouted)");
            failures.add((destination, e.topic.as_str(), f.dead), 1);
        }
    }
    let mut walk = 0;
    for p in plan.pairs.iter().filter(|p| p.failed) {
        if let Some(e) = by_id.find(&mut walk, &p.event_id) {
            failures.add((p.destination.as_str(), e.topic.as_str(), p.dead), 1);
        }
    }
    for ((destination, topic, dead), n) in failures.0 {
        let name = if dead {
            metric::DEAD_LETTERED_TOTAL
        } else {
            metric::FAILED_TOTAL
        };
        metrics::counter!(name, "destination" => destination.to_owned(), "topic" => topic.to_owned()).increment(n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::event::testing::event;

    /// Ids looked up in one walk (as positions in a batch of 100 events) → what is found.
    #[test]
    fn events_are_found_by_id_in_order_with_gaps_and_out_of_order() {
        let events: Vec<OutboxEvent> = (0..100).map(|_| event("t", None, &[])).collect();
        let by_id = ById::new(&events);
        let cases: Vec<Vec<usize>> = vec![
            (0..100).collect(),
            (0..100).step_by(3).collect(),
            vec![5, 90, 91],
            (0..100).rev().collect(),
            vec![50, 10, 60, 0, 99],
        ];
        for (i, positions) in cases.into_iter().enumerate() {
            let mut walk = 0;
            let found: Vec<usize> = positions
                .iter()
                .filter_map(|&p| by_id.find(&mut walk, &events[p].id))
                .map(|e| events.iter().position(|x| x.id == e.id).expect("an event"))
                .collect();
            assert_eq!(found, positions, "case {i}");
        }
        let mut walk = 0;
        assert!(
            by_id.find(&mut walk, &Uuid::new_v4()).is_none(),
            "not in the batch"
        );
        assert!(ById::new(&[]).find(&mut 0, &events[0].id).is_none());
    }

    #[test]
    fn a_tally_counts_per_key() {
        let mut tally = Tally(Vec::new());
        for (key, n) in [("a", 1), ("a", 2), ("b", 1), ("a", 1), ("c", 5)] {
            tally.add(key, n);
        }
        assert_eq!(tally.0, vec![("a", 4), ("b", 1), ("c", 5)]);
    }
}
