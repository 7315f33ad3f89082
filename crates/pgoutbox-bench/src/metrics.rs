//! Reading the relay's Prometheus scrape: its histograms (claim and settle times, batch sizes),
//! as bucket counts whose quantiles are bucket bounds, and its counters.

use std::collections::BTreeMap;

/// A histogram from a Prometheus scrape: cumulative bucket counts by upper bound, summed over
/// label sets.
#[derive(Debug, Clone, Default)]
pub struct Histogram {
    buckets: BTreeMap<u64, f64>,
}

impl Histogram {
    /// Reads `<name>_bucket` lines from `scrape`.
    pub fn parse(scrape: &str, name: &str) -> Self {
        let prefix = format!("{name}_bucket{{");
        let mut buckets = BTreeMap::new();
        for line in scrape.lines().filter(|l| l.starts_with(&prefix)) {
            let Some((labels, value)) = line.rsplit_once(' ') else {
                continue;
            };
            let Some(le) = labels
                .split("le=\"")
                .nth(1)
                .and_then(|r| r.split('"').next())
            else {
                continue;
            };
            let bound = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().unwrap_or(f64::INFINITY)
            };
            // Bounds as ordered keys: microseconds (the buckets are ≥ 0.5 ms apart).
            let key = if bound.is_finite() {
                (bound * 1e6) as u64
            } else {
                u64::MAX
            };
            *buckets.entry(key).or_insert(0.0) += value.parse::<f64>().unwrap_or(0.0);
        }
        Self { buckets }
    }

    /// What was observed since `earlier` (bucket by bucket).
    pub fn since(&self, earlier: &Self) -> Self {
        let buckets = self
            .buckets
            .iter()
            .map(|(k, v)| (*k, v - earlier.buckets.get(k).copied().unwrap_or(0.0)))
            .collect();
        Self { buckets }
    }

    /// Observations in all.
    pub fn count(&self) -> f64 {
        self.buckets.get(&u64::MAX).copied().unwrap_or(0.0)
    }

    /// The upper bound of the bucket holding quantile `q`, in the metric's own unit (events for
    /// the batch size); `None` when empty or past the last finite bucket.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        self.quantile_ms(q).map(|ms| ms / 1000.0)
    }

    /// The upper bound (ms) of the bucket holding quantile `q`: "at most this"; `None` when empty
    /// or past the last finite bucket.
    pub fn quantile_ms(&self, q: f64) -> Option<f64> {
        let total = self.count();
        if total <= 0.0 {
            return None;
        }
        let rank = total * q;
        self.buckets
            .iter()
            .find(|(_, c)| **c >= rank)
            .and_then(|(k, _)| (*k != u64::MAX).then(|| *k as f64 / 1000.0))
    }
}

/// A counter's value in a Prometheus scrape, summed over its label sets.
pub fn counter(scrape: &str, name: &str) -> f64 {
    counter_with(scrape, name, "")
}

/// A counter's value summed over the label sets that contain `label` (e.g.
/// `destination="up"`; empty: all of them).
pub fn counter_with(scrape: &str, name: &str, label: &str) -> f64 {
    scrape
        .lines()
        .filter(|l| {
            l.strip_prefix(name).is_some_and(|rest| {
                (rest.starts_with(' ') && label.is_empty())
                    || (rest.starts_with('{') && rest.contains(label))
            })
        })
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    const SCRAPE: &str = r#"# TYPE pgoutbox_claim_duration_seconds histogram
pgoutbox_claim_duration_seconds_bucket{le="0.001"} 50
pgoutbox_claim_duration_seconds_bucket{le="0.005"} 98
pgoutbox_claim_duration_seconds_bucket{le="0.01"} 99
pgoutbox_claim_duration_seconds_bucket{le="+Inf"} 100
pgoutbox_claim_duration_seconds_sum 0.2
pgoutbox_claim_duration_seconds_count 100
"#;

    #[test]
    fn a_histogram_quantile_is_the_bound_of_its_bucket() {
        let h = Histogram::parse(SCRAPE, "pgoutbox_claim_duration_seconds");
        assert_eq!(h.count(), 100.0);
        assert_eq!(h.quantile_ms(0.5), Some(1.0));
        assert_eq!(h.quantile_ms(0.98), Some(5.0));
        assert_eq!(h.quantile_ms(0.99), Some(10.0));
        // Past the last finite bound: unknown, not a number that looks measured.
        assert_eq!(h.quantile_ms(1.0), None);
        // What was observed between two scrapes.
        let empty = Histogram::parse("", "pgoutbox_claim_duration_seconds");
        assert_eq!(h.since(&h).quantile_ms(0.5), None);
        assert_eq!(h.since(&empty).count(), 100.0);
    }

    #[test]
    fn a_counter_is_summed_over_its_label_sets() {
        let scrape = "# TYPE pgoutbox_events_published_total counter\n\
                      pgoutbox_events_published_total{destination=\"a\"} 10\n\
                      pgoutbox_events_published_total{destination=\"b\"} 5\n\
                      pgoutbox_events_published_total_other 7\n";
        assert_eq!(counter(scrape, "pgoutbox_events_published_total"), 15.0);
        assert_eq!(
            counter_with(
                scrape,
                "pgoutbox_events_published_total",
                "destination=\"b\""
            ),
            5.0
        );
    }
}
