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
    /// Readiness fails when the slot holds back more WAL than this (`"1GB"`, `"512MB"`, or bytes):
    /// the relay is not keeping up, or not confirming. No bound by default.
    #[serde(deserialize_with = "size::deserialize")]
    pub max_slot_lag: Option<u64>,
}

/// Sizes as PostgreSQL writes them: bytes, or a number with `B`, `kB`, `MB`, `GB`, `TB`
/// (multiples of 1024).
mod size {
    use serde::{Deserialize, Deserializer};

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Raw {
        Bytes(u64),
        Text(String),
    }

    /// Parses `"512MB"` and the like; `None` when it is not a size.
    pub(super) fn parse(text: &str) -> Option<u64> {
        let text = text.trim();
        let split = text
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(text.len());
        let (number, unit) = text.split_at(split);
        let n: u64 = number.parse().ok()?;
        let shift = match unit.trim() {
            "" | "B" => 0,
            "kB" | "KB" => 10,
            "MB" => 20,
            "GB" => 30,
            "TB" => 40,
            _ => return None,
        };
        n.checked_mul(1 << shift)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
        match Raw::deserialize(d)? {
            Raw::Bytes(n) => Ok(Some(n)),
            Raw::Text(s) => parse(&s).map(Some).ok_or_else(|| {
                serde::de::Error::custom(format!(
                    "invalid size {s:?}; write e.g. \"1GB\", \"512MB\" or a number of bytes"
                ))
            }),
        }
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn sizes_parse_as_postgresql_writes_them() {
            for (text, bytes) in [
                ("0", Some(0)),
                ("100", Some(100)),
                ("64kB", Some(65_536)),
                ("512MB", Some(512 << 20)),
                ("1 GB", Some(1 << 30)),
                ("2TB", Some(2 << 40)),
                ("1.5GB", None),
                ("GB", None),
                ("10 parsecs", None),
                ("99999999999999999999TB", None),
            ] {
                assert_eq!(super::parse(text), bytes, "{text}");
            }
        }
    }
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
            max_slot_lag: None,
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
