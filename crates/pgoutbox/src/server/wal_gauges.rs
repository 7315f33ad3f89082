//! The WAL gauges: the slot's lag, safe WAL size and status, read on an interval.

use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::config::Config;
use crate::model::metric;
use crate::sources::wal::slot::Names;
use crate::store::Store;

/// Reads the slot's health (the slot of `config`) into the WAL gauges every `interval` until
/// `stop`.
pub async fn refresh_wal_gauges(
    store: Store,
    config: Config,
    interval: Duration,
    stop: CancellationToken,
) {
    let names = Names::of(&config.wal, &config.table);
    let mut known: Option<String> = None;
    loop {
        match crate::sources::wal::slot::status(store.pool(), &names).await {
            Ok(Some(s)) => {
                metrics::gauge!(metric::WAL_SLOT_LAG_BYTES).set(s.lag_bytes.unwrap_or(0) as f64);
                // NULL when max_slot_wal_keep_size is unset: no bound, shown as -1.
                metrics::gauge!(metric::WAL_SLOT_SAFE_WAL_SIZE_BYTES)
                    .set(s.safe_wal_size.map_or(-1.0, |v| v as f64));
                let status = s.wal_status.unwrap_or_else(|| "unknown".into());
                if let Some(old) = known.replace(status.clone()).filter(|o| *o != status) {
                    metrics::gauge!(metric::WAL_SLOT_STATUS, "status" => old).set(0.0);
                }
                metrics::gauge!(metric::WAL_SLOT_STATUS, "status" => status).set(1.0);
            }
            Ok(None) => {
                if let Some(old) = known.take() {
                    metrics::gauge!(metric::WAL_SLOT_STATUS, "status" => old).set(0.0);
                }
                metrics::gauge!(metric::WAL_SLOT_STATUS, "status" => "missing").set(1.0);
            }
            Err(e) => {
                metrics::counter!(metric::DB_ERRORS_TOTAL).increment(1);
                warn!(error = %crate::error_chain(&e), "cannot read the replication slot's status");
            }
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(interval) => {}
        }
    }
}
