//! The vLLM engine flags that `kvlens plan` and `kvlens serve` both take, spelled as `vllm serve`
//! spells them, and their one conversion into the planner's request.

use crate::UsageError;
use anyhow::Result;
use kvlens_engine::config::DType;
use kvlens_engine::memory::log_budget::HeaderSettings;
use kvlens_engine::memory::{MmLimits, PlanRequest};

/// Engine flags that size the KV cache, the scheduler and the multimodal budgets.
#[derive(Debug, Clone, clap::Args, serde::Serialize)]
pub struct VllmFlags {
    /// Longest prompt plus output [default: the model's max_position_embeddings].
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// Share of the device memory the engine may use [default: 0.9].
    #[arg(long)]
    pub gpu_memory_utilization: Option<f64>,
    /// Most tokens per engine step [default: vLLM's for the device].
    #[arg(long)]
    pub max_num_batched_tokens: Option<usize>,
    /// Most requests running at once [default: vLLM's for the device].
    #[arg(long)]
    pub max_num_seqs: Option<usize>,
    /// Tokens per KV block [default: 16, or 128 on Ascend].
    #[arg(long)]
    pub block_size: Option<usize>,
    /// Items per prompt: `image=N,video=M` or JSON such as '{"image": 4, "video": 0}'.
    #[arg(long)]
    pub limit_mm_per_prompt: Option<String>,
    /// Host memory of the preprocessed-image cache in GiB (0 turns it off).
    #[arg(long, default_value_t = 4.0, value_parser = non_negative)]
    pub mm_processor_cache_gb: f64,
    /// Weights dtype: auto (the checkpoint's), bfloat16, float16, float32; `kvlens serve` computes
    /// in float32 on the CPU.
    #[arg(long, default_value = "auto")]
    pub dtype: String,
    /// KV cache dtype: auto (the compute dtype), bfloat16, float16, float32, fp8, fp8_e4m3,
    /// fp8_e5m2.
    #[arg(long, default_value = "auto")]
    pub kv_cache_dtype: String,
}

impl VllmFlags {
    /// Sets these flags on a planner request; the settings a log header names (`kvlens plan
    /// --from-log`) fill in the flags not given, the planner's defaults the rest.
    pub fn apply(&self, r: &mut PlanRequest, header: &HeaderSettings) -> Result<()> {
        r.max_model_len = self.max_model_len.or(header.max_model_len);
        if let Some(u) = self.gpu_memory_utilization.or(header.gpu_memory_utilization) {
            r.gpu_memory_utilization = u;
        }
        r.max_num_batched_tokens = self.max_num_batched_tokens.or(header.max_num_batched_tokens);
        r.max_num_seqs = self.max_num_seqs.or(header.max_num_seqs);
        r.block_size = self.block_size.or(header.block_size);
        if let Some(l) = self
            .limit_mm_per_prompt
            .as_ref()
            .or(header.limit_mm_per_prompt.as_ref())
        {
            r.limit_mm_per_prompt = MmLimits::parse(l).map_err(|e| usage(e.to_string()))?;
        }
        r.mm_processor_cache_gb = self.mm_processor_cache_gb;
        let kv_dtype = match (self.kv_cache_dtype.as_str(), &header.kv_cache_dtype) {
            ("auto", Some(h)) => h.as_str(),
            (flag, _) => flag,
        };
        r.kv_cache_dtype = parse_dtype("kv-cache-dtype", kv_dtype)?;
        r.dtype = parse_dtype("dtype", &self.dtype)?;
        Ok(())
    }
}

fn usage(msg: impl Into<String>) -> anyhow::Error {
    UsageError(msg.into()).into()
}

/// A size flag's value parser: a finite number of GiB, 0 or more.
pub(crate) fn non_negative(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        Ok(v) => Err(format!("must be a non-negative size, got {v}")),
        Err(_) => Err(format!("{s:?} is not a number")),
    }
}

/// `--FLAG VALUE` as a dtype: None for `auto` (the checkpoint's), else a known name.
pub(crate) fn parse_dtype(flag: &str, value: &str) -> Result<Option<DType>> {
    if value.eq_ignore_ascii_case("auto") {
        return Ok(None);
    }
    DType::parse(value)
        .map(Some)
        .ok_or_else(|| usage(format!("--{flag}: unknown dtype {value:?}")))
}
