//! `rate_limit`: a destination's most events a second, held across relays by the token bucket
//! they share in the database. Events over the limit wait in their lane: no attempt, never dead.
//! The rate itself is measured by `pgoutbox bench rate-limit`; here, only what no machine's
//! speed can change: a lower bound on the time the limit forces.

mod common;

use std::collections::HashSet;
use std::time::Duration;

use common::*;

/// Two relays serve a destination limited to 20 events/s (burst 5) beside one without a limit:
/// the limited one gets every event, no sooner than the shared bucket allows (a limit per relay
/// would let 40/s through), with no attempt counted and nothing dead; the other is not held back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rate_limit_holds_across_relays_and_costs_the_others_nothing() {
    let db = TestDb::migrated().await;
    let limited = Receiver::start().await;
    let free = Receiver::start().await;
    db.insert_plain(60, "order.created").await;
    let text = format!(
        "database_url = \"{}\"\n[relay]\npoll_interval = \"50ms\"\n\
         [[destinations]]\nname = \"limited\"\ntype = \"webhook\"\nurl = \"{}\"\n\
         rate_limit = {{ rate = \"20/s\", burst = 5 }}\n\
         [[destinations]]\nname = \"free\"\ntype = \"webhook\"\nurl = \"{}\"\n",
        db.url, limited.url, free.url
    );
    let relays = vec![Running::start(&db, &text), Running::start(&db, &text)];
    let done = wait_for(Duration::from_secs(60), || async {
        limited.delivered_ids().len() >= 60 && free.delivered_ids().len() >= 60
    })
    .await;
    Running::stop_all(relays).await;
    assert!(
        done,
        "limited got {}, free {}",
        limited.delivered_ids().len(),
        free.delivered_ids().len()
    );
    let ids: HashSet<String> = limited.delivered().into_iter().map(|r| r.id).collect();
    assert_eq!(ids.len(), 60, "every event reached the limited destination");

    let arrivals = |rx: &Receiver| {
        let mut at: Vec<_> = rx.delivered().into_iter().map(|r| r.at).collect();
        at.sort();
        at
    };
    let limited_at = arrivals(&limited);
    let span = *limited_at.last().expect("some") - limited_at[0];
    // 60 events, 5 at once, then 20 a second: at least 55 / 20 = 2.75 s from first to last.
    println!("limited destination: 60 events in {span:?} (the limit allows no less than 2.75 s)");
    assert!(
        span >= Duration::from_millis(2_700),
        "60 events in {span:?}: faster than 20/s shared by both relays"
    );
    let free_last = *arrivals(&free).last().expect("some");
    assert!(
        free_last < *limited_at.last().expect("some"),
        "the destination without a limit is not paced by the other's"
    );

    let failed: i64 =
        sqlx::query_scalar("SELECT count(*) FROM outbox_attempts WHERE destination = 'limited'")
            .fetch_one(&db.pool)
            .await
            .expect("attempts");
    assert_eq!(failed, 0, "waiting for a token is not an attempt");
    assert_eq!(db.count("dead_at IS NOT NULL").await, 0);
    let dead_pairs: i64 =
        sqlx::query_scalar("SELECT count(*) FROM outbox_deliveries WHERE dead_at IS NOT NULL")
            .fetch_one(&db.pool)
            .await
            .expect("pairs");
    assert_eq!(dead_pairs, 0);
    let buckets: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_rates")
        .fetch_one(&db.pool)
        .await
        .expect("buckets");
    assert_eq!(buckets, 1, "one bucket, shared");
}

/// A relay stopped while its rate-limited lane waits for tokens stops at once: what the lane had
/// not sent goes back pending (no attempt counted), instead of the batch waiting for tokens
/// until its deadline (about 20 s here) or the shutdown grace period.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_does_not_wait_for_rate_limit_tokens() {
    let db = TestDb::migrated().await;
    let rx = Receiver::start().await;
    db.insert_plain(200, "order.created").await;
    let text = format!(
        "database_url = \"{}\"\n[relay]\npoll_interval = \"50ms\"\nshutdown_grace = \"60s\"\n\
         [[destinations]]\nname = \"slow\"\ntype = \"webhook\"\nurl = \"{}\"\n\
         rate_limit = {{ rate = \"10/s\", burst = 2 }}\n",
        db.url, rx.url
    );
    let relay = Running::start(&db, &text);
    let sending = wait_for(Duration::from_secs(30), || async {
        rx.delivered_ids().len() >= 5
    })
    .await;
    assert!(sending, "the limited destination gets events");
    let stopping = std::time::Instant::now();
    relay.stop().await;
    let took = stopping.elapsed();
    println!("stopped in {took:?} (shutdown_grace 60 s)");
    assert!(
        took < Duration::from_secs(10),
        "stop took {took:?}: the batch waited for tokens"
    );
    let pending = db
        .count("published_at IS NULL AND dead_at IS NULL AND attempts = 0")
        .await;
    assert_eq!(
        pending as usize + rx.delivered_ids().len(),
        200,
        "every event delivered or pending, none attempted"
    );
}

/// `pgoutbox status` names a destination's rate limit beside its state, so a backlog held by
/// the limit is read as such.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_shows_the_rate_limit() {
    let db = TestDb::migrated().await;
    let rx = Receiver::start().await;
    db.insert_plain(1, "order.created").await;
    let text = webhook_config(&db, &rx.url, "rate_limit = { rate = \"600/m\", burst = 3 }");
    let dir = scratch();
    let config = write_config(dir.path(), &text);
    let config = config.to_str().expect("utf8");
    let (code, _, err) = run(&["relay", "--once", "--config", config]);
    assert_eq!(code, 0, "{err}");
    let (code, out, err) = run(&["status", "--config", config]);
    assert_eq!(code, 0, "{err}");
    let line = out
        .lines()
        .skip_while(|l| *l != "DESTINATIONS")
        .find(|l| l.trim_start().starts_with("hooks"))
        .unwrap_or_else(|| panic!("no DESTINATIONS line for the destination: {out}"));
    assert!(line.contains("rate limit 10/s (burst 3)"), "{line}");
}
