//! The start-up budget vLLM computes, reproduced (docs/MEMORY.md; vLLM's `determine_available_memory`
//! in <https://github.com/vllm-project/vllm/blob/main/vllm/v1/worker/gpu_worker.py> and the KV cache
//! sizing in <https://github.com/vllm-project/vllm/blob/main/vllm/v1/core/kv_cache_utils.py>).
//!
//! `requested = total × util`; `non_kv = weights + activation_peak + non_torch`;
//! `available_kv = requested − non_kv` (or `--kv-cache-memory`); `num_blocks = available // page // layers`;
//! the encoder budget is `max(max_num_batched_tokens, largest item)`. Measured figures replace the
//! estimates when given.

use super::device::DeviceProfile;
use super::hybrid::HybridLayout;
use super::weights::weight_bytes_per_rank;
use crate::arch::config::{DType, Family, ImageLimits, ModelConfig};
use crate::arch::weight_format::WeightFormat;

use super::GIB;
/// vLLM's default `--limit-mm-per-prompt` for each modality in V1.
pub const DEFAULT_MM_LIMIT: usize = 999;
/// vLLM caps the frames of a profiled Qwen2/2.5-VL video at 14.
const MAX_VIDEO_FRAMES_QWEN2: usize = 14;
/// Most tokens (`--max-num-batched-tokens`) or sequences (`--max-num-seqs`) per step the planner
/// takes: far beyond any device's memory, small enough that every byte count it derives fits 64 bits.
pub const MAX_PER_STEP: usize = 1 << 31;
/// vLLM's default `--mm-processor-cache-gb`.
pub const DEFAULT_MM_PROCESSOR_CACHE_GB: f64 = 4.0;
/// Qwen3-VL's shipped video `size.longest_edge` (pixels over all frames).
const QWEN3_VIDEO_MAX_PIXELS: u64 = 25_165_824;

/// Why a plan cannot be computed from the given settings.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlanError {
    /// A flag value that cannot work.
    #[error("{0}")]
    Invalid(String),
}

fn invalid<T>(msg: impl Into<String>) -> Result<T, PlanError> {
    Err(PlanError::Invalid(msg.into()))
}

/// Per-prompt item limits (`--limit-mm-per-prompt`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct MmLimits {
    /// Images per prompt.
    pub image: usize,
    /// Videos per prompt.
    pub video: usize,
}

impl Default for MmLimits {
    fn default() -> Self {
        MmLimits {
            image: DEFAULT_MM_LIMIT,
            video: DEFAULT_MM_LIMIT,
        }
    }
}

impl MmLimits {
    /// Parses `image=4,video=0` or JSON such as `{"image": 4, "video": 0}` or
    /// `{"image": {"count": 4, "width": 512, "height": 512}}`. Unnamed modalities keep vLLM's default.
    pub fn parse(text: &str) -> Result<Self, PlanError> {
        let mut limits = MmLimits::default();
        let text = text.trim();
        let bad = |why: &str| PlanError::Invalid(format!("invalid --limit-mm-per-prompt {text:?}: {why}"));
        let pairs: Vec<(String, usize)> = if text.starts_with('{') {
            let v: serde_json::Value = serde_json::from_str(text).map_err(|e| bad(&e.to_string()))?;
            let obj = v.as_object().ok_or_else(|| bad("expected a JSON object"))?;
            obj.iter()
                .map(|(k, v)| {
                    let n = v
                        .as_u64()
                        .or_else(|| v.get("count").and_then(serde_json::Value::as_u64));
                    let n = n.ok_or_else(|| bad(&format!("{k} needs a count")))?;
                    Ok((k.clone(), usize::try_from(n).map_err(|_| bad("count too large"))?))
                })
                .collect::<Result<_, PlanError>>()?
        } else {
            text.split(',')
                .filter(|p| !p.trim().is_empty())
                .map(|p| {
                    let (k, v) = p.split_once('=').ok_or_else(|| bad("expected modality=count pairs"))?;
                    let n = v
                        .trim()
                        .parse::<usize>()
                        .map_err(|_| bad(&format!("{:?} is not a count", v.trim())))?;
                    Ok((k.trim().to_string(), n))
                })
                .collect::<Result<_, PlanError>>()?
        };
        if pairs.is_empty() {
            return Err(bad("empty"));
        }
        for (k, n) in pairs {
            match k.as_str() {
                "image" => limits.image = n,
                "video" => limits.video = n,
                "audio" => {}
                other => return Err(bad(&format!("unknown modality {other:?} (image, video)"))),
            }
        }
        Ok(limits)
    }
}

/// Everything the planner needs: the model, the device and vLLM's flags.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanRequest {
    /// Parsed `config.json`.
    pub model: ModelConfig,
    /// Name to show for the model.
    pub model_name: String,
    /// Image processor limits (shipped defaults unless a checkpoint says otherwise).
    pub image_limits: ImageLimits,
    /// Device preset (possibly with a custom total).
    pub device: DeviceProfile,
    /// `--tensor-parallel-size`.
    pub tensor_parallel_size: usize,
    /// `--max-model-len` (default: the model's `max_position_embeddings`).
    pub max_model_len: Option<usize>,
    /// `--gpu-memory-utilization`.
    pub gpu_memory_utilization: f64,
    /// `--max-num-batched-tokens` (default: the device's API-server default).
    pub max_num_batched_tokens: Option<usize>,
    /// `--max-num-seqs` (default: the device's API-server default).
    pub max_num_seqs: Option<usize>,
    /// `--block-size` (default: the platform's).
    pub block_size: Option<usize>,
    /// `--limit-mm-per-prompt`.
    pub limit_mm_per_prompt: MmLimits,
    /// `--mm-processor-cache-gb` (host RAM).
    pub mm_processor_cache_gb: f64,
    /// `--dtype` (None = the checkpoint's).
    pub dtype: Option<DType>,
    /// `--kv-cache-dtype` (None = auto, the model dtype).
    pub kv_cache_dtype: Option<DType>,
    /// `--quantization`: the weight matrices in a block format quantized on load.
    pub quantization: WeightFormat,
    /// `--kv-cache-memory`: skips the utilization rule.
    pub kv_cache_memory_bytes: Option<u64>,
    /// Measured weights memory replacing the estimate.
    pub weights_bytes: Option<u64>,
    /// Measured activation peak replacing the estimate.
    pub activation_peak_bytes: Option<u64>,
    /// Measured non-torch memory replacing the device default.
    pub non_torch_bytes: Option<u64>,
}

impl PlanRequest {
    /// vLLM's defaults for this model on this device.
    pub fn new(model_name: impl Into<String>, model: ModelConfig, device: DeviceProfile) -> Self {
        PlanRequest {
            image_limits: ImageLimits::shipped(model.family),
            model,
            model_name: model_name.into(),
            device,
            tensor_parallel_size: 1,
            max_model_len: None,
            gpu_memory_utilization: 0.9,
            max_num_batched_tokens: None,
            max_num_seqs: None,
            block_size: None,
            limit_mm_per_prompt: MmLimits::default(),
            mm_processor_cache_gb: DEFAULT_MM_PROCESSOR_CACHE_GB,
            dtype: None,
            kv_cache_dtype: None,
            quantization: WeightFormat::Unquantized,
            kv_cache_memory_bytes: None,
            weights_bytes: None,
            activation_peak_bytes: None,
            non_torch_bytes: None,
        }
    }
}

/// Where a figure comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    /// Computed by kvlens from the config (an estimate).
    Estimated,
    /// Given on the command line.
    Given,
    /// Follows from other figures by vLLM's formulas.
    Derived,
    /// Read from a vLLM log.
    FromLog,
}

/// The largest multimodal item the encoder budget is sized for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Modality {
    /// A still image.
    Image,
    /// A video.
    Video,
}

impl Source {
    /// How tables show where a figure comes from; `None` is the device preset.
    pub fn label(source: Option<Source>) -> &'static str {
        match source {
            None => "device",
            Some(Source::Estimated) => "estimated",
            Some(Source::Given) => "given",
            Some(Source::Derived) => "derived",
            Some(Source::FromLog) => "from log",
        }
    }
}

impl Modality {
    /// Lower-case name as vLLM logs it.
    pub fn as_str(self) -> &'static str {
        match self {
            Modality::Image => "image",
            Modality::Video => "video",
        }
    }
}

/// The full start-up budget of one tensor-parallel rank.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Plan {
    /// Model name.
    pub model: String,
    /// Device preset name.
    pub device: String,
    /// Tensor-parallel degree.
    pub tensor_parallel_size: usize,
    /// Effective `max_model_len`.
    pub max_model_len: usize,
    /// Effective `max_num_batched_tokens`.
    pub max_num_batched_tokens: usize,
    /// Effective `max_num_seqs`.
    pub max_num_seqs: usize,
    /// Effective block size.
    pub block_size: usize,
    /// `--block-size` as given (None: the device's default, or for a hybrid model the smallest
    /// block whose page holds a state).
    pub requested_block_size: Option<usize>,
    /// Weights dtype.
    pub dtype: DType,
    /// KV cache dtype.
    pub kv_cache_dtype: DType,
    /// Weight matrices' format (`--quantization`).
    pub quantization: WeightFormat,
    /// Device total as the runtime reports it.
    pub total_bytes: u64,
    /// `gpu_memory_utilization`.
    pub gpu_memory_utilization: f64,
    /// `total × util`.
    pub requested_bytes: u64,
    /// Weights memory (vLLM's "Loading model weights took"), including Qwen3-VL deepstack buffers.
    pub weights_bytes: u64,
    /// Of which Qwen3-VL deepstack input buffers (`3 × mnbt × hidden`).
    pub deepstack_buffer_bytes: u64,
    /// Transient peak of the profile run ("torch peak memory increase").
    pub activation_peak_bytes: u64,
    /// Non-torch growth (driver, communication buffers).
    pub non_torch_bytes: u64,
    /// `weights + activation_peak + non_torch`.
    pub non_kv_bytes: u64,
    /// Memory left for the KV cache (may be negative when nothing is left).
    pub available_kv_bytes: i64,
    /// One layer's page: `2 · block · kv_heads_per_rank · head_dim · dtype`.
    pub page_size_bytes: u64,
    /// KV bytes per token on this rank, all layers.
    pub kv_bytes_per_token: u64,
    /// Layers with their own KV cache.
    pub num_layers: usize,
    /// KV heads each rank holds.
    pub kv_heads_per_rank: usize,
    /// Blocks, including the null block.
    pub num_gpu_blocks: u64,
    /// `num_gpu_blocks × block_size` ("GPU KV cache size").
    pub kv_cache_tokens: u64,
    /// `num_gpu_blocks / cdiv(max_model_len, block)`.
    pub max_concurrency: f64,
    /// KV memory one request of `max_model_len` needs.
    pub needed_kv_bytes: u64,
    /// Largest image in LLM tokens.
    pub max_tokens_per_image: usize,
    /// Largest video in LLM tokens (0 when videos are disabled).
    pub max_tokens_per_video: usize,
    /// Modality the encoder budget is profiled with (None when all are disabled).
    pub encoder_profile_modality: Option<Modality>,
    /// `max(mnbt, largest item)`; 0 when every modality is disabled.
    pub encoder_budget_tokens: usize,
    /// Items of the maximum size in the profile run.
    pub encoder_profile_items: usize,
    /// Encoder output width per token (with deepstack).
    pub encoder_output_dim: usize,
    /// Device bytes the encoder cache can hold once full (`budget × dim × dtype`).
    pub encoder_cache_bytes: u64,
    /// Host RAM of the processor cache.
    pub processor_cache_bytes: u64,
    /// Whether one request of `max_model_len` fits.
    pub fits: bool,
    /// vLLM's estimate of the longest length that fits (when it does not).
    pub estimated_max_model_len: Option<usize>,
    /// vLLM's error text (when it does not fit).
    pub error: Option<String>,
    /// Where the weights figure came from.
    pub weights_source: Source,
    /// Where the activation peak came from.
    pub activation_peak_source: Source,
    /// Where the non-torch figure came from.
    pub non_torch_source: Source,
    /// Where the available KV figure came from.
    pub available_kv_source: Source,
    /// Where the device total came from: `None` for the device preset (or `--total-memory-gib`).
    pub total_source: Option<Source>,
    /// Where the requested figure came from (normally derived: `total × util`).
    pub requested_source: Source,
    /// A hybrid model's state layout (Qwen3.5); None when every layer is full attention.
    pub hybrid: Option<HybridLayout>,
}

/// `ceil(a / b)`.
fn cdiv(a: u64, b: u64) -> u64 {
    a.div_ceil(b.max(1))
}

/// Largest image in LLM tokens: `max_pixels // factor²` (vLLM's "image with most features"); 0
/// for a text model alone.
pub fn max_tokens_per_image(model: &ModelConfig, limits: ImageLimits) -> usize {
    let Some(v) = &model.vision else { return 0 };
    let f = v.image_factor() as u64;
    (limits.max_pixels / (f * f)) as usize
}

/// Largest profiled video in LLM tokens, following vLLM ≥ 0.15: Qwen2/2.5-VL fit as many
/// max-size frame pairs as `max_model_len` holds (at most 14 frames); Qwen3-VL uses two frames
/// whose joint area is its video `longest_edge`. 0 for a text model alone.
pub fn max_tokens_per_video(model: &ModelConfig, limits: ImageLimits, max_model_len: usize) -> usize {
    let Some(v) = &model.vision else { return 0 };
    let f = v.image_factor() as u64;
    match model.family {
        Family::Qwen3Vl | Family::Qwen3VlMoe | Family::Qwen35 | Family::Qwen35Moe => {
            (QWEN3_VIDEO_MAX_PIXELS / v.temporal_patch_size as u64 / (f * f)) as usize
        }
        Family::Qwen2Vl | Family::Qwen25Vl => {
            let per_pair = max_tokens_per_image(model, limits).max(1);
            let pairs = (max_model_len / per_pair).clamp(1, MAX_VIDEO_FRAMES_QWEN2 / 2);
            pairs * per_pair
        }
    }
}

/// The encoder budget and profile (vLLM's `compute_encoder_budget` in
/// <https://github.com/vllm-project/vllm/blob/main/vllm/v1/core/encoder_cache_manager.py>):
/// (budget tokens, items, modality, largest item).
fn encoder_budget(
    limits: MmLimits,
    image_tokens: usize,
    video_tokens: usize,
    mnbt: usize,
    mns: usize,
    max_len: usize,
) -> (usize, usize, Option<Modality>) {
    let candidates = [
        (Modality::Image, limits.image, image_tokens),
        (Modality::Video, limits.video, video_tokens),
    ];
    // The first modality with the most tokens wins, as Python's max over a dict does.
    let mut best: Option<(Modality, usize, usize)> = None;
    for (m, limit, tokens) in candidates {
        if limit > 0 && tokens > 0 && best.is_none_or(|(_, _, t)| tokens > t) {
            best = Some((m, limit, tokens));
        }
    }
    let Some((modality, limit, t)) = best else {
        return (0, 0, None);
    };
    let budget = mnbt.max(t);
    let encoder_items = budget / t;
    let per_prompt = limit.min(max_len / t).max(1);
    let decoder_items = mns.saturating_mul(per_prompt);
    (budget, encoder_items.min(decoder_items).max(1), Some(modality))
}

/// Transient peak of vLLM's profile run on one rank (an estimate of `profile_run` in
/// <https://github.com/vllm-project/vllm/blob/main/vllm/v1/worker/gpu_model_runner.py>): the larger of the vision
/// tower over the profiled items and the kept encoder outputs plus the decoder's dummy batch and the
/// sampler's logits.
fn estimate_activation_peak(p: &Plan, model: &ModelConfig, tp: usize, act_bytes: u64) -> u64 {
    let t = &model.text;
    let tp = tp.max(1) as u64;
    let n = p.max_num_batched_tokens as u64;
    let (h, hd) = (t.hidden_size as u64, t.head_dim as u64);
    let q_rank = t.num_attention_heads as u64 / tp;
    let inter_rank = match &t.moe {
        Some(m) => (m.moe_intermediate_size * m.num_experts_per_tok) as u64 / tp,
        None => t.intermediate_size as u64 / tp,
    };
    // Residual, normed hidden and the multimodal input embeddings, then the wider of attention and MLP.
    let attn = n * (2 * q_rank + 2 * p.kv_heads_per_rank as u64) * hd;
    let mlp = n * 3 * inter_rank;
    let decoder = (3 * n * h + attn.max(mlp)) * act_bytes;
    let rows = p.max_num_batched_tokens.min(p.max_num_seqs) as u64;
    let sampler = rows * t.vocab_size as u64 * (act_bytes + 3 * 4);
    let item_tokens = match p.encoder_profile_modality {
        Some(Modality::Video) => p.max_tokens_per_video,
        Some(Modality::Image) => p.max_tokens_per_image,
        None => 0,
    } as u64;
    let items = p.encoder_profile_items as u64;
    let kept_outputs = items * item_tokens * p.encoder_output_dim as u64 * act_bytes;
    let vit = model.vision.as_ref().map_or(0, |v| {
        let merge = (v.spatial_merge_size * v.spatial_merge_size) as u64;
        let patches = items * item_tokens * merge;
        let e = v.hidden_size as u64;
        let patch_in = v.patch_dim() as u64;
        // The MLP's intermediate activations: its up projections and their product or activation.
        let ups = 1 + v.mlp.up_projections() as u64;
        let vit_layer = (4 * e / tp).max(ups * v.intermediate_size as u64 / tp);
        patches * (patch_in + 2 * e + vit_layer) * act_bytes + kept_outputs
    });
    vit.max(kept_outputs + decoder + sampler)
}

/// Computes the budget. Settings that cannot work are errors; a `max_model_len` that does not fit is
/// not an error but a plan with `fits == false` and vLLM's message.
pub fn plan(req: &PlanRequest) -> Result<Plan, PlanError> {
    let m = &req.model;
    let t = &m.text;
    let tp = req.tensor_parallel_size;
    let util = req.gpu_memory_utilization;
    if !(util > 0.0 && util <= 1.0) {
        return invalid(format!("--gpu-memory-utilization must be in (0, 1], got {util}"));
    }
    if tp == 0 {
        return invalid("--tensor-parallel-size must be at least 1");
    }
    if !t.num_attention_heads.is_multiple_of(tp) {
        return invalid(format!(
            "Total number of attention heads ({}) must be divisible by tensor parallel size ({tp})",
            t.num_attention_heads
        ));
    }
    let nkv = t.num_key_value_heads;
    if !nkv.is_multiple_of(tp) && !tp.is_multiple_of(nkv) {
        return invalid(format!(
            "Number of KV heads ({nkv}) and tensor parallel size ({tp}) must divide one another"
        ));
    }
    if let Some(v) = m.vision.as_ref().filter(|v| !v.num_heads.is_multiple_of(tp)) {
        return invalid(format!(
            "Vision attention heads ({}) must be divisible by tensor parallel size ({tp})",
            v.num_heads
        ));
    }
    let max_len = req.max_model_len.unwrap_or(t.max_position_embeddings);
    if max_len == 0 {
        return invalid("--max-model-len must be positive");
    }
    if max_len > t.max_position_embeddings {
        return invalid(format!(
            "User-specified max_model_len ({max_len}) is greater than the derived max_model_len (max_position_embeddings={})",
            t.max_position_embeddings
        ));
    }
    req.image_limits.check().map_err(PlanError::Invalid)?;
    if let Some(b) = req.block_size.filter(|&b| b == 0 || b > 1024) {
        return invalid(format!("--block-size must be between 1 and 1024, got {b}"));
    }
    let (default_mnbt, default_mns) = req.device.default_scheduler_limits();
    let mnbt = req.max_num_batched_tokens.unwrap_or(default_mnbt);
    let mns = req.max_num_seqs.unwrap_or(default_mns.min(mnbt));
    if mnbt == 0 || mns == 0 {
        return invalid("--max-num-batched-tokens and --max-num-seqs must be positive");
    }
    if mnbt > MAX_PER_STEP || mns > MAX_PER_STEP {
        return invalid(format!(
            "--max-num-batched-tokens ({mnbt}) and --max-num-seqs ({mns}) must be at most {MAX_PER_STEP}"
        ));
    }
    if !(req.mm_processor_cache_gb >= 0.0 && req.mm_processor_cache_gb.is_finite()) {
        return invalid(format!(
            "--mm-processor-cache-gb must be a non-negative number, got {}",
            req.mm_processor_cache_gb
        ));
    }
    if req.device.total_bytes == 0 {
        return invalid("the device's total memory must be positive");
    }
    let dtype = req.dtype.unwrap_or(m.dtype);
    if dtype == DType::Fp8 {
        return invalid("--dtype fp8 is not a weights dtype (use it for --kv-cache-dtype)");
    }
    let kv_dtype = req.kv_cache_dtype.unwrap_or(dtype);
    let act_bytes = dtype.size_bytes();
    // A hybrid model's block holds a Gated DeltaNet state: vLLM raises the block size to fit it.
    let hybrid = HybridLayout::of(t, tp, dtype, kv_dtype);
    let block_size = match &hybrid {
        Some(h) => h.block_size(req.block_size),
        None => req.block_size.unwrap_or_else(|| req.device.default_block_size()),
    };

    let kv_heads_per_rank = (nkv / tp).max(1);
    let page = 2 * block_size as u64 * kv_heads_per_rank as u64 * t.head_dim as u64 * kv_dtype.size_bytes();
    // Blocks are counted per page in every layer of a KV cache group (all layers, without hybrid).
    let layers = hybrid.as_ref().map_or(t.num_hidden_layers, |h| h.layers_per_group);
    let needed_kv_bytes = match &hybrid {
        Some(h) => h.bytes_per_request(max_len, block_size, page),
        None => layers as u64 * cdiv(max_len as u64, block_size as u64) * page,
    };
    let image_tokens = max_tokens_per_image(m, req.image_limits);
    let limits = req.limit_mm_per_prompt;
    let video_tokens = if limits.video > 0 {
        max_tokens_per_video(m, req.image_limits, max_len)
    } else {
        0
    };
    let (budget, items, modality) = encoder_budget(limits, image_tokens, video_tokens, mnbt, mns, max_len);
    let encoder_dim = m.encoder_output_dim();

    let deepstack = m.deepstack_levels() as u64 * mnbt as u64 * t.hidden_size as u64 * act_bytes;
    let estimated_weights: u64 = weight_bytes_per_rank(m, tp, act_bytes, req.quantization)
        .iter()
        .map(|(_, b)| b)
        .sum::<u64>()
        + deepstack;
    let total = req.device.total_bytes;
    let requested = (total as f64 * util).ceil() as u64;

    let mut p = Plan {
        model: req.model_name.clone(),
        device: req.device.name.clone(),
        tensor_parallel_size: tp,
        max_model_len: max_len,
        max_num_batched_tokens: mnbt,
        max_num_seqs: mns,
        block_size,
        requested_block_size: req.block_size,
        dtype,
        kv_cache_dtype: kv_dtype,
        quantization: req.quantization,
        total_bytes: total,
        gpu_memory_utilization: util,
        requested_bytes: requested,
        weights_bytes: req.weights_bytes.unwrap_or(estimated_weights),
        deepstack_buffer_bytes: deepstack,
        activation_peak_bytes: 0,
        non_torch_bytes: req.non_torch_bytes.unwrap_or(req.device.non_torch_bytes),
        non_kv_bytes: 0,
        available_kv_bytes: 0,
        page_size_bytes: page,
        kv_bytes_per_token: page / block_size as u64 * t.attention_layers() as u64,
        num_layers: layers,
        kv_heads_per_rank,
        num_gpu_blocks: 0,
        kv_cache_tokens: 0,
        max_concurrency: 0.0,
        needed_kv_bytes,
        max_tokens_per_image: image_tokens,
        max_tokens_per_video: video_tokens,
        encoder_profile_modality: modality,
        encoder_budget_tokens: budget,
        encoder_profile_items: items,
        encoder_output_dim: encoder_dim,
        encoder_cache_bytes: budget as u64 * encoder_dim as u64 * act_bytes,
        processor_cache_bytes: (req.mm_processor_cache_gb * GIB).round() as u64,
        fits: false,
        estimated_max_model_len: None,
        error: None,
        weights_source: if req.weights_bytes.is_some() {
            Source::Given
        } else {
            Source::Estimated
        },
        activation_peak_source: if req.activation_peak_bytes.is_some() {
            Source::Given
        } else {
            Source::Estimated
        },
        non_torch_source: if req.non_torch_bytes.is_some() {
            Source::Given
        } else {
            Source::Estimated
        },
        available_kv_source: if req.kv_cache_memory_bytes.is_some() {
            Source::Given
        } else {
            Source::Derived
        },
        total_source: None,
        requested_source: Source::Derived,
        hybrid,
    };
    p.activation_peak_bytes = req
        .activation_peak_bytes
        .unwrap_or_else(|| estimate_activation_peak(&p, m, tp, act_bytes));
    p.sum_non_kv();
    p.available_kv_bytes = match req.kv_cache_memory_bytes {
        Some(b) => i64::try_from(b).unwrap_or(i64::MAX),
        None => clamp_i64(i128::from(requested) - i128::from(p.non_kv_bytes)),
    };
    finish_kv(&mut p);
    Ok(p)
}

/// `v` clamped into `i64` (byte figures read from a log can be as large as `u64` allows).
fn clamp_i64(v: i128) -> i64 {
    i64::try_from(v).unwrap_or(if v < 0 { i64::MIN } else { i64::MAX })
}

/// Blocks, tokens, concurrency and the fit check from `available_kv_bytes` (as in
/// <https://github.com/vllm-project/vllm/blob/main/vllm/v1/core/kv_cache_utils.py>).
pub fn finish_kv(p: &mut Plan) {
    let per_block_all_layers = p.page_size_bytes * p.num_layers as u64;
    let bs = p.block_size as u64;
    if p.available_kv_bytes <= 0 {
        p.num_gpu_blocks = 0;
        p.kv_cache_tokens = 0;
        p.max_concurrency = 0.0;
        p.fits = false;
        p.estimated_max_model_len = None;
        p.error = Some("No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when initializing the engine.".into());
        return;
    }
    let avail = p.available_kv_bytes as u64;
    p.num_gpu_blocks = avail / p.page_size_bytes / p.num_layers as u64;
    match &p.hybrid {
        // vLLM 0.17 divides the pool by its groups as if each took a block per token, and counts
        // a request's state blocks in its concurrency.
        Some(h) => {
            p.kv_cache_tokens = p.num_gpu_blocks / h.groups as u64 * bs;
            p.max_concurrency = p.num_gpu_blocks as f64 / h.blocks_per_request(p.max_model_len, p.block_size) as f64;
        }
        None => {
            p.kv_cache_tokens = p.num_gpu_blocks * bs;
            p.max_concurrency = p.num_gpu_blocks as f64 / cdiv(p.max_model_len as u64, bs) as f64;
        }
    }
    p.fits = p.needed_kv_bytes <= avail;
    if p.fits {
        p.estimated_max_model_len = None;
        p.error = None;
        return;
    }
    let state_pages = p
        .hybrid
        .as_ref()
        .map_or(0, |h| h.state_layers as u64 * p.page_size_bytes);
    let w = ((avail.saturating_sub(state_pages) / per_block_all_layers) * bs).min(p.max_model_len as u64) as usize;
    p.estimated_max_model_len = Some(w);
    let based_on = if w > 0 {
        format!(" Based on the available memory, the estimated maximum model length is {w}.")
    } else {
        String::new()
    };
    p.error = Some(format!(
        "To serve at least one request with the models's max seq len ({}), ({:.2} GiB KV cache is needed, which is larger than the available KV cache memory ({:.2} GiB).{based_on} Try increasing `gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine.",
        p.max_model_len,
        p.needed_kv_bytes as f64 / GIB,
        avail as f64 / GIB
    ));
}

/// Formats an integer with thousands separators, as Python's `{:,}`.
pub fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::with_capacity(s.len() + s.len() / 3);
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// Bytes as GiB with two decimals.
pub fn gib(bytes: u64) -> String {
    format!("{:.2}", bytes as f64 / GIB)
}

impl Plan {
    /// Sets `non_kv_bytes` to weights + activation peak + non-torch memory (saturating: figures
    /// read from a log can be as large as `u64` allows).
    pub fn sum_non_kv(&mut self) {
        self.non_kv_bytes = self
            .weights_bytes
            .saturating_add(self.activation_peak_bytes)
            .saturating_add(self.non_torch_bytes);
    }

    /// The settings the budget was computed with, in one line.
    pub fn summary(&self) -> String {
        format!(
            "{} on {} (TP {}), max_model_len {}, block {}, max_num_batched_tokens {}, max_num_seqs {}, dtype {:?}, KV {:?}{}",
            self.model,
            self.device,
            self.tensor_parallel_size,
            self.max_model_len,
            self.block_size,
            self.max_num_batched_tokens,
            self.max_num_seqs,
            self.dtype,
            self.kv_cache_dtype,
            match self.quantization {
                WeightFormat::Unquantized => String::new(),
                q => format!(", weights {q}"),
            }
        )
    }

    /// Whether one request of `max_model_len` fits, in one sentence; when it does not, with
    /// vLLM's estimate of the longest length that does.
    pub fn verdict(&self) -> String {
        let len = thousands(self.max_model_len as u64);
        let (needed, avail) = (gib(self.needed_kv_bytes), gib(self.available_kv_bytes.max(0) as u64));
        if self.fits {
            return format!(
                "Fits: one request of {len} tokens needs {needed} GiB of KV cache; {avail} GiB hold {} tokens ({:.2}x concurrency).",
                thousands(self.kv_cache_tokens),
                self.max_concurrency
            );
        }
        match self.estimated_max_model_len {
            Some(w) => format!(
                "Does not fit: one request of {len} tokens needs {needed} GiB of KV cache, {avail} GiB are available; the estimated maximum model length is {}.",
                thousands(w as u64)
            ),
            None => format!(
                "Does not fit: no memory is left for the KV cache (requested {} GiB, non-KV {} GiB).",
                gib(self.requested_bytes),
                gib(self.non_kv_bytes)
            ),
        }
    }

    /// The lines vLLM logs at start-up for this budget, in order.
    pub fn vllm_log_lines(&self) -> Vec<String> {
        let mut lines = vec![format!(
            "Loading model weights took {:.4} GiB",
            self.weights_bytes as f64 / GIB
        )];
        if let Some(h) = &self.hybrid {
            lines.extend(h.log_lines(self.block_size, self.requested_block_size, self.page_size_bytes));
        }
        match self.encoder_profile_modality {
            Some(m) => lines.push(format!(
                "Encoder cache will be initialized with a budget of {} tokens, and profiled with {} {} items of the maximum feature size.",
                self.encoder_budget_tokens,
                self.encoder_profile_items,
                m.as_str()
            )),
            None => lines.push("All non-text modalities supported by the model have been explicitly disabled via limit_mm_per_prompt. Encoder cache will not be initialized.".into()),
        }
        let avail = self.available_kv_bytes.max(0) as u64;
        lines.push(format!("Available KV cache memory: {} GiB", gib(avail)));
        match &self.error {
            Some(e) => lines.push(format!("ValueError: {e}")),
            None => {
                lines.push(format!("GPU KV cache size: {} tokens", thousands(self.kv_cache_tokens)));
                lines.push(format!(
                    "Maximum concurrency for {} tokens per request: {:.2}x",
                    thousands(self.max_model_len as u64),
                    self.max_concurrency
                ));
            }
        }
        lines
    }

    /// The breakdown as (label, value, source) rows for tables in the terminal and the playground.
    pub fn table(&self) -> Vec<(String, String, Option<Source>)> {
        let avail = self.available_kv_bytes.max(0) as u64;
        let mut rows = vec![
            (
                "total device memory".into(),
                format!("{} GiB", gib(self.total_bytes)),
                self.total_source,
            ),
            (
                format!("requested (× {})", self.gpu_memory_utilization),
                format!("{} GiB", gib(self.requested_bytes)),
                Some(self.requested_source),
            ),
            (
                "weights".into(),
                format!("{} GiB", gib(self.weights_bytes)),
                Some(self.weights_source),
            ),
            (
                "activation peak".into(),
                format!("{} GiB", gib(self.activation_peak_bytes)),
                Some(self.activation_peak_source),
            ),
            (
                "non-torch".into(),
                format!("{} GiB", gib(self.non_torch_bytes)),
                Some(self.non_torch_source),
            ),
            (
                "non-KV total".into(),
                format!("{} GiB", gib(self.non_kv_bytes)),
                Some(Source::Derived),
            ),
            (
                "available KV cache".into(),
                format!("{} GiB", gib(avail)),
                Some(self.available_kv_source),
            ),
            (
                "KV page per layer".into(),
                format!("{} B", thousands(self.page_size_bytes)),
                Some(Source::Derived),
            ),
            (
                "KV blocks (incl. null)".into(),
                thousands(self.num_gpu_blocks),
                Some(Source::Derived),
            ),
            (
                "KV cache tokens".into(),
                thousands(self.kv_cache_tokens),
                Some(Source::Derived),
            ),
            (
                "max concurrency".into(),
                format!("{:.2}x", self.max_concurrency),
                Some(Source::Derived),
            ),
            (
                "KV needed for max_model_len".into(),
                format!("{} GiB", gib(self.needed_kv_bytes)),
                Some(Source::Derived),
            ),
            (
                "max tokens per image".into(),
                thousands(self.max_tokens_per_image as u64),
                Some(Source::Derived),
            ),
            (
                "encoder budget".into(),
                format!("{} tokens", thousands(self.encoder_budget_tokens as u64)),
                Some(Source::Derived),
            ),
            (
                "encoder profile items".into(),
                self.encoder_profile_items.to_string(),
                Some(Source::Derived),
            ),
            (
                "encoder cache when full".into(),
                format!("{} GiB", gib(self.encoder_cache_bytes)),
                Some(Source::Derived),
            ),
            (
                "processor cache (host)".into(),
                format!("{} GiB", gib(self.processor_cache_bytes)),
                Some(Source::Given),
            ),
        ];
        if let Some(h) = &self.hybrid {
            // After the KV page row: what a Gated DeltaNet layer keeps per request instead.
            let at = rows
                .iter()
                .position(|r| r.0 == "KV page per layer")
                .map_or(rows.len(), |i| i + 1);
            let state_rows = [
                (
                    format!(
                        "state per request and layer ({} of {} layers)",
                        h.state_layers,
                        h.state_layers + h.attention_layers
                    ),
                    format!("{} B", thousands(h.state_bytes())),
                    Some(Source::Derived),
                ),
                (
                    "state per request, all layers".into(),
                    format!(
                        "{} MiB",
                        format_args!(
                            "{:.1}",
                            (h.state_layers as u64 * h.state_bytes()) as f64 / (1u64 << 20) as f64
                        )
                    ),
                    Some(Source::Derived),
                ),
                (
                    "KV cache groups × layers".into(),
                    format!("{} × {}", h.groups, h.layers_per_group),
                    Some(Source::Derived),
                ),
            ];
            rows.splice(at..at, state_rows);
        }
        if let Some(w) = self.estimated_max_model_len {
            rows.push((
                "estimated max model len".into(),
                thousands(w as u64),
                Some(Source::Derived),
            ));
        }
        rows
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::config::bundled_config;
    use crate::memory::device::{device_preset, gib_to_bytes};

    fn request(model: &str, device: &str) -> PlanRequest {
        PlanRequest::new(model, bundled_config(model).unwrap(), device_preset(device).unwrap())
    }

    #[test]
    fn qwen3_vl_8b_on_ascend_reproduces_the_log() {
        let mut r = request("Qwen3-VL-8B-Instruct", "ascend-910b-64g");
        r.tensor_parallel_size = 2;
        r.block_size = Some(128);
        r.gpu_memory_utilization = 0.95;
        r.weights_bytes = Some(gib_to_bytes(9.19));
        r.activation_peak_bytes = Some(gib_to_bytes(3.86));
        r.non_torch_bytes = Some(gib_to_bytes(0.56));
        let p = plan(&r).unwrap();
        assert_eq!(gib(p.requested_bytes), "57.91");
        assert_eq!(gib(p.available_kv_bytes as u64), "44.30");
        assert_eq!(p.page_size_bytes, 262_144);
        assert_eq!(p.num_gpu_blocks, 5_040);
        assert_eq!(p.kv_cache_tokens, 645_120);
        let lines = p.vllm_log_lines();
        assert!(
            lines.contains(&"GPU KV cache size: 645,120 tokens".to_string()),
            "{lines:?}"
        );
        assert!(
            lines.contains(&"Maximum concurrency for 262,144 tokens per request: 2.46x".to_string()),
            "{lines:?}"
        );
    }

    #[test]
    fn qwen3_5_27b_plans_states_and_kv_as_vllm_0_17() {
        // 40 GiB for the cache on one H100, 262,144 tokens: 784-token blocks of 16 attention
        // layers' pages (3,211,264 B each); 48 Gated DeltaNet layers dealt into 3 state groups.
        let mut r = request("Qwen3.5-27B", "h100-80g");
        r.kv_cache_memory_bytes = Some(40 << 30);
        let p = plan(&r).unwrap();
        assert_eq!((p.block_size, p.page_size_bytes, p.num_layers), (784, 3_211_264, 16));
        assert_eq!(p.num_gpu_blocks, 835);
        assert_eq!(p.kv_bytes_per_token, 16 * 4096);
        let h = p.hybrid.as_ref().unwrap();
        assert_eq!((h.groups, h.state_groups(), h.state_bytes()), (4, 3, 3_207_168));
        // One request: 335 blocks in each attention layer and a padded page in each state layer.
        assert_eq!(p.needed_kv_bytes, (16 * 335 + 48) * 3_211_264);
        let lines = p.vllm_log_lines();
        for want in [
            "Setting attention block size to 784 tokens to ensure that attention page size is >= mamba page size.",
            "Padding mamba page size by 0.13% to ensure that mamba page size and attention page size are exactly equal.",
            "GPU KV cache size: 163,072 tokens",
            "Maximum concurrency for 262,144 tokens per request: 2.47x",
        ] {
            assert!(lines.iter().any(|l| l == want), "{want:?} not in {lines:?}");
        }
        // Too little memory for one request: the estimate leaves room for the states.
        r.kv_cache_memory_bytes = Some(8 << 30);
        let p = plan(&r).unwrap();
        let blocks = ((8u64 << 30) - 48 * 3_211_264) / (16 * 3_211_264);
        assert_eq!(p.estimated_max_model_len, Some(blocks as usize * 784));
    }

    #[test]
    fn qwen3_vl_32b_does_not_fit_262144() {
        let mut r = request("Qwen3-VL-32B-Instruct", "ascend-910b-64g");
        r.tensor_parallel_size = 2;
        r.block_size = Some(128);
        r.kv_cache_memory_bytes = Some(gib_to_bytes(20.06));
        r.max_model_len = Some(262_144);
        let p = plan(&r).unwrap();
        assert!(!p.fits);
        assert_eq!(gib(p.needed_kv_bytes), "32.00");
        assert_eq!(p.estimated_max_model_len, Some(164_224));
        let err = p.error.clone().unwrap();
        assert!(
            err.contains("(32.00 GiB KV cache is needed") && err.contains("(20.06 GiB)") && err.contains("is 164224."),
            "{err}"
        );
        r.max_model_len = Some(160_000);
        let p = plan(&r).unwrap();
        assert!(p.fits && p.error.is_none() && p.estimated_max_model_len.is_none());
    }

    #[test]
    fn encoder_budget_follows_max_num_batched_tokens() {
        let mut r = request("Qwen3-VL-8B-Instruct", "h100-80g");
        r.max_num_batched_tokens = Some(32_768);
        r.limit_mm_per_prompt = MmLimits::parse("image=4,video=0").unwrap();
        let p = plan(&r).unwrap();
        assert_eq!((p.encoder_budget_tokens, p.encoder_profile_items), (32_768, 2));
        assert_eq!(p.encoder_profile_modality, Some(Modality::Image));
        r.max_num_batched_tokens = Some(8_192);
        let p = plan(&r).unwrap();
        assert_eq!((p.encoder_budget_tokens, p.encoder_profile_items), (16_384, 1));
        // Video left at its default: Qwen3-VL's video (12,288 tokens) is smaller than an image.
        r.limit_mm_per_prompt = MmLimits::default();
        assert_eq!(plan(&r).unwrap().max_tokens_per_video, 12_288);
        assert_eq!(plan(&r).unwrap().encoder_profile_modality, Some(Modality::Image));
        r.limit_mm_per_prompt = MmLimits { image: 0, video: 0 };
        let p = plan(&r).unwrap();
        assert_eq!(
            (
                p.encoder_budget_tokens,
                p.encoder_profile_items,
                p.encoder_profile_modality
            ),
            (0, 0, None)
        );
    }

    #[test]
    fn qwen25_video_dominates_by_default() {
        let mut r = request("Qwen2.5-VL-7B-Instruct", "h100-80g");
        let p = plan(&r).unwrap();
        assert_eq!((p.max_tokens_per_video, p.encoder_budget_tokens), (114_688, 114_688));
        assert_eq!(
            (p.encoder_profile_modality, p.encoder_profile_items),
            (Some(Modality::Video), 1)
        );
        r.max_model_len = Some(32_768);
        assert_eq!(plan(&r).unwrap().max_tokens_per_video, 32_768);
    }

    #[test]
    fn max_tokens_per_image_at_shipped_defaults() {
        for name in [
            "Qwen2-VL-7B-Instruct",
            "Qwen2.5-VL-3B-Instruct",
            "Qwen3-VL-4B-Instruct",
            "Qwen3-VL-30B-A3B-Instruct",
        ] {
            let cfg = bundled_config(name).unwrap();
            assert_eq!(
                max_tokens_per_image(&cfg, ImageLimits::shipped(cfg.family)),
                16_384,
                "{name}"
            );
        }
    }

    #[test]
    fn qwen2_vl_2b_weights_estimate_is_exact() {
        let p = plan(&request("Qwen2-VL-2B-Instruct", "h100-80g")).unwrap();
        assert_eq!(p.weights_bytes, 2 * 2_208_985_600);
        assert_eq!(p.weights_source, Source::Estimated);
        // Qwen3-VL adds its deepstack buffers: 3 × mnbt × hidden × 2 bytes.
        let mut r = request("Qwen3-VL-8B-Instruct", "h100-80g");
        r.max_num_batched_tokens = Some(32_768);
        let p = plan(&r).unwrap();
        assert_eq!(p.deepstack_buffer_bytes, 3 * 32_768 * 4096 * 2);
        assert_eq!(p.weights_bytes, 2 * 8_767_123_696 + p.deepstack_buffer_bytes);
    }

    #[test]
    fn estimated_budget_is_plausible_for_the_ascend_8b_run() {
        // The log measured 3.86 GiB of activation peak and 9.19 GiB of weights; the estimates must
        // land in the same range (they are estimates, not measurements).
        let mut r = request("Qwen3-VL-8B-Instruct", "ascend-910b-64g");
        r.tensor_parallel_size = 2;
        r.max_num_batched_tokens = Some(32_768);
        r.max_num_seqs = Some(8);
        r.max_model_len = Some(65_536);
        let p = plan(&r).unwrap();
        let act = p.activation_peak_bytes as f64 / GIB;
        let w = p.weights_bytes as f64 / GIB;
        assert!((2.0..6.0).contains(&act), "activation peak {act}");
        assert!((8.5..9.5).contains(&w), "weights {w}");
    }

    #[test]
    fn bad_settings_are_errors() {
        let base = request("Qwen3-VL-8B-Instruct", "h100-80g");
        type Mutation = Box<dyn Fn(&mut PlanRequest)>;
        let cases: Vec<(Mutation, &str)> = vec![
            (Box::new(|r| r.gpu_memory_utilization = 0.0), "gpu-memory-utilization"),
            (Box::new(|r| r.gpu_memory_utilization = 1.5), "gpu-memory-utilization"),
            (
                Box::new(|r| r.tensor_parallel_size = 3),
                "divisible by tensor parallel size (3)",
            ),
            (Box::new(|r| r.tensor_parallel_size = 0), "at least 1"),
            (
                Box::new(|r| r.max_model_len = Some(300_000)),
                "greater than the derived max_model_len",
            ),
            (Box::new(|r| r.block_size = Some(0)), "--block-size"),
            (Box::new(|r| r.max_num_seqs = Some(0)), "must be positive"),
            // Found by the mm_flags fuzz target: max_pixels u64::MAX overflowed the encoder cache bytes.
            (
                Box::new(|r| r.image_limits.max_pixels = u64::MAX),
                "is more than 4294967296",
            ),
            // Found by the vllm_log fuzz target: a header's --max-num-batched-tokens 2^64 − 1
            // overflowed the deepstack buffer bytes.
            (
                Box::new(|r| r.max_num_batched_tokens = Some(usize::MAX)),
                "must be at most 2147483648",
            ),
        ];
        for (mutate, needle) in cases {
            let mut r = base.clone();
            mutate(&mut r);
            let err = plan(&r).unwrap_err().to_string();
            assert!(err.contains(needle), "{err} lacks {needle}");
        }
        for bad in ["image", "image=x", "{\"image\": -1}", "pictures=3", "", "{"] {
            assert!(MmLimits::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(
            MmLimits::parse(r#"{"image": {"count": 2, "width": 512}, "video": 0}"#).unwrap(),
            MmLimits { image: 2, video: 0 }
        );
    }

    #[test]
    fn no_memory_left_is_vllms_error() {
        let mut r = request("Qwen2.5-VL-72B-Instruct", "rtx4090-24g");
        r.max_num_seqs = Some(8);
        let p = plan(&r).unwrap();
        assert!(!p.fits && p.available_kv_bytes < 0 && p.num_gpu_blocks == 0);
        assert!(p.error.unwrap().starts_with("No available memory for the cache blocks"));
    }

    #[test]
    fn thousands_separator() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(645_120), "645,120");
        assert_eq!(thousands(1_234_567), "1,234,567");
    }
}
