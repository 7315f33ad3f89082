//! One batch of events through its stages, whatever its origin: routed into items, published
//! lane by lane while watched (a lane that lags behind the others is handed over), then settled
//! by the settler, which judges each item and writes the plan; what was handed over with its
//! request still out is settled when its answers come.
//!
//! Everything a batch holds is bounded by `publish_timeout` from its start. What differs between
//! a batch claimed from the table and one read from the WAL is its [`Origin`]: the claim's guard
//! and the rows cut off behind their key, or the WAL's rowless events and deferred rows.

use std::collections::HashSet;
use std::future::Future;
use std::sync::Arc;

use uuid::Uuid;

use super::context::Context;
use super::publish::publish;
use super::watch::{in_flight_lease, Stop};
use crate::error::Result;
use crate::model::event::OutboxEvent;
use crate::model::metric;
use crate::route::{Dispatch, Item, Items};
use crate::settle::{self, Settled};
use crate::store::deliveries::{self, KeysWaiting};
use crate::store::outbox::Guard;
use crate::store::{Lease, Store};

/// How a batch settles, as its origin says.
pub(super) struct Settling<'a> {
    /// What its settle writes under.
    pub(super) guard: Guard,
    /// How its events settle.
    pub(super) origin: settle::Origin<'a>,
    /// Rows given back with the untouched ones: an ordered claim's rows cut off behind their key.
    pub(super) cut_off: &'a [Uuid],
}

/// What differs between a batch claimed from the table and one read from the WAL.
pub(super) trait Origin: Send {
    /// The lease token of what the batch hands over with its request out.
    fn lease_token(&self) -> Uuid;

    /// What the batch's settle writes under, and how its events settle.
    fn settling(&mut self) -> Settling<'_>;

    /// Gives the whole batch back untouched: its routing failed. A batch nothing holds (read
    /// from the WAL: it is read again) has nothing to give back.
    fn release(
        &mut self,
        _store: &Store,
        _events: &[OutboxEvent],
        _poison: &[(Uuid, String)],
    ) -> impl Future<Output = Result<()>> + Send {
        async { Ok(()) }
    }

    /// Some lane of the batch is done while another is not: the claim loop may go on.
    fn detach(&mut self) {}

    /// The batch handed lanes over and settled the rest (`early`): it now waits for the requests
    /// still out.
    fn settled_early(&mut self, _early: &Settled) {}
}

/// A batch as it enters the pipeline: its events, the rows that could not be read as events, and
/// when its budget ends.
pub(super) struct Read<'a> {
    /// The events, in order.
    pub(super) events: Vec<OutboxEvent>,
    /// Rows that cannot be read as events, with the reason.
    pub(super) poison: &'a [(Uuid, String)],
    /// When its publishing must end (`publish_timeout` from its start).
    pub(super) deadline: tokio::time::Instant,
}

/// Runs a batch `read` from `origin` through its stages; what it settled, the late answers of
/// lanes handed over included.
pub(super) async fn run<O: Origin>(
    ctx: &Arc<Context>,
    read: Read<'_>,
    origin: &mut O,
) -> Result<Settled> {
    let Read {
        events,
        poison,
        deadline,
    } = read;
    metrics::histogram!(metric::BATCH_SIZE).record((events.len() + poison.len()) as f64);
    let items = match items(ctx, &events, Targets::Routed, None).await {
        Ok(items) => items,
        Err(e) => {
            // Everything claimed goes back, not only the rows cut off (a lease would otherwise
            // keep the claimed ones until it expires).
            origin.release(&ctx.store, &events, poison).await?;
            return Err(e);
        }
    };
    let mut published = publish(ctx, events, items, deadline, || origin.detach()).await;
    let lease = Lease {
        token: origin.lease_token(),
        length: in_flight_lease(deadline),
    };
    let in_flight = published.in_flight();
    let aborted = published.stop == Stop::Aborted;
    let settling = origin.settling();
    let batch = settle::Batch {
        events: &published.run.events,
        poison,
        cut_off: settling.cut_off,
        origin: settling.origin,
        lease,
    };
    let attempts = std::mem::take(&mut published.attempts);
    let settled = ctx
        .settler
        .batch(&batch, attempts, settling.guard, &ctx.lanes, aborted);
    let mut settled = settled.await?;
    ctx.progressed();
    let Stop::HandOver(lanes) = published.stop.clone() else {
        return Ok(settled);
    };
    origin.settled_early(&settled);
    // The handed lanes' unsent items are the retry scheduler's now.
    if !lanes.is_empty() {
        ctx.retries_due.notify_one();
    }
    // Then wait for the requests still out, and settle them.
    let (run, late) = published.late(&in_flight).await;
    let leased_rows = settled.leased_rows.as_slice();
    let late = ctx
        .settler
        .late(&run.events, late, lease.token, leased_rows, &ctx.lanes);
    settled.report += late.await?;
    ctx.progressed();
    Ok(settled)
}

/// Where a batch's items go.
pub(super) enum Targets {
    /// Where routing sends each event.
    Routed,
    /// Every event to this one lane (a replay's step).
    Lane(usize),
}

/// The items of `events`, sent to `targets`, each held when its destination is; with ordered
/// destinations, an item whose key still has an undelivered pair for its destination waits
/// behind it (DeliveriesKeysWaiting) — behind the pairs of its own stream: live ones, or those of
/// the replay `replay` (a replay's events and live ones never wait for each other).
pub(super) async fn items(
    ctx: &Context,
    events: &[OutboxEvent],
    targets: Targets,
    replay: Option<Uuid>,
) -> Result<Items> {
    let mut items = match targets {
        Targets::Routed => {
            let routes = ctx.router.route_all(events);
            let open = ctx.lanes.open_of(routes.iter().flatten().copied());
            Items::route(routes, |lane| open.get(&lane).copied().unwrap_or(false))
        }
        Targets::Lane(d) => {
            let open = ctx.lanes[d].gate.is_open();
            Items::pairs(events.iter().map(|_| d), |_| open)
        }
    };
    let key_of = |item: &Item| -> Option<(usize, &str)> {
        let lane = item.lane?;
        let event = &events[item.event];
        ctx.lanes[lane]
            .keeps_order_of(event)
            .then(|| (lane, event.key.as_deref().unwrap_or_default()))
    };
    let keyed: Vec<(usize, &str)> = items
        .list
        .iter()
        .filter(|i| i.dispatch == Dispatch::Send)
        .filter_map(key_of)
        .collect();
    if keyed.is_empty() {
        return Ok(items);
    }
    let names: Vec<&str> = keyed
        .iter()
        .map(|(lane, _)| ctx.lanes[*lane].name())
        .collect();
    let keys: Vec<&str> = keyed.iter().map(|(_, key)| *key).collect();
    let asked = KeysWaiting {
        destinations: &names,
        keys: &keys,
        blocking: &ctx.blocking,
        replay,
    };
    let waiting = deliveries::keys_waiting(&ctx.store, &asked).await?;
    if waiting.is_empty() {
        return Ok(items);
    }
    let waiting: HashSet<(usize, &str)> = keyed
        .into_iter()
        .filter(|(lane, key)| {
            waiting
                .iter()
                .any(|(d, k)| d == ctx.lanes[*lane].name() && k == key)
        })
        .collect();
    items.keep_behind(&waiting, key_of);
    Ok(items)
}
