//! Device profiles, the parameter inventory, the vLLM-compatible start-up planner and its inputs,
//! and readers of what vLLM prints: its start-up log and its `/metrics`.

pub mod device;
pub mod hybrid;
pub mod ledger;
pub mod log_budget;
pub mod plan_inputs;
pub mod planner;
pub mod vllm_log;
pub mod vllm_metrics;
pub mod watch_check;
pub mod weights;

/// Bytes per GiB (vLLM divides by 2^30 wherever it prints GB or GiB).
pub const GIB: f64 = (1u64 << 30) as f64;

pub use device::{device_preset, device_presets, DeviceProfile, Platform};
pub use planner::{plan, MmLimits, Plan, PlanError, PlanRequest, Source};
