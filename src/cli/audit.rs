//! `pgoutbox audit`: the changes operators made (retry, discard, pause, resume), newest first,
//! through the console (under a token's name) or the CLI (as `user@host`).

use std::process::ExitCode;

use pgoutbox::store::operators::{self, Change};
use pgoutbox::store::Store;

use super::Cli;

/// `pgoutbox audit`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// How many changes to show.
    #[arg(long, default_value_t = 50)]
    limit: i64,
    /// One JSON object per line instead of the table.
    #[arg(long)]
    json: bool,
}

pub async fn run(cli: &Cli, args: &Args) -> anyhow::Result<ExitCode> {
    let config = cli.load_config()?;
    let pool = super::connect_checked(&config, 1).await?;
    let store = Store::new(pool, config.table.clone());
    let changes = operators::audit(&store, args.limit, None).await?;
    if args.json {
        for c in &changes {
            println!("{}", serde_json::to_string(c)?);
        }
        return Ok(ExitCode::SUCCESS);
    }
    if changes.is_empty() {
        println!("no changes recorded yet");
    }
    for c in &changes {
        println!(
            "{}  {:<20} {:<8} {:<8} {:>8}  {}",
            c.at.format("%Y-%m-%d %H:%M:%S"),
            c.who,
            c.via,
            c.action,
            c.matched,
            c.filter.get()
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Who runs this command, as the audit log names them: `user@host`.
pub(super) fn operator() -> String {
    let user = std::env::var("USER")
        .or_else(|_| std::env::var("LOGNAME"))
        .unwrap_or_else(|_| "unknown".into());
    let host = pgoutbox::server::host_name().unwrap_or_else(|| "localhost".into());
    format!("{user}@{host}")
}

/// Records a change the CLI made.
pub async fn record(
    store: &Store,
    action: &str,
    filter: serde_json::Value,
    matched: u64,
) -> anyhow::Result<()> {
    let who = operator();
    let change = Change {
        who: &who,
        via: "cli",
        action,
        filter,
        matched,
    };
    operators::record(store, &change).await?;
    Ok(())
}
