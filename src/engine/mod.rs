//! The relay engine: sources → route → lanes (sinks) → settle → retries and dead letters → upkeep.
//!
//! A source hands the engine batches: claim workers claim due rows from the table
//! ([`crate::sources::poll`]), or one reader streams them from the WAL ([`crate::sources::wal`]). Each batch
//! is routed into *items*, one per (event, destination), and each destination's items go to its
//! *lane* ([`lane`]): its sink, behind its gate — pause, circuit breaker, and `concurrency` for the
//! whole process ([`crate::gate`]). Lanes publish side by side, each at its own pace. When they
//! all finish, the batch settles in a few statements ([`crate::settle`]). When one falls behind the
//! others, it is handed over: the batch settles without it, what it had not finished becoming that
//! pair's state in the deliveries table, and the claim loop goes on. Each lane's retry loop
//! claims its own due pairs from there, so a slow, paused, failing or ordered destination never
//! sets another's pace. The destinations loop keeps the lanes' shared state (pauses, breakers),
//! sums up failures and probes open breakers; upkeep cleans up.
//!
//! Database errors (a PostgreSQL restart) are logged and retried with backoff; a bad event never
//! stops the relay: it is retried or dead-lettered, and a row that cannot be read is dead-lettered
//! alone.

mod batch;
mod chains;
mod claimed;
mod drive;
mod items;
mod lane;
mod pacing;
mod probe;
mod readiness;
mod replays;
mod report;
mod retries;
mod run;
mod settle_batch;
mod upkeep;
mod wal;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use sqlx::PgPool;

pub use self::lane::Destination;
use self::lane::Lane;
use self::pacing::Sizing;
pub use self::report::BatchReport;
use crate::config::{Config, ConfigError, Ordering};
use crate::model::metric;
use crate::route::Router;
use crate::settle::SettleMode;
use crate::sinks::{self, Sink};
use crate::sources::poll::ClaimOptions;
use crate::sources::watermark::Watermark;
use crate::store::Store;
use std::sync::Arc;

/// The relay engine.
pub struct Relay {
    store: Store,
    config: Config,
    router: Router,
    /// One lane per configured destination, in configuration order.
    lanes: Vec<Lane>,
    /// What a delivered event's row becomes.
    settle_mode: SettleMode,
    /// How claims are made (transaction or lease, ordered or not).
    claim: ClaimOptions,
    /// Ordered mode: the next claim's heads, followers and window.
    sizing: Sizing,
    /// Names of the destinations whose dead events hold back their key (ordered, `on_dead = "block"`).
    blocking: Vec<String>,
    /// Cancelled when the shutdown grace period is over: in-flight batches are released.
    abort: CancellationToken,
    /// Cancelled when shutdown begins: lanes stop waiting for rate-limit tokens (what they had
    /// not sent is handed on) so that in-flight batches end within the grace period.
    stopping: CancellationToken,
    /// Set when a claim worker died: `/healthz` reports it.
    failure: std::sync::Mutex<Option<String>>,
    /// Held by the one quiet claim worker that polls for due rows; the other quiet workers wait
    /// on `wake`, so an idle relay costs one poll per `poll_interval` whatever `workers` is.
    idle_poller: tokio::sync::Mutex<()>,
    /// Wakes quiet claim workers: the poller found due rows, or a claim filled its batch (a
    /// backlog: every worker should claim).
    wake: Notify,
    /// Claim workers whose last claim found rows; while one is busy (and its batches are quick)
    /// the quiet ones do not poll (see [`pacing::quiet_worker_polls`]).
    busy_workers: std::sync::atomic::AtomicUsize,
    /// When the last claim of any worker started.
    claim_started: std::sync::Mutex<std::time::Instant>,
    /// When this relay last claimed or settled anything (readiness sees a stall by it).
    progress: readiness::Progress,
    /// Where claims start their walk of the due range (kept by [`Relay::watermark_loop`]).
    watermark: Watermark,
}

impl Relay {
    /// Builds the relay and its sinks (once each) from the configuration; a destination whose
    /// type or settings are wrong is a configuration error naming it.
    pub fn new(pool: PgPool, config: &Config) -> std::result::Result<Self, ConfigError> {
        Ok(Self::with_sinks(pool, config, sinks::build_all(config)?))
    }

    /// Builds the relay around the sinks [`sinks::build_all`] made for `config`, one per
    /// destination in order.
    pub fn with_sinks(pool: PgPool, config: &Config, sinks: Vec<Arc<dyn Sink>>) -> Self {
        let destinations = config
            .destinations
            .iter()
            .zip(sinks)
            .map(|(d, sink)| Destination {
                name: d.name.clone(),
                sink,
                retry: d.retry.clone(),
            })
            .collect();
        Self::with_destinations(pool, config, destinations)
    }

    /// Builds the relay around sinks made by the caller (embedding, demos, tests). The i-th
    /// destination takes the routing, ordering and breaker of the configuration's i-th, if any.
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
            metrics::counter!(metric::RATE_LIMIT_WAITS_TOTAL, "destination" => d.name.clone())
                .absolute(0);
            metrics::counter!(metric::REPLAYED_TOTAL, "destination" => d.name.clone()).absolute(0);
        }
        let store = Store::new(pool, config.table.clone());
        let lanes: Vec<Lane> = destinations
            .into_iter()
            .enumerate()
            .map(|(d, destination)| Lane::new(destination, config.destinations.get(d), &store))
            .collect();
        let settings = &config.relay;
        Self {
            store,
            router: Router::new(&config.destinations),
            settle_mode: SettleMode::of(config),
            claim: ClaimOptions {
                mode: settings.claim,
                limit: settings.batch_size,
                lease: settings.lease(),
                ordered: lanes.iter().any(|l| l.config.ordering == Ordering::Key),
                heads: 0,
                followers: 0,
                window: 0,
            },
            sizing: Sizing::new(settings.batch_size),
            blocking: lanes
                .iter()
                .filter(|l| l.config.dead_blocks())
                .map(|l| l.name.clone())
                .collect(),
            lanes,
            config: config.clone(),
            abort: CancellationToken::new(),
            stopping: CancellationToken::new(),
            failure: std::sync::Mutex::new(None),
            idle_poller: tokio::sync::Mutex::new(()),
            wake: Notify::new(),
            busy_workers: std::sync::atomic::AtomicUsize::new(0),
            claim_started: std::sync::Mutex::new(std::time::Instant::now()),
            progress: readiness::Progress::default(),
            watermark: Watermark::default(),
        }
    }

    /// Whether a destination of that name is configured.
    pub fn has_destination(&self, name: &str) -> bool {
        self.lanes.iter().any(|l| l.name == name)
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
