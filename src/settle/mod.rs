//! Settle: recording what publishing did, in at most a few statements per batch.
//!
//! [`verdict`] decides what each pair's attempt means (the one place that does); [`plan`] gathers
//! a batch's verdicts into the writes of one settle — successes per destination, every failure in
//! one statement, split events' pairs fanned out to the deliveries table in the statement that
//! settles their rows — and [`write`] writes them under the batch's claim.

pub mod plan;
pub mod report;
pub mod verdict;
pub mod write;

use crate::store::outbox::Delivered;

pub use plan::{DeliveredRows, SettlePlan};
pub use report::BatchReport;
pub use write::{apply, apply_deliveries, write_delivered, SettleReport};

/// What settling a delivered event does to its outbox row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SettleMode {
    /// Keep it in the outbox, marked published (cleanup deletes it row by row after `retention`).
    Mark,
    /// Delete it (`retention = "0s"`).
    Delete,
    /// Move it to the partitioned history (`history = "partitions"`; cleanup drops partitions).
    Move,
}

impl SettleMode {
    /// What the store does with delivered rows in this mode.
    pub fn rows(self) -> Delivered {
        match self {
            Self::Mark => Delivered::Mark,
            Self::Delete => Delivered::Delete,
            Self::Move => Delivered::Move,
        }
    }

    /// The configuration's mode: retention zero deletes, else `history` decides.
    pub fn of(config: &crate::config::Config) -> Self {
        if config.retention.is_zero() {
            Self::Delete
        } else if config.history == crate::config::History::Partitions {
            Self::Move
        } else {
            Self::Mark
        }
    }
}
