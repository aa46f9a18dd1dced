//! `SessionSupervisor`: one actor per session. It owns the FIFO pump (claims in `seq` order, one
//! at a time), the running attempt and its cancel switch, the live prompts of that attempt, the
//! subscribers and the outbox of notifications. A parked turn holds nothing but this actor's own
//! state.
//!
//! Notifications: every event that reports a committed change is appended to the durable log
//! (`store::events`) by the transition itself and sent to subscribers from what the transaction
//! returned, strictly in `seq` order (a gap is filled from the log). Streaming deltas
//! (`message.delta`) are live only: they carry no `seq` but `after_seq` (the last durable seq sent
//! before them) and `live_seq` (a counter of this process), and wait behind event writes still in
//! flight so that subscribers see things in the order they happened.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use actix::prelude::*;
use diesel::sqlite::SqliteConnection;
use futures_util::FutureExt;
use serde_json::{json, Value};
use tokio::sync::{oneshot, watch};

use super::prompts::{Answer, OpenPrompt, OpenPrompts, PromptAnswer, PromptKind};
use super::shared::Shared;
use crate::agent::turn::{
    interrupted, run_turn, TurnCtx, TurnOutcome, TurnStart, WRITER_READ_ROWS,
};
use crate::error::{GatewayError, StoreError};
use crate::store::admissions::{self, AdmissionRow, Claim};
use crate::store::events::{self, EventRow, Logged, NewEvent};
use crate::store::messages::{closing_messages, live, NewMessage, OpenCalls};
use crate::store::{prompts as prompt_store, sessions};

/// Pre-serialised notification frames for one connection, in the order they are to be written:
/// everything one flush of a session's outbox sends, so that the events of one commit reach a
/// connection's thread in one hand-off and its socket in one write.
#[derive(Message, Clone)]
#[rtype(result = "()")]
pub struct PushEvent(pub Arc<[Arc<str>]>);

impl PushEvent {
    pub fn one(frame: Arc<str>) -> PushEvent {
        PushEvent(Arc::from([frame]))
    }

    /// No frames: "you were dropped, events were lost" (the receiver's mailbox was full).
    pub fn lost() -> PushEvent {
        PushEvent(Arc::from([]))
    }

    pub fn is_lost(&self) -> bool {
        self.0.is_empty()
    }
}

/// Hand `batch` to `r`; false when `r` is gone for good. A receiver whose mailbox is full would
/// silently miss this batch: it is dropped, and told so (a `lost` notice is queued whatever the
/// mailbox holds), so it can close instead of serving a stream with a hole in it.
pub fn push_or_drop(r: &actix::Recipient<PushEvent>, batch: PushEvent) -> bool {
    match r.try_send(batch) {
        Ok(()) => true,
        Err(actix::prelude::SendError::Full(_)) => {
            r.do_send(PushEvent::lost());
            false
        }
        Err(actix::prelude::SendError::Closed(_)) => false,
    }
}

struct Running {
    admission_id: String,
    /// The running input's `input_id`.
    request_id: String,
    generation: i64,
    cancel: watch::Sender<bool>,
    started: std::time::Instant,
    /// Set when the turn has decided how it ends (its settlement is on its way): an interrupt
    /// can no longer change the outcome.
    ended: std::rc::Rc<std::cell::Cell<bool>>,
    /// The prompt the turn is recording (see [`RecordingPrompt`]; a turn asks one question at
    /// a time), with the answers that came for it before the turn handed it over. Boxed, and
    /// only while it is recorded: a turn parked on its prompt holds nothing of it.
    recording: Option<Box<Recording>>,
}

/// A prompt its attempt is recording open: once committed, its `<kind>.request` can be read
/// from the log before the attempt hands the prompt to this supervisor, and an answer sent at
/// once must wait for that, not be told `already_resolved` and lost.
struct Recording {
    prompt_id: String,
    held: Vec<(Respond, oneshot::Sender<Result<Value, GatewayError>>)>,
}

/// An interrupt that named an attempt while a claim was in flight: the claim may be starting
/// that very attempt (its commit is visible before this supervisor hears of it).
struct HeldInterrupt {
    generation: i64,
    reason: String,
    reply: oneshot::Sender<Result<bool, GatewayError>>,
}

/// Notifications on their way to subscribers.
#[derive(Default)]
struct Outbox {
    /// The last durable seq sent (read from the log when the supervisor starts).
    sent: Option<i64>,
    /// Durable events waiting for an earlier seq.
    waiting: BTreeMap<i64, EventRow>,
    /// Event-bearing writes started here that have not answered yet.
    in_flight: usize,
    /// Live events held behind them.
    held: Vec<(&'static str, Value)>,
    /// A read of the log is under way (or waited for, after one failed).
    catching_up: bool,
    /// Reads of the log that failed in a row.
    catch_up_failures: u32,
}

/// How many events one catch-up read of the log fetches.
const CATCH_UP_BATCH: i64 = 1000;
/// Tries of a catch-up read before its gap is given up (its followers told events were lost).
const CATCH_UP_TRIES: u32 = 4;

/// The longest wait between two tries of a claim while the store is down.
const MAX_CLAIM_RETRY: std::time::Duration = std::time::Duration::from_secs(10);
/// First and longest wait between tries to put a claimed row back during a drain (`unclaim`).
const UNCLAIM_RETRY_FIRST: std::time::Duration = std::time::Duration::from_millis(50);
const UNCLAIM_RETRY_MAX: std::time::Duration = std::time::Duration::from_secs(1);

/// The wait before a try that follows `failures` failed ones: `first`, doubled for each.
fn doubled(first: std::time::Duration, failures: u32) -> std::time::Duration {
    first.saturating_mul(2u32.saturating_pow(failures))
}

pub struct SessionSupervisor {
    shared: Arc<Shared>,
    root_id: String,
    running: Option<Running>,
    prompts: OpenPrompts,
    subscribers: HashMap<u64, Recipient<PushEvent>>,
    outbox: Outbox,
    claiming: bool,
    /// Whether the claim being answered is put back for a drain, as its submit's reply was
    /// told (`None`: decided when it starts). Read once, as the drain's flag may change between.
    put_back: Option<bool>,
    /// Interrupts waiting for the claim in flight to answer.
    held_interrupts: Vec<HeldInterrupt>,
    pump_again: bool,
    /// Claims the store failed in a row: the next try waits 0.5 s doubled that many times less
    /// one, up to [`MAX_CLAIM_RETRY`].
    claim_failures: u8,
    /// Whether the FIFO may hold queued inputs: false once a claim found nothing queued (behind
    /// the input it started, if any), until an input is admitted again. A settled turn with
    /// nothing queued then starts no claim, which would commit nothing, and the next submit's
    /// claim commits with its admission.
    maybe_queued: bool,
    /// Inputs this supervisor admitted so far. A claim's view of the FIFO is the one its
    /// transaction had; an input admitted after it answers after the claim was sent, so a
    /// claim that finds the FIFO empty says so only if this did not move meanwhile.
    admitted: u64,
    /// Claims left that leave their turn's start to the turn: the transcript was too long for a
    /// claim to read on the writer (see [`WRITER_READ_ROWS`]) a few claims ago.
    long_transcript_claims: u8,
    draining: bool,
    drain_waiters: Vec<oneshot::Sender<()>>,
    /// Its own address while subscribers follow it, so eviction cannot drop it (registry.rs).
    pin: Option<Addr<SessionSupervisor>>,
    /// Where to say that it is idle again, once an eviction sweep found it busy (the sweep
    /// then stops asking it: registry.rs).
    registry: Arc<Recipient<BecameIdle>>,
    found_busy: bool,
}

/// A supervisor an eviction sweep found busy is idle now.
#[derive(Message)]
#[rtype(result = "()")]
pub struct BecameIdle(pub String);

impl SessionSupervisor {
    pub fn new(shared: Arc<Shared>, root_id: String, registry: Arc<Recipient<BecameIdle>>) -> Self {
        Self {
            shared,
            root_id,
            running: None,
            prompts: OpenPrompts::default(),
            subscribers: HashMap::new(),
            outbox: Outbox::default(),
            claiming: false,
            put_back: None,
            held_interrupts: Vec::new(),
            pump_again: false,
            claim_failures: 0,
            maybe_queued: true,
            admitted: 0,
            long_transcript_claims: 0,
            draining: false,
            drain_waiters: Vec::new(),
            pin: None,
            registry,
            found_busy: false,
        }
    }

    /// Nothing running or being claimed, no prompt, no subscriber, no write in flight.
    fn idle(&self) -> bool {
        self.running.is_none()
            && self.subscribers.is_empty()
            && !self.claiming
            && self.prompts.is_empty()
            && self.outbox.in_flight == 0
    }

    /// After anything that can leave it idle: tell the registry, if a sweep found it busy.
    fn report_idle(&mut self) {
        if self.found_busy {
            // A follower whose connection closed before it could unsubscribe (it subscribed
            // while its request was in flight) does not keep the session from being idle.
            self.forget_closed_followers();
        }
        if self.found_busy && self.idle() {
            self.found_busy = false;
            self.registry.do_send(BecameIdle(self.root_id.clone()));
        }
    }

    /// A live event's frame, made only if someone listens.
    fn live_frame(&self, mut params: Value, frames: &mut Vec<Arc<str>>) {
        if self.subscribers.is_empty() {
            return;
        }
        params["authority_epoch"] = json!(self.shared.epoch);
        let frame = json!({"jsonrpc": "2.0", "method": "event", "params": params});
        frames.push(Arc::from(crate::api::ws::text_of(&frame)));
    }

    /// A stored event's frame, made only if someone listens.
    fn row_frame(&self, row: &EventRow, frames: &mut Vec<Arc<str>>) {
        if !self.subscribers.is_empty() {
            frames.push(Arc::from(row.wire_frame(self.shared.epoch)));
        }
    }

    /// Send one flush's frames to every subscriber, as one message each.
    fn send_frames(&mut self, frames: Vec<Arc<str>>) {
        if !frames.is_empty() {
            let batch = PushEvent(Arc::from(frames));
            self.subscribers
                .retain(|_, r| push_or_drop(r, batch.clone()));
        }
        if self.subscribers.is_empty() {
            self.unwatched();
        }
    }

    /// Drop followers whose connection closed without unsubscribing (one that subscribed while
    /// its request was in flight and closed before the reply): they must not pin the session.
    fn forget_closed_followers(&mut self) {
        if self.subscribers.is_empty() {
            return;
        }
        self.subscribers.retain(|_, r| r.connected());
        if self.subscribers.is_empty() {
            self.pin = None;
        }
    }

    /// Nobody listens (any more): nothing keeps the supervisor awake for them.
    fn unwatched(&mut self) {
        self.pin = None;
        self.report_idle();
    }

    /// An event-bearing write starts: live events wait until it answers.
    fn write_started(&mut self) {
        self.outbox.in_flight += 1;
    }

    /// It answered, with the events it committed (none if it failed).
    fn write_answered(&mut self, rows: Vec<EventRow>, ctx: &mut Context<Self>) {
        self.outbox.in_flight = self.outbox.in_flight.saturating_sub(1);
        self.deliver(rows, ctx);
        self.report_idle();
    }

    /// A transition's answer: deliver its events, pass its value on.
    fn answered<T, E>(
        &mut self,
        res: Result<Logged<T>, E>,
        ctx: &mut Context<Self>,
    ) -> Result<T, E> {
        match res {
            Ok(Logged { value, events }) => {
                self.write_answered(events, ctx);
                Ok(value)
            }
            Err(e) => {
                self.write_answered(Vec::new(), ctx);
                Err(e)
            }
        }
    }

    /// Committed events: send each once, in seq order.
    fn deliver(&mut self, rows: Vec<EventRow>, ctx: &mut Context<Self>) {
        for row in rows {
            if self.outbox.sent.is_none_or(|s| row.seq > s) {
                self.outbox.waiting.insert(row.seq, row);
            }
        }
        self.flush(ctx);
    }

    /// Send whatever is due, in order, as one batch per subscriber. (With nobody subscribed
    /// nothing is made, and `send_frames` finds the supervisor unwatched, as it already is:
    /// `pin` is set only while someone subscribes.)
    fn flush(&mut self, ctx: &mut Context<Self>) {
        let mut frames = Vec::new();
        self.collect_due(&mut frames, ctx);
        self.send_frames(frames);
    }

    /// The frames of the events due now (made only if someone listens).
    fn collect_due(&mut self, frames: &mut Vec<Arc<str>>, ctx: &mut Context<Self>) {
        let first = self.outbox.waiting.keys().next().copied();
        if let (None, Some(first)) = (self.outbox.sent, first) {
            // The head could not be read at start: begin with what arrives.
            self.outbox.sent = Some(first - 1);
        }
        if let Some(mut sent) = self.outbox.sent {
            while let Some(row) = self.outbox.waiting.remove(&(sent + 1)) {
                sent = row.seq;
                self.outbox.sent = Some(sent);
                self.row_frame(&row, frames);
            }
        }
        if self.outbox.waiting.is_empty() {
            // A `BTreeMap` emptied by `remove` keeps its root node (about 1 KiB for these rows):
            // every parked session held one for good.
            self.outbox.waiting = BTreeMap::new();
        }
        if self.outbox.in_flight > 0 || self.outbox.catching_up {
            return;
        }
        if !self.outbox.waiting.is_empty() {
            // A gap no write of ours will fill (an answer that was lost): read it from the log.
            self.catch_up(ctx);
            return;
        }
        for (kind, payload) in std::mem::take(&mut self.outbox.held) {
            let params = json!({
                "type": kind,
                "session_id": self.root_id,
                "after_seq": self.outbox.sent.unwrap_or(0),
                "live_seq": self.shared.runtime.next_live_seq(),
                "payload": payload,
            });
            self.live_frame(params, frames);
        }
    }

    fn catch_up(&mut self, ctx: &mut Context<Self>) {
        let Some(after) = self.outbox.sent else {
            return;
        };
        self.outbox.catching_up = true;
        let (shared, root) = (self.shared.clone(), self.root_id.clone());
        let fut = async move {
            shared
                .db
                .read(move |c| events::since(c, &root, after, CATCH_UP_BATCH))
                .await
        };
        ctx.spawn(fut.into_actor(self).map(|res, act, ctx| {
            let more = match res {
                Ok(s) => {
                    act.outbox.catching_up = false;
                    act.outbox.catch_up_failures = 0;
                    // Events after the last one sent were pruned before they were sent: they
                    // cannot be, and each follower is told (a WebSocket is closed, to resume; a
                    // REST stream reads the log itself). Moved past at once, however long the
                    // rest: left for the end of the catch-up, a page that did not reach the end
                    // was read again and again from the same place, and nothing more was sent.
                    if s.truncated {
                        // Not past an event already in hand (a write's own report, behind the
                        // gap): it is sent, not skipped.
                        let past = s
                            .events
                            .first()
                            .map_or(s.last_sequence, |e| e.seq - 1)
                            .min(
                                act.outbox
                                    .waiting
                                    .keys()
                                    .next()
                                    .map_or(i64::MAX, |&first| first - 1),
                            );
                        if act.outbox.sent.is_none_or(|sent| past > sent) {
                            tracing::warn!(session = %act.root_id, through = past,
                                "events were pruned before they were sent; its followers are told events were lost");
                            act.outbox.sent = Some(past);
                            for r in act.subscribers.values() {
                                r.do_send(PushEvent::lost());
                            }
                        }
                    }
                    for row in s.events {
                        if act.outbox.sent.is_none_or(|sent| row.seq > sent) {
                            act.outbox.waiting.insert(row.seq, row);
                        }
                    }
                    s.has_more
                }
                // Asked again after a pause (still catching up meanwhile, so nothing else asks).
                // Taking one failed read for the end of the log skipped the gap for good, and
                // every follower missed its events without a word.
                Err(e) if act.outbox.catch_up_failures + 1 < CATCH_UP_TRIES => {
                    act.outbox.catch_up_failures += 1;
                    let wait = doubled(
                        std::time::Duration::from_millis(100),
                        act.outbox.catch_up_failures - 1,
                    );
                    tracing::warn!(session = %act.root_id, error = %e, ?wait,
                        "cannot read the event log; trying again");
                    ctx.run_later(wait, |act, ctx| {
                        act.outbox.catching_up = false;
                        act.flush(ctx);
                    });
                    return;
                }
                // Given up: the gap is passed over, and each follower is told events were lost
                // (a WebSocket is closed, to resume; a REST stream reads the log itself).
                Err(e) => {
                    act.outbox.catching_up = false;
                    act.outbox.catch_up_failures = 0;
                    tracing::error!(session = %act.root_id, error = %e,
                        "cannot read the event log; its followers are told events were lost");
                    for r in act.subscribers.values() {
                        r.do_send(PushEvent::lost());
                    }
                    false
                }
            };
            if !more {
                // What the log does not hold any more (pruned) cannot be sent: move past it.
                if let (Some(sent), Some(&first)) =
                    (act.outbox.sent, act.outbox.waiting.keys().next())
                {
                    if first > sent + 1 {
                        act.outbox.sent = Some(first - 1);
                    }
                }
            }
            act.flush(ctx);
        }));
    }

    /// A live-only event (a streaming delta): sent now, or after the writes in flight.
    fn emit_live(&mut self, kind: &'static str, payload: Value, ctx: &mut Context<Self>) {
        self.outbox.held.push((kind, payload));
        self.flush(ctx);
    }

    /// Run a write whose answer is the events it committed, and deliver them.
    fn write_events<F>(&mut self, what: &'static str, f: F, ctx: &mut Context<Self>)
    where
        F: FnOnce(&mut SqliteConnection) -> Result<Vec<EventRow>, StoreError> + Send + 'static,
    {
        self.write_started();
        // Queued now, in the order this actor handled what it records (a tool's start before
        // its end), not when the task is first polled (in no fixed order): the log's seq
        // follows the writer's order.
        let fut = self.shared.db.write(f);
        ctx.spawn(fut.into_actor(self).map(move |res, act, ctx| {
            let rows = res.unwrap_or_else(|e| {
                tracing::error!(session = %act.root_id, error = %e, "{what} failed");
                Vec::new()
            });
            act.write_answered(rows, ctx);
        }));
    }

    /// A durable event that reports no other state change (tool activity), in its own write,
    /// fenced by the epoch (a process whose authority another took writes nothing more).
    fn record(&mut self, kind: &str, payload: Value, ctx: &mut Context<Self>) {
        let write = self.event_write(kind, payload);
        self.write_events("event write", write, ctx);
    }

    /// The write of one event of this session that reports no other state change, fenced by
    /// the epoch.
    fn event_write(
        &self,
        kind: &str,
        payload: Value,
    ) -> impl FnOnce(&mut SqliteConnection) -> Result<Vec<EventRow>, StoreError> + Send + 'static
    {
        let (root, now, epoch) = (self.root_id.clone(), self.shared.now(), self.shared.epoch);
        let event = NewEvent::new(kind, payload);
        move |c| {
            crate::store::epoch::check_epoch(c, epoch)?;
            events::append_tx(c, &root, &[event], now)
        }
    }

    fn pump(&mut self, ctx: &mut Context<Self>) {
        if self.draining || self.shared.runtime.draining() || self.running.is_some() {
            return;
        }
        if self.claiming {
            self.pump_again = true;
            return;
        }
        self.claiming = true;
        self.write_started();
        let shared = self.shared.clone();
        let root = self.root_id.clone();
        let seen = self.admitted;
        let rows = self.start_read_rows();
        let (now, epoch) = (shared.now(), shared.epoch);
        let fut = shared
            .db
            .write(move |c| claim_with_start(c, epoch, &root, now, rows));
        ctx.spawn(fut.into_actor(self).map(move |res, act, ctx| {
            act.claiming = false;
            let (claim, start, more) = match res {
                Ok((logged, start, more)) => {
                    (act.answered(Ok::<_, StoreError>(logged), ctx), start, more)
                }
                Err(e) => (act.answered(Err(e), ctx), None, true),
            };
            act.claim_answered(claim, start, more, seen, rows, ctx);
        }));
    }

    /// What a claim answered, sent when `seen` inputs were admitted and allowed to read up to
    /// `rows` live messages for its turn: what it says of the FIFO and of the transcript's
    /// length, then the turn it started, if any.
    fn claim_answered(
        &mut self,
        claim: Result<Claim, StoreError>,
        start: Option<Box<TurnStart>>,
        more: bool,
        seen: u64,
        rows: i64,
        ctx: &mut Context<Self>,
    ) {
        self.claim_saw(&claim, more, seen);
        self.start_read_saw(rows, &claim, &start);
        self.claimed(claim, start, ctx);
    }

    /// How many live messages the next claim may read for its turn on the writer: none for a
    /// while after a claim found the transcript longer (then the turn reads it through a
    /// reader), so a long session's claims do not each read and drop the bound's worth of rows.
    fn start_read_rows(&mut self) -> i64 {
        if self.long_transcript_claims > 0 {
            self.long_transcript_claims -= 1;
            0
        } else {
            WRITER_READ_ROWS
        }
    }

    /// A claim that was to read its turn's start (`rows > 0`) started a turn without it: the
    /// transcript outgrew the bound (or the read failed). The next claims leave it to the turn;
    /// then one tries again, as a compression may have shortened the transcript.
    fn start_read_saw(
        &mut self,
        rows: i64,
        claim: &Result<Claim, StoreError>,
        start: &Option<Box<TurnStart>>,
    ) {
        if rows > 0 && matches!(claim, Ok(Claim::Started(_))) && start.is_none() {
            self.long_transcript_claims = LONG_TRANSCRIPT_CLAIMS;
        }
    }

    /// A claim sent when `seen` inputs were admitted found nothing queued (`more == false`
    /// behind the input it started): unless an input was admitted or another claim asked for
    /// since, the FIFO is empty until the next admission.
    fn claim_saw(&mut self, claim: &Result<Claim, StoreError>, more: bool, seen: u64) {
        let empty = match claim {
            Ok(Claim::Idle) => true,
            Ok(Claim::Started(_)) => !more,
            _ => false,
        };
        if empty && self.admitted == seen && !self.pump_again {
            self.maybe_queued = false;
        }
    }

    /// What a claim found (its events are delivered): start the turn, or wait.
    fn claimed(
        &mut self,
        claim: Result<Claim, StoreError>,
        start: Option<Box<TurnStart>>,
        ctx: &mut Context<Self>,
    ) {
        if claim.is_ok() {
            self.claim_failures = 0;
        }
        // Whether a pump asked for while this claim was in flight claims again now: after any
        // answer but a start or a retry already planned (a `resolve_unknown` that freed the
        // session, say, committed after the claim read it; else the queued inputs waited for
        // the next submit or restart).
        let again = match claim {
            Ok(Claim::Started(row)) => {
                self.start_turn(*row, start, ctx);
                false
            }
            Ok(Claim::Idle) | Ok(Claim::Busy) => true,
            Err(StoreError::UnknownExecution(m)) => {
                tracing::info!(session = %self.root_id, "FIFO held: {m}");
                true
            }
            Err(StoreError::CorruptPolicy(m)) => {
                tracing::error!(session = %self.root_id,
                    "FIFO held: {m}; its inputs stay queued until the store is repaired (then the next submit or start runs them)");
                true
            }
            Err(e @ (StoreError::Database(_) | StoreError::Pool(_) | StoreError::Other(_))) => {
                // The store failed (disk full, locked): try again, or queued work would wait
                // for the next submit or boot.
                let wait = doubled(
                    std::time::Duration::from_millis(500),
                    u32::from(self.claim_failures),
                )
                .min(MAX_CLAIM_RETRY);
                self.claim_failures = self.claim_failures.saturating_add(1);
                tracing::error!(session = %self.root_id, error = %e, ?wait, "claim failed; retrying");
                ctx.run_later(wait, |act, ctx| act.pump(ctx));
                false
            }
            Err(e) => {
                tracing::error!(session = %self.root_id, error = %e, "claim failed");
                true
            }
        };
        if again && std::mem::take(&mut self.pump_again) {
            self.pump(ctx);
        }
        // A drain that arrived during the claim waits for it; with nothing started it is done.
        // Not while a claimed row is being put back (`requeue`): that write answers the drain,
        // so the process cannot stop before the row is queued again.
        if self.running.is_none() && !self.claiming {
            for w in self.drain_waiters.drain(..) {
                let _ = w.send(());
            }
        }
        self.answer_held_interrupts(ctx);
        self.report_idle();
    }

    fn start_turn(
        &mut self,
        row: AdmissionRow,
        start: Option<Box<TurnStart>>,
        ctx: &mut Context<Self>,
    ) {
        let put_back = self
            .put_back
            .take()
            .unwrap_or_else(|| self.draining || self.shared.runtime.draining());
        let Some(generation) = row.execution_generation else {
            tracing::error!(session = %self.root_id, admission = %row.admission_id, "claimed row has no generation");
            return;
        };
        if put_back {
            // Claimed just as the drain began, before anything of it ran: queued again, so it runs
            // after the restart in its place. (A turn begun as the drain began is interrupted
            // by it, as every running turn is.)
            self.requeue(row, generation, ctx);
            return;
        }
        self.begin_turn(row, generation, start, ctx);
    }

    fn requeue(&mut self, row: AdmissionRow, generation: i64, ctx: &mut Context<Self>) {
        tracing::info!(session = %self.root_id, admission = %row.admission_id, generation, "claimed as the drain began; queued again");
        self.maybe_queued = true;
        self.claiming = true;
        self.unclaim(row, generation, UNCLAIM_RETRY_FIRST, ctx);
    }

    /// Put a claimed row back (`requeue`). A failure of the store is retried (the drain waits,
    /// within its own time) until the row is queued again; if the stop comes first the row stays
    /// `started`, and the next boot holds it `unknown` for the operator. Neither runs it twice.
    /// Once, a failure here settled the input `interrupted`, though nothing of it had run.
    fn unclaim(
        &mut self,
        row: AdmissionRow,
        generation: i64,
        backoff: std::time::Duration,
        ctx: &mut Context<Self>,
    ) {
        self.write_started();
        let (shared, root, admission) = (
            self.shared.clone(),
            self.root_id.clone(),
            row.admission_id.clone(),
        );
        let (epoch, now) = (shared.epoch, shared.now());
        let fut = shared
            .db
            .write(move |c| admissions::unclaim(c, epoch, &root, &admission, generation, now));
        ctx.spawn(fut.into_actor(self).map(move |res, act, ctx| {
            match act.answered(res, ctx) {
                Ok(_) => {}
                Err(e @ (StoreError::Database(_) | StoreError::Pool(_) | StoreError::Other(_))) => {
                    tracing::warn!(session = %act.root_id, admission = %row.admission_id, generation, error = %e, ?backoff,
                        "could not queue the claimed input again; retrying");
                    let next = (backoff * 2).min(UNCLAIM_RETRY_MAX);
                    ctx.run_later(backoff, move |act, ctx| {
                        act.unclaim(row, generation, next, ctx)
                    });
                    return;
                }
                // Fenced out (a newer epoch, or no longer this attempt): nothing of it is ours.
                Err(e) => {
                    tracing::error!(session = %act.root_id, admission = %row.admission_id, generation, error = %e,
                        "the claimed input was not queued again: the store no longer holds this claim");
                }
            }
            act.claiming = false;
            for w in act.drain_waiters.drain(..) {
                let _ = w.send(());
            }
            act.answer_held_interrupts(ctx);
            act.report_idle();
        }));
    }

    fn begin_turn(
        &mut self,
        row: AdmissionRow,
        generation: i64,
        start: Option<Box<TurnStart>>,
        ctx: &mut Context<Self>,
    ) {
        let (cancel_tx, cancel_rx) = watch::channel(self.draining);
        let ended = std::rc::Rc::new(std::cell::Cell::new(false));
        self.running = Some(Running {
            admission_id: row.admission_id.clone(),
            request_id: row.request_id.clone(),
            generation,
            cancel: cancel_tx,
            started: std::time::Instant::now(),
            ended: ended.clone(),
            recording: None,
        });
        self.shared.metrics.turn_started();
        let span = tracing::info_span!("turn", session = %self.root_id, admission = %row.admission_id, generation);
        let usage = Arc::new(std::sync::Mutex::new((0i64, 0i64)));
        let unrecorded = Arc::new(std::sync::Mutex::new(Vec::new()));
        let told = cancel_rx.clone();
        let turn = TurnCtx {
            shared: self.shared.clone(),
            root_id: self.root_id.clone(),
            admission_id: row.admission_id.clone(),
            generation,
            text: row.text(),
            cancel: cancel_rx,
            sup: ctx.address(),
            usage: usage.clone(),
            unrecorded: unrecorded.clone(),
            start,
        };
        let shared = self.shared.clone();
        let root = self.root_id.clone();
        let admission_id = row.admission_id.clone();
        let fut = async move {
            // Boxed apart from the settlement that follows it: a future is as large as its
            // largest state, and inline the turn's (its whole life) would carry this block's
            // settlement steps beside it, a larger allocation for every parked session.
            let running = tracing::Instrument::instrument(Box::pin(run_turn(turn)), span);
            // A panic in the turn fails the turn, settled like any failure (its row terminal,
            // its followers told, the queue moving on). Uncaught, it ended this actor with the
            // row `started`: the session's queue held until a restart, which found it `unknown`.
            let outcome = match std::panic::AssertUnwindSafe(running).catch_unwind().await {
                Ok(outcome) => outcome,
                Err(panic) => {
                    let message = panic
                        .downcast_ref::<&str>()
                        .map(|m| m.to_string())
                        .or_else(|| panic.downcast_ref::<String>().cloned())
                        .unwrap_or_default();
                    tracing::error!(session = %root, admission = %admission_id, generation,
                        panic = %message, "the turn panicked; it fails");
                    TurnOutcome::Failed {
                        error: "the turn stopped on an internal error (the gateway's log has it)"
                            .into(),
                        reason: "internal_error",
                    }
                }
            };
            let outcome = match outcome {
                // An interrupt acknowledged before the turn ended wins over a failure that raced
                // it, as it does over a final answer: the client was told the turn was
                // interrupted (a model error that came in the same poll settled `failed`).
                TurnOutcome::Failed { .. } if *told.borrow() => interrupted(),
                other => other,
            };
            // Runs on this actor's thread: no interrupt is handled between the turn's last look
            // at its cancel flag and this.
            ended.set(true);
            // The settlement in a box of its own, made once the turn is over: inline, its steps
            // (the outcome twice, the retries) widened this future, which every parked session
            // holds for its turn's whole life, by some 650 bytes.
            Box::pin(async move {
                // A storage failure (disk full, database locked) must not strand the row `started`
                // with nothing running it: keep the FIFO held and retry until the store is back.
                let mut backoff = std::time::Duration::from_millis(100);
                // Both are final once the turn has returned.
                let spent = usage.lock().map(|u| *u).unwrap_or((0, 0));
                let ran = unrecorded
                    .lock()
                    .map(|mut u| std::mem::take(&mut *u))
                    .unwrap_or_default();
                loop {
                    match Box::pin(settle(
                        &shared,
                        &root,
                        &admission_id,
                        generation,
                        &outcome,
                        spent,
                        ran.clone(),
                    ))
                    .await
                    {
                        Err(
                            e @ (StoreError::Database(_) | StoreError::Pool(_) | StoreError::Other(_)),
                        ) => {
                            tracing::warn!(session = %root, admission = %admission_id, generation, error = %e, ?backoff,
                                "settlement failed; retrying");
                            tokio::time::sleep(backoff).await;
                            backoff = (backoff * 2).min(std::time::Duration::from_secs(5));
                        }
                        settled => break settled,
                    }
                }
            })
            .await
        };
        ctx.spawn(fut.into_actor(self).map(move |settled, act, ctx| {
            act.turn_finished(generation, settled, ctx);
        }));
    }

    fn turn_finished(
        &mut self,
        generation: i64,
        settled: Result<Logged<()>, StoreError>,
        ctx: &mut Context<Self>,
    ) {
        let admission = self
            .running
            .as_ref()
            .map(|r| r.admission_id.clone())
            .unwrap_or_default();
        if let Some(r) = self.running.take() {
            self.shared
                .metrics
                .turn_finished(r.started.elapsed().as_secs_f64());
        }
        let stale = self.prompts.ids_where(|p| p.generation == generation);
        for id in stale {
            self.retire_prompt(&id, "turn_ended", ctx);
        }
        match settled {
            // The settlement's events (`session.info`, `message.complete`) were committed with it.
            Ok(logged) => self.deliver(logged.events, ctx),
            Err(e) => {
                // Not settled: the row stays started and becomes unknown at the next boot.
                tracing::error!(session = %self.root_id, admission = %admission, generation, error = %e,
                    "settlement refused: the input stays started and is unknown after the next boot");
            }
        }
        for w in self.drain_waiters.drain(..) {
            let _ = w.send(());
        }
        if !self.draining && self.maybe_queued {
            self.pump(ctx);
        }
        self.report_idle();
    }

    /// Every way a prompt ends without an answer (timed out, its turn ended or was interrupted,
    /// the stop) comes here: the open-prompts gauge goes down with it (it went down only for a
    /// time-out, and counted every interrupted prompt open for good), and its audit row records
    /// how it ended, with its `<kind>.settled` event (an answer is recorded by the attempt it was
    /// for).
    fn retire_prompt(&mut self, prompt_id: &str, resolution: &str, ctx: &mut Context<Self>) {
        if self.prompts.remove(prompt_id).is_none() {
            return;
        }
        self.shared.metrics.prompt_closed();
        let (id, resolution, now, epoch) = (
            prompt_id.to_string(),
            resolution.to_string(),
            self.shared.now(),
            self.shared.epoch,
        );
        self.write_events(
            "prompt audit write",
            move |c| prompt_store::record_resolution(c, epoch, &id, &resolution, "gateway", now),
            ctx,
        );
    }

    /// Open prompts of the running attempt, as listed in snapshots.
    fn open_prompts(&self) -> Vec<Value> {
        let running = self.running.as_ref().map(|r| r.generation);
        let mut v: Vec<&OpenPrompt> = self
            .prompts
            .iter()
            .filter(|p| Some(p.generation) == running)
            .collect();
        v.sort_by(|a, b| a.prompt_id.cmp(&b.prompt_id));
        v.into_iter()
            .filter_map(|p| match serde_json::from_str(p.payload.get()) {
                Ok(payload) => Some(payload),
                Err(e) => {
                    tracing::error!(session = %self.root_id, prompt = %p.prompt_id, error = %e,
                        "an open prompt's JSON does not read back: left out of the snapshot");
                    None
                }
            })
            .collect()
    }
}

/// Settle the attempt as `outcome`, with the token usage of its model calls (prompt,
/// completion) and the results of tools that ran but whose write failed (`unrecorded`).
async fn settle(
    shared: &Arc<Shared>,
    root: &str,
    admission_id: &str,
    generation: i64,
    outcome: &TurnOutcome,
    usage: (i64, i64),
    unrecorded: Vec<NewMessage>,
) -> Result<Logged<()>, StoreError> {
    let (status, closing, result) = match outcome {
        TurnOutcome::Stale => {
            return Err(StoreError::StaleGeneration(
                "the attempt lost its fence".into(),
            ))
        }
        TurnOutcome::Completed { final_message } => (
            "completed",
            vec![final_message.clone()],
            json!({"final_response": final_message.content, "completed": true,
                   "finish_reason": final_message.finish_reason.as_deref().unwrap_or("stop")}),
        ),
        TurnOutcome::Interrupted { reason } => {
            let closing = closing_for(
                shared,
                root,
                admission_id,
                &format!("[Turn interrupted: {reason}]"),
                unrecorded,
            )
            .await?;
            (
                "interrupted",
                closing,
                json!({"interrupted": true, "reason": reason}),
            )
        }
        TurnOutcome::Failed { error, reason } => {
            let closing = closing_for(
                shared,
                root,
                admission_id,
                &format!("[Turn failed: {error}]"),
                unrecorded,
            )
            .await?;
            (
                "failed",
                closing,
                json!({"failed": true, "error": error, "reason": reason}),
            )
        }
    };
    let (shown, text) = match outcome {
        TurnOutcome::Completed { final_message } => (
            "complete",
            final_message.content.clone().unwrap_or_default(),
        ),
        TurnOutcome::Interrupted { reason } => ("interrupted", reason.clone()),
        TurnOutcome::Failed { error, .. } => ("error", error.clone()),
        TurnOutcome::Stale => ("error", String::new()),
    };
    let report = [
        NewEvent::new(
            "session.info",
            json!({"running": false, "settled": admission_id, "outcome": status,
                   "execution_generation": generation}),
        ),
        NewEvent::new(
            "message.complete",
            json!({
                "admission_id": admission_id,
                "outcome": status,
                "status": shown,
                "text": text,
                "execution_generation": generation,
            }),
        ),
    ];
    let epoch = shared.epoch;
    let now = shared.now();
    let root = root.to_string();
    let settled_id = admission_id.to_string();
    let admission_id = admission_id.to_string();
    let result = result.to_string();
    let settled = shared
        .db
        .write(move |c| {
            admissions::settle(
                c,
                epoch,
                &root,
                &admission_id,
                generation,
                status,
                &result,
                &closing,
                &report,
                usage,
                now,
            )
        })
        .await;
    if settled.is_ok() {
        shared.settlements.settled(&settled_id);
    }
    settled
}

async fn closing_for(
    shared: &Arc<Shared>,
    root: &str,
    admission_id: &str,
    note: &str,
    unrecorded: Vec<NewMessage>,
) -> Result<Vec<NewMessage>, StoreError> {
    let root = root.to_string();
    let admission_id = admission_id.to_string();
    let note = note.to_string();
    shared
        .db
        .read(move |c| {
            let row = sessions::root_of(c, &root)?;
            let rows = live(c, &row.tip_session_id)?;
            Ok(closing_messages(
                &rows,
                &note,
                Some(&admission_id),
                OpenCalls::Ended(&unrecorded),
            ))
        })
        .await
}

impl Actor for SessionSupervisor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        if self.outbox.sent.is_none() {
            // Where the log stands, before any message is handled: later events follow it.
            let (shared, root) = (self.shared.clone(), self.root_id.clone());
            let fut = async move { shared.db.read(move |c| events::head(c, &root)).await };
            ctx.wait(fut.into_actor(self).map(|res, act, _| match res {
                Ok(h) => act.outbox.sent = Some(h.last_seq),
                Err(e) => {
                    tracing::error!(session = %act.root_id, error = %e, "cannot read the event head")
                }
            }));
        }
    }

    /// It stops only once nothing holds its address, and while anyone follows it, it holds its
    /// own: stopped with followers, a panic in one of its handlers ended it (the context stops
    /// the actor as it is dropped). They would get no more of the session's events, and nothing
    /// told them so (a submit went on to be admitted by a new supervisor they do not follow).
    /// Told they lost events, their connections are cut off, and a client that resumes follows
    /// the new one. Not in a stop of the gateway, which closes every connection itself.
    ///
    /// A turn it was running was dropped with it (its model call with it): its row would stay
    /// `started`, the session's queue held until a restart. It is `unknown` now, as after a
    /// crash, for the operator to resolve, and a command it was running is stopped, as a crash
    /// under systemd stops it (it ran on to its own timeout). Not in a stop of the gateway,
    /// whose actors end with it (the next start finds the row `unknown`).
    fn stopped(&mut self, _: &mut Context<Self>) {
        if self.shared.runtime.draining() {
            return;
        }
        if let Some(r) = self.running.take() {
            let _ = r.cancel.send(true);
            let (shared, root) = (self.shared.clone(), self.root_id.clone());
            let (epoch, now) = (shared.epoch, shared.now());
            let (admission_id, generation) = (r.admission_id, r.generation);
            tracing::error!(session = %root, admission = %admission_id, generation,
                "the session's supervisor stopped with its turn running; the input is unknown");
            // On the runtime's handle, not the arbiter's task set: as the runtime ends, a spawn
            // is let go of instead of failing (the next start finds the row `unknown`).
            let write = async move {
                let id = admission_id.clone();
                let marked = shared
                    .db
                    .write(move |c| {
                        crate::store::epoch::abandon_started(c, epoch, &id, generation, now)
                    })
                    .await;
                if let Err(e) = marked {
                    tracing::error!(session = %root, admission = %admission_id, error = %e,
                        "cannot mark the input unknown: it stays started until the next start");
                }
            };
            match tokio::runtime::Handle::try_current() {
                Ok(runtime) => drop(runtime.spawn(write)),
                Err(_) => tracing::error!(
                    "no runtime to mark the input unknown: it stays started until the next start"
                ),
            }
        }
        if self.subscribers.is_empty() {
            return;
        }
        tracing::error!(session = %self.root_id, followers = self.subscribers.len(),
            "the session's supervisor stopped with followers; they are cut off");
        for r in self.subscribers.values() {
            r.do_send(PushEvent::lost());
        }
    }
}

impl actix::Supervised for SessionSupervisor {
    fn restarting(&mut self, ctx: &mut Context<Self>) {
        // Runs only if the actor stopped itself with its mailbox still open, which the session
        // code never does. A panic in a handler is no stop: it ends the actor, and the
        // registry starts a new one on the next use (a panic in a turn fails the turn instead,
        // in `begin_turn`).
        tracing::error!(session = %self.root_id, "session supervisor restarted");
        self.running = None;
        for _ in 0..self.prompts.clear() {
            self.shared.metrics.prompt_closed();
        }
        self.claiming = false;
        self.maybe_queued = true;
        ctx.notify(Pump);
    }
}

// ---- messages ----

/// A fault in a handler, for tests of what follows one.
#[cfg(test)]
#[derive(Message)]
#[rtype(result = "()")]
pub struct PanicForTest;

#[cfg(test)]
impl Handler<PanicForTest> for SessionSupervisor {
    type Result = ();
    fn handle(&mut self, _: PanicForTest, _: &mut Context<Self>) {
        panic!("a fault in a session supervisor's handler, for a test");
    }
}

#[derive(Message)]
#[rtype(result = "()")]
pub struct Pump;

impl Handler<Pump> for SessionSupervisor {
    type Result = ();
    fn handle(&mut self, _: Pump, ctx: &mut Context<Self>) {
        self.pump(ctx);
    }
}

#[derive(Message)]
#[rtype(result = "()")]
pub struct Subscribe {
    pub conn_id: u64,
    pub recipient: Recipient<PushEvent>,
}

impl Handler<Subscribe> for SessionSupervisor {
    type Result = ();
    fn handle(&mut self, m: Subscribe, ctx: &mut Context<Self>) {
        self.subscribers.insert(m.conn_id, m.recipient);
        // Followed sessions stay in memory even if the registry lets go of them.
        self.pin = Some(ctx.address());
    }
}

#[derive(Message)]
#[rtype(result = "()")]
pub struct Unsubscribe {
    pub conn_id: u64,
}

impl Handler<Unsubscribe> for SessionSupervisor {
    type Result = ();
    fn handle(&mut self, m: Unsubscribe, _: &mut Context<Self>) {
        self.subscribers.remove(&m.conn_id);
        if self.subscribers.is_empty() {
            self.unwatched();
        }
    }
}

/// An admission and, when the session was idle, the claim that committed with it.
type AdmitAndClaim = (
    Logged<(AdmissionRow, bool)>,
    Option<Result<ClaimAndStart, StoreError>>,
);

/// A claim, what its turn starts from, and whether more inputs stay queued.
type ClaimAndStart = (Logged<Claim>, Option<Box<TurnStart>>, bool);

/// After a claim found a transcript too long to read on the writer, how many claims leave
/// the read to their turns before one tries again.
const LONG_TRANSCRIPT_CLAIMS: u8 = 16;

/// Claim the FIFO head; when that starts a turn, also read what the turn starts from, in the
/// same transaction, if its transcript has at most `rows` live messages (a longer one, or a
/// failed read, leaves the turn to read it itself).
fn claim_with_start(
    c: &mut SqliteConnection,
    epoch: i64,
    root: &str,
    now: f64,
    rows: i64,
) -> Result<ClaimAndStart, StoreError> {
    let (claim, more) = admissions::claim_next(c, epoch, root, now)?;
    let start = match &claim.value {
        Claim::Started(_) => TurnStart::read_bounded(c, root, rows)
            .map_err(
                |e| tracing::warn!(session = %root, error = %e, "cannot read the turn's start"),
            )
            .ok()
            .flatten(),
        Claim::Idle | Claim::Busy => None,
    };
    Ok((claim, start, more))
}

/// Admit an input (durably, before the reply), then pump.
#[derive(Message)]
#[rtype(result = "Result<AdmissionRow, GatewayError>")]
pub struct Submit {
    pub principal: String,
    pub input_id: String,
    pub text: String,
}

impl Handler<Submit> for SessionSupervisor {
    type Result = ResponseActFuture<Self, Result<AdmissionRow, GatewayError>>;

    fn handle(&mut self, m: Submit, _: &mut Context<Self>) -> Self::Result {
        let shared = self.shared.clone();
        let root = self.root_id.clone();
        // Nothing running or being claimed: the claim of the FIFO head commits with the admission
        // (one commit and one writer round trip fewer per turn; the input runs no earlier than
        // it would have, and a crash after that commit finds it `started`, as with a separate
        // claim).
        // Read once: a claim is only ever made with the admission's write (a drain that began
        // between two reads would leave a claim nobody answers).
        let runtime_draining = shared.runtime.draining();
        let claim = self.running.is_none() && !self.claiming && !self.draining && !runtime_draining;
        if claim {
            self.claiming = true;
        }
        self.write_started();
        let seen = self.admitted;
        let start_rows = if claim { self.start_read_rows() } else { 0 };
        // Queued on the writer here, in the order the inputs reached this session, not when
        // the task below is first polled (this actor's tasks are polled in no fixed order).
        let input = admissions::Input::new(&root, &m.text);
        let fut = if !runtime_draining {
            let epoch = shared.epoch;
            let now = shared.now();
            let max = shared.config.session.max_queued_admissions;
            let write = shared.db.write(move |c| {
                let admitted = admissions::admit_input(
                    c,
                    epoch,
                    &m.principal,
                    &root,
                    &m.input_id,
                    &input,
                    max,
                    now,
                )?;
                // A refused claim (an unknown row holds the FIFO) leaves the admission be.
                let claimed = claim.then(|| claim_with_start(c, epoch, &root, now, start_rows));
                Ok((admitted, claimed))
            });
            async move { Ok(write.await?) }.left_future()
        } else {
            // While the runtime drains no input is admitted, but one admitted before is not
            // new: its replay is answered with its row as at any other time (the RPC layer
            // answers it so when it sees the drain first; a replay it handed over just before
            // the phase turned reaches this supervisor after, and was refused).
            let db = shared.db.clone();
            async move {
                let replay = db.read(move |c| {
                    admissions::by_request(c, &root, &m.principal, &m.input_id)?
                        .map(|row| input.same_as(row))
                        .transpose()
                });
                match replay.await? {
                    Some(row) => Ok((Logged::quiet((row, false)), None)),
                    None => Err(GatewayError::RuntimeDraining),
                }
            }
            .right_future()
        };
        Box::pin(fut.into_actor(self).map(
            move |res: Result<AdmitAndClaim, GatewayError>, act, ctx| {
                if claim {
                    act.claiming = false;
                }
                let (admitted, claimed) = match res {
                    Ok(v) => v,
                    Err(e) => {
                        act.write_answered(Vec::new(), ctx);
                        if claim {
                            // Nothing was claimed (a drain waiting on the claim is released).
                            // Not a claim the store answered: the wait before the next try of
                            // one it failed stays as it was.
                            let failures = act.claim_failures;
                            act.claimed(Ok(Claim::Idle), None, ctx);
                            act.claim_failures = failures;
                        }
                        return Err(e);
                    }
                };
                let Logged {
                    value: (row, created),
                    events: mut rows,
                } = admitted;
                let claimed = claimed.map(|c| match c {
                    Ok((Logged { value, events }, start, more)) => {
                        rows.extend(events);
                        (Ok(value), start, more)
                    }
                    Err(e) => (Err(e), None, true),
                });
                act.write_answered(rows, ctx);
                // The reply says what was committed: an input claimed in its own admission's
                // transaction is `started`, with its generation, not `queued`; unless a drain
                // began meanwhile, which puts it back (`start_turn`): then it is `queued`.
                let putting_back = act.draining || act.shared.runtime.draining();
                if matches!(&claimed, Some((Ok(Claim::Started(_)), _, _))) {
                    act.put_back = Some(putting_back);
                }
                let row = match &claimed {
                    Some((Ok(Claim::Started(started)), _, _))
                        if started.admission_id == row.admission_id && !putting_back =>
                    {
                        (**started).clone()
                    }
                    _ => row,
                };
                if created {
                    act.shared.metrics.admitted();
                    act.maybe_queued = true;
                    act.admitted += 1;
                }
                match claimed {
                    Some((c, start, more)) => {
                        // The claim saw this input (same transaction): only inputs admitted by
                        // other submits since this one was sent can be missing from its view.
                        act.claim_answered(
                            c,
                            start,
                            more,
                            seen + u64::from(created),
                            start_rows,
                            ctx,
                        )
                    }
                    None if created => act.pump(ctx),
                    None => {}
                }
                Ok(row)
            },
        ))
    }
}

/// Live (in-memory) part of a snapshot.
#[derive(Debug, Clone)]
pub struct LiveView {
    pub running: Option<(String, i64)>,
    /// The running input's `input_id`.
    pub running_input: Option<String>,
    pub prompts: Vec<Value>,
}

#[derive(Message)]
#[rtype(result = "LiveView")]
pub struct GetLive;

impl Handler<GetLive> for SessionSupervisor {
    type Result = MessageResult<GetLive>;
    fn handle(&mut self, _: GetLive, _: &mut Context<Self>) -> Self::Result {
        MessageResult(LiveView {
            running: self
                .running
                .as_ref()
                .map(|r| (r.admission_id.clone(), r.generation)),
            running_input: self.running.as_ref().map(|r| r.request_id.clone()),
            prompts: self.open_prompts(),
        })
    }
}

/// From a turn: a prompt now waits for a human. The turn has recorded it open (`events`: its
/// `<kind>.request`, none when it is opened again after an answer the store could not record).
/// Refused, with the resolution the turn records for it, when the attempt no longer runs here.
#[derive(Message)]
#[rtype(result = "Result<(), &'static str>")]
pub struct RegisterPrompt {
    pub prompt: OpenPrompt,
    pub events: Vec<EventRow>,
}

impl Handler<RegisterPrompt> for SessionSupervisor {
    type Result = Result<(), &'static str>;
    fn handle(&mut self, m: RegisterPrompt, ctx: &mut Context<Self>) -> Self::Result {
        let prompt_id = m.prompt.prompt_id.clone();
        let registered = self.register_prompt(m, ctx);
        // The answers that came while it was being recorded, now that it is open (or not).
        for (answer, reply) in self.recorded(&prompt_id) {
            let answered = self.respond(answer, ctx);
            actix::spawn(async move {
                let _ = reply.send(answered.await);
            });
        }
        registered
    }
}

impl SessionSupervisor {
    fn register_prompt(
        &mut self,
        m: RegisterPrompt,
        ctx: &mut Context<Self>,
    ) -> Result<(), &'static str> {
        let p = m.prompt;
        // Committed whatever the answer: subscribers see the request, then how it ended.
        self.deliver(m.events, ctx);
        if self.draining {
            return Err("shutdown");
        }
        let running = self.running.as_ref();
        if running.map(|r| r.generation) != Some(p.generation) {
            return Err("turn_ended");
        }
        if running.is_some_and(|r| *r.cancel.borrow()) {
            return Err("interrupted");
        }
        self.prompts.insert(p);
        self.shared.metrics.prompt_opened();
        Ok(())
    }

    /// The prompt `prompt_id` is no longer being recorded: the answers held for it.
    fn recorded(
        &mut self,
        prompt_id: &str,
    ) -> Vec<(Respond, oneshot::Sender<Result<Value, GatewayError>>)> {
        let Some(r) = self.running.as_mut() else {
            return Vec::new();
        };
        match r.recording.take() {
            Some(rec) if rec.prompt_id == prompt_id => rec.held,
            other => {
                r.recording = other;
                Vec::new()
            }
        }
    }
}

/// From a turn, before it records a prompt open: answers for it wait until it is handed over
/// (see [`Recording`]).
#[derive(Message)]
#[rtype(result = "()")]
pub struct RecordingPrompt {
    pub generation: i64,
    pub prompt_id: String,
}

impl Handler<RecordingPrompt> for SessionSupervisor {
    type Result = ();
    fn handle(&mut self, m: RecordingPrompt, _: &mut Context<Self>) {
        if let Some(r) = self
            .running
            .as_mut()
            .filter(|r| r.generation == m.generation)
        {
            r.recording = Some(Box::new(Recording {
                prompt_id: m.prompt_id,
                held: Vec::new(),
            }));
        }
    }
}

/// From a turn: the prompt it was recording was not recorded (nobody can have seen it), so it
/// is not asked.
#[derive(Message)]
#[rtype(result = "()")]
pub struct PromptUnrecorded {
    pub prompt_id: String,
}

impl Handler<PromptUnrecorded> for SessionSupervisor {
    type Result = ();
    fn handle(&mut self, m: PromptUnrecorded, _: &mut Context<Self>) {
        for (answer, reply) in self.recorded(&m.prompt_id) {
            let _ = reply.send(Ok(already_resolved(&answer.prompt_id)));
        }
    }
}

fn already_resolved(prompt_id: &str) -> Value {
    json!({"status": "already_resolved", "prompt_id": prompt_id})
}

/// From a turn: its prompt timed out or was abandoned.
#[derive(Message)]
#[rtype(result = "()")]
pub struct RetirePrompt {
    pub prompt_id: String,
    pub resolution: String,
}

impl Handler<RetirePrompt> for SessionSupervisor {
    type Result = ();
    fn handle(&mut self, m: RetirePrompt, ctx: &mut Context<Self>) {
        self.retire_prompt(&m.prompt_id, &m.resolution, ctx);
    }
}

/// From a turn: events it committed with a transition of its own (a compaction's
/// `session.info`, in the compaction's transaction), to be sent to the subscribers in order.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Committed {
    pub rows: Vec<EventRow>,
}

impl Handler<Committed> for SessionSupervisor {
    type Result = ();
    fn handle(&mut self, m: Committed, ctx: &mut Context<Self>) {
        self.deliver(m.rows, ctx);
    }
}

/// From a turn: an event of the attempt. Streaming deltas (`message.delta`) are live only; the
/// rest (tool activity) is recorded in the log first.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Emit {
    pub kind: &'static str,
    pub payload: Value,
}

impl Handler<Emit> for SessionSupervisor {
    type Result = ();
    fn handle(&mut self, m: Emit, ctx: &mut Context<Self>) {
        if m.kind == "message.delta" {
            self.emit_live(m.kind, m.payload, ctx);
        } else {
            self.record(m.kind, m.payload, ctx);
        }
    }
}

/// From a turn: an event of the attempt that must be in the log before the turn goes on (how a
/// parked tool ended, before the settlement's events). Queued by this actor, so after every
/// [`Emit`] the turn sent before it (a tool's start before its end); answered once committed.
#[derive(Message)]
#[rtype(result = "Result<(), StoreError>")]
pub struct RecordNow {
    pub kind: &'static str,
    pub payload: Value,
}

impl Handler<RecordNow> for SessionSupervisor {
    type Result = ResponseActFuture<Self, Result<(), StoreError>>;
    fn handle(&mut self, m: RecordNow, _: &mut Context<Self>) -> Self::Result {
        let write = self.event_write(m.kind, m.payload);
        self.write_started();
        let fut = self.shared.db.write(write);
        Box::pin(fut.into_actor(self).map(|res, act, ctx| match res {
            Ok(rows) => {
                act.write_answered(rows, ctx);
                Ok(())
            }
            Err(e) => {
                act.write_answered(Vec::new(), ctx);
                Err(e)
            }
        }))
    }
}

/// A human's answer to a prompt, fenced by the running generation.
#[derive(Message)]
#[rtype(result = "Result<Value, GatewayError>")]
pub struct Respond {
    pub kind: PromptKind,
    pub generation: i64,
    pub prompt_id: String,
    pub answer: PromptAnswer,
    pub by: String,
}

impl Handler<Respond> for SessionSupervisor {
    type Result = ResponseFuture<Result<Value, GatewayError>>;
    fn handle(&mut self, m: Respond, ctx: &mut Context<Self>) -> Self::Result {
        // For the running attempt's prompt that is still being recorded: it waits for it.
        let recording = self
            .running
            .as_mut()
            .filter(|r| r.generation == m.generation)
            .and_then(|r| r.recording.as_deref_mut())
            .filter(|p| p.prompt_id == m.prompt_id);
        if let Some(r) = recording {
            let (tx, rx) = oneshot::channel();
            let prompt_id = m.prompt_id.clone();
            r.held.push((m, tx));
            // Dropped unanswered: the attempt ended first.
            return Box::pin(async move {
                rx.await
                    .unwrap_or_else(|_| Ok(already_resolved(&prompt_id)))
            });
        }
        self.respond(m, ctx)
    }
}

impl SessionSupervisor {
    fn respond(
        &mut self,
        m: Respond,
        ctx: &mut Context<Self>,
    ) -> futures_util::future::LocalBoxFuture<'static, Result<Value, GatewayError>> {
        let prompt_id = m.prompt_id.clone();
        match self.hand_over(m, ctx) {
            Err(e) => Box::pin(std::future::ready(Err(e))),
            Ok(None) => Box::pin(std::future::ready(Ok(already_resolved(&prompt_id)))),
            // `resolved` once the attempt has recorded the answer and will act on it.
            Ok(Some(taken)) => Box::pin(async move {
                match taken.await {
                    Ok(Ok(())) => Ok(json!({"status": "resolved", "prompt_id": prompt_id})),
                    Ok(Err(e)) => Err(e),
                    Err(_) => Err(GatewayError::StaleGeneration(
                        "the attempt ended before it took the answer".into(),
                    )),
                }
            }),
        }
    }
}

impl SessionSupervisor {
    /// Hand a human's answer to the attempt that asked: what will say whether the attempt took
    /// it (`None`: the prompt is no longer open).
    fn hand_over(
        &mut self,
        m: Respond,
        ctx: &mut Context<Self>,
    ) -> Result<Option<oneshot::Receiver<Result<(), GatewayError>>>, GatewayError> {
        let running = self.running.as_ref().map(|r| r.generation);
        if running != Some(m.generation) || self.draining {
            return Err(GatewayError::StaleGeneration(format!(
                "generation {} is not the running attempt of this session",
                m.generation
            )));
        }
        // An attempt being interrupted takes no answer: its interrupt wins over one that raced
        // it, and the answer was recorded (and told `resolved`) for a command that never ran.
        if self.shared.runtime.turns_stopping()
            || self.running.as_ref().is_some_and(|r| *r.cancel.borrow())
        {
            return Err(GatewayError::StaleGeneration(format!(
                "generation {} is being interrupted",
                m.generation
            )));
        }
        // Checked after the generation: an answer for another attempt is stale whatever it names
        // or holds.
        if m.prompt_id.is_empty() {
            return Err(GatewayError::InvalidParams(
                "prompt_id must not be empty".into(),
            ));
        }
        // An answer is kept in the transcript and sent with every later request, as an input
        // is: it is bounded as one.
        if let PromptAnswer::Text(text) = &m.answer {
            self.shared.config.session.check_text("answer", text)?;
        }
        let stale = self.prompts.ids_where(|p| Some(p.generation) != running);
        for id in stale {
            self.retire_prompt(&id, "stale", ctx);
        }
        let Some(p) = self.prompts.get(&m.prompt_id) else {
            return Ok(None);
        };
        if p.responder.is_closed() {
            // The turn stopped waiting (timeout or interrupt) and has already asked to retire the
            // prompt with the real resolution; this answer changes nothing.
            return Ok(None);
        }
        if p.kind != m.kind {
            return Err(GatewayError::InvalidParams(format!(
                "prompt {} is {}",
                m.prompt_id,
                match p.kind.as_str() {
                    "approval" => "an approval prompt: answer it with a `choice`",
                    _ => "a clarify prompt: answer it with an `answer`",
                }
            )));
        }
        if let PromptAnswer::Choice(choice) = &m.answer {
            if !p.choices.contains(choice) {
                return Err(GatewayError::InvalidParams(format!(
                    "choice {choice:?} is not one of {:?}",
                    p.choices
                )));
            }
        }
        let Some(p) = self.prompts.remove(&m.prompt_id) else {
            return Ok(None);
        };
        self.shared.metrics.prompt_closed();
        // The attempt records the answer (or how its prompt ended instead) before it acts.
        let (taken, told) = oneshot::channel();
        let answer = Answer {
            answer: m.answer,
            by: m.by,
            taken,
            payload: p.payload,
            choices: p.choices,
        };
        Ok(p.responder.send(answer).is_ok().then_some(told))
    }
}

#[derive(Message)]
#[rtype(result = "Result<AdmissionRow, GatewayError>")]
pub struct ResolveUnknown {
    pub admission_id: String,
    pub generation: i64,
}

impl Handler<ResolveUnknown> for SessionSupervisor {
    type Result = ResponseActFuture<Self, Result<AdmissionRow, GatewayError>>;
    fn handle(&mut self, m: ResolveUnknown, _: &mut Context<Self>) -> Self::Result {
        let shared = self.shared.clone();
        let root = self.root_id.clone();
        self.write_started();
        let (epoch, now) = (shared.epoch, shared.now());
        let id = m.admission_id.clone();
        // Queued when handled, in the order this session's messages came (see `Submit`).
        let write = shared.db.write(move |c| {
            admissions::resolve_unknown(c, epoch, &root, &m.admission_id, m.generation, now)
        });
        let fut = async move {
            let resolved = write.await?;
            shared.settlements.settled(&id);
            Ok(resolved)
        };
        Box::pin(fut.into_actor(self).map(
            |res: Result<Logged<AdmissionRow>, GatewayError>, act, ctx| {
                let row = act.answered(res, ctx)?;
                act.pump(ctx);
                Ok(row)
            },
        ))
    }
}

#[derive(Message)]
#[rtype(result = "Result<AdmissionRow, GatewayError>")]
pub struct CancelQueued {
    pub admission_id: String,
}

impl Handler<CancelQueued> for SessionSupervisor {
    type Result = ResponseActFuture<Self, Result<AdmissionRow, GatewayError>>;
    fn handle(&mut self, m: CancelQueued, _: &mut Context<Self>) -> Self::Result {
        let shared = self.shared.clone();
        let root = self.root_id.clone();
        self.write_started();
        let (epoch, now) = (shared.epoch, shared.now());
        let id = m.admission_id.clone();
        // Queued when handled, in the order this session's messages came (see `Submit`).
        let write = shared
            .db
            .write(move |c| admissions::cancel(c, epoch, &root, &m.admission_id, now));
        let fut = async move {
            let cancelled = write.await?;
            shared.settlements.settled(&id);
            Ok(cancelled)
        };
        Box::pin(fut.into_actor(self).map(
            |res: Result<Logged<AdmissionRow>, GatewayError>, act, ctx| act.answered(res, ctx),
        ))
    }
}

/// Interrupt the running attempt `generation`: `true` if it was running and is told to stop,
/// `false` if it has already decided how it ends (its settlement is on its way), and
/// `stale_generation` if it is not this session's running attempt.
#[derive(Message)]
#[rtype(result = "Result<bool, GatewayError>")]
pub struct Interrupt {
    pub generation: i64,
    pub reason: String,
}

impl Handler<Interrupt> for SessionSupervisor {
    type Result = ResponseFuture<Result<bool, GatewayError>>;
    fn handle(&mut self, m: Interrupt, ctx: &mut Context<Self>) -> Self::Result {
        if self.running.is_none() && self.claiming {
            // A client may know of the attempt the claim in flight committed (a receipt read
            // from the store) before this supervisor does: answer once the claim has.
            let (reply, answer) = oneshot::channel();
            self.held_interrupts.push(HeldInterrupt {
                generation: m.generation,
                reason: m.reason,
                reply,
            });
            return Box::pin(async move {
                answer.await.unwrap_or_else(|_| {
                    Err(GatewayError::Internal(
                        "session supervisor unavailable".into(),
                    ))
                })
            });
        }
        let answer = self.interrupt(m.generation, &m.reason, ctx);
        Box::pin(async move { answer })
    }
}

impl SessionSupervisor {
    fn interrupt(
        &mut self,
        generation: i64,
        reason: &str,
        ctx: &mut Context<Self>,
    ) -> Result<bool, GatewayError> {
        let Some(r) = &self.running else {
            return Err(GatewayError::StaleGeneration("nothing is running".into()));
        };
        if generation != r.generation {
            return Err(GatewayError::StaleGeneration(format!(
                "generation {generation} is not running"
            )));
        }
        if r.ended.get() {
            return Ok(false);
        }
        tracing::info!(session = %self.root_id, %reason, "interrupting the running turn");
        self.stop_running("interrupted", ctx);
        Ok(true)
    }

    /// Tell the running turn to stop, and retire its open prompts as `resolution`. The flag
    /// first, then the prompts: a released prompt must see the stop.
    fn stop_running(&mut self, resolution: &str, ctx: &mut Context<Self>) {
        if let Some(r) = &self.running {
            let _ = r.cancel.send(true);
        }
        let open = self.prompts.ids_where(|_| true);
        for id in open {
            self.retire_prompt(&id, resolution, ctx);
        }
    }

    /// The claim in flight has answered (and started its attempt, if it claimed one): answer
    /// the interrupts that waited for it.
    fn answer_held_interrupts(&mut self, ctx: &mut Context<Self>) {
        if self.claiming {
            return;
        }
        for held in std::mem::take(&mut self.held_interrupts) {
            let answer = self.interrupt(held.generation, &held.reason, ctx);
            let _ = held.reply.send(answer);
        }
    }
}

/// Graceful stop: no more claims; interrupt the running attempt; answer when it has settled.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Drain;

impl Handler<Drain> for SessionSupervisor {
    type Result = ResponseFuture<()>;
    fn handle(&mut self, _: Drain, ctx: &mut Context<Self>) -> Self::Result {
        self.draining = true;
        match &self.running {
            Some(_) => self.stop_running("shutdown", ctx),
            // A claim in flight may start an attempt (born cancelled): wait for it to settle.
            None if self.claiming => {}
            None => return Box::pin(async {}),
        }
        let (tx, rx) = oneshot::channel();
        self.drain_waiters.push(tx);
        Box::pin(async move {
            let _ = rx.await;
        })
    }
}

/// Is this supervisor idle (nothing running, nobody subscribed)?
#[derive(Message)]
#[rtype(result = "bool")]
pub struct IsIdle;

impl Handler<IsIdle> for SessionSupervisor {
    type Result = bool;
    fn handle(&mut self, _: IsIdle, _: &mut Context<Self>) -> bool {
        self.forget_closed_followers();
        let idle = self.idle();
        self.found_busy |= !idle;
        idle
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records what it is handed.
    struct Sink(Arc<std::sync::Mutex<Vec<usize>>>);

    impl Actor for Sink {
        type Context = Context<Self>;
    }

    impl Handler<PushEvent> for Sink {
        type Result = ();
        fn handle(&mut self, m: PushEvent, _: &mut Context<Self>) {
            if let Ok(mut seen) = self.0.lock() {
                seen.push(m.0.len());
            }
        }
    }

    #[actix_rt::test]
    async fn a_receiver_with_a_full_mailbox_is_dropped_and_told_so() {
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut ctx = Context::new();
        ctx.set_mailbox_capacity(2);
        let r = ctx.run(Sink(seen.clone())).recipient();
        let frame: Arc<str> = Arc::from("{}");
        // Nothing runs the sink until this task yields: its mailbox fills.
        let mut sent = 0;
        while push_or_drop(&r, PushEvent::one(frame.clone())) {
            sent += 1;
            assert!(sent < 100, "the mailbox never filled");
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        loop {
            let got = seen.lock().map(|s| s.clone()).unwrap_or_default();
            if got.len() == sent + 1 {
                // Every batch it was handed, then the notice that it lost the next one.
                assert_eq!(got[..sent], vec![1; sent][..]);
                assert_eq!(got[sent], 0);
                break;
            }
            assert!(std::time::Instant::now() < deadline, "{got:?}");
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    }
}
