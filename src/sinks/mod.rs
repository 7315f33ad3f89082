//! Sinks: the [`Sink`] trait and the registry of sinks, one file each.
//!
//! A sink takes a batch and returns one [`Outcome`] per event, in order. Sinks only classify
//! failures (retriable or not, with the receiver's `Retry-After`); when to retry is the retry
//! policy's business ([`crate::model::retry`]). Adding a sink is one file plus one line in [`build`].

#[cfg(feature = "kafka")]
pub mod kafka;
#[cfg(feature = "mqtt")]
pub mod mqtt;
#[cfg(feature = "nats")]
pub mod nats;
mod null;
#[cfg(feature = "rabbitmq")]
pub mod rabbitmq;
#[cfg(feature = "redis")]
pub mod redis;
mod reserved;
mod stdout;
pub mod tls;
mod webhook;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::time::Instant;

use async_trait::async_trait;
use serde::Serialize;
use serde_json::value::RawValue;

use crate::config::DestinationConfig;
use crate::error::{Error, Result};
use crate::model::event::OutboxEvent;
use crate::model::outcome::Outcome;

pub use null::NullSink;
pub use stdout::StdoutSink;
pub use webhook::WebhookSink;

/// A sink's `timeout` (per request, or per broker acknowledgement) when the destination sets none.
pub(crate) fn default_timeout() -> Duration {
    Duration::from_secs(10)
}

/// How long one destination's share of a batch may take: the batch's deadline (its claim time plus
/// `publish_timeout`), shared by every publish of that destination in the batch (chain steps too).
#[derive(Debug)]
pub struct Budget {
    deadline: Instant,
    started: AtomicBool,
}

/// Time kept between a request's own timeout and the batch's deadline, so that a request cut by
/// its own timeout reports an outcome before the batch stops waiting for it.
const DEADLINE_SLACK: Duration = Duration::from_millis(50);

impl Budget {
    /// A budget ending at `deadline`.
    pub fn until(deadline: Instant) -> Self {
        Self {
            deadline,
            started: AtomicBool::new(false),
        }
    }

    /// When the batch stops waiting.
    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    /// Whether the deadline has passed.
    pub fn is_over(&self) -> bool {
        Instant::now() >= self.deadline
    }

    /// How long a request started now may last: up to just before the deadline.
    pub fn request_limit(&self, own_timeout: Duration) -> Duration {
        let left = self
            .deadline
            .saturating_duration_since(Instant::now())
            .saturating_sub(DEADLINE_SLACK)
            .max(Duration::from_millis(1));
        own_timeout.min(left)
    }

    /// Whether a request expected to take `expected` may start now: only if it should end before
    /// the deadline (with half again as much to spare), so that the receiver is not sent what the
    /// relay would stop waiting for and send again. The budget's first request always may: a
    /// destination slower than `publish_timeout` still gets one event per batch (and its timeout).
    pub fn may_start(&self, expected: Duration) -> bool {
        let now = Instant::now();
        if now >= self.deadline {
            return false;
        }
        let first = !self.started.load(Ordering::Relaxed);
        if first || now + expected.mul_f64(1.5) <= self.deadline {
            self.started.store(true, Ordering::Relaxed);
            true
        } else {
            false
        }
    }
}

/// A moving average of a destination's request latency, for [`Budget::may_start`].
#[derive(Debug, Default)]
pub struct Latency {
    micros: AtomicU64,
}

impl Latency {
    /// Records one request's duration (exponentially weighted: recent requests count most).
    pub fn observe(&self, took: Duration) {
        let sample = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
        let old = self.micros.load(Ordering::Relaxed);
        let new = if old == 0 {
            sample
        } else {
            (old / 5).saturating_mul(4).saturating_add(sample / 5)
        };
        self.micros.store(new.max(1), Ordering::Relaxed);
    }

    /// The current estimate (zero before the first request).
    pub fn estimate(&self) -> Duration {
        Duration::from_micros(self.micros.load(Ordering::Relaxed))
    }
}

/// Where a sink records each event's outcome as soon as it knows it, so that what finished before
/// the batch's deadline is settled even when the rest of the batch is not.
pub struct Recorder<'a> {
    slots: &'a [OnceLock<Outcome>],
    at: &'a [usize],
}

impl<'a> Recorder<'a> {
    /// A recorder writing the outcome of the call's `i`-th event into `slots[at[i]]`.
    pub fn new(slots: &'a [OnceLock<Outcome>], at: &'a [usize]) -> Self {
        Self { slots, at }
    }

    /// Records the outcome of the call's `i`-th event; the first outcome recorded for it stands.
    pub fn record(&self, i: usize, outcome: Outcome) {
        if let Some(slot) = self.at.get(i).and_then(|&g| self.slots.get(g)) {
            let _ = slot.set(outcome);
        }
    }

    /// Whether the call's `i`-th event has an outcome.
    pub fn has(&self, i: usize) -> bool {
        self.at
            .get(i)
            .and_then(|&g| self.slots.get(g))
            .is_some_and(|s| s.get().is_some())
    }
}

/// A destination events are published to.
#[async_trait]
pub trait Sink: Send + Sync {
    /// Publishes a batch; returns exactly one outcome per event, in the same order. Must not
    /// report `Delivered` before the destination has durably accepted the event.
    async fn publish(&self, events: &[&OutboxEvent]) -> Vec<Outcome>;

    /// Publishes a batch within `budget`, recording each event's outcome in `recorder` as soon as
    /// it is known. The relay stops waiting at the budget's deadline: events with no outcome then
    /// are given back untouched (no attempt counted). Sinks that send a request per event override
    /// this to record outcomes one by one and to start no request they cannot finish in time; the
    /// default publishes the whole batch and records its outcomes at the end.
    async fn publish_until(
        &self,
        events: &[&OutboxEvent],
        budget: &Budget,
        recorder: &Recorder<'_>,
    ) {
        let _ = budget;
        let outcomes = self.publish(events).await;
        if outcomes.len() == events.len() {
            for (i, outcome) in outcomes.into_iter().enumerate() {
                recorder.record(i, outcome);
            }
        } else {
            let reason = format!(
                "sink returned {} outcomes for {} events",
                outcomes.len(),
                events.len()
            );
            for i in 0..events.len() {
                recorder.record(i, Outcome::retry(reason.clone()));
            }
        }
    }

    /// A cheap check that the destination is reachable (start-up, readiness).
    async fn healthcheck(&self) -> std::result::Result<(), String> {
        Ok(())
    }
}

/// A sink type: its `type` name in the configuration and how to build it from its settings.
///
/// `build` validates the settings and must not do I/O (connections are made on first publish), so
/// the configuration loader can call it to report a bad key before the relay starts.
#[derive(Clone, Copy)]
pub struct SinkKind {
    /// The `type` value in the configuration.
    pub name: &'static str,
    /// Builds the sink for destination `name` from its settings; errors are one sentence.
    pub build: BuildSink,
}

/// Builds a sink for destination `name` from its settings; the error is one sentence.
pub type BuildSink =
    fn(name: &str, settings: &toml::Table) -> std::result::Result<Arc<dyn Sink>, String>;

/// Every sink type this build has. Adding a sink: one file in this folder and one line here.
pub fn registry() -> Vec<SinkKind> {
    #[allow(unused_mut)]
    let mut kinds = vec![webhook::KIND, stdout::KIND, null::KIND];
    #[cfg(feature = "nats")]
    kinds.push(nats::KIND);
    #[cfg(feature = "rabbitmq")]
    kinds.push(rabbitmq::KIND);
    #[cfg(feature = "kafka")]
    kinds.push(kafka::KIND);
    #[cfg(feature = "redis")]
    kinds.push(redis::KIND);
    #[cfg(feature = "mqtt")]
    kinds.push(mqtt::KIND);
    kinds
}

/// Builds the sink of a configured destination.
pub fn build(dest: &DestinationConfig) -> Result<Arc<dyn Sink>> {
    let fail = |message: String| Error::SinkConfig {
        name: dest.name.clone(),
        message,
    };
    // Client libraries that build their own rustls configuration (Redis, RabbitMQ) take the
    // process's default crypto provider: ring, as everywhere else here.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let kind = registry()
        .into_iter()
        .find(|k| k.name == dest.sink.kind)
        .ok_or_else(|| fail(format!("unknown destination type {:?}", dest.sink.kind)))?;
    (kind.build)(&dest.name, &dest.sink.settings).map_err(fail)
}

/// The JSON envelope shared by the webhook and stdout sinks.
#[derive(Serialize)]
pub struct Envelope<'a> {
    /// Event id.
    pub id: String,
    /// Event type (the topic).
    #[serde(rename = "type")]
    pub kind: &'a str,
    /// When the event was written, RFC 3339.
    pub timestamp: String,
    /// Message key, omitted when absent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key: Option<&'a str>,
    /// The payload, verbatim.
    pub data: &'a RawValue,
}

impl<'a> Envelope<'a> {
    /// The envelope of one event.
    pub fn of(event: &'a OutboxEvent) -> Self {
        Self {
            id: event.id.to_string(),
            kind: &event.topic,
            timestamp: event
                .created_at
                .to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
            key: event.key.as_deref(),
            data: &event.payload,
        }
    }
}
