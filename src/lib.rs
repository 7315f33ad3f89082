//! pgoutbox: a transactional outbox for PostgreSQL.
//!
//! An application writes events into the `outbox` table in the same transaction as its business
//! data ([`enqueue`]). The relay ([`relay`]) then moves them out, following the data flow that the
//! modules are named after:
//!
//! enqueue → [`table`] → [`claim`] → [`route`] (and [`destination`] health: pause, circuit
//! breaker) → [`publish`] (sinks) → [`settle`] (ack / retry / hold / dead) → [`cleanup`].
//!
//! Delivery is at least once: consumers dedupe by the event id, which every sink forwards
//! (see [`webhook`] for the receiver side of webhook signatures).

pub mod claim;
pub mod cleanup;
pub mod config;
pub mod dead;
pub mod destination;
pub mod enqueue;
pub mod error;
pub mod event;
pub mod inbox;
pub mod observe;
pub mod otlp;
pub mod publish;
pub mod relay;
pub mod retry;
pub mod route;
pub mod schema;
pub mod secrets;
pub mod settle;
pub mod status;
pub mod table;
pub mod trace;
pub mod webhook;

pub use enqueue::{Event, Outbox, TypedEvent};
pub use error::{error_chain, Error, Result};
pub use event::OutboxEvent;
pub use table::{Ident, OutboxTable};
