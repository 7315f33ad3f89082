//! SIGHUP: the relay process re-reads its configuration file and relays with it, without a
//! restart. What was in flight under the old configuration finishes and settles under it (sent
//! once, never again, never dropped); a file with a mistake in it is refused and the relay goes on
//! with what it has.

mod common;

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use common::*;

/// Sends SIGHUP to the relay.
fn hangup(relay: &std::process::Child) {
    // SAFETY: kill(2) on a child process this test spawned; no memory involved.
    unsafe {
        libc::kill(relay.id() as i32, libc::SIGHUP);
    }
}

/// The relay's log so far.
fn log(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("relay-reload.log")).unwrap_or_default()
}

/// Waits until the relay's log says `what` `times` times.
async fn logged(dir: &Path, what: &str, times: usize) {
    assert!(
        wait_for(Duration::from_secs(60), || async {
            log(dir).matches(what).count() >= times
        })
        .await,
        "the relay logs {what:?} ({times}×):\n{}",
        log(dir)
    );
}

/// Requests per event id at `rx`.
fn requests(rx: &Receiver) -> HashMap<String, usize> {
    let mut counts = HashMap::new();
    for r in rx.log() {
        *counts.entry(r.id).or_insert(0) += 1;
    }
    counts
}

/// Waits until `rx` has every one of `ids`.
async fn delivered(rx: &Receiver, ids: &[String], what: &str) {
    assert!(
        wait_for(Duration::from_secs(60), || async {
            let got = rx.delivered_ids();
            ids.iter().all(|id| got.contains(id))
        })
        .await,
        "{what}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_adds_and_removes_destinations_without_resending_or_dropping_in_flight_events() {
    let db = TestDb::migrated().await;
    // A slow destination: batches are in flight when the reload comes.
    let a = Receiver::with(|_| Reply::ok().delay(Duration::from_millis(200))).await;
    let b = Receiver::start().await;
    let dir = scratch();
    let destination = |name: &str, rx: &Receiver| {
        format!("[[destinations]]\nname = \"{name}\"\ntype = \"webhook\"\nurl = \"{}\"\nconcurrency = 4\n", rx.url)
    };
    let head = format!(
        "database_url = \"{}\"\n[relay]\npoll_interval = \"50ms\"\n\n",
        db.url
    );
    let config = write_config(dir.path(), &format!("{head}{}", destination("a", &a)));
    let mut relay = spawn_relay(dir.path(), &config, "reload");
    logged(dir.path(), "relay started", 1).await;

    // 1. Add `b` while `a` works through a backlog.
    let first = db.insert_plain(60, "order.created").await;
    assert!(
        wait_for(Duration::from_secs(30), || async { a.count() >= 4 }).await,
        "a starts on the backlog"
    );
    std::fs::write(
        &config,
        format!("{head}{}{}", destination("a", &a), destination("b", &b)),
    )
    .expect("write config");
    hangup(&relay);
    logged(dir.path(), "configuration reloaded", 1).await;
    logged(dir.path(), "relay started", 2).await;
    let second = db.insert_plain(20, "order.created").await;
    delivered(&a, &first, "a gets the whole backlog").await;
    delivered(&a, &second, "a gets what came after").await;
    delivered(
        &b,
        &second,
        "the added destination gets what came after the reload",
    )
    .await;

    // 2. A file with a mistake: refused, the relay goes on as it was.
    std::fs::write(
        &config,
        format!("{head}[[destinations]]\nname = \"c\"\ntype = \"nosuch\"\n"),
    )
    .expect("write config");
    hangup(&relay);
    logged(dir.path(), "configuration not reloaded", 1).await;
    let third = db.insert_plain(5, "order.created").await;
    delivered(
        &b,
        &third,
        "the relay goes on with the configuration it has",
    )
    .await;
    delivered(&a, &third, "a too").await;

    // 3. Remove `a`.
    std::fs::write(&config, format!("{head}{}", destination("b", &b))).expect("write config");
    hangup(&relay);
    logged(dir.path(), "configuration reloaded", 2).await;
    logged(dir.path(), "relay started", 3).await;
    let fourth = db.insert_plain(10, "order.created").await;
    delivered(&b, &fourth, "b gets what came after").await;
    tokio::time::sleep(Duration::from_millis(500)).await;

    assert!(
        relay.try_wait().expect("try_wait").is_none(),
        "the same process relayed throughout:\n{}",
        log(dir.path())
    );
    relay.kill().ok();
    relay.wait().ok();
    if std::env::var_os("PGOUTBOX_TEST_SHOW_LOG").is_some() {
        eprintln!("{}", log(dir.path()));
    }
    let at_a = requests(&a);
    let again: Vec<(&String, &usize)> = at_a.iter().filter(|(_, n)| **n > 1).collect();
    assert!(
        again.is_empty(),
        "sent to a more than once: {again:?}\n{}",
        log(dir.path())
    );
    assert!(
        fourth.iter().all(|id| !at_a.contains_key(id)),
        "nothing goes to the removed destination"
    );
    let at_b = requests(&b);
    assert!(at_b.values().all(|n| *n == 1), "sent to b more than once");
    assert_eq!(
        db.count("published_at IS NULL").await,
        0,
        "every event settled"
    );
}
