//! The `kinesis` sink: puts each event on an Amazon Kinesis data stream, up to 500 to a
//! `PutRecords` call.
//!
//! A record's data is the event's `body` (the envelope by default: a record has no attributes, so
//! the id travels in it); its partition key is the event's key (its id when it has none), so a
//! key's events land on one shard, in order. A stream's calls go one after another, and an event
//! whose key failed in an earlier call of the same publish is not sent after it (`PutRecords`
//! goes on past a failed record, so a later one of the same key could overtake). Each record gets
//! its own answer: the failed ones are retried alone, the delivered ones never sent again.

use async_trait::async_trait;
use aws_sdk_kinesis::primitives::Blob;
use aws_sdk_kinesis::types::PutRecordsRequestEntry;

use super::aws::{self, AwsSettings, Calls, Limits};
use super::body::{Binding, Body, Shape};
use crate::model::event::OutboxEvent;
use crate::model::outcome::Outcome;
use crate::model::template::Template;

/// What one `PutRecords` takes — 500 records, 5 MiB of data and partition keys together — and a
/// stream keeps each shard's order: every stream is sent to in order.
const CALLS: Calls = Calls {
    limits: Limits {
        entries: 500,
        bytes: 5 * 1024 * 1024,
    },
    ordered: |_| true,
};

super::sink_type!(
    /// `body` (what a record's data holds) is `envelope` by default.
    "kinesis": KinesisSink, KinesisConfig = KinesisSettings + AwsSettings
);

super::own_settings! {
    /// The keys only `type = "kinesis"` takes.
    pub struct KinesisSettings {
        /// The stream's name or ARN, a template.
        pub stream: Template,
    }
}

/// Puts events on Kinesis data streams.
pub struct KinesisSink {
    cfg: KinesisSettings,
    shape: Shape,
    client: aws::Connection<aws_sdk_kinesis::Client>,
}

super::sink_debug!(KinesisSink { stream: cfg.stream });

impl KinesisSink {
    /// Validates the settings; connects on the first publish.
    pub fn new(cfg: KinesisConfig) -> Result<Self, String> {
        let (shape, client) =
            cfg.common
                .build("Kinesis", Body::Envelope, aws_sdk_kinesis::Client::new)?;
        aws::names::name_or_arn("stream", &cfg.own.stream, "kinesis", 128, "_.-")?;
        Ok(Self {
            cfg: cfg.own,
            shape,
            client,
        })
    }

    /// The record of `event` and its size against the limits.
    fn record(&self, event: &OutboxEvent) -> Result<(PutRecordsRequestEntry, usize), String> {
        let data = self.shape.message(event, Binding::Kafka).body.into_owned();
        let key = aws::group(event);
        let size = data.len() + key.len();
        let record = PutRecordsRequestEntry::builder()
            .data(Blob::new(data))
            .partition_key(key)
            .build()
            .map_err(|e| format!("cannot make the Kinesis record: {e}"))?;
        Ok((record, size))
    }

    /// Puts `records` on `stream` in one call.
    async fn send(&self, stream: String, records: Vec<PutRecordsRequestEntry>) -> Vec<Outcome> {
        let len = records.len();
        let call = self
            .client
            .get()
            .await
            .put_records()
            .set_records(Some(records));
        let call = if stream.starts_with("arn:") {
            call.stream_arn(stream)
        } else {
            call.stream_name(stream)
        };
        aws::in_order!("Kinesis", len, call.send().await, records)
    }
}

#[async_trait]
impl aws::Batches for KinesisSink {
    async fn send_all(&self, events: &[&OutboxEvent], record: aws::Record<'_>) {
        let entry = |_, event: &OutboxEvent, _: &str| self.record(event);
        let send = |stream, records| self.send(stream, records);
        aws::publish_each(events, &self.cfg.stream, CALLS, entry, send, record).await;
    }

    async fn ready(&self) -> Result<(), String> {
        self.client
            .ready(&self.cfg.stream, "stream", |client, stream| {
                let call = client.describe_stream_summary();
                let call = if stream.starts_with("arn:") {
                    call.stream_arn(stream)
                } else {
                    call.stream_name(stream)
                };
                call.send()
            })
            .await
    }
}
