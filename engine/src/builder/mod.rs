//! Start-up as vLLM does it, for every caller (`kvlens serve`, `kvlens generate`, the playground):
//! plan the budgets with the measured weights, profile one full dummy batch plus the largest
//! allowed images on the backend, re-plan with the measured activation peak, size the KV cache
//! from what is left and build the engine. vLLM's start-up log lines come back as data; the caller
//! prints them (or draws them).

mod open;

use crate::engine::{Engine, EngineConfig, EngineError};
use crate::memory::ledger::Category;
use crate::memory::planner::{gib, plan, Plan, PlanRequest};
use crate::model::ModelError;
use crate::profile::{ProfileResult, ProfileSpec};
use crate::runner::StepRunner;
pub use open::{open, BackendChoice, ModelSource};

/// Engine settings the planner does not decide.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineOptions {
    /// Reuse KV blocks across requests.
    pub enable_prefix_caching: bool,
    /// Most tokens one request computes per step (0 = no cap, or vLLM's default when
    /// `max_num_partial_prefills` is over 1).
    pub long_prefill_token_threshold: usize,
    /// vLLM's count of prompts prefilled at once: kvlens (like vLLM v1) prefills any number, and a
    /// value over 1 only sets the default threshold to 4% of `max_model_len`, as vLLM does.
    pub max_num_partial_prefills: usize,
    /// Tokens the sampler may return (the tokenizer's vocabulary; 0 = every logits row).
    pub vocab_size: usize,
}

/// How the engine was sized.
#[derive(Debug, Clone)]
pub struct StartupReport {
    /// The budget with the measured weights and activation peak.
    pub plan: Plan,
    /// What the profile run measured.
    pub profile: ProfileResult,
    /// Most tokens one image may have: the largest image the profile ran (None without images).
    pub max_image_tokens: Option<usize>,
    /// vLLM's start-up lines from "Initial free memory" on (the weights line is the loader's).
    pub log_lines: Vec<String>,
}

/// Why start-up failed.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// The settings do not plan (a usage error).
    #[error("{0}")]
    Plan(String),
    /// The profile run failed.
    #[error("profile run: {0}")]
    Profile(#[source] ModelError),
    /// The budget leaves no room (e.g. no KV cache); the lines were logged up to the failure.
    #[error("{error}")]
    Budget {
        /// vLLM's message.
        error: String,
        /// The start-up lines so far.
        log_lines: Vec<String>,
    },
    /// The engine could not be built.
    #[error("engine: {0}")]
    Engine(#[source] EngineError),
}

/// The patch grid of an image with exactly `max_tokens` tokens (the most `smart_resize` can give
/// under `max_pixels`), as close to square as the count allows: vLLM profiles the "image with most
/// features", and no real image can have more tokens than this one.
pub fn largest_image_grid(max_tokens: usize, merge: usize) -> [usize; 3] {
    let t = max_tokens.max(1);
    let a = (1..=t.isqrt()).rev().find(|a| t.is_multiple_of(*a)).unwrap_or(1);
    [1, a * merge, t / a * merge]
}

/// Sizes and builds the engine over a loaded model. `req` holds the device and the user's flags;
/// its weights, dtypes and activation peak are filled in here from the backend. `seconds` is a
/// clock (the engine has none of its own) used to time the profile run, which is awaited until
/// the device has run it (native callers: [`crate::backend::block_on`]).
pub async fn build_engine(
    mut runner: Box<dyn StepRunner>,
    mut req: PlanRequest,
    opts: EngineOptions,
    seconds: &dyn Fn() -> f64,
) -> Result<(Engine, StartupReport), BuildError> {
    req.weights_bytes = Some(runner.ledger().bytes(Category::Weights));
    let compute = runner.capabilities().compute;
    req.dtype = Some(compute);
    req.kv_cache_dtype = Some(compute);
    // First pass: the budgets the profile run needs (the activation figure is replaced below).
    let draft = plan(&req).map_err(|e| BuildError::Plan(e.to_string()))?;
    let merge = req.model.vision.as_ref().map_or(1, |v| v.spatial_merge_size);
    let spec = ProfileSpec {
        num_tokens: draft.max_num_batched_tokens,
        num_sampled: draft.max_num_seqs.min(draft.max_num_batched_tokens),
        image_grid: (draft.encoder_profile_items > 0).then(|| largest_image_grid(draft.max_tokens_per_image, merge)),
        image_items: draft.encoder_profile_items,
        block_size: draft.block_size,
    };
    let started = seconds();
    let (profile, read) = runner.profile(spec).map_err(BuildError::Profile)?;
    if let Some(read) = read {
        read.await.map_err(|e| BuildError::Profile(e.into()))?;
    }
    let profile_s = seconds() - started;
    req.activation_peak_bytes = Some(profile.activation_peak_bytes);
    let mut p = plan(&req).map_err(|e| BuildError::Plan(e.to_string()))?;
    let binding_cap = kv_binding_cap(runner.max_binding_bytes(), &p);
    if let Some(cap) = binding_cap.filter(|&cap| p.available_kv_bytes > cap as i64) {
        req.kv_cache_memory_bytes = Some(cap);
        p = plan(&req).map_err(|e| BuildError::Plan(e.to_string()))?;
    }
    let total = req.device.total_bytes;
    let mut log_lines = vec![
        format!(
            "Initial free memory: {} GiB; Requested memory: {:.2} (util), {} GiB",
            gib(total),
            p.gpu_memory_utilization,
            gib(p.requested_bytes)
        ),
        format!(
            "Memory profiling takes {profile_s:.2} seconds. Total non KV cache memory: {} GiB; torch peak memory increase: {} GiB; non-torch forward increase memory: {} GiB; weights memory: {} GiB.",
            gib(p.non_kv_bytes),
            gib(p.activation_peak_bytes),
            gib(p.non_torch_bytes),
            gib(p.weights_bytes)
        ),
    ];
    if let (Some(cap), Some(binding)) = (binding_cap, runner.max_binding_bytes()) {
        if req.kv_cache_memory_bytes == Some(cap) {
            log_lines.push(format!(
                "The {} backend binds at most {} MiB per buffer and keeps one layer's keys in one buffer: \
                 the KV cache is limited to {} GiB",
                runner.backend_name(),
                binding >> 20,
                gib(cap)
            ));
        }
    }
    // The weights line was printed while loading.
    log_lines.extend(p.vllm_log_lines().into_iter().skip(1));
    if let Some(error) = &p.error {
        return Err(BuildError::Budget {
            error: error.clone(),
            log_lines,
        });
    }
    let mut num_blocks =
        usize::try_from(p.num_gpu_blocks).map_err(|_| BuildError::Plan("KV cache too large".into()))?;
    let mut max_num_seqs = p.max_num_seqs;
    if let Some(h) = &p.hybrid {
        // vLLM hands a request's states blocks from the KV pool as it runs; kvlens keeps them in a
        // pool of one slot per request that can run at once and gives up the KV blocks whose memory
        // that pool takes, leaving at least one request of max_model_len its KV (fewer slots than
        // max_num_seqs where the memory holds fewer).
        let kv_blocks = p.max_model_len.div_ceil(p.block_size.max(1)) as u64 + 1;
        let spare = p.num_gpu_blocks.saturating_sub(kv_blocks) * p.page_size_bytes * h.layers_per_group as u64;
        let per_request = h.state_pool_bytes(1).max(1);
        let slots = (spare / per_request).min(p.max_num_seqs as u64) as usize;
        if slots == 0 {
            return Err(BuildError::Budget {
                error: format!(
                    "No available memory for the Gated DeltaNet states of one request ({} GiB) beside the KV cache of one request of max_model_len ({}). Try decreasing `max_model_len` or increasing `gpu_memory_utilization`.",
                    gib(per_request),
                    p.max_model_len
                ),
                log_lines,
            });
        }
        let reserved = h.blocks_for_states(slots, p.page_size_bytes) as usize;
        log_lines.push(format!(
            "kvlens keeps the Gated DeltaNet states of {slots} requests in a pool of their own: {} GiB, the memory of {reserved} of the {num_blocks} KV cache blocks{}",
            gib(h.state_pool_bytes(slots)),
            if slots < p.max_num_seqs {
                format!(" (max_num_seqs lowered from {}: the memory holds no more states)", p.max_num_seqs)
            } else {
                String::new()
            }
        ));
        num_blocks -= reserved;
        max_num_seqs = slots;
    }
    let cfg = EngineConfig {
        num_blocks,
        block_size: p.block_size,
        max_model_len: p.max_model_len,
        enable_prefix_caching: opts.enable_prefix_caching,
        encoder_cache_tokens: p.encoder_budget_tokens.max(1),
        max_num_seqs,
        max_num_batched_tokens: p.max_num_batched_tokens,
        vocab_size: opts.vocab_size,
        long_prefill_token_threshold: if opts.long_prefill_token_threshold == 0 && opts.max_num_partial_prefills > 1 {
            p.max_model_len * 4 / 100
        } else {
            opts.long_prefill_token_threshold
        },
    };
    let engine = Engine::new(runner, cfg).map_err(BuildError::Engine)?;
    let report = StartupReport {
        plan: p,
        profile,
        max_image_tokens: spec.image_grid.map(|g| g.iter().product::<usize>() / (merge * merge)),
        log_lines,
    };
    Ok((engine, report))
}

/// The most KV-cache bytes a backend whose buffers bind at most `binding` bytes can hold: as many
/// blocks as one layer's keys fit in one buffer, for every layer's keys and values.
impl StartupReport {
    /// Sizes `input` as start-up sized the engine: the processor cache, the context length and
    /// the largest image the profile ran.
    pub fn size_input(&self, input: &mut crate::input::InputProcessor) {
        input.set_processor_cache_bytes(self.plan.processor_cache_bytes);
        input.max_model_len = self.plan.max_model_len;
        if let Some(tokens) = self.max_image_tokens {
            input.max_image_tokens = tokens;
        }
    }
}

fn kv_binding_cap(binding: Option<u64>, p: &Plan) -> Option<u64> {
    let per_layer_block = p.page_size_bytes;
    let keys_per_block = (per_layer_block / 2).max(1);
    binding.map(|b| (b / keys_per_block) * per_layer_block * p.num_layers as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Qwen3.5-0.8B's decoder geometry (24 layers, 18 of them Gated DeltaNet with 16 heads of
    /// 128, 6 of full attention with 2 KV heads of 256) with the widths the state and the KV cache
    /// do not depend on shrunk: hidden size 64, MLP 64, a 2,048-token vocabulary, a 1-block vision
    /// tower. Started through the builder, its ledger holds exactly the state and KV bytes the
    /// plan gives it.
    #[test]
    fn a_qwen3_5_0_8b_shape_holds_the_planned_state_and_kv_bytes() {
        use crate::arch::config::{bundled_config, DType, ModelConfig};
        use crate::arch::spec::tensor_specs;
        use crate::backend::{block_on, cpu::CpuBackend};
        use crate::memory::ledger::MemoryLedger;
        use crate::memory::{device_preset, PlanRequest};
        use crate::model::{random_weights::RandomInit, weights::SafetensorsFiles, QwenVl};
        use crate::runner::ModelRunner;

        let published = bundled_config("Qwen3.5-0.8B").unwrap();
        let mut cfg = ModelConfig {
            dtype: DType::F32,
            ..published.clone()
        };
        (cfg.text.hidden_size, cfg.text.intermediate_size, cfg.text.vocab_size) = (64, 64, 2048);
        if let Some(v) = cfg.vision.as_mut() {
            (
                v.depth,
                v.hidden_size,
                v.intermediate_size,
                v.num_heads,
                v.out_hidden_size,
            ) = (1, 32, 32, 2, 64);
        }
        assert_eq!(cfg.text.linear, published.text.linear);
        let mut bytes = Vec::new();
        RandomInit::new(3, 0.02)
            .write_safetensors(&mut bytes, &tensor_specs(&cfg), |_| {})
            .unwrap();
        let shards = [("model.safetensors".to_string(), bytes.as_slice())];
        let ledger = MemoryLedger::new();
        let be = CpuBackend::new(ledger.clone());
        let model = QwenVl::load(cfg.clone(), &SafetensorsFiles::parse(&shards).unwrap(), &be, |_, _| {}).unwrap();
        let small = cfg.clone();
        let mut req = PlanRequest::new("Qwen3.5-0.8B (scaled)", cfg, device_preset("cpu").unwrap());
        (req.max_model_len, req.max_num_seqs, req.max_num_batched_tokens) = (Some(1024), Some(4), Some(8));
        req.kv_cache_memory_bytes = Some(512 << 20);
        (req.limit_mm_per_prompt.image, req.limit_mm_per_prompt.video) = (0, 0);
        let opts = EngineOptions {
            enable_prefix_caching: true,
            long_prefill_token_threshold: 0,
            max_num_partial_prefills: 1,
            vocab_size: 0,
        };
        let (engine, report) =
            block_on(build_engine(Box::new(ModelRunner::new(be, model)), req, opts, &|| 0.0)).unwrap();
        let p = &report.plan;
        let h = p.hybrid.as_ref().unwrap();
        // f32 on the CPU: conv window 3 × 6,144 and state 16 × 128 × 128, four bytes each.
        assert_eq!(h.state_bytes(), (3 * 6_144 + 16 * 128 * 128) * 4);
        assert_eq!(ledger.bytes(Category::StateCache), h.state_pool_bytes(4));
        let reserved = h.blocks_for_states(4, p.page_size_bytes);
        let blocks = engine.kv().summary().num_blocks as u64;
        assert_eq!(blocks, p.num_gpu_blocks - reserved);
        assert_eq!(ledger.bytes(Category::KvCache), blocks * p.page_size_bytes * 6);
        // Together they stay inside what the plan gave the KV cache.
        assert!(ledger.bytes(Category::KvCache) + ledger.bytes(Category::StateCache) <= p.available_kv_bytes as u64);
        assert!(report
            .log_lines
            .iter()
            .any(|l| l.starts_with("kvlens keeps the Gated DeltaNet states of 4 requests")));
        drop(engine);

        // 64 MiB: 9 blocks of 288 tokens; one request of 1,024 tokens keeps 5 (the null block
        // included), and the other 4 hold the states of one request (20.2 MiB), not four.
        let be = CpuBackend::new(MemoryLedger::new());
        let model = QwenVl::load(
            small.clone(),
            &SafetensorsFiles::parse(&shards).unwrap(),
            &be,
            |_, _| {},
        )
        .unwrap();
        let mut req = PlanRequest::new("Qwen3.5-0.8B (scaled)", small, device_preset("cpu").unwrap());
        (req.max_model_len, req.max_num_seqs, req.max_num_batched_tokens) = (Some(1024), Some(4), Some(8));
        req.kv_cache_memory_bytes = Some(64 << 20);
        (req.limit_mm_per_prompt.image, req.limit_mm_per_prompt.video) = (0, 0);
        let (engine, report) =
            block_on(build_engine(Box::new(ModelRunner::new(be, model)), req, opts, &|| 0.0)).unwrap();
        assert_eq!((report.plan.num_gpu_blocks, report.plan.block_size), (9, 288));
        assert_eq!(engine.snapshot().states.unwrap().total, 1);
        assert!(
            report
                .log_lines
                .iter()
                .any(|l| l.contains("max_num_seqs lowered from 4")),
            "{:?}",
            report.log_lines
        );
    }

    #[test]
    fn largest_grid_has_exactly_the_token_budget() {
        assert_eq!(largest_image_grid(16_384, 2), [1, 256, 256]);
        assert_eq!(largest_image_grid(1_000, 2), [1, 50, 80]);
        assert_eq!(largest_image_grid(997, 2), [1, 2, 1994]);
        assert_eq!(largest_image_grid(1, 2), [1, 2, 2]);
    }
}
