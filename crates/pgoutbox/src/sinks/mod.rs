//! Sinks: the [`Sink`] trait and the registry of sinks, one file each; what a sink is handed
//! besides its events ([`Share`]: its events' slots, the budget) and the [`gate`] every request
//! of a destination passes (pause, circuit breaker, `concurrency`).
//!
//! A sink takes a batch and returns one [`Outcome`] per event, in order. Sinks only classify
//! failures (retriable or not, with the receiver's `Retry-After`); when to retry is the retry
//! policy's business ([`crate::model::retry`]). Adding a sink is one file plus one line in
//! [`registry`].

#[cfg(feature = "aws")]
pub mod aws;
pub mod body;
#[cfg(any(
    feature = "kafka",
    feature = "mqtt",
    feature = "nats",
    feature = "rabbitmq",
    feature = "redis"
))]
pub mod broker;
#[cfg(feature = "eventbridge")]
pub mod eventbridge;
pub mod gate;
pub mod hosts;
#[cfg(feature = "kafka")]
pub mod kafka;
#[cfg(feature = "kinesis")]
pub mod kinesis;
#[cfg(feature = "mqtt")]
pub mod mqtt;
#[cfg(feature = "nats")]
pub mod nats;
mod null;
#[cfg(feature = "rabbitmq")]
pub mod rabbitmq;
#[cfg(feature = "redis")]
pub mod redis;
mod reserved;
#[cfg(feature = "s3")]
pub mod s3;
mod share;
#[cfg(feature = "sns")]
pub mod sns;
#[cfg(feature = "sqs")]
pub mod sqs;
mod stdout;
pub mod tls;
mod webhook;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde::Serialize;
use serde_json::value::RawValue;

use crate::config::{Config, ConfigError, DestinationConfig};
use crate::model::event::OutboxEvent;
use crate::model::outcome::Outcome;

pub use null::NullSink;
pub use share::{Budget, Latency, Share, Slot};
pub use stdout::StdoutSink;
pub use webhook::WebhookSink;

/// A sink's `timeout` (per request, or per broker acknowledgement) when the destination sets none.
pub(crate) fn default_timeout() -> Duration {
    Duration::from_secs(10)
}

/// `Debug` for a sink: its type and the settings that tell its destinations apart, never a
/// secret nor a client: `name: path` of each, from `self`, or, for a value shown otherwise than
/// it is kept (a URL redacted), `|sink| { name: value }`, each value a reference made of `sink`.
macro_rules! sink_debug {
    ($sink:ident { $($name:ident: $($path:ident).+),+ $(,)? }) => {
        $crate::sinks::sink_debug!($sink |sink| { $($name: &sink.$($path).+),+ });
    };
    ($sink:ident |$binding:ident| { $($name:ident: $value:expr),+ $(,)? }) => {
        impl std::fmt::Debug for $sink {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                let $binding = self;
                f.debug_struct(stringify!($sink))
                    $(.field(stringify!($name), $value))+
                    .finish_non_exhaustive()
            }
        }
    };
}
pub(crate) use sink_debug;

/// Declares a sink type in its module, Vector-style: the registry entry `KIND` of `type = $kind`,
/// whose build reads the destination's settings as `$config` and makes the sink with `$sink::new`
/// (through `broker::build` or `aws::build`, as the keys its kind shares say), and `$config`
/// itself: the keys only this type takes (`$own`, declared with `own_settings!`) beside those it
/// shares with the sinks of its kind (`$common`), read as one table ([`crate::config::Flat`]).
/// Doc lines before `$kind` are added to `$config`'s.
// A build without the sinks that use it leaves it unused.
#[allow(unused_macros)]
macro_rules! sink_type {
    (
        $(#[$doc:meta])*
        $kind:literal: $sink:ident, $config:ident = $own:ident + $common:ident
    ) => {
        #[doc = concat!("Registry entry: `type = \"", $kind, "\"`.")]
        pub const KIND: $crate::sinks::SinkKind = $crate::sinks::SinkKind {
            name: $kind,
            build: $crate::sinks::sink_type!(@build $common, $sink),
        };

        #[doc = concat!(
            "Settings of `type = \"", $kind, "\"`: [`", stringify!($own),
            "`] and the shared [`", stringify!($common), "`]."
        )]
        $(#[$doc])*
        pub type $config = $crate::config::Flat<$own, $common>;
    };
    (@build BrokerSettings, $sink:ident) => {
        |name, settings| $crate::sinks::broker::build(name, settings, $sink::new)
    };
    (@build AwsSettings, $sink:ident) => {
        |_, settings| $crate::sinks::aws::build(settings, $sink::new)
    };
}
#[allow(unused_imports)]
pub(crate) use sink_type;

/// Declares the struct of the keys only one sink type takes, the first part of its settings
/// ([`crate::config::Flat`]): read with serde and, as every table of the configuration, refusing
/// a key it does not name (`deny_unknown_fields`).
// A build without the sinks that use it leaves it unused.
#[allow(unused_macros)]
macro_rules! own_settings {
    ($(#[$doc:meta])* pub struct $own:ident { $($fields:tt)* }) => {
        $(#[$doc])*
        #[derive(Debug, Clone, ::serde::Deserialize)]
        #[serde(deny_unknown_fields)]
        pub struct $own {
            $($fields)*
        }
    };
}
#[allow(unused_imports)]
pub(crate) use own_settings;

/// A destination events are published to.
#[async_trait]
pub trait Sink: Send + Sync {
    /// Publishes a batch; returns exactly one outcome per event, in the same order. Must not
    /// report `Delivered` before the destination has durably accepted the event.
    async fn publish(&self, events: &[&OutboxEvent]) -> Vec<Outcome>;

    /// Publishes the events of `share`, recording each event's outcome in it as soon as it is
    /// known. Every request starts through [`Share::admit`] (which holds it to the destination's
    /// `concurrency`, its breaker and the budget); events it did not admit are left without an
    /// outcome, and the engine hands them on (no attempt counted). Sinks that send a request per
    /// event override this to admit and record them one by one; the default admits the whole
    /// call once, publishes it and records its outcomes at the end.
    async fn publish_until(&self, events: &[&OutboxEvent], share: &Share<'_>) {
        let Some(_permit) = share.admit_all().await else {
            return;
        };
        let outcomes = self.publish(events).await;
        if outcomes.len() == events.len() {
            for (i, outcome) in outcomes.into_iter().enumerate() {
                share.record(i, outcome);
            }
        } else {
            let reason = format!(
                "sink returned {} outcomes for {} events",
                outcomes.len(),
                events.len()
            );
            for i in 0..events.len() {
                share.record(i, Outcome::retry(reason.clone()));
            }
        }
    }

    /// A cheap check that the destination is reachable (start-up, readiness).
    async fn healthcheck(&self) -> std::result::Result<(), String> {
        Ok(())
    }

    /// Most requests in flight at once for this destination, across the whole process (`None`:
    /// the sink has no such limit; a broker client pipelines a batch itself).
    fn concurrency(&self) -> Option<usize> {
        None
    }

    /// Drops any connection the sink keeps, so that its next publish connects afresh. Called
    /// before each probe of an open breaker: a client that hands back its last failed reconnect
    /// would otherwise fail the probe of a destination that is back.
    fn reconnect(&self) {}
}

/// A sink type: its `type` name in the configuration and how to build it from its settings.
///
/// `build` validates the settings and must not do I/O (connections are made on first publish), so
/// the configuration loader can call it to report a bad key before the relay starts.
#[derive(Clone, Copy)]
pub struct SinkKind {
    /// The `type` value in the configuration.
    pub name: &'static str,
    /// Builds the sink for destination `name` from its settings; errors are one sentence.
    pub build: BuildSink,
}

/// Builds a sink for destination `name` from its settings; the error is one sentence.
pub type BuildSink =
    fn(name: &str, settings: &toml::Table) -> std::result::Result<Arc<dyn Sink>, String>;

/// Every sink type this build has. Adding a sink: one file in this folder and one line here.
pub fn registry() -> Vec<SinkKind> {
    vec![
        webhook::KIND,
        stdout::KIND,
        null::KIND,
        #[cfg(feature = "nats")]
        nats::KIND,
        #[cfg(feature = "rabbitmq")]
        rabbitmq::KIND,
        #[cfg(feature = "kafka")]
        kafka::KIND,
        #[cfg(feature = "redis")]
        redis::KIND,
        #[cfg(feature = "mqtt")]
        mqtt::KIND,
        #[cfg(feature = "sqs")]
        sqs::KIND,
        #[cfg(feature = "sns")]
        sns::KIND,
        #[cfg(feature = "kinesis")]
        kinesis::KIND,
        #[cfg(feature = "eventbridge")]
        eventbridge::KIND,
        #[cfg(feature = "s3")]
        s3::KIND,
    ]
}

/// Builds every configured destination's sink, once each, checking its type and settings; the
/// error names the destination's place in the file (`destinations[1] ("billing")`). No I/O:
/// connections are made on first publish.
pub fn build_all(config: &Config) -> std::result::Result<Vec<Arc<dyn Sink>>, ConfigError> {
    config
        .destinations
        .iter()
        .enumerate()
        .map(|(i, dest)| build(dest).map_err(|e| placed(i, dest, e)))
        .collect()
}

/// Builds one destination's sink, checking its type (the error's key: `type`) and its settings
/// (no key: the message names the setting). No I/O. Runtime definitions are checked by it too.
pub fn build(dest: &DestinationConfig) -> std::result::Result<Arc<dyn Sink>, ConfigError> {
    let kinds = registry();
    let Some(kind) = kinds.iter().find(|k| k.name == dest.sink.kind) else {
        let known: Vec<&str> = kinds.iter().map(|k| k.name).collect();
        return Err(ConfigError::at(
            "type",
            format!(
                "unknown destination type {:?}; known types: {}",
                dest.sink.kind,
                known.join(", ")
            ),
        ));
    };
    install_crypto_provider();
    (kind.build)(&dest.name, &dest.sink.settings.to_table()).map_err(|m| ConfigError {
        file: None,
        key: None,
        message: m,
    })
}

/// Checks every configured destination's type and settings, as [`build_all`] does, building
/// one sink at a time and dropping it; returns what the relay must know of each before it builds
/// it again for work: its `concurrency` ([`Sink::concurrency`]).
pub fn concurrencies(config: &Config) -> std::result::Result<Vec<Option<usize>>, ConfigError> {
    concurrencies_known(config, |_| None)
}

/// [`concurrencies`], taking those `known` gives (a destination a relay already runs, checked
/// then) instead of building their sinks again.
pub fn concurrencies_known(
    config: &Config,
    known: impl Fn(&Arc<DestinationConfig>) -> Option<Option<usize>>,
) -> std::result::Result<Vec<Option<usize>>, ConfigError> {
    config
        .destinations
        .iter()
        .enumerate()
        .map(|(i, dest)| match known(dest) {
            Some(concurrency) => Ok(concurrency),
            None => build(dest)
                .map(|sink| sink.concurrency())
                .map_err(|e| placed(i, dest, e)),
        })
        .collect()
}

/// Checks every configured destination's type and settings, as [`build_all`] does.
pub fn check(config: &Config) -> std::result::Result<(), ConfigError> {
    concurrencies(config).map(drop)
}

/// `e`, an error of the `i`-th destination `dest`, named by its place in the file.
fn placed(i: usize, dest: &DestinationConfig, e: ConfigError) -> ConfigError {
    match e.key.as_deref() {
        Some("type") => ConfigError::at(format!("destinations[{i}].type"), e.message),
        _ => ConfigError::at(format!("destinations[{i}] ({:?})", dest.name), e.message),
    }
}

use tls::install_crypto_provider;

/// The JSON envelope shared by the webhook and stdout sinks.
#[derive(Serialize)]
pub struct Envelope<'a> {
    /// Event id.
    pub id: String,
    /// Event type (the topic).
    #[serde(rename = "type")]
    pub kind: &'a str,
    /// When the event was written, RFC 3339.
    pub timestamp: String,
    /// Message key, omitted when absent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key: Option<&'a str>,
    /// The payload, verbatim.
    pub data: &'a RawValue,
}

impl<'a> Envelope<'a> {
    /// The envelope of one event.
    pub fn of(event: &'a OutboxEvent) -> Self {
        Self {
            id: event.id.to_string(),
            kind: &event.topic,
            timestamp: event
                .created_at
                .to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
            key: event.key.as_deref(),
            data: &event.payload,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn error_of(text: &str) -> String {
        let config = Config::parse(text, |_| None).expect("the common keys are fine");
        check(&config).expect_err("must be rejected").to_string()
    }

    #[test]
    fn a_destination_of_an_unknown_type_or_with_bad_settings_is_rejected_naming_it() {
        let e = error_of("[[destinations]]\nname = \"x\"\ntype = \"carrier-pigeon\"\n");
        assert!(
            e.contains("destinations[0].type")
                && e.contains("carrier-pigeon")
                && e.contains("webhook"),
            "{e}"
        );
        let e = error_of(
            "[[destinations]]\nname = \"x\"\ntype = \"webhook\"\nurl = \"http://a\"\nurll = 1\n",
        );
        assert!(e.contains("destinations[0]") && e.contains("urll"), "{e}");
        let e = error_of("[[destinations]]\nname = \"x\"\ntype = \"webhook\"\nurl = \"http://a\"\nsecret = \"whsec_n0t-base64!\"\n");
        assert!(e.contains("secret") && !e.contains("n0t-base64"), "{e}");
        let ok = Config::parse(
            "[[destinations]]\nname = \"x\"\ntype = \"webhook\"\nurl = \"http://a\"\n",
            |_| None,
        )
        .expect("valid");
        assert_eq!(build_all(&ok).expect("builds").len(), 1);
    }
}
