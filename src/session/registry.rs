//! `SessionRegistry`: finds or starts the supervisor of a session, keeps at most
//! `session.max_in_memory` of them loaded, and drains them all on stop.
//!
//! Eviction: when more supervisors are loaded than allowed, the least recently used ones that
//! are idle (nothing running or claiming, no prompt, no subscriber, no write in flight) are let
//! go; everything they hold is in the store, so the next request revives the session from it.
//! An evicted supervisor that is still alive (it got busy again after saying it was idle) is
//! kept as a weak address and revived rather than duplicated: there is never more than one
//! supervisor per session.
//!
//! A supervisor a sweep found busy (a turn parked on a prompt, say) leaves the eviction order
//! until it is used again or tells the registry it is idle ([`BecameIdle`]): thousands of parked
//! sessions are not asked again on every sweep, on the thread that runs every other session.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use actix::WeakAddr;

use super::shared::Shared;
use super::supervisor::{BecameIdle, Drain, IsIdle, Pump, SessionSupervisor, Unsubscribe};

pub struct SessionRegistry {
    shared: Arc<Shared>,
    sessions: HashMap<String, Addr<SessionSupervisor>>,
    /// Evicted supervisors, alive only while something else still holds them.
    evicted: HashMap<String, WeakAddr<SessionSupervisor>>,
    /// Last use of each loaded session (a tick), for least-recently-used eviction; not of those
    /// a sweep found busy, until they are used again or become idle.
    used: HashMap<String, u64>,
    /// The same, oldest first: a sweep takes its candidates from the front instead of looking
    /// at every loaded session (this runs on the thread of every supervisor).
    by_use: BTreeMap<u64, String>,
    tick: u64,
    /// Where supervisors say they became idle: one for all of them.
    idle_to: Option<Arc<Recipient<BecameIdle>>>,
    sweeping: bool,
    /// When the last sweep started: over the limit with nothing idle to evict, a sweep per
    /// request would ask the same busy supervisors again and again.
    last_sweep: Option<std::time::Instant>,
}

/// How often an over-full registry looks again for idle supervisors.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// How long a sweep waits for a supervisor to say whether it is idle: a sweep runs one at a
/// time, and one slow answer held every eviction up.
const IDLE_ASK_WAIT: Duration = Duration::from_millis(500);

impl SessionRegistry {
    pub fn new(shared: Arc<Shared>) -> Self {
        Self {
            shared,
            sessions: HashMap::new(),
            evicted: HashMap::new(),
            used: HashMap::new(),
            by_use: BTreeMap::new(),
            tick: 0,
            idle_to: None,
            sweeping: false,
            last_sweep: None,
        }
    }

    fn max_loaded(&self) -> usize {
        self.shared.config.session.max_in_memory.max(1)
    }

    fn touch(&mut self, root_id: &str) {
        self.tick += 1;
        if let Some(before) = self.used.insert(root_id.to_string(), self.tick) {
            self.by_use.remove(&before);
        }
        self.by_use.insert(self.tick, root_id.to_string());
    }

    fn forget(&mut self, root_id: &str) {
        if let Some(before) = self.used.remove(root_id) {
            self.by_use.remove(&before);
        }
    }

    fn get(&mut self, root_id: &str, ctx: &mut Context<Self>) -> Addr<SessionSupervisor> {
        self.touch(root_id);
        if let Some(a) = self.sessions.get(root_id).filter(|a| a.connected()) {
            return a.clone();
        }
        let revived = self
            .evicted
            .remove(root_id)
            .and_then(|w| w.upgrade())
            .filter(|a| a.connected());
        let addr = match revived {
            Some(a) => a,
            None => {
                let shared = self.shared.clone();
                let id = root_id.to_string();
                let registry = self
                    .idle_to
                    .get_or_insert_with(|| Arc::new(ctx.address().recipient()))
                    .clone();
                actix::Supervisor::start(move |ctx: &mut Context<SessionSupervisor>| {
                    // No bound of its own (0), set before anyone holds its address: every
                    // sender is bounded where it asks (a connection's 256 requests in flight, a
                    // room's one pass). Its bound, once reached, parked a connection's sender,
                    // and the requests it sent next waited for room in the order their tasks
                    // were polled: an input pipelined behind another could be admitted first,
                    // an interrupt reach the turn ahead of the answer sent before it.
                    ctx.set_mailbox_capacity(0);
                    SessionSupervisor::new(shared, id, registry)
                })
            }
        };
        self.sessions.insert(root_id.to_string(), addr.clone());
        self.report();
        if self.sessions.len() > self.max_loaded() {
            self.sweep(ctx);
        }
        addr
    }

    /// The live supervisor of a session, without starting one.
    fn existing(&mut self, root_id: &str) -> Option<Addr<SessionSupervisor>> {
        if let Some(a) = self.sessions.get(root_id).filter(|a| a.connected()) {
            return Some(a.clone());
        }
        self.evicted.get(root_id).and_then(|w| w.upgrade())
    }

    fn report(&mut self) {
        self.evicted.retain(|_, w| w.upgrade().is_some());
        self.shared
            .metrics
            .set_active_sessions(self.sessions.len() + self.evicted.len());
    }

    /// Let go of idle supervisors, least recently used first, down to the limit.
    fn sweep(&mut self, ctx: &mut Context<Self>) {
        let max = self.max_loaded();
        if self.sweeping || self.sessions.len() <= max {
            return;
        }
        if self
            .last_sweep
            .is_some_and(|t| t.elapsed() < SWEEP_EVERY / 4)
        {
            return;
        }
        self.last_sweep = Some(std::time::Instant::now());
        self.sweeping = true;
        // The least recently used few (a few more than needed: some will be busy).
        let excess = self.sessions.len() - max;
        let candidates: Vec<(String, Addr<SessionSupervisor>)> = self
            .by_use
            .values()
            .filter_map(|k| self.sessions.get(k).map(|a| (k.clone(), a.clone())))
            .take(excess * 2 + 1)
            .collect();
        self.shared.metrics.eviction_swept(candidates.len());
        // `None`: the supervisor is gone (it stopped, or panicked), its mailbox closed.
        // `Some(None)`: no answer in time (one still reading its log's head at its start, behind
        // every other read): asked again at the next sweep, which this one held up until then.
        let asks = candidates.into_iter().map(|(k, a)| async move {
            let idle = match tokio::time::timeout(IDLE_ASK_WAIT, a.send(IsIdle)).await {
                Ok(answer) => answer.ok().map(Some),
                Err(_) => Some(None),
            };
            (k, idle)
        });
        let fut = futures_util::future::join_all(asks);
        let asked = self.tick;
        ctx.spawn(fut.into_actor(self).map(move |answers, act, _| {
            act.sweeping = false;
            let mut left = act.sessions.len().saturating_sub(act.max_loaded());
            for (k, idle) in answers {
                let Some(idle) = idle else {
                    // Nothing to let go of, nor to ask again: its entry went on counting as a
                    // loaded session, and stayed until the session was asked for again.
                    if act.sessions.get(&k).is_some_and(|a| !a.connected()) {
                        act.sessions.remove(&k);
                        act.forget(&k);
                        left = left.saturating_sub(1);
                    }
                    continue;
                };
                let Some(idle) = idle else {
                    continue;
                };
                // Idle when asked, and not used since: one handed out meanwhile (a resume about
                // to follow it, a submit) is let go of no more than a busy one is; let go of, it
                // lived on outside the count (followed, running), and was churned.
                let unused_since = act.used.get(&k).is_none_or(|&t| t <= asked);
                if idle && unused_since && left > 0 {
                    if let Some(a) = act.sessions.remove(&k) {
                        act.forget(&k);
                        act.evicted.insert(k, a.downgrade());
                        left -= 1;
                    }
                } else if !idle && act.used.get(&k).is_some_and(|&t| t <= asked) {
                    // Busy (a parked prompt, a running turn), and not used or idle since it was
                    // asked: asked again once it says it is idle, or is used again.
                    act.forget(&k);
                }
            }
            act.report();
        }));
    }
}

impl Handler<BecameIdle> for SessionRegistry {
    type Result = ();
    fn handle(&mut self, m: BecameIdle, ctx: &mut Context<Self>) {
        if self.sessions.contains_key(&m.0) {
            self.touch(&m.0);
            self.sweep(ctx);
        }
    }
}

impl Actor for SessionRegistry {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        ctx.run_interval(SWEEP_EVERY, |act, ctx| {
            act.report();
            act.sweep(ctx);
        });
    }
}

/// The supervisor of an existing session (the caller has checked it exists).
#[derive(Message)]
#[rtype(result = "Addr<SessionSupervisor>")]
pub struct GetSupervisor(pub String);

impl Handler<GetSupervisor> for SessionRegistry {
    type Result = MessageResult<GetSupervisor>;
    fn handle(&mut self, m: GetSupervisor, ctx: &mut Context<Self>) -> Self::Result {
        MessageResult(self.get(&m.0, ctx))
    }
}

/// A connection no longer follows a session (nothing is started for it).
#[derive(Message)]
#[rtype(result = "()")]
pub struct UnsubscribeFrom {
    pub root_id: String,
    pub conn_id: u64,
}

impl Handler<UnsubscribeFrom> for SessionRegistry {
    type Result = ();
    fn handle(&mut self, m: UnsubscribeFrom, ctx: &mut Context<Self>) {
        if let Some(a) = self.existing(&m.root_id) {
            a.do_send(Unsubscribe { conn_id: m.conn_id });
            return;
        }
        // Not a root in memory: it may be another id of a session that is (a connection that
        // closed while it resumed a session by its tip, after a compaction, knew only that id),
        // whose supervisor it was subscribed to, and stayed followed by for good.
        let (db, id) = (self.shared.db.clone(), m.root_id.clone());
        let root = async move {
            db.read(move |c| crate::store::sessions::find_root(c, &id))
                .await
                .ok()
                .flatten()
        };
        ctx.spawn(root.into_actor(self).map(move |root, act, _| {
            let Some(root) = root.filter(|r| r.id != m.root_id) else {
                return;
            };
            if let Some(a) = act.existing(&root.id) {
                a.do_send(Unsubscribe { conn_id: m.conn_id });
            }
        }));
    }
}

/// Start the pumps of these sessions (boot recovery).
#[derive(Message)]
#[rtype(result = "()")]
pub struct PumpSessions(pub Vec<String>);

impl Handler<PumpSessions> for SessionRegistry {
    type Result = ();
    fn handle(&mut self, m: PumpSessions, ctx: &mut Context<Self>) {
        for id in m.0 {
            self.get(&id, ctx).do_send(Pump);
        }
    }
}

/// Drain every supervisor; resolves when all running attempts have settled.
#[derive(Message)]
#[rtype(result = "()")]
pub struct DrainAll;

impl Handler<DrainAll> for SessionRegistry {
    type Result = ResponseFuture<()>;
    fn handle(&mut self, _: DrainAll, _: &mut Context<Self>) -> Self::Result {
        // Evicted supervisors still alive may be running a turn: they drain too.
        let addrs: Vec<Addr<SessionSupervisor>> = self
            .sessions
            .values()
            .cloned()
            .chain(self.evicted.values().filter_map(|w| w.upgrade()))
            .collect();
        Box::pin(async move {
            let waits = addrs.iter().map(|a| a.send(Drain));
            futures_util::future::join_all(waits).await;
        })
    }
}

/// How many supervisors are loaded (including evicted ones still alive).
#[derive(Message)]
#[rtype(result = "usize")]
pub struct CountLoaded;

impl Handler<CountLoaded> for SessionRegistry {
    type Result = usize;
    fn handle(&mut self, _: CountLoaded, _: &mut Context<Self>) -> usize {
        self.report();
        self.sessions.len() + self.evicted.len()
    }
}
