//! Configuration: a TOML file, then `DATABASE_URL` / `PGOUTBOX_*` environment overrides, then
//! validation. Every error names the file, the key and the problem.
//!
//! ```toml
//! database_url = "postgres://postgres@127.0.0.1:5432/app"
//!
//! [[destinations]]
//! name = "billing"
//! type = "webhook"
//! url = "http://127.0.0.1:9000/events"
//! secret = "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD"   # optional
//! topics = ["order.*", "payment.*"]                    # optional glob list, default: all
//! ```

mod database;
pub(crate) mod destination;
mod duration;
mod error;
mod flat;
mod observability;
mod relay;
mod secret;
mod wal;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;

use crate::table::{Ident, OutboxTable};
use destination::parse_destination;
use duration::parse_duration_key;

pub use database::{DatabaseHosts, ServerRole, SessionAttrs};
pub use destination::{
    sink_settings, DestinationConfig, NoSettings, OnDead, Ordering, Settings, SinkConfig,
};
pub use duration::{duration_str, opt_duration_str, parse_duration};
pub use error::ConfigError;
pub use flat::Flat;
pub use observability::{AdminConfig, NamedToken, ObservabilityConfig, OtlpConfig, Role};
pub use relay::{ClaimMode, History, RelayConfig, SettleCommit, Source};
pub use secret::Secret;
pub use wal::WalConfig;

/// Default PostgreSQL URL for commands run with no configuration at all (the local database).
pub const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

/// The whole pgoutbox configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// PostgreSQL URL; `sslmode` (including `verify-full`) is honoured.
    pub database_url: Option<Secret>,
    /// The outbox table.
    pub table: OutboxTable,
    /// How long published rows are kept; zero deletes them at settle time.
    pub retention: Duration,
    /// Where published events are kept for `retention`: in the outbox, or moved to partitions.
    pub history: History,
    /// How long dead rows are kept; `None` keeps them until discarded.
    pub dead_retention: Option<Duration>,
    /// How long the history of failed attempts is kept (the console's per-event history).
    pub attempts_retention: Duration,
    /// How often the relay runs cleanup.
    pub cleanup_interval: Duration,
    /// Relay tuning.
    pub relay: RelayConfig,
    /// Where the relay takes events from: the table (`poll`, default) or the WAL (`wal`).
    pub source: Source,
    /// `[wal]`: the replication slot and publication of `source = "wal"`.
    pub wal: WalConfig,
    /// Metrics and health endpoints.
    pub observability: ObservabilityConfig,
    /// Who may use the operator console (served on the observability listener).
    pub admin: AdminConfig,
    /// Where events go; an event goes to every destination whose topics (and filter) match.
    /// Shared, not copied: the relay's lanes and a reload's comparison hold the same definitions,
    /// and with a hundred thousand destinations each copy would cost hundreds of MiB.
    pub destinations: Vec<Arc<DestinationConfig>>,
}

/// The file as written, before validation.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    database_url: Option<Secret>,
    schema: Option<String>,
    table: Option<String>,
    retention: Option<String>,
    #[serde(default)]
    history: History,
    dead_retention: Option<String>,
    attempts_retention: Option<String>,
    cleanup_interval: Option<String>,
    #[serde(default)]
    relay: RelayConfig,
    #[serde(default)]
    source: Source,
    #[serde(default)]
    wal: WalConfig,
    #[serde(default)]
    observability: ObservabilityConfig,
    #[serde(default)]
    admin: AdminConfig,
    #[serde(default)]
    destinations: Vec<toml::Table>,
}

impl Config {
    /// The configured destinations' names, comma-separated, for an error naming those there
    /// are; `None` when there are none.
    pub fn destination_names(&self) -> Option<String> {
        let names: Vec<&str> = self.destinations.iter().map(|d| d.name.as_str()).collect();
        (!names.is_empty()).then(|| names.join(", "))
    }

    /// Reads and validates a config file, then applies the process environment.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            file: Some(path.to_owned()),
            key: None,
            message: format!("cannot read the file: {e}"),
        })?;
        Self::parse(&text, |k| std::env::var(k).ok()).map_err(|mut e| {
            e.file = Some(path.to_owned());
            e
        })
    }

    /// A configuration with no file: defaults plus the environment (for database-only commands).
    pub fn from_env() -> Result<Self, ConfigError> {
        Self::parse("", |k| std::env::var(k).ok())
    }

    /// Parses TOML text, with `env` looked up for overrides.
    pub fn parse(text: &str, env: impl Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        let mut raw: RawConfig = toml::from_str(text).map_err(|e| ConfigError {
            file: None,
            key: None,
            message: format!("invalid TOML: {}", e.to_string().trim_end()),
        })?;

        // Environment overrides the file.
        if let Some(url) = env("PGOUTBOX_DATABASE_URL").or_else(|| env("DATABASE_URL")) {
            raw.database_url = Some(Secret(url));
        }
        let overrides: [(&str, &mut Option<String>); 5] = [
            ("PGOUTBOX_SCHEMA", &mut raw.schema),
            ("PGOUTBOX_TABLE", &mut raw.table),
            ("PGOUTBOX_RETENTION", &mut raw.retention),
            ("PGOUTBOX_DEAD_RETENTION", &mut raw.dead_retention),
            ("PGOUTBOX_CLEANUP_INTERVAL", &mut raw.cleanup_interval),
        ];
        for (var, slot) in overrides {
            if let Some(v) = env(var) {
                *slot = Some(v);
            }
        }
        if let Some(v) = env("PGOUTBOX_BATCH_SIZE") {
            raw.relay.batch_size = v.parse().map_err(|_| {
                ConfigError::at("PGOUTBOX_BATCH_SIZE", format!("not a number: {v:?}"))
            })?;
        }
        if let Some(v) = env("PGOUTBOX_METRICS_LISTEN") {
            raw.observability.listen = Some(v.parse().map_err(|_| {
                ConfigError::at(
                    "PGOUTBOX_METRICS_LISTEN",
                    format!("not an address like 127.0.0.1:9187: {v:?}"),
                )
            })?);
        }
        if let Some(v) = env("PGOUTBOX_WORKERS") {
            raw.relay.workers = v
                .parse()
                .map_err(|_| ConfigError::at("PGOUTBOX_WORKERS", format!("not a number: {v:?}")))?;
        }

        let schema = Ident::parse(raw.schema.as_deref().unwrap_or("public"))
            .map_err(|e| ConfigError::at("schema", e.to_string()))?;
        let table = Ident::parse(raw.table.as_deref().unwrap_or("outbox"))
            .map_err(|e| ConfigError::at("table", e.to_string()))?;
        let retention = parse_duration_key("retention", raw.retention.as_deref().unwrap_or("7d"))?;
        let dead_retention = raw
            .dead_retention
            .as_deref()
            .filter(|v| *v != "keep")
            .map(|v| parse_duration_key("dead_retention", v))
            .transpose()?;
        let attempts_retention = parse_duration_key(
            "attempts_retention",
            raw.attempts_retention.as_deref().unwrap_or("7d"),
        )?;
        let cleanup_interval = parse_duration_key(
            "cleanup_interval",
            raw.cleanup_interval.as_deref().unwrap_or("1m"),
        )?;
        if raw.relay.batch_size == 0 || raw.relay.batch_size > 10_000 {
            return Err(ConfigError::at(
                "relay.batch_size",
                "must be between 1 and 10000",
            ));
        }
        if raw.relay.workers == 0 || raw.relay.workers > 64 {
            return Err(ConfigError::at("relay.workers", "must be between 1 and 64"));
        }
        if raw.relay.min_poll_interval > raw.relay.poll_interval {
            return Err(ConfigError::at(
                "relay.min_poll_interval",
                "must not exceed relay.poll_interval",
            ));
        }
        if raw.relay.lease() <= raw.relay.publish_timeout {
            return Err(ConfigError::at(
                "relay.lease",
                "must be longer than relay.publish_timeout, or a lease could expire mid-publish",
            ));
        }
        if raw.relay.publish_timeout.is_zero() {
            return Err(ConfigError::at(
                "relay.publish_timeout",
                "must be more than zero",
            ));
        }

        if let Some(v) = env("PGOUTBOX_SOURCE") {
            raw.source = choice(
                "PGOUTBOX_SOURCE",
                &v,
                &[("poll", Source::Poll), ("wal", Source::Wal)],
            )?;
        }
        if let Some(v) = env("PGOUTBOX_HISTORY") {
            raw.history = choice(
                "PGOUTBOX_HISTORY",
                &v,
                &[
                    ("outbox", History::Outbox),
                    ("partitions", History::Partitions),
                ],
            )?;
        }
        // Slot and publication names are identifiers: the same rule as table names, so that they
        // can be quoted safely (and slot names allow only lower case, digits and `_`).
        for (key, name) in [
            ("wal.slot", &raw.wal.slot),
            ("wal.publication", &raw.wal.publication),
        ] {
            if let Some(name) = name {
                Ident::parse(name).map_err(|e| ConfigError::at(key, e.to_string()))?;
            }
        }
        if let Some(slot) = &raw.wal.slot {
            if slot.chars().any(|c| c.is_ascii_uppercase()) {
                return Err(ConfigError::at(
                    "wal.slot",
                    "a replication slot name may hold only lower-case letters, digits and _",
                ));
            }
        }
        if raw.wal.heartbeat_interval.is_zero() || raw.wal.status_interval.is_zero() {
            return Err(ConfigError::at(
                "wal",
                "heartbeat_interval and status_interval must be more than zero",
            ));
        }

        let mut destinations: Vec<Arc<DestinationConfig>> = Vec::new();
        // A set, not a scan of those before: a file may name tens of thousands of destinations.
        let mut names = std::collections::HashSet::new();
        for (i, table) in raw.destinations.into_iter().enumerate() {
            let dest = parse_destination(i, table)?;
            if !names.insert(dest.name.clone()) {
                return Err(ConfigError::at(
                    format!("destinations[{i}].name"),
                    format!("destination name {:?} is used twice", dest.name),
                ));
            }
            destinations.push(Arc::new(dest));
        }

        raw.admin.check_names()?;
        Ok(Self {
            database_url: raw.database_url,
            table: OutboxTable::new(schema, table),
            retention,
            history: raw.history,
            dead_retention,
            attempts_retention,
            cleanup_interval,
            relay: raw.relay,
            source: raw.source,
            wal: raw.wal,
            observability: raw.observability,
            admin: raw.admin,
            destinations,
        })
    }

    /// The database URL, or an error saying how to give one.
    pub fn database_url(&self) -> Result<&str, ConfigError> {
        self.database_url.as_ref().map(|s| s.0.as_str()).ok_or_else(|| {
            ConfigError::at(
                "database_url",
                "no database URL: set it in the config file, in DATABASE_URL, or with --database-url",
            )
        })
    }
}

/// The value of the environment variable `key` among `choices` (the spelling, the value).
fn choice<T: Copy>(key: &str, value: &str, choices: &[(&str, T)]) -> Result<T, ConfigError> {
    choices
        .iter()
        .find(|(name, _)| *name == value)
        .map(|(_, v)| *v)
        .ok_or_else(|| {
            let names: Vec<String> = choices.iter().map(|(n, _)| format!("{n:?}")).collect();
            ConfigError::at(
                key,
                format!("must be {}, not {value:?}", names.join(" or ")),
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_env(_: &str) -> Option<String> {
        None
    }

    const EXAMPLE: &str = r#"
database_url = "postgres://postgres@127.0.0.1:5432/app"

[[destinations]]
name = "billing"
type = "webhook"
url = "http://127.0.0.1:9000/events"
secret = "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD"   # optional
topics = ["order.*", "payment.*"]                    # optional glob list, default: all
retry_schedule = ["1s", "30s", "5m"]
max_attempts = 10
"#;

    #[test]
    fn the_documented_shape_parses() {
        let c = Config::parse(EXAMPLE, no_env).expect("valid");
        assert_eq!(
            c.database_url().expect("set"),
            "postgres://postgres@127.0.0.1:5432/app"
        );
        assert_eq!(c.destinations.len(), 1);
        let d = &c.destinations[0];
        assert_eq!(d.subscription.topics, vec!["order.*", "payment.*"]);
        assert_eq!(d.retry.max_attempts, Some(10));
        assert_eq!(d.retry.schedule[2], Duration::from_secs(300));
        assert_eq!(c.retention, Duration::from_secs(7 * 86400));
        assert_eq!(d.sink.kind, "webhook");
        assert!(
            !format!("{c:?}").contains("C2FVsBQIhrsc"),
            "secrets must not show in Debug"
        );
    }

    #[test]
    fn environment_overrides_the_file() {
        let env = |k: &str| match k {
            "DATABASE_URL" => Some("postgres://other/db".to_owned()),
            "PGOUTBOX_TABLE" => Some("events".to_owned()),
            _ => None,
        };
        let c = Config::parse(EXAMPLE, env).expect("valid");
        assert_eq!(c.database_url().expect("set"), "postgres://other/db");
        assert_eq!(c.table.table().as_str(), "events");
    }

    fn error_of(text: &str) -> String {
        Config::parse(text, no_env)
            .expect_err("must be rejected")
            .to_string()
    }

    #[test]
    fn secrets_come_from_the_file_the_environment_or_a_file_it_names() {
        let dir = std::env::temp_dir().join(format!("pgoutbox-secret-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let file = dir.join("db_url");
        std::fs::write(&file, "postgres://app:from-a-file@db/app\n").expect("write");
        // nextest runs each test in its own process: setting a variable touches no other test.
        std::env::set_var(
            "PGOUTBOX_TEST_WEBHOOK_SECRET",
            "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD",
        );
        let text = format!(
            "database_url = {{ file = {:?} }}\n\
             [[destinations]]\nname = \"b\"\ntype = \"webhook\"\nurl = \"http://a/\"\n\
             secret = {{ env = \"PGOUTBOX_TEST_WEBHOOK_SECRET\" }}\n",
            file.display().to_string()
        );
        let c = Config::parse(&text, no_env).expect("valid");
        assert_eq!(
            c.database_url().expect("set"),
            "postgres://app:from-a-file@db/app",
            "one trailing newline dropped"
        );
        #[derive(Debug, Deserialize)]
        struct Hook {
            #[allow(dead_code)]
            url: Secret,
            secret: Secret,
        }
        let settings: Hook =
            sink_settings(&c.destinations[0].sink.settings.to_table()).expect("webhook");
        assert_eq!(
            settings.secret.expose(),
            "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD"
        );
        assert!(!format!("{c:?}{settings:?}").contains("from-a-file"));

        let from_file = |path: &std::path::Path| {
            error_of(&format!(
                "database_url = {{ file = {:?} }}\n",
                path.display().to_string()
            ))
        };
        let e = from_file(&dir.join("nope"));
        assert!(
            e.contains("database_url")
                && e.contains("cannot read the secret file")
                && e.contains("nope"),
            "{e}"
        );
        let e = error_of("database_url = { env = \"PGOUTBOX_TEST_NEVER_SET\" }\n");
        assert!(e.contains("`PGOUTBOX_TEST_NEVER_SET` is not set"), "{e}");
        for bad in [
            "database_url = { env = \"A\", file = \"/b\" }\n",
            "database_url = { vault = \"x\" }\n",
            "database_url = {}\n",
            "database_url = 5\n",
        ] {
            let e = error_of(bad);
            assert!(e.contains("a secret is a string"), "{bad}: {e}");
        }
        std::fs::write(&file, "\n").expect("write");
        let e = from_file(&file);
        assert!(e.contains("empty"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn errors_name_the_key_and_problem() {
        let e = error_of("database_url = ");
        assert!(e.contains("invalid TOML"), "{e}");

        let e = error_of("table = \"x; drop table y\"\n");
        assert!(
            e.contains("`table`") && e.contains("invalid SQL identifier"),
            "{e}"
        );

        let e = error_of("retention = \"forever\"\n");
        assert!(e.contains("`retention`") && e.contains("forever"), "{e}");

        let e = error_of(
            "[[destinations]]\nname = \"a\"\ntype = \"null\"\nfilter = \"payload.total >\"\n",
        );
        assert!(e.contains("destinations[0].filter"), "{e}");

        let dest =
            |extra: &str| format!("[[destinations]]\nname = \"a\"\ntype = \"null\"\n{extra}\n");
        for (bad, says) in [
            ("rate_limit = \"fast\"", "not a rate"),
            ("rate_limit = 200", "found integer"),
            ("rate_limit = { rate = \"10/s\", burst = 0 }", "burst"),
            ("rate_limit = { rate = \"10/s\", brust = 5 }", "brust"),
        ] {
            let e = error_of(&dest(bad));
            assert!(
                e.contains("destinations[0].rate_limit") && e.contains(says),
                "{bad}: {e}"
            );
        }
        let c = Config::parse(
            &dest("rate_limit = { rate = \"600/m\", burst = 3 }"),
            no_env,
        )
        .expect("valid");
        let limit = c.destinations[0].rate_limit.expect("limit");
        assert_eq!((limit.per_second, limit.burst), (10.0, 3));

        let e = error_of("bogus = 1\n");
        assert!(e.contains("bogus"), "{e}");

        let e = error_of(&format!(
            "{}{}{}",
            dest(""),
            dest("topics = [\"b\"]"),
            dest("")
        ));
        assert!(
            e.contains("destinations[1].name") && e.contains("\"a\" is used twice"),
            "{e}"
        );
    }

    #[test]
    fn the_source_is_poll_unless_wal_is_asked_for() {
        let c = Config::parse("", no_env).expect("parse");
        assert_eq!(c.source, Source::Poll);
        assert_eq!(c.wal.slot_name(&c.table), "pgoutbox_outbox");
        let c = Config::parse(
            "source = \"wal\"\n[wal]\nslot = \"orders_slot\"\nheartbeat_interval = \"2s\"\n",
            no_env,
        )
        .expect("parse");
        assert_eq!(c.source, Source::Wal);
        assert_eq!(c.wal.slot_name(&c.table), "orders_slot");
        assert_eq!(c.wal.publication_name(&c.table), "pgoutbox_outbox");
        assert_eq!(c.wal.heartbeat_interval, Duration::from_secs(2));
        let env = |k: &str| (k == "PGOUTBOX_SOURCE").then(|| "wal".to_owned());
        assert_eq!(Config::parse("", env).expect("parse").source, Source::Wal);
        let e = error_of("[wal]\nslot = \"Bad-Name\"\n");
        assert!(e.contains("wal.slot"), "{e}");
        let e = error_of("[wal]\nslot = \"Upper\"\n");
        assert!(e.contains("lower-case"), "{e}");
        let e = error_of("source = \"kafka\"\n");
        assert!(e.contains("source") || e.contains("kafka"), "{e}");
    }
}
