//! A destination's `transform`: a CEL expression, compiled when the configuration loads, whose
//! value becomes the payload sent to that destination.
//!
//! It sees what a filter sees (`topic`, `key`, `headers`, `payload`) and may return a map or any
//! JSON value. Two functions are added to CEL's own, which builds maps but cannot change one:
//! `m.without("a", "b")`, the map `m` less those keys, and `m.with("k", v)`, `m` with key `k` set
//! to `v` (a rename is `m.without("old").with("new", m.old)`). An event on which the expression fails,
//! or whose value is no JSON (a function, a type), is not sent: the caller dead-letters it for
//! that destination with the error, so a payload is never sent half-built.

use std::fmt;
use std::sync::Arc;

use cel::extractors::{Arguments, This};
use cel::objects::{Key, Map};
use cel::{ExecutionError, FunctionContext, Value};
use serde_json::value::RawValue;

use super::event::OutboxEvent;
use super::filter::{compile_over_event, event_scope};

/// A compiled `transform`.
#[derive(Clone)]
pub struct Transform {
    source: String,
    program: Arc<cel::Program>,
}

impl Transform {
    /// Compiles `source`; the error is one sentence (a syntax error, or an unknown variable).
    pub fn compile(source: &str) -> Result<Self, String> {
        Ok(Self {
            source: source.to_owned(),
            program: Arc::new(compile_over_event(source, "transform")?),
        })
    }

    /// The context transforms evaluate in: CEL's functions, `without` and `with`. Built once per publish
    /// call (building one registers every function), shared by its events.
    pub fn root() -> cel::Context<'static> {
        let mut root = cel::Context::default();
        root.add_function("without", without);
        root.add_function("with", with);
        root
    }

    /// The payload `event` becomes, or why there is none (one sentence, for `last_error`).
    pub fn apply(
        &self,
        root: &cel::Context<'_>,
        event: &OutboxEvent,
    ) -> Result<Box<RawValue>, String> {
        let value = self
            .program
            .execute(&event_scope(root, event))
            .map_err(|e| format!("transform {:?} failed: {e}", self.source))?;
        let json = value
            .json()
            .map_err(|e| format!("transform {:?} gave no JSON value: {e}", self.source))?;
        // A serde_json value always serializes to valid JSON text.
        serde_json::value::to_raw_value(&json)
            .map_err(|e| format!("transform {:?} gave no JSON value: {e}", self.source))
    }

    /// The event as this destination is sent it: the same event with the transform's payload.
    pub fn event(
        &self,
        root: &cel::Context<'_>,
        event: &OutboxEvent,
    ) -> Result<OutboxEvent, String> {
        let payload = self.apply(root, event)?;
        Ok(OutboxEvent {
            payload,
            ..event.clone()
        })
    }
}

/// `m.without(k, ...)`: the map `m` without the keys given.
fn without(
    ftx: &FunctionContext,
    This(this): This<Value>,
    Arguments(keys): Arguments,
) -> Result<Value, ExecutionError> {
    let Value::Map(map) = this else {
        return Err(ftx.error("without() applies to a map"));
    };
    let mut kept = (*map.map).clone();
    for key in keys.iter() {
        kept.remove(&key_of(ftx, "without", key)?);
    }
    Ok(Value::Map(Map {
        map: Arc::new(kept),
    }))
}

/// `m.with(k, v)`: the map `m` with key `k` set to `v`.
fn with(
    ftx: &FunctionContext,
    This(this): This<Value>,
    key: Value,
    value: Value,
) -> Result<Value, ExecutionError> {
    let Value::Map(map) = this else {
        return Err(ftx.error("with() applies to a map"));
    };
    let mut map = (*map.map).clone();
    map.insert(key_of(ftx, "with", &key)?, value);
    Ok(Value::Map(Map { map: Arc::new(map) }))
}

/// A CEL value as a map key (strings, integers, booleans).
fn key_of(ftx: &FunctionContext, function: &str, value: &Value) -> Result<Key, ExecutionError> {
    Ok(match value {
        Value::String(s) => Key::String(s.clone()),
        Value::Int(i) => Key::Int(*i),
        Value::UInt(u) => Key::Uint(*u),
        Value::Bool(b) => Key::Bool(*b),
        other => return Err(ftx.error(format!("{function}() takes keys, not {other:?}"))),
    })
}

impl fmt::Debug for Transform {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Transform({:?})", self.source)
    }
}

impl PartialEq for Transform {
    fn eq(&self, other: &Self) -> bool {
        self.source == other.source
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::event::testing::event;
    use serde_json::json;

    fn order() -> OutboxEvent {
        let mut e = event("order.created", Some("o-42"), &[("X-Tenant", "acme")]);
        e.payload = RawValue::from_string(
            r#"{"id": 7, "total": 250, "currency": "EUR", "card": "4111", "items": [{"sku": "a", "qty": 2}, {"sku": "b", "qty": 1}]}"#.into(),
        )
        .expect("json");
        e
    }

    /// The forms the README documents: reshape, drop a field, rename, compute; each value is
    /// the payload the destination is sent.
    #[test]
    fn transforms_table() {
        let e = order();
        let cases: &[(&str, serde_json::Value)] = &[
            // Reshape: a new document from the event's parts.
            (
                "{'order': payload.id, 'type': topic, 'tenant': headers['x-tenant'], 'key': key}",
                json!({"order": 7, "type": "order.created", "tenant": "acme", "key": "o-42"}),
            ),
            // Drop a field.
            (
                "payload.without('card', 'items')",
                json!({"id": 7, "total": 250, "currency": "EUR"}),
            ),
            // Rename: add the new name, drop the old one.
            (
                "payload.without('total', 'card', 'items').with('amount', payload.total)",
                json!({"id": 7, "amount": 250, "currency": "EUR"}),
            ),
            (
                "{'amount': payload.total, 'currency': payload.currency}",
                json!({"amount": 250, "currency": "EUR"}),
            ),
            // Compute.
            (
                "{'skus': payload.items.map(i, i.sku), 'count': payload.items.map(i, i.qty).size(), 'big': payload.total > 100}",
                json!({"skus": ["a", "b"], "count": 2, "big": true}),
            ),
            ("payload.total * 2", json!(500)),
            ("topic + ':' + payload.currency", json!("order.created:EUR")),
            ("payload.items[0]", json!({"sku": "a", "qty": 2})),
            ("null", json!(null)),
        ];
        let root = Transform::root();
        for (source, expected) in cases {
            let t = Transform::compile(source).unwrap_or_else(|e| panic!("{source}: {e}"));
            match t.apply(&root, &e) {
                Ok(raw) => {
                    let got: serde_json::Value = serde_json::from_str(raw.get()).expect("json");
                    assert_eq!(&got, expected, "{source}");
                }
                Err(err) => panic!("{source}: {err}"),
            }
        }
    }

    /// A transform that fails on an event says why, naming the expression; it never yields a
    /// partial payload.
    #[test]
    fn a_failing_transform_is_an_error_with_its_reason() {
        let e = order();
        let root = Transform::root();
        for (source, says) in [
            ("payload.missing.deeper", "failed"),
            ("payload.total + 'x'", "failed"),
            ("payload.currency.without('a')", "applies to a map"),
            ("payload.with([1], 2)", "takes keys"),
            ("{'a': payload.nope}", "failed"),
        ] {
            let t = Transform::compile(source).unwrap_or_else(|e| panic!("{source}: {e}"));
            let err = t.apply(&root, &e).expect_err(source);
            assert!(
                err.contains(says) && err.contains(source),
                "{source}: {err}"
            );
        }
        for (bad, says) in [
            ("payload.total +", "not a valid CEL expression"),
            ("", "the transform is empty"),
            (
                "paylod.total",
                "a transform sees topic, key, headers, payload",
            ),
        ] {
            let e = Transform::compile(bad).expect_err(bad);
            assert!(e.contains(says), "{bad:?}: {e}");
        }
    }
}
