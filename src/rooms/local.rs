//! The local [`SessionPort`]: member turns of hosted rooms run through the same session authority
//! as every other input (registry → supervisor → admission ledger). A member's room session is
//! created under the rooms principal with title `Group: <room_id>` and source `bot_room`; each
//! attempt is admitted with the input id `room/<room>/<task>/<generation>`, so receipts and
//! history match the exact attempt.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};

use super::port::{
    AnswerOutcome, ApprovalAnswer, HistoryMessage, InterruptReply, InterruptRequest, LedgerAttempt,
    PortError, PortFuture, SessionAddress, SessionHandle, SessionInfo, SessionPort, SessionRef,
    SubmitRequest, TerminalReceipt,
};
use crate::api::rpc::{session_id_for, Authority, Caller};
use crate::error::GatewayError;
use crate::session::prompts::{PromptAnswer, PromptKind};
use crate::session::supervisor::{
    CancelQueued, GetLive, Interrupt, LiveView, Respond, SessionSupervisor, Submit,
};
use crate::store::admissions::{self, AdmissionRow};
use crate::store::room_tasks::TaskIdentity;
use crate::store::sessions;
use actix::Addr;

/// The principal that owns room sessions.
pub const ROOMS_PRINCIPAL: &str = "gateway:rooms";

pub struct LocalSessionPort {
    authority: Authority,
    poll: Duration,
}

impl LocalSessionPort {
    /// The ledger row of exactly this attempt (its input id).
    /// The attempt's ledger row; read on the writer, after every write queued before it, when
    /// `after_writes` (see [`SessionPort::ledger_attempt_settled`]).
    async fn attempt_row(
        &self,
        session: &SessionRef,
        task: &TaskIdentity,
        (generation, after_writes): (i64, bool),
    ) -> Result<Option<AdmissionRow>, PortError> {
        let id = session.session_id.clone();
        let input_id = input_id(&task.room_id, &task.task_id, generation);
        let read = move |c: &mut diesel::SqliteConnection| {
            admissions::by_request(c, &id, ROOMS_PRINCIPAL, &input_id)
        };
        let db = &self.authority.shared.db;
        let row = if after_writes {
            db.write(read).await
        } else {
            db.read(read).await
        };
        row.map_err(|e| port_err(e.into()))
    }

    /// What the attempt's ledger row says of it (see [`Self::attempt_row`]).
    fn ledger(
        &self,
        session: SessionRef,
        task: TaskIdentity,
        read: (i64, bool),
    ) -> PortFuture<'_, Option<LedgerAttempt>> {
        Box::pin(async move {
            let row = self.attempt_row(&session, &task, read).await?;
            Ok(row.map(|row| ledger_of(&row)))
        })
    }

    pub fn new(authority: Authority, poll: Duration) -> Self {
        Self { authority, poll }
    }

    fn request_id(address: &SessionAddress) -> String {
        format!("room-session/{}/{}", address.profile, address.title)
    }

    /// The session's supervisor and what it holds in memory.
    async fn live(
        &self,
        session_id: &str,
    ) -> Result<(Addr<SessionSupervisor>, LiveView), PortError> {
        let sup = self
            .authority
            .supervisor(session_id)
            .await
            .map_err(port_err)?;
        let live = sup
            .send(GetLive)
            .await
            .map_err(|e| PortError::new(e.to_string()))?;
        Ok((sup, live))
    }

    /// [`LocalSessionPort::live`], and the row of the running attempt.
    async fn running_attempt(
        &self,
        session_id: &str,
    ) -> Result<(Addr<SessionSupervisor>, LiveView, Option<AdmissionRow>), PortError> {
        let (sup, live) = self.live(session_id).await?;
        let Some((admission_id, _)) = live.running.clone() else {
            return Ok((sup, live, None));
        };
        let row = self
            .authority
            .shared
            .db
            .read(move |c| admissions::by_id(c, &admission_id))
            .await
            .map_err(|e| port_err(e.into()))?;
        Ok((sup, live, Some(row)))
    }

    fn caller() -> Caller {
        Caller {
            principal: ROOMS_PRINCIPAL.into(),
            conn_id: 0,
            recipient: None,
            subscribed: Default::default(),
        }
    }
}

fn port_err(e: GatewayError) -> PortError {
    PortError::new(e.to_string())
}

/// What an attempt's ledger row says of it.
fn ledger_of(row: &AdmissionRow) -> LedgerAttempt {
    if row.is_terminal() {
        LedgerAttempt::Ended(receipt_of(row))
    } else if row.status == "unknown" {
        LedgerAttempt::Unresolved {
            session_id: row.target_session_id.clone(),
            admission_id: row.admission_id.clone(),
        }
    } else {
        LedgerAttempt::Live {
            session_id: row.target_session_id.clone(),
            admission_id: row.admission_id.clone(),
            started: (row.status == "started").then_some(row.updated_at),
        }
    }
}

/// The input id of a room task's attempt: `room/<room>/<task>/<generation>`.
pub(crate) fn input_id(room_id: &str, task_id: &str, generation: i64) -> String {
    format!("room/{room_id}/{task_id}/{generation}")
}

/// A settled or failed attempt's ledger row as the member's history message (none for another
/// outcome, or a row that is not a room attempt's).
fn history_message(row: &AdmissionRow) -> Option<HistoryMessage> {
    let (task, gen) = parse_input_id(&row.request_id)?;
    let status = match row.outcome.as_deref() {
        Some("completed") => "settled",
        Some("failed") => "failed",
        _ => return None,
    };
    let (text, error, _) = result_fields(row);
    Some(HistoryMessage {
        role: "assistant".into(),
        task_id: Some(task),
        execution_generation: Some(gen),
        status: Some(status.into()),
        message_id: Some(row.admission_id.clone()),
        content: text.or(error).unwrap_or_default(),
    })
}

/// `room/<room>/<task>/<generation>` → (task, generation).
pub fn parse_input_id(input_id: &str) -> Option<(String, i64)> {
    let mut parts = input_id.strip_prefix("room/")?.split('/');
    let _room = parts.next()?;
    let task = parts.next()?;
    let gen = parts.next()?.parse().ok()?;
    Some((task.to_string(), gen))
}

/// What a settled admission's result says: its final text, its error, and, for an
/// interrupted turn (`{"interrupted": true, "reason": …}`), why. One parse of the result.
fn result_fields(row: &AdmissionRow) -> (Option<String>, Option<String>, Option<String>) {
    let v: Value = row
        .result_json
        .as_deref()
        .and_then(|r| serde_json::from_str(r).ok())
        .unwrap_or(Value::Null);
    let field = |name: &str| v.get(name).and_then(Value::as_str).map(str::to_string);
    (field("final_response"), field("error"), field("reason"))
}

fn receipt_of(row: &AdmissionRow) -> TerminalReceipt {
    let (text, mut error, reason) = result_fields(row);
    if row.outcome.as_deref() == Some("interrupted") && error.is_none() {
        error = Some(match reason {
            Some(reason) => format!("the member's turn was interrupted: {reason}"),
            None => "the member's turn was interrupted".into(),
        });
    }
    let status = match row.outcome.as_deref() {
        Some("completed") => "settled",
        Some("cancelled") => "cancelled",
        Some("interrupted") => "interrupted",
        _ => "failed",
    };
    TerminalReceipt {
        status: status.into(),
        settlement_id: Some(row.admission_id.clone()),
        message_id: Some(row.admission_id.clone()),
        text,
        error,
    }
}

/// Did this ended attempt end without a reply or an error the room records? One that completed
/// or failed did not end by a stop: a stop taken as acknowledged by it recorded the task
/// cancelled and dropped the member's reply (a completion wins over a stop: the stop's next look
/// at the receipt records it).
fn stopped(row: &AdmissionRow) -> bool {
    !(matches!(row.outcome.as_deref(), Some("completed" | "failed"))
        && history_message(row).is_some())
}

impl SessionPort for LocalSessionPort {
    /// The profiles a session may be created with: `default` and the config's `profiles`.
    fn has_profile(&self, profile: &str) -> Option<bool> {
        Some(profile == "default" || self.authority.shared.config.profiles.contains_key(profile))
    }

    fn resolve_exact(&self, address: SessionAddress) -> PortFuture<'_, Option<SessionHandle>> {
        Box::pin(async move {
            let id = session_id_for(ROOMS_PRINCIPAL, &Self::request_id(&address));
            let found = self
                .authority
                .shared
                .db
                .read(move |c| sessions::find(c, &id))
                .await
                .map_err(|e| port_err(e.into()))?;
            Ok(found.map(|s| SessionHandle { session_id: s.id }))
        })
    }

    /// One read: the session by its deterministic id, and its lineage's root.
    fn resolve_and_resume(&self, address: SessionAddress) -> PortFuture<'_, Option<SessionHandle>> {
        Box::pin(async move {
            let id = session_id_for(ROOMS_PRINCIPAL, &Self::request_id(&address));
            let root = self
                .authority
                .shared
                .db
                .read(move |c| sessions::find_root(c, &id))
                .await
                // Read before anything is submitted: a store that fails here admitted nothing,
                // and the task is queued again, not failed for good.
                .map_err(|e| create_refusal(e.into()))?;
            Ok(root.map(|s| SessionHandle { session_id: s.id }))
        })
    }

    fn create(&self, address: SessionAddress) -> PortFuture<'_, SessionHandle> {
        Box::pin(async move {
            let params = json!({
                "request_id": Self::request_id(&address),
                "source": address.source,
                "profile": address.profile,
                "title": address.title,
            });
            let r = self
                .authority
                .call("session.create", params, &Self::caller())
                .await
                .map_err(create_refusal)?;
            let result = r.result.into_value();
            let id = result["session_id"]
                .as_str()
                .ok_or_else(|| PortError::new("no session id"))?;
            Ok(SessionHandle {
                session_id: id.to_string(),
            })
        })
    }

    fn resume(&self, session: SessionRef) -> PortFuture<'_, SessionHandle> {
        Box::pin(async move {
            let id = session.session_id.clone();
            let root = self
                .authority
                .shared
                .db
                .read(move |c| sessions::root_of(c, &id))
                .await
                .map_err(|e| create_refusal(e.into()))?;
            Ok(SessionHandle {
                session_id: root.id,
            })
        })
    }

    fn submit(&self, request: SubmitRequest) -> PortFuture<'_, ()> {
        Box::pin(async move {
            if self.authority.shared.runtime.draining() {
                return Err(PortError::not_admitted("the gateway is draining"));
            }
            let input_id = input_id(
                &request.task.room_id,
                &request.task.task_id,
                request.execution_generation,
            );
            // Nothing is admitted yet: a failure here (the registry is gone while the gateway
            // stops) leaves the task queued for a later attempt, not watched until its deadline.
            let sup = self
                .authority
                .supervisor(&request.session_id)
                .await
                .map_err(|e| PortError::not_admitted(e.to_string()))?;
            let row = match sup
                .send(Submit {
                    principal: ROOMS_PRINCIPAL.into(),
                    input_id,
                    text: request.prompt.clone(),
                })
                .await
            {
                Ok(Ok(row)) => row,
                // Refused by the ledger: the transaction did not commit, and the task may be
                // tried again under a new generation.
                Ok(Err(e)) if refused_before_commit(&e) => {
                    return Err(PortError::not_admitted(e.to_string()))
                }
                // A failed commit, or a supervisor gone while its write was on its way: the
                // admission may be in the ledger all the same, and a new generation would run
                // the prompt twice. The room observes the attempt instead (never resubmits).
                Ok(Err(e)) => {
                    return Err(PortError::new(format!(
                        "the member's admission may have committed: {e}"
                    )))
                }
                Err(e) => {
                    return Err(PortError::new(format!(
                        "the member's admission may have committed (its supervisor is gone: {e})"
                    )))
                }
            };
            let db = self.authority.shared.db.clone();
            let poll = self.poll;
            let callback = request.on_terminal.clone();
            let admission = row.admission_id.clone();
            // Woken by the member's supervisor when it commits the settlement; the poll stays
            // as the bound on a wait (a settlement by a path that does not signal is still read).
            let mut settled = self.authority.shared.settlements.watch(&admission);
            tokio::spawn(async move {
                loop {
                    let id = admission.clone();
                    match db.read(move |c| admissions::by_id(c, &id)).await {
                        Ok(row) if row.is_terminal() => {
                            drop(settled);
                            // The callback commits the room's settlement: on the blocking pool,
                            // not on this arbiter, which also runs session supervisors (a commit
                            // here, its fsync and its wait for the write lock, would stall them).
                            let receipt = receipt_of(&row);
                            drop(tokio::task::spawn_blocking(move || callback(receipt)));
                            return;
                        }
                        Ok(_) => {}
                        Err(e) => {
                            tracing::warn!(error = %e, "room turn observation failed; retrying")
                        }
                    }
                    settled.wait(poll).await;
                }
            });
            Ok(())
        })
    }

    fn history(&self, session: SessionRef) -> PortFuture<'_, Vec<HistoryMessage>> {
        Box::pin(async move {
            let id = session.session_id.clone();
            let rows = self
                .authority
                .shared
                .db
                .read(move |c| admissions::terminal_of_session(c, &id))
                .await
                .map_err(|e| port_err(e.into()))?;
            Ok(rows.iter().filter_map(history_message).collect())
        })
    }

    /// The attempt's own ledger row, looked up by its input id (the default would read every
    /// settled input the member's room session has had, on each of the observer's wakeups).
    fn receipt(
        &self,
        session: SessionRef,
        task: TaskIdentity,
        generation: i64,
    ) -> PortFuture<'_, Option<HistoryMessage>> {
        Box::pin(async move {
            let row = self
                .attempt_row(&session, &task, (generation, false))
                .await?;
            Ok(row
                .filter(|row| row.is_terminal())
                .as_ref()
                .and_then(history_message))
        })
    }

    /// An `unknown` turn in the member's session (its lineage's root, whose FIFO it holds):
    /// nothing starts there until the operator resolves it.
    fn held(&self, address: SessionAddress) -> PortFuture<'_, Option<String>> {
        Box::pin(async move {
            let id = session_id_for(ROOMS_PRINCIPAL, &Self::request_id(&address));
            let unknown = self
                .authority
                .shared
                .db
                .read(move |c| -> Result<_, crate::error::StoreError> {
                    let Some(root) = sessions::find_root(c, &id)? else {
                        return Ok(None);
                    };
                    let unknown = admissions::holding_unknown(c, &root.id)?;
                    Ok(unknown.map(|admission| (root.id, admission)))
                })
                .await
                .map_err(|e| port_err(e.into()))?;
            Ok(unknown.map(|(session, admission)| {
                format!(
                    "its member's session {session} is held by the unknown turn {admission}, \
                     which nothing runs behind until the operator resolves it: `gatehouse \
                     resolve-unknown {session} {admission}`"
                )
            }))
        })
    }

    fn keeps_ledger(&self) -> bool {
        true
    }

    fn ledger_attempt_settled(
        &self,
        session: SessionRef,
        task: TaskIdentity,
        generation: i64,
    ) -> PortFuture<'_, Option<LedgerAttempt>> {
        self.ledger(session, task, (generation, true))
    }

    /// The attempt's ledger row: how it ended, with its result, or that it is `unknown`.
    fn ledger_attempt(
        &self,
        session: SessionRef,
        task: TaskIdentity,
        generation: i64,
    ) -> PortFuture<'_, Option<LedgerAttempt>> {
        self.ledger(session, task, (generation, false))
    }

    fn withdraw_queued(
        &self,
        session: SessionRef,
        task: TaskIdentity,
        generation: i64,
    ) -> PortFuture<'_, Option<bool>> {
        Box::pin(async move {
            // Read after every queued write: an admission whose submit answered ambiguously
            // may still be on its way, and "never admitted" acknowledged the stop before it ran.
            let Some(row) = self
                .attempt_row(&session, &task, (generation, true))
                .await?
            else {
                return Ok(None);
            };
            match row.status.as_str() {
                "queued" => {}
                "started" => return Ok(Some(false)),
                // Ended: stopped, or with a reply the stop's next look at the receipt records.
                _ if row.is_terminal() => return Ok(Some(stopped(&row))),
                // Unknown (never replayed): it will not start.
                _ => return Ok(Some(true)),
            }
            let (sup, _) = self.live(&session.session_id).await?;
            let cancelled = sup
                .send(CancelQueued {
                    admission_id: row.admission_id,
                })
                .await
                .map_err(|e| PortError::new(e.to_string()))?;
            match cancelled {
                Ok(row) => Ok(Some(row.is_terminal() && stopped(&row))),
                // Claimed between the read and the cancel: it runs now, so interrupt it.
                Err(GatewayError::StaleGeneration(_)) => Ok(Some(false)),
                Err(GatewayError::UnknownExecution(_)) => Ok(Some(true)),
                Err(e) => Err(port_err(e)),
            }
        })
    }

    fn info(&self, session: SessionRef) -> PortFuture<'_, SessionInfo> {
        Box::pin(async move {
            // What the supervisor holds in memory (no read of the running row: an observer
            // asks on each wakeup).
            let (_, live) = self.live(&session.session_id).await?;
            let (Some((admission_id, _)), Some(input_id)) = (live.running, live.running_input)
            else {
                return Ok(SessionInfo::default());
            };
            let (task_id, generation) = match parse_input_id(&input_id) {
                Some((t, g)) => (Some(t), Some(g)),
                None => (None, None),
            };
            let approval = live
                .prompts
                .iter()
                .find(|p| p["kind"] == "approval")
                .cloned();
            Ok(SessionInfo {
                active: true,
                task_id,
                status: Some(
                    if approval.is_some() {
                        "waiting_for_approval"
                    } else {
                        "running"
                    }
                    .into(),
                ),
                execution_generation: generation,
                pending_approval: approval,
                run_id: Some(admission_id),
            })
        })
    }

    fn interrupt(&self, request: InterruptRequest) -> PortFuture<'_, Option<InterruptReply>> {
        Box::pin(async move {
            let (sup, live, row) = self.running_attempt(&request.session_id).await?;
            let (Some((_, generation)), Some(row)) = (live.running, row) else {
                return Ok(Some(InterruptReply {
                    interrupted: Some(false),
                    status: Some("idle".into()),
                }));
            };
            if parse_input_id(&row.request_id).map(|(t, _)| t)
                != Some(request.expected_task_id.clone())
            {
                // Never interrupt a newer (or foreign) turn.
                return Ok(None);
            }
            let done = sup
                .send(Interrupt {
                    generation,
                    reason: "room task stop".into(),
                })
                .await
                .map_err(|e| PortError::new(e.to_string()))?
                .map_err(port_err)?;
            // Not interrupted: the turn had decided how it ends, and its settlement is on its
            // way. Not a stop's acknowledgement (that recorded the task stopped and dropped
            // the member's reply): the stop's next look at the receipt finds how it ended.
            Ok(Some(InterruptReply {
                interrupted: Some(done),
                status: Some(if done { "interrupted" } else { "ending" }.into()),
            }))
        })
    }

    fn answer(&self, answer: ApprovalAnswer) -> PortFuture<'_, AnswerOutcome> {
        Box::pin(async move {
            let (sup, live) = self.live(&answer.session.session_id).await?;
            let attempt = input_id(
                &answer.task.room_id,
                &answer.task.task_id,
                answer.execution_generation,
            );
            // The running turn and its input, from one look at the supervisor: the session's
            // generation sent below names exactly the turn whose input was compared, and the
            // supervisor refuses it once another turn runs.
            let (Some((_, generation)), Some(running)) = (live.running, live.running_input) else {
                return Ok(AnswerOutcome::Stale(
                    "the member's session runs no turn".into(),
                ));
            };
            if running != attempt {
                return Ok(AnswerOutcome::Stale(format!(
                    "the member's running turn is not attempt {} of task {}",
                    answer.execution_generation, answer.task.task_id
                )));
            }
            let reply = sup
                .send(Respond {
                    kind: PromptKind::Approval,
                    generation,
                    prompt_id: answer.request_id,
                    answer: PromptAnswer::Choice(answer.choice),
                    by: answer.by,
                })
                .await
                .map_err(|e| PortError::new(e.to_string()))?;
            Ok(match reply {
                Ok(taken) if taken["status"] == "resolved" => AnswerOutcome::Resolved,
                Ok(_) => AnswerOutcome::AlreadyResolved,
                Err(GatewayError::StaleGeneration(m)) => AnswerOutcome::Stale(m),
                Err(GatewayError::InvalidParams(m)) => AnswerOutcome::Refused(m),
                Err(e) => return Err(port_err(e)),
            })
        })
    }
}

/// Shared handle for building the port.
pub fn port(authority: Authority, poll: Duration) -> Arc<dyn SessionPort> {
    Arc::new(LocalSessionPort::new(authority, poll))
}

/// A member session that could not be opened for a passing reason (the gateway draining, the
/// store failing, too many requests): no input of the attempt was admitted, so the task is
/// queued again for a later attempt. It was failed for good, so a task that a pass started as
/// the gateway began a graceful stop never ran after the restart. A refusal that another try
/// would meet again (a profile that is not configured) still fails the task.
fn create_refusal(error: GatewayError) -> PortError {
    match error {
        GatewayError::RuntimeDraining
        | GatewayError::StorageUnavailable
        | GatewayError::RateLimited(_)
        | GatewayError::Internal(_) => PortError::not_admitted(error.to_string()),
        other => port_err(other),
    }
}

/// Did the member's ledger refuse the admission before anything could commit? A storage
/// failure (a commit that failed, the writer gone) leaves it unknown.
fn refused_before_commit(error: &GatewayError) -> bool {
    !matches!(
        error,
        GatewayError::StorageUnavailable | GatewayError::Internal(_)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_create_refused_for_a_passing_reason_admitted_nothing() {
        for passing in [
            GatewayError::RuntimeDraining,
            GatewayError::StorageUnavailable,
            GatewayError::RateLimited("busy".into()),
        ] {
            assert!(create_refusal(passing).not_admitted);
        }
        let lasting = GatewayError::InvalidParams("unknown profile \"ops\"".into());
        assert!(!create_refusal(lasting).not_admitted);
    }
    use crate::rooms::supervisor::{settlement_from_history, settlement_from_receipt};

    fn row(outcome: &str, result: Value) -> AdmissionRow {
        AdmissionRow {
            seq: 1,
            admission_id: "adm-1".into(),
            request_id: input_id("r1", "t-9", 3),
            principal_id: ROOMS_PRINCIPAL.into(),
            target_session_id: "s".into(),
            session_ordinal: 1,
            payload_json: "{}".into(),
            payload_digest: String::new(),
            intent: "queue".into(),
            status: "terminal".into(),
            outcome: Some(outcome.into()),
            owner_epoch: Some(1),
            execution_generation: Some(1),
            result_json: Some(result.to_string()),
            created_at: 1.0,
            updated_at: 2.0,
        }
    }

    /// Only a refusal of the ledger itself lets a room try its task again under a new
    /// generation; a storage failure may have committed the admission.
    #[test]
    fn only_a_ledger_refusal_is_not_admitted() {
        for refused in [
            GatewayError::RuntimeDraining,
            GatewayError::SessionBusy("full".into()),
            GatewayError::StaleEpoch,
            GatewayError::AdmissionConflict("other text".into()),
        ] {
            assert!(refused_before_commit(&refused), "{refused}");
        }
        for unknown in [
            GatewayError::StorageUnavailable,
            GatewayError::Internal("commit failed".into()),
        ] {
            assert!(!refused_before_commit(&unknown), "{unknown}");
        }
    }

    /// The callback and the observation settle the same attempt from the same ledger row; the
    /// second must be an idempotent replay of the first, so both write the same result.
    #[test]
    fn history_and_callback_settle_a_row_identically() {
        for row in [
            row(
                "completed",
                json!({"final_response": "done", "completed": true}),
            ),
            row(
                "failed",
                json!({"failed": true, "error": "model said 500", "reason": "model"}),
            ),
        ] {
            let history = history_message(&row).expect("a receipt");
            let from_history = settlement_from_history(&history);
            let from_callback = settlement_from_receipt(&receipt_of(&row), "t-9", 3);
            assert_eq!(from_history.settlement_id, from_callback.settlement_id);
            assert_eq!(from_history.status, from_callback.status);
            assert_eq!(from_history.result, from_callback.result, "{row:?}");
        }
    }

    /// A stop is acknowledged by an attempt that ended by a stop, not by one that completed
    /// or failed with a reply the room records (that recorded the task cancelled and dropped
    /// the reply).
    #[test]
    fn only_an_attempt_ended_by_a_stop_acknowledges_one() {
        let completed = row(
            "completed",
            json!({"final_response": "done", "completed": true}),
        );
        let failed = row(
            "failed",
            json!({"failed": true, "error": "500", "reason": "model"}),
        );
        for ended in [&completed, &failed] {
            assert!(history_message(ended).is_some());
            assert!(!stopped(ended), "{ended:?}");
        }
        for outcome in ["cancelled", "interrupted"] {
            assert!(stopped(&row(outcome, json!({}))), "{outcome}");
        }
    }

    #[test]
    fn input_ids_carry_task_and_generation() {
        assert_eq!(
            parse_input_id("room/r1/t-9/3"),
            Some(("t-9".to_string(), 3))
        );
        assert_eq!(parse_input_id("other"), None);
        assert_eq!(parse_input_id("room/r1/t/x"), None);
    }
}
