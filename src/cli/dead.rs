//! `pgoutbox dead list|show|retry|discard`.

use std::io::{BufRead, IsTerminal, Write};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::bail;
use pgoutbox::model::event::topic_label;
use pgoutbox::store::dead::{self, DeadFilter};
use pgoutbox::store::Store;
use uuid::Uuid;

use super::{parse_duration, Cli};

#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// List dead events, newest first.
    List {
        #[command(flatten)]
        filter: FilterArgs,
        /// Only events dead-lettered within this long (e.g. 1h, 2d).
        #[arg(long, value_parser = parse_duration)]
        since: Option<Duration>,
        /// Most events listed.
        #[arg(long, default_value_t = 100)]
        limit: i64,
        /// Print JSON lines.
        #[arg(long)]
        json: bool,
    },
    /// Show one dead event with its payload, headers and last error (JSON on stdout), and its
    /// failed attempts (on stderr).
    Show {
        /// Event id.
        id: Uuid,
    },
    /// Put dead events back as due now, attempts reset.
    Retry(Selection),
    /// Delete dead events for good (asks for confirmation unless --yes).
    Discard {
        #[command(flatten)]
        selection: Selection,
        /// Do not ask for confirmation.
        #[arg(long, short = 'y')]
        yes: bool,
    },
}

#[derive(Debug, clap::Args)]
pub struct FilterArgs {
    /// Only this topic.
    #[arg(long)]
    topic: Option<String>,
    /// Only this destination.
    #[arg(long)]
    destination: Option<String>,
}

#[derive(Debug, clap::Args)]
pub struct Selection {
    /// Event ids; without any, --destination, --topic or --all says which.
    #[arg(
        required_unless_present_any = ["all", "destination", "topic"],
        conflicts_with = "all"
    )]
    ids: Vec<Uuid>,
    /// Every dead event (narrowed by --topic / --destination, which select alone too).
    #[arg(long)]
    all: bool,
    #[command(flatten)]
    filter: FilterArgs,
    /// Say what would be done; change nothing.
    #[arg(long)]
    dry_run: bool,
}

impl Selection {
    fn filter(&self) -> DeadFilter {
        DeadFilter {
            ids: (!self.all).then(|| self.ids.clone()),
            topic: self.filter.topic.clone(),
            destination: self.filter.destination.clone(),
            since: None,
        }
    }
}

pub async fn run(cli: &Cli, cmd: &Command) -> anyhow::Result<ExitCode> {
    let config = cli.load_config()?;
    let pool = super::connect_checked(&config, 1).await?;
    let table = &config.table;
    let store = Store::new(pool, table.clone());
    match cmd {
        Command::List {
            filter,
            since,
            limit,
            json,
        } => {
            let f = DeadFilter {
                ids: None,
                topic: filter.topic.clone(),
                destination: filter.destination.clone(),
                since: *since,
            };
            let events = dead::list(&store, &f, *limit).await?;
            let total = dead::count(&store, &f).await?;
            if *json {
                for e in &events {
                    println!("{}", serde_json::to_string(e)?);
                }
                return Ok(ExitCode::SUCCESS);
            }
            for e in &events {
                println!(
                    "{}  {}  {:<24} {:<16} attempts={}  {}",
                    e.id,
                    e.dead_at.format("%Y-%m-%d %H:%M:%S"),
                    topic_label(e.topic.as_deref()),
                    e.destination.as_deref().unwrap_or("(unrouted)"),
                    e.attempts,
                    e.last_error.as_deref().unwrap_or("")
                );
            }
            println!("{} dead events shown, {} match", events.len(), total);
        }
        Command::Show { id } => {
            let dead = dead::show(&store, *id).await?;
            if dead.is_empty() {
                bail!("no dead event with id {id} in {table}");
            }
            // One document per destination that gave up on the event (several after a fan-out).
            for e in &dead {
                println!("{}", serde_json::to_string_pretty(e)?);
            }
            // Its failed attempts, as the console shows them.
            if let Some(detail) = pgoutbox::store::inspect::show(&store, *id).await? {
                eprintln!("failed attempts ({}):", detail.attempts.len());
                for a in &detail.attempts {
                    eprintln!(
                        "  {}  {}  {}{}",
                        a.at.format("%Y-%m-%d %H:%M:%S%.3f"),
                        a.destination.as_deref().unwrap_or("-"),
                        a.error,
                        if a.dead { "  (dead-lettered)" } else { "" }
                    );
                }
            }
        }
        Command::Retry(sel) => {
            let filter = sel.filter();
            let n = dead::retry(&store, &filter, sel.dry_run).await?;
            if sel.dry_run {
                println!("dry run: {n} dead events would be put back as due");
            } else {
                super::audit::record(&store, "retry", filter.to_json(), n).await?;
                println!("{n} dead events put back as due (attempts reset)");
            }
        }
        Command::Discard { selection, yes } => {
            let filter = selection.filter();
            let n = dead::count(&store, &filter).await?;
            if selection.dry_run {
                println!("dry run: {n} dead events would be discarded");
                return Ok(ExitCode::SUCCESS);
            }
            if n > 0
                && !yes
                && !confirm(&format!("Discard {n} dead events from {table} for good?"))?
            {
                println!("nothing discarded");
                return Ok(ExitCode::FAILURE);
            }
            let n = dead::discard(&store, &filter, false).await?;
            super::audit::record(&store, "discard", filter.to_json(), n).await?;
            println!("{n} dead events discarded");
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn confirm(question: &str) -> anyhow::Result<bool> {
    if !std::io::stdin().is_terminal() {
        bail!("refusing to discard without confirmation: pass --yes (or --dry-run to preview)");
    }
    eprint!("{question} [y/N] ");
    std::io::stderr().flush()?;
    let mut answer = String::new();
    std::io::stdin().lock().read_line(&mut answer)?;
    Ok(matches!(answer.trim(), "y" | "Y" | "yes"))
}
