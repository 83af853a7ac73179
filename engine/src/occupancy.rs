//! The engine's occupancy at one moment as a UI shows it: the snapshot `kvlens serve` sends on
//! `/v1/memory` and `/v1/memory/stream`, and the one the playground takes after each step of its
//! in-browser engine (it also reads the server's back, in server mode).

use crate::cache::{PrefixCacheStats, ProcessorCacheSnapshot};
use crate::engine::{Engine, EngineSnapshot};
use crate::input::processor::InputProcessor;
use serde::{Deserialize, Serialize};

/// Ledger, KV summary, encoder cache, processor cache, queues and counters at one moment.
#[derive(Debug, Clone, Serialize, Deserialize)]
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
    /// The process as the operating system sees it.
    pub process: ProcessMemory,
}

impl Occupancy {
    /// The occupancy of `engine` and of the processor cache of `input` now; `process`: what the
    /// caller read of its process (the engine reads no files).
    pub fn of(engine: &Engine, input: &InputProcessor, seq: u64, time: f64, process: ProcessMemory) -> Self {
        let processor_cache = input
            .processor_cache
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .snapshot();
        Occupancy {
            seq,
            time,
            engine: engine.snapshot(),
            prefix_cache: engine.kv().prefix_cache_stats(),
            processor_cache,
            process,
        }
    }
}

/// The process's memory as the operating system counts it.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct ProcessMemory {
    /// Resident set size in bytes (Linux `VmRSS`; absent elsewhere, in the browser too).
    pub resident_bytes: Option<u64>,
    /// In the browser: the engine's wasm linear memory in bytes. It grows to the most the engine
    /// ever held at once and never shrinks, so after a load it still counts the load's buffers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wasm_memory_bytes: Option<u64>,
}
