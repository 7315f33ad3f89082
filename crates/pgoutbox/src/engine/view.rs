//! What the server sees of a running relay: its store and configuration, which destinations take
//! a topic, and whether the relay is alive and ready. Nothing of the engine's loops or batches:
//! the server reads and answers, it never drives.

use std::sync::Arc;

use super::context::Context;
use super::Relay;
use crate::config::Config;
use crate::store::Store;

/// A narrow, cheap-to-clone view of a relay, for the server (metrics gauges, health, the console).
#[derive(Clone)]
pub struct RelayView(Arc<Context>);

impl RelayView {
    /// The view of the relay of `ctx`.
    pub(super) fn of(ctx: Arc<Context>) -> Self {
        Self(ctx)
    }

    /// The store: the database and its statements.
    pub fn store(&self) -> &Store {
        &self.0.store
    }

    /// The configuration the relay was built from.
    pub fn config(&self) -> &Config {
        &self.0.config
    }

    /// Whether a destination of that name is configured.
    pub fn has_destination(&self, name: &str) -> bool {
        self.0.lanes.named(name).is_some()
    }

    /// The `destination` label of `destination`'s series (the destinations managed at runtime
    /// share one, [`crate::model::metric::RUNTIME_DESTINATIONS`]).
    pub fn series<'a>(&'a self, destination: &'a str) -> &'a str {
        use crate::settle::Lanes as _;
        self.0.lanes.series(destination)
    }

    /// The configured destinations whose topics take `topic` (filters aside), in order.
    pub fn destinations_of_topic(&self, topic: &str) -> Vec<String> {
        self.0
            .router
            .by_topic(topic)
            .into_iter()
            .filter_map(|d| self.0.config.destinations.get(d).map(|c| c.name.clone()))
            .collect()
    }

    /// Readiness of the database and one destination (`Some(name)`), or of every destination
    /// (see [`Relay::readiness`]).
    pub async fn readiness_of(
        &self,
        only: Option<&str>,
    ) -> std::result::Result<Vec<String>, Vec<String>> {
        self.0.readiness_of(only).await
    }

    /// Whether the relay is stalled (see [`Relay::stall`]), also set as `pgoutbox_relay_stalled`.
    pub async fn stall(&self) -> crate::Result<Option<String>> {
        self.0.stall().await
    }

    /// Whether the relay is alive: `Some(reason)` once a claim worker died.
    pub fn failure(&self) -> Option<String> {
        self.0.failure()
    }
}

impl From<&Relay> for RelayView {
    fn from(relay: &Relay) -> Self {
        relay.view()
    }
}

impl From<Arc<Relay>> for RelayView {
    fn from(relay: Arc<Relay>) -> Self {
        relay.view()
    }
}

impl From<&Arc<Relay>> for RelayView {
    fn from(relay: &Arc<Relay>) -> Self {
        relay.view()
    }
}
