//! What a soak reports: one line per interval, the verdict lines at the end of each mode (p99
//! drift, size growth after the first retention period), the CSV file and the SVG plot.

use std::fmt::Write as _;

use super::args::Args;
use super::machine::Machine;
use crate::latency::Summary;
use crate::output::{Output, Row};

/// One interval's figures.
#[derive(Debug, Clone)]
pub struct Sample {
    /// Settle mode (keep, delete, partitions).
    pub(super) mode: String,
    /// Minutes since the mode's start, at the interval's end.
    pub(super) minute: f64,
    /// Events delivered (committed and received) in the interval.
    pub(super) delivered: usize,
    /// The relay's claim p99 in the interval (a bucket bound), when it claimed.
    pub(super) claim_p99_ms: Option<f64>,
    /// Commit→publish percentiles of the interval's events.
    pub(super) latency: Summary,
    /// Heap size of the outbox and its history's partitions, MB.
    pub(super) table_mb: f64,
    /// Their indexes, MB.
    pub(super) indexes_mb: f64,
    /// Dead tuples, from the statistics.
    pub(super) dead_tuples: i64,
    /// Live tuples, from the statistics.
    pub(super) live_tuples: i64,
    /// What the machine and the relay did in the interval.
    pub(super) machine: Machine,
}

/// One interval's line.
pub fn row(s: &Sample) -> Row {
    Row {
        scenario: "soak".into(),
        variant: format!("{} minute {:>5.1}", s.mode, s.minute),
        value: s.latency.p99,
        unit: "ms p99",
        detail: format!(
            "claim p99 {}, max {:.1} ms, {} delivered; table {:.0} MB + indexes {:.0} MB, {} live, {} dead tuples; CPU {:.0} % busy, {:.1} % stolen, relay {:.0} % of a core, {:.0} MiB; {} checkpoints, {} vacuums",
            s.claim_p99_ms
                .map_or("n/a".to_owned(), |ms| format!("≤ {ms} ms")),
            s.latency.max,
            s.delivered,
            s.table_mb,
            s.indexes_mb,
            s.live_tuples,
            s.dead_tuples,
            s.machine.busy_pct,
            s.machine.steal_pct,
            s.machine.relay_cpu_pct,
            s.machine.relay_rss_mb,
            s.machine.checkpoints,
            s.machine.vacuums
        ),
    }
}

/// The verdict lines: p99 drift, size growth after the first retention period, missing events.
pub fn summarize(out: &Output, args: &Args, mode: &str, samples: &[Sample], delivered: usize) {
    // Full intervals only: the first is the start-up, the tail is the drain after the producers.
    let full: Vec<&Sample> = samples.iter().filter(|s| s.delivered > 0).collect();
    let (Some(first), Some(last)) = (full.first(), full.iter().rev().nth(1).or(full.last())) else {
        return;
    };
    let settled = match mode {
        "keep" => args.retention.as_secs_f64() / 60.0 + args.cleanup_interval.as_secs_f64() / 60.0,
        // Plus one partition: the oldest is dropped once its whole range is past retention.
        "partitions" => {
            args.retention.as_secs_f64() / 60.0
                + args.cleanup_interval.as_secs_f64() / 60.0
                + pgoutbox::store::history::width_minutes(args.retention) as f64
        }
        _ => 1.0,
    };
    // Dropping whole partitions makes the sizes a saw-tooth (one partition's worth): compare the
    // largest of the first and the last few intervals rather than two points of it.
    let size = |s: &Sample| s.table_mb + s.indexes_mb;
    // Retention keeps a varying number of rows (cleanup's phase, a partition more or less): the
    // space each retained row takes is what grows when a table bloats.
    let per_row = |s: &Sample| size(s) * 1_048_576.0 / s.live_tuples.max(1) as f64;
    let running: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.minute >= settled && s.delivered > 0)
        .collect();
    let window = 5.min(running.len());
    let largest = |w: &[&Sample]| -> Option<Sample> {
        w.iter()
            .max_by(|a, b| size(a).total_cmp(&size(b)))
            .map(|s| (*s).clone())
    };
    let after = largest(&running[..window]);
    let end = largest(&running[running.len() - window..]);
    out.row(Row {
        scenario: "soak".into(),
        variant: format!("{mode}: last / first interval p99"),
        value: last.latency.p99 / first.latency.p99,
        unit: "×",
        detail: format!(
            "commit→publish p99 {:.1} → {:.1} ms (target ≤ 1.5×); in those intervals {} → {} delivered, CPU {:.0} → {:.0} % busy, {:.1} → {:.1} % stolen, relay {:.0} → {:.0} % of a core; {delivered} of {} delivered",
            first.latency.p99,
            last.latency.p99,
            first.delivered,
            last.delivered,
            first.machine.busy_pct,
            last.machine.busy_pct,
            first.machine.steal_pct,
            last.machine.steal_pct,
            first.machine.relay_cpu_pct,
            last.machine.relay_cpu_pct,
            args.events
        ),
    });
    if let (Some(after), Some(end)) = (after, end) {
        out.row(Row {
            scenario: "soak".into(),
            variant: format!("{mode}: size growth after minute {settled:.0}"),
            value: size(&end) / size(&after).max(0.001),
            unit: "×",
            detail: format!(
                "largest table + indexes of {window} intervals: {:.0} MB at minute {:.1} → {:.0} MB at minute {:.1}; {:.0} → {:.0} bytes per live row; dead tuples {} → {}",
                size(&after),
                after.minute,
                size(&end),
                end.minute,
                per_row(&after),
                per_row(&end),
                after.dead_tuples,
                end.dead_tuples
            ),
        });
    }
}

/// The held transaction's effect: commit→publish p99, backlog (live rows) and table + index size
/// before it began (the interval before), at their worst while it was open, and at the end.
pub fn held_xmin(out: &Output, mode: &str, samples: &[Sample], from: f64, to: f64) {
    let size = |s: &Sample| s.table_mb + s.indexes_mb;
    let before: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.minute <= from && s.delivered > 0)
        .collect();
    let during: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.minute > from && s.minute <= to + 1.0 && s.delivered > 0)
        .collect();
    // A hold that began before the first interval ended is weighed against that interval.
    let (Some(last_before), Some(end)) = (
        before.last().copied().or(samples.first()),
        samples.iter().rev().find(|s| s.delivered > 0),
    ) else {
        return;
    };
    let worst_p99 = during.iter().map(|s| s.latency.p99).fold(0.0, f64::max);
    let worst_size = during.iter().map(|s| size(s)).fold(0.0, f64::max);
    let worst_backlog = during.iter().map(|s| s.live_tuples).max().unwrap_or(0);
    let p99_before = before.iter().map(|s| s.latency.p99).fold(0.0, f64::max);
    out.row(Row {
        scenario: "soak".into(),
        variant: format!("{mode}: xmin held minute {from:.1} to {to:.1}"),
        value: worst_p99 / p99_before.max(0.001),
        unit: "× p99",
        detail: format!(
            "commit→publish p99 at most {p99_before:.1} ms before, {worst_p99:.1} ms while held (target within 3×); live rows {} before, at most {worst_backlog} while held, {} at the end; table + indexes {:.1} MB before, {worst_size:.1} MB at most while held, {:.1} MB at minute {:.1}",
            last_before.live_tuples,
            end.live_tuples,
            size(last_before),
            size(end),
            end.minute
        ),
    });
}

/// Every interval as a CSV line, under a header line.
pub fn csv(samples: &[Sample]) -> String {
    let mut s = String::from(
        "mode,minute,delivered,claim_p99_ms,latency_p50_ms,latency_p99_ms,latency_max_ms,table_mb,indexes_mb,dead_tuples,live_tuples,cpu_busy_pct,cpu_steal_pct,relay_cpu_pct,relay_rss_mb,checkpoints,vacuums\n",
    );
    for x in samples {
        let _ = writeln!(
            s,
            "{},{:.2},{},{},{:.3},{:.3},{:.3},{:.1},{:.1},{},{},{:.1},{:.2},{:.1},{:.1},{},{}",
            x.mode,
            x.minute,
            x.delivered,
            x.claim_p99_ms.map_or(String::new(), |v| v.to_string()),
            x.latency.p50,
            x.latency.p99,
            x.latency.max,
            x.table_mb,
            x.indexes_mb,
            x.dead_tuples,
            x.live_tuples,
            x.machine.busy_pct,
            x.machine.steal_pct,
            x.machine.relay_cpu_pct,
            x.machine.relay_rss_mb,
            x.machine.checkpoints,
            x.machine.vacuums
        );
    }
    s
}

/// Stacked charts over minutes: commit→publish p99, events delivered, CPU stolen, claim p99,
/// table + index size, dead tuples; one colour per mode.
pub fn plot(samples: &[Sample], args: &Args) -> String {
    type Metric = fn(&Sample) -> Option<f64>;
    let panels: [(&str, Metric); 6] = [
        ("commit→publish p99 (ms)", |s| {
            (s.delivered > 0).then_some(s.latency.p99)
        }),
        ("events delivered per interval (thousands)", |s| {
            Some(s.delivered as f64 / 1000.0)
        }),
        ("CPU stolen by the hypervisor (% of all cores)", |s| {
            Some(s.machine.steal_pct)
        }),
        ("claim p99 (ms, bucket bound)", |s| s.claim_p99_ms),
        ("table + indexes (MB)", |s| Some(s.table_mb + s.indexes_mb)),
        ("dead tuples (thousands)", |s| {
            Some(s.dead_tuples as f64 / 1000.0)
        }),
    ];
    let (w, h, margin) = (760.0, 170.0, 50.0);
    let colours = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"];
    let max_minute = samples.iter().map(|s| s.minute).fold(1.0, f64::max);
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{}\" font-family=\"sans-serif\" font-size=\"11\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"{margin}\" y=\"18\" font-size=\"13\">pgoutbox bench soak: {} events per mode at {}/s</text>\n",
        30.0 + panels.len() as f64 * (h + 30.0),
        args.events,
        args.rate
    );
    for (i, (title, metric)) in panels.iter().enumerate() {
        let top = 30.0 + i as f64 * (h + 30.0);
        let max_y = samples
            .iter()
            .filter_map(metric)
            .fold(0.0f64, f64::max)
            .max(1e-9);
        let _ = writeln!(
            svg,
            "<text x=\"{margin}\" y=\"{}\">{title} — max {max_y:.1}</text><rect x=\"{margin}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"#999\"/>",
            top + 12.0,
            top + 16.0,
            w - 2.0 * margin,
            h - 16.0
        );
        let mut modes: Vec<&str> = samples.iter().map(|s| s.mode.as_str()).collect();
        modes.dedup();
        for (m, mode) in modes.iter().enumerate() {
            let points: Vec<String> = samples
                .iter()
                .filter(|s| s.mode == *mode)
                .filter_map(|s| metric(s).map(|v| (s.minute, v)))
                .map(|(x, y)| {
                    format!(
                        "{:.1},{:.1}",
                        margin + x / max_minute * (w - 2.0 * margin),
                        top + h - y / max_y * (h - 20.0)
                    )
                })
                .collect();
            let colour = colours[m % colours.len()];
            let _ = writeln!(
                svg,
                "<polyline fill=\"none\" stroke=\"{colour}\" stroke-width=\"1.5\" points=\"{}\"/><text x=\"{}\" y=\"{}\" fill=\"{colour}\">{mode}</text>",
                points.join(" "),
                w - margin - 60.0,
                top + 30.0 + m as f64 * 13.0
            );
        }
    }
    let _ = writeln!(
        svg,
        "<text x=\"{margin}\" y=\"{}\">minutes since the mode's start (0 – {max_minute:.0})</text>\n</svg>",
        30.0 + panels.len() as f64 * (h + 30.0) - 8.0
    );
    svg
}
