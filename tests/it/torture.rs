//! Kill-anywhere torture: sessions submit inputs (some gated by approvals, some asking
//! clarifications, some slow) while the daemon is SIGKILLed or SIGTERMed at random moments and
//! restarted. The harness answers prompts, retries unacknowledged submits and resolves `unknown`
//! admissions like an operator. After every stop and at the end it checks, from `state.db` and the
//! fake model's request log:
//!
//! - every acknowledged admission exists with its identity (input id, session, text);
//! - no input reached the model twice, and no request carries a merged or repeated user turn;
//! - per session, the model saw inputs in admission order;
//! - no gated command ran without an approval the harness gave;
//! - at most one `started` row per session, and none of an older epoch after a boot;
//! - settled transcripts hold each input once, as its own user message.
//!
//! After a SIGTERM also: exit 0, every started turn ended `interrupted` (or had already been
//! answered), queued work stayed queued, nothing became `unknown`, no model call followed.
//!
//! Defaults keep `cargo test` quick (25 kills, 25 SIGTERMs); by hand:
//! `GATEHOUSE_TORTURE_KILLS=500 cargo test --release --test it torture -- --nocapture`
//! (`GATEHOUSE_TORTURE_TERMS`, `GATEHOUSE_TORTURE_SESSIONS`, `GATEHOUSE_TORTURE_SEED` too).

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gatehouse::store::admissions::AdmissionRow;
use serde_json::json;

use crate::chaos::{accepted_at, ChaosModel, Fault};
use crate::helpers::*;

/// xorshift64*: small, seeded, deterministic.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.max(1))
    }
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo)
    }
    fn percent(&mut self, p: u64) -> bool {
        self.below(100) < p
    }
}

fn env_num(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Plain,
    Slow,
    Approve,
    Clarify,
}

impl Kind {
    fn of(text: &str) -> Kind {
        match text.rsplit('-').next() {
            Some("slow") => Kind::Slow,
            Some("approve") => Kind::Approve,
            Some("clarify") => Kind::Clarify,
            _ => Kind::Plain,
        }
    }
    fn name(self) -> &'static str {
        match self {
            Kind::Plain => "plain",
            Kind::Slow => "slow",
            Kind::Approve => "approve",
            Kind::Clarify => "clarify",
        }
    }
}

/// One model request as the fake model saw it: last user text, after a tool result?, when its
/// connection was accepted.
#[derive(Clone)]
struct Seen {
    text: String,
    after_tool: bool,
    at: Instant,
}

fn session_of(text: &str) -> usize {
    text.trim_start_matches('S')
        .split('-')
        .next()
        .and_then(|s| s.parse().ok())
        .unwrap_or(usize::MAX)
}

fn small_hash(s: &str) -> u64 {
    s.bytes().fold(1469598103934665603u64, |h, b| {
        (h ^ b as u64).wrapping_mul(1099511628211)
    })
}

/// What the model saw, kept small: one entry per request, and the user turns it carried.
#[derive(Default)]
struct ModelLog {
    seen: Vec<Seen>,
    /// Every distinct user turn text in any request (each must be exactly one input).
    user_turns: HashSet<String>,
    /// Requests that carried the same user turn twice.
    repeated: Vec<Vec<String>>,
}

fn torture_model(victims: PathBuf, log: Arc<Mutex<ModelLog>>) -> ChaosModel {
    ChaosModel::inspecting(move |body, _| {
        let text = last_user(body);
        let tool = after_tool(body);
        let users = user_texts(body);
        if let Ok(mut l) = log.lock() {
            l.seen.push(Seen {
                text: text.clone(),
                after_tool: tool,
                at: accepted_at().unwrap_or_else(Instant::now),
            });
            let distinct: HashSet<&String> = users.iter().collect();
            if distinct.len() != users.len() {
                l.repeated.push(users.clone());
            }
            l.user_turns.extend(users);
        }
        let h = small_hash(&text);
        if tool {
            std::thread::sleep(Duration::from_millis(h % 15));
            return Fault::Message(
                json!({"role": "assistant", "content": format!("DONE_{text}")}),
                "stop",
            );
        }
        match Kind::of(&text) {
            Kind::Plain => {
                std::thread::sleep(Duration::from_millis(h % 20));
                Fault::Message(
                    json!({"role": "assistant", "content": format!("ACK_{text}")}),
                    "stop",
                )
            }
            Kind::Slow => {
                std::thread::sleep(Duration::from_millis(100 + h % 400));
                Fault::Message(
                    json!({"role": "assistant", "content": format!("SLOW_{text}")}),
                    "stop",
                )
            }
            Kind::Approve => {
                let command = format!("rm -rf -- {}", victims.join(&text).display());
                Fault::Message(
                    tool_call(
                        &format!("call_{h}"),
                        "terminal",
                        json!({"command": command}),
                    ),
                    "tool_calls",
                )
            }
            Kind::Clarify => Fault::Message(
                tool_call(
                    &format!("call_{h}"),
                    "clarify",
                    json!({"question": format!("Which one for {text}?"), "choices": ["a", "b"]}),
                ),
                "tool_calls",
            ),
        }
    })
}

struct Acked {
    admission_id: String,
    session: usize,
}

struct Torture {
    home: Home,
    /// The model server (kept alive for the whole run).
    _model: ChaosModel,
    log: Arc<Mutex<ModelLog>>,
    victims: PathBuf,
    rng: Rng,
    sids: Vec<String>,
    next_input: usize,
    /// Every input ever sent (text = input id), in the order first sent.
    sent: Vec<String>,
    acked: HashMap<String, Acked>,
    /// Admissions the harness answered `once` (sent before the answer went out).
    approved: HashSet<String>,
    denied: HashSet<String>,
    resolved_unknown: usize,
    answered: usize,
}

impl Torture {
    fn rows(&self) -> Vec<AdmissionRow> {
        self.home.admissions()
    }

    fn new_input(&mut self) -> String {
        let session = self.rng.below(self.sids.len() as u64) as usize;
        let kind = match self.rng.below(100) {
            0..=39 => Kind::Plain,
            40..=64 => Kind::Slow,
            65..=84 => Kind::Approve,
            _ => Kind::Clarify,
        };
        let text = format!("S{session}-N{}-{}", self.next_input, kind.name());
        self.next_input += 1;
        if kind == Kind::Approve {
            std::fs::create_dir_all(self.victims.join(&text).join("inside")).expect("victim");
        }
        self.sent.push(text.clone());
        text
    }

    fn submit_frame(&self, text: &str, id: &str) -> String {
        let session = session_of(text);
        json!({"jsonrpc": "2.0", "id": id, "method": "prompt.submit",
               "params": {"session_id": self.sids[session], "input_id": text, "text": text}})
        .to_string()
    }

    async fn submit(&mut self, ws: &mut Ws, text: &str) {
        let session = session_of(text);
        let v = ws
            .call(
                "prompt.submit",
                json!({"session_id": self.sids[session], "input_id": text, "text": text}),
            )
            .await;
        let r = &v["result"];
        assert!(r.is_object(), "submit {text}: {v}");
        let admission_id = r["admission_id"]
            .as_str()
            .expect("admission id")
            .to_string();
        if let Some(prev) = self.acked.get(text) {
            assert_eq!(
                prev.admission_id, admission_id,
                "a retried submit of {text} must return the same admission"
            );
        }
        self.acked.insert(
            text.to_string(),
            Acked {
                admission_id,
                session,
            },
        );
    }

    /// Answer the open prompts of one session, like a user.
    async fn answer_prompts(&mut self, ws: &mut Ws, session: usize) {
        let sid = self.sids[session].clone();
        let snap = ws.ok("session.resume", json!({"session_id": sid})).await;
        for p in snap["prompts"].as_array().cloned().unwrap_or_default() {
            let admission = p["admission_id"].as_str().unwrap_or("").to_string();
            let v = if p["kind"] == "approval" {
                let choice = if self.rng.percent(70) { "once" } else { "deny" };
                if choice == "once" {
                    self.approved.insert(admission);
                } else {
                    self.denied.insert(admission);
                }
                ws.call(
                    "approval.respond",
                    json!({"session_id": sid, "execution_generation": p["execution_generation"],
                           "prompt_id": p["prompt_id"], "choice": choice}),
                )
                .await
            } else {
                ws.call(
                    "clarify.respond",
                    json!({"session_id": sid, "execution_generation": p["execution_generation"],
                           "prompt_id": p["prompt_id"], "answer": "a"}),
                )
                .await
            };
            // The turn may have ended meanwhile (stale); anything else is a bug.
            let reason = v["error"]["data"]["reason"].as_str().unwrap_or("");
            assert!(
                v.get("result").is_some() || reason == "stale_generation",
                "answering {p}: {v}"
            );
            self.answered += 1;
        }
    }

    /// Boot work of an operator: subscribe, resolve every unknown row, retry unacked submits.
    async fn recover(&mut self, ws: &mut Ws) {
        for sid in self.sids.clone() {
            ws.ok("session.resume", json!({"session_id": sid})).await;
        }
        for row in self.rows() {
            if row.status == "unknown" {
                let r = ws
                    .ok(
                        "prompt.resolve_unknown",
                        json!({"session_id": row.target_session_id, "admission_id": row.admission_id,
                               "execution_generation": row.execution_generation}),
                    )
                    .await;
                assert_eq!(
                    (r["status"].as_str(), r["outcome"].as_str()),
                    (Some("terminal"), Some("interrupted"))
                );
                self.resolved_unknown += 1;
            }
        }
        let unacked: Vec<String> = self
            .sent
            .iter()
            .filter(|t| !self.acked.contains_key(*t))
            .cloned()
            .collect();
        for text in unacked {
            self.submit(ws, &text).await;
        }
    }

    /// Random client activity for a random while; maybe leave a request in flight.
    async fn activity(&mut self, ws: &mut Ws) {
        let budget = Duration::from_millis(self.rng.range(10, 450));
        let start = Instant::now();
        while start.elapsed() < budget {
            match self.rng.below(10) {
                0..=2 => {
                    let text = self.new_input();
                    self.submit(ws, &text).await;
                }
                3..=5 => {
                    let s = self.rng.below(self.sids.len() as u64) as usize;
                    self.answer_prompts(ws, s).await;
                }
                _ => {
                    let ms = self.rng.range(2, 40);
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                }
            }
        }
        if self.rng.percent(30) {
            // A submit whose reply we never wait for: it may or may not be admitted.
            let text = self.new_input();
            let frame = self.submit_frame(&text, "in-flight");
            ws.send_raw(frame).await;
            if self.rng.percent(50) {
                tokio::time::sleep(Duration::from_millis(self.rng.range(0, 5))).await;
            }
        }
    }

    fn seen(&self) -> Vec<Seen> {
        self.log.lock().map(|l| l.seen.clone()).unwrap_or_default()
    }

    /// The invariants that hold at every point we look. `live`: the daemon is running, so the
    /// transcripts may be mid-write and are checked only once it has stopped.
    fn check(&mut self, when: &str, epoch: Option<i64>, live: bool) {
        let rows = self.rows();
        let by_admission: HashMap<&str, &AdmissionRow> =
            rows.iter().map(|r| (r.admission_id.as_str(), r)).collect();
        let by_input: HashMap<&str, &AdmissionRow> =
            rows.iter().map(|r| (r.request_id.as_str(), r)).collect();
        assert_eq!(
            by_input.len(),
            rows.len(),
            "{when}: one admission per input id"
        );
        // Acknowledged admissions exist with their identity.
        for (text, ack) in &self.acked {
            let row = by_admission
                .get(ack.admission_id.as_str())
                .unwrap_or_else(|| panic!("{when}: acknowledged {text} lost"));
            assert_eq!(row.request_id, *text, "{when}");
            assert_eq!(row.target_session_id, self.sids[ack.session], "{when}");
            assert_eq!(row.text(), *text, "{when}");
        }
        // At most one started row per session; after a boot none of an older epoch.
        for sid in &self.sids {
            let started: Vec<&AdmissionRow> = rows
                .iter()
                .filter(|r| &r.target_session_id == sid && r.status == "started")
                .collect();
            assert!(started.len() <= 1, "{when}: {} started rows", started.len());
            if let Some(e) = epoch {
                assert!(
                    started.iter().all(|r| r.owner_epoch == Some(e)),
                    "{when}: a started row of an older epoch survived the boot"
                );
            }
        }
        // The model log: each input opened at most one turn, in admission order per session,
        // and no request carries a merged, unknown or repeated user turn.
        let seen = self.seen();
        let mut opened: HashMap<&str, usize> = HashMap::new();
        let mut last_seq: HashMap<usize, i64> = HashMap::new();
        for s in seen.iter().filter(|s| !s.after_tool) {
            *opened.entry(s.text.as_str()).or_default() += 1;
            let row = by_input
                .get(s.text.as_str())
                .unwrap_or_else(|| panic!("{when}: the model saw {} with no admission", s.text));
            let session = session_of(&s.text);
            if let Some(prev) = last_seq.insert(session, row.seq) {
                assert!(
                    prev < row.seq,
                    "{when}: session {session} ran seq {} after seq {prev}",
                    row.seq
                );
            }
        }
        for (text, n) in &opened {
            assert_eq!(*n, 1, "{when}: {text} reached the model {n} times");
        }
        let known: HashSet<&str> = self.sent.iter().map(String::as_str).collect();
        {
            let log = self.log.lock().expect("model log");
            assert!(
                log.repeated.is_empty(),
                "{when}: a repeated user turn in {:?}",
                log.repeated
            );
            for u in &log.user_turns {
                assert!(known.contains(u.as_str()), "{when}: merged user turn {u:?}");
            }
        }
        // No gated command ran without the harness's approval.
        for text in self.sent.iter().filter(|t| Kind::of(t) == Kind::Approve) {
            let gone = !self.victims.join(text).exists();
            let admission = by_input.get(text.as_str()).map(|r| r.admission_id.clone());
            let approved = admission
                .as_ref()
                .is_some_and(|a| self.approved.contains(a));
            assert!(
                !gone || approved,
                "{when}: the gated command of {text} ran without approval"
            );
            if let Some(a) = &admission {
                if self.denied.contains(a) && !self.approved.contains(a) {
                    assert!(!gone, "{when}: {text} ran although denied");
                }
            }
        }
        // Settled sessions: each input at most once in the transcript, as its own user message.
        if live {
            return;
        }
        for (i, sid) in self.sids.iter().enumerate() {
            let open = rows.iter().any(|r| {
                &r.target_session_id == sid && (r.status == "started" || r.status == "unknown")
            });
            if open {
                continue;
            }
            let transcript = self.home.transcript(sid);
            let mut users = HashSet::new();
            let mut prev_user = false;
            for m in &transcript {
                if m.role == "user" {
                    assert!(!prev_user, "{when}: session {i}: two user turns in a row");
                    let content = m.content.clone().unwrap_or_default();
                    let row = by_input.get(content.as_str()).unwrap_or_else(|| {
                        panic!("{when}: session {i}: user turn {content:?} is no input")
                    });
                    assert_eq!(
                        m.admission_id.as_deref(),
                        Some(row.admission_id.as_str()),
                        "{when}"
                    );
                    assert!(
                        users.insert(content.clone()),
                        "{when}: {content} twice in the transcript"
                    );
                }
                prev_user = m.role == "user";
            }
            assert!(!prev_user, "{when}: session {i}: an unclosed user turn");
            for r in rows.iter().filter(|r| &r.target_session_id == sid) {
                if r.outcome.as_deref() == Some("completed") {
                    assert!(
                        users.contains(&r.text()),
                        "{when}: completed {} missing from the transcript",
                        r.request_id
                    );
                }
            }
        }
    }

    /// After a SIGTERM: compare the ledger before the signal with the ledger after the exit.
    fn check_term(&self, before: &[AdmissionRow], stopping_seen: Instant) {
        // The drain reaches running turns just after the phase flips; allow for a loaded machine.
        let slack = Duration::from_millis(500);
        let after = self.rows();
        let before: HashMap<&str, &AdmissionRow> = before
            .iter()
            .map(|r| (r.admission_id.as_str(), r))
            .collect();
        let seen = self.seen();
        for row in &after {
            assert_ne!(
                row.status, "started",
                "SIGTERM left {} started",
                row.request_id
            );
            // A row admitted after the snapshot (a submit still in flight) counts as queued.
            let old = before.get(row.admission_id.as_str());
            if let Some(old) = old.filter(|o| o.status == "terminal" || o.status == "unknown") {
                assert_eq!(
                    (&row.status, &row.outcome, row.execution_generation),
                    (&old.status, &old.outcome, old.execution_generation),
                    "SIGTERM changed settled work {}",
                    row.request_id
                );
                continue;
            }
            assert_ne!(
                row.status, "unknown",
                "SIGTERM made {} unknown",
                row.request_id
            );
            if row.status == "terminal" && row.outcome.as_deref() != Some("interrupted") {
                // Only a turn whose last model answer was already on its way may finish.
                let last = seen
                    .iter()
                    .filter(|s| s.text == row.request_id)
                    .map(|s| s.at)
                    .max();
                assert!(
                    last.is_some_and(|t| t <= stopping_seen + slack),
                    "{} settled {:?} after the stop began",
                    row.request_id,
                    row.outcome
                );
            }
        }
        for s in &seen {
            assert!(
                s.at <= stopping_seen + slack,
                "a model request for {} followed the stop",
                s.text
            );
        }
    }
}

#[actix_rt::test]
async fn kill_anywhere_torture_keeps_every_promise() {
    let kills = env_num("GATEHOUSE_TORTURE_KILLS", 25);
    let terms = env_num("GATEHOUSE_TORTURE_TERMS", 25);
    let sessions = env_num("GATEHOUSE_TORTURE_SESSIONS", 4).max(1);
    let seed = env_num(
        "GATEHOUSE_TORTURE_SEED",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(7),
    );
    println!(
        "torture: seed={seed} kills={kills} sigterms={terms} sessions={sessions} \
         (replay with GATEHOUSE_TORTURE_SEED={seed})"
    );
    let began = Instant::now();
    let home = Home::new();
    let victims = home.path.join("victims");
    std::fs::create_dir_all(&victims).expect("victims");
    let log = Arc::new(Mutex::new(ModelLog::default()));
    let model = torture_model(victims.clone(), log.clone());
    home.write_config(&config(
        &model.url,
        json!({"compression": {"enabled": false}, "gateway": {"drain_timeout_seconds": 30}}),
    ));
    let mut t = Torture {
        home,
        _model: model,
        log,
        victims,
        rng: Rng::new(seed),
        sids: Vec::new(),
        next_input: 0,
        sent: Vec::new(),
        acked: HashMap::new(),
        approved: HashSet::new(),
        denied: HashSet::new(),
        resolved_unknown: 0,
        answered: 0,
    };
    let mut plan: Vec<bool> = (0..kills)
        .map(|_| true)
        .chain((0..terms).map(|_| false))
        .collect();
    for i in (1..plan.len()).rev() {
        let j = t.rng.below(i as u64 + 1) as usize;
        plan.swap(i, j);
    }
    let (mut survived, mut stopped) = (0u64, 0u64);
    for (round, kill) in plan.into_iter().enumerate() {
        let round_began = Instant::now();
        let mut d = Daemon::start(&t.home);
        let booted = round_began.elapsed();
        t.check(&format!("round {round} after boot"), Some(d.epoch()), true);
        let mut ws = d.ws().await;
        if t.sids.is_empty() {
            for s in 0..sessions {
                let sid = ws.session(&format!("torture-{s}"), &t.home.path).await;
                t.sids.push(sid);
            }
        }
        t.recover(&mut ws).await;
        let recovered = round_began.elapsed();
        t.activity(&mut ws).await;
        let acted = round_began.elapsed();
        if kill {
            d.kill();
            survived += 1;
            t.check(&format!("round {round} after SIGKILL"), None, false);
        } else {
            let before = t.rows();
            // SAFETY: signalling our own child.
            unsafe {
                libc::kill(d.child.id() as i32, libc::SIGTERM);
            }
            // The stop has begun once identify says so (or the socket is gone).
            let stopping_seen = loop {
                match control(&t.home.path, "identify", json!({})) {
                    Ok(v) if v["state"] == "ready" => std::thread::sleep(Duration::from_millis(2)),
                    _ => break Instant::now(),
                }
            };
            let deadline = Instant::now() + Duration::from_secs(60);
            let code = loop {
                if let Ok(Some(status)) = d.child.try_wait() {
                    break status.code();
                }
                assert!(Instant::now() < deadline, "no exit after SIGTERM");
                std::thread::sleep(Duration::from_millis(10));
            };
            assert_eq!(code, Some(0), "round {round}: a graceful stop exits 0");
            t.check_term(&before, stopping_seen);
            t.check(&format!("round {round} after SIGTERM"), None, false);
            stopped += 1;
        }
        drop(ws);
        println!(
            "torture round {round} ({}): booted {booted:?}, recovered {recovered:?}, \
             acted {acted:?}, stopped {:?}",
            if kill { "SIGKILL" } else { "SIGTERM" },
            round_began.elapsed()
        );
    }
    // The end: one more boot; the operator resolves what is unknown, the user answers every
    // prompt, and everything settles.
    let d = Daemon::start(&t.home);
    t.check("final boot", Some(d.epoch()), true);
    let mut ws = d.ws().await;
    if t.sids.is_empty() {
        for s in 0..sessions {
            let sid = ws.session(&format!("torture-{s}"), &t.home.path).await;
            t.sids.push(sid);
        }
    }
    t.recover(&mut ws).await;
    let deadline = Instant::now() + Duration::from_secs(120);
    while !t.rows().iter().all(|r| r.status == "terminal") {
        assert!(Instant::now() < deadline, "work did not settle");
        for s in 0..t.sids.len() {
            t.answer_prompts(&mut ws, s).await;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    t.check("the end", Some(d.epoch()), false);
    let rows = t.rows();
    let seen = t.seen();
    let mut opened: HashMap<&str, usize> = HashMap::new();
    for s in seen.iter().filter(|s| !s.after_tool) {
        *opened.entry(s.text.as_str()).or_default() += 1;
    }
    for r in &rows {
        if r.outcome.as_deref() == Some("completed") {
            assert_eq!(
                opened.get(r.request_id.as_str()).copied(),
                Some(1),
                "{} completed without exactly one model turn",
                r.request_id
            );
        }
    }
    let mut outcomes: HashMap<String, usize> = HashMap::new();
    for r in &rows {
        *outcomes
            .entry(r.outcome.clone().unwrap_or_default())
            .or_default() += 1;
    }
    assert_eq!(survived, kills);
    assert_eq!(stopped, terms);
    println!(
        "torture: survived {survived} kill points and {stopped} SIGTERMs, all invariants held; \
         {} admissions ({} acknowledged), outcomes {outcomes:?}, {} unknown resolved, {} prompts \
         answered ({} approved), {} model requests, {:.1}s, seed {seed}",
        rows.len(),
        t.acked.len(),
        t.resolved_unknown,
        t.answered,
        t.approved.len(),
        seen.len(),
        began.elapsed().as_secs_f64()
    );
}

#[test]
fn the_rng_is_deterministic() {
    let (mut a, mut b) = (Rng::new(42), Rng::new(42));
    let xs: Vec<u64> = (0..8).map(|_| a.below(1000)).collect();
    let ys: Vec<u64> = (0..8).map(|_| b.below(1000)).collect();
    assert_eq!(xs, ys);
    assert!(xs.iter().any(|x| *x != xs[0]));
}
