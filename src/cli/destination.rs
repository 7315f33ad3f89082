//! `pgoutbox destinations`: destinations managed at runtime (add, update, show, list, remove),
//! checked as the configuration file's are and applied by every running relay within a second;
//! an operator's pause and resume, obeyed by every relay; and the key their secrets are sealed
//! with. `pgoutbox destination` is the same command.

use std::collections::HashSet;
use std::process::ExitCode;

use anyhow::{bail, Context as _};
use pgoutbox::config::Config;
use pgoutbox::definitions::{Actor, Catalog, Key, Object};
use pgoutbox::store::definitions::Page;
use serde_json::Value;

use super::{human_age, Cli};

/// `destinations` subcommands.
#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Add a destination; every running relay sends it events within a second.
    Add(Definition),
    /// Change a destination added at runtime: the keys given replace theirs, the rest stay.
    Update(Definition),
    /// One destination: its definition (never its secrets), state and undelivered events.
    Show(NameArg),
    /// Every destination, the configuration file's then those added at runtime, by name.
    List(ListArgs),
    /// Remove a destination added at runtime: refused while it has undelivered events.
    Remove(RemoveArgs),
    /// Hold a destination's events (no attempts counted) until `resume`, in every relay.
    Pause(NameArg),
    /// Let a paused destination's events flow again; its held events are due at once.
    Resume(NameArg),
    /// Print a new key to seal secrets with: set it as PGOUTBOX_SECRETS_KEY for every relay
    /// and command.
    Key,
}

/// A destination's name.
#[derive(Debug, clap::Args)]
pub struct NameArg {
    /// The destination's name.
    name: String,
}

/// A definition, or a change to one, from flags and an optional file.
#[derive(Debug, clap::Args)]
pub struct Definition {
    /// The destination's name.
    name: String,
    /// Its `type`: webhook, nats, rabbitmq, kafka, redis, mqtt, sqs, sns, kinesis, eventbridge,
    /// s3, stdout, null.
    #[arg(long = "type", value_name = "TYPE")]
    kind: Option<String>,
    /// A topic glob it takes (repeat for more; none: every topic).
    #[arg(long = "topic", value_name = "GLOB")]
    topics: Vec<String>,
    /// A CEL filter over the event (`payload.total > 100`).
    #[arg(long)]
    filter: Option<String>,
    /// Any key of a `[[destinations]]` table, `KEY=VALUE`; the value is read as TOML when it is
    /// one (`5`, `true`, `["a"]`, `{ a = 1 }`), else as a string; `a.b=1` sets a nested key.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// A key to remove (update only).
    #[arg(long = "unset", value_name = "KEY")]
    unset: Vec<String>,
    /// A secret key (`secret=whsec_...`, `headers.Authorization=Bearer ...`): sealed with
    /// PGOUTBOX_SECRETS_KEY, never shown again.
    #[arg(long = "secret", value_name = "KEY=VALUE")]
    secrets: Vec<String>,
    /// A secret key whose value is read from this command's environment (`secret=HOOK_SECRET`):
    /// it stays out of the shell's history.
    #[arg(long = "secret-env", value_name = "KEY=VAR")]
    secret_env: Vec<String>,
    /// A file holding the definition: a JSON object, or a TOML table as in `[[destinations]]`;
    /// the flags apply over it.
    #[arg(long, value_name = "PATH")]
    file: Option<std::path::PathBuf>,
}

/// `list` options.
#[derive(Debug, clap::Args)]
pub struct ListArgs {
    /// Only destinations whose name or definition contain this text (any case).
    #[arg(long)]
    search: Option<String>,
    /// The page after this name (the last of the page before).
    #[arg(long, value_name = "NAME")]
    after: Option<String>,
    /// At most this many destinations added at runtime per page.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(i64).range(1..=10_000))]
    limit: i64,
}

/// `remove` options.
#[derive(Debug, clap::Args)]
pub struct RemoveArgs {
    /// The destination's name.
    name: String,
    /// Remove it even with undelivered events, and drop them (the audit log records how many).
    #[arg(long)]
    drop_events: bool,
}

pub async fn run(cli: &Cli, command: &Command) -> anyhow::Result<ExitCode> {
    if let Command::Key = command {
        println!("{}", Key::generate());
        eprintln!("set it as PGOUTBOX_SECRETS_KEY for every relay and every `pgoutbox destinations` command; keep it safe: without it, sealed secrets cannot be read");
        return Ok(ExitCode::SUCCESS);
    }
    let config = cli.load_config()?;
    let pool = super::connect_checked(&config, 1).await?;
    let store = pgoutbox::store::Store::new(pool.clone(), config.table.clone());
    let file_names: HashSet<String> = config.destinations.iter().map(|d| d.name.clone()).collect();
    let catalog = Catalog::new(store.clone(), Key::from_env()?, file_names);
    let who = super::audit::operator();
    let by = Actor {
        who: &who,
        via: "cli",
    };
    match command {
        Command::Add(def) => {
            let mut definition = def.base()?;
            definition.insert("name".into(), def.name.clone().into());
            def.apply(&mut definition)?;
            let version = catalog.add(definition, by).await?;
            eprintln!("destination {} added (version {version}): every running relay sends it events within a second", def.name);
        }
        Command::Update(def) => {
            let mut patch = def.base()?;
            def.apply(&mut patch)?;
            if patch.is_empty() {
                bail!("nothing to change: give --set, --unset, --secret, --topic, --filter, --type or --file");
            }
            let version = catalog.update(&def.name, &Value::Object(patch), by).await?;
            eprintln!("destination {} updated (version {version}): every running relay applies it within a second", def.name);
        }
        Command::Show(NameArg { name }) => show(&config, &catalog, &store, name).await?,
        Command::List(args) => list(&config, &catalog, &store, args).await?,
        Command::Remove(args) => {
            let version = catalog.remove(&args.name, args.drop_events, by).await?;
            eprintln!(
                "destination {} removed (version {version}): every running relay stops sending it events within a second",
                args.name
            );
        }
        Command::Pause(NameArg { name }) => {
            known(&config, &catalog, name).await?;
            pgoutbox::store::destinations::pause(&store, name).await?;
            let filter = serde_json::json!({ "destination": name });
            super::audit::record(&store, "pause", filter, 0).await?;
            eprintln!("destination {name} paused: every relay holds its events from now on (within about a second); `pgoutbox destinations resume {name}` lets them flow again");
        }
        Command::Resume(NameArg { name }) => {
            known(&config, &catalog, name).await?;
            let released = pgoutbox::store::destinations::resume(&store, name).await?;
            let filter = serde_json::json!({ "destination": name });
            super::audit::record(&store, "resume", filter, released.unwrap_or(0)).await?;
            match released {
                Some(released) => {
                    eprintln!("destination {name} resumed: {released} held events are due again")
                }
                None => eprintln!("destination {name} was not paused"),
            }
        }
        Command::Key => unreachable!("handled above"),
    }
    Ok(ExitCode::SUCCESS)
}

/// Refuses a name that is neither the file's nor added at runtime (with no file and nothing
/// added, any name is taken as given: the state row is kept for it).
async fn known(config: &Config, catalog: &Catalog, name: &str) -> anyhow::Result<()> {
    if config.destinations.iter().any(|d| d.name == name) || catalog.show(name).await.is_ok() {
        return Ok(());
    }
    if config.destinations.is_empty() {
        return Ok(());
    }
    Err(super::no_such_destination(config, name))
}

impl Definition {
    /// The file's definition, or an empty one.
    fn base(&self) -> anyhow::Result<Object> {
        let Some(path) = &self.file else {
            return Ok(Object::new());
        };
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        if let Ok(Value::Object(o)) = serde_json::from_str::<Value>(&text) {
            return Ok(o);
        }
        let table: toml::Table = toml::from_str(&text).with_context(|| {
            format!(
                "{} is neither a JSON object nor a TOML table",
                path.display()
            )
        })?;
        match serde_json::to_value(table)? {
            Value::Object(o) => Ok(o),
            _ => bail!("{} does not hold a table", path.display()),
        }
    }

    /// The flags, applied over `definition`.
    fn apply(&self, definition: &mut Object) -> anyhow::Result<()> {
        if let Some(kind) = &self.kind {
            definition.insert("type".into(), kind.clone().into());
        }
        if !self.topics.is_empty() {
            definition.insert("topics".into(), self.topics.clone().into());
        }
        if let Some(filter) = &self.filter {
            definition.insert("filter".into(), filter.clone().into());
        }
        for pair in &self.set {
            let (key, value) = key_value(pair, "--set")?;
            put(definition, key, toml_or_string(value))?;
        }
        for pair in &self.secrets {
            let (key, value) = key_value(pair, "--secret")?;
            put(definition, key, Value::String(value.to_owned()))?;
        }
        for pair in &self.secret_env {
            let (key, var) = key_value(pair, "--secret-env")?;
            let value = std::env::var(var)
                .with_context(|| format!("--secret-env {key}={var}: {var} is not set"))?;
            put(definition, key, Value::String(value))?;
        }
        for key in &self.unset {
            put(definition, key, Value::Null)?;
        }
        Ok(())
    }
}

/// `KEY=VALUE` split at its first `=`.
fn key_value<'a>(pair: &'a str, flag: &str) -> anyhow::Result<(&'a str, &'a str)> {
    match pair.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k, v)),
        _ => bail!("{flag} {pair:?}: expected KEY=VALUE"),
    }
}

/// A flag's value as TOML when it is one (`5`, `true`, `["a"]`), else the text.
fn toml_or_string(text: &str) -> Value {
    #[derive(serde::Deserialize)]
    struct One {
        v: toml::Value,
    }
    toml::from_str::<One>(&format!("v = {text}"))
        .ok()
        .and_then(|one| serde_json::to_value(one.v).ok())
        .unwrap_or_else(|| Value::String(text.to_owned()))
}

/// Sets `key` (dotted: nested) in `definition`.
fn put(definition: &mut Object, key: &str, value: Value) -> anyhow::Result<()> {
    let mut parts = key.split('.').peekable();
    let mut at = definition;
    while let Some(part) = parts.next() {
        if parts.peek().is_none() {
            at.insert(part.to_owned(), value);
            return Ok(());
        }
        let next = at
            .entry(part.to_owned())
            .or_insert_with(|| Value::Object(Object::new()));
        at = match next {
            Value::Object(o) => o,
            _ => bail!("{key}: {part} is not a table"),
        };
    }
    bail!("{key:?} is not a key")
}

/// `show`: the definition (no secret), where it comes from, its state and what it has not
/// delivered.
async fn show(
    config: &Config,
    catalog: &Catalog,
    store: &pgoutbox::store::Store,
    name: &str,
) -> anyhow::Result<()> {
    let state = pgoutbox::store::destinations::read(store)
        .await?
        .into_iter()
        .find(|s| s.name == name);
    let mut out = serde_json::Map::new();
    if let Some(d) = config.destinations.iter().find(|d| d.name == name) {
        out.insert("name".into(), name.into());
        out.insert("source".into(), "file".into());
        out.insert("type".into(), d.sink.kind.clone().into());
        out.insert("topics".into(), d.subscription.topics.clone().into());
    } else {
        let shown = catalog.show(name).await?;
        out.insert("name".into(), name.into());
        out.insert("source".into(), "runtime".into());
        out.insert("definition".into(), shown.definition);
        out.insert("secrets".into(), shown.secrets.into());
        out.insert("created_at".into(), shown.created_at.to_rfc3339().into());
        out.insert("updated_at".into(), shown.updated_at.to_rfc3339().into());
    }
    out.insert("state".into(), state_text(state.as_ref()).into());
    out.insert(
        "undelivered".into(),
        catalog.undelivered(name).await?.into(),
    );
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}

/// `list`: the file's destinations (first page only), then a page of those added at runtime.
async fn list(
    config: &Config,
    catalog: &Catalog,
    store: &pgoutbox::store::Store,
    args: &ListArgs,
) -> anyhow::Result<()> {
    let states: std::collections::HashMap<String, _> = pgoutbox::store::destinations::read(store)
        .await?
        .into_iter()
        .map(|s| (s.name.clone(), s))
        .collect();
    let search = args.search.as_deref().map(str::to_lowercase);
    let matches = |name: &str| {
        search
            .as_deref()
            .is_none_or(|s| name.to_lowercase().contains(s))
    };
    let mut shown = 0;
    if args.after.is_none() {
        for d in config.destinations.iter().filter(|d| matches(&d.name)) {
            let state = state_text(states.get(&d.name));
            println!("{:<32} file     {:<10} {state}", d.name, d.sink.kind);
            shown += 1;
        }
    }
    let page = catalog
        .page(&Page {
            after: args.after.as_deref(),
            search: args.search.as_deref(),
            limit: args.limit,
        })
        .await?;
    for d in &page {
        let kind = d
            .definition
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or("?");
        let state = state_text(states.get(&d.name));
        println!("{:<32} runtime  {kind:<10} {state}", d.name);
        shown += 1;
    }
    if shown == 0 {
        println!("no destinations (add one with `pgoutbox destinations add NAME --type webhook --set url=...`)");
    }
    if page.len() as i64 == args.limit {
        if let Some(last) = page.last() {
            eprintln!("more: --after {}", last.name);
        }
    }
    Ok(())
}

/// A destination's state in a few words.
fn state_text(state: Option<&pgoutbox::store::destinations::DestinationState>) -> String {
    let Some(d) = state else {
        return "running".into();
    };
    let since = d.paused_at.unwrap_or(d.breaker_since);
    let age = (chrono::Utc::now() - since).num_milliseconds() as f64 / 1000.0;
    let state = match (d.paused_at, d.breaker.as_str()) {
        (Some(_), b) => format!("paused (breaker {b})"),
        (None, "closed") => return "running".into(),
        (None, b) => format!("breaker {b}"),
    };
    format!(
        "{state} for {} {}",
        human_age(Some(age)),
        d.last_error.as_deref().unwrap_or_default()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flag_values_read_as_toml_when_they_are_and_as_text_otherwise() {
        for (text, value) in [
            ("5", serde_json::json!(5)),
            ("true", serde_json::json!(true)),
            ("[\"a\", \"b\"]", serde_json::json!(["a", "b"])),
            ("{ a = 1 }", serde_json::json!({ "a": 1 })),
            ("http://h:80/x?y=1", serde_json::json!("http://h:80/x?y=1")),
            ("\"5\"", serde_json::json!("5")),
            ("", serde_json::json!("")),
        ] {
            assert_eq!(toml_or_string(text), value, "{text}");
        }
        let mut o = Object::new();
        put(&mut o, "headers.X-Api", "k".into()).expect("nested");
        put(&mut o, "breaker.failures", 3.into()).expect("nested");
        assert_eq!(
            Value::Object(o),
            serde_json::json!({ "headers": { "X-Api": "k" }, "breaker": { "failures": 3 } })
        );
    }
}
