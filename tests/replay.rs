//! Replays and backfills: retained events sent again to one destination, with their own id and a
//! header naming the replay, run by whichever relay serves the destination, surviving a relay
//! killed mid-way; pause, resume and cancel; `--dry-run` counts; an ordered destination keeps
//! each key's order.

mod common;

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use common::*;
use pgoutbox::store::replays::{self, Change, NewReplay, Selection};
use pgoutbox::store::Store;

const HEADER: &str = "pgoutbox-replay";

fn store(db: &TestDb) -> Store {
    Store::new(
        db.pool.clone(),
        pgoutbox::table::OutboxTable::default_table(),
    )
}

/// The replayed requests `rx` got (those carrying the replay header), by event id.
fn replayed(rx: &Receiver) -> Vec<Received> {
    rx.delivered()
        .into_iter()
        .filter(|r| r.headers.contains_key(HEADER))
        .collect()
}

/// Waits until every event is settled: a replay sends retained (published) events, and an event
/// the receiver got may not be settled yet.
async fn all_published(db: &TestDb) {
    let settled = wait_for(Duration::from_secs(30), || async {
        db.count("published_at IS NULL").await == 0
    })
    .await;
    assert!(settled, "the live deliveries settle");
}

/// Waits until `rx` got `n` live deliveries (within `secs`) and every event is settled
/// ([`all_published`]): the retained events a replay then sends.
async fn live_delivered(db: &TestDb, rx: &Receiver, n: usize, secs: u64) {
    let got = wait_for(Duration::from_secs(secs), || async {
        rx.delivered_ids().len() >= n
    })
    .await;
    assert!(got, "{n} live deliveries");
    all_published(db).await;
}

/// A replay of everything retained to the tests' destination, `hooks`.
fn to_hooks() -> NewReplay {
    NewReplay {
        destination: "hooks".into(),
        ..NewReplay::default()
    }
}

/// Creates the replay `new`; its id.
async fn start(db: &TestDb, new: NewReplay) -> uuid::Uuid {
    replays::create(&store(db), &new)
        .await
        .expect("create")
        .expect("created")
}

async fn replay_state(db: &TestDb, id: uuid::Uuid) -> replays::Replay {
    replays::get(&store(db), id)
        .await
        .expect("get")
        .expect("replay")
}

/// Events delivered once are sent again by a replay of one topic: the same ids, each with the
/// replay's header, nothing of the other topic; the replay ends done with its counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_sends_retained_events_again_with_their_ids_and_its_header() {
    let db = TestDb::migrated().await;
    let rx = Receiver::start().await;
    let orders: HashSet<String> = db
        .insert_plain(40, "order.created")
        .await
        .into_iter()
        .collect();
    db.insert_plain(10, "user.created").await;
    let relay = Running::start(&db, &webhook_config(&db, &rx.url, ""));
    live_delivered(&db, &rx, 50, 30).await;

    let id = start(
        &db,
        NewReplay {
            selection: Selection {
                topics: vec!["order.created".into()],
                ..Selection::default()
            },
            ..to_hooks()
        },
    )
    .await;
    assert_eq!(
        replay_state(&db, id).await.total,
        40,
        "the selection's total"
    );
    let done = wait_for(Duration::from_secs(30), || async {
        replay_state(&db, id).await.state == "done"
    })
    .await;
    relay.stop().await;
    assert!(done, "replay: {:?}", replay_state(&db, id).await);
    let again = replayed(&rx);
    let ids: HashSet<String> = again.iter().map(|r| r.id.clone()).collect();
    assert_eq!(
        ids, orders,
        "every order sent again under its own id, nothing else"
    );
    assert!(again.iter().all(|r| r.headers[HEADER] == id.to_string()));
    let r = replay_state(&db, id).await;
    assert_eq!((r.read, r.queued, r.pending, r.dead), (40, 40, 0, 0));
    assert_eq!(r.delivered(), 40);
}

/// A replay paused queues nothing more (what it queued still goes); resumed, it goes on from its
/// cursor; cancelled, it stops for good. Each change is refused from a state that does not
/// allow it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_is_paused_resumed_and_cancelled() {
    let db = TestDb::migrated().await;
    let rx = Receiver::start().await;
    db.insert_plain(300, "order.created").await;
    // Cleanup is run by hand at the end, not by the relay's own loop.
    let config = format!(
        "cleanup_interval = \"1h\"\n{}",
        webhook_config(&db, &rx.url, "")
    );
    let relay = Running::start(&db, &config);
    assert!(
        wait_for(Duration::from_secs(30), || async {
            rx.delivered_ids().len() >= 300
        })
        .await
    );
    let s = store(&db);
    let new = NewReplay {
        rate: Some("50/s".into()),
        ..to_hooks()
    };
    all_published(&db).await;
    let id = replays::create(&s, &new)
        .await
        .expect("create")
        .expect("created");
    assert!(
        wait_for(Duration::from_secs(30), || async {
            replayed(&rx).len() >= 20
        })
        .await
    );
    assert!(replays::change(&s, id, Change::Pause).await.expect("pause"));
    assert!(!replays::change(&s, id, Change::Pause)
        .await
        .expect("pause twice"));
    let paused = replay_state(&db, id).await;
    assert_eq!(paused.state, "paused");
    // What was queued when it paused drains; then nothing more is read.
    assert!(
        wait_for(Duration::from_secs(30), || async {
            replay_state(&db, id).await.pending == 0
        })
        .await
    );
    let read = replay_state(&db, id).await.read;
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(
        replay_state(&db, id).await.read,
        read,
        "a paused replay reads nothing"
    );
    assert!(
        read < 300,
        "the rate kept it from finishing before the pause ({read} read)"
    );

    assert!(replays::change(&s, id, Change::Resume)
        .await
        .expect("resume"));
    assert!(
        wait_for(Duration::from_secs(30), || async {
            replay_state(&db, id).await.read > read
        })
        .await
    );
    assert!(replays::change(&s, id, Change::Cancel)
        .await
        .expect("cancel"));
    assert!(!replays::change(&s, id, Change::Resume)
        .await
        .expect("resume cancelled"));
    let cancelled = replay_state(&db, id).await;
    assert_eq!(cancelled.state, "cancelled");
    assert_eq!(cancelled.pending, 0, "its queued pairs are dropped");
    let read = cancelled.read;
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(replay_state(&db, id).await.read, read);
    relay.stop().await;

    // Its rate bucket outlives it until cleanup, which deletes the buckets of ended replays.
    let bucket = format!("destination = 'replay:{id}'");
    let buckets = || async {
        sqlx::query_scalar::<_, i64>(&format!("SELECT count(*) FROM outbox_rates WHERE {bucket}"))
            .fetch_one(&db.pool)
            .await
            .expect("count buckets")
    };
    assert_eq!(buckets().await, 1, "the cancelled replay's bucket");
    let options = pgoutbox::store::cleanup::CleanupOptions {
        retention: Duration::from_secs(3600),
        dead_retention: None,
        attempts_retention: Duration::from_secs(3600),
        chunk_rows: 1000,
        dry_run: false,
    };
    let report = pgoutbox::store::cleanup::run(&s, &options, |_| {})
        .await
        .expect("cleanup");
    assert_eq!(report.deleted_buckets, 1);
    assert_eq!(buckets().await, 0, "cleanup deleted it");
}

/// A relay killed (SIGKILL) in the middle of a replay: another relay finishes it (the pairs the
/// killed one had out come back when their lease ends), and every selected event reached the
/// destination at least once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_survives_its_relay_killed_mid_way() {
    let db = TestDb::migrated().await;
    let rx = Receiver::start().await;
    let ids: HashSet<String> = db
        .insert_plain(1_500, "order.created")
        .await
        .into_iter()
        .collect();
    let dir = scratch();
    // A short lease: the pairs the killed relay had out come back within seconds.
    let text = webhook_config(&db, &rx.url, "").replace(
        "poll_interval = \"50ms\"",
        "poll_interval = \"50ms\"\npublish_timeout = \"2s\"\nlease = \"3s\"",
    );
    let config = write_config(dir.path(), &text);
    let mut first = spawn_relay(dir.path(), &config, "first");
    live_delivered(&db, &rx, 1_500, 60).await;

    let (code, out, err) = run(&[
        "replay",
        "start",
        "hooks",
        "--config",
        config.to_str().expect("path"),
        "--rate",
        "500/s",
        "--detach",
    ]);
    assert_eq!(code, 0, "{err}");
    let id: uuid::Uuid = out.trim().parse().expect("the replay's id");
    assert!(
        wait_for(Duration::from_secs(30), || async {
            replayed(&rx).len() >= 300
        })
        .await
    );
    signal(&first, libc::SIGKILL);
    let _ = first.wait();
    let midway = replay_state(&db, id).await;
    assert_eq!(midway.state, "running");
    assert!(midway.read < 1_500, "killed mid-way ({} read)", midway.read);

    let mut second = spawn_relay(dir.path(), &config, "second");
    let done = wait_for(Duration::from_secs(60), || async {
        replay_state(&db, id).await.state == "done"
    })
    .await;
    signal(&second, libc::SIGTERM);
    let _ = exit_status(&mut second, Duration::from_secs(30)).await;
    let log = std::fs::read_to_string(dir.path().join("relay-second.log")).unwrap_or_default();
    assert!(done, "replay: {:?}\n{log}", replay_state(&db, id).await);
    let again: HashSet<String> = replayed(&rx).into_iter().map(|r| r.id).collect();
    assert_eq!(again, ids, "every event replayed at least once");

    let (code, out, err) = run(&["replay", "list", "--config", config.to_str().expect("path")]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains(&id.to_string()) && out.contains("done"),
        "{out}"
    );
}

/// A dry run stopped by its caller after a page (the API's time budget) says it counted part of
/// the range; walked to the end it says it counted all of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dry_run_stopped_early_says_its_counts_are_partial() {
    let db = TestDb::migrated().await;
    sqlx::query(
        "INSERT INTO outbox (topic, payload, published_at)
         SELECT 'order.created', '{}', now() FROM generate_series(1, 6000)",
    )
    .execute(&db.pool)
    .await
    .expect("retained rows");
    let config = parse_config(&webhook_config(&db, "http://127.0.0.1:1/", ""));
    let dest = &config.destinations[0];
    let everything = replays::Selection::default();
    let dry = |stop_after_first: bool| {
        let (s, selection) = (store(&db), everything.clone());
        async move {
            pgoutbox::route::dry_run(&s, dest, &selection, None, |_| {
                if stop_after_first {
                    std::ops::ControlFlow::Break(())
                } else {
                    std::ops::ControlFlow::Continue(())
                }
            })
            .await
            .expect("dry run")
        }
    };
    let part = dry(true).await;
    assert!(!part.complete, "{part:?}");
    assert!(part.read > 0 && part.read < 6000, "{part:?}");
    let all = dry(false).await;
    assert!(all.complete, "{all:?}");
    assert_eq!((all.read, all.would_send), (6000, 6000));
}

/// `--dry-run` counts what the destination would be sent (its topics and the replay's filter)
/// and creates nothing; bad input is refused naming the flag.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dry_run_counts_and_bad_input_is_refused() {
    let db = TestDb::migrated().await;
    let rx = Receiver::start().await;
    sqlx::query(
        "INSERT INTO outbox (topic, payload, published_at)
         SELECT 'order.created', jsonb_build_object('total', g), now() FROM generate_series(1, 30) g",
    )
    .execute(&db.pool)
    .await
    .expect("retained rows");
    db.insert_plain(5, "order.created").await; // pending: not retained, not replayed
    let dir = scratch();
    let config = write_config(dir.path(), &webhook_config(&db, &rx.url, ""));
    let config = config.to_str().expect("path");
    let (code, out, err) = run(&[
        "replay",
        "start",
        "hooks",
        "--config",
        config,
        "--dry-run",
        "--filter",
        "payload.total > 20",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("10 of 30 retained events"), "{out}");
    assert_eq!(
        replays::list(&store(&db), None, 10)
            .await
            .expect("list")
            .len(),
        0
    );

    for (args, says) in [
        (vec!["--filter", "payload.("], "invalid --filter"),
        (vec!["--rate", "fast"], "invalid --rate"),
        (vec!["--since", "yesterday"], "--since"),
    ] {
        let mut all = vec!["replay", "start", "hooks", "--config", config];
        all.extend(args);
        let (code, _, err) = run(&all);
        assert_ne!(code, 0);
        assert!(err.contains(says), "{err}");
    }
    let (code, _, err) = run(&["replay", "start", "nowhere", "--config", config]);
    assert_ne!(code, 0);
    assert!(err.contains("no destination named \"nowhere\""), "{err}");
    let (code, _, err) = run(&[
        "replay",
        "pause",
        &uuid::Uuid::nil().to_string(),
        "--config",
        config,
    ]);
    assert_ne!(code, 0);
    assert!(err.contains("no replay"), "{err}");
}

/// `backfill = "1h"` on a destination added later: its first start sends it the retained
/// events as a replay; a restart does not send them again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_destination_with_backfill_gets_the_history_once() {
    let db = TestDb::migrated().await;
    let old = Receiver::start().await;
    let new = Receiver::start().await;
    let ids: HashSet<String> = db
        .insert_plain(30, "order.created")
        .await
        .into_iter()
        .collect();
    let relay = Running::start(&db, &webhook_config(&db, &old.url, ""));
    assert!(
        wait_for(Duration::from_secs(30), || async {
            old.delivered_ids().len() >= 30
        })
        .await
    );
    relay.stop().await;

    let both = format!(
        "{}\n[[destinations]]\nname = \"late\"\ntype = \"webhook\"\nurl = \"{}\"\nbackfill = \"1h\"\n",
        webhook_config(&db, &old.url, ""),
        new.url
    );
    let relay = Running::start(&db, &both);
    assert!(
        wait_for(Duration::from_secs(30), || async {
            new.delivered_ids() == ids
        })
        .await
    );
    relay.stop().await;
    let relay = Running::start(&db, &both);
    tokio::time::sleep(Duration::from_secs(1)).await;
    relay.stop().await;
    assert_eq!(new.delivered().len(), 30, "backfilled once");
    let list = replays::list(&store(&db), Some("late"), 10)
        .await
        .expect("list");
    assert_eq!(list.len(), 1);
    assert!(list[0].backfill);
    assert!(
        replayed(&old).is_empty(),
        "the other destination is not sent the backfill"
    );
}

/// On an ordered destination, a replay runs while live events of the same keys flow: each key's
/// replayed events arrive in order and its live events arrive in order (a live event of a key
/// waits behind the key's replayed events queued before it, as behind any earlier pair).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ordered_destination_keeps_each_keys_order_through_a_replay() {
    let db = TestDb::migrated().await;
    let rx = Receiver::start().await;
    let insert = |from: i32| {
        let pool = db.pool.clone();
        async move {
            sqlx::query(
                "INSERT INTO outbox (topic, key, payload)
                 SELECT 'order.updated', 'k' || (g % 10), jsonb_build_object('n', g)
                 FROM generate_series($1, $1 + 199) g",
            )
            .bind(from)
            .execute(&pool)
            .await
            .expect("insert");
        }
    };
    insert(0).await;
    let relay = Running::start(&db, &webhook_config(&db, &rx.url, "ordering = \"key\""));
    live_delivered(&db, &rx, 200, 30).await;
    let id = start(
        &db,
        NewReplay {
            rate: Some("200/s".into()),
            ..to_hooks()
        },
    )
    .await;
    for round in 1..=3 {
        insert(round * 1_000).await;
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    let done = wait_for(Duration::from_secs(60), || async {
        replay_state(&db, id).await.state == "done" && rx.delivered_ids().len() >= 800
    })
    .await;
    relay.stop().await;
    assert!(done, "replay: {:?}", replay_state(&db, id).await);

    // Per key, in arrival order: (n, replayed).
    let mut by_key: HashMap<String, Vec<(i64, bool)>> = HashMap::new();
    let mut first_live: HashSet<String> = HashSet::new();
    for r in rx.delivered() {
        let n = r.json()["data"]["n"].as_i64().expect("n");
        let replay = r.headers.contains_key(HEADER);
        if !replay && !first_live.insert(r.id.clone()) {
            continue; // a live event's second delivery: not the order under test
        }
        by_key
            .entry(format!("k{}", n % 10))
            .or_default()
            .push((n, replay));
    }
    let mut violations = 0;
    for arrivals in by_key.values() {
        for stream in [true, false] {
            let ns: Vec<i64> = arrivals
                .iter()
                .filter(|a| a.1 == stream)
                .map(|a| a.0)
                .collect();
            violations += ns.windows(2).filter(|w| w[0] > w[1]).count();
        }
    }
    assert_eq!(
        violations, 0,
        "per-key order across replayed and live events"
    );
    let replayed_n: usize = by_key
        .values()
        .map(|a| a.iter().filter(|x| x.1).count())
        .sum();
    assert_eq!(replayed_n, 200, "the 200 retained events replayed");
}

/// A replayed event the destination refuses at first is not lost: it is left as a pair of the
/// destination, retried by its lane, and the replay is done once it is delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replayed_event_that_fails_is_retried_as_a_pair() {
    let db = TestDb::migrated().await;
    let rx = Receiver::start().await;
    let ids: HashSet<String> = db
        .insert_plain(20, "order.created")
        .await
        .into_iter()
        .collect();
    let relay = Running::start(
        &db,
        &webhook_config(&db, &rx.url, "retry_schedule = [\"100ms\"]"),
    );
    live_delivered(&db, &rx, 20, 30).await;
    // Each event's first replayed request fails (its live one was its first request).
    rx.set(|r| {
        if r.headers.contains_key(HEADER) && r.nth == 1 {
            Reply::status(503)
        } else {
            Reply::ok()
        }
    });
    let id = start(&db, to_hooks()).await;
    let done = wait_for(Duration::from_secs(30), || async {
        replay_state(&db, id).await.state == "done"
    })
    .await;
    relay.stop().await;
    assert!(done, "replay: {:?}", replay_state(&db, id).await);
    let again: HashSet<String> = replayed(&rx).into_iter().map(|r| r.id).collect();
    assert_eq!(again, ids, "every refused event delivered on its retry");
    let refused = rx.log().iter().filter(|r| r.status == 503).count();
    assert_eq!(refused, 20, "each replayed event refused once");
    let r = replay_state(&db, id).await;
    assert_eq!((r.queued, r.pending, r.dead), (20, 0, 0));
}

/// On an ordered destination a replayed event the destination keeps refusing holds back only the
/// later replayed events of its key: the key's live events are not kept behind it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_events_of_a_key_do_not_wait_behind_a_refused_replayed_event() {
    let db = TestDb::migrated().await;
    let rx = Receiver::start().await;
    let insert = |n: i32| {
        let pool = db.pool.clone();
        async move {
            sqlx::query_scalar::<_, String>(
                "INSERT INTO outbox (topic, key, payload)
                 SELECT 'order.updated', 'k1', jsonb_build_object('n', g)
                 FROM generate_series(1, $1) g RETURNING id::text",
            )
            .bind(n)
            .fetch_all(&pool)
            .await
            .expect("insert")
        }
    };
    insert(10).await;
    let relay = Running::start(
        &db,
        &webhook_config(
            &db,
            &rx.url,
            "ordering = \"key\"\nretry_schedule = [\"100ms\"]",
        ),
    );
    live_delivered(&db, &rx, 10, 30).await;
    rx.set(|r| {
        if r.headers.contains_key(HEADER) {
            Reply::status(503)
        } else {
            Reply::ok()
        }
    });
    let id = start(&db, to_hooks()).await;
    assert!(
        wait_for(Duration::from_secs(30), || async {
            replay_state(&db, id).await.pending > 0
        })
        .await,
        "the refused replayed events wait as pairs"
    );
    let live: HashSet<String> = insert(5).await.into_iter().collect();
    let through = wait_for(Duration::from_secs(30), || async {
        live.is_subset(&rx.delivered_ids())
    })
    .await;
    let r = replay_state(&db, id).await;
    relay.stop().await;
    assert!(through, "the key's live events went on");
    assert_eq!(r.state, "running");
    assert!(r.pending > 0, "the replay still waits: {r:?}");
}
