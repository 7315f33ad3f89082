//! The relay: claim → route → publish → settle, in a loop, on a few claim workers.
//!
//! Each worker claims a batch, routes every event to its destination, publishes each destination's
//! share concurrently (bounded by `publish_timeout`), and settles the whole batch in one or two
//! statements. Database errors (a PostgreSQL restart) are logged and retried with backoff; a bad
//! event never stops the relay: it is retried or dead-lettered.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering as AtomicOrdering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::join_all;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};
use uuid::Uuid;

use crate::claim::{claim_due, ClaimOptions, ClaimedBatch};
use crate::config::{Config, OnDead, Ordering, RelayConfig};
use crate::error::Result;
use crate::event::OutboxEvent;
use crate::observe;
use crate::publish::{self, Outcome, Sink};
use crate::retry::RetryPolicy;
use crate::route::Router;
use crate::settle;
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

/// Longest pause between retries while the database is unreachable.
const MAX_DB_BACKOFF: Duration = Duration::from_secs(5);

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
        self.fenced += o.fenced;
        self.released += o.released;
    }
}

/// The relay engine.
pub struct Relay {
    pool: PgPool,
    table: OutboxTable,
    router: Router,
    destinations: Vec<Destination>,
    settings: RelayConfig,
    delete_on_settle: bool,
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
        metrics::counter!(observe::DB_ERRORS_TOTAL).absolute(0);
        for d in &destinations {
            metrics::counter!(observe::SINK_RECONNECTS_TOTAL, "destination" => d.name.clone())
                .absolute(0);
        }
        Self {
            pool,
            table: config.table.clone(),
            router: Router::new(&config.destinations),
            destinations,
            settings: config.relay.clone(),
            delete_on_settle: config.retention.is_zero(),
            config: config.clone(),
            abort: CancellationToken::new(),
            claim: ClaimOptions {
                mode: config.relay.claim,
                limit: config.relay.batch_size,
                lease: config.relay.lease(),
                ordered: config
                    .destinations
                    .iter()
                    .any(|d| d.ordering == Ordering::Key)
                    .then(|| {
                        // One claim serves every destination: block wins if any ordered one asks for it.
                        config
                            .destinations
                            .iter()
                            .any(|d| d.ordering == Ordering::Key && d.on_dead == OnDead::Block)
                    }),
                heads: initial_heads(config.relay.batch_size),
                followers: INITIAL_FOLLOWERS,
                window: base_window(config.relay.batch_size),
            },
            heads: AtomicUsize::new(initial_heads(config.relay.batch_size)),
            followers: AtomicUsize::new(INITIAL_FOLLOWERS),
            window: AtomicU64::new(base_window(config.relay.batch_size)),
            window_since: std::sync::Mutex::new(Instant::now()),
        }
    }

    /// The connection pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Readiness: the database answers and every sink passes its healthcheck (2 s each).
    pub async fn readiness(&self) -> std::result::Result<(), Vec<String>> {
        let limit = Duration::from_secs(2);
        let mut problems = Vec::new();
        let db = tokio::time::timeout(limit, sqlx::query("SELECT 1").execute(&self.pool)).await;
        match db {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => problems.push(format!("database: {}", crate::error_chain(&e))),
            Err(_) => problems.push("database: no answer within 2 s".into()),
        }
        for dest in &self.destinations {
            match tokio::time::timeout(limit, dest.sink.healthcheck()).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => problems.push(format!("destination {}: {e}", dest.name)),
                Err(_) => problems.push(format!("destination {}: no answer within 2 s", dest.name)),
            }
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(problems)
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
        Ok(self.process_batch().await?.0)
    }

    /// One batch; also returns the ids scheduled for another attempt.
    async fn process_batch(&self) -> Result<(BatchReport, Vec<Uuid>)> {
        let claim_started = Instant::now();
        let options = ClaimOptions {
            heads: self.heads.load(AtomicOrdering::Relaxed),
            followers: self.followers.load(AtomicOrdering::Relaxed),
            window: self.window.load(AtomicOrdering::Relaxed),
            ..self.claim
        };
        let ClaimedBatch {
            events,
            held_back,
            hold,
            found,
        } = claim_due(&self.pool, &self.table, &options).await?;
        metrics::histogram!(observe::CLAIM_SECONDS).record(claim_started.elapsed().as_secs_f64());
        if self.claim.ordered.is_some() {
            self.adapt_claim(found, (options.heads, options.followers));
        }
        if events.is_empty() {
            crate::claim::release(&self.pool, &self.table, hold, &held_back).await?;
            return Ok((BatchReport::default(), Vec::new()));
        }
        metrics::histogram!(observe::BATCH_SIZE).record(events.len() as f64);
        let started = Instant::now();
        let route_of: Vec<Option<usize>> =
            events.iter().map(|e| self.router.route(&e.topic)).collect();

        let outcomes = tokio::select! {
            outcomes = self.publish_chains(&events, &route_of) => outcomes,
            _ = self.abort.cancelled() => {
                // Shutdown grace is over: give the rows back untouched (no attempt counted); what was
                // already delivered will be delivered again, which at-least-once allows.
                let ids: Vec<Uuid> = events.iter().map(|e| e.id).chain(held_back).collect();
                crate::claim::release(&self.pool, &self.table, hold, &ids).await?;
                warn!(released = events.len(), "shutdown grace period over: released an unfinished batch");
                let report = BatchReport { claimed: events.len(), released: events.len(), ..BatchReport::default() };
                return Ok((report, Vec::new()));
            }
        };

        let attempted =
            events
                .iter()
                .zip(&route_of)
                .zip(&outcomes)
                .filter_map(|((event, route), outcome)| {
                    let outcome = outcome.as_ref()?;
                    let route = route.map(|d| {
                        (
                            self.destinations[d].name.as_str(),
                            &self.destinations[d].retry,
                        )
                    });
                    Some((event, route, outcome))
                });
        let plan = settle::plan(attempted, chrono::Utc::now(), &mut rand::thread_rng());
        for failed in &plan.failed {
            let Some(event) = events.iter().find(|e| e.id == failed.id) else {
                continue;
            };
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
        // Events not attempted (behind a failure of their key) and held-back rows go back as they were.
        let mut untouched: Vec<Uuid> = events
            .iter()
            .zip(&outcomes)
            .filter(|(_, o)| o.is_none())
            .map(|(e, _)| e.id)
            .collect();
        untouched.extend(held_back);
        let settle_started = Instant::now();
        let settled = settle::apply(
            &self.table,
            &self.pool,
            hold,
            &plan,
            self.delete_on_settle,
            &untouched,
            self.claim.ordered,
        )
        .await?;
        metrics::histogram!(observe::SETTLE_SECONDS).record(settle_started.elapsed().as_secs_f64());
        record_outcomes(&events, &plan);
        if settled.fenced > 0 {
            warn!(
                fenced = settled.fenced,
                "lease lost before settle: another relay re-claimed these events"
            );
        }
        let report = BatchReport {
            claimed: events.len(),
            delivered: plan.delivered_count(),
            retried: plan.retry_count(),
            dead: plan.dead_count(),
            fenced: settled.fenced,
            released: untouched.len(),
        };
        debug!(
            claimed = report.claimed,
            delivered = report.delivered,
            retried = report.retried,
            dead = report.dead,
            held_back = report.released,
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

    /// Publishes a batch and returns an outcome per event, `None` for events not attempted.
    ///
    /// Events of an ordered destination that share a key form a chain, published one event after
    /// the other; a chain stops at its first failure, so a later event of a key is never published
    /// before an earlier one succeeded. Chains run side by side, each at its own pace: a slow
    /// request holds back only its own key, not the next step of every other chain. Every other
    /// event is a chain of one; those all go out together in one publish per destination.
    async fn publish_chains(
        &self,
        events: &[OutboxEvent],
        route_of: &[Option<usize>],
    ) -> Vec<Option<Outcome>> {
        let mut singles: Vec<usize> = Vec::new();
        let mut chains: Vec<Vec<usize>> = Vec::new();
        if self.claim.ordered.is_none() {
            // No ordered destination: no chains to build.
            singles = (0..events.len()).collect();
        } else {
            let mut chain_of_key: HashMap<(usize, &str), usize> = HashMap::new();
            for (i, event) in events.iter().enumerate() {
                let ordered_key = match (route_of[i], event.key.as_deref()) {
                    (Some(d), Some(key))
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
        let (single_results, chain_results) = futures::future::join(
            self.publish_together(events, route_of, &singles),
            join_all(
                chains
                    .iter()
                    .map(|chain| self.publish_chain(events, route_of, chain)),
            ),
        )
        .await;
        let mut outcomes: Vec<Option<Outcome>> = vec![None; events.len()];
        for (i, outcome) in single_results
            .into_iter()
            .chain(chain_results.into_iter().flatten())
        {
            outcomes[i] = Some(outcome);
        }
        outcomes
    }

    /// Publishes one key's chain in order, stopping at the first event that neither was delivered
    /// nor may be skipped (`on_dead = "skip"` lets a rejected event's successors go on).
    async fn publish_chain(
        &self,
        events: &[OutboxEvent],
        route_of: &[Option<usize>],
        chain: &[usize],
    ) -> Vec<(usize, Outcome)> {
        let mut results = Vec::with_capacity(chain.len());
        for &i in chain {
            let Some((_, outcome)) = self.publish_together(events, route_of, &[i]).await.pop()
            else {
                break;
            };
            let go_on = match &outcome {
                Outcome::Delivered => true,
                Outcome::Rejected { .. } => {
                    route_of[i].is_some_and(|d| self.config.destinations[d].on_dead == OnDead::Skip)
                }
                Outcome::Retry { .. } => false,
            };
            results.push((i, outcome));
            if !go_on {
                break;
            }
        }
        results
    }

    /// Publishes the events at `indexes`: each destination's share concurrently, each bounded by
    /// `publish_timeout`. Unroutable events get no outcome here (settle dead-letters them).
    async fn publish_together(
        &self,
        events: &[OutboxEvent],
        route_of: &[Option<usize>],
        indexes: &[usize],
    ) -> Vec<(usize, Outcome)> {
        let timeout = self.settings.publish_timeout;
        let publishes = self
            .destinations
            .iter()
            .enumerate()
            .filter_map(|(d, dest)| {
                let members: Vec<usize> = indexes
                    .iter()
                    .copied()
                    .filter(|&i| route_of[i] == Some(d))
                    .collect();
                if members.is_empty() {
                    return None;
                }
                Some(async move {
                    let batch: Vec<&OutboxEvent> = members.iter().map(|&i| &events[i]).collect();
                    let started = Instant::now();
                    let result = tokio::time::timeout(timeout, dest.sink.publish(&batch)).await;
                    metrics::histogram!(observe::PUBLISH_SECONDS, "destination" => dest.name.clone())
                        .record(started.elapsed().as_secs_f64());
                    let outcomes =
                        match result {
                            Ok(o) if o.len() == members.len() => o,
                            Ok(o) => vec![
                                Outcome::retry(format!(
                                    "sink returned {} outcomes for {} events",
                                    o.len(),
                                    members.len()
                                ));
                                members.len()
                            ],
                            Err(_) => vec![
                                Outcome::retry(format!(
                                    "publish_timeout of {} reached",
                                    humantime::format_duration(timeout)
                                ));
                                members.len()
                            ],
                        };
                    members.into_iter().zip(outcomes).collect::<Vec<_>>()
                })
            });
        let mut results: Vec<(usize, Outcome)> =
            join_all(publishes).await.into_iter().flatten().collect();
        // Unroutable events: an outcome is still needed to settle them (as dead).
        results.extend(
            indexes
                .iter()
                .filter(|&&i| route_of[i].is_none())
                .map(|&i| {
                    (
                        i,
                        Outcome::Rejected {
                            reason: "unroutable".into(),
                        },
                    )
                }),
        );
        results
    }

    /// Runs until `shutdown` is cancelled: claim workers plus the periodic cleanup.
    /// In-flight batches then get `shutdown_grace` to finish; past it they are released unsettled.
    pub async fn run(self: Arc<Self>, shutdown: CancellationToken) -> Result<BatchReport> {
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
        let mut tasks = Vec::new();
        for worker in 0..self.settings.workers {
            let relay = Arc::clone(&self);
            let shutdown = shutdown.clone();
            tasks.push(tokio::spawn(
                async move { relay.worker(worker, shutdown).await },
            ));
        }
        let cleanup = {
            let relay = Arc::clone(&self);
            let shutdown = shutdown.clone();
            tokio::spawn(async move { relay.cleanup_loop(shutdown).await })
        };
        let mut total = BatchReport::default();
        for task in tasks {
            if let Ok(report) = task.await {
                total += report;
            }
        }
        cleanup.abort();
        grace_timer.abort();
        Ok(total)
    }

    async fn worker(&self, worker: usize, shutdown: CancellationToken) -> BatchReport {
        let mut total = BatchReport::default();
        let mut backoff = Duration::from_millis(100);
        let mut idle_pause = self.settings.min_poll_interval;
        let mut db_down = false;
        while !shutdown.is_cancelled() {
            let pause = match self.run_batch().await {
                Ok(report) => {
                    if db_down {
                        info!(worker, "database reachable again, relaying");
                        db_down = false;
                    }
                    backoff = Duration::from_millis(100);
                    total += report;
                    if report.claimed > 0 {
                        // Busy: look again at once. The claim is an index range scan that finds
                        // nothing quickly, so this costs little and keeps latency at milliseconds.
                        idle_pause = self.settings.min_poll_interval;
                        continue;
                    }
                    // Idle: back off exponentially up to poll_interval, so an idle relay costs
                    // a few cheap queries per second and no measurable CPU.
                    let pause = idle_pause;
                    idle_pause = (idle_pause * 2).min(self.settings.poll_interval);
                    pause
                }
                Err(e) => {
                    metrics::counter!(observe::DB_ERRORS_TOTAL).increment(1);
                    warn!(worker, error = %crate::error_chain(&e), retry_in_ms = backoff.as_millis() as u64, "claim or settle failed; retrying");
                    db_down = true;
                    let pause = backoff;
                    backoff = (backoff * 2).min(MAX_DB_BACKOFF);
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
            let options = crate::cleanup::CleanupOptions::from_config(&self.config);
            match crate::cleanup::run_if_leader(&self.pool, &self.table, &options).await {
                Ok(Some(r)) if r.deleted() > 0 => info!(
                    published = r.deleted_published,
                    dead = r.deleted_dead,
                    batches = r.batches,
                    longest_batch_ms = r.longest_batch.as_millis() as u64,
                    "cleanup deleted old rows"
                ),
                Ok(_) => {}
                Err(e) => warn!(error = %crate::error_chain(&e), "cleanup failed; will try again"),
            }
            // Rows parked behind a dead row that cleanup (or an operator) removed, or parked under
            // an `on_dead = "block"` that is now "skip", are due again.
            let dead_blocks = self.claim.ordered.unwrap_or(false);
            match settle::unpark_followers(&self.table, &self.pool, dead_blocks).await {
                Ok(n) if n > 0 => {
                    info!(rows = n, "rows no longer behind a dead event are due again")
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
    /// Events that fail are scheduled per their policy; one that comes due again within the run
    /// (a zero retry delay) is not retried in a loop: the run ends when a batch holds only such.
    pub async fn run_once(&self) -> Result<BatchReport> {
        let mut total = BatchReport::default();
        let mut failed_before: HashSet<Uuid> = HashSet::new();
        let mut unbounded_tried = false;
        loop {
            let (report, retried) = self.process_batch().await?;
            total += report;
            let only_repeats = report.delivered == 0
                && report.dead == 0
                && !retried.is_empty()
                && retried.iter().all(|id| failed_before.contains(id));
            if report.claimed == 0 && self.claim.ordered.is_some() && !unbounded_tried {
                // Ordered: an empty claim only saw the window; make sure nothing further on is due.
                unbounded_tried = true;
                self.window
                    .store(crate::claim::WINDOW_UNBOUNDED_FROM, AtomicOrdering::Relaxed);
                continue;
            }
            if report.claimed == 0 || only_repeats {
                return Ok(total);
            }
            unbounded_tried = false;
            failed_before.extend(retried);
        }
    }
}

/// Counts a settled batch's outcomes per (destination, topic): one metric update per group, not
/// per event, to keep the hot path cheap.
fn record_outcomes(events: &[OutboxEvent], plan: &settle::SettlePlan) {
    let by_id: HashMap<Uuid, &OutboxEvent> = events.iter().map(|e| (e.id, e)).collect();
    let now = chrono::Utc::now();
    for (destination, ids) in &plan.delivered {
        let mut per_topic: HashMap<&str, u64> = HashMap::new();
        let latency = metrics::histogram!(observe::COMMIT_TO_PUBLISH_SECONDS, "destination" => destination.clone());
        for id in ids {
            if let Some(e) = by_id.get(id) {
                *per_topic.entry(e.topic.as_str()).or_default() += 1;
                latency.record(
                    (now - e.created_at).num_microseconds().unwrap_or(0).max(0) as f64 / 1e6,
                );
            }
        }
        for (topic, n) in per_topic {
            metrics::counter!(observe::PUBLISHED_TOTAL, "destination" => destination.clone(), "topic" => topic.to_owned())
                .increment(n);
        }
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
    for ((destination, topic, dead), n) in failures {
        let name = if dead {
            observe::DEAD_LETTERED_TOTAL
        } else {
            observe::FAILED_TOTAL
        };
        metrics::counter!(name, "destination" => destination.to_owned(), "topic" => topic.to_owned()).increment(n);
    }
}
