//! What a destination is sent: its `transform` (a CEL expression whose value is the payload) and
//! its `body` (the CloudEvents envelope, structured or binary), checked at real receivers.

mod common;

use std::time::Duration;

use common::*;

/// A relay config for `db` with fast polling and the given destination blocks.
fn config(db: &TestDb, destinations: &str) -> String {
    format!(
        "database_url = \"{}\"\n[relay]\npoll_interval = \"50ms\"\n{destinations}",
        db.url
    )
}

/// Pairs of `destination` in the deliveries table matching `condition`.
async fn pairs(db: &TestDb, destination: &str, condition: &str) -> i64 {
    sqlx::query_scalar(&format!(
        "SELECT count(*) FROM outbox_deliveries WHERE destination = $1 AND {condition}"
    ))
    .bind(destination)
    .fetch_one(&db.pool)
    .await
    .expect("count pairs")
}

/// A transform reshapes what its destination is sent and nothing else; an event it fails on is
/// dead-lettered for that destination with the reason, never sent half-built.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transform_shapes_its_destination_and_dead_letters_what_it_fails_on() {
    let db = TestDb::migrated().await;
    let plain = Receiver::start().await;
    let shaped = Receiver::start().await;
    // Events 1..=20; every fourth has no `total`, which the transform reads.
    sqlx::query(
        "INSERT INTO outbox (topic, payload)
         SELECT 'order.created',
                CASE WHEN g % 4 = 0 THEN jsonb_build_object('n', g, 'card', '4111')
                     ELSE jsonb_build_object('n', g, 'card', '4111', 'total', g * 10) END
         FROM generate_series(1, 20) g",
    )
    .execute(&db.pool)
    .await
    .expect("insert");
    let text = config(
        &db,
        &format!(
            "[[destinations]]\nname = \"plain\"\ntype = \"webhook\"\nurl = \"{}\"\n\
             [[destinations]]\nname = \"shaped\"\ntype = \"webhook\"\nurl = \"{}\"\n\
             transform = \"payload.without('card', 'total').with('amount', payload.total * 100)\"\n",
            plain.url, shaped.url
        ),
    );
    let relay = Running::start(&db, &text);
    let done = wait_for(Duration::from_secs(30), || async {
        plain.delivered_ids().len() == 20
            && shaped.delivered_ids().len() == 15
            && pairs(&db, "shaped", "dead_at IS NOT NULL").await == 5
    })
    .await;
    relay.stop().await;
    assert!(
        done,
        "plain got {}, shaped {}",
        plain.delivered_ids().len(),
        shaped.delivered_ids().len()
    );
    for r in plain.delivered() {
        assert_eq!(
            r.json()["data"]["card"],
            "4111",
            "plain is sent the payload as written"
        );
    }
    for r in shaped.delivered() {
        let data = &r.json()["data"];
        let n = data["n"].as_i64().expect("n");
        assert_eq!(
            data,
            &serde_json::json!({"n": n, "amount": n * 1000}),
            "shaped is sent the transform's value"
        );
        assert_ne!(n % 4, 0, "an event the transform fails on is never sent");
    }
    let reasons: Vec<String> = sqlx::query_scalar(
        "SELECT last_error FROM outbox_deliveries WHERE destination = 'shaped' AND dead_at IS NOT NULL",
    )
    .fetch_all(&db.pool)
    .await
    .expect("reasons");
    assert_eq!(reasons.len(), 5);
    assert!(
        reasons
            .iter()
            .all(|e| e.contains("transform") && e.contains("failed")),
        "{reasons:?}"
    );
    assert_eq!(pairs(&db, "plain", "dead_at IS NOT NULL").await, 0);
}

/// A transform that does not compile is refused when the configuration loads, naming its key.
#[test]
fn a_bad_transform_is_refused_at_load_naming_the_key() {
    let e = pgoutbox::config::Config::parse(
        "[[destinations]]\nname = \"x\"\ntype = \"null\"\ntransform = \"payload.total +\"\n",
        |_| None,
    )
    .expect_err("refused");
    let e = e.to_string();
    assert!(
        e.contains("destinations[0].transform") && e.contains("not a valid CEL"),
        "{e}"
    );
}

/// `body = "cloudevents"` (structured) and `"cloudevents-binary"` (`ce-*` headers) on webhooks:
/// the SDK's HTTP binding reads every request as the event sent, `traceparent` carried, a
/// transform's value as `data`, and the Standard Webhooks headers still there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cloudevents_on_webhooks_are_read_by_the_sdk() {
    use ::cloudevents::AttributesReader;

    let db = TestDb::migrated().await;
    let structured = Receiver::start().await;
    let binary = Receiver::start().await;
    let trace = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    sqlx::query(
        "INSERT INTO outbox (topic, payload, key, headers)
         SELECT 'order.created', jsonb_build_object('n', g), CASE WHEN g % 2 = 0 THEN 'k' || g END,
                jsonb_build_object('traceparent', $1::text)
         FROM generate_series(1, 10) g",
    )
    .bind(trace)
    .execute(&db.pool)
    .await
    .expect("insert");
    let events: Vec<(String, Option<String>, i64)> =
        sqlx::query_as("SELECT id::text, key, (payload->>'n')::bigint FROM outbox")
            .fetch_all(&db.pool)
            .await
            .expect("events");
    let text = config(
        &db,
        &format!(
            "[[destinations]]\nname = \"structured\"\ntype = \"webhook\"\nurl = \"{}\"\n\
             body = \"cloudevents\"\ncloudevents_source = \"/shop/orders\"\n\
             secret = \"whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD\"\n\
             [[destinations]]\nname = \"binary\"\ntype = \"webhook\"\nurl = \"{}\"\n\
             body = \"cloudevents-binary\"\ntransform = \"{{'n2': payload.n * 2}}\"\n",
            structured.url, binary.url
        ),
    );
    let relay = Running::start(&db, &text);
    let done = wait_for(Duration::from_secs(30), || async {
        structured.delivered_ids().len() == 10 && binary.delivered_ids().len() == 10
    })
    .await;
    relay.stop().await;
    assert!(done, "both destinations got the 10 events");
    for (rx, source, mode) in [
        (&structured, "/shop/orders", "application/cloudevents+json"),
        (&binary, "pgoutbox", "application/json"),
    ] {
        for r in rx.delivered() {
            assert_eq!(
                r.headers.get("content-type").map(String::as_str),
                Some(mode)
            );
            let mut headers = reqwest::header::HeaderMap::new();
            for (k, v) in &r.headers {
                headers.insert(
                    reqwest::header::HeaderName::try_from(k.as_str()).expect("name"),
                    reqwest::header::HeaderValue::try_from(v.as_str()).expect("value"),
                );
            }
            let e = ::cloudevents::binding::http::to_event(&headers, r.body.clone())
                .unwrap_or_else(|err| panic!("{mode}: the SDK reads no CloudEvent ({err}): {r:?}"));
            let (id, key, n) = events
                .iter()
                .find(|(id, _, _)| *id == e.id())
                .unwrap_or_else(|| panic!("unknown id {}", e.id()));
            assert_eq!(
                e.id(),
                r.headers["webhook-id"],
                "the event id, as webhook-id"
            );
            assert_eq!(e.id(), id);
            assert_eq!(e.source().to_string(), source);
            assert_eq!(e.ty(), "order.created");
            assert_eq!(e.subject(), key.as_deref());
            assert!(e.time().is_some());
            assert_eq!(e.datacontenttype(), Some("application/json"));
            assert_eq!(
                e.extension("traceparent").map(|v| v.to_string()).as_deref(),
                Some(trace)
            );
            let data = common::cloudevents::data(&e);
            let want = if mode == "application/json" {
                serde_json::json!({"n2": n * 2})
            } else {
                serde_json::json!({"n": n})
            };
            assert_eq!(data, want);
        }
    }
    assert!(structured
        .delivered()
        .iter()
        .all(|r| r.headers.contains_key("webhook-signature")));
}
