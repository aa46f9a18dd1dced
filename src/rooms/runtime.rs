//! The hosted-room runtime: construction, lifecycle, the bounded rotating scheduler, status, and
//! the operator actions (`cancel`, `retry_indeterminate`). The per-room pass lives in
//! `supervisor.rs`.
//!
//! Scheduling: each cycle spawns at most `max_concurrent_rooms − busy` room workers, walking the
//! room list from a start index that rotates by one per cycle, so a later room is always reached.
//! A worker runs one pass of its room (`process_room`), which holds the slot for as long as a
//! member turn is observed (until it is terminal, stopped or past its deadline). A queued task
//! whose member's turn lock another room holds is not started: the pass ends (freeing the slot)
//! and the lock's release wakes the room.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use serde::Serialize;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::clock::{SharedClock, SystemClock};
use crate::rooms::config::{RoomsConfig, RoomsConfigError};
use crate::rooms::db::RoomsDb;
use crate::rooms::port::{LedgerAttempt, PortError, ProfileTurnLocks, SessionPort, TurnLocks};
use crate::rooms::supervisor::Probe;
use crate::store::leases::Lease;
use crate::store::room_tasks::{
    begin_task_cancel, cancel_task, get_task, requeue_deferred_task, requeue_indeterminate_task,
    resolve_indeterminate_cancellation, resolve_indeterminate_task, TaskIdentity, TaskStatus,
    TaskView,
};
use crate::store::rooms::RoomStoreError;

/// The cancellation id of the cancellations a disband makes (one id: cancelling again is
/// idempotent, whether `room.disband` or the room's pass does it).
pub const DISBAND_CANCEL_ID: &str = "disband";

/// A room this gateway drives, with the authority it drives it under.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
pub struct RoomBinding {
    pub room_id: String,
    pub gateway_id: String,
    pub authority_epoch: i64,
    /// Its disband fence is up: the room's pass retires it once nothing in it is unresolved.
    pub disbanding: bool,
}

impl RoomBinding {
    pub fn new(
        room_id: impl Into<String>,
        gateway_id: impl Into<String>,
        authority_epoch: i64,
    ) -> Self {
        Self {
            room_id: room_id.into(),
            gateway_id: gateway_id.into(),
            authority_epoch,
            disbanding: false,
        }
    }

    /// The same binding, read with the room's disband fence up (or not).
    pub fn disbanding(mut self, disbanding: bool) -> Self {
        self.disbanding = disbanding;
        self
    }
}

/// The rooms to drive, re-read on every use.
pub type BindingSource = Arc<dyn Fn() -> Vec<RoomBinding> + Send + Sync>;

/// Chooses the transport of one task (e.g. a [`crate::rooms::port::PeerTransport`] for a member
/// on another gateway). Never changes durable state.
pub type TransportResolver =
    Arc<dyn Fn(&RoomBinding, &TaskView) -> Result<Arc<dyn SessionPort>, PortError> + Send + Sync>;

/// Policy hooks. All have no-op defaults; consumers must be idempotent.
pub trait RoomHooks: Send + Sync {
    /// Called at the start of every room pass.
    fn prepare_room(&self, _binding: &RoomBinding) -> Result<(), String> {
        Ok(())
    }
    /// Called once per terminal commit the runtime makes (settled, failed, deferred).
    fn publish_terminal(&self, _binding: &RoomBinding, _task: &TaskView) {}
    /// Called once per cancellation committed by `cancel` or by an acknowledged stop. Kept
    /// apart from [`RoomHooks::publish_terminal`], which the contract keeps cancellations out
    /// of; an event stream wants every terminal commit.
    fn task_cancelled(&self, _room_id: &str, _task: &TaskView) {}
    /// The room was retired (disbanded): nothing more is published of it.
    fn room_retired(&self, _room_id: &str) {}
    /// A member waits on an approval (`Some`), or no longer does (`None`).
    fn pending_action(
        &self,
        _room_id: &str,
        _member_id: &str,
        _action: Option<&serde_json::Value>,
    ) {
    }
}

/// Hooks that do nothing.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoRoomHooks;

impl RoomHooks for NoRoomHooks {}

/// Errors of the runtime's operations.
#[derive(Debug, thiserror::Error)]
pub enum RoomsError {
    #[error(transparent)]
    Store(#[from] RoomStoreError),
    #[error(transparent)]
    Port(#[from] PortError),
    #[error(transparent)]
    Config(#[from] RoomsConfigError),
    #[error("{0}")]
    Hook(String),
    /// The task's member turn is `unknown` (a crash cut it short): it holds the member's
    /// session, so nothing of the task can run until the member's operator resolves it.
    #[error(
        "task {task_id} waits for its member's unknown turn, which holds the member's session: \
         resolve it first with `gatehouse resolve-unknown {session_id} {admission_id}`"
    )]
    UnknownTurn {
        task_id: String,
        session_id: String,
        admission_id: String,
    },
}

impl RoomsError {
    /// The store error inside, if any.
    pub fn store(&self) -> Option<&RoomStoreError> {
        match self {
            Self::Store(e) => Some(e),
            _ => None,
        }
    }
}

/// A snapshot of the runtime.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RoomsStatus {
    pub running: bool,
    pub stopping: bool,
    pub process_generation: String,
    pub current_task: Option<TaskIdentity>,
    /// One identity per room with a member turn in flight.
    pub current_tasks: Vec<TaskIdentity>,
    pub leased_rooms: Vec<String>,
    pub blocked_rooms: Vec<String>,
    /// Rooms with work waiting for one of the `max_concurrent_rooms` slots (a count over the
    /// gateway, as `passes` is).
    pub waiting_rooms: usize,
    /// The last error of any room (the operator's view); see [`RoomsStatus::visible_to`].
    pub last_error: Option<String>,
    /// Each room's last error, oldest first (not sent: [`RoomsStatus::visible_to`] picks from it).
    #[serde(skip)]
    pub room_errors: Vec<(String, String)>,
    /// Completed scheduler cycles.
    pub cycles: u64,
    /// Room passes begun.
    pub passes: u64,
    /// Lease renewals committed.
    pub lease_renewals: u64,
    /// Leases found lost (expired, replaced, or authority moved).
    pub lease_losses: u64,
}

impl RoomsStatus {
    /// Every room the snapshot names (leased, blocked, in flight, or with an error).
    pub fn rooms(&self) -> BTreeSet<String> {
        let mut rooms: BTreeSet<String> = self.leased_rooms.iter().cloned().collect();
        rooms.extend(self.blocked_rooms.iter().cloned());
        rooms.extend(self.current_tasks.iter().map(|t| t.room_id.clone()));
        rooms.extend(self.room_errors.iter().map(|(room, _)| room.clone()));
        rooms
    }

    /// The snapshot as a caller that may see only the rooms `visible` admits sees it: the
    /// other rooms' leases, blocks and turns in flight are left out, and `last_error` is the
    /// last error of a room it may see (none if there is none: another room's error names that
    /// room, its sessions and admissions).
    pub fn visible_to(mut self, visible: impl Fn(&str) -> bool) -> RoomsStatus {
        self.leased_rooms.retain(|room| visible(room));
        self.blocked_rooms.retain(|room| visible(room));
        self.current_tasks.retain(|task| visible(&task.room_id));
        self.current_task = self.current_tasks.first().cloned();
        self.room_errors.retain(|(room, _)| visible(room));
        self.last_error = self.room_errors.last().map(|(_, message)| message.clone());
        self
    }
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct Backoff {
    pub delay: f64,
    pub next_at: f64,
}

#[derive(Default)]
pub(crate) struct RuntimeState {
    pub running: bool,
    pub stopping: bool,
    /// No new attempt starts ([`RoomRuntime::quiesce`]); attempts in flight are still observed.
    pub quiesced: bool,
    pub cycles: u64,
    pub passes: u64,
    pub cursor: usize,
    pub leases: HashMap<String, Lease>,
    /// Rooms whose lease this runtime is releasing (no longer its to use, still its in the row
    /// until the release is written): the status counts them leased.
    pub releasing: HashSet<String>,
    pub recovered: HashSet<(String, i64)>,
    pub blocked: BTreeSet<String>,
    /// Each room's last error, with the order it was recorded in (the newest is the runtime's
    /// `last_error`; a retired room's goes with it).
    pub room_errors: HashMap<String, (u64, String)>,
    pub errors_recorded: u64,
    pub current_tasks: BTreeMap<String, TaskIdentity>,
    pub inspected: HashSet<(String, String, i64)>,
    pub backoff: HashMap<(String, String), Backoff>,
    pub pending_actions: HashMap<(String, String), serde_json::Value>,
    pub lease_renewals: u64,
    pub lease_losses: u64,
    /// Rooms whose pass found their member's turn lock held (by profile): their queued head
    /// waits, without a scheduler slot, for the holder's release, which wakes them.
    pub turn_waiters: HashMap<String, BTreeSet<String>>,
    /// Rooms whose release of a turn lock woke other rooms waiting for it: their pass ends
    /// after that attempt (and is owed again), so a room with a long queue does not keep the
    /// member from the rooms that waited.
    pub turn_yielded: HashSet<String>,
    /// Rooms owed a pass that wait for a scheduler slot (as the scheduler last counted them),
    /// not counting those whose last pass found nothing to do and that nothing has woken since:
    /// a room's pass ends after its attempt while any wait, so one room with a long queue does
    /// not hold its slot until the queue is empty (nor give it up to rooms that only get the
    /// poll round's look).
    pub slot_waiters: usize,
    /// Rooms whose last pass found nothing to do, until something wakes them (a task admitted,
    /// a member's report, a stop or a retry: [`RoomRuntime::wake_room`]).
    pub idle_rooms: HashSet<String>,
    /// Tasks (room, task) an attempt of which this process is starting: from before its start
    /// commits until its submission has answered. A stop of such a task is not acknowledged by
    /// finding no turn of the attempt at the member yet: the attempt's own observation stops it.
    pub submitting: HashSet<(String, String)>,
}

pub(crate) struct Inner {
    pub db: RoomsDb,
    pub bindings: BindingSource,
    pub rpc: Option<Arc<dyn SessionPort>>,
    pub resolver: Option<TransportResolver>,
    pub locks: Arc<dyn TurnLocks>,
    pub hooks: Arc<dyn RoomHooks>,
    pub clock: SharedClock,
    pub config: RoomsConfig,
    pub process_generation: String,
    pub state: Mutex<RuntimeState>,
    /// A round of passes over every room (and the observers).
    pub wake: watch::Sender<u64>,
    /// Every attempt's observer ([`RoomRuntime::wakeup`]).
    pub observe: watch::Sender<u64>,
    /// One room's observers ([`RoomRuntime::wake_room`]); an entry lives while someone observes.
    pub room_observers: Mutex<HashMap<String, watch::Sender<u64>>>,
    /// Rooms that want a pass ([`RoomRuntime::wake_room`]), and the scheduler's signal for them.
    pub poked: Mutex<HashSet<String>>,
    pub poke: watch::Sender<u64>,
    pub stop: watch::Sender<bool>,
    pub supervisor: Mutex<Option<JoinHandle<()>>>,
    pub workers: Mutex<HashMap<String, JoinHandle<()>>>,
}

/// Builds a [`RoomRuntime`].
pub struct RoomRuntimeBuilder {
    db: RoomsDb,
    bindings: BindingSource,
    rpc: Option<Arc<dyn SessionPort>>,
    resolver: Option<TransportResolver>,
    locks: Option<Arc<dyn TurnLocks>>,
    hooks: Option<Arc<dyn RoomHooks>>,
    clock: Option<SharedClock>,
    config: RoomsConfig,
    process_generation: Option<String>,
}

impl RoomRuntimeBuilder {
    /// The local session adapter (the session authority's `SessionPort`).
    pub fn rpc(mut self, rpc: Arc<dyn SessionPort>) -> Self {
        self.rpc = Some(rpc);
        self
    }

    /// A per-task transport resolver (takes precedence over `rpc`).
    pub fn transport_resolver(mut self, resolver: TransportResolver) -> Self {
        self.resolver = Some(resolver);
        self
    }

    /// The per-profile turn locks (default: [`ProfileTurnLocks`]). Share them with anything else
    /// that runs turns for the same profiles.
    pub fn turn_locks(mut self, locks: Arc<dyn TurnLocks>) -> Self {
        self.locks = Some(locks);
        self
    }

    pub fn hooks(mut self, hooks: Arc<dyn RoomHooks>) -> Self {
        self.hooks = Some(hooks);
        self
    }

    pub fn clock(mut self, clock: SharedClock) -> Self {
        self.clock = Some(clock);
        self
    }

    pub fn config(mut self, config: RoomsConfig) -> Self {
        self.config = config;
        self
    }

    /// Override the process generation (default: a random UUIDv4 as 32 lowercase hex chars).
    pub fn process_generation(mut self, generation: impl Into<String>) -> Self {
        self.process_generation = Some(generation.into());
        self
    }

    pub fn build(self) -> Result<RoomRuntime, RoomsError> {
        self.config.validate()?;
        if self.rpc.is_none() && self.resolver.is_none() {
            return Err(RoomsError::Config(RoomsConfigError(
                "rpc or transport_resolver is required".into(),
            )));
        }
        let process_generation = match self.process_generation {
            Some(generation) => {
                crate::store::rooms::validate_identifier("process_generation", &generation)?
            }
            None => uuid::Uuid::new_v4().simple().to_string(),
        };
        let (wake, _) = watch::channel(0_u64);
        let (observe, _) = watch::channel(0_u64);
        let (poke, _) = watch::channel(0_u64);
        let (stop, _) = watch::channel(false);
        Ok(RoomRuntime {
            inner: Arc::new(Inner {
                db: self.db,
                bindings: self.bindings,
                rpc: self.rpc,
                resolver: self.resolver,
                locks: self
                    .locks
                    .unwrap_or_else(|| Arc::new(ProfileTurnLocks::default())),
                hooks: self.hooks.unwrap_or_else(|| Arc::new(NoRoomHooks)),
                clock: self
                    .clock
                    .unwrap_or_else(|| Arc::new(SystemClock::default())),
                config: self.config,
                process_generation,
                state: Mutex::new(RuntimeState::default()),
                wake,
                observe,
                room_observers: Mutex::new(HashMap::new()),
                poked: Mutex::new(HashSet::new()),
                poke,
                stop,
                supervisor: Mutex::new(None),
                workers: Mutex::new(HashMap::new()),
            }),
        })
    }
}

/// What ends an observer's pause early: its room's wakeups and the runtime's.
pub(crate) struct RoomWaker {
    room: watch::Receiver<u64>,
    all: watch::Receiver<u64>,
}

/// The hosted-room runtime. Cheap to clone; all clones share one runtime.
#[derive(Clone)]
pub struct RoomRuntime {
    pub(crate) inner: Arc<Inner>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

impl RoomRuntime {
    /// Start building a runtime over `db` for the rooms `bindings` returns.
    pub fn builder(db: RoomsDb, bindings: BindingSource) -> RoomRuntimeBuilder {
        RoomRuntimeBuilder {
            db,
            bindings,
            rpc: None,
            resolver: None,
            locks: None,
            hooks: None,
            clock: None,
            config: RoomsConfig::default(),
            process_generation: None,
        }
    }

    /// A fixed list of bindings.
    pub fn fixed_bindings(bindings: Vec<RoomBinding>) -> BindingSource {
        Arc::new(move || bindings.clone())
    }

    pub fn process_generation(&self) -> &str {
        &self.inner.process_generation
    }

    pub fn config(&self) -> &RoomsConfig {
        &self.inner.config
    }

    /// Whether a member of `profile` can run: `Some(false)` when the member port (no per-task
    /// transport chooses one) knows it has no such profile, `None` when it cannot tell.
    pub fn has_profile(&self, profile: &str) -> Option<bool> {
        if self.inner.resolver.is_some() {
            return None;
        }
        self.inner.rpc.as_ref()?.has_profile(profile)
    }

    pub(crate) fn state(&self) -> MutexGuard<'_, RuntimeState> {
        lock(&self.inner.state)
    }

    pub(crate) fn now(&self) -> f64 {
        self.inner.clock.now()
    }

    /// A terminal commit (settled, failed, deferred) made by the runtime: published, and the
    /// member's pending approval, if it was this task's, reported gone (the attempt that asked
    /// for it is over, however it ended). Said once: a commit that replayed an identical
    /// earlier one (`idempotent`) was said then.
    pub(crate) fn publish_terminal(&self, binding: &RoomBinding, view: &TaskView) {
        if !view.idempotent {
            self.inner.hooks.publish_terminal(binding, view);
            self.forget_pending_of(&binding.room_id, view);
        }
    }

    /// A cancellation committed: published, and the task's pending approval reported gone.
    /// Said once, as [`RoomRuntime::publish_terminal`].
    pub(crate) fn publish_cancelled(&self, room_id: &str, view: &TaskView) {
        if !view.idempotent {
            self.inner.hooks.task_cancelled(room_id, view);
            self.forget_pending_of(room_id, view);
        }
    }

    /// What room `room_id`'s members wait on now (`room.pending_action`'s latest non-null
    /// actions, by member): for a client that was not following the room when it was said.
    pub fn pending_actions(&self, room_id: &str) -> Vec<(String, serde_json::Value)> {
        let mut pending: Vec<(String, serde_json::Value)> = self
            .state()
            .pending_actions
            .iter()
            .filter(|((room, _), _)| room == room_id)
            .map(|((_, member), action)| (member.clone(), action.clone()))
            .collect();
        pending.sort_by(|a, b| a.0.cmp(&b.0));
        pending
    }

    fn forget_pending_of(&self, room_id: &str, view: &TaskView) {
        let member = view.payload.member_id().to_string();
        let key = (room_id.to_string(), member.clone());
        {
            let mut state = self.state();
            let of_this_task = state
                .pending_actions
                .get(&key)
                .is_some_and(|action| action["task_id"] == view.identity.task_id.as_str());
            if !of_this_task {
                return;
            }
            state.pending_actions.remove(&key);
        }
        self.inner.hooks.pending_action(room_id, &member, None);
    }

    /// Record an error of room `room_id` (its own last error, and the runtime's).
    pub(crate) fn set_error(&self, room_id: &str, message: String) {
        let mut state = self.state();
        // A room that stays blocked says why on every pass: the log says it once.
        if state
            .room_errors
            .get(room_id)
            .is_none_or(|(_, current)| *current != message)
        {
            tracing::warn!(target: "gatehouse::rooms", room = %room_id, "{message}");
        }
        state.errors_recorded += 1;
        let order = state.errors_recorded;
        state
            .room_errors
            .insert(room_id.to_string(), (order, message));
    }

    /// A room was retired (disbanded): forget what the runtime holds of it (its lease, block,
    /// error, back-off and pending actions) and release its lease, so the room leaves the
    /// status's leased rooms now rather than never.
    pub async fn retired(&self, room_id: &str) {
        let lease = {
            let mut state = self.state();
            state.blocked.remove(room_id);
            state.room_errors.remove(room_id);
            state.recovered.retain(|(room, _)| room != room_id);
            state.inspected.retain(|(room, _, _)| room != room_id);
            state.backoff.retain(|(room, _), _| room != room_id);
            state.pending_actions.retain(|(room, _), _| room != room_id);
            state.idle_rooms.remove(room_id);
            state.turn_yielded.remove(room_id);
            state.leases.remove(room_id)
        };
        self.inner.hooks.room_retired(room_id);
        if let Some(lease) = lease {
            let clock = self.inner.clock.clone();
            let released = self
                .inner
                .db
                .write(move |c| crate::store::leases::release_lease(c, &lease, clock.as_ref()))
                .await;
            if let Err(error) = released {
                tracing::debug!(
                    target: "gatehouse::rooms", room = %room_id, %error,
                    "retired room: its lease was not released (it lapses)"
                );
            }
        }
    }

    pub(crate) fn is_stopping(&self) -> bool {
        *self.inner.stop.borrow()
    }

    /// Start no new attempt from now on, but keep observing (and settling) the ones in flight:
    /// the first step of a graceful stop, before the member sessions drain, so that a member
    /// turn the drain interrupts settles its task while this runtime still holds the lease.
    pub fn quiesce(&self) {
        self.state().quiesced = true;
    }

    /// Whether a new attempt may start now.
    pub(crate) fn starts_refused(&self) -> bool {
        self.is_stopping() || self.state().quiesced
    }

    /// The in-memory lease of a room, if held.
    pub fn lease(&self, room_id: &str) -> Option<Lease> {
        self.state().leases.get(room_id).cloned()
    }

    /// Adopt a lease acquired elsewhere for this process (used by recovery tooling and tests).
    pub fn adopt_lease(&self, lease: Lease) {
        self.state().leases.insert(lease.room_id.clone(), lease);
    }

    /// The room's binding, read on the blocking pool (the source may read the store).
    pub(crate) async fn binding_for(&self, room_id: &str) -> Option<RoomBinding> {
        let (source, room_id) = (self.inner.bindings.clone(), room_id.to_string());
        tokio::task::spawn_blocking(move || source().into_iter().find(|b| b.room_id == room_id))
            .await
            .ok()
            .flatten()
    }

    /// Wake the scheduler and every observer now.
    pub fn wakeup(&self) {
        self.inner.wake.send_modify(|n| *n = n.wrapping_add(1));
        self.inner.observe.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Something changed for one room (a task admitted, a member's terminal report): a pass of
    /// that room, not a round over every room, and that room's observers woken, not every room's.
    /// A round per task cost every room a pass: with 128 rooms, a room task took 41 ms of the
    /// daemon's CPU, 23 ms once it woke only its own room (the task's own turn costs under 1 ms).
    pub fn wake_room(&self, room_id: &str) {
        self.state().idle_rooms.remove(room_id);
        lock(&self.inner.poked).insert(room_id.to_string());
        self.inner.poke.send_modify(|n| *n = n.wrapping_add(1));
        self.wake_observers(room_id);
    }

    /// A task of room `room_id` was resolved outside its pass: the room is no longer blocked on
    /// it, and its queue goes on at once (not at the next poll).
    fn resume_room(&self, room_id: &str) {
        self.state().blocked.remove(room_id);
        self.wake_room(room_id);
    }

    /// Wake the room's observers only.
    pub(crate) fn wake_observers(&self, room_id: &str) {
        let mut observers = lock(&self.inner.room_observers);
        if let Some(tx) = observers.get(room_id) {
            if tx.receiver_count() == 0 {
                observers.remove(room_id);
            } else {
                tx.send_modify(|n| *n = n.wrapping_add(1));
            }
        }
    }

    /// The rooms poked since the last call.
    pub(crate) fn take_poked(&self) -> HashSet<String> {
        std::mem::take(&mut *lock(&self.inner.poked))
    }

    /// A receiver of wakeups from now on, for [`RoomRuntime::pause_for`]: a loop subscribes
    /// before its first check, so that no wakeup between a check and its pause is lost.
    pub(crate) fn waker(&self, room_id: &str) -> RoomWaker {
        let room = {
            let mut observers = lock(&self.inner.room_observers);
            observers.retain(|_, tx| tx.receiver_count() > 0);
            observers
                .entry(room_id.to_string())
                .or_insert_with(|| watch::channel(0_u64).0)
                .subscribe()
        };
        RoomWaker {
            room,
            all: self.inner.observe.subscribe(),
        }
    }

    /// Wait up to `seconds`, or until stopped, or until woken since `wake` last returned: a
    /// wakeup between a loop's check and its pause ends the pause at once instead of being lost.
    pub(crate) async fn pause_for(&self, wake: &mut RoomWaker, seconds: f64) {
        let mut stop = self.inner.stop.subscribe();
        if *stop.borrow_and_update() {
            return;
        }
        let duration = Duration::from_secs_f64(seconds.clamp(0.001, 3600.0));
        tokio::select! {
            _ = wake.room.changed() => {}
            _ = wake.all.changed() => {}
            _ = stop.changed() => {}
            _ = tokio::time::sleep(duration) => {}
        }
    }

    /// A snapshot of the runtime.
    pub fn status(&self) -> RoomsStatus {
        let state = self.state();
        let current_tasks: Vec<TaskIdentity> = state.current_tasks.values().cloned().collect();
        let leased_rooms: Vec<String> = state
            .leases
            .keys()
            .chain(&state.releasing)
            .cloned()
            .collect::<BTreeSet<String>>()
            .into_iter()
            .collect();
        let mut room_errors: Vec<(u64, String, String)> = state
            .room_errors
            .iter()
            .map(|(room, (order, message))| (*order, room.clone(), message.clone()))
            .collect();
        room_errors.sort();
        RoomsStatus {
            running: state.running,
            stopping: state.stopping,
            process_generation: self.inner.process_generation.clone(),
            current_task: current_tasks.first().cloned(),
            current_tasks,
            leased_rooms,
            blocked_rooms: state.blocked.iter().cloned().collect(),
            waiting_rooms: state.slot_waiters,
            last_error: room_errors.last().map(|(_, _, message)| message.clone()),
            room_errors: room_errors
                .into_iter()
                .map(|(_, room, message)| (room, message))
                .collect(),
            cycles: state.cycles,
            passes: state.passes,
            lease_renewals: state.lease_renewals,
            lease_losses: state.lease_losses,
        }
    }

    /// Start the scheduler (idempotent). Must be called inside a tokio runtime.
    pub fn start(&self) {
        let mut supervisor = lock(&self.inner.supervisor);
        if supervisor.as_ref().is_some_and(|h| !h.is_finished()) {
            return;
        }
        {
            let mut state = self.state();
            state.running = true;
            state.stopping = false;
            state.quiesced = false;
        }
        self.inner.stop.send_replace(false);
        let runtime = self.clone();
        *supervisor = Some(tokio::spawn(async move { runtime.supervise().await }));
    }

    async fn supervise(&self) {
        let mut wake = self.inner.wake.subscribe();
        let mut poke = self.inner.poke.subscribe();
        let mut stop = self.inner.stop.subscribe();
        loop {
            if *stop.borrow_and_update() {
                break;
            }
            wake.borrow_and_update();
            poke.borrow_and_update();
            // This scheduler runs every room's pass on each cycle, poked ones included.
            self.take_poked();
            self.schedule_cycle();
            self.state().cycles += 1;
            let poll = Duration::from_secs_f64(self.inner.config.poll_interval_seconds);
            tokio::select! {
                _ = wake.changed() => {}
                _ = poke.changed() => {}
                _ = stop.changed() => {}
                _ = tokio::time::sleep(poll) => {}
            }
        }
    }

    /// One scheduling cycle: spawn room workers up to the free capacity, from a rotating start.
    fn schedule_cycle(&self) {
        if self.is_stopping() {
            return;
        }
        let mut workers = lock(&self.inner.workers);
        workers.retain(|_, handle| !handle.is_finished());
        let mut available = self
            .inner
            .config
            .max_concurrent_rooms
            .saturating_sub(workers.len());
        if available == 0 {
            return;
        }
        let bindings = (self.inner.bindings)();
        if bindings.is_empty() {
            return;
        }
        let start = {
            let mut state = self.state();
            let start = state.cursor % bindings.len();
            state.cursor = state.cursor.wrapping_add(1);
            start
        };
        for offset in 0..bindings.len() {
            if available == 0 {
                break;
            }
            let binding = bindings[(start + offset) % bindings.len()].clone();
            if workers.contains_key(&binding.room_id) {
                continue;
            }
            let runtime = self.clone();
            let room_id = binding.room_id.clone();
            workers.insert(
                room_id,
                tokio::spawn(async move { runtime.process_room(&binding).await }),
            );
            available -= 1;
        }
    }

    /// Process every room once, one after the other (for tools and tests).
    pub async fn run_cycle(&self) {
        for binding in (self.inner.bindings)() {
            self.process_room(&binding).await;
        }
        self.state().cycles += 1;
    }

    /// Stop the scheduler and room workers, waiting at most `timeout`. Never interrupts an
    /// accepted turn: its task stays `running` and a late completion may still settle it while the
    /// lease is valid. Returns true iff everything stopped in time.
    pub async fn stop(&self, timeout: Duration) -> bool {
        self.state().stopping = true;
        self.inner.stop.send_replace(true);
        self.wakeup();
        let deadline = tokio::time::Instant::now() + timeout;
        let mut stopped = true;
        let supervisor = lock(&self.inner.supervisor).take();
        if let Some(handle) = supervisor {
            stopped &= tokio::time::timeout_at(deadline, handle).await.is_ok();
        }
        let workers: Vec<JoinHandle<()>> =
            lock(&self.inner.workers).drain().map(|(_, h)| h).collect();
        for handle in workers {
            stopped &= tokio::time::timeout_at(deadline, handle).await.is_ok();
        }
        let leases: Vec<Lease> = self
            .state()
            .leases
            .drain()
            .map(|(_, lease)| lease)
            .collect();
        for lease in leases {
            let clock = self.inner.clock.clone();
            let release = self.inner.db.write(move |conn| {
                crate::store::leases::release_lease(conn, &lease, clock.as_ref())
            });
            // a room with a running task keeps its lease until it expires
            let _ = tokio::time::timeout_at(deadline, release).await;
        }
        let mut state = self.state();
        state.running = false;
        state.current_tasks.clear();
        stopped
    }

    /// Cancel a task: queued or deferred work is cancelled at once; running work gets a durable
    /// stop intent (`stopping`) before any interrupt, and is cancelled once the member
    /// acknowledges. A completion that wins the race settles the task instead. Returns the fresh
    /// task view (`cancelled`, `stopping` or `settled`).
    pub async fn cancel(
        &self,
        identity: &TaskIdentity,
        cancel_id: &str,
    ) -> Result<TaskView, RoomsError> {
        // Whatever the task's state: a stopping or cancelled task answered a malformed id
        // as if it were one, where a queued or running one refused it.
        crate::store::rooms::validate_identifier("cancel_id", cancel_id)?;
        let clock = self.inner.clock.clone();
        let mut stopping = None;
        let mut last_status = None;
        for _ in 0..8 {
            let task = self.read_task(identity).await?;
            last_status = Some(task.status);
            let (id, cancel, generation) = (
                identity.clone(),
                cancel_id.to_string(),
                task.cancel_generation,
            );
            let clock = clock.clone();
            let attempt = match task.status {
                TaskStatus::Cancelled => return Ok(task),
                TaskStatus::Settled | TaskStatus::Failed => {
                    return Err(RoomStoreError::InvalidTransition(format!(
                        "cannot cancel task in state '{}'",
                        task.status
                    ))
                    .into())
                }
                TaskStatus::Stopping => {
                    stopping = Some(task);
                    break;
                }
                TaskStatus::Queued | TaskStatus::Deferred => {
                    let result = self
                        .inner
                        .db
                        .write(move |c| cancel_task(c, &id, &cancel, generation, clock.as_ref()))
                        .await;
                    match result {
                        Ok(view) => {
                            self.publish_cancelled(&identity.room_id, &view);
                            self.wake_room(&identity.room_id);
                            return Ok(view);
                        }
                        Err(e) => e,
                    }
                }
                TaskStatus::Running | TaskStatus::Indeterminate => {
                    let result = self
                        .inner
                        .db
                        .write(move |c| {
                            begin_task_cancel(c, &id, &cancel, generation, clock.as_ref())
                        })
                        .await;
                    match result {
                        Ok(view) => {
                            stopping = Some(view);
                            break;
                        }
                        Err(e) => e,
                    }
                }
            };
            match attempt {
                RoomStoreError::InvalidTransition(_) | RoomStoreError::StaleTask(_) => continue,
                other => return Err(other.into()),
            }
        }
        let Some(task) = stopping else {
            let task = self.read_task(identity).await?;
            if task.status == TaskStatus::Cancelled {
                return Ok(task);
            }
            let state = last_status.map(|s| s.to_string()).unwrap_or_default();
            return Err(RoomStoreError::InvalidTransition(format!(
                "cancel kept losing races with the task (last observed state '{state}')"
            ))
            .into());
        };
        let Some(binding) = self.binding_for(&identity.room_id).await else {
            return Ok(task);
        };
        match self.finish_user_stop(&binding, &task).await {
            Ok(()) => {}
            // Another disband of the room (its pass, or `room.disband`) retired it meanwhile.
            Err(RoomsError::Store(error)) if crate::rooms::supervisor::ended_by_disband(&error) => {
                tracing::debug!(
                    target: "gatehouse::rooms", room = %identity.room_id,
                    task = %identity.task_id, %error, "stop ended by the room's disband"
                );
            }
            Err(error) => self.set_error(
                &identity.room_id,
                format!("task {} stop remains pending: {error}", identity.task_id),
            ),
        }
        self.wake_room(&identity.room_id);
        Ok(self.read_task(identity).await?)
    }

    /// Explicit operator retry of an indeterminate or deferred task. A deferred task is requeued.
    /// An indeterminate one is probed first (resolve, resume, history and info on the resumed
    /// session): an exact receipt settles it, a remote cancellation cancels it, a still-active
    /// attempt refuses the retry; otherwise it is requeued and its next start is a new generation.
    /// A local member's ledger is read too: an attempt it holds `unknown` refuses the retry
    /// ([`RoomsError::UnknownTurn`], naming the `resolve-unknown` to run), and an indeterminate
    /// one it has ended is resolved as it ended (what the room's pass does).
    pub async fn retry_indeterminate(
        &self,
        identity: &TaskIdentity,
    ) -> Result<TaskView, RoomsError> {
        let task = self.read_task(identity).await?;
        if !matches!(
            task.status,
            TaskStatus::Indeterminate | TaskStatus::Deferred
        ) {
            return Err(RoomStoreError::InvalidTransition(format!(
                "cannot retry task in state '{}'",
                task.status
            ))
            .into());
        }
        let binding = self
            .binding_for(&identity.room_id)
            .await
            .ok_or_else(|| RoomStoreError::RoomUnavailable("hosted room is unavailable".into()))?;
        let lease = self.ensure_lease(&binding).await?;
        let clock = self.inner.clock.clone();
        let (id, exec, cancel) = (
            identity.clone(),
            task.execution_generation,
            task.cancel_generation,
        );
        let room_id = identity.room_id.clone();
        if task.status == TaskStatus::Deferred {
            // A local attempt that completed after all (its member's unknown turn resolved, say)
            // is settled with its result, never run again; one still unknown holds the member's
            // session, and a new attempt would only queue behind it.
            let port = self.transport(&binding, &task)?;
            if !port.is_peer() {
                let probe = self
                    .locked_probe(&binding, port.as_ref(), &task, false, &lease)
                    .await?;
                Self::refuse_unknown(&task, &probe)?;
                Self::refuse_active(&task, &probe)?;
                if let Some(ended) = probe.settled() {
                    let view = self.resolve_ended(&binding, &lease, &task, ended).await?;
                    self.resume_room(&room_id);
                    return Ok(view);
                }
            }
            let view = self
                .inner
                .db
                .write(move |c| requeue_deferred_task(c, &id, &lease, exec, cancel, clock.as_ref()))
                .await?;
            self.resume_room(&room_id);
            return Ok(view);
        }
        let port = self.transport(&binding, &task)?;
        let probe = self
            .locked_probe(&binding, port.as_ref(), &task, true, &lease)
            .await?;
        if let Some(settlement) = probe
            .receipt
            .as_ref()
            .map(crate::rooms::supervisor::settlement_from_history)
        {
            let view = self
                .inner
                .db
                .write(move |c| {
                    resolve_indeterminate_task(
                        c,
                        &id,
                        &lease,
                        exec,
                        cancel,
                        &settlement,
                        clock.as_ref(),
                    )
                })
                .await?;
            self.publish_terminal(&binding, &view);
            self.resume_room(&room_id);
            return Ok(view);
        }
        if probe.status() == Some("cancelled") {
            let cancel_id = format!("remote-cancel:{exec}");
            let view = self
                .inner
                .db
                .write(move |c| {
                    resolve_indeterminate_cancellation(
                        c,
                        &id,
                        &lease,
                        exec,
                        cancel,
                        &cancel_id,
                        clock.as_ref(),
                    )
                })
                .await?;
            self.publish_terminal(&binding, &view);
            self.resume_room(&room_id);
            return Ok(view);
        }
        if probe.active_for(&task.identity.task_id) {
            self.state().blocked.insert(room_id.clone());
        }
        Self::refuse_active(&task, &probe)?;
        // A local member's own ledger says how the attempt went, as the room's pass reads it:
        // `unknown` holds the member's session until its operator resolves it (a new attempt
        // would queue behind it, never run, and fail at its deadline); ended, it is resolved so
        // and never run again.
        Self::refuse_unknown(&task, &probe)?;
        if let Some(LedgerAttempt::Ended(ended)) = probe.ledger {
            let view = self.resolve_ended(&binding, &lease, &task, ended).await?;
            self.resume_room(&room_id);
            return Ok(view);
        }
        let view = self
            .inner
            .db
            .write(move |c| {
                requeue_indeterminate_task(c, &id, &lease, exec, cancel, clock.as_ref())
            })
            .await?;
        self.resume_room(&room_id);
        Ok(view)
    }

    /// Refuse to retry `task` while its attempt is still active: run by its member, or held
    /// queued or running by the member's ledger (a new attempt would run the prompt twice).
    fn refuse_active(task: &TaskView, probe: &Probe) -> Result<(), RoomsError> {
        if !probe.active_for(&task.identity.task_id) {
            return Ok(());
        }
        let detail = match &probe.ledger {
            Some(LedgerAttempt::Live {
                session_id,
                admission_id,
                started: None,
            }) => format!(
                " (its input {admission_id} is queued in session {session_id}, behind the \
                 member's earlier turns)"
            ),
            _ => String::new(),
        };
        Err(RoomStoreError::InvalidTransition(format!(
            "cannot retry while the original task attempt is still active{detail}"
        ))
        .into())
    }

    /// Refuse to retry `task` while its member's ledger holds its attempt `unknown`.
    fn refuse_unknown(task: &TaskView, probe: &Probe) -> Result<(), RoomsError> {
        match &probe.ledger {
            Some(LedgerAttempt::Unresolved {
                session_id,
                admission_id,
            }) => Err(RoomsError::UnknownTurn {
                task_id: task.identity.task_id.clone(),
                session_id: session_id.clone(),
                admission_id: admission_id.clone(),
            }),
            _ => Ok(()),
        }
    }

    pub(crate) async fn read_task(
        &self,
        identity: &TaskIdentity,
    ) -> Result<TaskView, RoomStoreError> {
        let id = identity.clone();
        self.inner.db.run(move |c| get_task(c, &id)).await
    }

    pub(crate) fn transport(
        &self,
        binding: &RoomBinding,
        task: &TaskView,
    ) -> Result<Arc<dyn SessionPort>, PortError> {
        if let Some(resolver) = &self.inner.resolver {
            return resolver(binding, task);
        }
        self.inner
            .rpc
            .clone()
            .ok_or_else(|| PortError::new("no session transport is configured"))
    }
}
