//! The claim workers (the poll source's side of the engine): each claims due rows, hands the
//! batch to the pipeline, and goes on; an idle relay polls with one cheap statement instead, and
//! the claim watermark is kept beside them.
//!
//! Each batch runs as a task of its own; when one of its lanes is done while another is not, the
//! worker goes on to its next claim while the task waits, with at most one such batch waiting
//! per worker. A claimed batch's [`Origin`] is its claim's guard: the claiming transaction or
//! the lease token, which every write of its settle presents.

use std::sync::atomic::{AtomicUsize, Ordering as AtomicOrdering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use opentelemetry::KeyValue;
use tokio::sync::{oneshot, Notify};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};
use uuid::Uuid;

use super::context::Context;
use super::pacing::{db_reachable, quiet_worker_polls, wakes_quiet_workers, Pacing, Sizing};
use super::pipeline::{self, Origin, Read, Settling};
use crate::error::{Error, Result};
use crate::model::event::OutboxEvent;
use crate::model::metric;
use crate::model::report::BatchReport;
use crate::settle::Settled;
use crate::sources::poll::{claim_due, release, ClaimedBatch};
use crate::sources::watermark::{self, Watermark};
use crate::store::outbox::{self, Guard};
use crate::store::Store;

/// A batch task's result.
type BatchResult = Result<Settled>;

/// The claim workers of one relay and what they share.
pub(super) struct Claimers {
    ctx: Arc<Context>,
    /// Ordered mode: the next claim's heads, followers and window.
    sizing: Sizing,
    /// Held by the one quiet claim worker that polls for due rows; the other quiet workers wait
    /// on `wake`, so an idle relay costs one poll per `poll_interval` whatever `workers` is.
    idle_poller: tokio::sync::Mutex<()>,
    /// Wakes quiet claim workers: the poller found due rows, or a claim filled its batch (a
    /// backlog: every worker should claim).
    wake: Notify,
    /// Claim workers whose last claim found rows; while one is busy (and its batches are quick)
    /// the quiet ones do not poll (see [`quiet_worker_polls`]).
    busy_workers: AtomicUsize,
    /// When the last claim of any worker started.
    claim_started: std::sync::Mutex<Instant>,
    /// Where claims start their walk of the due range (kept by [`Claimers::watermark_loop`]).
    watermark: Watermark,
}

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

impl Claimers {
    /// The claim workers of the relay of `ctx`.
    pub(super) fn new(ctx: Arc<Context>) -> Self {
        Self {
            sizing: Sizing::new(ctx.config.relay.batch_size),
            ctx,
            idle_poller: tokio::sync::Mutex::new(()),
            wake: Notify::new(),
            busy_workers: AtomicUsize::new(0),
            claim_started: std::sync::Mutex::new(Instant::now()),
            watermark: Watermark::default(),
        }
    }

    /// Claims, publishes and settles one batch. `signals` tell the claim loop when it may go on
    /// while this batch waits for a lane behind, and when the batch has settled all but the
    /// requests still out of the lanes it handed over.
    pub(super) async fn batch(&self, signals: Signals) -> Result<Settled> {
        let ctx = &self.ctx;
        let claim_started = Instant::now();
        // Everything the claim holds is bounded by `publish_timeout` from the claim.
        let deadline = tokio::time::Instant::now() + ctx.config.relay.publish_timeout;
        let claim_wall = std::time::SystemTime::now();
        let options = self.sizing.options(&ctx.claim);
        let watermark = self.watermark.current(claim_started);
        let ClaimedBatch {
            events,
            poison,
            cut_off,
            guard,
            found,
        } = claim_due(&ctx.store, &options, &ctx.blocking, watermark).await?;
        metrics::histogram!(metric::CLAIM_SECONDS).record(claim_started.elapsed().as_secs_f64());
        let batch_size = ctx.config.relay.batch_size;
        if ctx.claim.ordered {
            self.sizing
                .adapt(found, (options.heads, options.followers), batch_size);
        }
        if events.is_empty() && poison.is_empty() {
            release(&ctx.store, guard, &cut_off).await?;
            return Ok(Settled::default());
        }
        ctx.progressed();
        ctx.progress.fresh();
        crate::otlp::batch_span("claim", claim_wall, || {
            vec![
                KeyValue::new("pgoutbox.events", events.len() as i64),
                KeyValue::new("pgoutbox.poison", poison.len() as i64),
                KeyValue::new("pgoutbox.table", ctx.store.table().to_string()),
            ]
        });
        let token = match &guard {
            Guard::Lease(token) => *token,
            // Rows handed over with their request out are settled later under a lease: the
            // claim's own in lease mode, a new one otherwise.
            Guard::Transaction(_) | Guard::Nothing => Uuid::new_v4(),
        };
        let mut origin = Claimed {
            guard: Some(guard),
            cut_off,
            token,
            signals,
        };
        let read = Read {
            events,
            poison: &poison,
            deadline,
        };
        pipeline::run(ctx, read, &mut origin).await
    }

    /// One claim loop (see the module's documentation).
    pub(super) async fn worker(
        self: Arc<Self>,
        worker: usize,
        shutdown: CancellationToken,
    ) -> BatchReport {
        let mut total = BatchReport::default();
        let settings = &self.ctx.config.relay;
        let mut pacing = Pacing::new(settings);
        let what = format!("claim worker {worker}");
        let batch_size = settings.batch_size;
        let mut db_down = false;
        // The batch the claim loop went on from, while it still holds its claim: one at a time.
        let mut waiting: Option<Waiting> = None;
        // Batches that settled all but the requests still out of lanes they handed over: they
        // hold no claim, and a request that hangs keeps one only until its budget ends.
        let mut stragglers = tokio::task::JoinSet::new();
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
                let poll_interval = settings.poll_interval;
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
                    Err(e) => Some(db_failed(worker, &mut pacing, &mut db_down, &e)),
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
            let started = Instant::now();
            *self.claim_started.lock().unwrap_or_else(|e| e.into_inner()) = started;
            while let Some(joined) = stragglers.try_join_next() {
                total += report_of(worker, joined_batch(joined));
            }
            let (signals, mut detached, settled) = Signals::new();
            let claimers = Arc::clone(&self);
            let mut batch = tokio::spawn(async move { claimers.batch(signals).await });
            let result = tokio::select! {
                joined = &mut batch => joined_batch(joined).map(|s| (s.report.claimed, s.report)),
                Ok(()) = &mut detached => {
                    // A lane of it is behind: claim on while the batch waits; its report is
                    // counted when it ends.
                    if let Some(previous) = waiting.replace(Waiting { batch, settled }) {
                        total += previous.until_settled(&mut stragglers, worker).await;
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
                        if wakes_quiet_workers(found, batch_size, self.ctx.claim.ordered) {
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
                    db_failed(worker, &mut pacing, &mut db_down, &e)
                }
            };
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep(pause) => {}
            }
        }
        if let Some(previous) = waiting {
            total += report_of(worker, joined_batch(previous.batch.await));
        }
        while let Some(joined) = stragglers.join_next().await {
            total += report_of(worker, joined_batch(joined));
        }
        total
    }

    /// OutboxAnyDue: is a row due now (from the watermark)?
    async fn any_due(&self) -> Result<bool> {
        let watermark = self.watermark.current(Instant::now());
        outbox::any_due(&self.ctx.store, watermark).await
    }

    /// Keeps the claim watermark (see [`crate::sources::watermark`]) until shutdown. A failed read
    /// is logged at debug only: the claims fail too and say so, and a stale watermark is not used.
    pub(super) async fn watermark_loop(&self, shutdown: CancellationToken) {
        loop {
            if let Err(e) = self.watermark.refresh(&self.ctx.store).await {
                debug!(error = %crate::error_chain(&e), "reading the claim watermark failed");
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(watermark::EVERY) => {}
            }
        }
    }

    /// The whole due range for the next claim (`relay --once` checks it before it ends).
    pub(super) fn unbounded(&self) {
        self.sizing.unbounded();
    }
}

/// A claimed batch's origin: the claim's guard, and the rows behind their key.
struct Claimed {
    /// What holds the rows until the settle (taken by it).
    guard: Option<Guard>,
    /// Ordered mode: rows claimed and cut off behind their key's first row that is not due, given
    /// back.
    cut_off: Vec<Uuid>,
    /// The lease of what the batch hands over with its request out.
    token: Uuid,
    /// What the claim loop is told while the batch runs.
    signals: Signals,
}

/// What a batch tells its claim loop: that the loop may go on while it waits for a lane behind
/// (`detach`), and that it has settled all but the requests still out (`settled`).
#[derive(Default)]
pub(super) struct Signals {
    detach: Option<oneshot::Sender<()>>,
    settled: Option<oneshot::Sender<()>>,
}

impl Signals {
    /// A batch's signals and the claim loop's ends of them.
    fn new() -> (Self, oneshot::Receiver<()>, oneshot::Receiver<()>) {
        let (detach, detached) = oneshot::channel();
        let (settled, settled_rx) = oneshot::channel();
        let signals = Self {
            detach: Some(detach),
            settled: Some(settled),
        };
        (signals, detached, settled_rx)
    }

    /// Signals nobody: a batch run outside a claim loop.
    pub(super) fn none() -> Self {
        Self::default()
    }
}

/// A batch the claim loop went on from, and its `settled` signal.
struct Waiting {
    batch: tokio::task::JoinHandle<BatchResult>,
    settled: oneshot::Receiver<()>,
}

impl Waiting {
    /// Waits until the batch has settled: then it holds no claim any more, and if requests of it
    /// are still out (a destination that hangs), it joins `stragglers` rather than holding up
    /// the claim loop until its budget ends. The report of a batch that ended.
    async fn until_settled(
        mut self,
        stragglers: &mut tokio::task::JoinSet<BatchResult>,
        worker: usize,
    ) -> BatchReport {
        tokio::select! {
            joined = &mut self.batch => report_of(worker, joined_batch(joined)),
            Ok(()) = &mut self.settled => {
                let batch = self.batch;
                // A panic in it still goes on up to the worker, through the straggler's join.
                stragglers.spawn(async move { joined_batch(batch.await) });
                BatchReport::default()
            }
        }
    }
}

impl Claimed {
    fn signal(&mut self) {
        if let Some(signal) = self.signals.detach.take() {
            let _ = signal.send(());
        }
    }
}

impl Origin for Claimed {
    fn lease_token(&self) -> Uuid {
        self.token
    }

    fn settling(&mut self) -> Settling<'_> {
        Settling {
            guard: self.guard.take().unwrap_or(Guard::Nothing),
            origin: crate::settle::Origin::Claimed,
            cut_off: &self.cut_off,
        }
    }

    async fn release(
        &mut self,
        store: &Store,
        events: &[OutboxEvent],
        poison: &[(Uuid, String)],
    ) -> Result<()> {
        let claimed: Vec<Uuid> = events
            .iter()
            .map(|e| e.id)
            .chain(poison.iter().map(|(id, _)| *id))
            .chain(self.cut_off.iter().copied())
            .collect();
        match self.guard.take() {
            Some(guard) => release(store, guard, &claimed).await,
            None => Ok(()),
        }
    }

    fn detach(&mut self) {
        self.signal();
    }

    fn settled_early(&mut self, _early: &Settled) {
        self.signal();
        if let Some(settled) = self.signals.settled.take() {
            let _ = settled.send(());
        }
    }
}

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

/// A claim loop's database error (poll, claim or settle): counted, logged, and the pause before
/// the next try.
fn db_failed(worker: usize, pacing: &mut Pacing, db_down: &mut bool, e: &Error) -> Duration {
    metrics::counter!(metric::DB_ERRORS_TOTAL).increment(1);
    let pause = pacing.failed();
    warn!(worker, error = %crate::error_chain(e), retry_in_ms = pause.as_millis() as u64, "claim or settle failed; retrying");
    *db_down = true;
    pause
}

/// A finished batch's report; a database error is logged (its rows are claimed again).
fn report_of(worker: usize, result: BatchResult) -> BatchReport {
    match result {
        Ok(settled) => settled.report,
        Err(e) => {
            metrics::counter!(metric::DB_ERRORS_TOTAL).increment(1);
            warn!(worker, error = %crate::error_chain(&e), "settling a batch failed; its events will be claimed again");
            BatchReport::default()
        }
    }
}
