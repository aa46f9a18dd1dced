//! Gatehouse: a durable gateway for LLM agent sessions.

pub mod agent;
pub mod api;
pub mod bench;
pub mod chat;
pub mod clock;
pub mod config;
pub mod error;
pub mod gateway;
pub mod model;
pub mod notify;
pub mod rooms;
pub mod session;
pub mod store;
pub mod telemetry;
pub mod tools;

pub use gateway::{Gateway, RunningGateway, StartError};
