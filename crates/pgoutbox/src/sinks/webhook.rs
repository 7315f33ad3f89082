//! The `webhook` sink: one HTTP POST per event, signed per Standard Webhooks.
//!
//! Classification: 2xx delivered; a status listed in `permanent_statuses` (by default the ones a
//! retry cannot fix: 400, 410, 413, 422) rejected for good; every other status, timeouts and
//! connection errors retried (honouring `Retry-After`). A 401, 403 or 404 is retried: credentials
//! get rotated and routes move, and one such spell must not dead-letter every event. Redirects are
//! not followed: a 3xx is retried with its `Location` in the reason, as a misconfigured URL.
//!
//! Headers: the destination's static `headers` win over the event's headers, and an event header
//! can never set a header the sink writes itself (`content-type`, `webhook-id`, …) or one the
//! destination configures; such a header is dropped with a warning. The URL reaches messages only
//! redacted (no password, no query values).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use futures::StreamExt;
use reqwest::header::{HeaderMap, HeaderName, HeaderValue, CONTENT_TYPE, LOCATION, RETRY_AFTER};
use reqwest::StatusCode;

use serde::Deserialize;

use super::body::{Binding, Body, Shape};
use super::reserved::Reserved;
use super::tls::TlsConfig;
use super::{Latency, Share, Sink, SinkKind};
use crate::config::{duration_str, Secret};
use crate::error::error_chain;
use crate::model::event::OutboxEvent;
use crate::model::outcome::Outcome;
use crate::model::retry::parse_retry_after;
use crate::model::secrets::{redact_url, scrub};

/// How much of a failed response's body goes into `last_error`.
const BODY_EXCERPT_BYTES: usize = 256;

/// Statuses that dead-letter an event when the destination does not set `permanent_statuses`:
/// the request itself is wrong (400, 422), too large (413) or the resource is gone for good (410).
const DEFAULT_PERMANENT_STATUSES: [u16; 4] = [400, 410, 413, 422];

/// Headers the sink writes itself, or that frame the request: no event header may set them.
const PROTOCOL_HEADERS: &[&str] = &[
    "content-type",
    "content-length",
    "content-encoding",
    "host",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "te",
    "trailer",
    "upgrade",
    "expect",
    "proxy-authorization",
    "proxy-connection",
    "webhook-id",
    "webhook-timestamp",
    "webhook-signature",
];

/// Registry entry: `type = "webhook"`.
pub const KIND: SinkKind = SinkKind {
    name: "webhook",
    build: |_, settings| {
        let cfg: WebhookConfig = crate::config::sink_settings(settings)?;
        Ok(Arc::new(WebhookSink::new(&cfg)?))
    },
};

/// Settings of `type = "webhook"`.
///
/// Its `Debug` shows the URL redacted and no secret, header value or signing key.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WebhookConfig {
    /// Endpoint URL (http or https). Credentials and query values in it are never shown in
    /// messages (`last_error`, logs, `/readyz`). Like every secret, it may be read from
    /// `{ env = "NAME" }` or `{ file = "PATH" }`.
    pub url: Secret,
    /// Standard Webhooks signing secret (`whsec_` + base64); no signature when absent.
    pub secret: Option<Secret>,
    /// `envelope` (default), `payload`, `cloudevents` or `cloudevents-binary` (`ce-*` headers).
    #[serde(default = "Body::envelope")]
    pub body: Body,
    /// The CloudEvents `source` attribute (with a `cloudevents` body); default `pgoutbox`.
    pub cloudevents_source: Option<String>,
    /// Per-request timeout.
    #[serde(default = "super::default_timeout", with = "duration_str")]
    pub timeout: Duration,
    /// Most requests in flight at once.
    #[serde(default = "default_concurrency")]
    pub concurrency: usize,
    /// Extra static headers sent with every request (e.g. `Authorization`). They win over the
    /// event's headers: an event header with the same name is dropped. They cannot set the
    /// headers the sink writes itself (`content-type`, `webhook-id`, `webhook-signature`, …).
    /// Values are secrets: a value may be `{ env = "NAME" }` or `{ file = "PATH" }`.
    #[serde(default)]
    pub headers: BTreeMap<String, Secret>,
    /// HTTP statuses that dead-letter the event at once (each 100 to 599, not 2xx); default
    /// `[400, 410, 413, 422]`, the ones a retry cannot fix. Every other non-2xx status is retried
    /// per `retry_schedule` (honouring `Retry-After`).
    #[serde(default = "default_permanent_statuses")]
    pub permanent_statuses: Vec<u16>,
    /// Whom to trust and who we are over `https://`: a CA bundle, a client certificate (mTLS).
    #[serde(default)]
    pub tls: TlsConfig,
}

impl std::fmt::Debug for WebhookConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WebhookConfig")
            .field("url", &redact_url(self.url.expose()))
            .field("secret", &self.secret)
            .field("body", &self.body)
            .field("cloudevents_source", &self.cloudevents_source)
            .field("timeout", &self.timeout)
            .field("concurrency", &self.concurrency)
            .field("headers", &self.headers.keys().collect::<Vec<_>>())
            .field("permanent_statuses", &self.permanent_statuses)
            .field("tls", &self.tls)
            .finish()
    }
}

fn default_concurrency() -> usize {
    64
}

fn default_permanent_statuses() -> Vec<u16> {
    DEFAULT_PERMANENT_STATUSES.to_vec()
}

/// What one request came to: an answer (a response, or a refused or broken connection), or none
/// before its timeout (the destination stays silent to the gate).
enum Reply {
    Answered(Outcome),
    TimedOut(Outcome),
}

impl Reply {
    fn outcome(self) -> Outcome {
        match self {
            Self::Answered(outcome) | Self::TimedOut(outcome) => outcome,
        }
    }
}

/// Posts events to one URL.
pub struct WebhookSink {
    client: reqwest::Client,
    url: reqwest::Url,
    /// The places of the URL's host, shared with every destination of that host.
    host: super::hosts::Room,
    key: Option<Vec<u8>>,
    shape: Shape,
    concurrency: usize,
    static_headers: HeaderMap,
    /// Header names no event may set: the protocol's and the configured ones.
    reserved: Reserved,
    /// Statuses that reject the event for good, sorted.
    permanent_statuses: Vec<u16>,
    /// The per-request timeout (less near a batch's deadline).
    timeout: Duration,
    /// Recent request latency: requests that cannot end before the deadline are not started.
    latency: Latency,
}

// The URL may hold a token, the headers credentials, the key signs: none of them is shown.
super::sink_debug!(WebhookSink |sink| {
    url: &redact_url(sink.url.as_str()),
    shape: &sink.shape,
    concurrency: &sink.concurrency,
    permanent_statuses: &sink.permanent_statuses,
});

/// An HTTP client's settings for destinations of `timeout`: no redirects followed, the timeout
/// as each request's default (a request sets its own) and, capped at 10 s, the connect timeout.
/// Idle connections are kept per host without a cap (they close after 90 s unused): how many
/// requests are in flight is each destination's `concurrency`, held by its gate.
fn client(timeout: Duration) -> reqwest::ClientBuilder {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .timeout(timeout)
        .connect_timeout(timeout.min(Duration::from_secs(10)))
        .user_agent(concat!("pgoutbox/", env!("CARGO_PKG_VERSION")))
}

/// The client shared by every webhook destination of `timeout` with no TLS files of its own:
/// destinations on one host share its connections, and thousands of destinations cost a few
/// clients (each with its parsed root certificates), not one each.
fn shared_client(timeout: Duration) -> Result<reqwest::Client, String> {
    type Clients = Mutex<HashMap<Duration, reqwest::Client>>;
    static CLIENTS: OnceLock<Clients> = OnceLock::new();
    let mut clients = CLIENTS
        .get_or_init(Clients::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    if let Some(shared) = clients.get(&timeout) {
        return Ok(shared.clone());
    }
    let made = client(timeout)
        .build()
        .map_err(|e| format!("cannot build the HTTP client: {e}"))?;
    clients.insert(timeout, made.clone());
    Ok(made)
}

impl WebhookSink {
    /// Builds the sink; its HTTP client keeps connections alive across batches, shared with the
    /// other destinations of the same settings ([`shared_client`]).
    pub fn new(cfg: &WebhookConfig) -> Result<Self, String> {
        // The parser's error never quotes the URL.
        let url = reqwest::Url::parse(cfg.url.expose())
            .map_err(|e| format!("key `url`: not a URL: {e}"))?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(format!(
                "key `url`: scheme must be http or https, not {:?}",
                url.scheme()
            ));
        }
        if cfg.concurrency == 0 {
            return Err("key `concurrency`: must be at least 1".into());
        }
        if cfg.timeout.is_zero() {
            return Err("key `timeout`: must be more than zero".into());
        }
        let key = cfg
            .secret
            .as_ref()
            .map(|s| crate::webhook::decode_secret(s.expose()))
            .transpose()
            .map_err(|e| format!("key `secret`: {e}"))?;
        let mut static_headers = HeaderMap::new();
        for (k, v) in &cfg.headers {
            let name = HeaderName::try_from(k.as_str())
                .map_err(|e| format!("key `headers`: {k:?}: {e}"))?;
            if PROTOCOL_HEADERS.contains(&name.as_str()) {
                return Err(format!(
                    "key `headers`: {k:?} is set by pgoutbox and cannot be configured"
                ));
            }
            // The value may be a credential: the error does not quote it.
            let value = HeaderValue::try_from(v.expose())
                .map_err(|e| format!("key `headers`: the value of {k:?}: {e}"))?;
            static_headers.insert(name, value);
        }
        let mut permanent_statuses = cfg.permanent_statuses.clone();
        for &status in &permanent_statuses {
            if !(100..=599).contains(&status) {
                return Err(format!(
                    "key `permanent_statuses`: {status} is not an HTTP status (100 to 599)"
                ));
            }
            if (200..=299).contains(&status) {
                return Err(format!(
                    "key `permanent_statuses`: {status} is a success, not a failure"
                ));
            }
        }
        permanent_statuses.sort_unstable();
        permanent_statuses.dedup();
        let reserved = Reserved::new("webhook", PROTOCOL_HEADERS, &[])
            .and_configured(static_headers.keys().map(HeaderName::as_str));
        let tls = cfg
            .tls
            .load_for(url.scheme() == "https", "a URL that is not https://")?;
        let client = match tls {
            // A destination with TLS files of its own has a client of its own.
            Some(files) => client(cfg.timeout)
                .use_preconfigured_tls(files.client_config()?)
                .build()
                .map_err(|e| format!("cannot build the HTTP client: {e}"))?,
            None => shared_client(cfg.timeout)?,
        };
        Ok(Self {
            client,
            host: super::hosts::room(&url),
            url,
            key,
            shape: Shape::new(cfg.body, cfg.cloudevents_source.clone())?,
            concurrency: cfg.concurrency,
            static_headers,
            reserved,
            permanent_statuses,
            timeout: cfg.timeout,
            latency: Latency::default(),
        })
    }

    /// Posts one event; `timeout` bounds the request (the sink's own, or less near a deadline).
    async fn send(&self, event: &OutboxEvent, timeout: Duration) -> Reply {
        let message = self.shape.message(event, Binding::Headers);
        let id = event.id.to_string();
        let timestamp = chrono::Utc::now().timestamp();
        let mut headers = HeaderMap::new();
        for (k, v) in &event.headers {
            // A header written by hand in SQL may not be valid HTTP; it is skipped, not fatal.
            if let (Ok(name), Ok(value)) = (
                HeaderName::try_from(k.as_str()),
                HeaderValue::try_from(v.as_str()),
            ) {
                if self.reserved.permits(name.as_str()) {
                    headers.insert(name, value);
                }
            }
        }
        // The destination's headers, then the sink's own, win over anything the event carried.
        for (name, value) in &self.static_headers {
            headers.insert(name.clone(), value.clone());
        }
        // CloudEvents attributes (binary mode) are the sink's own: they win over event headers.
        for (name, value) in &message.attributes {
            if let (Ok(name), Ok(value)) = (
                HeaderName::try_from(name.as_str()),
                HeaderValue::try_from(value.as_str()),
            ) {
                headers.insert(name, value);
            }
        }
        headers.insert(CONTENT_TYPE, HeaderValue::from_static(message.content_type));
        insert(&mut headers, "webhook-id", &id);
        insert(&mut headers, "webhook-timestamp", &timestamp.to_string());
        if let Some(key) = &self.key {
            insert(
                &mut headers,
                "webhook-signature",
                &crate::webhook::sign(key, &id, timestamp, &message.body),
            );
        }
        let response = self
            .client
            .post(self.url.clone())
            .timeout(timeout)
            .headers(headers)
            .body(message.body.into_owned())
            .send()
            .await;
        match response {
            Ok(resp) => Reply::Answered(self.classify(resp).await),
            Err(e) if e.is_timeout() => Reply::TimedOut(Outcome::retry(format!(
                "request timed out: {}",
                self.error_text(e)
            ))),
            Err(e) => Reply::Answered(Outcome::retry(format!(
                "request failed: {}",
                self.error_text(e)
            ))),
        }
    }

    /// A client error as one line, without the URL (reqwest's `Display` quotes it, query and
    /// all), and scrubbed of the URL's secrets should a cause quote them.
    fn error_text(&self, e: reqwest::Error) -> String {
        scrub(&error_chain(&e.without_url()), self.url.as_str())
    }

    /// The outcome of one response: delivered, rejected (a permanent status) or retried.
    async fn classify(&self, mut resp: reqwest::Response) -> Outcome {
        let status = resp.status();
        if status.is_success() {
            return Outcome::Delivered;
        }
        let retry_after = resp
            .headers()
            .get(RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| parse_retry_after(v, SystemTime::now()));
        let location = resp
            .headers()
            .get(LOCATION)
            .and_then(|v| v.to_str().ok())
            .map(redact_url);
        let mut excerpt = Vec::new();
        while excerpt.len() < BODY_EXCERPT_BYTES {
            match resp.chunk().await {
                Ok(Some(chunk)) => excerpt.extend_from_slice(&chunk),
                _ => break,
            }
        }
        excerpt.truncate(BODY_EXCERPT_BYTES);
        let excerpt = String::from_utf8_lossy(&excerpt);
        let mut reason = format!("HTTP {status}");
        if let Some(location) = location.filter(|_| status.is_redirection()) {
            reason.push_str(&format!(" (redirect to {location} not followed)"));
        }
        if !excerpt.trim().is_empty() {
            reason.push_str(": ");
            // A receiver may echo the request line back.
            reason.push_str(&scrub(excerpt.trim(), self.url.as_str()));
        }
        if self.is_permanent(status) {
            Outcome::Rejected { reason }
        } else {
            Outcome::Retry {
                reason,
                retry_after,
            }
        }
    }

    /// Whether `status` rejects the event for good (it is in `permanent_statuses`).
    fn is_permanent(&self, status: StatusCode) -> bool {
        self.permanent_statuses
            .binary_search(&status.as_u16())
            .is_ok()
    }
}

fn insert(headers: &mut HeaderMap, name: &'static str, value: &str) {
    if let Ok(v) = HeaderValue::try_from(value) {
        headers.insert(HeaderName::from_static(name), v);
    }
}

#[async_trait]
impl Sink for WebhookSink {
    async fn publish(&self, events: &[&OutboxEvent]) -> Vec<Outcome> {
        let sends: Vec<_> = events
            .iter()
            .map(|e| async { self.send(e, self.timeout).await.outcome() })
            .collect();
        futures::stream::iter(sends)
            .buffered(self.concurrency)
            .collect()
            .await
    }

    /// One request per event, each given a place among its host's ([`super::hosts`]), then
    /// admitted by the share (the destination's `concurrency` for the whole process, its breaker,
    /// the budget) and recorded as it ends. A request is only admitted when it should end before
    /// the deadline (by the recent latency), so a slow receiver gets fewer events per batch rather
    /// than requests the relay stops waiting for.
    async fn publish_until(&self, events: &[&OutboxEvent], share: &Share<'_>) {
        let mut running = futures::stream::FuturesUnordered::new();
        for (i, &event) in events.iter().enumerate() {
            // Wait for the next place and admission while the requests already out go on. The
            // place comes first: an event counts as started only once admitted, so a wait for
            // the host is never the destination's failure.
            let admitted = {
                let admit = async {
                    let place = Arc::clone(&self.host).acquire_owned();
                    let place = tokio::time::timeout_at(share.deadline(), place)
                        .await
                        .ok()?
                        .ok()?;
                    let permit = share.admit(i, self.latency.estimate()).await?;
                    Some((place, permit))
                };
                tokio::pin!(admit);
                loop {
                    tokio::select! {
                        admitted = &mut admit => break admitted,
                        Some(()) = running.next() => {}
                    }
                }
            };
            let Some((place, permit)) = admitted else {
                break;
            };
            running.push(async move {
                let started = std::time::Instant::now();
                let reply = self.send(event, share.request_limit(self.timeout)).await;
                self.latency.observe(started.elapsed());
                match reply {
                    Reply::Answered(outcome) => share.record(i, outcome),
                    Reply::TimedOut(outcome) => share.record_timeout(i, outcome),
                }
                // The answer is counted before the request's places are given back.
                drop(permit);
                drop(place);
            });
        }
        while running.next().await.is_some() {}
    }

    fn concurrency(&self) -> Option<usize> {
        Some(self.concurrency)
    }

    async fn healthcheck(&self) -> std::result::Result<(), String> {
        // Any answer, even an error status, proves the endpoint is reachable.
        self.client
            .head(self.url.clone())
            .send()
            .await
            .map(|_| ())
            .map_err(|e| self.error_text(e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sink(settings: &str) -> Result<WebhookSink, String> {
        let table: toml::Table = format!("url = \"http://127.0.0.1:9/events\"\n{settings}")
            .parse()
            .expect("toml");
        WebhookSink::new(&crate::config::sink_settings(&table)?)
    }

    fn permanent(sink: &WebhookSink, status: u16) -> bool {
        sink.is_permanent(StatusCode::from_u16(status).expect("valid"))
    }

    #[test]
    fn only_statuses_a_retry_cannot_fix_are_permanent_by_default() {
        let sink = sink("").expect("valid");
        for s in [400u16, 410, 413, 422] {
            assert!(permanent(&sink, s), "{s}");
        }
        for s in [
            301u16, 302, 307, 308, 401, 403, 404, 405, 408, 409, 425, 429, 500, 502, 503, 504,
        ] {
            assert!(!permanent(&sink, s), "{s}");
        }
    }

    #[test]
    fn permanent_statuses_are_configurable_and_checked() {
        let sink = sink("permanent_statuses = [404, 400, 404]").expect("valid");
        assert!(permanent(&sink, 404) && permanent(&sink, 400));
        assert!(!permanent(&sink, 410) && !permanent(&sink, 422));
        assert!(!permanent(
            &self::sink("permanent_statuses = []").expect("valid"),
            400
        ));
        for (bad, want) in [
            ("[99]", "99 is not an HTTP status"),
            ("[600]", "600 is not an HTTP status"),
            ("[204]", "204 is a success"),
        ] {
            let err = self::sink(&format!("permanent_statuses = {bad}")).expect_err(bad);
            assert!(
                err.contains("key `permanent_statuses`") && err.contains(want),
                "{err}"
            );
        }
    }

    #[test]
    fn configured_headers_cannot_replace_the_sinks_own() {
        let err = sink("headers = { \"Webhook-Signature\" = \"v1,x\" }").expect_err("reserved");
        assert!(err.contains("set by pgoutbox"), "{err}");
        let sink = sink("headers = { \"Authorization\" = \"Bearer t0ken\" }").expect("valid");
        assert!(!sink.reserved.permits("authorization"));
        assert!(!sink.reserved.permits("Webhook-Id"));
        assert!(sink.reserved.permits("x-tenant"));
        assert!(!format!("{sink:?}").contains("t0ken"));
    }

    #[test]
    fn debug_shows_no_secret() {
        let table: toml::Table = "url = \"https://u:pw-s3cret@example.com/h?token=tok-s3cret\"\n\
                                  secret = \"whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD\"\n\
                                  headers = { authorization = \"Bearer hdr-s3cret\" }"
            .parse()
            .expect("toml");
        let cfg: WebhookConfig = crate::config::sink_settings(&table).expect("valid");
        let sink = WebhookSink::new(&cfg).expect("valid");
        for shown in [format!("{cfg:?}"), format!("{sink:?}")] {
            for secret in ["s3cret", "C2FVsBQ"] {
                assert!(!shown.contains(secret), "{shown}");
            }
        }
    }
}
