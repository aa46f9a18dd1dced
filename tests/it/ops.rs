//! Operating the gateway: the CLI as child processes, health, readiness during drain, metrics,
//! the systemd unit, and the built-in echo provider.

use std::io::Write;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use serde_json::{json, Value};

use crate::helpers::*;

/// `gatehouse ARGS --home HOME` started in HOME, with its output piped.
fn spawn_cli(home: &Home, args: &[&str]) -> std::process::Child {
    Command::new(bin())
        .args(args)
        .arg("--home")
        .arg(&home.path)
        .current_dir(&home.path)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn gatehouse")
}

/// Run `gatehouse ARGS` to its end, within a minute (a command that waits for good fails the
/// test instead of hanging it).
fn cli(home: &Home, args: &[&str], stdin: &str) -> Output {
    let mut child = spawn_cli(home, args);
    if let Some(mut s) = child.stdin.take() {
        let _ = s.write_all(stdin.as_bytes());
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while child.try_wait().ok().flatten().is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let o = child.wait_with_output().expect("gatehouse output");
            panic!(
                "gatehouse {args:?} still running after 60 s: {}",
                String::from_utf8_lossy(&o.stdout)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("gatehouse output")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).to_string()
}

/// Parse Prometheus text format strictly enough to catch malformed output.
fn parse_prometheus(text: &str) -> Vec<(String, f64)> {
    let mut samples = Vec::new();
    for line in text.lines() {
        if line.is_empty() {
            continue;
        }
        if let Some(rest) = line.strip_prefix('#') {
            let words: Vec<&str> = rest.split_whitespace().collect();
            assert!(
                matches!(words.first(), Some(&"HELP") | Some(&"TYPE")),
                "bad comment line: {line}"
            );
            if words[0] == "TYPE" {
                assert!(
                    matches!(
                        words.get(2),
                        Some(&"counter" | &"gauge" | &"histogram" | &"summary" | &"untyped")
                    ),
                    "{line}"
                );
            }
            continue;
        }
        let (name_labels, value) = line
            .rsplit_once(' ')
            .unwrap_or_else(|| panic!("no value: {line}"));
        let value: f64 = value
            .parse()
            .unwrap_or_else(|_| panic!("bad value: {line}"));
        let name = name_labels.split('{').next().unwrap_or("");
        assert!(
            !name.is_empty()
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'),
            "bad metric name: {line}"
        );
        if let Some(labels) = name_labels.strip_prefix(name) {
            if !labels.is_empty() {
                assert!(
                    labels.starts_with('{') && labels.ends_with('}'),
                    "bad labels: {line}"
                );
            }
        }
        samples.push((name_labels.to_string(), value));
    }
    samples
}

fn sample(samples: &[(String, f64)], key: &str) -> f64 {
    samples
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| *v)
        .unwrap_or_else(|| panic!("no sample {key}"))
}

/// A home of its own holding a directory `keep`, and the command that removes it.
fn rm_keep() -> (Home, String) {
    let victim = Home::new();
    std::fs::create_dir_all(victim.path.join("keep")).expect("dir");
    let cmd = format!("rm -rf -- {}", victim.path.join("keep").display());
    (victim, cmd)
}

/// The model's request ends with the user's turn (not with a tool's result).
fn asks(body: &Value) -> bool {
    body["messages"]
        .as_array()
        .and_then(|m| m.last())
        .is_some_and(|m| m["role"] == "user")
}

/// `gatehouse chat` asks each question of a clarify batch and answers with the list of answers
/// (it showed the first question only, and the others went unanswered).
#[actix_rt::test]
async fn chat_asks_every_question_of_a_clarify_batch() {
    let model = FakeModel::start(|body| {
        if asks(body) {
            let questions = json!({"questions": [
                {"question": "FIRST?"},
                {"question": "SECOND?", "choices": ["red", "blue"]}]});
            Reply::Message(tool_call("q", "clarify", questions), "tool_calls")
        } else {
            Reply::Message(json!({"role": "assistant", "content": "DONE"}), "stop")
        }
    });
    let home = Home::new();
    home.write_config(&config(&model.url, json!({})));
    let _d = Daemon::start(&home);
    let o = cli(&home, &["chat", "--session", "ask", "ASK"], "alpha\n2\n");
    let out = stdout(&o);
    assert!(o.status.success(), "{o:?}");
    assert!(
        out.contains("FIRST?") && out.contains("SECOND?") && out.contains("2. blue"),
        "{out}"
    );
    assert!(out.contains("DONE"), "{out}");
    let result = model
        .requests()
        .iter()
        .flat_map(|b| b["messages"].as_array().cloned().unwrap_or_default())
        .find(|m| m["role"] == "tool")
        .and_then(|m| m["content"].as_str().map(str::to_string))
        .expect("the clarify result went back to the model");
    let result: Value = serde_json::from_str(&result).expect("a JSON result");
    assert_eq!(result["responses"][0]["user_response"], "alpha", "{result}");
    assert_eq!(result["responses"][1]["user_response"], "blue", "{result}");
}

/// What the model sends is printed with its control characters shown, not acted on by the
/// terminal: an escape sequence and a carriage return in a command could rewrite the approval
/// line to show a harmless command (and the reply could set the clipboard).
#[actix_rt::test]
async fn chat_shows_the_control_characters_a_model_sends() {
    let (victim, cmd) = rm_keep();
    let spoof = format!("{cmd} #\u{1b}[2K\r[approval needed: git status]\u{1b}[8m");
    let model = FakeModel::start(move |body| {
        if asks(body) {
            Reply::Message(
                tool_call("c1", "terminal", json!({"command": spoof})),
                "tool_calls",
            )
        } else {
            Reply::Message(
                json!({"role": "assistant", "content": "done\u{1b}]52;c;ZXZpbA==\u{7}\r"}),
                "stop",
            )
        }
    });
    let home = Home::new();
    home.write_config(&config(&model.url, json!({})));
    let _d = Daemon::start(&home);
    let o = cli(&home, &["chat", "--session", "spoof", "SPOOF"], "deny\n");
    assert!(o.status.success(), "{o:?}");
    let out = stdout(&o);
    assert!(
        !o.stdout.contains(&0x1b) && !o.stdout.contains(&b'\r'),
        "{out:?}"
    );
    assert!(
        out.contains(&format!("{cmd} #^[[2K^M[approval needed")),
        "{out}"
    );
    assert!(out.contains("done^[]52;c;ZXZpbA==^G^M"), "{out}");
    assert!(victim.path.join("keep").exists());
}

#[actix_rt::test]
async fn chat_and_operator_commands_work_as_child_processes() {
    let (victim, cmd) = rm_keep();
    let model = FakeModel::start(move |body| match last_user(body).as_str() {
        "HANG" => Reply::Hang,
        "DANGER" if asks(body) => Reply::Message(
            tool_call("c1", "terminal", json!({"command": cmd})),
            "tool_calls",
        ),
        text => Reply::Message(
            json!({"role": "assistant", "content": format!("ACK_{text}")}),
            "stop",
        ),
    });
    let home = Home::new();
    // Before a daemon runs, the CLI says so clearly.
    let o = cli(&home, &["status"], "");
    assert_eq!(o.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("no gatehouse daemon"),
        "{o:?}"
    );

    home.write_config(&config(&model.url, json!({})));
    let mut d = Daemon::start(&home);
    let o = cli(&home, &["chat", "--session", "ops", "hello there"], "");
    assert!(o.status.success(), "{o:?}");
    assert!(stdout(&o).contains("ACK_hello there"), "{}", stdout(&o));

    // An approval is asked of the operator with the offered choices; a denial keeps the directory.
    // A typo is asked again (it denied at once).
    let o = cli(
        &home,
        &["chat", "--session", "ops", "DANGER"],
        "dney\ndeny\n",
    );
    let out = stdout(&o);
    assert!(o.status.success(), "{o:?}");
    assert!(
        out.contains("approval needed") && out.contains("once/session/always/deny"),
        "{out}"
    );
    // Every rule it matched is named (a `session` answer approves them all).
    assert!(
        out.contains("delete in root path; recursive delete"),
        "{out}"
    );
    assert!(out.contains("\"dney\" is not one of them"), "{out}");
    assert!(out.contains("ACK_DANGER"), "{out}");
    assert!(victim.path.join("keep").exists());

    // The named session goes on from another directory (it keeps the one it started in).
    let elsewhere = Home::new();
    let o = Command::new(bin())
        .args(["chat", "--session", "ops", "from elsewhere", "--home"])
        .arg(&home.path)
        .current_dir(&elsewhere.path)
        .stdin(Stdio::null())
        .output()
        .expect("chat elsewhere");
    assert!(o.status.success(), "{o:?}");
    assert!(stdout(&o).contains("ACK_from elsewhere"), "{}", stdout(&o));
    let asked = model
        .requests()
        .into_iter()
        .find(|b| last_user(b) == "from elsewhere")
        .expect("the request");
    assert!(
        user_texts(&asked).contains(&"hello there".to_string()),
        "the same conversation: {asked}"
    );

    let o = cli(&home, &["status", "--json"], "");
    let status: Value = serde_json::from_slice(&o.stdout).expect("status json");
    assert_eq!(status["state"], "ready");
    assert_eq!(status["admissions"]["terminal"], 3);
    let o = cli(&home, &["status"], "");
    assert!(stdout(&o).contains("state      ready"), "{}", stdout(&o));
    let o = cli(&home, &["sessions"], "");
    assert!(stdout(&o).contains("fake-model"), "{}", stdout(&o));
    let o = cli(&home, &["sessions", "--json"], "");
    let listed: Value = serde_json::from_slice(&o.stdout).expect("sessions json");
    assert_eq!(listed["truncated"], false);
    // A stray argument is refused (it is not the home), and help is not an error.
    for stray in [
        &["status", "/var/lib/gatehouse"][..],
        &["serve", "/var/lib/gatehouse"],
    ] {
        let o = cli(&home, stray, "");
        assert_eq!(o.status.code(), Some(2), "{stray:?}: {o:?}");
        assert!(
            String::from_utf8_lossy(&o.stderr).contains("takes no argument"),
            "{stray:?}: {o:?}"
        );
    }
    let o = cli(&home, &["status", "--help"], "");
    assert!(
        o.status.success() && stdout(&o).contains("gatehouse"),
        "{o:?}"
    );

    // A turn lost to SIGKILL is listed by `pending` and settled by `resolve-unknown`.
    let mut ws = d.ws().await;
    let sid = ws.session("lost", &home.path).await;
    ws.submit(&sid, "HANG", "HANG").await;
    wait_until("HANG in flight", Duration::from_secs(20), || {
        model.reached("HANG") == 1
    })
    .await;
    ws.submit(&sid, "NEXT", "NEXT").await;
    d.kill();
    let _d2 = Daemon::start(&home);
    // The boot names the commands with this home (a service user's is not the operator's).
    assert!(
        home.log().contains(&format!(
            "`gatehouse pending --home {}`",
            home.path.display()
        )),
        "{}",
        home.log()
    );
    let o = cli(&home, &["pending", "--json"], "");
    let pending: Value = serde_json::from_slice(&o.stdout).expect("pending json");
    let lost = &pending["unknown"][0];
    assert_eq!(lost["input_id"], "HANG");
    let admission = lost["admission_id"]
        .as_str()
        .expect("admission")
        .to_string();
    let o = cli(&home, &["pending"], "");
    assert!(stdout(&o).contains(&admission), "{}", stdout(&o));
    let o = cli(&home, &["resolve-unknown", &sid, &admission], "");
    assert!(o.status.success(), "{o:?}");
    assert!(
        stdout(&o).contains("terminal interrupted"),
        "{}",
        stdout(&o)
    );
    wait_until("the follower", Duration::from_secs(20), || {
        all_terminal(&home)
    })
    .await;
    assert_eq!(model.reached("NEXT"), 1);
    assert_eq!(model.reached("HANG"), 1);
    let o = cli(&home, &["resolve-unknown", &sid, &admission], "");
    assert_eq!(o.status.code(), Some(1), "a second resolve is refused");
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(err.contains("stale_generation"), "{o:?}");
    // It says where the input is, and the reason once.
    assert!(err.contains("already settled (interrupted)"), "{err}");
    assert_eq!(err.matches("stale_generation").count(), 1, "{err}");
    // With --json the refusal is JSON on standard output, as an answer would be.
    let o = cli(&home, &["resolve-unknown", &sid, &admission, "--json"], "");
    assert_eq!(o.status.code(), Some(1));
    let refusal: Value = serde_json::from_slice(&o.stdout).expect("a JSON refusal");
    assert_eq!(refusal["error"]["code"], "stale_generation", "{refusal}");
}

#[actix_rt::test]
async fn metrics_parse_and_move_with_the_work() {
    let model = FakeModel::ack();
    let (home, d) = Daemon::with_model(&model, json!({}));
    let origin = d.origin();
    assert_eq!(http_get(&format!("{origin}/healthz")).await.0, 200);
    assert_eq!(http_get(&format!("{origin}/readyz")).await.0, 200);
    // A checker may ask with HEAD (they were 404 "no such route"); other methods are 405.
    let client = awc::Client::new();
    for path in ["/healthz", "/readyz", "/metrics"] {
        let mut head = client
            .head(format!("{origin}{path}"))
            .send()
            .await
            .expect("HEAD");
        assert_eq!(head.status().as_u16(), 200, "HEAD {path}");
        assert!(head.body().await.expect("body").is_empty(), "HEAD {path}");
        let post = client
            .post(format!("{origin}{path}"))
            .send()
            .await
            .expect("POST");
        assert_eq!(post.status().as_u16(), 405, "POST {path}");
        assert_eq!(
            post.headers().get("allow").and_then(|v| v.to_str().ok()),
            Some("GET, HEAD"),
            "POST {path}"
        );
    }
    let (code, before) = http_get(&format!("{origin}/metrics")).await;
    assert_eq!(code, 200);
    let before = parse_prometheus(&before);
    let mut ws = d.ws().await;
    let sid = ws.session("m", &home.path).await;
    for i in 0..3 {
        ws.submit(&sid, &format!("i{i}"), "hi").await;
    }
    wait_until("turns", Duration::from_secs(20), || all_terminal(&home)).await;
    // A turn is counted finished after its settlement commits, before its `message.complete`
    // is sent: once the three have come, the three are counted.
    for _ in 0..3 {
        ws.event(Duration::from_secs(20), |e| {
            e["type"] == "message.complete" && e["session_id"] == sid.as_str()
        })
        .await;
    }
    let (_, after) = http_get(&format!("{origin}/metrics")).await;
    let after = parse_prometheus(&after);
    let moved = |k: &str| sample(&after, k) - sample(&before, k);
    assert_eq!(moved("gatehouse_admissions_accepted_total"), 3.0);
    assert_eq!(moved("gatehouse_turns_finished_total"), 3.0);
    assert_eq!(moved("gatehouse_turn_seconds_count"), 3.0);
    // The buckets reach a room turn's deadline (a model's 600 s time-out falls inside them).
    assert_eq!(
        sample(&after, "gatehouse_turn_seconds_bucket{le=\"1800\"}"),
        sample(&after, "gatehouse_turn_seconds_count")
    );
    assert!(after
        .iter()
        .any(|(k, _)| k == "gatehouse_model_request_seconds_bucket{le=\"600\"}"));
    assert_eq!(
        sample(
            &after,
            "gatehouse_admissions{status=\"terminal\",outcome=\"completed\"}"
        ),
        3.0
    );
    assert!(sample(&after, "gatehouse_ws_connections") >= 1.0);
    assert!(moved("gatehouse_model_request_seconds_count") >= 3.0);
    assert!(moved("gatehouse_db_transaction_seconds_count") >= 6.0);
    assert_eq!(sample(&after, "gatehouse_prompts_open"), 0.0);
    assert!(
        sample(&after, "gatehouse_room_cycles_total") >= 1.0,
        "the room scheduler runs"
    );
    assert_eq!(sample(&after, "gatehouse_rooms_leased"), 0.0);
}

/// The store's pool opens its connections on one thread of its own: r2d2 started three per
/// pool, idle for the daemon's whole life.
#[actix_rt::test]
async fn the_store_opens_its_connections_on_one_thread() {
    let model = FakeModel::ack();
    let (home, d) = Daemon::with_model(&model, json!({}));
    let mut ws = d.ws().await;
    // Reads and a turn: the pool opens the connections they take.
    let sid = ws.session("threads", &home.path).await;
    ws.submit(&sid, "in-1", "hello").await;
    wait_until("the input settled", Duration::from_secs(10), || {
        all_terminal(&home)
    })
    .await;
    ws.ok("session.resume", json!({"session_id": sid})).await;
    let names: Vec<String> = std::fs::read_dir(format!("/proc/{}/task", d.child.id()))
        .expect("the daemon's threads")
        .filter_map(|t| {
            std::fs::read_to_string(t.ok()?.path().join("comm"))
                .ok()
                .map(|n| n.trim().to_string())
        })
        .collect();
    let opening: Vec<&String> = names
        .iter()
        .filter(|n| n.starts_with("gatehouse-open") || n.starts_with("r2d2"))
        .collect();
    assert_eq!(opening, ["gatehouse-open0"], "{names:?}");
}

#[actix_rt::test]
async fn readyz_is_unavailable_while_draining() {
    let model = FakeModel::ack();
    // What the test asks of the draining daemon must come within the grace, on a loaded
    // machine too.
    let (home, mut d) = Daemon::with_model(&model, json!({"gateway": {"drain_grace_seconds": 6}}));
    let origin = d.origin();
    assert_eq!(http_get(&format!("{origin}/readyz")).await.0, 200);
    d.signal(libc::SIGTERM);
    let mut seen = None;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while std::time::Instant::now() < deadline {
        let (code, body) = http_get(&format!("{origin}/readyz")).await;
        if code == 503 {
            seen = Some(body);
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(seen.as_deref(), Some("stopping\n"));
    assert_eq!(
        http_get(&format!("{origin}/healthz")).await.0,
        200,
        "alive while draining"
    );
    let ident = control(&home.path, "identify", json!({})).expect("identify");
    assert_eq!(ident["state"], "stopping");
    assert_eq!(d.term(), Some(0));
}

/// A SIGINT during the graceful stop (a second Ctrl-C) ends the daemon at once, exit 1, saying
/// that running turns become unknown; a SIGTERM sent again does not (it waited, and only
/// SIGKILL could cut a long drain short).
#[actix_rt::test]
async fn a_sigint_during_the_stop_ends_the_daemon_at_once() {
    let model = FakeModel::ack();
    // A grace far longer than the test waits: only the SIGINT can end the stop in time.
    let (home, mut d) =
        Daemon::with_model(&model, json!({"gateway": {"drain_grace_seconds": 300}}));
    let origin = d.origin();
    d.signal(libc::SIGTERM);
    wait_until("draining", Duration::from_secs(10), || {
        home.log().contains("refusing new work before the drain")
    })
    .await;
    d.signal(libc::SIGTERM);
    wait_until("the second SIGTERM heard", Duration::from_secs(10), || {
        home.log().contains("the daemon is stopping already")
    })
    .await;
    assert_eq!(
        http_get(&format!("{origin}/healthz")).await.0,
        200,
        "still stopping"
    );
    assert_eq!(d.stop_with(libc::SIGINT), Some(1));
    assert!(
        home.log().contains("SIGINT again during the stop"),
        "{}",
        home.log()
    );
}

/// While the daemon drains, a new input is refused, but one admitted before is not new: sent
/// again (a client whose reply was lost in the stop), it is answered with its receipt, and with
/// other text refused as a conflict, as at any other time. It was refused `runtime_draining`.
#[actix_rt::test]
async fn an_admitted_input_sent_again_while_draining_gets_its_receipt() {
    let model = FakeModel::ack();
    // What the test asks of the draining daemon must come within the grace, on a loaded
    // machine too.
    let (home, mut d) = Daemon::with_model(&model, json!({"gateway": {"drain_grace_seconds": 6}}));
    let mut ws = d.ws().await;
    let sid = ws.session("drain-retry", &home.path).await;
    let first = ws.submit(&sid, "in-1", "hello").await;
    wait_until("the input settled", Duration::from_secs(10), || {
        all_terminal(&home)
    })
    .await;
    d.signal(libc::SIGTERM);
    wait_until("the daemon drains", Duration::from_secs(10), || {
        control(&home.path, "identify", json!({})).is_ok_and(|v| v["state"] == "stopping")
    })
    .await;
    let again = ws.submit(&sid, "in-1", "hello").await;
    assert_eq!(again["admission_id"], first["admission_id"], "{again}");
    assert_eq!(again["status"], "terminal", "{again}");
    ws.refused(
        "prompt.submit",
        json!({"session_id": sid, "input_id": "in-1", "text": "other"}),
        "admission_conflict",
    )
    .await;
    ws.refused(
        "prompt.submit",
        json!({"session_id": sid, "input_id": "in-2", "text": "new"}),
        "runtime_draining",
    )
    .await;
    assert_eq!(d.term(), Some(0));
    assert_eq!(home.admissions().len(), 1);
}

#[test]
fn the_systemd_unit_verifies() {
    let Ok(which) = Command::new("sh")
        .args(["-c", "command -v systemd-analyze"])
        .output()
    else {
        return;
    };
    if !which.status.success() {
        eprintln!("systemd-analyze is not installed; skipping the unit check");
        return;
    }
    let unit = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/deploy/gatehouse.service"
    ))
    .expect("unit");
    assert!(unit.contains("Type=notify") && unit.contains("StateDirectory=gatehouse"));
    // The daemon stops its own commands; a refusal for good (exit 2) is not restarted.
    assert!(unit.contains("KillMode=mixed") && unit.contains("RestartPreventExitStatus=2"));
    let dir = Home::new();
    let path = dir.path.join("gatehouse.service");
    std::fs::write(&path, unit.replace("/usr/local/bin/gatehouse", bin())).expect("write unit");
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .arg(&path)
        .output()
        .expect("systemd-analyze");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "systemd-analyze verify failed: {stderr}"
    );
}

#[actix_rt::test]
async fn with_no_model_configured_the_echo_provider_answers() {
    let home = Home::new();
    let _d = Daemon::start(&home);
    let o = cli(&home, &["chat", "quick start"], "");
    assert!(o.status.success(), "{o:?}");
    let out = stdout(&o);
    assert!(
        out.contains("echo provider") && out.contains("quick start"),
        "{out}"
    );
    assert!(home.log().contains("echo provider"), "the log says so too");
}

/// After `--` every word is the message, even one that looks like an option (`ls -h` printed
/// the usage and sent nothing, exit 0); interactively, a message the daemon refuses is said
/// and the next line is read (the refusal ended the chat).
#[actix_rt::test]
async fn chat_text_after_the_separator_is_sent_and_a_refusal_ends_nothing() {
    let model = FakeModel::ack();
    let home = Home::new();
    home.write_config(&config(
        &model.url,
        json!({"session": {"max_text_bytes": 2000}}),
    ));
    let _d = Daemon::start(&home);
    let o = Command::new(bin())
        .args(["chat", "--home"])
        .arg(&home.path)
        .args(["--session", "sep", "--", "what", "does", "ls", "-h", "do"])
        .current_dir(&home.path)
        .stdin(Stdio::null())
        .output()
        .expect("chat");
    assert!(o.status.success(), "{o:?}");
    assert_eq!(model.reached("what does ls -h do"), 1, "{o:?}");
    let long = "x".repeat(3000);
    let o = cli(
        &home,
        &["chat", "--session", "sep"],
        &format!("{long}\nhello\n"),
    );
    let out = stdout(&o);
    assert!(o.status.success(), "{o:?}");
    assert!(out.contains("[not sent: payload_too_large"), "{out}");
    assert!(out.contains("ACK_hello"), "{out}");
}

/// A one-shot chat whose input another client cancels while it is queued exits 1, saying so:
/// no turn runs and no completion comes (it waited for good).
#[actix_rt::test]
async fn a_chat_whose_queued_input_is_cancelled_ends() {
    let model = FakeModel::ack_or_hang();
    let (home, d) = Daemon::with_model(&model, json!({}));
    let mut ws = d.ws().await;
    let sid = ws.session("chat:queued", &home.path).await;
    ws.submit(&sid, "head", "HANG").await;
    let chat = spawn_cli(&home, &["chat", "--session", "queued", "QUEUED"]);
    wait_until(
        "the chat's input is queued",
        Duration::from_secs(30),
        || home.admissions().iter().any(|a| a.text() == "QUEUED"),
    )
    .await;
    let queued = home
        .admissions()
        .into_iter()
        .find(|a| a.text() == "QUEUED")
        .expect("queued");
    let r = ws
        .ok(
            "prompt.cancel",
            json!({"session_id": sid, "admission_id": queued.admission_id}),
        )
        .await;
    assert_eq!(r["outcome"], "cancelled", "{r}");
    let (code, stderr) = exit_of(chat).await;
    assert_eq!(code, Some(1), "{stderr}");
}

/// An interactive chat whose session a crash left held by another client's `unknown` input
/// ends when its next line finds that, after reconnecting (exit 1, the operator's command): it
/// is not taken for a refusal of that one line (the next line would be admitted behind the
/// held input, never to run, and its completion waited for good).
#[actix_rt::test]
async fn an_interactive_chat_ends_on_a_session_held_after_a_crash() {
    use std::io::Write;
    let model = FakeModel::ack_or_hang();
    let (home, mut d) = Daemon::with_model(&model, json!({}));
    let mut chat = spawn_cli(&home, &["chat", "--session", "held"]);
    let mut stdin = chat.stdin.take().expect("stdin");
    stdin.write_all(b"first\n").expect("first line");
    wait_until("the chat's first turn", Duration::from_secs(30), || {
        model.reached("first") == 1
    })
    .await;
    let mut ws = d.ws().await;
    let sid = ws.session("chat:held", &home.path).await;
    ws.submit(&sid, "other", "HANG").await;
    wait_until(
        "the other client's turn at the model",
        Duration::from_secs(30),
        || model.reached("HANG") == 1,
    )
    .await;
    d.kill();
    let _d = Daemon::start(&home);
    stdin.write_all(b"second\nthird\n").expect("more lines");
    let (code, stderr) = exit_of(chat).await;
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("is held by"), "{stderr}");
    assert!(!home.admissions().iter().any(|a| a.text() == "third"));
    drop(stdin);
}

/// A chat whose input was running when the daemon crashed reconnects, finds the input `unknown`
/// (it never runs again, so no completion comes) and exits 1 with the operator's command,
/// instead of waiting for good.
#[test]
fn chat_across_a_crash_exits_with_the_command_that_settles_its_unknown_input() {
    let model = FakeModel::ack_or_hang();
    let (home, mut d) = Daemon::with_model(&model, json!({}));
    let mut chat = spawn_cli(&home, &["chat", "--session", "crash", "HANG"]);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while model.reached("HANG") == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the turn never reached the model"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    d.kill();
    let _d = Daemon::start(&home);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(s) = chat.try_wait().expect("chat status") {
            break s;
        }
        if std::time::Instant::now() > deadline {
            let _ = chat.kill();
            panic!("chat still waiting after the restart");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let out = chat.wait_with_output().expect("chat output");
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(status.code(), Some(1), "{err}");
    let (row, command) = unknown_admission(&home);
    // Naming this home: under a service user the default home is another one.
    let command = format!("{command} --home {}", home.path.display());
    assert!(err.contains(&command), "{err}");
    // Chat into the held session says why nothing would run, and admits nothing (it waited
    // silently, for good).
    let o = cli(&home, &["chat", "--session", "crash", "AFTER"], "");
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&command) && err.contains("is held by"),
        "{err}"
    );
    assert!(!home.admissions().iter().any(|a| a.text() == "AFTER"));
    // The command it names settles the input; then the session goes on.
    let o = cli(
        &home,
        &["resolve-unknown", &row.target_session_id, &row.admission_id],
        "",
    );
    assert!(o.status.success(), "{o:?}");
    assert_eq!(home.admission_by_id(&row.admission_id).status, "terminal");
    let o = cli(&home, &["chat", "--session", "crash", "AFTER"], "");
    assert!(o.status.success(), "{o:?}");
    assert!(stdout(&o).contains("ACK_AFTER"), "{}", stdout(&o));
}

/// Interactive chat goes on across a daemon restart between turns (its connection was gone and
/// the next line failed with `connection closed`); clarify choices are numbered and a number
/// picks one; a one-shot turn that fails exits 1 (it exited 0).
#[actix_rt::test]
async fn chat_reconnects_between_turns_and_a_turn_that_fails_exits_1() {
    let model = FakeModel::start(|body| {
        let last = body["messages"]
            .as_array()
            .and_then(|m| m.last())
            .cloned()
            .unwrap_or_default();
        if last["role"] == "tool" {
            let got = last["content"].as_str().unwrap_or_default().to_string();
            return Reply::Message(
                json!({"role": "assistant", "content": format!("GOT {got}")}),
                "stop",
            );
        }
        match last_user(body).as_str() {
            "FAIL" => Reply::Status(500, json!({"error": {"message": "down"}})),
            "ASK" => Reply::Message(
                tool_call(
                    "q1",
                    "clarify",
                    json!({"question": "Pick a color", "choices": ["BLUE", "GREEN"]}),
                ),
                "tool_calls",
            ),
            text => Reply::Message(
                json!({"role": "assistant", "content": format!("ACK_{text}")}),
                "stop",
            ),
        }
    });
    let (home, mut d) = Daemon::with_model(&model, json!({}));
    let o = cli(&home, &["chat", "--session", "f", "FAIL"], "");
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    assert!(stdout(&o).contains("[failed]"), "{}", stdout(&o));

    let mut chat = spawn_cli(&home, &["chat", "--session", "r"]);
    let mut stdin = chat.stdin.take().expect("stdin");
    stdin.write_all(b"one\n").expect("write");
    wait_until("the first turn", Duration::from_secs(30), || {
        home.admissions()
            .iter()
            .any(|a| a.text() == "one" && a.status == "terminal")
    })
    .await;
    assert_eq!(d.term(), Some(0));
    let _d = Daemon::start(&home);
    stdin.write_all(b"two\nASK\n2\n").expect("write");
    drop(stdin);
    let (code, out) = {
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        let code = loop {
            if let Some(s) = chat.try_wait().expect("chat status") {
                break s.code();
            }
            if std::time::Instant::now() > deadline {
                let _ = chat.kill();
                break None;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let o = chat.wait_with_output().expect("chat output");
        (
            code,
            format!("{}{}", stdout(&o), String::from_utf8_lossy(&o.stderr)),
        )
    };
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("ACK_one") && out.contains("ACK_two"), "{out}");
    assert_eq!(model.reached("two"), 1, "admitted once");
    assert!(out.contains("1. BLUE") && out.contains("2. GREEN"), "{out}");
    assert!(out.contains("GOT") && out.contains("GREEN"), "{out}");
}

#[actix_rt::test]
async fn a_second_daemon_on_the_same_home_is_refused_and_the_first_keeps_its_work() {
    let model = FakeModel::start(|_| Reply::Hang);
    let (home, d) = Daemon::with_model(&model, json!({}));
    let mut ws = d.ws().await;
    let sid = ws.session("s", &home.path).await;
    ws.submit(&sid, "parked", "parked").await;
    wait_until(
        "the turn reaches the model",
        Duration::from_secs(20),
        || model.reached("parked") == 1,
    )
    .await;
    // The lock file deleted (by hand, by a cleanup job) does not let a second daemon in: the
    // home directory itself is locked.
    std::fs::remove_file(home.path.join("gateway.lock")).expect("remove the lock file");
    let mut second = spawn_cli(&home, &["serve"]);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Ok(Some(status)) = second.try_wait() {
            break Some(status);
        }
        if std::time::Instant::now() > deadline {
            let _ = second.kill();
            break None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let out = second.wait_with_output().expect("second daemon output");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        status.and_then(|s| s.code()),
        Some(2),
        "a second daemon on the same home is refused for good (a unit does not restart it): \
         {status:?}\n{stderr}"
    );
    assert!(stderr.contains("another gateway is serving"), "{stderr}");
    // The first daemon still owns the home: its socket, its epoch and its running turn.
    let ident = control(&home.path, "identify", json!({})).expect("identify");
    assert_eq!(ident["authority_epoch"], d.epoch());
    assert_eq!(home.admission("parked").status, "started");
    model.release();
    wait_until("the parked turn settles", Duration::from_secs(20), || {
        home.admission("parked").status == "terminal"
    })
    .await;
}

/// An `OPENAI_BASE_URL` that is no http(s) URL, with no model configured, is a start-up error
/// naming it (before, the daemon started and refused every session `invalid_params`); one the
/// config's `model.base_url` overrides does not matter.
#[actix_rt::test]
async fn a_bad_model_url_from_the_environment_is_refused_at_start() {
    let home = Home::new();
    let serve = |home: &Home, stderr: Stdio| {
        Command::new(bin())
            .args(["serve", "--home"])
            .arg(&home.path)
            .env("OPENAI_BASE_URL", "api.example.com/v1")
            .env("RUST_LOG", "gatehouse=debgu")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .expect("spawn gatehouse")
    };
    let (code, stderr) = exit_of(serve(&home, Stdio::piped())).await;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("OPENAI_BASE_URL") && stderr.contains("http:// or https://"),
        "{stderr}"
    );
    assert!(!home.path.join("gateway.sock").exists(), "{stderr}");
    // A log filter with a typo is said, not silently replaced.
    assert!(
        stderr.contains("RUST_LOG=\"gatehouse=debgu\" is not a log filter"),
        "{stderr}"
    );
    let model = FakeModel::ack();
    home.write_config(&config(&model.url, json!({})));
    let d = Daemon::when_ready(serve(&home, Stdio::null()), &home.path, String::new);
    let mut ws = d.ws().await;
    let sid = ws.session("overridden", &home.path).await;
    ws.submit(&sid, "one", "hello").await;
}

/// A start refused for a value that carries a secret says what is wrong without the value (the
/// journal keeps what it says): an `OPENAI_BASE_URL` with credentials, a key written where
/// `gateway.api_keys` wants a list of digests.
#[actix_rt::test]
async fn a_refused_start_does_not_repeat_a_secret() {
    let home = Home::new();
    let serve = |home: &Home, url: Option<&str>| {
        let mut cmd = Command::new(bin());
        cmd.args(["serve", "--home"])
            .arg(&home.path)
            .env_remove("OPENAI_BASE_URL")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        if let Some(url) = url {
            cmd.env("OPENAI_BASE_URL", url);
        }
        cmd.spawn().expect("spawn gatehouse")
    };
    let (code, stderr) = exit_of(serve(
        &home,
        Some("https://user:SECRET@proxy/v1?key=SECRET"),
    ))
    .await;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("OPENAI_BASE_URL") && stderr.contains("credentials"),
        "{stderr}"
    );
    assert!(!stderr.contains("SECRET"), "{stderr}");
    std::fs::write(
        home.path.join("config.yaml"),
        "gateway:\n  api_keys: gk_SECRET\n",
    )
    .expect("config");
    let (code, stderr) = exit_of(serve(&home, None)).await;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("gateway.api_keys"), "{stderr}");
    assert!(!stderr.contains("SECRET"), "{stderr}");
}

/// A state.db that is not a database is refused at once, with SQLite's words, for good (exit 2:
/// a unit does not restart it every two seconds), and the failed start leaves no control socket.
#[actix_rt::test]
async fn a_start_on_a_file_that_is_not_a_database_is_refused_for_good() {
    let model = FakeModel::ack();
    let home = Home::new();
    home.write_config(&config(&model.url, json!({})));
    std::fs::write(home.path.join("state.db"), vec![b'x'; 8192]).expect("write garbage");
    let (code, stderr) = exit_of(spawn_cli(&home, &["serve"])).await;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("not a database"), "{stderr}");
    assert!(
        !stderr.contains("timed out"),
        "the cause is said at once, not after the pool's timeout: {stderr}"
    );
    assert!(
        !home.path.join("gateway.sock").exists(),
        "a failed start leaves no socket behind"
    );
}

/// While the store opens and recovers (here waiting for another process's write lock, as a
/// start waits on a long migration), the control socket says `starting` and the listener
/// answers: `/healthz` 200, `/readyz` 503 `starting`, the API 503 `starting` with a
/// `Retry-After`; `identify` names the instance and origin it will serve as. Once the lock is
/// let go the start goes on to ready. Before, neither answered until the start was done: both
/// ran on the thread that opening the store blocked (and `identify` said null for both).
#[actix_rt::test]
async fn the_socket_and_the_listener_answer_while_the_store_opens() {
    use diesel::connection::SimpleConnection;
    use diesel::Connection;
    let model = FakeModel::ack();
    let home = Home::new();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = taken.local_addr().expect("addr").port();
    drop(taken);
    home.write_config(&config(&model.url, json!({"gateway": {"port": port}})));
    assert_eq!(Daemon::start(&home).term(), Some(0), "{}", home.log());
    let mut holder =
        diesel::SqliteConnection::establish(&home.path.join("state.db").to_string_lossy())
            .expect("open state.db");
    holder
        .batch_execute("BEGIN IMMEDIATE")
        .expect("the write lock");
    let child = spawn_cli(&home, &["serve"]);
    let origin = format!("http://127.0.0.1:{port}");
    // Its instance and its origin are said already (its epoch is taken with the store).
    let mut starting = Value::Null;
    wait_until("identify says starting", Duration::from_secs(3), || {
        starting = control(&home.path, "identify", json!({})).unwrap_or_default();
        starting["state"] == "starting"
            && starting["pid"] == child.id()
            && starting["api_origin"] == origin
    })
    .await;
    assert!(starting["instance_id"].is_string(), "{starting}");
    assert!(starting["authority_epoch"].is_null(), "{starting}");
    assert_eq!(
        http_get(&format!("{origin}/healthz")).await,
        (200, "ok\n".into())
    );
    assert_eq!(
        http_get(&format!("{origin}/readyz")).await,
        (503, "starting\n".into())
    );
    let resp = awc::Client::new()
        .post(format!("{origin}/v1/chat/completions"))
        .send_json(&json!({"model": "default", "messages": []}))
        .await;
    let mut resp = resp.expect("an answer");
    assert_eq!(resp.status().as_u16(), 503);
    assert_eq!(
        resp.headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok()),
        Some("1")
    );
    let body: Value = resp.json().await.expect("a JSON refusal");
    assert_eq!(body["error"]["reason"], "starting", "{body}");
    assert!(
        control(&home.path, "identify", json!({})).is_ok_and(|v| v["state"] == "starting"),
        "still waiting for the lock"
    );

    holder.batch_execute("COMMIT").expect("let go");
    let mut ready = Value::Null;
    wait_until("ready", Duration::from_secs(30), || {
        ready = control(&home.path, "identify", json!({})).unwrap_or_default();
        ready["state"] == "ready"
    })
    .await;
    assert_eq!(ready["instance_id"], starting["instance_id"], "{ready}");
    assert_eq!(ready["api_origin"], origin, "{ready}");
    assert_eq!(
        http_get(&format!("{origin}/readyz")).await,
        (200, "ready\n".into())
    );
    // SAFETY: sending a signal to our own child process.
    unsafe {
        libc::kill(child.id() as i32, libc::SIGTERM);
    }
    let (code, stderr) = exit_of(child).await;
    assert_eq!(code, Some(0), "{stderr}");
}

/// A SIGTERM while the store opens (here, while another process holds its write lock) stops the
/// gateway once it has opened, and the input left queued by the last stop stays queued for the
/// next start: nothing runs only to be interrupted. Before, the start resumed the queued work,
/// which ran during the stop's grace before the drain (or was put back by the drain).
#[actix_rt::test]
async fn a_stop_asked_for_while_the_store_opens_starts_no_queued_work() {
    use diesel::connection::SimpleConnection;
    use diesel::Connection;
    let model = FakeModel::start(|body| {
        if last_user(body) == "running" {
            Reply::Hang
        } else {
            Reply::Message(
                json!({"role": "assistant", "content": format!("ACK_{}", last_user(body))}),
                "stop",
            )
        }
    });
    // The grace before the drain, in which a turn begun at the start ran whole.
    let (home, mut d) = Daemon::with_model(&model, json!({"gateway": {"drain_grace_seconds": 1}}));
    let mut ws = d.ws().await;
    let sid = ws.session("queued", &home.path).await;
    ws.submit(&sid, "running", "running").await;
    wait_until("running asked", Duration::from_secs(20), || {
        model.reached("running") == 1
    })
    .await;
    ws.submit(&sid, "queued", "queued").await;
    assert_eq!(d.term(), Some(0), "{}", home.log());
    model.release();
    assert_eq!(home.admission("queued").status, "queued");

    let mut holder =
        diesel::SqliteConnection::establish(&home.path.join("state.db").to_string_lossy())
            .expect("open state.db");
    holder
        .batch_execute("BEGIN IMMEDIATE")
        .expect("the write lock");
    let log = std::fs::OpenOptions::new()
        .append(true)
        .open(home.path.join("daemon.log"))
        .expect("log");
    let mut child = Command::new(bin())
        .args(["serve", "--home"])
        .arg(&home.path)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("log"))
        .stderr(log)
        .spawn()
        .expect("spawn gatehouse");
    wait_until("identify says starting", Duration::from_secs(10), || {
        control(&home.path, "identify", json!({}))
            .is_ok_and(|v| v["state"] == "starting" && v["pid"] == child.id())
    })
    .await;
    // SAFETY: sending a signal to our own child process.
    unsafe {
        libc::kill(child.id() as i32, libc::SIGTERM);
    }
    wait_until("the stop heard", Duration::from_secs(10), || {
        home.log().contains("SIGTERM during the start: stopping")
    })
    .await;
    holder.batch_execute("COMMIT").expect("let go");
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        assert!(std::time::Instant::now() < deadline, "{}", home.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(status.code(), Some(0), "{}", home.log());
    assert_eq!(home.admission("queued").status, "queued", "{}", home.log());
    assert_eq!(model.reached("queued"), 0);
    // The next start runs it.
    let _d = Daemon::start(&home);
    wait_until("queued ran", Duration::from_secs(20), || {
        home.admission("queued").status == "terminal"
    })
    .await;
    assert_eq!(
        home.admission("queued").outcome.as_deref(),
        Some("completed")
    );
}

/// A `gateway.host` this machine does not have (an interface not up yet at boot) is waited for
/// up to `gateway.bind_wait_seconds`, then refused for good, naming the setting; the store was
/// not touched meanwhile, and the control socket said the daemon was starting. A SIGTERM during
/// the wait ends the start at once, cleanly.
#[actix_rt::test]
async fn an_address_that_never_appears_is_waited_for_then_refused() {
    let model = FakeModel::ack();
    let home = Home::new();
    // TEST-NET-1 (RFC 5737): documentation only, never an address of a real machine.
    home.write_config(&config(
        &model.url,
        // Long enough for the three control requests below to be answered within it on a
        // loaded machine.
        json!({"gateway": {"host": "192.0.2.1", "bind_wait_seconds": 8.0}}),
    ));
    let socket_path = home.path.join("notify.sock");
    let socket = std::os::unix::net::UnixDatagram::bind(&socket_path).expect("notify socket");
    socket.set_nonblocking(true).expect("nonblocking");
    let started = std::time::Instant::now();
    let child = Command::new(bin())
        .args(["serve", "--home"])
        .arg(&home.path)
        .env("NOTIFY_SOCKET", &socket_path)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn gatehouse");
    // Its control socket answers meanwhile: `identify` says `starting`, other requests are
    // refused so (it was bound, and answered, only once the start was done).
    wait_until("identify says starting", Duration::from_secs(8), || {
        control(&home.path, "identify", json!({}))
            .is_ok_and(|v| v["state"] == "starting" && v["pid"] == child.id())
    })
    .await;
    let refused = control(
        &home.path,
        "session-ticket",
        json!({"purpose": "interactive"}),
    )
    .expect("an answer");
    assert_eq!(refused["error"]["code"], "starting", "{refused}");
    let status = control(&home.path, "status", json!({})).expect("an answer");
    assert_eq!(status["state"], "starting", "{status}");
    let (code, stderr) = exit_of(child).await;
    let waited = started.elapsed();
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("waiting for it"), "{stderr}");
    // systemd was asked for more time to start while it waited (its start timeout may be
    // shorter than the wait), and was never told the daemon is ready.
    let mut buf = [0u8; 4096];
    let mut said = Vec::new();
    while let Ok(n) = socket.recv(&mut buf) {
        said.push(String::from_utf8_lossy(&buf[..n]).to_string());
    }
    assert!(
        said.iter().any(|s| s.starts_with("EXTEND_TIMEOUT_USEC=")),
        "{said:?}"
    );
    assert!(!said.iter().any(|s| s.contains("READY=1")), "{said:?}");
    assert!(stderr.contains("gateway.bind_wait_seconds"), "{stderr}");
    assert!(waited >= Duration::from_secs(8), "{waited:?}");
    assert!(
        !home.path.join("state.db").exists(),
        "nothing durable happened before the listener"
    );
    assert!(!home.path.join("gateway.sock").exists());

    // A SIGTERM during the wait ends the start there, cleanly: it waited out the whole wait,
    // then exited 2 as a failed start.
    home.write_config(&config(
        &model.url,
        json!({"gateway": {"host": "192.0.2.1", "bind_wait_seconds": 60}}),
    ));
    let child = spawn_cli(&home, &["serve"]);
    wait_until("the start is under way", Duration::from_secs(10), || {
        control(&home.path, "identify", json!({})).is_ok_and(|v| v["state"] == "starting")
    })
    .await;
    let asked = std::time::Instant::now();
    // SAFETY: kill has no memory-safety preconditions; the pid is our child's.
    unsafe {
        libc::kill(child.id() as libc::pid_t, libc::SIGTERM);
    }
    let (code, stderr) = exit_of(child).await;
    assert_eq!(code, Some(0), "asked to stop, it stopped: {stderr}");
    assert!(
        asked.elapsed() < Duration::from_secs(10),
        "{:?}",
        asked.elapsed()
    );
    assert!(!home.path.join("gateway.sock").exists());
}

/// A state.db restored from a backup holds an older authority epoch; the next start still takes
/// one greater than every epoch taken on the home (recorded beside the database). Before, it
/// took the restored file's next one again, which an earlier process had already had.
#[test]
fn a_restored_backup_does_not_bring_an_earlier_epoch_back() {
    let model = FakeModel::ack();
    let home = Home::new();
    home.write_config(&config(&model.url, json!({})));
    let mut first = Daemon::start(&home);
    let e1 = first.epoch();
    assert_eq!(first.term(), Some(0));
    let db = home.path.join("state.db");
    let backup = home.path.join("backup.db");
    std::fs::copy(&db, &backup).expect("back up");
    let mut second = Daemon::start(&home);
    let e2 = second.epoch();
    assert!(e2 > e1);
    assert_eq!(second.term(), Some(0));
    for leftover in ["state.db-wal", "state.db-shm"] {
        let _ = std::fs::remove_file(home.path.join(leftover));
    }
    std::fs::rename(&backup, &db).expect("restore");
    let mut third = Daemon::start(&home);
    assert!(
        third.epoch() > e2,
        "epoch {} after {e2} (the backup's was {e1})",
        third.epoch()
    );
    assert_eq!(third.term(), Some(0));
}

/// A SIGHUP (often sent for a reload, which the daemon does not have) is logged and ignored:
/// the daemon goes on serving its running turn, and a SIGTERM still stops it gracefully. Before,
/// the signal's default action ended it at once, with no drain.
#[actix_rt::test]
async fn a_sighup_is_ignored_and_the_daemon_keeps_serving() {
    let model = FakeModel::start(|_| Reply::Hang);
    let (home, mut d) = Daemon::with_model(&model, json!({}));
    let mut ws = d.ws().await;
    let sid = ws.session("hup", &home.path).await;
    ws.submit(&sid, "running", "running").await;
    wait_until(
        "the turn reaches the model",
        Duration::from_secs(20),
        || model.reached("running") == 1,
    )
    .await;
    // SAFETY: sending a signal to our own child process.
    unsafe {
        libc::kill(d.child.id() as i32, libc::SIGHUP);
    }
    wait_until("the SIGHUP is logged", Duration::from_secs(20), || {
        home.log().contains("SIGHUP ignored")
    })
    .await;
    assert!(
        matches!(d.child.try_wait(), Ok(None)),
        "the daemon still runs"
    );
    let ident = control(&home.path, "identify", json!({})).expect("identify");
    assert_eq!(ident["state"], "ready", "{ident}");
    assert_eq!(home.admission("running").status, "started");
    assert_eq!(d.term(), Some(0), "SIGTERM still stops it gracefully");
    assert_eq!(
        home.admission("running").outcome.as_deref(),
        Some("interrupted")
    );
}

/// Under `Type=notify` the daemon says it is ready (with where it serves) only once it is, and
/// that it is stopping when a SIGTERM starts the drain.
#[test]
fn systemd_hears_ready_with_the_address_and_stopping() {
    use std::os::unix::net::UnixDatagram;
    let home = Home::new();
    let socket_path = home.path.join("notify.sock");
    let socket = UnixDatagram::bind(&socket_path).expect("notify socket");
    socket
        .set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    let mut d = Daemon::start_with_env(
        &home,
        &[("NOTIFY_SOCKET", socket_path.to_str().expect("utf-8 path"))],
    );
    let mut buf = [0u8; 4096];
    // The next notification other than a start-up extension (migrations ask for more time).
    let mut next = || loop {
        let n = socket.recv(&mut buf).expect("a notification");
        let said = String::from_utf8_lossy(&buf[..n]).to_string();
        if !said.starts_with("EXTEND_TIMEOUT_USEC=") {
            break said;
        }
    };
    let origin = d.identify["api_origin"]
        .as_str()
        .expect("origin")
        .to_string();
    assert_eq!(next(), format!("READY=1\nSTATUS=serving {origin}"));
    assert_eq!(
        control(&home.path, "identify", json!({})).expect("identify")["state"],
        "ready",
        "ready was said once the daemon was"
    );
    let stop = std::thread::spawn(move || d.term());
    assert_eq!(next(), "STOPPING=1");
    assert_eq!(stop.join().expect("term"), Some(0));
}

/// Wait (bounded) for a child to exit; its exit code and stderr.
async fn exit_of(mut child: std::process::Child) -> (Option<i32>, String) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Ok(Some(status)) = child.try_wait() {
            break status.code();
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            break None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let out = child.wait_with_output().expect("child output");
    (status, String::from_utf8_lossy(&out.stderr).to_string())
}

/// The Quickstart's `--home ./gatehouse-home` is relative: sessions created with no cwd get the
/// home as an absolute path (a relative one was refused as a cwd by every create). A start that
/// cannot listen is refused before it takes an authority epoch, without a panic: a port in use
/// exits 1 (the holder may be on its way out), a host that does not resolve exits 2.
#[actix_rt::test]
async fn a_relative_home_serves_sessions_and_a_start_that_cannot_listen_takes_no_epoch() {
    let model = FakeModel::start(|_| Reply::Hang);
    let home = Home::new();
    home.write_config(&config(&model.url, json!({})));
    let parent = home.path.parent().expect("temp dir").to_path_buf();
    let name = home.path.file_name().expect("home name").to_owned();
    let mut cmd = Command::new(bin());
    cmd.arg("serve")
        .arg("--home")
        .arg(std::path::Path::new(".").join(&name))
        .current_dir(&parent)
        .env_remove("OPENAI_BASE_URL")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let mut child = Reaped(cmd.spawn().expect("spawn gatehouse"));
    let mut ident = Value::Null;
    wait_until(
        "the daemon is ready",
        Duration::from_secs(60),
        || match control(&home.path, "identify", json!({})) {
            Ok(v) if v["state"] == "ready" => {
                ident = v;
                true
            }
            _ => false,
        },
    )
    .await;
    let origin = ident["api_origin"].as_str().expect("origin").to_string();
    let mut ws = Ws::connect(&home.path, &origin).await;
    let created = ws
        .ok("session.create", json!({"request_id": "no-cwd"}))
        .await;
    let sid = created["session_id"].as_str().expect("session id");
    let snap = ws.ok("session.resume", json!({"session_id": sid})).await;
    let cwd = snap["info"]["cwd"].as_str().unwrap_or_default().to_string();
    let expected = std::fs::canonicalize(home.path.join("workspace")).expect("workspace");
    assert_eq!(
        std::fs::canonicalize(&cwd).ok(),
        Some(expected),
        "the default cwd is the home's workspace, absolute: {snap}"
    );
    assert!(std::path::Path::new(&cwd).is_absolute(), "{snap}");
    drop(ws);
    // SAFETY: sending a signal to our own child process.
    unsafe {
        libc::kill(child.0.id() as i32, libc::SIGTERM);
    }
    let _ = child.0.wait();
    let epoch = ident["authority_epoch"].as_i64().expect("epoch");

    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = taken.local_addr().expect("addr").port();
    home.write_config(&config(&model.url, json!({"gateway": {"port": port}})));
    let (code, stderr) = exit_of(spawn_cli(&home, &["serve"])).await;
    assert_eq!(code, Some(1), "a port in use may free up: {stderr}");
    assert!(stderr.contains("cannot listen"), "{stderr}");
    assert!(stderr.contains("in use"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");

    home.write_config(&config(
        &model.url,
        json!({"gateway": {"host": "no-such-host.invalid", "bind_wait_seconds": 0.5}}),
    ));
    let (code, stderr) = exit_of(spawn_cli(&home, &["serve"])).await;
    assert_eq!(
        code,
        Some(2),
        "a host that still does not resolve after the wait is config: {stderr}"
    );
    assert!(stderr.contains("does not resolve"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    drop(taken);

    home.write_config(&config(&model.url, json!({})));
    let d = Daemon::start(&home);
    assert_eq!(
        d.epoch(),
        epoch + 1,
        "the refused starts took no authority epoch"
    );
}

/// `gatehouse chat` on a turn whose model asks to remove a directory, then answers `DONE`.
struct ApprovingChat {
    victim: Home,
    _model: FakeModel,
    _home: Home,
    _daemon: Daemon,
    chat: std::process::Child,
    seen: std::sync::Arc<std::sync::Mutex<String>>,
    reader: Option<std::thread::JoinHandle<()>>,
}

impl ApprovingChat {
    fn start(extra: Value) -> ApprovingChat {
        use std::io::Read;
        let (victim, cmd) = rm_keep();
        let model = FakeModel::start(move |body| {
            if asks(body) {
                Reply::Message(
                    tool_call("c1", "terminal", json!({"command": cmd})),
                    "tool_calls",
                )
            } else {
                Reply::Message(json!({"role": "assistant", "content": "DONE"}), "stop")
            }
        });
        let home = Home::new();
        home.write_config(&config(&model.url, extra));
        let daemon = Daemon::start(&home);
        let mut chat = spawn_cli(&home, &["chat", "--session", "slow", "remove it"]);
        let mut stdout = chat.stdout.take().expect("stdout");
        let seen = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let reader = {
            let seen = seen.clone();
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while let Ok(n) = stdout.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    if let Ok(mut s) = seen.lock() {
                        s.push_str(&String::from_utf8_lossy(&buf[..n]));
                    }
                }
            })
        };
        ApprovingChat {
            victim,
            _model: model,
            _home: home,
            _daemon: daemon,
            chat,
            seen,
            reader: Some(reader),
        }
    }

    fn output(&self) -> String {
        self.seen.lock().map(|s| s.clone()).unwrap_or_default()
    }

    async fn asked(&self) {
        wait_until("the approval asked", Duration::from_secs(30), || {
            self.output().contains("approval needed")
        })
        .await;
    }

    /// Wait for chat to exit (40 s at most); its status and all it printed.
    async fn ended(&mut self) -> (std::process::ExitStatus, String) {
        let deadline = std::time::Instant::now() + Duration::from_secs(40);
        let status = loop {
            if let Some(status) = self.chat.try_wait().expect("wait") {
                break status;
            }
            if std::time::Instant::now() > deadline {
                let _ = self.chat.kill();
                panic!("chat never ended: {}", self.output());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
        (status, self.output())
    }

    fn removed(&self) -> bool {
        !self.victim.path.join("keep").exists()
    }
}

/// An operator who takes longer than the daemon's client timeout to answer an approval in
/// `gatehouse chat` is heard: the client waited on the terminal alone, answered no ping, and the
/// daemon closed its connection; the answer was then refused ("connection lost") and the
/// question never asked again, so the command was denied when the approval timed out.
#[actix_rt::test]
async fn a_slow_answer_to_an_approval_in_chat_is_taken() {
    let mut c = ApprovingChat::start(
        // A client timeout of 2 s: chat's pongs must beat it on a loaded machine too.
        json!({"gateway": {"client_timeout_seconds": 2, "heartbeat_seconds": 0.2},
               "approvals": {"timeout": 20}}),
    );
    c.asked().await;
    // The operator reads the command for three client timeouts before answering.
    tokio::time::sleep(Duration::from_secs(6)).await;
    {
        let mut stdin = c.chat.stdin.take().expect("stdin");
        stdin.write_all(b"once\n").expect("answer");
    }
    let (status, out) = c.ended().await;
    assert!(status.success(), "{status:?}: {out}");
    assert!(!out.contains("not taken"), "{out}");
    assert!(out.contains("DONE"), "{out}");
    assert!(c.removed(), "the approved command ran: {out}");
}

/// An approval that ends while `gatehouse chat` waits for the operator (here it times out) ends
/// the wait: chat says so and follows the turn to its end, though its input stays open. It
/// waited for a line for good.
#[actix_rt::test]
async fn an_approval_that_times_out_in_chat_ends_the_wait_for_an_answer() {
    let mut c = ApprovingChat::start(json!({"approvals": {"timeout": 1}}));
    c.asked().await;
    // The operator never answers, and the input stays open.
    let _stdin = c.chat.stdin.take().expect("stdin");
    let (status, out) = c.ended().await;
    assert!(status.success(), "{status:?}: {out}");
    assert!(
        out.contains("the approval ended without an answer from here: timeout"),
        "{out}"
    );
    assert!(out.contains("DONE"), "{out}");
    assert!(!c.removed(), "a timed-out approval ran the command: {out}");
}

/// The control socket holds a bounded number of connections: each held a descriptor and a task
/// for as long as its client kept it open, however idle. One past the bound is told so and
/// closed; once one closes, another is served.
#[actix_rt::test]
async fn the_control_socket_holds_a_bounded_number_of_connections() {
    use std::io::{BufRead, BufReader};
    use std::os::unix::net::UnixStream;
    let model = FakeModel::ack();
    let (home, _d) = Daemon::with_model(&model, json!({}));
    let socket = home.path.join("gateway.sock");
    let mut idle: Vec<UnixStream> = (0..64)
        .map(|_| UnixStream::connect(&socket).expect("connect"))
        .collect();
    // Each is being served (its request is answered) before the next is counted.
    for s in &mut idle {
        s.write_all(b"{\"method\":\"identify\"}\n").expect("ask");
        let mut line = String::new();
        BufReader::new(s.try_clone().expect("clone"))
            .read_line(&mut line)
            .expect("answer");
        assert!(line.contains("ready"), "{line}");
    }
    let over = UnixStream::connect(&socket).expect("connect");
    over.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let mut line = String::new();
    BufReader::new(over).read_line(&mut line).expect("told");
    assert!(line.contains("busy"), "{line}");
    drop(idle.pop());
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        match control(&home.path, "identify", json!({})) {
            Ok(v) if v["state"] == "ready" => break,
            other => assert!(
                std::time::Instant::now() < deadline,
                "never served again: {other:?}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Without `--home`, the home is `$GATEHOUSE_HOME`, else `$XDG_STATE_HOME/gatehouse`, made 0700;
/// its control socket is 0600, a stale socket left by a crash is replaced, and with no model
/// configured, `OPENAI_BASE_URL` is where the turns go.
#[actix_rt::test]
async fn the_home_and_its_socket_are_the_users_alone() {
    use std::os::unix::fs::PermissionsExt;
    let model = FakeModel::ack();
    let base = Home::new();
    let mode = |p: &std::path::Path| {
        std::fs::metadata(p)
            .map(|m| m.permissions().mode() & 0o777)
            .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
    };
    for by_env in ["GATEHOUSE_HOME", "XDG_STATE_HOME"] {
        let (value, home) = match by_env {
            "GATEHOUSE_HOME" => (base.path.join("own"), base.path.join("own")),
            _ => (base.path.join("state"), base.path.join("state/gatehouse")),
        };
        let log = base.path.join(format!("{by_env}.log"));
        let start = || {
            let child = Command::new(bin())
                .arg("serve")
                .env_remove("GATEHOUSE_HOME")
                .env_remove("XDG_STATE_HOME")
                .env(by_env, &value)
                .env("OPENAI_BASE_URL", &model.url)
                .env("OPENAI_API_KEY", "loopback-only")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(&log).expect("log"))
                .spawn()
                .expect("spawn gatehouse");
            Daemon::when_ready(child, &home, || {
                format!(
                    "{by_env}: {}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                )
            })
        };
        let mut d = start();
        assert_eq!(mode(&home), 0o700, "{by_env}");
        assert_eq!(mode(&home.join("gateway.sock")), 0o600, "{by_env}");
        d.kill();
        assert!(
            home.join("gateway.sock").exists(),
            "a crash leaves its socket"
        );
        let d = start();
        assert_eq!(mode(&home.join("gateway.sock")), 0o600, "{by_env}");
        let mut ws = d.ws().await;
        let sid = ws.session(by_env, &base.path).await;
        ws.submit(&sid, by_env, "hello").await;
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while model
            .requests()
            .iter()
            .filter(|b| last_user(b) == "hello")
            .count()
            != usize::from(by_env == "XDG_STATE_HOME") + 1
        {
            assert!(
                std::time::Instant::now() < deadline,
                "{by_env}: the turn never reached the model: {}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}
