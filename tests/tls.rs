//! TLS and credentials for every transport, each against a real server that the test starts
//! with TLS on and a throwaway PKI (rcgen): a webhook receiver, Redis, Mosquitto, NATS,
//! PostgreSQL, and Kafka (Tansu behind a TLS front the test runs). Each sink is shown to deliver
//! with the right CA, client certificate and credentials, and to fail — retried, never dead-lettered, with one clear error naming the
//! destination — with a CA that did not sign the server's certificate, an expired server
//! certificate and a wrong password.

mod common;

use std::time::Duration;

use pgoutbox::engine::Relay;

use common::private::Private;
use common::sinks::sink_config;
use common::tls::{HttpsReceiver, Pki};
use common::*;

/// One relay pass over one event for a `kind` destination named `broker` with `settings`:
/// whether the event was delivered, and its `last_error`. Nothing may be dead-lettered.
async fn one_pass(kind: &str, settings: &str) -> (bool, String) {
    let db = TestDb::migrated().await;
    db.insert_plain(1, "order.created").await;
    let relay = Relay::new(
        db.pool.clone(),
        &parse_config(&sink_config(&db, kind, settings)),
    )
    .expect("relay");
    let report = relay.run_once().await.expect("run");
    let error: Option<String> = sqlx::query_scalar("SELECT last_error FROM outbox")
        .fetch_one(&db.pool)
        .await
        .expect("row");
    let error = error.unwrap_or_default();
    assert_eq!(
        db.count("dead_at IS NOT NULL").await,
        0,
        "a TLS or login failure is retried, never dead-lettered: {error}"
    );
    println!(
        "{kind}: delivered {}, last_error {error:?}",
        report.delivered
    );
    (report.delivered == 1, error)
}

/// Asserts a failed pass says what went wrong, and names the destination.
fn assert_failed(case: &str, (delivered, error): (bool, String), says: &[&str]) {
    assert!(!delivered, "{case}: must not be delivered");
    assert!(
        error.contains("to broker:"),
        "{case}: the error names the destination: {error}"
    );
    let lower = error.to_lowercase();
    assert!(
        says.iter().any(|s| lower.contains(&s.to_lowercase())),
        "{case}: expected one of {says:?} in: {error}"
    );
}

const UNTRUSTED: &[&str] = &["unknownissuer", "unknown issuer", "unknown ca"];
const EXPIRED: &[&str] = &["expired"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook_over_mutual_tls() {
    let pki = Pki::new();
    let rx = HttpsReceiver::start(&pki, "server").await;
    let settings = |ca: &str| {
        format!(
            "url = \"{}\"\ntimeout = \"3s\"\n{}",
            rx.url,
            pki.tls_line(ca)
        )
    };
    let (delivered, error) = one_pass("webhook", &settings("ca.pem")).await;
    assert!(delivered, "{error}");
    assert_eq!(rx.count(), 1);

    assert_failed(
        "other CA",
        one_pass("webhook", &settings("other-ca.pem")).await,
        UNTRUSTED,
    );
    let expired = HttpsReceiver::start(&pki, "expired").await;
    let settings_expired = format!(
        "url = \"{}\"\ntimeout = \"3s\"\n{}",
        expired.url,
        pki.tls_line("ca.pem")
    );
    assert_failed(
        "expired",
        one_pass("webhook", &settings_expired).await,
        EXPIRED,
    );
    // The receiver requires a client certificate: a CA alone is refused in the handshake.
    let no_identity = format!(
        "url = \"{}\"\ntimeout = \"3s\"\ntls = {{ ca_file = {:?} }}",
        rx.url,
        pki.path("ca.pem").display().to_string()
    );
    let (delivered, error) = one_pass("webhook", &no_identity).await;
    assert!(!delivered && error.contains("to broker:"), "{error}");
    assert_eq!(rx.count(), 1, "nothing got through without a certificate");
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_over_tls_with_an_acl_user() {
    let pki = Pki::new();
    let redis = Private::redis_tls(&pki, "server", "relay", "r3d1s-pw");
    let settings = |port: u16, password: &str, ca: &str| {
        format!(
            "url = \"rediss://relay:{password}@127.0.0.1:{port}/0\"\ntimeout = \"3s\"\n{}",
            pki.tls_line(ca)
        )
    };
    let (delivered, error) = one_pass("redis", &settings(redis.port, "r3d1s-pw", "ca.pem")).await;
    assert!(delivered, "{error}");
    assert_failed(
        "other CA",
        one_pass("redis", &settings(redis.port, "r3d1s-pw", "other-ca.pem")).await,
        UNTRUSTED,
    );
    assert_failed(
        "wrong password",
        one_pass("redis", &settings(redis.port, "wrong-pw", "ca.pem")).await,
        &["WRONGPASS", "authentication failed"],
    );
    let expired = Private::redis_tls(&pki, "expired", "relay", "r3d1s-pw");
    assert_failed(
        "expired",
        one_pass("redis", &settings(expired.port, "r3d1s-pw", "ca.pem")).await,
        EXPIRED,
    );
}

#[cfg(feature = "mqtt")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mqtt_over_tls_with_a_password() {
    let pki = Pki::new();
    // A `+` and an `@` in the password: percent-decoded, never form-decoded.
    let password = "mq+tt@pw";
    let mqtt = Private::mosquitto_tls(&pki, "server", "relay", password);
    // Each failure below comes back as soon as the handshake or the login fails; the timeout only
    // guards a hang. At 3 s a loaded machine (the suite beside a benchmark) once answered "no
    // PUBACK within 3s" before the expired certificate's handshake error: the timeout, not the
    // broker, decided which error the test saw.
    let settings = |port: u16, password: &str, ca: &str| {
        format!(
            "url = \"mqtts://relay:{}@127.0.0.1:{port}\"\ntimeout = \"20s\"\n{}",
            password.replace('@', "%40"),
            pki.tls_line(ca)
        )
    };
    let (delivered, error) = one_pass("mqtt", &settings(mqtt.port, password, "ca.pem")).await;
    assert!(delivered, "{error}");
    assert_failed(
        "other CA",
        one_pass("mqtt", &settings(mqtt.port, password, "other-ca.pem")).await,
        UNTRUSTED,
    );
    assert_failed(
        "wrong password",
        one_pass("mqtt", &settings(mqtt.port, "wrong", "ca.pem")).await,
        &["not authorized", "notauthorized", "bad user", "badusername"],
    );
    let expired = Private::mosquitto_tls(&pki, "expired", "relay", password);
    assert_failed(
        "expired",
        one_pass("mqtt", &settings(expired.port, password, "ca.pem")).await,
        EXPIRED,
    );
}

#[cfg(feature = "nats")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_over_tls_with_password_token_and_nkey() {
    let pki = Pki::new();
    let user = nkeys::KeyPair::new_user();
    let seed = user.seed().expect("seed");
    let nats = Private::nats_tls(
        &pki,
        "server",
        &format!(
            "users = [ {{ user: relay, password: \"n4ts-pw\" }}, {{ nkey: {} }} ]",
            user.public_key()
        ),
    );
    let stream =
        "create_stream = true\nstream = \"TLS\"\nsubjects = [\"order.>\"]\ntimeout = \"3s\"";
    let with = |url: String, ca: &str, extra: &str| {
        format!("url = \"{url}\"\n{stream}\n{}\n{extra}", pki.tls_line(ca))
    };
    let port = nats.port;
    let (delivered, error) = one_pass(
        "nats",
        &with(
            format!("tls://relay:n4ts-pw@127.0.0.1:{port}"),
            "ca.pem",
            "",
        ),
    )
    .await;
    assert!(delivered, "user and password: {error}");
    // The seed from a file, as a Kubernetes secret or systemd credential would give it.
    let seed_file = pki.dir().join("relay.nk");
    std::fs::write(&seed_file, format!("{seed}\n")).expect("seed file");
    let nkey = format!(
        "nkey_seed = {{ file = {:?} }}",
        seed_file.display().to_string()
    );
    let (delivered, error) = one_pass(
        "nats",
        &with(format!("tls://127.0.0.1:{port}"), "ca.pem", &nkey),
    )
    .await;
    assert!(delivered, "nkey: {error}");
    assert_failed(
        "wrong password",
        one_pass(
            "nats",
            &with(format!("tls://relay:wrong@127.0.0.1:{port}"), "ca.pem", ""),
        )
        .await,
        &["authorization violation", "authorization"],
    );
    assert_failed(
        "other CA",
        one_pass(
            "nats",
            &with(
                format!("tls://relay:n4ts-pw@127.0.0.1:{port}"),
                "other-ca.pem",
                "",
            ),
        )
        .await,
        UNTRUSTED,
    );
    let token = Private::nats_tls(&pki, "server", "token: \"t0ken-s3cret\"");
    let (delivered, error) = one_pass(
        "nats",
        &with(
            format!("tls://t0ken-s3cret@127.0.0.1:{}", token.port),
            "ca.pem",
            "",
        ),
    )
    .await;
    assert!(delivered, "token: {error}");
    let expired = Private::nats_tls(&pki, "expired", "token: \"t0ken-s3cret\"");
    assert_failed(
        "expired",
        one_pass(
            "nats",
            &with(
                format!("tls://t0ken-s3cret@127.0.0.1:{}", expired.port),
                "ca.pem",
                "",
            ),
        )
        .await,
        EXPIRED,
    );
}

/// A JWT as nats-server reads it: ed25519-nkey signed by `issuer`, with `nats` as its NATS
/// claims (`type`, `version`, limits).
#[cfg(feature = "nats")]
fn nats_jwt(issuer: &nkeys::KeyPair, subject: &str, name: &str, nats: serde_json::Value) -> String {
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let header = b64.encode(r#"{"typ":"JWT","alg":"ed25519-nkey"}"#);
    let claims = serde_json::json!({
        "jti": uuid::Uuid::new_v4().simple().to_string().to_uppercase(),
        "iat": std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_secs(),
        "iss": issuer.public_key(),
        "name": name,
        "sub": subject,
        "nats": nats,
    });
    let signed = format!("{header}.{}", b64.encode(claims.to_string()));
    let signature = issuer.sign(signed.as_bytes()).expect("sign");
    format!("{signed}.{}", b64.encode(signature))
}

/// Decentralized authentication: a server in operator mode, an account with JetStream, and the
/// relay's user in a `.creds` file (`credentials_file`).
#[cfg(feature = "nats")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_with_a_credentials_file() {
    let pki = Pki::new();
    let operator = nkeys::KeyPair::new_operator();
    let account = nkeys::KeyPair::new_account();
    let user = nkeys::KeyPair::new_user();
    let unlimited = serde_json::json!({
        "subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1, "wildcards": true,
        "conn": -1, "leaf": -1, "mem_storage": -1, "disk_storage": -1, "streams": -1,
        "consumer": -1
    });
    let operator_jwt = nats_jwt(
        &operator,
        &operator.public_key(),
        "pgt-operator",
        serde_json::json!({"type": "operator", "version": 2}),
    );
    let account_jwt = nats_jwt(
        &operator,
        &account.public_key(),
        "pgt-account",
        serde_json::json!({"type": "account", "version": 2, "limits": unlimited}),
    );
    let user_jwt = nats_jwt(
        &account,
        &user.public_key(),
        "relay",
        serde_json::json!({"type": "user", "version": 2, "pub": {}, "sub": {}, "subs": -1,
                           "data": -1, "payload": -1}),
    );
    // JetStream needs a system account.
    let system = nkeys::KeyPair::new_account();
    let system_jwt = nats_jwt(
        &operator,
        &system.public_key(),
        "SYS",
        serde_json::json!({"type": "account", "version": 2}),
    );
    let operator_file = pki.dir().join("operator.jwt");
    std::fs::write(&operator_file, &operator_jwt).expect("operator jwt");
    let nats = Private::nats_tls_with(
        &pki,
        "server",
        &format!(
            "operator: {:?}\nsystem_account: {}\nresolver: MEMORY\n\
             resolver_preload: {{ {}: {:?}, {}: {:?} }}\n",
            operator_file.display().to_string(),
            system.public_key(),
            account.public_key(),
            account_jwt,
            system.public_key(),
            system_jwt
        ),
    );
    let creds = pki.dir().join("relay.creds");
    let write_creds = |jwt: &str| {
        std::fs::write(
            &creds,
            format!(
                "-----BEGIN NATS USER JWT-----\n{jwt}\n------END NATS USER JWT------\n\n\
                 -----BEGIN USER NKEY SEED-----\n{}\n------END USER NKEY SEED------\n",
                user.seed().expect("seed")
            ),
        )
        .expect("creds");
    };
    write_creds(&user_jwt);
    let settings = format!(
        "url = \"tls://127.0.0.1:{}\"\ncreate_stream = true\nstream = \"CREDS\"\n\
         subjects = [\"order.>\"]\ntimeout = \"5s\"\ncredentials_file = {:?}\n{}",
        nats.port,
        creds.display().to_string(),
        pki.tls_line("ca.pem")
    );
    let (delivered, error) = one_pass("nats", &settings).await;
    assert!(delivered, "creds: {error}");
    // Another account's user, unknown to the server.
    let stranger = nkeys::KeyPair::new_account();
    let forged = nats_jwt(
        &stranger,
        &user.public_key(),
        "relay",
        serde_json::json!({"type": "user", "version": 2, "pub": {}, "sub": {}}),
    );
    write_creds(&forged);
    assert_failed(
        "unknown account",
        one_pass("nats", &settings).await,
        &["authorization violation", "authorization"],
    );
}

#[cfg(feature = "rabbitmq")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_over_tls() {
    let pki = Pki::new();
    let rabbit = Private::rabbitmq_tls(&pki, "server", "relay", "rabb1t-pw");
    let port = rabbit.port;
    let settings = |password: &str, ca: &str| {
        format!(
            "url = \"amqps://relay:{password}@127.0.0.1:{}/%2f\"\ntimeout = \"5s\"\n{}",
            port,
            pki.tls_line(ca)
        )
    };
    // The default exchange takes any routing key: a message no queue wants is still confirmed.
    let (delivered, error) = one_pass("rabbitmq", &settings("rabb1t-pw", "ca.pem")).await;
    assert!(delivered, "{error}");
    assert_failed(
        "other CA",
        one_pass("rabbitmq", &settings("rabb1t-pw", "other-ca.pem")).await,
        UNTRUSTED,
    );
    assert_failed(
        "wrong password",
        one_pass("rabbitmq", &settings("wrong", "ca.pem")).await,
        &["access_refused", "access refused", "authentication"],
    );
    drop(rabbit);
    let expired = Private::rabbitmq_tls(&pki, "expired", "relay", "rabb1t-pw");
    let settings = format!(
        "url = \"amqps://relay:rabb1t-pw@127.0.0.1:{}/%2f\"\ntimeout = \"5s\"\n{}",
        expired.port,
        pki.tls_line("ca.pem")
    );
    assert_failed("expired", one_pass("rabbitmq", &settings).await, EXPIRED);
}

/// Kafka over TLS with a client certificate. Tansu, the local Kafka-API broker, has no TLS
/// listener that works (0.6: `--cert` refuses `--key`, and a `tls://` listener reads plain
/// frames), so the test puts a TLS front of its own before it: the front requires a client
/// certificate of the CA and relays the bytes; Tansu advertises the front's port, so every
/// connection librdkafka makes goes through TLS. SASL cannot be tested here: Tansu creates SCRAM
/// users only over an authenticated connection, and its only storage is in memory.
#[cfg(feature = "kafka")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_over_tls_with_a_client_certificate() {
    use common::tls::TlsFront;
    let pki = Pki::new();
    let backend = common::private::free_port();
    let front = TlsFront::start(&pki, "server", backend).await;
    let _tansu = Private::tansu(backend, front.port);
    let expired_front = TlsFront::start(&pki, "expired", backend).await;
    let settings = |port: u16, ca: &str| {
        format!(
            "brokers = \"127.0.0.1:{port}\"\ntopic = \"tls-orders\"\ntimeout = \"4s\"\n\
             properties = {{ \"security.protocol\" = \"ssl\" }}\n{}",
            pki.tls_line(ca)
        )
    };
    // The topic is made through the front too: the admin client speaks TLS like the sink.
    let admin: rdkafka::admin::AdminClient<rdkafka::client::DefaultClientContext> =
        rdkafka::ClientConfig::new()
            .set("bootstrap.servers", format!("127.0.0.1:{}", front.port))
            .set("security.protocol", "ssl")
            .set("ssl.ca.location", pki.path("ca.pem").display().to_string())
            .set(
                "ssl.certificate.location",
                pki.path("client.pem").display().to_string(),
            )
            .set(
                "ssl.key.location",
                pki.path("client.key").display().to_string(),
            )
            .create()
            .expect("admin client");
    let created = admin
        .create_topics(
            &[rdkafka::admin::NewTopic::new(
                "tls-orders",
                1,
                rdkafka::admin::TopicReplication::Fixed(1),
            )],
            &rdkafka::admin::AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
        )
        .await
        .expect("create the topic over TLS");
    for r in created {
        r.expect("topic created");
    }

    let (delivered, error) = one_pass("kafka", &settings(front.port, "ca.pem")).await;
    assert!(delivered, "{error}");
    const OPENSSL_UNTRUSTED: &[&str] = &[
        "certificate verify failed",
        "unable to get local issuer certificate",
        "self-signed certificate in certificate chain",
    ];
    assert_failed(
        "other CA",
        one_pass("kafka", &settings(front.port, "other-ca.pem")).await,
        OPENSSL_UNTRUSTED,
    );
    // OpenSSL's message through librdkafka does not say which check failed (expired or
    // untrusted): "certificate verify failed" is what there is.
    assert_failed(
        "expired",
        one_pass("kafka", &settings(expired_front.port, "ca.pem")).await,
        OPENSSL_UNTRUSTED,
    );
    // The front requires a client certificate: with a CA alone the handshake is refused.
    let no_identity = format!(
        "brokers = \"127.0.0.1:{}\"\ntopic = \"tls-orders\"\ntimeout = \"4s\"\n\
         properties = {{ \"security.protocol\" = \"ssl\" }}\ntls = {{ ca_file = {:?} }}",
        front.port,
        pki.path("ca.pem").display().to_string()
    );
    let (delivered, error) = one_pass("kafka", &no_identity).await;
    assert!(!delivered && error.contains("to broker:"), "{error}");
}

/// The relay's own database connection with `sslmode=verify-full` and the test CA as
/// `sslrootcert`: `migrate` and `relay --once` work; a CA that did not sign the server's
/// certificate, or an expired one, stops them with one clear error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_with_verify_full_and_a_custom_root() {
    let pki = Pki::new();
    let pg = Private::postgres_tls(&pki, "server");
    let expired = Private::postgres_tls(&pki, "expired");
    let dir = scratch();
    let config = |port: u16, ca: &str| {
        let text = format!(
            "database_url = \"postgres://postgres@localhost:{port}/postgres?sslmode=verify-full&sslrootcert={}\"\n\
             [[destinations]]\nname = \"out\"\ntype = \"null\"\n",
            pki.path(ca).display()
        );
        let path = dir.path().join(format!("{port}-{ca}.toml"));
        std::fs::write(&path, text).expect("config");
        path.display().to_string()
    };
    let good = config(pg.port, "ca.pem");
    let ready = wait_for(Duration::from_secs(30), || async {
        run(&["migrate", "--config", &good]).0 == 0
    })
    .await;
    assert!(
        ready,
        "migrate over verify-full: {:?}",
        run(&["migrate", "--config", &good])
    );
    let (code, out, err) = run(&["relay", "--once", "--config", &good]);
    assert_eq!(code, 0, "relay --once over verify-full: {out}{err}");

    let (code, _, err) = run(&["migrate", "--config", &config(pg.port, "other-ca.pem")]);
    println!("other CA: exit {code}: {err}");
    assert_ne!(code, 0);
    assert!(
        UNTRUSTED.iter().any(|s| err.to_lowercase().contains(s)),
        "other CA: {err}"
    );
    let (code, _, err) = run(&["migrate", "--config", &config(expired.port, "ca.pem")]);
    println!("expired: exit {code}: {err}");
    assert_ne!(code, 0);
    assert!(err.to_lowercase().contains("expired"), "expired: {err}");
}

/// A destination whose server certificate is not trusted opens its breaker; the relay keeps
/// running and another destination keeps delivering.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_untrusted_certificate_opens_the_breaker_and_the_relay_goes_on() {
    let pki = Pki::new();
    let db = TestDb::migrated().await;
    let secure = HttpsReceiver::start(&pki, "server").await;
    let plain = Receiver::start().await;
    let config = format!(
        "database_url = \"{}\"\n[relay]\npoll_interval = \"50ms\"\n\
         [[destinations]]\nname = \"untrusted\"\ntype = \"webhook\"\ntopics = [\"secure.*\"]\n\
         url = \"{}\"\n{}\nbreaker = {{ failures = 3 }}\n\
         [[destinations]]\nname = \"plain\"\ntype = \"webhook\"\ntopics = [\"plain.*\"]\nurl = \"{}\"\n",
        db.url,
        secure.url,
        pki.tls_line("other-ca.pem"),
        plain.url
    );
    db.insert_plain(10, "secure.x").await;
    db.insert_plain(10, "plain.x").await;
    let relay = Running::start(&db, &config);
    let open = wait_for(Duration::from_secs(60), || async {
        let state: Option<String> = sqlx::query_scalar(
            "SELECT CASE WHEN count(*) > 0 THEN 'open' END FROM outbox \
             WHERE topic = 'secure.x' AND next_attempt_at = 'infinity'",
        )
        .fetch_one(&db.pool)
        .await
        .expect("held");
        state.is_some()
    })
    .await;
    // Events written after the breaker opened still reach the healthy destination.
    db.insert_plain(10, "plain.x").await;
    let delivered = wait_for(Duration::from_secs(60), || async {
        db.count("topic = 'plain.x' AND published_at IS NOT NULL")
            .await
            == 20
    })
    .await;
    relay.stop().await;
    assert!(
        open,
        "the untrusted destination's events are held (breaker open)"
    );
    assert!(delivered, "the other destination got all 20");
    assert_eq!(secure.count(), 0);
    assert_eq!(db.count("dead_at IS NOT NULL").await, 0);
    let error: String = sqlx::query_scalar(
        "SELECT last_error FROM outbox WHERE topic = 'secure.x' AND last_error IS NOT NULL LIMIT 1",
    )
    .fetch_one(&db.pool)
    .await
    .expect("an error");
    assert!(error.contains("to untrusted:"), "{error}");
}
