//! The console's Destinations view in a real browser (headless Chromium over WebDriver, as
//! `console_browser.rs`): a destination added with the form (its secret sealed, never shown),
//! a field the checks refuse named on the page, pages and search over the list, and a removal
//! confirmed.

mod common;

use std::sync::Arc;

use fantoccini::Locator;
use pgoutbox::engine::Relay;
use pgoutbox::server::Samples;

use common::browser::{click, shows, Driver};
use common::*;

const ADMIN: &str = "br0wser-t0ken";

async fn fill(browser: &fantoccini::Client, css: &str, text: &str) {
    let field = browser.find(Locator::Css(css)).await.expect(css);
    field.clear().await.expect("clear");
    field.send_keys(text).await.expect("type");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn add_search_page_and_remove_destinations_from_the_page() {
    let db = TestDb::migrated().await;
    let rx = Receiver::start().await;
    let config = parse_config(&webhook_config(&db, &rx.url, ""));
    let relay = Arc::new(Relay::new(db.pool.clone(), &config).expect("relay"));
    let key =
        pgoutbox::definitions::Key::parse(&pgoutbox::definitions::Key::generate()).expect("key");
    let catalog = pgoutbox::definitions::Catalog::new(
        relay.store().clone(),
        Some(key),
        ["hooks".to_owned()].into_iter().collect(),
    );
    // 150 already there: the list pages.
    let by = pgoutbox::definitions::Actor {
        who: "test",
        via: "cli",
    };
    for i in 0..150 {
        let definition = serde_json::json!({ "name": format!("c-{i:03}"), "type": "null" });
        let serde_json::Value::Object(definition) = definition else {
            unreachable!()
        };
        catalog.add(definition, by).await.expect("added");
    }
    let admin: pgoutbox::config::AdminConfig =
        toml::from_str(&format!("token = \"{ADMIN}\"")).expect("admin");
    let console =
        pgoutbox::server::console::Console::new(relay, Arc::new(Samples::default()), &admin)
            .with_catalog(catalog);
    let base = serve(console).await;

    let driver = Driver::start();
    let browser = driver.signed_in(&base, ADMIN).await;
    click(&browser, "#nav-destinations").await;
    assert!(
        shows(&browser, "#dest-list", "c-000").await,
        "the first page"
    );
    assert!(
        shows(&browser, "#dest-list", "hooks").await,
        "the file's, marked"
    );
    assert!(!shows_now(&browser, "c-120").await, "a page holds 100");
    click(&browser, "#dest-next").await;
    assert!(
        shows(&browser, "#dest-list", "c-149").await,
        "the next page"
    );
    click(&browser, "#dest-prev").await;
    assert!(shows(&browser, "#dest-list", "c-000").await, "back");

    // A filter the checks refuse: named on the page, nothing stored.
    fill(&browser, "#dest-form input[name=name]", "customer-1").await;
    fill(&browser, "#dest-form input[name=url]", &rx.url).await;
    fill(&browser, "#dest-form input[name=topics]", "order.*").await;
    fill(&browser, "#dest-form input[name=filter]", "payload.total >").await;
    fill(
        &browser,
        "#dest-form input[name=secret]",
        "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD",
    )
    .await;
    click(&browser, "#dest-add").await;
    assert!(
        shows(&browser, "#status", "filter").await,
        "the field is named"
    );
    fill(
        &browser,
        "#dest-form input[name=filter]",
        "payload.total > 10",
    )
    .await;
    click(&browser, "#dest-add").await;
    assert!(shows(&browser, "#status", "destination customer-1 added").await);
    fill(&browser, "#dest-search input[name=search]", "customer").await;
    click(&browser, "#dest-search button").await;
    assert!(shows(&browser, "#dest-list", "customer-1").await, "found");
    let text = browser
        .find(Locator::Css("#dest-list"))
        .await
        .expect("list")
        .text()
        .await
        .expect("text");
    assert!(
        text.contains("secret") && !text.contains("whsec_"),
        "{text}"
    );
    assert!(!text.contains("c-000"), "only what matches: {text}");

    // Removed, confirmed.
    click(&browser, "#dest-list button[data-remove='customer-1']").await;
    let question = browser.get_alert_text().await.expect("a confirmation");
    assert!(question.contains("customer-1"), "{question}");
    browser.accept_alert().await.expect("confirm");
    assert!(shows(&browser, "#status", "destination customer-1 removed").await);
    let png = browser.screenshot().await.expect("screenshot");
    std::fs::write(std::env::temp_dir().join("console-destinations.png"), png)
        .expect("write screenshot");
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_definitions")
        .fetch_one(&db.pool)
        .await
        .expect("count");
    assert_eq!(left, 150);
    browser.close().await.expect("close");
}

/// Whether the list shows `text` right now (no wait).
async fn shows_now(browser: &fantoccini::Client, text: &str) -> bool {
    browser
        .find(Locator::Css("#dest-list"))
        .await
        .expect("list")
        .text()
        .await
        .unwrap_or_default()
        .contains(text)
}
