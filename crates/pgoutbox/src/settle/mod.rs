//! Settle: what a batch's attempts mean, and recording it in at most a few statements per batch.
//!
//! [`verdict`] judges each item (the one place that decides what an attempt means); [`plan`]
//! gathers a batch's verdicts into the writes of one settle — successes per destination, every
//! failure in one statement, split events' pairs fanned out to the deliveries table in the
//! statement that settles their rows — by one constructor per kind of batch; the [`Settler`] has
//! the store write them under the batch's claim ([`crate::store::settle`]), stores the breakers
//! its answers opened, and counts the outcomes.

pub mod plan;
mod settler;
pub mod verdict;

use crate::model::event::OutboxEvent;
use crate::model::retry::RetryPolicy;
use crate::sinks::gate::Gate;

pub use plan::{Batch, Origin, PairsPlan, Planned};
pub use settler::{Pairs, Settled, Settler};
pub use verdict::{judge, Attempt, Attempts, Judged, Verdict, Verdicts};

/// The lanes as settling sees them, by the index routing gave each: its destination's name,
/// retry policy, key order and gate. The engine's lanes answer it.
pub trait Lanes: Sync {
    /// The destination's name.
    fn name(&self, lane: usize) -> &str;

    /// Its retry policy.
    fn policy(&self, lane: usize) -> &RetryPolicy;

    /// The `destination` label of the series of the destination named `destination`: its name,
    /// or [`crate::model::metric::RUNTIME_DESTINATIONS`] for one managed at runtime.
    fn series<'a>(&'a self, destination: &'a str) -> &'a str {
        destination
    }

    /// Whether it keeps the order of `event`'s key.
    fn keeps_order_of(&self, lane: usize, event: &OutboxEvent) -> bool;

    /// The gates whose answers opened a breaker not stored yet (the settler stores them).
    fn tripped_gates(&self) -> Vec<&Gate> {
        Vec::new()
    }
}

/// What the settle tests share.
#[cfg(test)]
pub(crate) mod testing {
    use super::Lanes;
    use crate::model::event::OutboxEvent;
    use crate::model::retry::RetryPolicy;

    /// One lane, `billing`, with the given retry policy; a destination named `customer-…` is
    /// one managed at runtime.
    pub(crate) struct OneLane(pub RetryPolicy);

    impl Lanes for OneLane {
        fn name(&self, _: usize) -> &str {
            "billing"
        }
        fn policy(&self, _: usize) -> &RetryPolicy {
            &self.0
        }
        fn keeps_order_of(&self, _: usize, _: &OutboxEvent) -> bool {
            false
        }
        fn series<'a>(&'a self, destination: &'a str) -> &'a str {
            match destination.starts_with("customer-") {
                true => crate::model::metric::RUNTIME_DESTINATIONS,
                false => destination,
            }
        }
    }
}
