//! The chaos suite: proves "a committed event is never lost, a rolled-back one is never sent".
//!
//! Producers commit keyed and unkeyed events and roll others back; 4 `pgoutbox relay` processes
//! fan them out to three destinations, each a real HTTP receiver of its own: `ordered` (per-key
//! order, ~10 % of requests fail), `flaky` (~20 % fail, some stall past the timeout, and for part
//! of the run every request is answered after 2 s) and `steady`. The suite SIGKILLs random relays
//! and restarts them and restarts PostgreSQL once. At the end it checks, per destination, from its
//! receiver's log and the table: lost = 0, phantom = 0, no event of a topic it did not ask for,
//! order violations = 0 on the ordered one, and prints the duplicates with their causes.
//!
//! The same suite runs with `source = "wal"` (`bounded_chaos_run_wal`): the relays read a logical
//! replication slot of a throwaway `wal_level = logical` cluster (one streams, three wait on
//! standby and take over when it is killed), and that cluster is the one restarted.
//!
//! The bounded run (20k events) is part of the test suite. The long run is opt-in:
//! `CHAOS_EVENTS=1000000 CHAOS_DURATION=30m cargo nextest run --release --test chaos --run-ignored only`;
//! with a duration, producers spread the events evenly over it.
//! `CHAOS_SEED=N` replays a run (the seed is printed). `CHAOS_KILL_EVERY=5s` sets the mean time
//! between relay kills (default 1.25 s). The flaky destination's slow phase starts once a quarter of
//! the events (or of the duration) is produced and lasts `CHAOS_SLOW_FOR` (default 10 s, or a tenth of the duration).

mod common;

use std::collections::{HashMap, HashSet};
use std::process::Child;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering as AtomicOrdering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use uuid::Uuid;

struct Settings {
    events: usize,
    duration: Option<Duration>,
    seed: u64,
    /// Mean time between relay kills (a kill every 0.5× to 1.5× of it).
    kill_every: Duration,
    /// How long the unordered destination stays slow.
    slow_for: Duration,
}

impl Settings {
    fn from_env(default_events: usize) -> Self {
        let events = std::env::var("CHAOS_EVENTS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default_events);
        let duration = std::env::var("CHAOS_DURATION")
            .ok()
            .and_then(|v| humantime::parse_duration(&v).ok());
        let seed = std::env::var("CHAOS_SEED")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| rand::thread_rng().gen());
        let kill_every = std::env::var("CHAOS_KILL_EVERY")
            .ok()
            .and_then(|v| humantime::parse_duration(&v).ok())
            .unwrap_or(Duration::from_millis(1250));
        let slow_for = std::env::var("CHAOS_SLOW_FOR")
            .ok()
            .and_then(|v| humantime::parse_duration(&v).ok())
            .unwrap_or_else(|| duration.map_or(Duration::from_secs(10), |d| d / 10));
        Self {
            events,
            duration,
            seed,
            kill_every,
            slow_for,
        }
    }
}

/// What producers committed and rolled back; commits whose outcome is unknown (the connection
/// broke during COMMIT) are settled at the end by looking for the row.
#[derive(Default)]
struct Ledger {
    committed: HashSet<Uuid>,
    rolled_back: HashSet<Uuid>,
    unknown: HashSet<Uuid>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bounded_chaos_run() {
    chaos(Settings::from_env(20_000), Source::Poll).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bounded_chaos_run_wal() {
    chaos(Settings::from_env(20_000), Source::Wal).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long run: CHAOS_EVENTS=1000000 CHAOS_DURATION=30m cargo nextest run --release --test chaos --run-ignored only"]
async fn long_chaos_run() {
    chaos(Settings::from_env(1_000_000), Source::Poll).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long run: CHAOS_EVENTS=1000000 CHAOS_DURATION=30m cargo nextest run --release --test chaos --run-ignored only"]
async fn long_chaos_run_wal() {
    chaos(Settings::from_env(1_000_000), Source::Wal).await;
}

/// Where the relays read events from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    /// Claims from the table, on the shared server.
    Poll,
    /// A logical replication slot, on a throwaway `wal_level = logical` cluster.
    Wal,
}

/// One destination of the run: its receiver and the requests it stalled.
struct Dest {
    name: &'static str,
    rx: Receiver,
    stalls: Arc<AtomicU64>,
    stalled_ids: Arc<Mutex<HashSet<String>>>,
    /// Whether it takes a topic (its `topics`).
    takes: fn(&str) -> bool,
    ordered: bool,
}

impl Dest {
    /// A receiver failing `fail` of requests with 503 and stalling `stall` of them 0.5 s past
    /// `timeout` (received: the consumer got it, the answer was lost); with `slow`, every request
    /// in the slow phase waits [`SLOW_ANSWER`], then is answered 200.
    async fn start(
        name: &'static str,
        seed: u64,
        (fail, stall, timeout): (f64, f64, Duration),
        slow: Option<(Arc<SlowPhase>, Arc<AtomicU64>)>,
        takes: fn(&str) -> bool,
        ordered: bool,
    ) -> Self {
        let rng = Mutex::new(StdRng::seed_from_u64(seed));
        let stalls = Arc::new(AtomicU64::new(0));
        let stalled_ids: Arc<Mutex<HashSet<String>>> = Arc::default();
        let (s, sid) = (stalls.clone(), stalled_ids.clone());
        let rx = Receiver::with(move |req| {
            if let Some((phase, slowed)) = &slow {
                if phase.active() {
                    slowed.fetch_add(1, AtomicOrdering::Relaxed);
                    return Reply::ok().delay(SLOW_ANSWER);
                }
            }
            let roll: f64 = rng.lock().expect("rng").gen();
            if roll < fail {
                Reply::status(503)
            } else if roll < fail + stall {
                s.fetch_add(1, AtomicOrdering::Relaxed);
                sid.lock().expect("stalled").insert(req.id.clone());
                Reply::ok().delay(timeout + Duration::from_millis(500))
            } else {
                Reply::ok()
            }
        })
        .await;
        Self {
            name,
            rx,
            stalls,
            stalled_ids,
            takes,
            ordered,
        }
    }
}

/// One destination's verdict.
#[derive(Debug, Default)]
struct Verdict {
    lost: usize,
    phantom: usize,
    wrong_topic: usize,
    order_violations: usize,
    delivered: usize,
    duplicates: usize,
    from_stalls: usize,
}

async fn chaos(settings: Settings, source: Source) {
    println!(
        "chaos: seed {} (CHAOS_SEED={} replays it), {} events, source {source:?}",
        settings.seed, settings.seed, settings.events
    );
    let mut rng = StdRng::seed_from_u64(settings.seed);
    let mut logical = (source == Source::Wal).then(|| common::logical::LogicalPg::start(&[]));
    let db = match &logical {
        Some(pg) => TestDb::migrated_on(&pg.server_url()).await,
        None => TestDb::migrated().await,
    };
    let wal_settings = match source {
        Source::Poll => String::new(),
        Source::Wal => {
            let config = parse_config(&format!("database_url = \"{}\"", db.url));
            let names = pgoutbox::sources::wal::slot::Names::of(&config.wal, &config.table);
            pgoutbox::sources::wal::slot::create(&db.pool, &config.table, &names)
                .await
                .expect("create the slot");
            // Confirmed often, so that a killed relay's successor re-reads little.
            "source = \"wal\"\n[wal]\nstatus_interval = \"100ms\"\nstandby_retry = \"200ms\"\n"
                .to_owned()
        }
    };

    // Three destinations, each with its own receiver and delivery state: `ordered` (per-key order,
    // 10 % 503s, 1 % stalls) takes the keyed events, `flaky` (20 % 503s, 2 % stalls, and a slow
    // phase) and `steady` (always 200) take everything. Every event goes to two or three of them.
    let slow = Arc::new(SlowPhase::default());
    let slow_requests = Arc::new(AtomicU64::new(0));
    let dests = [
        Dest::start(
            "ordered",
            settings.seed ^ 0x5eed,
            (0.10, 0.01, ORDERED_TIMEOUT),
            None,
            |t| t.starts_with("ordered."),
            true,
        )
        .await,
        Dest::start(
            "flaky",
            settings.seed ^ 0xf1a4,
            (0.20, 0.02, PLAIN_TIMEOUT),
            Some((slow.clone(), slow_requests.clone())),
            |_| true,
            false,
        )
        .await,
        Dest::start(
            "steady",
            settings.seed ^ 0x57ea,
            (0.0, 0.0, PLAIN_TIMEOUT),
            None,
            |_| true,
            false,
        )
        .await,
    ];

    let dir = scratch();
    // The flaky destination answers in 2 s while slow: its timeout is above that, and its
    // concurrency covers a whole batch, so a batch waits 2 s once rather than once per round of
    // requests; publish_timeout leaves room above every destination's timeout.
    let config_text = format!(
        r#"database_url = "{url}"
{wal_settings}
[relay]
batch_size = 200
poll_interval = "50ms"
publish_timeout = "10s"

[[destinations]]
name = "ordered"
type = "webhook"
url = "{ordered}"
topics = ["ordered.*"]
ordering = "key"
timeout = "{ordered_timeout}"
retry_schedule = ["100ms", "300ms", "1s"]
max_attempts = 1000

[[destinations]]
name = "flaky"
type = "webhook"
url = "{flaky}"
topics = ["*"]
timeout = "{plain_timeout}"
concurrency = 200
retry_schedule = ["100ms", "300ms", "1s"]
max_attempts = 1000

[[destinations]]
name = "steady"
type = "webhook"
url = "{steady}"
topics = ["*"]
timeout = "{plain_timeout}"
concurrency = 200
retry_schedule = ["100ms", "300ms", "1s"]
max_attempts = 1000
"#,
        url = db.url,
        ordered = dests[0].rx.url,
        flaky = dests[1].rx.url,
        steady = dests[2].rx.url,
        ordered_timeout = humantime::format_duration(ORDERED_TIMEOUT),
        plain_timeout = humantime::format_duration(PLAIN_TIMEOUT),
    );
    let config = write_config(dir.path(), &config_text);
    let mut relays: Vec<Child> = (0..4)
        .map(|i| spawn_relay(dir.path(), &config, &format!("{i}-0")))
        .collect();

    // Producers: each owns its keys, so per-key insert order is its commit order.
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let produced = Arc::new(AtomicU64::new(0));
    let producing = Arc::new(AtomicBool::new(true));
    // (start, end) of production when a duration bounds the run.
    let deadline = settings.duration.map(|d| {
        let start = Instant::now();
        (start, start + d)
    });
    let mut producers = Vec::new();
    for p in 0..4u64 {
        let (db_url, ledger, produced, producing) = (
            db.url.clone(),
            ledger.clone(),
            produced.clone(),
            producing.clone(),
        );
        let target = settings.events as u64;
        let seed = settings.seed.wrapping_add(p + 1);
        producers.push(tokio::spawn(async move {
            produce(
                p, &db_url, seed, target, deadline, ledger, produced, producing,
            )
            .await;
        }));
    }

    // A server with autovacuum off (some test machines) would let dead index entries pile up for
    // the whole run, which no production outbox has: vacuum as autovacuum would.
    let autovacuum: String = sqlx::query_scalar("SHOW autovacuum")
        .fetch_one(&db.pool)
        .await
        .expect("show autovacuum");
    let vacuum = (autovacuum == "off").then(|| {
        println!(
            "chaos: autovacuum is off on this server; the suite vacuums the outbox every 30 s"
        );
        let pool = db.pool.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(30)).await;
                let _ = sqlx::raw_sql("VACUUM (ANALYZE) outbox, outbox_deliveries")
                    .execute(&pool)
                    .await;
            }
        })
    });

    // Chaos: kill a random relay every 0.5–2 s and restart it; restart PostgreSQL once, mid-run;
    // make the flaky destination slow for a while from a quarter on.
    let mut kills = 0;
    let mut pg_restarts = 0;
    let started = Instant::now();
    // Kills go on into the drain when production was quick: at least MIN_KILLS of them.
    const MIN_KILLS: usize = 10;
    let mut last_progress = Instant::now();
    while producing.load(AtomicOrdering::Relaxed) || kills < MIN_KILLS {
        if last_progress.elapsed() >= Duration::from_secs(30) {
            last_progress = Instant::now();
            let pending = pending(&db).await.unwrap_or(-1);
            println!(
                "chaos: {:.0?} produced {} pending {pending} requests {:?} kills {kills} pg_restarts {pg_restarts}",
                started.elapsed(),
                produced.load(AtomicOrdering::Relaxed),
                dests.iter().map(|d| d.rx.count()).collect::<Vec<_>>(),
            );
        }
        tokio::time::sleep(settings.kill_every.mul_f64(rng.gen_range(0.5..1.5))).await;
        let victim = rng.gen_range(0..relays.len());
        let _ = relays[victim].kill();
        let _ = relays[victim].wait();
        kills += 1;
        relays[victim] = spawn_relay(dir.path(), &config, &format!("{victim}-{kills}"));
        // Halfway by events, or by time when a duration bounds the run.
        let halfway = produced.load(AtomicOrdering::Relaxed) as usize >= settings.events / 2
            || settings
                .duration
                .is_some_and(|d| started.elapsed() >= d / 2);
        if pg_restarts == 0 && halfway {
            let restarted = match &mut logical {
                Some(pg) => {
                    pg.restart();
                    println!("chaos: the logical cluster restarted");
                    true
                }
                None => restart_postgres(),
            };
            if restarted {
                pg_restarts += 1;
            }
        }
        let a_quarter = produced.load(AtomicOrdering::Relaxed) as usize >= settings.events / 4
            || settings
                .duration
                .is_some_and(|d| started.elapsed() >= d / 4);
        if a_quarter && slow.start(settings.slow_for) {
            println!(
                "chaos: {:.0?} the flaky destination is slow ({SLOW_ANSWER:?} per request) for {:?}",
                started.elapsed(),
                settings.slow_for
            );
        }
    }
    for p in producers {
        p.await.expect("producer");
    }
    let production_time = started.elapsed();

    // Let the relays finish the backlog (retries included). A long run under this much chaos builds
    // a backlog (every stalled request holds its batch for its destination's timeout, every slow
    // one for 2 s): allow as long as production took, and at least 4 minutes.
    let drain_limit = production_time.max(Duration::from_secs(240));
    println!(
        "chaos: production over after {production_time:.1?}; draining (limit {drain_limit:.0?})"
    );
    let drained = wait_for(drain_limit, || async {
        pending(&db).await.is_ok_and(|n| n == 0)
    })
    .await;
    if let Some(vacuum) = vacuum {
        vacuum.abort();
    }
    for relay in &relays {
        signal(relay, libc::SIGTERM);
    }
    for relay in &mut relays {
        let _ = relay.wait();
    }

    // Settle the unknown commits by looking for their rows.
    let mut ledger = std::mem::take(&mut *ledger.lock().expect("ledger"));
    let unknown: Vec<Uuid> = ledger.unknown.drain().collect();
    let present: HashSet<Uuid> = sqlx::query_scalar("SELECT id FROM outbox WHERE id = ANY($1)")
        .bind(&unknown)
        .fetch_all(&db.pool)
        .await
        .expect("unknown ids")
        .into_iter()
        .collect();
    for id in unknown {
        if present.contains(&id) {
            ledger.committed.insert(id);
        } else {
            ledger.rolled_back.insert(id);
        }
    }
    // Every committed row is still in the table (retention keeps published rows): its topic says
    // which destinations must have it.
    let topic_of: HashMap<Uuid, String> =
        sqlx::query_as::<_, (Uuid, String)>("SELECT id, topic FROM outbox")
            .fetch_all(&db.pool)
            .await
            .expect("topics")
            .into_iter()
            .collect();

    // The verdict, per destination, from each receiver's log.
    // A crash can re-send at most what was in flight: every batch of every relay it hit (2
    // workers and the deliveries loop; a PostgreSQL restart hits all 4 relays), once per later
    // attempt of those events.
    let crash_bound = (kills * 3 + pg_restarts * 12) * 200 * 3;
    let mut verdicts = Vec::new();
    for d in &dests {
        let log = d.rx.delivered();
        let delivered: HashSet<Uuid> = log.iter().filter_map(|r| r.id.parse().ok()).collect();
        let mut v = Verdict {
            lost: ledger
                .committed
                .iter()
                .filter(|id| topic_of.get(id).is_some_and(|t| (d.takes)(t)))
                .filter(|id| !delivered.contains(id))
                .count(),
            phantom: ledger.rolled_back.intersection(&delivered).count(),
            wrong_topic: delivered
                .iter()
                .filter(|id| topic_of.get(id).is_some_and(|t| !(d.takes)(t)))
                .count(),
            delivered: delivered.len(),
            ..Verdict::default()
        };
        let mut seen = HashSet::new();
        let mut last_n: HashMap<String, i64> = HashMap::new();
        for r in &log {
            if !seen.insert(r.id.clone()) || !d.ordered {
                continue;
            }
            let body = r.json();
            let key = body["key"].as_str().unwrap_or_default().to_owned();
            let n = body["data"]["n"].as_i64().unwrap_or(-1);
            if let Some(prev) = last_n.insert(key, n) {
                if n < prev {
                    v.order_violations += 1;
                }
            }
        }
        v.duplicates = log.len() - seen.len();
        // An event whose delivery stalled past the timeout was sent again by design; every other
        // duplicate comes from a batch in flight when a relay or PostgreSQL died.
        let stalled_ids = d.stalled_ids.lock().expect("stalled").clone();
        let mut requests: HashMap<&str, usize> = HashMap::new();
        for r in &log {
            *requests.entry(r.id.as_str()).or_default() += 1;
        }
        v.from_stalls = requests
            .iter()
            .filter(|(id, _)| stalled_ids.contains(**id))
            .map(|(_, n)| n - 1)
            .sum();
        println!(
            "chaos destination {}: delivered {} lost {} phantom {} wrong_topic {} order_violations {} duplicates {} ({:.2} %; {} from {} stalled requests, {} from crashes, bound {crash_bound})",
            d.name,
            v.delivered,
            v.lost,
            v.phantom,
            v.wrong_topic,
            v.order_violations,
            v.duplicates,
            v.duplicates as f64 / v.delivered.max(1) as f64 * 100.0,
            v.from_stalls,
            d.stalls.load(AtomicOrdering::Relaxed),
            v.duplicates - v.from_stalls,
        );
        verdicts.push(v);
    }
    let unpublished = pending(&db).await.unwrap_or(-1);
    let sum = |f: fn(&Verdict) -> usize| verdicts.iter().map(f).sum::<usize>();
    println!(
        "chaos summary: seed {} events {} committed {} rolled_back {} lost {} phantom {} order_violations {} duplicates {} kills {} pg_restarts {} slow_requests {} produced_in {:.1?} unpublished {}",
        settings.seed,
        ledger.committed.len() + ledger.rolled_back.len(),
        ledger.committed.len(),
        ledger.rolled_back.len(),
        sum(|v| v.lost),
        sum(|v| v.phantom),
        sum(|v| v.order_violations),
        sum(|v| v.duplicates),
        kills,
        pg_restarts,
        slow_requests.load(AtomicOrdering::Relaxed),
        production_time,
        unpublished
    );
    assert!(
        drained,
        "backlog not drained within 4 minutes after production"
    );
    for (d, v) in dests.iter().zip(&verdicts) {
        assert_eq!(v.lost, 0, "{}: lost events", d.name);
        assert_eq!(v.phantom, 0, "{}: phantom events", d.name);
        assert_eq!(
            v.wrong_topic, 0,
            "{}: events of a topic it did not ask for",
            d.name
        );
        assert_eq!(v.order_violations, 0, "{}: order violations", d.name);
        assert!(
            v.duplicates - v.from_stalls <= crash_bound,
            "{}: more duplicates than the crashes explain",
            d.name
        );
    }
    assert!(!ledger.rolled_back.is_empty() && ledger.committed.len() >= settings.events * 8 / 10);
    assert!(kills > 0);
}

/// Event rows not yet settled plus undelivered pairs: what is left to deliver.
async fn pending(db: &TestDb) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM outbox WHERE published_at IS NULL)
              + (SELECT count(*) FROM outbox_deliveries)",
    )
    .fetch_one(&db.pool)
    .await
}

/// Request timeout of the ordered destination; its stalled requests answer 0.5 s after it.
const ORDERED_TIMEOUT: Duration = Duration::from_secs(1);
/// Request timeout of the unordered destination: above its slow answers.
const PLAIN_TIMEOUT: Duration = Duration::from_secs(3);
/// How long the unordered destination takes per request while slow.
const SLOW_ANSWER: Duration = Duration::from_secs(2);

/// The window in which the unordered destination is slow: set once, by the chaos loop.
#[derive(Default)]
struct SlowPhase(std::sync::OnceLock<(Instant, Instant)>);

impl SlowPhase {
    /// Starts the window now, for `span`; false when it was started before.
    fn start(&self, span: Duration) -> bool {
        let now = Instant::now();
        self.0.set((now, now + span)).is_ok()
    }

    /// Whether a request arriving now is in the window.
    fn active(&self) -> bool {
        self.0
            .get()
            .is_some_and(|(from, to)| (*from..*to).contains(&Instant::now()))
    }
}

/// One producer: transactions of 1–5 events, ~10 % rolled back, keys owned by this producer.
#[allow(clippy::too_many_arguments)]
async fn produce(
    p: u64,
    db_url: &str,
    seed: u64,
    target: u64,
    deadline: Option<(Instant, Instant)>,
    ledger: Arc<Mutex<Ledger>>,
    produced: Arc<AtomicU64>,
    producing: Arc<AtomicBool>,
) {
    let mut rng = StdRng::seed_from_u64(seed);
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(30))
        .connect(db_url)
        .await
        .expect("producer pool");
    let outbox = pgoutbox::Outbox::default();
    let mut next_n: HashMap<String, i64> = HashMap::new();
    loop {
        let total = produced.load(AtomicOrdering::Relaxed);
        let out_of_time = deadline.is_some_and(|(_, end)| Instant::now() > end);
        if total >= target || out_of_time {
            producing.store(false, AtomicOrdering::Relaxed);
            return;
        }
        // A run bounded by time spreads its events evenly over it (all producers together).
        if let Some((start, end)) = deadline {
            let rate = target as f64 / (end - start).as_secs_f64();
            let due = start + Duration::from_secs_f64(total as f64 / rate);
            tokio::time::sleep_until(due.into()).await;
        }
        let size = rng.gen_range(1..=5);
        let rollback = rng.gen_bool(0.1);
        let mut events = Vec::new();
        let mut keys_used = Vec::new();
        for _ in 0..size {
            if rng.gen_bool(0.7) {
                let key = format!("p{p}-k{}", rng.gen_range(0..250));
                let n = next_n.get(&key).copied().unwrap_or(0)
                    + keys_used.iter().filter(|k| **k == key).count() as i64;
                events.push(
                    pgoutbox::Event::new("ordered.changed", &serde_json::json!({ "n": n, "p": p }))
                        .expect("json")
                        .key(key.clone()),
                );
                keys_used.push(key);
            } else {
                events.push(
                    pgoutbox::Event::new("plain.happened", &serde_json::json!({ "p": p }))
                        .expect("json"),
                );
            }
        }
        let attempt = async {
            let mut tx = pool.begin().await?;
            let ids = outbox.enqueue_many(&mut tx, &events).await?;
            Ok::<_, pgoutbox::Error>((tx, ids))
        }
        .await;
        let Ok((tx, ids)) = attempt else {
            // The database is restarting: nothing was committed; try again shortly.
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        };
        if rollback {
            let _ = tx.rollback().await;
            ledger.lock().expect("ledger").rolled_back.extend(ids);
            continue;
        }
        match tx.commit().await {
            Ok(()) => {
                ledger.lock().expect("ledger").committed.extend(ids);
                for key in keys_used {
                    *next_n.entry(key).or_insert(0) += 1;
                }
            }
            Err(_) => {
                // COMMIT's fate is unknown: decided at the end by looking for the rows. A key's
                // counter moves on either way: a gap in n is not an order violation.
                ledger.lock().expect("ledger").unknown.extend(ids);
                for key in keys_used {
                    *next_n.entry(key).or_insert(0) += 1;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        produced.fetch_add(size as u64, AtomicOrdering::Relaxed);
    }
}

/// Restarts the local PostgreSQL cluster; false when this machine cannot (no pg_ctlcluster).
fn restart_postgres() -> bool {
    let Ok(versions) = std::fs::read_dir("/etc/postgresql") else {
        return false;
    };
    let Some(version) = versions
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .next()
    else {
        return false;
    };
    let status = std::process::Command::new("pg_ctlcluster")
        .args(["--skip-systemctl-redirect", &version, "main", "restart"])
        .status();
    let ok = status.is_ok_and(|s| s.success());
    println!(
        "chaos: PostgreSQL {version} restart {}",
        if ok { "done" } else { "FAILED" }
    );
    ok
}
