//! Device profiles, the parameter inventory and the vLLM-compatible start-up planner.

pub mod device;
pub mod ledger;
pub mod log_budget;
pub mod planner;
pub mod vllm_log;
pub mod weights;

pub use device::{device_preset, device_presets, DeviceProfile, Platform};
pub use planner::{plan, MmLimits, Plan, PlanError, PlanRequest, Source};
