//! Names computed per event (`"orders.{topic}"`): the subjects, routing keys, topics and streams
//! of the broker sinks. Parsed once when the configuration loads.

use std::fmt;

use super::event::OutboxEvent;

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

    /// A template with no placeholder: `text`, verbatim, for every event.
    pub fn literal(text: &str) -> Self {
        Self {
            source: text.replace('{', "{{").replace('}', "}}"),
            parts: vec![Part::Literal(text.to_owned())],
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

    /// The template with every placeholder filled with `fill`: what its literal parts make of
    /// a name, checked when the settings load (a placeholder may hold anything at run time).
    pub fn sample(&self, fill: &str) -> String {
        let mut out = String::with_capacity(self.source.len());
        for part in &self.parts {
            match part {
                Part::Literal(s) => out.push_str(s),
                Part::Topic | Part::Key | Part::Header(_) => out.push_str(fill),
            }
        }
        out
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
    use crate::model::event::testing::event;

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
}
