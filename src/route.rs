//! Routing: which destinations an event goes to (every one whose topic globs match and whose
//! [`Filter`] is true), and the [`Template`]s broker sinks use to name the subject, routing key,
//! topic or stream of each event.

use glob::Pattern;

use crate::config::DestinationConfig;
use crate::model::event::OutboxEvent;
use crate::model::filter::{event_scope, Filter};

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

    /// Whether destination `d` takes `event` (its topics and filter).
    pub fn takes(&self, d: usize, event: &OutboxEvent) -> bool {
        let Some((globs, filter)) = self.routes.get(d) else {
            return false;
        };
        topic_matches(globs, &event.topic) && filter.as_ref().is_none_or(|f| f.eval(event))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::model::event::testing::event;

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
}
