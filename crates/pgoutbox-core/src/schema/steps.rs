//! What a migration is made of: plain SQL, or online steps. Only data: `runner.rs` applies them
//! (with the `sqlx08` feature), and without it the SQL stays readable here and in `migrations/`.

#![cfg_attr(not(feature = "sqlx08"), allow(dead_code))]

/// One numbered migration (of the outbox table, or of the inbox).
pub(crate) struct Migration {
    /// Its version number, from 1.
    pub version: i32,
    /// What it does.
    pub description: &'static str,
    /// How it is applied.
    pub(crate) body: Body,
}

pub(crate) enum Body {
    /// One transaction; the version is recorded in it.
    Sql(&'static str),
    /// Steps committed one by one; the version is recorded after the last.
    Steps(&'static [Step]),
}

impl Migration {
    /// A plain-SQL migration: its template runs in one transaction (under the DDL lock timeout),
    /// which also records the version. For anything fast on a table of any size: new tables,
    /// functions, metadata-only `ALTER TABLE`s.
    pub const fn sql(version: i32, description: &'static str, sql: &'static str) -> Self {
        Self {
            version,
            description,
            body: Body::Sql(sql),
        }
    }

    /// A migration of online steps, for work that must not lock a large table for long.
    pub const fn steps(version: i32, description: &'static str, steps: &'static [Step]) -> Self {
        Self {
            version,
            description,
            body: Body::Steps(steps),
        }
    }
}

/// One step of a migration. Every step is idempotent: `unless` (a query returning one boolean,
/// true when the step's effect is already there) lets a resumed run skip what is done.
pub(crate) struct Step {
    /// What it does, for progress lines.
    pub what: &'static str,
    /// A probe: `SELECT <bool>`, true when this step has nothing left to do.
    pub unless: Option<&'static str>,
    /// The work.
    pub action: Action,
}

/// The kinds of step. Templates are rendered for the migrated table before they run.
pub(crate) enum Action {
    /// Short DDL in one transaction under a lock timeout, retried on a growing lock timeout (see `runner.rs`).
    Transaction(&'static str),
    /// One autocommit statement whose locks never block writes (`ANALYZE`, `VACUUM`,
    /// `DROP INDEX CONCURRENTLY`): no lock timeout, it may wait.
    Statement(&'static str),
    /// `CREATE [UNIQUE] INDEX CONCURRENTLY IF NOT EXISTS` (one statement, `sql`) of the index
    /// `name` (a schema-qualified template such as `{qname:seq_idx}`) on `table`.
    Index {
        name: &'static str,
        table: &'static str,
        sql: &'static str,
    },
    /// An index on a partitioned `table` without blocking its writes: `sql` creates the index
    /// `name` on the parent alone (`ON ONLY`, INVALID), then each partition's index of `columns`
    /// is built concurrently and attached, the last attach making the parent's valid.
    PartitionedIndex {
        name: &'static str,
        table: &'static str,
        sql: &'static str,
        columns: &'static str,
    },
    /// Batches: `batch` takes `$1` (rows per batch) and `$2` (the cursor: `i64::MIN` at first,
    /// then what the previous batch returned) and returns `(rows touched, next cursor)`; a NULL
    /// cursor ends the backfill. `total`, when given, counts the rows to do (for progress).
    Backfill {
        total: Option<&'static str>,
        batch: &'static str,
    },
    /// `SET NOT NULL` on a column of the outbox table through a validated CHECK constraint.
    NotNull { column: &'static str },
}
