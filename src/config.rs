//! Typed `config.yaml` (YAML; plain JSON is valid YAML), with defaults and validation.
//!
//! Unknown keys are collected (each struct flattens the rest into `extra`) and logged once as a
//! warning, so configs written for the system we replace still load. A known key with a bad value
//! is a start-up error naming the key and what was expected.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::Value;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("config key `{key}`: {message}")]
    Invalid { key: String, message: String },
    #[error("environment variable `{name}`: {message}")]
    Environment { name: &'static str, message: String },
}

type Extra = BTreeMap<String, Value>;

/// What a model endpoint's URL must be, said when it is not.
pub const ENDPOINT_URL_EXPECTED: &str =
    "expected an http:// or https:// URL with no credentials, query or fragment";

/// Is `url` a model endpoint a session may be given: http(s), with no credentials (`@`), query
/// or fragment (its path is joined to `/chat/completions`, and a key goes in a header). One
/// check for the config, the environment and a client's `base_url`: the config took what every
/// session was then refused.
pub fn endpoint_url_fits(url: &str) -> bool {
    endpoint_url_fault(url).is_none()
}

/// Why `url` is no endpoint [`endpoint_url_fits`] takes, in words that hold nothing of it (`no
/// http:// or https:// scheme`, `credentials and a query`); none when it fits.
fn endpoint_url_fault(url: &str) -> Option<String> {
    if !(url.starts_with("http://") || url.starts_with("https://")) {
        return Some("no http:// or https:// scheme".into());
    }
    // An `@` before the query or fragment is in the credentials (or taken for them).
    let query = url
        .find('?')
        .filter(|q| url.find('#').is_none_or(|f| q < &f));
    let before = url.find(['?', '#']).unwrap_or(url.len());
    let faults: Vec<&str> = [
        (url[..before].contains('@'), "credentials"),
        (query.is_some(), "a query"),
        (url.contains('#'), "a fragment"),
    ]
    .into_iter()
    .filter_map(|(has, what)| has.then_some(what))
    .collect();
    (!faults.is_empty()).then(|| faults.join(" and "))
}

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(default)]
pub struct Config {
    pub gateway: GatewayConfig,
    pub model: ModelConfig,
    pub auxiliary: AuxiliaryConfig,
    pub compression: CompressionConfig,
    pub terminal: TerminalConfig,
    pub approvals: ApprovalsConfig,
    pub agent: AgentConfig,
    pub platform_toolsets: BTreeMap<String, Vec<String>>,
    pub session: SessionLimits,
    pub events: EventsConfig,
    pub http: HttpConfig,
    pub profiles: BTreeMap<String, ProfileConfig>,
    pub rooms: crate::rooms::RoomsConfig,
    /// What loading the config has to say at start: values taken, but not as written.
    #[serde(skip)]
    pub notices: Vec<String>,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct GatewayConfig {
    pub host: String,
    pub port: u16,
    pub max_frame_bytes: usize,
    pub id: Option<String>,
    #[serde(deserialize_with = "key_digests")]
    pub api_keys: Vec<String>,
    pub drain_timeout_seconds: f64,
    pub drain_grace_seconds: f64,
    pub ticket_ttl_seconds: f64,
    pub max_connections: usize,
    /// Sessions one WebSocket connection may follow at once (each keeps its supervisor loaded).
    pub max_sessions_per_connection: usize,
    pub outbound_queue_frames: usize,
    /// Bytes of those frames (a frame may be a whole reply, up to `model.max_response_bytes`).
    pub outbound_queue_bytes: usize,
    pub heartbeat_seconds: f64,
    pub client_timeout_seconds: f64,
    /// How long a start waits for `host`'s address to appear on this machine (an interface still
    /// coming up at boot) before it gives up.
    pub bind_wait_seconds: f64,
    /// Directories a session's `cwd` must lie under (after resolving symlinks); empty = anywhere.
    pub allowed_cwd_roots: Vec<PathBuf>,
    #[serde(flatten)]
    pub extra: Extra,
}

impl GatewayConfig {
    /// Does the listener stay on this host? `localhost`, or a loopback address (all of
    /// 127.0.0.0/8, `::1`, an IPv4 loopback written as IPv6), bracketed or not.
    pub fn is_loopback(&self) -> bool {
        let host = self.bind_host();
        host.eq_ignore_ascii_case("localhost")
            || host
                .parse::<std::net::IpAddr>()
                .is_ok_and(|ip| ip.to_canonical().is_loopback())
    }

    /// The host as it is bound: trimmed, an IPv6 address without its brackets (`[::1]` passed
    /// the loopback check, then went to a name lookup that failed).
    pub fn bind_host(&self) -> &str {
        let host = self.host.trim();
        host.strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host)
    }

    /// Is `cwd`, already resolved (canonical: no `..`, no symlink), inside one of
    /// `allowed_cwd_roots`? Always true when none are configured. The roots are resolved too, so
    /// `..` and symlinks cannot escape one; `cwd` is not resolved again, so what is checked is
    /// what the caller keeps.
    pub fn cwd_allowed(&self, cwd: &Path) -> bool {
        if self.allowed_cwd_roots.is_empty() {
            return true;
        }
        self.allowed_cwd_roots.iter().any(|root| {
            root.canonicalize()
                .map(|root| cwd.starts_with(root))
                .unwrap_or(false)
        })
    }

    /// Is `cwd`, as written (`.` and `..` taken away, no link followed), under one of
    /// `allowed_cwd_roots`, as configured or resolved? Always true when none are configured.
    /// What a refusal may say of a path outside them: nothing of whether it exists.
    pub fn cwd_within_roots_as_written(&self, cwd: &Path) -> bool {
        if self.allowed_cwd_roots.is_empty() {
            return true;
        }
        let written = lexically_normal(cwd);
        self.allowed_cwd_roots.iter().any(|root| {
            written.starts_with(lexically_normal(root))
                || root
                    .canonicalize()
                    .is_ok_and(|root| written.starts_with(root))
        })
    }
}

/// `path` with `.` and `..` taken away and repeated separators as one, as written (no file is
/// read, no link followed).
pub(crate) fn lexically_normal(path: &Path) -> PathBuf {
    use std::path::Component;
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
            other => out.push(other),
        }
    }
    out
}

impl Default for GatewayConfig {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".into(),
            port: 0,
            max_frame_bytes: 1 << 20,
            id: None,
            api_keys: Vec::new(),
            drain_timeout_seconds: 45.0,
            drain_grace_seconds: 0.0,
            ticket_ttl_seconds: 60.0,
            max_connections: 1024,
            max_sessions_per_connection: 1024,
            outbound_queue_frames: 4096,
            outbound_queue_bytes: 64 << 20,
            heartbeat_seconds: 15.0,
            client_timeout_seconds: 60.0,
            bind_wait_seconds: 30.0,
            allowed_cwd_roots: Vec::new(),
            extra: Extra::new(),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct ModelConfig {
    pub provider: Option<String>,
    pub default: Option<String>,
    pub base_url: Option<String>,
    pub api_key: Option<String>,
    pub context_length: Option<u64>,
    pub max_tokens: Option<u64>,
    pub stream: bool,
    pub timeout_seconds: f64,
    pub connect_timeout_seconds: f64,
    pub idle_timeout_seconds: f64,
    pub max_concurrent_requests: usize,
    pub max_retries: u32,
    pub max_response_bytes: usize,
    #[serde(flatten)]
    pub extra: Extra,
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self {
            provider: None,
            default: None,
            base_url: None,
            api_key: None,
            context_length: None,
            max_tokens: None,
            stream: true,
            timeout_seconds: 600.0,
            connect_timeout_seconds: 30.0,
            idle_timeout_seconds: 120.0,
            max_concurrent_requests: 64,
            max_retries: 3,
            max_response_bytes: 8 << 20,
            extra: Extra::new(),
        }
    }
}

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(default)]
pub struct AuxiliaryConfig {
    #[serde(deserialize_with = "null_as_default")]
    pub compression: AuxModelConfig,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct AuxModelConfig {
    pub provider: Option<String>,
    pub model: Option<String>,
    pub base_url: Option<String>,
    pub api_key: Option<String>,
    pub timeout: f64,
    #[serde(flatten)]
    pub extra: Extra,
}

impl Default for AuxModelConfig {
    fn default() -> Self {
        Self {
            provider: None,
            model: None,
            base_url: None,
            api_key: None,
            timeout: 120.0,
            extra: Extra::new(),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct CompressionConfig {
    pub enabled: bool,
    pub threshold: f64,
    pub threshold_tokens: Option<u64>,
    pub protect_first_n: usize,
    pub protect_last_n: usize,
    pub in_place: bool,
    pub max_attempts: u32,
    #[serde(flatten)]
    pub extra: Extra,
}

impl Default for CompressionConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            threshold: 0.5,
            threshold_tokens: None,
            protect_first_n: 3,
            protect_last_n: 20,
            in_place: false,
            max_attempts: 3,
            extra: Extra::new(),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct TerminalConfig {
    pub cwd: Option<PathBuf>,
    pub timeout: f64,
    pub output_cap: usize,
    /// Background processes (`background: true`) that may run at once; 0 refuses them.
    pub max_background: usize,
    /// How long an ended background process's log is kept (0: for good).
    pub log_retention_seconds: f64,
    #[serde(flatten)]
    pub extra: Extra,
}

impl Default for TerminalConfig {
    fn default() -> Self {
        Self {
            cwd: None,
            timeout: 180.0,
            output_cap: 50_000,
            max_background: 8,
            log_retention_seconds: 7.0 * 24.0 * 3600.0,
            extra: Extra::new(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApprovalMode {
    Manual,
    Off,
    Deny,
}

impl<'de> Deserialize<'de> for ApprovalMode {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = Value::deserialize(d)?;
        match &v {
            Value::Bool(false) => Ok(ApprovalMode::Off),
            Value::String(s) => match s.as_str() {
                "manual" | "smart" => Ok(ApprovalMode::Manual),
                "off" => Ok(ApprovalMode::Off),
                "deny" => Ok(ApprovalMode::Deny),
                other => Err(serde::de::Error::custom(format!(
                    "expected one of manual, off, deny; got {other:?}"
                ))),
            },
            other => Err(serde::de::Error::custom(format!(
                "expected one of manual, off, deny; got {other}"
            ))),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct ApprovalsConfig {
    pub mode: ApprovalMode,
    /// The mode for unattended sessions (source `api`, as the chat-completions facade creates):
    /// nobody is there to answer, so manual approvals are denied by default.
    pub unattended_mode: ApprovalMode,
    pub timeout: f64,
    #[serde(flatten)]
    pub extra: Extra,
}

impl Default for ApprovalsConfig {
    fn default() -> Self {
        Self {
            mode: ApprovalMode::Manual,
            unattended_mode: ApprovalMode::Deny,
            timeout: 300.0,
            extra: Extra::new(),
        }
    }
}

/// `clarify.timeout`: the older name of `agent.clarify_timeout`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
struct LegacyClarify {
    timeout: Option<f64>,
    #[serde(flatten)]
    extra: Extra,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct AgentConfig {
    pub clarify_timeout: f64,
    /// Model calls with tools per turn (`max_turns` is the same setting by its older name).
    #[serde(alias = "max_turns")]
    pub max_iterations: u32,
    pub system_prompt: Option<String>,
    #[serde(flatten)]
    pub extra: Extra,
}

impl Default for AgentConfig {
    fn default() -> Self {
        Self {
            clarify_timeout: 3600.0,
            max_iterations: 90,
            system_prompt: None,
            extra: Extra::new(),
        }
    }
}

impl ApprovalsConfig {
    /// The approval mode of a session launched from `source`.
    pub fn mode_for(&self, source: &str) -> ApprovalMode {
        if is_unattended(source) {
            self.unattended_mode
        } else {
            self.mode
        }
    }
}

/// Sessions of this source have nobody to answer a prompt (HTTP API clients).
pub fn is_unattended(source: &str) -> bool {
    source == "api"
}

/// The durable per-session event log.
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct EventsConfig {
    /// Events older than this are pruned (0: no age limit).
    pub retention_seconds: f64,
    /// Each session keeps at most this many of its newest events.
    pub max_per_session: i64,
    /// How often the pruner runs.
    pub prune_interval_seconds: f64,
    #[serde(flatten)]
    pub extra: Extra,
}

impl Default for EventsConfig {
    fn default() -> Self {
        Self {
            retention_seconds: 7.0 * 24.0 * 3600.0,
            max_per_session: 10_000,
            prune_interval_seconds: 60.0,
            extra: Extra::new(),
        }
    }
}

impl EventsConfig {
    pub fn retention(&self) -> crate::store::events::Retention {
        crate::store::events::Retention {
            max_age_seconds: self.retention_seconds,
            max_per_session: self.max_per_session,
        }
    }
}

/// The HTTP API (`/v1`): REST, SSE and the chat-completions facade.
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct HttpConfig {
    /// Seconds between SSE keep-alive comments.
    pub sse_keepalive_seconds: f64,
    /// The longest `?wait=` a receipt long-poll may ask for.
    pub max_wait_seconds: f64,
    /// How long a chat completion waits for its turn before answering 504.
    pub completion_timeout_seconds: f64,
    /// How long a request's body may take to arrive once its headers have (408 after it).
    pub body_timeout_seconds: f64,
    /// Lifetime of a bearer token exchanged for a control-socket ticket (`POST /v1/auth/token`).
    pub token_ttl_seconds: f64,
    /// Does `/metrics` need a key? Unset: only when the listener is not on loopback.
    pub metrics_require_key: Option<bool>,
    #[serde(flatten)]
    pub extra: Extra,
}

impl Default for HttpConfig {
    fn default() -> Self {
        Self {
            sse_keepalive_seconds: 15.0,
            max_wait_seconds: 120.0,
            completion_timeout_seconds: 300.0,
            body_timeout_seconds: 30.0,
            token_ttl_seconds: 900.0,
            metrics_require_key: None,
            extra: Extra::new(),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct SessionLimits {
    pub max_queued_admissions: i64,
    pub max_text_bytes: usize,
    /// Session supervisors kept in memory; idle ones past this are let go (revived on use).
    pub max_in_memory: usize,
    /// How long a submit waits for its admission to commit before it is answered
    /// `storage_unavailable` (the input may still be admitted: the same `input_id` finds it).
    pub admission_timeout_seconds: f64,
    #[serde(flatten)]
    pub extra: Extra,
}

impl SessionLimits {
    /// `text` (named `what` in the refusal) within `max_text_bytes`, the bound of anything kept
    /// in a transcript and sent with every later model request: an input, an answer, a message
    /// of a seeded conversation.
    pub fn check_text(&self, what: &str, text: &str) -> Result<(), crate::error::GatewayError> {
        let max = self.max_text_bytes;
        if text.len() > max {
            return Err(crate::error::GatewayError::PayloadTooLarge(format!(
                "{what} is over {max} bytes"
            )));
        }
        Ok(())
    }
}

impl Default for SessionLimits {
    fn default() -> Self {
        Self {
            max_queued_admissions: 1000,
            max_text_bytes: 256 * 1024,
            max_in_memory: 10_000,
            admission_timeout_seconds: 30.0,
            extra: Extra::new(),
        }
    }
}

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(default)]
pub struct ProfileConfig {
    pub model: Option<String>,
    pub provider: Option<String>,
    pub base_url: Option<String>,
    pub toolsets: Option<Vec<String>>,
    pub system_prompt: Option<String>,
    /// The profile model's context window (tokens), for compression; else the limits file's.
    pub context_length: Option<u64>,
    #[serde(flatten)]
    pub extra: Extra,
}

/// Config section `key` from `value`; a refusal names the key inside the section that caused it
/// (`gateway.port`), found by reading each of the section's keys alone (every section has
/// defaults for the keys it is not given).
fn section<T: serde::de::DeserializeOwned>(key: &str, value: Value) -> Result<T, ConfigError> {
    // A section written with nothing under it (`model:` whose keys are all commented out, as
    // the example invites) is its defaults, as an absent one is: it stopped the start before.
    let value = if value.is_null() {
        Value::Object(Default::default())
    } else {
        value
    };
    match serde_json::from_value::<T>(value.clone()) {
        Ok(v) => Ok(v),
        Err(e) => {
            let inner = value.as_object().and_then(|o| {
                o.iter()
                    .find(|(k, v)| {
                        let alone =
                            Value::Object([((*k).clone(), (*v).clone())].into_iter().collect());
                        serde_json::from_value::<T>(alone).is_err()
                    })
                    .map(|(k, _)| k.clone())
            });
            Err(ConfigError::Invalid {
                key: inner.map_or_else(|| key.to_string(), |k| format!("{key}.{k}")),
                message: e.to_string(),
            })
        }
    }
}

/// A nested section written with nothing under it (`auxiliary.compression:`) is its defaults.
fn null_as_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de> + Default,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// `gateway.api_keys`: a list of key digests. Anything else is refused without its text: one
/// string there is most likely a key itself (`api_keys: gk_…`), and serde's own message quoted
/// it into the journal. (`deserialize_any`: the section's flattened `extra` hands each field over
/// buffered, and that buffer refuses a string for a list itself, quoting it, if asked for one.)
fn key_digests<'de, D>(d: D) -> Result<Vec<String>, D::Error>
where
    D: serde::Deserializer<'de>,
{
    struct Digests;
    impl<'de> serde::de::Visitor<'de> for Digests {
        type Value = Vec<String>;

        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a list of key digests (sha256:<64 hex digits>)")
        }

        fn visit_str<E: serde::de::Error>(self, _: &str) -> Result<Self::Value, E> {
            Err(E::custom(
                "expected a list of key digests (sha256:<64 hex digits>, as `gatehouse key \
                 create` prints; never the key itself), not one string (not shown: it may be a \
                 key)",
            ))
        }

        fn visit_seq<A: serde::de::SeqAccess<'de>>(
            self,
            mut seq: A,
        ) -> Result<Self::Value, A::Error> {
            let mut out = Vec::new();
            // An entry of another type is refused with its type alone (`expected a string`).
            while let Some(entry) = seq.next_element::<String>()? {
                out.push(entry);
            }
            Ok(out)
        }
    }
    d.deserialize_any(Digests)
}

/// A stored key digest as it is compared: `sha256:` prefix and surrounding blanks dropped,
/// lower case (`gateway.api_keys` entries and the keys file's lines).
pub fn normalise_digest(stored: &str) -> String {
    stored
        .trim()
        .trim_start_matches("sha256:")
        .to_ascii_lowercase()
}

/// The longest duration any setting may name (ten years): long enough to mean "never", short
/// enough that every deadline computed from it is representable.
pub const MAX_SECONDS: f64 = 315_360_000.0;
/// The shortest a positive duration may be: each becomes a timer's period or a timeout, and one
/// that rounds to zero nanoseconds panicked a timer (`1e-10` passed as positive) or spun one.
pub const MIN_SECONDS: f64 = 0.001;

/// Most model requests in flight at once per endpoint: far above any real server's, and far
/// below the semaphore's own limit (`usize::MAX >> 3`, past which the first call panicked).
pub const MAX_CONCURRENT_REQUESTS: usize = 65_536;

/// Most messages `compression.protect_first_n` or `protect_last_n` may keep out of a summary.
pub const MAX_PROTECTED_MESSAGES: usize = 100_000;

/// Bounds of `terminal.output_cap` (characters of a command's output kept for the model; up to
/// four times as many bytes are buffered while a command runs).
pub const MIN_OUTPUT_CAP: usize = 256;
pub const MAX_OUTPUT_CAP: usize = 4_000_000;

impl Config {
    /// Load `home/config.yaml`; a missing file is the default config.
    pub fn load(home: &Path) -> Result<Config, ConfigError> {
        let path = home.join("config.yaml");
        let config = match std::fs::read_to_string(&path) {
            Ok(text) => Self::parse(&text, &path)?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Config::default(),
            Err(source) => return Err(ConfigError::Read { path, source }),
        };
        config.check_environment(|name| std::env::var(name).ok())?;
        Ok(config)
    }

    /// The environment's defaults that this config would use (`var` reads one): a bad one is a
    /// start-up error naming it. Before, `OPENAI_BASE_URL` without a scheme loaded, and every
    /// session's creation was then refused `invalid_params`, blaming a client that sent none.
    fn check_environment(
        &self,
        var: impl Fn(&'static str) -> Option<String>,
    ) -> Result<(), ConfigError> {
        if self.model.base_url.is_none() {
            if let Some(url) = var("OPENAI_BASE_URL").filter(|u| !u.is_empty()) {
                // What is wrong with it is said, never the value: it may carry a key (in its
                // credentials or query, or be one set in the wrong variable), and the refusal
                // goes to the journal. `model.base_url` is refused without its value too.
                if let Some(fault) = endpoint_url_fault(&url) {
                    return Err(ConfigError::Environment {
                        name: "OPENAI_BASE_URL",
                        message: format!(
                            "{ENDPOINT_URL_EXPECTED} (it has {fault}; `model.base_url` in \
                             config.yaml takes its place)"
                        ),
                    });
                }
            }
        }
        Ok(())
    }

    /// Parse YAML (or JSON) text.
    pub fn parse(text: &str, path: &Path) -> Result<Config, ConfigError> {
        let raw: Value = if text.trim().is_empty() {
            Value::Object(Default::default())
        } else {
            serde_norway::from_str(text).map_err(|e| ConfigError::Parse {
                path: path.to_path_buf(),
                message: e.to_string(),
            })?
        };
        let raw = if raw.is_null() {
            Value::Object(Default::default())
        } else {
            raw
        };
        if !raw.is_object() {
            return Err(ConfigError::Parse {
                path: path.to_path_buf(),
                message: "the top level must be a mapping".into(),
            });
        }
        let config: Config = Self::from_value(raw)?;
        config.validate()?;
        Ok(config)
    }

    fn from_value(raw: Value) -> Result<Config, ConfigError> {
        // Deserialize section by section so an error names its key.
        let obj = raw.as_object().cloned().unwrap_or_default();
        let mut config = Config::default();
        let mut legacy_clarify = None;
        for (key, value) in obj {
            let k = key.as_str();
            match k {
                "gateway" => config.gateway = section(k, value)?,
                "model" => config.model = section(k, value)?,
                "auxiliary" => config.auxiliary = section(k, value)?,
                "compression" => config.compression = section(k, value)?,
                "terminal" => config.terminal = section(k, value)?,
                "approvals" => {
                    // The system this gateway replaces has a `smart` mode (a model decides);
                    // its configs load, as `manual`, and the start says so.
                    for field in ["mode", "unattended_mode"] {
                        if value.get(field).and_then(Value::as_str) == Some("smart") {
                            config.notices.push(format!(
                                "approvals.{field}: smart is not supported here and is taken as \
                                 manual (a human answers every dangerous command)"
                            ));
                        }
                    }
                    config.approvals = section(k, value)?
                }
                "agent" => config.agent = section(k, value)?,
                "platform_toolsets" => config.platform_toolsets = section(k, value)?,
                "session" => config.session = section(k, value)?,
                "events" => config.events = section(k, value)?,
                "http" => config.http = section(k, value)?,
                // A profile with nothing under it is a profile of defaults.
                "profiles" => {
                    let profiles: BTreeMap<String, Option<ProfileConfig>> = section(k, value)?;
                    config.profiles = profiles
                        .into_iter()
                        .map(|(name, p)| (name, p.unwrap_or_default()))
                        .collect();
                }
                "rooms" => config.rooms = section(k, value)?,
                // The older name of `agent.clarify_timeout`, which wins when set (configs
                // written for the system this gateway replaces carry it).
                // (`clarify:` with nothing under it says nothing.)
                "clarify" if value.is_null() => {}
                "clarify" => {
                    let legacy: LegacyClarify = section(k, value)?;
                    if let Some(timeout) = legacy.timeout {
                        if !(timeout.is_finite() && (MIN_SECONDS..=MAX_SECONDS).contains(&timeout))
                        {
                            return Err(ConfigError::Invalid {
                                key: "clarify.timeout".into(),
                                message: format!(
                                    "expected {MIN_SECONDS} to {MAX_SECONDS} seconds (every wait \
                                     for an answer is bounded)"
                                ),
                            });
                        }
                        legacy_clarify = Some(timeout);
                    }
                    for (rest, v) in legacy.extra {
                        config.extra.insert(format!("clarify.{rest}"), v);
                    }
                }
                _ => {
                    config.extra.insert(key, value);
                }
            }
        }
        if let Some(timeout) = legacy_clarify {
            config.agent.clarify_timeout = timeout;
        }
        Ok(config)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |key: &str, message: &str| {
            Err(ConfigError::Invalid {
                key: key.to_string(),
                message: message.to_string(),
            })
        };
        if self.gateway.bind_host().is_empty() {
            return invalid(
                "gateway.host",
                "expected a host name or an IP address (127.0.0.1 by default)",
            );
        }
        if self.gateway.max_frame_bytes < 1024 {
            return invalid("gateway.max_frame_bytes", "expected at least 1024");
        }
        // The gateway's id is written into each room it creates and read back to find the rooms
        // it drives: an id a room could not hold (spaces, other characters) failed every
        // `room.create`, and one with spaces around it was trimmed there but not where the
        // rooms were looked up, so its rooms were never driven.
        if let Some(id) = &self.gateway.id {
            let held = crate::store::rooms::validate_identifier("gateway.id", id);
            if held.ok().as_deref() != Some(id.as_str()) {
                return invalid(
                    "gateway.id",
                    "expected 1-128 characters of letters, digits, '.', '_', ':' or '-', \
                     starting with a letter or digit",
                );
            }
        }
        // A model provider with nowhere to send requests would fail every turn.
        let endpoint = self.default_endpoint();
        if endpoint.provider != "echo" && endpoint.base_url.is_none() {
            return invalid(
                "model.base_url",
                &format!(
                    "provider {:?} needs a base_url (or OPENAI_BASE_URL)",
                    endpoint.provider
                ),
            );
        }
        // A key is listed by its SHA-256 (`gatehouse key create` prints one): anything else
        // (the key itself, a truncated hash) would match nothing while it still counted as
        // "a key is configured".
        let digest = |k: &str| {
            let hex = normalise_digest(k);
            hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit())
        };
        if let Some(bad) = self.gateway.api_keys.iter().position(|k| !digest(k)) {
            return invalid(
                "gateway.api_keys",
                &format!(
                    "entry {bad} is not a key's SHA-256 (expected sha256:<64 hex digits>, \
                     as `gatehouse key create` prints; never the key itself)"
                ),
            );
        }
        if self
            .gateway
            .allowed_cwd_roots
            .iter()
            .any(|r| !r.is_absolute())
        {
            return invalid(
                "gateway.allowed_cwd_roots",
                "expected a list of absolute directory paths",
            );
        }
        if !(self.compression.threshold > 0.0 && self.compression.threshold <= 1.0) {
            return invalid("compression.threshold", "expected a fraction in (0, 1]");
        }
        if self.compression.max_attempts == 0 || self.compression.max_attempts > 10 {
            return invalid("compression.max_attempts", "expected 1 to 10");
        }
        // A huge value overflowed the sums a turn makes of them (a panic in the turn).
        for (key, n) in [
            (
                "compression.protect_first_n",
                self.compression.protect_first_n,
            ),
            (
                "compression.protect_last_n",
                self.compression.protect_last_n,
            ),
        ] {
            if n > MAX_PROTECTED_MESSAGES {
                return invalid(
                    key,
                    &format!("expected 0 to {MAX_PROTECTED_MESSAGES} messages"),
                );
            }
        }
        // A huge value (past the semaphore's most permits) made the first model call panic.
        if !(1..=MAX_CONCURRENT_REQUESTS).contains(&self.model.max_concurrent_requests) {
            return invalid(
                "model.max_concurrent_requests",
                &format!("expected 1 to {MAX_CONCURRENT_REQUESTS}"),
            );
        }
        if !(MIN_OUTPUT_CAP..=MAX_OUTPUT_CAP).contains(&self.terminal.output_cap) {
            return invalid(
                "terminal.output_cap",
                &format!("expected {MIN_OUTPUT_CAP} to {MAX_OUTPUT_CAP} characters"),
            );
        }
        if let Err(e) = self.rooms.validate() {
            return invalid("rooms", &e.0);
        }
        if self.events.max_per_session < 1 {
            return invalid("events.max_per_session", "expected at least 1");
        }
        // Every duration is finite and bounded: each becomes a `Duration` or a deadline, and an
        // infinite or huge one would overflow there (a panic in the middle of a turn).
        let (g, m, h) = (&self.gateway, &self.model, &self.http);
        let zero_or_more = [
            ("gateway.drain_grace_seconds", g.drain_grace_seconds),
            ("gateway.bind_wait_seconds", g.bind_wait_seconds),
            ("events.retention_seconds", self.events.retention_seconds),
            (
                "terminal.log_retention_seconds",
                self.terminal.log_retention_seconds,
            ),
            ("http.max_wait_seconds", h.max_wait_seconds),
        ];
        for (key, v) in zero_or_more {
            if !(v.is_finite() && (0.0..=MAX_SECONDS).contains(&v)) {
                return invalid(key, &format!("expected 0 to {MAX_SECONDS} seconds"));
            }
        }
        let positive = [
            ("gateway.drain_timeout_seconds", g.drain_timeout_seconds),
            ("gateway.ticket_ttl_seconds", g.ticket_ttl_seconds),
            ("gateway.heartbeat_seconds", g.heartbeat_seconds),
            ("gateway.client_timeout_seconds", g.client_timeout_seconds),
            ("model.timeout_seconds", m.timeout_seconds),
            (
                "session.admission_timeout_seconds",
                self.session.admission_timeout_seconds,
            ),
            ("model.connect_timeout_seconds", m.connect_timeout_seconds),
            ("model.idle_timeout_seconds", m.idle_timeout_seconds),
            (
                "auxiliary.compression.timeout",
                self.auxiliary.compression.timeout,
            ),
            ("terminal.timeout", self.terminal.timeout),
            // Every wait for an answer is bounded: an unanswered approval fails closed.
            ("approvals.timeout", self.approvals.timeout),
            ("agent.clarify_timeout", self.agent.clarify_timeout),
            (
                "events.prune_interval_seconds",
                self.events.prune_interval_seconds,
            ),
            ("http.sse_keepalive_seconds", h.sse_keepalive_seconds),
            (
                "http.completion_timeout_seconds",
                h.completion_timeout_seconds,
            ),
            ("http.body_timeout_seconds", h.body_timeout_seconds),
            ("http.token_ttl_seconds", h.token_ttl_seconds),
        ];
        for (key, v) in positive {
            if !(v.is_finite() && (MIN_SECONDS..=MAX_SECONDS).contains(&v)) {
                return invalid(
                    key,
                    &format!("expected {MIN_SECONDS} to {MAX_SECONDS} seconds"),
                );
            }
        }
        // Below these the value was raised to them where it was used, silently: refused here,
        // as every other value out of range is.
        let floors = [
            (
                "model.connect_timeout_seconds",
                m.connect_timeout_seconds,
                0.1,
            ),
            ("model.idle_timeout_seconds", m.idle_timeout_seconds, 0.1),
            ("gateway.heartbeat_seconds", g.heartbeat_seconds, 0.1),
            (
                "gateway.client_timeout_seconds",
                g.client_timeout_seconds,
                0.2,
            ),
            (
                "auxiliary.compression.timeout",
                self.auxiliary.compression.timeout,
                1.0,
            ),
            (
                "gateway.outbound_queue_frames",
                g.outbound_queue_frames as f64,
                16.0,
            ),
        ];
        for (key, v, floor) in floors {
            if v < floor {
                return invalid(key, &format!("expected at least {floor}"));
            }
        }
        // A client is pinged once a heartbeat and cut off when nothing (a pong) has come from
        // it for the timeout: one no longer than the heartbeat cut off healthy idle clients.
        if g.client_timeout_seconds <= g.heartbeat_seconds {
            return invalid(
                "gateway.client_timeout_seconds",
                &format!(
                    "expected longer than gateway.heartbeat_seconds ({} s): a client is pinged \
                     once a heartbeat and cut off when it has not answered for this long",
                    g.heartbeat_seconds
                ),
            );
        }
        if self.agent.max_iterations == 0 {
            return invalid("agent.max_iterations", "expected at least 1");
        }
        // Each of these bounds something that must admit at least one: at zero the gateway
        // would start and then refuse every input, connection or frame.
        let at_least_one = [
            ("gateway.max_connections", g.max_connections as u64),
            (
                "gateway.max_sessions_per_connection",
                g.max_sessions_per_connection as u64,
            ),
            (
                "gateway.outbound_queue_frames",
                g.outbound_queue_frames as u64,
            ),
            (
                "gateway.outbound_queue_bytes",
                g.outbound_queue_bytes as u64,
            ),
            (
                "session.max_queued_admissions",
                self.session.max_queued_admissions.max(0) as u64,
            ),
            ("session.max_text_bytes", self.session.max_text_bytes as u64),
            ("model.max_response_bytes", m.max_response_bytes as u64),
        ];
        for (key, v) in at_least_one {
            if v == 0 {
                return invalid(key, "expected at least 1");
            }
        }
        let windows = std::iter::once(("model.context_length".to_string(), m.context_length))
            .chain(
                self.profiles
                    .iter()
                    .map(|(name, p)| (format!("profiles.{name}.context_length"), p.context_length)),
            );
        for (key, window) in windows {
            if window == Some(0) {
                return invalid(&key, "expected a positive number of tokens");
            }
        }
        // A tool name the gateway does not know would be offered to no session, silently.
        let toolsets = self
            .platform_toolsets
            .iter()
            .map(|(source, tools)| (format!("platform_toolsets.{source}"), tools))
            .chain(self.profiles.iter().filter_map(|(name, p)| {
                p.toolsets
                    .as_ref()
                    .map(|tools| (format!("profiles.{name}.toolsets"), tools))
            }));
        for (key, tools) in toolsets {
            if let Some(bad) = tools
                .iter()
                .find(|t| !crate::tools::KNOWN_TOOLS.contains(&t.as_str()))
            {
                return invalid(
                    &key,
                    &format!(
                        "unknown tool {bad:?} (known: {})",
                        crate::tools::KNOWN_TOOLS.join(", ")
                    ),
                );
            }
        }
        if let Some(cwd) = &self.terminal.cwd {
            if !cwd.is_absolute() {
                return invalid("terminal.cwd", "expected an absolute directory path");
            }
        }
        // Every endpoint a session may be given: a bad one loaded, then failed every session of
        // its profile (or every compression) when it came to be used.
        let urls = std::iter::once(("model.base_url".to_string(), &self.model.base_url))
            .chain(std::iter::once((
                "auxiliary.compression.base_url".to_string(),
                &self.auxiliary.compression.base_url,
            )))
            .chain(
                self.profiles
                    .iter()
                    .map(|(name, p)| (format!("profiles.{name}.base_url"), &p.base_url)),
            );
        for (key, url) in urls {
            if let Some(url) = url {
                if !endpoint_url_fits(url) {
                    return invalid(&key, ENDPOINT_URL_EXPECTED);
                }
            }
        }
        Ok(())
    }

    /// Endpoints that are missing unless each session brings its own, for a warning at start:
    /// a profile naming a provider other than echo with no `base_url` of its own or by default
    /// (a session of it fails each turn unless `session.create` gives one), and the summary
    /// model naming one (a compression fails unless the session has an endpoint).
    pub fn endpoint_warnings(&self) -> Vec<String> {
        let endpoint = self.default_endpoint();
        if endpoint.base_url.is_some() {
            return Vec::new();
        }
        let mut out: Vec<String> = self
            .profiles
            .iter()
            .filter_map(|(name, p)| {
                let provider = p.provider.as_deref().unwrap_or(&endpoint.provider);
                (provider != "echo" && p.base_url.is_none()).then(|| {
                    format!(
                        "profiles.{name}: provider {provider:?} has no base_url (nor \
                         model.base_url): its sessions fail each turn unless created with one"
                    )
                })
            })
            .collect();
        let aux = &self.auxiliary.compression;
        if let Some(provider) = aux.provider.as_deref() {
            if provider != "echo" && aux.base_url.is_none() {
                out.push(format!(
                    "auxiliary.compression: provider {provider:?} has no base_url (nor \
                     model.base_url): compressions use the session's endpoint, and fail where \
                     it has none"
                ));
            }
        }
        out
    }

    /// Every unknown key, dotted (`gateway.multiplex_profiles`), for a one-time warning.
    pub fn unknown_keys(&self) -> Vec<String> {
        let mut out = Vec::new();
        let mut push = |prefix: &str, extra: &Extra| {
            for key in extra.keys() {
                out.push(if prefix.is_empty() {
                    key.clone()
                } else {
                    format!("{prefix}.{key}")
                });
            }
        };
        push("", &self.extra);
        push("gateway", &self.gateway.extra);
        push("model", &self.model.extra);
        push("auxiliary", &self.auxiliary.extra);
        push("auxiliary.compression", &self.auxiliary.compression.extra);
        push("compression", &self.compression.extra);
        push("terminal", &self.terminal.extra);
        push("approvals", &self.approvals.extra);
        push("agent", &self.agent.extra);
        push("session", &self.session.extra);
        push("events", &self.events.extra);
        push("http", &self.http.extra);
        push("rooms", &self.rooms.extra);
        for (name, profile) in &self.profiles {
            push(&format!("profiles.{name}"), &profile.extra);
        }
        out
    }

    /// Tools offered to sessions of `source` by the platform (before the session's own list).
    pub fn platform_tools(&self, source: &str) -> Vec<String> {
        self.platform_toolsets
            .get(source)
            .cloned()
            .unwrap_or_else(|| {
                if is_unattended(source) {
                    // Nobody could answer a clarifying question.
                    vec!["terminal".to_string()]
                } else {
                    vec!["terminal".to_string(), "clarify".to_string()]
                }
            })
    }
}

/// The model endpoint a session is frozen to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub provider: String,
    pub model: String,
    pub base_url: Option<String>,
}

impl Config {
    /// The default endpoint: config, then `OPENAI_BASE_URL`, then the built-in echo provider.
    pub fn default_endpoint(&self) -> Endpoint {
        let env_url = std::env::var("OPENAI_BASE_URL")
            .ok()
            .filter(|s| !s.is_empty());
        let base_url = self.model.base_url.clone().or(env_url);
        let provider = self.model.provider.clone().unwrap_or_else(|| {
            if base_url.is_some() {
                "custom".into()
            } else {
                "echo".into()
            }
        });
        let model = self.model.default.clone().unwrap_or_else(|| {
            if provider == "echo" {
                "echo".into()
            } else {
                "default".into()
            }
        });
        Endpoint {
            provider,
            model,
            base_url,
        }
    }

    /// The API key for the main model.
    pub fn api_key(&self) -> Option<String> {
        self.model
            .api_key
            .clone()
            .or_else(|| std::env::var("OPENAI_API_KEY").ok())
    }

    /// Whether `base_url` is an endpoint the operator configured (the default model, a profile, or
    /// the auxiliary model). A session's `base_url` is chosen by its client; the configured keys go
    /// only to configured endpoints, so a client cannot point a session at its own server and
    /// collect them.
    pub fn is_configured_endpoint(&self, base_url: &str) -> bool {
        let same = |u: &str| u.trim_end_matches('/') == base_url.trim_end_matches('/');
        self.default_endpoint()
            .base_url
            .as_deref()
            .is_some_and(same)
            || self
                .profiles
                .values()
                .filter_map(|p| p.base_url.as_deref())
                .any(same)
            || self
                .auxiliary
                .compression
                .base_url
                .as_deref()
                .is_some_and(same)
    }

    /// The key to send to `base_url`: the main model's, only when `base_url` is configured.
    pub fn api_key_for(&self, base_url: Option<&str>) -> Option<String> {
        self.key_for(base_url, || self.api_key())
    }

    /// `key()` when `base_url` is a configured endpoint, else no key at all.
    pub fn key_for(
        &self,
        base_url: Option<&str>,
        key: impl FnOnce() -> Option<String>,
    ) -> Option<String> {
        base_url
            .is_some_and(|u| self.is_configured_endpoint(u))
            .then(key)
            .flatten()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The key and message of the refusal of config `text` (anything else fails the test).
    fn invalid(text: &str) -> (String, String) {
        match parse(text) {
            Err(ConfigError::Invalid { key, message }) => (key, message),
            other => panic!("{text}: expected an invalid setting, got {other:?}"),
        }
    }

    fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::parse(text, Path::new("config.yaml"))
    }

    /// Loopback is decided by the address, not its spelling: every 127/8 address, `::1`
    /// written in full, an IPv4 loopback as IPv6. Before, only three strings were, and
    /// `127.0.0.2` with no key configured was refused as a public listener.
    #[test]
    fn a_model_url_from_the_environment_must_be_http() {
        let env = |url: &'static str| {
            move |name: &'static str| (name == "OPENAI_BASE_URL").then(|| url.to_string())
        };
        let plain = Config::default();
        let err = plain
            .check_environment(env("api.example.com/v1"))
            .expect_err("no scheme");
        assert!(err.to_string().contains("`OPENAI_BASE_URL`"), "{err}");
        for bad in [
            "https://user:tok@host/v1",
            "https://host/v1?k=1",
            "https://host/v1#x",
        ] {
            plain.check_environment(env(bad)).expect_err(bad);
        }
        for fine in ["https://api.example.com/v1", "http://127.0.0.1:9/v1", ""] {
            plain.check_environment(env(fine)).expect(fine);
        }
        // Not used when the config names its own.
        let own = Config::parse(
            "model:\n  base_url: https://api.example.com/v1\n",
            Path::new("c"),
        )
        .expect("config");
        own.check_environment(env("api.example.com/v1"))
            .expect("overridden");
    }

    /// A refused `OPENAI_BASE_URL` is not copied into the message (the journal keeps it): a
    /// URL with credentials or a key in its query is refused for them, and said to have them.
    #[test]
    fn a_refused_model_url_from_the_environment_is_not_repeated() {
        let plain = Config::default();
        for (url, said) in [
            ("https://user:SECRET@proxy/v1", "credentials"),
            ("https://SECRET@proxy/v1", "credentials"),
            ("https://proxy/v1?key=SECRET", "query"),
            ("https://proxy/v1#SECRET", "fragment"),
            ("proxy/v1?key=SECRET", "scheme"),
            ("user:SECRET@proxy/v1", "scheme"),
            ("SECRET", "scheme"),
        ] {
            let err = plain
                .check_environment(|name| (name == "OPENAI_BASE_URL").then(|| url.to_string()))
                .expect_err(url)
                .to_string();
            assert!(!err.contains("SECRET"), "{url}: {err}");
            assert!(err.contains("`OPENAI_BASE_URL`"), "{url}: {err}");
            assert!(err.contains(said), "{url}: {err}");
        }
    }

    /// `api_keys` written as one string (a key where a list of digests belongs) is refused
    /// without the string: serde's own message quoted it, and the journal kept the key.
    #[test]
    fn api_keys_written_as_one_string_are_refused_without_it() {
        for text in [
            "gateway:\n  api_keys: gk_SECRET\n",
            "gateway: {api_keys: gk_SECRET, port: 1}\n",
            "{\"gateway\": {\"api_keys\": \"gk_SECRET\"}}",
            "gateway:\n  api_keys: [gk_SECRET]\n",
            "gateway:\n  api_keys:\n    - sha256:SECRET\n",
        ] {
            let (key, message) = invalid(text);
            assert_eq!(key, "gateway.api_keys", "{text}: {message}");
            assert!(!message.contains("SECRET"), "{text}: {message}");
        }
        // A list of digests, and a wrong type that holds no text, are as before.
        let digest = format!("sha256:{}", "ab".repeat(32));
        let c = parse(&format!("gateway:\n  api_keys: [{digest}]\n")).expect("a digest");
        assert_eq!(c.gateway.api_keys, vec![digest]);
        assert!(parse("gateway:\n  api_keys: []\n").is_ok());
        assert_eq!(invalid("gateway:\n  api_keys: 5\n").0, "gateway.api_keys");
    }

    /// A heartbeat at least as long as the client timeout is refused: pings go out each
    /// heartbeat and the timeout runs from the last pong, so a healthy idle client was cut off.
    #[test]
    fn a_client_timeout_no_longer_than_the_heartbeat_is_refused() {
        for text in [
            "gateway:\n  heartbeat_seconds: 60\n",
            "gateway:\n  heartbeat_seconds: 61\n",
            "gateway:\n  heartbeat_seconds: 15\n  client_timeout_seconds: 15\n",
            "gateway:\n  heartbeat_seconds: 15\n  client_timeout_seconds: 10\n",
            "gateway:\n  client_timeout_seconds: 1\n",
        ] {
            let (key, message) = invalid(text);
            assert_eq!(key, "gateway.client_timeout_seconds", "{text}: {message}");
            assert!(
                message.contains("gateway.heartbeat_seconds") && message.contains("longer"),
                "{text}: {message}"
            );
        }
        let defaults = Config::default();
        assert!(defaults.gateway.heartbeat_seconds < defaults.gateway.client_timeout_seconds);
        for fine in [
            "",
            "gateway:\n  heartbeat_seconds: 59\n",
            "gateway:\n  heartbeat_seconds: 0.2\n  client_timeout_seconds: 2\n",
            "gateway:\n  heartbeat_seconds: 120\n  client_timeout_seconds: 300\n",
            "gateway:\n  heartbeat_seconds: 0.3\n",
        ] {
            parse(fine).expect(fine);
        }
    }

    #[test]
    fn a_loopback_listener_is_known_by_its_address() {
        let on = |host: &str| {
            GatewayConfig {
                host: host.into(),
                ..Default::default()
            }
            .is_loopback()
        };
        for host in [
            "127.0.0.1",
            "127.0.0.2",
            "localhost",
            "LocalHost",
            "::1",
            "0:0:0:0:0:0:0:1",
            "[::1]",
            "::ffff:127.0.0.1",
        ] {
            assert!(on(host), "{host}");
        }
        for host in [
            "0.0.0.0",
            "::",
            "192.168.1.2",
            "example.com",
            "128.0.0.1",
            "::ffff:10.0.0.1",
        ] {
            assert!(!on(host), "{host}");
        }
        // An empty host names nothing to bind.
        for empty in ["", "  ", "[]"] {
            let e = parse(&format!("gateway: {{host: {empty:?}}}")).expect_err(empty);
            assert!(e.to_string().contains("gateway.host"), "{e}");
        }
    }

    #[test]
    fn json_is_yaml_and_unknown_keys_are_collected() {
        let c = parse(r#"{"gateway":{"multiplex_profiles":false},"auxiliary":{"title_generation":{"enabled":false}},
            "model":{"provider":"custom","default":"m","base_url":"http://127.0.0.1:9/v1","context_length":64000},
            "approvals":{"mode":"manual","timeout":120},"platform_toolsets":{"cli":["terminal"]},
            "rooms":{"lease_ttl_seconds":12,"driver_heartbeat":3},
            "profiles":{"coder":{"model":"m2","personality":"terse"}}}"#)
        .expect("loads");
        assert_eq!(c.model.context_length, Some(64000));
        assert_eq!(c.approvals.timeout, 120.0);
        assert_eq!(c.platform_tools("cli"), vec!["terminal".to_string()]);
        let unknown = c.unknown_keys();
        assert!(
            unknown.contains(&"gateway.multiplex_profiles".to_string()),
            "{unknown:?}"
        );
        assert!(
            unknown.contains(&"auxiliary.title_generation".to_string()),
            "{unknown:?}"
        );
        // Every section, rooms and each profile included, loads past a key it does not know.
        assert_eq!(c.rooms.lease_ttl_seconds, 12.0);
        assert!(
            unknown.contains(&"rooms.driver_heartbeat".to_string()),
            "{unknown:?}"
        );
        assert_eq!(c.profiles["coder"].model.as_deref(), Some("m2"));
        assert!(
            unknown.contains(&"profiles.coder.personality".to_string()),
            "{unknown:?}"
        );
    }

    #[test]
    fn max_turns_is_max_iterations_by_its_older_name() {
        let c = parse("agent:\n  max_turns: 7\n").expect("loads");
        assert_eq!(c.agent.max_iterations, 7);
        assert!(c.unknown_keys().is_empty(), "{:?}", c.unknown_keys());
        assert!(parse("agent:\n  max_turns: 7\n  max_iterations: 8\n").is_err());
    }

    #[test]
    fn a_bad_value_names_its_key_inside_the_section() {
        for (text, key) in [
            ("gateway:\n  port: lots\n", "gateway.port"),
            ("model:\n  context_length: -3\n", "model.context_length"),
            (
                "profiles:\n  ops:\n    toolsets: terminal\n",
                "profiles.ops",
            ),
            (
                "session:\n  max_queued_admissions: x\n",
                "session.max_queued_admissions",
            ),
        ] {
            let err = parse(text).unwrap_err().to_string();
            assert!(err.contains(&format!("`{key}`")), "{text}: {err}");
        }
    }

    #[test]
    fn a_provider_without_an_endpoint_is_refused() {
        if std::env::var_os("OPENAI_BASE_URL").is_some() {
            return; // the environment names the endpoint
        }
        let err = parse("model:\n  provider: custom\n  default: m\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("`model.base_url`"), "{err}");
        assert!(parse("model:\n  provider: custom\n  base_url: http://127.0.0.1:9/v1\n").is_ok());
        assert!(parse("model:\n  provider: echo\n").is_ok());
        // A profile or the summary model naming a provider, with no endpoint of its own or by
        // default, loads (a session may be created with its own) and is warned about.
        let c = parse(
            "profiles:\n  x:\n    provider: custom\n  y:\n    provider: echo\n  z:\n    provider: custom\n    base_url: http://127.0.0.1:9/v1\nauxiliary:\n  compression:\n    provider: custom\n",
        )
        .expect("loads");
        let warned = c.endpoint_warnings();
        assert_eq!(warned.len(), 2, "{warned:?}");
        assert!(warned[0].starts_with("profiles.x:"), "{warned:?}");
        assert!(
            warned[1].starts_with("auxiliary.compression:"),
            "{warned:?}"
        );
        let with_default =
            "model:\n  provider: custom\n  base_url: http://127.0.0.1:9/v1\nprofiles:\n  x:\n    provider: custom\n";
        assert!(parse(with_default)
            .expect("loads")
            .endpoint_warnings()
            .is_empty());
    }

    /// A section with nothing under it (its keys commented out) is its defaults, at the top
    /// level, nested, and as a profile: each stopped the start before.
    #[test]
    fn an_empty_section_is_its_defaults() {
        let c = parse(
            "model:\n  # provider: custom\ngateway:\nauxiliary:\n  compression:\nrooms:\nprofiles:\n  plain:\n",
        )
        .expect("loads");
        assert_eq!(c.model.max_concurrent_requests, 64);
        assert_eq!(c.auxiliary.compression.timeout, 120.0);
        assert_eq!(c.rooms, crate::rooms::RoomsConfig::default());
        assert!(c.profiles["plain"].model.is_none());
        assert!(c.unknown_keys().is_empty(), "{:?}", c.unknown_keys());
    }

    #[test]
    fn bad_values_name_their_key() {
        let err = parse("approvals:\n  mode: sometimes\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("approvals") && err.contains("manual"), "{err}");
        let err = parse("gateway:\n  port: lots\n").unwrap_err().to_string();
        assert!(err.contains("gateway"), "{err}");
        let err = parse("compression:\n  threshold: 3\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("compression.threshold"), "{err}");
        let err = parse("- a\n- b\n").unwrap_err().to_string();
        assert!(err.contains("mapping"), "{err}");
        // A gateway id a room could not hold, or one with spaces around it.
        for id in ["\" gw-a \"", "gw a", "\"\"", "-gw"] {
            let (key, _) = invalid(&format!("gateway:\n  id: {id}\n"));
            assert_eq!(key, "gateway.id", "{id}");
        }
        let c = parse("gateway:\n  id: gw-a.1_b:2\n").expect("a good id");
        assert_eq!(c.gateway.id.as_deref(), Some("gw-a.1_b:2"));
    }

    #[test]
    fn bounds_that_would_refuse_everything_are_refused_at_load() {
        // Each of these loaded once, and the gateway then refused every input, connection or
        // frame (or offered a tool it does not have to no one).
        for (text, key) in [
            (
                "session:\n  max_queued_admissions: 0\n",
                "session.max_queued_admissions",
            ),
            (
                "session:\n  max_queued_admissions: -4\n",
                "session.max_queued_admissions",
            ),
            (
                "gateway:\n  max_connections: 0\n",
                "gateway.max_connections",
            ),
            (
                "gateway:\n  outbound_queue_frames: 0\n",
                "gateway.outbound_queue_frames",
            ),
            ("model:\n  context_length: 0\n", "model.context_length"),
            (
                "profiles:\n  p:\n    context_length: 0\n",
                "profiles.p.context_length",
            ),
            (
                "platform_toolsets:\n  cli: [terminal, browser]\n",
                "platform_toolsets.cli",
            ),
            (
                "profiles:\n  p:\n    toolsets: [termnial]\n",
                "profiles.p.toolsets",
            ),
            ("terminal:\n  cwd: work\n", "terminal.cwd"),
            ("session:\n  max_text_bytes: 0\n", "session.max_text_bytes"),
            (
                "model:\n  max_response_bytes: 0\n",
                "model.max_response_bytes",
            ),
            (
                "profiles:\n  p:\n    base_url: ftp://x\n",
                "profiles.p.base_url",
            ),
            (
                "auxiliary:\n  compression:\n    base_url: localhost:9\n",
                "auxiliary.compression.base_url",
            ),
            // Values that were raised where they were used, or panicked there.
            (
                "model:\n  max_concurrent_requests: 1000000000000000000\n",
                "model.max_concurrent_requests",
            ),
            ("terminal:\n  output_cap: 0\n", "terminal.output_cap"),
            (
                "compression:\n  protect_first_n: 18446744073709551615\n",
                "compression.protect_first_n",
            ),
            (
                "compression:\n  protect_last_n: 100001\n",
                "compression.protect_last_n",
            ),
            (
                "model:\n  idle_timeout_seconds: 0.01\n",
                "model.idle_timeout_seconds",
            ),
            (
                "auxiliary:\n  compression:\n    timeout: 0.5\n",
                "auxiliary.compression.timeout",
            ),
            (
                "gateway:\n  outbound_queue_frames: 8\n",
                "gateway.outbound_queue_frames",
            ),
        ] {
            let (k, message) = invalid(text);
            assert_eq!(k, key, "{text}: {message}");
        }
        let err = parse("platform_toolsets:\n  cli: [terminal, browser]\n")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("\"browser\"") && err.contains("clarify"),
            "{err}"
        );
        assert!(parse("platform_toolsets:\n  cli: []\n").is_ok());
    }

    #[test]
    fn every_duration_is_finite_and_bounded() {
        // Each of these passed the loader once and panicked later, in the middle of a turn or a
        // stop, when it became a `Duration`.
        for (text, key) in [
            ("model:\n  timeout_seconds: .inf\n", "model.timeout_seconds"),
            ("approvals:\n  timeout: .inf\n", "approvals.timeout"),
            ("approvals:\n  timeout: -1\n", "approvals.timeout"),
            ("agent:\n  clarify_timeout: .nan\n", "agent.clarify_timeout"),
            (
                "gateway:\n  drain_timeout_seconds: 1e300\n",
                "gateway.drain_timeout_seconds",
            ),
            (
                "gateway:\n  drain_grace_seconds: .inf\n",
                "gateway.drain_grace_seconds",
            ),
            (
                "auxiliary:\n  compression:\n    timeout: .inf\n",
                "auxiliary.compression.timeout",
            ),
            ("http:\n  max_wait_seconds: 1e20\n", "http.max_wait_seconds"),
            ("rooms:\n  turn_timeout_seconds: 1e300\n", "rooms"),
            // A period that rounds to no time at all panicked its timer, or spun it.
            ("rooms:\n  prune_interval_seconds: 1e-10\n", "rooms"),
            ("rooms:\n  poll_interval_seconds: 0.0001\n", "rooms"),
            (
                "events:\n  prune_interval_seconds: 1e-10\n",
                "events.prune_interval_seconds",
            ),
            (
                "gateway:\n  heartbeat_seconds: 1e-12\n",
                "gateway.heartbeat_seconds",
            ),
            (
                "terminal:\n  log_retention_seconds: -1\n",
                "terminal.log_retention_seconds",
            ),
        ] {
            // (YAML's .inf and .nan do not survive the JSON reading: their section is named.)
            let (k, _) = invalid(text);
            assert!(
                k == key || key.starts_with(&format!("{k}.")),
                "{text}: named {k}"
            );
        }
        // Every wait for an answer is bounded (an approval fails closed when it runs out).
        for (text, key) in [
            ("approvals:\n  timeout: 0\n", "approvals.timeout"),
            ("agent:\n  clarify_timeout: 0\n", "agent.clarify_timeout"),
            ("clarify:\n  timeout: -1\n", "clarify.timeout"),
        ] {
            assert_eq!(invalid(text).0, key, "{text}");
        }
    }

    /// `clarify.timeout`, the older name of `agent.clarify_timeout`, wins when set (it was
    /// warned about as unknown, and a clarify waited an hour); what else is under `clarify` is
    /// warned about as unknown.
    #[test]
    fn a_smart_approval_mode_is_taken_as_manual_and_said_so() {
        let c = parse("approvals:\n  mode: smart\n  unattended_mode: deny\n").expect("loads");
        assert_eq!(c.approvals.mode, ApprovalMode::Manual);
        assert_eq!(c.notices.len(), 1, "{:?}", c.notices);
        assert!(
            c.notices[0].starts_with("approvals.mode: smart"),
            "{:?}",
            c.notices
        );
        assert!(parse("approvals:\n  mode: manual\n")
            .expect("loads")
            .notices
            .is_empty());
    }

    #[test]
    fn the_older_clarify_timeout_wins() {
        let c = parse("agent:\n  clarify_timeout: 120\nclarify:\n  timeout: 30\n  other: 1\n")
            .expect("config");
        assert_eq!(c.agent.clarify_timeout, 30.0);
        assert_eq!(c.unknown_keys(), vec!["clarify.other".to_string()]);
        for text in [
            "agent:\n  clarify_timeout: 120\n",
            "agent:\n  clarify_timeout: 120\nclarify:\n",
        ] {
            let c = parse(text).expect("config");
            assert_eq!(c.agent.clarify_timeout, 120.0, "{text}");
            assert!(c.unknown_keys().is_empty(), "{text}");
        }
    }

    #[test]
    fn api_keys_must_be_digests() {
        for keys in [r#"["gk_the_key_itself"]"#, r#"["sha256:abc"]"#] {
            let text = format!("gateway:\n  api_keys: {keys}\n");
            let (key, message) = invalid(&text);
            assert_eq!(key, "gateway.api_keys");
            assert!(message.contains("entry 0"), "{message}");
        }
        let digest = "a".repeat(64);
        parse(&format!(
            "gateway:\n  api_keys: [\"sha256:{digest}\", \"{digest}\"]\n"
        ))
        .expect("digests load");
    }

    #[test]
    fn yaml_false_means_approvals_off_and_defaults_hold() {
        let c = parse("approvals:\n  mode: false\n").expect("loads");
        assert_eq!(c.approvals.mode, ApprovalMode::Off);
        let c = parse("").expect("empty loads");
        assert_eq!(c.gateway.max_frame_bytes, 1 << 20);
        assert_eq!(c.compression.protect_last_n, 20);
    }
}

#[cfg(test)]
mod example {
    use super::Config;
    use std::path::Path;

    /// The shipped example names only keys the gateway knows, each with its default value.
    #[test]
    fn the_example_config_is_every_default() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/config.example.yaml");
        let text = std::fs::read_to_string(&path).expect("the example config");
        let mut parsed = Config::parse(&text, &path).expect("the example parses");
        assert_eq!(parsed.unknown_keys(), Vec::<String>::new());
        let default = Config::default();
        // Its platform toolsets spell out what the built-in choice gives.
        for (source, tools) in std::mem::take(&mut parsed.platform_toolsets) {
            assert_eq!(tools, default.platform_tools(&source), "{source}");
        }
        assert_eq!(format!("{parsed:#?}"), format!("{default:#?}"));
        // And it names every key of every section (set, or commented out when it has no default).
        let named: Vec<String> = text
            .lines()
            .filter_map(|l| l.trim_start().trim_start_matches("# ").split_once(':'))
            .map(|(key, _)| key.trim().to_string())
            .collect();
        let fields = format!("{default:#?}");
        let missing: Vec<&str> = fields
            .lines()
            .filter(|l| l.starts_with("        ") && !l.starts_with("         "))
            .filter_map(|l| l.trim().split_once(':').map(|(key, _)| key))
            .filter(|key| *key != "extra" && !key.starts_with('"'))
            .filter(|key| !named.iter().any(|n| n == key))
            .collect();
        assert!(missing.is_empty(), "not in the example: {missing:?}");
    }
}
