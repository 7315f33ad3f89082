//! The engine's side of the WAL source: a batch read from the slot goes through the same pipeline
//! as a claimed one; its [`Origin`] is what differs.
//!
//! Routed and published like a claimed batch, within `publish_timeout`; then settled so that
//! nothing of it needs the slot again: delivered rows are marked published (or deleted) a little
//! later, several batches' in one statement, and every (event, destination) that was not
//! delivered (failed, held, unanswered, waiting behind its key, or handed over with its lane)
//! becomes a deliveries pair that its lane retries. `emit()` events have no row: the ones that
//! were not delivered everywhere get one first, in the settle's transaction, so that their pairs
//! and dead letters have the row the deliveries table and the console expect; delivered ones cost
//! no write at all. A database error is answered: the batch stays unconfirmed, and the WAL source
//! ends its session so that it is read again (and published again) once the database answers.
//! Retrying the settle while holding the stream would be worse: a PostgreSQL shutdown waits for
//! the stream's client to confirm the last position, and would wait forever for a relay that
//! cannot reach it.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::oneshot;
use tracing::warn;
use uuid::Uuid;

use super::context::Context;
use super::pipeline::{self, Origin, Read, Settling};
use crate::config::Config;
use crate::error::Result;
use crate::model::report::DeliveredRows;
use crate::settle::Settled;
use crate::sources::wal::{WalBatch, WalEngine, WalSettled};
use crate::store::outbox::Guard;
use crate::store::Store;

impl WalEngine for Context {
    fn config(&self) -> &Config {
        &self.config
    }

    fn store(&self) -> &Store {
        &self.store
    }

    fn keeps_key_order(&self) -> bool {
        self.claim.ordered
    }

    async fn publish(self: Arc<Self>, batch: WalBatch, settled: oneshot::Sender<WalSettled>) {
        let WalBatch {
            events,
            poison,
            rowless,
        } = batch;
        if !events.is_empty() {
            self.progress.fresh();
        }
        let mut origin = FromWal {
            rowless,
            settled: Some(settled),
        };
        let read = Read {
            events,
            poison: &poison,
            deadline: tokio::time::Instant::now() + self.config.relay.publish_timeout,
        };
        let result = pipeline::run(&self, read, &mut origin).await;
        match (origin.settled.take(), result) {
            (Some(answer), result) => {
                let _ = answer.send(result.map(|s| (s.report, s.delivered_rows)));
            }
            // Answered when it settled early: the late answers' pairs stay leased until their
            // lease ends, then are sent again (at least once).
            (None, Err(e)) => {
                warn!(error = %crate::error_chain(&e), "cannot record late answers of a WAL batch; they will be sent again")
            }
            (None, Ok(_)) => {}
        }
    }

    async fn write_rows(self: Arc<Self>, rows: DeliveredRows) -> Result<u64> {
        self.settler.delivered_rows(&rows).await
    }

    fn unconfirmed_since(&self, since: Option<Instant>) {
        self.progress.wal_unconfirmed(since);
    }
}

/// A WAL batch's origin: its rowless events, and where its settle is answered.
struct FromWal {
    /// Events that have no table row (`emit()` messages).
    rowless: HashSet<Uuid>,
    /// Where the settle is answered (taken when it is).
    settled: Option<oneshot::Sender<WalSettled>>,
}

impl Origin for FromWal {
    fn lease_token(&self) -> Uuid {
        Uuid::new_v4()
    }

    fn settling(&mut self) -> Settling<'_> {
        // Nothing holds the rows: the settle opens a transaction only if it has something to
        // write besides the delivered rows (the rows of rowless events that go on, first).
        Settling {
            guard: Guard::Nothing,
            origin: crate::settle::Origin::Wal {
                rowless: &self.rowless,
            },
            cut_off: &[],
        }
    }

    fn settled_early(&mut self, early: &Settled) {
        // The slot moves on now; the late answers become pairs' state.
        if let Some(answer) = self.settled.take() {
            let _ = answer.send(Ok((early.report, early.delivered_rows.clone())));
        }
    }
}
