//! `pgoutbox migrate`.

use std::process::ExitCode;

use anyhow::Context;

use super::Cli;

/// Arguments of `migrate`.
#[derive(Debug, clap::Args)]
pub struct Args {}

pub async fn run(cli: &Cli, _args: &Args) -> anyhow::Result<ExitCode> {
    let config = cli.load_config()?;
    let pool = super::connect(config.database_url()?, 1).await?;
    let mut conn = pool.acquire().await?;
    let report = pgoutbox::schema::migrate(&mut conn, &config.table)
        .await
        .with_context(|| format!("cannot migrate {}", config.table))?;
    if report.applied.is_empty() {
        println!(
            "{} is up to date (schema version {})",
            config.table, report.version
        );
    } else {
        println!(
            "migrated {} to schema version {}:",
            config.table, report.version
        );
        for (version, description) in &report.applied {
            println!("  applied {version}: {description}");
        }
    }
    Ok(ExitCode::SUCCESS)
}
