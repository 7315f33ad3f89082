#![doc = include_str!("../README.md")]

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
