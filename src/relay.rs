//! The relay: claim → route → publish → settle, in a loop, on a few claim workers.
//!
//! Each worker claims a batch, routes every event to its destination, publishes each destination's
//! share concurrently (bounded by `publish_timeout`), and settles the whole batch in one or two
//! statements. Database errors (a PostgreSQL restart) are logged and retried with backoff; a bad
//! event never stops the relay: it is retried or dead-lettered.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::join_all;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};
use uuid::Uuid;

use crate::claim::{claim_due, ClaimedBatch};
use crate::config::{Config, RelayConfig};
use crate::error::Result;
use crate::publish::{self, Outcome, Sink};
use crate::retry::RetryPolicy;
use crate::route::Router;
use crate::settle::{self, Route};
use crate::table::OutboxTable;

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
        Self {
            pool,
            table: config.table.clone(),
            router: Router::new(&config.destinations),
            destinations,
            settings: config.relay.clone(),
            delete_on_settle: config.retention.is_zero(),
            config: config.clone(),
            abort: CancellationToken::new(),
        }
    }

    /// The connection pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Claims, publishes and settles one batch.
    pub async fn run_batch(&self) -> Result<BatchReport> {
        Ok(self.process_batch().await?.0)
    }

    /// One batch; also returns the ids scheduled for another attempt.
    async fn process_batch(&self) -> Result<(BatchReport, Vec<Uuid>)> {
        let ClaimedBatch { events, hold } = claim_due(
            &self.pool,
            &self.table,
            self.settings.claim,
            self.settings.batch_size,
            self.settings.publish_timeout * 2,
        )
        .await?;
        if events.is_empty() {
            if let crate::claim::Hold::Transaction(tx) = hold {
                tx.commit().await?;
            }
            return Ok((BatchReport::default(), Vec::new()));
        }
        let started = Instant::now();

        // Route: one index list per destination; unroutable events get no route.
        let route_of: Vec<Option<usize>> =
            events.iter().map(|e| self.router.route(&e.topic)).collect();
        let mut outcomes: Vec<Outcome> = vec![Outcome::retry("not published"); events.len()];
        let publishes = self
            .destinations
            .iter()
            .enumerate()
            .filter_map(|(d, dest)| {
                let members: Vec<usize> = (0..events.len())
                    .filter(|&i| route_of[i] == Some(d))
                    .collect();
                if members.is_empty() {
                    return None;
                }
                let batch: Vec<_> = members.iter().map(|&i| &events[i]).collect();
                let timeout = self.settings.publish_timeout;
                Some(async move {
                    let result = tokio::time::timeout(timeout, dest.sink.publish(&batch)).await;
                    let outcomes = match result {
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
                    (members, outcomes)
                })
            });
        let published = tokio::select! {
            results = join_all(publishes) => results,
            _ = self.abort.cancelled() => {
                // Shutdown grace is over: give the rows back untouched (no attempt counted); what was
                // already delivered will be delivered again, which at-least-once allows.
                let ids: Vec<Uuid> = events.iter().map(|e| e.id).collect();
                crate::claim::release(&self.pool, &self.table, hold, &ids).await?;
                warn!(released = events.len(), "shutdown grace period over: released an unfinished batch");
                let report = BatchReport { claimed: events.len(), released: events.len(), ..BatchReport::default() };
                return Ok((report, Vec::new()));
            }
        };
        for (members, results) in published {
            for (i, outcome) in members.into_iter().zip(results) {
                outcomes[i] = outcome;
            }
        }

        let routes: Vec<Route<'_>> = route_of
            .iter()
            .map(|r| {
                r.map(|d| {
                    (
                        self.destinations[d].name.as_str(),
                        &self.destinations[d].retry,
                    )
                })
            })
            .collect();
        let plan = settle::plan(
            &events,
            &routes,
            &outcomes,
            chrono::Utc::now(),
            &mut rand::thread_rng(),
        );
        for (event, failed) in plan
            .failed
            .iter()
            .filter_map(|f| events.iter().find(|e| e.id == f.id).map(|e| (e, f)))
        {
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
        let settled =
            settle::apply(&self.table, &self.pool, hold, &plan, self.delete_on_settle).await?;
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
            released: 0,
        };
        debug!(
            claimed = report.claimed,
            delivered = report.delivered,
            retried = report.retried,
            dead = report.dead,
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
                    if report.claimed >= self.settings.batch_size {
                        continue;
                    }
                    self.settings.poll_interval
                }
                Err(e) => {
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
        }
    }

    /// Processes everything due now, then returns: for cron-style runs (`relay --once`).
    ///
    /// Events that fail are scheduled per their policy; one that comes due again within the run
    /// (a zero retry delay) is not retried in a loop: the run ends when a batch holds only such.
    pub async fn run_once(&self) -> Result<BatchReport> {
        let mut total = BatchReport::default();
        let mut failed_before: HashSet<Uuid> = HashSet::new();
        loop {
            let (report, retried) = self.process_batch().await?;
            total += report;
            let only_repeats = report.delivered == 0
                && report.dead == 0
                && !retried.is_empty()
                && retried.iter().all(|id| failed_before.contains(id));
            if report.claimed == 0 || only_repeats {
                return Ok(total);
            }
            failed_before.extend(retried);
        }
    }
}
