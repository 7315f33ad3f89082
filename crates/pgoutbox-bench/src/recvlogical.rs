//! pg_recvlogical, the floor of any logical decoding client: finding the program of the server's
//! version, and the command that streams a slot to /dev/null with the connection settings of the
//! scratch database's URL (the password in the environment, not on its command line).

use std::path::{Path, PathBuf};
use std::process::Stdio;

use anyhow::Context;

use super::sql;

/// The pg_recvlogical program for the server of `pool` (see [`find_pg_recvlogical`]).
pub async fn pg_recvlogical(pool: &sqlx::PgPool) -> anyhow::Result<PathBuf> {
    let version = sql::watch::server_version_num(pool).await?;
    find_pg_recvlogical(version / 10_000)
}

/// pg_recvlogical of the server's major version under /usr/lib/postgresql, else the newest
/// there, else the one on PATH.
fn find_pg_recvlogical(major: i32) -> anyhow::Result<PathBuf> {
    let mut found: Vec<(i32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let version = e.file_name().to_str()?.parse::<i32>().ok()?;
            let path = e.path().join("bin/pg_recvlogical");
            path.is_file().then_some((version, path))
        })
        .collect();
    found.sort();
    if let Some((_, path)) = found.iter().find(|(v, _)| *v == major) {
        return Ok(path.clone());
    }
    if let Some((_, path)) = found.pop() {
        return Ok(path);
    }
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|dir| dir.join("pg_recvlogical"))
        .find(|p| p.is_file())
        .context(
            "pg_recvlogical not found under /usr/lib/postgresql/*/bin or on PATH \
             (it comes with the PostgreSQL client package); give it with --pg-recvlogical",
        )
}

/// libpq connection settings for pg_recvlogical, from the database URL: a keyword/value string
/// for `-d`, and the password and TLS settings as environment variables (not on its command line).
#[derive(Debug, PartialEq, Eq)]
struct Conninfo {
    conninfo: String,
    env: Vec<(&'static str, String)>,
}

impl Conninfo {
    fn of(database_url: &str) -> anyhow::Result<Self> {
        let url =
            pgoutbox::sources::wal::UrlParts::parse(database_url).map_err(anyhow::Error::msg)?;
        let mut pairs: Vec<(&str, String)> = vec![("dbname", url.dbname.clone())];
        if let Some(host) = &url.host {
            pairs.push(("host", host.clone()));
        }
        if let Some(port) = url.port {
            pairs.push(("port", port.to_string()));
        }
        if let Some(user) = &url.user {
            pairs.push(("user", user.clone()));
        }
        let conninfo = pairs
            .iter()
            .map(|(k, v)| format!("{k}='{}'", v.replace('\\', "\\\\").replace('\'', "\\'")))
            .collect::<Vec<_>>()
            .join(" ");
        let mut env = Vec::new();
        if let Some(password) = &url.password {
            env.push(("PGPASSWORD", password.clone()));
        }
        for (key, var) in [
            ("sslmode", "PGSSLMODE"),
            ("sslrootcert", "PGSSLROOTCERT"),
            ("sslcert", "PGSSLCERT"),
            ("sslkey", "PGSSLKEY"),
        ] {
            if let Some(v) = url.param(key) {
                env.push((var, v.to_owned()));
            }
        }
        Ok(Self { conninfo, env })
    }
}

/// The pg_recvlogical command streaming `slot` (pgoutput on `publication`, with messages) to
/// /dev/null, up to `end` when given, else until it is killed (dropping the child kills it).
pub fn recvlogical_command(
    url: &str,
    program: &Path,
    slot: &str,
    publication: &str,
    end: Option<&str>,
) -> anyhow::Result<tokio::process::Command> {
    let conn = Conninfo::of(url)?;
    let mut command = tokio::process::Command::new(program);
    command
        .arg("-d")
        .arg(&conn.conninfo)
        .args(["-S", slot, "--start", "--no-loop"])
        .args(["-o", "proto_version=1"])
        .arg("-o")
        .arg(format!("publication_names={publication}"))
        .args(["-o", "messages=true", "-f", "/dev/null"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        // An interrupted bench does not leave it streaming (the scratch cleanup drops its slot).
        .kill_on_drop(true);
    if let Some(end) = end {
        command.arg(format!("--endpos={end}"));
    }
    for (name, value) in &conn.env {
        command.env(name, value);
    }
    Ok(command)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_url_becomes_a_conninfo_and_the_password_an_environment_variable() {
        let c = Conninfo::of(
            "postgres://bench%40x:s3cr%27t@127.0.0.1:5499/pgoutbox_bench_1?sslmode=disable",
        )
        .expect("parses");
        assert_eq!(
            c.conninfo,
            "dbname='pgoutbox_bench_1' host='127.0.0.1' port='5499' user='bench@x'"
        );
        assert_eq!(
            c.env,
            vec![
                ("PGPASSWORD", "s3cr't".to_owned()),
                ("PGSSLMODE", "disable".to_owned())
            ]
        );
        let c = Conninfo::of("postgres:///db?host=/run/postgresql&user=o'k").expect("parses");
        assert_eq!(
            c.conninfo,
            "dbname='db' host='/run/postgresql' user='o\\'k'"
        );
        assert!(c.env.is_empty());
    }
}
