//! One attempt (`Turn`): model → tool calls → model … until the model stops, persisting messages
//! as it goes (a crash loses at most the step in flight). Prompts park the turn inside the tool
//! call; an interrupt (flag first, then prompts) ends it without running anything further.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use actix::Addr;
use serde_json::value::RawValue;
use serde_json::{json, Value};
use tokio::sync::{oneshot, watch};

use super::{compress, tokens, transcript};
use crate::config::ApprovalMode;
use crate::error::{GatewayError, StoreError};
use crate::model::{ChatCall, ChatResponse, DeltaSink, ModelError, StreamEvent, ToolCall};
use crate::session::prompts::{Answer, OpenPrompt, PromptAnswer, PromptKind};
use crate::session::shared::Shared;
use crate::session::supervisor::{
    Committed, Emit, PromptUnrecorded, RecordNow, RecordingPrompt, RegisterPrompt, RetirePrompt,
    SessionSupervisor,
};
use crate::store::events::{self, NewEvent};
use crate::store::messages::{self, NewMessage};
use crate::store::prompts as prompt_store;
use crate::store::sessions::{self, Compaction, SessionRow};
use crate::tools::guard::{names_gateway_process, touches_gateway_state};
use crate::tools::{self, danger, CommandSpec, RunCommand, StartBackground};

/// How an attempt ended.
#[derive(Debug, Clone)]
pub enum TurnOutcome {
    /// The model gave a final answer (written with the settlement).
    Completed { final_message: NewMessage },
    /// Interrupted by a decision (stop, interrupt): settles `interrupted`.
    Interrupted { reason: String },
    /// Failed with an error visible in the transcript and the receipt.
    Failed { error: String, reason: &'static str },
    /// The attempt lost its fence (another process owns the ledger): nothing more is written.
    Stale,
}

/// Everything one attempt needs.
pub struct TurnCtx {
    pub shared: Arc<Shared>,
    pub root_id: String,
    pub admission_id: String,
    pub generation: i64,
    pub text: String,
    pub cancel: watch::Receiver<bool>,
    pub sup: Addr<SessionSupervisor>,
    /// Token usage of this attempt's model calls (prompt, completion), settled with the turn.
    pub usage: Arc<std::sync::Mutex<(i64, i64)>>,
    /// Results of tools that ran but whose write failed: the settlement closes the transcript
    /// with them (a stub saying the tool did not run invited the model to run it again).
    pub unrecorded: Arc<std::sync::Mutex<Vec<NewMessage>>>,
    /// What the attempt starts from, when the claim read it (see [`TurnStart::read`]); else the
    /// attempt reads it itself. Boxed: a parked turn's future holds its context, and two
    /// session rows inline cost every parked session 4 KiB (measured by the bench).
    pub start: Option<Box<TurnStart>>,
}

/// What an attempt starts from: the session, its tip and the tip's live transcript (whose last
/// row is the user message its claim wrote).
pub struct TurnStart {
    root: SessionRow,
    tip: SessionRow,
    rows: Vec<messages::MessageRow>,
}

/// The longest transcript the claim reads for its turn on the writer, inside its transaction:
/// every commit waits while the writer reads, and a transcript's rows cost it about 7,000
/// instructions each, so a longer one is read by the turn itself, through a reader.
pub const WRITER_READ_ROWS: i64 = 128;

impl TurnStart {
    /// [`TurnStart::read`], unless the transcript has more than `max_rows` live messages
    /// (`None`: the turn reads it itself; with `max_rows` 0, nothing is read). A longer
    /// transcript costs the reading of `max_rows + 1` rows, however long it is.
    pub fn read_bounded(
        c: &mut diesel::sqlite::SqliteConnection,
        root_id: &str,
        max_rows: i64,
    ) -> Result<Option<Box<TurnStart>>, StoreError> {
        if max_rows <= 0 {
            return Ok(None);
        }
        let root = sessions::root_of(c, root_id)?;
        let tip = Self::tip_of(c, &root)?;
        let rows = messages::live_up_to(c, &tip.id, max_rows + 1)?;
        if rows.len() as i64 > max_rows {
            return Ok(None);
        }
        Ok(Some(Box::new(TurnStart { root, tip, rows })))
    }

    /// Read it. The writer does so inside the claim's own transaction, right after the claim,
    /// where the pages are the ones the claim just wrote: the attempt then skips a round trip
    /// through a reader, whose page cache every commit has reset.
    pub fn read(
        c: &mut diesel::sqlite::SqliteConnection,
        root_id: &str,
    ) -> Result<Box<TurnStart>, StoreError> {
        let root = sessions::root_of(c, root_id)?;
        let tip = Self::tip_of(c, &root)?;
        let rows = messages::live(c, &tip.id)?;
        Ok(Box::new(TurnStart { root, tip, rows }))
    }

    fn tip_of(
        c: &mut diesel::sqlite::SqliteConnection,
        root: &SessionRow,
    ) -> Result<SessionRow, StoreError> {
        // Until its first compression a session is its own tip.
        let tip = if root.tip_session_id == root.id {
            root.clone()
        } else {
            sessions::find(c, &root.tip_session_id)?
                .ok_or_else(|| StoreError::NotFound(root.tip_session_id.clone()))?
        };
        Ok(tip)
    }
}

enum Stop {
    Outcome(TurnOutcome),
}

/// Reads of a turn's start tried again after a passing failure, and the first wait (doubled
/// each time: 0.2, 0.4, 0.8, 1.6 s).
const LOAD_TRIES: u32 = 4;
const LOAD_RETRY_FIRST: Duration = Duration::from_millis(100);

/// A failure of the store that may pass: no refusal, no missing row, no damaged file, no row
/// that does not read back.
fn passing(e: &StoreError) -> bool {
    use diesel::result::Error as D;
    match e {
        StoreError::Pool(_) | StoreError::Other(_) => !e.is_corrupt(),
        StoreError::Database(D::NotFound | D::DeserializationError(_)) => false,
        StoreError::Database(_) => !e.is_corrupt(),
        _ => false,
    }
}

/// The turn of `ctx` is interrupted, or the gateway's drain has begun.
fn stopping(ctx: &TurnCtx) -> bool {
    *ctx.cancel.borrow() || ctx.shared.runtime.turns_stopping()
}

/// After failure `e` of the store in the turn of `ctx`, with `tries` made so far: one that may
/// pass is waited out, backing off (an interrupt, a drain's too, ends the wait), and it is
/// tried again (true); not when it may not pass, the tries are spent, or the turn stops.
async fn waited_to_retry(ctx: &TurnCtx, e: &StoreError, tries: &mut u32, what: &str) -> bool {
    if !passing(e) || *tries >= LOAD_TRIES || stopping(ctx) {
        return false;
    }
    *tries += 1;
    let wait = LOAD_RETRY_FIRST.saturating_mul(1 << *tries);
    tracing::warn!(session = %ctx.root_id, error = %e, ?wait, "{what}; trying again");
    let mut cancel = ctx.cancel.clone();
    tokio::select! {
        () = tokio::time::sleep(wait) => {}
        () = cancelled(&mut cancel) => {}
    }
    true
}

impl From<StoreError> for Stop {
    fn from(e: StoreError) -> Self {
        if e.is_stale() {
            return Stop::Outcome(TurnOutcome::Stale);
        }
        Stop::Outcome(TurnOutcome::Failed {
            error: e.to_string(),
            reason: "storage_unavailable",
        })
    }
}

/// Run one attempt to its outcome.
pub async fn run_turn(ctx: TurnCtx) -> TurnOutcome {
    let mut turn = match Turn::load(ctx).await {
        Ok(t) => t,
        Err(Stop::Outcome(o)) => return o,
    };
    match turn.run().await {
        Ok(o) | Err(Stop::Outcome(o)) => o,
    }
}

/// What a turn uses of its session's row: its launch policy. Not the row, which a parked turn
/// would hold whole for its lifetime (ids, digest, title, a copy of the system prompt).
struct Launch {
    profile: String,
    model: String,
    provider: String,
    base_url: Option<String>,
    source: String,
    principal_id: String,
    cwd: String,
}

impl From<SessionRow> for Launch {
    fn from(row: SessionRow) -> Self {
        Launch {
            profile: row.profile,
            model: row.model,
            provider: row.provider,
            base_url: row.base_url,
            source: row.source,
            principal_id: row.principal_id,
            cwd: row.cwd,
        }
    }
}

struct Turn {
    ctx: TurnCtx,
    root: Launch,
    tip: String,
    system: String,
    transcript: Vec<NewMessage>,
    tools: Vec<String>,
    compressions: u32,
    /// The transcript's length after a compaction that only cleared old tool output (no
    /// summary): a preflight clears again only once the turn has added `2 × protect_last_n`
    /// messages since (each one committed a copy of the whole transcript: one per tool round).
    cleared_at: Option<usize>,
    /// Compactions of this turn that only cleared old tool output: with the summaries asked
    /// for, at most `compression.max_attempts` (each commits a copy of the whole transcript, a
    /// new child session by default: a turn of many tool rounds made one every few rounds, some
    /// forty in one turn; counted apart from the summaries, a turn still made twice as many).
    clears: u32,
    /// A question of this turn (an approval, a clarify) timed out unanswered.
    unanswered: bool,
}

impl Turn {
    async fn load(mut ctx: TurnCtx) -> Result<Turn, Stop> {
        let TurnStart {
            root,
            tip: tip_row,
            rows,
        } = *match ctx.start.take() {
            Some(start) => start,
            None => {
                ctx.shared.metrics.turn_start_read_apart();
                let mut tries = 0;
                loop {
                    let root_id = ctx.root_id.clone();
                    match ctx
                        .shared
                        .db
                        .read(move |c| TurnStart::read(c, &root_id))
                        .await
                    {
                        Ok(start) => break start,
                        // Nothing of the turn has run yet: a passing failure of the store (its
                        // readers busy past their wait, a locked database) is tried again, not
                        // the input failed for good (it never reached the model).
                        Err(e) => {
                            let what = "the turn's transcript could not be read";
                            if !waited_to_retry(&ctx, &e, &mut tries, what).await {
                                return Err(e.into());
                            }
                        }
                    }
                }
            }
        };
        let tools = enabled_tools(&ctx.shared, &root);
        let system = match tip_row.system_prompt.clone() {
            Some(s) => s,
            None => {
                // Sessions made before the prompt was built at creation.
                let s = system_prompt_for(&ctx.shared, &root.cwd, &root.profile);
                let (id, text, epoch) = (tip_row.id.clone(), s.clone(), ctx.shared.epoch);
                ctx.shared
                    .db
                    .write(move |c| sessions::set_system_prompt(c, epoch, &id, &text))
                    .await?;
                s
            }
        };
        // The claim wrote this input's user message: it is the transcript's last row.
        let transcript: Vec<NewMessage> = rows.iter().map(NewMessage::from_row).collect();
        if transcript.last().and_then(|m| m.admission_id.as_deref())
            != Some(ctx.admission_id.as_str())
        {
            return Err(Stop::Outcome(TurnOutcome::Failed {
                error: "the input's user message is missing from the transcript".into(),
                reason: "storage_unavailable",
            }));
        }
        let mut turn = Turn {
            tip: tip_row.id,
            root: root.into(),
            system,
            transcript: Vec::new(),
            tools,
            ctx,
            compressions: 0,
            cleared_at: None,
            clears: 0,
            unanswered: false,
        };
        turn.transcript = transcript;
        Ok(turn)
    }

    /// The compactions of this turn so far, of both kinds: summaries asked for and clears of
    /// old tool output. `compression.max_attempts` bounds them together.
    fn compactions(&self) -> u32 {
        self.compressions.saturating_add(self.clears)
    }

    /// Interrupted, or the gateway's drain has begun (whose interrupt is on its way).
    fn cancelled(&self) -> bool {
        stopping(&self.ctx)
    }

    async fn persist(&mut self, rows: Vec<NewMessage>) -> Result<(), Stop> {
        let (epoch, root, generation, now) = (
            self.ctx.shared.epoch,
            self.ctx.root_id.clone(),
            self.ctx.generation,
            self.ctx.shared.now(),
        );
        let tip = self
            .ctx
            .shared
            .db
            .write(move |c| messages::append_for_attempt(c, epoch, &root, generation, &rows, now))
            .await?;
        self.tip = tip;
        Ok(())
    }

    /// The model is asked again for the same step (`why`): what it streamed for the attempt it
    /// answered is void. Said among the deltas (`retry`), so a client that showed them can say
    /// so; the deltas of the two answers ran together, as one.
    fn streamed_in_vain(&self, why: &str) {
        if self.ctx.shared.config.model.stream {
            self.emit(
                "message.delta",
                json!({"admission_id": self.ctx.admission_id, "retry": why}),
            );
        }
    }

    fn emit(&self, kind: &'static str, payload: Value) {
        self.ctx.sup.do_send(Emit { kind, payload });
    }

    fn tool_schemas(&self) -> Option<Value> {
        let list: Vec<Value> = self.tools.iter().filter_map(|t| tools::schema(t)).collect();
        if list.is_empty() {
            None
        } else {
            Some(Value::Array(list))
        }
    }

    /// The session's model's context window: its profile's `context_length`, else (for the
    /// default model) `model.context_length`, else the limits file, else 128K (less when the
    /// model's overflow errors said so: see `learn_window`).
    fn context(&self) -> u64 {
        let configured = self.configured_window();
        let limit = tokens::context_limit(
            configured,
            &self.ctx.shared.home,
            &self.root.provider,
            &self.root.model,
        );
        // What the model's own overflow errors said, unless the operator gave the window.
        match configured {
            Some(_) => limit,
            None => tokens::learned(&self.root.provider, self.endpoint_url(), &self.root.model)
                .map_or(limit, |learned| learned.min(limit)),
        }
    }

    /// The window the config gives the session's model: its profile's `context_length`, else
    /// (for the default model) `model.context_length`. A profile's window is its model's: a
    /// session that named another model has not got it.
    fn configured_window(&self) -> Option<u64> {
        let c = &self.ctx.shared.config;
        let default_model = c.default_endpoint().model;
        c.profiles
            .get(&self.root.profile)
            .filter(|p| p.model.as_deref().unwrap_or(&default_model) == self.root.model)
            .and_then(|p| p.context_length)
            .or_else(|| {
                (self.root.model == default_model)
                    .then_some(c.model.context_length)
                    .flatten()
            })
            .filter(|c| *c > 0)
    }

    /// The session's model endpoint's base URL, as the learned windows are keyed.
    fn endpoint_url(&self) -> &str {
        self.root.base_url.as_deref().unwrap_or("")
    }

    /// After an overflow error whose text names the model's window: learn it, when the
    /// operator did not give one and it is smaller than the window taken so far; whether the
    /// window changed.
    fn learn_window(&self, detail: &str) -> bool {
        let Some(limit) = tokens::limit_in_error(detail) else {
            return false;
        };
        if self.configured_window().is_some() || limit >= self.context() {
            return false;
        }
        let learned = tokens::learn(
            &self.root.provider,
            self.endpoint_url(),
            &self.root.model,
            limit,
        );
        if learned {
            tracing::info!(model = %self.root.model, window = limit,
                "the model's context window, from its overflow error: compaction now keeps within it");
        }
        learned
    }

    fn threshold(&self) -> u64 {
        let c = &self.ctx.shared.config;
        tokens::threshold(
            self.context(),
            c.compression.threshold,
            c.compression.threshold_tokens,
            c.model.max_tokens,
        )
    }

    async fn run(&mut self) -> Result<TurnOutcome, Stop> {
        let shared = self.ctx.shared.clone();
        let cfg = &shared.config;
        let max_iterations = cfg.agent.max_iterations;
        let max_compressions = cfg.compression.max_attempts;
        let mut threshold = self.threshold();
        let mut iterations = 0u32;
        let mut retry = Retries::default();
        loop {
            if self.cancelled() {
                return Ok(interrupted());
            }
            let tools = if iterations >= max_iterations {
                None
            } else {
                self.tool_schemas()
            };
            let mut wire = transcript::wire_messages(Some(&self.system), &self.transcript);
            if !retry.partial.is_empty() {
                // An answer cut off by the output limit goes on from where it stopped.
                wire.push(json!({"role": "assistant", "content": retry.partial}));
                wire.push(json!({"role": "user", "content": CONTINUE_NOTE}));
            }
            if iterations >= max_iterations {
                wire.push(json!({"role": "user", "content": "You have reached the maximum number of tool-calling \
                    iterations for this turn. Give your final response now, without calling any more tools."}));
            }
            // Preflight: compress before a request that would pass the threshold (not again in
            // a turn whose summary failed: the request goes as it is, and an overflow says
            // whether it fits; after "nothing to compact", again once the transcript has grown,
            // or a turn that began with nothing to compact grew without bound). After a tool
            // round, the usage the model reported counts too (the post-tool trigger): a
            // provider's tokens can outnumber the estimate's characters by four.
            let reported = retry.reported_before_tools.take();
            if cfg.compression.enabled
                && !retry.compaction_failed
                && retry
                    .nothing_to_compact_at
                    .is_none_or(|len| self.transcript.len() > len)
                && self.compactions() < max_compressions
                && (reported.is_some_and(|r| r >= threshold)
                    || tokens::estimate_request(&wire, tools.as_ref()) >= threshold)
                && self.transcript.len()
                    > cfg.compression.protect_first_n + cfg.compression.protect_last_n + 1
            {
                match self.compact(threshold, true, true).await {
                    Ok(()) => {
                        // Shorter now: the next look is not put off by an earlier "nothing".
                        retry.nothing_to_compact_at = None;
                        continue;
                    }
                    Err(CompactError::Stop(s)) => return Err(*s),
                    Err(CompactError::Nothing) => {
                        tracing::debug!("preflight compression found nothing to compact");
                        retry.nothing_to_compact_at = Some(self.transcript.len());
                    }
                    Err(CompactError::Failed(e)) => {
                        tracing::warn!(error = %e, "preflight compression failed; sending as is");
                        retry.compaction_failed = true;
                    }
                }
            }
            let mut response = match self.call_model(wire, tools).await {
                Ok(r) => r,
                Err(ModelError::Interrupted) => return Ok(interrupted()),
                Err(ModelError::ContextOverflow(detail)) => {
                    self.ctx.shared.metrics.model_error("context_overflow");
                    if self.learn_window(&detail) {
                        threshold = self.threshold();
                    }
                    // Compression turned off is off here too: no summary model is asked (its
                    // cost, or the conversation sent to its endpoint, is what the operator said
                    // no to) and no child session is made.
                    if !cfg.compression.enabled {
                        return Ok(TurnOutcome::Failed {
                            error: format!(
                                "context_overflow: {detail}; compression is turned off (compression.enabled)"
                            ),
                            reason: "context_overflow",
                        });
                    }
                    if self.compactions() >= max_compressions {
                        return Ok(TurnOutcome::Failed {
                            error: format!(
                                "context_overflow: max compression attempts ({}) reached; the conversation does not fit the model",
                                self.compactions()
                            ),
                            reason: "context_overflow",
                        });
                    }
                    // A summary that failed in this turn is not asked for again (it is asked
                    // once per turn): old tool output may still be cleared, else the turn fails.
                    let summarise = !retry.compaction_failed;
                    match self.compact(threshold, false, summarise).await {
                        Ok(()) => {
                            retry.nothing_to_compact_at = None;
                            continue;
                        }
                        Err(CompactError::Nothing) if !summarise => {
                            return Ok(TurnOutcome::Failed {
                                error: format!(
                                    "context_overflow: {detail}; the summary failed earlier in this turn"
                                ),
                                reason: "context_overflow",
                            })
                        }
                        Err(CompactError::Stop(s)) => return Err(*s),
                        Err(e @ (CompactError::Failed(_) | CompactError::Nothing)) => {
                            return Ok(TurnOutcome::Failed {
                                error: format!(
                                    "context_overflow: {detail}; compression failed: {e}"
                                ),
                                reason: "context_overflow",
                            })
                        }
                    }
                }
                Err(e) => {
                    self.ctx.shared.metrics.model_error(e.class());
                    // A model endpoint that still limits the rate after the retries says so in
                    // the receipt (a chat completion answers it 429, which clients back off on).
                    let reason = if matches!(e, ModelError::RateLimited(_)) {
                        "rate_limited"
                    } else {
                        "model_error"
                    };
                    return Ok(TurnOutcome::Failed {
                        error: format!("model request failed: {e}"),
                        reason,
                    });
                }
            };
            if let Some(u) = response.usage {
                // Written with the settlement (one commit fewer per call).
                if let Ok(mut total) = self.ctx.usage.lock() {
                    total.0 += u.prompt_tokens;
                    total.1 += u.completion_tokens;
                }
            }
            let final_answer = response.tool_calls.is_empty() || iterations >= max_iterations;
            if response.finish_reason == "length" {
                if !final_answer {
                    // Its calls' arguments may be cut anywhere: none of them is run.
                    return Ok(TurnOutcome::Failed {
                        error:
                            "model request failed: the response was cut off by the output limit \
                                (finish_reason length) in the middle of its tool calls"
                                .into(),
                        reason: "model_error",
                    });
                }
                // Cut off before any of the answer came (a reasoning model that spent the whole
                // output limit thinking): asking again sent the same request, up to seven times
                // at the full limit each, and then "completed" with no answer.
                let progress = response.content.as_deref().is_some_and(|c| !c.is_empty());
                if !progress && retry.partial.is_empty() {
                    return Ok(TurnOutcome::Failed {
                        error: "model request failed: the output limit was reached before any \
                                answer came (finish_reason length)"
                            .into(),
                        reason: "model_error",
                    });
                }
                // A continuation that added nothing ends the answer where it stopped.
                if progress && retry.continuations < MAX_MODEL_RETRIES {
                    retry.continuations += 1;
                    retry
                        .partial
                        .push_str(response.content.as_deref().unwrap_or(""));
                    retry
                        .partial_reasoning
                        .push_str(response.reasoning.as_deref().unwrap_or(""));
                    continue;
                }
            }
            if final_answer {
                // An interrupt acknowledged while the answer came wins over it, as it does over
                // an approval that raced it (the client was told the turn was interrupted, and
                // it settled `completed`).
                if self.cancelled() {
                    return Ok(interrupted());
                }
                let mut text = retry.partial.clone();
                text.push_str(response.content.as_deref().unwrap_or(""));
                let (mut content, thoughts) = split_think(&text);
                if content.is_empty() && response.finish_reason == "content_filter" {
                    // Withheld, not forgotten: asking again gets the same, and an empty
                    // "completed" answer hid why.
                    return Ok(TurnOutcome::Failed {
                        error: "model request failed: the model's answer was withheld by its \
                                content filter (finish_reason content_filter)"
                            .into(),
                        reason: "model_error",
                    });
                }
                if content.is_empty() {
                    // An empty answer is asked for again; then the last words that came with
                    // tool calls, if any, stand for it.
                    if retry.empty < MAX_MODEL_RETRIES {
                        retry.empty += 1;
                        self.streamed_in_vain("empty_answer");
                        continue;
                    }
                    content = retry.tool_content.take().unwrap_or_default();
                }
                return Ok(TurnOutcome::Completed {
                    final_message: NewMessage {
                        role: "assistant".into(),
                        content: Some(content),
                        // Thinking in `<think>` blocks is kept as the reasoning when no
                        // reasoning field came (it was dropped).
                        reasoning: retry
                            .reasoning_with(response.reasoning.take())
                            .or_else(|| (!thoughts.is_empty()).then_some(thoughts)),
                        finish_reason: Some(response.finish_reason.clone()),
                        admission_id: Some(self.ctx.admission_id.clone()),
                        ..Default::default()
                    },
                });
            }
            let unparsable = response
                .tool_calls
                .iter()
                .any(|c| !arguments_are_an_object(&c.function.arguments));
            if unparsable && retry.bad_arguments < MAX_MODEL_RETRIES {
                // Asked again before anything is kept; past the retries each bad call's result
                // says what was wrong.
                retry.bad_arguments += 1;
                self.streamed_in_vain("unparsable_tool_arguments");
                continue;
            }
            if !retry.partial.is_empty() {
                // The continuation of a cut-off answer made tool calls: the answer so far is
                // this message's text, and nothing is cut off any more.
                let mut text = std::mem::take(&mut retry.partial);
                text.push_str(response.content.as_deref().unwrap_or(""));
                response.content = Some(text);
                response.reasoning = retry.reasoning_with(response.reasoning.take());
            }
            if let Some(text) = response.content.as_deref().map(strip_think) {
                if !text.is_empty() {
                    retry.tool_content = Some(text);
                }
            }
            iterations += 1;
            let known = response
                .tool_calls
                .iter()
                .any(|c| self.tool_named(&c.function.name).is_some());
            let reported = response.usage.map(|u| {
                u.prompt_tokens
                    .max(0)
                    .saturating_add(u.completion_tokens.max(0)) as u64
            });
            if let Some(outcome) = self.run_tools(response).await? {
                return Ok(outcome);
            }
            retry.reported_before_tools = reported;
            retry.unknown_rounds = if known { 0 } else { retry.unknown_rounds + 1 };
            if retry.unknown_rounds >= MAX_MODEL_RETRIES {
                return Ok(TurnOutcome::Failed {
                    error: format!(
                        "model request failed: the model called only tools that do not exist, \
                         {MAX_MODEL_RETRIES} times in a row (available: {})",
                        self.tools.join(", ")
                    ),
                    reason: "model_error",
                });
            }
        }
    }

    /// The offered tool `name` means: its own name, else one that differs only in case.
    fn tool_named(&self, name: &str) -> Option<&str> {
        self.tools
            .iter()
            .find(|t| *t == name)
            .or_else(|| self.tools.iter().find(|t| t.eq_ignore_ascii_case(name)))
            .map(String::as_str)
    }

    async fn call_model(
        &self,
        wire: Vec<Value>,
        tools: Option<Value>,
    ) -> Result<ChatResponse, ModelError> {
        let cfg = &self.ctx.shared.config;
        let mut body = json!({"model": self.root.model, "messages": wire});
        if let Some(t) = tools {
            body["tools"] = t;
        }
        // At most half the window, the room for the answer the threshold leaves (see
        // `tokens::threshold`): `model.max_tokens` is one setting for every model, and a prompt
        // under the threshold with all of it asked on top was refused as over the window,
        // compacted and refused again, every turn.
        if let Some(m) = cfg.model.max_tokens {
            body["max_tokens"] = json!(m.min(self.context() / 2).max(1));
        }
        // A streamed call's deltas go straight from the model client to the supervisor; a plain
        // call has none, and needs neither a channel nor a task waiting on it.
        let deltas = cfg.model.stream.then(|| {
            let sup = self.ctx.sup.clone();
            let admission = self.ctx.admission_id.clone();
            Box::new(move |ev: StreamEvent| {
                let payload = match ev {
                    StreamEvent::Content(text) => json!({"admission_id": admission, "text": text}),
                    StreamEvent::Reasoning(text) => {
                        json!({"admission_id": admission, "reasoning": text})
                    }
                    StreamEvent::ToolName(name) => json!({"admission_id": admission, "tool": name}),
                };
                sup.do_send(Emit {
                    kind: "message.delta",
                    payload,
                });
            }) as DeltaSink
        });
        let call = ChatCall {
            provider: self.root.provider.clone(),
            base_url: self.root.base_url.clone(),
            api_key: cfg.api_key_for(self.root.base_url.as_deref()),
            body,
            stream: cfg.model.stream,
            deltas,
            cancel: self.ctx.cancel.clone(),
            timeout: Duration::from_secs_f64(cfg.model.timeout_seconds),
            retry: true,
        };
        self.ctx
            .shared
            .model
            .send(call)
            .await
            .map_err(|_| ModelError::Unavailable)?
    }

    /// Persist the assistant's calls, run them in order, persist each result.
    async fn run_tools(&mut self, response: ChatResponse) -> Result<Option<TurnOutcome>, Stop> {
        // Identical calls in one response (same tool, same arguments) run once: the duplicates
        // are dropped before the assistant message is kept, so each kept call has its result.
        let mut calls: Vec<ToolCall> = response
            .tool_calls
            .iter()
            .map(|c| {
                // `Terminal` is `terminal`: the kept call names the tool that runs.
                let mut c = c.clone();
                if let Some(name) = self.tool_named(&c.function.name) {
                    c.function.name = name.to_string();
                }
                c
            })
            .collect();
        {
            // Scoped: a turn parked on one of these calls keeps none of it.
            let mut seen = std::collections::HashSet::new();
            let first: Vec<bool> = calls
                .iter()
                .map(|c| seen.insert((c.function.name.as_str(), c.function.arguments.as_str())))
                .collect();
            let mut first = first.into_iter();
            calls.retain(|_| first.next().unwrap_or(false));
        }
        // Past the bound, calls are not kept at all: each would be sent back on every later
        // request with a result of its own (85,000 calls in one response made every later turn
        // of the session a 25 MB request). The last kept call's result says so.
        let dropped = calls.len().saturating_sub(MAX_TOOL_CALLS_PER_RESPONSE);
        calls.truncate(MAX_TOOL_CALLS_PER_RESPONSE);
        unique_call_ids(&mut calls);
        // Kept (and sent back on every later request) with arguments that are a JSON object
        // whatever the model wrote: a provider that reads them (vLLM, llama.cpp's templates)
        // refused every later request of the session over one call's bad arguments. The call
        // runs with what the model wrote (`written`: none where that is what is kept), and its
        // result says what was wrong.
        let written: Vec<Option<String>> = calls
            .iter_mut()
            .map(|c| {
                let arguments = &mut c.function.arguments;
                let kept = if arguments.trim().is_empty() {
                    "{}".to_string()
                } else if arguments_are_an_object(arguments) {
                    return None;
                } else {
                    object_arguments(arguments)
                };
                Some(std::mem::replace(arguments, kept))
            })
            .collect();
        let assistant = NewMessage {
            role: "assistant".into(),
            content: response.content.clone(),
            reasoning: response.reasoning.clone(),
            tool_calls: Some(serde_json::to_string(&calls).unwrap_or_else(|_| "[]".into())),
            finish_reason: Some(response.finish_reason.clone()),
            admission_id: Some(self.ctx.admission_id.clone()),
            ..Default::default()
        };
        self.persist(vec![assistant.clone()]).await?;
        self.transcript.push(assistant);
        let last = calls.len().saturating_sub(1);
        for (n, (call, written)) in calls.into_iter().zip(written).enumerate() {
            if self.cancelled() {
                return Ok(Some(interrupted()));
            }
            let arguments = written.as_deref().unwrap_or(&call.function.arguments);
            // Shown with secrets masked, as the command's prompt and output are.
            let shown = tools::redact::redact_json_text(arguments);
            self.emit("tool.start", json!({"tool_call_id": call.id, "name": call.function.name, "arguments": truncate(&shown, 2000)}));
            let (result, stopped) = match self.execute(&call.function.name, arguments).await {
                ToolResult::Output(text) => (text, false),
                ToolResult::InterruptedRunning(text) => (text, true),
                ToolResult::Interrupted => {
                    // Its `tool.start` is in the log: so is how it ended, before the
                    // settlement's events.
                    let name = &call.function.name;
                    self.record_event(
                        "tool.complete",
                        json!({"tool_call_id": call.id, "name": name, "interrupted": true,
                            "result": format!("[Tool execution cancelled: {name} did not run because the turn was interrupted]")}),
                    )
                    .await;
                    return Ok(Some(interrupted()));
                }
            };
            self.emit("tool.complete", json!({"tool_call_id": call.id, "name": call.function.name, "result": truncate(&result, 2000)}));
            let result = if n == last && dropped > 0 {
                format!(
                    "{result}\n[{dropped} more tool calls of this response were not run: a \
                     response may make at most {MAX_TOOL_CALLS_PER_RESPONSE}. Make them in a later \
                     response if they are still needed.]"
                )
            } else {
                result
            };
            self.keep_result(&call, result).await?;
            if stopped {
                return Ok(Some(interrupted()));
            }
        }
        Ok(None)
    }

    /// Persist `result` as the result of `call`, and add it to the transcript.
    async fn keep_result(&mut self, call: &ToolCall, result: String) -> Result<(), Stop> {
        let msg = NewMessage {
            role: "tool".into(),
            content: Some(result),
            tool_call_id: Some(call.id.clone()),
            tool_name: Some(call.function.name.clone()),
            admission_id: Some(self.ctx.admission_id.clone()),
            ..Default::default()
        };
        if let Err(stop) = self.persist(vec![msg.clone()]).await {
            if let Ok(mut unrecorded) = self.ctx.unrecorded.lock() {
                unrecorded.push(msg);
            }
            return Err(stop);
        }
        self.transcript.push(msg);
        Ok(())
    }

    async fn execute(&mut self, name: &str, arguments: &str) -> ToolResult {
        if !self.tools.iter().any(|t| t == name) {
            return ToolResult::Output(format!(
                "Tool '{name}' does not exist. Available tools: {}",
                self.tools.join(", ")
            ));
        }
        let args: Value = if arguments.trim().is_empty() {
            json!({})
        } else {
            match serde_json::from_str(arguments) {
                Ok(v @ Value::Object(_)) => v,
                Ok(_) => {
                    return ToolResult::Output(format!(
                        "Error executing tool '{name}': arguments must be a JSON object of the \
                         tool's parameters"
                    ))
                }
                Err(e) => {
                    return ToolResult::Output(format!(
                        "Error executing tool '{name}': arguments are not valid JSON: {e}"
                    ))
                }
            }
        };
        match name {
            "terminal" => self.terminal(args).await,
            "clarify" => self.clarify(&args).await,
            other => ToolResult::Output(format!("Tool '{other}' is not available")),
        }
    }

    /// `args` is dropped once read: a parked approval held its map (some 600 bytes) for good.
    async fn terminal(&mut self, args: Value) -> ToolResult {
        let TerminalArgs {
            command,
            background,
            workdir,
            timeout: asked_timeout,
        } = match TerminalArgs::read(&args) {
            Ok(read) => read,
            Err(why) => return ToolResult::Output(blocked(&why)),
        };
        drop(args);
        if command.len() > MAX_COMMAND_BYTES {
            return ToolResult::Output(blocked(&format!(
                "the command is over {MAX_COMMAND_BYTES} bytes: write a script file and run that"
            )));
        }
        let shared = self.ctx.shared.clone();
        let cfg = &shared.config;
        // Where it runs is part of what is approved: `rm -rf *` means something else in `/`.
        // A relative `workdir` is under the session's directory (it was dropped, and the command
        // ran somewhere the model did not ask for).
        let user_home = std::env::var("HOME").ok();
        // The command's directory, and what the rules read of the paths around it, looked at
        // off this thread: it runs every session's supervisor, and a `stat` on a mount that
        // stopped answering hung them all.
        let looked = {
            let (session_dir, fallback) = (PathBuf::from(&self.root.cwd), self.fallback_cwd());
            let (command, home) = (command.clone(), shared.home.clone());
            let user_home = user_home.clone();
            off_thread(move || {
                let session_cwd = if session_dir.is_dir() {
                    session_dir
                } else {
                    fallback
                };
                let cwd = workdir
                    .filter(|w| !w.trim().is_empty())
                    .map(|w| session_cwd.join(w))
                    .unwrap_or(session_cwd);
                let hardline = danger::is_hardline_in(&command, &cwd, user_home.as_deref());
                let state = touches_gateway_state(&command, &cwd, &home, user_home.as_deref());
                (cwd, hardline, state)
            })
            .await
        };
        let Some((cwd, hardline_in, gateway_state)) = looked else {
            return ToolResult::Output(not_run(&format!(
                "the working directory did not answer within {} s (a mount that stopped \
                 answering?): the command was not run",
                FS_LOOK_TIMEOUT.as_secs()
            )));
        };
        let (hardline, mut matched) = danger::assess(&command);
        if let Some(m) = hardline.or(hardline_in) {
            return ToolResult::Output(blocked(&format!(
                "BLOCKED: this command is never allowed ({}). Do NOT retry it.",
                m.description
            )));
        }
        if gateway_state {
            matched.push(danger::GATEWAY_STATE);
        }
        if names_gateway_process(&command, std::process::id()) {
            matched.push(danger::GATEWAY_PROCESS);
        }
        // A process left running outlives the turn and its time limit: a human says so each
        // time (an approval of the command for the session does not cover it).
        // So does a command that leaves one running itself (`server >/dev/null 2>&1 &`): it
        // went past this question, run in the foreground.
        let leaves_running = background || danger::leaves_running(&command);
        if leaves_running {
            matched.push(danger::BACKGROUND);
        }
        if let Some(first) = matched.first() {
            let keys: Vec<&'static str> = matched.iter().map(|m| m.key).collect();
            let mut descriptions: Vec<&'static str> = Vec::new();
            for m in &matched {
                if !descriptions.contains(&m.description) {
                    descriptions.push(m.description);
                }
            }
            let all = descriptions.join("; ");
            match cfg.approvals.mode_for(&self.root.source) {
                ApprovalMode::Off => {}
                ApprovalMode::Deny => {
                    return ToolResult::Output(blocked(&format!(
                        "BLOCKED: dangerous commands are denied by policy ({all}). Do NOT retry."
                    )))
                }
                ApprovalMode::Manual => {
                    // Every rule the command matches must be approved: a session approval of
                    // one (`rm -rf build`) does not let another ride along with it
                    // (`rm -rf dist && git push --force`).
                    // What an approval for the session (or for good) is kept as: the rule, or
                    // for an interpreter's inline code the rule and this very code.
                    let approval_keys: Vec<String> =
                        keys.iter().map(|k| approval_key(k, &command)).collect();
                    let (root, wanted) = (self.ctx.root_id.clone(), approval_keys.clone());
                    let principal = self.root.principal_id.clone();
                    // What reaches the gateway itself is approved one command at a time: a
                    // session approval of a read (`cat config.yaml`) let `: > state.db` through.
                    // Shown with its secrets masked: the prompt goes to the event log, every
                    // follower and each snapshot (what runs is the command itself). A masked
                    // part can hide text the approver would want to see (a "private key block"
                    // of shell lines): such a command is asked about each time, once or deny,
                    // and its prompt says part of it is hidden.
                    let shown = tools::redact::redact(&command);
                    let masked = shown != command.as_str();
                    let once_only = masked || keys.iter().any(|k| ONCE_ONLY_RULES.contains(k));
                    let approved = !once_only
                        && self
                            .ctx
                            .shared
                            .db
                            .read(move |c| {
                                for key in &wanted {
                                    if !prompt_store::is_approved(c, &root, &principal, key)? {
                                        return Ok(false);
                                    }
                                }
                                Ok(true)
                            })
                            .await
                            .unwrap_or(false);
                    if !approved {
                        let choices: Vec<String> = if once_only {
                            vec!["once".into(), "deny".into()]
                        } else {
                            vec![
                                "once".into(),
                                "session".into(),
                                "always".into(),
                                "deny".into(),
                            ]
                        };
                        let payload = json!({
                            "command": shown,
                            "masked": masked,
                            "workdir": cwd.to_string_lossy(),
                            "description": first.description,
                            "descriptions": descriptions,
                            "pattern_key": first.key,
                            "pattern_keys": keys,
                            // Left running after its call, when approved.
                            "background": leaves_running,
                        });
                        let timeout = cfg.approvals.timeout;
                        match self.ask(PromptKind::Approval, payload, choices, timeout).await {
                            Asked::Cancelled => return ToolResult::Interrupted,
                            Asked::TimedOut => {
                                return ToolResult::Output(blocked(
                                    "BLOCKED: the approval request timed out without a user response. Silence is not \
                                     consent: the command did not run. Do NOT retry it.",
                                ))
                            }
                            Asked::Unattended => {
                                return ToolResult::Output(blocked(
                                    "BLOCKED: an earlier question of this turn went unanswered, so nobody is there \
                                     to approve this command: it did not run. Do NOT retry it in this turn.",
                                ))
                            }
                            Asked::Unrecorded => {
                                return ToolResult::Output(blocked(
                                    "BLOCKED: the approval request could not be recorded (the gateway's storage \
                                     failed), so nobody was asked and the command did not run. Do NOT retry it in \
                                     this turn.",
                                ))
                            }
                            Asked::Answered(PromptAnswer::Choice(c)) if c == "deny" => {
                                return ToolResult::Output(blocked(
                                    "BLOCKED: Command denied by user. The user has NOT consented to this command. \
                                     Do NOT retry it.",
                                ))
                            }
                            Asked::Answered(PromptAnswer::Choice(c)) if c == "session" || c == "always" => {
                                let (root, now) = (self.ctx.root_id.clone(), self.ctx.shared.now());
                                let (principal, epoch) = (self.root.principal_id.clone(), self.ctx.shared.epoch);
                                let always = c == "always";
                                let remembered = self
                                    .ctx
                                    .shared
                                    .db
                                    .write(move |conn| {
                                        let keys: Vec<&str> = approval_keys.iter().map(String::as_str).collect();
                                        prompt_store::remember(conn, epoch, &root, &principal, &keys, always, now)
                                    })
                                    .await;
                                // The command runs (it was approved); a like one is asked again.
                                if let Err(e) = remembered {
                                    tracing::warn!(
                                        session = %self.ctx.root_id,
                                        choice = %c,
                                        error = %e,
                                        "an approval could not be remembered: it covers this command only"
                                    );
                                }
                            }
                            Asked::Answered(_) => {}
                        }
                    }
                }
            }
        }
        if self.cancelled() {
            return ToolResult::Interrupted;
        }
        // The model may ask for less time, never more: `terminal.timeout` is the limit (it could
        // ask for ten times as much).
        let timeout = asked_timeout
            .filter(|t| *t > 0.0)
            .map_or(cfg.terminal.timeout, |t| t.min(cfg.terminal.timeout));
        let mut spec = CommandSpec::new(command, cwd);
        spec.timeout = Duration::from_secs_f64(timeout);
        spec.output_cap = cfg.terminal.output_cap;
        spec.env_remove_prefixes = vec!["GATEHOUSE_".into(), "OPENAI_".into()];
        // What systemd hands the daemon alone: its notify socket and watchdog, sockets it
        // passed, and where its credentials are.
        spec.env_remove = [
            "ANTHROPIC_API_KEY",
            "NOTIFY_SOCKET",
            "WATCHDOG_USEC",
            "WATCHDOG_PID",
            "LISTEN_FDS",
            "LISTEN_PID",
            "LISTEN_FDNAMES",
            "CREDENTIALS_DIRECTORY",
        ]
        .map(String::from)
        .to_vec();
        if background {
            return self.background(spec).await;
        }
        let outcome = self
            .ctx
            .shared
            .terminal
            .send(RunCommand {
                spec,
                cancel: self.ctx.cancel.clone(),
            })
            .await;
        match outcome {
            // Started, then stopped: it may have done part of its work, and the transcript
            // says so (not the "did not run" of a call that never started).
            Ok(Ok(o)) if o.interrupted && o.started => {
                ToolResult::InterruptedRunning(o.to_tool_json(timeout.ceil() as u64))
            }
            Ok(Ok(o)) if o.interrupted => ToolResult::Interrupted,
            Ok(Ok(o)) => ToolResult::Output(o.to_tool_json(timeout.ceil() as u64)),
            Ok(Err(e)) => ToolResult::Output(not_run(&e.to_string())),
            Err(_) => ToolResult::Output(not_run("terminal tool unavailable")),
        }
    }

    /// Start an approved command to run on after this call (a server, a watcher): its output
    /// goes to a log the result names, and it runs until it ends, is killed, or the gateway
    /// stops.
    async fn background(&mut self, spec: CommandSpec) -> ToolResult {
        let started = self
            .ctx
            .shared
            .terminal
            .send(StartBackground {
                spec,
                cancel: self.ctx.cancel.clone(),
            })
            .await;
        match started {
            Ok(Ok(b)) => {
                let log = b.log.to_string_lossy();
                ToolResult::Output(
                    json!({
                        "output": "Background process started",
                        "session_id": b.id,
                        "pid": b.pid,
                        "exit_code": 0,
                        "error": null,
                        "log": log,
                        "note": format!(
                            "It runs on in the background. Its output (stdout and stderr) goes to \
                             {log}: read it with the terminal tool (tail -n 50 {log}). Stop it with \
                             kill -- -{}.",
                            b.pid
                        ),
                    })
                    .to_string(),
                )
            }
            Ok(Err(tools::TerminalError::Interrupted)) => ToolResult::Interrupted,
            // Its shell ran, if only for an instant: not "did not run", which invites a rerun.
            Ok(Err(e @ tools::TerminalError::InterruptedAtStart)) => {
                ToolResult::InterruptedRunning(
                    json!({"output": "", "exit_code": -1, "error": e.to_string()}).to_string(),
                )
            }
            Ok(Err(e)) => ToolResult::Output(not_run(&e.to_string())),
            Err(_) => ToolResult::Output(not_run("terminal tool unavailable")),
        }
    }

    /// Where a command runs when the session's directory is gone.
    fn fallback_cwd(&self) -> PathBuf {
        self.ctx
            .shared
            .config
            .terminal
            .cwd
            .clone()
            .unwrap_or_else(|| self.ctx.shared.home.clone())
    }

    async fn clarify(&mut self, args: &Value) -> ToolResult {
        let mut questions: Vec<(String, Vec<String>)> = Vec::new();
        let flatten_choices = |v: Option<&Value>| -> Vec<String> {
            v.and_then(|c| c.as_array())
                .map(|a| {
                    a.iter()
                        .filter_map(|c| {
                            // A choice written as a JSON object inside a string is that object.
                            let parsed = c
                                .as_str()
                                .filter(|s| s.trim_start().starts_with('{'))
                                .and_then(|s| serde_json::from_str::<Value>(s).ok())
                                .filter(Value::is_object);
                            match parsed.as_ref().unwrap_or(c) {
                                Value::String(s) => Some(s.clone()),
                                Value::Object(o) => ["label", "text", "title", "description"]
                                    .iter()
                                    .find_map(|k| {
                                        o.get(*k).and_then(|v| v.as_str()).map(str::to_string)
                                    }),
                                _ => None,
                            }
                        })
                        .filter(|s| !s.trim().is_empty())
                        .take(4)
                        .collect()
                })
                .unwrap_or_default()
        };
        // Several choices may be picked where the model asks for it (`multi_select`), of a
        // question that offers choices; a batch's question keeps the id the model gave it.
        let multi = |q: &Value| q.get("multi_select").and_then(Value::as_bool) == Some(true);
        let mut ids: Vec<String> = Vec::new();
        let mut multis: Vec<bool> = Vec::new();
        let batch = args.get("questions").and_then(|q| q.as_array()).is_some();
        if let Some(list) = args.get("questions").and_then(|q| q.as_array()) {
            for q in list.iter().take(5) {
                if let Some(text) = q.get("question").and_then(|t| t.as_str()) {
                    let choices = flatten_choices(q.get("choices"));
                    multis.push(multi(q) && !choices.is_empty());
                    // Each question's id is its own (answers are told apart by it).
                    let mut id = q
                        .get("id")
                        .and_then(Value::as_str)
                        .filter(|id| !id.trim().is_empty() && !ids.iter().any(|i| i == id))
                        .map_or_else(|| format!("q{}", questions.len()), str::to_string);
                    while ids.contains(&id) {
                        id.push('_');
                    }
                    ids.push(id);
                    questions.push((text.to_string(), choices));
                }
            }
        } else if let Some(text) = args.get("question").and_then(|t| t.as_str()) {
            let choices = flatten_choices(args.get("choices"));
            multis.push(multi(args) && !choices.is_empty());
            ids.push("q0".into());
            questions.push((text.to_string(), choices));
        }
        if questions.is_empty() {
            return ToolResult::Output(
                json!({"error": "clarify needs a `question` or a list of `questions`"}).to_string(),
            );
        }
        let payload = json!({
            "question": questions[0].0,
            "choices": questions[0].1,
            "questions": questions.iter().enumerate().map(|(i, (q, c))| json!({"id": ids[i], "question": q, "choices": c, "multi_select": multis[i]})).collect::<Vec<_>>(),
            "multi_select": multis[0],
        });
        let timeout = self.ctx.shared.config.agent.clarify_timeout;
        let (answers, timed_out): (Vec<String>, bool) = match self
            .ask(PromptKind::Clarify, payload, Vec::new(), timeout)
            .await
        {
            Asked::Cancelled => return ToolResult::Interrupted,
            Asked::TimedOut | Asked::Unattended => (Vec::new(), true),
            Asked::Unrecorded => {
                return ToolResult::Output(
                    json!({"error": "The question could not be asked: the gateway's storage failed. Use your \
                                     best judgement and proceed."})
                    .to_string(),
                )
            }
            Asked::Answered(PromptAnswer::Text(t)) | Asked::Answered(PromptAnswer::Choice(t)) => {
                // Several questions may be answered at once with a JSON list of strings.
                let many: Option<Vec<String>> = if questions.len() > 1 {
                    serde_json::from_str(&t).ok()
                } else {
                    None
                };
                (many.unwrap_or_else(|| vec![t]), false)
            }
        };
        // A multi-select answer is the list of the choices picked; any other, one text.
        let response = |i: usize, c: &[String]| -> Value {
            let typed = answers.get(i).map_or("", String::as_str);
            if multis[i] {
                Value::from(pick_many(typed, c))
            } else {
                Value::from(pick(typed, c))
            }
        };
        if !batch {
            let (q, c) = &questions[0];
            let response = if timed_out {
                Value::from(
                    "The user did not provide a response within the time limit. Use your best \
                     judgement to make the choice and proceed.",
                )
            } else {
                response(0, c)
            };
            return ToolResult::Output(
                json!({"question": q, "choices_offered": c, "user_response": response}).to_string(),
            );
        }
        let responses: Vec<Value> = questions
            .iter()
            .enumerate()
            .map(|(i, (q, c))| {
                json!({"id": ids[i], "question": q, "choices_offered": c,
                       "user_response": response(i, c)})
            })
            .collect();
        let mut out = json!({"responses": responses});
        if timed_out {
            out["timed_out"] = json!(true);
        }
        ToolResult::Output(out.to_string())
    }

    /// Park on a prompt until it is answered, times out (`timeout ≤ 0`: never) or the turn is
    /// interrupted.
    async fn ask(
        &mut self,
        kind: PromptKind,
        mut payload: Value,
        choices: Vec<String>,
        timeout: f64,
    ) -> Asked {
        // Nobody answered an earlier question of this turn: nobody is asked again in it (64
        // dangerous calls of one response each waited out `approvals.timeout`, five hours).
        if self.unanswered {
            return Asked::Unattended;
        }
        let prompt_id = uuid::Uuid::new_v4().simple().to_string();
        payload["kind"] = json!(kind.as_str());
        payload["prompt_id"] = json!(prompt_id);
        payload["execution_generation"] = json!(self.ctx.generation);
        payload["admission_id"] = json!(self.ctx.admission_id);
        if kind == PromptKind::Approval {
            payload["choices"] = json!(choices);
        }
        // The prompt is recorded open (fenced: this attempt must be the running one) before
        // anyone can see it, so every answer has its row to be recorded against.
        let (epoch, root, admission, generation, now) = (
            self.ctx.shared.epoch,
            self.ctx.root_id.clone(),
            self.ctx.admission_id.clone(),
            self.ctx.generation,
            self.ctx.shared.now(),
        );
        let shown = match serde_json::value::to_raw_value(&payload) {
            Ok(raw) => raw,
            Err(e) => {
                tracing::error!(session = %self.ctx.root_id, generation, error = %e,
                    "a prompt could not be written as JSON: not asked");
                return Asked::Unrecorded;
            }
        };
        let id = prompt_id.clone();
        // Once committed, the request can be read from the log before the prompt is handed over
        // below: an answer sent at once waits for it. Awaited: the supervisor has then queued
        // the writes of every event this turn emitted before (the call's `tool.start`), so the
        // request is logged after them (written at once, it came before its own call's start).
        let told = self
            .ctx
            .sup
            .send(RecordingPrompt {
                generation,
                prompt_id: prompt_id.clone(),
            })
            .await;
        if told.is_err() {
            // The turn runs in the supervisor's context: it is not gone while this runs.
            return Asked::Unrecorded;
        }
        let opened = self
            .ctx
            .shared
            .db
            .write(move |c| {
                prompt_store::record_open(
                    c,
                    epoch,
                    &id,
                    &root,
                    &admission,
                    generation,
                    kind.as_str(),
                    &payload,
                    now,
                )
            })
            .await;
        let mut events = match opened {
            Ok(rows) => rows,
            Err(e) => {
                self.ctx.sup.do_send(PromptUnrecorded {
                    prompt_id: prompt_id.clone(),
                });
                if e.is_stale() {
                    return Asked::Cancelled;
                }
                tracing::error!(session = %self.ctx.root_id, generation, error = %e,
                    "a prompt could not be recorded: not asked");
                return Asked::Unrecorded;
            }
        };
        let mut cancel = self.ctx.cancel.clone();
        let wait = async {
            if timeout > 0.0 {
                tokio::time::sleep(Duration::from_secs_f64(timeout)).await;
            } else {
                std::future::pending::<()>().await;
            }
        };
        tokio::pin!(wait);
        // What is shown goes to the supervisor, which hands it back with an answer the store
        // cannot record (held here as well, it cost every parked session a copy).
        let mut shown = (shown, choices);
        loop {
            let (tx, rx) = oneshot::channel();
            let open = OpenPrompt {
                prompt_id: prompt_id.clone(),
                kind,
                generation: self.ctx.generation,
                admission_id: self.ctx.admission_id.clone(),
                payload: shown.0,
                choices: shown.1,
                responder: tx,
            };
            let registered = self
                .ctx
                .sup
                .send(RegisterPrompt {
                    prompt: open,
                    events: std::mem::take(&mut events),
                })
                .await;
            match registered {
                Ok(Ok(())) => {}
                refused => {
                    let resolution = match refused {
                        Ok(Err(resolution)) => resolution,
                        _ => "turn_ended",
                    };
                    self.close_prompt(&prompt_id, resolution).await;
                    return Asked::Cancelled;
                }
            }
            // Biased: an answer that was delivered (the responder was told `resolved`) wins over
            // a timeout that became ready in the same instant.
            let result = tokio::select! {
                biased;
                answer = rx => match answer {
                    Ok(a) => Waited::Answer(a),
                    Err(_) => Waited::Over(Asked::Cancelled),
                },
                _ = &mut wait => {
                    self.ctx.sup.do_send(RetirePrompt { prompt_id: prompt_id.clone(), resolution: "timeout".into() });
                    self.unanswered = true;
                    Waited::Over(Asked::TimedOut)
                }
                _ = cancelled(&mut cancel) => {
                    self.ctx.sup.do_send(RetirePrompt { prompt_id: prompt_id.clone(), resolution: "interrupted".into() });
                    Waited::Over(Asked::Cancelled)
                }
            };
            match result {
                Waited::Answer(a) => match self.take_answer(&prompt_id, a).await {
                    Ok(asked) => return asked,
                    // Not recorded (the store failed; the answerer was told
                    // `storage_unavailable`): the prompt is open again, for the answer again,
                    // until its time is up.
                    Err(again) => shown = again,
                },
                // The interrupt flag wins over an answer that raced it.
                Waited::Over(_) if self.cancelled() => return Asked::Cancelled,
                Waited::Over(asked) => return asked,
            }
        }
    }

    /// Record an event of the attempt now, before the turn goes on (an [`Emit`]ted one is
    /// written when the supervisor gets to it, which may be after the settlement's). It goes
    /// through the supervisor all the same, so it is written after what this turn emitted
    /// before it (written straight, a tool's end could land before its start). Best effort: it
    /// tells; it changes nothing.
    async fn record_event(&self, kind: &'static str, payload: Value) {
        let recorded = match self.ctx.sup.send(RecordNow { kind, payload }).await {
            Ok(recorded) => recorded,
            // The turn runs in the supervisor's context: it is not gone while this runs.
            Err(e) => Err(StoreError::Pool(format!(
                "the session's supervisor is gone: {e}"
            ))),
        };
        if let Err(e) = recorded {
            tracing::warn!(session = %self.ctx.root_id, event = kind, error = %e,
                "cannot record an event of the attempt")
        }
    }

    /// Write with `f` on the writer, and hand the events it committed to the supervisor, for
    /// its subscribers in their order.
    async fn commit_events<F>(&self, f: F) -> Result<(), StoreError>
    where
        F: FnOnce(
                &mut diesel::sqlite::SqliteConnection,
            ) -> Result<Vec<events::EventRow>, StoreError>
            + Send
            + 'static,
    {
        let rows = self.ctx.shared.db.write(f).await?;
        self.ctx.sup.do_send(Committed { rows });
        Ok(())
    }

    /// Record how a prompt this attempt opened ended when no one else will: it was refused
    /// as the attempt stopped. Best effort: a boot closes what is left open.
    async fn close_prompt(&self, prompt_id: &str, resolution: &'static str) {
        let (id, now, epoch) = (
            prompt_id.to_string(),
            self.ctx.shared.now(),
            self.ctx.shared.epoch,
        );
        let closed = self
            .commit_events(move |c| {
                prompt_store::record_resolution(c, epoch, &id, resolution, "gateway", now)
            })
            .await;
        if let Err(e) = closed {
            tracing::warn!(session = %self.ctx.root_id, prompt = %prompt_id, error = %e,
                "cannot record how a prompt ended; the next start closes it")
        }
    }

    /// Record a human's answer before acting on it, fenced in the store by this attempt's
    /// generation and the epoch: an answer that cannot be recorded is never acted on, and the
    /// audit says what the attempt did with it. The answerer is told which. `Err`: the store
    /// could not record it, and the prompt stays open (what it shows, to show it again).
    async fn take_answer(
        &mut self,
        prompt_id: &str,
        answer: Answer,
    ) -> Result<Asked, (Box<RawValue>, Vec<String>)> {
        let Answer {
            answer,
            by,
            taken,
            payload,
            choices,
        } = answer;
        let (epoch, root, generation, now) = (
            self.ctx.shared.epoch,
            self.ctx.root_id.clone(),
            self.ctx.generation,
            self.ctx.shared.now(),
        );
        let (id, resolution) = (prompt_id.to_string(), answer.resolution());
        let (runtime, cancel) = (self.ctx.shared.runtime.clone(), self.ctx.cancel.clone());
        let written = self
            .ctx
            .shared
            .db
            .write(move |c| {
                // The interrupt flag wins over an answer that raced it: the prompt ends as the
                // attempt did (the stop's prompts end `shutdown`). Looked at as the write runs,
                // not as it was asked for: an interrupt that came while the answer waited for the
                // writer (an interrupt is handed to the session at once) ends the prompt instead.
                let ended = stop_resolution(*cancel.borrow(), runtime.turns_stopping());
                let rows = match ended {
                    Some(ended) => {
                        prompt_store::record_resolution(c, epoch, &id, ended, "gateway", now)?
                    }
                    None => prompt_store::record_answer(
                        c,
                        epoch,
                        &root,
                        generation,
                        &id,
                        &resolution,
                        &by,
                        now,
                    )?,
                };
                Ok((rows, ended.is_some()))
            })
            .await;
        let (asked, told) = match written {
            Ok((rows, ended)) => {
                self.ctx.sup.do_send(Committed { rows });
                // Recorded, and the attempt stopped after all (in the instant between the look
                // and the commit): not acted on, and the answerer is told so.
                if ended || self.cancelled() {
                    (
                        Ok(Asked::Cancelled),
                        Err(GatewayError::StaleGeneration(format!(
                            "generation {generation} is being interrupted"
                        ))),
                    )
                } else {
                    (Ok(Asked::Answered(answer)), Ok(()))
                }
            }
            Err(e) if e.is_stale() => {
                tracing::info!(session = %self.ctx.root_id, generation, prompt = %prompt_id, error = %e,
                    "an answer came to an attempt that no longer runs: not acted on");
                (Ok(Asked::Cancelled), Err(GatewayError::from(e)))
            }
            // Not recorded, and the attempt is stopping meanwhile: the answerer is told the
            // attempt is being stopped (not `storage_unavailable`, which asks for the answer
            // again), and the prompt is closed as the stop ends it. It was left open, taken out
            // of the supervisor's table already, and shown pending until the next start.
            Err(e) if self.cancelled() => {
                tracing::info!(session = %self.ctx.root_id, generation, prompt = %prompt_id, error = %e,
                    "an answer could not be recorded as its attempt stopped: not acted on");
                let cancel = *self.ctx.cancel.borrow();
                let stopping = self.ctx.shared.runtime.turns_stopping();
                let ended = stop_resolution(cancel, stopping).unwrap_or("interrupted");
                self.close_prompt(prompt_id, ended).await;
                (
                    Ok(Asked::Cancelled),
                    Err(GatewayError::StaleGeneration(format!(
                        "generation {generation} is being interrupted"
                    ))),
                )
            }
            Err(e) => {
                tracing::error!(session = %self.ctx.root_id, generation, prompt = %prompt_id, error = %e,
                    "an answer could not be recorded: not acted on; its prompt stays open");
                (Err((payload, choices)), Err(GatewayError::from(e)))
            }
        };
        let _ = taken.send(told);
        asked
    }

    /// Compact the transcript: summarise its middle (when `summarise`), else clear old tool
    /// output. A `preflight` clear waits for the turn to have grown since the last one (see
    /// `cleared_at`); one for an overflow does not.
    async fn compact(
        &mut self,
        threshold: u64,
        preflight: bool,
        summarise: bool,
    ) -> Result<(), CompactError> {
        let cfg = &self.ctx.shared.config;
        let c = &cfg.compression;
        let tail_budget = (threshold as f64 * 0.2) as usize;
        let pruned = compress::clear_old_tool_output(&self.transcript, c.protect_last_n);
        // A middle no larger than a summary (a short answer between the head and the latest
        // user message) is not summarised: the summary would make the transcript longer.
        let plan = compress::plan(&pruned, c.protect_first_n, c.protect_last_n, tail_budget)
            .filter(|p| summarise && compress::summary_can_shrink(p));
        let Some(plan) = plan else {
            // Nothing to summarise (too few messages, only an earlier summary, or a middle too
            // small), but old tool output cleared is still room won: kept, without a summary
            // request.
            let cleared = pruned.len() == self.transcript.len()
                && pruned
                    .iter()
                    .zip(&self.transcript)
                    .any(|(a, b)| a.content != b.content);
            let recently = self
                .cleared_at
                .is_some_and(|at| self.transcript.len() < at + 2 * c.protect_last_n.max(1));
            if cleared && !(preflight && recently) && self.compactions() < c.max_attempts {
                // A stop that began since the loop's last look commits nothing, as a summary's
                // does not: a child session made after it is a change it did not allow.
                if self.cancelled() {
                    return Err(CompactError::interrupted());
                }
                self.commit_compacted(pruned, self.system.clone()).await?;
                self.clears += 1;
                self.cleared_at = Some(self.transcript.len());
                return Ok(());
            }
            return Err(CompactError::Nothing);
        };
        // A stop that began since the loop's last look (the gateway's drain tells turns to stop
        // before each session hears it) asks no summary: no model call follows a stop.
        if self.cancelled() {
            return Err(CompactError::interrupted());
        }
        let aux = &cfg.auxiliary.compression;
        let model = aux.model.clone().unwrap_or_else(|| self.root.model.clone());
        let provider = aux
            .provider
            .clone()
            .unwrap_or_else(|| self.root.provider.clone());
        let base_url = aux.base_url.clone().or_else(|| self.root.base_url.clone());
        let mut budget = tokens::max_summary_tokens(self.context());
        // The turns sent to the summary model fit the window its overflow errors named (its
        // own, which may be smaller than the session's): the summary a quarter of it at most,
        // the turns what is left less the summary's room and the prompt's, at three characters
        // a token.
        let endpoint = base_url.clone().unwrap_or_default();
        let fit = |window: u64, budget: &mut u64| {
            *budget = (*budget).min(window / 4).max(1);
            usize::try_from(window.saturating_sub(2 * *budget + 1_000).saturating_mul(3))
                .unwrap_or(usize::MAX)
        };
        // What the prompt holds besides the turns (its words, earlier summaries at most
        // `earlier` characters): read only when a window is known or named, from the prompt
        // built with no turns.
        let rest = |earlier: usize| {
            compress::turn_chars(&compress::summary_request_within(
                &model,
                &plan.middle,
                None,
                0,
                compress::Within { turns: 0, earlier },
            ))
        };
        // Within a window's `room` the earlier summaries take half of it at most (and no more
        // than `earlier` already allowed): whole, a long one left no room for any turn, and
        // every later compaction failed. The turns take what is left.
        let within_room = |room: usize, earlier: usize| {
            let earlier = earlier.min(room / 2);
            compress::Within {
                turns: room.saturating_sub(rest(earlier)),
                earlier,
            }
        };
        let mut within = compress::Within::WHOLE;
        if let Some(window) = tokens::learned(&provider, &endpoint, &model) {
            within = within_room(fit(window, &mut budget), within.earlier);
        }
        // An attempt is a summary request: a plan with nothing to compact costs nothing.
        self.compressions += 1;
        // Keys go only to configured endpoints (the session's may be its client's choice).
        let api_key = cfg.key_for(base_url.as_deref(), || {
            aux.api_key.clone().or_else(|| cfg.api_key())
        });
        let mut asked = 0;
        let answered = loop {
            asked += 1;
            // No room for any turn: a summary of none would replace the middle with nothing.
            if within.turns == 0 {
                return Err(CompactError::Failed(format!(
                    "the summary model {model}'s window leaves no room for the turns to summarise"
                )));
            }
            let body = compress::summary_request_within(&model, &plan.middle, None, budget, within);
            let sent = compress::turn_chars(&body);
            let call = ChatCall {
                provider: provider.clone(),
                base_url: base_url.clone(),
                api_key: api_key.clone(),
                body,
                stream: false,
                deltas: None,
                cancel: self.ctx.cancel.clone(),
                timeout: Duration::from_secs_f64(aux.timeout),
                retry: false,
            };
            match self.ctx.shared.model.send(call).await {
                // Too long for the summary model: asked once more with what fits the window
                // its error names (learned for the next compactions), else with half as much.
                Ok(Err(ModelError::ContextOverflow(detail))) if asked < 2 && !self.cancelled() => {
                    // Always fewer than were sent (three quarters at most): a window learned
                    // already, with text denser than three characters a token, named the same
                    // window again and the same request was sent again.
                    let rest_sent = rest(within.earlier);
                    let turns = sent.saturating_sub(rest_sent);
                    within = match tokens::limit_in_error(&detail) {
                        Some(window) => {
                            tokens::learn(&provider, &endpoint, &model, window);
                            let sized = within_room(fit(window, &mut budget), within.earlier);
                            compress::Within {
                                turns: sized.turns.min(turns / 4 * 3),
                                ..sized
                            }
                        }
                        // Half as much of each (the earlier summaries may be most of it).
                        None => compress::Within {
                            turns: turns / 2,
                            earlier: within.earlier.min(rest_sent / 2),
                        },
                    };
                    tracing::warn!(session = %self.ctx.root_id, model = %model, chars = within.turns, earlier = within.earlier,
                        "the summary request was too long for the summary model; asking with its newest turns");
                }
                other => break other,
            }
        };
        let summary = match answered {
            // A reasoning model served without a reasoning parser thinks in `<think>` blocks:
            // the summary is what follows them (kept whole, the thoughts went into every later
            // request, and a cut over the budget could keep only them).
            Ok(Ok(r)) => {
                // The summary's tokens are the turn's too: settled with its usage.
                if let (Some(u), Ok(mut total)) = (r.usage, self.ctx.usage.lock()) {
                    total.0 += u.prompt_tokens;
                    total.1 += u.completion_tokens;
                }
                let summary = split_think(&r.content.unwrap_or_default()).0;
                // Cut short by the model's output limit: kept, and said to be (it was taken for
                // the whole summary).
                if r.finish_reason == "length" && !summary.trim().is_empty() {
                    format!("{summary}\n[The summary was cut short by the model's output limit.]")
                } else {
                    summary
                }
            }
            Ok(Err(ModelError::Interrupted)) => return Err(CompactError::interrupted()),
            Ok(Err(e)) => return Err(CompactError::Failed(format!("summary request failed: {e}"))),
            Err(_) => return Err(CompactError::Failed("model client unavailable".into())),
        };
        if summary.trim().is_empty() {
            return Err(CompactError::Failed(
                "the summary model returned nothing".into(),
            ));
        }
        // A summary model that ignores its budget does not fill the transcript it compacts
        // (7 MB kept as is made every later turn overflow): what passes 16 characters a token of
        // the budget (twice what the request's `max_tokens` allows at four a token) is cut.
        let most = usize::try_from(budget.saturating_mul(16)).unwrap_or(usize::MAX);
        let summary = match summary.char_indices().nth(most) {
            Some((cut, _)) => {
                tracing::warn!(session = %self.ctx.root_id, chars = most, "the summary was over its budget; cut");
                format!(
                    "{}\n[The summary was cut here: it was over its budget.]",
                    &summary[..cut]
                )
            }
            None => summary,
        };
        // A stop that came while the summary was made (an interrupt, a graceful stop) commits
        // nothing: it was acknowledged, and a child session made after it is a change it did
        // not allow. The summary is let go.
        if self.cancelled() {
            return Err(CompactError::interrupted());
        }
        let compacted = compress::assemble(&plan, &summary);
        let system = if self.system.contains("[Note: earlier turns") {
            self.system.clone()
        } else {
            format!(
                "{}\n\n[Note: earlier turns of this conversation were compacted into a summary.]",
                self.system
            )
        };
        match self.commit_compacted(compacted, system).await {
            // A summary was made, and is not kept (longer than the turns it summarised): a
            // failed summary, not asked for again in this turn (as "nothing to compact" it was
            // asked again after each tool round, the same turns each time).
            Err(CompactError::Nothing) => {
                return Err(CompactError::Failed(
                    "the summary was not shorter than the turns it summarised".into(),
                ))
            }
            committed => committed?,
        }
        // Shorter than when old output was last cleared: the next clear need not wait for it.
        self.cleared_at = None;
        Ok(())
    }

    /// Commit `compacted` as the live transcript (with `system`): in place, or rotated into a
    /// child session, as the config says; one transaction, fenced by epoch and generation.
    /// `Nothing` when it is not smaller than the transcript it replaces (a summary longer than
    /// the turns it summarised): committed, it made the transcript grow, in a new child session.
    async fn commit_compacted(
        &mut self,
        compacted: Vec<NewMessage>,
        system: String,
    ) -> Result<(), CompactError> {
        let size = |system: &str, t: &[NewMessage]| {
            tokens::estimate_request(&transcript::wire_messages(Some(system), t), None)
        };
        if size(&system, &compacted) >= size(&self.system, &self.transcript) {
            tracing::info!(session = %self.ctx.root_id, "the compaction would not shrink the transcript; not committed");
            return Err(CompactError::Nothing);
        }
        let c = &self.ctx.shared.config.compression;
        let compaction = Compaction {
            root_id: self.ctx.root_id.clone(),
            old_tip: self.tip.clone(),
            child_id: if c.in_place {
                None
            } else {
                Some(format!(
                    "{}-c{}",
                    self.ctx.root_id,
                    uuid::Uuid::new_v4().simple()
                ))
            },
            system_prompt: Some(system.clone()),
            messages: compacted.clone(),
        };
        let (epoch, generation, now, root) = (
            self.ctx.shared.epoch,
            self.ctx.generation,
            self.ctx.shared.now(),
            self.ctx.root_id.clone(),
        );
        // The event that tells clients of the new tip commits with it: a crash between two
        // commits lost it (found in a kill-anywhere run: one compaction of 685 had no event).
        // A failure of the store that may pass is tried again, as a turn's load is: the summary
        // was made (it failed the turn, and the next one asked for the same summary again). A
        // try that did commit makes the next refused by its fences, never a second compaction.
        let compaction = Arc::new(compaction);
        let mut tries = 0;
        let (tip, rows) = loop {
            let (compaction, root) = (compaction.clone(), root.clone());
            let written = self
                .ctx
                .shared
                .db
                .write(move |conn| {
                    crate::store::write_tx(conn, |conn| {
                        let tip =
                            sessions::commit_compaction(conn, epoch, generation, &compaction, now)?;
                        let event = NewEvent::new(
                            "session.info",
                            json!({"compacted": true, "tip_session_id": tip}),
                        );
                        let rows = events::append_tx(conn, &root, &[event], now)?;
                        Ok((tip, rows))
                    })
                })
                .await;
            match written {
                Ok(done) => break done,
                Err(e) => {
                    let what = "the compaction could not be committed";
                    if !waited_to_retry(&self.ctx, &e, &mut tries, what).await {
                        return Err(CompactError::Stop(Box::new(Stop::from(e))));
                    }
                }
            }
        };
        tracing::info!(session = %self.ctx.root_id, tip = %tip, kept = compacted.len(), "compacted the transcript");
        self.ctx.sup.do_send(Committed { rows });
        self.tip = tip;
        self.system = system;
        self.transcript = compacted;
        Ok(())
    }
}

enum CompactError {
    /// Boxed: a stop can carry a whole turn outcome, many times the size of the failure's text.
    Stop(Box<Stop>),
    Failed(String),
    /// No middle to summarise and no old tool output to clear (no summary was asked for), or
    /// a compaction that would not have shrunk the transcript (not committed).
    Nothing,
}

impl CompactError {
    /// The compaction stopped because the turn was (an interrupt, a graceful stop).
    fn interrupted() -> CompactError {
        CompactError::Stop(Box::new(Stop::Outcome(interrupted())))
    }
}

impl std::fmt::Display for CompactError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CompactError::Stop(_) => f.write_str("stopped"),
            CompactError::Failed(e) => f.write_str(e),
            CompactError::Nothing => f.write_str("nothing to compact"),
        }
    }
}

enum ToolResult {
    Output(String),
    /// Stopped before it did anything.
    Interrupted,
    /// Stopped while it ran: what it printed, to be kept as its result.
    InterruptedRunning(String),
}

enum Asked {
    Answered(PromptAnswer),
    /// Not asked: the prompt could not be recorded (the store failed).
    Unrecorded,
    TimedOut,
    /// Not asked: an earlier question of the turn timed out.
    Unattended,
    Cancelled,
}

/// How a wait on a prompt ended.
enum Waited {
    Answer(Answer),
    Over(Asked),
}

async fn cancelled(rx: &mut watch::Receiver<bool>) {
    loop {
        if *rx.borrow() {
            return;
        }
        if rx.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

/// The outcome of an attempt stopped by an interrupt (or the gateway's stop).
pub fn interrupted() -> TurnOutcome {
    TurnOutcome::Interrupted {
        reason: "the turn was interrupted".into(),
    }
}

/// The result of a command the terminal tool could not run (`error` says why).
/// How long a look at the paths a command will run among may take.
const FS_LOOK_TIMEOUT: Duration = Duration::from_secs(10);

/// `f` (which reads the file system) on a thread of its own, given up after
/// [`FS_LOOK_TIMEOUT`] (see [`tools::on_own_thread`]).
async fn off_thread<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    tools::on_own_thread(FS_LOOK_TIMEOUT, move |_| f()).await
}

fn not_run(error: &str) -> String {
    json!({"output": "", "exit_code": -1, "error": error}).to_string()
}

fn blocked(message: &str) -> String {
    json!({"output": "", "exit_code": -1, "error": message, "status": "blocked"}).to_string()
}

/// Rules that match an interpreter running code written in the command (`python3 -c …`,
/// `bash -c …`, a heredoc into one): the code is any code, so a `session` or `always` approval
/// covers the command as written, not every command the rule matches (`python3 -c "print(1)"`
/// approved for the session let `python3 -c "import os; os.system(…)"` run unasked).
const EXACT_COMMAND_RULES: &[&str] = &["script_dash_e", "shell_dash_c", "interpreter_heredoc"];

/// What a `session` or `always` approval of rule `key` for `command` is kept as: the rule, or
/// (one of [`EXACT_COMMAND_RULES`]) the rule and the command's SHA-256.
fn approval_key(key: &str, command: &str) -> String {
    if !EXACT_COMMAND_RULES.contains(&key) {
        return key.to_string();
    }
    format!("{key}:{}", crate::store::rooms::sha256_hex(command))
}

/// Rules whose commands are approved one at a time (no `session`, no `always`): they reach the
/// gateway's own state or process, where what one approval lets through is not one kind of act,
/// or leave a process running past the call, or run what cannot be read from the command (text
/// piped or downloaded into a shell, a command name computed at run time): approved for the
/// session, `cat setup.sh | bash` let `echo … | base64 -d | sh` run any command unasked, those
/// of the never-allowed list included.
const ONCE_ONLY_RULES: &[&str] = &[
    danger::GATEWAY_STATE.key,
    danger::GATEWAY_PROCESS.key,
    danger::BACKGROUND.key,
    "self_termination",
    "kill_user_processes",
    "pipe_to_shell",
    "curl_pipe_shell",
    "shell_remote_substitution",
    "dynamic_command",
    "dynamic_code",
];

/// The choices a multi-select answer picks, in the order typed: numbers or labels, separated by
/// commas (`1,3`, `blue, green`), or numbers by spaces (`1 3`), or a JSON list of them. What
/// is typed and is no choice is kept as typed; an empty answer picks nothing.
fn pick_many(answer: &str, choices: &[String]) -> Vec<String> {
    let typed = answer.trim();
    // A choice whose label has a comma in it ("Yes, please") is one choice.
    let whole = pick(typed, choices);
    if choices.contains(&whole) {
        return vec![whole];
    }
    let parts: Vec<String> = if let Ok(list) = serde_json::from_str::<Vec<Value>>(typed) {
        list.iter()
            .map(|v| v.as_str().map_or_else(|| v.to_string(), str::to_string))
            .collect()
    } else if typed.contains(',') {
        typed.split(',').map(str::to_string).collect()
    } else if typed.split_whitespace().all(|w| w.parse::<usize>().is_ok()) {
        typed.split_whitespace().map(str::to_string).collect()
    } else {
        vec![typed.to_string()]
    };
    let mut picked: Vec<String> = Vec::new();
    for part in parts.iter().filter(|p| !p.trim().is_empty()) {
        let one = pick(part, choices).trim().to_string();
        if !picked.contains(&one) {
            picked.push(one);
        }
    }
    picked
}

/// A typed answer to a question offering `choices`: a number picks that choice (1-based), a
/// choice's label in any case picks it as offered, anything else is the user's own words.
fn pick(answer: &str, choices: &[String]) -> String {
    let typed = answer.trim();
    let typed = typed.strip_suffix(" (Recommended)").unwrap_or(typed).trim();
    let numbered = typed
        .parse::<usize>()
        .ok()
        .and_then(|n| n.checked_sub(1))
        .and_then(|i| choices.get(i));
    numbered
        .or_else(|| {
            choices
                .iter()
                .find(|c| c.trim().eq_ignore_ascii_case(typed))
        })
        .cloned()
        .unwrap_or_else(|| answer.to_string())
}

/// How often one turn asks the model again for one kind of bad answer (cut off by the output
/// limit, empty, unparsable tool arguments) or puts up with calls to tools that do not exist.
const MAX_MODEL_RETRIES: u8 = 3;

/// The `terminal` tool's arguments, each of the type its schema gives. One of another type was
/// ignored: a `"background": "true"` ran in the foreground until its time limit, a `workdir`
/// object ran the command in the session's directory. The forms models write for a boolean or
/// a number (`"true"`, `"30"`) are read as such; anything else is refused, naming the argument.
struct TerminalArgs {
    command: String,
    background: bool,
    workdir: Option<String>,
    timeout: Option<f64>,
}

impl TerminalArgs {
    fn read(args: &Value) -> Result<TerminalArgs, String> {
        let given = |key: &str| args.get(key).filter(|v| !v.is_null());
        let command = match given("command") {
            Some(Value::String(c)) => c.clone(),
            Some(_) => return Err("the `command` argument must be a string".into()),
            None => return Err("the `command` argument is required".into()),
        };
        let background = match given("background") {
            None => false,
            Some(Value::Bool(b)) => *b,
            Some(Value::String(b)) if b.eq_ignore_ascii_case("true") => true,
            Some(Value::String(b)) if b.eq_ignore_ascii_case("false") => false,
            Some(_) => return Err("the `background` argument must be true or false".into()),
        };
        let workdir = match given("workdir") {
            None => None,
            Some(Value::String(w)) => Some(w.clone()),
            Some(_) => return Err("the `workdir` argument must be a directory's path".into()),
        };
        let not_seconds = || Err("the `timeout` argument must be a number of seconds".into());
        let timeout = match given("timeout") {
            None => None,
            Some(Value::Number(t)) => t.as_f64(),
            Some(Value::String(t)) => match t.trim().parse::<f64>() {
                Ok(t) if t.is_finite() => Some(t),
                _ => return not_seconds(),
            },
            Some(_) => return not_seconds(),
        };
        Ok(TerminalArgs {
            command,
            background,
            workdir,
            timeout,
        })
    }
}

/// Are a tool call's `arguments` a JSON object (or nothing, for a tool without parameters)?
fn arguments_are_an_object(arguments: &str) -> bool {
    let a = arguments.trim();
    a.is_empty() || (a.starts_with('{') && serde_json::from_str::<serde::de::IgnoredAny>(a).is_ok())
}

/// Arguments that are not a JSON object, as one that holds them: what a call is kept with and
/// sent back as.
fn object_arguments(arguments: &str) -> String {
    json!({ "unparsable_arguments": arguments }).to_string()
}

/// The note that asks the model to go on with an answer the output limit cut off.
const CONTINUE_NOTE: &str = "[Your previous response was cut off by the output length limit. \
    Continue exactly where you left off, without repeating anything.]";

/// A turn's count of its retries, and what it carries between them.
#[derive(Default)]
struct Retries {
    /// Continuations asked for after `finish_reason: length`.
    continuations: u8,
    /// Empty final answers asked for again.
    empty: u8,
    /// Responses with unparsable tool arguments asked for again.
    bad_arguments: u8,
    /// Rounds in a row whose calls all named tools that do not exist.
    unknown_rounds: u8,
    /// The answer so far, when the output limit cut it off.
    partial: String,
    /// The reasoning that came with `partial`.
    partial_reasoning: String,
    /// The last text that came with tool calls (the answer when the final one is empty).
    tool_content: Option<String>,
    /// A preflight compaction of this turn failed (its summary request).
    compaction_failed: bool,
    /// The transcript's length when a preflight compaction found nothing to compact.
    nothing_to_compact_at: Option<usize>,
    /// The tokens the model reported for the response whose tool calls just ran (prompt plus
    /// completion): the next request holds at least that much, whatever the estimate says.
    reported_before_tools: Option<u64>,
}

impl Retries {
    /// The reasoning of an answer that ends with `last`: what came with the parts the output
    /// limit cut off, then `last`'s own; none when there is none.
    fn reasoning_with(&mut self, last: Option<String>) -> Option<String> {
        let mut all = std::mem::take(&mut self.partial_reasoning);
        all.push_str(last.as_deref().unwrap_or(""));
        (!all.is_empty()).then_some(all)
    }
}

/// Tool calls one model response may make; the rest are not run nor kept (a response of
/// thousands of calls would otherwise run them all, each a process and two commits).
pub const MAX_TOOL_CALLS_PER_RESPONSE: usize = 64;

/// Give every call an id of its own: a result is matched to its call by id, so a repeated or
/// empty id (two calls `dup`, a call without an id beside an explicit `call_0`) ran both calls
/// and then kept one result for two calls in every later request.
fn unique_call_ids(calls: &mut [ToolCall]) {
    let mut seen = std::collections::HashSet::new();
    for (n, call) in calls.iter_mut().enumerate() {
        if call.id.is_empty() || seen.contains(&call.id) {
            let mut k = 0;
            call.id = loop {
                let id = match k {
                    0 => format!("call_{n}"),
                    _ => format!("call_{n}_{k}"),
                };
                if !seen.contains(&id) {
                    break id;
                }
                k += 1;
            };
        }
        seen.insert(call.id.clone());
    }
}

/// The longest `command` the terminal tool takes (the danger checks read all of it).
pub const MAX_COMMAND_BYTES: usize = 64 * 1024;

fn truncate(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        s.chars().take(n).collect::<String>() + "…"
    }
}

/// Remove `<think>…</think>` blocks from a final answer.
pub fn strip_think(text: &str) -> String {
    split_think(text).0
}

/// A text without its `<think>…</think>` blocks (an unclosed one runs to the end), and what
/// they held: a model that thinks in its content instead of a reasoning field.
pub fn split_think(text: &str) -> (String, String) {
    let mut out = String::with_capacity(text.len());
    let mut thoughts = String::new();
    let mut rest = text;
    while let Some(start) = rest.find("<think>") {
        out.push_str(&rest[..start]);
        let inner = &rest[start + "<think>".len()..];
        let (thought, after) = match inner.find("</think>") {
            Some(end) => (&inner[..end], &inner[end + "</think>".len()..]),
            None => (inner, ""),
        };
        let thought = thought.trim();
        if !thought.is_empty() {
            if !thoughts.is_empty() {
                thoughts.push('\n');
            }
            thoughts.push_str(thought);
        }
        rest = after;
    }
    out.push_str(rest);
    (out.trim().to_string(), thoughts)
}

/// Tools the model sees: the session's frozen list, limited to tools this gateway has. A claim
/// checked the list before the turn began; one found damaged since gives no tool.
fn enabled_tools(_shared: &Shared, root: &SessionRow) -> Vec<String> {
    root.toolsets()
        .unwrap_or_default()
        .into_iter()
        .filter(|t| tools::KNOWN_TOOLS.contains(&t.as_str()))
        .collect()
}

/// The system prompt of a session working in `cwd` under `profile`: built once per session and
/// stored with it, then reused byte for byte (rebuilt only by a compression).
pub fn system_prompt_for(shared: &Shared, cwd: &str, profile: &str) -> String {
    let mut s = String::from(
        "You are an assistant running inside Gatehouse, a gateway for agent sessions. Answer the latest user \
         message. Use tools only when they help.",
    );
    s.push_str(&format!("\nWorking directory: {cwd}"));
    if let Some(extra) = &shared.config.agent.system_prompt {
        s.push_str("\n\n");
        s.push_str(extra);
    }
    if let Some(p) = shared
        .config
        .profiles
        .get(profile)
        .and_then(|p| p.system_prompt.clone())
    {
        s.push_str("\n\n");
        s.push_str(&p);
    }
    s
}

/// How a prompt of an attempt that is stopping ends, as the write of an answer to it finds the
/// attempt (`None`: it runs on, and the answer is recorded): `shutdown` once the drain has begun,
/// whether or not its interrupt has reached the attempt yet (the turn stops at its next step all
/// the same, so an answer recorded then would be audited as acted on when it was not), else
/// `interrupted` for an interrupted attempt.
fn stop_resolution(interrupted: bool, draining: bool) -> Option<&'static str> {
    if draining {
        Some("shutdown")
    } else if interrupted {
        Some("interrupted")
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::{pick, pick_many, stop_resolution, strip_think, unique_call_ids, TerminalArgs};

    /// The terminal's arguments are read as typed, the forms models write for a boolean or a
    /// number included; one of another type is refused naming it (it was ignored: a
    /// `"background": "true"` ran in the foreground).
    #[test]
    fn terminal_arguments_of_another_type_are_refused_by_name() {
        let read = |args: serde_json::Value| TerminalArgs::read(&args);
        let ok = read(serde_json::json!({"command": "srv", "background": "true",
                                         "timeout": "30", "workdir": "sub"}))
        .expect("read");
        assert!(ok.background);
        assert_eq!(ok.timeout, Some(30.0));
        assert_eq!(ok.workdir.as_deref(), Some("sub"));
        let plain = read(serde_json::json!({"command": "ls", "background": null})).expect("read");
        assert!(!plain.background && plain.timeout.is_none() && plain.workdir.is_none());
        for (args, named) in [
            (serde_json::json!({}), "`command` argument is required"),
            (serde_json::json!({"command": ["ls"]}), "`command`"),
            (
                serde_json::json!({"command": "ls", "background": "yes"}),
                "`background`",
            ),
            (
                serde_json::json!({"command": "ls", "background": 1}),
                "`background`",
            ),
            (
                serde_json::json!({"command": "ls", "workdir": {"path": "sub"}}),
                "`workdir`",
            ),
            (
                serde_json::json!({"command": "ls", "timeout": "soon"}),
                "`timeout`",
            ),
            (
                serde_json::json!({"command": "ls", "timeout": "inf"}),
                "`timeout`",
            ),
        ] {
            match read(args.clone()) {
                Err(why) => assert!(why.contains(named), "{args}: {why}"),
                Ok(_) => panic!("{args} was taken"),
            }
        }
    }

    /// A once-only key that names no rule would restrict nothing.
    #[test]
    fn every_once_only_key_is_a_rule_key() {
        let keys = crate::tools::danger::all_keys();
        for key in super::ONCE_ONLY_RULES {
            assert!(keys.contains(key), "{key}");
        }
    }

    #[test]
    fn every_call_gets_an_id_of_its_own() {
        use crate::model::ToolCall;
        let mut calls: Vec<ToolCall> = ["dup", "dup", "", "call_0", "call_1", "x"]
            .iter()
            .map(|id| ToolCall {
                id: id.to_string(),
                ..Default::default()
            })
            .collect();
        unique_call_ids(&mut calls);
        let ids: Vec<&str> = calls.iter().map(|c| c.id.as_str()).collect();
        assert_eq!(ids, ["dup", "call_1", "call_2", "call_0", "call_4", "x"]);
    }

    /// An answer written once the drain has begun is recorded as the prompt's shutdown even
    /// before the drain's interrupt reaches the attempt: the turn does not act on it (it stops
    /// at its next step). Before, it was recorded as the human's choice, for a command that
    /// never ran.
    #[test]
    fn an_answer_written_during_the_drain_is_recorded_as_its_shutdown() {
        assert_eq!(stop_resolution(false, true), Some("shutdown"));
        assert_eq!(stop_resolution(true, true), Some("shutdown"));
        assert_eq!(stop_resolution(true, false), Some("interrupted"));
        assert_eq!(stop_resolution(false, false), None);
    }

    #[test]
    fn a_typed_clarify_answer_picks_by_number_or_label() {
        let choices = vec!["BLUE".to_string(), "GREEN".to_string()];
        assert_eq!(pick("2", &choices), "GREEN");
        assert_eq!(pick(" 1 ", &choices), "BLUE");
        assert_eq!(pick("green", &choices), "GREEN");
        assert_eq!(pick("Blue (Recommended)", &choices), "BLUE");
        // Out of range, or not a choice: the user's own words.
        assert_eq!(pick("3", &choices), "3");
        assert_eq!(pick("0", &choices), "0");
        assert_eq!(pick("teal, please", &choices), "teal, please");
        assert_eq!(pick("2", &[]), "2");
    }

    /// A multi-select answer picks several, by numbers or labels, in the order typed.
    #[test]
    fn a_multi_select_answer_picks_each_choice_named() {
        let choices: Vec<String> = ["RED", "GREEN", "BLUE"].map(String::from).to_vec();
        let many = |typed: &str| pick_many(typed, &choices);
        assert_eq!(many("1,3"), ["RED", "BLUE"]);
        assert_eq!(many(" 3 1 "), ["BLUE", "RED"]);
        assert_eq!(many("green, Red,green"), ["GREEN", "RED"]);
        assert_eq!(many(r#"["2", "blue"]"#), ["GREEN", "BLUE"]);
        assert_eq!(many("2, teal"), ["GREEN", "teal"]);
        assert_eq!(many("dark blue"), ["dark blue"]);
        assert!(many("").is_empty());
        assert!(many(" , ").is_empty());
        let polite: Vec<String> = ["Yes, please", "No"].map(String::from).to_vec();
        assert_eq!(pick_many("yes, please", &polite), ["Yes, please"]);
        assert_eq!(pick_many("1,2", &polite), ["Yes, please", "No"]);
    }

    /// The claim's bounded read gives up on a transcript with more live messages than its
    /// bound (counting live ones only), and otherwise reads what the unbounded read does.
    #[test]
    fn a_bounded_start_read_stops_at_its_bound() {
        use crate::store::messages::{insert_messages, NewMessage};
        use crate::store::{epoch, testing};
        use diesel::connection::SimpleConnection;
        let (_dir, mut c) = testing::conn();
        let e = epoch::begin_epoch(&mut c, "i", 1.0).expect("epoch");
        testing::session(&mut c, e, "s1");
        let message = |i: usize| NewMessage {
            session_id: "s1".into(),
            role: if i.is_multiple_of(2) {
                "user"
            } else {
                "assistant"
            }
            .into(),
            content: Some(format!("m{i}")),
            ..Default::default()
        };
        let texts = |start: &super::TurnStart| -> Vec<String> {
            start
                .rows
                .iter()
                .filter_map(|r| r.content.clone())
                .collect()
        };
        insert_messages(&mut c, &(0..5).map(message).collect::<Vec<_>>(), 1.0).expect("five");
        let bounded = super::TurnStart::read_bounded(&mut c, "s1", 5)
            .expect("read")
            .expect("five fit");
        let whole = super::TurnStart::read(&mut c, "s1").expect("read");
        assert_eq!(texts(&bounded), texts(&whole));
        assert_eq!(texts(&bounded).len(), 5);
        insert_messages(&mut c, &[message(5)], 2.0).expect("sixth");
        assert!(super::TurnStart::read_bounded(&mut c, "s1", 5)
            .expect("read")
            .is_none());
        c.batch_execute("UPDATE messages SET active = 0 WHERE content IN ('m0', 'm1')")
            .expect("compact");
        let bounded = super::TurnStart::read_bounded(&mut c, "s1", 5)
            .expect("read")
            .expect("four live fit");
        assert_eq!(texts(&bounded), ["m2", "m3", "m4", "m5"]);
        // A bound of nothing reads nothing.
        assert!(super::TurnStart::read_bounded(&mut c, "s1", 0)
            .expect("read")
            .is_none());
    }

    #[test]
    fn think_blocks_are_removed() {
        assert_eq!(strip_think("<think>hmm</think> Hello"), "Hello");
        assert_eq!(strip_think("A<think>x</think>B<think>y"), "AB");
        assert_eq!(
            super::split_think("<think> plan </think>Hello<think>more"),
            ("Hello".to_string(), "plan\nmore".to_string())
        );
        assert_eq!(
            super::split_think("no thoughts"),
            ("no thoughts".to_string(), String::new())
        );
    }
}
