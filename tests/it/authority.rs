//! The session authority: identify, tickets, the JSON-RPC envelope, admissions, FIFO, crash and
//! graceful restart.

use std::path::Path;
use std::time::Duration;

use serde_json::json;

use crate::helpers::*;

#[actix_rt::test]
async fn identify_reports_ready_and_epochs_strictly_increase() {
    let model = FakeModel::ack();
    let (home, mut d) = Daemon::with_model(&model, json!({}));
    let first = d.identify.clone();
    assert_eq!(first["state"], "ready");
    assert_eq!(
        first["capabilities"],
        json!([
            "session-authority-v1",
            "durable-admission-v1",
            "event-replay-v1"
        ])
    );
    assert_eq!(first["instance_id"].as_str().map(str::len), Some(32));
    assert!(first["api_origin"]
        .as_str()
        .is_some_and(|o| o.starts_with("http://127.0.0.1:")));
    assert_eq!(first["pid"].as_u64(), Some(d.child.id() as u64));
    d.kill();
    let d2 = Daemon::start(&home);
    assert!(d2.epoch() > first["authority_epoch"].as_i64().expect("epoch"));
    assert_ne!(d2.identify["instance_id"], first["instance_id"]);
    let unknown = control(&home.path, "no-such-verb", json!({})).expect("reply");
    assert_eq!(unknown["error"]["code"], "unknown_method");
    assert_eq!(
        control(&home.path, "identify", json!({})).expect("still usable")["state"],
        "ready"
    );
}

#[actix_rt::test]
async fn tickets_are_required_single_use_and_expire() {
    let model = FakeModel::ack();
    let home = Home::new();
    home.write_config(&config(
        &model.url,
        json!({"gateway": {"ticket_ttl_seconds": 3}}),
    ));
    let d = Daemon::start(&home);
    let origin = d.origin();
    assert_eq!(
        try_upgrade(&origin, &["gatehouse.v1".to_string()]).await,
        Err(401)
    );
    let bogus = vec![
        "gatehouse.v1".to_string(),
        "gatehouse-ticket.nope".to_string(),
    ];
    assert_eq!(try_upgrade(&origin, &bogus).await, Err(401));
    let t = ticket(&home.path);
    let offer = vec!["gatehouse.v1".to_string(), format!("gatehouse-ticket.{t}")];
    assert_eq!(try_upgrade(&origin, &offer).await, Ok(()));
    assert_eq!(
        try_upgrade(&origin, &offer).await,
        Err(401),
        "a ticket is single-use"
    );
    let t = ticket(&home.path);
    // The only wait here is for the ticket's own lifetime to pass (3 s: every ticket above
    // must be redeemed within it, on a loaded machine too).
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let offer = vec!["gatehouse.v1".to_string(), format!("gatehouse-ticket.{t}")];
    assert_eq!(
        try_upgrade(&origin, &offer).await,
        Err(401),
        "an expired ticket is refused"
    );
}

#[actix_rt::test]
async fn the_envelope_refuses_bad_requests_and_stays_up() {
    let model = FakeModel::ack();
    let home = Home::new();
    home.write_config(&config(
        &model.url,
        json!({"gateway": {"max_frame_bytes": 4096}}),
    ));
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let v = ws.call("no.such.method", json!({})).await;
    assert_eq!(v["error"]["code"], -32601);
    assert_eq!(v["error"]["data"]["reason"], "unknown_method");
    ws.refused("session.resume", json!({"session_id": 7}), "invalid_params")
        .await;
    ws.refused(
        "session.resume",
        json!({"session_id": "x", "extra": 1}),
        "invalid_params",
    )
    .await;
    let v = ws
        .refused(
            "session.resume",
            json!({"session_id": "never-created"}),
            "not_found",
        )
        .await;
    assert_eq!(v["error"]["code"], 4001);
    ws.send_raw("{not json".into()).await;
    let v = ws.recv_reply().await;
    assert_eq!(v["error"]["code"], -32700);
    ws.send_raw(json!([{"jsonrpc": "2.0", "id": 1, "method": "session.resume"}]).to_string())
        .await;
    assert_eq!(ws.recv_reply().await["error"]["code"], -32600);
    ws.send_raw(json!({"jsonrpc": "1.0", "id": 2, "method": "session.resume"}).to_string())
        .await;
    let v = ws.recv_reply().await;
    assert_eq!(
        (v["id"].clone(), v["error"]["code"].clone()),
        (json!(2), json!(-32600))
    );
    ws.send_raw(
        json!({"jsonrpc": "2.0", "id": 3, "method": "x", "pad": "y".repeat(8000)}).to_string(),
    )
    .await;
    let v = ws.recv_reply().await;
    assert_eq!(v["error"]["data"]["reason"], "payload_too_large");
    ws.send_binary(vec![1, 2, 3]).await;
    assert_eq!(ws.recv_reply().await["error"]["code"], -32600);
    // Still serving on the same connection.
    let s = ws.create("after-abuse", &home.path, json!({})).await;
    assert!(s["session_id"]
        .as_str()
        .is_some_and(|s| s.starts_with("local-")));
}

/// A session created before the cwd was compared as a path holds the digest of the cwd's text:
/// after an upgrade, the same request still finds it.
#[actix_rt::test]
async fn a_session_with_the_digest_of_its_cwds_text_is_found_again() {
    use diesel::prelude::*;
    use gatehouse::store::schema::sessions;
    use sha2::Digest;
    let model = FakeModel::ack();
    let (home, mut d) = Daemon::with_model(&model, json!({}));
    let cwd = format!("{}/", home.path.display());
    let mut ws = d.ws().await;
    let old = ws
        .create("req-old", Path::new(&cwd), json!({"toolsets": []}))
        .await;
    drop(ws);
    assert_eq!(d.term(), Some(0));
    let text = json!({
        "source": "cli", "cwd": cwd, "model": null, "provider": null, "base_url": null,
        "toolsets": [], "profile": null, "title": null,
    });
    let legacy = gatehouse::store::admissions::hex(&sha2::Sha256::digest(text.to_string()));
    let mut db = SqliteConnection::establish(&home.path.join("state.db").to_string_lossy())
        .expect("open state.db");
    let updated = diesel::update(sessions::table.filter(sessions::request_id.eq("req-old")))
        .set(sessions::request_digest.eq(&legacy))
        .execute(&mut db)
        .expect("set the legacy digest");
    assert_eq!(updated, 1);
    drop(db);
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let again = ws
        .create("req-old", Path::new(&cwd), json!({"toolsets": []}))
        .await;
    assert_eq!(again["session_id"], old["session_id"]);
}

#[actix_rt::test]
async fn create_is_idempotent_conflicts_and_freezes_its_policy() {
    let model = FakeModel::ack();
    let (home, mut d) = Daemon::with_model(&model, json!({}));
    let mut ws = d.ws().await;
    let a = ws
        .create("req-1", &home.path, json!({"toolsets": []}))
        .await;
    let b = ws
        .create("req-1", &home.path, json!({"toolsets": []}))
        .await;
    assert_eq!(a["session_id"], b["session_id"]);
    assert_eq!(a["info"]["model"], "fake-model");
    // The cwd is compared as a path: a trailing slash is the same request.
    let slashed = ws
        .create(
            "req-1",
            Path::new(&format!("{}/", home.path.display())),
            json!({"toolsets": []}),
        )
        .await;
    assert_eq!(slashed["session_id"], a["session_id"]);
    // The directory checked is the one kept: a session made through a symlink works in its
    // target, wherever the link points later.
    let real = home.path.join("real");
    std::fs::create_dir(&real).unwrap();
    let link = home.path.join("link");
    std::os::unix::fs::symlink(&real, &link).unwrap();
    let linked = ws.create("req-9", &link, json!({"toolsets": []})).await;
    assert_eq!(
        linked["info"]["cwd"],
        real.canonicalize().unwrap().to_string_lossy().as_ref()
    );
    ws.refused(
        "session.create",
        json!({"request_id": "req-1", "cwd": home.path, "toolsets": [], "model": "other"}),
        "invalid_params",
    )
    .await;
    ws.refused(
        "session.create",
        json!({"request_id": "req-2", "cwd": "relative/dir"}),
        "invalid_params",
    )
    .await;
    ws.refused(
        "session.create",
        json!({"request_id": "req-3", "cwd": home.path, "toolsets": ["rocket"]}),
        "invalid_params",
    )
    .await;
    // A client narrows the tools the operator enabled for its source, never widens them: an
    // unattended (`api`) session is offered `terminal` only, so asking for `clarify` is refused.
    let widened = ws
        .refused(
            "session.create",
            json!({"request_id": "req-4", "cwd": home.path, "source": "api", "toolsets": ["terminal", "clarify"]}),
            "invalid_params",
        )
        .await;
    assert!(
        widened
            .to_string()
            .contains(r#"toolset \"clarify\" is not enabled for source \"api\""#),
        "{widened}"
    );
    let narrowed = ws
        .create(
            "req-5",
            &home.path,
            json!({"source": "api", "toolsets": ["terminal"]}),
        )
        .await;
    assert_eq!(narrowed["info"]["toolsets"], json!(["terminal"]));
    // A tool named twice is offered once; what a client names is bounded.
    let twice = ws
        .create(
            "req-8",
            &home.path,
            json!({"toolsets": ["terminal", "clarify", "terminal"]}),
        )
        .await;
    assert_eq!(twice["info"]["toolsets"], json!(["terminal", "clarify"]));
    for (field, len) in [
        ("title", 513),
        ("model", 257),
        ("provider", 257),
        ("base_url", 2049),
    ] {
        let mut long = "x".repeat(len);
        if field == "base_url" {
            long = format!("http://{}", &long[7..]);
        }
        ws.refused(
            "session.create",
            json!({"request_id": format!("long-{field}"), "cwd": home.path, field: long}),
            "invalid_params",
        )
        .await;
    }
    let defaulted = ws
        .ok(
            "session.create",
            json!({"request_id": "req-6", "toolsets": []}),
        )
        .await;
    // By default a session works in the home's `workspace`, not among the gateway's own files.
    let workspace = home
        .path
        .join("workspace")
        .canonicalize()
        .expect("workspace");
    assert_eq!(
        defaulted["info"]["cwd"],
        workspace.to_string_lossy().as_ref()
    );
    drop(ws);
    d.kill();
    // The config changes; the existing session keeps its frozen model and (empty) toolsets.
    // Its default directory is now one that no longer exists (a start refuses a missing one,
    // so it goes away after the start): a retry of a create that took the default still gets
    // its session (the config decides only what a new session gets).
    let gone = home.path.join("gone");
    std::fs::create_dir(&gone).expect("mkdir");
    home.write_config(&config(
        &model.url,
        json!({"model": {"default": "changed-model"}, "terminal": {"cwd": gone}}),
    ));
    let d = Daemon::start(&home);
    std::fs::remove_dir(&gone).expect("rmdir");
    let mut ws = d.ws().await;
    let again = ws
        .ok(
            "session.create",
            json!({"request_id": "req-6", "toolsets": []}),
        )
        .await;
    assert_eq!(again["session_id"], defaulted["session_id"]);
    assert_eq!(again["info"]["cwd"], defaulted["info"]["cwd"]);
    ws.refused(
        "session.create",
        json!({"request_id": "req-7", "toolsets": []}),
        "invalid_params",
    )
    .await;
    let c = ws
        .create("req-1", &home.path, json!({"toolsets": []}))
        .await;
    assert_eq!(c["session_id"], a["session_id"]);
    assert_eq!(c["info"]["model"], "fake-model");
    let sid = c["session_id"].as_str().expect("sid").to_string();
    ws.submit(&sid, "in-1", "hello").await;
    wait_until("the turn", Duration::from_secs(20), || all_terminal(&home)).await;
    let req = &model.requests()[0];
    assert_eq!(req["model"], "fake-model");
    assert!(
        req.get("tools").is_none(),
        "an empty toolset list sends no tools: {req}"
    );
    let fresh = ws.create("req-new", &home.path, json!({})).await;
    assert_eq!(fresh["info"]["model"], "changed-model");
}

#[actix_rt::test]
async fn submit_is_durable_idempotent_and_needs_a_subscription() {
    let model = FakeModel::ack();
    let (home, d) = Daemon::with_model(&model, json!({}));
    let mut ws = d.ws().await;
    let sid = ws.session("s", &home.path).await;
    let first = ws.submit(&sid, "in-1", "hello").await;
    // An idle session claims the input in its admission's own transaction: the reply says so
    // (`started`, with the generation the row was given), as a crash right after it would find.
    assert_eq!(first["status"], "started", "{first}");
    assert!(first["execution_generation"].as_i64().is_some(), "{first}");
    assert_eq!(
        first["execution_generation"].as_i64(),
        home.admission("in-1").execution_generation
    );
    assert!(
        home.admissions()
            .iter()
            .any(|r| r.admission_id == first["admission_id"]),
        "committed before the reply"
    );
    wait_until("the turn", Duration::from_secs(20), || all_terminal(&home)).await;
    let again = ws.submit(&sid, "in-1", "hello").await;
    assert_eq!(again["admission_id"], first["admission_id"]);
    assert_eq!(again["status"], "terminal");
    assert_eq!(again["outcome"], "completed");
    // A submit is answered with a receipt, not the turn's result (prompt.receipt has it): the
    // same finished input sent again many times over, unread, held its whole result each time.
    assert!(again.get("result").is_none(), "{again}");
    ws.refused(
        "prompt.submit",
        json!({"session_id": sid, "input_id": "in-1", "text": "other"}),
        "admission_conflict",
    )
    .await;
    let r = ws
        .ok(
            "prompt.receipt",
            json!({"session_id": sid, "admission_id": first["admission_id"]}),
        )
        .await;
    assert_eq!(r["outcome"], "completed");
    assert_eq!(r["result"]["final_response"], "ACK_hello");
    // A second connection must resume before it may submit.
    let mut other = d.ws().await;
    other
        .refused(
            "prompt.submit",
            json!({"session_id": sid, "input_id": "in-2", "text": "x"}),
            "permission_denied",
        )
        .await;
    other.ok("session.resume", json!({"session_id": sid})).await;
    other.submit(&sid, "in-2", "x").await;
    wait_until("the second turn", Duration::from_secs(20), || {
        all_terminal(&home)
    })
    .await;
    assert_eq!(model.reached("hello"), 1);
    assert_eq!(model.reached("x"), 1);
}

#[actix_rt::test]
async fn inputs_run_in_fifo_order_one_at_a_time() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    // The model counts the session's requests in flight; each takes a while, so a second turn
    // running beside the first would be seen.
    let (in_flight, peak) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let (now, most) = (in_flight.clone(), peak.clone());
    let model = FakeModel::start(move |body| {
        most.fetch_max(now.fetch_add(1, Ordering::SeqCst) + 1, Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(20));
        now.fetch_sub(1, Ordering::SeqCst);
        Reply::Message(
            json!({"role": "assistant", "content": format!("ACK_{}", last_user(body))}),
            "stop",
        )
    });
    let (home, d) = Daemon::with_model(&model, json!({}));
    let mut ws = d.ws().await;
    let sid = ws.session("fifo", &home.path).await;
    let names: Vec<String> = (0..12).map(|i| format!("IN_{i:02}")).collect();
    for n in &names {
        ws.submit(&sid, n, n).await;
    }
    wait_until("all turns", Duration::from_secs(30), || {
        home.admissions().iter().all(|r| r.status == "terminal")
    })
    .await;
    assert_eq!(
        peak.load(Ordering::SeqCst),
        1,
        "one turn of the session at a time"
    );
    assert_eq!(
        model.texts(),
        names,
        "the model saw inputs in admission order"
    );
    let gens: Vec<i64> = home
        .admissions()
        .iter()
        .filter_map(|r| r.execution_generation)
        .collect();
    assert_eq!(
        gens,
        (1..=12).collect::<Vec<_>>(),
        "each claim takes the next generation"
    );
    let transcript = home.transcript(&sid);
    let users: Vec<_> = transcript
        .iter()
        .filter(|m| m.role == "user")
        .filter_map(|m| m.content.clone())
        .collect();
    assert_eq!(users, names);
}

#[actix_rt::test]
async fn a_crash_leaves_unknown_work_that_holds_the_fifo_until_resolved() {
    let model = FakeModel::start(|body| {
        if last_user(body) == "LOST" {
            Reply::Hang
        } else {
            Reply::Message(
                json!({"role": "assistant", "content": format!("ACK_{}", last_user(body))}),
                "stop",
            )
        }
    });
    let (home, mut d) = Daemon::with_model(&model, json!({}));
    let mut ws = d.ws().await;
    let sid = ws.session("crash", &home.path).await;
    let lost = ws.submit(&sid, "LOST", "LOST").await;
    wait_until("the model to hold LOST", Duration::from_secs(20), || {
        model.reached("LOST") == 1
    })
    .await;
    ws.submit(&sid, "F1", "F1").await;
    ws.submit(&sid, "F2", "F2").await;
    d.kill();
    assert_eq!(home.admission("LOST").status, "started");
    let first_epoch = d.epoch();
    // Across two restarts the unknown row holds its followers.
    for _ in 0..2 {
        let mut d2 = Daemon::start(&home);
        assert!(d2.epoch() > first_epoch);
        let mut ws = d2.ws().await;
        let snap = ws.ok("session.resume", json!({"session_id": sid})).await;
        let statuses: Vec<(String, String)> = snap["pending"]
            .as_array()
            .expect("pending")
            .iter()
            .map(|r| {
                (
                    r["input_id"].as_str().unwrap_or("").to_string(),
                    r["status"].as_str().unwrap_or("").to_string(),
                )
            })
            .collect();
        assert_eq!(
            statuses,
            vec![
                ("LOST".into(), "unknown".into()),
                ("F1".into(), "queued".into()),
                ("F2".into(), "queued".into())
            ]
        );
        assert_eq!(model.reached("F1"), 0, "nothing runs behind unknown work");
        d2.kill();
    }
    let d3 = Daemon::start(&home);
    let mut ws = d3.ws().await;
    ws.ok("session.resume", json!({"session_id": sid})).await;
    // A new input to the idle session is admitted (its claim, tried in the same transaction, is
    // refused by the unknown row) and waits its turn.
    let f3 = ws.submit(&sid, "F3", "F3").await;
    assert_eq!(f3["status"], "queued", "{f3}");
    assert_eq!(home.admission("F3").status, "queued");
    // The boot that found the lost turn reported it in the durable event log, once.
    let log = ws
        .ok(
            "session.events.since",
            json!({"session_id": sid, "last_sequence": 0}),
        )
        .await;
    let reported = log["events"]
        .as_array()
        .map(|evs| {
            evs.iter()
                .filter(|e| e["payload"]["unknown"] == lost["admission_id"])
                .count()
        })
        .unwrap_or(0);
    assert_eq!(reported, 1, "{log}");
    let gen = home
        .admission("LOST")
        .execution_generation
        .expect("generation");
    ws.refused(
        "prompt.resolve_unknown",
        json!({"session_id": sid, "admission_id": lost["admission_id"], "execution_generation": gen + 5}),
        "stale_generation",
    )
    .await;
    let r = ws
        .ok("prompt.resolve_unknown", json!({"session_id": sid, "admission_id": lost["admission_id"], "execution_generation": gen}))
        .await;
    assert_eq!(
        (r["status"].as_str(), r["outcome"].as_str()),
        (Some("terminal"), Some("interrupted"))
    );
    wait_until("followers", Duration::from_secs(20), || all_terminal(&home)).await;
    assert_eq!(
        model.reached("LOST"),
        1,
        "the lost input is never sent again"
    );
    assert_eq!(
        (
            model.reached("F1"),
            model.reached("F2"),
            model.reached("F3")
        ),
        (1, 1, 1)
    );
    let reqs = model.requests();
    let f1 = reqs
        .iter()
        .find(|b| last_user(b) == "F1")
        .expect("F1 request");
    assert_eq!(
        user_texts(f1),
        vec!["LOST".to_string(), "F1".to_string()],
        "separate user messages"
    );
    assert_eq!(roles(f1), ["user", "assistant", "user"], "LOST is closed");
    let order: Vec<String> = model
        .texts()
        .into_iter()
        .filter(|t| t.starts_with('F'))
        .collect();
    assert_eq!(
        order,
        vec!["F1".to_string(), "F2".to_string(), "F3".to_string()]
    );
    ws.refused(
        "prompt.resolve_unknown",
        json!({"session_id": sid, "admission_id": lost["admission_id"], "execution_generation": gen}),
        "stale_generation",
    )
    .await;
}

/// A session whose stored launch policy is damaged (its toolsets no longer parse) runs nothing:
/// `session.resume` is refused `storage_unavailable`, an input sent to it is admitted and stays
/// queued, with no model request, while other sessions run. Repaired, it runs after a restart,
/// once. Before, the damaged list was read as "no tools", and the input ran under it.
#[actix_rt::test]
async fn a_session_whose_stored_policy_is_damaged_runs_nothing() {
    use diesel::connection::SimpleConnection;
    use diesel::prelude::*;
    use gatehouse::store::schema::sessions;
    let model = FakeModel::ack();
    let (home, mut d) = Daemon::with_model(&model, json!({}));
    let mut ws = d.ws().await;
    let sid = ws.session("damaged", &home.path).await;
    let healthy = ws.session("healthy", &home.path).await;
    let db_path = home.path.join("state.db").to_string_lossy().to_string();
    let set_toolsets = |value: &str| {
        let mut db = SqliteConnection::establish(&db_path).expect("open state.db");
        // The gateway's writer may be committing (or checkpointing) at that moment.
        db.batch_execute("PRAGMA busy_timeout = 10000")
            .expect("a busy timeout");
        let updated = diesel::update(sessions::table.filter(sessions::id.eq(&sid)))
            .set(sessions::toolsets_json.eq(value))
            .execute(&mut db)
            .expect("set the stored toolsets");
        assert_eq!(updated, 1);
    };
    let intact: String = sessions::table
        .filter(sessions::id.eq(&sid))
        .select(sessions::toolsets_json)
        .first(&mut home.db())
        .expect("the stored toolsets");
    set_toolsets("{\"not\": \"a list\"");
    ws.refused(
        "session.resume",
        json!({"session_id": sid}),
        "storage_unavailable",
    )
    .await;
    // Its claim was tried in the admission's own transaction, and refused.
    let queued = ws.submit(&sid, "D1", "D1").await;
    assert_eq!(queued["status"], "queued", "{queued}");
    ws.submit(&healthy, "H1", "H1").await;
    wait_until("H1", Duration::from_secs(30), || {
        home.admission("H1").status == "terminal"
    })
    .await;
    assert_eq!(home.admission("D1").status, "queued");
    assert_eq!(model.reached("D1"), 0, "nothing of the session ran");
    // The supervisor logs it once it has the claim's refusal (not tied to H1's turn).
    wait_until("the held queue logged", Duration::from_secs(30), || {
        home.log()
            .lines()
            .any(|l| l.contains("FIFO held") && l.contains("stored toolsets are not a list"))
    })
    .await;
    drop(ws);
    assert_eq!(d.term(), Some(0));

    set_toolsets(&intact);
    let d = Daemon::start(&home);
    wait_until("D1 after the repair", Duration::from_secs(30), || {
        home.admission("D1").status == "terminal"
    })
    .await;
    assert_eq!(home.admission("D1").outcome.as_deref(), Some("completed"));
    assert_eq!(model.reached("D1"), 1);
    let mut ws = d.ws().await;
    ws.ok("session.resume", json!({"session_id": sid})).await;
}

#[actix_rt::test]
async fn sigterm_interrupts_the_running_turn_and_followers_run_after_restart() {
    a_graceful_stop_interrupts_the_running_turn(libc::SIGTERM).await;
}

/// SIGINT (Ctrl-C in a terminal) stops as gracefully as SIGTERM.
#[actix_rt::test]
async fn sigint_stops_as_gracefully_as_sigterm() {
    a_graceful_stop_interrupts_the_running_turn(libc::SIGINT).await;
}

/// A stop by `signal` while a turn runs: it exits 0, the running input settles interrupted,
/// the one behind it stays queued and runs after the restart, after the interrupted one's
/// closing message (never sent again).
async fn a_graceful_stop_interrupts_the_running_turn(signal: libc::c_int) {
    let model = FakeModel::start(|body| {
        if last_user(body) == "SLOW" {
            Reply::Hang
        } else {
            Reply::Message(
                json!({"role": "assistant", "content": format!("ACK_{}", last_user(body))}),
                "stop",
            )
        }
    });
    let (home, mut d) = Daemon::with_model(&model, json!({}));
    let mut ws = d.ws().await;
    let sid = ws.session("term", &home.path).await;
    ws.submit(&sid, "SLOW", "SLOW").await;
    wait_until("the model to hold SLOW", Duration::from_secs(20), || {
        model.reached("SLOW") == 1
    })
    .await;
    ws.submit(&sid, "AFTER", "AFTER").await;
    assert_eq!(d.stop_with(signal), Some(0), "a graceful stop exits 0");
    let slow = home.admission("SLOW");
    assert_eq!(
        (slow.status.as_str(), slow.outcome.as_deref()),
        ("terminal", Some("interrupted"))
    );
    assert_eq!(home.admission("AFTER").status, "queued");
    assert!(
        !home.path.join("gateway.sock").exists(),
        "the socket is removed on a clean stop"
    );
    let _d2 = Daemon::start(&home);
    wait_until("the follower", Duration::from_secs(20), || {
        all_terminal(&home)
    })
    .await;
    assert_eq!(
        home.admission("AFTER").outcome.as_deref(),
        Some("completed")
    );
    assert_eq!(model.reached("SLOW"), 1);
    let reqs = model.requests();
    let after = reqs
        .iter()
        .find(|b| last_user(b) == "AFTER")
        .expect("AFTER request");
    assert_eq!(
        user_texts(after),
        vec!["SLOW".to_string(), "AFTER".to_string()]
    );
    assert_eq!(
        roles(after),
        ["user", "assistant", "user"],
        "SLOW is closed"
    );
}

#[actix_rt::test]
async fn a_queued_admission_committed_before_a_kill_runs_exactly_once() {
    let model = FakeModel::start(|body| {
        if last_user(body) == "HEAD" {
            Reply::Hang
        } else {
            Reply::Message(json!({"role": "assistant", "content": "ok"}), "stop")
        }
    });
    let (home, mut d) = Daemon::with_model(&model, json!({}));
    let mut ws = d.ws().await;
    let sid = ws.session("a", &home.path).await;
    let head = ws.submit(&sid, "HEAD", "HEAD").await;
    wait_until("HEAD in flight", Duration::from_secs(20), || {
        model.reached("HEAD") == 1
    })
    .await;
    let queued = ws.submit(&sid, "QUEUED", "QUEUED").await;
    assert_eq!(queued["status"], "queued");
    d.kill();
    assert_eq!(
        home.admission("QUEUED").status,
        "queued",
        "acknowledged means committed"
    );
    let d2 = Daemon::start(&home);
    let mut ws = d2.ws().await;
    ws.ok("session.resume", json!({"session_id": sid})).await;
    let gen = home
        .admission("HEAD")
        .execution_generation
        .expect("generation");
    ws.ok("prompt.resolve_unknown", json!({"session_id": sid, "admission_id": head["admission_id"], "execution_generation": gen}))
        .await;
    wait_until("QUEUED settled", Duration::from_secs(20), || {
        all_terminal(&home)
    })
    .await;
    assert_eq!(
        home.admission("QUEUED").outcome.as_deref(),
        Some("completed")
    );
    assert_eq!(model.reached("QUEUED"), 1, "ran exactly once");
    assert_eq!(model.reached("HEAD"), 1, "the lost head never ran again");
}

/// The system prompt is built with the session, stored in its row, and sent byte for byte on
/// every turn, even after the configuration that built it changes.
#[actix_rt::test]
async fn the_system_prompt_is_built_once_with_the_session() {
    use diesel::prelude::*;
    let model = FakeModel::ack();
    let home = Home::new();
    home.write_config(&config(
        &model.url,
        json!({"agent": {"system_prompt": "Be brief."}}),
    ));
    let mut d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let sid = ws.session("sp", &home.path).await;
    let stored: Option<String> = gatehouse::store::schema::sessions::table
        .filter(gatehouse::store::schema::sessions::id.eq(&sid))
        .select(gatehouse::store::schema::sessions::system_prompt)
        .first(&mut home.db())
        .expect("session row");
    let stored = stored.expect("the system prompt is stored at creation");
    assert!(stored.contains("Be brief."), "{stored}");
    assert!(
        stored.contains(&format!("Working directory: {}", home.path.display())),
        "{stored}"
    );
    ws.submit(&sid, "in-1", "hello").await;
    wait_until("the first turn", Duration::from_secs(20), || {
        all_terminal(&home)
    })
    .await;
    drop(ws);
    d.kill();
    home.write_config(&config(
        &model.url,
        json!({"agent": {"system_prompt": "Be verbose."}}),
    ));
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let again = ws.session("sp", &home.path).await;
    assert_eq!(again, sid);
    ws.submit(&sid, "in-2", "again").await;
    wait_until("the second turn", Duration::from_secs(20), || {
        all_terminal(&home) && home.admissions().len() == 2
    })
    .await;
    let sent: Vec<serde_json::Value> = model
        .requests()
        .iter()
        .map(|r| r["messages"][0].clone())
        .collect();
    assert_eq!(sent.len(), 2, "{sent:?}");
    for m in &sent {
        assert_eq!(m["role"], "system");
        assert_eq!(m["content"].as_str(), Some(stored.as_str()));
    }
}

/// A resume snapshot is of one moment: its transcript holds exactly the replies whose
/// `message.complete` is at or below its `last_sequence`, however fast the session moves.
/// Before, `last_sequence` was read after the transcript, and a reply settled in between was in
/// neither the snapshot nor the events after it (5 of 300 snapshots under load).
/// A snapshot carries a pending input's text up to 4,096 characters, and says when it cut one
/// (with its whole length): a session of long queued inputs made every `session.resume` a
/// frame of all of them in full (1,000 inputs of 256 KiB: a quarter of a gigabyte).
#[actix_rt::test]
async fn a_snapshot_carries_the_start_of_a_long_pending_input() {
    let model = FakeModel::ack_or_hang();
    let (home, d) = Daemon::with_model(&model, json!({}));
    let mut ws = d.ws().await;
    let sid = ws.session("long-pending", &home.path).await;
    ws.submit(&sid, "HANG", "HANG").await;
    // Multi-byte characters: the cut is by character, never inside one.
    let long = "é".repeat(10_000);
    ws.submit(&sid, "LONG", &long).await;
    ws.submit(&sid, "SHORT", "short").await;
    let snapshot = ws.ok("session.resume", json!({"session_id": sid})).await;
    let pending = snapshot["pending"].as_array().expect("pending");
    let by_id = |id: &str| {
        pending
            .iter()
            .find(|p| p["input_id"] == id)
            .unwrap_or_else(|| panic!("{id} is pending: {snapshot}"))
    };
    let cut = by_id("LONG");
    assert_eq!(cut["text"], "é".repeat(4096), "the start of the text");
    assert_eq!(cut["text_truncated"], true, "{cut}");
    assert_eq!(cut["text_chars"], 10_000, "{cut}");
    let whole = by_id("SHORT");
    assert_eq!(whole["text"], "short");
    assert!(whole.get("text_truncated").is_none(), "{whole}");
    // The input itself is whole: the model gets all of it once the FIFO moves on.
    let running = by_id("HANG");
    ws.ok(
        "session.interrupt",
        json!({"session_id": sid, "execution_generation": running["execution_generation"]}),
    )
    .await;
    wait_until("the long input ran", Duration::from_secs(30), || {
        model.texts().contains(&long)
    })
    .await;
}

#[actix_rt::test]
async fn a_resume_snapshot_is_of_one_moment() {
    let model = FakeModel::ack();
    let (home, d) = Daemon::with_model(&model, json!({}));
    let mut writer = d.ws().await;
    let sid = writer.session("moment", &home.path).await;
    let inputs = 200;
    let busy = {
        let sid = sid.clone();
        actix_rt::spawn(async move {
            for i in 0..inputs {
                writer.submit(&sid, &format!("m{i}"), "go").await;
            }
        })
    };
    let mut reader = d.ws().await;
    let mut checked = 0;
    while checked < 120 {
        let snap = reader
            .ok("session.resume", json!({"session_id": sid}))
            .await;
        let last = snap["last_sequence"].as_i64().expect("last_sequence");
        let replies = snap["messages"]
            .as_array()
            .map_or(0, |m| m.iter().filter(|m| m["role"] == "assistant").count());
        let (mut completed, mut after) = (0, 0);
        while after < last {
            let events = reader.events_after(&sid, after).await;
            completed += events
                .iter()
                .filter(|e| e["type"] == "message.complete")
                .filter(|e| e["seq"].as_i64().is_some_and(|s| s <= last))
                .count();
            after = events
                .last()
                .and_then(|e| e["seq"].as_i64())
                .unwrap_or(last);
        }
        assert_eq!(
            replies, completed,
            "the snapshot at {last} holds {replies} replies"
        );
        checked += 1;
    }
    busy.await.expect("submits");
    wait_until("all turns", Duration::from_secs(60), || all_terminal(&home)).await;
}

/// An interrupt naming an attempt that a claim in flight is starting stops it. A client may
/// know of the attempt (from a receipt read from the store, or by counting: generations go up
/// by one) before the session's supervisor has heard the claim answered; it was refused as if
/// nothing ran, and the attempt ran on.
#[actix_rt::test]
async fn an_interrupt_naming_the_attempt_being_claimed_stops_it() {
    let model = FakeModel::start(|_| Reply::Hang);
    let (home, d) = Daemon::with_model(&model, json!({}));
    let mut ws = d.ws().await;
    let sid = ws.session("claim-window", &home.path).await;
    let inputs = 12;
    let mut admissions = Vec::new();
    for i in 1..=inputs {
        let receipt = ws.submit(&sid, &format!("I{i}"), "wait").await;
        admissions.push(receipt["admission_id"].clone());
    }
    for generation in 1..=inputs {
        if generation > 1 {
            // The attempt before has settled: its reply is out, and the next claim is on its way.
            let before = admissions[generation as usize - 2].clone();
            ws.event(Duration::from_secs(30), |e| {
                e["type"] == "message.complete" && e["payload"]["admission_id"] == before
            })
            .await;
        }
        let reply = ws
            .call(
                "session.interrupt",
                json!({"session_id": sid, "execution_generation": generation}),
            )
            .await;
        assert_eq!(
            reply["result"]["interrupted"], true,
            "generation {generation}: {reply}"
        );
    }
    wait_until("all settled", Duration::from_secs(30), || {
        all_terminal(&home)
    })
    .await;
    for row in home.admissions() {
        assert_eq!(row.outcome.as_deref(), Some("interrupted"), "{row:?}");
    }
    model.release();
}

/// Wait for the reply of `admission`: the end of its turn as its session saw it (sent after its
/// settlement).
async fn turn_ended(ws: &mut Ws, admission: &serde_json::Value) {
    ws.event(Duration::from_secs(30), |e| {
        e["type"] == "message.complete" && e["payload"]["admission_id"] == *admission
    })
    .await;
}

/// `interrupted: true` means the attempt was stopped: an interrupt that reaches a turn which has
/// already decided how it ends (its settlement on its way) answers `false`, never `true` for
/// an input that then settles `completed` or `failed`. The interrupts are sent at a sweep of
/// moments after each submit, so some land while the turn asks the model and some while it
/// settles.
#[actix_rt::test]
async fn an_interrupt_answers_true_only_for_an_attempt_it_stopped() {
    // Every third input fails at the model: a failure that raced the interrupt is no less
    // interrupted for it.
    let model = FakeModel::start(|body| {
        let text = last_user(body);
        if text.ends_with('0') || text.ends_with('3') || text.ends_with('6') {
            return Reply::Status(400, json!({"error": {"message": "refused"}}));
        }
        Reply::Message(
            json!({"role": "assistant", "content": format!("ACK_{text}")}),
            "stop",
        )
    });
    let (home, d) = Daemon::with_model(&model, json!({}));
    let mut ws = d.ws().await;
    let sid = ws.session("settle-window", &home.path).await;
    let mut answers = Vec::new();
    for i in 0..80u64 {
        let input = format!("S{i}");
        let receipt = ws.submit(&sid, &input, &input).await;
        let admission = receipt["admission_id"].clone();
        let Some(generation) = receipt["execution_generation"].as_i64() else {
            // Queued behind a claim of the session's own (a loaded machine): not started here.
            turn_ended(&mut ws, &admission).await;
            continue;
        };
        tokio::time::sleep(Duration::from_micros((i % 20) * 100)).await;
        let reply = ws
            .call(
                "session.interrupt",
                json!({"session_id": sid, "execution_generation": generation}),
            )
            .await;
        turn_ended(&mut ws, &admission).await;
        let row = home.admission(&input);
        let outcome = row.outcome.clone().unwrap_or_default();
        match reply["result"]["interrupted"].as_bool() {
            Some(true) => assert_eq!(outcome, "interrupted", "told stopped: {row:?}"),
            Some(false) => assert!(
                matches!(outcome.as_str(), "completed" | "failed"),
                "told not stopped: {row:?}"
            ),
            None => assert_eq!(
                reply["error"]["data"]["reason"], "stale_generation",
                "{reply}"
            ),
        }
        answers.push(reply);
    }
    assert!(
        answers
            .iter()
            .any(|r| r["result"]["interrupted"] == json!(true)),
        "no interrupt landed while a turn ran"
    );
}
