//! The agent side of a turn: the transcript as the model sees it, token estimates, compression
//! and the model ↔ tools loop of one attempt.

pub mod compress;
pub mod tokens;
pub mod transcript;
pub mod turn;
