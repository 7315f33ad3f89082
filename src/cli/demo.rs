//! `pgoutbox demo`: the main job end to end on the local database, with no configuration.
//!
//! It creates the `pgoutbox_demo` schema (orders table + outbox), commits some orders with their
//! `order.created` events, rolls others back, relays everything to stdout, and checks that exactly
//! the committed events were delivered.

use std::collections::HashSet;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};

use anyhow::{bail, Context};
use async_trait::async_trait;
use pgoutbox::config::{DestinationConfig, SinkConfig};
use pgoutbox::engine::{Destination, Relay};
use pgoutbox::model::outcome::Outcome;
use pgoutbox::model::retry::RetryPolicy;
use pgoutbox::sinks::{Sink, StdoutSink};
use pgoutbox::store::demo;
use pgoutbox::{Event, Outbox, OutboxEvent, OutboxTable};
use serde_json::json;
use uuid::Uuid;

use super::Cli;

/// Arguments of `demo`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Orders committed.
    #[arg(long, default_value_t = 8)]
    orders: usize,
    /// Orders rolled back (their events must never be sent).
    #[arg(long, default_value_t = 3)]
    rollbacks: usize,
}

/// Stdout, remembering what it delivered so the demo can check it.
struct Recording {
    inner: StdoutSink,
    delivered: Mutex<Vec<Uuid>>,
}

#[async_trait]
impl Sink for Recording {
    async fn publish(&self, events: &[&OutboxEvent]) -> Vec<Outcome> {
        let outcomes = self.inner.publish(events).await;
        if let Ok(mut d) = self.delivered.lock() {
            d.extend(
                events
                    .iter()
                    .zip(&outcomes)
                    .filter(|(_, o)| **o == Outcome::Delivered)
                    .map(|(e, _)| e.id),
            );
        }
        outcomes
    }
}

pub async fn run(cli: &Cli, args: &Args) -> anyhow::Result<ExitCode> {
    let mut config = cli.load_config()?;
    if config.database_url.is_none() {
        config.database_url = Some(pgoutbox::config::Secret(
            pgoutbox::config::DEFAULT_DATABASE_URL.into(),
        ));
    }
    config.table = OutboxTable::parse("pgoutbox_demo", "outbox")?;
    config.retention = std::time::Duration::from_secs(3600);
    config.destinations = vec![std::sync::Arc::new(DestinationConfig {
        name: "stdout".into(),
        subscription: Default::default(),
        transform: None,
        rate_limit: None,
        backfill: None,
        retry: RetryPolicy::default(),
        ordering: Default::default(),
        on_dead: Default::default(),
        breaker: Default::default(),
        sink: SinkConfig::bare("stdout"),
        runtime: false,
    })];
    let url = config.database_url()?.to_owned();
    eprintln!("pgoutbox demo on {}", super::redact_url(&url));
    let pool = super::connect(&url, 4).await?;

    eprintln!("1. fresh schema pgoutbox_demo: orders table + outbox (pgoutbox migrate)");
    demo::reset(&pool)
        .await
        .context("cannot create the demo schema")?;
    pgoutbox::schema::migrate(&pool, &config.table).await?;

    eprintln!(
        "2. {} orders committed with their order.created event, {} rolled back",
        args.orders, args.rollbacks
    );
    let outbox = Outbox::new(config.table.clone());
    let mut committed = HashSet::new();
    let mut rolled_back = HashSet::new();
    for n in 0..(args.orders + args.rollbacks) {
        let order_id = n as i64 + 1;
        let total = 1000 + 250 * order_id;
        let mut tx = pool.begin().await?;
        let order = demo::Order {
            id: order_id,
            customer: format!("customer-{}", order_id % 3),
            total_cents: total,
        };
        demo::insert_order(&mut tx, &order).await?;
        let event = Event::new(
            "order.created",
            &json!({"order_id": order_id, "total_cents": total}),
        )?
        .key(format!("order-{order_id}"));
        let id = outbox.enqueue(&mut tx, &event).await?;
        if n < args.orders {
            tx.commit().await?;
            committed.insert(id);
        } else {
            tx.rollback().await?;
            rolled_back.insert(id);
        }
    }

    eprintln!("3. relay --once to stdout:");
    let sink = Arc::new(Recording {
        inner: StdoutSink::default(),
        delivered: Mutex::new(Vec::new()),
    });
    let relay = Relay::with_destinations(
        pool.clone(),
        &config,
        vec![Destination {
            name: "stdout".into(),
            sink: sink.clone(),
            retry: RetryPolicy::default(),
        }],
    );
    relay.run_once().await?;

    let delivered: HashSet<Uuid> = sink
        .delivered
        .lock()
        .map(|d| d.iter().copied().collect())
        .unwrap_or_default();
    let leaked = delivered.intersection(&rolled_back).count();
    let missing = committed.difference(&delivered).count();
    eprintln!(
        "summary: committed {}, delivered {}, rolled back {} never sent{}",
        committed.len(),
        delivered.len(),
        rolled_back.len(),
        if leaked > 0 {
            format!(" — but {leaked} WERE SENT")
        } else {
            String::new()
        }
    );
    if leaked > 0 || missing > 0 {
        bail!("demo check failed: {missing} committed events missing, {leaked} rolled-back events sent");
    }
    eprintln!("the outbox is in schema pgoutbox_demo; see it with: pgoutbox status --database-url {} --schema pgoutbox_demo", super::redact_url(&url));
    Ok(ExitCode::SUCCESS)
}
