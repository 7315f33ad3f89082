//! `pgoutbox demo`, the README's first command, read as a person reads it: a few plain lines
//! saying what it did, no colour codes in a pipe, the migration's steps only with `-v`.

mod common;

use common::*;

/// Runs `pgoutbox demo` on `db` with default logging (no `RUST_LOG`), stderr piped, plus `args`.
fn demo(db: &TestDb, args: &[&str]) -> (bool, String) {
    let out = pgoutbox()
        .env_remove("RUST_LOG")
        .env_remove("NO_COLOR")
        .args(["demo", "--database-url", &db.url])
        .args(args)
        .output()
        .expect("run pgoutbox demo");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test]
async fn the_demo_tells_its_story_in_a_few_plain_lines() {
    let db = TestDb::empty().await;
    let (ok, err) = demo(&db, &[]);
    assert!(ok, "demo failed:\n{err}");
    assert!(!err.contains('\u{1b}'), "colour codes in a pipe:\n{err}");
    assert!(
        !err.contains("migration step done") && !err.contains("migration applied"),
        "migration steps at info:\n{err}"
    );
    assert!(
        err.contains("migrated from version 0"),
        "one summary line:\n{err}"
    );
    assert_eq!(
        err.matches(" INFO ").count(),
        1,
        "one log line at info:\n{err}"
    );
    assert!(err.contains("summary: committed 8"), "{err}");
    let lines = err.lines().count();
    assert!(lines <= 12, "{lines} lines on stderr:\n{err}");

    // With -v the steps are there for whoever wants them.
    let (ok, verbose) = demo(&db, &["-v"]);
    assert!(ok, "demo -v failed:\n{verbose}");
    assert!(verbose.contains("migration step done"), "{verbose}");
}
