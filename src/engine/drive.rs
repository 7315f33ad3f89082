//! Driving a batch's publish: waiting for it while watching its lanes, so that a lane that falls
//! behind is handed over instead of waited for, and the claim loop goes on to its next batch as
//! soon as one lane of this one is done.

use std::future::Future;
use std::pin::Pin;

use tokio::sync::oneshot;

use uuid::Uuid;

use super::batch::{Run, Watch, WATCH_EVERY};
use super::report::BatchReport;
use super::settle_batch::Results;
use super::Relay;
use crate::error::Result;
use crate::gate::Counted;
use crate::model::outcome::Outcome;
use crate::settle::plan::InFlightLease;

/// How long past the batch's deadline a pair (or row) handed over with its request out stays
/// leased to the batch: the request ends by the deadline, and its settle needs a moment.
const IN_FLIGHT_MARGIN: std::time::Duration = std::time::Duration::from_secs(5);

/// The lease of what a batch with budget until `deadline` hands over with its request out.
pub(super) fn in_flight_lease(deadline: tokio::time::Instant) -> InFlightLease {
    InFlightLease(
        deadline.saturating_duration_since(tokio::time::Instant::now()) + IN_FLIGHT_MARGIN,
    )
}

/// Why [`Relay::drive`] returned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Stop {
    /// Every lane finished, or the budget ran out.
    Done,
    /// The shutdown grace period is over.
    Aborted,
    /// These lanes fell behind: hand them over.
    HandOff(Vec<usize>),
}

impl Relay {
    /// Waits for `publish` (the publishing of `run`) to end, for shutdown, or for lanes to hand
    /// over. `detach` is signalled once some lane of the batch is done while another is not: the
    /// claim loop may then claim its next batch while this one waits.
    pub(super) async fn drive<F: Future>(
        &self,
        run: &Run<'_>,
        mut publish: Pin<&mut F>,
        watch: &mut Watch,
        detach: &mut Option<oneshot::Sender<()>>,
    ) -> Stop {
        loop {
            tokio::select! {
                _ = &mut publish => return Stop::Done,
                _ = self.abort.cancelled() => return Stop::Aborted,
                _ = tokio::time::sleep(WATCH_EVERY) => {
                    let now = tokio::time::Instant::now();
                    watch.look(run, now);
                    if watch.some_lane_behind() {
                        if let Some(signal) = detach.take() {
                            let _ = signal.send(());
                        }
                    }
                    let lagging = watch.lagging(run.started, now);
                    if !lagging.is_empty() {
                        return Stop::HandOff(lagging);
                    }
                }
            }
        }
    }

    /// After a hand-over: waits for the requests still out (bounded by the budget) or shutdown;
    /// `true` when shutdown cut them short.
    pub(super) async fn drive_rest<F: Future>(&self, publish: Pin<&mut F>) -> bool {
        tokio::select! {
            _ = publish => false,
            _ = self.abort.cancelled() => true,
        }
    }
}

/// The lanes a batch handed over, and what it had seen of its items then.
pub(super) struct Handed {
    /// The lanes handed over.
    pub(super) lanes: Vec<usize>,
    /// Per lane: whether it was handed over.
    pub(super) mask: Vec<bool>,
    /// Per item: its answer then.
    pub(super) answers: Vec<Option<(Outcome, Counted)>>,
    /// Per item: whether its request had started then.
    pub(super) started: Vec<bool>,
}

impl Handed {
    /// What the batch settles now.
    pub(super) fn results<'a>(&'a self, run: &Run<'a>) -> Results<'a> {
        Results {
            events: run.events,
            items: run.items,
            answers: &self.answers,
            started: &self.started,
            handed: &self.mask,
        }
    }
}

impl Relay {
    /// Stops `lanes` of `run` (none of their requests starts from now on) and takes what the
    /// batch has seen, for the settle that goes on without them.
    pub(super) fn hand_over(&self, run: &Run<'_>, lanes: Vec<usize>) -> Handed {
        run.stop(&lanes, &self.lanes);
        let (answers, started) = run.snapshot();
        Handed {
            mask: run.stopped(),
            lanes,
            answers,
            started,
        }
    }

    /// After the settle that went on without the handed lanes: wakes their retry loops (their
    /// unsent items are theirs now), waits for the requests still out (`late`), and settles them
    /// when their answers come (or the budget ends), under `token`; `leased_rows` are the events
    /// whose rows (not pairs) wait under that lease.
    pub(super) async fn finish_handed<F: Future>(
        &self,
        run: &Run<'_>,
        publish: Pin<&mut F>,
        handed: &Handed,
        (late, token, leased_rows): (&[usize], Uuid, &[Uuid]),
    ) -> Result<BatchReport> {
        for &d in &handed.lanes {
            self.lanes[d].handed.notify_one();
        }
        let aborted = self.drive_rest(publish).await;
        let (answers, started) =
            run.finish(aborted, &self.lanes, self.config.relay.publish_timeout);
        let results = Results {
            events: run.events,
            items: run.items,
            answers: &answers,
            started: &started,
            handed: &handed.mask,
        };
        self.settle_late(&results, late, (token, leased_rows)).await
    }
}
