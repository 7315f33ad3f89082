//! The migration runner: applies numbered migrations made of online steps.
//!
//! A migration is either plain SQL (one transaction, recorded in the same transaction) or a list
//! of [`Step`]s, each idempotent and each committed on its own, so that a large table is upgraded
//! without holding a lock that blocks producers for longer than a few milliseconds:
//!
//! - [`Action::Transaction`]: short DDL (metadata-only `ADD COLUMN`, `SET DEFAULT`,
//!   `ADD CONSTRAINT … NOT VALID`) under a `lock_timeout`, retried on a growing timeout, so a
//!   waiting `ALTER TABLE` never queues producers behind a long transaction for long.
//! - [`Action::Index`]: `CREATE INDEX CONCURRENTLY` outside any transaction; an index that an
//!   interrupted run left INVALID is dropped (concurrently) and built again.
//! - [`Action::Backfill`]: one short autocommit statement per batch, repeated until done.
//! - [`Action::NotNull`]: `SET NOT NULL` without a scan under an exclusive lock: a `CHECK … NOT
//!   VALID`, its `VALIDATE` (which takes SHARE UPDATE EXCLUSIVE: inserts go on), then `SET NOT
//!   NULL`, which PostgreSQL 12+ proves from the valid check instead of scanning.
//!
//! A version is recorded in `pgoutbox_migrations` only once all its steps are done; a run killed
//! at any point resumes where it stopped. Runs are serialized by a session advisory lock held by
//! the dedicated connection the whole run uses: closing that connection (at the end, on an error,
//! or when the future is dropped) releases it.

use std::time::{Duration, Instant};

use sqlx::{Connection, PgConnection, PgPool, Postgres};
use tracing::{debug, info, warn};

use super::steps::{Action, Body, Migration, Step};
use super::{MigrateReport, MIGRATE_LOCK_KEY, REGISTRY_DDL};
use crate::error::{Error, Result};
use crate::table::Ident;

/// Rows per backfill batch: each batch is one statement holding its rows' locks for ~100 ms.
const BACKFILL_BATCH_ROWS: i64 = 5_000;

/// Pause after each backfill batch, as a fraction of the time the batch took (1.0: as long).
const BACKFILL_PAUSE: f64 = 1.0;

/// `lock_timeout` of successive attempts of a DDL transaction. A waiting `ALTER TABLE` queues every
/// later INSERT behind it, so it gives up quickly and tries again after a pause; the last value
/// is kept for the remaining attempts. Producers are never held up longer than one timeout. The
/// last one outlasts the default `deadlock_timeout` (1 s), after which PostgreSQL cancels an
/// autovacuum that holds the lock we wait for: a waiter giving up earlier never gets it cancelled.
const LOCK_TIMEOUTS_MS: &[u64] = &[100, 200, 500, 1100];

/// Attempts of one DDL transaction before the migration fails (about two minutes in all).
const LOCK_ATTEMPTS: u32 = 30;

/// How often a waiting `migrate` checks whether the one running has finished.
const LOCK_POLL: Duration = Duration::from_millis(200);

/// How often a long backfill reports its progress.
const PROGRESS_EVERY: Duration = Duration::from_secs(5);

/// Renders a template for the table being migrated.
type Render<'a> = &'a (dyn Fn(&str) -> String + Sync);

/// Applies the `migrations` not yet recorded under `registry_key`, on a dedicated connection that
/// holds the shared advisory lock: creates `schema` when missing, then the registry, then each
/// pending migration as `render` writes it for its table.
pub(crate) async fn run_migrations(
    pool: &PgPool,
    schema: &Ident,
    registry_key: &str,
    migrations: &[Migration],
    latest: i32,
    render: Render<'_>,
) -> Result<MigrateReport> {
    let mut conn = pool.acquire().await?;
    // Never back to the pool: whatever happens from here (an error, a dropped future), the session
    // ends with this connection, and the advisory lock with it.
    conn.close_on_drop();
    take_lock(&mut conn).await?;
    // VACUUM and ANALYZE of this session as gentle as autovacuum's (a manual VACUUM's default is
    // no delay at all): its writes compete with the producers' commits for the disk.
    simple(&mut conn, "SET vacuum_cost_delay = '2ms'").await?;

    // Checked first: CREATE SCHEMA IF NOT EXISTS needs the CREATE privilege even when it exists.
    let schema_exists: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)")
            .bind(schema.as_str())
            .fetch_one(&mut *conn)
            .await?;
    if !schema_exists {
        simple(&mut conn, &render("CREATE SCHEMA IF NOT EXISTS {schema}")).await?;
    }
    simple(&mut conn, &render(REGISTRY_DDL)).await?;

    let current: Option<i32> = sqlx::query_scalar(&render(
        "SELECT max(version) FROM {schema}.pgoutbox_migrations WHERE table_name = $1",
    ))
    .bind(registry_key)
    .fetch_one(&mut *conn)
    .await?;
    let current = current.unwrap_or(0);
    let record = render(
        "INSERT INTO {schema}.pgoutbox_migrations (table_name, version, description) VALUES ($1, $2, $3)
         ON CONFLICT DO NOTHING",
    );
    let mut applied = Vec::new();
    for m in migrations.iter().filter(|m| m.version > current) {
        let failed = |source| Error::Migration {
            version: m.version,
            description: m.description,
            source,
        };
        match m.body {
            Body::Sql(sql) => {
                let record = Record {
                    sql: &record,
                    key: registry_key,
                    migration: m,
                };
                ddl_transaction(&mut conn, &render(sql), Some(&record), registry_key)
                    .await
                    .map_err(failed)?;
            }
            Body::Steps(steps) => {
                for step in steps {
                    run_step(&mut conn, step, m, registry_key, render)
                        .await
                        .map_err(failed)?;
                }
                Record {
                    sql: &record,
                    key: registry_key,
                    migration: m,
                }
                .query()
                .execute(&mut *conn)
                .await?;
            }
        }
        debug!(
            table = registry_key,
            version = m.version,
            "migration applied: {}",
            m.description
        );
        applied.push((m.version, m.description));
    }
    sqlx::query("SELECT pg_advisory_unlock($1)")
        .bind(MIGRATE_LOCK_KEY)
        .execute(&mut *conn)
        .await?;
    conn.close().await?;
    let version = current.max(latest);
    // One line for a person; each migration and step is at debug (`-v`).
    match applied.len() {
        0 => debug!(table = registry_key, version, "schema up to date"),
        n => info!(
            table = registry_key,
            version,
            applied = n,
            "schema of {registry_key} migrated from version {current} to {version} ({n} migrations)"
        ),
    }
    Ok(MigrateReport { applied, version })
}

/// Takes the session advisory lock that serializes `migrate` runs, polling with the non-blocking
/// form: a session waiting inside `pg_advisory_lock` holds a snapshot, which a `CREATE INDEX
/// CONCURRENTLY` of the run holding the lock would wait for, forever.
async fn take_lock(conn: &mut PgConnection) -> Result<()> {
    let mut told = false;
    loop {
        let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
            .bind(MIGRATE_LOCK_KEY)
            .fetch_one(&mut *conn)
            .await?;
        if got {
            return Ok(());
        }
        if !told {
            info!("another migrate is running; waiting for it to finish");
            told = true;
        }
        tokio::time::sleep(LOCK_POLL).await;
    }
}

async fn run_step(
    conn: &mut PgConnection,
    step: &Step,
    m: &Migration,
    table: &str,
    render: Render<'_>,
) -> Result<(), sqlx::Error> {
    if let Some(probe) = step.unless {
        let done: bool = sqlx::query_scalar(&render(probe))
            .fetch_one(&mut *conn)
            .await?;
        if done {
            return Ok(());
        }
    }
    let started = Instant::now();
    match step.action {
        Action::Transaction(sql) => ddl_transaction(conn, &render(sql), None, table).await?,
        Action::Statement(sql) => {
            simple(conn, &render(sql)).await?;
        }
        Action::Index {
            name,
            table: on,
            sql,
        } => {
            if !build_index(conn, &render(name), &render(on), &render(sql), table).await? {
                return Ok(());
            }
        }
        Action::PartitionedIndex {
            name,
            table: on,
            sql,
            columns,
        } => {
            let (name, on) = (render(name), render(on));
            if !partitioned_index(conn, &name, &on, &render(sql), columns, table).await? {
                return Ok(());
            }
        }
        Action::Backfill { total, batch } => {
            let total = match total {
                Some(q) => Some(
                    sqlx::query_scalar::<_, i64>(&render(q))
                        .fetch_one(&mut *conn)
                        .await?,
                ),
                None => None,
            };
            backfill(conn, &render(batch), total, step.what, table).await?
        }
        Action::NotNull { column } => set_not_null(conn, column, table, render).await?,
    }
    debug!(
        table,
        version = m.version,
        elapsed_ms = started.elapsed().as_millis() as u64,
        "migration step done: {}",
        step.what
    );
    Ok(())
}

/// The registry row of a migration: its insert statement, bound.
struct Record<'a> {
    sql: &'a str,
    key: &'a str,
    migration: &'a Migration,
}

impl Record<'_> {
    fn query(&self) -> sqlx::query::Query<'_, Postgres, sqlx::postgres::PgArguments> {
        sqlx::query(self.sql)
            .bind(self.key)
            .bind(self.migration.version)
            .bind(self.migration.description)
    }
}

/// Runs `sql` (and `record`, when given) in one transaction under a short `lock_timeout`, again
/// with a longer one when a lock was not granted in time. Producers queue behind a waiting
/// `ALTER TABLE`, so it must never wait long.
async fn ddl_transaction(
    conn: &mut PgConnection,
    sql: &str,
    record: Option<&Record<'_>>,
    table: &str,
) -> Result<(), sqlx::Error> {
    let mut attempt: u32 = 0;
    loop {
        let timeout = LOCK_TIMEOUTS_MS[(attempt as usize).min(LOCK_TIMEOUTS_MS.len() - 1)];
        match ddl_attempt(conn, sql, record, timeout).await {
            Err(e) if is_lock_timeout(&e) && attempt + 1 < LOCK_ATTEMPTS => {
                attempt += 1;
                let pause =
                    Duration::from_millis(250 * u64::from(attempt)).min(Duration::from_secs(5));
                warn!(
                    table,
                    attempt,
                    lock_timeout_ms = timeout,
                    "a transaction holds a lock the migration needs; trying again in {} ms",
                    pause.as_millis()
                );
                tokio::time::sleep(pause).await;
            }
            other => return other,
        }
    }
}

/// One attempt of [`ddl_transaction`].
async fn ddl_attempt(
    conn: &mut PgConnection,
    sql: &str,
    record: Option<&Record<'_>>,
    timeout_ms: u64,
) -> Result<(), sqlx::Error> {
    let mut tx = conn.begin().await?;
    simple(
        &mut tx,
        &format!("SET LOCAL lock_timeout = '{timeout_ms}ms'"),
    )
    .await?;
    simple(&mut tx, sql).await?;
    if let Some(record) = record {
        record.query().execute(&mut *tx).await?;
    }
    tx.commit().await
}

/// Runs `sql` (statements without parameters, several allowed) with the simple query protocol,
/// outside any transaction unless `conn` is one. Not `sqlx::raw_sql`: its future cannot be proven
/// `Send`, and `migrate` must be spawnable.
async fn simple(conn: &mut PgConnection, sql: &str) -> Result<(), sqlx::Error> {
    sqlx::Executor::execute(conn, sql).await.map(drop)
}

/// True for PostgreSQL's `lock_not_available` (a `lock_timeout` expired).
fn is_lock_timeout(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(d) if d.code().as_deref() == Some("55P03"))
}

/// Builds the index `name` on `on` with `sql` (a `CREATE INDEX CONCURRENTLY IF NOT EXISTS`),
/// unless a valid one exists (then returns false). An INVALID one (a run interrupted during its
/// build, or a failed build) is dropped first: `IF NOT EXISTS` would otherwise keep it, unused by
/// any query and still updated by every write. Neither statement blocks inserts (SHARE UPDATE
/// EXCLUSIVE); both wait for the transactions older than them to end: any of the database that
/// holds a snapshot, even one that never touches this table. So on an empty table (a fresh
/// install) the index is built the plain way instead, in a DDL transaction: its SHARE lock lasts
/// the milliseconds an empty build takes, and nobody's long transaction holds up the install.
async fn build_index(
    conn: &mut PgConnection,
    name: &str,
    on: &str,
    sql: &str,
    table: &str,
) -> Result<bool, sqlx::Error> {
    let valid = index_valid(conn, name).await?;
    match valid {
        Some(true) => return Ok(false),
        Some(false) => {
            warn!(
                index = name,
                "dropping an invalid index left by an interrupted build"
            );
            simple(conn, &format!("DROP INDEX CONCURRENTLY IF EXISTS {name}")).await?;
        }
        None => {}
    }
    let empty: bool = sqlx::query_scalar(&format!("SELECT NOT EXISTS (SELECT FROM {on})"))
        .fetch_one(&mut *conn)
        .await?;
    if empty && sql.contains(" INDEX CONCURRENTLY ") {
        let plain = sql.replacen(" INDEX CONCURRENTLY ", " INDEX ", 1);
        ddl_transaction(conn, &plain, None, table).await?;
    } else {
        // On a table with rows this takes a while: say what is going on.
        info!(index = name, "building an index concurrently");
        simple(conn, sql).await?;
    }
    Ok(true)
}

/// Whether the index `name` is valid; `None` when there is none.
async fn index_valid(conn: &mut PgConnection, name: &str) -> Result<Option<bool>, sqlx::Error> {
    sqlx::query_scalar("SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass($1)")
        .bind(name)
        .fetch_optional(&mut *conn)
        .await
}

/// The partitions of `$1` without an index attached to the partitioned index `$2`: each one's
/// name, and the name for its index (its own name and `_pubseq`, cut to fit 63 bytes), qualified
/// and bare, quoted.
const UNINDEXED_PARTITIONS: &str = "
SELECT c.oid::regclass::text,
       format('%I.%I', n.nspname, left(c.relname, 50) || '_pubseq'),
       quote_ident(left(c.relname, 50) || '_pubseq')
FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE i.inhparent = to_regclass($1)
  AND NOT EXISTS (SELECT FROM pg_inherits ii JOIN pg_index x ON x.indexrelid = ii.inhrelid
                  WHERE ii.inhparent = to_regclass($2) AND x.indrelid = c.oid)
ORDER BY 1";

/// Builds the partitioned index `name` on `on` (see [`Action::PartitionedIndex`]) unless a
/// valid one exists (then returns false). A run killed half-way resumes with the partitions not
/// attached yet; a partition's index left INVALID is built again ([`build_index`]).
async fn partitioned_index(
    conn: &mut PgConnection,
    name: &str,
    on: &str,
    sql: &str,
    columns: &str,
    table: &str,
) -> Result<bool, sqlx::Error> {
    let valid = index_valid(conn, name).await?;
    if valid == Some(true) {
        return Ok(false);
    }
    ddl_transaction(conn, sql, None, table).await?;
    let partitions: Vec<(String, String, String)> = sqlx::query_as(UNINDEXED_PARTITIONS)
        .bind(on)
        .bind(name)
        .fetch_all(&mut *conn)
        .await?;
    for (partition, index, bare) in partitions {
        let create =
            format!("CREATE INDEX CONCURRENTLY IF NOT EXISTS {bare} ON {partition} {columns}");
        build_index(conn, &index, &partition, &create, table).await?;
        let attach = format!("ALTER INDEX {name} ATTACH PARTITION {index}");
        ddl_transaction(conn, &attach, None, table).await?;
    }
    Ok(true)
}

/// Runs `batch` until it returns a NULL cursor, each batch its own autocommit statement; logs
/// progress every [`PROGRESS_EVERY`].
async fn backfill(
    conn: &mut PgConnection,
    batch: &str,
    total: Option<i64>,
    what: &str,
    table: &str,
) -> Result<(), sqlx::Error> {
    let started = Instant::now();
    let mut reported = started;
    let mut cursor = i64::MIN;
    let mut done: i64 = 0;
    loop {
        let batch_started = Instant::now();
        let (touched, next): (Option<i64>, Option<i64>) = sqlx::query_as(batch)
            .bind(BACKFILL_BATCH_ROWS)
            .bind(cursor)
            .fetch_one(&mut *conn)
            .await?;
        done += touched.unwrap_or(0);
        let Some(next) = next else { break };
        cursor = next;
        // The batch's WAL must reach the disk before any later commit can: leave the producers'
        // commits room between batches.
        tokio::time::sleep(batch_started.elapsed().mul_f64(BACKFILL_PAUSE)).await;
        if reported.elapsed() >= PROGRESS_EVERY {
            reported = Instant::now();
            match total {
                Some(total) => info!(table, rows = done, total, "{what}: {done} of {total} rows"),
                None => info!(table, rows = done, "{what}: {done} rows"),
            }
        }
    }
    if done > 0 {
        info!(
            table,
            rows = done,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "{what}: {done} rows"
        );
    }
    Ok(())
}

/// `SET NOT NULL` on `column` of the outbox table without scanning under ACCESS EXCLUSIVE: a
/// CHECK constraint added NOT VALID (metadata only, but enforced on new rows from then on),
/// validated under SHARE UPDATE EXCLUSIVE (a scan that inserts and updates do not wait for), then
/// `SET NOT NULL`, which PostgreSQL 12+ proves from the valid constraint, and the constraint
/// dropped. Each part is skipped when already done.
async fn set_not_null(
    conn: &mut PgConnection,
    column: &str,
    table: &str,
    render: Render<'_>,
) -> Result<(), sqlx::Error> {
    let relation = render("{outbox}");
    let constraint = render(&format!("{{name:{column}_not_null}}"));
    let not_null: Option<bool> = sqlx::query_scalar(
        "SELECT attnotnull FROM pg_attribute WHERE attrelid = to_regclass($1) AND attname = $2",
    )
    .bind(&relation)
    .bind(column)
    .fetch_optional(&mut *conn)
    .await?;
    if not_null == Some(true) {
        return Ok(());
    }
    let validated: Option<bool> = sqlx::query_scalar(
        "SELECT convalidated FROM pg_constraint WHERE conrelid = to_regclass($1) AND conname = $2",
    )
    .bind(&relation)
    .bind(constraint.trim_matches('"'))
    .fetch_optional(&mut *conn)
    .await?;
    if validated.is_none() {
        ddl_transaction(
            conn,
            &format!("ALTER TABLE {relation} ADD CONSTRAINT {constraint} CHECK ({column} IS NOT NULL) NOT VALID"),
            None,
            table,
        )
        .await?;
    }
    if validated != Some(true) {
        // SHARE UPDATE EXCLUSIVE: writes go on while it waits and scans, so no lock timeout.
        // Only a table with rows makes that scan worth a line for a person.
        let empty: bool =
            sqlx::query_scalar(&format!("SELECT NOT EXISTS (SELECT FROM {relation})"))
                .fetch_one(&mut *conn)
                .await?;
        if empty {
            debug!(table, column, "validating NOT NULL (an empty table)");
        } else {
            info!(table, column, "validating NOT NULL (a scan; inserts go on)");
        }
        simple(
            conn,
            &format!("ALTER TABLE {relation} VALIDATE CONSTRAINT {constraint}"),
        )
        .await?;
    }
    ddl_transaction(
        conn,
        &format!(
            "ALTER TABLE {relation} ALTER COLUMN {column} SET NOT NULL;
             ALTER TABLE {relation} DROP CONSTRAINT IF EXISTS {constraint};"
        ),
        None,
        table,
    )
    .await
}
