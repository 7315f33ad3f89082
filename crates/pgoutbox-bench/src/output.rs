//! Where results go: one line per result, as a table on stdout or as JSON lines (`--json`),
//! headed by what matters to read them; progress bars on stderr.

use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use serde_json::json;
use sqlx::PgPool;

use super::sql;

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
    /// Rows as a table, or as JSON lines when `json`.
    pub fn new(json: bool) -> Self {
        Self { json }
    }

    /// Prints the run's header: the server's version and the settings that move the numbers.
    pub async fn header(&self, pool: &PgPool) -> anyhow::Result<()> {
        let (version, sync, buffers, fsync) = sql::watch::settings(pool).await?;
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
