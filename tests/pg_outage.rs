//! Behaviour while PostgreSQL itself is down. Stops the shared server, so nextest runs this binary
//! alone (see .config/nextest.toml).

mod common;

use std::time::Duration;

use common::*;

fn pg_ctl(action: &str) -> bool {
    let Some(version) = std::fs::read_dir("/etc/postgresql")
        .ok()
        .and_then(|mut d| d.next())
        .and_then(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
    else {
        return false;
    };
    std::process::Command::new("pg_ctlcluster")
        .args(["--skip-systemctl-redirect", &version, "main", action])
        .status()
        .is_ok_and(|s| s.success())
}

async fn readyz(port: u16) -> Option<u16> {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .ok()?;
    Some(
        client
            .get(format!("http://127.0.0.1:{port}/readyz"))
            .send()
            .await
            .ok()?
            .status()
            .as_u16(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_follows_the_database_and_the_relay_survives_a_stop() {
    let db = TestDb::migrated().await;
    let rx = Receiver::start().await;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port();
    let dir = scratch();
    let text = webhook_config(&db, &rx.url, "").replace(
        "[relay]\n",
        &format!("[observability]\nlisten = \"127.0.0.1:{port}\"\n[relay]\n"),
    );
    let config = write_config(dir.path(), &text);
    let mut relay = spawn_relay(dir.path(), &config, "outage");
    assert!(
        wait_for(Duration::from_secs(20), || async {
            readyz(port).await == Some(200)
        })
        .await,
        "ready at start"
    );

    assert!(
        pg_ctl("stop"),
        "cannot stop PostgreSQL (needs pg_ctlcluster, as root)"
    );
    let not_ready = wait_for(Duration::from_secs(20), || async {
        readyz(port).await == Some(503)
    })
    .await;
    let log_path = dir.path().join("relay-outage.log");
    let logged = wait_for(Duration::from_secs(20), || async {
        std::fs::read_to_string(&log_path)
            .unwrap_or_default()
            .contains("claim or settle failed")
    })
    .await;
    let still_running = relay.try_wait().expect("try_wait").is_none();
    assert!(pg_ctl("start"), "cannot start PostgreSQL again");
    assert!(not_ready, "/readyz says not ready while PostgreSQL is down");
    assert!(
        still_running,
        "the relay did not exit while PostgreSQL was down"
    );
    assert!(logged, "the relay logs the outage");

    assert!(
        wait_for(Duration::from_secs(30), || async {
            readyz(port).await == Some(200)
        })
        .await,
        "ready again"
    );
    // And it relays again, on fresh connections.
    let pool = sqlx::postgres::PgPoolOptions::new()
        .connect(&db.url)
        .await
        .expect("reconnect");
    sqlx::query("INSERT INTO outbox (topic, payload) VALUES ('after.outage', '{}')")
        .execute(&pool)
        .await
        .expect("insert");
    assert!(
        wait_for(Duration::from_secs(20), || async {
            !rx.delivered().is_empty()
        })
        .await,
        "delivers after the outage"
    );
    signal(&relay, libc::SIGTERM);
    relay.wait().expect("wait");
    let log = std::fs::read_to_string(dir.path().join("relay-outage.log")).expect("log");
    assert!(
        log.contains("claim or settle failed") && log.contains("database reachable again"),
        "{log}"
    );
}
