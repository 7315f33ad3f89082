//! NATS JetStream fixtures for the sink tests: a client and a reader that consumes a whole
//! stream back with an ordered pull consumer.

use std::collections::HashMap;
use std::time::Duration;

use async_nats::jetstream;
use futures::StreamExt;

use super::sinks::Got;

/// The local NATS server.
pub const URL: &str = "nats://127.0.0.1:4222";

/// A JetStream context on the local server.
pub async fn jetstream() -> jetstream::Context {
    jetstream::new(
        async_nats::connect(URL)
            .await
            .expect("NATS on 127.0.0.1:4222 (bash .ci/run starts it)"),
    )
}

/// How many messages the stream stores.
pub async fn stored(js: &jetstream::Context, stream: &str) -> u64 {
    js.get_stream(stream)
        .await
        .expect("stream")
        .get_info()
        .await
        .expect("info")
        .state
        .messages
}

/// Reads `n` messages of the stream back with an ordered pull consumer; returns messages and subjects.
pub async fn consume(js: &jetstream::Context, stream: &str, n: usize) -> (Vec<Got>, Vec<String>) {
    let stream = js.get_stream(stream).await.expect("stream exists");
    let consumer = stream
        .create_consumer(jetstream::consumer::pull::OrderedConfig::default())
        .await
        .expect("consumer");
    let mut messages = consumer.messages().await.expect("messages");
    let mut got = Vec::new();
    let mut subjects = Vec::new();
    while got.len() < n {
        let m = tokio::time::timeout(Duration::from_secs(10), messages.next())
            .await
            .expect("a message within 10 s")
            .expect("stream open")
            .expect("message");
        let headers = m.headers.clone().unwrap_or_default();
        let map = headers
            .iter()
            .map(|(k, v)| {
                (
                    k.to_string(),
                    v.first().map(|v| v.to_string()).unwrap_or_default(),
                )
            })
            .collect::<HashMap<_, _>>();
        got.push(Got {
            id: map.get("Nats-Msg-Id").cloned().unwrap_or_default(),
            key: map.get("pgoutbox-key").cloned(),
            payload: m.payload.to_vec(),
            headers: map,
        });
        subjects.push(m.subject.to_string());
    }
    (got, subjects)
}

/// Settings of a `nats` destination on the local server that publishes on `subject` into a
/// stream `stream` it creates over `{prefix}.>`.
pub fn stream_settings(subject: &str, stream: &str, prefix: &str) -> String {
    format!(
        "url = \"{URL}\"\nsubject = \"{subject}\"\ncreate_stream = true\nstream = \"{stream}\"\n\
         subjects = [\"{prefix}.>\"]\n"
    )
}
