//! The scratch database of one bench run (`pgoutbox_bench_<pid>`, created on the configured
//! server and dropped at the end) and what every scenario does in it: fresh outbox tables, the
//! WAL source's slot and publication, server-side backlogs, and waiting for a backlog to drain.

use std::time::Duration;

use anyhow::Context;
use indicatif::ProgressBar;
use sqlx::PgPool;

use super::output::Output;
use super::sql;

/// The scratch database of one bench run.
pub struct Scratch {
    /// URL of the scratch database.
    pub url: String,
    /// A pool on it.
    pub pool: PgPool,
    admin_url: String,
    name: String,
}

impl Scratch {
    /// Creates the scratch database on the server of `url` and opens a pool on it.
    pub async fn create(url: &str) -> anyhow::Result<Self> {
        let name = format!("pgoutbox_bench_{}", std::process::id());
        let admin = crate::scratch::connect(url, 1).await?;
        sql::setup::drop_database(&admin, &name).await?;
        sql::setup::create_database(&admin, &name)
            .await
            .context("cannot create the scratch database (the bench needs CREATEDB)")?;
        admin.close().await;
        let mut scratch_url = url::Url::parse(url).context("invalid database URL")?;
        scratch_url.set_path(&format!("/{name}"));
        let pool = crate::scratch::connect(scratch_url.as_str(), 16).await?;
        Ok(Self {
            url: scratch_url.to_string(),
            pool,
            admin_url: url.to_owned(),
            name,
        })
    }

    /// Drops the scratch database, its replication slots first.
    pub async fn drop_database(&self) {
        self.pool.close().await;
        if let Ok(admin) = crate::scratch::connect(&self.admin_url, 1).await {
            // A database with a replication slot cannot be dropped, and a slot left behind pins
            // WAL on the server for ever: the slots go first.
            if let Err(e) = drop_slots(&admin, &self.name).await {
                eprintln!(
                    "warning: {e:#}; drop them by hand (SELECT pg_drop_replication_slot(slot_name) \
                     FROM pg_replication_slots WHERE database = '{}'), they hold WAL back",
                    self.name
                );
            }
            let _ = sql::setup::drop_database_forced(&admin, &self.name).await;
        }
    }

    /// Drops and creates `name` as the article's minimal outbox table: an application's own table
    /// from before pgoutbox (the baseline's, and what `bench migrate` upgrades).
    pub async fn minimal_table(&self, name: &str) -> anyhow::Result<()> {
        let table = pgoutbox::OutboxTable::parse("public", name)?;
        sql::setup::replace_minimal_table(&self.pool, &table).await?;
        Ok(())
    }

    /// Drops and re-creates the outbox table (default name) with pgoutbox's schema.
    pub async fn fresh_outbox(&self) -> anyhow::Result<()> {
        sql::setup::drop_outbox(&self.pool).await?;
        pgoutbox::schema::migrate(&self.pool, &pgoutbox::OutboxTable::default_table()).await?;
        Ok(())
    }

    /// The default outbox table and the bench's slot and publication names. Slot names are the
    /// server's, not the database's: the slot is named after the scratch database, so that the
    /// default `pgoutbox_outbox` slot of a real relay on the same server is never in the way (nor
    /// touched); the publication (per database) keeps its default name.
    pub fn wal_names(&self) -> (pgoutbox::OutboxTable, pgoutbox::sources::wal::slot::Names) {
        let table = pgoutbox::OutboxTable::default_table();
        let wal = pgoutbox::config::WalConfig {
            slot: Some(self.name.clone()),
            ..Default::default()
        };
        let names = pgoutbox::sources::wal::slot::Names::of(&wal, &table);
        (table, names)
    }

    /// A fresh outbox table for a relay of `source`. Any slot and publication of an earlier run
    /// go first (an unread slot still pins WAL, and a publication of a dropped table publishes
    /// nothing); for `wal`, the publication and the relay's replication slot are then created, as
    /// `pgoutbox slot create` does (the relay never creates a slot).
    pub async fn fresh_source(&self, source: Source) -> anyhow::Result<()> {
        drop_slots(&self.pool, &self.name).await?;
        let (table, names) = self.wal_names();
        let publication = pgoutbox::Ident::parse(&names.publication)?.quoted();
        sql::setup::drop_publication(&self.pool, &publication).await?;
        self.fresh_outbox().await?;
        if source == Source::Wal {
            pgoutbox::sources::wal::slot::create(&self.pool, &table, &names)
                .await
                .with_context(|| {
                    format!(
                        "the WAL source's bench creates replication slot {} in the scratch database",
                        names.slot
                    )
                })?;
        }
        Ok(())
    }

    /// Inserts `n` rows server-side with `insert` (an INSERT … SELECT over
    /// `generate_series(1, $1)`), at most `chunk` rows per statement, with a progress bar.
    pub async fn generate(
        &self,
        insert: &str,
        n: u64,
        chunk: u64,
        label: &str,
        out: &Output,
    ) -> anyhow::Result<()> {
        let bar = out.bar(n, label);
        let mut done = 0;
        while done < n {
            let rows = (n - done).min(chunk);
            sql::load::insert_generated(&self.pool, insert, rows as i64).await?;
            done += rows;
            bar.set_position(done);
        }
        bar.finish_and_clear();
        Ok(())
    }

    /// Inserts `n` pending events server-side (one statement per 100k rows), with a progress bar.
    pub async fn prefill(&self, n: u64, out: &Output) -> anyhow::Result<()> {
        self.generate(sql::load::PREFILL, n, 100_000, "prefill", out)
            .await?;
        sql::setup::vacuum_analyze(&self.pool, "outbox").await?;
        Ok(())
    }

    /// Waits until no row is pending, moving `bar` from the table statistics. Polling must not
    /// cost the relay being measured: an EXISTS probe every 20 ms (the first pending index entry)
    /// and the statistics counters, never a count of the backlog.
    pub async fn wait_drained(&self, bar: &ProgressBar, total: u64) -> anyhow::Result<()> {
        let mut ticks = 0u32;
        loop {
            let pending = sql::watch::any_pending(&self.pool).await?;
            if !pending {
                bar.set_position(total);
                return Ok(());
            }
            ticks += 1;
            if ticks.is_multiple_of(25) {
                let settled = sql::watch::settled_rows(&self.pool).await?;
                bar.set_position((settled.unwrap_or(0).max(0) as u64).min(total));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Where the measured relay takes events from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Source {
    /// Claimed from the table (`source = "poll"`).
    Poll,
    /// Read from a logical replication slot (`source = "wal"`; needs wal_level = logical).
    Wal,
}

impl Source {
    /// Its name in the config.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Poll => "poll",
            Self::Wal => "wal",
        }
    }
}

/// Drops every replication slot of database `database`. A slot still streamed (a relay or
/// pg_recvlogical just killed, whose walsender has not noticed yet) has that session ended first.
/// A pool of `max_connections` to `url`, as the bench's own connections (the scratch database,
/// its admin connection, the console's reader) need: an unreachable server is an error at once,
/// naming the URL without its password.
pub async fn connect(url: &str, max_connections: u32) -> anyhow::Result<PgPool> {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(Duration::from_secs(3))
        .connect(url)
        .await
        .with_context(|| {
            format!(
                "cannot connect to the database at {}",
                pgoutbox::model::secrets::redact_url(url)
            )
        })
}

pub async fn drop_slots(pool: &PgPool, database: &str) -> anyhow::Result<()> {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        // Slots of the scratch database only: the server may hold others (never touched).
        let slots = sql::setup::replication_slots(pool, database).await?;
        if slots.is_empty() {
            return Ok(());
        }
        if std::time::Instant::now() > deadline {
            let names: Vec<String> = slots.into_iter().map(|(s, _)| s).collect();
            anyhow::bail!("cannot drop replication slots {}", names.join(", "));
        }
        for (slot, pid) in slots {
            // Errors are retried: the walsender may be ending, or another slot user racing.
            let _ = match pid {
                Some(pid) => sql::setup::terminate_backend(pool, pid).await,
                None => sql::setup::drop_replication_slot(pool, &slot).await,
            };
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
