//! What operators did and what the console charts: the audit log (`{qname:audit}`: one row per
//! change made through the console or the CLI) and the shared samples (`{qname:samples}`: each
//! relay's sample per gauge interval, the last hour, read summed over the relays).

use chrono::{DateTime, Utc};
use serde::Serialize;

use super::Store;
use crate::error::Result;
use crate::model::event::StoredJson;
use crate::table::OutboxTable;

/// AuditRecord: one change, after it was made.
const AUDIT_RECORD: &str = "INSERT INTO {qname:audit} (who, via, action, filter, matched)
    VALUES ($1, $2, $3, $4, $5)";

/// AuditList: newest first, before the id `$2` (a page's last), at most `$1`.
const AUDIT_LIST: &str = "SELECT id, at, who, via, action, filter::text AS filter, matched
    FROM {qname:audit} WHERE ($2::bigint IS NULL OR id < $2) ORDER BY id DESC LIMIT $1";

/// SampleWrite: this relay's sample, and every sample older than the chart's span gone (whichever
/// relay wrote it: one that stopped leaves none behind; the primary key's order finds them).
const SAMPLE_WRITE: &str = "WITH gone AS (
      DELETE FROM {qname:samples} WHERE at < $1 - make_interval(secs => $6))
    INSERT INTO {qname:samples} (at, relay, lag_seconds, pending, delivered)
    VALUES ($1, $2, $3, $4, $5) ON CONFLICT DO NOTHING";

/// SampleRead: the last span of samples, every relay's. At most one per relay per interval and
/// an hour's span: a few thousand rows for a few relays.
const SAMPLE_READ: &str = "SELECT at, relay, lag_seconds, pending, delivered::text AS delivered
    FROM {qname:samples} WHERE at > now() - make_interval(secs => $1) ORDER BY at";

/// This module's statements, rendered.
pub(super) struct Sql {
    audit_record: String,
    audit_list: String,
    sample_write: String,
    sample_read: String,
}

impl Sql {
    pub(super) fn render(table: &OutboxTable) -> Self {
        Self {
            audit_record: table.render(AUDIT_RECORD),
            audit_list: table.render(AUDIT_LIST),
            sample_write: table.render(SAMPLE_WRITE),
            sample_read: table.render(SAMPLE_READ),
        }
    }
}

/// One change as recorded.
#[derive(Debug, Clone)]
pub struct Change<'a> {
    /// Who: a console token's name, or `user@host` for the CLI.
    pub who: &'a str,
    /// Through what: `console` or `cli`.
    pub via: &'a str,
    /// What: `retry`, `discard`, `pause`, `resume`, `replay`.
    pub action: &'a str,
    /// Which events or destination (the filter as given).
    pub filter: serde_json::Value,
    /// How many events it changed.
    pub matched: u64,
}

/// One row of the audit log.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct AuditRow {
    /// Its number, increasing.
    pub id: i64,
    /// When.
    pub at: DateTime<Utc>,
    /// Who.
    pub who: String,
    /// Through what.
    pub via: String,
    /// What.
    pub action: String,
    /// Which events or destination.
    pub filter: StoredJson,
    /// How many events.
    pub matched: i64,
}

/// AuditRecord: records a change.
pub async fn record(store: &Store, change: &Change<'_>) -> Result<()> {
    record_on(store, store.pool().acquire().await?.as_mut(), change).await
}

/// AuditRecord on `conn`: inside another unit of work, so that the change and its line in the
/// log commit together.
pub(super) async fn record_on(
    store: &Store,
    conn: &mut sqlx::PgConnection,
    change: &Change<'_>,
) -> Result<()> {
    sqlx::query(&store.sql.operators.audit_record)
        .bind(change.who)
        .bind(change.via)
        .bind(change.action)
        .bind(&change.filter)
        .bind(i64::try_from(change.matched).unwrap_or(i64::MAX))
        .execute(conn)
        .await?;
    Ok(())
}

/// AuditList: at most `limit` changes, newest first, older than `before` (an id) when given.
pub async fn audit(store: &Store, limit: i64, before: Option<i64>) -> Result<Vec<AuditRow>> {
    Ok(sqlx::query_as(&store.sql.operators.audit_list)
        .bind(limit.clamp(1, 1000))
        .bind(before)
        .fetch_all(store.pool())
        .await?)
}

/// One relay's sample as stored.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct StoredSample {
    /// When it was taken.
    pub at: DateTime<Utc>,
    /// Which relay took it.
    pub relay: String,
    /// The oldest pending event's age then.
    pub lag_seconds: f64,
    /// Pending events then.
    pub pending: i64,
    /// Events per second that relay delivered, per destination (a JSON object).
    pub delivered: StoredJson,
}

/// A sample to store.
#[derive(Debug, Clone)]
pub struct NewSample<'a> {
    /// Which relay takes it.
    pub relay: &'a str,
    /// When.
    pub at: DateTime<Utc>,
    /// The oldest pending event's age.
    pub lag_seconds: f64,
    /// Pending events.
    pub pending: i64,
    /// Events per second this relay delivered since its last sample, per destination.
    pub delivered: serde_json::Value,
}

/// SampleWrite: stores a sample, forgetting every sample older than `span`.
pub async fn write_sample(
    store: &Store,
    sample: &NewSample<'_>,
    span: std::time::Duration,
) -> Result<()> {
    sqlx::query(&store.sql.operators.sample_write)
        .bind(sample.at)
        .bind(sample.relay)
        .bind(sample.lag_seconds)
        .bind(sample.pending)
        .bind(&sample.delivered)
        .bind(span.as_secs_f64())
        .execute(store.pool())
        .await?;
    Ok(())
}

/// SampleRead: every relay's samples of the last `span`, oldest first.
pub async fn samples(store: &Store, span: std::time::Duration) -> Result<Vec<StoredSample>> {
    Ok(sqlx::query_as(&store.sql.operators.sample_read)
        .bind(span.as_secs_f64())
        .fetch_all(store.pool())
        .await?)
}
