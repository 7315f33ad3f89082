//! The local AWS emulator (moto's server mode on 127.0.0.1:5055, started by `.ci/run`): clients
//! that read back what the AWS sinks sent, the events the tests commit, the check of what came
//! back, and a proxy that fails chosen entries of SQS batches.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use aws_config::{BehaviorVersion, Region, SdkConfig};
use aws_sdk_sqs::config::Credentials;

use super::TestDb;

/// The emulator's endpoint.
pub const EMULATOR: &str = "http://127.0.0.1:5055";

/// How many events each black-box check commits, and over how many keys.
pub const EVENTS: usize = 300;
pub const KEYS: usize = 20;

/// Points the relay's credential chain at the emulator's dummy account, away from the machine's
/// own profile and instance metadata. Each nextest test is a process of its own, and this runs
/// before the test starts anything that reads the environment.
pub fn use_emulator_account() {
    for (name, value) in [
        ("AWS_ACCESS_KEY_ID", "testing"),
        ("AWS_SECRET_ACCESS_KEY", "testing"),
        ("AWS_REGION", "us-east-1"),
        ("AWS_EC2_METADATA_DISABLED", "true"),
        ("AWS_CONFIG_FILE", "/nonexistent/pgoutbox-tests"),
        ("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/pgoutbox-tests"),
    ] {
        std::env::set_var(name, value);
    }
}

/// The SDK configuration of the tests' own clients (the consumers).
pub async fn sdk() -> SdkConfig {
    aws_config::defaults(BehaviorVersion::latest())
        .http_client(aws_smithy_http_client::Builder::new().build_http())
        .region(Region::new("us-east-1"))
        .endpoint_url(EMULATOR)
        .credentials_provider(Credentials::new("testing", "testing", None, None, "tests"))
        .load()
        .await
}

/// The account settings of a destination on the emulator.
pub fn account() -> String {
    format!("region = \"us-east-1\"\nendpoint_url = \"{EMULATOR}\"\n")
}

/// One event as committed or as read back: id, key, payload number.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Seen {
    pub id: String,
    pub key: String,
    pub n: i64,
}

/// Commits [`EVENTS`] events on `topic` over [`KEYS`] keys (one transaction), payload `{"n": …}`
/// and header `x-tenant`; returns them in commit order.
pub async fn commit(db: &TestDb, topic: &str) -> Vec<Seen> {
    commit_n(db, topic, EVENTS).await
}

/// [`commit`] with `n` events.
pub async fn commit_n(db: &TestDb, topic: &str, n: usize) -> Vec<Seen> {
    let rows: Vec<(String, String, i64)> = sqlx::query_as(
        "INSERT INTO outbox (topic, key, payload, headers)
         SELECT $1, 'k' || (g % $3), jsonb_build_object('n', g), '{\"x-tenant\": \"acme\"}'
         FROM generate_series(1, $2) g ORDER BY g
         RETURNING id::text, key, (payload->>'n')::bigint",
    )
    .bind(topic)
    .bind(n as i32)
    .bind(KEYS as i32)
    .fetch_all(&db.pool)
    .await
    .expect("insert events");
    rows.into_iter()
        .map(|(id, key, n)| Seen { id, key, n })
        .collect()
}

/// The event an envelope (the body of the Kinesis, EventBridge and S3 sinks) carries.
pub fn from_envelope(envelope: &serde_json::Value) -> Seen {
    Seen {
        id: envelope["id"].as_str().expect("envelope id").to_owned(),
        key: envelope["key"].as_str().unwrap_or_default().to_owned(),
        n: envelope["data"]["n"].as_i64().expect("data.n"),
    }
}

/// Asserts `got` (in the order a consumer read it) holds every committed event, with its id, key
/// and payload, and nothing else; and, when `ordered`, each key's events in commit order (first
/// deliveries: at least once allows a redelivery later).
pub fn check(service: &str, committed: &[Seen], got: &[Seen], ordered: bool) {
    let expected: HashSet<&Seen> = committed.iter().collect();
    let distinct: HashSet<&Seen> = got.iter().collect();
    let lost = expected.difference(&distinct).count();
    let unknown = distinct.difference(&expected).count();
    println!(
        "{service}: {} committed, {} read back ({} distinct, {} redelivered), lost {lost}",
        committed.len(),
        got.len(),
        distinct.len(),
        got.len() - distinct.len()
    );
    assert_eq!(
        (lost, unknown),
        (0, 0),
        "{service}: lost and unknown events"
    );
    if ordered {
        let mut first = HashSet::new();
        let mut last: HashMap<&str, i64> = HashMap::new();
        for seen in got.iter().filter(|s| first.insert(&s.id)) {
            let before = last.insert(&seen.key, seen.n).unwrap_or(i64::MIN);
            assert!(
                seen.n > before,
                "{service}: key {} out of order ({} after {before})",
                seen.key,
                seen.n
            );
        }
    }
}

/// Reads and deletes the messages of `queue` until `n` are read, or nothing came for `patience`
/// long polls of a second: with their attributes, in the order SQS hands them out. Run beside
/// the relay, as a consumer would, it keeps the queue short (the emulator's FIFO receive takes
/// longer the more a queue holds).
pub async fn drain_queue(
    sqs: aws_sdk_sqs::Client,
    queue: String,
    n: usize,
    patience: u32,
) -> Vec<aws_sdk_sqs::types::Message> {
    let started = std::time::Instant::now();
    let mut got = Vec::new();
    let mut idle = 0;
    while got.len() < n && idle < patience {
        let out = sqs
            .receive_message()
            .queue_url(&queue)
            .max_number_of_messages(10)
            .message_attribute_names("All")
            .wait_time_seconds(1)
            .send()
            .await
            .expect("receive");
        let messages = out.messages().to_vec();
        if messages.is_empty() {
            idle += 1;
            continue;
        }
        idle = 0;
        let receipts = messages.iter().enumerate().map(|(i, m)| {
            aws_sdk_sqs::types::DeleteMessageBatchRequestEntry::builder()
                .id(i.to_string())
                .receipt_handle(m.receipt_handle().unwrap_or_default())
                .build()
                .expect("receipt")
        });
        sqs.delete_message_batch()
            .queue_url(&queue)
            .set_entries(Some(receipts.collect()))
            .send()
            .await
            .expect("delete");
        got.extend(messages);
    }
    println!(
        "read {} from {queue} in {:.1} s",
        got.len(),
        started.elapsed().as_secs_f64()
    );
    got
}

/// A queue named `name` (FIFO when it ends in `.fifo`); returns its URL and ARN.
pub async fn queue(sqs: &aws_sdk_sqs::Client, name: &str) -> (String, String) {
    use aws_sdk_sqs::types::QueueAttributeName;
    let mut create = sqs.create_queue().queue_name(name);
    if name.ends_with(".fifo") {
        create = create.attributes(QueueAttributeName::FifoQueue, "true");
    }
    let url = create
        .send()
        .await
        .expect("create queue (moto on 127.0.0.1:5055: bash .ci/run starts it)")
        .queue_url()
        .expect("queue url")
        .to_owned();
    let arn = sqs
        .get_queue_attributes()
        .queue_url(&url)
        .attribute_names(QueueAttributeName::QueueArn)
        .send()
        .await
        .expect("queue arn")
        .attributes()
        .and_then(|a| a.get(&QueueAttributeName::QueueArn).cloned())
        .expect("arn");
    (url, arn)
}

/// A proxy in front of the emulator that fails, the first time it sees it, each entry of an SQS
/// `SendMessageBatch` whose event id `fails` picks (the entry is kept from the emulator and
/// answered as failed), and counts every entry per event id: sent to it, and passed on.
#[derive(Clone, Default)]
pub struct FailingProxy {
    /// Entries per event id: (seen by the proxy, passed on to the emulator).
    pub counts: Arc<Mutex<HashMap<String, (usize, usize)>>>,
}

impl FailingProxy {
    /// Starts the proxy; returns its URL.
    pub async fn start(&self, fails: fn(&str) -> bool) -> String {
        let counts = self.counts.clone();
        let http = reqwest::Client::new();
        let app = axum::Router::new().fallback(
            move |method: axum::http::Method,
                  uri: axum::http::Uri,
                  headers: axum::http::HeaderMap,
                  body: axum::body::Bytes| {
                let (counts, http) = (counts.clone(), http.clone());
                async move {
                    let target = headers
                        .get("x-amz-target")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or_default()
                        .to_owned();
                    let mut failed = Vec::new();
                    let mut body = body.to_vec();
                    if target == "AmazonSQS.SendMessageBatch" {
                        let mut request: serde_json::Value =
                            serde_json::from_slice(&body).expect("batch json");
                        let entries = request["Entries"].as_array().cloned().unwrap_or_default();
                        let mut kept = Vec::new();
                        for entry in entries {
                            let id = entry["MessageAttributes"]["pgoutbox-id"]["StringValue"]
                                .as_str()
                                .unwrap_or_default()
                                .to_owned();
                            let mut counts = counts.lock().expect("counts");
                            let count = counts.entry(id.clone()).or_default();
                            count.0 += 1;
                            if count.0 == 1 && fails(&id) {
                                failed.push(serde_json::json!({
                                    "Id": entry["Id"], "SenderFault": false,
                                    "Code": "InternalError", "Message": "injected by the test's proxy"
                                }));
                            } else {
                                count.1 += 1;
                                kept.push(entry);
                            }
                        }
                        request["Entries"] = serde_json::Value::Array(kept);
                        body = serde_json::to_vec(&request).expect("json");
                    }
                    let mut forward = http.request(method, format!("{EMULATOR}{uri}"));
                    for (name, value) in &headers {
                        if name != "host" && name != "content-length" {
                            forward = forward.header(name, value);
                        }
                    }
                    let answer = forward.body(body).send().await.expect("emulator");
                    let status = answer.status();
                    let mut reply = answer.bytes().await.expect("answer").to_vec();
                    if !failed.is_empty() && status.is_success() {
                        let mut json: serde_json::Value =
                            serde_json::from_slice(&reply).expect("answer json");
                        let mut all = json["Failed"].as_array().cloned().unwrap_or_default();
                        all.extend(failed);
                        json["Failed"] = serde_json::Value::Array(all);
                        reply = serde_json::to_vec(&json).expect("json");
                    }
                    (
                        status,
                        [("content-type", "application/x-amz-json-1.0")],
                        reply,
                    )
                }
            },
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        tokio::spawn(async move { axum::serve(listener, app).await });
        tokio::time::sleep(Duration::from_millis(10)).await;
        url
    }
}
