//! A destination's `rate_limit`: how many events a second it may be sent, with a burst, and the
//! pure arithmetic of taking tokens from its bucket (how many to ask for at once, how long to
//! wait for more). The bucket itself lives in the database, shared by every relay
//! ([`crate::rate`]).

use std::time::Duration;

/// `rate_limit = "200/s"` (or `{ rate = "200/s", burst = 400 }`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RateLimit {
    /// Events per second.
    pub per_second: f64,
    /// Most events sent at once after an idle time: the bucket's size.
    pub burst: u32,
}

/// The slice of a second one take from the shared bucket is worth: a relay asks for a tenth of
/// a second's tokens at a time, so a busy destination costs each relay about ten short
/// statements a second.
const TAKE_SECONDS: f64 = 0.1;

/// How long tokens a relay took and has not used yet stay usable: past it they are dropped
/// (the destination is sent less, never more, than its limit).
pub const KEEP: Duration = Duration::from_millis(200);

/// Shortest and longest wait before asking the bucket again.
const MIN_WAIT: Duration = Duration::from_millis(5);
const MAX_WAIT: Duration = Duration::from_secs(1);

impl RateLimit {
    /// Parses `"N/s"`, `"N/m"` or `"N/h"` (N may have decimals) and an optional burst (default
    /// one second's events, at least 1); the error is one sentence.
    pub fn parse(rate: &str, burst: Option<u32>) -> Result<Self, String> {
        let how = "write e.g. \"200/s\", \"600/m\" or \"10/h\"";
        let (n, unit) = rate
            .split_once('/')
            .ok_or_else(|| format!("{rate:?} is not a rate; {how}"))?;
        let n: f64 = n
            .trim()
            .parse()
            .map_err(|_| format!("{rate:?} is not a rate; {how}"))?;
        let seconds = match unit.trim() {
            "s" | "sec" | "second" => 1.0,
            "m" | "min" | "minute" => 60.0,
            "h" | "hour" => 3600.0,
            _ => return Err(format!("{rate:?}: unknown unit {unit:?}; {how}")),
        };
        if !n.is_finite() || n <= 0.0 {
            return Err(format!("{rate:?}: the rate must be more than zero"));
        }
        let per_second = n / seconds;
        let burst = match burst {
            Some(0) => return Err("burst must be at least 1".into()),
            Some(b) => b,
            None => per_second.ceil().clamp(1.0, f64::from(u32::MAX)) as u32,
        };
        Ok(Self { per_second, burst })
    }

    /// How many tokens to ask the shared bucket for at once: a tenth of a second's worth (at
    /// least 1, at most the burst).
    pub fn ask(&self) -> u32 {
        (self.per_second * TAKE_SECONDS)
            .ceil()
            .clamp(1.0, f64::from(self.burst)) as u32
    }

    /// How long until the bucket, holding `available` tokens, holds `wanted` (bounded: asking
    /// again costs a statement, waiting too long lets the bucket fill to its burst unused).
    pub fn wait(&self, available: f64, wanted: u32) -> Duration {
        let missing = (f64::from(wanted) - available).max(0.0);
        Duration::from_secs_f64(missing / self.per_second).clamp(MIN_WAIT, MAX_WAIT)
    }
}

impl std::fmt::Display for RateLimit {
    /// `200/s (burst 200)`; a rate under one a second keeps its decimals (`0.025/s`).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.per_second.fract() == 0.0 {
            write!(f, "{:.0}/s (burst {})", self.per_second, self.burst)
        } else {
            write!(f, "{}/s (burst {})", self.per_second, self.burst)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_parse_with_their_unit_and_a_default_burst() {
        let cases: &[(&str, Option<u32>, f64, u32)] = &[
            ("200/s", None, 200.0, 200),
            ("600/m", None, 10.0, 10),
            ("90/h", None, 0.025, 1),
            ("2.5/s", Some(10), 2.5, 10),
            (" 50 / sec ", None, 50.0, 50),
        ];
        for (text, burst, per_second, want_burst) in cases {
            let r = RateLimit::parse(text, *burst).unwrap_or_else(|e| panic!("{text}: {e}"));
            assert!((r.per_second - per_second).abs() < 1e-9, "{text}: {r:?}");
            assert_eq!(r.burst, *want_burst, "{text}");
        }
        let shown = |text: &str, burst| RateLimit::parse(text, burst).expect("valid").to_string();
        assert_eq!(shown("200/s", None), "200/s (burst 200)");
        assert_eq!(shown("90/h", Some(3)), "0.025/s (burst 3)");
        for (bad, burst, says) in [
            ("200", None, "not a rate"),
            ("x/s", None, "not a rate"),
            ("200/d", None, "unknown unit"),
            ("0/s", None, "more than zero"),
            ("-1/s", None, "more than zero"),
            ("200/s", Some(0), "burst"),
        ] {
            let e = RateLimit::parse(bad, burst).expect_err(bad);
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn a_take_asks_for_a_tenth_of_a_second_within_the_burst() {
        let r = |per_second: f64, burst: u32| RateLimit { per_second, burst };
        // (limit, tokens asked)
        let cases = [
            (r(200.0, 200), 20),
            (r(200.0, 10), 10),
            (r(1.0, 1), 1),
            (r(0.01, 1), 1),
            (r(5000.0, 5000), 500),
        ];
        for (limit, asked) in cases {
            assert_eq!(limit.ask(), asked, "{limit:?}");
        }
    }

    #[test]
    fn the_wait_is_until_the_tokens_are_there_within_bounds() {
        let r = RateLimit {
            per_second: 200.0,
            burst: 200,
        };
        assert_eq!(r.wait(0.0, 20), Duration::from_millis(100));
        assert_eq!(r.wait(10.0, 20), Duration::from_millis(50));
        assert_eq!(r.wait(25.0, 20), MIN_WAIT, "already there: ask again soon");
        let slow = RateLimit {
            per_second: 0.1,
            burst: 1,
        };
        assert_eq!(slow.wait(0.0, 1), MAX_WAIT, "never longer than a second");
    }
}
