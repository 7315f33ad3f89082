#![doc = include_str!("../README.md")]
// Built with no database adapter (webhook verification only), the statements and event columns
// are data nobody reads.
#![cfg_attr(
    not(any(feature = "sqlx08", feature = "sqlx09", feature = "tokio-postgres")),
    allow(dead_code, unused_imports)
)]

pub mod enqueue;
pub mod error;
pub mod inbox;
pub mod schema;
pub mod table;
pub mod trace;
pub mod webhook;

pub use enqueue::{Event, Outbox, TypedEvent};
pub use error::{error_chain, Error, Result};
pub use table::{Ident, OutboxTable};
