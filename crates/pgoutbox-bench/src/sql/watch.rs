//! What the bench reads of the server while a relay runs: the settings that head the results, the
//! checkpointer's activity, table sizes and statistics, lock waits, replication slot positions and
//! index use. The readings taken while a relay runs are catalog or statistics queries or index
//! probes, never a count of the outbox, so that watching does not cost the relay being measured;
//! the check after `bench migrate` ([`upgrade_check`]) reads the table whole.

use sqlx::{PgExecutor, PgPool};

/// The settings that move the numbers, as `SHOW` prints them: server version,
/// synchronous_commit, shared_buffers and fsync, in that order.
pub async fn settings(pool: &PgPool) -> sqlx::Result<(String, String, String, String)> {
    let version: String = sqlx::query_scalar("SHOW server_version")
        .fetch_one(pool)
        .await?;
    let sync: String = sqlx::query_scalar("SHOW synchronous_commit")
        .fetch_one(pool)
        .await?;
    let buffers: String = sqlx::query_scalar("SHOW shared_buffers")
        .fetch_one(pool)
        .await?;
    let fsync: String = sqlx::query_scalar("SHOW fsync").fetch_one(pool).await?;
    Ok((version, sync, buffers, fsync))
}

/// The server's version as a number (e.g. 170002): its major version picks the pg_recvlogical.
pub async fn server_version_num(pool: &PgPool) -> sqlx::Result<i32> {
    sqlx::query_scalar("SELECT current_setting('server_version_num')::int")
        .fetch_one(pool)
        .await
}

/// BenchCheckpointer. The checkpointer's wait event (`running` when it waits on nothing), from
/// `pg_stat_activity`: sampled every 100 ms, it shows when a checkpoint writes or syncs.
pub async fn checkpointer_wait_event(pool: &PgPool) -> sqlx::Result<Option<String>> {
    sqlx::query_scalar(
        "SELECT coalesce(wait_event, 'running') FROM pg_stat_activity
                     WHERE backend_type = 'checkpointer'",
    )
    .fetch_optional(pool)
    .await
}

/// CheckpointsStarted (PostgreSQL ≤ 16).
const CHECKPOINTS_TO_16: &str =
    "SELECT (checkpoints_timed + checkpoints_req)::bigint FROM pg_stat_bgwriter";
/// CheckpointsStarted (PostgreSQL ≥ 17, where the counts moved to their own view).
const CHECKPOINTS_FROM_17: &str =
    "SELECT (num_timed + num_requested)::bigint FROM pg_stat_checkpointer";

/// Checkpoints the server started so far (timed or requested); 0 when neither view answers.
/// pg_stat_bgwriter holds the checkpoint counts up to PostgreSQL 16, pg_stat_checkpointer from 17.
pub async fn checkpoints_started(pool: &PgPool) -> i64 {
    let mut checkpoints = 0;
    for query in [CHECKPOINTS_TO_16, CHECKPOINTS_FROM_17] {
        if let Ok(n) = sqlx::query_scalar::<_, i64>(query).fetch_one(pool).await {
            checkpoints = n;
            break;
        }
    }
    checkpoints
}

/// OutboxSizes. Heap and index sizes, the statistics' tuple counts and the autovacuum runs so far
/// of the outbox and of its history's partitions (empty unless `history = "partitions"`); a
/// partition dropped meanwhile counts for nothing.
const SIZES: &str = "
WITH t AS (SELECT 'outbox'::regclass AS relid
           UNION ALL SELECT relid FROM pg_partition_tree('outbox_history') WHERE isleaf)
SELECT coalesce(sum(pg_relation_size(t.relid)), 0)::float8 / 1048576,
       coalesce(sum(pg_indexes_size(t.relid)), 0)::float8 / 1048576,
       coalesce(sum(s.n_dead_tup), 0)::bigint, coalesce(sum(s.n_live_tup), 0)::bigint,
       coalesce(sum(s.autovacuum_count), 0)::bigint
FROM t LEFT JOIN pg_stat_user_tables s ON s.relid = t.relid";

/// One reading of [`SIZES`]: table MB, indexes MB, dead and live tuples, autovacuum runs.
pub type Sizes = (f64, f64, i64, i64, i64);

/// Reads [`SIZES`].
pub async fn outbox_sizes(pool: &PgPool) -> sqlx::Result<Sizes> {
    sqlx::query_as(SIZES).fetch_one(pool).await
}

/// BenchAnyPending. Whether a row is still pending: an EXISTS probe reads the first entry of the
/// pending index, never a count of the backlog, so polling it every 20 ms does not cost the relay.
pub async fn any_pending(pool: &PgPool) -> sqlx::Result<bool> {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM outbox WHERE published_at IS NULL AND dead_at IS NULL)",
    )
    .fetch_one(pool)
    .await
}

/// BenchSettled. Rows updated or deleted in the outbox so far, from the statistics counters (no
/// read of the table): the progress bar of a drain.
pub async fn settled_rows(pool: &PgPool) -> sqlx::Result<Option<i64>> {
    sqlx::query_scalar(
        "SELECT (n_tup_upd + n_tup_del)::bigint FROM pg_stat_user_tables WHERE relname = 'outbox'",
    )
    .fetch_optional(pool)
    .await
}

/// BenchLockWaits. The producers' INSERTs waiting on a lock now (those whose query starts with
/// `INSERT INTO outbox`: see [`super::load::insert_live`]), each with whether it waits on the
/// table's lock (what migrate's DDL could cause) and for how long it has run.
pub async fn lock_waits<'c>(db: impl PgExecutor<'c>) -> sqlx::Result<Vec<(bool, f64)>> {
    sqlx::query_as(
        "SELECT wait_event = 'relation',
                            extract(epoch FROM clock_timestamp() - query_start)::float8
                     FROM pg_stat_activity
                     WHERE datname = current_database() AND wait_event_type = 'Lock'
                       AND query LIKE 'INSERT INTO outbox%'",
    )
    .fetch_all(db)
    .await
}

/// BenchUpgradeCheck. After `bench migrate`: the rows in all, the highest `seq` of the old rows
/// and the lowest of the producers' rows, to check that the upgrade kept every row and numbered
/// the old ones first.
pub async fn upgrade_check(pool: &PgPool) -> sqlx::Result<(i64, Option<i64>, Option<i64>)> {
    sqlx::query_as(
        "SELECT count(*), max(seq) FILTER (WHERE topic = 'bench.old'), min(seq) FILTER (WHERE topic = 'bench.live')
         FROM outbox",
    )
    .fetch_one(pool)
    .await
}

/// Events dead and events attempted (failed at least once) in the outbox.
pub async fn dead_and_attempted(pool: &PgPool) -> sqlx::Result<(i64, i64)> {
    sqlx::query_as(
        "SELECT count(*) FILTER (WHERE dead_at IS NOT NULL), count(*) FILTER (WHERE attempts > 0)
         FROM outbox",
    )
    .fetch_one(pool)
    .await
}

/// Every event's id, key and seq, for a per-key order check of what a receiver saw.
pub async fn keys_and_seqs(pool: &PgPool) -> sqlx::Result<Vec<(String, Option<String>, i64)>> {
    sqlx::query_as("SELECT id::text, key, seq FROM outbox")
        .fetch_all(pool)
        .await
}

/// The id of some dead event, for the console's one-event call.
pub async fn some_dead_event(pool: &PgPool) -> sqlx::Result<String> {
    sqlx::query_scalar("SELECT id::text FROM outbox WHERE dead_at IS NOT NULL LIMIT 1")
        .fetch_one(pool)
        .await
}

/// Has the console's session publish its statistics counters now (a backend publishes them when
/// idle, at most once a second, unless asked), then end its transaction with a trivial query.
pub async fn flush_stats(console: &PgPool) -> sqlx::Result<()> {
    sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(console)
        .await?;
    sqlx::query("SELECT 1").execute(console).await?;
    Ok(())
}

/// BenchIndexUse. Index scans per index and sequential scans per table of the outbox's tables
/// (`idx_scan`, `seq_scan`): read before and after a console call, what the call used.
pub async fn index_use(pool: &PgPool) -> sqlx::Result<Vec<(String, i64)>> {
    sqlx::query_as(
        "SELECT indexrelname::text, idx_scan FROM pg_stat_user_indexes WHERE relname LIKE 'outbox%'
         UNION ALL
         SELECT 'seq scan of ' || relname, seq_scan FROM pg_stat_user_tables WHERE relname LIKE 'outbox%'",
    )
    .fetch_all(pool)
    .await
}

/// The confirmed position of `slot`: where a reader of it starts.
pub async fn confirmed_flush_lsn(pool: &PgPool, slot: &str) -> sqlx::Result<String> {
    sqlx::query_scalar(
        "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
    )
    .bind(slot)
    .fetch_one(pool)
    .await
}

/// The server's current WAL position: the end of a backlog just written.
pub async fn current_wal_lsn(pool: &PgPool) -> sqlx::Result<String> {
    sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
        .fetch_one(pool)
        .await
}

/// WAL bytes from `start` to `end`: how much a backlog wrote.
pub async fn wal_bytes(pool: &PgPool, end: &str, start: &str) -> sqlx::Result<i64> {
    sqlx::query_scalar("SELECT pg_wal_lsn_diff($1::pg_lsn, $2::pg_lsn)::bigint")
        .bind(end)
        .bind(start)
        .fetch_one(pool)
        .await
}

/// The pid of the walsender streaming `slot` (none while no one streams it; no row when the
/// slot is gone).
pub async fn slot_active_pid(pool: &PgPool, slot: &str) -> sqlx::Result<Option<Option<i32>>> {
    sqlx::query_scalar("SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1")
        .bind(slot)
        .fetch_optional(pool)
        .await
}

/// BenchSlotConfirmed. `slot`'s confirmed position as the server has it, and whether it has
/// reached `end`: the relay confirms a position only once the events before it are settled.
pub async fn slot_confirmed(
    pool: &PgPool,
    slot: &str,
    end: &str,
) -> sqlx::Result<(Option<String>, Option<bool>)> {
    sqlx::query_as(
        "SELECT confirmed_flush_lsn::text, confirmed_flush_lsn >= $2::pg_lsn
             FROM pg_replication_slots WHERE slot_name = $1",
    )
    .bind(slot)
    .bind(end)
    .fetch_one(pool)
    .await
}

/// BenchSent. WAL bytes the walsender of `slot` has sent since `start` (no row when it is not
/// streaming): the progress shown while waiting, read from `pg_stat_replication`.
pub async fn sent_bytes(
    pool: &PgPool,
    slot: &str,
    start: &str,
) -> sqlx::Result<Option<Option<i64>>> {
    sqlx::query_scalar::<_, Option<i64>>(
        "SELECT pg_wal_lsn_diff(r.sent_lsn, $2::pg_lsn)::bigint
         FROM pg_replication_slots s JOIN pg_stat_replication r ON r.pid = s.active_pid
         WHERE s.slot_name = $1",
    )
    .bind(slot)
    .bind(start)
    .fetch_optional(pool)
    .await
}

/// BenchRelayBackends. The pids of the relay's sessions on this database (its pool's
/// `application_name`): how many connections it holds, and whose CPU to read in /proc.
pub async fn relay_backends(pool: &PgPool) -> sqlx::Result<Vec<i32>> {
    sqlx::query_scalar(
        "SELECT pid FROM pg_stat_activity
         WHERE datname = current_database() AND application_name = 'pgoutbox-relay'",
    )
    .fetch_all(pool)
    .await
}

/// BenchTransactions. Transactions committed and rolled back in this database so far (the
/// statistics' counters, flushed by each session about once a second).
pub async fn transactions(pool: &PgPool) -> sqlx::Result<i64> {
    sqlx::query_scalar(
        "SELECT (xact_commit + xact_rollback)::bigint FROM pg_stat_database
         WHERE datname = current_database()",
    )
    .fetch_one(pool)
    .await
}

/// The undelivered pairs of `destination` in the default outbox's deliveries table.
pub async fn pairs_left(pool: &PgPool, destination: &str) -> sqlx::Result<i64> {
    sqlx::query_scalar("SELECT count(*) FROM outbox_deliveries WHERE destination = $1")
        .bind(destination)
        .fetch_one(pool)
        .await
}
