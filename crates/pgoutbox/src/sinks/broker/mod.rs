//! What the broker sinks (`nats`, `rabbitmq`, `kafka`, `redis`, `mqtt`) share: the keys each
//! takes beside its own — how long to wait for the broker, TLS, and what a message's body holds —
//! read with them from the destination's table ([`crate::config::Flat`]), and the connection
//! each keeps between publishes (`Kept`).

mod kept;

use std::sync::Arc;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Deserialize;

use super::body::{Body, Shape};
use super::tls::TlsConfig;
use super::Sink;
use crate::config::duration_str;
#[cfg(any(feature = "mqtt", feature = "rabbitmq"))]
use crate::model::outcome::Outcome;

pub(crate) use kept::{Connection, Kept, Reconnects};

/// A broker sink's registry entry: the sink `new` makes of destination `name`'s settings.
pub(crate) fn build<C: DeserializeOwned, S: Sink + 'static>(
    name: &str,
    settings: &toml::Table,
    new: fn(&str, C) -> Result<S, String>,
) -> Result<Arc<dyn Sink>, String> {
    let cfg = crate::config::sink_settings(settings)?;
    Ok(Arc::new(new(name, cfg)?))
}

/// The rejection, before it is sent, of a message of `len` bytes over the sink's
/// `max_message_bytes` (`max`); `what` is what the protocol calls it: `message`, `payload`.
#[cfg(any(feature = "mqtt", feature = "rabbitmq"))]
pub(crate) fn oversized(what: &str, len: usize, max: usize) -> Option<Outcome> {
    (len > max).then(|| Outcome::Rejected {
        reason: format!("{what} of {len} bytes is over max_message_bytes ({max})"),
    })
}

/// The keys every broker sink takes beside its own.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BrokerSettings {
    /// How long to wait for a connection and for the broker's word on each event: a confirm
    /// (RabbitMQ), a PubAck (NATS), a PUBACK (MQTT), the pipeline's replies (Redis); for Kafka,
    /// how long a record may wait for its delivery report (librdkafka `message.timeout.ms`).
    #[serde(default = "super::default_timeout", with = "duration_str")]
    pub timeout: Duration,
    /// CA bundle and client certificate, for `amqps://`, `rediss://` and `mqtts://` URLs and
    /// Kafka's `security.protocol = "ssl"` or `"sasl_ssl"`; for NATS, setting it also requires
    /// TLS (as `tls://` URLs do).
    #[serde(default)]
    pub tls: TlsConfig,
    /// What a message's body holds: `payload` (default), `envelope`, `cloudevents` or
    /// `cloudevents-binary`, the payload with the attributes as the protocol's headers: `ce-*`
    /// (NATS), `ce_*` (Kafka), `cloudEvents_*` (RabbitMQ), user properties named `id`, `type`, …
    /// (MQTT). For Redis, the body is the entry's `payload` field and the attributes `ce_*` fields.
    #[serde(default = "Body::payload")]
    pub body: Body,
    /// The CloudEvents `source` attribute (with a `cloudevents` body); default `pgoutbox`.
    pub cloudevents_source: Option<String>,
}

impl BrokerSettings {
    /// What the sink's messages are made of: `body` and `cloudevents_source`, checked.
    pub(crate) fn shape(&self) -> Result<Shape, String> {
        Shape::new(self.body, self.cloudevents_source.clone())
    }

    /// Checks that `timeout` is more than zero (Kafka has bounds of its own).
    #[cfg(any(
        feature = "mqtt",
        feature = "nats",
        feature = "rabbitmq",
        feature = "redis"
    ))]
    pub(crate) fn check_timeout(&self) -> Result<(), String> {
        if self.timeout.is_zero() {
            return Err("key `timeout`: must be more than zero".into());
        }
        Ok(())
    }
}

/// What the broker sinks' unit tests share.
#[cfg(test)]
pub(crate) mod testing {
    /// Asserts that the name rule `valid` (a topic's, a subject's) takes each of `taken` and
    /// refuses each of `refused`.
    pub(crate) fn assert_names(valid: fn(&str) -> bool, taken: &[&str], refused: &[&str]) {
        for name in taken {
            assert!(valid(name), "{name:?} must be taken");
        }
        for name in refused {
            assert!(!valid(name), "{name:?} must be refused");
        }
    }
}
