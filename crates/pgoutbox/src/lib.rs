//! pgoutbox: a transactional outbox for PostgreSQL.
//!
//! An application writes events into the `outbox` table in the same transaction as its business
//! data ([`enqueue`]). The relay ([`engine`]) then moves them out, following the data flow that the
//! modules are named after:
//!
//! enqueue → [`table`] → [`sources`] (poll, WAL) → [`route`] → [`sinks`] (each destination behind its
//! [`sinks::gate`]: pause, circuit breaker, concurrency) → [`settle`] (ack / retry / hold / dead) →
//! [`store::cleanup`] (and the partitioned [`store::history`]), with every statement in the
//! [`store`].
//!
//! Delivery is at least once: consumers dedupe by the event id, which every sink forwards
//! (see [`webhook`] for the receiver side of webhook signatures).
//!
//! An application that only enqueues (or consumes) needs none of the relay: it depends on
//! `pgoutbox-core`, which this crate re-exports whole (same paths). The relay itself runs as the
//! `pgoutbox` binary, or in-process:
//!
//! ```no_run
//! use std::sync::Arc;
//!
//! use pgoutbox::config::Config;
//! use pgoutbox::engine::Relay;
//!
//! # async fn f() -> Result<(), Box<dyn std::error::Error>> {
//! let config = Config::load(std::path::Path::new("pgoutbox.toml"))?;
//! let pool = sqlx::PgPool::connect(config.database_url()?).await?;
//! let relay = Arc::new(Relay::new(pool, &config)?);
//! let stop = tokio_util::sync::CancellationToken::new();
//! let report = relay.run(stop).await?; // until `stop` is cancelled (SIGTERM, say)
//! println!("delivered {}", report.delivered);
//! # Ok(()) }
//! ```

pub mod config;
pub mod definitions;
pub mod engine;
pub mod model;
pub mod otlp;
pub mod rate;
pub mod route;
pub mod server;
pub mod settle;
pub mod sinks;
pub mod sources;
pub mod status;
pub mod store;

// The application side lives in `pgoutbox-core` (what an application links); the relay uses it
// through the same paths.
pub use pgoutbox_core::{enqueue, error, inbox, schema, table, trace, webhook};

pub use enqueue::{Event, Outbox, TypedEvent};
pub use error::{error_chain, Error, Result};
pub use model::event::OutboxEvent;
pub use sinks::tls::install_crypto_provider;
pub use table::{Ident, OutboxTable};
