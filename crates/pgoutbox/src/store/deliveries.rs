//! `<table>_deliveries` and `<table>_held_batches`: the undelivered (event, destination) pairs of
//! split events, each going on alone, and the pairs held in bulk for a destination that is down.
//!
//! A pair row exists only while its pair is undelivered; delivering it deletes it. Held pairs of
//! one batch for one destination are one held-batch row ([`HeldBatch`]) until the destination is
//! back ([`super::held_batches`]).

use std::time::Duration;

use uuid::Uuid;

use super::held_batches::HeldBatch;
use super::SettleMode;
use super::{Store, Unit};
use crate::error::Result;
use crate::table::OutboxTable;

/// DeliveriesFanOut (keep mode) / DeliveriesFanOutDelete (retention 0) / DeliveriesFanOutMove
/// (`history = "partitions"`: deleted, then appended to the history). Settles split events (an
/// event with several destinations, or a pair that waits behind its key): the event rows are
/// settled by primary key, fenced by the lease token `$9` like OutboxSetPublishedMany, and in the
/// same statement their undelivered pairs are inserted into `{qname:deliveries}`, joined to the
/// rows actually settled: a fenced-out event writes no pair. `$2..$8` are the pairs, unnested
/// (event id, destination, attempts, delay, error, dead, held). `$10..$14` are held batches, one
/// per destination whose pairs are held in bulk (destination, oldest, count, topic counts, the
/// events as one JSON array built by the relay): one row whatever the number of events, written
/// unless the whole settle was fenced out (a destination that is down costs the others one row per
/// batch; a partly fenced batch may send an event twice to it, never lose one). A pair whose
/// request is still out when its batch settles (`$15`) is written leased, due at the lease's end
/// (its delay) under the token `$16`, so that the batch settles it when the answer comes and no
/// other relay sends it meanwhile.
/// Returns how many events were settled and how many pairs written.
const DELIVERIES_FAN_OUT: &str = "
WITH settled AS (
    {settle}
    WHERE id = ANY($1) AND ($9::uuid IS NULL OR lease_token = $9)
    RETURNING id, seq, topic, key, payload, headers, created_at, attempts, last_error
),{history}
pairs AS (
    INSERT INTO {qname:deliveries} AS d (event_id, destination, seq, topic, key, payload, headers,
                                         created_at, attempts, next_attempt_at, last_error, dead_at,
                                         lease_token)
    SELECT s.id, p.destination, s.seq, s.topic, s.key, s.payload, coalesce(s.headers, '{}'::jsonb),
           s.created_at, p.attempts,
           CASE WHEN p.held THEN 'infinity'::timestamptz
                ELSE statement_timestamp() + make_interval(secs => p.delay_secs) END,
           p.error, CASE WHEN p.dead THEN statement_timestamp() END,
           CASE WHEN p.leased THEN $16::uuid END
    FROM unnest($2::uuid[], $3::text[], $4::int[], $5::float8[], $6::text[], $7::bool[], $8::bool[],
                $15::bool[])
         AS p(event_id, destination, attempts, delay_secs, error, dead, held, leased)
    JOIN settled s ON s.id = p.event_id
    ON CONFLICT (event_id, destination) DO NOTHING
    RETURNING 1
),
bundles AS (
    INSERT INTO {qname:held_batches} (destination, oldest, count, topics, events)
    SELECT b.destination, b.oldest, b.count, b.topics::jsonb, b.events
    FROM unnest($10::text[], $11::timestamptz[], $12::int[], $13::text[], $14::bytea[])
         AS b(destination, oldest, count, topics, events)
    WHERE EXISTS (SELECT 1 FROM settled)
    RETURNING count AS n
)
SELECT (SELECT count(*) FROM settled) AS settled,
       (SELECT count(*) FROM pairs) + (SELECT coalesce(sum(n), 0) FROM bundles)::bigint AS pairs";

/// See DELIVERIES_FAN_OUT: the event row is done with (its pairs carry on in the deliveries).
const FAN_OUT_PUBLISH: &str =
    "UPDATE {outbox} SET published_at = statement_timestamp(), destination = NULL, lease_token = NULL";

/// See DELIVERIES_FAN_OUT.
const FAN_OUT_DELETE: &str = "DELETE FROM {outbox}";

/// See DELIVERIES_FAN_OUT and OutboxMoveMany: the deleted split rows go to the history, with no
/// destination (as FAN_OUT_PUBLISH leaves them).
const FAN_OUT_MOVE: &str = "
history AS (
    INSERT INTO {qname:history} (id, seq, topic, key, payload, headers, created_at, published_at,
                                 destination, attempts, last_error)
    SELECT id, seq, topic, key, payload, headers, created_at, statement_timestamp(), NULL,
           attempts, last_error
    FROM settled
),";

/// DeliveriesDelete. Delivered pairs leave the table (primary key), fenced by the lease token.
const DELIVERIES_DELETE: &str = "
DELETE FROM {qname:deliveries} AS d
USING unnest($1::uuid[], $2::text[]) AS p(event_id, destination)
WHERE d.event_id = p.event_id AND d.destination = p.destination
  AND ($3::uuid IS NULL OR d.lease_token = $3)";

/// DeliveriesSettle. Every other pair of a batch of pairs, one statement (primary key, fenced):
/// `failed` counts an attempt and takes the backoff, or `dead`; `held` waits at 'infinity' with no
/// attempt counted (destination paused or breaker open); `release` is due again as it was (not
/// attempted before the batch's time ran out).
const DELIVERIES_SETTLE: &str = "
UPDATE {qname:deliveries} AS d
SET attempts = d.attempts + CASE WHEN p.kind = 'failed' THEN 1 ELSE 0 END,
    last_error = coalesce(p.error, d.last_error),
    next_attempt_at = CASE p.kind
        WHEN 'held' THEN 'infinity'::timestamptz
        WHEN 'release' THEN now()
        ELSE statement_timestamp() + make_interval(secs => p.delay_secs) END,
    dead_at = CASE WHEN p.dead THEN statement_timestamp() END,
    lease_token = NULL
FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::float8[], $6::bool[])
     AS p(event_id, destination, kind, error, delay_secs, dead)
WHERE d.event_id = p.event_id AND d.destination = p.destination
  AND ($7::uuid IS NULL OR d.lease_token = $7)";

/// DeliveriesKeysWaiting. Before a batch is published to ordered destinations: which of the
/// batch's (destination, key) pairs (`$1`, `$2`) still have an undelivered pair in
/// `{qname:deliveries}` (dead ones only for destinations whose dead pairs block, `$3`) of the
/// batch's stream: live pairs (`$4` NULL) or those of the replay `$4`. One
/// `{name:deliveries_key_idx}` probe per pair; an empty table answers at once.
const DELIVERIES_KEYS_WAITING: &str = "
SELECT DISTINCT q.destination, q.key
FROM unnest($1::text[], $2::text[]) AS q(destination, key)
WHERE EXISTS (
    SELECT 1 FROM {qname:deliveries} d
    WHERE d.destination = q.destination AND d.key = q.key
      AND d.replay_id IS NOT DISTINCT FROM $4
      AND (d.dead_at IS NULL OR d.destination = ANY($3::text[])))";

/// DeliveriesUnpark. Held pairs (at 'infinity') of the destinations that are back (neither paused
/// nor with their breaker open, a few rows of `{qname:destinations}`) are due again: one range scan
/// of `{name:deliveries_lane_idx}` at 'infinity' per such destination.
const DELIVERIES_UNPARK: &str = "
UPDATE {qname:deliveries} AS d SET next_attempt_at = now()
FROM (SELECT name FROM {qname:destinations} WHERE paused_at IS NULL AND breaker = 'closed') AS back
WHERE d.destination = back.name AND d.dead_at IS NULL AND d.next_attempt_at = 'infinity'";

/// DeliveriesExpireHeld. `max_age` for held pairs of destination `$1`, like OutboxExpireHeld:
/// range scan of `{name:deliveries_lane_idx}` at 'infinity'.
const DELIVERIES_EXPIRE_HELD: &str = "
UPDATE {qname:deliveries}
SET dead_at = now(),
    last_error = left(coalesce(last_error || ' ', '') || '[dead: older than max_age while ' || $1 || ' was unavailable]', 1024)
WHERE dead_at IS NULL AND next_attempt_at = 'infinity'
  AND destination = $1 AND created_at < now() - make_interval(secs => $2)";

/// DeliveriesFanOut with its settle of the event rows (`settle`) and, to move them to the
/// history, the CTE that does it (`history`, or empty).
fn fan_out_statement(settle: &str, history: &str) -> String {
    DELIVERIES_FAN_OUT
        .replace("{settle}", settle)
        .replace("{history}", history)
}

/// DeliveriesExpireGone. Pairs of destinations that are not configured (`$1`: the configured
/// ones) and that no relay has claimed for `$2` seconds past their due time: no running relay
/// serves that destination (one that did would have claimed them within seconds, so a rolling
/// deploy that adds a destination loses nothing), and they are dead-lettered with the way back.
/// A scan of the pairs; cleanup runs it, on its interval.
const DELIVERIES_EXPIRE_GONE: &str = "
UPDATE {qname:deliveries}
SET dead_at = now(),
    last_error = left(coalesce(last_error || ' ', '') || 'destination ' || destination
        || ' is no longer configured: add it back, then `pgoutbox dead retry --destination '
        || destination || '`, or `dead discard` [dead: no such destination]', 1024)
WHERE dead_at IS NULL AND NOT (destination = ANY($1::text[]))
  AND next_attempt_at < now() - make_interval(secs => $2)";

/// The deliveries' statements, rendered.
pub(super) struct Sql {
    fan_out: String,
    fan_out_delete: String,
    fan_out_move: String,
    delete: String,
    settle: String,
    keys_waiting: String,
    unpark: String,
    expire_held: String,
    expire_gone: String,
}

impl Sql {
    pub(super) fn render(table: &OutboxTable) -> Self {
        let r = |t: &str| table.render(t);
        Self {
            fan_out: r(&fan_out_statement(FAN_OUT_PUBLISH, "")),
            fan_out_delete: r(&fan_out_statement(FAN_OUT_DELETE, "")),
            fan_out_move: r(&fan_out_statement(FAN_OUT_DELETE, FAN_OUT_MOVE)),
            delete: r(DELIVERIES_DELETE),
            settle: r(DELIVERIES_SETTLE),
            keys_waiting: r(DELIVERIES_KEYS_WAITING),
            unpark: r(DELIVERIES_UNPARK),
            expire_held: r(DELIVERIES_EXPIRE_HELD),
            expire_gone: r(DELIVERIES_EXPIRE_GONE),
        }
    }
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
    /// What it waits for.
    pub state: PairState,
}

/// What an undelivered pair of a split event waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PairState {
    /// Its next attempt (due after `delay_secs`): not sent yet, or behind an earlier event of its
    /// key.
    Waiting,
    /// This settle counted a failed attempt: due again after `delay_secs`, or dead.
    Failed {
        /// Dead-lettered.
        dead: bool,
    },
    /// Its destination (paused, breaker open): due at 'infinity'.
    Held,
    /// The answer to its request, still out: leased (for `delay_secs`) to the batch that sent
    /// it, under [`FanOut::in_flight`].
    InFlight,
}

impl PairState {
    /// Dead-lettered.
    pub fn dead(self) -> bool {
        self == Self::Failed { dead: true }
    }
}

/// What a fan-out settle writes: the split event rows to settle and their undelivered pairs.
#[derive(Debug, Clone, Copy)]
pub struct FanOut<'a> {
    /// What the settled event rows become.
    pub rows: SettleMode,
    /// The split events (their rows are settled).
    pub events: &'a [Uuid],
    /// Their undelivered pairs, one row each.
    pub pairs: &'a [PairRow],
    /// Their held pairs in bulk, one row per destination.
    pub bundles: &'a [HeldBatch],
    /// The lease token fencing the rows, if any.
    pub token: Option<Uuid>,
    /// The token leased pairs are written under (their sender settles them with it).
    pub in_flight: Option<Uuid>,
}

/// DeliveriesFanOut (or its Delete / Move form): settles split event rows and writes their
/// pairs, in one statement. Returns the events settled and the pairs written.
pub async fn fan_out(store: &Store, unit: &mut Unit, fan_out: &FanOut<'_>) -> Result<(i64, i64)> {
    let sql = &store.sql.deliveries;
    let statement = match fan_out.rows {
        SettleMode::Mark => &sql.fan_out,
        SettleMode::Delete => &sql.fan_out_delete,
        SettleMode::Move => &sql.fan_out_move,
    };
    let (p, b) = (fan_out.pairs, fan_out.bundles);
    Ok(sqlx::query_as(statement)
        .bind(fan_out.events)
        .bind(p.iter().map(|r| r.event_id).collect::<Vec<_>>())
        .bind(p.iter().map(|r| r.destination.as_str()).collect::<Vec<_>>())
        .bind(p.iter().map(|r| r.attempts).collect::<Vec<_>>())
        .bind(p.iter().map(|r| r.delay_secs).collect::<Vec<_>>())
        .bind(p.iter().map(|r| r.error.as_deref()).collect::<Vec<_>>())
        .bind(p.iter().map(|r| r.state.dead()).collect::<Vec<_>>())
        .bind(
            p.iter()
                .map(|r| r.state == PairState::Held)
                .collect::<Vec<_>>(),
        )
        .bind(fan_out.token)
        .bind(b.iter().map(|b| b.destination.as_str()).collect::<Vec<_>>())
        .bind(b.iter().map(|b| b.oldest).collect::<Vec<_>>())
        .bind(b.iter().map(|b| b.count).collect::<Vec<_>>())
        .bind(b.iter().map(|b| b.topics.as_str()).collect::<Vec<_>>())
        .bind(b.iter().map(|b| b.events.as_slice()).collect::<Vec<_>>())
        .bind(
            p.iter()
                .map(|r| r.state == PairState::InFlight)
                .collect::<Vec<_>>(),
        )
        .bind(fan_out.in_flight)
        .fetch_one(unit.conn())
        .await?)
}

/// Pairs named by their event and destination, side by side, fenced by a lease token if any.
#[derive(Debug, Clone, Copy)]
pub struct PairIds<'a> {
    /// Their events.
    pub events: &'a [Uuid],
    /// Their destinations, one per event.
    pub destinations: &'a [&'a str],
    /// The lease token they are held by, if any.
    pub token: Option<Uuid>,
}

/// DeliveriesDelete: delivered pairs leave the table, fenced by their token.
pub async fn delete(store: &Store, unit: &mut Unit, pairs: &PairIds<'_>) -> Result<u64> {
    let done = sqlx::query(&store.sql.deliveries.delete)
        .bind(pairs.events)
        .bind(pairs.destinations)
        .bind(pairs.token)
        .execute(unit.conn())
        .await?;
    Ok(done.rows_affected())
}

/// How a pair of a batch of pairs settles (DeliveriesSettle's `kind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PairKind {
    /// An attempt failed: counted, with a backoff (or dead).
    Failed,
    /// Held for its destination: at 'infinity', no attempt counted.
    Held,
    /// Not attempted: due again now.
    Release,
}

impl PairKind {
    fn as_sql(self) -> &'static str {
        match self {
            Self::Failed => "failed",
            Self::Held => "held",
            Self::Release => "release",
        }
    }
}

/// One pair's new state in DeliveriesSettle.
#[derive(Debug, Clone, Copy)]
pub struct PairUpdate<'a> {
    /// The event.
    pub event_id: Uuid,
    /// The destination.
    pub destination: &'a str,
    /// What happened.
    pub kind: PairKind,
    /// The error for `last_error`, if any.
    pub error: Option<&'a str>,
    /// Delay until the next attempt (failed).
    pub delay_secs: f64,
    /// Dead-lettered (failed).
    pub dead: bool,
}

/// DeliveriesSettle: failed, held and released pairs in one statement, fenced by `token`.
pub async fn settle(
    store: &Store,
    unit: &mut Unit,
    updates: &[PairUpdate<'_>],
    token: Option<Uuid>,
) -> Result<u64> {
    let u = updates;
    let done = sqlx::query(&store.sql.deliveries.settle)
        .bind(u.iter().map(|s| s.event_id).collect::<Vec<_>>())
        .bind(u.iter().map(|s| s.destination).collect::<Vec<_>>())
        .bind(u.iter().map(|s| s.kind.as_sql()).collect::<Vec<_>>())
        .bind(u.iter().map(|s| s.error).collect::<Vec<_>>())
        .bind(u.iter().map(|s| s.delay_secs).collect::<Vec<_>>())
        .bind(u.iter().map(|s| s.dead).collect::<Vec<_>>())
        .bind(token)
        .execute(unit.conn())
        .await?;
    Ok(done.rows_affected())
}

/// What DeliveriesKeysWaiting asks.
#[derive(Debug, Clone, Copy)]
pub struct KeysWaiting<'a> {
    /// The ordered destinations, one per key.
    pub destinations: &'a [&'a str],
    /// The keys.
    pub keys: &'a [&'a str],
    /// The destinations whose dead pairs hold back their key.
    pub blocking: &'a [String],
    /// Whose stream: live pairs (`None`) or the replay's.
    pub replay: Option<Uuid>,
}

/// DeliveriesKeysWaiting: which of the (destination, key) pairs still have an undelivered pair
/// of the same stream.
pub async fn keys_waiting(store: &Store, q: &KeysWaiting<'_>) -> Result<Vec<(String, String)>> {
    Ok(sqlx::query_as(&store.sql.deliveries.keys_waiting)
        .bind(q.destinations)
        .bind(q.keys)
        .bind(q.blocking)
        .bind(q.replay)
        .fetch_all(store.pool())
        .await?)
}

/// DeliveriesUnpark: held pairs of destinations that are back are due again; returns how many.
pub async fn unpark(store: &Store) -> Result<u64> {
    let done = sqlx::query(&store.sql.deliveries.unpark)
        .execute(store.pool())
        .await?;
    Ok(done.rows_affected())
}

/// DeliveriesExpireHeld: pairs held for `destination` longer than `max_age` are dead-lettered.
pub async fn expire_held(store: &Store, destination: &str, max_age: Duration) -> Result<u64> {
    let done = sqlx::query(&store.sql.deliveries.expire_held)
        .bind(destination)
        .bind(max_age.as_secs_f64())
        .execute(store.pool())
        .await?;
    Ok(done.rows_affected())
}

/// DeliveriesExpireGone: pairs of destinations other than `configured` that no relay claimed for
/// `grace` past their due time are dead-lettered; returns how many.
pub async fn expire_gone(store: &Store, configured: &[String], grace: Duration) -> Result<u64> {
    let done = sqlx::query(&store.sql.deliveries.expire_gone)
        .bind(configured)
        .bind(grace.as_secs_f64())
        .execute(store.pool())
        .await?;
    Ok(done.rows_affected())
}
