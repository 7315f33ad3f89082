//! The settler: what a batch did, written where each event's state lives, and what follows from
//! it. It owns the plan (judged, then made by one constructor per kind of batch), the write, the
//! breakers its answers opened, and the outcome metrics (delivered, failed, dead-lettered and held
//! events per destination and topic, and the time from commit to delivery, counted once per group
//! rather than per event), so that every path that settles — a batch of events, what it handed
//! over with its request out, a batch of pairs, a probe — settles the same way.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use opentelemetry::KeyValue;
use tracing::{debug, warn};
use uuid::Uuid;

use super::plan::{Batch, Late, PairsPlan, Planned};
use super::verdict::{Attempts, Verdict};
use super::Lanes;
use crate::error::Result;
use crate::model::event::OutboxEvent;
use crate::model::metric;
use crate::model::report::{BatchReport, DeliveredRows};
use crate::sinks::gate::Gate;
use crate::store::deliveries::PairState;
use crate::store::outbox::{self, Guard};
use crate::store::settle::{self as write, Rows, SettlePlan};
use crate::store::SettleMode;
use crate::store::{destinations, Store};

/// A batch of pairs claimed from the deliveries table, as its settle sees it.
#[derive(Debug, Clone, Copy)]
pub struct Pairs<'a> {
    /// Their events (each event's `attempts` are its pair's), in order.
    pub events: &'a [OutboxEvent],
    /// Pairs that cannot be read as events (event id, destination, why): dead-lettered.
    pub poison: &'a [(Uuid, String, String)],
    /// The lease token they were claimed under.
    pub token: Uuid,
}

/// What a settle of a batch of events came to.
#[derive(Debug, Default)]
pub struct Settled {
    /// Its counts.
    pub report: BatchReport,
    /// The events it scheduled for another attempt.
    pub retried: Vec<Uuid>,
    /// WAL: the rows it delivered everywhere, written later with other batches'.
    pub delivered_rows: DeliveredRows,
    /// Claimed events of one destination whose request is still out: their rows wait under the
    /// batch's lease until [`Settler::late`] settles them.
    pub leased_rows: Vec<Uuid>,
}

/// Writes what batches did (see the module's documentation).
#[derive(Debug, Clone)]
pub struct Settler {
    store: Store,
    mode: SettleMode,
    /// Ordered claims: the destinations whose dead events hold back their key. A failed or held
    /// claimed event parks its key's later rows behind it.
    park: Option<Arc<[String]>>,
}

impl Settler {
    /// Settles through `store`, delivered rows becoming what `mode` says; `park`: ordered claims,
    /// with the destinations whose dead events hold back their key.
    pub fn new(store: Store, mode: SettleMode, park: Option<Vec<String>>) -> Self {
        Self {
            store,
            mode,
            park: park.map(Into::into),
        }
    }

    /// What delivered rows become.
    pub fn mode(&self) -> SettleMode {
        self.mode
    }

    /// Settles a batch of events from what publishing left of its items (`attempts`) under
    /// `guard`: each on its own row or split
    /// into pairs ([`Planned::batch`]), poison rows dead-lettered, rows nobody answered (and
    /// those cut off behind their key) given back. `aborted`: the shutdown grace period cut it short.
    pub async fn batch(
        &self,
        batch: &Batch<'_>,
        attempts: Attempts,
        guard: Guard,
        lanes: &dyn Lanes,
        aborted: bool,
    ) -> Result<Settled> {
        let planned = Planned::batch(batch, attempts, lanes)?;
        for (id, reason) in batch.poison {
            warn!(event_id = %id, error = %reason, "dead-lettering a row that cannot be read as an event");
        }
        let released = planned.untouched.len() - batch.cut_off.len();
        if aborted && released > 0 {
            // Shutdown grace is over: what finished is settled, the rest goes back untouched.
            warn!(
                released,
                "shutdown grace period over: released an unfinished batch"
            );
        }
        let started = Instant::now();
        let wall = SystemTime::now();
        let guard = match guard {
            Guard::Transaction(mut unit) if !planned.leased_rows.is_empty() => {
                // The rows whose request is out go under a lease, settled later by its token.
                let (rows, lease) = (&planned.leased_rows, planned.lease);
                outbox::lease_many(&self.store, &mut unit, rows, lease).await?;
                Guard::Transaction(unit)
            }
            // Lease mode: the rows are leased already (the batch's token), for longer than the
            // batch may last.
            guard => guard,
        };
        let plan = &planned.plan;
        // WAL: no claim reads the rows, so there are no followers to park.
        let park = self.park.as_deref().filter(|_| !plan.defer_delivered);
        let rows = Rows {
            mode: self.mode,
            untouched: &planned.untouched,
            park,
        };
        let written = write::apply(&self.store, guard, plan, rows).await?;
        metrics::histogram!(metric::SETTLE_SECONDS).record(started.elapsed().as_secs_f64());
        record(batch.events, plan, lanes);
        self.store_breakers(&lanes.tripped_gates()).await;
        fenced_warning(
            written.fenced,
            "lease lost before settle: another relay re-claimed these events",
        );
        let mut report = plan.report();
        report += planned.pairs;
        report.claimed = batch.events.len() + batch.poison.len();
        report.fenced = written.fenced;
        report.released = planned.untouched.len();
        span(wall, &report);
        debug!(
            claimed = report.claimed,
            delivered = report.delivered,
            retried = report.retried,
            dead = report.dead,
            held = report.held,
            released = report.released,
            "batch settled"
        );
        Ok(Settled {
            report,
            retried: plan
                .failed
                .iter()
                .filter(|f| !f.dead)
                .map(|f| f.id)
                .collect(),
            delivered_rows: plan.delivered_rows(),
            leased_rows: planned.leased_rows,
        })
    }

    /// Settles what a batch handed over with its request still out, once the answers came (or
    /// the budget ran out), under the batch's `token`: rows in `leased_rows` on the outbox table
    /// (given back due now when unanswered), the others as pairs of the deliveries table
    /// (deleted when delivered, due again when unanswered). What the token no longer holds (its
    /// lease ran out and another relay took it) is left alone.
    pub async fn late(
        &self,
        events: &[OutboxEvent],
        attempts: Attempts,
        token: Uuid,
        leased_rows: &[Uuid],
        lanes: &dyn Lanes,
    ) -> Result<BatchReport> {
        if attempts.list.is_empty() {
            return Ok(BatchReport::default());
        }
        let Late {
            rows,
            untouched_rows,
            pairs,
            untouched_pairs,
        } = Planned::late(events, attempts, leased_rows, lanes);
        let mut fenced = 0;
        if !leased_rows.is_empty() {
            let written = Rows {
                mode: self.mode,
                untouched: &untouched_rows,
                park: self.park.as_deref(),
            };
            let guard = Guard::Lease(token);
            fenced += write::apply(&self.store, guard, &rows, written)
                .await?
                .fenced;
        }
        if pairs.has_pairs() || !untouched_pairs.is_empty() {
            let written = write::apply_pairs(&self.store, token, &pairs, &untouched_pairs).await?;
            fenced += written.fenced;
        }
        for plan in [&rows, &pairs] {
            record(events, plan, lanes);
        }
        self.store_breakers(&lanes.tripped_gates()).await;
        fenced_warning(
            fenced,
            "lease lost before settle: another relay re-claimed these events",
        );
        let mut report = rows.report();
        report += pairs.report();
        report.fenced = fenced;
        report.released = untouched_rows.len();
        Ok(report)
    }

    /// Settles `pairs` claimed from the deliveries table from their `attempts`: each on its own
    /// pair row, under their lease. `aborted`: the shutdown grace period cut them short.
    pub async fn pairs(
        &self,
        pairs: &Pairs<'_>,
        attempts: Attempts,
        lanes: &dyn Lanes,
        aborted: bool,
    ) -> Result<BatchReport> {
        let Pairs {
            events,
            poison,
            token,
        } = *pairs;
        let PairsPlan { plan, untouched } = PairsPlan::of(events, attempts, poison, lanes);
        for (id, name, reason) in poison {
            warn!(event_id = %id, destination = %name, error = %reason, "dead-lettering a delivery that cannot be read as an event");
        }
        let written = write::apply_pairs(&self.store, token, &plan, &untouched).await?;
        record(events, &plan, lanes);
        self.store_breakers(&lanes.tripped_gates()).await;
        fenced_warning(
            written.fenced,
            "delivery lease lost before settle: another relay re-claimed these pairs",
        );
        if aborted && !untouched.is_empty() {
            warn!(
                released = untouched.len(),
                "shutdown grace period over: released unfinished deliveries"
            );
        }
        let mut report = plan.report();
        report.claimed = events.len() + poison.len();
        report.fenced = written.fenced;
        report.released = untouched.len();
        Ok(report)
    }

    /// Settles one event alone (a probe's) with verdict `v` for `destination`: on its row under
    /// `guard`, or, with a lease token, on its pair row.
    pub async fn one(
        &self,
        event: &OutboxEvent,
        destination: &str,
        v: Verdict,
        guard: Guard,
        lanes: &dyn Lanes,
    ) -> Result<()> {
        // A probe that failed puts its event back as it was: nothing to count.
        let answered = !matches!(v, Verdict::Held(_));
        let plan = SettlePlan::of_one(event, destination, v);
        self.write_alone(&plan, guard).await?;
        if answered {
            record(std::slice::from_ref(event), &plan, lanes);
        }
        Ok(())
    }

    /// Dead-letters one row (`destination`: a pair, under `guard`'s lease) that cannot be read
    /// as an event.
    pub async fn unreadable(
        &self,
        id: Uuid,
        destination: Option<&str>,
        reason: &str,
        guard: Guard,
    ) -> Result<()> {
        let plan = SettlePlan::of_unreadable(id, destination, reason);
        self.write_alone(&plan, guard).await
    }

    /// Writes the plan of one event settled alone: on its pair row under a lease token (a probe
    /// takes pairs leased), or on its row under the probe's transaction.
    async fn write_alone(&self, plan: &SettlePlan, guard: Guard) -> Result<()> {
        match guard {
            Guard::Lease(token) => {
                write::apply_pairs(&self.store, token, plan, &[]).await?;
            }
            guard => {
                let rows = Rows {
                    mode: self.mode,
                    untouched: &[],
                    park: None,
                };
                write::apply(&self.store, guard, plan, rows).await?;
            }
        }
        Ok(())
    }

    /// WAL: writes the rows that settled batches delivered everywhere, several batches' at once.
    pub async fn delivered_rows(&self, rows: &DeliveredRows) -> Result<u64> {
        let started = Instant::now();
        let written = write::write_delivered(&self.store, rows, self.mode).await?;
        metrics::histogram!(metric::SETTLE_SECONDS).record(started.elapsed().as_secs_f64());
        Ok(written)
    }

    /// Stores the breakers that `gates`' answers opened, so every relay holds those
    /// destinations' events; one line each, as the state changes.
    pub async fn store_breakers(&self, gates: &[&Gate]) {
        for gate in gates {
            let Some(reason) = gate.take_tripped() else {
                continue;
            };
            let policy = gate.policy();
            warn!(
                destination = %gate.name(),
                failures = policy.failures,
                error = %reason,
                "circuit breaker open: holding this destination's events, probing until it answers"
            );
            let opened =
                destinations::open(&self.store, gate.name(), &reason, policy.probe_interval);
            if let Err(e) = opened.await {
                warn!(destination = %gate.name(), error = %crate::error_chain(&e), "cannot store the breaker state");
            }
        }
    }
}

/// Warns when a settle was fenced: rows or pairs it named were not written (`why`).
fn fenced_warning(fenced: u64, why: &str) {
    if fenced > 0 {
        warn!(fenced, "{why}");
    }
}

/// The settle's span.
fn span(wall: SystemTime, report: &BatchReport) {
    crate::otlp::batch_span("settle", wall, || {
        vec![
            KeyValue::new("pgoutbox.delivered", report.delivered as i64),
            KeyValue::new("pgoutbox.retried", report.retried as i64),
            KeyValue::new("pgoutbox.dead", report.dead as i64),
            KeyValue::new("pgoutbox.held", report.held as i64),
            KeyValue::new("pgoutbox.fenced", report.fenced as i64),
        ]
    });
}

/// How far [`ById::find`] looks ahead of its walk before it asks the map: a destination's ids
/// come in its batch's order, with gaps where it took no event (filtered, held, failed).
const LOOK_AHEAD: usize = 32;

/// A batch's events found by id: walking ahead when the ids come in the events' order (no
/// hashing: this runs for every delivered pair), by a map built on the first id out of order.
struct ById<'a> {
    events: &'a [OutboxEvent],
    map: std::cell::OnceCell<HashMap<Uuid, usize>>,
}

impl<'a> ById<'a> {
    fn new(events: &'a [OutboxEvent]) -> Self {
        Self {
            events,
            map: std::cell::OnceCell::new(),
        }
    }

    /// The event `id`, looked for from `walk` on (which moves past it).
    fn find(&self, walk: &mut usize, id: &Uuid) -> Option<&'a OutboxEvent> {
        let ahead = self.events.get(*walk..).unwrap_or_default();
        let at = match ahead.iter().take(LOOK_AHEAD).position(|e| e.id == *id) {
            Some(offset) => *walk + offset,
            None => *self
                .map
                .get_or_init(|| {
                    self.events
                        .iter()
                        .enumerate()
                        .map(|(i, e)| (e.id, i))
                        .collect()
                })
                .get(id)?,
        };
        *walk = at + 1;
        self.events.get(at)
    }
}

/// Counts by key, for the few distinct keys of a batch (topics, destinations): a look at the
/// last key, then a short list, instead of hashing each entry.
struct Tally<K>(Vec<(K, u64)>);

impl<K: PartialEq> Tally<K> {
    fn add(&mut self, key: K, n: u64) {
        match self.0.iter_mut().rev().find(|(k, _)| *k == key) {
            Some((_, count)) => *count += n,
            None => self.0.push((key, n)),
        }
    }
}

/// Counts a settled batch's outcomes per (destination, topic): one metric update per group, not
/// per event, to keep the hot path cheap. Each destination's series are labelled as `lanes` says
/// (the destinations managed at runtime together).
fn record(events: &[OutboxEvent], plan: &SettlePlan, lanes: &dyn Lanes) {
    let by_id = ById::new(events);
    let now = chrono::Utc::now();
    for (destination, ids) in plan.delivered.iter().chain(&plan.pairs_delivered) {
        let mut per_topic = Tally(Vec::new());
        let series = lanes.series(destination);
        let latency = metrics::histogram!(metric::COMMIT_TO_PUBLISH_SECONDS, "destination" => series.to_owned());
        let mut walk = 0;
        for id in ids {
            if let Some(e) = by_id.find(&mut walk, id) {
                per_topic.add(e.topic.as_str(), 1);
                latency.record(
                    (now - e.created_at).num_microseconds().unwrap_or(0).max(0) as f64 / 1e6,
                );
            }
        }
        metric::count_delivered(destination, ids.len() as u64);
        for (topic, n) in per_topic.0 {
            metrics::counter!(metric::PUBLISHED_TOTAL, "destination" => series.to_owned(), "topic" => metric::series_topic(series, topic).to_owned())
                .increment(n);
        }
    }
    let mut held = Tally(Vec::new());
    for h in &plan.held {
        held.add(lanes.series(&h.destination), 1);
    }
    for p in plan.pairs.iter().filter(|p| p.state == PairState::Held) {
        held.add(lanes.series(&p.destination), 1);
    }
    for b in &plan.bundles {
        held.add(lanes.series(&b.destination), b.count as u64);
    }
    for (destination, n) in held.0 {
        metrics::counter!(metric::HELD_TOTAL, "destination" => destination.to_owned()).increment(n);
    }
    let mut failures = Tally(Vec::new());
    let mut walk = 0;
    for f in &plan.failed {
        if let Some(e) = by_id.find(&mut walk, &f.id) {
            let destination = f.destination.as_deref().unwrap_or("(unrouted)");
            let series = lanes.series(destination);
            failures.add((series, metric::series_topic(series, &e.topic), f.dead), 1);
        }
    }
    let mut walk = 0;
    for p in &plan.pairs {
        let PairState::Failed { dead } = p.state else {
            continue;
        };
        if let Some(e) = by_id.find(&mut walk, &p.event_id) {
            let series = lanes.series(&p.destination);
            failures.add((series, metric::series_topic(series, &e.topic), dead), 1);
        }
    }
    for ((destination, topic, dead), n) in failures.0 {
        let name = if dead {
            metric::DEAD_LETTERED_TOTAL
        } else {
            metric::FAILED_TOTAL
        };
        metrics::counter!(name, "destination" => destination.to_owned(), "topic" => topic.to_owned()).increment(n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::event::testing::event;
    use crate::model::retry::RetryPolicy;
    use crate::settle::testing::OneLane;

    /// Ids looked up in one walk (as positions in a batch of 100 events) → what is found.
    #[test]
    fn events_are_found_by_id_in_order_with_gaps_and_out_of_order() {
        let events: Vec<OutboxEvent> = (0..100).map(|_| event("t", None, &[])).collect();
        let by_id = ById::new(&events);
        let cases: Vec<Vec<usize>> = vec![
            (0..100).collect(),
            (0..100).step_by(3).collect(),
            vec![5, 90, 91],
            (0..100).rev().collect(),
            vec![50, 10, 60, 0, 99],
        ];
        for (i, positions) in cases.into_iter().enumerate() {
            let mut walk = 0;
            let found: Vec<usize> = positions
                .iter()
                .filter_map(|&p| by_id.find(&mut walk, &events[p].id))
                .map(|e| events.iter().position(|x| x.id == e.id).expect("an event"))
                .collect();
            assert_eq!(found, positions, "case {i}");
        }
        let mut walk = 0;
        assert!(
            by_id.find(&mut walk, &Uuid::new_v4()).is_none(),
            "not in the batch"
        );
        assert!(ById::new(&[]).find(&mut 0, &events[0].id).is_none());
    }

    #[test]
    fn the_destinations_managed_at_runtime_are_counted_in_one_series() {
        let events: Vec<OutboxEvent> = (0..3).map(|_| event("t", None, &[])).collect();
        let mut plan = SettlePlan::default();
        for (destination, e) in ["customer-1", "customer-2", "billing"].iter().zip(&events) {
            plan.delivered.insert((*destination).to_owned(), vec![e.id]);
        }
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, || {
            record(&events, &plan, &OneLane(RetryPolicy::default()))
        });
        let scrape = handle.render();
        assert!(!scrape.contains("customer-"), "{scrape}");
        assert!(
            scrape.contains(
                r#"pgoutbox_events_published_total{destination="(runtime)",topic="(all)"} 2"#
            ),
            "{scrape}"
        );
        assert!(
            scrape
                .contains(r#"pgoutbox_events_published_total{destination="billing",topic="t"} 1"#),
            "{scrape}"
        );
    }

    #[test]
    fn a_tally_counts_per_key() {
        let mut tally = Tally(Vec::new());
        for (key, n) in [("a", 1), ("a", 2), ("b", 1), ("a", 1), ("c", 5)] {
            tally.add(key, n);
        }
        assert_eq!(tally.0, vec![("a", 4), ("b", 1), ("c", 5)]);
    }
}
