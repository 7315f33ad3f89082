//! The `kafka` sink: produces to Kafka (or any Kafka-API broker) with librdkafka.
//!
//! The producer is idempotent with `acks=all`, so librdkafka's own resends cannot duplicate or
//! reorder records within a partition. The message key is the event's `key` (records of one key
//! land on one partition, in order); headers are the event's headers plus `id` (the event id,
//! stable across redeliveries) and `topic`. A batch is enqueued in order, then each delivery
//! report is awaited: an event is `Delivered` only once the broker has acknowledged it.
//! librdkafka connects in the background and reconnects by itself; the producer is created on the
//! first publish, and while the brokers are unreachable records time out after `timeout` and are
//! retried by the relay. The probe of an open breaker gets a new producer all the same: after a
//! ten-second outage the kept one timed out its first probe and then failed every record with
//! `ProducerFenced` — an idempotent producer whose records timed out must bump its epoch, and a
//! broker that refuses makes that a fatal error of the producer, which only a new producer
//! clears. A new producer also starts without the reconnect backoff librdkafka built up while
//! the brokers were away (up to `reconnect.backoff.max.ms`, 10 s by default).
//!
//! Classification: timeouts, transport errors, authentication and authorization failures (SASL,
//! topic and cluster ACLs), a full local queue, unknown topics (auto-create may be on its way)
//! and any error not listed here are retried; a record over the broker's size limit, an invalid
//! topic name, a record the broker's validation refuses (invalid or corrupt record, a timestamp
//! outside the topic's allowed range) are rejected.
//!
//! Event headers cannot set the `id` and `topic` headers; such a header is dropped with a warning.
//!
//! TLS: `security.protocol = "ssl"` (or `"sasl_ssl"`) in `properties` switches it on, and the
//! shared `tls` table says whom to trust and which client certificate to present (handed to
//! librdkafka as PEM, `ssl.ca.pem` / `ssl.certificate.pem` / `ssl.key.pem`). librdkafka reports a
//! failed handshake or login only to its error callback, while the record itself just times out;
//! the sink keeps the last such error and adds it to the timeout, so that `last_error` says
//! "certificate verify failed" rather than "Message timed out".

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use rdkafka::client::ClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord, Producer};

use super::body::{Binding, Shape};
use super::broker::{Broker, BrokerSettings, Connection, Kept, Names, Reconnects};
use super::reserved::Reserved;
use crate::config::{Flat, Secret};
use crate::model::event::OutboxEvent;
use crate::model::outcome::Outcome;
use crate::model::template::Template;

super::sink_type!("kafka": KafkaSink, KafkaConfig = KafkaSettings + BrokerSettings);

super::own_settings! {
    /// The keys only `type = "kafka"` takes.
    pub struct KafkaSettings {
        /// Bootstrap brokers, `host:port[,host:port…]`.
        pub brokers: String,
        /// Topic template; default `{topic}`.
        #[serde(default = "Template::topic")]
        pub topic: Template,
        /// Extra librdkafka producer properties (e.g. `"security.protocol" = "ssl"`,
        /// `"compression.type" = "zstd"`); they cannot turn off `acks=all` or idempotence. Values
        /// may hold credentials (`"sasl.password"`): each may be `{ env = "NAME" }` or
        /// `{ file = "PATH" }`, and none is shown in messages.
        #[serde(default)]
        pub properties: BTreeMap<String, Secret>,
    }
}

/// Kafka topic names, as `topic` renders them.
const TOPICS: Names = Names {
    what: "Kafka topic name",
    valid: valid_topic,
};

/// librdkafka properties the `tls` table sets; set them through `tls`, not `properties`.
const TLS_PROPERTIES: &[&str] = &[
    "ssl.ca.location",
    "ssl.ca.pem",
    "ssl.certificate.location",
    "ssl.certificate.pem",
    "ssl.key.location",
    "ssl.key.pem",
];

/// Keeps the last error librdkafka reported outside any record (a refused TLS handshake, a
/// failed SASL login, a broker that went away), so that a record's timeout can say why.
#[derive(Clone, Default)]
pub struct BrokerErrors {
    last: Arc<Mutex<Option<String>>>,
}

impl BrokerErrors {
    fn last(&self) -> Option<String> {
        self.last.lock().ok().and_then(|l| l.clone())
    }

    /// Forgets the last error once a record got through: it no longer explains anything.
    fn clear(&self) {
        if let Ok(mut last) = self.last.lock() {
            last.take();
        }
    }
}

impl ClientContext for BrokerErrors {
    fn error(&self, error: KafkaError, reason: &str) {
        tracing::debug!(%error, reason, "librdkafka reported an error");
        if let Ok(mut last) = self.last.lock() {
            // "All brokers are down" follows the failure that brought them down: keep the cause.
            if last.is_none()
                || error.rdkafka_error_code() != Some(RDKafkaErrorCode::AllBrokersDown)
            {
                *last = Some(reason.to_owned());
            }
        }
    }
}

/// Properties the sink's guarantees depend on.
const FIXED: &[(&str, &str)] = &[("acks", "all"), ("enable.idempotence", "true")];

/// Produces events to Kafka.
pub struct KafkaSink {
    cfg: KafkaSettings,
    reserved: Reserved,
    shape: Shape,
    client_config: ClientConfig,
    producer: Kept<Arc<KeptProducer>>,
    reconnects: Reconnects,
}

/// One librdkafka producer, with the errors only it reported.
pub(crate) struct KeptProducer {
    /// Taken only when dropped.
    producer: Option<FutureProducer<BrokerErrors>>,
    errors: BrokerErrors,
    /// Whether a record got through it: the first one shows it connected.
    delivered: AtomicBool,
}

impl KeptProducer {
    fn producer(&self) -> &FutureProducer<BrokerErrors> {
        self.producer
            .as_ref()
            .expect("the producer is taken only when dropped")
    }
}

impl Drop for KeptProducer {
    fn drop(&mut self) {
        // Dropping a librdkafka producer purges its queue, waits up to 500 ms for the purged
        // records' reports and joins its threads: not on a thread of the async runtime.
        if let Some(producer) = self.producer.take() {
            match tokio::runtime::Handle::try_current() {
                Ok(runtime) => drop(runtime.spawn_blocking(move || drop(producer))),
                Err(_) => drop(producer),
            }
        }
    }
}

// The last clone's drop shuts the producer down, in the background (see `Drop`).
impl Connection for Arc<KeptProducer> {}

super::sink_debug!(KafkaSink {
    brokers: cfg.brokers,
    topic: cfg.topic
});

/// Checks `brokers`: a comma-separated list of `host[:port]` (librdkafka would otherwise try
/// forever to reach a broker that cannot exist).
fn brokers(brokers: &str) -> Result<(), String> {
    if brokers.trim().is_empty() {
        return Err("key `brokers`: must not be empty".into());
    }
    for broker in brokers.split(',').map(str::trim) {
        // A scheme (`SSL://host:9093`) is librdkafka's to read; what follows it is host:port.
        let address = broker.split_once("://").map_or(broker, |(_, rest)| rest);
        let host_ok = |host: &str| !host.is_empty() && !host.contains(char::is_whitespace);
        let valid = !address.contains('/')
            && match address.rsplit_once(':') {
                // `[::1]` is an address with no port.
                Some((host, port)) if !address.ends_with(']') => {
                    host_ok(host) && port.parse::<u16>().is_ok_and(|p| p > 0)
                }
                _ => host_ok(address),
            };
        if !valid {
            return Err(format!(
                "key `brokers`: {broker:?} is not host:port (as \"kafka-1:9092,kafka-2:9092\")"
            ));
        }
    }
    Ok(())
}

impl KafkaSink {
    /// Validates the settings of destination `destination`; the producer (and its connections)
    /// is created on the first publish.
    pub fn new(destination: &str, Flat { own: cfg, common }: KafkaConfig) -> Result<Self, String> {
        brokers(&cfg.brokers)?;
        let timeout_ms = common.timeout.as_millis();
        if timeout_ms == 0 || timeout_ms > i32::MAX as u128 {
            return Err("key `timeout`: must be between 1ms and 24 days".into());
        }
        TOPICS.check("topic", &cfg.topic)?;
        let mut client_config = ClientConfig::new();
        for (k, v) in &cfg.properties {
            if FIXED.iter().any(|(f, _)| f == k) || k == "bootstrap.servers" {
                return Err(format!(
                    "key `properties`: {k:?} is set by pgoutbox and cannot be overridden"
                ));
            }
            if TLS_PROPERTIES.contains(&k.as_str()) {
                return Err(format!(
                    "key `properties`: set {k:?} through the `tls` table (ca_file, cert_file, key_file)"
                ));
            }
            client_config.set(k, v.expose());
        }
        let protocol = client_config
            .get("security.protocol")
            .unwrap_or("plaintext")
            .to_ascii_lowercase();
        let encrypted = matches!(protocol.as_str(), "ssl" | "sasl_ssl");
        if let Some(files) = common.tls.load_for(
            encrypted,
            "a `properties.\"security.protocol\"` that is not \"ssl\" or \"sasl_ssl\"",
        )? {
            if let Some(ca) = &files.ca_pem {
                client_config.set("ssl.ca.pem", String::from_utf8_lossy(ca));
            }
            if let Some(id) = &files.identity {
                client_config
                    .set("ssl.certificate.pem", String::from_utf8_lossy(&id.cert_pem))
                    .set("ssl.key.pem", String::from_utf8_lossy(&id.key_pem));
            }
        }
        client_config
            .set("bootstrap.servers", &cfg.brokers)
            .set("message.timeout.ms", timeout_ms.to_string())
            .set("client.id", concat!("pgoutbox/", env!("CARGO_PKG_VERSION")));
        for (k, v) in FIXED {
            client_config.set(*k, *v);
        }
        Ok(Self {
            shape: common.shape()?,
            cfg,
            reserved: Reserved::new("kafka", &["id", "topic"], &[]),
            client_config,
            producer: Kept::new(),
            reconnects: Reconnects::new(destination),
        })
    }

    /// Hands `event` to `producer`: its delivery report to come, or its outcome at once.
    fn enqueue(
        &self,
        producer: &FutureProducer<BrokerErrors>,
        event: &OutboxEvent,
    ) -> Result<DeliveryFuture, Outcome> {
        let topic = TOPICS.of(&self.cfg.topic, event)?;
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
        let message = self.shape.message(event, Binding::Kafka);
        for (name, value) in &message.attributes {
            headers = headers.insert(Header {
                key: name.as_str(),
                value: Some(value.as_str()),
            });
        }
        if self.shape.states_content_type() {
            headers = headers.insert(Header {
                key: "content-type",
                value: Some(message.content_type),
            });
        }
        let mut record: FutureRecord<'_, str, [u8]> = FutureRecord::to(&topic)
            .payload(&message.body[..])
            .headers(headers)
            .timestamp(event.created_at.timestamp_millis());
        if let Some(key) = &event.key {
            record = record.key(key.as_str());
        }
        producer
            .send_result(record)
            .map_err(|(e, _)| match e.rdkafka_error_code() {
                Some(RDKafkaErrorCode::QueueFull) => {
                    Outcome::retry("the Kafka producer queue is full")
                }
                _ => classify(&e),
            })
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

/// `classify`, with the last broker error added to a record that timed out or never reached a
/// broker: librdkafka gives the cause (a refused certificate, a failed login) only there.
fn classify_with(e: &KafkaError, errors: &BrokerErrors) -> Outcome {
    let outcome = classify(e);
    match (outcome, errors.last()) {
        (Outcome::Retry { reason, .. }, Some(cause))
            if matches!(
                e.rdkafka_error_code(),
                Some(RDKafkaErrorCode::MessageTimedOut | RDKafkaErrorCode::AllBrokersDown)
            ) =>
        {
            Outcome::retry(format!("{reason} (last broker error: {cause})"))
        }
        (outcome, _) => outcome,
    }
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
impl Broker for KafkaSink {
    type Link = Arc<KeptProducer>;

    async fn send(&self, kept: Self::Link, events: &[&OutboxEvent]) -> Vec<Outcome> {
        let producer = kept.producer();
        // Enqueue all in batch order (idempotence keeps per-partition order), then await reports.
        let pending: Vec<_> = events
            .iter()
            .map(|event| self.enqueue(producer, event))
            .collect();
        let mut outcomes = Vec::with_capacity(events.len());
        for p in pending {
            outcomes.push(match p {
                Err(outcome) => outcome,
                Ok(report) => match report.await {
                    Ok(Ok(_)) => {
                        kept.errors.clear();
                        // librdkafka says nothing when it connects: a delivery shows it did.
                        if !kept.delivered.swap(true, Ordering::Relaxed) {
                            self.reconnects.connected();
                        }
                        Outcome::Delivered
                    }
                    Ok(Err((e, _))) => classify_with(&e, &kept.errors),
                    Err(_) => Outcome::retry("the Kafka producer went away before the report"),
                },
            });
        }
        outcomes
    }

    async fn connect(&self) -> Result<Self::Link, String> {
        let errors = BrokerErrors::default();
        let producer = self
            .client_config
            .create_with_context(errors.clone())
            .map_err(|e| format!("cannot create the Kafka producer: {e}"))?;
        Ok(Arc::new(KeptProducer {
            producer: Some(producer),
            errors,
            delivered: AtomicBool::new(false),
        }))
    }

    fn kept(&self) -> &Kept<Self::Link> {
        &self.producer
    }

    async fn ready(&self) -> Result<(), String> {
        let kept = self.link().await?;
        // librdkafka's metadata request blocks its thread until answered or timed out.
        tokio::task::spawn_blocking(move || {
            kept.producer()
                .client()
                .fetch_metadata(None, HEALTHCHECK_TIMEOUT)
                .map(|_| ())
                .map_err(|e| match kept.errors.last() {
                    Some(cause) => {
                        format!("Kafka is not reachable: {e} (last broker error: {cause})")
                    }
                    None => format!("Kafka is not reachable: {e}"),
                })
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
    use crate::sinks::broker::testing::assert_names;

    #[test]
    fn brokers_are_host_and_port() {
        for good in [
            "h:1",
            "kafka-1:9092, kafka-2:9092",
            "kafka",
            "SSL://k:9093",
            "[::1]:9092",
        ] {
            assert!(brokers(good).is_ok(), "{good}");
        }
        for bad in [
            "", " ", "h:", ":9092", "h:x", "h:0", "h:70000", "a b:1", "h:1,,k:2", "h/x:1",
        ] {
            let e = brokers(bad).expect_err(bad);
            assert!(e.starts_with("key `brokers`"), "{e}");
        }
    }

    #[test]
    fn topic_names_are_checked() {
        assert_names(
            valid_topic,
            &["orders.created-v1_x"],
            &["orders/created", "..", ""],
        );
    }
}
