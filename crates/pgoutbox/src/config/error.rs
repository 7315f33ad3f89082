//! A configuration problem: which file, which key, what is wrong.

use std::fmt;
use std::path::PathBuf;

/// A configuration problem: where it is and what is wrong.
#[derive(Debug, thiserror::Error)]
pub struct ConfigError {
    /// The file, when the problem is in one.
    pub file: Option<PathBuf>,
    /// The key (dotted path), when known.
    pub key: Option<String>,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.file {
            Some(file) => write!(f, "invalid configuration in {}", file.display())?,
            None => f.write_str("invalid configuration")?,
        }
        if let Some(key) = &self.key {
            write!(f, ": key `{key}`")?;
        }
        write!(f, ": {}", self.message)
    }
}

impl ConfigError {
    pub(crate) fn at(key: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            file: None,
            key: Some(key.into()),
            message: message.into(),
        }
    }
}
