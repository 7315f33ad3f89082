//! The [`Catalog`]: how the command line and the console change the destinations managed at
//! runtime. Each change checks the whole definition as the file's are checked, seals its secrets,
//! and writes the row, the version, the notification and the audit log's line together.

use std::collections::HashSet;

use serde_json::Value;

use super::{check, split, whole, DefinitionError, Key, Object, Shown};
use crate::store::definitions::{self as stored, Applied, StoredDefinition, Written};
use crate::store::operators::Change;
use crate::store::Store;

/// Who makes a change, and through what: what the audit log records.
#[derive(Debug, Clone, Copy)]
pub struct Actor<'a> {
    /// A console token's name, or `user@host` for the command line.
    pub who: &'a str,
    /// `console` or `cli`.
    pub via: &'a str,
}

/// The destinations managed at runtime of one outbox, as a command or the console changes them.
#[derive(Debug, Clone)]
pub struct Catalog {
    store: Store,
    key: Option<Key>,
    file_names: HashSet<String>,
}

impl Catalog {
    /// The catalog of `store`'s outbox; `key` seals and opens secrets; `file_names` are the
    /// configuration file's destinations, which no runtime change may take.
    pub fn new(store: Store, key: Option<Key>, file_names: HashSet<String>) -> Self {
        Self {
            store,
            key,
            file_names,
        }
    }

    /// The configuration file's destinations' names.
    pub fn file_names(&self) -> impl Iterator<Item = &str> {
        let mut names: Vec<&str> = self.file_names.iter().map(String::as_str).collect();
        names.sort_unstable();
        names.into_iter()
    }

    /// Adds a destination; the version it moved to.
    pub async fn add(&self, definition: Object, by: Actor<'_>) -> Result<i64, DefinitionError> {
        let config = check(&definition)?;
        self.not_in_file(&config.name)?;
        let change = Change {
            who: by.who,
            via: by.via,
            action: "destination.add",
            filter: change_filter(&config.name, &definition),
            matched: 0,
        };
        match self.write(&config.name, definition, false, &change).await? {
            Applied::Done(version) => Ok(version),
            _ => Err(DefinitionError::Exists(config.name)),
        }
    }

    /// Changes a destination: `patch` is merged into its definition (RFC 7396: a key set to null
    /// is removed; sealed keys not given are kept); the version it moved to.
    pub async fn update(
        &self,
        name: &str,
        patch: &Value,
        by: Actor<'_>,
    ) -> Result<i64, DefinitionError> {
        self.not_in_file(name)?;
        let stored = stored::get(&self.store, name)
            .await?
            .ok_or_else(|| DefinitionError::NoSuch(name.to_owned()))?;
        if let Some(given) = patch.get("name") {
            if given.as_str() != Some(name) {
                return Err(DefinitionError::invalid(
                    "name",
                    "cannot be changed: add a destination of the new name and remove this one",
                ));
            }
        }
        let mut whole = Value::Object(self.whole(&stored)?);
        json_patch::merge(&mut whole, patch);
        let Value::Object(definition) = whole else {
            return Err(DefinitionError::invalid(
                "definition",
                "must be a JSON object",
            ));
        };
        check(&definition)?;
        let change = Change {
            who: by.who,
            via: by.via,
            action: "destination.update",
            filter: change_filter(name, patch.as_object().unwrap_or(&Object::new())),
            matched: 0,
        };
        match self.write(name, definition, true, &change).await? {
            Applied::Done(version) => Ok(version),
            _ => Err(DefinitionError::NoSuch(name.to_owned())),
        }
    }

    /// Removes a destination, refused while it has undelivered events unless `drop_events`; the
    /// version it moved to.
    pub async fn remove(
        &self,
        name: &str,
        drop_events: bool,
        by: Actor<'_>,
    ) -> Result<i64, DefinitionError> {
        self.not_in_file(name)?;
        let change = Change {
            who: by.who,
            via: by.via,
            action: "destination.remove",
            filter: serde_json::json!({ "destination": name }),
            matched: 0,
        };
        match stored::remove(&self.store, name, drop_events, &change).await? {
            Applied::Done(version) => Ok(version),
            Applied::NoSuchName => Err(DefinitionError::NoSuch(name.to_owned())),
            Applied::Undelivered(count) => Err(DefinitionError::Undelivered {
                name: name.to_owned(),
                count,
            }),
        }
    }

    /// One destination as shown, with no secret.
    pub async fn show(&self, name: &str) -> Result<Shown, DefinitionError> {
        stored::get(&self.store, name)
            .await?
            .map(Shown::from)
            .ok_or_else(|| DefinitionError::NoSuch(name.to_owned()))
    }

    /// A page of destinations as shown.
    pub async fn page(&self, page: &stored::Page<'_>) -> Result<Vec<Shown>, DefinitionError> {
        Ok(stored::page(&self.store, page)
            .await?
            .into_iter()
            .map(Shown::from)
            .collect())
    }

    /// The events routed to `name` and not yet delivered.
    pub async fn undelivered(&self, name: &str) -> Result<i64, DefinitionError> {
        Ok(stored::undelivered(&self.store, name).await?)
    }

    fn not_in_file(&self, name: &str) -> Result<(), DefinitionError> {
        if self.file_names.contains(name) {
            return Err(DefinitionError::InFile(name.to_owned()));
        }
        Ok(())
    }

    /// The stored definition whole: its clear part with its secrets opened over it.
    fn whole(&self, stored: &StoredDefinition) -> Result<Object, DefinitionError> {
        whole(&self.store, self.key.as_ref(), stored)
    }

    async fn write(
        &self,
        name: &str,
        definition: Object,
        update: bool,
        change: &Change<'_>,
    ) -> Result<Applied, DefinitionError> {
        let (clear, secrets) = split(definition);
        let sealed = match (secrets.is_empty(), &self.key) {
            (true, _) => None,
            (false, Some(key)) => {
                Some(key.seal(&self.store.table().to_string(), name, &secrets)?)
            }
            (false, None) => return Err(DefinitionError::NoKey),
        };
        let secret_keys: Vec<String> = secrets.keys().cloned().collect();
        let clear = Value::Object(clear);
        let written = Written {
            name,
            definition: &clear,
            secrets: sealed.as_deref(),
            secret_keys: &secret_keys,
        };
        Ok(stored::write(&self.store, written, update, change).await?)
    }
}

/// What the audit log records of a change: the destination and the keys given, never a value
/// (a secret may be among them).
fn change_filter(name: &str, given: &Object) -> Value {
    let keys: Vec<&str> = given.keys().map(String::as_str).collect();
    serde_json::json!({ "destination": name, "keys": keys })
}
