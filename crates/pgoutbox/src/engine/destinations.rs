//! The destinations loop: each second, the shared state of every destination is read (pauses,
//! breakers opened or closed by other relays), breakers this relay opened are stored, a flapping
//! destination's failures are summed up in one line an interval, and open breakers are probed.
//!
//! A probe sends one held event — through a fresh connection: the sink drops what it kept first,
//! so a client that hands back its last failed reconnect cannot fail the probe of a destination
//! that is back. An answer closes the breaker and releases the held events; a failure counts no
//! attempt and schedules the next probe, later each time.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::context::Context;
use super::lane::{Lane, SINK_IDLE};
use super::publish;
use crate::error::Result;
use crate::model::event::OutboxEvent;
use crate::model::metric;
use crate::model::outcome::Outcome;
use crate::settle::{judge, Attempt, Lanes as _, Verdict};
use crate::sinks::gate::BreakerState;
use crate::sources::poll::claim_probe_pair;
use crate::store::outbox::Guard;
use crate::store::{destinations, held};

/// How often each relay re-reads the shared destination state.
const SYNC_INTERVAL: Duration = Duration::from_secs(1);

/// How often a destination whose attempts fail (without its breaker opening) is summed up in the
/// log: the log grows with trouble, not with traffic.
const SUMMARY_INTERVAL: Duration = Duration::from_secs(30);

/// When a lane's failures were last summed up in the log, and last counted.
#[derive(Debug, Clone, Copy)]
struct SummaryClock {
    logged: Option<Instant>,
    taken: Instant,
}

impl SummaryClock {
    fn new() -> Self {
        Self {
            logged: None,
            taken: Instant::now(),
        }
    }
}

/// Registers the row of each destination not registered yet, with whether its dead events
/// block: at a relay's start every one; when it took over from another relay (a change applied),
/// only those whose definition changed, and not 100,000 rows again for one change.
pub(super) async fn register(ctx: &Context) -> Result<()> {
    let new: Vec<&Lane> = ctx.lanes.iter().filter(|l| !l.is_registered()).collect();
    if new.is_empty() {
        return Ok(());
    }
    let names: Vec<&str> = new.iter().map(|l| l.name()).collect();
    let blocks: Vec<bool> = new.iter().map(|l| l.config.dead_blocks()).collect();
    destinations::register(&ctx.store, &names, &blocks).await?;
    for lane in new {
        lane.registered();
    }
    Ok(())
}

/// Reads the shared state of the destinations changed since the last sync (every one now and
/// then, [`super::context::Synced`]) into their lanes' gates. When a destination this relay held
/// is free again (resumed, or closed by another relay's probe), the events held for it are made
/// due: a batch of this relay may have held some again just before it saw the change.
pub(super) async fn sync(ctx: &Context) -> Result<()> {
    let since = ctx.synced.since();
    let (stored, read_at) = destinations::read_changed(&ctx.store, since).await?;
    ctx.synced.read(since, read_at);
    let mut freed = false;
    for s in &stored {
        if let Some((_, lane)) = ctx.lanes.named(&s.name) {
            freed |= lane.gate.adopt(s);
        }
    }
    for lane in ctx.lanes.iter().filter(|l| !l.gate.is_quiet()) {
        // A destination's gauges appear once it is paused or its breaker leaves `closed`, and
        // follow it from then on: a scrape stays small with thousands of healthy destinations.
        let state = lane.gate.state();
        if lane.report_state(state) {
            let (breaker, paused) = state;
            metrics::gauge!(metric::DESTINATION_STATE, "destination" => lane.name().to_owned())
                .set(breaker.gauge());
            metrics::gauge!(metric::DESTINATION_PAUSED, "destination" => lane.name().to_owned())
                .set(if paused { 1.0 } else { 0.0 });
        }
    }
    if freed {
        held::unpark_followers(&ctx.store).await?;
        ctx.retries_due.notify_one();
    }
    Ok(())
}

/// How often the lanes' idle sinks are looked for ([`super::lane::SINK_IDLE`]): a look takes
/// every lane's lock, which at a hundred thousand destinations is worth doing less than each
/// second.
const SWEEP_EVERY: Duration = Duration::from_secs(30);

/// Every [`SYNC_INTERVAL`] until shutdown: the shared state, the breakers to store, the
/// summaries due, held batches to release, and the probes due; every [`SWEEP_EVERY`], the idle
/// sinks to drop.
pub(super) async fn destinations_loop(ctx: &Arc<Context>, shutdown: CancellationToken) {
    let mut summaries = vec![SummaryClock::new(); ctx.lanes.len()];
    let mut swept = Instant::now();
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(SYNC_INTERVAL) => {}
        }
        ctx.settler.store_breakers(&ctx.lanes.tripped_gates()).await;
        log_summaries(ctx, &mut summaries);
        if swept.elapsed() >= SWEEP_EVERY {
            swept = Instant::now();
            let dropped = ctx.lanes.iter().filter(|l| l.drop_idle(SINK_IDLE)).count();
            if dropped > 0 {
                debug!(dropped, "sinks of destinations idle for {} s dropped; each is built again when it has work", SINK_IDLE.as_secs());
            }
        }
        if let Err(e) = sync(ctx).await {
            warn!(error = %crate::error_chain(&e), "cannot read the destinations' state; will try again");
            continue;
        }
        // Held batches written by a batch that began before its destination came back.
        if let Err(e) = held::unbundle(&ctx.store, None, None).await {
            warn!(error = %crate::error_chain(&e), "cannot release held batches; will try again");
        }
        for (d, lane) in ctx.lanes.iter().enumerate() {
            if lane.gate.is_quiet() {
                continue;
            }
            let (state, paused) = lane.gate.state();
            if !paused && state != BreakerState::Closed {
                if let Err(e) = probe(ctx, d).await {
                    warn!(destination = %lane.name(), error = %crate::error_chain(&e), "probe failed on a database error; will try again");
                }
            }
            // Looked at in full this time: one with nothing to report is skipped until it is
            // used again.
            lane.hush();
        }
    }
}

/// One line for a destination whose attempts failed while its breaker stayed closed (an open
/// breaker has its own lines): how many failed, of how many, and the last error — at once when
/// failures start, then at most once per [`SUMMARY_INTERVAL`] while they go on. Each failed
/// attempt is also in the attempt history.
fn log_summaries(ctx: &Context, clocks: &mut [SummaryClock]) {
    for (lane, clock) in ctx.lanes.iter().zip(clocks.iter_mut()) {
        if lane.gate.is_quiet() {
            continue;
        }
        if clock
            .logged
            .is_some_and(|at| at.elapsed() < SUMMARY_INTERVAL)
        {
            continue;
        }
        let summary = lane.gate.take_summary();
        let since = clock.taken.elapsed().as_secs().max(1);
        clock.taken = Instant::now();
        if summary.failed == 0 {
            continue;
        }
        clock.logged = Some(clock.taken);
        warn!(
            destination = %lane.name(),
            failed = summary.failed,
            delivered = summary.delivered,
            last_error = summary.last_error.as_deref().unwrap_or("-"),
            "destination failing: {} of {} attempts failed in the last {since} s (each retried per its policy; `pgoutbox dead list` and the console show the events)",
            summary.failed,
            summary.failed + summary.delivered,
        );
    }
}

/// Sends one held event to lane `d` if its probe is due and this relay takes it: a held event
/// row, or else a held pair from the deliveries table.
async fn probe(ctx: &Arc<Context>, d: usize) -> Result<()> {
    let lane = &ctx.lanes[d];
    let hold_for = ctx.config.relay.publish_timeout * 2;
    let Some(failed_probes) = destinations::take_probe(&ctx.store, lane.name(), hold_for).await?
    else {
        return Ok(());
    };
    // A fresh connection: whatever the sink kept may be the failed one.
    lane.reconnect();
    let mut unit = ctx.store.begin().await?;
    let row = held::claim_probe(&ctx.store, &mut unit, lane.name()).await?;
    let event = match row.map(|row| (row.id, row.event)) {
        Some((_, Ok(event))) => event,
        Some((id, Err(reason))) => {
            // A poison row: dead-lettered; the next probe takes another, as scheduled.
            let guard = Guard::Transaction(unit);
            ctx.settler.unreadable(id, None, &reason, guard).await?;
            return probe_skipped(ctx, d, failed_probes).await;
        }
        None => {
            unit.rollback().await?;
            return probe_pair(ctx, d, failed_probes).await;
        }
    };
    sent(ctx, d, event, Guard::Transaction(unit), failed_probes).await
}

/// The probe of lane `d` found no held event row: it takes a held pair from the deliveries table
/// (turning one held batch into held pairs first, if that is all there is).
async fn probe_pair(ctx: &Arc<Context>, d: usize, failed_probes: i32) -> Result<()> {
    let lane = &ctx.lanes[d];
    let lease = ctx.claim.lease;
    let mut claimed = claim_probe_pair(&ctx.store, lane.name(), lease).await?;
    if claimed.events.is_empty() && claimed.poison.is_empty() {
        held::unbundle(&ctx.store, Some((lane.name(), 1)), None).await?;
        claimed = claim_probe_pair(&ctx.store, lane.name(), lease).await?;
    }
    let guard = Guard::Lease(claimed.token);
    if let Some((id, name, reason)) = claimed.poison.into_iter().next() {
        ctx.settler
            .unreadable(id, Some(&name), &reason, guard)
            .await?;
        return probe_skipped(ctx, d, failed_probes).await;
    }
    let Some(event) = claimed.events.into_iter().next() else {
        // Nothing held yet: the next events routed to the destination will be.
        return probe_skipped(ctx, d, failed_probes).await;
    };
    sent(ctx, d, event, guard, failed_probes).await
}

/// Probes lane `d` with `event`, held under `guard` (a held row's transaction, or a held pair's
/// lease), and settles what it came to: the answer's verdict (and the breaker closes), the dead
/// letter of an event past its `max_age`, or the event back to held (the row's transaction rolls
/// back; the pair is written held again). Either way the next probe is scheduled.
async fn sent(
    ctx: &Arc<Context>,
    d: usize,
    event: OutboxEvent,
    guard: Guard,
    failed_probes: i32,
) -> Result<()> {
    let lane = &ctx.lanes[d];
    let (verdict, reason) = match probe_once(ctx, d, &event).await {
        Probed::Answered(v) => {
            ctx.settler
                .one(&event, lane.name(), v, guard, &ctx.lanes)
                .await?;
            return probe_answered(ctx, d).await;
        }
        Probed::Failed { reason, expired } => (expired, Some(reason)),
        Probed::Silent => (None, None),
    };
    match (verdict, guard) {
        (Some(dead), guard) => {
            ctx.settler
                .one(&event, lane.name(), dead, guard, &ctx.lanes)
                .await?
        }
        (None, Guard::Transaction(unit)) => unit.rollback().await?,
        // Back to held, no attempt counted.
        (None, guard) => {
            let held = Verdict::Held(None);
            ctx.settler
                .one(&event, lane.name(), held, guard, &ctx.lanes)
                .await?
        }
    }
    probe_failed(ctx, d, failed_probes, reason).await
}

/// What a probe came to.
enum Probed {
    /// The destination answered (a delivery, or a permanent rejection): the verdict settles the
    /// event, and the breaker closes.
    Answered(Verdict),
    /// The request failed (`reason`), no attempt counted; `expired` is the verdict that
    /// dead-letters the event when it is past its `max_age`.
    Failed {
        reason: String,
        expired: Option<Verdict>,
    },
    /// No answer within `publish_timeout`.
    Silent,
}

/// Publishes `event` to lane `d` as a probe (whatever its breaker says) within one
/// `publish_timeout`, and judges its answer as any attempt's: a failure while the breaker is open
/// counts no attempt, and holds the event unless it is past its `max_age`.
async fn probe_once(ctx: &Arc<Context>, d: usize, event: &OutboxEvent) -> Probed {
    let attempts = publish::probe(ctx, event.clone(), d).await;
    let failed = match attempts.list.first().map(|(_, attempt)| attempt) {
        Some(Attempt::Answered(Outcome::Retry { reason, .. }, _)) => Some(reason.clone()),
        Some(Attempt::Answered(..)) => None,
        _ => return Probed::Silent,
    };
    let events = std::slice::from_ref(event);
    let verdicts = judge(events, attempts, &ctx.lanes);
    let Some(verdict) = verdicts.list.into_iter().next().map(|j| j.verdict) else {
        return Probed::Silent;
    };
    match (failed, verdict) {
        (None, verdict) => Probed::Answered(verdict),
        (Some(reason), dead @ Verdict::Failed(_)) => Probed::Failed {
            reason,
            expired: Some(dead),
        },
        (Some(reason), _) => Probed::Failed {
            reason,
            expired: None,
        },
    }
}

/// A probe found nothing to send (or a poison row): the next probe comes as scheduled.
async fn probe_skipped(ctx: &Context, d: usize, failed_probes: i32) -> Result<()> {
    let lane = &ctx.lanes[d];
    let delay = lane.gate.probe_delay(failed_probes);
    destinations::probe_failed(&ctx.store, lane.name(), None, delay).await
}

/// The destination answered its probe: the breaker closes and its held events are due again.
async fn probe_answered(ctx: &Context, d: usize) -> Result<()> {
    let lane = &ctx.lanes[d];
    lane.gate.close();
    destinations::close(&ctx.store, lane.name()).await?;
    let released = held::unpark_followers(&ctx.store).await?;
    ctx.retries_due.notify_one();
    info!(destination = %lane.name(), released, "probe answered: circuit breaker closed, held events are due again");
    Ok(())
}

/// The probe failed (`Some(reason)`) or got no answer (`None`): the breaker stays open, the
/// next probe later.
async fn probe_failed(
    ctx: &Context,
    d: usize,
    failed_probes: i32,
    failed: Option<String>,
) -> Result<()> {
    let lane = &ctx.lanes[d];
    let reason = failed.unwrap_or_else(|| "no answer within publish_timeout".to_owned());
    let delay = lane.gate.probe_delay(failed_probes + 1);
    info!(destination = %lane.name(), error = %reason, next_probe_in_ms = delay.as_millis() as u64, "probe failed: circuit breaker stays open");
    destinations::probe_failed(&ctx.store, lane.name(), Some(&reason), delay).await
}
