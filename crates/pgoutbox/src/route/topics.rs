//! Which destinations' topic globs match a topic, by lookup: exact topics through a map, every
//! other glob of every destination in one automaton ([`globset::GlobSet`]), and the destinations
//! that take every topic in a list. The cost per event follows the matches, not the number of
//! destinations.

use std::collections::HashMap;

use globset::{GlobSet, GlobSetBuilder};

use crate::model::subscription::{is_exact_topic, topic_glob, Subscription};

/// The topic globs of every destination, indexed.
#[derive(Debug, Clone, Default)]
pub struct Topics {
    every: Vec<usize>,
    exact: HashMap<String, Vec<usize>>,
    globs: GlobSet,
    owner: Vec<usize>,
}

impl Topics {
    /// The index of each destination's topics (`d` is its position); an invalid glob matches
    /// nothing (they were checked when loaded).
    pub fn new<'s>(subscriptions: impl IntoIterator<Item = &'s Subscription>) -> Self {
        let mut index = Self::default();
        let mut set = GlobSetBuilder::new();
        for (d, s) in subscriptions.into_iter().enumerate() {
            if s.topics.is_empty() {
                index.every.push(d);
            }
            for glob in &s.topics {
                if is_exact_topic(glob) {
                    index.exact.entry(glob.clone()).or_default().push(d);
                } else if let Ok(compiled) = topic_glob(glob) {
                    set.add(compiled);
                    index.owner.push(d);
                }
            }
        }
        // Each glob compiled on its own above: the set of valid ones builds.
        index.globs = set.build().unwrap_or_else(|_| GlobSet::empty());
        index
    }

    /// The destinations whose globs match `topic`, in ascending order, each once.
    pub fn matching(&self, topic: &str) -> Vec<usize> {
        let mut out = self.every.clone();
        if let Some(exact) = self.exact.get(topic) {
            out.extend_from_slice(exact);
        }
        if !self.globs.is_empty() {
            out.extend(self.globs.matches(topic).into_iter().map(|g| self.owner[g]));
        }
        out.sort_unstable();
        out.dedup();
        out
    }

    /// Whether destination `d`'s globs match `topic`.
    pub fn matches(&self, d: usize, topic: &str) -> bool {
        self.matching(topic).binary_search(&d).is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn subscribed(topics: &[&str]) -> Subscription {
        Subscription {
            topics: topics.iter().map(|t| (*t).to_owned()).collect(),
            filter: None,
        }
    }

    #[test]
    fn a_topic_finds_its_destinations_by_lookup() {
        let subs = [
            subscribed(&["order.created"]),
            subscribed(&["order.*"]),
            subscribed(&[]),
            subscribed(&["payment.?", "order.created"]),
            subscribed(&["[op]*.created", "{invoice,refund}.*"]),
            subscribed(&["a\\*b"]),
        ];
        let topics = Topics::new(&subs);
        // topic → the destinations that take it
        let cases: &[(&str, &[usize])] = &[
            ("order.created", &[0, 1, 2, 3, 4]),
            ("order.paid", &[1, 2]),
            ("order.paid.late", &[1, 2]),
            ("payment.x", &[2, 3]),
            ("payment.xy", &[2]),
            ("product.created", &[2, 4]),
            ("refund.sent", &[2, 4]),
            ("a*b", &[2, 5]),
            ("axb", &[2]),
            ("", &[2]),
        ];
        for (topic, expected) in cases {
            assert_eq!(topics.matching(topic), *expected, "{topic}");
            for d in 0..subs.len() {
                assert_eq!(
                    topics.matches(d, topic),
                    expected.contains(&d),
                    "{topic} {d}"
                );
            }
        }
    }

    #[test]
    fn it_matches_as_the_glob_crate_did_on_plain_topics() {
        let globs = ["order.*", "*.created", "o?der.*", "[a-c]*", "[!o]*", "*"];
        let topics = ["order.created", "ardor.x", "b", "payment.created", "o", ""];
        for glob in globs {
            let old = glob::Pattern::new(glob).expect("glob");
            let index = Topics::new(&[subscribed(&[glob])]);
            for topic in topics {
                assert_eq!(
                    index.matches(0, topic),
                    old.matches(topic),
                    "{glob} on {topic:?}"
                );
            }
        }
    }
}
