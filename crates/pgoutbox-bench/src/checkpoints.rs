//! What the server's checkpointer was doing, second by second, while a run measured latency: a
//! spread checkpoint's sync phase is when commits may wait on the disk.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use super::producer::unix_micros;
use super::sql;

/// What the checkpointer did, second by second (since the epoch): its wait events other than
/// `CheckpointerMain` (idle), sampled every 100 ms. A spread checkpoint shows as
/// `CheckpointWriteDelay` for minutes; its sync phase (`DataFileSync`, `DataFileFlush`) is when
/// commits may wait on the disk. Stops when dropped.
pub struct CheckpointWatch {
    seconds: Arc<Mutex<BTreeMap<u64, BTreeSet<String>>>>,
    task: tokio::task::JoinHandle<()>,
}

impl CheckpointWatch {
    /// Starts sampling on `pool`.
    pub fn start(pool: &sqlx::PgPool) -> Self {
        let seconds: Arc<Mutex<BTreeMap<u64, BTreeSet<String>>>> = Arc::default();
        let (pool, out) = (pool.clone(), seconds.clone());
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(100));
            loop {
                tick.tick().await;
                let event = sql::watch::checkpointer_wait_event(&pool)
                    .await
                    .ok()
                    .flatten();
                if let Some(event) = event.filter(|e| e != "CheckpointerMain") {
                    if let Ok(mut s) = out.lock() {
                        s.entry(unix_micros(SystemTime::now()) / 1_000_000)
                            .or_default()
                            .insert(event);
                    }
                }
            }
        });
        Self { seconds, task }
    }

    /// What the checkpointer was doing during second `s` ("" when idle).
    pub fn during(&self, s: u64) -> String {
        self.seconds
            .lock()
            .ok()
            .and_then(|x| {
                x.get(&s)
                    .map(|e| e.iter().cloned().collect::<Vec<_>>().join("+"))
            })
            .unwrap_or_default()
    }

    /// Seconds in which the checkpointer was not idle.
    pub fn count(&self) -> usize {
        self.seconds.lock().map(|x| x.len()).unwrap_or(0)
    }
}

impl Drop for CheckpointWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}
