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
        })
    }

    async fn recv(&mut self) -> Option<Value> {
        if !self.backlog.is_empty() {
            return Some(self.backlog.remove(0));
        }
        loop {
            match self.framed.next().await? {
                Ok(awc::ws::Frame::Text(b)) => return serde_json::from_slice(&b).ok(),
                Ok(awc::ws::Frame::Ping(p)) => {
                    let _ = self.framed.send(awc::ws::Message::Pong(p)).await;
                }
                Ok(awc::ws::Frame::Close(_)) | Err(_) => return None,
                Ok(_) => {}
            }
        }
    }

    async fn call(&mut self, method: &str, params: Value) -> Result<Value, String> {
        let id = format!("chat-{}", self.next_id);
        self.next_id += 1;
        let frame =
            json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}).to_string();
        self.framed
            .send(awc::ws::Message::Text(frame.into()))
            .await
            .map_err(|e| e.to_string())?;
        let mut held = Vec::new();
        let result = loop {
            let Some(v) = self.recv().await else {
                break Err("connection closed".to_string());
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
}

fn stdin_lines() -> mpsc::UnboundedReceiver<String> {
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
    rx
}

fn out(text: &str) {
    let mut o = std::io::stdout();
    let _ = o.write_all(text.as_bytes());
    let _ = o.flush();
}

/// Run the client until the given text's turn completes (or stdin ends, interactively).
pub async fn run(opts: ChatOptions) -> Result<(), String> {
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
    let mut lines = stdin_lines();
    let interactive = opts.text.is_none();
    let mut first = opts.text.clone();
    loop {
        let text = match first.take() {
            Some(t) => t,
            None if interactive => {
                out("> ");
                match lines.recv().await {
                    Some(l) if l.trim().is_empty() => continue,
                    Some(l) => l,
                    None => return Ok(()),
                }
            }
            None => return Ok(()),
        };
        let input_id = uuid::Uuid::new_v4().simple().to_string();
        let receipt = conn
            .call(
                "prompt.submit",
                json!({"session_id": session_id, "input_id": input_id, "text": text}),
            )
            .await?;
        let admission = receipt["admission_id"]
            .as_str()
            .ok_or("no admission id")?
            .to_string();
        follow(&mut conn, &opts.home, &session_id, &admission, &mut lines).await?;
        if !interactive {
            return Ok(());
        }
    }
}

/// Stream one admission's events until it completes, answering prompts, reconnecting on drops.
async fn follow(
    conn: &mut Conn,
    home: &Path,
    session_id: &str,
    admission: &str,
    lines: &mut mpsc::UnboundedReceiver<String>,
) -> Result<(), String> {
    let mut streamed = false;
    loop {
        let Some(frame) = conn.recv().await else {
            out("\n[connection lost; reconnecting]\n");
            *conn = reconnect(home).await?;
            conn.call("session.resume", json!({"session_id": session_id}))
                .await?;
            let r = conn
                .call(
                    "prompt.receipt",
                    json!({"session_id": session_id, "admission_id": admission}),
                )
                .await?;
            if r["status"] == "unknown" {
                // The daemon stopped (crashed) while this input ran: it is never run again and
                // no completion will come. Only an operator can settle it.
                return Err(format!(
                    "input {admission} was running when the daemon stopped; its outcome is unknown and it \
                     will not run again. Check what it did, then settle it with: \
                     gatehouse resolve-unknown {session_id} {admission}"
                ));
            }
            if r["status"] == "terminal" {
                let text = r["result"]["final_response"].as_str().unwrap_or("");
                out(&format!(
                    "{text}\n[{}]\n",
                    r["outcome"].as_str().unwrap_or("")
                ));
                return Ok(());
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
                    out(t);
                }
            }
            "tool.start" => out(&format!(
                "\n[tool {}: {}]\n",
                payload["name"].as_str().unwrap_or("?"),
                payload["arguments"].as_str().unwrap_or("")
            )),
            "tool.complete" => out(&format!(
                "[tool {} done]\n",
                payload["name"].as_str().unwrap_or("?")
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
                out(&format!(
                    "\n[approval needed: {} — {}]\nchoose one of {}: ",
                    payload["command"].as_str().unwrap_or(""),
                    payload["description"].as_str().unwrap_or(""),
                    choices.join("/")
                ));
                let mut choice = lines
                    .recv()
                    .await
                    .unwrap_or_else(|| "deny".into())
                    .trim()
                    .to_string();
                if !choices.contains(&choice) {
                    out(&format!("[{choice:?} is not offered; denying]\n"));
                    choice = "deny".into();
                }
                let r = conn
                    .call(
                        "approval.respond",
                        json!({"session_id": session_id, "prompt_id": payload["prompt_id"],
                               "execution_generation": payload["execution_generation"], "choice": choice}),
                    )
                    .await;
                if let Err(e) = r {
                    out(&format!("[approval not taken: {e}]\n"));
                }
            }
            "clarify.request" => {
                let choices = payload["choices"].as_array().cloned().unwrap_or_default();
                let listed: Vec<String> = choices
                    .iter()
                    .filter_map(|c| c.as_str().map(str::to_string))
                    .collect();
                out(&format!(
                    "\n[question: {}]\n",
                    payload["question"].as_str().unwrap_or("")
                ));
                if !listed.is_empty() {
                    out(&format!("choices: {}\n", listed.join(" / ")));
                }
                out("answer: ");
                let answer = lines.recv().await.unwrap_or_default();
                let r = conn
                    .call(
                        "clarify.respond",
                        json!({"session_id": session_id, "prompt_id": payload["prompt_id"],
                               "execution_generation": payload["execution_generation"], "answer": answer.trim()}),
                    )
                    .await;
                if let Err(e) = r {
                    out(&format!("[answer not taken: {e}]\n"));
                }
            }
            "message.complete" if payload["admission_id"] == admission => {
                if !streamed {
                    out(payload["text"].as_str().unwrap_or(""));
                }
                let outcome = payload["outcome"].as_str().unwrap_or("");
                if outcome == "completed" {
                    out("\n");
                } else {
                    out(&format!("\n[{outcome}]\n"));
                }
                return Ok(());
            }
            _ => {}
        }
    }
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
