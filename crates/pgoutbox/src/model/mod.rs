//! The vocabulary every layer shares: an event, what an attempt came to, a destination's
//! subscription, filter, transform and name templates, its retry and breaker policies, what a
//! batch's settle counted, redaction of secrets in messages, and metric names.
//!
//! Plain data and pure functions only: nothing here runs SQL, opens a connection or imports
//! another module of the relay.

pub mod breaker;
pub mod event;
pub mod filter;
pub mod metric;
pub mod outcome;
pub mod rate;
pub mod replay;
pub(crate) mod report;
pub mod retry;
pub mod secrets;
pub mod subscription;
pub mod template;
pub mod transform;
