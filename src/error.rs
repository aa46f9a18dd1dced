//! Errors, in layers.
//!
//! - Store functions return [`StoreError`]: a domain refusal decided in SQL (`StaleEpoch`,
//!   `StaleGeneration`, `AdmissionConflict`, …) or a storage failure that keeps the diesel cause
//!   for the logs.
//! - Everything a client can see is a [`GatewayError`]. Its [`GatewayError::reason`] is the stable
//!   wire string (`data.reason` in JSON-RPC, `error.reason` over REST) and
//!   [`GatewayError::code`] the JSON-RPC code. Internal causes are logged, never sent: a storage
//!   failure reaches the client as `storage_unavailable` with a generic message.

use serde_json::{json, Value};

/// Failures of a store transition.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("stale_epoch: this process no longer owns the ledger")]
    StaleEpoch,
    #[error("stale_generation: {0}")]
    StaleGeneration(String),
    #[error("not_found: {0}")]
    NotFound(String),
    #[error("admission_conflict: {0}")]
    AdmissionConflict(String),
    #[error("invalid_params: {0}")]
    InvalidParams(String),
    #[error("unknown_execution: {0}")]
    UnknownExecution(String),
    #[error("session_busy: {0}")]
    SessionBusy(String),
    /// A session's stored launch policy does not parse (a damaged or edited store): nothing
    /// of the session runs until it is repaired (clients are answered `storage_unavailable`).
    #[error("corrupt policy: {0}")]
    CorruptPolicy(String),
    #[error("storage: {0}")]
    Database(#[from] diesel::result::Error),
    #[error("storage pool: {0}")]
    Pool(String),
    #[error("storage: {0}")]
    Other(String),
}

/// Every refusal a client can receive.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    #[error("invalid_params: {0}")]
    InvalidParams(String),
    #[error("not_found: {0}")]
    NotFound(String),
    #[error("permission_denied: {0}")]
    PermissionDenied(String),
    #[error("profile_mismatch: {0}")]
    ProfileMismatch(String),
    #[error("storage_unavailable")]
    StorageUnavailable,
    #[error("stale_generation: {0}")]
    StaleGeneration(String),
    #[error("stale_epoch")]
    StaleEpoch,
    #[error("unknown_execution: {0}")]
    UnknownExecution(String),
    #[error("admission_conflict: {0}")]
    AdmissionConflict(String),
    #[error("runtime_draining")]
    RuntimeDraining,
    #[error("session_busy: {0}")]
    SessionBusy(String),
    #[error("payload_too_large: {0}")]
    PayloadTooLarge(String),
    #[error("rate_limited: {0}")]
    RateLimited(String),
    #[error("unknown method: {0}")]
    UnknownMethod(String),
    #[error("parse error: {0}")]
    Parse(String),
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    #[error("internal: {0}")]
    Internal(String),
}

impl GatewayError {
    /// The stable wire reason.
    pub fn reason(&self) -> &'static str {
        match self {
            GatewayError::InvalidParams(_) => "invalid_params",
            GatewayError::NotFound(_) => "not_found",
            GatewayError::PermissionDenied(_) => "permission_denied",
            GatewayError::ProfileMismatch(_) => "profile_mismatch",
            GatewayError::StorageUnavailable | GatewayError::Internal(_) => "storage_unavailable",
            GatewayError::StaleGeneration(_) => "stale_generation",
            GatewayError::StaleEpoch => "stale_epoch",
            GatewayError::UnknownExecution(_) => "unknown_execution",
            GatewayError::AdmissionConflict(_) => "admission_conflict",
            GatewayError::RuntimeDraining => "runtime_draining",
            GatewayError::SessionBusy(_) => "session_busy",
            GatewayError::PayloadTooLarge(_) => "payload_too_large",
            GatewayError::RateLimited(_) => "rate_limited",
            GatewayError::UnknownMethod(_) => "unknown_method",
            GatewayError::Parse(_) => "parse_error",
            GatewayError::InvalidRequest(_) => "invalid_request",
        }
    }

    /// The JSON-RPC error code.
    pub fn code(&self) -> i64 {
        match self {
            GatewayError::StorageUnavailable | GatewayError::Internal(_) => 5001,
            GatewayError::UnknownMethod(_) => -32601,
            GatewayError::Parse(_) => -32700,
            GatewayError::InvalidRequest(_) => -32600,
            GatewayError::InvalidParams(_) => -32602,
            _ => 4001,
        }
    }

    /// A human detail safe to show the client. It does not repeat the reason, which always
    /// travels beside it (`not_found` and `session x does not exist`, shown together as
    /// `not_found: session x does not exist`).
    pub fn detail(&self) -> String {
        match self {
            GatewayError::StorageUnavailable | GatewayError::Internal(_) => {
                "the state database is unavailable; retry later".to_string()
            }
            other => {
                let text = other.to_string();
                let rest = text.strip_prefix(self.reason());
                if let Some(detail) = rest.and_then(|r| r.strip_prefix(": ")) {
                    return detail.to_string();
                }
                if rest == Some("") {
                    // The reason alone (`stale_epoch`): say it in words.
                    return self.reason().replace('_', " ");
                }
                text
            }
        }
    }

    /// The JSON-RPC `error` object.
    pub fn to_rpc_error(&self) -> Value {
        let message = match self {
            GatewayError::UnknownMethod(m) => format!("unknown method: {m}"),
            GatewayError::Parse(_) | GatewayError::InvalidRequest(_) => self.to_string(),
            other => other.reason().to_string(),
        };
        json!({
            "code": self.code(),
            "message": message,
            "data": {"reason": self.reason(), "detail": self.detail()},
        })
    }
}

impl From<StoreError> for GatewayError {
    fn from(err: StoreError) -> Self {
        match err {
            StoreError::StaleEpoch => GatewayError::StaleEpoch,
            StoreError::StaleGeneration(m) => GatewayError::StaleGeneration(m),
            StoreError::NotFound(m) => GatewayError::NotFound(m),
            StoreError::AdmissionConflict(m) => GatewayError::AdmissionConflict(m),
            StoreError::InvalidParams(m) => GatewayError::InvalidParams(m),
            StoreError::UnknownExecution(m) => GatewayError::UnknownExecution(m),
            StoreError::SessionBusy(m) => GatewayError::SessionBusy(m),
            other => {
                if let Some(skipped) = STORAGE_LOG.admit() {
                    tracing::error!(error = %other, skipped, "storage failure");
                }
                GatewayError::StorageUnavailable
            }
        }
    }
}

pub type GatewayResult<T> = Result<T, GatewayError>;

impl StoreError {
    /// The write's fence refused it: this process or attempt no longer owns what it wrote to.
    pub fn is_stale(&self) -> bool {
        matches!(
            self,
            StoreError::StaleEpoch | StoreError::StaleGeneration(_)
        )
    }

    /// The database file is not one, or is damaged (SQLite's `SQLITE_NOTADB`, `SQLITE_CORRUPT`):
    /// starting again will not change that.
    pub fn is_corrupt(&self) -> bool {
        let text = self.to_string();
        text.contains("file is not a database") || text.contains("database disk image is malformed")
    }
}

/// Storage failures logged at most once a second: in an outage every request fails, and a line
/// for each (two, with the writer's) flooded the log (9 MB in 40 s of a full disk under twelve
/// clients), adding to the disk's pressure. The line logged says how many were left out.
pub static STORAGE_LOG: LogLimiter = LogLimiter::new(1000);

/// Admits at most one log line per period.
pub struct LogLimiter {
    period_ms: u64,
    /// When the last line was admitted ([`crate::clock::process_ms`]; [`NEVER`] before the first).
    last_ms: std::sync::atomic::AtomicU64,
    skipped: std::sync::atomic::AtomicU64,
}

/// No line admitted yet.
const NEVER: u64 = u64::MAX;

impl LogLimiter {
    pub const fn new(period_ms: u64) -> LogLimiter {
        LogLimiter {
            period_ms,
            last_ms: std::sync::atomic::AtomicU64::new(NEVER),
            skipped: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// `Some(lines left out since the last one)` when this line may be logged.
    pub fn admit(&self) -> Option<u64> {
        self.admit_at(crate::clock::process_ms())
    }

    fn admit_at(&self, now: u64) -> Option<u64> {
        use std::sync::atomic::Ordering;
        let last = self.last_ms.load(Ordering::Relaxed);
        if (last == NEVER || now.saturating_sub(last) >= self.period_ms)
            && self
                .last_ms
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            Some(self.skipped.swap(0, Ordering::Relaxed))
        } else {
            self.skipped.fetch_add(1, Ordering::Relaxed);
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_bodies_are_pinned() {
        let body = GatewayError::StaleGeneration("x".into()).to_rpc_error();
        assert_eq!(body["code"], 4001);
        assert_eq!(body["message"], "stale_generation");
        assert_eq!(body["data"]["reason"], "stale_generation");
        let body = GatewayError::UnknownMethod("nope".into()).to_rpc_error();
        assert_eq!(body["code"], -32601);
        assert_eq!(body["message"], "unknown method: nope");
        assert_eq!(body["data"]["reason"], "unknown_method");
        let body = GatewayError::from(StoreError::Other("disk on fire".into())).to_rpc_error();
        assert_eq!(body["code"], 5001);
        assert_eq!(body["data"]["reason"], "storage_unavailable");
        assert!(!body.to_string().contains("disk on fire"));
    }

    #[test]
    fn the_log_limiter_admits_one_line_a_period_and_counts_the_rest() {
        let limiter = LogLimiter::new(60_000);
        assert_eq!(limiter.admit_at(10), Some(0));
        assert_eq!(limiter.admit_at(20), None);
        assert_eq!(limiter.admit_at(60_009), None);
        assert_eq!(limiter.admit_at(60_010), Some(2));
    }
}
