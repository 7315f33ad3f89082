//! `<table>_attempts`: the history of failed attempts (the console's event view, `dead show`).

use uuid::Uuid;

use super::{Store, Unit};
use crate::error::Result;
use crate::table::OutboxTable;

/// AttemptsLog. Appends one row per failed attempt (`$1..$4`: event id, destination, error, dead)
/// in the settle's transaction: no index is read, two small ones are written.
const ATTEMPTS_LOG: &str = "
INSERT INTO {qname:attempts} (event_id, destination, error, dead)
SELECT * FROM unnest($1::uuid[], $2::text[], $3::text[], $4::bool[])";

/// This table's statements, rendered.
pub(super) struct Sql {
    log: String,
}

impl Sql {
    pub(super) fn render(table: &OutboxTable) -> Self {
        Self {
            log: table.render(ATTEMPTS_LOG),
        }
    }
}

/// A failed attempt of a pair, to record in the attempt history.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Failure<'a> {
    /// The event.
    pub event_id: Uuid,
    /// The destination that failed, if the event was routed.
    pub destination: Option<&'a str>,
    /// What went wrong.
    pub error: &'a str,
    /// Whether this attempt dead-lettered the event.
    pub dead: bool,
}

/// AttemptsLog: records failed attempts, in the caller's transaction. Writes nothing when there
/// are none.
pub async fn log(
    store: &Store,
    unit: &mut Unit,
    attempts: impl IntoIterator<Item = Failure<'_>>,
) -> Result<()> {
    let (mut ids, mut destinations, mut errors, mut dead) = (vec![], vec![], vec![], vec![]);
    for a in attempts {
        ids.push(a.event_id);
        destinations.push(a.destination);
        errors.push(a.error);
        dead.push(a.dead);
    }
    if ids.is_empty() {
        return Ok(());
    }
    sqlx::query(&store.sql.attempts.log)
        .bind(ids)
        .bind(destinations)
        .bind(errors)
        .bind(dead)
        .execute(unit.conn())
        .await?;
    Ok(())
}
