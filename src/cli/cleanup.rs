//! `pgoutbox cleanup`.

use std::io::{IsTerminal, Write};
use std::process::ExitCode;
use std::time::Duration;

use pgoutbox::inbox::{Inbox, InboxTable};
use pgoutbox::store::cleanup::{self, CleanupOptions};
use pgoutbox::store::SettleMode;
use pgoutbox::store::{history, Store};

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
    /// Clean the consumer-side inbox (in `--schema`) instead of the outbox: forget ids processed
    /// longer than `--retention` ago. Keep them longer than the outbox can still redeliver.
    #[arg(long, requires = "retention", conflicts_with = "dry_run")]
    inbox: bool,
    /// Name of the inbox table, with `--inbox`.
    #[arg(long, value_name = "NAME", default_value = "inbox", requires = "inbox")]
    inbox_table: String,
}

pub async fn run(cli: &Cli, args: &Args) -> anyhow::Result<ExitCode> {
    let config = cli.load_config()?;
    if args.inbox {
        // A consumer's database need not hold an outbox: no outbox schema check.
        let pool = super::connect(config.database_url()?, 1).await?;
        return inbox(&pool, &config, args).await;
    }
    let pool = super::connect_checked(&config, 1).await?;
    let store = Store::new(pool.clone(), config.table.clone());
    let mut options = CleanupOptions::from_config(&config);
    options.dry_run = args.dry_run;
    options.chunk_rows = args.batch_rows.max(1);
    if let Some(r) = args.retention {
        options.retention = r;
    }
    let tty = std::io::stderr().is_terminal();
    let report = cleanup::run(&store, &options, |r| {
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
    if report.dropped_partitions > 0 {
        println!(
            "{}{} partitions of the published history {}",
            if args.dry_run { "dry run: " } else { "" },
            report.dropped_partitions,
            if args.dry_run {
                "would be dropped"
            } else {
                "dropped"
            }
        );
    }
    if !args.dry_run && SettleMode::of(&config) == SettleMode::Move {
        // The relay does this on each tick too; a relay role that does not own the history
        // cannot, and this command, run by the owner, is then what keeps partitions ahead.
        use anyhow::Context;
        let ahead = history::ahead(config.retention, config.cleanup_interval);
        let created = history::ensure(&store, config.retention, ahead)
            .await
            .context(
                "cannot create the history's next partitions (only the history's owner can)",
            )?;
        if created > 0 {
            println!("{created} partitions of the published history created ahead of the clock");
        }
    }
    if !args.dry_run {
        // Rows waiting behind a dead event that this cleanup removed (or on a destination that is
        // back) are due again, as the long-running relay's cleanup would make them.
        let released = pgoutbox::store::held::unpark_followers(&store).await?;
        if released > 0 {
            println!("{released} rows no longer held back are due again");
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `cleanup --inbox`: the inbox's own batched delete (each batch one autocommit statement).
async fn inbox(
    pool: &sqlx::PgPool,
    config: &pgoutbox::config::Config,
    args: &Args,
) -> anyhow::Result<ExitCode> {
    use anyhow::Context;
    let table = InboxTable::parse(config.table.schema().as_str(), &args.inbox_table)?;
    let retention = args.retention.unwrap_or_default();
    let mut conn = pool.acquire().await?;
    let report = Inbox::new(table.clone())
        .cleanup(&mut conn, retention, args.batch_rows)
        .await
        .with_context(|| format!("cannot clean the inbox {table}"))?;
    println!(
        "{} rows of {table} processed more than {} ago deleted in {} batches",
        report.deleted,
        humantime::format_duration(retention),
        report.batches
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
