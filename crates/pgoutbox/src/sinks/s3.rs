//! The `s3` sink: archives events in Amazon S3 as JSON Lines, one object per batch for each day
//! and topic, for data lakes and audit.
//!
//! A publish groups its events by prefix, day (`created_at`, UTC) and topic, and writes each group
//! as one object, `<prefix>/<yyyy>/<mm>/<dd>/<topic>/<first event id>.jsonl`, one line per event:
//! its `body`, the envelope by default (so each line carries the event's id). Delivery is at least
//! once: a batch sent again after a crash is written under the same name and replaces the object;
//! an event retried in another batch may sit in two objects, and readers dedupe by id as any
//! consumer does. A group's events share its object's outcome.

use async_trait::async_trait;
use aws_sdk_s3::primitives::ByteStream;
use chrono::{DateTime, Utc};
use futures::StreamExt;

use super::aws::{self, AwsSettings};
use super::body::{Binding, Body, Shape};
use crate::config::Flat;
use crate::model::event::OutboxEvent;
use crate::model::outcome::Outcome;
use crate::model::template::Template;

/// Most objects one publish writes at once.
const OBJECTS_IN_FLIGHT: usize = 8;

/// The media type of a JSON Lines object.
const JSON_LINES: &str = "application/x-ndjson";

super::sink_type!(
    /// `body` (what a line holds) is `envelope` by default.
    "s3": S3Sink, S3Config = S3Settings + AwsSettings
);

super::own_settings! {
    /// The keys only `type = "s3"` takes.
    pub struct S3Settings {
        /// The bucket.
        pub bucket: String,
        /// What object names start with, a template (`events/{header.x-tenant}`); default none.
        pub prefix: Option<Template>,
        /// Path-style addressing (`host/bucket/key`); default on when `endpoint_url` is set.
        pub force_path_style: Option<bool>,
    }
}

/// Archives events in S3.
pub struct S3Sink {
    cfg: S3Settings,
    shape: Shape,
    client: aws::Connection<aws_sdk_s3::Client>,
}

super::sink_debug!(S3Sink {
    bucket: cfg.bucket,
    prefix: cfg.prefix
});

/// The folder of the objects holding events of `topic` written on `day`: `<prefix>/<yyyy>/<mm>/<dd>/<topic>`.
fn folder(prefix: &str, day: DateTime<Utc>, topic: &str) -> String {
    let path = format!("{}/{topic}", day.format("%Y/%m/%d"));
    match prefix.trim_end_matches('/') {
        "" => path,
        prefix => format!("{prefix}/{path}"),
    }
}

/// The name of the object holding events of `topic` written on `day`, the first of them `first`.
pub fn object_key(prefix: &str, day: DateTime<Utc>, topic: &str, first: &uuid::Uuid) -> String {
    in_folder(&folder(prefix, day, topic), first)
}

/// The name of the object in `folder` whose first event is `first`.
fn in_folder(folder: &str, first: &uuid::Uuid) -> String {
    format!("{folder}/{first}.jsonl")
}

/// One JSON Lines line: `body` as is, or re-written on one line when it spans several (a `json`
/// payload may keep the writer's line breaks).
fn line(body: &[u8]) -> Vec<u8> {
    let mut line = match body.contains(&b'\n') {
        false => body.to_vec(),
        true => serde_json::from_slice::<serde_json::Value>(body)
            .map(|v| v.to_string().into_bytes())
            .unwrap_or_else(|_| {
                body.iter()
                    .map(|&b| if b == b'\n' { b' ' } else { b })
                    .collect()
            }),
    };
    line.push(b'\n');
    line
}

impl S3Sink {
    /// Validates the settings; connects on the first publish.
    pub fn new(Flat { own: cfg, common }: S3Config) -> Result<Self, String> {
        super::aws::names::bucket(&cfg.bucket)?;
        let path_style = cfg
            .force_path_style
            .unwrap_or(common.endpoint_url.is_some());
        let (shape, client) = common.build("S3", Body::Envelope, move |sdk| {
            let config = aws_sdk_s3::config::Builder::from(sdk)
                .force_path_style(path_style)
                .build();
            aws_sdk_s3::Client::from_conf(config)
        })?;
        Ok(Self { cfg, shape, client })
    }

    /// The folder `event` is archived in.
    fn folder(&self, event: &OutboxEvent) -> String {
        let prefix = self.cfg.prefix.as_ref().map(|p| p.render(event));
        folder(&prefix.unwrap_or_default(), event.created_at, &event.topic)
    }

    /// The object of one group of events in `folder`: its name and its lines.
    fn object(&self, events: &[&OutboxEvent], folder: &str) -> (String, Vec<u8>) {
        let key = in_folder(folder, &events[0].id);
        let lines = events
            .iter()
            .flat_map(|e| line(&self.shape.message(e, Binding::Kafka).body))
            .collect();
        (key, lines)
    }

    async fn put(&self, key: String, lines: Vec<u8>) -> Outcome {
        let answer = self
            .client
            .get()
            .await
            .put_object()
            .bucket(&self.cfg.bucket)
            .key(key)
            .content_type(JSON_LINES)
            .body(ByteStream::from(lines))
            .send()
            .await;
        match answer {
            Ok(_) => Outcome::Delivered,
            Err(e) => aws::call_failed("S3", &e),
        }
    }
}

#[async_trait]
impl aws::Batches for S3Sink {
    async fn send_all(&self, events: &[&OutboxEvent], record: aws::Record<'_>) {
        // Events whose objects would share a folder share an object.
        let groups = aws::by_target(events.iter().map(|e| self.folder(e)).collect());
        let puts = groups.into_iter().map(|(folder, positions)| async move {
            let members: Vec<&OutboxEvent> = positions.iter().map(|&i| events[i]).collect();
            let (key, lines) = self.object(&members, &folder);
            let outcome = self.put(key, lines).await;
            record.call(
                positions
                    .into_iter()
                    .map(|i| (i, outcome.clone()))
                    .collect(),
            );
        });
        futures::stream::iter(puts)
            .buffer_unordered(OBJECTS_IN_FLIGHT)
            .collect::<()>()
            .await;
    }

    async fn ready(&self) -> Result<(), String> {
        let bucket = &self.cfg.bucket;
        let answer = self
            .client
            .get()
            .await
            .head_bucket()
            .bucket(bucket)
            .send()
            .await;
        answer
            .map(|_| ())
            .map_err(|e| aws::unreachable(&format!("bucket {bucket}"), aws::call_failed("S3", &e)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn objects_are_named_by_day_topic_and_first_id() {
        let day = DateTime::parse_from_rfc3339("2026-12-03T23:59:59Z")
            .expect("time")
            .with_timezone(&Utc);
        let id = uuid::Uuid::nil();
        assert_eq!(
            object_key("archive/", day, "order.created", &id),
            format!("archive/2026/12/03/order.created/{id}.jsonl")
        );
        assert_eq!(
            object_key("", day, "t", &id),
            format!("2026/12/03/t/{id}.jsonl")
        );
    }

    #[test]
    fn each_event_is_one_line() {
        assert_eq!(line(br#"{"a":1}"#), b"{\"a\":1}\n");
        assert_eq!(line(b"{\n  \"a\": 1\n}"), b"{\"a\":1}\n");
    }
}
