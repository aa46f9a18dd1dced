//! HTTP routes: health, readiness, metrics, the `/v1` API (REST, SSE, chat completions) and the
//! shared application state. Every route but `/healthz` and `/readyz` needs credentials (see
//! `auth`); `/metrics` needs them unless the listener is on loopback (`http.metrics_require_key`).

use std::sync::Arc;

use actix_web::{web, HttpRequest, HttpResponse, ResponseError};

use super::auth::{self, HttpAuth};
use super::rpc::Authority;
use super::tickets::Tickets;
use crate::session::RuntimePhase;

pub struct AppState {
    pub authority: Authority,
    pub tickets: Arc<Tickets>,
    pub auth: Arc<HttpAuth>,
}

impl AppState {
    /// The principal of a valid `Authorization: Bearer <key or token>` (keys are stored as
    /// SHA-256 hex and compared in constant time).
    pub fn bearer_principal(&self, req: &HttpRequest) -> Option<String> {
        auth::bearer(&self.auth, req)
    }
}

/// Does the request name a loopback host (`localhost`, `127.x.x.x`, `[::1]`, any port)?
fn loopback_host(req: &HttpRequest) -> bool {
    let Some(host) = req
        .headers()
        .get(actix_web::http::header::HOST)
        .and_then(|h| h.to_str().ok())
    else {
        // HTTP/1.0 without a Host: no name was asked for, so none was rebound.
        return true;
    };
    let name = match host.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or(""),
        None => host.rsplit_once(':').map_or(host, |(name, _)| name),
    };
    name.eq_ignore_ascii_case("localhost")
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.to_canonical().is_loopback())
}

pub async fn healthz() -> HttpResponse {
    HttpResponse::Ok().content_type("text/plain").body("ok\n")
}

/// 200 `ready` while the gateway serves and its store acknowledges writes; else 503 and why.
pub async fn readyz(state: web::Data<AppState>) -> HttpResponse {
    let shared = &state.authority.shared;
    let unready = match (shared.runtime.phase(), shared.db.health()) {
        (RuntimePhase::Ready, Ok(())) => None,
        (RuntimePhase::Ready, Err(why)) => Some(format!("storage: {why}")),
        (other, _) => Some(other.as_str().to_string()),
    };
    match unready {
        None => HttpResponse::Ok()
            .content_type("text/plain")
            .body("ready\n"),
        Some(why) => HttpResponse::ServiceUnavailable()
            .content_type("text/plain")
            .body(format!("{why}\n")),
    }
}

/// The routes answered while the daemon opens and recovers its store, before it serves: alive,
/// not ready, and every other request refused `starting` (503, `Retry-After`).
pub fn starting_routes(cfg: &mut web::ServiceConfig) {
    cfg.service(probe("/healthz", healthz))
        .service(probe("/readyz", not_ready_yet))
        .default_service(web::to(|| async {
            auth::ApiError::new(
                actix_web::http::StatusCode::SERVICE_UNAVAILABLE,
                "starting",
                "the gateway is starting (opening and recovering its store); retry shortly",
            )
            .error_response()
        }));
}

/// `/readyz` while the store opens: 503, `starting`.
async fn not_ready_yet() -> HttpResponse {
    HttpResponse::ServiceUnavailable()
        .content_type("text/plain")
        .body(format!("{}\n", RuntimePhase::Starting.as_str()))
}

pub async fn metrics(req: HttpRequest, state: web::Data<AppState>) -> HttpResponse {
    if state.auth.metrics_require_key {
        if let Err(e) = auth::authenticate(&state, &req) {
            return e.error_response();
        }
    } else if !loopback_host(&req) && auth::authenticate(&state, &req).is_err() {
        // Served without a key only to a loopback name: a web page whose own name was rebound
        // to 127.0.0.1 (DNS rebinding) sends its own name as the Host, and read the counters.
        // With a valid key it is served whatever the Host (a scrape through a proxy or tunnel
        // that keeps the outside name).
        return HttpResponse::Forbidden()
            .content_type("text/plain")
            .body("metrics are served without a key only to a loopback host name\n");
    }
    let shared = state.authority.shared.clone();
    // What the store could not be read for is left out, and said so (`gatehouse_metrics_read_ok`
    // 0): the families were empty, and a dashboard read "nothing queued".
    let mut read_ok = true;
    let counts = shared.ledger_counts().await.unwrap_or_else(|e| {
        tracing::warn!(error = %e, "metrics: cannot count the admission ledger");
        read_ok = false;
        Vec::new()
    });
    let mut body = shared.metrics.render(&counts);
    push_metric(
        &mut body,
        "gatehouse_wal_restarts_total",
        "Times the database writer restarted the WAL from its beginning.",
        "counter",
        shared.db.wal_restarts(),
    );
    push_metric(
        &mut body,
        "gatehouse_db_commits_total",
        "Transactions the database writer committed (each holds one or more writes).",
        "counter",
        shared.db.commits(),
    );
    push_metric(
        &mut body,
        "gatehouse_checkpoint_syncs_total",
        "Times the background checkpointer synced the database file after copying WAL frames.",
        "counter",
        shared.db.checkpoint_syncs(),
    );
    push_metric(
        &mut body,
        "gatehouse_idle_releases_total",
        "Times the store gave SQLite's cached pages back after 2 s without writes.",
        "counter",
        shared.db.idle_releases(),
    );
    push_metric(
        &mut body,
        "gatehouse_db_commit_failures_total",
        "Group commits that failed (a full disk, an I/O error, a database file gone).",
        "counter",
        shared.db.failed_commits(),
    );
    push_metric(
        &mut body,
        "gatehouse_storage_healthy",
        "1 while the store acknowledges writes; 0 when its file is gone, another process took \
         the authority, or a commit has waited on the disk for over 5 s (see /readyz).",
        "gauge",
        u64::from(shared.db.health().is_ok()),
    );
    if let Some(rooms) = state.authority.rooms.get() {
        let tasks = rooms
            .db
            .run(crate::store::room_tasks::count_all_tasks_by_status)
            .await
            .unwrap_or_else(|e| {
                tracing::warn!(error = %e, "metrics: cannot count the room tasks");
                read_ok = false;
                Default::default()
            });
        body.push_str("# HELP gatehouse_room_tasks Room tasks by status.\n# TYPE gatehouse_room_tasks gauge\n");
        for (status, n) in tasks {
            body.push_str(&format!(
                "gatehouse_room_tasks{{status=\"{status}\"}} {n}\n"
            ));
        }
        let st = rooms.runtime.status();
        for (name, help, kind, v) in [
            (
                "gatehouse_room_lease_renewals_total",
                "Room lease renewals.",
                "counter",
                st.lease_renewals,
            ),
            (
                "gatehouse_room_lease_losses_total",
                "Room leases lost.",
                "counter",
                st.lease_losses,
            ),
            (
                "gatehouse_rooms_leased",
                "Rooms this process holds a lease on.",
                "gauge",
                st.leased_rooms.len() as u64,
            ),
            (
                "gatehouse_rooms_blocked",
                "Rooms blocked on indeterminate work.",
                "gauge",
                st.blocked_rooms.len() as u64,
            ),
            (
                "gatehouse_rooms_waiting",
                "Rooms with work waiting for a scheduler slot (rooms.max_concurrent_rooms).",
                "gauge",
                st.waiting_rooms as u64,
            ),
            (
                "gatehouse_room_cycles_total",
                "Room scheduler cycles.",
                "counter",
                st.cycles,
            ),
        ] {
            push_metric(&mut body, name, help, kind, v);
        }
    }
    push_metric(
        &mut body,
        "gatehouse_metrics_read_ok",
        "1 when this scrape read every count from the store; 0 when the admission or room task \
         counts could not be read (they are left out).",
        "gauge",
        u64::from(read_ok),
    );
    HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4")
        .body(body)
}

/// One unlabelled metric in the Prometheus text format.
fn push_metric(body: &mut String, name: &str, help: &str, kind: &str, value: u64) {
    body.push_str(&format!(
        "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}\n"
    ));
}

pub fn routes(cfg: &mut web::ServiceConfig) {
    cfg.service(probe("/healthz", healthz))
        .service(probe("/readyz", readyz))
        .service(probe("/metrics", metrics))
        .service(
            web::resource("/api/ws")
                .route(web::get().to(super::ws::ws_route))
                .default_service(web::to(|| async {
                    method_not_allowed("GET", "the WebSocket is opened with GET")
                })),
        )
        .configure(super::rest::routes)
        .default_service(web::to(no_such_route));
}

/// A probe route (`/healthz`, `/readyz`, `/metrics`): GET, and HEAD for checkers that ask only
/// for the status (answered the same, without the body); any other method is 405 with `Allow`.
fn probe<F, Args>(path: &str, handler: F) -> actix_web::Resource
where
    F: actix_web::Handler<Args> + Clone,
    Args: actix_web::FromRequest + 'static,
    F::Output: actix_web::Responder + 'static,
{
    web::resource(path)
        .route(web::get().to(handler.clone()))
        .route(web::head().to(handler))
        .default_service(web::to(|| async {
            method_not_allowed("GET, HEAD", "this route answers GET and HEAD only")
        }))
}

/// 405 with the methods the route answers, in the API's JSON error body.
fn method_not_allowed(allow: &'static str, message: &'static str) -> HttpResponse {
    let refusal = super::auth::ApiError::new(
        actix_web::http::StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        message,
    );
    HttpResponse::MethodNotAllowed()
        .insert_header(("allow", allow))
        .json(refusal.body())
}

/// Outside `/v1` nothing needs authentication to be told it does not exist: 404 with the same
/// JSON error body as the API's.
async fn no_such_route() -> HttpResponse {
    let refusal = super::auth::ApiError::new(
        actix_web::http::StatusCode::NOT_FOUND,
        "not_found",
        "no such route (the API is under /v1, the WebSocket at /api/ws)",
    );
    HttpResponse::NotFound().json(refusal.body())
}
