//! The `rabbitmq` sink through a broker outage. This stops the shared local RabbitMQ: it is its
//! own test binary, and `.config/nextest.toml` keeps it from running beside the other RabbitMQ
//! tests.
#![cfg(feature = "rabbitmq")]

mod common;

use std::time::Duration;

use common::amqp::{channel, consume, queue, URL};
use common::sinks::{
    assert_delivered_any_order, commit_events, committed, sink_config, unique, Broker,
};
use common::{scratch, signal, spawn_relay, wait_for, write_config, TestDb};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_committed_while_rabbitmq_is_down_are_delivered_when_it_is_back() {
    let broker = Broker::rabbitmq();
    broker.start();
    let db = TestDb::migrated().await;
    let name = unique("pgtdown_");
    {
        // Durable queue and binding: they survive the restart.
        let (conn, ch) = channel().await;
        queue(&ch, &name, &format!("{name}.#")).await;
        let _ = conn.close(0, "done".into()).await;
    }
    let dir = scratch();
    let config = write_config(
        dir.path(),
        &sink_config(
            &db,
            "rabbitmq",
            &format!(
                "url = \"{URL}\"\nexchange = \"amq.topic\"\nrouting_key = \"{name}.{{topic}}\"\ntimeout = \"3s\"\n"
            ),
        ),
    );
    let mut relay = spawn_relay(dir.path(), &config, "rabbitmq");

    // Connected and delivering first, so the outage is a lost connection, not a refused one.
    commit_events(&db, 10, "before").await;
    assert!(
        wait_for(Duration::from_secs(30), || async {
            db.count("published_at IS NULL").await == 0
        })
        .await,
        "first events delivered"
    );

    broker.stop();
    commit_events(&db, 20, "during").await;
    assert!(
        wait_for(Duration::from_secs(30), || async {
            db.count("published_at IS NULL AND attempts >= 2").await == 20
        })
        .await,
        "events retried while RabbitMQ is down"
    );
    assert!(
        relay.try_wait().expect("wait").is_none(),
        "relay keeps running"
    );
    assert_eq!(db.count("dead_at IS NOT NULL").await, 0);

    broker.start();
    let delivered = wait_for(Duration::from_secs(90), || async {
        db.count("published_at IS NULL").await == 0
    })
    .await;
    signal(&relay, libc::SIGTERM);
    let status = relay.wait().expect("relay exits");
    assert!(delivered, "all delivered after the restart");
    assert!(status.success(), "{status:?}");

    let expected = committed(&db).await;
    let (_conn, ch) = channel().await;
    let (got, _, _) = consume(&ch, &name, expected.len()).await;
    assert_delivered_any_order(&expected, &got);
    ch.queue_delete(name.as_str().into(), Default::default())
        .await
        .expect("cleanup");
}
