//! Pacing: how long a loop waits before its next claim, how an ordered claim is sized, and how
//! many pairs the retry scheduler claims for a lane. Plain functions over plain data, with table tests; the
//! loops only carry their state.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering as AtomicOrdering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tracing::info;

use crate::config::RelayConfig;
use crate::sources::poll::{
    ClaimOptions, FOLLOWERS_PER_KEY, WINDOW_PER_BATCH_ROW, WINDOW_UNBOUNDED_FROM,
};

/// Ordered mode: followers per head of the first claim (adapted from then on).
const INITIAL_FOLLOWERS: usize = 7;

/// How long ordered claims may find no head before the window widens: other relays' batches
/// usually end well within it, freeing their keys near the front.
const WINDOW_PATIENCE: Duration = Duration::from_secs(1);

/// Longest pause between retries while the database is unreachable.
const MAX_DB_BACKOFF: Duration = Duration::from_secs(5);

/// How long a claim loop waits before its next claim.
///
/// Busy: at once. The claim is an index range scan that finds nothing quickly, so this costs little
/// and keeps latency at milliseconds. Idle: exponentially longer up to `poll_interval`, so an idle
/// relay costs a few cheap queries per second and no measurable CPU. After a database error:
/// exponentially longer up to [`MAX_DB_BACKOFF`].
#[derive(Debug, Clone)]
pub(super) struct Pacing {
    min: Duration,
    max: Duration,
    idle: Duration,
    backoff: Duration,
    /// After a claim that did not fill its batch (`relay.batch_wait`).
    batch_wait: Duration,
}

impl Pacing {
    const FIRST_BACKOFF: Duration = Duration::from_millis(100);

    /// The claim loops' pacing.
    pub(super) fn new(settings: &RelayConfig) -> Self {
        Self {
            batch_wait: settings.batch_wait,
            ..Self::between(settings.min_poll_interval, settings.poll_interval)
        }
    }

    /// Idle waits from `min` doubling up to `max`.
    pub(super) fn between(min: Duration, max: Duration) -> Self {
        Self {
            min,
            max,
            idle: min,
            backoff: Self::FIRST_BACKOFF,
            batch_wait: Duration::ZERO,
        }
    }

    /// A claim found work: look again at once.
    pub(super) fn busy(&mut self) {
        self.idle = self.min;
        self.backoff = Self::FIRST_BACKOFF;
    }

    /// A claim found `found` events of a batch of `batch`, and the batch took `took` from claim
    /// to settle: the pause before the next claim. None after a full batch (a backlog: drain it);
    /// after a partial one, as long as the batch took, up to `batch_wait`: the claim loop then
    /// works at most half the time on small batches. On a quiet machine batches take a
    /// millisecond or two, and so does the wait; when the database is busy (producers competing
    /// for it) they take longer, the waits grow with them, and the batches with the waits.
    pub(super) fn after_batch(&mut self, found: usize, batch: usize, took: Duration) -> Duration {
        self.busy();
        if found >= batch {
            Duration::ZERO
        } else {
            took.min(self.batch_wait)
        }
    }

    /// A claim found nothing: the pause before the next one.
    pub(super) fn idle(&mut self) -> Duration {
        self.backoff = Self::FIRST_BACKOFF;
        let pause = self.idle;
        self.idle = (self.idle * 2).min(self.max);
        pause
    }

    /// A claim or settle failed on the database: the pause before trying again.
    pub(super) fn failed(&mut self) -> Duration {
        let pause = self.backoff;
        self.backoff = (self.backoff * 2).min(MAX_DB_BACKOFF);
        pause
    }
}

/// Whether a batch that found `found` events of `batch` wakes the quiet claim workers. A full
/// batch means a backlog: every worker claims. A partial one took everything that was due, so
/// what comes next is a trickle, one worker's work: a second worker claiming beside it would
/// halve every batch — twice the claims and settles for the same events, on the cores the
/// application's commits need. Ordered claims stop at their heads' followers, short of a full
/// batch even with a backlog, so they wake the others whenever they found something.
pub(super) fn wakes_quiet_workers(found: usize, batch: usize, ordered: bool) -> bool {
    if ordered {
        found > 0
    } else {
        found >= batch
    }
}

/// Whether a quiet claim worker polls for due rows, with `busy` workers claiming and the last
/// claim started `since_claim` ago: when none is busy (then one quiet worker polls for all), or
/// when the busy ones' batches have run `poll_interval` (a slow destination: what arrives
/// meanwhile goes out beside them, not after them). A busy worker with quick batches claims
/// again at once and takes what came meanwhile; it wakes the others when that fills a batch.
pub(super) fn quiet_worker_polls(
    busy: usize,
    since_claim: Duration,
    poll_interval: Duration,
) -> bool {
    busy == 0 || since_claim >= poll_interval
}

/// Most events one replay step reads: a replay's events go out in steps, and a live event
/// arriving during one competes with it for the machine; short steps keep that wait short.
const REPLAY_STEP: i64 = 250;

/// Fewest events per replay step, however low its rate.
const REPLAY_STEP_MIN: i64 = 10;

/// How much of a second one step of a replay with a rate holds: its rate's worth of 50 ms, so
/// that it goes out smoothly, twenty small steps a second, rather than in bursts.
const REPLAY_STEP_SECONDS: f64 = 0.05;

/// The size of a replay's steps, from its own rate (events/s; `None`: none).
pub(super) fn replay_step(per_second: Option<f64>) -> i64 {
    match per_second {
        Some(rate) => ((rate * REPLAY_STEP_SECONDS) as i64).clamp(REPLAY_STEP_MIN, REPLAY_STEP),
        None => REPLAY_STEP,
    }
}

/// The replay loop's rest after steps that took `took`. With no rate of its own a replay would
/// take all the time the machine gives it, out of the live events': the loop rests as long as
/// its steps took, so that replays work at most half the time. Replays that all have a rate
/// (`limited`) are paced by it and do not rest.
pub(super) fn replay_rest(took: Duration, limited: bool) -> Duration {
    if limited {
        Duration::ZERO
    } else {
        took
    }
}

/// A loop's statement succeeded: if the database was down, say it is back (`what`: which loop).
pub(super) fn db_reachable(what: &str, db_down: &mut bool) {
    if std::mem::take(db_down) {
        info!(loop_ = what, "database reachable again, relaying");
    }
}

/// Ordered mode: the next claim's heads and followers per head, from what the last one found.
///
/// Keys to spare (every head asked for was found): follow each key only as deep as keys go, and
/// take as many heads as then fill a batch; shallow keys → up to `batch` heads, deep keys → fewer
/// heads, a few events each. Few free keys (other relays hold the rest, or there are few keys):
/// follow each one deeper to fill the batch. Many heads with few followers each keeps a batch on
/// few table pages and leaves keys for the other relays.
pub(super) fn next_sizing(
    batch: usize,
    found: (usize, usize),
    asked_heads: usize,
) -> (usize, usize) {
    let (heads_found, followers_found) = found;
    let scarce = heads_found < asked_heads;
    let followers = if scarce {
        batch.div_ceil(heads_found.max(1)).saturating_sub(1)
    } else {
        followers_found.div_ceil(heads_found.max(1))
    }
    .min(FOLLOWERS_PER_KEY);
    // At least a few heads, so that keys that show up later are found.
    let heads = (batch / (1 + followers)).clamp(8.min(batch), batch);
    // With keys to spare, followers beyond what the batch carries would be locked and then
    // left unpublished.
    let followers = if scarce {
        followers
    } else {
        followers.min((batch / heads).saturating_sub(1))
    };
    (heads, followers)
}

/// The heads window after a claim that found no head (`wider`), or one that found some: fourfold
/// wider up to the whole due range, or a quarter narrower down to `base`.
pub(super) fn next_window(window: u64, base: u64, found_heads: bool) -> u64 {
    if found_heads {
        // Slowly: a window widened past a long run of held-back rows is still needed.
        (window - window / 4).max(base)
    } else {
        window.saturating_mul(4).min(WINDOW_UNBOUNDED_FROM)
    }
}

/// How many due pairs the retry scheduler claims for a lane: as many as it can start soon — four rounds of
/// its free places under `concurrency` — and at most a batch. Claiming more only leases pairs that
/// would wait for the lane and then be released. While the claim loops carry fresh events
/// (`fresh`), one round: a backlog then goes in smaller steps, each resting after it
/// ([`backlog_rest`]), so a fresh event meets a short batch of it, not a long one.
pub(super) fn retry_claim(
    batch: usize,
    concurrency: usize,
    in_flight: usize,
    fresh: bool,
) -> usize {
    let free = concurrency.saturating_sub(in_flight).max(1);
    let rounds = if fresh { 1 } else { 4 };
    free.saturating_mul(rounds).min(batch).max(1)
}

/// The longest a lane with a backlog rests between its batches of pairs ([`backlog_rest`]).
const MAX_BACKLOG_REST: Duration = Duration::from_secs(1);

/// How many times as long as its batch took a lane with a backlog rests ([`backlog_rest`]).
const BACKLOG_REST_FACTOR: u32 = 3;

/// How long a lane's batch of pairs, which took `took`, keeps the lane from its next claim. A
/// lane that claimed all it could (`claimed` of `most`: more are due, a backlog) while the claim
/// loops carry fresh events (`fresh`) rests [`BACKLOG_REST_FACTOR`] times as long as its batch
/// took, at most [`MAX_BACKLOG_REST`]: a destination back from an outage with a million pairs
/// works a quarter of the time, and the fresh events of every other destination keep the rest of
/// the machine (`bench fairness`: the healthy p99 beside such a backlog 14.4 – 14.7 ms, against
/// 15.5 – 24.7 ms resting as long as the batch took and 18.6 – 29.1 ms not resting). With no fresh
/// events, or fewer pairs due than a claim, no rest: the backlog drains at full speed.
pub(super) fn backlog_rest(claimed: usize, most: usize, took: Duration, fresh: bool) -> Duration {
    if fresh && claimed >= most {
        (took * BACKLOG_REST_FACTOR).min(MAX_BACKLOG_REST)
    } else {
        Duration::ZERO
    }
}

/// The ordered claim's sizing, adapted after each claim by any claim loop of the relay.
#[derive(Debug)]
pub(super) struct Sizing {
    heads: AtomicUsize,
    followers: AtomicUsize,
    window: AtomicU64,
    base: u64,
    /// When the window last changed or last served a claim (see [`WINDOW_PATIENCE`]).
    since: Mutex<Instant>,
}

impl Sizing {
    /// The first claim's sizing for `batch_size`.
    pub(super) fn new(batch_size: usize) -> Self {
        let base = (batch_size as u64).saturating_mul(WINDOW_PER_BATCH_ROW);
        Self {
            heads: AtomicUsize::new((batch_size / (1 + INITIAL_FOLLOWERS)).max(1)),
            followers: AtomicUsize::new(INITIAL_FOLLOWERS),
            window: AtomicU64::new(base),
            base,
            since: Mutex::new(Instant::now()),
        }
    }

    /// `claim` with the current heads, followers and window.
    pub(super) fn options(&self, claim: &ClaimOptions) -> ClaimOptions {
        ClaimOptions {
            heads: self.heads.load(AtomicOrdering::Relaxed),
            followers: self.followers.load(AtomicOrdering::Relaxed),
            window: self.window.load(AtomicOrdering::Relaxed),
            ..*claim
        }
    }

    /// The whole due range for the next claim (`relay --once` checks it before it ends).
    pub(super) fn unbounded(&self) {
        self.window
            .store(WINDOW_UNBOUNDED_FROM, AtomicOrdering::Relaxed);
    }

    /// Adapts to what a claim found (`None` or no head: nothing), asked with `asked` (heads,
    /// followers). No head found: the window's rows are all held by other relays (a short wait
    /// frees them) or wait behind failing events of their keys; once that has lasted
    /// [`WINDOW_PATIENCE`], each empty claim widens the window.
    pub(super) fn adapt(&self, found: Option<(i64, i64)>, asked: (usize, usize), batch: usize) {
        let mut since = self.since.lock().unwrap_or_else(|e| e.into_inner());
        let found = found.filter(|(heads, _)| *heads > 0);
        let window = self.window.load(AtomicOrdering::Relaxed);
        let Some((heads, followers)) = found else {
            if since.elapsed() >= WINDOW_PATIENCE {
                self.window.store(
                    next_window(window, self.base, false),
                    AtomicOrdering::Relaxed,
                );
                *since = Instant::now();
            }
            return;
        };
        self.window.store(
            next_window(window, self.base, true),
            AtomicOrdering::Relaxed,
        );
        *since = Instant::now();
        let found = (
            usize::try_from(heads).unwrap_or(0),
            usize::try_from(followers).unwrap_or(0),
        );
        let (heads, followers) = next_sizing(batch, found, asked.0);
        self.heads.store(heads, AtomicOrdering::Relaxed);
        self.followers.store(followers, AtomicOrdering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_waits_double_and_a_busy_claim_resets_them() {
        let mut p = Pacing::between(Duration::from_millis(1), Duration::from_millis(25));
        let waits: Vec<u64> = (0..7).map(|_| p.idle().as_millis() as u64).collect();
        assert_eq!(waits, vec![1, 2, 4, 8, 16, 25, 25]);
        p.busy();
        assert_eq!(p.idle(), Duration::from_millis(1));
        let failures: Vec<u64> = (0..8).map(|_| p.failed().as_millis() as u64).collect();
        assert_eq!(failures, vec![100, 200, 400, 800, 1600, 3200, 5000, 5000]);
    }

    #[test]
    fn a_partial_batch_waits_as_long_as_it_took_up_to_batch_wait() {
        let settings = RelayConfig {
            batch_wait: Duration::from_millis(4),
            ..RelayConfig::default()
        };
        let ms = Duration::from_millis;
        let mut p = Pacing::new(&settings);
        // (found, batch, took) → pause
        let cases = [
            ((500, 500, ms(9)), ms(0)),
            ((12, 500, ms(1)), ms(1)),
            ((12, 500, ms(3)), ms(3)),
            ((12, 500, ms(30)), ms(4)),
            ((0, 500, ms(30)), ms(4)),
        ];
        for ((found, batch, took), pause) in cases {
            assert_eq!(
                p.after_batch(found, batch, took),
                pause,
                "{found}/{batch} in {took:?}"
            );
        }
        assert_eq!(
            p.idle(),
            settings.min_poll_interval,
            "work found: the idle wait starts short"
        );
        let mut at_once = Pacing::new(&RelayConfig::default());
        assert_eq!(at_once.after_batch(1, 500, ms(30)), Duration::ZERO);
    }

    /// (batch, heads found, followers found, heads asked) → (heads, followers) of the next claim.
    #[test]
    fn ordered_claim_sizing_table() {
        let cases = [
            // Shallow keys, all heads found: many heads, few followers.
            ((500, (62, 62), 62), (250, 1)),
            // Every key one event deep: as many heads as a batch.
            ((500, (62, 0), 62), (500, 0)),
            // Deep keys, all found: follow them as deep as they go, fill the batch.
            ((500, (62, 434), 62), (62, 7)),
            // Few free keys (scarce): follow each deeper, up to 100.
            ((500, (10, 70), 62), (10, 49)),
            ((500, (2, 14), 62), (8, 100)),
        ];
        for ((batch, found, asked), expected) in cases {
            assert_eq!(
                next_sizing(batch, found, asked),
                expected,
                "{batch} {found:?} {asked}"
            );
        }
    }

    #[test]
    fn the_heads_window_widens_fourfold_and_narrows_by_a_quarter() {
        assert_eq!(next_window(2000, 2000, false), 8000);
        assert_eq!(next_window(8000, 2000, true), 6000);
        assert_eq!(next_window(2100, 2000, true), 2000);
        assert_eq!(
            next_window(WINDOW_UNBOUNDED_FROM, 2000, false),
            WINDOW_UNBOUNDED_FROM
        );
    }

    /// A replay's rate (events/s) → its steps' size.
    #[test]
    fn replay_step_table() {
        let cases = [
            (None, 250),
            (Some(1_000_000.0), 250),
            (Some(1000.0), 50),
            (Some(200.0), 10),
            (Some(1.0), 10),
        ];
        for (rate, step) in cases {
            assert_eq!(replay_step(rate), step, "{rate:?}");
        }
        let ms = Duration::from_millis;
        assert_eq!(replay_rest(ms(40), false), ms(40));
        assert_eq!(replay_rest(ms(40), true), ms(0));
    }

    /// (found, batch, ordered) → whether the quiet workers are woken.
    #[test]
    fn only_a_backlog_wakes_the_quiet_workers() {
        let cases = [
            ((500, 500, false), true),
            ((499, 500, false), false),
            ((1, 500, false), false),
            ((0, 500, false), false),
            ((1, 500, true), true),
            ((0, 500, true), false),
        ];
        for ((found, batch, ordered), wakes) in cases {
            assert_eq!(
                wakes_quiet_workers(found, batch, ordered),
                wakes,
                "{found}/{batch}, ordered {ordered}"
            );
        }
        let ms = Duration::from_millis;
        // (busy workers, since the last claim started) → whether a quiet worker polls.
        let polls = [
            ((0, ms(0)), true),
            ((1, ms(3)), false),
            ((2, ms(24)), false),
            ((1, ms(25)), true),
            ((1, ms(500)), true),
        ];
        for ((busy, since), expected) in polls {
            assert_eq!(
                quiet_worker_polls(busy, since, ms(25)),
                expected,
                "{busy} busy, {since:?}"
            );
        }
    }

    #[test]
    fn a_backlog_rests_between_its_batches_while_fresh_events_flow() {
        let ms = Duration::from_millis;
        // (claimed, most, took, fresh) → rest
        let cases = [
            ((100, 100, ms(80), true), ms(240)),
            ((100, 100, ms(80), false), Duration::ZERO),
            ((99, 100, ms(80), true), Duration::ZERO),
            ((500, 100, ms(80), true), ms(240)),
            ((100, 100, ms(5_000), true), MAX_BACKLOG_REST),
        ];
        for ((claimed, most, took, fresh), expected) in cases {
            assert_eq!(
                backlog_rest(claimed, most, took, fresh),
                expected,
                "{claimed} of {most}, {took:?}, fresh {fresh}"
            );
        }
    }

    /// (batch, concurrency, in flight, fresh) → pairs claimed.
    #[test]
    fn retry_claim_table() {
        let cases = [
            ((500, 10, 0, false), 40),
            ((500, 10, 10, false), 4),
            ((500, 64, 0, false), 256),
            ((500, usize::MAX, 0, false), 500),
            ((20, 64, 3, false), 20),
            ((500, 64, 0, true), 64),
            ((500, 10, 10, true), 1),
            ((500, usize::MAX, 0, true), 500),
        ];
        for ((batch, concurrency, in_flight, fresh), expected) in cases {
            assert_eq!(
                retry_claim(batch, concurrency, in_flight, fresh),
                expected,
                "{batch} {concurrency} {in_flight} {fresh}"
            );
        }
    }
}
