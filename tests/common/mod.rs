//! Shared fixtures for the integration tests: a database per test, a real HTTP receiver, and
//! helpers to run the `pgoutbox` binary.
#![allow(dead_code)]

#[cfg(feature = "rabbitmq")]
pub mod amqp;
#[cfg(all(
    feature = "sqs",
    feature = "sns",
    feature = "kinesis",
    feature = "eventbridge",
    feature = "s3"
))]
pub mod aws;
pub mod browser;
pub mod cloudevents;
pub mod logical;
#[cfg(feature = "nats")]
pub mod nats;
pub mod private;
pub mod sinks;
pub mod tls;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use pgoutbox::config::Config;
use pgoutbox::engine::{BatchReport, Relay};
use pgoutbox::OutboxTable;
use sqlx::postgres::PgPoolOptions;
use sqlx::{Executor, PgPool};
use tokio_util::sync::CancellationToken;

/// The console token of an operator (`alice`, role `operate`), in [`TOKENS`].
pub const OPS: &str = "0ps-t0ken";
/// The console token of a reader (`victor`, role `read`), in [`TOKENS`].
pub const VIEWER: &str = "v1ewer-t0ken";
/// Configuration of the two console tokens above.
pub const TOKENS: &str = r#"
[[tokens]]
name = "alice"
role = "operate"
token = "0ps-t0ken"

[[tokens]]
name = "victor"
role = "read"
token = "v1ewer-t0ken"
"#;

/// Server URL of the local test PostgreSQL (trust auth), without a database name.
pub fn server_url() -> String {
    std::env::var("PGOUTBOX_TEST_SERVER")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".into())
}

/// A database of its own for one test, dropped at the end.
pub struct TestDb {
    pub name: String,
    pub url: String,
    pub pool: PgPool,
    /// The server it lives on (URL without a database).
    server: String,
}

impl TestDb {
    /// An empty database.
    pub async fn empty() -> Self {
        Self::empty_on(&server_url()).await
    }

    /// An empty database on another server (a `logical::LogicalPg`).
    pub async fn empty_on(server: &str) -> Self {
        let name = format!("pgoutbox_t_{}", uuid::Uuid::new_v4().simple());
        let admin = PgPoolOptions::new()
            .max_connections(1)
            .connect(&format!("{server}/postgres"))
            .await
            .expect("connect to the local PostgreSQL (is it running?)");
        admin
            .execute(format!("CREATE DATABASE {name}").as_str())
            .await
            .expect("create test database");
        admin.close().await;
        let url = format!("{server}/{name}");
        let pool = PgPoolOptions::new()
            .max_connections(8)
            .connect(&url)
            .await
            .expect("connect");
        Self {
            name,
            url,
            pool,
            server: server.to_owned(),
        }
    }

    /// A database with the default outbox table migrated.
    pub async fn migrated() -> Self {
        Self::migrated_on(&server_url()).await
    }

    /// A database with the default outbox table migrated, on another server.
    pub async fn migrated_on(server: &str) -> Self {
        let db = Self::empty_on(server).await;
        pgoutbox::schema::migrate(&db.pool, &OutboxTable::default_table())
            .await
            .expect("migrate");
        db
    }

    /// Counts rows matching a WHERE clause of the default outbox table.
    pub async fn count(&self, where_clause: &str) -> i64 {
        sqlx::query_scalar(&format!("SELECT count(*) FROM outbox WHERE {where_clause}"))
            .fetch_one(&self.pool)
            .await
            .expect("count")
    }

    /// Inserts `n` events with the plain SQL any language would use; returns their ids in order.
    pub async fn insert_plain(&self, n: usize, topic: &str) -> Vec<String> {
        sqlx::query_scalar(
            "INSERT INTO outbox (topic, payload)
             SELECT $1, jsonb_build_object('n', g) FROM generate_series(1, $2) g
             RETURNING id::text",
        )
        .bind(topic)
        .bind(n as i32)
        .fetch_all(&self.pool)
        .await
        .expect("insert")
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let name = self.name.clone();
        let server = self.server.clone();
        // Async drop is not a thing: drop the database from a short-lived runtime of its own.
        let _ = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async move {
                // A server a test stopped (a failover's old primary) refuses at once: do not
                // retry for the default 30 s.
                if let Ok(admin) = PgPoolOptions::new()
                    .max_connections(1)
                    .acquire_timeout(Duration::from_secs(3))
                    .connect(&format!("{server}/postgres"))
                    .await
                {
                    let _ = admin
                        .execute(format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)").as_str())
                        .await;
                }
            });
        })
        .join();
    }
}

/// A gate the receiver holds requests at until the test opens it: "while a request is held" is
/// then a state the test controls, not a guess about timing.
#[derive(Clone, Debug)]
pub struct Gate(Arc<tokio::sync::watch::Sender<bool>>);

impl Gate {
    /// A closed gate.
    pub fn closed() -> Self {
        Self(Arc::new(tokio::sync::watch::channel(false).0))
    }

    /// Lets every held request (and every later one) through.
    pub fn open(&self) {
        self.0.send_replace(true);
    }

    async fn passed(&self) {
        let _ = self.0.subscribe().wait_for(|open| *open).await;
    }
}

/// What the receiver answers to one request.
#[derive(Clone, Debug)]
pub struct Reply {
    pub status: u16,
    pub delay: Duration,
    /// Held here (after `delay`) until the gate opens.
    pub gate: Option<Gate>,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Reply {
    pub fn ok() -> Self {
        Self::status(200)
    }

    pub fn status(status: u16) -> Self {
        Self {
            status,
            delay: Duration::ZERO,
            gate: None,
            headers: vec![],
            body: String::new(),
        }
    }

    pub fn body(mut self, body: &str) -> Self {
        self.body = body.into();
        self
    }

    pub fn header(mut self, k: &str, v: &str) -> Self {
        self.headers.push((k.into(), v.into()));
        self
    }

    pub fn delay(mut self, d: Duration) -> Self {
        self.delay = d;
        self
    }

    /// Answers only once `gate` is open.
    pub fn held_at(mut self, gate: &Gate) -> Self {
        self.gate = Some(gate.clone());
        self
    }
}

/// One request the receiver got.
#[derive(Clone, Debug)]
pub struct Received {
    pub id: String,
    pub headers: HashMap<String, String>,
    pub body: Vec<u8>,
    pub at: Instant,
    pub status: u16,
    /// How many requests with this webhook-id came before (0 for the first).
    pub nth: usize,
}

impl Received {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).expect("json body")
    }
}

type Behaviour = Arc<dyn Fn(&Received) -> Reply + Send + Sync>;

#[derive(Clone)]
struct ReceiverState {
    log: Arc<Mutex<Vec<Received>>>,
    /// Requests seen per webhook-id, so `nth` costs O(1) however long the log grows.
    seen: Arc<Mutex<HashMap<String, usize>>>,
    behaviour: Arc<Mutex<Behaviour>>,
    /// Requests being answered now, and the most there ever were at once.
    in_flight: Arc<(
        std::sync::atomic::AtomicUsize,
        std::sync::atomic::AtomicUsize,
    )>,
}

/// The README's minimal outbox table, as an application that already has one created it: what
/// `migrate` upgrades in place.
pub const MINIMAL_OUTBOX: &str = "CREATE TABLE outbox (
    id           uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    created_at   timestamptz NOT NULL DEFAULT now(),
    published_at timestamptz,
    topic        text NOT NULL,
    payload      jsonb NOT NULL,
    attempts     int NOT NULL DEFAULT 0,
    last_error   text)";

/// A real HTTP server on 127.0.0.1 that records every request and answers per a behaviour.
pub struct Receiver {
    pub url: String,
    state: ReceiverState,
    _server: tokio::task::JoinHandle<()>,
}

impl Receiver {
    /// A receiver answering 200 to everything.
    pub async fn start() -> Self {
        Self::with(|_| Reply::ok()).await
    }

    /// A receiver that refuses every request with `status` and `body` until the returned switch is
    /// set, then answers 200.
    pub async fn refusing(
        status: u16,
        body: &'static str,
    ) -> (Self, Arc<std::sync::atomic::AtomicBool>) {
        let accept = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = accept.clone();
        let rx = Self::with(move |_| {
            if flag.load(std::sync::atomic::Ordering::SeqCst) {
                Reply::ok()
            } else {
                Reply::status(status).body(body)
            }
        })
        .await;
        (rx, accept)
    }

    /// A receiver answering per `behaviour`.
    pub async fn with(behaviour: impl Fn(&Received) -> Reply + Send + Sync + 'static) -> Self {
        Self::on("127.0.0.1:0", behaviour).await
    }

    /// A receiver on a given address (e.g. one that was closed until now), answering per
    /// `behaviour`.
    pub async fn on(
        addr: &str,
        behaviour: impl Fn(&Received) -> Reply + Send + Sync + 'static,
    ) -> Self {
        let state = ReceiverState {
            log: Arc::new(Mutex::new(Vec::new())),
            seen: Arc::default(),
            behaviour: Arc::new(Mutex::new(Arc::new(behaviour))),
            in_flight: Arc::default(),
        };
        let app = axum::Router::new()
            .route("/events", axum::routing::post(handle))
            .with_state(state.clone());
        let listener = tokio::net::TcpListener::bind(addr).await.expect("bind");
        let addr: SocketAddr = listener.local_addr().expect("addr");
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Self {
            url: format!("http://{addr}/events"),
            state,
            _server: server,
        }
    }

    /// Changes the behaviour from now on.
    pub fn set(&self, behaviour: impl Fn(&Received) -> Reply + Send + Sync + 'static) {
        *self.state.behaviour.lock().expect("lock") = Arc::new(behaviour);
    }

    /// Every request so far.
    pub fn log(&self) -> Vec<Received> {
        self.state.log.lock().expect("lock").clone()
    }

    /// How many requests so far (without copying the log).
    pub fn count(&self) -> usize {
        self.state.log.lock().expect("lock").len()
    }

    /// Requests answered with a 2xx.
    pub fn delivered(&self) -> Vec<Received> {
        self.log()
            .into_iter()
            .filter(|r| (200..300).contains(&r.status))
            .collect()
    }

    /// The most requests it was answering at once.
    pub fn max_in_flight(&self) -> usize {
        self.state
            .in_flight
            .1
            .load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Distinct ids answered with a 2xx.
    pub fn delivered_ids(&self) -> std::collections::HashSet<String> {
        self.delivered().into_iter().map(|r| r.id).collect()
    }
}

async fn handle(State(state): State<ReceiverState>, headers: HeaderMap, body: Bytes) -> Response {
    use std::sync::atomic::Ordering::SeqCst;
    /// Counts the request out when it ends, answered or dropped (the client went away).
    struct Out<'a>(&'a std::sync::atomic::AtomicUsize);
    impl Drop for Out<'_> {
        fn drop(&mut self) {
            self.0.fetch_sub(1, SeqCst);
        }
    }
    let now = state.in_flight.0.fetch_add(1, SeqCst) + 1;
    state.in_flight.1.fetch_max(now, SeqCst);
    let _out = Out(&state.in_flight.0);
    answer(&state, headers, body).await
}

async fn answer(state: &ReceiverState, headers: HeaderMap, body: Bytes) -> Response {
    let headers: HashMap<String, String> = headers
        .iter()
        .map(|(k, v)| (k.as_str().to_owned(), v.to_str().unwrap_or("").to_owned()))
        .collect();
    let id = headers.get("webhook-id").cloned().unwrap_or_default();
    let mut received = Received {
        nth: 0,
        id,
        headers,
        body: body.to_vec(),
        at: Instant::now(),
        status: 0,
    };
    received.nth = {
        let mut seen = state.seen.lock().expect("lock");
        let n = seen.entry(received.id.clone()).or_insert(0);
        *n += 1;
        *n - 1
    };
    let behaviour = state.behaviour.lock().expect("lock").clone();
    let reply = behaviour(&received);
    received.status = reply.status;
    state.log.lock().expect("lock").push(received);
    if !reply.delay.is_zero() {
        tokio::time::sleep(reply.delay).await;
    }
    if let Some(gate) = &reply.gate {
        gate.passed().await;
    }
    let mut response = (
        StatusCode::from_u16(reply.status).expect("status"),
        reply.body,
    )
        .into_response();
    for (k, v) in reply.headers {
        response.headers_mut().insert(
            axum::http::HeaderName::try_from(k).expect("name"),
            axum::http::HeaderValue::try_from(v).expect("value"),
        );
    }
    response
}

/// A local TCP port nothing listens on (bound, then closed): connections to it are refused.
pub fn closed_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port()
}

/// Polls `check` every 50 ms until it holds or `timeout` passes; returns whether it held.
pub async fn wait_for<F, Fut>(timeout: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if check().await {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A TOML config for `db` with one webhook destination at `url`, plus `extra` destination keys.
pub fn webhook_config(db: &TestDb, url: &str, extra: &str) -> String {
    format!(
        "database_url = \"{}\"\n[relay]\npoll_interval = \"50ms\"\n\n[[destinations]]\nname = \"hooks\"\ntype = \"webhook\"\nurl = \"{url}\"\n{extra}\n",
        db.url
    )
}

/// Parses a config text for in-process relays (no environment overrides).
pub fn parse_config(text: &str) -> Config {
    Config::parse(text, |_| None).expect("valid test config")
}

/// A relay running in this process (`Relay::run`) until stopped.
pub struct Running {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<pgoutbox::Result<BatchReport>>,
}

impl Running {
    /// Starts a relay for `config_text` on `db`'s pool.
    pub fn start(db: &TestDb, config_text: &str) -> Self {
        Self::on(db.pool.clone(), config_text)
    }

    /// Starts a relay for `config_text` on a pool of its own.
    pub fn on(pool: PgPool, config_text: &str) -> Self {
        let relay = Arc::new(Relay::new(pool, &parse_config(config_text)).expect("relay"));
        let stop = CancellationToken::new();
        let task = tokio::spawn(relay.run(stop.clone()));
        Self { stop, task }
    }

    /// Stops the relay and waits for it to end; returns its report.
    pub async fn stop(self) -> BatchReport {
        self.stop.cancel();
        self.task.await.expect("join").expect("relay result")
    }

    /// Stops every relay at once (all are told to stop before any is waited for).
    pub async fn stop_all(relays: Vec<Running>) {
        for relay in &relays {
            relay.stop.cancel();
        }
        for relay in relays {
            relay.stop().await;
        }
    }
}

/// A login role named `<prefix>_<part of db's name>`, granted what the relay needs on `db` by
/// `pgoutbox migrate --grant-relay`. Roles are the server's, not the database's: end with
/// [`drop_role`].
pub async fn relay_role(db: &TestDb, prefix: &str) -> String {
    let role = format!("{prefix}_{}", &db.name[11..23]);
    sqlx::raw_sql(&format!("CREATE ROLE {role} LOGIN"))
        .execute(&db.pool)
        .await
        .expect("role");
    let (code, out, err) = run(&["migrate", "--database-url", &db.url, "--grant-relay", &role]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains(&format!("granted {role}")), "{out}");
    role
}

/// Drops `db` (which holds the role's grants), then the role made by [`relay_role`].
pub async fn drop_role(db: TestDb, role: &str) {
    drop(db);
    let admin = sqlx::PgPool::connect(&format!("{}/postgres", server_url()))
        .await
        .expect("admin");
    let _ = sqlx::raw_sql(&format!("DROP ROLE IF EXISTS {role}"))
        .execute(&admin)
        .await;
}

/// A scratch directory that lives as long as the value.
pub fn scratch() -> tempfile::TempDir {
    tempfile::tempdir().expect("tempdir")
}

/// Writes `text` as `config.toml` in `dir`.
pub fn write_config(dir: &Path, text: &str) -> PathBuf {
    let path = dir.join("config.toml");
    std::fs::write(&path, text).expect("write config");
    path
}

/// The `pgoutbox` binary, with the environment cleared of overrides that would leak in.
pub fn pgoutbox() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_pgoutbox"));
    for var in [
        "DATABASE_URL",
        "PGOUTBOX_DATABASE_URL",
        "PGOUTBOX_CONFIG",
        "PGOUTBOX_SCHEMA",
        "PGOUTBOX_TABLE",
    ] {
        cmd.env_remove(var);
    }
    cmd.env("RUST_LOG", "pgoutbox=debug,warn");
    cmd
}

/// Starts `pgoutbox relay` with `config`, logs to `dir/relay-<tag>.log`.
pub fn spawn_relay(dir: &Path, config: &Path, tag: &str) -> Child {
    let log = std::fs::File::create(dir.join(format!("relay-{tag}.log"))).expect("log file");
    pgoutbox()
        .args(["relay", "--config"])
        .arg(config)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("spawn relay")
}

/// Runs the binary to completion; returns (exit code, stdout, stderr).
pub fn run(args: &[&str]) -> (i32, String, String) {
    let out = pgoutbox().args(args).output().expect("run pgoutbox");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Waits for `child` to exit by itself; past `guard` (a hang guard, not a property) it is killed
/// and `None` returned.
pub async fn exit_status(child: &mut Child, guard: Duration) -> Option<std::process::ExitStatus> {
    let deadline = Instant::now() + guard;
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            return Some(status);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Sends a signal to a child process.
pub fn signal(child: &Child, sig: i32) {
    // SAFETY: kill(2) on a pid we spawned; no memory is touched.
    unsafe {
        libc::kill(child.id() as i32, sig);
    }
}

/// Serves the console of an in-process relay on a free port, charting `samples`, with `admin`
/// (the `[admin]` table as TOML); returns its base URL.
pub async fn serve_console(
    relay: Arc<Relay>,
    samples: Arc<pgoutbox::server::Samples>,
    admin: &str,
) -> String {
    let config: pgoutbox::config::AdminConfig = toml::from_str(admin).expect("admin config");
    serve(pgoutbox::server::console::Console::new(
        relay, samples, &config,
    ))
    .await
}

/// Serves `console` on a free port; returns its base URL.
pub async fn serve(console: pgoutbox::server::console::Console) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(async move {
        let _ = axum::serve(listener, pgoutbox::server::console::router(console)).await;
    });
    base
}

/// A JSON API call: (status, JSON body or Null).
pub async fn api_call(
    method: &str,
    url: &str,
    token: Option<&str>,
    body: Option<serde_json::Value>,
) -> (u16, serde_json::Value) {
    let client = reqwest::Client::new();
    let mut req = match method {
        "GET" => client.get(url),
        "PATCH" => client.patch(url),
        "DELETE" => client.delete(url),
        _ => client.post(url),
    };
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    if let Some(b) = body {
        req = req.json(&b);
    }
    let resp = req.send().await.expect("request");
    let status = resp.status().as_u16();
    let text = resp.text().await.expect("body");
    (
        status,
        serde_json::from_str(&text).unwrap_or(serde_json::Value::Null),
    )
}

/// Percent-encodes every byte but ASCII letters and digits, for a query string that must carry
/// exactly these bytes (NUL, control bytes, bytes that are not UTF-8, JSON).
pub fn percent_encode(bytes: &[u8]) -> String {
    bytes
        .iter()
        .map(|&b| {
            if b.is_ascii_alphanumeric() {
                char::from(b).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// Waits (up to `guard`) until `relay`'s readiness fails with the stall line, then asserts it did.
pub async fn assert_stalls(relay: &pgoutbox::engine::Relay, guard: Duration) {
    let stalled = wait_for(guard, || async {
        matches!(relay.readiness().await, Err(lines) if lines.iter().any(|l| l.starts_with("progress: not ready: stalled")))
    })
    .await;
    assert!(
        stalled,
        "readiness fails with the stall: {:?}",
        relay.readiness().await
    );
}
