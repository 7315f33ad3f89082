//! The names of the relay's metrics, and what each one means.
//!
//! Counters and histograms are recorded through the `metrics` facade wherever the thing they count
//! happens (a no-op until a recorder is installed); every name is listed in [`METRICS`], which the
//! README's table and the tests follow.

/// Events delivered and settled, by destination and topic.
pub const PUBLISHED_TOTAL: &str = "pgoutbox_events_published_total";
/// Failed attempts scheduled for a retry, by destination and topic.
pub const FAILED_TOTAL: &str = "pgoutbox_events_failed_total";
/// Events dead-lettered, by destination and topic.
pub const DEAD_LETTERED_TOTAL: &str = "pgoutbox_events_dead_lettered_total";
/// The `destination` label of the destinations managed at runtime, counted together: their names
/// are data (a customer's endpoint each), and a series per name would grow every scrape with
/// their number. Each one's own figures are in the console and `pgoutbox destinations show`.
pub const RUNTIME_DESTINATIONS: &str = "(runtime)";

/// The `topic` label of the series of the destinations managed at runtime: their topics are
/// counted together too, since a customer's endpoint may have topics of its own.
pub const ALL_TOPICS: &str = "(all)";

/// The `topic` label of `topic`'s events in the series labelled `series` (a destination's, or
/// [`RUNTIME_DESTINATIONS`]).
pub fn series_topic<'a>(series: &str, topic: &'a str) -> &'a str {
    if series == RUNTIME_DESTINATIONS {
        ALL_TOPICS
    } else {
        topic
    }
}

/// Time a destination took to publish its share of a batch.
pub const PUBLISH_SECONDS: &str = "pgoutbox_publish_duration_seconds";
/// From the event's commit (its `created_at`) to its delivery.
pub const COMMIT_TO_PUBLISH_SECONDS: &str = "pgoutbox_commit_to_publish_seconds";
/// Events per claimed batch.
pub const BATCH_SIZE: &str = "pgoutbox_batch_size";
/// Duration of the claim statement.
pub const CLAIM_SECONDS: &str = "pgoutbox_claim_duration_seconds";
/// Duration of a batch's settle (statements and commit).
pub const SETTLE_SECONDS: &str = "pgoutbox_settle_duration_seconds";
/// Claims or settles that failed on a database error.
pub const DB_ERRORS_TOTAL: &str = "pgoutbox_database_errors_total";
/// Broker connections a sink made after its first one (after one broke, or for the probe of an
/// open breaker), by destination.
pub const SINK_RECONNECTS_TOTAL: &str = "pgoutbox_sink_reconnects_total";
/// Pending events due now, by destination and topic.
pub const PENDING_DUE: &str = "pgoutbox_pending_due";
/// Pending events waiting for a retry (or leased), by destination and topic.
pub const PENDING_BACKOFF: &str = "pgoutbox_pending_backoff";
/// Dead-lettered events, by destination and topic.
pub const DEAD: &str = "pgoutbox_dead";
/// Age of the oldest pending event, by destination and topic: the lag.
pub const OLDEST_PENDING_AGE_SECONDS: &str = "pgoutbox_oldest_pending_age_seconds";

/// Events held for their destination (paused or breaker open), with no attempt counted.
pub const HELD_TOTAL: &str = "pgoutbox_events_held_total";
/// A destination's circuit breaker: 0 closed, 1 half-open, 2 open.
pub const DESTINATION_STATE: &str = "pgoutbox_destination_state";
/// Whether an operator paused the destination (1) or not (0).
pub const DESTINATION_PAUSED: &str = "pgoutbox_destination_paused";
/// Times a destination's lanes found its `rate_limit` bucket empty and waited for tokens.
pub const RATE_LIMIT_WAITS_TOTAL: &str = "pgoutbox_rate_limit_waits_total";
/// Retained events a replay (or backfill) queued for the destination again.
pub const REPLAYED_TOTAL: &str = "pgoutbox_replayed_total";

/// `source = "wal"`: WAL the relay's replication slot holds back (current position − confirmed).
pub const WAL_SLOT_LAG_BYTES: &str = "pgoutbox_wal_slot_lag_bytes";
/// `source = "wal"`: bytes left before the slot risks losing WAL (-1: no `max_slot_wal_keep_size`).
pub const WAL_SLOT_SAFE_WAL_SIZE_BYTES: &str = "pgoutbox_wal_slot_safe_wal_size_bytes";
/// `source = "wal"`: 1 for the slot's current `wal_status`.
pub const WAL_SLOT_STATUS: &str = "pgoutbox_wal_slot_status";
/// `source = "wal"`: 1 while this relay streams the slot, 0 on standby.
pub const WAL_SLOT_ACTIVE: &str = "pgoutbox_wal_slot_active";
/// `source = "wal"`: messages with this table's prefix that are not events (skipped).
pub const WAL_UNDECODABLE_TOTAL: &str = "pgoutbox_wal_undecodable_total";

/// 1 while this relay is stalled: events due longer than `relay.stall_after` and nothing claimed
/// or settled for as long, or (WAL) events read that long ago and the slot not confirmed since
/// (`/readyz` fails with the reason).
pub const RELAY_STALLED: &str = "pgoutbox_relay_stalled";
/// `source = "wal"`: events read from the WAL (rows and `emit()` messages of this table).
pub const WAL_EVENTS_READ_TOTAL: &str = "pgoutbox_wal_events_read_total";
/// `source = "wal"`: streaming sessions this relay started on the slot.
pub const WAL_SESSIONS_TOTAL: &str = "pgoutbox_wal_sessions_total";
/// `source = "wal"`: times this relay did not stream, by reason: `failed` (a session ended or
/// could not start; it reconnects), `standby` (another relay streams the slot) or `missing` (the
/// slot is not on the server: lost in a failover, or dropped).
pub const WAL_SESSION_ENDS_TOTAL: &str = "pgoutbox_wal_session_ends_total";

/// The metrics of `source = "wal"` only (a polling relay has none of them).
pub const WAL_METRICS: &[(&str, &str, &str, &str)] = &[
    (
        WAL_EVENTS_READ_TOTAL,
        "counter",
        "",
        "events read from the WAL: rows and emit() messages of the outbox table",
    ),
    (
        WAL_SESSIONS_TOTAL,
        "counter",
        "",
        "streaming sessions this relay started on the slot",
    ),
    (
        WAL_SESSION_ENDS_TOTAL,
        "counter",
        "reason",
        "times the relay was not streaming: failed (it reconnects), standby (another relay streams the slot) or missing (no slot on the server: lost in a failover, or dropped)",
    ),
    (
        WAL_SLOT_LAG_BYTES,
        "gauge",
        "",
        "WAL the replication slot holds back: current WAL position minus the confirmed one",
    ),
    (
        WAL_SLOT_SAFE_WAL_SIZE_BYTES,
        "gauge",
        "",
        "bytes of WAL that can still be written before the slot risks being lost (-1: unbounded)",
    ),
    (
        WAL_SLOT_STATUS,
        "gauge",
        "status",
        "1 for the slot's wal_status: reserved, extended, unreserved, lost (or missing)",
    ),
    (
        WAL_SLOT_ACTIVE,
        "gauge",
        "",
        "1 while this relay streams the slot, 0 while it waits on standby",
    ),
    (
        WAL_UNDECODABLE_TOTAL,
        "counter",
        "",
        "messages with the table's prefix that are not events, skipped",
    ),
];

/// Every metric: name, type, labels, meaning (for docs and tests).
pub const METRICS: &[(&str, &str, &str, &str)] = &[
    (
        PUBLISHED_TOTAL,
        "counter",
        "destination, topic",
        "events delivered and settled",
    ),
    (
        FAILED_TOTAL,
        "counter",
        "destination, topic",
        "failed attempts scheduled for a retry",
    ),
    (
        DEAD_LETTERED_TOTAL,
        "counter",
        "destination, topic",
        "events dead-lettered",
    ),
    (
        PUBLISH_SECONDS,
        "histogram",
        "destination",
        "time to publish a destination's share of a batch",
    ),
    (
        COMMIT_TO_PUBLISH_SECONDS,
        "histogram",
        "destination",
        "event created_at to delivery",
    ),
    (BATCH_SIZE, "histogram", "", "events per claimed batch"),
    (CLAIM_SECONDS, "histogram", "", "claim statement duration"),
    (
        SETTLE_SECONDS,
        "histogram",
        "",
        "settle duration (statements + commit)",
    ),
    (
        DB_ERRORS_TOTAL,
        "counter",
        "",
        "claims or settles failed on a database error",
    ),
    (
        SINK_RECONNECTS_TOTAL,
        "counter",
        "destination",
        "broker connections a sink made after its first one (after one broke, or for a probe)",
    ),
    (
        PENDING_DUE,
        "gauge",
        "destination, topic",
        "pending events due now",
    ),
    (
        PENDING_BACKOFF,
        "gauge",
        "destination, topic",
        "pending events waiting for a retry or leased",
    ),
    (DEAD, "gauge", "destination, topic", "dead-lettered events"),
    (
        OLDEST_PENDING_AGE_SECONDS,
        "gauge",
        "destination, topic",
        "age of the oldest pending event (lag)",
    ),
    (
        HELD_TOTAL,
        "counter",
        "destination",
        "events held for a paused destination or an open breaker (no attempt counted)",
    ),
    (
        DESTINATION_STATE,
        "gauge",
        "destination",
        "circuit breaker: 0 closed, 1 half-open, 2 open",
    ),
    (
        DESTINATION_PAUSED,
        "gauge",
        "destination",
        "1 while an operator has paused the destination",
    ),
    (
        RATE_LIMIT_WAITS_TOTAL,
        "counter",
        "destination",
        "times the destination's lanes found its rate_limit bucket empty and waited (events ready, the limit held them)",
    ),
    (
        REPLAYED_TOTAL,
        "counter",
        "destination",
        "retained events replays and backfills queued for the destination again (sent by its lane like any pair)",
    ),
    (
        RELAY_STALLED,
        "gauge",
        "",
        "1 while events have been due longer than relay.stall_after and this relay claimed and settled nothing for as long",
    ),
];

/// Events this process delivered since it started, per destination: the console's throughput
/// samples are its differences. Counted once per settled batch and destination.
static DELIVERED: std::sync::Mutex<std::collections::BTreeMap<String, u64>> =
    std::sync::Mutex::new(std::collections::BTreeMap::new());

/// Counts `n` events delivered to `destination` (see [`DELIVERED`]).
pub fn count_delivered(destination: &str, n: u64) {
    if let Ok(mut counts) = DELIVERED.lock() {
        match counts.get_mut(destination) {
            Some(c) => *c += n,
            None => {
                counts.insert(destination.to_owned(), n);
            }
        }
    }
}

/// What [`count_delivered`] counted so far, per destination.
pub fn delivered_so_far() -> std::collections::BTreeMap<String, u64> {
    DELIVERED.lock().map(|c| c.clone()).unwrap_or_default()
}
