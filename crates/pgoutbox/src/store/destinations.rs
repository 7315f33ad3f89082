//! `<table>_destinations`: each destination's shared state — an operator's pause and its circuit
//! breaker — read by every relay about once a second and by `pgoutbox status`.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;

use super::Store;
use crate::error::Result;
use crate::table::OutboxTable;

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

/// DestinationsReadChanged. The shared state of the destinations whose row changed since `$1`
/// (every write sets `updated_at`; NULL: every destination), each with the server's time of the
/// read: what a relay's sync reads each second, a few rows whatever the number of destinations
/// (a sequential scan of a narrow table).
const DESTINATIONS_READ_CHANGED: &str = "
SELECT name, paused_at, breaker, breaker_since, last_error, failed_probes, probe_at,
       now() AS read_at
FROM {qname:destinations} WHERE $1::timestamptz IS NULL OR updated_at >= $1";

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

/// The destinations' statements, rendered.
pub(super) struct Sql {
    register: String,
    read: String,
    read_changed: String,
    open: String,
    take_probe: String,
    probe_failed: String,
    close: String,
    pause: String,
    resume: String,
}

impl Sql {
    pub(super) fn render(table: &OutboxTable) -> Self {
        let r = |t: &str| table.render(t);
        Self {
            register: r(DESTINATIONS_REGISTER),
            read: r(DESTINATIONS_READ),
            read_changed: r(DESTINATIONS_READ_CHANGED),
            open: r(DESTINATION_OPEN),
            take_probe: r(DESTINATION_TAKE_PROBE),
            probe_failed: r(DESTINATION_PROBE_FAILED),
            close: r(DESTINATION_CLOSE),
            pause: r(DESTINATION_PAUSE),
            resume: r(DESTINATION_RESUME),
        }
    }
}

/// One destination's shared state, as stored.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct DestinationState {
    /// The destination.
    pub name: String,
    /// When an operator paused it; `None` when running.
    pub paused_at: Option<DateTime<Utc>>,
    /// `closed`, `open` or `half_open`.
    pub breaker: String,
    /// When the breaker last changed state.
    pub breaker_since: DateTime<Utc>,
    /// The failure that opened the breaker, or the last failed probe.
    pub last_error: Option<String>,
    /// Probes failed since the breaker opened.
    pub failed_probes: i32,
    /// When the next probe may go (open), or when the current one counts as lost (half-open).
    pub probe_at: Option<DateTime<Utc>>,
}

/// DestinationsRegister: one row per configured destination (name, whether its dead events
/// block their key).
pub async fn register(store: &Store, names: &[&str], dead_blocks: &[bool]) -> Result<()> {
    sqlx::query(&store.sql.destinations.register)
        .bind(names)
        .bind(dead_blocks)
        .execute(store.pool())
        .await?;
    Ok(())
}

/// DestinationsRead: every destination's stored state.
pub async fn read(store: &Store) -> Result<Vec<DestinationState>> {
    Ok(sqlx::query_as(&store.sql.destinations.read)
        .fetch_all(store.pool())
        .await?)
}

/// A changed destination's state and when it was read (the server's clock).
#[derive(Debug, sqlx::FromRow)]
struct Changed {
    #[sqlx(flatten)]
    state: DestinationState,
    read_at: DateTime<Utc>,
}

/// DestinationsReadChanged: the stored state of the destinations changed since `since` (`None`:
/// every one), and when they were read (`None` when no row came back).
pub async fn read_changed(
    store: &Store,
    since: Option<DateTime<Utc>>,
) -> Result<(Vec<DestinationState>, Option<DateTime<Utc>>)> {
    let rows: Vec<Changed> = sqlx::query_as(&store.sql.destinations.read_changed)
        .bind(since)
        .fetch_all(store.pool())
        .await?;
    let read_at = rows.first().map(|r| r.read_at);
    Ok((rows.into_iter().map(|r| r.state).collect(), read_at))
}

/// DestinationOpen: the breaker of `name` opens with `error`, the first probe after
/// `probe_interval` (a no-op if another relay opened it first).
pub async fn open(store: &Store, name: &str, error: &str, probe_interval: Duration) -> Result<()> {
    sqlx::query(&store.sql.destinations.open)
        .bind(name)
        .bind(error)
        .bind(probe_interval.as_secs_f64())
        .execute(store.pool())
        .await?;
    Ok(())
}

/// DestinationTakeProbe: takes the probe of `name` if it is due and no other relay has it, for
/// `hold`; returns the failed probes so far when taken.
pub async fn take_probe(store: &Store, name: &str, hold: Duration) -> Result<Option<i32>> {
    Ok(sqlx::query_scalar(&store.sql.destinations.take_probe)
        .bind(name)
        .bind(hold.as_secs_f64())
        .fetch_optional(store.pool())
        .await?)
}

/// DestinationProbeFailed: the probe failed with `error` (or, `None`, found nothing to send); the
/// next one after `delay`.
pub async fn probe_failed(
    store: &Store,
    name: &str,
    error: Option<&str>,
    delay: Duration,
) -> Result<()> {
    sqlx::query(&store.sql.destinations.probe_failed)
        .bind(name)
        .bind(error)
        .bind(delay.as_secs_f64())
        .bind(error.is_some())
        .execute(store.pool())
        .await?;
    Ok(())
}

/// DestinationClose: the destination is back.
pub async fn close(store: &Store, name: &str) -> Result<()> {
    sqlx::query(&store.sql.destinations.close)
        .bind(name)
        .execute(store.pool())
        .await?;
    Ok(())
}

/// DestinationPause: an operator pauses `name` for every relay: its events are held (within about
/// a second) until [`resume`].
pub async fn pause(store: &Store, name: &str) -> Result<()> {
    sqlx::query(&store.sql.destinations.pause)
        .bind(name)
        .execute(store.pool())
        .await?;
    Ok(())
}

/// DestinationResume: resumes `name`, then makes its held events due again; returns how many
/// (`None` when it was not paused).
pub async fn resume(store: &Store, name: &str) -> Result<Option<u64>> {
    let done = sqlx::query(&store.sql.destinations.resume)
        .bind(name)
        .execute(store.pool())
        .await?;
    if done.rows_affected() == 0 {
        return Ok(None);
    }
    Ok(Some(super::held::unpark_followers(store).await?))
}
