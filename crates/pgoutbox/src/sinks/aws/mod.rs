//! What the AWS sinks (`sqs`, `sns`, `kinesis`, `eventbridge`, `s3`) share: the settings every one
//! of them takes ([`AwsSettings`]), the SDK configuration made from them, how an AWS error is
//! classified, how a batch is cut into the calls a batch API takes, and the one sink `sqs` and
//! `sns` both are (`Messages`, over either SDK).
//!
//! Credentials come from the SDK's standard provider chain (environment, shared profile, web
//! identity / IRSA, ECS and instance metadata), never from the relay's file. `region` falls back
//! to the chain's (`AWS_REGION`, the profile); `endpoint_url` points a sink at a local emulator or
//! a VPC endpoint. TLS goes through rustls on ring like every other sink: `tls.ca_file` replaces the
//! system's roots (a client certificate means nothing to AWS and is refused). The SDK's own retries
//! are off: when an event is tried again is the relay's retry policy's business.
//!
//! Classification ([`verdict`]): throttling codes are retried with the answer's `Retry-After`
//! when it has one; codes that say this event can never be accepted (too large, malformed) are
//! rejected; everything else — network failures, timeouts, 5xx, missing queues, refused or expired
//! credentials (credentials and policies change) and any code not known here — is retried.

// Each sink uses its own part of what is shared: a build with only some of them leaves the rest.
#![cfg_attr(
    not(all(
        feature = "sqs",
        feature = "sns",
        feature = "kinesis",
        feature = "eventbridge",
        feature = "s3"
    )),
    allow(dead_code, unused_imports, unused_macros)
)]

mod answers;
mod calls;
#[cfg(any(feature = "sqs", feature = "sns"))]
mod messages;
pub(crate) mod names;
mod settings;

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use aws_config::{BehaviorVersion, Region, SdkConfig};
use aws_smithy_http_client::tls;
use aws_smithy_runtime_api::client::orchestrator::HttpResponse;
use aws_smithy_runtime_api::client::result::SdkError;
use aws_smithy_types::error::metadata::ProvideErrorMetadata;
use aws_smithy_types::retry::RetryConfig;
use aws_smithy_types::timeout::TimeoutConfig;
use serde::de::DeserializeOwned;
use tokio::sync::OnceCell;

pub(crate) use answers::{call_failed, entry_outcomes, in_order, positional};
pub(crate) use calls::{by_target, group, publish_each, Calls, Limits};
#[cfg(any(feature = "sqs", feature = "sns"))]
pub(crate) use messages::message_sink;
#[cfg(any(feature = "sqs", feature = "sns"))]
pub use messages::{MessageApi, Messages};
pub use settings::AwsSettings;

use super::body::{Binding, Body, Shape};
use super::reserved::Reserved;
use super::tls::TlsConfig;
use super::{Share, Sink};
use crate::model::event::OutboxEvent;
use crate::model::outcome::Outcome;
use crate::model::template::Template;

/// Where an AWS sink records its events' outcomes (by position) as soon as each call is answered.
pub(crate) trait Recorder: Sync {
    /// The outcomes of the events one call carried: their destination answered once.
    fn call(&self, outcomes: Vec<(usize, Outcome)>);

    /// The outcome of an event that was not sent (an earlier event of its key failed): no answer.
    fn unsent(&self, i: usize, outcome: Outcome);
}

/// Where a sink records outcomes ([`Recorder`]).
pub(crate) type Record<'a> = &'a dyn Recorder;

impl Recorder for Share<'_> {
    fn call(&self, outcomes: Vec<(usize, Outcome)>) {
        self.record_call(outcomes);
    }

    fn unsent(&self, i: usize, outcome: Outcome) {
        self.record_unsent(i, outcome);
    }
}

/// Outcomes kept by position, for a publish with no share (and tests).
pub(crate) struct Collected(Mutex<Vec<Option<Outcome>>>);

impl Collected {
    /// Room for `n` events' outcomes.
    pub(crate) fn new(n: usize) -> Self {
        Self(Mutex::new(vec![None; n]))
    }

    fn set(&self, i: usize, outcome: Outcome) {
        if let Some(slot) = self
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get_mut(i)
        {
            *slot = Some(outcome);
        }
    }

    /// Each event's outcome, `None` where none was recorded.
    pub(crate) fn into_outcomes(self) -> Vec<Option<Outcome>> {
        self.0.into_inner().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Recorder for Collected {
    fn call(&self, outcomes: Vec<(usize, Outcome)>) {
        for (i, outcome) in outcomes {
            self.set(i, outcome);
        }
    }

    fn unsent(&self, i: usize, outcome: Outcome) {
        self.set(i, outcome);
    }
}

/// What an AWS sink does: send a batch, recording each event's outcome as its call is answered,
/// and check readiness. [`Batched`] makes one a [`Sink`].
#[async_trait]
pub(crate) trait Batches: Send + Sync + 'static {
    /// Sends `events`, recording each call's outcomes in `record` as soon as it is answered.
    async fn send_all(&self, events: &[&OutboxEvent], record: Record<'_>);

    /// A cheap check that the destination is reachable.
    async fn ready(&self) -> Result<(), String>;
}

/// An AWS sink as the engine sees it: outcomes recorded call by call, so a publish cut short by
/// `publish_timeout` keeps what was answered.
pub(crate) struct Batched<S>(pub S);

#[async_trait]
impl<S: Batches> Sink for Batched<S> {
    async fn publish(&self, events: &[&OutboxEvent]) -> Vec<Outcome> {
        let collected = Collected::new(events.len());
        self.0.send_all(events, &collected).await;
        collected
            .into_outcomes()
            .into_iter()
            .map(|o| o.unwrap_or_else(|| Outcome::retry("not sent")))
            .collect()
    }

    async fn publish_until(&self, events: &[&OutboxEvent], share: &Share<'_>) {
        let Some(_permit) = share.admit_all().await else {
            return;
        };
        self.0.send_all(events, share).await;
    }

    async fn healthcheck(&self) -> Result<(), String> {
        self.0.ready().await
    }
}

/// An AWS sink's registry entry: the sink `new` makes of the destination's settings.
pub(crate) fn build<C: DeserializeOwned, S: Batches>(
    settings: &toml::Table,
    new: fn(C) -> Result<S, String>,
) -> Result<Arc<dyn Sink>, String> {
    let cfg = crate::config::sink_settings(settings)?;
    Ok(Arc::new(Batched(new(cfg)?)))
}

/// The `body` of a sink of `service` that sends no CloudEvents binary mode (SQS and SNS take
/// ten attributes a message and have no binding; streams and archives have no attributes).
pub(crate) fn shape(body: Body, source: Option<String>, service: &str) -> Result<Shape, String> {
    if body == Body::CloudEventsBinary {
        return Err(format!(
            "key `body`: {service} has no CloudEvents binary mode; use \"cloudevents\" (structured)"
        ));
    }
    Shape::new(body, source)
}

/// The readiness of the destination `name` names (`what`: `queue`, `stream`, …), asked by
/// `check`, which gives the outcome its failure comes to. A template's names are known only per
/// event: not checked.
pub(crate) async fn ready_as<'n, Fut>(
    name: &'n Template,
    what: &str,
    check: impl FnOnce(&'n str) -> Fut,
) -> Result<(), String>
where
    Fut: std::future::Future<Output = Result<(), Outcome>>,
{
    if !name.is_constant() {
        return Ok(());
    }
    let name = name.as_str();
    check(name)
        .await
        .map_err(|outcome| unreachable(&format!("{what} {name}"), outcome))
}

/// A readiness failure of `what` (`queue …`), from the outcome its check came to.
pub(crate) fn unreachable(what: &str, outcome: Outcome) -> String {
    match outcome {
        Outcome::Retry { reason, .. } | Outcome::Rejected { reason } => {
            format!("{what} is not reachable: {reason}")
        }
        Outcome::Delivered => format!("{what} is not reachable"),
    }
}

/// Whether a queue URL or topic ARN names a FIFO queue or topic.
pub(crate) fn fifo(name: &str) -> bool {
    name.ends_with(".fifo")
}

/// One event as an SQS or SNS message (both take the same body and attributes).
pub struct Message {
    /// The body: the destination's `body` of the event.
    pub body: String,
    /// The message attributes ([`attributes`]), all of data type `String`.
    pub attributes: Vec<(String, String)>,
    /// Its size against a batch call's limit: the body and every attribute's name, type and value.
    pub size: usize,
}

/// The message `event` makes with `shape`, its headers checked against `reserved`.
pub(crate) fn message(shape: &Shape, event: &OutboxEvent, reserved: &Reserved) -> Message {
    let message = shape.message(event, Binding::Kafka);
    let content_type = shape.states_content_type().then_some(message.content_type);
    let body = String::from_utf8_lossy(&message.body).into_owned();
    let attributes = attributes(event, content_type, reserved);
    let size = body.len()
        + attributes
            .iter()
            .map(|(name, value)| name.len() + value.len() + "String".len())
            .sum::<usize>();
    Message {
        body,
        attributes,
        size,
    }
}

/// Most message attributes SQS and SNS take on one message.
const MAX_ATTRIBUTES: usize = 10;

/// The attribute that carries an event's headers as one JSON object when they do not fit one
/// attribute each.
pub(crate) const HEADERS_ATTRIBUTE: &str = "pgoutbox-headers";

/// Header names SQS and SNS keep for themselves, and the ones the sink sets.
pub(crate) fn reserved(sink: &'static str) -> Reserved {
    Reserved::new(sink, &[], &["pgoutbox-", "aws.", "amazon."])
}

/// Whether SQS and SNS take `name` as a message attribute's name.
fn attribute_name(name: &str) -> bool {
    name.len() <= 256
        && !name.starts_with('.')
        && !name.ends_with('.')
        && !name.contains("..")
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// The message attributes (SQS, SNS) of `event`: `pgoutbox-id`, `pgoutbox-topic`, `pgoutbox-key`
/// (when it has one), `content-type` (when the body states it) and its headers one attribute each
/// — or, when they would not fit the ten a message takes, or one has a name an attribute cannot
/// have or an empty value, all of them as one JSON object in `pgoutbox-headers`.
fn attributes(
    event: &OutboxEvent,
    content_type: Option<&str>,
    reserved: &Reserved,
) -> Vec<(String, String)> {
    let mut out = vec![
        ("pgoutbox-id".to_owned(), event.id.to_string()),
        ("pgoutbox-topic".to_owned(), event.topic.clone()),
    ];
    if let Some(key) = event.key.as_ref().filter(|k| !k.is_empty()) {
        out.push(("pgoutbox-key".to_owned(), key.clone()));
    }
    if let Some(content_type) = content_type {
        out.push(("content-type".to_owned(), content_type.to_owned()));
    }
    let headers: Vec<&(String, String)> = event
        .headers
        .iter()
        .filter(|(name, _)| !name.eq_ignore_ascii_case("content-type") && reserved.permits(name))
        .collect();
    let each = out.len() + headers.len() <= MAX_ATTRIBUTES
        && headers
            .iter()
            .all(|(name, value)| attribute_name(name) && !value.is_empty());
    if each {
        out.extend(headers.into_iter().cloned());
    } else {
        let object: serde_json::Map<String, serde_json::Value> = headers
            .into_iter()
            .map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone())))
            .collect();
        out.push((
            HEADERS_ATTRIBUTE.to_owned(),
            serde_json::Value::Object(object).to_string(),
        ));
    }
    out
}

/// An AWS sink's SDK client, made from its [`Account`] on first use: building a sink does no I/O.
pub struct Connection<C> {
    /// The service, in messages: `Kinesis`.
    service: &'static str,
    account: Account,
    make: Box<dyn Fn(&SdkConfig) -> C + Send + Sync>,
    client: OnceCell<C>,
}

impl<C> std::fmt::Debug for Connection<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("account", &self.account)
            .finish_non_exhaustive()
    }
}

impl<C> Connection<C> {
    /// The client of `service` that `make` builds from `account`'s SDK configuration.
    pub fn new(
        service: &'static str,
        account: Account,
        make: impl Fn(&SdkConfig) -> C + Send + Sync + 'static,
    ) -> Self {
        Self {
            service,
            account,
            make: Box::new(make),
            client: OnceCell::new(),
        }
    }

    /// The client, made on the first call.
    pub async fn get(&self) -> &C {
        self.client
            .get_or_init(|| async { (self.make)(self.account.sdk().await) })
            .await
    }

    /// The readiness of the destination `name` names (`what`: `stream`, `event bus`), asked by
    /// `check` of the client in one call. A template's names are known only per event: not
    /// checked.
    pub(crate) async fn ready<'a, 'n, T, E, Fut>(
        &'a self,
        name: &'n Template,
        what: &str,
        check: impl FnOnce(&'a C, &'n str) -> Fut,
    ) -> Result<(), String>
    where
        Fut: std::future::Future<Output = Result<T, SdkError<E, HttpResponse>>>,
        E: ProvideErrorMetadata + std::error::Error + 'static,
    {
        ready_as(name, what, |name| async move {
            check(self.get().await, name)
                .await
                .map(drop)
                .map_err(|e| call_failed(self.service, &e))
        })
        .await
    }
}

/// The account settings of an AWS sink, checked when it is built.
#[derive(Debug)]
pub struct Account {
    region: Option<String>,
    endpoint_url: Option<String>,
    timeout: Duration,
    ca_pem: Option<Vec<u8>>,
    sdk: OnceCell<SdkConfig>,
}

impl Account {
    /// Checks the settings (no I/O but reading `tls.ca_file`); the error names the key.
    pub fn new(
        region: Option<String>,
        endpoint_url: Option<String>,
        timeout: Duration,
        tls: &TlsConfig,
    ) -> Result<Self, String> {
        if let Some(region) = &region {
            names::region(region)?;
        }
        if let Some(url) = &endpoint_url {
            let parsed =
                url::Url::parse(url).map_err(|e| format!("key `endpoint_url`: not a URL: {e}"))?;
            if !matches!(parsed.scheme(), "http" | "https") {
                return Err("key `endpoint_url`: must be an http:// or https:// URL".into());
            }
        }
        if timeout.is_zero() {
            return Err("key `timeout`: must be more than zero".into());
        }
        if tls.cert_file.is_some() || tls.key_file.is_some() {
            return Err(
                "key `tls`: AWS takes no client certificate; only `ca_file` may be set".into(),
            );
        }
        let ca_pem = tls.load()?.and_then(|files| files.ca_pem);
        Ok(Self {
            region,
            endpoint_url,
            timeout,
            ca_pem,
            sdk: OnceCell::new(),
        })
    }

    /// The SDK configuration, made on first use (the credential chain is asked lazily, per
    /// request, and refreshes itself).
    pub async fn sdk(&self) -> &SdkConfig {
        self.sdk.get_or_init(|| self.load()).await
    }

    async fn load(&self) -> SdkConfig {
        let trust = match &self.ca_pem {
            Some(pem) => tls::TrustStore::empty()
                .with_native_roots(false)
                .with_pem_certificate(pem.clone()),
            None => tls::TrustStore::default(),
        };
        // The CA was parsed when the settings were checked; a context that still fails to build
        // falls back to the system's roots, and the handshake then says what is wrong.
        let context = tls::TlsContext::builder()
            .with_trust_store(trust)
            .build()
            .unwrap_or_default();
        let http = aws_smithy_http_client::Builder::new()
            .tls_provider(tls::Provider::Rustls(
                tls::rustls_provider::CryptoMode::Ring,
            ))
            .tls_context(context)
            .build_https();
        let mut loader = aws_config::defaults(BehaviorVersion::latest())
            .http_client(http)
            .retry_config(RetryConfig::disabled())
            .timeout_config(
                TimeoutConfig::builder()
                    .connect_timeout(self.timeout)
                    .operation_timeout(self.timeout)
                    .build(),
            );
        if let Some(region) = &self.region {
            loader = loader.region(Region::new(region.clone()));
        }
        if let Some(url) = &self.endpoint_url {
            loader = loader.endpoint_url(url.clone());
        }
        loader.load().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_are_attributes_while_they_fit() {
        use crate::model::event::testing::event;
        let reserved = reserved("sqs");
        let names = |attrs: Vec<(String, String)>| -> Vec<String> {
            attrs.into_iter().map(|(n, _)| n).collect()
        };
        let few = event(
            "t",
            Some("k"),
            &[("x-tenant", "acme"), ("pgoutbox-id", "forged")],
        );
        assert_eq!(
            names(attributes(&few, None, &reserved)),
            ["pgoutbox-id", "pgoutbox-topic", "pgoutbox-key", "x-tenant"]
        );
        let forged = attributes(&few, None, &reserved);
        assert_eq!(forged[0].1, few.id.to_string(), "the id is the event's");

        let many: Vec<(String, String)> = (0..8).map(|i| (format!("h{i}"), "v".into())).collect();
        let many: Vec<(&str, &str)> = many.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
        let crowded = event("t", Some("k"), &many);
        let attrs = attributes(&crowded, Some("application/json"), &reserved);
        assert_eq!(
            names(attrs.clone()),
            [
                "pgoutbox-id",
                "pgoutbox-topic",
                "pgoutbox-key",
                "content-type",
                HEADERS_ATTRIBUTE
            ]
        );
        let object: serde_json::Value = serde_json::from_str(&attrs[4].1).expect("json");
        assert_eq!(object["h7"], "v");

        for odd in [("bad name", "v"), ("x", ""), (".x", "v")] {
            let e = event("t", None, &[odd]);
            assert_eq!(
                names(attributes(&e, None, &reserved)),
                ["pgoutbox-id", "pgoutbox-topic", HEADERS_ATTRIBUTE],
                "{odd:?}"
            );
        }
    }
    #[test]
    fn settings_are_checked() {
        let tls = TlsConfig::default();
        let ok = Account::new(
            Some("eu-west-1".into()),
            Some("http://127.0.0.1:5055".into()),
            Duration::from_secs(1),
            &tls,
        );
        assert!(ok.is_ok());
        for (region, url, says) in [
            (Some(" "), None, "region"),
            (None, Some("not a url"), "endpoint_url"),
            (None, Some("ftp://x"), "endpoint_url"),
        ] {
            let err = Account::new(
                region.map(String::from),
                url.map(String::from),
                Duration::from_secs(1),
                &tls,
            )
            .expect_err("refused");
            assert!(err.contains(says), "{err}");
        }
        let client = TlsConfig {
            cert_file: Some("c.pem".into()),
            key_file: Some("k.pem".into()),
            ..TlsConfig::default()
        };
        let err = Account::new(None, None, Duration::from_secs(1), &client).expect_err("refused");
        assert!(err.contains("client certificate"), "{err}");
    }
}
