//! Commit→publish latency: the producers' commit times (read from the producer process) and the
//! receiver's arrival times, both in µs since the epoch on the same clock, joined by event id
//! into percentiles overall and per second.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use super::producer::{unix_micros, Producer, Spec};
use super::receiver::Receiver;

/// A receiver that records each event's arrival time (µs since the epoch) by id.
pub async fn timed_receiver() -> anyhow::Result<(Receiver, Times)> {
    let received: Arc<Mutex<HashMap<String, u64>>> = Arc::default();
    let rec = received.clone();
    let receiver = Receiver::with_hook(move |id| {
        let at = unix_micros(SystemTime::now());
        if let Ok(mut m) = rec.lock() {
            m.entry(id.to_owned()).or_insert(at);
        }
    })
    .await?;
    Ok((receiver, received))
}

/// Event ids with a time in µs since the epoch (commit or arrival).
pub type Times = Arc<Mutex<HashMap<String, u64>>>;

/// Starts a reporting producer process and collects its commits (id → µs) on a blocking thread;
/// the handle ends with the producer and gives its commit count.
pub fn follow_producer(
    spec: &Spec<'_>,
) -> anyhow::Result<(tokio::task::JoinHandle<anyhow::Result<u64>>, Times)> {
    let committed: Arc<Mutex<HashMap<String, u64>>> = Arc::default();
    let sink = committed.clone();
    let producer = Producer::spawn(spec)?;
    let handle = tokio::task::spawn_blocking(move || {
        producer.follow(|id, at| {
            if let Ok(mut m) = sink.lock() {
                m.insert(id.to_owned(), at);
            }
        })
    });
    Ok((handle, committed))
}

/// Commit→publish latencies, by commit time.
#[derive(Debug, Default)]
pub struct Latencies {
    /// (commit time µs since the epoch, latency µs).
    samples: Vec<(u64, u64)>,
}

/// Percentiles of a set of latencies, in ms.
/// The median of `values` (ratios of interleaved runs, mostly); NaN when empty.
pub fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted.get(sorted.len() / 2).copied().unwrap_or(f64::NAN)
}

#[derive(Debug, Clone, Copy)]
pub struct Summary {
    /// Samples.
    pub count: usize,
    /// Median.
    pub p50: f64,
    /// 95th percentile.
    pub p95: f64,
    /// 99th percentile.
    pub p99: f64,
    /// 99.9th percentile.
    pub p999: f64,
    /// Largest.
    pub max: f64,
}

impl Summary {
    /// Percentiles of `latencies` (µs).
    pub fn of(mut latencies: Vec<u64>) -> Self {
        latencies.sort_unstable();
        let pct = |p: f64| {
            latencies
                .get(((latencies.len() as f64 * p) as usize).min(latencies.len().saturating_sub(1)))
                .map(|us| *us as f64 / 1000.0)
                .unwrap_or(f64::NAN)
        };
        Self {
            count: latencies.len(),
            p50: pct(0.50),
            p95: pct(0.95),
            p99: pct(0.99),
            p999: pct(0.999),
            max: latencies
                .last()
                .map(|us| *us as f64 / 1000.0)
                .unwrap_or(f64::NAN),
        }
    }
}

impl Latencies {
    /// Pairs commits with arrivals (both µs since the epoch) by event id.
    pub fn join(committed: &HashMap<String, u64>, received: &HashMap<String, u64>) -> Self {
        let samples = committed
            .iter()
            .filter_map(|(id, c)| received.get(id).map(|r| (*c, r.saturating_sub(*c))))
            .collect();
        Self { samples }
    }

    /// All of them.
    pub fn summary(&self) -> Summary {
        Summary::of(self.samples.iter().map(|(_, l)| *l).collect())
    }

    /// Per second of commit time (seconds since the epoch), in order.
    pub fn per_second(&self) -> BTreeMap<u64, Summary> {
        let mut by_second: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
        for (at, l) in &self.samples {
            by_second.entry(at / 1_000_000).or_default().push(*l);
        }
        by_second
            .into_iter()
            .map(|(s, v)| (s, Summary::of(v)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latencies_are_summarised_overall_and_per_second() {
        // Commits in two seconds; latencies 1..=100 ms in the first, 500 ms once in the second.
        let mut committed = HashMap::new();
        let mut received = HashMap::new();
        for i in 1..=100u64 {
            committed.insert(format!("a{i}"), 10_000_000 + i);
            received.insert(format!("a{i}"), 10_000_000 + i + i * 1000);
        }
        committed.insert("b".into(), 11_000_000);
        received.insert("b".into(), 11_500_000);
        committed.insert("lost".into(), 11_000_001);
        let l = Latencies::join(&committed, &received);
        let all = l.summary();
        assert_eq!(all.count, 101);
        assert_eq!(all.max, 500.0);
        let seconds = l.per_second();
        assert_eq!(seconds.len(), 2);
        assert_eq!(seconds[&10].max, 100.0);
        assert_eq!(seconds[&10].p50, 51.0);
        assert_eq!(seconds[&11].count, 1);
    }
}
