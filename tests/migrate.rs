//! Online `migrate`: upgrading a minimal outbox table in place while producers insert, resuming
//! after an interruption at any point, running twice or concurrently, and leaving tables that an
//! earlier pgoutbox migrated alone. Durations are never asserted (`pgoutbox bench migrate`
//! measures the producers' stalls).

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use pgoutbox::schema::{migrate, CURRENT_VERSION};
use pgoutbox::OutboxTable;
use sqlx::{Connection, PgConnection, PgPool};
use uuid::Uuid;

/// Fills the table with `n` old rows: created a second apart in threes (ties, which the id
/// breaks), one in ten pending, stored in random order (so the physical order is not the
/// creation order). Returns their ids in creation order.
async fn old_rows(pool: &PgPool, n: i32) -> Vec<Uuid> {
    sqlx::query(
        "INSERT INTO outbox (topic, payload, created_at, published_at, attempts, last_error)
         SELECT 'old', jsonb_build_object('n', g), t,
                CASE WHEN g % 10 <> 0 THEN t + interval '1 minute' END,
                CASE WHEN g % 10 = 0 THEN 2 ELSE 0 END,
                CASE WHEN g % 10 = 0 THEN 'timeout' END
         FROM (SELECT g, now() - interval '1 day' + (g / 3) * interval '1 second' AS t
               FROM generate_series(1, $1) g) s
         ORDER BY random()",
    )
    .bind(n)
    .execute(pool)
    .await
    .expect("old rows");
    sqlx::query_scalar("SELECT id FROM outbox WHERE topic = 'old' ORDER BY created_at, id")
        .fetch_all(pool)
        .await
        .expect("old ids")
}

async fn minimal_table(db: &TestDb, n: i32) -> Vec<Uuid> {
    sqlx::raw_sql(MINIMAL_OUTBOX)
        .execute(&db.pool)
        .await
        .expect("minimal table");
    old_rows(&db.pool, n).await
}

/// Single-row INSERTs in a loop, each its own transaction, from connections of their own.
struct Producers {
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<Result<Vec<Uuid>, sqlx::Error>>>,
}

impl Producers {
    async fn start(db: &TestDb, n: usize) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let mut tasks = Vec::new();
        for _ in 0..n {
            let mut conn = PgConnection::connect(&db.url).await.expect("producer");
            let stop = stop.clone();
            tasks.push(tokio::spawn(async move {
                let mut ids = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    let id: Uuid = sqlx::query_scalar(
                        "INSERT INTO outbox (topic, payload) VALUES ('new', '{\"n\": 0}') RETURNING id",
                    )
                    .fetch_one(&mut conn)
                    .await?;
                    ids.push(id);
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                Ok(ids)
            }));
        }
        // Some inserts before migrate starts.
        tokio::time::sleep(Duration::from_millis(50)).await;
        Self { stop, tasks }
    }

    /// Stops them after a few more inserts; every insert must have succeeded.
    async fn stop(self) -> Vec<Uuid> {
        tokio::time::sleep(Duration::from_millis(50)).await;
        self.stop.store(true, Ordering::Relaxed);
        let mut all = Vec::new();
        for t in self.tasks {
            all.extend(
                t.await
                    .expect("producer task")
                    .expect("every INSERT succeeded"),
            );
        }
        all
    }
}

/// The table's shape as the catalogs describe it: columns (type, nullability, identity, default),
/// constraints, indexes (definition, validity) and the identity's sequence settings, with the
/// schema name taken out so that two schemas compare.
async fn shape(pool: &PgPool, schema: &str) -> Vec<String> {
    let table = format!("{schema}.outbox");
    let mut lines: Vec<String> = sqlx::query_scalar(
        "SELECT format('column %s %s not_null=%s identity=%s default=%s', a.attname,
                       format_type(a.atttypid, a.atttypmod), a.attnotnull, a.attidentity,
                       pg_get_expr(d.adbin, d.adrelid))
         FROM pg_attribute a LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
         WHERE a.attrelid = $1::regclass AND a.attnum > 0 AND NOT a.attisdropped
         ORDER BY a.attnum",
    )
    .bind(&table)
    .fetch_all(pool)
    .await
    .expect("columns");
    let more: Vec<String> = sqlx::query_scalar(
        // PostgreSQL 18 records NOT NULL as constraints, under generated names that depend on
        // the order columns were made NOT NULL: the column lines above already say which are.
        "SELECT format('constraint %s %s', conname, pg_get_constraintdef(oid))
         FROM pg_constraint WHERE conrelid = $1::regclass AND contype <> 'n'
         UNION ALL
         SELECT format('index %s valid=%s', pg_get_indexdef(indexrelid), indisvalid)
         FROM pg_index WHERE indrelid = $1::regclass
         UNION ALL
         SELECT format('sequence %s start=%s increment=%s min=%s cache=%s', c.relname, seqstart,
                       seqincrement, seqmin, seqcache)
         FROM pg_sequence s JOIN pg_class c ON c.oid = s.seqrelid
         WHERE c.relnamespace = $2::regnamespace
           -- The outbox's own (seq); other tables of the schema have theirs.
           AND c.oid IN (SELECT objid FROM pg_depend
                         WHERE refobjid = $1::regclass AND classid = 'pg_class'::regclass)
         ORDER BY 1",
    )
    .bind(&table)
    .bind(schema)
    .fetch_all(pool)
    .await
    .expect("constraints and indexes");
    lines.extend(more);
    lines
        .into_iter()
        .map(|l| l.replace(&format!("{schema}."), "SCHEMA."))
        .collect()
}

/// The shape of a table freshly created by `migrate`, in its own schema of the same database.
async fn fresh_shape(db: &TestDb) -> Vec<String> {
    let fresh = OutboxTable::parse("fresh", "outbox").expect("valid");
    migrate(&db.pool, &fresh).await.expect("fresh install");
    shape(&db.pool, "fresh").await
}

/// Everything an upgrade must leave: every row, old rows numbered in creation order before every
/// new row, pending old rows due from their creation time, the fresh table's exact shape.
async fn assert_upgraded(db: &TestDb, old: &[Uuid], new: &[Uuid]) {
    let total: i64 = db.count("true").await;
    assert_eq!(
        total as usize,
        old.len() + new.len(),
        "no row lost or added"
    );
    let by_seq: Vec<Uuid> =
        sqlx::query_scalar("SELECT id FROM outbox WHERE topic = 'old' ORDER BY seq")
            .fetch_all(&db.pool)
            .await
            .expect("old by seq");
    assert_eq!(by_seq, old, "old rows keep their creation order in seq");
    let new_by_seq: Vec<Uuid> =
        sqlx::query_scalar("SELECT id FROM outbox WHERE topic = 'new' ORDER BY seq")
            .fetch_all(&db.pool)
            .await
            .expect("new by seq");
    let mut new_sorted = new.to_vec();
    new_sorted.sort();
    let mut found = new_by_seq.clone();
    found.sort();
    assert_eq!(found, new_sorted, "every concurrent insert is there");
    let (old_max, new_min): (Option<i64>, Option<i64>) = sqlx::query_as(
        "SELECT max(seq) FILTER (WHERE topic = 'old'), min(seq) FILTER (WHERE topic = 'new') FROM outbox",
    )
    .fetch_one(&db.pool)
    .await
    .expect("seq bounds");
    if let (Some(old_max), Some(new_min)) = (old_max, new_min) {
        assert!(
            old_max < new_min,
            "old rows before new ones: {old_max} vs {new_min}"
        );
    }
    assert_eq!(
        db.count("topic = 'old' AND published_at IS NULL AND next_attempt_at <> created_at")
            .await,
        0,
        "pending old rows are due from their creation time"
    );
    let invalid: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_index WHERE indrelid = 'public.outbox'::regclass AND NOT indisvalid",
    )
    .fetch_one(&db.pool)
    .await
    .expect("invalid indexes");
    assert_eq!(invalid, 0, "every index valid");
    assert_eq!(
        shape(&db.pool, "public").await,
        fresh_shape(db).await,
        "the upgraded table has exactly the shape of a fresh one"
    );
    let versions: Vec<i32> = sqlx::query_scalar(
        "SELECT version FROM pgoutbox_migrations WHERE table_name = 'outbox' ORDER BY version",
    )
    .fetch_all(&db.pool)
    .await
    .expect("registry");
    assert_eq!(versions, (1..=CURRENT_VERSION).collect::<Vec<_>>());
    // GENERATED ALWAYS: producers never give seq, and cannot.
    let explicit = sqlx::query("INSERT INTO outbox (topic, payload, seq) VALUES ('x', '{}', 1)")
        .execute(&db.pool)
        .await;
    assert!(explicit.is_err(), "seq is generated always");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upgrade_in_place_while_producers_insert() {
    let db = TestDb::empty().await;
    let old = minimal_table(&db, 20_000).await;
    let producers = Producers::start(&db, 3).await;
    let report = migrate(&db.pool, &OutboxTable::default_table())
        .await
        .expect("migrate");
    let new = producers.stop().await;
    assert_eq!(report.applied.len(), CURRENT_VERSION as usize, "{report:?}");
    assert!(!new.is_empty());
    assert_upgraded(&db, &old, &new).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_killed_at_any_point_resumes_on_the_next_run() {
    let db = TestDb::empty().await;
    let old = minimal_table(&db, 10_000).await;
    let producers = Producers::start(&db, 1).await;
    // Each run is dropped (its connection closed) after a longer time than the one before,
    // until one finishes: the runs stop at many different points of the upgrade.
    let table = OutboxTable::default_table();
    let mut budget = Duration::ZERO;
    let mut interrupted = 0;
    loop {
        match tokio::time::timeout(budget, migrate(&db.pool, &table)).await {
            Ok(report) => {
                report.expect("migrate");
                break;
            }
            Err(_) => interrupted += 1,
        }
        budget = budget * 3 / 2 + Duration::from_millis(5);
    }
    let new = producers.stop().await;
    assert!(interrupted > 0);
    assert_upgraded(&db, &old, &new).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_index_left_by_an_interrupted_build_is_rebuilt() {
    let db = TestDb::empty().await;
    let old = minimal_table(&db, 1_000).await;
    // A failed concurrent build leaves its index behind, INVALID: here under the name of the
    // claim index, with another definition.
    let failed =
        sqlx::query("CREATE UNIQUE INDEX CONCURRENTLY outbox_pending_idx ON outbox (topic)")
            .execute(&db.pool)
            .await;
    assert!(failed.is_err(), "duplicate topics: the build fails");
    let valid: bool = sqlx::query_scalar(
        "SELECT indisvalid FROM pg_index WHERE indexrelid = 'outbox_pending_idx'::regclass",
    )
    .fetch_one(&db.pool)
    .await
    .expect("the invalid index is there");
    assert!(!valid);

    migrate(&db.pool, &OutboxTable::default_table())
        .await
        .expect("migrate");
    assert_upgraded(&db, &old, &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_twice_changes_nothing_the_second_time() {
    let db = TestDb::empty().await;
    let old = minimal_table(&db, 1_000).await;
    let table = OutboxTable::default_table();
    migrate(&db.pool, &table).await.expect("first");
    let before = (
        shape(&db.pool, "public").await,
        catalog_identity(&db.pool).await,
    );
    let report = migrate(&db.pool, &table).await.expect("second");
    assert!(report.applied.is_empty(), "{report:?}");
    assert_eq!(report.version, CURRENT_VERSION);
    let after = (
        shape(&db.pool, "public").await,
        catalog_identity(&db.pool).await,
    );
    assert_eq!(before, after, "the second run changed nothing");
    assert_upgraded(&db, &old, &[]).await;
}

/// The table's and its indexes' storage (a rewrite or a rebuild changes them) and the identity's
/// position.
async fn catalog_identity(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT format('%s %s', relname, relfilenode) FROM pg_class
         WHERE oid = 'outbox'::regclass
            OR oid IN (SELECT indexrelid FROM pg_index WHERE indrelid = 'outbox'::regclass)
         UNION ALL
         SELECT format('last_value %s', last_value) FROM outbox_seq_seq
         ORDER BY 1",
    )
    .fetch_all(pool)
    .await
    .expect("catalog")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_migrates_of_a_minimal_table_take_turns() {
    let db = TestDb::empty().await;
    let old = minimal_table(&db, 5_000).await;
    let producers = Producers::start(&db, 2).await;
    let runs: Vec<_> = (0..3)
        .map(|_| {
            let pool = db.pool.clone();
            tokio::spawn(async move { migrate(&pool, &OutboxTable::default_table()).await })
        })
        .collect();
    let mut applied = 0;
    for r in runs {
        applied += r.await.expect("task").expect("migrate").applied.len();
    }
    let new = producers.stop().await;
    assert_eq!(
        applied, CURRENT_VERSION as usize,
        "each version applied by exactly one run"
    );
    assert_upgraded(&db, &old, &new).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loose_minimal_table_gets_its_nulls_fixed() {
    let db = TestDb::empty().await;
    // No NOT NULL on attempts or created_at, and rows that use it.
    sqlx::raw_sql(
        "CREATE TABLE outbox (
            id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
            created_at timestamptz,
            published_at timestamptz,
            topic text NOT NULL,
            payload jsonb NOT NULL,
            attempts int,
            last_error text)",
    )
    .execute(&db.pool)
    .await
    .expect("loose table");
    let old = old_rows(&db.pool, 2_000).await;
    sqlx::query("UPDATE outbox SET attempts = NULL WHERE random() < 0.5")
        .execute(&db.pool)
        .await
        .expect("null attempts");
    let undated: Vec<Uuid> = sqlx::query_scalar(
        "UPDATE outbox SET created_at = NULL
         WHERE id IN (SELECT id FROM outbox ORDER BY random() LIMIT 10) RETURNING id",
    )
    .fetch_all(&db.pool)
    .await
    .expect("null created_at");

    migrate(&db.pool, &OutboxTable::default_table())
        .await
        .expect("migrate");
    assert_eq!(db.count("attempts IS NULL").await, 0);
    let attempts_not_null: bool = sqlx::query_scalar(
        "SELECT attnotnull FROM pg_attribute WHERE attrelid = 'outbox'::regclass AND attname = 'attempts'",
    )
    .fetch_one(&db.pool)
    .await
    .expect("attnotnull");
    assert!(attempts_not_null);
    // Undated rows count as the oldest, then the others in creation order.
    let mut undated_sorted = undated.clone();
    undated_sorted.sort();
    let first: Vec<Uuid> = sqlx::query_scalar("SELECT id FROM outbox ORDER BY seq LIMIT 10")
        .fetch_all(&db.pool)
        .await
        .expect("first by seq");
    assert_eq!(first, undated_sorted);
    let dated: Vec<Uuid> = old.into_iter().filter(|id| !undated.contains(id)).collect();
    let rest: Vec<Uuid> = sqlx::query_scalar("SELECT id FROM outbox ORDER BY seq OFFSET 10")
        .fetch_all(&db.pool)
        .await
        .expect("rest by seq");
    assert_eq!(rest, dated);
}

/// Migration 2 and 4 as pgoutbox applied them before migrations went online (one transaction,
/// a table rewrite): a table already at version 4 must be left exactly as it is.
const OLD_0002: &str = "
ALTER TABLE outbox
    ADD COLUMN IF NOT EXISTS seq bigint GENERATED ALWAYS AS IDENTITY,
    ADD COLUMN IF NOT EXISTS key text,
    ADD COLUMN IF NOT EXISTS headers jsonb NOT NULL DEFAULT '{}',
    ADD COLUMN IF NOT EXISTS next_attempt_at timestamptz NOT NULL DEFAULT now(),
    ADD COLUMN IF NOT EXISTS destination text,
    ADD COLUMN IF NOT EXISTS dead_at timestamptz,
    ADD COLUMN IF NOT EXISTS lease_token uuid;
UPDATE outbox SET attempts = 0 WHERE attempts IS NULL;
ALTER TABLE outbox
    ALTER COLUMN attempts SET DEFAULT 0,
    ALTER COLUMN attempts SET NOT NULL,
    ALTER COLUMN created_at SET DEFAULT now(),
    ALTER COLUMN headers SET DEFAULT '{}';
UPDATE outbox SET next_attempt_at = created_at
WHERE published_at IS NULL AND created_at IS NOT NULL AND next_attempt_at > created_at;
CREATE INDEX IF NOT EXISTS outbox_pending_idx ON outbox (next_attempt_at, seq)
    WHERE published_at IS NULL AND dead_at IS NULL;
CREATE UNIQUE INDEX IF NOT EXISTS outbox_seq_idx ON outbox (seq);
CREATE INDEX IF NOT EXISTS outbox_dead_idx ON outbox (dead_at) WHERE dead_at IS NOT NULL;
CREATE OR REPLACE FUNCTION outbox_enqueue(
    p_topic text, p_payload jsonb, p_key text DEFAULT NULL, p_headers jsonb DEFAULT '{}'
) RETURNS uuid LANGUAGE sql AS $$
    INSERT INTO outbox (topic, payload, key, headers)
    VALUES (p_topic, p_payload, p_key, coalesce(p_headers, '{}'))
    RETURNING id
$$;
CREATE INDEX IF NOT EXISTS outbox_key_idx ON outbox (key, seq)
    WHERE key IS NOT NULL AND published_at IS NULL;
CREATE TABLE pgoutbox_migrations (
    table_name  text NOT NULL,
    version     int NOT NULL,
    description text NOT NULL,
    applied_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (table_name, version)
);
INSERT INTO pgoutbox_migrations (table_name, version, description)
SELECT 'outbox', v, 'applied by an earlier pgoutbox' FROM generate_series(1, 4) v;";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_migrated_by_an_earlier_pgoutbox_is_left_as_it_is() {
    let db = TestDb::empty().await;
    minimal_table(&db, 1_000).await;
    sqlx::raw_sql(OLD_0002)
        .execute(&db.pool)
        .await
        .expect("the old migrations");
    // An operator's own autovacuum tuning, which migration 7 must keep.
    sqlx::query("ALTER TABLE outbox SET (autovacuum_vacuum_scale_factor = 0.05)")
        .execute(&db.pool)
        .await
        .expect("own setting");
    let before = catalog_identity(&db.pool).await;
    let report = migrate(&db.pool, &OutboxTable::default_table())
        .await
        .expect("migrate");
    // Only what came after the old code's last migration (4) is applied. The table is not
    // rewritten and its indexes are not rebuilt; migrations 7 and 15 only swap the seq index for
    // the published-rows index.
    assert!(report.applied.iter().all(|(v, _)| *v > 4), "{report:?}");
    let after = catalog_identity(&db.pool).await;
    let kept = |v: &[String]| -> Vec<String> {
        v.iter()
            .filter(|l| {
                !l.starts_with("outbox_seq_idx ") && !l.starts_with("outbox_published_seq_idx ")
            })
            .cloned()
            .collect()
    };
    assert_eq!(kept(&before), kept(&after));
    assert!(before.iter().any(|l| l.starts_with("outbox_seq_idx ")));
    assert!(!after.iter().any(|l| l.starts_with("outbox_seq_idx ")));
    assert!(after
        .iter()
        .any(|l| l.starts_with("outbox_published_seq_idx ")));
    assert_eq!(
        shape(&db.pool, "public").await,
        fresh_shape(&db).await,
        "the old upgrade and a fresh install have the same shape"
    );
    let options: Vec<String> = sqlx::query_scalar(
        "SELECT unnest(reloptions) FROM pg_class WHERE oid = 'outbox'::regclass ORDER BY 1",
    )
    .fetch_all(&db.pool)
    .await
    .expect("reloptions");
    assert!(
        options.contains(&"autovacuum_vacuum_scale_factor=0.05".to_owned()),
        "{options:?}"
    );
    assert!(
        options.contains(&"autovacuum_vacuum_cost_delay=0".to_owned()),
        "{options:?}"
    );
}

/// Migration 15 as a deployment at version 14 meets it: a history with partitions holding rows,
/// the outbox and the history indexed on `published_at` alone.
const AT_VERSION_14: &str = "
DROP INDEX outbox_history_published_seq_idx;
CREATE INDEX outbox_history_published_idx ON outbox_history (published_at);
DROP INDEX outbox_published_seq_idx;
CREATE INDEX outbox_published_idx ON outbox (published_at) WHERE published_at IS NOT NULL;
DELETE FROM pgoutbox_migrations WHERE table_name = 'outbox' AND version >= 15;
CREATE TABLE outbox_h202612040000_60 PARTITION OF outbox_history
    FOR VALUES FROM ('2026-12-04 00:00+00') TO ('2026-12-04 01:00+00');
CREATE TABLE outbox_h202612040100_60 PARTITION OF outbox_history
    FOR VALUES FROM ('2026-12-04 01:00+00') TO ('2026-12-04 02:00+00');
INSERT INTO outbox_history (id, seq, topic, payload, created_at, published_at)
SELECT gen_random_uuid(), g, 't', '{}', '2026-12-04 00:00+00',
       '2026-12-04 00:00+00'::timestamptz + (g % 120) * interval '1 minute'
FROM generate_series(1, 5000) g;
UPDATE outbox SET published_at = now() WHERE true;";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_replay_indexes_are_built_online_on_a_history_holding_rows() {
    let db = TestDb::empty().await;
    minimal_table(&db, 1_000).await;
    let table = OutboxTable::default_table();
    migrate(&db.pool, &table).await.expect("first");
    sqlx::raw_sql(AT_VERSION_14)
        .execute(&db.pool)
        .await
        .expect("back to version 14");
    let report = migrate(&db.pool, &table).await.expect("migration 15");
    assert_eq!(
        report.applied.iter().map(|(v, _)| *v).collect::<Vec<_>>(),
        (15..=pgoutbox::schema::CURRENT_VERSION).collect::<Vec<_>>()
    );
    // The parent's index is valid (every partition's attached), each partition has its own,
    // the indexes on published_at alone are gone.
    let indexes: Vec<(String, String, bool)> = sqlx::query_as(
        "SELECT i.indrelid::regclass::text, i.indexrelid::regclass::text, i.indisvalid
         FROM pg_index i JOIN pg_class c ON c.oid = i.indrelid
         WHERE c.relname LIKE 'outbox%' AND pg_get_indexdef(i.indexrelid) LIKE '%USING btree (published_at%'
         ORDER BY 1",
    )
    .fetch_all(&db.pool)
    .await
    .expect("indexes");
    let tables: Vec<&str> = indexes.iter().map(|(t, _, _)| t.as_str()).collect();
    assert_eq!(
        tables,
        [
            "outbox",
            "outbox_h202612040000_60",
            "outbox_h202612040100_60",
            "outbox_history",
            "outbox_history_default"
        ],
        "{indexes:?}"
    );
    assert!(indexes.iter().all(|(_, _, valid)| *valid), "{indexes:?}");
    for (_, index, _) in &indexes {
        let def: String = sqlx::query_scalar("SELECT pg_get_indexdef($1::regclass)")
            .bind(index)
            .fetch_one(&db.pool)
            .await
            .expect("definition");
        assert!(def.contains("(published_at, seq)"), "{def}");
    }
    assert_eq!(shape(&db.pool, "public").await, fresh_shape(&db).await);
    let again = migrate(&db.pool, &table).await.expect("again");
    assert!(again.applied.is_empty(), "{again:?}");
}
