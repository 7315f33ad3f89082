//! The inbox: one effect per event, whatever the redeliveries, concurrency and crashes.

mod common;

use std::time::Duration;

use common::*;
use pgoutbox::inbox::{Inbox, InboxTable};
use sqlx::PgPool;
use uuid::Uuid;

async fn inbox_db() -> TestDb {
    let db = TestDb::empty().await;
    pgoutbox::inbox::migrate(&db.pool, &InboxTable::default_table())
        .await
        .expect("migrate inbox");
    let mut conn = db.pool.acquire().await.expect("conn");
    sqlx::raw_sql(
        "CREATE TABLE balances (customer text PRIMARY KEY, total bigint NOT NULL);
         INSERT INTO balances VALUES ('acme', 0);",
    )
    .execute(&mut *conn)
    .await
    .expect("app table");
    db
}

async fn balance(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT total FROM balances WHERE customer = 'acme'")
        .fetch_one(pool)
        .await
        .expect("balance")
}

/// The consumer's handler: dedupe, apply, (pause to widen the race), commit.
async fn deliver(pool: PgPool, event_id: Uuid, amount: i64) -> bool {
    let inbox = Inbox::default();
    let mut tx = pool.begin().await.expect("begin");
    let first = inbox
        .process_once(&mut tx, "billing", event_id)
        .await
        .expect("process_once");
    if first {
        sqlx::query("UPDATE balances SET total = total + $1 WHERE customer = 'acme'")
            .bind(amount)
            .execute(&mut *tx)
            .await
            .expect("effect");
        // Keeps the transaction open while the other deliveries arrive.
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tx.commit().await.expect("commit");
    first
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_concurrent_deliveries_apply_the_effect_once() {
    let db = inbox_db().await;
    let event_id = Uuid::new_v4();
    let tasks: Vec<_> = (0..5)
        .map(|_| tokio::spawn(deliver(db.pool.clone(), event_id, 10)))
        .collect();
    let mut firsts = 0;
    for t in tasks {
        firsts += usize::from(t.await.expect("task"));
    }
    assert_eq!(firsts, 1, "exactly one delivery is the first");
    assert_eq!(balance(&db.pool).await, 10);

    // Later redeliveries are duplicates; another consumer of the same event is not.
    assert!(!deliver(db.pool.clone(), event_id, 10).await);
    let mut tx = db.pool.begin().await.expect("begin");
    assert!(Inbox::default()
        .process_once(&mut tx, "shipping", event_id)
        .await
        .expect("other consumer"));
    tx.rollback().await.expect("rollback");
    assert_eq!(balance(&db.pool).await, 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_before_commit_is_reapplied_on_redelivery() {
    let db = inbox_db().await;
    let inbox = Inbox::default();
    let event_id = Uuid::new_v4();

    // Crash 1: the effect is written, then the transaction is dropped without commit.
    {
        let mut tx = db.pool.begin().await.expect("begin");
        assert!(inbox
            .process_once(&mut tx, "billing", event_id)
            .await
            .expect("first"));
        sqlx::query("UPDATE balances SET total = total + 10 WHERE customer = 'acme'")
            .execute(&mut *tx)
            .await
            .expect("effect");
    }
    assert_eq!(
        balance(&db.pool).await,
        0,
        "nothing of the dropped transaction remains"
    );

    // Crash 2: the consumer's connection is killed after the effect, while a redelivery is
    // already waiting on the inbox key; the redelivery takes over and applies it.
    let mut crashing = db.pool.acquire().await.expect("conn");
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *crashing)
        .await
        .expect("pid");
    sqlx::query("BEGIN")
        .execute(&mut *crashing)
        .await
        .expect("begin");
    assert!(inbox
        .process_once(&mut crashing, "billing", event_id)
        .await
        .expect("first again"));
    sqlx::query("UPDATE balances SET total = total + 10 WHERE customer = 'acme'")
        .execute(&mut *crashing)
        .await
        .expect("effect");
    let redelivery = tokio::spawn(deliver(db.pool.clone(), event_id, 10));
    // The redelivery blocks on the uncommitted inbox key until the crash.
    let blocked = wait_for(Duration::from_secs(10), || async {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .fetch_one(&db.pool)
        .await
        .expect("locks");
        waiting > 0
    })
    .await;
    assert!(blocked, "the redelivery waits for the first transaction");
    assert!(!redelivery.is_finished());
    let killed: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .fetch_one(&db.pool)
        .await
        .expect("terminate");
    assert!(killed);
    drop(crashing);
    assert!(redelivery.await.expect("task"), "the redelivery applies it");
    assert_eq!(balance(&db.pool).await, 10);

    // And from then on it is a duplicate.
    assert!(!deliver(db.pool.clone(), event_id, 10).await);
    assert_eq!(balance(&db.pool).await, 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cleanup_deletes_only_expired_rows_in_bounded_batches() {
    let db = inbox_db().await;
    sqlx::query(
        "INSERT INTO inbox (consumer, event_id, processed_at)
         SELECT 'billing', gen_random_uuid(), now() - interval '10 days' FROM generate_series(1, 25)",
    )
    .execute(&db.pool)
    .await
    .expect("old rows");
    let fresh = Uuid::new_v4();
    let mut tx = db.pool.begin().await.expect("begin");
    assert!(Inbox::default()
        .process_once(&mut tx, "billing", fresh)
        .await
        .expect("fresh"));
    tx.commit().await.expect("commit");

    let mut conn = db.pool.acquire().await.expect("conn");
    let report = Inbox::default()
        .cleanup(&mut conn, Duration::from_secs(7 * 86_400), 10)
        .await
        .expect("cleanup");
    assert_eq!(report.deleted, 25);
    assert_eq!(report.batches, 3);
    let left: Vec<Uuid> = sqlx::query_scalar("SELECT event_id FROM inbox")
        .fetch_all(&db.pool)
        .await
        .expect("left");
    assert_eq!(left, vec![fresh]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cleanup_inbox_from_the_cli() {
    let db = inbox_db().await;
    sqlx::query(
        "INSERT INTO inbox (consumer, event_id, processed_at)
         SELECT 'billing', gen_random_uuid(), now() - interval '10 days' FROM generate_series(1, 30)
         UNION ALL SELECT 'billing', gen_random_uuid(), now() FROM generate_series(1, 4)",
    )
    .execute(&db.pool)
    .await
    .expect("rows");
    let (code, _, err) = run(&["cleanup", "--inbox", "--database-url", &db.url]);
    assert_eq!(code, 2, "--inbox without --retention is refused: {err}");
    assert!(err.contains("--retention"), "{err}");
    let (code, out, err) = run(&[
        "cleanup",
        "--inbox",
        "--retention",
        "7d",
        "--batch-rows",
        "10",
        "--database-url",
        &db.url,
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("30 rows of public.inbox processed more than 7days ago deleted in 4 batches"),
        "{out}"
    );
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM inbox")
        .fetch_one(&db.pool)
        .await
        .expect("count");
    assert_eq!(left, 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_inbox_from_the_cli_is_versioned_and_idempotent() {
    let db = TestDb::empty().await;
    let (code, out, err) = run(&[
        "migrate",
        "--inbox",
        "--inbox-table",
        "seen",
        "--schema",
        "app",
        "--database-url",
        &db.url,
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("migrated app.seen to schema version 1"),
        "{out}"
    );
    let (code, out, err) = run(&[
        "migrate",
        "--inbox",
        "--inbox-table",
        "seen",
        "--schema",
        "app",
        "--database-url",
        &db.url,
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("app.seen is up to date (schema version 1)"),
        "{out}"
    );
    let versions: Vec<(String, i32)> =
        sqlx::query_as("SELECT table_name, version FROM app.pgoutbox_migrations ORDER BY 1, 2")
            .fetch_all(&db.pool)
            .await
            .expect("registry");
    assert_eq!(versions, vec![("inbox:seen".to_owned(), 1)]);

    // The inbox and an outbox share the registry without mixing their versions.
    let (code, _, err) = run(&["migrate", "--schema", "app", "--database-url", &db.url]);
    assert_eq!(code, 0, "{err}");
    let inbox = Inbox::new(InboxTable::parse("app", "seen").expect("valid"));
    let mut tx = db.pool.begin().await.expect("begin");
    assert!(inbox
        .process_once(&mut tx, "c", Uuid::new_v4())
        .await
        .expect("insert"));
    tx.commit().await.expect("commit");

    let (code, _, err) = run(&[
        "migrate",
        "--inbox",
        "--inbox-table",
        "bad-name",
        "--database-url",
        &db.url,
    ]);
    assert_eq!(code, 1);
    assert!(err.contains("invalid SQL identifier"), "{err}");
}

#[cfg(feature = "sqlx09")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn process_once_with_sqlx09_dedupes_and_rolls_back_with_the_transaction() {
    let db = inbox_db().await;
    let pool = sqlx09::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(&db.url)
        .await
        .expect("connect with sqlx 0.9");
    let inbox = Inbox::default();
    let (kept, rolled_back) = (Uuid::new_v4(), Uuid::new_v4());

    let mut tx = pool.begin().await.expect("begin");
    assert!(inbox
        .process_once_sqlx09(&mut tx, "billing", kept)
        .await
        .expect("first"));
    tx.commit().await.expect("commit");
    let mut tx = pool.begin().await.expect("begin");
    assert!(
        !inbox
            .process_once_sqlx09(&mut tx, "billing", kept)
            .await
            .expect("again"),
        "a duplicate is reported as such"
    );
    assert!(inbox
        .process_once_sqlx09(&mut tx, "billing", rolled_back)
        .await
        .expect("other"));
    tx.rollback().await.expect("rollback");

    let ids: Vec<Uuid> = sqlx::query_scalar("SELECT event_id FROM inbox")
        .fetch_all(&db.pool)
        .await
        .expect("ids");
    assert_eq!(
        ids,
        vec![kept],
        "the rolled-back record is gone, to be applied again"
    );
}
