//! A quick smoke run of `pgoutbox bench` at small sizes: every scenario runs and reports. The
//! numbers themselves are for humans (docs/performance.md), never asserted here.

mod common;

use common::*;

fn bench(args: &[&str]) -> Vec<serde_json::Value> {
    let url = format!("{}/postgres", server_url());
    let mut full = vec!["bench", "--database-url", &url, "--json"];
    full.extend_from_slice(args);
    let (code, out, err) = run(&full);
    assert_eq!(code, 0, "bench {args:?} failed: {err}");
    out.lines()
        .map(|l| serde_json::from_str(l).expect("JSON line"))
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
    let variants: Vec<String> = rows[1..]
        .iter()
        .filter(|r| r["scenario"] == "soak")
        .map(|r| r["variant"].as_str().unwrap_or_default().to_owned())
        .collect();
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
