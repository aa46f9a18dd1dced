//! State-function tests: every transition of the room task table, with its fences (stale lease,
//! stale generation, authority change) and idempotent replays.

use diesel::prelude::*;

use crate::clock::{Clock, ManualClock};
use crate::rooms::testing::TestDb;
use crate::store::leases::{acquire_lease, release_lease, Lease};
use crate::store::room_tasks::*;
use crate::store::rooms::{begin_disband, claim_authority, RoomStoreError};

const ROOM: &str = "room-1";
const GW: &str = "gw-a";

fn identity(task: &str) -> TaskIdentity {
    TaskIdentity::new(ROOM, task, "thread-1", &format!("turn-{task}")).unwrap()
}

fn payload(seq: i64) -> TaskPayload {
    TaskPayload {
        target_profile: "ops".into(),
        prompt: "Inspect the release candidate.".into(),
        source_event_seq: seq,
        target_member_id: None,
    }
}

fn settlement(id: &str, text: &str) -> Settlement {
    Settlement {
        settlement_id: id.into(),
        status: SettlementStatus::Settled,
        result: serde_json::json!({ "message_id": id, "text": text }),
    }
}

struct Fixture {
    db: TestDb,
    clock: ManualClock,
}

impl Fixture {
    fn new() -> Self {
        Self {
            db: TestDb::with_room(ROOM, GW),
            clock: ManualClock::new(100.0),
        }
    }

    fn admit(&self, task: &str, seq: i64) -> TaskIdentity {
        let id = identity(task);
        admit_task(&mut self.db.conn(), &id, &payload(seq), &self.clock).unwrap();
        id
    }

    fn lease(&self, process: &str, ttl: f64) -> Lease {
        acquire_lease(&mut self.db.conn(), ROOM, GW, 1, process, ttl, &self.clock).unwrap()
    }

    fn start(&self, id: &TaskIdentity, lease: &Lease) -> TaskAttempt {
        let cancel = get_task(&mut self.db.conn(), id).unwrap().cancel_generation;
        start_task(&mut self.db.conn(), id, lease, cancel, &self.clock).unwrap()
    }

    fn get(&self, id: &TaskIdentity) -> TaskView {
        get_task(&mut self.db.conn(), id).unwrap()
    }

    /// An attempt started by an old process whose lease then expired, recovered by a new lease.
    fn indeterminate(&self, task: &str) -> (TaskIdentity, TaskAttempt, Lease) {
        let id = self.admit(task, 1);
        let old = self.lease("old-process", 1.0);
        let attempt = self.start(&id, &old);
        self.clock.advance(2.0);
        let lease = self.lease("new-process", 30.0);
        let report = recover_room(&mut self.db.conn(), &lease, &self.clock).unwrap();
        assert_eq!(report.indeterminate, vec![task.to_string()]);
        (id, attempt, lease)
    }
}

/// Every test ends with the counts the triggers keep equal to a count of the tasks.
impl Drop for Fixture {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            assert_kept_counts_are_true(&mut self.db.conn());
        }
    }
}

fn assert_kept_counts_are_true(c: &mut SqliteConnection) {
    use crate::store::rooms_schema::room_tasks;
    use std::collections::BTreeMap;
    let real: Vec<(String, String, i64)> = room_tasks::table
        .group_by((room_tasks::room_id, room_tasks::status))
        .select((
            room_tasks::room_id,
            room_tasks::status,
            diesel::dsl::count_star(),
        ))
        .load(c)
        .unwrap();
    let mut by_room = BTreeMap::<String, BTreeMap<String, i64>>::new();
    let mut all = BTreeMap::<String, i64>::new();
    for (room, status, n) in real {
        *all.entry(status.clone()).or_insert(0) += n;
        by_room.entry(room).or_default().insert(status, n);
    }
    for (room, counted) in by_room {
        assert_eq!(
            count_tasks_by_status(c, &room).unwrap(),
            counted,
            "room {room}"
        );
    }
    assert_eq!(count_all_tasks_by_status(c).unwrap(), all);
}

#[test]
fn kept_counts_follow_inserts_status_changes_and_a_rooms_cascade() {
    let f = Fixture::new();
    f.db.add_room("room-2", "ops", GW);
    f.admit("a", 1);
    let b = f.admit("b", 2);
    let other = TaskIdentity::new("room-2", "x", "thread-1", "turn-x").unwrap();
    admit_task(&mut f.db.conn(), &other, &payload(1), &f.clock).unwrap();
    let lease = f.lease("p", 30.0);
    let first = f.start(&identity("a"), &lease);
    settle_task(
        &mut f.db.conn(),
        &first,
        &settlement("s-a", "done"),
        &f.clock,
    )
    .unwrap();
    assert_eq!(
        count_tasks_by_status(&mut f.db.conn(), ROOM).unwrap(),
        [("queued".to_string(), 1), ("settled".to_string(), 1)].into()
    );
    assert_eq!(
        count_all_tasks_by_status(&mut f.db.conn()).unwrap(),
        [("queued".to_string(), 2), ("settled".to_string(), 1)].into()
    );
    cancel_task(&mut f.db.conn(), &b, "c-b", 0, &f.clock).unwrap();
    assert_kept_counts_are_true(&mut f.db.conn());
    // Deleting a room deletes its tasks, and their counts with them.
    use crate::store::rooms_schema::rooms;
    diesel::delete(rooms::table.find("room-2"))
        .execute(&mut f.db.conn())
        .unwrap();
    assert_eq!(
        count_all_tasks_by_status(&mut f.db.conn()).unwrap(),
        [("cancelled".to_string(), 1), ("settled".to_string(), 1)].into()
    );
}

#[test]
fn the_count_migration_counts_the_tasks_already_there() {
    use diesel_migrations::MigrationHarness;
    let (_dir, mut c) = crate::store::testing::conn_just_before("_room_task_counts");
    let clock = ManualClock::new(100.0);
    let members = vec![crate::store::rooms::RoomMember {
        profile: "ops".into(),
        handle: "ops".into(),
    }];
    crate::store::rooms::create_room(&mut c, ROOM, ROOM, &members, GW, &clock).unwrap();
    // Rows as that schema held them (today's admission writes tables it did not have).
    use diesel::connection::SimpleConnection;
    c.batch_execute(&format!(
        "INSERT INTO room_tasks (room_id, task_id, thread_id, turn_id, source_event_seq, \
           payload_json, payload_digest, status, created_at, updated_at) VALUES \
         ('{ROOM}', 'a', 'th', 'tu-a', 1, '{{}}', 'd', 'queued', 1.0, 1.0), \
         ('{ROOM}', 'b', 'th', 'tu-b', 2, '{{}}', 'd', 'queued', 1.0, 1.0), \
         ('{ROOM}', 'c', 'th', 'tu-c', 3, '{{}}', 'd', 'cancelled', 1.0, 1.0);"
    ))
    .unwrap();
    c.run_pending_migrations(crate::store::MIGRATIONS).unwrap();
    assert_eq!(
        count_tasks_by_status(&mut c, ROOM).unwrap(),
        [("cancelled".to_string(), 1), ("queued".to_string(), 2)].into()
    );
    assert_kept_counts_are_true(&mut c);
    // And its down migration (reached through the later ones' down migrations) takes the table
    // and its triggers away again.
    loop {
        let reverted = c.revert_last_migration(crate::store::MIGRATIONS).unwrap();
        if reverted.to_string() == "20261201000005" {
            break;
        }
    }
    let kept: i64 = diesel::dsl::sql::<diesel::sql_types::BigInt>(
        "SELECT count(*) FROM sqlite_schema WHERE name LIKE 'room_task_counts%'",
    )
    .get_result(&mut c)
    .unwrap();
    assert_eq!(kept, 0);
    c.batch_execute(&format!(
        "INSERT INTO room_tasks (room_id, task_id, thread_id, turn_id, source_event_seq, \
           payload_json, payload_digest, status, created_at, updated_at) VALUES \
         ('{ROOM}', 'd', 'th', 'tu-d', 4, '{{}}', 'd', 'queued', 1.0, 1.0);"
    ))
    .unwrap();
}

fn is_stale_task(result: Result<TaskView, RoomStoreError>) -> bool {
    matches!(result, Err(RoomStoreError::StaleTask(_)))
}

#[test]
fn admit_is_idempotent_by_identity_and_payload() {
    let f = Fixture::new();
    let id = f.admit("task-1", 1);
    let replay = admit_task(&mut f.db.conn(), &id, &payload(1), &f.clock).unwrap();
    assert!(replay.idempotent);
    assert_eq!(replay.status, TaskStatus::Queued);
    assert_eq!(
        (replay.execution_generation, replay.cancel_generation),
        (0, 0)
    );
    let mut other = payload(1);
    other.prompt = "Something else.".into();
    let err = admit_task(&mut f.db.conn(), &id, &other, &f.clock).unwrap_err();
    assert!(matches!(err, RoomStoreError::Conflict(ref m) if m.contains("different payload")));
    let reused_turn = TaskIdentity::new(ROOM, "task-2", "thread-1", "turn-task-1").unwrap();
    let err = admit_task(&mut f.db.conn(), &reused_turn, &payload(2), &f.clock).unwrap_err();
    assert!(matches!(err, RoomStoreError::Conflict(_)));
    let other_turn = TaskIdentity::new(ROOM, "task-1", "thread-1", "turn-x").unwrap();
    let err = admit_task(&mut f.db.conn(), &other_turn, &payload(1), &f.clock).unwrap_err();
    assert!(matches!(err, RoomStoreError::Conflict(ref m) if m.contains("different turn")));
}

#[test]
fn admit_validates_and_respects_the_disband_fence() {
    let f = Fixture::new();
    let mut blank = payload(1);
    blank.prompt = "   ".into();
    assert!(matches!(
        admit_task(&mut f.db.conn(), &identity("t"), &blank, &f.clock),
        Err(RoomStoreError::Validation(_))
    ));
    assert!(matches!(
        admit_task(&mut f.db.conn(), &identity("t"), &payload(0), &f.clock),
        Err(RoomStoreError::Validation(_))
    ));
    let unknown: Result<TaskPayload, _> = serde_json::from_value(serde_json::json!({
        "target_profile": "ops", "prompt": "x", "source_event_seq": 1, "model": "m"
    }));
    assert!(unknown.is_err());
    begin_disband(&mut f.db.conn(), ROOM, &f.clock).unwrap();
    assert!(matches!(
        admit_task(&mut f.db.conn(), &identity("t"), &payload(1), &f.clock),
        Err(RoomStoreError::RoomUnavailable(ref m)) if m.contains("being disbanded")
    ));
}

/// A page ends before the task that would take its stored prompts past the byte budget, with
/// one task at least, and goes on from there; the rows past the cut are never loaded.
#[test]
fn a_page_of_tasks_is_cut_by_the_bytes_it_holds() {
    let f = Fixture::new();
    for (task, seq) in [("a", 1), ("b", 2), ("c", 3)] {
        let mut p = payload(seq);
        p.prompt = task.repeat(100_000);
        admit_task(&mut f.db.conn(), &identity(task), &p, &f.clock).unwrap();
    }
    let page = |after: Option<&str>, max_bytes: i64| {
        let after = after.map(|t| TasksAfter::Task(t.into()));
        let (tasks, more) =
            list_tasks_page(&mut f.db.conn(), ROOM, None, after.as_ref(), 10, max_bytes).unwrap();
        let ids: Vec<String> = tasks.into_iter().map(|t| t.identity.task_id).collect();
        (ids, more)
    };
    assert_eq!(page(None, 250_000), (vec!["a".into(), "b".into()], true));
    assert_eq!(page(Some("b"), 250_000), (vec!["c".into()], false));
    // One task however large.
    assert_eq!(page(None, 1), (vec!["a".into()], true));
    assert_eq!(page(None, i64::MAX).0.len(), 3);
}

/// A page goes on from its cursor after the task it ended on has been pruned (by its id it is
/// refused, saying so); a cursor reads back its position exactly, and a made-up one is no cursor.
#[test]
fn a_page_of_tasks_goes_on_from_its_cursor_past_a_pruned_task() {
    let f = Fixture::new();
    for (task, seq) in [("a", 1), ("b", 2), ("c", 3)] {
        let id = f.admit(task, seq);
        if task == "b" {
            cancel_task(&mut f.db.conn(), &id, "c-b", 0, &f.clock).unwrap();
        }
        f.clock.advance(0.1);
    }
    let page = |after: Option<TasksAfter>| {
        list_tasks_page(&mut f.db.conn(), ROOM, None, after.as_ref(), 2, i64::MAX)
    };
    let (first, more) = page(None).unwrap();
    assert!(more);
    let last = first.last().unwrap();
    assert_eq!(last.identity.task_id, "b");
    let cursor = TaskPosition::of(last).cursor();
    assert_eq!(TaskPosition::parse(&cursor), Some(TaskPosition::of(last)));
    let retention = TaskRetention {
        max_age_seconds: 0.0,
        max_per_room: 0,
    };
    assert_eq!(
        prune_ended_tasks(&mut f.db.conn(), retention, f.clock.now(), 10)
            .unwrap()
            .deleted,
        1
    );
    let at = TaskPosition::parse(&cursor).map(TasksAfter::Position);
    let (rest, more) = page(at).unwrap();
    let ids: Vec<String> = rest.into_iter().map(|t| t.identity.task_id).collect();
    assert_eq!((ids, more), (vec!["c".to_string()], false));
    match page(Some(TasksAfter::Task("b".into()))) {
        Err(RoomStoreError::Validation(m)) => assert!(m.contains("next_cursor"), "{m}"),
        other => panic!("{other:?}"),
    }
    for bad in [
        "",
        "b",
        "t1.2.zz.b",
        "t1.2.0000000000000000.",
        "t2.2.0000000000000000.b",
    ] {
        assert_eq!(TaskPosition::parse(bad), None, "{bad}");
    }
}

#[test]
fn tasks_list_in_room_order_and_reads_verify_the_payload_digest() {
    let f = Fixture::new();
    f.admit("b-late", 2);
    f.admit("z-early", 1);
    let ids: Vec<String> = list_tasks(&mut f.db.conn(), ROOM, None)
        .unwrap()
        .into_iter()
        .map(|t| t.identity.task_id)
        .collect();
    assert_eq!(ids, vec!["z-early", "b-late"]);
    let counts = count_tasks_by_status(&mut f.db.conn(), ROOM).unwrap();
    assert_eq!(counts.get("queued"), Some(&2));
    use crate::store::rooms_schema::room_tasks;
    diesel::update(room_tasks::table.find((ROOM, "b-late")))
        .set(room_tasks::payload_digest.eq("0".repeat(64)))
        .execute(&mut f.db.conn())
        .unwrap();
    assert!(matches!(
        get_task(&mut f.db.conn(), &identity("b-late")),
        Err(RoomStoreError::Corrupt(ref m)) if m.contains("integrity")
    ));
}

#[test]
fn start_requires_the_head_of_room_order_and_nothing_blocking() {
    let f = Fixture::new();
    let first = f.admit("task-1", 1);
    let second = f.admit("task-2", 2);
    let lease = f.lease("proc", 30.0);
    let err = start_task(&mut f.db.conn(), &second, &lease, 0, &f.clock).unwrap_err();
    assert!(matches!(err, RoomStoreError::InvalidTransition(ref m) if m.contains("event order")));
    let err = start_task(&mut f.db.conn(), &first, &lease, 1, &f.clock).unwrap_err();
    assert!(matches!(err, RoomStoreError::StaleTask(_)));
    let attempt = start_task(&mut f.db.conn(), &first, &lease, 0, &f.clock).unwrap();
    assert_eq!(attempt.execution_generation, 1);
    let view = f.get(&first);
    assert_eq!(view.status, TaskStatus::Running);
    assert_eq!(view.run_lease_generation, Some(lease.lease_generation));
    let err = start_task(&mut f.db.conn(), &first, &lease, 0, &f.clock).unwrap_err();
    assert!(
        matches!(err, RoomStoreError::InvalidTransition(ref m) if m.contains("cannot start task in state 'running'"))
    );
    let err = start_task(&mut f.db.conn(), &second, &lease, 0, &f.clock).unwrap_err();
    assert!(
        matches!(err, RoomStoreError::InvalidTransition(ref m) if m.contains("recovery must resolve"))
    );
}

/// A task earlier in the room that is indeterminate, then stopping, blocks the next start as a
/// running one does (only the running case was tested).
#[test]
fn an_indeterminate_or_stopping_task_blocks_the_next_start() {
    let f = Fixture::new();
    let (first, _attempt, lease) = f.indeterminate("task-1");
    let second = f.admit("task-2", 2);
    let refused = |f: &Fixture, what: &str| {
        let err = start_task(&mut f.db.conn(), &second, &lease, 0, &f.clock).unwrap_err();
        assert!(
            matches!(err, RoomStoreError::InvalidTransition(ref m) if m.contains("recovery must resolve")),
            "{what}: {err:?}"
        );
    };
    refused(&f, "indeterminate");
    let stopping = begin_task_cancel(&mut f.db.conn(), &first, "cancel-1", 0, &f.clock).unwrap();
    assert_eq!(stopping.status, TaskStatus::Stopping);
    refused(&f, "stopping");
    complete_task_cancel(&mut f.db.conn(), &first, "cancel-1", 1, &f.clock).unwrap();
    let attempt = start_task(&mut f.db.conn(), &second, &lease, 0, &f.clock).unwrap();
    assert_eq!(attempt.identity, second);
}

#[test]
fn start_needs_an_active_lease_and_no_disband_fence() {
    let f = Fixture::new();
    let id = f.admit("task-1", 1);
    let lease = f.lease("proc", 1.0);
    f.clock.advance(5.0);
    assert!(matches!(
        start_task(&mut f.db.conn(), &id, &lease, 0, &f.clock),
        Err(RoomStoreError::StaleLease(_))
    ));
    let lease = f.lease("proc", 30.0);
    begin_disband(&mut f.db.conn(), ROOM, &f.clock).unwrap();
    assert!(matches!(
        start_task(&mut f.db.conn(), &id, &lease, 0, &f.clock),
        Err(RoomStoreError::RoomUnavailable(_))
    ));
}

#[test]
fn settle_commits_once_replays_identically_and_conflicts_otherwise() {
    let f = Fixture::new();
    let id = f.admit("task-1", 1);
    let lease = f.lease("proc", 30.0);
    let attempt = f.start(&id, &lease);
    let settled = settle_task(
        &mut f.db.conn(),
        &attempt,
        &settlement("reply-1", "done"),
        &f.clock,
    )
    .unwrap();
    assert_eq!(settled.status, TaskStatus::Settled);
    assert!(!settled.idempotent);
    assert_eq!(settled.result.as_ref().unwrap()["text"], "done");
    let replay = settle_task(
        &mut f.db.conn(),
        &attempt,
        &settlement("reply-1", "done"),
        &f.clock,
    )
    .unwrap();
    assert!(replay.idempotent);
    let err = settle_task(
        &mut f.db.conn(),
        &attempt,
        &settlement("reply-1", "other"),
        &f.clock,
    )
    .unwrap_err();
    assert!(
        matches!(err, RoomStoreError::Conflict(ref m) if m.contains("different terminal settlement"))
    );
    // an identical replay succeeds even after the lease moved on
    f.clock.advance(60.0);
    let replay = settle_task(
        &mut f.db.conn(),
        &attempt,
        &settlement("reply-1", "done"),
        &f.clock,
    )
    .unwrap();
    assert!(replay.idempotent);
    // release is allowed once nothing runs
    let lease = f.lease("proc", 30.0);
    release_lease(&mut f.db.conn(), &lease, &f.clock).unwrap();
}

#[test]
fn settle_is_fenced_by_generation_lease_and_authority() {
    let f = Fixture::new();
    let id = f.admit("task-1", 1);
    let lease = f.lease("proc", 30.0);
    let attempt = f.start(&id, &lease);
    let mut old_gen = attempt.clone();
    old_gen.execution_generation = 0;
    assert!(is_stale_task(settle_task(
        &mut f.db.conn(),
        &old_gen,
        &settlement("r", "x"),
        &f.clock
    )));
    let err = release_lease(&mut f.db.conn(), &lease, &f.clock).unwrap_err();
    assert!(
        matches!(err, RoomStoreError::InvalidTransition(ref m) if m.contains("tasks are running"))
    );
    claim_authority(&mut f.db.conn(), ROOM, GW, 1, "gw-b", "claim-1", &f.clock).unwrap();
    let err = settle_task(&mut f.db.conn(), &attempt, &settlement("r", "x"), &f.clock).unwrap_err();
    assert!(matches!(err, RoomStoreError::StaleLease(ref m) if m.contains("authority changed")));
    assert_eq!(f.get(&id).status, TaskStatus::Running);
}

#[test]
fn settle_with_an_expired_or_replaced_lease_is_stale() {
    let f = Fixture::new();
    let id = f.admit("task-1", 1);
    let lease = f.lease("proc-a", 1.0);
    let attempt = f.start(&id, &lease);
    f.clock.advance(2.0);
    let err = settle_task(&mut f.db.conn(), &attempt, &settlement("r", "x"), &f.clock).unwrap_err();
    assert!(matches!(err, RoomStoreError::StaleLease(ref m) if m.contains("stale or expired")));
    let new = f.lease("proc-b", 30.0);
    assert_eq!(new.lease_generation, 2);
    let mut under_new = attempt.clone();
    under_new.lease = new;
    // the run fence still names the old lease
    assert!(is_stale_task(settle_task(
        &mut f.db.conn(),
        &under_new,
        &settlement("r", "x"),
        &f.clock
    )));
}

#[test]
fn not_admitted_attempt_requeues_with_its_generation() {
    let f = Fixture::new();
    let id = f.admit("task-1", 1);
    let lease = f.lease("proc", 30.0);
    let attempt = f.start(&id, &lease);
    let queued = requeue_not_admitted_task(&mut f.db.conn(), &attempt, &f.clock).unwrap();
    assert_eq!(queued.status, TaskStatus::Queued);
    assert_eq!(queued.execution_generation, 1);
    assert_eq!(queued.run_gateway_id, None);
    assert!(
        requeue_not_admitted_task(&mut f.db.conn(), &attempt, &f.clock)
            .unwrap()
            .idempotent
    );
    let next = f.start(&id, &lease);
    assert_eq!(next.execution_generation, 2);
    assert!(matches!(
        requeue_not_admitted_task(&mut f.db.conn(), &attempt, &f.clock),
        Err(RoomStoreError::StaleTask(ref m)) if m.contains("lost its fence")
    ));
}

/// An attempt its member never admitted is put back while its room is being disbanded, and the
/// disband then cancels it directly: refused, it stayed running with nothing behind it, and the
/// disband's cancel made it a stop only the member could acknowledge.
#[test]
fn a_not_admitted_attempt_is_put_back_while_its_room_is_disbanded() {
    let f = Fixture::new();
    let id = f.admit("task-1", 1);
    let lease = f.lease("proc", 30.0);
    let attempt = f.start(&id, &lease);
    begin_disband(&mut f.db.conn(), ROOM, &f.clock).unwrap();
    let queued = requeue_not_admitted_task(&mut f.db.conn(), &attempt, &f.clock).unwrap();
    assert_eq!(queued.status, TaskStatus::Queued);
    let cancelled = cancel_task(&mut f.db.conn(), &id, "disband", 0, &f.clock).unwrap();
    assert_eq!(cancelled.status, TaskStatus::Cancelled);
    // Nothing starts it again meanwhile.
    assert!(matches!(
        start_task(&mut f.db.conn(), &id, &lease, 0, &f.clock),
        Err(RoomStoreError::RoomUnavailable(_)) | Err(RoomStoreError::InvalidTransition(_))
    ));
}

#[test]
fn queued_and_deferred_tasks_cancel_directly() {
    let f = Fixture::new();
    let id = f.admit("task-1", 1);
    let cancelled = cancel_task(&mut f.db.conn(), &id, "cancel-1", 0, &f.clock).unwrap();
    assert_eq!(cancelled.status, TaskStatus::Cancelled);
    assert_eq!(cancelled.cancel_generation, 1);
    assert!(
        cancel_task(&mut f.db.conn(), &id, "cancel-1", 0, &f.clock)
            .unwrap()
            .idempotent
    );
    assert!(matches!(
        cancel_task(&mut f.db.conn(), &id, "cancel-2", 1, &f.clock),
        Err(RoomStoreError::InvalidTransition(ref m)) if m.contains("cannot cancel task in state 'cancelled'")
    ));
    let f = Fixture::new();
    let (id, attempt, lease) = f.indeterminate("task-2");
    defer_indeterminate_task(
        &mut f.db.conn(),
        &id,
        &lease,
        attempt.execution_generation,
        0,
        "member_unavailable",
        &f.clock,
    )
    .unwrap();
    assert!(matches!(
        cancel_task(&mut f.db.conn(), &id, "cancel-1", 1, &f.clock),
        Err(RoomStoreError::StaleTask(_))
    ));
    let cancelled = cancel_task(&mut f.db.conn(), &id, "cancel-1", 0, &f.clock).unwrap();
    assert_eq!(cancelled.status, TaskStatus::Cancelled);
}

#[test]
fn running_work_needs_two_phase_cancellation() {
    let f = Fixture::new();
    let id = f.admit("task-1", 1);
    let lease = f.lease("proc", 30.0);
    let attempt = f.start(&id, &lease);
    assert!(matches!(
        cancel_task(&mut f.db.conn(), &id, "cancel-1", 0, &f.clock),
        Err(RoomStoreError::InvalidTransition(ref m)) if m.contains("two-phase")
    ));
    assert!(matches!(
        begin_task_cancel(&mut f.db.conn(), &id, "cancel-1", 5, &f.clock),
        Err(RoomStoreError::StaleTask(_))
    ));
    let stopping = begin_task_cancel(&mut f.db.conn(), &id, "cancel-1", 0, &f.clock).unwrap();
    assert_eq!(stopping.status, TaskStatus::Stopping);
    assert_eq!(stopping.cancel_generation, 1);
    assert_eq!(stopping.execution_generation, 1);
    assert!(
        begin_task_cancel(&mut f.db.conn(), &id, "cancel-1", 0, &f.clock)
            .unwrap()
            .idempotent
    );
    // the running attempt can no longer settle normally
    assert!(is_stale_task(settle_task(
        &mut f.db.conn(),
        &attempt,
        &settlement("r", "x"),
        &f.clock
    )));
    assert!(matches!(
        complete_task_cancel(&mut f.db.conn(), &id, "cancel-other", 1, &f.clock),
        Err(RoomStoreError::StaleTask(ref m)) if m.contains("stale")
    ));
    let cancelled = complete_task_cancel(&mut f.db.conn(), &id, "cancel-1", 1, &f.clock).unwrap();
    assert_eq!(cancelled.status, TaskStatus::Cancelled);
    assert!(
        complete_task_cancel(&mut f.db.conn(), &id, "cancel-1", 1, &f.clock)
            .unwrap()
            .idempotent
    );
    let queued = f.admit("task-2", 2);
    assert!(matches!(
        begin_task_cancel(&mut f.db.conn(), &queued, "cancel-2", 0, &f.clock),
        Err(RoomStoreError::InvalidTransition(ref m)) if m.contains("cannot request remote stop in state 'queued'")
    ));
}

/// A deadline stops the attempt it timed only: a stop asked for another attempt than the one
/// running is stale and leaves the task running (a requeue keeps the cancel generation, so
/// that alone let a late deadline of attempt g stop attempt g + 1).
#[test]
fn an_attempt_stop_stops_that_attempt_only() {
    let f = Fixture::new();
    let id = f.admit("task-1", 1);
    let lease = f.lease("proc", 30.0);
    let attempt = f.start(&id, &lease);
    let running = attempt.execution_generation;
    assert!(is_stale_task(begin_task_stop(
        &mut f.db.conn(),
        &id,
        "deadline:other",
        0,
        Some(running + 1),
        &f.clock
    )));
    let task = get_task(&mut f.db.conn(), &id).unwrap();
    assert_eq!(task.status, TaskStatus::Running);
    assert_eq!(task.cancel_generation, 0);
    let stopping = begin_task_stop(
        &mut f.db.conn(),
        &id,
        "deadline:this",
        0,
        Some(running),
        &f.clock,
    )
    .unwrap();
    assert_eq!(stopping.status, TaskStatus::Stopping);
    assert_eq!(stopping.execution_generation, running);
}

#[test]
fn completion_wins_an_unacknowledged_stop() {
    let f = Fixture::new();
    let id = f.admit("task-1", 1);
    let lease = f.lease("proc", 30.0);
    f.start(&id, &lease);
    begin_task_cancel(&mut f.db.conn(), &id, "cancel-1", 0, &f.clock).unwrap();
    assert!(matches!(
        settle_stopping_task(&mut f.db.conn(), &id, &lease, 1, 0, &settlement("r", "x"), &f.clock),
        Err(RoomStoreError::Validation(ref m)) if m.contains("generations are invalid")
    ));
    assert!(is_stale_task(settle_stopping_task(
        &mut f.db.conn(),
        &id,
        &lease,
        2,
        1,
        &settlement("r", "x"),
        &f.clock
    )));
    let settled = settle_stopping_task(
        &mut f.db.conn(),
        &id,
        &lease,
        1,
        1,
        &settlement("r", "x"),
        &f.clock,
    )
    .unwrap();
    assert_eq!(settled.status, TaskStatus::Settled);
    assert!(
        settle_stopping_task(
            &mut f.db.conn(),
            &id,
            &lease,
            1,
            1,
            &settlement("r", "x"),
            &f.clock
        )
        .unwrap()
        .idempotent
    );
    assert!(matches!(
        complete_task_cancel(&mut f.db.conn(), &id, "cancel-1", 1, &f.clock),
        Err(RoomStoreError::StaleTask(_))
    ));
}

#[test]
fn recovery_marks_only_attempts_of_other_leases_indeterminate() {
    let f = Fixture::new();
    let id = f.admit("task-1", 1);
    let lease = f.lease("proc", 30.0);
    f.start(&id, &lease);
    let report = recover_room(&mut f.db.conn(), &lease, &f.clock).unwrap();
    assert!(report.indeterminate.is_empty());
    assert_eq!(f.get(&id).status, TaskStatus::Running);
    let f = Fixture::new();
    let (id, _attempt, lease) = f.indeterminate("task-1");
    let view = f.get(&id);
    assert_eq!(view.status, TaskStatus::Indeterminate);
    assert_eq!(view.indeterminate_at, Some(102.0));
    assert!(
        recover_room(&mut f.db.conn(), &lease, &f.clock)
            .unwrap()
            .indeterminate
            == vec!["task-1".to_string()]
    );
}

#[test]
fn indeterminate_resolves_with_the_exact_generation() {
    let f = Fixture::new();
    let (id, attempt, lease) = f.indeterminate("task-1");
    let gen = attempt.execution_generation;
    assert!(matches!(
        resolve_indeterminate_task(&mut f.db.conn(), &id, &lease, gen + 1, 0, &settlement("r", "x"), &f.clock),
        Err(RoomStoreError::StaleTask(ref m)) if m.contains("indeterminate task generation changed")
    ));
    let settled = resolve_indeterminate_task(
        &mut f.db.conn(),
        &id,
        &lease,
        gen,
        0,
        &settlement("r", "x"),
        &f.clock,
    )
    .unwrap();
    assert_eq!(settled.status, TaskStatus::Settled);
    assert!(
        resolve_indeterminate_task(
            &mut f.db.conn(),
            &id,
            &lease,
            gen,
            0,
            &settlement("r", "x"),
            &f.clock
        )
        .unwrap()
        .idempotent
    );
}

#[test]
fn indeterminate_resolves_as_remote_cancellation() {
    let f = Fixture::new();
    let (id, attempt, lease) = f.indeterminate("task-1");
    let gen = attempt.execution_generation;
    let cancelled = resolve_indeterminate_cancellation(
        &mut f.db.conn(),
        &id,
        &lease,
        gen,
        0,
        "remote-cancel:1",
        &f.clock,
    )
    .unwrap();
    assert_eq!(cancelled.status, TaskStatus::Cancelled);
    assert_eq!(cancelled.execution_generation, gen);
    assert_eq!(cancelled.cancel_generation, 1);
    assert!(
        resolve_indeterminate_cancellation(
            &mut f.db.conn(),
            &id,
            &lease,
            gen,
            0,
            "remote-cancel:1",
            &f.clock
        )
        .unwrap()
        .idempotent
    );
}

#[test]
fn indeterminate_requeues_once_and_the_next_start_is_a_new_generation() {
    let f = Fixture::new();
    let (id, attempt, lease) = f.indeterminate("task-1");
    let gen = attempt.execution_generation;
    let other_room_lease = Lease {
        room_id: "room-2".into(),
        ..lease.clone()
    };
    assert!(matches!(
        requeue_indeterminate_task(&mut f.db.conn(), &id, &other_room_lease, gen, 0, &f.clock),
        Err(RoomStoreError::Validation(ref m)) if m.contains("different rooms")
    ));
    let queued =
        requeue_indeterminate_task(&mut f.db.conn(), &id, &lease, gen, 0, &f.clock).unwrap();
    assert_eq!(queued.status, TaskStatus::Queued);
    assert_eq!(queued.indeterminate_at, None);
    assert!(is_stale_task(requeue_indeterminate_task(
        &mut f.db.conn(),
        &id,
        &lease,
        gen,
        0,
        &f.clock
    )));
    let next = f.start(&id, &lease);
    assert_eq!(next.execution_generation, gen + 1);
    // the old attempt's late receipt is fenced, even under the current lease
    let late = TaskAttempt {
        lease: lease.clone(),
        ..attempt.clone()
    };
    assert!(is_stale_task(settle_task(
        &mut f.db.conn(),
        &late,
        &settlement("late", "x"),
        &f.clock
    )));
    assert!(matches!(
        settle_task(
            &mut f.db.conn(),
            &attempt,
            &settlement("late", "x"),
            &f.clock
        ),
        Err(RoomStoreError::StaleLease(_))
    ));
}

#[test]
fn indeterminate_defers_then_requeues_or_resolves() {
    let f = Fixture::new();
    let (id, attempt, lease) = f.indeterminate("task-1");
    let gen = attempt.execution_generation;
    let deferred = defer_indeterminate_task(
        &mut f.db.conn(),
        &id,
        &lease,
        gen,
        0,
        "member_unavailable",
        &f.clock,
    )
    .unwrap();
    assert_eq!(deferred.status, TaskStatus::Deferred);
    assert_eq!(
        deferred.result,
        Some(serde_json::json!({"reason": "member_unavailable", "retryable": true}))
    );
    assert!(
        defer_indeterminate_task(
            &mut f.db.conn(),
            &id,
            &lease,
            gen,
            0,
            "member_unavailable",
            &f.clock
        )
        .unwrap()
        .idempotent
    );
    // a deferred task does not block later work
    let later = f.admit("task-2", 2);
    f.start(&later, &lease);
    let later_view = f.get(&later);
    assert_eq!(later_view.status, TaskStatus::Running);
    let settled = resolve_deferred_completion(
        &mut f.db.conn(),
        &id,
        &lease,
        gen,
        0,
        &settlement("r", "x"),
        &f.clock,
    )
    .unwrap();
    assert_eq!(settled.status, TaskStatus::Settled);

    let f = Fixture::new();
    let (id, attempt, lease) = f.indeterminate("task-1");
    let gen = attempt.execution_generation;
    defer_indeterminate_task(
        &mut f.db.conn(),
        &id,
        &lease,
        gen,
        0,
        "member_unavailable",
        &f.clock,
    )
    .unwrap();
    assert!(matches!(
        requeue_deferred_task(&mut f.db.conn(), &id, &lease, gen + 1, 0, &f.clock),
        Err(RoomStoreError::StaleTask(ref m)) if m.contains("deferred task generation changed")
    ));
    let queued = requeue_deferred_task(&mut f.db.conn(), &id, &lease, gen, 0, &f.clock).unwrap();
    assert_eq!(queued.status, TaskStatus::Queued);
    assert_eq!(queued.result, None);
    assert_eq!(queued.terminal_at, None);
}

#[test]
fn recovery_family_checks_the_lease_first() {
    let f = Fixture::new();
    let (id, attempt, lease) = f.indeterminate("task-1");
    let gen = attempt.execution_generation;
    claim_authority(&mut f.db.conn(), ROOM, GW, 1, "gw-b", "claim-1", &f.clock).unwrap();
    let err =
        requeue_indeterminate_task(&mut f.db.conn(), &id, &lease, gen, 0, &f.clock).unwrap_err();
    assert!(matches!(err, RoomStoreError::StaleLease(ref m) if m.contains("authority changed")));
    let err = defer_indeterminate_task(
        &mut f.db.conn(),
        &id,
        &lease,
        gen,
        0,
        "member_unavailable",
        &f.clock,
    )
    .unwrap_err();
    assert!(matches!(err, RoomStoreError::StaleLease(_)));
    let err = recover_room(&mut f.db.conn(), &lease, &f.clock).unwrap_err();
    assert!(matches!(err, RoomStoreError::StaleLease(_)));
}

#[test]
fn indeterminate_work_can_be_stopped_two_phase() {
    let f = Fixture::new();
    let (id, _attempt, _lease) = f.indeterminate("task-1");
    let stopping = begin_task_cancel(&mut f.db.conn(), &id, "cancel-1", 0, &f.clock).unwrap();
    assert_eq!(stopping.status, TaskStatus::Stopping);
    let cancelled = complete_task_cancel(&mut f.db.conn(), &id, "cancel-1", 1, &f.clock).unwrap();
    assert_eq!(cancelled.status, TaskStatus::Cancelled);
}

/// Ended tasks are pruned by age (since they ended) and past the newest a room keeps, oldest
/// first and within the bound per transaction; work that has not ended (queued, running,
/// indeterminate, deferred) is never touched, however old; the kept counts stay true; a pruned
/// task's id can be admitted again.
#[test]
fn ended_tasks_are_pruned_by_age_and_count_and_nothing_else_is() {
    let f = Fixture::new();
    let (deferred, _, lease) = f.indeterminate("deferred");
    defer_indeterminate_task(&mut f.db.conn(), &deferred, &lease, 1, 0, "gone", &f.clock).unwrap();
    // Five tasks end one second apart: e1 (oldest) .. e5 (newest), settled and cancelled.
    let mut ended = Vec::new();
    for i in 1..=5 {
        let id = f.admit(&format!("e{i}"), 10 + i);
        if i % 2 == 0 {
            cancel_task(&mut f.db.conn(), &id, &format!("c{i}"), 0, &f.clock).unwrap();
        } else {
            let attempt = f.start(&id, &lease);
            settle_task(
                &mut f.db.conn(),
                &attempt,
                &settlement(&format!("s{i}"), "ok"),
                &f.clock,
            )
            .unwrap();
        }
        ended.push(id);
        f.clock.advance(1.0);
    }
    let running_id = f.admit("running", 20);
    f.start(&running_id, &lease);
    let queued = f.admit("queued", 21);
    f.clock.advance(1000.0);
    let left = |f: &Fixture| -> Vec<String> {
        list_tasks(&mut f.db.conn(), ROOM, None)
            .unwrap()
            .into_iter()
            .map(|t| t.identity.task_id)
            .collect()
    };
    let prune = |f: &Fixture, age: f64, keep: i64, limit: usize| {
        let retention = TaskRetention {
            max_age_seconds: age,
            max_per_room: keep,
        };
        prune_ended_tasks(&mut f.db.conn(), retention, f.clock.now(), limit).unwrap()
    };

    // Nothing is old enough and the room is under its count: nothing goes.
    assert_eq!(prune(&f, 1e6, 10, 100), PrunedTasks::default());
    // Keep the newest three ended tasks, in bounded transactions: the two oldest go.
    assert_eq!(
        prune(&f, 0.0, 3, 1),
        PrunedTasks {
            deleted: 1,
            more: true
        }
    );
    assert_eq!(prune(&f, 0.0, 3, 100).deleted, 1);
    let mut kept = left(&f);
    kept.sort();
    assert_eq!(kept, ["deferred", "e3", "e4", "e5", "queued", "running"]);
    // By age: what ended more than 1001.5 s ago (e3 1003 s ago, e4 1002 s, e5 1001 s).
    assert_eq!(prune(&f, 1001.5, 10, 100).deleted, 2);
    let mut kept = left(&f);
    kept.sort();
    assert_eq!(kept, ["deferred", "e5", "queued", "running"]);
    // With a tiny age, every ended task goes; the rest stays.
    assert_eq!(prune(&f, 0.001, 10, 100).deleted, 1);
    let mut kept = left(&f);
    kept.sort();
    assert_eq!(kept, ["deferred", "queued", "running"]);
    assert_eq!(f.get(&queued).status, TaskStatus::Queued);
    // Only a task that made an attempt leaves a tombstone: one cancelled while queued leaves
    // none (a loop of admits and cancels grew the table without bound).
    assert_eq!(tombstones(&f), ["e1", "e3", "e5"]);
    // A pruned id is a new task, whose attempts go on from the pruned task's generations (the
    // next starts at the one after): a settled e1 ran attempt 1, a cancelled e2 none.
    let again = admit_task(&mut f.db.conn(), &ended[0], &payload(11), &f.clock).unwrap();
    assert!(!again.idempotent);
    assert_eq!(again.status, TaskStatus::Queued);
    assert_eq!(again.execution_generation, 1);
    let fresh = admit_task(&mut f.db.conn(), &ended[1], &payload(12), &f.clock).unwrap();
    assert_eq!(fresh.execution_generation, 0);
}

/// The task ids the fixture's room keeps tombstones of, in order.
fn tombstones(f: &Fixture) -> Vec<String> {
    use crate::store::rooms_schema::room_task_tombstones as t;
    t::table
        .filter(t::room_id.eq(ROOM))
        .select(t::task_id)
        .order(t::task_id.asc())
        .load(&mut f.db.conn())
        .unwrap()
}

/// A retired room's tombstones go with its retirement, and its tasks pruned later leave none:
/// its id admits nothing again.
#[test]
fn a_retired_room_keeps_no_tombstones() {
    let f = Fixture::new();
    let lease = f.lease("proc", 30.0);
    let (first, second) = (f.admit("t1", 1), f.admit("t2", 2));
    for id in [&first, &second] {
        let attempt = f.start(id, &lease);
        settle_task(
            &mut f.db.conn(),
            &attempt,
            &settlement(&id.task_id, "ok"),
            &f.clock,
        )
        .unwrap();
    }
    let retention = TaskRetention {
        max_age_seconds: 0.0,
        max_per_room: 1,
    };
    prune_ended_tasks(&mut f.db.conn(), retention, f.clock.now(), 100).unwrap();
    assert_eq!(tombstones(&f), ["t1"]);
    begin_disband(&mut f.db.conn(), ROOM, &f.clock).unwrap();
    crate::store::rooms::disband_room(&mut f.db.conn(), ROOM, &f.clock).unwrap();
    assert!(tombstones(&f).is_empty());
    let retention = TaskRetention {
        max_age_seconds: 0.0,
        max_per_room: 0,
    };
    prune_ended_tasks(&mut f.db.conn(), retention, f.clock.now(), 100).unwrap();
    assert!(list_tasks(&mut f.db.conn(), ROOM, None).unwrap().is_empty());
    assert!(tombstones(&f).is_empty());
}

/// Pruning walks a room's ended tasks through their index, in the order they ended: never a
/// scan of the table, nor a sort.
#[test]
fn pruning_reads_a_rooms_ended_tasks_through_their_index() {
    let f = Fixture::new();
    for sql in [PRUNE_OLDEST_SQL, PRUNE_AGED_SQL] {
        let plan = crate::store::testing::query_plan(&mut f.db.conn(), sql).join(" | ");
        assert!(plan.contains("USING INDEX room_tasks_ended"), "{plan}");
        assert!(!plan.contains("SCAN room_tasks"), "{plan}");
        assert!(!plan.contains("TEMP B-TREE"), "{plan}");
    }
}

/// A room is retired only once every task in it has ended: a queued or deferred task whose
/// cancel the disband could not make would otherwise be left in a retired room, never to run
/// nor to end.
#[test]
fn a_room_is_not_retired_with_a_task_that_has_not_ended() {
    let f = Fixture::new();
    let (deferred, _, lease) = f.indeterminate("deferred");
    defer_indeterminate_task(&mut f.db.conn(), &deferred, &lease, 1, 0, "gone", &f.clock).unwrap();
    let queued = f.admit("queued", 2);
    crate::store::rooms::begin_disband(&mut f.db.conn(), ROOM, &f.clock).unwrap();
    let refused = crate::store::rooms::disband_room(&mut f.db.conn(), ROOM, &f.clock);
    assert!(
        matches!(refused, Err(RoomStoreError::InvalidTransition(ref m)) if m.contains("not ended")),
        "{refused:?}"
    );
    cancel_task(&mut f.db.conn(), &queued, "disband", 0, &f.clock).unwrap();
    let refused = crate::store::rooms::disband_room(&mut f.db.conn(), ROOM, &f.clock);
    assert!(refused.is_err(), "a deferred task is left: {refused:?}");
    let cancel = f.get(&deferred).cancel_generation;
    cancel_task(&mut f.db.conn(), &deferred, "disband", cancel, &f.clock).unwrap();
    let retired = crate::store::rooms::disband_room(&mut f.db.conn(), ROOM, &f.clock).unwrap();
    assert!(retired.disbanded_at.is_some());
}
