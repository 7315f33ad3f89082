//! What settling batches did, counted: one batch's report, or many summed; and the rows WAL
//! batches delivered everywhere, gathered to be written together.

use std::collections::BTreeMap;

use uuid::Uuid;

/// Counts for one batch, or summed over many.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct BatchReport {
    /// Events claimed.
    pub claimed: usize,
    /// Events delivered and settled.
    pub delivered: usize,
    /// Events scheduled for another attempt.
    pub retried: usize,
    /// Events dead-lettered.
    pub dead: usize,
    /// Events held for a paused or failing destination (no attempt counted).
    pub held: usize,
    /// Settles refused because another relay took the lease over (lease mode).
    pub fenced: u64,
    /// Events given back unpublished because the shutdown grace period ran out.
    pub released: usize,
}

impl std::ops::AddAssign for BatchReport {
    fn add_assign(&mut self, o: Self) {
        self.claimed += o.claimed;
        self.delivered += o.delivered;
        self.retried += o.retried;
        self.dead += o.dead;
        self.held += o.held;
        self.fenced += o.fenced;
        self.released += o.released;
    }
}

/// Rows that WAL batches delivered everywhere, per destination, gathered from several batches to
/// be deleted (or marked published) in one statement per destination: a slot's events each cost
/// one row write instead of one settle transaction per batch (see the WAL source's confirmer).
#[derive(Debug, Default, Clone, PartialEq)]
pub struct DeliveredRows(pub BTreeMap<String, Vec<Uuid>>);

impl DeliveredRows {
    /// How many rows.
    pub fn len(&self) -> usize {
        self.0.values().map(Vec::len).sum()
    }

    /// No rows.
    pub fn is_empty(&self) -> bool {
        self.0.values().all(Vec::is_empty)
    }

    /// Adds `other`'s rows.
    pub fn append(&mut self, other: DeliveredRows) {
        for (destination, mut ids) in other.0 {
            self.0.entry(destination).or_default().append(&mut ids);
        }
    }
}
