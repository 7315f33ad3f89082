//! The `sns` sink: publishes each event to an Amazon SNS topic, ten to a `PublishBatch` call.
//!
//! As the `sqs` sink: the body is the event's `body` (the payload by default), the message
//! attributes carry its id, topic, key and headers ([`super::aws::attributes`]), and on a FIFO
//! topic (its ARN ends in `.fifo`) `MessageGroupId` is the event's key (its id when it has none)
//! and `MessageDeduplicationId` its id. Subscribers see the attributes as sent when the
//! subscription has raw message delivery on, and inside SNS's JSON notification otherwise.

use super::aws::{self, AwsSettings};

aws::message_sink! {
    kind: "sns",
    service: "SNS",
    sdk: aws_sdk_sns,
    /// Publishes events to SNS topics; a topic is there when `GetTopicAttributes` answers.
    sink: SnsSink,
    config: SnsConfig,
    /// The keys only `type = "sns"` takes.
    settings: SnsSettings {
        /// The topic's ARN, a template: `arn:aws:sns:eu-west-1:123456789012:orders.fifo`.
        topic_arn
    },
    target: "topic",
    entry: PublishBatchRequestEntry.message,
    call: publish_batch.topic_arn.set_publish_batch_request_entries,
    valid: topic_arn,
    check: |client, topic| client.get_topic_attributes().topic_arn(topic),
}

/// A topic ARN of SNS (a template): checked when the settings load.
fn topic_arn(arn: &crate::model::template::Template) -> Result<(), String> {
    aws::names::arn("topic_arn", arn, "sns")
}
