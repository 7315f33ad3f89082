//! `pgoutbox bench`: measures the relay on the user's own database and hardware.
//!
//! Every scenario works in a scratch database it creates (`pgoutbox_bench_<pid>`) on the configured
//! server and drops at the end. Results are a readable table on stdout (or JSON lines with
//! `--json`), each run headed by what matters to read them: PostgreSQL version, the settings that
//! move the numbers, and the cores.
//!
//! This file is the subcommand and its dispatch; only the command line (`cli`) imports it. The
//! scenarios sit below it, one file or folder each (`drain` also runs `baseline`'s measurement for
//! comparison), and take what they share from files below them, never from this one: the relay as
//! a child process and /proc readings (`process`), the producer process (`produce` is its child
//! side, `producer` the parent's), the webhook `receiver`, commit→publish `latency`, the relay's
//! Prometheus `metrics`, the `checkpoints` watch, `recvlogical`, `claim_settle`, the scratch
//! database (`scratch`), rows and progress bars (`output`) and, at the bottom, `sql`: every
//! statement the bench runs. Imports among them point one way; no two files import each other.

// The scenarios, one per subcommand.
mod baseline;
mod catchup;
mod console;
mod destinations;
mod drain;
mod fairness;
mod history;
mod memory;
mod migrate;
mod ordering;
mod produce;
mod rate_limit;
mod replay;
mod routing;
mod soak;
mod steady;

// What the scenarios share.
mod checkpoints;
mod claim_settle;
mod latency;
mod metrics;
mod output;
mod process;
mod producer;
mod receiver;
mod recvlogical;
mod scratch;
mod scratch_queue;
mod sql;

use std::process::ExitCode;

use pgoutbox::config::Config;

use output::Output;
use scratch::Scratch;

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
    /// Batches claimed and settled back to back, with nothing to publish: the ceiling.
    SqlLimit(drain::Args),
    /// The minimal design (10 per transaction, per-row UPDATE, no index, ORDER BY created_at).
    Baseline(baseline::Args),
    /// Producers commit single-event transactions at a target rate while the relay runs:
    /// commit→publish latency, relay CPU, and what the wake-up mechanism costs producers.
    Steady(steady::Args),
    /// A backlog read from a logical replication slot: the WAL relay (null sink) against
    /// pg_recvlogical on the same WAL (needs wal_level = logical).
    Catchup(catchup::Args),
    /// The relay's resident memory with one of two destinations down: a backlog due (1,000,000
    /// by default, poll and WAL), optionally producers at a rate for a long time (`--rate 3000
    /// --duration 1h`).
    Memory(memory::Args),
    /// A batch's cost (claim and settle, nothing to publish) with 0 vs many already-published
    /// rows retained.
    History(history::Args),
    /// The rate a receiver sees from a destination with `rate_limit` (200/s by default), served
    /// by 1 and by 4 relays over a backlog: events/s per 10 s window and the error.
    RateLimit(rate_limit::Args),
    /// A replay of 1,000,000 retained events beside 3,000 live events/s: the live p99 with and
    /// without it, the replay's rate, per-key order (`--ordered`), a relay killed half-way.
    Replay(replay::Args),
    /// What one relay costs as its destinations grow (webhooks, one topic each): start → ready,
    /// idle CPU and transactions, connections, memory, the /metrics scrape, and a spread drain.
    Destinations(destinations::Args),
    /// Whether failing, hanging and backlogged destinations cost the healthy ones anything: 10,000
    /// webhooks at a steady 1,000 events/s, the healthy ones' commit→delivery p99 with 1 % of them
    /// failing and a 1,000,000-pair backlog against without.
    Fairness(fairness::Args),
    /// What routing one event costs as destinations grow (1 to 100,000, each on its own topic,
    /// some with globs and filters): the relay's router alone, no database read.
    Routing(routing::Args),
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
    match &args.scenario {
        Scenario::Steady(a) => a.validate()?,
        Scenario::Fairness(a) => a.validate()?,
        _ => {}
    }
    let config = load_config()?;
    let url = config
        .database_url
        .as_ref()
        .map(|s| s.0.clone())
        .unwrap_or_else(|| pgoutbox::config::DEFAULT_DATABASE_URL.to_owned());
    let scratch = Scratch::create(&url).await?;
    let out = Output::new(args.json);
    out.header(&scratch.pool).await?;
    let scenario = async {
        match &args.scenario {
            Scenario::Drain(a) => drain::run(&scratch, &out, a, true).await,
            Scenario::SqlLimit(a) => drain::sql_limit_only(&scratch, &out, a).await,
            Scenario::Baseline(a) => baseline::run(&scratch, &out, a).await,
            Scenario::Steady(a) => steady::run(&scratch, &out, a).await,
            Scenario::Catchup(a) => catchup::run(&scratch, &out, a).await,
            Scenario::Memory(a) => memory::run(&scratch, &out, a).await,
            Scenario::History(a) => history::run(&scratch, &out, a).await,
            Scenario::RateLimit(a) => rate_limit::run(&scratch, &out, a).await,
            Scenario::Replay(a) => replay::run(&scratch, &out, a).await,
            Scenario::Ordering(a) => ordering::run(&scratch, &out, a).await,
            Scenario::Routing(a) => routing::run(&out, a).await,
            Scenario::Destinations(a) => destinations::run(&scratch, &out, a).await,
            Scenario::Fairness(a) => fairness::run(&scratch, &out, a).await,
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
