//! Logging set-up and the counters behind `/metrics` (Prometheus text format).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use tracing_subscriber::EnvFilter;

/// Install the global subscriber: human format, or JSON lines with `json == true`.
pub fn init_logging(json: bool) {
    let filter = match std::env::var(EnvFilter::DEFAULT_ENV) {
        Ok(spec) => EnvFilter::try_new(&spec).unwrap_or_else(|e| {
            // Said, not silently replaced: a typo in a unit's drop-in otherwise looked like a
            // daemon that logs nothing of what was asked.
            eprintln!("gatehouse: RUST_LOG={spec:?} is not a log filter ({e}); logging at info");
            EnvFilter::new("info")
        }),
        Err(_) => EnvFilter::new("info"),
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = if json {
        builder.json().try_init()
    } else {
        builder.with_ansi(false).try_init()
    };
}

/// Turns and model calls: from an instant fake's milliseconds to a model's 600 s time-out and a
/// room turn's 1830 s deadline.
const TURN_BUCKETS: [f64; BUCKETS] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0, 30.0, 60.0, 180.0, 600.0, 1800.0,
];
const DB_BUCKETS: [f64; BUCKETS] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 30.0,
];
const BUCKETS: usize = 14;

/// A fixed-bucket histogram.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64; BUCKETS],
    inner: Mutex<([u64; BUCKETS], u64, f64)>,
}

impl Histogram {
    const fn new(bounds: &'static [f64; BUCKETS]) -> Self {
        Self {
            bounds,
            inner: Mutex::new(([0; BUCKETS], 0, 0.0)),
        }
    }

    pub fn observe(&self, seconds: f64) {
        if let Ok(mut h) = self.inner.lock() {
            for (i, b) in self.bounds.iter().enumerate() {
                if seconds <= *b {
                    h.0[i] += 1;
                }
            }
            h.1 += 1;
            h.2 += seconds;
        }
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} histogram\n"));
        if let Ok(h) = self.inner.lock() {
            for (i, b) in self.bounds.iter().enumerate() {
                out.push_str(&format!("{name}_bucket{{le=\"{b}\"}} {}\n", h.0[i]));
            }
            out.push_str(&format!("{name}_bucket{{le=\"+Inf\"}} {}\n", h.1));
            out.push_str(&format!("{name}_sum {}\n{name}_count {}\n", h.2, h.1));
        }
    }
}

/// Process-wide counters.
#[derive(Debug)]
pub struct Metrics {
    admissions: AtomicU64,
    turns_started: AtomicU64,
    /// Turns whose start (session rows and transcript) was not read by their claim.
    turn_starts_read_apart: AtomicU64,
    turns_finished: AtomicU64,
    prompts_open: AtomicU64,
    active_sessions: AtomicU64,
    ws_connections: AtomicU64,
    ws_connections_total: AtomicU64,
    model_errors: Mutex<Vec<(String, u64)>>,
    turn_hist: Histogram,
    /// Model request latency (each HTTP call, retries included).
    pub model_hist: Histogram,
    /// Database job latency (queue wait plus transaction).
    pub db_hist: Histogram,
    /// Write transitions committed (or refused) by the writer.
    db_writes: AtomicU64,
    /// Eviction sweeps of the session registry, and the supervisors they asked whether idle.
    eviction_sweeps: AtomicU64,
    eviction_asks: AtomicU64,
    /// Model calls that found every request slot of their endpoint taken and waited.
    model_slot_waits: AtomicU64,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            admissions: AtomicU64::new(0),
            turns_started: AtomicU64::new(0),
            turn_starts_read_apart: AtomicU64::new(0),
            turns_finished: AtomicU64::new(0),
            prompts_open: AtomicU64::new(0),
            active_sessions: AtomicU64::new(0),
            ws_connections: AtomicU64::new(0),
            ws_connections_total: AtomicU64::new(0),
            model_errors: Mutex::new(Vec::new()),
            turn_hist: Histogram::new(&TURN_BUCKETS),
            model_hist: Histogram::new(&TURN_BUCKETS),
            db_hist: Histogram::new(&DB_BUCKETS),
            db_writes: AtomicU64::new(0),
            eviction_sweeps: AtomicU64::new(0),
            eviction_asks: AtomicU64::new(0),
            model_slot_waits: AtomicU64::new(0),
        }
    }
}

impl Metrics {
    pub fn model_slot_wait(&self) {
        self.model_slot_waits.fetch_add(1, Ordering::Relaxed);
    }
    pub fn db_write(&self) {
        self.db_writes.fetch_add(1, Ordering::Relaxed);
    }
    pub fn admitted(&self) {
        self.admissions.fetch_add(1, Ordering::Relaxed);
    }
    pub fn turn_started(&self) {
        self.turns_started.fetch_add(1, Ordering::Relaxed);
    }
    /// A turn read what it starts from through a reader (its transcript was too long for the
    /// claim to read on the writer, or the claim's read failed).
    pub fn turn_start_read_apart(&self) {
        self.turn_starts_read_apart.fetch_add(1, Ordering::Relaxed);
    }
    pub fn turn_finished(&self, seconds: f64) {
        self.turns_finished.fetch_add(1, Ordering::Relaxed);
        self.turn_hist.observe(seconds);
    }
    pub fn prompt_opened(&self) {
        self.prompts_open.fetch_add(1, Ordering::Relaxed);
    }
    pub fn prompt_closed(&self) {
        let _ = self
            .prompts_open
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
                Some(v.saturating_sub(1))
            });
    }
    /// A sweep that asked `asked` supervisors whether they are idle.
    pub fn eviction_swept(&self, asked: usize) {
        self.eviction_sweeps.fetch_add(1, Ordering::Relaxed);
        self.eviction_asks
            .fetch_add(asked as u64, Ordering::Relaxed);
    }
    pub fn set_active_sessions(&self, n: usize) {
        self.active_sessions.store(n as u64, Ordering::Relaxed);
    }
    pub fn ws_opened(&self) {
        self.ws_connections.fetch_add(1, Ordering::Relaxed);
        self.ws_connections_total.fetch_add(1, Ordering::Relaxed);
    }
    pub fn ws_closed(&self) {
        let _ = self
            .ws_connections
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
                Some(v.saturating_sub(1))
            });
    }
    pub fn model_error(&self, class: &str) {
        if let Ok(mut v) = self.model_errors.lock() {
            match v.iter_mut().find(|(c, _)| c == class) {
                Some(e) => e.1 += 1,
                None => v.push((class.to_string(), 1)),
            }
        }
    }

    /// Render in Prometheus text format; `admissions` are the ledger's counts by status/outcome.
    pub fn render(&self, admissions: &[(String, Option<String>, i64)]) -> String {
        let mut out = String::new();
        let g = |o: &mut String, name: &str, help: &str, kind: &str, v: u64| {
            o.push_str(&format!(
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}\n"
            ));
        };
        out.push_str(
            "# HELP gatehouse_admissions Admissions in the ledger by status and outcome.\n",
        );
        out.push_str("# TYPE gatehouse_admissions gauge\n");
        for (status, outcome, n) in admissions {
            out.push_str(&format!(
                "gatehouse_admissions{{status=\"{status}\",outcome=\"{}\"}} {n}\n",
                outcome.as_deref().unwrap_or("")
            ));
        }
        g(
            &mut out,
            "gatehouse_admissions_accepted_total",
            "Inputs admitted by this process.",
            "counter",
            self.admissions.load(Ordering::Relaxed),
        );
        g(
            &mut out,
            "gatehouse_model_slot_waits_total",
            "Model calls that found every request slot of their endpoint taken \
             (model.max_concurrent_requests) and waited for one.",
            "counter",
            self.model_slot_waits.load(Ordering::Relaxed),
        );
        g(
            &mut out,
            "gatehouse_db_writes_total",
            "Write transitions the database writer answered.",
            "counter",
            self.db_writes.load(Ordering::Relaxed),
        );
        g(
            &mut out,
            "gatehouse_turns_started_total",
            "Turns started.",
            "counter",
            self.turns_started.load(Ordering::Relaxed),
        );
        g(
            &mut out,
            "gatehouse_turn_starts_read_apart_total",
            "Turns that read their session and transcript through a reader, not in their claim.",
            "counter",
            self.turn_starts_read_apart.load(Ordering::Relaxed),
        );
        g(
            &mut out,
            "gatehouse_turns_finished_total",
            "Turns finished.",
            "counter",
            self.turns_finished.load(Ordering::Relaxed),
        );
        g(
            &mut out,
            "gatehouse_prompts_open",
            "Open approval and clarify prompts.",
            "gauge",
            self.prompts_open.load(Ordering::Relaxed),
        );
        g(
            &mut out,
            "gatehouse_sessions_loaded",
            "Session supervisors in memory.",
            "gauge",
            self.active_sessions.load(Ordering::Relaxed),
        );
        g(
            &mut out,
            "gatehouse_eviction_sweeps_total",
            "Sweeps for idle session supervisors to let go of.",
            "counter",
            self.eviction_sweeps.load(Ordering::Relaxed),
        );
        g(
            &mut out,
            "gatehouse_eviction_asks_total",
            "Session supervisors those sweeps asked whether they were idle.",
            "counter",
            self.eviction_asks.load(Ordering::Relaxed),
        );
        g(
            &mut out,
            "gatehouse_ws_connections",
            "Open WebSocket connections.",
            "gauge",
            self.ws_connections.load(Ordering::Relaxed),
        );
        g(
            &mut out,
            "gatehouse_ws_connections_total",
            "WebSocket connections accepted.",
            "counter",
            self.ws_connections_total.load(Ordering::Relaxed),
        );
        out.push_str("# HELP gatehouse_model_errors_total Model request failures by class.\n# TYPE gatehouse_model_errors_total counter\n");
        if let Ok(v) = self.model_errors.lock() {
            for (class, n) in v.iter() {
                out.push_str(&format!(
                    "gatehouse_model_errors_total{{class=\"{class}\"}} {n}\n"
                ));
            }
        }
        self.turn_hist.render(
            &mut out,
            "gatehouse_turn_seconds",
            "Turn latency from claim to settlement.",
        );
        self.model_hist.render(
            &mut out,
            "gatehouse_model_request_seconds",
            "Model request latency.",
        );
        self.db_hist.render(
            &mut out,
            "gatehouse_db_transaction_seconds",
            "Database job latency (wait and transaction).",
        );
        out
    }
}
