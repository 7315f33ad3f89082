//! The `sqs` sink: sends each event to an Amazon SQS queue, ten to a `SendMessageBatch` call.
//!
//! The message body is the event's `body` (the payload by default); its attributes carry the
//! event's id, topic, key and headers ([`super::aws::attributes`]). On a FIFO queue (its URL ends
//! in `.fifo`) `MessageGroupId` is the event's key — its id when it has none — so the queue keeps
//! each key's order, and `MessageDeduplicationId` is the event id, so SQS drops a redelivery within
//! its five-minute window. A FIFO queue's calls go one after another; a standard queue's go side
//! by side. Each entry of a batch gets its own answer: the failed ones are retried (or rejected)
//! alone, the delivered ones are never sent again.

use aws_sdk_sqs::types::QueueAttributeName;
use serde::Deserialize;

use super::aws::{self, AwsSettings};
use super::SinkKind;
use crate::config::Flat;
use crate::model::template::Template;

/// Registry entry: `type = "sqs"`.
pub const KIND: SinkKind = SinkKind {
    name: "sqs",
    build: |_name, settings| {
        aws::build(settings, |cfg: SqsConfig| {
            SqsSink::new(cfg.own.queue_url, cfg.common)
        })
    },
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

/// Sends events to SQS queues; a queue is there when `GetQueueAttributes` answers.
pub type SqsSink = aws::Messages<aws_sdk_sqs::Client>;

aws::message_api!(
    aws_sdk_sqs,
    ("SQS", "sqs"),
    "queue",
    SendMessageBatchRequestEntry.message_body,
    send_message_batch.queue_url.set_entries,
    |client, queue| client
        .get_queue_attributes()
        .queue_url(queue)
        .attribute_names(QueueAttributeName::QueueArn)
);
