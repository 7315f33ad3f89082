//! A claimed batch: claimed from the table, routed into the lanes, published, settled.
//!
//! Everything the claim holds is bounded by `publish_timeout` from the claim. When every lane
//! finishes (or the budget runs out) the batch settles in a few statements. When a lane falls
//! behind the others, it is handed over: the batch settles at once — the lane's answered items
//! as usual, its unsent ones as pairs due now, its requests still out as pairs leased to this
//! batch — and the claim loop goes on; the batch then waits for those requests alone and settles
//! their pairs when the answers come.

use std::time::Instant;

use opentelemetry::KeyValue;
use tokio::sync::oneshot;
use uuid::Uuid;

use super::batch::{Run, Watch};
use super::drive::{in_flight_lease, Stop};
use super::report::BatchReport;
use super::settle_batch::{Origin, Results};
use super::Relay;
use crate::error::Result;
use crate::model::metric;
use crate::settle::plan::InFlightLease;
use crate::sources::poll::{claim_due, release, ClaimedBatch};
use crate::store::outbox::Guard;

impl Relay {
    /// Claims, publishes and settles one batch.
    pub async fn run_batch(&self) -> Result<BatchReport> {
        Ok(self.process_batch(None).await?.0)
    }

    /// One claimed batch; also returns the ids it scheduled for another attempt. `detach` is
    /// signalled when the claim loop may go on while this batch waits for a lane behind.
    pub(super) async fn process_batch(
        &self,
        detach: Option<oneshot::Sender<()>>,
    ) -> Result<(BatchReport, Vec<Uuid>)> {
        let claim_started = Instant::now();
        let claim_wall = std::time::SystemTime::now();
        let settings = &self.config.relay;
        let deadline = tokio::time::Instant::now() + settings.publish_timeout;
        let options = self.sizing.options(&self.claim);
        let ClaimedBatch {
            events,
            poison,
            behind,
            guard,
            found,
        } = claim_due(
            &self.store,
            &options,
            &self.blocking,
            self.watermark.current(claim_started),
        )
        .await?;
        metrics::histogram!(metric::CLAIM_SECONDS).record(claim_started.elapsed().as_secs_f64());
        if self.claim.ordered {
            self.sizing.adapt(
                found,
                (options.heads, options.followers),
                settings.batch_size,
            );
        }
        if events.is_empty() && poison.is_empty() {
            release(&self.store, guard, &behind).await?;
            return Ok((BatchReport::default(), Vec::new()));
        }
        metrics::histogram!(metric::BATCH_SIZE).record((events.len() + poison.len()) as f64);
        self.progressed();
        crate::otlp::batch_span("claim", claim_wall, || {
            vec![
                KeyValue::new("pgoutbox.events", events.len() as i64),
                KeyValue::new("pgoutbox.poison", poison.len() as i64),
                KeyValue::new("pgoutbox.table", self.store.table().to_string()),
            ]
        });
        let items = match self.items(&events).await {
            Ok(items) => items,
            Err(e) => {
                // Everything claimed goes back, not only the rows behind (a lease would otherwise
                // keep the claimed ones until it expires).
                let claimed: Vec<Uuid> = events
                    .iter()
                    .map(|e| e.id)
                    .chain(poison.iter().map(|(id, _)| *id))
                    .chain(behind.iter().copied())
                    .collect();
                release(&self.store, guard, &claimed).await?;
                return Err(e);
            }
        };
        let run = Run::new(&events, &items, self.lanes.len(), deadline);
        let mut watch = Watch::new(&run, self.lanes.len());
        let mut publish = Box::pin(tokio::time::timeout_at(deadline, self.publish_run(&run)));
        let mut detach = detach;
        let stop = self
            .drive(&run, publish.as_mut(), &mut watch, &mut detach)
            .await;
        let extra = (poison.as_slice(), behind.as_slice());
        let lanes = match stop {
            Stop::Done | Stop::Aborted => {
                let aborted = stop == Stop::Aborted;
                let (answers, started) = run.finish(aborted, &self.lanes, settings.publish_timeout);
                let handed = vec![false; self.lanes.len()];
                let results = Results {
                    events: &events,
                    items: &items,
                    answers: &answers,
                    started: &started,
                    handed: &handed,
                };
                let planned = self.plan_batch(
                    &results,
                    Origin::Claimed,
                    (Uuid::nil(), InFlightLease(deadline_left(deadline))),
                )?;
                return self
                    .settle_planned(&events, planned, guard, extra, aborted)
                    .await;
            }
            Stop::HandOff(lanes) => lanes,
        };
        // Hand the lagging lanes over: settle everything else now.
        let handed = self.hand_over(&run, lanes);
        // Rows handed over with their request out are settled later under a lease: the claim's
        // own in lease mode, a new one otherwise.
        let token = match &guard {
            Guard::Lease(token) => *token,
            Guard::Transaction(_) | Guard::Nothing => Uuid::new_v4(),
        };
        let early = handed.results(&run);
        let late = early.in_flight();
        let lease = in_flight_lease(deadline);
        let planned = self.plan_batch(&early, Origin::Claimed, (token, lease))?;
        let leased_rows = planned.leased_rows.clone();
        let (mut report, retried) = self
            .settle_planned(&events, planned, guard, extra, false)
            .await?;
        if let Some(signal) = detach.take() {
            let _ = signal.send(());
        }
        // Then wait for the requests still out, and settle them.
        report += self
            .finish_handed(
                &run,
                publish.as_mut(),
                &handed,
                (&late, token, &leased_rows),
            )
            .await?;
        Ok((report, retried))
    }
}

/// What is left of the budget ending at `deadline`.
fn deadline_left(deadline: tokio::time::Instant) -> std::time::Duration {
    deadline.saturating_duration_since(tokio::time::Instant::now())
}
