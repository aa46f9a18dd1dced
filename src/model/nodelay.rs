//! A TCP connector for awc that sets `TCP_NODELAY`: a request head and body written separately
//! must not wait on Nagle's algorithm for the peer's delayed ACK (tens of milliseconds per call).

use std::future::Future;
use std::pin::Pin;

use actix_rt::net::TcpStream;
use actix_service::Service;
use actix_tls::connect::{ConnectError, ConnectInfo, Connection};
use awc::http::Uri;

#[derive(Clone)]
pub struct NoDelay<S>(pub S);

impl<S> Service<ConnectInfo<Uri>> for NoDelay<S>
where
    S: Service<ConnectInfo<Uri>, Response = Connection<Uri, TcpStream>, Error = ConnectError>,
    S::Future: 'static,
{
    type Response = Connection<Uri, TcpStream>;
    type Error = ConnectError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>>>>;

    fn poll_ready(
        &self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&self, req: ConnectInfo<Uri>) -> Self::Future {
        let fut = self.0.call(req);
        Box::pin(async move {
            let conn = fut.await?;
            if let Err(e) = conn.io_ref().set_nodelay(true) {
                tracing::debug!(error = %e, "cannot set TCP_NODELAY");
            }
            Ok(conn)
        })
    }
}

/// Install the process-wide TLS crypto provider (ring) once; HTTPS model endpoints need it.
pub fn install_tls_provider() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // An error means another provider is installed already, which serves as well.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

/// The most connections to model endpoints open at once, all endpoints together (each also
/// has its own bound, `model.max_concurrent_requests`). awc's default, 100 a scheme, was
/// shared by every endpoint: a hung endpoint holding 100 calls made every other one wait,
/// uncounted, until its calls timed out.
pub const MAX_MODEL_CONNECTIONS: usize = 8192;

/// An awc connector (TLS with the webpki roots for `https://` endpoints) whose TCP connections
/// have `TCP_NODELAY` set, and whose connection (name resolution and TCP) and TLS handshake each
/// take at most `connect_timeout`; at most [`MAX_MODEL_CONNECTIONS`] are open at once.
pub fn connector(
    connect_timeout: std::time::Duration,
) -> awc::Connector<
    impl Service<ConnectInfo<Uri>, Response = Connection<Uri, TcpStream>, Error = ConnectError> + Clone,
> {
    install_tls_provider();
    let base = awc::Connector::new();
    let tcp = actix_tls::connect::ConnectorService::default();
    base.connector(NoDelay(tcp))
        .timeout(connect_timeout)
        .handshake_timeout(connect_timeout)
        .limit(MAX_MODEL_CONNECTIONS)
}
