//! Fixtures for the broker sink tests: events with keys and headers, what the relay must have
//! delivered, and a guard that restarts a stopped broker whatever the test's outcome.

use std::collections::HashMap;
use std::process::Command;
use std::time::Duration;

use pgoutbox::engine::{BatchReport, Relay};

use super::{parse_config, TestDb};

/// One event as committed: what a consumer must get back.
#[derive(Debug, Clone)]
pub struct Committed {
    pub id: String,
    pub key: Option<String>,
    pub payload: String,
    pub tenant: String,
}

/// One message as a real consumer received it.
#[derive(Debug, Clone)]
pub struct Got {
    pub id: String,
    pub key: Option<String>,
    pub payload: Vec<u8>,
    pub headers: HashMap<String, String>,
}

/// A unique name for a test's stream, queue or topic.
pub fn unique(prefix: &str) -> String {
    format!(
        "{prefix}{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    )
}

/// Commits `n` events on `topic`, keys `k0`..`k2` round-robin (so each key has several events
/// whose order matters), headers `x-tenant` and `x-n`, payloads with non-ASCII text.
pub async fn commit_events(db: &TestDb, n: usize, topic: &str) {
    sqlx::query(
        "INSERT INTO outbox (topic, payload, key, headers)
         SELECT $1, jsonb_build_object('n', g, 'text', 'héllo \"wörld\"'), 'k' || (g % 3),
                jsonb_build_object('x-tenant', 'acme', 'x-n', g::text)
         FROM generate_series(1, $2) g ORDER BY g",
    )
    .bind(topic)
    .bind(n as i32)
    .execute(&db.pool)
    .await
    .expect("insert events");
}

/// Event headers a producer could use to forge what a sink sets itself or what a broker acts on,
/// next to one an event may set (`x-tenant`).
pub const FORGED_HEADERS: &str = r#"{"Nats-Msg-Id": "forged", "Nats-Expected-Stream": "forged",
    "Nats-Rollup": "all", "pgoutbox-topic": "forged", "PGOUTBOX-KEY": "forged",
    "pgoutbox-id": "forged", "id": "forged", "topic": "forged", "CC": "forged",
    "x-tenant": "acme"}"#;

/// Commits one event on `topic` with key `k` and [`FORGED_HEADERS`]; returns its id.
pub async fn commit_forged(db: &TestDb, topic: &str) -> String {
    sqlx::query_scalar(
        "INSERT INTO outbox (topic, payload, key, headers) VALUES ($1, '{}', 'k', $2::jsonb)
         RETURNING id::text",
    )
    .bind(topic)
    .bind(FORGED_HEADERS)
    .fetch_one(&db.pool)
    .await
    .expect("insert forged event")
}

/// Runs a relay once over `db` with one destination of `kind` and `settings` (see
/// [`sink_config`]); returns its report and every event's `last_error` in seq order (`""` where
/// there is none).
pub async fn run_once(db: &TestDb, kind: &str, settings: &str) -> (BatchReport, Vec<String>) {
    let config = parse_config(&sink_config(db, kind, settings));
    let report = Relay::new(db.pool.clone(), &config)
        .expect("relay")
        .run_once()
        .await
        .expect("run");
    let errors = sqlx::query_scalar("SELECT coalesce(last_error, '') FROM outbox ORDER BY seq")
        .fetch_all(&db.pool)
        .await
        .expect("errors");
    (report, errors)
}

/// Commits `n` events on `topic` ([`commit_events`]), then [`run_once`].
pub async fn commit_and_run_once(
    db: &TestDb,
    n: usize,
    topic: &str,
    kind: &str,
    settings: &str,
) -> (BatchReport, Vec<String>) {
    commit_events(db, n, topic).await;
    run_once(db, kind, settings).await
}

/// The URL-credentials scenario: in a fresh database each, 3 events go out through a destination
/// of `kind` whose `settings(password)` log in with `good` (percent-encoded as in a URL) and all
/// arrive, then 3 through one with the wrong password `wr0ng-pw-77`, which are retried, none
/// dead-lettered. Returns the wrong password's `last_error`s, none of which may name it.
pub async fn credentials_scenario(
    kind: &str,
    good: &str,
    settings: impl Fn(&str) -> String,
) -> Vec<String> {
    let db = TestDb::migrated().await;
    let (report, _) = commit_and_run_once(&db, 3, "order.created", kind, &settings(good)).await;
    assert_eq!(report.delivered, 3, "{report:?}");

    // A refused login is transient: retried, never dead-lettered, the password not in last_error.
    let wrong = "wr0ng-pw-77";
    let db = TestDb::migrated().await;
    let (report, errors) =
        commit_and_run_once(&db, 3, "order.created", kind, &settings(wrong)).await;
    assert_eq!((report.retried, report.dead), (3, 0), "{report:?}");
    assert!(errors.iter().all(|e| !e.contains("wr0ng")), "{errors:?}");
    errors
}

/// Commits one event with [`FORGED_HEADERS`] on `order.created` and runs a relay once with a
/// destination of `kind` and `settings`, which must deliver it; returns its id.
pub async fn deliver_forged(db: &TestDb, kind: &str, settings: &str) -> String {
    let id = commit_forged(db, "order.created").await;
    let (report, _) = run_once(db, kind, settings).await;
    assert_eq!(report.delivered, 1, "{report:?}");
    id
}

/// Asserts a forged event arrived with the sink's own headers (`own`: name as the sink writes
/// it, value) and the allowed `x-tenant`, and without any of the `dropped` names (any case).
pub fn assert_not_forged(got: &Got, id: &str, own: &[(&str, &str)], dropped: &[&str]) {
    assert_eq!(got.id, id, "the event id: {:?}", got.headers);
    for (name, want) in own {
        assert_eq!(
            got.headers.get(*name).map(String::as_str),
            Some(*want),
            "{name}: {:?}",
            got.headers
        );
    }
    assert_eq!(
        got.headers.get("x-tenant").map(String::as_str),
        Some("acme"),
        "{:?}",
        got.headers
    );
    for name in dropped {
        let passed: Vec<_> = got
            .headers
            .iter()
            .filter(|(k, v)| {
                k.eq_ignore_ascii_case(name) && (!own.iter().any(|(o, _)| o == k) || *v == "forged")
            })
            .collect();
        assert!(passed.is_empty(), "forged {name} passed: {:?}", got.headers);
    }
}

/// Every committed event, in seq order, with the payload text the relay publishes.
pub async fn committed(db: &TestDb) -> Vec<Committed> {
    let rows: Vec<(String, Option<String>, String, String)> = sqlx::query_as(
        "SELECT id::text, key, payload::text, headers->>'x-tenant' FROM outbox ORDER BY seq",
    )
    .fetch_all(&db.pool)
    .await
    .expect("select events");
    rows.into_iter()
        .map(|(id, key, payload, tenant)| Committed {
            id,
            key,
            payload,
            tenant,
        })
        .collect()
}

/// Makes every event pending again, as if a relay had died before settling: the next relay run
/// publishes each of them a second time.
pub async fn unpublish_all(db: &TestDb) {
    sqlx::query("UPDATE outbox SET published_at = NULL, next_attempt_at = now()")
        .execute(&db.pool)
        .await
        .expect("reset published_at");
}

/// Asserts `got` holds each committed event exactly once with its payload bytes, key and headers,
/// and that the events of each key arrived in commit order.
pub fn assert_delivered(expected: &[Committed], got: &[Got]) {
    assert_eq!(got.len(), expected.len(), "message count: {got:#?}");
    let by_id: HashMap<&str, &Committed> = expected.iter().map(|c| (c.id.as_str(), c)).collect();
    for g in got {
        let c = by_id
            .get(g.id.as_str())
            .unwrap_or_else(|| panic!("unknown id {:?}", g.id));
        assert_eq!(
            String::from_utf8_lossy(&g.payload),
            c.payload,
            "payload of {}",
            g.id
        );
        assert_eq!(g.key, c.key, "key of {}", g.id);
        assert_eq!(
            g.headers.get("x-tenant").map(String::as_str),
            Some(c.tenant.as_str()),
            "x-tenant header of {}: {:?}",
            g.id,
            g.headers
        );
        assert!(g.headers.contains_key("x-n"), "x-n header of {}", g.id);
    }
    let distinct: std::collections::HashSet<&str> = got.iter().map(|g| g.id.as_str()).collect();
    assert_eq!(distinct.len(), expected.len(), "each event exactly once");
    for key in expected.iter().filter_map(|c| c.key.as_deref()) {
        let want: Vec<&str> = expected
            .iter()
            .filter(|c| c.key.as_deref() == Some(key))
            .map(|c| c.id.as_str())
            .collect();
        let seen: Vec<&str> = got
            .iter()
            .filter(|g| g.key.as_deref() == Some(key))
            .map(|g| g.id.as_str())
            .collect();
        assert_eq!(seen, want, "order of key {key}");
    }
}

/// Like [`assert_delivered`], for runs where retries may reorder events: after an outage the
/// relay's jittered backoff decides which event goes first, so only completeness is checked.
pub fn assert_delivered_any_order(expected: &[Committed], got: &[Got]) {
    let position = |id: &str| {
        expected
            .iter()
            .position(|c| c.id == id)
            .unwrap_or(usize::MAX)
    };
    let mut sorted = got.to_vec();
    sorted.sort_by_key(|g| position(&g.id));
    assert_delivered(expected, &sorted);
}

/// A relay config for `db` with one destination of `type` and `settings` (TOML lines), retrying
/// every second so broker outages are short to wait out.
pub fn sink_config(db: &TestDb, kind: &str, settings: &str) -> String {
    format!(
        "database_url = \"{}\"\n[relay]\npoll_interval = \"50ms\"\npublish_timeout = \"20s\"\n\n\
         [[destinations]]\nname = \"broker\"\ntype = \"{kind}\"\nretry_schedule = [\"1s\"]\n\
         max_attempts = 1000\n{settings}\n",
        db.url
    )
}

/// Whether something listens on 127.0.0.1:`port`.
pub fn port_open(port: u16) -> bool {
    std::net::TcpStream::connect_timeout(
        &std::net::SocketAddr::from(([127, 0, 0, 1], port)),
        Duration::from_millis(500),
    )
    .is_ok()
}

/// Waits up to `timeout` for the port to be `open` (or closed); returns whether it got there.
pub fn wait_port(port: u16, open: bool, timeout: Duration) -> bool {
    let deadline = std::time::Instant::now() + timeout;
    while std::time::Instant::now() < deadline {
        if port_open(port) == open {
            return true;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    port_open(port) == open
}

/// A local broker that a test stops and starts; dropping the guard starts it again (even when
/// the test panicked), so the other tests of that broker find it up.
pub struct Broker {
    pub name: &'static str,
    pub port: u16,
    pub start: &'static [&'static str],
    pub stop: &'static [&'static str],
    pub start_timeout: Duration,
}

impl Broker {
    pub fn nats() -> Self {
        Self {
            name: "nats-server",
            port: 4222,
            start: &[
                "start-stop-daemon",
                "--start",
                "--oknodo",
                "--background",
                "--exec",
                "/usr/sbin/nats-server",
                "--",
                "-a",
                "127.0.0.1",
                "-p",
                "4222",
                "-js",
                "-sd",
                "/var/lib/nats-server",
            ],
            stop: &[
                "start-stop-daemon",
                "--stop",
                "--retry",
                "10",
                "--exec",
                "/usr/sbin/nats-server",
            ],
            start_timeout: Duration::from_secs(30),
        }
    }

    pub fn rabbitmq() -> Self {
        Self {
            name: "rabbitmq-server",
            port: 5672,
            start: &["rabbitmq-server", "-detached"],
            stop: &["rabbitmqctl", "stop"],
            start_timeout: Duration::from_secs(90),
        }
    }

    fn exec(&self, argv: &[&str]) {
        let status = Command::new(argv[0])
            .args(&argv[1..])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status();
        if let Err(e) = status {
            eprintln!("{}: cannot run {:?}: {e}", self.name, argv);
        }
    }

    /// Stops the broker and waits until its port is closed.
    pub fn stop(&self) {
        self.exec(self.stop);
        assert!(
            wait_port(self.port, false, Duration::from_secs(60)),
            "{} still listens on {}",
            self.name,
            self.port
        );
    }

    /// Starts the broker and waits until its port is open.
    pub fn start(&self) {
        if !port_open(self.port) {
            self.exec(self.start);
        }
        assert!(
            wait_port(self.port, true, self.start_timeout),
            "{} did not come back on {}",
            self.name,
            self.port
        );
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        if !port_open(self.port) {
            self.exec(self.start);
            wait_port(self.port, true, self.start_timeout);
        }
    }
}

/// The broker-down scenario shared by the outage tests: a relay process delivers 10 events, the
/// broker stops, 20 more are committed and retried or held (never dead-lettered) while the relay keeps
/// running, the broker starts again, everything is delivered and the relay exits 0 on SIGTERM.
pub async fn broker_outage(
    db: &TestDb,
    broker: &Broker,
    dir: &std::path::Path,
    config: &std::path::Path,
    tag: &str,
) {
    let mut relay = super::spawn_relay(dir, config, tag);

    // Connected and delivering first, so the outage is a lost connection, not a refused one.
    commit_events(db, 10, "before").await;
    assert!(
        super::wait_for(Duration::from_secs(30), || async {
            db.count("published_at IS NULL").await == 0
        })
        .await,
        "first events delivered"
    );

    broker.stop();
    commit_events(db, 20, "during").await;
    // Each is tried and scheduled again, or, once the breaker has opened, held without an attempt.
    let retried = super::wait_for(Duration::from_secs(30), || async {
        db.count("published_at IS NULL AND (attempts >= 1 OR next_attempt_at = 'infinity')")
            .await
            == 20
    })
    .await;
    let errors: Vec<String> =
        sqlx::query_scalar("SELECT DISTINCT last_error FROM outbox WHERE last_error IS NOT NULL")
            .fetch_all(&db.pool)
            .await
            .expect("errors");
    assert!(
        retried,
        "events retried while {tag} is down; errors: {errors:?}"
    );
    assert!(
        relay.try_wait().expect("wait").is_none(),
        "relay keeps running"
    );
    assert_eq!(db.count("dead_at IS NOT NULL").await, 0, "{errors:?}");

    broker.start();
    let delivered = super::wait_for(Duration::from_secs(90), || async {
        db.count("published_at IS NULL").await == 0
    })
    .await;
    super::signal(&relay, libc::SIGTERM);
    let status = relay.wait().expect("relay exits");
    assert!(
        delivered,
        "all delivered after the restart; errors: {errors:?}"
    );
    assert!(status.success(), "{status:?}");
}
