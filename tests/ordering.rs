//! Per-key ordering and lease mode.

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering as AtomicOrdering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use pgoutbox::engine::Relay;

/// Inserts `per_key` events for each of `keys` keys, interleaved, payload `{"k": key, "n": i}`.
async fn insert_keyed(db: &TestDb, keys: usize, per_key: usize) {
    sqlx::query(
        "INSERT INTO outbox (topic, key, payload)
         SELECT 'order.updated', 'order-' || k, jsonb_build_object('k', k, 'n', n)
         FROM generate_series(0, $2 - 1) n, generate_series(0, $1 - 1) k
         ORDER BY n, k",
    )
    .bind(keys as i32)
    .bind(per_key as i32)
    .execute(&db.pool)
    .await
    .expect("insert");
}

/// Per key, the `n` values in the order of their first successful delivery.
fn first_delivery_order(rx: &Receiver) -> HashMap<i64, Vec<i64>> {
    let mut seen = HashSet::new();
    let mut order: HashMap<i64, Vec<i64>> = HashMap::new();
    for r in rx.delivered() {
        if seen.insert(r.id.clone()) {
            let data = &r.json()["data"];
            order
                .entry(data["k"].as_i64().expect("k"))
                .or_default()
                .push(data["n"].as_i64().expect("n"));
        }
    }
    order
}

fn violations(order: &HashMap<i64, Vec<i64>>) -> usize {
    order
        .values()
        .map(|ns| ns.windows(2).filter(|w| w[0] > w[1]).count())
        .sum()
}

/// Starts `n` in-process relays, each with its own pool.
async fn start_relays(db: &TestDb, text: &str, n: usize) -> Vec<Running> {
    let mut relays = Vec::new();
    for _ in 0..n {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(4)
            .connect(&db.url)
            .await
            .expect("pool");
        relays.push(Running::on(pool, text));
    }
    relays
}

/// Destination settings: ordered by key, a failed event waits an hour (so it is tried once).
const ORDERED_RETRY_IN_AN_HOUR: &str = "ordering = \"key\"\nretry_schedule = [\"1h\"]";

/// A receiver that answers 503 to every event of key 0 and 200 to the rest.
async fn key_0_fails() -> Receiver {
    Receiver::with(|r| {
        if r.json()["data"]["k"] == 0 {
            Reply::status(503)
        } else {
            Reply::ok()
        }
    })
    .await
}

/// Runs `n` relays until no row matches `pending` (true) or `secs` pass (false), then stops them.
async fn run_relays_until(db: &TestDb, text: &str, n: usize, secs: u64, pending: &str) -> bool {
    let relays = start_relays(db, text, n).await;
    let done = wait_for(Duration::from_secs(secs), || async {
        db.count(pending).await == 0
    })
    .await;
    Running::stop_all(relays).await;
    done
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ordered_keys_keep_seq_order_across_four_relays_and_retries() {
    let db = TestDb::migrated().await;
    // One request in five fails, pseudo-randomly but reproducibly.
    let counter = Arc::new(AtomicU64::new(0));
    let c = counter.clone();
    let rx = Receiver::with(move |_| {
        let n = c.fetch_add(1, AtomicOrdering::Relaxed);
        if n.wrapping_mul(2654435761).is_multiple_of(5) {
            Reply::status(503)
        } else {
            Reply::ok()
        }
    })
    .await;
    insert_keyed(&db, 100, 12).await;
    let text = webhook_config(
        &db,
        &rx.url,
        "ordering = \"key\"\nretry_schedule = [\"50ms\"]\nmax_attempts = 100",
    )
    .replace("[relay]\n", "[relay]\nbatch_size = 100\n");
    let drained = run_relays_until(&db, &text, 4, 90, "published_at IS NULL").await;
    assert!(drained, "backlog drained");
    let order = first_delivery_order(&rx);
    assert_eq!(order.len(), 100);
    assert!(
        order.values().all(|ns| ns.len() == 12),
        "every event delivered"
    );
    assert_eq!(violations(&order), 0, "per-key order holds");
    assert!(rx.log().iter().any(|r| r.status == 503), "retries happened");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_head_holds_back_only_its_own_key() {
    let db = TestDb::migrated().await;
    let rx = key_0_fails().await;
    insert_keyed(&db, 5, 4).await;
    let config = parse_config(&webhook_config(&db, &rx.url, ORDERED_RETRY_IN_AN_HOUR));
    let relay = Relay::new(db.pool.clone(), &config).expect("relay");
    relay.run_once().await.expect("run");
    let order = first_delivery_order(&rx);
    assert_eq!(order.get(&0), None, "key 0 delivered nothing");
    for k in 1..5 {
        assert_eq!(order[&k], vec![0, 1, 2, 3], "key {k} flows in order");
    }
    let attempted_k0: Vec<_> = rx
        .log()
        .into_iter()
        .filter(|r| r.json()["data"]["k"] == 0)
        .collect();
    assert_eq!(attempted_k0.len(), 1, "only the head of key 0 was tried");
    assert_eq!(
        db.count("key = 'order-0' AND attempts = 0 AND published_at IS NULL")
            .await,
        3
    );
}

/// A failing key with thousands of events ahead of every other key in the table, written after
/// its head failed (so not parked behind it): the claim's search for heads starts with a window of
/// a few batches, finds only that key's held-back rows, and widens until it reaches the other
/// keys, which are delivered while key 0 waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_behind_a_long_run_of_held_back_events_are_still_reached() {
    let db = TestDb::migrated().await;
    let rx = key_0_fails().await;
    let text = webhook_config(&db, &rx.url, ORDERED_RETRY_IN_AN_HOUR)
        .replace("[relay]\n", "[relay]\nbatch_size = 20\n");
    let insert_key0 = |from: i32, to: i32| {
        sqlx::query(
            "INSERT INTO outbox (topic, key, payload)
             SELECT 'order.updated', 'order-0', jsonb_build_object('k', 0, 'n', n)
             FROM generate_series($1::int, $2::int) n ORDER BY n",
        )
        .bind(from)
        .bind(to)
        .execute(&db.pool)
    };
    insert_key0(0, 0).await.expect("insert key 0's head");
    Relay::new(db.pool.clone(), &parse_config(&text))
        .expect("relay")
        .run_once()
        .await
        .expect("head fails");
    insert_key0(1, 2999)
        .await
        .expect("insert key 0's followers");
    sqlx::query(
        "INSERT INTO outbox (topic, key, payload)
         SELECT 'order.updated', 'order-' || k, jsonb_build_object('k', k, 'n', n)
         FROM generate_series(0, 3) n, generate_series(1, 5) k ORDER BY n, k",
    )
    .execute(&db.pool)
    .await
    .expect("insert keys 1-5");
    let reached = run_relays_until(
        &db,
        &text,
        1,
        60,
        "key <> 'order-0' AND published_at IS NULL",
    )
    .await;
    assert!(
        reached,
        "keys 1-5 delivered behind 3,000 held-back events of key 0"
    );
    let order = first_delivery_order(&rx);
    for k in 1..=5 {
        assert_eq!(order[&k], vec![0, 1, 2, 3], "key {k} in order");
    }
    let tried_k0 = rx
        .log()
        .into_iter()
        .filter(|r| r.json()["data"]["k"] == 0)
        .count();
    assert_eq!(tried_k0, 1, "only the head of key 0 was tried");
}

/// A failed head takes its key's later rows with it: they wait until its next attempt (behind a
/// dead head under `on_dead = "block"`: until it is retried or discarded), so they are not at the
/// front of the due range, where every claim would step over them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn followers_wait_with_their_failed_head() {
    let db = TestDb::migrated().await;
    let rx = Receiver::with(|r| match (&r.json()["data"]["k"], &r.json()["data"]["n"]) {
        (k, n) if *k == 0 && *n == 0 => Reply::status(503),
        (k, n) if *k == 1 && *n == 0 => Reply::status(400),
        _ => Reply::ok(),
    })
    .await;
    insert_keyed(&db, 3, 4).await;
    let config = parse_config(&webhook_config(&db, &rx.url, ORDERED_RETRY_IN_AN_HOUR));
    let relay = Relay::new(db.pool.clone(), &config).expect("relay");
    relay.run_once().await.expect("run");
    assert_eq!(first_delivery_order(&rx)[&2], vec![0, 1, 2, 3]);

    // Key 0: its head waits an hour (± 20 % jitter); the three behind it wait exactly as long.
    let parked = |k: i64| {
        format!(
            "key = 'order-{k}' AND (payload->>'n')::int > 0 AND published_at IS NULL
             AND next_attempt_at = (SELECT next_attempt_at FROM outbox
                                    WHERE key = 'order-{k}' AND (payload->>'n')::int = 0)"
        )
    };
    assert_eq!(
        db.count(&parked(0)).await,
        3,
        "key 0 parked behind its head"
    );
    assert!(
        db.count("key = 'order-0' AND next_attempt_at > now() + interval '40 minutes'")
            .await
            == 4
    );
    // Key 1: its head is dead and blocks; the rows behind it are parked for good…
    assert_eq!(
        db.count("key = 'order-1' AND next_attempt_at = 'infinity'")
            .await,
        3
    );
    // …until the dead head is retried: then they are due again (behind it).
    let retried = pgoutbox::store::dead::retry(
        &pgoutbox::store::Store::new(db.pool.clone(), config.table.clone()),
        &pgoutbox::store::dead::DeadFilter::default(),
        false,
    )
    .await
    .expect("dead retry");
    assert_eq!(retried, 1);
    assert_eq!(
        db.count("key = 'order-1' AND next_attempt_at <= now() AND published_at IS NULL")
            .await,
        4
    );
    rx.set(|_| Reply::ok());
    relay.run_once().await.expect("run again");
    assert_eq!(first_delivery_order(&rx)[&1], vec![0, 1, 2, 3]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hot_keys_move_many_events_per_batch() {
    let db = TestDb::migrated().await;
    let rx = Receiver::start().await;
    insert_keyed(&db, 1, 300).await;
    let config = parse_config(&webhook_config(&db, &rx.url, "ordering = \"key\""));
    let relay = Relay::new(db.pool.clone(), &config).expect("relay");
    let mut batches = 0;
    let mut largest = 0;
    loop {
        let report = relay.run_batch().await.expect("batch");
        if report.claimed == 0 {
            break;
        }
        batches += 1;
        largest = largest.max(report.delivered);
    }
    // The claim learns the key is deep: followers per head double up to the cap.
    assert_eq!(
        largest,
        1 + pgoutbox::sources::poll::FOLLOWERS_PER_KEY,
        "head plus a full set of followers"
    );
    assert!(batches <= 10, "300 events of one key took {batches} claims");
    assert_eq!(first_delivery_order(&rx)[&0], (0..300).collect::<Vec<_>>());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_dead_block_and_skip() {
    for (policy, expect_after_dead) in [("block", false), ("skip", true)] {
        let db = TestDb::migrated().await;
        let rx = Receiver::with(|r| {
            if r.json()["data"]["n"] == 1 {
                Reply::status(400)
            } else {
                Reply::ok()
            }
        })
        .await;
        insert_keyed(&db, 2, 4).await;
        let config = parse_config(&webhook_config(
            &db,
            &rx.url,
            &format!("ordering = \"key\"\non_dead = \"{policy}\""),
        ));
        let relay = Relay::new(db.pool.clone(), &config).expect("relay");
        relay.run_once().await.expect("run");
        relay.run_once().await.expect("run again");
        let order = first_delivery_order(&rx);
        let expected = if expect_after_dead {
            vec![0, 2, 3]
        } else {
            vec![0]
        };
        assert_eq!(order[&0], expected, "on_dead = {policy}");
        assert_eq!(
            db.count("dead_at IS NOT NULL").await,
            2,
            "on_dead = {policy}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_lease_holder_cannot_settle_after_another_relay_took_over() {
    let db = TestDb::migrated().await;
    // Phase 1: every request hangs 3 s, then fails: the stalled relay would record failures.
    let rx = Receiver::with(|_| Reply::status(503).delay(Duration::from_secs(3))).await;
    let ids: HashSet<String> = db
        .insert_plain(20, "order.created")
        .await
        .into_iter()
        .collect();
    let dir = scratch();
    let lease_cfg = |tag: &str| {
        // No breaker: every request of the batch must be out at once (a relay that has seen no
        // answer yet otherwise sends no more at a time than the failures that open its breaker).
        webhook_config(
            &db,
            &rx.url,
            "timeout = \"20s\"\nbreaker = { failures = 0 }",
        )
        .replace(
            "[relay]\n",
            "[relay]\nclaim = \"lease\"\npublish_timeout = \"25s\"\nlease = \"26s\"\n",
        )
        .replace("name = \"hooks\"", &format!("name = \"hooks-{tag}\""))
    };
    let config_a = write_config(dir.path(), &lease_cfg("a"));
    let mut a = spawn_relay(dir.path(), &config_a, "a");
    assert!(
        wait_for(Duration::from_secs(20), || async { rx.log().len() == 20 }).await,
        "A claimed and sent all"
    );
    signal(&a, libc::SIGSTOP);
    // The lease expires while A is frozen: make it expire now rather than wait 26 s.
    sqlx::query("UPDATE outbox SET next_attempt_at = now() WHERE lease_token IS NOT NULL")
        .execute(&db.pool)
        .await
        .expect("expire lease");

    // Phase 2: B re-claims and delivers everything.
    rx.set(|_| Reply::ok());
    let dir_b = scratch();
    let config_b = write_config(dir_b.path(), &lease_cfg("b"));
    let mut b = spawn_relay(dir_b.path(), &config_b, "b");
    let delivered = wait_for(Duration::from_secs(20), || async {
        db.count("published_at IS NOT NULL").await == 20
    })
    .await;
    signal(&b, libc::SIGTERM);
    b.wait().expect("b");
    assert!(delivered);

    // A wakes up, its requests fail, and its settle is fenced off.
    signal(&a, libc::SIGCONT);
    let log_a = dir.path().join("relay-a.log");
    let fenced = wait_for(Duration::from_secs(20), || async {
        std::fs::read_to_string(&log_a)
            .unwrap_or_default()
            .contains("lease lost before settle")
    })
    .await;
    signal(&a, libc::SIGTERM);
    a.wait().expect("a");
    assert!(fenced, "A noticed it lost the lease");
    assert_eq!(rx.delivered_ids(), ids);
    assert_eq!(
        db.count("published_at IS NOT NULL AND attempts = 0 AND last_error IS NULL AND destination = 'hooks-b'").await,
        20,
        "A's late failures did not overwrite B's settles"
    );
}

/// What `pg_stat_activity` shows of a relay process's sessions while the receiver holds every
/// request of its batch.
struct WhileHeld {
    /// Relay sessions seen in the test's database (the probe sees the relay at all).
    sessions: i64,
    /// Relay sessions that held a transaction across the wait: idle in transaction, or in a
    /// transaction that began before the requests were held.
    holding: i64,
}

/// Runs `pgoutbox relay` with `claim` mode against a receiver that holds every request at a gate;
/// once the whole batch (20 events) is held, looks at the relay's sessions 20 times, then opens
/// the gate and waits for the batch to be delivered and the relay to exit 0 on SIGTERM.
async fn relay_sessions_while_requests_are_held(claim: &str) -> WhileHeld {
    let db = TestDb::migrated().await;
    let gate = Gate::closed();
    let g = gate.clone();
    let rx = Receiver::with(move |_| Reply::ok().held_at(&g)).await;
    db.insert_plain(20, "order.created").await;
    let dir = scratch();
    // No breaker: all 20 requests must be out at once (a relay that has seen no answer yet
    // otherwise sends no more at a time than the failures that open its breaker).
    let text = webhook_config(
        &db,
        &rx.url,
        "concurrency = 20\ntimeout = \"60s\"\nbreaker = { failures = 0 }",
    )
    .replace(
        "[relay]\n",
        &format!(
            "[relay]\nclaim = \"{claim}\"\nbatch_size = 20\nworkers = 1\npublish_timeout = \"90s\"\n"
        ),
    );
    let config = write_config(dir.path(), &text);
    let mut relay = spawn_relay(dir.path(), &config, claim);
    // Hang guard only: a relay that never sends its batch fails here, however slow the machine.
    let all_held = wait_for(Duration::from_secs(60), || async { rx.count() == 20 }).await;
    if !all_held {
        gate.open();
        let _ = relay.kill();
        panic!(
            "the relay did not send its batch of 20 within 60 s ({} received)",
            rx.count()
        );
    }
    let held_since: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT now()")
        .fetch_one(&db.pool)
        .await
        .expect("now");
    let mut seen = WhileHeld {
        sessions: 0,
        holding: 0,
    };
    for _ in 0..20 {
        let (sessions, holding): (i64, i64) = sqlx::query_as(
            "SELECT count(*),
                    count(*) FILTER (WHERE state LIKE 'idle in transaction%' OR xact_start < $1)
             FROM pg_stat_activity
             WHERE datname = current_database() AND application_name = 'pgoutbox-relay'",
        )
        .bind(held_since)
        .fetch_one(&db.pool)
        .await
        .expect("pg_stat_activity");
        seen.sessions = seen.sessions.max(sessions);
        seen.holding = seen.holding.max(holding);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        db.count("published_at IS NOT NULL").await,
        0,
        "nothing settled while held"
    );
    gate.open();
    let delivered = wait_for(Duration::from_secs(60), || async {
        db.count("published_at IS NULL").await == 0
    })
    .await;
    signal(&relay, libc::SIGTERM);
    let status = relay.wait().expect("wait");
    assert!(delivered, "the batch was settled once the gate opened");
    assert!(status.success(), "{status:?}");
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_mode_holds_no_transaction_while_a_slow_destination_answers() {
    let seen = relay_sessions_while_requests_are_held("lease").await;
    assert!(seen.sessions > 0, "the relay's sessions are visible");
    assert_eq!(
        seen.holding, 0,
        "no relay session is in a transaction while the destination holds the requests"
    );
}

/// The control for the test above: the same probe does see transaction mode's claim held open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transaction_mode_is_seen_holding_its_claim_while_a_slow_destination_answers() {
    let seen = relay_sessions_while_requests_are_held("transaction").await;
    assert!(
        seen.holding >= 1,
        "the claim's transaction stays open while the destination holds the requests"
    );
}
