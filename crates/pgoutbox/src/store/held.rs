//! Rows and pairs held at 'infinity': held for their destination (paused, breaker open), or
//! parked behind an earlier row of their key; and releasing them once nothing holds them back.

use std::time::Duration;

use uuid::Uuid;

use super::outbox::EVENT_COLUMNS;
use super::outbox::{claimed_row, ClaimColumns, ClaimedRow};
use super::{deliveries, held_batches, Store, Unit};
use crate::error::Result;
use crate::table::OutboxTable;

/// OutboxParkFollowers. Ordered mode, in the settle of a batch with failed or held keyed events: a
/// key's later unsettled rows cannot go before that row, so they take its next attempt time
/// ('infinity' behind a held row, or behind a dead row of a destination whose dead rows block: `$2`). They leave the front of the due
/// range, where every claim's search for heads would otherwise step over them (a key whose head
/// was retried has all its older followers due before it). The materialized CTEs fix the plan:
/// from the failed rows (primary key) to their keys' later rows (`{name:key_idx}`), then back by
/// primary key; left to itself, with stale statistics, the planner once drove the join from every
/// pending row instead (32 s). Rows another relay leased are left alone, as is a failed row
/// someone re-leased since.
const PARK_FOLLOWERS: &str = "
WITH failed AS MATERIALIZED (
    SELECT h.key, h.seq,
           CASE WHEN h.dead_at IS NULL THEN h.next_attempt_at ELSE 'infinity'::timestamptz END AS until
    FROM {outbox} h
    WHERE h.id = ANY($1) AND h.key IS NOT NULL AND h.published_at IS NULL AND h.lease_token IS NULL
      AND (h.dead_at IS NULL OR h.destination = ANY($2::text[]))
),
later AS MATERIALIZED (
    SELECT l.id, f.until FROM failed f
    CROSS JOIN LATERAL (
        SELECT o.id FROM {outbox} o
        WHERE o.key = f.key AND o.seq > f.seq AND o.published_at IS NULL AND o.dead_at IS NULL
          AND o.lease_token IS NULL AND o.next_attempt_at < f.until
        ORDER BY o.key, o.seq
    ) l
)
UPDATE {outbox} AS o SET next_attempt_at = later.until
FROM later WHERE o.id = later.id";

/// OutboxUnparkFollowers. Rows wait at 'infinity' for one of two reasons: their destination is
/// held (paused, or its breaker is not closed), or an earlier row of their key is dead (for a
/// destination whose dead rows block) or held. Each is due again once none of its reasons is left.
/// Reads the reasons from `{qname:destinations}` (a few rows), then a range scan of
/// `{name:pending_idx}` at 'infinity', which holds only waiting rows, with one `{name:key_idx}`
/// probe per keyed row.
const UNPARK_FOLLOWERS: &str = "
WITH d AS MATERIALIZED (
    SELECT coalesce(array_agg(name) FILTER (WHERE paused_at IS NOT NULL OR breaker <> 'closed'), '{}') AS held,
           coalesce(array_agg(name) FILTER (WHERE dead_blocks), '{}') AS blocking
    FROM {qname:destinations}
)
UPDATE {outbox} AS o SET next_attempt_at = now()
FROM d
WHERE o.published_at IS NULL AND o.dead_at IS NULL AND o.next_attempt_at = 'infinity'
  AND NOT (o.destination IS NOT NULL AND o.destination = ANY(d.held))
  AND NOT (o.key IS NOT NULL AND EXISTS (
        SELECT 1 FROM {outbox} p
        WHERE p.key = o.key AND p.seq < o.seq AND p.published_at IS NULL
          AND ((p.dead_at IS NOT NULL AND p.destination = ANY(d.blocking))
               OR (p.dead_at IS NULL AND p.next_attempt_at = 'infinity' AND p.destination = ANY(d.held)))))";

/// OutboxHoldMany. Events of a destination that is paused or whose breaker is open: they wait at
/// 'infinity' with no attempt counted (primary-key lookups; they leave the due range, so claims do
/// not meet them again) until the destination is back and OutboxUnparkFollowers releases them.
/// `last_error` takes the failure that was not counted, when there was one.
const HOLD_MANY: &str = "
UPDATE {outbox} AS o
SET next_attempt_at = 'infinity', destination = h.destination,
    last_error = coalesce(h.error, o.last_error), lease_token = NULL
FROM unnest($1::uuid[], $2::text[], $3::text[]) AS h(id, destination, error)
WHERE o.id = h.id AND ($4::uuid IS NULL OR o.lease_token = $4)";

/// OutboxClaimProbe. The one event a destination's probe sends: its oldest held row that is its
/// key's first unsettled row (so a probe never breaks per-key order). Range scan of
/// `{name:pending_idx}` at 'infinity', `{name:key_idx}` for the order check; the row lock lasts
/// until the probe's transaction settles it.
const CLAIM_PROBE: &str = "
SELECT {columns}
FROM {outbox} o
WHERE o.published_at IS NULL AND o.dead_at IS NULL AND o.next_attempt_at = 'infinity'
  AND o.destination = $1
  AND (o.key IS NULL OR NOT EXISTS (
        SELECT 1 FROM {outbox} p
        WHERE p.key = o.key AND p.seq < o.seq AND p.published_at IS NULL AND p.dead_at IS NULL))
ORDER BY o.next_attempt_at, o.seq
LIMIT 1
FOR UPDATE SKIP LOCKED";

/// OutboxExpireHeld. `max_age` still applies to held events: those of destination `$1` older than
/// `$2` seconds are dead-lettered. Range scan of `{name:pending_idx}` at 'infinity'.
const EXPIRE_HELD: &str = "
UPDATE {outbox}
SET dead_at = now(),
    last_error = left(coalesce(last_error || ' ', '') || '[dead: older than max_age while ' || $1 || ' was unavailable]', 1024)
WHERE published_at IS NULL AND dead_at IS NULL AND next_attempt_at = 'infinity'
  AND destination = $1 AND created_at < now() - make_interval(secs => $2)";

/// The statements of rows waiting at 'infinity', rendered.
pub(super) struct Sql {
    park_followers: String,
    unpark_followers: String,
    hold_many: String,
    claim_probe: String,
    expire_held: String,
}

impl Sql {
    pub(super) fn render(table: &OutboxTable) -> Self {
        let r = |t: &str| table.render(&t.replace("{columns}", EVENT_COLUMNS));
        Self {
            park_followers: r(PARK_FOLLOWERS),
            unpark_followers: r(UNPARK_FOLLOWERS),
            hold_many: r(HOLD_MANY),
            claim_probe: r(CLAIM_PROBE),
            expire_held: r(EXPIRE_HELD),
        }
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

/// OutboxHoldMany: events wait at 'infinity' for their destination, fenced by `token` if any.
pub async fn hold_many(
    store: &Store,
    unit: &mut Unit,
    held: &[HeldRow],
    token: Option<Uuid>,
) -> Result<u64> {
    let h = held;
    let done = sqlx::query(&store.sql.held.hold_many)
        .bind(h.iter().map(|r| r.id).collect::<Vec<_>>())
        .bind(h.iter().map(|r| r.destination.as_str()).collect::<Vec<_>>())
        .bind(h.iter().map(|r| r.error.as_deref()).collect::<Vec<_>>())
        .bind(token)
        .execute(unit.conn())
        .await?;
    Ok(done.rows_affected())
}

/// OutboxParkFollowers: the later rows of the keys of `ids` (failed or held rows) wait with them;
/// behind dead rows of the `blocking` destinations, until released.
pub async fn park_followers(
    store: &Store,
    unit: &mut Unit,
    ids: &[Uuid],
    blocking: &[String],
) -> Result<()> {
    sqlx::query(&store.sql.held.park_followers)
        .bind(ids)
        .bind(blocking)
        .execute(unit.conn())
        .await?;
    Ok(())
}

/// OutboxUnparkFollowers: rows whose wait is over are due again; returns how many.
pub async fn unpark_rows(store: &Store) -> Result<u64> {
    let done = sqlx::query(&store.sql.held.unpark_followers)
        .execute(store.pool())
        .await?;
    Ok(done.rows_affected())
}

/// OutboxClaimProbe: the held row a probe of `destination` sends, locked in `unit`'s transaction.
pub async fn claim_probe(
    store: &Store,
    unit: &mut Unit,
    destination: &str,
) -> Result<Option<ClaimedRow>> {
    let row = sqlx::query(&store.sql.held.claim_probe)
        .bind(destination)
        .fetch_optional(unit.conn())
        .await?;
    row.map(|row| claimed_row(&row, &ClaimColumns::of(&row, false)?))
        .transpose()
}

/// OutboxExpireHeld: rows held for `destination` longer than `max_age` are dead-lettered.
pub async fn expire_held(store: &Store, destination: &str, max_age: Duration) -> Result<u64> {
    let done = sqlx::query(&store.sql.held.expire_held)
        .bind(destination)
        .bind(max_age.as_secs_f64())
        .execute(store.pool())
        .await?;
    Ok(done.rows_affected())
}

/// Makes rows waiting at 'infinity' due again once nothing holds them back: no dead row of a
/// blocking destination and no held row ahead of them in their key, and their own destination
/// neither paused nor with its breaker open (OutboxUnparkFollowers). Returns how many.
/// Held deliveries whose destination is back are due again too (DeliveriesUnpark), as are its held
/// batches (DeliveriesUnbundle).
pub async fn unpark_followers(store: &Store) -> Result<u64> {
    let rows = unpark_rows(store).await?;
    let pairs = deliveries::unpark(store).await?;
    let unbundled = unbundle(store, None, None).await?;
    Ok(rows + pairs + unbundled)
}

/// Held batches turned into deliveries per round trip: bounds each statement's size.
const UNBUNDLE_BATCHES: i64 = 50;

/// Turns held batches into deliveries rows (DeliveriesUnbundle), in rounds until none is left:
/// with `destination` `None`, those of every destination that is back (due now); with
/// `Some((name, limit))`, up to `limit` batches of that destination, still held (for its probe),
/// or, with `older_than`, those holding an event older than that (for `max_age`). Returns the
/// number of pairs.
pub async fn unbundle(
    store: &Store,
    destination: Option<(&str, i64)>,
    older_than: Option<Duration>,
) -> Result<u64> {
    let mut pairs = 0;
    loop {
        let limit = destination.map_or(UNBUNDLE_BATCHES, |(_, n)| n.min(UNBUNDLE_BATCHES));
        let (batches, moved) = held_batches::unbundle(
            store,
            &held_batches::Unbundle {
                limit,
                destination: destination.map(|(name, _)| name),
                older_than,
            },
        )
        .await?;
        pairs += moved as u64;
        // A destination's probe needs one batch only; the rest go on in rounds.
        if batches < limit || destination.is_some_and(|(_, n)| n <= limit) {
            return Ok(pairs);
        }
    }
}
