//! The engine's side of the WAL source: publishing and settling batches read from the slot.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::{debug, warn};
use uuid::Uuid;

use super::batch::{BatchRun, Items, Route, STRAGGLER_CHECK};
use super::report::BatchReport;
use super::Relay;
use crate::error::Result;
use crate::model::event::OutboxEvent;
use crate::model::metric;
use crate::model::outcome::Outcome;
use crate::settle;
use crate::sources::poll::Hold;
use crate::store::{deliveries, outbox};

impl Relay {
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
    pub(super) async fn finish_stragglers(
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
    pub(super) async fn settle_wal(
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
}

/// How a batch read from the WAL settles, unlike a claimed one: an event that did not reach a
/// destination goes on as a deliveries pair (never retried on its row, which no claim reads), and
/// nothing is given back.
pub(super) struct WalSettle {
    /// Delivered events that have no table row (`emit()` messages): nothing to write for them.
    pub(super) rowless: HashSet<Uuid>,
    /// Out: the rows delivered everywhere, which the settle leaves to the WAL processor to write
    /// with other batches' (`settle::write_delivered`).
    pub(super) rows: settle::DeliveredRows,
    /// For a batch settled without its stragglers: how long their pairs wait (their requests are
    /// still out).
    pub(super) linger: Option<Duration>,
}
