//! Routing: which destinations an event goes to (every one whose topic globs match and whose
//! [`Filter`] is true), and the [`Template`]s broker sinks use to name the subject, routing key,
//! topic or stream of each event.

use std::fmt;
use std::sync::Arc;

use glob::Pattern;

use crate::config::DestinationConfig;
use crate::event::OutboxEvent;

/// Topic globs and filter of every destination, in configuration order.
#[derive(Debug, Clone)]
pub struct Router {
    routes: Vec<(Vec<Pattern>, Option<Filter>)>,
}

impl Router {
    /// Builds the router; globs and filters were validated with the configuration (an invalid glob
    /// matches nothing).
    pub fn new(destinations: &[DestinationConfig]) -> Self {
        let routes = destinations
            .iter()
            .map(|d| {
                let globs = d
                    .topics
                    .iter()
                    .filter_map(|g| Pattern::new(g).ok())
                    .collect();
                (globs, d.filter.clone())
            })
            .collect();
        Self { routes }
    }

    /// Whether any destination has a filter (routing then reads payloads).
    pub fn filters(&self) -> bool {
        self.routes.iter().any(|(_, f)| f.is_some())
    }

    /// The destinations whose topic globs match `topic`, filters aside (for counts by topic).
    pub fn by_topic(&self, topic: &str) -> Vec<usize> {
        (0..self.routes.len())
            .filter(|&d| topic_matches(&self.routes[d].0, topic))
            .collect()
    }

    /// The destinations each event goes to, in configuration order; empty when none takes it.
    pub fn route_all(&self, events: &[OutboxEvent]) -> Vec<Vec<usize>> {
        if !self.filters() {
            return events.iter().map(|e| self.by_topic(&e.topic)).collect();
        }
        // Built once per batch: the interpreter's functions are registered here, each event only
        // adds its variables in a scope of its own.
        let root = cel::Context::default();
        events
            .iter()
            .map(|event| {
                let mut input: Option<cel::Context<'_>> = None;
                (0..self.routes.len())
                    .filter(|&d| {
                        let (globs, filter) = &self.routes[d];
                        topic_matches(globs, &event.topic)
                            && filter.as_ref().is_none_or(|f| {
                                f.matches(input.get_or_insert_with(|| event_scope(&root, event)))
                            })
                    })
                    .collect()
            })
            .collect()
    }
}

fn topic_matches(globs: &[Pattern], topic: &str) -> bool {
    globs.is_empty() || globs.iter().any(|g| g.matches(topic))
}

/// The variables a filter sees: `topic`, `key` (null when absent), `headers` (names lowercased)
/// and `payload` (the JSON document).
fn event_scope<'a>(root: &'a cel::Context<'a>, event: &OutboxEvent) -> cel::Context<'a> {
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
    let _ = scope.add_variable("payload", payload);
    scope
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
        if source.trim().is_empty() {
            return Err("the filter is empty".into());
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
                "{source:?} uses unknown variable(s) {}; a filter sees {}",
                unknown.join(", "),
                FILTER_VARIABLES.join(", ")
            ));
        }
        Ok(Self {
            source: source.to_owned(),
            program: Arc::new(program),
        })
    }

    /// The expression as written.
    pub fn as_str(&self) -> &str {
        &self.source
    }

    /// Whether the event whose scope is `input` passes (errors and non-booleans are `false`).
    fn matches(&self, input: &cel::Context<'_>) -> bool {
        matches!(self.program.execute(input), Ok(cel::Value::Bool(true)))
    }

    /// Evaluates the filter on one event (tests, `pgoutbox` tooling).
    pub fn eval(&self, event: &OutboxEvent) -> bool {
        let root = cel::Context::default();
        self.matches(&event_scope(&root, event))
    }
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

/// A name computed per event, e.g. `"orders.{topic}"` or `"{header.tenant}.{key}"`.
///
/// Placeholders: `{topic}`, `{key}` (empty when the event has none), `{header.NAME}` (the header's
/// value, matched case-insensitively; empty when absent). `{{` and `}}` stand for literal braces.
/// Parsed once when the sink is built, so a typo is a configuration error, not a runtime one.
#[derive(Clone, PartialEq, Eq)]
pub struct Template {
    source: String,
    parts: Vec<Part>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    Literal(String),
    Topic,
    Key,
    Header(String),
}

impl Template {
    /// Parses a template; the error is one sentence naming the problem.
    pub fn parse(source: &str) -> Result<Self, String> {
        let mut parts = Vec::new();
        let mut literal = String::new();
        let mut chars = source.char_indices().peekable();
        while let Some((at, c)) = chars.next() {
            match c {
                '{' if chars.peek().map(|(_, c)| *c) == Some('{') => {
                    chars.next();
                    literal.push('{');
                }
                '}' if chars.peek().map(|(_, c)| *c) == Some('}') => {
                    chars.next();
                    literal.push('}');
                }
                '}' => {
                    return Err(format!(
                        "template {source:?}: unmatched `}}` at byte {at} (write `}}}}` for a literal brace)"
                    ))
                }
                '{' => {
                    let mut name = String::new();
                    let mut closed = false;
                    for (_, c) in chars.by_ref() {
                        if c == '}' {
                            closed = true;
                            break;
                        }
                        name.push(c);
                    }
                    if !closed {
                        return Err(format!(
                            "template {source:?}: `{{` at byte {at} is never closed (write `{{{{` for a literal brace)"
                        ));
                    }
                    let part = match name.as_str() {
                        "topic" => Part::Topic,
                        "key" => Part::Key,
                        _ => match name.strip_prefix("header.") {
                            Some(h) if !h.is_empty() && !h.contains('{') => {
                                Part::Header(h.to_owned())
                            }
                            _ => {
                                return Err(format!(
                                    "template {source:?}: unknown placeholder {{{name}}}; known: {{topic}}, {{key}}, {{header.NAME}}"
                                ))
                            }
                        },
                    };
                    if !literal.is_empty() {
                        parts.push(Part::Literal(std::mem::take(&mut literal)));
                    }
                    parts.push(part);
                }
                c => literal.push(c),
            }
        }
        if !literal.is_empty() {
            parts.push(Part::Literal(literal));
        }
        if parts.is_empty() {
            return Err("template is empty".into());
        }
        Ok(Self {
            source: source.to_owned(),
            parts,
        })
    }

    /// The template `{topic}`: the event's topic, verbatim.
    pub fn topic() -> Self {
        Self {
            source: "{topic}".into(),
            parts: vec![Part::Topic],
        }
    }

    /// The text the template was parsed from.
    pub fn as_str(&self) -> &str {
        &self.source
    }

    /// Whether the template has no placeholder (the same name for every event).
    pub fn is_constant(&self) -> bool {
        self.parts.iter().all(|p| matches!(p, Part::Literal(_)))
    }

    /// The name for one event.
    pub fn render(&self, event: &OutboxEvent) -> String {
        let mut out = String::with_capacity(self.source.len() + event.topic.len());
        for part in &self.parts {
            match part {
                Part::Literal(s) => out.push_str(s),
                Part::Topic => out.push_str(&event.topic),
                Part::Key => out.push_str(event.key.as_deref().unwrap_or("")),
                Part::Header(h) => out.push_str(event.header(h).unwrap_or("")),
            }
        }
        out
    }
}

impl fmt::Debug for Template {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Template({:?})", self.source)
    }
}

impl<'de> serde::Deserialize<'de> for Template {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Template::parse(&s).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn event(topic: &str, key: Option<&str>, headers: &[(&str, &str)]) -> OutboxEvent {
        OutboxEvent {
            id: uuid::Uuid::new_v4(),
            seq: 1,
            topic: topic.into(),
            key: key.map(str::to_owned),
            payload: serde_json::value::RawValue::from_string("{}".into()).expect("json"),
            headers: headers
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            created_at: chrono::Utc::now(),
            attempts: 0,
        }
    }

    #[test]
    fn templates_render_topic_key_and_headers() {
        let e = event("order.created", Some("o-42"), &[("X-Tenant", "acme")]);
        let t = Template::parse("app.{header.x-tenant}.{topic}/{key}").expect("valid");
        assert_eq!(t.render(&e), "app.acme.order.created/o-42");
        assert!(!t.is_constant());
        let t = Template::parse("{{literal}}-{key}-{header.none}").expect("valid");
        assert_eq!(t.render(&event("t", None, &[])), "{literal}--");
        let t = Template::parse("fixed").expect("valid");
        assert!(t.is_constant());
        assert_eq!(Template::topic().render(&e), "order.created");
    }

    #[test]
    fn invalid_templates_are_errors() {
        for (bad, says) in [
            ("", "empty"),
            ("{topic", "never closed"),
            ("a}b", "unmatched"),
            ("{tpoic}", "unknown placeholder {tpoic}"),
            ("{header.}", "unknown placeholder"),
        ] {
            let e = Template::parse(bad).expect_err(bad);
            assert!(e.contains(says), "{bad:?}: {e}");
        }
    }

    #[test]
    fn every_matching_destination_takes_the_event() {
        let c = Config::parse(
            r#"
[[destinations]]
name = "a"
type = "null"
topics = ["order.*"]
[[destinations]]
name = "b"
type = "null"
topics = ["order.*", "payment.*"]
[[destinations]]
name = "c"
type = "null"
[[destinations]]
name = "big"
type = "null"
filter = "payload.total > 100"
"#,
            |_| None,
        )
        .expect("valid");
        let r = Router::new(&c.destinations);
        let mut small = event("order.created", None, &[]);
        small.payload =
            serde_json::value::RawValue::from_string(r#"{"total":5}"#.into()).expect("json");
        let mut big = event("payment.captured", None, &[]);
        big.payload =
            serde_json::value::RawValue::from_string(r#"{"total":500}"#.into()).expect("json");
        let routes = r.route_all(&[small, big, event("user.signed_up", None, &[])]);
        assert_eq!(routes, vec![vec![0, 1, 2], vec![1, 2, 3], vec![2]]);
        assert_eq!(r.by_topic("order.created"), vec![0, 1, 2, 3]);
    }

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
        let e = Config::parse(
            "[[destinations]]\nname = \"a\"\ntype = \"null\"\nfilter = \"payload.total >\"\n",
            |_| None,
        )
        .expect_err("bad filter");
        assert!(e.to_string().contains("destinations[0].filter"), "{e}");
    }
}
