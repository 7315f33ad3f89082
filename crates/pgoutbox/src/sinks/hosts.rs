//! The requests a relay has out to one host at once, across every webhook destination of that
//! host ([`room`]).
//!
//! Each destination's `concurrency` bounds its own requests. Thousands of customers' endpoints
//! can share one host (a platform that hosts webhooks for its users), and without a bound per host
//! a spread drain had thousands of requests out to it, each holding a connection and its buffers:
//! 3,900 sockets at 10,000 destinations. A host's requests take turns (first come, first served)
//! for [`PER_HOST`] places; a destination waits for its place before its request counts as started,
//! so the wait is never a failure of its own.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError, Weak};

use tokio::sync::Semaphore;

/// How many requests a relay has out to one host (scheme, host and port) at most.
pub const PER_HOST: usize = 512;

/// The places of one host's requests, shared by every destination of that host.
pub type Room = Arc<Semaphore>;

/// Each host's places, held weakly: a host's entry goes when no sink of it is left.
type Rooms = Mutex<HashMap<String, Weak<Semaphore>>>;

/// The places of `url`'s host (scheme, host and port).
pub fn room(url: &reqwest::Url) -> Room {
    static ROOMS: std::sync::OnceLock<Rooms> = std::sync::OnceLock::new();
    let key = origin(url);
    let mut rooms = ROOMS
        .get_or_init(Rooms::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    if let Some(room) = rooms.get(&key).and_then(Weak::upgrade) {
        return room;
    }
    // Hosts no sink uses any more go before the map grows: it holds the hosts in use, not
    // every host ever sent to.
    if rooms.len() >= 64 && rooms.len().is_power_of_two() {
        rooms.retain(|_, room| room.strong_count() > 0);
    }
    let room = Arc::new(Semaphore::new(PER_HOST));
    rooms.insert(key, Arc::downgrade(&room));
    room
}

/// `url`'s scheme, host and port (the scheme's own when none is given).
fn origin(url: &reqwest::Url) -> String {
    format!(
        "{}://{}:{}",
        url.scheme(),
        url.host_str().unwrap_or_default(),
        url.port_or_known_default().unwrap_or_default()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn url(s: &str) -> reqwest::Url {
        reqwest::Url::parse(s).expect("url")
    }

    #[test]
    fn destinations_of_one_host_share_its_places_and_other_hosts_have_their_own() {
        let a = room(&url("https://hooks.example.com/customer-1"));
        let b = room(&url("https://hooks.example.com:443/customer-2?x=1"));
        let other_port = room(&url("https://hooks.example.com:8443/customer-3"));
        let other_scheme = room(&url("http://hooks.example.com/customer-4"));
        let other_host = room(&url("https://example.org/customer-5"));
        assert!(Arc::ptr_eq(&a, &b), "same scheme, host and port");
        for other in [&other_port, &other_scheme, &other_host] {
            assert!(!Arc::ptr_eq(&a, other));
        }
        assert_eq!(a.available_permits(), PER_HOST);
    }

    #[test]
    fn a_host_no_sink_uses_gets_fresh_places() {
        let first = room(&url("https://gone.example.com/"));
        let taken = Arc::clone(&first).try_acquire_owned().expect("a place");
        drop(taken);
        let weak = Arc::downgrade(&first);
        drop(first);
        assert!(weak.upgrade().is_none(), "the map does not keep it alive");
        let again = room(&url("https://gone.example.com/"));
        assert_eq!(again.available_permits(), PER_HOST);
    }
}
