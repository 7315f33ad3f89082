//! Readiness: whether the database answers and each destination takes events.

use std::time::Duration;

use super::Relay;

impl Relay {
    /// Readiness: the database answers (2 s), every sink passes its healthcheck (2 s each, its
    /// result kept for a few seconds) and no breaker is open. One line per check; `Err` when any
    /// failed.
    pub async fn readiness(&self) -> std::result::Result<Vec<String>, Vec<String>> {
        self.readiness_of(None).await
    }

    /// Readiness of the database and one destination (`Some(name)`), or of every destination.
    /// `Err` with one line when no destination has that name.
    pub async fn readiness_of(
        &self,
        only: Option<&str>,
    ) -> std::result::Result<Vec<String>, Vec<String>> {
        if let Some(name) = only.filter(|name| !self.has_destination(name)) {
            return Err(vec![format!("no destination is named {name:?}\n")]);
        }
        let limit = Duration::from_secs(2);
        let mut lines = Vec::new();
        let mut ready = true;
        let db = tokio::time::timeout(limit, self.store.ping()).await;
        let line = match db {
            Ok(Ok(_)) => "ok".to_owned(),
            Ok(Err(e)) => format!("not ready: {}", crate::error_chain(&e)),
            Err(_) => "not ready: no answer within 2 s".into(),
        };
        ready &= line == "ok";
        lines.push(format!("database: {line}\n"));
        for lane in &self.lanes {
            if only.is_some_and(|name| name != lane.name) {
                continue;
            }
            let check = lane.health(limit).await;
            let (breaker, paused) = lane.gate.state();
            let line = match (lane.gate.problem(), check) {
                // A pause is an operator's decision, not a fault.
                (Some(p), None) if paused => p,
                (Some(p), _) => {
                    ready = false;
                    format!("not ready: {p}")
                }
                (None, Some(e)) => {
                    ready = false;
                    format!("not ready: {e}")
                }
                (None, None) => format!("ok (breaker {breaker})"),
            };
            lines.push(format!("destination {}: {line}\n", lane.name));
        }
        if ready {
            Ok(lines)
        } else {
            Err(lines)
        }
    }
}
