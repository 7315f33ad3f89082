//! A lane: one destination as the engine drives it — its sink, its retry policy, its gate (pause,
//! breaker, concurrency for the whole process) — and the signal that wakes its retry loop.
//!
//! Every batch routes its items into the lanes; each lane publishes its share at its own pace,
//! and what a lane has not finished when the others have is handed over to the deliveries table
//! as that pair's state, where the lane's own retry loop picks it up. So a destination that is
//! slow, paused, failing or ordered never sets another's pace.

use std::sync::Arc;

use tokio::sync::Notify;

use crate::config::{DestinationConfig, OnDead, Ordering, SinkConfig};
use crate::gate::Gate;
use crate::model::event::OutboxEvent;
use crate::model::retry::RetryPolicy;
use crate::rate::Limiter;
use crate::sinks::Sink;
use crate::store::Store;

/// A configured destination, ready to publish: what [`super::Relay::with_destinations`] takes
/// from a caller that builds its own sinks (embedding, demos, tests).
pub struct Destination {
    /// Its name.
    pub name: String,
    /// Its sink.
    pub sink: Arc<dyn Sink>,
    /// Its retry policy.
    pub retry: RetryPolicy,
}

/// How long a sink's health check answers readiness before it is run again.
pub(super) const HEALTH_TTL: std::time::Duration = std::time::Duration::from_secs(5);

/// One destination's lane.
pub(super) struct Lane {
    /// The destination's name.
    pub(super) name: String,
    /// Its sink.
    pub(super) sink: Arc<dyn Sink>,
    /// Its retry policy.
    pub(super) retry: RetryPolicy,
    /// Its configuration (routing, ordering, breaker).
    pub(super) config: DestinationConfig,
    /// Its gate: pause, breaker, requests in flight.
    pub(super) gate: Gate,
    /// Its `rate_limit`, when it has one: tokens from the destination's shared bucket.
    pub(super) rate: Option<Limiter>,
    /// Woken when a batch hands pairs over to this lane: its retry loop looks at once.
    pub(super) handed: Notify,
    /// The sink's last health check for readiness: when, and its error if it failed. Held while
    /// a check runs, so that concurrent `/readyz` calls share one.
    pub(super) health: tokio::sync::Mutex<Option<(std::time::Instant, Option<String>)>>,
}

impl Lane {
    /// The lane of `destination`, configured by `config` (a caller-built sink may have none:
    /// then every default applies); its rate limit takes tokens through `store`.
    pub(super) fn new(
        destination: Destination,
        config: Option<&DestinationConfig>,
        store: &Store,
    ) -> Self {
        let config = config.cloned().unwrap_or_else(|| DestinationConfig {
            name: destination.name.clone(),
            topics: Vec::new(),
            filter: None,
            transform: None,
            rate_limit: None,
            backfill: None,
            retry: destination.retry.clone(),
            ordering: Ordering::None,
            on_dead: OnDead::Block,
            breaker: Default::default(),
            sink: SinkConfig::bare("custom"),
        });
        let gate = Gate::new(
            &destination.name,
            config.breaker.clone(),
            destination.sink.concurrency(),
        );
        let rate = config
            .rate_limit
            .map(|limit| Limiter::new(&destination.name, limit, store.clone()));
        Self {
            rate,
            name: destination.name,
            sink: destination.sink,
            retry: destination.retry,
            config,
            gate,
            handed: Notify::new(),
            health: tokio::sync::Mutex::new(None),
        }
    }

    /// Whether this destination keeps the order of `event`'s key.
    pub(super) fn keeps_order_of(&self, event: &OutboxEvent) -> bool {
        self.config.ordering == Ordering::Key && event.key.is_some()
    }

    /// The sink's health for readiness: checked at most once per [`HEALTH_TTL`] (a `/readyz`
    /// caller cannot make the relay send requests to destinations at its own rate), within
    /// `limit`.
    pub(super) async fn health(&self, limit: std::time::Duration) -> Option<String> {
        let mut last = self.health.lock().await;
        if let Some((at, result)) = last.as_ref() {
            if at.elapsed() < HEALTH_TTL {
                return result.clone();
            }
        }
        let result = match tokio::time::timeout(limit, self.sink.healthcheck()).await {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(e),
            Err(_) => Some(format!("no answer within {} s", limit.as_secs())),
        };
        *last = Some((std::time::Instant::now(), result.clone()));
        result
    }

    /// Whether an ordered event of this lane that is rejected lets its key's later events go on.
    pub(super) fn skips_dead(&self) -> bool {
        self.config.on_dead == OnDead::Skip
    }
}
