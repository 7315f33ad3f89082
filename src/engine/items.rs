//! A batch's items: one per (event, destination) pair, each with what the engine does with it
//! now — send it, hold it, keep it behind an earlier event of its key, or dead-letter it as
//! unroutable. Building them from the router's answer is a pure function; the one database
//! question (which ordered keys still wait in the deliveries table) is asked by [`Relay::items`].

use std::collections::HashSet;
use std::ops::Range;

use super::Relay;
use crate::error::Result;
use crate::model::event::OutboxEvent;
use crate::store::deliveries;

/// What happens to an item now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Dispatch {
    /// Published to its lane.
    Send,
    /// Held: its destination is paused or its breaker is open.
    Hold,
    /// An earlier event of its key still has an undelivered pair for this ordered destination:
    /// not published now, its pair waits behind it in the deliveries table.
    Behind,
    /// No destination takes its event.
    Unroutable,
}

/// One (event, destination) pair of a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Item {
    /// Its event's index in the batch.
    pub(super) event: usize,
    /// Its lane (`None` for an unroutable event).
    pub(super) lane: Option<usize>,
    /// What happens to it now.
    pub(super) dispatch: Dispatch,
}

/// A batch's items, grouped by event.
#[derive(Debug, Default)]
pub(super) struct Items {
    /// Every item.
    pub(super) list: Vec<Item>,
    /// Per event: its items (contiguous).
    pub(super) spans: Vec<Range<usize>>,
}

impl Items {
    /// The items of events routed to `targets` (per event, its lanes; empty: unroutable), each
    /// sent unless `open(lane)` says its destination is held.
    pub(super) fn route(targets: Vec<Vec<usize>>, open: impl Fn(usize) -> bool) -> Self {
        let mut items = Self::default();
        for (event, lanes) in targets.into_iter().enumerate() {
            let start = items.list.len();
            if lanes.is_empty() {
                items.list.push(Item {
                    event,
                    lane: None,
                    dispatch: Dispatch::Unroutable,
                });
            }
            for lane in lanes {
                let dispatch = if open(lane) {
                    Dispatch::Send
                } else {
                    Dispatch::Hold
                };
                items.list.push(Item {
                    event,
                    lane: Some(lane),
                    dispatch,
                });
            }
            items.spans.push(start..items.list.len());
        }
        items
    }

    /// Keeps behind their key the items whose (lane, key) is in `waiting`; `key_of(item)` is the
    /// item's key when its lane keeps key order.
    pub(super) fn keep_behind<'k>(
        &mut self,
        waiting: &HashSet<(usize, &'k str)>,
        key_of: impl Fn(&Item) -> Option<(usize, &'k str)>,
    ) {
        for item in &mut self.list {
            if item.dispatch == Dispatch::Send && key_of(item).is_some_and(|k| waiting.contains(&k))
            {
                item.dispatch = Dispatch::Behind;
            }
        }
    }

    /// The items to publish.
    pub(super) fn sendable(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.list.len()).filter(|&i| self.list[i].dispatch == Dispatch::Send)
    }
}

impl Relay {
    /// The batch's items: one per event and destination that takes it (one unroutable item for
    /// an event none takes). With ordered destinations, an item whose key still has an
    /// undelivered pair for its destination waits behind it (DeliveriesKeysWaiting).
    pub(super) async fn items(&self, events: &[OutboxEvent]) -> Result<Items> {
        self.items_to(events, self.router.route_all(events), None)
            .await
    }

    /// The items of `events` routed to `targets` (per event, its lanes), kept behind their key
    /// as [`Relay::items`] does — behind the pairs of their own stream: live ones, or those of
    /// the replay `replay` (a replay's events and live ones never wait for each other).
    pub(super) async fn items_to(
        &self,
        events: &[OutboxEvent],
        targets: Vec<Vec<usize>>,
        replay: Option<uuid::Uuid>,
    ) -> Result<Items> {
        // Each gate read once per batch, not once per event: its lock is taken by every answer.
        let open: Vec<bool> = self.lanes.iter().map(|l| l.gate.is_open()).collect();
        let mut items = Items::route(targets, |lane| open[lane]);
        let key_of = |item: &Item| -> Option<(usize, &str)> {
            let lane = item.lane?;
            let event = &events[item.event];
            self.lanes[lane]
                .keeps_order_of(event)
                .then(|| (lane, event.key.as_deref().unwrap_or_default()))
        };
        let keyed: Vec<(usize, &str)> = items
            .list
            .iter()
            .filter(|i| i.dispatch == Dispatch::Send)
            .filter_map(key_of)
            .collect();
        if keyed.is_empty() {
            return Ok(items);
        }
        let names: Vec<&str> = keyed
            .iter()
            .map(|(lane, _)| self.lanes[*lane].name.as_str())
            .collect();
        let keys: Vec<&str> = keyed.iter().map(|(_, key)| *key).collect();
        let waiting =
            deliveries::keys_waiting(&self.store, (&names, &keys), &self.blocking, replay).await?;
        if waiting.is_empty() {
            return Ok(items);
        }
        let waiting: HashSet<(usize, &str)> = keyed
            .into_iter()
            .filter(|(lane, key)| {
                waiting
                    .iter()
                    .any(|(d, k)| d == &self.lanes[*lane].name && k == key)
            })
            .collect();
        items.keep_behind(&waiting, key_of);
        Ok(items)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_event_has_its_items_and_an_unroutable_one_has_one() {
        // Lane 1 is held (paused or breaker open).
        let items = Items::route(vec![vec![0, 1], vec![], vec![1]], |lane| lane != 1);
        let got: Vec<(usize, Option<usize>, Dispatch)> = items
            .list
            .iter()
            .map(|i| (i.event, i.lane, i.dispatch))
            .collect();
        assert_eq!(
            got,
            vec![
                (0, Some(0), Dispatch::Send),
                (0, Some(1), Dispatch::Hold),
                (1, None, Dispatch::Unroutable),
                (2, Some(1), Dispatch::Hold),
            ]
        );
        assert_eq!(items.spans, vec![0..2, 2..3, 3..4]);
        assert_eq!(items.sendable().collect::<Vec<_>>(), vec![0]);
    }

    #[test]
    fn items_whose_key_waits_stay_behind() {
        let mut items = Items::route(vec![vec![0, 1], vec![0]], |_| true);
        let keys = ["k1", "k2"];
        let waiting: HashSet<(usize, &str)> = [(0, "k1")].into_iter().collect();
        // Lane 0 keeps key order; lane 1 does not.
        items.keep_behind(&waiting, |i| {
            (i.lane == Some(0)).then(|| (0, keys[i.event]))
        });
        let got: Vec<Dispatch> = items.list.iter().map(|i| i.dispatch).collect();
        assert_eq!(got, vec![Dispatch::Behind, Dispatch::Send, Dispatch::Send]);
    }
}
