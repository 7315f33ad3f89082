//! `pgoutbox migrate`.

use std::process::ExitCode;

use anyhow::Context;
use pgoutbox::inbox::InboxTable;

use super::Cli;

/// Arguments of `migrate`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Create or upgrade the consumer-side inbox table instead of the outbox (in `--schema`).
    #[arg(long, conflicts_with_all = ["grant_relay", "grant_producer"])]
    inbox: bool,

    /// Name of the inbox table, with `--inbox`.
    #[arg(long, value_name = "NAME", default_value = "inbox", requires = "inbox")]
    inbox_table: String,

    /// Also grant ROLE exactly what the relay needs (run as the table owner).
    #[arg(long, value_name = "ROLE")]
    grant_relay: Option<String>,

    /// Also grant ROLE what a producer needs (INSERT, the enqueue function).
    #[arg(long, value_name = "ROLE")]
    grant_producer: Option<String>,
}

pub async fn run(cli: &Cli, args: &Args) -> anyhow::Result<ExitCode> {
    let config = cli.load_config()?;
    let pool = super::connect(config.database_url()?, 1).await?;
    let (name, report) = if args.inbox {
        let inbox = InboxTable::parse(config.table.schema().as_str(), &args.inbox_table)?;
        let report = pgoutbox::inbox::migrate(&pool, &inbox)
            .await
            .with_context(|| format!("cannot migrate the inbox {inbox}"))?;
        (inbox.to_string(), report)
    } else {
        let report = pgoutbox::schema::migrate(&pool, &config.table)
            .await
            .with_context(|| format!("cannot migrate {}", config.table))?;
        (config.table.to_string(), report)
    };
    if report.applied.is_empty() {
        println!("{name} is up to date (schema version {})", report.version);
    } else {
        println!("migrated {name} to schema version {}:", report.version);
        for (version, description) in &report.applied {
            println!("  applied {version}: {description}");
        }
    }
    let mut conn = pool.acquire().await?;
    if let Some(role) = &args.grant_relay {
        let role = pgoutbox::Ident::parse(role).context("invalid --grant-relay role")?;
        pgoutbox::schema::grant_relay(&mut conn, &config.table, &role)
            .await
            .with_context(|| format!("cannot grant the relay's privileges to {role}"))?;
        println!(
            "granted {role}: USAGE on schema {}, {} on {}, SELECT on the migrations registry",
            config.table.schema(),
            pgoutbox::schema::RELAY_TABLE_PRIVILEGES.join(", "),
            config.table
        );
    }
    if let Some(role) = &args.grant_producer {
        let role = pgoutbox::Ident::parse(role).context("invalid --grant-producer role")?;
        pgoutbox::schema::grant_producer(&mut conn, &config.table, &role)
            .await
            .with_context(|| format!("cannot grant the producer's privileges to {role}"))?;
        println!(
            "granted {role}: INSERT on {}, EXECUTE on its enqueue function",
            config.table
        );
    }
    Ok(ExitCode::SUCCESS)
}
