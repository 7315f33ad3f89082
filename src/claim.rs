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
use crate::event::OutboxEvent;
use crate::table::OutboxTable;

/// How a claimed batch is held until it is settled.
pub enum Hold {
    /// The open claiming transaction, holding the row locks.
    Transaction(Transaction<'static, Postgres>),
    /// The lease's fencing token.
    Lease(Uuid),
}

/// A batch of claimed events and what holds them.
pub struct ClaimedBatch {
    /// The events, in claim order.
    pub events: Vec<OutboxEvent>,
    /// The claim to settle under.
    pub hold: Hold,
}

/// Claims up to `limit` due events. `lease` is the lease length (lease mode only).
pub async fn claim_due(
    pool: &PgPool,
    table: &OutboxTable,
    mode: ClaimMode,
    limit: usize,
    lease: Duration,
) -> Result<ClaimedBatch> {
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    match mode {
        ClaimMode::Transaction => {
            let mut tx = pool.begin().await?;
            let rows = sqlx::query(&table.sql.claim_due)
                .bind(limit)
                .fetch_all(&mut *tx)
                .await?;
            let events = rows
                .iter()
                .map(OutboxEvent::from_row)
                .collect::<Result<_, _>>()?;
            Ok(ClaimedBatch {
                events,
                hold: Hold::Transaction(tx),
            })
        }
        ClaimMode::Lease => {
            let token = Uuid::new_v4();
            let rows = sqlx::query(&table.sql.claim_lease)
                .bind(limit)
                .bind(lease.as_secs_f64())
                .bind(token)
                .fetch_all(pool)
                .await?;
            let mut events: Vec<OutboxEvent> = rows
                .iter()
                .map(OutboxEvent::from_row)
                .collect::<Result<_, _>>()?;
            // UPDATE … RETURNING does not keep the CTE's order.
            events.sort_by_key(|e| e.seq);
            Ok(ClaimedBatch {
                events,
                hold: Hold::Lease(token),
            })
        }
    }
}

/// Gives a claimed batch back untouched: rolls the claiming transaction back, or ends the lease.
pub async fn release(pool: &PgPool, table: &OutboxTable, hold: Hold, ids: &[Uuid]) -> Result<()> {
    match hold {
        Hold::Transaction(tx) => tx.rollback().await?,
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
