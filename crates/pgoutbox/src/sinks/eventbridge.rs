//! The `eventbridge` sink: puts each event on an Amazon EventBridge bus, ten to a `PutEvents`
//! call.
//!
//! `detail-type` is the event's topic, `source` the destination's `source` (`pgoutbox` by
//! default), `time` its `created_at`, and `detail` its `body`: the envelope by default (EventBridge
//! gives each event its own id, so the event id travels in the detail). A detail must be a JSON
//! object: with `body = "payload"`, an event whose payload is not one is rejected by EventBridge
//! and dead-lettered. Each entry gets its own answer: the failed ones are retried alone.

use async_trait::async_trait;
use aws_sdk_eventbridge::primitives::DateTime;
use aws_sdk_eventbridge::types::PutEventsRequestEntry;

use super::aws::{self, AwsSettings, Calls, Limits};
use super::body::{Binding, Body, Shape};
use crate::model::event::OutboxEvent;
use crate::model::outcome::Outcome;
use crate::model::template::Template;

/// What one `PutEvents` takes — ten entries, 256 KiB together — and EventBridge keeps no order:
/// calls go side by side.
const CALLS: Calls = Calls {
    limits: Limits {
        entries: 10,
        bytes: 256 * 1024,
    },
    ordered: |_| false,
};

/// The `source` of a destination that sets none.
const DEFAULT_SOURCE: &str = "pgoutbox";

super::sink_type!(
    /// `body` (what `detail` holds) is `envelope` by default, and `payload` only does for
    /// payloads that are JSON objects.
    "eventbridge": EventBridgeSink, EventBridgeConfig = EventBridgeSettings + AwsSettings
);

super::own_settings! {
    /// The keys only `type = "eventbridge"` takes.
    pub struct EventBridgeSettings {
        /// The bus's name or ARN, a template; default `default`.
        #[serde(default = "default_bus")]
        pub event_bus: Template,
        /// Each event's `source`; default `pgoutbox`.
        pub source: Option<String>,
    }
}

fn default_bus() -> Template {
    Template::literal("default")
}

/// Puts events on EventBridge buses.
pub struct EventBridgeSink {
    cfg: EventBridgeSettings,
    source: String,
    shape: Shape,
    client: aws::Connection<aws_sdk_eventbridge::Client>,
}

super::sink_debug!(EventBridgeSink {
    event_bus: cfg.event_bus,
    source: source
});

impl EventBridgeSink {
    /// Validates the settings; connects on the first publish.
    pub fn new(cfg: EventBridgeConfig) -> Result<Self, String> {
        let source = cfg
            .own
            .source
            .clone()
            .unwrap_or_else(|| DEFAULT_SOURCE.into());
        if source.trim().is_empty() || source.len() > 256 {
            return Err("key `source`: must be 1 to 256 characters".into());
        }
        let (shape, client) = cfg.common.build(
            "EventBridge",
            Body::Envelope,
            aws_sdk_eventbridge::Client::new,
        )?;
        aws::names::name_or_arn("event_bus", &cfg.own.event_bus, "events", 256, "/._-")?;
        Ok(Self {
            cfg: cfg.own,
            source,
            shape,
            client,
        })
    }

    /// The entry of `event` on `bus` and its size against the limits.
    fn entry(&self, event: &OutboxEvent, bus: &str) -> (PutEventsRequestEntry, usize) {
        let detail =
            String::from_utf8_lossy(&self.shape.message(event, Binding::Kafka).body).into_owned();
        let size = detail.len() + event.topic.len() + self.source.len() + 14;
        let entry = PutEventsRequestEntry::builder()
            .event_bus_name(bus)
            .source(&self.source)
            .detail_type(&event.topic)
            .detail(detail)
            .time(DateTime::from_millis(event.created_at.timestamp_millis()))
            .build();
        (entry, size)
    }

    /// Puts `entries` in one call (each names its bus).
    async fn send(&self, entries: Vec<PutEventsRequestEntry>) -> Vec<Outcome> {
        let len = entries.len();
        let call = self.client.get().await.put_events();
        let answer = call.set_entries(Some(entries)).send().await;
        aws::in_order!("EventBridge", len, answer, entries)
    }
}

#[async_trait]
impl aws::Batches for EventBridgeSink {
    async fn send_all(&self, events: &[&OutboxEvent], record: aws::Record<'_>) {
        let entry = |_, event: &OutboxEvent, bus: &str| Ok(self.entry(event, bus));
        // Each entry names its bus: a call takes the entries of one bus all the same.
        let send = |_, entries| self.send(entries);
        aws::publish_each(events, &self.cfg.event_bus, CALLS, entry, send, record).await;
    }

    async fn ready(&self) -> Result<(), String> {
        self.client
            .ready(&self.cfg.event_bus, "event bus", |client, bus| {
                client.describe_event_bus().name(bus).send()
            })
            .await
    }
}
