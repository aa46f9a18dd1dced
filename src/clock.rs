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

/// Milliseconds on a monotonic clock that starts with the process's first reading (for bounds
/// that must not move with the wall clock: a step back would stall them).
pub fn process_ms() -> u64 {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    START
        .get_or_init(Instant::now)
        .elapsed()
        .as_millis()
        .try_into()
        .unwrap_or(u64::MAX)
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

/// `unix_secs` as UTC text, `2026-12-04 16:03:38Z` (for people: the JSON forms keep the number).
pub fn utc_text(unix_secs: i64) -> String {
    let days = unix_secs.div_euclid(86_400);
    let secs = unix_secs.rem_euclid(86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02}Z",
        secs / 3600,
        secs / 60 % 60,
        secs % 60
    )
}

#[cfg(test)]
mod utc_tests {
    use super::utc_text;

    #[test]
    fn unix_times_read_as_utc_dates() {
        assert_eq!(utc_text(0), "1970-01-01 00:00:00Z");
        assert_eq!(utc_text(951_782_400), "2000-02-29 00:00:00Z");
        assert_eq!(utc_text(1_796_399_018), "2026-12-04 15:43:38Z");
        assert_eq!(utc_text(-1), "1969-12-31 23:59:59Z");
    }
}
