//! Sources: where the relay takes events from. [`poll`] claims due rows from the outbox table
//! (`FOR UPDATE SKIP LOCKED`, from the [`watermark`]); [`wal`] reads them from a logical
//! replication slot in commit order. Either hands the engine a batch of events and what holds
//! them until they are settled.

pub mod poll;
pub mod wal;
pub mod watermark;
