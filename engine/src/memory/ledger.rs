//! The memory ledger: bytes a backend holds, by category, with peaks. Every device allocation a
//! backend makes is registered here, so what the planner predicted and what the backend allocated
//! can be compared.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// What an allocation is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Category {
    /// Model weights.
    Weights,
    /// The paged KV cache.
    KvCache,
    /// Hybrid models' per-request recurrent states (Qwen3.5's Gated DeltaNet conv windows and
    /// delta-rule states), one slot per request that can run at once.
    StateCache,
    /// Vision-encoder outputs kept for reuse.
    EncoderCache,
    /// Transient tensors of a forward pass.
    Activations,
    /// Host-device staging buffers, and host memory of images being decoded and preprocessed.
    Staging,
    /// Host memory of requests on their way to the engine: bodies being read, fetched images,
    /// tokenization (`kvlens serve` counts it within the preprocessing budget).
    Requests,
}

impl Category {
    /// Every category, in display order.
    pub const ALL: [Category; 7] = [
        Category::Weights,
        Category::KvCache,
        Category::StateCache,
        Category::EncoderCache,
        Category::Activations,
        Category::Staging,
        Category::Requests,
    ];

    fn index(self) -> usize {
        self as usize
    }
}

#[derive(Debug, Default)]
struct Counters {
    current: [AtomicU64; Category::ALL.len()],
    peak: [AtomicU64; Category::ALL.len()],
}

/// Shared byte counters per category. Cloning shares the counters.
#[derive(Debug, Clone, Default)]
pub struct MemoryLedger {
    counters: Arc<Counters>,
}

/// One category's figures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LedgerEntry {
    /// Category.
    pub category: Category,
    /// Bytes held now.
    pub bytes: u64,
    /// Most bytes held at once since the last peak reset.
    pub peak_bytes: u64,
}

impl MemoryLedger {
    /// A ledger with every counter at zero.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records an allocation.
    pub fn alloc(&self, category: Category, bytes: u64) {
        let i = category.index();
        let now = self.counters.current[i].fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.counters.peak[i].fetch_max(now, Ordering::Relaxed);
    }

    /// Records a release (saturating at zero).
    pub fn free(&self, category: Category, bytes: u64) {
        let i = category.index();
        let _ = self.counters.current[i]
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| Some(v.saturating_sub(bytes)));
    }

    /// Bytes held now in one category.
    pub fn bytes(&self, category: Category) -> u64 {
        self.counters.current[category.index()].load(Ordering::Relaxed)
    }

    /// Peak bytes in one category since the last reset.
    pub fn peak(&self, category: Category) -> u64 {
        self.counters.peak[category.index()].load(Ordering::Relaxed)
    }

    /// What a forward pass adds beside the weights and the KV cache (activations, staging,
    /// encoder outputs): held now, or the sum of their peaks since the last reset.
    pub fn transient(&self, peak: bool) -> u64 {
        [Category::Activations, Category::Staging, Category::EncoderCache]
            .iter()
            .map(|&c| if peak { self.peak(c) } else { self.bytes(c) })
            .sum()
    }

    /// Sets every peak to the current value (vLLM's `reset_peak_memory_stats`).
    pub fn reset_peaks(&self) {
        for i in 0..Category::ALL.len() {
            self.counters.peak[i].store(self.counters.current[i].load(Ordering::Relaxed), Ordering::Relaxed);
        }
    }

    /// Every category's figures.
    pub fn entries(&self) -> Vec<LedgerEntry> {
        Category::ALL
            .iter()
            .map(|&category| LedgerEntry {
                category,
                bytes: self.bytes(category),
                peak_bytes: self.peak(category),
            })
            .collect()
    }

    /// Bytes held now over all categories.
    pub fn total(&self) -> u64 {
        Category::ALL.iter().map(|&c| self.bytes(c)).sum()
    }

    /// A guard that records `bytes` now and releases them when dropped.
    pub fn hold(&self, category: Category, bytes: u64) -> Held {
        self.alloc(category, bytes);
        Held {
            ledger: self.clone(),
            category,
            bytes,
        }
    }
}

/// Bytes recorded in a ledger for as long as this value lives.
#[derive(Debug)]
pub struct Held {
    ledger: MemoryLedger,
    category: Category,
    bytes: u64,
}

impl Drop for Held {
    fn drop(&mut self) {
        self.ledger.free(self.category, self.bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_release_on_drop_and_peaks_remain() {
        let ledger = MemoryLedger::new();
        let weights = ledger.hold(Category::Weights, 100);
        {
            let _a = ledger.hold(Category::Activations, 40);
            let _b = ledger.hold(Category::Activations, 60);
            assert_eq!(ledger.bytes(Category::Activations), 100);
        }
        assert_eq!(ledger.bytes(Category::Activations), 0);
        assert_eq!(ledger.peak(Category::Activations), 100);
        ledger.reset_peaks();
        assert_eq!(ledger.peak(Category::Activations), 0);
        assert_eq!(ledger.total(), 100);
        drop(weights);
        assert_eq!(ledger.total(), 0);
        ledger.free(Category::Staging, 5);
        assert_eq!(ledger.bytes(Category::Staging), 0);
    }
}
