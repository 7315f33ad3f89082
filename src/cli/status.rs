//! `pgoutbox status`.

use std::process::ExitCode;

use pgoutbox::model::event::topic_label;
use pgoutbox::route::Router;
use pgoutbox::store::Store;

use super::{human_age, Cli};

/// Arguments of `status`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Print JSON (documented in README.md) instead of a table.
    #[arg(long, conflicts_with = "watch")]
    json: bool,
    /// Live view: refresh every --interval (Ctrl-C to quit).
    #[arg(long, short = 'w')]
    watch: bool,
    /// Refresh interval of --watch.
    #[arg(long, default_value = "1s", value_parser = super::parse_duration)]
    interval: std::time::Duration,
}

pub async fn run(cli: &Cli, args: &Args) -> anyhow::Result<ExitCode> {
    let mut config = cli.load_config()?;
    let pool = super::connect_checked(&config, 1).await?;
    let store = Store::new(pool.clone(), config.table.clone());
    // Untried events count for the destinations that will take them: those added at runtime too.
    let key = pgoutbox::definitions::Key::from_env()?;
    let added = match pgoutbox::definitions::load(&store, key.as_ref()).await {
        Ok(loaded) => loaded.add_to(&mut config),
        Err(e) => Err(e),
    };
    if let Err(e) = added {
        eprintln!("destinations added at runtime are left out of this view: {e}");
    }
    let router = Router::new(&config.destinations);
    let names: Vec<String> = config.destinations.iter().map(|d| d.name.clone()).collect();
    if args.watch {
        return watch(&store, &router, &names, &limits(&config), args.interval).await;
    }
    let status = pgoutbox::status::read(&store, Some((&router, &names))).await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&status)?);
        return Ok(ExitCode::SUCCESS);
    }
    print_table(&status, &limits(&config));
    if config.source == pgoutbox::config::Source::Wal {
        // Events written with emit() and not yet read live only in the WAL: the slot's lag is
        // their backlog.
        let names = pgoutbox::sources::wal::slot::Names::of(&config.wal, &config.table);
        match pgoutbox::sources::wal::slot::status(&pool, &names).await? {
            Some(s) => {
                println!(
                "wal slot {}: {}, {} bytes behind, wal_status {} (details: pgoutbox slot status)",
                s.slot_name,
                if s.active { "streamed by a relay" } else { "NOT streamed by any relay" },
                s.lag_bytes.unwrap_or(0),
                s.wal_status.unwrap_or_default()
            )
            }
            None => println!(
                "wal slot {}: MISSING (source = \"wal\"): `pgoutbox slot create`",
                names.slot
            ),
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The live view: the status table, throughput per destination and the newest errors.
async fn watch(
    store: &Store,
    router: &Router,
    names: &[String],
    limits: &std::collections::HashMap<String, pgoutbox::model::rate::RateLimit>,
    interval: std::time::Duration,
) -> anyhow::Result<ExitCode> {
    let mut previous: Option<(std::time::Instant, std::collections::HashMap<String, i64>)> = None;
    loop {
        let status = pgoutbox::status::read(store, Some((router, names))).await?;
        let now = std::time::Instant::now();
        let mut published: std::collections::HashMap<String, i64> = Default::default();
        for row in &status.rows {
            *published
                .entry(row.destination.clone().unwrap_or_default())
                .or_default() += row.published_retained;
        }
        // Clear the screen and go home, like top.
        print!("\x1b[2J\x1b[H");
        print_table(&status, limits);
        println!();
        println!("THROUGHPUT (published per second since the last refresh; needs retention > 0)");
        for (destination, count) in &published {
            let rate = previous
                .as_ref()
                .and_then(|(at, prev)| {
                    prev.get(destination)
                        .map(|p| (count - p) as f64 / now.duration_since(*at).as_secs_f64())
                })
                .map(|r| format!("{:.0}/s", r.max(0.0)))
                .unwrap_or_else(|| "…".into());
            println!(
                "  {:<24} {rate}",
                if destination.is_empty() {
                    "(unrouted)"
                } else {
                    destination
                }
            );
        }
        println!();
        println!("RECENT ERRORS");
        let errors = pgoutbox::store::status::recent_errors(store).await?;
        if errors.is_empty() {
            println!("  none");
        }
        for e in errors {
            let mut error = e.error.unwrap_or_default();
            error.truncate(120);
            println!(
                "  [{}] {} {}: {error}",
                e.state,
                e.destination,
                topic_label(e.topic.as_deref())
            );
        }
        previous = Some((now, published));
        tokio::time::sleep(interval).await;
    }
}

/// Each destination's `rate_limit`, by name, for the DESTINATIONS lines.
fn limits(
    config: &pgoutbox::config::Config,
) -> std::collections::HashMap<String, pgoutbox::model::rate::RateLimit> {
    config
        .destinations
        .iter()
        .filter_map(|d| Some((d.name.clone(), d.rate_limit?)))
        .collect()
}

fn print_table(
    status: &pgoutbox::status::Status,
    limits: &std::collections::HashMap<String, pgoutbox::model::rate::RateLimit>,
) {
    println!(
        "{}  (at {})",
        status.table,
        status.generated_at.format("%Y-%m-%d %H:%M:%S UTC")
    );
    let header = [
        "DESTINATION",
        "TOPIC",
        "DUE",
        "BACKOFF",
        "HELD",
        "IN-FLIGHT",
        "FAILING",
        "DEAD",
        "LAG",
        "PUB/1m",
        "PUB/1h",
        "PUBLISHED",
    ];
    let mut lines = vec![header.map(String::from).to_vec()];
    for row in status.rows.iter().chain(std::iter::once(&status.totals)) {
        let destination = if std::ptr::eq(row, &status.totals) {
            "TOTAL".to_owned()
        } else {
            row.destination
                .clone()
                .unwrap_or_else(|| "(unrouted)".into())
        };
        lines.push(vec![
            destination,
            topic_label(row.topic.as_deref()).to_owned(),
            row.due.to_string(),
            row.backoff.to_string(),
            row.held.to_string(),
            row.in_flight.to_string(),
            row.failing.to_string(),
            row.dead.to_string(),
            human_age(row.oldest_pending_age_seconds),
            row.published_last_minute.to_string(),
            row.published_last_hour.to_string(),
            row.published_retained.to_string(),
        ]);
    }
    let widths: Vec<usize> = (0..header.len())
        .map(|c| {
            lines
                .iter()
                .map(|l| l[c].chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    for line in &lines {
        let cells: Vec<String> = line
            .iter()
            .enumerate()
            .map(|(c, cell)| {
                if c < 2 {
                    format!("{cell:<w$}", w = widths[c])
                } else {
                    format!("{cell:>w$}", w = widths[c])
                }
            })
            .collect();
        println!("{}", cells.join("  ").trim_end());
    }
    if status.destinations.is_empty() {
        return;
    }
    println!();
    println!("DESTINATIONS");
    for d in &status.destinations {
        let since = d.paused_at.unwrap_or(d.breaker_since);
        let state = match (&d.paused_at, d.breaker.as_str()) {
            (Some(_), breaker) => format!("paused (breaker {breaker})"),
            (None, "closed") => "running".to_owned(),
            (None, breaker) => format!("breaker {breaker}"),
        };
        let age = (chrono::Utc::now() - since).num_milliseconds() as f64 / 1000.0;
        let mut line = format!("  {:<24} {state} for {}", d.name, human_age(Some(age)));
        if d.breaker != "closed" {
            if let Some(e) = &d.last_error {
                let mut e = e.clone();
                e.truncate(160);
                line.push_str(&format!(" — last error: {e}"));
            }
            if d.failed_probes > 0 {
                line.push_str(&format!(" ({} failed probes)", d.failed_probes));
            }
        }
        if let Some(limit) = limits.get(&d.name) {
            line.push_str(&format!(", rate limit {limit}"));
        }
        println!("{line}");
    }
}
