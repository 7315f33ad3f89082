//! The `nats` sink through a NATS server outage. This stops the shared local server: it is its
//! own test binary, and `.config/nextest.toml` keeps it from running beside the other NATS tests.
#![cfg(feature = "nats")]

mod common;

use async_nats::jetstream;

use common::nats::{consume, jetstream, stored, URL};
use common::sinks::{
    assert_delivered_any_order, broker_outage, committed, sink_config, unique, Broker,
};
use common::{scratch, write_config, TestDb};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_committed_while_nats_is_down_are_delivered_when_it_is_back() {
    let broker = Broker::nats();
    broker.start();
    let db = TestDb::migrated().await;
    let stream = unique("PGTDOWN_");
    let prefix = unique("pgtdown");
    {
        // A file-backed stream, so it survives the restart.
        let js = jetstream::new(async_nats::connect(URL).await.expect("nats"));
        js.create_stream(jetstream::stream::Config {
            name: stream.clone(),
            subjects: vec![format!("{prefix}.>")],
            ..Default::default()
        })
        .await
        .expect("create stream");
    }
    let dir = scratch();
    let config = write_config(
        dir.path(),
        &sink_config(
            &db,
            "nats",
            &format!("url = \"{URL}\"\nsubject = \"{prefix}.{{topic}}\"\ntimeout = \"2s\"\n"),
        ),
    );
    broker_outage(&db, &broker, dir.path(), &config, "nats").await;

    let expected = committed(&db).await;
    let js = jetstream().await;
    let (got, _) = consume(&js, &stream, expected.len()).await;
    assert_delivered_any_order(&expected, &got);
    assert_eq!(
        stored(&js, &stream).await,
        30,
        "none lost, none stored twice"
    );
    js.delete_stream(&stream).await.expect("cleanup");
}
