//! What the machine did in each interval of a soak, beside the figures that might move with it:
//! CPU busy and stolen by the hypervisor (/proc/stat), the relay's CPU and memory, checkpoints
//! started, autovacuum runs on the outbox.

use std::time::{Duration, Instant};

use crate::process::RelayProcess;
use crate::sql;

/// What the machine and the relay did during one interval (Linux /proc; zeros elsewhere).
#[derive(Debug, Clone)]
pub struct Machine {
    /// CPU busy (not idle, not waiting on I/O), % of all cores.
    pub(super) busy_pct: f64,
    /// CPU time the hypervisor gave to others, % of all cores.
    pub(super) steal_pct: f64,
    /// The relay process's CPU, % of one core.
    pub(super) relay_cpu_pct: f64,
    /// The relay's resident memory at the interval's end, MiB.
    pub(super) relay_rss_mb: f64,
    /// Checkpoints the server started (timed or requested).
    pub(super) checkpoints: i64,
    /// Autovacuum runs on the outbox (and its history).
    pub(super) vacuums: i64,
}

/// Cumulative counters read at each interval's end; `Machine` is the difference of two.
#[derive(Debug, Clone, Copy)]
pub struct Counters {
    cpu_total: u64,
    cpu_idle: u64,
    cpu_steal: u64,
    relay_cpu: Duration,
    relay_rss_kib: u64,
    at: Instant,
    checkpoints: i64,
    vacuums: i64,
}

impl Counters {
    /// Reads /proc/stat's first line, the relay's CPU time and memory and the server's
    /// checkpoint count; `vacuums` is the outbox's autovacuum count, read with its sizes.
    pub async fn read(pool: &sqlx::PgPool, relay: &RelayProcess, vacuums: i64) -> Self {
        let (mut cpu_total, mut cpu_idle, mut cpu_steal) = (0, 0, 0);
        if let Some(line) = std::fs::read_to_string("/proc/stat")
            .ok()
            .and_then(|s| s.lines().next().map(str::to_owned))
        {
            // cpu user nice system idle iowait irq softirq steal (guest time is inside user).
            let v: Vec<u64> = line
                .split_whitespace()
                .skip(1)
                .take(8)
                .filter_map(|x| x.parse().ok())
                .collect();
            if v.len() == 8 {
                cpu_total = v.iter().sum();
                cpu_idle = v[3] + v[4];
                cpu_steal = v[7];
            }
        }
        let checkpoints = sql::watch::checkpoints_started(pool).await;
        Self {
            cpu_total,
            cpu_idle,
            cpu_steal,
            relay_cpu: relay.cpu(),
            relay_rss_kib: relay.rss_kib(),
            at: Instant::now(),
            checkpoints,
            vacuums,
        }
    }

    /// What happened between `before` and `self`.
    pub fn since(&self, before: &Self) -> Machine {
        let total = self.cpu_total.saturating_sub(before.cpu_total).max(1) as f64;
        let idle = self.cpu_idle.saturating_sub(before.cpu_idle) as f64;
        let steal = self.cpu_steal.saturating_sub(before.cpu_steal) as f64;
        let wall = self.at.duration_since(before.at).as_secs_f64().max(1e-3);
        Machine {
            busy_pct: 100.0 * (total - idle - steal).max(0.0) / total,
            steal_pct: 100.0 * steal / total,
            relay_cpu_pct: 100.0
                * self
                    .relay_cpu
                    .saturating_sub(before.relay_cpu)
                    .as_secs_f64()
                / wall,
            relay_rss_mb: self.relay_rss_kib as f64 / 1024.0,
            checkpoints: self.checkpoints - before.checkpoints,
            vacuums: self.vacuums - before.vacuums,
        }
    }
}
