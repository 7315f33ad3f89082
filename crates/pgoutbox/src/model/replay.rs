//! A replay as plain data: which retained events it sends (its [`Selection`]), where its walk is
//! ([`Cursor`]), its progress ([`Replay`]) and what an operator may do to it ([`Change`]). The
//! store reads and writes them (`crate::store::replays`); the engine feeds replays, the CLI and
//! the console steer them.

use chrono::{DateTime, Utc};
use uuid::Uuid;

/// The header every replayed message carries: the replay's id.
pub const REPLAY_HEADER: &str = "pgoutbox-replay";

/// Which retained events a replay sends (before the destination's routing and its CEL filter,
/// which the relay applies).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Selection {
    /// Events created at or after this.
    pub since: Option<DateTime<Utc>>,
    /// Events created before this.
    pub until: Option<DateTime<Utc>>,
    /// Only these topics (empty: any).
    pub topics: Vec<String>,
    /// Only these keys (empty: any).
    pub keys: Vec<String>,
}

/// A replay to create.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NewReplay {
    /// The destination it sends to.
    pub destination: String,
    /// What it sends.
    pub selection: Selection,
    /// A CEL filter over the event (checked by the caller).
    pub filter: Option<String>,
    /// Its own rate (`"500/s"`, checked by the caller).
    pub rate: Option<String>,
    /// Whether it is the destination's `backfill` (one per destination, ever).
    pub backfill: bool,
    /// Who asks for it (the audit's `who`); the database user when `None`.
    pub created_by: Option<String>,
}

/// Where a replay's walk is: the last `(published_at, seq, id)` read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cursor {
    /// Its `published_at`.
    pub at: DateTime<Utc>,
    /// Its `seq` (0 for a row without one).
    pub seq: i64,
    /// Its id.
    pub id: Uuid,
}

/// A replay as operators see it.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Replay {
    /// Its id (what the `pgoutbox-replay` header carries).
    pub id: Uuid,
    /// The destination it sends to.
    pub destination: String,
    /// What it sends.
    pub since: Option<DateTime<Utc>>,
    /// What it sends.
    pub until: Option<DateTime<Utc>>,
    /// Its topics (empty: any).
    pub topics: Vec<String>,
    /// Its keys (empty: any).
    pub keys: Vec<String>,
    /// Its CEL filter.
    pub filter: Option<String>,
    /// Events published after this are not its to send (they were live).
    pub upto: DateTime<Utc>,
    /// Its own rate.
    pub rate: Option<String>,
    /// Whether it is a destination's `backfill`.
    pub backfill: bool,
    /// `running`, `paused`, `cancelled`, `done` or `failed`.
    pub state: String,
    /// Retained events in its range when it was created.
    pub total: i64,
    /// Events read so far.
    pub read: i64,
    /// Events queued for the destination so far (read, routed and filtered in).
    pub queued: i64,
    /// Queued events not delivered yet.
    pub pending: i64,
    /// Queued events dead-lettered (in the dead letters, like any).
    pub dead: i64,
    /// Whether its walk reached the end of its range.
    pub walked: bool,
    /// Why it failed.
    pub error: Option<String>,
    /// Who created it.
    pub created_by: String,
    /// When.
    pub created_at: DateTime<Utc>,
    /// When it last moved.
    pub updated_at: DateTime<Utc>,
    /// When it was done or cancelled.
    pub finished_at: Option<DateTime<Utc>>,
    /// Where its walk is.
    #[serde(skip)]
    pub cursor: Cursor,
}

impl Replay {
    /// Events queued and delivered so far.
    pub fn delivered(&self) -> i64 {
        (self.queued - self.pending - self.dead).max(0)
    }

    /// Its selection.
    pub fn selection(&self) -> Selection {
        Selection {
            since: self.since,
            until: self.until,
            topics: self.topics.clone(),
            keys: self.keys.clone(),
        }
    }
}

/// An operator's change to a replay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    /// Stop queuing (what is queued still goes).
    Pause,
    /// Queue again.
    Resume,
    /// Stop for good; what is queued and undelivered is dropped.
    Cancel,
}

impl Change {
    /// What the operator does: `pause`, `resume` or `cancel` (the audit's action is
    /// `replay-<verb>`).
    pub fn verb(self) -> &'static str {
        match self {
            Self::Pause => "pause",
            Self::Resume => "resume",
            Self::Cancel => "cancel",
        }
    }

    /// What it did, for messages: `paused`, `resumed` or `cancelled`.
    pub fn done(self) -> &'static str {
        match self {
            Self::Pause => "paused",
            Self::Resume => "resumed",
            Self::Cancel => "cancelled",
        }
    }

    /// The state it leads to, and the states it leads from.
    pub fn states(self) -> (&'static str, &'static [&'static str]) {
        match self {
            Self::Pause => ("paused", &["running"]),
            Self::Resume => ("running", &["paused"]),
            Self::Cancel => ("cancelled", &["running", "paused"]),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_change_leads_from_the_states_that_allow_it() {
        for (change, to, from) in [
            (Change::Pause, "paused", &["running"][..]),
            (Change::Resume, "running", &["paused"][..]),
            (Change::Cancel, "cancelled", &["running", "paused"][..]),
        ] {
            assert_eq!(change.states(), (to, from), "{}", change.verb());
        }
    }
}
