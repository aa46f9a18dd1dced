//! The room scheduler as the daemon runs it (the actor), where the scenarios drive the runtime's
//! own loop.

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use actix::Actor;

use super::fakes::*;
use crate::clock::SystemClock;
use crate::rooms::actors::{RoomScheduler, StopRooms};
use crate::rooms::runtime::{BindingSource, RoomBinding};
use crate::rooms::testing::TestDb;
use crate::store::room_tasks::{TaskIdentity, TaskStatus};

/// A bindings source whose reads can be held: a held read takes its list first, then waits to
/// be let go, as a read of the store that began before a room was made.
#[derive(Default)]
struct HeldSource {
    list: Mutex<Vec<RoomBinding>>,
    gate: Mutex<Gate>,
    changed: Condvar,
}

#[derive(Default)]
struct Gate {
    hold: bool,
    waiting: usize,
}

impl HeldSource {
    fn source(self: &Arc<Self>) -> BindingSource {
        let this = self.clone();
        Arc::new(move || {
            let read = lock(&this.list).clone();
            let mut gate = lock(&this.gate);
            if gate.hold {
                gate.waiting += 1;
                this.changed.notify_all();
                while gate.hold {
                    gate = this.changed.wait(gate).unwrap_or_else(|e| e.into_inner());
                }
                gate.waiting -= 1;
            }
            read
        })
    }

    fn hold(&self, hold: bool) {
        lock(&self.gate).hold = hold;
        self.changed.notify_all();
    }

    fn waiting(&self) -> usize {
        lock(&self.gate).waiting
    }
}

#[actix_rt::test]
async fn a_room_made_while_an_older_read_is_in_flight_gets_its_pass() {
    let db = TestDb::new();
    let rpc = Arc::new(FakeSessionRpc::new(true));
    let source = Arc::new(HeldSource::default());
    let mut spec = Spec::new(&rpc);
    spec.source = Some(source.source());
    // No round comes to the rescue while the test runs.
    spec.config.poll_interval_seconds = 600.0;
    spec.config.active_poll_interval_seconds = 600.0;
    let runtime = spec.build(&db);
    let scheduler = RoomScheduler::new(runtime.clone()).start();
    wait_for("the first round", || runtime.status().cycles >= 1).await;

    // A poke for a room the last read did not have reads the bindings again; that read takes
    // its list before the next room exists.
    source.hold(true);
    runtime.wake_room("elsewhere");
    wait_for("the read held", || source.waiting() == 1).await;
    db.add_room("late", PROFILE, GATEWAY);
    let identity = TaskIdentity::new("late", "task-late", "thread-late", "turn-late").unwrap();
    admit_to(
        &db,
        &identity,
        PROFILE,
        "Run late.",
        1,
        &SystemClock::default(),
    );
    lock(&source.list).push(RoomBinding::new("late", GATEWAY, 1));
    runtime.wake_room("late");
    wait_for("the poke taken", || lock(&runtime.inner.poked).is_empty()).await;
    source.hold(false);

    // The older read lands first: the new room is not in it, and the read asked for after the
    // poke has it. The room gets its pass now, not at the next round.
    wait_for("the late room's task settled", || {
        status(&db, &identity) == TaskStatus::Settled
    })
    .await;
    assert!(scheduler
        .send(StopRooms(Duration::from_secs(5)))
        .await
        .unwrap_or(false));
}
