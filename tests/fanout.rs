//! Fan-out: an event goes to every destination that takes it, and each (event, destination) pair
//! has its own delivery state. A failing destination delays and re-sends nothing to the others.
//! Times printed are for the record, never asserted.

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use pgoutbox::store::dead::{self, DeadFilter};
use pgoutbox::store::Store;
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

/// The topics a receiver got (2xx), per event type.
fn topics(rx: &Receiver) -> HashMap<String, usize> {
    let mut by_topic = HashMap::new();
    for r in rx.delivered() {
        let topic = r.json()["type"].as_str().unwrap_or_default().to_owned();
        *by_topic.entry(topic).or_default() += 1;
    }
    by_topic
}

/// Requests with an id the receiver had already accepted (a 2xx before).
fn duplicates(rx: &Receiver) -> usize {
    let mut accepted = HashSet::new();
    rx.log()
        .into_iter()
        .filter(|r| (200..300).contains(&r.status))
        .filter(|r| !accepted.insert(r.id.clone()))
        .count()
}

/// Undelivered pairs of a destination: rows of the deliveries table plus pairs in held batches.
async fn waiting(db: &TestDb, destination: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM outbox_deliveries WHERE destination = $1 AND dead_at IS NULL)
              + (SELECT coalesce(sum(count), 0) FROM outbox_held_batches
                 WHERE destination = $1)::bigint",
    )
    .bind(destination)
    .fetch_one(&db.pool)
    .await
    .expect("count waiting pairs")
}

async fn pairs(db: &TestDb, where_clause: &str) -> i64 {
    sqlx::query_scalar(&format!(
        "SELECT count(*) FROM outbox_deliveries WHERE {where_clause}"
    ))
    .fetch_one(&db.pool)
    .await
    .expect("count pairs")
}

/// The case: A takes `order.*`, B `order.*` and `payment.*`, C everything. With C
/// answering 503, A gets its 200 orders and B its 300 events, each once; once C recovers it gets
/// all 300; nothing dies and no destination gets a topic it did not ask for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_matching_destination_gets_the_event_while_another_is_down() {
    let db = TestDb::migrated().await;
    let a = Receiver::start().await;
    let b = Receiver::start().await;
    let c = Receiver::with(|_| Reply::status(503)).await;
    db.insert_plain(200, "order.created").await;
    db.insert_plain(100, "payment.captured").await;
    let text = config(
        &db,
        &[
            webhook("a", &a.url, "topics = [\"order.*\"]"),
            webhook("b", &b.url, "topics = [\"order.*\", \"payment.*\"]"),
            webhook("c", &c.url, "topics = [\"*\"]\nretry_schedule = [\"1s\"]"),
        ],
    );
    let started = Instant::now();
    let relay = Running::start(&db, &text);
    // The behaviour asserted: A and B get everything while C is still answering 503. The time
    // it took (the 15 s) is printed, not asserted; the limit only guards against a hang.
    let healthy = wait_for(Duration::from_secs(120), || async {
        a.delivered_ids().len() == 200 && b.delivered_ids().len() == 300
    })
    .await;
    let healthy_in = started.elapsed();
    let c_delivered_while_down = c.delivered_ids().len();
    // A and B answered; their batches' settles write C's pairs.
    wait_for(Duration::from_secs(120), || async {
        waiting(&db, "c").await == 300
    })
    .await;
    let waiting_for_c = waiting(&db, "c").await;
    let batches: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_held_batches")
        .fetch_one(&db.pool)
        .await
        .expect("held batches");
    let c_requests_while_down = c.count();
    c.set(|_| Reply::ok());
    let back = Instant::now();
    let recovered = wait_for(Duration::from_secs(60), || async {
        c.delivered_ids().len() == 300
    })
    .await;
    let recovered_in = back.elapsed();
    // Let any straggling re-send show up before counting.
    tokio::time::sleep(Duration::from_millis(500)).await;
    relay.stop().await;
    println!(
        "fan-out: A {} and B {} in {:.1} s while C answered 503 ({c_requests_while_down} requests, {waiting_for_c} pairs waiting, {batches} held batches); C got {} in {:.1} s after it recovered",
        a.delivered_ids().len(),
        b.delivered_ids().len(),
        healthy_in.as_secs_f64(),
        c.delivered_ids().len(),
        recovered_in.as_secs_f64()
    );
    assert!(healthy, "A got its 200 and B its 300 while C was down");
    assert_eq!(
        c_delivered_while_down, 0,
        "C accepted nothing while it answered 503"
    );
    assert!(recovered, "C got all 300 after it recovered");
    assert_eq!(
        waiting_for_c, 300,
        "C's pairs waited in the deliveries table"
    );
    assert_eq!(
        (duplicates(&a), duplicates(&b)),
        (0, 0),
        "A and B got no duplicates"
    );
    assert_eq!(duplicates(&c), 0, "C got each event once it answered");
    assert_eq!(topics(&a), HashMap::from([("order.created".into(), 200)]));
    assert_eq!(
        topics(&b),
        HashMap::from([
            ("order.created".into(), 200),
            ("payment.captured".into(), 100)
        ])
    );
    assert_eq!(c.delivered_ids().len(), 300);
    // C's events came back from where they were held (rows, or a held batch) exactly as B got them.
    let body_of = |rx: &Receiver| -> HashMap<String, serde_json::Value> {
        rx.delivered()
            .into_iter()
            .map(|r| (r.id.clone(), r.json()))
            .collect()
    };
    assert_eq!(
        body_of(&c),
        body_of(&b),
        "same envelopes: id, type, timestamp, key, data"
    );
    assert_eq!(
        db.count("dead_at IS NOT NULL").await,
        0,
        "no dead event row"
    );
    assert_eq!(
        pairs(&db, "true").await,
        0,
        "every pair delivered, none left"
    );
    assert_eq!(db.count("published_at IS NULL").await, 0);
}

/// Filters choose by payload and headers; an event no destination takes is still dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn filters_choose_events_by_payload_and_headers() {
    let db = TestDb::migrated().await;
    let big = Receiver::start().await;
    let acme = Receiver::start().await;
    sqlx::query(
        "INSERT INTO outbox (topic, payload, headers)
         SELECT 'order.created', jsonb_build_object('total', g * 10),
                CASE WHEN g % 2 = 0 THEN '{\"X-Tenant\": \"acme\"}'::jsonb ELSE '{}'::jsonb END
         FROM generate_series(1, 40) g",
    )
    .execute(&db.pool)
    .await
    .expect("insert");
    sqlx::query("INSERT INTO outbox (topic, payload) VALUES ('user.signed_up', '{}')")
        .execute(&db.pool)
        .await
        .expect("insert");
    let text = config(
        &db,
        &[
            webhook(
                "big",
                &big.url,
                "topics = [\"order.*\"]\nfilter = \"payload.total > 100\"",
            ),
            webhook(
                "acme",
                &acme.url,
                "topics = [\"order.*\"]\nfilter = \"headers['x-tenant'] == 'acme'\"",
            ),
        ],
    );
    let relay = Running::start(&db, &text);
    let done = wait_for(Duration::from_secs(30), || async {
        db.count("published_at IS NULL AND dead_at IS NULL").await == 0
    })
    .await;
    relay.stop().await;
    assert!(done, "every event settled");
    let totals = |rx: &Receiver| -> HashSet<i64> {
        rx.delivered()
            .iter()
            .map(|r| r.json()["data"]["total"].as_i64().expect("total"))
            .collect()
    };
    assert_eq!(totals(&big), (11..=40).map(|g| g * 10).collect());
    assert_eq!(totals(&acme), (1..=20).map(|g| g * 20).collect());
    // 10, 30, 50, 70, 90: neither filter takes them, nor the user event: dead, with the reason.
    assert_eq!(db.count("dead_at IS NOT NULL").await, 6);
    assert_eq!(
        db.count("dead_at IS NOT NULL AND last_error LIKE 'no destination takes topic%'")
            .await,
        6
    );
}

/// A destination that rejects an event dead-letters only its own pair; `dead list|retry
/// --destination` see and act on that destination's pairs only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_are_per_destination() {
    let db = TestDb::migrated().await;
    let ok = Receiver::start().await;
    let picky = Receiver::with(|_| Reply::status(422).body("schema mismatch")).await;
    db.insert_plain(10, "order.created").await;
    let text = config(
        &db,
        &[webhook("ok", &ok.url, ""), webhook("picky", &picky.url, "")],
    );
    let relay = Running::start(&db, &text);
    let settled = wait_for(Duration::from_secs(30), || async {
        pairs(&db, "dead_at IS NOT NULL").await == 10
    })
    .await;
    assert!(settled, "picky's 10 pairs dead");
    assert_eq!(ok.delivered_ids().len(), 10, "ok got every event");
    assert_eq!(
        db.count("dead_at IS NOT NULL").await,
        0,
        "no event row is dead"
    );
    let table = OutboxTable::default_table();
    let store = Store::new(db.pool.clone(), table.clone());
    let only = |name: &str| DeadFilter {
        destination: Some(name.into()),
        ..DeadFilter::default()
    };
    let picky_dead = dead::list(&store, &only("picky"), 100).await.expect("list");
    assert_eq!(picky_dead.len(), 10);
    assert!(picky_dead
        .iter()
        .all(|d| d.destination.as_deref() == Some("picky")
            && d.last_error
                .as_deref()
                .unwrap_or("")
                .contains("schema mismatch")));
    assert!(dead::list(&store, &only("ok"), 100)
        .await
        .expect("list")
        .is_empty());
    // `status` counts each destination's own: picky's dead pairs, nothing dead for ok.
    let config = parse_config(&text);
    let router = pgoutbox::route::Router::new(&config.destinations);
    let names: Vec<String> = config.destinations.iter().map(|d| d.name.clone()).collect();
    let status = pgoutbox::status::read(&store, Some((&router, &names)))
        .await
        .expect("status");
    let dead_of = |name: &str| -> i64 {
        status
            .rows
            .iter()
            .filter(|r| r.destination.as_deref() == Some(name))
            .map(|r| r.dead)
            .sum()
    };
    assert_eq!((dead_of("picky"), dead_of("ok")), (10, 0));
    assert_eq!(status.totals.dead, 10);
    let shown = dead::show(&store, picky_dead[0].id).await.expect("show");
    assert_eq!(shown.len(), 1);
    assert!(shown[0].payload.is_some());

    // The receiver is fixed; only picky's pairs are retried, and ok gets nothing again.
    picky.set(|_| Reply::ok());
    let retried = dead::retry(&store, &only("picky"), false)
        .await
        .expect("retry");
    assert_eq!(retried, 10);
    let redelivered = wait_for(Duration::from_secs(30), || async {
        picky.delivered_ids().len() == 10
    })
    .await;
    relay.stop().await;
    assert!(redelivered, "picky got its 10 after the retry");
    assert_eq!(ok.count(), 10, "ok was not sent anything again");
    assert_eq!(pairs(&db, "true").await, 0);
}

/// `ordering = "key"` holds per destination: an ordered destination that fails the first events of
/// a key holds back only its own later events of that key, and gets each key in order; a second
/// destination gets every event without waiting for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ordering_holds_per_destination() {
    let db = TestDb::migrated().await;
    let fast = Receiver::start().await;
    // The ordered destination fails its first 30 requests, whatever the event.
    let failures = Arc::new(AtomicUsize::new(0));
    let seen = Arc::clone(&failures);
    let ordered = Receiver::with(move |_| {
        if seen.fetch_add(1, Ordering::SeqCst) < 30 {
            Reply::status(503)
        } else {
            Reply::ok()
        }
    })
    .await;
    sqlx::query(
        "INSERT INTO outbox (topic, key, payload)
         SELECT 'order.updated', 'k' || (g % 5), jsonb_build_object('n', g)
         FROM generate_series(1, 100) g",
    )
    .execute(&db.pool)
    .await
    .expect("insert");
    let text = config(
        &db,
        &[
            webhook("fast", &fast.url, ""),
            webhook(
                "ordered",
                &ordered.url,
                "ordering = \"key\"\nretry_schedule = [\"200ms\"]\nbreaker = { failures = 1000 }",
            ),
        ],
    );
    let relay = Running::start(&db, &text);
    let fast_done = wait_for(Duration::from_secs(30), || async {
        fast.delivered_ids().len() == 100
    })
    .await;
    let ordered_done = wait_for(Duration::from_secs(60), || async {
        ordered.delivered_ids().len() == 100
    })
    .await;
    relay.stop().await;
    assert!(fast_done, "the unordered destination got all 100");
    assert!(ordered_done, "the ordered destination got all 100");
    assert_eq!(duplicates(&fast), 0);
    // Per key, the ordered destination's accepted events come in insert order.
    let mut last: HashMap<String, i64> = HashMap::new();
    let mut violations = 0;
    for r in ordered.delivered() {
        let body = r.json();
        let key = body["key"].as_str().expect("key").to_owned();
        let n = body["data"]["n"].as_i64().expect("n");
        if last.get(&key).is_some_and(|&prev| n < prev) {
            violations += 1;
        }
        last.insert(key, n);
    }
    assert_eq!(violations, 0, "per-key order at the ordered destination");
    assert_eq!(pairs(&db, "true").await, 0);
}

/// An outbox with rows pending at upgrade, some already failing for one destination, keeps
/// flowing once a second destination is configured.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_rows_keep_flowing_when_a_destination_is_added() {
    let db = TestDb::migrated().await;
    let old = Receiver::start().await;
    let new = Receiver::start().await;
    db.insert_plain(20, "order.created").await;
    sqlx::query(
        "UPDATE outbox SET attempts = 2, last_error = 'attempt 2 to old: HTTP 503', destination = 'old'
         WHERE seq IN (SELECT seq FROM outbox ORDER BY seq LIMIT 5)",
    )
    .execute(&db.pool)
    .await
    .expect("fail some");
    let text = config(
        &db,
        &[webhook("old", &old.url, ""), webhook("new", &new.url, "")],
    );
    let relay = Running::start(&db, &text);
    let done = wait_for(Duration::from_secs(30), || async {
        old.delivered_ids().len() == 20 && new.delivered_ids().len() == 20
    })
    .await;
    relay.stop().await;
    assert!(done, "both destinations got the 20 events");
    assert_eq!(db.count("published_at IS NULL").await, 0);
}

/// `/readyz` per destination: readiness of one destination names only it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_per_destination() {
    let db = TestDb::migrated().await;
    let up = Receiver::start().await;
    let text = config(
        &db,
        &[
            webhook("up", &up.url, ""),
            webhook(
                "down",
                &format!("http://127.0.0.1:{}/events", closed_port()),
                "",
            ),
        ],
    );
    let relay = pgoutbox::engine::Relay::new(db.pool.clone(), &parse_config(&text)).expect("relay");
    let up_lines = relay.readiness_of(Some("up")).await.expect("up is ready");
    assert!(up_lines.iter().any(|l| l.starts_with("destination up: ok")));
    assert!(!up_lines.iter().any(|l| l.contains("destination down")));
    let down = relay.readiness_of(Some("down")).await.expect_err("down");
    assert!(down
        .iter()
        .any(|l| l.starts_with("destination down: not ready")));
    assert!(relay.readiness_of(Some("nope")).await.is_err());
    assert!(relay.readiness().await.is_err(), "all together: not ready");
}

/// A paused destination's pairs wait in held batches (one row per batch, not per event) while the
/// other destination gets everything; `resume` sends them, each once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_destination_gets_its_events_on_resume() {
    let db = TestDb::migrated().await;
    let live = Receiver::start().await;
    let paused = Receiver::start().await;
    let table = OutboxTable::default_table();
    let text = config(
        &db,
        &[
            webhook("live", &live.url, ""),
            webhook("paused", &paused.url, ""),
        ],
    );
    pgoutbox::store::destinations::pause(
        &pgoutbox::store::Store::new(db.pool.clone(), table.clone()),
        "paused",
    )
    .await
    .expect("pause");
    let relay = Running::start(&db, &text);
    db.insert_plain(490, "order.created").await;
    // Keys and headers come back from a held batch as they went in (unordered destination).
    sqlx::query(
        "INSERT INTO outbox (topic, payload, key, headers)
         SELECT 'order.updated', jsonb_build_object('n', g, 'note', 'é \"quoted\"'), 'k' || g,
                jsonb_build_object('X-Tenant', 'acme', 'x-n', g::text)
         FROM generate_series(1, 10) g",
    )
    .execute(&db.pool)
    .await
    .expect("insert keyed");
    let live_done = wait_for(Duration::from_secs(30), || async {
        live.delivered_ids().len() == 500 && waiting(&db, "paused").await == 500
    })
    .await;
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_held_batches")
        .fetch_one(&db.pool)
        .await
        .expect("batches");
    assert!(live_done, "live got all 500 while paused held them");
    assert_eq!(paused.count(), 0, "nothing sent to the paused destination");
    assert!(
        rows < 500,
        "held in batches, not a row per event ({rows} rows)"
    );
    pgoutbox::store::destinations::resume(
        &pgoutbox::store::Store::new(db.pool.clone(), table.clone()),
        "paused",
    )
    .await
    .expect("resume");
    let resumed = wait_for(Duration::from_secs(30), || async {
        paused.delivered_ids().len() == 500
    })
    .await;
    relay.stop().await;
    assert!(resumed, "the resumed destination got its 500");
    assert_eq!((duplicates(&live), duplicates(&paused)), (0, 0));
    let seen = |rx: &Receiver| -> HashMap<String, (serde_json::Value, Option<String>)> {
        rx.delivered()
            .into_iter()
            .map(|r| (r.id.clone(), (r.json(), r.headers.get("x-tenant").cloned())))
            .collect()
    };
    assert_eq!(seen(&paused), seen(&live), "same envelopes and headers");
    assert_eq!(waiting(&db, "paused").await, 0);
}

/// `max_age` still applies to held pairs, in held batches too: past it they are dead-lettered for
/// that destination only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_pairs_reach_max_age() {
    let db = TestDb::migrated().await;
    let live = Receiver::start().await;
    let paused = Receiver::start().await;
    let table = OutboxTable::default_table();
    pgoutbox::store::destinations::pause(
        &pgoutbox::store::Store::new(db.pool.clone(), table.clone()),
        "paused",
    )
    .await
    .expect("pause");
    let text = config(
        &db,
        &[
            webhook("live", &live.url, ""),
            webhook("paused", &paused.url, "max_age = \"1s\""),
        ],
    )
    .replace("[relay]", "cleanup_interval = \"200ms\"\n[relay]");
    db.insert_plain(20, "order.created").await;
    let relay = Running::start(&db, &text);
    let dead = wait_for(Duration::from_secs(30), || async {
        pairs(&db, "destination = 'paused' AND dead_at IS NOT NULL").await == 20
    })
    .await;
    relay.stop().await;
    assert!(dead, "the paused destination's 20 pairs died of max_age");
    assert_eq!(live.delivered_ids().len(), 20);
    assert_eq!(paused.count(), 0);
    let last_error: String = sqlx::query_scalar(
        "SELECT last_error FROM outbox_deliveries WHERE destination = 'paused' LIMIT 1",
    )
    .fetch_one(&db.pool)
    .await
    .expect("last_error");
    assert!(last_error.contains("max_age"), "{last_error}");
}

/// Lease mode fans out the same way: a flapping destination's failures are its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_mode_fans_out() {
    let db = TestDb::migrated().await;
    let steady = Receiver::start().await;
    let flips = Arc::new(AtomicUsize::new(0));
    let seen = Arc::clone(&flips);
    let flapping = Receiver::with(move |_| {
        if seen.fetch_add(1, Ordering::SeqCst).is_multiple_of(3) {
            Reply::status(503)
        } else {
            Reply::ok()
        }
    })
    .await;
    db.insert_plain(300, "order.created").await;
    let text = config(
        &db,
        &[
            webhook("steady", &steady.url, ""),
            webhook(
                "flapping",
                &flapping.url,
                "retry_schedule = [\"100ms\"]\nbreaker = { failures = 1000 }",
            ),
        ],
    )
    .replace("[relay]", "[relay]\nclaim = \"lease\"");
    let relay = Running::start(&db, &text);
    let done = wait_for(Duration::from_secs(60), || async {
        steady.delivered_ids().len() == 300 && flapping.delivered_ids().len() == 300
    })
    .await;
    relay.stop().await;
    assert!(done, "both got all 300");
    assert_eq!(
        steady.count(),
        300,
        "the steady destination got each event once"
    );
    assert_eq!(duplicates(&flapping), 0);
    assert_eq!(pairs(&db, "true").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_row_records_the_destination_that_delivered_it_when_a_batch_spans_several() {
    let db = TestDb::migrated().await;
    let rx = Receiver::start().await;
    let names = ["alpha", "beta", "gamma"];
    let blocks: Vec<String> = names
        .iter()
        .map(|n| webhook(n, &rx.url, &format!("topics = [\"{n}.*\"]")))
        .collect();
    for name in names {
        db.insert_plain(7, &format!("{name}.created")).await;
    }
    let relay = Running::start(&db, &config(&db, &blocks));
    let published = wait_for(Duration::from_secs(60), || async {
        db.count("published_at IS NULL").await == 0
    })
    .await;
    relay.stop().await;
    assert!(published, "every event was published");
    for name in names {
        assert_eq!(
            db.count(&format!(
                "destination = '{name}' AND topic = '{name}.created' AND published_at IS NOT NULL"
            ))
            .await,
            7,
            "{name}'s rows name it"
        );
    }
}
