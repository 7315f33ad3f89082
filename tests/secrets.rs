//! Secrets (URL query values, passwords, tokens, webhook signing secrets, configured header
//! values) never reach what a user sees: the relay's output at `RUST_LOG=trace`, `last_error`,
//! `/readyz`, `status` (table, JSON and the live view) and configuration errors.

mod common;

use std::process::{Child, Stdio};
use std::time::Duration;

use base64::Engine as _;

use common::private::{free_port, Private};
use common::*;

/// Distinctive secret values, one per place a secret can hide.
const WEBHOOK_QUERY: &str = "qtok-7f3a9c1e5b";
const WEBHOOK_PASSWORD: &str = "wpass-1d2c3b4a";
const WEBHOOK_HEADER: &str = "hdr-9a8b7c6d5e";
const WEBHOOK_SIGNING: &[u8] = b"sig-secret-5e6f7a8b9c";
const REDIRECT_QUERY: &str = "rtok-3c4d5e6f70";
const NATS_PASSWORD: &str = "npass-0e1f2a3b";
const NATS_TOKEN: &str = "ntok-4c5d6e7f8a";
const AMQP_PASSWORD: &str = "apass-8b9c0d1e";
const REDIS_PASSWORD: &str = "rpass-2f3a4b5c";
const MQTT_PASSWORD: &str = "mpass-6d7e8f9a";
const MQTT_GOOD_PASSWORD: &str = "mgood-0a1b2c3d";
const KAFKA_PASSWORD: &str = "kpass-1e2f3a4b";
const ADMIN_TOKEN: &str = "admtok-5a6b7c8d";

/// Every spelling of every secret a leak could take: as written, as a Rust byte list (a
/// `Debug`-printed buffer, e.g. an AMQP `start-ok` frame) and base64 (a basic-auth header).
fn forbidden() -> Vec<(String, String)> {
    let b64 = base64::engine::general_purpose::STANDARD;
    let signing = format!("whsec_{}", b64.encode(WEBHOOK_SIGNING));
    let mut secrets: Vec<String> = [
        WEBHOOK_QUERY,
        WEBHOOK_PASSWORD,
        WEBHOOK_HEADER,
        REDIRECT_QUERY,
        NATS_PASSWORD,
        NATS_TOKEN,
        AMQP_PASSWORD,
        REDIS_PASSWORD,
        MQTT_PASSWORD,
        MQTT_GOOD_PASSWORD,
        KAFKA_PASSWORD,
        ADMIN_TOKEN,
    ]
    .map(str::to_owned)
    .to_vec();
    secrets.push(String::from_utf8_lossy(WEBHOOK_SIGNING).into_owned());
    secrets.push(b64.encode(WEBHOOK_SIGNING));
    let mut forms = Vec::new();
    for secret in &secrets {
        forms.push((secret.clone(), secret.clone()));
        let bytes: Vec<String> = secret.bytes().map(|b| b.to_string()).collect();
        forms.push((secret.clone(), bytes.join(", ")));
        forms.push((secret.clone(), b64.encode(secret)));
    }
    forms.push((signing.clone(), signing));
    forms.push((
        "basic auth".into(),
        b64.encode(format!("user:{WEBHOOK_PASSWORD}")),
    ));
    forms
}

/// Asserts no spelling of any secret is in `text`.
fn assert_clean(what: &str, text: &str) {
    for (secret, form) in forbidden() {
        if let Some(at) = text.find(&form) {
            let start = text[..at].rfind('\n').map_or(0, |i| i + 1);
            let end = text[at..].find('\n').map_or(text.len(), |i| at + i);
            panic!(
                "{what} shows the secret {secret:?} (as {form:?}) in:\n{}",
                &text[start..end]
            );
        }
    }
}

/// A `[[destinations]]` entry for the events of `topic` with `settings` (TOML lines), retried
/// every second up to 1000 attempts.
fn destination(name: &str, kind: &str, topic: &str, settings: &str) -> String {
    format!(
        "\n[[destinations]]\nname = \"{name}\"\ntype = \"{kind}\"\ntopics = [\"{topic}\"]\n\
         {settings}\nretry_schedule = [\"1s\"]\nmax_attempts = 1000\n"
    )
}

/// One destination per sink, each failing: a closed port, a wrong password, a redirect.
///
/// Some secrets are written in the file, some are read from a file under `dir` (`{ file = … }`)
/// and some from this process's environment (`{ env = … }`, inherited by every `pgoutbox` the
/// test runs): each form must stay out of every output.
fn destinations(dir: &std::path::Path, receiver: &str, closed: u16, mqtt_port: u16) -> String {
    let signing = base64::engine::general_purpose::STANDARD.encode(WEBHOOK_SIGNING);
    let secret_file = |name: &str, value: &str| {
        let path = dir.join(name);
        std::fs::write(&path, format!("{value}\n")).expect("secret file");
        format!("{{ file = {:?} }}", path.to_str().expect("utf-8"))
    };
    let hook_url = secret_file(
        "hook_url",
        &format!(
            "http://user:{WEBHOOK_PASSWORD}@127.0.0.1:{closed}/events?token={WEBHOOK_QUERY}&v=1"
        ),
    );
    let signing = secret_file("signing", &format!("whsec_{signing}"));
    // nextest runs each test in its own process: the variables reach only this test's children.
    std::env::set_var(
        "PGOUTBOX_TEST_HOOK_AUTH",
        format!("Bearer {WEBHOOK_HEADER}"),
    );
    std::env::set_var(
        "PGOUTBOX_TEST_REDIS_URL",
        format!("redis://:{REDIS_PASSWORD}@127.0.0.1:6379/0"),
    );
    let hook_headers = "{ authorization = { env = \"PGOUTBOX_TEST_HOOK_AUTH\" } }";
    #[allow(unused_mut)]
    let mut text = [
        destination(
            "hook-closed",
            "webhook",
            "hook.closed",
            &format!(
                "url = {hook_url}\nsecret = {signing}\nheaders = {hook_headers}\ntimeout = \"2s\""
            ),
        ),
        destination(
            "hook-redirect",
            "webhook",
            "hook.redirect",
            &format!("url = \"{receiver}?token={REDIRECT_QUERY}\""),
        ),
        destination(
            "nats-password",
            "nats",
            "nats.password",
            &format!("url = \"nats://user:{NATS_PASSWORD}@127.0.0.1:{closed}\"\ntimeout = \"1s\""),
        ),
        destination(
            "nats-token",
            "nats",
            "nats.token",
            &format!("url = \"nats://{NATS_TOKEN}@127.0.0.1:{closed}\"\ntimeout = \"1s\""),
        ),
        destination(
            "amqp",
            "rabbitmq",
            "amqp.x",
            &format!("url = \"amqp://guest:{AMQP_PASSWORD}@127.0.0.1:5672/%2f\"\ntimeout = \"3s\""),
        ),
        destination(
            "redis",
            "redis",
            "redis.x",
            "url = { env = \"PGOUTBOX_TEST_REDIS_URL\" }\ntimeout = \"2s\"",
        ),
        destination(
            "mqtt",
            "mqtt",
            "mqtt.x",
            &format!(
                "url = \"mqtt://pgt:{MQTT_PASSWORD}@127.0.0.1:{mqtt_port}\"\ntimeout = \"2s\""
            ),
        ),
    ]
    .concat();
    #[cfg(feature = "kafka")]
    text.push_str(&destination(
        "kafka",
        "kafka",
        "kafka.x",
        &format!(
            "brokers = \"127.0.0.1:{closed}\"\ntimeout = \"2s\"\nproperties = {{ \
             \"security.protocol\" = \"sasl_plaintext\", \"sasl.mechanism\" = \"PLAIN\", \
             \"sasl.username\" = \"user\", \"sasl.password\" = {} }}",
            secret_file("kafka_password", KAFKA_PASSWORD)
        ),
    ));
    text
}

/// The topics of [`destinations`], one event each.
fn topics() -> Vec<&'static str> {
    #[allow(unused_mut)]
    let mut topics = vec![
        "hook.closed",
        "hook.redirect",
        "nats.password",
        "nats.token",
        "amqp.x",
        "redis.x",
        "mqtt.x",
    ];
    #[cfg(feature = "kafka")]
    topics.push("kafka.x");
    topics
}

/// Runs `pgoutbox status --watch` for a moment and returns what it printed.
async fn watch_status(config: &std::path::Path) -> String {
    let dir = scratch();
    let out_path = dir.path().join("watch.out");
    let out = std::fs::File::create(&out_path).expect("watch output");
    let mut child: Child = pgoutbox()
        .args(["status", "--watch", "--interval", "200ms", "--config"])
        .arg(config)
        .stdout(out)
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn status --watch");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    signal(&child, libc::SIGINT);
    if exit_status(&mut child, Duration::from_secs(5))
        .await
        .is_none()
    {
        panic!("status --watch did not stop on SIGINT");
    }
    std::fs::read_to_string(out_path).expect("read watch output")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_reach_no_log_last_error_readyz_or_status() {
    let db = TestDb::migrated().await;
    // Answers every request with a redirect whose Location repeats the token.
    let rx = Receiver::with(|_| {
        Reply::status(307).header(
            "location",
            &format!("http://127.0.0.1:1/moved?token={REDIRECT_QUERY}"),
        )
    })
    .await;
    let mosquitto = Private::mosquitto("pgt", MQTT_GOOD_PASSWORD);
    let closed = free_port();
    let listen = free_port();
    let dir = scratch();
    let text = format!(
        "database_url = \"{}\"\n[relay]\npoll_interval = \"50ms\"\npublish_timeout = \"10s\"\n\
         [observability]\nlisten = \"127.0.0.1:{listen}\"\n\
         [admin]\ntoken = {{ file = {:?} }}\n{}",
        db.url,
        {
            let path = dir.path().join("admin-token");
            std::fs::write(&path, format!("{ADMIN_TOKEN}\n")).expect("token file");
            path.display().to_string()
        },
        destinations(dir.path(), &rx.url, closed, mosquitto.port)
    );
    let config = write_config(dir.path(), &text);
    for topic in topics() {
        db.insert_plain(1, topic).await;
    }
    let n = topics().len() as i64;

    let log_path = dir.path().join("relay.log");
    let log = std::fs::File::create(&log_path).expect("log file");
    let mut relay = pgoutbox()
        .env("RUST_LOG", "trace")
        .args(["relay", "--config"])
        .arg(&config)
        .stdout(log.try_clone().expect("clone log"))
        .stderr(log)
        .spawn()
        .expect("spawn relay");

    // Every event failed at least twice: connections refused, logins refused, redirects.
    let failed = wait_for(Duration::from_secs(60), || async {
        db.count("attempts >= 2 AND last_error IS NOT NULL").await == n
    })
    .await;
    let readyz = reqwest::get(format!("http://127.0.0.1:{listen}/readyz"))
        .await
        .expect("readyz");
    let ready_status = readyz.status();
    let ready_body = readyz.text().await.expect("readyz body");
    let status_table = run(&["status", "--config", config.to_str().expect("utf-8")]);
    let status_json = run(&[
        "status",
        "--json",
        "--config",
        config.to_str().expect("utf-8"),
    ]);
    let watched = watch_status(&config).await;
    // The console: what it shows, and a change made with the token (logged at info).
    let console = format!("http://127.0.0.1:{listen}");
    let mut shown = String::new();
    for path in [
        "/",
        "/api/v1/overview",
        "/api/v1/events?state=pending",
        "/api/v1/samples",
    ] {
        let body = reqwest::get(format!("{console}{path}"))
            .await
            .expect("console")
            .text()
            .await
            .expect("console body");
        shown.push_str(&body);
    }
    let paused = reqwest::Client::new()
        .post(format!("{console}/api/v1/destinations/hook-closed/pause"))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .expect("pause")
        .status();
    signal(&relay, libc::SIGTERM);
    let exit = exit_status(&mut relay, Duration::from_secs(30)).await;
    let relay_log = std::fs::read_to_string(&log_path).expect("read relay log");

    let errors: Vec<(String, String, bool)> = sqlx::query_as(
        "SELECT topic, coalesce(last_error, ''), dead_at IS NOT NULL FROM outbox ORDER BY topic",
    )
    .fetch_all(&db.pool)
    .await
    .expect("rows");
    assert!(failed, "every event failed twice: {errors:#?}");
    eprintln!("last_error: {errors:#?}\n/readyz: {ready_body}");

    // Nothing leaks anywhere a user looks.
    for (topic, error, _) in &errors {
        assert_clean(&format!("last_error of {topic}"), error);
    }
    assert_clean("/readyz", &ready_body);
    assert_clean("status", &format!("{} {}", status_table.1, status_table.2));
    assert_clean(
        "status --json",
        &format!("{} {}", status_json.1, status_json.2),
    );
    assert_clean("status --watch", &watched);
    assert_clean("the console", &shown);
    assert_eq!(paused, 200, "a change with the admin token from a file");
    assert!(
        shown.contains("hook-closed"),
        "the console answered: {shown}"
    );
    assert_clean("the relay's output", &relay_log);

    // And the test saw what it means to: real failures, each retried (a refused login is
    // transient), a trace-level log, an unready relay, working status commands.
    for (topic, error, dead) in &errors {
        assert!(!dead, "{topic} dead-lettered: {error}");
    }
    let error_of = |topic: &str| {
        errors
            .iter()
            .find(|(t, _, _)| t == topic)
            .map(|(_, e, _)| e.as_str())
            .unwrap_or_default()
    };
    assert!(
        error_of("hook.closed").contains("request failed"),
        "{errors:#?}"
    );
    assert!(
        error_of("hook.redirect").contains("HTTP 307")
            && error_of("hook.redirect").contains("token=***"),
        "{errors:#?}"
    );
    assert!(error_of("nats.password").contains("NATS"), "{errors:#?}");
    assert!(error_of("amqp.x").contains("RabbitMQ"), "{errors:#?}");
    assert!(error_of("redis.x").contains("Redis"), "{errors:#?}");
    assert!(error_of("mqtt.x").contains("MQTT"), "{errors:#?}");
    assert!(relay_log.contains("TRACE"), "a trace-level log");
    assert!(relay_log.contains("publish failed"), "failures are logged");
    assert_eq!(ready_status, 503, "{ready_body}");
    assert!(
        ready_body.contains("destination hook-closed"),
        "{ready_body}"
    );
    assert!(ready_body.contains("destination amqp"), "{ready_body}");
    assert_eq!(status_table.0, 0, "{status_table:?}");
    assert_eq!(status_json.0, 0, "{status_json:?}");
    assert!(watched.contains("hook.closed"), "{watched}");
    assert!(exit.is_some_and(|s| s.success()), "relay exit: {exit:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn configuration_errors_do_not_quote_secrets() {
    let db = TestDb::migrated().await;
    let dir = scratch();
    for (kind, settings, says) in [
        (
            "nats",
            format!("url = \"nats://user:{NATS_PASSWORD}@127.0.0.1:notaport\""),
            "not a NATS server address",
        ),
        (
            "nats",
            format!("url = \"nats://a:{NATS_PASSWORD}@h1,nats://b:{NATS_TOKEN}@h2\""),
            "different credentials",
        ),
        (
            "rabbitmq",
            format!("url = \"amqp://guest:{AMQP_PASSWORD}@127.0.0.1:5672:bad/\""),
            "not an AMQP URI",
        ),
        (
            "rabbitmq",
            // Not a base URL: the parser's error quotes the whole text.
            format!("url = \"amqp:guest:{AMQP_PASSWORD}@127.0.0.1\""),
            "not an AMQP URI",
        ),
        (
            "redis",
            format!("url = \"redis://:{REDIS_PASSWORD}@127.0.0.1:port/0\""),
            "not a Redis URL",
        ),
        (
            "mqtt",
            format!("url = \"ws://u:{MQTT_PASSWORD}@127.0.0.1\""),
            "scheme must be mqtt",
        ),
        (
            "webhook",
            format!("url = \"ftp://u:{WEBHOOK_PASSWORD}@h/?token={WEBHOOK_QUERY}\""),
            "scheme must be http",
        ),
        (
            "webhook",
            format!("url = \"http://h/\"\nheaders = {{ authorization = \"Bearer {WEBHOOK_HEADER}\\n\" }}"),
            "the value of \"authorization\"",
        ),
    ] {
        let text = format!(
            "database_url = \"{}\"\n[[destinations]]\nname = \"d\"\ntype = \"{kind}\"\n{settings}\n",
            db.url
        );
        let config = write_config(dir.path(), &text);
        let (code, out, err) = run(&["relay", "--once", "--config", config.to_str().expect("utf-8")]);
        assert_eq!(code, 1, "{kind} {settings}: {out} {err}");
        assert!(err.contains(says), "{kind} {settings}: {err}");
        assert_clean(&format!("the error for {kind} {settings}"), &format!("{out}{err}"));
    }
}
