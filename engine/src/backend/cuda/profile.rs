//! `KVLENS_CUDA_PROFILE=1`: every kernel launch timed on the host (the launch call) and on the GPU
//! (timing events recorded before and after it on the stream), summed by kernel, decode steps
//! (steps of at most [`GEMV_MAX_ROWS`](super::launch::GEMV_MAX_ROWS) rows) apart from the rest.
//! What a GPU run needs to tell launch overhead from kernel time; `kvlens generate --json` reports
//! it as `timing.cuda_kernels`. Off, it costs one branch a launch. cuBLAS's own launches are not
//! counted.
//!
//! An event recorded on an idle stream fires at once, so a launch's two events would also hold
//! the host's time to make the launch. Each step therefore starts behind a `hold` kernel that
//! spins for twice the previous step's time: the step's launches queue up behind it and run
//! back to back. On, the events, the holds and the waits slow every step: timings taken with
//! it are for the breakdown, not for the tokens a second.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use cudarc::driver::CudaEvent;

/// One kernel's launches and their summed times.
#[derive(Debug, Default, Clone, Copy)]
struct KernelTimes {
    /// Launches counted.
    launches: u64,
    /// Seconds the host spent in the launch calls.
    host_s: f64,
    /// Milliseconds between each launch's two events on the GPU: the kernel's run.
    gpu_ms: f64,
    /// Launches whose events could not be read (not in `gpu_ms`).
    unmeasured: u64,
}

/// A launch whose events the GPU may not have reached yet.
struct Pending {
    name: &'static str,
    decode: bool,
    host_s: f64,
    start: CudaEvent,
    end: CudaEvent,
}

/// Where the launches being recorded belong.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Phase {
    /// Before a step's metadata (the vision tower, start-up) or in a step of more rows.
    Other,
    Decode,
}

struct Profile {
    phase: Phase,
    /// When the last step's metadata was uploaded.
    last_step: Option<Instant>,
    decode_steps: u64,
    pending: Vec<Pending>,
    decode: BTreeMap<&'static str, KernelTimes>,
    other: BTreeMap<&'static str, KernelTimes>,
}

static PROFILE: Mutex<Profile> = Mutex::new(Profile {
    phase: Phase::Other,
    last_step: None,
    decode_steps: 0,
    pending: Vec::new(),
    decode: BTreeMap::new(),
    other: BTreeMap::new(),
});

fn profile() -> std::sync::MutexGuard<'static, Profile> {
    PROFILE.lock().unwrap_or_else(|p| p.into_inner())
}

/// Whether `KVLENS_CUDA_PROFILE=1` asks for the profile.
pub fn requested() -> bool {
    std::env::var("KVLENS_CUDA_PROFILE").is_ok_and(|v| v == "1")
}

/// A step's metadata is uploaded: the launches from here to the next step's metadata (its
/// embedding lookup and vision tower among them) count as decode where the step has at most
/// `decode_rows` rows. Settles the launches before it; returns how long to hold the stream (twice
/// the time since the last step, 1 to 200 ms).
pub(super) fn step(rows: usize, decode_rows: usize) -> Duration {
    let mut p = profile();
    p.settle();
    p.phase = if rows <= decode_rows {
        Phase::Decode
    } else {
        Phase::Other
    };
    p.decode_steps += u64::from(p.phase == Phase::Decode);
    let now = Instant::now();
    let last = p.last_step.replace(now).map_or(Duration::ZERO, |t| now - t);
    (2 * last).clamp(Duration::from_millis(1), Duration::from_millis(200))
}

/// A launch of `name` that took `host_s` seconds to make, between `start` and `end` on its stream.
pub(super) fn launched(name: &'static str, host_s: f64, start: CudaEvent, end: CudaEvent) {
    let mut p = profile();
    let decode = p.phase == Phase::Decode;
    p.pending.push(Pending {
        name,
        decode,
        host_s,
        start,
        end,
    });
}

impl Profile {
    /// Waits for the pending launches' events and adds their times to the totals.
    fn settle(&mut self) {
        for l in std::mem::take(&mut self.pending) {
            let totals = if l.decode { &mut self.decode } else { &mut self.other };
            let t = totals.entry(l.name).or_default();
            t.launches += 1;
            t.host_s += l.host_s;
            match l.start.elapsed_ms(&l.end) {
                Ok(ms) => t.gpu_ms += f64::from(ms),
                Err(_) => t.unmeasured += 1,
            }
        }
    }
}

/// The profile so far (after waiting for every launch made): `{"decode_steps": n, "decode":
/// {kernel: {launches, host_s, gpu_ms}}, "other": {…}}`; empty where it was not requested.
pub fn kernel_profile() -> serde_json::Value {
    let mut p = profile();
    p.settle();
    let table = |m: &BTreeMap<&'static str, KernelTimes>| -> serde_json::Value {
        m.iter()
            .map(|(name, t)| {
                let entry = serde_json::json!({
                    "launches": t.launches,
                    "host_s": t.host_s,
                    "gpu_ms": t.gpu_ms,
                    "unmeasured": t.unmeasured,
                });
                (name.to_string(), entry)
            })
            .collect::<serde_json::Map<_, _>>()
            .into()
    };
    serde_json::json!({"decode_steps": p.decode_steps, "decode": table(&p.decode), "other": table(&p.other)})
}
