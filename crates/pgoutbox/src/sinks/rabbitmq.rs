//! The `rabbitmq` sink: publishes to a RabbitMQ (AMQP 0-9-1) exchange with publisher confirms.
//!
//! Messages are persistent (delivery mode 2) and `mandatory`: a message no queue takes comes back
//! and is `Rejected` ("no route") instead of vanishing. `message_id` is the event id. A batch is
//! published in order on one channel without waiting, then each confirm is awaited: an event is
//! `Delivered` only once the broker has confirmed it. The connection is made on the first publish
//! and made again after it breaks, and for each probe of an open breaker (a connection that looks
//! up may be dead without knowing it until its heartbeat fails); while the broker is unreachable
//! every event is a `Retry`.
//!
//! Classification: connection and channel errors (including a refused login and a refused
//! permission, `ACCESS_REFUSED`), timeouts and broker nacks are retried; a returned (unroutable)
//! message, a routing key over 255 bytes and a message over `max_message_bytes` are rejected.
//!
//! Event headers cannot set `pgoutbox-*` headers nor `CC` / `BCC` (RabbitMQ routes copies of
//! the message to the queues they name); such a header is dropped with a warning. The URL's
//! password never reaches a message.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::tcp::{OwnedIdentity, OwnedTLSConfig};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Confirmation, ConnectionProperties, PublisherConfirm};

use super::body::{Binding, Message, Shape};
use super::broker::{self, Broker, BrokerSettings, Connection, Kept, Reconnects};
use super::reserved::Reserved;
use crate::config::Flat;
use crate::model::event::OutboxEvent;
use crate::model::outcome::Outcome;
use crate::model::secrets;
use crate::model::template::Template;

/// AMQP short strings (routing keys, header names, message ids) are at most this long.
const SHORT_STRING_MAX: usize = 255;

/// Event header names this sink writes, or that make RabbitMQ route the message elsewhere
/// (sender-selected distribution).
const RESERVED_NAMES: &[&str] = &["cc", "bcc"];

/// Event header prefixes this sink writes.
const RESERVED_PREFIXES: &[&str] = &["pgoutbox-"];

/// Every message is `mandatory`: one no queue takes comes back, and is rejected.
const PUBLISH: BasicPublishOptions = BasicPublishOptions {
    mandatory: true,
    immediate: false,
};

super::sink_type!("rabbitmq": RabbitMqSink, RabbitMqConfig = RabbitMqSettings + BrokerSettings);

super::own_settings! {
    /// The keys only `type = "rabbitmq"` takes.
    pub struct RabbitMqSettings {
        /// AMQP URI, e.g. `amqp://guest:guest@127.0.0.1:5672/%2f` (`amqps://` for TLS).
        pub url: crate::config::Secret,
        /// Exchange to publish to; default `""`, the default exchange (routing key = queue name).
        #[serde(default)]
        pub exchange: String,
        /// Routing key template; default `{topic}`.
        #[serde(default = "Template::topic")]
        pub routing_key: Template,
        /// Larger messages are rejected before sending (RabbitMQ's default `max_message_size`,
        /// 128 MiB).
        #[serde(default = "default_max_message_bytes")]
        pub max_message_bytes: usize,
    }
}

fn default_max_message_bytes() -> usize {
    128 << 20
}

/// Publishes events to one RabbitMQ exchange.
pub struct RabbitMqSink {
    cfg: RabbitMqSettings,
    timeout: Duration,
    // Holds the client key: never `Debug`-printed (lapin's own `Debug` would show it).
    tls: OwnedTLSConfig,
    reserved: Reserved,
    shape: Shape,
    // One connection and confirm-mode channel, replaced when either breaks.
    link: Kept<Arc<Link>>,
    reconnects: Reconnects,
}

pub(crate) struct Link {
    conn: lapin::Connection,
    channel: Channel,
}

// Dropped with its last clone (publishes still using it finish first), lapin closes the
// connection itself, without waiting for the broker's answer.
impl Connection for Arc<Link> {
    fn usable(&self) -> bool {
        self.conn.status().connected() && self.channel.status().connected()
    }
}

super::sink_debug!(RabbitMqSink {
    exchange: cfg.exchange,
    routing_key: cfg.routing_key
});

impl RabbitMqSink {
    /// Validates the settings of destination `destination`; connects on the first publish.
    pub fn new(
        destination: &str,
        Flat { own: cfg, common }: RabbitMqConfig,
    ) -> Result<Self, String> {
        let uri = cfg
            .url
            .0
            .parse::<lapin::uri::AMQPUri>()
            // The parser's error may quote the whole URI.
            .map_err(|e| {
                format!(
                    "key `url`: not an AMQP URI: {}",
                    secrets::scrub(&e, &cfg.url.0)
                )
            })?;
        let tls = match common.tls.load_for(
            uri.scheme == lapin::uri::AMQPScheme::AMQPS,
            "a URL that is not amqps://",
        )? {
            None => OwnedTLSConfig::default(),
            Some(files) => OwnedTLSConfig {
                identity: files.identity.map(|id| OwnedIdentity::PKCS8 {
                    pem: id.cert_pem,
                    key: id.key_pem,
                }),
                cert_chain: files
                    .ca_pem
                    .map(|pem| String::from_utf8_lossy(&pem).into_owned()),
            },
        };
        // A key's placeholders only lengthen it: its literal parts alone must fit.
        if cfg.routing_key.sample("").len() > SHORT_STRING_MAX {
            return Err(format!(
                "key `routing_key`: longer than {SHORT_STRING_MAX} bytes"
            ));
        }
        if cfg.exchange.len() > SHORT_STRING_MAX {
            return Err(format!(
                "key `exchange`: longer than {SHORT_STRING_MAX} bytes"
            ));
        }
        common.check_timeout()?;
        if cfg.max_message_bytes == 0 {
            return Err("key `max_message_bytes`: must be more than zero".into());
        }
        Ok(Self {
            shape: common.shape()?,
            cfg,
            timeout: common.timeout,
            tls,
            reserved: Reserved::new("rabbitmq", RESERVED_NAMES, RESERVED_PREFIXES),
            link: Kept::new(),
            reconnects: Reconnects::new(destination),
        })
    }

    /// A client error as text, with the URL's secrets masked.
    fn error_text(&self, e: &lapin::Error) -> String {
        secrets::scrub(&e.to_string(), &self.cfg.url.0)
    }

    /// Publishes `event` on `channel` without waiting: its confirm to come, or its outcome at once.
    async fn send_one(
        &self,
        channel: &Channel,
        event: &OutboxEvent,
    ) -> Result<PublisherConfirm, Outcome> {
        let routing_key = self.cfg.routing_key.render(event);
        let message = self.shape.message(event, Binding::Amqp);
        let payload: &[u8] = &message.body;
        if routing_key.len() > SHORT_STRING_MAX {
            return Err(Outcome::Rejected {
                reason: format!("routing key longer than {SHORT_STRING_MAX} bytes"),
            });
        }
        broker::within_max("message", payload.len(), self.cfg.max_message_bytes)?;
        channel
            .basic_publish(
                self.cfg.exchange.as_str().into(),
                routing_key.into(),
                PUBLISH,
                payload,
                self.properties(event, &message),
            )
            .await
            .map_err(|e| Outcome::retry(format!("publish failed: {}", self.error_text(&e))))
    }

    fn properties(&self, event: &OutboxEvent, message: &Message<'_>) -> BasicProperties {
        let mut headers = FieldTable::default();
        for (k, v) in &event.headers {
            // AMQP header names are short strings; a longer one (hand-written SQL) is skipped.
            if k.len() <= SHORT_STRING_MAX && self.reserved.permits(k) {
                headers.insert(
                    ShortString::from(k.as_str()),
                    AMQPValue::LongString(LongString::from(v.as_str())),
                );
            }
        }
        headers.insert(
            "pgoutbox-topic".into(),
            AMQPValue::LongString(event.topic.as_str().into()),
        );
        if let Some(key) = &event.key {
            headers.insert(
                "pgoutbox-key".into(),
                AMQPValue::LongString(key.as_str().into()),
            );
        }
        for (name, value) in &message.attributes {
            headers.insert(
                name.as_str().into(),
                AMQPValue::LongString(value.as_str().into()),
            );
        }
        BasicProperties::default()
            .with_delivery_mode(2)
            .with_content_type(message.content_type.into())
            .with_message_id(event.id.to_string().into())
            .with_timestamp(event.created_at.timestamp().max(0) as u64)
            .with_headers(headers)
    }
}

#[async_trait]
impl Broker for RabbitMqSink {
    type Link = Arc<Link>;

    async fn send(&self, link: Self::Link, events: &[&OutboxEvent]) -> Vec<Outcome> {
        // Publish all in batch order on one channel (AMQP keeps channel order), then await the
        // confirms.
        let mut pending = Vec::with_capacity(events.len());
        for event in events {
            pending.push(self.send_one(&link.channel, event).await);
        }
        let mut outcomes = Vec::with_capacity(events.len());
        for p in pending {
            let confirm = match p {
                Ok(confirm) => confirm,
                Err(outcome) => {
                    outcomes.push(outcome);
                    continue;
                }
            };
            outcomes.push(match tokio::time::timeout(self.timeout, confirm).await {
                Ok(Ok(Confirmation::Ack(None))) => Outcome::Delivered,
                Ok(Ok(Confirmation::Ack(Some(returned))))
                | Ok(Ok(Confirmation::Nack(Some(returned)))) => Outcome::Rejected {
                    reason: format!(
                        "no route: the broker returned the message ({} {})",
                        returned.reply_code, returned.reply_text
                    ),
                },
                Ok(Ok(Confirmation::Nack(None))) => Outcome::retry("the broker nacked the message"),
                Ok(Ok(Confirmation::NotRequested)) => {
                    Outcome::retry("publisher confirms are off on this channel")
                }
                Ok(Err(e)) => Outcome::retry(format!("no confirm: {}", self.error_text(&e))),
                Err(_) => Outcome::retry(format!("no confirm within {:?}", self.timeout)),
            });
        }
        outcomes
    }

    async fn connect(&self) -> Result<Self::Link, String> {
        let connect = async {
            let conn = lapin::Connection::connect_with_config(
                &self.cfg.url.0,
                ConnectionProperties::default()
                    .with_connection_name(concat!("pgoutbox/", env!("CARGO_PKG_VERSION")).into()),
                self.tls.clone(),
                lapin::runtime::default_runtime()?,
            )
            .await?;
            let channel = conn.create_channel().await?;
            channel
                .confirm_select(ConfirmSelectOptions::default())
                .await?;
            Ok::<_, lapin::Error>(Link { conn, channel })
        };
        match tokio::time::timeout(self.timeout, connect).await {
            Ok(Ok(link)) => {
                self.reconnects.connected();
                Ok(Arc::new(link))
            }
            Ok(Err(e)) => Err(format!(
                "cannot connect to RabbitMQ: {}",
                self.error_text(&e)
            )),
            Err(_) => Err(format!(
                "cannot connect to RabbitMQ: no answer within {:?}",
                self.timeout
            )),
        }
    }

    fn kept(&self) -> &Kept<Self::Link> {
        &self.link
    }

    async fn ready(&self) -> Result<(), String> {
        self.link().await.map(drop)
    }
}
