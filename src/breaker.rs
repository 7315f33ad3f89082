//! The breaker: whether a destination's events go out now. Two things can hold them: the
//! operator's pause (`pgoutbox destination pause`) and the destination's circuit breaker.
//!
//! The breaker counts failed attempts in a row in each relay; at `breaker.failures` it opens.
//! While a destination is paused or its breaker is not closed, its events are *held*: they wait at
//! 'infinity' with no attempt counted, so an outage of a day or a revoked credential moves nothing
//! toward the dead letters (`max_age` still applies). One probe at a time, across every relay,
//! sends one held event; the first the destination answers closes the breaker and its events are
//! due again. The state lives in the `{table}_destinations` table, so every relay and `pgoutbox
//! status` see the same, and each relay re-reads it about once a second ([`sync`]).

use std::fmt;
use std::sync::Mutex;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::config::{BreakerConfig, DestinationConfig};
use crate::error::Result;
use crate::model::outcome::Outcome;
pub use crate::store::destinations::DestinationState;
use crate::store::{destinations, waiting, Store};

/// How often each relay re-reads the shared destination state.
pub const SYNC_INTERVAL: Duration = Duration::from_secs(1);

/// A circuit breaker's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum BreakerState {
    /// The destination takes events.
    #[default]
    Closed,
    /// The destination is failing: its events are held, probes decide when it is back.
    Open,
    /// A probe is out.
    HalfOpen,
}

impl BreakerState {
    fn parse(s: &str) -> Self {
        match s {
            "open" => Self::Open,
            "half_open" => Self::HalfOpen,
            _ => Self::Closed,
        }
    }

    /// The value of the `pgoutbox_destination_state` gauge: 0 closed, 1 half-open, 2 open.
    pub fn gauge(self) -> f64 {
        match self {
            Self::Closed => 0.0,
            Self::HalfOpen => 1.0,
            Self::Open => 2.0,
        }
    }
}

impl fmt::Display for BreakerState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Closed => "closed",
            Self::Open => "open",
            Self::HalfOpen => "half_open",
        })
    }
}

/// What happens to an event routed to a destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gate {
    /// Publish it.
    Send,
    /// Hold it: the destination is paused or its breaker is not closed.
    Hold,
}

/// How an attempt's outcome counts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Counted {
    /// As an attempt, per the retry policy.
    Attempt,
    /// This failure opened the breaker (it counts as an attempt; the state must be stored).
    Tripped,
    /// Not at all: the breaker was already open, the event is held.
    Held,
}

#[derive(Debug, Default)]
struct Local {
    breaker: BreakerState,
    paused: bool,
    consecutive_failures: u32,
    since: Option<DateTime<Utc>>,
    last_error: Option<String>,
}

/// One destination's health in this relay: a mirror of the shared state plus the local count of
/// failures in a row.
#[derive(Debug)]
pub struct Health {
    name: String,
    config: BreakerConfig,
    local: Mutex<Local>,
}

impl Health {
    /// A closed, running destination.
    pub fn new(name: &str, config: BreakerConfig) -> Self {
        Self {
            name: name.to_owned(),
            config,
            local: Mutex::new(Local::default()),
        }
    }

    fn local(&self) -> std::sync::MutexGuard<'_, Local> {
        self.local.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The destination's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its breaker settings.
    pub fn config(&self) -> &BreakerConfig {
        &self.config
    }

    /// Whether its events go out now.
    pub fn gate(&self) -> Gate {
        let l = self.local();
        if l.paused || l.breaker != BreakerState::Closed {
            Gate::Hold
        } else {
            Gate::Send
        }
    }

    /// The breaker state and whether paused, as this relay last saw them.
    pub fn state(&self) -> (BreakerState, bool) {
        let l = self.local();
        (l.breaker, l.paused)
    }

    /// A line for `/readyz`: `None` when the destination takes events.
    pub fn problem(&self) -> Option<String> {
        let l = self.local();
        let since = l
            .since
            .map(|t| {
                format!(
                    " since {}",
                    t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
                )
            })
            .unwrap_or_default();
        let error = l
            .last_error
            .as_deref()
            .map(|e| format!(" (last error: {e})"))
            .unwrap_or_default();
        match (l.paused, l.breaker) {
            (true, _) => Some(format!("paused by an operator{since}")),
            (false, BreakerState::Closed) => None,
            (false, state) => Some(format!("circuit breaker {state}{since}{error}")),
        }
    }

    /// Counts one attempt's outcome. A delivery, or any answer that proves the destination is up
    /// (a permanent rejection), resets the count of failures in a row.
    pub fn record(&self, outcome: &Outcome) -> Counted {
        let mut l = self.local();
        match outcome {
            Outcome::Delivered | Outcome::Rejected { .. } => {
                l.consecutive_failures = 0;
                Counted::Attempt
            }
            Outcome::Retry { reason, .. } => {
                if l.breaker != BreakerState::Closed {
                    return Counted::Held;
                }
                l.consecutive_failures = l.consecutive_failures.saturating_add(1);
                if self.config.failures > 0 && l.consecutive_failures >= self.config.failures {
                    l.breaker = BreakerState::Open;
                    l.since = Some(Utc::now());
                    l.last_error = Some(reason.clone());
                    l.consecutive_failures = 0;
                    Counted::Tripped
                } else {
                    Counted::Attempt
                }
            }
        }
    }

    /// Takes the stored state over (another relay opened or closed the breaker, an operator paused).
    pub fn adopt(&self, stored: &DestinationState) {
        let mut l = self.local();
        let breaker = BreakerState::parse(&stored.breaker);
        if breaker != l.breaker {
            l.consecutive_failures = 0;
        }
        l.breaker = breaker;
        l.paused = stored.paused_at.is_some();
        l.since = Some(stored.paused_at.unwrap_or(stored.breaker_since));
        l.last_error = stored.last_error.clone();
    }

    /// Closes the breaker here (this relay's probe was answered).
    pub fn close(&self) {
        let mut l = self.local();
        l.breaker = BreakerState::Closed;
        l.consecutive_failures = 0;
        l.since = Some(Utc::now());
    }

    /// The wait before the probe after `failed_probes` failed ones: doubling, capped.
    pub fn probe_delay(&self, failed_probes: i32) -> Duration {
        let doublings = u32::try_from(failed_probes.clamp(0, 30)).unwrap_or(0);
        self.config
            .probe_interval
            .saturating_mul(1u32 << doublings.min(20))
            .min(self.config.max_probe_interval)
    }
}

/// Makes sure every configured destination has its row, with whether its dead events block.
pub async fn register(store: &Store, destinations: &[DestinationConfig]) -> Result<()> {
    let names: Vec<&str> = destinations.iter().map(|d| d.name.as_str()).collect();
    let blocks: Vec<bool> = destinations.iter().map(|d| d.dead_blocks()).collect();
    destinations::register(store, &names, &blocks).await
}

/// Re-reads the shared state into each destination's [`Health`]. When a destination this relay
/// held is free again (resumed, or closed by another relay's probe), the events held for it are
/// made due: a claim of this relay may have held some again just before it saw the change.
pub async fn sync(
    store: &Store,
    health: &[std::sync::Arc<Health>],
) -> Result<Vec<DestinationState>> {
    let stored = destinations::read(store).await?;
    let mut freed = false;
    for h in health {
        if let Some(s) = stored.iter().find(|s| s.name == h.name) {
            let was = h.gate();
            h.adopt(s);
            freed |= was == Gate::Hold && h.gate() == Gate::Send;
        }
        let (breaker, paused) = h.state();
        metrics::gauge!(crate::model::metric::DESTINATION_STATE, "destination" => h.name.clone())
            .set(breaker.gauge());
        metrics::gauge!(crate::model::metric::DESTINATION_PAUSED, "destination" => h.name.clone())
            .set(if paused { 1.0 } else { 0.0 });
    }
    if freed {
        waiting::unpark_followers(store).await?;
    }
    Ok(stored)
}

/// Stores that this relay's failures opened the breaker (a no-op if another relay was first).
pub async fn store_open(store: &Store, health: &Health, error: &str) -> Result<()> {
    destinations::open(store, &health.name, error, health.config.probe_interval).await
}

/// Stores that the destination is back (its breaker closed); its held events become due.
pub async fn store_closed(store: &Store, name: &str) -> Result<u64> {
    destinations::close(store, name).await?;
    waiting::unpark_followers(store).await
}

/// Pauses a destination for every relay: its events are held until [`resume`].
pub async fn pause(store: &Store, name: &str) -> Result<()> {
    destinations::pause(store, name).await
}

/// Resumes a paused destination; returns how many held events are due again (`None` when it was
/// not paused).
pub async fn resume(store: &Store, name: &str) -> Result<Option<u64>> {
    if !destinations::resume(store, name).await? {
        return Ok(None);
    }
    Ok(Some(waiting::unpark_followers(store).await?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn health(failures: u32) -> Health {
        Health::new(
            "d",
            BreakerConfig {
                failures,
                ..BreakerConfig::default()
            },
        )
    }

    #[test]
    fn failures_in_a_row_open_the_breaker_and_later_failures_are_held() {
        let h = health(3);
        let fail = Outcome::retry("HTTP 503");
        assert_eq!(h.record(&fail), Counted::Attempt);
        assert_eq!(h.record(&Outcome::Delivered), Counted::Attempt);
        assert_eq!(h.record(&fail), Counted::Attempt);
        assert_eq!(h.record(&fail), Counted::Attempt);
        assert_eq!(h.gate(), Gate::Send);
        assert_eq!(h.record(&fail), Counted::Tripped);
        assert_eq!(h.gate(), Gate::Hold);
        assert_eq!(h.record(&fail), Counted::Held);
        assert!(h.problem().is_some_and(|p| p.contains("open")));
        h.close();
        assert_eq!(h.gate(), Gate::Send);
    }

    #[test]
    fn a_rejection_proves_the_destination_is_up() {
        let h = health(2);
        let fail = Outcome::retry("timeout");
        assert_eq!(h.record(&fail), Counted::Attempt);
        let rejected = Outcome::Rejected {
            reason: "HTTP 400".into(),
        };
        assert_eq!(h.record(&rejected), Counted::Attempt);
        assert_eq!(h.record(&fail), Counted::Attempt);
        assert_eq!(h.gate(), Gate::Send);
    }

    #[test]
    fn zero_failures_turns_the_breaker_off() {
        let h = health(0);
        for _ in 0..100 {
            assert_eq!(h.record(&Outcome::retry("x")), Counted::Attempt);
        }
        assert_eq!(h.gate(), Gate::Send);
    }

    #[test]
    fn probes_back_off_up_to_the_cap() {
        let h = health(1);
        let d: Vec<u64> = (0..6).map(|n| h.probe_delay(n).as_secs()).collect();
        assert_eq!(d, vec![1, 2, 4, 8, 15, 15]);
    }
}
