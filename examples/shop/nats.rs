//! The balances consumer over NATS JetStream instead of webhooks (feature `nats`).
//!
//! Written against the contract of pgoutbox's NATS sink: subject = topic, header `Nats-Msg-Id` =
//! event id, payload = the envelope `{"id","type","timestamp","key","data"}`. JetStream's own
//! dedup window drops re-publishes with the same `Nats-Msg-Id` for a while; the inbox covers the
//! rest (redelivery after a crash before the ack, publishes outside the window).
//!
//! Run: `cargo run --example shop --features axum,nats -- --nats-consumer`, with NATS on
//! 127.0.0.1:4222 (`NATS_URL`) and a relay configured with a NATS destination for `order.*`.
//! `tests/shop_nats.rs` includes this file and drives [`consume`] on a stream of its own.
#![allow(dead_code)]

use std::sync::Arc;

use anyhow::{anyhow, Context};
use async_nats::jetstream::{self, consumer::pull, consumer::AckPolicy, stream};
use futures::StreamExt;
use sqlx::PgPool;
use uuid::Uuid;

use crate::services::{self, ConsumerStats, Envelope, OrderCreated};

/// Stream holding the shop's subjects (`SHOP_NATS_STREAM`, default `PGOUTBOX`).
fn stream_name() -> String {
    std::env::var("SHOP_NATS_STREAM").unwrap_or_else(|_| "PGOUTBOX".into())
}

/// Consumes `order.created` from JetStream until the process is stopped.
pub async fn run(pool: PgPool) -> anyhow::Result<()> {
    let url = std::env::var("NATS_URL").unwrap_or_else(|_| "127.0.0.1:4222".into());
    let stats = Arc::new(ConsumerStats::default());
    println!("consuming order.created from NATS at {url}");
    consume(&url, &stream_name(), "order.created", pool, stats, None).await
}

/// Pulls `subject` from a durable consumer on `stream` (created for that subject when missing);
/// each message is applied through the inbox, then acknowledged. With `limit`, returns after
/// that many messages (tests).
pub async fn consume(
    url: &str,
    stream: &str,
    subject: &str,
    pool: PgPool,
    stats: Arc<ConsumerStats>,
    limit: Option<usize>,
) -> anyhow::Result<()> {
    let client = async_nats::connect(url)
        .await
        .with_context(|| format!("cannot connect to NATS at {url}"))?;
    let js = jetstream::new(client);
    let stream = js
        .get_or_create_stream(stream::Config {
            name: stream.to_owned(),
            subjects: vec![subject.to_owned()],
            ..Default::default()
        })
        .await
        .map_err(|e| anyhow!("cannot get stream {stream}: {e}"))?;
    let consumer = stream
        .get_or_create_consumer(
            services::CONSUMER,
            pull::Config {
                durable_name: Some(services::CONSUMER.into()),
                ack_policy: AckPolicy::Explicit,
                filter_subject: subject.to_owned(),
                ..Default::default()
            },
        )
        .await
        .map_err(|e| anyhow!("cannot create consumer: {e}"))?;
    let mut messages = consumer
        .messages()
        .await
        .map_err(|e| anyhow!("cannot pull: {e}"))?;
    let mut seen = 0;
    while let Some(message) = messages.next().await {
        let message = message.map_err(|e| anyhow!("pull failed: {e}"))?;
        let id = message
            .headers
            .as_ref()
            // The constant, not the string: async-nats keys its standard headers by their own
            // name type, and a string lookup would miss them.
            .and_then(|h| h.get(async_nats::header::NATS_MESSAGE_ID))
            .and_then(|v| Uuid::parse_str(v.as_str()).ok());
        let envelope: Result<Envelope<OrderCreated>, _> = serde_json::from_slice(&message.payload);
        match (id, envelope) {
            (Some(id), Ok(envelope)) if envelope.id == id => {
                // On an error the consumer stops without acknowledging: JetStream redelivers to
                // the next run, and the inbox keeps the effect single.
                services::apply_order_created(&pool, id, &envelope.data, &stats).await?;
                message
                    .ack()
                    .await
                    .map_err(|e| anyhow!("ack failed: {e}"))?;
            }
            (id, envelope) => {
                eprintln!(
                    "terminating a malformed message on {} (Nats-Msg-Id {id:?}, envelope error {:?})",
                    message.subject,
                    envelope.err().map(|e| e.to_string())
                );
                // Malformed: redelivering will not fix it; terminate instead of looping.
                message
                    .ack_with(jetstream::AckKind::Term)
                    .await
                    .map_err(|e| anyhow!("term failed: {e}"))?;
            }
        }
        seen += 1;
        if limit.is_some_and(|l| seen >= l) {
            break;
        }
    }
    Ok(())
}
