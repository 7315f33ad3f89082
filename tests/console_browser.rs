//! The console in a real browser: headless Chromium driven over WebDriver (chromedriver, which
//! `.ci/run` installs with Chromium). Load the page, see a dead event, open it, see its markup
//! payload as text, press retry, confirm, and see it published. With `PGOUTBOX_SCREENSHOTS=1` the
//! overview and the dead-letter view are saved under `docs/img/` for the README.

mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use fantoccini::Locator;
use pgoutbox::engine::Relay;
use pgoutbox::server::Samples;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use common::browser::{shows, Driver};
use common::*;

const ADMIN: &str = "br0wser-t0ken";

fn screenshot(name: &str, png: &[u8]) {
    let dir = match std::env::var_os("PGOUTBOX_SCREENSHOTS") {
        Some(_) => std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("docs/img"),
        None => std::env::temp_dir(),
    };
    std::fs::write(dir.join(name), png).expect("write screenshot");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_a_dead_event_from_the_page() {
    let db = TestDb::migrated().await;
    let (rx, accept) = Receiver::refusing(422, "unknown customer 42").await;
    let config = format!(
        "{}\n[[destinations]]\nname = \"audit\"\ntype = \"null\"\ntopics = [\"audit.*\"]\n",
        webhook_config(
            &db,
            &rx.url,
            "topics = [\"order.*\", \"page.*\"]\nmax_attempts = 1"
        )
    );
    let config = parse_config(&config);
    let relay = Arc::new(Relay::new(db.pool.clone(), &config).expect("relay"));
    let stop = CancellationToken::new();
    let samples = Arc::new(Samples::default());
    tokio::spawn(pgoutbox::server::refresh_gauges(
        relay.clone(),
        Duration::from_millis(500),
        samples.clone(),
        stop.clone(),
    ));
    let running = tokio::spawn(relay.clone().run(stop.clone()));
    let base = serve_console(relay.clone(), samples, &format!("token = \"{ADMIN}\"")).await;

    db.insert_plain(3, "order.created").await;
    db.insert_plain(40, "audit.logged").await;
    let marked: String = sqlx::query_scalar(
        "INSERT INTO outbox (topic, payload, key) VALUES ('page.viewed', $1, 'visitor-7') RETURNING id::text",
    )
    .bind(json!({ "html": "<script>alert(1)</script><b>bold?</b>", "path": "/checkout" }))
    .fetch_one(&db.pool)
    .await
    .expect("insert");
    let dead = wait_for(Duration::from_secs(30), || async {
        db.count("dead_at IS NOT NULL").await == 4
    })
    .await;
    assert!(dead, "four events dead-lettered");
    pgoutbox::store::destinations::pause(
        &pgoutbox::store::Store::new(db.pool.clone(), config.table.clone()),
        "audit",
    )
    .await
    .expect("pause audit");
    // A few samples for the chart.
    tokio::time::sleep(Duration::from_secs(2)).await;

    let driver = Driver::start();
    let browser = driver.signed_in(&base, ADMIN).await;
    fn wait(b: &fantoccini::Client) -> fantoccini::wait::Wait<'_> {
        b.wait().at_most(Duration::from_secs(20))
    }

    let row = wait(&browser)
        .for_element(Locator::Css("#destinations tr[data-destination='hooks']"))
        .await
        .expect("the hooks destination in the overview");
    let text = row.text().await.expect("row text");
    assert!(text.contains("webhook"), "{text}");
    let paused = wait(&browser)
        .for_element(Locator::Css(
            "#destinations tr[data-destination='audit'] button.resume",
        ))
        .await
        .expect("audit shows as paused, with a resume button");
    drop(paused);
    wait(&browser)
        .for_element(Locator::Css("#chart svg"))
        .await
        .expect("the chart");
    // The destination's settings, one click under its target, the signing secret masked.
    browser
        .find(Locator::Css(
            "#destinations tr[data-destination='hooks'] details.settings summary",
        ))
        .await
        .expect("settings")
        .click()
        .await
        .expect("open settings");
    let settings = shows(
        &browser,
        "#destinations tr[data-destination='hooks'] details.settings pre",
        "\"max_attempts\": 1",
    )
    .await;
    assert!(settings, "the settings are shown");
    screenshot(
        "console-overview.png",
        &browser.screenshot().await.expect("screenshot"),
    );

    // Dead letters: the event is listed; opened, its payload is text, not markup.
    browser
        .find(Locator::Css("#nav-dead"))
        .await
        .expect("nav")
        .click()
        .await
        .expect("click");
    let listed = wait(&browser)
        .for_element(Locator::Css(&format!("#dead-list tr[data-id='{marked}']")))
        .await
        .expect("the dead event is listed");
    listed.click().await.expect("open it");
    let payload = wait(&browser)
        .for_element(Locator::Css("#event-payload"))
        .await
        .expect("payload");
    let shown = wait_for(Duration::from_secs(20), || async {
        payload
            .text()
            .await
            .unwrap_or_default()
            .contains("<script>alert(1)</script>")
    })
    .await;
    assert!(shown, "the payload's markup is shown as text");
    let html = payload.html(true).await.expect("inner html");
    assert!(
        html.contains("&lt;script&gt;") && !html.contains("<script>"),
        "escaped, never markup: {html}"
    );
    let bolds = browser
        .find_all(Locator::Css("#event-payload b, #event-payload script"))
        .await
        .expect("find");
    assert!(bolds.is_empty(), "no element came from the payload");
    let state = browser
        .find(Locator::Css("#event-state"))
        .await
        .expect("state");
    assert!(state.text().await.expect("state").contains("dead"));
    let counted = shows(&browser, "#dead-page", "of 4 matches").await;
    assert!(counted, "the search says how many events match");
    screenshot(
        "console-dead.png",
        &browser.screenshot().await.expect("screenshot"),
    );

    // Retry, confirm, and it is delivered.
    accept.store(true, Ordering::SeqCst);
    browser
        .find(Locator::Css("#event-retry"))
        .await
        .expect("retry button")
        .click()
        .await
        .expect("click retry");
    let question = browser.get_alert_text().await.expect("a confirmation");
    assert!(question.contains(&marked), "{question}");
    browser.accept_alert().await.expect("confirm");
    let said = shows(&browser, "#status", "retried 1 event").await;
    assert!(said, "the page says it retried the event");
    let published = wait_for(Duration::from_secs(30), || async {
        rx.delivered_ids().contains(&marked)
    })
    .await;
    assert!(published, "the retried event reached the receiver");
    browser
        .goto(&format!("{base}/#dead?state=all&id={marked}"))
        .await
        .expect("open by id");
    browser.refresh().await.expect("reload");
    let published_shown = shows(&browser, "#event-state", "published").await;
    assert!(published_shown, "the page shows the event published");

    // The audit log: the retry, by the token that made it.
    browser
        .find(Locator::Css("#nav-audit"))
        .await
        .expect("nav")
        .click()
        .await
        .expect("click");
    let logged = shows(&browser, "#audit-list", "retry").await;
    assert!(logged, "the retry is in the audit log");
    let row = browser
        .find(Locator::Css("#audit-list tr"))
        .await
        .expect("a row")
        .text()
        .await
        .expect("text");
    assert!(row.contains("admin") && row.contains("console"), "{row}");
    screenshot(
        "console-audit.png",
        &browser.screenshot().await.expect("screenshot"),
    );
    browser.close().await.expect("close");
    stop.cancel();
    let _ = running.await;
}

/// With no admin token configured the page says changes are off, and its change buttons are
/// disabled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_an_admin_token_the_page_says_changes_are_off() {
    let db = TestDb::migrated().await;
    let rx = Receiver::start().await;
    let config = parse_config(&webhook_config(&db, &rx.url, ""));
    let relay = Arc::new(Relay::new(db.pool.clone(), &config).expect("relay"));
    let base = serve_console(relay, Arc::new(Samples::default()), "").await;
    let driver = Driver::start();
    let browser = driver.session().await;
    browser.goto(&format!("{base}/")).await.expect("page");
    let notice = browser
        .wait()
        .at_most(Duration::from_secs(20))
        .for_element(Locator::Css("#mutations-off"))
        .await
        .expect("the changes-off notice");
    let text = notice.text().await.expect("text");
    assert!(text.contains("admin.token"), "{text}");
    let pause = browser
        .wait()
        .at_most(Duration::from_secs(20))
        .for_element(Locator::Css(
            "#destinations tr[data-destination='hooks'] button.pause",
        ))
        .await
        .expect("the pause button");
    let disabled = pause.prop("disabled").await.expect("disabled property");
    assert_eq!(disabled.as_deref(), Some("true"), "pause is disabled");

    // A bad search: the page shows the API's sentence (it names the parameter), not "HTTP 400";
    // once the relay answers again the red line is gone.
    browser
        .goto(&format!("{base}/#dead?id=not-an-id"))
        .await
        .expect("bad search");
    let said = shows(&browser, "#status.error", "id:").await;
    assert!(said, "the page shows the API's error");
    browser
        .goto(&format!("{base}/#overview"))
        .await
        .expect("overview");
    let cleared = wait_for(Duration::from_secs(20), || async {
        match browser.find(Locator::Css("#status")).await {
            Ok(e) => {
                e.attr("class").await.ok().flatten().as_deref() != Some("error")
                    && e.text().await.unwrap_or_default().is_empty()
            }
            Err(_) => false,
        }
    })
    .await;
    assert!(cleared, "the error line is gone once the relay answers");
    browser.close().await.expect("close");
}
