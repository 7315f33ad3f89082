//! A lane: one destination as the engine drives it — its sink, its retry policy, its gate (pause,
//! breaker, concurrency for the whole process), its rate limit; and the [`Lanes`] of a relay,
//! which routing's indexes name.
//!
//! Every batch routes its items into the lanes; each lane publishes its share at its own pace,
//! and what a lane has not finished when the others have is handed over to the deliveries table
//! as that pair's state, where the retry scheduler picks it up for the lane. So a destination that is
//! slow, paused, failing or ordered never sets another's pace.
//!
//! A lane of a configured destination builds its sink from the definition when it first has
//! work, and drops it once it has been idle for [`SINK_IDLE`] ([`SinkSlot`]): of ten thousand
//! customers' endpoints most are idle at any time, and an idle one costs its definition and its
//! gate, not a client.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

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

/// How long a lane's sink built from its definition stays after its last use.
pub(super) const SINK_IDLE: Duration = Duration::from_secs(300);

/// A lane's sink.
pub(super) enum SinkSlot {
    /// Built by the caller (embedding, tests): kept for the relay's life.
    Given(Arc<dyn Sink>),
    /// Built from the destination's definition when needed, and when it was last handed out.
    Lazy(Mutex<Option<(Arc<dyn Sink>, Instant)>>),
}

impl SinkSlot {
    /// A slot that builds its sink when first asked.
    pub(super) fn lazy() -> Self {
        Self::Lazy(Mutex::new(None))
    }
}

/// Whether a sink built from its definition, last handed out `since` ago and held by `holders`
/// (the slot's own reference included), is dropped now: idle for `idle`, and no publish holds it
/// (one that did would meet a second client of the same destination).
fn drops(since: Duration, holders: usize, idle: Duration) -> bool {
    since >= idle && holders == 1
}

/// How long a sink's health check answers readiness before it is run again.
const HEALTH_TTL: std::time::Duration = std::time::Duration::from_secs(5);

/// The sink's last health check for readiness: when, and its error if it failed. Held while a
/// check runs, so that concurrent `/readyz` calls share one.
type Health = tokio::sync::Mutex<Option<(std::time::Instant, Option<String>)>>;

/// One destination's lane. A relay holds one per destination, most of them idle: what only some
/// lanes use (a rate limit, a readiness check) is boxed, and the name and retry policy are the
/// configuration's, not copies.
pub(super) struct Lane {
    /// Its sink.
    sink: SinkSlot,
    /// Its configuration (name, routing, retry, ordering, breaker), shared with the relay's
    /// [`crate::config::Config`].
    pub(super) config: Arc<DestinationConfig>,
    /// Its gate: pause, breaker, requests in flight.
    pub(super) gate: Gate,
    /// Its `rate_limit`, when it has one: tokens from the destination's shared bucket.
    pub(super) rate: Option<Box<Limiter>>,
    /// The (breaker, paused) state last set on its gauges; none is set while it is the first
    /// (closed, running).
    reported: std::sync::Mutex<(BreakerState, bool)>,
    /// Whether its row of the destinations table is known to be there, as its definition has it
    /// (registered by this relay, or by the relay it took over from with the same definition).
    registered: std::sync::atomic::AtomicBool,
    /// Made by the first readiness check that reads this destination.
    health: std::sync::OnceLock<Box<Health>>,
}

impl Lane {
    /// The lane of destination `name` with `sink`, which takes `concurrency` requests at once,
    /// configured by `config` (a caller-built sink may have none: then every default applies); its
    /// rate limit takes tokens through `store`.
    fn new(
        name: String,
        sink: SinkSlot,
        concurrency: Option<usize>,
        retry: RetryPolicy,
        config: Option<&Arc<DestinationConfig>>,
        store: &Store,
    ) -> Self {
        let config = match config {
            // A caller-built sink may have been given its own name or retry policy.
            Some(config) if config.name == name && config.retry == retry => Arc::clone(config),
            Some(config) => Arc::new(DestinationConfig {
                name,
                retry,
                ..DestinationConfig::clone(config)
            }),
            None => Arc::new(DestinationConfig {
                name,
                subscription: Default::default(),
                transform: None,
                rate_limit: None,
                backfill: None,
                retry: retry.clone(),
                ordering: Ordering::None,
                on_dead: OnDead::Block,
                breaker: Default::default(),
                sink: SinkConfig::bare("custom"),
                runtime: false,
            }),
        };
        let gate = Gate::new(&config.name, config.breaker.clone(), concurrency);
        let rate = config
            .rate_limit
            .map(|limit| Box::new(Limiter::new(&config.name, limit, store.clone())));
        Self {
            rate,
            sink,
            config,
            gate,
            reported: std::sync::Mutex::new((BreakerState::Closed, false)),
            registered: std::sync::atomic::AtomicBool::new(false),
            health: std::sync::OnceLock::new(),
        }
    }

    /// The destination's name.
    pub(super) fn name(&self) -> &str {
        &self.config.name
    }

    /// The `destination` label of its series ([`crate::model::metric::RUNTIME_DESTINATIONS`]
    /// for a destination managed at runtime).
    pub(super) fn series(&self) -> &str {
        if self.config.runtime {
            crate::model::metric::RUNTIME_DESTINATIONS
        } else {
            self.name()
        }
    }

    /// Whether its row of the destinations table is known to be registered.
    pub(super) fn is_registered(&self) -> bool {
        self.registered.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Its row of the destinations table is registered as its definition has it.
    pub(super) fn registered(&self) {
        self.registered
            .store(true, std::sync::atomic::Ordering::Release);
    }

    /// Its retry policy.
    pub(super) fn retry(&self) -> &RetryPolicy {
        &self.config.retry
    }

    /// The lane's sink, built from its definition if it has none now ([`Lane::build`]).
    pub(super) fn sink(&self) -> Result<Arc<dyn Sink>, String> {
        let slot = match &self.sink {
            SinkSlot::Given(sink) => return Ok(Arc::clone(sink)),
            SinkSlot::Lazy(slot) => slot,
        };
        let mut slot = slot.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((sink, used)) = slot.as_mut() {
            *used = Instant::now();
            return Ok(Arc::clone(sink));
        }
        let sink = self.build()?;
        *slot = Some((Arc::clone(&sink), Instant::now()));
        Ok(sink)
    }

    /// The lane's sink if it has one now, else one built for a single use and not kept: a
    /// readiness check of ten thousand idle destinations does not leave ten thousand sinks
    /// behind until they are dropped as idle.
    fn sink_for_a_check(&self) -> Result<Arc<dyn Sink>, String> {
        let SinkSlot::Lazy(slot) = &self.sink else {
            return self.sink();
        };
        if let Some((sink, _)) = slot.lock().unwrap_or_else(PoisonError::into_inner).as_ref() {
            return Ok(Arc::clone(sink));
        }
        self.build()
    }

    /// A sink built from the definition. Building does no I/O and was checked when the
    /// definition was loaded; it fails only when something it reads from disk (a TLS file) went
    /// away since, and the error says so.
    fn build(&self) -> Result<Arc<dyn Sink>, String> {
        crate::sinks::build(&self.config)
            .map_err(|e| format!("cannot build the destination's sink again: {}", e.message))
    }

    /// Makes the sink's next request connect afresh: a sink not built now will anyway.
    pub(super) fn reconnect(&self) {
        match &self.sink {
            SinkSlot::Given(sink) => sink.reconnect(),
            SinkSlot::Lazy(slot) => {
                if let Some((sink, _)) =
                    slot.lock().unwrap_or_else(PoisonError::into_inner).as_ref()
                {
                    sink.reconnect();
                }
            }
        }
    }

    /// Drops the sink built from the definition if it has been idle for `idle` ([`drops`]);
    /// `true` when it did.
    pub(super) fn drop_idle(&self, idle: Duration) -> bool {
        let SinkSlot::Lazy(slot) = &self.sink else {
            return false;
        };
        let mut slot = slot.lock().unwrap_or_else(PoisonError::into_inner);
        let idle_now = slot
            .as_ref()
            .is_some_and(|(sink, used)| drops(used.elapsed(), Arc::strong_count(sink), idle));
        if idle_now {
            *slot = None;
        }
        idle_now
    }

    /// Whether the lane holds a sink now.
    #[cfg(test)]
    fn has_sink(&self) -> bool {
        match &self.sink {
            SinkSlot::Given(_) => true,
            SinkSlot::Lazy(slot) => slot
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .is_some(),
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

    /// Marks the lane's gate quiet if it has nothing to report, its gauges included (see
    /// [`Gate::hush`]): the destinations loop skips it until it is used again.
    pub(super) fn hush(&self) {
        let reported = *self
            .reported
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if reported == (BreakerState::Closed, false) {
            self.gate.hush();
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
        let mut last = self.health.get_or_init(Box::default).lock().await;
        if let Some((at, result)) = last.as_ref() {
            if at.elapsed() < HEALTH_TTL {
                return result.clone();
            }
        }
        let sink = match self.sink_for_a_check() {
            Ok(sink) => sink,
            Err(e) => return Some(e),
        };
        let result = match tokio::time::timeout(limit, sink.healthcheck()).await {
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
    /// The lanes of `destinations`, sinks built by the caller, the i-th taking the routing,
    /// ordering and breaker of `configs`' i-th, if any.
    pub(super) fn new(
        destinations: Vec<Destination>,
        configs: &[Arc<DestinationConfig>],
        store: &Store,
    ) -> Self {
        let lanes = destinations
            .into_iter()
            .enumerate()
            .map(|(d, destination)| {
                let concurrency = destination.sink.concurrency();
                Lane::new(
                    destination.name,
                    SinkSlot::Given(destination.sink),
                    concurrency,
                    destination.retry,
                    configs.get(d),
                    store,
                )
            })
            .collect();
        Self::of(lanes)
    }

    /// The lanes of `configs`, each building its sink from its definition when it has work; the
    /// i-th takes `concurrency[i]` requests at once (what [`crate::sinks::concurrencies`] read).
    pub(super) fn lazy(
        configs: &[Arc<DestinationConfig>],
        concurrency: &[Option<usize>],
        store: &Store,
    ) -> Self {
        let lanes = configs
            .iter()
            .zip(concurrency)
            .map(|(config, &concurrency)| {
                Lane::new(
                    config.name.clone(),
                    SinkSlot::lazy(),
                    concurrency,
                    config.retry.clone(),
                    Some(config),
                    store,
                )
            })
            .collect();
        Self::of(lanes)
    }

    fn of(lanes: Vec<Lane>) -> Self {
        let by_name = lanes
            .iter()
            .enumerate()
            .map(|(d, lane)| (lane.name().to_owned(), d))
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

    /// Whether each of `lanes` (a batch's) takes events now (not paused, breaker closed): each
    /// gate read once, not once per event, so that every event of a batch sees its destination
    /// the same; and only the gates the batch goes to, not every destination's.
    pub(super) fn open_of(
        &self,
        lanes: impl IntoIterator<Item = usize>,
    ) -> std::collections::HashMap<usize, bool> {
        let mut open = std::collections::HashMap::new();
        for lane in lanes {
            open.entry(lane)
                .or_insert_with(|| self.lanes[lane].gate.is_open());
        }
        open
    }

    /// The destinations whose dead events hold back their key (ordered, `on_dead = "block"`).
    pub(super) fn blocking(&self) -> Vec<String> {
        self.lanes
            .iter()
            .filter(|l| l.config.dead_blocks())
            .map(|l| l.name().to_owned())
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
        self.lanes[lane].name()
    }

    fn policy(&self, lane: usize) -> &RetryPolicy {
        self.lanes[lane].retry()
    }

    fn series<'a>(&'a self, destination: &'a str) -> &'a str {
        self.named(destination)
            .map_or(destination, |(_, lane)| lane.series())
    }

    fn keeps_order_of(&self, lane: usize, event: &OutboxEvent) -> bool {
        self.lanes[lane].keeps_order_of(event)
    }

    fn tripped_gates(&self) -> Vec<&Gate> {
        self.lanes
            .iter()
            .map(|l| &l.gate)
            .filter(|g| g.has_tripped())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_idle_sink_is_dropped_unless_a_publish_holds_it() {
        let idle = Duration::from_secs(300);
        // (since its last use, holders) → dropped
        let cases = [
            ((Duration::from_secs(299), 1), false),
            ((Duration::from_secs(300), 1), true),
            ((Duration::from_secs(3_600), 1), true),
            // A publish still holds it: a second client would be built beside it.
            ((Duration::from_secs(3_600), 2), false),
        ];
        for ((since, holders), expected) in cases {
            assert_eq!(drops(since, holders, idle), expected, "{since:?} {holders}");
        }
    }

    /// The configuration of one `null` destination `a`, and a store whose pool never connects.
    fn null_destination() -> (crate::config::Config, Store) {
        let config = crate::config::Config::parse(
            "[[destinations]]\nname = \"a\"\ntype = \"null\"\n",
            |_| None,
        )
        .expect("config");
        let pool = sqlx::postgres::PgPoolOptions::new()
            .connect_lazy("postgres://nobody@127.0.0.1:1/none")
            .expect("lazy pool");
        let store = Store::new(pool, config.table.clone());
        (config, store)
    }

    #[tokio::test]
    async fn a_lane_builds_its_sink_on_first_work_and_drops_it_when_idle() {
        let (config, store) = null_destination();
        let lanes = Lanes::lazy(&config.destinations, &[None], &store);
        let lane = &lanes[0];
        assert!(!lane.has_sink(), "no sink before the lane has work");
        let sink = lane.sink().expect("built");
        assert!(lane.has_sink());
        assert!(
            Arc::ptr_eq(&sink, &lane.sink().expect("kept")),
            "built once"
        );
        assert!(!lane.drop_idle(Duration::ZERO), "a publish holds it");
        drop(sink);
        assert!(!lane.drop_idle(Duration::from_secs(3_600)), "not idle yet");
        assert!(lane.drop_idle(Duration::ZERO));
        assert!(!lane.has_sink());
        assert!(lane.sink().is_ok(), "built again for the next work");
    }

    #[tokio::test]
    async fn a_destination_managed_at_runtime_is_labelled_with_the_others_of_its_kind() {
        let (config, store) = null_destination();
        let customer = Arc::new(DestinationConfig {
            name: "customer-1".into(),
            runtime: true,
            ..DestinationConfig::clone(&config.destinations[0])
        });
        let all = [Arc::clone(&config.destinations[0]), customer];
        let lanes = Lanes::lazy(&all, &[None, None], &store);
        use crate::settle::Lanes as _;
        assert_eq!(lanes.series("a"), "a");
        assert_eq!(
            lanes.series("customer-1"),
            crate::model::metric::RUNTIME_DESTINATIONS
        );
        assert_eq!(lanes.series("(unrouted)"), "(unrouted)", "no such lane");
    }

    #[tokio::test]
    async fn a_health_check_leaves_no_sink_behind_and_uses_the_one_there_is() {
        let (config, store) = null_destination();
        let lanes = Lanes::lazy(&config.destinations, &[None], &store);
        let lane = &lanes[0];
        assert_eq!(lane.health(Duration::from_secs(1)).await, None);
        assert!(!lane.has_sink(), "the checked sink is not kept");
        let sink = lane.sink().expect("built");
        let checked = lane.sink_for_a_check().expect("there is one");
        assert!(
            Arc::ptr_eq(&sink, &checked),
            "the lane's own sink is checked"
        );
    }
}
