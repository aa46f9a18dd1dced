//! A chaos model server: a raw HTTP/1.1 endpoint that answers each chat-completions request
//! according to a plan, with faults a well-behaved server never shows (resets mid-stream, stalls,
//! malformed SSE, oversized bodies, error bursts). Attempts are counted per user text.

#![allow(dead_code)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::io::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::helpers::last_user;

/// How to answer one request.
#[derive(Clone, Debug)]
pub enum Fault {
    /// A normal streamed answer with this content.
    Ok(String),
    /// A whole assistant message (content or tool calls) with this finish reason.
    Message(Value, &'static str),
    /// An HTTP error status with this body.
    Status(u16, String),
    /// Read the request, then close without answering.
    CloseWithoutResponse,
    /// Send the response head, then reset the connection (RST) before any event.
    ResetBeforeBody,
    /// Send the head and one content delta, then reset the connection once the flag is set
    /// (the test sets it when the client has shown the delta: an RST that overtook it would
    /// discard it unread).
    ResetMidStream(Arc<AtomicBool>),
    /// An HTTP/1.0 stream delimited by the connection (no length, not chunked): this content
    /// delta if any, then a clean close, with neither a finish_reason nor `[DONE]`.
    EndsEarly(Option<String>),
    /// An HTTP/1.0 stream delimited by the connection that closes (cleanly) halfway through
    /// its first event's `data:` line.
    EndsInsideEvent,
    /// The same over HTTP/1.1, with a whole answer: a framing the client does not read.
    CloseDelimited11(String),
    /// Send the head, then nothing at all (until the client gives up).
    Stall,
    /// Read the request, then send nothing, not even the response head (until the client
    /// gives up).
    NoHead,
    /// 429 with `Retry-After` of this many seconds.
    RetryAfter(u32),
    /// 503 with `Retry-After: 1`, a body of 500 bytes announced, and not one of them sent.
    StalledRefusal,
    /// A streamed answer with this content, a character an event, labelled `text/plain`.
    Mislabelled(String),
    /// 200 with a chunked body of nothing at all.
    EmptyChunked,
    /// A streamed answer with this content and its finish_reason, then an error event and a
    /// malformed one before `[DONE]`.
    ErrorAfterFinish(String),
    /// A whole streamed answer with its finish_reason, then silence: no `[DONE]`, no end.
    SilentAfterFinish(String),
    /// A whole streamed answer with its finish_reason, then the body cut short: the connection
    /// closes with neither `[DONE]` nor the chunked body's last chunk.
    CutAfterFinish(String),
    /// Only SSE comments (`: PROCESSING`), one every `every`: a server whose upstream is stuck.
    Comments(Duration),
    /// One small delta every `every`, never finishing.
    Drip(Duration),
    /// An SSE event whose data is not JSON.
    Malformed,
    /// A stream whose one event is this error object (`{"error": …}`), then `[DONE]`.
    SseError(Value),
    /// A streamed answer of this many one-character reasoning deltas, each in an event framed
    /// as OpenAI's are and padded to about 300 bytes, then `ACK_FAULT`.
    Chatty(usize),
    /// A streamed answer of about this many bytes of content.
    Huge(usize),
    /// A non-streamed JSON body of about this many bytes (Content-Length set).
    HugeJson(usize),
}

type Plan = dyn Fn(&Value, usize) -> Fault + Send + Sync;

thread_local! {
    /// When the connection of the request being planned was accepted (set on its thread).
    static ACCEPTED_AT: std::cell::Cell<Option<Instant>> = const { std::cell::Cell::new(None) };
}

/// When the connection of the request a plan is deciding was accepted: the moment the client
/// had sent it, give or take the accept, where the plan runs only once its thread has been
/// spawned and the whole body read (long after, on a loaded machine).
pub fn accepted_at() -> Option<Instant> {
    ACCEPTED_AT.with(|at| at.get())
}

pub struct ChaosModel {
    pub url: String,
    attempts: Arc<Mutex<HashMap<String, usize>>>,
    stop: Arc<AtomicBool>,
}

impl ChaosModel {
    /// `plan(last user text, attempt number from 1)` decides each answer.
    pub fn start(plan: impl Fn(&str, usize) -> Fault + Send + Sync + 'static) -> ChaosModel {
        Self::inspecting(move |body, n| plan(&last_user(body), n))
    }

    /// Like `start`, but the plan sees the whole request body. Bodies are not kept (a long run
    /// would hold every transcript many times over).
    pub fn inspecting(plan: impl Fn(&Value, usize) -> Fault + Send + Sync + 'static) -> ChaosModel {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind chaos model");
        let port = listener.local_addr().expect("addr").port();
        let attempts = Arc::new(Mutex::new(HashMap::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let plan: Arc<Plan> = Arc::new(plan);
        let (a, s) = (attempts.clone(), stop.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                if s.load(Ordering::Relaxed) {
                    return;
                }
                let Ok(stream) = stream else { continue };
                let accepted = Instant::now();
                let (a, s, plan) = (a.clone(), s.clone(), plan.clone());
                std::thread::spawn(move || {
                    ACCEPTED_AT.with(|at| at.set(Some(accepted)));
                    serve(stream, &a, &s, &*plan)
                });
            }
        });
        ChaosModel {
            url: format!("http://127.0.0.1:{port}/v1"),
            attempts,
            stop,
        }
    }

    /// How many requests carried this last user text.
    pub fn attempts(&self, text: &str) -> usize {
        self.attempts
            .lock()
            .map(|m| m.get(text).copied().unwrap_or(0))
            .unwrap_or(0)
    }
}

impl Drop for ChaosModel {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wake the accept loop so it sees the flag.
        let _ = TcpStream::connect(
            self.url
                .trim_start_matches("http://")
                .trim_end_matches("/v1"),
        );
    }
}

/// A loopback URL where nothing listens (connection refused), and what keeps it so: the port is
/// the local end of a connection kept open, which no listener may take. (A port freed by
/// dropping its listener went to the next test that asked for any port: under the whole suite,
/// now and then, the "dead" model was another test's live server.)
pub fn dead_url() -> (String, [TcpStream; 2]) {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let client = TcpStream::connect(l.local_addr().expect("addr")).expect("connect");
    let (server, _) = l.accept().expect("accept");
    let port = client.local_addr().expect("local addr").port();
    (format!("http://127.0.0.1:{port}/v1"), [client, server])
}

fn read_request(stream: &TcpStream) -> Option<Value> {
    let mut reader = BufReader::new(stream.try_clone().ok()?);
    let mut length = 0usize;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).ok()? == 0 {
            return None;
        }
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some(v) = l.to_ascii_lowercase().strip_prefix("content-length:") {
            length = v.trim().parse().unwrap_or(0);
        }
    }
    let mut body = vec![0u8; length];
    reader.read_exact(&mut body).ok()?;
    Some(serde_json::from_slice(&body).unwrap_or(Value::Null))
}

fn chunk(stream: &mut TcpStream, data: &str) -> std::io::Result<()> {
    stream.write_all(format!("{:x}\r\n{data}\r\n", data.len()).as_bytes())?;
    stream.flush()
}

fn delta(content: &str) -> String {
    let frame = json!({"id": "chaos", "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": null}]});
    format!("data: {frame}\n\n")
}

fn finish() -> String {
    let frame = json!({"id": "chaos", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                       "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}});
    format!("data: {frame}\n\ndata: [DONE]\n\n")
}

const SSE_HEAD: &str = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n";

/// Close with RST instead of FIN.
fn reset(stream: TcpStream) {
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: setting a socket option on a socket we own, with a correctly sized value.
    unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            &linger as *const libc::linger as *const libc::c_void,
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        );
    }
    drop(stream);
}

fn serve(
    mut stream: TcpStream,
    attempts: &Mutex<HashMap<String, usize>>,
    stop: &AtomicBool,
    plan: &Plan,
) {
    let Some(body) = read_request(&stream) else {
        return;
    };
    let text = last_user(&body);
    let n = {
        let mut m = attempts.lock().unwrap_or_else(|e| e.into_inner());
        let n = m.entry(text.clone()).or_insert(0);
        *n += 1;
        *n
    };
    let fault = plan(&body, n);
    let rst = matches!(fault, Fault::ResetBeforeBody | Fault::ResetMidStream(_));
    let _ = answer(&mut stream, fault, stop, &body);
    if rst {
        reset(stream);
    }
}

fn answer(
    stream: &mut TcpStream,
    fault: Fault,
    stop: &AtomicBool,
    body: &Value,
) -> std::io::Result<()> {
    let streaming = body["stream"].as_bool().unwrap_or(false);
    match fault {
        Fault::Ok(content) if !streaming => {
            let v = json!({"id": "chaos", "choices": [{"index": 0, "finish_reason": "stop",
                           "message": {"role": "assistant", "content": content}}]})
            .to_string();
            write!(
                stream,
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{v}",
                v.len()
            )
        }
        Fault::Ok(content) => {
            stream.write_all(SSE_HEAD.as_bytes())?;
            chunk(stream, &delta(&content))?;
            chunk(stream, &finish())?;
            stream.write_all(b"0\r\n\r\n")
        }
        Fault::Message(message, finish) => {
            let mut frame = json!({"id": "chaos", "choices": [{"index": 0, "finish_reason": finish}],
                                   "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}});
            if streaming {
                frame["choices"][0]["delta"] = message;
                stream.write_all(SSE_HEAD.as_bytes())?;
                chunk(stream, &format!("data: {frame}\n\ndata: [DONE]\n\n"))?;
                stream.write_all(b"0\r\n\r\n")
            } else {
                frame["choices"][0]["message"] = message;
                let v = frame.to_string();
                write!(
                    stream,
                    "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{v}",
                    v.len()
                )
            }
        }
        Fault::Status(code, text) => write!(
            stream,
            "HTTP/1.1 {code} Chaos\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{text}",
            text.len()
        ),
        Fault::RetryAfter(seconds) => write!(
            stream,
            "HTTP/1.1 429 Too Many Requests\r\nRetry-After: {seconds}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        ),
        Fault::ErrorAfterFinish(content) => {
            stream.write_all(SSE_HEAD.as_bytes())?;
            chunk(stream, &delta(&content))?;
            let last = finish();
            chunk(stream, last.trim_end_matches("data: [DONE]\n\n"))?;
            let error = json!({"error": {"message": "upstream went away", "code": 502}});
            chunk(stream, &format!("data: {error}\n\ndata: {{\"choices\n\n"))?;
            chunk(stream, "data: [DONE]\n\n")?;
            stream.write_all(b"0\r\n\r\n")
        }
        Fault::EmptyChunked => {
            stream.write_all(SSE_HEAD.replace("text/event-stream", "text/plain").as_bytes())?;
            stream.write_all(b"0\r\n\r\n")
        }
        Fault::Mislabelled(content) => {
            stream.write_all(SSE_HEAD.replace("text/event-stream", "text/plain").as_bytes())?;
            let mut events = String::new();
            for c in content.chars() {
                events.push_str(&delta(&c.to_string()));
            }
            chunk(stream, &events)?;
            chunk(stream, &finish())?;
            stream.write_all(b"0\r\n\r\n")
        }
        Fault::StalledRefusal => {
            write!(
                stream,
                "HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Length: 500\r\nContent-Type: application/json\r\n\r\n"
            )?;
            stream.flush()?;
            hold(stream, stop, Duration::from_secs(60), None)
        }
        Fault::CloseWithoutResponse => Ok(()),
        Fault::ResetBeforeBody => {
            stream.write_all(SSE_HEAD.as_bytes())?;
            stream.flush()
        }
        Fault::ResetMidStream(shown) => {
            stream.write_all(SSE_HEAD.as_bytes())?;
            chunk(stream, &delta("partial "))?;
            let deadline = Instant::now() + Duration::from_secs(30);
            while !shown.load(Ordering::SeqCst) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(5));
            }
            Ok(())
        }
        Fault::EndsEarly(content) => {
            stream.write_all(
                b"HTTP/1.0 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n",
            )?;
            if let Some(content) = content {
                stream.write_all(delta(&content).as_bytes())?;
            }
            stream.flush()
        }
        Fault::EndsInsideEvent => {
            stream.write_all(
                b"HTTP/1.0 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n",
            )?;
            stream.write_all(br#"data: {"choices":[{"index":0,"delta":{"content":"He"#)?;
            stream.flush()
        }
        Fault::CloseDelimited11(content) => {
            stream.write_all(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n",
            )?;
            stream.write_all(delta(&content).as_bytes())?;
            stream.write_all(finish().as_bytes())?;
            stream.flush()
        }
        Fault::Stall => {
            stream.write_all(SSE_HEAD.as_bytes())?;
            stream.flush()?;
            hold(stream, stop, Duration::from_secs(60), None)
        }
        Fault::NoHead => hold(stream, stop, Duration::from_secs(60), None),
        Fault::SilentAfterFinish(content) => {
            stream.write_all(SSE_HEAD.as_bytes())?;
            chunk(stream, &delta(&content))?;
            let last = finish();
            chunk(stream, last.trim_end_matches("data: [DONE]\n\n"))?;
            hold(stream, stop, Duration::from_secs(60), None)
        }
        Fault::CutAfterFinish(content) => {
            stream.write_all(SSE_HEAD.as_bytes())?;
            chunk(stream, &delta(&content))?;
            let last = finish();
            chunk(stream, last.trim_end_matches("data: [DONE]\n\n"))?;
            // Half a usage chunk, then the close.
            chunk(stream, "data: {\"choices\": [], \"usage\": {\"prompt_")?;
            stream.flush()
        }
        Fault::Comments(every) => {
            stream.write_all(SSE_HEAD.as_bytes())?;
            let deadline = Instant::now() + Duration::from_secs(60);
            while Instant::now() < deadline && !stop.load(Ordering::Relaxed) {
                std::thread::sleep(every);
                chunk(stream, ": PROCESSING\n\n")?;
            }
            Ok(())
        }
        Fault::Drip(every) => {
            stream.write_all(SSE_HEAD.as_bytes())?;
            hold(stream, stop, Duration::from_secs(60), Some(every))
        }
        Fault::SseError(error) => {
            stream.write_all(SSE_HEAD.as_bytes())?;
            chunk(stream, &format!("data: {}\n\n", json!({"error": error})))?;
            chunk(stream, "data: [DONE]\n\n")?;
            stream.write_all(b"0\r\n\r\n")
        }
        Fault::Malformed => {
            stream.write_all(SSE_HEAD.as_bytes())?;
            chunk(stream, "data: {\"choices\": [{\"delta\": {\"content\": \"x\"\n\n")?;
            chunk(stream, "data: [DONE]\n\n")?;
            stream.write_all(b"0\r\n\r\n")
        }
        Fault::Chatty(n) => {
            stream.write_all(SSE_HEAD.as_bytes())?;
            let event = json!({"id": "chatcmpl-chaos", "object": "chat.completion.chunk",
                "created": 1, "model": "chaos", "system_fingerprint": "f".repeat(160),
                "choices": [{"index": 0, "delta": {"reasoning_content": "t"}, "logprobs": null,
                             "finish_reason": null}]});
            for _ in 0..n {
                chunk(stream, &format!("data: {event}\n\n"))?;
            }
            chunk(stream, &delta("ACK_FAULT"))?;
            chunk(stream, &finish())?;
            stream.write_all(b"0\r\n\r\n")
        }
        Fault::Huge(bytes) => {
            stream.write_all(SSE_HEAD.as_bytes())?;
            let piece = "y".repeat(4096);
            let mut sent = 0;
            while sent < bytes {
                chunk(stream, &delta(&piece))?;
                sent += piece.len();
            }
            chunk(stream, &finish())?;
            stream.write_all(b"0\r\n\r\n")
        }
        Fault::HugeJson(bytes) => {
            let v = json!({"id": "chaos", "choices": [{"index": 0, "finish_reason": "stop",
                           "message": {"role": "assistant", "content": "z".repeat(bytes)}}]})
            .to_string();
            write!(
                stream,
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{v}",
                v.len()
            )
        }
    }
}

/// Keep the connection open (dripping deltas if asked) until the peer leaves or we stop.
fn hold(
    stream: &mut TcpStream,
    stop: &AtomicBool,
    max: Duration,
    drip: Option<Duration>,
) -> std::io::Result<()> {
    let deadline = Instant::now() + max;
    while Instant::now() < deadline && !stop.load(Ordering::Relaxed) {
        match drip {
            Some(every) => {
                std::thread::sleep(every);
                chunk(stream, &delta("."))?;
            }
            None => {
                std::thread::sleep(Duration::from_millis(50));
                // A zero-byte write does not reach the peer; probe for a closed connection.
                stream.set_nonblocking(true)?;
                let mut b = [0u8; 1];
                let gone = matches!(stream.read(&mut b), Ok(0));
                stream.set_nonblocking(false)?;
                if gone {
                    return Ok(());
                }
            }
        }
    }
    Ok(())
}
