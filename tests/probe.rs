//! Probes of an open breaker: what a probe's answer means for the event it sent is decided like
//! any attempt's, so an event held past its `max_age` whose probe fails is dead-lettered then,
//! not put back to wait for the next cleanup.

mod common;

use std::time::Duration;

use common::*;

/// A destination down from the start: its breaker opens after two failures and the rest of the
/// events are held. Once they are older than `max_age`, the next probe that fails dead-letters the
/// event it sent ("held for hooks: …"), with cleanup (which also expires held events) an hour away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_probe_of_an_event_past_max_age_dead_letters_it() {
    let db = TestDb::migrated().await;
    let rx = Receiver::with(|_| Reply::status(503)).await;
    db.insert_plain(5, "order.created").await;
    let config = webhook_config(
        &db,
        &rx.url,
        "max_age = \"2s\"\nretry_schedule = [\"1h\"]\n\
         breaker = { failures = 2, probe_interval = \"100ms\", max_probe_interval = \"200ms\" }",
    )
    .replace("[relay]\n", "cleanup_interval = \"1h\"\n[relay]\n");
    let relay = Running::start(&db, &config);
    let held = wait_for(Duration::from_secs(20), || async {
        db.count("next_attempt_at = 'infinity'").await == 3
    })
    .await;
    let expired = wait_for(Duration::from_secs(30), || async {
        db.count("dead_at IS NOT NULL AND last_error LIKE 'held for hooks:%max_age%'")
            .await
            >= 1
    })
    .await;
    relay.stop().await;
    assert!(
        held,
        "two attempts open the breaker, the other three events are held"
    );
    assert!(
        expired,
        "a probe that fails past max_age dead-letters its event: {} dead, {} held",
        db.count("dead_at IS NOT NULL").await,
        db.count("next_attempt_at = 'infinity'").await
    );
}
