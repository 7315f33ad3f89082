//! The relay engine: sources → route → lanes (sinks) → settle → retries and dead letters → upkeep.
//!
//! A source hands the engine batches: claim workers claim due rows from the table
//! ([`crate::sources::poll`], [`claimer`]), or one reader streams them from the WAL
//! ([`crate::sources::wal`], [`wal`]). Either way a batch goes through one [`pipeline`]: routed
//! into *items*, one per (event, destination); each destination's items go to its *lane*
//! ([`lane`]): its sink, behind its gate — pause, circuit breaker, and `concurrency` for the whole
//! process ([`crate::sinks::gate`]). Lanes publish side by side, each at its own pace ([`publish`]).
//! When they all finish, each item is judged and the batch settles in a few statements
//! ([`crate::settle`]). When one lane lags behind the others ([`watch`]), it is handed over: the
//! batch settles without it, what it had not finished becoming that pair's state in the
//! deliveries table, and the claim loop goes on. The retry scheduler ([`retries`]) claims every
//! lane's due pairs from there, each lane its share, and runs them as a batch per lane, so a
//! slow, paused, failing or ordered destination never sets another's pace. The destinations loop ([`destinations`]) keeps the lanes' shared state
//! (pauses, breakers), sums up failures and probes open breakers; [`upkeep`] cleans up; the
//! replays loop ([`replays`]) feeds running replays into their lanes.
//!
//! Every loop and stage shares one [`context::Context`]; the [`Relay`] is the engine's face to
//! the library's users, and [`RelayView`] what the server sees of it.
//!
//! Database errors (a PostgreSQL restart) are logged and retried with backoff; a bad event never
//! stops the relay: it is retried or dead-lettered, and a row that cannot be read is dead-lettered
//! alone.

mod claimer;
mod context;
mod destinations;
mod lane;
mod pacing;
mod pipeline;
mod publish;
mod readiness;
mod replays;
mod retries;
mod run;
mod upkeep;
mod view;
mod wal;
mod watch;

use std::sync::Arc;

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use self::claimer::Claimers;
use self::context::Context;
use self::lane::Lanes;
use crate::config::{Config, ConfigError, DestinationConfig};
use crate::error::Result;
use crate::route::Router;
use crate::sinks::{self, Sink};
use crate::store::Store;

pub use self::lane::Destination;
pub use self::view::RelayView;
pub use crate::model::report::BatchReport;

/// The relay engine.
pub struct Relay {
    ctx: Arc<Context>,
    claimers: Arc<Claimers>,
}

impl Relay {
    /// Builds the relay from the configuration; a destination whose type or settings are wrong
    /// is a configuration error naming it. Each destination's sink is built when it first has
    /// work, and dropped when it has been idle for a while: with thousands of destinations an
    /// idle one costs its definition, not a client.
    pub fn new(pool: PgPool, config: &Config) -> std::result::Result<Self, ConfigError> {
        let concurrency = sinks::concurrencies(config)?;
        Ok(Self::lazy(pool, config, &concurrency))
    }

    /// [`Relay::new`] for a relay that takes over from `previous` (a reload): a destination whose
    /// definition `previous` runs (the same `Arc`: the file was not read again, the definition
    /// did not change) is not checked, nor registered, again. With 100,000 destinations, applying
    /// a change to one checks and registers one.
    pub fn following(
        pool: PgPool,
        config: &Config,
        previous: &Relay,
    ) -> std::result::Result<Self, ConfigError> {
        let known: std::collections::HashMap<*const DestinationConfig, (usize, bool)> = previous
            .ctx
            .lanes
            .iter()
            .map(|lane| {
                let known = (lane.gate.concurrency(), lane.is_registered());
                (Arc::as_ptr(&lane.config), known)
            })
            .collect();
        let concurrency = sinks::concurrencies_known(config, |d| {
            known.get(&Arc::as_ptr(d)).map(|&(c, _)| Some(c))
        })?;
        let relay = Self::lazy(pool, config, &concurrency);
        for lane in relay.ctx.lanes.iter() {
            if known
                .get(&Arc::as_ptr(&lane.config))
                .is_some_and(|&(_, registered)| registered)
            {
                lane.registered();
            }
        }
        Ok(relay)
    }

    fn lazy(pool: PgPool, config: &Config, concurrency: &[Option<usize>]) -> Self {
        let store = Store::new(pool, config.table.clone());
        let lanes = Lanes::lazy(&config.destinations, concurrency, &store);
        Self::of(store, config, lanes)
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
        let store = Store::new(pool, config.table.clone());
        let lanes = Lanes::new(destinations, &config.destinations, &store);
        Self::of(store, config, lanes)
    }

    fn of(store: Store, config: &Config, lanes: Lanes) -> Self {
        let ctx = Arc::new(Context::new(store, config, lanes));
        Self {
            claimers: Arc::new(Claimers::new(Arc::clone(&ctx))),
            ctx,
        }
    }

    /// Runs until `shutdown` is cancelled: the source (claim workers, or the WAL reader), the
    /// retry scheduler, and the maintenance loops (destination state and probes, upkeep,
    /// replays). In-flight batches then get `shutdown_grace` to finish; past it they settle what
    /// finished and release the rest. A worker that panics (a bug) stops the relay: the others
    /// finish as on shutdown, then this returns [`crate::Error::WorkerPanicked`].
    pub async fn run(self: Arc<Self>, shutdown: CancellationToken) -> Result<BatchReport> {
        run::run(Arc::clone(&self.ctx), Arc::clone(&self.claimers), shutdown).await
    }

    /// What [`Relay::run`] does before its first claim, alone: creates the backfills of new
    /// destinations, registers the destinations and reads their shared state, releases rows
    /// whose wait is over, and makes the history's next partitions (`history = "partitions"`). A
    /// database error is logged, not returned: the loops try again.
    pub async fn prepare(&self) {
        run::prepare(&self.ctx).await
    }

    /// Processes everything due now, then returns: for cron-style runs (`relay --once`).
    ///
    /// Destinations paused or with an open breaker keep their events held (no probe is sent).
    /// Events that fail are scheduled per their policy; one that comes due again within the run
    /// (a zero retry delay) is not retried in a loop: the run ends when a batch holds only such.
    pub async fn run_once(&self) -> Result<BatchReport> {
        run::run_once(&self.ctx, &self.claimers).await
    }

    /// Claims, publishes and settles one batch.
    pub async fn run_batch(&self) -> Result<BatchReport> {
        Ok(self.claimers.batch(claimer::Signals::none()).await?.report)
    }

    /// Claims, publishes and settles one batch of due pairs of every lane, one lane after the
    /// other (`relay --once`, tests).
    pub async fn run_pairs_batch(&self) -> Result<BatchReport> {
        retries::every_lane_once(&self.ctx).await
    }

    /// Readiness: the database answers (2 s), events move (not stalled), every sink passes its
    /// healthcheck (2 s each, its result kept for a few seconds) and no breaker is open. One
    /// line per check; `Err` when any failed.
    pub async fn readiness(&self) -> std::result::Result<Vec<String>, Vec<String>> {
        self.ctx.readiness_of(None).await
    }

    /// Readiness of the database and one destination (`Some(name)`), or of every destination.
    /// `Err` with one line when no destination has that name.
    pub async fn readiness_of(
        &self,
        only: Option<&str>,
    ) -> std::result::Result<Vec<String>, Vec<String>> {
        self.ctx.readiness_of(only).await
    }

    /// Whether this relay is stalled, also set as `pgoutbox_relay_stalled`: polling, events due
    /// longer than `relay.stall_after` and nothing claimed or settled for as long; reading the
    /// WAL, events read that long ago and the slot's confirmed position not moved since.
    pub async fn stall(&self) -> Result<Option<String>> {
        self.ctx.stall().await
    }

    /// What the server sees of this relay.
    pub fn view(&self) -> RelayView {
        RelayView::of(Arc::clone(&self.ctx))
    }

    /// Whether a destination of that name is configured.
    pub fn has_destination(&self, name: &str) -> bool {
        self.ctx.lanes.named(name).is_some()
    }

    /// The connection pool.
    pub fn pool(&self) -> &PgPool {
        self.ctx.store.pool()
    }

    /// The store: the database and its statements.
    pub fn store(&self) -> &Store {
        &self.ctx.store
    }

    /// The configuration the relay was built from.
    pub fn config(&self) -> &Config {
        &self.ctx.config
    }

    /// Whether any destination orders its events by key.
    pub fn ordered(&self) -> bool {
        self.ctx.claim.ordered
    }

    /// The routing of topics to destinations.
    pub fn router(&self) -> &Router {
        &self.ctx.router
    }

    /// Whether the relay is alive: `Some(reason)` once a claim worker died.
    pub fn failure(&self) -> Option<String> {
        self.ctx.failure()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_relay_that_takes_over_registers_only_the_destinations_whose_definition_changed() {
        let config = Config::parse(
            "[[destinations]]\nname = \"kept\"\ntype = \"null\"\n\
             [[destinations]]\nname = \"changed\"\ntype = \"null\"\n",
            |_| None,
        )
        .expect("config");
        let pool = sqlx::postgres::PgPoolOptions::new()
            .connect_lazy("postgres://nobody@127.0.0.1:1/none")
            .expect("lazy pool");
        let first = Relay::lazy(pool.clone(), &config, &[None, None]);
        for lane in first.ctx.lanes.iter() {
            lane.registered();
        }
        let mut next = config.clone();
        next.destinations[1] = Arc::new(DestinationConfig::clone(&config.destinations[1]));
        let second = Relay::following(pool, &next, &first).expect("relay");
        let registered: Vec<bool> = second.ctx.lanes.iter().map(|l| l.is_registered()).collect();
        assert_eq!(
            registered,
            [true, false],
            "only the changed one registers again"
        );
    }
}
