//! The `kafka` sink: produces to Kafka (or any Kafka-API broker) with librdkafka.
//!
//! The producer is idempotent with `acks=all`, so librdkafka's own resends cannot duplicate or
//! reorder records within a partition. The message key is the event's `key` (records of one key
//! land on one partition, in order); headers are the event's headers plus `id` (the event id,
//! stable across redeliveries) and `topic`. A batch is enqueued in order, then each delivery
//! report is awaited: an event is `Delivered` only once the broker has acknowledged it.
//! librdkafka connects in the background and reconnects by itself; the producer is created on the
//! first publish, and while the brokers are unreachable records time out after `timeout` and are
//! retried by the relay.
//!
//! Classification: timeouts, transport errors, authentication and authorization failures (SASL,
//! topic and cluster ACLs), a full local queue, unknown topics (auto-create may be on its way)
//! and any error not listed here are retried; a record over the broker's size limit, an invalid
//! topic name, a record the broker's validation refuses (invalid or corrupt record, a timestamp
//! outside the topic's allowed range) are rejected.
//!
//! Event headers cannot set the `id` and `topic` headers; such a header is dropped with a warning.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use serde::Deserialize;
use tokio::sync::OnceCell;

use super::reserved::Reserved;
use super::{Outcome, Sink, SinkKind};
use crate::config::{duration_str, Secret};
use crate::event::OutboxEvent;
use crate::route::Template;

/// Registry entry: `type = "kafka"`.
pub const KIND: SinkKind = SinkKind {
    name: "kafka",
    build: |_, settings| {
        let cfg: KafkaConfig = crate::config::sink_settings(settings)?;
        Ok(Arc::new(KafkaSink::new(cfg)?))
    },
};

/// Settings of `type = "kafka"`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KafkaConfig {
    /// Bootstrap brokers, `host:port[,host:port…]`.
    pub brokers: String,
    /// Topic template; default `{topic}`.
    #[serde(default = "Template::topic")]
    pub topic: Template,
    /// How long a record may wait for its delivery report (librdkafka `message.timeout.ms`).
    #[serde(default = "super::default_timeout", with = "duration_str")]
    pub timeout: Duration,
    /// Extra librdkafka producer properties (e.g. `"security.protocol" = "ssl"`,
    /// `"compression.type" = "zstd"`); they cannot turn off `acks=all` or idempotence. Values
    /// may hold credentials (`"sasl.password"`): each may be `{ env = "NAME" }` or
    /// `{ file = "PATH" }`, and none is shown in messages.
    #[serde(default)]
    pub properties: BTreeMap<String, Secret>,
}

/// Properties the sink's guarantees depend on.
const FIXED: &[(&str, &str)] = &[("acks", "all"), ("enable.idempotence", "true")];

/// Produces events to Kafka.
pub struct KafkaSink {
    cfg: KafkaConfig,
    reserved: Reserved,
    client_config: ClientConfig,
    producer: OnceCell<FutureProducer>,
}

impl std::fmt::Debug for KafkaSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaSink")
            .field("brokers", &self.cfg.brokers)
            .field("topic", &self.cfg.topic)
            .finish_non_exhaustive()
    }
}

impl KafkaSink {
    /// Validates the settings; the producer (and its connections) is created on the first publish.
    pub fn new(cfg: KafkaConfig) -> Result<Self, String> {
        if cfg.brokers.trim().is_empty() {
            return Err("key `brokers`: must not be empty".into());
        }
        let timeout_ms = cfg.timeout.as_millis();
        if timeout_ms == 0 || timeout_ms > i32::MAX as u128 {
            return Err("key `timeout`: must be between 1ms and 24 days".into());
        }
        if cfg.topic.is_constant() && !valid_topic(cfg.topic.as_str()) {
            return Err(format!(
                "key `topic`: {:?} is not a valid Kafka topic name",
                cfg.topic.as_str()
            ));
        }
        let mut client_config = ClientConfig::new();
        for (k, v) in &cfg.properties {
            if FIXED.iter().any(|(f, _)| f == k) || k == "bootstrap.servers" {
                return Err(format!(
                    "key `properties`: {k:?} is set by pgoutbox and cannot be overridden"
                ));
            }
            client_config.set(k, v.expose());
        }
        client_config
            .set("bootstrap.servers", &cfg.brokers)
            .set("message.timeout.ms", timeout_ms.to_string())
            .set("client.id", concat!("pgoutbox/", env!("CARGO_PKG_VERSION")));
        for (k, v) in FIXED {
            client_config.set(*k, *v);
        }
        Ok(Self {
            cfg,
            reserved: Reserved::new("kafka", ["id", "topic"], &[]),
            client_config,
            producer: OnceCell::new(),
        })
    }

    fn producer(&self) -> Result<&FutureProducer, String> {
        if let Some(p) = self.producer.get() {
            return Ok(p);
        }
        let p: FutureProducer = self
            .client_config
            .create()
            .map_err(|e| format!("cannot create the Kafka producer: {e}"))?;
        // Another batch may have raced us here; either producer works, keep the first.
        let _ = self.producer.set(p);
        self.producer
            .get()
            .ok_or_else(|| "the Kafka producer vanished".to_owned())
    }
}

/// Kafka topic names: 1 to 249 characters of `[a-zA-Z0-9._-]`, not `.` or `..`.
fn valid_topic(topic: &str) -> bool {
    !topic.is_empty()
        && topic.len() <= 249
        && topic != "."
        && topic != ".."
        && topic
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

fn classify(e: &KafkaError) -> Outcome {
    use RDKafkaErrorCode as C;
    match e.rdkafka_error_code() {
        Some(
            C::MessageSizeTooLarge
            | C::InvalidMessageSize
            | C::InvalidMessage
            | C::InvalidRecord
            | C::InvalidTopic
            | C::InvalidTimestamp
            | C::MessageBatchTooLarge,
        ) => Outcome::Rejected {
            reason: format!("Kafka refused the record: {e}"),
        },
        _ => Outcome::retry(format!("Kafka: {e}")),
    }
}

#[async_trait]
impl Sink for KafkaSink {
    async fn publish(&self, events: &[&OutboxEvent]) -> Vec<Outcome> {
        let producer = match self.producer() {
            Ok(p) => p,
            Err(reason) => return vec![Outcome::retry(reason); events.len()],
        };
        // Enqueue all in batch order (idempotence keeps per-partition order), then await reports.
        let mut pending = Vec::with_capacity(events.len());
        for event in events {
            let topic = self.cfg.topic.render(event);
            if !valid_topic(&topic) {
                pending.push(Err(Outcome::Rejected {
                    reason: format!("invalid Kafka topic name {topic:?}"),
                }));
                continue;
            }
            let id = event.id.to_string();
            let mut headers = OwnedHeaders::new_with_capacity(event.headers.len() + 2)
                .insert(Header {
                    key: "id",
                    value: Some(id.as_str()),
                })
                .insert(Header {
                    key: "topic",
                    value: Some(event.topic.as_str()),
                });
            for (k, v) in event
                .headers
                .iter()
                .filter(|(k, _)| self.reserved.permits(k))
            {
                headers = headers.insert(Header {
                    key: k.as_str(),
                    value: Some(v.as_str()),
                });
            }
            let mut record: FutureRecord<'_, str, str> = FutureRecord::to(&topic)
                .payload(event.payload.get())
                .headers(headers)
                .timestamp(event.created_at.timestamp_millis());
            if let Some(key) = &event.key {
                record = record.key(key.as_str());
            }
            pending.push(producer.send_result(record).map_err(
                |(e, _)| match e.rdkafka_error_code() {
                    Some(RDKafkaErrorCode::QueueFull) => {
                        Outcome::retry("the Kafka producer queue is full")
                    }
                    _ => classify(&e),
                },
            ));
        }
        let mut outcomes = Vec::with_capacity(events.len());
        for p in pending {
            outcomes.push(match p {
                Err(outcome) => outcome,
                Ok(report) => match report.await {
                    Ok(Ok(_)) => Outcome::Delivered,
                    Ok(Err((e, _))) => classify(&e),
                    Err(_) => Outcome::retry("the Kafka producer went away before the report"),
                },
            });
        }
        outcomes
    }

    async fn healthcheck(&self) -> Result<(), String> {
        let producer = self.producer()?.clone();
        // librdkafka's metadata request blocks its thread until answered or timed out.
        tokio::task::spawn_blocking(move || {
            producer
                .client()
                .fetch_metadata(None, HEALTHCHECK_TIMEOUT)
                .map(|_| ())
                .map_err(|e| format!("Kafka is not reachable: {e}"))
        })
        .await
        .map_err(|e| format!("the Kafka metadata request failed: {e}"))?
    }
}

/// How long the readiness check waits for the brokers' metadata: under the relay's 2 s limit
/// per check, so that librdkafka's own error, not "no answer", is what `/readyz` shows.
const HEALTHCHECK_TIMEOUT: Duration = Duration::from_millis(1500);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topic_names_are_checked() {
        assert!(valid_topic("orders.created-v1_x"));
        assert!(!valid_topic("orders/created"));
        assert!(!valid_topic(".."));
        assert!(!valid_topic(""));
    }
}
