//! The outbox table: claiming due rows, settling them (published, failed, held, dead), the
//! ordered claim's parking of a key's later rows, probes and `max_age` of held rows, and the rows
//! the WAL source writes for `emit()` events.
//!
//! Reads return events already decoded ([`ClaimedRow`]): a row that cannot be read as an event
//! (a NULL topic, headers that are not an object) comes back as such, with the reason, so that
//! the caller dead-letters it alone.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::value::RawValue;
use sqlx::postgres::PgRow;
use sqlx::{Column, Row};
use uuid::Uuid;

use super::{Lease, Store, Unit};
use crate::error::Result;
use crate::model::event::{parse_headers, OutboxEvent, StoredJson};
use crate::table::OutboxTable;

/// Columns the relay reads for each claimed event, in the order [`crate::OutboxEvent`] decodes them.
pub(super) const EVENT_COLUMNS: &str =
    "id, seq, topic, key, payload::text AS payload, headers::text AS headers, created_at, attempts";

/// OutboxAnyDue. What an idle relay polls instead of a claim: the first entry of the due range
/// of `{name:pending_idx}` from the watermark (`$1`, see OutboxWatermark), one statement and no
/// transaction or row lock, so a short `poll_interval` (the wait of the first event after a quiet
/// spell) costs little when idle.
const ANY_DUE: &str = "
SELECT EXISTS (
    SELECT 1 FROM {outbox}
    WHERE published_at IS NULL AND dead_at IS NULL AND next_attempt_at <= now()
      AND next_attempt_at >= coalesce($1, '-infinity'::timestamptz))";

/// OutboxWatermark. Where claims may start their walk of `{name:pending_idx}`: the due time of the
/// oldest pending row at or above `$2` (NULL: of all), or now if that is later, less `$1` seconds,
/// and never below `$2`. A plain read, so rows other relays hold count too. Rows that later appear
/// below it are only those a transaction still open now commits with an older due time (an
/// insert's is its transaction's start): `$1` covers short ones, the next read from the start the
/// others. Why a watermark at all: while a long transaction holds back vacuum, the index entries
/// of every row settled since it began stay in front of the due range, and a claim from the start
/// would step over all of them.
const WATERMARK: &str = "
SELECT greatest($2::timestamptz,
                least(now(), (SELECT next_attempt_at FROM {outbox}
                              WHERE published_at IS NULL AND dead_at IS NULL
                                AND next_attempt_at >= coalesce($2, '-infinity'::timestamptz)
                              ORDER BY next_attempt_at, seq LIMIT 1))
                - make_interval(secs => $1))";

/// OutboxClaimDue. Range scan of the partial index `{name:pending_idx}` on (next_attempt_at, seq),
/// from the watermark (`$2`, see OutboxWatermark; NULL: from the start): published, dead and
/// backing-off rows are not in that range, so the cost does not grow with history or with events
/// waiting for a retry. `FOR UPDATE SKIP LOCKED` takes row locks that last until the claiming transaction
/// settles, and lets concurrent relays take disjoint rows without waiting on each other.
const CLAIM_DUE: &str = "
SELECT {columns}
FROM {outbox}
WHERE published_at IS NULL AND dead_at IS NULL AND next_attempt_at <= now()
  AND next_attempt_at >= coalesce($2, '-infinity'::timestamptz)
ORDER BY next_attempt_at, seq
LIMIT $1
FOR UPDATE SKIP LOCKED";

/// OutboxClaimLease. Same index and row choice as OutboxClaimDue, but commits at once: the lease is
/// `next_attempt_at` pushed to the lease expiry (so the row leaves the due range until then) plus a
/// fresh `lease_token` that every later settle must present (fencing). The watermark is `$4`.
const CLAIM_LEASE: &str = "
WITH due AS (
    SELECT id FROM {outbox}
    WHERE published_at IS NULL AND dead_at IS NULL AND next_attempt_at <= now()
      AND next_attempt_at >= coalesce($4, '-infinity'::timestamptz)
    ORDER BY next_attempt_at, seq
    LIMIT $1
    FOR UPDATE SKIP LOCKED
)
UPDATE {outbox} AS o
SET next_attempt_at = now() + make_interval(secs => $2), lease_token = $3
FROM due
WHERE o.id = due.id
RETURNING o.id, o.seq, o.topic, o.key, o.payload::text AS payload, o.headers::text AS headers,
          o.created_at, o.attempts";

/// The shared head of the ordered claims. `heads`: due rows with no earlier unsettled row of the
/// same key (`{name:key_idx}` answers the NOT EXISTS with one index probe), locked SKIP LOCKED, so a
/// key is held by at most one relay at a time: its head row's lock (or lease) is the key's lock.
/// At most `$4` heads are taken (the relay adapts it to how many events a key carries).
/// The heads scan only looks at the first `$5` due rows (the window: its end is found by an
/// index-only walk of `{name:pending_idx}` and becomes an index condition). Without it, a claim that
/// finds every key held by other relays would probe every due row of the table before giving up;
/// the relay widens the window when it comes back empty, so keys beyond a long run of held-back
/// rows are still reached. Both walks start at the watermark (`$6`, see OutboxWatermark).
/// `followers`: up to `$2` later rows of each head's key, in seq order, so a hot key moves many
/// events per round trip. Rows that are not due (backoff) or dead for a destination with
/// `on_dead = "block"` (`$3`, their names) are returned with `due = false`; the relay cuts each key's chain there. `picked` keeps a seq
/// prefix of at most `$1` rows, so every kept follower keeps its head. Rows are read once, with
/// the event columns, in the CTEs themselves.
const ORDERED_PICK: &str = "
WITH heads AS (
    SELECT o.id, o.seq, o.topic, o.key, o.payload::text AS payload, o.headers::text AS headers,
           o.created_at, o.attempts, true AS due
    FROM {outbox} o
    WHERE o.published_at IS NULL AND o.dead_at IS NULL AND o.next_attempt_at <= now()
      AND o.next_attempt_at >= coalesce($6, '-infinity'::timestamptz)
      AND (o.next_attempt_at, o.seq) < (
            SELECT b.t, b.s FROM (
                (SELECT w.next_attempt_at AS t, w.seq AS s, 0 AS last FROM {outbox} w
                 WHERE w.published_at IS NULL AND w.dead_at IS NULL AND w.next_attempt_at <= now()
                   AND w.next_attempt_at >= coalesce($6, '-infinity'::timestamptz)
                 ORDER BY w.next_attempt_at, w.seq
                 OFFSET $5 LIMIT 1)
                UNION ALL SELECT 'infinity'::timestamptz, 0, 1) b
            ORDER BY b.last LIMIT 1)
      AND (o.key IS NULL OR NOT EXISTS (
            SELECT 1 FROM {outbox} p
            WHERE p.key = o.key AND p.seq < o.seq AND p.published_at IS NULL
              AND (p.dead_at IS NULL OR p.destination = ANY($3::text[]))))
    ORDER BY o.next_attempt_at, o.seq
    LIMIT $4
    FOR UPDATE SKIP LOCKED
),
followers AS (
    SELECT f.* FROM heads h
    CROSS JOIN LATERAL (
        SELECT f.id, f.seq, f.topic, f.key, f.payload::text AS payload, f.headers::text AS headers,
               f.created_at, f.attempts, (f.next_attempt_at <= now() AND f.dead_at IS NULL) AS due
        FROM {outbox} f
        WHERE h.key IS NOT NULL AND f.key = h.key AND f.seq > h.seq AND f.published_at IS NULL
          AND (f.dead_at IS NULL OR f.destination = ANY($3::text[]))
        ORDER BY f.seq
        LIMIT $2
        FOR UPDATE SKIP LOCKED
    ) f
),
picked AS (
    SELECT * FROM heads UNION ALL SELECT * FROM followers
    ORDER BY seq
    LIMIT $1
)";

/// OutboxClaimDueOrdered. See ORDERED_PICK; the locks last until the claiming transaction ends.
const CLAIM_DUE_ORDERED: &str = "
SELECT picked.*, (SELECT count(*) FROM heads) AS heads_found, (SELECT count(*) FROM followers) AS followers_found
FROM picked ORDER BY seq";

/// OutboxClaimLeaseOrdered. See ORDERED_PICK; due rows are leased like OutboxClaimLease.
const CLAIM_LEASE_ORDERED: &str = ",
leased AS (
    UPDATE {outbox} AS o
    SET next_attempt_at = now() + make_interval(secs => $7), lease_token = $8
    FROM picked
    WHERE o.id = picked.id AND picked.due
    RETURNING o.id
)
SELECT picked.*, (SELECT count(*) FROM heads) AS heads_found, (SELECT count(*) FROM followers) AS followers_found
FROM picked ORDER BY seq";

/// OutboxReleaseLease. Primary-key lookups, fenced by the token; used on shutdown so another
/// relay need not wait for the lease to expire.
const RELEASE_LEASE: &str = "
UPDATE {outbox} SET next_attempt_at = now(), lease_token = NULL
WHERE id = ANY($1) AND lease_token = $2";

/// OutboxLeaseMany. Transaction mode, a batch settled but for a few stragglers: they go under a
/// lease (expiry + fencing token) in the claim's transaction, which then commits, releasing the row
/// locks of everything else; their settle comes later, fenced by the token, like lease mode's.
/// Primary-key lookups.
const LEASE_MANY: &str = "
UPDATE {outbox} SET next_attempt_at = now() + make_interval(secs => $2), lease_token = $3
WHERE id = ANY($1)";

/// WalMaterialize. WAL source: rows for `emit()` events a destination did not take, inserted in
/// the settle's transaction just before the settle fans them out or dead-letters them (the
/// deliveries table and the console work from rows). Inserted *published*, which the WAL decoder
/// skips (the insert comes back through the slot), then made pending by WalUnmark: an UPDATE, which
/// the publication does not publish. Invisible to claims until that transaction commits, by which
/// time they are settled. In commit order, so that their `seq` (the retry path's per-key order)
/// follows it. `ON CONFLICT`: a batch read again after a crash keeps the row of its first settle.
const WAL_MATERIALIZE: &str = "
INSERT INTO {outbox} (id, topic, key, payload, headers, created_at, published_at)
SELECT m.id, m.topic, m.key, m.payload::jsonb, m.headers::jsonb, m.created_at, statement_timestamp()
FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[], $6::timestamptz[])
     WITH ORDINALITY AS m(id, topic, key, payload, headers, created_at, n)
ORDER BY m.n
ON CONFLICT (id) DO NOTHING
RETURNING id";

/// WalUnmark. See WalMaterialize: primary-key lookups of the rows it just inserted.
const WAL_UNMARK: &str = "UPDATE {outbox} SET published_at = NULL WHERE id = ANY($1)";

/// The outbox table's statements, rendered.
pub(super) struct Sql {
    any_due: String,
    watermark: String,
    claim_due: String,
    claim_lease: String,
    claim_due_ordered: String,
    claim_lease_ordered: String,
    release_lease: String,
    lease_many: String,
    wal_materialize: String,
    wal_unmark: String,
}

impl Sql {
    pub(super) fn render(table: &OutboxTable) -> Self {
        let r = |t: &str| table.render(&t.replace("{columns}", EVENT_COLUMNS));
        Self {
            any_due: r(ANY_DUE),
            watermark: r(WATERMARK),
            claim_due: r(CLAIM_DUE),
            claim_lease: r(CLAIM_LEASE),
            claim_due_ordered: r(&format!("{ORDERED_PICK}\n{CLAIM_DUE_ORDERED}")),
            claim_lease_ordered: r(&format!("{ORDERED_PICK}\n{CLAIM_LEASE_ORDERED}")),
            release_lease: r(RELEASE_LEASE),
            lease_many: r(LEASE_MANY),
            wal_materialize: r(WAL_MATERIALIZE),
            wal_unmark: r(WAL_UNMARK),
        }
    }
}

/// What keeps a claimed batch this relay's until it is settled.
pub enum Guard {
    /// The open claiming transaction, holding the row locks.
    Transaction(Unit),
    /// The lease's fencing token.
    Lease(Uuid),
    /// Nothing holds the rows (WAL batches: no claim took them): a settle that has something to
    /// write opens a transaction of its own.
    Nothing,
}

/// What a claim asks for.
#[derive(Debug, Clone, Copy)]
pub struct Claim<'a> {
    /// Most rows.
    pub limit: usize,
    /// `Some`: per-key ordered (heads and their followers).
    pub ordered: Option<OrderedClaim<'a>>,
    /// `Some`: leased (committed at once) rather than held by the transaction.
    pub lease: Option<Lease>,
    /// Where the walk of the due range starts (see [`watermark`]); `None`: from the start.
    pub watermark: Option<DateTime<Utc>>,
}

/// The ordered claim's sizing.
#[derive(Debug, Clone, Copy)]
pub struct OrderedClaim<'a> {
    /// Most keys (chain heads).
    pub heads: usize,
    /// Most later rows per head.
    pub followers: usize,
    /// Due rows, from the oldest, that the search for heads looks at (`i64::MAX`: all).
    pub window: i64,
    /// Destinations whose dead rows hold back their key.
    pub blocking: &'a [String],
}

/// What a claim found: its rows and, ordered, how many heads and followers (before the cut).
#[derive(Debug, Default)]
pub struct Claimed {
    /// The rows, in the statement's order.
    pub rows: Vec<ClaimedRow>,
    /// Ordered claims: heads and followers found.
    pub found: Option<(i64, i64)>,
}

fn to_i64(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// OutboxAnyDue: is a row due now, at or above `watermark`?
pub async fn any_due(store: &Store, watermark: Option<DateTime<Utc>>) -> Result<bool> {
    Ok(sqlx::query_scalar(&store.sql.outbox.any_due)
        .bind(watermark)
        .fetch_one(store.pool())
        .await?)
}

/// OutboxWatermark: where claims may start, `margin` below the oldest pending row at or above
/// `from` (or now), never below `from` (`None`: from the first entry).
pub async fn watermark(
    store: &Store,
    from: Option<DateTime<Utc>>,
    margin: Duration,
) -> Result<DateTime<Utc>> {
    Ok(sqlx::query_scalar(&store.sql.outbox.watermark)
        .bind(margin.as_secs_f64())
        .bind(from)
        .fetch_one(store.pool())
        .await?)
}

/// OutboxClaimDue, OutboxClaimLease, OutboxClaimDueOrdered or OutboxClaimLeaseOrdered, as
/// `claim` asks, in `unit` (the claiming transaction, or a plain connection for a lease).
pub async fn claim(store: &Store, unit: &mut Unit, claim: &Claim<'_>) -> Result<Claimed> {
    let sql = &store.sql.outbox;
    let limit = to_i64(claim.limit);
    let rows = match (claim.ordered, claim.lease) {
        (None, None) => {
            sqlx::query(&sql.claim_due)
                .bind(limit)
                .bind(claim.watermark)
                .fetch_all(unit.conn())
                .await?
        }
        (None, Some(lease)) => {
            sqlx::query(&sql.claim_lease)
                .bind(limit)
                .bind(lease.length.as_secs_f64())
                .bind(lease.token)
                .bind(claim.watermark)
                .fetch_all(unit.conn())
                .await?
        }
        (Some(o), lease) => {
            let statement = match lease {
                None => &sql.claim_due_ordered,
                Some(_) => &sql.claim_lease_ordered,
            };
            let query = sqlx::query(statement)
                .bind(limit)
                .bind(to_i64(o.followers))
                .bind(o.blocking)
                .bind(to_i64(o.heads))
                .bind(o.window)
                .bind(claim.watermark);
            match lease {
                None => query.fetch_all(unit.conn()).await?,
                Some(Lease { length, token }) => {
                    query
                        .bind(length.as_secs_f64())
                        .bind(token)
                        .fetch_all(unit.conn())
                        .await?
                }
            }
        }
    };
    let found = match (claim.ordered, rows.first()) {
        (Some(_), Some(row)) => Some((
            row.try_get::<i64, _>("heads_found")?,
            row.try_get::<i64, _>("followers_found")?,
        )),
        _ => None,
    };
    let rows = match rows.first() {
        Some(first) => {
            let at = ClaimColumns::of(first, claim.ordered.is_some())?;
            rows.iter()
                .map(|row| claimed_row(row, &at))
                .collect::<Result<_>>()?
        }
        None => Vec::new(),
    };
    Ok(Claimed { rows, found })
}

/// One claimed row: its event, or why it cannot be read as one.
#[derive(Debug)]
pub struct ClaimedRow {
    /// The primary key (it always decodes).
    pub id: Uuid,
    /// The key, when it could be read (ordered claims cut a key's chain at a bad row).
    pub key: Option<String>,
    /// Ordered claims: whether the row is due now (a follower may be in backoff or dead).
    pub due: bool,
    /// The event, or the reason the row cannot be read as one.
    pub event: std::result::Result<OutboxEvent, String>,
}

/// Where a result's event columns are. Found once per result ([`EventColumns::of`] its first
/// row): finding a column by name hashes and compares the name, and a claim of 1,000 rows would
/// do it 8,000 times (a sixth of decoding a claim, profiled).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct EventColumns {
    /// `id`.
    pub(super) id: usize,
    seq: usize,
    topic: usize,
    /// `key`.
    pub(super) key: usize,
    payload: usize,
    headers: usize,
    created_at: usize,
    attempts: usize,
}

impl EventColumns {
    /// The event columns of `row`'s result.
    pub(super) fn of(row: &PgRow) -> std::result::Result<Self, sqlx::Error> {
        let at = |name: &str| row.try_column(name).map(sqlx::Column::ordinal);
        Ok(Self {
            id: at("id")?,
            seq: at("seq")?,
            topic: at("topic")?,
            key: at("key")?,
            payload: at("payload")?,
            headers: at("headers")?,
            created_at: at("created_at")?,
            attempts: at("attempts")?,
        })
    }
}

/// Decodes a row selected with the table's event columns, which are `at` (found once for its
/// whole result).
pub(super) fn event(
    row: &PgRow,
    at: &EventColumns,
) -> std::result::Result<OutboxEvent, sqlx::Error> {
    let payload: String = column(row, at.payload, "payload")?;
    let payload = RawValue::from_string(payload).map_err(|e| sqlx::Error::ColumnDecode {
        index: "payload".into(),
        source: Box::new(e),
    })?;
    let headers: Option<&str> = column(row, at.headers, "headers")?;
    let headers = match headers {
        Some(text) => parse_headers(text).map_err(|message| sqlx::Error::ColumnDecode {
            index: "headers".into(),
            source: message.into(),
        })?,
        None => Vec::new(),
    };
    Ok(OutboxEvent {
        id: column(row, at.id, "id")?,
        seq: column(row, at.seq, "seq")?,
        topic: column(row, at.topic, "topic")?,
        key: column(row, at.key, "key")?,
        payload,
        headers,
        created_at: column(row, at.created_at, "created_at")?,
        attempts: column(row, at.attempts, "attempts")?,
    })
}

/// The value of column `name`, found at `at`: a decoding error names the column (what an operator
/// reads in `last_error`), not its position.
fn column<'r, T>(row: &'r PgRow, at: usize, name: &str) -> std::result::Result<T, sqlx::Error>
where
    T: sqlx::Decode<'r, sqlx::Postgres> + sqlx::Type<sqlx::Postgres>,
{
    row.try_get(at).map_err(|e| match e {
        sqlx::Error::ColumnDecode { source, .. } => sqlx::Error::ColumnDecode {
            index: name.into(),
            source,
        },
        other => other,
    })
}

/// Where a claim's columns are, found once per result (see [`EventColumns`]).
#[derive(Debug, Clone, Copy)]
pub(super) struct ClaimColumns {
    event: EventColumns,
    /// `due`, selected by ordered claims.
    due: Option<usize>,
}

impl ClaimColumns {
    /// The columns of `row`'s result (`due` too when `ordered`).
    pub(super) fn of(row: &PgRow, ordered: bool) -> Result<Self> {
        Ok(Self {
            event: EventColumns::of(row)?,
            due: match ordered {
                true => Some(row.try_column("due")?.ordinal()),
                false => None,
            },
        })
    }
}

/// Decodes a row selected with the event columns (`due` too when `ordered`).
pub(super) fn claimed_row(row: &PgRow, at: &ClaimColumns) -> Result<ClaimedRow> {
    Ok(ClaimedRow {
        id: row.try_get(at.event.id)?,
        key: row.try_get(at.event.key).ok().flatten(),
        due: match at.due {
            Some(due) => row.try_get(due)?,
            None => true,
        },
        event: event(row, &at.event).map_err(|e| crate::error_chain(&e)),
    })
}

impl sqlx::Type<sqlx::Postgres> for StoredJson {
    fn type_info() -> sqlx::postgres::PgTypeInfo {
        <String as sqlx::Type<sqlx::Postgres>>::type_info()
    }

    fn compatible(ty: &sqlx::postgres::PgTypeInfo) -> bool {
        <String as sqlx::Type<sqlx::Postgres>>::compatible(ty)
    }
}

impl<'r> sqlx::Decode<'r, sqlx::Postgres> for StoredJson {
    fn decode(
        value: sqlx::postgres::PgValueRef<'r>,
    ) -> std::result::Result<Self, sqlx::error::BoxDynError> {
        let text = <String as sqlx::Decode<sqlx::Postgres>>::decode(value)?;
        Ok(StoredJson::parse(text)?)
    }
}

/// OutboxReleaseLease: leased rows given back, due now (fenced by their `token`).
pub async fn release_lease(
    store: &Store,
    unit: &mut Unit,
    ids: &[Uuid],
    token: Uuid,
) -> Result<u64> {
    let done = sqlx::query(&store.sql.outbox.release_lease)
        .bind(ids)
        .bind(token)
        .execute(unit.conn())
        .await?;
    Ok(done.rows_affected())
}

/// OutboxLeaseMany: rows go under `lease` (in the claim's transaction).
pub async fn lease_many(store: &Store, unit: &mut Unit, ids: &[Uuid], lease: Lease) -> Result<()> {
    sqlx::query(&store.sql.outbox.lease_many)
        .bind(ids)
        .bind(lease.length.as_secs_f64())
        .bind(lease.token)
        .execute(unit.conn())
        .await?;
    Ok(())
}

/// WalMaterialize then WalUnmark: rows for `emit()` events that a destination did not take, in
/// the settle's transaction (see the statements). A row already there is kept.
pub async fn wal_materialize(
    store: &Store,
    unit: &mut Unit,
    events: &[&OutboxEvent],
) -> Result<()> {
    let headers: Vec<String> = events
        .iter()
        .map(|e| {
            serde_json::Value::Object(
                e.headers
                    .iter()
                    .map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone())))
                    .collect(),
            )
            .to_string()
        })
        .collect();
    let inserted: Vec<Uuid> = sqlx::query_scalar(&store.sql.outbox.wal_materialize)
        .bind(events.iter().map(|e| e.id).collect::<Vec<_>>())
        .bind(events.iter().map(|e| e.topic.as_str()).collect::<Vec<_>>())
        .bind(events.iter().map(|e| e.key.as_deref()).collect::<Vec<_>>())
        .bind(events.iter().map(|e| e.payload.get()).collect::<Vec<_>>())
        .bind(headers)
        .bind(events.iter().map(|e| e.created_at).collect::<Vec<_>>())
        .fetch_all(unit.conn())
        .await?;
    if !inserted.is_empty() {
        sqlx::query(&store.sql.outbox.wal_unmark)
            .bind(&inserted)
            .execute(unit.conn())
            .await?;
    }
    Ok(())
}
