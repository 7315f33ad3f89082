//! Reserved headers: an event's own headers cannot replace the headers a webhook destination
//! configures (`Authorization`) or the ones the sink writes itself (`webhook-id`, the signature,
//! `content-type`, `host`); such headers are dropped with one warning per header name.

mod common;

use std::time::Duration;

use common::*;

const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";

/// Headers an attacker-controlled (or careless) producer could put on an event.
const CONFLICTING: &str = r#"{"authorization": "Bearer evil", "Webhook-Id": "forged",
    "webhook-timestamp": "1", "webhook-signature": "v1,Zm9yZ2Vk", "content-type": "text/evil",
    "host": "evil.example", "transfer-encoding": "chunked", "X-Source": "evil", "x-tenant": "acme"}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn configured_and_protocol_headers_win_over_event_headers() {
    let db = TestDb::migrated().await;
    let rx = Receiver::start().await;
    let ids: Vec<String> = sqlx::query_scalar(
        "INSERT INTO outbox (topic, payload, headers)
         SELECT 'order.created', jsonb_build_object('n', g), $1::jsonb
         FROM generate_series(1, 20) g RETURNING id::text",
    )
    .bind(CONFLICTING)
    .fetch_all(&db.pool)
    .await
    .expect("insert");

    let dir = scratch();
    let text = webhook_config(
        &db,
        &rx.url,
        &format!(
            "secret = \"{SECRET}\"\n\
             headers = {{ \"Authorization\" = \"Bearer good\", \"x-source\" = \"pgoutbox\" }}"
        ),
    );
    let config = write_config(dir.path(), &text);
    let mut relay = spawn_relay(dir.path(), &config, "headers");
    let delivered = wait_for(Duration::from_secs(30), || async {
        db.count("published_at IS NULL").await == 0
    })
    .await;
    signal(&relay, libc::SIGTERM);
    relay.wait().expect("relay exits");
    let log = std::fs::read_to_string(dir.path().join("relay-headers.log")).expect("log");
    assert!(delivered, "{log}");

    let host = rx
        .url
        .trim_start_matches("http://")
        .split('/')
        .next()
        .expect("host");
    let requests = rx.delivered();
    assert_eq!(requests.len(), ids.len());
    for r in &requests {
        assert!(
            ids.contains(&r.id),
            "webhook-id is the event id, not {:?}",
            r.id
        );
        assert_eq!(r.headers["authorization"], "Bearer good");
        assert_eq!(r.headers["x-source"], "pgoutbox");
        assert_eq!(r.headers["content-type"], "application/json");
        assert_eq!(r.headers["host"], host);
        assert!(
            !r.headers.contains_key("transfer-encoding"),
            "{:?}",
            r.headers
        );
        assert_eq!(
            r.headers["x-tenant"], "acme",
            "other event headers still pass"
        );
        let signed = pgoutbox::webhook::SignedHeaders {
            id: &r.headers["webhook-id"],
            timestamp: &r.headers["webhook-timestamp"],
            signature: &r.headers["webhook-signature"],
        };
        pgoutbox::webhook::verify(
            &[SECRET],
            &signed,
            &r.body,
            pgoutbox::webhook::DEFAULT_TOLERANCE,
        )
        .expect("the sink's own signature");
    }

    // Twenty events, one warning per header name.
    for name in ["authorization", "webhook-id", "x-source", "host"] {
        let warnings = log
            .lines()
            .filter(|l| l.contains("WARN") && l.contains("reserves") && l.contains(name))
            .count();
        assert_eq!(warnings, 1, "warnings about {name}:\n{log}");
    }
}
