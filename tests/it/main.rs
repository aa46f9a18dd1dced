//! One integration-test binary: the real daemon over real sockets against a loopback fake model.

mod authority;
mod bench;
mod chaos;
mod compression;
mod faults;
mod fuzz;
mod helpers;
mod hostile;
mod ops;
mod rest;
mod rooms;
mod tools;
mod torture;
