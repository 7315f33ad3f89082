//! `bench routing`: what routing one event costs as the destinations grow, with the relay's own
//! router ([`pgoutbox::route::Router`]). Each destination subscribes to its own topic (`t.<i>`),
//! as a SaaS's customers' endpoints would; one in ten uses a glob (`g.<i>.*`) instead, and one
//! in a hundred has a CEL filter, so that exact lookups, the glob automaton and filters are all
//! in the way. Events are spread evenly over the topics. No database is read: this is the pure
//! routing step of a batch, timed over whole batches.

use std::time::Instant;

use pgoutbox::model::event::OutboxEvent;
use pgoutbox::model::filter::Filter;
use pgoutbox::model::subscription::Subscription;
use pgoutbox::route::Router;
use serde_json::value::RawValue;

use super::output::{Output, Row};

/// Arguments of `bench routing`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Destination counts to measure, one run each (the first is the reference of the ratios).
    #[arg(long, value_delimiter = ',', default_value = "1,100,1000,10000,100000")]
    counts: Vec<usize>,
    /// Events routed per run, in batches of `--batch-size`.
    #[arg(long, default_value_t = 200_000)]
    events: usize,
    /// Events per batch (the relay's `batch_size`).
    #[arg(long, default_value_t = 500)]
    batch_size: usize,
}

/// The subscription of destination `i`: its own topic, every tenth a glob, every hundredth
/// a filter.
fn subscription(i: usize) -> anyhow::Result<Subscription> {
    let topic = if i % 10 == 9 {
        format!("g.{i}.*")
    } else {
        format!("t.{i}")
    };
    let filter = if i % 100 == 99 {
        Some(Filter::compile("payload.n >= 0").map_err(anyhow::Error::msg)?)
    } else {
        None
    };
    Ok(Subscription {
        topics: vec![topic],
        filter,
    })
}

/// Event `n` of a run over `count` destinations: for destination `n % count`.
fn event(n: usize, count: usize) -> anyhow::Result<OutboxEvent> {
    let i = n % count;
    let topic = if i % 10 == 9 {
        format!("g.{i}.created")
    } else {
        format!("t.{i}")
    };
    Ok(OutboxEvent {
        id: uuid::Uuid::now_v7(),
        seq: n as i64,
        topic,
        key: None,
        payload: RawValue::from_string(format!("{{\"n\":{n}}}"))?,
        headers: Vec::new(),
        created_at: chrono::Utc::now(),
        attempts: 0,
    })
}

/// Runs `bench routing`: one row per destination count, with its ratio to the first.
pub async fn run(out: &Output, args: &Args) -> anyhow::Result<()> {
    if args.counts.is_empty() || args.counts.contains(&0) || args.batch_size == 0 {
        anyhow::bail!("--counts and --batch-size: give numbers of 1 or more, e.g. --counts 1,1000");
    }
    let mut reference: Option<f64> = None;
    for &count in &args.counts {
        let built = Instant::now();
        let subscriptions = (0..count)
            .map(subscription)
            .collect::<anyhow::Result<Vec<_>>>()?;
        let router = Router::new(&subscriptions);
        let build = built.elapsed();
        let events = (0..args.events)
            .map(|n| event(n, count))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let bar = out.bar(
            events.len() as u64,
            &format!("routing over {count} destinations"),
        );
        let started = Instant::now();
        let mut routed = 0usize;
        for batch in events.chunks(args.batch_size) {
            routed += router.route_all(batch).iter().map(Vec::len).sum::<usize>();
            bar.inc(batch.len() as u64);
        }
        let per_event = started.elapsed().as_nanos() as f64 / events.len() as f64;
        bar.finish_and_clear();
        if routed != events.len() {
            anyhow::bail!(
                "{routed} routes for {} events: each should have one",
                events.len()
            );
        }
        let ratio = per_event / *reference.get_or_insert(per_event);
        out.row(Row {
            scenario: "routing".into(),
            variant: format!("{count} destinations"),
            value: per_event,
            unit: "ns/event",
            detail: format!(
                "{ratio:.2}× the first count; router built in {} ms",
                build.as_millis()
            ),
        });
    }
    Ok(())
}
