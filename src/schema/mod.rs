//! Schema and migrations: numbered SQL files, embedded in the binary, applied in order.
//!
//! `migrate` is idempotent (applied versions are recorded in `pgoutbox_migrations`), safe to run from
//! several processes at once (a transaction-scoped advisory lock serializes them), and all-or-nothing
//! (every pending migration runs in one transaction: PostgreSQL DDL is transactional).

use sqlx::{Connection, PgConnection};

use crate::error::{Error, Result};
use crate::table::OutboxTable;

/// One numbered migration (of the outbox table, or of the inbox).
pub(crate) struct Migration {
    /// Its version number, from 1.
    pub version: i32,
    /// What it does.
    pub description: &'static str,
    /// Its SQL template (placeholders rendered by the table it belongs to).
    pub sql: &'static str,
}

const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        description: "create the minimal outbox table",
        sql: include_str!("migrations/0001_minimal_outbox.sql"),
    },
    Migration {
        version: 2,
        description: "add relay columns and the pending-claim index",
        sql: include_str!("migrations/0002_relay_columns.sql"),
    },
    Migration {
        version: 3,
        description: "add the enqueue() SQL function",
        sql: include_str!("migrations/0003_enqueue_function.sql"),
    },
    Migration {
        version: 4,
        description: "add the per-key ordering index",
        sql: include_str!("migrations/0004_key_order_index.sql"),
    },
    Migration {
        version: 5,
        description: "add the per-destination state table (pause, circuit breaker)",
        sql: include_str!("migrations/0005_destinations.sql"),
    },
];

/// The schema version this build of pgoutbox needs.
pub const CURRENT_VERSION: i32 = 5;

/// Advisory lock key shared by every `migrate`, whatever the table: migrations are rare and short.
pub(crate) const MIGRATE_LOCK_KEY: i64 = 0x7067_6f75_7462_6f78; // "pgoutbox"

/// The registry of applied migrations, one per schema; shared with the inbox's migrations
/// ([`crate::inbox::migrate`]), which record themselves under `inbox:<table>`.
pub(crate) const REGISTRY_DDL: &str = "CREATE TABLE IF NOT EXISTS {schema}.pgoutbox_migrations (
    table_name  text NOT NULL,
    version     int NOT NULL,
    description text NOT NULL,
    applied_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (table_name, version)
)";

/// What a `migrate` run did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigrateReport {
    /// Versions applied by this run, in order (empty when already up to date).
    pub applied: Vec<(i32, &'static str)>,
    /// The version the table is at now.
    pub version: i32,
}

/// Brings `table` (and its schema) up to [`CURRENT_VERSION`].
pub async fn migrate(conn: &mut PgConnection, table: &OutboxTable) -> Result<MigrateReport> {
    run_migrations(
        conn,
        table.schema(),
        table.table().as_str(),
        MIGRATIONS,
        CURRENT_VERSION,
        |sql| table.render(sql),
    )
    .await
}

/// Applies the `migrations` not yet recorded under `registry_key`, in one transaction under the
/// shared advisory lock: creates `schema` when missing, then the registry, then each pending
/// migration as `render` writes it for its table.
pub(crate) async fn run_migrations(
    conn: &mut PgConnection,
    schema: &crate::table::Ident,
    registry_key: &str,
    migrations: &[Migration],
    latest: i32,
    render: impl Fn(&str) -> String,
) -> Result<MigrateReport> {
    let mut tx = conn.begin().await?;
    // Serializes concurrent migrate runs; released at commit or rollback.
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(MIGRATE_LOCK_KEY)
        .execute(&mut *tx)
        .await?;

    // Checked first: CREATE SCHEMA IF NOT EXISTS needs the CREATE privilege even when it exists.
    let schema_exists: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)")
            .bind(schema.as_str())
            .fetch_one(&mut *tx)
            .await?;
    if !schema_exists {
        sqlx::raw_sql(&render("CREATE SCHEMA {schema}"))
            .execute(&mut *tx)
            .await?;
    }
    sqlx::raw_sql(&render(REGISTRY_DDL))
        .execute(&mut *tx)
        .await?;

    let current: Option<i32> = sqlx::query_scalar(&render(
        "SELECT max(version) FROM {schema}.pgoutbox_migrations WHERE table_name = $1",
    ))
    .bind(registry_key)
    .fetch_one(&mut *tx)
    .await?;
    let current = current.unwrap_or(0);
    let mut applied = Vec::new();
    for m in migrations.iter().filter(|m| m.version > current) {
        sqlx::raw_sql(&render(m.sql))
            .execute(&mut *tx)
            .await
            .map_err(|source| Error::Migration {
                version: m.version,
                description: m.description,
                source,
            })?;
        sqlx::query(&render(
            "INSERT INTO {schema}.pgoutbox_migrations (table_name, version, description) VALUES ($1, $2, $3)",
        ))
        .bind(registry_key)
        .bind(m.version)
        .bind(m.description)
        .execute(&mut *tx)
        .await?;
        applied.push((m.version, m.description));
    }
    tx.commit().await?;
    Ok(MigrateReport {
        applied,
        version: current.max(latest),
    })
}

/// The version `table` is at: 0 when it was never migrated.
pub async fn applied_version(conn: &mut PgConnection, table: &OutboxTable) -> Result<i32> {
    let registry = format!("{}.pgoutbox_migrations", table.schema().quoted());
    let exists: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
        .bind(&registry)
        .fetch_one(&mut *conn)
        .await?;
    if !exists {
        return Ok(0);
    }
    let version: Option<i32> = sqlx::query_scalar(&format!(
        "SELECT max(version) FROM {registry} WHERE table_name = $1"
    ))
    .bind(table.table().as_str())
    .fetch_one(&mut *conn)
    .await?;
    Ok(version.unwrap_or(0))
}

/// Fails with [`Error::SchemaOutdated`] unless `table` is at [`CURRENT_VERSION`] or later.
pub async fn ensure_current(conn: &mut PgConnection, table: &OutboxTable) -> Result<()> {
    let found = applied_version(conn, table).await?;
    if found < CURRENT_VERSION {
        return Err(Error::SchemaOutdated {
            table: table.to_string(),
            found,
            needed: CURRENT_VERSION,
        });
    }
    Ok(())
}

/// Privileges the relay's role needs on the outbox table (DELETE: retention 0 and cleanup).
pub const RELAY_TABLE_PRIVILEGES: &[&str] = &["SELECT", "UPDATE", "DELETE"];

/// Grants `role` what the relay needs, and nothing more: USAGE on the schema, SELECT, UPDATE and
/// DELETE on the outbox table, SELECT, INSERT and UPDATE on its destinations table, SELECT on the
/// migrations registry. Run as the table's owner.
pub async fn grant_relay(
    conn: &mut PgConnection,
    table: &OutboxTable,
    role: &crate::table::Ident,
) -> Result<()> {
    let sql = table.render(&format!(
        "GRANT USAGE ON SCHEMA {{schema}} TO {role};
         GRANT {privileges} ON {{outbox}} TO {role};
         GRANT SELECT, INSERT, UPDATE ON {{qname:destinations}} TO {role};
         GRANT SELECT ON {{schema}}.pgoutbox_migrations TO {role};",
        role = role.quoted(),
        privileges = RELAY_TABLE_PRIVILEGES.join(", ")
    ));
    sqlx::raw_sql(&sql).execute(conn).await?;
    Ok(())
}

/// Grants `role` what a producer needs: USAGE on the schema, INSERT on the outbox table and
/// EXECUTE on the enqueue function.
pub async fn grant_producer(
    conn: &mut PgConnection,
    table: &OutboxTable,
    role: &crate::table::Ident,
) -> Result<()> {
    let sql = table.render(&format!(
        "GRANT USAGE ON SCHEMA {{schema}} TO {role};
         GRANT INSERT ON {{outbox}} TO {role};
         GRANT EXECUTE ON FUNCTION {{qname:enqueue}}(text, jsonb, text, jsonb) TO {role};",
        role = role.quoted()
    ));
    sqlx::raw_sql(&sql).execute(conn).await?;
    Ok(())
}

/// The relay privileges the current role lacks on `table` (empty when all are there).
pub async fn missing_relay_privileges(
    conn: &mut PgConnection,
    table: &OutboxTable,
) -> Result<Vec<&'static str>> {
    let mut missing = Vec::new();
    for privilege in RELAY_TABLE_PRIVILEGES {
        let has: bool = sqlx::query_scalar("SELECT has_table_privilege(current_user, $1, $2)")
            .bind(table.qualified())
            .bind(privilege)
            .fetch_one(&mut *conn)
            .await?;
        if !has {
            missing.push(*privilege);
        }
    }
    Ok(missing)
}
