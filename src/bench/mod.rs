//! `pgoutbox bench`: measures the relay on the user's own database and hardware.
//!
//! Every scenario works in a scratch database it creates (`pgoutbox_bench_<pid>`) on the configured
//! server and drops at the end. Results are a readable table on stdout (or JSON lines with
//! `--json`), each run headed by what matters to read them: PostgreSQL version, the settings that
//! move the numbers, and the cores.

mod baseline;
mod catchup;
mod console;
mod drain;
mod history;
mod migrate;
mod ordering;
mod produce;
mod soak;
mod steady;

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use pgoutbox::config::Config;
use serde::Serialize;
use serde_json::json;
use sqlx::{Executor, PgPool};

/// Arguments of `bench`.
#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(subcommand)]
    scenario: Scenario,
    /// Print JSON lines instead of a table.
    #[arg(long, global = true)]
    json: bool,
}

#[derive(Debug, clap::Subcommand)]
enum Scenario {
    /// Prefill N events, then time the relay draining them, per sink and settle mode; also runs
    /// sql-limit and baseline on the same data for comparison.
    Drain(drain::Args),
    /// The claim + settle statements back to back with no publishing: the ceiling.
    SqlLimit(drain::Args),
    /// The minimal design (10 per transaction, per-row UPDATE, no index, ORDER BY created_at).
    Baseline(baseline::Args),
    /// Producers commit single-event transactions at a target rate while the relay runs:
    /// commit→publish latency, relay CPU, and what the wake-up mechanism costs producers.
    Steady(steady::Args),
    /// A backlog read from a logical replication slot: the WAL relay (null sink) against
    /// pg_recvlogical on the same WAL (needs wal_level = logical).
    Catchup(catchup::Args),
    /// Claim cost with 0 vs many already-published rows retained.
    History(history::Args),
    /// The cost of per-key ordering: the same keyed backlog, several relays, ordered vs not.
    Ordering(ordering::Args),
    /// `migrate` upgrading a large minimal table in place while producers insert: how long the
    /// producers' INSERTs were blocked.
    Migrate(migrate::Args),
    /// A long steady load (5,000,000 events at 3,000/s by default) in keep mode with cleanup
    /// running, then in delete mode: every minute the claim p99, commit→publish p99, table and
    /// index sizes and dead tuples, to see whether anything grows or slows down over time.
    Soak(soak::Args),
    /// The operator console's page and API over a large outbox (1,000,000 rows): p50/p99/max per
    /// call and the indexes each used, before and after VACUUM ANALYZE.
    Console(console::Args),
    /// drain (null sink, both settle modes, with sql-limit and baseline), steady and history at
    /// reduced sizes: a quick tour.
    Quick,
    /// Producers in their own process (started by steady and soak).
    #[command(hide = true)]
    Produce(produce::Args),
}

impl Args {
    /// Whether this is the hidden producer scenario, which the other scenarios start.
    pub fn is_producer(&self) -> bool {
        matches!(self.scenario, Scenario::Produce(_))
    }
}

/// Runs the scenario `args` asks for; `load_config` gives the configuration (the command line's
/// layering of file, environment and flags), called only once the arguments are known to run.
pub async fn run(
    args: &Args,
    load_config: impl FnOnce() -> anyhow::Result<Config>,
) -> anyhow::Result<ExitCode> {
    if let Scenario::Produce(a) = &args.scenario {
        return produce::run(a).await.map(|()| ExitCode::SUCCESS);
    }
    // Argument combinations that cannot run are refused before a scratch database is made.
    if let Scenario::Steady(a) = &args.scenario {
        a.validate()?;
    }
    let config = load_config()?;
    let url = config
        .database_url
        .as_ref()
        .map(|s| s.0.clone())
        .unwrap_or_else(|| pgoutbox::config::DEFAULT_DATABASE_URL.to_owned());
    let scratch = Scratch::create(&url).await?;
    let out = Output { json: args.json };
    out.header(&scratch.pool).await?;
    let scenario = async {
        match &args.scenario {
            Scenario::Drain(a) => drain::run(&scratch, &out, a, true).await,
            Scenario::SqlLimit(a) => drain::sql_limit_only(&scratch, &out, a).await,
            Scenario::Baseline(a) => baseline::run(&scratch, &out, a).await,
            Scenario::Steady(a) => steady::run(&scratch, &out, a).await,
            Scenario::Catchup(a) => catchup::run(&scratch, &out, a).await,
            Scenario::History(a) => history::run(&scratch, &out, a).await,
            Scenario::Ordering(a) => ordering::run(&scratch, &out, a).await,
            Scenario::Migrate(a) => migrate::run(&scratch, &out, a).await,
            Scenario::Soak(a) => soak::run(&scratch, &out, a).await,
            Scenario::Console(a) => console::run(&scratch, &out, a).await,
            Scenario::Quick => quick(&scratch, &out).await,
            Scenario::Produce(_) => Ok(()),
        }
    };
    // An interrupted bench still stops its relay and producer processes (dropping the scenario
    // kills them) and drops its scratch database.
    let result = tokio::select! {
        result = scenario => result,
        signal = interrupted() => Err(anyhow::anyhow!("interrupted by {signal}; the scratch database is dropped")),
    };
    scratch.drop_database().await;
    result.map(|()| ExitCode::SUCCESS)
}

/// Resolves on the first SIGINT or SIGTERM with its name (never, if the handlers cannot be set).
async fn interrupted() -> &'static str {
    use tokio::signal::unix::{signal, SignalKind};
    match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) {
        (Ok(mut term), Ok(mut int)) => tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        },
        _ => std::future::pending().await,
    }
}

async fn quick(scratch: &Scratch, out: &Output) -> anyhow::Result<()> {
    drain::run(scratch, out, &drain::Args::quick(), true).await?;
    steady::run(scratch, out, &steady::Args::quick()).await?;
    ordering::run(scratch, out, &ordering::Args::quick()).await?;
    history::run(scratch, out, &history::Args::quick()).await
}

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
    async fn create(url: &str) -> anyhow::Result<Self> {
        let name = format!("pgoutbox_bench_{}", std::process::id());
        let admin = crate::connect::connect(url, 1).await?;
        admin
            .execute(format!("DROP DATABASE IF EXISTS {name}").as_str())
            .await?;
        admin
            .execute(format!("CREATE DATABASE {name}").as_str())
            .await
            .context("cannot create the scratch database (the bench needs CREATEDB)")?;
        admin.close().await;
        let mut scratch_url = url::Url::parse(url).context("invalid database URL")?;
        scratch_url.set_path(&format!("/{name}"));
        let pool = crate::connect::connect(scratch_url.as_str(), 16).await?;
        Ok(Self {
            url: scratch_url.to_string(),
            pool,
            admin_url: url.to_owned(),
            name,
        })
    }

    async fn drop_database(&self) {
        self.pool.close().await;
        if let Ok(admin) = crate::connect::connect(&self.admin_url, 1).await {
            // A database with a replication slot cannot be dropped, and a slot left behind pins
            // WAL on the server for ever: the slots go first.
            if let Err(e) = drop_slots(&admin, &self.name).await {
                eprintln!(
                    "warning: {e:#}; drop them by hand (SELECT pg_drop_replication_slot(slot_name) \
                     FROM pg_replication_slots WHERE database = '{}'), they hold WAL back",
                    self.name
                );
            }
            let _ = admin
                .execute(format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name).as_str())
                .await;
        }
    }

    /// Drops and creates `name` as the article's minimal outbox table: an application's own table
    /// from before pgoutbox (the baseline's, and what `bench migrate` upgrades).
    pub async fn minimal_table(&self, name: &str) -> anyhow::Result<()> {
        let table = pgoutbox::OutboxTable::parse("public", name)?;
        sqlx::raw_sql(&table.render("DROP TABLE IF EXISTS {outbox}"))
            .execute(&self.pool)
            .await?;
        sqlx::raw_sql(&table.render(pgoutbox::schema::MINIMAL_TABLE))
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Drops and re-creates the outbox table (default name) with pgoutbox's schema.
    pub async fn fresh_outbox(&self) -> anyhow::Result<()> {
        sqlx::raw_sql(
            "DROP TABLE IF EXISTS outbox, outbox_deliveries, outbox_held_batches, outbox_destinations, outbox_attempts, outbox_history, pgoutbox_migrations;",
        )
            .execute(&self.pool)
            .await?;
        pgoutbox::schema::migrate(&self.pool, &pgoutbox::OutboxTable::default_table()).await?;
        Ok(())
    }

    /// The default outbox table and the bench's slot and publication names. Slot names are the
    /// server's, not the database's: the slot is named after the scratch database, so that the
    /// default `pgoutbox_outbox` slot of a real relay on the same server is never in the way (nor
    /// touched); the publication (per database) keeps its default name.
    pub fn wal_names(&self) -> (pgoutbox::OutboxTable, pgoutbox::wal::slot::Names) {
        let table = pgoutbox::OutboxTable::default_table();
        let wal = pgoutbox::config::WalConfig {
            slot: Some(self.name.clone()),
            ..Default::default()
        };
        let names = pgoutbox::wal::slot::Names::of(&wal, &table);
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
        sqlx::raw_sql(&format!("DROP PUBLICATION IF EXISTS {publication}"))
            .execute(&self.pool)
            .await?;
        self.fresh_outbox().await?;
        if source == Source::Wal {
            pgoutbox::wal::slot::create(&self.pool, &table, &names)
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
            sqlx::query(insert)
                .bind(rows as i64)
                .execute(&self.pool)
                .await?;
            done += rows;
            bar.set_position(done);
        }
        bar.finish_and_clear();
        Ok(())
    }

    /// Inserts `n` pending events server-side (one statement per 100k rows), with a progress bar.
    pub async fn prefill(&self, n: u64, out: &Output) -> anyhow::Result<()> {
        self.generate(
            "INSERT INTO outbox (topic, payload)
             SELECT 'bench.event', jsonb_build_object('n', g, 'order_id', g % 1000, 'note', 'benchmark event payload')
             FROM generate_series(1, $1) g",
            n,
            100_000,
            "prefill",
            out,
        )
        .await?;
        sqlx::query("VACUUM ANALYZE outbox")
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Waits until no row is pending, moving `bar` from the table statistics. Polling must not
    /// cost the relay being measured: an EXISTS probe every 20 ms (the first pending index entry)
    /// and the statistics counters, never a count of the backlog.
    pub async fn wait_drained(&self, bar: &ProgressBar, total: u64) -> anyhow::Result<()> {
        let mut ticks = 0u32;
        loop {
            let pending: bool = sqlx::query_scalar(
                "SELECT EXISTS (SELECT 1 FROM outbox WHERE published_at IS NULL AND dead_at IS NULL)",
            )
            .fetch_one(&self.pool)
            .await?;
            if !pending {
                bar.set_position(total);
                return Ok(());
            }
            ticks += 1;
            if ticks.is_multiple_of(25) {
                let settled: Option<i64> = sqlx::query_scalar(
                    "SELECT (n_tup_upd + n_tup_del)::bigint FROM pg_stat_user_tables WHERE relname = 'outbox'",
                )
                .fetch_optional(&self.pool)
                .await?;
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
pub async fn drop_slots(pool: &PgPool, database: &str) -> anyhow::Result<()> {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        // Slots of the scratch database only: the server may hold others (never touched).
        let slots: Vec<(String, Option<i32>)> = sqlx::query_as(
            "SELECT slot_name::text, active_pid FROM pg_replication_slots WHERE database::text = $1",
        )
        .bind(database)
        .fetch_all(pool)
        .await?;
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
                Some(pid) => sqlx::query("SELECT pg_terminate_backend($1)")
                    .bind(pid)
                    .execute(pool)
                    .await
                    .map(|_| ()),
                None => sqlx::query("SELECT pg_drop_replication_slot($1)")
                    .bind(&slot)
                    .execute(pool)
                    .await
                    .map(|_| ()),
            };
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Where results go: a table on stdout, or JSON lines.
pub struct Output {
    json: bool,
}

/// One result line.
#[derive(Debug, Serialize)]
pub struct Row {
    /// Scenario name.
    pub scenario: String,
    /// Variant (sink, settle mode, …).
    pub variant: String,
    /// The headline figure.
    pub value: f64,
    /// Its unit.
    pub unit: &'static str,
    /// Anything else worth printing.
    pub detail: String,
}

impl Output {
    async fn header(&self, pool: &PgPool) -> anyhow::Result<()> {
        let version: String = sqlx::query_scalar("SHOW server_version")
            .fetch_one(pool)
            .await?;
        let sync: String = sqlx::query_scalar("SHOW synchronous_commit")
            .fetch_one(pool)
            .await?;
        let buffers: String = sqlx::query_scalar("SHOW shared_buffers")
            .fetch_one(pool)
            .await?;
        let fsync: String = sqlx::query_scalar("SHOW fsync").fetch_one(pool).await?;
        let cores = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1);
        if self.json {
            println!(
                "{}",
                json!({"postgres": version, "synchronous_commit": sync, "shared_buffers": buffers, "fsync": fsync, "cores": cores, "pgoutbox": env!("CARGO_PKG_VERSION")})
            );
        } else {
            println!(
                "pgoutbox {} bench — PostgreSQL {version}, synchronous_commit={sync}, fsync={fsync}, shared_buffers={buffers}, {cores} cores",
                env!("CARGO_PKG_VERSION")
            );
            println!(
                "{:<12} {:<40} {:>16}  DETAIL",
                "SCENARIO", "VARIANT", "RESULT"
            );
        }
        Ok(())
    }

    /// Prints one result line.
    pub fn row(&self, row: Row) {
        if self.json {
            println!("{}", serde_json::to_string(&row).unwrap_or_default());
        } else {
            let value = if row.value >= 100.0 {
                format!("{:.0}", row.value)
            } else {
                format!("{:.2}", row.value)
            };
            println!(
                "{:<12} {:<40} {:>16}  {}",
                row.scenario,
                row.variant,
                format!("{value} {}", row.unit),
                row.detail
            );
        }
    }

    /// A progress bar on stderr (hidden when stderr is not a terminal).
    pub fn bar(&self, len: u64, label: &str) -> ProgressBar {
        let bar = ProgressBar::new(len);
        bar.set_style(
            ProgressStyle::with_template("{prefix:>10} [{bar:40}] {pos}/{len} {per_sec} {eta}")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        bar.set_prefix(label.to_owned());
        bar
    }
}

/// Events per second.
pub fn rate(events: u64, elapsed: Duration) -> f64 {
    events as f64 / elapsed.as_secs_f64().max(1e-9)
}

/// Claims one batch (transaction mode, unordered) and settles all of it as delivered: the relay's
/// statements with a sink that accepts everything instantly. Returns the events settled (0 when
/// nothing was due) and how long the claim statement took.
pub async fn claim_and_settle(
    pool: &PgPool,
    table: &pgoutbox::OutboxTable,
    batch_size: usize,
    settle: pgoutbox::settle::SettleMode,
) -> anyhow::Result<(usize, Duration)> {
    let options = pgoutbox::claim::ClaimOptions {
        mode: pgoutbox::config::ClaimMode::Transaction,
        limit: batch_size,
        lease: Duration::from_secs(60),
        ordered: false,
        heads: batch_size,
        followers: 0,
        window: u64::MAX,
    };
    let started = std::time::Instant::now();
    let batch = pgoutbox::claim::claim_due(pool, table, &options, &[]).await?;
    let claim_time = started.elapsed();
    if batch.events.is_empty() {
        pgoutbox::claim::release(pool, table, batch.hold, &[]).await?;
        return Ok((0, claim_time));
    }
    let policy = pgoutbox::retry::RetryPolicy::default();
    let delivered = pgoutbox::publish::Outcome::Delivered;
    let plan = pgoutbox::settle::plan(
        batch
            .events
            .iter()
            .map(|e| (e, Some(("bench", &policy)), &delivered)),
        chrono::Utc::now(),
        &mut rand::thread_rng(),
    );
    pgoutbox::settle::apply(table, pool, batch.hold, &plan, settle, &[], None).await?;
    Ok((batch.events.len(), claim_time))
}
