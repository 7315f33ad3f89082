//! A quick smoke run of `pgoutbox bench` at small sizes: every scenario runs and reports. The
//! numbers themselves are for humans (docs/performance.md), never asserted here.

mod common;

use common::*;

fn bench(args: &[&str]) -> Vec<serde_json::Value> {
    bench_on(&server_url(), args)
}

/// `pgoutbox bench --json` on `server` (a URL without a database), its JSON lines.
fn bench_on(server: &str, args: &[&str]) -> Vec<serde_json::Value> {
    let url = format!("{server}/postgres");
    let mut full = vec!["bench", "--database-url", &url, "--json"];
    full.extend_from_slice(args);
    let (code, out, err) = run(&full);
    assert_eq!(code, 0, "bench {args:?} failed: {err}");
    out.lines()
        .map(|l| serde_json::from_str(l).expect("JSON line"))
        .collect()
}

/// The variants of `scenario`'s rows among `rows` (the first line, the header, left out).
fn variants(rows: &[serde_json::Value], scenario: &str) -> Vec<String> {
    rows[1..]
        .iter()
        .filter(|r| r["scenario"] == scenario)
        .map(|r| r["variant"].as_str().unwrap_or_default().to_owned())
        .collect()
}

#[test]
fn drain_sql_limit_and_baseline_report() {
    let rows = bench(&[
        "drain",
        "--events",
        "3000",
        "--sinks",
        "null,stdout,webhook",
    ]);
    assert!(
        rows[0]["postgres"].is_string() && rows[0]["cores"].is_number(),
        "header first: {:?}",
        rows[0]
    );
    let variants: Vec<String> = rows[1..]
        .iter()
        .map(|r| format!("{} {}", r["scenario"], r["variant"]))
        .collect();
    for expected in [
        "\"drain\" \"null, delete\"",
        "\"drain\" \"webhook, keep\"",
        "\"drain\" \"stdout, delete\"",
        "\"sql-limit\" \"keep, batch 1000\"",
        "\"baseline\"",
    ] {
        assert!(
            variants.iter().any(|v| v.starts_with(expected)),
            "{expected} missing from {variants:?}"
        );
    }
    assert!(rows[1..]
        .iter()
        .all(|r| r["value"].as_f64().is_some_and(|v| v > 0.0)));
}

#[test]
fn steady_and_history_report() {
    let rows = bench(&[
        "steady",
        "--rate",
        "200",
        "--duration",
        "2s",
        "--cost-connections",
        "4",
        "--cost-duration",
        "1s",
        "--idle",
        "1s",
    ]);
    let scenarios: Vec<&str> = rows[1..]
        .iter()
        .filter_map(|r| r["scenario"].as_str())
        .collect();
    assert!(
        scenarios.contains(&"steady")
            && scenarios.contains(&"idle")
            && scenarios.contains(&"producers")
            && scenarios.contains(&"timeline"),
        "{scenarios:?}"
    );
    // The producers' cost includes the schema's, against the minimal table.
    assert!(
        rows.iter().any(|r| r["unit"] == "× minimal"),
        "no schema-cost row"
    );
    let rows = bench(&["history", "--history-rows", "20000", "--events", "3000"]);
    assert!(rows.iter().any(|r| r["variant"] == "ratio"));
    let rows = bench(&["ordering", "--events", "4000", "--keys", "100"]);
    assert_eq!(
        rows.iter().filter(|r| r["scenario"] == "ordering").count(),
        2
    );
}

#[test]
fn migrate_reports_the_producers_stalls() {
    let rows = bench(&[
        "migrate",
        "--rows",
        "20000",
        "--producers",
        "2",
        "--alone",
        "1s",
    ]);
    let variants: Vec<&str> = rows[1..]
        .iter()
        .filter(|r| r["scenario"] == "migrate")
        .filter_map(|r| r["variant"].as_str())
        .collect();
    assert_eq!(variants.len(), 4, "{variants:?}");
    assert!(variants.contains(&"longest INSERT"), "{variants:?}");
}

#[test]
fn soak_reports_each_interval_and_draws_its_curves() {
    let dir = tempfile::tempdir().expect("tempdir");
    let csv = dir.path().join("soak.csv");
    let svg = dir.path().join("soak.svg");
    let rows = bench(&[
        "soak",
        "--events",
        "3000",
        "--rate",
        "1000",
        "--retention",
        "1s",
        "--cleanup-interval",
        "1s",
        "--every",
        "1s",
        "--csv",
        csv.to_str().expect("utf-8"),
        "--plot",
        svg.to_str().expect("utf-8"),
    ]);
    let variants = variants(&rows, "soak");
    for mode in ["keep", "delete"] {
        assert!(
            variants
                .iter()
                .any(|v| v.starts_with(&format!("{mode} minute"))),
            "{variants:?}"
        );
        let verdict = rows
            .iter()
            .find(|r| r["variant"] == format!("{mode}: last / first interval p99"))
            .unwrap_or_else(|| panic!("no {mode} verdict in {variants:?}"));
        assert!(
            verdict["detail"]
                .as_str()
                .is_some_and(|d| d.contains("3000 of 3000 delivered")),
            "{verdict}"
        );
    }
    let table = std::fs::read_to_string(&csv).expect("csv");
    assert!(table.starts_with("mode,minute,delivered,claim_p99_ms"));
    assert!(
        table.lines().any(|l| l.starts_with("keep,"))
            && table.lines().any(|l| l.starts_with("delete,"))
    );
    let plot = std::fs::read_to_string(&svg).expect("svg");
    assert!(plot.starts_with("<svg") && plot.contains("<polyline"));
}

#[test]
fn the_wal_scenarios_refuse_what_cannot_run_and_report_on_a_logical_server() {
    let url = format!("{}/postgres", server_url());
    // emit() events are invisible to a polling relay: refused before anything is created.
    let (code, _, err) = run(&[
        "bench",
        "--database-url",
        &url,
        "steady",
        "--producer",
        "emit",
    ]);
    assert_ne!(code, 0);
    assert!(err.contains("--producer emit needs --source wal"), "{err}");
    // The shared server (wal_level = replica in CI) cannot serve a slot: a clear error naming
    // the setting. On a server set up for logical decoding, the scenario runs instead.
    let (code, out, err) = run(&[
        "bench",
        "--database-url",
        &url,
        "--json",
        "catchup",
        "--events",
        "1000",
    ]);
    if code == 0 {
        assert!(out.contains("pg_recvlogical"), "{out}");
    } else {
        assert!(err.contains("wal_level = logical"), "{err}");
    }

    let mut pg = common::logical::LogicalPg::start(&[]);
    let server = pg.server_url();
    for producer in ["insert", "emit"] {
        let rows = bench_on(
            &server,
            &[
                "catchup",
                "--events",
                "3000",
                "--per-transaction",
                "500",
                "--batch-size",
                "1000,2000",
                "--producer",
                producer,
            ],
        );
        let variants = variants(&rows, "catchup");
        for expected in [
            format!("backlog, {producer}"),
            "pg_recvlogical → /dev/null".into(),
            "relay wal → null, batch 2000, delete".into(),
            "relay / pg_recvlogical, batch 1000".into(),
        ] {
            assert!(
                variants.contains(&expected),
                "{expected} missing: {variants:?}"
            );
        }
        // Every event reached the null sink (the relay's own counter).
        let relay = rows
            .iter()
            .find(|r| r["variant"] == "relay wal → null, batch 1000, delete")
            .expect("relay row");
        assert!(
            relay["detail"]
                .as_str()
                .is_some_and(|d| d.contains("3000 events published")),
            "{relay}"
        );
    }
    let rows = bench_on(
        &server,
        &[
            "steady",
            "--source",
            "wal",
            "--producer",
            "emit",
            "--rate",
            "200",
            "--duration",
            "2s",
            "--cost-connections",
            "4",
            "--cost-duration",
            "1s",
            "--cost-pairs",
            "1",
            "--idle",
            "0s",
            "--timeline",
            "false",
        ],
    );
    let steady = rows
        .iter()
        .find(|r| r["scenario"] == "steady" && r["unit"] == "ms p50")
        .expect("steady row");
    assert!(
        steady["variant"]
            .as_str()
            .is_some_and(|v| v.starts_with("wal, emit(), ")),
        "{steady}"
    );
    assert!(
        rows.iter().any(|r| r["unit"] == "× minimal INSERT"),
        "no emit() cost ratio"
    );
    // The scratch database and its slots are gone: nothing pins the server's WAL.
    let left = tokio::runtime::Runtime::new()
        .expect("runtime")
        .block_on(async {
            let pool = sqlx::PgPool::connect(&format!("{server}/postgres"))
                .await
                .expect("connect");
            let left: (i64, i64) = sqlx::query_as(
                "SELECT (SELECT count(*) FROM pg_replication_slots),
                        (SELECT count(*) FROM pg_database WHERE datname LIKE 'pgoutbox_bench_%')",
            )
            .fetch_one(&pool)
            .await
            .expect("query");
            left
        });
    assert_eq!(left, (0, 0), "slots and scratch databases left behind");
    pg.stop();
}

#[test]
fn memory_and_a_held_xmin_report() {
    let pg = common::logical::LogicalPg::start(&[]);
    let rows = bench_on(
        &pg.server_url(),
        &[
            "memory",
            "--events",
            "2000",
            "--rate",
            "200",
            "--duration",
            "2s",
            "--hold",
            "1s",
        ],
    );
    for source in ["poll", "wal"] {
        let row = rows
            .iter()
            .find(|r| {
                r["scenario"] == "memory"
                    && r["variant"].as_str().is_some_and(|v| {
                        v.starts_with(&format!("{source}, 1 of 2 destinations down"))
                    })
            })
            .unwrap_or_else(|| panic!("no {source} row in {rows:?}"));
        assert!(row["value"].as_f64().is_some_and(|mib| mib > 0.0), "{row}");
        assert!(
            row["detail"]
                .as_str()
                .is_some_and(|d| d.contains("2000 events due at start")),
            "{row}"
        );
    }
    let rows = bench(&[
        "soak",
        "--modes",
        "delete",
        "--events",
        "3000",
        "--rate",
        "1000",
        "--every",
        "1s",
        "--hold-xmin",
        "1s",
        "--hold-xmin-at",
        "1s",
    ]);
    assert!(
        rows.iter().any(|r| r["variant"]
            .as_str()
            .is_some_and(|v| v.starts_with("delete: xmin held minute"))),
        "{rows:?}"
    );
}

#[test]
fn routing_and_destinations_report_every_count() {
    let rows = bench(&["routing", "--counts", "1,50", "--events", "2000"]);
    let routing: Vec<&serde_json::Value> = rows[1..].iter().collect();
    assert_eq!(routing.len(), 2, "{routing:?}");
    assert!(routing
        .iter()
        .all(|r| r["unit"] == "ns/event" && r["value"].as_f64().is_some_and(|v| v > 0.0)));

    let rows = bench(&[
        "destinations",
        "--counts",
        "1,5",
        "--events",
        "500",
        "--idle",
        "1s",
    ]);
    let variants = variants(&rows, "destinations");
    for count in ["1", "5"] {
        for what in [
            "start → ready",
            "connections held",
            "drain",
            "/metrics scrape, idle",
            "/metrics scrape after the drain",
        ] {
            let expected = format!("{count}: {what}");
            assert!(
                variants.contains(&expected),
                "{expected} missing: {variants:?}"
            );
        }
    }
    let drains = rows[1..].iter().filter(|r| {
        r["variant"]
            .as_str()
            .is_some_and(|v| v.ends_with(": drain"))
    });
    assert!(drains
        .into_iter()
        .all(|r| r["value"].as_f64().is_some_and(|v| v > 0.0)));
}

#[test]
fn fairness_reports_both_runs_and_no_empty_figure() {
    // Shorter than the first 5 s: the "after 5 s" figures have no events and are left out.
    let rows = bench(&[
        "fairness",
        "--destinations",
        "20",
        "--failing",
        "10",
        "--backlog",
        "200",
        "--rate",
        "50",
        "--duration",
        "2s",
    ]);
    let variants = variants(&rows, "fairness");
    for expected in [
        "without: healthy commit→delivery p99",
        "with: healthy commit→delivery p99",
        "with: healthy events delivered",
        "with: backlog delivered meanwhile",
    ] {
        assert!(
            variants.iter().any(|v| v == expected),
            "{expected} missing: {variants:?}"
        );
    }
    assert!(
        !variants.iter().any(|v| v.ends_with("after 5 s")),
        "no figure for the seconds after a 2 s run: {variants:?}"
    );
    assert!(
        rows[1..].iter().all(|r| r["value"].as_f64().is_some()),
        "every figure is a number: {rows:?}"
    );
}
