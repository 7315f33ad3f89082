//! A destination's `filter`: a CEL expression over an event, compiled when the configuration
//! loads and evaluated when an event is routed.

use std::fmt;
use std::sync::Arc;

use super::event::OutboxEvent;

/// The variables a filter sees: `topic`, `key` (null when absent), `headers` (names lowercased)
/// and `payload` (the JSON document).
pub fn event_scope<'a>(root: &'a cel::Context<'a>, event: &OutboxEvent) -> cel::Context<'a> {
    let mut scope = root.new_inner_scope();
    let headers: std::collections::HashMap<String, String> = event
        .headers
        .iter()
        .map(|(k, v)| (k.to_ascii_lowercase(), v.clone()))
        .collect();
    let payload: serde_json::Value =
        serde_json::from_str(event.payload.get()).unwrap_or(serde_json::Value::Null);
    // Serializing plain strings, maps and JSON into CEL values cannot fail; a failure would only
    // leave the variable unset, and the filter then evaluates to false.
    let _ = scope.add_variable("topic", event.topic.as_str());
    let _ = scope.add_variable("key", event.key.as_deref());
    let _ = scope.add_variable("headers", headers);
    scope.add_variable_from_value("payload", cel_value(payload));
    scope
}

/// A JSON value as CEL sees it. Integers are CEL `int`s (those above `i64::MAX` stay `uint`), as
/// a JSON reader expects: serde would make every non-negative one a `uint`, and CEL has no mixed
/// arithmetic, so `payload.total * 2` would fail.
fn cel_value(json: serde_json::Value) -> cel::Value {
    use serde_json::Value as J;
    match json {
        J::Null => cel::Value::Null,
        J::Bool(b) => cel::Value::Bool(b),
        J::Number(n) => match (n.as_i64(), n.as_u64()) {
            (Some(i), _) => cel::Value::Int(i),
            (None, Some(u)) => cel::Value::UInt(u),
            _ => cel::Value::Float(n.as_f64().unwrap_or(f64::NAN)),
        },
        J::String(s) => cel::Value::String(Arc::new(s)),
        J::Array(items) => cel::Value::List(Arc::new(items.into_iter().map(cel_value).collect())),
        J::Object(map) => cel::Value::Map(cel::objects::Map {
            map: Arc::new(
                map.into_iter()
                    .map(|(k, v)| (cel::objects::Key::from(k), cel_value(v)))
                    .collect(),
            ),
        }),
    }
}

/// A destination's `filter`: a CEL expression over `topic`, `key`, `headers` and `payload`,
/// compiled when the configuration loads.
///
/// An event goes to the destination only when the expression is `true`. One that fails on an
/// event (a missing payload field, a type mismatch) or yields something else than a boolean is
/// `false` for that event: the event does not go there, and nothing is logged per event.
#[derive(Clone)]
pub struct Filter {
    source: String,
    program: Arc<cel::Program>,
}

/// The variables a filter may use.
pub const FILTER_VARIABLES: [&str; 4] = ["topic", "key", "headers", "payload"];

impl Filter {
    /// Compiles `source`; the error is one sentence (a syntax error, or an unknown variable).
    pub fn compile(source: &str) -> Result<Self, String> {
        Ok(Self {
            source: source.to_owned(),
            program: Arc::new(compile_over_event(source, "filter")?),
        })
    }

    /// The expression as written.
    pub fn as_str(&self) -> &str {
        &self.source
    }

    /// Whether the event whose scope is `input` passes (errors and non-booleans are `false`).
    pub fn matches(&self, input: &cel::Context<'_>) -> bool {
        matches!(self.program.execute(input), Ok(cel::Value::Bool(true)))
    }

    /// Evaluates the filter on one event (tests, `pgoutbox` tooling).
    pub fn eval(&self, event: &OutboxEvent) -> bool {
        let root = cel::Context::default();
        self.matches(&event_scope(&root, event))
    }
}

/// Compiles a CEL expression over an event's variables (`what` names it in errors: a filter, a
/// transform); the error is one sentence (empty, a syntax error, or an unknown variable).
pub(crate) fn compile_over_event(source: &str, what: &str) -> Result<cel::Program, String> {
    if source.trim().is_empty() {
        return Err(format!("the {what} is empty"));
    }
    let program = cel::Program::compile(source)
        .map_err(|e| format!("{source:?} is not a valid CEL expression: {e}"))?;
    let references = program.references();
    let bound = comprehension_variables(source);
    let mut unknown: Vec<&str> = references
        .variables()
        .into_iter()
        .filter(|v| !FILTER_VARIABLES.contains(v) && !bound.iter().any(|b| b == v))
        .collect();
    unknown.sort_unstable();
    if !unknown.is_empty() {
        return Err(format!(
            "{source:?} uses unknown variable(s) {}; a {what} sees {}",
            unknown.join(", "),
            FILTER_VARIABLES.join(", ")
        ));
    }
    Ok(program)
}

/// The variables that comprehension macros bind (`x` in `list.exists(x, x > 1)`): they are not
/// references to unknown variables.
fn comprehension_variables(source: &str) -> Vec<String> {
    const MACROS: [&str; 5] = ["all(", "exists(", "exists_one(", "map(", "filter("];
    let mut bound = Vec::new();
    for (at, _) in source.match_indices('.') {
        let rest = &source[at + 1..];
        let Some(args) = MACROS.iter().find_map(|m| rest.strip_prefix(m)) else {
            continue;
        };
        let name: String = args
            .trim_start()
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if !name.is_empty() {
            bound.push(name);
        }
    }
    bound
}

impl fmt::Debug for Filter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Filter({:?})", self.source)
    }
}

impl PartialEq for Filter {
    fn eq(&self, other: &Self) -> bool {
        self.source == other.source
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::event::testing::event;

    /// The expression forms the README documents, each against the same event.
    #[test]
    fn filters_table() {
        let mut e = event(
            "order.created",
            Some("o-42"),
            &[("X-Tenant", "acme"), ("x-region", "eu")],
        );
        e.payload = serde_json::value::RawValue::from_string(
            r#"{"total": 250, "currency": "EUR", "items": [{"sku": "a"}, {"sku": "b"}], "customer": {"vip": true}}"#.into(),
        )
        .expect("json");
        let cases: &[(&str, bool)] = &[
            ("topic == 'order.created'", true),
            ("topic.startsWith('order.')", true),
            ("topic in ['payment.captured', 'refund.created']", false),
            ("key == 'o-42'", true),
            ("key != null && key.startsWith('o-')", true),
            ("headers['x-tenant'] == 'acme'", true),
            ("'x-tenant' in headers", true),
            ("headers['x-region'] == 'us'", false),
            ("payload.total > 100", true),
            ("payload.total > 100 && headers['x-tenant'] == 'acme'", true),
            ("payload.total >= 1000 || payload.currency == 'EUR'", true),
            ("payload.customer.vip", true),
            ("size(payload.items) == 2", true),
            ("payload.items.exists(i, i.sku == 'b')", true),
            ("has(payload.coupon)", false),
            ("!has(payload.coupon)", true),
            ("payload.currency.matches('^EU')", true),
            // Fails on this event (no such field, wrong type, not a boolean): false, not an error.
            ("payload.missing > 1", false),
            ("headers['x-missing'] == 'x'", false),
            ("payload.currency > 1", false),
            ("payload.total", false),
        ];
        for (source, expected) in cases {
            let filter = Filter::compile(source).unwrap_or_else(|e| panic!("{source}: {e}"));
            assert_eq!(filter.eval(&e), *expected, "{source}");
        }
        let keyless = event("order.created", None, &[]);
        let f = Filter::compile("key == null").expect("valid");
        assert!(f.eval(&keyless));
    }

    #[test]
    fn bad_filters_are_configuration_errors_naming_the_key() {
        for (bad, says) in [
            ("payload.total >", "not a valid CEL expression"),
            ("", "empty"),
            ("paylod.total > 1", "unknown variable(s) paylod"),
        ] {
            let e = Filter::compile(bad).expect_err(bad);
            assert!(e.contains(says), "{bad:?}: {e}");
        }
    }
}
