//! How a batch goes out through a batch API: grouped by target, cut into calls within the API's
//! limits, calls side by side — or, on a FIFO target, one after another per lane of message
//! groups — and each outcome recorded as its call is answered.

use std::collections::HashMap;
use std::ops::Range;

use futures::StreamExt;

use super::Record;
use crate::model::event::OutboxEvent;
use crate::model::outcome::Outcome;
use crate::model::template::Template;

/// How much one call of a batch API may carry.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    /// Most entries in one call.
    pub entries: usize,
    /// Most bytes of entries in one call (an entry larger than this goes alone: the service
    /// answers for it).
    pub bytes: usize,
}

/// How a batch API takes a batch: its limits, and which targets keep order (a FIFO queue or topic,
/// a stream), whose calls go one after another.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Calls {
    /// What one call may carry.
    pub limits: Limits,
    /// Whether a target keeps order.
    pub ordered: fn(&str) -> bool,
}

/// Cuts entries of `sizes` bytes, in order, into consecutive calls within `limits`.
pub(crate) fn calls(sizes: &[usize], limits: Limits) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (i, &size) in sizes.iter().enumerate() {
        let full = i - start == limits.entries || (i > start && bytes + size > limits.bytes);
        if full {
            out.push(start..i);
            (start, bytes) = (i, 0);
        }
        bytes += size;
    }
    if start < sizes.len() {
        out.push(start..sizes.len());
    }
    out
}

/// Groups positions by the target each is sent to (queue, topic, stream, bus), targets in the
/// order first seen and positions in order within each.
pub(crate) fn by_target(targets: Vec<String>) -> Vec<(String, Vec<usize>)> {
    let mut groups: Vec<(String, Vec<usize>)> = Vec::new();
    let mut at: HashMap<String, usize> = HashMap::new();
    for (i, target) in targets.into_iter().enumerate() {
        match at.get(&target) {
            Some(&g) => groups[g].1.push(i),
            None => {
                at.insert(target.clone(), groups.len());
                groups.push((target, vec![i]));
            }
        }
    }
    groups
}

/// The message group of `event` on a FIFO target (and the partition key of a stream): its key,
/// else its id (an event with no key is ordered after none). A key FIFO groups cannot take (more
/// than 128 characters, or any but printable ASCII) is sent as `sha256:` and its hash in hex: the
/// same key, the same group.
pub(crate) fn group(event: &OutboxEvent) -> String {
    use sha2::Digest;
    match event.key.as_deref() {
        Some(key)
            if key.len() <= 128 && !key.is_empty() && key.bytes().all(|b| b.is_ascii_graphic()) =>
        {
            key.to_owned()
        }
        Some(key) if !key.is_empty() => {
            format!("sha256:{:x}", sha2::Sha256::digest(key.as_bytes()))
        }
        _ => event.id.to_string(),
    }
}

/// Most calls one publish has in flight at once (each ordered lane counts one).
const CALLS_IN_FLIGHT: usize = 16;

/// How many calls to one FIFO target (queue, topic, stream) go out at once: each carries the
/// message groups of its own lane, one after another, so a group keeps its order.
const ORDERED_LANES: usize = 8;

/// Publishes `events` through a batch API: grouped by `targets[i]` (each event's queue, topic,
/// stream or bus), each target's events cut into calls by `sizes` and `limits`, and `send(target,
/// positions)` answering one outcome per position. Targets are sent to side by side, and so are
/// the calls of one target. On an `ordered` target (a FIFO queue or topic, a stream) the events
/// are first split by [`group`] into [`ORDERED_LANES`] lanes whose calls go one after another, and
/// an event whose group already failed in an earlier call is not sent (it would overtake).
pub(crate) async fn publish_batched<F, Fut>(
    events: &[&OutboxEvent],
    targets: Vec<String>,
    sizes: &[usize],
    limits: Limits,
    ordered: impl Fn(&str) -> bool,
    send: F,
    record: Record<'_>,
) where
    F: Fn(String, Vec<usize>) -> Fut,
    Fut: std::future::Future<Output = Vec<Outcome>>,
{
    let send = &send;
    let mut lanes = Vec::new();
    for (target, positions) in by_target(targets) {
        let chunked = |lane: Vec<usize>| -> Vec<Vec<usize>> {
            let own: Vec<usize> = lane.iter().map(|&i| sizes[i]).collect();
            calls(&own, limits)
                .into_iter()
                .map(|r| lane[r].to_vec())
                .collect()
        };
        if ordered(&target) {
            for lane in lanes_by_group(events, positions) {
                lanes.push((target.clone(), chunked(lane), true));
            }
        } else {
            // Every call on its own: none waits for another.
            for part in chunked(positions) {
                lanes.push((target.clone(), vec![part], false));
            }
        }
    }
    let runs = lanes.into_iter().map(|(target, parts, ordered)| async move {
        let mut failed: std::collections::HashSet<String> = Default::default();
        for part in parts {
            let (held, sent): (Vec<usize>, Vec<usize>) = part
                .into_iter()
                .partition(|&i| ordered && failed.contains(&group(events[i])));
            for i in held {
                record.unsent(
                    i,
                    Outcome::retry(
                        "an earlier event of its key was not accepted by this FIFO target; sent after it",
                    ),
                );
            }
            if sent.is_empty() {
                continue;
            }
            let outcomes = send(target.clone(), sent.clone()).await;
            let answered: Vec<(usize, Outcome)> = sent.into_iter().zip(outcomes).collect();
            for (i, outcome) in &answered {
                if ordered && !matches!(outcome, Outcome::Delivered) {
                    failed.insert(group(events[*i]));
                }
            }
            record.call(answered);
        }
    });
    futures::stream::iter(runs)
        .buffer_unordered(CALLS_IN_FLIGHT)
        .collect::<()>()
        .await;
}

/// Splits `positions` into at most [`ORDERED_LANES`] lanes, every event of a [`group`] in the
/// same lane, in order.
fn lanes_by_group(events: &[&OutboxEvent], positions: Vec<usize>) -> Vec<Vec<usize>> {
    use std::hash::{Hash, Hasher};
    let mut lanes = vec![Vec::new(); ORDERED_LANES];
    for i in positions {
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        group(events[i]).hash(&mut hasher);
        lanes[(hasher.finish() % ORDERED_LANES as u64) as usize].push(i);
    }
    lanes.retain(|lane| !lane.is_empty());
    lanes
}

/// [`publish_batched`] of each event to the target `target` names for it, as the entry `entry`
/// makes of it (from its name within its call, the event and the target: the entry and its size,
/// or why it cannot be made), in `calls`: `send(target, entries)` makes one call.
pub(crate) async fn publish_each<E, F, Fut>(
    events: &[&OutboxEvent],
    target: &Template,
    calls: Calls,
    entry: impl Fn(usize, &OutboxEvent, &str) -> Result<(E, usize), String>,
    send: F,
    record: Record<'_>,
) where
    E: Clone,
    F: Fn(String, Vec<E>) -> Fut,
    Fut: std::future::Future<Output = Vec<Outcome>>,
{
    let targets: Vec<String> = events.iter().map(|e| target.render(e)).collect();
    let entries: Vec<_> = events
        .iter()
        .zip(&targets)
        .enumerate()
        .map(|(i, (e, t))| entry(i, e, t))
        .collect();
    let sizes: Vec<usize> = entries
        .iter()
        .map(|e| e.as_ref().map_or(0, |(_, size)| *size))
        .collect();
    let (send, entries) = (&send, &entries);
    let send_one = |target, positions: Vec<usize>| async move {
        send_built(&positions, entries, |built| send(target, built)).await
    };
    let Calls { limits, ordered } = calls;
    publish_batched(events, targets, &sizes, limits, ordered, send_one, record).await
}

/// Sends the entries made for `positions` in one call through `send`, one outcome per position: a
/// position whose entry could not be made is rejected with the reason, unsent.
pub(crate) async fn send_built<E, Fut>(
    positions: &[usize],
    entries: &[Result<(E, usize), String>],
    send: impl FnOnce(Vec<E>) -> Fut,
) -> Vec<Outcome>
where
    E: Clone,
    Fut: std::future::Future<Output = Vec<Outcome>>,
{
    let mut out: Vec<Option<Outcome>> = vec![None; positions.len()];
    let mut built = Vec::with_capacity(positions.len());
    let mut sent = Vec::with_capacity(positions.len());
    for (k, &i) in positions.iter().enumerate() {
        match &entries[i] {
            Ok((entry, _)) => {
                built.push(entry.clone());
                sent.push(k);
            }
            Err(reason) => {
                out[k] = Some(Outcome::Rejected {
                    reason: reason.clone(),
                })
            }
        }
    }
    if !built.is_empty() {
        for (k, outcome) in sent.into_iter().zip(send(built).await) {
            out[k] = Some(outcome);
        }
    }
    out.into_iter()
        .map(|o| o.unwrap_or_else(|| Outcome::retry("no answer for this entry")))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[test]
    #[allow(clippy::single_range_in_vec_init)] // a cut into one call is one range
    fn batches_are_cut_by_entries_and_bytes() {
        let ten = Limits {
            entries: 3,
            bytes: 100,
        };
        for (sizes, expected) in [
            (vec![], vec![]),
            (vec![1], vec![0..1]),
            (vec![1; 7], vec![0..3, 3..6, 6..7]),
            (vec![60, 30, 20, 100, 5], vec![0..2, 2..3, 3..4, 4..5]),
            // An entry larger than a call goes alone.
            (vec![500, 1, 1], vec![0..1, 1..3]),
            (vec![1, 500], vec![0..1, 1..2]),
        ] {
            assert_eq!(calls(&sizes, ten), expected, "{sizes:?}");
        }
    }
    #[test]
    fn targets_group_positions_in_first_seen_order() {
        let names = ["b", "a", "b", "c", "a"].map(String::from).to_vec();
        assert_eq!(
            by_target(names),
            vec![
                ("b".to_owned(), vec![0, 2]),
                ("a".to_owned(), vec![1, 4]),
                ("c".to_owned(), vec![3]),
            ]
        );
    }
    #[test]
    fn groups_are_keys_fifo_takes() {
        use crate::model::event::testing::event;
        assert_eq!(group(&event("t", Some("k1"), &[])), "k1");
        let none = event("t", None, &[]);
        assert_eq!(group(&none), none.id.to_string());
        let wide = group(&event("t", Some("clé"), &[]));
        assert!(wide.starts_with("sha256:") && wide.len() == 71, "{wide}");
        assert_eq!(wide, group(&event("u", Some("clé"), &[])), "stable");
        assert!(group(&event("t", Some(&"k".repeat(129)), &[])).starts_with("sha256:"));
    }
    /// Publishes four events, keys `a`, `b`, `a`, `b`, one per call, the first call failing;
    /// returns the calls made and each event's outcome.
    async fn one_per_call(ordered: bool) -> (Vec<Vec<usize>>, Vec<Option<Outcome>>) {
        use crate::model::event::testing::event;
        let events: Vec<OutboxEvent> = ["a", "b", "a", "b"]
            .iter()
            .map(|k| event("t", Some(k), &[]))
            .collect();
        let refs: Vec<&OutboxEvent> = events.iter().collect();
        let calls = Mutex::new(Vec::new());
        let answers = super::super::Collected::new(4);
        let send = |_target: String, positions: Vec<usize>| {
            calls.lock().expect("calls").push(positions.clone());
            async move {
                positions
                    .iter()
                    .map(|&i| match i {
                        0 => Outcome::retry("refused"),
                        _ => Outcome::Delivered,
                    })
                    .collect()
            }
        };
        let one = Limits {
            entries: 1,
            bytes: 100,
        };
        let targets = vec!["q.fifo".to_owned(); 4];
        publish_batched(&refs, targets, &[1; 4], one, |_| ordered, send, &answers).await;
        let mut calls = calls.into_inner().expect("calls");
        calls.sort();
        (calls, answers.into_outcomes())
    }
    #[tokio::test]
    async fn an_ordered_target_holds_a_key_back_after_its_failure() {
        let (calls, answers) = one_per_call(true).await;
        assert_eq!(
            calls,
            [vec![0], vec![1], vec![3]],
            "the second `a` is not sent"
        );
        assert!(
            matches!(&answers[2], Some(Outcome::Retry { reason, .. }) if reason.contains("earlier event of its key"))
        );
        assert_eq!(answers[1], Some(Outcome::Delivered));
        assert_eq!(answers[3], Some(Outcome::Delivered));

        let (calls, answers) = one_per_call(false).await;
        assert_eq!(calls.len(), 4, "unordered: every call goes out");
        assert_eq!(answers[2], Some(Outcome::Delivered));
    }
}
