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
    /// The drain has begun (after `gateway.drain_grace_seconds`): a running turn makes no
    /// further model call or tool run, and ends interrupted.
    turns_stopping: std::sync::atomic::AtomicBool,
    pub instance_id: String,
    pub epoch: i64,
    pub pid: u32,
    pub api_origin: Mutex<String>,
    /// The last `live_seq` given to a live event: one counter for the process, so that a
    /// session's live events keep counting up across its supervisor's eviction and revival.
    live_seq: std::sync::atomic::AtomicU64,
}

impl RuntimeState {
    pub fn new(instance_id: String, epoch: i64) -> Self {
        Self {
            phase: AtomicU8::new(RuntimePhase::Starting as u8),
            turns_stopping: std::sync::atomic::AtomicBool::new(false),
            instance_id,
            epoch,
            pid: std::process::id(),
            api_origin: Mutex::new(String::new()),
            live_seq: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// The next `live_seq` (1, 2, 3, … over the process's life, across all sessions).
    pub fn next_live_seq(&self) -> u64 {
        self.live_seq.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// The drain has begun: running turns stop at their next step.
    pub fn turns_stopping(&self) -> bool {
        self.turns_stopping.load(Ordering::SeqCst)
    }

    pub fn stop_turns(&self) {
        self.turns_stopping.store(true, Ordering::SeqCst);
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
    /// Who waits for which admission to settle (the rooms' local session port).
    pub settlements: Arc<Settlements>,
}

/// Admissions someone waits on, by admission id, and a signal for each: a settlement committed
/// by a session supervisor (a turn's, a cancellation's, an operator's resolution) sets it, so the
/// waiter reads the settled row at once instead of on its next poll. Only watched admissions
/// have an entry; the supervisors' lookup on every settlement finds none for the rest.
#[derive(Debug, Default)]
pub struct Settlements {
    watched: Mutex<std::collections::HashMap<String, Watched>>,
}

#[derive(Debug)]
struct Watched {
    signal: tokio::sync::watch::Sender<bool>,
    watchers: usize,
}

impl Settlements {
    /// Watch `admission_id` until the returned guard is dropped.
    pub fn watch(self: &Arc<Self>, admission_id: &str) -> SettlementWatch {
        let mut watched = self.watched.lock().unwrap_or_else(|e| e.into_inner());
        let entry = watched
            .entry(admission_id.to_string())
            .or_insert_with(|| Watched {
                signal: tokio::sync::watch::channel(false).0,
                watchers: 0,
            });
        entry.watchers += 1;
        SettlementWatch {
            settlements: self.clone(),
            admission_id: admission_id.to_string(),
            settled: entry.signal.subscribe(),
        }
    }

    /// `admission_id` has settled (its transaction committed).
    pub fn settled(&self, admission_id: &str) {
        let watched = self.watched.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(w) = watched.get(admission_id) {
            w.signal.send_replace(true);
        }
    }

    /// How many admissions are watched.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.watched.lock().map(|w| w.len()).unwrap_or(0)
    }
}

/// A watch on one admission ([`Settlements::watch`]).
#[derive(Debug)]
pub struct SettlementWatch {
    settlements: Arc<Settlements>,
    admission_id: String,
    settled: tokio::sync::watch::Receiver<bool>,
}

impl SettlementWatch {
    /// Wait until the admission is reported settled, or at most `limit`: at once when the report
    /// came since the last wait, the full `limit` once it has been seen (the caller reads the row
    /// either way; the signal only says when to look, and a reader that keeps failing is not
    /// spun).
    pub async fn wait(&mut self, limit: std::time::Duration) {
        if self.settled.has_changed().unwrap_or(false) {
            self.settled.borrow_and_update();
            return;
        }
        let _ = tokio::time::timeout(limit, self.settled.changed()).await;
    }
}

impl Drop for SettlementWatch {
    fn drop(&mut self) {
        let mut watched = self
            .settlements
            .watched
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(w) = watched.get_mut(&self.admission_id) {
            w.watchers -= 1;
            if w.watchers == 0 {
                watched.remove(&self.admission_id);
            }
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A settlement wakes its watchers, whether it comes before or during their wait; another
    /// admission's settlement wakes nobody; the entry goes with the last watcher.
    #[actix_rt::test]
    async fn a_settlement_wakes_its_watchers_and_no_one_else() {
        let s = Arc::new(Settlements::default());
        let mut a = s.watch("a");
        let mut a2 = s.watch("a");
        let mut b = s.watch("b");
        assert_eq!(s.len(), 2);
        let waiting = tokio::spawn(async move {
            a2.wait(Duration::from_secs(3600)).await;
            a2
        });
        s.settled("a");
        tokio::time::timeout(Duration::from_secs(5), a.wait(Duration::from_secs(3600)))
            .await
            .expect("a woken");
        let a2 = tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("a2 woken")
            .expect("a2's task");
        // B is not woken by a's settlement (nor by one nobody watches): its wait runs out.
        s.settled("nobody");
        let started = std::time::Instant::now();
        b.wait(Duration::from_millis(50)).await;
        assert!(started.elapsed() >= Duration::from_millis(50));
        drop((a, a2));
        assert_eq!(s.len(), 1, "a's entry left with its last watcher");
        drop(b);
        assert_eq!(s.len(), 0);
    }
}
