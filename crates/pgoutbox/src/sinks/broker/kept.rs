//! What a broker sink keeps between publishes — its connection, client, session or producer —
//! and the count of connections it made again.
//!
//! The connection is made on the first publish (a sink's `build` does no I/O), shared by the
//! publishes that follow, and made again when it is no longer usable or when the engine asks for
//! a fresh one before probing an open breaker ([`crate::sinks::Sink::reconnect`]): a client that
//! reconnects by itself may hand the probe the failed reconnect it made while the broker was
//! down, and the probe of a broker that is back would fail.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use crate::model::metric;

/// A connection a sink keeps.
pub(crate) trait Connection: Clone + Send + 'static {
    /// Whether publishes may still use it; one that may not is replaced on the next publish.
    fn usable(&self) -> bool {
        true
    }

    /// Lets go of it, once it was replaced or dropped. Must return at once: a client whose
    /// shutdown takes time is shut down in the background. Publishes still using a clone of it
    /// finish on it.
    fn retire(self) {}
}

/// The connection of one sink.
pub(crate) struct Kept<T> {
    /// Locked only to read or swap the value, never across an await: `reconnect` is not async.
    current: Mutex<Option<T>>,
    /// One connection attempt at a time: the publishes that find none share the one made.
    connecting: tokio::sync::Mutex<()>,
}

impl<T: Connection> Kept<T> {
    pub(crate) fn new() -> Self {
        Self {
            current: Mutex::new(None),
            connecting: tokio::sync::Mutex::new(()),
        }
    }

    /// The kept connection if it is usable, else a new one from `connect` (kept when made).
    pub(crate) async fn get<E, Fut>(&self, connect: impl FnOnce() -> Fut) -> Result<T, E>
    where
        Fut: Future<Output = Result<T, E>>,
    {
        if let Some(conn) = self.usable() {
            return Ok(conn);
        }
        let _connecting = self.connecting.lock().await;
        // Another publish may have made one while this one waited.
        if let Some(conn) = self.usable() {
            return Ok(conn);
        }
        let fresh = connect().await?;
        let replaced = self.slot().replace(fresh.clone());
        if let Some(old) = replaced {
            old.retire();
        }
        Ok(fresh)
    }

    /// Drops the kept connection: the next publish makes a new one. One that a publish is making
    /// meanwhile is kept when made: it is new all the same.
    pub(crate) fn drop_current(&self) {
        let old = self.slot().take();
        if let Some(old) = old {
            old.retire();
        }
    }

    /// The kept connection if it is usable; one that is not is let go of.
    fn usable(&self) -> Option<T> {
        let mut slot = self.slot();
        match slot.as_ref() {
            Some(conn) if conn.usable() => Some(conn.clone()),
            Some(_) => {
                let old = slot.take();
                drop(slot);
                if let Some(old) = old {
                    old.retire();
                }
                None
            }
            None => None,
        }
    }

    fn slot(&self) -> MutexGuard<'_, Option<T>> {
        self.current.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Counts the connections a sink makes after its first one (`pgoutbox_sink_reconnects_total`):
/// a connection counts once it is made, not when it is asked for, so a broker that stays down
/// adds nothing however often it is tried.
#[derive(Debug)]
pub(crate) struct Reconnects {
    destination: String,
    made: AtomicBool,
}

impl Reconnects {
    pub(crate) fn new(destination: &str) -> Self {
        Self {
            destination: destination.to_owned(),
            made: AtomicBool::new(false),
        }
    }

    /// A connection was made.
    pub(crate) fn connected(&self) {
        if self.made.swap(true, Ordering::Relaxed) {
            metrics::counter!(metric::SINK_RECONNECTS_TOTAL, "destination" => self.destination.clone())
                .increment(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;
    use std::sync::Arc;

    use super::*;

    /// A connection numbered in the order made, that counts its retirement.
    #[derive(Clone)]
    struct Numbered {
        n: usize,
        up: Arc<AtomicBool>,
        retired: Arc<AtomicUsize>,
    }

    impl Connection for Numbered {
        fn usable(&self) -> bool {
            self.up.load(Ordering::Relaxed)
        }

        fn retire(self) {
            self.retired.fetch_add(1, Ordering::Relaxed);
        }
    }

    #[tokio::test]
    async fn kept_until_unusable_or_dropped_and_each_replaced_one_retired() {
        let kept = Kept::new();
        let made = AtomicUsize::new(0);
        let retired = Arc::new(AtomicUsize::new(0));
        let up = Arc::new(AtomicBool::new(true));
        let get = || {
            kept.get(|| async {
                Ok::<_, ()>(Numbered {
                    n: made.fetch_add(1, Ordering::Relaxed),
                    up: up.clone(),
                    retired: retired.clone(),
                })
            })
        };
        assert_eq!(get().await.map(|c| c.n), Ok(0));
        assert_eq!(get().await.map(|c| c.n), Ok(0), "kept");
        kept.drop_current();
        assert_eq!(retired.load(Ordering::Relaxed), 1);
        assert_eq!(get().await.map(|c| c.n), Ok(1), "made afresh");
        up.store(false, Ordering::Relaxed);
        let third = get().await.expect("made");
        assert_eq!(third.n, 2, "an unusable one is replaced");
        assert_eq!(retired.load(Ordering::Relaxed), 2);

        // A failed attempt keeps nothing: the next publish tries again.
        kept.drop_current();
        let failed: Result<Numbered, &str> = kept.get(|| async { Err("refused") }).await;
        assert_eq!(failed.err(), Some("refused"));
        assert_eq!(get().await.map(|c| c.n), Ok(3));
    }
}
