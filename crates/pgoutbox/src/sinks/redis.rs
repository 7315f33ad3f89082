//! The `redis` sink: `XADD`s each event to a Redis stream, the whole batch in one pipeline.
//!
//! Entry fields: `id` (event id), `topic`, `key` (only when the event has one), `payload` (the
//! JSON text, verbatim) and `headers` (a JSON object). With `maxlen`, each `XADD` trims the
//! stream with `MAXLEN ~ N`. Redis answers a pipeline in order, so each event gets its own
//! result; a write is acknowledged once Redis has applied it (durability is Redis's own
//! `appendfsync` setting). The connection is made on the first publish and re-made by the
//! connection manager after it breaks; while Redis is unreachable every event is a `Retry`. The
//! probe of an open breaker gets a new connection manager: the kept one answers the first command
//! after an outage with its last failed reconnect ("Connection refused") even when Redis is back.
//!
//! Classification: only `WRONGTYPE` (the stream name is a key of another type, so this event's
//! `XADD` cannot succeed) is rejected. Everything else is retried: I/O errors, timeouts, a refused
//! login or permission (`NOAUTH`, `WRONGPASS`, `NOPERM`: credentials and ACLs change), busy or
//! failing-over servers (`OOM`, `LOADING`, `BUSY`, `READONLY`, `TRYAGAIN`, `MASTERDOWN`,
//! `CLUSTERDOWN`, …) and any error code not known here. The URL's password never reaches a
//! message.

use std::time::Duration;

use async_trait::async_trait;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};

use super::body::{Binding, Shape};
use super::broker::{Broker, BrokerSettings, Connection, Kept, Reconnects};
use crate::config::Flat;
use crate::model::event::OutboxEvent;
use crate::model::outcome::Outcome;
use crate::model::secrets;
use crate::model::template::Template;

/// Server error codes that say this event's `XADD` cannot succeed, however often it is tried.
const PERMANENT_CODES: &[&str] = &["WRONGTYPE"];

super::sink_type!("redis": RedisSink, RedisConfig = RedisSettings + BrokerSettings);

super::own_settings! {
    /// The keys only `type = "redis"` takes.
    pub struct RedisSettings {
        /// Redis URL, e.g. `redis://127.0.0.1:6379/0`, `rediss://relay:password@redis:6380/0` for
        /// TLS with an ACL user.
        pub url: crate::config::Secret,
        /// Stream name template; default `{topic}`.
        #[serde(default = "Template::topic")]
        pub stream: Template,
        /// Trim each stream to about this many entries (`MAXLEN ~ N`); no trimming when absent.
        pub maxlen: Option<u64>,
    }
}

/// Appends events to Redis streams.
pub struct RedisSink {
    cfg: RedisSettings,
    shape: Shape,
    client: redis::Client,
    /// How a connection manager connects, waits and reconnects.
    manager: ConnectionManagerConfig,
    conn: Kept<ConnectionManager>,
    reconnects: Reconnects,
}

// Dropping the manager ends its tasks (a reconnect under way first finishes): nothing to wait for.
impl Connection for ConnectionManager {}

super::sink_debug!(RedisSink {
    stream: cfg.stream,
    maxlen: cfg.maxlen
});

impl RedisSink {
    /// Validates the settings of destination `destination`; connects on the first publish.
    pub fn new(destination: &str, Flat { own: cfg, common }: RedisConfig) -> Result<Self, String> {
        // `open` and `build_with_tls` only parse the URL and the certificates.
        let not_a_url = |e: redis::RedisError| {
            format!(
                "key `url`: not a Redis URL: {}",
                secrets::scrub(&e.to_string(), &cfg.url.0)
            )
        };
        let client = match common.tls.load_for(
            cfg.url.0.starts_with("rediss://"),
            "a URL that is not rediss://",
        )? {
            None => redis::Client::open(cfg.url.0.as_str()).map_err(not_a_url)?,
            Some(files) => {
                let certificates = redis::TlsCertificates {
                    client_tls: files.identity.map(|id| redis::ClientTlsConfig {
                        client_cert: id.cert_pem,
                        client_key: id.key_pem,
                    }),
                    root_cert: files.ca_pem,
                };
                redis::Client::build_with_tls(cfg.url.0.as_str(), certificates)
                    .map_err(not_a_url)?
            }
        };
        common.check_timeout()?;
        if cfg.maxlen == Some(0) {
            return Err("key `maxlen`: must be at least 1".into());
        }
        Ok(Self {
            shape: common.shape()?,
            cfg,
            client,
            manager: ConnectionManagerConfig::new()
                .set_connection_timeout(Some(common.timeout))
                .set_response_timeout(Some(common.timeout))
                // Reconnection happens in the background; the relay's retry policy decides
                // when the events are tried again, so no retries inside the client.
                .set_number_of_retries(1)
                .set_max_delay(Duration::from_secs(2)),
            conn: Kept::new(),
            reconnects: Reconnects::new(destination),
        })
    }

    fn xadd(&self, pipe: &mut redis::Pipeline, event: &OutboxEvent) {
        let headers: serde_json::Map<String, serde_json::Value> = event
            .headers
            .iter()
            .map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone())))
            .collect();
        let cmd = pipe.cmd("XADD").arg(self.cfg.stream.render(event));
        if let Some(n) = self.cfg.maxlen {
            cmd.arg("MAXLEN").arg("~").arg(n);
        }
        cmd.arg("*")
            .arg("id")
            .arg(event.id.to_string())
            .arg("topic")
            .arg(&event.topic);
        if let Some(key) = &event.key {
            cmd.arg("key").arg(key);
        }
        let message = self.shape.message(event, Binding::Kafka);
        cmd.arg("payload")
            .arg(&message.body[..])
            .arg("headers")
            .arg(serde_json::Value::Object(headers).to_string());
        if self.shape.states_content_type() {
            cmd.arg("content-type").arg(message.content_type);
        }
        for (name, value) in &message.attributes {
            cmd.arg(name).arg(value);
        }
    }
}

impl RedisSink {
    /// A client error as text, with the URL's secrets masked.
    fn error_text(&self, e: &redis::RedisError) -> String {
        secrets::scrub(&e.to_string(), &self.cfg.url.0)
    }

    fn classify(&self, e: &redis::RedisError) -> Outcome {
        if e.code().is_some_and(|c| PERMANENT_CODES.contains(&c)) {
            Outcome::Rejected {
                reason: format!("Redis refused the XADD: {}", self.error_text(e)),
            }
        } else {
            Outcome::retry(format!("Redis: {}", self.error_text(e)))
        }
    }
}

#[async_trait]
impl Broker for RedisSink {
    type Link = ConnectionManager;

    async fn send(&self, mut conn: Self::Link, events: &[&OutboxEvent]) -> Vec<Outcome> {
        let mut pipe = redis::pipe();
        pipe.ignore_errors();
        for event in events {
            self.xadd(&mut pipe, event);
        }
        match pipe
            .query_async::<Vec<redis::RedisResult<String>>>(&mut conn)
            .await
        {
            Ok(results) if results.len() == events.len() => results
                .iter()
                .map(|r| match r {
                    Ok(_) => Outcome::Delivered,
                    Err(e) => self.classify(e),
                })
                .collect(),
            Ok(results) => vec![
                Outcome::retry(format!(
                    "Redis answered {} replies to {} commands",
                    results.len(),
                    events.len()
                ));
                events.len()
            ],
            Err(e) => vec![self.classify(&e); events.len()],
        }
    }

    async fn connect(&self) -> Result<Self::Link, String> {
        let manager = ConnectionManager::new_with_config(self.client.clone(), self.manager.clone())
            .await
            .map_err(|e| format!("cannot connect to Redis: {}", self.error_text(&e)))?;
        self.reconnects.connected();
        Ok(manager)
    }

    fn kept(&self) -> &Kept<Self::Link> {
        &self.conn
    }

    async fn ready(&self) -> Result<(), String> {
        let mut conn = self.link().await?;
        redis::cmd("PING")
            .query_async::<String>(&mut conn)
            .await
            .map(|_| ())
            .map_err(|e| format!("Redis is not reachable: {}", self.error_text(&e)))
    }
}
