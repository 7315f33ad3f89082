//! A replay's dry run: which retained events one destination would be sent, counted page by page
//! without writing anything.

use std::ops::ControlFlow;

use super::Router;
use crate::error::Result;
use crate::model::filter::Filter;
use crate::model::subscription::Subscription;
use crate::store::replays::{self, Selection};
use crate::store::Store;

/// What a replay's dry run counted: the retained events in its range, those the destination
/// would be sent, and rows that cannot be read as events (a replay skips them).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct DryRun {
    /// Retained events in the range (the selection's topics, keys and times).
    pub read: u64,
    /// Of those, the events the destination takes (its topics and filter) and `filter` keeps.
    pub would_send: u64,
    /// Rows that cannot be read as events.
    pub unreadable: u64,
    /// Whether the walk reached the end of the range; when `progress` stopped it first, the
    /// counts are of the events read until then.
    pub complete: bool,
}

/// Retained events a dry run reads at a time.
const DRY_RUN_PAGE: i64 = 5_000;

/// Walks `selection` as a replay to `dest` would (published up to now), counting what the
/// destination would be sent with the replay's own `filter`; `progress` is told the events read
/// so far after each page, and may stop the walk there (a request with a time budget). Nothing
/// is written.
pub async fn dry_run<D: AsRef<Subscription>>(
    store: &Store,
    dest: &D,
    selection: &Selection,
    filter: Option<&Filter>,
    mut progress: impl FnMut(u64) -> ControlFlow<()>,
) -> Result<DryRun> {
    let router = Router::new(std::slice::from_ref(dest));
    let upto = chrono::Utc::now();
    let mut counted = DryRun::default();
    let mut cursor = None;
    loop {
        let asked = replays::Page {
            selection,
            upto: Some(upto),
            after: cursor,
            limit: DRY_RUN_PAGE,
        };
        let page = replays::read(store, &asked).await?;
        for r in &page {
            match &r.event {
                Ok(e) if router.replay_takes(0, filter, e) => {
                    counted.would_send += 1;
                }
                Ok(_) => {}
                Err(_) => counted.unreadable += 1,
            }
        }
        counted.read += page.len() as u64;
        let stop = progress(counted.read);
        match page.last() {
            Some(last) if page.len() as i64 == DRY_RUN_PAGE => cursor = Some(last.cursor),
            _ => {
                counted.complete = true;
                return Ok(counted);
            }
        }
        if stop.is_break() {
            return Ok(counted);
        }
    }
}
