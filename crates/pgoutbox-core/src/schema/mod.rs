//! Schema and migrations: numbered migrations, embedded in the binary, applied in order.
//!
//! `migrate` is idempotent (applied versions are recorded in `pgoutbox_migrations`), safe to run from
//! several processes at once (a session advisory lock serializes them) and **online**: on a large
//! existing table no step holds a lock that blocks inserts for more than a few milliseconds
//! (metadata-only DDL under a lock timeout, backfills in short batches, indexes built
//! concurrently, NOT NULL through validated CHECK constraints; see `runner.rs`). Each step is
//! idempotent and committed on its own, so a run killed at any point resumes where it stopped; a
//! version is recorded only once all its steps are done. Plain-SQL migrations run in one
//! transaction as before: adding one is one `Migration::sql` line in `MIGRATIONS`.

#[cfg(feature = "sqlx08")]
mod runner;
mod steps;

#[cfg(feature = "sqlx08")]
use sqlx::{PgConnection, PgPool};

#[cfg(feature = "sqlx08")]
pub(crate) use runner::run_migrations;
pub(crate) use steps::Migration;
use steps::{Action, Step};

#[cfg(feature = "sqlx08")]
use crate::error::{Error, Result};
#[cfg(feature = "sqlx08")]
use crate::table::OutboxTable;

/// Migration 1: the article's minimal outbox table (a template for [`OutboxTable::render`](crate::table::OutboxTable::render)).
pub const MINIMAL_TABLE: &str = include_str!("migrations/0001_minimal_outbox.sql");

/// The outbox table's migrations, in order.
const MIGRATIONS: &[Migration] = &[
    Migration::sql(1, "create the minimal outbox table", MINIMAL_TABLE),
    Migration::steps(
        2,
        "add relay columns and the pending-claim index",
        RELAY_COLUMNS,
    ),
    Migration::sql(
        3,
        "add the enqueue() SQL function",
        include_str!("migrations/0003_enqueue_function.sql"),
    ),
    Migration::steps(4, "add the per-key ordering index", KEY_ORDER_INDEX),
    Migration::sql(
        5,
        "add the per-destination state table (pause, circuit breaker)",
        include_str!("migrations/0005_destinations.sql"),
    ),
    Migration::sql(
        6,
        "add the per-destination deliveries table (fan-out)",
        include_str!("migrations/0006_deliveries.sql"),
    ),
    Migration::steps(
        7,
        "cheaper inserts: cleanup index on published rows only, no seq index, autovacuum settings",
        WRITE_PATH,
    ),
    Migration::sql(
        8,
        "add the attempt history table (failed attempts only)",
        include_str!("migrations/0008_attempts.sql"),
    ),
    Migration::sql(
        9,
        "add the emit() SQL function (events as logical decoding messages, for source = \"wal\")",
        include_str!("migrations/0009_emit_function.sql"),
    ),
    Migration::sql(
        10,
        "add the partitioned history table (history = \"partitions\")",
        include_str!("migrations/0010_history.sql"),
    ),
    Migration::steps(
        11,
        "each destination claims its own due pairs (the deliveries' per-destination due index)",
        LANES,
    ),
    Migration::sql(
        12,
        "add the operators' audit log and the console's shared samples",
        include_str!("migrations/0012_operators.sql"),
    ),
    Migration::sql(
        13,
        "add the rate-limited destinations' shared token buckets",
        include_str!("migrations/0013_rates.sql"),
    ),
    Migration::sql(
        14,
        "add replays (retained events sent again to one destination)",
        include_str!("migrations/0014_replays.sql"),
    ),
    Migration::steps(
        15,
        "replays read in index order: (published_at, seq) indexes on the published rows and the history",
        REPLAY_INDEX,
    ),
    Migration::sql(
        16,
        "add the destinations managed at runtime (definitions, their version)",
        include_str!("migrations/0016_definitions.sql"),
    ),
];

/// The schema version this build of pgoutbox needs: the last migration's.
pub const CURRENT_VERSION: i32 = MIGRATIONS[MIGRATIONS.len() - 1].version;

/// True once migration 2 is complete for `seq`: it is an identity column.
const SEQ_IS_IDENTITY: &str = "SELECT EXISTS (SELECT FROM pg_attribute
    WHERE attrelid = to_regclass('{outbox}') AND attname = 'seq' AND attidentity <> '')";

/// True once every row has a `seq` (and so the numbering is over).
const SEQ_IS_NOT_NULL: &str = "SELECT EXISTS (SELECT FROM pg_attribute
    WHERE attrelid = to_regclass('{outbox}') AND attname = 'seq' AND attnotnull)";

/// True when `attempts` is NOT NULL already (it is in the usual minimal table).
const ATTEMPTS_IS_NOT_NULL: &str = "SELECT EXISTS (SELECT FROM pg_attribute
    WHERE attrelid = to_regclass('{outbox}') AND attname = 'attempts' AND attnotnull)";

/// Migration 2, online: the relay's columns on a minimal table of any size. `seq` cannot be added
/// as an identity (that rewrites the table under ACCESS EXCLUSIVE): it is added nullable with a
/// sequence default for new rows, existing rows are numbered in batches before them, then it
/// becomes NOT NULL and the identity a fresh table has. Producers may leave `seq` out throughout.
const RELAY_COLUMNS: &[Step] = &[
    Step {
        what: "add the relay columns (metadata only)",
        unless: Some(SEQ_IS_IDENTITY),
        action: Action::Transaction(include_str!(
            "migrations/0002_relay_columns/add_columns.sql"
        )),
    },
    Step {
        what: "build the seq index",
        unless: None,
        action: Action::Index {
            name: "{qname:seq_idx}",
            table: "{outbox}",
            sql: include_str!("migrations/0002_relay_columns/seq_idx.sql"),
        },
    },
    Step {
        what: "build the index of the rows to number",
        unless: Some(SEQ_IS_NOT_NULL),
        action: Action::Index {
            name: "{qname:seq_backfill_idx}",
            table: "{outbox}",
            sql: include_str!("migrations/0002_relay_columns/backfill_idx.sql"),
        },
    },
    Step {
        // The new columns have no statistics yet: without them the planner would read the whole
        // table for each numbering batch instead of the index built for it.
        what: "refresh the planner statistics",
        unless: Some(SEQ_IS_NOT_NULL),
        action: Action::Statement("ANALYZE {outbox}"),
    },
    Step {
        what: "number the existing rows",
        unless: Some(SEQ_IS_NOT_NULL),
        action: Action::Backfill {
            total: Some("SELECT count(*) FROM {outbox} WHERE seq IS NULL"),
            batch: include_str!("migrations/0002_relay_columns/number_rows.sql"),
        },
    },
    Step {
        what: "drop the index of the rows to number",
        unless: None,
        action: Action::Statement("DROP INDEX CONCURRENTLY IF EXISTS {qname:seq_backfill_idx}"),
    },
    Step {
        // Numbering left a dead version of every old row. Vacuumed now (SHARE UPDATE EXCLUSIVE:
        // inserts go on), rather than by an autovacuum starting just as the next steps need
        // their brief exclusive locks: an autovacuum is only cancelled for a waiter after
        // `deadlock_timeout`, and producers would queue behind the waiting ALTER meanwhile.
        what: "vacuum the numbered rows",
        unless: Some(SEQ_IS_NOT_NULL),
        action: Action::Statement("VACUUM (ANALYZE) {outbox}"),
    },
    Step {
        what: "make seq NOT NULL",
        unless: Some(SEQ_IS_NOT_NULL),
        action: Action::NotNull { column: "seq" },
    },
    Step {
        what: "set missing attempts to 0",
        unless: Some(ATTEMPTS_IS_NOT_NULL),
        action: Action::Backfill {
            total: None,
            batch: include_str!("migrations/0002_relay_columns/attempts.sql"),
        },
    },
    Step {
        what: "make attempts NOT NULL",
        unless: Some(ATTEMPTS_IS_NOT_NULL),
        action: Action::NotNull { column: "attempts" },
    },
    Step {
        what: "make seq an identity column",
        unless: Some(SEQ_IS_IDENTITY),
        action: Action::Transaction(include_str!("migrations/0002_relay_columns/identity.sql")),
    },
    Step {
        what: "build the pending-claim index",
        unless: None,
        action: Action::Index {
            name: "{qname:pending_idx}",
            table: "{outbox}",
            sql: include_str!("migrations/0002_relay_columns/pending_idx.sql"),
        },
    },
    Step {
        what: "build the dead-letter index",
        unless: None,
        action: Action::Index {
            name: "{qname:dead_idx}",
            table: "{outbox}",
            sql: include_str!("migrations/0002_relay_columns/dead_idx.sql"),
        },
    },
];

/// Migration 7: what every INSERT pays, cut (docs/performance.md, "Write path"). The unique index
/// on `seq` (every row, so every INSERT) gives way to an index of published rows only, which
/// INSERTs never touch; built first, so cleanup always has one of them.
const WRITE_PATH: &[Step] = &[
    Step {
        what: "build the published-rows index (cleanup)",
        unless: None,
        action: Action::Index {
            name: "{qname:published_idx}",
            table: "{outbox}",
            sql: include_str!("migrations/0007_write_path/published_idx.sql"),
        },
    },
    Step {
        what: "drop the seq index",
        unless: None,
        action: Action::Statement(include_str!("migrations/0007_write_path/drop_seq_idx.sql")),
    },
    Step {
        what: "set the outbox's own autovacuum settings",
        unless: None,
        action: Action::Transaction(include_str!("migrations/0007_write_path/autovacuum.sql")),
    },
    Step {
        what: "time-ordered id default (PostgreSQL 18+)",
        unless: None,
        action: Action::Transaction(include_str!(
            "migrations/0007_write_path/uuidv7_default.sql"
        )),
    },
];

/// Migration 11: the per-destination due index, built concurrently, then the index it replaces
/// dropped.
const LANES: &[Step] = &[
    Step {
        what: "build the per-destination due index of the deliveries",
        unless: None,
        action: Action::Index {
            name: "{qname:deliveries_lane_idx}",
            table: "{qname:deliveries}",
            sql: include_str!("migrations/0011_lanes/lane_idx.sql"),
        },
    },
    Step {
        what: "drop the deliveries' old due index",
        unless: None,
        action: Action::Statement(include_str!("migrations/0011_lanes/drop_due_idx.sql")),
    },
];

/// Migration 15: the published rows and the history indexed in replay order, `(published_at,
/// seq)`, each replacing the index on `published_at` alone (built first: cleanup and EventSearch
/// always have one of them).
const REPLAY_INDEX: &[Step] = &[
    Step {
        what: "build the published-rows index in replay order",
        unless: None,
        action: Action::Index {
            name: "{qname:published_seq_idx}",
            table: "{outbox}",
            sql: include_str!("migrations/0015_replay_index/published_seq_idx.sql"),
        },
    },
    Step {
        what: "drop the published-rows index on published_at alone",
        unless: None,
        action: Action::Statement("DROP INDEX CONCURRENTLY IF EXISTS {qname:published_idx}"),
    },
    Step {
        what: "build the history's index in replay order, partition by partition",
        unless: None,
        action: Action::PartitionedIndex {
            name: "{qname:history_published_seq_idx}",
            table: "{qname:history}",
            sql: include_str!("migrations/0015_replay_index/history_published_seq_idx.sql"),
            columns: "(published_at, seq)",
        },
    },
    Step {
        what: "drop the history's index on published_at alone",
        unless: None,
        action: Action::Transaction(include_str!("migrations/0015_replay_index/drop_old.sql")),
    },
];

/// Migration 4: one index, built concurrently.
const KEY_ORDER_INDEX: &[Step] = &[Step {
    what: "build the per-key ordering index",
    unless: None,
    action: Action::Index {
        name: "{qname:key_idx}",
        table: "{outbox}",
        sql: include_str!("migrations/0004_key_order_index.sql"),
    },
}];

/// Advisory lock key shared by every `migrate`, whatever the table.
#[cfg(feature = "sqlx08")]
pub(crate) const MIGRATE_LOCK_KEY: i64 = 0x7067_6f75_7462_6f78; // "pgoutbox"

/// The registry of applied migrations, one per schema; shared with the inbox's migrations
/// ([`crate::inbox::migrate`]), which record themselves under `inbox:<table>`.
#[cfg(feature = "sqlx08")]
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

#[cfg(feature = "sqlx08")]
/// Brings `table` (and its schema) up to [`CURRENT_VERSION`], online: see the [module](self)
/// documentation. The run takes one connection of `pool` for itself and closes it at the end.
///
/// ```no_run
/// # async fn f(pool: sqlx::PgPool) -> pgoutbox_core::Result<()> {
/// let report = pgoutbox_core::schema::migrate(&pool, &pgoutbox_core::OutboxTable::default_table()).await?;
/// println!("at version {}", report.version);
/// # Ok(()) }
/// ```
pub async fn migrate(pool: &PgPool, table: &OutboxTable) -> Result<MigrateReport> {
    runner::run_migrations(
        pool,
        table.schema(),
        table.table().as_str(),
        MIGRATIONS,
        CURRENT_VERSION,
        &|sql| table.render(sql),
    )
    .await
}

#[cfg(feature = "sqlx08")]
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

#[cfg(feature = "sqlx08")]
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

#[cfg(feature = "sqlx08")]
/// Grants `role` what the relay needs, and nothing more: USAGE on the schema, SELECT, UPDATE and
/// DELETE on the outbox table, SELECT, INSERT, UPDATE and DELETE on its destinations' state and
/// definitions (the console in the relay's process adds, changes and removes them) and SELECT and
/// UPDATE on their version, SELECT, INSERT and UPDATE on its rate
/// limits' buckets and its replays, SELECT, INSERT,
/// UPDATE and DELETE on its deliveries table and its held batches (UPDATE: `FOR UPDATE`), SELECT,
/// INSERT and DELETE on its history and the console's shared samples, SELECT and INSERT on the
/// audit log (the console in the relay's process records operators' changes), SELECT on the
/// migrations registry. Run as the table's owner.
/// Partitions of the history are created and dropped by their owner only: with
/// `history = "partitions"`, run `pgoutbox cleanup` as the owner (see docs/operations.md).
pub async fn grant_relay(
    conn: &mut PgConnection,
    table: &OutboxTable,
    role: &crate::table::Ident,
) -> Result<()> {
    let sql = table.render(&format!(
        "GRANT USAGE ON SCHEMA {{schema}} TO {role};
         GRANT {privileges} ON {{outbox}} TO {role};
         GRANT SELECT, INSERT, UPDATE, DELETE ON {{qname:destinations}} TO {role};
         GRANT SELECT, INSERT, UPDATE, DELETE ON {{qname:definitions}} TO {role};
         GRANT SELECT, UPDATE ON {{qname:definitions_version}} TO {role};
         GRANT SELECT, INSERT, UPDATE ON {{qname:rates}} TO {role};
         GRANT SELECT, INSERT, UPDATE ON {{qname:replays}} TO {role};
         GRANT SELECT, INSERT, DELETE ON {{qname:samples}} TO {role};
         GRANT SELECT, INSERT ON {{qname:audit}} TO {role};
         GRANT SELECT, INSERT, UPDATE, DELETE ON {{qname:deliveries}} TO {role};
         GRANT SELECT, INSERT, UPDATE, DELETE ON {{qname:held_batches}} TO {role};
         GRANT USAGE ON SEQUENCE {{qname:held_batches_id_seq}} TO {role};
         GRANT SELECT, INSERT, DELETE ON {{qname:attempts}} TO {role};
         GRANT SELECT, INSERT, DELETE ON {{qname:history}} TO {role};
         GRANT SELECT ON {{schema}}.pgoutbox_migrations TO {role};",
        role = role.quoted(),
        privileges = RELAY_TABLE_PRIVILEGES.join(", ")
    ));
    sqlx::raw_sql(&sql).execute(conn).await?;
    Ok(())
}

#[cfg(feature = "sqlx08")]
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

#[cfg(feature = "sqlx08")]
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
