//! `pgoutbox destination pause|resume|list`: an operator's hold on a destination, obeyed by every
//! relay of the outbox within about a second, and the breaker state of each.

use std::process::ExitCode;

use super::{human_age, Cli};

/// `destination` subcommands.
#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Hold a destination's events (no attempts counted) until `resume`, in every relay.
    Pause(NameArg),
    /// Let a paused destination's events flow again; its held events are due at once.
    Resume(NameArg),
    /// Each destination's state: running, paused, circuit breaker open or half-open.
    List,
}

/// A destination's name.
#[derive(Debug, clap::Args)]
pub struct NameArg {
    /// The destination's `name` from the configuration.
    name: String,
}

pub async fn run(cli: &Cli, command: &Command) -> anyhow::Result<ExitCode> {
    let config = cli.load_config()?;
    let pool = super::connect_checked(&config, 1).await?;
    let store = pgoutbox::store::Store::new(pool.clone(), config.table.clone());
    let check = |name: &str| -> anyhow::Result<()> {
        // Without a config file the names cannot be checked: the state row is kept as given.
        if !config.destinations.is_empty() && !config.destinations.iter().any(|d| d.name == name) {
            return Err(super::no_such_destination(&config, name));
        }
        Ok(())
    };
    match command {
        Command::Pause(NameArg { name }) => {
            check(name)?;
            pgoutbox::store::destinations::pause(&store, name).await?;
            let filter = serde_json::json!({ "destination": name });
            super::audit::record(&store, "pause", filter, 0).await?;
            eprintln!("destination {name} paused: every relay holds its events from now on (within about a second); `pgoutbox destination resume {name}` lets them flow again");
        }
        Command::Resume(NameArg { name }) => {
            check(name)?;
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
        Command::List => {
            let states = pgoutbox::store::destinations::read(&store).await?;
            if states.is_empty() {
                println!("no destination state recorded yet (a relay records its destinations when it starts)");
            }
            for d in states {
                let since = d.paused_at.unwrap_or(d.breaker_since);
                let age = (chrono::Utc::now() - since).num_milliseconds() as f64 / 1000.0;
                let state = match (d.paused_at, d.breaker.as_str()) {
                    (Some(_), b) => format!("paused (breaker {b})"),
                    (None, "closed") => "running".into(),
                    (None, b) => format!("breaker {b}"),
                };
                println!(
                    "{:<24} {state:<26} for {:<8} {}",
                    d.name,
                    human_age(Some(age)),
                    d.last_error.unwrap_or_default()
                );
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
