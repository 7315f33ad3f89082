//! The operator console's API against a real relay and database: every endpoint, pagination,
//! filters, retry and discard by filter with a dry run first, pause and resume obeyed by every
//! relay process, and 401/403 without the right token.

mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use pgoutbox::engine::Relay;
use pgoutbox::server::Samples;
use serde_json::{json, Value};

use common::*;

const ADMIN: &str = "adm1n-t0ken";
const READER: &str = "r3ad-t0ken";

/// Serves the console of an in-process relay on a free port; returns its base URL.
async fn serve(relay: Arc<Relay>, admin: &str) -> String {
    serve_console(relay, Arc::new(Samples::default()), admin).await
}

use common::api_call as call;

/// Dead-letters `n` events of `topic` (the receiver refuses them with a 400), plus one whose payload
/// holds markup.
async fn dead_events(db: &TestDb, relay: &Relay, n: usize, topic: &str) {
    db.insert_plain(n, topic).await;
    sqlx::query("INSERT INTO outbox (topic, payload, key) VALUES ('page.viewed', $1, 'k-1')")
        .bind(json!({ "html": "<script>alert(1)</script>" }))
        .execute(&db.pool)
        .await
        .expect("insert");
    relay.run_once().await.expect("run");
    assert_eq!(db.count("dead_at IS NOT NULL").await, n as i64 + 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_endpoint_with_tokens_filters_pages_and_dry_runs() {
    let db = TestDb::migrated().await;
    let (rx, accept) = Receiver::refusing(400, "no such customer").await;
    let config = webhook_config(
        &db,
        &rx.url,
        "topics = [\"order.*\", \"page.*\"]\nmax_attempts = 1",
    );
    let relay = Arc::new(Relay::new(db.pool.clone(), &parse_config(&config)).expect("relay"));
    dead_events(&db, &relay, 5, "order.created").await;
    let base = serve(
        relay.clone(),
        &format!("token = \"{ADMIN}\"\nread_token = \"{READER}\""),
    )
    .await;
    let api = |path: &str| format!("{base}/api/v1{path}");

    // Reads need the read token (or the admin token).
    assert_eq!(call("GET", &api("/overview"), None, None).await.0, 401);
    assert_eq!(
        call("GET", &api("/overview"), Some("nope"), None).await.0,
        401
    );
    let (status, overview) = call("GET", &api("/overview"), Some(READER), None).await;
    assert_eq!(status, 200, "{overview}");
    assert_eq!(
        call("GET", &api("/overview"), Some(ADMIN), None).await.0,
        200
    );
    let hooks = &overview["destinations"][0];
    assert_eq!(hooks["name"], "hooks");
    assert_eq!(hooks["kind"], "webhook");
    assert_eq!(hooks["dead"], 6, "{overview}");
    assert_eq!(hooks["breaker"], "closed");
    assert_eq!(overview["admin"]["mutations_enabled"], true);
    assert!(
        !hooks["target"]
            .as_str()
            .unwrap_or_default()
            .contains("/events"),
        "the target has no path: {hooks}"
    );
    let (status, samples) = call("GET", &api("/samples"), Some(READER), None).await;
    assert_eq!(status, 200);
    assert!(samples["samples"].is_array());

    // Pages of 2, newest first, until the cursor runs out.
    let mut seen = Vec::new();
    let mut cursor = String::new();
    loop {
        let (status, page) = call(
            "GET",
            &api(&format!("/events?state=dead&limit=2&cursor={cursor}")),
            Some(READER),
            None,
        )
        .await;
        assert_eq!(status, 200, "{page}");
        let events = page["events"].as_array().expect("events").clone();
        assert!(events.len() <= 2);
        seen.extend(events.iter().map(|e| e["seq"].as_i64().expect("seq")));
        match page["next_cursor"].as_str() {
            Some(c) => cursor = c.to_owned(),
            None => break,
        }
    }
    assert_eq!(seen.len(), 6, "every dead event once: {seen:?}");
    assert!(
        seen.windows(2).all(|w| w[0] > w[1]),
        "newest first: {seen:?}"
    );

    // Filters: topic, key, destination, id, time, state.
    let count = |page: &Value| page["events"].as_array().map_or(0, Vec::len);
    let (_, by_topic) = call(
        "GET",
        &api("/events?state=dead&topic=page.viewed"),
        Some(READER),
        None,
    )
    .await;
    assert_eq!(count(&by_topic), 1);
    let marked = by_topic["events"][0]["id"].as_str().expect("id").to_owned();
    let (_, by_key) = call(
        "GET",
        &api("/events?state=dead&key=k-1"),
        Some(READER),
        None,
    )
    .await;
    assert_eq!(count(&by_key), 1);
    let (status, every) = call("GET", &api("/events?state=all"), Some(READER), None).await;
    assert_eq!(status, 400, "all states at once only by id: {every}");
    let (_, by_id) = call(
        "GET",
        &api(&format!("/events?state=all&id={marked}")),
        Some(READER),
        None,
    )
    .await;
    assert_eq!(count(&by_id), 1);
    let (_, other) = call(
        "GET",
        &api("/events?state=dead&destination=elsewhere"),
        Some(READER),
        None,
    )
    .await;
    assert_eq!(count(&other), 0);
    let (_, future) = call(
        "GET",
        &api("/events?state=dead&since=2999-01-01T00:00:00Z"),
        Some(READER),
        None,
    )
    .await;
    assert_eq!(count(&future), 0);
    let (_, pending) = call("GET", &api("/events?state=pending"), Some(READER), None).await;
    assert_eq!(count(&pending), 0);
    let (status, published) = call(
        "GET",
        &api("/events?state=published&topic=order.created"),
        Some(READER),
        None,
    )
    .await;
    assert_eq!((status, count(&published)), (200, 0), "{published}");
    let (status, bad) = call("GET", &api("/events?since=yesterday"), Some(READER), None).await;
    assert_eq!(status, 400, "{bad}");

    // One event whole: the markup comes back as data (the page shows it as text).
    let (status, event) = call(
        "GET",
        &api(&format!("/events/{marked}")),
        Some(READER),
        None,
    )
    .await;
    assert_eq!(status, 200, "{event}");
    assert_eq!(event["payload"]["html"], "<script>alert(1)</script>");
    assert_eq!(event["deliveries"][0]["state"], "dead");
    let history = event["attempts"].as_array().expect("attempt history");
    assert_eq!(history.len(), 1, "{event}");
    assert_eq!(history[0]["dead"], true);
    assert_eq!(history[0]["destination"], "hooks");
    assert!(history[0]["error"]
        .as_str()
        .unwrap_or_default()
        .contains("no such customer"));
    assert!(event["deliveries"][0]["last_error"]
        .as_str()
        .unwrap_or_default()
        .contains("400"));
    let missing = uuid::Uuid::new_v4();
    assert_eq!(
        call(
            "GET",
            &api(&format!("/events/{missing}")),
            Some(READER),
            None
        )
        .await
        .0,
        404
    );

    // Changes need the admin token: the read token is not enough.
    let retry_one = json!({ "ids": [marked], "dry_run": false });
    assert_eq!(
        call("POST", &api("/dead/retry"), None, Some(retry_one.clone()))
            .await
            .0,
        401
    );
    // The read token is known, so the answer is "not allowed" (403), not "who are you" (401).
    assert_eq!(
        call(
            "POST",
            &api("/dead/retry"),
            Some(READER),
            Some(retry_one.clone())
        )
        .await
        .0,
        403
    );
    assert_eq!(db.count("dead_at IS NOT NULL").await, 6, "nothing changed");

    // Retry one by id, the receiver now accepts: it is delivered.
    accept.store(true, Ordering::SeqCst);
    let (status, done) = call("POST", &api("/dead/retry"), Some(ADMIN), Some(retry_one)).await;
    assert_eq!((status, done["matched"].as_u64()), (200, Some(1)), "{done}");
    relay.run_once().await.expect("run");
    assert_eq!(rx.delivered().len(), 1);
    let (_, event) = call(
        "GET",
        &api(&format!("/events/{marked}")),
        Some(READER),
        None,
    )
    .await;
    assert_eq!(event["deliveries"][0]["state"], "published", "{event}");

    // Retry by filter: a dry run counts and changes nothing; then the real run.
    let filter = json!({ "topic": "order.created", "destination": "hooks", "dry_run": true });
    let (_, dry) = call("POST", &api("/dead/retry"), Some(ADMIN), Some(filter)).await;
    assert_eq!(
        (dry["matched"].as_u64(), dry["dry_run"].as_bool()),
        (Some(5), Some(true))
    );
    assert_eq!(db.count("dead_at IS NOT NULL").await, 5);
    let (_, dry) = call(
        "POST",
        &api("/dead/discard"),
        Some(ADMIN),
        Some(json!({ "topic": "order.created", "dry_run": true })),
    )
    .await;
    assert_eq!(dry["matched"].as_u64(), Some(5));
    assert_eq!(db.count("dead_at IS NOT NULL").await, 5);
    // Discard two by id, retry the rest by topic.
    let (_, page) = call(
        "GET",
        &api("/events?state=dead&limit=2"),
        Some(READER),
        None,
    )
    .await;
    let two: Vec<Value> = page["events"]
        .as_array()
        .expect("events")
        .iter()
        .map(|e| e["id"].clone())
        .collect();
    let (_, gone) = call(
        "POST",
        &api("/dead/discard"),
        Some(ADMIN),
        Some(json!({ "ids": two })),
    )
    .await;
    assert_eq!(gone["matched"].as_u64(), Some(2));
    let (_, back) = call(
        "POST",
        &api("/dead/retry"),
        Some(ADMIN),
        Some(json!({ "topic": "order.created" })),
    )
    .await;
    assert_eq!(back["matched"].as_u64(), Some(3));
    relay.run_once().await.expect("run");
    assert_eq!(rx.delivered().len(), 4);
    assert_eq!(db.count("dead_at IS NOT NULL").await, 0);
    let (_, published) = call(
        "GET",
        &api("/events?state=published&limit=500"),
        Some(READER),
        None,
    )
    .await;
    assert_eq!(count(&published), 4, "{published}");
    assert!(published["next_cursor"].is_null());

    // Pause and resume.
    assert_eq!(
        call("POST", &api("/destinations/nope/pause"), Some(ADMIN), None)
            .await
            .0,
        404
    );
    assert_eq!(
        call(
            "POST",
            &api("/destinations/hooks/pause"),
            Some(READER),
            None
        )
        .await
        .0,
        403
    );
    let (status, paused) = call("POST", &api("/destinations/hooks/pause"), Some(ADMIN), None).await;
    assert_eq!((status, paused["paused"].as_bool()), (200, Some(true)));
    let (_, overview) = call("GET", &api("/overview"), Some(READER), None).await;
    assert_eq!(overview["destinations"][0]["paused"], true);
    db.insert_plain(2, "order.created").await;
    relay.run_once().await.expect("run");
    assert_eq!(rx.delivered().len(), 4, "a paused destination gets nothing");
    let (_, resumed) = call(
        "POST",
        &api("/destinations/hooks/resume"),
        Some(ADMIN),
        None,
    )
    .await;
    assert_eq!(resumed["paused"].as_bool(), Some(false));
    relay.run_once().await.expect("run");
    assert_eq!(rx.delivered().len(), 6);

    // The page and the OpenAPI document are served from the binary.
    let page = reqwest::get(format!("{base}/")).await.expect("page");
    assert_eq!(page.status(), 200);
    let csp = page
        .headers()
        .get("content-security-policy")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    assert!(csp.contains("default-src 'self'"), "{csp}");
    assert!(page.text().await.expect("html").contains("/console/app.js"));
    for asset in ["/console/app.js", "/console/app.css"] {
        assert_eq!(
            reqwest::get(format!("{base}{asset}"))
                .await
                .expect("asset")
                .status(),
            200
        );
    }
    let (status, openapi) = call("GET", &format!("{base}/api/openapi.json"), None, None).await;
    assert_eq!(status, 200);
    for path in [
        "/api/v1/overview",
        "/api/v1/samples",
        "/api/v1/events",
        "/api/v1/events/{id}",
        "/api/v1/dead/retry",
        "/api/v1/dead/discard",
        "/api/v1/destinations/{name}/pause",
        "/api/v1/destinations/{name}/resume",
        "/api/v1/audit",
    ] {
        assert!(openapi["paths"].get(path).is_some(), "OpenAPI lacks {path}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_an_admin_token_changes_are_off_and_reads_are_open() {
    let db = TestDb::migrated().await;
    let rx = Receiver::start().await;
    let relay = Arc::new(
        Relay::new(
            db.pool.clone(),
            &parse_config(&webhook_config(&db, &rx.url, "")),
        )
        .expect("relay"),
    );
    let base = serve(relay, "").await;
    let (status, overview) = call("GET", &format!("{base}/api/v1/overview"), None, None).await;
    assert_eq!(status, 200);
    assert_eq!(overview["admin"]["mutations_enabled"], false);
    for path in ["/dead/retry", "/dead/discard"] {
        let (status, body) = call(
            "POST",
            &format!("{base}/api/v1{path}"),
            Some("anything"),
            Some(json!({ "dry_run": true })),
        )
        .await;
        assert_eq!(status, 403, "{body}");
        assert!(body["error"]
            .as_str()
            .unwrap_or_default()
            .contains("admin.token"));
    }
    let (status, _) = call(
        "POST",
        &format!("{base}/api/v1/destinations/hooks/pause"),
        None,
        None,
    )
    .await;
    assert_eq!(status, 403);
}

/// Two relay processes; the destination is paused through one's console: neither sends; resumed
/// through the other's: both may, and everything arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_through_one_console_holds_every_relay_process() {
    let db = TestDb::migrated().await;
    let rx = Receiver::start().await;
    let dir = scratch();
    let mut relays = Vec::new();
    let mut bases = Vec::new();
    for tag in ["a", "b"] {
        let port = common::private::free_port();
        let text = format!(
            "{}\n[observability]\nlisten = \"127.0.0.1:{port}\"\ngauge_interval = \"1s\"\n[admin]\ntoken = \"{ADMIN}\"\n",
            webhook_config(&db, &rx.url, "")
        );
        let sub = dir.path().join(tag);
        std::fs::create_dir_all(&sub).expect("dir");
        let path = write_config(&sub, &text);
        relays.push(spawn_relay(&sub, &path, tag));
        bases.push(format!("http://127.0.0.1:{port}"));
    }
    for base in &bases {
        let up = wait_for(Duration::from_secs(60), || async {
            reqwest::get(format!("{base}/healthz")).await.is_ok()
        })
        .await;
        assert!(up, "relay console at {base}");
    }
    let (status, _) = call(
        "POST",
        &format!("{}/api/v1/destinations/hooks/pause", bases[0]),
        Some(ADMIN),
        None,
    )
    .await;
    assert_eq!(status, 200);
    // Each relay re-reads the shared state every second; its /readyz line says when it has.
    for base in &bases {
        let knows = wait_for(Duration::from_secs(30), || async {
            match reqwest::get(format!("{base}/readyz/hooks")).await {
                Ok(r) => r.text().await.unwrap_or_default().contains("paused"),
                Err(_) => false,
            }
        })
        .await;
        assert!(knows, "relay at {base} sees the pause");
    }
    db.insert_plain(20, "order.created").await;
    // Both relays claim and hold them, and send none; the other console shows them held.
    let held = || async {
        let (_, overview) = call("GET", &format!("{}/api/v1/overview", bases[1]), None, None).await;
        overview["destinations"][0].clone()
    };
    let all_held = wait_for(Duration::from_secs(60), || async {
        held().await["held"] == 20
    })
    .await;
    let hooks = held().await;
    assert!(all_held, "held: {hooks}");
    assert_eq!(hooks["paused"], true);
    assert_eq!(
        rx.count(),
        0,
        "a paused destination gets nothing from any relay"
    );

    let (status, _) = call(
        "POST",
        &format!("{}/api/v1/destinations/hooks/resume", bases[1]),
        Some(ADMIN),
        None,
    )
    .await;
    assert_eq!(status, 200);
    let all = wait_for(Duration::from_secs(60), || async {
        rx.delivered_ids().len() == 20
    })
    .await;
    assert!(
        all,
        "delivered {} of 20 after resume",
        rx.delivered_ids().len()
    );
    for mut r in relays {
        let _ = r.kill();
        let _ = r.wait();
    }
}
