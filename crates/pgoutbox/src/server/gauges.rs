//! The backlog gauges (pending, backoff, held, dead, lag per destination and topic), refreshed
//! on an interval by each relay from one query over the pending and dead indexes — never per
//! scrape — and the console's samples of the last hour.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::engine::RelayView;
use crate::model::event::topic_label;
use crate::model::metric::*;
use crate::store::backlog::{Backlog, BacklogRow};
use crate::store::operators::StoredSample;

/// Reads the backlog per (destination, topic) from the relay's store ([`crate::store::backlog`]);
/// rows not yet routed count for each destination of `relay` whose topics match (`(unrouted)`
/// when none does).
pub async fn backlog(
    relay: &RelayView,
) -> crate::Result<std::collections::HashMap<(String, String), Backlog>> {
    let rows = crate::store::backlog::rows(relay.store()).await?;
    let mut merged: std::collections::HashMap<(String, String), Backlog> = Default::default();
    for BacklogRow {
        destination,
        topic,
        backlog: b,
    } in rows
    {
        let topic = topic_label(topic.as_deref()).to_owned();
        let destinations = match destination {
            Some(d) => vec![d],
            None => {
                let routed = relay.destinations_of_topic(&topic);
                if routed.is_empty() {
                    vec!["(unrouted)".into()]
                } else {
                    routed
                }
            }
        };
        for destination in destinations {
            *merged.entry((destination, topic.clone())).or_default() += b;
        }
    }
    Ok(merged)
}

/// This relay's name among the relays sharing the chart: host and process id.
fn relay_name() -> String {
    let host = super::host_name().unwrap_or_else(|| "relay".into());
    format!("{host}:{}", std::process::id())
}

/// Stores `sample` for the chart every relay's console shows. A failure costs only that point.
async fn share(relay: &RelayView, me: &str, sample: &Sample) {
    let stored = crate::store::operators::NewSample {
        relay: me,
        at: sample.at,
        lag_seconds: sample.lag_seconds,
        pending: sample.pending,
        delivered: serde_json::json!(sample.per_destination),
    };
    if let Err(e) =
        crate::store::operators::write_sample(relay.store(), &stored, Samples::SPAN).await
    {
        tracing::debug!(error = %crate::error_chain(&e), "cannot store the chart's sample");
    }
}

/// Every relay's stored samples as the chart's points, one per `interval`: lag and pending the
/// largest any relay saw (they read the same backlog), delivery rates summed over the relays
/// (each relay's last sample in the interval).
pub fn merge_samples(stored: &[StoredSample], interval: Duration) -> Vec<Sample> {
    use std::collections::BTreeMap;
    let step = (interval.as_micros() as i64).max(1);
    let mut buckets: BTreeMap<i64, BTreeMap<&str, &StoredSample>> = BTreeMap::new();
    for s in stored {
        buckets
            .entry(s.at.timestamp_micros().div_euclid(step))
            .or_default()
            .insert(s.relay.as_str(), s);
    }
    buckets
        .into_values()
        .map(|relays| {
            let mut point = Sample {
                at: chrono::DateTime::<chrono::Utc>::MIN_UTC,
                lag_seconds: 0.0,
                pending: 0,
                published_per_second: 0.0,
                per_destination: BTreeMap::new(),
            };
            for s in relays.values() {
                point.at = point.at.max(s.at);
                point.lag_seconds = point.lag_seconds.max(s.lag_seconds);
                point.pending = point.pending.max(s.pending);
                let rates: BTreeMap<String, f64> =
                    serde_json::from_str(s.delivered.get()).unwrap_or_default();
                for (destination, rate) in rates {
                    *point.per_destination.entry(destination).or_default() += rate;
                }
            }
            point.published_per_second = point.per_destination.values().sum();
            point
        })
        .collect()
}

/// One point of the console's chart.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Sample {
    /// When it was taken.
    pub at: chrono::DateTime<chrono::Utc>,
    /// The oldest pending event's age, over every destination.
    pub lag_seconds: f64,
    /// Pending events (due and waiting), over every destination.
    pub pending: i64,
    /// Events this relay delivered per second since the previous sample.
    pub published_per_second: f64,
    /// The same per destination.
    pub per_destination: std::collections::BTreeMap<String, f64>,
}

/// The last hour of [`Sample`]s, taken by [`refresh_gauges`] at each refresh.
#[derive(Debug, Default)]
pub struct Samples {
    kept: std::sync::Mutex<std::collections::VecDeque<Sample>>,
}

impl Samples {
    /// How far back samples are kept.
    pub const SPAN: Duration = Duration::from_secs(3600);

    /// Adds a sample and forgets those older than [`Samples::SPAN`].
    pub fn push(&self, sample: Sample) {
        if let Ok(mut kept) = self.kept.lock() {
            let horizon = sample.at - chrono::Duration::from_std(Self::SPAN).unwrap_or_default();
            while kept.front().is_some_and(|s| s.at < horizon) {
                kept.pop_front();
            }
            kept.push_back(sample);
        }
    }

    /// The newest sample.
    pub fn last(&self) -> Option<Sample> {
        self.kept.lock().ok().and_then(|k| k.back().cloned())
    }

    /// The samples kept, oldest first.
    pub fn all(&self) -> Vec<Sample> {
        self.kept
            .lock()
            .map(|k| k.iter().cloned().collect())
            .unwrap_or_default()
    }
}

/// Refreshes `relay`'s backlog gauges every `interval` until `stop`, and adds a [`Sample`] to
/// `samples` each time.
pub async fn refresh_gauges(
    relay: impl Into<RelayView>,
    interval: Duration,
    samples: Arc<Samples>,
    stop: CancellationToken,
) {
    let relay = relay.into();
    let mut known: std::collections::HashSet<(String, String)> = std::collections::HashSet::new();
    let me = relay_name();
    let mut last = (Instant::now(), crate::model::metric::delivered_so_far());
    loop {
        match backlog(&relay).await {
            Ok(merged) => {
                let delivered = crate::model::metric::delivered_so_far();
                let elapsed = last.0.elapsed().as_secs_f64().max(1e-3);
                let per_destination: std::collections::BTreeMap<String, f64> = delivered
                    .iter()
                    .map(|(d, n)| {
                        let before = last.1.get(d).copied().unwrap_or(0);
                        (d.clone(), n.saturating_sub(before) as f64 / elapsed)
                    })
                    .collect();
                let sample = Sample {
                    at: chrono::Utc::now(),
                    lag_seconds: merged.values().map(|b| b.lag).fold(0.0, f64::max),
                    pending: merged.values().map(|b| b.due + b.backoff).sum(),
                    published_per_second: per_destination.values().sum(),
                    per_destination,
                };
                share(&relay, &me, &sample).await;
                // Keeps pgoutbox_relay_stalled current whether or not anyone calls /readyz.
                if let Err(e) = relay.stall().await {
                    tracing::debug!(error = %crate::error_chain(&e), "cannot check for a stall");
                }
                samples.push(sample);
                last = (Instant::now(), delivered);
                // The destinations managed at runtime are counted together, their topics too.
                let mut series: std::collections::HashMap<(String, String), Backlog> =
                    Default::default();
                for ((destination, topic), b) in merged {
                    let label = relay.series(&destination);
                    let key = (label.to_owned(), series_topic(label, &topic).to_owned());
                    *series.entry(key).or_default() += b;
                }
                // Series that emptied go back to zero rather than keep their last value.
                for key in known.iter() {
                    series.entry(key.clone()).or_default();
                }
                for ((destination, topic), b) in &series {
                    let labels = [
                        ("destination", destination.clone()),
                        ("topic", topic.clone()),
                    ];
                    metrics::gauge!(PENDING_DUE, &labels).set(b.due as f64);
                    metrics::gauge!(PENDING_BACKOFF, &labels).set(b.backoff as f64);
                    metrics::gauge!(DEAD, &labels).set(b.dead as f64);
                    metrics::gauge!(OLDEST_PENDING_AGE_SECONDS, &labels).set(b.lag);
                }
                known.extend(series.into_keys());
            }
            Err(e) => {
                metrics::counter!(DB_ERRORS_TOTAL).increment(1);
                warn!(error = %crate::error_chain(&e), "cannot refresh the backlog gauges");
            }
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(interval) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::event::StoredJson;

    fn stored(relay: &str, at_ms: i64, lag: f64, pending: i64, delivered: &str) -> StoredSample {
        StoredSample {
            at: chrono::DateTime::from_timestamp_millis(at_ms).expect("time"),
            relay: relay.into(),
            lag_seconds: lag,
            pending,
            delivered: StoredJson::parse(delivered.into()).expect("json"),
        }
    }

    #[test]
    fn relays_samples_merge_into_one_point_per_interval() {
        let interval = Duration::from_secs(15);
        let points = merge_samples(
            &[
                stored("a", 1_000, 2.0, 10, r#"{"hooks": 100.0}"#),
                stored("b", 3_000, 5.0, 12, r#"{"hooks": 50.0, "nats": 7.0}"#),
                // The same relay twice in one interval: its last sample counts.
                stored("a", 9_000, 1.0, 9, r#"{"hooks": 80.0}"#),
                stored("a", 16_000, 0.5, 4, r#"{"hooks": 90.0}"#),
                stored("c", 17_000, 0.0, 0, "[1, 2]"),
            ],
            interval,
        );
        assert_eq!(points.len(), 2);
        let first = &points[0];
        assert_eq!(first.lag_seconds, 5.0);
        assert_eq!(first.pending, 12);
        assert_eq!(first.per_destination["hooks"], 130.0);
        assert_eq!(first.per_destination["nats"], 7.0);
        assert_eq!(first.published_per_second, 137.0);
        assert_eq!(first.at.timestamp_millis(), 9_000);
        assert_eq!(points[1].per_destination["hooks"], 90.0);
        assert_eq!(points[1].pending, 4);
    }
}
