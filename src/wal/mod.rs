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

pub mod decode;
pub mod slot;

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use pgwire_replication::{
    Lsn, ReplicationClient, ReplicationConfig, ReplicationEvent, SslMode, TlsConfig,
};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};
use uuid::Uuid;

use crate::engine::{BatchReport, Relay};
use crate::model::event::OutboxEvent;
use crate::model::metric;
use crate::settle::DeliveredRows;
use decode::{Decoded, Decoder};
use slot::Names;

/// Prefix of the heartbeat messages (non-transactional, never an event).
pub const HEARTBEAT_PREFIX: &str = "pgoutbox-heartbeat";

/// One batch of events read from the slot, in commit order.
#[derive(Debug, Default)]
pub struct WalBatch {
    /// The events, in commit order (and statement order within a transaction).
    pub events: Vec<OutboxEvent>,
    /// Outbox rows that cannot be read as events: dead-lettered.
    pub poison: Vec<(Uuid, String)>,
    /// Events that have no table row (`emit()` messages).
    pub rowless: HashSet<Uuid>,
}

/// What the reader hands the processor, in stream order.
#[derive(Debug)]
enum Item {
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
}

/// Runs the WAL source until `shutdown`: one streaming session at a time, reconnecting (or
/// waiting on standby) when a session ends.
pub async fn run(relay: Arc<Relay>, shutdown: CancellationToken) -> BatchReport {
    let config = relay.config().clone();
    let names = Names::of(&config.wal, &config.table);
    let mut total = BatchReport::default();
    // The last position this relay had settled: a new session starts there, so a reconnect does
    // not deliver again what was settled but not yet reported to the server.
    let mut settled = Lsn::ZERO;
    let mut standby_logged = false;
    let mut warned = false;
    let mut pause = Duration::from_millis(100);
    while !shutdown.is_cancelled() {
        let ready = slot::ready(relay.pool(), &config.table, &names).await;
        let end = match ready {
            Ok(warnings) => {
                if !std::mem::replace(&mut warned, true) {
                    for w in warnings {
                        warn!("{w}");
                    }
                }
                let mut streamed = false;
                let end = session(
                    &relay,
                    &names,
                    &mut settled,
                    &mut total,
                    &shutdown,
                    &mut streamed,
                )
                .await;
                if streamed {
                    // A session that streamed: the next outage starts its back-off afresh, and a
                    // later standby spell is logged again.
                    pause = Duration::from_millis(100);
                    standby_logged = false;
                }
                end
            }
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
                config.wal.standby_retry
            }
            End::Failed(why) => {
                metrics::counter!(metric::DB_ERRORS_TOTAL).increment(1);
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

/// A PostgreSQL URL's connection parts, as libpq reads them: `postgres://user:password@host:port/db`
/// with percent-decoding, and query parameters (`host`, `port`, `user`, `password`, `dbname`,
/// `sslmode`, ...) winning over the URL's own parts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UrlParts {
    /// Host name or address (IPv6 without brackets), or a socket directory; `None`: not given.
    pub host: Option<String>,
    /// Port; `None`: not given.
    pub port: Option<u16>,
    /// Role; `None`: not given.
    pub user: Option<String>,
    /// Password; `None`: not given.
    pub password: Option<String>,
    /// Database name.
    pub dbname: String,
    params: Vec<(String, String)>,
}

impl UrlParts {
    /// Parses `url`.
    pub fn parse(url: &str) -> Result<Self, String> {
        let url = url::Url::parse(url).map_err(|e| format!("invalid database URL: {e}"))?;
        let params: Vec<(String, String)> = url.query_pairs().into_owned().collect();
        let param = |k: &str| {
            params
                .iter()
                .find(|(key, _)| key == k)
                .map(|(_, v)| v.clone())
        };
        let decode = |s: &str| {
            percent_encoding::percent_decode_str(s)
                .decode_utf8_lossy()
                .into_owned()
        };
        Ok(Self {
            host: param("host").or_else(|| {
                url.host_str()
                    .map(|h| h.trim_start_matches('[').trim_end_matches(']').to_owned())
            }),
            port: param("port").and_then(|p| p.parse().ok()).or(url.port()),
            user: match url.username() {
                "" => param("user"),
                u => Some(decode(u)),
            },
            password: url.password().map(decode).or_else(|| param("password")),
            dbname: param("dbname").unwrap_or_else(|| decode(url.path().trim_start_matches('/'))),
            params,
        })
    }

    /// A query parameter (`sslmode`, `sslrootcert`, ...).
    pub fn param(&self, key: &str) -> Option<&str> {
        self.params
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

/// The replication session's settings, from the database URL and `[wal]`.
pub fn replication_config(
    url: &str,
    names: &Names,
    status: Duration,
) -> Result<ReplicationConfig, String> {
    let parts = UrlParts::parse(url)?;
    let host = parts.host.clone().unwrap_or_else(|| "127.0.0.1".into());
    let port = parts.port.unwrap_or(5432);
    let user = parts.user.clone().unwrap_or_else(|| "postgres".into());
    let password = parts.password.clone().unwrap_or_default();
    let database = parts.dbname.clone();
    let ca = parts.param("sslrootcert").map(std::path::PathBuf::from);
    let tls = match parts.param("sslmode") {
        None | Some("prefer") | Some("allow") => TlsConfig {
            mode: SslMode::Prefer,
            ..TlsConfig::disabled()
        },
        Some("disable") => TlsConfig::disabled(),
        Some("require") => TlsConfig::require(),
        Some("verify-ca") => TlsConfig::verify_ca(ca),
        Some("verify-full") => TlsConfig::verify_full(ca),
        Some(other) => return Err(format!("unknown sslmode {other:?} in database_url")),
    };
    let tls = match (parts.param("sslcert"), parts.param("sslkey")) {
        (Some(cert), Some(key)) => tls.with_client_cert(cert, key),
        _ => tls,
    };
    Ok(ReplicationConfig::new(
        host,
        user,
        password,
        database,
        names.slot.clone(),
        names.publication.clone(),
    )
    .with_port(port)
    .with_tls(tls)
    .with_status_interval(status)
    // Timestamps in the text form the decoder reads, whatever the role's settings.
    .with_options("-c datestyle=ISO -c timezone=UTC")
    .with_application_name("pgoutbox-wal"))
}

/// One streaming session: connect, start at `settled`, relay until it ends.
async fn session(
    relay: &Arc<Relay>,
    names: &Names,
    settled: &mut Lsn,
    total: &mut BatchReport,
    shutdown: &CancellationToken,
    streamed: &mut bool,
) -> End {
    let config = relay.config();
    let url = match config.database_url() {
        Ok(url) => url.to_owned(),
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
    info!(slot = %names.slot, from = %settled, "streaming the replication slot");
    *streamed = true;
    metrics::gauge!(metric::WAL_SLOT_ACTIVE).set(1.0);

    let (items_tx, items_rx) = mpsc::channel::<Item>(64);
    let (confirm_tx, mut confirm_rx) = watch::channel(*settled);
    let stop = CancellationToken::new();
    let processor = {
        let relay = Arc::clone(relay);
        let stop = stop.clone();
        tokio::spawn(async move { process(relay, items_rx, confirm_tx, stop).await })
    };

    let mut decoder = Decoder::new(&config.table);
    let batch_size = config.relay.batch_size;
    let mut records: Vec<(Decoded, bool)> = Vec::new();
    let mut in_transaction = false;
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
                    // Backpressure: the stream waits while the processor is behind.
                    tokio::select! {
                        sent = items_tx.send(item) => if sent.is_err() { break End::Shutdown },
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

/// A session error: standby when another session holds the slot.
fn ended(e: &pgwire_replication::PgWireError) -> End {
    let text = e.to_string();
    if text.contains("is active for PID") || text.contains("55006") {
        End::Standby(text)
    } else {
        End::Failed(text)
    }
}

/// What a batch's task answers once it is settled: its report, and the rows it delivered
/// everywhere, which the processor writes with other batches' ([`Confirmer`]).
type Answer = crate::error::Result<(BatchReport, DeliveredRows)>;

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
/// publishes and settles each through the relay, then confirms the last complete transaction.
/// With no destination ordered by key, up to `relay.workers` batches are in flight at once (their
/// events have no order to keep, as within one batch); confirmations still go in commit order,
/// each once every batch before it is settled and its delivered rows written. On `stop` it
/// finishes the batches in hand and returns; on a batch that cannot be settled it returns at once
/// with the error (the session ends, and the batches not confirmed are read again).
async fn process(
    relay: Arc<Relay>,
    mut items: mpsc::Receiver<Item>,
    confirm: watch::Sender<Lsn>,
    stop: CancellationToken,
) -> (BatchReport, Option<String>) {
    let config = relay.config().clone();
    let batch_size = config.relay.batch_size;
    let heartbeat = config.wal.heartbeat_interval;
    // Ordered keys need each batch settled (its failures recorded) before the next is routed.
    let most_in_flight = if relay.ordered() {
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
                confirmer.write_if_due(&relay, false);
                continue;
            }
            // A write of delivered rows ended, or gathered rows are due.
            stepped = confirmer.step(&relay) => {
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
                if let Err(e) = sqlx::query("SELECT pg_logical_emit_message(false, $1, '')")
                    .bind(HEARTBEAT_PREFIX)
                    .execute(relay.pool())
                    .await
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
            stragglers.spawn(Arc::clone(&relay).process_wal_batch(batch, settled_tx));
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
        confirmer.write_if_due(&relay, false);
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
            Ok(()) => confirmer.finish(&relay).await.err(),
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

/// Settled batches' delivered rows, gathered and written together (one statement for many
/// batches instead of a settle transaction each: what the relay costs the database per event is
/// then about one row write), and the positions waiting for them. A position is confirmed once
/// the rows of its batch and of every batch before it are written, so the slot never passes an
/// event whose row could still be claimed by the polling relay. Rows are written when
/// `batch_size` of them are gathered or the oldest has waited `wait`, one write at a time; a
/// crash before a write means its batches are read again (at least once, as before).
struct Confirmer {
    confirm: watch::Sender<Lsn>,
    batch_size: usize,
    wait: Duration,
    /// Rows gathered, not yet being written, and when the first of them came.
    rows: DeliveredRows,
    since: Option<tokio::time::Instant>,
    /// The last position waiting for `rows` or for the write in progress.
    waiting: Option<Lsn>,
    /// The write in progress and the position it lets through.
    writing: Option<(
        tokio::task::JoinHandle<crate::error::Result<u64>>,
        Option<Lsn>,
    )>,
}

impl Confirmer {
    fn new(confirm: watch::Sender<Lsn>, batch_size: usize, wait: Duration) -> Self {
        Self {
            confirm,
            batch_size,
            wait,
            rows: DeliveredRows::default(),
            since: None,
            waiting: None,
            writing: None,
        }
    }

    /// A batch is settled, and every batch before it: its rows join the gathered ones, and its
    /// position is confirmed now if no row before it is left to write.
    fn settled(&mut self, rows: DeliveredRows, position: Option<Lsn>) {
        if !rows.is_empty() {
            self.since.get_or_insert_with(tokio::time::Instant::now);
            self.rows.append(rows);
        }
        let Some(position) = position else { return };
        if self.rows.is_empty() && self.writing.is_none() {
            let _ = self.confirm.send(position);
        } else {
            self.waiting = Some(self.waiting.map_or(position, |w| w.max(position)));
        }
    }

    /// Waits for the write in progress to end (then starts the next if enough rows are
    /// gathered), or else for the gathered rows to be due and starts writing them; pending for
    /// ever when there is neither (a select! branch: cancel-safe).
    async fn step(&mut self, relay: &Arc<Relay>) -> Result<(), String> {
        if self.writing.is_some() {
            self.written().await?;
            self.write_if_due(relay, false);
            return Ok(());
        }
        let Some(since) = self.since else {
            return std::future::pending().await;
        };
        tokio::time::sleep_until(since + self.wait).await;
        self.write_if_due(relay, true);
        Ok(())
    }

    /// Starts writing the gathered rows if there are `batch_size` of them, or (`timed_out`)
    /// any, and no write is in progress.
    fn write_if_due(&mut self, relay: &Arc<Relay>, timed_out: bool) {
        if self.writing.is_some() || self.rows.is_empty() {
            return;
        }
        if !timed_out && self.rows.len() < self.batch_size {
            return;
        }
        let rows = std::mem::take(&mut self.rows);
        self.since = None;
        let relay = Arc::clone(relay);
        let task = tokio::spawn(async move { relay.write_wal_rows(&rows).await });
        self.writing = Some((task, self.waiting.take()));
    }

    /// The write in progress ended: on success its position is confirmed, and a later one too
    /// if nothing is left to write before it. Pending for ever when no write is in progress (a
    /// select! branch).
    async fn written(&mut self) -> Result<(), String> {
        let Some((task, _)) = &mut self.writing else {
            return std::future::pending().await;
        };
        let result = task.await;
        let position = self.writing.take().and_then(|(_, position)| position);
        match result {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return Err(crate::error_chain(&e)),
            Err(e) => return Err(format!("writing the delivered rows ended abnormally: {e}")),
        }
        // Positions that waited behind this write pass too, unless rows came in after them.
        let behind = if self.rows.is_empty() {
            self.waiting.take()
        } else {
            None
        };
        if let Some(position) = position.max(behind) {
            let _ = self.confirm.send(position);
        }
        Ok(())
    }

    /// Backpressure: with a write in progress and many more rows gathered behind it, waits for
    /// that write (reading on would only grow what a crash has to read again).
    async fn keep_up(&mut self) -> Result<(), String> {
        if self.writing.is_some() && self.rows.len() >= 4 * self.batch_size {
            self.written().await?;
        }
        Ok(())
    }

    /// On stop: waits for the write in progress, then writes what is left and confirms the last
    /// position.
    async fn finish(&mut self, relay: &Arc<Relay>) -> Result<(), String> {
        loop {
            self.write_if_due(relay, true);
            if self.writing.is_none() {
                return Ok(());
            }
            self.written().await?;
        }
    }
}

/// Reads the slot's health into the WAL gauges every `interval` until `stop`.
pub async fn refresh_gauges(relay: Arc<Relay>, interval: Duration, stop: CancellationToken) {
    let config = relay.config().clone();
    let names = Names::of(&config.wal, &config.table);
    let mut known: Option<String> = None;
    loop {
        match slot::status(relay.pool(), &names).await {
            Ok(Some(s)) => {
                metrics::gauge!(metric::WAL_SLOT_LAG_BYTES).set(s.lag_bytes.unwrap_or(0) as f64);
                // NULL when max_slot_wal_keep_size is unset: no bound, shown as -1.
                metrics::gauge!(metric::WAL_SLOT_SAFE_WAL_SIZE_BYTES)
                    .set(s.safe_wal_size.map_or(-1.0, |v| v as f64));
                let status = s.wal_status.unwrap_or_else(|| "unknown".into());
                if let Some(old) = known.replace(status.clone()).filter(|o| *o != status) {
                    metrics::gauge!(metric::WAL_SLOT_STATUS, "status" => old).set(0.0);
                }
                metrics::gauge!(metric::WAL_SLOT_STATUS, "status" => status).set(1.0);
            }
            Ok(None) => {
                if let Some(old) = known.take() {
                    metrics::gauge!(metric::WAL_SLOT_STATUS, "status" => old).set(0.0);
                }
                metrics::gauge!(metric::WAL_SLOT_STATUS, "status" => "missing").set(1.0);
            }
            Err(e) => {
                metrics::counter!(metric::DB_ERRORS_TOTAL).increment(1);
                warn!(error = %crate::error_chain(&e), "cannot read the replication slot's status");
            }
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(interval) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_replication_session_follows_the_database_url() {
        let names = Names {
            slot: "s".into(),
            publication: "p".into(),
        };
        let cfg = replication_config(
            "postgres://relay:p%40ss@db.example:6543/app?sslmode=verify-full&sslrootcert=/ca.pem",
            &names,
            Duration::from_secs(1),
        )
        .expect("valid");
        assert_eq!((cfg.host.as_str(), cfg.port), ("db.example", 6543));
        assert_eq!(
            (cfg.user.as_str(), cfg.password.as_str()),
            ("relay", "p@ss")
        );
        assert_eq!(cfg.database, "app");
        assert_eq!(cfg.tls.mode, SslMode::VerifyFull);
        let local = replication_config(
            "postgres:///app?host=/run/pg&port=5433",
            &names,
            Duration::from_secs(1),
        )
        .expect("valid");
        assert!(local.is_unix_socket());
        assert_eq!((local.port, local.user.as_str()), (5433, "postgres"));
        assert!(replication_config(
            "postgres://h/db?sslmode=bogus",
            &names,
            Duration::from_secs(1)
        )
        .is_err());
    }
}
