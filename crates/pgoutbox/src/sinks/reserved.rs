//! Reserved headers: names an event's own headers cannot set, because the sink writes them itself
//! (ids, signatures, framing), the destination configures them (`Authorization`), or the broker
//! acts on them (JetStream's `Nats-*`). Such an event header is dropped with a warning, logged
//! once per sink type and header name per process, so a hot loop does not flood the log.

use std::collections::HashSet;
use std::sync::{Mutex, OnceLock};

/// The header names one destination reserves, compared case-insensitively.
#[derive(Debug, Clone)]
pub(crate) struct Reserved {
    /// The sink type, for the warning.
    sink: &'static str,
    /// Reserved names every destination of the sink type has, lowercase: kept once, not copied
    /// into each of ten thousand webhook sinks.
    fixed: &'static [&'static str],
    /// Reserved names of this destination, lowercase.
    names: Vec<String>,
    /// Reserved prefixes, lowercase.
    prefixes: &'static [&'static str],
}

impl Reserved {
    /// The names (lowercase) and prefixes every destination of `sink`'s type reserves.
    pub fn new(
        sink: &'static str,
        fixed: &'static [&'static str],
        prefixes: &'static [&'static str],
    ) -> Self {
        Self {
            sink,
            fixed,
            names: Vec::new(),
            prefixes,
        }
    }

    /// These names too, which this destination's configuration sets.
    pub fn and_configured(self, names: impl IntoIterator<Item = impl AsRef<str>>) -> Self {
        Self {
            names: names
                .into_iter()
                .map(|n| n.as_ref().to_ascii_lowercase())
                .collect(),
            ..self
        }
    }

    /// Whether `name` is reserved.
    pub fn contains(&self, name: &str) -> bool {
        let lower = name.to_ascii_lowercase();
        self.fixed.contains(&lower.as_str())
            || self.names.contains(&lower)
            || self.prefixes.iter().any(|p| lower.starts_with(p))
    }

    /// Whether an event header `name` may be sent; when not, warns (once per sink type and name).
    pub fn permits(&self, name: &str) -> bool {
        if !self.contains(name) {
            return true;
        }
        static WARNED: OnceLock<Mutex<HashSet<(&'static str, String)>>> = OnceLock::new();
        let first = WARNED
            .get_or_init(Mutex::default)
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert((self.sink, name.to_ascii_lowercase()));
        if first {
            tracing::warn!(
                sink = self.sink,
                header = name,
                "an event header tried to set a header this destination reserves; dropped (logged once per header name)"
            );
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_prefixes_are_reserved_case_insensitively() {
        let reserved = Reserved::new("nats", &["webhook-id"], &["nats-", "pgoutbox-"])
            .and_configured(["X-Configured"]);
        assert!(reserved.contains("Webhook-ID"));
        for name in [
            "Nats-Msg-Id",
            "nats-rollup",
            "PGOUTBOX-TOPIC",
            "x-configured",
        ] {
            assert!(!reserved.permits(name), "{name}");
        }
        for name in ["x-tenant", "traceparent", "natsy"] {
            assert!(reserved.permits(name), "{name}");
        }
    }
}
