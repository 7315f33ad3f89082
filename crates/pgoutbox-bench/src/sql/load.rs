//! The load the bench writes: backlogs generated server-side (`INSERT … SELECT` over
//! `generate_series(1, $1)`, run in chunks by `Scratch::generate`), the producers' one-event
//! statements, and the rows a scenario sets up to be in the relay's way (an open breaker, a
//! NOTIFY trigger). Every event carries a small JSON payload like an application's.

use pgoutbox::OutboxTable;
use sqlx::postgres::PgRow;
use sqlx::{PgExecutor, PgPool};

/// Runs one chunk of a generated backlog: `insert` (one of this file's `INSERT … SELECT`s)
/// with `$1` = `rows`.
pub async fn insert_generated(pool: &PgPool, insert: &str, rows: i64) -> sqlx::Result<()> {
    sqlx::query(insert)
        .bind(rows)
        .execute(pool)
        .await
        .map(|_| ())
}

/// BenchPrefill. Pending events into the default outbox, the payload an order event's size: the
/// backlog `drain`, `sql-limit` and `history` claim. No key, so any relay worker may take any row.
pub const PREFILL: &str = "INSERT INTO outbox (topic, payload)
             SELECT 'bench.event', jsonb_build_object('n', g, 'order_id', g % 1000, 'note', 'benchmark event payload')
             FROM generate_series(1, $1) g";

/// BenchBacklogRows. The prefill's events, into the table `{outbox}` renders to (schema-qualified,
/// the table the WAL source's publication covers): `catchup`'s backlog as outbox rows, many per
/// transaction.
const BACKLOG_ROWS: &str = "INSERT INTO {outbox} (topic, payload)
                 SELECT 'bench.event', jsonb_build_object('n', g, 'order_id', g % 1000, 'note', 'benchmark event payload')
                 FROM generate_series(1, $1) g";

/// BenchBacklogEmits. The same events as logical decoding messages (`outbox_emit()`, no row);
/// count() only makes the function run once per row and the result one value.
const BACKLOG_EMITS: &str = "SELECT count({qname:emit}('bench.event', jsonb_build_object('n', g, 'order_id', g % 1000, 'note', 'benchmark event payload')))
                 FROM generate_series(1, $1) g";

/// `catchup`'s backlog as rows of `table` ([`BACKLOG_ROWS`]).
pub fn backlog_rows(table: &OutboxTable) -> String {
    table.render(BACKLOG_ROWS)
}

/// `catchup`'s backlog as emit() messages of `table` ([`BACKLOG_EMITS`]).
pub fn backlog_emits(table: &OutboxTable) -> String {
    table.render(BACKLOG_EMITS)
}

/// BenchHistory. Published rows two days old: history that a claim must not read (it reads the
/// partial index of pending rows only), which `bench history` checks.
pub const HISTORY: &str = "INSERT INTO outbox (topic, payload, created_at, published_at)
             SELECT 'bench.old', jsonb_build_object('n', g), now() - interval '2 days', now() - interval '2 days'
             FROM generate_series(1, $1) g";

/// A month of history in the minimal table, oldest first, with one row in `every` still pending
/// (`published_at` NULL): what `bench migrate` upgrades in place. The numbering goes on from the
/// rows already there, so chunks do not repeat timestamps.
pub fn minimal_history(every: u64) -> String {
    format!(
        "INSERT INTO outbox (topic, payload, created_at, published_at)
         SELECT 'bench.old', jsonb_build_object('n', g, 'order_id', g % 1000, 'note', 'benchmark event payload'),
                t, CASE WHEN g % {every} <> 0 THEN t + interval '1 second' END
         FROM (SELECT g, now() - interval '30 days' + g * interval '1 ms' AS t
               FROM generate_series((SELECT count(*) FROM outbox) + 1, (SELECT count(*) FROM outbox) + $1) g) s",
        every = every
    )
}

/// BenchConsolePublished. Published history over 20 topics, 10,000 keys and three destinations,
/// one hour old: most of what a shop's outbox holds, which the console pages through.
pub const CONSOLE_PUBLISHED: &str = "INSERT INTO outbox (topic, key, payload, created_at, published_at, destination, attempts)
             SELECT 'order.t' || (g % 20), 'k' || (g % 10000), jsonb_build_object('n', g, 'total', g % 997),
                    now() - interval '1 hour' + g * interval '1 millisecond',
                    now() - interval '59 minutes' + g * interval '1 millisecond',
                    (ARRAY['billing','crm','audit'])[1 + g % 3], 1
             FROM generate_series(1, $1) g";

/// BenchConsoleDead. Dead events over the same topics, keys and destinations, with a last error:
/// what the console's dead views and the dry-run retry search.
pub const CONSOLE_DEAD: &str = "INSERT INTO outbox (topic, key, payload, destination, attempts, last_error, dead_at)
             SELECT 'order.t' || (g % 20), 'k' || (g % 10000), jsonb_build_object('n', g),
                    (ARRAY['billing','crm','audit'])[1 + g % 3], 8,
                    'attempt 8 to billing: HTTP 500 Internal Server Error', now() - (g || ' seconds')::interval
             FROM generate_series(1, $1) g";

/// BenchConsolePending. Pending events due in an hour (no relay runs in `bench console`).
pub const CONSOLE_PENDING: &str = "INSERT INTO outbox (topic, key, payload, next_attempt_at)
             SELECT 'order.t' || (g % 20), 'k' || (g % 10000), jsonb_build_object('n', g),
                    now() + interval '1 hour'
             FROM generate_series(1, $1) g";

/// BenchBaselineFill. Events in the minimal table, `created_at` a microsecond apart so that its
/// `ORDER BY created_at` has one order to follow.
pub async fn fill_baseline(pool: &PgPool, events: i64) -> sqlx::Result<()> {
    sqlx::query(
        "INSERT INTO baseline_outbox (topic, payload, created_at)
         SELECT 'bench.event', jsonb_build_object('n', g), now() + g * interval '1 microsecond'
         FROM generate_series(1, $1) g",
    )
    .bind(events)
    .execute(pool)
    .await
    .map(|_| ())
}

/// BenchBaselineClaim. The minimal design's claim, as the article writes it: 10 rows per
/// transaction, no index to read, `FOR UPDATE SKIP LOCKED` so that relays would not wait on each
/// other.
pub async fn claim_baseline<'c>(db: impl PgExecutor<'c>) -> sqlx::Result<Vec<PgRow>> {
    sqlx::query(
        "SELECT id, topic, payload FROM baseline_outbox WHERE published_at IS NULL
             ORDER BY created_at LIMIT 10 FOR UPDATE SKIP LOCKED",
    )
    .fetch_all(db)
    .await
}

/// BenchBaselineSettle. The minimal design's settle: one UPDATE per event, in the claim's
/// transaction.
pub async fn settle_baseline<'c>(db: impl PgExecutor<'c>, id: uuid::Uuid) -> sqlx::Result<()> {
    sqlx::query("UPDATE baseline_outbox SET published_at = now() WHERE id = $1")
        .bind(id)
        .execute(db)
        .await
        .map(|_| ())
}

/// BenchKeyed. Pending events over `$2` keys, round-robin (`g % $2`): each key's events spread
/// evenly through the backlog, the same keyed backlog for the ordered and the unordered runs.
pub async fn fill_keyed(pool: &PgPool, events: i64, keys: i64) -> sqlx::Result<()> {
    sqlx::query(
        "INSERT INTO outbox (topic, key, payload)
         SELECT 'bench.keyed', 'key-' || (g % $2), jsonb_build_object('n', g)
         FROM generate_series(1, $1) g",
    )
    .bind(events)
    .bind(keys)
    .execute(pool)
    .await
    .map(|_| ())
}

/// BenchBreakerOpen. Destination `$1` down: its breaker open with the next probe a day away,
/// after the run ends, so the relay holds its pairs in the deliveries table throughout.
pub async fn open_breaker(pool: &PgPool, destination: &str) -> sqlx::Result<()> {
    sqlx::query(
        "INSERT INTO outbox_destinations (name, breaker, breaker_since, last_error, probe_at)
             VALUES ($1, 'open', now(), 'down for the benchmark', now() + interval '1 day')",
    )
    .bind(destination)
    .execute(pool)
    .await
    .map(|_| ())
}

/// BenchLiveInsert. `bench migrate`'s producers' single-row INSERT, autocommit, into the table
/// being upgraded; [`super::watch::lock_waits`] recognises them by its start.
pub async fn insert_live<'c>(db: impl PgExecutor<'c>) -> sqlx::Result<()> {
    sqlx::query("INSERT INTO outbox (topic, payload) VALUES ('bench.live', '{\"order_id\": 1}')")
        .execute(db)
        .await
        .map(|_| ())
}

/// BenchNotifyTrigger. The alternative wake-up whose cost producers pay: a statement-level
/// trigger that NOTIFYs on every INSERT into the outbox.
const NOTIFY_TRIGGER: &str = "CREATE FUNCTION bench_notify() RETURNS trigger LANGUAGE plpgsql AS
           $$ BEGIN PERFORM pg_notify('pgoutbox', ''); RETURN NULL; END $$;
         CREATE TRIGGER bench_notify AFTER INSERT ON outbox FOR EACH STATEMENT EXECUTE FUNCTION bench_notify();";

/// Adds the NOTIFY trigger ([`NOTIFY_TRIGGER`]) to the outbox.
pub async fn create_notify_trigger(pool: &PgPool) -> sqlx::Result<()> {
    sqlx::raw_sql(NOTIFY_TRIGGER)
        .execute(pool)
        .await
        .map(|_| ())
}

/// Removes the NOTIFY trigger and its function.
pub async fn drop_notify_trigger(pool: &PgPool) -> sqlx::Result<()> {
    sqlx::raw_sql("DROP TRIGGER bench_notify ON outbox; DROP FUNCTION bench_notify();")
        .execute(pool)
        .await
        .map(|_| ())
}

/// The producers' statement as a plain INSERT into `table`: what an application in any language
/// writes. It returns the event's id, which the sinks forward (the receiver matches arrivals by it).
pub fn producer_insert(table: &str) -> anyhow::Result<String> {
    let table = pgoutbox::table::Ident::parse(table)?.quoted();
    Ok(format!(
        "INSERT INTO {table} (topic, payload) VALUES ('bench.steady', '{{\"order_id\": 1}}') RETURNING id"
    ))
}

/// BenchProducerInsertKeyed. The producer's INSERT with one of 1,000 keys (`bench replay
/// --ordered`), the keys of [`RETAINED`]. A key's inserts take turns (a transaction advisory lock
/// on the key, taken before the row gets its `seq`), as an application that orders a key's events
/// does: a key's `seq` order is then its commit order, and the bench can count any event
/// delivered out of it as a violation.
pub fn producer_insert_keyed(table: &str) -> anyhow::Result<String> {
    let table = pgoutbox::table::Ident::parse(table)?.quoted();
    Ok(format!(
        "INSERT INTO {table} (topic, key, payload)
         SELECT 'bench.steady', k.key, '{{\"order_id\": 1}}'
         FROM (SELECT 'k' || floor(random() * 1000)::int AS key) k,
              LATERAL (SELECT pg_advisory_xact_lock(hashtext(k.key))) l
         RETURNING id"
    ))
}

/// BenchRetained. Published events kept in the outbox (`retention`), 1,000 keys: what `bench
/// replay` sends again.
pub const RETAINED: &str = "INSERT INTO outbox (topic, key, payload, published_at)
             SELECT 'bench.event', 'k' || (g % 1000), jsonb_build_object('n', g, 'order_id', g % 1000, 'note', 'benchmark event payload'), now()
             FROM generate_series(1, $1) g";

/// The same event as a transactional logical decoding message (migration 0009), through `table`'s
/// emit function; it returns the event's id too.
pub fn producer_emit(table: &str) -> anyhow::Result<String> {
    Ok(format!(
        "SELECT {}('bench.steady', '{{\"order_id\": 1}}')",
        pgoutbox::OutboxTable::parse("public", table)?.derived("emit")
    ))
}

/// Commits one producer event with `statement` (autocommit), returning its id.
pub async fn commit_event<'c>(
    db: impl PgExecutor<'c>,
    statement: &str,
) -> sqlx::Result<uuid::Uuid> {
    sqlx::query_scalar(statement).fetch_one(db).await
}

/// BenchInsertSpread. `$1` events spread evenly over the topics `t.0` … `t.<$2 - 1>`, in one
/// statement: each of `bench destinations`' destinations takes one topic.
pub async fn insert_spread(pool: &PgPool, events: i64, topics: i64) -> sqlx::Result<()> {
    sqlx::query(
        "INSERT INTO outbox (topic, payload)
         SELECT 't.' || (g % $2), jsonb_build_object('n', g) FROM generate_series(1, $1) g",
    )
    .bind(events)
    .bind(topics)
    .execute(pool)
    .await?;
    Ok(())
}

/// BenchRuntimeDestinations. The destinations `d1` … `d<$1 - 1>` managed at runtime, each a
/// webhook to `$2` on topic `t.<i>`, as `pgoutbox destinations add` writes them (no secrets),
/// replacing any there were; then the version moves, as every change moves it.
pub async fn runtime_destinations(pool: &PgPool, count: i64, url: &str) -> sqlx::Result<()> {
    let mut tx = pool.begin().await?;
    sqlx::query("DELETE FROM outbox_definitions")
        .execute(&mut *tx)
        .await?;
    sqlx::query(
        "INSERT INTO outbox_definitions (name, definition)
         SELECT 'd' || g, jsonb_build_object('name', 'd' || g, 'type', 'webhook', 'url', $2::text,
                                             'topics', jsonb_build_array('t.' || g))
         FROM generate_series(1, $1 - 1) g",
    )
    .bind(count)
    .bind(url)
    .execute(&mut *tx)
    .await?;
    sqlx::query("UPDATE outbox_definitions_version SET version = version + 1")
        .execute(&mut *tx)
        .await?;
    tx.commit().await
}

/// `count` due pairs of the destination `destination` in the default outbox's deliveries table,
/// as a destination that was down and is back leaves them (`bench fairness`); then ANALYZE.
pub async fn due_pairs(pool: &PgPool, destination: &str, count: i64) -> sqlx::Result<()> {
    sqlx::query(
        "INSERT INTO outbox_deliveries (event_id, destination, seq, topic, payload, created_at,
                                        attempts, next_attempt_at)
         SELECT gen_random_uuid(), $2, g, $2, jsonb_build_object('n', g),
                now() - interval '1 hour', 1, now() - interval '1 minute'
         FROM generate_series(1, $1) g",
    )
    .bind(count)
    .bind(destination)
    .execute(pool)
    .await?;
    sqlx::query("ANALYZE outbox_deliveries")
        .execute(pool)
        .await
        .map(|_| ())
}

/// One statement of events on the topics `t.<i>` for each `i` of `topics`: each event's id and
/// `i`, in no particular order.
pub async fn spread_events(pool: &PgPool, topics: &[i32]) -> sqlx::Result<Vec<(String, i32)>> {
    sqlx::query_as(
        "INSERT INTO outbox (topic, payload)
         SELECT 't.' || i, '{}'::jsonb FROM unnest($1::int[]) AS i
         RETURNING id::text, split_part(topic, '.', 2)::int",
    )
    .bind(topics)
    .fetch_all(pool)
    .await
}
