//! Injected time. Leases, deadlines, back-off and timestamps read a [`Clock`] so tests can drive
//! time exactly (a room test moves a [`ManualClock`] from 100.0 to 108.0 and runs one pass).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Wall time (seconds since the Unix epoch, as f64) and monotonic time.
pub trait Clock: Send + Sync + 'static {
    /// Seconds since the Unix epoch.
    fn now(&self) -> f64;
    /// A monotonic reading in seconds, for measuring intervals.
    fn monotonic(&self) -> f64;
}

/// The real clock.
#[derive(Debug, Clone)]
pub struct SystemClock {
    origin: Instant,
}

impl Default for SystemClock {
    fn default() -> Self {
        Self {
            origin: Instant::now(),
        }
    }
}

impl Clock for SystemClock {
    fn now(&self) -> f64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or(Duration::ZERO)
            .as_secs_f64()
    }

    fn monotonic(&self) -> f64 {
        self.origin.elapsed().as_secs_f64()
    }
}

/// A clock that only moves when told to.
#[derive(Debug, Clone)]
pub struct ManualClock {
    inner: Arc<Mutex<f64>>,
}

impl ManualClock {
    pub fn new(start: f64) -> Self {
        Self {
            inner: Arc::new(Mutex::new(start)),
        }
    }

    pub fn set(&self, value: f64) {
        let mut guard = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        *guard = value;
    }

    pub fn advance(&self, by: f64) {
        let mut guard = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        *guard += by;
    }
}

impl Clock for ManualClock {
    fn now(&self) -> f64 {
        *self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn monotonic(&self) -> f64 {
        self.now()
    }
}

/// The shared handle everything takes.
pub type SharedClock = Arc<dyn Clock>;
