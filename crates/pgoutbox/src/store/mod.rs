//! The store: every SQL statement the relay and its commands run, and the binds that go with it.
//!
//! No other module of the relay writes SQL or binds a parameter: they call the functions here,
//! one per statement (River's driver interface), each taking named parameters (a params struct
//! where there are more than a few) and returning typed rows. Statements are rendered for the
//! configured outbox table once, when the [`Store`] is built; each says which index it uses and
//! which locks it takes. What an application runs itself (enqueue, the inbox, migrations) lives
//! in `pgoutbox-core`.
//!
//! A file per table or concern. The relay's own: the [`outbox`] table, the split events'
//! [`deliveries`] and the claims of those [`due`], the [`held_batches`], the rows and pairs [`held`] at 'infinity', the
//! [`destinations`]' shared state, the [`definitions`] of those managed at runtime, and the failed [`attempts`]. The operator's: [`dead`] letters,
//! the event search ([`inspect`]), the [`status`] and [`backlog`] counts, [`cleanup`] and the
//! partitioned [`history`]. Then the statements about the server rather than the outbox table,
//! which take a pool or a connection instead of a [`Store`] (nothing in them is rendered for a
//! table): its settings ([`server`]), the WAL source's [`slot`] and publication, and the
//! [`demo`]'s own tables.

pub mod attempts;
pub mod backlog;
pub mod cleanup;
pub mod dead;
pub mod definitions;
pub mod deliveries;
pub mod demo;
pub mod destinations;
pub mod due;
pub mod held;
pub mod held_batches;
pub mod history;
pub mod inspect;
pub mod operators;
pub mod outbox;
pub mod rates;
pub mod replays;
pub mod server;
pub mod settle;
pub mod slot;
pub mod status;

use std::sync::Arc;

use sqlx::pool::PoolConnection;
use sqlx::{PgConnection, PgPool, Postgres, Transaction};

use crate::table::OutboxTable;

/// The relay's database: a connection pool, the outbox table, and its statements.
#[derive(Clone)]
pub struct Store {
    pool: PgPool,
    table: OutboxTable,
    sql: Arc<Statements>,
}

/// Every statement, rendered for one outbox table.
struct Statements {
    attempts: attempts::Sql,
    backlog: backlog::Sql,
    cleanup: cleanup::Sql,
    dead: dead::Sql,
    definitions: definitions::Sql,
    deliveries: deliveries::Sql,
    destinations: destinations::Sql,
    due: due::Sql,
    held_batches: held_batches::Sql,
    history: history::Sql,
    inspect: inspect::Sql,
    operators: operators::Sql,
    outbox: outbox::Sql,
    settle: settle::Sql,
    rates: rates::Sql,
    replays: replays::Sql,
    status: status::Sql,
    held: held::Sql,
}

impl Statements {
    fn render(table: &OutboxTable) -> Self {
        Self {
            attempts: attempts::Sql::render(table),
            backlog: backlog::Sql::render(table),
            cleanup: cleanup::Sql::render(table),
            dead: dead::Sql::render(table),
            definitions: definitions::Sql::render(table),
            deliveries: deliveries::Sql::render(table),
            destinations: destinations::Sql::render(table),
            due: due::Sql::render(table),
            held_batches: held_batches::Sql::render(table),
            history: history::Sql::render(table),
            inspect: inspect::Sql::render(table),
            operators: operators::Sql::render(table),
            outbox: outbox::Sql::render(table),
            settle: settle::Sql::render(table),
            rates: rates::Sql::render(table),
            replays: replays::Sql::render(table),
            status: status::Sql::render(table),
            held: held::Sql::render(table),
        }
    }
}

impl Store {
    /// The store of `table`, reached through `pool`.
    pub fn new(pool: PgPool, table: OutboxTable) -> Self {
        let sql = Arc::new(Statements::render(&table));
        Self { pool, table, sql }
    }

    /// The connection pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The outbox table.
    pub fn table(&self) -> &OutboxTable {
        &self.table
    }

    /// A unit of work in one transaction: its statements commit together ([`Unit::commit`]), or
    /// not at all.
    pub async fn begin(&self) -> crate::error::Result<Unit> {
        Ok(Unit(Connection::Transaction(self.pool.begin().await?)))
    }

    /// A unit of work on one connection with no transaction: each statement commits by itself
    /// (writes fenced by a lease token need no more).
    pub async fn connect(&self) -> crate::error::Result<Unit> {
        Ok(Unit(Connection::Plain(self.pool.acquire().await?)))
    }

    /// Whether the database answers (readiness): one trivial statement.
    pub async fn ping(&self) -> crate::error::Result<()> {
        sqlx::query("SELECT 1").execute(&self.pool).await?;
        Ok(())
    }
}

/// Runs `statement` (one chunk of a cleanup: binds `$1` the age in seconds, `$2` the chunk size;
/// returns the rows deleted) until a chunk comes back short; returns the rows deleted and the
/// chunks run. Cleanup and the history's default partition both delete this way.
async fn delete_in_chunks(
    store: &Store,
    statement: &str,
    older_than: std::time::Duration,
    chunk_rows: i64,
) -> crate::error::Result<(u64, u64)> {
    let (mut rows, mut chunks) = (0, 0);
    loop {
        let (deleted,): (i64,) = sqlx::query_as(statement)
            .bind(older_than.as_secs_f64())
            .bind(chunk_rows)
            .fetch_one(store.pool())
            .await?;
        rows += deleted as u64;
        chunks += 1;
        if deleted < chunk_rows {
            return Ok((rows, chunks));
        }
    }
}

/// What settling a delivered event does to its outbox row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SettleMode {
    /// Keep it in the outbox, marked published (cleanup deletes it row by row after `retention`).
    Mark,
    /// Delete it (`retention = "0s"`).
    Delete,
    /// Move it to the partitioned history (`history = "partitions"`; cleanup drops partitions).
    Move,
}

impl SettleMode {
    /// The configuration's mode: retention zero deletes, else `history` decides.
    pub fn of(config: &crate::config::Config) -> Self {
        if config.retention.is_zero() {
            Self::Delete
        } else if config.history == crate::config::History::Partitions {
            Self::Move
        } else {
            Self::Mark
        }
    }
}

/// A lease: rows or pairs pushed out of the due range until its end, with a fencing token that
/// every later write of them must present.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    /// How long it holds.
    pub length: std::time::Duration,
    /// Its fencing token.
    pub token: uuid::Uuid,
}

/// A unit of work: statements on one connection of the store's pool, in one transaction
/// ([`Store::begin`]) or each on its own ([`Store::connect`]). Only the store opens one; the
/// layers above hand it back to the store's statements and end it.
pub struct Unit(Connection);

enum Connection {
    Transaction(Transaction<'static, Postgres>),
    Plain(PoolConnection<Postgres>),
}

impl Unit {
    /// Commits the unit's transaction (a unit with none has nothing left to commit).
    pub async fn commit(self) -> crate::error::Result<()> {
        if let Connection::Transaction(tx) = self.0 {
            tx.commit().await?;
        }
        Ok(())
    }

    /// Rolls the unit's transaction back: none of its statements took effect.
    pub async fn rollback(self) -> crate::error::Result<()> {
        if let Connection::Transaction(tx) = self.0 {
            tx.rollback().await?;
        }
        Ok(())
    }

    /// The connection its statements run on.
    fn conn(&mut self) -> &mut PgConnection {
        match &mut self.0 {
            Connection::Transaction(tx) => tx,
            Connection::Plain(conn) => conn,
        }
    }
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Store({})", self.table)
    }
}
