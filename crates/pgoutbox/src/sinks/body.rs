//! A destination's `body`: what a message's body holds, and the CloudEvents attributes that travel
//! beside it. Pure: each sink asks for its event's [`Message`] and puts the attributes where its
//! protocol's CloudEvents binding says ([`Binding`]).
//!
//! - `envelope`: pgoutbox's JSON envelope ([`super::Envelope`]);
//! - `payload`: the payload as written;
//! - `cloudevents`: structured mode, the whole CloudEvent as JSON (`application/cloudevents+json`);
//! - `cloudevents-binary`: binary mode, the payload as body (`application/json`) and the event's
//!   attributes as the protocol's headers or properties.
//!
//! Attributes: `specversion` 1.0, `id` the event id, `source` the destination's
//! `cloudevents_source`, `type` the topic, `subject` the key (when set), `time` `created_at`, and
//! `traceparent` / `tracestate` (the distributed tracing extension) when the event carries them.

use std::borrow::Cow;

use serde::ser::SerializeMap;
use serde::{Deserialize, Serialize, Serializer};
use serde_json::value::RawValue;

use super::Envelope;
use crate::model::event::OutboxEvent;

/// The `cloudevents_source` of a destination that sets none.
pub const DEFAULT_SOURCE: &str = "pgoutbox";

/// `body`: what a message's body holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum Body {
    /// pgoutbox's envelope `{"id","type","timestamp","key","data"}`.
    #[serde(rename = "envelope")]
    Envelope,
    /// The payload as written.
    #[serde(rename = "payload")]
    Payload,
    /// A CloudEvent in structured mode.
    #[serde(rename = "cloudevents")]
    CloudEvents,
    /// A CloudEvent in binary mode.
    #[serde(rename = "cloudevents-binary")]
    CloudEventsBinary,
}

impl Body {
    /// The default of the webhook and stdout sinks.
    pub fn envelope() -> Self {
        Body::Envelope
    }

    /// The default of broker sinks.
    pub fn payload() -> Self {
        Body::Payload
    }
}

/// Where a protocol's CloudEvents binding puts attributes in binary mode: the prefix of their
/// header (or property) names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Binding {
    /// HTTP and NATS headers: `ce-id`.
    Headers,
    /// Kafka headers (and Redis stream fields, which have no binding of their own): `ce_id`.
    Kafka,
    /// AMQP application properties (RabbitMQ headers): `cloudEvents_id`.
    Amqp,
    /// MQTT 5 user properties: the attribute's bare name, `id`.
    Mqtt,
}

impl Binding {
    fn prefix(self) -> &'static str {
        match self {
            Binding::Headers => "ce-",
            Binding::Kafka => "ce_",
            Binding::Amqp => "cloudEvents_",
            Binding::Mqtt => "",
        }
    }
}

/// A destination's `body` and CloudEvents `source`, checked when its sink is built.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shape {
    body: Body,
    source: String,
}

/// What one event's message is made of.
#[derive(Debug, PartialEq)]
pub struct Message<'a> {
    /// The body's bytes.
    pub body: Cow<'a, [u8]>,
    /// Its media type, for the protocol's content-type header or property.
    pub content_type: &'static str,
    /// CloudEvents attributes to send as headers or properties, names already prefixed (binary
    /// mode only; empty otherwise).
    pub attributes: Vec<(String, String)>,
}

/// The CloudEvents JSON format of one event (structured mode): its context attributes, the same
/// ones binary mode sends, then `datacontenttype` and the payload as `data`.
struct Structured<'a> {
    attributes: Vec<(&'static str, String)>,
    data: &'a RawValue,
}

impl Serialize for Structured<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(self.attributes.len() + 2))?;
        for (name, value) in &self.attributes {
            map.serialize_entry(name, value)?;
        }
        map.serialize_entry("datacontenttype", JSON)?;
        map.serialize_entry("data", self.data)?;
        map.end()
    }
}

/// The media type of a JSON body.
pub const JSON: &str = "application/json";
/// The media type of a structured CloudEvent.
pub const CLOUDEVENTS_JSON: &str = "application/cloudevents+json";

impl Shape {
    /// The shape of a destination with `body` and `cloudevents_source` (`None`: the default);
    /// the error is one sentence.
    pub fn new(body: Body, source: Option<String>) -> Result<Self, String> {
        let uses_source = matches!(body, Body::CloudEvents | Body::CloudEventsBinary);
        match source {
            Some(_) if !uses_source => Err(
                "cloudevents_source is only used with body = \"cloudevents\" or \"cloudevents-binary\""
                    .into(),
            ),
            Some(s) if s.trim().is_empty() => Err("cloudevents_source must not be empty".into()),
            source => Ok(Self {
                body,
                source: source.unwrap_or_else(|| DEFAULT_SOURCE.to_owned()),
            }),
        }
    }

    /// Whether a broker message states its content type: the raw payload goes as it always
    /// did, any other body says what it is.
    pub fn states_content_type(&self) -> bool {
        self.body != Body::Payload
    }

    /// The message of `event`, its attributes named as `binding` says.
    pub fn message<'a>(&self, event: &'a OutboxEvent, binding: Binding) -> Message<'a> {
        let payload = || Cow::Borrowed(event.payload.get().as_bytes());
        match self.body {
            Body::Payload => Message {
                body: payload(),
                content_type: JSON,
                attributes: Vec::new(),
            },
            // Strings and raw JSON always serialize.
            Body::Envelope => Message {
                body: Cow::Owned(serde_json::to_vec(&Envelope::of(event)).unwrap_or_default()),
                content_type: JSON,
                attributes: Vec::new(),
            },
            Body::CloudEvents => Message {
                body: Cow::Owned(
                    serde_json::to_vec(&Structured {
                        attributes: self.attributes(event),
                        data: &event.payload,
                    })
                    .unwrap_or_default(),
                ),
                content_type: CLOUDEVENTS_JSON,
                attributes: Vec::new(),
            },
            Body::CloudEventsBinary => Message {
                body: payload(),
                content_type: JSON,
                attributes: self
                    .attributes(event)
                    .into_iter()
                    .map(|(name, value)| (format!("{}{name}", binding.prefix()), value))
                    .collect(),
            },
        }
    }

    /// The context attributes of `event`, both modes' (`datacontenttype` aside: binary mode sends
    /// it as the protocol's content type).
    fn attributes(&self, event: &OutboxEvent) -> Vec<(&'static str, String)> {
        let mut attributes = vec![
            ("specversion", "1.0".to_owned()),
            ("id", event.id.to_string()),
            ("source", self.source.clone()),
            ("type", event.topic.clone()),
            ("time", time(event)),
        ];
        if let Some(key) = &event.key {
            attributes.push(("subject", key.clone()));
        }
        for name in ["traceparent", "tracestate"] {
            if let Some(value) = event.header(name) {
                attributes.push((name, value.to_owned()));
            }
        }
        attributes
    }
}

/// `created_at` as RFC 3339 (microseconds, `Z`).
fn time(event: &OutboxEvent) -> String {
    event
        .created_at
        .to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::event::testing::event;

    fn ordered() -> OutboxEvent {
        let mut e = event(
            "order.created",
            Some("o-42"),
            &[(
                "traceparent",
                "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            )],
        );
        e.payload = RawValue::from_string(r#"{"total":250}"#.into()).expect("json");
        e
    }

    #[test]
    fn structured_mode_is_the_cloudevents_json_format() {
        let e = ordered();
        let shape = Shape::new(Body::CloudEvents, Some("/shop/orders".into())).expect("valid");
        let m = shape.message(&e, Binding::Headers);
        assert_eq!(m.content_type, CLOUDEVENTS_JSON);
        assert!(m.attributes.is_empty());
        let json: serde_json::Value = serde_json::from_slice(&m.body).expect("json");
        assert_eq!(json["specversion"], "1.0");
        assert_eq!(json["id"], e.id.to_string());
        assert_eq!(json["source"], "/shop/orders");
        assert_eq!(json["type"], "order.created");
        assert_eq!(json["subject"], "o-42");
        assert_eq!(json["datacontenttype"], "application/json");
        assert_eq!(json["data"], serde_json::json!({"total": 250}));
        assert!(json["traceparent"]
            .as_str()
            .is_some_and(|t| t.starts_with("00-")));
        assert!(json.get("tracestate").is_none());
    }

    #[test]
    fn binary_mode_names_attributes_per_binding() {
        let mut e = ordered();
        e.key = None;
        let shape = Shape::new(Body::CloudEventsBinary, None).expect("valid");
        let cases = [
            (Binding::Headers, "ce-id"),
            (Binding::Kafka, "ce_id"),
            (Binding::Amqp, "cloudEvents_id"),
            (Binding::Mqtt, "id"),
        ];
        for (binding, id_name) in cases {
            let m = shape.message(&e, binding);
            assert_eq!(m.body.as_ref(), br#"{"total":250}"#);
            assert_eq!(m.content_type, JSON);
            let prefix = binding.prefix();
            let names: Vec<&str> = m.attributes.iter().map(|(n, _)| n.as_str()).collect();
            assert!(names.contains(&id_name), "{binding:?}: {names:?}");
            assert!(
                names.iter().all(|n| n.starts_with(prefix)),
                "{binding:?}: {names:?}"
            );
            let value = |name: &str| {
                m.attributes
                    .iter()
                    .find(|(n, _)| n == &format!("{prefix}{name}"))
                    .map(|(_, v)| v.clone())
            };
            assert_eq!(value("source").as_deref(), Some(DEFAULT_SOURCE));
            assert_eq!(value("type").as_deref(), Some("order.created"));
            assert_eq!(value("subject"), None, "a keyless event has no subject");
            assert!(value("traceparent").is_some());
        }
    }

    #[test]
    fn payload_and_envelope_modes_carry_no_attributes() {
        let e = ordered();
        let payload = Shape::new(Body::Payload, None).expect("valid");
        let m = payload.message(&e, Binding::Headers);
        assert!(
            matches!(m.body, Cow::Borrowed(_)),
            "the payload is not copied"
        );
        assert!(m.attributes.is_empty());
        let envelope = Shape::new(Body::Envelope, None).expect("valid");
        let json: serde_json::Value =
            serde_json::from_slice(&envelope.message(&e, Binding::Headers).body).expect("json");
        assert_eq!(json["key"], "o-42");
    }

    #[test]
    fn a_source_is_checked() {
        assert!(Shape::new(Body::Payload, Some("x".into()))
            .expect_err("unused")
            .contains("only used"));
        assert!(Shape::new(Body::CloudEvents, Some(" ".into()))
            .expect_err("empty")
            .contains("empty"));
    }
}
