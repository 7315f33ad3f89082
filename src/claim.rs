//! Claim: taking due rows so that no other relay publishes them at the same time.
//!
//! Two ways to hold a claim ([`ClaimMode`]):
//! - `transaction`: the claiming transaction keeps the row locks (`FOR UPDATE SKIP LOCKED`) while
//!   the batch is published, then settles and commits. A crashed relay's locks vanish with its
//!   connection, so its rows are due again at once. One write per event (the settle).
//! - `lease`: the claim commits at once, pushing `next_attempt_at` to the lease expiry and stamping a
//!   fencing token; settles only apply with that token. No transaction is open while publishing,
//!   which suits slow destinations; a crashed relay's rows wait for the lease to expire.

use std::time::Duration;

use sqlx::{PgPool, Postgres, Transaction};
use uuid::Uuid;

use crate::config::ClaimMode;

use crate::error::Result;
use crate::model::event::OutboxEvent;
use crate::table::OutboxTable;

/// How a claimed batch is held until it is settled.
pub enum Hold {
    /// The open claiming transaction, holding the row locks.
    Transaction(Transaction<'static, Postgres>),
    /// The lease's fencing token.
    Lease(Uuid),
    /// Nothing holds the rows (WAL batches: no claim took them): a settle that has something to
    /// write opens a transaction of its own.
    Nothing,
}

/// A batch of claimed events and what holds them.
pub struct ClaimedBatch {
    /// The events to publish, in seq order.
    pub events: Vec<OutboxEvent>,
    /// Rows that could not be read as events (a NULL where a value is needed, headers that are not
    /// an object…), with the reason: the settle dead-letters them, so they never block a claim.
    pub poison: Vec<(Uuid, String)>,
    /// Ordered mode: rows claimed behind a key's first not-due or dead row, not to be published
    /// now (released at settle: the transaction ends, or the lease is given back).
    pub held_back: Vec<Uuid>,
    /// The claim to settle under.
    pub hold: Hold,
    /// Ordered mode: heads and followers the claim found (before the batch-size cut).
    pub found: Option<(i64, i64)>,
}

/// What to claim and how.
#[derive(Debug, Clone, Copy)]
pub struct ClaimOptions {
    /// Transaction-held or leased.
    pub mode: ClaimMode,
    /// Most rows per batch.
    pub limit: usize,
    /// Lease length (lease mode).
    pub lease: Duration,
    /// Per-key ordering: a key's events are claimed from its first unsettled row on.
    pub ordered: bool,
    /// Ordered mode: most keys (chain heads) per claim, so that heads plus their followers fill
    /// about `limit` rows; `limit` when events rarely share a key.
    pub heads: usize,
    /// Ordered mode: most followers taken per head.
    pub followers: usize,
    /// Ordered mode: how many due rows, from the oldest, the search for heads looks at.
    pub window: u64,
}

/// The heads window a relay starts from, per row of batch size: wide enough to reach past the rows
/// other relays hold while they publish.
pub const WINDOW_PER_BATCH_ROW: u64 = 4;

/// Past this many rows, a widened heads window becomes unbounded (the whole due range).
pub const WINDOW_UNBOUNDED_FROM: u64 = 1 << 20;

/// Most later events of one key carried in a batch behind its head (ordered mode).
pub const FOLLOWERS_PER_KEY: usize = 100;

/// Claims due events per `options`. Ordered claims: `blocking` names the destinations whose dead
/// events hold back the later events of their key (`on_dead = "block"`).
pub async fn claim_due(
    pool: &PgPool,
    table: &OutboxTable,
    options: &ClaimOptions,
    blocking: &[String],
) -> Result<ClaimedBatch> {
    let limit = i64::try_from(options.limit).unwrap_or(i64::MAX);
    let lease = options.lease.as_secs_f64();
    let heads = i64::try_from(options.heads.clamp(1, options.limit.max(1))).unwrap_or(1);
    let followers = i64::try_from(options.followers.min(FOLLOWERS_PER_KEY)).unwrap_or(0);
    let window = if options.window >= WINDOW_UNBOUNDED_FROM {
        i64::MAX
    } else {
        i64::try_from(options.window).unwrap_or(i64::MAX)
    };
    let (rows, hold) = match (options.mode, options.ordered) {
        (ClaimMode::Transaction, false) => {
            let mut tx = pool.begin().await?;
            let rows = sqlx::query(&table.sql.claim_due)
                .bind(limit)
                .fetch_all(&mut *tx)
                .await?;
            (rows, Hold::Transaction(tx))
        }
        (ClaimMode::Transaction, true) => {
            let mut tx = pool.begin().await?;
            let rows = sqlx::query(&table.sql.claim_due_ordered)
                .bind(limit)
                .bind(followers)
                .bind(blocking)
                .bind(heads)
                .bind(window)
                .fetch_all(&mut *tx)
                .await?;
            (rows, Hold::Transaction(tx))
        }
        (ClaimMode::Lease, false) => {
            let token = Uuid::new_v4();
            let rows = sqlx::query(&table.sql.claim_lease)
                .bind(limit)
                .bind(lease)
                .bind(token)
                .fetch_all(pool)
                .await?;
            (rows, Hold::Lease(token))
        }
        (ClaimMode::Lease, true) => {
            let token = Uuid::new_v4();
            let rows = sqlx::query(&table.sql.claim_lease_ordered)
                .bind(limit)
                .bind(followers)
                .bind(blocking)
                .bind(heads)
                .bind(window)
                .bind(lease)
                .bind(token)
                .fetch_all(pool)
                .await?;
            (rows, Hold::Lease(token))
        }
    };
    let found = match (options.ordered, rows.first()) {
        (true, Some(row)) => Some((
            sqlx::Row::try_get::<i64, _>(row, "heads_found")?,
            sqlx::Row::try_get::<i64, _>(row, "followers_found")?,
        )),
        _ => None,
    };
    let mut events = Vec::with_capacity(rows.len());
    let mut poison = Vec::new();
    let mut held_back = Vec::new();
    // Ordered mode: a key's chain stops at its first row that is not due or dead; the rows behind
    // it must wait for it, whatever their own state.
    let mut stopped_keys: std::collections::HashSet<String> = std::collections::HashSet::new();
    for row in &rows {
        let key: Option<String> = sqlx::Row::try_get(row, "key").ok().flatten();
        if options.ordered {
            let due: bool = sqlx::Row::try_get(row, "due")?;
            let stopped = key.as_ref().is_some_and(|k| stopped_keys.contains(k));
            if !due || stopped {
                if let Some(k) = key {
                    stopped_keys.insert(k);
                }
                held_back.push(sqlx::Row::try_get(row, "id")?);
                continue;
            }
        }
        match OutboxEvent::from_row(row) {
            Ok(event) => events.push(event),
            Err(e) => {
                // The primary key always decodes; whatever else is wrong is this row's alone.
                let id: Uuid = sqlx::Row::try_get(row, "id")?;
                if let Some(k) = key {
                    // Its later rows wait for the next claim, which sees it dead.
                    stopped_keys.insert(k);
                }
                poison.push((id, crate::error_chain(&e)));
            }
        }
    }
    // UPDATE … RETURNING does not keep the CTE's order.
    events.sort_by_key(|e| e.seq);
    Ok(ClaimedBatch {
        events,
        poison,
        held_back,
        hold,
        found,
    })
}

/// Gives a claimed batch back untouched: rolls the claiming transaction back, or ends the lease.
pub async fn release(pool: &PgPool, table: &OutboxTable, hold: Hold, ids: &[Uuid]) -> Result<()> {
    match hold {
        Hold::Transaction(tx) => tx.rollback().await?,
        Hold::Nothing => {}
        Hold::Lease(token) => {
            sqlx::query(&table.sql.release_lease)
                .bind(ids)
                .bind(token)
                .execute(pool)
                .await?;
        }
    }
    Ok(())
}

/// A claimed delivery: one (event, destination) pair from the deliveries table.
pub struct ClaimedDelivery {
    /// The destination's name.
    pub destination: String,
    /// The event (its `attempts` are the pair's).
    pub event: OutboxEvent,
}

/// A batch of claimed deliveries, leased under one token.
pub struct ClaimedDeliveries {
    /// The pairs to publish, in seq order.
    pub deliveries: Vec<ClaimedDelivery>,
    /// Pairs that cannot be read as events (event id, destination, reason): dead-lettered.
    pub poison: Vec<(Uuid, String, String)>,
    /// The lease's fencing token.
    pub token: Uuid,
}

/// Claims due deliveries (DeliveriesClaim), leased for `lease`. `ordered` names the destinations
/// whose pairs keep key order, `blocking` those whose dead pairs hold back their key.
pub async fn claim_deliveries(
    pool: &PgPool,
    table: &OutboxTable,
    limit: usize,
    lease: Duration,
    ordered: &[String],
    blocking: &[String],
) -> Result<ClaimedDeliveries> {
    let token = Uuid::new_v4();
    let rows = sqlx::query(&table.sql.deliveries_claim)
        .bind(i64::try_from(limit).unwrap_or(i64::MAX))
        .bind(lease.as_secs_f64())
        .bind(token)
        .bind(ordered)
        .bind(blocking)
        .fetch_all(pool)
        .await?;
    delivery_rows(&rows, token)
}

/// Claims one held delivery of `destination` for its probe (DeliveriesClaimProbe).
pub async fn claim_delivery_probe(
    pool: &PgPool,
    table: &OutboxTable,
    destination: &str,
    lease: Duration,
) -> Result<ClaimedDeliveries> {
    let token = Uuid::new_v4();
    let rows = sqlx::query(&table.sql.deliveries_claim_probe)
        .bind(destination)
        .bind(lease.as_secs_f64())
        .bind(token)
        .fetch_all(pool)
        .await?;
    delivery_rows(&rows, token)
}

/// Decodes leased delivery rows; `token` is their lease's.
fn delivery_rows(rows: &[sqlx::postgres::PgRow], token: Uuid) -> Result<ClaimedDeliveries> {
    let mut deliveries = Vec::with_capacity(rows.len());
    let mut poison = Vec::new();
    for row in rows {
        let destination: String = sqlx::Row::try_get(row, "destination")?;
        match OutboxEvent::from_row(row) {
            Ok(event) => deliveries.push(ClaimedDelivery { destination, event }),
            Err(e) => poison.push((
                sqlx::Row::try_get(row, "id")?,
                destination,
                crate::error_chain(&e),
            )),
        }
    }
    deliveries.sort_by_key(|d| d.event.seq);
    Ok(ClaimedDeliveries {
        deliveries,
        poison,
        token,
    })
}
