//! The poll source: claiming due rows so that no other relay publishes them at the same time.
//!
//! Two ways to hold a claim ([`ClaimMode`]):
//! - `transaction`: the claiming transaction keeps the row locks (`FOR UPDATE SKIP LOCKED`) while
//!   the batch is published, then settles and commits. A crashed relay's locks vanish with its
//!   connection, so its rows are due again at once. One write per event (the settle).
//! - `lease`: the claim commits at once, pushing `next_attempt_at` to the lease expiry and stamping a
//!   fencing token; settles only apply with that token. No transaction is open while publishing,
//!   which suits slow destinations; a crashed relay's rows wait for the lease to expire.

use std::time::Duration;

use chrono::{DateTime, Utc};
use uuid::Uuid;

use crate::config::{ClaimMode, DestinationConfig, Ordering};

use crate::error::Result;
use crate::model::event::OutboxEvent;
use crate::store::due::{self, ClaimedPair, LaneClaim};
use crate::store::outbox::{self, Claim, Guard, OrderedClaim};
use crate::store::{Lease, Store};

/// A batch of claimed events and what holds them.
pub struct ClaimedBatch {
    /// The events to publish, in seq order.
    pub events: Vec<OutboxEvent>,
    /// Rows that could not be read as events (a NULL where a value is needed, headers that are not
    /// an object…), with the reason: the settle dead-letters them, so they never block a claim.
    pub poison: Vec<(Uuid, String)>,
    /// Ordered mode: rows claimed and cut off behind a key's first not-due or dead row, not to be
    /// published now (given back at settle: the transaction ends, or the lease is released).
    pub cut_off: Vec<Uuid>,
    /// The claim to settle under.
    pub guard: Guard,
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

/// Claims due events per `options`, from `watermark` (see [`super::watermark`]; `None`: from the
/// oldest). Ordered claims: `blocking` names the destinations whose dead events hold back the
/// later events of their key (`on_dead = "block"`).
pub async fn claim_due(
    store: &Store,
    options: &ClaimOptions,
    blocking: &[String],
    watermark: Option<DateTime<Utc>>,
) -> Result<ClaimedBatch> {
    let window = if options.window >= WINDOW_UNBOUNDED_FROM {
        i64::MAX
    } else {
        i64::try_from(options.window).unwrap_or(i64::MAX)
    };
    let ordered = options.ordered.then_some(OrderedClaim {
        heads: options.heads.clamp(1, options.limit.max(1)),
        followers: options.followers.min(FOLLOWERS_PER_KEY),
        window,
        blocking,
    });
    let lease = match options.mode {
        ClaimMode::Transaction => None,
        ClaimMode::Lease => Some(Lease {
            length: options.lease,
            token: Uuid::new_v4(),
        }),
    };
    let claim = Claim {
        limit: options.limit,
        ordered,
        lease,
        watermark,
    };
    let (claimed, guard) = match lease {
        None => {
            let mut unit = store.begin().await?;
            let claimed = outbox::claim(store, &mut unit, &claim).await?;
            (claimed, Guard::Transaction(unit))
        }
        Some(Lease { token, .. }) => {
            let mut unit = store.connect().await?;
            (
                outbox::claim(store, &mut unit, &claim).await?,
                Guard::Lease(token),
            )
        }
    };
    let mut events = Vec::with_capacity(claimed.rows.len());
    let mut poison = Vec::new();
    let mut cut_off = Vec::new();
    // Ordered mode: a key's chain stops at its first row that is not due or dead; the rows behind
    // it must wait for it, whatever their own state.
    let mut stopped_keys: std::collections::HashSet<String> = std::collections::HashSet::new();
    for row in claimed.rows {
        if options.ordered {
            let stopped = row.key.as_ref().is_some_and(|k| stopped_keys.contains(k));
            if !row.due || stopped {
                if let Some(k) = row.key {
                    stopped_keys.insert(k);
                }
                cut_off.push(row.id);
                continue;
            }
        }
        match row.event {
            Ok(event) => events.push(event),
            Err(reason) => {
                if let Some(k) = row.key {
                    // Its later rows wait for the next claim, which sees it dead.
                    stopped_keys.insert(k);
                }
                poison.push((row.id, reason));
            }
        }
    }
    // UPDATE … RETURNING does not keep the CTE's order.
    events.sort_by_key(|e| e.seq);
    Ok(ClaimedBatch {
        events,
        poison,
        cut_off,
        guard,
        found: claimed.found,
    })
}

/// Gives a claimed batch back untouched: rolls the claiming transaction back, or ends the lease.
pub async fn release(store: &Store, guard: Guard, ids: &[Uuid]) -> Result<()> {
    match guard {
        Guard::Transaction(unit) => unit.rollback().await?,
        Guard::Nothing => {}
        Guard::Lease(token) => {
            let mut unit = store.connect().await?;
            outbox::release_lease(store, &mut unit, ids, token).await?;
        }
    }
    Ok(())
}

/// A batch of pairs of one destination claimed from the deliveries table, leased under one token.
pub struct ClaimedPairs {
    /// Their events, in seq order (each event's `attempts` are its pair's).
    pub events: Vec<OutboxEvent>,
    /// Pairs that cannot be read as events (event id, destination, reason): dead-lettered.
    pub poison: Vec<(Uuid, String, String)>,
    /// The lease's fencing token.
    pub token: Uuid,
}

/// Claims the due pairs of several destinations at once (DeliveriesClaim), each up to its
/// limit, leased for `lease` under one token: each destination's pairs, apart.
pub async fn claim_pairs(
    store: &Store,
    lanes: &[LaneClaim<'_>],
    lease: Duration,
) -> Result<Vec<(String, ClaimedPairs)>> {
    let token = Uuid::new_v4();
    let pairs = due::claim(
        store,
        lanes,
        Lease {
            length: lease,
            token,
        },
    )
    .await?;
    let mut by_lane: Vec<(String, Vec<ClaimedPair>)> = Vec::new();
    let mut at: std::collections::HashMap<String, usize> = Default::default();
    for pair in pairs {
        let i = *at.entry(pair.destination.clone()).or_insert_with(|| {
            by_lane.push((pair.destination.clone(), Vec::new()));
            by_lane.len() - 1
        });
        by_lane[i].1.push(pair);
    }
    Ok(by_lane
        .into_iter()
        .map(|(d, pairs)| (d, pair_rows(pairs, token)))
        .collect())
}

/// One destination's part of a claim of due pairs, from its configuration: at most `limit`.
pub fn lane_claim(destination: &DestinationConfig, limit: usize) -> LaneClaim<'_> {
    LaneClaim {
        destination: &destination.name,
        limit,
        ordered: destination.ordering == Ordering::Key,
        dead_blocks: destination.dead_blocks(),
    }
}

/// Claims one held pair of `destination` for its probe (DeliveriesClaimProbe).
pub async fn claim_probe_pair(
    store: &Store,
    destination: &str,
    lease: Duration,
) -> Result<ClaimedPairs> {
    let token = Uuid::new_v4();
    let lease = Lease {
        length: lease,
        token,
    };
    let pairs = due::claim_probe(store, destination, lease).await?;
    Ok(pair_rows(pairs, token))
}

/// Sorts claimed pairs into events and poison; `token` is their lease's.
fn pair_rows(pairs: Vec<ClaimedPair>, token: Uuid) -> ClaimedPairs {
    let mut events = Vec::with_capacity(pairs.len());
    let mut poison = Vec::new();
    for pair in pairs {
        match pair.row.event {
            Ok(event) => events.push(event),
            Err(reason) => poison.push((pair.row.id, pair.destination, reason)),
        }
    }
    events.sort_by_key(|e| e.seq);
    ClaimedPairs {
        events,
        poison,
        token,
    }
}
