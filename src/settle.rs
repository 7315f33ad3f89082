//! Settle: recording what publishing did, in at most a few statements per batch.
//!
//! Successes are marked published (or deleted, when retention is zero) in one statement per
//! destination; every failure of the batch, retried or dead-lettered, in one more. The decision per
//! failure comes from the destination's [`RetryPolicy`]; this module turns outcomes into that plan
//! ([`plan`], pure and unit-tested) and writes it ([`apply`]).

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use rand::Rng;
use uuid::Uuid;

use crate::claim::Hold;
use crate::error::Result;
use crate::event::OutboxEvent;
use crate::publish::Outcome;
use crate::retry::{Decision, Failure, RetryPolicy};
use crate::table::OutboxTable;

/// Longest `last_error` kept, so a chatty receiver cannot bloat the table.
const MAX_ERROR_LEN: usize = 1024;

/// One failed event's new state.
#[derive(Debug, Clone, PartialEq)]
pub struct FailedRow {
    /// The event.
    pub id: Uuid,
    /// What went wrong, for `last_error`.
    pub error: String,
    /// The destination that failed, if the event was routed.
    pub destination: Option<String>,
    /// Delay until the next attempt (ignored when dead).
    pub delay_secs: f64,
    /// Dead-lettered instead of retried.
    pub dead: bool,
}

/// One event held for its destination (paused, or breaker open): it waits, no attempt counted.
#[derive(Debug, Clone, PartialEq)]
pub struct HeldRow {
    /// The event.
    pub id: Uuid,
    /// The destination it waits for.
    pub destination: String,
    /// The failure that was not counted as an attempt (the breaker was open), if any.
    pub error: Option<String>,
}

/// What a batch's settle writes.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct SettlePlan {
    /// Delivered event ids, per destination name.
    pub delivered: BTreeMap<String, Vec<Uuid>>,
    /// Failures, retried or dead.
    pub failed: Vec<FailedRow>,
    /// Events held for their destination.
    pub held: Vec<HeldRow>,
}

impl SettlePlan {
    /// Number of delivered events.
    pub fn delivered_count(&self) -> usize {
        self.delivered.values().map(Vec::len).sum()
    }

    /// Number of events dead-lettered by this plan.
    pub fn dead_count(&self) -> usize {
        self.failed.iter().filter(|f| f.dead).count()
    }

    /// Number of events scheduled for another attempt.
    pub fn retry_count(&self) -> usize {
        self.failed.len() - self.dead_count()
    }

    /// Dead-letters a row the relay could not read (a poison row), with the reason.
    pub fn poison(&mut self, id: Uuid, reason: &str) {
        self.failed.push(FailedRow {
            id,
            error: truncate(format!(
                "cannot relay this row: {reason} [dead: unreadable row]"
            )),
            destination: None,
            delay_secs: 0.0,
            dead: true,
        });
    }

    /// Holds an event for `destination`; `error` is a failure not counted as an attempt.
    pub fn hold(&mut self, id: Uuid, destination: &str, error: Option<&str>) {
        self.held.push(HeldRow {
            id,
            destination: destination.to_owned(),
            error: error.map(|e| {
                truncate(format!(
                    "{e} [held: {destination} is unavailable, not counted as an attempt]"
                ))
            }),
        });
    }
}

/// The destination an event was routed to, with its policy; `None` for an unroutable event.
pub type Route<'a> = Option<(&'a str, &'a RetryPolicy)>;

/// Turns the outcomes of the events that were attempted into writes.
pub fn plan<'a>(
    attempted: impl IntoIterator<Item = (&'a OutboxEvent, Route<'a>, &'a Outcome)>,
    now: DateTime<Utc>,
    rng: &mut impl Rng,
) -> SettlePlan {
    let mut plan = SettlePlan::default();
    for (event, route, outcome) in attempted {
        let attempt = event.attempts + 1;
        let Some((destination, policy)) = route else {
            plan.failed.push(FailedRow {
                id: event.id,
                error: format!(
                    "no destination takes topic {:?}: add it to a destination's `topics`, then `pgoutbox dead retry`",
                    event.topic
                ),
                destination: None,
                delay_secs: 0.0,
                dead: true,
            });
            continue;
        };
        let (error, decision) = match outcome {
            Outcome::Delivered => {
                // No String per event: the destination is looked up, inserted once.
                match plan.delivered.get_mut(destination) {
                    Some(ids) => ids.push(event.id),
                    None => {
                        plan.delivered
                            .insert((*destination).to_owned(), vec![event.id]);
                    }
                }
                continue;
            }
            Outcome::Rejected { reason } => (reason, Decision::Dead("permanent failure".into())),
            Outcome::Retry {
                reason,
                retry_after,
            } => {
                let failure = Failure {
                    previous_attempts: event.attempts,
                    created_at: event.created_at,
                    retry_after: *retry_after,
                };
                (reason, policy.decide(&failure, now, rng))
            }
        };
        let (delay_secs, dead, suffix) = match decision {
            Decision::Retry(delay) => (delay.as_secs_f64(), false, String::new()),
            Decision::Dead(why) => (0.0, true, format!(" [dead: {why}]")),
        };
        plan.failed.push(FailedRow {
            id: event.id,
            error: truncate(format!(
                "attempt {attempt} to {destination}: {error}{suffix}"
            )),
            destination: Some((*destination).to_owned()),
            delay_secs,
            dead,
        });
    }
    plan
}

fn truncate(mut s: String) -> String {
    if s.len() > MAX_ERROR_LEN {
        let mut cut = MAX_ERROR_LEN;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push('…');
    }
    s
}

/// How a settle went.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct SettleReport {
    /// Rows written.
    pub rows: u64,
    /// Rows the plan named that were not written because the lease was lost (lease mode).
    pub fenced: u64,
}

/// Writes `plan` under the batch's claim; `delete` settles successes by deleting the rows.
/// `untouched` rows were claimed but not attempted: they are given back as they were.
/// `park`: ordered mode, `Some(names of the destinations whose dead rows block)`: the later rows of
/// each failed or held event's key wait behind it (OutboxParkFollowers).
pub async fn apply(
    table: &OutboxTable,
    pool: &sqlx::PgPool,
    hold: Hold,
    plan: &SettlePlan,
    delete: bool,
    untouched: &[Uuid],
    park: Option<&[String]>,
) -> Result<SettleReport> {
    match hold {
        Hold::Transaction(mut tx) => {
            // Untouched rows need nothing: their locks end with the transaction.
            let rows = write(table, &mut tx, plan, delete, None).await?;
            park_followers(table, &mut tx, plan, park).await?;
            tx.commit().await?;
            Ok(SettleReport { rows, fenced: 0 })
        }
        Hold::Lease(token) => {
            let mut conn = pool.acquire().await?;
            let rows = write(table, &mut conn, plan, delete, Some(token)).await?;
            if !untouched.is_empty() {
                sqlx::query(&table.sql.release_lease)
                    .bind(untouched)
                    .bind(token)
                    .execute(&mut *conn)
                    .await?;
            }
            // After the release, which makes the given-back rows due now.
            park_followers(table, &mut conn, plan, park).await?;
            let expected = (plan.delivered_count() + plan.failed.len() + plan.held.len()) as u64;
            Ok(SettleReport {
                rows,
                fenced: expected.saturating_sub(rows),
            })
        }
    }
}

async fn park_followers(
    table: &OutboxTable,
    conn: &mut sqlx::PgConnection,
    plan: &SettlePlan,
    park: Option<&[String]>,
) -> Result<()> {
    let Some(blocking) = park else {
        return Ok(());
    };
    if plan.failed.is_empty() && plan.held.is_empty() {
        return Ok(());
    }
    let ids: Vec<Uuid> = plan
        .failed
        .iter()
        .map(|f| f.id)
        .chain(plan.held.iter().map(|h| h.id))
        .collect();
    sqlx::query(&table.sql.park_followers)
        .bind(ids)
        .bind(blocking)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// Makes rows waiting at 'infinity' due again once nothing holds them back: no dead row of a
/// blocking destination and no held row ahead of them in their key, and their own destination
/// neither paused nor with its breaker open (OutboxUnparkFollowers). Returns how many.
pub async fn unpark_followers(table: &OutboxTable, pool: &sqlx::PgPool) -> Result<u64> {
    let done = sqlx::query(&table.sql.unpark_followers)
        .execute(pool)
        .await?;
    Ok(done.rows_affected())
}

async fn write(
    table: &OutboxTable,
    conn: &mut sqlx::PgConnection,
    plan: &SettlePlan,
    delete: bool,
    token: Option<Uuid>,
) -> Result<u64> {
    let mut rows = 0;
    for (destination, ids) in &plan.delivered {
        let done = if delete {
            sqlx::query(&table.sql.delete_many)
                .bind(ids)
                .bind(token)
                .execute(&mut *conn)
                .await?
        } else {
            sqlx::query(&table.sql.set_published_many)
                .bind(ids)
                .bind(destination)
                .bind(token)
                .execute(&mut *conn)
                .await?
        };
        rows += done.rows_affected();
    }
    if !plan.failed.is_empty() {
        let f = &plan.failed;
        let done = sqlx::query(&table.sql.set_failed_many)
            .bind(f.iter().map(|r| r.id).collect::<Vec<_>>())
            .bind(f.iter().map(|r| r.error.as_str()).collect::<Vec<_>>())
            .bind(
                f.iter()
                    .map(|r| r.destination.as_deref())
                    .collect::<Vec<_>>(),
            )
            .bind(f.iter().map(|r| r.delay_secs).collect::<Vec<_>>())
            .bind(f.iter().map(|r| r.dead).collect::<Vec<_>>())
            .bind(token)
            .execute(&mut *conn)
            .await?;
        rows += done.rows_affected();
    }
    if !plan.held.is_empty() {
        let h = &plan.held;
        let done = sqlx::query(&table.sql.hold_many)
            .bind(h.iter().map(|r| r.id).collect::<Vec<_>>())
            .bind(h.iter().map(|r| r.destination.as_str()).collect::<Vec<_>>())
            .bind(h.iter().map(|r| r.error.as_deref()).collect::<Vec<_>>())
            .bind(token)
            .execute(&mut *conn)
            .await?;
        rows += done.rows_affected();
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::SeedableRng;
    use serde_json::value::RawValue;
    use std::time::Duration;

    fn event(attempts: i32) -> OutboxEvent {
        OutboxEvent {
            id: Uuid::new_v4(),
            seq: 1,
            topic: "order.created".into(),
            key: None,
            payload: RawValue::from_string("{}".into()).expect("json"),
            headers: vec![],
            created_at: Utc::now(),
            attempts,
        }
    }

    #[test]
    fn outcomes_become_one_plan() {
        let policy = RetryPolicy {
            schedule: vec![Duration::from_secs(1), Duration::from_secs(30)],
            max_attempts: Some(3),
            max_age: None,
            jitter: 0.0,
        };
        let events = [event(0), event(0), event(2), event(0), event(0)];
        let route = Some(("billing", &policy));
        let routes = vec![route, route, route, route, None];
        let outcomes = vec![
            Outcome::Delivered,
            Outcome::retry("HTTP 503"),
            Outcome::retry("HTTP 503"),
            Outcome::Rejected {
                reason: "HTTP 400: bad".into(),
            },
            Outcome::Delivered,
        ];
        let attempted = events
            .iter()
            .zip(routes)
            .zip(&outcomes)
            .map(|((e, r), o)| (e, r, o));
        let plan = plan(attempted, Utc::now(), &mut StdRng::seed_from_u64(1));
        assert_eq!(plan.delivered["billing"], vec![events[0].id]);
        assert_eq!(plan.failed.len(), 4);
        assert_eq!(
            (plan.failed[0].dead, plan.failed[0].delay_secs),
            (false, 1.0)
        );
        assert!(plan.failed[1].dead, "third attempt of max 3 dead-letters");
        assert!(plan.failed[2].dead && plan.failed[2].error.contains("HTTP 400: bad"));
        assert!(plan.failed[3].dead && plan.failed[3].error.contains("no destination"));
        assert_eq!(
            (
                plan.delivered_count(),
                plan.retry_count(),
                plan.dead_count()
            ),
            (1, 1, 3)
        );
    }
}
