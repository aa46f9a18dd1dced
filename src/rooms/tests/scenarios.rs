//! The hosted-room runtime acceptance scenarios, one test per seed scenario and named after it.

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::json;

use super::fakes::*;
use crate::clock::{ManualClock, SystemClock};
use crate::rooms::bound::MAX_TERMINAL_TEXT_BYTES;
use crate::rooms::config::RoomsConfig;
use crate::rooms::port::{
    AnswerOutcome, LedgerAttempt, ProfileTurnLocks, SessionPort, TerminalReceipt,
    ROOM_SESSION_SOURCE,
};
use crate::rooms::runtime::{RoomBinding, RoomsError, TransportResolver};
use crate::rooms::testing::TestDb;
use crate::store::leases::release_lease;
use crate::store::room_tasks::{
    begin_task_cancel, recover_room, requeue_indeterminate_task, settle_task, start_task,
    Settlement, SettlementStatus, TaskAttempt, TaskIdentity, TaskStatus, TaskView,
};
use crate::store::rooms::{claim_authority, RoomStoreError};

const STOP: Duration = Duration::from_secs(5);

fn db() -> TestDb {
    TestDb::with_room(ROOM_ID, GATEWAY)
}

fn rpc(auto_complete: bool) -> Arc<FakeSessionRpc> {
    Arc::new(FakeSessionRpc::new(auto_complete))
}

/// Task `task-1` ("Inspect the release candidate.") started at 100 s under an old process's
/// lease of one second, the clock still at 100 s.
fn started_by_an_old_process() -> (TestDb, ManualClock, TaskIdentity, TaskAttempt) {
    let db = db();
    let clock = ManualClock::new(100.0);
    let id = identity("task-1");
    admit_to(
        &db,
        &id,
        PROFILE,
        "Inspect the release candidate.",
        1,
        &clock,
    );
    let attempt = start_old_attempt(&db, &id, 1.0, &clock);
    (db, clock, id, attempt)
}

/// [`started_by_an_old_process`], the clock now at 102 s (the old lease lapsed).
fn left_by_an_old_process() -> (TestDb, ManualClock, TaskIdentity, TaskAttempt) {
    let (db, clock, id, attempt) = started_by_an_old_process();
    clock.set(102.0);
    (db, clock, id, attempt)
}

/// An attempt started under an old process's lease (`ttl` seconds from the clock's now).
fn start_old_attempt(
    db: &TestDb,
    identity: &TaskIdentity,
    ttl: f64,
    clock: &dyn crate::clock::Clock,
) -> TaskAttempt {
    let old = lease_for(db, "old-process", ttl, clock);
    start_task(&mut db.conn(), identity, &old, 0, clock).expect("start")
}

/// `id`'s task failed by its turn deadline (`what` names the case in a failure).
fn assert_failed_at_its_deadline(db: &TestDb, id: &TaskIdentity, what: &str) {
    let failed = task(db, id);
    assert_eq!(failed.status, TaskStatus::Failed, "{what}");
    assert_eq!(
        failed.result.as_ref().map(|r| r["reason_code"].clone()),
        Some(json!("turn_deadline_exceeded")),
        "{what}: {:?}",
        failed.result
    );
}

/// [`left_by_an_old_process`]'s attempt recovered `indeterminate` elsewhere while its member
/// session (the one returned) still runs it.
fn recovered_while_its_member_runs_it() -> (
    TestDb,
    ManualClock,
    TaskIdentity,
    TaskAttempt,
    Arc<FakeSessionRpc>,
    String,
) {
    let (db, clock, id, attempt) = left_by_an_old_process();
    recover_elsewhere(&db, &clock);
    let rpc = rpc(false);
    let session = rpc.add_session(true, Some("task-1"), Vec::new());
    (db, clock, id, attempt, rpc, session)
}

/// Recover an old attempt into `indeterminate` under a separate process, then release.
fn recover_elsewhere(db: &TestDb, clock: &ManualClock) {
    let recovery = lease_for(db, "recovery-process", 30.0, clock);
    recover_room(&mut db.conn(), &recovery, clock).expect("recover");
    release_lease(&mut db.conn(), &recovery, clock).expect("release");
}

#[tokio::test]
async fn test_runtime_uses_unique_process_generation() {
    let db = db();
    let first = Spec::new(&rpc(true)).build(&db);
    let second = Spec::new(&rpc(true)).build(&db);
    assert_ne!(first.process_generation(), second.process_generation());
    assert_eq!(first.process_generation().len(), 32);
    assert!(first
        .process_generation()
        .chars()
        .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()));
}

#[tokio::test]
async fn test_room_concurrency_bound_must_be_a_positive_integer_0() {
    let db = db();
    let mut spec = Spec::new(&rpc(true));
    spec.config.max_concurrent_rooms = 0;
    let error = spec.try_build(&db).err().expect("rejected");
    assert!(
        error.to_string().contains("max_concurrent_rooms"),
        "{error}"
    );
}

#[tokio::test]
async fn test_room_concurrency_bound_must_be_a_positive_integer_true() {
    // A boolean is not a positive integer (the configuration is typed, so it is refused on read).
    let error =
        serde_json::from_value::<RoomsConfig>(json!({ "max_concurrent_rooms": true })).unwrap_err();
    assert!(
        error.to_string().contains("max_concurrent_rooms"),
        "{error}"
    );
}

/// Two rooms with one task each, for the multi-room scenarios.
fn two_rooms(
    db: &TestDb,
    rooms: [&str; 2],
    profiles: [&str; 2],
) -> (Vec<RoomBinding>, Vec<TaskIdentity>) {
    let threads = ["thread-a", "thread-b"];
    let turns = ["turn-a", "turn-b"];
    let tasks = ["task-waiting", "task-healthy"];
    let mut bindings = Vec::new();
    let mut identities = Vec::new();
    for i in 0..2 {
        db.add_room(rooms[i], profiles[i], GATEWAY);
        let identity = TaskIdentity::new(rooms[i], tasks[i], threads[i], turns[i]).unwrap();
        admit_to(
            db,
            &identity,
            profiles[i],
            &format!("Run {}.", rooms[i]),
            1,
            &SystemClock::default(),
        );
        bindings.push(RoomBinding::new(rooms[i], GATEWAY, 1));
        identities.push(identity);
    }
    (bindings, identities)
}

#[tokio::test]
async fn test_waiting_room_does_not_block_an_independent_local_room() {
    let db = TestDb::new();
    let (bindings, ids) = two_rooms(
        &db,
        ["room-waiting", "room-healthy"],
        ["profile-waiting", "profile-healthy"],
    );
    let mut fake = FakeSessionRpc::new(true);
    fake.waiting_profiles.insert("profile-waiting".into());
    let rpc = Arc::new(fake);
    let mut spec = Spec::new(&rpc);
    spec.bindings = bindings;
    spec.config.max_concurrent_rooms = 2;
    let runtime = spec.build(&db);
    runtime.start();
    wait_for("healthy settled", || {
        status(&db, &ids[1]) == TaskStatus::Settled
    })
    .await;
    wait_for("waiting running", || {
        status(&db, &ids[0]) == TaskStatus::Running
    })
    .await;
    assert_eq!(status(&db, &ids[0]), TaskStatus::Running);
    wait_for("one current task", || {
        runtime.status().current_tasks.len() == 1
    })
    .await;
    assert_eq!(runtime.status().current_tasks.len(), 1);
    assert!(runtime.stop(STOP).await);
}

async fn later_room_runs(db: TestDb) {
    let bindings: Vec<RoomBinding> = (1..=3)
        .map(|i| RoomBinding::new(format!("room-{i}"), GATEWAY, 1))
        .collect();
    for binding in &bindings {
        db.add_room(&binding.room_id, PROFILE, GATEWAY);
    }
    let identity =
        TaskIdentity::new("room-3", "task-room-3", "thread-room-3", "turn-room-3").unwrap();
    admit_to(
        &db,
        &identity,
        PROFILE,
        "Run the later room.",
        1,
        &SystemClock::default(),
    );
    let mut spec = Spec::new(&rpc(true));
    spec.bindings = bindings;
    spec.config.max_concurrent_rooms = 2;
    let runtime = spec.build(&db);
    runtime.start();
    wait_for("later room settled", || {
        status(&db, &identity) == TaskStatus::Settled
    })
    .await;
    assert!(runtime.stop(STOP).await);
}

#[tokio::test]
async fn test_rotated_bounded_scheduler_eventually_runs_later_room() {
    later_room_runs(TestDb::new()).await;
}

#[tokio::test]
async fn test_queued_task_routes_profile_and_credentials_without_overrides() {
    let db = db();
    let id = identity("task-1");
    admit(&db, &id, "Use the configured profile credentials.");
    let rpc = rpc(true);
    let runtime = Spec::new(&rpc).build(&db);
    runtime.start();
    wait_for("settled", || status(&db, &id) == TaskStatus::Settled).await;
    assert!(runtime.stop(STOP).await);
    let create = rpc.params("create").into_iter().next().expect("create");
    let submit = rpc.params("submit").into_iter().next().expect("submit");
    assert_eq!(
        create,
        json!({ "profile": PROFILE, "title": "Group: room-1", "source": ROOM_SESSION_SOURCE })
    );
    assert_eq!(submit["profile"], PROFILE);
    assert_eq!(submit["source"], ROOM_SESSION_SOURCE);
    assert_eq!(submit["prompt"], "Use the configured profile credentials.");
    for key in ["model", "provider"] {
        assert!(create.get(key).is_none() && submit.get(key).is_none());
    }
    assert_eq!(task(&db, &id).result.unwrap()["text"], "Finished once.");
}

#[tokio::test]
async fn test_worker_settles_without_any_client_transport() {
    let (db, id) = one_queued_task();
    let runtime = Spec::new(&rpc(true)).build(&db);
    runtime.start();
    wait_for("settled and cycled", || {
        status(&db, &id) == TaskStatus::Settled && runtime.status().cycles >= 1
    })
    .await;
    assert!(runtime.status().running);
    assert!(runtime.status().cycles >= 1);
    assert!(runtime.stop(STOP).await);
}

#[tokio::test]
async fn test_policy_hooks_prepare_and_publish_terminal_idempotently() {
    let (db, id) = one_queued_task();
    let hooks = Arc::new(RecordingHooks::default());
    let mut spec = Spec::new(&rpc(true));
    spec.hooks = Some(hooks.clone());
    let runtime = spec.build(&db);
    runtime.start();
    wait_for("settled", || status(&db, &id) == TaskStatus::Settled).await;
    assert!(runtime.stop(STOP).await);
    assert!(!lock(&hooks.prepared).is_empty());
    let published: Vec<(String, String, TaskStatus)> = lock(&hooks.published)
        .iter()
        .map(|(room, task)| (room.clone(), task.identity.task_id.clone(), task.status))
        .collect();
    assert_eq!(
        published,
        vec![(
            ROOM_ID.to_string(),
            "task-1".to_string(),
            TaskStatus::Settled
        )]
    );
}

#[tokio::test]
async fn test_transport_resolver_selects_member_transport_without_forking_state() {
    let (db, id) = one_queued_task();
    let selected = rpc(true);
    let resolutions: Arc<Mutex<Vec<(RoomBinding, TaskIdentity, String)>>> = Arc::default();
    let (seen, chosen) = (resolutions.clone(), selected.clone());
    let resolver: TransportResolver = Arc::new(move |binding: &RoomBinding, task: &TaskView| {
        lock(&seen).push((
            binding.clone(),
            task.identity.clone(),
            task.payload.prompt.clone(),
        ));
        Ok(chosen.clone() as Arc<dyn SessionPort>)
    });
    let mut spec = Spec::new(&selected);
    spec.rpc = None;
    spec.resolver = Some(resolver);
    let runtime = spec.build(&db);
    runtime.start();
    wait_for("settled", || status(&db, &id) == TaskStatus::Settled).await;
    assert!(runtime.stop(STOP).await);
    let resolutions = lock(&resolutions).clone();
    assert!(!resolutions.is_empty());
    assert!(resolutions.iter().all(|(b, _, _)| *b == binding()));
    assert!(resolutions.iter().all(|(_, i, _)| *i == id));
    assert!(selected.count("submit") >= 1);
}

/// A queued task for a member on another gateway is dispatched to it, for the attempt its start
/// made. Before, the member's transport was chosen for the task as read queued (the previous
/// generation), refused every attempt as another one's, and the task stayed queued for good.
#[tokio::test]
async fn a_peer_members_task_is_dispatched_for_the_attempt_its_start_made() {
    let db = db();
    let id = identity("task-1");
    admit(&db, &id, "Ask the peer.");
    let client = Arc::new(TerminalPeerClient::new("task-1", 1));
    let mut spec = Spec::new(&rpc(false));
    spec.resolver = Some(peer_resolver(client.clone()));
    let runtime = spec.build(&db);
    runtime.run_cycle().await;
    let sent: Vec<(String, i64)> = lock(&client.dispatches)
        .iter()
        .map(|d| (d.task_id.clone(), d.execution_generation))
        .collect();
    assert_eq!(sent, vec![("task-1".to_string(), 1)]);
    assert_ne!(status(&db, &id), TaskStatus::Queued);
}

/// A cancel of the head that lands between the room's read of it and its start is a race the
/// start lost, not the room's error: the pass goes on to the next task. Before, the pass ended
/// there with "task cancel generation changed" as the room's and the runtime's last error.
#[tokio::test]
async fn a_head_cancelled_as_it_starts_is_passed_over_in_silence() {
    let db = db();
    let (first, second) = (identity("task-1"), identity("task-2"));
    admit(&db, &first, "Cancelled as it starts.");
    admit_to(
        &db,
        &second,
        PROFILE,
        "Runs next.",
        2,
        &SystemClock::default(),
    );
    let rpc = rpc(true);
    let (rooms_db, cancelled) = (db.db.clone(), first.clone());
    *lock(&rpc.on_held) = Some(Box::new(move || {
        let mut c = rooms_db.conn().expect("conn");
        crate::store::room_tasks::cancel_task(
            &mut c,
            &cancelled,
            "user-cancel",
            0,
            &SystemClock::default(),
        )
        .expect("cancelled");
    }));
    let runtime = Spec::new(&rpc).build(&db);
    runtime.run_cycle().await;
    assert_eq!(status(&db, &first), TaskStatus::Cancelled);
    assert_eq!(status(&db, &second), TaskStatus::Settled);
    assert_eq!(runtime.status().last_error, None);
}

#[tokio::test]
async fn test_not_admitted_peer_task_stays_queued_with_exponential_capped_retry() {
    let db = db();
    let clock = ManualClock::new(100.0);
    let id = identity("task-1");
    admit_to(
        &db,
        &id,
        PROFILE,
        "Keep this exact prompt queued.",
        1,
        &clock,
    );
    let rpc = rpc(true);
    rpc.not_admitted_failures.store(3, Ordering::SeqCst);
    let mut spec = Spec::new(&rpc).manual(&clock);
    spec.config.lease_ttl_seconds = 30.0;
    spec.config.unavailable_retry_min_seconds = 2.0;
    spec.config.unavailable_retry_max_seconds = 4.0;
    let runtime = spec.build(&db);
    let generations = || lock(&rpc.attempted_generations).clone();
    runtime.run_cycle().await;
    assert_eq!(status(&db, &id), TaskStatus::Queued);
    assert_eq!(generations(), vec![1]);
    runtime.run_cycle().await;
    assert_eq!(generations(), vec![1]);
    clock.advance(2.0);
    runtime.run_cycle().await;
    assert_eq!(generations(), vec![1, 2]);
    clock.advance(3.9);
    runtime.run_cycle().await;
    assert_eq!(generations(), vec![1, 2]);
    clock.advance(0.1);
    runtime.run_cycle().await;
    assert_eq!(generations(), vec![1, 2, 3]);
    clock.advance(4.0);
    runtime.run_cycle().await;
    let view = task(&db, &id);
    assert_eq!(view.status, TaskStatus::Settled);
    assert_eq!(view.execution_generation, 4);
    assert_eq!(view.payload.prompt, "Keep this exact prompt queued.");
    assert_eq!(generations(), vec![1, 2, 3, 4]);
}

#[tokio::test]
async fn test_not_admitted_room_does_not_block_other_rooms() {
    let db = TestDb::new();
    db.add_room("room-1", PROFILE, GATEWAY);
    db.add_room("room-2", PROFILE, GATEWAY);
    let offline_id = identity("offline-task");
    let healthy_id =
        TaskIdentity::new("room-2", "healthy-task", "thread-2", "turn-healthy").unwrap();
    admit(&db, &offline_id, "Inspect the release candidate.");
    admit(&db, &healthy_id, "Inspect the release candidate.");
    let offline = rpc(true);
    offline.not_admitted_failures.store(10, Ordering::SeqCst);
    let healthy = rpc(true);
    let (off, ok) = (offline.clone(), healthy.clone());
    let resolver: TransportResolver = Arc::new(move |binding: &RoomBinding, _task: &TaskView| {
        Ok(if binding.room_id == ROOM_ID {
            off.clone()
        } else {
            ok.clone()
        } as Arc<dyn SessionPort>)
    });
    let mut spec = Spec::new(&offline).manual(&ManualClock::new(100.0));
    spec.rpc = None;
    spec.resolver = Some(resolver);
    spec.bindings = vec![binding(), RoomBinding::new("room-2", GATEWAY, 1)];
    spec.config.lease_ttl_seconds = 30.0;
    let runtime = spec.build(&db);
    runtime.run_cycle().await;
    assert_eq!(status(&db, &offline_id), TaskStatus::Queued);
    assert_eq!(status(&db, &healthy_id), TaskStatus::Settled);
}

#[tokio::test]
async fn test_waiting_room_does_not_block_an_independent_room() {
    let db = TestDb::new();
    let (bindings, ids) = two_rooms(
        &db,
        ["room-waiting", "room-healthy"],
        ["profile-waiting", "profile-healthy"],
    );
    let waiting = rpc(false);
    let healthy = rpc(true);
    let (w, h) = (waiting.clone(), healthy.clone());
    let resolver: TransportResolver = Arc::new(move |binding: &RoomBinding, _task: &TaskView| {
        Ok(if binding.room_id == "room-waiting" {
            w.clone()
        } else {
            h.clone()
        } as Arc<dyn SessionPort>)
    });
    let mut spec = Spec::new(&waiting);
    spec.rpc = None;
    spec.resolver = Some(resolver);
    spec.bindings = bindings;
    spec.config.max_concurrent_rooms = 2;
    let runtime = spec.build(&db);
    runtime.start();
    assert!(waiting.submitted.wait(Duration::from_secs(5)).await);
    wait_for("healthy settled", || {
        status(&db, &ids[1]) == TaskStatus::Settled
    })
    .await;
    assert_eq!(status(&db, &ids[0]), TaskStatus::Running);
    assert!(runtime.stop(STOP).await);
}

#[tokio::test]
async fn test_bounded_scheduler_eventually_runs_later_room() {
    later_room_runs(TestDb::new()).await;
}

#[tokio::test]
async fn test_existing_canonical_session_is_resumed_not_duplicated() {
    let (db, id) = one_queued_task();
    let rpc = rpc(true);
    let session_id = rpc.add_session(false, None, Vec::new());
    let runtime = Spec::new(&rpc).build(&db);
    runtime.start();
    wait_for("settled", || status(&db, &id) == TaskStatus::Settled).await;
    assert!(runtime.stop(STOP).await);
    assert_eq!(rpc.count("create"), 0);
    let resume = rpc.params("resume").into_iter().next().expect("resume");
    assert_eq!(
        resume,
        json!({ "profile": PROFILE, "session_id": session_id, "source": ROOM_SESSION_SOURCE })
    );
}

#[tokio::test]
async fn test_local_crash_recovery_keeps_ambiguous_history_explicit_without_resume() {
    let db = db();
    let clock = ManualClock::new(100.0);
    let id = identity("task-1");
    admit_to(
        &db,
        &id,
        PROFILE,
        "Inspect the release candidate.",
        1,
        &clock,
    );
    start_old_attempt(&db, &id, 0.2, &clock);
    let rpc = rpc(false);
    rpc.add_session(
        false,
        Some("task-1"),
        vec![receipt(
            "task-1",
            1,
            "reply:recovered",
            "Recovered durable answer.",
        )],
    );
    clock.set(101.0);
    let mut spec = Spec::new(&rpc).manual(&clock);
    spec.config.indeterminate_defer_seconds = 5.0;
    let runtime = spec.build(&db);
    runtime.process_room(&binding()).await;
    let recovered = task(&db, &id);
    assert_eq!(recovered.status, TaskStatus::Indeterminate);
    assert_eq!(recovered.result, None);
    assert_eq!(rpc.count("history"), 0);
    assert!(rpc.count("info") > 0);
    assert_eq!(rpc.count("resume"), 0);
    assert_eq!(rpc.count("submit"), 0);
}

#[tokio::test]
async fn test_expired_local_attempt_defers_without_hydrating_or_resubmitting() {
    let db = db();
    let clock = ManualClock::new(100.0);
    let id = identity("task-1");
    admit_to(
        &db,
        &id,
        PROFILE,
        "Inspect the release candidate.",
        1,
        &clock,
    );
    start_old_attempt(&db, &id, 0.2, &clock);
    let rpc = rpc(false);
    rpc.add_session(
        false,
        Some("task-1"),
        vec![receipt(
            "task-1",
            1,
            "reply:expired-recovered",
            "Recovered.",
        )],
    );
    clock.set(101.0);
    let mut spec = Spec::new(&rpc).manual(&clock);
    spec.config.indeterminate_defer_seconds = 0.5;
    let runtime = spec.build(&db);
    runtime.process_room(&binding()).await;
    clock.set(102.0);
    runtime.process_room(&binding()).await;
    let recovered = task(&db, &id);
    assert_eq!(recovered.status, TaskStatus::Deferred);
    assert_eq!(
        recovered.result,
        Some(json!({ "reason": "member_unavailable", "retryable": true }))
    );
    assert_eq!(rpc.count("history"), 0);
    assert_eq!(rpc.count("resume"), 0);
    assert_eq!(rpc.count("submit"), 0);
}

/// The stored result of a running task whose member replies `reply`, settled as soon as the
/// reply comes (not at the deadline).
async fn stored_result_of(reply: &str) -> serde_json::Value {
    let (db, id) = one_queued_task();
    let rpc = rpc(false);
    let mut spec = Spec::new(&rpc);
    spec.config.turn_timeout_seconds = 30.0;
    let runtime = spec.build(&db);
    runtime.start();
    assert!(rpc.submitted.wait(Duration::from_secs(5)).await);
    rpc.complete("task-1", reply, "settled");
    wait_for("settled", || status(&db, &id) == TaskStatus::Settled).await;
    assert!(runtime.stop(STOP).await);
    task(&db, &id).result.expect("result")
}

#[tokio::test]
async fn test_oversized_terminal_reply_is_bounded_without_waiting_for_deadline() {
    let result = stored_result_of(&"é".repeat(MAX_TERMINAL_TEXT_BYTES + 100)).await;
    assert_eq!(result["truncated"], true);
    let text = result["text"].as_str().expect("text");
    assert!(text.len() <= MAX_TERMINAL_TEXT_BYTES);
    assert!(text.ends_with("share the full result as a file.]"));
}

/// A reply of control characters (six bytes each stored in JSON) over the bound is cut to 64
/// KiB of text and recorded: the store holds it (at first it did not, and the task stayed
/// running, then stopping, for good).
#[tokio::test]
async fn a_reply_of_control_characters_is_bounded_and_stored() {
    let result = stored_result_of(&"\u{1}".repeat(MAX_TERMINAL_TEXT_BYTES + 1)).await;
    assert_eq!(result["truncated"], true);
    let text = result["text"].as_str().expect("text");
    assert!(text.len() <= MAX_TERMINAL_TEXT_BYTES, "{}", text.len());
}

/// A reply under the bound is stored whole, however its characters are escaped: one of 40,000
/// newlines used to be cut to about 32,700 (it was bounded as it takes escaped).
#[tokio::test]
async fn a_reply_under_the_bound_is_stored_whole() {
    let reply = "\n".repeat(40_000);
    let result = stored_result_of(&reply).await;
    assert_eq!(result.get("truncated"), None, "{}", result["text"]);
    assert_eq!(result["text"], reply.as_str());
}

#[tokio::test]
async fn test_peer_recovery_probe_is_bounded_by_attempt_and_stale_age() {
    let (db, clock, id, _attempt) = left_by_an_old_process();
    // the peer member: every probe starts with one resolve, recorded with the clock's time
    let mut peer = FakeSessionRpc::new(false);
    peer.peer = true;
    peer.probe_clock = Some(Arc::new(clock.clone()));
    let peer = Arc::new(peer);
    let member = peer.clone();
    let mut spec = Spec::new(&rpc(true)).manual(&clock);
    spec.config.lease_ttl_seconds = 30.0;
    spec.config.indeterminate_defer_seconds = 5.0;
    spec.resolver = Some(Arc::new(move |_b: &RoomBinding, _t: &TaskView| {
        Ok(member.clone() as Arc<dyn SessionPort>)
    }));
    let runtime = spec.build(&db);
    let recovery = lease_for(&db, runtime.process_generation(), 30.0, &clock);
    recover_room(&mut db.conn(), &recovery, &clock).unwrap();
    let probes = || lock(&peer.resolve_times).clone();
    assert!(runtime
        .reconcile_indeterminate(&binding(), &recovery)
        .await
        .unwrap());
    assert!(runtime
        .reconcile_indeterminate(&binding(), &recovery)
        .await
        .unwrap());
    assert_eq!(probes(), vec![102.0]);
    clock.set(108.0);
    assert!(!runtime
        .reconcile_indeterminate(&binding(), &recovery)
        .await
        .unwrap());
    assert_eq!(probes(), vec![102.0, 108.0]);
    assert_eq!(status(&db, &id), TaskStatus::Deferred);
}

/// A peer member's attempt left indeterminate is resolved by the room's probe as the member
/// ended it, and the room says so once (`room.task`, on every terminal commit): settled from its
/// exact receipt, cancelled when the member cancelled it. Before, both were committed in
/// silence.
#[tokio::test]
async fn a_peer_attempt_the_rooms_probe_resolves_is_published_once() {
    for (remote, want) in [
        (None, TaskStatus::Settled),
        (Some("cancelled"), TaskStatus::Cancelled),
    ] {
        let (db, clock, id, attempt) = left_by_an_old_process();
        let mut peer = FakeSessionRpc::new(false);
        peer.peer = true;
        let receipt = crate::rooms::port::HistoryMessage {
            role: "assistant".into(),
            task_id: Some("task-1".into()),
            execution_generation: Some(attempt.execution_generation),
            status: Some("settled".into()),
            message_id: Some("m-1".into()),
            content: "Finished once.".into(),
        };
        let history = if remote.is_none() {
            vec![receipt]
        } else {
            Vec::new()
        };
        peer.add_session(false, Some("task-1"), history);
        *lock(&peer.info_status) = remote.map(str::to_string);
        let peer = Arc::new(peer);
        let member = peer.clone();
        let hooks = Arc::new(RecordingHooks::default());
        let mut spec = Spec::new(&rpc(true)).manual(&clock);
        spec.hooks = Some(hooks.clone());
        spec.resolver = Some(Arc::new(move |_b: &RoomBinding, _t: &TaskView| {
            Ok(member.clone() as Arc<dyn SessionPort>)
        }));
        let runtime = spec.build(&db);
        let recovery = lease_for(&db, runtime.process_generation(), 30.0, &clock);
        recover_room(&mut db.conn(), &recovery, &clock).unwrap();
        assert!(!runtime
            .reconcile_indeterminate(&binding(), &recovery)
            .await
            .unwrap());
        assert_eq!(status(&db, &id), want);
        assert_eq!(hooks.published_statuses(), vec![want], "{remote:?}");
        // Nothing is left to resolve, nor to say again.
        assert!(!runtime
            .reconcile_indeterminate(&binding(), &recovery)
            .await
            .unwrap());
        assert_eq!(hooks.published_statuses(), vec![want], "{remote:?}");
    }
}

/// An attempt of this process left indeterminate while its member still runs it (its lease
/// lapsed mid-turn: a clock jump, a long stall) is held to its turn deadline: waited for within
/// it, then stopped and failed as timed out. Before, the room waited for it without end.
#[tokio::test]
async fn an_active_indeterminate_attempt_is_held_to_its_deadline() {
    let db = db();
    let clock = ManualClock::new(100.0);
    let id = identity("task-1");
    admit_to(&db, &id, PROFILE, "Hang.", 1, &clock);
    let attempt = start_old_attempt(&db, &id, 1.0, &clock);
    clock.set(102.0);
    let rpc = rpc(false);
    rpc.add_session(true, Some("task-1"), Vec::new());
    let hooks = Arc::new(RecordingHooks::default());
    let mut spec = Spec::new(&rpc).manual(&clock);
    spec.config.turn_timeout_seconds = 60.0;
    spec.hooks = Some(hooks.clone());
    let runtime = spec.build(&db);
    let recovery = lease_for(&db, runtime.process_generation(), 300.0, &clock);
    recover_room(&mut db.conn(), &recovery, &clock).unwrap();
    runtime.adopt_lease(recovery.clone());
    assert_eq!(status(&db, &id), TaskStatus::Indeterminate);
    // Within its deadline, the room waits for it.
    assert!(runtime
        .reconcile_indeterminate(&binding(), &recovery)
        .await
        .unwrap());
    assert_eq!(rpc.count("interrupt"), 0);
    clock.set(161.0);
    // The member's turn reports its end (as interrupted) before the stop has completed: a
    // report of an attempt made under a lease the room has taken again since, which the
    // deadline's stop resolves, and no error of the room's.
    let reported = {
        let (rt, attempt) = (runtime.clone(), attempt.clone());
        move || {
            let receipt = TerminalReceipt {
                status: "interrupted".into(),
                ..Default::default()
            };
            rt.on_terminal(&binding(), &attempt, receipt);
        }
    };
    *lock(&rpc.on_interrupt) = Some(Box::new(reported));
    assert!(!runtime
        .reconcile_indeterminate(&binding(), &recovery)
        .await
        .unwrap());
    assert_eq!(rpc.count("interrupt"), 1);
    assert_eq!(runtime.status().last_error, None);
    assert_eq!(
        runtime.lease(ROOM_ID).map(|l| l.lease_generation),
        Some(recovery.lease_generation),
        "the room keeps its lease"
    );
    assert_failed_at_its_deadline(&db, &id, "");
    assert_eq!(hooks.published_statuses(), vec![TaskStatus::Failed]);
    // Resolved, what was probed of it is forgotten at the next pass (it was kept for good).
    assert_eq!(runtime.state().inspected.len(), 1);
    assert!(!runtime
        .reconcile_indeterminate(&binding(), &recovery)
        .await
        .unwrap());
    assert!(runtime.state().inspected.is_empty());
}

/// An attempt of a dead process that its member still runs is held to its turn deadline, local
/// member or peer: past it the room takes its lease, recovers the attempt and stops it. Before,
/// every pass ended at the probe that found it running, before the lease and recovery, for as
/// long as the member's turn ran (an approval nobody answers: for good).
#[tokio::test]
async fn an_abandoned_attempt_still_running_is_held_to_its_deadline() {
    for peer in [false, true] {
        let (db, clock, id, _attempt) = left_by_an_old_process();
        let mut member = FakeSessionRpc::new(false);
        member.peer = peer;
        let member = Arc::new(member);
        member.add_session(true, Some("task-1"), Vec::new());
        let mut spec = Spec::new(&member).manual(&clock);
        spec.config.turn_timeout_seconds = 60.0;
        spec.config.lease_ttl_seconds = 30.0;
        let runtime = spec.build(&db);
        // Within its deadline the room waits for it, and takes no lease.
        runtime.process_room(&binding()).await;
        assert_eq!(status(&db, &id), TaskStatus::Running, "peer {peer}");
        assert!(runtime.lease(ROOM_ID).is_none(), "peer {peer}");
        clock.set(161.0);
        runtime.process_room(&binding()).await;
        assert_failed_at_its_deadline(&db, &id, &format!("peer {peer}"));
        assert_eq!(member.count("interrupt"), 1, "peer {peer}");
        assert_eq!(member.count("submit"), 0, "peer {peer}");
    }
}

/// An abandoned attempt's turn deadline counts from when its member began it, when its ledger
/// says so: one that waited in the member's queue (behind an `unknown` turn, until the
/// operator resolved it) is not stopped the moment it begins.
#[tokio::test]
async fn an_abandoned_attempt_is_timed_from_when_its_member_began_it() {
    let (db, clock, id, _attempt) = left_by_an_old_process();
    let rpc = rpc(false);
    rpc.add_session(true, Some("task-1"), Vec::new());
    lock(&rpc.ledger).insert(
        "task-1".into(),
        LedgerAttempt::Live {
            session_id: "member-1".into(),
            admission_id: "adm-1".into(),
            started: Some(150.0),
        },
    );
    let mut spec = Spec::new(&rpc).manual(&clock);
    spec.config.turn_timeout_seconds = 60.0;
    spec.config.lease_ttl_seconds = 30.0;
    let runtime = spec.build(&db);
    // 61 s after the attempt's start, 11 s after the member began it: it runs on.
    clock.set(161.0);
    runtime.process_room(&binding()).await;
    runtime.process_room(&binding()).await;
    assert!(
        matches!(
            status(&db, &id),
            TaskStatus::Running | TaskStatus::Indeterminate
        ),
        "{:?}",
        status(&db, &id)
    );
    assert_eq!(rpc.count("interrupt"), 0);
    // 60 s after the member began it: stopped.
    clock.set(211.0);
    runtime.process_room(&binding()).await;
    assert_failed_at_its_deadline(&db, &id, "");
    assert_eq!(rpc.count("interrupt"), 1);
    assert_eq!(rpc.count("submit"), 0);
}

/// An attempt whose task can no longer be read while it is watched ends the pass at its
/// deadline, giving back the member's turn lock and the pass's scheduler slot; once the task
/// reads again, a later pass stops the attempt. Before, the watch retried the read without end
/// and never looked at the deadline, holding the lock (and so every room of the member) while
/// the read failed.
#[tokio::test]
async fn an_attempt_whose_task_cannot_be_read_ends_its_pass_at_the_deadline() {
    use diesel::RunQueryDsl;
    let (db, id) = one_queued_task();
    let rpc = rpc(false);
    // Each look at the member spoils the task's digest (mended below), so every read of it
    // fails, and moves the clock past the attempt's deadline: the deadline passes after the
    // first look whatever the machine's speed (with the real clock, a first look later than
    // the deadline stopped the attempt in the first pass).
    let clock = manual_clock_at_now();
    let store = db.db.clone();
    let later = clock.clone();
    let spoil = move || {
        diesel::sql_query(
            "UPDATE room_tasks SET payload_digest = '!' || ltrim(payload_digest, '!') \
             WHERE task_id = 'task-1'",
        )
        .execute(&mut store.conn().expect("conn"))
        .expect("spoil");
        later.advance(1.0);
    };
    *lock(&rpc.on_info) = Some(Box::new(spoil));
    let locks = RecordingTurnLocks::default();
    let mut spec = Spec::new(&rpc).manual(&clock);
    spec.locks = locks.clone();
    spec.config.active_poll_interval_seconds = 0.01;
    spec.config.turn_timeout_seconds = 0.05;
    let runtime = spec.build(&db);
    tokio::time::timeout(STOP, runtime.process_room(&binding()))
        .await
        .expect("the pass ends at the attempt's deadline");
    assert!(
        !locks.held_for(PROFILE),
        "the member's turn lock is given back"
    );
    assert_eq!(rpc.count("interrupt"), 0);
    // Readable again: the next pass stops the attempt.
    *lock(&rpc.on_info) = None;
    diesel::sql_query(
        "UPDATE room_tasks SET payload_digest = ltrim(payload_digest, '!') WHERE task_id = 'task-1'",
    )
    .execute(&mut db.conn())
    .expect("mend");
    tokio::time::timeout(STOP, runtime.process_room(&binding()))
        .await
        .expect("the pass ends");
    let failed = task(&db, &id);
    assert_eq!(failed.status, TaskStatus::Failed);
    assert_eq!(failed.cancel_id.as_deref(), Some("deadline:1"));
    assert_eq!(rpc.count("interrupt"), 1);
    assert_eq!(rpc.count("submit"), 1);
}

#[tokio::test]
async fn test_turn_deadline_stops_exact_attempt_and_publishes_durable_failure() {
    let (db, id) = one_queued_task();
    let rpc = rpc(false);
    let hooks = Arc::new(RecordingHooks::default());
    let mut spec = Spec::new(&rpc);
    spec.config.active_poll_interval_seconds = 0.01;
    spec.config.turn_timeout_seconds = 0.05;
    spec.hooks = Some(hooks.clone());
    let runtime = spec.build(&db);
    runtime.start();
    wait_for("failed", || status(&db, &id) == TaskStatus::Failed).await;
    assert!(runtime.stop(STOP).await);
    let failed = task(&db, &id);
    assert_eq!(
        failed.result,
        Some(json!({
            "error": "This Group Chat turn exceeded its configured time limit and was stopped.",
            "reason_code": "turn_deadline_exceeded",
            "timeout_seconds": 0.05,
        }))
    );
    assert_eq!(failed.cancel_id.as_deref(), Some("deadline:1"));
    assert!(rpc.count("interrupt") > 0);
    assert_eq!(hooks.published_statuses(), vec![TaskStatus::Failed]);
}

/// Two rooms of one member under one scheduler permit: `room-stuck`'s turns never end,
/// `room-healthy`'s complete; turns have `timeout` seconds, and the member answers an interrupt
/// with `interrupt` (when given).
fn stuck_and_healthy_room(
    db: &TestDb,
    timeout: f64,
    interrupt: Option<&str>,
) -> (Spec, Vec<TaskIdentity>, Arc<FakeSessionRpc>) {
    let (bindings, ids) = two_rooms(db, ["room-stuck", "room-healthy"], [PROFILE, PROFILE]);
    let mut fake = FakeSessionRpc::new(false);
    fake.complete_rooms.insert("room-healthy".into());
    *lock(&fake.interrupt_status) = interrupt.map(str::to_string);
    let rpc = Arc::new(fake);
    let mut spec = Spec::new(&rpc);
    spec.bindings = bindings;
    spec.config.poll_interval_seconds = 0.02;
    spec.config.active_poll_interval_seconds = 0.01;
    spec.config.turn_timeout_seconds = timeout;
    spec.config.max_concurrent_rooms = 1;
    (spec, ids, rpc)
}

#[tokio::test]
async fn test_deadline_releases_worker_capacity_for_later_room() {
    let db = TestDb::new();
    let (spec, ids, _) = stuck_and_healthy_room(&db, 0.05, None);
    let runtime = spec.build(&db);
    runtime.start();
    wait_for("stuck failed", || {
        status(&db, &ids[0]) == TaskStatus::Failed
    })
    .await;
    wait_for("healthy settled", || {
        status(&db, &ids[1]) == TaskStatus::Settled
    })
    .await;
    assert!(runtime.stop(STOP).await);
    assert_eq!(
        task(&db, &ids[0]).result.unwrap()["reason_code"],
        "turn_deadline_exceeded"
    );
    assert_eq!(status(&db, &ids[1]), TaskStatus::Settled);
}

/// A user's stop that the member never acknowledges does not hold the room's place past the
/// turn's deadline: the next room runs, and the stop stays recorded for a later pass.
#[tokio::test]
async fn an_unacknowledged_user_stop_releases_capacity_at_the_deadline() {
    let db = TestDb::new();
    let (spec, ids, rpc) = stuck_and_healthy_room(&db, 0.5, Some("stopping"));
    let clock = manual_clock_at_now();
    let runtime = spec.manual(&clock).build(&db);
    runtime.start();
    // Submitted, not only running: a stop that comes while the member's session is opened
    // ends the attempt before anything is submitted (`cancelled`, not `stopping`).
    wait_for("stuck submitted", || {
        rpc.params("submit")
            .iter()
            .any(|p| p["task_id"] == ids[0].task_id.as_str())
    })
    .await;
    let stopping = runtime.cancel(&ids[0], "user-stop").await.unwrap();
    assert_eq!(stopping.status, TaskStatus::Stopping);
    // The turn's deadline passes only now, after the user's stop (with the real clock, a
    // cancel later than the deadline found the deadline's stop begun).
    clock.advance(1.0);
    wait_for("healthy settled", || {
        status(&db, &ids[1]) == TaskStatus::Settled
    })
    .await;
    assert!(runtime.stop(STOP).await);
    let stuck = task(&db, &ids[0]);
    assert_eq!(stuck.status, TaskStatus::Stopping, "never acknowledged");
    assert_eq!(stuck.cancel_id.as_deref(), Some("user-stop"));
}

/// A task left running under this process's own lease with no member session (its opening
/// failed, and so did the write of that failure) is queued again and runs: nothing of it was
/// admitted. It stayed running, its lease renewed on every pass, until someone cancelled it.
#[tokio::test]
async fn an_own_attempt_whose_session_was_never_opened_is_queued_again() {
    let (db, id) = one_queued_task();
    let rpc = rpc(false);
    let (runtime, attempt) = running_under_runtime(&db, &rpc);
    assert_eq!(status(&db, &id), TaskStatus::Running);
    runtime.start();
    wait_for("submitted", || rpc.count("submit") == 1).await;
    assert!(runtime.stop(STOP).await);
    let after = task(&db, &id);
    assert!(
        after.execution_generation > attempt.execution_generation,
        "a new attempt ran: {after:?}"
    );
}

/// A stop the member never acknowledges is asked again at each look, but the lease is renewed
/// only when due: every look renewed it, a commit on the shared writer four times a second for
/// as long as the stop was pending.
#[tokio::test]
async fn a_pending_stop_renews_the_lease_only_when_due() {
    let (db, id) = one_queued_task();
    let rpc = rpc(false);
    *lock(&rpc.interrupt_status) = Some("stopping".into());
    let mut spec = Spec::new(&rpc);
    spec.config.lease_ttl_seconds = 30.0;
    spec.config.active_poll_interval_seconds = 0.01;
    spec.config.turn_timeout_seconds = 300.0;
    let runtime = spec.build(&db);
    runtime.start();
    wait_for("submitted", || rpc.count("submit") == 1).await;
    let stopping = runtime.cancel(&id, "user-stop").await.unwrap();
    assert_eq!(stopping.status, TaskStatus::Stopping);
    let before = runtime.status().lease_renewals;
    // Twenty looks at the member's turn after the stop (each reads its history).
    let looked = || rpc.count("history");
    let asked = looked();
    wait_for("looked again", || looked() >= asked + 20).await;
    let renewed = runtime.status().lease_renewals - before;
    assert!(runtime.stop(STOP).await);
    assert!(
        renewed <= 1,
        "{renewed} renewals while the stop was pending"
    );
}

#[tokio::test]
async fn test_retry_ignores_late_receipt_from_prior_execution_generation() {
    let db = db();
    let clock = ManualClock::new(100.0);
    let id = identity("task-1");
    admit_to(
        &db,
        &id,
        PROFILE,
        "Inspect the release candidate.",
        1,
        &clock,
    );
    let old_attempt = start_old_attempt(&db, &id, 0.2, &clock);
    clock.set(101.0);
    let current = lease_for(&db, "manual-recovery", 30.0, &clock);
    recover_room(&mut db.conn(), &current, &clock).unwrap();
    requeue_indeterminate_task(
        &mut db.conn(),
        &id,
        &current,
        old_attempt.execution_generation,
        old_attempt.cancel_generation,
        &clock,
    )
    .unwrap();
    release_lease(&mut db.conn(), &current, &clock).unwrap();
    let rpc = rpc(false);
    rpc.add_session(
        false,
        Some("task-1"),
        vec![receipt(
            "task-1",
            1,
            "reply:late-old-attempt",
            "Late old result.",
        )],
    );
    let runtime = Spec::new(&rpc).manual(&clock).build(&db);
    runtime.start();
    assert!(rpc.submitted.wait(Duration::from_secs(5)).await);
    // let the observer read the stale receipt more than once
    wait_for("history observed twice", || rpc.count("history") >= 2).await;
    assert!(runtime.stop(STOP).await);
    let view = task(&db, &id);
    assert_eq!(view.status, TaskStatus::Running);
    assert_eq!(
        view.execution_generation,
        old_attempt.execution_generation + 1
    );
}

#[tokio::test]
async fn test_active_recovered_turn_is_never_resubmitted() {
    let (db, id) = one_queued_task();
    start_old_attempt(&db, &id, 10.0, &SystemClock::default());
    let rpc = rpc(false);
    rpc.add_session(true, Some("task-1"), Vec::new());
    let runtime = Spec::new(&rpc).build(&db);
    runtime.start();
    // several full scheduler cycles instead of a sleep
    wait_for("several cycles", || {
        runtime.status().cycles >= 5 && rpc.count("info") >= 3
    })
    .await;
    assert!(runtime.stop(STOP).await);
    assert_eq!(status(&db, &id), TaskStatus::Running);
    assert_eq!(rpc.count("submit"), 0);
}

#[tokio::test]
async fn test_retry_cannot_advance_generation_while_original_attempt_is_active() {
    let (db, clock, id, attempt, rpc, session) = recovered_while_its_member_runs_it();
    lock(&rpc.states)
        .get_mut(&session)
        .unwrap()
        .execution_generation = Some(attempt.execution_generation);
    let runtime = Spec::new(&rpc).manual(&clock).build(&db);
    let error = runtime.retry_indeterminate(&id).await.unwrap_err();
    assert!(
        matches!(error, RoomsError::Store(RoomStoreError::InvalidTransition(ref m)) if m.contains("still active")),
        "{error}"
    );
    let view = task(&db, &id);
    assert_eq!(view.status, TaskStatus::Indeterminate);
    assert_eq!(view.execution_generation, attempt.execution_generation);
    assert_eq!(rpc.count("submit"), 0);
}

#[tokio::test]
async fn test_retry_uses_runtime_session_id_returned_by_resume() {
    let (db, clock, id, _attempt) = left_by_an_old_process();
    recover_elsewhere(&db, &clock);
    let rpc = rpc(false);
    let stored = rpc.add_session(false, Some("task-1"), Vec::new());
    rpc.rename_state(&stored, "runtime-session");
    *lock(&rpc.resume_to) = Some("runtime-session".into());
    let runtime = Spec::new(&rpc).manual(&clock).build(&db);
    let retried = runtime.retry_indeterminate(&id).await.unwrap();
    assert_eq!(retried.status, TaskStatus::Queued);
    let history: Vec<_> = rpc
        .params("history")
        .iter()
        .map(|p| p["session_id"].clone())
        .collect();
    let info: Vec<_> = rpc
        .params("info")
        .iter()
        .map(|p| p["session_id"].clone())
        .collect();
    assert_eq!(history, vec![json!("runtime-session")]);
    assert_eq!(info, vec![json!("runtime-session")]);
}

#[tokio::test]
async fn test_retry_reconciles_terminal_remote_cancellation_without_new_generation() {
    let (db, clock, id, attempt) = left_by_an_old_process();
    recover_elsewhere(&db, &clock);
    let rpc = rpc(false);
    rpc.add_session(false, Some("task-1"), Vec::new());
    *lock(&rpc.info_status) = Some("cancelled".into());
    let runtime = Spec::new(&rpc).manual(&clock).build(&db);
    // The room's pass had found the attempt still active and blocked the room.
    runtime.state().blocked.insert(ROOM_ID.into());
    let cancelled = runtime.retry_indeterminate(&id).await.unwrap();
    assert_eq!(cancelled.status, TaskStatus::Cancelled);
    assert_eq!(cancelled.execution_generation, attempt.execution_generation);
    assert_eq!(rpc.count("submit"), 0);
    // Resolved, the room is no longer blocked (its queue went on only at the next poll).
    assert!(
        !runtime
            .status()
            .blocked_rooms
            .contains(&ROOM_ID.to_string()),
        "{:?}",
        runtime.status().blocked_rooms
    );
}

#[tokio::test]
async fn test_ambiguous_recovery_remains_indeterminate() {
    let db = db();
    let clock = ManualClock::new(100.0);
    let id = identity("task-1");
    admit_to(
        &db,
        &id,
        PROFILE,
        "Inspect the release candidate.",
        1,
        &clock,
    );
    start_old_attempt(&db, &id, 0.2, &clock);
    let rpc = rpc(false);
    rpc.add_session(false, Some("task-1"), Vec::new());
    clock.set(101.0);
    let runtime = Spec::new(&rpc).manual(&clock).build(&db);
    runtime.start();
    wait_for("indeterminate", || {
        status(&db, &id) == TaskStatus::Indeterminate
    })
    .await;
    assert!(runtime.stop(STOP).await);
    assert_eq!(rpc.count("submit"), 0);
}

/// An attempt recovered `indeterminate` (its lease lapsed mid-turn) whose member still runs it
/// and waits on an approval: the room reports the approval for that attempt, and an answer to
/// it reaches the member (it was refused as stale while the room advertised it); an answer
/// naming another attempt still reaches nothing.
#[tokio::test]
async fn an_indeterminate_attempts_reported_approval_can_be_answered() {
    let (db, clock, id, attempt, rpc, session) = recovered_while_its_member_runs_it();
    lock(&rpc.states)
        .get_mut(&session)
        .expect("session")
        .pending_approval = Some(json!({
        "request_id": "approval-1",
        "command": "rm -rf build",
        "choices": ["once", "deny"],
    }));
    let hooks = Arc::new(RecordingHooks::default());
    let mut spec = Spec::new(&rpc).manual(&clock);
    spec.hooks = Some(hooks.clone());
    let runtime = spec.build(&db);
    runtime.process_room(&binding()).await;
    assert_eq!(status(&db, &id), TaskStatus::Indeterminate);
    let action = lock(&hooks.actions)
        .iter()
        .find_map(|(_, _, a)| a.clone())
        .expect("the approval reported");
    let generation = attempt.execution_generation;
    assert_eq!(action["execution_generation"], generation);
    let answer = |generation| runtime.answer_approval(&id, generation, "approval-1", "once", "op");
    let other = answer(generation + 1).await.expect("answered");
    assert!(matches!(other, AnswerOutcome::Stale(_)), "{other:?}");
    assert_eq!(rpc.count("answer"), 0);
    let taken = answer(generation).await.expect("answered");
    assert!(matches!(taken, AnswerOutcome::Resolved), "{taken:?}");
    assert_eq!(rpc.params("answer")[0]["execution_generation"], generation);
}

#[tokio::test]
async fn test_offline_member_defers_then_healthy_task_runs_and_retry_is_fenced() {
    let db = db();
    let clock = ManualClock::new(100.0);
    let first = identity("task-offline");
    let second =
        TaskIdentity::new(ROOM_ID, "task-healthy", "thread-1", "turn-task-healthy").unwrap();
    admit_to(&db, &first, PROFILE, "Try the offline member.", 1, &clock);
    let old_attempt = start_old_attempt(&db, &first, 1.0, &clock);
    admit_to(
        &db,
        &second,
        PROFILE,
        "Continue with the healthy member.",
        2,
        &clock,
    );
    clock.set(102.0);
    let rpc = rpc(true);
    let hooks = Arc::new(RecordingHooks::default());
    let mut spec = Spec::new(&rpc).manual(&clock);
    spec.config.lease_ttl_seconds = 30.0;
    spec.config.indeterminate_defer_seconds = 5.0;
    spec.hooks = Some(hooks.clone());
    let runtime = spec.build(&db);
    runtime.process_room(&binding()).await;
    assert_eq!(status(&db, &first), TaskStatus::Indeterminate);
    assert_eq!(status(&db, &second), TaskStatus::Queued);
    clock.set(108.0);
    runtime.process_room(&binding()).await;
    assert_eq!(status(&db, &first), TaskStatus::Deferred);
    assert_eq!(status(&db, &second), TaskStatus::Settled);
    assert_eq!(
        hooks.published_statuses(),
        vec![TaskStatus::Deferred, TaskStatus::Settled]
    );
    assert!(!runtime
        .status()
        .blocked_rooms
        .contains(&ROOM_ID.to_string()));
    let requeued = runtime.retry_indeterminate(&first).await.unwrap();
    assert_eq!(requeued.status, TaskStatus::Queued);
    let lease = runtime.lease(ROOM_ID).expect("lease");
    let retry_attempt = start_task(&mut db.conn(), &first, &lease, 0, &clock).unwrap();
    assert_eq!(
        retry_attempt.execution_generation,
        old_attempt.execution_generation + 1
    );
    let late_attempt = TaskAttempt {
        identity: first.clone(),
        lease: lease.clone(),
        execution_generation: old_attempt.execution_generation,
        cancel_generation: old_attempt.cancel_generation,
    };
    let settlement = |id: &str, text: &str| Settlement {
        settlement_id: id.into(),
        status: SettlementStatus::Settled,
        result: json!({ "text": text }),
    };
    assert!(matches!(
        settle_task(
            &mut db.conn(),
            &late_attempt,
            &settlement("late-old-result", "too late"),
            &clock
        ),
        Err(RoomStoreError::StaleTask(_))
    ));
    settle_task(
        &mut db.conn(),
        &retry_attempt,
        &settlement("retry-result", "retry accepted"),
        &clock,
    )
    .unwrap();
    assert_eq!(task(&db, &first).result.unwrap()["text"], "retry accepted");
}

#[tokio::test]
async fn test_post_submit_observation_failure_preserves_recoverable_outcome() {
    let (db, id) = one_queued_task();
    let rpc = rpc(false);
    rpc.history_failures.store(1, Ordering::SeqCst);
    let runtime = Spec::new(&rpc).build(&db);
    runtime.start();
    assert!(rpc.submitted.wait(Duration::from_secs(5)).await);
    wait_for("observation failure reported", || {
        runtime
            .status()
            .last_error
            .unwrap_or_default()
            .contains("observation failed after submit")
    })
    .await;
    assert_eq!(status(&db, &id), TaskStatus::Running);
    rpc.complete("task-1", "Recovered after a transient read.", "settled");
    runtime.wakeup();
    wait_for("settled", || status(&db, &id) == TaskStatus::Settled).await;
    assert!(runtime.stop(STOP).await);
    assert_eq!(
        task(&db, &id).result.unwrap()["text"],
        "Recovered after a transient read."
    );
    assert_eq!(rpc.count("submit"), 1);
}

#[tokio::test]
async fn test_cancellation_is_persisted_before_interrupt_and_fences_late_result() {
    let (db, id) = one_queued_task();
    let rpc = rpc(false);
    let runtime = Spec::new(&rpc).build(&db);
    let observed: Arc<Mutex<Vec<TaskStatus>>> = Arc::default();
    let (seen, handle, task_id) = (observed.clone(), db.db.clone(), id.clone());
    *lock(&rpc.on_interrupt) = Some(Box::new(move || {
        let view = handle
            .run_sync(|c| crate::store::room_tasks::get_task(c, &task_id))
            .unwrap();
        lock(&seen).push(view.status);
    }));
    runtime.start();
    assert!(rpc.submitted.wait(Duration::from_secs(5)).await);
    let cancelled = runtime.cancel(&id, "cancel-user").await.unwrap();
    rpc.complete("task-1", "Too late.", "settled");
    runtime.wakeup();
    assert!(runtime.stop(STOP).await);
    assert_eq!(cancelled.status, TaskStatus::Cancelled);
    assert_eq!(*lock(&observed), vec![TaskStatus::Stopping]);
    assert_eq!(status(&db, &id), TaskStatus::Cancelled);
}

#[tokio::test]
async fn test_transient_remote_stop_failure_stays_pending_and_retries() {
    let (db, id) = one_queued_task();
    let rpc = rpc(false);
    let retry_allowed = Arc::new(Event::default());
    rpc.interrupt_failures.store(1, Ordering::SeqCst);
    *lock(&rpc.interrupt_gate) = Some(retry_allowed.clone());
    let runtime = Spec::new(&rpc).build(&db);
    runtime.start();
    assert!(rpc.submitted.wait(Duration::from_secs(5)).await);
    let stopping = runtime.cancel(&id, "cancel-retry").await.unwrap();
    assert_eq!(stopping.status, TaskStatus::Stopping);
    assert_eq!(status(&db, &id), TaskStatus::Stopping);
    retry_allowed.set();
    runtime.wakeup();
    wait_for("cancelled", || status(&db, &id) == TaskStatus::Cancelled).await;
    assert!(rpc.interrupt_attempts.load(Ordering::SeqCst) >= 2);
    assert!(runtime.stop(STOP).await);
    assert_eq!(status(&db, &id), TaskStatus::Cancelled);
}

/// A runtime holding a live lease whose task is running in an active session.
fn running_under_runtime(
    db: &TestDb,
    rpc: &Arc<FakeSessionRpc>,
) -> (crate::rooms::RoomRuntime, TaskAttempt) {
    let runtime = Spec::new(rpc).build(db);
    let clock = SystemClock::default();
    let lease = lease_for(db, runtime.process_generation(), 1.0, &clock);
    runtime.adopt_lease(lease.clone());
    let attempt = start_task(&mut db.conn(), &identity("task-1"), &lease, 0, &clock).unwrap();
    (runtime, attempt)
}

#[tokio::test]
async fn test_provisional_stopping_response_does_not_acknowledge_cancellation() {
    let (db, id) = one_queued_task();
    let rpc = rpc(false);
    let (runtime, attempt) = running_under_runtime(&db, &rpc);
    let session = rpc.add_session(true, Some("task-1"), Vec::new());
    lock(&rpc.states)
        .get_mut(&session)
        .unwrap()
        .execution_generation = Some(attempt.execution_generation);
    *lock(&rpc.interrupt_status) = Some("stopping".into());
    let stopping = runtime.cancel(&id, "cancel-peer").await.unwrap();
    assert_eq!(stopping.status, TaskStatus::Stopping);
    assert_eq!(status(&db, &id), TaskStatus::Stopping);
    *lock(&rpc.interrupt_status) = Some("cancelled".into());
    let cancelled = runtime.cancel(&id, "cancel-peer").await.unwrap();
    assert_eq!(cancelled.status, TaskStatus::Cancelled);
}

fn peer_runtime(
    db: &TestDb,
    client: &Arc<TerminalPeerClient>,
) -> (
    crate::rooms::RoomRuntime,
    crate::store::leases::Lease,
    TaskAttempt,
) {
    let mut spec = Spec::new(&rpc(false));
    spec.resolver = Some(peer_resolver(client.clone()));
    let runtime = spec.build(db);
    let clock = SystemClock::default();
    let lease = lease_for(db, runtime.process_generation(), 1.0, &clock);
    runtime.adopt_lease(lease.clone());
    let attempt = start_task(&mut db.conn(), &identity("task-1"), &lease, 0, &clock).unwrap();
    (runtime, lease, attempt)
}

#[tokio::test]
async fn test_peer_terminal_status_acknowledges_durable_stop_on_retry() {
    let (db, id) = one_queued_task();
    let client = Arc::new(TerminalPeerClient::new("task-1", 1));
    let (runtime, lease, attempt) = peer_runtime(&db, &client);
    assert_eq!(attempt.execution_generation, client.execution_generation);
    let stopping = begin_task_cancel(
        &mut db.conn(),
        &id,
        "cancel-peer-terminal",
        0,
        &SystemClock::default(),
    )
    .unwrap();
    assert_eq!(stopping.status, TaskStatus::Stopping);
    runtime
        .retry_stopping_tasks(&binding(), &lease)
        .await
        .unwrap();
    assert_eq!(status(&db, &id), TaskStatus::Cancelled);
    assert_eq!(client.history_calls.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn test_peer_terminal_status_must_match_exact_task_attempt() {
    let (db, id) = one_queued_task();
    let client = Arc::new(TerminalPeerClient::new("task-1", 1));
    *lock(&client.status_task_id) = "different-task".into();
    let (runtime, _lease, attempt) = peer_runtime(&db, &client);
    let stopping = begin_task_cancel(
        &mut db.conn(),
        &id,
        "cancel-mismatch",
        0,
        &SystemClock::default(),
    )
    .unwrap();
    assert!(!runtime.peer_stop_acknowledged(&binding(), &stopping).await);
    *lock(&client.status_task_id) = "task-1".into();
    *lock(&client.status_generation) = attempt.execution_generation + 1;
    assert!(!runtime.peer_stop_acknowledged(&binding(), &stopping).await);
    assert_eq!(status(&db, &id), TaskStatus::Stopping);
}

#[tokio::test]
async fn test_completion_wins_a_race_with_unacknowledged_stop() {
    let (db, id) = one_queued_task();
    let rpc = rpc(false);
    let runtime = Spec::new(&rpc).build(&db);
    runtime.start();
    assert!(rpc.submitted.wait(Duration::from_secs(5)).await);
    let (member, handle, task_id) = (Arc::downgrade(&rpc), db.db.clone(), id.clone());
    *lock(&rpc.on_info) = Some(Box::new(move || {
        let view = handle
            .run_sync(|c| crate::store::room_tasks::get_task(c, &task_id))
            .unwrap();
        if view.status == TaskStatus::Stopping {
            if let Some(member) = member.upgrade() {
                member.complete("task-1", "Already done.", "settled");
            }
        }
    }));
    let result = runtime.cancel(&id, "cancel-raced").await.unwrap();
    assert_eq!(result.status, TaskStatus::Settled);
    assert_eq!(result.result.unwrap()["text"], "Already done.");
    assert!(runtime.stop(STOP).await);
}

#[tokio::test]
async fn test_restart_harvests_completion_before_retrying_durable_stop() {
    let (db, clock, id, attempt) = started_by_an_old_process();
    let stopping = begin_task_cancel(
        &mut db.conn(),
        &id,
        "cancel-before-restart",
        attempt.cancel_generation,
        &clock,
    )
    .unwrap();
    let rpc = rpc(false);
    rpc.add_session(
        false,
        Some("task-1"),
        vec![receipt(
            "task-1",
            attempt.execution_generation,
            "reply-after-stop",
            "Finished before Stop reached the session.",
        )],
    );
    clock.set(102.0);
    let mut spec = Spec::new(&rpc).manual(&clock);
    spec.process_generation = Some("new-process".into());
    let runtime = spec.build(&db);
    runtime.start();
    wait_for("settled", || status(&db, &id) == TaskStatus::Settled).await;
    assert!(runtime.stop(STOP).await);
    assert_eq!(stopping.status, TaskStatus::Stopping);
    assert_eq!(
        task(&db, &id).result.unwrap()["text"],
        "Finished before Stop reached the session."
    );
    assert_eq!(rpc.count("interrupt"), 0);
}

#[tokio::test]
async fn test_restart_acknowledges_inactive_local_stop_without_memory_marker() {
    let (db, clock, id, attempt) = started_by_an_old_process();
    begin_task_cancel(
        &mut db.conn(),
        &id,
        "cancel-before-restart",
        attempt.cancel_generation,
        &clock,
    )
    .unwrap();
    let rpc = rpc(false);
    clock.set(102.0);
    let mut spec = Spec::new(&rpc).manual(&clock);
    spec.process_generation = Some("new-process".into());
    let runtime = spec.build(&db);
    let cancelled = runtime.cancel(&id, "cancel-before-restart").await.unwrap();
    assert_eq!(cancelled.status, TaskStatus::Cancelled);
    assert_eq!(rpc.count("interrupt"), 0);
}

#[tokio::test]
async fn test_stop_resumes_persisted_session_before_reading_runtime_history() {
    let (db, id) = one_queued_task();
    let rpc = rpc(false);
    let (runtime, attempt) = running_under_runtime(&db, &rpc);
    let stored = rpc.add_session(false, Some("task-1"), Vec::new());
    rpc.rename_state(&stored, "runtime-session");
    *lock(&rpc.resume_to) = Some("runtime-session".into());
    begin_task_cancel(
        &mut db.conn(),
        &id,
        "cancel-remapped",
        attempt.cancel_generation,
        &SystemClock::default(),
    )
    .unwrap();
    let cancelled = runtime.cancel(&id, "cancel-remapped").await.unwrap();
    assert_eq!(cancelled.status, TaskStatus::Cancelled);
    let methods = rpc.methods();
    let resume = methods.iter().position(|m| m == "resume").expect("resume");
    let history = methods
        .iter()
        .position(|m| m == "history")
        .expect("history");
    assert!(resume < history);
    assert_eq!(rpc.params("history")[0]["session_id"], "runtime-session");
}

#[tokio::test]
async fn test_pending_local_approval_is_reported_with_safe_choices() {
    let (db, _id) = one_queued_task();
    let rpc = rpc(false);
    let hooks = Arc::new(RecordingHooks::default());
    let mut spec = Spec::new(&rpc);
    spec.hooks = Some(hooks.clone());
    let runtime = spec.build(&db);
    runtime.start();
    assert!(rpc.submitted.wait(Duration::from_secs(5)).await);
    let session = rpc.first_session();
    lock(&rpc.states)
        .get_mut(&session)
        .unwrap()
        .pending_approval = Some(json!({
        "request_id": "approval-1",
        "command": "pytest -q tests/focused",
        "choices": ["once", "session", "always", "deny"],
    }));
    runtime.wakeup();
    wait_for("approval reported", || {
        lock(&hooks.actions).iter().any(|(_, _, a)| a.is_some())
    })
    .await;
    let (_room, member, action) = lock(&hooks.actions)
        .iter()
        .find(|(_, _, a)| a.is_some())
        .cloned()
        .expect("action");
    let action = action.expect("action");
    assert_eq!(member, PROFILE);
    assert_eq!(action["request_id"], "approval-1");
    assert_eq!(action["approval"]["choices"], json!(["once", "deny"]));
    assert!(runtime.stop(STOP).await);
}

#[tokio::test]
async fn a_stopped_tasks_pending_approval_is_reported_gone() {
    // The stop is acknowledged at once and nothing observes the member again: the approval the
    // stopped attempt asked for must still be reported gone (the room showed it forever).
    let (db, id) = one_queued_task();
    let rpc = rpc(false);
    let hooks = Arc::new(RecordingHooks::default());
    let mut spec = Spec::new(&rpc);
    spec.hooks = Some(hooks.clone());
    let runtime = spec.build(&db);
    runtime.start();
    assert!(rpc.submitted.wait(Duration::from_secs(5)).await);
    let session = rpc.first_session();
    lock(&rpc.states)
        .get_mut(&session)
        .unwrap()
        .pending_approval = Some(json!({
        "request_id": "approval-1",
        "command": "rm -rf build",
        "choices": ["once", "deny"],
    }));
    runtime.wakeup();
    wait_for("approval reported", || {
        lock(&hooks.actions).iter().any(|(_, _, a)| a.is_some())
    })
    .await;
    let cancelled = runtime.cancel(&id, "cancel-parked").await.unwrap();
    assert_eq!(cancelled.status, TaskStatus::Cancelled);
    let last = lock(&hooks.actions).last().cloned().expect("actions");
    assert_eq!(last, (ROOM_ID.to_string(), PROFILE.to_string(), None));
    assert!(runtime.stop(STOP).await);
}

#[tokio::test]
async fn test_cancel_never_interrupts_a_newer_task_in_the_same_session() {
    let (db, id) = one_queued_task();
    let rpc = rpc(false);
    let runtime = Spec::new(&rpc).build(&db);
    runtime.start();
    assert!(rpc.submitted.wait(Duration::from_secs(5)).await);
    let session = rpc.first_session();
    let (member, target) = (Arc::downgrade(&rpc), session.clone());
    *lock(&rpc.on_info) = Some(Box::new(move || {
        if let Some(member) = member.upgrade() {
            let mut states = lock(&member.states);
            let state = states.get_mut(&target).unwrap();
            state.active = true;
            state.task_id = Some("task-2".into());
        }
    }));
    let cancelled = runtime.cancel(&id, "cancel-old-task").await.unwrap();
    assert_eq!(cancelled.status, TaskStatus::Stopping);
    assert_eq!(rpc.count("interrupt"), 0);
    assert!(rpc
        .params("interrupt_skipped")
        .iter()
        .all(|p| p["expected_task_id"] == "task-1"));
    {
        let states = lock(&rpc.states);
        assert!(states[&session].active);
        assert_eq!(states[&session].task_id.as_deref(), Some("task-2"));
    }
    assert!(runtime.stop(STOP).await);
}

#[tokio::test]
async fn test_status_reports_room_blocked_on_unresolved_indeterminate_task() {
    let db = db();
    let clock = ManualClock::new(100.0);
    let id = identity("task-1");
    admit(&db, &id, "Inspect the release candidate.");
    start_old_attempt(&db, &id, 1.0, &clock);
    let rpc = rpc(false);
    rpc.add_session(false, Some("task-1"), Vec::new());
    clock.advance(2.0);
    let runtime = Spec::new(&rpc).manual(&clock).build(&db);
    runtime.start();
    wait_for("room blocked", || {
        runtime
            .status()
            .blocked_rooms
            .contains(&ROOM_ID.to_string())
    })
    .await;
    assert!(runtime.stop(STOP).await);
    assert_eq!(status(&db, &id), TaskStatus::Indeterminate);
}

#[tokio::test]
async fn test_authority_loss_stops_terminal_commit() {
    let (db, id) = one_queued_task();
    let rpc = rpc(false);
    let mut spec = Spec::new(&rpc);
    spec.config.lease_ttl_seconds = 30.0;
    let runtime = spec.build(&db);
    runtime.start();
    assert!(rpc.submitted.wait(Duration::from_secs(5)).await);
    claim_authority(
        &mut db.conn(),
        ROOM_ID,
        GATEWAY,
        1,
        "gateway-b",
        "claim-gateway-b",
        &SystemClock::default(),
    )
    .unwrap();
    rpc.complete("task-1", "Finished once.", "settled");
    runtime.wakeup();
    wait_for("error reported", || runtime.status().last_error.is_some()).await;
    assert!(runtime.stop(STOP).await);
    assert_eq!(status(&db, &id), TaskStatus::Running);
    let error = runtime.status().last_error.unwrap_or_default();
    assert!(error.contains("authority changed"), "{error}");
}

#[tokio::test]
async fn test_profile_turn_lock_covers_resolve_submit_and_terminal_observation() {
    let (db, id) = one_queued_task();
    let locks = RecordingTurnLocks::default();
    let mut fake = FakeSessionRpc::new(true);
    fake.required_lock = Some(locks.clone());
    let rpc = Arc::new(fake);
    let mut spec = Spec::new(&rpc);
    spec.locks = locks.clone();
    let runtime = spec.build(&db);
    runtime.start();
    wait_for("settled", || status(&db, &id) == TaskStatus::Settled).await;
    assert!(runtime.stop(STOP).await);
    assert_eq!(
        locks.events(),
        vec![
            ("lock-enter".to_string(), PROFILE.to_string()),
            ("lock-exit".to_string(), PROFILE.to_string())
        ]
    );
    let methods = rpc.methods();
    let index = |m: &str| {
        methods
            .iter()
            .position(|x| x == m)
            .unwrap_or_else(|| panic!("{m} missing"))
    };
    assert!(index("resolve_exact") < index("submit"));
    assert!(index("submit") < index("complete"));
    assert!(!methods.contains(&"history".to_string()));
}

/// A cancel that comes after an attempt's start and before its submission (the member's room
/// session being made) is not acknowledged for want of a turn at the member: nothing is
/// submitted, and the task ends cancelled. It used to be recorded cancelled at once, and the
/// attempt then submitted its turn, which ran in full.
#[tokio::test]
async fn a_cancel_while_an_attempt_opens_its_session_is_never_followed_by_its_turn() {
    let (db, id) = one_queued_task();
    let (reached, go) = (Arc::new(Event::default()), Arc::new(Event::default()));
    let mut fake = FakeSessionRpc::new(true);
    fake.create_gate = Some((reached.clone(), go.clone()));
    let rpc = Arc::new(fake);
    let runtime = Spec::new(&rpc).build(&db);
    runtime.start();
    assert!(reached.wait(Duration::from_secs(5)).await);
    assert_eq!(status(&db, &id), TaskStatus::Running);
    let view = runtime.cancel(&id, "c1").await.expect("cancel");
    assert_eq!(
        view.status,
        TaskStatus::Stopping,
        "acknowledged before the attempt was submitted"
    );
    go.set();
    wait_for("the task cancelled", || {
        status(&db, &id) == TaskStatus::Cancelled
    })
    .await;
    assert_eq!(rpc.count("submit"), 0);
    assert!(runtime.stop(STOP).await);
}

/// A cancel acknowledged (`stopping`) while the attempt opened its member's session, whose
/// opening then fails, ends the task `cancelled`, as its client was told it would: nothing reached
/// the member. The failure to open overrode it, and the task ended `failed`.
#[tokio::test]
async fn a_cancel_while_an_attempt_opens_its_session_wins_over_the_opening_failing() {
    a_cancel_while_the_session_opens_ends_the_attempt(
        false,
        crate::rooms::port::PortError::new("profile is gone"),
    )
    .await;
}

/// The same with a peer member whose session opening is not admitted: the stop ends the
/// attempt. Before, the not-admitted requeue lost its fence to the stopping row, nothing
/// completed the stop (a peer with no session acknowledges no interrupt), and the task stayed
/// `stopping`, its room blocked behind it.
#[tokio::test]
async fn a_cancel_while_a_peer_attempt_is_not_admitted_ends_the_attempt() {
    a_cancel_while_the_session_opens_ends_the_attempt(
        true,
        crate::rooms::port::PortError::not_admitted("connection refused"),
    )
    .await;
}

/// A task cancelled (`stopping`) while its attempt opens its member's session (of a peer
/// member, or not), which then fails with `failure`, ends `cancelled` with nothing submitted;
/// a malformed cancel id is refused while it stops and once it is cancelled.
async fn a_cancel_while_the_session_opens_ends_the_attempt(
    peer: bool,
    failure: crate::rooms::port::PortError,
) {
    let (db, id) = one_queued_task();
    let (reached, go) = (Arc::new(Event::default()), Arc::new(Event::default()));
    let mut fake = FakeSessionRpc::new(true);
    fake.peer = peer;
    fake.create_gate = Some((reached.clone(), go.clone()));
    lock(&fake.create_failures).push_back(failure);
    let rpc = Arc::new(fake);
    let runtime = Spec::new(&rpc).build(&db);
    runtime.start();
    assert!(reached.wait(Duration::from_secs(5)).await);
    let view = runtime.cancel(&id, "c1").await.expect("cancel");
    assert_eq!(view.status, TaskStatus::Stopping);
    // A malformed cancel id is refused whatever the task's state (a stopping or cancelled
    // task took it, where a queued or running one refused it).
    assert!(runtime.cancel(&id, "bad id").await.is_err());
    go.set();
    wait_for("the task ended", || {
        matches!(status(&db, &id), TaskStatus::Cancelled | TaskStatus::Failed)
    })
    .await;
    assert_eq!(status(&db, &id), TaskStatus::Cancelled);
    assert!(runtime.cancel(&id, "bad id").await.is_err());
    assert_eq!(rpc.count("submit"), 0);
    assert!(runtime.stop(STOP).await);
}

#[tokio::test]
async fn test_stop_is_bounded_and_does_not_interrupt_active_turn() {
    let (db, id) = one_queued_task();
    let rpc = rpc(false);
    let runtime = Spec::new(&rpc).build(&db);
    runtime.start();
    assert!(rpc.submitted.wait(Duration::from_secs(5)).await);
    let started = Instant::now();
    let stopped = runtime.stop(Duration::from_millis(500)).await;
    assert!(stopped);
    // Bounded by its budget (plus the lease's release): the member's turn never ends here, so a
    // stop that waited for it would not return at all. Slack for a loaded machine.
    assert!(started.elapsed() < Duration::from_secs(3));
    assert_eq!(status(&db, &id), TaskStatus::Running);
    assert_eq!(rpc.count("interrupt"), 0);
}

/// The member's report of an attempt whose stop was acknowledged, coming after the room let
/// its lease go, is fenced in silence: the attempt had ended. Before, it was recorded as the
/// room's error ("fenced: driver lease is stale").
#[tokio::test]
async fn a_late_report_of_a_cancelled_attempt_is_no_room_error() {
    let (db, id) = one_queued_task();
    let rpc = rpc(false);
    let runtime = Spec::new(&rpc).build(&db);
    runtime.start();
    assert!(rpc.submitted.wait(Duration::from_secs(5)).await);
    let report = {
        let states = lock(&rpc.states);
        states
            .values()
            .find_map(|s| s.on_terminal.clone())
            .expect("a turn's callback")
    };
    let cancelled = runtime.cancel(&id, "user-cancel").await.unwrap();
    assert_eq!(cancelled.status, TaskStatus::Cancelled);
    assert!(runtime.stop(STOP).await);
    let lease = crate::store::leases::get_lease(&mut db.conn(), ROOM_ID).unwrap();
    assert!(
        lease.is_some_and(|l| l.released_at.is_some()),
        "the lease was let go"
    );
    report(TerminalReceipt {
        status: "interrupted".into(),
        ..Default::default()
    });
    assert_eq!(runtime.status().last_error, None);
    assert_eq!(status(&db, &id), TaskStatus::Cancelled);
}

#[tokio::test]
async fn restarted_runtime_observes_its_own_running_attempt_again() {
    let (db, id) = one_queued_task();
    let rpc = rpc(false);
    let mut spec = Spec::new(&rpc);
    spec.config.lease_ttl_seconds = 30.0;
    let runtime = spec.build(&db);
    runtime.start();
    assert!(rpc.submitted.wait(Duration::from_secs(5)).await);
    assert!(runtime.stop(STOP).await);
    assert_eq!(status(&db, &id), TaskStatus::Running);
    // the terminal callback is gone: only the transcript can tell
    let session = rpc.first_session();
    lock(&rpc.states).get_mut(&session).unwrap().on_terminal = None;
    runtime.start();
    rpc.complete("task-1", "Observed again.", "settled");
    runtime.wakeup();
    wait_for("settled", || status(&db, &id) == TaskStatus::Settled).await;
    assert!(runtime.stop(STOP).await);
    assert_eq!(task(&db, &id).result.unwrap()["text"], "Observed again.");
    assert_eq!(rpc.count("submit"), 1);
}

/// An own attempt found running with its member session open, that the member's own ledger
/// never admitted (its failure or put-back could not be recorded: the store failed too), is
/// queued again and runs; it is not observed until its deadline, holding the room's slot and
/// the member's turn lock.
#[tokio::test]
async fn reattaching_an_attempt_its_member_never_admitted_queues_it_again() {
    let (db, id) = one_queued_task();
    let rpc = rpc(true);
    let mut spec = Spec::new(&rpc);
    spec.config.lease_ttl_seconds = 30.0;
    spec.config.unavailable_retry_min_seconds = 0.01;
    spec.config.unavailable_retry_max_seconds = 0.01;
    spec.config.turn_timeout_seconds = 3600.0;
    let runtime = spec.build(&db);
    // The first attempt is left running with its member session open, as a pass that could
    // record neither its failure nor its put-back leaves it.
    let clock = SystemClock::default();
    let lease = lease_for(&db, runtime.process_generation(), 30.0, &clock);
    runtime.adopt_lease(lease.clone());
    let attempt = start_task(&mut db.conn(), &id, &lease, 0, &clock).expect("start");
    rpc.add_session(false, None, Vec::new());
    rpc.keeps_ledger.store(true, Ordering::SeqCst);
    runtime.start();
    wait_for("settled", || status(&db, &id) == TaskStatus::Settled).await;
    assert!(runtime.stop(STOP).await);
    assert_eq!(rpc.count("submit"), 1);
    assert_eq!(
        task(&db, &id).execution_generation,
        attempt.execution_generation + 1
    );
}

/// An own attempt found running on a peer member that reports no member session is not queued
/// again: a peer that lost or moved the session may have run the attempt (a local member's
/// turn cannot outlive its session; a peer's proves nothing by its absence). It stays running,
/// the room's error says why, and nothing is dispatched a second time.
#[tokio::test]
async fn reattaching_a_peer_attempt_whose_session_is_gone_does_not_dispatch_it_again() {
    let (db, id) = one_queued_task();
    let mut peer = FakeSessionRpc::new(true);
    peer.peer = true;
    let rpc = Arc::new(peer);
    let mut spec = Spec::new(&rpc);
    spec.config.lease_ttl_seconds = 30.0;
    spec.config.unavailable_retry_min_seconds = 0.01;
    spec.config.unavailable_retry_max_seconds = 0.01;
    spec.config.turn_timeout_seconds = 3600.0;
    let runtime = spec.build(&db);
    // The first attempt is left running, its member session not to be found on the peer.
    let clock = SystemClock::default();
    let lease = lease_for(&db, runtime.process_generation(), 30.0, &clock);
    runtime.adopt_lease(lease.clone());
    let attempt = start_task(&mut db.conn(), &id, &lease, 0, &clock).expect("start");
    runtime.start();
    wait_for("error reported", || runtime.status().last_error.is_some()).await;
    assert!(runtime.stop(STOP).await);
    let error = runtime.status().last_error.unwrap_or_default();
    assert!(error.contains("no member session"), "{error}");
    assert_eq!(status(&db, &id), TaskStatus::Running);
    assert_eq!(rpc.count("submit"), 0);
    assert_eq!(
        task(&db, &id).execution_generation,
        attempt.execution_generation
    );
}

/// Once the room's first submit reached the member, its turn ends without a report (the member
/// session idle, no terminal report sent): what its ledger says is the test's to set. The
/// member session's id.
async fn member_turn_ended_unreported(rpc: &FakeSessionRpc) -> String {
    assert!(rpc.submitted.wait(Duration::from_secs(5)).await);
    let session = rpc.first_session();
    {
        let mut states = lock(&rpc.states);
        let state = states.get_mut(&session).expect("the member session");
        state.on_terminal = None;
        state.active = false;
    }
    session
}

/// A member turn stopped outside the room, whose terminal report was lost (its commit failed),
/// is found by the observer in the member's own ledger: the task fails at once with the
/// member's reason, not at its deadline.
#[tokio::test]
async fn an_observed_turn_stopped_outside_the_room_is_read_from_the_members_ledger() {
    let (db, id) = one_queued_task();
    let rpc = rpc(false);
    let mut spec = Spec::new(&rpc);
    spec.config.turn_timeout_seconds = 3600.0;
    let runtime = spec.build(&db);
    runtime.start();
    member_turn_ended_unreported(&rpc).await;
    lock(&rpc.ledger).insert(
        "task-1".into(),
        LedgerAttempt::Ended(TerminalReceipt {
            status: "interrupted".into(),
            error: Some("stopped by its operator".into()),
            ..Default::default()
        }),
    );
    rpc.keeps_ledger.store(true, Ordering::SeqCst);
    runtime.wakeup();
    wait_for("failed", || status(&db, &id) == TaskStatus::Failed).await;
    assert!(runtime.stop(STOP).await);
    let failed = task(&db, &id);
    assert!(
        failed
            .result
            .unwrap_or_default()
            .to_string()
            .contains("stopped by its operator"),
        "{:?}",
        failed.settlement_id
    );
    assert_eq!(rpc.count("submit"), 1);
}

/// An observed turn that its member's ledger holds `unknown` (the member's supervisor ended
/// without settling it) ends the watch: the member's turn lock and the pass's slot are given
/// back, and the room waits for the member's operator, saying what to run. The watch held both
/// until the deadline, and the deadline's stop recorded the task failed.
#[tokio::test]
async fn an_observed_turn_its_member_holds_unknown_waits_for_the_operator_unlocked() {
    let (db, id) = one_queued_task();
    let locks = RecordingTurnLocks::default();
    let rpc = rpc(false);
    let mut spec = Spec::new(&rpc);
    spec.locks = locks.clone();
    spec.config.turn_timeout_seconds = 3600.0;
    let runtime = spec.build(&db);
    runtime.start();
    let session = member_turn_ended_unreported(&rpc).await;
    lock(&rpc.ledger).insert(
        "task-1".into(),
        LedgerAttempt::Unresolved {
            session_id: session.clone(),
            admission_id: "adm-1".into(),
        },
    );
    rpc.keeps_ledger.store(true, Ordering::SeqCst);
    runtime.wakeup();
    wait_for("the operator named", || {
        runtime
            .status()
            .last_error
            .is_some_and(|e| e.contains("resolve-unknown"))
    })
    .await;
    wait_for("the turn lock given back", || !locks.held_for(PROFILE)).await;
    assert!(runtime.stop(STOP).await);
    let error = runtime.status().last_error.unwrap_or_default();
    assert!(error.contains(&format!("{session} adm-1")), "{error}");
    assert_eq!(status(&db, &id), TaskStatus::Running);
    assert_eq!(rpc.count("submit"), 1);
}

/// Past its deadline, an observed turn its member holds `unknown` is not stopped (the stop
/// found it "will not start" and recorded the task failed, to be retried though the turn may
/// have run): the room waits for the member's operator.
#[tokio::test]
async fn a_turn_its_member_holds_unknown_is_not_stopped_at_its_deadline() {
    let (db, id) = one_queued_task();
    let rpc = rpc(false);
    lock(&rpc.ledger).insert(
        "task-1".into(),
        LedgerAttempt::Unresolved {
            session_id: "member".into(),
            admission_id: "adm-1".into(),
        },
    );
    rpc.keeps_ledger.store(true, Ordering::SeqCst);
    let mut spec = Spec::new(&rpc);
    spec.config.turn_timeout_seconds = 0.001;
    let runtime = spec.build(&db);
    runtime.start();
    wait_for("the operator named", || {
        runtime
            .status()
            .last_error
            .is_some_and(|e| e.contains("resolve-unknown"))
    })
    .await;
    assert!(runtime.stop(STOP).await);
    assert_eq!(status(&db, &id), TaskStatus::Running);
    assert_eq!(rpc.count("interrupt"), 0);
}

#[test]
fn every_seed_scenario_has_a_test() {
    // The seed's scenarios, by name: each has a test here named after it (a parametrized one,
    // one per case, `_<case>`), and every `test_` here is one of them.
    const SEED: [&str; 42] = [
        "test_active_recovered_turn_is_never_resubmitted",
        "test_ambiguous_recovery_remains_indeterminate",
        "test_authority_loss_stops_terminal_commit",
        "test_bounded_scheduler_eventually_runs_later_room",
        "test_cancel_never_interrupts_a_newer_task_in_the_same_session",
        "test_cancellation_is_persisted_before_interrupt_and_fences_late_result",
        "test_completion_wins_a_race_with_unacknowledged_stop",
        "test_deadline_releases_worker_capacity_for_later_room",
        "test_existing_canonical_session_is_resumed_not_duplicated",
        "test_expired_local_attempt_defers_without_hydrating_or_resubmitting",
        "test_local_crash_recovery_keeps_ambiguous_history_explicit_without_resume",
        "test_not_admitted_peer_task_stays_queued_with_exponential_capped_retry",
        "test_not_admitted_room_does_not_block_other_rooms",
        "test_offline_member_defers_then_healthy_task_runs_and_retry_is_fenced",
        "test_oversized_terminal_reply_is_bounded_without_waiting_for_deadline",
        "test_peer_recovery_probe_is_bounded_by_attempt_and_stale_age",
        "test_peer_terminal_status_acknowledges_durable_stop_on_retry",
        "test_peer_terminal_status_must_match_exact_task_attempt",
        "test_pending_local_approval_is_reported_with_safe_choices",
        "test_policy_hooks_prepare_and_publish_terminal_idempotently",
        "test_post_submit_observation_failure_preserves_recoverable_outcome",
        "test_profile_turn_lock_covers_resolve_submit_and_terminal_observation",
        "test_provisional_stopping_response_does_not_acknowledge_cancellation",
        "test_queued_task_routes_profile_and_credentials_without_overrides",
        "test_restart_acknowledges_inactive_local_stop_without_memory_marker",
        "test_restart_harvests_completion_before_retrying_durable_stop",
        "test_retry_cannot_advance_generation_while_original_attempt_is_active",
        "test_retry_ignores_late_receipt_from_prior_execution_generation",
        "test_retry_reconciles_terminal_remote_cancellation_without_new_generation",
        "test_retry_uses_runtime_session_id_returned_by_resume",
        "test_room_concurrency_bound_must_be_a_positive_integer",
        "test_rotated_bounded_scheduler_eventually_runs_later_room",
        "test_runtime_uses_unique_process_generation",
        "test_status_reports_room_blocked_on_unresolved_indeterminate_task",
        "test_stop_is_bounded_and_does_not_interrupt_active_turn",
        "test_stop_resumes_persisted_session_before_reading_runtime_history",
        "test_transient_remote_stop_failure_stays_pending_and_retries",
        "test_transport_resolver_selects_member_transport_without_forking_state",
        "test_turn_deadline_stops_exact_attempt_and_publishes_durable_failure",
        "test_waiting_room_does_not_block_an_independent_local_room",
        "test_waiting_room_does_not_block_an_independent_room",
        "test_worker_settles_without_any_client_transport",
    ];
    let source = include_str!("scenarios.rs");
    let names: HashSet<&str> = source
        .lines()
        .filter_map(|l| l.strip_prefix("async fn "))
        .filter_map(|l| l.split('(').next())
        .filter(|n| n.starts_with("test_"))
        .collect();
    let of_seed = |n: &str| {
        SEED.iter()
            .any(|s| n == *s || n.strip_prefix(s).is_some_and(|c| c.starts_with('_')))
    };
    let missing: Vec<&str> = SEED
        .iter()
        .copied()
        .filter(|s| !names.iter().any(|n| of_seed(n) && n.starts_with(s)))
        .collect();
    assert!(
        missing.is_empty(),
        "seed scenarios without a test: {missing:?}"
    );
    let strays: Vec<&&str> = names.iter().filter(|n| !of_seed(n)).collect();
    assert!(
        strays.is_empty(),
        "test_ names that are no seed scenario: {strays:?}"
    );
    assert_eq!(names.len(), SEED.len() + 1, "one scenario is two cases");
}

/// An observation poll longer than the lease's TTL does not let a long turn's lease lapse: the
/// observer renews it while the member works, so the late completion settles the task (it used
/// to be fenced out, and the attempt recovered as indeterminate).
#[tokio::test]
async fn a_long_turn_keeps_its_lease_whatever_the_observation_poll() {
    let (db, id) = one_queued_task();
    let rpc = rpc(false);
    // The lease's time is a manual clock's, so no stall of a loaded machine lapses it.
    let clock = manual_clock_at_now();
    let mut spec = Spec::new(&rpc).manual(&clock);
    spec.config.lease_ttl_seconds = 2.0;
    spec.config.active_poll_interval_seconds = 60.0;
    let runtime = spec.build(&db);
    runtime.start();
    wait_for("submitted", || rpc.count("submit") == 1).await;
    // Over two TTLs of work, in steps past half the TTL, each renewed before the next.
    for _ in 0..4 {
        let renewed = runtime.status().lease_renewals;
        clock.advance(1.1);
        wait_for("renewed while the turn runs", || {
            runtime.status().lease_renewals > renewed
        })
        .await;
    }
    assert_eq!(status(&db, &id), TaskStatus::Running);
    rpc.complete("task-1", "done", "settled");
    wait_for("settled", || status(&db, &id) == TaskStatus::Settled).await;
    assert!(runtime.stop(STOP).await);
    let status = runtime.status();
    assert_eq!(status.lease_losses, 0);
    assert!(
        status.lease_renewals >= 2,
        "renewed while the turn ran: {status:?}"
    );
}

/// A renewal of the lease that the store fails (a write that did not commit: busy, an I/O
/// error) does not end the observation of the member's running turn: the room keeps the member's
/// turn lock and renews at its next look. It was taken as a lost lease: the lock (and the room's
/// slot) let go while the member's turn ran on, unobserved, and another room could start a turn
/// of the same member.
#[tokio::test]
async fn a_lease_renewal_the_store_fails_keeps_observing_the_running_turn() {
    use diesel::RunQueryDsl;
    let (db, id) = one_queued_task();
    let rpc = rpc(false);
    let mut spec = Spec::new(&rpc);
    // Due for renewal after half of it: failed renewals have the other half before it lapses.
    spec.config.lease_ttl_seconds = 4.0;
    spec.config.active_poll_interval_seconds = 0.05;
    let locks = spec.locks.clone();
    let runtime = spec.build(&db);
    runtime.start();
    wait_for("submitted", || rpc.count("submit") == 1).await;
    let fail = "CREATE TRIGGER fail_renewal BEFORE UPDATE ON room_leases \
                BEGIN SELECT RAISE(ABORT, 'injected renewal failure'); END";
    diesel::sql_query(fail)
        .execute(&mut db.conn())
        .expect("trigger");
    let failed = || {
        runtime
            .status()
            .last_error
            .is_some_and(|e| e.contains("injected renewal failure"))
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while !failed() {
        assert!(Instant::now() < deadline, "no renewal was tried");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(locks.held_for(PROFILE), "the member's turn lock was let go");
    assert_eq!(status(&db, &id), TaskStatus::Running);
    let renewed = runtime.status().lease_renewals;
    diesel::sql_query("DROP TRIGGER fail_renewal")
        .execute(&mut db.conn())
        .expect("drop trigger");
    wait_for("renewed", || runtime.status().lease_renewals > renewed).await;
    assert!(locks.held_for(PROFILE));
    rpc.complete("task-1", "done", "settled");
    wait_for("settled", || status(&db, &id) == TaskStatus::Settled).await;
    assert!(runtime.stop(STOP).await);
    assert_eq!(runtime.status().lease_losses, 0);
    assert_eq!(rpc.count("submit"), 1);
}

/// A lease lost while the member runs the attempt's turn (the clock jumped past its TTL, and
/// the renewal took the room's lease again at a new generation): nothing of the attempt can be
/// written, but the member's turn lock is held until that turn ends. It was let go at once, and
/// another room's task for the same member could start beside the running turn.
#[tokio::test]
async fn a_lease_lost_mid_turn_keeps_the_members_turn_lock_until_the_turn_ends() {
    let (db, id) = one_queued_task();
    let rpc = rpc(false);
    let clock = manual_clock_at_now();
    let mut spec = Spec::new(&rpc).manual(&clock);
    spec.config.lease_ttl_seconds = 2.0;
    spec.config.active_poll_interval_seconds = 0.05;
    let locks = spec.locks.clone();
    let runtime = spec.build(&db);
    runtime.start();
    wait_for("submitted", || rpc.count("submit") == 1).await;
    clock.advance(10.0);
    wait_for("the lease lost", || runtime.status().lease_losses > 0).await;
    // Still held some polls later: the member's turn runs on.
    let asked = rpc.count("info");
    wait_for("the member asked again", || rpc.count("info") > asked + 2).await;
    assert!(locks.held_for(PROFILE), "the member's turn lock was let go");
    assert_eq!(status(&db, &id), TaskStatus::Running);
    // The turn ends: the lock is let go, and the attempt is recovered from the member.
    rpc.complete("task-1", "done", "settled");
    wait_for("the lock let go", || !locks.held_for(PROFILE)).await;
    assert!(runtime.stop(STOP).await);
    assert_eq!(rpc.count("submit"), 1);
}

/// What [`abandoned_local_attempt`] sets up: the store, its clock, the task, its member's fake
/// and the new process's runtime.
type Abandoned = (
    TestDb,
    ManualClock,
    TaskIdentity,
    Arc<FakeSessionRpc>,
    crate::rooms::RoomRuntime,
);

/// A task whose attempt an old process started and abandoned, its member idle, and a runtime
/// of a new process (its clock a second later) that defers after `defer` seconds.
fn abandoned_local_attempt(defer: f64) -> Abandoned {
    abandoned_local_attempt_with(|spec| spec.config.indeterminate_defer_seconds = defer)
}

/// [`abandoned_local_attempt`] with the new process's runtime as `tweak` makes it.
fn abandoned_local_attempt_with(tweak: impl FnOnce(&mut Spec)) -> Abandoned {
    let db = db();
    let clock = ManualClock::new(100.0);
    let id = identity("task-1");
    admit_to(
        &db,
        &id,
        PROFILE,
        "Inspect the release candidate.",
        1,
        &clock,
    );
    start_old_attempt(&db, &id, 0.2, &clock);
    let rpc = rpc(false);
    rpc.add_session(false, Some("task-1"), Vec::new());
    clock.set(101.0);
    let mut spec = Spec::new(&rpc).manual(&clock);
    tweak(&mut spec);
    let runtime = spec.build(&db);
    (db, clock, id, rpc, runtime)
}

/// The probe of an abandoned attempt does not wait for its member in a scheduler slot: while
/// another room's turn holds the member, the pass ends at once with nothing asked of the member,
/// and the first pass after the holder let go resolves the attempt. Before, the pass waited for
/// the lock (up to the other turn's deadline) and held the slot meanwhile.
#[tokio::test]
async fn an_abandoned_attempts_probe_does_not_wait_for_a_busy_member() {
    let (db, _clock, id, rpc, runtime) = abandoned_local_attempt_with(|spec| {
        spec.exclusive_locks = Some(Arc::new(ProfileTurnLocks::default()));
    });
    ledger_says(&rpc, "settled", Some("Recovered."));

    let other = runtime
        .try_turn("room-2", PROFILE)
        .expect("the member is free");
    tokio::time::timeout(STOP, runtime.process_room(&binding()))
        .await
        .expect("the pass waited for the busy member");
    assert_eq!(status(&db, &id), TaskStatus::Running);
    assert_eq!(rpc.count("ledger_attempt"), 0);

    drop(other);
    runtime.process_room(&binding()).await;
    assert_eq!(status(&db, &id), TaskStatus::Settled);
    assert_eq!(rpc.count("submit"), 0);
}

/// The recovery probe of an indeterminate task does not wait for its member in a scheduler
/// slot either: while another room's turn holds the member the pass ends with nothing asked,
/// and the pass after the release resolves the task from the member's ledger.
#[tokio::test]
async fn an_indeterminate_tasks_probe_does_not_wait_for_a_busy_member() {
    let (db, clock, id, rpc, runtime) = abandoned_local_attempt_with(|spec| {
        spec.exclusive_locks = Some(Arc::new(ProfileTurnLocks::default()));
    });
    recover_elsewhere(&db, &clock);
    assert_eq!(status(&db, &id), TaskStatus::Indeterminate);
    ledger_says(&rpc, "settled", Some("Recovered."));

    let other = runtime
        .try_turn("room-2", PROFILE)
        .expect("the member is free");
    tokio::time::timeout(STOP, runtime.process_room(&binding()))
        .await
        .expect("the pass waited for the busy member");
    assert_eq!(status(&db, &id), TaskStatus::Indeterminate);
    assert_eq!(rpc.count("ledger_attempt"), 0);

    drop(other);
    runtime.process_room(&binding()).await;
    assert_eq!(status(&db, &id), TaskStatus::Settled);
    assert_eq!(rpc.count("submit"), 0);
}

/// An operator's retry waits for a busy member a bounded time, then is refused having done
/// nothing (the task keeps its state and generation, nothing is submitted); once the member is
/// free the retry goes through. Before, it waited up to the other room's turn deadline, long
/// after the CLI had given up and said the retry failed, and then made it.
#[tokio::test]
async fn a_retry_does_not_wait_out_a_busy_member() {
    let (db, clock, id, rpc, runtime) = abandoned_local_attempt_with(|spec| {
        spec.exclusive_locks = Some(Arc::new(ProfileTurnLocks::default()));
    });
    recover_elsewhere(&db, &clock);
    let before = task(&db, &id);
    assert_eq!(before.status, TaskStatus::Indeterminate);

    let other = runtime
        .try_turn("room-2", PROFILE)
        .expect("the member is free");
    let refused = tokio::time::timeout(STOP, runtime.retry_indeterminate(&id))
        .await
        .expect("the retry waited out the busy member")
        .unwrap_err();
    assert!(
        refused.to_string().contains("running another room's turn"),
        "{refused}"
    );
    let after = task(&db, &id);
    assert_eq!(after.status, TaskStatus::Indeterminate);
    assert_eq!(after.execution_generation, before.execution_generation);
    assert_eq!(rpc.count("submit"), 0);

    drop(other);
    let retried = runtime.retry_indeterminate(&id).await.unwrap();
    assert_eq!(retried.status, TaskStatus::Queued);
}

/// Observing again its own running attempt (after a stop and start of the runtime) does not
/// wait in a scheduler slot for a member another room's turn holds: with one slot, a room of
/// another member still runs meanwhile; the attempt is never resubmitted, and once the member
/// is free it is observed to its end. Before, the pass held the only slot until the release.
#[tokio::test]
async fn reattaching_an_own_attempt_does_not_wait_for_a_busy_member() {
    let db = db();
    db.add_room("room-2", "dev", GATEWAY);
    let id = identity("task-1");
    admit(&db, &id, "Inspect the release candidate.");
    let rpc = rpc(false);
    let mut spec = Spec::new(&rpc);
    spec.bindings = vec![binding(), RoomBinding::new("room-2", GATEWAY, 1)];
    spec.config.lease_ttl_seconds = 30.0;
    spec.config.max_concurrent_rooms = 1;
    spec.exclusive_locks = Some(Arc::new(ProfileTurnLocks::default()));
    let runtime = spec.build(&db);
    runtime.start();
    assert!(rpc.submitted.wait(Duration::from_secs(5)).await);
    assert!(runtime.stop(STOP).await);
    let session = rpc.first_session();
    lock(&rpc.states).get_mut(&session).unwrap().on_terminal = None;

    let other = runtime
        .try_turn("room-3", PROFILE)
        .expect("the member is free");
    let second = TaskIdentity::new("room-2", "task-2", "thread-2", "turn-2").unwrap();
    admit_to(
        &db,
        &second,
        "dev",
        "Run room two.",
        1,
        &SystemClock::default(),
    );
    // The first cycle's only slot goes to room-1, whose pass finds its member busy.
    runtime.state().cursor = 0;
    runtime.start();
    wait_for("room two's task submitted", || {
        rpc.params("submit")
            .iter()
            .any(|p| p["prompt"] == "Run room two.")
    })
    .await;
    assert_eq!(status(&db, &id), TaskStatus::Running);
    rpc.complete("task-2", "Room two done.", "settled");
    wait_for("room two settled", || {
        status(&db, &second) == TaskStatus::Settled
    })
    .await;

    drop(other);
    rpc.complete("task-1", "Observed again.", "settled");
    runtime.wakeup();
    wait_for("settled", || status(&db, &id) == TaskStatus::Settled).await;
    assert!(runtime.stop(STOP).await);
    assert_eq!(task(&db, &id).result.unwrap()["text"], "Observed again.");
    let submits = rpc.params("submit");
    assert_eq!(
        submits
            .iter()
            .filter(|p| p["prompt"] == "Inspect the release candidate.")
            .count(),
        1
    );
}

/// What the member's ledger says of `task-1`: it ended as `status`.
fn ledger_says(rpc: &FakeSessionRpc, status: &str, text: Option<&str>) {
    lock(&rpc.ledger).insert(
        "task-1".into(),
        LedgerAttempt::Ended(TerminalReceipt {
            status: status.into(),
            settlement_id: Some("adm-1".into()),
            message_id: Some("adm-1".into()),
            text: text.map(str::to_string),
            error: None,
        }),
    );
}

/// An abandoned local attempt whose member's ledger says how it ended is resolved from that
/// ledger at the first pass of its new holder (no defer wait, no history, no resubmission):
/// settled with its result, and an interrupted one failed, saying so.
#[tokio::test]
async fn an_abandoned_local_attempt_is_resolved_from_its_members_ledger() {
    for (ended, want) in [
        ("settled", TaskStatus::Settled),
        ("interrupted", TaskStatus::Failed),
    ] {
        let (db, _clock, id, rpc, runtime) = abandoned_local_attempt(60.0);
        ledger_says(&rpc, ended, (ended == "settled").then_some("Recovered."));
        runtime.process_room(&binding()).await;
        let resolved = task(&db, &id);
        assert_eq!(resolved.status, want, "{ended}");
        let result = resolved.result.expect("result").to_string();
        if ended == "settled" {
            assert!(result.contains("Recovered."), "{result}");
        } else {
            assert!(
                result.contains("the member's turn was interrupted"),
                "{result}"
            );
        }
        assert!(rpc.count("ledger_attempt") >= 1);
        assert_eq!(rpc.count("history"), 0);
        assert_eq!(rpc.count("submit"), 0);
    }
}

/// A retry of a deferred local attempt that its member completed after all settles it with the
/// result instead of running it again.
#[tokio::test]
async fn a_retry_of_a_deferred_attempt_that_completed_settles_it() {
    let (db, clock, id, rpc, runtime) = abandoned_local_attempt(0.5);
    runtime.process_room(&binding()).await;
    clock.set(102.0);
    runtime.process_room(&binding()).await;
    assert_eq!(status(&db, &id), TaskStatus::Deferred);
    // The member's unknown turn is resolved meanwhile: it had completed.
    ledger_says(&rpc, "settled", Some("Done after all."));
    let view = runtime.retry_indeterminate(&id).await.expect("retry");
    assert_eq!(view.status, TaskStatus::Settled);
    assert!(view
        .result
        .expect("result")
        .to_string()
        .contains("Done after all."));
    assert_eq!(rpc.count("submit"), 0);
}

/// The runtime's `last_error` is the newest error of a room it still holds: a retired room's
/// goes with it (before, the operator's view kept naming a disbanded room's error for good).
#[tokio::test]
async fn a_retired_rooms_error_leaves_the_runtimes_last_error() {
    let (_db, _clock, _id, _rpc, runtime) = abandoned_local_attempt(0.5);
    runtime.set_error("other-room", "older error".into());
    runtime.set_error(ROOM_ID, "newest error".into());
    assert_eq!(runtime.status().last_error.as_deref(), Some("newest error"));
    runtime.retired(ROOM_ID).await;
    assert_eq!(runtime.status().last_error.as_deref(), Some("older error"));
    runtime.retired("other-room").await;
    assert_eq!(runtime.status().last_error, None);
}

/// [`abandoned_local_attempt`] whose member's ledger says `ledger` of it, passed before and
/// after its defer deadline: still indeterminate, its room blocked with an error that says
/// `says`.
async fn held_past_its_defer(ledger: LedgerAttempt, says: &str) -> Abandoned {
    let (db, clock, id, rpc, runtime) = abandoned_local_attempt(0.5);
    lock(&rpc.ledger).insert("task-1".into(), ledger);
    runtime.process_room(&binding()).await;
    clock.set(110.0);
    runtime.process_room(&binding()).await;
    assert_eq!(status(&db, &id), TaskStatus::Indeterminate);
    let waiting = runtime.status();
    assert_eq!(waiting.blocked_rooms, vec![ROOM_ID.to_string()]);
    assert!(
        waiting
            .last_error
            .as_deref()
            .is_some_and(|e| e.contains(says)),
        "{:?}",
        waiting.last_error
    );
    (db, clock, id, rpc, runtime)
}

/// An abandoned local attempt that its member's ledger holds as `unknown` keeps its room waiting
/// for the member's operator, past the defer deadline (deferring would only queue the room's next
/// task behind it), and resolves at the first pass after the operator has.
#[tokio::test]
async fn an_unresolved_member_turn_holds_its_room_until_its_operator_resolves_it() {
    let (db, _clock, id, rpc, runtime) = held_past_its_defer(
        LedgerAttempt::Unresolved {
            session_id: "member-1".into(),
            admission_id: "adm-1".into(),
        },
        "gatehouse resolve-unknown member-1 adm-1",
    )
    .await;
    ledger_says(&rpc, "interrupted", None);
    runtime.process_room(&binding()).await;
    assert_eq!(status(&db, &id), TaskStatus::Failed);
    assert!(runtime.status().blocked_rooms.is_empty());
    assert_eq!(rpc.count("submit"), 0);
}

/// A queued task whose member's session is held (by an `unknown` turn its operator has still to
/// resolve) waits in the room: nothing is started or submitted, its generation stays, the room
/// is blocked saying what holds it and how to free it, and the first pass after the session is
/// freed runs the task. Before, the task was started and submitted into the held session, where
/// it waited out its turn deadline and failed, and so did each task after it.
#[tokio::test]
async fn a_task_for_a_held_member_session_waits_in_its_room() {
    let (db, id) = one_queued_task();
    let rpc = rpc(true);
    *lock(&rpc.held) = Some("held by the unknown turn adm-0: resolve it".into());
    let runtime = Spec::new(&rpc).build(&db);
    for _ in 0..2 {
        runtime.process_room(&binding()).await;
    }
    let waiting = task(&db, &id);
    assert_eq!(waiting.status, TaskStatus::Queued);
    assert_eq!(waiting.execution_generation, 0);
    assert_eq!(rpc.count("held"), 2);
    assert_eq!(rpc.count("create") + rpc.count("submit"), 0);
    let held = runtime.status();
    assert_eq!(held.blocked_rooms, vec![ROOM_ID.to_string()]);
    assert_eq!(
        held.last_error.as_deref(),
        Some("task task-1 waits: held by the unknown turn adm-0: resolve it")
    );

    *lock(&rpc.held) = None;
    runtime.process_room(&binding()).await;
    assert_eq!(status(&db, &id), TaskStatus::Settled);
    assert_eq!(rpc.count("submit"), 1);
    assert!(runtime.status().blocked_rooms.is_empty());
}

/// A recovered attempt that waits in its member's queue (admitted, not started) is neither
/// deferred at its defer deadline nor retried into a second attempt: the room waits for it,
/// saying where it is queued, and resolves it from the member's ledger once it has run.
#[tokio::test]
async fn a_recovered_attempt_queued_in_its_member_is_waited_for_not_deferred() {
    let (db, _clock, id, rpc, runtime) = held_past_its_defer(
        LedgerAttempt::Live {
            session_id: "member-1".into(),
            admission_id: "adm-1".into(),
            started: None,
        },
        "adm-1 is queued in session member-1",
    )
    .await;
    let refused = runtime
        .retry_indeterminate(&id)
        .await
        .expect_err("a retry of a queued attempt was taken");
    assert!(refused.to_string().contains("still active"), "{refused}");

    ledger_says(&rpc, "settled", Some("Ran once."));
    runtime.process_room(&binding()).await;
    let settled = task(&db, &id);
    assert_eq!(settled.status, TaskStatus::Settled);
    assert_eq!(settled.execution_generation, 1);
    assert_eq!(rpc.count("submit"), 0);
}

/// A room offers a member's approval as `once` and `deny` only, in the member's order, and both
/// when the member offered neither (only inputs already in once-then-deny order were tested).
#[test]
fn a_rooms_approval_offers_once_and_deny_in_the_members_order() {
    use crate::rooms::supervisor::room_approval_choices;
    let offered = |choices: serde_json::Value| room_approval_choices(&json!({"choices": choices}));
    assert_eq!(
        offered(json!(["once", "session", "always", "deny"])),
        [json!("once"), json!("deny")]
    );
    assert_eq!(
        offered(json!(["deny", "always", "once"])),
        [json!("deny"), json!("once")]
    );
    assert_eq!(
        offered(json!(["session", "always"])),
        [json!("once"), json!("deny")]
    );
    assert_eq!(offered(json!("once")), [json!("once"), json!("deny")]);
    assert_eq!(
        room_approval_choices(&json!({})),
        [json!("once"), json!("deny")]
    );
}

/// A session that cannot be opened fails the attempt before anything is submitted: the task
/// ends `failed` under the settlement `failure:<task>:<generation>` with the error as its
/// result, and the room says why. Nothing was submitted.
#[tokio::test]
async fn a_session_that_cannot_be_opened_fails_the_task_before_submit() {
    let (db, id) = one_queued_task();
    let rpc = rpc(true);
    lock(&rpc.create_failures).push_back(crate::rooms::port::PortError::new("profile is gone"));
    let runtime = Spec::new(&rpc).build(&db);
    runtime.run_cycle().await;
    let view = task(&db, &id);
    assert_eq!(view.status, TaskStatus::Failed);
    assert_eq!(view.settlement_id.as_deref(), Some("failure:task-1:1"));
    assert_eq!(view.result, Some(json!({"error": "profile is gone"})));
    assert_eq!(rpc.count("submit"), 0);
    let error = runtime.status().last_error.unwrap_or_default();
    assert!(error.contains("task task-1 failed"), "{error}");
}

/// A task id as long as an identifier may be still gets a settlement id that is one: its
/// failure is recorded (before, the id was refused as too long, and the task started again on
/// every pass, never ending).
#[tokio::test]
async fn a_task_with_the_longest_id_fails_before_submit_once() {
    let db = db();
    let long = "t".repeat(128);
    let id = TaskIdentity::new(ROOM_ID, &long, "thread-1", "turn-long").expect("identity");
    admit(&db, &id, "Inspect the release candidate.");
    let rpc = rpc(true);
    lock(&rpc.create_failures).push_back(crate::rooms::port::PortError::new("profile is gone"));
    let runtime = Spec::new(&rpc).build(&db);
    runtime.run_cycle().await;
    let view = task(&db, &id);
    assert_eq!(view.status, TaskStatus::Failed, "{view:?}");
    assert_eq!(view.execution_generation, 1);
    let settlement = view.settlement_id.unwrap_or_default();
    assert!(
        settlement.starts_with("failure:1:") && settlement.len() <= 128,
        "{settlement}"
    );
    assert_eq!(rpc.count("submit"), 0);
    // Short ids keep their readable form; distinct long ones stay distinct.
    use crate::rooms::supervisor::attempt_id;
    assert_eq!(attempt_id("reply", "task-1", 2), "reply:task-1:2");
    assert_ne!(
        attempt_id("reply", &format!("{long}a"), 2),
        attempt_id("reply", &format!("{long}b"), 2)
    );
}

/// A member that provably did not admit the session's opening leaves the task queued for a
/// later attempt (it is not failed, and nothing was submitted).
#[tokio::test]
async fn a_session_open_not_admitted_leaves_the_task_queued() {
    let (db, id) = one_queued_task();
    let rpc = rpc(true);
    lock(&rpc.create_failures).push_back(crate::rooms::port::PortError::not_admitted(
        "peer refused the connection",
    ));
    let clock = ManualClock::new(100.0);
    let mut spec = Spec::new(&rpc).manual(&clock);
    spec.config.unavailable_retry_min_seconds = 2.0;
    let runtime = spec.build(&db);
    runtime.run_cycle().await;
    assert_eq!(status(&db, &id), TaskStatus::Queued);
    assert_eq!(rpc.count("submit"), 0);
    clock.advance(2.0);
    runtime.run_cycle().await;
    assert_eq!(status(&db, &id), TaskStatus::Settled);
    assert_eq!(rpc.count("submit"), 1);
}

/// A submit answered with an error the member may have admitted anyway is never sent again:
/// the task stays running, observed, and settles with the member's turn.
#[tokio::test]
async fn an_ambiguous_submit_is_observed_and_never_resubmitted() {
    let (db, id) = one_queued_task();
    let rpc = rpc(false);
    rpc.ambiguous_submit_failures.store(1, Ordering::SeqCst);
    let runtime = Spec::new(&rpc).build(&db);
    runtime.start();
    wait_for("submitted", || rpc.count("submit") == 1).await;
    wait_for("the error reported", || {
        runtime
            .status()
            .last_error
            .is_some_and(|e| e.contains("observation failed after submit"))
    })
    .await;
    assert_eq!(status(&db, &id), TaskStatus::Running);
    rpc.complete("task-1", "done", "settled");
    wait_for("settled", || status(&db, &id) == TaskStatus::Settled).await;
    assert!(runtime.stop(STOP).await);
    assert_eq!(rpc.count("submit"), 1, "never sent again");
}

/// A member turn that ends `cancelled` while its task is still `running` (stopped by something
/// other than this room, such as the member's own drain) fails the task with that reason: the
/// attempt is over and never runs again. (The reference ignores such a report and leaves the
/// task to its deadline; this gateway settles it at once, as a graceful stop needs.)
#[tokio::test]
async fn a_member_turn_cancelled_elsewhere_fails_its_running_task() {
    let (db, id) = one_queued_task();
    let rpc = rpc(false);
    let runtime = Spec::new(&rpc).build(&db);
    runtime.start();
    wait_for("submitted", || rpc.count("submit") == 1).await;
    assert_eq!(status(&db, &id), TaskStatus::Running);
    rpc.complete("task-1", "", "cancelled");
    wait_for("failed", || status(&db, &id) == TaskStatus::Failed).await;
    assert!(runtime.stop(STOP).await);
    let view = task(&db, &id);
    let error = view
        .result
        .as_ref()
        .and_then(|r| r["error"].as_str())
        .unwrap_or_default()
        .to_string();
    assert!(
        error.contains("the member's turn was cancelled"),
        "{view:?}"
    );
    assert_eq!(rpc.count("submit"), 1, "never run again");
}

/// A manual clock that starts at the wall clock's time, which the tasks' admissions were
/// stamped with (`admit` and `two_rooms` use the system clock), so that it only moves when a
/// test moves it past a deadline or a lease's renewal point.
fn manual_clock_at_now() -> ManualClock {
    ManualClock::new(crate::clock::Clock::now(&SystemClock::default()))
}

/// A store with one room and its one task, `task-1`, queued.
fn one_queued_task() -> (TestDb, TaskIdentity) {
    let db = db();
    let id = identity("task-1");
    admit(&db, &id, "Inspect the release candidate.");
    (db, id)
}
