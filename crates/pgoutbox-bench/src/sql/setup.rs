//! The scratch database and what each run makes fresh in it: the database itself, the outbox
//! tables, the WAL source's publication and slots, and the housekeeping between runs (VACUUM,
//! CHECKPOINT) that keeps one run's leftovers out of the next one's numbers.

use pgoutbox::OutboxTable;
use sqlx::{Executor, PgExecutor, PgPool};

/// Drops database `name` if it exists: a scratch database of an earlier run with the same pid.
/// The name is the bench's own (`pgoutbox_bench_<pid>`), spliced in: DDL takes no parameters.
pub async fn drop_database(admin: &PgPool, name: &str) -> sqlx::Result<()> {
    admin
        .execute(format!("DROP DATABASE IF EXISTS {name}").as_str())
        .await
        .map(|_| ())
}

/// Creates the scratch database `name` (the role needs CREATEDB).
pub async fn create_database(admin: &PgPool, name: &str) -> sqlx::Result<()> {
    admin
        .execute(format!("CREATE DATABASE {name}").as_str())
        .await
        .map(|_| ())
}

/// Drops the scratch database `name` at the end, ending the sessions still on it (a relay or
/// producer process being killed) instead of failing on them.
pub async fn drop_database_forced(admin: &PgPool, name: &str) -> sqlx::Result<()> {
    admin
        .execute(format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)").as_str())
        .await
        .map(|_| ())
}

/// Drops and creates `table` as the article's minimal outbox table (`MINIMAL_TABLE` of the
/// library's schema): an application's own table from before pgoutbox.
pub async fn replace_minimal_table(pool: &PgPool, table: &OutboxTable) -> sqlx::Result<()> {
    sqlx::raw_sql(&table.render("DROP TABLE IF EXISTS {outbox}"))
        .execute(pool)
        .await?;
    sqlx::raw_sql(&table.render(pgoutbox::schema::MINIMAL_TABLE))
        .execute(pool)
        .await?;
    Ok(())
}

/// BenchHoldSnapshot. A REPEATABLE READ transaction that has taken its snapshot with a count of
/// the outbox (a long report, a forgotten session): while it stays open, no row version deleted
/// after it began can be vacuumed away. [`release_snapshot`] ends it.
pub async fn hold_snapshot(conn: &mut sqlx::PgConnection) -> sqlx::Result<i64> {
    conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        .await?;
    sqlx::query_scalar("SELECT count(*) FROM outbox")
        .fetch_one(&mut *conn)
        .await
}

/// BenchReleaseSnapshot. Ends [`hold_snapshot`]'s transaction.
pub async fn release_snapshot(conn: &mut sqlx::PgConnection) -> sqlx::Result<()> {
    conn.execute("COMMIT").await.map(|_| ())
}

/// BenchDropOutbox. Every table pgoutbox's migrations create for the default outbox, and the
/// migrations' own record: the next migrate starts from nothing, so each run measures a new
/// table, not the bloat of the last one.
const DROP_OUTBOX: &str = "DROP TABLE IF EXISTS outbox, outbox_deliveries, outbox_held_batches, outbox_destinations, outbox_attempts, outbox_history, pgoutbox_migrations;";

/// Drops the default outbox's tables ([`DROP_OUTBOX`]).
pub async fn drop_outbox(pool: &PgPool) -> sqlx::Result<()> {
    sqlx::raw_sql(DROP_OUTBOX).execute(pool).await.map(|_| ())
}

/// Drops `outbox_minimal`, the minimal table the schema-cost runs compare against: it must not
/// be there for the next run's fresh tables.
pub async fn drop_minimal_copy(pool: &PgPool) -> sqlx::Result<()> {
    sqlx::query("DROP TABLE IF EXISTS outbox_minimal")
        .execute(pool)
        .await
        .map(|_| ())
}

/// Drops the migrations' record alone: `bench migrate` upgrades a minimal table that never was
/// migrated, and a record left by an earlier scenario would make migrate skip the upgrade.
pub async fn drop_migrations_record(pool: &PgPool) -> sqlx::Result<()> {
    sqlx::raw_sql("DROP TABLE IF EXISTS pgoutbox_migrations")
        .execute(pool)
        .await
        .map(|_| ())
}

/// Drops `publication` (already quoted), if any: a publication of a dropped table publishes
/// nothing, so each WAL run makes its own.
pub async fn drop_publication(pool: &PgPool, publication: &str) -> sqlx::Result<()> {
    sqlx::raw_sql(&format!("DROP PUBLICATION IF EXISTS {publication}"))
        .execute(pool)
        .await
        .map(|_| ())
}

/// The replication slots of `database` (name, the pid streaming it if any): slots of the scratch
/// database only, the server may hold others (never touched).
pub async fn replication_slots(
    pool: &PgPool,
    database: &str,
) -> sqlx::Result<Vec<(String, Option<i32>)>> {
    sqlx::query_as(
        "SELECT slot_name::text, active_pid FROM pg_replication_slots WHERE database::text = $1",
    )
    .bind(database)
    .fetch_all(pool)
    .await
}

/// Ends the session `pid`: a slot still streamed cannot be dropped until its walsender is gone.
pub async fn terminate_backend(pool: &PgPool, pid: i32) -> sqlx::Result<()> {
    sqlx::query("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .execute(pool)
        .await
        .map(|_| ())
}

/// Drops replication slot `slot`: an unread slot pins WAL on the server for ever.
pub async fn drop_replication_slot(pool: &PgPool, slot: &str) -> sqlx::Result<()> {
    sqlx::query("SELECT pg_drop_replication_slot($1)")
        .bind(slot)
        .execute(pool)
        .await
        .map(|_| ())
}

/// Creates slot `copy` at the position of slot `slot`: two readers of exactly the same WAL.
pub async fn copy_replication_slot(pool: &PgPool, slot: &str, copy: &str) -> sqlx::Result<()> {
    sqlx::query("SELECT pg_copy_logical_replication_slot($1, $2)")
        .bind(slot)
        .bind(copy)
        .execute(pool)
        .await
        .map(|_| ())
}

/// `VACUUM ANALYZE` of `table` (a name the bench chose, not user input) after a bulk load: the
/// planner's statistics and the visibility map of a table just written, as autovacuum would
/// leave them, so that the first claims do not pay for them.
pub async fn vacuum_analyze(pool: &PgPool, table: &str) -> sqlx::Result<()> {
    sqlx::query(&format!("VACUUM ANALYZE {table}"))
        .execute(pool)
        .await
        .map(|_| ())
}

/// A checkpoint now, so that the dirty pages of what was just written are not flushed during the
/// measurement that follows (needs superuser or pg_checkpoint).
pub async fn checkpoint<'c>(db: impl PgExecutor<'c>) -> sqlx::Result<()> {
    sqlx::query("CHECKPOINT").execute(db).await.map(|_| ())
}
