//! Every SQL statement the bench runs itself, in one place: what it sets up in the scratch
//! database (`setup`), the events and rows it writes as load (`load`), and what it reads of the
//! server while a relay is measured (`watch`). Each statement sits in a function named for what it
//! does, with why it is written so; the longer ones are named constants that the function binds
//! (the convention of `pgoutbox_core::table`), and those with a name spliced in are built by a
//! function. Nothing else in the bench holds SQL text. What the
//! relay itself runs (claim, settle, migrations) stays in the library and is called as the relay
//! calls it. Functions that run a statement return `sqlx::Result`, for the callers to add their
//! context.

/// The load the bench writes: backlogs, producers' statements, rows in the relay's way.
pub mod load;
/// The scratch database, its tables, publication and slots, and housekeeping between runs.
pub mod setup;
/// What the bench reads of the server while a relay runs.
pub mod watch;
