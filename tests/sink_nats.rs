//! The `nats` sink against the local NATS server with JetStream (127.0.0.1:4222).
#![cfg(feature = "nats")]

mod common;

use std::sync::Arc;

use pgoutbox::engine::{Destination, Relay};
use pgoutbox::sinks::nats::{NatsConfig, NatsSink};

use common::cloudevents;
use common::nats::{consume, jetstream, stored, stream_settings, URL};
use common::private::Private;
use common::sinks::{
    assert_delivered, assert_not_forged, commit_events, committed, credentials_scenario,
    deliver_forged, run_once, sink_config, unique, unpublish_all,
};
use common::{parse_config, TestDb};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_land_in_jetstream_and_redeliveries_are_deduplicated() {
    let db = TestDb::migrated().await;
    let stream = unique("PGT_");
    let prefix = unique("pgt");
    let config = parse_config(&sink_config(
        &db,
        "nats",
        &stream_settings(
            &format!("{prefix}.{{header.x-tenant}}.{{topic}}"),
            &stream,
            &prefix,
        ),
    ));
    commit_events(&db, 30, "order.created").await;
    let expected = committed(&db).await;

    // The sink is built by the test so it can read the duplicate count off the PubAcks.
    let dest = &config.destinations[0];
    let settings: NatsConfig =
        pgoutbox::config::sink_settings(&dest.sink.settings.to_table()).expect("settings");
    let sink = Arc::new(NatsSink::new(&dest.name, settings).expect("sink"));
    let relay = Relay::with_destinations(
        db.pool.clone(),
        &config,
        vec![Destination {
            name: dest.name.clone(),
            sink: sink.clone(),
            retry: dest.retry.clone(),
        }],
    );
    let report = relay.run_once().await.expect("run");
    assert_eq!(report.delivered, 30, "{report:?}");
    assert_eq!(db.count("published_at IS NULL").await, 0);

    let js = jetstream().await;
    let (got, subjects) = consume(&js, &stream, 30).await;
    assert_delivered(&expected, &got);
    let want_subject = format!("{prefix}.acme.order.created");
    assert!(subjects.iter().all(|s| *s == want_subject), "{subjects:?}");
    assert_eq!(sink.duplicates(), 0);

    // The same events again, as after a relay crash before settling: same Nats-Msg-Id, so
    // JetStream acknowledges them as duplicates and stores nothing new.
    unpublish_all(&db).await;
    let report = relay.run_once().await.expect("run again");
    assert_eq!(report.delivered, 30, "{report:?}");
    assert_eq!(
        sink.duplicates(),
        30,
        "every redelivery acked as a duplicate"
    );
    assert_eq!(stored(&js, &stream).await, 30, "no message stored twice");
    js.delete_stream(&stream).await.expect("cleanup");
}

/// `body = "cloudevents"` and `"cloudevents-binary"` (`ce-*` headers): the SDK reads every
/// message as the event sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cloudevents_structured_and_binary_are_read_by_the_sdk() {
    let db = TestDb::migrated().await;
    let js = jetstream().await;
    let prefix = unique("pgtce");
    let settings = stream_settings(&format!("{prefix}.{{topic}}"), &prefix, &prefix);
    let mut seen = 0;
    cloudevents::both_modes(&db, "nats", &settings, "ce-", || {
        let js = js.clone();
        let stream = prefix.clone();
        seen += 6;
        async move {
            let (got, _) = consume(&js, &stream, seen).await;
            got[seen - 6..].to_vec()
        }
    })
    .await;
    js.delete_stream(&prefix).await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subject_no_stream_takes_is_dead_lettered_and_a_bad_one_rejected() {
    let db = TestDb::migrated().await;
    let prefix = unique("pgtnone");
    commit_events(&db, 1, "x").await;
    // No key: the subject would end with an empty token.
    sqlx::query("INSERT INTO outbox (topic, payload) VALUES ('x', '{}')")
        .execute(&db.pool)
        .await
        .expect("insert");
    let (report, errors) = run_once(
        &db,
        "nats",
        &format!("url = \"{URL}\"\nsubject = \"{prefix}.{{key}}\"\n"),
    )
    .await;
    assert_eq!(report.dead, 2, "{report:?}");
    assert!(errors[0].contains("no JetStream stream"), "{errors:?}");
    assert!(errors[1].contains("invalid NATS subject"), "{errors:?}");
}

#[test]
fn bad_settings_are_config_errors() {
    for (settings, says) in [
        ("subject = \"a.{nope}\"", "unknown placeholder"),
        ("subject = \"a.*\"", "not a valid NATS subject"),
        ("create_stream = true", "`stream`"),
        ("stream = \"S\"", "only apply with `create_stream"),
        ("bogus = 1", "bogus"),
    ] {
        let text = format!(
            "[[destinations]]\nname = \"n\"\ntype = \"nats\"\nurl = \"{URL}\"\n{settings}\n"
        );
        let e = pgoutbox::config::Config::parse(&text, |_| None)
            .and_then(|config| pgoutbox::sinks::check(&config))
            .expect_err(settings)
            .to_string();
        assert!(e.contains(says), "{settings}: {e}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_larger_than_the_client_ack_window_is_delivered() {
    // async-nats allows 5,000 unacknowledged publishes; a 6,000-event batch must not wait on
    // itself.
    let db = TestDb::migrated().await;
    let stream = unique("PGTBIG_");
    let prefix = unique("pgtbig");
    let config = parse_config(
        &sink_config(
            &db,
            "nats",
            &stream_settings(&format!("{prefix}.{{topic}}"), &stream, &prefix),
        )
        .replace("[relay]\n", "[relay]\nbatch_size = 10000\n"),
    );
    commit_events(&db, 6000, "bulk").await;
    let report = Relay::new(db.pool.clone(), &config)
        .expect("relay")
        .run_once()
        .await
        .expect("run");
    assert_eq!(report.delivered, 6000, "{report:?}");
    assert_eq!(report.claimed, 6000, "one batch: {report:?}");
    let js = jetstream().await;
    assert_eq!(stored(&js, &stream).await, 6000);
    js.delete_stream(&stream).await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_traceparent_set_at_enqueue_arrives_in_the_nats_headers() {
    use opentelemetry::trace::{
        SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState,
    };

    let db = TestDb::migrated().await;
    let stream = unique("PGTRACE_");
    let prefix = unique("pgtrace");
    let traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let sc = SpanContext::new(
        TraceId::from_hex("0af7651916cd43dd8448eb211c80319c").expect("hex"),
        SpanId::from_hex("b7ad6b7169203331").expect("hex"),
        TraceFlags::SAMPLED,
        true,
        TraceState::default(),
    );
    let event = {
        let _guard = opentelemetry::Context::current()
            .with_remote_span_context(sc)
            .attach();
        pgoutbox::Event::new("order.created", &serde_json::json!({"order_id": 7})).expect("json")
    };
    let mut conn = db.pool.acquire().await.expect("conn");
    let id = pgoutbox::Outbox::default()
        .enqueue(&mut conn, &event)
        .await
        .expect("enqueue");
    drop(conn);
    let settings = stream_settings(&format!("{prefix}.{{topic}}"), &stream, &prefix);
    let (report, _) = run_once(&db, "nats", &settings).await;
    assert_eq!(report.delivered, 1, "{report:?}");

    let js = jetstream().await;
    let (got, _) = consume(&js, &stream, 1).await;
    assert_eq!(got[0].id, id.to_string());
    assert_eq!(
        got[0].headers.get("traceparent").map(String::as_str),
        Some(traceparent),
        "the producer's trace context, unchanged"
    );
    js.delete_stream(&stream).await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn event_headers_cannot_set_jetstream_or_pgoutbox_headers() {
    let db = TestDb::migrated().await;
    let stream = unique("PGTFORGE_");
    let prefix = unique("pgtforge");
    // Passed through, `Nats-Expected-Stream` would fail the publish and `Nats-Rollup` purge the
    // stream (or fail: rollups are off by default).
    let settings = stream_settings(&format!("{prefix}.{{topic}}"), &stream, &prefix);
    let id = deliver_forged(&db, "nats", &settings).await;
    let js = jetstream().await;
    let (got, _) = consume(&js, &stream, 1).await;
    assert_not_forged(
        &got[0],
        &id,
        &[
            ("Nats-Msg-Id", id.as_str()),
            ("pgoutbox-topic", "order.created"),
            ("pgoutbox-key", "k"),
        ],
        &[
            "nats-msg-id",
            "nats-expected-stream",
            "nats-rollup",
            "pgoutbox-topic",
            "pgoutbox-key",
            "pgoutbox-id",
        ],
    );
    js.delete_stream(&stream).await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn url_credentials_log_in_and_a_wrong_password_is_retried_not_dead() {
    // A server of this test's own: the shared one has no users.
    let user = "pg+t@x";
    let password = "pa:ss+w@rd%";
    let server = Private::nats(user, password);
    let prefix = unique("pgtauth");
    let settings = |password: &str| {
        format!(
            "url = \"nats://pg+t%40x:{password}@127.0.0.1:{}\"\ntimeout = \"2s\"\n\
             subject = \"{prefix}.{{topic}}\"\ncreate_stream = true\nstream = \"AUTH\"\n\
             subjects = [\"{prefix}.>\"]\n",
            server.port
        )
    };

    // `+` is a plus (form-decoding would make it a space), `%40` an `@`, `%3A` a `:`; a refused
    // login is retried, not dead-lettered.
    let errors = credentials_scenario("nats", "pa%3Ass+w%40rd%25", settings).await;
    assert!(
        errors.iter().all(|e| e.contains("cannot connect to NATS")),
        "{errors:?}"
    );
}
