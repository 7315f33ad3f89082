//! What every part of the engine shares: the store and configuration, the router and the lanes,
//! the settler, how claims are made, and the shutdown signals. One value, built once, that each
//! loop and each batch stage takes instead of long parameter lists.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use tokio_util::sync::CancellationToken;

use super::lane::Lanes;
use crate::config::Config;
use crate::model::metric;
use crate::route::Router;
use crate::settle::Settler;
use crate::sources::poll::ClaimOptions;
use crate::store::SettleMode;
use crate::store::Store;

/// What the engine's loops and stages share.
pub(super) struct Context {
    /// The database and its statements.
    pub(super) store: Store,
    /// The configuration the relay was built from.
    pub(super) config: Config,
    /// Which destinations take an event.
    pub(super) router: Router,
    /// One lane per destination, in the order routing names them.
    pub(super) lanes: Lanes,
    /// Writes what batches did.
    pub(super) settler: Settler,
    /// How claims are made (transaction or lease, ordered or not).
    pub(super) claim: ClaimOptions,
    /// Names of the destinations whose dead events hold back their key (ordered, `on_dead =
    /// "block"`).
    pub(super) blocking: Vec<String>,
    /// Cancelled when the shutdown grace period is over: in-flight batches are released.
    pub(super) abort: CancellationToken,
    /// Cancelled when shutdown begins: lanes stop waiting for rate-limit tokens (what they had
    /// not sent goes on later) so that in-flight batches end within the grace period.
    pub(super) stopping: CancellationToken,
    /// When this relay last claimed or settled anything (readiness sees a stall by it).
    pub(super) progress: Progress,
    /// Set when a worker died: `/healthz` reports it.
    pub(super) failure: Mutex<Option<String>>,
    /// What the destinations' sync has read of the shared state, and when.
    pub(super) synced: Synced,
    /// Woken when pairs are due now (a batch handed some over, a destination is back, a replay
    /// queued some): the retry scheduler looks at once.
    pub(super) retries_due: tokio::sync::Notify,
}

impl Context {
    /// The context of a relay of `config` around `lanes`, on `store`.
    pub(super) fn new(store: Store, config: &Config, lanes: Lanes) -> Self {
        // A relay-wide counter that may never move still shows up at zero, so dashboards and
        // alerts see it. A destination's series appear once it has something to report: a scrape
        // stays small with thousands of destinations.
        metrics::counter!(metric::DB_ERRORS_TOTAL).absolute(0);
        let blocking = lanes.blocking();
        let ordered = lanes.ordered();
        let settings = &config.relay;
        Self {
            router: Router::new(&config.destinations),
            settler: Settler::new(
                store.clone(),
                SettleMode::of(config),
                ordered.then(|| blocking.clone()),
            ),
            claim: ClaimOptions {
                mode: settings.claim,
                limit: settings.batch_size,
                lease: settings.lease(),
                ordered,
                heads: 0,
                followers: 0,
                window: 0,
            },
            blocking,
            lanes,
            store,
            config: config.clone(),
            abort: CancellationToken::new(),
            stopping: CancellationToken::new(),
            progress: Progress::default(),
            failure: Mutex::new(None),
            retries_due: tokio::sync::Notify::new(),
            synced: Synced::default(),
        }
    }

    /// Marks progress: events claimed or settled.
    pub(super) fn progressed(&self) {
        self.progress.mark();
    }

    /// Records why a worker died: `/healthz` reports it.
    pub(super) fn fail(&self, why: &str) {
        *self.failure.lock().unwrap_or_else(|e| e.into_inner()) = Some(why.to_owned());
    }

    /// Why a worker died, if one did.
    pub(super) fn failure(&self) -> Option<String> {
        self.failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

/// When the relay last made progress (claimed events or settled some), and for the WAL source
/// since when events read wait for the slot's confirmed position to move.
#[derive(Debug)]
pub(super) struct Progress {
    started: Instant,
    /// Milliseconds after `started`.
    last: AtomicU64,
    /// When a claim loop (or the WAL reader) last had fresh events, milliseconds after `started`
    /// (0: never).
    fresh: AtomicU64,
    wal_unconfirmed: std::sync::Mutex<Option<Instant>>,
}

impl Default for Progress {
    fn default() -> Self {
        Self {
            started: Instant::now(),
            last: AtomicU64::new(0),
            fresh: AtomicU64::new(0),
            wal_unconfirmed: std::sync::Mutex::new(None),
        }
    }
}

impl Progress {
    /// Something was claimed or settled just now.
    pub(super) fn mark(&self) {
        let now = self.started.elapsed().as_millis() as u64;
        self.last.fetch_max(now, Ordering::Relaxed);
    }

    /// A claim loop (or the WAL reader) has fresh events just now.
    pub(super) fn fresh(&self) {
        let now = (self.started.elapsed().as_millis() as u64).max(1);
        self.fresh.fetch_max(now, Ordering::Relaxed);
    }

    /// Whether a claim loop (or the WAL reader) had fresh events within `within`.
    pub(super) fn fresh_within(&self, within: Duration) -> bool {
        let at = self.fresh.load(Ordering::Relaxed);
        at > 0
            && self
                .started
                .elapsed()
                .saturating_sub(Duration::from_millis(at))
                < within
    }

    /// WAL source: events read wait since `since` (`None`: nothing waits).
    pub(super) fn wal_unconfirmed(&self, since: Option<Instant>) {
        if let Ok(mut w) = self.wal_unconfirmed.lock() {
            *w = since;
        }
    }

    /// WAL source: how long events read have waited for the confirmed position to move.
    pub(super) fn wal_unconfirmed_for(&self) -> Option<Duration> {
        self.wal_unconfirmed
            .lock()
            .ok()
            .and_then(|w| w.map(|since| since.elapsed()))
    }

    /// How long ago the last progress was (since start when there was none).
    pub(super) fn since(&self) -> Duration {
        let last = Duration::from_millis(self.last.load(Ordering::Relaxed));
        self.started.elapsed().saturating_sub(last)
    }
}

/// How often the destinations' sync reads every destination's state, not only the changed ones:
/// the backstop for a write that did not set `updated_at` (a hand-made UPDATE).
const FULL_SYNC_EVERY: Duration = Duration::from_secs(30);

/// How far before its last read a sync looks: a change committed a little after that read began
/// is still seen.
const SYNC_MARGIN: chrono::TimeDelta = chrono::TimeDelta::seconds(5);

/// When the destinations' shared state was last read (the server's clock), and when it was last
/// read whole (this process's).
#[derive(Debug, Default)]
pub(super) struct Synced(Mutex<(Option<DateTime<Utc>>, Option<Instant>)>);

impl Synced {
    /// The rows to read now: those changed since this time (`None`: all of them).
    pub(super) fn since(&self) -> Option<DateTime<Utc>> {
        let (read_at, whole_at) = *self.0.lock().unwrap_or_else(PoisonError::into_inner);
        read_since(read_at, whole_at.map(|at| at.elapsed()))
    }

    /// A read since `since` ended, the server's clock at `read_at` (`None`: no row came back).
    pub(super) fn read(&self, since: Option<DateTime<Utc>>, read_at: Option<DateTime<Utc>>) {
        let mut synced = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if since.is_none() {
            synced.1 = Some(Instant::now());
        }
        if read_at.is_some() {
            synced.0 = read_at;
        }
    }
}

/// The rows a sync reads: every one (`None`) on the first sync and every [`FULL_SYNC_EVERY`],
/// otherwise those changed since [`SYNC_MARGIN`] before the last read.
fn read_since(
    read_at: Option<DateTime<Utc>>,
    since_whole: Option<Duration>,
) -> Option<DateTime<Utc>> {
    match (read_at, since_whole) {
        (Some(at), Some(whole)) if whole < FULL_SYNC_EVERY => Some(at - SYNC_MARGIN),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_sync_reads_what_changed_and_everything_now_and_then() {
        let at = DateTime::<Utc>::from_timestamp(1_000_000, 0).expect("a time");
        // (last read, since the last whole read) → read since (None: every row)
        let cases = [
            ((None, None), None),
            ((None, Some(Duration::from_secs(1))), None),
            ((Some(at), None), None),
            (
                (Some(at), Some(Duration::from_secs(1))),
                Some(at - SYNC_MARGIN),
            ),
            ((Some(at), Some(Duration::from_secs(31))), None),
        ];
        for ((read_at, whole), expected) in cases {
            assert_eq!(
                read_since(read_at, whole),
                expected,
                "{read_at:?} {whole:?}"
            );
        }
    }
}
