//! `pgoutbox status`.

use std::process::ExitCode;

use pgoutbox::route::Router;

use super::{human_age, Cli};

/// Arguments of `status`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Print JSON (documented in README.md) instead of a table.
    #[arg(long)]
    json: bool,
}

pub async fn run(cli: &Cli, args: &Args) -> anyhow::Result<ExitCode> {
    let config = cli.load_config()?;
    let pool = super::connect_checked(&config, 1).await?;
    let router = Router::new(&config.destinations);
    let names: Vec<String> = config.destinations.iter().map(|d| d.name.clone()).collect();
    let status = pgoutbox::status::read(&pool, &config.table, Some((&router, &names))).await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&status)?);
        return Ok(ExitCode::SUCCESS);
    }
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
            row.topic.clone(),
            row.due.to_string(),
            row.backoff.to_string(),
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
    Ok(ExitCode::SUCCESS)
}
