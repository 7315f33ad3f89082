//! The console and the operator commands against what operators and attackers send and what a
//! table can hold: a generated sweep of hostile values over every endpoint and parameter (never a
//! 5xx, never database text, always the `{"error": …}` contract), paging that loses nothing when
//! one event is dead at several destinations, and rows that break the table's assumptions (NULL
//! topic, NULL created_at, deeply nested payloads) shown by `status`, `dead` and the console.

mod common;

use std::collections::HashSet;
use std::sync::Arc;

use pgoutbox::engine::Relay;
use pgoutbox::server::Samples;
use serde_json::{json, Value};

use common::*;

const ADMIN: &str = "adm1n-t0ken";

/// A raw call: (status, body text, content type).
async fn raw(
    method: &str,
    url: &str,
    body: Option<Vec<u8>>,
    json_body: bool,
) -> (u16, String, String) {
    let client = reqwest::Client::new();
    let mut req = match method {
        "GET" => client.get(url),
        _ => client.post(url),
    }
    .bearer_auth(ADMIN);
    if let Some(b) = body {
        if json_body {
            req = req.header("content-type", "application/json");
        }
        req = req.body(b);
    }
    let resp = req.send().await.expect("request");
    let status = resp.status().as_u16();
    let content_type = resp
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let text = resp.text().await.expect("body");
    (status, text, content_type)
}

/// Asserts the answer keeps the API's contract: no 5xx, a JSON `error` on every 4xx, and no
/// database text anywhere.
fn assert_contract(what: &str, (status, text, content_type): &(u16, String, String)) {
    assert!(*status < 500, "{what}: {status} {text}");
    if *status >= 400 {
        let body: Value = serde_json::from_str(text)
            .unwrap_or_else(|_| panic!("{what}: {status} answered non-JSON {text:?}"));
        let error = body["error"].as_str().unwrap_or_default();
        assert!(
            !error.is_empty(),
            "{what}: {status} without an error: {text}"
        );
        assert!(
            content_type.starts_with("application/json"),
            "{what}: {content_type}"
        );
    }
    for leak in [
        "SQLSTATE",
        "error returned from database",
        "syntax error",
        "0x00",
    ] {
        assert!(
            !text.contains(leak),
            "{what}: database text {leak:?}: {text}"
        );
    }
}

use common::percent_encode as encode;

fn cursor(text: &str) -> Vec<u8> {
    use base64::Engine as _;
    base64::engine::general_purpose::URL_SAFE_NO_PAD
        .encode(text)
        .into_bytes()
}

/// The hostile values of one text parameter, as raw bytes.
fn hostile_values() -> Vec<Vec<u8>> {
    let mut values: Vec<Vec<u8>> = [
        "\0",
        "a\0b",
        "\x01\x02\x1b[31m\x7f",
        "",
        " ",
        "-1",
        "0",
        "-9223372036854775808",
        "9223372036854775808",
        "99999999999999999999999999",
        "1e400",
        "NaN",
        "-inf",
        "2024-13-45T99:99:99Z",
        "0000-01-01T00:00:00Z",
        "-4713-01-01T00:00:00Z",
        "+275760-09-13T00:00:00Z",
        "9999-12-31T23:59:59.999999999+14:00",
        "infinity",
        "'; DROP TABLE outbox; --",
        "%",
        "🦀",
    ]
    .iter()
    .map(|s| s.as_bytes().to_vec())
    .collect();
    values.push(vec![0xff, 0xfe, 0x80]);
    values.push("x".repeat(20_000).into_bytes());
    for c in [
        "x|1",
        "2024-01-01 00:00:00+00|x",
        "2024-01-01 00:00:00+00|99999999999999999999",
        "not a time|1",
        "infinity|-1",
        "-infinity|0",
        "\0|1",
        "2024-01-01 00:00:00+00\0|1",
        "|",
        "",
    ] {
        values.push(cursor(c));
    }
    values.push(b"!!!not-base64!!!".to_vec());
    values
}

/// Deep and wide JSON, and bodies that are not JSON at all.
fn hostile_bodies() -> Vec<(String, Vec<u8>)> {
    let deep = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
    let mut wide = String::from("{");
    for i in 0..20_000 {
        wide.push_str(&format!("\"k{i}\":{i},"));
    }
    wide.push_str("\"dry_run\":true}");
    let mut bodies: Vec<(String, Vec<u8>)> = vec![
        ("empty".into(), Vec::new()),
        ("not JSON".into(), b"hello".to_vec()),
        ("non-UTF-8".into(), vec![b'{', 0xff, 0xfe, b'}']),
        ("deep array".into(), deep(100_000).into_bytes()),
        (
            "deep in a field".into(),
            format!("{{\"topic\":{}}}", deep(5_000)).into_bytes(),
        ),
        ("wide object".into(), wide.into_bytes()),
        ("array".into(), b"[1,2,3]".to_vec()),
        ("null".into(), b"null".to_vec()),
    ];
    for (field, value) in [
        ("ids", json!(["not-a-uuid"])),
        ("ids", json!("x")),
        ("ids", json!([null])),
        ("topic", json!("a\u{0}b")),
        ("topic", json!(12)),
        ("destination", json!("\u{0}")),
        ("destination", json!("x".repeat(100_000))),
        ("since_seconds", json!(-1)),
        ("since_seconds", json!(1e300)),
        ("since_seconds", json!("soon")),
        ("dry_run", json!("yes")),
        ("unknown_field", json!(1)),
    ] {
        let mut body = json!({ "dry_run": true });
        body[field] = value;
        bodies.push((format!("{field} = {body}"), body.to_string().into_bytes()));
    }
    bodies
}

/// A config with three webhook destinations at `url`, each dead-lettering at the first refusal.
fn three_destinations(db: &TestDb, url: &str) -> String {
    let mut config = format!(
        "database_url = \"{}\"\n[relay]\npoll_interval = \"50ms\"\n",
        db.url
    );
    for name in ["alpha", "beta", "gamma"] {
        config.push_str(&format!(
            "\n[[destinations]]\nname = \"{name}\"\ntype = \"webhook\"\nurl = \"{url}\"\nmax_attempts = 1\n"
        ));
    }
    config
}

/// `n` events dead at three destinations (each refuses them): a relay and its receiver.
async fn dead_at_three_destinations(n: usize) -> (TestDb, Arc<Relay>, Receiver) {
    let db = TestDb::migrated().await;
    let (rx, _) = Receiver::refusing(400, "no").await;
    let relay = Arc::new(
        Relay::new(
            db.pool.clone(),
            &parse_config(&three_destinations(&db, &rx.url)),
        )
        .expect("relay"),
    );
    db.insert_plain(n, "order.created").await;
    relay.run_once().await.expect("run");
    (db, relay, rx)
}

async fn serve(relay: Arc<Relay>) -> String {
    serve_console(
        relay,
        Arc::new(Samples::default()),
        &format!("token = \"{ADMIN}\""),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_hostile_input_gets_a_5xx_or_database_text() {
    let (_db, relay, _rx) = dead_at_three_destinations(3).await;
    let base = serve(relay).await;
    let api = |path: &str| format!("{base}/api/v1{path}");

    let params = [
        "id",
        "state",
        "topic",
        "key",
        "destination",
        "since",
        "until",
        "limit",
        "cursor",
        "topic_prefix",
        "payload",
        "total",
    ];
    let values = hostile_values();
    let mut calls = 0;
    for value in &values {
        let v = encode(value);
        for state in ["dead", "pending", "published"] {
            for param in params {
                let url = api(&format!("/events?state={state}&{param}={v}"));
                assert_contract(
                    &format!("events {param}"),
                    &raw("GET", &url, None, false).await,
                );
                calls += 1;
            }
        }
        for path in [
            format!("/events/{v}"),
            format!("/destinations/{v}/pause"),
            format!("/destinations/{v}/resume"),
        ] {
            let method = if path.starts_with("/events") {
                "GET"
            } else {
                "POST"
            };
            assert_contract(&path, &raw(method, &api(&path), None, false).await);
            calls += 1;
        }
        for param in ["limit", "before"] {
            let url = api(&format!("/audit?{param}={v}"));
            assert_contract(
                &format!("audit {param}"),
                &raw("GET", &url, None, false).await,
            );
            calls += 1;
        }
        for path in ["/overview", "/samples"] {
            let url = api(&format!("{path}?x={v}"));
            assert_contract(path, &raw("GET", &url, None, false).await);
            calls += 1;
        }
    }
    for (what, body) in hostile_bodies() {
        for path in ["/dead/retry", "/dead/discard"] {
            for json_type in [true, false] {
                let answer = raw("POST", &api(path), Some(body.clone()), json_type).await;
                assert_contract(&format!("{path} {what}"), &answer);
                calls += 1;
            }
        }
    }
    // A duplicated parameter, and a limit that only a 64-bit integer holds.
    for query in [
        "state=dead&state=pending",
        "limit=9223372036854775807",
        "limit=-9223372036854775808",
        "state=dead&limit=1&limit=2",
    ] {
        assert_contract(
            query,
            &raw("GET", &api(&format!("/events?{query}")), None, false).await,
        );
        calls += 1;
    }
    // Errors name the parameter they are about.
    let (status, text, _) = raw("GET", &api("/events?limit=abc"), None, false).await;
    assert_eq!(status, 400);
    assert!(text.contains("limit"), "{text}");
    let (status, text, _) = raw(
        "GET",
        &api(&format!("/events?topic={}", encode(b"a\0"))),
        None,
        false,
    )
    .await;
    assert_eq!(status, 400);
    assert!(text.contains("topic"), "{text}");
    let c = encode(&cursor("not a time|1"));
    let (status, text, _) = raw("GET", &api(&format!("/events?cursor={c}")), None, false).await;
    assert_eq!(status, 400);
    assert!(text.contains("cursor"), "{text}");
    eprintln!("hostile sweep: {calls} calls, none answered 5xx");
}

/// One event dead at three destinations gives three records with the same dead time and `seq`:
/// every page size from 1 to 10 shows each (event, destination) exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paging_shows_every_dead_pair_once_at_every_page_size() {
    let (db, relay, _rx) = dead_at_three_destinations(10).await;
    // One settle statement writes an event's dead pairs (and a batch's) with one `now()`; make
    // that so here whatever the lanes' timing was: every pair ties on its dead time.
    let tied = sqlx::query("UPDATE outbox_deliveries SET dead_at = date_trunc('second', now())")
        .execute(&db.pool)
        .await
        .expect("tie the dead times")
        .rows_affected();
    assert_eq!(tied, 30, "ten events dead at three destinations");
    let base = serve(relay).await;
    for limit in 1..=10 {
        let mut seen = HashSet::new();
        let mut pages = 0;
        let mut after = String::new();
        loop {
            let url = format!("{base}/api/v1/events?state=dead&limit={limit}&cursor={after}");
            let (status, text, _) = raw("GET", &url, None, false).await;
            assert_eq!(status, 200, "{text}");
            let page: Value = serde_json::from_str(&text).expect("json");
            for e in page["events"].as_array().expect("events") {
                let pair = format!("{}@{}", e["id"], e["destination"]);
                assert!(seen.insert(pair.clone()), "limit {limit}: {pair} twice");
            }
            pages += 1;
            assert!(pages <= 40, "limit {limit}: the pages do not end");
            match page["next_cursor"].as_str() {
                Some(c) => after = c.to_owned(),
                None => break,
            }
        }
        assert_eq!(seen.len(), 30, "limit {limit}: every dead pair once");
    }
}

/// Nests `depth` arrays around a number.
fn nested(depth: usize) -> Value {
    let mut v = json!(1);
    for _ in 0..depth {
        v = json!([v]);
    }
    v
}

/// An upgraded table may hold NULL topics and creation times, and any payload: the operator's
/// commands and the console show such rows instead of failing on them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_views_show_rows_that_break_the_tables_assumptions() {
    let db = TestDb::migrated().await;
    let rx = Receiver::start().await;
    sqlx::query("ALTER TABLE outbox ALTER COLUMN topic DROP NOT NULL, ALTER COLUMN created_at DROP NOT NULL")
        .execute(&db.pool)
        .await
        .expect("relax the table");
    let deep = nested(600);
    let mut ids = Vec::new();
    for (topic, created, payload) in [
        (None, true, json!({ "a": 1 })),
        (Some("t.null_created"), false, json!({ "b": 2 })),
        (Some("t.deep"), true, deep.clone()),
    ] {
        let id: uuid::Uuid = sqlx::query_scalar(
            "INSERT INTO outbox (topic, payload, created_at, attempts, last_error, dead_at)
             VALUES ($1, $2, CASE WHEN $3 THEN now() END, 1, 'broken row', now()) RETURNING id",
        )
        .bind(topic)
        .bind(&payload)
        .bind(created)
        .fetch_one(&db.pool)
        .await
        .expect("insert");
        ids.push(id);
    }
    // A pending one of each kind too: the gauges and status count them.
    sqlx::query(
        "INSERT INTO outbox (topic, payload, created_at) VALUES (NULL, '{}', now()), ('t.p', '{}', NULL)",
    )
    .execute(&db.pool)
    .await
    .expect("insert pending");

    let dir = scratch();
    let config = write_config(dir.path(), &webhook_config(&db, &rx.url, ""));
    let config = config.to_str().expect("path");
    for args in [
        vec!["status", "--config", config],
        vec!["status", "--json", "--config", config],
        vec!["dead", "list", "--config", config],
    ] {
        let (code, out, err) = run(&args);
        assert_eq!(code, 0, "{args:?}: {err}");
        assert!(!out.is_empty(), "{args:?}");
    }
    for id in &ids {
        let (code, out, err) = run(&["dead", "show", &id.to_string(), "--config", config]);
        assert_eq!(code, 0, "dead show {id}: {err}");
        assert!(out.contains(&id.to_string()), "{out}");
    }

    let relay = Arc::new(
        Relay::new(
            db.pool.clone(),
            &parse_config(&webhook_config(&db, &rx.url, "")),
        )
        .expect("relay"),
    );
    let base = serve(relay).await;
    let api = |path: &str| format!("{base}/api/v1{path}");
    let (status, text, _) = raw("GET", &api("/overview"), None, false).await;
    assert_eq!(status, 200, "{text}");
    let (status, text, _) = raw("GET", &api("/events?state=dead"), None, false).await;
    assert_eq!(status, 200, "{text}");
    let page: Value = serde_json::from_str(&text).expect("json");
    assert_eq!(page["events"].as_array().map(Vec::len), Some(3), "{page}");
    assert!(
        page["events"]
            .as_array()
            .expect("events")
            .iter()
            .any(|e| e["topic"].is_null()),
        "a NULL topic is shown as null: {page}"
    );
    // The deep payload comes back whole, as the JSON it is (this test's JSON parser, like the
    // relay's, stops at 128 levels, so it is compared as text).
    let deep_text = serde_json::to_string(&deep).expect("deep");
    for id in &ids {
        let (status, text, _) = raw("GET", &api(&format!("/events/{id}")), None, false).await;
        assert_eq!(status, 200, "{id}: {text}");
        assert!(text.contains(&id.to_string()), "{text}");
        if id == &ids[2] {
            assert!(text.contains(&deep_text), "the deep payload whole");
        }
    }
}

/// Secure by default: a `Host` the console does not answer to (DNS rebinding) is refused, every
/// answer says `no-store`, readiness runs a sink's health check at most once per few seconds
/// whatever the callers' rate, and a relay listening beyond loopback with no read token does not
/// start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secure_defaults_host_names_no_store_cached_readiness_and_no_open_reads() {
    let db = TestDb::migrated().await;
    // A destination that counts the health checks (HEAD requests) it gets.
    let heads = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = heads.clone();
    let app = axum::Router::new().route(
        "/hook",
        axum::routing::any(move || {
            let counter = counter.clone();
            async move {
                counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                "ok"
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}/hook", listener.local_addr().expect("addr"));
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    let relay = Arc::new(
        Relay::new(
            db.pool.clone(),
            &parse_config(&webhook_config(&db, &url, "")),
        )
        .expect("relay"),
    );
    for _ in 0..20 {
        let _ = relay.readiness().await;
    }
    assert_eq!(
        heads.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "twenty readiness calls, one health check"
    );

    let base = serve(relay).await;
    let client = reqwest::Client::new();
    let port = base.rsplit(':').next().expect("port");
    for (host, allowed) in [
        (format!("127.0.0.1:{port}"), true),
        (format!("localhost:{port}"), true),
        (format!("LOCALHOST:{port}"), true),
        (format!("[::1]:{port}"), true),
        (format!("attacker.example:{port}"), false),
        ("attacker.example".to_owned(), false),
        (format!("127.0.0.1.attacker.example:{port}"), false),
    ] {
        for path in ["/api/v1/overview", "/console", "/api/openapi.json"] {
            let resp = client
                .get(format!("{base}{path}"))
                .header("host", &host)
                .bearer_auth(ADMIN)
                .send()
                .await
                .expect("request");
            let status = resp.status().as_u16();
            assert_eq!(
                resp.headers()
                    .get("cache-control")
                    .and_then(|v| v.to_str().ok()),
                Some("no-store"),
                "{host} {path}"
            );
            if allowed {
                assert_eq!(status, 200, "{host} {path}");
            } else {
                assert_eq!(status, 421, "{host} {path}");
                let body: Value = resp.json().await.expect("json");
                assert!(body["error"]
                    .as_str()
                    .unwrap_or_default()
                    .starts_with("host:"));
            }
        }
    }

    // Beyond loopback without a read token: refused at start, with the way out named.
    let dir = scratch();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port();
    let config = write_config(
        dir.path(),
        &webhook_config(
            &db,
            &url,
            &format!("[observability]\nlisten = \"0.0.0.0:{port}\"\n"),
        ),
    );
    let mut child = spawn_relay(dir.path(), &config, "open");
    let status = exit_status(&mut child, std::time::Duration::from_secs(30))
        .await
        .expect("the relay refuses to start");
    assert!(!status.success());
    let log = std::fs::read_to_string(dir.path().join("relay-open.log")).expect("log");
    assert!(
        log.contains("admin.read_token") && log.contains("admin.open_reads"),
        "{log}"
    );
}
