//! Driver adapters: an event enqueued through each driver commits with the caller's transaction
//! and is absent after its rollback; batches keep their order. One Event type, one INSERT.

mod common;

use common::*;
use pgoutbox::{Event, Outbox, TypedEvent};
use serde::Serialize;
use serde_json::json;
use uuid::Uuid;

#[derive(Serialize)]
struct OrderPaid {
    order_id: i64,
}

impl TypedEvent for OrderPaid {
    const TOPIC: &'static str = "order.paid";
    fn key(&self) -> Option<String> {
        Some(format!("order-{}", self.order_id))
    }
}

fn event(n: i64) -> Event {
    Event::new("order.created", &json!({ "n": n }))
        .expect("json")
        .key(format!("k{n}"))
        .header("x-n", n.to_string())
}

/// (topic, payload, key, headers) of a row, or None when it does not exist.
async fn row(
    db: &TestDb,
    id: Uuid,
) -> Option<(String, serde_json::Value, Option<String>, serde_json::Value)> {
    sqlx::query_as("SELECT topic, payload, key, headers FROM outbox WHERE id = $1")
        .bind(id)
        .fetch_optional(&db.pool)
        .await
        .expect("select")
}

/// The topics of `ids`, in `seq` order.
async fn seq_order(db: &TestDb, ids: &[Uuid]) -> Vec<Uuid> {
    sqlx::query_scalar("SELECT id FROM outbox WHERE id = ANY($1) ORDER BY seq")
        .bind(ids)
        .fetch_all(&db.pool)
        .await
        .expect("select")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlx08_commits_with_the_transaction_and_not_after_rollback() {
    let db = TestDb::migrated().await;
    let outbox = Outbox::default();

    let mut tx = db.pool.begin().await.expect("begin");
    let kept = outbox.enqueue(&mut tx, &event(1)).await.expect("enqueue");
    let typed = outbox
        .enqueue_typed(&mut tx, &OrderPaid { order_id: 9 })
        .await
        .expect("typed");
    let batch = outbox
        .enqueue_many(&mut tx, &[event(2), event(3), event(4)])
        .await
        .expect("batch");
    tx.commit().await.expect("commit");

    let mut tx = db.pool.begin().await.expect("begin");
    let gone = outbox.enqueue(&mut tx, &event(5)).await.expect("enqueue");
    let gone_batch = outbox
        .enqueue_many(&mut tx, &[event(6), event(7)])
        .await
        .expect("batch");
    tx.rollback().await.expect("rollback");

    let (topic, payload, key, headers) = row(&db, kept).await.expect("committed row");
    assert_eq!(
        (topic.as_str(), key.as_deref()),
        ("order.created", Some("k1"))
    );
    assert_eq!(payload, json!({"n": 1}));
    assert_eq!(headers, json!({"x-n": "1"}));
    let (topic, payload, key, _) = row(&db, typed).await.expect("typed row");
    assert_eq!(
        (topic.as_str(), key.as_deref()),
        ("order.paid", Some("order-9"))
    );
    assert_eq!(payload, json!({"order_id": 9}));
    assert_eq!(seq_order(&db, &batch).await, batch);
    assert!(row(&db, gone).await.is_none());
    for id in gone_batch {
        assert!(row(&db, id).await.is_none());
    }
    assert_eq!(db.count("true").await, 5);
}

#[cfg(feature = "sqlx09")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlx09_commits_with_the_transaction_and_not_after_rollback() {
    let db = TestDb::migrated().await;
    let outbox = Outbox::default();
    let pool = sqlx09::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(&db.url)
        .await
        .expect("connect with sqlx 0.9");

    let mut tx = pool.begin().await.expect("begin");
    sqlx09::query("CREATE TABLE orders (id int PRIMARY KEY)")
        .execute(&mut *tx)
        .await
        .expect("business write");
    let kept = outbox
        .enqueue_sqlx09(&mut tx, &event(1))
        .await
        .expect("enqueue");
    let typed = outbox
        .enqueue_sqlx09(
            &mut tx,
            &Event::typed(&OrderPaid { order_id: 9 }).expect("json"),
        )
        .await
        .expect("typed");
    let batch = outbox
        .enqueue_many_sqlx09(&mut tx, &[event(2), event(3), event(4)])
        .await
        .expect("batch");
    tx.commit().await.expect("commit");

    let mut tx = pool.begin().await.expect("begin");
    let gone = outbox
        .enqueue_sqlx09(&mut tx, &event(5))
        .await
        .expect("enqueue");
    let gone_batch = outbox
        .enqueue_many_sqlx09(&mut tx, &[event(6), event(7)])
        .await
        .expect("batch");
    tx.rollback().await.expect("rollback");

    let (_, payload, key, headers) = row(&db, kept).await.expect("committed row");
    assert_eq!(payload, json!({"n": 1}));
    assert_eq!(key.as_deref(), Some("k1"));
    assert_eq!(headers, json!({"x-n": "1"}));
    assert_eq!(row(&db, typed).await.expect("typed").0, "order.paid");
    assert_eq!(seq_order(&db, &batch).await, batch);
    assert!(row(&db, gone).await.is_none());
    for id in gone_batch {
        assert!(row(&db, id).await.is_none());
    }
    assert_eq!(db.count("true").await, 5);
}

#[cfg(feature = "tokio-postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokio_postgres_commits_with_the_transaction_and_not_after_rollback() {
    let db = TestDb::migrated().await;
    let outbox = Outbox::default();
    let (mut client, connection) = tokio_postgres::connect(&db.url, tokio_postgres::NoTls)
        .await
        .expect("connect with tokio-postgres");
    tokio::spawn(connection);

    let tx = client.transaction().await.expect("begin");
    let kept = outbox.enqueue_pg(&tx, &event(1)).await.expect("enqueue");
    let typed = outbox
        .enqueue_pg(
            &tx,
            &Event::typed(&OrderPaid { order_id: 9 }).expect("json"),
        )
        .await
        .expect("typed");
    let batch = outbox
        .enqueue_many_pg(&tx, &[event(2), event(3), event(4)])
        .await
        .expect("batch");
    tx.commit().await.expect("commit");

    let tx = client.transaction().await.expect("begin");
    let gone = outbox.enqueue_pg(&tx, &event(5)).await.expect("enqueue");
    let gone_batch = outbox
        .enqueue_many_pg(&tx, &[event(6), event(7)])
        .await
        .expect("batch");
    tx.rollback().await.expect("rollback");

    // A plain Client (autocommit) is a GenericClient too.
    let auto = outbox
        .enqueue_pg(&client, &event(8))
        .await
        .expect("autocommit");

    let (_, payload, key, headers) = row(&db, kept).await.expect("committed row");
    assert_eq!(payload, json!({"n": 1}));
    assert_eq!(key.as_deref(), Some("k1"));
    assert_eq!(headers, json!({"x-n": "1"}));
    assert_eq!(row(&db, typed).await.expect("typed").0, "order.paid");
    assert_eq!(seq_order(&db, &batch).await, batch);
    assert!(row(&db, auto).await.is_some());
    assert!(row(&db, gone).await.is_none());
    for id in gone_batch {
        assert!(row(&db, id).await.is_none());
    }
    assert_eq!(db.count("true").await, 6);
}
