//! The library's error type: one enum, a variant per way things fail, causes kept as sources.

/// Result alias used across the library.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything the pgoutbox library can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A schema or table name from configuration is not a plain SQL identifier.
    #[error("invalid SQL identifier {0:?}: use 1 to {max} ASCII letters, digits or underscores, not starting with a digit", max = crate::table::MAX_IDENT_LEN)]
    InvalidIdentifier(String),

    /// An event payload could not be turned into JSON.
    #[error("event payload is not valid JSON")]
    Payload(#[source] serde_json::Error),

    /// An event topic is empty.
    #[error("event topic must not be empty")]
    EmptyTopic,

    /// A statement against PostgreSQL failed (sqlx 0.8, the default adapter).
    #[cfg(feature = "sqlx08")]
    #[error("database error")]
    Database(#[from] sqlx::Error),

    /// A statement sent through the sqlx 0.9 adapter failed.
    #[cfg(feature = "sqlx09")]
    #[error("database error (sqlx 0.9)")]
    Sqlx09(#[from] sqlx09::Error),

    /// A statement sent through the tokio-postgres adapter failed.
    #[cfg(feature = "tokio-postgres")]
    #[error("database error (tokio-postgres)")]
    TokioPostgres(#[from] tokio_postgres::Error),

    /// A schema migration failed. The failed step was rolled back; the steps done before it stay
    /// done, and the next `migrate` resumes from there.
    #[cfg(feature = "sqlx08")]
    #[error("migration {version} ({description}) failed")]
    Migration {
        /// The migration's version number.
        version: i32,
        /// What the migration does.
        description: &'static str,
        /// The database error.
        #[source]
        source: sqlx::Error,
    },

    /// The outbox table is missing or older than this version of pgoutbox expects.
    #[error("the outbox table {table} is at schema version {found}, this pgoutbox needs {needed}: run `pgoutbox migrate`")]
    SchemaOutdated {
        /// The qualified table name.
        table: String,
        /// The version found (0 when the table has never been migrated).
        found: i32,
        /// The version this build needs.
        needed: i32,
    },

    /// A claim worker panicked (a bug): the relay stopped so that a supervisor restarts it.
    #[error("{0}")]
    WorkerPanicked(String),

    /// A sink could not be built from its configuration.
    #[error("destination {name:?}: {message}")]
    SinkConfig {
        /// The destination's name.
        name: String,
        /// What is wrong.
        message: String,
    },
}

/// An error and its sources on one line: `outer: cause: root cause`.
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        // Some libraries repeat their source in their own message.
        if !s.ends_with(&text) {
            s.push_str(": ");
            s.push_str(&text);
        }
        source = cause.source();
    }
    s
}
