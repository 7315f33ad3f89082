//! What settling batches did, counted: one batch's report, or many summed.

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
