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

use super::aws::{self, AwsSettings};

aws::message_sink! {
    kind: "sqs",
    service: "SQS",
    sdk: aws_sdk_sqs,
    /// Sends events to SQS queues; a queue is there when `GetQueueAttributes` answers.
    sink: SqsSink,
    config: SqsConfig,
    /// The keys only `type = "sqs"` takes.
    settings: SqsSettings {
        /// The queue's URL, a template:
        /// `https://sqs.eu-west-1.amazonaws.com/123456789012/orders.fifo`.
        queue_url
    },
    target: "queue",
    entry: SendMessageBatchRequestEntry.message_body,
    call: send_message_batch.queue_url.set_entries,
    valid: aws::names::queue_url,
    check: |client, queue| client
        .get_queue_attributes()
        .queue_url(queue)
        .attribute_names(QueueAttributeName::QueueArn),
}
