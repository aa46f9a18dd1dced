//! `SessionRegistry`: finds or starts the supervisor of a session, and drains them all on stop.

use std::collections::HashMap;
use std::sync::Arc;

use actix::prelude::*;

use super::shared::Shared;
use super::supervisor::{Drain, Pump, SessionSupervisor};

pub struct SessionRegistry {
    shared: Arc<Shared>,
    sessions: HashMap<String, Addr<SessionSupervisor>>,
}

impl SessionRegistry {
    pub fn new(shared: Arc<Shared>) -> Self {
        Self {
            shared,
            sessions: HashMap::new(),
        }
    }

    fn get(&mut self, root_id: &str) -> Addr<SessionSupervisor> {
        if let Some(a) = self.sessions.get(root_id).filter(|a| a.connected()) {
            return a.clone();
        }
        let shared = self.shared.clone();
        let id = root_id.to_string();
        let addr = actix::Supervisor::start(move |_| SessionSupervisor::new(shared, id));
        self.sessions.insert(root_id.to_string(), addr.clone());
        self.shared.metrics.set_active_sessions(self.sessions.len());
        addr
    }
}

impl Actor for SessionRegistry {
    type Context = Context<Self>;
}

/// The supervisor of an existing session (the caller has checked it exists).
#[derive(Message)]
#[rtype(result = "Addr<SessionSupervisor>")]
pub struct GetSupervisor(pub String);

impl Handler<GetSupervisor> for SessionRegistry {
    type Result = MessageResult<GetSupervisor>;
    fn handle(&mut self, m: GetSupervisor, _: &mut Context<Self>) -> Self::Result {
        MessageResult(self.get(&m.0))
    }
}

/// Start the pumps of these sessions (boot recovery).
#[derive(Message)]
#[rtype(result = "()")]
pub struct PumpSessions(pub Vec<String>);

impl Handler<PumpSessions> for SessionRegistry {
    type Result = ();
    fn handle(&mut self, m: PumpSessions, _: &mut Context<Self>) {
        for id in m.0 {
            self.get(&id).do_send(Pump);
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
        let addrs: Vec<Addr<SessionSupervisor>> = self.sessions.values().cloned().collect();
        Box::pin(async move {
            let waits = addrs.iter().map(|a| a.send(Drain));
            futures_util::future::join_all(waits).await;
        })
    }
}

/// How many supervisors are loaded.
#[derive(Message)]
#[rtype(result = "usize")]
pub struct CountLoaded;

impl Handler<CountLoaded> for SessionRegistry {
    type Result = usize;
    fn handle(&mut self, _: CountLoaded, _: &mut Context<Self>) -> usize {
        self.sessions.len()
    }
}
