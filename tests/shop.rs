//! The shop example end to end: 1,000 orders created over HTTP while the real `pgoutbox relay`
//! process is SIGKILLed and restarted twice; the consumer's balances must add up to the orders
//! exactly (redeliveries absorbed by the inbox).
#![cfg(feature = "axum")]

mod common;
#[path = "../examples/shop/services.rs"]
mod services;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use pgoutbox::webhook::axum::WebhookVerifier;
use services::{ConsumerStats, NewOrder};

const SECRET: &str = "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD";
const ORDERS: usize = 1000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn balances_equal_orders_exactly_across_relay_kills() {
    let db = TestDb::empty().await;
    services::setup(&db.pool).await.expect("setup");
    let stats = Arc::new(ConsumerStats::default());
    let verifier = WebhookVerifier::new([SECRET]).expect("secret");
    let balances = services::serve(services::balances_app(
        db.pool.clone(),
        verifier,
        stats.clone(),
    ))
    .await
    .expect("balances service");
    let shop = services::serve(services::orders_app(db.pool.clone()))
        .await
        .expect("orders service");

    let dir = scratch();
    let config = write_config(
        dir.path(),
        &webhook_config(
            &db,
            &format!("{balances}/events"),
            &format!("secret = \"{SECRET}\""),
        ),
    );
    let mut relay = spawn_relay(dir.path(), &config, "0");

    // Four clients create the orders concurrently, as a web shop's users would.
    let created = Arc::new(AtomicUsize::new(0));
    let clients: Vec<_> = (0..4)
        .map(|c| {
            let shop = shop.clone();
            let created = created.clone();
            tokio::spawn(async move {
                let http = reqwest::Client::new();
                let mut sum = 0i64;
                for i in (c..ORDERS).step_by(4) {
                    let order = NewOrder {
                        customer: format!("customer-{}", i % 7),
                        amount: 100 + (i as i64 * 37) % 900,
                    };
                    sum += order.amount;
                    let res = http
                        .post(format!("{shop}/orders"))
                        .json(&order)
                        .send()
                        .await
                        .expect("POST /orders");
                    assert_eq!(res.status(), 201);
                    created.fetch_add(1, Ordering::Relaxed);
                }
                sum
            })
        })
        .collect();

    // Kill the relay twice while orders keep coming and deliveries are under way.
    for (restart, at) in [(1, ORDERS / 3), (2, 2 * ORDERS / 3)] {
        let stats_now = stats.clone();
        let created_now = created.clone();
        assert!(
            wait_for(Duration::from_secs(30), || {
                let (applied, _) = stats_now.get();
                let ready = created_now.load(Ordering::Relaxed) >= at && applied > 0;
                async move { ready }
            })
            .await,
            "orders and deliveries progress before kill {restart}"
        );
        signal(&relay, libc::SIGKILL);
        relay.wait().expect("reap relay");
        relay = spawn_relay(dir.path(), &config, &restart.to_string());
    }

    let mut expected = 0i64;
    for c in clients {
        expected += c.await.expect("client");
    }
    let pool = db.pool.clone();
    let settled = wait_for(Duration::from_secs(40), || {
        let pool = pool.clone();
        async move {
            let (ordered, balanced) = services::totals(&pool).await.expect("totals");
            ordered == balanced
        }
    })
    .await;
    signal(&relay, libc::SIGTERM);
    relay.wait().expect("reap relay");

    let (ordered, balanced) = services::totals(&db.pool).await.expect("totals");
    assert!(
        settled,
        "balances {balanced} never reached orders {ordered}"
    );
    assert_eq!(ordered, expected);
    assert_eq!(balanced, expected, "every order counted exactly once");
    // The inbox, not the in-memory counter, is the record of what was applied.
    let (applied, duplicates) = stats.get();
    let inbox_rows: i64 =
        sqlx::query_scalar("SELECT count(*) FROM inbox WHERE consumer = 'balances'")
            .fetch_one(&db.pool)
            .await
            .expect("inbox");
    assert_eq!(inbox_rows, ORDERS as i64);
    assert_eq!(db.count("published_at IS NULL").await, 0);
    eprintln!(
        "shop: {ORDERS} orders, {applied} applied, {duplicates} duplicate deliveries absorbed"
    );
}
