//! The relay engine: claim → route → publish → settle, in a loop, on a few claim workers.
//!
//! Each worker claims a batch, routes every event to each destination that takes it (one *item*
//! per event and destination), publishes each destination's share concurrently within the batch's
//! `publish_timeout`, and settles the whole batch in a few statements: what finished, delivered or
//! failed; what was left unfinished, given back untouched; what a paused or failing destination
//! cannot take now, held ([`crate::breaker`]). An event with several destinations that did not
//! reach all of them is *split*: its row is settled and each undelivered pair goes on in the
//! deliveries table, which a deliveries loop claims and settles the same way. Database
//! errors (a PostgreSQL restart) are logged and retried with backoff; a bad event never stops the
//! relay: it is retried or dead-lettered, and a row that cannot be read is dead-lettered alone.

mod batch;
mod chains;
mod claimed;
mod pacing;
mod probe;
mod readiness;
mod report;
mod retries;
mod run;
mod settle_batch;
mod upkeep;
mod wal;

use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::Arc;
use std::time::Instant;

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use self::pacing::{base_window, initial_heads, INITIAL_FOLLOWERS};
pub use self::report::BatchReport;
use crate::breaker::Health;
use crate::config::{Config, Ordering, RelayConfig};
use crate::error::Result;
use crate::model::metric;
use crate::model::outcome::Outcome;
use crate::model::retry::RetryPolicy;
use crate::route::Router;
use crate::settle;
use crate::sinks::{self, Sink};
use crate::sources::poll::ClaimOptions;
use crate::store::Store;
use crate::table::OutboxTable;

/// A configured destination, ready to publish.
pub struct Destination {
    /// Its name.
    pub name: String,
    /// Its sink.
    pub sink: Arc<dyn Sink>,
    /// Its retry policy.
    pub retry: RetryPolicy,
}

/// The relay engine.
pub struct Relay {
    store: Store,
    table: OutboxTable,
    router: Router,
    destinations: Vec<Destination>,
    settings: RelayConfig,
    /// What a delivered event's row becomes.
    settle_mode: settle::SettleMode,
    config: Config,
    /// Cancelled when the shutdown grace period is over: in-flight batches are released.
    abort: CancellationToken,
    claim: ClaimOptions,
    /// Ordered mode: heads for the next claim, adapted after each batch.
    heads: AtomicUsize,
    /// Ordered mode: followers per head for the next claim, adapted after each batch.
    followers: AtomicUsize,
    /// Ordered mode: due rows the next claim's search for heads looks at; widened after a claim
    /// that found no head, back to its base after one that did.
    window: AtomicU64,
    /// When the window last changed or last served a claim (see [`WINDOW_PATIENCE`]).
    window_since: std::sync::Mutex<Instant>,
    /// Each destination's health (pause, breaker), by index like `destinations`.
    health: Vec<Arc<Health>>,
    /// Names of the destinations whose dead events hold back their key (ordered, `on_dead = "block"`).
    blocking: Vec<String>,
    /// Set when a claim worker died: `/healthz` reports it.
    failure: std::sync::Mutex<Option<String>>,
    /// The outcome given to events no destination takes (settle dead-letters them).
    unroutable: Outcome,
    /// Names of the destinations with `ordering = "key"`.
    ordered: Vec<String>,
    /// Held by the one quiet claim worker that polls for due rows; the other quiet workers wait
    /// on `wake`, so an idle relay costs one poll per `poll_interval` whatever `workers` is.
    idle_poller: tokio::sync::Mutex<()>,
    /// Wakes quiet claim workers: the poller found due rows, or a claim found some (more may
    /// follow, so every worker should claim).
    wake: tokio::sync::Notify,
}

impl Relay {
    /// Builds the relay and its sinks from the configuration.
    pub fn new(pool: PgPool, config: &Config) -> Result<Self> {
        let destinations = config
            .destinations
            .iter()
            .map(|d| {
                Ok(Destination {
                    name: d.name.clone(),
                    sink: sinks::build(d)?,
                    retry: d.retry.clone(),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self::with_destinations(pool, config, destinations))
    }

    /// Builds the relay around sinks made by the caller (embedding, demos, tests).
    pub fn with_destinations(
        pool: PgPool,
        config: &Config,
        destinations: Vec<Destination>,
    ) -> Self {
        // Counters that may never move still show up at zero, so dashboards and alerts see them.
        metrics::counter!(metric::DB_ERRORS_TOTAL).absolute(0);
        for d in &destinations {
            metrics::counter!(metric::SINK_RECONNECTS_TOTAL, "destination" => d.name.clone())
                .absolute(0);
            metrics::counter!(metric::HELD_TOTAL, "destination" => d.name.clone()).absolute(0);
        }
        let health = destinations
            .iter()
            .enumerate()
            .map(|(d, dest)| {
                let breaker = config
                    .destinations
                    .get(d)
                    .map(|c| c.breaker.clone())
                    .unwrap_or_default();
                Arc::new(Health::new(&dest.name, breaker))
            })
            .collect();
        Self {
            store: Store::new(pool, config.table.clone()),
            table: config.table.clone(),
            router: Router::new(&config.destinations),
            destinations,
            settings: config.relay.clone(),
            settle_mode: settle::SettleMode::of(config),
            config: config.clone(),
            abort: CancellationToken::new(),
            claim: ClaimOptions {
                mode: config.relay.claim,
                limit: config.relay.batch_size,
                lease: config.relay.lease(),
                ordered: config
                    .destinations
                    .iter()
                    .any(|d| d.ordering == Ordering::Key),
                heads: initial_heads(config.relay.batch_size),
                followers: INITIAL_FOLLOWERS,
                window: base_window(config.relay.batch_size),
            },
            heads: AtomicUsize::new(initial_heads(config.relay.batch_size)),
            followers: AtomicUsize::new(INITIAL_FOLLOWERS),
            window: AtomicU64::new(base_window(config.relay.batch_size)),
            window_since: std::sync::Mutex::new(Instant::now()),
            health,
            blocking: config
                .destinations
                .iter()
                .filter(|d| d.dead_blocks())
                .map(|d| d.name.clone())
                .collect(),
            failure: std::sync::Mutex::new(None),
            unroutable: Outcome::Rejected {
                reason: "unroutable".into(),
            },
            ordered: config
                .destinations
                .iter()
                .filter(|d| d.ordering == Ordering::Key)
                .map(|d| d.name.clone())
                .collect(),
            idle_poller: tokio::sync::Mutex::new(()),
            wake: tokio::sync::Notify::new(),
        }
    }

    /// Whether a destination of that name is configured.
    pub fn has_destination(&self, name: &str) -> bool {
        self.destinations.iter().any(|d| d.name == name)
    }

    /// The connection pool.
    pub fn pool(&self) -> &PgPool {
        self.store.pool()
    }

    /// The store: the database and its statements.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// The configuration the relay was built from.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Whether any destination orders its events by key.
    pub fn ordered(&self) -> bool {
        self.claim.ordered
    }

    /// The routing of topics to destinations.
    pub fn router(&self) -> &Router {
        &self.router
    }

    /// Whether the relay is alive: `Some(reason)` once a claim worker died.
    pub fn failure(&self) -> Option<String> {
        self.failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}
