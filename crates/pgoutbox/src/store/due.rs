//! Claims of due pairs of `<table>_deliveries`: which destinations have pairs due and when, the
//! due pairs of several destinations at once, each taking its share, leased so that no transaction
//! stays open while the destinations answer, and one held pair for a probe.

use sqlx::postgres::PgRow;
use sqlx::{Column, Row};

use super::outbox::{claimed_row, ClaimColumns, ClaimedRow};
use super::{Lease, Store};
use crate::error::Result;
use crate::table::OutboxTable;

/// DeliveriesDue. Which destinations have undelivered pairs, each with its earliest due time
/// (`'infinity'` while all of them are held): a loose index scan of `{name:deliveries_lane_idx}`,
/// one probe per destination that has pairs, whatever their number or the number configured. The
/// scheduler claims from those that are due and sleeps until the earliest of the others.
const DELIVERIES_DUE: &str = "
WITH RECURSIVE lanes AS (
    (SELECT destination, next_attempt_at FROM {qname:deliveries}
     WHERE dead_at IS NULL ORDER BY destination, next_attempt_at LIMIT 1)
    UNION ALL
    SELECT next.destination, next.next_attempt_at FROM lanes
    CROSS JOIN LATERAL (
        SELECT destination, next_attempt_at FROM {qname:deliveries}
        WHERE dead_at IS NULL AND destination > lanes.destination
        ORDER BY destination, next_attempt_at LIMIT 1) next
)
SELECT destination,
       CASE WHEN next_attempt_at = 'infinity' THEN NULL
            ELSE extract(epoch FROM next_attempt_at - now())::float8 END AS due_in_secs
FROM lanes";

/// DeliveriesClaim. The due pairs of several destinations at once, each destination's own
/// (`$4`, unnested with its most pairs `$1`, whether it is ordered `$5` and whether its dead
/// pairs block `$6`), oldest first: a range scan of `{name:deliveries_lane_idx}` per destination,
/// so that a destination with a million due pairs takes its share and no more, and no other waits
/// behind it. Leased at once (`next_attempt_at` pushed to the lease expiry `$2`, fencing token
/// `$3`) so no transaction is open while the destinations answer. For an ordered destination a
/// keyed pair is taken only when it is its key's first undelivered pair for it
/// (`{name:deliveries_key_idx}`; dead pairs count where its dead pairs block) and no earlier event
/// row of the key is unsettled (`{name:key_idx}`): the pair never overtakes an earlier event. A
/// replay's pairs are a stream of their own (`replay_id`): they wait only for earlier pairs of the
/// same replay, live pairs only for earlier live pairs and rows, so neither stream holds the
/// other back.
const DELIVERIES_CLAIM: &str = "
WITH picked AS (
    SELECT pick.event_id, pick.destination
    FROM unnest($4::text[], $1::int8[], $5::bool[], $6::bool[])
         AS l(destination, most, ordered, dead_blocks)
    CROSS JOIN LATERAL (
        SELECT d.event_id, d.destination FROM {qname:deliveries} d
        WHERE d.destination = l.destination AND d.dead_at IS NULL AND d.next_attempt_at <= now()
          AND (d.key IS NULL OR NOT l.ordered OR (
                NOT EXISTS (
                    SELECT 1 FROM {qname:deliveries} p
                    WHERE p.destination = d.destination AND p.key = d.key AND p.seq < d.seq
                      AND p.replay_id IS NOT DISTINCT FROM d.replay_id
                      AND (p.dead_at IS NULL OR l.dead_blocks))
                AND (d.replay_id IS NOT NULL OR NOT EXISTS (
                    SELECT 1 FROM {outbox} o
                    WHERE o.key = d.key AND o.seq < d.seq AND o.published_at IS NULL
                      AND (o.dead_at IS NULL
                           OR (o.destination = d.destination AND l.dead_blocks))))))
        ORDER BY d.next_attempt_at, d.seq
        LIMIT l.most
        FOR UPDATE SKIP LOCKED
    ) pick
)";

/// The end of DeliveriesClaim and DeliveriesClaimProbe: the `picked` pairs are leased (due again at
/// the lease expiry `$2`, fencing token `$3`) and returned as events. They are joined back by
/// primary key through arrays: joined to the CTE itself, the planner cannot tell how few rows it
/// holds and, on a large table, hashes the whole table (360 ms at 1,000,000 pairs, against 7 ms).
const DELIVERIES_LEASE: &str = ",
keys AS (
    SELECT array_agg(event_id) AS ids, array_agg(destination) AS destinations FROM picked
)
UPDATE {qname:deliveries} AS d
SET next_attempt_at = now() + make_interval(secs => $2), lease_token = $3
FROM unnest((SELECT ids FROM keys), (SELECT destinations FROM keys)) AS picked(event_id, destination)
WHERE d.event_id = picked.event_id AND d.destination = picked.destination
RETURNING d.event_id AS id, d.destination, d.seq, d.topic, d.key, d.payload::text AS payload,
          d.headers::text AS headers, d.created_at, d.attempts";

/// DeliveriesClaimProbe. A held pair for destination `$1`'s probe, its key's first for that
/// destination (a probe never breaks key order): `{name:deliveries_lane_idx}` at 'infinity',
/// `{name:deliveries_key_idx}`; leased like DeliveriesClaim.
const DELIVERIES_CLAIM_PROBE: &str = "
WITH picked AS (
    SELECT d.event_id, d.destination FROM {qname:deliveries} d
    WHERE d.dead_at IS NULL AND d.next_attempt_at = 'infinity' AND d.destination = $1
      AND (d.key IS NULL OR NOT EXISTS (
            SELECT 1 FROM {qname:deliveries} p
            WHERE p.destination = d.destination AND p.key = d.key AND p.seq < d.seq
              AND p.dead_at IS NULL))
    ORDER BY d.next_attempt_at, d.seq
    LIMIT 1
    FOR UPDATE SKIP LOCKED
)";

/// The claims' statements, rendered.
pub(super) struct Sql {
    due: String,
    claim: String,
    claim_probe: String,
}

impl Sql {
    pub(super) fn render(table: &OutboxTable) -> Self {
        let r = |t: &str| table.render(t);
        Self {
            due: r(DELIVERIES_DUE),
            claim: r(&format!("{DELIVERIES_CLAIM}{DELIVERIES_LEASE}")),
            claim_probe: r(&format!("{DELIVERIES_CLAIM_PROBE}{DELIVERIES_LEASE}")),
        }
    }
}

/// A claimed pair: its destination and its event (the pair's attempts).
#[derive(Debug)]
pub struct ClaimedPair {
    /// The destination's name.
    pub destination: String,
    /// The event, or why the pair cannot be read as one.
    pub row: ClaimedRow,
}

/// One destination's part of a claim.
#[derive(Debug, Clone, Copy)]
pub struct LaneClaim<'a> {
    /// The destination.
    pub destination: &'a str,
    /// Most pairs.
    pub limit: usize,
    /// Whether its pairs keep key order.
    pub ordered: bool,
    /// Whether its dead pairs hold back their key.
    pub dead_blocks: bool,
}

/// A destination with undelivered pairs, and when its earliest is due.
#[derive(Debug, Clone, PartialEq)]
pub struct DueLane {
    /// The destination.
    pub destination: String,
    /// How long until its earliest pair is due (zero or less: due now); `None` while every
    /// pair of it is held.
    pub due_in: Option<f64>,
}

fn claimed_pairs(rows: &[PgRow]) -> Result<Vec<ClaimedPair>> {
    let Some(first) = rows.first() else {
        return Ok(Vec::new());
    };
    let at = ClaimColumns::of(first, false)?;
    let destination = first.try_column("destination")?.ordinal();
    rows.iter()
        .map(|row| {
            Ok(ClaimedPair {
                destination: row.try_get(destination)?,
                row: claimed_row(row, &at)?,
            })
        })
        .collect()
}

/// DeliveriesDue: the destinations with undelivered pairs, and when each is due.
pub async fn due(store: &Store) -> Result<Vec<DueLane>> {
    let rows: Vec<(String, Option<f64>)> = sqlx::query_as(&store.sql.due.due)
        .fetch_all(store.pool())
        .await?;
    Ok(rows
        .into_iter()
        .map(|(destination, due_in)| DueLane {
            destination,
            due_in,
        })
        .collect())
}

/// DeliveriesClaim: the due pairs of `lanes`, each destination's up to its limit, leased under
/// one token.
pub async fn claim(
    store: &Store,
    lanes: &[LaneClaim<'_>],
    lease: Lease,
) -> Result<Vec<ClaimedPair>> {
    let most: Vec<i64> = lanes
        .iter()
        .map(|l| i64::try_from(l.limit).unwrap_or(i64::MAX))
        .collect();
    let rows = sqlx::query(&store.sql.due.claim)
        .bind(most)
        .bind(lease.length.as_secs_f64())
        .bind(lease.token)
        .bind(lanes.iter().map(|l| l.destination).collect::<Vec<_>>())
        .bind(lanes.iter().map(|l| l.ordered).collect::<Vec<_>>())
        .bind(lanes.iter().map(|l| l.dead_blocks).collect::<Vec<_>>())
        .fetch_all(store.pool())
        .await?;
    claimed_pairs(&rows)
}

/// DeliveriesClaimProbe: one held pair of `destination` for its probe, leased.
pub async fn claim_probe(
    store: &Store,
    destination: &str,
    lease: Lease,
) -> Result<Vec<ClaimedPair>> {
    let rows = sqlx::query(&store.sql.due.claim_probe)
        .bind(destination)
        .bind(lease.length.as_secs_f64())
        .bind(lease.token)
        .fetch_all(store.pool())
        .await?;
    claimed_pairs(&rows)
}
