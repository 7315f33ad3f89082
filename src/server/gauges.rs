//! The backlog gauges (pending, backoff, held, dead, lag per destination and topic), refreshed
//! on an interval by each relay from one query over the pending and dead indexes — never per
//! scrape — and the console's samples of the last hour.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::engine::Relay;
use crate::model::event::topic_label;
use crate::model::metric::*;
use crate::store::backlog::{Backlog, BacklogRow};

/// Reads the backlog per (destination, topic) from the relay's store ([`crate::store::backlog`]);
/// rows not yet routed count for each destination of `relay` whose topics match (`(unrouted)`
/// when none does).
pub async fn backlog(
    relay: &Relay,
) -> crate::Result<std::collections::HashMap<(String, String), Backlog>> {
    let config = relay.config();
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
                let routed: Vec<String> = relay
                    .router()
                    .by_topic(&topic)
                    .into_iter()
                    .filter_map(|i| config.destinations.get(i).map(|d| d.name.clone()))
                    .collect();
                if routed.is_empty() {
                    vec!["(unrouted)".into()]
                } else {
                    routed
                }
            }
        };
        for destination in destinations {
            let e = merged.entry((destination, topic.clone())).or_default();
            e.due += b.due;
            e.backoff += b.backoff;
            e.held += b.held;
            e.in_flight += b.in_flight;
            e.failing += b.failing;
            e.dead += b.dead;
            e.lag = e.lag.max(b.lag);
        }
    }
    Ok(merged)
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
    relay: Arc<Relay>,
    interval: Duration,
    samples: Arc<Samples>,
    stop: CancellationToken,
) {
    let mut known: std::collections::HashSet<(String, String)> = std::collections::HashSet::new();
    let mut last = (Instant::now(), crate::model::metric::delivered_so_far());
    loop {
        match backlog(&relay).await {
            Ok(mut merged) => {
                let delivered = crate::model::metric::delivered_so_far();
                let elapsed = last.0.elapsed().as_secs_f64().max(1e-3);
                let per_destination: std::collections::BTreeMap<String, f64> = delivered
                    .iter()
                    .map(|(d, n)| {
                        let before = last.1.get(d).copied().unwrap_or(0);
                        (d.clone(), n.saturating_sub(before) as f64 / elapsed)
                    })
                    .collect();
                samples.push(Sample {
                    at: chrono::Utc::now(),
                    lag_seconds: merged.values().map(|b| b.lag).fold(0.0, f64::max),
                    pending: merged.values().map(|b| b.due + b.backoff).sum(),
                    published_per_second: per_destination.values().sum(),
                    per_destination,
                });
                last = (Instant::now(), delivered);
                // Series that emptied go back to zero rather than keep their last value.
                for key in known.iter() {
                    merged.entry(key.clone()).or_default();
                }
                for ((destination, topic), b) in &merged {
                    let labels = [
                        ("destination", destination.clone()),
                        ("topic", topic.clone()),
                    ];
                    metrics::gauge!(PENDING_DUE, &labels).set(b.due as f64);
                    metrics::gauge!(PENDING_BACKOFF, &labels).set(b.backoff as f64);
                    metrics::gauge!(DEAD, &labels).set(b.dead as f64);
                    metrics::gauge!(OLDEST_PENDING_AGE_SECONDS, &labels).set(b.lag);
                }
                known.extend(merged.into_keys());
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
