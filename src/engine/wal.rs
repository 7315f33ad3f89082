//! The engine's side of the WAL source: publishing and settling batches read from the slot.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::oneshot;
use tracing::warn;
use uuid::Uuid;

use super::batch::{Run, Watch};
use super::drive::{in_flight_lease, Stop};
use super::items::Dispatch;
use super::settle_batch::{Origin, Results};
use super::Relay;
use crate::config::Config;
use crate::error::Result;
use crate::model::event::OutboxEvent;
use crate::model::metric;
use crate::model::outcome::Outcome;
use crate::settle::plan::InFlightLease;
use crate::settle::{self, DeliveredRows};
use crate::sources::wal::{WalBatch, WalEngine, WalSettled};
use crate::store::outbox;
use crate::store::outbox::Guard;
use crate::store::Store;

impl WalEngine for Relay {
    fn config(&self) -> &Config {
        &self.config
    }

    fn store(&self) -> &Store {
        &self.store
    }

    fn keeps_key_order(&self) -> bool {
        self.claim.ordered
    }

    fn publish(
        self: Arc<Self>,
        batch: WalBatch,
        settled: oneshot::Sender<WalSettled>,
    ) -> impl std::future::Future<Output = ()> + Send + 'static {
        self.process_wal_batch(batch, settled)
    }

    async fn write_rows(self: Arc<Self>, rows: DeliveredRows) -> Result<u64> {
        self.write_wal_rows(&rows).await
    }

    fn unconfirmed_since(&self, since: Option<Instant>) {
        self.progress.wal_waiting(since);
    }
}

impl Relay {
    /// WAL source: publishes and settles one batch read from the slot ([`crate::sources::wal`]).
    ///
    /// Routed and published like a claimed batch, within `publish_timeout`; then settled so that
    /// nothing of it needs the slot again: delivered rows are marked published (or deleted), and
    /// every (event, destination) that was not delivered (failed, held, unanswered, waiting behind
    /// its key, or handed over with its lane) becomes a deliveries pair that its lane retries.
    /// `emit()` events have no row: the ones that were not delivered everywhere get one first, in
    /// the settle's transaction, so that their pairs and dead letters have the row the deliveries
    /// table and the console expect; delivered ones cost no write at all. A database error is
    /// returned: the batch stays unconfirmed, and the WAL source ends its session so that it is
    /// read again (and published again) once the database answers. Retrying the settle while
    /// holding the stream would be worse: a PostgreSQL shutdown waits for the stream's client to
    /// confirm the last position, and would wait forever for a relay that cannot reach it.
    async fn process_wal_batch(
        self: Arc<Self>,
        batch: WalBatch,
        settled: oneshot::Sender<WalSettled>,
    ) {
        let WalBatch {
            events,
            poison,
            rowless,
        } = batch;
        let timeout = self.config.relay.publish_timeout;
        let deadline = tokio::time::Instant::now() + timeout;
        metrics::histogram!(metric::BATCH_SIZE).record((events.len() + poison.len()) as f64);
        let items = match self.items(&events).await {
            Ok(items) => items,
            Err(e) => {
                let _ = settled.send(Err(e));
                return;
            }
        };
        let run = Run::new(&events, &items, self.lanes.len(), deadline);
        let mut watch = Watch::new(&run, self.lanes.len());
        let mut publish = Box::pin(tokio::time::timeout_at(deadline, self.publish_run(&run)));
        let stop = self
            .drive(&run, publish.as_mut(), &mut watch, &mut None)
            .await;
        let batch = WalBatchRef {
            events: &events,
            poison: &poison,
            rowless: &rowless,
        };
        let lanes = match stop {
            Stop::Done | Stop::Aborted => {
                let aborted = stop == Stop::Aborted;
                let (answers, started) = run.finish(aborted, &self.lanes, timeout);
                let handed = vec![false; self.lanes.len()];
                let results = Results {
                    events: &events,
                    items: &items,
                    answers: &answers,
                    started: &started,
                    handed: &handed,
                };
                let result = self
                    .settle_wal(
                        &batch,
                        &results,
                        (Uuid::nil(), InFlightLease(timeout)),
                        aborted,
                    )
                    .await;
                let _ = settled.send(result);
                return;
            }
            Stop::HandOff(lanes) => lanes,
        };
        // A lane fell behind: settle now, so that the slot moves on; its requests still out are
        // pairs leased to this batch until their answers come.
        let handed = self.hand_over(&run, lanes);
        let token = Uuid::new_v4();
        let early = handed.results(&run);
        let late = early.in_flight();
        let lease = in_flight_lease(deadline);
        let result = self.settle_wal(&batch, &early, (token, lease), false).await;
        let failed = result.is_err();
        let _ = settled.send(result);
        if failed {
            return;
        }
        // From the WAL, everything handed over goes on as pairs: no row is leased.
        let handed_late = (late.as_slice(), token, [].as_slice());
        if let Err(e) = self
            .finish_handed(&run, publish.as_mut(), &handed, handed_late)
            .await
        {
            // The pairs stay leased until their lease ends, then are sent again (at least once).
            warn!(error = %crate::error_chain(&e), "cannot record late answers of a WAL batch; they will be sent again");
        }
    }

    /// WAL source: deletes (or marks published) the rows that settled WAL batches delivered
    /// everywhere, several batches' at once (the processor confirms their positions after).
    async fn write_wal_rows(&self, rows: &DeliveredRows) -> Result<u64> {
        let started = Instant::now();
        let written = settle::write_delivered(&self.store, rows, self.settle_mode).await?;
        metrics::histogram!(metric::SETTLE_SECONDS).record(started.elapsed().as_secs_f64());
        Ok(written)
    }

    /// WAL source: settles a published batch (see [`Relay::process_wal_batch`]).
    async fn settle_wal(
        &self,
        batch: &WalBatchRef<'_>,
        results: &Results<'_>,
        in_flight: (Uuid, InFlightLease),
        aborted: bool,
    ) -> WalSettled {
        let delivered_everywhere = |e: usize| {
            results.items.spans[e].clone().all(|i| {
                results.items.list[i].dispatch == Dispatch::Send
                    && matches!(results.answers[i], Some((Outcome::Delivered, _)))
            })
        };
        let (done, unfinished): (Vec<usize>, Vec<usize>) = (0..batch.events.len())
            .filter(|&e| batch.rowless.contains(&batch.events[e].id))
            .partition(|&e| delivered_everywhere(e));
        let no_row: HashSet<Uuid> = done.iter().map(|&e| batch.events[e].id).collect();
        let materialize: Vec<&OutboxEvent> = unfinished.iter().map(|&e| &batch.events[e]).collect();
        // Materialized rows are settled in the transaction that wrote them; otherwise the settle
        // opens one only if it has something to write besides the delivered rows.
        let guard = if materialize.is_empty() {
            Guard::Nothing
        } else {
            let mut tx = self.store.pool().begin().await?;
            outbox::wal_materialize(&self.store, &mut tx, &materialize).await?;
            Guard::Transaction(tx)
        };
        let planned = self.plan_batch(results, Origin::Wal { rowless: &no_row }, in_flight)?;
        let rows = planned.plan.delivered_rows();
        let (report, _) = self
            .settle_planned(batch.events, planned, guard, (batch.poison, &[]), aborted)
            .await?;
        Ok((report, rows))
    }
}

/// A WAL batch's parts, borrowed.
struct WalBatchRef<'a> {
    events: &'a [OutboxEvent],
    poison: &'a [(Uuid, String)],
    rowless: &'a HashSet<Uuid>,
}
