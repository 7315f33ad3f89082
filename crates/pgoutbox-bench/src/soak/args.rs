//! The flags of `bench soak`: how many events at what rate, which settle modes, the retention and
//! cleanup of keep mode, how often a line is printed, and where the CSV and the plot go.

use std::path::PathBuf;
use std::time::Duration;

/// Arguments of `bench soak`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Events per mode.
    #[arg(long, default_value_t = 5_000_000)]
    pub(super) events: u64,
    /// Commits per second, all producers together.
    #[arg(long, default_value_t = 3000)]
    pub(super) rate: u64,
    /// Producer connections.
    #[arg(long, default_value_t = 8)]
    pub(super) producers: usize,
    /// Settle modes to run, in order: keep (published_at, with cleanup), delete, partitions (kept
    /// in the partitioned history, partitions dropped by cleanup).
    #[arg(long, value_delimiter = ',', default_value = "keep,delete")]
    pub(super) modes: Vec<String>,
    /// Keep mode: published rows older than this are deleted by cleanup.
    #[arg(long, default_value = "5m", value_parser = pgoutbox::config::parse_duration)]
    pub(super) retention: Duration,
    /// Keep mode: how often cleanup runs.
    #[arg(long, default_value = "1m", value_parser = pgoutbox::config::parse_duration)]
    pub(super) cleanup_interval: Duration,
    /// How often a line is printed.
    #[arg(long, default_value = "60s", value_parser = pgoutbox::config::parse_duration)]
    pub(super) every: Duration,
    /// Write every interval's figures to this CSV file.
    #[arg(long)]
    pub(super) csv: Option<PathBuf>,
    /// Draw the curves into this SVG file.
    #[arg(long)]
    pub(super) plot: Option<PathBuf>,
    /// Hold a REPEATABLE READ transaction open this long in each mode (a long report or a
    /// forgotten session): vacuum cannot remove what it might still see.
    #[arg(long, value_parser = pgoutbox::config::parse_duration)]
    pub(super) hold_xmin: Option<Duration>,
    /// When the held transaction begins, after the mode's start.
    #[arg(long, default_value = "2m", value_parser = pgoutbox::config::parse_duration)]
    pub(super) hold_xmin_at: Duration,
}
