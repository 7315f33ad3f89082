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

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Deserialize;

use crate::retry::RetryPolicy;
use crate::table::{Ident, OutboxTable};

/// A configuration problem: where it is and what is wrong.
#[derive(Debug, thiserror::Error)]
pub struct ConfigError {
    /// The file, when the problem is in one.
    pub file: Option<PathBuf>,
    /// The key (dotted path), when known.
    pub key: Option<String>,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.file {
            Some(file) => write!(f, "invalid configuration in {}", file.display())?,
            None => f.write_str("invalid configuration")?,
        }
        if let Some(key) = &self.key {
            write!(f, ": key `{key}`")?;
        }
        write!(f, ": {}", self.message)
    }
}

impl ConfigError {
    fn at(key: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            file: None,
            key: Some(key.into()),
            message: message.into(),
        }
    }
}

/// A secret string whose `Debug` never shows it.
///
/// In the file it is written in one of three ways: the value itself (`"whsec_…"`), the name of an
/// environment variable that holds it (`{ env = "BILLING_WEBHOOK_SECRET" }`), or the path of a file
/// that holds it (`{ file = "/run/credentials/pgoutbox/billing" }`, the form systemd credentials
/// and Kubernetes secret volumes give). The reference is resolved when the configuration loads;
/// a file's one trailing newline is dropped (`echo value > file` writes one). A missing variable or
/// an unreadable file is a configuration error that names the variable or the path, never a value.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(pub String);

impl Secret {
    /// The secret's value, for the one place that uses it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(***)")
    }
}

/// What a secret may be written as, for the errors that reject another form.
const SECRET_FORMS: &str = "a secret is a string, `{ env = \"NAME\" }` or `{ file = \"PATH\" }`";

/// Where a secret is read from, as written in the file: `{ env = "NAME" }` or `{ file = "PATH" }`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SecretSource {
    env: Option<String>,
    file: Option<PathBuf>,
}

impl SecretSource {
    /// Reads the value this source points at.
    fn resolve(self) -> Result<String, String> {
        let value = match (self.env, self.file) {
            (Some(name), None) => std::env::var(&name).map_err(|e| match e {
                std::env::VarError::NotPresent => {
                    format!("secret from the environment: `{name}` is not set")
                }
                std::env::VarError::NotUnicode(_) => {
                    format!("secret from the environment: `{name}` is not UTF-8")
                }
            })?,
            (None, Some(path)) => {
                let mut text = std::fs::read_to_string(&path)
                    .map_err(|e| format!("cannot read the secret file {}: {e}", path.display()))?;
                if text.ends_with('\n') {
                    text.pop();
                    if text.ends_with('\r') {
                        text.pop();
                    }
                }
                text
            }
            _ => return Err(SECRET_FORMS.into()),
        };
        if value.is_empty() {
            return Err("the secret it points at is empty".into());
        }
        Ok(value)
    }
}

impl<'de> Deserialize<'de> for Secret {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Written {
            Value(String),
            Source(SecretSource),
        }
        // Untagged errors say only "did not match any variant"; say what is accepted instead.
        match Written::deserialize(d).map_err(|_| serde::de::Error::custom(SECRET_FORMS))? {
            Written::Value(value) => Ok(Secret(value)),
            Written::Source(source) => source
                .resolve()
                .map(Secret)
                .map_err(serde::de::Error::custom),
        }
    }
}

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
    pub admin: crate::admin::AdminConfig,
    /// Where events go; an event goes to every destination whose topics (and filter) match.
    pub destinations: Vec<DestinationConfig>,
}

/// Where published events are kept until `retention` is over (with `retention` above zero).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum History {
    /// Marked published in the outbox table; cleanup deletes them row by row (vacuum reclaims).
    #[default]
    Outbox,
    /// Moved at settle to `<table>_history`, partitioned by publish time; cleanup drops whole
    /// partitions, so neither table bloats (see [`crate::history`]).
    Partitions,
}

/// Where the relay takes events from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    /// Claim pending rows from the outbox table (`FOR UPDATE SKIP LOCKED`): works everywhere.
    #[default]
    Poll,
    /// Read inserted rows and `outbox_emit` messages from a logical replication slot, in commit
    /// order (see [`crate::wal`]).
    Wal,
}

/// `[wal]`: logical replication settings, used when `source = "wal"`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WalConfig {
    /// The replication slot (default `pgoutbox_<table>`); `pgoutbox slot create` makes it.
    pub slot: Option<String>,
    /// The publication of the outbox table's inserts (default `pgoutbox_<table>`).
    pub publication: Option<String>,
    /// How often a quiet relay writes a heartbeat into the WAL, so that its slot moves on when
    /// the outbox sees no writes (other tables' writes would otherwise pin WAL behind it).
    #[serde(with = "duration_str")]
    pub heartbeat_interval: Duration,
    /// How often the confirmed position is reported to the server.
    #[serde(with = "duration_str")]
    pub status_interval: Duration,
    /// How often a standby relay (the slot is held by another) tries to take the slot over.
    #[serde(with = "duration_str")]
    pub standby_retry: Duration,
    /// How long a batch waits for more transactions after its first one, unless it is full:
    /// fewer, larger batches (one settle transaction each) for a little latency. "0s" publishes
    /// each transaction as soon as it is read.
    #[serde(with = "duration_str")]
    pub batch_wait: Duration,
    /// How long the rows of delivered events wait to be deleted (or marked published) together
    /// with later batches' rows: one statement for many batches. The slot is confirmed past an
    /// event only once its row is written, so a longer wait only means more to read again after
    /// a crash; "0s" writes each batch's rows as soon as it is settled.
    #[serde(with = "duration_str")]
    pub settle_wait: Duration,
}

impl Default for WalConfig {
    fn default() -> Self {
        Self {
            slot: None,
            publication: None,
            heartbeat_interval: Duration::from_secs(10),
            status_interval: Duration::from_secs(1),
            standby_retry: Duration::from_secs(2),
            batch_wait: Duration::from_millis(2),
            settle_wait: Duration::from_millis(50),
        }
    }
}

impl WalConfig {
    /// The slot's name: configured, or `pgoutbox_<table>`.
    pub fn slot_name(&self, table: &OutboxTable) -> String {
        self.slot
            .clone()
            .unwrap_or_else(|| format!("pgoutbox_{}", table.table().as_str()))
    }

    /// The publication's name: configured, or `pgoutbox_<table>`.
    pub fn publication_name(&self, table: &OutboxTable) -> String {
        self.publication
            .clone()
            .unwrap_or_else(|| format!("pgoutbox_{}", table.table().as_str()))
    }
}

/// How the relay holds claimed rows while it publishes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ClaimMode {
    /// Rows stay locked by the claiming transaction until settled (fast brokers).
    Transaction,
    /// Rows are leased (expiry + fencing token); no transaction is open while publishing.
    Lease,
}

/// `[relay]`: the claim loop's tuning.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RelayConfig {
    /// Most rows claimed per batch.
    pub batch_size: usize,
    /// Concurrent claim loops per relay process; with `source = "wal"`, batches in flight at once
    /// (one when a destination is ordered by key).
    pub workers: usize,
    /// The longest an idle relay waits before it looks for due rows again.
    #[serde(with = "duration_str")]
    pub poll_interval: Duration,
    /// The first wait after an empty claim; it doubles on each empty claim up to `poll_interval`.
    /// Set it equal to `poll_interval` for fixed-interval polling.
    #[serde(with = "duration_str")]
    pub min_poll_interval: Duration,
    /// Upper bound for publishing one batch; a row lock or lease is never held on the network longer.
    #[serde(with = "duration_str")]
    pub publish_timeout: Duration,
    /// `transaction` (default) or `lease`.
    pub claim: ClaimMode,
    /// After SIGTERM, how long in-flight batches may take before they are released unsettled.
    #[serde(with = "duration_str")]
    pub shutdown_grace: Duration,
    /// Lease mode: how long a claim lasts (default: twice `publish_timeout`).
    #[serde(with = "opt_duration_str")]
    pub lease: Option<Duration>,
    /// `synchronous_commit` of the relay's own sessions (claims, settles, cleanup); producers keep
    /// theirs. See [`SettleCommit`].
    pub synchronous_commit: SettleCommit,
}

/// Whether the relay's commits wait for the WAL flush.
///
/// `on` (default): every settle is durable before the next claim. `off`: a settle returns as soon
/// as it is in the WAL buffers, so no claim loop waits on the disk (on a slow disk; measured here
/// it made no difference, docs/performance.md, "Tail"). Safe for
/// at-least-once: producers' commits stay synchronous, so no event is lost; only if the
/// *database server* crashes can the last settles (at most about three `wal_writer_delay`s, 600
/// ms by default) be lost, and those events are delivered again, as after a relay crash.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SettleCommit {
    /// Wait for the WAL flush (the default, as PostgreSQL's).
    On,
    /// Do not wait.
    Off,
}

impl SettleCommit {
    /// The setting's value for PostgreSQL.
    pub fn as_setting(self) -> &'static str {
        match self {
            Self::On => "on",
            Self::Off => "off",
        }
    }
}

impl RelayConfig {
    /// The lease length in force.
    pub fn lease(&self) -> Duration {
        self.lease.unwrap_or(self.publish_timeout * 2)
    }
}

impl Default for RelayConfig {
    fn default() -> Self {
        Self {
            batch_size: 500,
            workers: 2,
            poll_interval: Duration::from_millis(25),
            min_poll_interval: Duration::from_millis(1),
            publish_timeout: Duration::from_secs(30),
            claim: ClaimMode::Transaction,
            shutdown_grace: Duration::from_secs(10),
            lease: None,
            synchronous_commit: SettleCommit::On,
        }
    }
}

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
    pub otlp: crate::otlp::OtlpConfig,
}

impl Default for ObservabilityConfig {
    fn default() -> Self {
        Self {
            listen: None,
            gauge_interval: Duration::from_secs(15),
            otlp: crate::otlp::OtlpConfig::default(),
        }
    }
}

/// One destination: its routing, its retry policy and its sink.
#[derive(Debug, Clone)]
pub struct DestinationConfig {
    /// Unique name, recorded on each row it handles.
    pub name: String,
    /// Topic globs (`order.*`); empty matches every topic.
    pub topics: Vec<String>,
    /// A CEL expression an event must also satisfy to go here.
    pub filter: Option<crate::route::Filter>,
    /// Retry schedule and limits.
    pub retry: RetryPolicy,
    /// Per-key ordering of this destination's events.
    pub ordering: Ordering,
    /// Ordered mode: what a dead-lettered event does to the later events of its key.
    pub on_dead: OnDead,
    /// When the destination counts as down, and how it is probed until it is back.
    pub breaker: BreakerConfig,
    /// The sink and its own settings.
    pub sink: SinkConfig,
}

impl DestinationConfig {
    /// Whether a dead event of this destination holds back the later events of its key.
    pub fn dead_blocks(&self) -> bool {
        self.ordering == Ordering::Key && self.on_dead == OnDead::Block
    }
}

/// `breaker`: a destination's circuit breaker.
///
/// After `failures` failed attempts in a row the breaker opens: the destination's events wait
/// (held, no attempt counted, not moving toward dead) while one probe at a time, first after
/// `probe_interval` and then at doubling intervals up to `max_probe_interval`, tries one event.
/// The first probe the destination answers closes it, and its events are due again.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BreakerConfig {
    /// Consecutive failed attempts that open the breaker; 0 turns the breaker off.
    pub failures: u32,
    /// Wait before the first probe.
    #[serde(with = "duration_str")]
    pub probe_interval: Duration,
    /// Longest wait between probes.
    #[serde(with = "duration_str")]
    pub max_probe_interval: Duration,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        Self {
            failures: 10,
            probe_interval: Duration::from_secs(1),
            max_probe_interval: Duration::from_secs(15),
        }
    }
}

/// `ordering`: whether events of one key are published in insert order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Ordering {
    /// No ordering: events are published concurrently (fastest).
    #[default]
    None,
    /// Events with the same `key` are published in `seq` order; keyless events are unordered.
    Key,
}

/// `on_dead`: what happens to a key's later events when its head event is dead-lettered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnDead {
    /// Later events wait until the dead event is retried (`dead retry`) or discarded (default).
    #[default]
    Block,
    /// Later events go on; the dead event stays in the dead letters.
    Skip,
}

/// A sink's type and its own settings (the destination table minus the common keys).
///
/// The settings are checked at load time by the sink's registry entry ([`crate::publish::registry`]),
/// so a typo is reported before the relay starts.
#[derive(Clone)]
pub struct SinkConfig {
    /// The `type` key: a name from the sink registry.
    pub kind: String,
    /// The sink's own keys.
    pub settings: toml::Table,
}

impl SinkConfig {
    /// A sink with no settings of its own (`stdout`, `null`).
    pub fn bare(kind: &str) -> Self {
        Self {
            kind: kind.to_owned(),
            settings: toml::Table::new(),
        }
    }
}

impl fmt::Debug for SinkConfig {
    // Settings may hold secrets: show the keys only.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SinkConfig")
            .field("kind", &self.kind)
            .field("keys", &self.settings.keys().collect::<Vec<_>>())
            .finish()
    }
}

/// Deserializes a sink's settings, rejecting unknown keys with the serde message.
pub fn sink_settings<T: DeserializeOwned>(settings: &toml::Table) -> Result<T, String> {
    deserialize(settings.clone())
}

/// The settings of a sink that has none: any key is an error.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NoSettings {}

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
    admin: crate::admin::AdminConfig,
    #[serde(default)]
    destinations: Vec<toml::Table>,
}

/// Keys every destination has, whatever its type.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CommonDestination {
    name: String,
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    topics: Vec<String>,
    filter: Option<String>,
    retry_schedule: Option<Vec<String>>,
    max_attempts: Option<u32>,
    max_age: Option<String>,
    #[serde(default)]
    ordering: Ordering,
    #[serde(default)]
    on_dead: OnDead,
    #[serde(default)]
    breaker: BreakerConfig,
}

const COMMON_KEYS: &[&str] = &[
    "name",
    "type",
    "topics",
    "filter",
    "retry_schedule",
    "max_attempts",
    "max_age",
    "ordering",
    "on_dead",
    "breaker",
];

impl Config {
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

        let mut destinations: Vec<DestinationConfig> = Vec::new();
        for (i, table) in raw.destinations.into_iter().enumerate() {
            let dest = parse_destination(i, table)?;
            if destinations.iter().any(|d| d.name == dest.name) {
                return Err(ConfigError::at(
                    format!("destinations[{i}].name"),
                    format!("destination name {:?} is used twice", dest.name),
                ));
            }
            destinations.push(dest);
        }

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

fn parse_destination(
    index: usize,
    mut table: toml::Table,
) -> Result<DestinationConfig, ConfigError> {
    let mut common = toml::Table::new();
    for key in COMMON_KEYS {
        if let Some(v) = table.remove(*key) {
            common.insert((*key).to_owned(), v);
        }
    }
    let at = |key: &str| format!("destinations[{index}].{key}");
    let common: CommonDestination =
        deserialize(common).map_err(|m| ConfigError::at(format!("destinations[{index}]"), m))?;
    let label = format!("destinations[{index}] ({:?})", common.name);
    if common.name.trim().is_empty() {
        return Err(ConfigError::at(at("name"), "must not be empty"));
    }

    let Some(kind) = crate::publish::registry()
        .into_iter()
        .find(|k| k.name == common.kind)
    else {
        let known: Vec<&str> = crate::publish::registry().iter().map(|k| k.name).collect();
        return Err(ConfigError::at(
            at("type"),
            format!(
                "unknown destination type {:?}; known types: {}",
                common.kind,
                known.join(", ")
            ),
        ));
    };
    (kind.build)(&common.name, &table).map_err(|m| ConfigError::at(&label, m))?;
    let sink = SinkConfig {
        kind: common.kind.clone(),
        settings: table,
    };

    for glob in &common.topics {
        glob::Pattern::new(glob)
            .map_err(|e| ConfigError::at(at("topics"), format!("invalid glob {glob:?}: {e}")))?;
    }

    let filter = common
        .filter
        .as_deref()
        .map(crate::route::Filter::compile)
        .transpose()
        .map_err(|m| ConfigError::at(at("filter"), m))?;

    let mut retry = RetryPolicy::default();
    if let Some(schedule) = common.retry_schedule {
        if schedule.is_empty() {
            return Err(ConfigError::at(
                at("retry_schedule"),
                "must list at least one delay",
            ));
        }
        retry.schedule = schedule
            .iter()
            .map(|s| parse_duration_key(&at("retry_schedule"), s))
            .collect::<Result<_, _>>()?;
    }
    if let Some(max) = common.max_attempts {
        if max == 0 {
            return Err(ConfigError::at(at("max_attempts"), "must be at least 1"));
        }
        retry.max_attempts = Some(max);
    }
    if let Some(age) = common.max_age {
        retry.max_age = Some(parse_duration_key(&at("max_age"), &age)?);
    }

    if common.breaker.probe_interval.is_zero()
        || common.breaker.max_probe_interval < common.breaker.probe_interval
    {
        return Err(ConfigError::at(
            at("breaker"),
            "probe_interval must be more than zero and at most max_probe_interval",
        ));
    }

    Ok(DestinationConfig {
        name: common.name,
        topics: common.topics,
        filter,
        retry,
        ordering: common.ordering,
        on_dead: common.on_dead,
        breaker: common.breaker,
        sink,
    })
}

fn deserialize<T: DeserializeOwned>(table: toml::Table) -> Result<T, String> {
    T::deserialize(toml::Value::Table(table)).map_err(|e| e.message().to_owned())
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

fn parse_duration_key(key: &str, value: &str) -> Result<Duration, ConfigError> {
    humantime::parse_duration(value).map_err(|e| {
        ConfigError::at(
            key,
            format!("invalid duration {value:?} ({e}); write e.g. \"30s\", \"5m\", \"7d\""),
        )
    })
}

/// Serde helper for durations written as `"30s"`, `"5m"`, `"7d"`.
pub mod duration_str {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer};

    /// Deserializes a humantime duration string.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let s = String::deserialize(d)?;
        humantime::parse_duration(&s).map_err(|e| {
            serde::de::Error::custom(format!(
                "invalid duration {s:?} ({e}); write e.g. \"30s\", \"5m\""
            ))
        })
    }
}

/// Serde helper for optional durations.
pub mod opt_duration_str {
    use std::time::Duration;

    use serde::Deserializer;

    /// Deserializes an optional humantime duration string.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        super::duration_str::deserialize(d).map(Some)
    }
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
        assert_eq!(d.topics, vec!["order.*", "payment.*"]);
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
        let settings: Hook = sink_settings(&c.destinations[0].sink.settings).expect("webhook");
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

        let e = error_of("[[destinations]]\nname = \"x\"\ntype = \"carrier-pigeon\"\n");
        assert!(
            e.contains("destinations[0].type")
                && e.contains("carrier-pigeon")
                && e.contains("webhook"),
            "{e}"
        );

        let e = error_of("table = \"x; drop table y\"\n");
        assert!(
            e.contains("`table`") && e.contains("invalid SQL identifier"),
            "{e}"
        );

        let e = error_of(
            "[[destinations]]\nname = \"x\"\ntype = \"webhook\"\nurl = \"http://a\"\nurll = 1\n",
        );
        assert!(e.contains("destinations[0]") && e.contains("urll"), "{e}");

        let e = error_of("[[destinations]]\nname = \"x\"\ntype = \"webhook\"\nurl = \"http://a\"\nsecret = \"whsec_n0t-base64!\"\n");
        assert!(e.contains("secret") && !e.contains("n0t-base64"), "{e}");

        let e = error_of("retention = \"forever\"\n");
        assert!(e.contains("`retention`") && e.contains("forever"), "{e}");

        let e = error_of("bogus = 1\n");
        assert!(e.contains("bogus"), "{e}");
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
