//! Hosted-room methods (`room.*`) and their events (`room.task`, `room.pending_action`).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use actix::Recipient;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::clock::SharedClock;
use crate::error::{GatewayError, GatewayResult};
use crate::rooms::db::RoomsDb;
use crate::rooms::port::AnswerOutcome;
use crate::rooms::runtime::{
    RoomBinding, RoomHooks, RoomRuntime, RoomsError, RoomsStatus, DISBAND_CANCEL_ID,
};
use crate::session::supervisor::{push_or_drop, PushEvent};
use crate::store::room_tasks::{self, TaskIdentity, TaskPayload, TaskStatus, TaskView};
use crate::store::rooms::{self, RoomMember, RoomStoreError};

/// Maps room errors to wire reasons.
pub fn room_error(e: RoomsError) -> GatewayError {
    match e {
        RoomsError::Store(s) => store_error(s),
        RoomsError::Port(p) => GatewayError::SessionBusy(p.to_string()),
        RoomsError::Config(c) => GatewayError::InvalidParams(c.to_string()),
        RoomsError::Hook(h) => GatewayError::SessionBusy(h),
        unknown @ RoomsError::UnknownTurn { .. } => GatewayError::SessionBusy(unknown.to_string()),
    }
}

pub fn store_error(e: RoomStoreError) -> GatewayError {
    match e {
        RoomStoreError::Validation(m) | RoomStoreError::InvalidTransition(m) => {
            GatewayError::InvalidParams(m)
        }
        RoomStoreError::RoomUnavailable(m) => GatewayError::NotFound(m),
        RoomStoreError::LeaseHeld(m) | RoomStoreError::Full(m) => GatewayError::SessionBusy(m),
        RoomStoreError::StaleLease(m) | RoomStoreError::StaleTask(m) => {
            GatewayError::StaleGeneration(m)
        }
        RoomStoreError::Conflict(m) => GatewayError::AdmissionConflict(m),
        other => {
            tracing::error!(error = %other, "rooms storage failure");
            GatewayError::StorageUnavailable
        }
    }
}

/// A room's state: `active`, `disbanding` (its disband fence is up, a stop is pending) or
/// `disbanded`.
fn room_state(room: &rooms::RoomView) -> &'static str {
    if room.disbanded_at.is_some() {
        "disbanded"
    } else if room.disband_requested_at.is_some() {
        "disbanding"
    } else {
        "active"
    }
}

/// A room's view after `room.disband`, with its state.
fn disband_view(room: rooms::RoomView, idempotent: bool) -> Value {
    let state = room_state(&room);
    let mut v = serde_json::to_value(room).unwrap_or(Value::Null);
    v["state"] = json!(state);
    v["idempotent"] = json!(idempotent);
    v
}

/// Connections that want a room's events.
#[derive(Default)]
pub struct RoomEventHub {
    subscribers: Mutex<HashMap<String, HashMap<u64, Recipient<PushEvent>>>>,
    seq: Mutex<HashMap<String, u64>>,
    /// The rooms retired last (at most [`RETIRED_KEPT`]), oldest first: a room read just before
    /// its retirement is not followed once it is retired.
    retired: Mutex<(
        std::collections::HashSet<String>,
        std::collections::VecDeque<String>,
    )>,
}

/// How many retired rooms the hub remembers (a room's read that began before its retirement
/// and ends after this many later ones is not looked for).
const RETIRED_KEPT: usize = 4096;

impl RoomEventHub {
    /// Connection `conn_id` follows `room_id`, unless the room was retired meanwhile (a
    /// `room.get` that read it before its disband ended after it): a retired room says
    /// nothing more, and its entry held the connection's mailbox until the connection closed.
    pub fn subscribe(&self, room_id: &str, conn_id: u64, r: Recipient<PushEvent>) {
        if let Ok(mut s) = self.subscribers.lock() {
            let retired = self
                .retired
                .lock()
                .is_ok_and(|retired| retired.0.contains(room_id));
            if !retired {
                s.entry(room_id.to_string()).or_default().insert(conn_id, r);
            }
        }
    }

    /// Forget connection `conn_id` (it closed): its rooms no longer hold its mailbox (and, with
    /// it, its socket), and a room nobody follows any more is dropped from the map.
    pub fn unsubscribe_all(&self, conn_id: u64) {
        if let Ok(mut s) = self.subscribers.lock() {
            s.retain(|_, subs| {
                subs.remove(&conn_id);
                !subs.is_empty()
            });
        }
    }

    /// Rooms followed by at least one connection.
    pub fn followed_rooms(&self) -> usize {
        self.subscribers.lock().map_or(0, |s| s.len())
    }

    /// Rooms whose events have been counted (and not retired since).
    pub fn counted_rooms(&self) -> usize {
        self.seq.lock().map_or(0, |s| s.len())
    }

    fn publish(&self, room_id: &str, kind: &str, payload: Value) {
        // The number is taken and the frame handed over under one lock: two publishers (an API
        // task, a member's terminal report on another thread) hand theirs over in seq order.
        let mut counters = self.seq.lock();
        let seq = match &mut counters {
            Ok(m) => {
                let e = m.entry(room_id.to_string()).or_insert(0);
                *e += 1;
                *e
            }
            Err(_) => 0,
        };
        let frame = json!({"jsonrpc": "2.0", "method": "event",
            "params": {"type": kind, "room_id": room_id, "seq": seq, "payload": payload}});
        let text: Arc<str> = Arc::from(frame.to_string());
        if let Ok(mut s) = self.subscribers.lock() {
            if let Some(subs) = s.get_mut(room_id) {
                subs.retain(|_, r| push_or_drop(r, PushEvent::one(text.clone())));
            }
        }
        drop(counters);
    }
}

impl RoomHooks for RoomEventHub {
    fn publish_terminal(&self, binding: &RoomBinding, task: &TaskView) {
        self.publish(&binding.room_id, "room.task", task_view(task));
    }

    fn task_cancelled(&self, room_id: &str, task: &TaskView) {
        self.publish(room_id, "room.task", task_view(task));
    }

    /// A retired room's counter and followers go (a counter stayed for every room ever made).
    fn room_retired(&self, room_id: &str) {
        if let Ok(mut seq) = self.seq.lock() {
            seq.remove(room_id);
        }
        // Remembered before its followers go: a subscription after this finds it retired, and
        // one before it is removed below.
        if let Ok(mut retired) = self.retired.lock() {
            if retired.0.insert(room_id.to_string()) {
                retired.1.push_back(room_id.to_string());
            }
            while retired.1.len() > RETIRED_KEPT {
                if let Some(oldest) = retired.1.pop_front() {
                    retired.0.remove(&oldest);
                }
            }
        }
        if let Ok(mut subscribers) = self.subscribers.lock() {
            subscribers.remove(room_id);
        }
    }

    fn pending_action(&self, room_id: &str, member_id: &str, action: Option<&Value>) {
        self.publish(
            room_id,
            "room.pending_action",
            json!({"member_id": member_id, "action": action}),
        );
    }
}

pub fn task_view(t: &TaskView) -> Value {
    serde_json::to_value(t).unwrap_or(Value::Null)
}

/// Refuse `principal` a room `owner` created (no owner recorded, or the operator: allowed).
fn owned_by(room_id: &str, owner: Option<&str>, principal: Option<&str>) -> GatewayResult<()> {
    match (owner, principal) {
        (Some(owner), Some(principal)) if owner != principal => {
            Err(GatewayError::PermissionDenied(format!(
                "hosted room {room_id} belongs to another principal"
            )))
        }
        _ => Ok(()),
    }
}

/// The owner recorded for a room the operator creates on the control socket.
pub const OPERATOR: &str = "operator";

/// The rooms side of the authority.
#[derive(Clone)]
pub struct RoomsService {
    pub runtime: RoomRuntime,
    /// The actor that schedules room passes (one `RoomSupervisor` actor per room).
    pub scheduler: actix::Addr<crate::rooms::actors::RoomScheduler>,
    pub db: RoomsDb,
    pub hub: Arc<RoomEventHub>,
    pub gateway_id: String,
    pub clock: SharedClock,
    /// The process's phase: a draining gateway takes no new room work (`runtime_draining`).
    pub phase: Arc<crate::session::shared::RuntimeState>,
    /// The most bytes of a task's prompt: the rooms' own bound, or `session.max_text_bytes`
    /// when that is smaller (a member's turn is an input of its session).
    pub max_prompt_bytes: usize,
}

/// A turn deadline's stop is recorded under a cancel id of this prefix (`deadline:<generation>`):
/// a client's cancel under such an id would be taken for one, and its task failed as timed out.
const DEADLINE_CANCEL_PREFIX: &str = "deadline:";

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateRoom {
    room_id: String,
    name: String,
    members: Vec<RoomMember>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RoomRef {
    room_id: String,
}

/// `room.status` takes no params (unknown ones are refused, as every method's are).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NoParams {}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AdmitTask {
    room_id: String,
    task_id: String,
    thread_id: String,
    turn_id: String,
    target_profile: String,
    prompt: String,
    source_event_seq: i64,
    target_member_id: Option<String>,
}

impl AdmitTask {
    /// The task named and what it asks for.
    fn into_task(self) -> GatewayResult<(TaskIdentity, TaskPayload)> {
        let identity =
            TaskIdentity::new(&self.room_id, &self.task_id, &self.thread_id, &self.turn_id)
                .map_err(store_error)?;
        let payload = TaskPayload {
            target_profile: self.target_profile,
            prompt: self.prompt,
            source_event_seq: self.source_event_seq,
            target_member_id: self.target_member_id,
        };
        Ok((identity, payload))
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ListTasks {
    room_id: String,
    status: Option<String>,
    /// The most tasks in the reply (1 to [`MAX_TASKS_PAGE`]; [`DEFAULT_TASKS_PAGE`]).
    limit: Option<i64>,
    /// The task the page starts after (the last page's `next_after`).
    after: Option<String>,
    /// Where the page starts (the last page's `next_cursor`): unlike `after`, it holds when
    /// that task has since been pruned.
    cursor: Option<String>,
}

/// The most tasks one `room.tasks` reply holds, and how many when the request does not say.
const MAX_TASKS_PAGE: i64 = 1000;
const DEFAULT_TASKS_PAGE: i64 = 200;
/// A page ends early once its tasks come to this many bytes (each may hold a 128 KiB prompt and
/// a 256 KiB result: a room's whole list was one reply of up to a gigabyte).
const TASKS_PAGE_BYTES: usize = 8 << 20;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TaskRef {
    room_id: String,
    task_id: String,
    cancel_id: Option<String>,
}

/// `room.respond`: the room's owner answers the approval a member's attempt waits on (a
/// `room.pending_action`), naming the attempt as the event did.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RespondToMember {
    room_id: String,
    task_id: String,
    /// The task's execution generation; one that is not an integer is stale (as for
    /// `approval.respond`).
    execution_generation: Value,
    request_id: String,
    choice: String,
}

/// What a room's owner may answer for a member: this one command, or not. An approval that
/// outlived the attempt (`session`, `always`) would let the member run later commands unasked.
const ROOM_CHOICES: [&str; 2] = ["once", "deny"];

fn params<T: for<'de> Deserialize<'de>>(p: Value) -> GatewayResult<T> {
    serde_json::from_value(p).map_err(|e| GatewayError::InvalidParams(e.to_string()))
}

impl RoomsService {
    async fn find(&self, room_id: &str, task_id: &str) -> GatewayResult<TaskView> {
        let (r, t) = (room_id.to_string(), task_id.to_string());
        self.db
            .run(move |c| room_tasks::find_task(c, &r, &t))
            .await
            .map_err(store_error)?
            .ok_or_else(|| GatewayError::NotFound(format!("no task {task_id} in room {room_id}")))
    }

    /// Refuse `principal` a room another principal created (`None`: the operator, on the control
    /// socket, who may use every room); the room's recorded owner, as read for a principal.
    async fn authorize(
        &self,
        principal: Option<&str>,
        room_id: &str,
    ) -> GatewayResult<Option<String>> {
        if principal.is_none() {
            return Ok(None);
        }
        let id = room_id.to_string();
        let (exists, owner) = self
            .db
            .run(move |c| {
                Ok((
                    rooms::load_room(c, &id)?.is_some(),
                    rooms::room_owner(c, &id)?,
                ))
            })
            .await
            .map_err(store_error)?;
        // A room that does not exist is not found here, not let through: read as having no
        // owner, a disband (a cancel, a read) named one that another principal then made went
        // on to act on that principal's room. A room, once made, keeps its owner.
        if !exists {
            return Err(GatewayError::NotFound(format!("no room {room_id}")));
        }
        owned_by(room_id, owner.as_deref(), principal)?;
        Ok(owner)
    }

    /// A `room.admit` while the gateway drains: the view of the task it names when that task
    /// was admitted with this payload (a conflict when with another), else `runtime_draining`.
    async fn admitted_while_draining(&self, p: Value) -> GatewayResult<Value> {
        let (identity, payload) = params::<AdmitTask>(p)?.into_task()?;
        let admitted = self
            .db
            .run(move |c| room_tasks::admitted_task(c, &identity, &payload))
            .await
            .map_err(store_error)?;
        admitted
            .map(|view| task_view(&view))
            .ok_or(GatewayError::RuntimeDraining)
    }

    /// What room `room_id`'s members wait on now, as `room.pending_action` last said it.
    fn pending_actions(&self, room_id: &str) -> Value {
        self.runtime
            .pending_actions(room_id)
            .into_iter()
            .map(|(member, action)| json!({"member_id": member, "action": action}))
            .collect()
    }

    /// Dispatch a `room.*` method for `principal` (`None`: the operator); `subscribe` is called
    /// with the room the caller now follows. A room is its creator's: every method that names
    /// one refuses (`permission_denied`) a principal that did not create it.
    pub async fn call(
        &self,
        method: &str,
        p: Value,
        principal: Option<&str>,
        subscribe: impl Fn(&str),
    ) -> GatewayResult<Value> {
        // Ids as the store keeps them (it trims them): a task admitted as " t1" was not found
        // by a cancel, a retry or a read naming it so.
        let mut p = p;
        for key in ["room_id", "task_id"] {
            if let Some(Value::String(id)) = p.get_mut(key) {
                if id.trim().len() != id.len() {
                    *id = id.trim().to_string();
                }
            }
        }
        // The owner of the room named, as read for a principal.
        let mut owner = None;
        if method != "room.create" {
            if let Some(room_id) = p.get("room_id").and_then(Value::as_str) {
                owner = self.authorize(principal, room_id).await?;
            }
        }
        // New work waits for the next process; cancels, reads and disbands go on, and so does
        // the replay of an admission (it is not new: answered with its task, as at any time).
        if matches!(method, "room.create" | "room.admit" | "room.retry") && self.phase.draining() {
            if method == "room.admit" {
                return self.admitted_while_draining(p).await;
            }
            return Err(GatewayError::RuntimeDraining);
        }
        match method {
            "room.create" => {
                let p: CreateRoom = params(p)?;
                // A member runs as its profile: one this gateway lacks would fail every task.
                if let Some(unknown) = p
                    .members
                    .iter()
                    .find(|m| self.runtime.has_profile(&m.profile) == Some(false))
                {
                    return Err(GatewayError::InvalidParams(format!(
                        "no profile {:?} in the config",
                        unknown.profile
                    )));
                }
                let (clock, gateway) = (self.clock.clone(), self.gateway_id.clone());
                let owner = principal.unwrap_or(OPERATOR).to_string();
                let (room, recorded) = self
                    .db
                    .write(move |c| {
                        rooms::create_owned_room(
                            c,
                            &owner,
                            &p.room_id,
                            &p.name,
                            &p.members,
                            &gateway,
                            clock.as_ref(),
                        )
                    })
                    .await
                    .map_err(store_error)?;
                owned_by(&room.room_id, recorded.as_deref(), principal)?;
                subscribe(&room.room_id);
                // A pass of the new room (the scheduler reads the rooms again for it), not a
                // round over every room.
                self.runtime.wake_room(&room.room_id);
                Ok(serde_json::to_value(room).unwrap_or(Value::Null))
            }
            "room.get" => {
                let p: RoomRef = params(p)?;
                let id = p.room_id.clone();
                let (room, counts) = self
                    .db
                    .run(move |c| {
                        Ok((
                            rooms::get_room(c, &id)?,
                            room_tasks::count_tasks_by_status(c, &id)?,
                        ))
                    })
                    .await
                    .map_err(store_error)?;
                let room =
                    room.ok_or_else(|| GatewayError::NotFound(format!("no room {}", p.room_id)))?;
                // A retired room says nothing more: following it would only keep the caller's
                // mailbox until the connection closes.
                if room.disbanded_at.is_none() {
                    subscribe(&room.room_id);
                }
                let state = room_state(&room);
                let mut v = serde_json::to_value(room).unwrap_or(Value::Null);
                v["state"] = json!(state);
                v["task_counts"] = json!(counts);
                v["pending_actions"] = self.pending_actions(&p.room_id);
                Ok(v)
            }
            "room.admit" => {
                let p: AdmitTask = params(p)?;
                if p.prompt.len() > self.max_prompt_bytes {
                    return Err(GatewayError::PayloadTooLarge(format!(
                        "prompt is {} bytes, more than {}",
                        p.prompt.len(),
                        self.max_prompt_bytes
                    )));
                }
                let (identity, payload) = p.into_task()?;
                let clock = self.clock.clone();
                let max_queued = self.runtime.config().max_queued_tasks_per_room;
                let who = principal.map(str::to_string);
                let view = self
                    .db
                    .write(move |c| {
                        // The owner again, in the admission's own transaction: a room made by
                        // another principal since the check above (none existed then) is
                        // not admitted into.
                        let owner = rooms::room_owner(c, &identity.room_id)?;
                        if let Err(refused) =
                            owned_by(&identity.room_id, owner.as_deref(), who.as_deref())
                        {
                            return Ok(Err(refused));
                        }
                        room_tasks::admit_task_within(
                            c,
                            &identity,
                            &payload,
                            clock.as_ref(),
                            max_queued,
                        )
                        .map(Ok)
                    })
                    .await
                    .map_err(store_error)??;
                subscribe(&view.identity.room_id);
                self.runtime.wake_room(&view.identity.room_id);
                Ok(task_view(&view))
            }
            "room.tasks" => {
                let p: ListTasks = params(p)?;
                let status = match p.status.as_deref() {
                    Some(s) => Some(TaskStatus::parse(s).map_err(store_error)?),
                    None => None,
                };
                let limit = p.limit.unwrap_or(DEFAULT_TASKS_PAGE);
                if !(1..=MAX_TASKS_PAGE).contains(&limit) {
                    return Err(GatewayError::InvalidParams(format!(
                        "limit must be 1 to {MAX_TASKS_PAGE}"
                    )));
                }
                let after = match (p.after, p.cursor) {
                    (Some(_), Some(_)) => {
                        return Err(GatewayError::InvalidParams(
                            "give `after` or `cursor`, not both".into(),
                        ))
                    }
                    (Some(task), None) => Some(room_tasks::TasksAfter::Task(task)),
                    (None, Some(cursor)) => Some(room_tasks::TasksAfter::Position(
                        room_tasks::TaskPosition::parse(&cursor).ok_or_else(|| {
                            GatewayError::InvalidParams(
                                "cursor is not a `next_cursor` of room.tasks".into(),
                            )
                        })?,
                    )),
                    (None, None) => None,
                };
                let id = p.room_id.clone();
                let page = self
                    .db
                    .run(move |c| {
                        let Some(room) = rooms::get_room(c, &id)? else {
                            return Ok(None);
                        };
                        room_tasks::list_tasks_page(
                            c,
                            &id,
                            status,
                            after.as_ref(),
                            limit,
                            TASKS_PAGE_BYTES as i64,
                        )
                        .map(|page| Some((page, room.disbanded_at.is_some())))
                    })
                    .await
                    .map_err(store_error)?;
                // No room, no events to follow (and nothing kept for a name a client made up),
                // nor for a retired room.
                let Some(((tasks, mut more), retired)) = page else {
                    return Err(GatewayError::NotFound(format!("no room {}", p.room_id)));
                };
                if !retired {
                    subscribe(&p.room_id);
                }
                let mut views = Vec::with_capacity(tasks.len());
                let mut bytes = 0;
                for task in &tasks {
                    if bytes >= TASKS_PAGE_BYTES {
                        more = true;
                        break;
                    }
                    let view = task_view(task);
                    bytes += view.to_string().len();
                    views.push(view);
                }
                let last = more
                    .then(|| tasks.get(views.len().saturating_sub(1)))
                    .flatten();
                Ok(json!({
                    "tasks": views,
                    "has_more": more,
                    "next_after": last.map(|t| t.identity.task_id.clone()),
                    "next_cursor": last.map(|t| room_tasks::TaskPosition::of(t).cursor()),
                }))
            }
            "room.cancel" => {
                let p: TaskRef = params(p)?;
                let cancel_id = p
                    .cancel_id
                    .clone()
                    .ok_or_else(|| GatewayError::InvalidParams("cancel_id is required".into()))?;
                if cancel_id.trim().starts_with(DEADLINE_CANCEL_PREFIX) {
                    return Err(GatewayError::InvalidParams(format!(
                        "cancel_id must not start with {DEADLINE_CANCEL_PREFIX:?}: turn deadlines \
                         stop tasks under such ids"
                    )));
                }
                let task = self.find(&p.room_id, &p.task_id).await?;
                let view = self
                    .runtime
                    .cancel(&task.identity, &cancel_id)
                    .await
                    .map_err(room_error)?;
                Ok(task_view(&view))
            }
            "room.retry" => {
                let p: TaskRef = params(p)?;
                let task = self.find(&p.room_id, &p.task_id).await?;
                let view = self
                    .runtime
                    .retry_indeterminate(&task.identity)
                    .await
                    .map_err(room_error)?;
                Ok(task_view(&view))
            }
            "room.respond" => {
                let p: RespondToMember = params(p)?;
                if !ROOM_CHOICES.contains(&p.choice.as_str()) {
                    return Err(GatewayError::InvalidParams(format!(
                        "choice must be one of {ROOM_CHOICES:?}: a member is approved for one \
                         command at a time"
                    )));
                }
                if p.request_id.is_empty() {
                    return Err(GatewayError::InvalidParams(
                        "request_id must not be empty".into(),
                    ));
                }
                let task = self.find(&p.room_id, &p.task_id).await?;
                // What an answer lets run is its owner's to approve: a room with no owner
                // recorded (made before owners were) is answered by the operator only.
                if let Some(who) = principal {
                    if owner.as_deref() != Some(who) {
                        return Err(GatewayError::PermissionDenied(format!(
                            "hosted room {} has no owner of record: its members' approvals are \
                             answered by the operator (gatehouse room-respond)",
                            p.room_id
                        )));
                    }
                }
                let Some(generation) = p.execution_generation.as_i64() else {
                    return Err(GatewayError::StaleGeneration(
                        "execution_generation must be an integer".into(),
                    ));
                };
                let by = principal.unwrap_or(OPERATOR);
                let outcome = self
                    .runtime
                    .answer_approval(&task.identity, generation, &p.request_id, &p.choice, by)
                    .await
                    .map_err(room_error)?;
                let status = match outcome {
                    AnswerOutcome::Resolved => "resolved",
                    AnswerOutcome::AlreadyResolved => "already_resolved",
                    AnswerOutcome::Stale(m) => return Err(GatewayError::StaleGeneration(m)),
                    AnswerOutcome::Refused(m) => return Err(GatewayError::InvalidParams(m)),
                };
                tracing::info!(
                    target: "gatehouse::rooms", room = %p.room_id, task = %p.task_id,
                    generation, request = %p.request_id, choice = %p.choice, by, status,
                    "member approval answered"
                );
                Ok(json!({"status": status, "request_id": p.request_id,
                          "task_id": p.task_id, "execution_generation": generation}))
            }
            "room.disband" => {
                let p: RoomRef = params(p)?;
                self.disband(&p.room_id).await
            }
            "room.status" => {
                let NoParams {} = params(p)?;
                let status = self.status_for(principal).await?;
                let mut status = serde_json::to_value(status).unwrap_or(Value::Null);
                status["followed_rooms"] = json!(self.hub.followed_rooms());
                Ok(status)
            }
            other => Err(GatewayError::UnknownMethod(other.to_string())),
        }
    }

    /// The runtime's status as `principal` may see it: only the rooms it may use (those it
    /// created, as every method that names a room decides), and the last error of one of them.
    /// The operator (`None`) sees every room.
    async fn status_for(&self, principal: Option<&str>) -> GatewayResult<RoomsStatus> {
        let status = self.runtime.status();
        let Some(principal) = principal else {
            return Ok(status);
        };
        let (named, who) = (status.rooms(), principal.to_string());
        let visible = self
            .db
            .run(move |c| {
                let mut visible = HashSet::new();
                for room in named {
                    let owner = rooms::room_owner(c, &room)?;
                    if owned_by(&room, owner.as_deref(), Some(&who)).is_ok() {
                        visible.insert(room);
                    }
                }
                Ok(visible)
            })
            .await
            .map_err(store_error)?;
        Ok(status.visible_to(|room| visible.contains(room)))
    }

    /// Disband a room: raise its disband fence (no new admission or start from now on), cancel
    /// every task that has not ended (queued and deferred ones at once; running and
    /// indeterminate ones through a stop of the exact attempt), then retire the room, which
    /// frees its place among the active rooms. While a stop is still unacknowledged the room
    /// stays `disbanding`; the room's own passes carry the disband out (again after a crash or
    /// a stop that cut it short) and retire it as soon as nothing in it is unresolved.
    /// Idempotent: a disbanded room answers its view.
    async fn disband(&self, room_id: &str) -> GatewayResult<Value> {
        let clock = self.clock.clone();
        let id = room_id.to_string();
        let room = self
            .db
            .run(move |c| rooms::get_room(c, &id))
            .await
            .map_err(store_error)?
            .ok_or_else(|| GatewayError::NotFound(format!("no room {room_id}")))?;
        if room.disbanded_at.is_some() {
            return Ok(disband_view(room, true));
        }
        let id = room_id.to_string();
        let requested = self
            .db
            .write(move |c| rooms::begin_disband(c, &id, clock.as_ref()))
            .await
            .map_err(store_error)?;
        if requested.disbanded_at.is_some() {
            return Ok(disband_view(requested, true));
        }
        let id = room_id.to_string();
        let open = self
            .db
            .run(move |c| room_tasks::open_tasks(c, &id))
            .await
            .map_err(store_error)?;
        for identity in open {
            if let Err(error) = self.runtime.cancel(&identity, DISBAND_CANCEL_ID).await {
                tracing::warn!(
                    room = %room_id, task = %identity.task_id, %error,
                    "disband: cannot cancel the task yet"
                );
            }
        }
        // Retired now if nothing is unresolved; else by the room's pass that finds its stops
        // resolved (the wakeup re-reads the rooms with this one's fence up).
        let view = match self.complete_disband(room_id).await? {
            Some(retired) => {
                self.runtime.retired(room_id).await;
                retired
            }
            None => requested,
        };
        self.runtime.wakeup();
        tracing::info!(room = %room_id, disbanded = view.disbanded_at.is_some(), "room disband");
        Ok(disband_view(view, false))
    }

    /// Retire a disbanding room if nothing in it is unresolved (`None` while something is).
    async fn complete_disband(&self, room_id: &str) -> GatewayResult<Option<rooms::RoomView>> {
        let (clock, id) = (self.clock.clone(), room_id.to_string());
        match self
            .db
            .write(move |c| rooms::disband_room(c, &id, clock.as_ref()))
            .await
        {
            Ok(view) => Ok(Some(view)),
            Err(RoomStoreError::InvalidTransition(_)) => Ok(None),
            Err(e) => Err(store_error(e)),
        }
    }

    /// Rooms this gateway drives (operator view).
    pub async fn list(&self) -> GatewayResult<Value> {
        let gateway = self.gateway_id.clone();
        let rooms = self
            .db
            .run(move |c| {
                let rooms = rooms::list_rooms_for_gateway(c, &gateway)?;
                let mut out = Vec::new();
                for r in rooms {
                    let counts = room_tasks::count_tasks_by_status(c, &r.room_id)?;
                    out.push(
                        json!({"room_id": r.room_id, "name": r.name, "members": r.members.len(),
                        "authority_epoch": r.authority_epoch, "task_counts": counts}),
                    );
                }
                Ok(out)
            })
            .await
            .map_err(store_error)?;
        // What each room's members wait on now (to answer with `room-respond`).
        let rooms: Vec<Value> = rooms
            .into_iter()
            .map(|mut r| {
                let room = r["room_id"].as_str().unwrap_or_default().to_string();
                r["pending_actions"] = self.pending_actions(&room);
                r
            })
            .collect();
        Ok(json!({"gateway_id": self.gateway_id, "rooms": rooms, "status": self.runtime.status()}))
    }

    /// Start no new room work; attempts in flight are still observed and settled.
    pub async fn quiesce(&self) {
        let _ = self
            .scheduler
            .send(crate::rooms::actors::QuiesceRooms)
            .await;
    }

    /// Wait up to `timeout` for the room passes in flight to end; whether they did.
    pub async fn idle(&self, timeout: Duration) -> bool {
        self.scheduler
            .send(crate::rooms::actors::RoomsIdle(timeout))
            .await
            .unwrap_or(false)
    }

    pub async fn stop(&self, timeout: Duration) -> bool {
        self.scheduler
            .send(crate::rooms::actors::StopRooms(timeout))
            .await
            .unwrap_or(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A retired room leaves nothing in the hub: its counter went on for every room ever made.
    #[test]
    fn a_retired_room_leaves_the_hub() {
        let hub = RoomEventHub::default();
        hub.publish("gone", "room.task", json!({}));
        hub.publish("kept", "room.task", json!({}));
        assert_eq!(hub.counted_rooms(), 2);
        hub.room_retired("gone");
        assert_eq!(hub.counted_rooms(), 1);
    }

    /// A connection that asks to follow a room once it is retired (its read began before the
    /// disband) is not kept as a follower: it was, holding the connection's mailbox until the
    /// connection closed.
    #[actix_rt::test]
    async fn a_retired_room_is_not_followed_again() {
        use actix::Actor;
        struct Sink;
        impl actix::Actor for Sink {
            type Context = actix::Context<Self>;
        }
        impl actix::Handler<PushEvent> for Sink {
            type Result = ();
            fn handle(&mut self, _: PushEvent, _: &mut Self::Context) {}
        }
        let hub = RoomEventHub::default();
        let sink = Sink.start();
        hub.subscribe("kept", 1, sink.clone().recipient());
        hub.room_retired("gone");
        hub.subscribe("gone", 1, sink.recipient());
        assert_eq!(
            hub.followed_rooms(),
            1,
            "only the room still there is followed"
        );
    }

    /// A stored task that fails its integrity check is the store's fault: `storage_unavailable`,
    /// not the `admission_conflict` that blames the client's request.
    #[test]
    fn a_damaged_task_is_a_storage_failure() {
        let e = super::store_error(crate::store::rooms::RoomStoreError::Corrupt(
            "stored task payload failed its integrity check".into(),
        ));
        assert!(matches!(e, GatewayError::StorageUnavailable), "{e:?}");
        let e = super::store_error(crate::store::rooms::RoomStoreError::Conflict(
            "a different payload".into(),
        ));
        assert!(matches!(e, GatewayError::AdmissionConflict(_)), "{e:?}");
    }
}
