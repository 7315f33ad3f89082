//! `history = "partitions"`: delivered events move to the partitioned history, stay visible to
//! status and inspect, and cleanup drops whole partitions once past retention.

mod common;

use std::time::Duration;

use common::*;
use pgoutbox::store::inspect::{EventQuery, EventState};
use pgoutbox::OutboxTable;

/// Rows of the history (all partitions) matching a WHERE clause.
async fn history_count(db: &TestDb, where_clause: &str) -> i64 {
    sqlx::query_scalar(&format!(
        "SELECT count(*) FROM outbox_history WHERE {where_clause}"
    ))
    .fetch_one(&db.pool)
    .await
    .expect("count history")
}

/// The history's partitions, by name.
async fn partition_names(db: &TestDb) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
         WHERE i.inhparent = 'outbox_history'::regclass ORDER BY 1",
    )
    .fetch_all(&db.pool)
    .await
    .expect("partitions")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delivered_events_move_to_the_history_and_stay_visible() {
    let db = TestDb::migrated().await;
    let rx = Receiver::start().await;
    // "audit" also wants order.* events: those are split (one pair per destination) and their
    // event row moves with no destination; user.* events go to "hooks" alone, invoice.* ones to
    // "billing" alone.
    let text = webhook_config(&db, &rx.url, "topics = [\"user.*\", \"order.*\"]")
        .replace(
            "[relay]\n",
            "retention = \"1h\"\nhistory = \"partitions\"\n[relay]\n",
        )
        + &format!(
            "\n[[destinations]]\nname = \"audit\"\ntype = \"webhook\"\nurl = \"{}\"\ntopics = [\"order.*\"]\n",
            rx.url
        )
        + &format!(
            "\n[[destinations]]\nname = \"billing\"\ntype = \"webhook\"\nurl = \"{}\"\ntopics = [\"invoice.*\"]\n",
            rx.url
        );
    let users = db.insert_plain(30, "user.signed_up").await;
    let orders = db.insert_plain(10, "order.created").await;
    db.insert_plain(5, "invoice.paid").await;
    let relay = Running::start(&db, &text);
    let moved = wait_for(Duration::from_secs(60), || async {
        db.count("true").await == 0 && history_count(&db, "true").await == 45
    })
    .await;
    relay.stop().await;
    assert!(moved, "every event left the outbox for the history");
    assert_eq!(rx.delivered_ids().len(), 45, "each event delivered");
    // A batch that spans destinations moves its rows in one statement, each with its own.
    assert_eq!(
        history_count(&db, "destination = 'billing' AND topic = 'invoice.paid'").await,
        5
    );
    assert_eq!(
        history_count(&db, "destination = 'hooks' AND topic = 'user.signed_up'").await,
        30
    );
    assert_eq!(
        history_count(&db, "destination IS NULL AND topic = 'order.created'").await,
        10,
        "split events move with no destination"
    );
    let partitions = partition_names(&db).await;
    assert!(
        partitions.iter().any(|p| p.starts_with("outbox_h")),
        "the relay created partitions ahead of the clock: {partitions:?}"
    );
    assert_eq!(
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM outbox_history_default")
            .fetch_one(&db.pool)
            .await
            .expect("default"),
        0,
        "nothing fell into the default partition"
    );

    let table = OutboxTable::default_table();
    let store = pgoutbox::store::Store::new(db.pool.clone(), table.clone());
    let status = pgoutbox::status::read(&store, None).await.expect("status");
    assert_eq!(status.totals.published_retained, 45);
    assert_eq!(status.totals.published_last_minute, 45);

    let page = pgoutbox::store::inspect::search(
        &store,
        &EventQuery {
            state: EventState::Published,
            topic: Some("user.signed_up".into()),
            limit: 100,
            ..EventQuery::default()
        },
    )
    .await
    .expect("search");
    assert_eq!(page.events.len(), 30, "search finds moved events");
    assert!(page.events.iter().all(|e| e.state == "published"));

    let id = users[0].parse().expect("uuid");
    let shown = pgoutbox::store::inspect::show(&store, id)
        .await
        .expect("show")
        .expect("a moved event is still shown");
    assert_eq!(shown.topic.as_deref(), Some("user.signed_up"));
    assert!(shown
        .deliveries
        .iter()
        .any(|d| d.state == "published" && d.destination.as_deref() == Some("hooks")));
    let split = pgoutbox::store::inspect::show(&store, orders[0].parse().expect("uuid"))
        .await
        .expect("show")
        .expect("a split event is still shown");
    assert!(
        split.deliveries.iter().any(|d| d.state == "split"),
        "its event row, moved: {:?}",
        split.deliveries
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cleanup_drops_expired_partitions_whole() {
    let db = TestDb::migrated().await;
    let table = OutboxTable::default_table();
    let store = pgoutbox::store::Store::new(db.pool.clone(), table.clone());
    let retention = Duration::from_secs(3600);
    // A partition from long ago (as an earlier run would have left it), with a row in it, and an
    // expired row that fell into the default partition.
    sqlx::raw_sql(
        "CREATE TABLE outbox_h202601010000_15 PARTITION OF outbox_history
             FOR VALUES FROM ('2026-01-01 00:00+00') TO ('2026-01-01 00:15+00');
         INSERT INTO outbox_history (id, seq, topic, payload, created_at, published_at)
         VALUES (gen_random_uuid(), 1, 'old', '{}', '2026-01-01 00:01+00', '2026-01-01 00:02+00'),
                (gen_random_uuid(), 2, 'stray', '{}', '2025-06-01 00:00+00', '2025-06-01 00:00+00');
         CREATE TABLE outbox_history_archive (LIKE outbox_history);",
    )
    .execute(&db.pool)
    .await
    .expect("old partition");
    // A row newer than any partition in the default partition: new partitions start after it
    // (one over it could not be attached).
    sqlx::query(
        "INSERT INTO outbox_history (id, seq, topic, payload, created_at, published_at)
         VALUES (gen_random_uuid(), 3, 'early', '{}', now(), now() + interval '20 minutes')",
    )
    .execute(&db.pool)
    .await
    .expect("default row");

    let created = pgoutbox::store::history::ensure(&store, retention, retention)
        .await
        .expect("ensure");
    assert!(created > 0);
    assert_eq!(
        pgoutbox::store::history::ensure(&store, retention, retention)
            .await
            .expect("ensure again"),
        0,
        "idempotent"
    );
    let mut conn = db.pool.acquire().await.expect("conn");
    let parts = pgoutbox::store::history::partitions(&store, &mut conn)
        .await
        .expect("partitions");
    drop(conn);
    let newest: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT max(published_at) FROM outbox_history_default")
            .fetch_one(&db.pool)
            .await
            .expect("newest");
    assert!(
        parts
            .iter()
            .filter(|p| p.name != "outbox_h202601010000_15")
            .all(|p| p.start > newest),
        "new partitions start after the default partition's newest row: {parts:?}"
    );

    let options = pgoutbox::store::cleanup::CleanupOptions {
        retention,
        dead_retention: None,
        attempts_retention: Duration::from_secs(7 * 86_400),
        chunk_rows: 5,
        dry_run: true,
    };
    let dry = pgoutbox::store::cleanup::run(&store, &options, |_| {})
        .await
        .expect("dry run");
    assert_eq!(dry.dropped_partitions, 1);
    assert_eq!(
        history_count(&db, "topic = 'old'").await,
        1,
        "a dry run drops nothing"
    );

    let report = pgoutbox::store::cleanup::run(
        &store,
        &pgoutbox::store::cleanup::CleanupOptions {
            dry_run: false,
            ..options
        },
        |_| {},
    )
    .await
    .expect("cleanup");
    assert_eq!(report.dropped_partitions, 1, "the expired partition");
    assert_eq!(report.deleted_published, 1, "the expired default row");
    let names = partition_names(&db).await;
    assert!(!names.contains(&"outbox_h202601010000_15".to_owned()));
    assert_eq!(
        names.len(),
        parts.len(),
        "current partitions kept: {names:?}"
    );
    assert_eq!(
        history_count(&db, "topic IN ('old', 'stray')").await,
        0,
        "expired rows gone"
    );
    assert_eq!(history_count(&db, "topic = 'early'").await, 1, "kept");
    let archive: bool =
        sqlx::query_scalar("SELECT to_regclass('outbox_history_archive') IS NOT NULL")
            .fetch_one(&db.pool)
            .await
            .expect("archive");
    assert!(
        archive,
        "a table not named as a partition of ours is never dropped"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_least_privilege_relay_settles_into_the_default_partition_until_the_owner_runs_cleanup() {
    let db = TestDb::migrated().await;
    let role = relay_role(&db, "pgoutbox_hist").await;

    let rx = Receiver::start().await;
    let dir = scratch();
    let owner = webhook_config(&db, &rx.url, "").replace(
        "[relay]\n",
        "retention = \"1h\"\nhistory = \"partitions\"\n[relay]\n",
    );
    let relay_url = db.url.replacen("postgres@", &format!("{role}@"), 1);
    let owner_config = write_config(dir.path(), &owner);
    let relay_dir = scratch();
    let relay_config = write_config(relay_dir.path(), &owner.replace(&db.url, &relay_url));
    let (owner_config, relay_config) = (
        owner_config.to_str().expect("utf8"),
        relay_config.to_str().expect("utf8"),
    );

    // The relay's role may not create partitions: it says so, and still delivers and settles.
    db.insert_plain(20, "order.created").await;
    let (code, _, err) = run(&["relay", "--once", "--config", relay_config]);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("cannot create the history's next partitions") && err.contains("cleanup"),
        "{err}"
    );
    assert_eq!(rx.delivered_ids().len(), 20);
    assert_eq!(db.count("true").await, 0);
    let in_default = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM outbox_history_default")
            .fetch_one(&db.pool)
            .await
            .expect("default")
    };
    assert_eq!(in_default().await, 20, "settled into the default partition");

    // The owner's cleanup makes partitions ahead (starting after the default partition's newest
    // row: here a few minutes old, as after a relay that ran so for a while); the next settles
    // land in them.
    sqlx::query("UPDATE outbox_history SET published_at = published_at - interval '3 minutes'")
        .execute(&db.pool)
        .await
        .expect("age the default rows");
    let (code, out, err) = run(&["cleanup", "--config", owner_config]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("partitions of the published history created ahead"),
        "{out}"
    );
    db.insert_plain(10, "order.created").await;
    let (code, _, err) = run(&["relay", "--once", "--config", relay_config]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(rx.delivered_ids().len(), 30);
    assert_eq!(
        in_default().await,
        20,
        "the new settles went to a partition"
    );
    assert_eq!(history_count(&db, "true").await, 30);

    drop_role(db, &role).await;
}
