//! Opening database pools, for the commands (`cli`) and the benchmark harness (`bench`) alike:
//! [`PoolSettings`] says how a pool is sized and how its sessions are set up, [`connect_with`]
//! opens one and reports an unreachable or misconfigured database at once, with the URL's
//! password redacted. Below both; imports neither.

use std::str::FromStr;
use std::time::Duration;

use anyhow::{anyhow, Context};
use pgoutbox::model::secrets::redact_url;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, PgConnection, PgPool};

/// How a command's pool is sized and its sessions are set up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolSettings {
    /// `application_name` of every session, as `pg_stat_activity` shows it.
    pub application_name: &'static str,
    /// Connections in the pool at most.
    pub max_connections: u32,
    /// How long a task waits for a free connection (or a new one) before it fails.
    pub acquire_timeout: Duration,
    /// Server settings of every session (`-c name=value` at connect), each skipped when the URL's
    /// `options` (or `PGOPTIONS`) already sets it: the operator's value wins.
    pub session: Vec<(&'static str, String)>,
}

impl PoolSettings {
    /// A short-lived command (`migrate`, `status`, `dead`, `cleanup`, …): the server's session
    /// defaults, and a short acquire timeout so an unreachable database is reported at once.
    pub fn command(max_connections: u32) -> Self {
        Self {
            application_name: "pgoutbox",
            max_connections,
            acquire_timeout: Duration::from_secs(3),
            session: Vec::new(),
        }
    }
}

/// Opens a pool for a short-lived command ([`PoolSettings::command`]).
pub async fn connect(url: &str, max_connections: u32) -> anyhow::Result<PgPool> {
    connect_with(url, &PoolSettings::command(max_connections)).await
}

/// Opens a pool; errors name the (redacted) URL and the cause.
pub async fn connect_with(url: &str, settings: &PoolSettings) -> anyhow::Result<PgPool> {
    let options = PgConnectOptions::from_str(url).map_err(|e| {
        anyhow!(
            "invalid database URL {}: {}",
            redact_url(url),
            pgoutbox::model::secrets::scrub(&e.to_string(), url)
        )
    })?;
    let options = session_options(options, settings);
    let failed = || format!("cannot connect to the database at {}", redact_url(url));
    // One plain attempt first: the pool would retry a refused connection until its timeout, where
    // an operator wants the cause at once (a session setting the server rejects shows here too).
    let first = tokio::time::timeout(
        Duration::from_secs(10),
        PgConnection::connect_with(&options),
    )
    .await
    .map_err(|_| anyhow!("no answer within 10 s"))
    .with_context(failed)?
    .with_context(failed)?;
    first.close().await.ok();
    PgPoolOptions::new()
        .max_connections(settings.max_connections)
        .acquire_timeout(settings.acquire_timeout)
        .connect_with(options)
        .await
        .with_context(failed)
}

/// Adds the application name and the session settings the URL does not set already.
fn session_options(options: PgConnectOptions, settings: &PoolSettings) -> PgConnectOptions {
    let given = options.get_options().unwrap_or_default().to_owned();
    let own: Vec<(&str, &str)> = settings
        .session
        .iter()
        .filter(|(name, _)| !given.contains(&format!("{name}=")))
        .map(|(name, value)| (*name, value.as_str()))
        .collect();
    let options = options.application_name(settings.application_name);
    if own.is_empty() {
        options
    } else {
        options.options(own)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn session_settings_go_to_the_server_unless_the_url_sets_them() {
        let settings = PoolSettings {
            session: vec![
                ("statement_timeout", "60000".to_owned()),
                ("idle_in_transaction_session_timeout", "90000".to_owned()),
            ],
            ..PoolSettings::command(1)
        };
        let plain = PgConnectOptions::from_str("postgres://u@h/db").expect("url");
        let options = session_options(plain, &settings);
        assert_eq!(
            options.get_options(),
            Some("-c statement_timeout=60000 -c idle_in_transaction_session_timeout=90000")
        );
        assert_eq!(options.get_application_name(), Some("pgoutbox"));

        let own = PgConnectOptions::from_str(
            "postgres://u@h/db?options=-c%20statement_timeout%3D5min&application_name=app",
        )
        .expect("url");
        let options = session_options(own, &settings);
        assert_eq!(
            options.get_options(),
            Some("-c statement_timeout=5min -c idle_in_transaction_session_timeout=90000")
        );
    }
}
