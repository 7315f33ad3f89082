//! `[observability]` and `[admin]`: the metrics and health listener, span export, and who may
//! use the operator console.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Deserialize;

use super::duration::duration_str;
use super::secret::Secret;

/// `[observability]`: the metrics and health endpoints.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ObservabilityConfig {
    /// Address serving `/metrics`, `/healthz` and `/readyz` (e.g. "127.0.0.1:9187"); off when absent.
    pub listen: Option<std::net::SocketAddr>,
    /// How often each relay refreshes the backlog gauges (one query on the pending index).
    #[serde(with = "duration_str")]
    pub gauge_interval: Duration,
    /// `[observability.otlp]`: export of the relay's own spans.
    pub otlp: OtlpConfig,
}

impl Default for ObservabilityConfig {
    fn default() -> Self {
        Self {
            listen: None,
            gauge_interval: Duration::from_secs(15),
            otlp: OtlpConfig::default(),
        }
    }
}

/// `[observability.otlp]`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OtlpConfig {
    /// Base URL of the collector's OTLP/HTTP receiver, e.g. `http://127.0.0.1:4318`; spans go to
    /// its `/v1/traces`. When absent, `OTEL_EXPORTER_OTLP_ENDPOINT` decides.
    pub endpoint: Option<String>,
    /// Extra request headers (an API key); values are secrets (`{ env = … }`, `{ file = … }`).
    #[serde(default)]
    pub headers: BTreeMap<String, Secret>,
    /// `service.name` of the spans; default `OTEL_SERVICE_NAME`, else `pgoutbox`.
    pub service_name: Option<String>,
}

/// `[admin]`: who may use the console.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    /// Bearer token for the mutating calls (retry, discard, pause, resume); they are off when
    /// absent. A secret: a string, `{ env = "NAME" }` or `{ file = "PATH" }`.
    pub token: Option<Secret>,
    /// Bearer token the read calls need too (the admin token also works); reads are open to
    /// whoever reaches the listener when absent, which only a loopback listener allows unless
    /// `open_reads` says so.
    pub read_token: Option<Secret>,
    /// Let anyone who reaches a non-loopback `observability.listen` read the console and its API
    /// (payloads included) without a token. Off: such a relay refuses to start without
    /// `read_token`.
    pub open_reads: bool,
    /// `Host` names the console and its API answer to (without the port; `*`: any). Default: the
    /// listen address, `localhost`, `127.0.0.1` and `::1`. A page on another site that points its
    /// own name at this address (DNS rebinding) sends its own name, and is refused.
    pub allowed_hosts: Vec<String>,
}

impl AdminConfig {
    /// Refuses a console readable by anyone on a non-loopback address (see `open_reads`); the
    /// relay checks it before it listens (other commands do not serve the console).
    pub fn check(&self, listen: Option<std::net::SocketAddr>) -> Result<(), super::ConfigError> {
        match listen {
            Some(addr) if !addr.ip().is_loopback() && self.read_token.is_none() && !self.open_reads => {
                Err(super::ConfigError::at(
                    "admin.read_token",
                    format!(
                        "observability.listen = \"{addr}\" is not a loopback address, so the console and its API \
                         would show every event to whoever reaches it: set admin.read_token, bind to 127.0.0.1, \
                         or set admin.open_reads = true to allow it"
                    ),
                ))
            }
            _ => Ok(()),
        }
    }
}
