//! The `rabbitmq` sink against the local RabbitMQ (127.0.0.1:5672, guest/guest).
#![cfg(feature = "rabbitmq")]

mod common;

use pgoutbox::engine::Relay;

use common::amqp::{channel, consume, queue, URL};
use common::cloudevents;
use common::sinks::{
    assert_delivered, assert_not_forged, commit_and_run_once, commit_events, committed,
    deliver_forged, sink_config, unique, unpublish_all,
};
use common::{parse_config, TestDb};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_are_confirmed_persistent_and_redeliveries_keep_their_id() {
    let db = TestDb::migrated().await;
    let name = unique("pgt_");
    let (_conn, ch) = channel().await;
    queue(&ch, &name, &format!("{name}.#")).await;
    let config = parse_config(&sink_config(
        &db,
        "rabbitmq",
        &format!(
            "url = \"{URL}\"\nexchange = \"amq.topic\"\nrouting_key = \"{name}.{{header.x-tenant}}.{{topic}}\"\n"
        ),
    ));
    commit_events(&db, 30, "order.created").await;
    let expected = committed(&db).await;
    let relay = Relay::new(db.pool.clone(), &config).expect("relay");
    let report = relay.run_once().await.expect("run");
    assert_eq!(report.delivered, 30, "{report:?}");

    let (got, keys, modes) = consume(&ch, &name, 30).await;
    assert_delivered(&expected, &got);
    assert!(
        keys.iter()
            .all(|k| *k == format!("{name}.acme.order.created")),
        "{keys:?}"
    );
    assert!(
        modes.iter().all(|m| *m == 2),
        "persistent delivery mode: {modes:?}"
    );

    // Published again (a relay that died before settling): same message_id on every copy.
    unpublish_all(&db).await;
    let report = relay.run_once().await.expect("run again");
    assert_eq!(report.delivered, 30, "{report:?}");
    let (again, _, _) = consume(&ch, &name, 30).await;
    assert_delivered(&expected, &again);
    ch.queue_delete(name.as_str().into(), Default::default())
        .await
        .expect("cleanup");
}

/// `body = "cloudevents"` and `"cloudevents-binary"` (`cloudEvents_*` headers): the SDK reads
/// every message as the event sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cloudevents_structured_and_binary_are_read_by_the_sdk() {
    let db = TestDb::migrated().await;
    let name = unique("pgtce_");
    let (_conn, ch) = channel().await;
    queue(&ch, &name, &format!("{name}.#")).await;
    let settings =
        format!("url = \"{URL}\"\nexchange = \"amq.topic\"\nrouting_key = \"{name}.{{topic}}\"\n");
    cloudevents::both_modes(&db, "rabbitmq", &settings, "cloudEvents_", || {
        let name = name.clone();
        async move {
            // A channel per run: its consumer ends with it and takes no later message.
            let (conn, ch) = channel().await;
            let (got, _, _) = consume(&ch, &name, 6).await;
            let _ = conn.close(200, "done".into()).await;
            got
        }
    })
    .await;
    ch.queue_delete(name.as_str().into(), Default::default())
        .await
        .expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unroutable_event_is_rejected_as_no_route() {
    let db = TestDb::migrated().await;
    let name = unique("pgtnoroute_");
    let (report, errors) = commit_and_run_once(
        &db,
        3,
        "nobody.listens",
        "rabbitmq",
        &format!("url = \"{URL}\"\nexchange = \"amq.topic\"\nrouting_key = \"{name}.{{topic}}\"\n"),
    )
    .await;
    assert_eq!(report.dead, 3, "{report:?}");
    assert!(errors.iter().all(|e| e.contains("no route")), "{errors:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn event_headers_cannot_set_pgoutbox_or_routing_headers() {
    // Passed through, a string `CC` header makes RabbitMQ close the channel (it must be an
    // array), failing every message in flight; as an array it would copy the message elsewhere.
    let db = TestDb::migrated().await;
    let name = unique("pgtforge_");
    let (_conn, ch) = channel().await;
    queue(&ch, &name, &format!("{name}.#")).await;
    let id = deliver_forged(
        &db,
        "rabbitmq",
        &format!("url = \"{URL}\"\nexchange = \"amq.topic\"\nrouting_key = \"{name}.{{topic}}\"\n"),
    )
    .await;
    let (got, _, _) = consume(&ch, &name, 1).await;
    assert_not_forged(
        &got[0],
        &id,
        &[("pgoutbox-topic", "order.created"), ("pgoutbox-key", "k")],
        &["pgoutbox-topic", "pgoutbox-key", "pgoutbox-id", "cc", "bcc"],
    );
    ch.queue_delete(name.as_str().into(), Default::default())
        .await
        .expect("cleanup");
}

#[test]
fn bad_settings_are_config_errors() {
    for (settings, says) in [
        ("url = \"http://x\"", "url"),
        (
            "url = \"amqp://h\"\nrouting_key = \"{oops\"",
            "never closed",
        ),
        (
            "url = \"amqp://h\"\nmax_message_bytes = 0",
            "max_message_bytes",
        ),
        (
            format!(
                "url = \"amqp://h\"\nrouting_key = \"{}.{{topic}}\"",
                "k".repeat(256)
            )
            .as_str(),
            "key `routing_key`",
        ),
    ] {
        let text = format!("[[destinations]]\nname = \"r\"\ntype = \"rabbitmq\"\n{settings}\n");
        let e = pgoutbox::config::Config::parse(&text, |_| None)
            .and_then(|config| pgoutbox::sinks::check(&config))
            .expect_err(settings)
            .to_string();
        assert!(e.contains(says), "{settings}: {e}");
    }
}
