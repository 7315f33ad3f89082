//! `<table>_replays`: retained events sent again to one destination (`pgoutbox replay`, the
//! console, a destination's `backfill`).
//!
//! A replay walks the retained events — published rows of the outbox (`retention`) and the
//! partitioned history — in `(published_at, seq, id)` order from its cursor. Each step is one
//! transaction ([`Step`]): the replay's row is locked (`SKIP LOCKED`: one relay feeds it at a
//! time, any relay may), the next events are read and sent by the relay, those the destination
//! did not take at once are left as pairs of its destination naming the replay in the deliveries
//! table (the retry scheduler takes them on: retried, dead-lettered, held while it is paused), and the
//! cursor moves on. A relay killed mid-step loses the lock with its connection; the step is then
//! sent again by the next relay (at least once, as always).

use chrono::{DateTime, Utc};
use sqlx::postgres::PgRow;
use sqlx::Row;
use uuid::Uuid;

use super::outbox::{self, EventColumns};
use super::Store;
use crate::error::Result;
use crate::model::event::OutboxEvent;
pub use crate::model::replay::{Change, Cursor, NewReplay, Replay, Selection, REPLAY_HEADER};
use crate::table::OutboxTable;

/// The selection's conditions on a retained table: published before the replay (`$4`; now
/// when NULL), created in `[$5, $6)`, of the topics `$7` and keys `$8` (NULL: any). `published_at`
/// is at least `created_at`, so the walk starts at `since` (`$1`).
const IN_RANGE: &str = "published_at IS NOT NULL AND published_at >= $1
      AND published_at <= coalesce($4, statement_timestamp())
      AND ($5::timestamptz IS NULL OR created_at >= $5)
      AND ($6::timestamptz IS NULL OR created_at < $6)
      AND ($7::text[] IS NULL OR topic = ANY($7)) AND ($8::text[] IS NULL OR key = ANY($8))";

/// ReplayRead. The next `$9` retained events after the cursor `($1, $2, $3)` in the selection
/// (IN_RANGE), from the outbox's published rows (`{name:published_seq_idx}`) and the history
/// (`{name:history_published_seq_idx}`, each partition's range), merged in cursor order: two
/// index range scans from the cursor, whatever the number of rows published at its instant. The
/// ORDER BY names the table's columns (`o.seq`, not the output's `seq`) for the index to give the
/// order; `seq` is never NULL in either table (an identity, copied). No locks.
const REPLAY_READ: &str = "
SELECT * FROM (
    (SELECT id, coalesce(seq, 0) AS seq, topic, key, payload::text AS payload,
            headers::text AS headers, coalesce(created_at, published_at) AS created_at,
            published_at, 0 AS attempts
     FROM {outbox} o
     WHERE {in_range} AND (o.published_at, o.seq, o.id) > ($1, $2, $3)
     ORDER BY o.published_at, o.seq, o.id LIMIT $9)
    UNION ALL
    (SELECT id, coalesce(seq, 0) AS seq, topic, key, payload::text AS payload,
            headers::text AS headers, coalesce(created_at, published_at) AS created_at,
            published_at, 0 AS attempts
     FROM {qname:history} h
     WHERE {in_range} AND (h.published_at, h.seq, h.id) > ($1, $2, $3)
     ORDER BY h.published_at, h.seq, h.id LIMIT $9)
) e
ORDER BY published_at, seq, id LIMIT $9";

/// ReplayCreate. A replay from its selection (`$1..$8`, `$1` its walk's start, `$4` NULL: it
/// sends what was published up to now), with what the selection holds now as its total (IN_RANGE
/// over both tables: the same index ranges as ReplayRead, counted). A backfill (`$9`) is created
/// only for a destination the relays have not registered yet (its first start), and once
/// (`{name:replays_backfill_idx}`).
const REPLAY_CREATE: &str = "
INSERT INTO {qname:replays} AS r (id, destination, since, until, topics, keys, filter, upto, rate,
                                  backfill, cursor_at, cursor_seq, cursor_id, total, created_by)
SELECT $10, $11, $5, $6, $7, $8, $12, coalesce($4, statement_timestamp()), $13, $9, $1, $2,
       '00000000-0000-0000-0000-000000000000',
       (SELECT count(*) FROM {outbox} WHERE {in_range})
       + (SELECT count(*) FROM {qname:history} WHERE {in_range}),
       coalesce($14, current_user)
WHERE NOT $9 OR NOT EXISTS (SELECT 1 FROM {qname:destinations} WHERE name = $11)
ON CONFLICT (destination) WHERE backfill DO NOTHING
RETURNING r.id";

/// ReplayCount. What a selection holds (`--dry-run`, before any filter): see ReplayCreate.
const REPLAY_COUNT: &str = "
SELECT (SELECT count(*) FROM {outbox} WHERE {in_range})
       + (SELECT count(*) FROM {qname:history} WHERE {in_range})";

/// The columns of a replay as [`Replay`] reads them, with its pairs still queued and dead
/// (`{name:deliveries_replay_idx}`).
const REPLAY_COLUMNS: &str = "r.id, r.destination, r.since, r.until, r.topics, r.keys, r.filter,
  r.upto, r.rate, r.backfill, r.state, r.total, r.read, r.queued, r.walked, r.error, r.created_by,
  r.created_at, r.updated_at, r.finished_at, r.cursor_at, r.cursor_seq, r.cursor_id,
  (SELECT count(*) FROM {qname:deliveries} d WHERE d.replay_id = r.id AND d.dead_at IS NULL)
    AS pending,
  (SELECT count(*) FROM {qname:deliveries} d WHERE d.replay_id = r.id AND d.dead_at IS NOT NULL)
    AS dead";

/// ReplayList. Replays newest first, those still running or paused before the others (a few
/// rows: sequential scan).
const REPLAY_LIST: &str = "
SELECT {columns} FROM {qname:replays} r
WHERE ($1::text IS NULL OR r.destination = $1)
ORDER BY r.state IN ('running', 'paused') DESC, r.created_at DESC
LIMIT $2";

/// ReplayGet. One replay (primary key).
const REPLAY_GET: &str = "SELECT {columns} FROM {qname:replays} r WHERE r.id = $1";

/// ReplayRunning. The running replays of the destinations `$1` (a few rows).
const REPLAY_RUNNING: &str = "
SELECT {columns} FROM {qname:replays} r
WHERE r.state = 'running' AND r.destination = ANY($1)
ORDER BY r.created_at";

/// ReplayLock. The replay `$1` if it is running and not walked to its end, locked until the
/// feeding transaction ends (`SKIP LOCKED`: a relay feeding it already is left to it).
const REPLAY_LOCK: &str = "
SELECT {columns} FROM {qname:replays} r
WHERE r.id = $1 AND r.state = 'running' AND NOT r.walked
FOR UPDATE SKIP LOCKED";

/// ReplayQueue. The chosen events of a step as pairs of the replay's destination (`$2`) naming it
/// (`$1`), their headers with the replay's. An event whose pair is there already (still
/// undelivered there) is not queued twice. Returns how many were queued.
const REPLAY_QUEUE: &str = "
WITH queued AS (
    INSERT INTO {qname:deliveries} (event_id, destination, seq, topic, key, payload, headers,
                                    created_at, replay_id)
    SELECT p.id, $2, p.seq, p.topic, p.key, coalesce(p.payload::jsonb, 'null'::jsonb),
           CASE WHEN jsonb_typeof(p.headers::jsonb) = 'object' THEN p.headers::jsonb
                ELSE '{}'::jsonb END || jsonb_build_object('{header}', $1::text),
           p.created_at, $1
    FROM unnest($3::uuid[], $4::bigint[], $5::text[], $6::text[], $7::text[], $8::text[],
                $9::timestamptz[]) AS p(id, seq, topic, key, payload, headers, created_at)
    ON CONFLICT (event_id, destination) DO NOTHING
    RETURNING 1
)
SELECT count(*) FROM queued";

/// ReplayAdvance. A step's end: the cursor (`$2..$4`), `$5` more read and `$6` more queued, and
/// whether the walk reached the end (`$7`). Primary key.
const REPLAY_ADVANCE: &str = "
UPDATE {qname:replays} SET cursor_at = $2, cursor_seq = $3, cursor_id = $4, read = read + $5,
    queued = queued + $6, walked = walked OR $7, updated_at = now()
WHERE id = $1";

/// ReplayFinish. A running replay walked to its end whose pairs are all delivered or dead is done.
const REPLAY_FINISH: &str = "
UPDATE {qname:replays} r SET state = 'done', finished_at = now(), updated_at = now()
WHERE r.id = $1 AND r.state = 'running' AND r.walked
  AND NOT EXISTS (SELECT 1 FROM {qname:deliveries} d WHERE d.replay_id = r.id AND d.dead_at IS NULL)";

/// ReplayFail. A replay that cannot run (its filter or rate does not read), with why.
const REPLAY_FAIL: &str = "
UPDATE {qname:replays} SET state = 'failed', error = $2, finished_at = now(), updated_at = now()
WHERE id = $1 AND state = 'running'";

/// ReplaySetState. An operator's change: pause (from running), resume (from paused), cancel
/// (from either; its undelivered pairs leave the deliveries table, dead ones stay for the
/// operator). Returns the replay's id when it changed.
const REPLAY_SET_STATE: &str = "
WITH changed AS (
    UPDATE {qname:replays} SET state = $2, updated_at = now(),
        finished_at = CASE WHEN $2 = 'cancelled' THEN now() END
    WHERE id = $1 AND state = ANY($3)
    RETURNING id
),
dropped AS (
    DELETE FROM {qname:deliveries} d USING changed
    WHERE $2 = 'cancelled' AND d.replay_id = changed.id AND d.dead_at IS NULL
)
SELECT id FROM changed";

/// The replays' statements, rendered.
pub(super) struct Sql {
    read: String,
    create: String,
    count: String,
    list: String,
    get: String,
    running: String,
    lock: String,
    queue: String,
    advance: String,
    finish: String,
    set_state: String,
    fail: String,
}

impl Sql {
    pub(super) fn render(table: &OutboxTable) -> Self {
        let r = |s: &str| {
            table.render(
                &s.replace("{in_range}", IN_RANGE)
                    .replace("{columns}", REPLAY_COLUMNS)
                    .replace("{header}", REPLAY_HEADER),
            )
        };
        Self {
            read: r(REPLAY_READ),
            create: r(REPLAY_CREATE),
            count: r(REPLAY_COUNT),
            list: r(REPLAY_LIST),
            get: r(REPLAY_GET),
            running: r(REPLAY_RUNNING),
            lock: r(REPLAY_LOCK),
            queue: r(REPLAY_QUEUE),
            advance: r(REPLAY_ADVANCE),
            finish: r(REPLAY_FINISH),
            set_state: r(REPLAY_SET_STATE),
            fail: r(REPLAY_FAIL),
        }
    }
}

impl Replay {
    fn from_row(row: &PgRow) -> Result<Self> {
        Ok(Self {
            id: row.try_get("id")?,
            destination: row.try_get("destination")?,
            since: row.try_get("since")?,
            until: row.try_get("until")?,
            topics: row
                .try_get::<Option<Vec<String>>, _>("topics")?
                .unwrap_or_default(),
            keys: row
                .try_get::<Option<Vec<String>>, _>("keys")?
                .unwrap_or_default(),
            filter: row.try_get("filter")?,
            upto: row.try_get("upto")?,
            rate: row.try_get("rate")?,
            backfill: row.try_get("backfill")?,
            state: row.try_get("state")?,
            total: row.try_get("total")?,
            read: row.try_get("read")?,
            queued: row.try_get("queued")?,
            pending: row.try_get("pending")?,
            dead: row.try_get("dead")?,
            walked: row.try_get("walked")?,
            error: row.try_get("error")?,
            created_by: row.try_get("created_by")?,
            created_at: row.try_get("created_at")?,
            updated_at: row.try_get("updated_at")?,
            finished_at: row.try_get("finished_at")?,
            cursor: Cursor {
                at: row.try_get("cursor_at")?,
                seq: row.try_get("cursor_seq")?,
                id: row.try_get("cursor_id")?,
            },
        })
    }
}

/// Where a walk with no `since` starts: before any event (PostgreSQL's `-infinity` would not
/// read back as a time).
fn beginning() -> DateTime<Utc> {
    DateTime::<Utc>::UNIX_EPOCH - chrono::Duration::days(365 * 70)
}

/// Binds a selection as `$1..$8` of IN_RANGE (`$2`, `$3` the cursor's `seq` and id; `$9` is
/// left to the statement).
fn bind_selection<'q>(
    query: sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>,
    selection: &'q Selection,
    cursor: Option<Cursor>,
    upto: Option<DateTime<Utc>>,
) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
    let start = cursor.map(|c| c.at).or(selection.since);
    let none = |v: &'q Vec<String>| (!v.is_empty()).then_some(v);
    query
        .bind(start.unwrap_or_else(beginning))
        // Before any seq: rows numbered by migration 2 have negative ones.
        .bind(cursor.map_or(i64::MIN, |c| c.seq))
        .bind(cursor.map_or(Uuid::nil(), |c| c.id))
        .bind(upto)
        .bind(selection.since)
        .bind(selection.until)
        .bind(none(&selection.topics))
        .bind(none(&selection.keys))
}

/// ReplayCreate: the replay of `new`; `None` for a backfill of a destination seen before.
pub async fn create(store: &Store, new: &NewReplay) -> Result<Option<Uuid>> {
    let id = Uuid::now_v7();
    let query = bind_selection(
        sqlx::query(&store.sql.replays.create),
        &new.selection,
        None,
        None,
    );
    let row = query
        .bind(new.backfill)
        .bind(id)
        .bind(&new.destination)
        .bind(new.filter.as_deref())
        .bind(new.rate.as_deref())
        .bind(new.created_by.as_deref())
        .fetch_optional(store.pool())
        .await?;
    Ok(row.map(|r| r.try_get(0)).transpose()?)
}

/// ReplayCount: the retained events `selection` holds now (before routing and filters).
pub async fn count(store: &Store, selection: &Selection) -> Result<i64> {
    let query = bind_selection(sqlx::query(&store.sql.replays.count), selection, None, None);
    Ok(query.fetch_one(store.pool()).await?.try_get(0)?)
}

/// One retained event as a replay reads it: the event (or why it cannot be read as one), its
/// place for the cursor, and its headers as stored.
#[derive(Debug)]
pub struct Retained {
    /// Where it is in the walk.
    pub cursor: Cursor,
    /// The event, or the reason the row cannot be read as one (it is then skipped).
    pub event: std::result::Result<OutboxEvent, String>,
    /// Its headers as stored (JSON text).
    pub headers: Option<String>,
}

fn retained_all(rows: &[PgRow]) -> Result<Vec<Retained>> {
    let Some(first) = rows.first() else {
        return Ok(Vec::new());
    };
    let at = EventColumns::of(first)?;
    rows.iter().map(|row| retained(row, &at)).collect()
}

fn retained(row: &PgRow, at: &EventColumns) -> Result<Retained> {
    Ok(Retained {
        cursor: Cursor {
            at: row.try_get("published_at")?,
            seq: row.try_get("seq")?,
            id: row.try_get("id")?,
        },
        event: outbox::event(row, at).map_err(|e| crate::error_chain(&e)),
        headers: row.try_get("headers")?,
    })
}

/// One page of a walk of the retained events outside a step (a dry run).
#[derive(Debug, Clone, Copy)]
pub struct Page<'a> {
    /// Which events.
    pub selection: &'a Selection,
    /// Published up to when (`None`: any time).
    pub upto: Option<DateTime<Utc>>,
    /// After which event (`None`: from the start).
    pub after: Option<Cursor>,
    /// Most events.
    pub limit: i64,
}

/// ReplayRead outside a step: one `page` of retained events, in walk order (`--dry-run`).
pub async fn read(store: &Store, page: &Page<'_>) -> Result<Vec<Retained>> {
    let query = bind_selection(
        sqlx::query(&store.sql.replays.read),
        page.selection,
        page.after,
        page.upto,
    );
    let rows = query.bind(page.limit).fetch_all(store.pool()).await?;
    retained_all(&rows)
}

/// ReplayList: the latest `limit` replays (of `destination` only, if given).
pub async fn list(store: &Store, destination: Option<&str>, limit: i64) -> Result<Vec<Replay>> {
    let rows = sqlx::query(&store.sql.replays.list)
        .bind(destination)
        .bind(limit)
        .fetch_all(store.pool())
        .await?;
    rows.iter().map(Replay::from_row).collect()
}

/// ReplayGet: the replay `id`, if there is one.
pub async fn get(store: &Store, id: Uuid) -> Result<Option<Replay>> {
    let row = sqlx::query(&store.sql.replays.get)
        .bind(id)
        .fetch_optional(store.pool())
        .await?;
    row.as_ref().map(Replay::from_row).transpose()
}

/// ReplayRunning: the running replays of `destinations`.
pub async fn running(store: &Store, destinations: &[String]) -> Result<Vec<Replay>> {
    let rows = sqlx::query(&store.sql.replays.running)
        .bind(destinations)
        .fetch_all(store.pool())
        .await?;
    rows.iter().map(Replay::from_row).collect()
}

/// One step of a replay, in one transaction that holds the replay's row lock (ReplayLock) until
/// [`Step::advance`] commits it: while the relay sends the step's events, no other relay feeds
/// the replay; a relay killed meanwhile drops the lock with its connection, and the step is
/// done again from the same cursor by whichever relay locks the replay next.
pub struct Step {
    tx: sqlx::Transaction<'static, sqlx::Postgres>,
    store: Store,
    /// The replay, as locked.
    pub replay: Replay,
}

/// ReplayLock: the next step of the replay `id`; `None` when it is not running, walked to its
/// end, or being fed by another relay.
pub async fn begin(store: &Store, id: Uuid) -> Result<Option<Step>> {
    let mut tx = store.pool().begin().await?;
    let row = sqlx::query(&store.sql.replays.lock)
        .bind(id)
        .fetch_optional(&mut *tx)
        .await?;
    let Some(row) = row else {
        return Ok(None);
    };
    Ok(Some(Step {
        replay: Replay::from_row(&row)?,
        tx,
        store: store.clone(),
    }))
}

impl Step {
    /// ReplayRead: up to `limit` events after the cursor.
    pub async fn read(&mut self, limit: i64) -> Result<Vec<Retained>> {
        let selection = self.replay.selection();
        let query = bind_selection(
            sqlx::query(&self.store.sql.replays.read),
            &selection,
            Some(self.replay.cursor),
            Some(self.replay.upto),
        );
        let rows = query.bind(limit).fetch_all(&mut *self.tx).await?;
        retained_all(&rows)
    }

    /// ReplayQueue: `events` (with their headers as stored) as pairs of the replay's
    /// destination, due now, for the retry scheduler; how many were queued.
    pub async fn queue(&mut self, events: &[&Retained]) -> Result<u64> {
        let mut pairs = Pairs::default();
        for r in events {
            if let Ok(event) = &r.event {
                pairs.push(event, r.headers.as_deref());
            }
        }
        if pairs.id.is_empty() {
            return Ok(0);
        }
        let queued: i64 = sqlx::query_scalar(&self.store.sql.replays.queue)
            .bind(self.replay.id)
            .bind(&self.replay.destination)
            .bind(&pairs.id)
            .bind(&pairs.seq)
            .bind(&pairs.topic)
            .bind(&pairs.key)
            .bind(&pairs.payload)
            .bind(&pairs.headers)
            .bind(&pairs.created_at)
            .fetch_one(&mut *self.tx)
            .await?;
        Ok(queued.max(0) as u64)
    }

    /// ReplayAdvance, then commit: the cursor moves past `read` (the last event read), `chosen`
    /// more were sent or queued, and the walk ended when `walked`.
    pub async fn advance(mut self, read: &[Retained], chosen: u64, walked: bool) -> Result<()> {
        let cursor = read.last().map_or(self.replay.cursor, |r| r.cursor);
        sqlx::query(&self.store.sql.replays.advance)
            .bind(self.replay.id)
            .bind(cursor.at)
            .bind(cursor.seq)
            .bind(cursor.id)
            .bind(read.len() as i64)
            .bind(chosen as i64)
            .bind(walked)
            .execute(&mut *self.tx)
            .await?;
        self.tx.commit().await?;
        Ok(())
    }
}

/// A step's chosen events, as the columns ReplayQueue unnests.
#[derive(Default)]
struct Pairs {
    id: Vec<Uuid>,
    seq: Vec<i64>,
    topic: Vec<String>,
    key: Vec<Option<String>>,
    payload: Vec<String>,
    headers: Vec<Option<String>>,
    created_at: Vec<DateTime<Utc>>,
}

impl Pairs {
    fn push(&mut self, event: &OutboxEvent, headers: Option<&str>) {
        self.id.push(event.id);
        self.seq.push(event.seq);
        self.topic.push(event.topic.clone());
        self.key.push(event.key.clone());
        self.payload.push(event.payload.get().to_owned());
        self.headers.push(headers.map(str::to_owned));
        self.created_at.push(event.created_at);
    }
}

/// ReplayFinish: whether the replay `id` is done now (walked, nothing left queued).
pub async fn finish(store: &Store, id: Uuid) -> Result<bool> {
    let done = sqlx::query(&store.sql.replays.finish)
        .bind(id)
        .execute(store.pool())
        .await?;
    Ok(done.rows_affected() > 0)
}

/// ReplaySetState: applies `change` to the replay `id`; false when its state does not allow it
/// (or there is no such replay).
pub async fn change(store: &Store, id: Uuid, change: Change) -> Result<bool> {
    let (to, from) = change.states();
    let changed: Option<Uuid> = sqlx::query_scalar(&store.sql.replays.set_state)
        .bind(id)
        .bind(to)
        .bind(from)
        .fetch_optional(store.pool())
        .await?;
    Ok(changed.is_some())
}

/// ReplayFail: the replay `id` cannot run, for `why`.
pub async fn fail(store: &Store, id: Uuid, why: &str) -> Result<()> {
    sqlx::query(&store.sql.replays.fail)
        .bind(id)
        .bind(why)
        .execute(store.pool())
        .await?;
    Ok(())
}
