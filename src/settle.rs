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

use crate::error::Result;
use crate::model::event::OutboxEvent;
use crate::model::outcome::Outcome;
use crate::model::retry::{Decision, Failure, RetryPolicy};
use crate::sources::poll::Hold;
use crate::store::attempts::{self, Attempt};
pub use crate::store::deliveries::PairRow;
use crate::store::deliveries::{self, PairKind, PairUpdate};
pub use crate::store::held_batches::HeldBatch;
pub use crate::store::outbox::FailedRow;
use crate::store::outbox::{self, Delivered};
use crate::store::waiting;
pub use crate::store::waiting::HeldRow;
use crate::store::Store;

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
    /// What the store does with delivered rows in this mode.
    pub fn rows(self) -> Delivered {
        match self {
            Self::Mark => Delivered::Mark,
            Self::Delete => Delivered::Delete,
            Self::Move => Delivered::Move,
        }
    }

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
    store: &Store,
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
        Hold::Nothing => store.pool().begin().await?,
        Hold::Lease(token) => {
            let mut conn = store.pool().acquire().await?;
            let rows = write(store, &mut conn, plan, mode, Some(token)).await?;
            if !untouched.is_empty() {
                outbox::release_lease(store, &mut conn, untouched, token).await?;
            }
            // After the release, which makes the given-back rows due now.
            park_followers(store, &mut conn, plan, park).await?;
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
    let rows = write(store, &mut tx, plan, mode, None).await?;
    park_followers(store, &mut tx, plan, park).await?;
    tx.commit().await?;
    Ok(SettleReport { rows, fenced: 0 })
}

/// Marks published, deletes or moves to the history the delivered rows, as `mode` says: one
/// statement per destination, fenced by the lease's `token` if any.
async fn write_rows(
    store: &Store,
    conn: &mut sqlx::PgConnection,
    delivered: &DeliveredRows,
    mode: SettleMode,
    token: Option<Uuid>,
) -> Result<u64> {
    let mut rows = 0;
    for (destination, ids) in &delivered.0 {
        rows +=
            outbox::settle_delivered(store, conn, mode.rows(), (destination, ids), token).await?;
    }
    Ok(rows)
}

/// WAL: writes the delivered rows that [`apply`] deferred, several batches' at once, in one
/// transaction.
pub async fn write_delivered(
    store: &Store,
    delivered: &DeliveredRows,
    mode: SettleMode,
) -> Result<u64> {
    if delivered.is_empty() {
        return Ok(0);
    }
    let mut conn = store.pool().acquire().await?;
    if delivered.0.len() == 1 {
        // One statement: no transaction to open and commit.
        return write_rows(store, &mut conn, delivered, mode, None).await;
    }
    let mut tx = sqlx::Connection::begin(&mut *conn).await?;
    let rows = write_rows(store, &mut tx, delivered, mode, None).await?;
    tx.commit().await?;
    Ok(rows)
}

async fn park_followers(
    store: &Store,
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
    waiting::park_followers(store, conn, &ids, blocking).await
}

/// A failure as a row of the attempt history.
fn attempt(f: &FailedRow) -> Attempt<'_> {
    Attempt {
        event_id: f.id,
        destination: f.destination.as_deref(),
        error: &f.error,
        dead: f.dead,
    }
}

/// Writes a deliveries batch's `plan` under its lease `token`: delivered pairs are deleted, failed
/// and held ones updated, `untouched` ones (event id, destination) given back due now. Returns how
/// the settle went (pairs the token no longer holds are fenced).
pub async fn apply_deliveries(
    store: &Store,
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
    let mut conn = store.pool().acquire().await?;
    let mut rows = 0;
    if !ids.is_empty() {
        rows += deliveries::delete(store, &mut conn, (&ids, &destinations), Some(token)).await?;
    }
    let mut settle: Vec<PairUpdate<'_>> = Vec::new();
    for f in &plan.failed {
        settle.push(PairUpdate {
            event_id: f.id,
            destination: f.destination.as_deref().unwrap_or_default(),
            kind: PairKind::Failed,
            error: Some(&f.error),
            delay_secs: f.delay_secs,
            dead: f.dead,
        });
    }
    for h in &plan.held {
        settle.push(PairUpdate {
            event_id: h.id,
            destination: &h.destination,
            kind: PairKind::Held,
            error: h.error.as_deref(),
            delay_secs: 0.0,
            dead: false,
        });
    }
    for (id, destination) in untouched {
        settle.push(PairUpdate {
            event_id: *id,
            destination,
            kind: PairKind::Release,
            error: None,
            delay_secs: 0.0,
            dead: false,
        });
    }
    if !settle.is_empty() {
        rows += deliveries::settle(store, &mut conn, &settle, Some(token)).await?;
    }
    attempts::log(store, &mut conn, plan.failed.iter().map(attempt)).await?;
    let expected = (ids.len() + settle.len()) as u64;
    Ok(SettleReport {
        rows,
        fenced: expected.saturating_sub(rows),
    })
}

async fn write(
    store: &Store,
    conn: &mut sqlx::PgConnection,
    plan: &SettlePlan,
    mode: SettleMode,
    token: Option<Uuid>,
) -> Result<u64> {
    let mut rows = 0;
    if !plan.defer_delivered {
        rows += write_rows(store, &mut *conn, &plan.delivered_rows(), mode, token).await?;
    }
    if !plan.failed.is_empty() {
        rows += outbox::set_failed_many(store, &mut *conn, &plan.failed, token).await?;
        attempts::log(store, conn, plan.failed.iter().map(attempt)).await?;
    }
    let fanned: Vec<Uuid> = plan
        .fanned
        .iter()
        .filter(|id| !plan.rowless.contains(id))
        .copied()
        .collect();
    if !fanned.is_empty() {
        let (settled, _pairs) = deliveries::fan_out(
            store,
            &mut *conn,
            &deliveries::FanOut {
                rows: mode.rows(),
                events: &fanned,
                pairs: &plan.pairs,
                bundles: &plan.bundles,
                token,
            },
        )
        .await?;
        rows += settled as u64;
        // Pairs whose first attempt failed (held ones were not tried).
        let failed = plan.pairs.iter().filter(|r| !r.held && r.attempts > 0);
        let failed = failed.filter_map(|r| {
            Some(Attempt {
                event_id: r.event_id,
                destination: Some(r.destination.as_str()),
                error: r.error.as_deref()?,
                dead: r.dead,
            })
        });
        attempts::log(store, conn, failed).await?;
    }
    if !plan.held.is_empty() {
        rows += waiting::hold_many(store, &mut *conn, &plan.held, token).await?;
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
