//! The retry scheduler: one loop for every destination's due pairs. Many destinations, each
//! failing every event once, through a pool of a few connections: every pair is retried and
//! delivered, none is lost or sent twice after its delivery, and a destination with a long
//! backlog of due pairs does not hold back another's.

mod common;

use std::collections::HashSet;
use std::time::Duration;

use common::*;
use sqlx::postgres::PgPoolOptions;

/// A receiver that fails the first request of every event with a 503, then answers `then`.
async fn failing_once(then: Reply) -> Receiver {
    Receiver::with(move |r| {
        if r.nth == 0 {
            Reply::status(503)
        } else {
            then.clone()
        }
    })
    .await
}

/// `[[destinations]]` webhook tables `d0` … `d<n-1>` on topics `t.<i>`, at `url`, with `extra`.
fn destinations(n: usize, url: &str, extra: &str) -> String {
    (0..n)
        .map(|i| {
            format!(
                "[[destinations]]\nname = \"d{i}\"\ntype = \"webhook\"\nurl = \"{url}\"\n\
                 topics = [\"t.{i}\"]\nretry_schedule = [\"100ms\"]\nbreaker = {{ failures = 0 }}\n{extra}\n"
            )
        })
        .collect()
}

#[tokio::test]
async fn forty_destinations_retry_through_a_pool_of_four_connections() {
    const LANES: usize = 40;
    const PER_LANE: usize = 5;
    let db = TestDb::migrated().await;
    // Every first request of an event fails: each (event, d<i>) pair goes to the deliveries table.
    let rx = failing_once(Reply::ok()).await;
    // An audit destination beside them makes every event a fan-out: its pairs are split.
    let config = format!(
        "database_url = \"{}\"\n[relay]\npoll_interval = \"50ms\"\n\n{}\
         [[destinations]]\nname = \"audit\"\ntype = \"null\"\n",
        db.url,
        destinations(LANES, &rx.url, "")
    );
    let mut ids = HashSet::new();
    for i in 0..LANES {
        ids.extend(db.insert_plain(PER_LANE, &format!("t.{i}")).await);
    }
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect(&db.url)
        .await
        .expect("a pool of four");
    let relay = Running::on(pool, &config);
    let all = LANES * PER_LANE;
    let delivered = wait_for(Duration::from_secs(60), || async {
        rx.delivered_ids().len() == all
    })
    .await;
    let report = relay.stop().await;
    assert!(
        delivered,
        "{} of {all} delivered ({report:?})",
        rx.delivered_ids().len()
    );
    assert_eq!(rx.delivered_ids(), ids);
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_deliveries")
        .fetch_one(&db.pool)
        .await
        .expect("count pairs");
    assert_eq!(left, 0, "every pair delivered leaves the table");
    // Each event was sent twice at most: the failure, then its delivery.
    let per_id = rx
        .log()
        .iter()
        .fold(std::collections::HashMap::new(), |mut m, r| {
            *m.entry(r.id.clone()).or_insert(0) += 1;
            m
        });
    assert!(per_id.values().all(|&n| n == 2), "{per_id:?}");
}

#[tokio::test]
async fn a_destination_with_a_backlog_of_due_pairs_does_not_hold_back_another() {
    let db = TestDb::migrated().await;
    // `slow` answers after 300 ms, `quick` at once; both failed every event once.
    let slow = failing_once(Reply::ok().delay(Duration::from_millis(300))).await;
    let quick = failing_once(Reply::ok()).await;
    let config = format!(
        "database_url = \"{}\"\n[relay]\npoll_interval = \"50ms\"\n\n\
         [[destinations]]\nname = \"slow\"\ntype = \"webhook\"\nurl = \"{}\"\ntopics = [\"t.slow\"]\n\
         retry_schedule = [\"50ms\"]\nbreaker = {{ failures = 0 }}\nconcurrency = 1\n\n\
         [[destinations]]\nname = \"quick\"\ntype = \"webhook\"\nurl = \"{}\"\ntopics = [\"t.quick\"]\n\
         retry_schedule = [\"50ms\"]\nbreaker = {{ failures = 0 }}\n\n\
         [[destinations]]\nname = \"audit\"\ntype = \"null\"\n",
        db.url, slow.url, quick.url
    );
    db.insert_plain(200, "t.slow").await;
    let quick_ids = db.insert_plain(20, "t.quick").await;
    let relay = Running::start(&db, &config);
    // The slow destination's 200 retries take a minute; the quick one's 20 are not behind them.
    let quick_done = wait_for(Duration::from_secs(20), || async {
        quick.delivered_ids().len() == quick_ids.len()
    })
    .await;
    let slow_delivered = slow.delivered_ids().len();
    relay.stop().await;
    assert!(
        quick_done,
        "the quick destination got {} of {} while the slow one got {slow_delivered}",
        quick.delivered_ids().len(),
        quick_ids.len()
    );
    assert!(
        slow_delivered < 200,
        "the slow destination's backlog was still there ({slow_delivered} delivered)"
    );
}
