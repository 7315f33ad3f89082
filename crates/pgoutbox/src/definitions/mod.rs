//! Destinations managed at runtime: a definition is a `[[destinations]]` table as JSON, stored in
//! `<table>_definitions`, checked by the very code that checks the configuration file
//! ([`crate::config`]'s destination parser and the sink registry's builders), with its secret keys
//! sealed ([`sealed`]). The command line and the console's API both change them through the
//! [`Catalog`]; a relay loads them beside its file's ([`load`]) and, when told of a change,
//! reads again only the definitions that changed ([`reload`]).
//!
//! What decides is plain functions over JSON ([`split`], [`check_name`], [`check`]); the
//! catalog's methods only read, decide, seal and write.

mod catalog;
pub mod sealed;

pub use catalog::{Actor, Catalog};

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use serde::Serialize;
use serde_json::{Map, Value};

use crate::config::{Config, DestinationConfig};
use crate::model::secrets::redact_url;
use crate::sinks::Sink;
use crate::store::definitions::{self as stored, StoredDefinition};
use crate::store::Store;
pub use sealed::{Key, KEY_VAR};

/// A definition as JSON: the keys of a `[[destinations]]` table.
pub type Object = Map<String, Value>;

/// Why a definition or a change to one was refused.
#[derive(Debug, thiserror::Error)]
pub enum DefinitionError {
    /// A field of the definition is wrong; nothing was stored.
    #[error("{field}: {message}")]
    Invalid {
        /// The field, as the definition names it (`filter`, `url`, `retry_schedule`).
        field: String,
        /// What is wrong with it.
        message: String,
    },
    /// Adding: the name is taken.
    #[error("a destination named {0:?} exists already")]
    Exists(String),
    /// The name is the configuration file's: it is changed there, not at runtime.
    #[error("destination {0:?} is defined in the configuration file: change it there (and send the relays SIGHUP)")]
    InFile(String),
    /// A name is both the file's and managed at runtime (a relay starting finds it).
    #[error("destination {0:?} is both in the configuration file and added at runtime: keep one (edit the file, or `pgoutbox destinations remove {0}`)")]
    Both(String),
    /// No destination of that name is managed at runtime.
    #[error("no destination named {0:?} is managed at runtime")]
    NoSuch(String),
    /// Removing a destination that still has events to deliver.
    #[error("destination {name:?} still has {count} undelivered events: nothing was removed; remove it with drop_events (`--drop-events`) to drop them")]
    Undelivered {
        /// The destination.
        name: String,
        /// How many events it has not delivered.
        count: i64,
    },
    /// Secrets are to be sealed or opened and no key is set.
    #[error("{KEY_VAR} is not set: destinations with secrets need the key they are sealed with (`pgoutbox destinations key` makes one; give every relay the same)")]
    NoKey,
    /// The key is not 32 bytes in base64.
    #[error("{KEY_VAR} is not a key: it must be 32 bytes in base64 (`pgoutbox destinations key` makes one)")]
    BadKey,
    /// The sealed secrets do not open with this key (another key, or a copied row).
    #[error("the secrets of destination {0:?} do not open with this {KEY_VAR}: give the relays the key they were sealed with")]
    WrongKey(String),
    /// The secrets could not be sealed.
    #[error("cannot seal the destination's secrets")]
    Unsealable,
    /// The database failed.
    #[error(transparent)]
    Store(#[from] crate::error::Error),
}

impl DefinitionError {
    fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self::Invalid {
            field: field.into(),
            message: message.into(),
        }
    }
}

/// Keys whose values are secrets wherever they appear at the top of a definition: sealed, never
/// shown. A `url` is sealed too when it carries a credential (see [`split`]).
pub const SEALED_KEYS: &[&str] = &[
    "secret",
    "headers",
    "nkey_seed",
    "properties",
    "password",
    "sasl_password",
    "token",
    "secret_access_key",
    "session_token",
];

/// The longest name a destination managed at runtime may have.
const MAX_NAME_LEN: usize = 128;

/// A name managed at runtime: 1 to 128 ASCII letters, digits, `.`, `_`, `-` or `:`, starting with
/// a letter or digit. It is a metric label, a log field and a URL segment: nothing else gets in.
pub fn check_name(name: &str) -> Result<(), DefinitionError> {
    let ok_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | ':');
    let first_ok = name
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphanumeric());
    if name.is_empty() || name.len() > MAX_NAME_LEN || !first_ok || !name.chars().all(ok_char) {
        return Err(DefinitionError::invalid(
            "name",
            format!("must be 1 to {MAX_NAME_LEN} ASCII letters, digits, '.', '_', '-' or ':', starting with a letter or digit"),
        ));
    }
    Ok(())
}

/// `definition` split into what is stored in the clear and what is sealed: the [`SEALED_KEYS`],
/// and a `url` that carries a credential (user info, a query, a fragment), whose redacted form
/// stays in the clear to be shown.
pub fn split(mut definition: Object) -> (Object, Object) {
    let mut sealed = Object::new();
    for key in SEALED_KEYS {
        if let Some(v) = definition.remove(*key) {
            sealed.insert((*key).to_owned(), v);
        }
    }
    if let Some(Value::String(url)) = definition.get("url") {
        let redacted = redact_url(url);
        if &redacted != url {
            sealed.insert("url".into(), Value::String(url.clone()));
            definition.insert("url".into(), Value::String(redacted));
        }
    }
    (definition, sealed)
}

/// The whole definition again: the clear part with the sealed keys over it.
pub fn join(mut clear: Object, sealed: Object) -> Object {
    clear.extend(sealed);
    clear
}

/// Checks `definition` as the configuration file's destinations are checked: its name, its keys
/// (routing, retry, ordering, breaker), its sink's settings (the sink is built, with no I/O); and
/// refuses a secret read from the relay's environment or files (`{ env }`, `{ file }`), which a
/// definition written through the API must never reach.
pub fn check(definition: &Object) -> Result<DestinationConfig, DefinitionError> {
    checked(definition).map(|(config, _)| config)
}

/// [`check`], with the sink it built.
fn checked(definition: &Object) -> Result<(DestinationConfig, Arc<dyn Sink>), DefinitionError> {
    let name = match definition.get("name") {
        Some(Value::String(name)) => name.clone(),
        Some(_) => return Err(DefinitionError::invalid("name", "must be a string")),
        None => return Err(DefinitionError::invalid("name", "is required")),
    };
    check_name(&name)?;
    if !definition.contains_key("type") {
        return Err(DefinitionError::invalid("type", "is required"));
    }
    for (key, value) in definition {
        refuse_references(key, value)?;
    }
    let table = match toml::Value::try_from(Value::Object(definition.clone())) {
        Ok(toml::Value::Table(table)) => table,
        _ => {
            let field = definition
                .iter()
                .find(|(_, v)| has_null(v))
                .map_or("definition", |(k, _)| k.as_str());
            return Err(DefinitionError::invalid(
                field,
                "null is not a value here: leave the key out",
            ));
        }
    };
    let mut config = crate::config::destination::parse_destination(0, table).map_err(|e| {
        let field = e.key.as_deref().unwrap_or("definition");
        let field = field
            .strip_prefix("destinations[0].")
            .or_else(|| field.strip_prefix("destinations[0]"))
            .filter(|f| !f.is_empty())
            .unwrap_or("definition");
        DefinitionError::invalid(field, e.message)
    })?;
    config.runtime = true;
    let sink = crate::sinks::build(&config).map_err(|e| {
        if e.key.as_deref() == Some("type") {
            return DefinitionError::invalid("type", e.message);
        }
        let (field, message) = setting_named(&e.message);
        DefinitionError::invalid(field, message)
    })?;
    Ok((config, sink))
}

/// The setting a sink's error names (``key `url`: ...``, ``missing field `url` ``, ``unknown
/// field `x` ``) and what it says; `settings` when it names none.
fn setting_named(message: &str) -> (String, String) {
    if let Some(rest) = message.strip_prefix("key `") {
        if let Some((key, said)) = rest.split_once("`: ") {
            return (key.to_owned(), said.to_owned());
        }
    }
    for marker in ["missing field `", "unknown field `"] {
        if let Some((_, rest)) = message.split_once(marker) {
            if let Some((field, _)) = rest.split_once('`') {
                return (field.to_owned(), message.to_owned());
            }
        }
    }
    ("settings".to_owned(), message.to_owned())
}

/// Whether `value` holds a null anywhere.
fn has_null(value: &Value) -> bool {
    match value {
        Value::Null => true,
        Value::Array(a) => a.iter().any(has_null),
        Value::Object(o) => o.values().any(has_null),
        _ => false,
    }
}

/// Refuses `{ env = ... }` and `{ file = ... }` anywhere under `key`.
fn refuse_references(key: &str, value: &Value) -> Result<(), DefinitionError> {
    match value {
        Value::Object(o) => {
            if !o.is_empty() && o.keys().all(|k| k == "env" || k == "file") {
                return Err(DefinitionError::invalid(
                    key,
                    "a destination managed at runtime takes a secret's value, not `{ env }` or `{ file }` (those read the relay's own environment and files)",
                ));
            }
            o.values().try_for_each(|v| refuse_references(key, v))
        }
        Value::Array(a) => a.iter().try_for_each(|v| refuse_references(key, v)),
        _ => Ok(()),
    }
}

/// A definition as shown: never its secrets, only which keys are sealed.
#[derive(Debug, Clone, Serialize)]
pub struct Shown {
    /// The destination's name.
    pub name: String,
    /// Its definition without its secrets (a URL with a credential is redacted).
    pub definition: Value,
    /// The keys whose values are sealed.
    pub secrets: Vec<String>,
    /// When it was added.
    pub created_at: chrono::DateTime<chrono::Utc>,
    /// When it was last changed.
    pub updated_at: chrono::DateTime<chrono::Utc>,
}

impl From<StoredDefinition> for Shown {
    fn from(d: StoredDefinition) -> Self {
        Self {
            definition: serde_json::from_str(&d.definition).unwrap_or(Value::Null),
            name: d.name,
            secrets: d.secret_keys,
            created_at: d.created_at,
            updated_at: d.updated_at,
        }
    }
}

/// `stored` whole: its clear part with its secrets opened over it (with `key`).
fn whole(
    store: &Store,
    key: Option<&Key>,
    stored: &StoredDefinition,
) -> Result<Object, DefinitionError> {
    let clear: Object = serde_json::from_str(&stored.definition).map_err(|_| {
        DefinitionError::invalid("definition", "the stored definition is not a JSON object")
    })?;
    let secrets = match (&stored.secrets, key) {
        (None, _) => Object::new(),
        (Some(sealed), Some(key)) => key.open(&store.table().to_string(), &stored.name, sealed)?,
        (Some(_), None) => return Err(DefinitionError::NoKey),
    };
    Ok(join(clear, secrets))
}

/// Every destination managed at runtime, checked as the configuration's are, and the version they
/// were read at (read before them: a change committed meanwhile is applied again, never missed).
/// A definition that no longer passes the checks (an older relay wrote it) is an error naming it:
/// a relay that skipped it would not deliver its events.
pub async fn load(store: &Store, key: Option<&Key>) -> Result<Loaded, DefinitionError> {
    reload(store, key, &Loaded::default()).await
}

/// [`load`] again after `previous`: only the definitions whose row changed since (by their stamps)
/// are read and checked again; the others are `previous`' own (the same `Arc`, which tells the
/// relay it knows them), and one removed is left out. A change to one of 100,000 definitions
/// costs a read of their names and stamps and the check of one.
pub async fn reload(
    store: &Store,
    key: Option<&Key>,
    previous: &Loaded,
) -> Result<Loaded, DefinitionError> {
    let mut loaded = Loaded {
        version: stored::version(store).await?,
        ..Loaded::default()
    };
    if previous.destinations.is_empty() {
        for definition in stored::all(store).await? {
            let checked = checked_stored(store, key, &definition)?;
            loaded.push(Arc::new(checked), definition.stamp);
        }
        return Ok(loaded);
    }
    let known: HashMap<&str, (i64, &Arc<DestinationConfig>)> = previous
        .destinations
        .iter()
        .zip(&previous.stamps)
        .map(|(d, &stamp)| (d.name.as_str(), (stamp, d)))
        .collect();
    let stamps = stored::stamps(store).await?;
    let changed: Vec<String> = stamps
        .iter()
        .filter(|(name, stamp)| known.get(name.as_str()).map(|k| k.0) != Some(*stamp))
        .map(|(name, _)| name.clone())
        .collect();
    let mut fresh = HashMap::new();
    if !changed.is_empty() {
        for definition in stored::named(store, &changed).await? {
            let checked = checked_stored(store, key, &definition)?;
            fresh.insert(definition.name, (definition.stamp, Arc::new(checked)));
        }
    }
    for (name, stamp) in stamps {
        if let Some((stamp, checked)) = fresh.remove(&name) {
            loaded.push(checked, stamp);
        } else if let Some(&(_, same)) = known.get(name.as_str()).filter(|k| k.0 == stamp) {
            loaded.push(Arc::clone(same), stamp);
        }
        // Otherwise it was removed after its stamp was read: the version moved past the one
        // read, so the relay loads again.
    }
    Ok(loaded)
}

/// `definition` as stored, opened with `key` and checked; an error names it.
fn checked_stored(
    store: &Store,
    key: Option<&Key>,
    definition: &StoredDefinition,
) -> Result<DestinationConfig, DefinitionError> {
    check(&whole(store, key, definition)?).map_err(|e| match e {
        DefinitionError::Invalid { field, message } => DefinitionError::Invalid {
            field: format!("destination {:?}: {field}", definition.name),
            message,
        },
        other => other,
    })
}

/// What [`load`] read: the version, and each destination, checked (its sink was built and
/// dropped: the relay builds it again when the destination has work).
#[derive(Default)]
pub struct Loaded {
    /// The version of the definitions read.
    pub version: i64,
    /// Each destination, by name.
    pub destinations: Vec<Arc<DestinationConfig>>,
    /// Each destination's stamp, in the same order: what [`reload`] compares.
    stamps: Vec<i64>,
}

impl Loaded {
    fn push(&mut self, destination: Arc<DestinationConfig>, stamp: i64) {
        self.destinations.push(destination);
        self.stamps.push(stamp);
    }

    /// Adds these destinations after `config`'s own (a name that is the file's too is an error).
    pub fn add_to(&self, config: &mut Config) -> Result<(), DefinitionError> {
        let file: HashSet<&str> = config
            .destinations
            .iter()
            .map(|d| d.name.as_str())
            .collect();
        if let Some(both) = self
            .destinations
            .iter()
            .find(|d| file.contains(d.name.as_str()))
        {
            return Err(DefinitionError::Both(both.name.clone()));
        }
        config
            .destinations
            .extend(self.destinations.iter().cloned());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn object(v: Value) -> Object {
        v.as_object().expect("an object").clone()
    }

    #[test]
    fn secrets_are_split_off_and_a_url_with_a_credential_is_shown_redacted() {
        let (clear, sealed) = split(object(json!({
            "name": "a", "type": "webhook", "url": "https://h/x?token=abcdefgh",
            "secret": "whsec_x", "headers": { "Authorization": "Bearer y" }, "topics": ["t"]
        })));
        assert_eq!(
            clear,
            object(
                json!({ "name": "a", "type": "webhook", "url": "https://h/x?token=***", "topics": ["t"] })
            )
        );
        assert_eq!(
            sealed.keys().collect::<Vec<_>>(),
            ["headers", "secret", "url"]
        );
        assert_eq!(join(clear, sealed)["url"], "https://h/x?token=abcdefgh");
        let (clear, sealed) = split(object(json!({ "url": "https://h/x" })));
        assert!(sealed.is_empty());
        assert_eq!(clear["url"], "https://h/x");
    }

    #[test]
    fn a_definition_is_checked_as_the_file_is_naming_the_field() {
        // (definition, the field the error names)
        let cases = [
            (json!({ "type": "null" }), "name"),
            (json!({ "name": "a b", "type": "null" }), "name"),
            (json!({ "name": "", "type": "null" }), "name"),
            (json!({ "name": "a\u{7}", "type": "null" }), "name"),
            (json!({ "name": "a" }), "type"),
            (json!({ "name": "a", "type": "carrier-pigeon" }), "type"),
            (
                json!({ "name": "a", "type": "null", "filter": "payload.x >" }),
                "filter",
            ),
            (
                json!({ "name": "a", "type": "null", "topics": ["[x"] }),
                "topics",
            ),
            (
                json!({ "name": "a", "type": "null", "max_attempts": 0 }),
                "max_attempts",
            ),
            (
                json!({ "name": "a", "type": "null", "rate_limit": "fast" }),
                "rate_limit",
            ),
            (json!({ "name": "a", "type": "webhook" }), "url"),
            (
                json!({ "name": "a", "type": "webhook", "url": "ftp://x/" }),
                "url",
            ),
            (
                json!({ "name": "a", "type": "webhook", "url": "http://x/", "bogus": 1 }),
                "bogus",
            ),
            (
                json!({ "name": "a", "type": "webhook", "url": "http://x/", "secret": { "env": "HOME" } }),
                "secret",
            ),
            (
                json!({ "name": "a", "type": "webhook", "url": "http://x/", "headers": { "A": { "file": "/etc/passwd" } } }),
                "headers",
            ),
            (
                json!({ "name": "a", "type": "null", "max_age": null }),
                "max_age",
            ),
        ];
        for (definition, field) in cases {
            match check(&object(definition.clone())) {
                Err(DefinitionError::Invalid { field: f, .. }) => {
                    assert_eq!(f, field, "{definition}")
                }
                other => panic!("{definition}: {other:?}"),
            }
        }
        let ok = check(&object(json!({
            "name": "customer-1.hooks", "type": "webhook", "url": "http://127.0.0.1:9/x",
            "topics": ["orders.*"], "filter": "payload.total > 10", "max_attempts": 3
        })))
        .expect("valid");
        assert_eq!(ok.name, "customer-1.hooks");
        assert_eq!(ok.subscription.topics, ["orders.*"]);
    }
}
