//! `[[destinations]]`: where events go. The keys every destination has (routing, retry policy,
//! ordering, breaker) are parsed and checked here; the sink's own keys stay a table that the sink
//! checks when it is built.

use std::fmt;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Deserialize;

use super::duration::{duration_str, parse_duration_key};
use super::error::ConfigError;
use crate::model::breaker::BreakerPolicy;
use crate::model::rate::RateLimit;
use crate::model::retry::RetryPolicy;
use crate::model::subscription::Subscription;

/// One destination: its routing, its retry policy and its sink.
#[derive(Debug, Clone)]
pub struct DestinationConfig {
    /// Unique name, recorded on each row it handles.
    pub name: String,
    /// Which events it takes: its topic globs and filter.
    pub subscription: Subscription,
    /// A CEL expression whose value is the payload this destination is sent.
    pub transform: Option<crate::model::transform::Transform>,
    /// Most events a second this destination is sent, across every relay.
    pub rate_limit: Option<RateLimit>,
    /// How far back the retained events reach that this destination is sent when it first
    /// appears (a replay created at its first start).
    pub backfill: Option<std::time::Duration>,
    /// Retry schedule and limits.
    pub retry: RetryPolicy,
    /// Per-key ordering of this destination's events.
    pub ordering: Ordering,
    /// Ordered mode: what a dead-lettered event does to the later events of its key.
    pub on_dead: OnDead,
    /// When the destination counts as down, and how it is probed until it is back.
    pub breaker: BreakerPolicy,
    /// The sink and its own settings.
    pub sink: SinkConfig,
    /// Managed at runtime (a definition in the database), not the configuration file's: a
    /// customer's endpoint, whose failures do not make the relay unready.
    pub runtime: bool,
}

impl DestinationConfig {
    /// Whether a dead event of this destination holds back the later events of its key.
    pub fn dead_blocks(&self) -> bool {
        self.ordering == Ordering::Key && self.on_dead == OnDead::Block
    }
}

impl AsRef<Subscription> for DestinationConfig {
    fn as_ref(&self) -> &Subscription {
        &self.subscription
    }
}

// The configuration holds its destinations shared ([`super::Config::destinations`]): routing
// reads them as they are held.
impl AsRef<Subscription> for std::sync::Arc<DestinationConfig> {
    fn as_ref(&self) -> &Subscription {
        &self.subscription
    }
}

/// The `breaker` table as written: [`BreakerPolicy`] with its durations as strings.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct BreakerTable {
    failures: u32,
    #[serde(with = "duration_str")]
    probe_interval: Duration,
    #[serde(with = "duration_str")]
    max_probe_interval: Duration,
}

impl Default for BreakerTable {
    fn default() -> Self {
        let d = BreakerPolicy::default();
        Self {
            failures: d.failures,
            probe_interval: d.probe_interval,
            max_probe_interval: d.max_probe_interval,
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
/// The settings are checked when the sink is built (`sinks::build_all`, before the relay connects
/// to the database), so a typo is reported before the relay starts.
#[derive(Clone)]
pub struct SinkConfig {
    /// The `type` key: a name from the sink registry.
    pub kind: String,
    /// The sink's own keys.
    pub settings: Settings,
}

/// A sink's own keys, as the configuration gave them. Kept as a boxed slice, not a map: a relay
/// holds one per destination for its whole life and reads it only to build the sink, and a map of
/// two keys costs six times the memory (one tree node of eleven slots).
#[derive(Clone, Default, PartialEq)]
pub struct Settings(Box<[(Box<str>, toml::Value)]>);

impl Settings {
    /// The value of `key`, if set.
    pub fn get(&self, key: &str) -> Option<&toml::Value> {
        self.0.iter().find(|(k, _)| &**k == key).map(|(_, v)| v)
    }

    /// The keys set, in order.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.0.iter().map(|(k, _)| &**k)
    }

    /// The settings as a table, to deserialize or show.
    pub fn to_table(&self) -> toml::Table {
        self.0
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect()
    }
}

impl From<toml::Table> for Settings {
    fn from(table: toml::Table) -> Self {
        Self(
            table
                .into_iter()
                .map(|(k, v)| (k.into_boxed_str(), v))
                .collect(),
        )
    }
}

impl SinkConfig {
    /// A sink with no settings of its own (`stdout`, `null`).
    pub fn bare(kind: &str) -> Self {
        Self {
            kind: kind.to_owned(),
            settings: Settings::default(),
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

/// `rate_limit = "200/s"` or `rate_limit = { rate = "200/s", burst = 400 }`; the error is one
/// sentence.
fn rate_limit(value: toml::Value) -> Result<RateLimit, String> {
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Table {
        rate: String,
        burst: Option<u32>,
    }
    match value {
        toml::Value::String(rate) => RateLimit::parse(&rate, None),
        toml::Value::Table(table) => {
            let t: Table = deserialize(table)?;
            RateLimit::parse(&t.rate, t.burst)
        }
        other => Err(format!(
            "expected \"200/s\" or {{ rate = \"200/s\", burst = 400 }}, found {}",
            other.type_str()
        )),
    }
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
    transform: Option<String>,
    rate_limit: Option<toml::Value>,
    backfill: Option<String>,
    retry_schedule: Option<Vec<String>>,
    max_attempts: Option<u32>,
    max_age: Option<String>,
    #[serde(default)]
    ordering: Ordering,
    #[serde(default)]
    on_dead: OnDead,
    #[serde(default)]
    breaker: BreakerTable,
}

const COMMON_KEYS: &[&str] = &[
    "name",
    "type",
    "topics",
    "filter",
    "transform",
    "rate_limit",
    "backfill",
    "retry_schedule",
    "max_attempts",
    "max_age",
    "ordering",
    "on_dead",
    "breaker",
];

pub(crate) fn parse_destination(
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
    if common.name.trim().is_empty() {
        return Err(ConfigError::at(at("name"), "must not be empty"));
    }
    // The sink's own keys stay a table: the sink checks them when it is built
    // (`crate::sinks::build_all`), so that configuration stays plain data.
    let sink = SinkConfig {
        kind: common.kind.clone(),
        settings: table.into(),
    };

    for glob in &common.topics {
        crate::model::subscription::topic_glob(glob)
            .map_err(|e| ConfigError::at(at("topics"), format!("invalid glob {glob:?}: {e}")))?;
    }

    let filter = common
        .filter
        .as_deref()
        .map(crate::model::filter::Filter::compile)
        .transpose()
        .map_err(|m| ConfigError::at(at("filter"), m))?;

    let transform = common
        .transform
        .as_deref()
        .map(crate::model::transform::Transform::compile)
        .transpose()
        .map_err(|m| ConfigError::at(at("transform"), m))?;

    let rate_limit = common
        .rate_limit
        .map(rate_limit)
        .transpose()
        .map_err(|m| ConfigError::at(at("rate_limit"), m))?;

    let backfill = common
        .backfill
        .map(|b| parse_duration_key(&at("backfill"), &b))
        .transpose()?;

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
        subscription: Subscription {
            topics: common.topics,
            filter,
        },
        transform,
        rate_limit,
        backfill,
        retry,
        ordering: common.ordering,
        on_dead: common.on_dead,
        breaker: BreakerPolicy {
            failures: common.breaker.failures,
            probe_interval: common.breaker.probe_interval,
            max_probe_interval: common.breaker.max_probe_interval,
        },
        sink,
        runtime: false,
    })
}

/// Deserializes a table, keeping serde's message.
pub(crate) fn deserialize<T: DeserializeOwned>(table: toml::Table) -> Result<T, String> {
    T::deserialize(toml::Value::Table(table)).map_err(|e| e.message().to_owned())
}
