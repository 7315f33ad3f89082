//! `bench drain` and `bench sql-limit`: how fast a prefilled backlog drains, against the ceiling.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pgoutbox::config::Config;
use pgoutbox::engine::Relay;
use pgoutbox::store::SettleMode;
use tokio_util::sync::CancellationToken;

use super::claim_settle::{claim_and_settle, relay};
use super::output::{rate, Output, Row};
use super::receiver::Receiver;
use super::scratch::Scratch;
use super::scratch_queue::ScratchQueue;
use super::sql;

/// Arguments of `bench drain` / `bench sql-limit`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Events prefilled for each run.
    #[arg(long, default_value_t = 1_000_000)]
    pub events: u64,
    /// Sinks to drain to (null, stdout, webhook, nats: JetStream on --nats-url, sqs: a scratch
    /// queue on --sqs-endpoint, with the `sqs` feature).
    #[arg(long, value_delimiter = ',', default_value = "null,stdout,webhook")]
    pub sinks: Vec<String>,
    /// Settle modes (keep = set published_at, delete = retention 0, partitions = keep in the
    /// partitioned history).
    #[arg(long, value_delimiter = ',', default_value = "delete,keep")]
    pub settle: Vec<String>,
    /// Fan-out layouts, each drained in turn: N destinations taking every event (1, 2, 3…), or
    /// N-down: N destinations of which one has its circuit breaker open (its pairs are held).
    /// Layouts other than 1 use the null sink.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    pub destinations: Vec<Layout>,
    /// Rows per claim.
    #[arg(long, default_value_t = 1000)]
    pub batch_size: usize,
    /// Claim loops.
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// Skip the baseline comparison.
    #[arg(long)]
    pub no_baseline: bool,
    /// NATS server for the `nats` sink (a scratch stream is created and deleted).
    #[arg(long, default_value = "nats://127.0.0.1:4222")]
    pub nats_url: String,
    /// SQS endpoint for the `sqs` sink (a scratch queue is made and deleted): a local emulator
    /// by default; credentials from the AWS SDK's chain.
    #[arg(long, default_value = "http://127.0.0.1:5055")]
    pub sqs_endpoint: String,
}

impl Args {
    /// Small sizes for `bench quick` and the CI smoke test.
    pub fn quick() -> Self {
        Self {
            events: 50_000,
            sinks: vec!["null".into()],
            settle: vec!["delete".into(), "keep".into()],
            destinations: vec![Layout::default()],
            batch_size: 1000,
            workers: 2,
            no_baseline: false,
            nats_url: "nats://127.0.0.1:4222".into(),
            sqs_endpoint: "http://127.0.0.1:5055".into(),
        }
    }
}

/// Runs `bench sql-limit`: the claim + settle ceiling alone, per settle mode.
pub async fn sql_limit_only(scratch: &Scratch, out: &Output, args: &Args) -> anyhow::Result<()> {
    for mode in &args.settle {
        let settle = settle_mode(mode)?;
        let r = sql_limit(scratch, out, args, settle).await?;
        out.row(ceiling_row(args, mode, r));
    }
    Ok(())
}

/// Runs `bench drain`: per settle mode the ceiling, then the relay per sink and layout; with
/// `compare`, the baseline on the same number of events (at most 200,000) too.
pub async fn run(
    scratch: &Scratch,
    out: &Output,
    args: &Args,
    compare: bool,
) -> anyhow::Result<()> {
    for mode in &args.settle {
        let settle = settle_mode(mode)?;
        let ceiling = sql_limit(scratch, out, args, settle).await?;
        out.row(ceiling_row(args, mode, ceiling));
        for sink in &args.sinks {
            for layout in &args.destinations {
                if layout.fans_out() && sink != "null" {
                    anyhow::bail!("--destinations {layout} needs the null sink, not {sink:?}");
                }
                let r = drain(scratch, out, args, settle, sink, layout).await?;
                out.row(Row {
                    scenario: "drain".into(),
                    variant: match layout.fans_out() {
                        false => format!("{sink}, {mode}"),
                        true => format!("{sink} ×{layout}, {mode}"),
                    },
                    value: r,
                    unit: "ev/s",
                    detail: format!("{:.0} % of sql-limit ({mode})", r / ceiling * 100.0),
                });
            }
        }
    }
    if compare && !args.no_baseline {
        let base = super::baseline::measure(
            scratch,
            out,
            args.events.min(200_000),
            Duration::from_secs(10),
        )
        .await?;
        out.row(Row {
            scenario: "baseline".into(),
            variant: "minimal design, 10/tx, per-row UPDATE".into(),
            value: base,
            unit: "ev/s",
            detail: "no index, ORDER BY created_at, 10 s sample".into(),
        });
    }
    Ok(())
}

/// A fan-out layout for `bench drain`: how many destinations take every event, and whether one of
/// them is down (its breaker open, so its pairs are held in the deliveries table).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// Destinations taking every event.
    pub destinations: usize,
    /// One of them has its breaker open.
    pub one_down: bool,
}

impl Default for Layout {
    fn default() -> Self {
        Self {
            destinations: 1,
            one_down: false,
        }
    }
}

impl Layout {
    fn fans_out(&self) -> bool {
        self.destinations > 1 || self.one_down
    }
}

impl std::fmt::Display for Layout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.destinations)?;
        if self.one_down {
            f.write_str("-down")?;
        }
        Ok(())
    }
}

impl std::str::FromStr for Layout {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (n, one_down) = match s.strip_suffix("-down") {
            Some(n) => (n, true),
            None => (s, false),
        };
        let destinations: usize = n
            .parse()
            .map_err(|_| format!("{s:?} is not a layout: use N or N-down (e.g. 3, 3-down)"))?;
        if destinations == 0 || (one_down && destinations < 2) {
            return Err(format!(
                "{s:?}: N-down needs at least 2 destinations, N at least 1"
            ));
        }
        Ok(Self {
            destinations,
            one_down,
        })
    }
}

/// The row of the ceiling (`sql-limit`) in settle mode `mode`: `rate` events a second.
fn ceiling_row(args: &Args, mode: &str, rate: f64) -> Row {
    Row {
        scenario: "sql-limit".into(),
        variant: format!("{mode}, batch {}", args.batch_size),
        value: rate,
        unit: "ev/s",
        detail: format!(
            "{} events, {} workers: claim and settle, nothing to publish",
            args.events, args.workers
        ),
    }
}

fn settle_mode(mode: &str) -> anyhow::Result<SettleMode> {
    match mode {
        "delete" => Ok(SettleMode::Delete),
        "keep" => Ok(SettleMode::Mark),
        "partitions" => Ok(SettleMode::Move),
        other => anyhow::bail!("unknown settle mode {other:?}: use keep, delete or partitions"),
    }
}

/// Batches claimed and settled back to back, with a destination that accepts everything at
/// once; returns events/s.
async fn sql_limit(
    scratch: &Scratch,
    out: &Output,
    args: &Args,
    settle: SettleMode,
) -> anyhow::Result<f64> {
    scratch.fresh_outbox().await?;
    scratch.prefill(args.events, out).await?;
    let relay = Arc::new(relay(scratch.pool.clone(), args.batch_size, settle)?);
    // The history's partitions, as the relay makes them at start-up.
    relay.prepare().await;
    let done = Arc::new(AtomicU64::new(0));
    let bar = out.bar(args.events, "sql-limit");
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..args.workers {
        let relay = Arc::clone(&relay);
        let done = done.clone();
        tasks.push(tokio::spawn(async move {
            loop {
                let (n, _) = claim_and_settle(&relay).await?;
                if n == 0 {
                    return Ok::<_, anyhow::Error>(());
                }
                done.fetch_add(n as u64, Ordering::Relaxed);
            }
        }));
    }
    let ticker = tick(bar.clone(), done.clone());
    for t in tasks {
        t.await??;
    }
    let elapsed = started.elapsed();
    ticker.abort();
    bar.finish_and_clear();
    Ok(rate(done.load(Ordering::Relaxed), elapsed))
}

fn tick(bar: indicatif::ProgressBar, done: Arc<AtomicU64>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            bar.set_position(done.load(Ordering::Relaxed));
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
}

/// The relay draining the prefilled backlog to `sink`; returns events/s.
async fn drain(
    scratch: &Scratch,
    out: &Output,
    args: &Args,
    settle: SettleMode,
    sink: &str,
    layout: &Layout,
) -> anyhow::Result<f64> {
    scratch.fresh_outbox().await?;
    scratch.prefill(args.events, out).await?;
    let receiver = match sink {
        "webhook" => Some(Receiver::start().await?),
        _ => None,
    };
    let queue = match sink {
        "sqs" => Some(ScratchQueue::create(&args.sqs_endpoint).await?),
        _ => None,
    };
    let destination = match sink {
        "null" => "type = \"null\"".to_owned(),
        "stdout" => "type = \"null\"".to_owned(), // replaced below by a stdout sink writing to /dev/null
        "webhook" => format!(
            "type = \"webhook\"\nurl = \"{}\"\nconcurrency = 128",
            receiver
                .as_ref()
                .map(|r| r.url.as_str())
                .unwrap_or_default()
        ),
        "nats" => {
            let id = std::process::id();
            format!(
                "type = \"nats\"\nurl = \"{}\"\nsubject = \"pgoutbox-bench-{id}.{{topic}}\"\ncreate_stream = true\nstream = \"PGOUTBOX_BENCH_{id}\"\nsubjects = [\"pgoutbox-bench-{id}.>\"]\n",
                args.nats_url
            )
        }
        "sqs" => queue
            .as_ref()
            .map(ScratchQueue::settings)
            .unwrap_or_default(),
        other => {
            anyhow::bail!("unknown bench sink {other:?}: use null, stdout, webhook, nats or sqs")
        }
    };
    let mut text = format!(
        "retention = \"{}\"\nhistory = \"{}\"\n[relay]\nbatch_size = {}\nworkers = {}\n[[destinations]]\nname = \"{sink}\"\n{destination}\n",
        if settle == SettleMode::Delete { "0s" } else { "7d" },
        if settle == SettleMode::Move { "partitions" } else { "outbox" },
        args.batch_size,
        args.workers
    );
    for n in 2..=layout.destinations {
        text.push_str(&format!(
            "[[destinations]]\nname = \"{sink}-{n}\"\n{destination}\n"
        ));
    }
    if layout.one_down {
        // The last destination is down: its breaker is open, with no probe before the run ends.
        sql::load::open_breaker(&scratch.pool, &format!("{sink}-{}", layout.destinations)).await?;
    }
    let config = Config::parse(&text, |_| None)?;
    let relay = if sink == "stdout" {
        let devnull = tokio::fs::OpenOptions::new()
            .write(true)
            .open("/dev/null")
            .await?;
        let sink = Arc::new(pgoutbox::sinks::StdoutSink::to_writer(devnull));
        Relay::with_destinations(
            scratch.pool.clone(),
            &config,
            vec![pgoutbox::engine::Destination {
                name: "stdout".into(),
                sink,
                retry: Default::default(),
            }],
        )
    } else {
        Relay::new(scratch.pool.clone(), &config)?
    };
    let relay = Arc::new(relay);
    let bar = out.bar(args.events, &format!("drain {sink}"));
    let stop = CancellationToken::new();
    let started = Instant::now();
    let task = tokio::spawn(Arc::clone(&relay).run(stop.clone()));
    scratch.wait_drained(&bar, args.events).await?;
    let elapsed = started.elapsed();
    stop.cancel();
    task.await??;
    bar.finish_and_clear();
    if sink == "nats" {
        delete_nats_stream(&args.nats_url).await;
    }
    if let Some(queue) = queue {
        queue.delete().await;
    }
    Ok(rate(args.events, elapsed))
}

/// Deletes the scratch JetStream stream of a `nats` drain.
async fn delete_nats_stream(url: &str) {
    #[cfg(feature = "nats")]
    if let Ok(client) = async_nats::connect(url).await {
        let _ = async_nats::jetstream::new(client)
            .delete_stream(format!("PGOUTBOX_BENCH_{}", std::process::id()))
            .await;
    }
    #[cfg(not(feature = "nats"))]
    let _ = url;
}
