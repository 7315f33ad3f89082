//! `pgoutbox replay`: send retained events again to one destination — start (or count with
//! `--dry-run`), list, watch, pause, resume, cancel.
//!
//! A replay is a row of `<table>_replays`: the relays serving its destination run it (any of
//! them, surviving restarts); this command only creates and steers it, and follows its progress.

use std::ops::ControlFlow;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context};
use chrono::{DateTime, Utc};
use indicatif::{ProgressBar, ProgressStyle};
use pgoutbox::config::{Config, DestinationConfig};
use pgoutbox::model::filter::Filter;
use pgoutbox::model::rate::RateLimit;
use pgoutbox::route;
use pgoutbox::store::replays::{self, Change, NewReplay, Replay, Selection};
use pgoutbox::store::Store;
use uuid::Uuid;

use super::Cli;

/// `replay` subcommands.
#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Send retained events again to one destination (its topics and filter apply); follows the
    /// replay's progress until it is done unless `--detach`.
    Start(StartArgs),
    /// The latest replays, running and paused first.
    List(ListArgs),
    /// Follow a replay's progress until it is done, paused or cancelled.
    Watch(IdArg),
    /// Stop queuing a replay's events (those already queued still go) until `resume`.
    Pause(IdArg),
    /// Queue a paused replay's events again, from where it stopped.
    Resume(IdArg),
    /// Stop a replay for good; its queued, undelivered events are dropped.
    Cancel(IdArg),
}

/// `replay start`.
#[derive(Debug, clap::Args)]
pub struct StartArgs {
    /// The destination's `name` from the configuration.
    destination: String,
    /// Events created at or after this: a time (RFC 3339, `2026-12-01T00:00:00Z`) or an age
    /// (`24h`: a day ago). Default: the oldest retained event.
    #[arg(long, value_parser = parse_time)]
    since: Option<DateTime<Utc>>,
    /// Events created before this (a time or an age). Default: no bound.
    #[arg(long, value_parser = parse_time)]
    until: Option<DateTime<Utc>>,
    /// Only this topic (repeat for several).
    #[arg(long = "topic")]
    topics: Vec<String>,
    /// Only this key (repeat for several).
    #[arg(long = "key")]
    keys: Vec<String>,
    /// A CEL expression over `topic`, `key`, `headers` and `payload` an event must satisfy.
    #[arg(long)]
    filter: Option<String>,
    /// The replay's own rate, e.g. `500/s` (default: as fast as the destination takes it, a
    /// window of 2,000 events at a time).
    #[arg(long)]
    rate: Option<String>,
    /// Count what would be sent, and send nothing.
    #[arg(long)]
    dry_run: bool,
    /// Print the replay's id and return at once instead of following it.
    #[arg(long)]
    detach: bool,
}

/// `replay list`.
#[derive(Debug, clap::Args)]
pub struct ListArgs {
    /// Only this destination's replays.
    #[arg(long)]
    destination: Option<String>,
    /// How many replays to show.
    #[arg(long, default_value_t = 20)]
    limit: i64,
    /// One JSON object per line instead of the table.
    #[arg(long)]
    json: bool,
}

/// A replay's id.
#[derive(Debug, clap::Args)]
pub struct IdArg {
    /// The replay's id (`replay list` shows it).
    id: Uuid,
}

/// A time, or an age before now (`24h`, `7d`).
fn parse_time(text: &str) -> Result<DateTime<Utc>, String> {
    if let Ok(t) = DateTime::parse_from_rfc3339(text.trim()) {
        return Ok(t.with_timezone(&Utc));
    }
    let age = humantime::parse_duration(text.trim()).map_err(|_| {
        format!("{text:?} is neither a time (2026-12-01T00:00:00Z) nor an age (24h, 7d)")
    })?;
    let age = chrono::Duration::from_std(age).map_err(|e| e.to_string())?;
    Ok(Utc::now() - age)
}

pub async fn run(cli: &Cli, command: &Command) -> anyhow::Result<ExitCode> {
    let config = cli.load_config()?;
    let pool = super::connect_checked(&config, 1).await?;
    let store = Store::new(pool, config.table.clone());
    match command {
        Command::Start(args) => start(&store, &config, args).await,
        Command::List(args) => list(&store, args).await,
        Command::Watch(IdArg { id }) => follow(&store, *id).await,
        Command::Pause(IdArg { id }) => steer(&store, *id, Change::Pause).await,
        Command::Resume(IdArg { id }) => steer(&store, *id, Change::Resume).await,
        Command::Cancel(IdArg { id }) => steer(&store, *id, Change::Cancel).await,
    }
}

/// The configured destination `name`, or an error listing those there are.
fn destination<'c>(config: &'c Config, name: &str) -> anyhow::Result<&'c DestinationConfig> {
    config
        .destinations
        .iter()
        .find(|d| d.name == name)
        .map(|d| &**d)
        .ok_or_else(|| super::no_such_destination(config, name))
}

async fn start(store: &Store, config: &Config, args: &StartArgs) -> anyhow::Result<ExitCode> {
    let dest = destination(config, &args.destination)?;
    let filter = args
        .filter
        .as_deref()
        .map(Filter::compile)
        .transpose()
        .map_err(|e| anyhow::anyhow!("invalid --filter: {e}"))?;
    if let Some(rate) = &args.rate {
        RateLimit::parse(rate, None).map_err(|e| anyhow::anyhow!("invalid --rate: {e}"))?;
    }
    if let (Some(since), Some(until)) = (args.since, args.until) {
        if until <= since {
            bail!("--until ({until}) must be after --since ({since})");
        }
    }
    let selection = Selection {
        since: args.since,
        until: args.until,
        topics: args.topics.clone(),
        keys: args.keys.clone(),
    };
    if args.dry_run {
        return dry_run(store, dest, &selection, filter.as_ref()).await;
    }
    let new = NewReplay {
        destination: dest.name.clone(),
        selection,
        filter: args.filter.clone(),
        rate: args.rate.clone(),
        backfill: false,
        created_by: Some(super::audit::operator()),
    };
    let id = replays::create(store, &new)
        .await?
        .context("the replay was not created")?;
    let replay = replays::get(store, id)
        .await?
        .context("the replay vanished")?;
    let filter_json = serde_json::json!({ "destination": dest.name, "replay": id });
    super::audit::record(store, "replay", filter_json, replay.total.max(0) as u64).await?;
    eprintln!(
        "replay {id} of up to {} retained events to {} created; every relay serving {} runs it",
        replay.total, dest.name, dest.name
    );
    if args.detach {
        println!("{id}");
        return Ok(ExitCode::SUCCESS);
    }
    follow(store, id).await
}

/// Walks the selection as a replay would ([`pgoutbox::route::dry_run`]), counting what the
/// destination would be sent.
async fn dry_run(
    store: &Store,
    dest: &DestinationConfig,
    selection: &Selection,
    filter: Option<&Filter>,
) -> anyhow::Result<ExitCode> {
    let total = replays::count(store, selection).await?;
    let bar = bar(total);
    let counted = route::dry_run(store, dest, selection, filter, |read| {
        bar.set_position(read);
        ControlFlow::Continue(())
    })
    .await?;
    bar.finish_and_clear();
    println!(
        "dry run: {} of {} retained events in range would be sent to {}{}",
        counted.would_send,
        counted.read,
        dest.name,
        if counted.unreadable > 0 {
            format!(
                " ({} rows cannot be read as events and would be skipped)",
                counted.unreadable
            )
        } else {
            String::new()
        }
    );
    Ok(ExitCode::SUCCESS)
}

fn bar(total: i64) -> ProgressBar {
    let bar = ProgressBar::new(total.max(0) as u64);
    bar.set_style(
        ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} read  {msg}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar
}

/// Follows replay `id` until it ends or stops moving by an operator's hand.
async fn follow(store: &Store, id: Uuid) -> anyhow::Result<ExitCode> {
    let Some(mut replay) = replays::get(store, id).await? else {
        bail!("no replay {id}; `pgoutbox replay list` shows them");
    };
    let bar = bar(replay.total);
    let started = std::time::Instant::now();
    let first = replay.delivered();
    let (mut last_moved, mut told) = (std::time::Instant::now(), false);
    loop {
        bar.set_length(replay.total.max(replay.read) as u64);
        bar.set_position(replay.read as u64);
        bar.set_message(progress(&replay));
        if replay.state != "running" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        let now = replays::get(store, id)
            .await?
            .context("the replay vanished")?;
        if now.updated_at != replay.updated_at || now.pending != replay.pending {
            last_moved = std::time::Instant::now();
        } else if !told && last_moved.elapsed() > Duration::from_secs(15) {
            told = true;
            bar.println(format!(
                "replay {id} has not moved for 15 s: is a relay serving {} running? (Ctrl-C leaves the replay running; `pgoutbox replay watch {id}` follows it again)",
                now.destination
            ));
        }
        replay = now;
    }
    bar.finish_and_clear();
    let secs = started.elapsed().as_secs_f64();
    let rate = (replay.delivered() - first) as f64 / secs.max(0.001);
    println!(
        "replay {id} {}: {} in {:.1} s ({rate:.0} events/s)",
        replay.state,
        progress(&replay),
        secs
    );
    Ok(match replay.state.as_str() {
        "done" | "paused" => ExitCode::SUCCESS,
        _ => ExitCode::FAILURE,
    })
}

/// `1200 queued, 1100 delivered, 0 dead`.
fn progress(r: &Replay) -> String {
    let mut text = format!(
        "{} queued, {} delivered, {} dead",
        r.queued,
        r.delivered(),
        r.dead
    );
    if let Some(e) = &r.error {
        text.push_str(&format!(" — {e}"));
    }
    text
}

async fn list(store: &Store, args: &ListArgs) -> anyhow::Result<ExitCode> {
    let list = replays::list(store, args.destination.as_deref(), args.limit).await?;
    if args.json {
        for r in &list {
            println!("{}", serde_json::to_string(r)?);
        }
        return Ok(ExitCode::SUCCESS);
    }
    if list.is_empty() {
        println!("no replays yet; `pgoutbox replay start DESTINATION` sends retained events again");
    }
    for r in &list {
        println!(
            "{}  {:<20} {:<9} {:>9}/{:<9} read  {}  {}",
            r.id,
            r.destination,
            r.state,
            r.read,
            r.total,
            progress(r),
            r.created_at.format("%Y-%m-%d %H:%M:%S")
        );
    }
    Ok(ExitCode::SUCCESS)
}

async fn steer(store: &Store, id: Uuid, change: Change) -> anyhow::Result<ExitCode> {
    let Some(before) = replays::get(store, id).await? else {
        bail!("no replay {id}; `pgoutbox replay list` shows them");
    };
    let (action, allowed) = (change.verb(), change.states().1.join(" or "));
    if !replays::change(store, id, change).await? {
        bail!(
            "cannot {action} replay {id}: it is {} (only a {allowed} replay can be)",
            before.state
        );
    }
    let filter = serde_json::json!({ "destination": before.destination, "replay": id });
    super::audit::record(
        store,
        &format!("replay-{action}"),
        filter,
        before.pending.max(0) as u64,
    )
    .await?;
    eprintln!("replay {id} to {}: {}", before.destination, change.done());
    Ok(ExitCode::SUCCESS)
}
