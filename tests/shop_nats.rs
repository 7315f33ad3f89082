//! The shop's NATS consumer against the real local NATS JetStream (127.0.0.1:4222), with
//! messages published per the NATS sink's contract: subject = topic, `Nats-Msg-Id` = event id,
//! payload = the envelope. Events whose effect was committed by an earlier consumer run that died
//! before acknowledging are redelivered and must not be applied twice.
#![cfg(all(feature = "axum", feature = "nats"))]

mod common;
#[path = "../examples/shop/nats.rs"]
mod nats;
#[path = "../examples/shop/services.rs"]
mod services;

use std::sync::Arc;

use common::*;
use serde_json::json;
use services::{ConsumerStats, OrderCreated};
use uuid::Uuid;

const EVENTS: usize = 50;
const COMMITTED_BEFORE_CRASH: usize = 10;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_consumer_applies_each_event_once() {
    let db = TestDb::empty().await;
    services::setup(&db.pool).await.expect("setup");
    // A stream and subject of this test's own, so parallel runs and other streams never overlap.
    let tag = Uuid::new_v4().simple().to_string();
    let stream = format!("SHOP_TEST_{tag}");
    let subject = format!("t{tag}.order.created");

    let client = async_nats::connect("127.0.0.1:4222")
        .await
        .expect("NATS on 127.0.0.1:4222");
    let js = async_nats::jetstream::new(client);
    js.get_or_create_stream(async_nats::jetstream::stream::Config {
        name: stream.clone(),
        subjects: vec![subject.clone()],
        ..Default::default()
    })
    .await
    .expect("stream");

    let earlier_run = ConsumerStats::default();
    let mut expected = 0;
    for i in 0..EVENTS {
        let id = Uuid::new_v4();
        let order = OrderCreated {
            order_id: i as i64,
            customer: format!("c{}", i % 3),
            amount: 10 + i as i64,
        };
        expected += order.amount;
        if i < COMMITTED_BEFORE_CRASH {
            // An earlier consumer applied these and died before its ack.
            assert!(
                services::apply_order_created(&db.pool, id, &order, &earlier_run)
                    .await
                    .expect("apply")
            );
        }
        let envelope = json!({
            "id": id, "type": "order.created", "timestamp": "2026-11-30T12:00:00Z",
            "key": order.customer, "data": order,
        });
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Msg-Id", id.to_string().as_str());
        js.publish_with_headers(
            subject.clone(),
            headers,
            serde_json::to_vec(&envelope).expect("json").into(),
        )
        .await
        .expect("publish")
        .await
        .expect("stored");
    }

    let stats = Arc::new(ConsumerStats::default());
    nats::consume(
        "127.0.0.1:4222",
        &stream,
        &subject,
        db.pool.clone(),
        stats.clone(),
        Some(EVENTS),
    )
    .await
    .expect("consume");
    let _ = js.delete_stream(&stream).await;

    let (ordered, balanced) = services::totals(&db.pool).await.expect("totals");
    assert_eq!(ordered, 0, "this test creates no order rows");
    let balanced_expected: i64 = expected;
    assert_eq!(
        balanced, balanced_expected,
        "each event applied exactly once"
    );
    assert_eq!(
        stats.get(),
        (
            (EVENTS - COMMITTED_BEFORE_CRASH) as u64,
            COMMITTED_BEFORE_CRASH as u64
        )
    );
}
