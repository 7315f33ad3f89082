//! The replication slot and publication of `source = "wal"`: start-up checks with clear errors,
//! the operator's `pgoutbox slot create|drop|status`, and the slot's health for metrics.
//!
//! The relay never creates or drops a slot by itself: a slot pins WAL until it is dropped, and a
//! slot dropped by mistake loses the events that only live in the WAL (`emit()` messages). It
//! creates the publication if it is missing, which costs nothing until a slot reads it.
//!
//! The statements are the store's ([`crate::store::slot`]); this module decides what their
//! answers mean and says it in words an operator can act on.

use sqlx::PgPool;

pub use crate::store::slot::SlotStatus;

use crate::config::WalConfig;
use crate::store::{self, slot as sql};
use crate::table::{Ident, OutboxTable};

/// Oldest PostgreSQL the WAL source runs on: 14 added `pgoutput`'s `messages` option, which
/// `emit()` events need.
pub const MIN_SERVER_VERSION: i32 = 140_000;

/// First PostgreSQL whose logical slots can follow a failover (`failover` at creation, synced to
/// standbys that set `sync_replication_slots`).
pub const FAILOVER_SLOT_VERSION: i32 = 170_000;

/// Why the WAL source cannot run, in words an operator can act on.
#[derive(Debug, thiserror::Error)]
pub enum SlotError {
    /// A query failed.
    #[error("database error")]
    Database(#[from] sqlx::Error),
    /// The server or the role is not set up for logical replication.
    #[error("{0}")]
    NotReady(String),
    /// There is no slot of that name on the server (never created, dropped, or not on a
    /// promoted standby: lost in a failover).
    #[error("replication slot {0} does not exist: create it with `pgoutbox slot create` (the relay never creates or drops a slot by itself)")]
    Missing(String),
}

impl From<crate::Error> for SlotError {
    fn from(e: crate::Error) -> Self {
        match e {
            crate::Error::Database(e) => Self::Database(e),
            other => Self::NotReady(crate::error_chain(&other)),
        }
    }
}

/// The slot and publication names of one outbox table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Names {
    /// The logical replication slot.
    pub slot: String,
    /// The publication of the outbox table's inserts.
    pub publication: String,
}

impl Names {
    /// The names configured for `table` (or their defaults).
    pub fn of(wal: &WalConfig, table: &OutboxTable) -> Self {
        Self {
            slot: wal.slot_name(table),
            publication: wal.publication_name(table),
        }
    }
}

/// Checks that the server can serve the WAL source: `wal_level = logical`, PostgreSQL 14 or
/// newer, and a role with the REPLICATION attribute. Returns warnings worth logging (no
/// `max_slot_wal_keep_size`: a relay that is down for long fills the disk with WAL).
pub async fn check_server(pool: &PgPool) -> Result<Vec<String>, SlotError> {
    check_setup(&sql::server_setup(pool).await?)
}

/// What [`check_server`] decides from the server's answers.
fn check_setup(setup: &sql::ServerSetup) -> Result<Vec<String>, SlotError> {
    let sql::ServerSetup {
        wal_level,
        version,
        replication,
        keep_size,
        role,
    } = setup;
    let version = *version;
    if version < MIN_SERVER_VERSION {
        return Err(SlotError::NotReady(format!(
            "source = \"wal\" needs PostgreSQL 14 or newer (this server is {}.{}); use source = \"poll\"",
            version / 10_000,
            version % 10_000 / 100
        )));
    }
    if wal_level != "logical" {
        return Err(SlotError::NotReady(format!(
            "source = \"wal\" needs wal_level = logical, and this server has wal_level = {wal_level}: \
             run ALTER SYSTEM SET wal_level = logical and restart PostgreSQL, or use source = \"poll\""
        )));
    }
    if *replication != Some(true) {
        return Err(SlotError::NotReady(format!(
            "source = \"wal\" needs a role with the REPLICATION attribute, and {role} has none: \
             ALTER ROLE {role} REPLICATION (pg_hba.conf must also let it in for replication)"
        )));
    }
    let mut warnings = Vec::new();
    if keep_size == "-1" {
        warnings.push(
            "max_slot_wal_keep_size is unset (-1): while the relay is down, its slot keeps every \
             WAL segment and can fill the disk; set it (ALTER SYSTEM SET max_slot_wal_keep_size = '50GB'), \
             and the rows still pending in the table remain deliverable by source = \"poll\" if the slot is ever lost"
                .to_owned(),
        );
    }
    Ok(warnings)
}

/// The slot's status, `None` when there is no slot of that name.
pub async fn status(pool: &PgPool, names: &Names) -> Result<Option<SlotStatus>, SlotError> {
    Ok(sql::slot_status(pool, &names.slot).await?)
}

/// Creates the publication of the outbox table's inserts if it is missing (`CREATE PUBLICATION`
/// takes no lock that blocks writers). Returns whether it was created.
pub async fn ensure_publication(
    pool: &PgPool,
    table: &OutboxTable,
    names: &Names,
) -> Result<bool, SlotError> {
    if sql::publication_publishes(pool, &names.publication, table).await? {
        return Ok(false);
    }
    if sql::publication_exists(pool, &names.publication).await? {
        return Err(SlotError::NotReady(format!(
            "publication {} exists but does not publish {table}: \
             ALTER PUBLICATION {} ADD TABLE {}, or configure another wal.publication",
            names.publication,
            names.publication,
            table.qualified()
        )));
    }
    // Validated identifiers (config), quoted: the only DDL here built from names.
    let publication =
        Ident::parse(&names.publication).map_err(|e| SlotError::NotReady(e.to_string()))?;
    sql::create_publication(pool, &publication, table).await?;
    Ok(true)
}

/// What `slot create` did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Created {
    /// The publication was created (false: it was there).
    pub publication: bool,
    /// The slot was created at this position (`None`: it was there).
    pub slot_at: Option<String>,
    /// The slot was created as a failover slot (PostgreSQL 17+).
    pub failover: bool,
}

/// Creates the publication and the slot (`pgoutput`) where missing, after the server checks.
/// Events committed from then on are read from the slot; rows already pending in the table are
/// not in its WAL (see docs/wal.md on switching from `poll`).
pub async fn create(
    pool: &PgPool,
    table: &OutboxTable,
    names: &Names,
) -> Result<Created, SlotError> {
    let setup = sql::server_setup(pool).await?;
    check_setup(&setup)?;
    let failover = setup.version >= FAILOVER_SLOT_VERSION;
    let publication = ensure_publication(pool, table, names).await?;
    let slot_at = match status(pool, names).await? {
        Some(existing) => {
            check_slot(&existing, pool).await?;
            None
        }
        None => Some(sql::create_slot(pool, &names.slot, failover).await?),
    };
    Ok(Created {
        publication,
        failover: failover && slot_at.is_some(),
        slot_at,
    })
}

/// What `slot drop` may do.
#[derive(Debug, Clone, Copy, Default)]
pub struct DropOptions {
    /// Also drop the publication.
    pub publication: bool,
    /// Drop even when the slot holds `emit()` events not yet delivered (they are lost).
    pub force: bool,
}

/// Drops the slot (and the publication when asked). Refused while a relay streams from it, and
/// while it holds `table`'s `emit()` events not yet delivered unless forced (they live nowhere
/// else). Returns whether there was a slot to drop.
pub async fn drop(
    pool: &PgPool,
    names: &Names,
    table: &OutboxTable,
    options: DropOptions,
) -> Result<bool, SlotError> {
    let dropped = match status(pool, names).await? {
        Some(s) if s.active => {
            return Err(SlotError::NotReady(format!(
                "slot {} is in use by a relay (backend pid {}): stop the relays reading it first",
                names.slot,
                s.active_pid.unwrap_or_default()
            )))
        }
        Some(s) if !options.force => {
            let held = sql::undelivered_emits(pool, &names.slot, &names.publication, table).await?;
            if held > 0 {
                return Err(SlotError::NotReady(format!(
                    "slot {} holds {held} {}_emit() events not yet delivered ({} bytes of WAL \
                     past its confirmed position {}): they exist nowhere else and are lost with \
                     it. Start a relay with source = \"wal\" to deliver them first, or pass \
                     --force to drop them",
                    names.slot,
                    table.table().as_str(),
                    s.lag_bytes.unwrap_or_default(),
                    s.confirmed_flush_lsn.as_deref().unwrap_or("?"),
                )));
            }
            sql::drop_slot(pool, &names.slot).await?;
            true
        }
        Some(_) => {
            sql::drop_slot(pool, &names.slot).await?;
            true
        }
        None => false,
    };
    if options.publication {
        let publication =
            Ident::parse(&names.publication).map_err(|e| SlotError::NotReady(e.to_string()))?;
        sql::drop_publication(pool, &publication).await?;
    }
    Ok(dropped)
}

/// Checks an existing slot: in this database, `pgoutput`, WAL not lost.
async fn check_slot(slot: &SlotStatus, pool: &PgPool) -> Result<(), SlotError> {
    let database = store::server::current_database(pool).await?;
    if slot.database.as_deref() != Some(database.as_str()) {
        return Err(SlotError::NotReady(format!(
            "slot {} belongs to database {}, not {database}: configure another wal.slot",
            slot.slot_name,
            slot.database
                .as_deref()
                .unwrap_or("(none: a physical slot)")
        )));
    }
    if slot.plugin.as_deref() != Some("pgoutput") {
        return Err(SlotError::NotReady(format!(
            "slot {} uses the output plugin {}, the relay reads pgoutput: configure another wal.slot",
            slot.slot_name,
            slot.plugin.as_deref().unwrap_or("(none)")
        )));
    }
    if slot.wal_status.as_deref() == Some("lost") {
        return Err(SlotError::NotReady(format!(
            "slot {} lost WAL it still needed (max_slot_wal_keep_size): events written with emit() \
             since its confirmed position are gone; outbox rows still pending are not. Deliver them \
             with source = \"poll\", then `pgoutbox slot drop` and `pgoutbox slot create` to go back to the WAL",
            slot.slot_name
        )));
    }
    Ok(())
}

/// Everything the relay checks before it reads the slot: the server, the slot (it must exist:
/// `pgoutbox slot create`), and the publication (created if missing). Returns warnings to log.
pub async fn ready(pool: &PgPool, table: &OutboxTable, names: &Names) -> Result<Ready, SlotError> {
    let warnings = check_server(pool).await?;
    let Some(slot) = status(pool, names).await? else {
        return Err(SlotError::Missing(names.slot.clone()));
    };
    check_slot(&slot, pool).await?;
    ensure_publication(pool, table, names).await?;
    Ok(Ready { warnings, slot })
}

/// What [`ready`] found: warnings for the operator, and the slot as it stands.
#[derive(Debug, Clone)]
pub struct Ready {
    /// Settings that work but deserve a look.
    pub warnings: Vec<String>,
    /// The slot's state (active, confirmed position, lag).
    pub slot: SlotStatus,
}
