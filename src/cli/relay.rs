//! `pgoutbox relay`: the long-running relay, or one pass with `--once`.

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering as AtomicOrdering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use pgoutbox::config::{RelayConfig, Source};
use pgoutbox::engine::Relay;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use super::{Cli, PoolSettings};

/// Exit status of `relay --once` when some events were not delivered.
pub const EXIT_SOME_FAILED: u8 = 3;

/// Arguments of `relay`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Process everything due now, print a summary and exit: 0 when all were delivered,
    /// 3 when some failed (they stay scheduled for retry or dead-lettered), 1 on error.
    #[arg(long)]
    once: bool,
}

/// A configuration made ready to run: its sinks built, its pool open and checked, the destinations
/// added at runtime among its own.
struct Prepared {
    config: pgoutbox::config::Config,
    pool: sqlx::PgPool,
    pool_settings: PoolSettings,
    /// The destinations added at runtime that it holds, and their version, as read (a change
    /// reads again only those that changed).
    loaded: pgoutbox::definitions::Loaded,
    /// The key their secrets are sealed with, read once from the environment.
    key: Option<pgoutbox::definitions::Key>,
}

/// Loads the configuration and makes it ready: every check the relay makes before it relays, so
/// that a reload with a mistake in it is refused while the running relay goes on.
async fn prepare(cli: &Cli, once: bool) -> anyhow::Result<Prepared> {
    let mut config = cli.load_config()?;
    // The file's destinations are checked (each sink built, then dropped) before the database is
    // reached: a typo in a destination is reported first.
    pgoutbox::sinks::check(&config).map_err(|mut e| {
        e.file = cli.config.clone();
        e
    })?;
    let pool_settings = pool_settings(&config.relay);
    let pool = super::connect_checked_with(&config, &pool_settings).await?;
    let key = pgoutbox::definitions::Key::from_env()?;
    let store = pgoutbox::store::Store::new(pool.clone(), config.table.clone());
    let loaded = pgoutbox::definitions::load(&store, key.as_ref())
        .await
        .context("cannot load the destinations added at runtime")?;
    loaded.add_to(&mut config)?;
    some_destination(&config)?;
    super::check_relay_privileges(&pool, &config).await?;
    if config.source == Source::Wal {
        if once {
            bail!("--once claims from the table: it works with source = \"poll\" only");
        }
        let names = pgoutbox::sources::wal::slot::Names::of(&config.wal, &config.table);
        // Fails fast on a server or slot that cannot serve; warnings are logged by the source.
        pgoutbox::sources::wal::slot::ready(&pool, &config.table, &names)
            .await
            .context("cannot read events from the WAL (source = \"wal\")")?;
    }
    Ok(Prepared {
        config,
        pool,
        pool_settings,
        loaded,
        key,
    })
}

/// A relay needs a destination.
fn some_destination(config: &pgoutbox::config::Config) -> anyhow::Result<()> {
    if config.destinations.is_empty() {
        bail!("no destinations configured: add a [[destinations]] table to the config file, or one at runtime with `pgoutbox destinations add` (see README)");
    }
    Ok(())
}

/// `current` with the destinations added at runtime read again (only those that changed: see
/// [`pgoutbox::definitions::reload`]), on the same pool. The file is not read again (SIGHUP
/// does that), and its destinations are the same definitions, which the next relay knows and
/// does not check again ([`Relay::following`]): applying a change costs what the change does,
/// not what the configuration holds.
async fn refresh(current: &Prepared) -> anyhow::Result<Prepared> {
    let store = pgoutbox::store::Store::new(current.pool.clone(), current.config.table.clone());
    let loaded = pgoutbox::definitions::reload(&store, current.key.as_ref(), &current.loaded)
        .await
        .context("cannot load the destinations added at runtime")?;
    let mut config = current.config.clone();
    config.destinations.retain(|d| !d.runtime);
    loaded.add_to(&mut config)?;
    some_destination(&config)?;
    Ok(Prepared {
        config,
        pool: current.pool.clone(),
        pool_settings: current.pool_settings.clone(),
        loaded,
        key: current.key.clone(),
    })
}

pub async fn run(cli: &Cli, args: &Args) -> anyhow::Result<ExitCode> {
    let prepared = prepare(cli, args.once).await?;
    // Every settle leaves a dead row version and dead index entries behind; only vacuum removes
    // them, and without it claims slow down as they pile up.
    if let Ok(off) = pgoutbox::store::server::autovacuum(&prepared.pool).await {
        if off == "off" {
            tracing::warn!(
                "autovacuum is off on this server: the outbox's dead rows and index entries will pile up and claims will slow down; turn autovacuum on or VACUUM the outbox regularly"
            );
        }
    }
    // The recorder and the span exporter live as long as the process, across reloads: metrics
    // registered while a relay is built must reach the recorder, so it goes first (with --once
    // too: its spans are exported).
    let first = &prepared.config;
    let metrics = match first.observability.listen {
        Some(_) => Some(pgoutbox::server::install_recorder().map_err(anyhow::Error::msg)?),
        None => None,
    };
    let spans = pgoutbox::otlp::start(&first.observability.otlp, |k| std::env::var(k).ok())
        .map_err(anyhow::Error::msg)
        .context("cannot export spans over OTLP")?;
    if spans.is_some() {
        info!("exporting the relay's spans over OTLP");
    }
    let result = if args.once {
        let relay = Relay::new(prepared.pool, &prepared.config)?;
        run_once(&relay).await
    } else {
        relay_until_stopped(cli, prepared, metrics).await
    };
    if let Some(spans) = spans {
        // Sends what is buffered; the exporter blocks on its own thread.
        let _ = tokio::task::spawn_blocking(move || spans.shutdown()).await;
    }
    result
}

/// Relays until a signal stops it; SIGHUP swaps in the configuration read again (see
/// [`prepare`]), and a change to the destinations added at runtime the one it runs with those
/// read again ([`refresh`]), once the running relay's in-flight batches have settled.
async fn relay_until_stopped(
    cli: &Cli,
    mut prepared: Prepared,
    metrics: Option<metrics_exporter_prometheus::PrometheusHandle>,
) -> anyhow::Result<ExitCode> {
    let shutdown = CancellationToken::new();
    let (reload_tx, mut reload_rx) = tokio::sync::mpsc::channel(1);
    // Set by SIGHUP: the next reload reads the file again. A change to the destinations added at
    // runtime alone reads those that changed.
    let file_wanted = Arc::new(AtomicBool::new(false));
    tokio::spawn(watch_signals(
        shutdown.clone(),
        reload_tx.clone(),
        Arc::clone(&file_wanted),
    ));
    // The relay running, which the next one takes over from.
    let mut previous: Option<Arc<Relay>> = None;
    loop {
        let generation = shutdown.child_token();
        let pool = prepared.pool.clone();
        let store = pgoutbox::store::Store::new(pool.clone(), prepared.config.table.clone());
        tokio::spawn(watch_definitions(
            store,
            prepared.loaded.version,
            reload_tx.clone(),
            generation.clone(),
        ));
        let running = Generation::start(
            &prepared,
            previous.as_deref(),
            metrics.clone(),
            generation.clone(),
        )?;
        previous = Some(Arc::clone(&running.relay));
        let mut relay = tokio::spawn(running.run());
        let ended = loop {
            tokio::select! {
                ended = &mut relay => break Ended::Stopped(ended),
                Some(()) = reload_rx.recv() => {
                    let file = file_wanted.swap(false, AtomicOrdering::SeqCst);
                    let next = if file {
                        prepare(cli, false).await
                    } else {
                        refresh(&prepared).await
                    };
                    match next {
                        Ok(next) => {
                            info!(destinations = next.config.destinations.len(), version = next.loaded.version, "configuration reloaded: in-flight batches finish under the old one, then the new one relays");
                            generation.cancel();
                            break Ended::Reloaded(relay.await, Box::new(next), file);
                        }
                        Err(e) => error!(error = %format!("{e:#}"), "configuration not reloaded: the relay goes on with the one it has"),
                    }
                }
            }
        };
        // The definitions' watcher holds a connection of the pool: it ends first. A change to the
        // runtime destinations keeps the pool.
        generation.cancel();
        if !matches!(ended, Ended::Reloaded(_, _, false)) {
            pool.close().await;
        }
        match ended {
            Ended::Stopped(result) => {
                return result
                    .context("the relay task ended abnormally")
                    .and_then(|r| r)
            }
            Ended::Reloaded(result, next, _) => {
                result.context("the relay task ended abnormally")??;
                prepared = *next;
            }
        }
    }
}

/// How a generation of the relay ended.
enum Ended {
    /// Shut down (a signal) or failed.
    Stopped(Result<anyhow::Result<ExitCode>, tokio::task::JoinError>),
    /// Stopped for a reload: the next configuration, ready, and whether the file was read again
    /// (on a new pool).
    Reloaded(
        Result<anyhow::Result<ExitCode>, tokio::task::JoinError>,
        Box<Prepared>,
        bool,
    ),
}

/// `relay --once`: everything due now, then a summary and the exit status.
async fn run_once(relay: &Relay) -> anyhow::Result<ExitCode> {
    let report = relay.run_once().await?;
    eprintln!(
        "relay --once: claimed {}, delivered {}, scheduled for retry {}, dead-lettered {}, held for an unavailable destination {}",
        report.claimed, report.delivered, report.retried, report.dead, report.held
    );
    Ok(if report.retried + report.dead + report.held == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(EXIT_SOME_FAILED)
    })
}

/// One configuration's relay, with its metrics, health and console endpoint, until its token is
/// cancelled (a shutdown, or a reload).
struct Generation {
    config: pgoutbox::config::Config,
    relay: Arc<Relay>,
    server: Option<tokio::task::JoinHandle<()>>,
    stop: CancellationToken,
}

impl Generation {
    /// Builds the relay of `prepared`, taking over from `previous` if any, and starts serving
    /// its endpoint.
    fn start(
        prepared: &Prepared,
        previous: Option<&Relay>,
        metrics: Option<metrics_exporter_prometheus::PrometheusHandle>,
        stop: CancellationToken,
    ) -> anyhow::Result<Self> {
        let Prepared {
            config,
            pool,
            pool_settings,
            loaded,
            key,
        } = prepared;
        let relay = Arc::new(match previous {
            Some(previous) => Relay::following(pool.clone(), config, previous)?,
            None => Relay::new(pool.clone(), config)?,
        });
        info!(
            table = %config.table,
            destinations = config.destinations.len(),
            workers = config.relay.workers,
            source = ?config.source,
            claim = ?config.relay.claim,
            pool = pool_settings.max_connections,
            version = loaded.version,
            "relay started"
        );
        let server = match (config.observability.listen, metrics) {
            (Some(addr), Some(handle)) => {
                Some(serve(config, addr, handle, &relay, &stop, key.clone())?)
            }
            (Some(addr), None) => {
                warn!(%addr, "observability.listen was added by a reload: restart the relay to serve it");
                None
            }
            _ => None,
        };
        Ok(Self {
            config: config.clone(),
            relay,
            server,
            stop,
        })
    }

    /// Relays until the token is cancelled; waits for the endpoint to close (a reload binds it
    /// again).
    async fn run(self) -> anyhow::Result<ExitCode> {
        let total = self.relay.run(self.stop.clone()).await;
        self.stop.cancel();
        if let Some(server) = self.server {
            let _ = tokio::time::timeout(Duration::from_secs(5), server).await;
        }
        let total = total?;
        info!(
            delivered = total.delivered,
            retried = total.retried,
            dead = total.dead,
            source = ?self.config.source,
            "relay stopped"
        );
        Ok(ExitCode::SUCCESS)
    }
}

/// Serves metrics, health and the console for `relay` on `addr` until `stop`.
fn serve(
    config: &pgoutbox::config::Config,
    addr: std::net::SocketAddr,
    handle: metrics_exporter_prometheus::PrometheusHandle,
    relay: &Arc<Relay>,
    stop: &CancellationToken,
    key: Option<pgoutbox::definitions::Key>,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let samples = Arc::new(pgoutbox::server::Samples::default());
    tokio::spawn(pgoutbox::server::refresh_gauges(
        Arc::clone(relay),
        config.observability.gauge_interval,
        samples.clone(),
        stop.clone(),
    ));
    if config.source == Source::Wal {
        tokio::spawn(pgoutbox::server::refresh_wal_gauges(
            relay.store().clone(),
            config.clone(),
            config.observability.gauge_interval,
            stop.clone(),
        ));
    }
    // The console may not change the file's destinations.
    let file_names = config
        .destinations
        .iter()
        .filter(|d| !d.runtime)
        .map(|d| d.name.clone())
        .collect();
    let catalog = pgoutbox::definitions::Catalog::new(relay.store().clone(), key, file_names);
    let console =
        pgoutbox::server::console::Console::new(Arc::clone(relay), samples, &config.admin)
            .with_catalog(catalog);
    config.admin.check(Some(addr))?;
    if !addr.ip().is_loopback() && !config.admin.reads_need_token() {
        warn!(%addr, "admin.open_reads: the console and its API are readable by anyone who reaches this address");
    }
    // Bind before relaying, so a taken port is an error at start rather than a silent loss.
    let listener_check = std::net::TcpListener::bind(addr)
        .with_context(|| format!("cannot listen on {addr} for metrics and health"))?;
    drop(listener_check);
    let (relay, stop) = (Arc::clone(relay), stop.clone());
    let server = tokio::spawn(async move {
        if let Err(e) = pgoutbox::server::serve(addr, handle, relay, Some(console), stop).await {
            warn!(error = %e, "metrics and health endpoint stopped");
        }
    });
    info!(%addr, "serving /metrics, /healthz, /readyz and the console (http://{addr}/)");
    Ok(server)
}

/// Longest a relay statement may run: claims and settles take milliseconds, a cleanup chunk
/// seconds; past this something is wrong (a lock wait, a runaway plan) and the statement fails and
/// is retried rather than hold its locks. Set your own with the URL's `options`.
const STATEMENT_TIMEOUT: Duration = Duration::from_secs(60);

/// How long the relay waits for a pool connection before a claim, settle or cleanup fails (and is
/// retried): long enough that a busy pool is waited for, short enough that an unreachable database
/// is logged soon.
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(10);

/// The relay's pool and sessions, derived from its settings.
///
/// - Size: every claim worker holds a connection for its whole batch in transaction mode and takes
///   another to settle in lease mode (2 per worker); cleanup holds its leader lock on one and
///   deletes on another, the retry scheduler (every destination's due pairs, whatever their
///   number; its lanes' batches take one in turn to settle), the gauge refresher and `/readyz`
///   take one each: `workers * 2 + 5`, whatever the number of destinations.
/// - `idle_in_transaction_session_timeout`: a transaction-mode claim stays idle in its transaction
///   while it publishes, for up to `publish_timeout`; the server ends the session only well past
///   that (twice it, plus 30 s), so a server default cannot cut a healthy claim, while a relay
///   that hangs with its rows locked still loses them.
/// - `statement_timeout`: [`STATEMENT_TIMEOUT`], whatever the server's default.
/// - `jit`: off. The relay's statements take milliseconds, but a prepared statement's generic
///   plan may be costed high (a claim's `LIMIT` is a parameter), and past `jit_above_cost` the
///   server compiles it on every run: 800 ms for a retry claim that runs in 5 ms.
fn pool_settings(relay: &RelayConfig) -> PoolSettings {
    let workers = u32::try_from(relay.workers).unwrap_or(u32::MAX);
    let idle_in_transaction = relay.publish_timeout * 2 + Duration::from_secs(30);
    PoolSettings {
        application_name: "pgoutbox-relay",
        max_connections: workers.saturating_mul(2).saturating_add(5),
        acquire_timeout: ACQUIRE_TIMEOUT,
        session: vec![
            ("statement_timeout", millis(STATEMENT_TIMEOUT)),
            (
                "idle_in_transaction_session_timeout",
                millis(idle_in_transaction),
            ),
            (
                "synchronous_commit",
                relay.synchronous_commit.as_setting().to_owned(),
            ),
            ("jit", "off".to_owned()),
        ],
    }
}

/// A duration as a PostgreSQL setting in milliseconds (the unit both timeouts default to).
fn millis(d: Duration) -> String {
    d.as_millis().to_string()
}

/// How often the version of the destinations added at runtime is read, in case a notification was
/// lost (a reconnect drops them).
const DEFINITIONS_POLL: Duration = Duration::from_secs(1);

/// How long after asking for a reload that did not happen (the new configuration was refused)
/// the same version asks again.
const DEFINITIONS_RETRY: Duration = Duration::from_secs(10);

/// Asks for a reload when the destinations added at runtime move past `version`: woken by their
/// notification, and reading their version every [`DEFINITIONS_POLL`] as the backstop. Its
/// listener holds one connection of the generation's pool until `stop`.
async fn watch_definitions(
    store: pgoutbox::store::Store,
    version: i64,
    reload: tokio::sync::mpsc::Sender<()>,
    stop: CancellationToken,
) {
    let mut listener = None;
    let mut asked: Option<(i64, std::time::Instant)> = None;
    let mut warned = false;
    loop {
        // A new listener misses what committed before it listened: read the version at once.
        let mut now_listening = false;
        if listener.is_none() {
            listener = match pgoutbox::store::definitions::listen(&store).await {
                Ok(l) => {
                    now_listening = true;
                    Some(l)
                }
                Err(e) => {
                    if !std::mem::replace(&mut warned, true) {
                        warn!(error = %e, "cannot listen for changes to the destinations: reading their version each second instead");
                    }
                    None
                }
            };
        }
        if !now_listening {
            let woken = async {
                match listener.as_mut() {
                    Some(l) => l.recv().await.map(drop),
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = stop.cancelled() => return,
                result = woken => if result.is_err() { listener = None },
                _ = tokio::time::sleep(DEFINITIONS_POLL) => {}
            }
        }
        let Ok(now) = pgoutbox::store::definitions::version(&store).await else {
            continue;
        };
        let fresh = match asked {
            Some((v, at)) => v != now || at.elapsed() >= DEFINITIONS_RETRY,
            None => true,
        };
        if now != version && fresh {
            info!(
                version = now,
                "the destinations added at runtime changed: reloading"
            );
            asked = Some((now, std::time::Instant::now()));
            let _ = reload.try_send(());
        }
    }
}

/// First SIGINT/SIGTERM: stop claiming and let in-flight batches settle. Second: exit at once
/// (still safe: unsettled events are claimed again, at least once). SIGHUP: ask for a reload.
async fn watch_signals(
    shutdown: CancellationToken,
    reload: tokio::sync::mpsc::Sender<()>,
    file_wanted: Arc<AtomicBool>,
) {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int), Ok(mut hup)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
        signal(SignalKind::hangup()),
    ) else {
        warn!("cannot install signal handlers");
        return;
    };
    loop {
        tokio::select! {
            _ = term.recv() => break,
            _ = int.recv() => break,
            _ = hup.recv() => {
                info!("SIGHUP: reloading the configuration");
                // One reload waiting is enough: a second SIGHUP meanwhile reads the same file,
                // and one a change asked for reads the file too.
                file_wanted.store(true, AtomicOrdering::SeqCst);
                let _ = reload.try_send(());
            }
        }
    }
    info!("shutting down: no new claims, finishing in-flight batches (signal again to exit now)");
    shutdown.cancel();
    tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
    warn!("second signal: exiting now; unsettled events will be delivered again");
    std::process::exit(130);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pool_and_sessions_follow_the_relay_settings() {
        let relay = RelayConfig {
            workers: 3,
            publish_timeout: Duration::from_secs(20),
            ..RelayConfig::default()
        };
        let settings = pool_settings(&relay);
        assert_eq!(settings.application_name, "pgoutbox-relay");
        assert_eq!(settings.max_connections, 11, "3 workers x 2, 5 others");
        assert_eq!(
            settings.session,
            vec![
                ("statement_timeout", "60000".to_owned()),
                ("idle_in_transaction_session_timeout", "70000".to_owned()),
                ("synchronous_commit", "on".to_owned()),
                ("jit", "off".to_owned()),
            ]
        );
    }
}
