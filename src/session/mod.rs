//! Sessions over time: the registry, one supervisor per session, live prompts and events.

pub mod prompts;
pub mod registry;
pub mod shared;
pub mod supervisor;

pub use registry::SessionRegistry;
pub use shared::{RuntimePhase, RuntimeState, Shared};
pub use supervisor::SessionSupervisor;
