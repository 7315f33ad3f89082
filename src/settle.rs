//! Settle: recording what publishing did, in at most a few statements per batch.
//!
//! Successes are marked published (or deleted, when retention is zero) in one statement per
//! destination; every failure of the batch, retried or dead-lettered, in one more. The decision per
//! failure comes from the destination's [`RetryPolicy`]; this module turns outcomes into that plan
//! ([`plan`], pure and unit-tested) and writes it ([`apply`]).
//!
//! Fan-out: a split event (several destinations, not all delivered) has its row settled and its
//! undelivered pairs written to the deliveries table in the same statement ([`SettlePlan::fanned`]);
//! a batch of deliveries is settled on that table ([`apply_deliveries`]) from the same kind of plan.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use rand::Rng;
use uuid::Uuid;

use crate::claim::Hold;
use crate::error::{Error, Result};
use crate::model::event::OutboxEvent;
use crate::model::outcome::Outcome;
use crate::model::retry::{Decision, Failure, RetryPolicy};
use crate::table::OutboxTable;

/// What settling a delivered event does to its outbox row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SettleMode {
    /// Keep it in the outbox, marked published (cleanup deletes it row by row after `retention`).
    Mark,
    /// Delete it (`retention = "0s"`).
    Delete,
    /// Move it to the partitioned history (`history = "partitions"`; cleanup drops partitions).
    Move,
}

impl SettleMode {
    /// The configuration's mode: retention zero deletes, else `history` decides.
    pub fn of(config: &crate::config::Config) -> Self {
        if config.retention.is_zero() {
            Self::Delete
        } else if config.history == crate::config::History::Partitions {
            Self::Move
        } else {
            Self::Mark
        }
    }
}

/// Longest `last_error` kept, so a chatty receiver cannot bloat the table.
const MAX_ERROR_LEN: usize = 1024;

/// One failed event's new state.
#[derive(Debug, Clone, PartialEq)]
pub struct FailedRow {
    /// The event.
    pub id: Uuid,
    /// What went wrong, for `last_error`.
    pub error: String,
    /// The destination that failed, if the event was routed.
    pub destination: Option<String>,
    /// Delay until the next attempt (ignored when dead).
    pub delay_secs: f64,
    /// Dead-lettered instead of retried.
    pub dead: bool,
}

impl FailedRow {
    /// This failure as a row of the attempt history (see [`log_attempts`]).
    fn attempt(&self) -> Attempt<'_> {
        (
            self.id,
            self.destination.as_deref(),
            self.error.as_str(),
            self.dead,
        )
    }
}

/// One event held for its destination (paused, or breaker open): it waits, no attempt counted.
#[derive(Debug, Clone, PartialEq)]
pub struct HeldRow {
    /// The event.
    pub id: Uuid,
    /// The destination it waits for.
    pub destination: String,
    /// The failure that was not counted as an attempt (the breaker was open), if any.
    pub error: Option<String>,
}

/// One undelivered pair of a split event, written to the deliveries table.
#[derive(Debug, Clone, PartialEq)]
pub struct PairRow {
    /// The event.
    pub event_id: Uuid,
    /// The destination.
    pub destination: String,
    /// Attempts counted so far.
    pub attempts: i32,
    /// Delay until it is due (ignored when held or dead).
    pub delay_secs: f64,
    /// Its last error, if any.
    pub error: Option<String>,
    /// Dead-lettered.
    pub dead: bool,
    /// Held for its destination (paused, breaker open): due at 'infinity'.
    pub held: bool,
    /// This settle counted a failed attempt for it (metrics).
    pub failed: bool,
}

/// What a batch's settle writes.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct SettlePlan {
    /// Delivered event ids (or pairs, in a deliveries batch), per destination name.
    pub delivered: BTreeMap<String, Vec<Uuid>>,
    /// Failures, retried or dead.
    pub failed: Vec<FailedRow>,
    /// Events held for their destination.
    pub held: Vec<HeldRow>,
    /// Split events: settled, their undelivered pairs going to the deliveries table.
    pub fanned: Vec<Uuid>,
    /// The undelivered pairs of the split events.
    pub pairs: Vec<PairRow>,
    /// The split events' delivered pairs, per destination (metrics; nothing to write).
    pub pairs_delivered: BTreeMap<String, Vec<Uuid>>,
    /// Held pairs of split events written in bulk: one held batch per destination instead of a
    /// row each. Only pairs that need no per-key order.
    pub bundles: Vec<HeldBatch>,
    /// Delivered events that have no table row (WAL `emit()` messages): counted, never written.
    pub rowless: std::collections::HashSet<Uuid>,
    /// WAL: the delivered rows are not written with the rest of the plan but handed back
    /// ([`SettlePlan::delivered_rows`]) and written later with other batches' ([`write_delivered`]).
    pub defer_delivered: bool,
}

/// Rows that WAL batches delivered everywhere, per destination, gathered from several batches to be
/// deleted (or marked published) in one statement per destination: a slot's events each cost one
/// row write instead of one settle transaction per batch (see `wal::Confirmer`).
#[derive(Debug, Default, Clone, PartialEq)]
pub struct DeliveredRows(BTreeMap<String, Vec<Uuid>>);

impl DeliveredRows {
    /// How many rows.
    pub fn len(&self) -> usize {
        self.0.values().map(Vec::len).sum()
    }

    /// No rows.
    pub fn is_empty(&self) -> bool {
        self.0.values().all(Vec::is_empty)
    }

    /// Adds `other`'s rows.
    pub fn append(&mut self, other: DeliveredRows) {
        for (destination, mut ids) in other.0 {
            self.0.entry(destination).or_default().append(&mut ids);
        }
    }
}

/// A destination's held pairs of one batch, as one `<table>_held_batches` row.
#[derive(Debug, Clone, PartialEq)]
pub struct HeldBatch {
    /// The destination that is down or paused.
    pub destination: String,
    /// The oldest event's creation time (`max_age`).
    pub oldest: DateTime<Utc>,
    /// How many events.
    pub count: i32,
    /// Events per topic, as a JSON object (status, gauges).
    pub topics: String,
    /// The events, one JSON array (DeliveriesUnbundle reads it back).
    pub events: Vec<u8>,
}

impl HeldBatch {
    /// Encodes `events` held for `destination`.
    pub fn encode(destination: &str, events: &[&OutboxEvent]) -> Result<Self> {
        let mut topics: BTreeMap<&str, u64> = BTreeMap::new();
        let mut body = Vec::with_capacity(events.len() * 192);
        body.push(b'[');
        for (i, e) in events.iter().enumerate() {
            if i > 0 {
                body.push(b',');
            }
            *topics.entry(e.topic.as_str()).or_default() += 1;
            serde_json::to_writer(&mut body, &Held(e)).map_err(Error::Payload)?;
        }
        body.push(b']');
        Ok(Self {
            destination: destination.to_owned(),
            oldest: events
                .iter()
                .map(|e| e.created_at)
                .min()
                .unwrap_or_else(Utc::now),
            count: i32::try_from(events.len()).unwrap_or(i32::MAX),
            topics: serde_json::to_string(&topics).map_err(Error::Payload)?,
            events: body,
        })
    }
}

/// An event as a held batch stores it: the columns of a deliveries row, under one-letter names
/// (`i` id, `s` seq, `t` topic, `k` key, `p` payload, `h` headers, `c` created_at in microseconds
/// since the epoch), an absent key and empty headers left out: the batch is written on the settle
/// path of the other destinations, so every byte counts (DeliveriesUnbundle reads it back).
struct Held<'a>(&'a OutboxEvent);

impl serde::Serialize for Held<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let e = self.0;
        let mut m = s.serialize_map(None)?;
        m.serialize_entry("i", &e.id)?;
        m.serialize_entry("s", &e.seq)?;
        m.serialize_entry("t", &e.topic)?;
        if let Some(key) = &e.key {
            m.serialize_entry("k", key)?;
        }
        m.serialize_entry("p", &e.payload)?;
        if !e.headers.is_empty() {
            m.serialize_entry("h", &Headers(&e.headers))?;
        }
        m.serialize_entry("c", &e.created_at.timestamp_micros())?;
        m.end()
    }
}

/// Headers as the JSON object they came from.
struct Headers<'a>(&'a [(String, String)]);

impl serde::Serialize for Headers<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in self.0 {
            m.serialize_entry(k, v)?;
        }
        m.end()
    }
}

impl SettlePlan {
    /// The delivered events that have a row, for [`write_delivered`].
    pub fn delivered_rows(&self) -> DeliveredRows {
        DeliveredRows(
            self.delivered
                .iter()
                .map(|(destination, ids)| {
                    let ids = ids.iter().filter(|id| !self.rowless.contains(id));
                    (destination.clone(), ids.copied().collect::<Vec<_>>())
                })
                .filter(|(_, ids)| !ids.is_empty())
                .collect(),
        )
    }

    /// Nothing for [`apply`] to write (delivered rows aside when they are deferred).
    fn writes_nothing(&self) -> bool {
        (self.defer_delivered || self.delivered_rows().is_empty())
            && self.failed.is_empty()
            && self.held.is_empty()
            && self.fanned.iter().all(|id| self.rowless.contains(id))
    }

    /// Number of delivered events.
    pub fn delivered_count(&self) -> usize {
        self.delivered.values().map(Vec::len).sum()
    }

    /// Number of events dead-lettered by this plan.
    pub fn dead_count(&self) -> usize {
        self.failed.iter().filter(|f| f.dead).count()
    }

    /// Number of events scheduled for another attempt.
    pub fn retry_count(&self) -> usize {
        self.failed.len() - self.dead_count()
    }

    /// Records a split event's undelivered pair from its failure (see [`decide`]).
    pub fn pair_failed(&mut self, attempts: i32, failed: FailedRow) {
        self.pairs.push(PairRow {
            event_id: failed.id,
            destination: failed.destination.unwrap_or_default(),
            attempts,
            delay_secs: failed.delay_secs,
            error: Some(failed.error),
            dead: failed.dead,
            held: false,
            failed: true,
        });
    }

    /// Records a split event's pair that is due without an attempt counted (`held`: at
    /// 'infinity' until its destination is back), with a note for `last_error`.
    pub fn pair_waiting(
        &mut self,
        event: &OutboxEvent,
        destination: &str,
        held: bool,
        note: Option<String>,
    ) {
        self.pairs.push(PairRow {
            event_id: event.id,
            destination: destination.to_owned(),
            attempts: event.attempts,
            delay_secs: 0.0,
            error: note.map(truncate),
            dead: false,
            held,
            failed: false,
        });
    }

    /// Dead-letters a row the relay could not read (a poison row), with the reason.
    pub fn poison(&mut self, id: Uuid, reason: &str) {
        self.failed.push(unreadable(id, None, reason));
    }

    /// Dead-letters a pair of the deliveries table that cannot be read as an event.
    pub fn poison_pair(&mut self, id: Uuid, destination: &str, reason: &str) {
        self.failed
            .push(unreadable(id, Some(destination.to_owned()), reason));
    }

    /// Holds an event for `destination`; `error` is a failure not counted as an attempt.
    pub fn hold(&mut self, id: Uuid, destination: &str, error: Option<&str>) {
        self.held.push(HeldRow {
            id,
            destination: destination.to_owned(),
            error: error.map(|e| {
                truncate(format!(
                    "{e} [held: {destination} is unavailable, not counted as an attempt]"
                ))
            }),
        });
    }
}

/// The dead letter of a row (or pair) that cannot be read as an event.
fn unreadable(id: Uuid, destination: Option<String>, reason: &str) -> FailedRow {
    FailedRow {
        id,
        error: truncate(format!(
            "cannot relay this row: {reason} [dead: unreadable row]"
        )),
        destination,
        delay_secs: 0.0,
        dead: true,
    }
}

/// `max_age` still applies while a destination is unavailable: the dead letter of an event held
/// for `destination` past its policy's `max_age`, or `None` while it may wait.
pub fn expired_hold(
    event: &OutboxEvent,
    destination: &str,
    policy: &RetryPolicy,
    now: DateTime<Utc>,
) -> Option<FailedRow> {
    policy.expired(event.created_at, now).map(|why| FailedRow {
        id: event.id,
        error: format!("held for {destination}: {why}"),
        destination: Some(destination.to_owned()),
        delay_secs: 0.0,
        dead: true,
    })
}

/// The destination an event was routed to, with its policy; `None` for an unroutable event.
pub type Route<'a> = Option<(&'a str, &'a RetryPolicy)>;

/// Turns the outcomes of the events that were attempted into writes.
pub fn plan<'a>(
    attempted: impl IntoIterator<Item = (&'a OutboxEvent, Route<'a>, &'a Outcome)>,
    now: DateTime<Utc>,
    rng: &mut impl Rng,
) -> SettlePlan {
    let mut plan = SettlePlan::default();
    for (event, route, outcome) in attempted {
        let Some((destination, policy)) = route else {
            plan.failed.push(FailedRow {
                id: event.id,
                error: format!(
                    "no destination takes topic {:?} (by its `topics` and `filter`): make one take it, then `pgoutbox dead retry`",
                    event.topic
                ),
                destination: None,
                delay_secs: 0.0,
                dead: true,
            });
            continue;
        };
        match decide(event, destination, policy, outcome, now, rng) {
            None => {
                // No String per event: the destination is looked up, inserted once.
                match plan.delivered.get_mut(destination) {
                    Some(ids) => ids.push(event.id),
                    None => {
                        plan.delivered
                            .insert(destination.to_owned(), vec![event.id]);
                    }
                }
            }
            Some(failed) => plan.failed.push(failed),
        }
    }
    plan
}

/// One attempt's outcome for `destination` under its policy: `None` when delivered, else the
/// failure's new state (retried after a delay, or dead).
pub fn decide(
    event: &OutboxEvent,
    destination: &str,
    policy: &RetryPolicy,
    outcome: &Outcome,
    now: DateTime<Utc>,
    rng: &mut impl Rng,
) -> Option<FailedRow> {
    let attempt = event.attempts + 1;
    let (error, decision) = match outcome {
        Outcome::Delivered => return None,
        Outcome::Rejected { reason } => (reason, Decision::Dead("permanent failure".into())),
        Outcome::Retry {
            reason,
            retry_after,
        } => {
            let failure = Failure {
                previous_attempts: event.attempts,
                created_at: event.created_at,
                retry_after: *retry_after,
            };
            (reason, policy.decide(&failure, now, rng))
        }
    };
    let (delay_secs, dead, suffix) = match decision {
        Decision::Retry(delay) => (delay.as_secs_f64(), false, String::new()),
        Decision::Dead(why) => (0.0, true, format!(" [dead: {why}]")),
    };
    Some(FailedRow {
        id: event.id,
        error: truncate(format!(
            "attempt {attempt} to {destination}: {error}{suffix}"
        )),
        destination: Some(destination.to_owned()),
        delay_secs,
        dead,
    })
}

fn truncate(mut s: String) -> String {
    if s.len() > MAX_ERROR_LEN {
        let mut cut = MAX_ERROR_LEN;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push('…');
    }
    s
}

/// How a settle went.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct SettleReport {
    /// Rows written.
    pub rows: u64,
    /// Rows the plan named that were not written because the lease was lost (lease mode).
    pub fenced: u64,
}

/// Writes `plan` under the batch's claim; `mode` says what becomes of delivered rows.
/// `untouched` rows were claimed but not attempted: they are given back as they were.
/// `park`: ordered mode, `Some(names of the destinations whose dead rows block)`: the later rows of
/// each failed or held event's key wait behind it (OutboxParkFollowers).
pub async fn apply(
    table: &OutboxTable,
    pool: &sqlx::PgPool,
    hold: Hold,
    plan: &SettlePlan,
    mode: SettleMode,
    untouched: &[Uuid],
    park: Option<&[String]>,
) -> Result<SettleReport> {
    let mut tx = match hold {
        Hold::Transaction(tx) => tx,
        // A WAL batch whose events all arrived (the usual case) costs no round trip here.
        Hold::Nothing if plan.writes_nothing() => return Ok(SettleReport { rows: 0, fenced: 0 }),
        Hold::Nothing => pool.begin().await?,
        Hold::Lease(token) => {
            let mut conn = pool.acquire().await?;
            let rows = write(table, &mut conn, plan, mode, Some(token)).await?;
            if !untouched.is_empty() {
                sqlx::query(&table.sql.release_lease)
                    .bind(untouched)
                    .bind(token)
                    .execute(&mut *conn)
                    .await?;
            }
            // After the release, which makes the given-back rows due now.
            park_followers(table, &mut conn, plan, park).await?;
            let expected =
                (plan.delivered_count() + plan.failed.len() + plan.held.len() + plan.fanned.len())
                    as u64;
            return Ok(SettleReport {
                rows,
                fenced: expected.saturating_sub(rows),
            });
        }
    };
    // Untouched rows need nothing: their locks end with the transaction.
    let rows = write(table, &mut tx, plan, mode, None).await?;
    park_followers(table, &mut tx, plan, park).await?;
    tx.commit().await?;
    Ok(SettleReport { rows, fenced: 0 })
}

/// WAL source: gives `emit()` events that a destination did not take a row, pending, in the
/// settle's transaction (WalMaterialize), so that the settle can fan them out or dead-letter them
/// like any row. A row that is already there (the batch read again after a crash) is kept.
pub async fn materialize(
    table: &OutboxTable,
    conn: &mut sqlx::PgConnection,
    events: &[&OutboxEvent],
) -> Result<()> {
    let headers: Vec<String> = events
        .iter()
        .map(|e| {
            serde_json::Value::Object(
                e.headers
                    .iter()
                    .map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone())))
                    .collect(),
            )
            .to_string()
        })
        .collect();
    let inserted: Vec<Uuid> = sqlx::query_scalar(&table.sql.wal_materialize)
        .bind(events.iter().map(|e| e.id).collect::<Vec<_>>())
        .bind(events.iter().map(|e| e.topic.as_str()).collect::<Vec<_>>())
        .bind(events.iter().map(|e| e.key.as_deref()).collect::<Vec<_>>())
        .bind(events.iter().map(|e| e.payload.get()).collect::<Vec<_>>())
        .bind(headers)
        .bind(events.iter().map(|e| e.created_at).collect::<Vec<_>>())
        .fetch_all(&mut *conn)
        .await?;
    if !inserted.is_empty() {
        sqlx::query(&table.sql.wal_unmark)
            .bind(&inserted)
            .execute(&mut *conn)
            .await?;
    }
    Ok(())
}

/// Marks published, deletes or moves to the history the delivered rows, as `mode` says: one
/// statement per destination (SetPublishedMany, DeleteMany, MoveMany: by primary key), fenced by
/// the lease's `token` if any.
async fn write_rows(
    table: &OutboxTable,
    conn: &mut sqlx::PgConnection,
    delivered: &DeliveredRows,
    mode: SettleMode,
    token: Option<Uuid>,
) -> Result<u64> {
    let mut rows = 0;
    for (destination, ids) in &delivered.0 {
        let query = match mode {
            SettleMode::Delete => sqlx::query(&table.sql.delete_many).bind(ids),
            SettleMode::Mark => sqlx::query(&table.sql.set_published_many)
                .bind(ids)
                .bind(destination),
            SettleMode::Move => sqlx::query(&table.sql.move_many)
                .bind(ids)
                .bind(destination),
        };
        let done = query.bind(token).execute(&mut *conn).await?;
        rows += done.rows_affected();
    }
    Ok(rows)
}

/// WAL: writes the delivered rows that [`apply`] deferred, several batches' at once, in one
/// transaction.
pub async fn write_delivered(
    table: &OutboxTable,
    pool: &sqlx::PgPool,
    delivered: &DeliveredRows,
    mode: SettleMode,
) -> Result<u64> {
    if delivered.is_empty() {
        return Ok(0);
    }
    let mut conn = pool.acquire().await?;
    if delivered.0.len() == 1 {
        // One statement: no transaction to open and commit.
        return write_rows(table, &mut conn, delivered, mode, None).await;
    }
    let mut tx = sqlx::Connection::begin(&mut *conn).await?;
    let rows = write_rows(table, &mut tx, delivered, mode, None).await?;
    tx.commit().await?;
    Ok(rows)
}

async fn park_followers(
    table: &OutboxTable,
    conn: &mut sqlx::PgConnection,
    plan: &SettlePlan,
    park: Option<&[String]>,
) -> Result<()> {
    let Some(blocking) = park else {
        return Ok(());
    };
    if plan.failed.is_empty() && plan.held.is_empty() {
        return Ok(());
    }
    let ids: Vec<Uuid> = plan
        .failed
        .iter()
        .map(|f| f.id)
        .chain(plan.held.iter().map(|h| h.id))
        .collect();
    sqlx::query(&table.sql.park_followers)
        .bind(ids)
        .bind(blocking)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// Makes rows waiting at 'infinity' due again once nothing holds them back: no dead row of a
/// blocking destination and no held row ahead of them in their key, and their own destination
/// neither paused nor with its breaker open (OutboxUnparkFollowers). Returns how many.
/// Held deliveries whose destination is back are due again too (DeliveriesUnpark), as are its held
/// batches (DeliveriesUnbundle).
pub async fn unpark_followers(table: &OutboxTable, pool: &sqlx::PgPool) -> Result<u64> {
    let done = sqlx::query(&table.sql.unpark_followers)
        .execute(pool)
        .await?;
    let pairs = sqlx::query(&table.sql.deliveries_unpark)
        .execute(pool)
        .await?;
    let unbundled = unbundle(table, pool, None, None).await?;
    Ok(done.rows_affected() + pairs.rows_affected() + unbundled)
}

/// Held batches turned into deliveries per round trip: bounds each statement's size.
const UNBUNDLE_BATCHES: i64 = 50;

/// Turns held batches into deliveries rows (DeliveriesUnbundle), in rounds until none is left:
/// with `destination` `None`, those of every destination that is back (due now); with
/// `Some((name, limit))`, up to `limit` batches of that destination, still held (for its probe),
/// or, with `older_than`, those holding an event older than that (for `max_age`). Returns the
/// number of pairs.
pub async fn unbundle(
    table: &OutboxTable,
    pool: &sqlx::PgPool,
    destination: Option<(&str, i64)>,
    older_than: Option<std::time::Duration>,
) -> Result<u64> {
    let mut pairs = 0;
    loop {
        let limit = destination.map_or(UNBUNDLE_BATCHES, |(_, n)| n.min(UNBUNDLE_BATCHES));
        let (batches, moved): (i64, i64) = sqlx::query_as(&table.sql.deliveries_unbundle)
            .bind(limit)
            .bind(destination.map(|(name, _)| name))
            .bind(destination.is_some())
            .bind(older_than.map(|d| d.as_secs_f64()))
            .fetch_one(pool)
            .await?;
        pairs += moved as u64;
        // A destination's probe needs one batch only; the rest go on in rounds.
        if batches < limit || destination.is_some_and(|(_, n)| n <= limit) {
            return Ok(pairs);
        }
    }
}

/// One failed attempt for the history: (event id, destination, error, dead-lettered).
type Attempt<'a> = (Uuid, Option<&'a str>, &'a str, bool);

/// AttemptsLog: records failed attempts for the history, in the settle's transaction. Nothing is
/// written when nothing failed.
async fn log_attempts<'a>(
    table: &OutboxTable,
    conn: &mut sqlx::PgConnection,
    failed: impl Iterator<Item = Attempt<'a>>,
) -> Result<()> {
    let (mut ids, mut destinations, mut errors, mut dead) = (vec![], vec![], vec![], vec![]);
    for (id, destination, error, is_dead) in failed {
        ids.push(id);
        destinations.push(destination);
        errors.push(error);
        dead.push(is_dead);
    }
    if ids.is_empty() {
        return Ok(());
    }
    sqlx::query(&table.sql.attempts_log)
        .bind(ids)
        .bind(destinations)
        .bind(errors)
        .bind(dead)
        .execute(conn)
        .await?;
    Ok(())
}

/// One pair's new state in DeliveriesSettle: (event id, destination, kind, error, delay, dead).
type PairUpdate<'a> = (Uuid, &'a str, &'static str, Option<&'a str>, f64, bool);

/// Writes a deliveries batch's `plan` under its lease `token`: delivered pairs are deleted, failed
/// and held ones updated, `untouched` ones (event id, destination) given back due now. Returns how
/// the settle went (pairs the token no longer holds are fenced).
pub async fn apply_deliveries(
    table: &OutboxTable,
    pool: &sqlx::PgPool,
    token: Uuid,
    plan: &SettlePlan,
    untouched: &[(Uuid, String)],
) -> Result<SettleReport> {
    let mut ids: Vec<Uuid> = Vec::new();
    let mut destinations: Vec<&str> = Vec::new();
    for (destination, pairs) in &plan.delivered {
        for id in pairs {
            ids.push(*id);
            destinations.push(destination);
        }
    }
    let mut conn = pool.acquire().await?;
    let mut rows = 0;
    if !ids.is_empty() {
        rows += sqlx::query(&table.sql.deliveries_delete)
            .bind(&ids)
            .bind(&destinations)
            .bind(token)
            .execute(&mut *conn)
            .await?
            .rows_affected();
    }
    let mut settle: Vec<PairUpdate<'_>> = Vec::new();
    for f in &plan.failed {
        let destination = f.destination.as_deref().unwrap_or_default();
        settle.push((
            f.id,
            destination,
            "failed",
            Some(&f.error),
            f.delay_secs,
            f.dead,
        ));
    }
    for h in &plan.held {
        settle.push((h.id, &h.destination, "held", h.error.as_deref(), 0.0, false));
    }
    for (id, destination) in untouched {
        settle.push((*id, destination, "release", None, 0.0, false));
    }
    if !settle.is_empty() {
        rows += sqlx::query(&table.sql.deliveries_settle)
            .bind(settle.iter().map(|s| s.0).collect::<Vec<_>>())
            .bind(settle.iter().map(|s| s.1).collect::<Vec<_>>())
            .bind(settle.iter().map(|s| s.2).collect::<Vec<_>>())
            .bind(settle.iter().map(|s| s.3).collect::<Vec<_>>())
            .bind(settle.iter().map(|s| s.4).collect::<Vec<_>>())
            .bind(settle.iter().map(|s| s.5).collect::<Vec<_>>())
            .bind(token)
            .execute(&mut *conn)
            .await?
            .rows_affected();
    }
    log_attempts(table, &mut conn, plan.failed.iter().map(FailedRow::attempt)).await?;
    let expected = (ids.len() + settle.len()) as u64;
    Ok(SettleReport {
        rows,
        fenced: expected.saturating_sub(rows),
    })
}

async fn write(
    table: &OutboxTable,
    conn: &mut sqlx::PgConnection,
    plan: &SettlePlan,
    mode: SettleMode,
    token: Option<Uuid>,
) -> Result<u64> {
    let mut rows = 0;
    let with_rows = |ids: &[Uuid]| -> Vec<Uuid> {
        ids.iter()
            .filter(|id| !plan.rowless.contains(id))
            .copied()
            .collect()
    };
    if !plan.defer_delivered {
        rows += write_rows(table, &mut *conn, &plan.delivered_rows(), mode, token).await?;
    }
    if !plan.failed.is_empty() {
        let f = &plan.failed;
        let done = sqlx::query(&table.sql.set_failed_many)
            .bind(f.iter().map(|r| r.id).collect::<Vec<_>>())
            .bind(f.iter().map(|r| r.error.as_str()).collect::<Vec<_>>())
            .bind(
                f.iter()
                    .map(|r| r.destination.as_deref())
                    .collect::<Vec<_>>(),
            )
            .bind(f.iter().map(|r| r.delay_secs).collect::<Vec<_>>())
            .bind(f.iter().map(|r| r.dead).collect::<Vec<_>>())
            .bind(token)
            .execute(&mut *conn)
            .await?;
        rows += done.rows_affected();
        log_attempts(table, conn, f.iter().map(FailedRow::attempt)).await?;
    }
    let fanned = with_rows(&plan.fanned);
    if !fanned.is_empty() {
        let p = &plan.pairs;
        let statement = match mode {
            SettleMode::Mark => &table.sql.deliveries_fan_out,
            SettleMode::Delete => &table.sql.deliveries_fan_out_delete,
            SettleMode::Move => &table.sql.deliveries_fan_out_move,
        };
        let b = &plan.bundles;
        let (settled, _pairs): (i64, i64) = sqlx::query_as(statement)
            .bind(&fanned)
            .bind(p.iter().map(|r| r.event_id).collect::<Vec<_>>())
            .bind(p.iter().map(|r| r.destination.as_str()).collect::<Vec<_>>())
            .bind(p.iter().map(|r| r.attempts).collect::<Vec<_>>())
            .bind(p.iter().map(|r| r.delay_secs).collect::<Vec<_>>())
            .bind(p.iter().map(|r| r.error.as_deref()).collect::<Vec<_>>())
            .bind(p.iter().map(|r| r.dead).collect::<Vec<_>>())
            .bind(p.iter().map(|r| r.held).collect::<Vec<_>>())
            .bind(token)
            .bind(b.iter().map(|b| b.destination.as_str()).collect::<Vec<_>>())
            .bind(b.iter().map(|b| b.oldest).collect::<Vec<_>>())
            .bind(b.iter().map(|b| b.count).collect::<Vec<_>>())
            .bind(b.iter().map(|b| b.topics.as_str()).collect::<Vec<_>>())
            .bind(b.iter().map(|b| b.events.as_slice()).collect::<Vec<_>>())
            .fetch_one(&mut *conn)
            .await?;
        rows += settled as u64;
        // Pairs whose first attempt failed (held ones were not tried).
        log_attempts(
            table,
            conn,
            p.iter()
                .filter(|r| !r.held && r.attempts > 0)
                .filter_map(|r| {
                    let error = r.error.as_deref()?;
                    Some((r.event_id, Some(r.destination.as_str()), error, r.dead))
                }),
        )
        .await?;
    }
    if !plan.held.is_empty() {
        let h = &plan.held;
        let done = sqlx::query(&table.sql.hold_many)
            .bind(h.iter().map(|r| r.id).collect::<Vec<_>>())
            .bind(h.iter().map(|r| r.destination.as_str()).collect::<Vec<_>>())
            .bind(h.iter().map(|r| r.error.as_deref()).collect::<Vec<_>>())
            .bind(token)
            .execute(&mut *conn)
            .await?;
        rows += done.rows_affected();
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::SeedableRng;
    use serde_json::value::RawValue;
    use std::time::Duration;

    fn event(attempts: i32) -> OutboxEvent {
        OutboxEvent {
            id: Uuid::new_v4(),
            seq: 1,
            topic: "order.created".into(),
            key: None,
            payload: RawValue::from_string("{}".into()).expect("json"),
            headers: vec![],
            created_at: Utc::now(),
            attempts,
        }
    }

    #[test]
    fn outcomes_become_one_plan() {
        let policy = RetryPolicy {
            schedule: vec![Duration::from_secs(1), Duration::from_secs(30)],
            max_attempts: Some(3),
            max_age: None,
            jitter: 0.0,
        };
        let events = [event(0), event(0), event(2), event(0), event(0)];
        let route = Some(("billing", &policy));
        let routes = vec![route, route, route, route, None];
        let outcomes = vec![
            Outcome::Delivered,
            Outcome::retry("HTTP 503"),
            Outcome::retry("HTTP 503"),
            Outcome::Rejected {
                reason: "HTTP 400: bad".into(),
            },
            Outcome::Delivered,
        ];
        let attempted = events
            .iter()
            .zip(routes)
            .zip(&outcomes)
            .map(|((e, r), o)| (e, r, o));
        let plan = plan(attempted, Utc::now(), &mut StdRng::seed_from_u64(1));
        assert_eq!(plan.delivered["billing"], vec![events[0].id]);
        assert_eq!(plan.failed.len(), 4);
        assert_eq!(
            (plan.failed[0].dead, plan.failed[0].delay_secs),
            (false, 1.0)
        );
        assert!(plan.failed[1].dead, "third attempt of max 3 dead-letters");
        assert!(plan.failed[2].dead && plan.failed[2].error.contains("HTTP 400: bad"));
        assert!(plan.failed[3].dead && plan.failed[3].error.contains("no destination"));
        assert_eq!(
            (
                plan.delivered_count(),
                plan.retry_count(),
                plan.dead_count()
            ),
            (1, 1, 3)
        );
    }
}
