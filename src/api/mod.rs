//! The outside of the daemon: JSON-RPC methods, the WebSocket, HTTP routes and the control socket.

pub mod auth;
pub mod control;
pub mod http;
pub mod inbound;
pub mod openai;
pub mod openapi;
pub mod rest;
pub mod rooms;
pub mod rpc;
pub mod tickets;
pub mod ws;
