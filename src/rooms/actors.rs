//! The room runtime as actors, as the daemon runs it: one `RoomScheduler` owns the
//! `max_concurrent_rooms` bound (a rotating start, so a later room is always reached) and hands
//! passes to one `RoomSupervisor` actor per room, which runs that room's pass (lease, recovery,
//! queued tasks, observation, deadlines, cancellation) as its own actor future and reports back. A
//! room blocked on a slow member holds one scheduler slot until its deadline stops the attempt; it
//! never blocks another room's actor. A room whose member is busy with another room's turn holds
//! no slot: its pass ends with its task queued, and the member's release wakes it.
//!
//! The pass logic itself lives in [`RoomRuntime`] (tested directly by the seed scenarios); these
//! actors only decide when and where it runs.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use actix::prelude::*;

use super::runtime::{RoomBinding, RoomRuntime};

/// Drives the rooms whose authority is this gateway.
pub struct RoomScheduler {
    runtime: RoomRuntime,
    supervisors: HashMap<String, Addr<RoomSupervisor>>,
    busy: HashSet<String>,
    /// Rooms owed a pass in the current round. A round starts on each tick of the poll interval
    /// and each wakeup, and gives every room one pass (a pass drains its room's queue); a room
    /// busy when the round starts gets its pass when its current one ends.
    owed: HashSet<String>,
    /// The rooms bound to this gateway as last read. Read again (on the blocking pool: the
    /// source reads the store, and this actor shares its arbiter with the session supervisors)
    /// at the start of each round and when a room is poked that the last read did not have; a
    /// cycle between reads uses this copy. A room whose authority moved meanwhile has its pass
    /// refused by the lease's fences in SQL.
    bindings: Vec<RoomBinding>,
    /// A read of the bindings is in flight; `reread` asks for another when it lands.
    reading: bool,
    reread: bool,
    /// The next read of the bindings starts a round.
    round: bool,
    cursor: usize,
    stopping: bool,
    idle_waiters: Vec<tokio::sync::oneshot::Sender<()>>,
}

impl RoomScheduler {
    pub fn new(runtime: RoomRuntime) -> Self {
        Self {
            runtime,
            supervisors: HashMap::new(),
            busy: HashSet::new(),
            owed: HashSet::new(),
            bindings: Vec::new(),
            reading: false,
            reread: false,
            round: true,
            cursor: 0,
            stopping: false,
            idle_waiters: Vec::new(),
        }
    }

    /// Start a round: every room is owed a pass once the bindings are read again.
    fn start_round(&mut self, ctx: &mut Context<Self>) {
        self.round = true;
        self.read_bindings(ctx);
    }

    /// Read the bindings off this thread, then cycle.
    fn read_bindings(&mut self, ctx: &mut Context<Self>) {
        if self.reading {
            self.reread = true;
            return;
        }
        self.reading = true;
        let source = self.runtime.inner.bindings.clone();
        let read = async move { tokio::task::spawn_blocking(move || source()).await };
        ctx.spawn(read.into_actor(self).map(|read, act, ctx| {
            act.reading = false;
            match read {
                Ok(bindings) => act.bound(bindings),
                Err(e) => tracing::error!(error = %e, "cannot list rooms"),
            }
            if std::mem::take(&mut act.reread) {
                act.read_bindings(ctx);
            }
            act.cycle(ctx);
        }));
    }

    /// Take a fresh read of the bindings: a pending round owes every room a pass; rooms that
    /// are no longer bound here are owed nothing and lose their actor when idle. While another
    /// read is asked for, this one may predate a room poked since it began (a room created
    /// meanwhile): what that room is owed is left for the later read to settle. Dropping it
    /// here left a new room's first task queued until the next poll round.
    fn bound(&mut self, bindings: Vec<RoomBinding>) {
        let known: HashSet<&str> = bindings.iter().map(|b| b.room_id.as_str()).collect();
        let later_read = self.reread;
        if std::mem::take(&mut self.round) {
            if !later_read {
                self.owed.clear();
            }
            self.owed.extend(known.iter().map(|r| r.to_string()));
        } else if !later_read {
            self.owed.retain(|r| known.contains(r.as_str()));
        }
        let busy = &self.busy;
        self.supervisors
            .retain(|r, _| known.contains(r.as_str()) || busy.contains(r));
        // A room no longer driven here (retired, or its authority moved) is nobody's idle room.
        self.runtime
            .state()
            .idle_rooms
            .retain(|r| known.contains(r.as_str()));
        self.bindings = bindings;
    }

    fn cycle(&mut self, ctx: &mut Context<Self>) {
        if self.stopping {
            return;
        }
        self.runtime.state().cycles += 1;
        let max = self.runtime.config().max_concurrent_rooms;
        let mut available = max.saturating_sub(self.busy.len());
        let n = self.bindings.len();
        if available == 0 || n == 0 || self.owed.is_empty() {
            self.count_waiters();
            return;
        }
        let start = self.cursor % n;
        self.cursor = self.cursor.wrapping_add(1);
        for offset in 0..n {
            if available == 0 {
                break;
            }
            let binding = &self.bindings[(start + offset) % n];
            if self.busy.contains(&binding.room_id) || !self.owed.remove(&binding.room_id) {
                continue;
            }
            let binding = binding.clone();
            let supervisor = self
                .supervisors
                .entry(binding.room_id.clone())
                .or_insert_with(|| {
                    RoomSupervisor {
                        runtime: self.runtime.clone(),
                        scheduler: ctx.address(),
                    }
                    .start()
                })
                .clone();
            self.busy.insert(binding.room_id.clone());
            supervisor.do_send(RunPass(binding));
            available -= 1;
        }
        self.count_waiters();
    }

    /// Tell the passes how many rooms wait for a slot with work they could start (or not yet
    /// looked at): owed a pass and not in one; not found idle by their last pass since anything
    /// woke them; not blocked on an unresolved attempt; not waiting for a member's turn lock
    /// that another room's turn holds (its release wakes them). A room with a long queue ends
    /// its pass between tasks only for these.
    fn count_waiters(&self) {
        let mut state = self.runtime.state();
        let waiting = self
            .owed
            .iter()
            .filter(|r| {
                !self.busy.contains(*r)
                    && !state.idle_rooms.contains(*r)
                    && !state.blocked.contains(*r)
                    && !state.turn_waiters.values().any(|rooms| rooms.contains(*r))
            })
            .count();
        state.slot_waiters = waiting;
    }
}

impl Actor for RoomScheduler {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        {
            let mut state = self.runtime.state();
            state.running = true;
            state.stopping = false;
        }
        let poll = Duration::from_secs_f64(self.runtime.config().poll_interval_seconds);
        ctx.run_interval(poll, |act, ctx| act.start_round(ctx));
        // `wakeup()` (a new room, a cancellation, a retry) starts a round at once.
        let wake = self.runtime.inner.wake.subscribe();
        self.forward(ctx, wake, || Cycle);
        // `wake_room()` (a task admitted, a member's terminal report) owes that room a pass.
        let poke = self.runtime.inner.poke.subscribe();
        self.forward(ctx, poke, || Poke);
        ctx.notify(Cycle);
    }
}

impl RoomScheduler {
    /// Send the scheduler `message()` on each change of `signal`, for the actor's life.
    fn forward<M>(
        &self,
        ctx: &mut Context<Self>,
        mut signal: tokio::sync::watch::Receiver<u64>,
        message: fn() -> M,
    ) where
        M: Message<Result = ()> + Send + 'static,
        Self: Handler<M>,
    {
        let addr = ctx.address();
        ctx.spawn(
            async move {
                while signal.changed().await.is_ok() {
                    addr.do_send(message());
                }
            }
            .into_actor(self),
        );
    }
}

#[derive(Message)]
#[rtype(result = "()")]
struct Poke;

impl Handler<Poke> for RoomScheduler {
    type Result = ();
    fn handle(&mut self, _: Poke, ctx: &mut Context<Self>) {
        let poked = self.runtime.take_poked();
        if poked.is_empty() {
            return;
        }
        // A room the last read did not have (created since) is read before it is passed.
        let unknown = poked
            .iter()
            .any(|r| !self.bindings.iter().any(|b| &b.room_id == r));
        self.owed.extend(poked);
        if unknown {
            self.read_bindings(ctx);
        } else {
            self.cycle(ctx);
        }
    }
}

#[derive(Message)]
#[rtype(result = "()")]
struct Cycle;

impl Handler<Cycle> for RoomScheduler {
    type Result = ();
    fn handle(&mut self, _: Cycle, ctx: &mut Context<Self>) {
        self.start_round(ctx);
    }
}

/// A room's pass ended; its slot is free.
#[derive(Message)]
#[rtype(result = "()")]
struct PassDone(String);

impl Handler<PassDone> for RoomScheduler {
    type Result = ();
    fn handle(&mut self, m: PassDone, ctx: &mut Context<Self>) {
        self.busy.remove(&m.0);
        if self.busy.is_empty() {
            for w in self.idle_waiters.drain(..) {
                let _ = w.send(());
            }
        }
        // The freed slot goes to a room still owed a pass this round; a room that has had its
        // pass waits for the next round (it used to get another at once, so idle rooms' passes
        // ran back to back without end).
        if !self.owed.is_empty() {
            self.cycle(ctx);
        }
    }
}

/// The first step of a graceful stop: no new pass and no new attempt from now on, while the
/// passes in flight keep observing their attempts, so a member turn that the session drain
/// interrupts settles its task under this runtime's lease (which can then be released).
#[derive(Message)]
#[rtype(result = "()")]
pub struct QuiesceRooms;

impl Handler<QuiesceRooms> for RoomScheduler {
    type Result = ();
    fn handle(&mut self, _: QuiesceRooms, _: &mut Context<Self>) {
        self.stopping = true;
        self.runtime.quiesce();
    }
}

/// Wait up to the duration for the passes in flight to end on their own; whether they did.
#[derive(Message)]
#[rtype(result = "bool")]
pub struct RoomsIdle(pub Duration);

impl Handler<RoomsIdle> for RoomScheduler {
    type Result = ResponseFuture<bool>;
    fn handle(&mut self, m: RoomsIdle, _: &mut Context<Self>) -> Self::Result {
        let idle = self.when_idle();
        Box::pin(async move {
            match idle {
                None => true,
                Some(rx) => matches!(tokio::time::timeout(m.0, rx).await, Ok(Ok(()))),
            }
        })
    }
}

impl RoomScheduler {
    /// A signal for when the passes in flight have ended (`None`: none is in flight).
    fn when_idle(&mut self) -> Option<tokio::sync::oneshot::Receiver<()>> {
        if self.busy.is_empty() {
            return None;
        }
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.idle_waiters.push(tx);
        Some(rx)
    }
}

/// Stop scheduling, wait (bounded) for the passes in flight, then release the leases. Never
/// interrupts an accepted member turn. Answers whether everything stopped in time.
#[derive(Message)]
#[rtype(result = "bool")]
pub struct StopRooms(pub Duration);

impl Handler<StopRooms> for RoomScheduler {
    type Result = ResponseFuture<bool>;
    fn handle(&mut self, m: StopRooms, _: &mut Context<Self>) -> Self::Result {
        self.stopping = true;
        self.runtime.inner.stop.send_replace(true);
        self.runtime.wakeup();
        let idle = self.when_idle();
        let runtime = self.runtime.clone();
        Box::pin(async move {
            let deadline = tokio::time::Instant::now() + m.0;
            let mut stopped = true;
            if let Some(rx) = idle {
                stopped &= tokio::time::timeout_at(deadline, rx).await.is_ok();
            }
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            stopped &= runtime.stop(left).await;
            stopped
        })
    }
}

/// One room's driver.
pub struct RoomSupervisor {
    runtime: RoomRuntime,
    scheduler: Addr<RoomScheduler>,
}

impl Actor for RoomSupervisor {
    type Context = Context<Self>;
}

#[derive(Message)]
#[rtype(result = "()")]
struct RunPass(RoomBinding);

impl Handler<RunPass> for RoomSupervisor {
    type Result = ();
    fn handle(&mut self, m: RunPass, ctx: &mut Context<Self>) {
        let runtime = self.runtime.clone();
        let room = m.0.room_id.clone();
        let span = tracing::debug_span!("room_pass", room = %room);
        let fut = async move {
            tracing::Instrument::instrument(runtime.process_room(&m.0), span).await;
        };
        ctx.spawn(fut.into_actor(self).map(move |_, act, _| {
            act.scheduler.do_send(PassDone(room));
        }));
    }
}
