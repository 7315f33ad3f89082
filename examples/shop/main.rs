//! The shop: pgoutbox end to end on the local machine, from one command.
//!
//! ```sh
//! cargo run --example shop --features axum            # 200 orders, then exits
//! cargo run --example shop --features axum -- 1000    # more orders
//! cargo run --example shop --features axum,nats -- --nats-consumer  # see nats.rs
//! ```
//!
//! It creates the database `pgoutbox_shop` on `postgres://postgres@127.0.0.1:5432` (or uses
//! `DATABASE_URL`), then runs:
//!
//! 1. the **orders** service, which writes each order and its `order.created` event in one
//!    transaction;
//! 2. the **relay**, delivering the outbox to a signed webhook;
//! 3. the **balances** service, which verifies the signature and applies each event once through
//!    the inbox.
//!
//! It creates orders over HTTP, waits until the balances add up to the orders, and prints both.
//! The services live in `services.rs`; `tests/shop.rs` runs the same services against the real
//! `pgoutbox relay` process while killing it.

mod services;

#[cfg(feature = "nats")]
mod nats;

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use pgoutbox::config::Config;
use pgoutbox::engine::Relay;
use pgoutbox::webhook::axum::WebhookVerifier;
use sqlx::postgres::PgPoolOptions;
use sqlx::{Executor, PgPool};
use tokio_util::sync::CancellationToken;

use services::{ConsumerStats, NewOrder};

/// A demo signing secret; a real one comes from configuration.
const SECRET: &str = "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD";

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/pgoutbox_shop".into());
    let pool = connect_creating(&url).await?;
    services::setup(&pool).await?;

    if args.iter().any(|a| a == "--nats-consumer") {
        #[cfg(feature = "nats")]
        return nats::run(pool).await;
        #[cfg(not(feature = "nats"))]
        bail!("the NATS consumer needs --features axum,nats");
    }
    let orders: usize = match args.first() {
        Some(n) => n.parse().context("the argument is the number of orders")?,
        None => 200,
    };

    let stats = Arc::new(ConsumerStats::default());
    let verifier = WebhookVerifier::new([SECRET])?;
    let balances = services::serve(services::balances_app(
        pool.clone(),
        verifier,
        stats.clone(),
    ))
    .await?;
    let shop = services::serve(services::orders_app(pool.clone())).await?;
    println!("orders service:   {shop}/orders");
    println!("balances service: {balances}/events");

    // The relay, in-process here; in production it is the `pgoutbox relay` process.
    let config = Config::parse(
        &format!(
            "database_url = \"{url}\"\n[relay]\npoll_interval = \"50ms\"\n\n\
             [[destinations]]\nname = \"balances\"\ntype = \"webhook\"\n\
             url = \"{balances}/events\"\nsecret = \"{SECRET}\"\ntopics = [\"order.*\"]\n"
        ),
        |_| None,
    )?;
    let relay = Arc::new(Relay::new(pool.clone(), &config)?);
    let shutdown = CancellationToken::new();
    let relay_task = tokio::spawn(relay.run(shutdown.clone()));

    let started = Instant::now();
    let http = reqwest::Client::new();
    let customers = ["acme", "globex", "initech", "umbrella"];
    for i in 0..orders {
        let order = NewOrder {
            customer: customers[i % customers.len()].into(),
            amount: 100 + (i as i64 % 900),
        };
        let res = http
            .post(format!("{shop}/orders"))
            .json(&order)
            .send()
            .await?;
        if !res.status().is_success() {
            bail!("POST /orders: {} {}", res.status(), res.text().await?);
        }
    }
    println!("created {orders} orders over HTTP");

    let deadline = Instant::now() + Duration::from_secs(60);
    let (ordered, balanced) = loop {
        let (ordered, balanced) = services::totals(&pool).await?;
        if ordered == balanced || Instant::now() > deadline {
            break (ordered, balanced);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    shutdown.cancel();
    relay_task.await??;

    let (applied, duplicates) = stats.get();
    println!(
        "sum of orders {ordered}, sum of balances {balanced}: {} ({applied} events applied, {duplicates} duplicates absorbed, {:.1?})",
        if ordered == balanced { "equal" } else { "NOT EQUAL" },
        started.elapsed()
    );
    if ordered != balanced {
        bail!("the balances did not add up within 60 s");
    }
    Ok(())
}

/// Connects to `url`, creating its database first when it does not exist.
async fn connect_creating(url: &str) -> anyhow::Result<PgPool> {
    let mut parsed = url::Url::parse(url).context("DATABASE_URL is not a URL")?;
    let name = parsed.path().trim_start_matches('/').to_owned();
    if let Err(first) = PgPoolOptions::new().max_connections(1).connect(url).await {
        let valid = !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !valid {
            return Err(first).context("cannot connect");
        }
        parsed.set_path("/postgres");
        let admin = PgPoolOptions::new()
            .max_connections(1)
            .connect(parsed.as_str())
            .await
            .context("cannot connect to the server")?;
        // Validated above: letters, digits and underscores only.
        admin
            .execute(format!("CREATE DATABASE \"{name}\"").as_str())
            .await
            .with_context(|| format!("cannot create database {name}"))?;
    }
    Ok(PgPoolOptions::new()
        .max_connections(16)
        .connect(url)
        .await?)
}
