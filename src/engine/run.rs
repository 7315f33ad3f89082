//! Running the relay: its loops until shutdown, or one pass (`relay --once`).

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering as AtomicOrdering};
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{debug, error, warn};
use uuid::Uuid;

use super::pacing::{db_reachable, quiet_worker_polls, wakes_quiet_workers, Pacing};
use super::report::{panic_message, BatchReport};
use super::Relay;
use crate::config::Source;
use crate::error::{Error, Result};
use crate::model::metric;
use crate::sources::watermark;
use crate::store::{outbox, waiting};

/// Counts a claim worker among the busy ones while its last claim found rows, until it ends.
struct Busy<'a> {
    count: &'a AtomicUsize,
    on: bool,
}

impl Busy<'_> {
    fn set(&mut self, on: bool) {
        if on != std::mem::replace(&mut self.on, on) {
            if on {
                self.count.fetch_add(1, AtomicOrdering::Relaxed);
            } else {
                self.count.fetch_sub(1, AtomicOrdering::Relaxed);
            }
        }
    }
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.set(false);
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

impl Relay {
    /// Runs until `shutdown` is cancelled: the source (claim workers, or the WAL reader), each
    /// lane's retry loop, and the maintenance loops (destination state and probes, upkeep). In-flight batches then get `shutdown_grace` to finish; past it
    /// they settle what finished and release the rest. A worker that panics (a bug) stops the
    /// relay: the others finish as on shutdown, then this returns [`Error::WorkerPanicked`].
    pub async fn run(self: Arc<Self>, shutdown: CancellationToken) -> Result<BatchReport> {
        self.prepare().await;
        let grace_timer = {
            let (shutdown, stopping, abort, grace) = (
                shutdown.clone(),
                self.stopping.clone(),
                self.abort.clone(),
                self.config.relay.shutdown_grace,
            );
            tokio::spawn(async move {
                shutdown.cancelled().await;
                stopping.cancel();
                tokio::time::sleep(grace).await;
                abort.cancel();
            })
        };
        let mut workers = tokio::task::JoinSet::new();
        match self.config.source {
            Source::Poll => {
                let relay = Arc::clone(&self);
                let watermark_shutdown = shutdown.clone();
                workers.spawn(async move {
                    relay.watermark_loop(watermark_shutdown).await;
                    BatchReport::default()
                });
                for worker in 0..self.config.relay.workers {
                    let relay = Arc::clone(&self);
                    let shutdown = shutdown.clone();
                    workers.spawn(async move { relay.worker(worker, shutdown).await });
                }
            }
            // One reader per slot: the WAL source replaces the claim workers.
            Source::Wal => {
                let relay = Arc::clone(&self);
                let shutdown = shutdown.clone();
                workers.spawn(async move { crate::sources::wal::run(relay, shutdown).await });
            }
        }
        for d in 0..self.lanes.len() {
            let relay = Arc::clone(&self);
            let shutdown = shutdown.clone();
            workers.spawn(async move { relay.retries_loop(d, shutdown).await });
        }
        let maintenance = {
            let relay = Arc::clone(&self);
            let shutdown = shutdown.clone();
            tokio::spawn(async move {
                tokio::join!(
                    relay.cleanup_loop(shutdown.clone()),
                    relay.replays_loop(shutdown.clone()),
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
    pub(super) async fn prepare(&self) {
        let steps = async {
            self.create_backfills().await?;
            self.register().await?;
            self.sync().await?;
            waiting::unpark_followers(&self.store).await
        };
        if let Err(e) = steps.await {
            warn!(error = %crate::error_chain(&e), "cannot read the destinations' state yet; will try again");
        }
        self.ensure_history().await;
    }

    /// One claim loop. Each batch runs as a task of its own; when one of its lanes is done while
    /// another is not (see [`Relay::process_batch`]), the loop goes on to its next claim while the
    /// task waits, with at most one such batch waiting per worker.
    pub(super) async fn worker(
        self: Arc<Self>,
        worker: usize,
        shutdown: CancellationToken,
    ) -> BatchReport {
        let mut total = BatchReport::default();
        let mut pacing = Pacing::new(&self.config.relay);
        let what = format!("claim worker {worker}");
        let batch_size = self.config.relay.batch_size;
        let mut db_down = false;
        let mut waiting: Option<tokio::task::JoinHandle<BatchResult>> = None;
        let mut quiet = false;
        let mut busy = Busy {
            count: &self.busy_workers,
            on: false,
        };
        while !shutdown.is_cancelled() {
            // After an empty claim, poll with one cheap statement and claim only once there is
            // something: an idle relay's cost is a few index probes per second, not transactions.
            // One quiet worker polls, and only while no worker is busy with quick batches; the
            // others wait until it (or a busy worker's full batch) wakes them.
            if quiet {
                let woken = self.wake.notified();
                let poll_interval = self.config.relay.poll_interval;
                let since_claim = self
                    .claim_started
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .elapsed();
                let busy_workers = self.busy_workers.load(AtomicOrdering::Relaxed);
                let polls = quiet_worker_polls(busy_workers, since_claim, poll_interval);
                let poller = polls.then(|| self.idle_poller.try_lock().ok()).flatten();
                let Some(_poller) = poller else {
                    // Another worker claims or polls. Look again once a busy worker's batch has
                    // run `poll_interval`, or when the poller stopped without waking anyone.
                    let look_again = if polls {
                        poll_interval
                    } else {
                        poll_interval.saturating_sub(since_claim)
                    };
                    tokio::select! {
                        _ = shutdown.cancelled() => break,
                        _ = woken => {
                            quiet = false;
                            pacing.busy();
                        }
                        _ = tokio::time::sleep(look_again.max(Duration::from_millis(1))) => {}
                    }
                    continue;
                };
                let pause = match self.any_due().await {
                    Ok(true) => None,
                    Ok(false) => {
                        db_reachable(&what, &mut db_down);
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
            let started = std::time::Instant::now();
            *self.claim_started.lock().unwrap_or_else(|e| e.into_inner()) = started;
            let (signal, detached) = tokio::sync::oneshot::channel();
            let relay = Arc::clone(&self);
            let mut batch = tokio::spawn(async move { relay.process_batch(Some(signal)).await });
            let result = tokio::select! {
                joined = &mut batch => joined_batch(joined).map(|(report, _)| (report.claimed, report)),
                Ok(()) = detached => {
                    // A lane of it is behind: claim on while the batch waits; its report is
                    // counted when it ends.
                    if let Some(previous) = waiting.replace(batch) {
                        total += self.report_of(worker, joined_batch(previous.await));
                    }
                    // A lane of it is behind: the next batch goes at once.
                    Ok((batch_size, BatchReport::default()))
                }
            };
            let pause = match result {
                Ok((found, report)) => {
                    db_reachable(&what, &mut db_down);
                    if found > 0 {
                        total += report;
                        quiet = false;
                        busy.set(true);
                        if wakes_quiet_workers(found, batch_size, self.claim.ordered) {
                            self.wake.notify_waiters();
                        }
                        let pause = pacing.after_batch(found, batch_size, started.elapsed());
                        if pause.is_zero() {
                            continue;
                        }
                        tokio::select! {
                            _ = shutdown.cancelled() => break,
                            _ = tokio::time::sleep(pause) => {}
                        }
                        continue;
                    }
                    quiet = true;
                    busy.set(false);
                    pacing.idle()
                }
                Err(e) => {
                    busy.set(false);
                    self.db_failed(worker, &mut pacing, &mut db_down, &e)
                }
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

    /// OutboxAnyDue: is a row due now (from the watermark)?
    pub(super) async fn any_due(&self) -> Result<bool> {
        outbox::any_due(
            &self.store,
            self.watermark.current(std::time::Instant::now()),
        )
        .await
    }

    /// Keeps the claim watermark (see [`crate::sources::watermark`]) until shutdown. A failed read
    /// is logged at debug only: the claims fail too and say so, and a stale watermark is not used.
    pub(super) async fn watermark_loop(&self, shutdown: CancellationToken) {
        loop {
            if let Err(e) = self.watermark.refresh(&self.store).await {
                debug!(error = %crate::error_chain(&e), "reading the claim watermark failed");
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(watermark::EVERY) => {}
            }
        }
    }

    /// A claim loop's database error (poll, claim or settle): counted, logged, and the pause
    /// before the next try.
    pub(super) fn db_failed(
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
    pub(super) fn report_of(
        &self,
        worker: usize,
        result: Result<(BatchReport, Vec<Uuid>)>,
    ) -> BatchReport {
        match result {
            Ok((report, _)) => report,
            Err(e) => {
                metrics::counter!(metric::DB_ERRORS_TOTAL).increment(1);
                warn!(worker, error = %crate::error_chain(&e), "settling a batch failed; its events will be claimed again");
                BatchReport::default()
            }
        }
    }

    /// Processes everything due now, then returns: for cron-style runs (`relay --once`).
    ///
    /// Destinations paused or with an open breaker keep their events held (no probe is sent).
    /// Events that fail are scheduled per their policy; one that comes due again within the run
    /// (a zero retry delay) is not retried in a loop: the run ends when a batch holds only such.
    pub async fn run_once(&self) -> Result<BatchReport> {
        self.register().await?;
        self.sync().await?;
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
                self.sizing.unbounded();
                continue;
            }
            if report.claimed == 0 || only_repeats {
                break;
            }
            unbounded_tried = false;
            failed_before.extend(retried);
        }
        // Then every lane's due pairs, until none is due or a round only failed again.
        loop {
            let report = self.run_deliveries_batch().await?;
            total += report;
            if report.claimed == 0 || report.delivered + report.dead == 0 {
                return Ok(total);
            }
        }
    }
}
