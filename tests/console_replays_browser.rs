//! The console's Replays view in a real browser (headless Chromium over WebDriver, as
//! `console_browser.rs`): count with a dry run, start a replay, see it listed with its progress,
//! pause it and cancel it with its buttons, each confirmed.

mod common;

use std::sync::Arc;

use fantoccini::Locator;
use pgoutbox::engine::Relay;
use pgoutbox::server::Samples;

use common::browser::{click, shows, Driver};
use common::*;

const ADMIN: &str = "br0wser-t0ken";

/// Accepts the confirmation the page asks, returning its question.
async fn confirm(browser: &fantoccini::Client) -> String {
    let question = browser.get_alert_text().await.expect("a confirmation");
    browser.accept_alert().await.expect("confirm");
    question
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_pause_and_cancel_a_replay_from_the_page() {
    let db = TestDb::migrated().await;
    let rx = Receiver::start().await;
    let config = parse_config(&webhook_config(&db, &rx.url, "topics = [\"order.*\"]"));
    // Not running: a replay stays where the page puts it.
    let relay = Arc::new(Relay::new(db.pool.clone(), &config).expect("relay"));
    sqlx::query(
        "INSERT INTO outbox (topic, payload, published_at)
         SELECT CASE WHEN g <= 30 THEN 'order.created' ELSE 'user.created' END,
                jsonb_build_object('n', g), now()
         FROM generate_series(1, 40) g",
    )
    .execute(&db.pool)
    .await
    .expect("retained rows");
    let base = serve_console(
        relay,
        Arc::new(Samples::default()),
        &format!("token = \"{ADMIN}\""),
    )
    .await;

    let driver = Driver::start();
    let browser = driver.signed_in(&base, ADMIN).await;
    click(&browser, "#nav-replays").await;
    let empty = shows(&browser, "#replay-list", "no replays yet").await;
    assert!(empty, "the view says there are none yet");
    let listed = shows(&browser, "#replay-destination", "hooks").await;
    assert!(listed, "the destinations are offered");

    // A dry run counts: the destination takes order.* only.
    click(&browser, "#replay-dry").await;
    let counted = shows(
        &browser,
        "#replay-count",
        "30 of 40 retained events in range would be sent to hooks",
    )
    .await;
    assert!(counted, "the dry run's count is shown");

    // Started, confirmed, listed with its progress and the buttons its state allows.
    browser
        .find(Locator::Css("#replay-form input[name=rate]"))
        .await
        .expect("rate")
        .send_keys("5/s")
        .await
        .expect("type a rate");
    click(&browser, "#replay-start").await;
    let question = confirm(&browser).await;
    assert!(question.contains("hooks"), "{question}");
    let started = shows(&browser, "#status", "started: up to 40 events").await;
    assert!(started, "the page says it started");
    let row = "#replay-list tr[data-state='running']";
    let running = shows(&browser, row, "running").await;
    assert!(running, "the replay is listed as running");
    let text = browser
        .find(Locator::Css(row))
        .await
        .expect("row")
        .text()
        .await
        .expect("text");
    assert!(
        text.contains("admin") && text.contains("rate 5/s") && text.contains("0 / 40"),
        "{text}"
    );
    browser
        .find(Locator::Css(&format!("{row} progress")))
        .await
        .expect("a progress bar");

    let png = browser.screenshot().await.expect("screenshot");
    std::fs::write(std::env::temp_dir().join("console-replays.png"), png)
        .expect("write screenshot");

    // Paused, then cancelled: the buttons follow the state.
    click(&browser, &format!("{row} button[data-action=pause]")).await;
    confirm(&browser).await;
    let paused = shows(&browser, "#replay-list tr[data-state='paused']", "paused").await;
    assert!(paused, "the replay is paused");
    let resume = browser
        .find_all(Locator::Css(
            "#replay-list tr[data-state='paused'] button[data-action=resume]",
        ))
        .await
        .expect("find");
    assert_eq!(resume.len(), 1, "a paused replay offers resume");
    click(
        &browser,
        "#replay-list tr[data-state='paused'] button[data-action=cancel]",
    )
    .await;
    let question = confirm(&browser).await;
    assert!(question.contains("dropped"), "{question}");
    let cancelled = shows(
        &browser,
        "#replay-list tr[data-state='cancelled']",
        "cancelled",
    )
    .await;
    assert!(cancelled, "the replay is cancelled");
    let buttons = browser
        .find_all(Locator::Css(
            "#replay-list tr[data-state='cancelled'] button",
        ))
        .await
        .expect("find");
    assert!(buttons.is_empty(), "a cancelled replay offers nothing");

    // A bad rate: the page shows the API's sentence naming it.
    let rate = browser
        .find(Locator::Css("#replay-form input[name=rate]"))
        .await
        .expect("rate");
    rate.clear().await.expect("clear");
    rate.send_keys("fast").await.expect("type");
    click(&browser, "#replay-dry").await;
    let said = shows(&browser, "#status.error", "rate:").await;
    assert!(said, "the page shows the API's error");

    // The audit log has the start, the pause and the cancel.
    click(&browser, "#nav-audit").await;
    let logged = shows(&browser, "#audit-list", "replay-cancel").await;
    assert!(logged, "the changes are in the audit log");
    browser.close().await.expect("close");
}
