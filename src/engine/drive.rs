//! Driving a batch's publish: waiting for it while watching its lanes, so that a lane that falls
//! behind is handed over instead of waited for, and the claim loop goes on to its next batch as
//! soon as one lane of this one is done.

use std::future::Future;
use std::pin::Pin;

use tokio::sync::oneshot;

use super::batch::{Run, Watch, WATCH_EVERY};
use super::Relay;

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
