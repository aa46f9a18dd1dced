//! Single-use, short-lived WebSocket tickets, minted only on the control socket.

use std::collections::HashMap;
use std::sync::Mutex;

use crate::clock::SharedClock;

pub struct Tickets {
    ttl: f64,
    clock: SharedClock,
    map: Mutex<HashMap<String, (f64, String)>>,
}

/// Why a ticket was refused.
#[derive(Debug, PartialEq, Eq)]
pub enum TicketRefusal {
    Unknown,
    Expired,
}

impl Tickets {
    pub fn new(ttl: f64, clock: SharedClock) -> Self {
        Self {
            ttl,
            clock,
            map: Mutex::new(HashMap::new()),
        }
    }

    /// Mint a ticket for `principal`: `(ticket, expires_at)`.
    pub fn mint(&self, principal: &str) -> (String, f64) {
        let ticket = format!(
            "{}{}",
            uuid::Uuid::new_v4().simple(),
            uuid::Uuid::new_v4().simple()
        );
        let now = self.clock.now();
        let expires = now + self.ttl;
        if let Ok(mut m) = self.map.lock() {
            m.retain(|_, (exp, _)| *exp > now);
            m.insert(ticket.clone(), (expires, principal.to_string()));
        }
        (ticket, expires)
    }

    /// Redeem (and so consume) a ticket, returning its principal.
    pub fn redeem(&self, ticket: &str) -> Result<String, TicketRefusal> {
        let mut m = self.map.lock().map_err(|_| TicketRefusal::Unknown)?;
        let (expires, principal) = m.remove(ticket).ok_or(TicketRefusal::Unknown)?;
        if expires <= self.clock.now() {
            return Err(TicketRefusal::Expired);
        }
        Ok(principal)
    }

    /// Revoke every ticket (shutdown).
    pub fn revoke_all(&self) {
        if let Ok(mut m) = self.map.lock() {
            m.clear();
        }
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
}
