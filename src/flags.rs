//! Value parsers for command-line flags that both the commands (`cli`) and the benchmark harness
//! (`bench`) declare: one spelling of each kind of value, one error message, whichever command
//! reads it. Below both; imports neither.

use std::time::Duration;

/// Parses a duration flag such as `30s`, `2h`, `7d`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| format!("{e}; write e.g. 30s, 5m, 2h, 7d"))
}
