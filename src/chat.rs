//! `gatehouse chat`: an interactive client over the WebSocket. It creates or resumes a session,
//! streams replies as they arrive, shows tool activity, asks the operator on approvals and
//! clarifications, and reconnects (resuming the session) when the connection drops.

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio::sync::mpsc;

pub type Framed = actix_codec::Framed<awc::BoxedSocket, awc::ws::Codec>;

pub struct ChatOptions {
    pub home: PathBuf,
    pub session: String,
    pub text: Option<String>,
}

/// A control-socket request whose `{"error":…}` reply is an error.
fn control(home: &Path, method: &str, params: Value) -> Result<Value, String> {
    let v = crate::api::control::request(home, method, params)?;
    if let Some(err) = v.get("error") {
        return Err(format!("control socket: {err}"));
    }
    Ok(v)
}

/// A WebSocket on the daemon at `origin`, authenticated by a fresh control-socket ticket.
pub async fn connect_ws(home: &Path, origin: &str) -> Result<Framed, String> {
    let ticket = control(home, "session-ticket", json!({"purpose": "interactive"}))?;
    let ticket = ticket["ticket"]
        .as_str()
        .ok_or("no ticket in the reply")?
        .to_string();
    let url = format!("{}/api/ws", origin.replacen("http", "ws", 1));
    let client = awc::Client::builder()
        .max_http_version(awc::http::Version::HTTP_11)
        .finish();
    let (_, framed) = client
        .ws(url)
        .protocols([
            "gatehouse.v1".to_string(),
            format!("gatehouse-ticket.{ticket}"),
        ])
        .max_frame_size(64 << 20)
        .connect()
        .await
        .map_err(|e| format!("cannot open the WebSocket: {e}"))?;
    Ok(framed)
}

struct Conn {
    framed: Framed,
    next_id: u64,
    backlog: Vec<Value>,
    /// The connection is gone (a send failed, or the stream ended): reconnect to go on.
    lost: bool,
}

/// How the client ends: every turn it ran completed, or one did not (exit 1 for scripts).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChatEnd {
    Completed,
    NotCompleted,
}

impl Conn {
    async fn open(home: &Path) -> Result<Conn, String> {
        let identify = control(home, "identify", json!({}))?;
        let origin = identify["api_origin"]
            .as_str()
            .ok_or("the daemon reported no api_origin")?;
        Ok(Conn {
            framed: connect_ws(home, origin).await?,
            next_id: 1,
            backlog: Vec::new(),
            lost: false,
        })
    }

    async fn recv(&mut self) -> Option<Value> {
        if !self.backlog.is_empty() {
            return Some(self.backlog.remove(0));
        }
        while !self.lost {
            let frame = self.framed.next().await;
            if let Some(text) = self.take(frame).await {
                return text;
            }
        }
        None
    }

    /// What a frame read off the socket says: a text frame's JSON (`Some(None)` if it is not
    /// JSON); `None` for anything else. A ping is answered; a close, an error or the end of the
    /// stream marks the connection lost.
    async fn take(
        &mut self,
        frame: Option<Result<awc::ws::Frame, awc::error::WsProtocolError>>,
    ) -> Option<Option<Value>> {
        match frame {
            Some(Ok(awc::ws::Frame::Text(b))) => return Some(serde_json::from_slice(&b).ok()),
            Some(Ok(awc::ws::Frame::Ping(p))) => {
                let _ = self.framed.send(awc::ws::Message::Pong(p)).await;
            }
            Some(Ok(awc::ws::Frame::Close(_))) | Some(Err(_)) | None => self.lost = true,
            Some(Ok(_)) => {}
        }
        None
    }

    /// The operator's answer to the open prompt `prompt_id`: a line of input, or how the prompt
    /// ended without one (timed out, answered elsewhere, its turn stopped), whichever comes
    /// first (a terminal left open after the prompt ended waited for a line for good). The
    /// connection is kept alive meanwhile: the daemon's pings are answered and its frames kept
    /// for later (waiting on the terminal alone answered no ping, and the daemon closed the
    /// connection of a user who took over a minute to answer).
    async fn read_answer(&mut self, lines: &mut Lines, prompt_id: &Value) -> Read {
        let ended = |v: &Value| -> Option<String> {
            let params = v.get("params").filter(|_| v["method"] == "event")?;
            let settled = params["type"]
                .as_str()
                .is_some_and(|t| t.ends_with(".settled"));
            (settled && &params["payload"]["prompt_id"] == prompt_id).then(|| {
                params["payload"]["resolution"]
                    .as_str()
                    .unwrap_or("ended")
                    .to_string()
            })
        };
        if let Some(resolution) = self.backlog.iter().find_map(ended) {
            return Read::Ended(resolution);
        }
        loop {
            // Asked again from the daemon's snapshot once reconnected (this waited for a line
            // alone, and a terminal left open waited for good).
            if self.lost {
                return Read::Ended(
                    "the connection to the daemon was lost (it is asked again once reconnected)"
                        .into(),
                );
            }
            tokio::select! {
                line = lines.answer() => return line.map_or(Read::Eof, Read::Line),
                frame = self.framed.next() => {
                    if let Some(Some(v)) = self.take(frame).await {
                        if let Some(resolution) = ended(&v) {
                            return Read::Ended(resolution);
                        }
                        self.backlog.push(v);
                    }
                }
            }
        }
    }

    async fn call(&mut self, method: &str, params: Value) -> Result<Value, String> {
        let id = format!("chat-{}", self.next_id);
        self.next_id += 1;
        let frame =
            json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}).to_string();
        if let Err(e) = self.framed.send(awc::ws::Message::Text(frame.into())).await {
            self.lost = true;
            return Err(format!("connection lost: {e}"));
        }
        let mut held = Vec::new();
        let result = loop {
            let Some(v) = self.recv().await else {
                break Err("connection lost".to_string());
            };
            if v["id"] == json!(id) {
                break match v.get("error") {
                    Some(e) => Err(format!(
                        "{}: {}",
                        e["data"]["reason"].as_str().unwrap_or("error"),
                        e["data"]["detail"].as_str().unwrap_or("")
                    )),
                    None => Ok(v["result"].clone()),
                };
            }
            held.push(v);
        };
        self.backlog.extend(held);
        result
    }

    /// Say goodbye with a close frame (the daemon logged a protocol error for a bare drop).
    async fn close(mut self) {
        if self.lost {
            return;
        }
        let close = awc::ws::Message::Close(Some(awc::ws::CloseCode::Normal.into()));
        if self.framed.send(close).await.is_err() {
            return;
        }
        // Wait (briefly) for the daemon's close in answer, so the connection ends cleanly.
        let _ = tokio::time::timeout(Duration::from_secs(2), async {
            while let Some(Ok(frame)) = self.framed.next().await {
                if matches!(frame, awc::ws::Frame::Close(_)) {
                    break;
                }
            }
        })
        .await;
    }
}

/// The operator's lines of input, read from stdin on a thread of their own.
struct Lines {
    rx: mpsc::UnboundedReceiver<String>,
    /// Lines typed on a terminal before a question was shown: they answer nothing (a `once`
    /// typed for a prompt that ended meanwhile approved the next command, unseen), and
    /// interactively they are the next messages, in order.
    ahead: std::collections::VecDeque<String>,
    /// Whether stdin is a terminal. Piped input answers the questions in the order given: a
    /// script's answers are all there before its questions are shown.
    terminal: bool,
}

impl Lines {
    fn new(rx: mpsc::UnboundedReceiver<String>, terminal: bool) -> Lines {
        Lines {
            rx,
            ahead: std::collections::VecDeque::new(),
            terminal,
        }
    }

    /// The next message to send (interactively). One typed ahead of a question is shown as
    /// it is sent.
    async fn input(&mut self) -> Option<String> {
        match self.ahead.pop_front() {
            Some(line) => {
                out(&format!("{}\n", printable(&line, false)));
                Some(line)
            }
            None => self.rx.recv().await,
        }
    }

    /// A question is shown now (once per question, not per read: a line typed after it, read
    /// after a typo's re-ask, is an answer): on a terminal, what was typed before it is set
    /// aside, and said; how many lines.
    fn question_shown(&mut self) -> usize {
        if !self.terminal {
            return 0;
        }
        let before = self.ahead.len();
        while let Ok(line) = self.rx.try_recv() {
            self.ahead.push_back(line);
        }
        let typed = self.ahead.len() - before;
        if typed > 0 {
            out(&format!(
                "\n[{typed} line(s) typed before this question was shown are not its answer]\nanswer: "
            ));
        }
        typed
    }

    /// A line typed since the question was shown.
    async fn answer(&mut self) -> Option<String> {
        self.rx.recv().await
    }
}

fn stdin_lines() -> Lines {
    use std::io::IsTerminal;
    let terminal = std::io::stdin().is_terminal();
    let (tx, rx) = mpsc::unbounded_channel();
    std::thread::spawn(move || {
        let stdin = std::io::stdin();
        for line in stdin.lock().lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    Lines::new(rx, terminal)
}

/// `text` from the model or another client as it is safe to print on a terminal. An escape
/// sequence or a carriage return could rewrite what is on screen (show a harmless command where
/// an approval asks for a dangerous one, hide the choices, set the clipboard): control
/// characters are shown in caret notation (`^[`, `^M`), C1 controls and bidirectional
/// overrides as `?`. With `lines`, newlines and tabs are kept; without, they are shown too (a
/// command's hidden second line is seen).
pub fn printable(text: &str, lines: bool) -> std::borrow::Cow<'_, str> {
    let unsafe_char = |c: char| {
        (c.is_control() && !(lines && matches!(c, '\n' | '\t')))
            || matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
    };
    if !text.chars().any(unsafe_char) {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut shown = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        match c {
            c if !unsafe_char(c) => shown.push(c),
            '\u{7f}' => shown.push_str("^?"),
            c if (c as u32) < 0x20 => {
                shown.push('^');
                shown.push(char::from(b'@' + c as u8));
            }
            _ => shown.push('?'),
        }
    }
    std::borrow::Cow::Owned(shown)
}

fn out(text: &str) {
    let mut o = std::io::stdout();
    let _ = o.write_all(text.as_bytes());
    let _ = o.flush();
}

/// Run the client until the given text's turn ends (or stdin ends, interactively). A one-shot
/// turn that did not complete ends `NotCompleted`.
pub async fn run(opts: ChatOptions) -> Result<ChatEnd, String> {
    let cwd = std::env::current_dir().map_err(|e| e.to_string())?;
    let mut conn = Conn::open(&opts.home).await?;
    let request_id = format!("chat:{}", opts.session);
    // A named session goes on wherever it is run from: it is resumed if it exists (it keeps the
    // directory it was started in), and created in this directory if not.
    let principal = format!("uid:{}", crate::api::control::own_uid());
    let existing = crate::api::rpc::session_id_for(&principal, &request_id);
    let snap = match conn
        .call("session.resume", json!({"session_id": existing}))
        .await
    {
        Ok(snap) => snap,
        Err(e) if e.starts_with("not_found:") => {
            conn.call(
                "session.create",
                json!({"request_id": request_id, "cwd": cwd.to_string_lossy(), "source": "cli"}),
            )
            .await?
        }
        Err(e) => return Err(e),
    };
    let session_id = snap["session_id"]
        .as_str()
        .ok_or("no session id")?
        .to_string();
    out(&format!(
        "[session {} · model {}]\n",
        opts.session,
        snap["info"]["model"].as_str().unwrap_or("?")
    ));
    if snap["info"]["provider"] == "echo" {
        // A session keeps the model it was created with.
        out(
            "[this session was created with no model configured and keeps the built-in echo \
             provider; --session NAME starts one with the model configured now]\n",
        );
    }
    held_by_unknown(&snap, &opts.home, &session_id, None)?;
    let mut lines = stdin_lines();
    let interactive = opts.text.is_none();
    let mut first = opts.text.clone();
    let mut end = ChatEnd::Completed;
    loop {
        let text = match first.take() {
            Some(t) => t,
            None if interactive => {
                out("> ");
                match lines.input().await {
                    Some(l) if l.trim().is_empty() => continue,
                    Some(l) => l,
                    None => break,
                }
            }
            None => break,
        };
        let input_id = uuid::Uuid::new_v4().simple().to_string();
        let (admission, sent_again) =
            match submit(&mut conn, &opts.home, &session_id, &input_id, &text).await {
                Ok(submitted) => submitted,
                // A refusal of one message (too long, the queue full) ends nothing interactively:
                // it is said, and the next line is read.
                Err(NotSubmitted::Refused(e)) if interactive => {
                    out(&format!("[not sent: {}]\n", printable(&e, false)));
                    continue;
                }
                Err(NotSubmitted::Refused(e) | NotSubmitted::Ended(e)) => return Err(e),
            };
        let ended = sent_again
            .as_ref()
            .and_then(|r| ended_before(r, &opts.home, &session_id, &admission));
        let outcome = match ended {
            Some(ended) => ended?,
            None => follow(&mut conn, &opts.home, &session_id, &admission, &mut lines).await?,
        };
        if !interactive {
            if outcome != "completed" {
                end = ChatEnd::NotCompleted;
            }
            break;
        }
    }
    conn.close().await;
    Ok(end)
}

/// The operator's command that settles `admission`, naming this home (under a service user the
/// default home is another one).
fn settle_command(home: &Path, session_id: &str, admission: &str) -> String {
    let home = shell_word(&home.display().to_string());
    format!("gatehouse resolve-unknown {session_id} {admission} --home {home}")
}

/// `word` as one word of a shell command: as it is if nothing in it is special, else quoted.
pub(crate) fn shell_word(word: &str) -> String {
    let plain = !word.is_empty()
        && word
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"/._-+:,@".contains(&b));
    if plain {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

/// Refuse to go on in a session held by an input whose outcome is unknown (other than
/// `mine`): nothing queued behind it runs until an operator settles it, so waiting would be for
/// good.
fn held_by_unknown(
    snap: &Value,
    home: &Path,
    session_id: &str,
    mine: Option<&str>,
) -> Result<(), String> {
    let held = snap["pending"].as_array().and_then(|pending| {
        pending
            .iter()
            .find(|r| r["status"] == "unknown" && r["admission_id"].as_str() != mine)
    });
    let Some(row) = held else { return Ok(()) };
    let admission = row["admission_id"].as_str().unwrap_or("?");
    let queued = match mine {
        Some(mine) => format!(" Input {mine} is queued behind it and runs once it is settled."),
        None => String::new(),
    };
    Err(format!(
        "session {session_id} is held by input {admission}, which was running when the daemon \
         stopped: its outcome is unknown, it will not run again, and nothing after it runs until \
         it is settled.{queued} Check what it did, then settle it with: {}",
        settle_command(home, session_id, admission)
    ))
}

/// Why a submit did not give an admission.
enum NotSubmitted {
    /// The daemon refused this input (too long, the queue full…): the session goes on.
    Refused(String),
    /// The chat cannot go on: the connection could not be reopened, or the session is held
    /// by an unknown input (nothing sent to it would run).
    Ended(String),
}

impl From<String> for NotSubmitted {
    fn from(e: String) -> NotSubmitted {
        NotSubmitted::Ended(e)
    }
}

/// Submit `text` as `input_id`; a connection found lost is reopened and the same input sent
/// again (it is idempotent by its id: admitted once however often it is sent). Its admission
/// id, and (sent again) its receipt: the first sending may have been admitted and even run to
/// its end before the new connection followed the session, its events gone with the old one.
async fn submit(
    conn: &mut Conn,
    home: &Path,
    session_id: &str,
    input_id: &str,
    text: &str,
) -> Result<(String, Option<Value>), NotSubmitted> {
    let params = json!({"session_id": session_id, "input_id": input_id, "text": text});
    let mut reconnected = false;
    loop {
        match conn.call("prompt.submit", params.clone()).await {
            Ok(receipt) => {
                let admission = receipt["admission_id"]
                    .as_str()
                    .map(str::to_string)
                    .ok_or_else(|| NotSubmitted::Ended("no admission id".into()))?;
                if !reconnected {
                    return Ok((admission, None));
                }
                // The submit's receipt has no result: the full one says how it ended.
                let full = conn
                    .call(
                        "prompt.receipt",
                        json!({"session_id": session_id, "admission_id": admission}),
                    )
                    .await?;
                return Ok((admission, Some(full)));
            }
            Err(_) if conn.lost && !reconnected => {
                out("[connection lost; reconnecting]\n");
                *conn = reconnect(home).await?;
                let snap = conn
                    .call("session.resume", json!({"session_id": session_id}))
                    .await?;
                held_by_unknown(&snap, home, session_id, None)?;
                reconnected = true;
            }
            Err(e) if conn.lost => return Err(NotSubmitted::Ended(e)),
            Err(e) => return Err(NotSubmitted::Refused(e)),
        }
    }
}

/// How input `admission` ended, from its receipt `r`, when it ended before its events could
/// be followed (they went to a connection that was lost): its reply printed and its outcome,
/// or why none will come (its outcome is unknown). `None` while it is queued or running.
fn ended_before(
    r: &Value,
    home: &Path,
    session_id: &str,
    admission: &str,
) -> Option<Result<String, String>> {
    if r["status"] == "unknown" {
        // The daemon stopped (crashed) while this input ran: it is never run again and no
        // completion will come. Only an operator can settle it.
        return Some(Err(format!(
            "input {admission} was running when the daemon stopped; its outcome is unknown and it \
             will not run again. Check what it did, then settle it with: {}",
            settle_command(home, session_id, admission)
        )));
    }
    if r["status"] == "terminal" {
        let text = r["result"]["final_response"].as_str().unwrap_or("");
        let outcome = r["outcome"].as_str().unwrap_or("").to_string();
        out(&format!("{}\n[{outcome}]\n", printable(text, true)));
        return Some(Ok(outcome));
    }
    None
}

/// Stream one admission's events until it ends, answering prompts, reconnecting on drops; its
/// outcome.
async fn follow(
    conn: &mut Conn,
    home: &Path,
    session_id: &str,
    admission: &str,
    lines: &mut Lines,
) -> Result<String, String> {
    let mut streamed = false;
    loop {
        let Some(frame) = conn.recv().await else {
            out("\n[connection lost; reconnecting]\n");
            *conn = reconnect(home).await?;
            let snap = conn
                .call("session.resume", json!({"session_id": session_id}))
                .await?;
            held_by_unknown(&snap, home, session_id, Some(admission))?;
            // A question asked while the connection was down is asked again here; what was
            // streamed meanwhile is lost, so the reply is printed whole when it completes.
            for prompt in snap["prompts"].as_array().into_iter().flatten() {
                if prompt["admission_id"] == admission {
                    let kind = prompt["kind"].as_str().unwrap_or("");
                    conn.backlog
                        .push(json!({"jsonrpc": "2.0", "method": "event",
                        "params": {"type": format!("{kind}.request"), "payload": prompt}}));
                }
            }
            if streamed {
                out("[the reply in full follows when it completes]\n");
                streamed = false;
            }
            let r = conn
                .call(
                    "prompt.receipt",
                    json!({"session_id": session_id, "admission_id": admission}),
                )
                .await?;
            if let Some(ended) = ended_before(&r, home, session_id, admission) {
                return ended;
            }
            continue;
        };
        let Some(params) = frame.get("params").filter(|_| frame["method"] == "event") else {
            continue;
        };
        let payload = &params["payload"];
        match params["type"].as_str().unwrap_or("") {
            "message.delta" if payload["admission_id"] == admission => {
                if let Some(t) = payload["text"].as_str() {
                    streamed = true;
                    out(&printable(t, true));
                }
                // What was streamed is void: the model is asked again.
                if payload.get("retry").is_some() && streamed {
                    out("\n[the model is asked again]\n");
                }
            }
            "tool.start" => out(&format!(
                "\n[tool {}: {}]\n",
                printable(payload["name"].as_str().unwrap_or("?"), false),
                printable(payload["arguments"].as_str().unwrap_or(""), true)
            )),
            "tool.complete" => out(&format!(
                "[tool {} done]\n",
                printable(payload["name"].as_str().unwrap_or("?"), false)
            )),
            "approval.request" => {
                let choices: Vec<String> = payload["choices"]
                    .as_array()
                    .map(|a| {
                        a.iter()
                            .filter_map(|c| c.as_str().map(str::to_string))
                            .collect()
                    })
                    .unwrap_or_default();
                let mut left_running = if payload["background"] == true {
                    " (left running in the background)"
                } else {
                    ""
                }
                .to_string();
                if payload["masked"] == true {
                    left_running.push_str(
                        " (part of the command is masked as a secret: not all of what runs is shown)",
                    );
                }
                // Every rule the command matched (a `session` answer approves them all), not only
                // the first.
                let rules: Vec<&str> = payload["descriptions"]
                    .as_array()
                    .map(|d| d.iter().filter_map(Value::as_str).collect())
                    .filter(|d: &Vec<&str>| !d.is_empty())
                    .unwrap_or_else(|| vec![payload["description"].as_str().unwrap_or("")]);
                out(&format!(
                    "\n[approval needed: {}{left_running} — {}]\nchoose one of {}: ",
                    printable(payload["command"].as_str().unwrap_or(""), false),
                    printable(&rules.join("; "), false),
                    printable(&choices.join("/"), false)
                ));
                // A typo is asked again (it denied at once); the end of input denies.
                lines.question_shown();
                let choice = loop {
                    let line = match conn.read_answer(lines, &payload["prompt_id"]).await {
                        Read::Line(line) => line,
                        Read::Eof => {
                            out("[no more input; denying]\n");
                            break Some("deny".to_string());
                        }
                        Read::Ended(resolution) => {
                            out(&format!("\n[the approval ended without an answer from here: {resolution}]\n"));
                            break None;
                        }
                    };
                    let line = line.trim().to_string();
                    if choices.contains(&line) {
                        break Some(line);
                    }
                    out(&format!(
                        "[{line:?} is not one of them] choose one of {}: ",
                        choices.join("/")
                    ));
                };
                let Some(choice) = choice else {
                    continue;
                };
                let r = conn
                    .call(
                        "approval.respond",
                        json!({"session_id": session_id, "prompt_id": payload["prompt_id"],
                               "execution_generation": payload["execution_generation"], "choice": choice}),
                    )
                    .await;
                if let Some(why) = not_taken(&r, "approval", "prompt") {
                    out(&why);
                }
            }
            "clarify.request" => {
                // A batch of questions is asked one after the other and answered with the list
                // of answers (only the first used to be shown, and the others went unanswered).
                let batch: Vec<Value> = payload["questions"]
                    .as_array()
                    .filter(|q| q.len() > 1)
                    .cloned()
                    .unwrap_or_else(|| vec![payload.clone()]);
                let mut answers = Vec::with_capacity(batch.len());
                for question in &batch {
                    match ask_question(conn, lines, &payload["prompt_id"], question).await {
                        Some(answer) => answers.push(answer),
                        None => break,
                    }
                }
                if answers.len() < batch.len() {
                    continue;
                }
                let answer = if batch.len() > 1 {
                    Value::from(answers).to_string()
                } else {
                    answers.pop().unwrap_or_default()
                };
                let r = conn
                    .call(
                        "clarify.respond",
                        json!({"session_id": session_id, "prompt_id": payload["prompt_id"],
                               "execution_generation": payload["execution_generation"], "answer": answer}),
                    )
                    .await;
                if let Some(why) = not_taken(&r, "answer", "question") {
                    out(&why);
                }
            }
            // Cancelled while it was queued (by another client): no turn, no completion.
            "session.info" if payload["cancelled"] == admission => {
                out("[cancelled before it ran]\n");
                return Ok("cancelled".into());
            }
            "message.complete" if payload["admission_id"] == admission => {
                if !streamed {
                    out(&printable(payload["text"].as_str().unwrap_or(""), true));
                }
                let outcome = payload["outcome"].as_str().unwrap_or("").to_string();
                if outcome == "completed" {
                    out("\n");
                } else {
                    out(&format!("\n[{outcome}]\n"));
                }
                return Ok(outcome);
            }
            _ => {}
        }
    }
}

/// What to say when the daemon did not take the operator's `what` ("approval", "answer"): it
/// refused it, or the `prompt` had already ended.
fn not_taken(reply: &Result<Value, String>, what: &str, prompt: &str) -> Option<String> {
    match reply {
        Err(e) => Some(format!("[{what} not taken: {e}]\n")),
        Ok(r) if r["status"] == "already_resolved" => Some(format!(
            "[{what} not taken: the {prompt} had already ended]\n"
        )),
        Ok(_) => None,
    }
}

/// Ask one clarify `question` (its text, choices and `multi_select`) and read its answer: a
/// number picks that choice; the end of input is an empty answer. `None`: the prompt ended
/// without an answer from here.
async fn ask_question(
    conn: &mut Conn,
    lines: &mut Lines,
    prompt_id: &Value,
    question: &Value,
) -> Option<String> {
    let listed: Vec<String> = question["choices"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c.as_str().map(str::to_string))
        .collect();
    out(&format!(
        "\n[question: {}]\n",
        printable(question["question"].as_str().unwrap_or(""), true)
    ));
    for (i, choice) in listed.iter().enumerate() {
        out(&format!("  {}. {}\n", i + 1, printable(choice, false)));
    }
    out(if listed.is_empty() {
        "answer: "
    } else if question["multi_select"] == true {
        "answer (numbers separated by commas pick those choices): "
    } else {
        "answer (a number picks that choice; anything else is said as is): "
    });
    lines.question_shown();
    let answer = match conn.read_answer(lines, prompt_id).await {
        Read::Line(line) => line,
        Read::Eof => String::new(),
        Read::Ended(resolution) => {
            out(&format!(
                "\n[the question ended without an answer from here: {resolution}]\n"
            ));
            return None;
        }
    };
    Some(match answer.trim().parse::<usize>() {
        Ok(n) if (1..=listed.len()).contains(&n) => listed[n - 1].clone(),
        _ => answer.trim().to_string(),
    })
}

/// What came first while the operator was asked.
enum Read {
    Line(String),
    /// The end of input.
    Eof,
    /// The prompt ended without an answer from here, so (its resolution).
    Ended(String),
}

async fn reconnect(home: &Path) -> Result<Conn, String> {
    let mut delay = Duration::from_millis(200);
    for _ in 0..30 {
        match Conn::open(home).await {
            Ok(c) => return Ok(c),
            Err(_) => {
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(5));
            }
        }
    }
    Err("could not reconnect to the daemon".into())
}

#[cfg(test)]
mod tests {
    use super::{printable, Lines};
    use tokio::sync::mpsc;

    /// On a terminal, a line typed before a question was shown does not answer it: it is the
    /// next message instead. Piped, the lines answer in the order given.
    #[actix_rt::test]
    async fn lines_typed_before_a_question_are_not_its_answer() {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut lines = Lines::new(rx, true);
        for l in ["once", "next message"] {
            tx.send(l.to_string()).expect("send");
        }
        assert_eq!(lines.question_shown(), 2);
        tx.send("deny".to_string()).expect("send");
        assert_eq!(lines.answer().await.as_deref(), Some("deny"));
        assert_eq!(lines.input().await.as_deref(), Some("once"));
        assert_eq!(lines.input().await.as_deref(), Some("next message"));
        let (tx, rx) = mpsc::unbounded_channel();
        let mut piped = Lines::new(rx, false);
        tx.send("once".to_string()).expect("send");
        assert_eq!(piped.question_shown(), 0);
        assert_eq!(piped.answer().await.as_deref(), Some("once"));
    }

    #[test]
    fn text_is_printed_with_its_controls_shown() {
        assert!(matches!(
            printable("plain text\nwith a tab\t", true),
            std::borrow::Cow::Borrowed(_)
        ));
        assert_eq!(printable("a\nb\tc", false), "a^Jb^Ic");
        assert_eq!(printable("x\u{1b}[2K\ry\u{7f}", true), "x^[[2K^My^?");
        // C1 controls (CSI as one character) and bidirectional overrides.
        assert_eq!(printable("a\u{9b}2Kb", true), "a?2Kb");
        assert_eq!(
            printable("rm -rf /\u{202e}txt.exe", false),
            "rm -rf /?txt.exe"
        );
        assert_eq!(printable("é ✓", false), "é ✓");
    }
}
