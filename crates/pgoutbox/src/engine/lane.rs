//! A lane: one destination as the engine drives it — its sink, its retry policy, its gate (pause,
//! breaker, concurrency for the whole process), its rate limit; and the [`Lanes`] of a relay,
//! which routing's indexes name.
//!
//! Every batch routes its items into the lanes; each lane publishes its share at its own pace,
//! and what a lane has not finished when the others have is handed over to the deliveries table
//! as that pair's state, where the retry scheduler picks it up for the lane. So a destination that is
//! slow, paused, failing or ordered never sets another's pace.

use std::sync::Arc;

use crate::config::{DestinationConfig, OnDead, Ordering, SinkConfig};
use crate::model::event::OutboxEvent;
use crate::model::retry::RetryPolicy;
use crate::rate::Limiter;
use crate::sinks::gate::{BreakerState, Gate};
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
const HEALTH_TTL: std::time::Duration = std::time::Duration::from_secs(5);

/// One destination's lane.
pub(super) struct Lane {
    /// The destination's name.
    pub(super) name: String,
    /// Its sink.
    pub(super) sink: Arc<dyn Sink>,
    /// Its retry policy.
    pub(super) retry: RetryPolicy,
    /// Its configuration (routing, ordering, breaker), shared with the relay's [`crate::config::Config`].
    pub(super) config: Arc<DestinationConfig>,
    /// Its gate: pause, breaker, requests in flight.
    pub(super) gate: Gate,
    /// Its `rate_limit`, when it has one: tokens from the destination's shared bucket.
    pub(super) rate: Option<Limiter>,
    /// The (breaker, paused) state last set on its gauges; none is set while it is the first
    /// (closed, running).
    reported: std::sync::Mutex<(BreakerState, bool)>,
    /// The sink's last health check for readiness: when, and its error if it failed. Held while
    /// a check runs, so that concurrent `/readyz` calls share one.
    health: tokio::sync::Mutex<Option<(std::time::Instant, Option<String>)>>,
}

impl Lane {
    /// The lane of `destination`, configured by `config` (a caller-built sink may have none:
    /// then every default applies); its rate limit takes tokens through `store`.
    fn new(
        destination: Destination,
        config: Option<&Arc<DestinationConfig>>,
        store: &Store,
    ) -> Self {
        let config = config.cloned().unwrap_or_else(|| {
            Arc::new(DestinationConfig {
                name: destination.name.clone(),
                subscription: Default::default(),
                transform: None,
                rate_limit: None,
                backfill: None,
                retry: destination.retry.clone(),
                ordering: Ordering::None,
                on_dead: OnDead::Block,
                breaker: Default::default(),
                sink: SinkConfig::bare("custom"),
                runtime: false,
            })
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
            reported: std::sync::Mutex::new((BreakerState::Closed, false)),
            health: tokio::sync::Mutex::new(None),
        }
    }

    /// Whether the gauges of this destination must be set to `state`: it differs from what they
    /// last showed (a healthy destination that never changed has none).
    pub(super) fn report_state(&self, state: (BreakerState, bool)) -> bool {
        let mut reported = self
            .reported
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let changed = *reported != state;
        *reported = state;
        changed
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

/// A relay's lanes, in the order routing names them (the configuration's), and each one's index
/// by name (looked up per due destination by the retry scheduler).
pub(super) struct Lanes {
    lanes: Vec<Lane>,
    by_name: std::collections::HashMap<String, usize>,
}

impl Lanes {
    /// The lanes of `destinations`, the i-th taking the routing, ordering and breaker of
    /// `configs`' i-th, if any.
    pub(super) fn new(
        destinations: Vec<Destination>,
        configs: &[Arc<DestinationConfig>],
        store: &Store,
    ) -> Self {
        let lanes: Vec<Lane> = destinations
            .into_iter()
            .enumerate()
            .map(|(d, destination)| Lane::new(destination, configs.get(d), store))
            .collect();
        let by_name = lanes
            .iter()
            .enumerate()
            .map(|(d, lane)| (lane.name.clone(), d))
            .collect();
        Self { lanes, by_name }
    }

    /// How many lanes.
    pub(super) fn len(&self) -> usize {
        self.lanes.len()
    }

    /// Every lane, in order.
    pub(super) fn iter(&self) -> std::slice::Iter<'_, Lane> {
        self.lanes.iter()
    }

    /// The lane named `name`, with its index.
    pub(super) fn named(&self, name: &str) -> Option<(usize, &Lane)> {
        let &d = self.by_name.get(name)?;
        Some((d, &self.lanes[d]))
    }

    /// Whether each lane's events go out now (not paused, breaker closed): each gate read once,
    /// not once per event (its lock is taken by every answer).
    pub(super) fn open(&self) -> Vec<bool> {
        self.lanes.iter().map(|l| l.gate.is_open()).collect()
    }

    /// The destinations whose dead events hold back their key (ordered, `on_dead = "block"`).
    pub(super) fn blocking(&self) -> Vec<String> {
        self.lanes
            .iter()
            .filter(|l| l.config.dead_blocks())
            .map(|l| l.name.clone())
            .collect()
    }

    /// Whether any destination orders its events by key.
    pub(super) fn ordered(&self) -> bool {
        self.lanes
            .iter()
            .any(|l| l.config.ordering == Ordering::Key)
    }
}

impl std::ops::Index<usize> for Lanes {
    type Output = Lane;

    fn index(&self, lane: usize) -> &Lane {
        &self.lanes[lane]
    }
}

impl crate::settle::Lanes for Lanes {
    fn name(&self, lane: usize) -> &str {
        &self.lanes[lane].name
    }

    fn policy(&self, lane: usize) -> &RetryPolicy {
        &self.lanes[lane].retry
    }

    fn keeps_order_of(&self, lane: usize, event: &OutboxEvent) -> bool {
        self.lanes[lane].keeps_order_of(event)
    }

    fn gates(&self) -> Vec<&Gate> {
        self.lanes.iter().map(|l| &l.gate).collect()
    }
}
