//! Reading what a sink sent as CloudEvents with the CloudEvents SDK: structured messages with its
//! JSON format, binary ones with its binding machinery ([`BinaryDeserializer`], as the SDK's own
//! protocol bindings do) over the attribute names each protocol's binding defines.

use cloudevents::event::SpecVersion;
use cloudevents::message::{
    BinaryDeserializer, BinarySerializer, Error, MessageAttributeValue, Result,
};
use cloudevents::{AttributesReader, Data, Event};

use super::sinks::{Committed, Got};

/// Extensions pgoutbox sets besides the spec's attributes (distributed tracing).
const EXTENSIONS: [&str; 2] = ["traceparent", "tracestate"];

/// A message received in binary mode: its headers (or properties, or fields) and body; the
/// attributes are the headers named `prefix` + attribute.
pub struct Binary<'a> {
    pub got: &'a Got,
    pub prefix: &'a str,
}

impl BinaryDeserializer for Binary<'_> {
    fn deserialize_binary<R: Sized, V: BinarySerializer<R>>(self, mut visitor: V) -> Result<R> {
        let header = |name: &str| self.got.headers.get(&format!("{}{name}", self.prefix));
        let version = header("specversion").ok_or(Error::WrongEncoding {})?;
        let version = SpecVersion::try_from(version.as_str())?;
        let names = version.attribute_names();
        visitor = visitor.set_spec_version(version)?;
        for name in names.iter().filter(|n| **n != "specversion") {
            if let Some(value) = header(name) {
                visitor =
                    visitor.set_attribute(name, MessageAttributeValue::String(value.clone()))?;
            }
        }
        for name in EXTENSIONS {
            if let Some(value) = header(name) {
                visitor =
                    visitor.set_extension(name, MessageAttributeValue::String(value.clone()))?;
            }
        }
        if let Some(content_type) = self.got.headers.get("content-type") {
            visitor = visitor.set_attribute(
                "datacontenttype",
                MessageAttributeValue::String(content_type.clone()),
            )?;
        }
        visitor.end_with_data(self.got.payload.clone())
    }
}

/// The events of messages received in structured mode (`prefix` `None`) or in binary mode with
/// attributes named `prefix` + attribute.
pub fn parse(got: &[Got], prefix: Option<&str>) -> Vec<Event> {
    got.iter()
        .map(|g| match prefix {
            None => structured(&g.payload),
            Some(prefix) => binary(g, prefix),
        })
        .collect()
}

/// The event of a binary-mode message whose attributes are named `prefix` + attribute.
pub fn binary(got: &Got, prefix: &str) -> Event {
    Binary { got, prefix }
        .into_event()
        .unwrap_or_else(|e| panic!("not a binary-mode CloudEvent ({e}): {got:?}"))
}

/// The event of a structured-mode body.
pub fn structured(body: &[u8]) -> Event {
    serde_json::from_slice(body).unwrap_or_else(|e| {
        panic!(
            "not a structured CloudEvent ({e}): {}",
            String::from_utf8_lossy(body)
        )
    })
}

/// The event's data as JSON.
pub fn data(event: &Event) -> serde_json::Value {
    match event.data() {
        Some(Data::Json(v)) => v.clone(),
        Some(Data::Binary(b)) => serde_json::from_slice(b).expect("json data"),
        Some(Data::String(s)) => serde_json::from_str(s).expect("json data"),
        None => panic!("no data: {event:?}"),
    }
}

/// Asserts `events` are the `expected` events of `topic` with attributes as pgoutbox documents
/// them: id the event id, source `source`, type the topic, subject the key, a time, the payload
/// as data.
pub fn assert_events(events: &[Event], expected: &[Committed], topic: &str, source: &str) {
    assert_eq!(events.len(), expected.len(), "{events:#?}");
    for c in expected {
        let e = events
            .iter()
            .find(|e| e.id() == c.id)
            .unwrap_or_else(|| panic!("no event {} among {events:#?}", c.id));
        assert_eq!(e.specversion(), SpecVersion::V10);
        assert_eq!(e.source().to_string(), source, "{e:?}");
        assert_eq!(e.ty(), topic, "{e:?}");
        assert_eq!(e.subject(), c.key.as_deref(), "{e:?}");
        assert!(e.time().is_some(), "{e:?}");
        let want: serde_json::Value = serde_json::from_str(&c.payload).expect("payload");
        assert_eq!(data(e), want, "{e:?}");
    }
}

/// The `cloudevents_source` the sink tests configure.
pub const SOURCE: &str = "/shop/orders";

/// Commits 6 events of `order.created` and delivers them through one `kind` destination with
/// `settings`, with `body = "cloudevents"`, then 6 more with `"cloudevents-binary"`; `receive` gets
/// each run's 6 messages, which the SDK must read as the events sent (binary attributes named
/// `prefix` + attribute, as the protocol's binding says).
pub async fn both_modes<F, Fut>(
    db: &super::TestDb,
    kind: &str,
    settings: &str,
    prefix: &str,
    mut receive: F,
) where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Vec<Got>>,
{
    for (body, mode) in [("cloudevents", None), ("cloudevents-binary", Some(prefix))] {
        // New events each time: a broker that deduplicates by id (JetStream) would drop the
        // same ones sent again.
        sqlx::query("DELETE FROM outbox")
            .execute(&db.pool)
            .await
            .expect("clear");
        super::sinks::commit_events(db, 6, "order.created").await;
        let expected = super::sinks::committed(db).await;
        let settings =
            format!("{settings}\nbody = \"{body}\"\ncloudevents_source = \"{SOURCE}\"\n");
        let (report, errors) = super::sinks::run_once(db, kind, &settings).await;
        assert_eq!(report.delivered, 6, "{body}: {report:?} {errors:?}");
        let got = receive().await;
        let events = parse(&got, mode);
        assert_events(&events, &expected, "order.created", SOURCE);
        if mode.is_none() {
            for e in &events {
                assert_eq!(e.datacontenttype(), Some("application/json"), "{e:?}");
            }
        }
    }
}
