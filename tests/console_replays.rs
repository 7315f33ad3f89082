//! Replays through the console's API: a dry run counts what the destination would be sent
//! (its topics and filter, and the replay's own), a start creates the replay under the token's
//! name, the list and a lookup show it, pause, resume and cancel steer it (refused with a 409
//! naming the state it is in), every change is in the audit log, bad input is a 4xx naming the
//! parameter and never a 5xx, and a replay started from the console is run by the relays.

mod common;

use std::sync::Arc;
use std::time::Duration;

use pgoutbox::engine::Relay;
use pgoutbox::server::Samples;
use serde_json::{json, Value};

use common::api_call as call;
use common::*;

/// Retained events: `n` rows of `topic` published now, payload `{"n": 1..n}`, key `k-<n>`.
async fn retained(db: &TestDb, n: i32, topic: &str) {
    sqlx::query(
        "INSERT INTO outbox (topic, key, payload, published_at)
         SELECT $1, 'k-' || g, jsonb_build_object('n', g), now() FROM generate_series(1, $2) g",
    )
    .bind(topic)
    .bind(n)
    .execute(&db.pool)
    .await
    .expect("insert retained rows");
}

/// The error sentence of an answer.
fn error(body: &Value) -> &str {
    body["error"].as_str().unwrap_or_default()
}

/// A console (not running the relay: replays stay where the API puts them) over `hooks`, which
/// takes `order.*`, and `other`; 6 `order.created`, 3 `order.paid` and 4 `user.created` retained.
async fn console(admin: &str) -> (TestDb, String) {
    let db = TestDb::migrated().await;
    let rx = Receiver::start().await;
    let config = format!(
        "{}\n[[destinations]]\nname = \"other\"\ntype = \"null\"\n",
        webhook_config(&db, &rx.url, "topics = [\"order.*\"]")
    );
    let relay = Arc::new(Relay::new(db.pool.clone(), &parse_config(&config)).expect("relay"));
    retained(&db, 6, "order.created").await;
    retained(&db, 3, "order.paid").await;
    retained(&db, 4, "user.created").await;
    let base = serve_console(relay, Arc::new(Samples::default()), admin).await;
    (db, format!("{base}/api/v1"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dry_run_start_list_and_steer_a_replay_with_each_change_audited() {
    let (_db, api) = console(TOKENS).await;
    let replays = format!("{api}/replays");
    let post = |body: Value| {
        let url = replays.clone();
        async move { call("POST", &url, Some(OPS), Some(body)).await }
    };

    // Dry runs: the destination's topics apply, then the replay's selection and filter.
    let (status, dry) = post(json!({ "destination": "hooks", "dry_run": true })).await;
    assert_eq!(status, 200, "{dry}");
    assert_eq!(
        dry,
        json!({ "dry_run": true, "read": 13, "would_send": 9, "unreadable": 0, "complete": true })
    );
    let (status, dry) = post(json!({
        "destination": "hooks", "topics": ["order.created", "user.created"],
        "filter": "payload.n > 3", "dry_run": true
    }))
    .await;
    assert_eq!(status, 200, "{dry}");
    assert_eq!(
        (dry["read"].as_u64(), dry["would_send"].as_u64()),
        (Some(10), Some(3))
    );
    let (status, dry) =
        post(json!({ "destination": "other", "keys": ["k-1", "k-2"], "dry_run": true })).await;
    assert_eq!(status, 200, "{dry}");
    assert_eq!(
        (dry["read"].as_u64(), dry["would_send"].as_u64()),
        (Some(6), Some(6))
    );
    let (_, list) = call("GET", &replays, Some(VIEWER), None).await;
    assert_eq!(list, json!({ "replays": [] }), "a dry run creates nothing");

    // Started: 201, under the token's name.
    let (status, first) = post(json!({
        "destination": "hooks", "topics": ["order.created"], "rate": "500/s",
        "since": "2000-01-01T00:00:00Z", "until": "2999-01-01T00:00:00Z"
    }))
    .await;
    assert_eq!(status, 201, "{first}");
    assert_eq!(first["state"], "running", "{first}");
    assert_eq!(first["total"], 6, "{first}");
    assert_eq!(first["created_by"], "alice");
    assert_eq!(first["rate"], "500/s");
    assert_eq!(first["topics"], json!(["order.created"]));
    assert_eq!(first["delivered"], 0);
    let id = first["id"].as_str().expect("id").to_owned();
    let (status, second) = post(json!({ "destination": "hooks", "filter": "payload.n > 1" })).await;
    assert_eq!(status, 201, "{second}");
    assert_eq!(second["filter"], "payload.n > 1");
    let second_id = second["id"].as_str().expect("id").to_owned();

    // Shown: one by id, the list newest first, by destination, limited.
    let (status, one) = call("GET", &format!("{replays}/{id}"), Some(VIEWER), None).await;
    assert_eq!((status, &one["id"]), (200, &json!(id)), "{one}");
    let ids = |list: &Value| -> Vec<String> {
        list["replays"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|r| r["id"].as_str().unwrap_or("").to_owned())
                    .collect()
            })
            .unwrap_or_default()
    };
    let (status, list) = call("GET", &replays, Some(VIEWER), None).await;
    assert_eq!(status, 200, "{list}");
    assert_eq!(ids(&list), [second_id.clone(), id.clone()]);
    let (_, list) = call(
        "GET",
        &format!("{replays}?destination=other"),
        Some(VIEWER),
        None,
    )
    .await;
    assert!(ids(&list).is_empty(), "{list}");
    let (_, list) = call(
        "GET",
        &format!("{replays}?destination=hooks&limit=1"),
        Some(VIEWER),
        None,
    )
    .await;
    assert_eq!(ids(&list), std::slice::from_ref(&second_id));
    let unknown = uuid::Uuid::now_v7();
    let (status, body) = call("GET", &format!("{replays}/{unknown}"), Some(VIEWER), None).await;
    assert_eq!(status, 404, "{body}");
    assert!(error(&body).contains(&unknown.to_string()), "{body}");
    let (status, body) = call("GET", &format!("{replays}/not-a-uuid"), Some(VIEWER), None).await;
    assert_eq!(status, 400, "{body}");
    assert!(error(&body).starts_with("id:"), "{body}");

    // Steered: each change answers the replay after it; a change its state refuses is a 409
    // naming that state; an unknown replay is a 404.
    let steer = |action: &str, id: &str| {
        let url = format!("{replays}/{id}/{action}");
        async move { call("POST", &url, Some(OPS), None).await }
    };
    let (status, r) = steer("pause", &id).await;
    assert_eq!((status, r["state"].as_str()), (200, Some("paused")), "{r}");
    let (status, body) = steer("pause", &id).await;
    assert_eq!(status, 409, "{body}");
    assert!(error(&body).contains("is paused"), "{body}");
    let (status, r) = steer("resume", &id).await;
    assert_eq!((status, r["state"].as_str()), (200, Some("running")), "{r}");
    let (status, r) = steer("cancel", &id).await;
    assert_eq!(
        (status, r["state"].as_str()),
        (200, Some("cancelled")),
        "{r}"
    );
    assert!(r["finished_at"].is_string(), "{r}");
    let (status, body) = steer("resume", &id).await;
    assert_eq!(status, 409, "{body}");
    assert!(error(&body).contains("is cancelled"), "{body}");
    let (status, body) = steer("cancel", &unknown.to_string()).await;
    assert_eq!(status, 404, "{body}");
    let (status, body) = steer("pause", "nope").await;
    assert_eq!(status, 400, "{body}");
    assert!(error(&body).starts_with("id:"), "{body}");
    let (status, _) = steer("rewind", &id).await;
    assert_eq!(status, 404);

    // The audit log, newest first: refused changes and dry runs are not changes.
    let (status, log) = call("GET", &format!("{api}/audit"), Some(VIEWER), None).await;
    assert_eq!(status, 200, "{log}");
    let changes = log["changes"].as_array().expect("changes");
    let actions: Vec<&str> = changes
        .iter()
        .map(|c| c["action"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(
        actions,
        [
            "replay-cancel",
            "replay-resume",
            "replay-pause",
            "replay",
            "replay"
        ],
        "{log}"
    );
    assert!(
        changes
            .iter()
            .all(|c| c["who"] == "alice" && c["via"] == "console"),
        "{log}"
    );
    assert_eq!(
        changes[0]["filter"],
        json!({ "destination": "hooks", "replay": id })
    );
    assert_eq!(
        changes[4]["filter"],
        json!({ "destination": "hooks", "replay": id })
    );
    assert_eq!(
        changes[4]["matched"], 6,
        "a start counts the replay's total"
    );
    assert_eq!(
        changes[3]["filter"],
        json!({ "destination": "hooks", "replay": second_id })
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_refused_naming_the_parameter() {
    let (_db, api) = console(TOKENS).await;
    let replays = format!("{api}/replays");
    for (body, status, named) in [
        (json!({}), 400, "destination:"),
        (json!({ "destination": "nowhere" }), 400, "destination:"),
        (json!({ "destination": "a\u{0}b" }), 400, "destination:"),
        (
            json!({ "destination": "hooks", "filter": "payload.n >" }),
            400,
            "filter:",
        ),
        (
            json!({ "destination": "hooks", "filter": "x\u{0}" }),
            400,
            "filter:",
        ),
        (
            json!({ "destination": "hooks", "rate": "fast" }),
            400,
            "rate:",
        ),
        (
            json!({ "destination": "hooks", "rate": "0/s" }),
            400,
            "rate:",
        ),
        (
            json!({ "destination": "hooks", "since": "yesterday" }),
            400,
            "since:",
        ),
        (
            json!({ "destination": "hooks", "until": "2024-13-45T00:00:00Z" }),
            400,
            "until:",
        ),
        (
            json!({ "destination": "hooks", "since": "2026-01-02T00:00:00Z", "until": "2026-01-01T00:00:00Z" }),
            400,
            "until:",
        ),
        (
            json!({ "destination": "hooks", "topics": ["a\u{0}"] }),
            400,
            "topics:",
        ),
        (
            json!({ "destination": "hooks", "keys": ["x".repeat(5000)] }),
            400,
            "keys:",
        ),
        (
            json!({ "destination": "hooks", "topics": "order.created" }),
            422,
            "topics",
        ),
        (
            json!({ "destination": "hooks", "dry_run": "yes" }),
            422,
            "dry_run",
        ),
        (json!({ "destination": "hooks", "speed": 1 }), 422, "speed"),
    ] {
        let (got, answer) = call("POST", &replays, Some(OPS), Some(body.clone())).await;
        assert_eq!(got, status, "{body}: {answer}");
        assert!(error(&answer).contains(named), "{body}: {answer}");
    }
    let (status, body) = call("GET", &format!("{replays}?limit=abc"), None, None).await;
    assert_eq!(status, 401, "reads need a token here: {body}");
    let (status, body) = call("GET", &format!("{replays}?limit=abc"), Some(VIEWER), None).await;
    assert_eq!(status, 400, "{body}");
    assert!(error(&body).starts_with("limit:"), "{body}");
    let (status, body) = call(
        "GET",
        &format!("{replays}?destination={}", percent_encode(b"\0")),
        Some(VIEWER),
        None,
    )
    .await;
    assert_eq!(status, 400, "{body}");
    assert!(error(&body).starts_with("destination:"), "{body}");

    // Hostile values in every place a value goes: never a 5xx, always the error contract.
    let hostile = [
        "\0",
        "-1",
        "9223372036854775808",
        "0000-01-01T00:00:00Z",
        "9999-12-31T23:59:59Z",
        "'; DROP TABLE outbox; --",
        "%",
        "🦀",
        "infinity",
    ];
    let id = uuid::Uuid::now_v7();
    for v in hostile {
        let enc = percent_encode(v.as_bytes());
        for url in [
            format!("{replays}?limit={enc}"),
            format!("{replays}?destination={enc}"),
            format!("{replays}/{enc}"),
        ] {
            let (status, body) = call("GET", &url, Some(VIEWER), None).await;
            assert!(
                status < 500 && (status < 400 || !error(&body).is_empty()),
                "{url}: {status} {body}"
            );
        }
        for action in ["pause", "resume", "cancel"] {
            let (status, body) = call(
                "POST",
                &format!("{replays}/{enc}/{action}"),
                Some(OPS),
                None,
            )
            .await;
            assert!(
                (400..500).contains(&status) && !error(&body).is_empty(),
                "{v}: {status} {body}"
            );
        }
        for field in ["since", "until", "filter", "rate", "destination"] {
            let mut body = json!({ "destination": "hooks", "dry_run": true });
            body[field] = json!(v);
            let (status, answer) = call("POST", &replays, Some(OPS), Some(body.clone())).await;
            assert!(status < 500, "{body}: {status} {answer}");
            assert!(!answer.to_string().contains("SQLSTATE"), "{answer}");
        }
        let body = json!({ "destination": "hooks", "topics": [v], "keys": [v], "dry_run": true });
        let (status, answer) = call("POST", &replays, Some(OPS), Some(body.clone())).await;
        assert!(status < 500, "{body}: {status} {answer}");
    }
    let (status, body) = call("POST", &format!("{replays}/{id}/pause"), Some(OPS), None).await;
    assert_eq!(status, 404, "{body}");

    // The OpenAPI document describes them; the page's script is served like app.js.
    let base = api.trim_end_matches("/api/v1");
    let (status, openapi) = call("GET", &format!("{base}/api/openapi.json"), None, None).await;
    assert_eq!(status, 200);
    for path in [
        "/api/v1/replays",
        "/api/v1/replays/{id}",
        "/api/v1/replays/{id}/pause",
        "/api/v1/replays/{id}/resume",
        "/api/v1/replays/{id}/cancel",
    ] {
        assert!(openapi["paths"].get(path).is_some(), "OpenAPI lacks {path}");
    }
    let script = reqwest::get(format!("{base}/console/replays.js"))
        .await
        .expect("replays.js");
    assert_eq!(script.status(), 200);
    assert!(script.headers().contains_key("content-security-policy"));
    let (_, list) = call("GET", &replays, Some(VIEWER), None).await;
    assert_eq!(list, json!({ "replays": [] }), "nothing bad was created");
}

/// Starting and steering replays is a change like a retry: a reader's token, a wrong token or
/// none are refused as the dead-letter calls refuse them, and with no token that may operate
/// changes are off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changes_to_replays_are_refused_as_other_changes_are() {
    let (_db, api) = console(TOKENS).await;
    let start = json!({ "destination": "hooks" });
    let (status, created) = call(
        "POST",
        &format!("{api}/replays"),
        Some(OPS),
        Some(start.clone()),
    )
    .await;
    assert_eq!(status, 201, "{created}");
    let id = created["id"].as_str().expect("id");
    for token in [Some(VIEWER), Some("wrong"), None] {
        let (retry_status, retry) =
            call("POST", &format!("{api}/dead/retry"), token, Some(json!({}))).await;
        assert!(retry_status == 401 || retry_status == 403, "{retry}");
        for (url, body) in [
            (format!("{api}/replays"), Some(start.clone())),
            (
                format!("{api}/replays"),
                Some(json!({ "destination": "hooks", "dry_run": true })),
            ),
            (format!("{api}/replays/{id}/pause"), None),
            (format!("{api}/replays/{id}/cancel"), None),
        ] {
            let (status, answer) = call("POST", &url, token, body).await;
            assert_eq!(
                (status, error(&answer)),
                (retry_status, error(&retry)),
                "{url} {token:?}"
            );
        }
    }
    let (_, one) = call("GET", &format!("{api}/replays/{id}"), Some(VIEWER), None).await;
    assert_eq!(one["state"], "running", "nothing refused changed it");

    // Without a token that may operate, reads are open and changes are off.
    let (_db, api) = console("").await;
    let (status, body) = call("POST", &format!("{api}/replays"), None, Some(start)).await;
    assert_eq!(status, 403, "{body}");
    assert!(error(&body).contains("changes are off"), "{body}");
    let (status, list) = call("GET", &format!("{api}/replays"), None, None).await;
    assert_eq!((status, list), (200, json!({ "replays": [] })));
}

/// A replay started from the console is run by the relay serving its destination: its events
/// arrive again with the replay's header, and the console shows it done with its counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_started_from_the_console_is_run_by_the_relay() {
    let db = TestDb::migrated().await;
    let rx = Receiver::start().await;
    let config = webhook_config(&db, &rx.url, "");
    db.insert_plain(12, "order.created").await;
    let relay = Running::start(&db, &config);
    assert!(
        wait_for(Duration::from_secs(30), || async {
            rx.delivered_ids().len() >= 12
        })
        .await,
        "the live events are delivered"
    );
    let console = Arc::new(Relay::new(db.pool.clone(), &parse_config(&config)).expect("relay"));
    let base = serve_console(
        console,
        Arc::new(Samples::default()),
        &format!("token = \"{OPS}\""),
    )
    .await;
    let (status, created) = call(
        "POST",
        &format!("{base}/api/v1/replays"),
        Some(OPS),
        Some(json!({ "destination": "hooks", "filter": "payload.n <= 5" })),
    )
    .await;
    assert_eq!(status, 201, "{created}");
    let id = created["id"].as_str().expect("id").to_owned();
    let url = format!("{base}/api/v1/replays/{id}");
    let done = wait_for(Duration::from_secs(30), || async {
        call("GET", &url, Some(OPS), None).await.1["state"] == "done"
    })
    .await;
    relay.stop().await;
    let (_, replay) = call("GET", &url, Some(OPS), None).await;
    assert!(done, "{replay}");
    assert_eq!(
        (
            &replay["read"],
            &replay["queued"],
            &replay["delivered"],
            &replay["dead"]
        ),
        (&json!(12), &json!(5), &json!(5), &json!(0)),
        "{replay}"
    );
    let again = rx
        .delivered()
        .into_iter()
        .filter(|r| r.headers.get("pgoutbox-replay").map(String::as_str) == Some(id.as_str()))
        .count();
    assert_eq!(again, 5, "the five events the filter keeps, sent again");
}
