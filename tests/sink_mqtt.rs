//! The `mqtt` sink against the local Mosquitto (127.0.0.1:1883), MQTT 5.
#![cfg(feature = "mqtt")]

mod common;

use std::collections::HashMap;
use std::time::Duration;

use pgoutbox::engine::Relay;
use rumqttc::v5::mqttbytes::v5::Packet;
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::{AsyncClient, Event, MqttOptions};
use tokio::sync::mpsc;

use common::cloudevents;
use common::private::Private;
use common::sinks::{
    assert_delivered, assert_not_forged, commit_events, committed, credentials_scenario,
    deliver_forged, run_once, sink_config, unique, unpublish_all, Got,
};
use common::{parse_config, TestDb};

/// A QoS 1 subscriber on `filter`; returns (topic, message) pairs as they arrive.
async fn subscribe(filter: &str) -> (AsyncClient, mpsc::UnboundedReceiver<(String, Got)>) {
    let mut options = MqttOptions::new(unique("pgt-sub-"), "127.0.0.1", 1883);
    options.set_keep_alive(Duration::from_secs(30));
    let (client, mut eventloop) = AsyncClient::new(options, 100);
    client
        .subscribe(filter, QoS::AtLeastOnce)
        .await
        .expect("subscribe");
    let (tx, rx) = mpsc::unbounded_channel();
    let (subscribed_tx, subscribed) = tokio::sync::oneshot::channel();
    let mut subscribed_tx = Some(subscribed_tx);
    tokio::spawn(async move {
        loop {
            match eventloop.poll().await {
                Ok(Event::Incoming(Packet::SubAck(_))) => {
                    if let Some(s) = subscribed_tx.take() {
                        let _ = s.send(());
                    }
                }
                Ok(Event::Incoming(Packet::Publish(p))) => {
                    let headers: HashMap<String, String> = p
                        .properties
                        .map(|props| props.user_properties.into_iter().collect())
                        .unwrap_or_default();
                    let got = Got {
                        id: headers.get("pgoutbox-id").cloned().unwrap_or_default(),
                        key: headers.get("pgoutbox-key").cloned(),
                        payload: p.payload.to_vec(),
                        headers,
                    };
                    let topic = String::from_utf8_lossy(&p.topic).into_owned();
                    if tx.send((topic, got)).is_err() {
                        return;
                    }
                }
                Ok(_) => {}
                Err(e) => {
                    panic!("subscriber connection failed (Mosquitto on 127.0.0.1:1883?): {e}")
                }
            }
        }
    });
    tokio::time::timeout(Duration::from_secs(10), subscribed)
        .await
        .expect("SUBACK within 10 s")
        .expect("subscriber alive");
    (client, rx)
}

async fn receive(
    rx: &mut mpsc::UnboundedReceiver<(String, Got)>,
    n: usize,
) -> (Vec<String>, Vec<Got>) {
    let mut topics = Vec::new();
    let mut got = Vec::new();
    while got.len() < n {
        let (topic, g) = tokio::time::timeout(Duration::from_secs(10), rx.recv())
            .await
            .expect("a message within 10 s")
            .expect("subscriber alive");
        topics.push(topic);
        got.push(g);
    }
    (topics, got)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_are_published_at_qos1_with_user_properties() {
    let db = TestDb::migrated().await;
    let prefix = unique("pgt/");
    let (_sub, mut rx) = subscribe(&format!("{prefix}/#")).await;
    let config = parse_config(&sink_config(
        &db,
        "mqtt",
        &format!(
            "url = \"mqtt://127.0.0.1:1883\"\ntopic = \"{prefix}/{{header.x-tenant}}/{{topic}}\"\n"
        ),
    ));
    commit_events(&db, 30, "order.created").await;
    let expected = committed(&db).await;
    let relay = Relay::new(db.pool.clone(), &config).expect("relay");
    let report = relay.run_once().await.expect("run");
    assert_eq!(report.delivered, 30, "{report:?}");

    let (topics, got) = receive(&mut rx, 30).await;
    assert_delivered(&expected, &got);
    assert!(
        topics
            .iter()
            .all(|t| *t == format!("{prefix}/acme/order.created")),
        "{topics:?}"
    );

    unpublish_all(&db).await;
    let report = relay.run_once().await.expect("run again");
    assert_eq!(report.delivered, 30, "{report:?}");
    let (_, again) = receive(&mut rx, 30).await;
    assert_delivered(&expected, &again);
}

/// `body = "cloudevents"` and `"cloudevents-binary"` (user properties named as the attributes):
/// the SDK reads every message as the event sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cloudevents_structured_and_binary_are_read_by_the_sdk() {
    let db = TestDb::migrated().await;
    let prefix = unique("pgtce/");
    let (_sub, rx) = subscribe(&format!("{prefix}/#")).await;
    let rx = std::sync::Arc::new(tokio::sync::Mutex::new(rx));
    let settings = format!("url = \"mqtt://127.0.0.1:1883\"\ntopic = \"{prefix}/{{topic}}\"\n");
    cloudevents::both_modes(&db, "mqtt", &settings, "", || {
        let rx = rx.clone();
        async move { receive(&mut *rx.lock().await, 6).await.1 }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_topic_is_rejected_and_others_still_delivered() {
    let db = TestDb::migrated().await;
    let prefix = unique("pgt/");
    commit_events(&db, 2, "fine").await;
    commit_events(&db, 1, "wild/#").await;
    let (report, _) = run_once(
        &db,
        "mqtt",
        &format!("url = \"mqtt://127.0.0.1:1883\"\ntopic = \"{prefix}/{{topic}}\"\n"),
    )
    .await;
    assert_eq!((report.delivered, report.dead), (2, 1), "{report:?}");
}

#[test]
fn bad_settings_are_config_errors() {
    for (settings, says) in [
        ("url = \"ws://h\"", "scheme"),
        (
            "url = \"mqtt://h\"\ntls = { ca_file = \"/nonexistent/ca.pem\" }",
            "not mqtts://",
        ),
        (
            "url = \"mqtt://h\"\ntopic = \"a/#\"",
            "not a valid MQTT topic",
        ),
        (
            "url = \"mqtt://h\"\ntopic = \"{header}\"",
            "unknown placeholder",
        ),
    ] {
        let text = format!("[[destinations]]\nname = \"m\"\ntype = \"mqtt\"\n{settings}\n");
        let e = pgoutbox::config::Config::parse(&text, |_| None)
            .and_then(|config| pgoutbox::sinks::check(&config))
            .expect_err(settings)
            .to_string();
        assert!(e.contains(says), "{settings}: {e}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn event_headers_cannot_set_the_pgoutbox_user_properties() {
    let db = TestDb::migrated().await;
    let prefix = unique("pgtforge/");
    let (_sub, mut rx) = subscribe(&format!("{prefix}/#")).await;
    let id = deliver_forged(
        &db,
        "mqtt",
        &format!("url = \"mqtt://127.0.0.1:1883\"\ntopic = \"{prefix}/{{topic}}\"\n"),
    )
    .await;
    let (_, got) = receive(&mut rx, 1).await;
    assert_not_forged(
        &got[0],
        &id,
        &[
            ("pgoutbox-id", id.as_str()),
            ("pgoutbox-topic", "order.created"),
            ("pgoutbox-key", "k"),
        ],
        &["pgoutbox-id", "pgoutbox-topic", "pgoutbox-key"],
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn url_credentials_are_percent_decoded_and_a_wrong_password_is_retried_not_dead() {
    // A Mosquitto of this test's own with a password file; the shared one on 1883 is untouched.
    let password = "pa:ss+w@rd%";
    let broker = Private::mosquitto("pg+t@x", password);
    let url = |password: &str| {
        format!(
            "url = \"mqtt://pg+t%40x:{password}@127.0.0.1:{}\"\ntimeout = \"3s\"\n",
            broker.port
        )
    };

    // `+` is a plus (form-decoding made it a space and the login failed), `%40` an `@`, `%3A`
    // a `:`, `%25` a `%`; a refused login is retried, not dead-lettered.
    let errors = credentials_scenario("mqtt", "pa%3Ass+w%40rd%25", url).await;
    assert!(
        errors
            .iter()
            .all(|e| e.contains("MQTT") || e.contains("PUBACK")),
        "{errors:?}"
    );
}
