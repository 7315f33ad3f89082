//! The database URL read for its hosts: libpq's multi-host form
//! (`postgres://user@primary:5432,standby:5432/app?target_session_attrs=read-write`) split into
//! one URL per host, tried in order, and what a session must be to serve the relay. Pure: which
//! host is reachable and writable is for the caller to find out (`connect` in the binary).

use super::ConfigError;

/// What a session must be, from the URL's `target_session_attrs`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionAttrs {
    /// `any`: the first host that answers.
    Any,
    /// `read-write`: a session that can write (not a standby, not `default_transaction_read_only`).
    ReadWrite,
    /// `primary`: a server not in recovery.
    Primary,
}

/// What a server said of itself, as [`SessionAttrs::fits`] weighs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerRole {
    /// `pg_is_in_recovery()`: a standby (or a server still replaying WAL).
    pub in_recovery: bool,
    /// `transaction_read_only` of a new session.
    pub read_only: bool,
}

impl SessionAttrs {
    /// Whether a server of `role` serves a session of these attributes.
    pub fn fits(self, role: ServerRole) -> bool {
        match self {
            Self::Any => true,
            Self::ReadWrite => !role.in_recovery && !role.read_only,
            Self::Primary => !role.in_recovery,
        }
    }
}

/// A database URL's hosts: one single-host URL each, in the order given, and the attributes a
/// session must have.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DatabaseHosts {
    /// One URL per host, the rest of the URL (role, database, parameters) unchanged, without
    /// `target_session_attrs` (the driver does not know it).
    pub urls: Vec<String>,
    /// What a session must be. With several hosts and none given, `read-write`: the relay, the
    /// migrations and the repairs all write, so a standby cannot serve them.
    pub attrs: SessionAttrs,
}

/// The query parameter libpq names the session attributes with.
const ATTRS_PARAM: &str = "target_session_attrs";

impl DatabaseHosts {
    /// Reads `url`; errors never repeat it (it may hold a password).
    pub fn parse(url: &str) -> Result<Self, ConfigError> {
        let invalid = |message: String| ConfigError::at("database_url", message);
        let (scheme, rest) = url
            .split_once("://")
            .ok_or_else(|| invalid("not a URL: expected postgres://…".into()))?;
        let end = rest.find(['/', '?']).unwrap_or(rest.len());
        let (authority, tail) = rest.split_at(end);
        let (userinfo, hosts) = match authority.rsplit_once('@') {
            Some((user, hosts)) => (Some(user), hosts),
            None => (None, authority),
        };
        let (path, query) = match tail.split_once('?') {
            Some((path, query)) => (path, Some(query)),
            None => (tail, None),
        };
        let mut attrs = None;
        let mut params = Vec::new();
        for pair in query.into_iter().flat_map(|q| q.split('&')) {
            match pair.split_once('=') {
                Some((ATTRS_PARAM, value)) => attrs = Some(parse_attrs(value).map_err(invalid)?),
                _ if pair.is_empty() => {}
                _ => params.push(pair),
            }
        }
        let hosts: Vec<&str> = hosts.split(',').collect();
        if hosts.len() > 1 && hosts.iter().any(|h| h.is_empty()) {
            return Err(invalid("an empty host in the list of hosts".into()));
        }
        let default = if hosts.len() > 1 {
            SessionAttrs::ReadWrite
        } else {
            SessionAttrs::Any
        };
        let urls = hosts
            .iter()
            .map(|host| {
                let mut one = format!("{scheme}://");
                if let Some(user) = userinfo {
                    one.push_str(user);
                    one.push('@');
                }
                one.push_str(host);
                one.push_str(path);
                if !params.is_empty() {
                    one.push('?');
                    one.push_str(&params.join("&"));
                }
                one
            })
            .collect();
        Ok(Self {
            urls,
            attrs: attrs.unwrap_or(default),
        })
    }

    /// Whether the URL names more than one host (the pool then follows a failover).
    pub fn several(&self) -> bool {
        self.urls.len() > 1
    }
}

/// A `target_session_attrs` value pgoutbox can serve.
fn parse_attrs(value: &str) -> Result<SessionAttrs, String> {
    match value {
        "any" => Ok(SessionAttrs::Any),
        "read-write" => Ok(SessionAttrs::ReadWrite),
        "primary" => Ok(SessionAttrs::Primary),
        "read-only" | "standby" | "prefer-standby" => Err(format!(
            "{ATTRS_PARAM}={value}: pgoutbox writes to the outbox, so it needs read-write, primary or any"
        )),
        other => Err(format!(
            "{ATTRS_PARAM}={other:?} is not one of any, read-write, primary"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_splits_into_one_url_per_host() {
        let cases: &[(&str, &[&str], SessionAttrs)] = &[
            (
                "postgres://u@h/db",
                &["postgres://u@h/db"],
                SessionAttrs::Any,
            ),
            (
                "postgres://u:p%40w@a:5441,b:5442/app?target_session_attrs=read-write&sslmode=require",
                &[
                    "postgres://u:p%40w@a:5441/app?sslmode=require",
                    "postgres://u:p%40w@b:5442/app?sslmode=require",
                ],
                SessionAttrs::ReadWrite,
            ),
            (
                "postgres://a,b:5433/app",
                &["postgres://a/app", "postgres://b:5433/app"],
                SessionAttrs::ReadWrite,
            ),
            (
                "postgresql://u@[::1]:5432,[::2]:5432?target_session_attrs=any",
                &["postgresql://u@[::1]:5432", "postgresql://u@[::2]:5432"],
                SessionAttrs::Any,
            ),
            (
                "postgres://u@h/db?target_session_attrs=primary",
                &["postgres://u@h/db"],
                SessionAttrs::Primary,
            ),
        ];
        for (url, urls, attrs) in cases {
            let hosts = DatabaseHosts::parse(url).expect(url);
            assert_eq!(hosts.urls, *urls, "{url}");
            assert_eq!(hosts.attrs, *attrs, "{url}");
        }
    }

    #[test]
    fn urls_pgoutbox_cannot_serve_are_refused_without_their_password() {
        for url in [
            "postgres://u:secret@a,b/db?target_session_attrs=standby",
            "postgres://u:secret@a,b/db?target_session_attrs=whatever",
            "postgres://u:secret@a,,b/db",
            "u:secret@a/db",
        ] {
            let err = DatabaseHosts::parse(url).expect_err(url).to_string();
            assert!(!err.contains("secret"), "{err}");
            assert!(err.contains("database_url"), "{err}");
        }
    }

    #[test]
    fn a_session_fits_its_attributes() {
        let primary = ServerRole {
            in_recovery: false,
            read_only: false,
        };
        let standby = ServerRole {
            in_recovery: true,
            read_only: true,
        };
        let read_only_primary = ServerRole {
            in_recovery: false,
            read_only: true,
        };
        let table = [
            (SessionAttrs::Any, [true, true, true]),
            (SessionAttrs::ReadWrite, [true, false, false]),
            (SessionAttrs::Primary, [true, false, true]),
        ];
        for (attrs, expected) in table {
            let got = [primary, standby, read_only_primary].map(|r| attrs.fits(r));
            assert_eq!(got, expected, "{attrs:?}");
        }
    }
}
