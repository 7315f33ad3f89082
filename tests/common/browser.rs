//! A real browser for the console's tests: chromedriver (which `.ci/run` installs with
//! Chromium) on a free port, a headless session, and a wait for what the page shows.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use fantoccini::{ClientBuilder, Locator};
use serde_json::json;

use super::wait_for;

/// chromedriver on a free port, killed when dropped.
pub struct Driver {
    url: String,
    child: Child,
}

impl Driver {
    /// Starts chromedriver; panics naming the package when it is missing.
    pub fn start() -> Self {
        let port = super::private::free_port();
        let child = Command::new("chromedriver")
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("chromedriver (apt-get install chromium chromium-driver; .ci/run does)");
        assert!(
            super::sinks::wait_port(port, true, Duration::from_secs(30)),
            "chromedriver did not listen on {port}"
        );
        Self {
            url: format!("http://127.0.0.1:{port}"),
            child,
        }
    }

    /// A WebDriver session with headless Chromium at 1280×860.
    pub async fn session(&self) -> fantoccini::Client {
        let mut caps = serde_json::Map::new();
        caps.insert(
            "goog:chromeOptions".into(),
            json!({
                "binary": "/usr/bin/chromium",
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                         "--window-size=1280,860"]
            }),
        );
        ClientBuilder::rustls()
            .expect("rustls")
            .capabilities(caps)
            .connect(&self.url)
            .await
            .expect("a WebDriver session with headless Chromium")
    }
}

impl Driver {
    /// A session on the console at `base`, signed in with `token` and showing its overview. The
    /// token lives in the tab's sessionStorage, as the page's token box keeps it.
    pub async fn signed_in(&self, base: &str, token: &str) -> fantoccini::Client {
        let browser = self.session().await;
        browser.goto(&format!("{base}/")).await.expect("page");
        browser
            .execute(
                "sessionStorage.setItem('pgoutbox-token', arguments[0])",
                vec![json!(token)],
            )
            .await
            .expect("token");
        browser
            .goto(&format!("{base}/#overview"))
            .await
            .expect("page");
        browser
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Whether the element at `css` comes to show `text` (the page updates it asynchronously).
pub async fn shows(browser: &fantoccini::Client, css: &str, text: &str) -> bool {
    wait_for(Duration::from_secs(20), || async {
        match browser.find(Locator::Css(css)).await {
            Ok(e) => e.text().await.unwrap_or_default().contains(text),
            Err(_) => false,
        }
    })
    .await
}

/// Clicks the element at `css`, waiting for it to be there.
pub async fn click(browser: &fantoccini::Client, css: &str) {
    browser
        .wait()
        .at_most(Duration::from_secs(20))
        .for_element(Locator::Css(css))
        .await
        .unwrap_or_else(|e| panic!("{css}: {e}"))
        .click()
        .await
        .unwrap_or_else(|e| panic!("click {css}: {e}"));
}
