//! The Prometheus recorder: installed once per process, before anything records, with the
//! histogram buckets of the relay's metrics.

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use crate::model::metric::*;

/// Installs the Prometheus recorder for this process; returns the handle that renders a scrape.
pub fn install_recorder() -> Result<PrometheusHandle, String> {
    let seconds = [
        0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
        60.0,
    ];
    let sizes = [
        1.0, 5.0, 10.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0, 5000.0, 10000.0,
    ];
    PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &seconds)
        .and_then(|b| b.set_buckets_for_metric(Matcher::Full(BATCH_SIZE.into()), &sizes))
        .and_then(|b| b.install_recorder())
        .map_err(|e| format!("cannot install the metrics recorder: {e}"))
}
