//! The `mqtt` sink: publishes to an MQTT 5 broker at QoS 1.
//!
//! rumqttc's `publish` returns once the request is queued, long before the broker's PUBACK, so a
//! background task owns the event loop and matches packets: each queued publish gets a waiter in
//! FIFO order, the loop's `Outgoing::Publish(pkid)` binds the next waiter to its packet id, and
//! the `PubAck` with that id resolves it. An event is `Delivered` only after its PUBACK.
//!
//! Event headers travel as MQTT 5 user properties, plus `pgoutbox-id` (the event id, stable
//! across redeliveries), `pgoutbox-topic` and, when set, `pgoutbox-key`. A session (connection,
//! event loop, waiters) is made on the first publish; when its connection fails every waiting
//! event is a `Retry` and the next publish starts a fresh session, so nothing queued on a dead
//! connection can be mismatched with a later PUBACK. The probe of an open breaker starts a fresh
//! session too: one whose connection died without a word looks alive until its keep-alive fails.
//!
//! Credentials come from the URL's userinfo, percent-decoded (`%2B` is `+`, and a `+` stays a
//! `+`); they never reach a message.
//!
//! Classification: connection errors (including a refused login) and ack timeouts are retried, as
//! are the PUBACK reasons "not authorized" (ACLs change), "quota exceeded", "unspecified",
//! "implementation specific" and "packet identifier in use"; "topic name invalid" and "payload
//! format invalid", an invalid topic and a payload over `max_message_bytes` are rejected.
//!
//! Event headers cannot set the `pgoutbox-*` user properties; such a header is dropped with a
//! warning.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use async_trait::async_trait;
use rumqttc::v5::mqttbytes::v5::{Packet, PubAckReason, PublishProperties};
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::{AsyncClient, Event, EventLoop, MqttOptions};
use rumqttc::{Outgoing, TlsConfiguration, Transport};
use tokio::sync::{oneshot, Mutex};

use super::body::{Binding, Message, Shape};
use super::broker::{self, Broker, BrokerSettings, Connection, Kept, Names, Reconnects};
use super::reserved::Reserved;
use super::tls::TlsFiles;
use crate::config::Flat;
use crate::model::event::OutboxEvent;
use crate::model::outcome::Outcome;
use crate::model::secrets;
use crate::model::template::Template;

/// The largest MQTT packet (remaining length is at most 268,435,455 bytes).
const MQTT_MAX_PACKET: usize = 268_435_455;

/// MQTT topic names, as `topic` renders them.
const TOPICS: Names = Names {
    what: "MQTT topic name",
    valid: valid_topic,
};

super::sink_type!("mqtt": MqttSink, MqttConfig = MqttSettings + BrokerSettings);

super::own_settings! {
    /// The keys only `type = "mqtt"` takes.
    pub struct MqttSettings {
        /// Broker URL: `mqtt://[user:password@]host[:port]` (port 1883 by default), or `mqtts://`
        /// for TLS (port 8883 by default). User and password are percent-decoded: write `%40` for
        /// `@`, `%3A` for `:` in the user name, `%25` for `%`; a `+` is a `+`.
        pub url: crate::config::Secret,
        /// Topic template; default `{topic}`.
        #[serde(default = "Template::topic")]
        pub topic: Template,
        /// MQTT client id; default `pgoutbox-` plus a random suffix (two clients with one id evict
        /// each other).
        pub client_id: Option<String>,
        /// Publish with the retain flag.
        #[serde(default)]
        pub retain: bool,
        /// Larger payloads are rejected before sending; default 1 MiB (brokers often cap lower than
        /// MQTT's 256 MiB).
        #[serde(default = "default_max_message_bytes")]
        pub max_message_bytes: usize,
    }
}

fn default_max_message_bytes() -> usize {
    1 << 20
}

/// Publishes events to an MQTT broker.
pub struct MqttSink {
    cfg: MqttSettings,
    timeout: Duration,
    options: MqttOptions,
    reserved: Reserved,
    shape: Shape,
    session: Kept<Arc<Session>>,
    reconnects: Arc<Reconnects>,
}

super::sink_debug!(MqttSink { topic: cfg.topic });

/// One connection: the client that queues publishes and the waiters the event loop resolves.
pub(crate) struct Session {
    client: AsyncClient,
    waiters: Arc<StdMutex<Waiters>>,
    alive: Arc<AtomicBool>,
    // Publishes of one batch must enter the client's queue together with their waiters, in order.
    send: Mutex<()>,
}

impl Connection for Arc<Session> {
    fn usable(&self) -> bool {
        self.alive.load(Ordering::Acquire)
    }

    fn retire(self) {
        // Without a client left, the event loop ends (failing the waiters still there with
        // `Retry`); the DISCONNECT lets the broker end the session at once rather than when it
        // sees the socket close. Queued without waiting: a full or closed queue skips it.
        let _ = self.client.try_disconnect();
    }
}

#[derive(Default)]
struct Waiters {
    /// Queued publishes not yet given a packet id, in queue order.
    unsent: VecDeque<oneshot::Sender<Outcome>>,
    /// Sent publishes awaiting their PUBACK.
    inflight: HashMap<u16, oneshot::Sender<Outcome>>,
    /// Why the session ended, once it has: a publish the client can no longer queue is given
    /// this reason (a refused certificate, say), not the client's "channel closed".
    ended: Option<String>,
}

impl MqttSink {
    /// Validates the settings of destination `destination`; connects on the first publish.
    pub fn new(destination: &str, Flat { own: cfg, common }: MqttConfig) -> Result<Self, String> {
        let url = url::Url::parse(&cfg.url.0).map_err(|e| format!("key `url`: not a URL: {e}"))?;
        let secure = match url.scheme() {
            "mqtt" | "tcp" => false,
            "mqtts" | "ssl" => true,
            other => {
                return Err(format!(
                    "key `url`: scheme must be mqtt, or mqtts for TLS, not {other:?}"
                ))
            }
        };
        let tls = common.tls.load_for(secure, "a URL that is not mqtts://")?;
        let host = url
            .host_str()
            .filter(|h| !h.is_empty())
            .ok_or("key `url`: no host")?;
        common.check_timeout()?;
        if cfg.max_message_bytes == 0 || cfg.max_message_bytes > MQTT_MAX_PACKET {
            return Err(format!(
                "key `max_message_bytes`: must be between 1 and {MQTT_MAX_PACKET}"
            ));
        }
        TOPICS.check("topic", &cfg.topic)?;
        let client_id = match &cfg.client_id {
            Some(id) if id.is_empty() => return Err("key `client_id`: must not be empty".into()),
            Some(id) => id.clone(),
            None => format!("pgoutbox-{}", uuid::Uuid::new_v4().simple()),
        };
        let port = url.port().unwrap_or(if secure { 8883 } else { 1883 });
        let mut options = MqttOptions::new(client_id, host, port);
        if secure {
            let config = tls.unwrap_or_else(TlsFiles::system).client_config()?;
            options.set_transport(Transport::tls_with_config(TlsConfiguration::Rustls(
                Arc::new(config),
            )));
        }
        options
            .set_clean_start(true)
            .set_keep_alive(Duration::from_secs(30))
            .set_connection_timeout(common.timeout.as_secs().max(1))
            .set_max_packet_size(Some(MQTT_MAX_PACKET as u32));
        if let Some(credentials) =
            secrets::credentials(&url).map_err(|e| format!("key `url`: {e}"))?
        {
            options.set_credentials(credentials.user, credentials.password.unwrap_or_default());
        }
        Ok(Self {
            shape: common.shape()?,
            cfg,
            timeout: common.timeout,
            options,
            reserved: Reserved::new("mqtt", &[], &["pgoutbox-"]),
            session: Kept::new(),
            reconnects: Arc::new(Reconnects::new(destination)),
        })
    }

    /// Queues `event` on `session`: its PUBACK to come, or its outcome at once.
    async fn queue(
        &self,
        session: &Session,
        event: &OutboxEvent,
    ) -> Result<oneshot::Receiver<Outcome>, Outcome> {
        let topic = TOPICS.of(&self.cfg.topic, event)?;
        let message = self.shape.message(event, Binding::Mqtt);
        let payload: &[u8] = &message.body;
        broker::within_max("payload", payload.len(), self.cfg.max_message_bytes)?;
        let (tx, rx) = oneshot::channel();
        session
            .waiters
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .unsent
            .push_back(tx);
        let queued = session
            .client
            .publish_with_properties(
                topic,
                QoS::AtLeastOnce,
                self.cfg.retain,
                payload.to_vec(),
                self.properties(event, &message),
            )
            .await;
        // A request that never entered the queue has no packet coming: its waiter (the last one
        // pushed) must not be bound to the next packet id.
        if let Err(e) = queued {
            let ended = {
                let mut w = session.waiters.lock().unwrap_or_else(|p| p.into_inner());
                w.unsent.pop_back();
                w.ended.clone()
            };
            return Err(Outcome::retry(
                ended.unwrap_or_else(|| format!("MQTT client closed: {e}")),
            ));
        }
        Ok(rx)
    }

    fn properties(&self, event: &OutboxEvent, message: &Message<'_>) -> PublishProperties {
        let mut user_properties = Vec::with_capacity(event.headers.len() + 3);
        user_properties.push(("pgoutbox-id".to_owned(), event.id.to_string()));
        user_properties.push(("pgoutbox-topic".to_owned(), event.topic.clone()));
        if let Some(key) = &event.key {
            user_properties.push(("pgoutbox-key".to_owned(), key.clone()));
        }
        // CloudEvents attributes (binary mode) are the sink's own: an event header of the same
        // name is not sent beside them.
        let attribute = |k: &str| message.attributes.iter().any(|(n, _)| n == k);
        user_properties.extend(
            event
                .headers
                .iter()
                .filter(|(k, _)| !attribute(k) && self.reserved.permits(k))
                .cloned(),
        );
        user_properties.extend(message.attributes.iter().cloned());
        PublishProperties {
            // 1 = the payload is UTF-8 (JSON text).
            payload_format_indicator: Some(1),
            content_type: Some(message.content_type.into()),
            user_properties,
            ..Default::default()
        }
    }
}

/// A topic name one can publish to: non-empty, no wildcards, no NUL.
fn valid_topic(topic: &str) -> bool {
    !topic.is_empty() && !topic.contains(['+', '#', '\0']) && topic.len() <= 65_535
}

/// Owns the event loop: binds waiters to packet ids and resolves them on PUBACK; on a connection
/// error fails every waiter with `Retry` and ends the session.
async fn drive(
    mut eventloop: EventLoop,
    waiters: Arc<StdMutex<Waiters>>,
    alive: Arc<AtomicBool>,
    reconnects: Arc<Reconnects>,
) {
    let reason = loop {
        match eventloop.poll().await {
            // A session connects once: its event loop ends on its first connection error.
            Ok(Event::Incoming(Packet::ConnAck(_))) => reconnects.connected(),
            Ok(Event::Outgoing(Outgoing::Publish(pkid))) => {
                let mut w = waiters.lock().unwrap_or_else(|p| p.into_inner());
                if let Some(waiter) = w.unsent.pop_front() {
                    w.inflight.insert(pkid, waiter);
                }
            }
            Ok(Event::Incoming(Packet::PubAck(ack))) => {
                let waiter = waiters
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .inflight
                    .remove(&ack.pkid);
                if let Some(waiter) = waiter {
                    let _ = waiter.send(classify(ack.reason));
                }
            }
            Ok(Event::Incoming(Packet::Disconnect(d))) => {
                break format!("the broker disconnected: {:?}", d.reason_code);
            }
            Ok(_) => {}
            Err(e) => break format!("MQTT connection failed: {e}"),
        }
    };
    alive.store(false, Ordering::Release);
    let mut guard = waiters.lock().unwrap_or_else(|p| p.into_inner());
    let w = &mut *guard;
    w.ended = Some(reason.clone());
    for waiter in w.unsent.drain(..).chain(w.inflight.drain().map(|(_, v)| v)) {
        let _ = waiter.send(Outcome::retry(reason.clone()));
    }
}

fn classify(reason: PubAckReason) -> Outcome {
    match reason {
        PubAckReason::Success | PubAckReason::NoMatchingSubscribers => Outcome::Delivered,
        // Not authorized: ACLs and credentials change, and a spell of it must not dead-letter
        // every event.
        PubAckReason::NotAuthorized
        | PubAckReason::QuotaExceeded
        | PubAckReason::UnspecifiedError
        | PubAckReason::ImplementationSpecificError
        | PubAckReason::PacketIdentifierInUse => Outcome::retry(format!(
            "the broker refused the publish for now: {reason:?}"
        )),
        PubAckReason::TopicNameInvalid | PubAckReason::PayloadFormatInvalid => Outcome::Rejected {
            reason: format!("the broker refused the publish: {reason:?}"),
        },
    }
}

#[async_trait]
impl Broker for MqttSink {
    type Link = Arc<Session>;

    async fn send(&self, session: Self::Link, events: &[&OutboxEvent]) -> Vec<Outcome> {
        let mut pending = Vec::with_capacity(events.len());
        {
            let _order = session.send.lock().await;
            for event in events {
                pending.push(self.queue(&session, event).await);
            }
        }
        let mut outcomes = Vec::with_capacity(events.len());
        for p in pending {
            outcomes.push(match p {
                Err(outcome) => outcome,
                Ok(rx) => match tokio::time::timeout(self.timeout, rx).await {
                    Ok(Ok(outcome)) => outcome,
                    Ok(Err(_)) => Outcome::retry("MQTT connection lost before the PUBACK"),
                    Err(_) => Outcome::retry(format!("no PUBACK within {:?}", self.timeout)),
                },
            });
        }
        outcomes
    }

    /// Starts a session. Its event loop makes the connection, in the background: this never
    /// fails, and a session whose connection fails fails its waiting events instead.
    async fn connect(&self) -> Result<Self::Link, String> {
        let (client, eventloop) = AsyncClient::new(self.options.clone(), 1024);
        let waiters = Arc::new(StdMutex::new(Waiters::default()));
        let alive = Arc::new(AtomicBool::new(true));
        tokio::spawn(drive(
            eventloop,
            waiters.clone(),
            alive.clone(),
            self.reconnects.clone(),
        ));
        Ok(Arc::new(Session {
            client,
            waiters,
            alive,
            send: Mutex::new(()),
        }))
    }

    fn kept(&self) -> &Kept<Self::Link> {
        &self.session
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sinks::broker::testing::assert_names;

    #[test]
    fn topics_are_checked() {
        assert_names(valid_topic, &["orders/created"], &["orders/+", ""]);
    }

    fn sink(url: &str) -> Result<MqttSink, String> {
        let table: toml::Table = format!("url = {url:?}").parse().expect("toml");
        MqttSink::new("mqtt", crate::config::sink_settings(&table)?)
    }

    #[test]
    fn credentials_are_percent_decoded_never_form_decoded() {
        let sink =
            self::sink("mqtt://us%3Aer+a%2Bb%40:pa:ss+w%2Bd%40@127.0.0.1:1883").expect("valid");
        let login = sink.options.credentials().expect("credentials");
        assert_eq!(login.username, "us:er+a+b@");
        assert_eq!(login.password, "pa:ss+w+d@");

        let sink = self::sink("mqtt://user@127.0.0.1").expect("valid");
        let login = sink.options.credentials().expect("credentials");
        assert_eq!(
            (login.username.as_str(), login.password.as_str()),
            ("user", "")
        );
        assert!(self::sink("mqtt://127.0.0.1")
            .expect("valid")
            .options
            .credentials()
            .is_none());

        let err = self::sink("mqtt://u:%FF%FE@127.0.0.1").expect_err("not UTF-8");
        assert!(err.contains("key `url`") && !err.contains("FF"), "{err}");
    }

    #[test]
    fn authorization_is_transient_and_bad_topics_permanent() {
        assert!(matches!(
            classify(PubAckReason::NotAuthorized),
            Outcome::Retry { .. }
        ));
        assert!(matches!(
            classify(PubAckReason::QuotaExceeded),
            Outcome::Retry { .. }
        ));
        assert!(matches!(
            classify(PubAckReason::TopicNameInvalid),
            Outcome::Rejected { .. }
        ));
        assert_eq!(
            classify(PubAckReason::NoMatchingSubscribers),
            Outcome::Delivered
        );
    }
}
