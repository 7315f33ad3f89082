//! The `rabbitmq` sink through a broker outage. This stops the shared local RabbitMQ: it is its
//! own test binary, and `.config/nextest.toml` keeps it from running beside the other RabbitMQ
//! tests.
#![cfg(feature = "rabbitmq")]

mod common;

use common::amqp::{channel, consume, queue, URL};
use common::sinks::{
    assert_delivered_any_order, broker_outage, committed, sink_config, unique, Broker,
};
use common::{scratch, write_config, TestDb};

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
    broker_outage(&db, &broker, dir.path(), &config, "rabbitmq").await;

    let expected = committed(&db).await;
    let (_conn, ch) = channel().await;
    let (got, _, _) = consume(&ch, &name, expected.len()).await;
    assert_delivered_any_order(&expected, &got);
    ch.queue_delete(name.as_str().into(), Default::default())
        .await
        .expect("cleanup");
}
