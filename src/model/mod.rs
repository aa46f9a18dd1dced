//! The model side: chat-completions wire types, SSE parsing and the `ModelClient` actor.

pub mod client;
pub mod nodelay;
pub mod sse;
pub mod wire;

pub use client::{ChatCall, DeltaSink, ModelClient, ModelError, StreamEvent};
pub use wire::{ChatResponse, ToolCall, Usage};
