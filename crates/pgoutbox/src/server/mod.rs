//! The server: what the relay answers over HTTP on `observability.listen` — Prometheus metrics
//! (`/metrics`), liveness and readiness (`/healthz`, `/readyz`), and the operator console and its
//! API ([`console`]).
//!
//! Counters and histograms are recorded on the relay's hot path through the `metrics` facade (a
//! no-op until a recorder is installed, [`metrics`]). Backlog gauges come from one query over the
//! pending and dead indexes ([`crate::store::backlog`]), run on an interval by each relay
//! ([`gauges`]) — never per scrape. Every metric is listed in [`crate::model::metric::METRICS`],
//! which the README's table and the tests follow.

pub mod console;
pub mod gauges;
pub mod metrics;
pub mod wal_gauges;

pub use gauges::{refresh_gauges, Sample, Samples};
pub use metrics::install_recorder;
pub use wal_gauges::refresh_wal_gauges;

use std::net::SocketAddr;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio_util::sync::CancellationToken;

use crate::engine::RelayView;

/// This machine's name (from the kernel, Linux), to name a relay among the relays sharing the
/// chart and an operator in the audit log; `None` where it cannot be read.
pub fn host_name() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
}

#[derive(Clone)]
struct ServerState {
    handle: PrometheusHandle,
    relay: RelayView,
}

/// Serves `/metrics`, `/healthz` and `/readyz` on `addr` until `stop`, and the operator console
/// (its page and `/api/…`, see [`crate::admin`]) when given one.
pub async fn serve(
    addr: SocketAddr,
    handle: PrometheusHandle,
    relay: impl Into<RelayView>,
    console: Option<crate::server::console::Console>,
    stop: CancellationToken,
) -> std::io::Result<()> {
    let relay = relay.into();
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
        Some(console) => app.merge(crate::server::console::router(console)),
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

async fn ready_response(relay: &RelayView, only: Option<&str>) -> (StatusCode, String) {
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
