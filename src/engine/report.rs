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

/// Counts a settled batch's outcomes per (destination, topic): one metric update per group, not
/// per event, to keep the hot path cheap.
pub(super) fn record_outcomes(events: &[OutboxEvent], plan: &settle::SettlePlan) {
    let by_id: HashMap<Uuid, &OutboxEvent> = events.iter().map(|e| (e.id, e)).collect();
    let now = chrono::Utc::now();
    for (destination, ids) in plan.delivered.iter().chain(&plan.pairs_delivered) {
        let mut per_topic: HashMap<&str, u64> = HashMap::new();
        let latency = metrics::histogram!(metric::COMMIT_TO_PUBLISH_SECONDS, "destination" => destination.clone());
        for id in ids {
            if let Some(e) = by_id.get(id) {
                *per_topic.entry(e.topic.as_str()).or_default() += 1;
                latency.record(
                    (now - e.created_at).num_microseconds().unwrap_or(0).max(0) as f64 / 1e6,
                );
            }
        }
        metric::count_delivered(destination, ids.len() as u64);
        for (topic, n) in per_topic {
            metrics::counter!(metric::PUBLISHED_TOTAL, "destination" => destination.clone(), "topic" => topic.to_owned())
                .increment(n);
        }
    }
    let mut held: HashMap<&str, u64> = HashMap::new();
    for h in &plan.held {
        *held.entry(h.destination.as_str()).or_default() += 1;
    }
    for p in plan.pairs.iter().filter(|p| p.held) {
        *held.entry(p.destination.as_str()).or_default() += 1;
    }
    for b in &plan.bundles {
        *held.entry(b.destination.as_str()).or_default() += b.count as u64;
    }
    for (destination, n) in held {
        metrics::counter!(metric::HELD_TOTAL, "destination" => destination.to_owned()).increment(n);
    }
    let mut failures: HashMap<(&str, &str, bool), u64> = HashMap::new();
    for f in &plan.failed {
        if let Some(e) = by_id.get(&f.id) {
            *failures
                .entry((
                    f.destination.as_deref().unwrap_or("(unrouted)"),
                    e.topic.as_str(),
                    f.dead,
                ))
                .or_default() += 1;
        }
    }
    for p in plan.pairs.iter().filter(|p| p.failed) {
        if let Some(e) = by_id.get(&p.event_id) {
            *failures
                .entry((p.destination.as_str(), e.topic.as_str(), p.dead))
                .or_default() += 1;
        }
    }
    for ((destination, topic, dead), n) in failures {
        let name = if dead {
            metric::DEAD_LETTERED_TOTAL
        } else {
            metric::FAILED_TOTAL
        };
        metrics::counter!(name, "destination" => destination.to_owned(), "topic" => topic.to_owned()).increment(n);
    }
}
