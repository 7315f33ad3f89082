//! The `null` sink: accepts every event and drops it (benchmarks, tests).

use async_trait::async_trait;

use std::sync::Arc;

use super::{Sink, SinkKind};
use crate::model::event::OutboxEvent;
use crate::model::outcome::Outcome;

/// Delivers everything instantly, nowhere.
#[derive(Debug, Default)]
pub struct NullSink;

#[async_trait]
impl Sink for NullSink {
    async fn publish(&self, events: &[&OutboxEvent]) -> Vec<Outcome> {
        vec![Outcome::Delivered; events.len()]
    }
}

/// Registry entry: `type = "null"`, no settings.
pub const KIND: SinkKind = SinkKind {
    name: "null",
    build: |_, settings| {
        crate::config::sink_settings::<crate::config::NoSettings>(settings)?;
        Ok(Arc::new(NullSink))
    },
};
