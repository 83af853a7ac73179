//! kvlens-engine: everything the browser playground, the native server and the planner share.
//!
//! The crate has no networking, spawns no threads and touches no files: callers hand it bytes.
//! It compiles for native targets and for `wasm32-unknown-unknown`.

pub mod arch;
pub mod backend;
pub mod builder;
pub mod cache;
pub mod engine;
pub mod fault;
#[cfg(any(test, feature = "testing"))]
#[doc(hidden)]
pub mod fuzzing;
#[cfg(any(test, feature = "testing"))]
pub mod golden;
pub mod input;
pub mod lessons;
pub mod memory;
pub mod model;
pub mod occupancy;
pub mod output;
mod parallel;
pub mod profile;
pub mod runner;
pub mod sample;
pub mod sched;
pub mod timeline;
