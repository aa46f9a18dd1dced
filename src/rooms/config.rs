//! `rooms.*` configuration with its defaults and validation.

use serde::{Deserialize, Deserializer, Serialize};

/// Configuration of the hosted-room runtime.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RoomsConfig {
    /// Driver lease time-to-live.
    pub lease_ttl_seconds: f64,
    /// Idle wait between scheduler cycles.
    pub poll_interval_seconds: f64,
    /// Observation poll while a turn is in flight.
    pub active_poll_interval_seconds: f64,
    /// Longest a member turn may run before it is stopped and failed.
    pub turn_timeout_seconds: f64,
    /// How long an abandoned attempt stays indeterminate (blocking its room) before it is deferred.
    pub indeterminate_defer_seconds: f64,
    /// Most rooms executing at once.
    #[serde(deserialize_with = "positive_integer")]
    pub max_concurrent_rooms: usize,
    /// First back-off after a member provably did not admit a turn.
    pub unavailable_retry_min_seconds: f64,
    /// Cap of that back-off.
    pub unavailable_retry_max_seconds: f64,
    /// An ended (settled, failed, cancelled) task is pruned this long after it ended (0: no
    /// age limit). A task id is idempotent for as long as its task is kept.
    pub task_retention_seconds: f64,
    /// A room keeps at most this many of its newest ended tasks.
    #[serde(deserialize_with = "positive_count")]
    pub max_ended_tasks_per_room: i64,
    /// How often ended tasks are pruned.
    pub prune_interval_seconds: f64,
    /// Tasks a room may have queued; `room.admit` past it is refused (`session_busy`).
    #[serde(deserialize_with = "positive_queued")]
    pub max_queued_tasks_per_room: i64,
    /// Keys this version does not know: logged once and otherwise ignored, as in every section.
    #[serde(flatten, skip_serializing)]
    pub extra: std::collections::BTreeMap<String, serde_json::Value>,
}

impl Default for RoomsConfig {
    fn default() -> Self {
        Self {
            lease_ttl_seconds: 30.0,
            poll_interval_seconds: 5.0,
            active_poll_interval_seconds: 0.25,
            turn_timeout_seconds: 1830.0,
            indeterminate_defer_seconds: 60.0,
            max_concurrent_rooms: 4,
            unavailable_retry_min_seconds: 1.0,
            unavailable_retry_max_seconds: 30.0,
            task_retention_seconds: 30.0 * 24.0 * 3600.0,
            max_ended_tasks_per_room: 2048,
            prune_interval_seconds: 60.0,
            max_queued_tasks_per_room: 1000,
            extra: Default::default(),
        }
    }
}

const MAX_CONCURRENT_ROOMS_MESSAGE: &str = "max_concurrent_rooms must be a positive integer";

/// A positive integer of type `T`, else `message`: booleans, floats, strings and negatives
/// are not positive integers.
fn positive<'de, D: Deserializer<'de>, T: TryFrom<u64>>(
    deserializer: D,
    message: &'static str,
) -> Result<T, D::Error> {
    let value = serde_json::Value::deserialize(deserializer)?;
    value
        .as_u64()
        .filter(|n| *n >= 1 && !value.is_boolean())
        .and_then(|n| T::try_from(n).ok())
        .ok_or_else(|| serde::de::Error::custom(message))
}

fn positive_integer<'de, D: Deserializer<'de>>(deserializer: D) -> Result<usize, D::Error> {
    positive(deserializer, MAX_CONCURRENT_ROOMS_MESSAGE)
}

const MAX_ENDED_TASKS_MESSAGE: &str = "max_ended_tasks_per_room must be a positive integer";

fn positive_count<'de, D: Deserializer<'de>>(deserializer: D) -> Result<i64, D::Error> {
    positive(deserializer, MAX_ENDED_TASKS_MESSAGE)
}

const MAX_QUEUED_TASKS_MESSAGE: &str = "max_queued_tasks_per_room must be a positive integer";

fn positive_queued<'de, D: Deserializer<'de>>(deserializer: D) -> Result<i64, D::Error> {
    positive(deserializer, MAX_QUEUED_TASKS_MESSAGE)
}

/// A configuration value that is out of range.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid rooms configuration: {0}")]
pub struct RoomsConfigError(pub String);

impl RoomsConfig {
    /// Check every bound; the message names the offending key.
    pub fn validate(&self) -> Result<(), RoomsConfigError> {
        let positive = [
            ("lease_ttl_seconds", self.lease_ttl_seconds),
            ("poll_interval_seconds", self.poll_interval_seconds),
            (
                "active_poll_interval_seconds",
                self.active_poll_interval_seconds,
            ),
            ("turn_timeout_seconds", self.turn_timeout_seconds),
            (
                "indeterminate_defer_seconds",
                self.indeterminate_defer_seconds,
            ),
            ("prune_interval_seconds", self.prune_interval_seconds),
        ];
        for (name, value) in positive {
            let (min, max) = (crate::config::MIN_SECONDS, crate::config::MAX_SECONDS);
            if !(value.is_finite() && (min..=max).contains(&value)) {
                return Err(RoomsConfigError(format!(
                    "{name} must be {min} to {max} seconds"
                )));
            }
        }
        if !(self.task_retention_seconds.is_finite()
            && (0.0..=crate::config::MAX_SECONDS).contains(&self.task_retention_seconds))
        {
            return Err(RoomsConfigError(
                "task_retention_seconds must be zero or positive".into(),
            ));
        }
        if self.max_ended_tasks_per_room < 1 {
            return Err(RoomsConfigError(MAX_ENDED_TASKS_MESSAGE.into()));
        }
        if self.max_queued_tasks_per_room < 1 {
            return Err(RoomsConfigError(MAX_QUEUED_TASKS_MESSAGE.into()));
        }
        if self.max_concurrent_rooms < 1 {
            return Err(RoomsConfigError(MAX_CONCURRENT_ROOMS_MESSAGE.into()));
        }
        let (min, max) = (
            self.unavailable_retry_min_seconds,
            self.unavailable_retry_max_seconds,
        );
        let most = crate::config::MAX_SECONDS;
        if !(min.is_finite() && min > 0.0 && min <= most) {
            return Err(RoomsConfigError(format!(
                "unavailable_retry_min_seconds must be more than 0 and at most {most} seconds"
            )));
        }
        if !(max.is_finite() && min <= max && max <= most) {
            return Err(RoomsConfigError(format!(
                "unavailable_retry_max_seconds must be at least unavailable_retry_min_seconds \
                 ({min}) and at most {most} seconds"
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_match_the_contract() {
        let config: RoomsConfig = serde_json::from_str("{}").unwrap();
        assert_eq!(config, RoomsConfig::default());
        assert_eq!(config.lease_ttl_seconds, 30.0);
        assert_eq!(config.poll_interval_seconds, 5.0);
        assert_eq!(config.active_poll_interval_seconds, 0.25);
        assert_eq!(config.turn_timeout_seconds, 1830.0);
        assert_eq!(config.indeterminate_defer_seconds, 60.0);
        assert_eq!(config.max_concurrent_rooms, 4);
        assert_eq!(config.unavailable_retry_min_seconds, 1.0);
        assert_eq!(config.unavailable_retry_max_seconds, 30.0);
        config.validate().unwrap();
    }

    #[test]
    fn bounds_are_validated_with_the_key_name() {
        let config = RoomsConfig {
            unavailable_retry_min_seconds: 5.0,
            unavailable_retry_max_seconds: 1.0,
            ..Default::default()
        };
        assert!(config
            .validate()
            .unwrap_err()
            .to_string()
            .contains("unavailable_retry_max_seconds must be at least"));
        let config = RoomsConfig {
            unavailable_retry_min_seconds: 0.0,
            ..Default::default()
        };
        assert!(config
            .validate()
            .unwrap_err()
            .to_string()
            .contains("unavailable_retry_min_seconds must be more than 0"));
        let config = RoomsConfig {
            lease_ttl_seconds: 0.0,
            ..Default::default()
        };
        assert!(config
            .validate()
            .unwrap_err()
            .to_string()
            .contains("lease_ttl_seconds"));
        let err =
            serde_json::from_str::<RoomsConfig>(r#"{"max_concurrent_rooms": 2.5}"#).unwrap_err();
        assert!(err.to_string().contains("max_concurrent_rooms"));
        let parsed: RoomsConfig = serde_json::from_str(r#"{"max_concurrent_rooms": 2}"#).unwrap();
        assert_eq!(parsed.max_concurrent_rooms, 2);
        for bad in ["0", "-1", "1.5", "true", "\"9\""] {
            let err = serde_json::from_str::<RoomsConfig>(&format!(
                r#"{{"max_ended_tasks_per_room": {bad}}}"#
            ))
            .unwrap_err();
            assert!(
                err.to_string().contains("max_ended_tasks_per_room"),
                "{bad}: {err}"
            );
        }
        let config = RoomsConfig {
            task_retention_seconds: -1.0,
            ..Default::default()
        };
        assert!(config
            .validate()
            .unwrap_err()
            .to_string()
            .contains("task_retention_seconds"));
        let config = RoomsConfig {
            task_retention_seconds: 0.0,
            ..Default::default()
        };
        config.validate().unwrap();
    }
}
