//! The retry scheduler: one loop for the due pairs of every destination — failed attempts whose
//! backoff is over, pairs a batch handed over, held pairs of a destination that is back. It asks
//! which destinations have pairs due (one index probe per destination that has pairs, none for
//! the others), claims theirs in one statement, each destination up to what it can start soon,
//! and runs each destination's pairs as a batch of its own, side by side: published through the
//! lane's gate, judged and settled like any batch, at the lane's own pace.
//!
//! So the relay's cost follows the work, not the configuration: no loop, poll or connection per
//! destination, and a destination with a long backlog (a slow one, one down for an hour) takes
//! its share of each claim, never another's — while its batch runs it is not claimed for again,
//! and the others are. While the claim loops carry fresh events, a lane claims one round of its
//! free places ([`retry_claim`]), and one that claimed all it could rests three times as long as
//! its batch took before its next claim ([`backlog_rest`]): on a machine the database, the relay
//! and the receivers share, a backlog draining flat out would otherwise take the cores the other
//! destinations' fresh events need. A batch that hands pairs over, a destination that is back and
//! a replay wake the scheduler at once; otherwise it sleeps until the earliest due pair, polling
//! at most every [`RETRIES_POLL_INTERVAL`] for pairs other relays made due.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::task::{Id, JoinSet};
use tokio_util::sync::CancellationToken;
use tracing::warn;

use super::context::Context;
use super::pacing::{backlog_rest, db_reachable, retry_claim, Pacing};
use super::publish::publish_whole;
use super::watch::Stop;
use crate::error::Result;
use crate::model::metric;
use crate::model::report::BatchReport;
use crate::route::Items;
use crate::settle::Pairs;
use crate::sources::poll::{claim_pairs, lane_claim, ClaimedPairs};
use crate::store::due::{self, DueLane};

/// The scheduler's longest idle wait (or `poll_interval` if longer). Its rows are retries and
/// held pairs, due after a backoff of seconds, and pairs handed over wake it directly, so it need
/// not poll as often as the claim loops that carry fresh events.
const RETRIES_POLL_INTERVAL: Duration = Duration::from_millis(250);

/// What one look at the due pairs decided: which lanes to claim for, at most how many pairs
/// each, and how long until the next pair of another lane is due.
#[derive(Debug, Default, PartialEq)]
pub(super) struct Due {
    /// (lane, most pairs), in the order the database named them.
    pub(super) claims: Vec<(usize, usize)>,
    /// Until the earliest pair that is not due yet, of a lane not busy.
    pub(super) next: Option<Duration>,
}

/// How recently the claim loops must have had fresh events for a lane with a backlog to rest
/// between its batches ([`backlog_rest`]).
const FRESH_WITHIN: Duration = Duration::from_secs(1);

/// Which of the destinations with undelivered pairs (`due`) to claim for now: those due, that
/// this relay serves (`lane` names their lane) and whose last batch is over (not in `busy`),
/// each up to `most(lane)`; and when the first of the others that is not held is due.
pub(super) fn plan(
    due: &[DueLane],
    lane: impl Fn(&str) -> Option<usize>,
    busy: &HashSet<usize>,
    most: impl Fn(usize) -> usize,
) -> Due {
    let mut plan = Due::default();
    for entry in due {
        let Some(d) = lane(&entry.destination) else {
            continue;
        };
        if busy.contains(&d) {
            continue;
        }
        match entry.due_in {
            Some(secs) if secs <= 0.0 => plan.claims.push((d, most(d))),
            Some(secs) => {
                let wait = Duration::from_secs_f64(secs);
                plan.next = Some(plan.next.map_or(wait, |n: Duration| n.min(wait)));
            }
            None => {}
        }
    }
    plan
}

/// Publishes and settles lane `d`'s claimed pairs as a batch of their own. Each pair is its
/// destination's alone: it is published, retried, held and dead-lettered like an event with that
/// one destination.
pub(super) async fn lane_batch(
    ctx: &Arc<Context>,
    d: usize,
    claimed: ClaimedPairs,
) -> Result<BatchReport> {
    let open = ctx.lanes[d].gate.is_open();
    let events = claimed.events;
    let items = Items::pairs(events.iter().map(|_| d), |_| open);
    let published = publish_whole(ctx, events, items).await;
    let aborted = published.stop == Stop::Aborted;
    let pairs = Pairs {
        events: &published.run.events,
        poison: &claimed.poison,
        token: claimed.token,
    };
    let settled = ctx
        .settler
        .pairs(&pairs, published.attempts, &ctx.lanes, aborted);
    let report = settled.await?;
    ctx.progressed();
    Ok(report)
}

/// The retry scheduler over a relay's context.
struct Scheduler {
    ctx: Arc<Context>,
}

impl Scheduler {
    fn new(ctx: &Arc<Context>) -> Self {
        Self {
            ctx: Arc::clone(ctx),
        }
    }

    /// Looks at the due pairs and claims those of the lanes not `busy`: each lane's claimed
    /// pairs, and how long until the next is due.
    async fn claim(&self, busy: &HashSet<usize>) -> Result<(Vec<(usize, ClaimedPairs)>, Due)> {
        let ctx = &self.ctx;
        let due = due::due(&ctx.store).await?;
        let batch = ctx.config.relay.batch_size;
        let fresh = ctx.progress.fresh_within(FRESH_WITHIN);
        let plan = plan(
            &due,
            |name| ctx.lanes.named(name).map(|(d, _)| d),
            busy,
            |d| {
                let gate = &ctx.lanes[d].gate;
                retry_claim(batch, gate.concurrency(), gate.in_flight(), fresh)
            },
        );
        if plan.claims.is_empty() {
            return Ok((Vec::new(), plan));
        }
        let lanes: Vec<_> = plan
            .claims
            .iter()
            .map(|&(d, most)| lane_claim(&ctx.lanes[d].config, most))
            .collect();
        let claimed = claim_pairs(&ctx.store, &lanes, ctx.claim.lease).await?;
        let claimed = claimed
            .into_iter()
            .filter_map(|(name, pairs)| Some((ctx.lanes.named(&name)?.0, pairs)))
            .collect();
        Ok((claimed, plan))
    }
}

/// Claims, publishes and settles one batch of due pairs of every lane, side by side (`relay
/// --once`, tests).
pub(super) async fn every_lane_once(ctx: &Arc<Context>) -> Result<BatchReport> {
    let (claimed, _) = Scheduler::new(ctx).claim(&HashSet::new()).await?;
    let batches = claimed
        .into_iter()
        .map(|(d, pairs)| async move { lane_batch(ctx, d, pairs).await });
    let mut total = BatchReport::default();
    for report in futures::future::join_all(batches).await {
        total += report?;
    }
    Ok(total)
}

/// The scheduler, until shutdown: claims the due pairs of every lane not running a batch and
/// starts a batch per lane; claims again at once when it found some or a batch ended, backs off
/// to [`RETRIES_POLL_INTERVAL`] (or `poll_interval`, or the next due pair if sooner) while it
/// finds none or the database fails; woken at once when a batch hands pairs over. At shutdown the
/// batches running end (their own grace) before it returns.
pub(super) async fn retries_loop(ctx: &Arc<Context>, shutdown: CancellationToken) -> BatchReport {
    let scheduler = Scheduler::new(ctx);
    let settings = &ctx.config.relay;
    let mut pacing = Pacing::between(
        settings.min_poll_interval,
        settings.poll_interval.max(RETRIES_POLL_INTERVAL),
    );
    let mut db_down = false;
    let mut total = BatchReport::default();
    let mut running: JoinSet<Result<BatchReport>> = JoinSet::new();
    let mut lane_of: HashMap<Id, usize> = HashMap::new();
    let mut busy: HashSet<usize> = HashSet::new();
    let what = "retries";
    while !shutdown.is_cancelled() {
        let pause = match scheduler.claim(&busy).await {
            Ok((claimed, plan)) if !claimed.is_empty() => {
                db_reachable(what, &mut db_down);
                let most: HashMap<usize, usize> = plan.claims.into_iter().collect();
                for (d, pairs) in claimed {
                    let ctx = Arc::clone(ctx);
                    let most = most.get(&d).copied().unwrap_or(usize::MAX);
                    let task = running.spawn(async move {
                        let (started, claimed) = (Instant::now(), pairs.events.len());
                        let report = lane_batch(&ctx, d, pairs).await;
                        let fresh = ctx.progress.fresh_within(FRESH_WITHIN);
                        let rest = backlog_rest(claimed, most, started.elapsed(), fresh);
                        if !rest.is_zero() {
                            tokio::select! {
                                _ = tokio::time::sleep(rest) => {}
                                _ = ctx.stopping.cancelled() => {}
                            }
                        }
                        report
                    });
                    lane_of.insert(task.id(), d);
                    busy.insert(d);
                }
                pacing.busy();
                continue;
            }
            Ok((_, plan)) => {
                db_reachable(what, &mut db_down);
                let idle = pacing.idle();
                plan.next.map_or(idle, |next| idle.min(next))
            }
            Err(e) => {
                db_down = true;
                metrics::counter!(metric::DB_ERRORS_TOTAL).increment(1);
                let pause = pacing.failed();
                warn!(error = %crate::error_chain(&e), retry_in_ms = pause.as_millis() as u64, "claim of retries failed; retrying");
                pause
            }
        };
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = ctx.retries_due.notified() => pacing.busy(),
            Some(ended) = running.join_next_with_id(), if !running.is_empty() => {
                total += ended_batch(ctx, ended, &mut lane_of, &mut busy);
                pacing.busy();
            }
            _ = tokio::time::sleep(pause) => {}
        }
    }
    while let Some(ended) = running.join_next_with_id().await {
        total += ended_batch(ctx, ended, &mut lane_of, &mut busy);
    }
    total
}

/// What a lane's batch that `ended` did; its lane is no longer busy. A batch that panicked
/// takes the scheduler down with it, as a claim worker's panic does: the relay stops.
fn ended_batch(
    ctx: &Context,
    ended: std::result::Result<(Id, Result<BatchReport>), tokio::task::JoinError>,
    lane_of: &mut HashMap<Id, usize>,
    busy: &mut HashSet<usize>,
) -> BatchReport {
    let (id, result) = match ended {
        Ok(ended) => ended,
        Err(e) => match e.try_into_panic() {
            Ok(panic) => std::panic::resume_unwind(panic),
            Err(e) => (e.id(), Ok(BatchReport::default())),
        },
    };
    let Some(d) = lane_of.remove(&id) else {
        return BatchReport::default();
    };
    busy.remove(&d);
    match result {
        Ok(report) => report,
        Err(e) => {
            metrics::counter!(metric::DB_ERRORS_TOTAL).increment(1);
            warn!(destination = %ctx.lanes[d].name(), error = %crate::error_chain(&e), "settle of retries failed; their lease expires and they are retried");
            BatchReport::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn due(name: &str, due_in: Option<f64>) -> DueLane {
        DueLane {
            destination: name.into(),
            due_in,
        }
    }

    #[test]
    fn the_plan_claims_for_due_lanes_not_busy_and_waits_for_the_next() {
        let lanes = ["a", "b", "c", "d", "e"];
        let lane = |name: &str| lanes.iter().position(|l| *l == name);
        let due = [
            due("a", Some(-3.0)),
            due("b", Some(0.0)),
            due("c", Some(2.5)),
            due("d", None),
            due("e", Some(-1.0)),
            due("gone", Some(-9.0)),
            due("f", Some(0.5)),
        ];
        // busy lanes → (claims, next)
        type Case<'a> = (&'a [usize], &'a [(usize, usize)], Option<f64>);
        let cases: &[Case] = &[
            (&[], &[(0, 10), (1, 11), (4, 14)], Some(2.5)),
            (&[0, 4], &[(1, 11)], Some(2.5)),
            (&[2], &[(0, 10), (1, 11), (4, 14)], None),
        ];
        for (busy, claims, next) in cases {
            let busy: HashSet<usize> = busy.iter().copied().collect();
            let plan = plan(&due, lane, &busy, |d| 10 + d);
            assert_eq!(plan.claims, *claims, "busy {busy:?}");
            assert_eq!(
                plan.next,
                next.map(Duration::from_secs_f64),
                "busy {busy:?}"
            );
        }
    }
}
