//! The `sns` sink: publishes each event to an Amazon SNS topic, ten to a `PublishBatch` call.
//!
//! As the `sqs` sink: the body is the event's `body` (the payload by default), the message
//! attributes carry its id, topic, key and headers ([`super::aws::attributes`]), and on a FIFO
//! topic (its ARN ends in `.fifo`) `MessageGroupId` is the event's key (its id when it has none)
//! and `MessageDeduplicationId` its id. Subscribers see the attributes as sent when the
//! subscription has raw message delivery on, and inside SNS's JSON notification otherwise.

use async_trait::async_trait;
use aws_sdk_sns::types::{MessageAttributeValue, PublishBatchRequestEntry};
use serde::Deserialize;

use super::aws::{self, AwsSettings, Limits};
use super::body::{Body, Shape};
use super::reserved::Reserved;
use super::SinkKind;
use crate::config::Flat;
use crate::model::event::OutboxEvent;
use crate::model::outcome::Outcome;
use crate::model::template::Template;

/// What one `PublishBatch` takes: ten entries, 256 KiB of messages and attributes together.
const LIMITS: Limits = Limits {
    entries: 10,
    bytes: 256 * 1024,
};

/// Registry entry: `type = "sns"`.
pub const KIND: SinkKind = SinkKind {
    name: "sns",
    build: |_name, settings| aws::build(settings, SnsSink::new),
};

/// Settings of `type = "sns"`: [`SnsSettings`] and the [`AwsSettings`] every AWS sink takes; `body`
/// (what a message holds) is `payload` by default.
pub type SnsConfig = Flat<SnsSettings, AwsSettings>;

/// The keys only `type = "sns"` takes.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnsSettings {
    /// The topic's ARN, a template: `arn:aws:sns:eu-west-1:123456789012:orders.fifo`.
    pub topic_arn: Template,
}

/// Publishes events to SNS topics.
pub struct SnsSink {
    cfg: SnsSettings,
    shape: Shape,
    reserved: Reserved,
    client: aws::Connection<aws_sdk_sns::Client>,
}

impl std::fmt::Debug for SnsSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SnsSink")
            .field("topic_arn", &self.cfg.topic_arn)
            .finish_non_exhaustive()
    }
}

impl SnsSink {
    /// Validates the settings; connects on the first publish.
    pub fn new(cfg: SnsConfig) -> Result<Self, String> {
        let (shape, client) = cfg
            .common
            .build(("SNS", Body::Payload), aws_sdk_sns::Client::new)?;
        Ok(Self {
            cfg: cfg.own,
            shape,
            reserved: aws::reserved("sns"),
            client,
        })
    }

    /// The batch entry of `event`, named `id` within its call, and its size against the limits.
    fn entry(
        &self,
        id: usize,
        event: &OutboxEvent,
        topic: &str,
    ) -> Result<(PublishBatchRequestEntry, usize), String> {
        let message = aws::message(&self.shape, event, &self.reserved);
        let mut entry = PublishBatchRequestEntry::builder()
            .id(id.to_string())
            .message(message.body);
        for (name, value) in message.attributes {
            let value = MessageAttributeValue::builder()
                .data_type("String")
                .string_value(value)
                .build()
                .map_err(|e| format!("cannot make the SNS message attribute {name}: {e}"))?;
            entry = entry.message_attributes(name, value);
        }
        if aws::fifo(topic) {
            entry = entry
                .message_group_id(aws::group(event))
                .message_deduplication_id(event.id.to_string());
        }
        let entry = entry
            .build()
            .map_err(|e| format!("cannot make the SNS message: {e}"))?;
        Ok((entry, message.size))
    }

    /// Publishes `entries` to `topic` in one call.
    async fn send(&self, topic: String, entries: Vec<PublishBatchRequestEntry>) -> Vec<Outcome> {
        let ids: Vec<String> = entries.iter().map(|e| e.id().to_owned()).collect();
        let answer = self
            .client
            .get()
            .await
            .publish_batch()
            .topic_arn(&topic)
            .set_publish_batch_request_entries(Some(entries))
            .send()
            .await;
        match answer {
            Ok(out) => aws::entry_outcomes(
                "SNS",
                &ids,
                out.successful().iter().filter_map(|s| s.id()),
                out.failed()
                    .iter()
                    .map(|f| (f.id(), Some(f.code()), f.message().unwrap_or("no message"))),
            ),
            Err(e) => vec![aws::call_failed("SNS", &e); ids.len()],
        }
    }
}

#[async_trait]
impl aws::Batches for SnsSink {
    async fn send_all(&self, events: &[&OutboxEvent], record: aws::Record<'_>) {
        let topics: Vec<String> = events
            .iter()
            .map(|e| self.cfg.topic_arn.render(e))
            .collect();
        let entries: Vec<_> = events
            .iter()
            .zip(&topics)
            .enumerate()
            .map(|(i, (e, t))| self.entry(i, e, t))
            .collect();
        aws::publish_built(
            events,
            topics,
            &entries,
            LIMITS,
            aws::fifo,
            |topic, built| self.send(topic, built),
            record,
        )
        .await;
    }

    async fn ready(&self) -> Result<(), String> {
        aws::ready(&self.cfg.topic_arn, ("topic", "SNS"), |topic| async move {
            let client = self.client.get().await;
            client.get_topic_attributes().topic_arn(topic).send().await
        })
        .await
    }
}
