//! A destination's subscription: which events it takes, by their topic (globs) and a filter over
//! the whole event. Plain data: the configuration file fills it in, routing
//! ([`crate::route::Router`]) follows it.

use super::filter::Filter;

/// Which events a destination takes: those whose topic matches one of its globs (every topic when
/// it has none) and that its filter, if any, keeps.
#[derive(Debug, Clone, Default)]
pub struct Subscription {
    /// Topic globs (`order.*`); empty matches every topic. Checked when they are loaded: an
    /// invalid glob matches nothing.
    pub topics: Vec<String>,
    /// A CEL expression an event must also satisfy.
    pub filter: Option<Filter>,
}
