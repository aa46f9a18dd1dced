//! In-memory fakes for the runtime scenarios: a session adapter with no model or network, turn
//! locks that record their use, recording hooks, and a peer client with a fixed terminal status.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use serde_json::{json, Value};
use tokio::sync::watch;

use crate::clock::{ManualClock, SharedClock, SystemClock};
use crate::rooms::config::RoomsConfig;
use crate::rooms::port::*;
use crate::rooms::runtime::{
    BindingSource, RoomBinding, RoomHooks, RoomRuntime, TransportResolver,
};
use crate::rooms::testing::TestDb;
use crate::store::leases::{acquire_lease, Lease};
use crate::store::room_tasks::{
    admit_task, get_task, TaskIdentity, TaskPayload, TaskStatus, TaskView,
};

pub const ROOM_ID: &str = "room-1";
pub const PROFILE: &str = "ops";
pub const GATEWAY: &str = "gateway-a";

pub fn binding() -> RoomBinding {
    RoomBinding::new(ROOM_ID, GATEWAY, 1)
}

pub fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// A one-shot flag that can be awaited.
pub struct Event {
    tx: watch::Sender<bool>,
}

impl Default for Event {
    fn default() -> Self {
        Self {
            tx: watch::channel(false).0,
        }
    }
}

impl Event {
    pub fn set(&self) {
        self.tx.send_replace(true);
    }

    pub async fn wait(&self, timeout: Duration) -> bool {
        let mut rx = self.tx.subscribe();
        let waited = tokio::time::timeout(timeout, rx.wait_for(|set| *set)).await;
        waited.is_ok_and(|result| result.is_ok())
    }
}

/// Await a condition (polled), failing the test after five seconds.
pub async fn wait_for(what: &str, mut predicate: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        if predicate() {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "condition was not reached before timeout: {what}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

// ------------------------------------------------------------------------------------------------

#[derive(Default)]
struct RecordingInner {
    events: Mutex<Vec<(String, String)>>,
    held: Mutex<HashMap<String, usize>>,
}

/// Turn locks that record enter/exit and let the fake adapter check ownership.
#[derive(Default, Clone)]
pub struct RecordingTurnLocks {
    inner: Arc<RecordingInner>,
}

struct RecordingGuard {
    inner: Arc<RecordingInner>,
    profile: String,
}

impl Drop for RecordingGuard {
    fn drop(&mut self) {
        lock(&self.inner.events).push(("lock-exit".into(), self.profile.clone()));
        if let Some(count) = lock(&self.inner.held).get_mut(&self.profile) {
            *count = count.saturating_sub(1);
        }
    }
}

impl RecordingTurnLocks {
    pub fn events(&self) -> Vec<(String, String)> {
        lock(&self.inner.events).clone()
    }

    pub fn held_for(&self, profile: &str) -> bool {
        lock(&self.inner.held).get(profile).copied().unwrap_or(0) > 0
    }
}

impl TurnLocks for RecordingTurnLocks {
    fn lock(
        &self,
        profile: String,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = TurnGuard> + Send + '_>> {
        lock(&self.inner.events).push(("lock-enter".into(), profile.clone()));
        *lock(&self.inner.held).entry(profile.clone()).or_default() += 1;
        let guard = RecordingGuard {
            inner: self.inner.clone(),
            profile,
        };
        Box::pin(std::future::ready(Box::new(guard) as TurnGuard))
    }
}

// ------------------------------------------------------------------------------------------------

/// Hooks that record every call.
#[derive(Default)]
pub struct RecordingHooks {
    pub prepared: Mutex<Vec<String>>,
    pub published: Mutex<Vec<(String, TaskView)>>,
    pub actions: Mutex<Vec<(String, String, Option<Value>)>>,
}

impl RecordingHooks {
    pub fn published_statuses(&self) -> Vec<TaskStatus> {
        lock(&self.published)
            .iter()
            .map(|(_, task)| task.status)
            .collect()
    }
}

impl RoomHooks for RecordingHooks {
    fn prepare_room(&self, binding: &RoomBinding) -> Result<(), String> {
        lock(&self.prepared).push(binding.room_id.clone());
        Ok(())
    }

    fn publish_terminal(&self, binding: &RoomBinding, task: &TaskView) {
        lock(&self.published).push((binding.room_id.clone(), task.clone()));
    }

    fn pending_action(&self, room_id: &str, member_id: &str, action: Option<&Value>) {
        lock(&self.actions).push((room_id.into(), member_id.into(), action.cloned()));
    }
}

// ------------------------------------------------------------------------------------------------

/// The state of one fake session.
#[derive(Default)]
pub struct SessionState {
    pub active: bool,
    pub task_id: Option<String>,
    pub execution_generation: Option<i64>,
    pub history: Vec<HistoryMessage>,
    pub on_terminal: Option<TerminalCallback>,
    pub pending_approval: Option<Value>,
}

pub type Hook = Box<dyn Fn() + Send + Sync>;

/// A normalised in-memory session adapter with no model or network.
#[derive(Default)]
pub struct FakeSessionRpc {
    pub auto_complete: bool,
    pub peer: bool,
    pub required_lock: Option<RecordingTurnLocks>,
    pub calls: Mutex<Vec<(String, Value)>>,
    pub sessions: Mutex<HashMap<(String, String), String>>,
    pub states: Mutex<BTreeMap<String, SessionState>>,
    pub submitted: Event,
    pub on_interrupt: Mutex<Option<Hook>>,
    pub on_info: Mutex<Option<Hook>>,
    pub history_failures: AtomicUsize,
    next_id: AtomicUsize,
    /// `resume` answers with this runtime id instead of the stored one.
    pub resume_to: Mutex<Option<String>>,
    /// `info` reports this status.
    pub info_status: Mutex<Option<String>>,
    /// The next interrupts fail.
    pub interrupt_failures: AtomicUsize,
    /// Interrupts after the first wait for this gate.
    pub interrupt_gate: Mutex<Option<Arc<Event>>>,
    /// `interrupt` answers `{"status": …}` without touching the session.
    pub interrupt_status: Mutex<Option<String>>,
    pub interrupt_attempts: AtomicUsize,
    /// The next submits fail as provably not admitted.
    pub not_admitted_failures: AtomicUsize,
    /// The next submits are admitted by the member, then answered with an error (as when the
    /// connection drops after the request was sent): the room cannot tell that it was admitted.
    pub ambiguous_submit_failures: AtomicUsize,
    /// What the next creates answer instead of a session, in order.
    pub create_failures: Mutex<std::collections::VecDeque<PortError>>,
    pub attempted_generations: Mutex<Vec<i64>>,
    /// Turns of these profiles keep running.
    pub waiting_profiles: HashSet<String>,
    /// Turns in these rooms complete right after submit even without auto-complete.
    pub complete_rooms: HashSet<String>,
    /// Records `resolve_exact` times on this clock.
    pub probe_clock: Option<SharedClock>,
    pub resolve_times: Mutex<Vec<f64>>,
    /// What `ledger_attempt` reads, by task id (a member's own ledger; empty: a port without one).
    pub ledger: Mutex<HashMap<String, LedgerAttempt>>,
    /// Whether `ledger` is the member's whole ledger (what it lacks was never admitted).
    pub keeps_ledger: std::sync::atomic::AtomicBool,
    /// `create` sets the first event, then waits for the second before it makes the session.
    pub create_gate: Option<(Arc<Event>, Arc<Event>)>,
    /// What `held` says holds every member session (`None`: nothing does).
    pub held: Mutex<Option<String>>,
    /// Runs (once) when `held` is asked: between the room's read of its head and its start.
    pub on_held: Mutex<Option<Hook>>,
}

impl FakeSessionRpc {
    pub fn new(auto_complete: bool) -> Self {
        Self {
            auto_complete,
            next_id: AtomicUsize::new(1),
            ..Default::default()
        }
    }

    pub fn record(&self, method: &str, params: Value) {
        lock(&self.calls).push((method.into(), params));
    }

    pub fn methods(&self) -> Vec<String> {
        lock(&self.calls).iter().map(|(m, _)| m.clone()).collect()
    }

    pub fn count(&self, method: &str) -> usize {
        lock(&self.calls)
            .iter()
            .filter(|(m, _)| m == method)
            .count()
    }

    pub fn params(&self, method: &str) -> Vec<Value> {
        lock(&self.calls)
            .iter()
            .filter(|(m, _)| m == method)
            .map(|(_, p)| p.clone())
            .collect()
    }

    fn assert_lock(&self, profile: &str) {
        if let Some(locks) = &self.required_lock {
            assert!(
                locks.held_for(profile),
                "turn lock for {profile} is not held"
            );
        }
    }

    pub fn add_session(
        &self,
        active: bool,
        task_id: Option<&str>,
        history: Vec<HistoryMessage>,
    ) -> String {
        self.add_session_for(
            PROFILE,
            &room_session_title(ROOM_ID),
            active,
            task_id,
            history,
        )
    }

    pub fn add_session_for(
        &self,
        profile: &str,
        title: &str,
        active: bool,
        task_id: Option<&str>,
        history: Vec<HistoryMessage>,
    ) -> String {
        let session_id = format!(
            "session-{}",
            self.next_id.fetch_add(1, Ordering::SeqCst).max(1)
        );
        lock(&self.sessions).insert((profile.into(), title.into()), session_id.clone());
        lock(&self.states).insert(
            session_id.clone(),
            SessionState {
                active,
                task_id: task_id.map(Into::into),
                history,
                ..Default::default()
            },
        );
        session_id
    }

    /// Move a session's state to a new runtime id (as a resume after restart may do).
    pub fn rename_state(&self, from: &str, to: &str) {
        let mut states = lock(&self.states);
        if let Some(state) = states.remove(from) {
            states.insert(to.into(), state);
        }
    }

    pub fn first_session(&self) -> String {
        lock(&self.states)
            .keys()
            .next()
            .cloned()
            .expect("a session")
    }

    /// Finish the turn of `task_id`: append its receipt, deactivate, and report it.
    pub fn complete(&self, task_id: &str, content: &str, status: &str) {
        let mut found = None;
        {
            let mut states = lock(&self.states);
            for (session_id, state) in states.iter_mut() {
                if state.task_id.as_deref() != Some(task_id) {
                    continue;
                }
                let message_id = format!("reply:{task_id}");
                state.history.push(HistoryMessage {
                    role: "assistant".into(),
                    task_id: Some(task_id.into()),
                    execution_generation: state.execution_generation,
                    status: Some(status.into()),
                    message_id: Some(message_id.clone()),
                    content: content.into(),
                });
                state.active = false;
                found = Some((session_id.clone(), message_id, state.on_terminal.clone()));
                break;
            }
        }
        let (session_id, message_id, callback) =
            found.unwrap_or_else(|| panic!("no active session for {task_id}"));
        self.record("complete", json!({ "session_id": session_id }));
        if let Some(callback) = callback {
            callback(TerminalReceipt {
                status: status.into(),
                settlement_id: Some(message_id.clone()),
                message_id: Some(message_id),
                text: Some(content.into()),
                error: None,
            });
        }
    }
}

pub fn receipt(task_id: &str, generation: i64, message_id: &str, content: &str) -> HistoryMessage {
    HistoryMessage {
        role: "assistant".into(),
        task_id: Some(task_id.into()),
        execution_generation: Some(generation),
        status: Some("settled".into()),
        message_id: Some(message_id.into()),
        content: content.into(),
    }
}

fn ready<T: Send + 'static>(value: Result<T, PortError>) -> PortFuture<'static, T> {
    Box::pin(std::future::ready(value))
}

impl SessionPort for FakeSessionRpc {
    fn resolve_exact(&self, address: SessionAddress) -> PortFuture<'_, Option<SessionHandle>> {
        self.assert_lock(&address.profile);
        self.record(
            "resolve_exact",
            serde_json::to_value(&address).unwrap_or_default(),
        );
        if let Some(clock) = &self.probe_clock {
            lock(&self.resolve_times).push(clock.now());
        }
        let found = lock(&self.sessions)
            .get(&(address.profile, address.title))
            .cloned();
        ready(Ok(found.map(|session_id| SessionHandle { session_id })))
    }

    fn create(&self, address: SessionAddress) -> PortFuture<'_, SessionHandle> {
        self.assert_lock(&address.profile);
        self.record("create", serde_json::to_value(&address).unwrap_or_default());
        let gate = self.create_gate.clone();
        Box::pin(async move {
            // A failure comes after the gate: a create that fails once it was waited for.
            if let Some((reached, go)) = gate {
                reached.set();
                if !go.wait(Duration::from_secs(10)).await {
                    return Err(PortError::new("the create gate was never opened"));
                }
            }
            if let Some(error) = lock(&self.create_failures).pop_front() {
                return Err(error);
            }
            let session_id =
                self.add_session_for(&address.profile, &address.title, false, None, Vec::new());
            Ok(SessionHandle { session_id })
        })
    }

    fn resume(&self, session: SessionRef) -> PortFuture<'_, SessionHandle> {
        self.assert_lock(&session.profile);
        self.record("resume", serde_json::to_value(&session).unwrap_or_default());
        let session_id = lock(&self.resume_to).clone().unwrap_or(session.session_id);
        ready(Ok(SessionHandle { session_id }))
    }

    fn submit(&self, request: SubmitRequest) -> PortFuture<'_, ()> {
        self.assert_lock(&request.profile);
        lock(&self.attempted_generations).push(request.execution_generation);
        let params = json!({
            "profile": request.profile,
            "session_id": request.session_id,
            "prompt": request.prompt,
            "source": request.source,
            "task_id": request.task.task_id,
            "execution_generation": request.execution_generation,
        });
        self.record("submit", params);
        let failures = self.not_admitted_failures.load(Ordering::SeqCst);
        if failures > 0 {
            self.not_admitted_failures
                .store(failures - 1, Ordering::SeqCst);
            return ready(Err(PortError::not_admitted("peer refused the connection")));
        }
        {
            let mut states = lock(&self.states);
            let Some(state) = states.get_mut(&request.session_id) else {
                return ready(Err(PortError::new("unknown session")));
            };
            state.active = true;
            state.task_id = Some(request.task.task_id.clone());
            state.execution_generation = Some(request.execution_generation);
            state.on_terminal = Some(request.on_terminal.clone());
        }
        self.submitted.set();
        let ambiguous = self.ambiguous_submit_failures.load(Ordering::SeqCst);
        if ambiguous > 0 {
            self.ambiguous_submit_failures
                .store(ambiguous - 1, Ordering::SeqCst);
            return ready(Err(PortError::new(
                "connection reset after the request was sent",
            )));
        }
        let auto = self.auto_complete && !self.waiting_profiles.contains(&request.profile);
        if auto || self.complete_rooms.contains(&request.task.room_id) {
            self.complete(&request.task.task_id, "Finished once.", "settled");
        }
        ready(Ok(()))
    }

    fn history(&self, session: SessionRef) -> PortFuture<'_, Vec<HistoryMessage>> {
        self.assert_lock(&session.profile);
        self.record(
            "history",
            serde_json::to_value(&session).unwrap_or_default(),
        );
        let failures = self.history_failures.load(Ordering::SeqCst);
        if failures > 0 {
            self.history_failures.store(failures - 1, Ordering::SeqCst);
            return ready(Err(PortError::new("transient history read failed")));
        }
        let states = lock(&self.states);
        ready(match states.get(&session.session_id) {
            Some(state) => Ok(state.history.clone()),
            None => Err(PortError::new("unknown session")),
        })
    }

    fn held(&self, address: SessionAddress) -> PortFuture<'_, Option<String>> {
        self.record("held", serde_json::to_value(&address).unwrap_or_default());
        let hook = lock(&self.on_held).take();
        if let Some(hook) = hook {
            hook();
        }
        ready(Ok(lock(&self.held).clone()))
    }

    fn ledger_attempt(
        &self,
        session: SessionRef,
        task: TaskIdentity,
        generation: i64,
    ) -> PortFuture<'_, Option<LedgerAttempt>> {
        self.record(
            "ledger_attempt",
            json!({"session_id": session.session_id, "task_id": task.task_id, "generation": generation}),
        );
        ready(Ok(lock(&self.ledger).get(&task.task_id).cloned()))
    }

    fn info(&self, session: SessionRef) -> PortFuture<'_, SessionInfo> {
        self.assert_lock(&session.profile);
        self.record("info", serde_json::to_value(&session).unwrap_or_default());
        let info = {
            let states = lock(&self.states);
            let Some(state) = states.get(&session.session_id) else {
                return ready(Err(PortError::new("unknown session")));
            };
            let mut info = SessionInfo {
                active: state.active,
                task_id: state.task_id.clone(),
                ..Default::default()
            };
            if let Some(approval) = &state.pending_approval {
                info.status = Some("waiting_for_approval".into());
                info.pending_approval = Some(approval.clone());
            }
            if let Some(status) = lock(&self.info_status).clone() {
                info.status = Some(status);
            }
            info
        };
        if let Some(hook) = lock(&self.on_info).as_ref() {
            hook();
        }
        ready(Ok(info))
    }

    fn interrupt(&self, request: InterruptRequest) -> PortFuture<'_, Option<InterruptReply>> {
        Box::pin(async move {
            let attempt = self.interrupt_attempts.fetch_add(1, Ordering::SeqCst) + 1;
            let failures = self.interrupt_failures.load(Ordering::SeqCst);
            if failures > 0 {
                self.interrupt_failures
                    .store(failures - 1, Ordering::SeqCst);
                return Err(PortError::new("temporary stop transport failure"));
            }
            let gate = lock(&self.interrupt_gate).clone();
            if let Some(gate) = gate {
                if attempt > 1 && !gate.wait(Duration::from_secs(1)).await {
                    return Err(PortError::new("stop retry was not allowed yet"));
                }
            }
            if let Some(status) = lock(&self.interrupt_status).clone() {
                return Ok(Some(InterruptReply {
                    interrupted: None,
                    status: Some(status),
                }));
            }
            let params = serde_json::to_value(&request).unwrap_or_default();
            {
                let mut states = lock(&self.states);
                let Some(state) = states.get_mut(&request.session_id) else {
                    return Err(PortError::new("unknown session"));
                };
                if !state.active
                    || state.task_id.as_deref() != Some(request.expected_task_id.as_str())
                {
                    drop(states);
                    self.record("interrupt_skipped", params);
                    return Ok(Some(InterruptReply {
                        interrupted: Some(false),
                        status: None,
                    }));
                }
                state.active = false;
            }
            self.record("interrupt", params);
            if let Some(hook) = lock(&self.on_interrupt).as_ref() {
                hook();
            }
            Ok(Some(InterruptReply {
                interrupted: Some(true),
                status: None,
            }))
        })
    }

    /// Taken when the session runs the attempt answered about and waits on that request (as
    /// a local member's supervisor fences it); stale otherwise.
    fn answer(&self, answer: ApprovalAnswer) -> PortFuture<'_, AnswerOutcome> {
        Box::pin(async move {
            self.record(
                "answer",
                json!({"session_id": answer.session.session_id, "task_id": answer.task.task_id,
                       "execution_generation": answer.execution_generation,
                       "request_id": answer.request_id, "choice": answer.choice}),
            );
            let mut states = lock(&self.states);
            let Some(state) = states.get_mut(&answer.session.session_id) else {
                return Err(PortError::new("unknown session"));
            };
            let runs_it = state.active
                && state.task_id.as_deref() == Some(answer.task.task_id.as_str())
                && state
                    .execution_generation
                    .is_none_or(|g| g == answer.execution_generation);
            let waits = state
                .pending_approval
                .as_ref()
                .is_some_and(|a| a["request_id"] == answer.request_id.as_str());
            if !(runs_it && waits) {
                return Ok(AnswerOutcome::Stale(
                    "not the running attempt's request".into(),
                ));
            }
            state.pending_approval = None;
            Ok(AnswerOutcome::Resolved)
        })
    }

    fn is_peer(&self) -> bool {
        self.peer
    }

    fn keeps_ledger(&self) -> bool {
        self.keeps_ledger.load(Ordering::SeqCst)
    }
}

// ------------------------------------------------------------------------------------------------

/// A peer client whose terminal history would look failed if it were read first.
pub struct TerminalPeerClient {
    pub task_id: String,
    pub execution_generation: i64,
    pub status_task_id: Mutex<String>,
    pub status_generation: Mutex<i64>,
    pub status_value: Mutex<String>,
    pub history_calls: AtomicUsize,
    /// The dispatches it was sent (each refused as ambiguous).
    pub dispatches: Mutex<Vec<PeerDispatch>>,
}

impl TerminalPeerClient {
    pub fn new(task_id: &str, execution_generation: i64) -> Self {
        Self {
            task_id: task_id.into(),
            execution_generation,
            status_task_id: Mutex::new(task_id.into()),
            status_generation: Mutex::new(execution_generation),
            status_value: Mutex::new("interrupted".into()),
            history_calls: AtomicUsize::new(0),
            dispatches: Mutex::new(Vec::new()),
        }
    }
}

impl PeerClient for TerminalPeerClient {
    fn prepare(&self, _request: PeerPrepare) -> PeerFuture<'_, Option<SessionHandle>> {
        Box::pin(std::future::ready(Ok(Some(SessionHandle {
            session_id: "peer-session".into(),
        }))))
    }

    fn dispatch(&self, request: PeerDispatch) -> PeerFuture<'_, PeerDispatchReply> {
        lock(&self.dispatches).push(request);
        Box::pin(std::future::ready(Err(PeerError::ambiguous(
            "dispatch is not expected",
        ))))
    }

    fn status(&self, _scope: PeerTaskScope) -> PeerFuture<'_, SessionInfo> {
        let info = SessionInfo {
            active: false,
            status: Some(lock(&self.status_value).clone()),
            task_id: Some(lock(&self.status_task_id).clone()),
            execution_generation: Some(*lock(&self.status_generation)),
            ..Default::default()
        };
        Box::pin(std::future::ready(Ok(info)))
    }

    fn history(&self, _scope: PeerTaskScope) -> PeerFuture<'_, Vec<HistoryMessage>> {
        self.history_calls.fetch_add(1, Ordering::SeqCst);
        let mut message = receipt(
            &self.task_id,
            self.execution_generation,
            "peer-interrupted",
            "interrupted",
        );
        message.status = Some("failed".into());
        Box::pin(std::future::ready(Ok(vec![message])))
    }

    fn stop(&self, _dispatch: PeerDispatch) -> PeerFuture<'_, InterruptReply> {
        Box::pin(std::future::ready(Ok(InterruptReply {
            interrupted: None,
            status: Some("stopping".into()),
        })))
    }

    fn stop_receipt(&self, _scope: PeerTaskScope) -> PeerFuture<'_, InterruptReply> {
        Box::pin(std::future::ready(Ok(InterruptReply {
            interrupted: None,
            status: Some("stopping".into()),
        })))
    }
}

/// A resolver that reaches the member through a [`PeerTransport`] over `client`.
pub fn peer_resolver(client: Arc<TerminalPeerClient>) -> TransportResolver {
    let route = PeerMemberRoute {
        home_install_id: "install-home".into(),
        member_id: PROFILE.into(),
        target_install_id: "install-peer".into(),
        target_profile: PROFILE.into(),
        capability_digest: "a".repeat(64),
        execution_policy_digest: "b".repeat(64),
        cancellation_scope_id: "cancel-peer".into(),
        trace_id: "trace-peer".into(),
        grant: "signed-room-grant".into(),
    };
    Arc::new(move |binding: &RoomBinding, task: &TaskView| {
        let transport = PeerTransport::new(
            PeerBinding {
                room_id: binding.room_id.clone(),
                authority_gateway_id: binding.gateway_id.clone(),
                authority_epoch: binding.authority_epoch,
            },
            route.clone(),
            client.clone(),
            task.payload.source_event_seq,
            task.identity.task_id.clone(),
            task.execution_generation,
        );
        Ok(Arc::new(transport) as Arc<dyn SessionPort>)
    })
}

// ------------------------------------------------------------------------------------------------

pub fn identity(task_id: &str) -> TaskIdentity {
    TaskIdentity::new(ROOM_ID, task_id, "thread-1", &format!("turn-{task_id}")).expect("identity")
}

pub fn admit_to(
    db: &TestDb,
    identity: &TaskIdentity,
    profile: &str,
    prompt: &str,
    seq: i64,
    clock: &dyn crate::clock::Clock,
) {
    let payload = TaskPayload {
        target_profile: profile.into(),
        prompt: prompt.into(),
        source_event_seq: seq,
        target_member_id: None,
    };
    admit_task(&mut db.conn(), identity, &payload, clock).expect("admit");
}

pub fn admit(db: &TestDb, identity: &TaskIdentity, prompt: &str) {
    admit_to(db, identity, PROFILE, prompt, 1, &SystemClock::default());
}

pub fn task(db: &TestDb, identity: &TaskIdentity) -> TaskView {
    get_task(&mut db.conn(), identity).expect("task")
}

pub fn status(db: &TestDb, identity: &TaskIdentity) -> TaskStatus {
    task(db, identity).status
}

pub fn lease_for(db: &TestDb, process: &str, ttl: f64, clock: &dyn crate::clock::Clock) -> Lease {
    acquire_lease(&mut db.conn(), ROOM_ID, GATEWAY, 1, process, ttl, clock).expect("lease")
}

/// How to build a runtime for a scenario (defaults: lease TTL 0.4 s, poll 0.01 s, room-1).
pub struct Spec {
    pub config: RoomsConfig,
    pub clock: Option<SharedClock>,
    pub hooks: Option<Arc<RecordingHooks>>,
    pub locks: RecordingTurnLocks,
    /// Turn locks that exclude (instead of `locks`, which records and never waits).
    pub exclusive_locks: Option<Arc<dyn TurnLocks>>,
    pub rpc: Option<Arc<FakeSessionRpc>>,
    pub resolver: Option<TransportResolver>,
    pub bindings: Vec<RoomBinding>,
    /// Where the bindings are read (instead of the fixed `bindings`).
    pub source: Option<BindingSource>,
    pub process_generation: Option<String>,
}

impl Spec {
    pub fn new(rpc: &Arc<FakeSessionRpc>) -> Self {
        Self {
            config: RoomsConfig {
                lease_ttl_seconds: 5.0,
                poll_interval_seconds: 0.01,
                ..Default::default()
            },
            clock: None,
            hooks: None,
            locks: RecordingTurnLocks::default(),
            exclusive_locks: None,
            rpc: Some(rpc.clone()),
            resolver: None,
            bindings: vec![binding()],
            source: None,
            process_generation: None,
        }
    }

    pub fn manual(mut self, clock: &ManualClock) -> Self {
        self.clock = Some(Arc::new(clock.clone()));
        self
    }

    pub fn build(self, db: &TestDb) -> RoomRuntime {
        self.try_build(db).expect("runtime")
    }

    pub fn try_build(self, db: &TestDb) -> Result<RoomRuntime, crate::rooms::RoomsError> {
        let source = match self.source {
            Some(source) => source,
            None => RoomRuntime::fixed_bindings(self.bindings),
        };
        let mut builder = RoomRuntime::builder(db.db.clone(), source)
            .config(self.config)
            .turn_locks(match self.exclusive_locks {
                Some(locks) => locks,
                None => Arc::new(self.locks),
            });
        if let Some(rpc) = self.rpc {
            builder = builder.rpc(rpc);
        }
        if let Some(resolver) = self.resolver {
            builder = builder.transport_resolver(resolver);
        }
        if let Some(clock) = self.clock {
            builder = builder.clock(clock);
        }
        if let Some(hooks) = self.hooks {
            builder = builder.hooks(hooks);
        }
        if let Some(generation) = self.process_generation {
            builder = builder.process_generation(generation);
        }
        builder.build()
    }
}
