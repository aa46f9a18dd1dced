//! One integration-test binary: the real daemon over real sockets against a loopback fake model.

mod authority;
mod compression;
mod helpers;
mod rooms;
mod tools;
mod ops;
