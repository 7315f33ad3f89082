//! The vocabulary every layer shares: an event, what an attempt came to, a destination's filter,
//! transform and name templates, the retry policy, redaction of secrets in messages, and metric names.
//!
//! Plain data and pure functions only: nothing here runs SQL, opens a connection or imports
//! another module of the relay.

pub mod event;
pub mod filter;
pub mod metric;
pub mod outcome;
pub mod rate;
pub mod replay;
pub mod retry;
pub mod secrets;
pub mod template;
pub mod transform;
