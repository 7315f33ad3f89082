//! A destination's `rate_limit` as one relay applies it: before a lane sends, it takes tokens
//! from the destination's bucket in the database ([`crate::store::rates`]), which every relay
//! shares, so the limit holds for the destination however many relays serve it.
//!
//! A relay takes a tenth of a second's tokens at a time and keeps what it does not use at once
//! for [`KEEP`]; tokens unused by then are dropped, so the destination is sent less than its
//! limit, never more. Events waiting for tokens are not attempts: what a lane could not send by
//! its batch's deadline goes on later, as for a lane handed over.

use std::sync::Mutex;

use tokio::time::Instant;

use crate::model::metric;
use crate::model::rate::{RateLimit, KEEP};
use crate::store::{rates, Store};

/// One destination's rate limit in this relay.
pub struct Limiter {
    destination: String,
    limit: RateLimit,
    store: Store,
    /// Tokens taken and not used yet, and until when they may be.
    kept: Mutex<(u32, Instant)>,
}

impl Limiter {
    /// The limiter of `destination`, taking from its bucket through `store`.
    pub fn new(destination: &str, limit: RateLimit, store: Store) -> Self {
        Self {
            destination: destination.to_owned(),
            limit,
            store,
            kept: Mutex::new((0, Instant::now())),
        }
    }

    /// Up to `wanted` tokens: what this relay kept, else a take from the shared bucket, waiting
    /// for tokens until `deadline`. 0 when the deadline came first (or the database did not
    /// answer: events then wait, as for an empty bucket).
    pub async fn take(&self, wanted: usize, deadline: Instant) -> usize {
        if wanted == 0 {
            return 0;
        }
        let mut registered = false;
        loop {
            if let Some(given) = self.use_kept(wanted) {
                return given;
            }
            let ask = self.limit.ask();
            let taken = rates::take(
                &self.store,
                &self.destination,
                self.limit.per_second,
                self.limit.burst,
                ask,
            )
            .await;
            let wait = match taken {
                Ok(Some(t)) if t.granted > 0 => return self.keep(t.granted, wanted),
                Ok(Some(t)) => self.limit.wait(t.available, ask),
                Ok(None) if !registered => {
                    registered = true;
                    if let Err(e) =
                        rates::register(&self.store, &self.destination, self.limit.burst).await
                    {
                        tracing::debug!(destination = %self.destination, error = %e, "cannot create the rate limit's bucket");
                    }
                    continue;
                }
                Ok(None) => KEEP,
                Err(e) => {
                    tracing::debug!(destination = %self.destination, error = %e, "cannot take rate limit tokens; the lane waits");
                    std::time::Duration::from_secs(1)
                }
            };
            metrics::counter!(metric::RATE_LIMIT_WAITS_TOTAL, "destination" => self.destination.clone())
                .increment(1);
            let until = (Instant::now() + wait).min(deadline);
            tokio::time::sleep_until(until).await;
            if until >= deadline {
                return 0;
            }
        }
    }

    /// Up to `wanted` of the tokens kept, if there are any still usable.
    fn use_kept(&self, wanted: usize) -> Option<usize> {
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        if kept.0 == 0 || Instant::now() >= kept.1 {
            kept.0 = 0;
            return None;
        }
        let given = (kept.0 as usize).min(wanted);
        kept.0 -= given as u32;
        Some(given)
    }

    /// Keeps `unused` tokens that [`Limiter::take`] gave and the caller did not spend (a replay
    /// step another relay held, events it skipped), for the next take within [`KEEP`].
    pub fn give_back(&self, unused: usize) {
        if unused == 0 {
            return;
        }
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        if kept.0 == 0 || now >= kept.1 {
            *kept = (0, now + KEEP);
        }
        kept.0 = kept
            .0
            .saturating_add(u32::try_from(unused).unwrap_or(u32::MAX));
    }

    /// Gives `wanted` of `granted` fresh tokens (or all), keeping the rest for [`KEEP`].
    fn keep(&self, granted: u32, wanted: usize) -> usize {
        let given = (granted as usize).min(wanted);
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        *kept = (granted - given as u32, Instant::now() + KEEP);
        given
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A limiter whose store is never reached: what it gives comes from what it kept.
    fn offline() -> Limiter {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .connect_lazy("postgres://nobody@127.0.0.1:1/none")
            .expect("a lazy pool");
        let store = Store::new(pool, crate::table::OutboxTable::default_table());
        let limit = RateLimit::parse("100/s", None).expect("a rate");
        Limiter::new("d", limit, store)
    }

    #[tokio::test]
    async fn tokens_given_back_are_taken_again_before_they_expire() {
        let limiter = offline();
        let soon = Instant::now() + std::time::Duration::from_millis(10);
        limiter.give_back(5);
        assert_eq!(limiter.take(3, soon).await, 3);
        assert_eq!(limiter.take(9, soon).await, 2);
        limiter.give_back(0);
        limiter.give_back(4);
        tokio::time::sleep(KEEP).await;
        assert_eq!(limiter.use_kept(4), None, "dropped after KEEP");
    }
}
