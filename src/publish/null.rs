//! The `null` sink: accepts every event and drops it (benchmarks, tests).

use async_trait::async_trait;

use super::{Outcome, Sink};
use crate::event::OutboxEvent;

/// Delivers everything instantly, nowhere.
#[derive(Debug, Default)]
pub struct NullSink;

#[async_trait]
impl Sink for NullSink {
    async fn publish(&self, events: &[&OutboxEvent]) -> Vec<Outcome> {
        vec![Outcome::Delivered; events.len()]
    }
}
