//! The replay loop: feeds the running replays of this relay's destinations into their lanes.
//!
//! A replay ([`crate::store::replays`]) is fed a step at a time: the events after its cursor that
//! the destination takes (its topics and filter) and the replay's own filter keeps become pairs of
//! the destination in the deliveries table, marked with the replay's header, and the lane's retry
//! loop sends them like any pair. At most [`WINDOW`] of a replay's pairs wait there at a time, and
//! a replay with a `rate` takes a token per event from a bucket of its own first: so a replay of a
//! million events never stands in front of the destination's live events (which never go through
//! the deliveries table unless they fail or fall behind) for more than a window's worth.
//!
//! Any relay serving the destination feeds it, one at a time (the step locks the replay's row);
//! a relay killed mid-step leaves the step undone, and the next step starts from the same cursor.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};
use uuid::Uuid;

use super::Relay;
use crate::model::filter::Filter;
use crate::model::metric;
use crate::model::rate::RateLimit;
use crate::rate::Limiter;
use crate::store::replays::{self, NewReplay, Replay, Selection};

/// Most pairs of one replay waiting in the deliveries table at a time.
pub(super) const WINDOW: i64 = 2_000;

/// Most events one step reads.
const STEP: i64 = 1_000;

/// How often the loop looks for running replays while none is moving.
const IDLE: Duration = Duration::from_millis(250);

/// What this relay keeps of a replay it feeds: its lane, its filter, its rate.
struct Fed {
    lane: usize,
    filter: Option<Filter>,
    rate: Option<Limiter>,
}

impl Fed {
    /// What to keep of `replay` fed into lane `lane`; an error names what cannot be read.
    fn new(relay: &Relay, replay: &Replay, lane: usize) -> Result<Self, String> {
        let filter = replay
            .filter
            .as_deref()
            .map(Filter::compile)
            .transpose()
            .map_err(|e| format!("filter: {e}"))?;
        let rate = replay
            .rate
            .as_deref()
            .map(|r| RateLimit::parse(r, None))
            .transpose()
            .map_err(|e| format!("rate: {e}"))?
            .map(|limit| Limiter::new(&bucket(replay.id), limit, relay.store.clone()));
        Ok(Self { lane, filter, rate })
    }
}

/// The name of a replay's own token bucket in `<table>_rates` (beside the destinations' own).
fn bucket(id: Uuid) -> String {
    format!("replay:{id}")
}

impl Relay {
    /// Creates the backfill of each destination that has `backfill` and that no relay has
    /// registered yet (its first start); before [`Relay::register`].
    pub(super) async fn create_backfills(&self) -> crate::error::Result<()> {
        for lane in &self.lanes {
            let Some(back) = lane.config.backfill else {
                continue;
            };
            let since = chrono::Utc::now()
                - chrono::Duration::from_std(back).unwrap_or(chrono::Duration::MAX);
            let new = NewReplay {
                destination: lane.name.clone(),
                selection: Selection {
                    since: Some(since),
                    ..Selection::default()
                },
                backfill: true,
                created_by: Some("backfill".into()),
                ..NewReplay::default()
            };
            if let Some(id) = replays::create(&self.store, &new).await? {
                info!(destination = %lane.name, replay = %id, since = %since, "backfilling a new destination");
            }
        }
        Ok(())
    }

    /// Feeds the running replays of this relay's destinations until `shutdown`.
    pub(super) async fn replays_loop(&self, shutdown: CancellationToken) {
        let names: Vec<String> = self.lanes.iter().map(|l| l.name.clone()).collect();
        let mut fed: HashMap<Uuid, Fed> = HashMap::new();
        while !shutdown.is_cancelled() {
            let moved = match self.replays_step(&names, &mut fed).await {
                Ok(moved) => moved,
                Err(e) => {
                    metrics::counter!(metric::DB_ERRORS_TOTAL).increment(1);
                    debug!(error = %crate::error_chain(&e), "cannot feed replays; retrying");
                    false
                }
            };
            if !moved {
                tokio::select! {
                    _ = tokio::time::sleep(IDLE) => {}
                    _ = shutdown.cancelled() => {}
                }
            }
        }
    }

    /// One step of every running replay of `names`; whether any moved.
    async fn replays_step(
        &self,
        names: &[String],
        fed: &mut HashMap<Uuid, Fed>,
    ) -> crate::error::Result<bool> {
        let running = replays::running(&self.store, names).await?;
        fed.retain(|id, _| running.iter().any(|r| r.id == *id));
        let mut moved = false;
        for replay in &running {
            let Some(lane) = self.lanes.iter().position(|l| l.name == replay.destination) else {
                continue;
            };
            if replay.walked {
                if replays::finish(&self.store, replay.id).await? {
                    info!(replay = %replay.id, destination = %replay.destination, queued = replay.queued, dead = replay.dead, "replay done");
                }
                continue;
            }
            let f = match fed.entry(replay.id) {
                Entry::Occupied(known) => known.into_mut(),
                Entry::Vacant(new) => match Fed::new(self, replay, lane) {
                    Ok(f) => new.insert(f),
                    Err(why) => {
                        warn!(replay = %replay.id, error = %why, "replay cannot run");
                        replays::fail(&self.store, replay.id, &why).await?;
                        continue;
                    }
                },
            };
            moved |= self.feed(replay, f).await?;
        }
        Ok(moved)
    }

    /// One step of `replay`: whether it queued anything.
    async fn feed(&self, replay: &Replay, f: &Fed) -> crate::error::Result<bool> {
        let room = (WINDOW - replay.pending).min(STEP);
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
        let lane = &self.lanes[f.lane];
        let step = replays::feed(
            &self.store,
            replay.id,
            |now| (WINDOW - now.pending).min(tokens),
            |event| {
                self.router.takes(f.lane, event)
                    && f.filter.as_ref().is_none_or(|flt| flt.eval(event))
            },
        )
        .await?;
        if step.queued > 0 {
            metrics::counter!(metric::REPLAYED_TOTAL, "destination" => lane.name.clone())
                .increment(step.queued);
            lane.handed.notify_one();
        }
        Ok(step.read > 0)
    }
}
