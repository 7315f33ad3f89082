//! The `stdout` sink: one JSON line per event, for demos and piping into other tools.

use async_trait::async_trait;
use serde::Serialize;
use tokio::io::AsyncWriteExt;
use tokio::sync::Mutex;

use std::sync::Arc;

use super::{Envelope, Sink, SinkKind};
use crate::model::event::OutboxEvent;
use crate::model::outcome::Outcome;

/// Writes each event as a JSON line: the webhook envelope plus its headers.
pub struct StdoutSink {
    // Concurrent batches must not interleave their lines.
    out: Mutex<Box<dyn tokio::io::AsyncWrite + Send + Unpin>>,
}

impl Default for StdoutSink {
    fn default() -> Self {
        Self::to_writer(tokio::io::stdout())
    }
}

impl StdoutSink {
    /// The same JSON lines to any writer (a file, `/dev/null` in benchmarks).
    pub fn to_writer(out: impl tokio::io::AsyncWrite + Send + Unpin + 'static) -> Self {
        Self {
            out: Mutex::new(Box::new(out)),
        }
    }
}

#[derive(Serialize)]
struct Line<'a> {
    #[serde(flatten)]
    envelope: Envelope<'a>,
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    headers: &'a [(String, String)],
}

#[async_trait]
impl Sink for StdoutSink {
    async fn publish(&self, events: &[&OutboxEvent]) -> Vec<Outcome> {
        let mut buf = Vec::with_capacity(events.len() * 256);
        for event in events {
            let line = Line {
                envelope: Envelope::of(event),
                headers: &event.headers,
            };
            // Serializing strings and raw JSON into a Vec cannot fail.
            let _ = serde_json::to_writer(&mut buf, &line);
            buf.push(b'\n');
        }
        let mut out = self.out.lock().await;
        let written = async {
            out.write_all(&buf).await?;
            out.flush().await
        }
        .await;
        match written {
            Ok(()) => vec![Outcome::Delivered; events.len()],
            Err(e) => vec![Outcome::retry(format!("cannot write to stdout: {e}")); events.len()],
        }
    }
}

/// Registry entry: `type = "stdout"`, no settings.
pub const KIND: SinkKind = SinkKind {
    name: "stdout",
    build: |_, settings| {
        crate::config::sink_settings::<crate::config::NoSettings>(settings)?;
        Ok(Arc::new(StdoutSink::default()))
    },
};
