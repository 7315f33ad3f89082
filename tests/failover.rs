//! A database failover under running relays: a primary and a synchronous streaming standby of the
//! test's own ([`LogicalPg::standby`]), a producer writing all along, relays given both hosts in
//! one URL. The primary stops and the standby is promoted. What is asserted is the promise: every
//! event whose commit was acknowledged is delivered (lost 0), and nothing arrives that is not in
//! the promoted server's table (phantom 0). The time from the promotion to the first delivery of
//! an event written on the new primary is printed, not asserted.

mod common;

use std::collections::HashSet;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poll_relays_given_both_hosts_deliver_every_committed_event_across_a_promotion() {
    let mut primary = LogicalPg::start(&[]);
    let standby = primary.standby();
    let db = TestDb::migrated_on(&primary.server_url()).await;
    let rx = Receiver::start().await;
    let both = format!(
        "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/{}?target_session_attrs=read-write",
        primary.port, standby.port, db.name
    );
    let dir = scratch();
    let config = write_config(
        dir.path(),
        &webhook_config(&db, &rx.url, "").replace(&db.url, &both),
    );
    // Two relays, as operators run them: they share the work and both follow the failover.
    let mut relays = vec![
        spawn_relay(dir.path(), &config, "a"),
        spawn_relay(dir.path(), &config, "b"),
    ];

    let stop = Arc::new(AtomicBool::new(false));
    let producer = tokio::spawn(produce(
        vec![primary.port, standby.port],
        db.name.clone(),
        stop.clone(),
    ));
    assert!(
        wait_for(Duration::from_secs(60), || async {
            rx.delivered_ids().len() >= 50
        })
        .await,
        "the relays deliver from the primary"
    );
    primary.stop();
    standby.promote();
    let promoted = Instant::now();
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.store(true, Ordering::SeqCst);
    let written = producer.await.expect("producer");
    let after: Vec<&(String, Instant)> = written
        .committed
        .iter()
        .filter(|(_, at)| *at > promoted)
        .collect();
    assert!(!after.is_empty(), "the producer wrote to the new primary");

    let new_primary = PgConnection::connect(&format!(
        "postgres://postgres@127.0.0.1:{}/{}",
        standby.port, db.name
    ))
    .await
    .expect("connect to the promoted server");
    let mut new_primary = new_primary;
    let table: HashSet<String> = sqlx::query_scalar::<_, String>("SELECT id::text FROM outbox")
        .fetch_all(&mut new_primary)
        .await
        .expect("ids")
        .into_iter()
        .collect();
    let delivered_all = wait_for(Duration::from_secs(60), || async {
        table.is_subset(&rx.delivered_ids())
    })
    .await;
    for relay in &mut relays {
        relay.kill().ok();
        relay.wait().ok();
    }
    let delivered = rx.delivered_ids();
    let lost: Vec<&String> = written
        .committed
        .iter()
        .map(|(id, _)| id)
        .filter(|id| !delivered.contains(*id))
        .collect();
    let phantom: Vec<&String> = delivered.difference(&table).collect();
    let after_ids: HashSet<&String> = after.iter().map(|(id, _)| id).collect();
    let first = rx
        .delivered()
        .into_iter()
        .filter(|r| after_ids.contains(&r.id))
        .map(|r| r.at)
        .min();
    eprintln!(
        "failover (poll, two relays): {} committed ({} after the promotion), {} in doubt, {} delivered; lost {}, phantom {}; promotion to the first delivery of an event written on the new primary: {:?}",
        written.committed.len(),
        after.len(),
        written.in_doubt.len(),
        delivered.len(),
        lost.len(),
        phantom.len(),
        first.map(|at| at.duration_since(promoted)),
    );
    let logs: String = ["a", "b"]
        .iter()
        .map(|tag| {
            std::fs::read_to_string(dir.path().join(format!("relay-{tag}.log"))).unwrap_or_default()
        })
        .collect();
    assert!(lost.is_empty(), "lost {lost:?}\n{logs}");
    assert!(phantom.is_empty(), "phantom {phantom:?}");
    assert!(
        delivered_all,
        "every event in the promoted table is delivered\n{logs}"
    );
    assert!(
        logs.contains("new sessions go to this host"),
        "the relays say where they went\n{logs}"
    );
    assert_eq!(
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM outbox WHERE published_at IS NULL")
            .fetch_one(&mut new_primary)
            .await
            .expect("count"),
        0,
        "every event is settled on the promoted server"
    );
}

/// A relay never writes through a standby: given only a standby's address (with
/// `target_session_attrs=read-write`, the default for several hosts), it refuses at start and says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_refuses_a_standby_and_names_it() {
    let primary = LogicalPg::start(&[]);
    let standby = primary.standby();
    let db = TestDb::migrated_on(&primary.server_url()).await;
    let dir = scratch();
    let url = format!(
        "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/{}",
        standby.port,
        closed_port(),
        db.name
    );
    let config = write_config(
        dir.path(),
        &webhook_config(&db, "http://127.0.0.1:9/", "").replace(&db.url, &url),
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
        stderr.contains(&format!("127.0.0.1:{}", standby.port)),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
}
