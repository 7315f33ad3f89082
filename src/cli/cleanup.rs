//! `pgoutbox cleanup`.

use std::io::{IsTerminal, Write};
use std::process::ExitCode;
use std::time::Duration;

use pgoutbox::cleanup::{self, CleanupOptions};

use super::{parse_duration, Cli};

/// Arguments of `cleanup`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Count what would be deleted; delete nothing.
    #[arg(long)]
    dry_run: bool,
    /// Override the configured retention of published rows (e.g. 7d, 12h, 0s).
    #[arg(long, value_parser = parse_duration)]
    retention: Option<Duration>,
    /// Rows looked at per batch; each batch is one short transaction.
    #[arg(long, default_value_t = 5000)]
    batch_rows: i64,
}

pub async fn run(cli: &Cli, args: &Args) -> anyhow::Result<ExitCode> {
    let config = cli.load_config()?;
    let pool = super::connect_checked(&config, 1).await?;
    let mut options = CleanupOptions::from_config(&config);
    options.dry_run = args.dry_run;
    options.chunk_rows = args.batch_rows.max(1);
    if let Some(r) = args.retention {
        options.retention = r;
    }
    let tty = std::io::stderr().is_terminal();
    let report = cleanup::run(&pool, &config.table, &options, |r| {
        if tty {
            eprint!(
                "\r{} rows {} in {} batches…",
                r.deleted(),
                verb(args.dry_run),
                r.batches
            );
            let _ = std::io::stderr().flush();
        }
    })
    .await?;
    if tty {
        eprintln!();
    }
    println!(
        "{}{} published and {} dead rows {} in {} batches (longest batch {} ms)",
        if args.dry_run { "dry run: " } else { "" },
        report.deleted_published,
        report.deleted_dead,
        if args.dry_run {
            "would be deleted"
        } else {
            "deleted"
        },
        report.batches,
        report.longest_batch.as_millis()
    );
    Ok(ExitCode::SUCCESS)
}

fn verb(dry_run: bool) -> &'static str {
    if dry_run {
        "to delete"
    } else {
        "deleted"
    }
}
