//! A real AMQP consumer for the RabbitMQ sink tests (127.0.0.1:5672, guest/guest).

use std::collections::HashMap;
use std::time::Duration;

use futures::StreamExt;
use lapin::options::{BasicConsumeOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection, ConnectionProperties};

use super::sinks::Got;

pub const URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// A channel on the local broker.
pub async fn channel() -> (Connection, Channel) {
    let conn = Connection::connect(URL, ConnectionProperties::default())
        .await
        .expect("RabbitMQ on 127.0.0.1:5672 (bash .ci/run starts it)");
    let channel = conn.create_channel().await.expect("channel");
    (conn, channel)
}

/// Declares a durable queue bound to `amq.topic` with `pattern`.
pub async fn queue(channel: &Channel, name: &str, pattern: &str) {
    channel
        .queue_declare(
            name.into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("declare queue");
    channel
        .queue_bind(
            name.into(),
            "amq.topic".into(),
            pattern.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("bind queue");
}

/// Consumes `n` messages from `queue`; returns them with their routing keys and delivery modes.
pub async fn consume(channel: &Channel, queue: &str, n: usize) -> (Vec<Got>, Vec<String>, Vec<u8>) {
    let mut consumer = channel
        .basic_consume(
            queue.into(),
            "".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("consume");
    let mut got = Vec::new();
    let mut keys = Vec::new();
    let mut modes = Vec::new();
    while got.len() < n {
        let d = tokio::time::timeout(Duration::from_secs(10), consumer.next())
            .await
            .expect("a message within 10 s")
            .expect("consumer open")
            .expect("delivery");
        let mut headers = HashMap::new();
        if let Some(table) = d.properties.headers() {
            for (k, v) in table.inner() {
                let v = match v {
                    AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
                    other => format!("{other:?}"),
                };
                headers.insert(k.as_str().to_owned(), v);
            }
        }
        got.push(Got {
            id: d
                .properties
                .message_id()
                .as_ref()
                .map(|s| s.as_str().to_owned())
                .unwrap_or_default(),
            key: headers.get("pgoutbox-key").cloned(),
            payload: d.data.clone(),
            headers,
        });
        keys.push(d.routing_key.as_str().to_owned());
        modes.push(d.properties.delivery_mode().unwrap_or(0));
    }
    (got, keys, modes)
}
