//! `[wal]`: the replication slot and publication of `source = "wal"`.

use std::time::Duration;

use serde::Deserialize;

use super::duration::duration_str;
use crate::table::OutboxTable;

/// `[wal]`: logical replication settings, used when `source = "wal"`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WalConfig {
    /// The replication slot (default `pgoutbox_<table>`); `pgoutbox slot create` makes it.
    pub slot: Option<String>,
    /// The publication of the outbox table's inserts (default `pgoutbox_<table>`).
    pub publication: Option<String>,
    /// How often a quiet relay writes a heartbeat into the WAL, so that its slot moves on when
    /// the outbox sees no writes (other tables' writes would otherwise pin WAL behind it).
    #[serde(with = "duration_str")]
    pub heartbeat_interval: Duration,
    /// How often the confirmed position is reported to the server.
    #[serde(with = "duration_str")]
    pub status_interval: Duration,
    /// How often a standby relay (the slot is held by another) tries to take the slot over.
    #[serde(with = "duration_str")]
    pub standby_retry: Duration,
    /// How long a batch waits for more transactions after its first one, unless it is full:
    /// fewer, larger batches (one settle transaction each) for a little latency. "0s" publishes
    /// each transaction as soon as it is read.
    #[serde(with = "duration_str")]
    pub batch_wait: Duration,
    /// How long the rows of delivered events wait to be deleted (or marked published) together
    /// with later batches' rows: one statement for many batches. The slot is confirmed past an
    /// event only once its row is written, so a longer wait only means more to read again after
    /// a crash; "0s" writes each batch's rows as soon as it is settled.
    #[serde(with = "duration_str")]
    pub settle_wait: Duration,
}

impl Default for WalConfig {
    fn default() -> Self {
        Self {
            slot: None,
            publication: None,
            heartbeat_interval: Duration::from_secs(10),
            status_interval: Duration::from_secs(1),
            standby_retry: Duration::from_secs(2),
            batch_wait: Duration::from_millis(2),
            settle_wait: Duration::from_millis(50),
        }
    }
}

impl WalConfig {
    /// The slot's name: configured, or `pgoutbox_<table>`.
    pub fn slot_name(&self, table: &OutboxTable) -> String {
        self.slot
            .clone()
            .unwrap_or_else(|| format!("pgoutbox_{}", table.table().as_str()))
    }

    /// The publication's name: configured, or `pgoutbox_<table>`.
    pub fn publication_name(&self, table: &OutboxTable) -> String {
        self.publication
            .clone()
            .unwrap_or_else(|| format!("pgoutbox_{}", table.table().as_str()))
    }
}
