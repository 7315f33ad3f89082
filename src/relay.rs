//! The relay: claim → route → publish → settle, in a loop, on a few claim workers.
//!
//! Each worker claims a batch, routes every event to each destination that takes it (one *item*
//! per event and destination), publishes each destination's share concurrently within the batch's
//! `publish_timeout`, and settles the whole batch in a few statements: what finished, delivered or
//! failed; what was left unfinished, given back untouched; what a paused or failing destination
//! cannot take now, held ([`crate::destination`]). An event with several destinations that did not
//! reach all of them is *split*: its row is settled and each undelivered pair goes on in the
//! deliveries table, which a deliveries loop claims and settles the same way. Database
//! errors (a PostgreSQL restart) are logged and retried with backoff; a bad event never stops the
//! relay: it is retried or dead-lettered, and a row that cannot be read is dead-lettered alone.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering as AtomicOrdering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use futures::future::join_all;
use futures::FutureExt;
use opentelemetry::KeyValue;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};
use uuid::Uuid;

use crate::claim::{claim_due, ClaimOptions, ClaimedBatch, Hold};
use crate::config::{Config, OnDead, Ordering, RelayConfig, Source};
use crate::destination::{self, BreakerState, Counted, Gate, Health};
use crate::error::{Error, Result};
use crate::model::event::OutboxEvent;
use crate::model::metric;
use crate::model::outcome::Outcome;
use crate::model::retry::RetryPolicy;
use crate::publish::{self, Budget, Recorder, Sink};
use crate::route::Router;
use crate::settle;
use crate::store::{deliveries, destinations, outbox, waiting, Store};
use crate::table::OutboxTable;

/// Ordered mode: followers per head of the first claim (adapted from then on).
const INITIAL_FOLLOWERS: usize = 7;

/// Ordered mode: heads of the first claim, so that they and their followers fill a batch.
fn initial_heads(batch_size: usize) -> usize {
    (batch_size / (1 + INITIAL_FOLLOWERS)).max(1)
}

/// How long ordered claims may find no head before the window widens: other relays' batches
/// usually end well within it, freeing their keys near the front.
const WINDOW_PATIENCE: Duration = Duration::from_secs(1);

/// The heads window an ordered claim starts from (see [`ClaimOptions::window`]).
fn base_window(batch_size: usize) -> u64 {
    (batch_size as u64).saturating_mul(crate::claim::WINDOW_PER_BATCH_ROW)
}

/// How often a batch looks whether only stragglers are left (see [`Relay::process_batch`]).
const STRAGGLER_CHECK: Duration = Duration::from_millis(50);

/// How long a batch's last outcome must be past before its unfinished events count as stragglers.
const STRAGGLER_PATIENCE: Duration = Duration::from_millis(200);

/// Longest pause between retries while the database is unreachable.
const MAX_DB_BACKOFF: Duration = Duration::from_secs(5);

/// The deliveries loop's longest idle wait (or `poll_interval` if longer). Its rows are retries
/// and held pairs, due after a backoff of seconds, so it need not poll as often as the claim loops
/// that carry fresh events.
const DELIVERIES_POLL_INTERVAL: Duration = Duration::from_millis(250);

/// How long a claim loop waits before its next claim.
///
/// Busy: at once. The claim is an index range scan that finds nothing quickly, so this costs little
/// and keeps latency at milliseconds. Idle: exponentially longer up to `poll_interval`, so an idle
/// relay costs a few cheap queries per second and no measurable CPU. After a database error:
/// exponentially longer up to [`MAX_DB_BACKOFF`].
struct Pacing {
    min: Duration,
    max: Duration,
    idle: Duration,
    backoff: Duration,
}

impl Pacing {
    const FIRST_BACKOFF: Duration = Duration::from_millis(100);

    fn new(settings: &RelayConfig) -> Self {
        Self {
            min: settings.min_poll_interval,
            max: settings.poll_interval,
            idle: settings.min_poll_interval,
            backoff: Self::FIRST_BACKOFF,
        }
    }

    /// A claim found work: look again at once.
    fn busy(&mut self) {
        self.idle = self.min;
        self.backoff = Self::FIRST_BACKOFF;
    }

    /// A claim found nothing: the pause before the next one.
    fn idle(&mut self) -> Duration {
        self.backoff = Self::FIRST_BACKOFF;
        let pause = self.idle;
        self.idle = (self.idle * 2).min(self.max);
        pause
    }

    /// A claim or settle failed on the database: the pause before trying again.
    fn failed(&mut self) -> Duration {
        let pause = self.backoff;
        self.backoff = (self.backoff * 2).min(MAX_DB_BACKOFF);
        pause
    }
}

/// A loop's statement succeeded: if the database was down, say it is back. `worker` is the claim
/// worker, `None` for the deliveries loop (whichever loop met the outage says when it is over).
fn db_reachable(worker: Option<usize>, db_down: &mut bool) {
    if std::mem::take(db_down) {
        match worker {
            Some(worker) => info!(worker, "database reachable again, relaying"),
            None => info!("database reachable again, relaying deliveries"),
        }
    }
}

/// A configured destination, ready to publish.
pub struct Destination {
    /// Its name.
    pub name: String,
    /// Its sink.
    pub sink: Arc<dyn Sink>,
    /// Its retry policy.
    pub retry: RetryPolicy,
}

/// Counts for one batch, or summed over many.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct BatchReport {
    /// Events claimed.
    pub claimed: usize,
    /// Events delivered and settled.
    pub delivered: usize,
    /// Events scheduled for another attempt.
    pub retried: usize,
    /// Events dead-lettered.
    pub dead: usize,
    /// Events held for a paused or failing destination (no attempt counted).
    pub held: usize,
    /// Settles refused because another relay took the lease over (lease mode).
    pub fenced: u64,
    /// Events given back unpublished because the shutdown grace period ran out.
    pub released: usize,
}

impl std::ops::AddAssign for BatchReport {
    fn add_assign(&mut self, o: Self) {
        self.claimed += o.claimed;
        self.delivered += o.delivered;
        self.retried += o.retried;
        self.dead += o.dead;
        self.held += o.held;
        self.fenced += o.fenced;
        self.released += o.released;
    }
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
                    sink: publish::build(d)?,
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

    /// Readiness: the database answers (2 s), every sink passes its healthcheck (2 s each) and no
    /// breaker is open. One line per check; `Err` when any failed.
    pub async fn readiness(&self) -> std::result::Result<Vec<String>, Vec<String>> {
        self.readiness_of(None).await
    }

    /// Readiness of the database and one destination (`Some(name)`), or of every destination.
    /// `Err` with one line when no destination has that name.
    pub async fn readiness_of(
        &self,
        only: Option<&str>,
    ) -> std::result::Result<Vec<String>, Vec<String>> {
        if let Some(name) = only.filter(|name| !self.has_destination(name)) {
            return Err(vec![format!("no destination is named {name:?}\n")]);
        }
        let limit = Duration::from_secs(2);
        let mut lines = Vec::new();
        let mut ready = true;
        let db = tokio::time::timeout(limit, self.store.ping()).await;
        let line = match db {
            Ok(Ok(_)) => "ok".to_owned(),
            Ok(Err(e)) => format!("not ready: {}", crate::error_chain(&e)),
            Err(_) => "not ready: no answer within 2 s".into(),
        };
        ready &= line == "ok";
        lines.push(format!("database: {line}\n"));
        for (dest, health) in self.destinations.iter().zip(&self.health) {
            if only.is_some_and(|name| name != dest.name) {
                continue;
            }
            let check = match tokio::time::timeout(limit, dest.sink.healthcheck()).await {
                Ok(Ok(())) => None,
                Ok(Err(e)) => Some(e),
                Err(_) => Some("no answer within 2 s".into()),
            };
            let (breaker, paused) = health.state();
            let line = match (health.problem(), check) {
                // A pause is an operator's decision, not a fault.
                (Some(p), None) if paused => p,
                (Some(p), _) => {
                    ready = false;
                    format!("not ready: {p}")
                }
                (None, Some(e)) => {
                    ready = false;
                    format!("not ready: {e}")
                }
                (None, None) => format!("ok (breaker {breaker})"),
            };
            lines.push(format!("destination {}: {line}\n", dest.name));
        }
        if ready {
            Ok(lines)
        } else {
            Err(lines)
        }
    }

    /// Ordered mode: sizes the next claim from what this one found, asked with `asked` (heads,
    /// followers per head).
    ///
    /// Keys to spare (every head asked for was found): follow each key only as deep as keys go, and
    /// take as many heads as then fill a batch; shallow keys → up to `batch_size` heads, deep keys →
    /// fewer heads, a few events each. Few free keys (other relays hold the rest, or there are few
    /// keys): follow each one deeper to fill the batch. Many heads with few followers each keeps a
    /// batch on few table pages and leaves keys for the other relays.
    ///
    /// No head found: the window's rows are all held by other relays (a short wait frees them) or
    /// wait behind failing events of their keys. Once that has lasted [`WINDOW_PATIENCE`], each
    /// empty claim widens the window fourfold, up to the whole due range, so keys further on are
    /// reached; each claim that finds heads narrows it by a quarter, down to its base.
    fn adapt_claim(&self, found: Option<(i64, i64)>, asked: (usize, usize)) {
        let batch = self.settings.batch_size;
        let base = base_window(batch);
        let Some((heads_found, followers_found)) = found.filter(|(heads, _)| *heads > 0) else {
            let mut since = self.window_since.lock().unwrap_or_else(|e| e.into_inner());
            if since.elapsed() >= WINDOW_PATIENCE {
                let wider = self
                    .window
                    .load(AtomicOrdering::Relaxed)
                    .saturating_mul(4)
                    .min(crate::claim::WINDOW_UNBOUNDED_FROM);
                self.window.store(wider, AtomicOrdering::Relaxed);
                *since = Instant::now();
            }
            return;
        };
        let window = self.window.load(AtomicOrdering::Relaxed);
        if window > base {
            // Slowly: a window widened past a long run of held-back rows is still needed.
            self.window
                .store((window - window / 4).max(base), AtomicOrdering::Relaxed);
        }
        *self.window_since.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();

        let (heads_found, followers_found) = (heads_found as usize, followers_found as usize);
        let scarce = heads_found < asked.0;
        let followers = if scarce {
            batch.div_ceil(heads_found).saturating_sub(1)
        } else {
            followers_found.div_ceil(heads_found)
        }
        .min(crate::claim::FOLLOWERS_PER_KEY);
        // At least a few heads, so that keys that show up later are found.
        let heads = (batch / (1 + followers)).clamp(8.min(batch), batch);
        // With keys to spare, followers beyond what the batch carries would be locked and then
        // left unpublished.
        let followers = if scarce {
            followers
        } else {
            followers.min((batch / heads).saturating_sub(1))
        };
        self.heads.store(heads, AtomicOrdering::Relaxed);
        self.followers.store(followers, AtomicOrdering::Relaxed);
    }

    /// Claims, publishes and settles one batch.
    pub async fn run_batch(&self) -> Result<BatchReport> {
        Ok(self.process_batch(None).await?.0)
    }

    /// WAL source: publishes and settles one batch read from the slot ([`crate::wal`]).
    ///
    /// Routed and published like a claimed batch, within `publish_timeout`; then settled so that
    /// nothing of it needs the slot again: delivered rows are marked published (or deleted), and
    /// every (event, destination) that was not delivered (failed, held, unanswered, waiting behind
    /// its key) becomes a deliveries pair that the deliveries loop retries. `emit()` events have
    /// no row: the ones that were not delivered everywhere get one first, in the settle's
    /// transaction, so that their pairs and dead letters have the row the deliveries table and
    /// the console expect; delivered ones cost no write at all. A database error is returned: the
    /// batch stays unconfirmed, and the WAL source ends its session so that it is read again (and
    /// published again) once the database answers. Retrying the settle while holding the stream
    /// would be worse: a PostgreSQL shutdown waits for the stream's client to confirm the last
    /// position, and would wait forever for a relay that cannot reach it.
    pub async fn process_wal_batch(
        self: Arc<Self>,
        batch: crate::wal::WalBatch,
        settled: tokio::sync::oneshot::Sender<Result<(BatchReport, settle::DeliveredRows)>>,
    ) {
        let crate::wal::WalBatch {
            events,
            poison,
            rowless,
        } = batch;
        let deadline = tokio::time::Instant::now() + self.settings.publish_timeout;
        metrics::histogram!(metric::BATCH_SIZE).record((events.len() + poison.len()) as f64);
        let items = match self.items(&events).await {
            Ok(items) => items,
            Err(e) => {
                let _ = settled.send(Err(e));
                return;
            }
        };
        let run = BatchRun::new(&events, &items, &self.destinations, deadline);
        let mut aborted = false;
        // Once settled early: the items that had no outcome then.
        let mut straggling: Option<Vec<usize>> = None;
        let mut settled = Some(settled);
        {
            let publish = tokio::time::timeout_at(deadline, self.publish_chains(&run));
            tokio::pin!(publish);
            let mut last_progress = (run.finished(), tokio::time::Instant::now());
            loop {
                tokio::select! {
                    _ = &mut publish => break,
                    _ = self.abort.cancelled() => {
                        aborted = true;
                        break;
                    }
                    _ = tokio::time::sleep(STRAGGLER_CHECK), if straggling.is_none() => {
                        // Only stragglers left (a stalled request, a slow answer): settle the
                        // rest now, so that the slot moves on; see `settle_wal`.
                        let most = (items.routes.len() / 4).max(1);
                        let Some(stragglers) = run.only_stragglers(&mut last_progress, most) else {
                            continue;
                        };
                        let linger = deadline
                            .saturating_duration_since(tokio::time::Instant::now())
                            + Duration::from_secs(1);
                        let snapshot = run.snapshot();
                        let result = self
                            .settle_wal(&events, &items, &snapshot, &poison, &rowless, false, linger)
                            .await;
                        let failed = result.is_err();
                        if let Some(settled) = settled.take() {
                            let _ = settled.send(result);
                        }
                        if failed {
                            return;
                        }
                        debug!(stragglers = stragglers.len(), "WAL batch settled but for its stragglers; the slot moves on");
                        // The loop now only waits for the stragglers.
                        straggling = Some(
                            (0..snapshot.len()).filter(|&i| snapshot[i].is_none()).collect(),
                        );
                    }
                }
            }
        }
        let Some(settled) = settled else {
            let outcomes = run.finish(true, self.settings.publish_timeout);
            let late = straggling.unwrap_or_default();
            return self
                .finish_stragglers(&late, &outcomes, &events, &items)
                .await;
        };
        let outcomes = run.finish(aborted, self.settings.publish_timeout);
        let result = self
            .settle_wal(
                &events,
                &items,
                &outcomes,
                &poison,
                &rowless,
                aborted,
                Duration::ZERO,
            )
            .await;
        let _ = settled.send(result);
    }

    /// WAL source: deletes (or marks published) the rows that settled WAL batches delivered
    /// everywhere, several batches' at once (the processor confirms their positions after).
    pub async fn write_wal_rows(&self, rows: &settle::DeliveredRows) -> Result<u64> {
        let started = Instant::now();
        let written = settle::write_delivered(&self.store, rows, self.settle_mode).await?;
        metrics::histogram!(metric::SETTLE_SECONDS).record(started.elapsed().as_secs_f64());
        Ok(written)
    }

    /// WAL source: once the stragglers of a batch settled without them are over (their pairs were
    /// written due only after the batch's publish deadline), each one delivered
    /// after all has its pair deleted, so it is not sent again. One that failed, or that was never
    /// published (a later event of a straggler's ordered key), is retried from its pair.
    async fn finish_stragglers(
        &self,
        late: &[usize],
        outcomes: &[Option<Outcome>],
        events: &[OutboxEvent],
        items: &Items,
    ) {
        let delivered: Vec<(Uuid, &str)> = late
            .iter()
            .filter_map(|&i| match (items.routes[i], &outcomes[i]) {
                (Route::Send(d), Some(Outcome::Delivered)) => Some((
                    events[items.owner[i]].id,
                    self.destinations[d].name.as_str(),
                )),
                _ => None,
            })
            .collect();
        if delivered.is_empty() {
            return;
        }
        // Only pairs still due later exist for these (event, destination)s: the ones just written.
        let ids: Vec<Uuid> = delivered.iter().map(|(id, _)| *id).collect();
        let names: Vec<&str> = delivered.iter().map(|(_, d)| *d).collect();
        let done = match self.store.pool().acquire().await {
            Ok(mut conn) => deliveries::delete(&self.store, &mut conn, (&ids, &names), None).await,
            Err(e) => Err(e.into()),
        };
        if let Err(e) = done {
            // The pairs stay: delivered again when due (at least once).
            warn!(error = %crate::error_chain(&e), "cannot record late deliveries of a WAL batch; they will be sent again");
        }
    }

    /// WAL source: settles a published batch (see [`Relay::process_wal_batch`]). Items with no
    /// outcome become pairs due after `linger` (the stragglers of a batch settled early, whose
    /// requests are still out).
    #[allow(clippy::too_many_arguments)]
    async fn settle_wal(
        &self,
        events: &[OutboxEvent],
        items: &Items,
        outcomes: &[Option<Outcome>],
        poison: &[(Uuid, String)],
        rowless: &HashSet<Uuid>,
        aborted: bool,
        linger: Duration,
    ) -> Result<(BatchReport, settle::DeliveredRows)> {
        let delivered_everywhere = |e: usize| {
            items.spans[e].clone().all(|i| {
                matches!(
                    (items.routes[i], &outcomes[i]),
                    (Route::Send(_), Some(Outcome::Delivered))
                )
            })
        };
        let (done, unfinished): (Vec<usize>, Vec<usize>) = (0..events.len())
            .filter(|&e| rowless.contains(&events[e].id))
            .partition(|&e| delivered_everywhere(e));
        let no_row: HashSet<Uuid> = done.iter().map(|&e| events[e].id).collect();
        let materialize: Vec<&OutboxEvent> = unfinished.iter().map(|&e| &events[e]).collect();
        // Materialized rows are settled in the transaction that wrote them; otherwise the settle
        // opens one only if it has something to write besides the delivered rows.
        let hold = if materialize.is_empty() {
            Hold::Nothing
        } else {
            let mut tx = self.store.pool().begin().await?;
            outbox::wal_materialize(&self.store, &mut tx, &materialize).await?;
            Hold::Transaction(tx)
        };
        let linger = (!linger.is_zero()).then_some(linger);
        let mut wal = WalSettle {
            rowless: no_row,
            rows: settle::DeliveredRows::default(),
            linger,
        };
        let (report, _) = self
            .settle_part(
                events,
                items,
                outcomes,
                &|_| true,
                (poison, &[]),
                hold,
                None,
                aborted,
                Some(&mut wal),
            )
            .await?;
        Ok((report, wal.rows))
    }

    /// Where an item for destination `d` goes now: sent, or held while `d` is paused or open.
    fn gate(&self, d: usize) -> Route {
        match self.health[d].gate() {
            Gate::Send => Route::Send(d),
            Gate::Hold => Route::Hold(d),
        }
    }

    /// The batch's items: one per event and destination that takes it (one `Unroutable` item for
    /// an event none takes). With ordered destinations, an item whose key still has an undelivered
    /// pair for its destination waits behind it (DeliveriesKeysWaiting).
    async fn items(&self, events: &[OutboxEvent]) -> Result<Items> {
        let mut items = Items::default();
        for (e, targets) in self.router.route_all(events).into_iter().enumerate() {
            let start = items.routes.len();
            if targets.is_empty() {
                items.owner.push(e);
                items.routes.push(Route::Unroutable);
            }
            for d in targets {
                items.owner.push(e);
                items.routes.push(self.gate(d));
            }
            items.spans.push(start..items.routes.len());
        }
        if !self.ordered.is_empty() {
            let keyed: Vec<(usize, usize, &str)> = (0..items.routes.len())
                .filter_map(
                    |i| match (items.routes[i], events[items.owner[i]].key.as_deref()) {
                        (Route::Send(d), Some(key))
                            if self.config.destinations[d].ordering == Ordering::Key =>
                        {
                            Some((i, d, key))
                        }
                        _ => None,
                    },
                )
                .collect();
            if !keyed.is_empty() {
                let names: Vec<&str> = keyed
                    .iter()
                    .map(|(_, d, _)| self.destinations[*d].name.as_str())
                    .collect();
                let keys: Vec<&str> = keyed.iter().map(|(_, _, k)| *k).collect();
                let waiting =
                    deliveries::keys_waiting(&self.store, (&names, &keys), &self.blocking).await?;
                if !waiting.is_empty() {
                    let waiting: HashSet<(&str, &str)> = waiting
                        .iter()
                        .map(|(d, k)| (d.as_str(), k.as_str()))
                        .collect();
                    for (i, d, key) in keyed {
                        if waiting.contains(&(self.destinations[d].name.as_str(), key)) {
                            items.routes[i] = Route::Defer(d);
                        }
                    }
                }
            }
        }
        Ok(items)
    }

    /// One batch; also returns the ids scheduled for another attempt.
    ///
    /// Everything the claim holds is bounded by `publish_timeout` from the claim: each
    /// destination's share publishes within that budget, recording each event's outcome as it
    /// comes; at the deadline the relay stops waiting, settles what finished and gives the rest
    /// back untouched (no attempt counted), so an event a destination accepted is never marked
    /// failed and sent again because a slower one in its batch ran out of time.
    ///
    /// With `detach`, a batch whose events have all finished but a few stragglers settles what
    /// finished at once, moves the stragglers under a lease, and signals `detach`, so that the
    /// worker claims its next batch while this one waits for them: a stalled request holds back
    /// only its own event (and, ordered, its own key).
    async fn process_batch(
        &self,
        detach: Option<tokio::sync::oneshot::Sender<()>>,
    ) -> Result<(BatchReport, Vec<Uuid>)> {
        let claim_started = Instant::now();
        let claim_wall = std::time::SystemTime::now();
        let deadline = tokio::time::Instant::now() + self.settings.publish_timeout;
        let options = ClaimOptions {
            heads: self.heads.load(AtomicOrdering::Relaxed),
            followers: self.followers.load(AtomicOrdering::Relaxed),
            window: self.window.load(AtomicOrdering::Relaxed),
            ..self.claim
        };
        let ClaimedBatch {
            events,
            poison,
            held_back,
            hold,
            found,
        } = claim_due(&self.store, &options, &self.blocking).await?;
        metrics::histogram!(metric::CLAIM_SECONDS).record(claim_started.elapsed().as_secs_f64());
        if self.claim.ordered {
            self.adapt_claim(found, (options.heads, options.followers));
        }
        if events.is_empty() && poison.is_empty() {
            crate::claim::release(&self.store, hold, &held_back).await?;
            return Ok((BatchReport::default(), Vec::new()));
        }
        metrics::histogram!(metric::BATCH_SIZE).record((events.len() + poison.len()) as f64);
        crate::otlp::batch_span("claim", claim_wall, || {
            vec![
                KeyValue::new("pgoutbox.events", events.len() as i64),
                KeyValue::new("pgoutbox.poison", poison.len() as i64),
                KeyValue::new("pgoutbox.table", self.table.to_string()),
            ]
        });
        let items = match self.items(&events).await {
            Ok(items) => items,
            Err(e) => {
                crate::claim::release(&self.store, hold, &held_back).await?;
                return Err(e);
            }
        };

        let run = BatchRun::new(&events, &items, &self.destinations, deadline);
        let mut detach = detach;
        let mut last_progress = (run.finished(), tokio::time::Instant::now());
        let mut early: Option<(BatchReport, Vec<Uuid>, Uuid, HashSet<usize>)> = None;
        let mut hold = Some(hold);
        let aborted = {
            let publish = tokio::time::timeout_at(deadline, self.publish_chains(&run));
            tokio::pin!(publish);
            loop {
                tokio::select! {
                    _ = &mut publish => break false,
                    _ = self.abort.cancelled() => break true,
                    _ = tokio::time::sleep(STRAGGLER_CHECK), if detach.is_some() => {
                        let most = (events.len() / 20).max(1);
                        let Some(stragglers) = run.only_stragglers(&mut last_progress, most) else {
                            continue;
                        };
                        // Settle what finished now; the stragglers go on under a lease.
                        let Some(claim_hold) = hold.take() else {
                            continue;
                        };
                        let token = match &claim_hold {
                            Hold::Lease(token) => *token,
                            // A claimed batch is never unheld; a new token as for a transaction.
                            Hold::Transaction(_) | Hold::Nothing => Uuid::new_v4(),
                        };
                        // Settled per event: an event waits for all its items.
                        let straggling: HashSet<usize> =
                            stragglers.iter().map(|&i| items.owner[i]).collect();
                        let snapshot = run.snapshot();
                        let lease = (
                            straggling.iter().map(|&e| events[e].id).collect::<Vec<_>>(),
                            token,
                            deadline.saturating_duration_since(tokio::time::Instant::now())
                                + self.settings.publish_timeout,
                        );
                        let (report, retried) = self
                            .settle_part(
                                &events,
                                &items,
                                &snapshot,
                                &|i| !straggling.contains(&i),
                                (&poison, &held_back),
                                claim_hold,
                                Some(lease),
                                false,
                                None,
                            )
                            .await?;
                        debug!(stragglers = stragglers.len(), "batch settled but for its stragglers; the worker goes on");
                        early = Some((report, retried, token, straggling));
                        if let Some(signal) = detach.take() {
                            let _ = signal.send(());
                        }
                        break tokio::select! {
                            _ = &mut publish => false,
                            _ = self.abort.cancelled() => true,
                        };
                    }
                }
            }
        };
        let outcomes = run.finish(aborted, self.settings.publish_timeout);
        match (early, hold) {
            (None, Some(hold)) => {
                self.settle_part(
                    &events,
                    &items,
                    &outcomes,
                    &|_| true,
                    (&poison, &held_back),
                    hold,
                    None,
                    aborted,
                    None,
                )
                .await
            }
            (None, None) => Ok((BatchReport::default(), Vec::new())),
            (Some((mut report, mut retried, token, straggling)), _) => {
                let (late, late_retried) = self
                    .settle_part(
                        &events,
                        &items,
                        &outcomes,
                        &|i| straggling.contains(&i),
                        (&[], &[]),
                        Hold::Lease(token),
                        None,
                        aborted,
                        None,
                    )
                    .await?;
                report += late;
                retried.extend(late_retried);
                Ok((report, retried))
            }
        }
    }

    /// Settles the events of a batch that `include` selects (by event index), given their items'
    /// outcomes, under `hold`; with `lease_rest`, first moves those ids under a lease (token,
    /// length) so that they can be settled later, fenced by the token. `extra`: the claim's poison
    /// rows and held-back rows (given to one settle only).
    #[allow(clippy::too_many_arguments)]
    async fn settle_part(
        &self,
        events: &[OutboxEvent],
        items: &Items,
        outcomes: &[Option<Outcome>],
        include: &(dyn Fn(usize) -> bool + Sync),
        extra: (&[(Uuid, String)], &[Uuid]),
        hold: Hold,
        lease_rest: Option<(Vec<Uuid>, Uuid, Duration)>,
        aborted: bool,
        mut wal: Option<&mut WalSettle>,
    ) -> Result<(BatchReport, Vec<Uuid>)> {
        let (poison, held_back) = extra;
        let started = Instant::now();
        let now = chrono::Utc::now();
        let mut tripped: Vec<(usize, String)> = Vec::new();
        let mut attempted = Vec::new();
        let mut held: Vec<(usize, usize, Option<String>)> = Vec::new();
        let mut untouched: Vec<Uuid> = Vec::new();
        let mut split: Vec<usize> = Vec::new();
        for (e, event) in events.iter().enumerate() {
            if !include(e) {
                continue;
            }
            let span = items.spans[e].clone();
            // WAL: anything but a delivery of a routed event goes on as a pair.
            let wal_split = wal.is_some()
                && !matches!(
                    (items.routes[span.start], &outcomes[span.start]),
                    (Route::Unroutable, _) | (Route::Send(_), Some(Outcome::Delivered))
                );
            if items.is_split(e) || wal_split {
                let mut sends = span.filter(|&i| matches!(items.routes[i], Route::Send(_)));
                // From the WAL nothing is given back: the slot moves past it.
                if wal.is_none()
                    && sends.clone().next().is_some()
                    && sends.all(|i| outcomes[i].is_none())
                {
                    // Not one destination answered before the batch's time ran out: as it was.
                    untouched.push(event.id);
                } else {
                    split.push(e);
                }
                continue;
            }
            let i = span.start;
            match (items.routes[i], &outcomes[i]) {
                (Route::Unroutable, _) => attempted.push((event, None, &self.unroutable)),
                (Route::Hold(d), _) => held.push((e, d, None)),
                (Route::Send(_) | Route::Defer(_), None) => untouched.push(event.id),
                (Route::Send(d) | Route::Defer(d), Some(outcome)) => {
                    match self.count(d, outcome, &mut tripped) {
                        Counted::Held => held.push((e, d, retry_reason(outcome))),
                        _ => {
                            let dest = &self.destinations[d];
                            attempted.push((
                                event,
                                Some((dest.name.as_str(), &dest.retry)),
                                outcome,
                            ));
                        }
                    }
                }
            }
        }
        // Send, unlike ThreadRng: the batch future crosses threads.
        let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::from_entropy();
        let mut plan = settle::plan(attempted, now, &mut rng);
        if let Some(wal) = &wal {
            plan.rowless = wal.rowless.clone();
            plan.defer_delivered = true;
        }
        for (e, d, reason) in held {
            let (event, dest) = (&events[e], &self.destinations[d]);
            match settle::expired_hold(event, &dest.name, &dest.retry, now) {
                Some(dead) => plan.failed.push(dead),
                None => plan.hold(event.id, &dest.name, reason.as_deref()),
            }
        }
        let mut pairs = PairCounts::default();
        // Per destination: its held pairs that go into one held batch.
        let mut bundled: Vec<Vec<&OutboxEvent>> = vec![Vec::new(); self.destinations.len()];
        for e in split {
            let event = &events[e];
            plan.fanned.push(event.id);
            for i in items.spans[e].clone() {
                let (d, outcome) = match (items.routes[i], &outcomes[i]) {
                    (Route::Unroutable, _) => continue,
                    (Route::Send(d), outcome) => (d, outcome.as_ref()),
                    (Route::Hold(d) | Route::Defer(d), _) => (d, None),
                };
                let dest = &self.destinations[d];
                let counted = outcome.map(|o| (o, self.count(d, o, &mut tripped)));
                match (items.routes[i], counted) {
                    (Route::Defer(_), _) => {
                        let note = format!(
                            "waiting for an earlier event of key {:?} to reach {}",
                            event.key.as_deref().unwrap_or_default(),
                            dest.name
                        );
                        plan.pair_waiting(event, &dest.name, false, Some(note));
                    }
                    (Route::Hold(_), _) | (_, Some((_, Counted::Held))) => {
                        match settle::expired_hold(event, &dest.name, &dest.retry, now) {
                            Some(dead) => plan.pair_failed(event.attempts, dead),
                            // No per-key order to keep: with the others of its batch, in one row.
                            None if !(event.key.is_some()
                                && self.config.destinations[d].ordering == Ordering::Key) =>
                            {
                                bundled[d].push(event);
                            }
                            None => {
                                let note = outcome.and_then(retry_reason).map(|r| {
                                    format!(
                                        "{r} [held: {} is unavailable, not counted as an attempt]",
                                        dest.name
                                    )
                                });
                                plan.pair_waiting(event, &dest.name, true, note);
                            }
                        }
                        pairs.held += 1;
                    }
                    (_, None) => {
                        plan.pair_waiting(event, &dest.name, false, None);
                        // WAL: a straggler's request is still out; its pair waits until it is over.
                        let linger = wal.as_ref().and_then(|w| w.linger);
                        if let (Some(linger), Some(pair)) = (linger, plan.pairs.last_mut()) {
                            pair.delay_secs = linger.as_secs_f64();
                        }
                    }
                    (_, Some((outcome, _))) => {
                        match settle::decide(event, &dest.name, &dest.retry, outcome, now, &mut rng)
                        {
                            None => {
                                pairs.delivered += 1;
                                plan.pairs_delivered
                                    .entry(dest.name.clone())
                                    .or_default()
                                    .push(event.id);
                            }
                            Some(failed) => {
                                if failed.dead {
                                    pairs.dead += 1;
                                } else {
                                    pairs.retried += 1;
                                }
                                warn_failed(event, &failed);
                                plan.pair_failed(event.attempts + 1, failed);
                            }
                        }
                    }
                }
            }
        }
        for (d, held) in bundled.iter().enumerate() {
            if !held.is_empty() {
                plan.bundles
                    .push(settle::HeldBatch::encode(&self.destinations[d].name, held)?);
            }
        }
        for (id, reason) in poison {
            warn!(event_id = %id, error = %reason, "dead-lettering a row that cannot be read as an event");
            plan.poison(*id, reason);
        }
        for failed in &plan.failed {
            if let Some(event) = events.iter().find(|e| e.id == failed.id) {
                warn_failed(event, failed);
            }
        }
        if aborted && !untouched.is_empty() {
            // Shutdown grace is over: what finished is settled, the rest goes back untouched.
            warn!(
                released = untouched.len(),
                "shutdown grace period over: released an unfinished batch"
            );
        }
        // Events not attempted (behind a failure of their key, or left when the batch's time was
        // up) and held-back rows go back as they were.
        untouched.extend(held_back);
        let settle_started = Instant::now();
        let settle_wall = std::time::SystemTime::now();
        let hold = match (lease_rest, hold) {
            (None, hold) => hold,
            (Some((ids, token, length)), Hold::Transaction(mut tx)) => {
                outbox::lease_many(&self.store, &mut tx, &ids, (length, token)).await?;
                Hold::Transaction(tx)
            }
            // Lease mode: the stragglers are leased already, for longer than the batch may last.
            (Some(_), hold @ Hold::Lease(_)) => hold,
            // WAL batches have no lease to move rows under.
            (Some(_), hold @ Hold::Nothing) => hold,
        };
        // WAL: no claim reads the rows, so there are no followers to park.
        let park = (self.claim.ordered && wal.is_none()).then_some(self.blocking.as_slice());
        if let Some(wal) = &mut wal {
            wal.rows = plan.delivered_rows();
        }
        let settled =
            settle::apply(&self.store, hold, &plan, self.settle_mode, &untouched, park).await?;
        metrics::histogram!(metric::SETTLE_SECONDS).record(settle_started.elapsed().as_secs_f64());
        record_outcomes(events, &plan);
        self.open_breakers(tripped).await;
        if settled.fenced > 0 {
            warn!(
                fenced = settled.fenced,
                "lease lost before settle: another relay re-claimed these events"
            );
        }
        let report = BatchReport {
            claimed: (0..events.len()).filter(|&i| include(i)).count() + poison.len(),
            delivered: plan.delivered_count() + pairs.delivered,
            retried: plan.retry_count() + pairs.retried,
            dead: plan.dead_count() + pairs.dead,
            held: plan.held.len() + pairs.held,
            fenced: settled.fenced,
            released: untouched.len(),
        };
        crate::otlp::batch_span("settle", settle_wall, || {
            vec![
                KeyValue::new("pgoutbox.delivered", report.delivered as i64),
                KeyValue::new("pgoutbox.retried", report.retried as i64),
                KeyValue::new("pgoutbox.dead", report.dead as i64),
                KeyValue::new("pgoutbox.held", report.held as i64),
                KeyValue::new("pgoutbox.fenced", report.fenced as i64),
            ]
        });
        debug!(
            claimed = report.claimed,
            delivered = report.delivered,
            retried = report.retried,
            dead = report.dead,
            held = report.held,
            released = report.released,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "batch settled"
        );
        let retried = plan
            .failed
            .iter()
            .filter(|f| !f.dead)
            .map(|f| f.id)
            .collect();
        Ok((report, retried))
    }

    /// Publishes a batch, recording an outcome per event into `run` as each finishes.
    ///
    /// Events of an ordered destination that share a key form a chain, published one event after
    /// the other; a chain stops at its first failure, so a later event of a key is never published
    /// before an earlier one succeeded, and at the batch's deadline, leaving the rest of its key to
    /// the next claim, in order. Chains run side by side, each at its own pace: a slow request
    /// holds back only its own key. Every other event is a chain of one; those all go out together
    /// in one publish per destination.
    async fn publish_chains(&self, run: &BatchRun<'_>) {
        let mut singles: Vec<usize> = Vec::new();
        let mut chains: Vec<Vec<usize>> = Vec::new();
        let sendable = (0..run.routes.len()).filter(|&i| matches!(run.routes[i], Route::Send(_)));
        if !self.claim.ordered {
            // No ordered destination: no chains to build.
            singles = sendable.collect();
        } else {
            let mut chain_of_key: HashMap<(usize, &str), usize> = HashMap::new();
            for i in sendable {
                let ordered_key = match (run.routes[i], run.event(i).key.as_deref()) {
                    (Route::Send(d), Some(key))
                        if self.config.destinations[d].ordering == Ordering::Key =>
                    {
                        (d, key)
                    }
                    _ => {
                        singles.push(i);
                        continue;
                    }
                };
                let c = *chain_of_key.entry(ordered_key).or_insert_with(|| {
                    chains.push(Vec::new());
                    chains.len() - 1
                });
                chains[c].push(i);
            }
            // A key with one event here needs no sequencing: it joins the singles.
            chains.retain(|chain| match chain.as_slice() {
                [only] => {
                    singles.push(*only);
                    false
                }
                _ => true,
            });
        }
        futures::future::join(
            self.publish_together(run, &singles),
            join_all(chains.iter().map(|chain| self.publish_chain(run, chain))),
        )
        .await;
    }

    /// Publishes one key's chain in order, stopping at the first event that neither was delivered
    /// nor may be skipped (`on_dead = "skip"` lets a rejected event's successors go on), or when
    /// the batch's time is up.
    async fn publish_chain(&self, run: &BatchRun<'_>, chain: &[usize]) {
        for &i in chain {
            let Route::Send(d) = run.routes[i] else {
                break;
            };
            if run.budgets[d].is_over() {
                break;
            }
            self.publish_together(run, &[i]).await;
            let go_on = match run.slots[i].get() {
                Some(Outcome::Delivered) => true,
                Some(Outcome::Rejected { .. }) => {
                    self.config.destinations[d].on_dead == OnDead::Skip
                }
                Some(Outcome::Retry { .. }) | None => false,
            };
            if !go_on {
                break;
            }
        }
    }

    /// Publishes the events at `indexes`: each destination's share concurrently, within the
    /// destination's budget. A sink that panics fails the events it left without an outcome.
    async fn publish_together(&self, run: &BatchRun<'_>, indexes: &[usize]) {
        let publishes = self
            .destinations
            .iter()
            .enumerate()
            .filter_map(|(d, dest)| {
                let members: Vec<usize> = indexes
                    .iter()
                    .copied()
                    .filter(|&i| run.routes[i] == Route::Send(d))
                    .collect();
                if members.is_empty() {
                    return None;
                }
                Some(async move {
                    for &i in &members {
                        run.handed[i].store(true, AtomicOrdering::Relaxed);
                    }
                    let batch: Vec<&OutboxEvent> = members.iter().map(|&i| run.event(i)).collect();
                    let recorder = Recorder::new(&run.slots, &members);
                    let started = Instant::now();
                    let wall = std::time::SystemTime::now();
                    let publish = dest
                        .sink
                        .publish_until(&batch, &run.budgets[d], &recorder);
                    if let Err(panic) = std::panic::AssertUnwindSafe(publish).catch_unwind().await {
                        let reason = format!("the sink panicked: {}", panic_message(&*panic));
                        warn!(destination = %dest.name, error = %reason, "sink panicked; its unfinished events will be retried");
                        for i in 0..members.len() {
                            recorder.record(i, Outcome::retry(reason.clone()));
                        }
                    }
                    metrics::histogram!(metric::PUBLISH_SECONDS, "destination" => dest.name.clone())
                        .record(started.elapsed().as_secs_f64());
                    if crate::otlp::enabled() {
                        for &i in &members {
                            crate::otlp::publish_span(run.event(i), &dest.name, run.slots[i].get(), wall);
                        }
                    }
                })
            });
        join_all(publishes).await;
    }

    /// Whether the relay is alive: `Some(reason)` once a claim worker died.
    pub fn failure(&self) -> Option<String> {
        self.failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Runs until `shutdown` is cancelled: claim workers plus the maintenance loops (destination
    /// state and probes, cleanup). In-flight batches then get `shutdown_grace` to finish; past it
    /// they settle what finished and release the rest. A worker that panics (a bug) stops the
    /// relay: the others finish as on shutdown, then this returns [`Error::WorkerPanicked`].
    pub async fn run(self: Arc<Self>, shutdown: CancellationToken) -> Result<BatchReport> {
        self.prepare().await;
        let grace_timer = {
            let (shutdown, abort, grace) = (
                shutdown.clone(),
                self.abort.clone(),
                self.settings.shutdown_grace,
            );
            tokio::spawn(async move {
                shutdown.cancelled().await;
                tokio::time::sleep(grace).await;
                abort.cancel();
            })
        };
        let mut workers = tokio::task::JoinSet::new();
        match self.config.source {
            Source::Poll => {
                for worker in 0..self.settings.workers {
                    let relay = Arc::clone(&self);
                    let shutdown = shutdown.clone();
                    workers.spawn(async move { relay.worker(worker, shutdown).await });
                }
            }
            // One reader per slot: the WAL source replaces the claim workers.
            Source::Wal => {
                let relay = Arc::clone(&self);
                let shutdown = shutdown.clone();
                workers.spawn(async move { crate::wal::run(relay, shutdown).await });
            }
        }
        {
            let relay = Arc::clone(&self);
            let shutdown = shutdown.clone();
            workers.spawn(async move { relay.deliveries_loop(shutdown).await });
        }
        let maintenance = {
            let relay = Arc::clone(&self);
            let shutdown = shutdown.clone();
            tokio::spawn(async move {
                tokio::join!(
                    relay.cleanup_loop(shutdown.clone()),
                    relay.destinations_loop(shutdown)
                )
            })
        };
        let mut total = BatchReport::default();
        let mut panicked = None;
        while let Some(joined) = workers.join_next().await {
            match joined {
                Ok(report) => total += report,
                Err(e) => {
                    let why = match e.try_into_panic() {
                        Ok(panic) => format!("a claim worker panicked: {}", panic_message(&*panic)),
                        Err(e) => format!("a claim worker was cancelled: {e}"),
                    };
                    error!(error = %why, "stopping the relay");
                    *self.failure.lock().unwrap_or_else(|e| e.into_inner()) = Some(why.clone());
                    shutdown.cancel();
                    panicked.get_or_insert(why);
                }
            }
        }
        maintenance.abort();
        grace_timer.abort();
        match panicked {
            Some(why) => Err(Error::WorkerPanicked(why)),
            None => Ok(total),
        }
    }

    /// Before the first claim: registers the destinations and reads their shared state (an
    /// operator's pause, an open breaker), and releases rows whose wait is over.
    async fn prepare(&self) {
        let steps = async {
            destination::register(&self.store, &self.config.destinations).await?;
            destination::sync(&self.store, &self.health).await?;
            waiting::unpark_followers(&self.store).await
        };
        if let Err(e) = steps.await {
            warn!(error = %crate::error_chain(&e), "cannot read the destinations' state yet; will try again");
        }
        self.ensure_history().await;
    }

    /// `history = "partitions"`: partitions ready ahead of the clock. At start-up and on every
    /// cleanup tick, in every instance (idempotent, serialized in the database), so that a dead
    /// cleanup leader does not leave the others without one. A failure is not fatal: a settle
    /// with no partition for its time lands in the default partition.
    async fn ensure_history(&self) {
        if self.settle_mode != settle::SettleMode::Move {
            return;
        }
        let ahead = crate::history::ahead(self.config.retention, self.config.cleanup_interval);
        if let Err(e) =
            crate::history::ensure(self.store.pool(), &self.table, self.config.retention, ahead)
                .await
        {
            warn!(error = %crate::error_chain(&e), "cannot create the history's next partitions (the relay's role must own the history, or run `pgoutbox cleanup` as its owner); settles land in its default partition until then");
        }
    }

    /// One claim loop. Each batch runs as a task of its own; when only stragglers are left in it
    /// (see [`Relay::process_batch`]), the loop goes on to its next claim while the task waits for
    /// them, with at most one such batch waiting per worker.
    async fn worker(self: Arc<Self>, worker: usize, shutdown: CancellationToken) -> BatchReport {
        let mut total = BatchReport::default();
        let mut pacing = Pacing::new(&self.settings);
        let mut db_down = false;
        let mut waiting: Option<tokio::task::JoinHandle<BatchResult>> = None;
        let mut quiet = false;
        while !shutdown.is_cancelled() {
            // After an empty claim, poll with one cheap statement and claim only once there is
            // something: an idle relay's cost is a few index probes per second, not transactions.
            // One quiet worker polls; the others wait until it (or a busy worker) wakes them.
            if quiet {
                let woken = self.wake.notified();
                let Ok(_poller) = self.idle_poller.try_lock() else {
                    // Another worker polls. The timeout only matters if it stopped polling
                    // without waking anyone (it went back to claiming): take its place.
                    tokio::select! {
                        _ = shutdown.cancelled() => break,
                        _ = woken => {
                            quiet = false;
                            pacing.busy();
                        }
                        _ = tokio::time::sleep(self.settings.poll_interval) => {}
                    }
                    continue;
                };
                let pause = match self.any_due().await {
                    Ok(true) => None,
                    Ok(false) => {
                        db_reachable(Some(worker), &mut db_down);
                        Some(pacing.idle())
                    }
                    Err(e) => Some(self.db_failed(worker, &mut pacing, &mut db_down, &e)),
                };
                match pause {
                    Some(pause) => {
                        tokio::select! {
                            _ = shutdown.cancelled() => break,
                            _ = tokio::time::sleep(pause) => {}
                        }
                        continue;
                    }
                    None => {
                        // Rows are due: if another worker's claim takes them first, this
                        // worker's next wait must still start short, not where the quiet left it.
                        pacing.busy();
                        self.wake.notify_waiters();
                    }
                }
            }
            let (signal, detached) = tokio::sync::oneshot::channel();
            let relay = Arc::clone(&self);
            let mut batch = tokio::spawn(async move { relay.process_batch(Some(signal)).await });
            let result = tokio::select! {
                joined = &mut batch => joined_batch(joined),
                Ok(()) = detached => {
                    // Settled but for its stragglers: claim on while it waits for them.
                    if let Some(previous) = waiting.replace(batch) {
                        total += self.report_of(worker, joined_batch(previous.await));
                    }
                    Ok((BatchReport { claimed: 1, ..BatchReport::default() }, Vec::new()))
                }
            };
            let pause = match result {
                Ok((report, _)) => {
                    db_reachable(Some(worker), &mut db_down);
                    if report.claimed > 0 {
                        total += report;
                        pacing.busy();
                        quiet = false;
                        self.wake.notify_waiters();
                        continue;
                    }
                    quiet = true;
                    pacing.idle()
                }
                Err(e) => self.db_failed(worker, &mut pacing, &mut db_down, &e),
            };
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep(pause) => {}
            }
        }
        if let Some(previous) = waiting {
            total += self.report_of(worker, joined_batch(previous.await));
        }
        total
    }

    /// OutboxAnyDue: is a row due now?
    async fn any_due(&self) -> Result<bool> {
        outbox::any_due(&self.store).await
    }

    /// A claim loop's database error (poll, claim or settle): counted, logged, and the pause
    /// before the next try.
    fn db_failed(
        &self,
        worker: usize,
        pacing: &mut Pacing,
        db_down: &mut bool,
        e: &crate::error::Error,
    ) -> Duration {
        metrics::counter!(metric::DB_ERRORS_TOTAL).increment(1);
        let pause = pacing.failed();
        warn!(worker, error = %crate::error_chain(e), retry_in_ms = pause.as_millis() as u64, "claim or settle failed; retrying");
        *db_down = true;
        pause
    }

    /// A finished batch's report; a database error is logged (its rows are claimed again).
    fn report_of(&self, worker: usize, result: Result<(BatchReport, Vec<Uuid>)>) -> BatchReport {
        match result {
            Ok((report, _)) => report,
            Err(e) => {
                metrics::counter!(metric::DB_ERRORS_TOTAL).increment(1);
                warn!(worker, error = %crate::error_chain(&e), "settling a batch's stragglers failed; they will be claimed again");
                BatchReport::default()
            }
        }
    }

    /// Every [`destination::SYNC_INTERVAL`]: re-reads the shared destination state (pauses,
    /// breakers opened or closed by other relays), then probes each open destination whose probe is
    /// due, if this relay wins it.
    async fn destinations_loop(&self, shutdown: CancellationToken) {
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(destination::SYNC_INTERVAL) => {}
            }
            if let Err(e) = destination::sync(&self.store, &self.health).await {
                warn!(error = %crate::error_chain(&e), "cannot read the destinations' state; will try again");
                continue;
            }
            // Held batches written by a batch that began before its destination came back.
            if let Err(e) = waiting::unbundle(&self.store, None, None).await {
                warn!(error = %crate::error_chain(&e), "cannot release held batches; will try again");
            }
            for d in 0..self.destinations.len() {
                let (state, paused) = self.health[d].state();
                if paused || state == BreakerState::Closed {
                    continue;
                }
                if let Err(e) = self.probe(d).await {
                    warn!(destination = %self.destinations[d].name, error = %crate::error_chain(&e), "probe failed on a database error; will try again");
                }
            }
        }
    }

    /// Sends one held event to destination `d` if its probe is due and this relay takes it: a held
    /// event row, or else a held pair from the deliveries table. An answer (delivered, or a
    /// permanent rejection) closes the breaker and releases the held events; a failure counts no
    /// attempt and schedules the next probe, later each time.
    async fn probe(&self, d: usize) -> Result<()> {
        let dest = &self.destinations[d];
        let hold_for = self.settings.publish_timeout * 2;
        let Some(failed_probes) =
            destinations::take_probe(&self.store, &dest.name, hold_for).await?
        else {
            return Ok(());
        };
        let mut tx = self.store.pool().begin().await?;
        let row = waiting::claim_probe(&self.store, &mut tx, &dest.name).await?;
        let event = match row.map(|row| (row.id, row.event)) {
            Some((_, Ok(event))) => event,
            Some((id, Err(reason))) => {
                // A poison row: dead-lettered; the next probe takes another, as scheduled.
                let mut plan = settle::SettlePlan::default();
                plan.poison(id, &reason);
                let hold = Hold::Transaction(tx);
                settle::apply(&self.store, hold, &plan, self.settle_mode, &[], None).await?;
                return self.probe_skipped(d, failed_probes).await;
            }
            None => {
                tx.rollback().await?;
                return self.probe_delivery(d, failed_probes).await;
            }
        };
        let (outcome, _) = self
            .publish_each(std::slice::from_ref(&event), vec![Route::Send(d)])
            .await;
        match outcome.into_iter().next().flatten() {
            Some(outcome @ (Outcome::Delivered | Outcome::Rejected { .. })) => {
                let plan = settle::plan(
                    [(&event, Some((dest.name.as_str(), &dest.retry)), &outcome)],
                    chrono::Utc::now(),
                    &mut rand::thread_rng(),
                );
                settle::apply(
                    &self.store,
                    Hold::Transaction(tx),
                    &plan,
                    self.settle_mode,
                    &[],
                    None,
                )
                .await?;
                record_outcomes(std::slice::from_ref(&event), &plan);
                self.probe_answered(d).await
            }
            failed => {
                tx.rollback().await?;
                self.probe_failed(d, failed_probes, failed).await
            }
        }
    }

    /// The probe of `d` found no held event row: it takes a held pair from the deliveries table.
    async fn probe_delivery(&self, d: usize, failed_probes: i32) -> Result<()> {
        let dest = &self.destinations[d];
        let claimed =
            crate::claim::claim_delivery_probe(&self.store, &dest.name, self.claim.lease).await?;
        // Its held pairs may all be in held batches: one becomes held rows to take the probe from.
        let claimed = if claimed.deliveries.is_empty() && claimed.poison.is_empty() {
            waiting::unbundle(&self.store, Some((&dest.name, 1)), None).await?;
            crate::claim::claim_delivery_probe(&self.store, &dest.name, self.claim.lease).await?
        } else {
            claimed
        };
        let token = claimed.token;
        if let Some((id, name, reason)) = claimed.poison.into_iter().next() {
            let mut plan = settle::SettlePlan::default();
            plan.poison_pair(id, &name, &reason);
            settle::apply_deliveries(&self.store, token, &plan, &[]).await?;
            return self.probe_skipped(d, failed_probes).await;
        }
        let Some(delivery) = claimed.deliveries.into_iter().next() else {
            // Nothing held yet: the next events routed to the destination will be.
            return self.probe_skipped(d, failed_probes).await;
        };
        let event = delivery.event;
        let (outcome, _) = self
            .publish_each(std::slice::from_ref(&event), vec![Route::Send(d)])
            .await;
        let mut plan = settle::SettlePlan::default();
        match outcome.into_iter().next().flatten() {
            Some(outcome @ (Outcome::Delivered | Outcome::Rejected { .. })) => {
                let now = chrono::Utc::now();
                // Send, unlike ThreadRng: the batch future crosses threads.
                let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::from_entropy();
                match settle::decide(&event, &dest.name, &dest.retry, &outcome, now, &mut rng) {
                    None => {
                        plan.delivered.insert(dest.name.clone(), vec![event.id]);
                    }
                    Some(failed) => plan.failed.push(failed),
                }
                settle::apply_deliveries(&self.store, token, &plan, &[]).await?;
                record_outcomes(std::slice::from_ref(&event), &plan);
                self.probe_answered(d).await
            }
            failed => {
                // Back to held, no attempt counted.
                plan.hold(event.id, &dest.name, None);
                settle::apply_deliveries(&self.store, token, &plan, &[]).await?;
                self.probe_failed(d, failed_probes, failed).await
            }
        }
    }

    /// A probe found nothing to send (or a poison row): the next probe comes as scheduled.
    async fn probe_skipped(&self, d: usize, failed_probes: i32) -> Result<()> {
        let delay = self.health[d].probe_delay(failed_probes);
        let name = &self.destinations[d].name;
        destinations::probe_failed(&self.store, name, None, delay).await
    }

    /// The destination answered its probe: the breaker closes and its held events are due again.
    async fn probe_answered(&self, d: usize) -> Result<()> {
        let name = &self.destinations[d].name;
        self.health[d].close();
        let released = destination::store_closed(&self.store, name).await?;
        info!(destination = %name, released, "probe answered: circuit breaker closed, held events are due again");
        Ok(())
    }

    /// The probe failed: the breaker stays open, the next probe later.
    async fn probe_failed(
        &self,
        d: usize,
        failed_probes: i32,
        failed: Option<Outcome>,
    ) -> Result<()> {
        let name = &self.destinations[d].name;
        let reason = match failed {
            Some(Outcome::Retry { reason, .. }) => reason,
            _ => "no answer within publish_timeout".to_owned(),
        };
        let delay = self.health[d].probe_delay(failed_probes + 1);
        info!(destination = %name, error = %reason, next_probe_in_ms = delay.as_millis() as u64, "probe failed: circuit breaker stays open");
        destinations::probe_failed(&self.store, name, Some(&reason), delay).await
    }

    /// Publishes events that have one item each (`routes`) within one `publish_timeout`; returns
    /// their outcomes and whether shutdown cut the publish short.
    async fn publish_each(
        &self,
        events: &[OutboxEvent],
        routes: Vec<Route>,
    ) -> (Vec<Option<Outcome>>, bool) {
        let items = Items::single(routes);
        let deadline = tokio::time::Instant::now() + self.settings.publish_timeout;
        let run = BatchRun::new(events, &items, &self.destinations, deadline);
        let aborted = tokio::select! {
            _ = tokio::time::timeout_at(deadline, self.publish_chains(&run)) => false,
            _ = self.abort.cancelled() => true,
        };
        (run.finish(aborted, self.settings.publish_timeout), aborted)
    }

    /// Records an outcome of destination `d` on its breaker; a failure that opens it joins
    /// `tripped` (stored once the batch is settled).
    fn count(&self, d: usize, outcome: &Outcome, tripped: &mut Vec<(usize, String)>) -> Counted {
        let counted = self.health[d].record(outcome);
        if counted == Counted::Tripped {
            if let Some(reason) = retry_reason(outcome) {
                tripped.push((d, reason));
            }
        }
        counted
    }

    /// Stores the breakers a batch opened, so every relay holds those destinations' events.
    async fn open_breakers(&self, tripped: Vec<(usize, String)>) {
        for (d, reason) in tripped {
            let health = &self.health[d];
            warn!(
                destination = health.name(),
                failures = health.config().failures,
                error = %reason,
                "circuit breaker open: holding this destination's events, probing until it answers"
            );
            if let Err(e) = destination::store_open(&self.store, health, &reason).await {
                warn!(destination = health.name(), error = %crate::error_chain(&e), "cannot store the breaker state");
            }
        }
    }

    /// Claims, publishes and settles one batch of due deliveries (the undelivered pairs of split
    /// events). Each pair is its destination's alone: it is published, retried, held and
    /// dead-lettered like an event with that one destination.
    pub async fn run_deliveries_batch(&self) -> Result<BatchReport> {
        let claimed = crate::claim::claim_deliveries(
            &self.store,
            self.settings.batch_size,
            self.claim.lease,
            &self.ordered,
            &self.blocking,
        )
        .await?;
        let token = claimed.token;
        let mut plan = settle::SettlePlan::default();
        for (id, name, reason) in &claimed.poison {
            warn!(event_id = %id, destination = %name, error = %reason, "dead-lettering a delivery that cannot be read as an event");
            plan.poison_pair(*id, name, reason);
        }
        if claimed.deliveries.is_empty() && plan.failed.is_empty() {
            return Ok(BatchReport::default());
        }
        let (names, events): (Vec<String>, Vec<OutboxEvent>) = claimed
            .deliveries
            .into_iter()
            .map(|c| (c.destination, c.event))
            .unzip();
        let routes: Vec<Route> = names
            .iter()
            .map(
                |name| match self.destinations.iter().position(|d| &d.name == name) {
                    Some(d) => self.gate(d),
                    None => Route::Unroutable,
                },
            )
            .collect();
        let (outcomes, aborted) = self.publish_each(&events, routes.clone()).await;
        let now = chrono::Utc::now();
        // Send, unlike ThreadRng: the batch future crosses threads.
        let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::from_entropy();
        let mut tripped = Vec::new();
        let mut untouched: Vec<(Uuid, String)> = Vec::new();
        for (i, event) in events.iter().enumerate() {
            let name = &names[i];
            match (routes[i], &outcomes[i]) {
                (Route::Unroutable, _) => plan.failed.push(settle::FailedRow {
                    id: event.id,
                    error: format!("destination {name:?} is no longer configured: add it back, then `pgoutbox dead retry --destination {name}`, or `dead discard` [dead: no such destination]"),
                    destination: Some(name.clone()),
                    delay_secs: 0.0,
                    dead: true,
                }),
                (Route::Hold(d), _) => {
                    match settle::expired_hold(event, name, &self.destinations[d].retry, now) {
                        Some(dead) => plan.failed.push(dead),
                        None => plan.hold(event.id, name, None),
                    }
                }
                (Route::Send(_) | Route::Defer(_), None) => untouched.push((event.id, name.clone())),
                (Route::Send(d) | Route::Defer(d), Some(outcome)) => {
                    match self.count(d, outcome, &mut tripped) {
                        Counted::Held => {
                            plan.hold(event.id, name, retry_reason(outcome).as_deref())
                        }
                        _ => {
                            let dest = &self.destinations[d];
                            match settle::decide(event, name, &dest.retry, outcome, now, &mut rng) {
                                None => plan.delivered.entry(name.clone()).or_default().push(event.id),
                                Some(failed) => {
                                    warn_failed(event, &failed);
                                    plan.failed.push(failed);
                                }
                            }
                        }
                    }
                }
            }
        }
        let settled = settle::apply_deliveries(&self.store, token, &plan, &untouched).await?;
        record_outcomes(&events, &plan);
        self.open_breakers(tripped).await;
        if settled.fenced > 0 {
            warn!(
                fenced = settled.fenced,
                "delivery lease lost before settle: another relay re-claimed these pairs"
            );
        }
        if aborted && !untouched.is_empty() {
            warn!(
                released = untouched.len(),
                "shutdown grace period over: released unfinished deliveries"
            );
        }
        Ok(BatchReport {
            claimed: events.len() + claimed.poison.len(),
            delivered: plan.delivered_count(),
            retried: plan.retry_count(),
            dead: plan.dead_count(),
            held: plan.held.len(),
            fenced: settled.fenced,
            released: untouched.len(),
        })
    }

    /// Claims due deliveries until shutdown: at once again while there are some, backing off to
    /// [`DELIVERIES_POLL_INTERVAL`] (or `poll_interval`) while there are none, and on database
    /// errors.
    async fn deliveries_loop(&self, shutdown: CancellationToken) -> BatchReport {
        let mut total = BatchReport::default();
        let mut pacing = Pacing {
            max: self.settings.poll_interval.max(DELIVERIES_POLL_INTERVAL),
            ..Pacing::new(&self.settings)
        };
        let mut db_down = false;
        while !shutdown.is_cancelled() {
            let pause = match self.run_deliveries_batch().await {
                Ok(report) if report.claimed > 0 => {
                    db_reachable(None, &mut db_down);
                    total += report;
                    pacing.busy();
                    continue;
                }
                Ok(_) => {
                    db_reachable(None, &mut db_down);
                    pacing.idle()
                }
                Err(e) => {
                    db_down = true;
                    metrics::counter!(metric::DB_ERRORS_TOTAL).increment(1);
                    let pause = pacing.failed();
                    warn!(error = %crate::error_chain(&e), retry_in_ms = pause.as_millis() as u64, "deliveries claim or settle failed; retrying");
                    pause
                }
            };
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep(pause) => {}
            }
        }
        total
    }

    async fn cleanup_loop(&self, shutdown: CancellationToken) {
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(self.config.cleanup_interval) => {}
            }
            self.ensure_history().await;
            let options = crate::cleanup::CleanupOptions::from_config(&self.config);
            match crate::cleanup::run_if_leader(self.store.pool(), &self.table, &options).await {
                Ok(Some(r)) if r.deleted() + r.dropped_partitions > 0 => info!(
                    published = r.deleted_published,
                    dead = r.deleted_dead,
                    partitions = r.dropped_partitions,
                    batches = r.batches,
                    longest_batch_ms = r.longest_batch.as_millis() as u64,
                    "cleanup deleted old rows"
                ),
                Ok(_) => {}
                Err(e) => warn!(error = %crate::error_chain(&e), "cleanup failed; will try again"),
            }
            // Held events of a destination that stays unavailable still reach their max_age.
            for dest in &self.destinations {
                let Some(max_age) = dest.retry.max_age else {
                    continue;
                };
                let rows = waiting::expire_held(&self.store, &dest.name, max_age).await;
                expired(&dest.name, rows, "held events");
                let expiring = Some((dest.name.as_str(), i64::MAX));
                if let Err(e) = waiting::unbundle(&self.store, expiring, Some(max_age)).await {
                    warn!(error = %crate::error_chain(&e), "expiring held batches failed; will try again");
                }
                let pairs = deliveries::expire_held(&self.store, &dest.name, max_age).await;
                expired(&dest.name, pairs, "held deliveries");
            }
            // Rows whose wait is over (a dead row ahead was retried, discarded or cleaned up; an
            // `on_dead` that is now "skip"; a destination resumed) are due again.
            match waiting::unpark_followers(&self.store).await {
                Ok(n) if n > 0 => {
                    info!(rows = n, "rows no longer held back are due again")
                }
                Ok(_) => {}
                Err(e) => {
                    warn!(error = %crate::error_chain(&e), "unparking failed; will try again")
                }
            }
        }
    }

    /// Processes everything due now, then returns: for cron-style runs (`relay --once`).
    ///
    /// Destinations paused or with an open breaker keep their events held (no probe is sent).
    /// Events that fail are scheduled per their policy; one that comes due again within the run
    /// (a zero retry delay) is not retried in a loop: the run ends when a batch holds only such.
    pub async fn run_once(&self) -> Result<BatchReport> {
        destination::register(&self.store, &self.config.destinations).await?;
        destination::sync(&self.store, &self.health).await?;
        waiting::unpark_followers(&self.store).await?;
        self.ensure_history().await;
        let mut total = BatchReport::default();
        let mut failed_before: HashSet<Uuid> = HashSet::new();
        let mut unbounded_tried = false;
        loop {
            let (report, retried) = self.process_batch(None).await?;
            total += report;
            let only_repeats = report.delivered == 0
                && report.dead == 0
                && !retried.is_empty()
                && retried.iter().all(|id| failed_before.contains(id));
            if report.claimed == 0 && self.claim.ordered && !unbounded_tried {
                // Ordered: an empty claim only saw the window; make sure nothing further on is due.
                unbounded_tried = true;
                self.window
                    .store(crate::claim::WINDOW_UNBOUNDED_FROM, AtomicOrdering::Relaxed);
                continue;
            }
            if report.claimed == 0 || only_repeats {
                break;
            }
            unbounded_tried = false;
            failed_before.extend(retried);
        }
        // Then the due pairs of split events, until none is due or a batch only failed again.
        loop {
            let report = self.run_deliveries_batch().await?;
            total += report;
            if report.claimed == 0 || report.delivered + report.dead == 0 {
                return Ok(total);
            }
        }
    }
}

/// How a batch read from the WAL settles, unlike a claimed one: an event that did not reach a
/// destination goes on as a deliveries pair (never retried on its row, which no claim reads), and
/// nothing is given back.
struct WalSettle {
    /// Delivered events that have no table row (`emit()` messages): nothing to write for them.
    rowless: HashSet<Uuid>,
    /// Out: the rows delivered everywhere, which the settle leaves to the WAL processor to write
    /// with other batches' (`settle::write_delivered`).
    rows: settle::DeliveredRows,
    /// For a batch settled without its stragglers: how long their pairs wait (their requests are
    /// still out).
    linger: Option<Duration>,
}

/// Logs what an expiry (OutboxExpireHeld, DeliveriesExpireHeld) of `destination`'s held `what`
/// did: those older than `max_age` were dead-lettered.
fn expired(destination: &str, done: Result<u64>, what: &str) {
    match done {
        Ok(rows) if rows > 0 => {
            warn!(destination, rows, "{what} reached max_age: dead-lettered")
        }
        Ok(_) => {}
        Err(e) => {
            warn!(error = %crate::error_chain(&e), "expiring {what} failed; will try again")
        }
    }
}

/// Where one (event, destination) item of a batch goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    /// Published to destination `d`.
    Send(usize),
    /// Held for destination `d` (paused, or its breaker is open).
    Hold(usize),
    /// Ordered destination `d` still has an undelivered pair of this key: not published now, the
    /// pair waits behind it in the deliveries table.
    Defer(usize),
    /// No destination takes its topic.
    Unroutable,
}

/// A batch's items: one per (event, destination), what publishing works on.
#[derive(Debug, Default)]
struct Items {
    /// Per item: its event's index in the batch.
    owner: Vec<usize>,
    /// Per item: where it goes.
    routes: Vec<Route>,
    /// Per event: its items (contiguous).
    spans: Vec<std::ops::Range<usize>>,
}

impl Items {
    /// One item per event, for batches whose events each have one destination already (a batch of
    /// deliveries, a probe).
    fn single(routes: Vec<Route>) -> Self {
        Self {
            owner: (0..routes.len()).collect(),
            spans: (0..routes.len()).map(|i| i..i + 1).collect(),
            routes,
        }
    }

    /// Whether event `e` settles through the deliveries table: several destinations, or one item
    /// that waits behind its key there.
    fn is_split(&self, e: usize) -> bool {
        let span = self.spans[e].clone();
        span.len() > 1
            || self.routes[span]
                .iter()
                .any(|r| matches!(r, Route::Defer(_)))
    }
}

/// Counts of a batch's split-event pairs, for its report.
#[derive(Debug, Default)]
struct PairCounts {
    delivered: usize,
    retried: usize,
    dead: usize,
    held: usize,
}

/// Logs a failed attempt (retried or dead-lettered) of `event`.
fn warn_failed(event: &OutboxEvent, failed: &settle::FailedRow) {
    warn!(
        event_id = %event.id,
        topic = %event.topic,
        destination = failed.destination.as_deref().unwrap_or("-"),
        attempt = event.attempts + 1,
        dead = failed.dead,
        error = %failed.error,
        "publish failed"
    );
}

/// The failure an outcome reports, if it is a retryable one.
fn retry_reason(outcome: &Outcome) -> Option<String> {
    match outcome {
        Outcome::Retry { reason, .. } => Some(reason.clone()),
        _ => None,
    }
}

/// One batch being published: its items, the outcome slots sinks fill as they go, and each
/// destination's time budget.
struct BatchRun<'a> {
    events: &'a [OutboxEvent],
    owner: &'a [usize],
    routes: &'a [Route],
    slots: Vec<OnceLock<Outcome>>,
    /// Items handed to a sink (their publish started, or was queued to start).
    handed: Vec<AtomicBool>,
    budgets: Vec<Budget>,
}

impl<'a> BatchRun<'a> {
    fn new(
        events: &'a [OutboxEvent],
        items: &'a Items,
        destinations: &[Destination],
        deadline: tokio::time::Instant,
    ) -> Self {
        Self {
            events,
            owner: &items.owner,
            routes: &items.routes,
            slots: items.routes.iter().map(|_| OnceLock::new()).collect(),
            handed: items
                .routes
                .iter()
                .map(|_| AtomicBool::new(false))
                .collect(),
            budgets: destinations
                .iter()
                .map(|_| Budget::until(deadline))
                .collect(),
        }
    }

    /// The event of item `i`.
    fn event(&self, i: usize) -> &'a OutboxEvent {
        &self.events[self.owner[i]]
    }

    /// How many items have an outcome so far.
    fn finished(&self) -> usize {
        self.slots.iter().filter(|s| s.get().is_some()).count()
    }

    /// The stragglers, when they are all that is left of the batch: something finished, at most
    /// `most` items have no outcome, and none has come for [`STRAGGLER_PATIENCE`]. `last_progress`
    /// (finished count, when it last changed) is kept up to date by the calls.
    fn only_stragglers(
        &self,
        last_progress: &mut (usize, tokio::time::Instant),
        most: usize,
    ) -> Option<Vec<usize>> {
        let finished = self.finished();
        if finished != last_progress.0 {
            *last_progress = (finished, tokio::time::Instant::now());
            return None;
        }
        let stragglers = self.stragglers();
        (!stragglers.is_empty()
            && finished > 0
            && stragglers.len() <= most
            && last_progress.1.elapsed() >= STRAGGLER_PATIENCE)
            .then_some(stragglers)
    }

    /// Items to publish that have no outcome yet.
    fn stragglers(&self) -> Vec<usize> {
        (0..self.slots.len())
            .filter(|&i| matches!(self.routes[i], Route::Send(_)) && self.slots[i].get().is_none())
            .collect()
    }

    /// The outcomes known so far.
    fn snapshot(&self) -> Vec<Option<Outcome>> {
        self.slots.iter().map(|s| s.get().cloned()).collect()
    }

    /// The outcomes: `None` for events that have none (not attempted, or unfinished at the
    /// deadline: given back untouched). A destination that finished nothing at all within the
    /// whole budget is not making progress: its unfinished events count as failed attempts (it
    /// would otherwise be retried at no cost forever), unless the batch was aborted by shutdown.
    fn finish(self, aborted: bool, publish_timeout: Duration) -> Vec<Option<Outcome>> {
        let mut outcomes: Vec<Option<Outcome>> =
            self.slots.into_iter().map(OnceLock::into_inner).collect();
        if aborted {
            return outcomes;
        }
        let stalled: HashSet<usize> = (0..self.budgets.len())
            .filter(|&d| {
                let mine =
                    || (0..outcomes.len()).filter(move |&i| self.routes[i] == Route::Send(d));
                mine().any(|i| self.handed[i].load(AtomicOrdering::Relaxed))
                    && mine().all(|i| outcomes[i].is_none())
            })
            .collect();
        for (i, outcome) in outcomes.iter_mut().enumerate() {
            if let Route::Send(d) = self.routes[i] {
                if outcome.is_none()
                    && stalled.contains(&d)
                    && self.handed[i].load(AtomicOrdering::Relaxed)
                {
                    *outcome = Some(Outcome::retry(format!(
                        "no answer within publish_timeout ({})",
                        humantime::format_duration(publish_timeout)
                    )));
                }
            }
        }
        outcomes
    }
}

/// A batch's report and the ids it scheduled for another attempt.
type BatchResult = Result<(BatchReport, Vec<Uuid>)>;

/// A batch task's result; a panic inside it goes on up to the worker (and stops the relay).
fn joined_batch(joined: std::result::Result<BatchResult, tokio::task::JoinError>) -> BatchResult {
    match joined {
        Ok(result) => result,
        Err(e) => match e.try_into_panic() {
            Ok(panic) => std::panic::resume_unwind(panic),
            Err(e) => Err(Error::WorkerPanicked(format!("a batch was cancelled: {e}"))),
        },
    }
}

/// The text of a panic's payload.
fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into())
}

/// Counts a settled batch's outcomes per (destination, topic): one metric update per group, not
/// per event, to keep the hot path cheap.
fn record_outcomes(events: &[OutboxEvent], plan: &settle::SettlePlan) {
    let by_id: HashMap<Uuid, &OutboxEvent> = events.iter().map(|e| (e.id, e)).collect();
    let now = chrono::Utc::now();
    for (destination, ids) in plan.delivered.iter().chain(&plan.pairs_delivered) {
        let mut per_topic: HashMap<&str, u64> = HashMap::new();
        let latency = metrics::histogram!(metric::COMMIT_TO_PUBLISH_SECONDS, "destination" => destination.clone());
        for id in ids {
            if let Some(e) = by_id.get(id) {
                *per_topic.entry(e.topic.as_str()).or_default() += 1;
                latency.record(
                    (now - e.created_at).num_microseconds().unwrap_or(0).max(0) as f64 / 1e6,
                );
            }
        }
        metric::count_delivered(destination, ids.len() as u64);
        for (topic, n) in per_topic {
            metrics::counter!(metric::PUBLISHED_TOTAL, "destination" => destination.clone(), "topic" => topic.to_owned())
                .increment(n);
        }
    }
    let mut held: HashMap<&str, u64> = HashMap::new();
    for h in &plan.held {
        *held.entry(h.destination.as_str()).or_default() += 1;
    }
    for p in plan.pairs.iter().filter(|p| p.held) {
        *held.entry(p.destination.as_str()).or_default() += 1;
    }
    for b in &plan.bundles {
        *held.entry(b.destination.as_str()).or_default() += b.count as u64;
    }
    for (destination, n) in held {
        metrics::counter!(metric::HELD_TOTAL, "destination" => destination.to_owned()).increment(n);
    }
    let mut failures: HashMap<(&str, &str, bool), u64> = HashMap::new();
    for f in &plan.failed {
        if let Some(e) = by_id.get(&f.id) {
            *failures
                .entry((
                    f.destination.as_deref().unwrap_or("(unrouted)"),
                    e.topic.as_str(),
                    f.dead,
                ))
                .or_default() += 1;
        }
    }
    for p in plan.pairs.iter().filter(|p| p.failed) {
        if let Some(e) = by_id.get(&p.event_id) {
            *failures
                .entry((p.destination.as_str(), e.topic.as_str(), p.dead))
                .or_default() += 1;
        }
    }
    for ((destination, topic, dead), n) in failures {
        let name = if dead {
            metric::DEAD_LETTERED_TOTAL
        } else {
            metric::FAILED_TOTAL
        };
        metrics::counter!(name, "destination" => destination.to_owned(), "topic" => topic.to_owned()).increment(n);
    }
}
