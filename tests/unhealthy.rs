//! Unhealthy destinations and hostile rows: slow receivers, outages, rejected credentials, rows the
//! relay cannot read, operator pauses. Each test observes behaviour (what was delivered, how often,
//! what is dead); the times it prints are for the record, never asserted.

mod common;

use std::time::{Duration, Instant};

use common::*;

/// The slow receiver: 1 s per request, concurrency 10, batches of 200, a 5 s
/// publish_timeout. Every event must be published, none dead, and the receiver must not get the
/// events the relay already had an answer for again: at most 5 % more requests than events.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_receiver_gets_each_event_about_once() {
    let db = TestDb::migrated().await;
    let rx = Receiver::with(|_| Reply::ok().delay(Duration::from_secs(1))).await;
    db.insert_plain(200, "order.created").await;
    let config = webhook_config(&db, &rx.url, "concurrency = 10").replace(
        "[relay]\n",
        "[relay]\nbatch_size = 200\npublish_timeout = \"5s\"\n",
    );
    let started = Instant::now();
    let relay = Running::start(&db, &config);
    let done = wait_for(Duration::from_secs(120), || async {
        db.count("published_at IS NOT NULL").await == 200
    })
    .await;
    let report = relay.stop().await;
    let requests = rx.count();
    println!(
        "slow receiver: 200 events, {requests} requests ({:.3} per event), {} dead, all published in {:.1} s; {report:?}",
        requests as f64 / 200.0,
        db.count("dead_at IS NOT NULL").await,
        started.elapsed().as_secs_f64()
    );
    assert!(done, "all 200 events published");
    assert_eq!(db.count("dead_at IS NOT NULL").await, 0, "none dead");
    assert_eq!(rx.delivered_ids().len(), 200);
    assert!(
        requests <= 210,
        "receiver got {requests} requests for 200 events (at most 1.05 × allowed)"
    );
}

/// Runs the outage scenario: 50 events, a destination that fails (`down`) for 25 s with
/// `max_attempts = 3` and `retry_schedule = ["1s"]`, then recovers. Nothing may die.
async fn outage(down: Option<u16>) {
    let db = TestDb::migrated().await;
    let port = closed_port();
    let addr = format!("127.0.0.1:{port}");
    // Refused connections, or a receiver answering `down` (e.g. 401) until it recovers.
    let failing = match down {
        Some(status) => Some(Receiver::on(&addr, move |_| Reply::status(status)).await),
        None => None,
    };
    db.insert_plain(50, "order.created").await;
    let config = webhook_config(
        &db,
        &format!("http://{addr}/events"),
        "max_attempts = 3\nretry_schedule = [\"1s\"]",
    );
    let relay = Running::start(&db, &config);
    tokio::time::sleep(Duration::from_secs(25)).await;
    let dead_during = db.count("dead_at IS NOT NULL").await;
    let held_during = db.count("next_attempt_at = 'infinity'").await;
    let rx = match failing {
        Some(rx) => {
            rx.set(|_| Reply::ok());
            rx
        }
        None => Receiver::on(&addr, |_| Reply::ok()).await,
    };
    let back = Instant::now();
    let done = wait_for(Duration::from_secs(90), || async {
        db.count("published_at IS NOT NULL").await == 50
    })
    .await;
    let recovered_in = back.elapsed();
    relay.stop().await;
    let max_attempts: i32 = sqlx::query_scalar("SELECT max(attempts) FROM outbox")
        .fetch_one(&db.pool)
        .await
        .expect("attempts");
    println!(
        "outage ({}): during it {dead_during} dead and {held_during} held; after it all 50 published in {:.1} s, most attempts on one event {max_attempts}, requests {}",
        down.map_or("connection refused".to_owned(), |s| format!("HTTP {s}")),
        recovered_in.as_secs_f64(),
        rx.count()
    );
    assert_eq!(dead_during, 0, "nothing dead while the destination is down");
    assert!(done, "every event delivered once the destination is back");
    assert_eq!(db.count("dead_at IS NOT NULL").await, 0, "none dead");
    assert_eq!(rx.delivered_ids().len(), 50);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_down_for_25_s_loses_nothing_to_the_dead_letters() {
    outage(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_401_for_25_s_is_retried_not_dead_lettered() {
    outage(Some(401)).await;
}

/// The breaker's state is shared through the database: `status --json` and `/readyz` show it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_breaker_shows_in_status_and_readyz() {
    let db = TestDb::migrated().await;
    let rx = Receiver::with(|_| Reply::status(503).body("down for maintenance")).await;
    db.insert_plain(20, "order.created").await;
    let listen = format!("127.0.0.1:{}", closed_port());
    let config = webhook_config(&db, &rx.url, "breaker = { failures = 5 }").replace(
        "[relay]\n",
        &format!("[observability]\nlisten = \"{listen}\"\n[relay]\n"),
    );
    let dir = scratch();
    let path = write_config(dir.path(), &config);
    let mut relay = spawn_relay(dir.path(), &path, "breaker");
    let held = wait_for(Duration::from_secs(30), || async {
        db.count("next_attempt_at = 'infinity'").await == 15
    })
    .await;
    let readyz = reqwest::get(format!("http://{listen}/readyz"))
        .await
        .expect("readyz");
    let (code, body) = (readyz.status().as_u16(), readyz.text().await.expect("body"));
    let (status_code, json, _) = run(&[
        "status",
        "--json",
        "--config",
        path.to_str().expect("utf-8"),
    ]);
    signal(&relay, libc::SIGTERM);
    let _ = relay.wait();
    assert!(held, "5 attempts counted, the other 15 events held");
    assert_eq!(db.count("attempts = 1").await, 5);
    assert_eq!(db.count("dead_at IS NOT NULL").await, 0);
    assert_eq!(code, 503, "{body}");
    assert!(
        body.contains("destination hooks: not ready: circuit breaker")
            && body.contains("down for maintenance"),
        "{body}"
    );
    assert_eq!(status_code, 0);
    let status: serde_json::Value = serde_json::from_str(&json).expect("status json");
    let hooks = &status["destinations"][0];
    assert_eq!(hooks["name"], "hooks", "{json}");
    assert!(
        matches!(hooks["breaker"].as_str(), Some("open" | "half_open")),
        "{json}"
    );
    assert_eq!(status["totals"]["held"], 15, "{json}");
}

/// `destination pause` holds a destination's events in every relay; `resume` lets them go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_holds_events_and_resume_delivers_them() {
    let db = TestDb::migrated().await;
    let rx = Receiver::start().await;
    let config = webhook_config(&db, &rx.url, "");
    let dir = scratch();
    let path = write_config(dir.path(), &config);
    let path = path.to_str().expect("utf-8");
    let (code, _, err) = run(&["destination", "pause", "hooks", "--config", path]);
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = run(&["destination", "pause", "nope", "--config", path]);
    assert_ne!(code, 0);
    assert!(err.contains("no destination named \"nope\""), "{err}");

    let relay = Running::start(&db, &config);
    db.insert_plain(30, "order.created").await;
    let held = wait_for(Duration::from_secs(30), || async {
        db.count("next_attempt_at = 'infinity' AND attempts = 0")
            .await
            == 30
    })
    .await;
    let sent_while_paused = rx.count();
    let (_, listed, _) = run(&["destination", "list", "--config", path]);
    let (code, _, err) = run(&["destination", "resume", "hooks", "--config", path]);
    assert_eq!(code, 0, "{err}");
    let delivered = wait_for(Duration::from_secs(30), || async {
        db.count("published_at IS NOT NULL").await == 30
    })
    .await;
    relay.stop().await;
    assert!(held, "paused: every event held, no attempt counted");
    assert_eq!(sent_while_paused, 0);
    assert!(
        listed.contains("hooks") && listed.contains("paused"),
        "{listed}"
    );
    assert!(err.contains("30 held events are due again"), "{err}");
    assert!(delivered, "resumed: all delivered");
}

/// Rows the relay cannot read or a destination cannot take are dead-lettered alone: a NULL
/// created_at in an upgraded minimal table, headers that are not an object, a payload the
/// receiver refuses as too large (413). Every other row goes out, with `relay --once` and with
/// the long-running relay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_rows_are_dead_lettered_and_the_rest_flows() {
    let rx = Receiver::with(|r| {
        if r.body.len() > 4096 {
            Reply::status(413).body("payload too large")
        } else {
            Reply::ok()
        }
    })
    .await;
    for once in [true, false] {
        let db = TestDb::empty().await;
        sqlx::raw_sql(
            "CREATE TABLE outbox (
                id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
                created_at timestamptz DEFAULT now(),
                published_at timestamptz,
                topic text NOT NULL,
                payload jsonb NOT NULL,
                attempts int NOT NULL DEFAULT 0,
                last_error text);
             INSERT INTO outbox (topic, payload, created_at) VALUES ('order.created', '{\"n\": 0}', NULL);
             INSERT INTO outbox (topic, payload) SELECT 'order.created', jsonb_build_object('n', g) FROM generate_series(1, 20) g;",
        )
        .execute(&db.pool)
        .await
        .expect("minimal table");
        let dir = scratch();
        let config = webhook_config(&db, &rx.url, "");
        let path = write_config(dir.path(), &config);
        let path = path.to_str().expect("utf-8");
        let (code, _, err) = run(&["migrate", "--config", path]);
        assert_eq!(code, 0, "{err}");
        sqlx::raw_sql(
            "INSERT INTO outbox (topic, payload, headers) VALUES ('order.created', '{\"n\": 21}', '[1, 2]');
             INSERT INTO outbox (topic, payload) VALUES ('order.created', jsonb_build_object('big', repeat('x', 10000)));
             INSERT INTO outbox (topic, payload) SELECT 'order.created', jsonb_build_object('n', g) FROM generate_series(22, 40) g;",
        )
        .execute(&db.pool)
        .await
        .expect("hostile rows");
        if once {
            let (code, _, err) = run(&["relay", "--once", "--config", path]);
            assert_eq!(code, 3, "some dead-lettered: exit 3\n{err}");
        } else {
            let relay = Running::start(&db, &config);
            assert!(
                wait_for(Duration::from_secs(30), || async {
                    db.count("published_at IS NOT NULL").await == 39
                })
                .await
            );
            relay.stop().await;
        }
        assert_eq!(
            db.count("published_at IS NOT NULL").await,
            39,
            "once = {once}"
        );
        assert_eq!(db.count("dead_at IS NOT NULL").await, 3, "once = {once}");
        let reasons: Vec<String> = sqlx::query_scalar(
            "SELECT last_error FROM outbox WHERE dead_at IS NOT NULL ORDER BY seq",
        )
        .fetch_all(&db.pool)
        .await
        .expect("reasons");
        assert!(reasons[0].contains("created_at"), "{reasons:?}");
        assert!(
            reasons[1].contains("headers must be a JSON object"),
            "{reasons:?}"
        );
        assert!(reasons[2].contains("413"), "{reasons:?}");
    }
}

/// Ordered chains stop at the batch's deadline: in lease mode with a slow destination and two
/// relays, a key's chain never outlives its lease, so no second relay starts the same key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ordered_chains_end_within_publish_timeout_under_a_lease() {
    let db = TestDb::migrated().await;
    let rx = Receiver::with(|_| Reply::ok().delay(Duration::from_millis(400))).await;
    sqlx::query(
        "INSERT INTO outbox (topic, payload, key)
         SELECT 'order.created', jsonb_build_object('n', g), 'k' || (g % 2) FROM generate_series(1, 30) g",
    )
    .execute(&db.pool)
    .await
    .expect("insert");
    let config = webhook_config(&db, &rx.url, "ordering = \"key\"").replace(
        "[relay]\n",
        "[relay]\nclaim = \"lease\"\npublish_timeout = \"2s\"\nlease = \"3s\"\n",
    );
    let a = Running::start(&db, &config);
    let b = Running::start(&db, &config);
    let done = wait_for(Duration::from_secs(60), || async {
        db.count("published_at IS NOT NULL").await == 30
    })
    .await;
    a.stop().await;
    b.stop().await;
    assert!(done);
    let log = rx.log();
    assert_eq!(
        log.len(),
        30,
        "each event sent once: no lease expired mid-chain"
    );
    // Per key, the receiver saw the events in insert order.
    for key in ["k0", "k1"] {
        let ns: Vec<i64> = log
            .iter()
            .map(|r| r.json())
            .filter(|j| j["key"] == key)
            .map(|j| j["data"]["n"].as_i64().expect("n"))
            .collect();
        assert!(ns.windows(2).all(|w| w[0] < w[1]), "{key}: {ns:?}");
    }
}

/// `on_dead` is per destination: a destination with `on_dead = "skip"` lets a key go on past its
/// dead event even when another ordered destination blocks on its own dead events.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_dead_skip_holds_even_beside_a_blocking_destination() {
    let db = TestDb::migrated().await;
    // The first `skip.*` event of key k is refused for good; everything else is accepted.
    let rx = Receiver::with(|r| {
        let j = r.json();
        if j["type"] == "skip.first" {
            Reply::status(400).body("bad event")
        } else {
            Reply::ok()
        }
    })
    .await;
    sqlx::raw_sql(
        "INSERT INTO outbox (topic, payload, key) VALUES
           ('skip.first', '{}', 'k'), ('skip.second', '{}', 'k'),
           ('block.first', '{}', 'b'), ('block.second', '{}', 'b');",
    )
    .execute(&db.pool)
    .await
    .expect("insert");
    let config = format!(
        "database_url = \"{}\"\n[relay]\npoll_interval = \"50ms\"\n
[[destinations]]\nname = \"skipper\"\ntype = \"webhook\"\nurl = \"{url}\"\ntopics = [\"skip.*\"]\nordering = \"key\"\non_dead = \"skip\"\n
[[destinations]]\nname = \"blocker\"\ntype = \"webhook\"\nurl = \"{url}\"\ntopics = [\"block.*\"]\nordering = \"key\"\non_dead = \"block\"\n",
        db.url,
        url = rx.url
    );
    let relay = Running::start(&db, &config);
    let done = wait_for(Duration::from_secs(20), || async {
        db.count("published_at IS NOT NULL").await == 3
    })
    .await;
    relay.stop().await;
    assert!(
        done,
        "the skip destination's later event went on past its dead one"
    );
    assert_eq!(
        db.count("dead_at IS NOT NULL AND topic = 'skip.first'")
            .await,
        1
    );
}

/// Rows waiting at 'infinity' whose reason is gone (here: none left) are made due again by
/// `pgoutbox cleanup` and by `relay --once`, not only by the long-running relay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cleanup_and_relay_once_release_rows_whose_wait_is_over() {
    let db = TestDb::migrated().await;
    let rx = Receiver::start().await;
    db.insert_plain(2, "order.created").await;
    let park = "UPDATE outbox SET next_attempt_at = 'infinity' WHERE published_at IS NULL";
    sqlx::query(park).execute(&db.pool).await.expect("park");
    let dir = scratch();
    let path = write_config(dir.path(), &webhook_config(&db, &rx.url, ""));
    let path = path.to_str().expect("utf-8");

    let (code, out, err) = run(&["cleanup", "--config", path]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("2 rows no longer held back are due again"),
        "{out}"
    );
    assert_eq!(db.count("next_attempt_at <= now()").await, 2);

    sqlx::query(park).execute(&db.pool).await.expect("park");
    let (code, _, err) = run(&["relay", "--once", "--config", path]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(db.count("published_at IS NOT NULL").await, 2);
}

/// A stalled request holds back only its own event: the rest of its batch is settled as published
/// while it hangs, the stalled event goes on under a lease, and the worker claims new events.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_request_holds_back_only_its_own_event() {
    for claim in ["transaction", "lease"] {
        let db = TestDb::migrated().await;
        let gate = Gate::closed();
        let held = gate.clone();
        let ids = db.insert_plain(50, "order.created").await;
        let stalled = ids[0].clone();
        let rx = Receiver::with(move |r| {
            if r.id == stalled {
                Reply::ok().held_at(&held)
            } else {
                Reply::ok()
            }
        })
        .await;
        let config = webhook_config(&db, &rx.url, "timeout = \"120s\"").replace(
            "[relay]\n",
            &format!("[relay]\nworkers = 1\nbatch_size = 100\npublish_timeout = \"120s\"\nclaim = \"{claim}\"\n"),
        );
        let relay = Running::start(&db, &config);
        // 60 s are only hang guards: the property is that these happen while the request hangs.
        let rest_settled = wait_for(Duration::from_secs(60), || async {
            db.count("published_at IS NOT NULL").await == 49
        })
        .await;
        db.insert_plain(50, "order.created").await;
        let worker_went_on = wait_for(Duration::from_secs(60), || async {
            db.count("published_at IS NOT NULL").await == 99
        })
        .await;
        let stalled_still_pending = db.count("published_at IS NULL").await;
        gate.open();
        let all = wait_for(Duration::from_secs(60), || async {
            db.count("published_at IS NOT NULL").await == 100
        })
        .await;
        relay.stop().await;
        assert!(
            rest_settled,
            "{claim}: the other 49 settled while one request hangs"
        );
        assert!(
            worker_went_on,
            "{claim}: the worker claimed and delivered new events meanwhile"
        );
        assert_eq!(stalled_still_pending, 1, "{claim}");
        assert!(all, "{claim}: the stalled event settled once answered");
        assert_eq!(rx.count(), 100, "{claim}: nothing sent twice");
    }
}
