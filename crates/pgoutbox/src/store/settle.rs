//! A settle's writes: the plan of what one settle writes — rows delivered, failed or held, split
//! events fanned out to their pairs, held pairs in bulk — and writing it in one unit of work,
//! under the batch's claim (its transaction, or its lease token); a batch of pairs from the
//! deliveries table under its lease token. The statements that settle an outbox row are here;
//! those of the other tables are in their own files. Which plan a batch gets is decided above
//! (`crate::settle::plan`).

use std::collections::{BTreeMap, HashSet};

use uuid::Uuid;

use super::attempts::{self, Failure};
use super::deliveries::{self, PairIds, PairKind, PairRow, PairState, PairUpdate};
use super::held::{self, HeldRow};
use super::held_batches::HeldBatch;
use super::outbox::{self, Guard};
use super::{SettleMode, Store, Unit};
use crate::error::Result;
use crate::model::event::OutboxEvent;
use crate::model::report::{BatchReport, DeliveredRows};
use crate::table::OutboxTable;

/// OutboxSetPublishedMany. Primary-key lookups; the row leaves the pending index. Each row
/// records the destination that delivered it (`$2`, beside `$1`'s ids): one statement for a
/// batch whatever the number of destinations it spans. `$3` is the lease token in lease mode
/// (NULL in transaction mode, where the row lock already fences).
const SET_PUBLISHED_MANY: &str = "
UPDATE {outbox} AS o
SET published_at = statement_timestamp(), destination = d.destination, lease_token = NULL
FROM unnest($1::uuid[], $2::text[]) AS d(id, destination)
WHERE o.id = d.id AND ($3::uuid IS NULL OR o.lease_token = $3)";

/// OutboxDeleteMany. Primary-key lookups; used when retention is zero, the cheapest settle.
const DELETE_MANY: &str = "
DELETE FROM {outbox}
WHERE id = ANY($1) AND ($2::uuid IS NULL OR lease_token = $2)";

/// OutboxMoveMany. `history = "partitions"`: the rows leave the outbox as in OutboxDeleteMany (no
/// dead row version left behind for vacuum beyond the delete) and are appended to the current
/// partition of `{qname:history}`, which cleanup drops whole. Binds as OutboxSetPublishedMany;
/// the count is the rows moved.
const MOVE_MANY: &str = "
WITH moved AS (
    DELETE FROM {outbox} AS o
    USING unnest($1::uuid[], $2::text[]) AS d(id, destination)
    WHERE o.id = d.id AND ($3::uuid IS NULL OR o.lease_token = $3)
    RETURNING o.id, o.seq, o.topic, o.key, o.payload, o.headers, o.created_at, o.attempts,
              o.last_error, d.destination
)
INSERT INTO {qname:history} (id, seq, topic, key, payload, headers, created_at, published_at,
                             destination, attempts, last_error)
SELECT id, seq, topic, key, payload, headers, created_at, statement_timestamp(), destination,
       attempts, last_error
FROM moved";

/// OutboxSetFailedMany. One statement for every failure of a batch: the delay and the dead flag
/// are decided by the retry policy in Rust, the clock is the database's. `statement_timestamp()`,
/// not `now()`: in transaction mode `now()` is the claim's start, before the publish, and a delay
/// must count from the failure.
const SET_FAILED_MANY: &str = "
UPDATE {outbox} AS o
SET attempts = o.attempts + 1,
    last_error = f.error,
    destination = f.destination,
    next_attempt_at = statement_timestamp() + make_interval(secs => f.delay_secs),
    dead_at = CASE WHEN f.dead THEN statement_timestamp() END,
    lease_token = NULL
FROM unnest($1::uuid[], $2::text[], $3::text[], $4::float8[], $5::bool[])
     AS f(id, error, destination, delay_secs, dead)
WHERE o.id = f.id AND ($6::uuid IS NULL OR o.lease_token = $6)";

/// The statements that settle outbox rows, rendered.
pub(super) struct Sql {
    set_published_many: String,
    delete_many: String,
    move_many: String,
    set_failed_many: String,
}

impl Sql {
    pub(super) fn render(table: &OutboxTable) -> Self {
        Self {
            set_published_many: table.render(SET_PUBLISHED_MANY),
            delete_many: table.render(DELETE_MANY),
            move_many: table.render(MOVE_MANY),
            set_failed_many: table.render(SET_FAILED_MANY),
        }
    }
}

/// Delivered rows, to settle.
#[derive(Debug, Clone, Copy)]
pub struct Delivered<'a> {
    /// What they become.
    pub how: SettleMode,
    /// The rows.
    pub ids: &'a [Uuid],
    /// Beside each row, the destination that delivered it (recorded on the row).
    pub destinations: &'a [&'a str],
    /// The lease token fencing them, if any.
    pub token: Option<Uuid>,
}

/// OutboxSetPublishedMany, OutboxDeleteMany or OutboxMoveMany (as `rows.how` says). Returns the
/// rows written.
pub async fn settle_delivered(store: &Store, unit: &mut Unit, rows: &Delivered<'_>) -> Result<u64> {
    let sql = &store.sql.settle;
    let Delivered {
        how,
        ids,
        destinations,
        token,
    } = *rows;
    let query = match how {
        SettleMode::Delete => sqlx::query(&sql.delete_many).bind(ids),
        SettleMode::Mark => sqlx::query(&sql.set_published_many)
            .bind(ids)
            .bind(destinations),
        SettleMode::Move => sqlx::query(&sql.move_many).bind(ids).bind(destinations),
    };
    Ok(query
        .bind(token)
        .execute(unit.conn())
        .await?
        .rows_affected())
}

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

/// OutboxSetFailedMany: every failure of a batch in one statement, fenced by `token` if any.
pub async fn set_failed_many(
    store: &Store,
    unit: &mut Unit,
    failed: &[FailedRow],
    token: Option<Uuid>,
) -> Result<u64> {
    let f = failed;
    let done = sqlx::query(&store.sql.settle.set_failed_many)
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
        .execute(unit.conn())
        .await?;
    Ok(done.rows_affected())
}

/// What a batch's settle writes.
#[derive(Debug, Default, Clone)]
pub struct SettlePlan {
    /// Delivered event ids (or pairs, in a batch of pairs), per destination name.
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
    /// The lease token of pairs handed over with their request still out.
    pub in_flight: Option<Uuid>,
    /// Delivered events that have no table row (WAL `emit()` messages): counted, never written.
    pub rowless: HashSet<Uuid>,
    /// WAL: the delivered rows are not written with the rest of the plan but handed back
    /// ([`SettlePlan::delivered_rows`]) and written later with other batches'.
    pub defer_delivered: bool,
    /// WAL: `emit()` events that go on (as pairs, or dead) and need a row first, written in the
    /// settle's transaction.
    pub materialize: Vec<OutboxEvent>,
}

impl SettlePlan {
    /// The delivered events that have a row, to be written later with other batches' (WAL).
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

    /// Nothing to write (delivered rows aside when they are deferred).
    pub(crate) fn writes_nothing(&self) -> bool {
        (self.defer_delivered || self.delivered_rows().is_empty())
            && self.failed.is_empty()
            && self.held.is_empty()
            && self.fanned.iter().all(|id| self.rowless.contains(id))
    }

    /// Whether it writes anything to the deliveries table (a batch of pairs' plan).
    pub(crate) fn has_pairs(&self) -> bool {
        !self.failed.is_empty() || !self.delivered.is_empty() || !self.held.is_empty()
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

    /// What the plan counts: delivered, retried, dead and held events.
    pub fn report(&self) -> BatchReport {
        BatchReport {
            delivered: self.delivered_count(),
            retried: self.retry_count(),
            dead: self.dead_count(),
            held: self.held.len(),
            ..BatchReport::default()
        }
    }
}

/// How a settle went.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct SettleReport {
    /// Rows written.
    pub rows: u64,
    /// Rows the plan named that were not written because the lease was lost (lease mode).
    pub fenced: u64,
}

/// What a settle of rows writes besides its plan.
#[derive(Debug, Clone, Copy)]
pub struct Rows<'a> {
    /// What becomes of delivered rows.
    pub mode: SettleMode,
    /// Rows claimed but not attempted: given back as they were.
    pub untouched: &'a [Uuid],
    /// Ordered mode, `Some(names of the destinations whose dead rows block)`: the later rows of
    /// each failed or held event's key wait behind it (OutboxParkFollowers).
    pub park: Option<&'a [String]>,
}

/// Writes `plan` under the batch's claim `guard`, with `rows`' untouched rows and parking.
pub async fn apply(
    store: &Store,
    guard: Guard,
    plan: &SettlePlan,
    rows: Rows<'_>,
) -> Result<SettleReport> {
    let mut unit = match guard {
        Guard::Transaction(unit) => unit,
        // A WAL batch whose events all arrived (the usual case) costs no round trip here.
        Guard::Nothing if plan.writes_nothing() => return Ok(SettleReport::default()),
        Guard::Nothing => store.begin().await?,
        Guard::Lease(token) => {
            let mut unit = store.connect().await?;
            let written = write(store, &mut unit, plan, rows.mode, Some(token)).await?;
            if !rows.untouched.is_empty() {
                outbox::release_lease(store, &mut unit, rows.untouched, token).await?;
            }
            // After the release, which makes the given-back rows due now.
            park_followers(store, &mut unit, plan, rows.park).await?;
            let expected =
                (plan.delivered_count() + plan.failed.len() + plan.held.len() + plan.fanned.len())
                    as u64;
            return Ok(SettleReport {
                rows: written,
                fenced: expected.saturating_sub(written),
            });
        }
    };
    if !plan.materialize.is_empty() {
        // Rows for the WAL's rowless events that go on: settled in the transaction that writes
        // them.
        let events: Vec<&OutboxEvent> = plan.materialize.iter().collect();
        outbox::wal_materialize(store, &mut unit, &events).await?;
    }
    // Untouched rows need nothing: their locks end with the transaction.
    let written = write(store, &mut unit, plan, rows.mode, None).await?;
    park_followers(store, &mut unit, plan, rows.park).await?;
    unit.commit().await?;
    Ok(SettleReport {
        rows: written,
        fenced: 0,
    })
}

/// Marks published, deletes or moves to the history the delivered rows, as `mode` says: one
/// statement whatever the number of destinations (a batch may span thousands), fenced by the
/// lease's `token` if any.
async fn write_rows(
    store: &Store,
    unit: &mut Unit,
    delivered: &DeliveredRows,
    mode: SettleMode,
    token: Option<Uuid>,
) -> Result<u64> {
    if delivered.is_empty() {
        return Ok(0);
    }
    let mut ids = Vec::with_capacity(delivered.len());
    let mut destinations = Vec::with_capacity(delivered.len());
    for (destination, rows) in &delivered.0 {
        ids.extend_from_slice(rows);
        destinations.extend(rows.iter().map(|_| destination.as_str()));
    }
    let delivered = Delivered {
        how: mode,
        ids: &ids,
        destinations: &destinations,
        token,
    };
    settle_delivered(store, unit, &delivered).await
}

/// WAL: writes the delivered rows that [`apply`] deferred, several batches' at once, in one
/// statement.
pub async fn write_delivered(
    store: &Store,
    delivered: &DeliveredRows,
    mode: SettleMode,
) -> Result<u64> {
    if delivered.is_empty() {
        return Ok(0);
    }
    // One statement: no transaction to open and commit.
    let mut unit = store.connect().await?;
    write_rows(store, &mut unit, delivered, mode, None).await
}

async fn park_followers(
    store: &Store,
    unit: &mut Unit,
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
    held::park_followers(store, unit, &ids, blocking).await
}

/// A failed row or pair as an entry of the attempt history.
fn failure(f: &FailedRow) -> Failure<'_> {
    Failure {
        event_id: f.id,
        destination: f.destination.as_deref(),
        error: &f.error,
        dead: f.dead,
    }
}

/// Writes a batch of pairs' `plan` under its lease `token`: delivered pairs are deleted, failed
/// and held ones updated, `untouched` ones (event id, destination) given back due now. Returns how
/// the settle went (pairs the token no longer holds are fenced).
pub async fn apply_pairs(
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
    let mut unit = store.connect().await?;
    let mut rows = 0;
    if !ids.is_empty() {
        let delivered = PairIds {
            events: &ids,
            destinations: &destinations,
            token: Some(token),
        };
        rows += deliveries::delete(store, &mut unit, &delivered).await?;
    }
    let failed = plan.failed.iter().map(|f| PairUpdate {
        event_id: f.id,
        destination: f.destination.as_deref().unwrap_or_default(),
        kind: PairKind::Failed,
        error: Some(&f.error),
        delay_secs: f.delay_secs,
        dead: f.dead,
    });
    let held = plan.held.iter().map(|h| PairUpdate {
        event_id: h.id,
        destination: &h.destination,
        kind: PairKind::Held,
        error: h.error.as_deref(),
        delay_secs: 0.0,
        dead: false,
    });
    let released = untouched.iter().map(|(id, destination)| PairUpdate {
        event_id: *id,
        destination,
        kind: PairKind::Release,
        error: None,
        delay_secs: 0.0,
        dead: false,
    });
    let settle: Vec<PairUpdate<'_>> = failed.chain(held).chain(released).collect();
    if !settle.is_empty() {
        rows += deliveries::settle(store, &mut unit, &settle, Some(token)).await?;
    }
    attempts::log(store, &mut unit, plan.failed.iter().map(failure)).await?;
    let expected = (ids.len() + settle.len()) as u64;
    Ok(SettleReport {
        rows,
        fenced: expected.saturating_sub(rows),
    })
}

async fn write(
    store: &Store,
    unit: &mut Unit,
    plan: &SettlePlan,
    mode: SettleMode,
    token: Option<Uuid>,
) -> Result<u64> {
    let mut rows = 0;
    if !plan.defer_delivered {
        rows += write_rows(store, unit, &plan.delivered_rows(), mode, token).await?;
    }
    if !plan.failed.is_empty() {
        rows += set_failed_many(store, unit, &plan.failed, token).await?;
        attempts::log(store, unit, plan.failed.iter().map(failure)).await?;
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
            unit,
            &deliveries::FanOut {
                rows: mode,
                events: &fanned,
                pairs: &plan.pairs,
                bundles: &plan.bundles,
                token,
                in_flight: plan.in_flight,
            },
        )
        .await?;
        rows += settled as u64;
        // Pairs whose first attempt failed (held ones were not tried).
        let failed = plan
            .pairs
            .iter()
            .filter(|r| r.state != PairState::Held && r.attempts > 0);
        let failed = failed.filter_map(|r| {
            Some(Failure {
                event_id: r.event_id,
                destination: Some(r.destination.as_str()),
                error: r.error.as_deref()?,
                dead: r.state.dead(),
            })
        });
        attempts::log(store, unit, failed).await?;
    }
    if !plan.held.is_empty() {
        rows += held::hold_many(store, unit, &plan.held, token).await?;
    }
    Ok(rows)
}
