//! Confirming positions: the delivered rows of settled batches written together, and each
//! position confirmed once its batch and every batch before it is written.

use std::sync::Arc;
use std::time::Duration;

use pgwire_replication::Lsn;
use tokio::sync::watch;

use super::WalEngine;
use crate::model::report::DeliveredRows;

/// Settled batches' delivered rows, gathered and written together (one statement for many
/// batches instead of a settle transaction each: what the relay costs the database per event is
/// then about one row write), and the positions waiting for them. A position is confirmed once
/// the rows of its batch and of every batch before it are written, so the slot never passes an
/// event whose row could still be claimed by the polling relay. Rows are written when
/// `batch_size` of them are gathered or the oldest has waited `wait`, one write at a time; a
/// crash before a write means its batches are read again (at least once, as before).
pub(super) struct Confirmer {
    confirm: watch::Sender<Lsn>,
    batch_size: usize,
    wait: Duration,
    /// Rows gathered, not yet being written, and when the first of them came.
    rows: DeliveredRows,
    since: Option<tokio::time::Instant>,
    /// The last position waiting for `rows` or for the write in progress.
    waiting: Option<Lsn>,
    /// The write in progress and the position it lets through.
    writing: Option<(
        tokio::task::JoinHandle<crate::error::Result<u64>>,
        Option<Lsn>,
    )>,
}

impl Confirmer {
    pub(super) fn new(confirm: watch::Sender<Lsn>, batch_size: usize, wait: Duration) -> Self {
        Self {
            confirm,
            batch_size,
            wait,
            rows: DeliveredRows::default(),
            since: None,
            waiting: None,
            writing: None,
        }
    }

    /// A batch is settled, and every batch before it: its rows join the gathered ones, and its
    /// position is confirmed now if no row before it is left to write.
    pub(super) fn settled(&mut self, rows: DeliveredRows, position: Option<Lsn>) {
        if !rows.is_empty() {
            self.since.get_or_insert_with(tokio::time::Instant::now);
            self.rows.append(rows);
        }
        let Some(position) = position else { return };
        if self.rows.is_empty() && self.writing.is_none() {
            let _ = self.confirm.send(position);
        } else {
            self.waiting = Some(self.waiting.map_or(position, |w| w.max(position)));
        }
    }

    /// Waits for the write in progress to end (then starts the next if enough rows are
    /// gathered), or else for the gathered rows to be due and starts writing them; pending for
    /// ever when there is neither (a select! branch: cancel-safe).
    pub(super) async fn step<E: WalEngine>(&mut self, engine: &Arc<E>) -> Result<(), String> {
        if self.writing.is_some() {
            self.written().await?;
            self.write_if_due(engine, false);
            return Ok(());
        }
        let Some(since) = self.since else {
            return std::future::pending().await;
        };
        tokio::time::sleep_until(since + self.wait).await;
        self.write_if_due(engine, true);
        Ok(())
    }

    /// Starts writing the gathered rows if there are `batch_size` of them, or (`timed_out`)
    /// any, and no write is in progress.
    pub(super) fn write_if_due<E: WalEngine>(&mut self, engine: &Arc<E>, timed_out: bool) {
        if self.writing.is_some() || self.rows.is_empty() {
            return;
        }
        if !timed_out && self.rows.len() < self.batch_size {
            return;
        }
        let rows = std::mem::take(&mut self.rows);
        self.since = None;
        let task = tokio::spawn(Arc::clone(engine).write_rows(rows));
        self.writing = Some((task, self.waiting.take()));
    }

    /// The write in progress ended: on success its position is confirmed, and a later one too
    /// if nothing is left to write before it. Pending for ever when no write is in progress (a
    /// select! branch).
    pub(super) async fn written(&mut self) -> Result<(), String> {
        let Some((task, _)) = &mut self.writing else {
            return std::future::pending().await;
        };
        let result = task.await;
        let position = self.writing.take().and_then(|(_, position)| position);
        match result {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return Err(crate::error_chain(&e)),
            Err(e) => return Err(format!("writing the delivered rows ended abnormally: {e}")),
        }
        // Positions that waited behind this write pass too, unless rows came in after them.
        let behind = if self.rows.is_empty() {
            self.waiting.take()
        } else {
            None
        };
        if let Some(position) = position.max(behind) {
            let _ = self.confirm.send(position);
        }
        Ok(())
    }

    /// Backpressure: with a write in progress and many more rows gathered behind it, waits for
    /// that write (reading on would only grow what a crash has to read again).
    pub(super) async fn keep_up(&mut self) -> Result<(), String> {
        if self.writing.is_some() && self.rows.len() >= 4 * self.batch_size {
            self.written().await?;
        }
        Ok(())
    }

    /// On stop: waits for the write in progress, then writes what is left and confirms the last
    /// position.
    pub(super) async fn finish<E: WalEngine>(&mut self, engine: &Arc<E>) -> Result<(), String> {
        loop {
            self.write_if_due(engine, true);
            if self.writing.is_none() {
                return Ok(());
            }
            self.written().await?;
        }
    }
}
