//! `<table>_definitions`: the destinations managed at runtime, and the one version every change
//! moves. A change (add, update, remove) is one unit of work: the row, the version, the audit
//! log's line and the notification that wakes every relay commit together or not at all.

use chrono::{DateTime, Utc};
use serde::Serialize;

use super::operators::Change;
use super::Store;
use crate::error::Result;
use crate::table::OutboxTable;

/// DefinitionsVersion. What every relay reads each second (one row).
const DEFINITIONS_VERSION: &str = "SELECT version FROM {qname:definitions_version}";

/// DefinitionsAll. Every definition, with its sealed secrets and its stamp: what a relay loads
/// (the primary key's order: the same order in every relay).
const DEFINITIONS_ALL: &str = "
SELECT name, definition::text AS definition, secrets, secret_keys, created_at, updated_at,
       xmin::text::bigint AS stamp
FROM {qname:definitions} ORDER BY name";

/// DefinitionsStamps. Each definition's name and stamp, the transaction that last wrote its row
/// (`xmin`, which every insert and update changes): what a relay compares with the stamps it
/// holds to read again only the definitions that changed.
const DEFINITIONS_STAMPS: &str =
    "SELECT name, xmin::text::bigint AS stamp FROM {qname:definitions} ORDER BY name";

/// DefinitionsNamed. The definitions named in `$1`, with their sealed secrets and stamps.
const DEFINITIONS_NAMED: &str = "
SELECT name, definition::text AS definition, secrets, secret_keys, created_at, updated_at,
       xmin::text::bigint AS stamp
FROM {qname:definitions} WHERE name = ANY($1) ORDER BY name";

/// DefinitionsPage. A page of definitions after `$2` by name, those whose name or definition
/// contain `$3` (NULL: every one), at most `$1`: the primary key's order, so a page at 100,000
/// costs what the first does when nothing is searched.
const DEFINITIONS_PAGE: &str = "
SELECT name, definition::text AS definition, NULL::bytea AS secrets, secret_keys, created_at,
       updated_at
FROM {qname:definitions}
WHERE ($2::text IS NULL OR name > $2)
  AND ($3::text IS NULL OR strpos(lower(name), lower($3)) > 0
       OR strpos(lower(definition::text), lower($3)) > 0)
ORDER BY name LIMIT $1";

/// DefinitionGet. One definition, with its sealed secrets (an update keeps those not given).
const DEFINITION_GET: &str = "
SELECT name, definition::text AS definition, secrets, secret_keys, created_at, updated_at
FROM {qname:definitions} WHERE name = $1";

/// DefinitionInsert. A new destination; nothing when the name is taken.
const DEFINITION_INSERT: &str = "
INSERT INTO {qname:definitions} (name, definition, secrets, secret_keys)
VALUES ($1, $2::jsonb, $3, $4) ON CONFLICT (name) DO NOTHING";

/// DefinitionUpdate. A destination's new definition; nothing when there is none of that name.
const DEFINITION_UPDATE: &str = "
UPDATE {qname:definitions}
SET definition = $2::jsonb, secrets = $3, secret_keys = $4, updated_at = now()
WHERE name = $1";

/// DefinitionDelete. A destination removed; nothing when there is none of that name.
const DEFINITION_DELETE: &str = "DELETE FROM {qname:definitions} WHERE name = $1";

/// DefinitionsBump. The version moves, and every relay listening is told (`$1`: the channel).
const DEFINITIONS_BUMP: &str = "
WITH bumped AS (
  UPDATE {qname:definitions_version} SET version = version + 1 RETURNING version),
told AS (SELECT pg_notify($1, version::text) FROM bumped)
SELECT version FROM bumped, told";

/// DestinationUndelivered. The events routed to a destination and not delivered: its pairs
/// (failing, held, dead), its held batches' events, and the rows of events it alone takes that
/// are retrying or dead (each part served by an index on the destination, or the pending and dead
/// indexes).
const DESTINATION_UNDELIVERED: &str = "
SELECT (SELECT count(*) FROM {qname:deliveries} WHERE destination = $1)
     + (SELECT coalesce(sum(count), 0) FROM {qname:held_batches} WHERE destination = $1)
     + (SELECT count(*) FROM {outbox}
        WHERE published_at IS NULL AND dead_at IS NULL AND destination = $1 AND attempts > 0)
     + (SELECT count(*) FROM {outbox}
        WHERE dead_at IS NOT NULL AND published_at IS NULL AND destination = $1)";

/// DestinationDropEvents. What DestinationUndelivered counts, deleted (the removal said so).
const DESTINATION_DROP_EVENTS: [&str; 3] = [
    "DELETE FROM {qname:deliveries} WHERE destination = $1",
    "DELETE FROM {qname:held_batches} WHERE destination = $1",
    "DELETE FROM {outbox} WHERE published_at IS NULL AND destination = $1
       AND (attempts > 0 OR dead_at IS NOT NULL)",
];

/// The shared pause and breaker state of a removed destination: gone with it.
const DESTINATION_STATE_DELETE: &str = "DELETE FROM {qname:destinations} WHERE name = $1";

/// This module's statements, rendered.
pub(super) struct Sql {
    version: String,
    all: String,
    stamps: String,
    named: String,
    page: String,
    get: String,
    insert: String,
    update: String,
    delete: String,
    bump: String,
    undelivered: String,
    drop_events: [String; 3],
    state_delete: String,
    channel: String,
}

impl Sql {
    pub(super) fn render(table: &OutboxTable) -> Self {
        let r = |t: &str| table.render(t);
        Self {
            version: r(DEFINITIONS_VERSION),
            all: r(DEFINITIONS_ALL),
            stamps: r(DEFINITIONS_STAMPS),
            named: r(DEFINITIONS_NAMED),
            page: r(DEFINITIONS_PAGE),
            get: r(DEFINITION_GET),
            insert: r(DEFINITION_INSERT),
            update: r(DEFINITION_UPDATE),
            delete: r(DEFINITION_DELETE),
            bump: r(DEFINITIONS_BUMP),
            undelivered: r(DESTINATION_UNDELIVERED),
            drop_events: DESTINATION_DROP_EVENTS.map(r),
            state_delete: r(DESTINATION_STATE_DELETE),
            channel: channel(table),
        }
    }
}

/// The channel every change notifies: the table's qualified name, cut to what a channel name may
/// hold (63 bytes). Two tables that share a cut name only wake each other's relays for nothing.
pub fn channel(table: &OutboxTable) -> String {
    let mut name = format!(
        "pgoutbox:{}.{}",
        table.schema().as_str(),
        table.table().as_str()
    );
    name.truncate(63);
    name
}

/// A stored definition.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct StoredDefinition {
    /// The destination's name.
    pub name: String,
    /// Its definition without its secrets (a JSON object, as text).
    pub definition: String,
    /// Its sealed secrets (never read by a page of the list).
    #[serde(skip)]
    pub secrets: Option<Vec<u8>>,
    /// The names of its sealed keys.
    pub secret_keys: Vec<String>,
    /// When it was added.
    pub created_at: DateTime<Utc>,
    /// When it was last changed.
    pub updated_at: DateTime<Utc>,
    /// The transaction that last wrote it (read by a relay's loads only; 0 elsewhere).
    #[serde(skip)]
    #[sqlx(default)]
    pub stamp: i64,
}

/// A definition as written: its plain part and its sealed secrets.
#[derive(Debug, Clone, Copy)]
pub struct Written<'a> {
    /// The destination's name.
    pub name: &'a str,
    /// The definition without its secrets, a JSON object.
    pub definition: &'a serde_json::Value,
    /// Its sealed secrets, if it has any.
    pub secrets: Option<&'a [u8]>,
    /// The names of its sealed keys.
    pub secret_keys: &'a [String],
}

/// What a change did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// Done; the version it moved to.
    Done(i64),
    /// Adding: the name is taken. Updating or removing: there is none of that name.
    NoSuchName,
    /// Removing: the destination still has this many undelivered events (nothing changed).
    Undelivered(i64),
}

/// DefinitionsVersion: the version of the destinations managed at runtime.
pub async fn version(store: &Store) -> Result<i64> {
    let (v,): (i64,) = sqlx::query_as(&store.sql.definitions.version)
        .fetch_one(store.pool())
        .await?;
    Ok(v)
}

/// DefinitionsAll: every definition, with its sealed secrets.
pub async fn all(store: &Store) -> Result<Vec<StoredDefinition>> {
    Ok(sqlx::query_as(&store.sql.definitions.all)
        .fetch_all(store.pool())
        .await?)
}

/// DefinitionsStamps: each definition's name and stamp, by name.
pub async fn stamps(store: &Store) -> Result<Vec<(String, i64)>> {
    Ok(sqlx::query_as(&store.sql.definitions.stamps)
        .fetch_all(store.pool())
        .await?)
}

/// DefinitionsNamed: the definitions of `names` (those that still exist), by name.
pub async fn named(store: &Store, names: &[String]) -> Result<Vec<StoredDefinition>> {
    Ok(sqlx::query_as(&store.sql.definitions.named)
        .bind(names)
        .fetch_all(store.pool())
        .await?)
}

/// A page of the list: after which name, searching for what, how many.
#[derive(Debug, Clone, Default)]
pub struct Page<'a> {
    /// The last name of the page before (`None`: the first page).
    pub after: Option<&'a str>,
    /// Only those whose name or definition contain this, in any case (`None`: every one).
    pub search: Option<&'a str>,
    /// At most this many.
    pub limit: i64,
}

/// DefinitionsPage: one page of definitions, by name, without their sealed secrets.
pub async fn page(store: &Store, page: &Page<'_>) -> Result<Vec<StoredDefinition>> {
    Ok(sqlx::query_as(&store.sql.definitions.page)
        .bind(page.limit)
        .bind(page.after)
        .bind(page.search.filter(|s| !s.is_empty()))
        .fetch_all(store.pool())
        .await?)
}

/// DefinitionGet: one definition, with its sealed secrets.
pub async fn get(store: &Store, name: &str) -> Result<Option<StoredDefinition>> {
    Ok(sqlx::query_as(&store.sql.definitions.get)
        .bind(name)
        .fetch_optional(store.pool())
        .await?)
}

/// DefinitionInsert (or DefinitionUpdate when `update`), the version moved and the change audited,
/// in one unit of work.
pub async fn write(
    store: &Store,
    written: Written<'_>,
    update: bool,
    change: &Change<'_>,
) -> Result<Applied> {
    let sql = &store.sql.definitions;
    let mut tx = store.pool().begin().await?;
    let statement = if update { &sql.update } else { &sql.insert };
    let rows = sqlx::query(statement)
        .bind(written.name)
        .bind(written.definition)
        .bind(written.secrets)
        .bind(written.secret_keys)
        .execute(&mut *tx)
        .await?
        .rows_affected();
    if rows == 0 {
        tx.rollback().await?;
        return Ok(Applied::NoSuchName);
    }
    let version = finish(store, &mut tx, change).await?;
    tx.commit().await?;
    Ok(Applied::Done(version))
}

/// DefinitionDelete, refused while the destination has undelivered events unless `drop_events`
/// (then DestinationDropEvents); its shared state goes with it; the version moved and the change
/// audited with the events dropped, in one unit of work.
pub async fn remove(
    store: &Store,
    name: &str,
    drop_events: bool,
    change: &Change<'_>,
) -> Result<Applied> {
    let sql = &store.sql.definitions;
    let mut tx = store.pool().begin().await?;
    let deleted = sqlx::query(&sql.delete)
        .bind(name)
        .execute(&mut *tx)
        .await?
        .rows_affected();
    if deleted == 0 {
        tx.rollback().await?;
        return Ok(Applied::NoSuchName);
    }
    let (undelivered,): (i64,) = sqlx::query_as(&sql.undelivered)
        .bind(name)
        .fetch_one(&mut *tx)
        .await?;
    if undelivered > 0 && !drop_events {
        tx.rollback().await?;
        return Ok(Applied::Undelivered(undelivered));
    }
    let mut dropped = 0;
    if drop_events {
        for statement in &sql.drop_events {
            dropped += sqlx::query(statement)
                .bind(name)
                .execute(&mut *tx)
                .await?
                .rows_affected();
        }
    }
    sqlx::query(&sql.state_delete)
        .bind(name)
        .execute(&mut *tx)
        .await?;
    let change = Change {
        matched: undelivered.max(0) as u64,
        filter: serde_json::json!({ "destination": name, "dropped_events": undelivered, "rows_deleted": dropped }),
        ..change.clone()
    };
    let version = finish(store, &mut tx, &change).await?;
    tx.commit().await?;
    Ok(Applied::Done(version))
}

/// DestinationUndelivered: the events routed to `name` and not delivered.
pub async fn undelivered(store: &Store, name: &str) -> Result<i64> {
    let (n,): (i64,) = sqlx::query_as(&store.sql.definitions.undelivered)
        .bind(name)
        .fetch_one(store.pool())
        .await?;
    Ok(n)
}

/// DefinitionsBump and AuditRecord: the end of every change's unit of work.
async fn finish(
    store: &Store,
    tx: &mut sqlx::Transaction<'static, sqlx::Postgres>,
    change: &Change<'_>,
) -> Result<i64> {
    super::operators::record_on(store, tx, change).await?;
    let sql = &store.sql.definitions;
    let (version,): (i64,) = sqlx::query_as(&sql.bump)
        .bind(&sql.channel)
        .fetch_one(&mut **tx)
        .await?;
    Ok(version)
}

/// Listens for changes on `store`'s channel: a listener that wakes when a change commits.
pub async fn listen(store: &Store) -> Result<sqlx::postgres::PgListener> {
    let mut listener = sqlx::postgres::PgListener::connect_with(store.pool()).await?;
    listener.listen(&store.sql.definitions.channel).await?;
    Ok(listener)
}
