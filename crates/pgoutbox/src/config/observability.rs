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
    /// `[[admin.tokens]]`: named tokens, each with a role; the audit log records changes under
    /// the name. `token` and `read_token` are the tokens named `admin` (operate) and `reader`.
    pub tokens: Vec<NamedToken>,
    /// `Host` names the console and its API answer to (without the port; `*`: any). Default: the
    /// listen address, `localhost`, `127.0.0.1` and `::1`. A page on another site that points its
    /// own name at this address (DNS rebinding) sends its own name, and is refused.
    pub allowed_hosts: Vec<String>,
}

/// What a console token may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Read the overview, the events and the audit log.
    Read,
    /// Read, and retry, discard, pause and resume.
    Operate,
}

/// One `[[admin.tokens]]` entry.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NamedToken {
    /// Who holds it, as the audit log names them.
    pub name: String,
    /// What it may do.
    pub role: Role,
    /// The token (a secret: a string, `{ env = … }` or `{ file = … }`).
    pub token: Secret,
}

impl AdminConfig {
    /// Every token with its name and role: `token` as `admin`, `read_token` as `reader`, then
    /// `[[admin.tokens]]`.
    pub fn all_tokens(&self) -> Vec<NamedToken> {
        let builtin = [
            ("admin", Role::Operate, &self.token),
            ("reader", Role::Read, &self.read_token),
        ];
        builtin
            .into_iter()
            .filter_map(|(name, role, token)| {
                token.clone().map(|token| NamedToken {
                    name: name.into(),
                    role,
                    token,
                })
            })
            .chain(self.tokens.iter().cloned())
            .collect()
    }

    /// Token names are unique and not blank (the audit log tells people apart by them).
    pub(super) fn check_names(&self) -> Result<(), super::ConfigError> {
        let tokens = self.all_tokens();
        for (i, t) in tokens.iter().enumerate() {
            if t.name.trim().is_empty() {
                return Err(super::ConfigError::at(
                    "admin.tokens",
                    "a token has no name",
                ));
            }
            if tokens[..i].iter().any(|o| o.name == t.name) {
                return Err(super::ConfigError::at(
                    "admin.tokens",
                    format!(
                        "the token name {:?} is used twice (admin.token is \"admin\", admin.read_token \"reader\")",
                        t.name
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Whether reads need a token: some token may only read.
    pub fn reads_need_token(&self) -> bool {
        self.all_tokens().iter().any(|t| t.role == Role::Read)
    }

    /// Refuses a console readable by anyone on a non-loopback address (see `open_reads`); the
    /// relay checks it before it listens (other commands do not serve the console).
    pub fn check(&self, listen: Option<std::net::SocketAddr>) -> Result<(), super::ConfigError> {
        match listen {
            Some(addr) if !addr.ip().is_loopback() && !self.reads_need_token() && !self.open_reads => {
                Err(super::ConfigError::at(
                    "admin.read_token",
                    format!(
                        "observability.listen = \"{addr}\" is not a loopback address, so the console and its API \
                         would show every event to whoever reaches it: set admin.read_token (or a token with \
                         role = \"read\" in [[admin.tokens]]), bind to 127.0.0.1, \
                         or set admin.open_reads = true to allow it"
                    ),
                ))
            }
            _ => Ok(()),
        }
    }
}
