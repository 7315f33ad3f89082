//! The gate's table tests: admission, the breaker's counting, silence, probes.

use super::*;

fn gate(failures: u32, concurrency: Option<usize>) -> Gate {
    Gate::new(
        "d",
        BreakerPolicy {
            failures,
            ..BreakerPolicy::default()
        },
        concurrency,
    )
}

#[test]
fn a_failure_of_a_request_older_than_the_close_is_not_counted() {
    let g = gate(2, None);
    let fail = || Outcome::retry("timed out");
    let before = std::time::Instant::now();
    assert_eq!(g.answered(&fail()), Counted::Attempt);
    assert_eq!(g.answered(&fail()), Counted::Tripped);
    g.close();
    // Requests out since before the close time out now: retried, not counted.
    for _ in 0..5 {
        assert_eq!(g.answered_to(&fail(), Some(before)), Counted::Attempt);
    }
    assert!(g.is_open(), "the breaker stays closed");
    // A request started after the close counts as usual.
    let after = std::time::Instant::now();
    assert_eq!(g.answered_to(&fail(), Some(after)), Counted::Attempt);
    assert_eq!(g.answered_to(&fail(), Some(after)), Counted::Tripped);
}

#[test]
fn silence_counts_from_the_last_answer_or_the_first_request_out() {
    let g = gate(10, None);
    let later = |s: u64| std::time::Instant::now() + Duration::from_secs(s);
    assert_eq!(g.silent_for(later(60)), Duration::ZERO, "nothing out");
    let first = g.try_admit(false).expect("admitted");
    let second = g.try_admit(false).expect("admitted");
    assert!(
        g.silent_for(later(5)) >= Duration::from_secs(5),
        "out, no answer"
    );
    g.answered(&Outcome::Delivered);
    drop(first);
    let silent = g.silent_for(later(2));
    assert!(
        silent >= Duration::from_secs(2) && silent < Duration::from_secs(3),
        "counted from the answer: {silent:?}"
    );
    drop(second);
    assert_eq!(g.silent_for(later(60)), Duration::ZERO, "none out any more");
    // An answer long ago does not make a new request silent.
    let _third = g.try_admit(false).expect("admitted");
    assert!(g.silent_for(std::time::Instant::now()) < Duration::from_secs(1));
}

#[test]
fn a_destination_whose_requests_time_out_stays_silent_until_it_answers() {
    let g = gate(10, None);
    let later = |s: u64| std::time::Instant::now() + Duration::from_secs(s);
    let started = std::time::Instant::now();
    let hung = g.try_admit(false).expect("admitted");
    let timeout = Outcome::retry("request timed out");
    assert_eq!(g.timed_out(&timeout, Some(started)), Counted::Attempt);
    drop(hung);
    // Nothing is out, but the last request got no answer: silent since it started, so a new
    // batch's lane for it is handed over at its first look.
    assert!(g.silent_for(later(10)) >= Duration::from_secs(10));
    let next = g.try_admit(false).expect("admitted");
    assert!(
        g.silent_for(later(1)) >= Duration::from_secs(1),
        "a new request does not make it heard"
    );
    // Any answer, a failure too, is news: silence counts from it again.
    g.answered(&Outcome::retry("HTTP 503"));
    drop(next);
    assert_eq!(g.silent_for(later(60)), Duration::ZERO, "heard, none out");
}

#[test]
fn failures_in_a_row_open_the_breaker_and_later_failures_are_held() {
    let g = gate(3, None);
    let fail = Outcome::retry("HTTP 503");
    assert_eq!(g.answered(&fail), Counted::Attempt);
    assert_eq!(g.answered(&Outcome::Delivered), Counted::Attempt);
    assert_eq!(g.answered(&fail), Counted::Attempt);
    assert_eq!(g.answered(&fail), Counted::Attempt);
    assert!(g.is_open());
    assert_eq!(g.answered(&fail), Counted::Tripped);
    assert!(!g.is_open());
    assert_eq!(g.take_tripped().as_deref(), Some("HTTP 503"));
    assert_eq!(g.take_tripped(), None);
    assert_eq!(g.answered(&fail), Counted::Held);
    assert!(g.problem().is_some_and(|p| p.contains("open")));
    g.close();
    assert!(g.is_open());
}

#[test]
fn a_rejection_proves_the_destination_is_up() {
    let g = gate(2, None);
    let fail = Outcome::retry("timeout");
    assert_eq!(g.answered(&fail), Counted::Attempt);
    let rejected = Outcome::Rejected {
        reason: "HTTP 400".into(),
    };
    assert_eq!(g.answered(&rejected), Counted::Attempt);
    assert_eq!(g.answered(&fail), Counted::Attempt);
    assert!(g.is_open());
}

#[test]
fn zero_failures_turns_the_breaker_off() {
    let g = gate(0, None);
    for _ in 0..100 {
        assert_eq!(g.answered(&Outcome::retry("x")), Counted::Attempt);
    }
    assert!(g.is_open());
}

#[test]
fn probes_back_off_up_to_the_cap() {
    let g = gate(1, None);
    let d: Vec<u64> = (0..6).map(|n| g.probe_delay(n).as_secs()).collect();
    assert_eq!(d, vec![1, 2, 4, 8, 15, 15]);
}

/// (in flight, concurrency, failures in a row, breaker.failures, proven, held) → may start.
#[test]
fn admission_table() {
    type Case = ((usize, usize, u32, u32, bool, bool), bool);
    let cases: &[Case] = &[
        // A proven, healthy destination: concurrency is the only limit.
        ((0, 64, 0, 10, true, false), true),
        ((63, 64, 0, 10, true, false), true),
        ((64, 64, 0, 10, true, false), false),
        // Held: nothing starts.
        ((0, 64, 0, 10, true, true), false),
        // Unproven (just started): no more in flight than the failures that open the breaker.
        ((9, 64, 0, 10, false, false), true),
        ((10, 64, 0, 10, false, false), false),
        // Failing now and then: the whole concurrency.
        ((40, 64, 4, 10, true, false), true),
        // Halfway to the breaker: each failure in a row leaves room for one fewer.
        ((4, 64, 5, 10, true, false), true),
        ((5, 64, 5, 10, true, false), false),
        ((0, 64, 9, 10, true, false), true),
        ((1, 64, 9, 10, true, false), false),
        // Concurrency lower than the breaker's count still wins.
        ((2, 2, 0, 10, false, false), false),
        // No breaker: concurrency alone.
        ((50, 64, 30, 0, false, false), true),
        ((64, 64, 30, 0, false, false), false),
    ];
    for &((in_flight, concurrency, failures, breaker, proven, held), expected) in cases {
        let a = Admission {
            in_flight,
            concurrency,
            failures_in_a_row: failures,
            breaker_failures: breaker,
            proven,
            held,
        };
        assert_eq!(may_start(&a), expected, "{a:?}");
    }
}

#[test]
fn a_destination_down_from_the_start_gets_at_most_its_breaker_failures() {
    let g = gate(10, Some(64));
    let mut permits: Vec<Permit<'_>> = Vec::new();
    while let Some(p) = g.try_admit(false) {
        permits.push(p);
    }
    assert_eq!(permits.len(), 10, "unproven: ten at once");
    let mut sent = permits.len();
    while let Some(p) = permits.pop() {
        drop(p);
        let counted = g.answered(&Outcome::retry("HTTP 401"));
        if counted == Counted::Tripped {
            break;
        }
        if let Some(p) = g.try_admit(false) {
            sent += 1;
            permits.push(p);
        }
    }
    assert_eq!(
        sent, 10,
        "no request starts after a failure while ten are out"
    );
    assert!(!g.is_open());
    assert!(g.try_admit(false).is_none());
    assert!(g.try_admit(true).is_some(), "a probe always goes");
}

#[test]
fn the_summary_counts_since_the_last_one() {
    let g = gate(0, None);
    g.answered(&Outcome::retry("HTTP 503"));
    g.answered(&Outcome::Delivered);
    g.answered(&Outcome::retry("HTTP 502"));
    let s = g.take_summary();
    assert_eq!((s.failed, s.delivered), (2, 1));
    assert_eq!(s.last_error.as_deref(), Some("HTTP 502"));
    assert_eq!(g.take_summary(), Summary::default());
}

#[test]
fn a_gate_is_quiet_once_hushed_with_nothing_to_report_until_it_is_used() {
    let g = gate(1, None);
    assert!(!g.is_quiet(), "a new gate is looked at once");
    assert!(g.hush() && g.is_quiet());
    assert!(g.is_open() && g.state() == (BreakerState::Closed, false));
    assert_eq!(g.in_flight(), 0);
    assert!(g.is_quiet(), "reading its state does not stir it");

    // An answer stirs it; it stays looked at while its summary waits to be taken.
    assert_eq!(g.answered(&Outcome::Delivered), Counted::Attempt);
    assert!(!g.is_quiet());
    assert!(!g.hush(), "its summary is not taken yet");
    assert_eq!(g.take_summary().delivered, 1);
    assert!(g.hush());

    // A breaker it opened: stored first, and an open breaker is never quiet (probes).
    assert!(!g.has_tripped());
    assert_eq!(g.answered(&Outcome::retry("HTTP 503")), Counted::Tripped);
    assert!(g.has_tripped() && !g.is_quiet());
    g.take_summary();
    assert!(!g.hush(), "a breaker to store");
    assert_eq!(g.take_tripped().as_deref(), Some("HTTP 503"));
    assert!(!g.has_tripped());
    assert!(!g.hush(), "open");
    g.close();
    assert!(g.hush());

    // Another relay's state adopted (a pause) stirs it too.
    let paused = crate::store::destinations::DestinationState {
        name: "d".into(),
        paused_at: Some(Utc::now()),
        breaker: "closed".into(),
        breaker_since: Utc::now(),
        last_error: None,
        failed_probes: 0,
        probe_at: None,
    };
    g.adopt(&paused);
    assert!(!g.is_quiet() && !g.hush(), "paused");
}
