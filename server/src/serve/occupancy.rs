//! What `/v1/memory`, `/v1/memory/stream` and `/metrics` report of the engine at one moment: the
//! snapshot the engine thread takes and publishes.

use kvlens_engine::cache::{PrefixCacheStats, ProcessorCacheSnapshot};
use kvlens_engine::engine::EngineSnapshot;

/// The engine's occupancy at one moment, as `/v1/memory` and `/v1/memory/stream` send it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Occupancy {
    /// Counts published snapshots (fresh ones for `/v1/memory` repeat the last number).
    pub seq: u64,
    /// Unix time in seconds.
    pub time: f64,
    /// Ledger, KV summary, encoder cache, queue lengths, counters.
    #[serde(flatten)]
    pub engine: EngineSnapshot,
    /// Prefix-cache lookups and hits (tokens) so far.
    pub prefix_cache: PrefixCacheStats,
    /// The preprocessed-image cache (host memory).
    pub processor_cache: ProcessorCacheSnapshot,
    /// The server process as the operating system sees it.
    pub process: ProcessMemory,
}

/// The server process's memory as the operating system counts it.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct ProcessMemory {
    /// Resident set size in bytes (Linux `VmRSS`; absent elsewhere).
    pub resident_bytes: Option<u64>,
}

impl ProcessMemory {
    /// Reads this process's figures now.
    pub fn now() -> Self {
        let resident_bytes = std::fs::read_to_string("/proc/self/status").ok().and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
                .map(|kib| kib << 10)
        });
        ProcessMemory { resident_bytes }
    }
}
