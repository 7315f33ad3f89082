//! Foundation: enqueue in the caller's transaction, the relay to a real webhook receiver, crash
//! safety, migrations and bad input.

mod common;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use pgoutbox::engine::Relay;
use pgoutbox::{Event, Outbox, OutboxTable};
use serde_json::json;

const SECRET: &str = "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn committed_events_are_delivered_and_rolled_back_ones_never() {
    let db = TestDb::migrated().await;
    let rx = Receiver::start().await;
    let outbox = Outbox::default();

    let mut committed = HashSet::new();
    let mut rolled_back = HashSet::new();
    for i in 0..20 {
        let mut tx = db.pool.begin().await.expect("begin");
        let event = Event::new("order.created", &json!({"order_id": i}))
            .expect("json")
            .key(format!("order-{i}"))
            .header("x-tenant", "acme");
        let id = outbox.enqueue(&mut tx, &event).await.expect("enqueue");
        if i % 4 == 3 {
            tx.rollback().await.expect("rollback");
            rolled_back.insert(id.to_string());
        } else {
            tx.commit().await.expect("commit");
            committed.insert(id.to_string());
        }
    }

    let config = parse_config(&webhook_config(
        &db,
        &rx.url,
        &format!("secret = \"{SECRET}\""),
    ));
    let relay = Relay::new(db.pool.clone(), &config).expect("relay");
    let report = relay.run_once().await.expect("run once");
    assert_eq!(report.delivered, committed.len());

    let delivered = rx.delivered_ids();
    assert_eq!(delivered, committed);
    assert!(delivered.is_disjoint(&rolled_back));
    assert_eq!(db.count("published_at IS NULL").await, 0);

    // The body is the documented envelope, the headers are Standard Webhooks and the event's own.
    let r = &rx.delivered()[0];
    let body = r.json();
    assert_eq!(body["id"], r.id.as_str());
    assert_eq!(body["type"], "order.created");
    assert!(body["key"].as_str().expect("key").starts_with("order-"));
    assert!(body["data"]["order_id"].is_number());
    chrono::DateTime::parse_from_rfc3339(body["timestamp"].as_str().expect("ts")).expect("rfc3339");
    assert_eq!(r.headers["x-tenant"], "acme");
    let headers = pgoutbox::webhook::SignedHeaders {
        id: &r.headers["webhook-id"],
        timestamp: &r.headers["webhook-timestamp"],
        signature: &r.headers["webhook-signature"],
    };
    pgoutbox::webhook::verify(
        &[SECRET],
        &headers,
        &r.body,
        pgoutbox::webhook::DEFAULT_TOLERANCE,
    )
    .expect("signature verifies");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_sql_insert_works_and_enqueue_many_keeps_order() {
    let db = TestDb::migrated().await;
    sqlx::query(
        "INSERT INTO outbox (topic, payload) VALUES ('order.created', '{\"order_id\": 1}')",
    )
    .execute(&db.pool)
    .await
    .expect("the plain INSERT of any language works");
    sqlx::query("SELECT outbox_enqueue('order.paid', '{\"order_id\": 1}', 'order-1')")
        .execute(&db.pool)
        .await
        .expect("the SQL function works");

    let events: Vec<Event> = (0..5)
        .map(|i| {
            Event::new("order.shipped", &json!({ "i": i }))
                .expect("json")
                .key("k")
        })
        .collect();
    let mut tx = db.pool.begin().await.expect("begin");
    let ids = Outbox::default()
        .enqueue_many(&mut tx, &events)
        .await
        .expect("enqueue many");
    tx.commit().await.expect("commit");
    assert_eq!(ids.len(), 5);

    let rx = Receiver::with(|_| Reply::ok()).await;
    let config = parse_config(&webhook_config(&db, &rx.url, "body = \"payload\""));
    Relay::new(db.pool.clone(), &config)
        .expect("relay")
        .run_once()
        .await
        .expect("run");
    let log = rx.delivered();
    assert_eq!(log.len(), 7);
    assert!(
        log.iter().any(|r| r.json() == json!({"order_id": 1})),
        "body = payload sends the raw payload"
    );
    let by_seq: Vec<uuid::Uuid> =
        sqlx::query_scalar("SELECT id FROM outbox WHERE topic = 'order.shipped' ORDER BY seq")
            .fetch_all(&db.pool)
            .await
            .expect("ids");
    assert_eq!(by_seq, ids, "enqueue_many keeps the given order in seq");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_json_payload_is_refused_before_the_database() {
    let err = Event::from_json_str("order.created", "{oops").expect_err("not JSON");
    assert_eq!(err.to_string(), "event payload is not valid JSON");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_relays_in_parallel_deliver_each_event_exactly_once() {
    let db = TestDb::migrated().await;
    let rx = Receiver::start().await;
    let ids: HashSet<String> = db
        .insert_plain(3000, "order.created")
        .await
        .into_iter()
        .collect();
    let dir = scratch();
    let config = write_config(
        dir.path(),
        &webhook_config(&db, &rx.url, "").replace("[relay]\n", "[relay]\nbatch_size = 50\n"),
    );
    let mut a = spawn_relay(dir.path(), &config, "a");
    let mut b = spawn_relay(dir.path(), &config, "b");
    let drained = wait_for(Duration::from_secs(60), || async {
        db.count("published_at IS NULL").await == 0
    })
    .await;
    signal(&a, libc::SIGTERM);
    signal(&b, libc::SIGTERM);
    assert!(a.wait().expect("wait").success());
    assert!(b.wait().expect("wait").success());
    assert!(drained, "backlog not drained");

    let log = rx.log();
    assert_eq!(
        log.len(),
        3000,
        "each event published once in the happy path"
    );
    assert_eq!(rx.delivered_ids(), ids);
    let a_log = std::fs::read_to_string(dir.path().join("relay-a.log")).expect("log");
    let b_log = std::fs::read_to_string(dir.path().join("relay-b.log")).expect("log");
    assert!(
        a_log.contains("batch settled") && b_log.contains("batch settled"),
        "both relays did work"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_killed_mid_batch_loses_nothing() {
    let db = TestDb::migrated().await;
    // Slow receiver: batches are in flight when the relay is killed.
    let rx = Receiver::with(|_| Reply::ok().delay(Duration::from_millis(20))).await;
    let ids: HashSet<String> = db
        .insert_plain(600, "order.created")
        .await
        .into_iter()
        .collect();
    let dir = scratch();
    let config = write_config(
        dir.path(),
        &webhook_config(&db, &rx.url, "concurrency = 8")
            .replace("[relay]\n", "[relay]\nbatch_size = 100\n"),
    );
    let mut relay = spawn_relay(dir.path(), &config, "first");
    assert!(wait_for(Duration::from_secs(30), || async { rx.log().len() >= 50 }).await);
    relay.kill().expect("SIGKILL");
    relay.wait().expect("reap");
    let delivered_before_kill = rx.delivered_ids().len();
    assert!(delivered_before_kill < ids.len(), "killed before the end");

    let mut relay = spawn_relay(dir.path(), &config, "second");
    let drained = wait_for(Duration::from_secs(60), || async {
        db.count("published_at IS NULL").await == 0
    })
    .await;
    signal(&relay, libc::SIGTERM);
    relay.wait().expect("reap");
    assert!(drained);
    assert_eq!(
        rx.delivered_ids(),
        ids,
        "every committed event delivered at least once"
    );
    let duplicates = rx.delivered().len() - ids.len();
    assert!(
        duplicates <= 100,
        "duplicates only from the one batch in flight at the kill: {duplicates}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_once_drains_and_reports_by_exit_status() {
    let db = TestDb::migrated().await;
    let rx = Receiver::start().await;
    db.insert_plain(120, "order.created").await;
    let dir = scratch();
    let config = write_config(dir.path(), &webhook_config(&db, &rx.url, ""));
    let config = config.to_str().expect("utf8");

    let (code, _, stderr) = run(&["relay", "--once", "--config", config]);
    assert_eq!(code, 0, "{stderr}");
    assert!(stderr.contains("delivered 120"), "{stderr}");
    assert_eq!(rx.delivered().len(), 120);

    // Nothing due: still a success.
    let (code, _, _) = run(&["relay", "--once", "--config", config]);
    assert_eq!(code, 0);

    // A failing receiver: exit 3, the events stay scheduled.
    rx.set(|_| Reply::status(503));
    db.insert_plain(5, "order.created").await;
    let (code, _, stderr) = run(&["relay", "--once", "--config", config]);
    assert_eq!(code, 3, "{stderr}");
    assert!(stderr.contains("scheduled for retry 5"), "{stderr}");
    assert_eq!(
        db.count("published_at IS NULL AND attempts = 1 AND next_attempt_at > now()")
            .await,
        5
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_releases_the_unfinished_batch_after_the_grace_and_exits_zero() {
    let db = TestDb::migrated().await;
    // 400 events at 200 ms each, 4 at a time: one batch would take 20 s.
    let rx = Receiver::with(|_| Reply::ok().delay(Duration::from_millis(200))).await;
    let ids: HashSet<String> = db
        .insert_plain(400, "order.created")
        .await
        .into_iter()
        .collect();
    let dir = scratch();
    let text = webhook_config(&db, &rx.url, "concurrency = 4")
        .replace("[relay]\n", "[relay]\nshutdown_grace = \"2s\"\n");
    let config = write_config(dir.path(), &text);
    let mut relay = spawn_relay(dir.path(), &config, "term");
    assert!(wait_for(Duration::from_secs(20), || async { !rx.log().is_empty() }).await);
    signal(&relay, libc::SIGTERM);
    // The relay exits by itself; 60 s (three times the whole batch) is only a hang guard.
    let status = exit_status(&mut relay, Duration::from_secs(60)).await;
    let log = std::fs::read_to_string(dir.path().join("relay-term.log")).expect("log");
    let status = status.unwrap_or_else(|| panic!("no exit within 60 s of SIGTERM: {log}"));
    assert!(status.success(), "exit 0 on SIGTERM: {status:?}");
    // The batch was cut short at the grace, not finished: released, and most requests never sent.
    assert!(
        log.contains("shutting down") && log.contains("released an unfinished batch"),
        "{log}"
    );
    assert!(
        rx.count() < 400,
        "the batch was not finished: {} sent",
        rx.count()
    );
    // What was delivered before the grace ran out is settled as published; the rest is released:
    // not locked, not settled, no attempt counted, due. Another run delivers them all.
    let published = db.count("published_at IS NOT NULL").await;
    assert!(published < 400, "{published} published");
    assert_eq!(
        db.count("published_at IS NULL AND attempts = 0 AND next_attempt_at <= now()")
            .await,
        400 - published
    );
    rx.set(|_| Reply::ok());
    let (code, _, err) = run(&[
        "relay",
        "--once",
        "--config",
        config.to_str().expect("utf8"),
    ]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(rx.delivered_ids(), ids, "nothing lost");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_twice_is_a_no_op() {
    let db = TestDb::empty().await;
    let (code, out, err) = run(&["migrate", "--database-url", &db.url]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("migrated public.outbox to schema version"),
        "{out}"
    );
    let (code, out, _) = run(&["migrate", "--database-url", &db.url]);
    assert_eq!(code, 0);
    assert!(out.contains("is up to date"), "{out}");
    let versions: i64 = sqlx::query_scalar("SELECT count(*) FROM pgoutbox_migrations")
        .fetch_one(&db.pool)
        .await
        .expect("count");
    assert_eq!(versions, pgoutbox::schema::CURRENT_VERSION as i64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_migrations_serialize() {
    let db = TestDb::empty().await;
    let runs: Vec<_> = (0..4)
        .map(|_| {
            let url = db.url.clone();
            std::thread::spawn(move || run(&["migrate", "--database-url", &url]).0)
        })
        .collect();
    for r in runs {
        assert_eq!(r.join().expect("thread"), 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_upgrades_a_minimal_outbox_in_place() {
    let db = TestDb::empty().await;
    // The well-known minimal table, with history and a backlog.
    sqlx::raw_sql(&format!(
        "{MINIMAL_OUTBOX};
         INSERT INTO outbox (topic, payload, published_at, created_at)
           SELECT 'order.created', jsonb_build_object('n', g), now() - interval '1 day', now() - interval '2 days'
           FROM generate_series(1, 50) g;
         INSERT INTO outbox (topic, payload, attempts, last_error, created_at)
           SELECT 'order.created', jsonb_build_object('n', g), 2, 'timeout', now() - interval '1 hour' + g * interval '1 second'
           FROM generate_series(1, 30) g;",
    ))
    .execute(&db.pool)
    .await
    .expect("minimal table");
    let pending: HashSet<String> =
        sqlx::query_scalar("SELECT id::text FROM outbox WHERE published_at IS NULL")
            .fetch_all(&db.pool)
            .await
            .expect("ids")
            .into_iter()
            .collect();

    let (code, out, err) = run(&["migrate", "--database-url", &db.url]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("applied 2"), "{out}");
    assert_eq!(db.count("true").await, 80, "no row lost");

    let rx = Receiver::start().await;
    let config = parse_config(&webhook_config(&db, &rx.url, ""));
    Relay::new(db.pool.clone(), &config)
        .expect("relay")
        .run_once()
        .await
        .expect("run");
    assert_eq!(
        rx.delivered_ids(),
        pending,
        "the old backlog is delivered, the history is not"
    );
    assert_eq!(db.count("published_at IS NULL").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_one_clear_error() {
    let dir = scratch();
    let path = |name: &str, text: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).expect("write");
        p.to_str().expect("utf8").to_owned()
    };

    let bad_toml = path("bad.toml", "database_url = \n");
    let (code, _, err) = run(&["relay", "--config", &bad_toml]);
    assert_eq!(code, 1);
    assert!(
        err.contains("bad.toml") && err.contains("invalid TOML"),
        "{err}"
    );

    let unknown = path(
        "unknown.toml",
        "database_url = \"postgres://x@127.0.0.1/db\"\n[[destinations]]\nname = \"a\"\ntype = \"smoke-signals\"\n",
    );
    let (code, _, err) = run(&["relay", "--config", &unknown]);
    assert_eq!(code, 1);
    assert!(
        err.contains("unknown.toml")
            && err.contains("destinations[0].type")
            && err.contains("smoke-signals"),
        "{err}"
    );

    let (code, _, err) = run(&[
        "migrate",
        "--database-url",
        "postgres://x@127.0.0.1/db",
        "--table",
        "x; drop table y",
    ]);
    assert_eq!(code, 1);
    assert!(
        err.contains("invalid --table") && err.contains("invalid SQL identifier"),
        "{err}"
    );

    let bad_schema = path("schema.toml", "schema = \"x; drop table y\"\n");
    let (code, _, err) = run(&["status", "--config", &bad_schema]);
    assert_eq!(code, 1);
    assert!(err.contains("key `schema`"), "{err}");

    // Unreachable database: a clear sentence, the cause, and never the password.
    let (code, _, err) = run(&[
        "migrate",
        "--database-url",
        "postgres://app:hunter2@127.0.0.1:1/app",
    ]);
    assert_eq!(code, 1);
    assert!(
        err.contains("cannot connect to the database at postgres://app:***@127.0.0.1:1/app"),
        "{err}"
    );
    assert!(err.contains("caused by"), "{err}");
    assert!(!err.contains("hunter2"), "{err}");

    let (code, _, err) = run(&["status"]);
    assert_eq!(code, 1);
    assert!(err.contains("no database URL"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unroutable_events_stay_visible_not_looping() {
    let db = TestDb::migrated().await;
    let rx = Receiver::start().await;
    db.insert_plain(3, "order.created").await;
    db.insert_plain(2, "audit.logged").await;
    let config = parse_config(&webhook_config(&db, &rx.url, "topics = [\"order.*\"]"));
    let relay = Arc::new(Relay::new(db.pool.clone(), &config).expect("relay"));
    let report = relay.run_once().await.expect("run");
    assert_eq!((report.delivered, report.dead), (3, 2));
    assert_eq!(
        db.count("topic = 'audit.logged' AND dead_at IS NOT NULL AND last_error LIKE 'no destination takes topic%'")
            .await,
        2
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn custom_schema_and_table() {
    let db = TestDb::empty().await;
    let (code, _, err) = run(&[
        "migrate",
        "--database-url",
        &db.url,
        "--schema",
        "events",
        "--table",
        "app_outbox",
    ]);
    assert_eq!(code, 0, "{err}");
    let table = OutboxTable::parse("events", "app_outbox").expect("valid");
    let mut conn = db.pool.acquire().await.expect("conn");
    Outbox::new(table)
        .enqueue(&mut conn, &Event::new("t", &json!({})).expect("json"))
        .await
        .expect("enqueue");
    let (code, out, err) = run(&[
        "status",
        "--json",
        "--database-url",
        &db.url,
        "--schema",
        "events",
        "--table",
        "app_outbox",
    ]);
    assert_eq!(code, 0, "{err}");
    let status: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(status["totals"]["due"], 1);
}

/// CI runs the tests exactly as the README tells a newcomer to, without fail-fast (one failure
/// must not hide the others).
#[test]
fn ci_runs_the_readme_test_command() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let command_in = |file: &str| -> Vec<String> {
        std::fs::read_to_string(root.join(file))
            .expect(file)
            .lines()
            .map(str::trim)
            .filter(|l| l.starts_with("cargo nextest run --workspace"))
            .map(|l| l.split('#').next().unwrap_or_default().trim().to_owned())
            .collect()
    };
    let readme = command_in("README.md");
    assert_eq!(readme.len(), 1, "one test command in README.md: {readme:?}");
    // .ci/run may run parts of the suite before (against PostgreSQL 18), but ends with it.
    let ci = std::fs::read_to_string(root.join(".ci/run")).expect(".ci/run");
    let last = ci
        .lines()
        .map(str::trim)
        .rfind(|l| !l.is_empty() && !l.starts_with('#'))
        .unwrap_or_default();
    assert_eq!(last, readme[0], ".ci/run ends with the README's command");
    assert!(readme[0].contains("--no-fail-fast"), "{}", readme[0]);
}

/// Claims start at a watermark a little below the oldest pending row (so that a transaction holding
/// back vacuum does not make every claim step over the rows settled since it began). A row that
/// commits later with an older due time — a long producer transaction's, or one written with an
/// old `next_attempt_at` — is below the watermark claims use at the time, and is still delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_committed_below_the_claim_watermark_are_delivered() {
    use pgoutbox::sources::{poll, watermark};
    let db = TestDb::migrated().await;
    let rx = Receiver::start().await;
    let store = pgoutbox::store::Store::new(db.pool.clone(), OutboxTable::default_table());
    let old = "INSERT INTO outbox (topic, payload, next_attempt_at)
               VALUES ('t', '{}', now() - interval '1 hour') RETURNING id::text";
    let first: String = sqlx::query_scalar(old)
        .fetch_one(&db.pool)
        .await
        .expect("insert");
    let options = poll::ClaimOptions {
        mode: pgoutbox::config::ClaimMode::Lease,
        limit: 10,
        lease: Duration::from_secs(30),
        ordered: false,
        heads: 0,
        followers: 0,
        window: 0,
    };
    let read = |from| pgoutbox::store::outbox::watermark(&store, from, watermark::MARGIN);
    let mark = read(None).await.expect("full read");
    assert!(mark < chrono::Utc::now() - chrono::Duration::minutes(59));
    let above = Some(chrono::Utc::now() - chrono::Duration::minutes(1));
    let short = read(above).await.expect("short read");
    assert!(
        Some(short) >= above,
        "a short read only moves the watermark up"
    );
    for (from, found) in [(above, 0), (Some(mark), 1), (None, 1)] {
        let batch = poll::claim_due(&store, &options, &[], from)
            .await
            .expect("claim");
        assert_eq!(batch.events.len(), found, "claim from {from:?}");
        let ids: Vec<_> = batch.events.iter().map(|e| e.id).collect();
        poll::release(&store, batch.guard, &ids)
            .await
            .expect("release");
    }

    let relay = Running::start(&db, &webhook_config(&db, &rx.url, ""));
    let mut long = db.pool.begin().await.expect("begin");
    let late = Outbox::default()
        .enqueue(&mut long, &Event::new("t", &json!({})).expect("json"))
        .await
        .expect("enqueue");
    let mut ids: HashSet<String> = [first, late.to_string()].into();
    // The relay reads new watermarks while other rows come and go.
    for _ in 0..3 {
        ids.extend(db.insert_plain(2, "t").await);
        tokio::time::sleep(watermark::EVERY + watermark::MARGIN).await;
    }
    long.commit().await.expect("commit");
    ids.insert(
        sqlx::query_scalar(old)
            .fetch_one(&db.pool)
            .await
            .expect("insert"),
    );
    let all = wait_for(Duration::from_secs(30), || async {
        rx.delivered_ids().is_superset(&ids)
    })
    .await;
    relay.stop().await;
    assert!(all, "missing: {:?}", ids.difference(&rx.delivered_ids()));
}
