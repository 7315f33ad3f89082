//! A throwaway PostgreSQL cluster with `wal_level = logical` for the WAL source's tests: `initdb`
//! and `postgres` run as the `postgres` user from the installed binaries (nothing new to install),
//! on a free port of 127.0.0.1, in a scratch directory removed at the end. The shared server on
//! 5432 (wal_level = replica) stays untouched.

use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::private::free_port;
use super::sinks::wait_port;

/// A running `wal_level = logical` cluster of this test.
pub struct LogicalPg {
    /// Its port on 127.0.0.1.
    pub port: u16,
    bin: PathBuf,
    data: PathBuf,
    settings: Vec<String>,
    child: Option<Child>,
    dir: tempfile::TempDir,
}

impl LogicalPg {
    /// A new cluster; `settings` are extra `name=value` server settings (e.g.
    /// `logical_decoding_work_mem=64kB`).
    pub fn start(settings: &[&str]) -> Self {
        let bin = super::private::postgres_bin();
        let dir = postgres_scratch();
        let data = dir.path().join("data");
        let status = as_postgres(&bin, "initdb")
            .args(["-A", "trust", "-U", "postgres", "-D"])
            .arg(&data)
            .stdout(Stdio::null())
            .status()
            .expect("initdb");
        assert!(status.success(), "initdb: {status:?}");
        let mut pg = Self {
            port: free_port(),
            bin,
            data,
            settings: settings.iter().map(|s| s.to_string()).collect(),
            child: None,
            dir,
        };
        pg.spawn();
        pg
    }

    fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("postgres.log"))
            .expect("log");
        let mut cmd = as_postgres(&self.bin, "postgres");
        cmd.arg("-D")
            .arg(&self.data)
            .args(["-p", &self.port.to_string()])
            .args(["-c", "listen_addresses=127.0.0.1"])
            .arg("-c")
            .arg(format!(
                "unix_socket_directories={}",
                self.dir.path().display()
            ))
            .args(["-c", "wal_level=logical", "-c", "fsync=off"])
            .args(["-c", "max_wal_senders=20", "-c", "max_replication_slots=20"])
            .args(["-c", "max_connections=200"])
            // A killed relay's walsender must notice soon, so that a standby can take over.
            .args(["-c", "wal_sender_timeout=5s"]);
        for s in &self.settings {
            cmd.arg("-c").arg(s);
        }
        let child = cmd
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn postgres");
        self.child = Some(child);
        if !wait_port(self.port, true, Duration::from_secs(60)) {
            let log =
                std::fs::read_to_string(self.dir.path().join("postgres.log")).unwrap_or_default();
            panic!("postgres did not listen on {}: {log}", self.port);
        }
        // Accepting TCP is not accepting sessions: wait until a query answers.
        for _ in 0..100 {
            let ok = Command::new(self.bin.join("psql"))
                .args([
                    "-h",
                    "127.0.0.1",
                    "-p",
                    &self.port.to_string(),
                    "-U",
                    "postgres",
                ])
                .args(["-d", "postgres", "-Atc", "SELECT 1"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if ok {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("postgres on {} does not answer queries", self.port);
    }

    /// The server URL without a database (for `TestDb::empty_on`).
    pub fn server_url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}", self.port)
    }

    /// Stops the server (fast shutdown: sessions are ended, as in a restart). A fast shutdown
    /// waits for logical replication clients to confirm the last WAL; past 60 s (a client that
    /// never does) it becomes an immediate shutdown, and the test that caused it will see it.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let pid = child.id() as i32;
            // SAFETY: kill(2) on the postmaster we spawned; SIGINT is PostgreSQL's fast shutdown.
            unsafe {
                libc::kill(pid, libc::SIGINT);
            }
            for _ in 0..600 {
                if child.try_wait().ok().flatten().is_some() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            eprintln!(
                "postgres on {} ignored a fast shutdown for 60 s; stopping it at once",
                self.port
            );
            // SAFETY: as above; SIGQUIT is the immediate shutdown.
            unsafe {
                libc::kill(pid, libc::SIGQUIT);
            }
            let _ = child.wait();
        }
    }

    /// This server's `server_version_num`.
    pub fn version(&self) -> i32 {
        self.psql("SHOW server_version_num")
            .parse()
            .expect("server_version_num")
    }

    /// A streaming standby of this server (`pg_basebackup -R`, with a physical slot) on a port of
    /// its own, made synchronous (`synchronous_standby_names = '*'` here): from then on a commit
    /// this server acknowledges is on the standby too. On PostgreSQL 17 and later the standby
    /// also keeps copies of the failover slots (`sync_replication_slots`), and this server sends
    /// logical changes only once the standby has them (`synchronized_standby_slots`).
    pub fn standby(&self) -> Self {
        let dir = postgres_scratch();
        let data = dir.path().join("data");
        let port = free_port();
        let physical = format!("standby_{port}");
        // dbname in the connection string: -R writes it into primary_conninfo, which slot
        // synchronisation needs.
        let status = as_postgres(&self.bin, "pg_basebackup")
            .arg("-d")
            .arg(format!(
                "host=127.0.0.1 port={} user=postgres dbname=postgres",
                self.port
            ))
            .args([
                "-X", "stream", "-R", "-c", "fast", "-C", "-S", &physical, "-D",
            ])
            .arg(&data)
            .stdout(Stdio::null())
            .status()
            .expect("pg_basebackup");
        assert!(status.success(), "pg_basebackup: {status:?}");
        let failover_slots = self.version() >= 170_000;
        let mut settings = self.settings.clone();
        settings.push("hot_standby_feedback=on".into());
        if failover_slots {
            settings.push("sync_replication_slots=on".into());
        }
        let mut standby = Self {
            port,
            bin: self.bin.clone(),
            data,
            settings,
            child: None,
            dir,
        };
        standby.spawn();
        if failover_slots {
            self.psql(&format!(
                "ALTER SYSTEM SET synchronized_standby_slots = '{physical}'"
            ));
        }
        self.psql("ALTER SYSTEM SET synchronous_standby_names = '*'");
        self.psql("SELECT pg_reload_conf()");
        for _ in 0..600 {
            if self.psql("SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'")
                == "1"
            {
                return standby;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("the standby on {} never became synchronous", standby.port);
    }

    /// Promotes this standby (`pg_ctl promote`, waiting until it accepts writes).
    pub fn promote(&self) {
        let status = as_postgres(&self.bin, "pg_ctl")
            .args(["promote", "-w", "-D"])
            .arg(&self.data)
            .stdout(Stdio::null())
            .status()
            .expect("pg_ctl promote");
        assert!(status.success(), "pg_ctl promote: {status:?}");
    }

    /// Runs `sql` with psql on the `postgres` database; its output, trimmed.
    pub fn psql(&self, sql: &str) -> String {
        let out = Command::new(self.bin.join("psql"))
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
            .args(["-U", "postgres", "-d", "postgres", "-Atc", sql])
            .output()
            .expect("psql");
        assert!(
            out.status.success(),
            "psql {sql}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    /// Restarts the server on the same port and data directory.
    pub fn restart(&mut self) {
        self.stop();
        self.spawn();
    }
}

impl Drop for LogicalPg {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A scratch directory the `postgres` user owns (the server's data and socket live there).
fn postgres_scratch() -> tempfile::TempDir {
    let dir = super::scratch();
    let status = Command::new("chown")
        .args(["-R", "postgres:postgres"])
        .arg(dir.path())
        .status()
        .expect("chown");
    assert!(status.success());
    dir
}

fn as_postgres(bin: &std::path::Path, program: &str) -> Command {
    let mut cmd = Command::new("setpriv");
    cmd.args(["--reuid=postgres", "--regid=postgres", "--init-groups"])
        .arg(bin.join(program));
    // The server must not inherit the test's signal disposition or process group: a Ctrl-C of
    // the test run stops it through Drop, not mid-write.
    cmd.process_group(0);
    cmd
}
