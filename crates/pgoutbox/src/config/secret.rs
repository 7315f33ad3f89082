//! Secrets in the configuration: written as a value, an environment variable or a file, never
//! shown by `Debug`.

use std::fmt;
use std::path::PathBuf;

use serde::Deserialize;

/// A secret string whose `Debug` never shows it.
///
/// In the file it is written in one of three ways: the value itself (`"whsec_…"`), the name of an
/// environment variable that holds it (`{ env = "BILLING_WEBHOOK_SECRET" }`), or the path of a file
/// that holds it (`{ file = "/run/credentials/pgoutbox/billing" }`, the form systemd credentials
/// and Kubernetes secret volumes give). The reference is resolved when the configuration loads;
/// a file's one trailing newline is dropped (`echo value > file` writes one). A missing variable or
/// an unreadable file is a configuration error that names the variable or the path, never a value.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(pub String);

impl Secret {
    /// The secret's value, for the one place that uses it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(***)")
    }
}

/// What a secret may be written as, for the errors that reject another form.
const SECRET_FORMS: &str = "a secret is a string, `{ env = \"NAME\" }` or `{ file = \"PATH\" }`";

/// Where a secret is read from, as written in the file: `{ env = "NAME" }` or `{ file = "PATH" }`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SecretSource {
    env: Option<String>,
    file: Option<PathBuf>,
}

impl SecretSource {
    /// Reads the value this source points at.
    fn resolve(self) -> Result<String, String> {
        let value = match (self.env, self.file) {
            (Some(name), None) => std::env::var(&name).map_err(|e| match e {
                std::env::VarError::NotPresent => {
                    format!("secret from the environment: `{name}` is not set")
                }
                std::env::VarError::NotUnicode(_) => {
                    format!("secret from the environment: `{name}` is not UTF-8")
                }
            })?,
            (None, Some(path)) => {
                let mut text = std::fs::read_to_string(&path)
                    .map_err(|e| format!("cannot read the secret file {}: {e}", path.display()))?;
                if text.ends_with('\n') {
                    text.pop();
                    if text.ends_with('\r') {
                        text.pop();
                    }
                }
                text
            }
            _ => return Err(SECRET_FORMS.into()),
        };
        if value.is_empty() {
            return Err("the secret it points at is empty".into());
        }
        Ok(value)
    }
}

impl<'de> Deserialize<'de> for Secret {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Written {
            Value(String),
            Source(SecretSource),
        }
        // Untagged errors say only "did not match any variant"; say what is accepted instead. A
        // key left out keeps serde's own "missing field `url`": that is what is wrong.
        let written = Written::deserialize(d).map_err(|e: D::Error| {
            if e.to_string().starts_with("missing field") {
                e
            } else {
                serde::de::Error::custom(SECRET_FORMS)
            }
        })?;
        match written {
            Written::Value(value) => Ok(Secret(value)),
            Written::Source(source) => source
                .resolve()
                .map(Secret)
                .map_err(serde::de::Error::custom),
        }
    }
}
