//! The `kafka` sink against a local Kafka-API broker (Tansu on 127.0.0.1:19092; `.ci/run` starts
//! it). Needs `--features kafka`.
#![cfg(feature = "kafka")]

mod common;

use std::collections::HashMap;
use std::time::Duration;

use futures::StreamExt;
use pgoutbox::engine::Relay;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

use common::cloudevents;
use common::sinks::{
    assert_delivered, assert_not_forged, commit_events, committed, deliver_forged, sink_config,
    unique, unpublish_all, Got,
};
use common::{parse_config, TestDb};

const BROKERS: &str = "127.0.0.1:19092";

async fn create_topic(name: &str) {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", BROKERS)
        .create()
        .expect("admin client");
    let results = admin
        .create_topics(
            &[NewTopic::new(name, 1, TopicReplication::Fixed(1))],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
        )
        .await
        .expect("create topic (Tansu on 127.0.0.1:19092?)");
    for r in results {
        r.expect("topic created");
    }
}

/// Reads `n` records of partition 0 from the beginning.
async fn consume(topic: &str, n: usize) -> Vec<Got> {
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", BROKERS)
        .set("group.id", unique("pgt-group-"))
        .set("enable.auto.commit", "false")
        .create()
        .expect("consumer");
    let mut assignment = TopicPartitionList::new();
    assignment
        .add_partition_offset(topic, 0, Offset::Beginning)
        .expect("partition");
    consumer.assign(&assignment).expect("assign");
    let mut stream = consumer.stream();
    let mut got = Vec::new();
    while got.len() < n {
        let m = tokio::time::timeout(Duration::from_secs(20), stream.next())
            .await
            .expect("a record within 20 s")
            .expect("stream open")
            .expect("record");
        let mut headers = HashMap::new();
        if let Some(hs) = m.headers() {
            for h in hs.iter() {
                headers.insert(
                    h.key.to_owned(),
                    String::from_utf8_lossy(h.value.unwrap_or_default()).into_owned(),
                );
            }
        }
        got.push(Got {
            id: headers.get("id").cloned().unwrap_or_default(),
            key: m.key().map(|k| String::from_utf8_lossy(k).into_owned()),
            payload: m.payload().unwrap_or_default().to_vec(),
            headers,
        });
    }
    got
}

/// `body = "cloudevents"` and `"cloudevents-binary"` (`ce_*` headers): the SDK reads every record
/// as the event sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cloudevents_structured_and_binary_are_read_by_the_sdk() {
    let db = TestDb::migrated().await;
    let prefix = unique("pgtce");
    let topic = format!("{prefix}.order.created");
    create_topic(&topic).await;
    let settings = format!("brokers = \"{BROKERS}\"\ntopic = \"{prefix}.{{topic}}\"\n");
    let mut seen = 0;
    cloudevents::both_modes(&db, "kafka", &settings, "ce_", || {
        let topic = topic.clone();
        seen += 6;
        async move { consume(&topic, seen).await[seen - 6..].to_vec() }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_are_produced_with_keys_headers_and_ids() {
    let db = TestDb::migrated().await;
    let prefix = unique("pgt");
    let topic = format!("{prefix}.acme.order.created");
    create_topic(&topic).await;
    let config = parse_config(&sink_config(
        &db,
        "kafka",
        &format!("brokers = \"{BROKERS}\"\ntopic = \"{prefix}.{{header.x-tenant}}.{{topic}}\"\n"),
    ));
    commit_events(&db, 30, "order.created").await;
    let expected = committed(&db).await;
    let relay = Relay::new(db.pool.clone(), &config).expect("relay");
    let report = relay.run_once().await.expect("run");
    assert_eq!(report.delivered, 30, "{report:?}");

    let got = consume(&topic, 30).await;
    assert_delivered(&expected, &got);

    unpublish_all(&db).await;
    let report = relay.run_once().await.expect("run again");
    assert_eq!(report.delivered, 30, "{report:?}");
    let all = consume(&topic, 60).await;
    assert_delivered(&expected, &all[30..]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn event_headers_cannot_set_the_id_and_topic_headers() {
    let db = TestDb::migrated().await;
    let topic = unique("pgtforge.");
    create_topic(&topic).await;
    let id = deliver_forged(
        &db,
        "kafka",
        &format!("brokers = \"{BROKERS}\"\ntopic = \"{topic}\"\n"),
    )
    .await;
    let got = consume(&topic, 1).await;
    assert_not_forged(
        &got[0],
        &id,
        &[("id", id.as_str()), ("topic", "order.created")],
        &["id", "topic"],
    );
}

/// `/readyz` asks the brokers for metadata: ready against the live broker, not ready (with
/// librdkafka's reason) against a closed port.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_asks_the_brokers_for_metadata() {
    let db = TestDb::migrated().await;
    let up = Relay::new(
        db.pool.clone(),
        &parse_config(&sink_config(
            &db,
            "kafka",
            &format!("brokers = \"{BROKERS}\"\n"),
        )),
    )
    .expect("relay");
    let lines = up.readiness().await.expect("ready against the live broker");
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("destination ") && l.contains("ok")),
        "{lines:?}"
    );

    let closed = common::closed_port();
    let down = Relay::new(
        db.pool.clone(),
        &parse_config(&sink_config(
            &db,
            "kafka",
            &format!("brokers = \"127.0.0.1:{closed}\"\n"),
        )),
    )
    .expect("relay");
    let lines = down
        .readiness()
        .await
        .expect_err("not ready on a closed port");
    assert!(
        lines.iter().any(|l| l.contains("Kafka is not reachable")),
        "{lines:?}"
    );
}

#[test]
fn bad_settings_are_config_errors() {
    for (settings, says) in [
        (
            "brokers = \"h:1\"\ntopic = \"a/b\"",
            "not a valid Kafka topic",
        ),
        (
            "brokers = \"h:1\"\nproperties = { acks = \"1\" }",
            "cannot be overridden",
        ),
        ("brokers = \"\"", "brokers"),
        ("brokers = \"kafka:ninety\"", "key `brokers`"),
        (
            "brokers = \"h:1\"\ntls = { ca_file = \"/etc/ssl/certs/ca-certificates.crt\" }",
            "is not \"ssl\" or \"sasl_ssl\"",
        ),
        (
            "brokers = \"h:1\"\nproperties = { \"security.protocol\" = \"ssl\", \"ssl.ca.location\" = \"/x\" }",
            "through the `tls` table",
        ),
        (
            "brokers = \"h:1\"\nproperties = { \"security.protocol\" = \"ssl\" }\ntls = { ca_file = \"/nonexistent/ca.pem\" }",
            "tls.ca_file",
        ),
    ] {
        let text = format!("[[destinations]]\nname = \"k\"\ntype = \"kafka\"\n{settings}\n");
        let e = pgoutbox::config::Config::parse(&text, |_| None)
            .and_then(|config| pgoutbox::sinks::check(&config))
            .expect_err(settings)
            .to_string();
        assert!(e.contains(says), "{settings}: {e}");
    }
}
