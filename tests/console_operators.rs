//! What operators reach for in the console beyond the basics: named tokens with roles and the
//! audit log of every change (console and CLI, shown by both), total match counts, topic prefix
//! and payload search, each destination's settings with secrets masked, and the chart shared by
//! every relay through the database.

mod common;

use std::sync::Arc;

use pgoutbox::engine::Relay;
use pgoutbox::server::Samples;
use serde_json::json;

use common::*;

use common::api_call as call;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn named_tokens_roles_and_the_audit_log_of_console_and_cli() {
    let db = TestDb::migrated().await;
    let (rx, _) = Receiver::refusing(400, "no").await;
    let config_text = webhook_config(
        &db,
        &rx.url,
        "max_attempts = 1\nsecret = \"whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD\"",
    );
    let relay = Arc::new(Relay::new(db.pool.clone(), &parse_config(&config_text)).expect("relay"));
    db.insert_plain(4, "order.created").await;
    db.insert_plain(2, "invoice.sent").await;
    relay.run_once().await.expect("run");
    let base = serve_console(relay, Arc::new(Samples::default()), TOKENS).await;
    let api = |path: &str| format!("{base}/api/v1{path}");

    // Reads need a token (a read-only one exists); the reader may read, not change.
    assert_eq!(call("GET", &api("/overview"), None, None).await.0, 401);
    let (status, overview) = call("GET", &api("/overview"), Some(VIEWER), None).await;
    assert_eq!(status, 200, "{overview}");
    assert_eq!(overview["admin"]["mutations_enabled"], true);
    let (status, body) = call(
        "POST",
        &api("/dead/retry"),
        Some(VIEWER),
        Some(json!({ "topic": "invoice.sent" })),
    )
    .await;
    assert_eq!(status, 403, "{body}");
    assert!(body["error"]
        .as_str()
        .unwrap_or_default()
        .contains("victor"));

    // Settings: routing and retry as configured, the signing secret masked.
    let settings = &overview["destinations"][0]["settings"];
    assert_eq!(settings["max_attempts"], 1, "{settings}");
    assert_eq!(settings["sink"]["secret"], "***", "{settings}");
    assert!(!overview.to_string().contains("whsec_"));

    // Changes by alice through the console.
    let (status, retried) = call(
        "POST",
        &api("/dead/retry"),
        Some(OPS),
        Some(json!({ "topic": "invoice.sent" })),
    )
    .await;
    assert_eq!(
        (status, retried["matched"].as_u64()),
        (200, Some(2)),
        "{retried}"
    );
    let (status, _) = call(
        "POST",
        &api("/dead/retry"),
        Some(OPS),
        Some(json!({ "dry_run": true })),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(
        call("POST", &api("/destinations/hooks/pause"), Some(OPS), None)
            .await
            .0,
        200
    );
    assert_eq!(
        call("POST", &api("/destinations/hooks/resume"), Some(OPS), None)
            .await
            .0,
        200
    );

    // And one through the CLI.
    let dir = scratch();
    let config = write_config(dir.path(), &config_text);
    let config = config.to_str().expect("path");
    let (code, out, err) = run(&[
        "dead",
        "discard",
        "--all",
        "--topic",
        "order.created",
        "--yes",
        "--config",
        config,
    ]);
    assert_eq!(code, 0, "{out}{err}");

    // The log, newest first: the CLI's discard, resume, pause, retry (the dry run is not a change).
    let (status, log) = call("GET", &api("/audit"), Some(VIEWER), None).await;
    assert_eq!(status, 200, "{log}");
    let changes = log["changes"].as_array().expect("changes");
    let actions: Vec<&str> = changes
        .iter()
        .map(|c| c["action"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(actions, ["discard", "resume", "pause", "retry"], "{log}");
    assert_eq!(changes[0]["via"], "cli");
    assert_eq!(changes[0]["matched"], 4);
    assert_eq!(changes[0]["filter"]["topic"], "order.created");
    assert!(changes[1..]
        .iter()
        .all(|c| c["who"] == "alice" && c["via"] == "console"));
    assert_eq!(changes[3]["filter"], json!({ "topic": "invoice.sent" }));
    assert_eq!(changes[3]["matched"], 2);
    // Paged.
    let (_, first) = call("GET", &api("/audit?limit=3"), Some(VIEWER), None).await;
    let before = first["next_before"].as_i64().expect("a next page");
    let (_, rest) = call(
        "GET",
        &api(&format!("/audit?limit=3&before={before}")),
        Some(VIEWER),
        None,
    )
    .await;
    assert_eq!(rest["changes"].as_array().map(Vec::len), Some(1), "{rest}");

    let (code, out, err) = run(&["audit", "--config", config]);
    assert_eq!(code, 0, "{err}");
    for word in ["discard", "resume", "pause", "retry", "alice", "cli"] {
        assert!(out.contains(word), "{word}: {out}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn totals_topic_prefix_and_payload_search() {
    let db = TestDb::migrated().await;
    let (rx, _) = Receiver::refusing(400, "no").await;
    let relay = Arc::new(
        Relay::new(
            db.pool.clone(),
            &parse_config(&webhook_config(&db, &rx.url, "max_attempts = 1")),
        )
        .expect("relay"),
    );
    for (topic, customer) in [
        ("order.created", "c-1"),
        ("order.created", "c-2"),
        ("order.paid", "c-1"),
        ("invoice.sent", "c-1"),
    ] {
        sqlx::query("INSERT INTO outbox (topic, payload) VALUES ($1, $2)")
            .bind(topic)
            .bind(json!({ "customer": customer, "lines": [1, 2] }))
            .execute(&db.pool)
            .await
            .expect("insert");
    }
    relay.run_once().await.expect("run");
    let base = serve_console(relay, Arc::new(Samples::default()), "").await;
    let search = |query: &str| {
        let url = format!("{base}/api/v1/events?state=dead&{query}");
        async move { call("GET", &url, None, None).await }
    };
    let (status, page) = search("total=true&limit=1").await;
    assert_eq!(status, 200, "{page}");
    assert_eq!(page["total"], 4, "{page}");
    assert_eq!(page["events"].as_array().map(Vec::len), Some(1));
    let (_, page) = search("topic_prefix=order.&total=true").await;
    assert_eq!(page["total"], 3, "{page}");
    let (_, page) = search(&format!(
        "payload={}&total=true",
        percent_encode(br#"{"customer":"c-1"}"#)
    ))
    .await;
    assert_eq!(page["total"], 3, "{page}");
    let (_, page) = search(&format!(
        "payload={}&topic_prefix=order.&total=true",
        percent_encode(br#"{"customer":"c-1"}"#)
    ))
    .await;
    assert_eq!(page["total"], 2, "{page}");
    // A percent sign or underscore in a prefix is a character, not a pattern.
    let (_, page) = search("topic_prefix=%25&total=true").await;
    assert_eq!(page["total"], 0, "{page}");
    let (status, page) = search("payload=42").await;
    assert_eq!(status, 400, "{page}");
    assert!(page["error"]
        .as_str()
        .unwrap_or_default()
        .starts_with("payload:"));
    let (status, page) = search(&format!("payload={}", percent_encode(br#"{"a":"\u0000"}"#))).await;
    assert_eq!(status, 400, "{page}");
}

/// Two relay processes on one outbox: each stores its samples in the database, and either
/// console charts both (delivery rates summed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chart_is_shared_by_every_relay_through_the_database() {
    let db = TestDb::migrated().await;
    let rx = Receiver::start().await;
    let dir = scratch();
    let mut relays = Vec::new();
    let mut ports = Vec::new();
    for tag in ["a", "b"] {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .expect("bind")
            .local_addr()
            .expect("addr")
            .port();
        let own = dir.path().join(tag);
        std::fs::create_dir_all(&own).expect("dir");
        let config = write_config(
            &own,
            &webhook_config(
                &db,
                &rx.url,
                &format!(
                    "[observability]\nlisten = \"127.0.0.1:{port}\"\ngauge_interval = \"200ms\"\n"
                ),
            ),
        );
        relays.push(spawn_relay(&own, &config, tag));
        ports.push(port);
    }
    db.insert_plain(200, "order.created").await;
    let relays_in_chart = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(DISTINCT relay) FROM outbox_samples")
            .fetch_one(&db.pool)
            .await
            .unwrap_or(0)
    };
    let both = wait_for(std::time::Duration::from_secs(30), || async {
        relays_in_chart().await == 2
    })
    .await;
    assert!(
        both,
        "both relays store samples: {}",
        std::fs::read_to_string(dir.path().join("a").join("relay-a.log")).unwrap_or_default()
    );
    let (status, samples) = call(
        "GET",
        &format!("http://127.0.0.1:{}/api/v1/samples", ports[0]),
        None,
        None,
    )
    .await;
    assert_eq!(status, 200, "{samples}");
    assert!(!samples["samples"].as_array().expect("samples").is_empty());
    for mut relay in relays {
        signal(&relay, libc::SIGTERM);
        let _ = exit_status(&mut relay, std::time::Duration::from_secs(30)).await;
    }
    // A restarted console still has them: they are in the database, at most an hour's worth.
    let old: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox_samples WHERE at < now() - interval '1 hour'",
    )
    .fetch_one(&db.pool)
    .await
    .expect("count");
    assert_eq!(old, 0);
}
