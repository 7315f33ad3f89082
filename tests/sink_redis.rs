//! The `redis` sink against the local Redis (127.0.0.1:6379).
#![cfg(feature = "redis")]

mod common;

use std::collections::HashMap;

use pgoutbox::engine::Relay;
use redis::AsyncCommands;

use common::cloudevents;
use common::sinks::{
    assert_delivered, commit_events, committed, sink_config, unique, unpublish_all, Got,
};
use common::{parse_config, TestDb};

const URL: &str = "redis://127.0.0.1:6379/0";

/// Reads a whole stream with XRANGE.
async fn read(conn: &mut redis::aio::MultiplexedConnection, stream: &str) -> Vec<Got> {
    let entries: Vec<(String, HashMap<String, Vec<u8>>)> = redis::cmd("XRANGE")
        .arg(stream)
        .arg("-")
        .arg("+")
        .query_async(conn)
        .await
        .expect("xrange");
    entries
        .into_iter()
        .map(|(_, f)| {
            let text = |k: &str| f.get(k).map(|v| String::from_utf8_lossy(v).into_owned());
            let mut headers: HashMap<String, String> =
                serde_json::from_str(&text("headers").expect("headers field"))
                    .expect("headers json");
            // Fields beside the event's own (CloudEvents attributes, `content-type`).
            for name in f
                .keys()
                .filter(|k| k.starts_with("ce_") || *k == "content-type")
            {
                headers.insert(name.clone(), text(name).unwrap_or_default());
            }
            Got {
                id: text("id").expect("id field"),
                key: text("key"),
                payload: f.get("payload").cloned().expect("payload field"),
                headers,
            }
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_are_appended_to_streams_and_redeliveries_keep_their_id() {
    let db = TestDb::migrated().await;
    let prefix = unique("pgt:");
    let config = parse_config(&sink_config(
        &db,
        "redis",
        &format!("url = \"{URL}\"\nstream = \"{prefix}:{{header.x-tenant}}:{{topic}}\"\nmaxlen = 10000\n"),
    ));
    commit_events(&db, 30, "order.created").await;
    let expected = committed(&db).await;
    let relay = Relay::new(db.pool.clone(), &config).expect("relay");
    let report = relay.run_once().await.expect("run");
    assert_eq!(report.delivered, 30, "{report:?}");

    let client = redis::Client::open(URL).expect("url");
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("Redis on 127.0.0.1:6379 (bash .ci/run starts it)");
    let stream = format!("{prefix}:acme:order.created");
    let got = read(&mut conn, &stream).await;
    assert_delivered(&expected, &got);

    unpublish_all(&db).await;
    let report = relay.run_once().await.expect("run again");
    assert_eq!(report.delivered, 30, "{report:?}");
    let all = read(&mut conn, &stream).await;
    assert_eq!(all.len(), 60);
    assert_delivered(&expected, &all[30..]);
    let _: () = conn.del(&stream).await.expect("cleanup");
}

/// `body = "cloudevents"` (in the `payload` field) and `"cloudevents-binary"` (`ce_*` fields):
/// the SDK reads every entry as the event sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cloudevents_structured_and_binary_are_read_by_the_sdk() {
    let db = TestDb::migrated().await;
    let prefix = unique("pgtce:");
    let stream = format!("{prefix}:order.created");
    let client = redis::Client::open(URL).expect("url");
    let settings = format!("url = \"{URL}\"\nstream = \"{prefix}:{{topic}}\"\n");
    cloudevents::both_modes(&db, "redis", &settings, "ce_", || {
        let (client, stream) = (client.clone(), stream.clone());
        async move {
            let mut conn = client
                .get_multiplexed_async_connection()
                .await
                .expect("Redis on 127.0.0.1:6379 (bash .ci/run starts it)");
            let got = read(&mut conn, &stream).await;
            let _: () = conn.del(&stream).await.expect("cleanup");
            got
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn maxlen_trims_and_a_wrong_type_key_is_rejected() {
    let db = TestDb::migrated().await;
    let prefix = unique("pgt:");
    let client = redis::Client::open(URL).expect("url");
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("redis");
    // A plain string where the sink wants a stream: WRONGTYPE, permanent.
    let _: () = conn.set(format!("{prefix}:taken"), "x").await.expect("set");
    let config = parse_config(&sink_config(
        &db,
        "redis",
        &format!("url = \"{URL}\"\nstream = \"{prefix}:{{topic}}\"\nmaxlen = 1\n"),
    ));
    commit_events(&db, 500, "many").await;
    commit_events(&db, 1, "taken").await;
    let report = Relay::new(db.pool.clone(), &config)
        .expect("relay")
        .run_once()
        .await
        .expect("run");
    assert_eq!((report.delivered, report.dead), (500, 1), "{report:?}");
    let len: usize = conn.xlen(format!("{prefix}:many")).await.expect("xlen");
    assert!(len < 500, "MAXLEN ~ trims the stream (length {len})");
    let error: String =
        sqlx::query_scalar("SELECT last_error FROM outbox WHERE dead_at IS NOT NULL")
            .fetch_one(&db.pool)
            .await
            .expect("error");
    assert!(error.contains("WRONGTYPE"), "{error}");
    let _: () = conn
        .del(&[format!("{prefix}:taken"), format!("{prefix}:many")])
        .await
        .expect("cleanup");
}

#[test]
fn bad_settings_are_config_errors() {
    for (settings, says) in [
        ("url = \"http://x\"", "url"),
        ("url = \"redis://h\"\nmaxlen = 0", "maxlen"),
        ("url = \"redis://h\"\nstream = \"{key\"", "never closed"),
    ] {
        let text = format!("[[destinations]]\nname = \"r\"\ntype = \"redis\"\n{settings}\n");
        let e = pgoutbox::config::Config::parse(&text, |_| None)
            .and_then(|config| pgoutbox::sinks::check(&config))
            .expect_err(settings)
            .to_string();
        assert!(e.contains(says), "{settings}: {e}");
    }
}
