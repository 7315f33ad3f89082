//! What the broker sinks (`nats`, `rabbitmq`, `kafka`, `redis`, `mqtt`) share: the keys each
//! takes beside its own — how long to wait for the broker, TLS, and what a message's body holds —
//! read with them from the destination's table ([`crate::config::Flat`]); the connection each
//! keeps between publishes (`Kept`); and how each is a [`Sink`] ([`Broker`]): a batch goes out on
//! that connection, or is retried whole when none can be made.

mod kept;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde::de::DeserializeOwned;
use serde::Deserialize;

use super::body::{Body, Shape};
use super::tls::TlsConfig;
use super::Sink;
use crate::config::duration_str;
use crate::model::event::OutboxEvent;
use crate::model::outcome::Outcome;
#[cfg(any(feature = "kafka", feature = "mqtt", feature = "nats"))]
use crate::model::template::Template;

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

/// What a broker sink does on the connection it keeps. Every one is a [`Sink`] through it, alike:
/// a batch goes out on the kept connection, made first when there is none usable, and when none
/// can be made every event is retried with the reason; the probe of an open breaker starts from
/// a new connection.
#[async_trait]
pub(crate) trait Broker: Send + Sync + 'static {
    /// The connection, client, session or producer it keeps.
    type Link: Connection + Sync;

    /// Publishes `events` on `link`: one outcome each, in order.
    async fn send(&self, link: Self::Link, events: &[&OutboxEvent]) -> Vec<Outcome>;

    /// Makes a new connection (only [`Broker::link`] calls it, one attempt at a time).
    async fn connect(&self) -> Result<Self::Link, String>;

    /// Where its connection is kept.
    fn kept(&self) -> &Kept<Self::Link>;

    /// A cheap check that the broker is reachable (start-up, readiness); none by default.
    async fn ready(&self) -> Result<(), String> {
        Ok(())
    }

    /// The kept connection, made first when there is none usable.
    async fn link(&self) -> Result<Self::Link, String> {
        self.kept().get(|| self.connect()).await
    }
}

#[async_trait]
impl<B: Broker> Sink for B {
    async fn publish(&self, events: &[&OutboxEvent]) -> Vec<Outcome> {
        match self.link().await {
            Ok(link) => self.send(link, events).await,
            Err(reason) => vec![Outcome::retry(reason); events.len()],
        }
    }

    async fn healthcheck(&self) -> Result<(), String> {
        self.ready().await
    }

    fn reconnect(&self) {
        self.kept().drop_current();
    }
}

/// The names a broker sends to (Kafka topics, NATS subjects): the rule they follow, and what
/// messages call one.
#[cfg(any(feature = "kafka", feature = "mqtt", feature = "nats"))]
#[derive(Clone, Copy)]
pub(crate) struct Names {
    /// What a name is called: `Kafka topic name`.
    pub what: &'static str,
    /// Whether a name follows the rule.
    pub valid: fn(&str) -> bool,
}

#[cfg(any(feature = "kafka", feature = "mqtt", feature = "nats"))]
impl Names {
    /// Refuses the template of key `key` when it names one name only (no placeholder) and that
    /// name breaks the rule: no event could be sent.
    pub(crate) fn check(self, key: &str, template: &Template) -> Result<(), String> {
        if template.is_constant() && !(self.valid)(template.as_str()) {
            return Err(format!(
                "key `{key}`: {:?} is not a valid {}",
                template.as_str(),
                self.what
            ));
        }
        Ok(())
    }

    /// The name `template` gives `event`, or the event's rejection when that name breaks the rule.
    pub(crate) fn of(self, template: &Template, event: &OutboxEvent) -> Result<String, Outcome> {
        let name = template.render(event);
        if (self.valid)(&name) {
            Ok(name)
        } else {
            Err(Outcome::Rejected {
                reason: format!("invalid {} {name:?}", self.what),
            })
        }
    }
}

/// Checks a message of `len` bytes against the sink's `max_message_bytes` (`max`): one over it is
/// rejected before it is sent. `what` is what the protocol calls it: `message`, `payload`.
#[cfg(any(feature = "mqtt", feature = "rabbitmq"))]
pub(crate) fn within_max(what: &str, len: usize, max: usize) -> Result<(), Outcome> {
    if len > max {
        return Err(Outcome::Rejected {
            reason: format!("{what} of {len} bytes is over max_message_bytes ({max})"),
        });
    }
    Ok(())
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
