//! Readiness: whether the database answers, each destination takes events, and events move:
//! a relay whose destinations are healthy but that has claimed and settled nothing while events
//! wait is stalled (a lock held on its rows, a wedged statement), and says so.

use std::time::Duration;

use super::context::Context;
use super::lane::Lane;
use crate::config::Source;
use crate::model::metric;

/// How many destinations' health checks run at once for readiness.
const HEALTH_CHECKS_AT_ONCE: usize = 32;

/// Whether the relay is stalled: an event has been due longer than `stall_after` and the relay
/// has claimed and settled nothing for as long. `Some(why)` when stalled.
pub(super) fn stalled(
    oldest_due: Option<Duration>,
    since_progress: Duration,
    stall_after: Duration,
) -> Option<String> {
    let due = oldest_due?;
    (due > stall_after && since_progress > stall_after).then(|| {
        format!(
            "stalled: an event has been due for {} s and this relay has claimed and settled \
             nothing for {} s (relay.stall_after = {} s): look for locks on the outbox's rows \
             (pg_locks, pg_stat_activity) or a statement that does not finish",
            due.as_secs(),
            since_progress.as_secs(),
            stall_after.as_secs()
        )
    })
}

impl Context {
    /// Whether this relay is stalled, also set as `pgoutbox_relay_stalled`: polling, events due
    /// longer than `relay.stall_after` and nothing claimed or settled for as long; reading the
    /// WAL, events read that long ago and the slot's confirmed position not moved since.
    pub(super) async fn stall(&self) -> crate::Result<Option<String>> {
        let stall_after = self.config.relay.stall_after;
        let why = if self.config.source == Source::Wal {
            self.progress.wal_unconfirmed_for().and_then(|waited| {
                (waited > stall_after).then(|| {
                    format!(
                        "stalled: events read from the slot {} s ago wait and its confirmed \
                         position has not moved since (relay.stall_after = {} s): look for locks \
                         on the outbox's rows (pg_locks, pg_stat_activity) or a statement that \
                         does not finish",
                        waited.as_secs(),
                        stall_after.as_secs()
                    )
                })
            })
        } else {
            let oldest = crate::store::backlog::oldest_due_seconds(&self.store)
                .await?
                .map(|s| Duration::from_secs_f64(s.max(0.0)));
            stalled(oldest, self.progress.since(), stall_after)
        };
        metrics::gauge!(metric::RELAY_STALLED).set(if why.is_some() { 1.0 } else { 0.0 });
        Ok(why)
    }

    /// The WAL the replication slot holds back, in bytes (`None`: no slot).
    async fn slot_lag(&self) -> std::result::Result<Option<u64>, String> {
        let names = crate::sources::wal::slot::Names::of(&self.config.wal, &self.config.table);
        crate::sources::wal::slot::status(self.store.pool(), &names)
            .await
            .map(|s| s.map(|s| s.lag_bytes.unwrap_or(0).max(0) as u64))
            .map_err(|e| e.to_string())
    }

    /// Readiness of the database and one destination (`Some(name)`), or of every destination.
    /// `Err` with one line when no destination has that name.
    pub(super) async fn readiness_of(
        &self,
        only: Option<&str>,
    ) -> std::result::Result<Vec<String>, Vec<String>> {
        if let Some(name) = only.filter(|name| self.lanes.named(name).is_none()) {
            return Err(vec![format!("no destination is named {name:?}\n")]);
        }
        let limit = Duration::from_secs(2);
        let mut lines = Vec::new();
        let mut ready = true;
        let db = tokio::time::timeout(limit, self.store.ping()).await;
        let line = match db {
            Ok(Ok(_)) => "ok".to_owned(),
            Ok(Err(e)) => format!("not ready: {}", crate::error_chain(&e)),
            Err(_) => "not ready: no answer within 2 s".into(),
        };
        ready &= line == "ok";
        lines.push(format!("database: {line}\n"));
        if ready {
            let line = match tokio::time::timeout(limit, self.stall()).await {
                Ok(Ok(None)) => "ok".to_owned(),
                Ok(Ok(Some(why))) => format!("not ready: {why}"),
                Ok(Err(e)) => format!("not ready: {}", crate::error_chain(&e)),
                Err(_) => "not ready: no answer within 2 s".into(),
            };
            ready &= line == "ok";
            lines.push(format!("progress: {line}\n"));
        }
        if let (true, Some(max)) = (ready, self.config.wal.max_slot_lag) {
            if self.config.source == Source::Wal {
                let line = match tokio::time::timeout(limit, self.slot_lag()).await {
                    Ok(Ok(Some(lag))) if lag > max => format!(
                        "not ready: it holds back {lag} bytes of WAL (wal.max_slot_lag = {max})"
                    ),
                    Ok(Ok(Some(lag))) => format!("ok ({lag} bytes behind)"),
                    Ok(Ok(None)) => "not ready: no such slot (pgoutbox slot create)".into(),
                    Ok(Err(e)) => format!("not ready: {e}"),
                    Err(_) => "not ready: no answer within 2 s".into(),
                };
                ready &= line.starts_with("ok");
                lines.push(format!("slot: {line}\n"));
            }
        }
        // A destination managed at runtime is a customer's endpoint: one of thousands is always
        // down somewhere, and neither it nor checking them all each time is a reason to take the
        // relay out of service. Asked for by name, it answers.
        let checked: Vec<&Lane> = self
            .lanes
            .iter()
            .filter(|lane| match only {
                Some(name) => name == lane.name(),
                None => !lane.config.runtime,
            })
            .collect();
        // Side by side, a few at a time: one after the other, a file of 10,000 destinations took
        // seconds to answer, longer than a probe waits.
        for some in checked.chunks(HEALTH_CHECKS_AT_ONCE) {
            let checks = futures::future::join_all(some.iter().map(|l| l.health(limit))).await;
            for (lane, check) in some.iter().zip(checks) {
                let (breaker, paused) = lane.gate.state();
                let line = match (lane.gate.problem(), check) {
                    // A pause is an operator's decision, not a fault.
                    (Some(p), None) if paused => p,
                    (Some(p), _) => {
                        ready = false;
                        format!("not ready: {p}")
                    }
                    (None, Some(e)) => {
                        ready = false;
                        format!("not ready: {e}")
                    }
                    (None, None) => format!("ok (breaker {breaker})"),
                };
                lines.push(format!("destination {}: {line}\n", lane.name()));
            }
        }
        if ready {
            Ok(lines)
        } else {
            Err(lines)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stalled_only_when_events_wait_and_nothing_moves_for_the_bound() {
        let s = Duration::from_secs;
        let bound = s(60);
        // (oldest due, since progress) -> stalled?
        for (due, since, expect) in [
            (None, s(3600), false),       // nothing due: an idle relay is fine
            (Some(s(5)), s(3600), false), // due only just now
            (Some(s(120)), s(1), false),  // old event, but the relay is working
            (Some(s(120)), s(61), true),  // old event, nothing moved
            (Some(s(60)), s(600), false), // at the bound, not past it
        ] {
            assert_eq!(
                stalled(due, since, bound).is_some(),
                expect,
                "{due:?} {since:?}"
            );
        }
        let why = stalled(Some(s(120)), s(90), bound).expect("stalled");
        assert!(why.contains("120 s") && why.contains("90 s") && why.contains("stall_after"));
    }
}
