//! Finding events: search the outbox (and the per-destination pairs of split events) by id, topic,
//! key, destination, state and time, a page at a time with a cursor; and one event whole, with
//! its payload, headers, where it stands at each destination and its failed attempts. The
//! operator console and its API use these; the CLI's `dead` commands are the dead-letter subset
//! (see [`super::dead`]).
//!
//! Statements are built from fixed fragments, one per filter given, with the values bound. Each
//! state is walked in the order of its partial index (see [`order`]) from the cursor on, so a page
//! costs its own rows, not the table; a lookup by id uses the primary key. A search is the one
//! statement assembled per call (from those fragments); the lookup's are rendered once (`Sql`).

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use sqlx::postgres::PgArguments;
use sqlx::Arguments;
use uuid::Uuid;

use super::Store;
use crate::error::Result;
use crate::model::event::StoredJson;
use crate::table::OutboxTable;

/// Where an event stands.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EventState {
    /// Not yet delivered, not dead.
    Pending,
    /// Dead-lettered.
    #[default]
    Dead,
    /// Delivered (kept until retention removes it).
    Published,
    /// Any of the above.
    All,
}

/// A search. Every field left `None` matches everything.
#[derive(Debug, Clone, Default)]
pub struct EventQuery {
    /// One event.
    pub id: Option<Uuid>,
    /// Which state.
    pub state: EventState,
    /// Exact topic.
    pub topic: Option<String>,
    /// Topics that start with this (`order.` finds `order.created` and `order.paid`).
    pub topic_prefix: Option<String>,
    /// Payloads that contain this JSON (`{"customer": "c-1"}`; PostgreSQL's `@>`): served by a
    /// GIN index on `payload` when the table has one, else checked on the rows the state's index
    /// walks.
    pub payload: Option<serde_json::Value>,
    /// Exact key.
    pub key: Option<String>,
    /// Exact destination.
    pub destination: Option<String>,
    /// Written at or after.
    pub since: Option<DateTime<Utc>>,
    /// Written before.
    pub until: Option<DateTime<Utc>>,
    /// Count the matches too (up to [`TOTAL_CAP`]).
    pub total: bool,
    /// Where the previous page ended (its `next_cursor`).
    pub after: Option<Cursor>,
    /// Page size (1 to 500).
    pub limit: i64,
}

/// One event (or one destination's pair of a split event) in a search result.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct EventRow {
    /// Event id.
    pub id: Uuid,
    /// Insert order; breaks ties between equal sort times in a page's order.
    pub seq: i64,
    /// Topic (`None`: the row has none; a table may allow it).
    pub topic: Option<String>,
    /// Key.
    pub key: Option<String>,
    /// The destination, once routed.
    pub destination: Option<String>,
    /// `pending`, `held`, `dead`, `published`, or `split` (the event row of a fanned-out event).
    pub state: String,
    /// Attempts made.
    pub attempts: i32,
    /// The last error.
    pub last_error: Option<String>,
    /// When it was written (`None`: the row has no time; a table may allow it).
    pub created_at: Option<DateTime<Utc>>,
    /// When it was delivered.
    pub published_at: Option<DateTime<Utc>>,
    /// When it was dead-lettered.
    pub dead_at: Option<DateTime<Utc>>,
    /// When it is tried next (pending only).
    pub next_attempt_at: Option<DateTime<Utc>>,
}

/// A page of results and the cursor of the next one (`None`: this was the last).
#[derive(Debug, Clone)]
pub struct EventPage {
    /// In the state's order (see [`order`]).
    pub events: Vec<EventRow>,
    /// Pass as [`EventQuery::after`] for the next page.
    pub next_cursor: Option<Cursor>,
    /// How many events match the search (every page), when asked for: at most [`TOTAL_CAP`]
    /// (then "at least that many").
    pub total: Option<i64>,
}

/// The most matches a search counts: a count walks every match, so it is bounded like a page.
pub const TOTAL_CAP: i64 = 10_000;

/// One event whole: payload, headers and its state at each destination.
#[derive(Debug, Clone, Serialize)]
pub struct EventDetail {
    /// Event id.
    pub id: Uuid,
    /// Insert order.
    pub seq: i64,
    /// Topic (`None`: the row has none).
    pub topic: Option<String>,
    /// Key.
    pub key: Option<String>,
    /// When it was written (`None`: the row has no time).
    pub created_at: Option<DateTime<Utc>>,
    /// The payload, as stored (any depth).
    pub payload: Option<StoredJson>,
    /// The headers, as stored.
    pub headers: Option<StoredJson>,
    /// Its row and each pair: attempts, last error, next attempt, per destination.
    pub deliveries: Vec<EventRow>,
    /// Its failed attempts, oldest first, as far back as `attempts_retention` (a delivery
    /// records none).
    pub attempts: Vec<RecordedAttempt>,
}

/// One failed attempt of an event at a destination, as the attempt history recorded it.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct RecordedAttempt {
    /// The destination tried.
    pub destination: Option<String>,
    /// When the attempt was settled.
    pub at: DateTime<Utc>,
    /// What went wrong.
    pub error: String,
    /// Whether this attempt dead-lettered the event there.
    pub dead: bool,
}

/// State and columns of an outbox row, as [`EventRow`] reads them.
/// A row with `published_at` and no destination was split into per-destination pairs (fan-out):
/// `split`, its destinations' states are in the pairs (a pair delivered at once leaves none). A
/// pending row waiting at 'infinity' is `held` (its destination is paused or down, or a dead
/// event of its key blocks it); its next attempt is then unknown (NULL).
const ROW_COLUMNS: &str = "id, seq, topic, key, destination,
  CASE WHEN dead_at IS NOT NULL THEN 'dead'
       WHEN published_at IS NOT NULL AND destination IS NULL THEN 'split'
       WHEN published_at IS NOT NULL THEN 'published'
       WHEN next_attempt_at = 'infinity' THEN 'held'
       ELSE 'pending' END AS state,
  attempts, last_error, created_at, published_at, dead_at,
  CASE WHEN published_at IS NULL AND dead_at IS NULL AND next_attempt_at <> 'infinity'
       THEN next_attempt_at END AS next_attempt_at";

/// The same for a pair (the deliveries table has no published pairs: a delivered pair is deleted).
const PAIR_COLUMNS: &str = "event_id AS id, seq, topic, key, destination,
  CASE WHEN dead_at IS NOT NULL THEN 'dead' WHEN next_attempt_at = 'infinity' THEN 'held'
       ELSE 'pending' END AS state,
  attempts, last_error, created_at, NULL::timestamptz AS published_at, dead_at,
  CASE WHEN dead_at IS NULL AND next_attempt_at <> 'infinity' THEN next_attempt_at END
    AS next_attempt_at";

/// The same for a row of the partitioned history (`history = "partitions"`): published, or split
/// when it has no destination, as in the outbox.
const HISTORY_COLUMNS: &str = "id, coalesce(seq, 0) AS seq, topic, key,
  destination, CASE WHEN destination IS NULL THEN 'split' ELSE 'published' END AS state,
  coalesce(attempts, 0) AS attempts, last_error, coalesce(created_at, published_at) AS created_at,
  published_at, NULL::timestamptz AS dead_at,
  NULL::timestamptz AS next_attempt_at";

/// Where a page ends: the sort column's value (as PostgreSQL writes it, 'infinity' included),
/// then the `seq` and the destination that break ties (one event dead at several destinations
/// has one dead time and one `seq`). Opaque to clients (base64url).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cursor {
    at: String,
    seq: i64,
    destination: String,
}

impl Cursor {
    /// Reads a cursor given out by [`search`]; `None` when it is not one (its time is checked
    /// here and written anew, so nothing but a valid timestamp reaches the statement).
    pub fn parse(text: &str) -> Option<Self> {
        use base64::Engine as _;
        let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(text.trim())
            .ok()?;
        let raw = String::from_utf8(raw).ok()?;
        let mut parts = raw.splitn(3, '|');
        let (at, seq, destination) = (parts.next()?, parts.next()?, parts.next()?);
        if destination.contains('\0') {
            return None;
        }
        Some(Self {
            at: canonical_time(at)?,
            seq: seq.parse().ok()?,
            destination: destination.to_owned(),
        })
    }
}

/// A sort value as PostgreSQL writes a `timestamptz` (any time zone, 'infinity' included),
/// rewritten in UTC with microseconds; `None` when it is not one.
fn canonical_time(text: &str) -> Option<String> {
    match text {
        "infinity" | "-infinity" => Some(text.to_owned()),
        _ => DateTime::parse_from_str(text, "%Y-%m-%d %H:%M:%S%.f%#z")
            .ok()
            .map(|t| {
                t.with_timezone(&Utc)
                    .format("%Y-%m-%dT%H:%M:%S%.6fZ")
                    .to_string()
            }),
    }
}

impl std::fmt::Display for Cursor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use base64::Engine as _;
        f.write_str(
            &base64::engine::general_purpose::URL_SAFE_NO_PAD
                .encode(format!("{}|{}|{}", self.at, self.seq, self.destination)),
        )
    }
}

/// The order of a state's results, chosen so that an index serves each page without a sort of
/// the table: dead newest first by `dead_at` (`{name:dead_idx}`), published newest first by
/// `published_at` (`{name:published_seq_idx}`), pending in the order they are due (`{name:pending_idx}`,
/// `{name:deliveries_due_idx}`). There is no index on `seq` or `created_at` (each would cost every
/// insert): "all states" is only for a lookup by id.
fn order(state: EventState) -> Order {
    let (column, descending, rows, pairs, history) = match state {
        EventState::Dead => (
            "dead_at",
            true,
            "dead_at IS NOT NULL",
            Some("dead_at IS NOT NULL"),
            None,
        ),
        EventState::Published => (
            "published_at",
            true,
            "published_at IS NOT NULL AND dead_at IS NULL",
            None,
            Some("true"),
        ),
        EventState::Pending => (
            "next_attempt_at",
            false,
            "published_at IS NULL AND dead_at IS NULL",
            Some("dead_at IS NULL"),
            None,
        ),
        EventState::All => ("created_at", true, "true", Some("true"), Some("true")),
    };
    Order {
        column,
        descending,
        rows,
        pairs,
        history,
    }
}

/// A state's search: its sort column and direction, and its condition on the outbox rows, on
/// the pairs and on the partitioned history (`None`: never in that state there).
struct Order {
    column: &'static str,
    descending: bool,
    rows: &'static str,
    pairs: Option<&'static str>,
    history: Option<&'static str>,
}

/// A search's conditions on the outbox rows and on the pairs (the history takes the rows'), and
/// their bound values: `$1..$n`.
struct Conditions {
    args: PgArguments,
    common: Vec<(String, String)>,
    n: usize,
}

/// A part's WHERE: its state's condition and the filters, in the pairs' form for the deliveries.
fn where_clause(state: &str, common: &[(String, String)], pair: bool) -> String {
    std::iter::once(state)
        .chain(
            common
                .iter()
                .map(|(r, p)| if pair { p.as_str() } else { r.as_str() }),
        )
        .collect::<Vec<&str>>()
        .join(" AND ")
}

/// The filters of `q` and, when given, the cursor `after` in the order of `column`.
fn conditions(
    q: &EventQuery,
    column: &str,
    descending: bool,
    after: Option<&Cursor>,
) -> Result<Conditions> {
    let mut args = PgArguments::default();
    // (outbox condition, deliveries condition), each with its bound value's placeholder.
    let mut common: Vec<(String, String)> = Vec::new();
    let mut n = 0;
    macro_rules! filter {
        ($value:expr, $row:expr, $pair:expr) => {
            if let Some(v) = $value {
                n += 1;
                args.add(v).map_err(sqlx::Error::Encode)?;
                let close = if $row.ends_with(',') { ")" } else { "" };
                common.push((
                    format!("{} ${n}{close}", $row),
                    format!("{} ${n}{close}", $pair),
                ));
            }
        };
    }
    filter!(q.id, "id =", "event_id =");
    filter!(q.topic.as_deref(), "topic =", "topic =");
    filter!(
        q.topic_prefix.as_deref(),
        "starts_with(topic,",
        "starts_with(topic,"
    );
    filter!(q.payload.as_ref(), "payload @>", "payload @>");
    filter!(q.key.as_deref(), "key =", "key =");
    filter!(q.destination.as_deref(), "destination =", "destination =");
    filter!(q.since, "created_at >=", "created_at >=");
    filter!(q.until, "created_at <", "created_at <");
    if let Some(after) = after {
        args.add(after.at.as_str()).map_err(sqlx::Error::Encode)?;
        args.add(after.seq).map_err(sqlx::Error::Encode)?;
        args.add(after.destination.as_str())
            .map_err(sqlx::Error::Encode)?;
        let (at, seq, dest) = (n + 1, n + 2, n + 3);
        n += 3;
        let (cmp, strict) = if descending { ("<=", "<") } else { (">=", ">") };
        let past = format!(
            "{column} {cmp} ${at}::timestamptz AND ({column} {strict} ${at}::timestamptz
             OR seq {strict} ${seq} OR (seq = ${seq} AND coalesce(destination, '') {strict} ${dest}))"
        );
        common.push((past.clone(), past));
    }
    Ok(Conditions { args, common, n })
}

/// EventSearch: one page in the state's order (see [`order`]), at most `limit` (plus one, to know
/// whether a next page exists).
pub async fn search(store: &Store, q: &EventQuery) -> Result<EventPage> {
    let limit = q.limit.clamp(1, 500);
    let Order {
        column,
        descending,
        rows: row_state,
        pairs: pair_state,
        history: history_state,
    } = order(q.state);
    let Conditions {
        mut args,
        common,
        mut n,
    } = conditions(q, column, descending, q.after.as_ref())?;
    n += 1;
    args.add(limit + 1).map_err(sqlx::Error::Encode)?;
    let direction = if descending { "DESC" } else { "ASC" };
    let sort = format!(
        "{column} AS sort_ts, {column}::text AS sort_at, coalesce(destination, '') AS sort_dest"
    );
    // Each part ordered and limited by its own index; more than one are merged (a UNION takes one
    // ORDER BY). The history's columns have the outbox's names, so it takes the same conditions.
    let part = |columns: &str, from: &str, state: &str, pair: bool| {
        format!(
            "(SELECT {columns}, {sort} FROM {from} WHERE {}
              ORDER BY {column} {direction}, seq {direction}, coalesce(destination, '') {direction}
              LIMIT ${n})",
            where_clause(state, &common, pair)
        )
    };
    let mut parts = vec![part(ROW_COLUMNS, "{outbox}", row_state, false)];
    if let Some(state) = pair_state {
        parts.push(part(PAIR_COLUMNS, "{qname:deliveries}", state, true));
    }
    if let Some(state) = history_state {
        parts.push(part(HISTORY_COLUMNS, "{qname:history}", state, false));
    }
    let mut sql = parts.join("\nUNION ALL\n");
    if parts.len() > 1 {
        sql.push_str(&format!(
            "\nORDER BY sort_ts {direction}, seq {direction}, sort_dest {direction} LIMIT ${n}"
        ));
    }
    let mut rows: Vec<(EventRow, String)> = sqlx::query_as_with(&store.table().render(&sql), args)
        .fetch_all(store.pool())
        .await?
        .into_iter()
        .map(|row: SortedRow| (row.event, row.sort_at))
        .collect();
    let next_cursor = if rows.len() as i64 > limit {
        rows.truncate(limit as usize);
        rows.last().map(|(e, at)| Cursor {
            at: at.clone(),
            seq: e.seq,
            destination: e.destination.clone().unwrap_or_default(),
        })
    } else {
        None
    };
    let total = if q.total {
        Some(count(store, q, &order(q.state)).await?)
    } else {
        None
    };
    Ok(EventPage {
        events: rows.into_iter().map(|(e, _)| e).collect(),
        next_cursor,
        total,
    })
}

/// EventCount: how many events match `q` over every page, up to [`TOTAL_CAP`]; each part stops
/// at the cap, so a count costs at most that many index entries per part.
async fn count(store: &Store, q: &EventQuery, order: &Order) -> Result<i64> {
    let Conditions {
        mut args,
        common,
        n,
    } = conditions(q, order.column, order.descending, None)?;
    args.add(TOTAL_CAP).map_err(sqlx::Error::Encode)?;
    let cap = n + 1;
    let part = |from: &str, state: &str, pair: bool| {
        format!(
            "(SELECT 1 FROM {from} WHERE {} LIMIT ${cap})",
            where_clause(state, &common, pair)
        )
    };
    let mut parts = vec![part("{outbox}", order.rows, false)];
    if let Some(state) = order.pairs {
        parts.push(part("{qname:deliveries}", state, true));
    }
    if let Some(state) = order.history {
        parts.push(part("{qname:history}", state, false));
    }
    let sql = format!(
        "SELECT count(*) FROM ({}) AS matches",
        parts.join("\nUNION ALL\n")
    );
    let (n,): (i64,) = sqlx::query_as_with(&store.table().render(&sql), args)
        .fetch_one(store.pool())
        .await?;
    Ok(n.min(TOTAL_CAP))
}

/// A search result with its sort value, for the cursor.
#[derive(sqlx::FromRow)]
struct SortedRow {
    #[sqlx(flatten)]
    event: EventRow,
    sort_at: String,
}

/// EventShow's head. The event's payload and headers: primary key on the outbox; a split event in
/// delete mode has only its pairs left (each holds a copy of the payload), found by the
/// deliveries' (event_id, destination) key; a moved one its history row
/// (`{name:history_id_idx}`).
const SHOW_HEAD: &str =
    "SELECT seq, topic, key, created_at, payload::text, headers::text FROM {outbox} WHERE id = $1
         UNION ALL
         (SELECT seq, topic, key, created_at, payload::text, headers::text FROM {qname:deliveries}
          WHERE event_id = $1 LIMIT 1)
         UNION ALL
         (SELECT coalesce(seq, 0), topic, key, coalesce(created_at, published_at),
                 payload::text, headers::text FROM {qname:history}
          WHERE id = $1 LIMIT 1)
         LIMIT 1";

/// EventShow's deliveries: its row, each pair and its history row, by the same keys.
fn show_deliveries() -> String {
    format!(
        "SELECT {ROW_COLUMNS} FROM {{outbox}} WHERE id = $1
         UNION ALL
         SELECT {PAIR_COLUMNS} FROM {{qname:deliveries}} WHERE event_id = $1
         UNION ALL
         SELECT {HISTORY_COLUMNS} FROM {{qname:history}} WHERE id = $1
         ORDER BY destination NULLS FIRST"
    )
}

/// EventShow's attempts. `{name:attempts_event_idx}`: this event's history, in order.
const SHOW_ATTEMPTS: &str =
    "SELECT destination, at, error, dead FROM {qname:attempts} WHERE event_id = $1
         ORDER BY at, destination LIMIT 1000";

/// This module's statements that do not depend on a search's filters, rendered.
pub(super) struct Sql {
    show_head: String,
    show_deliveries: String,
    show_attempts: String,
}

impl Sql {
    pub(super) fn render(table: &OutboxTable) -> Self {
        Self {
            show_head: table.render(SHOW_HEAD),
            show_deliveries: table.render(&show_deliveries()),
            show_attempts: table.render(SHOW_ATTEMPTS),
        }
    }
}

/// EventShow: the event `id` whole, or `None` when no row has it (delivered and cleaned up, or
/// never written).
pub async fn show(store: &Store, id: Uuid) -> Result<Option<EventDetail>> {
    type Head = (
        i64,
        Option<String>,
        Option<String>,
        Option<DateTime<Utc>>,
        Option<StoredJson>,
        Option<StoredJson>,
    );
    let sql = &store.sql.inspect;
    let head: Option<Head> = sqlx::query_as(&sql.show_head)
        .bind(id)
        .fetch_optional(store.pool())
        .await?;
    let Some((seq, topic, key, created_at, payload, headers)) = head else {
        return Ok(None);
    };
    let deliveries: Vec<EventRow> = sqlx::query_as(&sql.show_deliveries)
        .bind(id)
        .fetch_all(store.pool())
        .await?;
    let attempts: Vec<RecordedAttempt> = sqlx::query_as(&sql.show_attempts)
        .bind(id)
        .fetch_all(store.pool())
        .await?;
    Ok(Some(EventDetail {
        id,
        seq,
        topic,
        key,
        created_at,
        payload,
        headers,
        deliveries,
        attempts,
    }))
}
