//! Routing: which destinations an event goes to — every one whose [`Subscription`] takes it (its
//! topic globs match and its [`Filter`] is true) — and a batch's [`Items`], one per (event,
//! destination) pair, each with what the engine does with it now: send it, hold it, keep it
//! behind an earlier event of its key, or dead-letter it as unroutable. Building them is pure; the
//! one database question (which ordered keys still wait in the deliveries table) is the
//! engine's, which keeps the items it names behind ([`Items::keep_behind`]). And a replay's dry
//! run ([`dry_run`]): which retained events one destination would take.

mod dry_run;
mod topics;

use std::collections::HashSet;
use std::ops::Range;

use crate::model::event::OutboxEvent;
use crate::model::filter::{event_scope, Filter};
use crate::model::subscription::Subscription;

pub use dry_run::{dry_run, DryRun};
pub use topics::Topics;

/// Topic globs and filter of every destination, in the order they were given: the topics
/// indexed ([`Topics`]), so that routing an event costs what its matches cost, and the filters
/// evaluated only for the destinations its topic matched.
#[derive(Debug, Clone)]
pub struct Router {
    topics: Topics,
    filters: Vec<Option<Filter>>,
}

impl Router {
    /// Builds the router over each destination's subscription; globs and filters were validated
    /// when they were loaded (an invalid glob matches nothing).
    pub fn new<D: AsRef<Subscription>>(destinations: &[D]) -> Self {
        Self {
            topics: Topics::new(destinations.iter().map(AsRef::as_ref)),
            filters: destinations
                .iter()
                .map(|d| d.as_ref().filter.clone())
                .collect(),
        }
    }

    /// Whether any destination has a filter (routing then reads payloads).
    pub fn filters(&self) -> bool {
        self.filters.iter().any(Option::is_some)
    }

    /// The destinations whose topic globs match `topic`, filters aside (for counts by topic).
    pub fn by_topic(&self, topic: &str) -> Vec<usize> {
        self.topics.matching(topic)
    }

    /// Whether destination `d` takes `event` (its topics and filter).
    pub fn takes(&self, d: usize, event: &OutboxEvent) -> bool {
        let Some(filter) = self.filters.get(d) else {
            return false;
        };
        self.topics.matches(d, &event.topic) && filter.as_ref().is_none_or(|f| f.eval(event))
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
                let mut candidates = self.topics.matching(&event.topic);
                candidates.retain(|&d| {
                    self.filters[d].as_ref().is_none_or(|f| {
                        f.matches(input.get_or_insert_with(|| event_scope(&root, event)))
                    })
                });
                candidates
            })
            .collect()
    }
}

/// What happens to an item now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dispatch {
    /// Published to its lane.
    Send,
    /// Held: its destination is paused or its breaker is open.
    Hold,
    /// An earlier event of its key still has an undelivered pair for this ordered destination:
    /// not published now, its pair waits behind it in the deliveries table.
    Behind,
    /// No destination takes its event.
    Unroutable,
}

/// One (event, destination) pair of a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Item {
    /// Its event's index in the batch.
    pub event: usize,
    /// Its lane (`None` for an unroutable event).
    pub lane: Option<usize>,
    /// What happens to it now.
    pub dispatch: Dispatch,
}

/// A batch's items, grouped by event.
#[derive(Debug, Default)]
pub struct Items {
    /// Every item.
    pub list: Vec<Item>,
    /// Per event: its items (contiguous).
    pub spans: Vec<Range<usize>>,
}

impl Items {
    /// The items of events routed to `targets` (per event, its lanes; empty: unroutable), each
    /// sent unless `open(lane)` says its destination is held.
    pub fn route(targets: Vec<Vec<usize>>, open: impl Fn(usize) -> bool) -> Self {
        let mut items = Self::default();
        for (event, lanes) in targets.into_iter().enumerate() {
            let start = items.list.len();
            if lanes.is_empty() {
                items.list.push(Item {
                    event,
                    lane: None,
                    dispatch: Dispatch::Unroutable,
                });
            }
            for lane in lanes {
                let dispatch = if open(lane) {
                    Dispatch::Send
                } else {
                    Dispatch::Hold
                };
                items.list.push(Item {
                    event,
                    lane: Some(lane),
                    dispatch,
                });
            }
            items.spans.push(start..items.list.len());
        }
        items
    }

    /// Keeps behind their key the items whose (lane, key) is in `waiting`; `key_of(item)` is the
    /// item's key when its lane keeps key order.
    pub fn keep_behind<'k>(
        &mut self,
        waiting: &HashSet<(usize, &'k str)>,
        key_of: impl Fn(&Item) -> Option<(usize, &'k str)>,
    ) {
        for item in &mut self.list {
            if item.dispatch == Dispatch::Send && key_of(item).is_some_and(|k| waiting.contains(&k))
            {
                item.dispatch = Dispatch::Behind;
            }
        }
    }

    /// Items of one destination each, in the events' order: a batch of pairs claimed from the
    /// deliveries table, each sent unless `open(lane)` says its destination is held.
    pub fn pairs(lanes: impl IntoIterator<Item = usize>, open: impl Fn(usize) -> bool) -> Self {
        Self::route(lanes.into_iter().map(|lane| vec![lane]).collect(), open)
    }

    /// The items to publish.
    pub fn sendable(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.list.len()).filter(|&i| self.list[i].dispatch == Dispatch::Send)
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

    #[test]
    fn every_event_has_its_items_and_an_unroutable_one_has_one() {
        // Lane 1 is held (paused or breaker open).
        let items = Items::route(vec![vec![0, 1], vec![], vec![1]], |lane| lane != 1);
        let got: Vec<(usize, Option<usize>, Dispatch)> = items
            .list
            .iter()
            .map(|i| (i.event, i.lane, i.dispatch))
            .collect();
        assert_eq!(
            got,
            vec![
                (0, Some(0), Dispatch::Send),
                (0, Some(1), Dispatch::Hold),
                (1, None, Dispatch::Unroutable),
                (2, Some(1), Dispatch::Hold),
            ]
        );
        assert_eq!(items.spans, vec![0..2, 2..3, 3..4]);
        assert_eq!(items.sendable().collect::<Vec<_>>(), vec![0]);
    }

    #[test]
    fn items_whose_key_waits_stay_behind() {
        let mut items = Items::route(vec![vec![0, 1], vec![0]], |_| true);
        let keys = ["k1", "k2"];
        let waiting: HashSet<(usize, &str)> = [(0, "k1")].into_iter().collect();
        // Lane 0 keeps key order; lane 1 does not.
        items.keep_behind(&waiting, |i| {
            (i.lane == Some(0)).then(|| (0, keys[i.event]))
        });
        let got: Vec<Dispatch> = items.list.iter().map(|i| i.dispatch).collect();
        assert_eq!(got, vec![Dispatch::Behind, Dispatch::Send, Dispatch::Send]);
    }
}
