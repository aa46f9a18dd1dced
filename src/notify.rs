//! systemd notifications (`Type=notify`): READY=1, STOPPING=1, WATCHDOG=1, written to
//! `$NOTIFY_SOCKET` when it is set; silent otherwise.

use std::os::unix::net::UnixDatagram;

fn send(state: &str) {
    let Ok(path) = std::env::var("NOTIFY_SOCKET") else {
        return;
    };
    let Ok(sock) = UnixDatagram::unbound() else {
        return;
    };
    let result = if let Some(abstract_name) = path.strip_prefix('@') {
        use std::os::linux::net::SocketAddrExt;
        std::os::unix::net::SocketAddr::from_abstract_name(abstract_name.as_bytes())
            .and_then(|addr| sock.send_to_addr(state.as_bytes(), &addr))
    } else {
        sock.send_to(state.as_bytes(), &path)
    };
    if let Err(e) = result {
        tracing::debug!(error = %e, "sd_notify failed");
    }
}

pub fn ready() {
    send("READY=1");
}

pub fn stopping() {
    send("STOPPING=1");
}

pub fn watchdog() {
    send("WATCHDOG=1");
}

/// The watchdog interval systemd asked for (half of `WATCHDOG_USEC`), if any.
pub fn watchdog_interval() -> Option<std::time::Duration> {
    let usec: u64 = std::env::var("WATCHDOG_USEC").ok()?.parse().ok()?;
    Some(std::time::Duration::from_micros(usec / 2))
}
