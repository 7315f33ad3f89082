//! Observability: Prometheus metrics, and the health and readiness endpoints.
//!
//! Counters and histograms are recorded on the relay's hot path through the `metrics` facade (a
//! no-op until a recorder is installed). Backlog gauges (pending, backoff, dead, lag) come from one
//! query over the pending and dead indexes ([`crate::store::backlog`]), run on an interval by each
//! relay — never per scrape.
//! Every metric is listed in [`METRICS`], which the README's table and the tests follow.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::engine::Relay;
use crate::model::metric::*;
use crate::store::backlog::{Backlog, BacklogRow};

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

/// Reads the backlog per (destination, topic) from the relay's store ([`crate::store::backlog`]);
/// rows not yet routed count for each destination of `relay` whose topics match (`(unrouted)`
/// when none does).
pub async fn backlog(
    relay: &Relay,
) -> crate::Result<std::collections::HashMap<(String, String), Backlog>> {
    let config = relay.config();
    let rows = crate::store::backlog::rows(relay.store()).await?;
    let mut merged: std::collections::HashMap<(String, String), Backlog> = Default::default();
    for BacklogRow {
        destination,
        topic,
        backlog: b,
    } in rows
    {
        let destinations = match destination {
            Some(d) => vec![d],
            None => {
                let routed: Vec<String> = relay
                    .router()
                    .by_topic(&topic)
                    .into_iter()
                    .filter_map(|i| config.destinations.get(i).map(|d| d.name.clone()))
                    .collect();
                if routed.is_empty() {
                    vec!["(unrouted)".into()]
                } else {
                    routed
                }
            }
        };
        for destination in destinations {
            let e = merged.entry((destination, topic.clone())).or_default();
            e.due += b.due;
            e.backoff += b.backoff;
            e.held += b.held;
            e.in_flight += b.in_flight;
            e.failing += b.failing;
            e.dead += b.dead;
            e.lag = e.lag.max(b.lag);
        }
    }
    Ok(merged)
}

/// One point of the console's chart.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Sample {
    /// When it was taken.
    pub at: chrono::DateTime<chrono::Utc>,
    /// The oldest pending event's age, over every destination.
    pub lag_seconds: f64,
    /// Pending events (due and waiting), over every destination.
    pub pending: i64,
    /// Events this relay delivered per second since the previous sample.
    pub published_per_second: f64,
    /// The same per destination.
    pub per_destination: std::collections::BTreeMap<String, f64>,
}

/// The last hour of [`Sample`]s, taken by [`refresh_gauges`] at each refresh.
#[derive(Debug, Default)]
pub struct Samples {
    kept: std::sync::Mutex<std::collections::VecDeque<Sample>>,
}

impl Samples {
    /// How far back samples are kept.
    pub const SPAN: Duration = Duration::from_secs(3600);

    /// Adds a sample and forgets those older than [`Samples::SPAN`].
    pub fn push(&self, sample: Sample) {
        if let Ok(mut kept) = self.kept.lock() {
            let horizon = sample.at - chrono::Duration::from_std(Self::SPAN).unwrap_or_default();
            while kept.front().is_some_and(|s| s.at < horizon) {
                kept.pop_front();
            }
            kept.push_back(sample);
        }
    }

    /// The newest sample.
    pub fn last(&self) -> Option<Sample> {
        self.kept.lock().ok().and_then(|k| k.back().cloned())
    }

    /// The samples kept, oldest first.
    pub fn all(&self) -> Vec<Sample> {
        self.kept
            .lock()
            .map(|k| k.iter().cloned().collect())
            .unwrap_or_default()
    }
}

/// Refreshes `relay`'s backlog gauges every `interval` until `stop`, and adds a [`Sample`] to
/// `samples` each time.
pub async fn refresh_gauges(
    relay: Arc<Relay>,
    interval: Duration,
    samples: Arc<Samples>,
    stop: CancellationToken,
) {
    let mut known: std::collections::HashSet<(String, String)> = std::collections::HashSet::new();
    let mut last = (Instant::now(), crate::model::metric::delivered_so_far());
    loop {
        match backlog(&relay).await {
            Ok(mut merged) => {
                let delivered = crate::model::metric::delivered_so_far();
                let elapsed = last.0.elapsed().as_secs_f64().max(1e-3);
                let per_destination: std::collections::BTreeMap<String, f64> = delivered
                    .iter()
                    .map(|(d, n)| {
                        let before = last.1.get(d).copied().unwrap_or(0);
                        (d.clone(), n.saturating_sub(before) as f64 / elapsed)
                    })
                    .collect();
                samples.push(Sample {
                    at: chrono::Utc::now(),
                    lag_seconds: merged.values().map(|b| b.lag).fold(0.0, f64::max),
                    pending: merged.values().map(|b| b.due + b.backoff).sum(),
                    published_per_second: per_destination.values().sum(),
                    per_destination,
                });
                last = (Instant::now(), delivered);
                // Series that emptied go back to zero rather than keep their last value.
                for key in known.iter() {
                    merged.entry(key.clone()).or_default();
                }
                for ((destination, topic), b) in &merged {
                    let labels = [
                        ("destination", destination.clone()),
                        ("topic", topic.clone()),
                    ];
                    metrics::gauge!(PENDING_DUE, &labels).set(b.due as f64);
                    metrics::gauge!(PENDING_BACKOFF, &labels).set(b.backoff as f64);
                    metrics::gauge!(DEAD, &labels).set(b.dead as f64);
                    metrics::gauge!(OLDEST_PENDING_AGE_SECONDS, &labels).set(b.lag);
                }
                known.extend(merged.into_keys());
            }
            Err(e) => {
                metrics::counter!(DB_ERRORS_TOTAL).increment(1);
                warn!(error = %crate::error_chain(&e), "cannot refresh the backlog gauges");
            }
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(interval) => {}
        }
    }
}

#[derive(Clone)]
struct ServerState {
    handle: PrometheusHandle,
    relay: Arc<Relay>,
}

/// Serves `/metrics`, `/healthz` and `/readyz` on `addr` until `stop`, and the operator console
/// (its page and `/api/…`, see [`crate::admin`]) when given one.
pub async fn serve(
    addr: SocketAddr,
    handle: PrometheusHandle,
    relay: Arc<Relay>,
    console: Option<crate::admin::Console>,
    stop: CancellationToken,
) -> std::io::Result<()> {
    let app = axum::Router::new()
        .route(
            "/metrics",
            axum::routing::get(|State(s): State<ServerState>| async move { s.handle.render() }),
        )
        .route("/healthz", axum::routing::get(healthz))
        .route("/readyz", axum::routing::get(readyz))
        .route(
            "/readyz/:destination",
            axum::routing::get(readyz_destination),
        )
        .with_state(ServerState { handle, relay });
    let app = match console {
        Some(console) => app.merge(crate::admin::router(console)),
        None => app,
    };
    let listener = tokio::net::TcpListener::bind(addr).await?;
    axum::serve(listener, app)
        .with_graceful_shutdown(async move { stop.cancelled().await })
        .await
}

/// Alive unless a claim worker died (a bug): then 503, and the process is on its way out.
async fn healthz(State(s): State<ServerState>) -> impl IntoResponse {
    match s.relay.failure() {
        None => (StatusCode::OK, "ok\n".to_owned()),
        Some(why) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("unhealthy: {why}\n"),
        ),
    }
}

/// Ready when the database answers, every sink passes its healthcheck and no breaker is open; the
/// body has a line per check either way. `?destination=NAME` checks the database and that one
/// destination only (404 for an unknown name), as does `/readyz/NAME`.
async fn readyz(
    State(s): State<ServerState>,
    axum::extract::Query(query): axum::extract::Query<std::collections::HashMap<String, String>>,
) -> impl IntoResponse {
    ready_response(&s.relay, query.get("destination").map(String::as_str)).await
}

/// `/readyz/NAME`: see [`readyz`].
async fn readyz_destination(
    State(s): State<ServerState>,
    axum::extract::Path(name): axum::extract::Path<String>,
) -> impl IntoResponse {
    ready_response(&s.relay, Some(&name)).await
}

async fn ready_response(relay: &Relay, only: Option<&str>) -> (StatusCode, String) {
    if let Some(name) = only {
        if !relay.has_destination(name) {
            return (
                StatusCode::NOT_FOUND,
                format!("no destination is named {name:?}\n"),
            );
        }
    }
    match relay.readiness_of(only).await {
        Ok(lines) => (StatusCode::OK, format!("ready\n{}", lines.join(""))),
        Err(lines) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready\n{}", lines.join("")),
        ),
    }
}
