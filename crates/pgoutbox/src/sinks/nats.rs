//! The `nats` sink: publishes to NATS JetStream, one message per event, pipelined.
//!
//! Every message carries `Nats-Msg-Id` = event id, so JetStream drops a redelivery that lands
//! inside the stream's duplicate window (the PubAck then says `duplicate`). A batch is sent in
//! order without waiting (in windows of [`PIPELINE_WINDOW`]), then each PubAck is awaited: an
//! event is `Delivered` only once the stream has stored it. The client connects on the first publish and reconnects by itself;
//! while it is disconnected every event is a `Retry`. The probe of an open breaker gets a new
//! client: the kept one waits between its reconnects (up to 4 s, longer each time), so after an
//! outage it would still be "reconnecting" when the probe comes.
//!
//! Credentials in the URL (`nats://user:password@host`, or `nats://token@host`) are taken out of
//! it and given to the client as its credentials, so the address the client logs carries none.
//!
//! Classification: no connection (including authentication and authorization failures), ack
//! timeouts, JetStream being unavailable and any JetStream error not listed here are retried; an
//! invalid subject, a message over the server's `max_payload` or the stream's `max_msg_size`, and
//! a subject no stream takes are rejected.
//!
//! Event headers cannot set `Nats-*` headers (JetStream acts on them: `Nats-Msg-Id` deduplicates,
//! `Nats-Rollup` purges, `Nats-Expected-*` fail the publish) nor `pgoutbox-*`; such a header is
//! dropped with a warning.

use std::collections::HashMap;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_nats::header::{HeaderMap, HeaderName, HeaderValue};
use async_nats::jetstream::context::{
    GetStreamByNameErrorKind, PublishAckFuture, PublishError, PublishErrorKind,
};
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::ErrorCode;
use async_nats::ServerAddr;
use async_trait::async_trait;

use super::body::{Binding, Shape};
use super::broker::{Broker, BrokerSettings, Connection, Kept, Names, Reconnects};
use super::reserved::Reserved;
use super::tls::TlsFiles;
use crate::config::{Flat, Secret};
use crate::error::error_chain;
use crate::model::event::OutboxEvent;
use crate::model::outcome::Outcome;
use crate::model::secrets::{self, redact_url, Credentials};
use crate::model::template::Template;

/// Events sent before their PubAcks are awaited. async-nats holds one permit per unacknowledged
/// publish (5,000 by default) and blocks the next send when they run out: a batch larger than
/// that, sent whole before awaiting, would wait on itself.
const PIPELINE_WINDOW: usize = 256;

super::sink_type!("nats": NatsSink, NatsConfig = NatsSettings + BrokerSettings);

super::own_settings! {
    /// The keys only `type = "nats"` takes.
    pub struct NatsSettings {
        /// Server URL(s), comma-separated, e.g. `nats://127.0.0.1:4222`. Credentials may go in the
        /// URL (`user:password@` or `token@`, percent-encoded; the same on every server); they are
        /// never shown in messages.
        pub url: Secret,
        /// Subject template; default `{topic}`.
        #[serde(default = "Template::topic")]
        pub subject: Template,
        /// Create the stream `stream` with `subjects` if it does not exist (off by default).
        #[serde(default)]
        pub create_stream: bool,
        /// Stream name, for `create_stream`.
        pub stream: Option<String>,
        /// Subjects the created stream takes (NATS wildcards allowed), for `create_stream`.
        #[serde(default)]
        pub subjects: Vec<String>,
        /// JetStream duplicate window of the created stream; default the server's (2 minutes).
        #[serde(default, with = "opt_duration")]
        pub duplicate_window: Option<Duration>,
        /// NKey authentication: the user's seed (`SU…`), best given as `{ file = … }` or
        /// `{ env = … }`.
        pub nkey_seed: Option<Secret>,
        /// Decentralized (JWT) authentication: the path of a `.creds` file, read when the
        /// configuration loads.
        pub credentials_file: Option<PathBuf>,
    }
}

/// `duplicate_window = "2m"`: present means `Some`; absent is handled by `#[serde(default)]`.
mod opt_duration {
    use std::time::Duration;

    use serde::Deserializer;

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        crate::config::duration_str::deserialize(d).map(Some)
    }
}

/// NATS subjects, as `subject` renders them.
const SUBJECTS: Names = Names {
    what: "NATS subject",
    valid: valid_subject,
};

/// Event header names JetStream or this sink act on.
const RESERVED_PREFIXES: &[&str] = &["nats-", "pgoutbox-"];

/// Publishes events to JetStream.
pub struct NatsSink {
    cfg: NatsSettings,
    timeout: Duration,
    /// The servers, without credentials.
    servers: Vec<ServerAddr>,
    /// The credentials the URL carried.
    credentials: Option<Credentials>,
    /// NKey or `.creds` authentication, read when the configuration loaded.
    auth: Auth,
    /// CA and client certificate, when configured.
    tls: Option<TlsFiles>,
    reserved: Reserved,
    shape: Shape,
    conn: Kept<Conn>,
    reconnects: Reconnects,
    duplicates: AtomicU64,
}

/// Authentication other than the URL's user, password or token.
#[derive(Debug, Clone)]
enum Auth {
    None,
    Nkey(Secret),
    Creds(Secret),
}

#[derive(Clone)]
pub(crate) struct Conn {
    client: async_nats::Client,
    js: async_nats::jetstream::Context,
}

// The client's task ends once no clone of it is left — or, if it was reconnecting then, once its
// next reconnect gets through: the attempts an outage would have cost anyway, and no more.
impl Connection for Conn {}

super::sink_debug!(NatsSink {
    subject: cfg.subject
});

impl NatsSink {
    /// Validates the settings of destination `destination`; connects on the first publish.
    pub fn new(destination: &str, Flat { own: cfg, common }: NatsConfig) -> Result<Self, String> {
        if cfg.url.0.trim().is_empty() {
            return Err("key `url`: must not be empty".into());
        }
        let mut servers = Vec::new();
        let mut credentials = None;
        for part in cfg.url.0.split(',').map(str::trim) {
            let mut url = part
                .parse::<ServerAddr>()
                .map_err(|e| {
                    format!(
                        "key `url`: {} is not a NATS server address: {}",
                        redact_url(part),
                        secrets::scrub(&e.to_string(), part)
                    )
                })?
                .into_inner();
            let found = secrets::credentials(&url).map_err(|e| format!("key `url`: {e}"))?;
            if found.is_some() {
                if credentials.is_some() && credentials != found {
                    return Err(
                        "key `url`: the servers carry different credentials; give every server the same ones"
                            .into(),
                    );
                }
                credentials = found;
                // Only the client options carry them from here on.
                let _ = url.set_password(None);
                let _ = url.set_username("");
            }
            servers.push(ServerAddr::from_url(url).map_err(|e| format!("key `url`: {e}"))?);
        }
        let tls = common.tls.load()?;
        let mut auth = Auth::None;
        if let Some(seed) = &cfg.nkey_seed {
            // Checked here so that a typo is a configuration error, not an endless retry.
            nkeys::KeyPair::from_seed(seed.expose())
                .map_err(|e| format!("key `nkey_seed`: not an NKey seed: {e}"))?;
            auth = Auth::Nkey(seed.clone());
        }
        if let Some(path) = &cfg.credentials_file {
            if !matches!(auth, Auth::None) {
                return Err("keys `nkey_seed` and `credentials_file`: give one, not both".into());
            }
            let creds = std::fs::read_to_string(path).map_err(|e| {
                format!(
                    "key `credentials_file`: cannot read {}: {e}",
                    path.display()
                )
            })?;
            async_nats::ConnectOptions::new()
                .credentials(&creds)
                .map_err(|e| {
                    format!(
                        "key `credentials_file`: {} is not a NATS credentials file: {e}",
                        path.display()
                    )
                })?;
            auth = Auth::Creds(Secret(creds));
        }
        if !matches!(auth, Auth::None) && credentials.is_some() {
            return Err(
                "key `url`: carries a user or token, and `nkey_seed` or `credentials_file` is set too; give one"
                    .into(),
            );
        }
        common.check_timeout()?;
        SUBJECTS.check("subject", &cfg.subject)?;
        if cfg.create_stream {
            match cfg.stream.as_deref() {
                None | Some("") => {
                    return Err("key `stream`: required when `create_stream` is true".into())
                }
                Some(name) if name.contains(['.', ' ', '\t', '*', '>']) => {
                    return Err(format!(
                        "key `stream`: {name:?} must not contain spaces, `.`, `*` or `>`"
                    ))
                }
                Some(_) => {}
            }
            if cfg.subjects.is_empty() {
                return Err("key `subjects`: list the subjects of the stream to create".into());
            }
        } else if cfg.stream.is_some() || !cfg.subjects.is_empty() || cfg.duplicate_window.is_some()
        {
            return Err(
                "keys `stream`, `subjects` and `duplicate_window` only apply with `create_stream = true`"
                    .into(),
            );
        }
        Ok(Self {
            shape: common.shape()?,
            cfg,
            timeout: common.timeout,
            servers,
            credentials,
            auth,
            tls,
            reserved: Reserved::new("nats", &[], RESERVED_PREFIXES),
            conn: Kept::new(),
            reconnects: Reconnects::new(destination),
            duplicates: AtomicU64::new(0),
        })
    }

    /// `message` with the secrets of every configured server URL masked.
    fn scrub(&self, message: String) -> String {
        self.cfg
            .url
            .0
            .split(',')
            .fold(message, |m, part| secrets::scrub(&m, part.trim()))
    }

    /// How many publishes JetStream acknowledged as duplicates (redeliveries it dropped).
    pub fn duplicates(&self) -> u64 {
        self.duplicates.load(Ordering::Relaxed)
    }

    fn message(&self, event: &OutboxEvent) -> PublishMessage {
        let mut headers = HeaderMap::new();
        for (k, v) in &event.headers {
            // A header written by hand in SQL may not be valid NATS; it is skipped, not fatal.
            if let Ok(name) = HeaderName::from_str(k) {
                if !v.contains(['\r', '\n']) && self.reserved.permits(k) {
                    headers.insert(name, HeaderValue::from(v.as_str()));
                }
            }
        }
        if let Some(key) = &event.key {
            if !key.contains(['\r', '\n']) {
                headers.insert("pgoutbox-key", key.as_str());
            }
        }
        headers.insert("pgoutbox-topic", event.topic.as_str());
        let message = self.shape.message(event, Binding::Headers);
        for (name, value) in &message.attributes {
            if !value.contains(['\r', '\n']) {
                headers.insert(name.as_str(), value.as_str());
            }
        }
        if self.shape.states_content_type() {
            headers.insert("content-type", message.content_type);
        }
        PublishMessage::build()
            .payload(message.body.into_owned().into())
            .headers(headers)
            .message_id(event.id.to_string())
    }

    async fn classify_publish_error(
        &self,
        js: &async_nats::jetstream::Context,
        subject: &str,
        error: &PublishError,
        reason: String,
        streamless: &mut HashMap<String, bool>,
    ) -> Outcome {
        match error.kind() {
            PublishErrorKind::MaxPayloadExceeded => Outcome::Rejected { reason },
            // A JetStream error in the PubAck: only "over the stream's max_msg_size" is about
            // the message itself; the others (limits reached, JetStream unavailable) may pass.
            PublishErrorKind::Other
                if jetstream_code(error) == Some(ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM) =>
            {
                Outcome::Rejected { reason }
            }
            // "No responders" also happens while JetStream starts up or elects a leader: only a
            // definite "no stream matches" from JetStream is permanent. Asked once per subject
            // per batch.
            PublishErrorKind::StreamNotFound => {
                let none = match streamless.get(subject) {
                    Some(none) => *none,
                    None => {
                        let none = matches!(
                            js.stream_by_subject(subject).await,
                            Err(e) if matches!(e.kind(), GetStreamByNameErrorKind::NotFound)
                        );
                        streamless.insert(subject.to_owned(), none);
                        none
                    }
                };
                if none {
                    Outcome::Rejected {
                        reason: format!("no JetStream stream takes subject {subject:?}"),
                    }
                } else {
                    Outcome::retry(reason)
                }
            }
            _ => Outcome::retry(reason),
        }
    }
}

/// The JetStream API error code behind a publish error, when JetStream answered with one.
fn jetstream_code(error: &PublishError) -> Option<ErrorCode> {
    std::error::Error::source(error)
        .and_then(|source| source.downcast_ref::<async_nats::jetstream::Error>())
        .map(async_nats::jetstream::Error::error_code)
}

/// A subject a message can be published to: non-empty dot-separated tokens, no whitespace, no
/// wildcards.
fn valid_subject(subject: &str) -> bool {
    !subject.is_empty()
        && subject.split('.').all(|token| {
            !token.is_empty()
                && token != "*"
                && token != ">"
                && !token.contains(|c: char| c.is_whitespace())
        })
}

#[async_trait]
impl Broker for NatsSink {
    type Link = Conn;

    async fn send(&self, conn: Conn, events: &[&OutboxEvent]) -> Vec<Outcome> {
        if conn.client.connection_state() != async_nats::connection::State::Connected {
            return vec![Outcome::retry("not connected to NATS (reconnecting)"); events.len()];
        }
        let mut streamless = HashMap::new();
        let mut outcomes = Vec::with_capacity(events.len());
        for window in events.chunks(PIPELINE_WINDOW) {
            outcomes.extend(self.publish_window(&conn, window, &mut streamless).await);
        }
        outcomes
    }

    async fn connect(&self) -> Result<Conn, String> {
        let mut options = async_nats::ConnectOptions::new()
            .connection_timeout(self.timeout)
            .name(concat!("pgoutbox/", env!("CARGO_PKG_VERSION")))
            // Reconnect forever: the relay keeps running through broker outages.
            .max_reconnects(None);
        options = match &self.credentials {
            Some(Credentials {
                user,
                password: Some(password),
            }) => options.user_and_password(user.clone(), password.clone()),
            Some(Credentials {
                user,
                password: None,
            }) => options.token(user.clone()),
            None => options,
        };
        options = match &self.auth {
            Auth::None => options,
            Auth::Nkey(seed) => options.nkey(seed.expose().to_owned()),
            Auth::Creds(creds) => options
                .credentials(creds.expose())
                .map_err(|e| format!("the NATS credentials file cannot be used: {e}"))?,
        };
        if let Some(files) = &self.tls {
            options = options
                .require_tls(true)
                .tls_client_config(files.client_config()?);
        }
        let client = options
            .connect(self.servers.as_slice())
            .await
            .map_err(|e| self.scrub(format!("cannot connect to NATS: {}", error_chain(&e))))?;
        let js = async_nats::jetstream::context::ContextBuilder::new()
            .timeout(self.timeout)
            .build(client.clone());
        if self.cfg.create_stream {
            let config = async_nats::jetstream::stream::Config {
                name: self.cfg.stream.clone().unwrap_or_default(),
                subjects: self.cfg.subjects.clone(),
                duplicate_window: self.cfg.duplicate_window.unwrap_or_default(),
                ..Default::default()
            };
            js.get_or_create_stream(config).await.map_err(|e| {
                self.scrub(format!(
                    "cannot create the JetStream stream: {}",
                    error_chain(&e)
                ))
            })?;
        }
        self.reconnects.connected();
        Ok(Conn { client, js })
    }

    fn kept(&self) -> &Kept<Conn> {
        &self.conn
    }

    async fn ready(&self) -> Result<(), String> {
        let conn = self.link().await?;
        conn.client
            .flush()
            .await
            .map_err(|e| self.scrub(format!("NATS is not reachable: {}", error_chain(&e))))
    }
}

impl NatsSink {
    /// Sends a window of events in order, then awaits their PubAcks.
    async fn publish_window(
        &self,
        conn: &Conn,
        events: &[&OutboxEvent],
        streamless: &mut HashMap<String, bool>,
    ) -> Vec<Outcome> {
        let mut pending = Vec::with_capacity(events.len());
        for event in events {
            pending.push(self.send_one(conn, event, streamless).await);
        }
        let mut outcomes = Vec::with_capacity(events.len());
        for p in pending {
            outcomes.push(match p {
                Err(outcome) => outcome,
                Ok((subject, ack)) => match ack.await {
                    Ok(ack) => {
                        if ack.duplicate {
                            self.duplicates.fetch_add(1, Ordering::Relaxed);
                            tracing::debug!(stream = %ack.stream, seq = ack.sequence, "JetStream dropped a duplicate");
                        }
                        Outcome::Delivered
                    }
                    Err(e) => {
                        let reason =
                            self.scrub(format!("no PubAck for {subject:?}: {}", error_chain(&e)));
                        self.classify_publish_error(&conn.js, &subject, &e, reason, streamless)
                            .await
                    }
                },
            });
        }
        outcomes
    }

    /// Sends `event` without waiting: its subject and PubAck to come, or its outcome at once.
    async fn send_one(
        &self,
        conn: &Conn,
        event: &OutboxEvent,
        streamless: &mut HashMap<String, bool>,
    ) -> Result<(String, PublishAckFuture), Outcome> {
        let subject = SUBJECTS.of(&self.cfg.subject, event)?;
        let sent = conn
            .js
            .send_publish(subject.clone(), self.message(event))
            .await;
        match sent {
            Ok(ack) => Ok((subject, ack)),
            Err(e) => {
                let reason = self.scrub(format!(
                    "publish to {subject:?} failed: {}",
                    error_chain(&e)
                ));
                Err(self
                    .classify_publish_error(&conn.js, &subject, &e, reason, streamless)
                    .await)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sinks::broker::testing::assert_names;

    #[test]
    fn subjects_are_checked() {
        assert_names(
            valid_subject,
            &["orders.created"],
            &["orders..created", "orders.*", "orders created", ""],
        );
    }
}
