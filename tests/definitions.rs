//! Destinations managed at runtime: added, changed and removed with `pgoutbox destinations` and
//! the console's API while relays run, checked as the configuration file's are (a bad field is
//! named and nothing is stored), their secrets sealed and never shown, applied by every running
//! relay without a restart, and refused where they would lose events or clash with the file.

mod common;

use std::path::Path;
use std::process::{Child, Stdio};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use serde_json::json;

const SECRET: &str = "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD";

/// A key to seal secrets with, fixed for the test.
fn key() -> String {
    pgoutbox::definitions::Key::generate()
}

/// `pgoutbox` with the database, the configuration and the key of this test.
fn cli(config: &Path, key: Option<&str>, args: &[&str]) -> (i32, String, String) {
    let mut cmd = pgoutbox();
    cmd.arg("--config").arg(config).args(args);
    cmd.env_remove("PGOUTBOX_SECRETS_KEY");
    if let Some(k) = key {
        cmd.env("PGOUTBOX_SECRETS_KEY", k);
    }
    let out = cmd.output().expect("run pgoutbox");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `pgoutbox destinations add customer-1`: a webhook to `url` taking `order.*`, with `more`.
fn add_customer(
    config: &Path,
    key: Option<&str>,
    url: &str,
    more: &[&str],
) -> (i32, String, String) {
    let url = format!("url={url}");
    let mut args = vec![
        "destinations",
        "add",
        "customer-1",
        "--type",
        "webhook",
        "--set",
        &url,
        "--topic",
        "order.*",
    ];
    args.extend_from_slice(more);
    cli(config, key, &args)
}

/// A relay process, killed when dropped: a failed assertion leaves none behind.
struct Relay(Child);

impl Drop for Relay {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `pgoutbox relay` with `config` and `key`, its log in `dir/relay-<tag>.log`.
fn relay(dir: &Path, config: &Path, key: Option<&str>, tag: &str) -> Relay {
    let log = std::fs::File::create(dir.join(format!("relay-{tag}.log"))).expect("log file");
    let mut cmd = pgoutbox();
    cmd.env_remove("PGOUTBOX_SECRETS_KEY");
    if let Some(k) = key {
        cmd.env("PGOUTBOX_SECRETS_KEY", k);
    }
    Relay(
        cmd.args(["relay", "--config"])
            .arg(config)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn relay"),
    )
}

fn log(dir: &Path, tag: &str) -> String {
    std::fs::read_to_string(dir.join(format!("relay-{tag}.log"))).unwrap_or_default()
}

async fn logged(dir: &Path, tag: &str, what: &str, times: usize) {
    assert!(
        wait_for(Duration::from_secs(60), || async {
            log(dir, tag).matches(what).count() >= times
        })
        .await,
        "relay {tag} logs {what:?} ({times}×):\n{}",
        log(dir, tag)
    );
}

async fn receives(rx: &Receiver, ids: &[String], what: &str) {
    assert!(
        wait_for(Duration::from_secs(60), || async {
            let got = rx.delivered_ids();
            ids.iter().all(|id| got.contains(id))
        })
        .await,
        "{what}: {} of {} arrived",
        rx.delivered_ids().len(),
        ids.len()
    );
}

async fn version(db: &TestDb) -> i64 {
    sqlx::query_scalar("SELECT version FROM outbox_definitions_version")
        .fetch_one(&db.pool)
        .await
        .expect("version")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn destinations_added_changed_and_removed_at_runtime_reach_every_running_relay() {
    let db = TestDb::migrated().await;
    let (file_rx, added_rx, moved_rx) = (
        Receiver::start().await,
        Receiver::start().await,
        Receiver::start().await,
    );
    let dir = scratch();
    let config = write_config(
        dir.path(),
        &format!(
            "database_url = \"{}\"\n[relay]\npoll_interval = \"50ms\"\n\n[[destinations]]\nname = \"file\"\ntype = \"webhook\"\nurl = \"{}\"\ntopics = [\"audit.*\"]\n",
            db.url, file_rx.url
        ),
    );
    let key = key();
    // Two relays: a change reaches both, with no restart.
    let mut relays = vec![
        relay(dir.path(), &config, Some(&key), "one"),
        relay(dir.path(), &config, Some(&key), "two"),
    ];
    for tag in ["one", "two"] {
        logged(dir.path(), tag, "relay started", 1).await;
    }

    // A definition that can never work is refused, naming the field; nothing is stored.
    let before = version(&db).await;
    for (args, field) in [
        (vec!["--type", "webhook", "--set", "url=ftp://x/"], "url:"),
        (
            vec![
                "--type",
                "webhook",
                "--set",
                "url=http://x/",
                "--filter",
                "payload.n >",
            ],
            "filter",
        ),
        (
            vec![
                "--type",
                "webhook",
                "--set",
                "url=http://x/",
                "--topic",
                "[x",
            ],
            "topics",
        ),
        (vec!["--type", "carrier-pigeon"], "type"),
    ] {
        let mut full = vec!["destinations", "add", "bad"];
        full.extend(args);
        let (code, _, err) = cli(&config, Some(&key), &full);
        assert_ne!(code, 0, "{full:?} must be refused");
        assert!(err.contains(field), "{full:?}: names {field}: {err}");
    }
    let (code, _, err) = cli(
        &config,
        Some(&key),
        &["destinations", "add", "file", "--type", "null"],
    );
    assert!(code != 0 && err.contains("configuration file"), "{err}");
    assert_eq!(version(&db).await, before, "nothing stored");

    // Added with a sealed secret: both relays send to it, signed; the secret is never shown.
    let (code, _, err) = add_customer(
        &config,
        Some(&key),
        &added_rx.url,
        &["--secret", &format!("secret={SECRET}")],
    );
    assert_eq!(code, 0, "{err}");
    for tag in ["one", "two"] {
        logged(dir.path(), tag, "configuration reloaded", 1).await;
    }
    let ids = db.insert_plain(20, "order.created").await;
    receives(&added_rx, &ids, "the added destination gets the events").await;
    assert!(added_rx.delivered().iter().all(|r| r
        .headers
        .get("webhook-signature")
        .is_some_and(|s| s.starts_with("v1,"))));
    let (code, shown, err) = cli(&config, Some(&key), &["destinations", "show", "customer-1"]);
    assert_eq!(code, 0, "{err}");
    assert!(!shown.contains("whsec_"), "{shown}");
    assert!(
        shown.contains("\"secret\""),
        "the sealed key is named: {shown}"
    );
    let stored: String = sqlx::query_scalar(
        "SELECT definition::text || encode(secrets, 'escape') FROM outbox_definitions",
    )
    .fetch_one(&db.pool)
    .await
    .expect("row");
    assert!(!stored.contains("whsec_"), "sealed at rest");

    // Its URL changed: the next events go to the new one.
    let (code, _, err) = cli(
        &config,
        Some(&key),
        &[
            "destinations",
            "update",
            "customer-1",
            "--set",
            &format!("url={}", moved_rx.url),
        ],
    );
    assert_eq!(code, 0, "{err}");
    for tag in ["one", "two"] {
        logged(dir.path(), tag, "configuration reloaded", 2).await;
    }
    let ids = db.insert_plain(10, "order.created").await;
    receives(&moved_rx, &ids, "the changed URL gets the next events").await;
    let (_, list, _) = cli(&config, Some(&key), &["destinations", "list"]);
    assert!(
        list.contains("file") && list.contains("customer-1"),
        "{list}"
    );

    // A relay without the key refuses to start, saying why.
    let mut keyless = relay(dir.path(), &config, None, "keyless");
    let status = exit_status(&mut keyless.0, Duration::from_secs(30)).await;
    assert!(
        status.is_some_and(|s| !s.success()),
        "refuses without the key"
    );
    assert!(log(dir.path(), "keyless").contains("PGOUTBOX_SECRETS_KEY is not set"));

    // Removing it while it has undelivered events is refused, naming the count; asked to drop
    // them, it goes and the audit log says how many.
    moved_rx.set(|_| Reply::status(503));
    let failing = db.insert_plain(5, "order.created").await;
    assert!(
        wait_for(Duration::from_secs(60), || async {
            db.count(&format!(
                "attempts > 0 AND id::text IN ('{}')",
                failing.join("','")
            ))
            .await
                == 5
        })
        .await,
        "the events fail"
    );
    let (code, _, err) = cli(
        &config,
        Some(&key),
        &["destinations", "remove", "customer-1"],
    );
    assert!(code != 0 && err.contains("5 undelivered"), "{err}");
    let (code, _, err) = cli(
        &config,
        Some(&key),
        &["destinations", "remove", "customer-1", "--drop-events"],
    );
    assert_eq!(code, 0, "{err}");
    let dropped: i64 = sqlx::query_scalar(
        "SELECT matched FROM outbox_audit WHERE action = 'destination.remove' ORDER BY id DESC LIMIT 1",
    )
    .fetch_one(&db.pool)
    .await
    .expect("audited");
    assert!(
        dropped >= 5,
        "the audit log counts what was dropped: {dropped}"
    );
    for tag in ["one", "two"] {
        logged(dir.path(), tag, "configuration reloaded", 3).await;
    }
    let actions: Vec<String> = sqlx::query_scalar("SELECT action FROM outbox_audit ORDER BY id")
        .fetch_all(&db.pool)
        .await
        .expect("audit");
    assert_eq!(
        actions,
        [
            "destination.add",
            "destination.update",
            "destination.remove"
        ]
    );

    // The file's destination went on throughout.
    let ids = db.insert_plain(5, "audit.x").await;
    receives(&file_rx, &ids, "the file's destination").await;
    for r in &mut relays {
        signal(&r.0, libc::SIGTERM);
    }
    for mut r in relays {
        assert!(exit_status(&mut r.0, Duration::from_secs(30))
            .await
            .is_some());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_checks_seals_pages_and_refuses_as_the_command_line_does() {
    let db = TestDb::migrated().await;
    let rx = Receiver::start().await;
    let config = parse_config(&webhook_config(&db, &rx.url, ""));
    let relay = Arc::new(pgoutbox::engine::Relay::new(db.pool.clone(), &config).expect("relay"));
    let admin: pgoutbox::config::AdminConfig =
        toml::from_str("token = \"op-token-123456\"").expect("admin");
    let store = relay.store().clone();
    let key = pgoutbox::definitions::Key::parse(&key()).expect("key");
    let catalog = pgoutbox::definitions::Catalog::new(
        store,
        Some(key),
        ["hooks".to_owned()].into_iter().collect(),
    );
    let console = pgoutbox::server::console::Console::new(relay, Default::default(), &admin)
        .with_catalog(catalog);
    let base = serve(console).await;
    let token = Some("op-token-123456");
    let url = |path: &str| format!("{base}/api/v1/destinations{path}");

    // Bad input: a 4xx naming the field; nothing stored.
    for (body, status, says) in [
        (
            json!({ "name": "x", "type": "webhook", "url": "ftp://h/" }),
            400,
            "url: scheme",
        ),
        (json!({ "name": "x y", "type": "null" }), 400, "name"),
        (
            json!({ "name": "x", "type": "null", "filter": "payload.n >" }),
            400,
            "filter",
        ),
        (
            json!({ "name": "x", "type": "webhook", "url": "http://h/", "secret": { "env": "HOME" } }),
            400,
            "secret",
        ),
        (
            json!({ "name": "hooks", "type": "null" }),
            409,
            "configuration file",
        ),
        (json!(["not", "an", "object"]), 422, "request body"),
    ] {
        let (got, answer) = api_call("POST", &url(""), token, Some(body.clone())).await;
        assert_eq!(got, status, "{body}: {answer}");
        assert!(
            answer["error"].as_str().is_some_and(|e| e.contains(says)),
            "{body}: {answer}"
        );
    }
    let (status, _) = api_call(
        "POST",
        &url(""),
        None,
        Some(json!({ "name": "x", "type": "null" })),
    )
    .await;
    assert_eq!(status, 401);
    let (_, page) = api_call("GET", &url(""), token, None).await;
    assert_eq!(page["destinations"], json!([]), "nothing stored");
    assert_eq!(page["file"], json!(["hooks"]));

    // 250 added; pages of 100 by name, searched.
    for i in 0..250 {
        let body = json!({
            "name": format!("c-{i:04}"), "type": "webhook", "url": format!("http://127.0.0.1:9/{i}?token=abcdefgh"),
            "topics": [format!("t.{i}")], "secret": SECRET,
        });
        let (status, answer) = api_call("POST", &url(""), token, Some(body)).await;
        assert_eq!(status, 201, "{answer}");
    }
    let (status, _) = api_call(
        "POST",
        &url(""),
        token,
        Some(json!({ "name": "c-0001", "type": "null" })),
    )
    .await;
    assert_eq!(status, 409, "the name is taken");
    let mut seen = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let q = after
            .as_ref()
            .map(|a| format!("?after={a}"))
            .unwrap_or_default();
        let (status, page) = api_call("GET", &url(&q), token, None).await;
        assert_eq!(status, 200, "{page}");
        let text = page.to_string();
        assert!(
            !text.contains("whsec_") && !text.contains("abcdefgh"),
            "no secret shown"
        );
        for d in page["destinations"].as_array().expect("list") {
            seen.push(d["name"].as_str().expect("name").to_owned());
        }
        match page["next_after"].as_str() {
            Some(next) => after = Some(next.to_owned()),
            None => break,
        }
    }
    assert_eq!(seen.len(), 250);
    assert!(seen.windows(2).all(|w| w[0] < w[1]), "by name, each once");
    let (_, found) = api_call("GET", &url("?search=C-0123"), token, None).await;
    assert_eq!(found["destinations"][0]["name"], "c-0123");
    assert_eq!(found["destinations"].as_array().map(Vec::len), Some(1));
    let (_, one) = api_call("GET", &url("/c-0007"), token, None).await;
    assert_eq!(one["secrets"], json!(["secret", "url"]), "{one}");
    assert_eq!(one["definition"]["url"], "http://127.0.0.1:9/7?token=***");
    assert_eq!(one["undelivered"], 0);

    // A merge patch: the sealed secret is kept, the topic changes; a bad patch changes nothing.
    let (status, answer) = api_call(
        "PATCH",
        &url("/c-0007"),
        token,
        Some(json!({ "topics": ["x.*"] })),
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    let (status, answer) = api_call(
        "PATCH",
        &url("/c-0007"),
        token,
        Some(json!({ "max_attempts": 0 })),
    )
    .await;
    assert!(
        status == 400
            && answer["error"]
                .as_str()
                .is_some_and(|e| e.contains("max_attempts")),
        "{answer}"
    );
    let (_, one) = api_call("GET", &url("/c-0007"), token, None).await;
    assert_eq!(one["definition"]["topics"], json!(["x.*"]));
    assert_eq!(one["secrets"], json!(["secret", "url"]));
    let (status, _) = api_call("PATCH", &url("/nope"), token, Some(json!({ "topics": [] }))).await;
    assert_eq!(status, 404);

    // Removed; then gone.
    let (status, _) = api_call("DELETE", &url("/c-0007"), token, None).await;
    assert_eq!(status, 200);
    let (status, _) = api_call("GET", &url("/c-0007"), token, None).await;
    assert_eq!(status, 404);
    let (status, _) = api_call("DELETE", &url("/hooks"), token, None).await;
    assert_eq!(status, 409, "the file's destination is changed in the file");

    let (_, openapi) = api_call("GET", &format!("{base}/api/openapi.json"), None, None).await;
    for path in ["/api/v1/destinations", "/api/v1/destinations/{name}"] {
        assert!(openapi["paths"].get(path).is_some(), "OpenAPI lacks {path}");
    }
    let audited: i64 =
        sqlx::query_scalar("SELECT count(*) FROM outbox_audit WHERE via = 'console'")
            .fetch_one(&db.pool)
            .await
            .expect("audit");
    assert_eq!(audited, 250 + 1 + 1, "every change, and only the changes");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_in_the_file_and_at_runtime_is_a_clear_error_at_start() {
    let db = TestDb::migrated().await;
    let dir = scratch();
    let head = format!("database_url = \"{}\"\n", db.url);
    let config = write_config(
        dir.path(),
        &format!("{head}[[destinations]]\nname = \"a\"\ntype = \"null\"\n"),
    );
    let (code, _, err) = cli(
        &config,
        None,
        &["destinations", "add", "shared", "--type", "null"],
    );
    assert_eq!(code, 0, "{err}");
    // A secret without the key: refused, nothing stored.
    let (code, _, err) = cli(
        &config,
        None,
        &[
            "destinations",
            "add",
            "s",
            "--type",
            "webhook",
            "--set",
            "url=http://h/",
            "--secret",
            &format!("secret={SECRET}"),
        ],
    );
    assert!(
        code != 0 && err.contains("PGOUTBOX_SECRETS_KEY is not set"),
        "{err}"
    );
    // `status` counts untried events for the destinations added at runtime too.
    db.insert_plain(3, "order.created").await;
    let (code, status, err) = cli(&config, None, &["status", "--json"]);
    assert_eq!(code, 0, "{err}");
    assert!(status.contains("\"shared\""), "{status}");
    let clash = write_config(
        dir.path(),
        &format!("{head}[[destinations]]\nname = \"shared\"\ntype = \"null\"\n"),
    );
    let (code, _, err) = cli(&clash, None, &["relay", "--once"]);
    assert_ne!(code, 0);
    assert!(
        err.contains("\"shared\" is both in the configuration file and added at runtime"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runtime_destination_that_is_down_does_not_make_the_relay_unready() {
    let db = TestDb::migrated().await;
    let rx = Receiver::start().await;
    let mut config = parse_config(&webhook_config(&db, &rx.url, ""));
    let down = format!("http://127.0.0.1:{}/hook", closed_port());
    let definition = json!({ "name": "customer-down", "type": "webhook", "url": down });
    let serde_json::Value::Object(definition) = definition else {
        unreachable!()
    };
    config.destinations.push(std::sync::Arc::new(
        pgoutbox::definitions::check(&definition).expect("valid"),
    ));
    let relay = pgoutbox::engine::Relay::new(db.pool.clone(), &config).expect("relay");
    let lines = relay
        .readiness()
        .await
        .expect("ready: the file's destination is up");
    assert!(
        !lines.iter().any(|l| l.contains("customer-down")),
        "{lines:?}"
    );
    let asked = relay
        .readiness_of(Some("customer-down"))
        .await
        .expect_err("asked by name, it answers that it is down");
    assert!(
        asked
            .iter()
            .any(|l| l.starts_with("destination customer-down: not ready")),
        "{asked:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_reads_and_checks_again_only_the_definitions_that_changed() {
    let db = TestDb::migrated().await;
    let store =
        pgoutbox::store::Store::new(db.pool.clone(), pgoutbox::OutboxTable::default_table());
    let catalog = pgoutbox::definitions::Catalog::new(store.clone(), None, Default::default());
    let by = pgoutbox::definitions::Actor {
        who: "test",
        via: "cli",
    };
    let hook = |name: &str| {
        let serde_json::Value::Object(d) = json!({
            "name": name, "type": "webhook", "url": "http://127.0.0.1:9/hook", "topics": ["t"],
        }) else {
            unreachable!()
        };
        d
    };
    for name in ["a", "b", "c"] {
        catalog.add(hook(name), by).await.expect("add");
    }
    let first = pgoutbox::definitions::load(&store, None)
        .await
        .expect("load");
    let names = |l: &pgoutbox::definitions::Loaded| -> Vec<String> {
        l.destinations.iter().map(|d| d.name.clone()).collect()
    };
    assert_eq!(names(&first), ["a", "b", "c"]);

    // Nothing changed: every definition is the one held.
    let same = pgoutbox::definitions::reload(&store, None, &first)
        .await
        .expect("reload");
    assert_eq!(same.version, first.version);
    for (held, read) in first.destinations.iter().zip(&same.destinations) {
        assert!(Arc::ptr_eq(held, read), "{} read again", held.name);
    }

    // b changed, c removed, d added: those are read; a is the one held.
    catalog
        .update("b", &json!({ "topics": ["u"] }), by)
        .await
        .expect("update");
    catalog.remove("c", false, by).await.expect("remove");
    catalog.add(hook("d"), by).await.expect("add");
    let next = pgoutbox::definitions::reload(&store, None, &same)
        .await
        .expect("reload");
    assert_eq!(names(&next), ["a", "b", "d"]);
    assert!(next.version > same.version);
    assert!(Arc::ptr_eq(&next.destinations[0], &same.destinations[0]));
    assert!(!Arc::ptr_eq(&next.destinations[1], &same.destinations[1]));
    assert_eq!(
        next.destinations[1].subscription.topics,
        ["u".to_owned()],
        "b as changed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runtime_change_is_applied_while_the_file_is_being_edited() {
    let db = TestDb::migrated().await;
    let (file_rx, added_rx) = (Receiver::start().await, Receiver::start().await);
    let dir = scratch();
    let text = format!(
        "database_url = \"{}\"\n[relay]\npoll_interval = \"50ms\"\n\n[[destinations]]\nname = \"file\"\ntype = \"webhook\"\nurl = \"{}\"\ntopics = [\"audit.*\"]\n",
        db.url, file_rx.url
    );
    let config = write_config(dir.path(), &text);
    let _relay = relay(dir.path(), &config, None, "one");
    logged(dir.path(), "one", "relay started", 1).await;

    // The operator is halfway through an edit of the file: a change made at runtime meanwhile is
    // applied all the same (it reads the changed definitions, not the file).
    let cli_config = dir.path().join("cli.toml");
    std::fs::write(&cli_config, &text).expect("the command line's copy");
    std::fs::write(&config, "[[destinations]\nname = ").expect("edit");
    let (code, _, err) = add_customer(&cli_config, None, &added_rx.url, &[]);
    assert_eq!(code, 0, "{err}");
    logged(dir.path(), "one", "configuration reloaded", 1).await;
    let ids = db.insert_plain(10, "order.created").await;
    receives(&added_rx, &ids, "the added destination gets the events").await;
    let ids = db.insert_plain(5, "audit.read").await;
    receives(&file_rx, &ids, "the file's destination still gets its own").await;
    assert!(
        !log(dir.path(), "one").contains("not reloaded"),
        "{}",
        log(dir.path(), "one")
    );
}
