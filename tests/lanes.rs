//! Lanes: each destination publishes at its own pace. A slow, paused, failing, filtered or ordered
//! destination costs the others nothing; `concurrency` holds for the whole process; the breaker
//! counts answers as they come; a flapping destination is summed up in the log, not logged per
//! event. Times are printed for the record, never asserted: what is asserted is what each
//! receiver saw, and in what order.

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use pgoutbox::table::OutboxTable;

/// A `[[destinations]]` webhook block.
fn webhook(name: &str, url: &str, extra: &str) -> String {
    format!("\n[[destinations]]\nname = \"{name}\"\ntype = \"webhook\"\nurl = \"{url}\"\n{extra}\n")
}

/// A relay config for `db` with fast polling and the given destination blocks.
fn config(db: &TestDb, destinations: &[String]) -> String {
    format!(
        "database_url = \"{}\"\n[relay]\npoll_interval = \"50ms\"\n{}",
        db.url,
        destinations.concat()
    )
}

/// Commits `n` events over `keys` keys at about `rate` per second (one transaction each), the
/// payload carrying its number `n`; returns when the last is committed.
async fn produce(db: &TestDb, n: usize, keys: usize, rate: f64) {
    let started = Instant::now();
    for i in 0..n {
        // Another test may restart the shared server meanwhile: an insert that fails is tried
        // again (it did not commit), as an application would.
        let mut tries = 0;
        while let Err(e) = sqlx::query("INSERT INTO outbox (topic, key, payload) VALUES ('order.created', $1, jsonb_build_object('n', $2::int))")
            .bind(format!("k{}", i % keys))
            .bind(i as i32)
            .execute(&db.pool)
            .await
        {
            tries += 1;
            assert!(tries < 600, "insert: {e}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let due = started + Duration::from_secs_f64((i + 1) as f64 / rate);
        tokio::time::sleep_until(due.into()).await;
    }
}

/// The payload numbers a receiver accepted, first delivery of each id only, in arrival order.
fn accepted_numbers(rx: &Receiver) -> Vec<(String, i64)> {
    let mut seen = HashSet::new();
    rx.delivered()
        .into_iter()
        .filter(|r| seen.insert(r.id.clone()))
        .map(|r| {
            let body = r.json();
            (
                body["key"].as_str().unwrap_or_default().to_owned(),
                body["data"]["n"].as_i64().unwrap_or(-1),
            )
        })
        .collect()
}

/// Events delivered out of their key's order: a first delivery with a lower number than one
/// already delivered for its key.
fn order_violations(accepted: &[(String, i64)]) -> usize {
    let mut last: HashMap<&str, i64> = HashMap::new();
    let mut violations = 0;
    for (key, n) in accepted {
        let before = last.entry(key.as_str()).or_insert(-1);
        if *n < *before {
            violations += 1;
        }
        *before = (*before).max(*n);
    }
    violations
}

async fn dead(db: &TestDb) -> i64 {
    sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM outbox WHERE dead_at IS NOT NULL)
              + (SELECT count(*) FROM outbox_deliveries WHERE dead_at IS NOT NULL)",
    )
    .fetch_one(&db.pool)
    .await
    .expect("count dead")
}

/// How long the healthy destination takes to get `n` events produced at `rate`, alone.
async fn healthy_alone(n: usize, keys: usize, rate: f64) -> Duration {
    let db = TestDb::migrated().await;
    let healthy = Receiver::start().await;
    let relay = Running::start(&db, &config(&db, &[webhook("healthy", &healthy.url, "")]));
    let started = Instant::now();
    produce(&db, n, keys, rate).await;
    let done = wait_for(Duration::from_secs(120), || async {
        healthy.delivered_ids().len() == n
    })
    .await;
    let took = started.elapsed();
    relay.stop().await;
    assert!(done, "the healthy destination alone got all {n}");
    took
}

/// The case: five webhook destinations on one outbox, 1,000 events over 20 keys — one
/// slow (0.5 s an answer, `concurrency = 10`), one paused then resumed, one filtered, one ordered
/// by key that answers 503 to about a third of its requests in bursts, one healthy. The healthy
/// one gets everything while the slow one is far behind; the slow one never has more than ten
/// requests out; the ordered one keeps each key's order; the filtered one gets only what matches;
/// the paused one nothing until resumed, then everything; nothing dies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_paused_failing_filtered_and_ordered_destination_cost_the_healthy_one_nothing() {
    const N: usize = 1_000;
    const KEYS: usize = 20;
    const RATE: f64 = 100.0;
    let alone = healthy_alone(N, KEYS, RATE).await;

    let db = TestDb::migrated().await;
    let healthy = Receiver::start().await;
    let slow = Receiver::with(|_| Reply::ok().delay(Duration::from_millis(500))).await;
    let paused = Receiver::start().await;
    let filtered = Receiver::start().await;
    // 503 to five requests in a row out of every fifteen: failures in bursts, about a third.
    let requests = Arc::new(AtomicUsize::new(0));
    let counter = requests.clone();
    let ordered = Receiver::with(move |_| {
        let n = counter.fetch_add(1, Ordering::SeqCst);
        if (n / 5).is_multiple_of(3) {
            Reply::status(503)
        } else {
            Reply::ok()
        }
    })
    .await;
    let text = config(
        &db,
        &[
            webhook("healthy", &healthy.url, ""),
            webhook("slow", &slow.url, "concurrency = 10"),
            webhook("paused", &paused.url, ""),
            webhook("filtered", &filtered.url, "filter = \"int(payload.n) % 3 == 0\""),
            webhook(
                "ordered",
                &ordered.url,
                "ordering = \"key\"\nretry_schedule = [\"100ms\"]\nmax_attempts = 1000\nbreaker = { failures = 0 }",
            ),
        ],
    );
    let store = pgoutbox::store::Store::new(db.pool.clone(), OutboxTable::default_table());
    // The destination's row must exist before the pause; the relay registers it too.
    pgoutbox::store::destinations::pause(&store, "paused")
        .await
        .expect("pause");
    let relay = Running::start(&db, &text);
    let started = Instant::now();
    produce(&db, N, KEYS, RATE).await;
    let healthy_done = wait_for(Duration::from_secs(120), || async {
        healthy.delivered_ids().len() == N
    })
    .await;
    let with_others = started.elapsed();
    let slow_then = slow.delivered_ids().len();
    assert!(healthy_done, "the healthy destination got all {N}");
    println!(
        "healthy destination: all {N} events in {:.1} s alone, {:.1} s beside the four others ({:.2}x); the slow one had {slow_then} by then",
        alone.as_secs_f64(),
        with_others.as_secs_f64(),
        with_others.as_secs_f64() / alone.as_secs_f64()
    );
    assert!(
        slow_then < N / 2,
        "the healthy destination did not wait for the slow one ({slow_then} of {N} delivered there)"
    );
    assert_eq!(paused.count(), 0, "nothing reaches a paused destination");
    pgoutbox::store::destinations::resume(&store, "paused")
        .await
        .expect("resume");

    let all = wait_for(Duration::from_secs(240), || async {
        slow.delivered_ids().len() == N
            && paused.delivered_ids().len() == N
            && ordered.delivered_ids().len() == N
            && filtered.delivered_ids().len() == N.div_ceil(3)
    })
    .await;
    println!(
        "slow {} / paused {} / ordered {} / filtered {} of theirs after {:.1} s",
        slow.delivered_ids().len(),
        paused.delivered_ids().len(),
        ordered.delivered_ids().len(),
        filtered.delivered_ids().len(),
        started.elapsed().as_secs_f64()
    );
    relay.stop().await;
    assert!(all, "every destination got all its events");
    println!(
        "slow destination: at most {} requests in flight at once (concurrency = 10)",
        slow.max_in_flight()
    );
    assert!(
        slow.max_in_flight() <= 10,
        "concurrency holds for the whole process"
    );
    let accepted = accepted_numbers(&ordered);
    println!(
        "ordered destination: {} requests, {} answered 503, {} order violations",
        ordered.count(),
        ordered.log().iter().filter(|r| r.status == 503).count(),
        order_violations(&accepted)
    );
    assert_eq!(order_violations(&accepted), 0, "per-key order holds");
    let matching: HashSet<i64> = (0..N as i64).filter(|n| n % 3 == 0).collect();
    let got: HashSet<i64> = accepted_numbers(&filtered)
        .into_iter()
        .map(|(_, n)| n)
        .collect();
    assert_eq!(
        got, matching,
        "the filtered destination got exactly the matching events"
    );
    assert!(
        filtered
            .log()
            .iter()
            .all(|r| r.json()["data"]["n"].as_i64().unwrap_or(1) % 3 == 0),
        "and no other"
    );
    assert_eq!(dead(&db).await, 0, "nothing dead");
}

/// A destination that answers 401 from the start: the breaker counts the answers as they come,
/// and no request starts that the breaker would have stopped — `breaker.failures` requests, not
/// a batch. (The probe interval is long here, so every request the receiver sees is counted.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destination_refusing_from_the_start_gets_no_more_requests_than_its_breaker_allows() {
    let db = TestDb::migrated().await;
    let refusing = Receiver::with(|_| Reply::status(401).body("bad credentials")).await;
    let relay = Running::start(
        &db,
        &config(
            &db,
            &[webhook(
                "billing",
                &refusing.url,
                "breaker = { failures = 10, probe_interval = \"1h\", max_probe_interval = \"1h\" }",
            )],
        ),
    );
    db.insert_plain(100, "order.created").await;
    let open = wait_for(Duration::from_secs(30), || async {
        db.count("next_attempt_at = 'infinity'").await
            + sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM outbox_destinations WHERE breaker = 'open'",
            )
            .fetch_one(&db.pool)
            .await
            .unwrap_or(0)
            >= 1
    })
    .await;
    // Let anything that would still go out go out.
    tokio::time::sleep(Duration::from_secs(2)).await;
    relay.stop().await;
    assert!(open, "the breaker opened");
    println!(
        "{} requests for 100 events before the breaker opened",
        refusing.count()
    );
    assert!(
        refusing.count() <= 10,
        "at most breaker.failures requests: {}",
        refusing.count()
    );
    assert_eq!(
        db.count("dead_at IS NOT NULL").await,
        0,
        "an outage moves nothing toward the dead letters"
    );
}

/// A destination failing every third request, for 1,000 events: its failures are summed up in a
/// line an interval (and per event at debug), not a WARN line per failed event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flapping_destination_is_summed_up_in_the_log() {
    let db = TestDb::migrated().await;
    let requests = Arc::new(AtomicUsize::new(0));
    let counter = requests.clone();
    let flapping = Receiver::with(move |_| {
        if counter.fetch_add(1, Ordering::SeqCst) % 3 == 2 {
            Reply::status(503)
        } else {
            Reply::ok()
        }
    })
    .await;
    let dir = scratch();
    let path = write_config(
        dir.path(),
        &config(
            &db,
            &[webhook(
                "flapping",
                &flapping.url,
                "retry_schedule = [\"100ms\"]\nmax_attempts = 100",
            )],
        ),
    );
    let mut relay = pgoutbox()
        .env("RUST_LOG", "info")
        .args(["relay", "--config"])
        .arg(&path)
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(dir.path().join("relay.log")).expect("log"))
        .spawn()
        .expect("spawn relay");
    db.insert_plain(1_000, "order.created").await;
    let done = wait_for(Duration::from_secs(120), || async {
        flapping.delivered_ids().len() == 1_000
    })
    .await;
    let log_path = dir.path().join("relay.log");
    // The summary comes within a second of the first failures (the destinations loop's tick).
    let summed_up = wait_for(Duration::from_secs(40), || async {
        std::fs::read_to_string(&log_path)
            .unwrap_or_default()
            .contains("destination failing")
    })
    .await;
    signal(&relay, libc::SIGTERM);
    let _ = exit_status(&mut relay, Duration::from_secs(30)).await;
    assert!(done, "every event delivered in the end");
    let log = std::fs::read_to_string(dir.path().join("relay.log")).expect("log");
    let warns: Vec<&str> = log.lines().filter(|l| l.contains("WARN")).collect();
    let failed = flapping.log().iter().filter(|r| r.status == 503).count();
    println!(
        "{failed} failed requests, {} WARN lines:\n{}",
        warns.len(),
        warns.join("\n")
    );
    assert!(
        failed >= 300,
        "the destination did flap ({failed} failures)"
    );
    assert!(
        warns.len() <= 50,
        "{} WARN lines for {failed} failures",
        warns.len()
    );
    assert!(summed_up, "the flapping is summed up");
    assert!(
        warns
            .iter()
            .any(|l| l.contains("destination failing") && l.contains("flapping")),
        "in a WARN line naming the destination"
    );
}

/// A destination that accepts every request and never answers costs the others nothing: neither
/// its batches alone (events only it takes), which are handed over after a second without an
/// answer, nor batches it shares, which settle without it and wait for its answers aside, so
/// that the claim loop goes on. Before, the claim loop waited for such a batch until its budget
/// ended (`publish_timeout`, a minute here), and the healthy destination with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destination_that_never_answers_does_not_hold_back_the_others() {
    const N: usize = 30;
    let db = TestDb::migrated().await;
    let healthy = Receiver::start().await;
    let silent = Receiver::with(|_| Reply::ok().delay(Duration::from_secs(600))).await;
    let text = format!(
        "database_url = \"{}\"\n[relay]\npoll_interval = \"50ms\"\npublish_timeout = \"60s\"\nshutdown_grace = \"1s\"\n{}{}",
        db.url,
        webhook("healthy", &healthy.url, "topics = [\"ok\"]"),
        webhook("silent", &silent.url, "timeout = \"60s\""),
    );
    let relay = Running::start(&db, &text);
    // One event a transaction, alternately for both destinations and for the silent one alone.
    for i in 0..N * 2 {
        let topic = if i % 2 == 0 { "ok" } else { "other" };
        sqlx::query("INSERT INTO outbox (topic, payload) VALUES ($1, '{}')")
            .bind(topic)
            .execute(&db.pool)
            .await
            .expect("insert");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let committed = Instant::now();
    let all = wait_for(Duration::from_secs(20), || async {
        healthy.delivered_ids().len() == N
    })
    .await;
    println!(
        "healthy destination: {} of {N} events, {:.1} s after the last commit; the silent one was sent {}",
        healthy.delivered_ids().len(),
        committed.elapsed().as_secs_f64(),
        silent.count()
    );
    relay.stop().await;
    assert!(
        all,
        "the healthy destination got its {N} events well before the silent one's requests time out"
    );
}
