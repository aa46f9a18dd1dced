//! Room tasks: one member's turn in a room, and every transition of its state machine.
//!
//! Statuses: queued → running → settled | failed, with stopping (a durable stop intent),
//! indeterminate (an abandoned attempt nobody can vouch for), deferred (parked, retryable) and
//! cancelled. Each function is one transaction ([`crate::store::write_tx`]: `BEGIN IMMEDIATE`, or a
//! savepoint of the writer's group commit): load, replay check, lease check, guard, then a
//! compare-and-swap `UPDATE … WHERE <fence>` that must touch exactly one row.

use std::fmt;

use diesel::prelude::*;
use diesel::sqlite::SqliteConnection;
use serde::{Deserialize, Serialize};

use crate::clock::Clock;
use crate::store::leases::{check_active_lease, Lease};
use crate::store::rooms::{
    canonical_json, live_room, read_clock, sha256_hex, validate_identifier, RoomStoreError,
    StoreResult,
};
use crate::store::rooms_schema::{room_members, room_task_tombstones, room_tasks};

/// Largest prompt, in UTF-8 bytes.
pub const MAX_PROMPT_BYTES: usize = 128 * 1024;
/// Largest stored result, in canonical JSON bytes.
/// The longest result stored: a 64 KiB reply and a 4 KiB error whose every character is a control
/// character (six bytes inside a JSON string), with room to spare.
pub const MAX_RESULT_BYTES: usize = 512 * 1024;

/// The identity of one room task (one member's turn).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct TaskIdentity {
    pub room_id: String,
    pub task_id: String,
    pub thread_id: String,
    pub turn_id: String,
}

impl TaskIdentity {
    /// Build a validated identity.
    pub fn new(room_id: &str, task_id: &str, thread_id: &str, turn_id: &str) -> StoreResult<Self> {
        Ok(Self {
            room_id: validate_identifier("room_id", room_id)?,
            task_id: validate_identifier("task_id", task_id)?,
            thread_id: validate_identifier("thread_id", thread_id)?,
            turn_id: validate_identifier("turn_id", turn_id)?,
        })
    }

    fn validated(&self) -> StoreResult<Self> {
        Self::new(&self.room_id, &self.task_id, &self.thread_id, &self.turn_id)
    }
}

/// What the task asks a member to do.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TaskPayload {
    pub target_profile: String,
    pub prompt: String,
    pub source_event_seq: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_member_id: Option<String>,
}

impl TaskPayload {
    fn normalized(&self) -> StoreResult<Self> {
        if self.prompt.trim().is_empty() {
            return Err(RoomStoreError::Validation(
                "prompt must not be blank".into(),
            ));
        }
        if self.prompt.len() > MAX_PROMPT_BYTES {
            return Err(RoomStoreError::Validation("prompt is too large".into()));
        }
        if self.source_event_seq < 1 {
            return Err(RoomStoreError::Validation(
                "source_event_seq must be a positive integer".into(),
            ));
        }
        Ok(Self {
            target_profile: validate_identifier("target_profile", &self.target_profile)?,
            prompt: self.prompt.clone(),
            source_event_seq: self.source_event_seq,
            target_member_id: match &self.target_member_id {
                Some(id) => Some(validate_identifier("target_member_id", id)?),
                None => None,
            },
        })
    }

    /// The member a task addresses: its member id, else its profile.
    pub fn member_id(&self) -> &str {
        self.target_member_id
            .as_deref()
            .unwrap_or(&self.target_profile)
    }
}

/// Task statuses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TaskStatus {
    Queued,
    Running,
    Stopping,
    Settled,
    Failed,
    Cancelled,
    Indeterminate,
    Deferred,
}

impl TaskStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Queued => "queued",
            Self::Running => "running",
            Self::Stopping => "stopping",
            Self::Settled => "settled",
            Self::Failed => "failed",
            Self::Cancelled => "cancelled",
            Self::Indeterminate => "indeterminate",
            Self::Deferred => "deferred",
        }
    }

    pub fn parse(value: &str) -> StoreResult<Self> {
        Ok(match value {
            "queued" => Self::Queued,
            "running" => Self::Running,
            "stopping" => Self::Stopping,
            "settled" => Self::Settled,
            "failed" => Self::Failed,
            "cancelled" => Self::Cancelled,
            "indeterminate" => Self::Indeterminate,
            "deferred" => Self::Deferred,
            other => {
                return Err(RoomStoreError::Validation(format!(
                    "unknown task status {other}"
                )))
            }
        })
    }

    /// settled, failed or cancelled.
    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Settled | Self::Failed | Self::Cancelled)
    }
}

impl fmt::Display for TaskStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How a settlement ends a task.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SettlementStatus {
    Settled,
    Failed,
}

impl SettlementStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Settled => "settled",
            Self::Failed => "failed",
        }
    }
}

/// A terminal receipt to commit: its id, status and result.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Settlement {
    pub settlement_id: String,
    pub status: SettlementStatus,
    pub result: serde_json::Value,
}

impl Settlement {
    fn checked(&self) -> StoreResult<(String, String)> {
        let id = validate_identifier("settlement_id", &self.settlement_id)?;
        let json = canonical_json(&self.result);
        if json.len() > MAX_RESULT_BYTES {
            return Err(RoomStoreError::Validation("result is too large".into()));
        }
        Ok((id, json))
    }
}

/// The exact capability needed to settle one attempt.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TaskAttempt {
    pub identity: TaskIdentity,
    pub lease: Lease,
    pub execution_generation: i64,
    pub cancel_generation: i64,
}

/// A task as read.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TaskView {
    pub identity: TaskIdentity,
    pub payload: TaskPayload,
    pub payload_digest: String,
    pub status: TaskStatus,
    pub execution_generation: i64,
    pub cancel_generation: i64,
    pub run_gateway_id: Option<String>,
    pub run_process_generation: Option<String>,
    pub run_lease_generation: Option<i64>,
    pub cancel_id: Option<String>,
    pub settlement_id: Option<String>,
    pub settlement_status: Option<String>,
    pub result: Option<serde_json::Value>,
    pub created_at: f64,
    pub updated_at: f64,
    pub started_at: Option<f64>,
    pub terminal_at: Option<f64>,
    pub indeterminate_at: Option<f64>,
    /// True only when the call replayed an identical earlier commit.
    pub idempotent: bool,
}

/// What `recover_room` found.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct RecoveryReport {
    pub queued: Vec<String>,
    pub indeterminate: Vec<String>,
}

#[derive(Debug, Clone, Queryable, Selectable)]
#[diesel(table_name = room_tasks)]
#[diesel(check_for_backend(diesel::sqlite::Sqlite))]
struct TaskRow {
    room_id: String,
    task_id: String,
    thread_id: String,
    turn_id: String,
    source_event_seq: i64,
    payload_json: String,
    payload_digest: String,
    status: String,
    execution_generation: i64,
    cancel_generation: i64,
    run_gateway_id: Option<String>,
    run_process_generation: Option<String>,
    run_lease_generation: Option<i64>,
    cancel_id: Option<String>,
    settlement_id: Option<String>,
    settlement_status: Option<String>,
    result_json: Option<String>,
    created_at: f64,
    updated_at: f64,
    started_at: Option<f64>,
    terminal_at: Option<f64>,
    indeterminate_at: Option<f64>,
}

impl TaskRow {
    fn status(&self) -> StoreResult<TaskStatus> {
        TaskStatus::parse(&self.status)
    }

    fn run_fence_is(&self, lease: &Lease) -> bool {
        self.run_gateway_id.as_deref() == Some(lease.gateway_id.as_str())
            && self.run_process_generation.as_deref() == Some(lease.process_generation.as_str())
            && self.run_lease_generation == Some(lease.lease_generation)
    }

    fn into_view(self, idempotent: bool) -> StoreResult<TaskView> {
        if sha256_hex(&self.payload_json) != self.payload_digest {
            return Err(integrity_error());
        }
        let payload: TaskPayload =
            serde_json::from_str(&self.payload_json).map_err(|_| integrity_error())?;
        if payload.source_event_seq != self.source_event_seq {
            return Err(integrity_error());
        }
        let result = match &self.result_json {
            Some(text) => Some(serde_json::from_str(text).map_err(|_| integrity_error())?),
            None => None,
        };
        Ok(TaskView {
            status: self.status()?,
            identity: TaskIdentity {
                room_id: self.room_id,
                task_id: self.task_id,
                thread_id: self.thread_id,
                turn_id: self.turn_id,
            },
            payload,
            payload_digest: self.payload_digest,
            execution_generation: self.execution_generation,
            cancel_generation: self.cancel_generation,
            run_gateway_id: self.run_gateway_id,
            run_process_generation: self.run_process_generation,
            run_lease_generation: self.run_lease_generation,
            cancel_id: self.cancel_id,
            settlement_id: self.settlement_id,
            settlement_status: self.settlement_status,
            result,
            created_at: self.created_at,
            updated_at: self.updated_at,
            started_at: self.started_at,
            terminal_at: self.terminal_at,
            indeterminate_at: self.indeterminate_at,
            idempotent,
        })
    }
}

fn integrity_error() -> RoomStoreError {
    RoomStoreError::Corrupt("stored task payload failed its integrity check".into())
}

fn find_row(
    conn: &mut SqliteConnection,
    room_id: &str,
    task_id: &str,
) -> StoreResult<Option<TaskRow>> {
    Ok(room_tasks::table
        .find((room_id, task_id))
        .select(TaskRow::as_select())
        .first(conn)
        .optional()?)
}

fn load_row(conn: &mut SqliteConnection, identity: &TaskIdentity) -> StoreResult<TaskRow> {
    let row = find_row(conn, &identity.room_id, &identity.task_id)?
        .ok_or_else(|| RoomStoreError::Conflict("task does not exist".into()))?;
    if row.thread_id != identity.thread_id || row.turn_id != identity.turn_id {
        return Err(RoomStoreError::Conflict(
            "task_id is already bound to a different turn".into(),
        ));
    }
    Ok(row)
}

fn reload(conn: &mut SqliteConnection, identity: &TaskIdentity) -> StoreResult<TaskView> {
    load_row(conn, identity)?.into_view(false)
}

/// An identical settlement replays; a different one on a settled row conflicts.
fn settlement_replay(
    row: &TaskRow,
    settlement_id: &str,
    status: SettlementStatus,
    json: &str,
) -> StoreResult<bool> {
    match &row.settlement_id {
        None => Ok(false),
        Some(existing) => {
            if existing == settlement_id
                && row.settlement_status.as_deref() == Some(status.as_str())
                && row.result_json.as_deref() == Some(json)
            {
                Ok(true)
            } else {
                Err(RoomStoreError::Conflict(
                    "task already has a different terminal settlement".into(),
                ))
            }
        }
    }
}

fn expect_one(updated: usize, error: impl FnOnce() -> RoomStoreError) -> StoreResult<()> {
    if updated == 1 {
        Ok(())
    } else {
        Err(error())
    }
}

fn stale(message: &str) -> impl FnOnce() -> RoomStoreError + '_ {
    move || RoomStoreError::StaleTask(message.to_string())
}

fn check_recovery_inputs(
    identity: &TaskIdentity,
    lease: &Lease,
    expected_execution_generation: i64,
    expected_cancel_generation: i64,
) -> StoreResult<TaskIdentity> {
    let identity = identity.validated()?;
    if lease.room_id != identity.room_id {
        return Err(RoomStoreError::Validation(
            "lease and task belong to different rooms".into(),
        ));
    }
    if expected_execution_generation < 1 {
        return Err(RoomStoreError::Validation(
            "expected_execution_generation must be a positive integer".into(),
        ));
    }
    if expected_cancel_generation < 0 {
        return Err(RoomStoreError::Validation(
            "expected_cancel_generation must be a non-negative integer".into(),
        ));
    }
    Ok(identity)
}

/// Admit a task as `queued`. Idempotent by identity and payload; a different payload for the same
/// task, or a (thread, turn) already used by another task, is a conflict.
pub fn admit_task(
    conn: &mut SqliteConnection,
    identity: &TaskIdentity,
    payload: &TaskPayload,
    clock: &dyn Clock,
) -> StoreResult<TaskView> {
    admit_task_within(conn, identity, payload, clock, i64::MAX)
}

/// A task's payload as stored (canonical JSON).
fn payload_json_of(payload: &TaskPayload) -> StoreResult<String> {
    let value =
        serde_json::to_value(payload).map_err(|e| RoomStoreError::Validation(e.to_string()))?;
    Ok(canonical_json(&value))
}

/// The task `identity` names, admitted before with this payload: its view (`idempotent`); a
/// conflict if it was admitted with another turn or payload; none if it never was.
fn replayed(
    conn: &mut SqliteConnection,
    identity: &TaskIdentity,
    payload_json: &str,
) -> StoreResult<Option<TaskView>> {
    let Some(row) = find_row(conn, &identity.room_id, &identity.task_id)? else {
        return Ok(None);
    };
    if row.thread_id != identity.thread_id || row.turn_id != identity.turn_id {
        return Err(RoomStoreError::Conflict(
            "task_id is already bound to a different turn".into(),
        ));
    }
    if row.payload_json != payload_json {
        return Err(RoomStoreError::Conflict(
            "task_id is already bound to a different payload".into(),
        ));
    }
    row.into_view(true).map(Some)
}

/// A replay of an admission, read without admitting anything (while the gateway drains: a
/// task admitted before is answered as at any other time; a new one is not taken).
pub fn admitted_task(
    conn: &mut SqliteConnection,
    identity: &TaskIdentity,
    payload: &TaskPayload,
) -> StoreResult<Option<TaskView>> {
    let identity = identity.validated()?;
    let payload_json = payload_json_of(&payload.normalized()?)?;
    replayed(conn, &identity, &payload_json)
}

/// [`admit_task`], refused (`Full`) when the room already has `max_queued` tasks queued (a
/// replay of an admitted task is answered whatever the queue holds).
pub fn admit_task_within(
    conn: &mut SqliteConnection,
    identity: &TaskIdentity,
    payload: &TaskPayload,
    clock: &dyn Clock,
    max_queued: i64,
) -> StoreResult<TaskView> {
    let identity = identity.validated()?;
    let payload = payload.normalized()?;
    let payload_json = payload_json_of(&payload)?;
    let digest = sha256_hex(&payload_json);
    let now = read_clock(clock)?;
    crate::store::write_tx(conn, |conn| {
        if let Some(view) = replayed(conn, &identity, &payload_json)? {
            return Ok(view);
        }
        live_room(conn, &identity.room_id, true)?;
        if max_queued < i64::MAX {
            use crate::store::rooms_schema::room_task_counts as k;
            let queued: Option<i64> = k::table
                .filter(k::room_id.eq(&identity.room_id))
                .filter(k::status.eq(TaskStatus::Queued.as_str()))
                .select(k::n)
                .first(conn)
                .optional()?;
            if queued.unwrap_or(0) >= max_queued {
                return Err(RoomStoreError::Full(format!(
                    "room {} has {max_queued} tasks queued (rooms.max_queued_tasks_per_room)",
                    identity.room_id
                )));
            }
        }
        // A task is one member's turn: a profile that is not a member would open a room session
        // for an agent the room never had.
        let is_member: i64 = room_members::table
            .filter(room_members::room_id.eq(&identity.room_id))
            .filter(room_members::profile.eq(&payload.target_profile))
            .count()
            .get_result(conn)?;
        if is_member == 0 {
            return Err(RoomStoreError::Validation(format!(
                "target_profile {:?} is not a member of room {:?}",
                payload.target_profile, identity.room_id
            )));
        }
        // A member id names the member (its handle) whose profile runs the turn: another
        // would be reported as waiting on the approvals, and backed off for the failures, of a
        // member that does not run it.
        if let Some(member) = &payload.target_member_id {
            let named: i64 = room_members::table
                .filter(room_members::room_id.eq(&identity.room_id))
                .filter(room_members::profile.eq(&payload.target_profile))
                .filter(room_members::handle.eq(member))
                .count()
                .get_result(conn)?;
            if named == 0 {
                return Err(RoomStoreError::Validation(format!(
                    "target_member_id {member:?} is not a member of room {:?} with profile {:?}",
                    identity.room_id, payload.target_profile
                )));
            }
        }
        let turn_taken: i64 = room_tasks::table
            .filter(room_tasks::room_id.eq(&identity.room_id))
            .filter(room_tasks::thread_id.eq(&identity.thread_id))
            .filter(room_tasks::turn_id.eq(&identity.turn_id))
            .count()
            .get_result(conn)?;
        if turn_taken > 0 {
            return Err(RoomStoreError::Conflict(
                "thread turn is already bound to a different task".into(),
            ));
        }
        // A pruned task's id: the new task's attempts go on from the old one's generations
        // (its member knows an attempt by room, task and generation, for good).
        let tomb = room_task_tombstones::table.find((&identity.room_id, &identity.task_id));
        let generation: Option<i64> = tomb
            .select(room_task_tombstones::execution_generation)
            .first(conn)
            .optional()?;
        if generation.is_some() {
            diesel::delete(tomb).execute(conn)?;
        }
        diesel::insert_into(room_tasks::table)
            .values((
                room_tasks::room_id.eq(&identity.room_id),
                room_tasks::task_id.eq(&identity.task_id),
                room_tasks::thread_id.eq(&identity.thread_id),
                room_tasks::turn_id.eq(&identity.turn_id),
                room_tasks::source_event_seq.eq(payload.source_event_seq),
                room_tasks::payload_json.eq(&payload_json),
                room_tasks::payload_digest.eq(&digest),
                room_tasks::status.eq(TaskStatus::Queued.as_str()),
                room_tasks::execution_generation.eq(generation.unwrap_or(0)),
                room_tasks::cancel_generation.eq(0_i64),
                room_tasks::created_at.eq(now),
                room_tasks::updated_at.eq(now),
            ))
            .execute(conn)?;
        reload(conn, &identity)
    })
}

/// Read one task (its payload digest re-verified).
pub fn get_task(conn: &mut SqliteConnection, identity: &TaskIdentity) -> StoreResult<TaskView> {
    load_row(conn, identity)?.into_view(false)
}

/// Read one task by room and task id.
pub fn find_task(
    conn: &mut SqliteConnection,
    room_id: &str,
    task_id: &str,
) -> StoreResult<Option<TaskView>> {
    match find_row(conn, room_id, task_id)? {
        Some(row) => Ok(Some(row.into_view(false)?)),
        None => Ok(None),
    }
}

/// Tasks of a room in room order (`source_event_seq, created_at, task_id`), optionally by status.
pub fn list_tasks(
    conn: &mut SqliteConnection,
    room_id: &str,
    status: Option<TaskStatus>,
) -> StoreResult<Vec<TaskView>> {
    Ok(list_tasks_page(conn, room_id, status, None, i64::MAX, i64::MAX)?.0)
}

/// The identities of a room's tasks that have not ended and are not being stopped (queued,
/// deferred, running, indeterminate), in the room's order: what a disband cancels. Only the
/// identities are read (listing the room's tasks whole read every prompt and result it keeps,
/// up to its 2048 ended tasks, to find the few open ones).
pub fn open_tasks(conn: &mut SqliteConnection, room_id: &str) -> StoreResult<Vec<TaskIdentity>> {
    let rows: Vec<(String, String, String, String)> = room_tasks::table
        .filter(room_tasks::room_id.eq(room_id))
        .filter(room_tasks::status.eq_any(["queued", "deferred", "running", "indeterminate"]))
        .order((
            room_tasks::source_event_seq.asc(),
            room_tasks::created_at.asc(),
            room_tasks::task_id.asc(),
        ))
        .select((
            room_tasks::room_id,
            room_tasks::task_id,
            room_tasks::thread_id,
            room_tasks::turn_id,
        ))
        .load(conn)?;
    Ok(rows
        .into_iter()
        .map(|(room_id, task_id, thread_id, turn_id)| TaskIdentity {
            room_id,
            task_id,
            thread_id,
            turn_id,
        })
        .collect())
}

/// Where a page of a room's tasks starts: after a task still kept (named by its id), or after a
/// position in the room's order, which holds when the task there has since been pruned.
#[derive(Debug, Clone, PartialEq)]
pub enum TasksAfter {
    Task(String),
    Position(TaskPosition),
}

/// A task's place in its room's order: its source event, creation time and id.
#[derive(Debug, Clone, PartialEq)]
pub struct TaskPosition {
    pub source_event_seq: i64,
    pub created_at: f64,
    pub task_id: String,
}

impl TaskPosition {
    const VERSION: &'static str = "t1";

    pub fn of(task: &TaskView) -> Self {
        Self {
            source_event_seq: task.payload.source_event_seq,
            created_at: task.created_at,
            task_id: task.identity.task_id.clone(),
        }
    }

    /// The position as an opaque cursor (the creation time by its bits, so it reads back
    /// exactly).
    pub fn cursor(&self) -> String {
        format!(
            "{}.{}.{:016x}.{}",
            Self::VERSION,
            self.source_event_seq,
            self.created_at.to_bits(),
            self.task_id
        )
    }

    /// A cursor made by [`TaskPosition::cursor`], or `None`.
    pub fn parse(cursor: &str) -> Option<Self> {
        let mut parts = cursor.splitn(4, '.');
        if parts.next()? != Self::VERSION {
            return None;
        }
        let source_event_seq = parts.next()?.parse().ok()?;
        let bits = parts.next()?;
        if bits.len() != 16 {
            return None;
        }
        let created_at = f64::from_bits(u64::from_str_radix(bits, 16).ok()?);
        let task_id = parts.next()?.to_string();
        (created_at.is_finite() && !task_id.is_empty()).then_some(Self {
            source_event_seq,
            created_at,
            task_id,
        })
    }
}

/// One page of a room's tasks in the room's order: at most `limit` tasks (with `status`, if
/// given) after `after`, and whether more follow. The page also ends before the task
/// that would take its stored prompts and results past `max_bytes` (it holds one task at
/// least): the sizes are read first, so a page of large tasks is never loaded whole (a
/// thousand prompts of 128 KiB each were, before the reply was cut).
pub fn list_tasks_page(
    conn: &mut SqliteConnection,
    room_id: &str,
    status: Option<TaskStatus>,
    after: Option<&TasksAfter>,
    limit: i64,
    max_bytes: i64,
) -> StoreResult<(Vec<TaskView>, bool)> {
    let mut query = room_tasks::table
        .filter(room_tasks::room_id.eq(room_id))
        .into_boxed();
    if let Some(status) = status {
        query = query.filter(room_tasks::status.eq(status.as_str()));
    }
    if let Some(after) = after {
        let (seq, created, id): (i64, f64, String) = match after {
            TasksAfter::Position(p) => (p.source_event_seq, p.created_at, p.task_id.clone()),
            TasksAfter::Task(task_id) => room_tasks::table
                .filter(room_tasks::room_id.eq(room_id))
                .filter(room_tasks::task_id.eq(task_id))
                .select((
                    room_tasks::source_event_seq,
                    room_tasks::created_at,
                    room_tasks::task_id,
                ))
                .first(conn)
                .optional()?
                .ok_or_else(|| {
                    RoomStoreError::Validation(format!(
                        "after names no task of room {room_id} (an ended task may have been \
                         pruned: page with `cursor`, the last page's `next_cursor`)"
                    ))
                })?,
        };
        query = query.filter(
            room_tasks::source_event_seq
                .gt(seq)
                .or(room_tasks::source_event_seq
                    .eq(seq)
                    .and(room_tasks::created_at.gt(created)))
                .or(room_tasks::source_event_seq
                    .eq(seq)
                    .and(room_tasks::created_at.eq(created))
                    .and(room_tasks::task_id.gt(id))),
        );
    }
    let sizes: Vec<(String, i64)> = query
        .order((
            room_tasks::source_event_seq.asc(),
            room_tasks::created_at.asc(),
            room_tasks::task_id.asc(),
        ))
        .limit(limit.saturating_add(1))
        .select((
            room_tasks::task_id,
            diesel::dsl::sql::<diesel::sql_types::BigInt>(
                "octet_length(payload_json) + coalesce(octet_length(result_json), 0)",
            ),
        ))
        .load(conn)?;
    let mut more = sizes.len() as i64 > limit;
    let (mut bytes, mut kept) = (0i64, Vec::new());
    for (task_id, size) in sizes.into_iter().take(usize::try_from(limit).unwrap_or(0)) {
        if !kept.is_empty() && bytes.saturating_add(size) > max_bytes {
            more = true;
            break;
        }
        bytes = bytes.saturating_add(size);
        kept.push(task_id);
    }
    let mut rows: Vec<TaskRow> = Vec::with_capacity(kept.len());
    // In chunks well under SQLite's limit of bound parameters.
    for ids in kept.chunks(500) {
        rows.extend(
            room_tasks::table
                .filter(room_tasks::room_id.eq(room_id))
                .filter(room_tasks::task_id.eq_any(ids))
                .select(TaskRow::as_select())
                .load::<TaskRow>(conn)?,
        );
    }
    // The page's order is the one its ids were read in.
    let at: std::collections::HashMap<&str, usize> = kept
        .iter()
        .enumerate()
        .map(|(i, id)| (id.as_str(), i))
        .collect();
    rows.sort_by_key(|row| at.get(row.task_id.as_str()).copied().unwrap_or(usize::MAX));
    let tasks = rows
        .into_iter()
        .map(|row| row.into_view(false))
        .collect::<StoreResult<Vec<_>>>()?;
    Ok((tasks, more))
}

/// The first task of a room with `status`, in the room's order (what [`list_tasks`] would put
/// first, without loading the rest).
pub fn first_task(
    conn: &mut SqliteConnection,
    room_id: &str,
    status: TaskStatus,
) -> StoreResult<Option<TaskView>> {
    let row: Option<TaskRow> = room_tasks::table
        .filter(room_tasks::room_id.eq(room_id))
        .filter(room_tasks::status.eq(status.as_str()))
        .select(TaskRow::as_select())
        .order((
            room_tasks::source_event_seq.asc(),
            room_tasks::created_at.asc(),
            room_tasks::task_id.asc(),
        ))
        .first(conn)
        .optional()?;
    row.map(|row| row.into_view(false)).transpose()
}

/// Number of tasks of a room by status (for `room.get`), from the counts the triggers keep.
pub fn count_tasks_by_status(
    conn: &mut SqliteConnection,
    room_id: &str,
) -> StoreResult<std::collections::BTreeMap<String, i64>> {
    use crate::store::rooms_schema::room_task_counts as k;
    let rows: Vec<(String, i64)> = k::table
        .filter(k::room_id.eq(room_id))
        .filter(k::n.gt(0))
        .select((k::status, k::n))
        .load(conn)?;
    Ok(rows.into_iter().collect())
}

/// Number of tasks of every room by status (for metrics), from the kept counts.
pub fn count_all_tasks_by_status(
    conn: &mut SqliteConnection,
) -> StoreResult<std::collections::BTreeMap<String, i64>> {
    use crate::store::rooms_schema::room_task_counts as k;
    // A row per room and status: a handful per room, however many tasks it ever had.
    let rows: Vec<(String, i64)> = k::table
        .filter(k::n.gt(0))
        .select((k::status, k::n))
        .load(conn)?;
    let mut out = std::collections::BTreeMap::new();
    for (status, n) in rows {
        *out.entry(status).or_insert(0) += n;
    }
    Ok(out)
}

/// How long a room keeps its ended (settled, failed, cancelled) tasks. A task id is idempotent
/// for as long as its task is kept.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TaskRetention {
    /// An ended task older than this is pruned (0: no age limit).
    pub max_age_seconds: f64,
    /// A room keeps at most this many of its newest ended tasks.
    pub max_per_room: i64,
}

/// What one pruning transaction did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PrunedTasks {
    pub deleted: usize,
    /// It stopped at its bound with more to prune.
    pub more: bool,
}

/// A room's oldest ended tasks (`room_id`, how many). The ended statuses are spelled as the
/// `room_tasks_ended` index spells them, which is what lets the index serve the query.
pub(crate) const PRUNE_OLDEST_SQL: &str = "DELETE FROM room_tasks WHERE rowid IN (SELECT rowid \
     FROM room_tasks WHERE room_id = ? \
     AND (status = 'settled' OR status = 'failed' OR status = 'cancelled') \
     ORDER BY terminal_at LIMIT ?)";

/// A room's tasks that ended before a time (`room_id`, the time, how many), oldest first.
pub(crate) const PRUNE_AGED_SQL: &str = "DELETE FROM room_tasks WHERE rowid IN (SELECT rowid \
     FROM room_tasks WHERE room_id = ? \
     AND (status = 'settled' OR status = 'failed' OR status = 'cancelled') \
     AND terminal_at < ? ORDER BY terminal_at LIMIT ?)";

/// Prune ended tasks, at most `limit` in one transaction: those that ended more than
/// `max_age_seconds` ago, and a room's oldest past its newest `max_per_room`. Every read and
/// delete walks a room's ended tasks in the order they ended (`room_tasks_ended`), and a room's
/// count of them comes from the kept counts; queued, running, stopping, indeterminate and
/// deferred tasks are never touched.
pub fn prune_ended_tasks(
    conn: &mut SqliteConnection,
    retention: TaskRetention,
    now: f64,
    limit: usize,
) -> StoreResult<PrunedTasks> {
    use crate::store::rooms_schema::room_task_counts as k;
    use diesel::sql_types::{BigInt, Double, Text};
    crate::store::write_tx(conn, |conn| {
        let ended: Vec<(String, i64)> = k::table
            .filter(k::status.eq_any(["settled", "failed", "cancelled"]))
            .filter(k::n.gt(0))
            .select((k::room_id, k::n))
            .load(conn)?;
        let mut per_room: std::collections::BTreeMap<String, i64> = Default::default();
        for (room, n) in ended {
            *per_room.entry(room).or_insert(0) += n;
        }
        let mut left = limit as i64;
        let mut deleted = 0usize;
        for (room, n) in per_room {
            if left <= 0 {
                return Ok(PrunedTasks {
                    deleted,
                    more: true,
                });
            }
            let over = (n - retention.max_per_room.max(0)).max(0);
            let mut gone = 0;
            if over > 0 {
                gone += diesel::sql_query(PRUNE_OLDEST_SQL)
                    .bind::<Text, _>(&room)
                    .bind::<BigInt, _>(over.min(left))
                    .execute(conn)? as i64;
            }
            if retention.max_age_seconds > 0.0 && left > gone {
                gone += diesel::sql_query(PRUNE_AGED_SQL)
                    .bind::<Text, _>(&room)
                    .bind::<Double, _>(now - retention.max_age_seconds)
                    .bind::<BigInt, _>(left - gone)
                    .execute(conn)? as i64;
            }
            left -= gone;
            deleted += gone as usize;
        }
        Ok(PrunedTasks {
            deleted,
            more: left <= 0,
        })
    })
}

/// Start the room's next queued task under an active lease: `running`, execution generation + 1,
/// run fence = the lease.
pub fn start_task(
    conn: &mut SqliteConnection,
    identity: &TaskIdentity,
    lease: &Lease,
    expected_cancel_generation: i64,
    clock: &dyn Clock,
) -> StoreResult<TaskAttempt> {
    let identity = identity.validated()?;
    if lease.room_id != identity.room_id {
        return Err(RoomStoreError::Validation(
            "lease and task belong to different rooms".into(),
        ));
    }
    let now = read_clock(clock)?;
    crate::store::write_tx(conn, |conn| {
        live_room(conn, &identity.room_id, true)?;
        check_active_lease(conn, lease, now)?;
        let row = load_row(conn, &identity)?;
        if row.cancel_generation != expected_cancel_generation {
            return Err(RoomStoreError::StaleTask(
                "task cancel generation changed".into(),
            ));
        }
        let status = row.status()?;
        if status != TaskStatus::Queued {
            return Err(RoomStoreError::InvalidTransition(format!(
                "cannot start task in state '{status}'"
            )));
        }
        let blocking: i64 = room_tasks::table
            .filter(room_tasks::room_id.eq(&identity.room_id))
            .filter(room_tasks::status.eq_any(["running", "indeterminate", "stopping"]))
            .count()
            .get_result(conn)?;
        if blocking > 0 {
            return Err(RoomStoreError::InvalidTransition(
                "room recovery must resolve the prior task before starting new work".into(),
            ));
        }
        let head: Option<String> = room_tasks::table
            .filter(room_tasks::room_id.eq(&identity.room_id))
            .filter(room_tasks::status.eq("queued"))
            .order((
                room_tasks::source_event_seq.asc(),
                room_tasks::created_at.asc(),
                room_tasks::task_id.asc(),
            ))
            .select(room_tasks::task_id)
            .first(conn)
            .optional()?;
        if head.as_deref() != Some(identity.task_id.as_str()) {
            return Err(RoomStoreError::InvalidTransition(
                "task is not next in the hosted room event order".into(),
            ));
        }
        let execution_generation = row.execution_generation + 1;
        let updated = diesel::update(
            room_tasks::table
                .find((&identity.room_id, &identity.task_id))
                .filter(room_tasks::status.eq("queued"))
                .filter(room_tasks::cancel_generation.eq(expected_cancel_generation))
                .filter(room_tasks::execution_generation.eq(row.execution_generation)),
        )
        .set((
            room_tasks::status.eq("running"),
            room_tasks::execution_generation.eq(execution_generation),
            room_tasks::run_gateway_id.eq(Some(&lease.gateway_id)),
            room_tasks::run_process_generation.eq(Some(&lease.process_generation)),
            room_tasks::run_lease_generation.eq(Some(lease.lease_generation)),
            room_tasks::started_at.eq(Some(now)),
            room_tasks::updated_at.eq(now),
        ))
        .execute(conn)?;
        expect_one(updated, stale("task changed before it could start"))?;
        Ok(TaskAttempt {
            identity: identity.clone(),
            lease: lease.clone(),
            execution_generation,
            cancel_generation: expected_cancel_generation,
        })
    })
}

macro_rules! settle_columns {
    ($id:expr, $status:expr, $json:expr, $now:expr) => {
        (
            room_tasks::status.eq($status.as_str()),
            room_tasks::settlement_id.eq(Some($id)),
            room_tasks::settlement_status.eq(Some($status.as_str())),
            room_tasks::result_json.eq(Some($json)),
            room_tasks::terminal_at.eq(Some($now)),
            room_tasks::updated_at.eq($now),
        )
    };
}

/// Settle the running attempt: needs the active lease that started it and both generations.
pub fn settle_task(
    conn: &mut SqliteConnection,
    attempt: &TaskAttempt,
    settlement: &Settlement,
    clock: &dyn Clock,
) -> StoreResult<TaskView> {
    let identity = attempt.identity.validated()?;
    let (settlement_id, json) = settlement.checked()?;
    let now = read_clock(clock)?;
    let lease = &attempt.lease;
    crate::store::write_tx(conn, |conn| {
        let row = load_row(conn, &identity)?;
        if settlement_replay(&row, &settlement_id, settlement.status, &json)? {
            return row.into_view(true);
        }
        check_active_lease(conn, lease, now)?;
        let updated = diesel::update(
            room_tasks::table
                .find((&identity.room_id, &identity.task_id))
                .filter(room_tasks::status.eq("running"))
                .filter(room_tasks::execution_generation.eq(attempt.execution_generation))
                .filter(room_tasks::cancel_generation.eq(attempt.cancel_generation))
                .filter(room_tasks::run_gateway_id.eq(&lease.gateway_id))
                .filter(room_tasks::run_process_generation.eq(&lease.process_generation))
                .filter(room_tasks::run_lease_generation.eq(lease.lease_generation)),
        )
        .set(settle_columns!(
            &settlement_id,
            settlement.status,
            &json,
            now
        ))
        .execute(conn)?;
        expect_one(updated, stale("task attempt is stale or cancelled"))?;
        reload(conn, &identity)
    })
}

/// Land a completion that raced an unacknowledged stop (or the acknowledged deadline failure):
/// `stopping` → settled/failed, under any active lease, on both generations.
#[allow(clippy::too_many_arguments)]
pub fn settle_stopping_task(
    conn: &mut SqliteConnection,
    identity: &TaskIdentity,
    lease: &Lease,
    expected_execution_generation: i64,
    expected_cancel_generation: i64,
    settlement: &Settlement,
    clock: &dyn Clock,
) -> StoreResult<TaskView> {
    if expected_execution_generation < 1 || expected_cancel_generation < 1 {
        return Err(RoomStoreError::Validation(
            "stopping settlement generations are invalid".into(),
        ));
    }
    let identity = check_recovery_inputs(
        identity,
        lease,
        expected_execution_generation,
        expected_cancel_generation,
    )?;
    let (settlement_id, json) = settlement.checked()?;
    let now = read_clock(clock)?;
    crate::store::write_tx(conn, |conn| {
        let row = load_row(conn, &identity)?;
        if settlement_replay(&row, &settlement_id, settlement.status, &json)? {
            return row.into_view(true);
        }
        check_active_lease(conn, lease, now)?;
        let updated = diesel::update(
            room_tasks::table
                .find((&identity.room_id, &identity.task_id))
                .filter(room_tasks::status.eq("stopping"))
                .filter(room_tasks::execution_generation.eq(expected_execution_generation))
                .filter(room_tasks::cancel_generation.eq(expected_cancel_generation)),
        )
        .set(settle_columns!(
            &settlement_id,
            settlement.status,
            &json,
            now
        ))
        .execute(conn)?;
        expect_one(updated, stale("task completion lost the stop race"))?;
        reload(conn, &identity)
    })
}

/// Put an attempt that provably never reached the member back in the queue (prompt unchanged,
/// execution generation kept, so the next start is generation + 1).
pub fn requeue_not_admitted_task(
    conn: &mut SqliteConnection,
    attempt: &TaskAttempt,
    clock: &dyn Clock,
) -> StoreResult<TaskView> {
    let identity = attempt.identity.validated()?;
    let now = read_clock(clock)?;
    let lease = &attempt.lease;
    crate::store::write_tx(conn, |conn| {
        check_active_lease(conn, lease, now)?;
        let row = load_row(conn, &identity)?;
        if row.status()? == TaskStatus::Queued
            && row.execution_generation == attempt.execution_generation
            && row.cancel_generation == attempt.cancel_generation
            && row.run_gateway_id.is_none()
        {
            return row.into_view(true);
        }
        // Put back while the room is being disbanded too: it is no new work (the disband's
        // fence refuses its start), and queued, the disband cancels it directly. Refused, the
        // attempt stayed running with nothing behind it, and the disband's cancel made it a
        // stop that only the member could acknowledge (a peer that is down, never).
        live_room(conn, &identity.room_id, false)?;
        let error = || RoomStoreError::StaleTask("not-admitted task attempt lost its fence".into());
        if !row.run_fence_is(lease) {
            return Err(error());
        }
        let updated = diesel::update(
            room_tasks::table
                .find((&identity.room_id, &identity.task_id))
                .filter(room_tasks::status.eq("running"))
                .filter(room_tasks::execution_generation.eq(attempt.execution_generation))
                .filter(room_tasks::cancel_generation.eq(attempt.cancel_generation))
                .filter(room_tasks::run_gateway_id.eq(&lease.gateway_id))
                .filter(room_tasks::run_process_generation.eq(&lease.process_generation))
                .filter(room_tasks::run_lease_generation.eq(lease.lease_generation)),
        )
        .set((
            room_tasks::status.eq("queued"),
            room_tasks::run_gateway_id.eq(None::<String>),
            room_tasks::run_process_generation.eq(None::<String>),
            room_tasks::run_lease_generation.eq(None::<i64>),
            room_tasks::started_at.eq(None::<f64>),
            room_tasks::updated_at.eq(now),
        ))
        .execute(conn)?;
        expect_one(updated, error)?;
        reload(conn, &identity)
    })
}

/// Cancel work that never started (queued) or is parked (deferred), directly.
pub fn cancel_task(
    conn: &mut SqliteConnection,
    identity: &TaskIdentity,
    cancel_id: &str,
    expected_cancel_generation: i64,
    clock: &dyn Clock,
) -> StoreResult<TaskView> {
    let identity = identity.validated()?;
    let cancel_id = validate_identifier("cancel_id", cancel_id)?;
    let now = read_clock(clock)?;
    crate::store::write_tx(conn, |conn| {
        let row = load_row(conn, &identity)?;
        let status = row.status()?;
        if status == TaskStatus::Cancelled && row.cancel_id.as_deref() == Some(cancel_id.as_str()) {
            return row.into_view(true);
        }
        if status.is_terminal() {
            return Err(RoomStoreError::InvalidTransition(format!(
                "cannot cancel task in state '{status}'"
            )));
        }
        if !matches!(status, TaskStatus::Queued | TaskStatus::Deferred) {
            return Err(RoomStoreError::InvalidTransition(
                "running work requires acknowledged two-phase cancellation".into(),
            ));
        }
        if row.cancel_generation != expected_cancel_generation {
            return Err(RoomStoreError::StaleTask(
                "task cancel generation changed".into(),
            ));
        }
        let updated = diesel::update(
            room_tasks::table
                .find((&identity.room_id, &identity.task_id))
                .filter(room_tasks::status.eq_any(["queued", "deferred"]))
                .filter(room_tasks::cancel_generation.eq(expected_cancel_generation)),
        )
        .set((
            room_tasks::status.eq("cancelled"),
            room_tasks::cancel_generation.eq(expected_cancel_generation + 1),
            room_tasks::cancel_id.eq(Some(&cancel_id)),
            room_tasks::terminal_at.eq(Some(now)),
            room_tasks::updated_at.eq(now),
        ))
        .execute(conn)?;
        expect_one(updated, stale("task changed during cancellation"))?;
        reload(conn, &identity)
    })
}

/// Persist a stop intent for running (or indeterminate) work: `stopping`, cancel generation + 1.
/// The run fence and execution generation are kept, so a racing completion can still land.
pub fn begin_task_cancel(
    conn: &mut SqliteConnection,
    identity: &TaskIdentity,
    cancel_id: &str,
    expected_cancel_generation: i64,
    clock: &dyn Clock,
) -> StoreResult<TaskView> {
    begin_task_stop(
        conn,
        identity,
        cancel_id,
        expected_cancel_generation,
        None,
        clock,
    )
}

/// [`begin_task_cancel`], of attempt `attempt` only when given (a turn's deadline stops the
/// attempt it timed, never the one after it: a requeue keeps the cancel generation, so only the
/// execution generation tells a later attempt from the one timed).
pub fn begin_task_stop(
    conn: &mut SqliteConnection,
    identity: &TaskIdentity,
    cancel_id: &str,
    expected_cancel_generation: i64,
    attempt: Option<i64>,
    clock: &dyn Clock,
) -> StoreResult<TaskView> {
    let identity = identity.validated()?;
    let cancel_id = validate_identifier("cancel_id", cancel_id)?;
    let now = read_clock(clock)?;
    crate::store::write_tx(conn, |conn| {
        let row = load_row(conn, &identity)?;
        let status = row.status()?;
        if status == TaskStatus::Stopping && row.cancel_id.as_deref() == Some(cancel_id.as_str()) {
            return row.into_view(true);
        }
        if status.is_terminal() || matches!(status, TaskStatus::Queued | TaskStatus::Deferred) {
            return Err(RoomStoreError::InvalidTransition(format!(
                "cannot request remote stop in state '{status}'"
            )));
        }
        if row.cancel_generation != expected_cancel_generation {
            return Err(RoomStoreError::StaleTask(
                "task cancel generation changed".into(),
            ));
        }
        // The attempt asked for, else the one this transaction read: either way the statement
        // stops that attempt only.
        let generation = attempt.unwrap_or(row.execution_generation);
        if row.execution_generation != generation {
            return Err(RoomStoreError::StaleTask(format!(
                "task runs attempt {}, not {generation}",
                row.execution_generation
            )));
        }
        let updated = diesel::update(
            room_tasks::table
                .find((&identity.room_id, &identity.task_id))
                .filter(room_tasks::status.eq_any(["running", "indeterminate"]))
                .filter(room_tasks::cancel_generation.eq(expected_cancel_generation))
                .filter(room_tasks::execution_generation.eq(generation)),
        )
        .set((
            room_tasks::status.eq("stopping"),
            room_tasks::cancel_generation.eq(expected_cancel_generation + 1),
            room_tasks::cancel_id.eq(Some(&cancel_id)),
            room_tasks::updated_at.eq(now),
        ))
        .execute(conn)?;
        expect_one(updated, stale("task changed during stop request"))?;
        reload(conn, &identity)
    })
}

/// Complete an acknowledged stop: `stopping` with this cancel id and generation → `cancelled`.
pub fn complete_task_cancel(
    conn: &mut SqliteConnection,
    identity: &TaskIdentity,
    cancel_id: &str,
    expected_cancel_generation: i64,
    clock: &dyn Clock,
) -> StoreResult<TaskView> {
    let identity = identity.validated()?;
    let cancel_id = validate_identifier("cancel_id", cancel_id)?;
    let now = read_clock(clock)?;
    crate::store::write_tx(conn, |conn| {
        let row = load_row(conn, &identity)?;
        if row.status()? == TaskStatus::Cancelled
            && row.cancel_id.as_deref() == Some(cancel_id.as_str())
        {
            return row.into_view(true);
        }
        let updated = diesel::update(
            room_tasks::table
                .find((&identity.room_id, &identity.task_id))
                .filter(room_tasks::status.eq("stopping"))
                .filter(room_tasks::cancel_id.eq(&cancel_id))
                .filter(room_tasks::cancel_generation.eq(expected_cancel_generation)),
        )
        .set((
            room_tasks::status.eq("cancelled"),
            room_tasks::terminal_at.eq(Some(now)),
            room_tasks::updated_at.eq(now),
        ))
        .execute(conn)?;
        expect_one(updated, stale("task stop acknowledgement is stale"))?;
        reload(conn, &identity)
    })
}

/// Under a new lease, mark every running attempt this lease did not start `indeterminate`.
pub fn recover_room(
    conn: &mut SqliteConnection,
    lease: &Lease,
    clock: &dyn Clock,
) -> StoreResult<RecoveryReport> {
    let now = read_clock(clock)?;
    crate::store::write_tx(conn, |conn| {
        check_active_lease(conn, lease, now)?;
        let running: Vec<TaskRow> = room_tasks::table
            .filter(room_tasks::room_id.eq(&lease.room_id))
            .filter(room_tasks::status.eq("running"))
            .select(TaskRow::as_select())
            .load(conn)?;
        for row in running.iter().filter(|row| !row.run_fence_is(lease)) {
            let updated = diesel::update(
                room_tasks::table
                    .find((&row.room_id, &row.task_id))
                    .filter(room_tasks::status.eq("running"))
                    .filter(room_tasks::execution_generation.eq(row.execution_generation)),
            )
            .set((
                room_tasks::status.eq("indeterminate"),
                room_tasks::indeterminate_at.eq(Some(now)),
                room_tasks::updated_at.eq(now),
            ))
            .execute(conn)?;
            expect_one(updated, stale("task changed during recovery"))?;
        }
        // The ids and statuses of the tasks not ended, in the room's order, and nothing else:
        // every task loaded whole (its prompt checked against its digest, its result parsed),
        // up to the room's 2048 ended ones, held the writer on every new lease of a busy room.
        let open: Vec<(String, String)> = room_tasks::table
            .filter(room_tasks::room_id.eq(&lease.room_id))
            .filter(room_tasks::status.eq_any(["queued", "indeterminate"]))
            .order((
                room_tasks::source_event_seq.asc(),
                room_tasks::created_at.asc(),
                room_tasks::task_id.asc(),
            ))
            .select((room_tasks::task_id, room_tasks::status))
            .load(conn)?;
        let mut report = RecoveryReport::default();
        for (task_id, status) in open {
            if status == "queued" {
                report.queued.push(task_id);
            } else {
                report.indeterminate.push(task_id);
            }
        }
        Ok(report)
    })
}

/// Shared shape of the recovery family: lease first, then replay, then a CAS on
/// `status = from` and both generations.
struct RecoveryCas<'a> {
    identity: &'a TaskIdentity,
    lease: &'a Lease,
    from: TaskStatus,
    exec: i64,
    cancel: i64,
    stale_message: &'a str,
}

impl RecoveryCas<'_> {
    fn updated(&self, updated: usize) -> StoreResult<()> {
        expect_one(updated, stale(self.stale_message))
    }
}

macro_rules! recovery_target {
    ($cas:expr) => {
        room_tasks::table
            .find((&$cas.identity.room_id, &$cas.identity.task_id))
            .filter(room_tasks::status.eq($cas.from.as_str()))
            .filter(room_tasks::execution_generation.eq($cas.exec))
            .filter(room_tasks::cancel_generation.eq($cas.cancel))
    };
}

fn settle_recovered(
    conn: &mut SqliteConnection,
    cas: RecoveryCas<'_>,
    settlement: &Settlement,
    clock: &dyn Clock,
) -> StoreResult<TaskView> {
    let identity = check_recovery_inputs(cas.identity, cas.lease, cas.exec, cas.cancel)?;
    let (settlement_id, json) = settlement.checked()?;
    let now = read_clock(clock)?;
    crate::store::write_tx(conn, |conn| {
        check_active_lease(conn, cas.lease, now)?;
        let row = load_row(conn, &identity)?;
        if settlement_replay(&row, &settlement_id, settlement.status, &json)? {
            return row.into_view(true);
        }
        let updated = diesel::update(recovery_target!(cas))
            .set(settle_columns!(
                &settlement_id,
                settlement.status,
                &json,
                now
            ))
            .execute(conn)?;
        cas.updated(updated)?;
        reload(conn, &identity)
    })
}

/// A probe found the exact receipt of an indeterminate attempt: settle it.
#[allow(clippy::too_many_arguments)]
pub fn resolve_indeterminate_task(
    conn: &mut SqliteConnection,
    identity: &TaskIdentity,
    lease: &Lease,
    expected_execution_generation: i64,
    expected_cancel_generation: i64,
    settlement: &Settlement,
    clock: &dyn Clock,
) -> StoreResult<TaskView> {
    let cas = RecoveryCas {
        identity,
        lease,
        from: TaskStatus::Indeterminate,
        exec: expected_execution_generation,
        cancel: expected_cancel_generation,
        stale_message: "indeterminate task generation changed",
    };
    settle_recovered(conn, cas, settlement, clock)
}

/// A probe saw the member cancelled an indeterminate attempt: `cancelled`, cancel generation + 1.
#[allow(clippy::too_many_arguments)]
pub fn resolve_indeterminate_cancellation(
    conn: &mut SqliteConnection,
    identity: &TaskIdentity,
    lease: &Lease,
    expected_execution_generation: i64,
    expected_cancel_generation: i64,
    cancel_id: &str,
    clock: &dyn Clock,
) -> StoreResult<TaskView> {
    let identity = check_recovery_inputs(
        identity,
        lease,
        expected_execution_generation,
        expected_cancel_generation,
    )?;
    let cancel_id = validate_identifier("cancel_id", cancel_id)?;
    let now = read_clock(clock)?;
    let cas = RecoveryCas {
        identity: &identity,
        lease,
        from: TaskStatus::Indeterminate,
        exec: expected_execution_generation,
        cancel: expected_cancel_generation,
        stale_message: "indeterminate task generation changed",
    };
    crate::store::write_tx(conn, |conn| {
        check_active_lease(conn, lease, now)?;
        let row = load_row(conn, &identity)?;
        if row.status()? == TaskStatus::Cancelled
            && row.cancel_id.as_deref() == Some(cancel_id.as_str())
        {
            return row.into_view(true);
        }
        let updated = diesel::update(recovery_target!(cas))
            .set((
                room_tasks::status.eq("cancelled"),
                room_tasks::cancel_generation.eq(expected_cancel_generation + 1),
                room_tasks::cancel_id.eq(Some(&cancel_id)),
                room_tasks::terminal_at.eq(Some(now)),
                room_tasks::updated_at.eq(now),
            ))
            .execute(conn)?;
        cas.updated(updated)?;
        reload(conn, &identity)
    })
}

/// Explicit operator retry of an indeterminate attempt (accepting at-least-once): back to `queued`.
pub fn requeue_indeterminate_task(
    conn: &mut SqliteConnection,
    identity: &TaskIdentity,
    lease: &Lease,
    expected_execution_generation: i64,
    expected_cancel_generation: i64,
    clock: &dyn Clock,
) -> StoreResult<TaskView> {
    requeue_from(
        conn,
        RecoveryCas {
            identity,
            lease,
            from: TaskStatus::Indeterminate,
            exec: expected_execution_generation,
            cancel: expected_cancel_generation,
            stale_message: "indeterminate task generation changed",
        },
        clock,
    )
}

/// Explicit retry of a deferred task: back to `queued` with its result cleared.
pub fn requeue_deferred_task(
    conn: &mut SqliteConnection,
    identity: &TaskIdentity,
    lease: &Lease,
    expected_execution_generation: i64,
    expected_cancel_generation: i64,
    clock: &dyn Clock,
) -> StoreResult<TaskView> {
    requeue_from(
        conn,
        RecoveryCas {
            identity,
            lease,
            from: TaskStatus::Deferred,
            exec: expected_execution_generation,
            cancel: expected_cancel_generation,
            stale_message: "deferred task generation changed",
        },
        clock,
    )
}

fn requeue_from(
    conn: &mut SqliteConnection,
    cas: RecoveryCas<'_>,
    clock: &dyn Clock,
) -> StoreResult<TaskView> {
    let identity = check_recovery_inputs(cas.identity, cas.lease, cas.exec, cas.cancel)?;
    let now = read_clock(clock)?;
    crate::store::write_tx(conn, |conn| {
        check_active_lease(conn, cas.lease, now)?;
        load_row(conn, &identity)?;
        live_room(conn, &identity.room_id, true)?;
        let updated = diesel::update(recovery_target!(cas))
            .set((
                room_tasks::status.eq("queued"),
                room_tasks::run_gateway_id.eq(None::<String>),
                room_tasks::run_process_generation.eq(None::<String>),
                room_tasks::run_lease_generation.eq(None::<i64>),
                room_tasks::result_json.eq(None::<String>),
                room_tasks::started_at.eq(None::<f64>),
                room_tasks::terminal_at.eq(None::<f64>),
                room_tasks::indeterminate_at.eq(None::<f64>),
                room_tasks::updated_at.eq(now),
            ))
            .execute(conn)?;
        cas.updated(updated)?;
        reload(conn, &identity)
    })
}

/// Park an indeterminate attempt after its defer age: `deferred`, result
/// `{"reason": <reason>, "retryable": true}`; later room work may run.
#[allow(clippy::too_many_arguments)]
pub fn defer_indeterminate_task(
    conn: &mut SqliteConnection,
    identity: &TaskIdentity,
    lease: &Lease,
    expected_execution_generation: i64,
    expected_cancel_generation: i64,
    reason: &str,
    clock: &dyn Clock,
) -> StoreResult<TaskView> {
    let identity = check_recovery_inputs(
        identity,
        lease,
        expected_execution_generation,
        expected_cancel_generation,
    )?;
    let reason = validate_identifier("reason", reason)?;
    let json = canonical_json(&serde_json::json!({ "reason": reason, "retryable": true }));
    let now = read_clock(clock)?;
    let cas = RecoveryCas {
        identity: &identity,
        lease,
        from: TaskStatus::Indeterminate,
        exec: expected_execution_generation,
        cancel: expected_cancel_generation,
        stale_message: "indeterminate task generation changed",
    };
    crate::store::write_tx(conn, |conn| {
        check_active_lease(conn, lease, now)?;
        let row = load_row(conn, &identity)?;
        if row.status()? == TaskStatus::Deferred
            && row.execution_generation == expected_execution_generation
            && row.cancel_generation == expected_cancel_generation
            && row.result_json.as_deref() == Some(json.as_str())
        {
            return row.into_view(true);
        }
        let updated = diesel::update(recovery_target!(cas))
            .set((
                room_tasks::status.eq("deferred"),
                room_tasks::result_json.eq(Some(&json)),
                room_tasks::terminal_at.eq(Some(now)),
                room_tasks::updated_at.eq(now),
            ))
            .execute(conn)?;
        cas.updated(updated)?;
        reload(conn, &identity)
    })
}

/// The exact successful receipt of a deferred attempt turned up: `settled`.
#[allow(clippy::too_many_arguments)]
pub fn resolve_deferred_completion(
    conn: &mut SqliteConnection,
    identity: &TaskIdentity,
    lease: &Lease,
    expected_execution_generation: i64,
    expected_cancel_generation: i64,
    settlement: &Settlement,
    clock: &dyn Clock,
) -> StoreResult<TaskView> {
    if settlement.status != SettlementStatus::Settled {
        return Err(RoomStoreError::Validation(
            "a deferred task resolves only with a settled receipt".into(),
        ));
    }
    let cas = RecoveryCas {
        identity,
        lease,
        from: TaskStatus::Deferred,
        exec: expected_execution_generation,
        cancel: expected_cancel_generation,
        stale_message: "deferred task generation changed",
    };
    settle_recovered(conn, cas, settlement, clock)
}
