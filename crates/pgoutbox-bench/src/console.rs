//! `bench console`: how fast the console's page and API answer over a large outbox (1,000,000
//! rows by default: published history, pending and dead events over several topics, keys and
//! destinations). Each call is made `--requests` times over HTTP against the console served in
//! this process; p50, p99 and max per call, and which indexes each call used (from
//! `pg_stat_user_indexes`, read before and after it; "seq scan" when a table was read whole).
//!
//! Run twice: right after the load with no statistics (what a server with autovacuum off shows
//! until someone runs ANALYZE), then after `VACUUM ANALYZE` (what autovacuum, on by default and
//! tuned on the outbox by its migration, keeps it at).

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::output::{Output, Row};
use super::scratch::Scratch;
use super::sql;

/// Arguments of `bench console`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Rows in the outbox: 99 % published, 0.5 % pending, 0.5 % dead.
    #[arg(long, default_value_t = 1_000_000)]
    rows: u64,
    /// Requests per call measured.
    #[arg(long, default_value_t = 200)]
    requests: usize,
}

const DESTINATIONS: [&str; 3] = ["billing", "crm", "audit"];

/// Runs `bench console`: loads the outbox, then times each call with no statistics and after
/// VACUUM ANALYZE.
pub async fn run(scratch: &Scratch, out: &Output, args: &Args) -> anyhow::Result<()> {
    scratch.fresh_outbox().await?;
    let dead = (args.rows / 200).max(1);
    let pending = (args.rows / 200).max(1);
    let published = args.rows.saturating_sub(dead + pending);
    // Topics t0..t19, keys k0..k9999, destinations by topic: what a shop's outbox looks like.
    scratch
        .generate(
            sql::load::CONSOLE_PUBLISHED,
            published,
            200_000,
            "published",
            out,
        )
        .await?;
    scratch
        .generate(sql::load::CONSOLE_DEAD, dead, 200_000, "dead", out)
        .await?;
    scratch
        .generate(sql::load::CONSOLE_PENDING, pending, 200_000, "pending", out)
        .await?;

    let mut text = String::from("database_url = \"unused\"\n");
    for d in DESTINATIONS {
        text.push_str(&format!(
            "[[destinations]]\nname = \"{d}\"\ntype = \"null\"\ntopics = [\"order.*\"]\n"
        ));
    }
    let config = pgoutbox::config::Config::parse(&text, |_| None)?;
    // The console gets one connection of its own: its statistics are flushed on demand (below),
    // so each call's index use is read exactly.
    let console_pool = crate::scratch::connect(&scratch.url, 1).await?;
    let relay = Arc::new(pgoutbox::engine::Relay::new(console_pool.clone(), &config)?);
    let admin: pgoutbox::config::AdminConfig = toml::from_str("token = \"bench\"")?;
    let console = pgoutbox::server::console::Console::new(
        relay,
        Arc::new(pgoutbox::server::Samples::default()),
        &admin,
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    let server = tokio::spawn(async move {
        let _ = axum::serve(listener, pgoutbox::server::console::router(console)).await;
    });

    let some_dead = sql::watch::some_dead_event(&scratch.pool).await?;
    let client = reqwest::Client::new();
    // Keyset pages cost the same at any depth: the second page stands for all of them.
    let next = |url: String| {
        let client = client.clone();
        async move {
            let page: serde_json::Value = client.get(&url).send().await?.json().await?;
            let cursor = page["next_cursor"].as_str().unwrap_or_default().to_owned();
            anyhow::Ok(format!("{url}&cursor={cursor}"))
        }
    };
    let dead_page_2 = next(format!("{base}/api/v1/events?state=dead")).await?;
    let published_page_2 = next(format!("{base}/api/v1/events?state=published")).await?;
    let calls: Vec<(&str, String, Option<serde_json::Value>)> = vec![
        ("page /", format!("{base}/"), None),
        ("overview", format!("{base}/api/v1/overview"), None),
        (
            "dead, first page",
            format!("{base}/api/v1/events?state=dead"),
            None,
        ),
        (
            "dead, one topic",
            format!("{base}/api/v1/events?state=dead&topic=order.t7"),
            None,
        ),
        ("dead, next page", dead_page_2, None),
        ("published, next page", published_page_2, None),
        (
            "published, one topic",
            format!("{base}/api/v1/events?state=published&topic=order.t3"),
            None,
        ),
        (
            "pending, one destination",
            format!("{base}/api/v1/events?state=pending&destination=crm"),
            None,
        ),
        (
            "one event",
            format!("{base}/api/v1/events/{some_dead}"),
            None,
        ),
        (
            "dead, counted (total=true)",
            format!("{base}/api/v1/events?state=dead&total=true"),
            None,
        ),
        (
            "dead, topic prefix, counted",
            format!("{base}/api/v1/events?state=dead&topic_prefix=order.t1&total=true"),
            None,
        ),
        (
            "dead, payload contains",
            format!("{base}/api/v1/events?state=dead&payload=%7B%22n%22%3A42%7D"),
            None,
        ),
        (
            "published, topic prefix",
            format!("{base}/api/v1/events?state=published&topic_prefix=order.t1"),
            None,
        ),
        (
            "published, counted (total=true)",
            format!("{base}/api/v1/events?state=published&total=true"),
            None,
        ),
        (
            "published, payload contains (no GIN index)",
            format!("{base}/api/v1/events?state=published&payload=%7B%22total%22%3A5%7D"),
            None,
        ),
        ("audit log", format!("{base}/api/v1/audit"), None),
        ("chart samples", format!("{base}/api/v1/samples"), None),
        (
            "dead retry, dry run by topic",
            format!("{base}/api/v1/dead/retry"),
            Some(serde_json::json!({ "topic": "order.t7", "dry_run": true })),
        ),
    ];
    for phase in ["no statistics", "after VACUUM ANALYZE"] {
        if phase != "no statistics" {
            sql::setup::vacuum_analyze(&scratch.pool, "outbox").await?;
        }
        for (name, url, body) in &calls {
            let before = index_use(scratch, &console_pool).await?;
            let requests = args.requests.max(1);
            let mut times = Vec::with_capacity(requests);
            for _ in 0..requests {
                let started = Instant::now();
                let req = match body {
                    Some(b) => client.post(url).bearer_auth("bench").json(b),
                    None => client.get(url),
                };
                let resp = req.send().await?;
                let status = resp.status();
                resp.bytes().await?;
                anyhow::ensure!(status.is_success(), "{name}: HTTP {status}");
                times.push(started.elapsed());
            }
            let after = index_use(scratch, &console_pool).await?;
            let used: Vec<String> = after
                .iter()
                .filter(|(k, v)| before.get(*k).is_some_and(|b| *v > b))
                .map(|(k, _)| k.clone())
                .collect();
            times.sort();
            let pct = |p: f64| times[((times.len() as f64 * p) as usize).min(times.len() - 1)];
            let ms = |d: Duration| d.as_secs_f64() * 1000.0;
            out.row(Row {
                scenario: "console".into(),
                variant: format!("{name} ({phase})"),
                value: ms(pct(0.99)),
                unit: "ms p99",
                detail: format!(
                    "p50 {:.1} ms, max {:.1} ms over {} requests, {} rows; used: {}",
                    ms(pct(0.5)),
                    ms(times[times.len() - 1]),
                    times.len(),
                    args.rows,
                    if used.is_empty() {
                        "no table".into()
                    } else {
                        used.join(", ")
                    }
                ),
            });
        }
    }
    server.abort();
    Ok(())
}

/// Index scans per index and sequential scans per table of the outbox's tables, as counted by
/// PostgreSQL (`idx_scan`, `seq_scan`), once the console's connection has flushed its counters.
async fn index_use(
    scratch: &Scratch,
    console: &sqlx::PgPool,
) -> anyhow::Result<std::collections::BTreeMap<String, i64>> {
    sql::watch::flush_stats(console).await?;
    let rows = sql::watch::index_use(&scratch.pool).await?;
    Ok(rows.into_iter().collect())
}
