//! `[relay]` and the choices of how the relay takes and keeps events: the claim loop's tuning,
//! the source (table or WAL) and where published events are kept.

use std::time::Duration;

use serde::Deserialize;

use super::duration::{duration_str, opt_duration_str};

/// Where published events are kept until `retention` is over (with `retention` above zero).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum History {
    /// Marked published in the outbox table; cleanup deletes them row by row (vacuum reclaims).
    #[default]
    Outbox,
    /// Moved at settle to `<table>_history`, partitioned by publish time; cleanup drops whole
    /// partitions, so neither table bloats (see [`crate::store::history`]).
    Partitions,
}

/// Where the relay takes events from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    /// Claim pending rows from the outbox table (`FOR UPDATE SKIP LOCKED`): works everywhere.
    #[default]
    Poll,
    /// Read inserted rows and `outbox_emit` messages from a logical replication slot, in commit
    /// order (see [`crate::sources::wal`]).
    Wal,
}

/// How the relay holds claimed rows while it publishes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ClaimMode {
    /// Rows stay locked by the claiming transaction until settled (fast brokers).
    Transaction,
    /// Rows are leased (expiry + fencing token); no transaction is open while publishing.
    Lease,
}

/// `[relay]`: the claim loop's tuning.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RelayConfig {
    /// Most rows claimed per batch.
    pub batch_size: usize,
    /// Concurrent claim loops per relay process (a backlog is claimed by all, a trickle by one);
    /// with `source = "wal"`, batches in flight at once (one when a destination is ordered by key).
    pub workers: usize,
    /// The longest an idle relay waits before it looks for due rows again.
    #[serde(with = "duration_str")]
    pub poll_interval: Duration,
    /// The first wait after an empty claim; it doubles on each empty claim up to `poll_interval`.
    /// Set it equal to `poll_interval` for fixed-interval polling.
    #[serde(with = "duration_str")]
    pub min_poll_interval: Duration,
    /// After a claim that did not fill its batch, the longest the claim loop lets events gather
    /// before it claims again: as long as that batch took, up to this. Fewer, larger batches
    /// (each claim and settle costs the database about as much for one event as for hundreds)
    /// for at most this much latency, and only as much as the database's own pace: a quick batch
    /// waits little. "0s" claims again at once. A full batch is followed by the next claim at
    /// once, whatever this says.
    #[serde(with = "duration_str")]
    pub batch_wait: Duration,
    /// Readiness fails (and `pgoutbox_relay_stalled` is 1) when events have been due longer than
    /// this and this relay has neither claimed nor settled any for as long; with `source =
    /// "wal"`, when events read this long ago still wait for the slot's confirmed position.
    #[serde(with = "duration_str")]
    pub stall_after: Duration,
    /// Upper bound for publishing one batch; a row lock or lease is never held on the network longer.
    #[serde(with = "duration_str")]
    pub publish_timeout: Duration,
    /// `transaction` (default) or `lease`.
    pub claim: ClaimMode,
    /// After SIGTERM, how long in-flight batches may take before they are released unsettled.
    #[serde(with = "duration_str")]
    pub shutdown_grace: Duration,
    /// Lease mode: how long a claim lasts (default: twice `publish_timeout`).
    #[serde(with = "opt_duration_str")]
    pub lease: Option<Duration>,
    /// `synchronous_commit` of the relay's own sessions (claims, settles, cleanup); producers keep
    /// theirs. See [`SettleCommit`].
    pub synchronous_commit: SettleCommit,
}

/// Whether the relay's commits wait for the WAL flush.
///
/// `on` (default): every settle is durable before the next claim. `off`: a settle returns as soon
/// as it is in the WAL buffers, so no claim loop waits on the disk (on a slow disk; measured here
/// it made no difference, docs/performance.md, "Tail"). Safe for
/// at-least-once: producers' commits stay synchronous, so no event is lost; only if the
/// *database server* crashes can the last settles (at most about three `wal_writer_delay`s, 600
/// ms by default) be lost, and those events are delivered again, as after a relay crash.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SettleCommit {
    /// Wait for the WAL flush (the default, as PostgreSQL's).
    On,
    /// Do not wait.
    Off,
}

impl SettleCommit {
    /// The setting's value for PostgreSQL.
    pub fn as_setting(self) -> &'static str {
        match self {
            Self::On => "on",
            Self::Off => "off",
        }
    }
}

impl RelayConfig {
    /// The lease length in force.
    pub fn lease(&self) -> Duration {
        self.lease.unwrap_or(self.publish_timeout * 2)
    }
}

impl Default for RelayConfig {
    fn default() -> Self {
        Self {
            batch_size: 500,
            workers: 2,
            poll_interval: Duration::from_millis(25),
            min_poll_interval: Duration::from_millis(1),
            batch_wait: Duration::ZERO,
            stall_after: Duration::from_secs(60),
            publish_timeout: Duration::from_secs(30),
            claim: ClaimMode::Transaction,
            shutdown_grace: Duration::from_secs(10),
            lease: None,
            synchronous_commit: SettleCommit::On,
        }
    }
}
