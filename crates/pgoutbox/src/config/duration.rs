//! Durations as the configuration writes them: `"30s"`, `"5m"`, `"7d"`.

use std::time::Duration;

use super::error::ConfigError;

/// Parses a duration as a command-line flag writes it (`30s`, `2h`, `7d`): the one parser of the
/// commands' and the benchmark's duration flags, so each says the same when it is mistyped.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| format!("{e}; write e.g. 30s, 5m, 2h, 7d"))
}

/// Parses the duration at `key`, or says how to write one.
pub(crate) fn parse_duration_key(key: &str, value: &str) -> Result<Duration, ConfigError> {
    humantime::parse_duration(value).map_err(|e| {
        ConfigError::at(
            key,
            format!("invalid duration {value:?} ({e}); write e.g. \"30s\", \"5m\", \"7d\""),
        )
    })
}

/// Serde helper for durations written as `"30s"`, `"5m"`, `"7d"`.
pub mod duration_str {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer};

    /// Deserializes a humantime duration string.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let s = String::deserialize(d)?;
        humantime::parse_duration(&s).map_err(|e| {
            serde::de::Error::custom(format!(
                "invalid duration {s:?} ({e}); write e.g. \"30s\", \"5m\""
            ))
        })
    }
}

/// Serde helper for optional durations.
pub mod opt_duration_str {
    use std::time::Duration;

    use serde::Deserializer;

    /// Deserializes an optional humantime duration string.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        super::duration_str::deserialize(d).map(Some)
    }
}
