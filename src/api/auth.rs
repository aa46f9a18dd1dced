//! Who is calling over HTTP, and the refusal body every `/v1` route shares.
//!
//! A caller proves itself with one of:
//! - `Authorization: Bearer <key>`: an API key whose SHA-256 is listed in `gateway.api_keys` or in
//!   the keys file `HOME/api_keys` (written by `gatehouse key create`; re-read when it changes, so
//!   `gatehouse key revoke` takes effect without a restart). Principal `key:<first 12 hex of the
//!   hash>`; keys are compared in constant time.
//! - `X-Gatehouse-Ticket: <ticket>`: a control-socket ticket, consumed by that one request.
//! - `Authorization: Bearer <token>`: a token from `POST /v1/auth/token` (which takes a ticket),
//!   valid for `http.token_ttl_seconds`; for local clients that make many requests.
//!
//! Tickets and tokens carry the principal of the control socket's user (`uid:N`).

use std::io::{Read, Seek, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use actix_web::http::StatusCode;
use actix_web::{web, FromRequest, HttpRequest, HttpResponse, ResponseError};
use serde_json::json;

use super::http::AppState;
use super::tickets::Expiring;
use crate::clock::SharedClock;
use crate::config::normalise_digest as normalise;
use crate::error::GatewayError;

/// The keys file in the home.
pub const KEYS_FILE: &str = "api_keys";
/// The header that carries a single-use control-socket ticket.
pub const TICKET_HEADER: &str = "x-gatehouse-ticket";

// ---------- refusals ----------

/// A refusal over HTTP: `{"error": {"reason", "message"}}` with a fitting status.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub reason: &'static str,
    pub message: String,
}

impl ApiError {
    pub fn new(status: StatusCode, reason: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            reason,
            message: message.into(),
        }
    }

    pub fn unauthorized(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::UNAUTHORIZED, "permission_denied", message)
    }

    pub fn invalid(message: impl Into<String>) -> ApiError {
        ApiError::from(GatewayError::InvalidParams(message.into()))
    }

    pub fn body(&self) -> serde_json::Value {
        json!({"error": {"reason": self.reason, "message": self.message}})
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.reason, self.message)
    }
}

/// The HTTP status of each stable reason.
pub fn status_of(err: &GatewayError) -> StatusCode {
    match err {
        GatewayError::InvalidParams(_)
        | GatewayError::Parse(_)
        | GatewayError::InvalidRequest(_) => StatusCode::BAD_REQUEST,
        GatewayError::NotFound(_) | GatewayError::UnknownMethod(_) => StatusCode::NOT_FOUND,
        GatewayError::PermissionDenied(_) => StatusCode::FORBIDDEN,
        GatewayError::ProfileMismatch(_)
        | GatewayError::StaleGeneration(_)
        | GatewayError::StaleEpoch
        | GatewayError::UnknownExecution(_)
        | GatewayError::AdmissionConflict(_) => StatusCode::CONFLICT,
        GatewayError::PayloadTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
        GatewayError::SessionBusy(_) | GatewayError::RateLimited(_) => {
            StatusCode::TOO_MANY_REQUESTS
        }
        GatewayError::RuntimeDraining
        | GatewayError::StorageUnavailable
        | GatewayError::Internal(_) => StatusCode::SERVICE_UNAVAILABLE,
    }
}

impl From<GatewayError> for ApiError {
    fn from(err: GatewayError) -> ApiError {
        ApiError {
            status: status_of(&err),
            reason: err.reason(),
            message: err.detail(),
        }
    }
}

/// The headers every refusal of `status` carries: the challenge of a 401, and when to come
/// back after a refusal that is about load or availability (`session_busy`, `rate_limited`,
/// `runtime_draining`, `storage_unavailable`): HTTP clients, OpenAI's among them, wait that
/// long before they retry, instead of at once or by a back-off of their own.
pub fn refusal_headers(status: StatusCode, r: &mut actix_web::HttpResponseBuilder) {
    match status {
        StatusCode::UNAUTHORIZED => {
            r.insert_header(("www-authenticate", "Bearer"));
        }
        StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE => {
            r.insert_header(("retry-after", RETRY_AFTER_SECONDS));
        }
        _ => {}
    }
}

/// The `Retry-After` of a refusal about load or availability, in seconds.
pub const RETRY_AFTER_SECONDS: &str = "1";

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        self.status
    }

    fn error_response(&self) -> HttpResponse {
        let mut r = HttpResponse::build(self.status);
        refusal_headers(self.status, &mut r);
        r.json(self.body())
    }
}

// ---------- API keys ----------

/// One line of the keys file: `sha256:<hex> <name> <created_unix_seconds>`.
#[derive(Debug, Clone, PartialEq)]
pub struct KeyEntry {
    pub digest: String,
    pub name: String,
    pub created_at: i64,
}

/// The SHA-256 of a key, as stored.
pub fn key_digest(key: &str) -> String {
    crate::store::rooms::sha256_hex(key)
}

pub fn keys_file(home: &Path) -> PathBuf {
    home.join(KEYS_FILE)
}

/// Parse the keys file (blank lines and `#` comments are skipped).
pub fn parse_keys(text: &str) -> Vec<KeyEntry> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .filter_map(|l| {
            let mut parts = l.split_whitespace();
            let digest = normalise(parts.next()?);
            if digest.len() != 64 || !digest.bytes().all(|b| b.is_ascii_hexdigit()) {
                return None;
            }
            Some(KeyEntry {
                digest,
                name: parts.next().unwrap_or("").to_string(),
                created_at: parts.next().and_then(|t| t.parse().ok()).unwrap_or(0),
            })
        })
        .collect()
}

/// The keys listed in `HOME/api_keys` (none when there is no file).
pub fn list_keys(home: &Path) -> std::io::Result<Vec<KeyEntry>> {
    match std::fs::read_to_string(keys_file(home)) {
        Ok(text) => Ok(parse_keys(&text)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(e),
    }
}

/// A key's name as the keys file holds it (one word: blanks become `-`).
fn key_name(name: &str) -> String {
    name.chars()
        .map(|c| if c.is_whitespace() { '-' } else { c })
        .collect()
}

/// `HOME/api_keys.lock`, held for one change of the keys file. Two `gatehouse key` commands at
/// once each read the file: a revoke written after another put back the key the other had
/// removed (and a key created meanwhile was lost).
fn lock_keys(home: &Path) -> std::io::Result<std::fs::File> {
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .open(home.join(format!("{KEYS_FILE}.lock")))?;
    // Waited for a while, not for ever: an urgent revoke behind a stuck command says so.
    let until = std::time::Instant::now() + KEYS_LOCK_WAIT;
    loop {
        match lock.try_lock() {
            Ok(()) => return Ok(lock),
            Err(std::fs::TryLockError::WouldBlock) if std::time::Instant::now() < until => {
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            Err(std::fs::TryLockError::WouldBlock) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!(
                        "another process has held {KEYS_FILE}.lock for {} s (a `gatehouse key` \
                         command still running?)",
                        KEYS_LOCK_WAIT.as_secs()
                    ),
                ))
            }
            Err(std::fs::TryLockError::Error(e)) => return Err(e),
        }
    }
}

/// How long a change of the keys file waits for another one to end.
const KEYS_LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// Make the keys file's latest name (a rename, its creation) last through a power loss: a
/// revoked key came back with the old directory entry.
fn sync_home(home: &Path) -> std::io::Result<()> {
    std::fs::File::open(home)?.sync_all()
}

/// Make a new key named `name`, append its hash to the keys file (created 0600) and return the
/// key itself: it is shown once and stored nowhere.
pub fn create_key(home: &Path, name: &str) -> std::io::Result<(String, KeyEntry)> {
    create_key_noting(home, name).map(|(key, entry, _)| (key, entry))
}

/// [`create_key`], with what its caller should tell the operator: the home could not be synced
/// after the key was written (lost to a power cut before the next sync, the key would not work).
pub fn create_key_noting(
    home: &Path,
    name: &str,
) -> std::io::Result<(String, KeyEntry, Option<String>)> {
    let name = key_name(name.trim());
    if name.is_empty() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "a key's name must not be empty",
        ));
    }
    let _lock = lock_keys(home)?;
    if list_keys(home)?.iter().any(|k| k.name == name) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::AlreadyExists,
            format!("a key named {name:?} exists already"),
        ));
    }
    let key = format!(
        "gk_{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    );
    let created_at = crate::store::now() as i64;
    let entry = KeyEntry {
        digest: key_digest(&key),
        name,
        created_at,
    };
    let path = keys_file(home);
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .read(true)
        .append(true)
        .mode(0o600)
        .open(&path)?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
    // A file written without a final newline (`printf`, a provisioning tool) would have the new
    // line glued to its last one: the new key never read as one, and the last line's maybe lost.
    let mut line = String::new();
    if f.metadata()?.len() > 0 {
        let mut last = [0u8];
        f.seek(std::io::SeekFrom::End(-1))?;
        f.read_exact(&mut last)?;
        if last[0] != b'\n' {
            line.push('\n');
        }
    }
    line.push_str(&format!(
        "sha256:{} {} {}\n",
        entry.digest, entry.name, entry.created_at
    ));
    f.write_all(line.as_bytes())?;
    f.sync_all()?;
    // The key is written and valid: shown whatever the home's sync says (lost to a power cut
    // before the home is synced, it is a key that does not work, and is made again).
    let warning = sync_home(home).err().map(|e| {
        format!("the home could not be synced after the key was added ({e}): a power cut now could lose it")
    });
    Ok((key, entry, warning))
}

/// Remove every key whose name is `which` or whose hash starts with it (at least 8 hex digits);
/// how many were removed.
pub fn revoke_key(home: &Path, which: &str) -> std::io::Result<usize> {
    let path = keys_file(home);
    let _lock = lock_keys(home)?;
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(e),
    };
    let prefix = normalise(which);
    // Named as `create` named it (`"ci bot"` is `ci-bot`).
    let name = key_name(which.trim());
    let matches = |e: &KeyEntry| {
        (!name.is_empty() && e.name == name) || (prefix.len() >= 8 && e.digest.starts_with(&prefix))
    };
    let mut removed = 0;
    let kept: Vec<&str> = text
        .lines()
        .filter(|l| match parse_keys(l).first() {
            Some(e) if matches(e) => {
                removed += 1;
                false
            }
            _ => true,
        })
        .collect();
    if removed > 0 {
        // A name of its own: a file another writer left is never written into.
        let tmp = home.join(format!("{KEYS_FILE}.{}.tmp", uuid::Uuid::new_v4().simple()));
        let written = (|| {
            let mut f = std::fs::OpenOptions::new()
                .create_new(true)
                .write(true)
                .mode(0o600)
                .open(&tmp)?;
            for l in kept {
                writeln!(f, "{l}")?;
            }
            f.sync_all()?;
            std::fs::rename(&tmp, &path)
        })();
        if let Err(e) = written {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
        sync_home(home).map_err(|e| {
            std::io::Error::new(
                e.kind(),
                format!(
                    "the key is revoked (the daemon refuses it now), but the home could not be \
                     synced, so a power loss could bring it back: {e}"
                ),
            )
        })?;
    }
    Ok(removed)
}

/// Size, modification time, inode and change time: when any changes, the file is read again.
/// Size and modification time alone missed a rotation that kept both (a file of the same length
/// copied with its times, `cp -p`; a store whose files all have one time): the revoked key was
/// accepted until a restart. A change time cannot be set back.
type Stamp = (u64, Option<SystemTime>, u64, i64, i64);

fn stamp_of(m: &std::fs::Metadata) -> Stamp {
    use std::os::unix::fs::MetadataExt;
    (
        m.len(),
        m.modified().ok(),
        m.ino(),
        m.ctime(),
        m.ctime_nsec(),
    )
}

/// The accepted API keys: `gateway.api_keys` plus the keys file, re-read when it changes.
pub struct ApiKeys {
    configured: Vec<String>,
    path: PathBuf,
    file: Mutex<(Option<Stamp>, Vec<String>)>,
}

impl ApiKeys {
    pub fn new(home: &Path, configured: &[String]) -> ApiKeys {
        let keys = ApiKeys {
            configured: configured.iter().map(|k| normalise(k)).collect(),
            path: keys_file(home),
            file: Mutex::new((None, Vec::new())),
        };
        keys.file_keys();
        keys
    }

    fn file_keys(&self) -> Vec<String> {
        let stamp = std::fs::metadata(&self.path).ok().map(|m| stamp_of(&m));
        let Ok(mut cache) = self.file.lock() else {
            return Vec::new();
        };
        if cache.0 != stamp || stamp.is_none() {
            let keys = match std::fs::read_to_string(&self.path) {
                Ok(t) => parse_keys(&t).into_iter().map(|e| e.digest).collect(),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
                Err(e) => {
                    // Said once per version of the file: a keys file the daemon cannot read (one
                    // written by root, say) accepts no key, and every client would get 401 with
                    // nothing in the log to say why.
                    tracing::error!(path = %self.path.display(), error = %e,
                        "the API keys file cannot be read: none of its keys is accepted");
                    Vec::new()
                }
            };
            *cache = (stamp, keys);
        }
        cache.1.clone()
    }

    /// Is any key configured at all?
    pub fn any(&self) -> bool {
        !self.configured.is_empty() || !self.file_keys().is_empty()
    }

    /// The principal of `key`, if it is accepted. Every stored hash is compared, in constant time.
    pub fn principal(&self, key: &str) -> Option<String> {
        let digest = key_digest(key);
        let mut found = false;
        for stored in self.configured.iter().chain(self.file_keys().iter()) {
            found |= constant_time_eq(stored.as_bytes(), digest.as_bytes());
        }
        found.then(|| format!("key:{}", &digest[..12]))
    }
}

/// Is any API key configured for a gateway on `home` (config or keys file)?
pub fn any_api_key(home: &Path, configured: &[String]) -> bool {
    !configured.is_empty() || list_keys(home).map(|k| !k.is_empty()).unwrap_or(false)
}

pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

// ---------- tokens (a ticket exchanged for a short session) ----------

/// Bearer tokens minted for a redeemed ticket; kept in memory only (a restart ends them), by
/// their SHA-256.
pub struct Tokens(Expiring);

impl Tokens {
    pub fn new(ttl: f64, clock: SharedClock) -> Tokens {
        Tokens(Expiring::new(ttl, clock, key_digest))
    }

    pub fn mint(&self, principal: &str) -> (String, f64) {
        self.0.mint("gt_", principal)
    }

    pub fn principal(&self, token: &str) -> Option<String> {
        self.0.principal(token)
    }
}

/// Keys and tokens, as the HTTP routes see them.
pub struct HttpAuth {
    pub keys: ApiKeys,
    pub tokens: Tokens,
    /// Does `/metrics` need credentials?
    pub metrics_require_key: bool,
}

impl HttpAuth {
    pub fn new(home: &Path, config: &crate::config::Config, clock: SharedClock) -> HttpAuth {
        let loopback = config.gateway.is_loopback();
        HttpAuth {
            keys: ApiKeys::new(home, &config.gateway.api_keys),
            tokens: Tokens::new(config.http.token_ttl_seconds, clock),
            metrics_require_key: config.http.metrics_require_key.unwrap_or(!loopback),
        }
    }
}

impl HttpAuth {
    /// The principal of a bearer value: an accepted API key, else a live token.
    fn principal_of(&self, value: &str) -> Option<String> {
        self.keys
            .principal(value)
            .or_else(|| self.tokens.principal(value))
    }
}

/// The value of `Authorization: Bearer …`, if the request has a non-empty one.
fn bearer_value(req: &HttpRequest) -> Option<&str> {
    let header = req
        .headers()
        .get("authorization")?
        .to_str()
        .ok()?
        .trim_start();
    // The scheme is a case-insensitive token (RFC 9110 §11.1), then blanks: `BEARER x` and
    // `Bearer<TAB>x` were refused.
    let (scheme, value) = header.split_once([' ', '\t'])?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return None;
    }
    let value = value.trim();
    (!value.is_empty()).then_some(value)
}

/// The principal behind `Authorization: Bearer …` (an API key or a token), if any.
pub fn bearer(auth: &HttpAuth, req: &HttpRequest) -> Option<String> {
    auth.principal_of(bearer_value(req)?)
}

/// What a long-lived connection (a WebSocket, an event stream) authenticated with, to check
/// again while it stays open: a key revoked or a token expired ends it. A ticket is spent once
/// and has nothing left to revoke.
#[derive(Clone)]
pub struct Credential {
    auth: Arc<HttpAuth>,
    bearer: Option<String>,
}

impl Credential {
    /// The request's bearer key or token, if it authenticated with one.
    pub fn of(auth: &Arc<HttpAuth>, req: &HttpRequest) -> Credential {
        Credential {
            auth: auth.clone(),
            bearer: bearer_value(req).map(str::to_string),
        }
    }

    /// A credential that is never checked again (a redeemed ticket).
    pub fn ticket(auth: &Arc<HttpAuth>) -> Credential {
        Credential {
            auth: auth.clone(),
            bearer: None,
        }
    }

    /// Is it still accepted? (Keys are re-read from the keys file when it changes.)
    pub fn still_valid(&self) -> bool {
        match &self.bearer {
            None => true,
            Some(v) => self.auth.principal_of(v).is_some(),
        }
    }
}

/// Authenticate an HTTP request: a bearer key or token, else a single-use ticket header.
pub fn authenticate(state: &AppState, req: &HttpRequest) -> Result<String, ApiError> {
    if req.headers().contains_key("authorization") {
        return bearer(&state.auth, req)
            .ok_or_else(|| ApiError::unauthorized("the API key or token is not valid"));
    }
    if let Some(t) = req.headers().get(TICKET_HEADER) {
        let t = t.to_str().unwrap_or("").trim();
        return state
            .tickets
            .redeem(t)
            .map_err(|why| ApiError::unauthorized(why.to_string()));
    }
    Err(ApiError::unauthorized(
        "send Authorization: Bearer <API key or token>, or X-Gatehouse-Ticket: <ticket>",
    ))
}

/// An authenticated caller: take it as a handler argument and the route needs credentials.
#[derive(Debug, Clone)]
pub struct Principal(pub String);

impl FromRequest for Principal {
    type Error = ApiError;
    type Future = std::future::Ready<Result<Principal, ApiError>>;

    fn from_request(req: &HttpRequest, _: &mut actix_web::dev::Payload) -> Self::Future {
        let result = match req.app_data::<web::Data<AppState>>() {
            Some(state) => authenticate(state, req).map(Principal),
            None => Err(ApiError::from(GatewayError::Internal(
                "no application state".into(),
            ))),
        };
        std::future::ready(result)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_created_listed_accepted_and_revoked() {
        let dir = crate::store::testing::tempfile_dir::TempDir::new();
        let home = dir.path();
        assert!(!any_api_key(home, &[]));
        let (key, entry) = create_key(home, "ci bot").expect("create");
        assert_eq!(entry.name, "ci-bot");
        assert!(key.starts_with("gk_") && key.len() == 67);
        assert!(create_key(home, "ci-bot").is_err(), "names are unique");
        let (other, _) = create_key(home, "laptop").expect("create");
        let mode = std::fs::metadata(keys_file(home))
            .expect("file")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        assert!(!std::fs::read_to_string(keys_file(home))
            .expect("read")
            .contains(&key));
        let keys = ApiKeys::new(home, &["sha256:".to_string() + &"ab".repeat(32)]);
        assert_eq!(
            keys.principal(&key),
            Some(format!("key:{}", &entry.digest[..12]))
        );
        assert!(keys.principal("gk_wrong").is_none());
        assert!(keys.principal("").is_none());
        assert_eq!(revoke_key(home, "ci-bot").expect("revoke"), 1);
        assert!(
            keys.principal(&key).is_none(),
            "a revoked key is refused at once"
        );
        assert!(keys.principal(&other).is_some());
        assert_eq!(revoke_key(home, "nobody").expect("revoke"), 0);
        assert_eq!(list_keys(home).expect("list").len(), 1);
        assert!(any_api_key(home, &[]));
        // Named as it was created: `"ci bot"` is `ci-bot`; an empty name names none.
        let (spaced, _) = create_key(home, "ci bot").expect("create again");
        assert_eq!(revoke_key(home, "ci bot").expect("revoke"), 1);
        assert!(keys.principal(&spaced).is_none());
        assert!(create_key(home, "  ").is_err(), "a key needs a name");
        assert_eq!(revoke_key(home, "").expect("revoke"), 0);
    }

    /// A keys file written without a final newline (by `printf`, a provisioning tool) keeps its
    /// last key, and a key created after it works: its line was glued to the last one, where
    /// it was never read as a key.
    #[test]
    fn a_key_created_after_a_last_line_with_no_newline_is_accepted() {
        let dir = crate::store::testing::tempfile_dir::TempDir::new();
        let home = dir.path();
        let provisioned = "gk_provisioned";
        std::fs::write(
            keys_file(home),
            format!("sha256:{} provisioned 1700000000", key_digest(provisioned)),
        )
        .expect("write");
        let (key, _) = create_key(home, "new").expect("create");
        let listed: Vec<(String, i64)> = list_keys(home)
            .expect("list")
            .into_iter()
            .map(|k| (k.name, k.created_at))
            .collect();
        assert_eq!(listed.len(), 2, "{listed:?}");
        assert_eq!(listed[0], ("provisioned".to_string(), 1_700_000_000));
        assert_eq!(listed[1].0, "new");
        let accepted = ApiKeys::new(home, &[]);
        assert!(accepted.principal(provisioned).is_some());
        assert!(accepted.principal(&key).is_some());
        // A line of a digest alone is kept too (glued, neither key was one).
        let dir = crate::store::testing::tempfile_dir::TempDir::new();
        let home = dir.path();
        std::fs::write(
            keys_file(home),
            format!("sha256:{}", key_digest(provisioned)),
        )
        .expect("write");
        let (key, _) = create_key(home, "new").expect("create");
        let accepted = ApiKeys::new(home, &[]);
        assert!(accepted.principal(provisioned).is_some());
        assert!(accepted.principal(&key).is_some());
    }

    /// Revokes and creates run at once (two operators, a script) each keep what the others did:
    /// every revoked key stays revoked, every created one is kept.
    #[test]
    fn changes_of_the_keys_file_at_once_keep_each_other() {
        let dir = crate::store::testing::tempfile_dir::TempDir::new();
        let home = dir.path();
        for round in 0..20 {
            let names: Vec<String> = (0..6).map(|i| format!("r{round}-k{i}")).collect();
            let keys: Vec<String> = names
                .iter()
                .map(|n| create_key(home, n).expect("create").0)
                .collect();
            std::thread::scope(|s| {
                for name in &names {
                    s.spawn(move || revoke_key(home, name).expect("revoke"));
                }
                s.spawn(move || create_key(home, &format!("r{round}-new")).expect("create"));
            });
            let accepted = ApiKeys::new(home, &[]);
            for key in &keys {
                assert!(accepted.principal(key).is_none(), "round {round}");
            }
            let listed: Vec<String> = list_keys(home)
                .expect("list")
                .into_iter()
                .map(|k| k.name)
                .collect();
            assert!(
                listed.contains(&format!("r{round}-new")),
                "round {round}: {listed:?}"
            );
            assert_eq!(listed.len(), round + 1, "round {round}: {listed:?}");
        }
    }

    /// The keys file is read again when it is replaced by one of the same length and times.
    #[test]
    fn a_keys_file_replaced_with_the_same_length_and_times_is_read_again() {
        let dir = crate::store::testing::tempfile_dir::TempDir::new();
        let home = dir.path();
        let (key, _) = create_key(home, "old").expect("create");
        let accepted = ApiKeys::new(home, &[]);
        assert!(accepted.principal(&key).is_some());
        let path = keys_file(home);
        let before = std::fs::metadata(&path).expect("metadata");
        // The same length: the digest's first hex digit changed.
        let mut changed = std::fs::read(&path).expect("read");
        assert!(changed.starts_with(b"sha256:"));
        changed[7] = if changed[7] == b'0' { b'1' } else { b'0' };
        let tmp = home.join("replacement");
        std::fs::write(&tmp, &changed).expect("write");
        let file = std::fs::File::options()
            .write(true)
            .open(&tmp)
            .expect("open");
        file.set_times(
            std::fs::FileTimes::new()
                .set_modified(before.modified().expect("mtime"))
                .set_accessed(before.accessed().expect("atime")),
        )
        .expect("times");
        drop(file);
        std::fs::rename(&tmp, &path).expect("rename");
        let after = std::fs::metadata(&path).expect("metadata");
        assert_eq!(after.len(), before.len());
        assert_eq!(after.modified().ok(), before.modified().ok());
        assert!(accepted.principal(&key).is_none(), "the old key is refused");
    }

    #[test]
    fn refusals_have_fitting_statuses() {
        let cases = [
            (GatewayError::InvalidParams("x".into()), 400),
            (GatewayError::NotFound("x".into()), 404),
            (GatewayError::PermissionDenied("x".into()), 403),
            (GatewayError::AdmissionConflict("x".into()), 409),
            (GatewayError::StaleGeneration("x".into()), 409),
            (GatewayError::PayloadTooLarge("x".into()), 413),
            (GatewayError::SessionBusy("x".into()), 429),
            (GatewayError::RuntimeDraining, 503),
        ];
        for (err, status) in cases {
            let reason = err.reason();
            let e = ApiError::from(err);
            assert_eq!(e.status.as_u16(), status, "{reason}");
            assert_eq!(e.body()["error"]["reason"], reason);
        }
        let e = ApiError::from(GatewayError::Internal("disk on fire".into()));
        assert!(!e.body().to_string().contains("disk on fire"));
    }
}
