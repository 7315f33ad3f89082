//! Routing: which destinations an event goes to (every one whose topic globs match and whose
//! [`Filter`] is true), and the [`Template`]s broker sinks use to name the subject, routing key,
//! topic or stream of each event; and a replay's dry run ([`dry_run`]): which retained events one
//! destination would take.

use std::ops::ControlFlow;

use glob::Pattern;

use crate::config::DestinationConfig;
use crate::error::Result;
use crate::model::event::OutboxEvent;
use crate::model::filter::{event_scope, Filter};
use crate::store::replays::{self, Selection};
use crate::store::Store;

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

    /// Whether a replay to destination `d` sends `event`: the destination takes it and the
    /// replay's own `filter` keeps it. A replay and its dry run decide by this alike.
    pub fn replay_takes(&self, d: usize, filter: Option<&Filter>, event: &OutboxEvent) -> bool {
        self.takes(d, event) && filter.is_none_or(|f| f.eval(event))
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

/// What a replay's dry run counted: the retained events in its range, those the destination
/// would be sent, and rows that cannot be read as events (a replay skips them).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct DryRun {
    /// Retained events in the range (the selection's topics, keys and times).
    pub read: u64,
    /// Of those, the events the destination takes (its topics and filter) and `filter` keeps.
    pub would_send: u64,
    /// Rows that cannot be read as events.
    pub unreadable: u64,
    /// Whether the walk reached the end of the range; when `progress` stopped it first, the
    /// counts are of the events read until then.
    pub complete: bool,
}

/// Retained events a dry run reads at a time.
const DRY_RUN_PAGE: i64 = 5_000;

/// Walks `selection` as a replay to `dest` would (published up to now), counting what the
/// destination would be sent with the replay's own `filter`; `progress` is told the events read
/// so far after each page, and may stop the walk there (a request with a time budget). Nothing
/// is written.
pub async fn dry_run(
    store: &Store,
    dest: &DestinationConfig,
    selection: &Selection,
    filter: Option<&Filter>,
    mut progress: impl FnMut(u64) -> ControlFlow<()>,
) -> Result<DryRun> {
    let router = Router::new(std::slice::from_ref(dest));
    let upto = chrono::Utc::now();
    let mut counted = DryRun::default();
    let mut cursor = None;
    loop {
        let page = replays::read(store, (selection, Some(upto)), cursor, DRY_RUN_PAGE).await?;
        for r in &page {
            match &r.event {
                Ok(e) if router.replay_takes(0, filter, e) => {
                    counted.would_send += 1;
                }
                Ok(_) => {}
                Err(_) => counted.unreadable += 1,
            }
        }
        counted.read += page.len() as u64;
        let stop = progress(counted.read);
        match page.last() {
            Some(last) if page.len() as i64 == DRY_RUN_PAGE => cursor = Some(last.cursor),
            _ => {
                counted.complete = true;
                return Ok(counted);
            }
        }
        if stop.is_break() {
            return Ok(counted);
        }
    }
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
