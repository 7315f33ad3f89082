//! One claim + settle round of the relay with no publishing cost in between (a sink that accepts
//! everything at once): the ceiling of `bench sql-limit` and the batch timing of `bench history`.

use std::time::Duration;

use pgoutbox::config::{ClaimMode, Config, History};
use pgoutbox::engine::Relay;
use pgoutbox::store::SettleMode;

/// A relay over `pool`'s default outbox that claims `batch_size` rows at a time (transaction
/// mode, unordered) and settles them as `settle` says, with one destination that accepts every
/// event at once.
pub fn relay(pool: sqlx::PgPool, batch_size: usize, settle: SettleMode) -> anyhow::Result<Relay> {
    let accepts_all = "[[destinations]]\nname = \"bench\"\ntype = \"null\"\n";
    let mut config = Config::parse(accepts_all, |_| None)?;
    config.relay.batch_size = batch_size;
    config.relay.claim = ClaimMode::Transaction;
    match settle {
        SettleMode::Delete => config.retention = Duration::ZERO,
        SettleMode::Mark => config.history = History::Outbox,
        SettleMode::Move => config.history = History::Partitions,
    }
    Ok(Relay::new(pool, &config)?)
}

/// Claims one batch and settles all of it as delivered. Returns the events settled (0 when
/// nothing was due) and how long the round took.
pub async fn claim_and_settle(relay: &Relay) -> anyhow::Result<(usize, Duration)> {
    let started = std::time::Instant::now();
    let report = relay.run_batch().await?;
    Ok((report.claimed, started.elapsed()))
}
