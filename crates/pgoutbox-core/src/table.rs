//! The outbox table's name and every SQL statement the relay runs against it.
//!
//! Schema and table names come from configuration, so they are validated as plain identifiers and
//! quoted once, here, when an [`OutboxTable`] is built; statements are then rendered once from the
//! templates below. No other module formats SQL at run time.

use std::fmt;

use crate::error::{Error, Result};

/// Longest accepted identifier: PostgreSQL's limit is 63 bytes and index names add a suffix.
pub const MAX_IDENT_LEN: usize = 40;

/// A validated SQL identifier (schema or table name).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ident(String);

impl Ident {
    /// Validates `name` as `[A-Za-z_][A-Za-z0-9_]*` of at most [`MAX_IDENT_LEN`] characters.
    pub fn parse(name: &str) -> Result<Self> {
        let mut chars = name.chars();
        let first_ok = matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_');
        let rest_ok = chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
        if first_ok && rest_ok && name.len() <= MAX_IDENT_LEN {
            Ok(Self(name.to_owned()))
        } else {
            Err(Error::InvalidIdentifier(name.to_owned()))
        }
    }

    /// The bare name, as stored in the catalogs.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The name quoted for SQL (validation guarantees there is no quote inside).
    pub fn quoted(&self) -> String {
        format!("\"{}\"", self.0)
    }
}

impl fmt::Display for Ident {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Columns the relay reads for each claimed event, in the order [`crate::OutboxEvent`] decodes them.
const EVENT_COLUMNS: &str =
    "id, seq, topic, key, payload::text AS payload, headers::text AS headers, created_at, attempts";

/// An outbox table (schema + name) and its statements, rendered once.
#[derive(Clone)]
pub struct OutboxTable {
    schema: Ident,
    table: Ident,
    /// Named statements, see [`Queries`].
    pub sql: Queries,
}

impl OutboxTable {
    /// The default table, `public.outbox`.
    pub fn default_table() -> Self {
        Self::new(Ident("public".into()), Ident("outbox".into()))
    }

    /// Builds the table handle from raw names, validating both.
    pub fn parse(schema: &str, table: &str) -> Result<Self> {
        Ok(Self::new(Ident::parse(schema)?, Ident::parse(table)?))
    }

    /// Builds the table handle from validated names.
    pub fn new(schema: Ident, table: Ident) -> Self {
        let sql = Queries::render(&schema, &table);
        Self { schema, table, sql }
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

    /// The prefix of this table's logical decoding messages (`<table>_emit()`): a relay reading
    /// the WAL takes only messages with its own table's prefix.
    pub fn message_prefix(&self) -> String {
        self.render("{prefix}")
    }

    /// An object name derived from the table's (index, function), quoted and schema-qualified.
    pub fn derived(&self, suffix: &str) -> String {
        format!(
            "{}.\"{}_{}\"",
            self.schema.quoted(),
            self.table.as_str(),
            suffix
        )
    }

    /// An unqualified derived name (for `CREATE INDEX name`), quoted.
    pub fn derived_bare(&self, suffix: &str) -> String {
        format!("\"{}_{}\"", self.table.as_str(), suffix)
    }

    /// Replaces `{outbox}`, `{schema}`, `{name}` and `{name:SUFFIX}` placeholders in a template.
    pub fn render(&self, template: &str) -> String {
        render(template, &self.schema, &self.table)
    }
}

impl fmt::Debug for OutboxTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "OutboxTable({self})")
    }
}

impl fmt::Display for OutboxTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.schema, self.table)
    }
}

fn render(template: &str, schema: &Ident, table: &Ident) -> String {
    let mut out = String::with_capacity(template.len() + 64);
    let mut rest = template;
    while let Some(start) = rest.find('{') {
        let Some(len) = rest[start..].find('}') else {
            break;
        };
        let placeholder = &rest[start + 1..start + len];
        let replacement = match placeholder {
            "outbox" => Some(format!("{}.{}", schema.quoted(), table.quoted())),
            "schema" => Some(schema.quoted()),
            "table" => Some(table.quoted()),
            // The logical decoding message prefix of `{name}_emit` (see `message_prefix`).
            "prefix" => Some(format!("pgoutbox:{}.{}", schema.as_str(), table.as_str())),
            p if p.starts_with("name:") => Some(format!("\"{}_{}\"", table.as_str(), &p[5..])),
            p if p.starts_with("qname:") => Some(format!(
                "{}.\"{}_{}\"",
                schema.quoted(),
                table.as_str(),
                &p[6..]
            )),
            _ => None,
        };
        out.push_str(&rest[..start]);
        match replacement {
            Some(r) => out.push_str(&r),
            // Not a placeholder (a JSON literal such as '{}'): keep it as written.
            None => out.push_str(&rest[start..start + len + 1]),
        }
        rest = &rest[start + len + 1..];
    }
    out.push_str(rest);
    out
}

/// Every statement the relay and the CLI run against the outbox table, rendered for one table.
///
/// Each template says which index it uses and which locks it takes; that is the contract the
/// migrations in [`crate::schema`] are built to serve.
#[derive(Clone, Debug)]
pub struct Queries {
    /// `OutboxAnyDue`: is anything due? (an idle relay's poll).
    pub any_due: String,
    /// `OutboxClaimDue`: the transaction-held claim.
    pub claim_due: String,
    /// `OutboxClaimLease`: the lease-mode claim.
    pub claim_lease: String,
    /// `OutboxClaimDueOrdered`: the transaction-held claim, per-key ordered.
    pub claim_due_ordered: String,
    /// `OutboxClaimLeaseOrdered`: the lease-mode claim, per-key ordered.
    pub claim_lease_ordered: String,
    /// `OutboxSetPublishedMany`: keep-mode settle of successes.
    pub set_published_many: String,
    /// `OutboxDeleteMany`: delete-mode settle of successes (retention 0).
    pub delete_many: String,
    /// `OutboxMoveMany`: partitioned-history settle of successes.
    pub move_many: String,
    /// `OutboxSetFailedMany`: failures and dead letters, one row per event.
    pub set_failed_many: String,
    /// `OutboxReleaseLease`: gives leased rows back, due now.
    pub release_lease: String,
    /// OutboxParkFollowers.
    pub park_followers: String,
    /// OutboxUnparkFollowers.
    pub unpark_followers: String,
    /// OutboxHoldMany.
    pub hold_many: String,
    /// OutboxLeaseMany.
    pub lease_many: String,
    /// OutboxClaimProbe.
    pub claim_probe: String,
    /// OutboxExpireHeld.
    pub expire_held: String,
    /// DestinationsRegister.
    pub destinations_register: String,
    /// DestinationsRead.
    pub destinations_read: String,
    /// DestinationOpen.
    pub destination_open: String,
    /// DestinationTakeProbe.
    pub destination_take_probe: String,
    /// DestinationProbeFailed.
    pub destination_probe_failed: String,
    /// DestinationClose.
    pub destination_close: String,
    /// DestinationPause.
    pub destination_pause: String,
    /// DestinationResume.
    pub destination_resume: String,
    /// WalMaterialize.
    pub wal_materialize: String,
    /// WalUnmark.
    pub wal_unmark: String,
    /// DeliveriesFanOut.
    pub deliveries_fan_out: String,
    /// DeliveriesFanOutDelete.
    pub deliveries_fan_out_delete: String,
    /// DeliveriesFanOutMove.
    pub deliveries_fan_out_move: String,
    /// DeliveriesClaim.
    pub deliveries_claim: String,
    /// DeliveriesDelete.
    pub deliveries_delete: String,
    /// DeliveriesSettle.
    pub deliveries_settle: String,
    /// DeliveriesKeysWaiting.
    pub deliveries_keys_waiting: String,
    /// DeliveriesUnpark.
    pub deliveries_unpark: String,
    /// DeliveriesClaimProbe.
    pub deliveries_claim_probe: String,
    /// DeliveriesExpireHeld.
    pub deliveries_expire_held: String,
    /// DeliveriesUnbundle.
    pub deliveries_unbundle: String,
    /// `AttemptsLog`: failed attempts, for the history.
    pub attempts_log: String,
    /// `OutboxInsert`: one event.
    pub insert_one: String,
    /// `OutboxInsertMany`: many events in one statement.
    pub insert_many: String,
}

impl Queries {
    fn render(schema: &Ident, table: &Ident) -> Self {
        let r = |t: &str| render(&t.replace("{columns}", EVENT_COLUMNS), schema, table);
        Self {
            any_due: r(ANY_DUE),
            claim_due: r(CLAIM_DUE),
            claim_lease: r(CLAIM_LEASE),
            claim_due_ordered: r(&format!("{ORDERED_PICK}\n{CLAIM_DUE_ORDERED}")),
            claim_lease_ordered: r(&format!("{ORDERED_PICK}\n{CLAIM_LEASE_ORDERED}")),
            set_published_many: r(SET_PUBLISHED_MANY),
            delete_many: r(DELETE_MANY),
            move_many: r(MOVE_MANY),
            set_failed_many: r(SET_FAILED_MANY),
            release_lease: r(RELEASE_LEASE),
            park_followers: r(PARK_FOLLOWERS),
            unpark_followers: r(UNPARK_FOLLOWERS),
            hold_many: r(HOLD_MANY),
            lease_many: r(LEASE_MANY),
            claim_probe: r(CLAIM_PROBE),
            expire_held: r(EXPIRE_HELD),
            destinations_register: r(DESTINATIONS_REGISTER),
            destinations_read: r(DESTINATIONS_READ),
            destination_open: r(DESTINATION_OPEN),
            destination_take_probe: r(DESTINATION_TAKE_PROBE),
            destination_probe_failed: r(DESTINATION_PROBE_FAILED),
            destination_close: r(DESTINATION_CLOSE),
            destination_pause: r(DESTINATION_PAUSE),
            destination_resume: r(DESTINATION_RESUME),
            wal_materialize: r(WAL_MATERIALIZE),
            wal_unmark: r(WAL_UNMARK),
            deliveries_fan_out: r(&fan_out(FAN_OUT_PUBLISH, "")),
            deliveries_fan_out_delete: r(&fan_out(FAN_OUT_DELETE, "")),
            deliveries_fan_out_move: r(&fan_out(FAN_OUT_DELETE, FAN_OUT_MOVE)),
            deliveries_claim: r(&format!("{DELIVERIES_CLAIM}{DELIVERIES_LEASE}")),
            deliveries_delete: r(DELIVERIES_DELETE),
            deliveries_settle: r(DELIVERIES_SETTLE),
            deliveries_keys_waiting: r(DELIVERIES_KEYS_WAITING),
            deliveries_unpark: r(DELIVERIES_UNPARK),
            deliveries_claim_probe: r(&format!("{DELIVERIES_CLAIM_PROBE}{DELIVERIES_LEASE}")),
            deliveries_expire_held: r(DELIVERIES_EXPIRE_HELD),
            deliveries_unbundle: r(DELIVERIES_UNBUNDLE),
            attempts_log: r(ATTEMPTS_LOG),
            insert_one: r(INSERT_ONE),
            insert_many: r(INSERT_MANY),
        }
    }
}

/// AttemptsLog. Appends one row per failed attempt (`$1..$4`: event id, destination, error, dead)
/// in the settle's transaction: no index is read, two small ones are written.
const ATTEMPTS_LOG: &str = "
INSERT INTO {qname:attempts} (event_id, destination, error, dead)
SELECT * FROM unnest($1::uuid[], $2::text[], $3::text[], $4::bool[])";

/// OutboxClaimDue. Range scan of the partial index `{name:pending_idx}` on (next_attempt_at, seq):
/// published, dead and backing-off rows are not in that range, so the cost does not grow with
/// history or with events waiting for a retry. `FOR UPDATE SKIP LOCKED` takes row locks that last
/// until the claiming transaction settles, and lets concurrent relays take disjoint rows without
/// waiting on each other.
const CLAIM_DUE: &str = "
SELECT {columns}
FROM {outbox}
WHERE published_at IS NULL AND dead_at IS NULL AND next_attempt_at <= now()
ORDER BY next_attempt_at, seq
LIMIT $1
FOR UPDATE SKIP LOCKED";

/// OutboxAnyDue. What an idle relay polls instead of a claim: the first entry of the due range
/// of `{name:pending_idx}`, one statement and no transaction or row lock, so a short
/// `poll_interval` (the wait of the first event after a quiet spell) costs little when idle.
const ANY_DUE: &str = "
SELECT EXISTS (
    SELECT 1 FROM {outbox}
    WHERE published_at IS NULL AND dead_at IS NULL AND next_attempt_at <= now())";

/// OutboxClaimLease. Same index and row choice as OutboxClaimDue, but commits at once: the lease is
/// `next_attempt_at` pushed to the lease expiry (so the row leaves the due range until then) plus a
/// fresh `lease_token` that every later settle must present (fencing).
const CLAIM_LEASE: &str = "
WITH due AS (
    SELECT id FROM {outbox}
    WHERE published_at IS NULL AND dead_at IS NULL AND next_attempt_at <= now()
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
/// rows are still reached.
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
      AND (o.next_attempt_at, o.seq) < (
            SELECT b.t, b.s FROM (
                (SELECT w.next_attempt_at AS t, w.seq AS s, 0 AS last FROM {outbox} w
                 WHERE w.published_at IS NULL AND w.dead_at IS NULL AND w.next_attempt_at <= now()
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
    SET next_attempt_at = now() + make_interval(secs => $6), lease_token = $7
    FROM picked
    WHERE o.id = picked.id AND picked.due
    RETURNING o.id
)
SELECT picked.*, (SELECT count(*) FROM heads) AS heads_found, (SELECT count(*) FROM followers) AS followers_found
FROM picked ORDER BY seq";

/// OutboxSetPublishedMany. Primary-key lookups; the row leaves the pending index. `$3` is the
/// lease token in lease mode (NULL in transaction mode, where the row lock already fences).
const SET_PUBLISHED_MANY: &str = "
UPDATE {outbox}
SET published_at = statement_timestamp(), destination = $2, lease_token = NULL
WHERE id = ANY($1) AND ($3::uuid IS NULL OR lease_token = $3)";

/// OutboxDeleteMany. Primary-key lookups; used when retention is zero, the cheapest settle.
const DELETE_MANY: &str = "
DELETE FROM {outbox}
WHERE id = ANY($1) AND ($2::uuid IS NULL OR lease_token = $2)";

/// OutboxMoveMany. `history = "partitions"`: the rows leave the outbox as in OutboxDeleteMany (no
/// dead row version left behind for vacuum beyond the delete) and are appended to the current
/// partition of `{qname:history}`, which cleanup drops whole. Binds as OutboxSetPublishedMany;
/// the count is the rows moved.
const MOVE_MANY: &str = "
WITH moved AS (
    DELETE FROM {outbox}
    WHERE id = ANY($1) AND ($3::uuid IS NULL OR lease_token = $3)
    RETURNING id, seq, topic, key, payload, headers, created_at, attempts, last_error
)
INSERT INTO {qname:history} (id, seq, topic, key, payload, headers, created_at, published_at,
                             destination, attempts, last_error)
SELECT id, seq, topic, key, payload, headers, created_at, statement_timestamp(), $2, attempts,
       last_error
FROM moved";

/// OutboxSetFailedMany. One statement for every failure of a batch: the delay and the dead flag
/// are decided by the retry policy in Rust, the clock is the database's. `statement_timestamp()`,
/// not `now()`: in transaction mode `now()` is the claim's start, before the publish, and a delay
/// must count from the failure.
const SET_FAILED_MANY: &str = "
UPDATE {outbox} AS o
SET attempts = o.attempts + 1,
    last_error = f.error,
    destination = f.destination,
    next_attempt_at = statement_timestamp() + make_interval(secs => f.delay_secs),
    dead_at = CASE WHEN f.dead THEN statement_timestamp() END,
    lease_token = NULL
FROM unnest($1::uuid[], $2::text[], $3::text[], $4::float8[], $5::bool[])
     AS f(id, error, destination, delay_secs, dead)
WHERE o.id = f.id AND ($6::uuid IS NULL OR o.lease_token = $6)";

/// OutboxReleaseLease. Primary-key lookups, fenced by the token; used on shutdown so another
/// relay need not wait for the lease to expire.
const RELEASE_LEASE: &str = "
UPDATE {outbox} SET next_attempt_at = now(), lease_token = NULL
WHERE id = ANY($1) AND lease_token = $2";

/// OutboxParkFollowers. Ordered mode, in the settle of a batch with failed or held keyed events: a
/// key's later unsettled rows cannot go before that row, so they take its next attempt time
/// ('infinity' behind a held row, or behind a dead row of a destination whose dead rows block: `$2`). They leave the front of the due
/// range, where every claim's search for heads would otherwise step over them (a key whose head
/// was retried has all its older followers due before it). The materialized CTEs fix the plan:
/// from the failed rows (primary key) to their keys' later rows (`{name:key_idx}`), then back by
/// primary key; left to itself, with stale statistics, the planner once drove the join from every
/// pending row instead (32 s). Rows another relay leased are left alone, as is a failed row
/// someone re-leased since.
const PARK_FOLLOWERS: &str = "
WITH failed AS MATERIALIZED (
    SELECT h.key, h.seq,
           CASE WHEN h.dead_at IS NULL THEN h.next_attempt_at ELSE 'infinity'::timestamptz END AS until
    FROM {outbox} h
    WHERE h.id = ANY($1) AND h.key IS NOT NULL AND h.published_at IS NULL AND h.lease_token IS NULL
      AND (h.dead_at IS NULL OR h.destination = ANY($2::text[]))
),
later AS MATERIALIZED (
    SELECT l.id, f.until FROM failed f
    CROSS JOIN LATERAL (
        SELECT o.id FROM {outbox} o
        WHERE o.key = f.key AND o.seq > f.seq AND o.published_at IS NULL AND o.dead_at IS NULL
          AND o.lease_token IS NULL AND o.next_attempt_at < f.until
        ORDER BY o.key, o.seq
    ) l
)
UPDATE {outbox} AS o SET next_attempt_at = later.until
FROM later WHERE o.id = later.id";

/// OutboxUnparkFollowers. Rows wait at 'infinity' for one of two reasons: their destination is
/// held (paused, or its breaker is not closed), or an earlier row of their key is dead (for a
/// destination whose dead rows block) or held. Each is due again once none of its reasons is left.
/// Reads the reasons from `{qname:destinations}` (a few rows), then a range scan of
/// `{name:pending_idx}` at 'infinity', which holds only waiting rows, with one `{name:key_idx}`
/// probe per keyed row.
const UNPARK_FOLLOWERS: &str = "
WITH d AS MATERIALIZED (
    SELECT coalesce(array_agg(name) FILTER (WHERE paused_at IS NOT NULL OR breaker <> 'closed'), '{}') AS held,
           coalesce(array_agg(name) FILTER (WHERE dead_blocks), '{}') AS blocking
    FROM {qname:destinations}
)
UPDATE {outbox} AS o SET next_attempt_at = now()
FROM d
WHERE o.published_at IS NULL AND o.dead_at IS NULL AND o.next_attempt_at = 'infinity'
  AND NOT (o.destination IS NOT NULL AND o.destination = ANY(d.held))
  AND NOT (o.key IS NOT NULL AND EXISTS (
        SELECT 1 FROM {outbox} p
        WHERE p.key = o.key AND p.seq < o.seq AND p.published_at IS NULL
          AND ((p.dead_at IS NOT NULL AND p.destination = ANY(d.blocking))
               OR (p.dead_at IS NULL AND p.next_attempt_at = 'infinity' AND p.destination = ANY(d.held)))))";

/// OutboxHoldMany. Events of a destination that is paused or whose breaker is open: they wait at
/// 'infinity' with no attempt counted (primary-key lookups; they leave the due range, so claims do
/// not meet them again) until the destination is back and OutboxUnparkFollowers releases them.
/// `last_error` takes the failure that was not counted, when there was one.
const HOLD_MANY: &str = "
UPDATE {outbox} AS o
SET next_attempt_at = 'infinity', destination = h.destination,
    last_error = coalesce(h.error, o.last_error), lease_token = NULL
FROM unnest($1::uuid[], $2::text[], $3::text[]) AS h(id, destination, error)
WHERE o.id = h.id AND ($4::uuid IS NULL OR o.lease_token = $4)";

/// OutboxLeaseMany. Transaction mode, a batch settled but for a few stragglers: they go under a
/// lease (expiry + fencing token) in the claim's transaction, which then commits, releasing the row
/// locks of everything else; their settle comes later, fenced by the token, like lease mode's.
/// Primary-key lookups.
const LEASE_MANY: &str = "
UPDATE {outbox} SET next_attempt_at = now() + make_interval(secs => $2), lease_token = $3
WHERE id = ANY($1)";

/// OutboxClaimProbe. The one event a destination's probe sends: its oldest held row that is its
/// key's first unsettled row (so a probe never breaks per-key order). Range scan of
/// `{name:pending_idx}` at 'infinity', `{name:key_idx}` for the order check; the row lock lasts
/// until the probe's transaction settles it.
const CLAIM_PROBE: &str = "
SELECT {columns}
FROM {outbox} o
WHERE o.published_at IS NULL AND o.dead_at IS NULL AND o.next_attempt_at = 'infinity'
  AND o.destination = $1
  AND (o.key IS NULL OR NOT EXISTS (
        SELECT 1 FROM {outbox} p
        WHERE p.key = o.key AND p.seq < o.seq AND p.published_at IS NULL AND p.dead_at IS NULL))
ORDER BY o.next_attempt_at, o.seq
LIMIT 1
FOR UPDATE SKIP LOCKED";

/// OutboxExpireHeld. `max_age` still applies to held events: those of destination `$1` older than
/// `$2` seconds are dead-lettered. Range scan of `{name:pending_idx}` at 'infinity'.
const EXPIRE_HELD: &str = "
UPDATE {outbox}
SET dead_at = now(),
    last_error = left(coalesce(last_error || ' ', '') || '[dead: older than max_age while ' || $1 || ' was unavailable]', 1024)
WHERE published_at IS NULL AND dead_at IS NULL AND next_attempt_at = 'infinity'
  AND destination = $1 AND created_at < now() - make_interval(secs => $2)";

/// DestinationsRegister. At relay start: one row per configured destination (kept when present),
/// with whether its dead events block their key.
const DESTINATIONS_REGISTER: &str = "
INSERT INTO {qname:destinations} AS d (name, dead_blocks)
SELECT * FROM unnest($1::text[], $2::bool[])
ON CONFLICT (name) DO UPDATE SET dead_blocks = excluded.dead_blocks
WHERE d.dead_blocks IS DISTINCT FROM excluded.dead_blocks";

/// DestinationsRead. Every destination's shared state (a few rows, sequential scan).
const DESTINATIONS_READ: &str = "
SELECT name, paused_at, breaker, breaker_since, last_error, failed_probes, probe_at
FROM {qname:destinations} ORDER BY name";

/// DestinationOpen. A relay saw `failures` failed attempts in a row: the breaker opens, unless it
/// is open already (another relay was first), and the first probe is due after `$3` seconds.
const DESTINATION_OPEN: &str = "
INSERT INTO {qname:destinations} AS d (name, breaker, breaker_since, last_error, failed_probes, probe_at)
VALUES ($1, 'open', now(), $2, 0, now() + make_interval(secs => $3))
ON CONFLICT (name) DO UPDATE
SET breaker = 'open', breaker_since = now(), last_error = excluded.last_error, failed_probes = 0,
    probe_at = excluded.probe_at, updated_at = now()
WHERE d.breaker = 'closed'";

/// DestinationTakeProbe. One probe at a time across every relay: the row update is the lock. An
/// open breaker whose probe is due, or a half-open one whose prober did not report back in time
/// (it died), goes half-open for `$2` seconds under this relay. Paused destinations are not probed.
const DESTINATION_TAKE_PROBE: &str = "
UPDATE {qname:destinations}
SET breaker = 'half_open', probe_at = now() + make_interval(secs => $2), updated_at = now()
WHERE name = $1 AND breaker IN ('open', 'half_open') AND probe_at <= now() AND paused_at IS NULL
RETURNING failed_probes";

/// DestinationProbeFailed. Back to open; the next probe after `$3` seconds (the caller doubles it
/// per failed probe). `$4`: whether the probe really failed (false: it found nothing to send).
const DESTINATION_PROBE_FAILED: &str = "
UPDATE {qname:destinations}
SET breaker = 'open', last_error = coalesce($2, last_error),
    failed_probes = failed_probes + CASE WHEN $4 THEN 1 ELSE 0 END,
    probe_at = now() + make_interval(secs => $3), updated_at = now()
WHERE name = $1 AND breaker = 'half_open'";

/// DestinationClose. The probe was answered: the destination is back.
const DESTINATION_CLOSE: &str = "
UPDATE {qname:destinations}
SET breaker = 'closed', breaker_since = now(), failed_probes = 0, probe_at = NULL, updated_at = now()
WHERE name = $1 AND breaker <> 'closed'";

/// DestinationPause / DestinationResume. Operator commands; every relay obeys within a second.
const DESTINATION_PAUSE: &str = "
INSERT INTO {qname:destinations} AS d (name, paused_at) VALUES ($1, now())
ON CONFLICT (name) DO UPDATE SET paused_at = coalesce(d.paused_at, now()), updated_at = now()";

/// See DESTINATION_PAUSE.
const DESTINATION_RESUME: &str = "
UPDATE {qname:destinations} SET paused_at = NULL, updated_at = now() WHERE name = $1";

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

/// DeliveriesFanOut (keep mode) / DeliveriesFanOutDelete (retention 0) / DeliveriesFanOutMove
/// (`history = "partitions"`: deleted, then appended to the history). Settles split events (an
/// event with several destinations, or a pair that waits behind its key): the event rows are
/// settled by primary key, fenced by the lease token `$9` like OutboxSetPublishedMany, and in the
/// same statement their undelivered pairs are inserted into `{qname:deliveries}`, joined to the
/// rows actually settled: a fenced-out event writes no pair. `$2..$8` are the pairs, unnested
/// (event id, destination, attempts, delay, error, dead, held). `$10..$14` are held batches, one
/// per destination whose pairs are held in bulk (destination, oldest, count, topic counts, the
/// events as one JSON array built by the relay): one row whatever the number of events, written
/// unless the whole settle was fenced out (a destination that is down costs the others one row per
/// batch; a partly fenced batch may send an event twice to it, never lose one).
/// Returns how many events were settled and how many pairs written.
const DELIVERIES_FAN_OUT: &str = "
WITH settled AS (
    {settle}
    WHERE id = ANY($1) AND ($9::uuid IS NULL OR lease_token = $9)
    RETURNING id, seq, topic, key, payload, headers, created_at, attempts, last_error
),{history}
pairs AS (
    INSERT INTO {qname:deliveries} AS d (event_id, destination, seq, topic, key, payload, headers,
                                         created_at, attempts, next_attempt_at, last_error, dead_at)
    SELECT s.id, p.destination, s.seq, s.topic, s.key, s.payload, coalesce(s.headers, '{}'::jsonb),
           s.created_at, p.attempts,
           CASE WHEN p.held THEN 'infinity'::timestamptz
                ELSE statement_timestamp() + make_interval(secs => p.delay_secs) END,
           p.error, CASE WHEN p.dead THEN statement_timestamp() END
    FROM unnest($2::uuid[], $3::text[], $4::int[], $5::float8[], $6::text[], $7::bool[], $8::bool[])
         AS p(event_id, destination, attempts, delay_secs, error, dead, held)
    JOIN settled s ON s.id = p.event_id
    ON CONFLICT (event_id, destination) DO NOTHING
    RETURNING 1
),
bundles AS (
    INSERT INTO {qname:held_batches} (destination, oldest, count, topics, events)
    SELECT b.destination, b.oldest, b.count, b.topics::jsonb, b.events
    FROM unnest($10::text[], $11::timestamptz[], $12::int[], $13::text[], $14::bytea[])
         AS b(destination, oldest, count, topics, events)
    WHERE EXISTS (SELECT 1 FROM settled)
    RETURNING count AS n
)
SELECT (SELECT count(*) FROM settled) AS settled,
       (SELECT count(*) FROM pairs) + (SELECT coalesce(sum(n), 0) FROM bundles)::bigint AS pairs";

/// See DELIVERIES_FAN_OUT: the event row is done with (its pairs carry on in the deliveries).
const FAN_OUT_PUBLISH: &str =
    "UPDATE {outbox} SET published_at = statement_timestamp(), destination = NULL, lease_token = NULL";

/// See DELIVERIES_FAN_OUT.
const FAN_OUT_DELETE: &str = "DELETE FROM {outbox}";

/// See DELIVERIES_FAN_OUT and OutboxMoveMany: the deleted split rows go to the history, with no
/// destination (as FAN_OUT_PUBLISH leaves them).
const FAN_OUT_MOVE: &str = "
history AS (
    INSERT INTO {qname:history} (id, seq, topic, key, payload, headers, created_at, published_at,
                                 destination, attempts, last_error)
    SELECT id, seq, topic, key, payload, headers, created_at, statement_timestamp(), NULL,
           attempts, last_error
    FROM settled
),";

/// DeliveriesFanOut with its settle of the event rows (`settle`) and, to move them to the
/// history, the CTE that does it (`history`, or empty).
fn fan_out(settle: &str, history: &str) -> String {
    DELIVERIES_FAN_OUT
        .replace("{settle}", settle)
        .replace("{history}", history)
}

/// DeliveriesClaim. Due pairs, oldest first: range scan of `{name:deliveries_due_idx}`, leased at
/// once (`next_attempt_at` pushed to the lease expiry `$2`, fencing token `$3`) so no transaction is
/// open while a destination answers. For an ordered destination (`$4`) a keyed pair is taken only
/// when it is its key's first undelivered pair for that destination (`{name:deliveries_key_idx}`;
/// dead pairs count where that destination's dead pairs block, `$5`) and no earlier event row of
/// the key is unsettled (`{name:key_idx}`): the pair never overtakes an earlier event.
const DELIVERIES_CLAIM: &str = "
WITH picked AS (
    SELECT d.event_id, d.destination FROM {qname:deliveries} d
    WHERE d.dead_at IS NULL AND d.next_attempt_at <= now()
      AND (d.key IS NULL OR NOT (d.destination = ANY($4::text[])) OR (
            NOT EXISTS (
                SELECT 1 FROM {qname:deliveries} p
                WHERE p.destination = d.destination AND p.key = d.key AND p.seq < d.seq
                  AND (p.dead_at IS NULL OR p.destination = ANY($5::text[])))
            AND NOT EXISTS (
                SELECT 1 FROM {outbox} o
                WHERE o.key = d.key AND o.seq < d.seq AND o.published_at IS NULL
                  AND (o.dead_at IS NULL OR (o.destination = d.destination
                                             AND o.destination = ANY($5::text[]))))))
    ORDER BY d.next_attempt_at, d.seq
    LIMIT $1
    FOR UPDATE SKIP LOCKED
)";

/// The end of DeliveriesClaim and DeliveriesClaimProbe: the `picked` pairs are leased (due again at
/// the lease expiry `$2`, fencing token `$3`) and returned as events.
const DELIVERIES_LEASE: &str = "
UPDATE {qname:deliveries} AS d
SET next_attempt_at = now() + make_interval(secs => $2), lease_token = $3
FROM picked
WHERE d.event_id = picked.event_id AND d.destination = picked.destination
RETURNING d.event_id AS id, d.destination, d.seq, d.topic, d.key, d.payload::text AS payload,
          d.headers::text AS headers, d.created_at, d.attempts";

/// DeliveriesDelete. Delivered pairs leave the table (primary key), fenced by the lease token.
const DELIVERIES_DELETE: &str = "
DELETE FROM {qname:deliveries} AS d
USING unnest($1::uuid[], $2::text[]) AS p(event_id, destination)
WHERE d.event_id = p.event_id AND d.destination = p.destination
  AND ($3::uuid IS NULL OR d.lease_token = $3)";

/// DeliveriesSettle. Every other pair of a deliveries batch, one statement (primary key, fenced):
/// `failed` counts an attempt and takes the backoff, or `dead`; `held` waits at 'infinity' with no
/// attempt counted (destination paused or breaker open); `release` is due again as it was (not
/// attempted before the batch's time ran out).
const DELIVERIES_SETTLE: &str = "
UPDATE {qname:deliveries} AS d
SET attempts = d.attempts + CASE WHEN p.kind = 'failed' THEN 1 ELSE 0 END,
    last_error = coalesce(p.error, d.last_error),
    next_attempt_at = CASE p.kind
        WHEN 'held' THEN 'infinity'::timestamptz
        WHEN 'release' THEN now()
        ELSE statement_timestamp() + make_interval(secs => p.delay_secs) END,
    dead_at = CASE WHEN p.dead THEN statement_timestamp() END,
    lease_token = NULL
FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::float8[], $6::bool[])
     AS p(event_id, destination, kind, error, delay_secs, dead)
WHERE d.event_id = p.event_id AND d.destination = p.destination
  AND ($7::uuid IS NULL OR d.lease_token = $7)";

/// DeliveriesKeysWaiting. Before a batch is published to ordered destinations: which of the
/// batch's (destination, key) pairs (`$1`, `$2`) still have an undelivered pair in
/// `{qname:deliveries}` (dead ones only for destinations whose dead pairs block, `$3`). One
/// `{name:deliveries_key_idx}` probe per pair; an empty table answers at once.
const DELIVERIES_KEYS_WAITING: &str = "
SELECT DISTINCT q.destination, q.key
FROM unnest($1::text[], $2::text[]) AS q(destination, key)
WHERE EXISTS (
    SELECT 1 FROM {qname:deliveries} d
    WHERE d.destination = q.destination AND d.key = q.key
      AND (d.dead_at IS NULL OR d.destination = ANY($3::text[])))";

/// DeliveriesUnpark. Held pairs (at 'infinity') whose destination is neither paused nor has its
/// breaker open are due again. Reads `{qname:destinations}` (a few rows), then a range scan of
/// `{name:deliveries_due_idx}` at 'infinity'.
const DELIVERIES_UNPARK: &str = "
WITH h AS MATERIALIZED (
    SELECT coalesce(array_agg(name) FILTER (WHERE paused_at IS NOT NULL OR breaker <> 'closed'), '{}') AS held
    FROM {qname:destinations}
)
UPDATE {qname:deliveries} AS d SET next_attempt_at = now()
FROM h
WHERE d.dead_at IS NULL AND d.next_attempt_at = 'infinity' AND NOT (d.destination = ANY(h.held))";

/// DeliveriesClaimProbe. A held pair for destination `$1`'s probe, its key's first for that
/// destination (a probe never breaks key order): `{name:deliveries_due_idx}` at 'infinity',
/// `{name:deliveries_key_idx}`; leased like DeliveriesClaim.
const DELIVERIES_CLAIM_PROBE: &str = "
WITH picked AS (
    SELECT d.event_id, d.destination FROM {qname:deliveries} d
    WHERE d.dead_at IS NULL AND d.next_attempt_at = 'infinity' AND d.destination = $1
      AND (d.key IS NULL OR NOT EXISTS (
            SELECT 1 FROM {qname:deliveries} p
            WHERE p.destination = d.destination AND p.key = d.key AND p.seq < d.seq
              AND p.dead_at IS NULL))
    ORDER BY d.next_attempt_at, d.seq
    LIMIT 1
    FOR UPDATE SKIP LOCKED
)";

/// DeliveriesExpireHeld. `max_age` for held pairs of destination `$1`, like OutboxExpireHeld:
/// range scan of `{name:deliveries_due_idx}` at 'infinity'.
const DELIVERIES_EXPIRE_HELD: &str = "
UPDATE {qname:deliveries}
SET dead_at = now(),
    last_error = left(coalesce(last_error || ' ', '') || '[dead: older than max_age while ' || $1 || ' was unavailable]', 1024)
WHERE dead_at IS NULL AND next_attempt_at = 'infinity'
  AND destination = $1 AND created_at < now() - make_interval(secs => $2)";

/// DeliveriesUnbundle. Turns up to `$1` held batches into deliveries rows, oldest first, each batch
/// once (`FOR UPDATE SKIP LOCKED`, then deleted in the same statement). Which batches: with `$2`
/// NULL, those of destinations that are neither paused nor open (their pairs are due now); with
/// `$2` a destination, that destination's, as held pairs (`$3`: at 'infinity', for its probe or
/// for `max_age`), only those holding an event older than `$4` seconds when `$4` is set.
/// `{name:held_batches_destination_idx}`, then primary keys. The events' field names are those
/// `settle::HeldBatch` writes. Returns batches and pairs moved.
const DELIVERIES_UNBUNDLE: &str = "
WITH h AS MATERIALIZED (
    SELECT coalesce(array_agg(name) FILTER (WHERE paused_at IS NOT NULL OR breaker <> 'closed'), '{}') AS held
    FROM {qname:destinations}
),
taken AS (
    DELETE FROM {qname:held_batches} AS b
    WHERE b.id IN (
        SELECT c.id FROM {qname:held_batches} c, h
        WHERE CASE WHEN $2::text IS NULL THEN NOT (c.destination = ANY(h.held))
                   ELSE c.destination = $2 END
          AND ($4::float8 IS NULL OR c.oldest < now() - make_interval(secs => $4))
        ORDER BY c.id
        LIMIT $1
        FOR UPDATE SKIP LOCKED)
    RETURNING b.destination, b.events
),
moved AS (
    INSERT INTO {qname:deliveries} (event_id, destination, seq, topic, key, payload, headers,
                                    created_at, attempts, next_attempt_at)
    SELECT (e->>'i')::uuid, t.destination, (e->>'s')::bigint, e->>'t', e->>'k', e->'p',
           coalesce(e->'h', '{}'::jsonb),
           'epoch'::timestamptz + ((e->>'c') || ' microseconds')::interval, 0,
           CASE WHEN $3 THEN 'infinity'::timestamptz ELSE now() END
    FROM taken t, jsonb_array_elements(convert_from(t.events, 'UTF8')::jsonb) AS e
    ON CONFLICT (event_id, destination) DO NOTHING
    RETURNING 1
)
SELECT (SELECT count(*) FROM taken) AS batches, (SELECT count(*) FROM moved) AS pairs";

/// OutboxInsert. The id is made by the adapter (a UUIDv7, `enqueue::new_id`); every other column
/// not named has a default, as for any plain-SQL producer.
const INSERT_ONE: &str = "
INSERT INTO {outbox} (id, topic, payload, key, headers)
VALUES ($5, $1, $2::text::jsonb, $3, $4::text::jsonb)
RETURNING id";

/// OutboxInsertMany. One round trip for a whole batch; unnest keeps the array order, and so `seq`.
const INSERT_MANY: &str = "
INSERT INTO {outbox} (id, topic, payload, key, headers)
SELECT i, t, p::jsonb, k, h::jsonb
FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::uuid[])
     WITH ORDINALITY AS e(t, p, k, h, i, n)
ORDER BY n
RETURNING id";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_are_validated() {
        assert!(Ident::parse("outbox").is_ok());
        assert!(Ident::parse("_events_2").is_ok());
        for bad in [
            "",
            "x; drop table y",
            "1abc",
            "a\"b",
            "a.b",
            "ünïcode",
            &"a".repeat(41),
        ] {
            assert!(Ident::parse(bad).is_err(), "{bad:?} should be rejected");
        }
    }

    #[test]
    fn templates_render_quoted_names_and_keep_json_literals() {
        let t = OutboxTable::parse("app", "events").expect("valid");
        assert_eq!(
            t.render("CREATE INDEX {name:pending_idx} ON {outbox} DEFAULT '{}'"),
            "CREATE INDEX \"events_pending_idx\" ON \"app\".\"events\" DEFAULT '{}'"
        );
        assert!(t.sql.claim_due.contains("FROM \"app\".\"events\""));
    }
}
