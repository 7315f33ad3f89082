//! The WAL source (`source = "wal"`): events read from a logical replication slot, in commit
//! order, instead of claimed from the table.
//!
//! A reader streams the slot (`pgoutput` on the outbox table's publication, plus this table's
//! `emit()` messages) and hands each committed transaction's events to the processor in commit
//! order. The processor publishes them in batches through the relay's own route → publish →
//! settle path ([`Relay::process_wal_batch`]): every event a destination did not take goes to the
//! per-destination deliveries table, where the relay's deliveries loop retries it like any split
//! event, and delivered table rows are marked published (or deleted) a little later, several
//! batches' in one statement (`wal.settle_wait`). Only then is the slot's confirmed position moved
//! past the batch's last transaction, so a failing destination never holds the slot, and a crash
//! between publish and settle means the batch is read again (at least once).
//!
//! One relay streams a slot at a time (PostgreSQL allows one session per slot); the others wait on
//! standby and take over when its session ends. A quiet outbox still lets the slot advance: the
//! reader confirms the server's position whenever nothing is in flight, and a heartbeat message
//! keeps the stream moving.

mod confirm;
pub mod decode;
mod process;
pub mod slot;
mod url;

pub use url::{replication_config, UrlParts};

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use pgwire_replication::{Lsn, ReplicationClient, ReplicationEvent};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};
use uuid::Uuid;

use crate::config::Config;
use crate::model::event::OutboxEvent;
use crate::model::metric;
use crate::model::report::{BatchReport, DeliveredRows};
use crate::store::Store;
use decode::{Decoded, Decoder};
use slot::Names;

/// What a batch's settle answers: its report, and the rows it delivered everywhere (written later
/// with other batches' rows, [`WalEngine::write_rows`]).
pub(crate) type WalSettled = crate::error::Result<(BatchReport, DeliveredRows)>;

/// What the WAL source hands its batches to (the engine), so that the source knows nothing of
/// routing, sinks or settling.
pub(crate) trait WalEngine: Send + Sync + 'static {
    /// The configuration: the table, `[wal]`, `[relay]`.
    fn config(&self) -> &Config;

    /// The store (slot checks, heartbeats).
    fn store(&self) -> &Store;

    /// Whether a destination keeps key order: then batches settle one at a time, in order.
    fn keeps_key_order(&self) -> bool;

    /// Publishes and settles `batch`, answering on `settled` once it is settled (the task may go
    /// on waiting for late answers after that). A database error is answered: the batch is then
    /// read again.
    fn publish(
        self: Arc<Self>,
        batch: WalBatch,
        settled: tokio::sync::oneshot::Sender<WalSettled>,
    ) -> impl std::future::Future<Output = ()> + Send + 'static;

    /// Writes the rows that settled batches delivered everywhere, several batches' at once.
    fn write_rows(
        self: Arc<Self>,
        rows: DeliveredRows,
    ) -> impl std::future::Future<Output = crate::error::Result<u64>> + Send + 'static;

    /// Since when events read from the slot wait for the confirmed position to move (`None`:
    /// nothing waits, or the position just moved). Readiness sees a stall by it.
    fn unconfirmed_since(&self, since: Option<std::time::Instant>);
}

/// Prefix of the heartbeat messages (non-transactional, never an event).
use process::process;

pub const HEARTBEAT_PREFIX: &str = "pgoutbox-heartbeat";

/// One batch of events read from the slot, in commit order.
#[derive(Debug, Default)]
pub(crate) struct WalBatch {
    /// The events, in commit order (and statement order within a transaction).
    pub events: Vec<OutboxEvent>,
    /// Outbox rows that cannot be read as events: dead-lettered.
    pub poison: Vec<(Uuid, String)>,
    /// Events that have no table row (`emit()` messages).
    pub rowless: HashSet<Uuid>,
}

/// What the reader hands the processor, in stream order.
#[derive(Debug)]
pub(super) enum Item {
    /// Decoded records of a transaction; `commit` is its end position once it is complete (a
    /// transaction larger than a batch arrives in several parts, only the last with it).
    Part {
        records: Vec<(Decoded, bool)>,
        commit: Option<Lsn>,
    },
    /// A position with nothing before it left to deliver (a keepalive or heartbeat outside any
    /// transaction): confirmed once everything handed over earlier is settled.
    Idle(Lsn),
}

/// How the session ended.
enum End {
    /// Shutdown: stop.
    Shutdown,
    /// Another relay streams the slot: wait, then try again.
    Standby(String),
    /// An error: log, wait, reconnect.
    Failed(String),
    /// The slot is not on the server (lost in a failover, or dropped): said once, then looked
    /// for again quietly.
    Missing(String),
}

/// Runs the WAL source until `shutdown`: one streaming session at a time, reconnecting (or
/// waiting on standby) when a session ends.
pub(crate) async fn run<E: WalEngine>(engine: Arc<E>, shutdown: CancellationToken) -> BatchReport {
    let config = engine.config().clone();
    let names = Names::of(&config.wal, &config.table);
    let mut total = BatchReport::default();
    // The last position this relay had settled: a new session starts there, so a reconnect does
    // not deliver again what was settled but not yet reported to the server.
    let mut settled = Lsn::ZERO;
    let mut standby_logged = false;
    let mut missing_logged = false;
    let mut warned = false;
    let mut pause = Duration::from_millis(100);
    while !shutdown.is_cancelled() {
        let ready = slot::ready(engine.store().pool(), &config.table, &names).await;
        let end = match ready {
            Ok(slot::Ready { warnings, slot }) => {
                if !std::mem::replace(&mut warned, true) {
                    for w in warnings {
                        warn!("{w}");
                    }
                }
                let mut streamed = false;
                let end = match held_elsewhere(&slot, &names) {
                    // Another relay streams the slot: no session is tried (it would fail with
                    // an ERROR in the server's log and the client's, at every retry).
                    Some(why) => End::Standby(why),
                    None => {
                        session(
                            &engine,
                            &names,
                            &mut settled,
                            slot.confirmed_flush_lsn.as_deref(),
                            &mut total,
                            &shutdown,
                            &mut streamed,
                        )
                        .await
                    }
                };
                if streamed {
                    // A session that streamed: the next outage starts its back-off afresh, and a
                    // later standby spell is logged again.
                    pause = Duration::from_millis(100);
                    standby_logged = false;
                    missing_logged = false;
                }
                end
            }
            Err(e @ slot::SlotError::Missing(_)) => End::Missing(e.to_string()),
            Err(e) => End::Failed(crate::error_chain(&e)),
        };
        let wait = match end {
            End::Shutdown => break,
            End::Standby(why) => {
                if !standby_logged {
                    info!(slot = %names.slot, "standby: {why}; taking over when it is free");
                    standby_logged = true;
                }
                metrics::gauge!(metric::WAL_SLOT_ACTIVE).set(0.0);
                metrics::counter!(metric::WAL_SESSION_ENDS_TOTAL, "reason" => "standby")
                    .increment(1);
                config.wal.standby_retry
            }
            End::Missing(why) => {
                let again = config.wal.standby_retry.max(Duration::from_secs(1));
                if !std::mem::replace(&mut missing_logged, true) {
                    error!(slot = %names.slot, "{why}. If the database failed over to a server without it (PostgreSQL before 17, or a slot made without failover), outbox_emit() events committed after its last confirmed position are lost and rows of the table stay pending for a relay with source = \"poll\": see docs/operations.md (failover); looking for the slot again every {} s", again.as_secs());
                }
                metrics::gauge!(metric::WAL_SLOT_ACTIVE).set(0.0);
                metrics::counter!(metric::WAL_SESSION_ENDS_TOTAL, "reason" => "missing")
                    .increment(1);
                again
            }
            End::Failed(why) => {
                metrics::counter!(metric::DB_ERRORS_TOTAL).increment(1);
                metrics::counter!(metric::WAL_SESSION_ENDS_TOTAL, "reason" => "failed")
                    .increment(1);
                warn!(slot = %names.slot, error = %why, retry_in_ms = pause.as_millis() as u64, "WAL session ended; reconnecting");
                metrics::gauge!(metric::WAL_SLOT_ACTIVE).set(0.0);
                let p = pause;
                pause = (pause * 2).min(Duration::from_secs(5));
                p
            }
        };
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tokio::time::sleep(wait) => {}
        }
    }
    total
}

/// Whether another session streams the slot (`Some(why)`): then this relay waits on standby
/// without trying a session.
fn held_elsewhere(status: &slot::SlotStatus, names: &Names) -> Option<String> {
    status.active.then(|| {
        format!(
            "replication slot {:?} is active for PID {}",
            names.slot,
            status.active_pid.unwrap_or_default()
        )
    })
}

/// One streaming session: connect, start at `settled` (at the slot's `confirmed` position while
/// this process has settled nothing), relay until it ends.
async fn session<E: WalEngine>(
    engine: &Arc<E>,
    names: &Names,
    settled: &mut Lsn,
    confirmed: Option<&str>,
    total: &mut BatchReport,
    shutdown: &CancellationToken,
    streamed: &mut bool,
) -> End {
    let config = engine.config();
    let url = match config.database_url() {
        // With several hosts, the slot is streamed where the pool is: the host it found
        // writable (after a failover, the promoted standby with its synced failover slot).
        Ok(url) => {
            let pool = engine.store().pool().connect_options();
            url::host_in_use(url, pool.get_host(), pool.get_port())
        }
        Err(e) => return End::Failed(e.to_string()),
    };
    let cfg = match replication_config(&url, names, config.wal.status_interval) {
        Ok(cfg) => cfg.with_start_lsn(*settled),
        Err(e) => return End::Failed(e),
    };
    let mut client = match ReplicationClient::connect(cfg).await {
        Ok(client) => client,
        Err(e) => return ended(&e),
    };
    if let Err(e) = client.wait_started().await {
        return ended(&e);
    }
    // Nothing settled yet in this process: the server resumes at the slot's confirmed position,
    // which is what the line should name (not 0/0).
    let from = if settled.0 == 0 {
        confirmed.map_or_else(
            || "the slot's confirmed position".into(),
            |lsn| format!("{lsn} (the slot's confirmed position)"),
        )
    } else {
        settled.to_string()
    };
    info!(slot = %names.slot, %from, "streaming the replication slot");
    *streamed = true;
    metrics::gauge!(metric::WAL_SLOT_ACTIVE).set(1.0);
    metrics::counter!(metric::WAL_SESSIONS_TOTAL).increment(1);

    let (items_tx, items_rx) = mpsc::channel::<Item>(64);
    let (confirm_tx, mut confirm_rx) = watch::channel(*settled);
    let stop = CancellationToken::new();
    let processor = {
        let engine = Arc::clone(engine);
        let stop = stop.clone();
        tokio::spawn(async move { process(engine, items_rx, confirm_tx, stop).await })
    };

    let mut decoder = Decoder::new(&config.table);
    let batch_size = config.relay.batch_size;
    let mut records: Vec<(Decoded, bool)> = Vec::new();
    let mut in_transaction = false;
    // Since when events read wait for the confirmed position to move.
    let mut waiting: Option<std::time::Instant> = None;
    let end = loop {
        tokio::select! {
            _ = shutdown.cancelled() => break End::Shutdown,
            changed = confirm_rx.changed() => {
                if changed.is_err() {
                    // The processor stopped: a batch could not be settled (its error follows).
                    break End::Failed("a batch could not be settled".into());
                }
                let lsn = *confirm_rx.borrow_and_update();
                client.update_applied_lsn(lsn);
                if lsn > *settled {
                    // The position moved: what was read is not stuck (later reads start anew).
                    waiting = None;
                    engine.unconfirmed_since(None);
                }
                *settled = lsn.max(*settled);
            }
            event = client.recv() => {
                let event = match event {
                    Ok(Some(event)) => event,
                    Ok(None) => break End::Failed("the server ended the replication stream".into()),
                    Err(e) => break ended(&e),
                };
                let item = match event {
                    ReplicationEvent::Begin { .. } => {
                        in_transaction = true;
                        None
                    }
                    ReplicationEvent::XLogData { data, .. } => {
                        match decoder.change(&data) {
                            Ok(Some(decoded)) => records.push((decoded, false)),
                            Ok(None) => {}
                            Err(e) => break End::Failed(e.to_string()),
                        }
                        (records.len() >= batch_size).then(|| Item::Part {
                            records: std::mem::take(&mut records),
                            commit: None,
                        })
                    }
                    ReplicationEvent::Message { transactional: true, lsn, prefix, content } => {
                        if let Some(decoded) = decoder.message(&prefix, lsn.as_u64(), &content) {
                            records.push((decoded, true));
                        }
                        (records.len() >= batch_size).then(|| Item::Part {
                            records: std::mem::take(&mut records),
                            commit: None,
                        })
                    }
                    ReplicationEvent::Commit { end_lsn, .. } => {
                        in_transaction = false;
                        if records.is_empty() {
                            Some(Item::Idle(end_lsn))
                        } else {
                            Some(Item::Part { records: std::mem::take(&mut records), commit: Some(end_lsn) })
                        }
                    }
                    // Outside a transaction the server's position has nothing undelivered
                    // before it (inside one, it may be past the commit being sent).
                    ReplicationEvent::KeepAlive { wal_end, .. } if !in_transaction => {
                        Some(Item::Idle(wal_end))
                    }
                    ReplicationEvent::Message { transactional: false, lsn, .. } if !in_transaction => {
                        Some(Item::Idle(lsn))
                    }
                    _ => None,
                };
                if let Some(item) = item {
                    if matches!(item, Item::Part { .. }) && waiting.is_none() {
                        waiting = Some(std::time::Instant::now());
                        engine.unconfirmed_since(waiting);
                    }
                    // Backpressure: the stream waits while the processor is behind.
                    tokio::select! {
                        // The processor gone: a batch could not be settled (a shutdown also
                        // says so by its token). Ending the session as a shutdown would end the
                        // WAL source for good while the relay runs on.
                        sent = items_tx.send(item) => if sent.is_err() {
                            break if shutdown.is_cancelled() {
                                End::Shutdown
                            } else {
                                End::Failed("a batch could not be settled".into())
                            };
                        },
                        _ = shutdown.cancelled() => break End::Shutdown,
                    }
                }
            }
        }
    };
    // Let the processor finish its batch (the shutdown grace bounds it), then report the last
    // settled position before closing the stream: the server would otherwise only learn it at the
    // next status interval, and a restart would deliver that batch again.
    drop(items_tx);
    stop.cancel();
    // What this session read and did not confirm is read again by the next one (or another
    // relay's): nothing waits on this relay any more.
    engine.unconfirmed_since(None);
    let end = match processor.await {
        Ok((report, failed)) => {
            *total += report;
            match (end, failed) {
                (End::Shutdown, _) => End::Shutdown,
                (_, Some(why)) => End::Failed(why),
                (end, None) => end,
            }
        }
        Err(e) => End::Failed(format!("the WAL processor ended abnormally: {e}")),
    };
    let last = *confirm_rx.borrow();
    *settled = last.max(*settled);
    client.update_applied_lsn(*settled);
    let metrics = client.metrics();
    let deadline =
        tokio::time::Instant::now() + config.wal.status_interval + Duration::from_secs(1);
    while metrics.last_applied_lsn() < *settled
        && client.is_running()
        && tokio::time::Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    client.stop();
    let _ = tokio::time::timeout(Duration::from_secs(2), client.shutdown()).await;
    debug!(slot = %names.slot, confirmed = %settled, "WAL session closed");
    end
}

/// SQLSTATE 55006 (object_in_use): the replication slot is active for another session.
const SLOT_IN_USE: &str = "55006";

/// A session error: standby when another session holds the slot (SQLSTATE 55006).
fn ended(e: &pgwire_replication::PgWireError) -> End {
    let text = e.to_string();
    if sqlstate(e) == Some(SLOT_IN_USE) {
        End::Standby(text)
    } else {
        End::Failed(text)
    }
}

/// The SQLSTATE of a server error. pgwire-replication hands a server's error response over as
/// its message followed by `(SQLSTATE xxxxx)` (its `ErrorFields::to_error_string`), the code's
/// only form in its public error type.
fn sqlstate(e: &pgwire_replication::PgWireError) -> Option<&str> {
    let pgwire_replication::PgWireError::Server(message) = e else {
        return None;
    };
    let code = message.strip_suffix(')')?.rsplit_once("(SQLSTATE ")?.1;
    (code.len() == 5 && code.bytes().all(|b| b.is_ascii_alphanumeric())).then_some(code)
}

#[cfg(test)]
mod tests {
    use super::*;
    use pgwire_replication::PgWireError;

    #[test]
    fn a_slot_in_use_is_recognised_by_its_sqlstate() {
        let busy = PgWireError::Server(
            "replication slot \"s\" is active for PID 4242 (SQLSTATE 55006)".into(),
        );
        assert_eq!(sqlstate(&busy), Some("55006"));
        assert!(matches!(ended(&busy), End::Standby(_)));
        for other in [
            PgWireError::Server("permission denied to start WAL sender (SQLSTATE 42501)".into()),
            PgWireError::Server("a message that mentions 55006 (SQLSTATE 57P01)".into()),
            PgWireError::Server("no code at all".into()),
            PgWireError::Protocol("unexpected message (SQLSTATE 55006)".into()),
        ] {
            assert!(matches!(ended(&other), End::Failed(_)), "{other}");
        }
    }
}
