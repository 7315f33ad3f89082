//! The flags of `bench steady`, the sizes of `bench quick`'s run, and the combinations refused
//! before a scratch database is made.

use std::time::Duration;

use crate::producer::Statement;
use crate::scratch::Source;

/// Arguments of `bench steady`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Target commits per second, all producers together.
    #[arg(long, default_value_t = 3000)]
    pub(super) rate: u64,
    /// Producer connections.
    #[arg(long, default_value_t = 8)]
    pub(super) producers: usize,
    /// How long producers run.
    #[arg(long, default_value = "20s", value_parser = pgoutbox::config::parse_duration)]
    pub(super) duration: Duration,
    /// Producer connections for the producer-cost measurement (0 skips it).
    #[arg(long, default_value_t = 32)]
    pub(super) cost_connections: usize,
    /// Where the relays of the producer-cost runs deliver: the webhook receiver in this process
    /// (its CPU is taken from the same cores), or the null sink (the relay's own cost only).
    #[arg(long, default_value = "webhook", value_parser = ["webhook", "null"])]
    pub(super) cost_sink: String,
    /// How long each producer-cost run lasts.
    #[arg(long, default_value = "10s", value_parser = pgoutbox::config::parse_duration)]
    pub(super) cost_duration: Duration,
    /// Pairs of (minimal table, pgoutbox table) runs for the schema cost, and rounds of the
    /// producer-cost settings (no relay, relays, trigger); medians of the ratios are reported.
    #[arg(long, default_value_t = 3)]
    pub(super) cost_pairs: usize,
    /// How long the idle relay's CPU is measured (0s skips it).
    #[arg(long, default_value = "60s", value_parser = pgoutbox::config::parse_duration)]
    pub(super) idle: Duration,
    /// `relay.synchronous_commit` of the measured relay (on: every settle waits for the disk).
    #[arg(long, default_value = "on", value_parser = ["on", "off"])]
    pub(super) relay_synchronous_commit: String,
    /// `relay.poll_interval` of the measured relay (its default when absent).
    #[arg(long)]
    pub(super) relay_poll_interval: Option<String>,
    /// `relay.batch_wait` of the measured relay and of the adaptive-polling producer-cost run (its
    /// default when absent).
    #[arg(long)]
    pub(super) relay_batch_wait: Option<String>,
    /// `wal.batch_wait` of the measured relay with --source wal (its default when absent).
    #[arg(long)]
    pub(super) wal_batch_wait: Option<String>,
    /// Print the per-second timeline (p99 and max of each second).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub(super) timeline: bool,
    /// Where the relay takes events from: claimed from the table (poll), or read from a logical
    /// replication slot (wal: needs wal_level = logical; the slot is created in the scratch
    /// database before the relay starts).
    #[arg(long, value_enum, default_value_t = Source::Poll)]
    pub(super) source: Source,
    /// What the producers write: a plain INSERT, or `SELECT outbox_emit(...)` (a logical decoding
    /// message and no row, which only the WAL relay reads: --source wal only).
    #[arg(long, value_enum, default_value_t = Statement::Insert)]
    pub(super) producer: Statement,
}

impl Args {
    /// Small sizes for `bench quick`.
    pub fn quick() -> Self {
        Self {
            rate: 1000,
            producers: 8,
            duration: Duration::from_secs(5),
            cost_connections: 32,
            cost_duration: Duration::from_secs(3),
            cost_sink: "webhook".into(),
            cost_pairs: 1,
            idle: Duration::from_secs(5),
            relay_synchronous_commit: "on".into(),
            relay_poll_interval: None,
            relay_batch_wait: None,
            wal_batch_wait: None,
            timeline: false,
            source: Source::Poll,
            producer: Statement::Insert,
        }
    }

    /// Refuses combinations that cannot run.
    pub fn validate(&self) -> anyhow::Result<()> {
        if self.producer == Statement::Emit && self.source == Source::Poll {
            anyhow::bail!(
                "--producer emit needs --source wal: outbox_emit() writes a logical decoding \
                 message and no row, so a polling relay would never see those events"
            );
        }
        Ok(())
    }

    /// What the run measures, at the head of its rows: nothing for the polling relay and plain
    /// INSERTs (the historical variant names), else the source and the producers' statement.
    pub(super) fn label(&self) -> String {
        match (self.source, self.producer) {
            (Source::Poll, Statement::Insert) => String::new(),
            (source, Statement::Insert) => format!("{}, ", source.as_str()),
            (source, Statement::Emit) => format!("{}, emit(), ", source.as_str()),
            (source, Statement::InsertKeyed) => format!("{}, keyed, ", source.as_str()),
        }
    }
}
