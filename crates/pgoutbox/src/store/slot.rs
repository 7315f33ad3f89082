//! The replication slot's and the publication's statements (`source = "wal"`): what the server
//! and the role allow, a slot's state in `pg_replication_slots`, and creating and dropping both.
//! What the answers mean (readiness, the operator's messages) is [`crate::sources::wal::slot`]'s.
//!
//! These read the server and its catalogs rather than the outbox table, so they take the pool,
//! not a [`super::Store`]: nothing in them is rendered for a table, and callers without one (a
//! bench's scratch server) run them too.

use sqlx::PgPool;

use crate::error::Result;
use crate::table::{Ident, OutboxTable};

/// ServerSetup. What the checks need from the server and the role, in one round trip.
const SERVER_SETUP: &str = "
SELECT current_setting('wal_level') AS wal_level,
       current_setting('server_version_num')::int AS version,
       (SELECT rolreplication OR rolsuper FROM pg_roles WHERE rolname = current_user) AS replication,
       current_setting('max_slot_wal_keep_size') AS keep_size,
       current_user AS role";

/// What the server and the role are set up for, as ServerSetup reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerSetup {
    /// `wal_level`.
    pub wal_level: String,
    /// `server_version_num`.
    pub version: i32,
    /// Whether the role has REPLICATION (or is a superuser); `None` when it is not in `pg_roles`.
    pub replication: Option<bool>,
    /// `max_slot_wal_keep_size` as the server writes it (`-1`: unset).
    pub keep_size: String,
    /// The role.
    pub role: String,
}

/// ServerSetup: the server's and the role's replication settings.
pub async fn server_setup(pool: &PgPool) -> Result<ServerSetup> {
    let (wal_level, version, replication, keep_size, role): (
        String,
        i32,
        Option<bool>,
        String,
        String,
    ) = sqlx::query_as(SERVER_SETUP).fetch_one(pool).await?;
    Ok(ServerSetup {
        wal_level,
        version,
        replication,
        keep_size,
        role,
    })
}

/// One slot as `pg_replication_slots` shows it.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct SlotStatus {
    /// The slot's name.
    pub slot_name: String,
    /// Its output plugin (must be `pgoutput`).
    pub plugin: Option<String>,
    /// Its database.
    pub database: Option<String>,
    /// Whether a session streams from it now.
    pub active: bool,
    /// That session's backend pid.
    pub active_pid: Option<i32>,
    /// The position up to which the relay confirmed delivery.
    pub confirmed_flush_lsn: Option<String>,
    /// WAL written since the confirmed position, in bytes: what the slot holds back.
    pub lag_bytes: Option<i64>,
    /// `reserved`, `extended`, `unreserved` or `lost` (the slot's WAL was removed).
    pub wal_status: Option<String>,
    /// Bytes that can still be written before the slot risks losing WAL (`max_slot_wal_keep_size`);
    /// NULL when that is unset.
    pub safe_wal_size: Option<i64>,
}

/// SlotStatus. One row of `pg_replication_slots`, with the lag computed against the current WAL
/// position.
const SLOT_STATUS: &str = "
SELECT slot_name::text, plugin::text, database::text, active, active_pid,
       confirmed_flush_lsn::text,
       pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::bigint AS lag_bytes,
       wal_status, safe_wal_size
FROM pg_replication_slots WHERE slot_name = $1";

/// SlotStatus: the slot named `slot`, `None` when there is none.
pub async fn slot_status(pool: &PgPool, slot: &str) -> Result<Option<SlotStatus>> {
    Ok(sqlx::query_as(SLOT_STATUS)
        .bind(slot)
        .fetch_optional(pool)
        .await?)
}

/// SlotCreate. A logical slot with `pgoutput`; returns the position it starts at.
const SLOT_CREATE: &str =
    "SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput')";

/// SlotCreateFailover. The same, as a failover slot (PostgreSQL 17+: not temporary, no two-phase,
/// `failover`): standbys with `sync_replication_slots` keep a copy that a promotion makes usable.
const SLOT_CREATE_FAILOVER: &str =
    "SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput', false, false, true)";

/// SlotCreate or SlotCreateFailover: creates the slot `slot`; returns its starting position.
pub async fn create_slot(pool: &PgPool, slot: &str, failover: bool) -> Result<String> {
    let sql = if failover {
        SLOT_CREATE_FAILOVER
    } else {
        SLOT_CREATE
    };
    Ok(sqlx::query_scalar(sql).bind(slot).fetch_one(pool).await?)
}

/// SlotUndelivered. The `<table>_emit()` events the slot holds past its confirmed position,
/// peeked (nothing is consumed) through the publication with messages on. A `pgoutput` message
/// (protocol version 1) is `M`, a flags byte, its LSN (8 bytes), then its NUL-terminated prefix:
/// the prefix starts at byte 11. Rows inserted into the table are not counted: they stay in the table, and a
/// polling relay delivers them. Fails while a session streams from the slot.
const SLOT_UNDELIVERED: &str = "
SELECT count(*) FROM pg_logical_slot_peek_binary_changes($1, NULL, NULL,
    'proto_version', '1', 'publication_names', $2, 'messages', 'true')
WHERE get_byte(data, 0) = 77 AND substring(data FROM 11 FOR $4) = $3";

/// SlotUndelivered: how many of `table`'s `emit()` events the slot holds undelivered (it decodes
/// the WAL from the slot's confirmed position: as long as that WAL is).
pub async fn undelivered_emits(
    pool: &PgPool,
    slot: &str,
    publication: &str,
    table: &OutboxTable,
) -> Result<i64> {
    let mut prefix = table.message_prefix().into_bytes();
    prefix.push(0);
    let len = prefix.len() as i32;
    Ok(sqlx::query_scalar(SLOT_UNDELIVERED)
        .bind(slot)
        .bind(publication)
        .bind(prefix)
        .bind(len)
        .fetch_one(pool)
        .await?)
}

/// SlotDrop. Fails while a session streams from the slot.
const SLOT_DROP: &str = "SELECT pg_drop_replication_slot($1)";

/// SlotDrop: drops the slot `slot`.
pub async fn drop_slot(pool: &PgPool, slot: &str) -> Result<()> {
    sqlx::query(SLOT_DROP).bind(slot).execute(pool).await?;
    Ok(())
}

/// PublicationStatus. Whether the publication exists and publishes the outbox table.
const PUBLICATION_STATUS: &str = "
SELECT EXISTS (SELECT FROM pg_publication_tables
               WHERE pubname = $1 AND schemaname = $2 AND tablename = $3)";

/// PublicationStatus: whether `publication` publishes `table`.
pub async fn publication_publishes(
    pool: &PgPool,
    publication: &str,
    table: &OutboxTable,
) -> Result<bool> {
    Ok(sqlx::query_scalar(PUBLICATION_STATUS)
        .bind(publication)
        .bind(table.schema().as_str())
        .bind(table.table().as_str())
        .fetch_one(pool)
        .await?)
}

/// PublicationExists. Whether a publication of that name exists, whatever it publishes.
const PUBLICATION_EXISTS: &str = "SELECT EXISTS (SELECT FROM pg_publication WHERE pubname = $1)";

/// PublicationExists: whether a publication named `publication` exists.
pub async fn publication_exists(pool: &PgPool, publication: &str) -> Result<bool> {
    Ok(sqlx::query_scalar(PUBLICATION_EXISTS)
        .bind(publication)
        .fetch_one(pool)
        .await?)
}

/// PublicationCreate: the publication of `table`'s inserts. `CREATE PUBLICATION` takes no lock
/// that blocks writers. Built from validated identifiers, quoted: the only DDL here made from
/// names.
pub async fn create_publication(
    pool: &PgPool,
    publication: &Ident,
    table: &OutboxTable,
) -> Result<()> {
    sqlx::query(&format!(
        "CREATE PUBLICATION {} FOR TABLE {} WITH (publish = 'insert')",
        publication.quoted(),
        table.qualified()
    ))
    .execute(pool)
    .await?;
    Ok(())
}

/// PublicationDrop: drops `publication` if it exists.
pub async fn drop_publication(pool: &PgPool, publication: &Ident) -> Result<()> {
    sqlx::query(&format!(
        "DROP PUBLICATION IF EXISTS {}",
        publication.quoted()
    ))
    .execute(pool)
    .await?;
    Ok(())
}

/// WalHeartbeat: a non-transactional logical decoding message with `prefix`, so that a quiet
/// slot's position moves on even when only other tables (or other databases) write.
pub async fn heartbeat(pool: &PgPool, prefix: &str) -> Result<()> {
    sqlx::query("SELECT pg_logical_emit_message(false, $1, '')")
        .bind(prefix)
        .execute(pool)
        .await?;
    Ok(())
}
