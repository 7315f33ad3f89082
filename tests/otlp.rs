//! The relay's own spans over OTLP/HTTP, received by a collector the test starts: it decodes the
//! protobuf and checks the `claim`, `publish` (one per event and destination) and `settle`
//! spans, their attributes, and that a `publish` span is the child of the producer's span.

mod common;

use std::sync::{Arc, Mutex};

use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;

use common::*;

/// The producer's span, as the enqueue adapters write it.
const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const PRODUCER_SPAN: &str = "00f067aa0ba902b7";

/// An OTLP/HTTP collector on 127.0.0.1: every span it was sent, with its resource's
/// `service.name`.
async fn collector() -> (String, Arc<Mutex<Vec<(String, Span)>>>) {
    let spans: Arc<Mutex<Vec<(String, Span)>>> = Arc::default();
    let sink = spans.clone();
    let app = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |body: axum::body::Bytes| {
            let sink = sink.clone();
            async move {
                let request = ExportTraceServiceRequest::decode(body).expect("OTLP protobuf");
                let mut spans = sink.lock().expect("lock");
                for resource in request.resource_spans {
                    let service = resource
                        .resource
                        .iter()
                        .flat_map(|r| &r.attributes)
                        .find(|a| a.key == "service.name")
                        .and_then(|a| text(a.value.as_ref()?.value.as_ref()?))
                        .unwrap_or_default();
                    for scope in resource.scope_spans {
                        for span in scope.spans {
                            spans.push((service.clone(), span));
                        }
                    }
                }
                ""
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (url, spans)
}

fn text(value: &Value) -> Option<String> {
    match value {
        Value::StringValue(s) => Some(s.clone()),
        Value::IntValue(i) => Some(i.to_string()),
        _ => None,
    }
}

fn attribute(span: &Span, key: &str) -> Option<String> {
    span.attributes
        .iter()
        .find(|a| a.key == key)
        .and_then(|a| text(a.value.as_ref()?.value.as_ref()?))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_exports_claim_publish_and_settle_spans() {
    let db = TestDb::migrated().await;
    let (endpoint, spans) = collector().await;
    let up = Receiver::start().await;
    let down = Receiver::with(|_| Reply::status(503)).await;
    let traced: String = sqlx::query_scalar(
        "INSERT INTO outbox (topic, payload, headers) VALUES ('order.created', '{}', $1) RETURNING id::text",
    )
    .bind(serde_json::json!({ "traceparent": format!("00-{TRACE_ID}-{PRODUCER_SPAN}-01") }))
    .fetch_one(&db.pool)
    .await
    .expect("traced event");
    let plain = db.insert_plain(1, "order.created").await.remove(0);
    let dir = scratch();
    let config = write_config(
        dir.path(),
        &format!(
            "database_url = \"{}\"\n[observability.otlp]\nendpoint = \"{endpoint}\"\n\
             service_name = \"billing-relay\"\n\
             [[destinations]]\nname = \"up\"\ntype = \"webhook\"\nurl = \"{}\"\n\
             [[destinations]]\nname = \"down\"\ntype = \"webhook\"\nurl = \"{}\"\n",
            db.url, up.url, down.url
        ),
    );
    let (code, _, err) = run(&[
        "relay",
        "--once",
        "--config",
        config.to_str().expect("utf-8"),
    ]);
    assert_eq!(code, 3, "one destination failing: exit 3\n{err}");

    let spans = spans.lock().expect("lock").clone();
    for (service, span) in &spans {
        println!(
            "{service} {} trace {} parent {} {:?}",
            span.name,
            hex(&span.trace_id),
            hex(&span.parent_span_id),
            span.attributes
                .iter()
                .map(|a| format!(
                    "{}={:?}",
                    a.key,
                    a.value
                        .as_ref()
                        .and_then(|v| v.value.as_ref())
                        .and_then(text)
                ))
                .collect::<Vec<_>>()
        );
    }
    assert!(spans.iter().all(|(service, _)| service == "billing-relay"));
    let named = |name: &'static str| {
        spans
            .iter()
            .filter(move |(_, s)| s.name == name)
            .map(|(_, s)| s)
    };
    let claim = named("claim").next().expect("a claim span");
    assert_eq!(attribute(claim, "pgoutbox.events").as_deref(), Some("2"));
    let settle = named("settle").next().expect("a settle span");
    assert!(attribute(settle, "pgoutbox.delivered").is_some());

    let publishes: Vec<&Span> = named("publish").collect();
    assert_eq!(publishes.len(), 4, "one per event and destination");
    for span in &publishes {
        let id = attribute(span, "messaging.message.id").expect("event id");
        let destination = attribute(span, "pgoutbox.destination").expect("destination");
        let outcome = attribute(span, "pgoutbox.outcome").expect("outcome");
        assert_eq!(
            attribute(span, "pgoutbox.topic").as_deref(),
            Some("order.created")
        );
        assert_eq!(
            outcome,
            if destination == "up" {
                "delivered"
            } else {
                "retry"
            },
            "{destination}"
        );
        if id == traced {
            assert_eq!(hex(&span.trace_id), TRACE_ID, "the producer's trace");
            assert_eq!(
                hex(&span.parent_span_id),
                PRODUCER_SPAN,
                "child of the producer's span"
            );
        } else {
            assert_eq!(id, plain);
            assert!(
                span.parent_span_id.is_empty(),
                "no producer span: a root span"
            );
        }
    }
}
