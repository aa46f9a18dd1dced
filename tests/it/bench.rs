//! `gatehouse bench --quick` runs end to end (figures are not asserted: this machine is noisy).

use std::process::Command;

use serde_json::Value;

use crate::helpers::bin;

/// `gatehouse bench --quick --json ARGS`, which must succeed: its report.
fn bench_json(args: &[&str]) -> Value {
    let out = Command::new(bin())
        .args(["bench", "--quick", "--json"])
        .args(args)
        .output()
        .expect("run bench");
    assert!(
        out.status.success(),
        "bench failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("bench JSON")
}

/// A turn-shaped section's rows: one per default level, each with a rate and as many floor calls
/// as measured operations.
fn levels_report<'a>(report: &'a Value, section: &str) -> &'a Vec<Value> {
    let rows = report[section].as_array().expect(section);
    assert_eq!(
        rows.iter()
            .map(|t| t["sessions"].as_u64())
            .collect::<Vec<_>>(),
        [Some(1), Some(16), Some(256)],
        "{section}"
    );
    assert!(
        rows.iter().all(
            |t| t["turn"]["per_second"].as_f64().is_some_and(|r| r > 0.0)
                && t["floor"]["count"] == t["turn"]["count"]
        ),
        "{section}: {rows:?}"
    );
    rows
}

#[test]
fn the_quick_benchmark_runs_and_reports_every_section() {
    let report = bench_json(&["--parked", "100"]);
    assert!(
        report["raw_commit"]["per_second"]
            .as_f64()
            .is_some_and(|r| r > 0.0),
        "{report}"
    );
    // Ratios are against the faster of the two raw measurements.
    let best = report["raw_commit"]["per_second"]
        .as_f64()
        .zip(report["raw_commit_end"]["per_second"].as_f64())
        .map(|(a, b)| a.max(b));
    let taken = report["raw_commit_best_per_second"].as_f64();
    assert!(
        best.zip(taken)
            .is_some_and(|(b, t)| (b - t).abs() <= 0.01 * b),
        "{report}"
    );
    // The admission's own transaction, committed alone in the bench's process: as many commits
    // as the raw baseline, its ratio against the same raw rate as the daemon's.
    let own = &report["admission_own_commit"];
    assert_eq!(own["count"], report["raw_commit"]["count"], "{report}");
    assert!(
        own["per_second"]
            .as_f64()
            .zip(own["ratio_to_raw_commit"].as_f64())
            .zip(taken)
            .is_some_and(|((rate, ratio), best)| rate > 0.0 && (rate / best - ratio).abs() < 0.01),
        "{report}"
    );
    // The machine's thread hand-off, on one CPU and (with two or more) across two.
    let handoff = &report["machine"]["handoff"];
    assert!(
        handoff["same_cpu"]["p50_us"]
            .as_f64()
            .is_some_and(|us| us > 0.0),
        "{report}"
    );
    let cpus = handoff["cpus_allowed"].as_u64().unwrap_or(0);
    assert_eq!(
        handoff["other_cpu"]["p50_us"]
            .as_f64()
            .is_some_and(|us| us > 0.0),
        cpus >= 2,
        "{report}"
    );
    let admission = report["admission"].as_array().expect("admission");
    assert!(
        admission.iter().all(|a| {
            let rate = a["ack"]["per_second"].as_f64();
            let ratio = a["ratio_to_raw_commit"].as_f64();
            rate.zip(ratio)
                .zip(taken)
                .is_some_and(|((rate, ratio), best)| (rate / best - ratio).abs() < 0.01)
        }),
        "{report}"
    );
    assert_eq!(
        admission
            .iter()
            .map(|a| a["sessions"].as_u64())
            .collect::<Vec<_>>(),
        [Some(1), Some(16), Some(256)]
    );
    assert!(admission
        .iter()
        .all(|a| a["ack"]["count"].as_u64().is_some_and(|c| c > 0)
            && a["replay"]["count"] == a["ack"]["count"]
            && a["ping"]["count"] == a["ack"]["count"]));
    // The writer thread was found and timed: its share of the wall time is a percentage (above
    // 100 only by the rounding of clock ticks).
    assert!(
        admission.iter().all(|a| a["ack"]["writer_busy_percent"]
            .as_f64()
            .is_some_and(|p| (0.0..=110.0).contains(&p))),
        "{report}"
    );
    let turn = levels_report(&report, "turn");
    // A tool turn: two model calls around a real child process, against the same floor; alone on
    // its session (no group commit), it commits more often than a plain turn: its tool call and
    // result are durable before the next step.
    let tool = levels_report(&report, "tool");
    assert!(
        tool[0]["turn"]["commits_per_turn"].as_f64() > turn[0]["turn"]["commits_per_turn"].as_f64(),
        "{tool:?}"
    );
    // A room task: one plain turn of its room's member, driven by the room's supervisor; every
    // level reports (at 256, one room per client, the gateway's bound on active rooms).
    levels_report(&report, "room");
    assert_eq!(report["isolation"]["parked_sessions"], 100);
    assert_eq!(report["isolation"]["rounds"], 1);
    assert!(report["isolation"]["loaded_rounds_p99_ms"][0]
        .as_f64()
        .is_some_and(|p| p > 0.0));
    assert!(
        report["isolation"]["loaded_daemon_cpu_seconds_during_alone_rounds"]
            .as_f64()
            .is_some_and(|s| s >= 0.0)
    );
    assert!(report["isolation"]["p99_ratio"]
        .as_f64()
        .is_some_and(|r| r > 0.0));
    assert!(report["memory"]["idle_rss_kib"]
        .as_u64()
        .is_some_and(|k| k > 0));
    // The peak of every daemon of the run is at least the isolation daemon's, and named.
    let memory = &report["memory"];
    assert!(
        memory["peak_rss_kib_any_daemon"]
            .as_u64()
            .zip(memory["peak_rss_kib"].as_u64())
            .is_some_and(|(any, isolation)| any >= isolation),
        "{memory}"
    );
    assert!(
        memory["peak_daemon"]
            .as_str()
            .is_some_and(|d| !d.is_empty()),
        "{memory}"
    );
    // Every target is judged (figures not asserted: the machine is noisy).
    let targets = report["targets"].as_array().expect("targets");
    assert_eq!(targets.len(), 11, "{report}");
    assert_eq!(
        report["targets_sized_otherwise"][0], "a quick run",
        "{report}"
    );
    assert!(
        targets
            .iter()
            .all(|t| t["holds"].is_boolean() && t["figure"].is_number()),
        "{report}"
    );
    // The idle readings' parts are of the same reading: they add up to it.
    for reading in ["idle_rss", "rss_before_parking"] {
        let part = |p: &str| memory[format!("{reading}_{p}kib")].as_u64();
        assert_eq!(
            part("anon_").zip(part("file_")).map(|(a, f)| a + f),
            part(""),
            "{memory}"
        );
    }
    // The recovery store holds what its admissions left as the turns a daemon ran: each one's
    // three event batches and two messages, and in every tenth turn of a session an approval
    // with its two batches and two messages more (the tool call and its result).
    let recovery = &report["recovery"];
    let admissions = recovery["admissions"].as_u64().expect("admissions");
    let sessions = recovery["sessions"].as_u64().expect("sessions");
    assert!(admissions > 0 && sessions > 0, "{recovery}");
    let approvals = sessions * (admissions / sessions / 10);
    assert!(approvals > 0, "{recovery}");
    assert_eq!(recovery["prompts"].as_u64(), Some(approvals), "{recovery}");
    assert_eq!(
        recovery["messages"].as_u64(),
        Some(2 * admissions + 2 * approvals),
        "{recovery}"
    );
    assert_eq!(
        recovery["event_batches"].as_u64(),
        Some(3 * admissions + 2 * approvals),
        "{recovery}"
    );
    assert_eq!(
        report["recovery"]["unknown_after_crash"],
        report["recovery"]["crash_started_rows"]
    );
    // The second crash's restart read its store from the disk: its own turns are the ones
    // left `unknown` then (the first crash's were already).
    assert_eq!(
        report["recovery"]["unknown_after_cold_crash"],
        report["recovery"]["crash_started_rows"]
    );
    for figure in [
        "ready_seconds",
        "ready_cold_seconds",
        "crash_ready_seconds",
        "crash_cold_ready_seconds",
    ] {
        assert!(
            report["recovery"][figure].as_f64().is_some_and(|s| s > 0.0),
            "{figure}: {}",
            report["recovery"]
        );
    }
    for share in ["cached_after_drop", "cached_after_crash_drop"] {
        assert!(
            report["recovery"][share]
                .as_f64()
                .is_some_and(|s| (0.0..=1.0).contains(&s)),
            "{share}: {}",
            report["recovery"]
        );
    }
}

/// `--levels` picks the admission and turn sections' session counts and `--admissions` how many
/// inputs each admission section submits; bad values are refused.
#[test]
fn bench_levels_and_admissions_size_the_sections_and_bad_values_are_refused() {
    let report = bench_json(&["--only", "admission", "--levels", "2", "--admissions", "6"]);
    let admission = report["admission"].as_array().expect("admission");
    assert_eq!(
        admission
            .iter()
            .map(|a| (a["sessions"].clone(), a["ack"]["count"].clone()))
            .collect::<Vec<_>>(),
        [(Value::from(2), Value::from(6))]
    );
    assert_eq!(report["turn"], Value::Array(Vec::new()));
    let bad_values = ["0", "1,1", "x", "", "5000"]
        .map(|v| ("--levels", v))
        .into_iter()
        .chain(["0", "x", "-3", ""].map(|v| ("--admissions", v)));
    for (option, bad) in bad_values {
        let out = Command::new(bin())
            .args(["bench", option, bad])
            .output()
            .expect("run bench");
        assert_eq!(out.status.code(), Some(2), "{option} {bad:?}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains(option),
            "{option} {bad:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
