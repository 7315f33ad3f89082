//! Where the replication session connects: the database URL read as libpq reads it.

use std::time::Duration;

use pgwire_replication::{ReplicationConfig, SslMode, TlsConfig};

use super::slot::Names;

/// A PostgreSQL URL's connection parts, as libpq reads them: `postgres://user:password@host:port/db`
/// with percent-decoding, and query parameters (`host`, `port`, `user`, `password`, `dbname`,
/// `sslmode`, ...) winning over the URL's own parts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UrlParts {
    /// Host name or address (IPv6 without brackets), or a socket directory; `None`: not given.
    pub host: Option<String>,
    /// Port; `None`: not given.
    pub port: Option<u16>,
    /// Role; `None`: not given.
    pub user: Option<String>,
    /// Password; `None`: not given.
    pub password: Option<String>,
    /// Database name.
    pub dbname: String,
    params: Vec<(String, String)>,
}

impl UrlParts {
    /// Parses `url`.
    pub fn parse(url: &str) -> Result<Self, String> {
        let url = url::Url::parse(url).map_err(|e| format!("invalid database URL: {e}"))?;
        let params: Vec<(String, String)> = url.query_pairs().into_owned().collect();
        let param = |k: &str| {
            params
                .iter()
                .find(|(key, _)| key == k)
                .map(|(_, v)| v.clone())
        };
        let decode = |s: &str| {
            percent_encoding::percent_decode_str(s)
                .decode_utf8_lossy()
                .into_owned()
        };
        Ok(Self {
            host: param("host").or_else(|| {
                url.host_str()
                    .map(|h| h.trim_start_matches('[').trim_end_matches(']').to_owned())
            }),
            port: param("port").and_then(|p| p.parse().ok()).or(url.port()),
            user: match url.username() {
                "" => param("user"),
                u => Some(decode(u)),
            },
            password: url.password().map(decode).or_else(|| param("password")),
            dbname: param("dbname").unwrap_or_else(|| decode(url.path().trim_start_matches('/'))),
            params,
        })
    }

    /// A query parameter (`sslmode`, `sslrootcert`, ...).
    pub fn param(&self, key: &str) -> Option<&str> {
        self.params
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

/// The one of `url`'s hosts at `host`:`port` (where the relay's pool connects now: it follows a
/// failover), as a single-host URL; the first host when none is there, and `url` itself when it
/// names one host (or cannot be read: the session reports that).
pub fn host_in_use(url: &str, host: &str, port: u16) -> String {
    let Ok(hosts) = crate::config::DatabaseHosts::parse(url) else {
        return url.to_owned();
    };
    if !hosts.several() {
        return url.to_owned();
    }
    hosts
        .urls
        .iter()
        .find(|one| {
            UrlParts::parse(one)
                .is_ok_and(|p| p.host.as_deref() == Some(host) && p.port.unwrap_or(5432) == port)
        })
        .unwrap_or(&hosts.urls[0])
        .clone()
}

/// The replication session's settings, from the database URL and `[wal]`.
pub fn replication_config(
    url: &str,
    names: &Names,
    status: Duration,
) -> Result<ReplicationConfig, String> {
    let parts = UrlParts::parse(url)?;
    let host = parts.host.clone().unwrap_or_else(|| "127.0.0.1".into());
    let port = parts.port.unwrap_or(5432);
    let user = parts.user.clone().unwrap_or_else(|| "postgres".into());
    let password = parts.password.clone().unwrap_or_default();
    let database = parts.dbname.clone();
    let ca = parts.param("sslrootcert").map(std::path::PathBuf::from);
    let tls = match parts.param("sslmode") {
        None | Some("prefer") | Some("allow") => TlsConfig {
            mode: SslMode::Prefer,
            ..TlsConfig::disabled()
        },
        Some("disable") => TlsConfig::disabled(),
        Some("require") => TlsConfig::require(),
        Some("verify-ca") => TlsConfig::verify_ca(ca),
        Some("verify-full") => TlsConfig::verify_full(ca),
        Some(other) => return Err(format!("unknown sslmode {other:?} in database_url")),
    };
    let tls = match (parts.param("sslcert"), parts.param("sslkey")) {
        (Some(cert), Some(key)) => tls.with_client_cert(cert, key),
        _ => tls,
    };
    Ok(ReplicationConfig::new(
        host,
        user,
        password,
        database,
        names.slot.clone(),
        names.publication.clone(),
    )
    .with_port(port)
    .with_tls(tls)
    .with_status_interval(status)
    // Timestamps in the text form the decoder reads, whatever the role's settings.
    .with_options("-c datestyle=ISO -c timezone=UTC")
    .with_application_name("pgoutbox-wal"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_replication_session_follows_the_database_url() {
        let names = Names {
            slot: "s".into(),
            publication: "p".into(),
        };
        let cfg = replication_config(
            "postgres://relay:p%40ss@db.example:6543/app?sslmode=verify-full&sslrootcert=/ca.pem",
            &names,
            Duration::from_secs(1),
        )
        .expect("valid");
        assert_eq!((cfg.host.as_str(), cfg.port), ("db.example", 6543));
        assert_eq!(
            (cfg.user.as_str(), cfg.password.as_str()),
            ("relay", "p@ss")
        );
        assert_eq!(cfg.database, "app");
        assert_eq!(cfg.tls.mode, SslMode::VerifyFull);
        let local = replication_config(
            "postgres:///app?host=/run/pg&port=5433",
            &names,
            Duration::from_secs(1),
        )
        .expect("valid");
        assert!(local.is_unix_socket());
        assert_eq!((local.port, local.user.as_str()), (5433, "postgres"));
        assert!(replication_config(
            "postgres://h/db?sslmode=bogus",
            &names,
            Duration::from_secs(1)
        )
        .is_err());
    }

    #[test]
    fn the_session_streams_from_the_host_the_pool_is_on() {
        let both = "postgres://r:pw@a:5441,b/app?target_session_attrs=read-write&sslmode=require";
        let cases = [
            ("a", 5441, "postgres://r:pw@a:5441/app?sslmode=require"),
            ("b", 5432, "postgres://r:pw@b/app?sslmode=require"),
            (
                "elsewhere",
                5432,
                "postgres://r:pw@a:5441/app?sslmode=require",
            ),
        ];
        for (host, port, expected) in cases {
            assert_eq!(host_in_use(both, host, port), expected, "{host}:{port}");
        }
        let one = "postgres://r@a/app?sslmode=disable";
        assert_eq!(host_in_use(one, "b", 1), one);
    }
}
