//! The processor: the reader's transactions gathered into batches, each published and settled
//! through the engine, and their positions confirmed in commit order.

use std::collections::VecDeque;
use std::sync::Arc;

use pgwire_replication::Lsn;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::decode::Decoded;
use super::WalEngine;
use crate::model::metric;
use crate::model::report::BatchReport;
use crate::model::report::DeliveredRows;

use super::confirm::Confirmer;
use super::{Item, WalBatch, HEARTBEAT_PREFIX};

/// What a batch's task answers once it is settled: its report, and the rows it delivered
/// everywhere, which the processor writes with other batches' ([`Confirmer`]).
type Answer = super::WalSettled;

/// A batch handed to its task, oldest first, until its position is passed to the [`Confirmer`].
struct InFlight {
    /// The settle's answer; `None`: nothing to wait for (a position alone, or the answer taken).
    settle: Option<tokio::sync::oneshot::Receiver<Answer>>,
    /// The rows its answer handed over.
    rows: DeliveredRows,
    /// The position to confirm once it (and every batch before it) is settled and written.
    position: Option<Lsn>,
}

/// The processor: gathers the reader's items into batches of up to `batch_size` events,
/// publishes and settles each through the engine, then confirms the last complete transaction.
/// With no destination ordered by key, up to `relay.workers` batches are in flight at once (their
/// events have no order to keep, as within one batch); confirmations still go in commit order,
/// each once every batch before it is settled and its delivered rows written. On `stop` it
/// finishes the batches in hand and returns; on a batch that cannot be settled it returns at once
/// with the error (the session ends, and the batches not confirmed are read again).
pub(super) async fn process<E: WalEngine>(
    engine: Arc<E>,
    mut items: mpsc::Receiver<Item>,
    confirm: watch::Sender<Lsn>,
    stop: CancellationToken,
) -> (BatchReport, Option<String>) {
    let config = engine.config().clone();
    let batch_size = config.relay.batch_size;
    let heartbeat = config.wal.heartbeat_interval;
    // Ordered keys need each batch settled (its failures recorded) before the next is routed.
    let most_in_flight = if engine.keeps_key_order() {
        1
    } else {
        config.relay.workers.max(1)
    };
    let mut total = BatchReport::default();
    let mut stragglers = tokio::task::JoinSet::new();
    let mut in_flight: VecDeque<InFlight> = VecDeque::new();
    let mut confirmer = Confirmer::new(confirm, batch_size, config.wal.settle_wait);
    let failed = 'run: loop {
        let first = tokio::select! {
            biased;
            _ = stop.cancelled() => break 'run None,
            // The oldest batch settled: its position can be confirmed now, not at the next item.
            settled = oldest_settled(&mut in_flight) => {
                match settled {
                    Ok(report) => total += report,
                    Err(e) => break 'run Some(e),
                }
                if let Err(e) = confirm_settled(&mut in_flight, &mut confirmer, &mut total) {
                    break 'run Some(e);
                }
                confirmer.write_if_due(&engine, false);
                continue;
            }
            // A write of delivered rows ended, or gathered rows are due.
            stepped = confirmer.step(&engine) => {
                if let Err(e) = stepped {
                    break 'run Some(e);
                }
                continue;
            }
            item = items.recv() => match item {
                Some(item) => item,
                None => break 'run None,
            },
            _ = tokio::time::sleep(heartbeat) => {
                // A quiet stream: a heartbeat moves the server's position on, so that the slot
                // advances even when only other tables (or other databases) write.
                if let Err(e) =
                    crate::store::slot::heartbeat(engine.store().pool(), HEARTBEAT_PREFIX).await
                {
                    debug!(error = %e, "WAL heartbeat failed");
                }
                continue;
            }
        };
        let mut batch = WalBatch::default();
        let mut confirm_at: Option<Lsn> = None;
        let mut add = |item: Item, batch: &mut WalBatch| match item {
            Item::Idle(lsn) => confirm_at = Some(confirm_at.map_or(lsn, |c| c.max(lsn))),
            Item::Part { records, commit } => {
                for (decoded, rowless) in records {
                    match decoded {
                        Decoded::Event(event) => {
                            metrics::counter!(metric::WAL_EVENTS_READ_TOTAL).increment(1);
                            if rowless {
                                batch.rowless.insert(event.id);
                            }
                            batch.events.push(event);
                        }
                        Decoded::Poison(id, reason) => batch.poison.push((id, reason)),
                        Decoded::Undecodable(reason) => {
                            metrics::counter!(metric::WAL_UNDECODABLE_TOTAL).increment(1);
                            warn!(error = %reason, "skipping an outbox message that is not an event");
                        }
                    }
                }
                if let Some(lsn) = commit {
                    confirm_at = Some(confirm_at.map_or(lsn, |c| c.max(lsn)));
                }
            }
        };
        add(first, &mut batch);
        let gathered_by = tokio::time::Instant::now() + config.wal.batch_wait;
        while batch.events.len() + batch.poison.len() < batch_size {
            match items.try_recv() {
                Ok(item) => add(item, &mut batch),
                // Nothing more read yet: wait a moment for it (batch_wait), unless the batch has
                // nothing to publish (a position to confirm only).
                Err(_) if batch.events.is_empty() && batch.poison.is_empty() => break,
                Err(_) => match tokio::time::timeout_at(gathered_by, items.recv()).await {
                    Ok(Some(item)) => add(item, &mut batch),
                    Ok(None) | Err(_) => break,
                },
            }
        }
        let settle = if batch.events.is_empty() && batch.poison.is_empty() {
            None
        } else {
            // The batch runs as a task of its own: once it is settled it signals, and the slot
            // moves on while the task may still wait for a few straggling requests.
            let (settled_tx, settled_rx) = tokio::sync::oneshot::channel();
            stragglers.spawn(Arc::clone(&engine).publish(batch, settled_tx));
            Some(settled_rx)
        };
        in_flight.push_back(InFlight {
            settle,
            rows: DeliveredRows::default(),
            position: confirm_at,
        });
        // Finished straggler tasks are reaped as the processor goes.
        while stragglers.try_join_next().is_some() {}
        // Room for the next batch: wait for the oldest ones beyond the limit (and for the rows
        // being written, when too many more are waiting behind them).
        if let Err(e) =
            settle_down_to(&mut in_flight, most_in_flight, &mut confirmer, &mut total).await
        {
            break 'run Some(e);
        }
        confirmer.write_if_due(&engine, false);
        if let Err(e) = confirmer.keep_up().await {
            break 'run Some(e);
        }
    };
    // After a failed settle nothing more is confirmed: the next session reads the transactions
    // of that batch and of every batch after it again. Otherwise the batches in hand are
    // finished, in order, each confirmed once its rows are written.
    let failed = match failed {
        Some(e) => Some(e),
        None => match settle_down_to(&mut in_flight, 1, &mut confirmer, &mut total).await {
            Ok(()) => confirmer.finish(&engine).await.err(),
            Err(e) => Some(e),
        },
    };
    // Straggling requests end by their batch's deadline (or the shutdown grace).
    stragglers.join_all().await;
    (total, failed)
}

/// Confirms what is settled, in order, waiting for the oldest batches until fewer than `most`
/// are in flight.
async fn settle_down_to(
    in_flight: &mut VecDeque<InFlight>,
    most: usize,
    confirmer: &mut Confirmer,
    total: &mut BatchReport,
) -> Result<(), String> {
    loop {
        confirm_settled(in_flight, confirmer, total)?;
        if in_flight.len() < most {
            return Ok(());
        }
        *total += oldest_settled(in_flight).await?;
    }
}

/// Waits for the oldest in-flight batch's settle and takes its answer (its rows kept for the
/// confirmer); pending for ever when nothing is in flight or the oldest is settled already (a
/// select! branch).
async fn oldest_settled(in_flight: &mut VecDeque<InFlight>) -> Result<BatchReport, String> {
    let Some(oldest) = in_flight.front_mut() else {
        return std::future::pending().await;
    };
    let Some(rx) = oldest.settle.as_mut() else {
        return std::future::pending().await;
    };
    let answer = rx.await.ok();
    take_answer(oldest, answer)
}

/// Takes a batch's settle answer (`None`: its task ended without one): the report, its rows
/// kept in `batch` for the confirmer.
fn take_answer(batch: &mut InFlight, answer: Option<Answer>) -> Result<BatchReport, String> {
    batch.settle = None;
    match answer {
        Some(Ok((report, rows))) => {
            batch.rows = rows;
            Ok(report)
        }
        Some(Err(e)) => Err(crate::error_chain(&e)),
        None => Err(UNSETTLED.to_owned()),
    }
}

/// A batch task that ended without saying how its settle went.
const UNSETTLED: &str = "a WAL batch task ended without settling (a bug)";

/// Hands the oldest batches that are settled, in order, to the confirmer, stopping at the first
/// still in flight; a settle that answered meanwhile is taken here too.
fn confirm_settled(
    in_flight: &mut VecDeque<InFlight>,
    confirmer: &mut Confirmer,
    total: &mut BatchReport,
) -> Result<(), String> {
    while let Some(oldest) = in_flight.front_mut() {
        if let Some(rx) = &mut oldest.settle {
            let answer = match rx.try_recv() {
                Err(tokio::sync::oneshot::error::TryRecvError::Empty) => return Ok(()),
                answer => answer.ok(),
            };
            *total += take_answer(oldest, answer)?;
        }
        if let Some(done) = in_flight.pop_front() {
            confirmer.settled(done.rows, done.position);
        }
    }
    Ok(())
}
