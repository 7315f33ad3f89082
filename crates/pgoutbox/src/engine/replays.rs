//! The replay loop: feeds the running replays of this relay's destinations into their lanes.
//!
//! A replay ([`crate::store::replays`]) is fed a step at a time: the events after its cursor that
//! the destination takes (its topics and filter) and the replay's own filter keeps are sent
//! through the destination's lane, marked with the replay's header, as a batch of that lane alone
//! (its gate, breaker, transform, key order and rate limit apply). What the destination did not
//! take at once — a failure, a held or paused destination, an event behind a waiting pair of its
//! key — becomes a pair of the destination in the deliveries table, which the retry scheduler
//! takes on like any; while more than [`WINDOW`] of a replay's pairs wait there, it reads nothing more. A
//! replay with a `rate` takes a token per event from a bucket of its own first, in steps of 50 ms
//! of its rate; one without rests as long as its steps took (it works at most half the time,
//! in steps of a few hundred events: [`pacing::replay_step`], [`pacing::replay_rest`]), so that
//! live events keep most of the machine.
//!
//! Any relay serving the destination feeds it, one at a time (a step holds the replay's row
//! lock); a relay killed mid-step drops the lock with its connection, and the next step sends the
//! same events again from the same cursor.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};
use uuid::Uuid;

use super::context::Context;
use super::pacing;
use super::pipeline::{self, Targets};
use super::publish::publish_whole;
use crate::model::event::OutboxEvent;
use crate::model::filter::Filter;
use crate::model::metric;
use crate::model::rate::RateLimit;
use crate::rate::Limiter;
use crate::settle::Lanes as _;
use crate::store::replays::{self, NewReplay, Replay, Retained, Selection, REPLAY_HEADER};

/// Most pairs of one replay waiting in the deliveries table at a time.
pub(super) const WINDOW: i64 = 2_000;

/// How often the loop looks again while a replay it feeds is not moving (paused, throttled, its
/// window full).
const IDLE: Duration = Duration::from_millis(250);

/// How often the loop looks for running replays while it feeds none: a new replay starts within
/// this, and a relay with no replays pays one query a second for them.
const NONE: Duration = Duration::from_secs(1);

/// What this relay keeps of a replay it feeds: its lane, its filter, its rate, its step's size.
struct Fed {
    lane: usize,
    filter: Option<Filter>,
    rate: Option<Limiter>,
    step: i64,
}

impl Fed {
    /// What to keep of `replay` fed into lane `lane`; an error names what cannot be read.
    fn new(ctx: &Context, replay: &Replay, lane: usize) -> Result<Self, String> {
        let filter = replay
            .filter
            .as_deref()
            .map(Filter::compile)
            .transpose()
            .map_err(|e| format!("filter: {e}"))?;
        let limit = replay
            .rate
            .as_deref()
            .map(|r| RateLimit::parse(r, None))
            .transpose()
            .map_err(|e| format!("rate: {e}"))?;
        let step = pacing::replay_step(limit.as_ref().map(|l| l.per_second));
        let rate = limit.map(|limit| Limiter::new(&bucket(replay.id), limit, ctx.store.clone()));
        Ok(Self {
            lane,
            filter,
            rate,
            step,
        })
    }
}

/// The name of a replay's own token bucket in `<table>_rates` (beside the destinations' own).
fn bucket(id: Uuid) -> String {
    format!("replay:{id}")
}

/// Creates the backfill of each destination that has `backfill` and that no relay has registered
/// yet (its first start); before the destinations are registered.
pub(super) async fn create_backfills(ctx: &Context) -> crate::error::Result<()> {
    for lane in ctx.lanes.iter() {
        let Some(back) = lane.config.backfill else {
            continue;
        };
        let since =
            chrono::Utc::now() - chrono::Duration::from_std(back).unwrap_or(chrono::Duration::MAX);
        let new = NewReplay {
            destination: lane.name().to_owned(),
            selection: Selection {
                since: Some(since),
                ..Selection::default()
            },
            backfill: true,
            created_by: Some("backfill".into()),
            ..NewReplay::default()
        };
        if let Some(id) = replays::create(&ctx.store, &new).await? {
            info!(destination = %lane.name(), replay = %id, since = %since, "backfilling a new destination");
        }
    }
    Ok(())
}

/// Feeds the running replays of this relay's destinations until `shutdown`.
pub(super) async fn replays_loop(ctx: &Arc<Context>, shutdown: CancellationToken) {
    let names: Vec<String> = ctx.lanes.iter().map(|l| l.name().to_owned()).collect();
    let mut fed: HashMap<Uuid, Fed> = HashMap::new();
    while !shutdown.is_cancelled() {
        let began = std::time::Instant::now();
        let moved = match replays_step(ctx, &names, &mut fed).await {
            Ok(moved) => moved,
            Err(e) => {
                metrics::counter!(metric::DB_ERRORS_TOTAL).increment(1);
                debug!(error = %crate::error_chain(&e), "cannot feed replays; retrying");
                false
            }
        };
        let wait = if moved {
            let limited = fed.values().all(|f| f.rate.is_some());
            pacing::replay_rest(began.elapsed(), limited)
        } else if fed.is_empty() {
            NONE
        } else {
            IDLE
        };
        if !wait.is_zero() {
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = shutdown.cancelled() => {}
            }
        }
    }
}

/// One step of every running replay of `names`; whether any moved.
async fn replays_step(
    ctx: &Arc<Context>,
    names: &[String],
    fed: &mut HashMap<Uuid, Fed>,
) -> crate::error::Result<bool> {
    let running = replays::running(&ctx.store, names).await?;
    fed.retain(|id, _| running.iter().any(|r| r.id == *id));
    let mut moved = false;
    for replay in &running {
        let Some((lane, _)) = ctx.lanes.named(&replay.destination) else {
            continue;
        };
        if replay.walked {
            if replays::finish(&ctx.store, replay.id).await? {
                info!(replay = %replay.id, destination = %replay.destination, queued = replay.queued, dead = replay.dead, "replay done");
            }
            continue;
        }
        let f = match fed.entry(replay.id) {
            Entry::Occupied(known) => known.into_mut(),
            Entry::Vacant(new) => match Fed::new(ctx, replay, lane) {
                Ok(f) => new.insert(f),
                Err(why) => {
                    warn!(replay = %replay.id, error = %why, "replay cannot run");
                    replays::fail(&ctx.store, replay.id, &why).await?;
                    continue;
                }
            },
        };
        moved |= feed(ctx, replay, f).await?;
    }
    Ok(moved)
}

/// One step of `replay`: reads its next events, sends those its destination takes (with the
/// replay's header) through the lane, leaves those not delivered at once as pairs for the
/// retry scheduler, and moves its cursor. Whether it read anything.
async fn feed(ctx: &Arc<Context>, replay: &Replay, f: &Fed) -> crate::error::Result<bool> {
    let room = (WINDOW - replay.pending).min(f.step);
    if room <= 0 {
        return Ok(false);
    }
    let tokens = match &f.rate {
        Some(limiter) => {
            let deadline = tokio::time::Instant::now() + IDLE;
            limiter.take(room as usize, deadline).await as i64
        }
        None => room,
    };
    if tokens == 0 {
        return Ok(false);
    }
    // Tokens pay for events sent: what a step does not send (another relay holds the step,
    // fewer events left, events the replay skips) goes back to the limiter for the next one.
    let unused = |sent: usize| {
        if let Some(limiter) = &f.rate {
            limiter.give_back((tokens as usize).saturating_sub(sent));
        }
    };
    let Some(mut step) = replays::begin(&ctx.store, replay.id).await? else {
        unused(0);
        return Ok(false);
    };
    let limit = (WINDOW - step.replay.pending).min(tokens);
    if limit <= 0 {
        unused(0);
        return Ok(false);
    }
    let read = step.read(limit).await?;
    let header = (REPLAY_HEADER.to_owned(), replay.id.to_string());
    let (chosen, events): (Vec<&Retained>, Vec<OutboxEvent>) = read
        .iter()
        .filter_map(|r| {
            let event = r.event.as_ref().ok()?;
            let takes = ctx.router.replay_takes(f.lane, f.filter.as_ref(), event);
            takes.then(|| {
                let mut event = event.clone();
                event
                    .headers
                    .retain(|(k, _)| !k.eq_ignore_ascii_case(REPLAY_HEADER));
                event.headers.push(header.clone());
                (r, event)
            })
        })
        .unzip();
    unused(events.len());
    let delivered = send_replayed(ctx, f.lane, replay.id, events).await?;
    let left: Vec<&Retained> = chosen
        .iter()
        .zip(&delivered)
        .filter(|(_, ok)| !**ok)
        .map(|(r, _)| *r)
        .collect();
    let queued = step.queue(&left).await?;
    let walked = (read.len() as i64) < limit;
    step.advance(&read, chosen.len() as u64, walked).await?;
    let lane = &ctx.lanes[f.lane];
    metrics::counter!(metric::REPLAYED_TOTAL, "destination" => lane.name().to_owned())
        .increment(chosen.len() as u64);
    if queued > 0 {
        ctx.retries_due.notify_one();
    }
    Ok(!read.is_empty())
}

/// Publishes `events` of `replay` to lane `d` as a batch of that lane alone (gate, breaker,
/// transform, rate limit; an event of an ordered key waits behind a pair of the same replay);
/// per event, whether it was delivered.
async fn send_replayed(
    ctx: &Arc<Context>,
    d: usize,
    replay: Uuid,
    events: Vec<OutboxEvent>,
) -> crate::error::Result<Vec<bool>> {
    if events.is_empty() {
        return Ok(Vec::new());
    }
    let items = pipeline::items(ctx, &events, Targets::Lane(d), Some(replay)).await?;
    let published = publish_whole(ctx, events, items).await;
    let attempts = published.attempts.list;
    ctx.settler.store_breakers(&ctx.lanes.tripped_gates()).await;
    Ok(attempts.iter().map(|(_, a)| a.delivered()).collect())
}
