//! Failure handling: retries with backoff, Retry-After, dead letters and redrive, cleanup, status.

mod common;

use std::collections::HashSet;
use std::time::Duration;

use common::*;
use pgoutbox::engine::Relay;

/// Runs a relay (retrying every 100 ms) until the one event inserted is published, at most 20 s.
async fn run_until_the_event_is_published(db: &TestDb, rx: &Receiver) {
    let relay = Running::start(
        db,
        &webhook_config(db, &rx.url, "retry_schedule = [\"100ms\"]"),
    );
    let done = wait_for(Duration::from_secs(20), || async {
        db.count("published_at IS NOT NULL").await == 1
    })
    .await;
    relay.stop().await;
    assert!(done);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_503s_then_200_delivers_on_the_fourth_attempt() {
    let db = TestDb::migrated().await;
    let rx = Receiver::with(|r| {
        if r.nth < 3 {
            Reply::status(503).body("busy")
        } else {
            Reply::ok()
        }
    })
    .await;
    let id = db.insert_plain(1, "order.created").await.remove(0);
    run_until_the_event_is_published(&db, &rx).await;
    let log = rx.log();
    assert_eq!(
        log.iter().map(|r| r.status).collect::<Vec<_>>(),
        vec![503, 503, 503, 200]
    );
    assert!(
        log.iter().all(|r| r.id == id),
        "webhook-id is stable across retries"
    );
    let (attempts, last_error): (i32, String) =
        sqlx::query_as("SELECT attempts, last_error FROM outbox WHERE id = $1::uuid")
            .bind(&id)
            .fetch_one(&db.pool)
            .await
            .expect("row");
    assert_eq!(
        attempts, 3,
        "three failed attempts recorded before the success"
    );
    assert!(
        last_error.contains("attempt 3")
            && last_error.contains("503")
            && last_error.contains("busy"),
        "{last_error}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_is_honoured() {
    let db = TestDb::migrated().await;
    let rx = Receiver::with(|r| {
        if r.nth == 0 {
            Reply::status(429).header("retry-after", "2")
        } else {
            Reply::ok()
        }
    })
    .await;
    db.insert_plain(1, "order.created").await;
    run_until_the_event_is_published(&db, &rx).await;
    let log = rx.log();
    assert_eq!(log.len(), 2);
    let gap = log[1].at - log[0].at;
    assert!(
        gap >= Duration::from_secs(2),
        "next attempt not before 2 s, was {gap:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_400_dead_letters_at_once_with_status_and_body() {
    let db = TestDb::migrated().await;
    let rx = Receiver::with(|_| Reply::status(400).body("{\"error\":\"customer_id is required\"}"))
        .await;
    db.insert_plain(1, "order.created").await;
    let config = parse_config(&webhook_config(&db, &rx.url, ""));
    let report = Relay::new(db.pool.clone(), &config)
        .expect("relay")
        .run_once()
        .await
        .expect("run");
    assert_eq!(report.dead, 1);
    assert_eq!(rx.log().len(), 1, "a permanent failure is not retried");
    let (dead, last_error, destination): (bool, String, String) =
        sqlx::query_as("SELECT dead_at IS NOT NULL, last_error, destination FROM outbox")
            .fetch_one(&db.pool)
            .await
            .expect("row");
    assert!(dead);
    assert_eq!(destination, "hooks");
    assert!(
        last_error.contains("HTTP 400 Bad Request")
            && last_error.contains("customer_id is required"),
        "{last_error}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_401_or_404_is_retried_unless_listed_in_permanent_statuses() {
    // Credentials being rotated, a route moved: retried by default, then delivered.
    for status in [401u16, 403, 404, 301] {
        let db = TestDb::migrated().await;
        let rx = Receiver::with(move |r| {
            if r.nth < 2 {
                Reply::status(status).header("location", "http://127.0.0.1:1/moved")
            } else {
                Reply::ok()
            }
        })
        .await;
        db.insert_plain(1, "order.created").await;
        run_until_the_event_is_published(&db, &rx).await;
        assert_eq!(rx.log().len(), 3, "{status}: two failures, then delivered");
        assert_eq!(db.count("dead_at IS NOT NULL").await, 0, "{status}");
    }

    // A destination that knows its 404s are final says so.
    let db = TestDb::migrated().await;
    let rx = Receiver::with(|_| Reply::status(404).body("no such hook")).await;
    db.insert_plain(1, "order.created").await;
    let config = parse_config(&webhook_config(
        &db,
        &rx.url,
        "permanent_statuses = [404, 410]",
    ));
    let report = Relay::new(db.pool.clone(), &config)
        .expect("relay")
        .run_once()
        .await
        .expect("run");
    assert_eq!(report.dead, 1, "{report:?}");
    let last_error: String = sqlx::query_scalar("SELECT last_error FROM outbox")
        .fetch_one(&db.pool)
        .await
        .expect("row");
    assert!(
        last_error.contains("HTTP 404 Not Found") && last_error.contains("no such hook"),
        "{last_error}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timing_out_endpoint_is_retried_while_other_events_flow() {
    let db = TestDb::migrated().await;
    // Events of topic "slow" hang far past the request timeout; the rest answer at once.
    let rx = Receiver::with(|r| {
        if r.json()["type"] == "slow" {
            Reply::ok().delay(Duration::from_secs(30))
        } else {
            Reply::ok()
        }
    })
    .await;
    db.insert_plain(1, "slow").await;
    let text = webhook_config(
        &db,
        &rx.url,
        "timeout = \"300ms\"\nretry_schedule = [\"200ms\"]",
    )
    .replace("[relay]\n", "[relay]\nbatch_size = 10\n");
    let relay = Running::start(&db, &text);
    let mut fast = HashSet::new();
    for _ in 0..5 {
        fast.extend(db.insert_plain(20, "fast").await);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let done = wait_for(Duration::from_secs(20), || async {
        db.count("topic = 'fast' AND published_at IS NULL").await == 0
            && db.count("topic = 'slow' AND attempts >= 3").await == 1
    })
    .await;
    relay.stop().await;
    assert!(done, "fast events delivered and the slow one retried");
    assert_eq!(rx.delivered_ids().intersection(&fast).count(), fast.len());
    let last_error: String =
        sqlx::query_scalar("SELECT last_error FROM outbox WHERE topic = 'slow'")
            .fetch_one(&db.pool)
            .await
            .expect("row");
    assert!(last_error.contains("timed out"), "{last_error}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_event_does_not_delay_the_healthy_ones_behind_it() {
    let db = TestDb::migrated().await;
    let rx = Receiver::with(|r| {
        if r.json()["type"] == "poison" {
            Reply::status(422)
        } else {
            Reply::ok()
        }
    })
    .await;
    db.insert_plain(1, "poison").await;
    let healthy: HashSet<String> = db
        .insert_plain(1000, "order.created")
        .await
        .into_iter()
        .collect();
    let config = parse_config(&webhook_config(&db, &rx.url, ""));
    let report = Relay::new(db.pool.clone(), &config)
        .expect("relay")
        .run_once()
        .await
        .expect("run");
    assert_eq!((report.delivered, report.dead), (1000, 1));
    assert_eq!(rx.delivered_ids(), healthy);
    assert_eq!(rx.log().iter().filter(|r| r.status == 422).count(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_can_be_listed_retried_and_discarded() {
    let db = TestDb::migrated().await;
    let rx = Receiver::with(|_| Reply::status(410)).await;
    db.insert_plain(3, "order.created").await;
    db.insert_plain(2, "payment.failed").await;
    let dir = scratch();
    let config = write_config(dir.path(), &webhook_config(&db, &rx.url, ""));
    let config = config.to_str().expect("utf8");
    let (code, _, err) = run(&["relay", "--once", "--config", config]);
    assert_eq!(code, 3, "{err}");
    assert_eq!(db.count("dead_at IS NOT NULL").await, 5);

    let (code, out, _) = run(&[
        "dead",
        "list",
        "--config",
        config,
        "--topic",
        "payment.failed",
        "--json",
    ]);
    assert_eq!(code, 0);
    let listed: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).expect("json line"))
        .collect();
    assert_eq!(listed.len(), 2);
    assert!(listed[0]["last_error"]
        .as_str()
        .expect("text")
        .contains("410"));
    let id = listed[0]["id"].as_str().expect("id").to_owned();

    let (code, out, err) = run(&["dead", "show", &id, "--config", config]);
    assert_eq!(code, 0);
    assert!(out.contains("\"payload\"") && out.contains(&id), "{out}");
    assert!(
        err.contains("failed attempts (") && err.contains("410") && err.contains("(dead-lettered)"),
        "the attempt history: {err}"
    );

    // Dry runs change nothing.
    let (_, out, _) = run(&["dead", "retry", "--all", "--dry-run", "--config", config]);
    assert!(out.contains("5 dead events would be put back"), "{out}");
    let (_, out, _) = run(&[
        "dead",
        "discard",
        "--all",
        "--topic",
        "payment.failed",
        "--dry-run",
        "--config",
        config,
    ]);
    assert!(out.contains("2 dead events would be discarded"), "{out}");
    assert_eq!(db.count("dead_at IS NOT NULL").await, 5);

    // Discard without --yes and without a terminal refuses.
    let (code, _, err) = run(&["dead", "discard", &id, "--config", config]);
    assert_eq!(code, 1);
    assert!(err.contains("--yes"), "{err}");
    let (code, out, _) = run(&[
        "dead",
        "discard",
        "--all",
        "--topic",
        "payment.failed",
        "--yes",
        "--config",
        config,
    ]);
    assert_eq!(code, 0);
    assert!(out.contains("2 dead events discarded"), "{out}");
    assert_eq!(db.count("true").await, 3);

    // Redrive: the receiver is fixed, the dead events are delivered.
    rx.set(|_| Reply::ok());
    let (code, out, _) = run(&["dead", "retry", "--all", "--config", config]);
    assert_eq!(code, 0);
    assert!(out.contains("3 dead events put back as due"), "{out}");
    assert_eq!(db.count("dead_at IS NULL AND attempts = 0").await, 3);
    let (code, _, err) = run(&["relay", "--once", "--config", config]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(db.count("published_at IS NOT NULL").await, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cleanup_deletes_only_published_rows_past_retention() {
    let db = TestDb::migrated().await;
    sqlx::raw_sql(
        "INSERT INTO outbox (topic, payload, created_at, published_at)
           SELECT 'old.published', '{}', now() - interval '30 days', now() - interval '30 days' FROM generate_series(1, 12000);
         INSERT INTO outbox (topic, payload, created_at, published_at)
           SELECT 'recent.published', '{}', now() - interval '1 day', now() - interval '1 day' FROM generate_series(1, 10);
         INSERT INTO outbox (topic, payload, created_at)
           SELECT 'ancient.pending', '{}', now() - interval '90 days' FROM generate_series(1, 10);
         INSERT INTO outbox (topic, payload, created_at, dead_at, last_error)
           SELECT 'old.dead', '{}', now() - interval '60 days', now() - interval '59 days', 'HTTP 400' FROM generate_series(1, 10);
         INSERT INTO outbox (topic, payload) SELECT 'new.pending', '{}' FROM generate_series(1, 10);",
    )
    .execute(&db.pool)
    .await
    .expect("fixture");
    let cli = |extra: &[&str]| {
        let mut args = vec!["cleanup", "--database-url", &db.url];
        args.extend_from_slice(extra);
        run(&args)
    };
    let (code, out, err) = cli(&["--dry-run"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("dry run: 12000 published and 0 dead rows would be deleted"),
        "{out}"
    );
    assert_eq!(db.count("true").await, 12040);

    let (code, out, err) = cli(&[]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("12000 published and 0 dead rows deleted"),
        "{out}"
    );
    for (topic, left) in [
        ("old.published", 0),
        ("recent.published", 10),
        ("ancient.pending", 10),
        ("old.dead", 10),
        ("new.pending", 10),
    ] {
        assert_eq!(
            db.count(&format!("topic = '{topic}'")).await,
            left,
            "{topic}"
        );
    }

    // Dead rows go only under their own retention.
    let (code, out, _) = run(&["cleanup", "--database-url", &db.url]);
    assert_eq!(code, 0);
    assert!(out.contains("0 published and 0 dead"), "{out}");
    let out = pgoutbox()
        .args(["cleanup", "--database-url", &db.url])
        .env("PGOUTBOX_DEAD_RETENTION", "30d")
        .output()
        .expect("run");
    assert!(String::from_utf8_lossy(&out.stdout).contains("0 published and 10 dead rows deleted"));
    assert_eq!(
        db.count("topic = 'ancient.pending'").await,
        10,
        "pending rows are never deleted"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_zero_deletes_at_settle_time() {
    let db = TestDb::migrated().await;
    let rx = Receiver::start().await;
    db.insert_plain(50, "order.created").await;
    let config = parse_config(&format!(
        "retention = \"0s\"\n{}",
        webhook_config(&db, &rx.url, "")
    ));
    Relay::new(db.pool.clone(), &config)
        .expect("relay")
        .run_once()
        .await
        .expect("run");
    assert_eq!(rx.delivered_ids().len(), 50);
    assert_eq!(db.count("true").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_json_reports_due_backoff_dead_and_lag() {
    let db = TestDb::migrated().await;
    sqlx::raw_sql(
        "INSERT INTO outbox (topic, payload, created_at, next_attempt_at) SELECT 'order.created', '{}', now() - interval '90 seconds', now() - interval '90 seconds' FROM generate_series(1, 4);
         INSERT INTO outbox (topic, payload, attempts, next_attempt_at, destination) SELECT 'order.created', '{}', 2, now() + interval '1 hour', 'billing' FROM generate_series(1, 3);
         INSERT INTO outbox (topic, payload, dead_at, destination) SELECT 'payment.failed', '{}', now(), 'billing' FROM generate_series(1, 2);
         INSERT INTO outbox (topic, payload, published_at, destination) SELECT 'order.created', '{}', now(), 'billing' FROM generate_series(1, 5);",
    )
    .execute(&db.pool)
    .await
    .expect("fixture");
    let dir = scratch();
    let config = write_config(
        dir.path(),
        &format!(
            "database_url = \"{}\"\n[[destinations]]\nname = \"billing\"\ntype = \"null\"\n",
            db.url
        ),
    );
    let (code, out, err) = run(&[
        "status",
        "--json",
        "--config",
        config.to_str().expect("utf8"),
    ]);
    assert_eq!(code, 0, "{err}");
    let status: serde_json::Value = serde_json::from_str(&out).expect("json");
    let t = &status["totals"];
    assert_eq!(
        (t["due"].as_i64(), t["backoff"].as_i64(), t["dead"].as_i64()),
        (Some(4), Some(3), Some(2))
    );
    assert_eq!(t["failing"], 3);
    assert_eq!(t["published_last_minute"], 5);
    let lag = t["oldest_pending_age_seconds"].as_f64().expect("lag");
    assert!((89.0..600.0).contains(&lag), "{lag}");
    let rows = status["rows"].as_array().expect("rows");
    assert!(
        rows.iter().all(|r| r["destination"] == "billing"),
        "untried rows get their routed destination"
    );
    assert_eq!(rows.len(), 2, "one row per (destination, topic)");

    let (code, out, _) = run(&["status", "--config", config.to_str().expect("utf8")]);
    assert_eq!(code, 0);
    assert!(
        out.contains("DESTINATION") && out.contains("TOTAL") && out.contains("1m 3"),
        "{out}"
    );
}
