//! The `sns` sink: publishes each event to an Amazon SNS topic, ten to a `PublishBatch` call.
//!
//! As the `sqs` sink: the body is the event's `body` (the payload by default), the message
//! attributes carry its id, topic, key and headers ([`super::aws::attributes`]), and on a FIFO
//! topic (its ARN ends in `.fifo`) `MessageGroupId` is the event's key (its id when it has none)
//! and `MessageDeduplicationId` its id. Subscribers see the attributes as sent when the
//! subscription has raw message delivery on, and inside SNS's JSON notification otherwise.

use serde::Deserialize;

use super::aws::{self, AwsSettings};
use super::SinkKind;
use crate::config::Flat;
use crate::model::template::Template;

/// Registry entry: `type = "sns"`.
pub const KIND: SinkKind = SinkKind {
    name: "sns",
    build: |_name, settings| {
        aws::build(settings, |cfg: SnsConfig| {
            SnsSink::new(cfg.own.topic_arn, cfg.common)
        })
    },
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

/// Publishes events to SNS topics; a topic is there when `GetTopicAttributes` answers.
pub type SnsSink = aws::Messages<aws_sdk_sns::Client>;

aws::message_api!(
    aws_sdk_sns,
    ("SNS", "sns"),
    "topic",
    PublishBatchRequestEntry.message,
    publish_batch.topic_arn.set_publish_batch_request_entries,
    |client, topic| client.get_topic_attributes().topic_arn(topic)
);
