//! What one attempt to deliver one event to one destination came to.
//!
//! Sinks only classify (delivered, retry with an optional `Retry-After`, rejected for good); what
//! an outcome means for the event's delivery state is decided in one place, [`crate::settle`].

use std::time::Duration;

/// What happened to one event.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// The destination durably accepted the event.
    Delivered,
    /// A transient failure: try again per the retry policy.
    Retry {
        /// What went wrong, for `last_error`.
        reason: String,
        /// How long the destination asked us to wait, if it did.
        retry_after: Option<Duration>,
    },
    /// A permanent failure: retrying cannot help, the event is dead-lettered.
    Rejected {
        /// What went wrong, for `last_error`.
        reason: String,
    },
}

impl Outcome {
    /// A transient failure with no `Retry-After`.
    pub fn retry(reason: impl Into<String>) -> Self {
        Outcome::Retry {
            reason: reason.into(),
            retry_after: None,
        }
    }
}
