//! A database failover under running relays: a primary and a synchronous streaming standby of the
//! test's own ([`LogicalPg::standby`]), a producer writing all along, relays given both hosts in
//! one URL. The primary stops and the standby is promoted. What is asserted is the promise: every
//! event whose commit was acknowledged is delivered (lost 0), and nothing arrives that is not in
//! the promoted server's table (phantom 0). The time from the promotion to the first delivery of
//! an event written on the new primary is printed, not asserted.

mod common;

use std::collections::HashSet;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::logical::LogicalPg;
use common::*;
use sqlx::{Connection, PgConnection};

/// What the producer wrote: events whose commit was acknowledged (with when), and events whose
/// commit was sent but never answered (the server went away: they may or may not exist).
#[derive(Default)]
struct Written {
    committed: Vec<(String, Instant)>,
    in_doubt: Vec<String>,
}

/// A session on whichever of `ports` accepts writes now, if any.
async fn writable(ports: &[u16], db: &str) -> Option<PgConnection> {
    for port in ports {
        let url = format!("postgres://postgres@127.0.0.1:{port}/{db}");
        let Ok(Ok(mut conn)) =
            tokio::time::timeout(Duration::from_secs(2), PgConnection::connect(&url)).await
        else {
            continue;
        };
        let standby: Result<bool, _> = sqlx::query_scalar("SELECT pg_is_in_recovery()")
            .fetch_one(&mut conn)
            .await;
        if standby.is_ok_and(|s| !s) {
            return Some(conn);
        }
    }
    None
}

/// An application writing one event every 10 ms until `stop`, to whichever host is writable, as
/// a failover-aware application would.
async fn produce(ports: Vec<u16>, db: String, stop: Arc<AtomicBool>) -> Written {
    let mut written = Written::default();
    let mut conn: Option<PgConnection> = None;
    while !stop.load(Ordering::SeqCst) {
        let Some(session) = conn.as_mut() else {
            conn = writable(&ports, &db).await;
            if conn.is_none() {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            continue;
        };
        let id = uuid::Uuid::new_v4().to_string();
        let insert = sqlx::query(
            "INSERT INTO outbox (id, topic, payload) VALUES ($1::uuid, 'failover', '{}')",
        )
        .bind(&id)
        .execute(&mut *session)
        .await;
        match insert {
            Ok(_) => written.committed.push((id, Instant::now())),
            Err(_) => {
                written.in_doubt.push(id);
                conn = None;
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    written
}

/// A primary with a synchronous standby, a migrated database on both, a receiver, and the URL
/// naming both hosts.
struct Pair {
    primary: LogicalPg,
    standby: LogicalPg,
    db: TestDb,
    rx: Receiver,
    both: String,
    dir: tempfile::TempDir,
}

impl Pair {
    async fn start() -> Self {
        let primary = LogicalPg::start(&[]);
        let standby = primary.standby();
        let db = TestDb::migrated_on(&primary.server_url()).await;
        // A synchronous commit waits for the standby to flush, not to apply: wait until the
        // standby shows the migrated database, or a test that connects to it first races replay.
        let on_standby = format!("postgres://postgres@127.0.0.1:{}/{}", standby.port, db.name);
        let applied = wait_for(Duration::from_secs(30), || async {
            match sqlx::PgPool::connect(&on_standby).await {
                Ok(pool) => {
                    let version: Option<i32> =
                        sqlx::query_scalar("SELECT max(version) FROM pgoutbox_migrations")
                            .fetch_one(&pool)
                            .await
                            .unwrap_or(None);
                    pool.close().await;
                    version == Some(pgoutbox::schema::CURRENT_VERSION)
                }
                Err(_) => false,
            }
        })
        .await;
        assert!(
            applied,
            "the standby replays the migrated database within 30 s"
        );
        let both = format!(
            "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/{}?target_session_attrs=read-write",
            primary.port, standby.port, db.name
        );
        Self {
            primary,
            standby,
            db,
            rx: Receiver::start().await,
            both,
            dir: scratch(),
        }
    }

    /// A relay config on both hosts with `source` and the receiver as the one destination.
    fn config(&self, source: &str, extra: &str) -> String {
        format!(
            "database_url = \"{}\"\nsource = \"{source}\"\n{extra}\n[relay]\npoll_interval = \"50ms\"\n\n[wal]\nstandby_retry = \"200ms\"\n\n[[destinations]]\nname = \"hooks\"\ntype = \"webhook\"\nurl = \"{}\"\n",
            self.both, self.rx.url
        )
    }

    /// A producer on both hosts (stopped by the returned flag).
    fn produce(&self) -> (Arc<AtomicBool>, tokio::task::JoinHandle<Written>) {
        let stop = Arc::new(AtomicBool::new(false));
        let producer = tokio::spawn(produce(
            vec![self.primary.port, self.standby.port],
            self.db.name.clone(),
            stop.clone(),
        ));
        (stop, producer)
    }

    /// Stops the primary and promotes the standby; when the promotion was done.
    fn fail_over(&mut self) -> Instant {
        self.primary.stop();
        self.standby.promote();
        Instant::now()
    }

    /// The promoted server's outbox ids.
    async fn table(&self) -> HashSet<String> {
        let mut conn = PgConnection::connect(&format!(
            "postgres://postgres@127.0.0.1:{}/{}",
            self.standby.port, self.db.name
        ))
        .await
        .expect("connect to the promoted server");
        sqlx::query_scalar::<_, String>("SELECT id::text FROM outbox")
            .fetch_all(&mut conn)
            .await
            .expect("ids")
            .into_iter()
            .collect()
    }

    /// The relay logs of `tags`, joined.
    fn logs(&self, tags: &[&str]) -> String {
        tags.iter()
            .map(|tag| {
                std::fs::read_to_string(self.dir.path().join(format!("relay-{tag}.log")))
                    .unwrap_or_default()
            })
            .collect()
    }

    /// Waits until everything in the promoted table is delivered, then weighs what arrived
    /// against what was written: prints the figures and asserts lost 0, phantom 0.
    async fn check(&self, what: &str, written: &Written, promoted: Instant, logs: &[&str]) {
        let table = self.table().await;
        let delivered_all = wait_for(Duration::from_secs(90), || async {
            table.is_subset(&self.rx.delivered_ids())
        })
        .await;
        let delivered = self.rx.delivered_ids();
        let lost: Vec<&String> = written
            .committed
            .iter()
            .map(|(id, _)| id)
            .filter(|id| !delivered.contains(*id))
            .collect();
        let phantom: Vec<&String> = delivered.difference(&table).collect();
        let after: HashSet<&String> = written
            .committed
            .iter()
            .filter(|(_, at)| *at > promoted)
            .map(|(id, _)| id)
            .collect();
        let first = self
            .rx
            .delivered()
            .into_iter()
            .filter(|r| after.contains(&r.id))
            .map(|r| r.at)
            .min();
        eprintln!(
            "failover ({what}): {} committed ({} after the promotion), {} in doubt, {} delivered ({} requests); lost {}, phantom {}; promotion to the first delivery of an event written on the new primary: {:?}",
            written.committed.len(),
            after.len(),
            written.in_doubt.len(),
            delivered.len(),
            self.rx.delivered().len(),
            lost.len(),
            phantom.len(),
            first.map(|at| at.duration_since(promoted)),
        );
        assert!(!after.is_empty(), "the producer wrote to the new primary");
        assert!(lost.is_empty(), "lost {lost:?}\n{}", self.logs(logs));
        assert!(phantom.is_empty(), "phantom {phantom:?}");
        assert!(
            delivered_all,
            "every event in the promoted table is delivered\n{}",
            self.logs(logs)
        );
    }
}

/// The `server_version_num` (major × 10000) of the programs the clusters run: whether failover
/// slots exist.
fn installed_version() -> i32 {
    let out = std::process::Command::new(common::private::postgres_bin().join("postgres"))
        .arg("--version")
        .output()
        .expect("postgres --version");
    // "postgres (PostgreSQL) 18.6"
    let text = String::from_utf8_lossy(&out.stdout);
    let major: i32 = text
        .split_whitespace()
        .nth(2)
        .and_then(|v| v.split('.').next())
        .and_then(|m| m.parse().ok())
        .unwrap_or_else(|| panic!("a version in {text:?}"));
    major * 10_000
}

/// `pgoutbox slot create` for `config`; what it said.
fn slot_create(config: &Path) -> String {
    let (code, _, stderr) = run(&[
        "slot",
        "create",
        "--config",
        config.to_str().expect("utf-8"),
    ]);
    assert_eq!(code, 0, "{stderr}");
    stderr
}

/// Stops relay processes.
fn kill(relays: &mut [std::process::Child]) {
    for relay in relays {
        relay.kill().ok();
        relay.wait().ok();
    }
}

/// Waits until `count` events are delivered.
async fn delivering(rx: &Receiver, count: usize) {
    assert!(
        wait_for(Duration::from_secs(60), || async {
            rx.delivered_ids().len() >= count
        })
        .await,
        "the relays deliver from the primary"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poll_relays_given_both_hosts_deliver_every_committed_event_across_a_promotion() {
    let mut pair = Pair::start().await;
    let config = write_config(pair.dir.path(), &pair.config("poll", ""));
    // Two relays, as operators run them: they share the work and both follow the failover.
    let mut relays = vec![
        spawn_relay(pair.dir.path(), &config, "a"),
        spawn_relay(pair.dir.path(), &config, "b"),
    ];
    let (stop, producer) = pair.produce();
    delivering(&pair.rx, 50).await;
    let promoted = pair.fail_over();
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.store(true, Ordering::SeqCst);
    let written = producer.await.expect("producer");
    pair.check("poll, two relays", &written, promoted, &["a", "b"])
        .await;
    kill(&mut relays);
    let logs = pair.logs(&["a", "b"]);
    assert!(
        logs.contains("new sessions go to this host"),
        "the relays say where they went\n{logs}"
    );
}

/// WAL mode across a promotion (PostgreSQL 17 and later: failover slots; `.ci/run` runs this on
/// 18). `slot create` makes a failover slot, the standby keeps a synced copy, and relays given
/// both hosts resume on the promoted server from the copy's position.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_relays_resume_on_the_promoted_standby_from_the_synced_failover_slot() {
    let version = installed_version();
    if version < 170_000 {
        eprintln!("skipped: failover slots need PostgreSQL 17 or later, this is {version} (.ci/run runs this test on 18)");
        return;
    }
    let mut pair = Pair::start().await;
    let text = pair.config("wal", "");
    let parsed = parse_config(&text);
    let slot = pgoutbox::sources::wal::slot::Names::of(&parsed.wal, &parsed.table).slot;
    let config = write_config(pair.dir.path(), &text);
    let stderr = slot_create(&config);
    assert!(stderr.contains("failover slot"), "{stderr}");
    let mut relays = vec![
        spawn_relay(pair.dir.path(), &config, "a"),
        spawn_relay(pair.dir.path(), &config, "b"),
    ];
    let (stop, producer) = pair.produce();
    delivering(&pair.rx, 50).await;
    // The copy turns from temporary to persistent once the primary's slot has moved past where
    // the standby started it: only then does it survive a promotion.
    let synced = format!(
        "SELECT count(*) FROM pg_replication_slots WHERE slot_name = '{slot}' AND synced AND NOT temporary"
    );
    assert!(
        wait_for(Duration::from_secs(90), || async {
            pair.standby.psql(&synced) == "1"
        })
        .await,
        "the standby has the slot: {}",
        pair.standby.psql("SELECT string_agg(format('%s synced=%s temporary=%s', slot_name, synced, temporary), '; ') FROM pg_replication_slots")
    );
    let promoted = pair.fail_over();
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.store(true, Ordering::SeqCst);
    let written = producer.await.expect("producer");
    pair.check(
        &format!("WAL, PostgreSQL {}, two relays", version / 10_000),
        &written,
        promoted,
        &["a", "b"],
    )
    .await;
    kill(&mut relays);
}

/// WAL mode across a promotion before PostgreSQL 17 (no failover slots): the promoted server has
/// no slot. The relay says so in one line and a metric, and keeps looking; a polling relay
/// delivers the rows (here every event is a row: `emit()` events past the slot's confirmed
/// position would be lost, as docs/operations.md says).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_failover_slots_a_wal_relay_names_the_lost_slot_and_a_poll_relay_takes_the_rows() {
    let version = installed_version();
    if version >= 170_000 {
        eprintln!("skipped: PostgreSQL {version} has failover slots (the test above)");
        return;
    }
    let mut pair = Pair::start().await;
    let metrics_port = common::private::free_port();
    let text = pair.config(
        "wal",
        &format!("[observability]\nlisten = \"127.0.0.1:{metrics_port}\"\n"),
    );
    let config = write_config(pair.dir.path(), &text);
    slot_create(&config);
    let mut relays = vec![spawn_relay(pair.dir.path(), &config, "wal")];
    let (stop, producer) = pair.produce();
    delivering(&pair.rx, 50).await;
    let promoted = pair.fail_over();
    let said = "does not exist";
    assert!(
        wait_for(Duration::from_secs(60), || async {
            pair.logs(&["wal"]).contains(said)
        })
        .await,
        "the WAL relay names the missing slot; its log's last lines:\n{}",
        last_lines(&pair.logs(&["wal"]), 80)
    );
    let metrics = format!("http://127.0.0.1:{metrics_port}/metrics");
    assert!(
        wait_for(Duration::from_secs(30), || async {
            let text = match reqwest::get(&metrics).await {
                Ok(response) => response.text().await.unwrap_or_default(),
                Err(_) => String::new(),
            };
            text.contains("pgoutbox_wal_session_ends_total{reason=\"missing\"}")
        })
        .await,
        "a metric counts it"
    );
    let poll = pair.dir.path().join("poll.toml");
    std::fs::write(&poll, pair.config("poll", "")).expect("write poll.toml");
    relays.push(spawn_relay(pair.dir.path(), &poll, "poll"));
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.store(true, Ordering::SeqCst);
    let written = producer.await.expect("producer");
    pair.check(
        &format!(
            "WAL without failover slots, PostgreSQL {}, a poll relay takes over",
            version / 10_000
        ),
        &written,
        promoted,
        &["wal", "poll"],
    )
    .await;
    let wal_log = pair.logs(&["wal"]);
    kill(&mut relays);
    assert_eq!(
        wal_log.matches(said).count(),
        1,
        "said once, then looked for quietly\n{wal_log}"
    );
}

/// A relay never writes through a standby: given a standby's address and one where nothing
/// listens (`target_session_attrs=read-write`, the default for several hosts), it refuses at
/// start and names each host's reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_refuses_a_standby_and_names_it() {
    let pair = Pair::start().await;
    let url = format!(
        "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/{}",
        pair.standby.port,
        closed_port(),
        pair.db.name
    );
    let config = write_config(
        pair.dir.path(),
        &pair.config("poll", "").replace(&pair.both, &url),
    );
    let (code, _, stderr) = run(&[
        "relay",
        "--once",
        "--config",
        config.to_str().expect("utf-8"),
    ]);
    assert_ne!(code, 0, "{stderr}");
    assert!(stderr.contains("read-only"), "{stderr}");
    assert!(
        stderr.contains(&format!("127.0.0.1:{}", pair.standby.port)),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// The last `n` lines of `log` without the per-batch debug lines, so that a failure shows what
/// the relay did last (a CI report keeps only the start and the end of a long message).
fn last_lines(log: &str, n: usize) -> String {
    let lines: Vec<&str> = log
        .lines()
        .filter(|line| !line.contains("batch settled"))
        .collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}
