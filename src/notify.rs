//! systemd notifications (`Type=notify`): READY=1, STOPPING=1, WATCHDOG=1, written to
//! `$NOTIFY_SOCKET` when it is set; silent otherwise.

use std::os::unix::net::UnixDatagram;

fn send(state: &str) {
    let Ok(path) = std::env::var("NOTIFY_SOCKET") else {
        return;
    };
    send_to(&path, state);
}

fn send_to(path: &str, state: &str) {
    let Ok(sock) = UnixDatagram::unbound() else {
        return;
    };
    let result = if let Some(abstract_name) = path.strip_prefix('@') {
        use std::os::linux::net::SocketAddrExt;
        std::os::unix::net::SocketAddr::from_abstract_name(abstract_name.as_bytes())
            .and_then(|addr| sock.send_to_addr(state.as_bytes(), &addr))
    } else {
        sock.send_to(state.as_bytes(), path)
    };
    if let Err(e) = result {
        tracing::debug!(error = %e, "sd_notify failed");
    }
}

/// Ready, with a status line for `systemctl status` (where the API listens: a port of 0 in the
/// config is a new port on every start).
pub fn ready(status: &str) {
    let status: String = status.chars().filter(|c| *c != '\n').collect();
    send(&format!("READY=1\nSTATUS={status}"));
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

/// How much more time each start-up extension asks systemd for.
const EXTENSION: std::time::Duration = std::time::Duration::from_secs(60);
/// How often an extension is sent while the start-up work runs.
const EXTEND_EVERY: std::time::Duration = std::time::Duration::from_secs(20);

/// While the guard lives, ask systemd every 20 s for 60 s more to start
/// (`EXTEND_TIMEOUT_USEC`): for start-up work that grows with the store, such as a migration that
/// copies a table, which would otherwise hit `TimeoutStartSec` on a large store and be killed
/// (and then restarted into the same migration). Without `$NOTIFY_SOCKET` it does nothing.
pub fn extend_start_while_alive() -> StartExtension {
    StartExtension::to(std::env::var("NOTIFY_SOCKET").ok(), EXTEND_EVERY)
}

/// See [`extend_start_while_alive`]; dropping it stops the extensions.
pub struct StartExtension {
    stop: Option<std::sync::mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl StartExtension {
    fn to(path: Option<String>, every: std::time::Duration) -> StartExtension {
        let Some(path) = path else {
            return StartExtension {
                stop: None,
                thread: None,
            };
        };
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        let state = format!("EXTEND_TIMEOUT_USEC={}", EXTENSION.as_micros());
        let thread = std::thread::Builder::new()
            .name("start-extension".into())
            .spawn(move || loop {
                send_to(&path, &state);
                match stopped.recv_timeout(every) {
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout) => continue,
                    _ => return,
                }
            })
            .map_err(|e| tracing::debug!(error = %e, "no start-up extension thread"))
            .ok();
        StartExtension {
            stop: Some(stop),
            thread,
        }
    }
}

impl Drop for StartExtension {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Extensions arrive at the notify socket until the guard is dropped, and none after.
    #[test]
    fn start_extensions_stop_with_their_guard() {
        let dir = crate::store::testing::tempfile_dir::TempDir::new();
        let path = dir.path().join("notify");
        let sock = UnixDatagram::bind(&path).expect("bind");
        sock.set_read_timeout(Some(std::time::Duration::from_secs(10)))
            .expect("timeout");
        let guard = StartExtension::to(
            Some(path.to_string_lossy().to_string()),
            std::time::Duration::from_millis(5),
        );
        let mut buf = [0u8; 64];
        for _ in 0..3 {
            let n = sock.recv(&mut buf).expect("an extension");
            assert_eq!(&buf[..n], b"EXTEND_TIMEOUT_USEC=60000000");
        }
        drop(guard);
        // Drain what was sent before the drop; then nothing comes.
        sock.set_nonblocking(true).expect("nonblocking");
        while sock.recv(&mut buf).is_ok() {}
        sock.set_nonblocking(false).expect("blocking");
        sock.set_read_timeout(Some(std::time::Duration::from_millis(50)))
            .expect("timeout");
        assert!(sock.recv(&mut buf).is_err(), "an extension after the drop");
    }
}
