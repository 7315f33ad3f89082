//! The retry policy: when a failed event is tried again, and when it is dead-lettered instead.
//!
//! Sinks only classify a failure (retriable or not, with an optional `Retry-After`); this module
//! alone decides timing, so every sink gets the same schedule, jitter and limits. Inputs include the
//! clock and the random source, so the policy is tested with a controllable clock.

use std::time::Duration;

use chrono::{DateTime, Utc};
use rand::Rng;

/// Delays between attempts recommended by Standard Webhooks, after the immediate first attempt.
pub const DEFAULT_SCHEDULE: [Duration; 7] = [
    Duration::from_secs(5),
    Duration::from_secs(5 * 60),
    Duration::from_secs(30 * 60),
    Duration::from_secs(2 * 3600),
    Duration::from_secs(5 * 3600),
    Duration::from_secs(10 * 3600),
    Duration::from_secs(10 * 3600),
];

/// Shortest wait a `Retry-After` can ask for.
pub const RETRY_AFTER_MIN: Duration = Duration::from_secs(1);
/// Longest wait a `Retry-After` can impose.
pub const RETRY_AFTER_MAX: Duration = Duration::from_secs(3600);

/// A destination's retry policy.
#[derive(Debug, Clone, PartialEq)]
pub struct RetryPolicy {
    /// Delays between attempts; once used up, its last delay repeats.
    pub schedule: Vec<Duration>,
    /// Total attempts before an event is dead-lettered (first attempt included).
    pub max_attempts: Option<u32>,
    /// Age after which a failing event is dead-lettered instead of retried.
    pub max_age: Option<Duration>,
    /// Relative jitter applied to scheduled delays: 0.2 means ±20 %.
    pub jitter: f64,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            schedule: DEFAULT_SCHEDULE.to_vec(),
            max_attempts: Some(DEFAULT_SCHEDULE.len() as u32 + 1),
            max_age: None,
            jitter: 0.2,
        }
    }
}

/// What to do with an event after a failed attempt.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// Try again after this delay.
    Retry(Duration),
    /// Give up: the event goes to the dead letters, with the reason.
    Dead(String),
}

/// The facts about one failure that the policy decides on.
#[derive(Debug, Clone)]
pub struct Failure {
    /// Failed attempts before this one.
    pub previous_attempts: i32,
    /// When the event was written.
    pub created_at: DateTime<Utc>,
    /// The receiver's `Retry-After`, if any.
    pub retry_after: Option<Duration>,
}

impl RetryPolicy {
    /// Decides the next step after a retriable failure, at time `now`.
    pub fn decide(&self, failure: &Failure, now: DateTime<Utc>, rng: &mut impl Rng) -> Decision {
        let attempts = u32::try_from(failure.previous_attempts.max(0)).unwrap_or(0) + 1;
        if let Some(max) = self.max_attempts {
            if attempts >= max {
                return Decision::Dead(format!(
                    "gave up after {attempts} attempts (max_attempts = {max})"
                ));
            }
        }
        if let Some(why) = self.expired(failure.created_at, now) {
            return Decision::Dead(why);
        }
        if let Some(asked) = failure.retry_after {
            // The receiver knows best when it can take more, within bounds that keep a wrong header
            // from either hammering it or parking the event for days.
            return Decision::Retry(asked.clamp(RETRY_AFTER_MIN, RETRY_AFTER_MAX));
        }
        Decision::Retry(self.jittered(self.scheduled(attempts), rng))
    }

    /// Why an event written at `created_at` is past `max_age` at `now`; `None` when it is not (or
    /// there is no `max_age`).
    pub fn expired(&self, created_at: DateTime<Utc>, now: DateTime<Utc>) -> Option<String> {
        let max_age = self.max_age?;
        let age = (now - created_at).to_std().unwrap_or_default();
        (age >= max_age).then(|| {
            format!(
                "gave up after {} (max_age = {})",
                humantime::format_duration(Duration::from_secs(age.as_secs())),
                humantime::format_duration(max_age)
            )
        })
    }

    /// The un-jittered delay after the `attempts`-th failed attempt (1-based).
    pub fn scheduled(&self, attempts: u32) -> Duration {
        let index = (attempts.max(1) - 1) as usize;
        self.schedule
            .get(index)
            .or(self.schedule.last())
            .copied()
            .unwrap_or(Duration::from_secs(5))
    }

    fn jittered(&self, delay: Duration, rng: &mut impl Rng) -> Duration {
        if self.jitter <= 0.0 || delay.is_zero() {
            return delay;
        }
        let factor = rng.gen_range((1.0 - self.jitter)..=(1.0 + self.jitter));
        delay.mul_f64(factor.max(0.0))
    }
}

/// Parses an HTTP `Retry-After` value: delay seconds or an HTTP date (relative to `now`).
pub fn parse_retry_after(value: &str, now: std::time::SystemTime) -> Option<Duration> {
    let value = value.trim();
    if let Ok(secs) = value.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let when = httpdate::parse_http_date(value).ok()?;
    Some(when.duration_since(now).unwrap_or(Duration::ZERO))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::SeedableRng;

    fn failure(previous_attempts: i32, created_at: DateTime<Utc>) -> Failure {
        Failure {
            previous_attempts,
            created_at,
            retry_after: None,
        }
    }

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn schedule_repeats_its_last_delay() {
        let p = RetryPolicy {
            schedule: vec![secs(1), secs(30), secs(300)],
            max_attempts: Some(10),
            max_age: None,
            jitter: 0.0,
        };
        let now = Utc::now();
        let mut rng = StdRng::seed_from_u64(1);
        let delays: Vec<_> = (0..6)
            .map(|prev| p.decide(&failure(prev, now), now, &mut rng))
            .collect();
        assert_eq!(
            delays,
            vec![
                Decision::Retry(secs(1)),
                Decision::Retry(secs(30)),
                Decision::Retry(secs(300)),
                Decision::Retry(secs(300)),
                Decision::Retry(secs(300)),
                Decision::Retry(secs(300)),
            ]
        );
    }

    #[test]
    fn max_attempts_dead_letters() {
        let p = RetryPolicy {
            max_attempts: Some(10),
            ..RetryPolicy::default()
        };
        let now = Utc::now();
        let mut rng = StdRng::seed_from_u64(1);
        assert!(matches!(
            p.decide(&failure(8, now), now, &mut rng),
            Decision::Retry(_)
        ));
        assert!(matches!(
            p.decide(&failure(9, now), now, &mut rng),
            Decision::Dead(_)
        ));
    }

    #[test]
    fn max_age_dead_letters() {
        let p = RetryPolicy {
            max_attempts: None,
            max_age: Some(secs(3600)),
            ..RetryPolicy::default()
        };
        let created = Utc::now();
        let mut rng = StdRng::seed_from_u64(1);
        let early = created + chrono::Duration::minutes(59);
        let late = created + chrono::Duration::minutes(61);
        assert!(matches!(
            p.decide(&failure(3, created), early, &mut rng),
            Decision::Retry(_)
        ));
        assert!(matches!(
            p.decide(&failure(3, created), late, &mut rng),
            Decision::Dead(_)
        ));
    }

    #[test]
    fn jitter_stays_within_bounds() {
        let p = RetryPolicy::default();
        let now = Utc::now();
        let mut rng = StdRng::seed_from_u64(7);
        let (mut lo, mut hi) = (Duration::MAX, Duration::ZERO);
        for _ in 0..2000 {
            let Decision::Retry(d) = p.decide(&failure(1, now), now, &mut rng) else {
                panic!("expected a retry");
            };
            lo = lo.min(d);
            hi = hi.max(d);
        }
        // Second failure: 5 min ± 20 %.
        assert!(lo >= secs(240) && hi <= secs(360), "{lo:?}..{hi:?}");
        assert!(
            lo < secs(260) && hi > secs(340),
            "jitter should spread: {lo:?}..{hi:?}"
        );
    }

    #[test]
    fn retry_after_is_honoured_and_clamped() {
        let p = RetryPolicy::default();
        let now = Utc::now();
        let mut rng = StdRng::seed_from_u64(1);
        let with = |ra: u64| Failure {
            retry_after: Some(secs(ra)),
            ..failure(0, now)
        };
        assert_eq!(p.decide(&with(2), now, &mut rng), Decision::Retry(secs(2)));
        assert_eq!(
            p.decide(&with(0), now, &mut rng),
            Decision::Retry(RETRY_AFTER_MIN)
        );
        assert_eq!(
            p.decide(&with(86_400 * 3), now, &mut rng),
            Decision::Retry(RETRY_AFTER_MAX)
        );
    }

    #[test]
    fn retry_after_parses_seconds_and_http_dates() {
        let now = std::time::UNIX_EPOCH + secs(1_700_000_000);
        assert_eq!(parse_retry_after(" 120 ", now), Some(secs(120)));
        let in_90 = httpdate::fmt_http_date(now + secs(90));
        assert_eq!(parse_retry_after(&in_90, now), Some(secs(90)));
        let past = httpdate::fmt_http_date(now - secs(90));
        assert_eq!(parse_retry_after(&past, now), Some(Duration::ZERO));
        assert_eq!(parse_retry_after("soon", now), None);
    }
}
