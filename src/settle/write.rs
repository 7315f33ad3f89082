//! Writing a settle plan: under the batch's claim (its transaction, or its lease token), in one
//! transaction; a batch of pairs from the deliveries table under its lease token.

use uuid::Uuid;

use super::plan::{DeliveredRows, SettlePlan};
use super::SettleMode;
use crate::error::Result;
use crate::store::attempts::{self, Attempt};
use crate::store::deliveries::{self, PairKind, PairUpdate};
use crate::store::outbox::Guard;
use crate::store::outbox::{self, FailedRow};
use crate::store::waiting;
use crate::store::Store;

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
    guard: Guard,
    plan: &SettlePlan,
    mode: SettleMode,
    untouched: &[Uuid],
    park: Option<&[String]>,
) -> Result<SettleReport> {
    let mut tx = match guard {
        Guard::Transaction(tx) => tx,
        // A WAL batch whose events all arrived (the usual case) costs no round trip here.
        Guard::Nothing if plan.writes_nothing() => return Ok(SettleReport { rows: 0, fenced: 0 }),
        Guard::Nothing => store.pool().begin().await?,
        Guard::Lease(token) => {
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
                in_flight: plan.in_flight,
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
