//! `<table>_rates`: the token bucket of each rate-limited destination, shared by every relay so
//! that `rate_limit` holds for the destination, not per process. The arithmetic of a take is
//! SQL's here (one statement under the row's lock); how much to ask for and how long to wait is
//! [`crate::model::rate`]'s.

use super::Store;
use crate::error::Result;
use crate::table::OutboxTable;

/// RateRegister. A bucket for `$1`, full (`$2` tokens), unless one is there (its tokens stand:
/// a restart must not hand out a second burst).
const RATE_REGISTER: &str = "
INSERT INTO {qname:rates} (destination, tokens, at) VALUES ($1, $2, clock_timestamp())
ON CONFLICT (destination) DO NOTHING";

/// RateTake. Refills the bucket of `$1` at `$2` tokens a second since it was last written (up to
/// `$3`, the burst), and takes up to `$4` whole tokens from it. The row lock orders concurrent
/// takers; the time only moves forward, so a taker that waited for the lock never counts the
/// same interval twice. Returns what it got and what was there (primary key; a HOT update).
const RATE_TAKE: &str = "
UPDATE {qname:rates} AS r
SET granted = least(floor(f.available), $4)::int,
    tokens = f.available - least(floor(f.available), $4),
    at = greatest(r.at, f.now)
FROM (SELECT b.destination, c.now,
             least($3::float8, b.tokens + $2::float8
                   * greatest(0, extract(epoch FROM c.now - b.at)::float8)) AS available
      FROM {qname:rates} AS b, (SELECT clock_timestamp() AS now) AS c
      WHERE b.destination = $1
      FOR UPDATE OF b) AS f
WHERE r.destination = f.destination
RETURNING r.granted, f.available";

/// The rates' statements, rendered.
pub(super) struct Sql {
    register: String,
    take: String,
}

impl Sql {
    pub(super) fn render(table: &OutboxTable) -> Self {
        Self {
            register: table.render(RATE_REGISTER),
            take: table.render(RATE_TAKE),
        }
    }
}

/// What one take got from a bucket.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Taken {
    /// Tokens granted (events that may be sent now).
    pub granted: u32,
    /// Tokens the bucket held before the take.
    pub available: f64,
}

/// RateRegister: a full bucket of `burst` tokens for `destination`, unless it has one.
pub async fn register(store: &Store, destination: &str, burst: u32) -> Result<()> {
    sqlx::query(&store.sql.rates.register)
        .bind(destination)
        .bind(f64::from(burst))
        .execute(store.pool())
        .await?;
    Ok(())
}

/// RateTake: up to `want` tokens from the bucket of `destination`, refilled at `per_second` up
/// to `burst`; `None` when it has no bucket yet ([`register`] it).
pub async fn take(
    store: &Store,
    destination: &str,
    per_second: f64,
    burst: u32,
    want: u32,
) -> Result<Option<Taken>> {
    let row: Option<(i32, f64)> = sqlx::query_as(&store.sql.rates.take)
        .bind(destination)
        .bind(per_second)
        .bind(f64::from(burst))
        .bind(i64::from(want))
        .fetch_optional(store.pool())
        .await?;
    Ok(row.map(|(granted, available)| Taken {
        granted: u32::try_from(granted).unwrap_or(0),
        available,
    }))
}
