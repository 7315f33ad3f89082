//! A destination's circuit breaker policy: when the destination counts as down, and how it is
//! probed until it is back. Plain data: the configuration file fills it in, the gate
//! ([`crate::sinks::gate`]) follows it.

use std::time::Duration;

/// `breaker`: a destination's circuit breaker.
///
/// After `failures` failed attempts in a row the breaker opens: the destination's events wait
/// (held, no attempt counted, not moving toward dead) while one probe at a time, first after
/// `probe_interval` and then at doubling intervals up to `max_probe_interval`, tries one event.
/// The first probe the destination answers closes it, and its events are due again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BreakerPolicy {
    /// Consecutive failed attempts that open the breaker; 0 turns the breaker off.
    pub failures: u32,
    /// Wait before the first probe.
    pub probe_interval: Duration,
    /// Longest wait between probes.
    pub max_probe_interval: Duration,
}

impl Default for BreakerPolicy {
    fn default() -> Self {
        Self {
            failures: 10,
            probe_interval: Duration::from_secs(1),
            max_probe_interval: Duration::from_secs(15),
        }
    }
}
