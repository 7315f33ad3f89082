//! Command-line interface: argument parsing, configuration layering and one module per command.

mod audit;
mod cleanup;
mod dead;
mod demo;
mod destination;
mod migrate;
mod relay;
mod replay;
mod slot;
mod status;

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use pgoutbox::config::{Config, Secret};
use pgoutbox::table::{Ident, OutboxTable};
use sqlx::PgPool;

/// pgoutbox: a transactional outbox relay for PostgreSQL.
///
/// Applications write events into the outbox table in their own transactions; `pgoutbox relay`
/// delivers every committed event to webhooks or brokers, at least once.
#[derive(Debug, Parser)]
#[command(name = "pgoutbox", version, propagate_version = true)]
pub struct Cli {
    /// Configuration file (TOML). Database-only commands work without one.
    #[arg(long, short = 'c', global = true, env = "PGOUTBOX_CONFIG")]
    config: Option<PathBuf>,

    /// PostgreSQL URL; overrides the config file and DATABASE_URL.
    #[arg(long, global = true, value_name = "URL", hide_env_values = true)]
    database_url: Option<String>,

    /// Schema of the outbox table [default: public].
    #[arg(long, global = true)]
    schema: Option<String>,

    /// Name of the outbox table [default: outbox].
    #[arg(long, global = true)]
    table: Option<String>,

    /// Log format on standard error.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Human)]
    log_format: LogFormat,

    /// More logging (-v debug, -vv trace). RUST_LOG, when set, wins.
    #[arg(long, short = 'v', global = true, action = clap::ArgAction::Count)]
    verbose: u8,

    #[command(subcommand)]
    command: Command,
}

/// How logs are written.
#[derive(Debug, Clone, Copy, ValueEnum)]
enum LogFormat {
    /// Human-readable lines.
    Human,
    /// One JSON object per line.
    Json,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Create or upgrade the outbox table (idempotent; safe to run from several processes).
    Migrate(migrate::Args),
    /// Run the relay: claim due events, publish them, settle them.
    Relay(relay::Args),
    /// Show pending, failing and dead events and the lag, per destination and topic.
    Status(status::Args),
    /// Inspect, redrive or discard dead-lettered events.
    #[command(subcommand)]
    Dead(dead::Command),
    /// Destinations: add, update, show, list, remove at runtime; pause, resume (`destination`
    /// works too).
    #[command(subcommand, visible_alias = "destination")]
    Destinations(destination::Command),
    /// Send retained events again to one destination; list, watch, pause, resume, cancel replays.
    #[command(subcommand)]
    Replay(replay::Command),
    /// The changes operators made through the console and the CLI, newest first.
    Audit(audit::Args),
    /// The logical replication slot of `source = "wal"`: create, drop, status.
    #[command(subcommand)]
    Slot(slot::Command),
    /// Delete published rows older than the retention, in short batches.
    Cleanup(cleanup::Args),
    /// Benchmarks on a scratch database: drain, sql-limit, baseline, steady, history, ordering, migrate.
    Bench(pgoutbox_bench::Args),
    /// End-to-end demo on the local database: commit and roll back orders, relay them to stdout.
    Demo(demo::Args),
}

/// Log targets whose trace level prints credentials, capped at debug: lapin traces every frame it
/// writes, among them `connection.start-ok`, whose SASL response holds the AMQP password.
const SECRET_TRACING_TARGETS: &[&str] = &["lapin::io_loop=debug"];

/// Whether logs are coloured: only on a terminal, and not when `NO_COLOR` is set to anything
/// but the empty string (<https://no-color.org>).
fn colour(terminal: bool, no_color: Option<&std::ffi::OsStr>) -> bool {
    terminal && no_color.is_none_or(|v| v.is_empty())
}

/// Sets up `tracing` on standard error (coloured only on a terminal, see [`colour`]).
pub fn init_logging(cli: &Cli) {
    let default = match cli.verbose {
        // The bench migrates a fresh table before each run: its step lines would bury the results.
        0 if matches!(cli.command, Command::Bench(_)) => {
            "pgoutbox_core::schema=warn,pgoutbox=info,sqlx=error,warn"
        }
        // sqlx's own slow-statement warnings would drown the relay's logs (bulk work is slow by design).
        0 => "pgoutbox=info,sqlx=error,warn",
        1 => "pgoutbox=debug,sqlx=error,info",
        _ => "trace",
    };
    let mut filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    // Whatever RUST_LOG asks, no target that traces credentials logs at trace level.
    for directive in SECRET_TRACING_TARGETS {
        if let Ok(directive) = directive.parse() {
            filter = filter.add_directive(directive);
        }
    }
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(colour(
            std::io::stderr().is_terminal(),
            std::env::var_os("NO_COLOR").as_deref(),
        ))
        .with_writer(std::io::stderr);
    match cli.log_format {
        LogFormat::Human => builder.init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
}

/// Runs the chosen command.
pub async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match &cli.command {
        Command::Migrate(args) => migrate::run(&cli, args).await,
        Command::Audit(args) => audit::run(&cli, args).await,
        Command::Relay(args) => relay::run(&cli, args).await,
        Command::Status(args) => status::run(&cli, args).await,
        Command::Dead(cmd) => dead::run(&cli, cmd).await,
        Command::Destinations(cmd) => destination::run(&cli, cmd).await,
        Command::Replay(cmd) => replay::run(&cli, cmd).await,
        Command::Slot(cmd) => slot::run(&cli, cmd).await,
        Command::Cleanup(args) => cleanup::run(&cli, args).await,
        Command::Demo(args) => demo::run(&cli, args).await,
        Command::Bench(args) => pgoutbox_bench::run(args, || cli.load_config()).await,
    }
}

impl Cli {
    /// Whether this process is a bench's producer child (`pgoutbox bench produce`).
    pub fn is_bench_producer(&self) -> bool {
        matches!(&self.command, Command::Bench(args) if args.is_producer())
    }

    /// The configuration: file (if any), then environment, then command-line flags.
    fn load_config(&self) -> anyhow::Result<Config> {
        let mut config = match &self.config {
            Some(path) => Config::load(path)?,
            None => Config::from_env()?,
        };
        if let Some(url) = &self.database_url {
            config.database_url = Some(Secret(url.clone()));
        }
        if self.schema.is_some() || self.table.is_some() {
            let schema = match &self.schema {
                Some(s) => Ident::parse(s).context("invalid --schema")?,
                None => config.table.schema().clone(),
            };
            let table = match &self.table {
                Some(t) => Ident::parse(t).context("invalid --table")?,
                None => config.table.table().clone(),
            };
            config.table = OutboxTable::new(schema, table);
        }
        Ok(config)
    }
}

pub use crate::connect::{connect, connect_with, PoolSettings};
pub use pgoutbox::config::parse_duration;
pub use pgoutbox::model::secrets::redact_url;

/// Connects a short-lived command and checks that the outbox table is migrated.
pub async fn connect_checked(config: &Config, max_connections: u32) -> anyhow::Result<PgPool> {
    connect_checked_with(config, &PoolSettings::command(max_connections)).await
}

/// Connects with `settings` and checks that the outbox table is migrated.
pub async fn connect_checked_with(
    config: &Config,
    settings: &PoolSettings,
) -> anyhow::Result<PgPool> {
    let pool = connect_with(config.database_url()?, settings).await?;
    let mut conn = pool
        .acquire()
        .await
        .context("cannot get a database connection")?;
    pgoutbox::schema::ensure_current(&mut conn, &config.table).await?;
    Ok(pool)
}

/// Fails with a sentence naming the missing grants when the role cannot run the relay.
pub async fn check_relay_privileges(pool: &PgPool, config: &Config) -> anyhow::Result<()> {
    let mut conn = pool.acquire().await?;
    let missing = pgoutbox::schema::missing_relay_privileges(&mut conn, &config.table).await?;
    if !missing.is_empty() {
        let role = pgoutbox::store::server::current_user(&mut *conn).await?;
        anyhow::bail!(
            "role {role} lacks {} on {}: as the table owner, run `pgoutbox migrate --grant-relay {role}`",
            missing.join(", "),
            config.table
        );
    }
    Ok(())
}

/// The error for a destination name the configuration does not have, listing those it has.
pub fn no_such_destination(config: &Config, name: &str) -> anyhow::Error {
    anyhow::anyhow!(
        "no destination named {name:?} in the configuration; configured: {}",
        config
            .destination_names()
            .unwrap_or_else(|| "none (pass --config)".to_owned())
    )
}

/// Formats an age in seconds as `3d 4h`, `12m 5s`, `850ms`.
pub fn human_age(seconds: Option<f64>) -> String {
    let Some(s) = seconds else { return "-".into() };
    if s < 1.0 {
        return format!("{}ms", (s * 1000.0).max(0.0) as u64);
    }
    let secs = s as u64;
    let (d, h, m, sec) = (secs / 86400, secs / 3600 % 24, secs / 60 % 60, secs % 60);
    match (d, h, m) {
        (0, 0, 0) => format!("{sec}s"),
        (0, 0, _) => format!("{m}m {sec}s"),
        (0, _, _) => format!("{h}h {m}m"),
        _ => format!("{d}d {h}h"),
    }
}

#[cfg(test)]
mod tests {
    use super::colour;
    use std::ffi::OsStr;

    #[test]
    fn dead_events_are_selected_by_ids_a_filter_or_all() {
        use clap::Parser;
        let parses = |args: &[&str]| {
            super::Cli::try_parse_from(["pgoutbox", "dead"].iter().chain(args)).is_ok()
        };
        let id = "018f3c1e-0000-7000-8000-000000000001";
        for ok in [
            &["retry", "--destination", "webhook"][..],
            &["retry", "--topic", "order.created"],
            &["retry", "--all"],
            &["retry", id],
            &["retry", id, "--destination", "webhook"],
            &["discard", "--destination", "webhook", "--yes"],
        ] {
            assert!(parses(ok), "{ok:?}");
        }
        for refused in [
            &["retry"][..],
            &["retry", "--all", id],
            &["discard", "--yes"],
        ] {
            assert!(!parses(refused), "{refused:?}");
        }
    }

    #[test]
    fn colour_only_on_a_terminal_without_no_color() {
        // (terminal, NO_COLOR) → coloured
        let cases: &[((bool, Option<&str>), bool)] = &[
            ((true, None), true),
            ((true, Some("")), true),
            ((true, Some("1")), false),
            ((false, None), false),
            ((false, Some("1")), false),
        ];
        for &((terminal, no_color), expected) in cases {
            assert_eq!(
                colour(terminal, no_color.map(OsStr::new)),
                expected,
                "{terminal} {no_color:?}"
            );
        }
    }
}
