//! The claim watermark: where claims and the idle poll start their walk of the pending index.
//!
//! A claim walks the pending index in due order from its first entry. Normally the entries of
//! settled rows are gone (vacuum, or marked dead by the first scan that meets them), but while a
//! long transaction holds back vacuum (a report, a forgotten `BEGIN`, a replica with
//! `hot_standby_feedback`) they stay, still visible to it, and each claim steps over every row
//! settled since it began: millions after a few minutes. So a relay keeps a watermark, a margin
//! below the oldest pending row (OutboxWatermark), and claims start there.
//!
//! Two reads keep it. A *full* read walks the index from its first entry: it is what finds rows
//! that appeared below the watermark (the only ones that can are rows a transaction that was open
//! at the read commits with an older due time: an insert's is its transaction's start, and the
//! margin covers short ones). A *short* read walks from the current watermark only, and moves it
//! up as rows are settled. Short reads come every second; full reads as often, unless they are slow
//! (the very situation the watermark is for): then at most one part in [`SHARE`] of the time. A
//! watermark not renewed for a few rounds (the reads fail) is not used: claims then start at the
//! first entry again.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};

use crate::error::Result;
use crate::store::{outbox, Store};

/// How far below the oldest pending row a watermark is: covers producer transactions this short.
/// A longer one's rows wait for the next full read.
pub const MARGIN: Duration = Duration::from_secs(1);

/// The time between two reads of the watermark.
pub const EVERY: Duration = Duration::from_secs(1);

/// A full read takes at most one part in this many of the time until the next one.
pub const SHARE: u32 = 20;

/// A watermark is not used once this many reads in a row have failed.
pub const STALE_AFTER_ROUNDS: u32 = 3;

/// When the next full read may start, after one that started at `started` and took `took`.
pub fn next_full(started: Instant, took: Duration) -> Instant {
    started + EVERY.max(took.saturating_mul(SHARE))
}

/// What the next read walks from: `None` for a full read, else the watermark it moves up.
pub fn read_from(state: Option<&State>, now: Instant) -> Option<DateTime<Utc>> {
    state
        .filter(|s| now < s.full_due && now < s.usable_until)
        .map(|s| s.at)
}

/// The watermark as last read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct State {
    /// Where claims start.
    pub at: DateTime<Utc>,
    /// Claims stop using it then (no read since).
    pub usable_until: Instant,
    /// When the next read is a full one.
    pub full_due: Instant,
}

/// The relay's current watermark, shared by its claim workers and its idle poll.
#[derive(Debug, Default)]
pub struct Watermark {
    state: Mutex<Option<State>>,
}

impl Watermark {
    /// The watermark to claim from at `now`; `None` (from the first entry) before the first read or
    /// once the last one is stale.
    pub fn current(&self, now: Instant) -> Option<DateTime<Utc>> {
        let state = *self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.filter(|s| now < s.usable_until).map(|s| s.at)
    }

    /// The state now, to decide the next read.
    pub fn state(&self) -> Option<State> {
        *self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records a read that walked from `from` (`None`: full), started at `started`, took `took`
    /// and found `at`.
    pub fn record(
        &self,
        from: Option<DateTime<Utc>>,
        at: DateTime<Utc>,
        started: Instant,
        took: Duration,
    ) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let full_due = match (from, *state) {
            (None, _) | (_, None) => next_full(started, took),
            (Some(_), Some(s)) => s.full_due,
        };
        *state = Some(State {
            at,
            usable_until: started + (took + EVERY).saturating_mul(STALE_AFTER_ROUNDS),
            full_due,
        });
    }

    /// One read (OutboxWatermark), full or short as [`read_from`] decides, recorded.
    pub async fn refresh(&self, store: &Store) -> Result<()> {
        let started = Instant::now();
        let from = read_from(self.state().as_ref(), started);
        let at = outbox::watermark(store, from, MARGIN).await?;
        self.record(from, at, started, started.elapsed());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slow_full_reads_are_spaced_out() {
        let start = Instant::now();
        let cases = [
            (Duration::ZERO, EVERY),
            (Duration::from_millis(20), EVERY),
            (Duration::from_millis(50), EVERY),
            (Duration::from_millis(400), Duration::from_secs(8)),
            (Duration::from_secs(3), Duration::from_secs(60)),
        ];
        for (took, wait) in cases {
            assert_eq!(next_full(start, took), start + wait, "took {took:?}");
        }
    }

    #[test]
    fn reads_are_full_until_due_then_short_from_the_watermark() {
        let mark = Watermark::default();
        let start = Instant::now();
        assert_eq!(read_from(mark.state().as_ref(), start), None, "first: full");
        let at = Utc::now();
        mark.record(None, at, start, Duration::from_millis(400));
        let state = mark.state().expect("recorded");
        assert_eq!(state.full_due, start + Duration::from_secs(8));
        let later = start + Duration::from_secs(2);
        assert_eq!(read_from(Some(&state), later), Some(at), "short, from it");
        let moved = at + chrono::Duration::seconds(2);
        mark.record(Some(at), moved, later, Duration::from_millis(5));
        let state = mark.state().expect("recorded");
        assert_eq!(state.full_due, start + Duration::from_secs(8), "kept");
        assert_eq!(
            read_from(Some(&state), start + Duration::from_secs(8)),
            None
        );
    }

    #[test]
    fn a_watermark_is_used_until_it_is_stale() {
        let mark = Watermark::default();
        let start = Instant::now();
        assert_eq!(
            mark.current(start),
            None,
            "no read yet: from the first entry"
        );
        let at = Utc::now();
        mark.record(None, at, start, Duration::from_millis(10));
        assert_eq!(mark.current(start + EVERY), Some(at));
        let stale = start + (Duration::from_millis(10) + EVERY) * STALE_AFTER_ROUNDS;
        assert_eq!(mark.current(stale - Duration::from_millis(1)), Some(at));
        assert_eq!(mark.current(stale), None, "no new read for three rounds");
        let state = mark.state().expect("recorded");
        assert_eq!(read_from(Some(&state), stale), None, "stale: full");
    }
}
