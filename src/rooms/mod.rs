//! Hosted rooms: the runtime that drives room tasks into member sessions.
//!
//! Wiring: build a [`RoomRuntime`] with [`RoomRuntime::builder`] from a [`db::RoomsDb`], a
//! [`runtime::BindingSource`] (the rooms whose authority is this gateway), a local
//! [`port::SessionPort`] (and/or a [`runtime::TransportResolver`] for peers), the shared
//! [`port::TurnLocks`], [`runtime::RoomHooks`] and the injected clock; then `start()` it and
//! `stop(timeout)` it on shutdown.

pub mod actors;
pub mod bound;
pub mod config;
pub mod db;
pub mod local;
pub mod port;
pub mod runtime;
pub mod supervisor;

pub use config::RoomsConfig;
pub use port::{PeerClient, PeerTransport, SessionPort, TurnLocks};
pub use runtime::{RoomBinding, RoomHooks, RoomRuntime, RoomsError, RoomsStatus};

#[cfg(test)]
pub(crate) mod testing;
#[cfg(test)]
mod tests;
