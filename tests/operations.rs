//! Operations: metrics and health endpoints, least privilege.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::*;
use pgoutbox::store::Store;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

/// Parses a Prometheus text scrape into `name{labels}` → value.
async fn scrape(port: u16) -> Option<HashMap<String, f64>> {
    let body = reqwest::get(format!("http://127.0.0.1:{port}/metrics"))
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    Some(
        body.lines()
            .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
            .filter_map(|l| {
                let (k, v) = l.rsplit_once(' ')?;
                Some((k.to_owned(), v.parse().ok()?))
            })
            .collect(),
    )
}

fn sum(m: &HashMap<String, f64>, name: &str) -> f64 {
    m.iter()
        .filter(|(k, _)| k.as_str() == name || k.starts_with(&format!("{name}{{")))
        .map(|(_, v)| v)
        .sum()
}

fn max(m: &HashMap<String, f64>, name: &str) -> f64 {
    m.iter()
        .filter(|(k, _)| k.starts_with(&format!("{name}{{")))
        .map(|(_, v)| *v)
        .fold(0.0, f64::max)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_are_exposed_and_move_with_the_backlog() {
    let db = TestDb::migrated().await;
    // Slow enough that a backlog exists for a few seconds; some failures and one poison event.
    let rx = Receiver::with(|r| {
        if r.json()["type"] == "poison" {
            Reply::status(400)
        } else if r.nth == 0 && r.json()["data"]["n"].as_i64().is_some_and(|n| n % 10 == 0) {
            Reply::status(503)
        } else {
            Reply::ok().delay(Duration::from_millis(5))
        }
    })
    .await;
    db.insert_plain(1, "poison").await;
    db.insert_plain(1500, "order.created").await;
    // Let the backlog age a little so the lag is clearly above zero.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let port = free_port();
    let dir = scratch();
    let text = webhook_config(&db, &rx.url, "concurrency = 4\nretry_schedule = [\"200ms\"]").replace(
        "[relay]\n",
        &format!("[observability]\nlisten = \"127.0.0.1:{port}\"\ngauge_interval = \"100ms\"\n[relay]\nbatch_size = 50\n"),
    );
    let config = write_config(dir.path(), &text);
    let mut relay = spawn_relay(dir.path(), &config, "metrics");

    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let first = loop {
        match scrape(port).await {
            Some(m) if sum(&m, "pgoutbox_pending_due") > 0.0 => break m,
            _ if std::time::Instant::now() > deadline => panic!("no scrape with a backlog"),
            _ => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    };
    assert!(
        max(&first, "pgoutbox_oldest_pending_age_seconds") > 1.0,
        "lag > 0 while a backlog exists"
    );

    let drained = wait_for(Duration::from_secs(60), || async {
        db.count("published_at IS NULL AND dead_at IS NULL").await == 0
    })
    .await;
    assert!(drained);
    // The gauges catch up at their next refresh; 20 s is only a hang guard.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let last = loop {
        match scrape(port).await {
            Some(m)
                if sum(&m, "pgoutbox_pending_due") == 0.0
                    && sum(&m, "pgoutbox_pending_backoff") == 0.0 =>
            {
                break m
            }
            _ if std::time::Instant::now() > deadline => {
                panic!("no scrape with the backlog gone within 20 s of the drain")
            }
            _ => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    };
    let health = reqwest::get(format!("http://127.0.0.1:{port}/healthz"))
        .await
        .expect("healthz");
    assert_eq!(health.status(), 200);
    let ready = reqwest::get(format!("http://127.0.0.1:{port}/readyz"))
        .await
        .expect("readyz");
    assert_eq!(ready.status(), 200);
    signal(&relay, libc::SIGTERM);
    relay.wait().expect("wait");

    // A destination's series appear once it has something to report (docs/operations.md): this
    // healthy one never reconnected, held, waited for tokens, replayed, paused or opened.
    let on_report = [
        "pgoutbox_sink_reconnects_total",
        "pgoutbox_events_held_total",
        "pgoutbox_destination_state",
        "pgoutbox_destination_paused",
        "pgoutbox_rate_limit_waits_total",
        "pgoutbox_replayed_total",
    ];
    for (name, kind, _, _) in pgoutbox::model::metric::METRICS {
        let present = last.keys().any(|k| {
            k == name
                || k.starts_with(&format!("{name}{{"))
                || (*kind == "histogram" && k.starts_with(&format!("{name}_count")))
        });
        if on_report.contains(name) {
            assert!(!present, "{name} of a destination with nothing to report");
        } else {
            assert!(present, "metric {name} missing from the scrape");
        }
    }
    assert!(
        sum(&first, "pgoutbox_pending_due") > sum(&last, "pgoutbox_pending_due"),
        "pending falls"
    );
    assert_eq!(sum(&last, "pgoutbox_pending_due"), 0.0);
    assert!(
        sum(&last, "pgoutbox_events_published_total") >= 1500.0,
        "published_total rises"
    );
    assert!(
        sum(&last, "pgoutbox_events_published_total")
            > sum(&first, "pgoutbox_events_published_total")
    );
    assert!(
        sum(&last, "pgoutbox_events_failed_total") >= 100.0,
        "failures counted"
    );
    assert_eq!(sum(&last, "pgoutbox_events_dead_lettered_total"), 1.0);
    assert_eq!(sum(&last, "pgoutbox_dead"), 1.0);
    assert_eq!(
        max(&last, "pgoutbox_oldest_pending_age_seconds"),
        0.0,
        "no lag once nothing is pending (the dead event does not count)"
    );
}

/// A database whose session defaults would end every claim: the relay brings its own timeouts.
/// In transaction mode a claim is idle in its transaction while the destination answers (1 s per
/// request here); a server default of 200 ms would end that session before the settle, the batch
/// would go back and be sent again, forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_works_under_hostile_session_defaults() {
    let db = TestDb::migrated().await;
    let ids: std::collections::HashSet<String> = db
        .insert_plain(10, "order.created")
        .await
        .into_iter()
        .collect();
    sqlx::raw_sql(&format!(
        "ALTER DATABASE {name} SET idle_in_transaction_session_timeout = '200ms';
         ALTER DATABASE {name} SET statement_timeout = '1ms';",
        name = db.name
    ))
    .execute(&db.pool)
    .await
    .expect("hostile defaults");
    // The test's own sessions opt out of the defaults it just set.
    let probe = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect_with(
            db.url
                .parse::<sqlx::postgres::PgConnectOptions>()
                .expect("url")
                .options([
                    ("statement_timeout", "0"),
                    ("idle_in_transaction_session_timeout", "0"),
                ]),
        )
        .await
        .expect("probe pool");

    let rx = Receiver::with(|_| Reply::ok().delay(Duration::from_secs(1))).await;
    let dir = scratch();
    let text = webhook_config(&db, &rx.url, "concurrency = 2\ntimeout = \"10s\"").replace(
        "[relay]\n",
        "[relay]\nclaim = \"transaction\"\nbatch_size = 5\nworkers = 1\npublish_timeout = \"20s\"\n",
    );
    let config = write_config(dir.path(), &text);
    let mut relay = spawn_relay(dir.path(), &config, "hostile");
    // Hang guard: two batches of 5 at 2 a time take about 6 s; a relay whose claims are cut never
    // gets there.
    let delivered = wait_for(Duration::from_secs(60), || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM outbox WHERE published_at IS NULL")
            .fetch_one(&probe)
            .await
            .expect("count")
            == 0
    })
    .await;
    signal(&relay, libc::SIGTERM);
    let status = exit_status(&mut relay, Duration::from_secs(60)).await;
    let log = std::fs::read_to_string(dir.path().join("relay-hostile.log")).expect("log");
    assert!(
        delivered,
        "every event settled under hostile defaults: {log}"
    );
    assert_eq!(rx.delivered_ids(), ids);
    assert_eq!(
        rx.count(),
        10,
        "each event sent once: no claim was cut and sent again"
    );
    assert!(!log.contains("claim or settle failed"), "{log}");
    assert!(status.is_some_and(|s| s.success()), "{status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_runs_under_a_least_privilege_role() {
    let db = TestDb::migrated().await;
    let role = relay_role(&db, "pgoutbox_relay").await;

    let rx = Receiver::start().await;
    db.insert_plain(25, "order.created").await;
    let dir = scratch();
    let relay_url = db.url.replacen("postgres@", &format!("{role}@"), 1);
    let text = webhook_config(&db, &rx.url, "").replace(&db.url, &relay_url);
    let config = write_config(dir.path(), &text);
    let config = config.to_str().expect("utf8");
    let (code, _, err) = run(&["relay", "--once", "--config", config]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(rx.delivered_ids().len(), 25);
    // The relay role cannot write events, only relay them.
    let insert = std::process::Command::new("psql")
        .args([
            &relay_url,
            "-c",
            "INSERT INTO outbox (topic, payload) VALUES ('x', '{}')",
        ])
        .output();
    if let Ok(out) = insert {
        assert!(!out.status.success(), "the relay role must not insert");
    }

    // Fan-out under the same role: a second destination that refuses connections gets its pairs
    // recorded (deliveries rows, then, once its breaker opens, held batches).
    db.insert_plain(25, "order.created").await;
    let down = format!(
        "\n[[destinations]]\nname = \"down\"\ntype = \"webhook\"\nurl = \"http://127.0.0.1:{}/events\"\n",
        closed_port()
    );
    let fan_out = write_config(dir.path(), &format!("{text}{down}"));
    let (code, _, err) = run(&[
        "relay",
        "--once",
        "--config",
        fan_out.to_str().expect("utf8"),
    ]);
    assert_eq!(code, 3, "some events not delivered to `down`: {err}");
    assert!(!err.contains("permission denied"), "{err}");
    assert_eq!(rx.delivered_ids().len(), 50);
    let waiting: i64 = sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM outbox_deliveries)
              + (SELECT coalesce(sum(count), 0) FROM outbox_held_batches)::bigint",
    )
    .fetch_one(&db.pool)
    .await
    .expect("pairs");
    assert_eq!(waiting, 25, "down's 25 pairs are recorded");

    // A rate-limited destination under the same role: it takes tokens from its shared bucket.
    db.insert_plain(5, "order.created").await;
    let limited = write_config(
        dir.path(),
        &text.replace(
            "type = \"webhook\"",
            "type = \"webhook\"\nrate_limit = \"1000/s\"",
        ),
    );
    assert!(std::fs::read_to_string(&limited)
        .expect("config")
        .contains("rate_limit"));
    let (code, _, err) = run(&[
        "relay",
        "--once",
        "--config",
        limited.to_str().expect("utf8"),
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(!err.contains("permission denied"), "{err}");
    assert_eq!(rx.delivered_ids().len(), 55);

    // The console in the relay's process: its shared chart samples and the audit log of an
    // operator's change, written under the same role.
    let as_relay = Store::new(
        sqlx::PgPool::connect(&relay_url).await.expect("relay pool"),
        pgoutbox::table::OutboxTable::default_table(),
    );
    let sample = pgoutbox::store::operators::NewSample {
        relay: "test:1",
        at: chrono::Utc::now(),
        lag_seconds: 0.0,
        pending: 0,
        delivered: serde_json::json!({}),
    };
    pgoutbox::store::operators::write_sample(&as_relay, &sample, Duration::from_secs(3600))
        .await
        .expect("the relay role stores the chart's samples");
    assert_eq!(
        pgoutbox::store::operators::samples(&as_relay, Duration::from_secs(3600))
            .await
            .expect("the relay role reads them")
            .len(),
        1
    );
    let change = pgoutbox::store::operators::Change {
        who: "alice",
        via: "console",
        action: "pause",
        filter: serde_json::json!({"destination": "hooks"}),
        matched: 1,
    };
    pgoutbox::store::operators::record(&as_relay, &change)
        .await
        .expect("the relay role records an operator's change");
    assert_eq!(
        pgoutbox::store::operators::audit(&as_relay, 10, None)
            .await
            .expect("the relay role reads the audit log")
            .len(),
        1
    );
    as_relay.pool().close().await;

    sqlx::raw_sql(&format!("REVOKE UPDATE ON outbox FROM {role}"))
        .execute(&db.pool)
        .await
        .expect("revoke");
    let (code, _, err) = run(&["relay", "--once", "--config", config]);
    assert_eq!(code, 1);
    assert!(
        err.contains(&format!("role {role} lacks UPDATE on public.outbox"))
            && err.contains("--grant-relay"),
        "{err}"
    );

    drop_role(db, &role).await;
}

#[test]
fn alert_rules_pass_promtool() {
    let Ok(out) = std::process::Command::new("promtool")
        .args(["check", "rules", "deploy/alerts.yml"])
        .output()
    else {
        println!("promtool not installed (Debian package prometheus): skipped");
        return;
    };
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

#[test]
fn the_dashboard_uses_only_documented_metrics() {
    let dashboard = std::fs::read_to_string("deploy/grafana-dashboard.json").expect("dashboard");
    let json: serde_json::Value = serde_json::from_str(&dashboard).expect("valid JSON");
    assert!(json["panels"].as_array().is_some_and(|p| p.len() >= 8));
    let names: Vec<&str> = pgoutbox::model::metric::METRICS
        .iter()
        .map(|m| m.0)
        .collect();
    for word in dashboard.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
        if let Some(base) = word.strip_prefix("pgoutbox_") {
            let base = format!("pgoutbox_{base}");
            let base = base.trim_end_matches("_bucket");
            assert!(
                names.contains(&base),
                "dashboard uses undocumented metric {word}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_traceparent_set_at_enqueue_reaches_the_webhook_receiver() {
    use opentelemetry::trace::{
        SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState,
    };

    let db = TestDb::migrated().await;
    let rx = Receiver::start().await;
    let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let sc = SpanContext::new(
        TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").expect("hex"),
        SpanId::from_hex("00f067aa0ba902b7").expect("hex"),
        TraceFlags::SAMPLED,
        true,
        TraceState::default(),
    );
    let (traced, untraced) = {
        let _guard = opentelemetry::Context::current()
            .with_remote_span_context(sc)
            .attach();
        let traced =
            pgoutbox::Event::new("order.created", &serde_json::json!({"n": 1})).expect("json");
        let untraced = pgoutbox::Event::new("order.created", &serde_json::json!({"n": 2}))
            .expect("json")
            .without_trace_context();
        (traced, untraced)
    };
    let outbox = pgoutbox::Outbox::default();
    let mut tx = db.pool.begin().await.expect("begin");
    let traced_id = outbox.enqueue(&mut tx, &traced).await.expect("enqueue");
    outbox.enqueue(&mut tx, &untraced).await.expect("enqueue");
    tx.commit().await.expect("commit");

    let config = parse_config(&webhook_config(&db, &rx.url, ""));
    pgoutbox::engine::Relay::new(db.pool.clone(), &config)
        .expect("relay")
        .run_once()
        .await
        .expect("run");
    let log = rx.delivered();
    let got = log
        .iter()
        .find(|r| r.id == traced_id.to_string())
        .expect("delivered");
    assert_eq!(
        got.headers.get("traceparent").map(String::as_str),
        Some(traceparent),
        "unchanged"
    );
    let other = log
        .iter()
        .find(|r| r.id != traced_id.to_string())
        .expect("delivered");
    assert!(!other.headers.contains_key("traceparent"), "opted out");
}

/// Published rows past a 1 h retention, and a transaction holding one of them: a cleanup that
/// reaches it waits there, mid-run, holding the leader's lock.
async fn cleanup_blocked_mid_run(db: &TestDb) -> sqlx::Transaction<'static, sqlx::Postgres> {
    sqlx::query(
        "INSERT INTO outbox (topic, payload, created_at, published_at)
         SELECT 'old', '{}', now() - interval '2 days', now() - interval '2 days'
         FROM generate_series(1, 50)",
    )
    .execute(&db.pool)
    .await
    .expect("expired rows");
    let mut blocker = db.pool.begin().await.expect("begin");
    sqlx::query("SELECT 1 FROM outbox ORDER BY seq DESC LIMIT 1 FOR UPDATE")
        .execute(&mut *blocker)
        .await
        .expect("row lock");
    blocker
}

/// Waits until some DELETE of the outbox waits on a lock.
async fn a_cleanup_waits(db: &TestDb) -> bool {
    wait_for(Duration::from_secs(10), || async {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%DELETE FROM%'",
        )
        .fetch_one(&db.pool)
        .await
        .expect("activity");
        waiting > 0
    })
    .await
}

/// The cleanup settings of the leader tests: an hour of retention, small chunks.
fn hour_retention_in_chunks_of_five() -> pgoutbox::store::cleanup::CleanupOptions {
    pgoutbox::store::cleanup::CleanupOptions {
        attempts_retention: Duration::from_secs(7 * 86_400),
        retention: Duration::from_secs(3600),
        dead_retention: None,
        chunk_rows: 5,
        dry_run: false,
    }
}

/// A second relay's cleanup takes over once the first one's has ended, however it ended.
async fn another_leader_takes_over(db: &TestDb) {
    let pool = sqlx::PgPool::connect(&db.url).await.expect("second relay");
    let table = pgoutbox::OutboxTable::default_table();
    let options = hour_retention_in_chunks_of_five();
    let mut report = None;
    for _ in 0..100 {
        report = pgoutbox::store::cleanup::run_if_leader(
            &Store::new(pool.clone(), table.clone()),
            &options,
        )
        .await
        .expect("cleanup");
        if report.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        report.is_some(),
        "the second relay became the cleanup leader"
    );
    assert_eq!(
        db.count("published_at IS NOT NULL").await,
        0,
        "and cleaned up"
    );
    pool.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cleanup_lock_ends_with_a_dropped_or_failed_cleanup() {
    let db = TestDb::migrated().await;
    let table = pgoutbox::OutboxTable::default_table();
    let options = hour_retention_in_chunks_of_five();

    // Dropped mid-run, as the relay aborts its cleanup task at shutdown. The first relay's pool
    // stays open: a connection returned to it would keep the lock.
    let blocker = cleanup_blocked_mid_run(&db).await;
    let first = sqlx::PgPool::connect(&db.url).await.expect("first relay");
    let task = {
        let (first, table, options) = (first.clone(), table.clone(), options.clone());
        tokio::spawn(async move {
            pgoutbox::store::cleanup::run_if_leader(&Store::new(first, table), &options).await
        })
    };
    assert!(a_cleanup_waits(&db).await, "the first cleanup is mid-run");
    task.abort();
    let _ = task.await;
    blocker.rollback().await.expect("rollback");
    another_leader_takes_over(&db).await;

    // Failed mid-run: its statements time out.
    let blocker = cleanup_blocked_mid_run(&db).await;
    let options_timeout: sqlx::postgres::PgConnectOptions = db.url.parse().expect("url");
    let failing = sqlx::postgres::PgPoolOptions::new()
        .connect_with(options_timeout.options([("statement_timeout", "300")]))
        .await
        .expect("failing relay");
    let failed = pgoutbox::store::cleanup::run_if_leader(
        &Store::new(failing.clone(), table.clone()),
        &options,
    )
    .await;
    assert!(failed.is_err(), "{failed:?}");
    blocker.rollback().await.expect("rollback");
    another_leader_takes_over(&db).await;
    first.close().await;
    failing.close().await;
}

/// Every `sslmode` of the database URL connects or is refused with a sentence and exit 1, never
/// a panic: the binary chooses its TLS crypto provider before its first connection (verify-ca and
/// verify-full build a certificate verifier at once; without a provider chosen that panicked with
/// exit 101).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_sslmode_connects_or_is_refused_in_a_sentence() {
    let db = TestDb::migrated().await;
    let ssl_on = sqlx::query_scalar::<_, String>("SHOW ssl")
        .fetch_one(&db.pool)
        .await
        .expect("show ssl")
        == "on";
    for mode in ["disable", "prefer", "require", "verify-ca", "verify-full"] {
        let url = format!("{}?sslmode={mode}", db.url);
        let (code, _, err) = run(&["status", "--database-url", &url]);
        assert!(!err.contains("panicked"), "{mode}: {err}");
        match mode {
            "disable" | "prefer" => assert_eq!(code, 0, "{mode}: {err}"),
            "require" if ssl_on => assert_eq!(code, 0, "{mode}: {err}"),
            _ => {
                // This server's certificate is self-signed: no trusted root vouches for it.
                assert_eq!(code, 1, "{mode}: {err}");
                assert!(
                    err.starts_with("error: cannot connect to the database"),
                    "{mode}: {err}"
                );
            }
        }
    }
}

/// A relay whose destinations are healthy but that cannot claim (another session holds its rows
/// locked: a forgotten transaction) is not ready once events have waited `relay.stall_after`,
/// says why, and is ready again once the lock is gone and the events move.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_sees_a_stall_and_its_end() {
    let db = TestDb::migrated().await;
    let rx = Receiver::start().await;
    let text =
        webhook_config(&db, &rx.url, "").replace("[relay]\n", "[relay]\nstall_after = \"1s\"\n");
    let relay = std::sync::Arc::new(
        pgoutbox::engine::Relay::new(db.pool.clone(), &parse_config(&text)).expect("relay"),
    );
    let ids = db.insert_plain(5, "order.created").await;
    // Another session locks the due rows before the relay starts.
    let mut locker = db.pool.begin().await.expect("begin");
    let locked: Vec<(uuid::Uuid,)> =
        sqlx::query_as("SELECT id FROM outbox WHERE published_at IS NULL FOR UPDATE")
            .fetch_all(&mut *locker)
            .await
            .expect("lock");
    assert_eq!(locked.len(), 5);
    let stop = tokio_util::sync::CancellationToken::new();
    let running = tokio::spawn(relay.clone().run(stop.clone()));

    assert_stalls(&relay, Duration::from_secs(20)).await;
    assert_eq!(rx.count(), 0, "nothing could be sent");

    locker.rollback().await.expect("release the rows");
    let delivered = wait_for(Duration::from_secs(20), || async {
        ids.iter().all(|id| rx.delivered_ids().contains(id))
    })
    .await;
    assert!(delivered, "the events move once the lock is gone");
    let ready = wait_for(Duration::from_secs(20), || async {
        relay.readiness().await.is_ok()
    })
    .await;
    assert!(ready, "ready again: {:?}", relay.readiness().await);
    stop.cancel();
    let _ = running.await;
}

/// The names of `pid`'s threads.
#[cfg(target_os = "linux")]
fn thread_names(pid: u32) -> Vec<String> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|name| name.trim().to_owned())
        .collect()
}

/// The allocator gives freed pages back to the system from a thread of its own: a relay that
/// read ten thousand destinations at start does not keep that read's memory while it idles.
#[cfg(target_os = "linux")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_gives_memory_it_freed_back_to_the_system() {
    let db = TestDb::migrated().await;
    let rx = Receiver::start().await;
    let dir = scratch();
    let config = write_config(dir.path(), &webhook_config(&db, &rx.url, ""));
    let mut relay = spawn_relay(dir.path(), &config, "allocator");
    let pid = relay.id();
    // Hang guard: the allocator starts its thread with the process.
    let found = wait_for(Duration::from_secs(20), || async {
        thread_names(pid).iter().any(|n| n == "jemalloc_bg_thd")
    })
    .await;
    let names = thread_names(pid);
    let _ = relay.kill();
    let _ = relay.wait();
    assert!(found, "no allocator background thread among {names:?}");
}

/// An HTTP endpoint that answers every request 200 after `delay`, one request per connection;
/// its URL and the most connections it held at once.
async fn slow_endpoint(
    delay: Duration,
) -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}/events", listener.local_addr().expect("addr"));
    let (now, most) = (
        std::sync::Arc::new(AtomicUsize::new(0)),
        std::sync::Arc::new(AtomicUsize::new(0)),
    );
    let seen = std::sync::Arc::clone(&most);
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let (now, most) = (std::sync::Arc::clone(&now), std::sync::Arc::clone(&most));
            tokio::spawn(async move {
                most.fetch_max(now.fetch_add(1, SeqCst) + 1, SeqCst);
                let mut request = [0u8; 4096];
                let _ = socket.read(&mut request).await;
                tokio::time::sleep(delay).await;
                let _ = socket
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                    .await;
                now.fetch_sub(1, SeqCst);
            });
        }
    });
    (url, seen)
}

/// Readiness checks its destinations side by side, in their order: one after the other, a file
/// of 10,000 webhook destinations took seconds to answer, longer than a probe waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_checks_the_destinations_side_by_side() {
    let db = TestDb::migrated().await;
    let (url, most) = slow_endpoint(Duration::from_millis(300)).await;
    let mut text = format!("database_url = \"{}\"\n", db.url);
    for i in 0..8 {
        text.push_str(&format!(
            "[[destinations]]\nname = \"d{i}\"\ntype = \"webhook\"\nurl = \"{url}\"\ntopics = [\"t.{i}\"]\n"
        ));
    }
    let relay = pgoutbox::engine::Relay::new(db.pool.clone(), &parse_config(&text)).expect("relay");
    let lines = relay.readiness().await.expect("ready");
    let named: Vec<&str> = lines
        .iter()
        .filter_map(|l| l.strip_prefix("destination "))
        .filter_map(|l| l.split(':').next())
        .collect();
    let expected: Vec<String> = (0..8).map(|i| format!("d{i}")).collect();
    assert_eq!(named, expected, "every destination, in order: {lines:?}");
    let most = most.load(std::sync::atomic::Ordering::SeqCst);
    assert!(
        most > 1,
        "the health checks went one after the other ({most} at once)"
    );
}
