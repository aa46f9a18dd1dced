//! Single-use, short-lived WebSocket tickets, minted only on the control socket.

use std::collections::HashMap;
use std::sync::Mutex;

use crate::clock::SharedClock;

/// Random secrets, each naming a principal until it expires; kept in memory only (a restart ends
/// them). Each is stored under `key(secret)`, so a store may keep digests instead of secrets.
pub struct Expiring {
    ttl: f64,
    clock: SharedClock,
    key: fn(&str) -> String,
    /// `key(secret)` → `(expiry on the monotonic clock, principal)`: a step of the wall clock
    /// neither lengthens nor shortens a secret's life.
    map: Mutex<HashMap<String, (f64, String)>>,
}

/// Why a ticket was refused.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum TicketRefusal {
    /// Never issued, or already used (a ticket is good once).
    #[error("ticket refused: unknown or already used (get a new one)")]
    Unknown,
    #[error("ticket refused: expired (get a new one)")]
    Expired,
}

impl Expiring {
    pub fn new(ttl: f64, clock: SharedClock, key: fn(&str) -> String) -> Self {
        Self {
            ttl,
            clock,
            key,
            map: Mutex::new(HashMap::new()),
        }
    }

    /// A fresh secret (`prefix` and 64 hex digits) for `principal`: `(secret, expires_at)`.
    /// Expired secrets are dropped on the way.
    pub fn mint(&self, prefix: &str, principal: &str) -> (String, f64) {
        let secret = format!(
            "{prefix}{}{}",
            uuid::Uuid::new_v4().simple(),
            uuid::Uuid::new_v4().simple()
        );
        let now = self.clock.monotonic();
        if let Ok(mut m) = self.map.lock() {
            m.retain(|_, (exp, _)| *exp > now);
            m.insert((self.key)(&secret), (now + self.ttl, principal.to_string()));
        }
        (secret, self.clock.now() + self.ttl)
    }

    /// The principal of an unexpired secret, which stays valid.
    pub fn principal(&self, secret: &str) -> Option<String> {
        let m = self.map.lock().ok()?;
        let (expires, principal) = m.get(&(self.key)(secret))?;
        (*expires > self.clock.monotonic()).then(|| principal.clone())
    }

    /// Take a secret out (it is spent whether or not it had expired): its principal.
    pub fn take(&self, secret: &str) -> Result<String, TicketRefusal> {
        let mut m = self.map.lock().map_err(|_| TicketRefusal::Unknown)?;
        let (expires, principal) = m
            .remove(&(self.key)(secret))
            .ok_or(TicketRefusal::Unknown)?;
        if expires <= self.clock.monotonic() {
            return Err(TicketRefusal::Expired);
        }
        Ok(principal)
    }

    /// Forget every secret.
    pub fn revoke_all(&self) {
        if let Ok(mut m) = self.map.lock() {
            m.clear();
        }
    }
}

/// WebSocket tickets: single use, kept as they are (they live a minute and never leave the
/// control socket's user).
pub struct Tickets(Expiring);

impl Tickets {
    pub fn new(ttl: f64, clock: SharedClock) -> Self {
        Self(Expiring::new(ttl, clock, str::to_string))
    }

    /// Mint a ticket for `principal`: `(ticket, expires_at)`.
    pub fn mint(&self, principal: &str) -> (String, f64) {
        self.0.mint("", principal)
    }

    /// Redeem (and so consume) a ticket, returning its principal.
    pub fn redeem(&self, ticket: &str) -> Result<String, TicketRefusal> {
        self.0.take(ticket)
    }

    /// Revoke every ticket (shutdown).
    pub fn revoke_all(&self) {
        self.0.revoke_all()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use std::sync::Arc;

    #[test]
    fn tickets_are_single_use_and_expire() {
        let clock = ManualClock::new(100.0);
        let t = Tickets::new(60.0, Arc::new(clock.clone()));
        let (a, exp) = t.mint("uid:1");
        assert_eq!(exp, 160.0);
        assert_eq!(t.redeem(&a), Ok("uid:1".to_string()));
        assert_eq!(t.redeem(&a), Err(TicketRefusal::Unknown));
        let (b, _) = t.mint("uid:1");
        clock.advance(61.0);
        assert_eq!(t.redeem(&b), Err(TicketRefusal::Expired));
        assert_eq!(t.redeem("nope"), Err(TicketRefusal::Unknown));
    }

    /// A clock whose wall reading is set apart from its monotonic one.
    struct Stepped {
        wall: std::sync::Mutex<f64>,
        mono: std::sync::Mutex<f64>,
    }

    impl crate::clock::Clock for Stepped {
        fn now(&self) -> f64 {
            self.wall.lock().map_or(0.0, |w| *w)
        }
        fn monotonic(&self) -> f64 {
            self.mono.lock().map_or(0.0, |m| *m)
        }
    }

    /// A step of the wall clock neither ends a ticket early nor keeps it alive past its minute
    /// (expiry was read on the wall clock).
    #[test]
    fn a_wall_clock_step_does_not_move_a_tickets_expiry() {
        let clock = Arc::new(Stepped {
            wall: std::sync::Mutex::new(10_000.0),
            mono: std::sync::Mutex::new(5.0),
        });
        let step = |wall: f64, mono: f64| {
            *clock.wall.lock().unwrap() += wall;
            *clock.mono.lock().unwrap() += mono;
        };
        let t = Tickets::new(60.0, clock.clone());
        let (a, exp) = t.mint("uid:1");
        assert_eq!(exp, 10_060.0, "the expiry shown is on the wall clock");
        let (b, _) = t.mint("uid:1");
        step(7200.0, 1.0);
        assert_eq!(t.redeem(&a), Ok("uid:1".to_string()));
        step(-10_800.0, 60.0);
        assert_eq!(t.redeem(&b), Err(TicketRefusal::Expired));
    }
}
