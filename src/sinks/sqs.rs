//! The `sqs` sink: sends each event to an Amazon SQS queue, ten to a `SendMessageBatch` call.
//!
//! The message body is the event's `body` (the payload by default); its attributes carry the
//! event's id, topic, key and headers ([`super::aws::attributes`]). On a FIFO queue (its URL ends
//! in `.fifo`) `MessageGroupId` is the event's key — its id when it has none — so the queue keeps
//! each key's order, and `MessageDeduplicationId` is the event id, so SQS drops a redelivery within
//! its five-minute window. A FIFO queue's calls go one after another; a standard queue's go side
//! by side. Each entry of a batch gets its own answer: the failed ones are retried (or rejected)
//! alone, the delivered ones are never sent again.

use async_trait::async_trait;
use aws_sdk_sqs::types::{MessageAttributeValue, QueueAttributeName, SendMessageBatchRequestEntry};
use serde::Deserialize;

use super::aws::{self, AwsSettings, Limits};
use super::body::{Body, Shape};
use super::reserved::Reserved;
use super::SinkKind;
use crate::config::Flat;
use crate::model::event::OutboxEvent;
use crate::model::outcome::Outcome;
use crate::model::template::Template;

/// What one `SendMessageBatch` takes: ten entries, 256 KiB of bodies and attributes together.
const LIMITS: Limits = Limits {
    entries: 10,
    bytes: 256 * 1024,
};

/// Registry entry: `type = "sqs"`.
pub const KIND: SinkKind = SinkKind {
    name: "sqs",
    build: |_name, settings| aws::build(settings, SqsSink::new),
};

/// Settings of `type = "sqs"`: [`SqsSettings`] and the [`AwsSettings`] every AWS sink takes; `body`
/// (what a message's body holds) is `payload` by default.
pub type SqsConfig = Flat<SqsSettings, AwsSettings>;

/// The keys only `type = "sqs"` takes.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SqsSettings {
    /// The queue's URL, a template: `https://sqs.eu-west-1.amazonaws.com/123456789012/orders.fifo`.
    pub queue_url: Template,
}

/// Sends events to SQS queues.
pub struct SqsSink {
    cfg: SqsSettings,
    shape: Shape,
    reserved: Reserved,
    client: aws::Connection<aws_sdk_sqs::Client>,
}

impl std::fmt::Debug for SqsSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqsSink")
            .field("queue_url", &self.cfg.queue_url)
            .finish_non_exhaustive()
    }
}

impl SqsSink {
    /// Validates the settings; connects on the first publish.
    pub fn new(cfg: SqsConfig) -> Result<Self, String> {
        let (shape, client) = cfg
            .common
            .build(("SQS", Body::Payload), aws_sdk_sqs::Client::new)?;
        Ok(Self {
            cfg: cfg.own,
            shape,
            reserved: aws::reserved("sqs"),
            client,
        })
    }

    /// The batch entry of `event`, named `id` within its call, and its size against the limits.
    fn entry(
        &self,
        id: usize,
        event: &OutboxEvent,
        queue: &str,
    ) -> Result<(SendMessageBatchRequestEntry, usize), String> {
        let message = aws::message(&self.shape, event, &self.reserved);
        let mut entry = SendMessageBatchRequestEntry::builder()
            .id(id.to_string())
            .message_body(message.body);
        for (name, value) in message.attributes {
            let value = MessageAttributeValue::builder()
                .data_type("String")
                .string_value(value)
                .build()
                .map_err(|e| format!("cannot make the SQS message attribute {name}: {e}"))?;
            entry = entry.message_attributes(name, value);
        }
        if aws::fifo(queue) {
            entry = entry
                .message_group_id(aws::group(event))
                .message_deduplication_id(event.id.to_string());
        }
        let entry = entry
            .build()
            .map_err(|e| format!("cannot make the SQS message: {e}"))?;
        Ok((entry, message.size))
    }

    /// Sends `entries` to `queue` in one call.
    async fn send(
        &self,
        queue: String,
        entries: Vec<SendMessageBatchRequestEntry>,
    ) -> Vec<Outcome> {
        let ids: Vec<String> = entries.iter().map(|e| e.id().to_owned()).collect();
        let answer = self
            .client
            .get()
            .await
            .send_message_batch()
            .queue_url(&queue)
            .set_entries(Some(entries))
            .send()
            .await;
        match answer {
            Ok(out) => aws::entry_outcomes(
                "SQS",
                &ids,
                out.successful().iter().map(|s| s.id()),
                out.failed()
                    .iter()
                    .map(|f| (f.id(), Some(f.code()), f.message().unwrap_or("no message"))),
            ),
            Err(e) => vec![aws::call_failed("SQS", &e); ids.len()],
        }
    }
}

#[async_trait]
impl aws::Batches for SqsSink {
    async fn send_all(&self, events: &[&OutboxEvent], record: aws::Record<'_>) {
        let queues: Vec<String> = events
            .iter()
            .map(|e| self.cfg.queue_url.render(e))
            .collect();
        let entries: Vec<_> = events
            .iter()
            .zip(&queues)
            .enumerate()
            .map(|(i, (e, q))| self.entry(i, e, q))
            .collect();
        aws::publish_built(
            events,
            queues,
            &entries,
            LIMITS,
            aws::fifo,
            |queue, built| self.send(queue, built),
            record,
        )
        .await;
    }

    async fn ready(&self) -> Result<(), String> {
        aws::ready(&self.cfg.queue_url, ("queue", "SQS"), |queue| async move {
            let client = self.client.get().await;
            let call = client.get_queue_attributes().queue_url(queue);
            call.attribute_names(QueueAttributeName::QueueArn)
                .send()
                .await
        })
        .await
    }
}
