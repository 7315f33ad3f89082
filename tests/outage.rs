//! Broker outages: a relay delivers to a broker of its own, the broker stops for ten seconds while
//! events keep being committed, then starts again on the same port. Every event must arrive, and
//! the circuit breaker must close on the first probe sent once the broker answers again: the sink
//! connects afresh for each probe (`Sink::reconnect`), so no client can hand the probe the failed
//! reconnect it made while the broker was down. How long delivery took to resume is printed.
//!
//! Each broker is a private server (tests/common/private.rs) stopped and started on its own port,
//! so the shared brokers of the other tests are never touched. Kafka's is the exception: Tansu
//! keeps its log in memory, so the port that goes away is a front before it (see the test).
#![cfg(any(
    feature = "kafka",
    feature = "mqtt",
    feature = "nats",
    feature = "rabbitmq",
    feature = "redis"
))]

mod common;

use std::future::Future;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};

#[cfg(feature = "kafka")]
use common::private::Front;
use common::private::Private;
use common::sinks::{committed, sink_config, Committed, Got};
use common::{wait_for, Running, TestDb};

/// How long the broker stays down.
const DOWN: Duration = Duration::from_secs(10);

/// How long at least the broker stays down once the breaker opened.
const PROBED_WHILE_DOWN: Duration = Duration::from_secs(3);

/// Opens after three failures in a row, then probes every second.
const BREAKER: &str =
    "breaker = { failures = 3, probe_interval = \"1s\", max_probe_interval = \"1s\" }\n";

/// A broker the outage stops and starts again on the same port.
trait Restartable {
    async fn stop(&mut self);
    async fn start(&mut self);
}

impl Restartable for Private {
    async fn stop(&mut self) {
        tokio::task::block_in_place(|| Private::stop(self));
    }

    async fn start(&mut self) {
        tokio::task::block_in_place(|| Private::start(self));
    }
}

#[cfg(feature = "kafka")]
impl Restartable for Front {
    async fn stop(&mut self) {
        self.close().await;
    }

    async fn start(&mut self) {
        self.open().await;
    }
}

/// The breaker of destination `name` as stored: state, failed probes, last error.
async fn breaker(db: &TestDb, name: &str) -> (String, i32, Option<String>) {
    sqlx::query_as(
        "SELECT breaker, failed_probes, last_error FROM outbox_destinations WHERE name = $1",
    )
    .bind(name)
    .fetch_one(&db.pool)
    .await
    .expect("the destination's row")
}

/// This process's metrics recorder (one per process, whichever test comes first).
fn metrics() -> &'static metrics_exporter_prometheus::PrometheusHandle {
    static HANDLE: std::sync::OnceLock<metrics_exporter_prometheus::PrometheusHandle> =
        std::sync::OnceLock::new();
    HANDLE.get_or_init(|| pgoutbox::server::install_recorder().expect("recorder"))
}

/// `pgoutbox_sink_reconnects_total` of destination `name`.
fn reconnects(name: &str) -> u64 {
    let line = format!("pgoutbox_sink_reconnects_total{{destination=\"{name}\"}} ");
    metrics()
        .render()
        .lines()
        .find_map(|l| l.strip_prefix(line.as_str()))
        .map_or(0, |v| v.trim().parse().expect("a count"))
}

/// Commits one event every 200 ms until stopped: events keep coming whatever the broker does.
struct Committer {
    stop: tokio_util::sync::CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Committer {
    fn start(db: &TestDb) -> Self {
        let stop = tokio_util::sync::CancellationToken::new();
        let token = stop.clone();
        let pool = db.pool.clone();
        let task = tokio::spawn(async move {
            while !token.is_cancelled() {
                let committed = sqlx::query(
                    "INSERT INTO outbox (topic, payload, key, headers)
                     VALUES ('flowing', jsonb_build_object('at', clock_timestamp()), 'k',
                             '{\"x-tenant\": \"acme\"}')",
                )
                .execute(&pool)
                .await;
                // Gone with the test's database, when the test failed.
                if committed.is_err() {
                    return;
                }
                tokio::select! {
                    _ = token.cancelled() => {}
                    _ = tokio::time::sleep(Duration::from_millis(200)) => {}
                }
            }
        });
        Self { stop, task }
    }

    async fn stop(self) {
        self.stop.cancel();
        self.task.await.expect("committer");
    }
}

/// The outage, with one destination of `kind` and `settings` and the broker `broker`; `answers`
/// says whether the broker answers a client of the test. Prints the seconds from the broker's
/// return (the moment it answered the test) to the first delivery after it.
async fn outage<B, F, Fut>(db: &TestDb, kind: &str, settings: &str, broker: &mut B, answers: F)
where
    B: Restartable,
    F: Fn() -> Fut,
    Fut: Future<Output = bool>,
{
    // Named after the broker, so that tests sharing a process count reconnects apart.
    let config = sink_config(db, kind, &format!("{settings}{BREAKER}"))
        .replace("name = \"broker\"", &format!("name = \"{kind}\""));
    metrics();
    let relay = Running::start(db, &config);
    let committer = Committer::start(db);
    assert!(
        wait_for(Duration::from_secs(30), || async {
            db.count("published_at IS NOT NULL").await >= 5
        })
        .await,
        "{kind}: events delivered before the outage; breaker {:?}",
        breaker(db, kind).await
    );

    broker.stop().await;
    let stopped = Instant::now();
    assert!(
        wait_for(Duration::from_secs(30), || async {
            breaker(db, kind).await.0 != "closed"
        })
        .await,
        "{kind}: the breaker opens while the broker is down; breaker {:?}",
        breaker(db, kind).await
    );
    // Down for DOWN, and long enough after the breaker opened for a probe to go out meanwhile.
    let opened = Instant::now();
    tokio::time::sleep(
        DOWN.saturating_sub(stopped.elapsed())
            .max(PROBED_WHILE_DOWN.saturating_sub(opened.elapsed())),
    )
    .await;

    broker.start().await;
    // Asked often: the breaker is read as soon as the broker answers.
    let deadline = Instant::now() + Duration::from_secs(60);
    while !answers().await {
        assert!(
            Instant::now() < deadline,
            "{kind}: the broker answers again"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let back: DateTime<Utc> = sqlx::query_scalar("SELECT clock_timestamp()")
        .fetch_one(&db.pool)
        .await
        .expect("clock");
    // A probe already out when the broker came back is the outage's: its result is waited for.
    let mut state = breaker(db, kind).await;
    while state.0 == "half_open" {
        tokio::time::sleep(Duration::from_millis(100)).await;
        state = breaker(db, kind).await;
    }
    let failed_when_back = state.1;
    let mut failed_after = state.1;
    let deadline = Instant::now() + Duration::from_secs(60);
    while state.0 != "closed" {
        assert!(
            Instant::now() < deadline,
            "{kind}: the breaker closes once the broker is back; breaker {state:?}"
        );
        failed_after = state.1;
        tokio::time::sleep(Duration::from_millis(100)).await;
        state = breaker(db, kind).await;
    }
    assert!(
        failed_after <= failed_when_back,
        "{kind}: the first probe after the broker was back failed ({failed_when_back} failed \
         probes when it was back, {failed_after} before the breaker closed)"
    );

    // Events keep flowing a moment after the breaker closed, then everything must be out.
    tokio::time::sleep(Duration::from_secs(1)).await;
    committer.stop().await;
    assert!(
        wait_for(Duration::from_secs(60), || async {
            db.count("published_at IS NULL").await == 0
        })
        .await,
        "{kind}: every event delivered after the outage; {} left, breaker {:?}",
        db.count("published_at IS NULL").await,
        breaker(db, kind).await
    );
    relay.stop().await;
    assert_eq!(
        db.count("dead_at IS NOT NULL").await,
        0,
        "{kind}: none dead"
    );
    // The attempts that failed during the outage made no connection; the probe's did.
    assert_eq!(reconnects(kind), 1, "{kind}: reconnects counted");

    let resumed: f64 = sqlx::query_scalar(
        "SELECT extract(epoch FROM min(published_at) - $1)::float8 FROM outbox
         WHERE published_at >= $1",
    )
    .bind(back)
    .fetch_one(&db.pool)
    .await
    .expect("first delivery after the outage");
    println!(
        "{kind}: delivery resumed {resumed:.2} s after the broker was back \
         ({failed_when_back} failed probes during the outage)"
    );
}

/// Asserts every committed event is among the messages a consumer got, with its payload (a
/// redelivery may add a copy: the relay delivers at least once).
fn assert_none_lost(kind: &str, expected: &[Committed], got: &[Got]) {
    let by_id: std::collections::HashMap<&str, &Got> =
        got.iter().map(|g| (g.id.as_str(), g)).collect();
    let lost: Vec<&str> = expected
        .iter()
        .map(|c| c.id.as_str())
        .filter(|id| !by_id.contains_key(id))
        .collect();
    assert!(
        lost.is_empty(),
        "{kind}: lost {} of {}: {lost:?}",
        lost.len(),
        expected.len()
    );
    for c in expected {
        assert_eq!(
            String::from_utf8_lossy(&by_id[c.id.as_str()].payload),
            c.payload,
            "{kind}: payload of {}",
            c.id
        );
    }
    let known: std::collections::HashSet<&str> = expected.iter().map(|c| c.id.as_str()).collect();
    assert!(
        got.iter().all(|g| known.contains(g.id.as_str())),
        "{kind}: a message that was never committed"
    );
    println!(
        "{kind}: {} events, lost 0, {} redelivered copies",
        expected.len(),
        got.len() - by_id.len()
    );
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_outage_closes_the_breaker_on_the_first_probe() {
    use std::collections::HashMap;

    let mut redis = Private::redis();
    let url = format!("redis://127.0.0.1:{}/0", redis.port);
    let db = TestDb::migrated().await;
    let answers = || async {
        let Ok(client) = redis::Client::open(url.as_str()) else {
            return false;
        };
        let Ok(mut conn) = client.get_multiplexed_async_connection().await else {
            return false;
        };
        redis::cmd("PING")
            .query_async::<String>(&mut conn)
            .await
            .is_ok()
    };
    outage(
        &db,
        "redis",
        &format!("url = \"{url}\"\nstream = \"outage\"\n"),
        &mut redis,
        answers,
    )
    .await;

    let client = redis::Client::open(url.as_str()).expect("url");
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("redis");
    let entries: Vec<(String, HashMap<String, Vec<u8>>)> = redis::cmd("XRANGE")
        .arg("outage")
        .arg("-")
        .arg("+")
        .query_async(&mut conn)
        .await
        .expect("xrange");
    let got: Vec<Got> = entries
        .into_iter()
        .map(|(_, f)| Got {
            id: String::from_utf8_lossy(&f["id"]).into_owned(),
            key: None,
            payload: f["payload"].clone(),
            headers: HashMap::new(),
        })
        .collect();
    assert_none_lost("redis", &committed(&db).await, &got);
}

#[cfg(feature = "nats")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_outage_closes_the_breaker_on_the_first_probe() {
    use async_nats::jetstream;

    let mut nats = Private::nats_anonymous();
    let url = format!("nats://127.0.0.1:{}", nats.port);
    let db = TestDb::migrated().await;
    let js = jetstream::new(async_nats::connect(url.as_str()).await.expect("nats"));
    // File storage: the stream and its messages outlive the restart.
    js.create_stream(jetstream::stream::Config {
        name: "OUTAGE".into(),
        subjects: vec!["outage.>".into()],
        ..Default::default()
    })
    .await
    .expect("create stream");
    // Back means JetStream answers, not only the port: it restores its streams after listening.
    let answers = || async {
        let Ok(client) = async_nats::connect(url.as_str()).await else {
            return false;
        };
        jetstream::new(client).get_stream("OUTAGE").await.is_ok()
    };
    outage(
        &db,
        "nats",
        &format!("url = \"{url}\"\nsubject = \"outage.{{topic}}\"\n"),
        &mut nats,
        answers,
    )
    .await;

    let expected = committed(&db).await;
    let js = jetstream::new(async_nats::connect(url.as_str()).await.expect("nats"));
    let stored = common::nats::stored(&js, "OUTAGE").await;
    let (got, _) = common::nats::consume(&js, "OUTAGE", stored as usize).await;
    assert_none_lost("nats", &expected, &got);
}

#[cfg(feature = "rabbitmq")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_outage_closes_the_breaker_on_the_first_probe() {
    use lapin::{Connection, ConnectionProperties};

    // The node's queue `order.created` is durable, and the sink's messages persistent.
    let mut rabbitmq = Private::rabbitmq("relay", "r4bb1t-pw");
    let url = format!("amqp://relay:r4bb1t-pw@127.0.0.1:{}/%2f", rabbitmq.port);
    let db = TestDb::migrated().await;
    let answers = || async {
        match Connection::connect(&url, ConnectionProperties::default()).await {
            Ok(conn) => {
                let ok = conn.create_channel().await.is_ok();
                let _ = conn.close(0, "ready".into()).await;
                ok
            }
            Err(_) => false,
        }
    };
    outage(
        &db,
        "rabbitmq",
        &format!("url = \"{url}\"\nrouting_key = \"order.created\"\n"),
        &mut rabbitmq,
        answers,
    )
    .await;

    let expected = committed(&db).await;
    let conn = Connection::connect(&url, ConnectionProperties::default())
        .await
        .expect("rabbitmq");
    let channel = conn.create_channel().await.expect("channel");
    let queued = channel
        .queue_declare(
            "order.created".into(),
            lapin::options::QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            Default::default(),
        )
        .await
        .expect("queue")
        .message_count();
    let (got, _, _) = common::amqp::consume(&channel, "order.created", queued as usize).await;
    assert_none_lost("rabbitmq", &expected, &got);
}

#[cfg(feature = "mqtt")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mqtt_outage_closes_the_breaker_on_the_first_probe() {
    use std::collections::HashMap;

    use rumqttc::v5::mqttbytes::v5::Packet;
    use rumqttc::v5::mqttbytes::QoS;
    use rumqttc::v5::{AsyncClient, Event, MqttOptions};

    let mut mosquitto = Private::mosquitto_anonymous();
    let port = mosquitto.port;
    let db = TestDb::migrated().await;

    // A subscriber whose session (its subscription, and the messages queued for it while it is
    // away) outlives its connection and the broker's restart: it reconnects until stopped.
    let mut options = MqttOptions::new("pgt-outage-sub", "127.0.0.1", port);
    options
        .set_clean_start(false)
        .set_session_expiry_interval(Some(3600))
        .set_keep_alive(Duration::from_secs(30));
    let (client, mut eventloop) = AsyncClient::new(options, 100);
    client
        .subscribe("outage/#", QoS::AtLeastOnce)
        .await
        .expect("subscribe");
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Got>();
    let (subscribed_tx, subscribed) = tokio::sync::oneshot::channel();
    let subscriber = tokio::spawn(async move {
        let mut subscribed_tx = Some(subscribed_tx);
        loop {
            match eventloop.poll().await {
                Ok(Event::Incoming(Packet::SubAck(_))) => {
                    if let Some(s) = subscribed_tx.take() {
                        let _ = s.send(());
                    }
                }
                Ok(Event::Incoming(Packet::Publish(p))) => {
                    let headers: HashMap<String, String> = p
                        .properties
                        .map(|props| props.user_properties.into_iter().collect())
                        .unwrap_or_default();
                    let _ = tx.send(Got {
                        id: headers.get("pgoutbox-id").cloned().unwrap_or_default(),
                        key: None,
                        payload: p.payload.to_vec(),
                        headers,
                    });
                }
                Ok(_) => {}
                // The broker is down: the next poll connects again.
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
    });
    tokio::time::timeout(Duration::from_secs(10), subscribed)
        .await
        .expect("SUBACK within 10 s")
        .expect("subscriber alive");

    outage(
        &db,
        "mqtt",
        &format!("url = \"mqtt://127.0.0.1:{port}\"\ntopic = \"outage/{{topic}}\"\n"),
        &mut mosquitto,
        // Mosquitto restores its sessions before it listens.
        || async move { common::sinks::port_open(port) },
    )
    .await;

    let expected = committed(&db).await;
    let mut got = Vec::new();
    let mut ids = std::collections::HashSet::new();
    while !expected.iter().all(|c| ids.contains(&c.id)) {
        match tokio::time::timeout(Duration::from_secs(10), rx.recv()).await {
            Ok(Some(g)) => {
                ids.insert(g.id.clone());
                got.push(g);
            }
            _ => break,
        }
    }
    subscriber.abort();
    assert_none_lost("mqtt", &expected, &got);
}

#[cfg(feature = "kafka")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_outage_closes_the_breaker_on_the_first_probe() {
    use std::collections::HashMap;

    use futures::StreamExt;
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use rdkafka::client::DefaultClientContext;
    use rdkafka::consumer::{Consumer, StreamConsumer};
    use rdkafka::message::{Headers, Message};
    use rdkafka::{ClientConfig, Offset, TopicPartitionList};

    // Tansu keeps its log in memory, so a restart would lose what it stored (no Kafka broker
    // does): the broker the relay knows is a front on a port of its own, which goes away and
    // comes back on the same port while Tansu behind it keeps running. Tansu names the front's
    // port to its clients.
    let front_port = common::private::free_port();
    let tansu = Private::tansu(common::private::free_port(), front_port);
    let mut front = Front::new(front_port, tansu.port);
    front.open().await;
    let brokers = format!("127.0.0.1:{front_port}");
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .create()
        .expect("admin client");
    for r in admin
        .create_topics(
            &[NewTopic::new("outage", 1, TopicReplication::Fixed(1))],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
        )
        .await
        .expect("create topic")
    {
        r.expect("topic created");
    }
    drop(admin);
    let db = TestDb::migrated().await;
    outage(
        &db,
        "kafka",
        // Records time out after 2 s (10 s by default), so that the breaker opens soon enough.
        &format!("brokers = \"{brokers}\"\ntopic = \"outage\"\ntimeout = \"2s\"\n"),
        &mut front,
        || async move { common::sinks::port_open(front_port) },
    )
    .await;

    let expected = committed(&db).await;
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .set("group.id", "pgt-outage")
        .set("enable.auto.commit", "false")
        .create()
        .expect("consumer");
    let mut assignment = TopicPartitionList::new();
    assignment
        .add_partition_offset("outage", 0, Offset::Beginning)
        .expect("partition");
    consumer.assign(&assignment).expect("assign");
    let mut stream = consumer.stream();
    let mut got = Vec::new();
    let mut ids = std::collections::HashSet::new();
    while !expected.iter().all(|c| ids.contains(&c.id)) {
        let Ok(Some(Ok(m))) = tokio::time::timeout(Duration::from_secs(20), stream.next()).await
        else {
            break;
        };
        let headers: HashMap<String, String> = m
            .headers()
            .map(|hs| {
                hs.iter()
                    .map(|h| {
                        (
                            h.key.to_owned(),
                            String::from_utf8_lossy(h.value.unwrap_or_default()).into_owned(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        let id = headers.get("id").cloned().unwrap_or_default();
        ids.insert(id.clone());
        got.push(Got {
            id,
            key: None,
            payload: m.payload().unwrap_or_default().to_vec(),
            headers,
        });
    }
    assert_none_lost("kafka", &expected, &got);
}
