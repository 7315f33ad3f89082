//! The `webhook` sink: one HTTP POST per event, signed per Standard Webhooks.
//!
//! Classification: 2xx delivered; 408, 425, 429 and 5xx, timeouts and connection errors retried
//! (honouring `Retry-After`); any other status rejected for good. Redirects are not followed: a
//! 3xx is reported with its `Location`, as a misconfigured URL.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use futures::StreamExt;
use reqwest::header::{HeaderMap, HeaderName, HeaderValue, CONTENT_TYPE, LOCATION, RETRY_AFTER};
use reqwest::StatusCode;

use serde::Deserialize;

use super::{Budget, Envelope, Latency, Outcome, Recorder, Sink, SinkKind};
use crate::config::{duration_str, Secret};
use crate::error::error_chain;
use crate::event::OutboxEvent;
use crate::retry::parse_retry_after;

/// How much of a failed response's body goes into `last_error`.
const BODY_EXCERPT_BYTES: usize = 256;

/// Registry entry: `type = "webhook"`.
pub const KIND: SinkKind = SinkKind {
    name: "webhook",
    build: |_, settings| {
        let cfg: WebhookConfig = crate::config::sink_settings(settings)?;
        Ok(Arc::new(WebhookSink::new(&cfg)?))
    },
};

/// What the webhook body holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum BodyMode {
    /// `{"id","type","timestamp","key","data"}`.
    #[default]
    Envelope,
    /// The raw payload.
    Payload,
}

/// Settings of `type = "webhook"`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WebhookConfig {
    /// Endpoint URL (http or https).
    pub url: String,
    /// Standard Webhooks signing secret (`whsec_` + base64); no signature when absent.
    pub secret: Option<Secret>,
    /// `envelope` (default) or `payload`.
    #[serde(default)]
    pub body: BodyMode,
    /// Per-request timeout.
    #[serde(default = "super::default_timeout", with = "duration_str")]
    pub timeout: Duration,
    /// Most requests in flight at once.
    #[serde(default = "default_concurrency")]
    pub concurrency: usize,
    /// Extra static headers sent with every request.
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
}

fn default_concurrency() -> usize {
    64
}

/// Posts events to one URL.
#[derive(Debug)]
pub struct WebhookSink {
    client: reqwest::Client,
    url: reqwest::Url,
    key: Option<Vec<u8>>,
    body: BodyMode,
    concurrency: usize,
    static_headers: HeaderMap,
    timeout: Duration,
    latency: Latency,
}

impl WebhookSink {
    /// Builds the sink; the HTTP client keeps connections alive across batches.
    pub fn new(cfg: &WebhookConfig) -> Result<Self, String> {
        let url =
            reqwest::Url::parse(&cfg.url).map_err(|e| format!("key `url`: not a URL: {e}"))?;
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
            .map(|s| crate::webhook::decode_secret(&s.0))
            .transpose()
            .map_err(|e| format!("key `secret`: {e}"))?;
        let mut static_headers = HeaderMap::new();
        for (k, v) in &cfg.headers {
            let name = HeaderName::try_from(k.as_str())
                .map_err(|e| format!("key `headers`: {k:?}: {e}"))?;
            let value = HeaderValue::try_from(v.as_str())
                .map_err(|e| format!("key `headers`: {k:?}: {e}"))?;
            static_headers.insert(name, value);
        }
        let client = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .timeout(cfg.timeout)
            .connect_timeout(cfg.timeout.min(Duration::from_secs(10)))
            .pool_max_idle_per_host(cfg.concurrency)
            .user_agent(concat!("pgoutbox/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| format!("cannot build the HTTP client: {e}"))?;
        Ok(Self {
            client,
            url,
            key,
            body: cfg.body,
            concurrency: cfg.concurrency,
            static_headers,
            timeout: cfg.timeout,
            latency: Latency::default(),
        })
    }

    fn body_of(&self, event: &OutboxEvent) -> Vec<u8> {
        match self.body {
            BodyMode::Payload => event.payload.get().as_bytes().to_vec(),
            // Strings and raw JSON always serialize.
            BodyMode::Envelope => serde_json::to_vec(&Envelope::of(event)).unwrap_or_default(),
        }
    }

    /// Posts one event; `timeout` bounds the request (the sink's own, or less near a deadline).
    async fn send(&self, event: &OutboxEvent, timeout: Duration) -> Outcome {
        let body = self.body_of(event);
        let id = event.id.to_string();
        let timestamp = chrono::Utc::now().timestamp();
        let mut headers = self.static_headers.clone();
        for (k, v) in &event.headers {
            // A header written by hand in SQL may not be valid HTTP; it is skipped, not fatal.
            if let (Ok(name), Ok(value)) = (
                HeaderName::try_from(k.as_str()),
                HeaderValue::try_from(v.as_str()),
            ) {
                headers.insert(name, value);
            }
        }
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        insert(&mut headers, "webhook-id", &id);
        insert(&mut headers, "webhook-timestamp", &timestamp.to_string());
        if let Some(key) = &self.key {
            insert(
                &mut headers,
                "webhook-signature",
                &crate::webhook::sign(key, &id, timestamp, &body),
            );
        }
        let response = self
            .client
            .post(self.url.clone())
            .timeout(timeout)
            .headers(headers)
            .body(body)
            .send()
            .await;
        match response {
            Ok(resp) => classify(resp).await,
            Err(e) if e.is_timeout() => {
                Outcome::retry(format!("request timed out: {}", error_chain(&e)))
            }
            Err(e) => Outcome::retry(format!("request failed: {}", error_chain(&e))),
        }
    }
}

fn insert(headers: &mut HeaderMap, name: &'static str, value: &str) {
    if let Ok(v) = HeaderValue::try_from(value) {
        headers.insert(HeaderName::from_static(name), v);
    }
}

async fn classify(mut resp: reqwest::Response) -> Outcome {
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
        .map(str::to_owned);
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
        reason.push_str(excerpt.trim());
    }
    if is_transient(status) {
        Outcome::Retry {
            reason,
            retry_after,
        }
    } else {
        Outcome::Rejected { reason }
    }
}

/// Statuses worth retrying: the receiver is busy, rate-limiting or broken for now.
fn is_transient(status: StatusCode) -> bool {
    matches!(status.as_u16(), 408 | 425 | 429) || status.is_server_error()
}

#[async_trait]
impl Sink for WebhookSink {
    async fn publish(&self, events: &[&OutboxEvent]) -> Vec<Outcome> {
        let sends: Vec<_> = events.iter().map(|e| self.send(e, self.timeout)).collect();
        futures::stream::iter(sends)
            .buffered(self.concurrency)
            .collect()
            .await
    }

    /// Up to `concurrency` requests at a time, each outcome recorded as it comes. A request is
    /// only started when it should end before the deadline (by the recent latency), so a slow
    /// receiver gets fewer events per batch rather than requests the relay stops waiting for.
    async fn publish_until(
        &self,
        events: &[&OutboxEvent],
        budget: &Budget,
        recorder: &Recorder<'_>,
    ) {
        futures::stream::iter(events.iter().enumerate())
            .take_while(|_| futures::future::ready(budget.may_start(self.latency.estimate())))
            .for_each_concurrent(self.concurrency, |(i, event)| async move {
                let started = std::time::Instant::now();
                let outcome = self.send(event, budget.request_limit(self.timeout)).await;
                self.latency.observe(started.elapsed());
                recorder.record(i, outcome);
            })
            .await;
    }

    async fn healthcheck(&self) -> std::result::Result<(), String> {
        // Any answer, even an error status, proves the endpoint is reachable.
        self.client
            .head(self.url.clone())
            .send()
            .await
            .map(|_| ())
            .map_err(|e| error_chain(&e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_are_classified() {
        for s in [408u16, 425, 429, 500, 502, 503, 504] {
            assert!(is_transient(StatusCode::from_u16(s).expect("valid")), "{s}");
        }
        for s in [301u16, 400, 401, 403, 404, 410, 413, 422] {
            assert!(
                !is_transient(StatusCode::from_u16(s).expect("valid")),
                "{s}"
            );
        }
    }
}
