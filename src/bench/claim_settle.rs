//! One claim + settle round of the relay's own statements with no publishing in between: the
//! ceiling of `bench sql-limit` and the claim timing of `bench history`.

use std::time::Duration;

/// Claims one batch (transaction mode, unordered) and settles all of it as delivered: the relay's
/// statements with a sink that accepts everything instantly. Returns the events settled (0 when
/// nothing was due) and how long the claim statement took.
pub async fn claim_and_settle(
    store: &pgoutbox::store::Store,
    batch_size: usize,
    settle: pgoutbox::settle::SettleMode,
) -> anyhow::Result<(usize, Duration)> {
    let options = pgoutbox::sources::poll::ClaimOptions {
        mode: pgoutbox::config::ClaimMode::Transaction,
        limit: batch_size,
        lease: Duration::from_secs(60),
        ordered: false,
        heads: batch_size,
        followers: 0,
        window: u64::MAX,
    };
    let started = std::time::Instant::now();
    let batch = pgoutbox::sources::poll::claim_due(store, &options, &[], None).await?;
    let claim_time = started.elapsed();
    if batch.events.is_empty() {
        pgoutbox::sources::poll::release(store, batch.guard, &[]).await?;
        return Ok((0, claim_time));
    }
    let policy = pgoutbox::model::retry::RetryPolicy::default();
    let delivered = pgoutbox::model::outcome::Outcome::Delivered;
    let plan = pgoutbox::settle::plan::plan(
        batch
            .events
            .iter()
            .map(|e| (e, Some(("bench", &policy)), &delivered)),
        chrono::Utc::now(),
        &mut rand::thread_rng(),
    );
    pgoutbox::settle::apply(store, batch.guard, &plan, settle, &[], None).await?;
    Ok((batch.events.len(), claim_time))
}
