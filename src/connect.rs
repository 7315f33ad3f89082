//! Opening database pools, for the commands (`cli`) and the benchmark harness (`bench`) alike:
//! [`PoolSettings`] says how a pool is sized and how its sessions are set up, [`connect_with`]
//! opens one and reports an unreachable or misconfigured database at once, with the URL's
//! password redacted. A URL naming several hosts (libpq's `host1:port1,host2:port2` with
//! `target_session_attrs`) connects to the first that fits, and the pool follows a failover:
//! [`follow`] watches the host in use and moves the pool to the next that fits when it goes away
//! or becomes a standby. Below both; imports neither.

use std::str::FromStr;
use std::time::Duration;

use anyhow::{anyhow, Context};
use pgoutbox::config::{DatabaseHosts, SessionAttrs};
use pgoutbox::model::secrets::redact_url;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, PgConnection, PgPool};
use tracing::{info, warn};

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

/// How often the pool of a multi-host URL asks its host whether it still fits.
const FOLLOW_EVERY: Duration = Duration::from_secs(1);

/// One of a URL's hosts: its redacted URL (for messages) and how to connect to it.
#[derive(Clone)]
struct Host {
    shown: String,
    options: PgConnectOptions,
}

/// Opens a pool; errors name the (redacted) URL and the cause.
pub async fn connect_with(url: &str, settings: &PoolSettings) -> anyhow::Result<PgPool> {
    let parsed = DatabaseHosts::parse(url)?;
    let hosts = parsed
        .urls
        .iter()
        .map(|one| {
            let options = PgConnectOptions::from_str(one).map_err(|e| {
                anyhow!(
                    "invalid database URL {}: {}",
                    redact_url(url),
                    pgoutbox::model::secrets::scrub(&e.to_string(), one)
                )
            })?;
            Ok(Host {
                shown: redact_url(one),
                options: session_options(options, settings),
            })
        })
        .collect::<anyhow::Result<Vec<Host>>>()?;
    let attrs = parsed.attrs;
    let failed = || format!("cannot connect to the database at {}", redact_url(url));
    // One plain attempt first: the pool would retry a refused connection until its timeout, where
    // an operator wants the cause at once (a session setting the server rejects shows here too).
    let (at, first) = first_fitting(&hosts, attrs).await.with_context(failed)?;
    first.close().await.ok();
    let pool = PgPoolOptions::new()
        .max_connections(settings.max_connections)
        .acquire_timeout(settings.acquire_timeout)
        .after_connect(move |conn, _| {
            Box::pin(async move {
                // Between the follower's looks a new session may reach a server that has just
                // become a standby: it is refused, never written through.
                match fits(conn, attrs).await {
                    Ok(true) => Ok(()),
                    Ok(false) => Err(sqlx::Error::Configuration(UNFIT.into())),
                    Err(e) => Err(sqlx::Error::Configuration(e.into())),
                }
            })
        })
        .connect_with(hosts[at].options.clone())
        .await
        .with_context(failed)?;
    if hosts.len() > 1 {
        tokio::spawn(follow(pool.clone(), hosts, attrs, at));
    }
    Ok(pool)
}

/// The first host, in the URL's order, that answers and fits `attrs`, with a session on it; the
/// error names each host's failure.
async fn first_fitting(
    hosts: &[Host],
    attrs: SessionAttrs,
) -> anyhow::Result<(usize, PgConnection)> {
    let mut failures = Vec::new();
    for (at, host) in hosts.iter().enumerate() {
        match try_host(host, attrs).await {
            Ok(conn) => return Ok((at, conn)),
            Err(e) if hosts.len() == 1 => return Err(e),
            Err(e) => failures.push(format!("{}: {e:#}", host.shown)),
        }
    }
    Err(anyhow!("no host fits: {}", failures.join("; ")))
}

/// A session on `host` if it answers within 10 s and fits `attrs`.
async fn try_host(host: &Host, attrs: SessionAttrs) -> anyhow::Result<PgConnection> {
    let mut conn = tokio::time::timeout(
        Duration::from_secs(10),
        PgConnection::connect_with(&host.options),
    )
    .await
    .map_err(|_| anyhow!("no answer within 10 s"))??;
    if !fits(&mut conn, attrs).await? {
        conn.close().await.ok();
        anyhow::bail!(UNFIT);
    }
    Ok(conn)
}

/// Why a session on a server that does not fit `target_session_attrs` is refused.
const UNFIT: &str = "read-only (a standby?), and target_session_attrs asks for a writable server";

/// Whether the server of `conn` serves sessions of `attrs` (`any`: without asking it).
async fn fits(conn: &mut PgConnection, attrs: SessionAttrs) -> pgoutbox::Result<bool> {
    if attrs == SessionAttrs::Any {
        return Ok(true);
    }
    Ok(attrs.fits(pgoutbox::store::server::role(conn).await?))
}

/// Keeps `pool` on a host that fits: asks the host in use every [`FOLLOW_EVERY`] over a session
/// of its own, and when that host stops answering or stops fitting (a failover), looks through
/// the hosts again in order and points the pool's new sessions at the first that fits. Sessions
/// already open on a lost host fail their next statement and are replaced. Ends with the pool.
async fn follow(pool: PgPool, hosts: Vec<Host>, attrs: SessionAttrs, mut at: usize) {
    let mut watch: Option<PgConnection> = None;
    let mut lost = false;
    loop {
        tokio::time::sleep(FOLLOW_EVERY).await;
        if pool.is_closed() {
            return;
        }
        if let Some(conn) = watch.as_mut() {
            let fits =
                tokio::time::timeout(FOLLOW_EVERY * 5, pgoutbox::store::server::role(&mut *conn))
                    .await
                    .ok()
                    .and_then(Result::ok)
                    .is_some_and(|role| attrs.fits(role));
            if fits {
                continue;
            }
            watch = None;
        }
        match first_fitting(&hosts, attrs).await {
            Ok((found, conn)) => {
                watch = Some(conn);
                if found != at || lost {
                    info!(host = %hosts[found].shown, "database: new sessions go to this host");
                    pool.set_connect_options(hosts[found].options.clone());
                    at = found;
                }
                lost = false;
            }
            Err(e) if !lost => {
                warn!(error = %format!("{e:#}"), "database: no host fits, looking again every second");
                lost = true;
            }
            Err(_) => {}
        }
    }
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
