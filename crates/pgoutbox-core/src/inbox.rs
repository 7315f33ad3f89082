//! The inbox: exactly-once effects for consumers of an at-least-once stream.
//!
//! pgoutbox delivers every event at least once, so a consumer may see an event twice. The inbox
//! turns that into "applied once": in the **same transaction** as its own writes, the consumer
//! records `(consumer, event_id)` with [`Inbox::process_once`]:
//!
//! 1. first delivery: `process_once` returns `true` → apply the effect → commit. The inbox row and
//!    the effect commit together, or neither does.
//! 2. a later duplicate: returns `false` → skip the effect, commit (or roll back), acknowledge.
//! 3. concurrent duplicates: the second `INSERT` waits on the first transaction's primary-key
//!    entry. If the first commits, the second returns `false`; if it rolls back (or its connection
//!    dies after the effect but before commit), the second inserts, returns `true` and applies the
//!    effect itself. Either way the effect is applied once.
//!
//! ```no_run
//! # async fn f(pool: sqlx::PgPool, event_id: uuid::Uuid) -> pgoutbox_core::Result<()> {
//! let inbox = pgoutbox_core::inbox::Inbox::default(); // public.inbox
//! let mut tx = pool.begin().await?;
//! if inbox.process_once(&mut tx, "billing", event_id).await? {
//!     sqlx::query("UPDATE balances SET total = total + 10 WHERE customer = 'acme'")
//!         .execute(&mut *tx)
//!         .await?;
//! }
//! tx.commit().await?; // acknowledge (HTTP 2xx, broker ack) only after this
//! # Ok(()) }
//! ```
//!
//! Rows older than a retention are deleted by [`Inbox::cleanup`] in bounded batches. The retention
//! must be longer than any event can still be redelivered (the relay's `max_age`, plus time for a
//! `dead retry`): a duplicate arriving after its inbox row is gone is applied again.
//!
//! The table is created by `pgoutbox migrate --inbox` ([`migrate`]), versioned in the schema's
//! `pgoutbox_migrations` under `inbox:<table>`.

#[cfg(feature = "sqlx08")]
use std::time::Duration;

#[cfg(feature = "sqlx08")]
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

use crate::error::Result;
#[cfg(feature = "sqlx08")]
use crate::schema::MigrateReport;
use crate::schema::Migration;
use crate::table::Ident;

/// An inbox table (schema + name) and its statements, rendered once from validated identifiers.
#[derive(Clone, Debug)]
pub struct InboxTable {
    schema: Ident,
    table: Ident,
    process_once: String,
    cleanup: String,
}

impl InboxTable {
    /// The default inbox, `public.inbox`.
    pub fn default_table() -> Self {
        Self::new(
            Ident::parse("public").unwrap_or_else(|_| unreachable!("valid identifier")),
            Ident::parse("inbox").unwrap_or_else(|_| unreachable!("valid identifier")),
        )
    }

    /// Builds the table handle from raw names, validating both.
    pub fn parse(schema: &str, table: &str) -> Result<Self> {
        Ok(Self::new(Ident::parse(schema)?, Ident::parse(table)?))
    }

    /// Builds the table handle from validated names.
    pub fn new(schema: Ident, table: Ident) -> Self {
        let mut t = Self {
            schema,
            table,
            process_once: String::new(),
            cleanup: String::new(),
        };
        t.process_once = t.render(PROCESS_ONCE);
        t.cleanup = t.render(CLEANUP);
        t
    }

    /// The schema.
    pub fn schema(&self) -> &Ident {
        &self.schema
    }

    /// The table name.
    pub fn table(&self) -> &Ident {
        &self.table
    }

    /// `"schema"."table"`, ready for SQL.
    pub fn qualified(&self) -> String {
        format!("{}.{}", self.schema.quoted(), self.table.quoted())
    }

    /// The key this table's migrations are recorded under in `pgoutbox_migrations`; the colon
    /// cannot occur in an identifier, so it never collides with an outbox table's entry.
    pub fn registry_key(&self) -> String {
        format!("inbox:{}", self.table)
    }

    /// Replaces `{inbox}`, `{schema}` and `{processed_idx}` in a template.
    fn render(&self, template: &str) -> String {
        template
            .replace("{inbox}", &self.qualified())
            .replace("{schema}", &self.schema.quoted())
            .replace(
                "{processed_idx}",
                &format!("\"{}_processed_idx\"", self.table.as_str()),
            )
    }
}

impl std::fmt::Display for InboxTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.schema, self.table)
    }
}

/// InboxProcessOnce. A primary-key insert: `ON CONFLICT DO NOTHING` makes a duplicate a no-op
/// (0 rows), and a concurrent duplicate waits on the uncommitted key of the first transaction, so
/// exactly one of them sees 1 row. The row lock lasts until the caller's transaction ends.
const PROCESS_ONCE: &str = "
INSERT INTO {inbox} (consumer, event_id) VALUES ($1, $2)
ON CONFLICT (consumer, event_id) DO NOTHING";

/// InboxCleanup. One bounded batch: the oldest expired rows by the `processed_at` index, then
/// primary-key deletes. `SKIP LOCKED` leaves rows a consumer is touching right now alone, so
/// cleanup never waits on (or blocks) a consumer's transaction.
const CLEANUP: &str = "
WITH expired AS (
    SELECT consumer, event_id FROM {inbox}
    WHERE processed_at < now() - make_interval(secs => $1)
    ORDER BY processed_at
    LIMIT $2
    FOR UPDATE SKIP LOCKED
)
DELETE FROM {inbox} AS i
USING expired
WHERE i.consumer = expired.consumer AND i.event_id = expired.event_id";

const INBOX_0001: &str = include_str!("schema/migrations/inbox_0001_create.sql");

#[cfg_attr(not(feature = "sqlx08"), allow(dead_code))]
const INBOX_MIGRATIONS: &[Migration] = &[Migration::sql(1, "create the inbox table", INBOX_0001)];

/// The inbox schema version this build needs.
pub const INBOX_VERSION: i32 = 1;

#[cfg(feature = "sqlx08")]
/// Creates or upgrades the inbox table (and its schema). Idempotent, each migration
/// all-or-nothing, and serialized with every other `migrate` by the same advisory lock (held by a
/// connection of `pool` taken for the run and closed at its end).
pub async fn migrate(pool: &PgPool, table: &InboxTable) -> Result<MigrateReport> {
    crate::schema::run_migrations(
        pool,
        table.schema(),
        &table.registry_key(),
        INBOX_MIGRATIONS,
        INBOX_VERSION,
        &|sql| table.render(sql),
    )
    .await
}

/// Records processed events per consumer, for idempotent consumers.
#[derive(Clone, Debug)]
pub struct Inbox {
    table: InboxTable,
}

impl Default for Inbox {
    /// The inbox at `public.inbox`.
    fn default() -> Self {
        Self::new(InboxTable::default_table())
    }
}

/// What one [`Inbox::cleanup`] run deleted.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct InboxCleanupReport {
    /// Rows deleted.
    pub deleted: u64,
    /// Batches (statements) run.
    pub batches: u64,
}

impl Inbox {
    /// An inbox on a specific table.
    pub fn new(table: InboxTable) -> Self {
        Self { table }
    }

    /// The table.
    pub fn table(&self) -> &InboxTable {
        &self.table
    }

    #[cfg(feature = "sqlx08")]
    /// Records `event_id` as processed by `consumer` in the caller's transaction (`&mut *tx`):
    /// `true` the first time (apply the effect, then commit), `false` for a duplicate.
    ///
    /// Call it inside a transaction: on a bare connection the row commits at once, and an effect
    /// that then fails would never be retried.
    pub async fn process_once(
        &self,
        conn: &mut PgConnection,
        consumer: &str,
        event_id: Uuid,
    ) -> Result<bool> {
        let done = sqlx::query(&self.table.process_once)
            .bind(consumer)
            .bind(event_id)
            .execute(conn)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    /// [`Inbox::process_once`] through tokio-postgres (a `Transaction` is a `GenericClient`).
    #[cfg(feature = "tokio-postgres")]
    pub async fn process_once_pg<C: tokio_postgres::GenericClient>(
        &self,
        client: &C,
        consumer: &str,
        event_id: Uuid,
    ) -> Result<bool> {
        let n = client
            .execute(self.table.process_once.as_str(), &[&consumer, &event_id])
            .await?;
        Ok(n == 1)
    }

    /// [`Inbox::process_once`] through sqlx 0.9 (feature `sqlx09`; `&mut *tx` of a 0.9 transaction).
    #[cfg(feature = "sqlx09")]
    pub async fn process_once_sqlx09(
        &self,
        conn: &mut sqlx09::PgConnection,
        consumer: &str,
        event_id: Uuid,
    ) -> Result<bool> {
        // The statement is rendered from validated, quoted identifiers (see `InboxTable::parse`).
        let sql = sqlx09::AssertSqlSafe(self.table.process_once.clone());
        let done = sqlx09::query(sql)
            .bind(consumer)
            .bind(event_id)
            .execute(conn)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    #[cfg(feature = "sqlx08")]
    /// Deletes rows processed longer than `retention` ago, `batch` rows per statement (each its
    /// own short autocommit statement), until none is left.
    pub async fn cleanup(
        &self,
        conn: &mut PgConnection,
        retention: Duration,
        batch: i64,
    ) -> Result<InboxCleanupReport> {
        let mut report = InboxCleanupReport::default();
        let batch = batch.max(1);
        loop {
            let done = sqlx::query(&self.table.cleanup)
                .bind(retention.as_secs_f64())
                .bind(batch)
                .execute(&mut *conn)
                .await?;
            report.batches += 1;
            report.deleted += done.rows_affected();
            if done.rows_affected() < batch as u64 {
                return Ok(report);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statements_use_quoted_validated_names() {
        let t = InboxTable::parse("app", "seen").expect("valid");
        assert!(t.process_once.contains("INSERT INTO \"app\".\"seen\""));
        assert!(t.render(INBOX_0001).contains("\"seen_processed_idx\""));
        assert_eq!(t.registry_key(), "inbox:seen");
        assert!(InboxTable::parse("app", "x; drop").is_err());
    }
}
