//! One pass of one room (`process_room`), in this order: prepare hook; inspection of attempts
//! abandoned by another process (live probe only for local sessions, never a resubmit); lease;
//! recovery once per lease generation; retries of durable stops; reconciliation of indeterminate
//! attempts (deferred after `indeterminate_defer_seconds`); then queued tasks in room order, each
//! observed to its end under the member's turn lock, with its deadline enforced. The lock is
//! taken before the task starts and without waiting: while another room's turn holds it, the
//! task stays queued and the pass ends, so rooms that wait for a member hold no scheduler slot.

use std::sync::Arc;
use std::time::Duration;

use crate::rooms::bound::{bound_text, bounded_result, MAX_TERMINAL_ERROR_BYTES};
use crate::rooms::port::{
    room_session_title, AnswerOutcome, ApprovalAnswer, HistoryMessage, InterruptRequest,
    LedgerAttempt, PortError, SessionAddress, SessionInfo, SessionPort, SessionRef, SubmitRequest,
    TerminalCallback, TerminalReceipt, TurnGuard, ROOM_SESSION_SOURCE,
};
use crate::rooms::runtime::{
    Backoff, RoomBinding, RoomRuntime, RoomWaker, RoomsError, DISBAND_CANCEL_ID,
};
use crate::store::leases::{acquire_lease, release_lease, renew_lease, Lease};
use crate::store::room_tasks::{
    complete_task_cancel, count_tasks_by_status, defer_indeterminate_task, first_task, get_task,
    list_tasks, recover_room, requeue_not_admitted_task, resolve_indeterminate_cancellation,
    resolve_indeterminate_task, settle_stopping_task, settle_task, start_task, Settlement,
    SettlementStatus, TaskAttempt, TaskIdentity, TaskStatus, TaskView,
};
use crate::store::rooms::{disband_room, get_room, validate_identifier, RoomStoreError};

/// The result of a failed deadline, as stored.
pub const DEADLINE_ERROR: &str =
    "This Group Chat turn exceeded its configured time limit and was stopped.";
/// The reason code of a failed deadline.
pub const DEADLINE_REASON_CODE: &str = "turn_deadline_exceeded";
/// The reason a parked attempt was deferred.
pub const MEMBER_UNAVAILABLE: &str = "member_unavailable";

/// How long an operator's retry waits for its task's member while another room's turn holds it
/// (the CLI gives up on an answer after 30 s): past it the retry is refused, having done nothing,
/// rather than made later, after its caller was told it failed.
#[cfg(not(test))]
const RETRY_MEMBER_WAIT: Duration = Duration::from_secs(10);
#[cfg(test)]
const RETRY_MEMBER_WAIT: Duration = Duration::from_millis(300);

/// What a recovery probe saw.
#[derive(Debug, Clone, Default)]
pub(crate) struct Probe {
    pub receipt: Option<HistoryMessage>,
    pub info: Option<SessionInfo>,
    /// What the member's own ledger says of the attempt ([`SessionPort::ledger_attempt`]).
    pub ledger: Option<LedgerAttempt>,
}

impl Probe {
    /// The session is busy with this task (or with an unnamed one).
    pub fn running(&self, task_id: &str) -> bool {
        self.info
            .as_ref()
            .is_some_and(|info| running_for(info, task_id))
    }

    /// The attempt has not ended and will by itself: its member runs it, or the member's ledger
    /// holds it queued (behind another turn) or running. A new attempt would run it twice.
    pub fn active_for(&self, task_id: &str) -> bool {
        self.running(task_id) || matches!(self.ledger, Some(LedgerAttempt::Live { .. }))
    }

    pub fn status(&self) -> Option<&str> {
        self.info.as_ref().and_then(|info| info.status.as_deref())
    }

    /// The attempt's receipt, if the member's ledger says it settled.
    pub fn settled(self) -> Option<TerminalReceipt> {
        match self.ledger {
            Some(LedgerAttempt::Ended(ended)) if ended.status == "settled" => Some(ended),
            _ => None,
        }
    }
}

/// `info`'s session is busy with `task_id` (or with an unnamed task).
fn running_for(info: &SessionInfo, task_id: &str) -> bool {
    info.active && info.task_id.as_deref().is_none_or(|id| id == task_id)
}

/// How a stop attempt ended.
pub(crate) enum StopOutcome {
    Resolved,
    Pending,
}

fn settlement_id_for(candidate: Option<&str>, task_id: &str, generation: i64) -> String {
    candidate
        .and_then(|id| validate_identifier("settlement_id", id).ok())
        .unwrap_or_else(|| attempt_id("reply", task_id, generation))
}

/// An id the driver makes for an attempt's settlement: `KIND:TASK:GENERATION`, or, when that
/// would pass the 128 characters an identifier may have (a task id may have 128 itself),
/// `KIND:GENERATION:` and a digest of the task id. Refused as too long, the settlement could
/// never be recorded: the task was started again and again, or held its member to its deadline.
pub(crate) fn attempt_id(kind: &str, task_id: &str, generation: i64) -> String {
    let id = format!("{kind}:{task_id}:{generation}");
    if id.len() <= 128 {
        return id;
    }
    let hex = crate::store::rooms::sha256_hex(task_id);
    format!("{kind}:{generation}:{}", &hex[..32])
}

/// A settlement built from a history receipt (serialises identically to the callback's).
pub(crate) fn settlement_from_history(message: &HistoryMessage) -> Settlement {
    let task_id = message.task_id.clone().unwrap_or_default();
    let generation = message.execution_generation.unwrap_or_default();
    let settlement_id = settlement_id_for(message.message_id.as_deref(), &task_id, generation);
    let message_id = message
        .message_id
        .clone()
        .unwrap_or_else(|| settlement_id.clone());
    // A failed receipt's content is its error, and is recorded as the error, as the callback
    // records the same receipt: the two paths race to settle an attempt, and must write the
    // same result (the second is then an idempotent replay, not a conflict).
    let settled = message.status.as_deref() == Some("settled");
    let (text, error) = if settled {
        (message.content.as_str(), None)
    } else {
        ("", Some(message.content.as_str()))
    };
    Settlement {
        settlement_id,
        status: if settled {
            SettlementStatus::Settled
        } else {
            SettlementStatus::Failed
        },
        result: bounded_result(&message_id, text, error),
    }
}

pub(crate) fn settlement_from_receipt(
    receipt: &TerminalReceipt,
    task_id: &str,
    generation: i64,
) -> Settlement {
    let settlement_id = settlement_id_for(
        receipt
            .settlement_id
            .as_deref()
            .or(receipt.message_id.as_deref()),
        task_id,
        generation,
    );
    let message_id = receipt
        .message_id
        .clone()
        .unwrap_or_else(|| settlement_id.clone());
    Settlement {
        settlement_id,
        status: if receipt.status == "settled" {
            SettlementStatus::Settled
        } else {
            SettlementStatus::Failed
        },
        result: bounded_result(
            &message_id,
            receipt.text.as_deref().unwrap_or(""),
            receipt.error.as_deref(),
        ),
    }
}

/// The settlement of an attempt that ended as `ended` says (an interrupted or cancelled one
/// fails, and says so when its receipt does not).
fn settlement_from_ended(mut ended: TerminalReceipt, task_id: &str, generation: i64) -> Settlement {
    if ended.status != "settled" && ended.error.as_deref().is_none_or(str::is_empty) {
        ended.error = Some(format!("the member's turn was {}", ended.status));
    }
    settlement_from_receipt(&ended, task_id, generation)
}

/// A room's tasks counted by status.
struct TaskCounts(std::collections::BTreeMap<String, i64>);

impl TaskCounts {
    fn has(&self, status: TaskStatus) -> bool {
        self.0.get(status.as_str()).is_some_and(|n| *n > 0)
    }

    /// Nothing for a pass to do: no task waits, runs, stops, or waits to be reconciled (a
    /// deferred one waits for an operator's retry, which wakes the room).
    fn idle(&self) -> bool {
        use TaskStatus::*;
        [Queued, Running, Stopping, Indeterminate]
            .into_iter()
            .all(|status| !self.has(status))
    }
}

fn is_lease_loss(error: &RoomStoreError) -> bool {
    matches!(
        error,
        RoomStoreError::StaleLease(_) | RoomStoreError::RoomUnavailable(_)
    )
}

/// Whether the store refused a write because of the room's disband: it is retired (every lease
/// check refuses it from then on) or its disband fence refused new work. Not an error of the
/// room: the disband ended (or is ending) the attempt. It races every commit of an attempt the
/// disband stops: the member's late terminal report of the interrupted turn, or its observer's
/// next commit, lands after `room.disband` (or the room's pass) has already retired the room.
pub(crate) fn ended_by_disband(error: &RoomStoreError) -> bool {
    matches!(error, RoomStoreError::RoomUnavailable(_))
}

/// What a room says of task `task_id` whose member holds its turn `unknown`: what its member's
/// operator runs to end it.
fn unresolved_member(task_id: &str, session_id: &str, admission_id: &str) -> String {
    format!(
        "task {task_id} waits for the operator to resolve its member's unknown turn: gatehouse \
         resolve-unknown {session_id} {admission_id}"
    )
}

/// What a member's own ledger says of an observed attempt its member no longer runs.
enum InLedger {
    /// Stopped outside the room: the task is settled from the ledger.
    Settled,
    /// Held `unknown`, for the member's operator (what to tell them).
    Unresolved(String),
    /// Nothing to act on here.
    Other,
}

/// What [`RoomRuntime::keep_lease_for`] found of an observed attempt's lease.
enum LeaseKept {
    /// Held (renewed if it was due).
    Held,
    /// Gone: lost, replaced, or the room retired; the attempt is fenced out.
    Lost,
    /// Due, and the store failed its renewal: held until it expires, renewed again next time.
    NotRenewed,
}

/// A member's turn lock as a room holds it. Dropping it releases the lock and then wakes the
/// rooms whose pass found it held ([`RoomRuntime::try_turn`]), so their queued heads are taken
/// up as soon as the member is free, not at the next poll round.
pub(crate) struct HeldTurn {
    guard: Option<TurnGuard>,
    runtime: RoomRuntime,
    profile: String,
    room_id: String,
}

impl Drop for HeldTurn {
    fn drop(&mut self) {
        drop(self.guard.take());
        let waiting = self
            .runtime
            .state()
            .turn_waiters
            .remove(&self.profile)
            .unwrap_or_default();
        if waiting.iter().any(|room| room != &self.room_id) {
            self.runtime
                .state()
                .turn_yielded
                .insert(self.room_id.clone());
        }
        for room in &waiting {
            self.runtime.wake_room(room);
        }
    }
}

/// An attempt of a task being started by this process, until its submission has answered
/// ([`RuntimeState::submitting`](super::runtime::RuntimeState)); dropping it ends that.
pub(crate) struct Submitting {
    runtime: RoomRuntime,
    key: (String, String),
}

impl Submitting {
    fn new(runtime: &RoomRuntime, identity: &crate::store::room_tasks::TaskIdentity) -> Submitting {
        let key = (identity.room_id.clone(), identity.task_id.clone());
        runtime.state().submitting.insert(key.clone());
        Submitting {
            runtime: runtime.clone(),
            key,
        }
    }
}

impl Drop for Submitting {
    fn drop(&mut self) {
        self.runtime.state().submitting.remove(&self.key);
    }
}

impl RoomRuntime {
    /// One pass of one room. Errors are recorded in `status().last_error`, never raised.
    pub async fn process_room(&self, binding: &RoomBinding) {
        self.state().passes += 1;
        let mut pass = self.process_room_inner(binding).await;
        if pass.is_ok() && binding.disbanding {
            pass = self.carry_out_disband(binding).await;
        }
        match pass {
            Ok(()) => {}
            Err(RoomsError::Store(RoomStoreError::LeaseHeld(_))) => {}
            Err(RoomsError::Store(error)) if is_lease_loss(&error) => {
                // The room's disband fence (or its retirement) ended the pass: no error. A
                // retired room is forgotten; a disbanding one is carried out by its next pass,
                // which the bindings read again by a round see disbanding.
                if matches!(error, RoomStoreError::RoomUnavailable(_)) {
                    if let Some(retired) = self.disband_raised(&binding.room_id).await {
                        tracing::debug!(
                            target: "gatehouse::rooms", room = %binding.room_id, %error,
                            "room pass ended by the room's disband"
                        );
                        if retired {
                            self.retired(&binding.room_id).await;
                        } else {
                            self.wakeup();
                        }
                        return;
                    }
                }
                {
                    let mut state = self.state();
                    state.lease_losses += 1;
                    state.leases.remove(&binding.room_id);
                    state.blocked.remove(&binding.room_id);
                }
                self.set_error(
                    &binding.room_id,
                    format!("room {}: {error}", binding.room_id),
                );
            }
            Err(error) => self.set_error(
                &binding.room_id,
                format!("room {}: {error}", binding.room_id),
            ),
        }
    }

    async fn process_room_inner(&self, binding: &RoomBinding) -> Result<(), RoomsError> {
        self.inner
            .hooks
            .prepare_room(binding)
            .map_err(RoomsError::Hook)?;
        // Which steps have work, from the counts the store keeps per room and status (one read,
        // where each step would list its tasks). A task that changes state after this read
        // wakes the room (admission, cancellation, retry), so its work gets the next pass.
        // The room is marked idle before the read, and the mark kept only if the read finds
        // nothing to do: a wake after the read (a task admitted meanwhile) takes it off, where
        // a mark made after the lease's release (a write away) outlived the wake before it.
        self.state().idle_rooms.insert(binding.room_id.clone());
        let mut counts = match self.task_counts(binding).await {
            Ok(counts) => counts,
            Err(e) => {
                self.state().idle_rooms.remove(&binding.room_id);
                return Err(e.into());
            }
        };
        // A room with nothing to do renews no lease: renewing kept every idle room writing a
        // commit each half lease TTL for as long as it stayed idle. It keeps the lease it holds
        // while that needs no renewal (a task soon after the last one takes no new lease), then
        // releases it; the next task's pass takes a fresh lease (and recovers the room under it)
        // before it starts anything.
        if counts.idle() {
            self.let_go_of_lease(binding).await;
            self.state().blocked.remove(&binding.room_id);
            return Ok(());
        }
        self.state().idle_rooms.remove(&binding.room_id);
        if counts.has(TaskStatus::Running) && !self.inspect_abandoned_attempts(binding).await? {
            return Ok(());
        }
        let lease = self.ensure_lease(binding).await?;
        if self.recover_once(binding, &lease).await? {
            counts = self.task_counts(binding).await?;
        }
        // Each step may leave work for the ones after it: from the first that runs, all do.
        let mut busy = counts.has(TaskStatus::Running);
        if busy && !self.reattach_own_attempts(binding, &lease).await? {
            return Ok(());
        }
        busy |= counts.has(TaskStatus::Stopping);
        if busy && self.retry_stopping_tasks(binding, &lease).await? {
            return Ok(());
        }
        let lease = self.ensure_lease(binding).await?;
        busy |= counts.has(TaskStatus::Indeterminate);
        if !busy {
            // What reconciling no indeterminate task does.
            self.state().blocked.remove(&binding.room_id);
        } else if self.reconcile_indeterminate(binding, &lease).await? {
            return Ok(());
        }
        // A disbanding room starts nothing new (its fence refuses the start): its queued tasks
        // are cancelled by the disband that follows this pass.
        if (busy || counts.has(TaskStatus::Queued)) && !binding.disbanding {
            self.run_queued(binding).await?;
        }
        Ok(())
    }

    /// Whether the room's disband is raised: `Some(true)` once it is retired, `Some(false)`
    /// while it is disbanding, `None` if not (or the room cannot be read).
    async fn disband_raised(&self, room_id: &str) -> Option<bool> {
        let room = room_id.to_string();
        let view = self
            .inner
            .db
            .run(move |c| get_room(c, &room))
            .await
            .ok()
            .flatten()?;
        if view.disbanded_at.is_some() {
            Some(true)
        } else {
            view.disband_requested_at.is_some().then_some(false)
        }
    }

    /// Carry out a disband whose fence is up, on every pass of the room until it is retired:
    /// cancel each task that has not ended (what `room.disband` does at once; a disband that a
    /// crash or a stop cut short resumes here), then retire the room as soon as nothing in it is
    /// unresolved, whenever that is (a stop acknowledged late, an operator's resolution after a
    /// restart), with no caller left waiting on it.
    async fn carry_out_disband(&self, binding: &RoomBinding) -> Result<(), RoomsError> {
        // A queued or deferred task whose cancel failed is tried again on the next pass: the
        // room is not retired with it (the store refuses that as well).
        let unresolved = [
            TaskStatus::Queued,
            TaskStatus::Deferred,
            TaskStatus::Running,
            TaskStatus::Stopping,
            TaskStatus::Indeterminate,
        ];
        let mut counts = self.task_counts(binding).await?;
        let open = [
            TaskStatus::Queued,
            TaskStatus::Deferred,
            TaskStatus::Running,
            TaskStatus::Indeterminate,
        ];
        if open.into_iter().any(|s| counts.has(s)) {
            let room = binding.room_id.clone();
            let open = self
                .inner
                .db
                .run(move |c| crate::store::room_tasks::open_tasks(c, &room))
                .await?;
            for identity in open {
                if let Err(error) = self.cancel(&identity, DISBAND_CANCEL_ID).await {
                    tracing::warn!(
                        room = %binding.room_id, task = %identity.task_id, %error,
                        "disband: cannot cancel the task yet"
                    );
                }
            }
            counts = self.task_counts(binding).await?;
        }
        if unresolved.into_iter().any(|s| counts.has(s)) {
            return Ok(());
        }
        let (room, clock) = (binding.room_id.clone(), self.inner.clock.clone());
        match self
            .inner
            .db
            .write(move |c| disband_room(c, &room, clock.as_ref()))
            .await
        {
            Ok(_) => {
                tracing::info!(room = %binding.room_id, "room disbanded");
                self.retired(&binding.room_id).await;
                // The scheduler reads its bindings again, without this room.
                self.wakeup();
                Ok(())
            }
            // A task became unresolved since the count (a stop under way): a later pass.
            Err(RoomStoreError::InvalidTransition(_)) => Ok(()),
            Err(error) => Err(error.into()),
        }
    }

    async fn task_counts(&self, binding: &RoomBinding) -> Result<TaskCounts, RoomStoreError> {
        let room = binding.room_id.clone();
        let counts = self
            .inner
            .db
            .run(move |c| count_tasks_by_status(c, &room))
            .await?;
        Ok(TaskCounts(counts))
    }

    // ---------------------------------------------------------------------------------------
    // Leases and recovery

    /// The room's lease: the in-memory one, renewed when half its TTL is gone, else a fresh one.
    pub(crate) async fn ensure_lease(
        &self,
        binding: &RoomBinding,
    ) -> Result<Lease, RoomStoreError> {
        let ttl = self.inner.config.lease_ttl_seconds;
        let clock = self.inner.clock.clone();
        let existing = self.lease(&binding.room_id);
        if let Some(lease) = existing {
            let same_authority = lease.gateway_id == binding.gateway_id
                && lease.authority_epoch == binding.authority_epoch;
            if same_authority {
                if self.lease_fresh(&lease) {
                    return Ok(lease);
                }
                let current = lease.clone();
                match self
                    .inner
                    .db
                    .write(move |c| renew_lease(c, &current, ttl, clock.as_ref()))
                    .await
                {
                    Ok(renewed) => {
                        let mut state = self.state();
                        state.lease_renewals += 1;
                        state
                            .leases
                            .insert(binding.room_id.clone(), renewed.clone());
                        return Ok(renewed);
                    }
                    Err(error) if is_lease_loss(&error) => {
                        let mut state = self.state();
                        // An idle pass of this runtime may have released the lease while the
                        // renewal was on its way (the release leaves the runtime's hands first):
                        // that is not a loss.
                        let held = state
                            .leases
                            .get(&binding.room_id)
                            .is_some_and(|l| l.lease_generation == lease.lease_generation);
                        if held {
                            tracing::warn!(
                                room = %binding.room_id,
                                "room lease lost on renewal (it expired, or another driver holds it)"
                            );
                            state.lease_losses += 1;
                            state.leases.remove(&binding.room_id);
                        }
                    }
                    Err(error) => return Err(error),
                }
            } else {
                self.state().leases.remove(&binding.room_id);
            }
        }
        let (room, gateway, epoch) = (
            binding.room_id.clone(),
            binding.gateway_id.clone(),
            binding.authority_epoch,
        );
        let process = self.inner.process_generation.clone();
        let clock = self.inner.clock.clone();
        let lease = self
            .inner
            .db
            .write(move |c| acquire_lease(c, &room, &gateway, epoch, &process, ttl, clock.as_ref()))
            .await?;
        let mut state = self.state();
        state.recovered.retain(|(room, generation)| {
            room != &binding.room_id || *generation == lease.lease_generation
        });
        state.leases.insert(binding.room_id.clone(), lease.clone());
        Ok(lease)
    }

    /// How often a wait that must keep the room's lease looks at it: a quarter of the TTL, so
    /// the renewal (due once half the TTL is gone) comes at most three quarters in, leaving a
    /// stalled machine at least a quarter of the TTL before the lease lapses. At a third, the
    /// renewal came two thirds in: one third of slack.
    fn renewal_tick(&self) -> Duration {
        Duration::from_secs_f64(self.inner.config.lease_ttl_seconds / 4.0)
    }

    /// Does `lease` need no renewal yet (less than half its TTL gone)?
    fn lease_fresh(&self, lease: &Lease) -> bool {
        self.now() < lease.expires_at - self.inner.config.lease_ttl_seconds / 2.0
    }

    /// Release the room's lease, if this runtime holds one that would now need renewing. A
    /// release refused (the lease lapsed, the room's authority moved, a task started meanwhile)
    /// leaves the lease to expire. The lease is no longer this runtime's to use from the start
    /// of its release (work that comes meanwhile takes a fresh one, after it), but the status
    /// counts it leased until the release is written: it never shows a room let go whose row
    /// still holds the lease.
    async fn let_go_of_lease(&self, binding: &RoomBinding) {
        let Some(lease) = self.lease(&binding.room_id) else {
            return;
        };
        if self.lease_fresh(&lease) {
            return;
        }
        {
            let mut state = self.state();
            state.leases.remove(&binding.room_id);
            state.releasing.insert(binding.room_id.clone());
        }
        let clock = self.inner.clock.clone();
        let released = self
            .inner
            .db
            .write(move |c| release_lease(c, &lease, clock.as_ref()))
            .await;
        self.state().releasing.remove(&binding.room_id);
        if let Err(error) = released {
            tracing::debug!(room = %binding.room_id, %error, "an idle room's lease was left to expire");
        }
    }

    /// Recover the room once per lease generation; whether this call did.
    async fn recover_once(
        &self,
        binding: &RoomBinding,
        lease: &Lease,
    ) -> Result<bool, RoomStoreError> {
        let key = (binding.room_id.clone(), lease.lease_generation);
        if self.state().recovered.contains(&key) {
            return Ok(false);
        }
        let (current, clock) = (lease.clone(), self.inner.clock.clone());
        self.inner
            .db
            .write(move |c| recover_room(c, &current, clock.as_ref()))
            .await?;
        self.state().recovered.insert(key);
        Ok(true)
    }

    /// Running attempts this lease started but nobody observes any more (e.g. after `stop()` and
    /// a new `start()` of the same runtime): observe them again, never resubmitting. Returns false
    /// while one is still running after its observation ends.
    async fn reattach_own_attempts(
        &self,
        binding: &RoomBinding,
        lease: &Lease,
    ) -> Result<bool, RoomsError> {
        let room = binding.room_id.clone();
        let running = self
            .inner
            .db
            .run(move |c| list_tasks(c, &room, Some(TaskStatus::Running)))
            .await?;
        for task in running {
            let own = task.run_gateway_id.as_deref() == Some(lease.gateway_id.as_str())
                && task.run_process_generation.as_deref()
                    == Some(lease.process_generation.as_str())
                && task.run_lease_generation == Some(lease.lease_generation);
            if !own || self.is_stopping() {
                continue;
            }
            let attempt = TaskAttempt {
                identity: task.identity.clone(),
                lease: lease.clone(),
                execution_generation: task.execution_generation,
                cancel_generation: task.cancel_generation,
            };
            let port = self.transport(binding, &task)?;
            let profile = task.payload.target_profile.clone();
            self.state()
                .current_tasks
                .insert(binding.room_id.clone(), attempt.identity.clone());
            // Without waiting: while another room's turn holds the member, the attempt is left
            // running and the pass ends (freeing its scheduler slot); the release wakes the room.
            if let Some(_turn) = self.try_turn(&binding.room_id, &profile) {
                match self
                    .open_existing(port.as_ref(), &profile, &binding.room_id)
                    .await
                {
                    // A member's own ledger that has no such input proves nothing was
                    // admitted: the attempt could not record a failure before its submit, or
                    // its put-back (the store failed too). Queued again, not observed until its
                    // deadline, holding the room's slot and the member's turn lock.
                    Ok(Some(session_id))
                        if port.keeps_ledger()
                            && matches!(
                                port.ledger_attempt_settled(
                                    Self::session_ref(&profile, &session_id),
                                    task.identity.clone(),
                                    task.execution_generation,
                                )
                                .await,
                                Ok(None)
                            ) =>
                    {
                        let error = PortError::not_admitted("its member never admitted it");
                        self.requeue_not_admitted(binding, &attempt, &task, error)
                            .await;
                    }
                    Ok(Some(session_id)) => {
                        let started = task.started_at.unwrap_or(task.updated_at);
                        let left = started + self.inner.config.turn_timeout_seconds - self.now();
                        let deadline = self.inner.clock.monotonic() + left;
                        self.observe(
                            binding,
                            &attempt,
                            &task,
                            port.as_ref(),
                            &session_id,
                            deadline,
                        )
                        .await;
                    }
                    // A peer that reports no member session proves nothing (the peer may have
                    // lost or moved it after it ran the attempt): queued again, the task would
                    // be dispatched a second time. Left running for the peer's recovery, as an
                    // attempt that cannot be observed is.
                    Ok(None) if port.is_peer() => self.set_error(
                        &binding.room_id,
                        format!(
                            "task {}: its peer member reports no member session; whether the \
                             attempt was admitted is unknown, so it is not dispatched again",
                            task.identity.task_id
                        ),
                    ),
                    // No member session: nothing of the attempt was admitted (an input needs
                    // its session), so the task is queued again. The attempt whose opening
                    // failed could not record its failure (the store failed too), and the task
                    // was left running, renewed on every pass, until a cancel.
                    Ok(None) => {
                        let error = PortError::not_admitted("its member session was never opened");
                        self.requeue_not_admitted(binding, &attempt, &task, error)
                            .await;
                    }
                    Err(error) => self.set_error(
                        &binding.room_id,
                        format!(
                            "task {} observation failed after submit: {error}",
                            task.identity.task_id
                        ),
                    ),
                }
            }
            self.state().current_tasks.remove(&binding.room_id);
            let after = self.read_task(&task.identity).await?;
            if after.status == TaskStatus::Running {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Running attempts started by another process: probe them (live only, for local sessions).
    /// Returns false when such an attempt is still active, which ends the pass quietly.
    async fn inspect_abandoned_attempts(&self, binding: &RoomBinding) -> Result<bool, RoomsError> {
        let room = binding.room_id.clone();
        let running = self
            .inner
            .db
            .run(move |c| list_tasks(c, &room, Some(TaskStatus::Running)))
            .await?;
        for task in running {
            if task.run_process_generation.as_deref()
                == Some(self.inner.process_generation.as_str())
            {
                continue;
            }
            let probe = match self.transport(binding, &task) {
                Ok(port) => {
                    // Without waiting: while another room's turn holds the member, the pass
                    // ends (freeing its scheduler slot) and the holder's release wakes it.
                    let Some(_turn) = self.try_turn(&binding.room_id, &task.payload.target_profile)
                    else {
                        return Ok(false);
                    };
                    if port.is_peer() {
                        self.full_probe(binding, port.as_ref(), &task).await
                    } else {
                        self.live_probe(binding, port.as_ref(), &task).await
                    }
                }
                Err(error) => Err(error),
            };
            let probe = match probe {
                Ok(probe) => probe,
                Err(error) => {
                    self.set_error(
                        &binding.room_id,
                        format!(
                            "task {} recovery probe failed: {error}",
                            task.identity.task_id
                        ),
                    );
                    continue;
                }
            };
            if let Some(receipt) = &probe.receipt {
                // succeeds only while the previous holder's lease is still live
                if let (Some(gateway), Some(process), Some(generation)) = (
                    task.run_gateway_id.clone(),
                    task.run_process_generation.clone(),
                    task.run_lease_generation,
                ) {
                    let attempt = TaskAttempt {
                        identity: task.identity.clone(),
                        lease: Lease {
                            room_id: binding.room_id.clone(),
                            gateway_id: gateway,
                            authority_epoch: binding.authority_epoch,
                            process_generation: process,
                            lease_generation: generation,
                            expires_at: 0.0,
                            reclaimed: false,
                        },
                        execution_generation: task.execution_generation,
                        cancel_generation: task.cancel_generation,
                    };
                    let settlement = settlement_from_history(receipt);
                    let clock = self.inner.clock.clone();
                    if let Ok(view) = self
                        .inner
                        .db
                        .write(move |c| settle_task(c, &attempt, &settlement, clock.as_ref()))
                        .await
                    {
                        self.publish_terminal(binding, &view);
                    }
                }
                continue;
            }
            // Running now, within its deadline: the pass ends quietly. Queued behind another
            // turn, it is recovered as indeterminate, and the room waits for it there, saying so.
            // Past its deadline the pass goes on to take the lease and recover it, and the
            // recovered attempt is stopped (`reconcile_indeterminate`): ending the pass here
            // held the room for as long as the member's turn ran.
            if probe.running(&task.identity.task_id)
                && !self.past_deadline(&task, probe.ledger.as_ref())
            {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Open the room session without creating it: resolve, then resume (its returned id is used).
    async fn open_existing(
        &self,
        port: &dyn SessionPort,
        profile: &str,
        room_id: &str,
    ) -> Result<Option<String>, PortError> {
        self.open_session(port, profile, room_id, false).await
    }

    async fn open_session(
        &self,
        port: &dyn SessionPort,
        profile: &str,
        room_id: &str,
        create: bool,
    ) -> Result<Option<String>, PortError> {
        let address = Self::member_address(profile, room_id);
        let handle = match port.resolve_and_resume(address.clone()).await? {
            Some(live) => live,
            None if create => port.create(address).await?,
            None => return Ok(None),
        };
        if handle.session_id.is_empty() {
            return Err(PortError::new("session adapter returned no session_id"));
        }
        Ok(Some(handle.session_id))
    }

    /// Where `profile`'s room session of room `room_id` lives.
    fn member_address(profile: &str, room_id: &str) -> SessionAddress {
        SessionAddress {
            profile: profile.to_string(),
            title: room_session_title(room_id),
            source: ROOM_SESSION_SOURCE.to_string(),
        }
    }

    fn session_ref(profile: &str, session_id: &str) -> SessionRef {
        SessionRef {
            profile: profile.to_string(),
            session_id: session_id.to_string(),
            source: ROOM_SESSION_SOURCE.to_string(),
        }
    }

    /// The durable intent to stop attempt `generation` of a task at its turn deadline: a stop
    /// under `deadline:<generation>`, which fails the task as timed out once completed.
    async fn begin_deadline_stop(
        &self,
        identity: &TaskIdentity,
        generation: i64,
        cancel_generation: i64,
    ) -> Result<TaskView, RoomStoreError> {
        let (id, clock) = (identity.clone(), self.inner.clock.clone());
        self.inner
            .db
            .write(move |c| {
                crate::store::room_tasks::begin_task_stop(
                    c,
                    &id,
                    &format!("deadline:{generation}"),
                    cancel_generation,
                    Some(generation),
                    clock.as_ref(),
                )
            })
            .await
    }

    /// Whether `task`'s attempt has run past its turn deadline (by the store's clock: the
    /// measure that holds across processes), counted from its start or, when its member's
    /// ledger says it began it later, from then. An attempt its member holds queued (behind an
    /// `unknown` turn its operator has to resolve) runs no deadline: counted from the attempt's
    /// start, the hours it waited stopped it the moment it began.
    fn past_deadline(&self, task: &TaskView, ledger: Option<&LedgerAttempt>) -> bool {
        let began = match ledger {
            Some(LedgerAttempt::Live { started: None, .. }) => return false,
            Some(LedgerAttempt::Live {
                started: Some(at), ..
            }) => Some(*at),
            _ => None,
        };
        task.started_at.is_some_and(|at| {
            self.now() >= at.max(began.unwrap_or(at)) + self.inner.config.turn_timeout_seconds
        })
    }

    /// Stop `task`'s attempt as its turn deadline does (a stop under `deadline:<generation>`,
    /// which fails the task as timed out once the member acknowledges); whether it is resolved
    /// (else the stop stays pending, and the room says so).
    async fn stop_at_deadline(
        &self,
        binding: &RoomBinding,
        lease: &Lease,
        task: &TaskView,
    ) -> Result<bool, RoomsError> {
        let stopping = self
            .begin_deadline_stop(
                &task.identity,
                task.execution_generation,
                task.cancel_generation,
            )
            .await?;
        match self.finish_stop(binding, lease, &stopping).await? {
            StopOutcome::Resolved => Ok(true),
            StopOutcome::Pending => {
                self.set_error(
                    &binding.room_id,
                    format!(
                        "task {} exceeded its deadline; stop remains pending",
                        task.identity.task_id
                    ),
                );
                Ok(false)
            }
        }
    }

    /// Live probe of a local session: resolve and info only (no resume, no history, no submit).
    async fn live_probe(
        &self,
        binding: &RoomBinding,
        port: &dyn SessionPort,
        task: &TaskView,
    ) -> Result<Probe, PortError> {
        let profile = &task.payload.target_profile;
        let address = Self::member_address(profile, &binding.room_id);
        let Some(found) = port.resolve_exact(address).await? else {
            return Ok(Probe::default());
        };
        let info = port
            .info(Self::session_ref(profile, &found.session_id))
            .await?;
        self.report_pending(binding, task, &found.session_id, &info);
        // One busy with another turn may hold this attempt queued behind it; one running it
        // says since when (its turn deadline counts from then: see `past_deadline`).
        let ledger = port
            .ledger_attempt(
                Self::session_ref(profile, &found.session_id),
                task.identity.clone(),
                task.execution_generation,
            )
            .await?;
        Ok(Probe {
            receipt: None,
            info: Some(info),
            ledger,
        })
    }

    /// A probe of the task's member under its turn lock: [`Self::full_probe`] if `full`, else
    /// [`Self::live_probe`].
    pub(crate) async fn locked_probe(
        &self,
        binding: &RoomBinding,
        port: &dyn SessionPort,
        task: &TaskView,
        full: bool,
        lease: &Lease,
    ) -> Result<Probe, PortError> {
        // Another room's turn of this member may hold it up to that turn's deadline: the wait
        // is bounded, and the lease is renewed meanwhile (it lapsed, and the probe's resolution
        // was then fenced as a lease loss).
        let profile = &task.payload.target_profile;
        let waited = tokio::time::timeout(
            RETRY_MEMBER_WAIT,
            self.lock_renewing(binding, profile, lease),
        )
        .await;
        let _guard = match waited {
            Ok(Some(guard)) => guard,
            Ok(None) => {
                return Err(PortError::new(
                    "the room's lease was lost while it waited for its member",
                ))
            }
            Err(_) => {
                return Err(PortError::new(format!(
                    "member {profile} is running another room's turn: nothing was retried; \
                     retry task {} once that turn ends",
                    task.identity.task_id
                )))
            }
        };
        if full {
            self.full_probe(binding, port, task).await
        } else {
            self.live_probe(binding, port, task).await
        }
    }

    /// Resolve an indeterminate attempt from how its member's ledger says it ended: settled or
    /// failed with its result; a cancelled one cancelled; an interrupted one failed, with why.
    /// A deferred attempt resolves only as settled (anything else is the operator's to retry).
    pub(crate) async fn resolve_ended(
        &self,
        binding: &RoomBinding,
        lease: &Lease,
        task: &TaskView,
        ended: TerminalReceipt,
    ) -> Result<TaskView, RoomStoreError> {
        let (id, current, clock) = (
            task.identity.clone(),
            lease.clone(),
            self.inner.clock.clone(),
        );
        let (generation, cancel) = (task.execution_generation, task.cancel_generation);
        let view = if ended.status == "cancelled" && task.status != TaskStatus::Deferred {
            let cancel_id = format!("member-cancel:{generation}");
            self.inner
                .db
                .write(move |c| {
                    resolve_indeterminate_cancellation(
                        c,
                        &id,
                        &current,
                        generation,
                        cancel,
                        &cancel_id,
                        clock.as_ref(),
                    )
                })
                .await?
        } else {
            let resolve = if task.status == TaskStatus::Deferred {
                crate::store::room_tasks::resolve_deferred_completion
            } else {
                resolve_indeterminate_task
            };
            let settlement = settlement_from_ended(ended, &id.task_id, generation);
            self.inner
                .db
                .write(move |c| {
                    resolve(
                        c,
                        &id,
                        &current,
                        generation,
                        cancel,
                        &settlement,
                        clock.as_ref(),
                    )
                })
                .await?
        };
        self.publish_terminal(binding, &view);
        Ok(view)
    }

    /// Full probe: resolve, resume, then history and info on the resumed session (and, for a
    /// local member that is not running, its ledger's record of the attempt).
    pub(crate) async fn full_probe(
        &self,
        binding: &RoomBinding,
        port: &dyn SessionPort,
        task: &TaskView,
    ) -> Result<Probe, PortError> {
        let profile = &task.payload.target_profile;
        let Some(session_id) = self.open_existing(port, profile, &binding.room_id).await? else {
            return Ok(Probe::default());
        };
        let receipt = port
            .receipt(
                Self::session_ref(profile, &session_id),
                task.identity.clone(),
                task.execution_generation,
            )
            .await?;
        let info = port.info(Self::session_ref(profile, &session_id)).await?;
        self.report_pending(binding, task, &session_id, &info);
        // A local member's own ledger, read as the live probe reads it.
        let ledger = if port.is_peer() || running_for(&info, &task.identity.task_id) {
            None
        } else {
            port.ledger_attempt(
                Self::session_ref(profile, &session_id),
                task.identity.clone(),
                task.execution_generation,
            )
            .await?
        };
        Ok(Probe {
            receipt,
            info: Some(info),
            ledger,
        })
    }

    /// The room stays blocked, saying why (`message` is its error); true, for
    /// [`Self::reconcile_indeterminate`] to return.
    fn hold_room(&self, binding: &RoomBinding, message: String) -> bool {
        self.set_error(&binding.room_id, message);
        self.state().blocked.insert(binding.room_id.clone());
        true
    }

    /// Resolve indeterminate attempts in room order. Returns true when the room stays blocked.
    pub(crate) async fn reconcile_indeterminate(
        &self,
        binding: &RoomBinding,
        lease: &Lease,
    ) -> Result<bool, RoomsError> {
        let room = binding.room_id.clone();
        let tasks = self
            .inner
            .db
            .run(move |c| list_tasks(c, &room, Some(TaskStatus::Indeterminate)))
            .await?;
        // What was probed of attempts no longer indeterminate is forgotten: kept for every
        // attempt ever recovered, it grew for as long as the room lived.
        let current: std::collections::HashSet<(&str, i64)> = tasks
            .iter()
            .map(|t| (t.identity.task_id.as_str(), t.execution_generation))
            .collect();
        self.state().inspected.retain(|(room, task, generation)| {
            *room != binding.room_id || current.contains(&(task.as_str(), *generation))
        });
        for task in tasks {
            let id = task.identity.clone();
            let generation = task.execution_generation;
            let key = (binding.room_id.clone(), id.task_id.clone(), generation);
            let port = match self.transport(binding, &task) {
                Ok(port) => port,
                Err(error) => {
                    return Ok(self.hold_room(
                        binding,
                        format!("task {} recovery probe failed: {error}", id.task_id),
                    ))
                }
            };
            let inspected = self.state().inspected.contains(&key);
            // A local member is probed on every pass (a few reads of this process's own state):
            // while it still runs the attempt the room waits, and once its ledger says how the
            // attempt ended (an operator resolved its `unknown` turn, say) the task resolves so,
            // without waiting out the defer.
            if !port.is_peer() {
                // Without waiting for the member (another room's turn may hold it up to its
                // deadline): the pass ends, freeing its scheduler slot, and the release wakes it.
                let Some(turn) = self.try_turn(&binding.room_id, &task.payload.target_profile)
                else {
                    return Ok(true);
                };
                let probe = self.live_probe(binding, port.as_ref(), &task).await;
                drop(turn);
                self.state().inspected.insert(key.clone());
                match probe {
                    // Still running, past its turn deadline: an attempt of this process left
                    // indeterminate when its lease lapsed mid-turn (a clock jump, a long stall)
                    // is held to its deadline all the same, not waited for without end.
                    Ok(probe)
                        if probe.active_for(&id.task_id)
                            && self.past_deadline(&task, probe.ledger.as_ref()) =>
                    {
                        if self.stop_at_deadline(binding, lease, &task).await? {
                            continue;
                        }
                        self.state().blocked.insert(binding.room_id.clone());
                        return Ok(true);
                    }
                    Ok(probe) if probe.active_for(&id.task_id) => {
                        if let Some(LedgerAttempt::Live {
                            session_id,
                            admission_id,
                            started: None,
                        }) = &probe.ledger
                        {
                            // Deferred, it could be retried (or cancelled) while its input still
                            // waits in the member's queue, and then run twice (or after all).
                            self.set_error(
                                &binding.room_id,
                                format!(
                                    "task {} waits for its member's earlier turns: its input \
                                     {admission_id} is queued in session {session_id} (`gatehouse \
                                     pending` lists an unknown turn that holds it)",
                                    id.task_id
                                ),
                            );
                        }
                        self.state().blocked.insert(binding.room_id.clone());
                        return Ok(true);
                    }
                    Ok(Probe {
                        ledger: Some(LedgerAttempt::Ended(ended)),
                        ..
                    }) => {
                        self.resolve_ended(binding, lease, &task, ended).await?;
                        continue;
                    }
                    Ok(Probe {
                        ledger:
                            Some(LedgerAttempt::Unresolved {
                                session_id,
                                admission_id,
                            }),
                        ..
                    }) => {
                        // Deferring it would only queue the room's next task behind it in the
                        // member's session: the room waits for the member's operator instead.
                        return Ok(self.hold_room(
                            binding,
                            unresolved_member(&id.task_id, &session_id, &admission_id),
                        ));
                    }
                    Ok(_) => {}
                    Err(error) => {
                        // Not knowing whether the member still holds the attempt, the room does
                        // not defer it (a retry could then run it twice): the next pass asks again.
                        return Ok(self.hold_room(
                            binding,
                            format!("task {} recovery probe failed: {error}", id.task_id),
                        ));
                    }
                }
            }
            let since = task.indeterminate_at.unwrap_or(task.updated_at);
            let deadline = since + self.inner.config.indeterminate_defer_seconds;
            if port.is_peer() && (!inspected || self.now() >= deadline) {
                let Some(turn) = self.try_turn(&binding.room_id, &task.payload.target_profile)
                else {
                    return Ok(true);
                };
                let probe = self.full_probe(binding, port.as_ref(), &task).await;
                drop(turn);
                self.state().inspected.insert(key.clone());
                match probe {
                    Ok(probe) => {
                        let (current, clock, cancel) = (
                            lease.clone(),
                            self.inner.clock.clone(),
                            task.cancel_generation,
                        );
                        let task_id = id.clone();
                        // Resolved as the member ended it; the room says so once, as for every
                        // terminal commit (`room.task`).
                        if probe.status() == Some("cancelled") {
                            let cancel_id = format!("remote-cancel:{generation}");
                            let view = self
                                .inner
                                .db
                                .write(move |c| {
                                    resolve_indeterminate_cancellation(
                                        c,
                                        &task_id,
                                        &current,
                                        generation,
                                        cancel,
                                        &cancel_id,
                                        clock.as_ref(),
                                    )
                                })
                                .await?;
                            self.publish_terminal(binding, &view);
                            continue;
                        }
                        if let Some(receipt) = &probe.receipt {
                            let settlement = settlement_from_history(receipt);
                            let view = self
                                .inner
                                .db
                                .write(move |c| {
                                    resolve_indeterminate_task(
                                        c,
                                        &task_id,
                                        &current,
                                        generation,
                                        cancel,
                                        &settlement,
                                        clock.as_ref(),
                                    )
                                })
                                .await?;
                            self.publish_terminal(binding, &view);
                            continue;
                        }
                        // Still active past its turn deadline: stopped, as a local member's
                        // attempt is (it blocked the room for as long as the peer ran it).
                        if probe.active_for(&id.task_id)
                            && self.past_deadline(&task, probe.ledger.as_ref())
                        {
                            if self.stop_at_deadline(binding, lease, &task).await? {
                                continue;
                            }
                            self.state().blocked.insert(binding.room_id.clone());
                            return Ok(true);
                        }
                        if probe.active_for(&id.task_id) {
                            self.state().blocked.insert(binding.room_id.clone());
                            return Ok(true);
                        }
                    }
                    Err(error) => self.set_error(
                        &binding.room_id,
                        format!("task {} recovery probe failed: {error}", id.task_id),
                    ),
                }
            }
            if self.now() < deadline {
                self.state().blocked.insert(binding.room_id.clone());
                return Ok(true);
            }
            let (current, clock, cancel) = (
                lease.clone(),
                self.inner.clock.clone(),
                task.cancel_generation,
            );
            let view = self
                .inner
                .db
                .write(move |c| {
                    defer_indeterminate_task(
                        c,
                        &id,
                        &current,
                        generation,
                        cancel,
                        MEMBER_UNAVAILABLE,
                        clock.as_ref(),
                    )
                })
                .await?;
            self.publish_terminal(binding, &view);
        }
        self.state().blocked.remove(&binding.room_id);
        Ok(false)
    }

    // ---------------------------------------------------------------------------------------
    // Stops

    /// Retry every durable stop of the room. Returns true while one remains unacknowledged
    /// (the room is then blocked).
    pub(crate) async fn retry_stopping_tasks(
        &self,
        binding: &RoomBinding,
        _lease: &Lease,
    ) -> Result<bool, RoomsError> {
        let room = binding.room_id.clone();
        let tasks = self
            .inner
            .db
            .run(move |c| list_tasks(c, &room, Some(TaskStatus::Stopping)))
            .await?;
        for task in tasks {
            let lease = self.ensure_lease(binding).await?;
            let outcome = if self.peer_stop_acknowledged(binding, &task).await {
                self.complete_acknowledged_stop(binding, &lease, &task)
                    .await
                    .map(|_| StopOutcome::Resolved)
            } else {
                self.finish_stop(binding, &lease, &task).await
            };
            match outcome {
                Ok(StopOutcome::Resolved) => {}
                Ok(StopOutcome::Pending) => {
                    self.state().blocked.insert(binding.room_id.clone());
                    return Ok(true);
                }
                // The room was retired meanwhile: the pass ends as its disband (no error).
                Err(error) if error.store().is_some_and(ended_by_disband) => return Err(error),
                Err(error) => {
                    self.set_error(
                        &binding.room_id,
                        format!(
                            "task {} stop retry remains pending: {error}",
                            task.identity.task_id
                        ),
                    );
                    self.state().blocked.insert(binding.room_id.clone());
                    return Ok(true);
                }
            }
        }
        Ok(false)
    }

    pub(crate) async fn finish_user_stop(
        &self,
        binding: &RoomBinding,
        task: &TaskView,
    ) -> Result<(), RoomsError> {
        let lease = self.ensure_lease(binding).await?;
        if self.peer_stop_acknowledged(binding, task).await {
            return self.complete_acknowledged_stop(binding, &lease, task).await;
        }
        self.finish_stop(binding, &lease, task).await.map(|_| ())
    }

    /// Completion wins: an exact receipt settles the stopping task; otherwise interrupt the exact
    /// task, and complete the stop once acknowledged.
    pub(crate) async fn finish_stop(
        &self,
        binding: &RoomBinding,
        lease: &Lease,
        task: &TaskView,
    ) -> Result<StopOutcome, RoomsError> {
        match self.finish_stop_inner(binding, lease, task).await {
            Err(RoomsError::Store(RoomStoreError::StaleTask(message))) => {
                // the task moved on (e.g. the completion landed meanwhile)
                let fresh = self.read_task(&task.identity).await?;
                if fresh.status != TaskStatus::Stopping {
                    Ok(StopOutcome::Resolved)
                } else {
                    Err(RoomStoreError::StaleTask(message).into())
                }
            }
            other => other,
        }
    }

    async fn finish_stop_inner(
        &self,
        binding: &RoomBinding,
        lease: &Lease,
        task: &TaskView,
    ) -> Result<StopOutcome, RoomsError> {
        let port = self.transport(binding, task)?;
        let profile = task.payload.target_profile.clone();
        let session = self
            .open_existing(port.as_ref(), &profile, &binding.room_id)
            .await?;
        if let Some(session_id) = &session {
            let receipt = port
                .receipt(
                    Self::session_ref(&profile, session_id),
                    task.identity.clone(),
                    task.execution_generation,
                )
                .await?;
            if let Some(receipt) = receipt {
                let settlement = settlement_from_history(&receipt);
                self.settle_stopping(binding, lease, task, settlement)
                    .await?;
                return Ok(StopOutcome::Resolved);
            }
        }
        if !self
            .interrupt_stopping_task(binding, port.as_ref(), session.as_deref(), task)
            .await?
        {
            return Ok(StopOutcome::Pending);
        }
        self.complete_acknowledged_stop(binding, lease, task)
            .await?;
        Ok(StopOutcome::Resolved)
    }

    async fn settle_stopping(
        &self,
        binding: &RoomBinding,
        lease: &Lease,
        task: &TaskView,
        settlement: Settlement,
    ) -> Result<TaskView, RoomStoreError> {
        let (id, current, clock) = (
            task.identity.clone(),
            lease.clone(),
            self.inner.clock.clone(),
        );
        let (exec, cancel) = (task.execution_generation, task.cancel_generation);
        let view = self
            .inner
            .db
            .write(move |c| {
                settle_stopping_task(c, &id, &current, exec, cancel, &settlement, clock.as_ref())
            })
            .await?;
        self.publish_terminal(binding, &view);
        Ok(view)
    }

    /// An acknowledged stop: `cancelled`, or the deadline failure for a `deadline:` stop.
    async fn complete_acknowledged_stop(
        &self,
        binding: &RoomBinding,
        lease: &Lease,
        task: &TaskView,
    ) -> Result<(), RoomsError> {
        let cancel_id = task.cancel_id.clone().unwrap_or_default();
        if cancel_id.starts_with("deadline:") {
            let settlement = Settlement {
                settlement_id: cancel_id,
                status: SettlementStatus::Failed,
                result: serde_json::json!({
                    "error": DEADLINE_ERROR,
                    "reason_code": DEADLINE_REASON_CODE,
                    "timeout_seconds": self.inner.config.turn_timeout_seconds,
                }),
            };
            self.settle_stopping(binding, lease, task, settlement)
                .await?;
            return Ok(());
        }
        let (id, clock, cancel) = (
            task.identity.clone(),
            self.inner.clock.clone(),
            task.cancel_generation,
        );
        let view = self
            .inner
            .db
            .write(move |c| complete_task_cancel(c, &id, &cancel_id, cancel, clock.as_ref()))
            .await?;
        self.publish_cancelled(&binding.room_id, &view);
        Ok(())
    }

    /// Interrupt the exact task, never a newer one. Returns whether the stop is acknowledged.
    async fn interrupt_stopping_task(
        &self,
        binding: &RoomBinding,
        port: &dyn SessionPort,
        session_id: Option<&str>,
        task: &TaskView,
    ) -> Result<bool, PortError> {
        if self
            .state()
            .submitting
            .contains(&(task.identity.room_id.clone(), task.identity.task_id.clone()))
        {
            // Being submitted by this process: no turn of it is to be found yet, and one may
            // be about to start. The attempt's observation stops it once its submission answers.
            return Ok(false);
        }
        let Some(session_id) = session_id else {
            // an accepted local turn cannot outlive its session
            return Ok(!port.is_peer());
        };
        let profile = &task.payload.target_profile;
        let info = port.info(Self::session_ref(profile, session_id)).await?;
        self.report_pending(binding, task, session_id, &info);
        let running_this = info.active && info.task_id.as_deref() == Some(&task.identity.task_id);
        if !running_this {
            // Not running: an admission still queued (behind another turn, or behind an
            // `unknown` one the member's operator has to resolve) is withdrawn, or it would run
            // after its task was recorded stopped.
            let withdrawn = port
                .withdraw_queued(
                    Self::session_ref(profile, session_id),
                    task.identity.clone(),
                    task.execution_generation,
                )
                .await?;
            return Ok(match withdrawn {
                Some(will_not_start) => will_not_start,
                None => !info.active,
            });
        }
        let reply = port
            .interrupt(InterruptRequest {
                profile: profile.clone(),
                session_id: session_id.to_string(),
                source: ROOM_SESSION_SOURCE.to_string(),
                expected_task_id: task.identity.task_id.clone(),
            })
            .await?;
        Ok(reply.is_some_and(|r| r.acknowledged()))
    }

    /// Peer stop evidence (no history read): the peer session is inactive, cancelled or
    /// interrupted, and names this exact task attempt.
    pub(crate) async fn peer_stop_acknowledged(
        &self,
        binding: &RoomBinding,
        task: &TaskView,
    ) -> bool {
        let Ok(port) = self.transport(binding, task) else {
            return false;
        };
        if !port.is_peer() {
            return false;
        }
        let profile = &task.payload.target_profile;
        let Ok(Some(session_id)) = self
            .open_existing(port.as_ref(), profile, &binding.room_id)
            .await
        else {
            return false;
        };
        let Ok(info) = port.info(Self::session_ref(profile, &session_id)).await else {
            return false;
        };
        !info.active
            && matches!(info.status.as_deref(), Some("cancelled" | "interrupted"))
            && info.task_id.as_deref() == Some(task.identity.task_id.as_str())
            && info.execution_generation == Some(task.execution_generation)
    }

    // ---------------------------------------------------------------------------------------
    // Queued work

    async fn run_queued(&self, binding: &RoomBinding) -> Result<(), RoomsError> {
        self.state().turn_yielded.remove(&binding.room_id);
        loop {
            let Some(head) = self.queued_head(&binding.room_id).await? else {
                return Ok(());
            };
            let route = (
                binding.room_id.clone(),
                head.payload.member_id().to_string(),
            );
            if self
                .state()
                .backoff
                .get(&route)
                .is_some_and(|b| self.now() < b.next_at)
            {
                return Ok(());
            }
            if self.starts_refused() {
                return Ok(());
            }
            // The member's turn lock before the start, without waiting: while another room's
            // turn holds it, this room's head stays queued and the pass ends, freeing its
            // scheduler slot for rooms of other members (waiting here held the slot up to that
            // turn's deadline). The holder's release wakes the room.
            let Some(turn) = self.try_turn(&binding.room_id, &head.payload.target_profile) else {
                return Ok(());
            };
            if let Some(held) = self.member_held(binding, &head).await {
                // The task waits in the room, where a cancel ends it at once and no deadline
                // runs, not in the member's queue: each task submitted there used to wait out
                // its whole turn deadline, and fail, until the operator freed the session.
                drop(turn);
                self.hold_room(
                    binding,
                    format!("task {} waits: {held}", head.identity.task_id),
                );
                return Ok(());
            }
            let lease = self.ensure_lease(binding).await?;
            let (id, clock, cancel) = (
                head.identity.clone(),
                self.inner.clock.clone(),
                head.cancel_generation,
            );
            let submitting = Submitting::new(self, &head.identity);
            let attempt = match self
                .inner
                .db
                .write(move |c| start_task(c, &id, &lease, cancel, clock.as_ref()))
                .await
            {
                Ok(attempt) => attempt,
                Err(
                    error @ (RoomStoreError::StaleTask(_) | RoomStoreError::InvalidTransition(_)),
                ) => {
                    // A cancel of the head, or an earlier task admitted, since the head was read:
                    // a race lost, not the room's error. The queue is read again; a head that
                    // did not move refuses its start for a reason of the room's own.
                    let now = self.queued_head(&binding.room_id).await?;
                    let moved = now.as_ref().map(|t| (&t.identity, t.cancel_generation))
                        != Some((&head.identity, head.cancel_generation));
                    if moved {
                        continue;
                    }
                    return Err(error.into());
                }
                Err(error) => return Err(error.into()),
            };
            // The task as started: a member's transport is chosen for this attempt (a peer's
            // takes only the attempt it was made for, and was made for the queued one).
            let started = started_view(head, &attempt);
            // The observer's last read when it ended the observation (no second read).
            let after = match self
                .execute_attempt(binding, &attempt, &started, turn, submitting)
                .await
            {
                Some(after) => after,
                None => self.read_task(&started.identity).await?,
            };
            if !(after.status.is_terminal() || after.status == TaskStatus::Deferred) {
                // Left stopping or unresolved: the room's next pass takes it up at once.
                self.wake_room(&binding.room_id);
                return Ok(());
            }
            if self.state().turn_yielded.remove(&binding.room_id) {
                // Rooms waited for the member this turn released: they go first, this room's
                // next task gets its pass after them.
                self.wake_room(&binding.room_id);
                return Ok(());
            }
            if self.state().slot_waiters > 0 {
                // Rooms wait for a scheduler slot: this one is owed its next pass among them
                // (its pass ran its whole queue, however long, while they waited).
                self.wake_room(&binding.room_id);
                return Ok(());
            }
        }
    }

    /// The task next in room `room_id`'s queue: the head alone (a long queue is not read, and
    /// parsed, for every task it starts).
    async fn queued_head(&self, room_id: &str) -> Result<Option<TaskView>, RoomStoreError> {
        let room = room_id.to_string();
        self.inner
            .db
            .run(move |c| first_task(c, &room, TaskStatus::Queued))
            .await
    }

    /// What holds the member's session of `task` from starting a turn, if anything does
    /// ([`SessionPort::held`]). A member that cannot be reached or read is not held: the
    /// attempt's own start reports that.
    async fn member_held(&self, binding: &RoomBinding, task: &TaskView) -> Option<String> {
        let port = self.transport(binding, task).ok()?;
        let address = Self::member_address(&task.payload.target_profile, &binding.room_id);
        match port.held(address).await {
            Ok(held) => held,
            Err(error) => {
                tracing::debug!(
                    target: "gatehouse::rooms", room = %binding.room_id, %error,
                    "could not read whether the member's session is held"
                );
                None
            }
        }
    }

    /// Run the attempt; the task as its observer last read it, when that ended the observation.
    async fn execute_attempt(
        &self,
        binding: &RoomBinding,
        attempt: &TaskAttempt,
        task: &TaskView,
        turn: HeldTurn,
        submitting: Submitting,
    ) -> Option<TaskView> {
        self.state()
            .current_tasks
            .insert(binding.room_id.clone(), attempt.identity.clone());
        let last = self
            .run_attempt(binding, attempt, task, turn, submitting)
            .await;
        self.state().current_tasks.remove(&binding.room_id);
        // A slot is free: the task scheduler (`start`) runs a cycle on a poke; the actors' one
        // learns it from the pass's end. Not a round over every room: with 128 rooms that cost
        // every task 128 passes.
        self.inner.poke.send_modify(|n| *n = n.wrapping_add(1));
        last
    }

    /// Run the attempt under `turn`, its member's turn lock (taken before its start), held to
    /// its end: session, submit, observation and settlement.
    async fn run_attempt(
        &self,
        binding: &RoomBinding,
        attempt: &TaskAttempt,
        task: &TaskView,
        _turn: HeldTurn,
        submitting: Submitting,
    ) -> Option<TaskView> {
        let task_id = attempt.identity.task_id.clone();
        let port = match self.transport(binding, task) {
            Ok(port) => port,
            Err(error) => {
                self.fail_before_submit(binding, attempt, error).await;
                return None;
            }
        };
        let profile = task.payload.target_profile.clone();
        let session_id = match self
            .open_session(port.as_ref(), &profile, &binding.room_id, true)
            .await
        {
            Ok(Some(session_id)) => session_id,
            Ok(None) => {
                self.fail_before_submit(
                    binding,
                    attempt,
                    PortError::new("session adapter returned no session_id"),
                )
                .await;
                return None;
            }
            Err(error) if error.not_admitted => {
                self.requeue_not_admitted(binding, attempt, task, error)
                    .await;
                return None;
            }
            Err(error) => {
                self.fail_before_submit(binding, attempt, error).await;
                return None;
            }
        };
        let deadline = self.inner.clock.monotonic() + self.inner.config.turn_timeout_seconds;
        // A stop (a cancel, the room's disband) that came while the session was opened: nothing
        // is submitted, and the observation finds no turn of this attempt and completes the stop.
        // A stop that comes from here on waits for the submission (`submitting`), then stops the
        // turn submitted; it used to be acknowledged for want of a turn, and the turn submitted
        // after it ran in full for a task recorded cancelled.
        let stopped = self.read_task(&attempt.identity).await.is_ok_and(|t| {
            t.status != TaskStatus::Running
                || t.execution_generation != attempt.execution_generation
        });
        if stopped {
            drop(submitting);
            return self
                .observe(binding, attempt, task, port.as_ref(), &session_id, deadline)
                .await;
        }
        let request = SubmitRequest {
            profile: profile.clone(),
            session_id: session_id.clone(),
            prompt: task.payload.prompt.clone(),
            source: ROOM_SESSION_SOURCE.to_string(),
            task: attempt.identity.clone(),
            execution_generation: attempt.execution_generation,
            on_terminal: self.terminal_callback(binding, attempt),
        };
        let submitted = port.submit(request).await;
        drop(submitting);
        match submitted {
            Ok(()) => {
                let route = (
                    binding.room_id.clone(),
                    task.payload.member_id().to_string(),
                );
                self.state().backoff.remove(&route);
            }
            Err(error) if error.not_admitted => {
                self.requeue_not_admitted(binding, attempt, task, error)
                    .await;
                return None;
            }
            // the member may have admitted it: never resubmit, keep observing
            Err(error) => self.set_error(
                &binding.room_id,
                format!("task {task_id} observation failed after submit: {error}"),
            ),
        }
        self.observe(binding, attempt, task, port.as_ref(), &session_id, deadline)
            .await
    }

    /// Wait for `profile`'s turn lock (an operator's retry probing its task's member), renewing
    /// the room's lease as [`Self::renewal_tick`] says and checking that it is still `held`;
    /// `None` once it is lost or replaced (a lapsed lease is taken again under a new generation,
    /// which fences what the waiter would commit under the old one). Scheduler passes never
    /// wait here: they take the lock with [`Self::try_turn`] and end when it is held.
    async fn lock_renewing(
        &self,
        binding: &RoomBinding,
        profile: &str,
        held: &Lease,
    ) -> Option<HeldTurn> {
        let mut lock = self.inner.locks.lock(profile.to_string());
        let every = self.renewal_tick();
        loop {
            tokio::select! {
                guard = &mut lock => break Some(self.held(&binding.room_id, profile, guard)),
                _ = tokio::time::sleep(every) => {}
            }
            let kept = self
                .ensure_lease(binding)
                .await
                .is_ok_and(|now| now.lease_generation == held.lease_generation);
            if !kept {
                return None;
            }
        }
    }

    /// `room_id`'s hold of `profile`'s turn lock.
    fn held(&self, room_id: &str, profile: &str, guard: TurnGuard) -> HeldTurn {
        HeldTurn {
            guard: Some(guard),
            runtime: self.clone(),
            profile: profile.to_string(),
            room_id: room_id.to_string(),
        }
    }

    /// `profile`'s turn lock for `room_id` if it is free now; else `None`, and the room is woken
    /// when the holder releases it. The room is listed before the lock is tried, so a release
    /// between the try and the listing cannot be missed.
    pub(crate) fn try_turn(&self, room_id: &str, profile: &str) -> Option<HeldTurn> {
        self.state()
            .turn_waiters
            .entry(profile.to_string())
            .or_default()
            .insert(room_id.to_string());
        let guard = self.inner.locks.try_lock(profile.to_string())?;
        {
            let mut state = self.state();
            if let Some(waiters) = state.turn_waiters.get_mut(profile) {
                waiters.remove(room_id);
                if waiters.is_empty() {
                    state.turn_waiters.remove(profile);
                }
            }
        }
        Some(self.held(room_id, profile, guard))
    }

    /// Renew the room's lease when due. [`LeaseKept::Lost`] (and the room's error says why) when
    /// the attempt's lease is gone: lost, or replaced by a new generation;
    /// [`LeaseKept::NotRenewed`] when the store failed the renewal (nothing was decided: the
    /// lease holds until it expires, and the next look renews it again).
    async fn keep_lease_for(&self, binding: &RoomBinding, attempt: &TaskAttempt) -> LeaseKept {
        let task_id = &attempt.identity.task_id;
        if let Err(kept) = self.observed_lease(binding, task_id).await {
            return kept;
        }
        if self
            .lease(&binding.room_id)
            .is_some_and(|l| l.lease_generation != attempt.lease.lease_generation)
        {
            self.set_error(
                &binding.room_id,
                format!("task {task_id} fenced: driver lease is stale or expired"),
            );
            return LeaseKept::Lost;
        }
        LeaseKept::Held
    }

    /// The room's lease, renewed when due, for an observation of task `task_id`'s attempt; else
    /// why not, said in the room's error: [`LeaseKept::NotRenewed`] when the store failed the
    /// renewal (the observation goes on), [`LeaseKept::Lost`] when the lease is gone.
    async fn observed_lease(
        &self,
        binding: &RoomBinding,
        task_id: &str,
    ) -> Result<Lease, LeaseKept> {
        match self.ensure_lease(binding).await {
            Ok(lease) => Ok(lease),
            Err(error) if error.is_storage() => {
                self.set_error(
                    &binding.room_id,
                    format!("task {task_id}: lease renewal failed, retrying: {error}"),
                );
                Err(LeaseKept::NotRenewed)
            }
            Err(error) => {
                self.fenced(binding, task_id, &error);
                Err(LeaseKept::Lost)
            }
        }
    }

    async fn fail_before_submit(
        &self,
        binding: &RoomBinding,
        attempt: &TaskAttempt,
        error: PortError,
    ) {
        let task_id = attempt.identity.task_id.clone();
        // Should the stop not commit, the failure below is settled as a stopping task's
        // would be.
        if self.stop_before_submit(binding, attempt).await {
            return;
        }
        let (message, _) = bound_text(&error.message, MAX_TERMINAL_ERROR_BYTES);
        let settlement = Settlement {
            settlement_id: attempt_id("failure", &task_id, attempt.execution_generation),
            status: SettlementStatus::Failed,
            result: serde_json::json!({ "error": message }),
        };
        self.set_error(&binding.room_id, format!("task {task_id} failed: {error}"));
        if let Err(commit) = self.commit_receipt(binding, attempt, settlement).await {
            self.fenced(binding, &task_id, &commit);
        }
    }

    /// A stop acknowledged while the attempt had not reached its member (a cancel answered
    /// `stopping` while its session opened or its submit was on the way, then either failed):
    /// nothing reached the member, so the stop is what ends the attempt (`cancelled`, as its
    /// client was told). Whether it did.
    async fn stop_before_submit(&self, binding: &RoomBinding, attempt: &TaskAttempt) -> bool {
        let Ok(task) = self.read_task(&attempt.identity).await else {
            return false;
        };
        if task.status != TaskStatus::Stopping
            || task.execution_generation != attempt.execution_generation
        {
            return false;
        }
        let stopped = match self.ensure_lease(binding).await {
            Ok(lease) => self
                .complete_acknowledged_stop(binding, &lease, &task)
                .await
                .map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        match stopped {
            Ok(()) => true,
            Err(e) => {
                self.set_error(
                    &binding.room_id,
                    format!(
                        "task {} stop before submit failed: {e}",
                        attempt.identity.task_id
                    ),
                );
                false
            }
        }
    }

    async fn requeue_not_admitted(
        &self,
        binding: &RoomBinding,
        attempt: &TaskAttempt,
        task: &TaskView,
        error: PortError,
    ) {
        let task_id = attempt.identity.task_id.clone();
        let (current, clock) = (attempt.clone(), self.inner.clock.clone());
        match self
            .inner
            .db
            .write(move |c| requeue_not_admitted_task(c, &current, clock.as_ref()))
            .await
        {
            Ok(_) => {
                let route = (
                    binding.room_id.clone(),
                    task.payload.member_id().to_string(),
                );
                let delay = self.schedule_route_retry(route);
                self.set_error(
                    &binding.room_id,
                    format!(
                        "task {task_id} was not admitted; queued for retry in {delay}s: {error}"
                    ),
                );
            }
            // The requeue takes a running row only. Not admitted proves nothing reached the
            // member: a stop acknowledged meanwhile ends the attempt. Before, nothing ended
            // that stop: a peer, with no session to interrupt, never acknowledged it, and the
            // room stayed blocked behind it.
            Err(_) if self.stop_before_submit(binding, attempt).await => {}
            Err(fence) if ended_by_disband(&fence) => tracing::debug!(
                target: "gatehouse::rooms", room = %binding.room_id, task = %task_id, %fence,
                "not-admitted attempt left to the room's disband"
            ),
            Err(fence) => self.set_error(
                &binding.room_id,
                format!("task {task_id} not-admitted proof lost its fence: {fence}"),
            ),
        }
    }

    /// Exponential, capped back-off per member route: min, then min(max, max(min, previous × 2)).
    fn schedule_route_retry(&self, route: (String, String)) -> f64 {
        let (min, max) = (
            self.inner.config.unavailable_retry_min_seconds,
            self.inner.config.unavailable_retry_max_seconds,
        );
        let now = self.now();
        let mut state = self.state();
        let delay = match state.backoff.get(&route) {
            None => min,
            Some(previous) => max.min(min.max(previous.delay * 2.0)),
        };
        state.backoff.insert(
            route,
            Backoff {
                delay,
                next_at: now + delay,
            },
        );
        delay
    }

    /// Observe a submitted attempt until it is terminal, its stop is resolved or pending past its
    /// deadline, its fence is lost, or the runtime stops (which leaves it running).
    async fn observe(
        &self,
        binding: &RoomBinding,
        attempt: &TaskAttempt,
        task: &TaskView,
        port: &dyn SessionPort,
        session_id: &str,
        deadline: f64,
    ) -> Option<TaskView> {
        let task_id = attempt.identity.task_id.clone();
        let generation = attempt.execution_generation;
        // Each round renews the lease when half its TTL is gone (see `renewal_tick`): a longer
        // pause would let a long turn's lease lapse between two rounds (its settlement then
        // fenced out, and the task recovered as indeterminate, then deferred).
        let poll = self
            .inner
            .config
            .active_poll_interval_seconds
            .min(self.renewal_tick().as_secs_f64());
        let profile = task.payload.target_profile.clone();
        // Subscribed before the first check: the member's terminal report wakes it, and a report
        // that lands between a check and the pause must end that pause, not wait out the poll.
        let mut wake = self.waker(&binding.room_id);
        loop {
            if self.is_stopping() {
                return None;
            }
            let current = match self.read_task(&attempt.identity).await {
                Ok(current) => current,
                // Past the deadline, with the task unreadable, the watch ends: it gives back
                // the member's turn lock and the pass's slot, and a later pass, reading the task
                // again, begins the deadline's stop (`reattach_own_attempts`). Retrying here
                // held both for as long as the reads failed.
                Err(error) if self.inner.clock.monotonic() >= deadline => {
                    self.set_error(
                        &binding.room_id,
                        format!(
                            "task {task_id} exceeded its deadline and cannot be read to stop it: \
                             {error}"
                        ),
                    );
                    return None;
                }
                Err(error) => {
                    self.set_error(
                        &binding.room_id,
                        format!("task {task_id} observation failed after submit: {error}"),
                    );
                    self.pause_for(&mut wake, poll).await;
                    continue;
                }
            };
            if current.execution_generation != generation {
                return Some(current);
            }
            match current.status {
                TaskStatus::Running => {}
                TaskStatus::Stopping => {
                    // Renewed when due, not on every look: a member that never acknowledges
                    // its stop made four commits a second on the writer every session shares,
                    // for as long as the stop was pending.
                    let lease = match self.observed_lease(binding, &task_id).await {
                        Ok(lease) => lease,
                        Err(LeaseKept::NotRenewed) => {
                            self.pause_for(&mut wake, poll).await;
                            continue;
                        }
                        Err(_) => return None,
                    };
                    let outcome = self.finish_stop(binding, &lease, &current).await;
                    // A stop pending past the turn's deadline (a deadline stop, or a user's
                    // stop the member has not acknowledged) no longer holds the room's place: the
                    // stop stays recorded, and a later pass retries it.
                    let deadline_stop = current
                        .cancel_id
                        .as_deref()
                        .is_some_and(|id| id.starts_with("deadline:"))
                        || self.inner.clock.monotonic() >= deadline;
                    match outcome {
                        Ok(StopOutcome::Resolved) => continue,
                        Err(RoomsError::Store(error)) if ended_by_disband(&error) => {
                            self.fenced(binding, &task_id, &error);
                            return None;
                        }
                        Ok(StopOutcome::Pending) if deadline_stop => {
                            self.set_error(
                                &binding.room_id,
                                format!(
                                    "task {task_id} exceeded its deadline; stop remains pending"
                                ),
                            );
                            return None;
                        }
                        Ok(StopOutcome::Pending) => {}
                        Err(error) if deadline_stop => {
                            self.set_error(&binding.room_id, format!("task {task_id} exceeded its deadline; stop remains pending: {error}"));
                            return None;
                        }
                        Err(error) => self.set_error(
                            &binding.room_id,
                            format!("task {task_id} stop remains pending: {error}"),
                        ),
                    }
                    self.pause_for(&mut wake, poll).await;
                    continue;
                }
                _ => return Some(current),
            }
            if self.inner.clock.monotonic() >= deadline {
                // An attempt its member holds `unknown` is not stopped at its deadline: its
                // stop would find it "will not start" and record the task failed (then retried,
                // the turn having perhaps run). It waits for the member's operator.
                if port.keeps_ledger() {
                    let session = Self::session_ref(&profile, session_id);
                    let held = port
                        .ledger_attempt(session, attempt.identity.clone(), generation)
                        .await;
                    if let Ok(Some(LedgerAttempt::Unresolved {
                        session_id,
                        admission_id,
                    })) = held
                    {
                        let message = unresolved_member(&task_id, &session_id, &admission_id);
                        self.hold_room(binding, message);
                        return None;
                    }
                }
                let begun = self
                    .begin_deadline_stop(&attempt.identity, generation, current.cancel_generation)
                    .await;
                match begun {
                    Ok(_)
                    | Err(RoomStoreError::InvalidTransition(_))
                    | Err(RoomStoreError::StaleTask(_)) => {}
                    Err(error) => {
                        self.set_error(
                            &binding.room_id,
                            format!("task {task_id} deadline stop failed: {error}"),
                        );
                        self.pause_for(&mut wake, poll).await;
                    }
                }
                continue;
            }
            match self.keep_lease_for(binding, attempt).await {
                LeaseKept::Held => {}
                LeaseKept::Lost => {
                    // Nothing of the attempt can be written any more (a later pass recovers it),
                    // but the member may still run its turn: the turn lock is held until it
                    // ends or its deadline passes. Let go at once, another room's turn of the
                    // same member began beside it.
                    let session = Self::session_ref(&profile, session_id);
                    self.hold_while_member_runs(port, session, &task_id, deadline, &mut wake)
                        .await;
                    return None;
                }
                // Given up on a failed write, the member's turn ran on unobserved, its turn lock
                // and the room's slot let go: another room could start a turn of the same member.
                LeaseKept::NotRenewed => {
                    self.pause_for(&mut wake, poll).await;
                    continue;
                }
            }
            let session = Self::session_ref(&profile, session_id);
            match port
                .receipt(session.clone(), attempt.identity.clone(), generation)
                .await
            {
                Ok(receipt) => {
                    if let Some(receipt) = receipt {
                        if let Err(error) = self
                            .commit_receipt(binding, attempt, settlement_from_history(&receipt))
                            .await
                        {
                            if error.is_fence() || ended_by_disband(&error) {
                                self.fenced(binding, &task_id, &error);
                                return None;
                            }
                            self.set_error(
                                &binding.room_id,
                                format!("task {task_id} observation failed after submit: {error}"),
                            );
                            // Not again at once: a failing write asked again without a pause
                            // spun this watcher on the writer until the deadline.
                            self.pause_for(&mut wake, poll).await;
                        }
                        continue;
                    }
                }
                Err(error) => {
                    self.set_error(
                        &binding.room_id,
                        format!("task {task_id} observation failed after submit: {error}"),
                    );
                    self.pause_for(&mut wake, poll).await;
                    continue;
                }
            }
            match port.info(session.clone()).await {
                Ok(info) => {
                    self.report_pending(binding, &current, session_id, &info);
                    // A turn stopped outside the room (interrupted, cancelled) is in no
                    // history: only its terminal report tells, and a report whose commit failed
                    // left the task running until its deadline. The member's own ledger, where
                    // there is one, tells again.
                    if port.keeps_ledger() && !running_for(&info, &task_id) {
                        match self
                            .settle_stopped_in_ledger(binding, attempt, port, session)
                            .await
                        {
                            Ok(InLedger::Settled) => continue,
                            // Held `unknown` (its member's supervisor ended without settling
                            // it): it ends only by its member's operator, so the watch ends,
                            // giving back the member's turn lock and the pass's slot (held to
                            // the deadline, which then recorded a failure the task could be
                            // retried on, the turn having perhaps run). The room waits, as for
                            // an indeterminate attempt the member holds `unknown`.
                            Ok(InLedger::Unresolved(message)) => {
                                self.hold_room(binding, message);
                                return None;
                            }
                            Ok(InLedger::Other) => {}
                            Err(error) if error.is_fence() || ended_by_disband(&error) => {
                                self.fenced(binding, &task_id, &error);
                                return None;
                            }
                            Err(error) => self.set_error(
                                &binding.room_id,
                                format!("task {task_id} terminal commit failed: {error}"),
                            ),
                        }
                    }
                }
                Err(error) => self.set_error(
                    &binding.room_id,
                    format!("task {task_id} observation failed after submit: {error}"),
                ),
            }
            let left = deadline - self.inner.clock.monotonic();
            self.pause_for(&mut wake, poll.min(left.max(0.0))).await;
        }
    }

    /// Until the member's `session` no longer runs task `task_id`'s turn, the attempt's
    /// `deadline` passes, or the runtime stops (the caller holds the member's turn lock
    /// meanwhile). A member that cannot be asked is waited for to the deadline.
    async fn hold_while_member_runs(
        &self,
        port: &dyn SessionPort,
        session: SessionRef,
        task_id: &str,
        deadline: f64,
        wake: &mut RoomWaker,
    ) {
        let poll = self.inner.config.active_poll_interval_seconds;
        loop {
            let left = deadline - self.inner.clock.monotonic();
            if self.is_stopping() || left <= 0.0 {
                return;
            }
            if let Ok(info) = port.info(session.clone()).await {
                if !running_for(&info, task_id) {
                    return;
                }
            }
            self.pause_for(wake, poll.min(left)).await;
        }
    }

    /// An attempt's commit (or its lease) was refused. The room's disband is no error: a
    /// retired room's lease is forgotten (and released) by [`RoomRuntime::retired`], and a
    /// disbanding room's lease is still its own, for the disband to carry out.
    fn fenced(&self, binding: &RoomBinding, task_id: &str, error: &RoomStoreError) {
        if ended_by_disband(error) {
            tracing::debug!(
                target: "gatehouse::rooms", room = %binding.room_id, task = %task_id, %error,
                "attempt ended by the room's disband"
            );
            return;
        }
        if is_lease_loss(error) {
            self.state().leases.remove(&binding.room_id);
        }
        self.set_error(&binding.room_id, format!("task {task_id} fenced: {error}"));
    }

    // ---------------------------------------------------------------------------------------
    // Terminal commits

    fn terminal_callback(&self, binding: &RoomBinding, attempt: &TaskAttempt) -> TerminalCallback {
        let weak = Arc::downgrade(&self.inner);
        let (binding, attempt) = (binding.clone(), attempt.clone());
        Arc::new(move |receipt: TerminalReceipt| {
            if let Some(inner) = weak.upgrade() {
                RoomRuntime { inner }.on_terminal(&binding, &attempt, receipt);
            }
        })
    }

    /// A terminal report from the member (any thread).
    ///
    /// A cancelled or interrupted turn that this room asked to stop is resolved by the stop
    /// path (the task is `stopping`). One that ended so while the task was still `running` was
    /// stopped by something else, such as the drain of a graceful stop: the attempt is over and
    /// is never run again, so its task fails with the reason (while the lease is still held,
    /// which is why a graceful stop drains the members before it stops the rooms).
    pub(crate) fn on_terminal(
        &self,
        binding: &RoomBinding,
        attempt: &TaskAttempt,
        receipt: TerminalReceipt,
    ) {
        let task_id = &attempt.identity.task_id;
        let reported = receipt.status.clone();
        let committed = if matches!(receipt.status.as_str(), "cancelled" | "interrupted") {
            let settlement = settlement_from_ended(receipt, task_id, attempt.execution_generation);
            self.commit_stopped_elsewhere(binding, attempt, settlement)
        } else {
            let settlement =
                settlement_from_receipt(&receipt, task_id, attempt.execution_generation);
            self.commit_receipt_sync(binding, attempt, settlement)
        };
        match committed {
            Ok(_) => {}
            // The attempt was settled first, as expected of some reports: a turn the deadline
            // (or a stop) ended reports `interrupted` (`cancelled`) after the stop's own commit,
            // a different settlement of the same attempt. Nothing to record.
            Err(RoomStoreError::StaleTask(_))
            | Err(RoomStoreError::Conflict(_))
            | Err(RoomStoreError::Corrupt(_))
                if self.attempt_ended(attempt) =>
            {
                tracing::debug!(
                    target: "gatehouse::rooms", room = %binding.room_id, task = %task_id,
                    generation = attempt.execution_generation, %reported,
                    "terminal report ignored: the attempt was already settled"
                );
            }
            // A stop of the attempt is under way (the stop path settles it) or its fence moved.
            Err(RoomStoreError::StaleTask(_)) => tracing::debug!(
                target: "gatehouse::rooms", room = %binding.room_id, task = %task_id,
                generation = attempt.execution_generation, %reported,
                "terminal report ignored: the attempt is being stopped, or is stale"
            ),
            // Fenced, as it should be, and nothing the room need say: a late report of an
            // attempt made under a lease the room has since taken again (this process's own
            // lease lapsed mid-turn: the attempt is the new lease's to resolve, by its recovery
            // or its deadline's stop, and the new lease is no less the room's), or of one that
            // ended (its stop acknowledged, then the idle room let its lease go before the
            // member's turn said so).
            Err(error)
                if (error.is_fence() || is_lease_loss(&error))
                    && (self.lease(&binding.room_id).is_some_and(|held| {
                        held.lease_generation != attempt.lease.lease_generation
                    }) || self.attempt_ended(attempt)) =>
            {
                tracing::debug!(
                    target: "gatehouse::rooms", room = %binding.room_id, task = %task_id,
                    generation = attempt.execution_generation, %reported, %error,
                    "terminal report ignored: its attempt's lease was taken again, or it had ended"
                );
            }
            Err(error) if error.is_fence() || is_lease_loss(&error) => {
                self.fenced(binding, task_id, &error)
            }
            Err(error) => self.set_error(
                &binding.room_id,
                format!("task {task_id} terminal commit failed: {error}"),
            ),
        }
        // The pass that submitted the attempt observes it and takes up what follows: it needs
        // waking, not another pass after it. An attempt nobody observes (its pass is gone)
        // owes its room one.
        let observed = self.state().current_tasks.get(&binding.room_id) == Some(&attempt.identity);
        if observed {
            self.wake_observers(&binding.room_id);
        } else {
            self.wake_room(&binding.room_id);
        }
    }

    /// Whether `attempt` is over in the store: its task has ended at its generation, or moved on
    /// to a later one.
    fn attempt_ended(&self, attempt: &TaskAttempt) -> bool {
        match self.inner.db.run_sync(|c| get_task(c, &attempt.identity)) {
            Ok(task) => {
                task.execution_generation > attempt.execution_generation
                    || (task.execution_generation == attempt.execution_generation
                        && task.status.is_terminal())
            }
            Err(_) => false,
        }
    }

    /// Fail a `running` task whose member turn was cancelled or interrupted without a stop
    /// from this room. Only the running attempt's own settlement: if a stop intent got there
    /// first the CAS fails (`StaleTask`) and the stop path completes the task as `cancelled`.
    fn commit_stopped_elsewhere(
        &self,
        binding: &RoomBinding,
        attempt: &TaskAttempt,
        settlement: Settlement,
    ) -> Result<TaskView, RoomStoreError> {
        let (clock, owned) = (self.inner.clock.clone(), attempt.clone());
        let view = self
            .inner
            .db
            .write_sync(move |c| settle_task(c, &owned, &settlement, clock.as_ref()))?;
        if !view.idempotent {
            tracing::info!(
                target: "gatehouse::rooms",
                room = %attempt.identity.room_id,
                task = %attempt.identity.task_id,
                "the member's turn was stopped outside the room: task failed"
            );
            self.publish_terminal(binding, &view);
        }
        Ok(view)
    }

    /// A member turn stopped outside the room (interrupted, cancelled) is in no history: only
    /// its terminal report tells, and a report whose commit failed left the task running until
    /// its deadline. The member's own ledger tells again: the attempt is settled as the report
    /// would have settled it. Whether it was (a stop, or another report, that got there first
    /// is no error: the task, read again, says what it is now). An attempt the ledger holds
    /// `unknown` (its member's supervisor ended without settling it) is reported so: it will
    /// not end by itself, and only the member's operator can end it.
    async fn settle_stopped_in_ledger(
        &self,
        binding: &RoomBinding,
        attempt: &TaskAttempt,
        port: &dyn SessionPort,
        session: SessionRef,
    ) -> Result<InLedger, RoomStoreError> {
        let generation = attempt.execution_generation;
        let receipt = match port
            .ledger_attempt(session, attempt.identity.clone(), generation)
            .await
        {
            Ok(Some(LedgerAttempt::Ended(receipt))) => receipt,
            Ok(Some(LedgerAttempt::Unresolved {
                session_id,
                admission_id,
            })) => {
                return Ok(InLedger::Unresolved(unresolved_member(
                    &attempt.identity.task_id,
                    &session_id,
                    &admission_id,
                )))
            }
            _ => return Ok(InLedger::Other),
        };
        if !matches!(receipt.status.as_str(), "cancelled" | "interrupted") {
            return Ok(InLedger::Other);
        }
        let settlement = settlement_from_ended(receipt, &attempt.identity.task_id, generation);
        let committed = self
            .on_blocking(binding, attempt, move |runtime, binding, attempt| {
                runtime.commit_stopped_elsewhere(binding, attempt, settlement)
            })
            .await;
        match committed {
            Ok(_) => Ok(InLedger::Settled),
            Err(RoomStoreError::StaleTask(_))
            | Err(RoomStoreError::Conflict(_))
            | Err(RoomStoreError::Corrupt(_)) => Ok(InLedger::Other),
            Err(error) => Err(error),
        }
    }

    async fn commit_receipt(
        &self,
        binding: &RoomBinding,
        attempt: &TaskAttempt,
        settlement: Settlement,
    ) -> Result<TaskView, RoomStoreError> {
        self.on_blocking(binding, attempt, move |runtime, binding, attempt| {
            runtime.commit_receipt_sync(binding, attempt, settlement)
        })
        .await
    }

    /// Run `commit` (a synchronous commit of the attempt's) on the blocking pool, not on the
    /// thread that runs the rooms' passes and the session supervisors.
    async fn on_blocking<T: Send + 'static>(
        &self,
        binding: &RoomBinding,
        attempt: &TaskAttempt,
        commit: impl FnOnce(&Self, &RoomBinding, &TaskAttempt) -> Result<T, RoomStoreError>
            + Send
            + 'static,
    ) -> Result<T, RoomStoreError> {
        let runtime = self.clone();
        let (binding, attempt) = (binding.clone(), attempt.clone());
        tokio::task::spawn_blocking(move || commit(&runtime, &binding, &attempt))
            .await
            .map_err(|e| RoomStoreError::Pool(format!("database worker failed: {e}")))?
    }

    /// Settle the attempt; if a stop intent got there first, the completion still wins while the
    /// stop is unacknowledged. Publishes once per non-idempotent commit.
    fn commit_receipt_sync(
        &self,
        binding: &RoomBinding,
        attempt: &TaskAttempt,
        settlement: Settlement,
    ) -> Result<TaskView, RoomStoreError> {
        let (clock, owned, first) = (
            self.inner.clock.clone(),
            attempt.clone(),
            settlement.clone(),
        );
        let view = match self
            .inner
            .db
            .write_sync(move |c| settle_task(c, &owned, &first, clock.as_ref()))
        {
            Ok(view) => view,
            Err(RoomStoreError::StaleTask(message)) => {
                let row = self.inner.db.run_sync(|c| get_task(c, &attempt.identity))?;
                if row.status != TaskStatus::Stopping
                    || row.execution_generation != attempt.execution_generation
                {
                    return Err(RoomStoreError::StaleTask(message));
                }
                let lease = self
                    .lease(&binding.room_id)
                    .unwrap_or_else(|| attempt.lease.clone());
                let (identity, generation, cancel) = (
                    attempt.identity.clone(),
                    attempt.execution_generation,
                    row.cancel_generation,
                );
                let clock = self.inner.clock.clone();
                self.inner.db.write_sync(move |c| {
                    settle_stopping_task(
                        c,
                        &identity,
                        &lease,
                        generation,
                        cancel,
                        &settlement,
                        clock.as_ref(),
                    )
                })?
            }
            Err(error) => return Err(error),
        };
        self.publish_terminal(binding, &view);
        Ok(view)
    }

    // ---------------------------------------------------------------------------------------
    // Pending approvals

    /// A human's answer (`once` or `deny`) to the approval a running task's member waits on.
    /// Only the exact attempt answered about takes it: the task must be running under
    /// `execution_generation` (or `indeterminate` under it: recovered after its lease lapsed,
    /// its member may still run it, and the room reports the approval it waits on), and the
    /// member's running turn must be that attempt's input (the member's session fences its own
    /// generation in turn); anything else is [`AnswerOutcome::Stale`] and reaches no command.
    pub async fn answer_approval(
        &self,
        identity: &TaskIdentity,
        execution_generation: i64,
        request_id: &str,
        choice: &str,
        by: &str,
    ) -> Result<AnswerOutcome, RoomsError> {
        let task = self.read_task(identity).await?;
        if !matches!(task.status, TaskStatus::Running | TaskStatus::Indeterminate) {
            return Ok(AnswerOutcome::Stale(format!(
                "task {} is {}: none of its attempts waits on an answer",
                identity.task_id, task.status
            )));
        }
        if task.execution_generation != execution_generation {
            return Ok(AnswerOutcome::Stale(format!(
                "attempt {execution_generation} of task {} is not its running one ({})",
                identity.task_id, task.execution_generation
            )));
        }
        let binding = self
            .binding_for(&identity.room_id)
            .await
            .ok_or_else(|| RoomStoreError::RoomUnavailable("hosted room is unavailable".into()))?;
        let port = self.transport(&binding, &task)?;
        let profile = &task.payload.target_profile;
        let address = Self::member_address(profile, &identity.room_id);
        let Some(found) = port.resolve_exact(address).await? else {
            return Ok(AnswerOutcome::Stale(format!(
                "the member {} has no session in this room",
                task.payload.member_id()
            )));
        };
        let answer = ApprovalAnswer {
            session: Self::session_ref(profile, &found.session_id),
            task: identity.clone(),
            execution_generation,
            request_id: request_id.to_string(),
            choice: choice.to_string(),
            by: by.to_string(),
        };
        Ok(port.answer(answer).await?)
    }

    /// Report a pending approval (choices narrowed to once/deny) or its absence, on change.
    fn report_pending(
        &self,
        binding: &RoomBinding,
        task: &TaskView,
        session_id: &str,
        info: &SessionInfo,
    ) {
        let action = info
            .pending_approval
            .as_ref()
            .filter(|a| a.is_object())
            .map(|approval| {
                let mut approval = approval.clone();
                approval["choices"] = serde_json::Value::Array(room_approval_choices(&approval));
                serde_json::json!({
                    "kind": "approval",
                    "task_id": task.identity.task_id,
                    "execution_generation": task.execution_generation,
                    "run_id": info.run_id,
                    "session_id": session_id,
                    // The member's own name for the request: a peer's `request_id`, a local
                    // session's `prompt_id` (what `approval.respond` names).
                    "request_id": approval
                        .get("request_id")
                        .or_else(|| approval.get("prompt_id"))
                        .cloned()
                        .unwrap_or(serde_json::Value::Null),
                    "approval": approval,
                })
            });
        let member = task.payload.member_id().to_string();
        let key = (binding.room_id.clone(), member.clone());
        {
            let mut state = self.state();
            // Nothing waited on is no entry (a member's entry stayed, empty, for the room's
            // life): the same answer twice is said once either way.
            if state.pending_actions.get(&key) == action.as_ref() {
                return;
            }
            match &action {
                Some(action) => state.pending_actions.insert(key, action.clone()),
                None => state.pending_actions.remove(&key),
            };
        }
        self.inner
            .hooks
            .pending_action(&binding.room_id, &member, action.as_ref());
    }
}

/// `head` (read queued) as `start_task` left it: running `attempt`, under its lease.
fn started_view(head: TaskView, attempt: &TaskAttempt) -> TaskView {
    TaskView {
        status: TaskStatus::Running,
        execution_generation: attempt.execution_generation,
        cancel_generation: attempt.cancel_generation,
        run_gateway_id: Some(attempt.lease.gateway_id.clone()),
        run_process_generation: Some(attempt.lease.process_generation.clone()),
        run_lease_generation: Some(attempt.lease.lease_generation),
        idempotent: false,
        ..head
    }
}

/// The choices a room offers for a member's approval: its `once` and `deny`, in the member's
/// order (a room answers for one attempt: never for the session, nor always); both when the
/// member offered neither.
pub(crate) fn room_approval_choices(approval: &serde_json::Value) -> Vec<serde_json::Value> {
    let narrowed: Vec<serde_json::Value> = approval
        .get("choices")
        .and_then(|c| c.as_array())
        .map(|choices| {
            choices
                .iter()
                .filter(|c| matches!(c.as_str(), Some("once" | "deny")))
                .cloned()
                .collect()
        })
        .unwrap_or_default();
    if narrowed.is_empty() {
        vec!["once".into(), "deny".into()]
    } else {
        narrowed
    }
}
