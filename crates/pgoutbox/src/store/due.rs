//! Claims of due pairs of `<table>_deliveries`: a destination's due pairs, leased so that no
//! transaction stays open while the destination answers, and one held pair for a probe.

use sqlx::postgres::PgRow;
use sqlx::{Column, Row};

use super::outbox::{claimed_row, ClaimColumns, ClaimedRow};
use super::{Lease, Store};
use crate::error::Result;
use crate::table::OutboxTable;

/// DeliveriesClaim. One destination's due pairs (`$4`), oldest first: range scan of
/// `{name:deliveries_lane_idx}`, leased at once (`next_attempt_at` pushed to the lease expiry
/// `$2`, fencing token `$3`) so no transaction is open while the destination answers. When the
/// destination is ordered (`$5`) a keyed pair is taken only when it is its key's first
/// undelivered pair for it (`{name:deliveries_key_idx}`; dead pairs count where its dead pairs
/// block, `$6`) and no earlier event row of the key is unsettled (`{name:key_idx}`): the pair
/// never overtakes an earlier event. A replay's pairs are a stream of their own
/// (`replay_id`): they wait only for earlier pairs of the same replay, live pairs only for
/// earlier live pairs and rows, so neither stream holds the other back.
const DELIVERIES_CLAIM: &str = "
WITH picked AS (
    SELECT d.event_id, d.destination FROM {qname:deliveries} d
    WHERE d.destination = $4 AND d.dead_at IS NULL AND d.next_attempt_at <= now()
      AND (d.key IS NULL OR NOT $5 OR (
            NOT EXISTS (
                SELECT 1 FROM {qname:deliveries} p
                WHERE p.destination = d.destination AND p.key = d.key AND p.seq < d.seq
                  AND p.replay_id IS NOT DISTINCT FROM d.replay_id
                  AND (p.dead_at IS NULL OR $6))
            AND (d.replay_id IS NOT NULL OR NOT EXISTS (
                SELECT 1 FROM {outbox} o
                WHERE o.key = d.key AND o.seq < d.seq AND o.published_at IS NULL
                  AND (o.dead_at IS NULL OR (o.destination = d.destination AND $6))))))
    ORDER BY d.next_attempt_at, d.seq
    LIMIT $1
    FOR UPDATE SKIP LOCKED
)";

/// The end of DeliveriesClaim and DeliveriesClaimProbe: the `picked` pairs are leased (due again at
/// the lease expiry `$2`, fencing token `$3`) and returned as events.
const DELIVERIES_LEASE: &str = "
UPDATE {qname:deliveries} AS d
SET next_attempt_at = now() + make_interval(secs => $2), lease_token = $3
FROM picked
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
    claim: String,
    claim_probe: String,
}

impl Sql {
    pub(super) fn render(table: &OutboxTable) -> Self {
        let r = |t: &str| table.render(t);
        Self {
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

/// What a claim of one destination's due pairs asks for.
#[derive(Debug, Clone, Copy)]
pub struct ClaimPairs<'a> {
    /// The destination.
    pub destination: &'a str,
    /// Most pairs.
    pub limit: usize,
    /// Their lease.
    pub lease: Lease,
    /// Whether its pairs keep key order.
    pub ordered: bool,
    /// Whether its dead pairs hold back their key.
    pub dead_blocks: bool,
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

/// DeliveriesClaim: one destination's due pairs, leased.
pub async fn claim(store: &Store, claim: &ClaimPairs<'_>) -> Result<Vec<ClaimedPair>> {
    let rows = sqlx::query(&store.sql.due.claim)
        .bind(i64::try_from(claim.limit).unwrap_or(i64::MAX))
        .bind(claim.lease.length.as_secs_f64())
        .bind(claim.lease.token)
        .bind(claim.destination)
        .bind(claim.ordered)
        .bind(claim.dead_blocks)
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
