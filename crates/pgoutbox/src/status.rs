//! Status: what is pending, failing, dead and how far behind the relay is, per destination and topic.
//!
//! The counts come from the store ([`crate::store::status`]); this module names the destination of
//! rows not yet tried from the routing, merges, and adds each destination's shared state.

use chrono::{DateTime, Utc};
use serde::Serialize;

pub use crate::store::status::StatusRow;

use crate::error::Result;
use crate::route::Router;
use crate::store::Store;

/// The whole status.
#[derive(Debug, Clone, Serialize)]
pub struct Status {
    /// The table looked at.
    pub table: String,
    /// When it was read.
    pub generated_at: DateTime<Utc>,
    /// Sums over every row.
    pub totals: StatusRow,
    /// Per destination and topic.
    pub rows: Vec<StatusRow>,
    /// Each destination's shared state: paused, circuit breaker.
    pub destinations: Vec<crate::store::destinations::DestinationState>,
}

/// Reads the status; with a router, rows not yet tried (and fanned-out rows) are counted for each
/// destination whose topics match. The totals count each row and each pair once.
pub async fn read(store: &Store, routing: Option<(&Router, &[String])>) -> Result<Status> {
    let raw: Vec<StatusRow> = crate::store::status::rows(store).await?;
    let mut totals = StatusRow {
        topic: Some("*".into()),
        ..StatusRow::default()
    };
    for row in &raw {
        totals += row;
    }
    let raw = match routing {
        None => raw,
        Some((router, names)) => raw
            .into_iter()
            .flat_map(|row| {
                let targets: Vec<String> = match row.destination {
                    Some(_) => Vec::new(),
                    None => router
                        .by_topic(row.topic.as_deref().unwrap_or_default())
                        .into_iter()
                        .filter_map(|i| names.get(i).cloned())
                        .collect(),
                };
                if targets.is_empty() {
                    return vec![row];
                }
                targets
                    .into_iter()
                    .map(|d| StatusRow {
                        destination: Some(d),
                        ..row.clone()
                    })
                    .collect()
            })
            .collect(),
    };
    // Merge rows that routing made identical.
    let mut rows: Vec<StatusRow> = Vec::with_capacity(raw.len());
    for row in raw {
        match rows
            .iter_mut()
            .find(|r| r.destination == row.destination && r.topic == row.topic)
        {
            Some(existing) => *existing += &row,
            None => rows.push(row),
        }
    }
    rows.sort_by(|a, b| (&a.destination, &a.topic).cmp(&(&b.destination, &b.topic)));
    Ok(Status {
        table: store.table().to_string(),
        generated_at: Utc::now(),
        totals,
        rows,
        destinations: crate::store::destinations::read(store).await?,
    })
}
