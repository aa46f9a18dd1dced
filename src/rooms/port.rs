//! What the room runtime needs from the outside: a [`SessionPort`] to reach a member's room
//! session (the local adapter over the session authority, or a [`PeerTransport`] for a member on
//! another gateway), a [`PeerClient`] for the latter, and [`TurnLocks`] (one turn per profile).
//!
//! The traits are object-safe and return boxed futures, so an implementation may be async
//! (`Box::pin(async move { … })`) or answer at once (`Box::pin(std::future::ready(…))`).

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use crate::store::room_tasks::TaskIdentity;

/// The session source of every room session.
pub const ROOM_SESSION_SOURCE: &str = "bot_room";

/// The title of a room's session for a member: `Group: <room_id>`.
pub fn room_session_title(room_id: &str) -> String {
    format!("Group: {room_id}")
}

/// A boxed, sendable future returning a port result.
pub type PortFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, PortError>> + Send + 'a>>;

/// A failure of a session port call.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct PortError {
    pub message: String,
    /// True only when the request provably never reached the member (so it may be retried
    /// without risking a second execution).
    pub not_admitted: bool,
}

impl PortError {
    pub fn new(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            not_admitted: false,
        }
    }

    pub fn not_admitted(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            not_admitted: true,
        }
    }
}

/// Where a room session lives: profile, title and source (never model or provider overrides).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionAddress {
    pub profile: String,
    pub title: String,
    pub source: String,
}

/// A known session.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionRef {
    pub profile: String,
    pub session_id: String,
    pub source: String,
}

/// A session as returned by resolve/create/resume. After `resume` callers use the returned id,
/// which may differ from the stored one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionHandle {
    pub session_id: String,
}

/// A terminal report of a submitted turn.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct TerminalReceipt {
    /// settled, failed, cancelled or interrupted.
    pub status: String,
    pub settlement_id: Option<String>,
    pub message_id: Option<String>,
    pub text: Option<String>,
    pub error: Option<String>,
}

/// Called once a submitted turn ends (possibly synchronously inside `submit`, or later from any
/// thread).
pub type TerminalCallback = Arc<dyn Fn(TerminalReceipt) + Send + Sync>;

/// One member turn to submit.
#[derive(Clone)]
pub struct SubmitRequest {
    pub profile: String,
    pub session_id: String,
    /// The task's prompt, verbatim.
    pub prompt: String,
    pub source: String,
    pub task: TaskIdentity,
    pub execution_generation: i64,
    pub on_terminal: TerminalCallback,
}

impl std::fmt::Debug for SubmitRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SubmitRequest")
            .field("profile", &self.profile)
            .field("session_id", &self.session_id)
            .field("source", &self.source)
            .field("task", &self.task)
            .field("execution_generation", &self.execution_generation)
            .finish_non_exhaustive()
    }
}

/// A transcript message. Assistant receipts carry the task id, execution generation and status.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct HistoryMessage {
    pub role: String,
    pub task_id: Option<String>,
    pub execution_generation: Option<i64>,
    pub status: Option<String>,
    pub message_id: Option<String>,
    pub content: String,
}

/// The newest assistant receipt of exactly this task attempt.
pub fn exact_receipt(
    history: &[HistoryMessage],
    task_id: &str,
    generation: i64,
) -> Option<HistoryMessage> {
    history
        .iter()
        .rev()
        .find(|m| {
            m.role == "assistant"
                && m.task_id.as_deref() == Some(task_id)
                && m.execution_generation == Some(generation)
                && matches!(m.status.as_deref(), Some("settled" | "failed"))
        })
        .cloned()
}

/// Live information about a session.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct SessionInfo {
    /// A turn is in flight.
    pub active: bool,
    pub task_id: Option<String>,
    /// e.g. `waiting_for_approval`, `cancelled`, `interrupted`.
    pub status: Option<String>,
    pub execution_generation: Option<i64>,
    pub pending_approval: Option<serde_json::Value>,
    pub run_id: Option<String>,
}

/// Interrupt the session's current turn, only if it is `expected_task_id`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InterruptRequest {
    pub profile: String,
    pub session_id: String,
    pub source: String,
    pub expected_task_id: String,
}

/// A human's answer to the approval a member's attempt waits on (`room.respond`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApprovalAnswer {
    pub session: SessionRef,
    /// The attempt answered about: its task and the task's execution generation.
    pub task: TaskIdentity,
    pub execution_generation: i64,
    /// The member's name for the request (a `room.pending_action`'s `request_id`).
    pub request_id: String,
    /// `once` or `deny`: a room's member is never approved beyond the one command.
    pub choice: String,
    /// Who answered, recorded with the prompt's resolution.
    pub by: String,
}

/// How a member took an [`ApprovalAnswer`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AnswerOutcome {
    /// The attempt recorded the answer and acts on it.
    Resolved,
    /// The request had already ended (answered, timed out, or its turn stopped waiting).
    AlreadyResolved,
    /// The member's running turn is not the attempt answered about, or is being stopped.
    Stale(String),
    /// Refused as asked: not an approval, a choice the request does not offer, a transport
    /// that takes no answers.
    Refused(String),
}

/// Reply to an interrupt.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct InterruptReply {
    pub interrupted: Option<bool>,
    pub status: Option<String>,
}

impl InterruptReply {
    /// Acknowledged iff `interrupted: true` or a terminal stop status. A provisional
    /// `{"status": "stopping"}` is not an acknowledgement.
    pub fn acknowledged(&self) -> bool {
        self.interrupted == Some(true)
            || matches!(self.status.as_deref(), Some("cancelled" | "interrupted"))
    }
}

/// A member's room session, reached through the session authority (locally) or a peer.
pub trait SessionPort: Send + Sync {
    /// The session with exactly this title under this profile, if any.
    fn resolve_exact(&self, address: SessionAddress) -> PortFuture<'_, Option<SessionHandle>>;
    /// A new session with this title.
    fn create(&self, address: SessionAddress) -> PortFuture<'_, SessionHandle>;
    /// Make a stored session live; use the returned id from then on.
    fn resume(&self, session: SessionRef) -> PortFuture<'_, SessionHandle>;
    /// [`SessionPort::resolve_exact`], then [`SessionPort::resume`] of what it found: the live
    /// session with this title, if any. A port that can do both in one step should (each
    /// attempt opens its session so).
    fn resolve_and_resume(&self, address: SessionAddress) -> PortFuture<'_, Option<SessionHandle>> {
        Box::pin(async move {
            let Some(found) = self.resolve_exact(address.clone()).await? else {
                return Ok(None);
            };
            let session = SessionRef {
                profile: address.profile,
                session_id: found.session_id,
                source: address.source,
            };
            self.resume(session).await.map(Some)
        })
    }
    /// Submit one turn. Must either fail before admission (`not_admitted`) or return after it;
    /// reports the end through `on_terminal`.
    fn submit(&self, request: SubmitRequest) -> PortFuture<'_, ()>;
    /// The session's messages, oldest first.
    fn history(&self, session: SessionRef) -> PortFuture<'_, Vec<HistoryMessage>>;
    /// The session's receipt of exactly this attempt ([`exact_receipt`]), if it has one. The
    /// default reads the whole history; a port that can look one attempt up should, since an
    /// attempt's observer asks on every wakeup and a member's history only grows.
    fn receipt(
        &self,
        session: SessionRef,
        task: TaskIdentity,
        generation: i64,
    ) -> PortFuture<'_, Option<HistoryMessage>> {
        Box::pin(async move {
            let history = self.history(session).await?;
            Ok(exact_receipt(&history, &task.task_id, generation))
        })
    }
    /// What the member's own ledger says of exactly this attempt, for a port that reads it
    /// whole and cheaply: what recovery uses to resolve an abandoned local attempt at once, or
    /// to hold its room while the member's operator has still to resolve it or while the
    /// attempt waits in the member's queue, instead of deferring it (`None`: the member never
    /// admitted it). The default knows nothing (`None`), so a port without such a ledger
    /// recovers as the contract says (live probes, then deferral).
    fn ledger_attempt(
        &self,
        _session: SessionRef,
        _task: TaskIdentity,
        _generation: i64,
    ) -> PortFuture<'_, Option<LedgerAttempt>> {
        Box::pin(async { Ok(None) })
    }
    /// Withdraw exactly this attempt if it was admitted and has not started (queued behind
    /// other work, or behind an `unknown` turn the member's operator has still to resolve), so
    /// a stop acknowledged now can never be followed by the turn running later. `None`: no such
    /// admission; `Some(true)`: it will not start (withdrawn now, ended, or unknown);
    /// `Some(false)`: it has started (interrupt it instead). The default, for a port with no
    /// queue it can reach, knows of no admission.
    fn withdraw_queued(
        &self,
        _session: SessionRef,
        _task: TaskIdentity,
        _generation: i64,
    ) -> PortFuture<'_, Option<bool>> {
        Box::pin(async { Ok(None) })
    }
    /// Why the member's session for `address` would not start a new turn now, if it would
    /// not: what holds it and what frees it, for the room to say while its next task waits in
    /// the room (where a cancel ends it at once and no deadline runs) instead of in the member's
    /// queue. The local port names an `unknown` turn and the `gatehouse resolve-unknown` command
    /// that frees the session; the default (a peer, whose own gateway reports its sessions)
    /// knows of nothing.
    fn held(&self, _address: SessionAddress) -> PortFuture<'_, Option<String>> {
        Box::pin(async { Ok(None) })
    }
    /// Live session information.
    fn info(&self, session: SessionRef) -> PortFuture<'_, SessionInfo>;
    /// Interrupt the current turn if it is the expected task. `None` means no acknowledgement.
    fn interrupt(&self, request: InterruptRequest) -> PortFuture<'_, Option<InterruptReply>>;
    /// Hand a human's answer to the approval the member's running turn waits on, only if that
    /// turn is exactly the attempt answered about. The default (a peer, whose protocol carries
    /// no answers) refuses it.
    fn answer(&self, _answer: ApprovalAnswer) -> PortFuture<'_, AnswerOutcome> {
        Box::pin(async {
            Ok(AnswerOutcome::Refused(
                "this member's transport takes no answers to its approvals".into(),
            ))
        })
    }
    /// True for a member on another gateway (recovery probes and stop acknowledgements differ).
    fn is_peer(&self) -> bool {
        false
    }
    /// True when [`SessionPort::ledger_attempt`] reads the member's own ledger, so its `None`
    /// proves the member never admitted the attempt (the default knows nothing).
    fn keeps_ledger(&self) -> bool {
        false
    }
    /// [`SessionPort::ledger_attempt`], read after every write the member has queued (an
    /// admission a submit asked for may still be on its way to the ledger): what a `None` may
    /// be taken to prove. The default reads as `ledger_attempt` does.
    fn ledger_attempt_settled(
        &self,
        session: SessionRef,
        task: TaskIdentity,
        generation: i64,
    ) -> PortFuture<'_, Option<LedgerAttempt>> {
        self.ledger_attempt(session, task, generation)
    }
    /// Whether a member of `profile` can run here (`None`: this port cannot tell).
    fn has_profile(&self, _profile: &str) -> Option<bool> {
        None
    }
}

/// An attempt as its member's ledger has it ([`SessionPort::ledger_attempt`]).
#[derive(Debug, Clone, PartialEq)]
pub enum LedgerAttempt {
    /// It ended so: settled, failed, cancelled or interrupted.
    Ended(TerminalReceipt),
    /// A crash cut it short and nobody knows how far it got: it holds the member's session
    /// until the member's operator resolves it (`unknown`). What to resolve, as the operator
    /// names it (`gatehouse resolve-unknown SESSION ADMISSION`).
    Unresolved {
        session_id: String,
        admission_id: String,
    },
    /// It has not ended and will by itself: queued in the member's session (behind another
    /// turn, or behind an `unknown` one the member's operator has to resolve), or running. A new
    /// attempt would run the task's prompt a second time.
    Live {
        session_id: String,
        admission_id: String,
        /// When the member began it (its claim, by the member's clock); `None` while it waits
        /// in the member's queue.
        started: Option<f64>,
    },
}

/// A held turn lock; dropping it releases the lock.
pub type TurnGuard = Box<dyn Send>;

/// One turn at a time per profile: held for resolve → submit → observation of a member turn.
pub trait TurnLocks: Send + Sync {
    fn lock(&self, profile: String) -> Pin<Box<dyn Future<Output = TurnGuard> + Send + '_>>;

    /// The lock if it is free now, without waiting (a room whose member is busy with another
    /// room's turn does not wait for it in a scheduler slot). By default, `lock` polled once,
    /// which suits a lock whose future gives up its place in the queue when dropped.
    fn try_lock(&self, profile: String) -> Option<TurnGuard> {
        use futures_util::FutureExt;
        self.lock(profile).now_or_never()
    }
}

/// The default [`TurnLocks`]: an async mutex per profile.
#[derive(Debug, Default)]
pub struct ProfileTurnLocks {
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

impl ProfileTurnLocks {
    /// `profile`'s mutex (made on first use).
    fn mutex_for(&self, profile: String) -> Arc<tokio::sync::Mutex<()>> {
        let mut locks = self.locks.lock().unwrap_or_else(|e| e.into_inner());
        locks.entry(profile).or_default().clone()
    }
}

impl TurnLocks for ProfileTurnLocks {
    fn lock(&self, profile: String) -> Pin<Box<dyn Future<Output = TurnGuard> + Send + '_>> {
        let mutex = self.mutex_for(profile);
        Box::pin(async move { Box::new(mutex.lock_owned().await) as TurnGuard })
    }

    fn try_lock(&self, profile: String) -> Option<TurnGuard> {
        let guard = self.mutex_for(profile).try_lock_owned().ok()?;
        Some(Box::new(guard) as TurnGuard)
    }
}

// ------------------------------------------------------------------------------------------------
// Peers

/// A failure talking to a peer gateway.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct PeerError {
    pub message: String,
    pub retryable: bool,
    /// The peer may or may not have acted on the request.
    pub ambiguous: bool,
    /// The request provably never reached the peer (DNS failure, connection refused, network or
    /// host unreachable).
    pub not_admitted: bool,
    pub status_code: Option<u16>,
    pub error_code: Option<String>,
}

impl PeerError {
    /// A connection-level failure that proves the request never reached the peer.
    pub fn not_admitted(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            retryable: true,
            ambiguous: false,
            not_admitted: true,
            status_code: None,
            error_code: None,
        }
    }

    /// A failure after which the peer may have acted.
    pub fn ambiguous(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            retryable: true,
            ambiguous: true,
            not_admitted: false,
            status_code: None,
            error_code: None,
        }
    }
}

impl From<PeerError> for PortError {
    fn from(error: PeerError) -> Self {
        Self {
            message: error.message,
            not_admitted: error.not_admitted,
        }
    }
}

/// A boxed, sendable future returning a peer result.
pub type PeerFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, PeerError>> + Send + 'a>>;

/// How this gateway reaches one member hosted on a peer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerMemberRoute {
    pub home_install_id: String,
    pub member_id: String,
    pub target_install_id: String,
    pub target_profile: String,
    pub capability_digest: String,
    pub execution_policy_digest: String,
    pub cancellation_scope_id: String,
    pub trace_id: String,
    pub grant: String,
}

/// Open (or create) the member's room session on the peer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerPrepare {
    pub room_id: String,
    pub profile: String,
    pub source: String,
    pub grant: String,
    pub create: bool,
    pub expected_session_id: Option<String>,
}

/// A fenced member dispatch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerDispatch {
    pub room_id: String,
    pub home_install_id: String,
    pub target_install_id: String,
    pub authority_gateway_id: String,
    pub authority_epoch: i64,
    pub member_id: String,
    pub profile: String,
    pub session_id: String,
    pub task_id: String,
    pub execution_generation: i64,
    pub source_event_seq: i64,
    pub cancellation_scope_id: String,
    pub prompt: String,
    pub prompt_sha256: String,
    pub capability_digest: String,
    pub execution_policy_digest: String,
    pub trace_id: String,
    pub grant: String,
}

/// A status/history/stop request scoped to one task attempt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerTaskScope {
    pub room_id: String,
    pub session_id: String,
    pub task_id: String,
    pub execution_generation: i64,
    pub grant: String,
}

/// The peer's answer to a dispatch: `accepted`, or already terminal (settled, failed, cancelled).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct PeerDispatchReply {
    pub status: String,
    pub settlement_id: Option<String>,
    pub message_id: Option<String>,
    pub text: Option<String>,
    pub error: Option<String>,
}

/// A client of a peer gateway's member runs.
pub trait PeerClient: Send + Sync {
    fn prepare(&self, request: PeerPrepare) -> PeerFuture<'_, Option<SessionHandle>>;
    fn dispatch(&self, request: PeerDispatch) -> PeerFuture<'_, PeerDispatchReply>;
    fn status(&self, scope: PeerTaskScope) -> PeerFuture<'_, SessionInfo>;
    fn history(&self, scope: PeerTaskScope) -> PeerFuture<'_, Vec<HistoryMessage>>;
    fn stop(&self, dispatch: PeerDispatch) -> PeerFuture<'_, InterruptReply>;
    /// Stop by receipt (after a restart, when the dispatch is no longer in memory).
    fn stop_receipt(&self, scope: PeerTaskScope) -> PeerFuture<'_, InterruptReply>;
}

/// The room binding a peer transport serves.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerBinding {
    pub room_id: String,
    pub authority_gateway_id: String,
    pub authority_epoch: i64,
}

/// A [`SessionPort`] over a [`PeerClient`], scoped to one room task attempt.
pub struct PeerTransport {
    binding: PeerBinding,
    route: PeerMemberRoute,
    client: Arc<dyn PeerClient>,
    source_event_seq: i64,
    task_id: String,
    execution_generation: i64,
    dispatched: Mutex<Option<PeerDispatch>>,
}

impl PeerTransport {
    pub fn new(
        binding: PeerBinding,
        route: PeerMemberRoute,
        client: Arc<dyn PeerClient>,
        source_event_seq: i64,
        task_id: String,
        execution_generation: i64,
    ) -> Self {
        Self {
            binding,
            route,
            client,
            source_event_seq,
            task_id,
            execution_generation,
            dispatched: Mutex::new(None),
        }
    }

    fn check(&self, profile: &str, source: &str, title: Option<&str>) -> Result<(), PortError> {
        if source != ROOM_SESSION_SOURCE {
            return Err(PortError::new("peer transport serves only room sessions"));
        }
        if profile != self.route.target_profile {
            return Err(PortError::new(
                "peer transport profile does not match the member route",
            ));
        }
        if let Some(title) = title {
            if title != room_session_title(&self.binding.room_id) {
                return Err(PortError::new(
                    "peer transport title does not match the room",
                ));
            }
        }
        Ok(())
    }

    fn scope(&self, session_id: &str) -> PeerTaskScope {
        PeerTaskScope {
            room_id: self.binding.room_id.clone(),
            session_id: session_id.to_string(),
            task_id: self.task_id.clone(),
            execution_generation: self.execution_generation,
            grant: self.route.grant.clone(),
        }
    }

    fn prepare(
        &self,
        profile: &str,
        source: &str,
        create: bool,
        expected: Option<String>,
    ) -> PeerPrepare {
        PeerPrepare {
            room_id: self.binding.room_id.clone(),
            profile: profile.to_string(),
            source: source.to_string(),
            grant: self.route.grant.clone(),
            create,
            expected_session_id: expected,
        }
    }
}

fn required(handle: Option<SessionHandle>) -> Result<SessionHandle, PortError> {
    handle
        .filter(|h| !h.session_id.is_empty())
        .ok_or_else(|| PortError::new("session adapter returned no session_id"))
}

impl SessionPort for PeerTransport {
    fn resolve_exact(&self, address: SessionAddress) -> PortFuture<'_, Option<SessionHandle>> {
        Box::pin(async move {
            self.check(&address.profile, &address.source, Some(&address.title))?;
            Ok(self
                .client
                .prepare(self.prepare(&address.profile, &address.source, false, None))
                .await?)
        })
    }

    fn create(&self, address: SessionAddress) -> PortFuture<'_, SessionHandle> {
        Box::pin(async move {
            self.check(&address.profile, &address.source, Some(&address.title))?;
            required(
                self.client
                    .prepare(self.prepare(&address.profile, &address.source, true, None))
                    .await?,
            )
        })
    }

    fn resume(&self, session: SessionRef) -> PortFuture<'_, SessionHandle> {
        Box::pin(async move {
            self.check(&session.profile, &session.source, None)?;
            let request = self.prepare(
                &session.profile,
                &session.source,
                false,
                Some(session.session_id.clone()),
            );
            required(self.client.prepare(request).await?)
        })
    }

    fn submit(&self, request: SubmitRequest) -> PortFuture<'_, ()> {
        Box::pin(async move {
            self.check(&request.profile, &request.source, None)?;
            if request.task.task_id != self.task_id
                || request.execution_generation != self.execution_generation
            {
                return Err(PortError::not_admitted(
                    "peer transport is bound to a different task attempt",
                ));
            }
            let prompt_sha256 = crate::store::rooms::sha256_hex(&request.prompt);
            let dispatch = PeerDispatch {
                room_id: self.binding.room_id.clone(),
                home_install_id: self.route.home_install_id.clone(),
                target_install_id: self.route.target_install_id.clone(),
                authority_gateway_id: self.binding.authority_gateway_id.clone(),
                authority_epoch: self.binding.authority_epoch,
                member_id: self.route.member_id.clone(),
                profile: request.profile.clone(),
                session_id: request.session_id.clone(),
                task_id: self.task_id.clone(),
                execution_generation: self.execution_generation,
                source_event_seq: self.source_event_seq,
                cancellation_scope_id: self.route.cancellation_scope_id.clone(),
                prompt: request.prompt.clone(),
                prompt_sha256,
                capability_digest: self.route.capability_digest.clone(),
                execution_policy_digest: self.route.execution_policy_digest.clone(),
                trace_id: self.route.trace_id.clone(),
                grant: self.route.grant.clone(),
            };
            *self.dispatched.lock().unwrap_or_else(|e| e.into_inner()) = Some(dispatch.clone());
            let reply = self.client.dispatch(dispatch).await?;
            if matches!(reply.status.as_str(), "settled" | "failed" | "cancelled") {
                let receipt = TerminalReceipt {
                    status: reply.status,
                    settlement_id: reply.settlement_id,
                    message_id: reply.message_id,
                    text: reply.text,
                    error: reply.error,
                };
                // The callback commits the room's settlement: on the blocking pool, as the
                // local port's does, not on the thread that runs the room's pass (and session
                // supervisors), which would wait there for the writer and its fsync.
                let callback = request.on_terminal.clone();
                let _ = tokio::task::spawn_blocking(move || callback(receipt)).await;
            }
            Ok(())
        })
    }

    fn history(&self, session: SessionRef) -> PortFuture<'_, Vec<HistoryMessage>> {
        Box::pin(async move {
            self.check(&session.profile, &session.source, None)?;
            Ok(self.client.history(self.scope(&session.session_id)).await?)
        })
    }

    fn info(&self, session: SessionRef) -> PortFuture<'_, SessionInfo> {
        Box::pin(async move {
            self.check(&session.profile, &session.source, None)?;
            Ok(self.client.status(self.scope(&session.session_id)).await?)
        })
    }

    fn interrupt(&self, request: InterruptRequest) -> PortFuture<'_, Option<InterruptReply>> {
        Box::pin(async move {
            self.check(&request.profile, &request.source, None)?;
            if request.expected_task_id != self.task_id {
                return Ok(None);
            }
            let dispatched = self
                .dispatched
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone();
            let reply = match dispatched {
                Some(dispatch) => self.client.stop(dispatch).await?,
                None => {
                    self.client
                        .stop_receipt(self.scope(&request.session_id))
                        .await?
                }
            };
            Ok(Some(reply))
        })
    }

    fn is_peer(&self) -> bool {
        true
    }
}
