//! OTLP export of the relay's own spans: one `claim` span per claimed batch, one `publish` span
//! per event and destination, one `settle` span per settled batch.
//!
//! A `publish` span's parent is the producer's span when the event carries a `traceparent`
//! (written at enqueue, see [`crate::trace`]), so one trace shows the producer's transaction, the
//! relay's publish and the consumer; its attributes say which event, topic and destination, and
//! how it ended (`delivered`, `retry`, `rejected`, `unfinished`). Spans leave through a batch
//! exporter over OTLP/HTTP (protobuf) on its own thread: a slow or absent collector never slows
//! a claim. Sampling follows the parent's sampled flag; spans without a parent follow
//! `OTEL_TRACES_SAMPLER` (always on by default).
//!
//! Export is on when `[observability.otlp] endpoint` is set, or when the standard
//! `OTEL_EXPORTER_OTLP_ENDPOINT` / `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` variable is
//! (`OTEL_EXPORTER_OTLP_HEADERS`, `OTEL_SERVICE_NAME` and `OTEL_SDK_DISABLED` are honoured too).
//! When off, the relay builds no span at all.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::SystemTime;

use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::{SpanKind, Status, TraceContextExt, Tracer};
use opentelemetry::{global, Context, KeyValue};
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::Resource;

use crate::config::OtlpConfig;
use crate::model::event::OutboxEvent;
use crate::model::outcome::Outcome;

/// Whether spans are exported (set once, by [`start`]): the hot path checks it before building
/// anything.
static ENABLED: AtomicBool = AtomicBool::new(false);

/// The instrumentation scope of every span.
const SCOPE: &str = "pgoutbox";

/// The running exporter; [`Exporter::shutdown`] sends what is still buffered.
pub struct Exporter {
    provider: SdkTracerProvider,
}

impl Exporter {
    /// Flushes the buffered spans and stops the export thread (blocks: call it off the runtime).
    pub fn shutdown(self) {
        ENABLED.store(false, Ordering::Relaxed);
        if let Err(e) = self.provider.shutdown() {
            tracing::warn!(error = %e, "OTLP: the last spans could not be sent");
        }
    }
}

/// Starts exporting if the configuration or the environment asks for it (`env` looks up
/// variables); `None` when export is off.
pub fn start(
    cfg: &OtlpConfig,
    env: impl Fn(&str) -> Option<String>,
) -> Result<Option<Exporter>, String> {
    let set = |name: &str| env(name).is_some_and(|v| !v.trim().is_empty());
    if env("OTEL_SDK_DISABLED").is_some_and(|v| v.trim().eq_ignore_ascii_case("true")) {
        return Ok(None);
    }
    if cfg.endpoint.is_none()
        && !set("OTEL_EXPORTER_OTLP_ENDPOINT")
        && !set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    {
        return Ok(None);
    }
    let mut builder = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(opentelemetry_otlp::Protocol::HttpBinary);
    if let Some(endpoint) = &cfg.endpoint {
        let url = url::Url::parse(endpoint)
            .map_err(|e| format!("key `observability.otlp.endpoint`: not a URL: {e}"))?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err("key `observability.otlp.endpoint`: scheme must be http or https".into());
        }
        builder = builder.with_endpoint(format!("{}/v1/traces", endpoint.trim_end_matches('/')));
    }
    if !cfg.headers.is_empty() {
        builder = builder.with_headers(
            cfg.headers
                .iter()
                .map(|(k, v)| (k.clone(), v.expose().to_owned()))
                .collect::<HashMap<_, _>>(),
        );
    }
    let exporter = builder
        .build()
        .map_err(|e| format!("cannot set up the OTLP exporter: {e}"))?;
    let name = cfg
        .service_name
        .clone()
        .or_else(|| env("OTEL_SERVICE_NAME"))
        .unwrap_or_else(|| "pgoutbox".to_owned());
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(Resource::builder().with_service_name(name).build())
        .build();
    global::set_tracer_provider(provider.clone());
    ENABLED.store(true, Ordering::Relaxed);
    Ok(Some(Exporter { provider }))
}

/// Whether spans are being exported.
pub(crate) fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// A finished batch-level span (`claim`, `settle`) with its attributes (made only when spans
/// are exported).
pub(crate) fn batch_span(
    name: &'static str,
    start: SystemTime,
    attributes: impl FnOnce() -> Vec<KeyValue>,
) {
    if !enabled() {
        return;
    }
    let attributes = attributes();
    let tracer = global::tracer(SCOPE);
    let mut span = tracer
        .span_builder(name)
        .with_kind(SpanKind::Internal)
        .with_start_time(start)
        .with_attributes(attributes)
        .start(&tracer);
    opentelemetry::trace::Span::end(&mut span);
}

/// A finished `publish` span for `event` to `destination`, child of the producer's span when
/// the event carries a `traceparent`.
pub(crate) fn publish_span(
    event: &OutboxEvent,
    destination: &str,
    outcome: Option<&Outcome>,
    start: SystemTime,
) {
    if !enabled() {
        return;
    }
    let parent = TraceContextPropagator::new().extract(&Headers(&event.headers));
    let (ended, error) = match outcome {
        Some(Outcome::Delivered) => ("delivered", None),
        Some(Outcome::Retry { reason, .. }) => ("retry", Some(reason.clone())),
        Some(Outcome::Rejected { reason }) => ("rejected", Some(reason.clone())),
        None => ("unfinished", None),
    };
    let tracer = global::tracer(SCOPE);
    let mut span = tracer
        .span_builder("publish")
        .with_kind(SpanKind::Producer)
        .with_start_time(start)
        .with_attributes([
            KeyValue::new("messaging.system", "pgoutbox"),
            KeyValue::new("messaging.operation.type", "send"),
            KeyValue::new("messaging.message.id", event.id.to_string()),
            KeyValue::new("pgoutbox.topic", event.topic.clone()),
            KeyValue::new("pgoutbox.destination", destination.to_owned()),
            KeyValue::new("pgoutbox.outcome", ended),
            KeyValue::new("pgoutbox.attempt", i64::from(event.attempts) + 1),
        ])
        .start_with_context(&tracer, &parent_or_root(parent));
    if let Some(error) = error {
        opentelemetry::trace::Span::set_status(&mut span, Status::error(error));
    }
    opentelemetry::trace::Span::end(&mut span);
}

/// The producer's context when it is a valid span context, else none (a root span).
fn parent_or_root(extracted: Context) -> Context {
    if extracted.span().span_context().is_valid() {
        extracted
    } else {
        Context::new()
    }
}

/// An event's headers as a propagator reads them.
struct Headers<'a>(&'a [(String, String)]);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(key))
            .map(|(_, v)| v.as_str())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.iter().map(|(k, _)| k.as_str()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn export_is_off_unless_asked_for() {
        let none = |_: &str| None;
        assert!(start(&OtlpConfig::default(), none).expect("ok").is_none());
        let disabled = |k: &str| match k {
            "OTEL_SDK_DISABLED" => Some("true".to_owned()),
            "OTEL_EXPORTER_OTLP_ENDPOINT" => Some("http://127.0.0.1:4318".to_owned()),
            _ => None,
        };
        assert!(start(&OtlpConfig::default(), disabled)
            .expect("ok")
            .is_none());
        let bad = OtlpConfig {
            endpoint: Some("collector:4318".into()),
            ..Default::default()
        };
        let e = start(&bad, none).err().expect("rejected");
        assert!(e.contains("observability.otlp.endpoint"), "{e}");
    }
}
