//! The WAL source (`source = "wal"`): events read from a logical replication slot, in commit
//! order. Each test runs its own throwaway `wal_level = logical` cluster ([`LogicalPg`]), real
//! HTTP receivers and real relays (in process, or the binary where a process must die). What is
//! asserted is behaviour: what arrived, in which order, what the slot confirmed; the timeouts only
//! guard against hangs.

mod common;

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::process::Child;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::logical::LogicalPg;
use common::*;
use pgoutbox::sources::wal::slot::{self, Names};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;

/// The default slot name of the default outbox table.
const SLOT: &str = "pgoutbox_outbox";

/// Hang guard of the waits (never a property: the tests run in parallel on 2 cores).
const GUARD: Duration = Duration::from_secs(90);

/// A `[[destinations]]` webhook block.
fn webhook(name: &str, url: &str, extra: &str) -> String {
    format!("\n[[destinations]]\nname = \"{name}\"\ntype = \"webhook\"\nurl = \"{url}\"\n{extra}\n")
}

/// A `source = "wal"` relay config for `db`: `wal` are extra `[wal]` keys, then the destinations.
fn wal_config(db: &TestDb, wal: &str, destinations: &[String]) -> String {
    format!(
        "database_url = \"{}\"\nsource = \"wal\"\n\n[relay]\npoll_interval = \"50ms\"\n\n[wal]\nstandby_retry = \"200ms\"\n{wal}\n{}",
        db.url,
        destinations.concat()
    )
}

/// Creates the publication and the slot for `config_text` (what `pgoutbox slot create` does).
async fn create_slot(db: &TestDb, config_text: &str) {
    let config = parse_config(config_text);
    let names = Names::of(&config.wal, &config.table);
    assert_eq!(names.slot, SLOT);
    let created = slot::create(&db.pool, &config.table, &names)
        .await
        .expect("create the slot");
    assert!(created.slot_at.is_some(), "a new slot: {created:?}");
}

/// A pool of its own for an in-process relay (the test's writers use `db.pool`).
async fn own_pool(db: &TestDb) -> PgPool {
    PgPoolOptions::new()
        .max_connections(4)
        .connect(&db.url)
        .await
        .expect("relay pool")
}

/// The server's current WAL position.
async fn current_lsn(db: &TestDb) -> String {
    sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
        .fetch_one(&db.pool)
        .await
        .expect("current lsn")
}

/// The slot's confirmed position (`None` without a slot).
async fn confirmed(db: &TestDb) -> Option<String> {
    sqlx::query_scalar::<_, Option<String>>(
        "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
    )
    .bind(SLOT)
    .fetch_optional(&db.pool)
    .await
    .expect("slot")
    .flatten()
}

/// Whether the slot's confirmed position is at or past `lsn`.
async fn confirmed_past(db: &TestDb, lsn: &str) -> bool {
    sqlx::query_scalar::<_, Option<bool>>(
        "SELECT confirmed_flush_lsn >= $2::pg_lsn FROM pg_replication_slots WHERE slot_name = $1",
    )
    .bind(SLOT)
    .bind(lsn)
    .fetch_optional(&db.pool)
    .await
    .expect("slot")
    .flatten()
    .unwrap_or(false)
}

/// Whether a session streams the slot now.
async fn slot_active(db: &TestDb) -> bool {
    sqlx::query_scalar::<_, bool>("SELECT active FROM pg_replication_slots WHERE slot_name = $1")
        .bind(SLOT)
        .fetch_optional(&db.pool)
        .await
        .expect("slot")
        .unwrap_or(false)
}

/// Writes `n` outbox rows and `emits` `outbox_emit()` events of `topic` in one transaction;
/// returns their ids (rows first).
async fn write(db: &TestDb, n: usize, emits: usize, topic: &str) -> Vec<String> {
    let mut tx = db.pool.begin().await.expect("begin");
    let mut ids: Vec<String> = sqlx::query_scalar(
        "INSERT INTO outbox (topic, key, payload)
         SELECT $1, 'k' || (g % 7), jsonb_build_object('n', g) FROM generate_series(1, $2) g
         ORDER BY g
         RETURNING id::text",
    )
    .bind(topic)
    .bind(n as i32)
    .fetch_all(&mut *tx)
    .await
    .expect("insert");
    let emitted: Vec<String> = sqlx::query_scalar(
        "SELECT outbox_emit($1, jsonb_build_object('m', g), 'k' || (g % 7))::text
         FROM generate_series(1, $2) g",
    )
    .bind(topic)
    .bind(emits as i32)
    .fetch_all(&mut *tx)
    .await
    .expect("emit");
    tx.commit().await.expect("commit");
    ids.extend(emitted);
    ids
}

/// How many requests the receiver got per id (any status).
fn requests_per_id(rx: &Receiver) -> HashMap<String, usize> {
    let mut per_id = HashMap::new();
    for r in rx.log() {
        *per_id.entry(r.id).or_default() += 1;
    }
    per_id
}

/// Whether the receiver accepted every id of `ids`.
fn has_all(rx: &Receiver, ids: &[String]) -> bool {
    let delivered = rx.delivered_ids();
    ids.iter().all(|id| delivered.contains(id))
}

/// The relay's log so far.
fn relay_log(dir: &Path, tag: &str) -> String {
    std::fs::read_to_string(dir.join(format!("relay-{tag}.log"))).unwrap_or_default()
}

/// Whether the relay `tag` streams the slot (its log says so).
fn streams(dir: &Path, tag: &str) -> bool {
    relay_log(dir, tag).contains("streaming the replication slot")
}

/// SIGTERM, then the exit status (killed past the hang guard).
async fn terminate(child: &mut Child) -> Option<std::process::ExitStatus> {
    signal(child, libc::SIGTERM);
    exit_status(child, GUARD).await
}

// ---------------------------------------------------------------------------------------------
// 1. Commit order, rollbacks.

/// Keys the writers share.
const KEYS: [&str; 3] = ["k0", "k1", "k2"];

/// What the writers committed (with each transaction's commit rank) and rolled back.
#[derive(Default)]
struct Ledger {
    /// Transactions begun so far (a transaction's begin rank is its first write's).
    begun: u64,
    committed: Vec<Committed>,
    rolled_back: HashSet<String>,
}

/// One committed transaction.
#[derive(Clone)]
struct Committed {
    /// Its place in commit order.
    rank: i64,
    /// Its place in begin order.
    begun: u64,
    /// Its events' (key, id), in statement order.
    events: Vec<(String, String)>,
}

/// One writer: `txs` transactions of one to three keyed events (rows and `outbox_emit()`
/// messages), pausing inside each so that transactions of other writers begun later commit
/// first; about a quarter roll back. A committing transaction takes a rank from a sequence under
/// an advisory lock held until its commit, so ranks are the order of the commit records.
async fn writer(pool: PgPool, seed: u64, txs: usize, ledger: Arc<Mutex<Ledger>>) {
    let mut rng = StdRng::seed_from_u64(seed);
    for t in 0..txs {
        let mut tx = pool.begin().await.expect("begin");
        let mut events = Vec::new();
        let mut begun = 0;
        for i in 0..rng.gen_range(1..=3) {
            let key = KEYS[rng.gen_range(0..KEYS.len())];
            let payload = serde_json::json!({"seed": seed, "t": t, "i": i}).to_string();
            let id: String = if rng.gen_bool(0.5) {
                sqlx::query_scalar(
                    "INSERT INTO outbox (topic, key, payload) VALUES ('order.updated', $1, $2::jsonb)
                     RETURNING id::text",
                )
            } else {
                sqlx::query_scalar("SELECT outbox_emit('order.emitted', $2::jsonb, $1)::text")
            }
            .bind(key)
            .bind(&payload)
            .fetch_one(&mut *tx)
            .await
            .expect("write an event");
            if i == 0 {
                let mut ledger = ledger.lock().expect("ledger");
                ledger.begun += 1;
                begun = ledger.begun;
            }
            events.push((key.to_owned(), id));
            let pause = f64::from(rng.gen_range(0..20u32)) / 1000.0;
            sqlx::query("SELECT pg_sleep($1)")
                .bind(pause)
                .execute(&mut *tx)
                .await
                .expect("sleep");
        }
        if rng.gen_bool(0.25) {
            tx.rollback().await.expect("rollback");
            let mut ledger = ledger.lock().expect("ledger");
            ledger
                .rolled_back
                .extend(events.into_iter().map(|(_, id)| id));
        } else {
            sqlx::query("SELECT pg_advisory_xact_lock(20240601)")
                .execute(&mut *tx)
                .await
                .expect("commit lock");
            let rank: i64 = sqlx::query_scalar("SELECT nextval('commit_rank')")
                .fetch_one(&mut *tx)
                .await
                .expect("rank");
            tx.commit().await.expect("commit");
            ledger.lock().expect("ledger").committed.push(Committed {
                rank,
                begun,
                events,
            });
        }
    }
}

/// Concurrent writers interleave transactions on the same keys, some roll back: every committed
/// event (row or `outbox_emit()`) arrives, no rolled-back one does, and per key the arrival order
/// is the commit order (statement order within a transaction).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn committed_events_arrive_in_commit_order_rolled_back_never() {
    let pg = LogicalPg::start(&[]);
    let db = TestDb::migrated_on(&pg.server_url()).await;
    sqlx::query("CREATE SEQUENCE commit_rank")
        .execute(&db.pool)
        .await
        .expect("sequence");
    let rx = Receiver::start().await;
    let text = wal_config(&db, "", &[webhook("hooks", &rx.url, "ordering = \"key\"")]);
    create_slot(&db, &text).await;
    let relay = Running::on(own_pool(&db).await, &text);

    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let seed: u64 = rand::thread_rng().gen();
    println!("writers' seed {seed}");
    let writers: Vec<_> = (0..4)
        .map(|w| tokio::spawn(writer(db.pool.clone(), seed ^ w, 15, ledger.clone())))
        .collect();
    for w in writers {
        w.await.expect("writer");
    }
    let written = current_lsn(&db).await;
    let (mut committed, rolled_back) = {
        let ledger = ledger.lock().expect("ledger");
        (ledger.committed.clone(), ledger.rolled_back.clone())
    };
    committed.sort_by_key(|c| c.rank);
    let committed_ids: Vec<String> = committed
        .iter()
        .flat_map(|c| c.events.iter().map(|(_, id)| id.clone()))
        .collect();
    // Transactions that began before one that committed earlier: the writers did interleave.
    let overtaken = committed
        .iter()
        .enumerate()
        .filter(|(i, c)| committed[i + 1..].iter().any(|later| later.begun < c.begun))
        .count();
    // Everything committed arrived and the slot moved past the last write: a rolled-back event
    // would have arrived by now.
    let done = wait_for(GUARD, || async {
        has_all(&rx, &committed_ids) && confirmed_past(&db, &written).await
    })
    .await;
    relay.stop().await;
    assert!(
        done,
        "every committed event arrived and the slot confirmed past the writes"
    );

    let key_of: HashMap<&str, &str> = committed
        .iter()
        .flat_map(|c| c.events.iter().map(|(k, id)| (id.as_str(), k.as_str())))
        .collect();
    let mut expected: HashMap<&str, Vec<&str>> = HashMap::new();
    for c in &committed {
        for (key, id) in &c.events {
            expected.entry(key.as_str()).or_default().push(id.as_str());
        }
    }
    let log = rx.log();
    let mut seen = HashSet::new();
    let mut arrived: HashMap<&str, Vec<&str>> = HashMap::new();
    let mut phantoms = Vec::new();
    for r in &log {
        if !seen.insert(r.id.as_str()) {
            continue;
        }
        match key_of.get(r.id.as_str()) {
            Some(key) => arrived.entry(key).or_default().push(r.id.as_str()),
            None => phantoms.push(r.id.clone()),
        }
    }
    let rolled_back_arrived: Vec<&String> = rolled_back
        .iter()
        .filter(|id| seen.contains(id.as_str()))
        .collect();
    println!(
        "{} committed events in {} transactions ({overtaken} committed before one begun earlier), {} rolled back; {} requests",
        committed_ids.len(),
        committed.len(),
        rolled_back.len(),
        log.len()
    );
    assert!(
        !rolled_back.is_empty() && committed.len() > 10,
        "the mix has both"
    );
    assert!(overtaken > 0, "commit order differs from begin order");
    let topics: HashSet<String> = log
        .iter()
        .map(|r| r.json()["type"].as_str().unwrap_or_default().to_owned())
        .collect();
    assert_eq!(
        topics,
        HashSet::from(["order.updated".to_owned(), "order.emitted".to_owned()]),
        "rows and emitted events both"
    );
    assert_eq!(
        rolled_back_arrived,
        Vec::<&String>::new(),
        "no rolled-back event arrived"
    );
    assert_eq!(
        phantoms,
        Vec::<String>::new(),
        "nothing but committed events arrived"
    );
    assert_eq!(log.len(), committed_ids.len(), "each event once");
    for key in KEYS {
        assert_eq!(
            arrived.get(key),
            expected.get(key),
            "key {key}: arrival order is commit order"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// 2. Crash between publish and acknowledgement.

/// The relay is SIGKILLed while the destination holds its requests (it has the events, the slot
/// was not confirmed): a new relay delivers them again, and nothing is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_between_publish_and_confirm_delivers_again() {
    let pg = LogicalPg::start(&[]);
    let db = TestDb::migrated_on(&pg.server_url()).await;
    let gate = Gate::closed();
    let held = gate.clone();
    let rx = Receiver::with(move |_| Reply::ok().held_at(&held)).await;
    let text = wal_config(
        &db,
        "status_interval = \"100ms\"",
        &[webhook("hooks", &rx.url, "timeout = \"120s\"")],
    );
    create_slot(&db, &text).await;
    let dir = scratch();
    let config = write_config(dir.path(), &text);
    let mut first = spawn_relay(dir.path(), &config, "first");
    assert!(
        wait_for(GUARD, || async { slot_active(&db).await }).await,
        "the first relay streams: {}",
        relay_log(dir.path(), "first")
    );
    let ids = write(&db, 3, 2, "order.created").await;
    let committed = current_lsn(&db).await;
    // The destination has every event (held before its answer), and the relay has reported its
    // position to the server since: kill it now.
    let seen = wait_for(GUARD, || async { rx.count() == ids.len() }).await;
    assert!(seen, "the destination got the {} events", ids.len());
    let held_since: String = sqlx::query_scalar("SELECT clock_timestamp()::text")
        .fetch_one(&db.pool)
        .await
        .expect("clock");
    let reported = wait_for(GUARD, || async {
        sqlx::query_scalar::<_, Option<bool>>(
            "SELECT reply_time > $2::timestamptz FROM pg_stat_replication
             WHERE pid = (SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1)",
        )
        .bind(SLOT)
        .bind(&held_since)
        .fetch_optional(&db.pool)
        .await
        .expect("reply time")
        .flatten()
        .unwrap_or(false)
    })
    .await;
    assert!(
        reported,
        "the relay reported its position while the events were held"
    );
    signal(&first, libc::SIGKILL);
    let _ = first.wait();
    if confirmed_past(&db, &committed).await {
        // On a busy machine the destination can go a second without an answer before the kill:
        // the batch then settles without it and hands its events over as pairs (in flight), and
        // only that makes confirming the slot past them safe.
        let handed_over: i64 = sqlx::query_scalar(
            "SELECT count(DISTINCT event_id) FROM outbox_deliveries WHERE event_id::text = ANY($1)",
        )
        .bind(&ids)
        .fetch_one(&db.pool)
        .await
        .expect("pairs");
        assert_eq!(
            handed_over as usize,
            ids.len(),
            "the slot was confirmed past unanswered events that were not handed over: {}",
            relay_log(dir.path(), "first")
        );
    }

    let mut second = spawn_relay(dir.path(), &config, "second");
    let later = write(&db, 2, 1, "order.created").await;
    // The new relay sends the same events again (held too), then the gate opens.
    let again = wait_for(GUARD, || async {
        let per_id = requests_per_id(&rx);
        ids.iter()
            .all(|id| per_id.get(id).copied().unwrap_or(0) >= 2)
    })
    .await;
    gate.open();
    let written = current_lsn(&db).await;
    let all = wait_for(GUARD, || async {
        has_all(&rx, &ids) && has_all(&rx, &later) && confirmed_past(&db, &written).await
    })
    .await;
    let status = terminate(&mut second).await;
    assert!(
        again,
        "the new relay delivered the unconfirmed events again: {}",
        relay_log(dir.path(), "second")
    );
    assert!(all, "every event delivered, none lost");
    assert!(
        status.is_some_and(|s| s.success()),
        "graceful stop: {status:?}"
    );
    let per_id = requests_per_id(&rx);
    assert!(
        later.iter().all(|id| per_id[id] == 1),
        "events written after the crash arrive once: {per_id:?}"
    );
    assert_eq!(
        db.count("published_at IS NULL").await,
        0,
        "every row settled"
    );
}

// ---------------------------------------------------------------------------------------------
// 3. Resume after a graceful restart.

/// Events delivered before a graceful stop (SIGTERM) are not delivered again after a restart;
/// events written while the relay was down are; the slot's confirmed position moved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_resumes_from_the_confirmed_position() {
    let pg = LogicalPg::start(&[]);
    let db = TestDb::migrated_on(&pg.server_url()).await;
    let rx = Receiver::start().await;
    // No ordered destination and small batches: several batches are in flight at once, and
    // the slot is still confirmed only in commit order, past batches that are settled.
    let text = wal_config(&db, "", &[webhook("hooks", &rx.url, "")])
        .replace("[relay]\n", "[relay]\nbatch_size = 2\nworkers = 4\n");
    create_slot(&db, &text).await;
    let at_create = confirmed(&db).await.expect("confirmed position");
    let dir = scratch();
    let config = write_config(dir.path(), &text);

    let mut relay = spawn_relay(dir.path(), &config, "first");
    let mut first = Vec::new();
    for _ in 0..12 {
        first.extend(write(&db, 2, 1, "order.created").await);
    }
    // Stopped as soon as the destination has them: the stop reports what was settled.
    let delivered = wait_for(GUARD, || async { has_all(&rx, &first) }).await;
    let status = terminate(&mut relay).await;
    assert!(delivered, "the first {} events arrived", first.len());
    assert!(
        status.is_some_and(|s| s.success()),
        "graceful stop: {status:?}"
    );
    let after_stop = confirmed(&db).await.expect("confirmed position");

    let mut second = Vec::new();
    for _ in 0..6 {
        second.extend(write(&db, 2, 1, "order.updated").await);
    }
    let written = current_lsn(&db).await;
    let mut relay = spawn_relay(dir.path(), &config, "second");
    // Commit order: any event of the first round read again would come before these, and the
    // slot confirms past them once their batch is settled.
    let resumed = wait_for(GUARD, || async {
        has_all(&rx, &second) && confirmed_past(&db, &written).await
    })
    .await;
    let status = terminate(&mut relay).await;
    assert!(resumed, "the events written while it was down arrived");
    assert!(
        status.is_some_and(|s| s.success()),
        "graceful stop: {status:?}"
    );
    let per_id = requests_per_id(&rx);
    let again: Vec<&String> = first.iter().filter(|id| per_id[*id] > 1).collect();
    assert_eq!(
        again,
        Vec::<&String>::new(),
        "nothing delivered before the stop came again"
    );
    assert!(
        second.iter().all(|id| per_id[id] == 1),
        "each new event once"
    );
    assert_eq!(rx.count(), first.len() + second.len());
    let moved: bool = sqlx::query_scalar("SELECT $1::pg_lsn > $2::pg_lsn")
        .bind(&after_stop)
        .bind(&at_create)
        .fetch_one(&db.pool)
        .await
        .expect("compare");
    assert!(
        moved,
        "the graceful stop left the slot confirmed past its creation ({at_create} → {after_stop})"
    );
    assert_eq!(
        db.count("published_at IS NULL").await,
        0,
        "every row settled"
    );
}

/// Delivered rows are written after their batches, several batches' together (`settle_wait`),
/// and the slot is never confirmed past an event whose row is not written yet: a relay that died
/// then would leave a row that the polling relay could still send, with the slot past it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_slot_waits_for_the_rows_of_delivered_events() {
    let pg = LogicalPg::start(&[]);
    let db = TestDb::migrated_on(&pg.server_url()).await;
    let rx = Receiver::start().await;
    // Rows wait for 100 of them or an hour: here, until the stop.
    let text = wal_config(
        &db,
        "settle_wait = \"1h\"\nstatus_interval = \"100ms\"",
        &[webhook("hooks", &rx.url, "")],
    )
    .replace("[relay]\n", "[relay]\nbatch_size = 100\n");
    create_slot(&db, &text).await;
    let dir = scratch();
    let config = write_config(dir.path(), &text);
    let mut relay = spawn_relay(dir.path(), &config, "rows");

    let mut ids = write(&db, 2, 0, "order.created").await;
    let after_first = current_lsn(&db).await;
    for _ in 0..4 {
        ids.extend(write(&db, 2, 1, "order.created").await);
    }
    let written = current_lsn(&db).await;
    let delivered = wait_for(GUARD, || async { has_all(&rx, &ids) }).await;
    assert!(delivered, "all {} events arrived", ids.len());
    // Ten status intervals: long enough for a confirmation that should not be there to show.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        db.count("published_at IS NULL").await,
        10,
        "the delivered rows wait to be written together"
    );
    assert!(
        !confirmed_past(&db, &after_first).await,
        "the slot is not confirmed past an event whose row is not written"
    );

    let status = terminate(&mut relay).await;
    assert!(
        status.is_some_and(|s| s.success()),
        "graceful stop: {status:?}"
    );
    assert_eq!(
        db.count("published_at IS NULL").await,
        0,
        "the stop wrote the rows"
    );
    assert!(
        confirmed_past(&db, &written).await,
        "then confirmed the slot past them"
    );
    assert!(
        requests_per_id(&rx).values().all(|&n| n == 1),
        "each event once"
    );
}

// ---------------------------------------------------------------------------------------------
// 4. Standby take-over.

/// Two relays on one slot: one streams, the other waits on standby; when the streaming one is
/// SIGKILLed, the standby takes over and delivers what was written after the kill.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_relay_takes_over_the_slot() {
    let pg = LogicalPg::start(&[]);
    let db = TestDb::migrated_on(&pg.server_url()).await;
    let rx = Receiver::start().await;
    let text = wal_config(&db, "", &[webhook("hooks", &rx.url, "")]);
    create_slot(&db, &text).await;
    let dir = scratch();
    let config = write_config(dir.path(), &text);
    let a = spawn_relay(dir.path(), &config, "a");
    let b = spawn_relay(dir.path(), &config, "b");
    let standby = |tag: &str| relay_log(dir.path(), tag).contains("standby:");
    // Exactly one streams; the other said it waits.
    let settled = wait_for(GUARD, || async {
        (streams(dir.path(), "a") && standby("b")) || (streams(dir.path(), "b") && standby("a"))
    })
    .await;
    assert!(
        settled,
        "one relay streams, the other is on standby:\n--- a\n{}\n--- b\n{}",
        relay_log(dir.path(), "a"),
        relay_log(dir.path(), "b")
    );
    let (mut active, mut passive, passive_tag) = if streams(dir.path(), "a") {
        (a, b, "b")
    } else {
        (b, a, "a")
    };
    let before = write(&db, 5, 2, "order.created").await;
    assert!(
        wait_for(GUARD, || async { has_all(&rx, &before) }).await,
        "the streaming relay delivers"
    );
    assert!(
        !streams(dir.path(), passive_tag),
        "only one relay streams:\n{}",
        relay_log(dir.path(), passive_tag)
    );
    // On standby the relay retries quietly (every 200 ms here): one INFO line, no ERROR or WARN
    // per retry. Both relays start at once, so the first try may race the other's and fail in
    // the client library (one ERROR line of its own, at most); the retries look first.
    let waiting = relay_log(dir.path(), passive_tag);
    assert_eq!(
        waiting.matches("standby:").count(),
        1,
        "one line on standby:\n{waiting}"
    );
    assert!(
        waiting.matches("ERROR").count() <= 1 && !waiting.contains("WAL session ended"),
        "no error per retry on standby:\n{waiting}"
    );
    signal(&active, libc::SIGKILL);
    let _ = active.wait();
    let after = write(&db, 5, 2, "order.updated").await;
    let written = current_lsn(&db).await;
    let taken_over = wait_for(GUARD, || async {
        has_all(&rx, &after) && confirmed_past(&db, &written).await
    })
    .await;
    let log = relay_log(dir.path(), passive_tag);
    let status = terminate(&mut passive).await;
    assert!(taken_over, "the standby took over and delivered:\n{log}");
    assert!(
        log.contains("streaming the replication slot"),
        "the standby streams now:\n{log}"
    );
    // It resumed where the slot was confirmed, and says so (not "0/0").
    let start = log
        .lines()
        .find(|l| l.contains("streaming the replication slot"))
        .unwrap_or_default();
    assert!(
        start.contains("the slot's confirmed position") && !start.contains("from=0/0"),
        "{start}"
    );
    assert!(
        status.is_some_and(|s| s.success()),
        "graceful stop: {status:?}"
    );
    assert!(has_all(&rx, &before), "none lost");
    assert_eq!(
        db.count("published_at IS NULL").await,
        0,
        "every row settled"
    );
}

// ---------------------------------------------------------------------------------------------
// 5. A transaction larger than logical_decoding_work_mem.

/// One transaction of 10,000 rows and 2,000 `outbox_emit()` events, spilled to disk by the
/// server's decoder (64 kB of decoding memory): every event arrives exactly once, every row is
/// published, no emitted event leaves a row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_larger_than_decoding_memory_arrives_whole() {
    let pg = LogicalPg::start(&["logical_decoding_work_mem=64kB"]);
    let db = TestDb::migrated_on(&pg.server_url()).await;
    let rx = Receiver::start().await;
    let text = wal_config(&db, "", &[webhook("hooks", &rx.url, "")]);
    create_slot(&db, &text).await;
    let relay = Running::on(own_pool(&db).await, &text);
    let ids = write(&db, 10_000, 2_000, "order.created").await;
    let written = current_lsn(&db).await;
    let done = wait_for(GUARD, || async {
        rx.count() >= ids.len() && confirmed_past(&db, &written).await
    })
    .await;
    relay.stop().await;
    let spilled: i64 = sqlx::query_scalar(
        "SELECT coalesce(sum(spill_txns), 0)::bigint FROM pg_stat_replication_slots",
    )
    .fetch_one(&db.pool)
    .await
    .expect("spill stats");
    println!("{} requests; spilled transactions: {spilled}", rx.count());
    assert!(done, "every event arrived and the slot confirmed past them");
    assert!(
        spilled > 0,
        "the server's decoder spilled the transaction to disk"
    );
    let per_id = requests_per_id(&rx);
    assert_eq!(per_id.len(), ids.len(), "every event arrived");
    assert!(
        ids.iter().all(|id| per_id.get(id) == Some(&1)),
        "each exactly once"
    );
    assert_eq!(db.count("true").await, 10_000, "emitted events left no row");
    assert_eq!(
        db.count("published_at IS NOT NULL").await,
        10_000,
        "every row published"
    );
}

// ---------------------------------------------------------------------------------------------
// 6. The heartbeat.

/// Heartbeats the relay wrote (`pgoutbox-heartbeat` messages) that a `test_decoding` slot
/// `watch` shows.
async fn heartbeats_seen(db: &TestDb) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_logical_slot_peek_changes('watch', NULL, NULL)
         WHERE data LIKE 'message: transactional: 0 prefix: pgoutbox-heartbeat%'",
    )
    .fetch_one(&db.pool)
    .await
    .expect("peek the watch slot")
}

/// A quiet relay writes heartbeats into the WAL (no events), and with the outbox quiet, writes to
/// another table (not in the publication) still let the slot's confirmed position pass them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_heartbeat_advances_an_idle_slot() {
    let pg = LogicalPg::start(&[]);
    let db = TestDb::migrated_on(&pg.server_url()).await;
    let rx = Receiver::start().await;
    let text = wal_config(
        &db,
        "heartbeat_interval = \"200ms\"\nstatus_interval = \"200ms\"",
        &[webhook("hooks", &rx.url, "")],
    );
    create_slot(&db, &text).await;
    // A second slot that shows what the WAL holds, heartbeats included.
    sqlx::query("SELECT pg_create_logical_replication_slot('watch', 'test_decoding')")
        .execute(&db.pool)
        .await
        .expect("watch slot");
    let relay = Running::on(own_pool(&db).await, &text);
    let beating = wait_for(GUARD, || async {
        slot_active(&db).await && heartbeats_seen(&db).await > 0
    })
    .await;
    assert!(beating, "the idle relay writes heartbeats");
    let start = confirmed(&db).await.expect("confirmed");
    sqlx::query("CREATE TABLE elsewhere (n int, filler text)")
        .execute(&db.pool)
        .await
        .expect("create");
    for _ in 0..5 {
        sqlx::query(
            "INSERT INTO elsewhere SELECT g, repeat('x', 200) FROM generate_series(1, 5000) g",
        )
        .execute(&db.pool)
        .await
        .expect("insert elsewhere");
    }
    let written = current_lsn(&db).await;
    // From now on the watch slot shows only what comes after those writes.
    sqlx::query("SELECT pg_replication_slot_advance('watch', $1::pg_lsn)")
        .bind(&written)
        .execute(&db.pool)
        .await
        .expect("advance the watch slot");
    let advanced = wait_for(GUARD, || async {
        confirmed_past(&db, &written).await && heartbeats_seen(&db).await > 0
    })
    .await;
    let end = confirmed(&db).await;
    relay.stop().await;
    assert!(
        advanced,
        "the slot confirmed past the other table's writes, heartbeats went on ({start} → {end:?}, wrote up to {written})"
    );
    assert_eq!(rx.count(), 0, "no event was sent");
    assert_eq!(db.count("true").await, 0, "no outbox row");
}

// ---------------------------------------------------------------------------------------------
// 7. wal_level = replica.

/// On a server with wal_level = replica (a cluster of the test's own: the shared server may be a
/// logical one), the relay and `slot create` exit non-zero with a message that names
/// wal_level = logical.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_level_replica_is_a_clear_error() {
    // The last `-c wal_level` on the server's command line wins.
    let pg = LogicalPg::start(&["wal_level=replica"]);
    let db = TestDb::migrated_on(&pg.server_url()).await;
    let level: String = sqlx::query_scalar("SHOW wal_level")
        .fetch_one(&db.pool)
        .await
        .expect("wal_level");
    assert_ne!(
        level, "logical",
        "the cluster runs with wal_level = replica"
    );
    let rx = Receiver::start().await;
    let text = wal_config(&db, "", &[webhook("hooks", &rx.url, "")]);
    let dir = scratch();
    let config = write_config(dir.path(), &text);
    let config = config.to_str().expect("utf-8 path");

    let mut relay = spawn_relay(dir.path(), Path::new(config), "relay");
    let status = exit_status(&mut relay, GUARD).await;
    let log = relay_log(dir.path(), "relay");
    assert!(
        status.is_some_and(|s| !s.success()),
        "the relay exits with an error: {status:?}\n{log}"
    );
    assert!(
        log.contains("wal_level = logical"),
        "the error names it:\n{log}"
    );

    let (code, _, stderr) = run(&["slot", "create", "--config", config]);
    assert_ne!(code, 0, "slot create fails:\n{stderr}");
    assert!(
        stderr.contains("wal_level = logical"),
        "the error names it:\n{stderr}"
    );
    let slots: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_replication_slots")
        .fetch_one(&db.pool)
        .await
        .expect("slots");
    assert_eq!(slots, 0, "no slot was made");
}

// ---------------------------------------------------------------------------------------------
// 8. Failures go to the per-destination path.

/// One destination is down, one is up: the up one gets everything, the down one's pairs go to
/// the deliveries table (dead after two attempts), and the slot confirms past them meanwhile. A
/// failed `outbox_emit()` event gets a row (its pair needs one); one delivered everywhere does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_go_to_the_deliveries_table_and_never_hold_the_slot() {
    let pg = LogicalPg::start(&[]);
    let db = TestDb::migrated_on(&pg.server_url()).await;
    let up = Receiver::start().await;
    let down_url = format!("http://127.0.0.1:{}/events", closed_port());
    let text = wal_config(
        &db,
        "",
        &[
            webhook("up", &up.url, ""),
            webhook(
                "down",
                &down_url,
                "topics = [\"fail.*\"]\nretry_schedule = [\"1s\"]\nmax_attempts = 2\nbreaker = { failures = 0 }",
            ),
        ],
    );
    create_slot(&db, &text).await;
    let relay = Running::on(own_pool(&db).await, &text);
    let failing = write(&db, 4, 3, "fail.created").await;
    let fine = write(&db, 3, 3, "ok.created").await;
    let written = current_lsn(&db).await;
    let (failing_rows, failing_emits) = failing.split_at(4);
    let fine_emits = &fine[3..];

    // The slot moves past the failed events while they still wait for their second attempt.
    let moved = wait_for(GUARD, || async { confirmed_past(&db, &written).await }).await;
    let pairs_when_confirmed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox_deliveries WHERE destination = 'down' AND event_id::text = ANY($1)",
    )
    .bind(&failing)
    .fetch_one(&db.pool)
    .await
    .expect("pairs");
    let dead = wait_for(GUARD, || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM outbox_deliveries
             WHERE destination = 'down' AND dead_at IS NOT NULL AND attempts = 2",
        )
        .fetch_one(&db.pool)
        .await
        .expect("dead pairs")
            == failing.len() as i64
    })
    .await;
    let all_up = wait_for(GUARD, || async {
        has_all(&up, &failing) && has_all(&up, &fine)
    })
    .await;
    relay.stop().await;

    assert!(moved, "the slot confirmed past the failed events");
    assert_eq!(
        pairs_when_confirmed,
        failing.len() as i64,
        "the failed pairs were in the deliveries table when the slot moved past them"
    );
    assert!(
        dead,
        "the down destination's pairs are dead after two attempts"
    );
    assert!(all_up, "the up destination got every event");
    let per_id = requests_per_id(&up);
    assert!(
        failing.iter().chain(&fine).all(|id| per_id[id] == 1),
        "the up destination got each event once: {per_id:?}"
    );
    let other_pairs: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox_deliveries WHERE destination <> 'down' OR NOT (event_id::text = ANY($1))",
    )
    .bind(&failing)
    .fetch_one(&db.pool)
    .await
    .expect("pairs");
    assert_eq!(
        other_pairs, 0,
        "no pair for the up destination or the fine events"
    );
    let rows_of = |ids: &[String]| {
        let ids = ids.to_vec();
        let pool = db.pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM outbox WHERE id::text = ANY($1)")
                .bind(ids)
                .fetch_one(&pool)
                .await
                .expect("rows")
        }
    };
    assert_eq!(
        rows_of(failing_emits).await,
        failing_emits.len() as i64,
        "a failed emitted event got a row"
    );
    assert_eq!(
        rows_of(failing_rows).await,
        failing_rows.len() as i64,
        "the failed rows are still there"
    );
    assert_eq!(
        rows_of(fine_emits).await,
        0,
        "an emitted event delivered everywhere left no row"
    );
    let materialized: Vec<(String, Option<String>, serde_json::Value)> = sqlx::query_as(
        "SELECT topic, key, payload FROM outbox WHERE id::text = ANY($1) ORDER BY payload->>'m'",
    )
    .bind(failing_emits)
    .fetch_all(&db.pool)
    .await
    .expect("materialized rows");
    assert_eq!(
        materialized,
        (1..=3)
            .map(|m| (
                "fail.created".to_owned(),
                Some(format!("k{}", m % 7)),
                serde_json::json!({ "m": m })
            ))
            .collect::<Vec<_>>(),
        "the row holds the emitted event"
    );
}

// ---------------------------------------------------------------------------------------------
// 9. `pgoutbox slot create|status|drop`.

/// Stops `relay` gracefully and waits until the slot has no session.
async fn stop_streaming(db: &TestDb, relay: &mut Child) {
    let status = terminate(relay).await;
    assert!(
        status.is_some_and(|s| s.success()),
        "graceful stop: {status:?}"
    );
    assert!(
        wait_for(GUARD, || async { !slot_active(db).await }).await,
        "the relay's session ended"
    );
}

/// `slot create` makes the slot, `slot status` shows it (active while a relay streams it, its
/// confirmed position and lag), `slot drop` refuses while a relay streams it and works after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slot_commands_show_and_guard_the_slot() {
    let pg = LogicalPg::start(&[]);
    let db = TestDb::migrated_on(&pg.server_url()).await;
    let rx = Receiver::start().await;
    let port = common::private::free_port();
    let text = format!(
        "{}
[observability]
listen = \"127.0.0.1:{port}\"\n",
        wal_config(&db, "", &[webhook("hooks", &rx.url, "")])
    );
    let dir = scratch();
    let config = write_config(dir.path(), &text);
    let config_arg = config.to_str().expect("utf-8 path");

    let (code, _, stderr) = run(&["slot", "status", "--config", config_arg]);
    assert_eq!(code, 1, "no slot yet: {stderr}");
    let (code, _, stderr) = run(&["slot", "create", "--config", config_arg]);
    assert_eq!(code, 0, "slot create: {stderr}");
    assert!(
        stderr.contains(&format!("slot {SLOT} created at")),
        "{stderr}"
    );
    assert!(
        stderr.contains("publication pgoutbox_outbox created"),
        "{stderr}"
    );
    let (code, _, stderr) = run(&["slot", "create", "--config", config_arg]);
    assert_eq!(code, 0, "slot create again: {stderr}");
    assert!(
        stderr.contains(&format!("slot {SLOT} already there")),
        "{stderr}"
    );

    let mut relay = spawn_relay(dir.path(), &config, "relay");
    assert!(
        wait_for(GUARD, || async { slot_active(&db).await }).await,
        "the relay streams: {}",
        relay_log(dir.path(), "relay")
    );
    let ids = write(&db, 3, 1, "order.created").await;
    let written = current_lsn(&db).await;
    assert!(
        wait_for(GUARD, || async {
            has_all(&rx, &ids) && confirmed_past(&db, &written).await
        })
        .await,
        "delivered"
    );
    let pid: i32 =
        sqlx::query_scalar("SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1")
            .bind(SLOT)
            .fetch_one(&db.pool)
            .await
            .expect("active pid");
    let confirmed_now = confirmed(&db).await.expect("confirmed");
    let (code, stdout, stderr) = run(&["slot", "status", "--config", config_arg]);
    assert_eq!(code, 0, "slot status: {stderr}");
    let line = |name: &str| {
        stdout
            .lines()
            .find(|l| l.starts_with(name))
            .map(|l| l[name.len()..].trim().to_owned())
            .unwrap_or_else(|| panic!("no {name} line in:\n{stdout}"))
    };
    assert_eq!(line("slot"), SLOT);
    assert_eq!(line("plugin"), "pgoutput");
    assert_eq!(line("active"), format!("yes (backend pid {pid})"));
    // The relay may confirm more (a keepalive) between the two reads: at or past.
    let shown = line("confirmed");
    let at_least: bool = sqlx::query_scalar("SELECT $1::pg_lsn >= $2::pg_lsn")
        .bind(&shown)
        .bind(&confirmed_now)
        .fetch_one(&db.pool)
        .await
        .expect("compare");
    assert!(at_least, "confirmed {shown} vs {confirmed_now}");
    assert!(line("lag").ends_with('B'), "lag in bytes: {stdout}");
    assert_eq!(line("wal_status"), "reserved");

    // What the relay read and how it streamed, in its metrics.
    let metrics = reqwest::get(format!("http://127.0.0.1:{port}/metrics"))
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text");
    let value = |name: &str| {
        metrics
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
    };
    assert_eq!(
        value("pgoutbox_wal_events_read_total"),
        Some(ids.len() as f64),
        "three rows and one emit() message: {metrics}"
    );
    assert_eq!(value("pgoutbox_wal_sessions_total"), Some(1.0), "{metrics}");

    let (code, _, stderr) = run(&["slot", "drop", "--config", config_arg]);
    assert_ne!(code, 0, "drop refused while streamed: {stderr}");
    assert!(stderr.contains("in use by a relay"), "{stderr}");
    assert!(confirmed(&db).await.is_some(), "the slot is still there");

    stop_streaming(&db, &mut relay).await;
    let (code, stdout, _) = run(&["slot", "status", "--config", config_arg]);
    assert_eq!(code, 0);
    assert!(stdout.contains("no (no relay streams it)"), "{stdout}");

    // Events emitted while no relay runs live only behind the slot: drop refuses, says how many.
    let late = write(&db, 1, 2, "order.late").await;
    let (code, _, stderr) = run(&["slot", "drop", "--config", config_arg]);
    assert_ne!(code, 0, "drop refused while emit() events wait: {stderr}");
    assert!(
        stderr.contains("holds 2 outbox_emit() events not yet delivered")
            && stderr.contains("--force"),
        "{stderr}"
    );
    assert!(confirmed(&db).await.is_some(), "the slot is still there");
    // A relay delivers them; then nothing is held and the drop needs no --force.
    let mut relay = spawn_relay(dir.path(), &config, "again");
    let late_written = current_lsn(&db).await;
    assert!(
        wait_for(GUARD, || async {
            has_all(&rx, &late) && confirmed_past(&db, &late_written).await
        })
        .await,
        "the late events delivered: {}",
        relay_log(dir.path(), "again")
    );
    stop_streaming(&db, &mut relay).await;
    let (code, _, stderr) = run(&["slot", "drop", "--config", config_arg, "--publication"]);
    assert_eq!(code, 0, "slot drop: {stderr}");
    assert!(stderr.contains(&format!("slot {SLOT} dropped")), "{stderr}");
    assert!(confirmed(&db).await.is_none(), "the slot is gone");
    let publications: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_publication")
        .fetch_one(&db.pool)
        .await
        .expect("publications");
    assert_eq!(publications, 0, "the publication is gone");
    let (code, stdout, _) = run(&["slot", "status", "--config", config_arg]);
    assert_eq!(code, 1, "no slot: {stdout}");
    assert!(
        stdout.contains(&format!("no slot named {SLOT}")),
        "{stdout}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_request_does_not_hold_the_slot_and_is_not_sent_twice() {
    let pg = LogicalPg::start(&[]);
    let db = TestDb::migrated_on(&pg.server_url()).await;
    let gate = Gate::closed();
    let held = gate.clone();
    // Only the `slow` event waits for the gate; the destination answers the rest at once.
    let rx = Receiver::with(move |req| {
        if req.json()["type"] == "slow" {
            Reply::ok().held_at(&held)
        } else {
            Reply::ok()
        }
    })
    .await;
    let text = wal_config(&db, "", &[webhook("hooks", &rx.url, "timeout = \"20s\"")])
        .replace("[relay]\n", "[relay]\npublish_timeout = \"3s\"\n");
    create_slot(&db, &text).await;
    let relay = Running::on(own_pool(&db).await, &text);
    assert!(wait_for(GUARD, || async { slot_active(&db).await }).await);
    // One transaction, so one batch: the slow event first, then the others.
    let mut tx = db.pool.begin().await.expect("begin");
    let slow: String = sqlx::query_scalar(
        "INSERT INTO outbox (topic, payload) VALUES ('slow', '{}') RETURNING id::text",
    )
    .fetch_one(&mut *tx)
    .await
    .expect("slow");
    let fast: Vec<String> = sqlx::query_scalar(
        "INSERT INTO outbox (topic, payload)
         SELECT 'fast', jsonb_build_object('n', g) FROM generate_series(1, 20) g RETURNING id::text",
    )
    .fetch_all(&mut *tx)
    .await
    .expect("fast");
    tx.commit().await.expect("commit");
    let committed = current_lsn(&db).await;

    // While the slow request is still out, the rest of its batch is delivered and settled and
    // the slot moves past the batch; the slow event waits as a pair.
    assert!(wait_for(GUARD, || async { has_all(&rx, &fast) }).await);
    assert!(
        wait_for(GUARD, || async { confirmed_past(&db, &committed).await }).await,
        "the slot moved past the batch while a request was held"
    );
    let pairs = |db: &TestDb| {
        let pool = db.pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM outbox_deliveries")
                .fetch_one(&pool)
                .await
                .expect("pairs")
        }
    };
    assert_eq!(pairs(&db).await, 1, "the held event waits as a pair");

    // Answered late: delivered, its pair gone, and once its pair would have been due (the batch's
    // publish deadline plus a second) it is not sent again.
    gate.open();
    assert!(
        wait_for(GUARD, || async { pairs(&db).await == 0 }).await,
        "the late delivery removed its pair"
    );
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(requests_per_id(&rx).get(&slow), Some(&1), "sent once");
    assert!(fast
        .iter()
        .all(|id| requests_per_id(&rx).get(id) == Some(&1)));
    relay.stop().await;
}

/// `wal.max_slot_lag`: readiness fails, saying how far behind, once the slot holds back more WAL
/// than the bound (here no relay streams it while the outbox is written).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_fails_past_max_slot_lag() {
    let pg = LogicalPg::start(&[]);
    let db = TestDb::migrated_on(&pg.server_url()).await;
    let rx = Receiver::start().await;
    let text = wal_config(
        &db,
        "max_slot_lag = \"256kB\"",
        &[webhook("hooks", &rx.url, "")],
    );
    create_slot(&db, &text).await;
    let relay = pgoutbox::engine::Relay::new(db.pool.clone(), &parse_config(&text)).expect("relay");
    let lines = relay
        .readiness()
        .await
        .expect("ready with the slot caught up");
    assert!(lines.iter().any(|l| l.starts_with("slot: ok")), "{lines:?}");
    sqlx::query(
        "INSERT INTO outbox (topic, payload)
         SELECT 'order.created', jsonb_build_object('pad', repeat('x', 1000)) FROM generate_series(1, 1000)",
    )
    .execute(&db.pool)
    .await
    .expect("write a megabyte");
    let lines = relay
        .readiness()
        .await
        .expect_err("not ready past the bound");
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("slot: not ready") && l.contains("wal.max_slot_lag = 262144")),
        "{lines:?}"
    );
}

/// A WAL relay whose settle cannot write (another session holds the outbox locked) reads events
/// whose confirmed position does not move: readiness fails with the stall once
/// `relay.stall_after` has passed, and recovers once the lock is gone and the slot moves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_sees_a_wal_stall_and_its_end() {
    let pg = LogicalPg::start(&[]);
    let db = TestDb::migrated_on(&pg.server_url()).await;
    // Slow answers leave the time to lock the table before the batch's rows are written.
    let rx = Receiver::with(|_| Reply::ok().delay(Duration::from_millis(500))).await;
    let text = wal_config(&db, "", &[webhook("hooks", &rx.url, "")])
        .replace("[relay]\n", "[relay]\nstall_after = \"1s\"\n");
    create_slot(&db, &text).await;
    let relay = Arc::new(
        pgoutbox::engine::Relay::new(db.pool.clone(), &parse_config(&text)).expect("relay"),
    );
    let stop = tokio_util::sync::CancellationToken::new();
    let running = tokio::spawn(relay.clone().run(stop.clone()));
    assert!(
        wait_for(GUARD, || async { slot_active(&db).await }).await,
        "the relay streams"
    );

    let ids = write(&db, 3, 0, "order.created").await;
    let mut locker = db.pool.begin().await.expect("begin");
    sqlx::query("LOCK TABLE outbox IN SHARE MODE")
        .execute(&mut *locker)
        .await
        .expect("lock");
    assert_stalls(&relay, GUARD).await;

    locker.rollback().await.expect("release the table");
    let written = current_lsn(&db).await;
    assert!(
        wait_for(GUARD, || async {
            has_all(&rx, &ids) && confirmed_past(&db, &written).await
        })
        .await,
        "delivered and confirmed once the lock is gone"
    );
    let ready = wait_for(GUARD, || async { relay.readiness().await.is_ok() }).await;
    assert!(ready, "ready again: {:?}", relay.readiness().await);
    stop.cancel();
    let _ = running.await;
}
