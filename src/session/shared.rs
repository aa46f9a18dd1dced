//! What every session supervisor and turn shares: config, store, epoch, the model and tool actors.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

use actix::Addr;

use crate::clock::SharedClock;
use crate::config::Config;
use crate::model::ModelClient;
use crate::store::Db;
use crate::telemetry::Metrics;
use crate::tools::TerminalTool;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RuntimePhase {
    Starting = 0,
    Ready = 1,
    Stopping = 2,
}

impl RuntimePhase {
    pub fn as_str(self) -> &'static str {
        match self {
            RuntimePhase::Starting => "starting",
            RuntimePhase::Ready => "ready",
            RuntimePhase::Stopping => "stopping",
        }
    }
}

/// The process's identity and phase, as `identify` reports it.
#[derive(Debug)]
pub struct RuntimeState {
    phase: AtomicU8,
    pub instance_id: String,
    pub epoch: i64,
    pub pid: u32,
    pub api_origin: Mutex<String>,
}

impl RuntimeState {
    pub fn new(instance_id: String, epoch: i64) -> Self {
        Self {
            phase: AtomicU8::new(RuntimePhase::Starting as u8),
            instance_id,
            epoch,
            pid: std::process::id(),
            api_origin: Mutex::new(String::new()),
        }
    }

    pub fn phase(&self) -> RuntimePhase {
        match self.phase.load(Ordering::SeqCst) {
            0 => RuntimePhase::Starting,
            1 => RuntimePhase::Ready,
            _ => RuntimePhase::Stopping,
        }
    }

    pub fn set_phase(&self, p: RuntimePhase) {
        self.phase.store(p as u8, Ordering::SeqCst);
    }

    pub fn draining(&self) -> bool {
        self.phase() == RuntimePhase::Stopping
    }

    pub fn origin(&self) -> String {
        self.api_origin
            .lock()
            .map(|g| g.clone())
            .unwrap_or_default()
    }
}

/// Shared by every supervisor and turn.
pub struct Shared {
    pub config: Config,
    pub home: PathBuf,
    pub db: Db,
    pub epoch: i64,
    pub model: Addr<ModelClient>,
    pub terminal: Addr<TerminalTool>,
    pub runtime: Arc<RuntimeState>,
    pub clock: SharedClock,
    pub metrics: Arc<Metrics>,
    /// The admission ledger's counts, kept between reads (metrics and status).
    pub ledger: Arc<std::sync::Mutex<crate::store::admissions::LedgerTally>>,
}

impl Shared {
    pub fn now(&self) -> f64 {
        self.clock.now()
    }

    /// The admission ledger's `(status, outcome, count)`, reading only rows not yet settled
    /// when last counted (see [`crate::store::admissions::LedgerTally`]).
    pub async fn ledger_counts(
        &self,
    ) -> Result<Vec<(String, Option<String>, i64)>, crate::error::StoreError> {
        let tally = self.ledger.clone();
        self.db
            .read(move |c| {
                let mut tally = tally.lock().map_err(|_| {
                    crate::error::StoreError::Other("the ledger tally was poisoned".into())
                })?;
                tally.counts(c)
            })
            .await
    }
}
