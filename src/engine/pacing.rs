//! Pacing: how long a loop waits before its next claim, and how an ordered claim is sized.

use std::sync::atomic::Ordering as AtomicOrdering;
use std::time::{Duration, Instant};

use tracing::info;

use super::Relay;
use crate::config::RelayConfig;

/// Ordered mode: followers per head of the first claim (adapted from then on).
pub(super) const INITIAL_FOLLOWERS: usize = 7;

/// Ordered mode: heads of the first claim, so that they and their followers fill a batch.
pub(super) fn initial_heads(batch_size: usize) -> usize {
    (batch_size / (1 + INITIAL_FOLLOWERS)).max(1)
}

/// How long ordered claims may find no head before the window widens: other relays' batches
/// usually end well within it, freeing their keys near the front.
pub(super) const WINDOW_PATIENCE: Duration = Duration::from_secs(1);

/// The heads window an ordered claim starts from (see [`ClaimOptions::window`]).
pub(super) fn base_window(batch_size: usize) -> u64 {
    (batch_size as u64).saturating_mul(crate::sources::poll::WINDOW_PER_BATCH_ROW)
}
/// Longest pause between retries while the database is unreachable.
pub(super) const MAX_DB_BACKOFF: Duration = Duration::from_secs(5);
/// How long a claim loop waits before its next claim.
///
/// Busy: at once. The claim is an index range scan that finds nothing quickly, so this costs little
/// and keeps latency at milliseconds. Idle: exponentially longer up to `poll_interval`, so an idle
/// relay costs a few cheap queries per second and no measurable CPU. After a database error:
/// exponentially longer up to [`MAX_DB_BACKOFF`].
pub(super) struct Pacing {
    pub(super) min: Duration,
    pub(super) max: Duration,
    pub(super) idle: Duration,
    pub(super) backoff: Duration,
}
impl Pacing {
    pub(super) const FIRST_BACKOFF: Duration = Duration::from_millis(100);

    pub(super) fn new(settings: &RelayConfig) -> Self {
        Self {
            min: settings.min_poll_interval,
            max: settings.poll_interval,
            idle: settings.min_poll_interval,
            backoff: Self::FIRST_BACKOFF,
        }
    }

    /// A claim found work: look again at once.
    pub(super) fn busy(&mut self) {
        self.idle = self.min;
        self.backoff = Self::FIRST_BACKOFF;
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

/// A loop's statement succeeded: if the database was down, say it is back. `worker` is the claim
/// worker, `None` for the deliveries loop (whichever loop met the outage says when it is over).
pub(super) fn db_reachable(worker: Option<usize>, db_down: &mut bool) {
    if std::mem::take(db_down) {
        match worker {
            Some(worker) => info!(worker, "database reachable again, relaying"),
            None => info!("database reachable again, relaying deliveries"),
        }
    }
}

impl Relay {
    /// Ordered mode: sizes the next claim from what this one found, asked with `asked` (heads,
    /// followers per head).
    ///
    /// Keys to spare (every head asked for was found): follow each key only as deep as keys go, and
    /// take as many heads as then fill a batch; shallow keys → up to `batch_size` heads, deep keys →
    /// fewer heads, a few events each. Few free keys (other relays hold the rest, or there are few
    /// keys): follow each one deeper to fill the batch. Many heads with few followers each keeps a
    /// batch on few table pages and leaves keys for the other relays.
    ///
    /// No head found: the window's rows are all held by other relays (a short wait frees them) or
    /// wait behind failing events of their keys. Once that has lasted [`WINDOW_PATIENCE`], each
    /// empty claim widens the window fourfold, up to the whole due range, so keys further on are
    /// reached; each claim that finds heads narrows it by a quarter, down to its base.
    pub(super) fn adapt_claim(&self, found: Option<(i64, i64)>, asked: (usize, usize)) {
        let batch = self.settings.batch_size;
        let base = base_window(batch);
        let Some((heads_found, followers_found)) = found.filter(|(heads, _)| *heads > 0) else {
            let mut since = self.window_since.lock().unwrap_or_else(|e| e.into_inner());
            if since.elapsed() >= WINDOW_PATIENCE {
                let wider = self
                    .window
                    .load(AtomicOrdering::Relaxed)
                    .saturating_mul(4)
                    .min(crate::sources::poll::WINDOW_UNBOUNDED_FROM);
                self.window.store(wider, AtomicOrdering::Relaxed);
                *since = Instant::now();
            }
            return;
        };
        let window = self.window.load(AtomicOrdering::Relaxed);
        if window > base {
            // Slowly: a window widened past a long run of held-back rows is still needed.
            self.window
                .store((window - window / 4).max(base), AtomicOrdering::Relaxed);
        }
        *self.window_since.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();

        let (heads_found, followers_found) = (heads_found as usize, followers_found as usize);
        let scarce = heads_found < asked.0;
        let followers = if scarce {
            batch.div_ceil(heads_found).saturating_sub(1)
        } else {
            followers_found.div_ceil(heads_found)
        }
        .min(crate::sources::poll::FOLLOWERS_PER_KEY);
        // At least a few heads, so that keys that show up later are found.
        let heads = (batch / (1 + followers)).clamp(8.min(batch), batch);
        // With keys to spare, followers beyond what the batch carries would be locked and then
        // left unpublished.
        let followers = if scarce {
            followers
        } else {
            followers.min((batch / heads).saturating_sub(1))
        };
        self.heads.store(heads, AtomicOrdering::Relaxed);
        self.followers.store(followers, AtomicOrdering::Relaxed);
    }
}
