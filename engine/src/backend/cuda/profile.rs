//! `KVLENS_CUDA_PROFILE=1`: every kernel launch timed on the host (the launch call) and on the GPU
//! (timing events recorded before and after it on the stream), summed by kernel, decode steps
//! (steps of at most [`GEMV_MAX_ROWS`](super::launch::GEMV_MAX_ROWS) rows) apart from the rest.
//! What a GPU run needs to tell launch overhead from kernel time; `kvlens generate --json` reports
//! it as `timing.cuda_kernels`. Off, it costs one branch a launch. cuBLAS's own launches are not
//! counted. On, the events and the waits for them slow the host: timings taken with it are
//! for the breakdown, not for the tokens a second.

use std::collections::BTreeMap;
use std::sync::Mutex;

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
    decode_steps: u64,
    pending: Vec<Pending>,
    decode: BTreeMap<&'static str, KernelTimes>,
    other: BTreeMap<&'static str, KernelTimes>,
}

static PROFILE: Mutex<Profile> = Mutex::new(Profile {
    phase: Phase::Other,
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
/// `decode_rows` rows. Settles the launches before it.
pub(super) fn step(rows: usize, decode_rows: usize) {
    let mut p = profile();
    p.settle();
    p.phase = if rows <= decode_rows {
        Phase::Decode
    } else {
        Phase::Other
    };
    p.decode_steps += u64::from(p.phase == Phase::Decode);
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
            let gpu_ms = l.start.elapsed_ms(&l.end).map_or(f64::NAN, f64::from);
            let totals = if l.decode { &mut self.decode } else { &mut self.other };
            add(totals.entry(l.name).or_default(), l.host_s, gpu_ms);
        }
    }
}

fn add(t: &mut KernelTimes, host_s: f64, gpu_ms: f64) {
    t.launches += 1;
    t.host_s += host_s;
    t.gpu_ms += gpu_ms;
}

/// The profile so far (after waiting for every launch made): `{"decode_steps": n, "decode":
/// {kernel: {launches, host_s, gpu_ms}}, "other": {…}}`; empty where it was not requested.
pub fn kernel_profile() -> serde_json::Value {
    let mut p = profile();
    p.settle();
    let table = |m: &BTreeMap<&'static str, KernelTimes>| -> serde_json::Value {
        m.iter()
            .map(|(name, t)| {
                let entry = serde_json::json!({"launches": t.launches, "host_s": t.host_s, "gpu_ms": t.gpu_ms});
                (name.to_string(), entry)
            })
            .collect::<serde_json::Map<_, _>>()
            .into()
    };
    serde_json::json!({"decode_steps": p.decode_steps, "decode": table(&p.decode), "other": table(&p.other)})
}
