//! Hosted rooms end to end: the real daemon, the room runtime over the local session port, and a
//! loopback model.

use std::time::Duration;

use serde_json::{json, Value};

use crate::helpers::*;

async fn room_tasks(ws: &mut Ws, room: &str) -> Vec<Value> {
    ws.ok("room.tasks", json!({"room_id": room})).await["tasks"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

async fn task_status(ws: &mut Ws, room: &str, task: &str) -> String {
    room_tasks(ws, room)
        .await
        .iter()
        .find(|t| t["identity"]["task_id"] == task)
        .and_then(|t| t["status"].as_str().map(str::to_string))
        .unwrap_or_default()
}

async fn wait_status(ws: &mut Ws, room: &str, task: &str, want: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    status_by(ws, room, task, deadline, |s| s == want).await;
}

/// Read `task`'s status until `done` holds, by `deadline` (else fail); that status.
async fn status_by(
    ws: &mut Ws,
    room: &str,
    task: &str,
    deadline: std::time::Instant,
    done: impl Fn(&str) -> bool,
) -> String {
    loop {
        let s = task_status(ws, room, task).await;
        if done(&s) {
            return s;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{room}/{task} is still {s}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn admit(room: &str, task: &str, profile: &str, prompt: &str, seq: i64) -> Value {
    json!({"room_id": room, "task_id": task, "thread_id": format!("th-{task}"), "turn_id": format!("tu-{task}"),
           "target_profile": profile, "prompt": prompt, "source_event_seq": seq})
}

#[actix_rt::test]
async fn a_parked_room_blocks_no_other_room_and_its_deadline_frees_the_slot() {
    let victim = Home::new();
    let model = parking_model(&victim);
    let home = Home::new();
    home.write_config(&config(
        &model.url,
        json!({
            "profiles": {"ops": {"toolsets": ["terminal"]}, "dev": {"toolsets": []}},
            // The deadline leaves a loaded machine time to park the turn and report it first.
            "rooms": {"turn_timeout_seconds": 6, "poll_interval_seconds": 0.2, "active_poll_interval_seconds": 0.05,
                      "max_concurrent_rooms": 2},
        }),
    ));
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    ws.ok(
        "room.create",
        json!({"room_id": "room-a", "name": "A", "members": [{"profile": "ops", "handle": "ops"}]}),
    )
    .await;
    let again = ws
        .ok("room.create", json!({"room_id": "room-a", "name": "A", "members": [{"profile": "ops", "handle": "ops"}]}))
        .await;
    assert_eq!(again["idempotent"], true);
    ws.refused(
        "room.create",
        json!({"room_id": "room-a", "name": "other", "members": [{"profile": "ops", "handle": "ops"}]}),
        "admission_conflict",
    )
    .await;
    ws.ok(
        "room.create",
        json!({"room_id": "room-b", "name": "B", "members": [{"profile": "dev", "handle": "dev"}]}),
    )
    .await;

    ws.ok("room.admit", admit("room-a", "a1", "ops", "PARK please", 1))
        .await;
    let again = ws
        .ok("room.admit", admit("room-a", "a1", "ops", "PARK please", 1))
        .await;
    assert_eq!(again["idempotent"], true);
    ws.refused(
        "room.admit",
        admit("room-a", "a1", "ops", "something else", 1),
        "admission_conflict",
    )
    .await;

    // The member parks on an approval; the room reports it with choices narrowed to once/deny.
    let pending = ws
        .event(Duration::from_secs(30), |e| {
            e["type"] == "room.pending_action" && e["payload"]["action"].is_object()
        })
        .await;
    assert_eq!(pending["room_id"], "room-a");
    assert_eq!(
        pending["payload"]["action"]["approval"]["choices"],
        json!(["once", "deny"])
    );
    let action = &pending["payload"]["action"];
    assert!(action["request_id"].is_string(), "{action}");
    assert_eq!(action["request_id"], action["approval"]["prompt_id"]);
    assert_eq!(task_status(&mut ws, "room-a", "a1").await, "running");

    // Meanwhile the other room's tasks settle.
    ws.ok("room.admit", admit("room-b", "b1", "dev", "hello b1", 1))
        .await;
    ws.ok("room.admit", admit("room-b", "b2", "dev", "hello b2", 2))
        .await;
    wait_status(&mut ws, "room-b", "b1", "settled").await;
    wait_status(&mut ws, "room-b", "b2", "settled").await;
    let b = room_tasks(&mut ws, "room-b").await;
    assert!(
        b[0]["result"].to_string().contains("ACK_hello b1"),
        "{}",
        b[0]
    );
    let settled_event = ws
        .event(Duration::from_secs(10), |e| {
            e["type"] == "room.task" && e["room_id"] == "room-b"
        })
        .await;
    assert_eq!(settled_event["payload"]["status"], "settled");
    assert_eq!(
        model
            .texts()
            .iter()
            .filter(|t| t.as_str() == "hello b1")
            .count(),
        1
    );

    // The deadline stops exactly the parked attempt and fails its task.
    wait_status(&mut ws, "room-a", "a1", "failed").await;
    let a1 = room_tasks(&mut ws, "room-a")
        .await
        .into_iter()
        .find(|t| t["identity"]["task_id"] == "a1")
        .expect("a1");
    assert!(a1.to_string().contains("turn_deadline_exceeded"), "{a1}");
    assert!(
        victim.path.join("keep").exists(),
        "the gated command never ran"
    );
    // The approval it waited on is gone with it: the room says so.
    ws.event(Duration::from_secs(10), |e| {
        e["type"] == "room.pending_action"
            && e["room_id"] == "room-a"
            && e["payload"]["action"].is_null()
    })
    .await;

    // The slot is free again: a new task in the same room runs.
    ws.ok("room.admit", admit("room-a", "a2", "ops", "hello a2", 2))
        .await;
    wait_status(&mut ws, "room-a", "a2", "settled").await;
    let status = ws.ok("room.status", json!({})).await;
    assert_eq!(status["running"], true);
    assert!(status["cycles"].as_u64().is_some_and(|c| c > 0));
    // Unknown params are refused, as every other method's are (they were ignored).
    ws.refused(
        "room.status",
        json!({"room_id": "room-a"}),
        "invalid_params",
    )
    .await;
    let room = ws.ok("room.get", json!({"room_id": "room-a"})).await;
    assert_eq!(room["task_counts"]["failed"], 1);
    assert_eq!(room["task_counts"]["settled"], 1);
    // Member turns ran through the session authority, in the member's room session.
    let sessions: Vec<(String, Option<String>)> = {
        use diesel::prelude::*;
        use gatehouse::store::schema::sessions;
        sessions::table
            .select((sessions::source, sessions::title))
            .load(&mut home.db())
            .expect("sessions")
    };
    assert!(
        sessions.contains(&("bot_room".to_string(), Some("Group: room-a".to_string()))),
        "{sessions:?}"
    );
    let ops = control(&home.path, "rooms", json!({})).expect("rooms");
    assert_eq!(ops["rooms"].as_array().map(Vec::len), Some(2), "{ops}");
}

/// A daemon with the `rooms` settings given, a `dev` profile without tools, and a model that
/// answers each user message with `ACK_<message>` (and never answers `HANG`).
fn acking_rooms(rooms: Value) -> (FakeModel, Home, Daemon) {
    let model = FakeModel::ack_or_hang();
    let home = Home::new();
    home.write_config(&config(
        &model.url,
        json!({"profiles": {"dev": {"toolsets": []}}, "rooms": rooms}),
    ));
    let d = Daemon::start(&home);
    (model, home, d)
}

/// A configured `gateway.id` is the authority of the rooms this gateway creates, and the rooms
/// under it are driven here (a start refuses an id a room could not hold: see config's tests).
#[actix_rt::test]
async fn a_configured_gateway_id_drives_its_rooms() {
    let model = FakeModel::ack_or_hang();
    let home = Home::new();
    home.write_config(&config(
        &model.url,
        json!({"gateway": {"id": "gw-configured.1"}, "profiles": {"dev": {"toolsets": []}}}),
    ));
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let room = ws
        .ok(
            "room.create",
            json!({"room_id": "named", "name": "Named", "members": [{"profile": "dev", "handle": "dev"}]}),
        )
        .await;
    assert_eq!(room["authority_gateway_id"], "gw-configured.1", "{room}");
    ws.ok("room.admit", admit("named", "n1", "dev", "hello n1", 1))
        .await;
    wait_status(&mut ws, "named", "n1", "settled").await;
    assert_eq!(model.reached("hello n1"), 1);
}

/// At most `rooms.max_concurrent_rooms` rooms run at once in the gateway's scheduler: with two
/// slots, three rooms whose members hang (three profiles: no member's turn lock is shared) run
/// two tasks, and the third room waits for a slot (`waiting_rooms`, a gauge on /metrics too)
/// until one of the two tasks ends. A room with nothing to do is not counted waiting, though
/// each poll round owes it a look.
#[actix_rt::test]
async fn at_most_max_concurrent_rooms_run_at_once() {
    let model = FakeModel::ack_or_hang();
    let home = Home::new();
    home.write_config(&config(
        &model.url,
        json!({"profiles": {"p1": {"toolsets": []}, "p2": {"toolsets": []}, "p3": {"toolsets": []}},
               "rooms": {"max_concurrent_rooms": 2, "poll_interval_seconds": 0.05}}),
    ));
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let before = passes(&mut ws).await;
    ws.ok(
        "room.create",
        json!({"room_id": "idle", "name": "idle", "members": [{"profile": "p1", "handle": "p1"}]}),
    )
    .await;
    status_when(&mut ws, "the idle room's first pass", |s| {
        s["passes"].as_u64().unwrap_or(0) > before
    })
    .await;
    for i in 1..=3 {
        let (room, profile) = (format!("r{i}"), format!("p{i}"));
        ws.ok(
            "room.create",
            json!({"room_id": room, "name": room, "members": [{"profile": profile, "handle": profile}]}),
        )
        .await;
        ws.ok(
            "room.admit",
            admit(&room, &format!("t{i}"), &profile, "HANG", 1),
        )
        .await;
    }
    let status = status_when(&mut ws, "two rooms running and one waiting", |s| {
        s["current_tasks"].as_array().map_or(0, Vec::len) == 2 && s["waiting_rooms"] == 1
    })
    .await;
    wait_until("two turns at the model", Duration::from_secs(30), || {
        model.reached("HANG") == 2
    })
    .await;
    // Poll rounds go by (each owes every room a look): the idle room is still not waiting.
    let cycles = status["cycles"].as_u64().unwrap_or(0);
    let status = status_when(&mut ws, "ten more cycles", |s| {
        s["cycles"].as_u64().unwrap_or(0) > cycles + 10
    })
    .await;
    assert_eq!(status["waiting_rooms"], 1, "{status}");
    assert_eq!(
        metric(&d.origin(), "gatehouse_rooms_waiting").await,
        1.0,
        "{status}"
    );
    let running: Vec<(String, String)> = status["current_tasks"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|t| {
            let field = |k: &str| t[k].as_str().unwrap_or_default().to_string();
            (field("room_id"), field("task_id"))
        })
        .collect();
    let waiting = (1..=3)
        .map(|i| (format!("r{i}"), format!("t{i}")))
        .find(|task| !running.contains(task))
        .expect("a room not running");
    assert_eq!(task_status(&mut ws, &waiting.0, &waiting.1).await, "queued");
    assert_eq!(model.reached("HANG"), 2, "the third waits for a slot");

    // One of the two ends: its slot goes to the room that waited.
    let (room, task) = &running[0];
    ws.ok(
        "room.cancel",
        json!({"room_id": room, "task_id": task, "cancel_id": "free-a-slot"}),
    )
    .await;
    wait_until(
        "the third turn at the model",
        Duration::from_secs(30),
        || model.reached("HANG") == 3,
    )
    .await;
    wait_status(&mut ws, &waiting.0, &waiting.1, "running").await;
    model.release();
}

/// `room.tasks` with a `status` lists that status's tasks only, in room order; a status that is
/// none is `invalid_params`.
#[actix_rt::test]
async fn room_tasks_filters_by_status() {
    let (model, _home, d) = acking_rooms(json!({}));
    let mut ws = d.ws().await;
    ws.ok(
        "room.create",
        json!({"room_id": "sorted", "name": "S", "members": [{"profile": "dev", "handle": "dev"}]}),
    )
    .await;
    for (seq, (task, prompt)) in [("t1", "HANG"), ("t2", "two"), ("t3", "three")]
        .into_iter()
        .enumerate()
    {
        ws.ok(
            "room.admit",
            admit("sorted", task, "dev", prompt, seq as i64 + 1),
        )
        .await;
    }
    wait_status(&mut ws, "sorted", "t1", "running").await;
    let ids = |page: &Value| -> Vec<String> {
        page["tasks"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|t| {
                t["identity"]["task_id"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string()
            })
            .collect()
    };
    let of = |status: &str| json!({"room_id": "sorted", "status": status});
    assert_eq!(ids(&ws.ok("room.tasks", of("queued")).await), ["t2", "t3"]);
    assert_eq!(ids(&ws.ok("room.tasks", of("running")).await), ["t1"]);
    assert!(ids(&ws.ok("room.tasks", of("settled")).await).is_empty());
    ws.refused("room.tasks", of("bogus"), "invalid_params")
        .await;
    model.release();
}

/// A connection's room requests take effect in the order it sent them: a `room.cancel` sent
/// right behind its task's `room.admit`, without waiting for its answer, cancels that task (it
/// could read the store before the admission committed, be answered `not_found`, and the task
/// ran).
#[actix_rt::test]
async fn a_cancel_pipelined_behind_its_admit_cancels_the_task() {
    let (model, _home, d) = acking_rooms(json!({}));
    let mut ws = d.ws().await;
    ws.ok(
        "room.create",
        json!({"room_id": "piped", "name": "P", "members": [{"profile": "dev", "handle": "dev"}]}),
    )
    .await;
    // A task that runs and hangs: those after it stay queued, and a cancel ends them at once.
    ws.ok("room.admit", admit("piped", "t0", "dev", "HANG", 1))
        .await;
    wait_status(&mut ws, "piped", "t0", "running").await;
    for i in 1..=20 {
        let task = format!("t{i}");
        let frame = |id: String, method: &str, params: Value| {
            json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}).to_string()
        };
        ws.send_raw(frame(
            format!("a{i}"),
            "room.admit",
            admit("piped", &task, "dev", "two", i + 1),
        ))
        .await;
        ws.send_raw(frame(
            format!("c{i}"),
            "room.cancel",
            json!({"room_id": "piped", "task_id": task, "cancel_id": format!("stop-{i}")}),
        ))
        .await;
        for _ in 0..2 {
            let reply = ws.recv_reply().await;
            assert!(reply.get("result").is_some(), "{reply}");
        }
        assert_eq!(task_status(&mut ws, "piped", &task).await, "cancelled");
    }
    model.release();
}

/// A room task settles as soon as its member's turn does: the member's supervisor signals the
/// settlement to the room's session port, and the room supervisor is woken by its report, so
/// neither poll interval (a minute each here) stands between a turn and its task's settlement.
#[actix_rt::test]
async fn a_room_task_settles_with_its_turn_not_on_a_poll() {
    let (_model, _home, d) =
        acking_rooms(json!({"poll_interval_seconds": 60, "active_poll_interval_seconds": 60}));
    let mut ws = d.ws().await;
    ws.ok(
        "room.create",
        json!({"room_id": "quick", "name": "Q", "members": [{"profile": "dev", "handle": "dev"}]}),
    )
    .await;
    for (i, task) in ["q1", "q2", "q3"].into_iter().enumerate() {
        let admitted = std::time::Instant::now();
        ws.ok(
            "room.admit",
            admit("quick", task, "dev", &format!("hello {task}"), i as i64 + 1),
        )
        .await;
        let settled = ws
            .event(Duration::from_secs(20), |e| {
                e["type"] == "room.task" && e["payload"]["identity"]["task_id"] == task
            })
            .await;
        assert_eq!(settled["payload"]["status"], "settled", "{settled}");
        assert!(
            settled["payload"]["result"]
                .to_string()
                .contains(&format!("ACK_hello {task}")),
            "{settled}"
        );
        assert!(
            admitted.elapsed() < Duration::from_secs(20),
            "{task} took {:?}",
            admitted.elapsed()
        );
    }
}

/// Idle rooms get a pass per round (each tick of the poll interval, each wakeup), not one pass
/// after another: before, every pass that ended started the next at once, so a gateway with idle
/// rooms ran their passes back to back for good (about 2,000 scheduler cycles a second with 240
/// rooms). Over a quiet second, with a 30 s poll interval and no wakeup, the scheduler cycles at
/// most a few times. (A window of time is the measurement here: the property is that nothing
/// happens in it.)
#[actix_rt::test]
async fn idle_rooms_are_not_passed_back_to_back() {
    let (_model, _home, d) = acking_rooms(json!({"poll_interval_seconds": 30}));
    let mut ws = d.ws().await;
    for room in ["idle-1", "idle-2", "idle-3"] {
        ws.ok(
            "room.create",
            json!({"room_id": room, "name": room, "members": [{"profile": "dev", "handle": "dev"}]}),
        )
        .await;
        ws.ok("room.admit", admit(room, "t1", "dev", "hello", 1))
            .await;
        ws.event(Duration::from_secs(20), |e| {
            e["type"] == "room.task" && e["room_id"] == room
        })
        .await;
    }
    // Let the passes that the last settlement asked for end.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !ws.ok("room.status", json!({})).await["current_tasks"]
        .as_array()
        .is_some_and(|t| t.is_empty())
    {
        assert!(std::time::Instant::now() < deadline, "rooms stayed busy");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let before = ws.ok("room.status", json!({})).await["cycles"]
        .as_u64()
        .unwrap_or(0);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let after = ws.ok("room.status", json!({})).await["cycles"]
        .as_u64()
        .unwrap_or(0);
    assert!(
        after - before <= 3,
        "the scheduler cycled {} times in a quiet second",
        after - before
    );
}

/// Passes the room runtime has begun, from `room.status`.
async fn passes(ws: &mut Ws) -> u64 {
    ws.ok("room.status", json!({})).await["passes"]
        .as_u64()
        .unwrap_or(0)
}

/// A room's task costs its own room's passes, not every room's: neither its admission nor its
/// end starts a round over the gateway's other rooms (each such round passed every room, so a
/// task's cost grew with the number of rooms: 21 ms of the daemon's CPU per task beside 128
/// rooms, against under 1 ms for the turn itself).
#[actix_rt::test]
async fn a_room_task_does_not_pass_the_other_rooms() {
    let (model, _home, d) = acking_rooms(
        json!({"poll_interval_seconds": 60, "active_poll_interval_seconds": 60, "max_concurrent_rooms": 16}),
    );
    let mut ws = d.ws().await;
    const ROOMS: usize = 8;
    let created = passes(&mut ws).await;
    for i in 0..ROOMS {
        let room = format!("quiet-{i}");
        ws.ok(
            "room.create",
            json!({"room_id": room, "name": room, "members": [{"profile": "dev", "handle": "dev"}]}),
        )
        .await;
    }
    // The rounds the creations started are over (each creation reads the rooms again and
    // passes every room): their passes have stopped coming, with no task under way (nothing
    // else wakes a room here, with its polls a minute apart).
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let mut last = (u64::MAX, std::time::Instant::now());
    loop {
        let status = ws.ok("room.status", json!({})).await;
        let passed = status["passes"].as_u64().unwrap_or(0) - created;
        let idle = status["current_tasks"]
            .as_array()
            .is_some_and(|t| t.is_empty());
        if passed != last.0 || !idle {
            last = (passed, std::time::Instant::now());
        } else if passed >= ROOMS as u64 && last.1.elapsed() >= Duration::from_secs(1) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "rooms never settled: {status}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let before = passes(&mut ws).await;
    const TASKS: i64 = 6;
    for k in 1..=TASKS {
        let task = format!("t{k}");
        ws.ok("room.admit", admit("quiet-0", &task, "dev", "hello", k))
            .await;
        let settled = ws
            .event(Duration::from_secs(20), |e| {
                e["type"] == "room.task" && e["payload"]["identity"]["task_id"] == task.as_str()
            })
            .await;
        assert_eq!(settled["payload"]["status"], "settled", "{settled}");
    }
    let spent = passes(&mut ws).await - before;
    // At most a pass per admission and one more per task (a pass that picks up the next
    // admission itself leaves that admission's pass nothing to do); a round per task would be
    // ROOMS passes each.
    assert!(
        spent <= 2 * TASKS as u64,
        "{TASKS} tasks in one room took {spent} passes beside {ROOMS} rooms"
    );
    // Nor does a cancellation, or a new room: each started a round over every room.
    ws.ok("room.admit", admit("quiet-1", "hung", "dev", "HANG", 1))
        .await;
    wait_until("the hung turn", Duration::from_secs(20), || {
        model.reached("HANG") == 1
    })
    .await;
    ws.ok("room.admit", admit("quiet-1", "behind", "dev", "later", 2))
        .await;
    wait_status(&mut ws, "quiet-1", "behind", "queued").await;
    let before = passes(&mut ws).await;
    ws.ok(
        "room.cancel",
        json!({"room_id": "quiet-1", "task_id": "behind", "cancel_id": "c1"}),
    )
    .await;
    ws.ok(
        "room.create",
        json!({"room_id": "late", "name": "late", "members": [{"profile": "dev", "handle": "dev"}]}),
    )
    .await;
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while passes(&mut ws).await == before {
        assert!(
            std::time::Instant::now() < deadline,
            "the new room was never passed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Whatever else was coming has come.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let spent = passes(&mut ws).await - before;
    assert!(
        spent <= 3,
        "a cancellation and a new room took {spent} passes beside {ROOMS} rooms"
    );
    model.release();
}

/// A model that answers a `PARK…` user message with a `terminal` call of a dangerous command
/// (which would delete `victim/keep`: its member parks on the approval) and anything else with
/// `ACK_<message>`.
fn parking_model(victim: &Home) -> FakeModel {
    std::fs::create_dir_all(victim.path.join("keep")).expect("victim dir");
    let cmd = format!("rm -rf -- {}", victim.path.join("keep").display());
    FakeModel::start(move |body| {
        let last_is_user = body["messages"]
            .as_array()
            .and_then(|m| m.last())
            .is_some_and(|m| m["role"] == "user");
        if last_is_user && last_user(body).starts_with("PARK") {
            Reply::Message(
                tool_call("call_rm", "terminal", json!({"command": cmd})),
                "tool_calls",
            )
        } else {
            Reply::Message(
                json!({"role": "assistant", "content": format!("ACK_{}", last_user(body))}),
                "stop",
            )
        }
    })
}

/// The `PARK now` attempt reached the model once (never run again) and its gated command never
/// ran.
fn assert_parked_once(model: &FakeModel, victim: &Home) {
    assert_eq!(model.reached("PARK now"), 1, "the parked attempt ran once");
    assert!(
        victim.path.join("keep").exists(),
        "the gated command never ran"
    );
}

/// A daemon whose `ops` member runs on [`parking_model`]; the room lease is long (a restart
/// that had to wait it out would show).
fn parking_rooms(victim: &Home, defer_seconds: f64) -> (FakeModel, Home, Daemon) {
    let model = parking_model(victim);
    let home = Home::new();
    home.write_config(&config(
        &model.url,
        json!({
            "profiles": {"ops": {"toolsets": ["terminal"]}},
            "rooms": {"lease_ttl_seconds": 300, "indeterminate_defer_seconds": defer_seconds,
                      "poll_interval_seconds": 0.2, "active_poll_interval_seconds": 0.05},
        }),
    ));
    let d = Daemon::start(&home);
    (model, home, d)
}

/// Room `room` (member `ops`) with its task `task` parked on its approval.
async fn park_in(ws: &mut Ws, room: &str, task: &str) {
    ws.ok(
        "room.create",
        json!({"room_id": room, "name": room, "members": [{"profile": "ops", "handle": "ops"}]}),
    )
    .await;
    ws.ok("room.admit", admit(room, task, "ops", "PARK now", 1))
        .await;
    ws.event(Duration::from_secs(30), |e| {
        e["room_id"] == room
            && e["type"] == "room.pending_action"
            && e["payload"]["action"].is_object()
    })
    .await;
}

/// Room `park` with task `p1` parked on its approval and `p2` queued behind it.
async fn park_a_task(ws: &mut Ws) {
    park_in(ws, "park", "p1").await;
    ws.ok("room.admit", admit("park", "p2", "ops", "hello p2", 2))
        .await;
    assert_eq!(task_status(ws, "park", "p1").await, "running");
    assert_eq!(task_status(ws, "park", "p2").await, "queued");
}

/// The `room.pending_action` of `room` whose action is `task`'s.
async fn pending_for(ws: &mut Ws, room: &str, task: &str) -> Value {
    let e = ws
        .event(Duration::from_secs(30), |e| {
            e["room_id"] == room
                && e["type"] == "room.pending_action"
                && e["payload"]["action"]["task_id"] == task
        })
        .await;
    e["payload"]["action"].clone()
}

/// A member's approval is its room owner's to answer (`room.respond`), for the exact attempt
/// the room reported and for that one command (`once` or `deny`). Before, nobody could answer
/// it (the member's session is the rooms principal's, so `approval.respond` was refused) and
/// the task waited out its turn deadline, its command denied.
#[actix_rt::test]
async fn the_rooms_owner_answers_its_members_approval_for_that_attempt_only() {
    let victim = Home::new();
    let (model, home, d) = parking_rooms(&victim, 300.0);
    let mut ws = d.ws().await;
    ws.ok(
        "room.create",
        json!({"room_id": "ask", "name": "Ask", "members": [{"profile": "ops", "handle": "ops"}]}),
    )
    .await;
    ws.ok("room.admit", admit("ask", "t1", "ops", "PARK now", 1))
        .await;
    let action = pending_for(&mut ws, "ask", "t1").await;
    // A client that was not following the room when it was said finds it in the room.
    let mut late = d.ws().await;
    let room = late.ok("room.get", json!({"room_id": "ask"})).await;
    assert_eq!(
        room["pending_actions"],
        json!([{"member_id": "ops", "action": action}])
    );
    let (request, generation) = (
        action["request_id"].clone(),
        action["execution_generation"].clone(),
    );
    let answer = |task: &str, generation: &Value, choice: &str| {
        json!({"room_id": "ask", "task_id": task, "execution_generation": generation,
               "request_id": request, "choice": choice})
    };
    // Refused, and nothing runs: a choice that would outlive the command, another attempt of
    // the task, a generation that is no integer, a task the room does not have.
    for choice in ["always", "session", "yes"] {
        ws.refused(
            "room.respond",
            answer("t1", &generation, choice),
            "invalid_params",
        )
        .await;
    }
    let next = json!(generation.as_i64().expect("generation") + 1);
    for stale in [next, json!("1")] {
        ws.refused(
            "room.respond",
            answer("t1", &stale, "once"),
            "stale_generation",
        )
        .await;
    }
    ws.refused(
        "room.respond",
        answer("t9", &generation, "once"),
        "not_found",
    )
    .await;
    assert!(victim.path.join("keep").exists(), "nothing was approved");
    assert_eq!(task_status(&mut ws, "ask", "t1").await, "running");

    // The attempt reported, once: its command runs and the task settles on the member's reply.
    let taken = ws
        .ok("room.respond", answer("t1", &generation, "once"))
        .await;
    assert_eq!(taken["status"], "resolved", "{taken}");
    wait_status(&mut ws, "ask", "t1", "settled").await;
    assert!(
        !victim.path.join("keep").exists(),
        "the approved command ran"
    );
    ws.event(Duration::from_secs(10), |e| {
        e["room_id"] == "ask"
            && e["type"] == "room.pending_action"
            && e["payload"]["action"].is_null()
    })
    .await;
    let room = late.ok("room.get", json!({"room_id": "ask"})).await;
    assert_eq!(room["pending_actions"], json!([]), "{room}");
    // Too late once the attempt has ended.
    ws.refused(
        "room.respond",
        answer("t1", &generation, "once"),
        "stale_generation",
    )
    .await;

    // Denied, by the operator (on the control socket, which lists what members wait on): the
    // next task's command never runs, and the task settles all the same.
    std::fs::create_dir_all(victim.path.join("keep")).expect("victim dir");
    ws.ok("room.admit", admit("ask", "t2", "ops", "PARK now", 2))
        .await;
    let action = pending_for(&mut ws, "ask", "t2").await;
    let listed = control(&home.path, "rooms", json!({})).expect("rooms");
    assert_eq!(
        listed["rooms"][0]["pending_actions"],
        json!([{"member_id": "ops", "action": action}]),
        "{listed}"
    );
    let cli = |args: &[&str]| {
        let o = std::process::Command::new(bin())
            .args(args)
            .arg("--home")
            .arg(&home.path)
            .output()
            .expect("gatehouse");
        assert!(o.status.success(), "{args:?}: {o:?}");
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    let (generation, request) = (
        action["execution_generation"].to_string(),
        action["request_id"].as_str().expect("request").to_string(),
    );
    let answer_line = format!("gatehouse room-respond ask t2 {generation} {request} once|deny");
    let listing = cli(&["rooms"]);
    assert!(listing.contains(&answer_line), "{listing}");
    let taken = cli(&["room-respond", "ask", "t2", &generation, &request, "deny"]);
    assert_eq!(taken.trim(), format!("{request} resolved"));
    wait_status(&mut ws, "ask", "t2", "settled").await;
    assert!(
        victim.path.join("keep").exists(),
        "the denied command never ran"
    );
    assert_eq!(model.reached("PARK now"), 2, "each attempt ran once");

    // Each answer is recorded as who gave it, against its prompt: the owner, then the operator.
    let answers: Vec<(Option<String>, Option<String>)> = {
        use diesel::prelude::*;
        use gatehouse::store::schema::prompts;
        prompts::table
            .filter(prompts::kind.eq("approval"))
            .order(prompts::opened_at)
            .select((prompts::resolution, prompts::resolved_by))
            .load(&mut home.db())
            .expect("prompts")
    };
    let owner: String = {
        use diesel::prelude::*;
        use gatehouse::store::rooms_schema::room_owners;
        room_owners::table
            .find("ask")
            .select(room_owners::principal)
            .first(&mut home.db())
            .expect("owner")
    };
    assert_eq!(answers.len(), 2, "{answers:?}");
    assert_eq!(answers[0].1.as_deref(), Some(owner.as_str()), "{answers:?}");
    assert_eq!(answers[1].1.as_deref(), Some("operator"), "{answers:?}");
    assert!(
        answers[0].0.as_deref().is_some_and(|r| r.contains("once")),
        "{answers:?}"
    );
    assert!(
        answers[1].0.as_deref().is_some_and(|r| r.contains("deny")),
        "{answers:?}"
    );
    // A room with no owner of record (made before owners were) is answered by the operator
    // only: every principal may use such a room, but not approve what its members run.
    {
        use diesel::connection::SimpleConnection;
        use diesel::Connection;
        diesel::SqliteConnection::establish(&home.path.join("state.db").to_string_lossy())
            .expect("open state.db")
            .batch_execute("PRAGMA busy_timeout = 10000; DELETE FROM room_owners")
            .expect("owner gone");
    }
    ws.refused(
        "room.respond",
        answer("t1", &json!(1), "once"),
        "permission_denied",
    )
    .await;
}

/// [`parking_rooms`] with a long defer, [`park_a_task`], then a crash: the member's parked turn
/// is left `started`, to be found `unknown` by the next boot.
async fn park_a_task_and_crash(victim: &Home) -> (FakeModel, Home) {
    let (model, home, mut d) = parking_rooms(victim, 300.0);
    let mut ws = d.ws().await;
    park_a_task(&mut ws).await;
    drop(ws);
    d.kill();
    (model, home)
}

fn lease_of(home: &Home, room: &str) -> (Option<f64>, String) {
    use diesel::prelude::*;
    use gatehouse::store::rooms_schema::room_leases;
    room_leases::table
        .find(room)
        .select((room_leases::released_at, room_leases::process_generation))
        .first(&mut home.db())
        .expect("lease row")
}

/// A graceful stop drains the members before it stops the rooms: the parked turn the drain
/// interrupts fails its task (never to run again) while the room still holds its lease, the
/// lease is released, and the next boot runs the queued task at once. Before, the rooms
/// stopped first: the task stayed `running`, its lease could not be released, and the next
/// boot waited out the lease (300 s here) before it could even look at the room.
#[actix_rt::test]
async fn a_graceful_restart_fails_the_interrupted_room_task_and_runs_the_next_at_once() {
    let victim = Home::new();
    let (model, home, mut d) = parking_rooms(&victim, 1.0);
    let mut ws = d.ws().await;
    park_a_task(&mut ws).await;
    drop(ws);
    assert_eq!(d.term(), Some(0));

    let p1 = {
        use diesel::prelude::*;
        use gatehouse::store::rooms_schema::room_tasks;
        room_tasks::table
            .filter(room_tasks::task_id.eq("p1"))
            .select((room_tasks::status, room_tasks::result_json))
            .first::<(String, Option<String>)>(&mut home.db())
            .expect("p1")
    };
    assert_eq!(p1.0, "failed", "{p1:?}");
    assert!(
        p1.1.as_deref().is_some_and(|r| r.contains("interrupted")),
        "{p1:?}"
    );
    assert!(
        lease_of(&home, "park").0.is_some(),
        "the lease was released"
    );

    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let restarted = std::time::Instant::now();
    wait_status(&mut ws, "park", "p2", "settled").await;
    assert!(restarted.elapsed() < Duration::from_secs(30));
    assert_eq!(task_status(&mut ws, "park", "p1").await, "failed");
    assert_parked_once(&model, &victim);
}

/// After a crash the dead process's lease ends at the next boot, which recovers the room at once
/// rather than after the lease's 300 s. Its running task becomes indeterminate and is never
/// resubmitted; since the member's own ledger holds the attempt as `unknown` (its session held
/// until the operator resolves it), the room waits for the operator and says so, and does not
/// defer the task (which would only queue the next one behind the unknown turn), even past
/// its 1 s defer.
#[actix_rt::test]
async fn a_boot_after_a_crash_takes_the_room_over_and_waits_for_the_operator() {
    let victim = Home::new();
    let (model, home, mut d) = parking_rooms(&victim, 1.0);
    let mut ws = d.ws().await;
    park_a_task(&mut ws).await;
    drop(ws);
    let crashed = lease_of(&home, "park").1;
    d.kill();
    assert_eq!(lease_of(&home, "park").0, None);

    let d = Daemon::start(&home);
    let booted = std::time::Instant::now();
    let mut ws = d.ws().await;
    wait_status(&mut ws, "park", "p1", "indeterminate").await;
    assert_ne!(
        lease_of(&home, "park").1,
        crashed,
        "the room was taken over"
    );
    // Passes after the defer deadline leave it waiting for the operator.
    let deadline = booted + Duration::from_secs(30);
    let mut seen = None;
    loop {
        let status = ws.ok("room.status", json!({})).await;
        let passes = status["passes"].as_u64().unwrap_or(0);
        let waits = status["last_error"]
            .as_str()
            .is_some_and(|e| e.contains("resolve-unknown"));
        if booted.elapsed() > Duration::from_millis(1500) && waits {
            match seen {
                Some(before) if passes >= before + 2 => break,
                None => seen = Some(passes),
                _ => {}
            }
        }
        assert!(std::time::Instant::now() < deadline, "{status}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(task_status(&mut ws, "park", "p1").await, "indeterminate");
    assert_eq!(task_status(&mut ws, "park", "p2").await, "queued");
    let status = ws.ok("room.status", json!({})).await;
    assert_eq!(status["blocked_rooms"], json!(["park"]), "{status}");
    assert_parked_once(&model, &victim);
}

/// The daemon prunes a room's ended tasks past the newest it keeps: the oldest go, the kept ones
/// stay idempotent, and the room's counts follow.
#[actix_rt::test]
async fn the_daemon_prunes_a_rooms_oldest_ended_tasks() {
    let (model, _home, d) = acking_rooms(json!({"max_ended_tasks_per_room": 2,
        "prune_interval_seconds": 0.1, "poll_interval_seconds": 0.2}));
    let mut ws = d.ws().await;
    ws.ok(
        "room.create",
        json!({"room_id": "busy", "name": "B", "members": [{"profile": "dev", "handle": "dev"}]}),
    )
    .await;
    // A task is one member's turn: a profile outside the room is refused, and nothing is queued.
    let refused = ws
        .refused(
            "room.admit",
            admit("busy", "t0", "ops", "not a member", 1),
            "invalid_params",
        )
        .await;
    assert!(refused.to_string().contains("not a member"), "{refused}");
    assert!(room_tasks(&mut ws, "busy").await.is_empty());
    for k in 1..=4 {
        let task = format!("t{k}");
        ws.ok(
            "room.admit",
            admit("busy", &task, "dev", &format!("hi {k}"), k),
        )
        .await;
        wait_status(&mut ws, "busy", &task, "settled").await;
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let ids: Vec<String> = room_tasks(&mut ws, "busy")
            .await
            .iter()
            .filter_map(|t| t["identity"]["task_id"].as_str().map(str::to_string))
            .collect();
        if ids == ["t3", "t4"] {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "kept {ids:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let again = ws
        .ok("room.admit", admit("busy", "t4", "dev", "hi 4", 4))
        .await;
    assert_eq!(again["idempotent"], true);
    let room = ws.ok("room.get", json!({"room_id": "busy"})).await;
    assert_eq!(room["task_counts"], json!({"settled": 2}), "{room}");
    // A pruned id admitted again, with the same prompt, is a new task that runs: its attempt is
    // not the pruned task's (the member's ledger would answer that with the old reply).
    let asked = |model: &FakeModel| {
        model
            .requests()
            .iter()
            .filter(|b| last_user(b) == "hi 1")
            .count()
    };
    assert_eq!(asked(&model), 1);
    let readmitted = ws
        .ok("room.admit", admit("busy", "t1", "dev", "hi 1", 5))
        .await;
    assert_eq!(readmitted["idempotent"], false, "{readmitted}");
    wait_status(&mut ws, "busy", "t1", "settled").await;
    assert_eq!(asked(&model), 2);
    let task = room_tasks(&mut ws, "busy")
        .await
        .into_iter()
        .find(|t| t["identity"]["task_id"] == "t1")
        .expect("t1 is kept");
    assert_eq!(task["execution_generation"], 2, "{task}");
    assert!(task["result"].to_string().contains("ACK_hi 1"), "{task}");
}

/// After a crash, the member's parked turn is `unknown` and holds its session until the operator
/// resolves it; the room's task waits for it (indeterminate, never resubmitted) and its status
/// names the command that resolves it. Once the operator has run that command the room reads how
/// the turn ended from the member's ledger: the task fails as interrupted and the room's next
/// task runs, with no retry and no defer wait.
#[actix_rt::test]
async fn after_a_crash_the_operators_resolution_of_the_members_turn_frees_the_room() {
    let victim = Home::new();
    let (model, home) = park_a_task_and_crash(&victim).await;

    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    wait_status(&mut ws, "park", "p1", "indeterminate").await;
    assert_eq!(task_status(&mut ws, "park", "p2").await, "queued");
    // The room names what the operator is to resolve; the operator runs what it says.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let command = loop {
        let status = ws.ok("room.status", json!({})).await;
        let said = status["last_error"].as_str().unwrap_or("");
        if let Some(at) = said.find("gatehouse resolve-unknown ") {
            break said[at + "gatehouse ".len()..].to_string();
        }
        assert!(std::time::Instant::now() < deadline, "{status}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let unknown = home
        .admissions()
        .into_iter()
        .find(|a| a.status == "unknown")
        .expect("the member's turn is unknown");
    assert_eq!(
        command,
        format!(
            "resolve-unknown {} {}",
            unknown.target_session_id, unknown.admission_id
        )
    );
    let args: Vec<&str> = command.split(' ').collect();
    let (ok, out, err) = room_cli(&home, &args);
    assert!(ok, "{out}{err}");
    assert!(out.contains("interrupted"), "{out}");

    wait_status(&mut ws, "park", "p2", "settled").await;
    let p1 = room_tasks(&mut ws, "park")
        .await
        .into_iter()
        .find(|t| t["identity"]["task_id"] == "p1")
        .expect("p1");
    assert_eq!(p1["status"], "failed", "{p1}");
    assert!(p1.to_string().contains("interrupted"), "{p1}");
    assert_parked_once(&model, &victim);
}

/// A disband that a crash cut short right after its fence went up (before it cancelled
/// anything) is carried out by the room's own pass after the restart: the parked attempt's
/// task and the queued one are cancelled, the gated command and the queued prompt never run,
/// and the room is retired, with no second `room.disband`. Before, the room stayed
/// `disbanding` with its queued task queued for good.
#[actix_rt::test]
async fn a_disband_cut_short_by_a_crash_is_carried_out_after_the_restart() {
    let victim = Home::new();
    let (model, home) = park_a_task_and_crash(&victim).await;
    // What `room.disband` commits first, then the crash.
    {
        use diesel::Connection;
        let mut conn =
            diesel::SqliteConnection::establish(&home.path.join("state.db").to_string_lossy())
                .expect("state.db");
        let clock = gatehouse::clock::SystemClock::default();
        let view = gatehouse::store::rooms::begin_disband(&mut conn, "park", &clock)
            .expect("disband fence");
        assert!(view.disband_requested_at.is_some());
    }

    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let room = loop {
        let room = ws.ok("room.get", json!({"room_id": "park"})).await;
        if room["disbanded_at"].is_number() {
            break room;
        }
        assert!(std::time::Instant::now() < deadline, "{room}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(room["task_counts"], json!({"cancelled": 2}), "{room}");
    let again = ws.ok("room.disband", json!({"room_id": "park"})).await;
    assert_eq!(again["state"], "disbanded", "{again}");
    assert_eq!(again["idempotent"], true, "{again}");
    let (ok, out, _) = room_cli(&home, &["rooms", "--json"]);
    assert!(ok);
    let rooms: Value = serde_json::from_str(&out).expect("rooms json");
    assert_eq!(rooms["rooms"], json!([]), "{rooms}");
    assert_parked_once(&model, &victim);
    assert_eq!(model.reached("hello p2"), 0, "cancelled work never ran");
}

/// A room whose member's session a crash left held by an `unknown` turn keeps its next tasks in
/// the room, not in the member's queue: `room.status` blocks the room naming the
/// `resolve-unknown` command that frees the session, nothing of the waiting task reaches the
/// member, a cancel ends it at once, and once the operator has resolved the turn the room's next
/// task runs, once. Before, each task was submitted into the held session, where it waited out
/// its whole turn deadline (30 minutes by default) and failed, and so did every task after it.
#[actix_rt::test]
async fn a_room_keeps_its_tasks_while_its_members_session_is_held_by_an_unknown_turn() {
    let victim = Home::new();
    let (model, home) = park_a_task_and_crash(&victim).await;
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    wait_status(&mut ws, "park", "p1", "indeterminate").await;
    let (ok, out, err) = room_cli(&home, &["room-cancel", "park", "p1"]);
    assert!(ok, "{out}{err}");
    wait_status(&mut ws, "park", "p1", "cancelled").await;
    let (_, command) = unknown_admission(&home);
    status_when(&mut ws, "the room says what holds p2", |s| {
        s["blocked_rooms"] == json!(["park"])
            && s["last_error"]
                .as_str()
                .is_some_and(|e| e.contains("task p2 waits") && e.contains(&command))
    })
    .await;
    let p2 = room_tasks(&mut ws, "park")
        .await
        .into_iter()
        .find(|t| t["identity"]["task_id"] == "p2")
        .expect("p2");
    assert_eq!(p2["status"], "queued", "{p2}");
    assert_eq!(p2["execution_generation"], 0, "{p2}");
    let of = |task: &'static str| {
        move |a: &gatehouse::store::admissions::AdmissionRow| {
            a.request_id.contains(&format!("/{task}/"))
        }
    };
    assert!(
        !home.admissions().iter().any(of("p2")),
        "p2 reached its member"
    );

    ws.ok("room.admit", admit("park", "p3", "ops", "hello p3", 3))
        .await;
    let (ok, out, err) = room_cli(&home, &["room-cancel", "park", "p2"]);
    assert!(ok, "{out}{err}");
    wait_status(&mut ws, "park", "p2", "cancelled").await;
    resolve_the_unknown_member_turn(&home);
    wait_status(&mut ws, "park", "p3", "settled").await;
    assert!(
        !home.admissions().iter().any(of("p2")),
        "p2 reached its member"
    );
    assert_eq!(home.admissions().iter().filter(|a| of("p3")(a)).count(), 1);
    assert_eq!(
        model.reached("hello p2"),
        0,
        "a cancelled task's prompt ran"
    );
    assert_eq!(model.reached("hello p3"), 1);
    assert_parked_once(&model, &victim);
}

/// A member's turns run one at a time across rooms. A room whose task waits for the member while
/// another room's turn holds it (here parked on an approval until its deadline, three lease TTLs)
/// keeps its lease the whole wait, so its own attempt is not fenced when it finally runs: it
/// settles through its observation, never lost to a lapsed lease and recovered as indeterminate.
#[actix_rt::test]
async fn a_task_waiting_for_its_member_behind_another_room_keeps_its_lease() {
    let victim = Home::new();
    let model = parking_model(&victim);
    let (_home, d) = Daemon::with_model(
        &model,
        json!({
            "profiles": {"ops": {"toolsets": ["terminal"]}},
            // A renewal is due at half the TTL and looked for every quarter: 3 s leaves a
            // stall of at least 0.75 s before the lease lapses.
            "rooms": {"turn_timeout_seconds": 9, "lease_ttl_seconds": 3, "poll_interval_seconds": 0.2,
                      "active_poll_interval_seconds": 0.05, "max_concurrent_rooms": 2},
        }),
    );
    let mut ws = d.ws().await;
    park_in(&mut ws, "first", "f1").await;
    ws.ok(
        "room.create",
        json!({"room_id": "second", "name": "second", "members": [{"profile": "ops", "handle": "ops"}]}),
    )
    .await;
    ws.ok("room.admit", admit("second", "s1", "ops", "hello s1", 1))
        .await;
    wait_status(&mut ws, "first", "f1", "failed").await;
    wait_status(&mut ws, "second", "s1", "settled").await;
    let s1 = room_tasks(&mut ws, "second")
        .await
        .into_iter()
        .find(|t| t["identity"]["task_id"] == "s1")
        .expect("s1");
    assert!(s1["indeterminate_at"].is_null(), "{s1}");
    assert!(s1.to_string().contains("ACK_hello s1"), "{s1}");
    let status = ws.ok("room.status", json!({})).await;
    assert_eq!(status["lease_losses"], 0, "{status}");
    assert_eq!(model.reached("hello s1"), 1);
    assert_parked_once(&model, &victim);
}

/// A room whose crashed attempt is probed on every pass waits for its member's turn lock while
/// another room's turn holds it (parked until its deadline, three lease TTLs): its lease is
/// renewed the whole wait, so once the operator has resolved the member's turn, the probe's
/// resolution commits under it. Before, the lease lapsed in the wait and the resolution was
/// fenced as a lease loss.
#[actix_rt::test]
async fn a_probe_waiting_for_its_member_behind_another_room_keeps_its_lease() {
    let victim = Home::new();
    let (model, home) = park_a_task_and_crash(&victim).await;
    home.write_config(&config(
        &model.url,
        json!({
            "profiles": {"ops": {"toolsets": ["terminal"]}},
            // As above: 3 s leaves a stall of at least 0.75 s before the lease lapses.
            "rooms": {"turn_timeout_seconds": 9, "lease_ttl_seconds": 3, "indeterminate_defer_seconds": 300,
                      "poll_interval_seconds": 0.2, "active_poll_interval_seconds": 0.05,
                      "max_concurrent_rooms": 2},
        }),
    ));
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    wait_status(&mut ws, "park", "p1", "indeterminate").await;
    // Another room's turn of the same member holds its turn lock until its deadline.
    ws.ok(
        "room.create",
        json!({"room_id": "other", "name": "other", "members": [{"profile": "ops", "handle": "ops"}]}),
    )
    .await;
    ws.ok("room.admit", admit("other", "o1", "ops", "PARK again", 1))
        .await;
    wait_until("o1 parked", Duration::from_secs(30), || {
        home.admissions()
            .iter()
            .any(|a| a.status == "started" && a.text() == "PARK again")
    })
    .await;
    resolve_the_unknown_member_turn(&home);
    wait_status(&mut ws, "other", "o1", "failed").await;
    wait_status(&mut ws, "park", "p2", "settled").await;
    assert_eq!(task_status(&mut ws, "park", "p1").await, "failed");
    let status = ws.ok("room.status", json!({})).await;
    assert_eq!(status["lease_losses"], 0, "{status}");
    assert!(victim.path.join("keep").exists(), "no gated command ran");
}

/// A connection that closes stops following its rooms (its mailbox, and with it its socket,
/// was kept by every room it had looked at), and a room that does not exist is not followed.
#[actix_rt::test]
async fn a_closed_connection_stops_following_its_rooms() {
    let (_model, home, d) = acking_rooms(json!({}));
    let mut watcher = d.ws().await;
    watcher
        .ok(
            "room.create",
            json!({"room_id": "watched", "name": "watched", "members": [{"profile": "dev", "handle": "dev"}]}),
        )
        .await;
    watcher.ok("room.get", json!({"room_id": "watched"})).await;
    watcher
        .refused(
            "room.tasks",
            json!({"room_id": "no-such-room"}),
            "not_found",
        )
        .await;
    let mut other = d.ws().await;
    let followed = other.ok("room.status", json!({})).await["followed_rooms"].clone();
    assert_eq!(followed, 1, "the made-up room is not followed");
    drop(watcher);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let status = other.ok("room.status", json!({})).await;
        if status["followed_rooms"] == 0 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{status}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop(home);
}

/// A retired (disbanded) room is not followed by a connection that reads it: it says nothing
/// more. Before, `room.get` and `room.tasks` on it made the connection follow it again, after
/// its retirement had let go of its followers, until the connection closed.
#[actix_rt::test]
async fn a_retired_room_is_not_followed_again() {
    let (_model, home, d) = acking_rooms(json!({}));
    let mut ws = d.ws().await;
    ws.ok(
        "room.create",
        json!({"room_id": "gone", "name": "gone", "members": [{"profile": "dev", "handle": "dev"}]}),
    )
    .await;
    ws.ok("room.disband", json!({"room_id": "gone"})).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let room = ws.ok("room.get", json!({"room_id": "gone"})).await;
        if !room["disbanded_at"].is_null() {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{room}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    ws.ok("room.get", json!({"room_id": "gone"})).await;
    ws.ok("room.tasks", json!({"room_id": "gone"})).await;
    let status = ws.ok("room.status", json!({})).await;
    assert_eq!(status["followed_rooms"], 0, "{status}");
    drop(home);
}

/// A room's queue is bounded: past `rooms.max_queued_tasks_per_room` a new task is refused
/// (`session_busy`), while a replay of an admitted one is still answered.
#[actix_rt::test]
async fn a_rooms_queue_is_bounded() {
    let victim = Home::new();
    let model = parking_model(&victim);
    let home = Home::new();
    home.write_config(&config(
        &model.url,
        json!({
            "profiles": {"ops": {"toolsets": ["terminal"]}},
            "rooms": {"max_queued_tasks_per_room": 2, "poll_interval_seconds": 0.2,
                      "active_poll_interval_seconds": 0.05},
        }),
    ));
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    park_in(&mut ws, "full", "p1").await;
    for (task, seq) in [("q1", 2), ("q2", 3)] {
        ws.ok("room.admit", admit("full", task, "ops", "hello", seq))
            .await;
    }
    let refused = ws
        .refused(
            "room.admit",
            admit("full", "q3", "ops", "hello", 4),
            "session_busy",
        )
        .await;
    assert!(
        refused.to_string().contains("max_queued_tasks_per_room"),
        "{refused}"
    );
    let replay = ws
        .ok("room.admit", admit("full", "q1", "ops", "hello", 2))
        .await;
    assert_eq!(replay["idempotent"], true, "{replay}");
    assert_eq!(
        room_tasks(&mut ws, "full").await.len(),
        3,
        "p1 running, q1 and q2 queued"
    );
    // The list comes in pages, in the room's order.
    let first = ws
        .ok("room.tasks", json!({"room_id": "full", "limit": 2}))
        .await;
    let ids = |page: &Value| -> Vec<String> {
        page["tasks"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|t| t["identity"]["task_id"].as_str().map(str::to_string))
            .collect()
    };
    assert_eq!(ids(&first), ["p1", "q1"], "{first}");
    assert_eq!(first["has_more"], true);
    assert_eq!(first["next_after"], "q1");
    let second = ws
        .ok(
            "room.tasks",
            json!({"room_id": "full", "limit": 2, "after": first["next_after"]}),
        )
        .await;
    assert_eq!(ids(&second), ["q2"], "{second}");
    assert_eq!(second["has_more"], false);
    assert_eq!(second["next_after"], Value::Null);
    assert_eq!(second["next_cursor"], Value::Null);
    // The same page from the first page's cursor, which holds even once `q1` is pruned.
    let cursor = first["next_cursor"].as_str().expect("a cursor").to_string();
    let by_cursor = ws
        .ok(
            "room.tasks",
            json!({"room_id": "full", "limit": 2, "cursor": cursor}),
        )
        .await;
    assert_eq!(ids(&by_cursor), ["q2"], "{by_cursor}");
    for bad in [
        json!({"room_id": "full", "limit": 0}),
        json!({"room_id": "full", "limit": 1001}),
        json!({"room_id": "full", "after": "no-such-task"}),
        json!({"room_id": "full", "cursor": "q1"}),
        json!({"room_id": "full", "after": "q1", "cursor": cursor}),
    ] {
        ws.refused("room.tasks", bad, "invalid_params").await;
    }
}

/// The operator resolves the member's `unknown` turn with `gatehouse resolve-unknown`.
fn resolve_the_unknown_member_turn(home: &Home) {
    let unknown = home
        .admissions()
        .into_iter()
        .find(|a| a.status == "unknown")
        .expect("the member's turn is unknown");
    let (ok, out, err) = room_cli(
        home,
        &[
            "resolve-unknown",
            &unknown.target_session_id,
            &unknown.admission_id,
        ],
    );
    assert!(ok, "{out}{err}");
}

/// `gatehouse ARGS --home HOME`: (exit success, stdout, stderr).
fn room_cli(home: &Home, args: &[&str]) -> (bool, String, String) {
    let out = std::process::Command::new(bin())
        .args(args)
        .arg("--home")
        .arg(&home.path)
        .output()
        .expect("gatehouse");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

/// A disband cancels what has not ended (the parked attempt through a stop of that exact
/// attempt, whose gated command never runs; queued work at once), retires the room and refuses
/// new work in it, while another room goes on. The operator commands name their room and task.
#[actix_rt::test]
async fn a_disband_cancels_the_rooms_open_work_and_retires_it() {
    let victim = Home::new();
    let (model, home, d) = parking_rooms(&victim, 1.0);
    let mut ws = d.ws().await;
    park_a_task(&mut ws).await;
    ws.ok("room.admit", admit("park", "p3", "ops", "hello p3", 3))
        .await;
    ws.ok(
        "room.create",
        json!({"room_id": "other", "name": "O", "members": [{"profile": "ops", "handle": "ops"}]}),
    )
    .await;

    // The operator cancels one queued task by name.
    let (ok, out, err) = room_cli(&home, &["room-cancel", "park", "p2"]);
    assert!(ok, "{out}{err}");
    assert_eq!(out.trim(), "park p2 cancelled");
    let (ok, _, err) = room_cli(&home, &["room-cancel", "park"]);
    assert!(!ok && err.contains("usage"), "{err}");

    let disbanding = ws.ok("room.disband", json!({"room_id": "park"})).await;
    assert!(
        matches!(
            disbanding["state"].as_str(),
            Some("disbanding" | "disbanded")
        ),
        "{disbanding}"
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let room = ws.ok("room.get", json!({"room_id": "park"})).await;
        if room["disbanded_at"].is_number() {
            assert_eq!(room["task_counts"], json!({"cancelled": 3}), "{room}");
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{room}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for task in ["p1", "p2", "p3"] {
        assert_eq!(
            task_status(&mut ws, "park", task).await,
            "cancelled",
            "{task}"
        );
        // Every cancellation is a terminal commit its room's followers hear of: the queued
        // ones cancelled at once and the parked one once its member acknowledged the stop.
        let event = ws
            .event(Duration::from_secs(10), |e| {
                e["type"] == "room.task"
                    && e["room_id"] == "park"
                    && e["payload"]["identity"]["task_id"] == task
            })
            .await;
        assert_eq!(event["payload"]["status"], "cancelled", "{event}");
    }
    let again = ws.ok("room.disband", json!({"room_id": "park"})).await;
    assert_eq!(again["state"], "disbanded");
    assert_eq!(again["idempotent"], true);
    ws.refused(
        "room.admit",
        admit("park", "p4", "ops", "hello p4", 4),
        "not_found",
    )
    .await;
    assert_parked_once(&model, &victim);
    assert_eq!(model.reached("hello p3"), 0, "cancelled work never ran");
    // The approval p1 waited on went with it: the room's report of it is withdrawn.
    ws.event(Duration::from_secs(10), |e| {
        e["type"] == "room.pending_action"
            && e["room_id"] == "park"
            && e["payload"]["action"].is_null()
    })
    .await;

    // The other room still works; the operator retires it by name.
    ws.ok("room.admit", admit("other", "o1", "ops", "hello o1", 1))
        .await;
    wait_status(&mut ws, "other", "o1", "settled").await;
    let (ok, out, err) = room_cli(&home, &["room-disband", "other"]);
    assert!(ok, "{out}{err}");
    assert_eq!(out.trim(), "other disbanded");
    let (ok, out, _) = room_cli(&home, &["rooms", "--json"]);
    assert!(ok);
    let rooms: Value = serde_json::from_str(&out).expect("rooms json");
    assert_eq!(rooms["rooms"], json!([]), "{rooms}");
}

/// The API key of the second principal in the tests that need two.
const STRANGER_KEY: &str = "rooms-stranger-key";

/// `room.status` as `ws` sees it, once `pred` holds of it (30 s at most).
async fn status_when(ws: &mut Ws, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let status = ws.ok("room.status", json!({})).await;
        if pred(&status) {
            return status;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{what}: never; last {status}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `room.status` shows a principal its own rooms only: another principal's leased and blocked
/// rooms, and an error that names another principal's room with its member session and
/// admission, are left out; the operator's `gatehouse rooms` still sees every room. Before, a
/// fresh API key that owned no room read every room's lease and block, and the `last_error`
/// naming the other owner's room, session and admission.
#[actix_rt::test]
async fn room_status_shows_a_principal_only_its_own_rooms() {
    let victim = Home::new();
    let (model, home) = park_a_task_and_crash(&victim).await;
    home.write_config(&config(
        &model.url,
        json!({
            "gateway": {"api_keys": [gatehouse::store::rooms::sha256_hex(STRANGER_KEY)]},
            "profiles": {"ops": {"toolsets": ["terminal"]}},
            "rooms": {"lease_ttl_seconds": 300, "indeterminate_defer_seconds": 300,
                      "poll_interval_seconds": 0.2, "active_poll_interval_seconds": 0.05},
        }),
    ));
    let d = Daemon::start(&home);
    let mut owner = d.ws().await;
    let unknown_named = |s: &Value| {
        s["last_error"]
            .as_str()
            .is_some_and(|e| e.contains("resolve-unknown"))
            && s["blocked_rooms"] == json!(["park"])
    };
    let seen = status_when(&mut owner, "the owner sees its blocked room", unknown_named).await;
    assert_eq!(seen["leased_rooms"], json!(["park"]), "{seen}");
    let unknown = home
        .admissions()
        .into_iter()
        .find(|a| a.status == "unknown")
        .expect("the member's turn is unknown");

    let mut stranger = keyed_ws(&d, STRANGER_KEY).await;
    let seen = stranger.ok("room.status", json!({})).await;
    assert_eq!(seen["leased_rooms"], json!([]), "{seen}");
    assert_eq!(seen["blocked_rooms"], json!([]), "{seen}");
    assert_eq!(seen["current_tasks"], json!([]), "{seen}");
    assert!(seen["last_error"].is_null(), "{seen}");
    let text = seen.to_string();
    for secret in ["park", &unknown.target_session_id, &unknown.admission_id] {
        assert!(!text.contains(secret), "{secret} leaked: {text}");
    }

    // Its own room is its own to see (leased while it has work: a task parked on an
    // approval); the owner does not see it.
    stranger
        .ok(
            "room.create",
            json!({"room_id": "theirs", "name": "Theirs", "members": [{"profile": "ops", "handle": "ops"}]}),
        )
        .await;
    stranger
        .ok("room.admit", admit("theirs", "t1", "ops", "PARK theirs", 1))
        .await;
    let seen = status_when(&mut stranger, "the stranger sees its room", |s| {
        s["leased_rooms"] == json!(["theirs"])
    })
    .await;
    assert!(seen["last_error"].is_null(), "{seen}");
    assert_eq!(seen["blocked_rooms"], json!([]), "{seen}");
    let seen = owner.ok("room.status", json!({})).await;
    assert_eq!(seen["leased_rooms"], json!(["park"]), "{seen}");
    assert!(unknown_named(&seen), "{seen}");

    // The operator sees every room.
    let ops = control(&home.path, "rooms", json!({})).expect("rooms");
    assert_eq!(
        ops["status"]["leased_rooms"],
        json!(["park", "theirs"]),
        "{ops}"
    );
    assert!(
        ops["status"]["last_error"]
            .as_str()
            .is_some_and(|e| e.contains(&unknown.admission_id)),
        "{ops}"
    );
}

/// A retry of a task whose member turn a crash left `unknown` is refused (`session_busy`) with
/// the `resolve-unknown` command that frees the member's session, over the WebSocket and from
/// `gatehouse room-retry`; nothing new is sent to the member. Once the operator has run that
/// command the task is resolved as the turn ended (failed, interrupted: never run again), a
/// retry then refused by the task's end or answering it, and the room's next task runs. Before,
/// the retry was accepted: the task went `running` at generation 2 with its new member input
/// queued behind the unknown turn, where it never ran, and failed at its turn deadline.
#[actix_rt::test]
async fn a_retry_behind_an_unknown_member_turn_names_the_resolve_unknown_command() {
    let victim = Home::new();
    let (model, home) = park_a_task_and_crash(&victim).await;
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    wait_status(&mut ws, "park", "p1", "indeterminate").await;
    let (_, command) = unknown_admission(&home);
    let refused = ws
        .refused(
            "room.retry",
            json!({"room_id": "park", "task_id": "p1"}),
            "session_busy",
        )
        .await;
    assert!(refused.to_string().contains(&command), "{refused}");
    let (ok, out, err) = room_cli(&home, &["room-retry", "park", "p1"]);
    assert!(!ok, "{out}");
    assert!(err.contains(&command), "{err}");
    let p1 = room_tasks(&mut ws, "park")
        .await
        .into_iter()
        .find(|t| t["identity"]["task_id"] == "p1")
        .expect("p1");
    assert_eq!(p1["status"], "indeterminate", "{p1}");
    assert_eq!(p1["execution_generation"], 1, "{p1}");
    assert_eq!(home.admissions().len(), 1, "nothing new went to the member");

    resolve_the_unknown_member_turn(&home);
    // The retry and the room's pass race to resolve the task from the member's ledger: the
    // retry answers the resolved task, or is refused because the pass resolved it first.
    let after = ws
        .call("room.retry", json!({"room_id": "park", "task_id": "p1"}))
        .await;
    match after["result"]["status"].as_str() {
        Some(status) => assert_eq!(status, "failed", "{after}"),
        None => assert!(
            after
                .to_string()
                .contains("cannot retry task in state 'failed'"),
            "{after}"
        ),
    }
    wait_status(&mut ws, "park", "p2", "settled").await;
    let p1 = room_tasks(&mut ws, "park")
        .await
        .into_iter()
        .find(|t| t["identity"]["task_id"] == "p1")
        .expect("p1");
    assert_eq!(p1["status"], "failed", "{p1}");
    assert!(p1.to_string().contains("interrupted"), "{p1}");
    assert_parked_once(&model, &victim);
}

/// A member turn that its room's deadline stopped reports `interrupted` once the deadline has
/// failed its task: that late report of a settled attempt is expected and ignored (a debug
/// line), not an error. Before, every room turn deadline logged `WARN task … terminal commit
/// failed: task already has a different terminal settlement` and left that text in
/// `room.status`'s `last_error`.
#[actix_rt::test]
async fn a_deadlines_late_member_report_is_not_an_error() {
    let victim = Home::new();
    let model = parking_model(&victim);
    let home = Home::new();
    home.write_config(&config(
        &model.url,
        json!({
            "profiles": {"ops": {"toolsets": ["terminal"]}},
            // Time for a loaded machine to park the turn (`park_in`) before the deadline.
            "rooms": {"turn_timeout_seconds": 4, "poll_interval_seconds": 0.2,
                      "active_poll_interval_seconds": 0.05},
        }),
    ));
    let d = Daemon::start_with_env(&home, &[("RUST_LOG", "info,gatehouse::rooms=debug")]);
    let mut ws = d.ws().await;
    park_in(&mut ws, "late", "l1").await;
    wait_status(&mut ws, "late", "l1", "failed").await;
    // The member's own report of the stopped turn reaches the room, after the deadline's
    // commit or before it.
    wait_until("the member's report", Duration::from_secs(30), || {
        let log = home.log();
        log.contains("terminal report ignored") || log.contains("terminal commit failed")
    })
    .await;
    let log = home.log();
    assert!(!log.contains("terminal commit failed"), "{log}");
    let l1 = room_tasks(&mut ws, "late")
        .await
        .into_iter()
        .find(|t| t["identity"]["task_id"] == "l1")
        .expect("l1");
    assert!(l1.to_string().contains("turn_deadline_exceeded"), "{l1}");
    let status = ws.ok("room.status", json!({})).await;
    assert!(status["last_error"].is_null(), "{status}");
    assert_parked_once(&model, &victim);
}

/// `room.create` refuses a member whose profile the config lacks (`invalid_params`, naming it,
/// as `session.create` does) and creates nothing; `default` and configured profiles are
/// members. Before, the room was created and every task for that member failed with
/// `invalid_params: no profile "nosuch" in the config`.
#[actix_rt::test]
async fn a_room_with_an_unknown_member_profile_is_refused() {
    let (_model, _home, d) = acking_rooms(json!({}));
    let mut ws = d.ws().await;
    for members in [
        json!([{"profile": "nosuch", "handle": "n"}]),
        json!([{"profile": "dev", "handle": "dev"}, {"profile": "nosuch", "handle": "n"}]),
    ] {
        let refused = ws
            .refused(
                "room.create",
                json!({"room_id": "typo", "name": "T", "members": members}),
                "invalid_params",
            )
            .await;
        assert!(
            refused.to_string().contains(r#"no profile \"nosuch\""#),
            "{refused}"
        );
    }
    ws.refused("room.get", json!({"room_id": "typo"}), "not_found")
        .await;
    ws.ok(
        "room.create",
        json!({"room_id": "typo", "name": "T",
               "members": [{"profile": "dev", "handle": "dev"}, {"profile": "default", "handle": "d"}]}),
    )
    .await;
    ws.ok("room.admit", admit("typo", "t1", "default", "hello", 1))
        .await;
    wait_status(&mut ws, "typo", "t1", "settled").await;
}

/// A disbanded room leaves `room.status`'s leased rooms when it is retired, and its disband is
/// no error: no `last_error` or warning says the room is (being) disbanded. `room.get` says the
/// room's state, as the disband's reply does. Before, the retired room stayed among the leased
/// rooms for good (its lease row long expired), a pass that met the disband fence recorded
/// `room park: hosted room is being disbanded` as the last error (a WARN), and `room.get` had no
/// state.
#[actix_rt::test]
async fn a_disbanded_room_leaves_the_leased_rooms_and_its_disband_is_no_error() {
    let victim = Home::new();
    let (_model, home, d) = parking_rooms(&victim, 1.0);
    let mut ws = d.ws().await;
    park_a_task(&mut ws).await;
    ws.ok("room.admit", admit("park", "p3", "ops", "hello p3", 3))
        .await;
    let room = ws.ok("room.get", json!({"room_id": "park"})).await;
    assert_eq!(room["state"], "active", "{room}");
    let seen = ws.ok("room.status", json!({})).await;
    assert_eq!(seen["leased_rooms"], json!(["park"]), "{seen}");

    let disbanding = ws.ok("room.disband", json!({"room_id": "park"})).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let room = loop {
        let room = ws.ok("room.get", json!({"room_id": "park"})).await;
        if room["disbanded_at"].is_number() {
            break room;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{disbanding} then {room}"
        );
        assert_eq!(room["state"], "disbanding", "{room}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(room["state"], "disbanded", "{room}");
    let seen = status_when(&mut ws, "the retired room leaves the leased rooms", |s| {
        s["leased_rooms"] == json!([])
    })
    .await;
    assert!(
        !seen["last_error"]
            .as_str()
            .is_some_and(|e| e.contains("disband")),
        "{seen}"
    );
    assert_eq!(seen["blocked_rooms"], json!([]), "{seen}");
    let log = home.log();
    assert!(
        !log.lines()
            .any(|l| l.contains("WARN") && l.contains("disbanded")),
        "{log}"
    );
}

/// Rooms waiting for a member's turn lock hold no scheduler slot: with `max_concurrent_rooms`
/// (4) rooms whose member's model hangs, a room of another member still runs its task at once,
/// and the rooms behind the hung turn are taken up as soon as it ends, not at the next poll
/// round. Before, each waiting room took a slot while it waited for the lock (its task already
/// `running`, its deadline not yet started): the healthy room waited for a slot until the hung
/// turn's deadline (38 s at a 40 s deadline), and the hung tasks ended at 1x, 2x, 3x, 4x it.
#[actix_rt::test]
async fn rooms_waiting_for_a_hung_member_leave_the_slots_to_other_members() {
    let model = FakeModel::ack_or_hang();
    let home = Home::new();
    home.write_config(&config(
        &model.url,
        json!({
            "profiles": {"stuck": {"toolsets": []}, "good": {"toolsets": []}},
            // The hung turn's deadline and the poll round are far past every wait below.
            "rooms": {"turn_timeout_seconds": 300, "poll_interval_seconds": 120,
                      "active_poll_interval_seconds": 0.05},
        }),
    ));
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let stuck = ["s1", "s2", "s3", "s4"];
    for room in stuck.iter().chain(&["healthy"]) {
        let profile = if *room == "healthy" { "good" } else { "stuck" };
        ws.ok(
            "room.create",
            json!({"room_id": room, "name": room, "members": [{"profile": profile, "handle": profile}]}),
        )
        .await;
    }
    for (seq, room) in stuck.iter().enumerate() {
        ws.ok(
            "room.admit",
            admit(room, &format!("{room}-t"), "stuck", "HANG", seq as i64 + 1),
        )
        .await;
    }
    // Every stuck room has had its pass (it holds its lease) and one turn hangs in the model.
    status_when(&mut ws, "the stuck rooms leased", |s| {
        stuck.iter().all(|r| {
            s["leased_rooms"]
                .as_array()
                .is_some_and(|l| l.contains(&json!(r)))
        })
    })
    .await;
    wait_until("a hung turn in the model", Duration::from_secs(30), || {
        model.reached("HANG") == 1
    })
    .await;

    let admitted = std::time::Instant::now();
    ws.ok("room.admit", admit("healthy", "h1", "good", "hello", 1))
        .await;
    let deadline = admitted + Duration::from_secs(15);
    status_by(&mut ws, "healthy", "h1", deadline, |s| s == "settled").await;
    // One member turn at a time: the others wait queued, outside the scheduler's slots.
    let mut statuses = Vec::new();
    for room in stuck {
        statuses.push(task_status(&mut ws, room, &format!("{room}-t")).await);
    }
    statuses.sort();
    assert_eq!(statuses, ["queued", "queued", "queued", "running"]);
    let status = ws.ok("room.status", json!({})).await;
    assert_eq!(
        status["current_tasks"].as_array().map(Vec::len),
        Some(1),
        "{status}"
    );

    // The hung turn ends (its model call fails): the rooms behind it run one after the other,
    // each woken by the release of the member, with no poll round (120 s) in between.
    model.release();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    for room in stuck {
        let task = format!("{room}-t");
        status_by(&mut ws, room, &task, deadline, |s| {
            s != "queued" && s != "running"
        })
        .await;
    }
    assert_eq!(model.reached("HANG"), 4, "each stuck task ran once");
}

/// A room with nothing to do takes no lease and renews none: each idle room renewed its lease
/// every half lease TTL for as long as it stayed idle (a commit per room, forever, on a gateway
/// with nothing to do). A task's pass takes a lease; once the room is idle again, the pass that
/// would have renewed it releases it instead, and nothing more is written. The status shows the
/// room let go only once the release is committed (it dropped the lease from memory first).
/// The TTL leaves a loaded machine 1.5 s between the pass that may release and the expiry.
#[actix_rt::test]
async fn an_idle_room_holds_no_lease() {
    use diesel::prelude::*;
    use gatehouse::store::rooms_schema::room_leases;
    let (_model, home, d) =
        acking_rooms(json!({"lease_ttl_seconds": 3, "poll_interval_seconds": 0.05}));
    let mut ws = d.ws().await;
    ws.ok(
        "room.create",
        json!({"room_id": "calm", "name": "Calm", "members": [{"profile": "dev", "handle": "dev"}]}),
    )
    .await;
    // Passes over two points where a held lease would be renewed (half a TTL each).
    let start = passes(&mut ws).await;
    let began = std::time::Instant::now();
    status_when(&mut ws, "passes over two renewal points", |s| {
        began.elapsed() > Duration::from_millis(3200)
            && s["passes"].as_u64().unwrap_or(0) >= start + 20
    })
    .await;
    let status = ws.ok("room.status", json!({})).await;
    assert_eq!(status["leased_rooms"], json!([]), "{status}");
    let leases = |home: &Home| -> Vec<Option<f64>> {
        room_leases::table
            .select(room_leases::released_at)
            .load(&mut home.db())
            .expect("leases")
    };
    assert_eq!(
        leases(&home),
        Vec::<Option<f64>>::new(),
        "an idle room took a lease"
    );

    // Work takes a lease; the room idle again lets it go.
    ws.ok("room.admit", admit("calm", "c1", "dev", "hello", 1))
        .await;
    wait_status(&mut ws, "calm", "c1", "settled").await;
    status_when(&mut ws, "the lease let go", |s| {
        s["leased_rooms"] == json!([])
    })
    .await;
    let released = leases(&home);
    assert_eq!(released.len(), 1, "{released:?}");
    assert!(
        released[0].is_some(),
        "the lease was released: {released:?}"
    );
}

/// A room with a long queue does not keep its scheduler slot from the rooms waiting for one: its
/// pass ran the whole queue (only a wait for the same member made it yield), so with one slot a
/// second room's task waited behind every task of the first.
#[actix_rt::test]
async fn a_long_queue_leaves_the_slot_to_a_waiting_room_between_tasks() {
    let model = FakeModel::start(|body| {
        let text = last_user(body);
        if text.starts_with("long") {
            std::thread::sleep(Duration::from_millis(200));
        }
        Reply::Message(
            json!({"role": "assistant", "content": format!("ACK_{text}")}),
            "stop",
        )
    });
    let home = Home::new();
    home.write_config(&config(
        &model.url,
        json!({
            "profiles": {"a": {"toolsets": []}, "b": {"toolsets": []}},
            "rooms": {"max_concurrent_rooms": 1, "poll_interval_seconds": 120},
        }),
    ));
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    for (room, profile) in [("busy", "a"), ("other", "b")] {
        ws.ok(
            "room.create",
            json!({"room_id": room, "name": room, "members": [{"profile": profile, "handle": profile}]}),
        )
        .await;
    }
    let tasks = 20;
    for i in 0..tasks {
        ws.ok(
            "room.admit",
            admit("busy", &format!("l{i}"), "a", &format!("long{i}"), i + 1),
        )
        .await;
    }
    wait_until("the long queue running", Duration::from_secs(30), || {
        model.reached("long0") == 1
    })
    .await;
    ws.ok("room.admit", admit("other", "o1", "b", "short", 1))
        .await;
    wait_status(&mut ws, "other", "o1", "settled").await;
    let before = model
        .texts()
        .iter()
        .take_while(|t| t.as_str() != "short")
        .count();
    // Yielding between tasks, it runs after one or two of them; the margin (two seconds of
    // the queue's tasks) is for a loaded machine. Without the yield, after all twenty.
    assert!(
        before < 10,
        "the waiting room's task ran after {before} of the long queue's {tasks}"
    );
    wait_status(&mut ws, "busy", &format!("l{}", tasks - 1), "settled").await;
}

/// What a client cannot mean is refused, naming why, and changes nothing: a member id that is
/// not the handle of a member with the task's profile (`invalid_params`; it would be reported
/// as the member waiting on the approvals of a turn another runs), a prompt over
/// `session.max_text_bytes` (`payload_too_large`, as `prompt.submit` refuses it; it was
/// `invalid_params` over the rooms' own bound only), and a cancel under a turn deadline's id
/// (`deadline:…`; `invalid_params`), which used to fail the running task as timed out. A
/// member's pending approval names its request (the prompt's id; it was `null`).
#[actix_rt::test]
async fn room_requests_a_client_cannot_mean_are_refused() {
    let model = FakeModel::ack_or_hang();
    let home = Home::new();
    home.write_config(&config(
        &model.url,
        json!({"profiles": {"dev": {"toolsets": []}}, "session": {"max_text_bytes": 4096}}),
    ));
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    ws.ok(
        "room.create",
        json!({"room_id": "meant", "name": "M",
               "members": [{"profile": "dev", "handle": "bob"}, {"profile": "default", "handle": "ann"}]}),
    )
    .await;
    for (member, seq) in [("ghost", 1), ("ann", 2)] {
        let mut p = admit("meant", &format!("m-{member}"), "dev", "hello", seq);
        p["target_member_id"] = json!(member);
        let refused = ws.refused("room.admit", p, "invalid_params").await;
        assert!(refused.to_string().contains(member), "{refused}");
    }
    ws.refused(
        "room.admit",
        admit("meant", "big", "dev", &"x".repeat(4097), 3),
        "payload_too_large",
    )
    .await;
    let counts = ws.ok("room.get", json!({"room_id": "meant"})).await;
    assert_eq!(counts["task_counts"], json!({}), "{counts}");

    let mut hang = admit("meant", "h1", "dev", "HANG", 4);
    hang["target_member_id"] = json!("bob");
    ws.ok("room.admit", hang).await;
    wait_status(&mut ws, "meant", "h1", "running").await;
    let refused = ws
        .refused(
            "room.cancel",
            json!({"room_id": "meant", "task_id": "h1", "cancel_id": "deadline:1"}),
            "invalid_params",
        )
        .await;
    assert!(refused.to_string().contains("deadline:"), "{refused}");
    assert_eq!(task_status(&mut ws, "meant", "h1").await, "running");
    ws.ok(
        "room.cancel",
        json!({"room_id": "meant", "task_id": "h1", "cancel_id": "user-1"}),
    )
    .await;
    wait_status(&mut ws, "meant", "h1", "cancelled").await;
    let h1 = room_tasks(&mut ws, "meant")
        .await
        .into_iter()
        .find(|t| t["identity"]["task_id"] == "h1")
        .expect("h1");
    assert!(!h1.to_string().contains("turn_deadline_exceeded"), "{h1}");
}

/// Room and task ids are the store's, trimmed, in every method: a task admitted as " t1" is
/// found by a cancel and a read naming it so (they answered `not_found`).
#[actix_rt::test]
async fn padded_room_and_task_ids_name_the_same_task_in_every_method() {
    let model = FakeModel::ack_or_hang();
    let home = Home::new();
    home.write_config(&config(
        &model.url,
        json!({"profiles": {"dev": {"toolsets": []}}}),
    ));
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let room =
        json!({"room_id": "pad", "name": "P", "members": [{"profile": "dev", "handle": "dev"}]});
    ws.ok("room.create", room).await;
    let mut padded = admit("pad", "t1", "dev", "hello", 1);
    padded["room_id"] = json!(" pad ");
    padded["task_id"] = json!(" t1 ");
    let admitted = ws.ok("room.admit", padded).await;
    assert_eq!(admitted["identity"]["task_id"], "t1", "{admitted}");
    let got = ws.ok("room.get", json!({"room_id": " pad "})).await;
    assert_eq!(got["room_id"], "pad", "{got}");
    let cancelled = ws
        .ok(
            "room.cancel",
            json!({"room_id": " pad", "task_id": "t1 ", "cancel_id": "c1"}),
        )
        .await;
    assert_eq!(cancelled["identity"]["task_id"], "t1", "{cancelled}");
}

/// A draining gateway takes no new work (`runtime_draining`): not an input, a session, a room, a
/// task or a retry; reads go on. Before, a task admitted during the drain was committed queued.
#[actix_rt::test]
async fn a_draining_gateway_takes_no_new_room_work() {
    let model = FakeModel::ack_or_hang();
    let home = Home::new();
    home.write_config(&config(
        &model.url,
        json!({"profiles": {"dev": {"toolsets": []}}, "gateway": {"drain_grace_seconds": 30}}),
    ));
    let mut d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let room =
        json!({"room_id": "late", "name": "L", "members": [{"profile": "dev", "handle": "dev"}]});
    ws.ok("room.create", room).await;
    let before = ws
        .ok("room.admit", admit("late", "t0", "dev", "early", 1))
        .await;
    let sid = ws.session("before", &home.path).await;
    // SAFETY: signalling our own child.
    unsafe {
        libc::kill(d.child.id() as i32, libc::SIGTERM);
    }
    wait_until("the gateway drains", Duration::from_secs(10), || {
        control(&home.path, "identify", json!({})).is_ok_and(|i| i["state"] == "stopping")
    })
    .await;
    ws.refused(
        "prompt.submit",
        json!({"session_id": sid, "input_id": "late-input", "text": "hello"}),
        "runtime_draining",
    )
    .await;
    ws.refused(
        "session.create",
        json!({"request_id": "after", "cwd": home.path.to_string_lossy()}),
        "runtime_draining",
    )
    .await;
    assert!(
        home.admissions()
            .iter()
            .all(|a| a.request_id != "late-input"),
        "the late input was not admitted"
    );
    ws.refused(
        "room.admit",
        admit("late", "t1", "dev", "hello", 2),
        "runtime_draining",
    )
    .await;
    // A task admitted before is not new: its replay is answered with it, as at any time (a
    // client whose reply was lost in the stop learns its admission); other text is a conflict.
    let again = ws
        .ok("room.admit", admit("late", "t0", "dev", "early", 1))
        .await;
    assert_eq!(again["idempotent"], true, "{again}");
    assert_eq!(again["identity"]["task_id"], "t0", "{again}");
    assert_eq!(again["identity"], before["identity"], "{again}");
    ws.refused(
        "room.admit",
        admit("late", "t0", "dev", "other", 1),
        "admission_conflict",
    )
    .await;
    ws.refused(
        "room.create",
        json!({"room_id": "later", "name": "L", "members": [{"profile": "dev", "handle": "dev"}]}),
        "runtime_draining",
    )
    .await;
    ws.refused(
        "room.retry",
        json!({"room_id": "late", "task_id": "t1"}),
        "runtime_draining",
    )
    .await;
    let late = ws.ok("room.get", json!({"room_id": "late"})).await;
    let counted: i64 = late["task_counts"]
        .as_object()
        .map_or(0, |c| c.values().filter_map(Value::as_i64).sum());
    assert_eq!(counted, 1, "only t0: {late}");
    drop(ws);
    d.kill();
}
