//! Private brokers for tests that need one set up differently from the shared ones (a password):
//! each runs on a free port from a scratch directory and is killed when dropped, so the shared
//! brokers are never touched.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::sinks::wait_port;

/// A port nothing listens on (bound, then released).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
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
                "user root\nlistener {port} 127.0.0.1\nallow_anonymous false\npassword_file {}\n\
                 persistence false\nlog_dest stderr\n",
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

    fn started(port: u16, mut child: Child, dir: tempfile::TempDir, name: &str) -> Self {
        if !wait_port(port, true, Duration::from_secs(20)) {
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
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
