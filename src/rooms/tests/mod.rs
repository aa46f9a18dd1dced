//! Unit tests of the room state layer and runtime.

mod fakes;
mod scenarios;
mod scheduler;
mod state;
