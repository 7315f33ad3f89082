//! `pgoutbox slot create|drop|status`: the replication slot and publication of `source = "wal"`.
//! The relay never creates or drops a slot by itself; these commands are how an operator does.

use std::process::ExitCode;

use anyhow::Context;
use pgoutbox::sources::wal::slot::{self, Names};

use super::Cli;

/// `slot` subcommands.
#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Create the publication and the logical replication slot (pgoutput), where missing, after
    /// checking the server (wal_level = logical, PostgreSQL 14+, a REPLICATION role).
    Create,
    /// Drop the slot: refused while a relay streams from it, and while it holds events written
    /// with emit() and not yet delivered (they are lost with it; pending outbox rows are not:
    /// source = "poll" delivers them) unless --force.
    Drop {
        /// Also drop the publication.
        #[arg(long)]
        publication: bool,
        /// Drop even when the slot holds emit() events not yet delivered (they are lost).
        #[arg(long)]
        force: bool,
    },
    /// The slot's state: active or not, confirmed position, WAL it holds back, wal_status.
    Status,
}

pub async fn run(cli: &Cli, command: &Command) -> anyhow::Result<ExitCode> {
    let config = cli.load_config()?;
    let pool = super::connect_checked(&config, 1).await?;
    let names = Names::of(&config.wal, &config.table);
    match command {
        Command::Create => {
            let created = slot::create(&pool, &config.table, &names)
                .await
                .with_context(|| format!("cannot create replication slot {}", names.slot))?;
            match created.publication {
                true => eprintln!(
                    "publication {} created: inserts into {}",
                    names.publication, config.table
                ),
                false => eprintln!("publication {} already there", names.publication),
            }
            match created.slot_at {
                Some(lsn) => eprintln!(
                    "slot {} created at {lsn}: events committed from now on are read from it by \
                     relays with source = \"wal\" (rows already pending are not in it: drain them \
                     with source = \"poll\" first, see docs/wal.md)",
                    names.slot
                ),
                None => eprintln!("slot {} already there", names.slot),
            }
            if created.failover {
                eprintln!(
                    "it is a failover slot: standbys with sync_replication_slots = on keep a copy, \
                     and relays given every host in database_url resume on a promoted standby \
                     (see docs/operations.md)"
                );
            }
        }
        Command::Drop { publication, force } => {
            let options = slot::DropOptions {
                publication: *publication,
                force: *force,
            };
            let dropped = slot::drop(&pool, &names, &config.table, options)
                .await
                .with_context(|| format!("cannot drop replication slot {}", names.slot))?;
            match dropped {
                true => eprintln!("slot {} dropped", names.slot),
                false => eprintln!("no slot named {}", names.slot),
            }
            if *publication {
                eprintln!("publication {} dropped", names.publication);
            }
        }
        Command::Status => {
            let Some(s) = slot::status(&pool, &names).await? else {
                println!(
                    "no slot named {}: `pgoutbox slot create` makes it",
                    names.slot
                );
                return Ok(ExitCode::from(1));
            };
            let keep = pgoutbox::store::server::max_slot_wal_keep_size(&pool).await?;
            println!("slot              {}", s.slot_name);
            println!("plugin            {}", s.plugin.unwrap_or_default());
            println!(
                "active            {}",
                match (s.active, s.active_pid) {
                    (true, Some(pid)) => format!("yes (backend pid {pid})"),
                    (true, None) => "yes".into(),
                    (false, _) => "no (no relay streams it)".into(),
                }
            );
            println!(
                "confirmed         {}",
                s.confirmed_flush_lsn.unwrap_or_default()
            );
            println!(
                "lag               {}",
                s.lag_bytes.map(bytes).unwrap_or_default()
            );
            println!("wal_status        {}", s.wal_status.unwrap_or_default());
            println!(
                "safe_wal_size     {}",
                match s.safe_wal_size {
                    Some(v) => bytes(v),
                    None => format!("unbounded (max_slot_wal_keep_size = {keep})"),
                }
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Bytes in a readable unit.
fn bytes(n: i64) -> String {
    let units = ["B", "kB", "MB", "GB", "TB"];
    let mut v = n as f64;
    let mut unit = 0;
    while v.abs() >= 1024.0 && unit + 1 < units.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", units[unit])
    }
}
