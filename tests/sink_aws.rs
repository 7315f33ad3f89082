//! The AWS sinks against the local emulator (moto on 127.0.0.1:5055, started by `.ci/run`): the
//! black-box check of the other brokers — 300 events over 20 keys go out through a running
//! relay and a consumer reads every one back (lost 0, ids carried, per-key order where the service
//! keeps it) — for SQS standard and FIFO, SNS through an SQS subscription, Kinesis, EventBridge
//! through a rule to SQS and the S3 archive; and a batch whose entries partly fail re-sends only
//! those.
#![cfg(all(
    feature = "sqs",
    feature = "sns",
    feature = "kinesis",
    feature = "eventbridge",
    feature = "s3"
))]

mod common;

use std::time::Duration;

use common::aws::{self, check, commit, drain_queue, queue, Seen, EVENTS};
use common::sinks::{sink_config, unique};
use common::{parse_config, wait_for, Running, TestDb};

/// A relay config with one destination of `kind` and `settings`, retrying after 100 ms, its calls
/// given a minute: the emulator answers slowly when every test leans on it at once.
fn config(db: &TestDb, kind: &str, settings: &str) -> String {
    sink_config(db, kind, &format!("timeout = \"60s\"\n{settings}"))
        .replace("retry_schedule = [\"1s\"]", "retry_schedule = [\"100ms\"]")
        .replace("publish_timeout = \"20s\"", "publish_timeout = \"120s\"")
}

/// Runs a relay with one destination of `kind` and `settings` until every event is published.
async fn relay_until_published(db: &TestDb, kind: &str, settings: &str) {
    relay_until_n(db, kind, settings, EVENTS).await;
}

/// Runs a relay with one destination of `kind` and `settings` until `n` events are published.
async fn relay_until_n(db: &TestDb, kind: &str, settings: &str, n: usize) {
    let config = config(db, kind, &format!("{}{settings}", aws::account()));
    let relay = Running::start(db, &config);
    let started = std::time::Instant::now();
    let done = wait_for(Duration::from_secs(300), || async {
        db.count("published_at IS NOT NULL").await == n as i64
    })
    .await;
    let report = relay.stop().await;
    let errors: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT last_error FROM outbox WHERE last_error IS NOT NULL LIMIT 5",
    )
    .fetch_all(&db.pool)
    .await
    .expect("errors");
    assert!(
        done,
        "every event published: {report:?}, errors {errors:#?}"
    );
    println!(
        "{kind}: published in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    assert_eq!(db.count("dead_at IS NOT NULL").await, 0, "none dead");
}

/// Runs the relay as [`relay_until_published`] with a consumer of `queue` beside it; returns
/// what the consumer read.
async fn relay_and_read(
    db: &TestDb,
    kind: &str,
    settings: &str,
    sqs: &aws_sdk_sqs::Client,
    queue: &str,
) -> Vec<aws_sdk_sqs::types::Message> {
    let reader = tokio::spawn(drain_queue(sqs.clone(), queue.to_owned(), EVENTS, 30));
    relay_until_published(db, kind, settings).await;
    reader.await.expect("consumer")
}

/// An SQS message as the event it carries (body: the payload; id and key in attributes).
fn from_sqs(m: &aws_sdk_sqs::types::Message) -> Seen {
    let attribute = |name: &str| {
        m.message_attributes()
            .and_then(|a| a.get(name))
            .and_then(|v| v.string_value())
            .unwrap_or_default()
            .to_owned()
    };
    let payload: serde_json::Value =
        serde_json::from_str(m.body().unwrap_or_default()).expect("payload json");
    assert_eq!(
        attribute("x-tenant"),
        "acme",
        "headers travel as attributes"
    );
    Seen {
        id: attribute("pgoutbox-id"),
        key: attribute("pgoutbox-key"),
        n: payload["n"].as_i64().expect("n"),
    }
}

/// Sends every event to the queue `name` through a running relay; checks what a consumer read.
/// Returns the database, the queue's client and URL.
async fn sqs_roundtrip(name: &str) -> (TestDb, aws_sdk_sqs::Client, String) {
    aws::use_emulator_account();
    let sqs = aws_sdk_sqs::Client::new(&aws::sdk().await);
    let (url, _) = queue(&sqs, name).await;
    let db = TestDb::migrated().await;
    let committed = commit(&db, "order.created").await;
    // Per-key order across batches is the relay's when asked for; a FIFO queue keeps it after.
    let fifo = name.ends_with(".fifo");
    let ordering = if fifo { "ordering = \"key\"\n" } else { "" };
    let settings = format!("queue_url = \"{url}\"\n{ordering}");
    let read = relay_and_read(&db, "sqs", &settings, &sqs, &url).await;
    let got: Vec<Seen> = read.iter().map(from_sqs).collect();
    check(name, &committed, &got, fifo);
    (db, sqs, url)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqs_standard_queue_gets_every_event() {
    sqs_roundtrip(&unique("pgt-std-")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqs_fifo_queue_keeps_each_keys_order_and_drops_redeliveries() {
    let name = format!("{}.fifo", unique("pgt-fifo-"));
    let (_, sqs, _) = sqs_roundtrip(&name).await;

    // Deduplication by event id: every event sent again (as after a relay died before settling)
    // within the five-minute window is dropped by SQS. (The emulator forgets an id once its
    // message is deleted, so the queue is read only after both sends.)
    let (url, _) = queue(&sqs, &format!("{}.fifo", unique("pgt-dedup-"))).await;
    let db = TestDb::migrated().await;
    let committed = aws::commit_n(&db, "order.created", 100).await;
    let settings = format!("queue_url = \"{url}\"\n");
    relay_until_n(&db, "sqs", &settings, 100).await;
    sqlx::query("UPDATE outbox SET published_at = NULL, next_attempt_at = now()")
        .execute(&db.pool)
        .await
        .expect("unpublish");
    relay_until_n(&db, "sqs", &settings, 100).await;
    let got: Vec<Seen> = drain_queue(sqs, url, 200, 3)
        .await
        .iter()
        .map(from_sqs)
        .collect();
    assert_eq!(
        got.len(),
        100,
        "redeliveries within the window are dropped by SQS"
    );
    check("FIFO redelivered", &committed, &got, false);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sns_topic_reaches_an_sqs_subscription() {
    aws::use_emulator_account();
    let config = aws::sdk().await;
    let (sqs, sns) = (
        aws_sdk_sqs::Client::new(&config),
        aws_sdk_sns::Client::new(&config),
    );
    let name = unique("pgt-sns-");
    let (url, queue_arn) = queue(&sqs, &name).await;
    let topic = sns
        .create_topic()
        .name(&name)
        .send()
        .await
        .expect("create topic")
        .topic_arn()
        .expect("arn")
        .to_owned();
    sns.subscribe()
        .topic_arn(&topic)
        .protocol("sqs")
        .endpoint(&queue_arn)
        .attributes("RawMessageDelivery", "true")
        .send()
        .await
        .expect("subscribe");
    let db = TestDb::migrated().await;
    let committed = commit(&db, "order.created").await;
    let settings = format!("topic_arn = \"{topic}\"\n");
    let read = relay_and_read(&db, "sns", &settings, &sqs, &url).await;
    let got: Vec<Seen> = read.iter().map(from_sqs).collect();
    check("SNS", &committed, &got, false);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kinesis_stream_keeps_each_keys_order() {
    aws::use_emulator_account();
    let kinesis = aws_sdk_kinesis::Client::new(&aws::sdk().await);
    let stream = unique("pgt-stream-");
    kinesis
        .create_stream()
        .stream_name(&stream)
        .shard_count(2)
        .send()
        .await
        .expect("create stream (moto on 127.0.0.1:5055: bash .ci/run starts it)");
    let db = TestDb::migrated().await;
    let committed = commit(&db, "order.created").await;
    relay_until_published(
        &db,
        "kinesis",
        &format!("stream = \"{stream}\"\nordering = \"key\"\n"),
    )
    .await;

    let mut got = Vec::new();
    let shards = kinesis
        .list_shards()
        .stream_name(&stream)
        .send()
        .await
        .expect("shards");
    for shard in shards.shards() {
        let mut iterator = kinesis
            .get_shard_iterator()
            .stream_name(&stream)
            .shard_id(shard.shard_id())
            .shard_iterator_type(aws_sdk_kinesis::types::ShardIteratorType::TrimHorizon)
            .send()
            .await
            .expect("iterator")
            .shard_iterator()
            .map(str::to_owned);
        while let Some(at) = iterator {
            let out = kinesis
                .get_records()
                .shard_iterator(at)
                .send()
                .await
                .expect("records");
            if out.records().is_empty() {
                break;
            }
            for record in out.records() {
                let envelope: serde_json::Value =
                    serde_json::from_slice(record.data().as_ref()).expect("envelope");
                assert_eq!(
                    record.partition_key(),
                    envelope["key"].as_str(),
                    "partition key = key"
                );
                got.push(aws::from_envelope(&envelope));
            }
            iterator = out.next_shard_iterator().map(str::to_owned);
        }
    }
    check("Kinesis", &committed, &got, true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eventbridge_bus_reaches_sqs_through_a_rule() {
    aws::use_emulator_account();
    let config = aws::sdk().await;
    let (sqs, events) = (
        aws_sdk_sqs::Client::new(&config),
        aws_sdk_eventbridge::Client::new(&config),
    );
    let name = unique("pgt-eb-");
    let (url, queue_arn) = queue(&sqs, &name).await;
    // The source is this test's own: other tests' events on the shared bus do not match.
    let source = format!("pgoutbox.{name}");
    events
        .put_rule()
        .name(&name)
        .event_pattern(serde_json::json!({ "source": [source] }).to_string())
        .send()
        .await
        .expect("rule");
    events
        .put_targets()
        .rule(&name)
        .targets(
            aws_sdk_eventbridge::types::Target::builder()
                .id("queue")
                .arn(&queue_arn)
                .build()
                .expect("target"),
        )
        .send()
        .await
        .expect("target");
    let db = TestDb::migrated().await;
    let committed = commit(&db, "order.created").await;
    let settings = format!("source = \"{source}\"\n");
    let got: Vec<Seen> = relay_and_read(&db, "eventbridge", &settings, &sqs, &url)
        .await
        .iter()
        .map(|m| {
            let event: serde_json::Value =
                serde_json::from_str(m.body().unwrap_or_default()).expect("event json");
            assert_eq!(event["detail-type"], "order.created", "detail-type = topic");
            assert_eq!(event["source"], source.as_str());
            aws::from_envelope(&event["detail"])
        })
        .collect();
    check("EventBridge", &committed, &got, false);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_archive_holds_every_event_in_the_objects_listed() {
    aws::use_emulator_account();
    let s3 = aws_sdk_s3::Client::from_conf(
        aws_sdk_s3::config::Builder::from(&aws::sdk().await)
            .force_path_style(true)
            .build(),
    );
    let bucket = unique("pgt-archive-");
    s3.create_bucket()
        .bucket(&bucket)
        .send()
        .await
        .expect("bucket");
    let db = TestDb::migrated().await;
    let committed = commit(&db, "order.created").await;
    relay_until_published(
        &db,
        "s3",
        &format!("bucket = \"{bucket}\"\nprefix = \"archive/{{header.x-tenant}}\"\n"),
    )
    .await;

    let listed = s3
        .list_objects_v2()
        .bucket(&bucket)
        .send()
        .await
        .expect("list");
    let today = chrono::Utc::now().format("%Y/%m/%d").to_string();
    let mut got = Vec::new();
    for object in listed.contents() {
        let key = object.key().expect("key");
        assert!(
            key.starts_with(&format!("archive/acme/{today}/order.created/"))
                && key.ends_with(".jsonl"),
            "object name {key}"
        );
        let body = s3
            .get_object()
            .bucket(&bucket)
            .key(key)
            .send()
            .await
            .expect("get");
        let bytes = body.body.collect().await.expect("read").into_bytes();
        let lines: Vec<Seen> = String::from_utf8_lossy(&bytes)
            .lines()
            .map(|l| aws::from_envelope(&serde_json::from_str(l).expect("line json")))
            .collect();
        let first = lines.first().expect("a line").id.clone();
        assert!(
            key.ends_with(&format!("/{first}.jsonl")),
            "named by its first event: {key}"
        );
        got.extend(lines);
    }
    println!("S3: {} objects", listed.contents().len());
    check("S3", &committed, &got, false);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partly_failed_batch_resends_only_its_failed_entries() {
    aws::use_emulator_account();
    let sqs = aws_sdk_sqs::Client::new(&aws::sdk().await);
    let (url, _) = queue(&sqs, &unique("pgt-partial-")).await;
    let proxy = aws::FailingProxy::default();
    // About a third of the events fail their first try.
    let endpoint = proxy
        .start(|id| id.starts_with(['0', '1', '2', '3', '4']))
        .await;
    let db = TestDb::migrated().await;
    let committed = commit(&db, "order.created").await;
    let settings = format!("queue_url = \"{url}\"\nbreaker = {{ failures = 0 }}\n")
        + &aws::account().replace(aws::EMULATOR, &endpoint);
    // One pass at a time (`relay --once`), so that no batch is claimed twice while in flight:
    // every entry the proxy sees twice was sent again because it failed.
    let relay = pgoutbox::engine::Relay::new(
        db.pool.clone(),
        &parse_config(&config(&db, "sqs", &settings)),
    )
    .expect("relay");
    let reader = tokio::spawn(drain_queue(sqs.clone(), url.clone(), EVENTS, 30));
    let done = wait_for(Duration::from_secs(300), || async {
        relay.run_once().await.expect("pass");
        tokio::time::sleep(Duration::from_millis(100)).await;
        db.count("published_at IS NOT NULL").await == EVENTS as i64
    })
    .await;
    assert!(done, "every event published");

    let counts = proxy.counts.lock().expect("counts").clone();
    let failed_once = counts.values().filter(|(seen, _)| *seen == 2).count();
    println!("{failed_once} of {EVENTS} entries failed once and were sent again");
    assert!(
        failed_once > EVENTS / 5,
        "failures were injected ({failed_once})"
    );
    for event in &committed {
        let (seen, passed) = counts.get(&event.id).copied().unwrap_or_default();
        assert_eq!(passed, 1, "{} reached the emulator once", event.id);
        let expected = if event.id.starts_with(['0', '1', '2', '3', '4']) {
            2
        } else {
            1
        };
        assert_eq!(seen, expected, "{} sent {seen} times", event.id);
    }
    let retried: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox WHERE attempts > 0")
        .fetch_one(&db.pool)
        .await
        .expect("attempts");
    assert_eq!(
        retried as usize, failed_once,
        "only the failed entries count an attempt"
    );
    let read = reader.await.expect("consumer");
    let got: Vec<Seen> = read.iter().map(from_sqs).collect();
    check("SQS behind the failing proxy", &committed, &got, false);
}

#[test]
fn bad_settings_are_config_errors() {
    for (kind, settings, says) in [
        ("sqs", "", "queue_url"),
        (
            "sqs",
            "queue_url = \"q\"\nbody = \"cloudevents-binary\"",
            "binary",
        ),
        (
            "sqs",
            "queue_url = \"q\"\nendpoint_url = \"ftp://x\"",
            "endpoint_url",
        ),
        ("sqs", "queue_url = \"q\"\nregion = \"\"", "region"),
        ("sqs", "queue_url = \"{queue\"", "never closed"),
        (
            "sns",
            "topic_arn = \"t\"\ntls = { cert_file = \"c\", key_file = \"k\" }",
            "client certificate",
        ),
        ("kinesis", "stream = \"s\"\ntimeout = \"0s\"", "timeout"),
        ("eventbridge", "source = \"\"", "source"),
        ("eventbridge", "bus = \"b\"", "unknown field"),
        ("s3", "bucket = \" \"", "bucket"),
        // Settings that can never work are refused when loaded, naming the key.
        ("sqs", "queue_url = \"orders\"", "key `queue_url`"),
        (
            "sqs",
            "queue_url = \"ftp://sqs.example.com/1/q\"",
            "key `queue_url`",
        ),
        ("sqs", "queue_url = \"{topic}\"", "key `queue_url`"),
        (
            "sqs",
            "queue_url = \"https://sqs.eu-west-1.amazonaws.com/1/q\"\nregion = \"eu west 1\"",
            "key `region`",
        ),
        ("sns", "topic_arn = \"orders\"", "key `topic_arn`"),
        (
            "sns",
            "topic_arn = \"arn:aws:sqs:eu-west-1:1:q\"",
            "key `topic_arn`",
        ),
        ("kinesis", "stream = \"a stream\"", "key `stream`"),
        (
            "eventbridge",
            "event_bus = \"arn:aws:sns:x:1:b\"",
            "key `event_bus`",
        ),
        ("s3", "bucket = \"My_Bucket\"", "key `bucket`"),
    ] {
        let text = format!("[[destinations]]\nname = \"aws\"\ntype = \"{kind}\"\n{settings}\n");
        let e = pgoutbox::config::Config::parse(&text, |_| None)
            .and_then(|config| pgoutbox::sinks::check(&config))
            .expect_err(settings)
            .to_string();
        assert!(e.contains(says), "{kind} {settings}: {e}");
    }
}
