//! Hugging Face `config.json` -> [`ModelConfig`] for Qwen2-VL, Qwen2.5-VL, Qwen3-VL (dense and MoE)
//! and Qwen3.5 (Gated DeltaNet layers beside gated full attention; dense and MoE).
//!
//! Both spellings seen in the wild are accepted: the published layouts (Qwen2/2.5-VL flat with
//! `rope_scaling`, Qwen3-VL nested `text_config`) and the transformers 5 layout (`rope_parameters`).
//! Fields that newer transformers omit because they equal the class defaults get the family's defaults.
//! The configs of every published size are bundled ([`bundled_config`]) so the planner works offline.

use serde_json::Value;

/// A model family: what the forward pass and the preprocessing look like.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Family {
    /// `qwen2_vl`
    Qwen2Vl,
    /// `qwen2_5_vl`
    Qwen25Vl,
    /// `qwen3_vl`
    Qwen3Vl,
    /// `qwen3_vl_moe`: Qwen3-VL with a mixture of experts in every layer.
    Qwen3VlMoe,
    /// `qwen3_5`: Qwen3-VL's vision tower before a hybrid decoder ([`LinearAttention`]).
    Qwen35,
    /// `qwen3_5_moe`: Qwen3.5 with a mixture of experts and a shared expert in every layer.
    Qwen35Moe,
}

impl Family {
    /// The `model_type` string Hugging Face uses.
    pub fn model_type(self) -> &'static str {
        match self {
            Family::Qwen2Vl => "qwen2_vl",
            Family::Qwen25Vl => "qwen2_5_vl",
            Family::Qwen3Vl => "qwen3_vl",
            Family::Qwen3VlMoe => "qwen3_vl_moe",
            Family::Qwen35 => "qwen3_5",
            Family::Qwen35Moe => "qwen3_5_moe",
        }
    }

    fn from_model_type(s: &str) -> Option<Self> {
        Some(match s {
            "qwen2_vl" => Family::Qwen2Vl,
            "qwen2_5_vl" => Family::Qwen25Vl,
            "qwen3_vl" => Family::Qwen3Vl,
            "qwen3_vl_moe" => Family::Qwen3VlMoe,
            "qwen3_5" => Family::Qwen35,
            "qwen3_5_moe" => Family::Qwen35Moe,
            _ => return None,
        })
    }

    /// Qwen3-VL, Qwen3-VL-MoE and Qwen3.5 share the vision tower, the nested checkpoint layout,
    /// interleaved M-RoPE and the per-head q/k norms.
    pub fn is_qwen3(self) -> bool {
        matches!(self, Family::Qwen3Vl | Family::Qwen3VlMoe) || self.is_qwen35()
    }

    /// Qwen3.5, dense or MoE: the hybrid decoder, zero-centred norms and gated attention.
    pub fn is_qwen35(self) -> bool {
        matches!(self, Family::Qwen35 | Family::Qwen35Moe)
    }
}

/// Where a checkpoint keeps the tensors of its two towers. The prefixes are written here once;
/// the loader accepts either layout whatever the family (see [`crate::model::weights`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CheckpointLayout {
    /// `visual.*` and `model.*`: Qwen2-VL and Qwen2.5-VL as published.
    Flat,
    /// `model.visual.*` and `model.language_model.*`: Qwen3-VL, and the module tree of newer transformers.
    Nested,
}

impl CheckpointLayout {
    /// Both layouts.
    pub const ALL: [CheckpointLayout; 2] = [CheckpointLayout::Flat, CheckpointLayout::Nested];

    /// Prefix of the vision tower's tensors.
    pub fn vision_prefix(self) -> &'static str {
        match self {
            CheckpointLayout::Flat => "visual",
            CheckpointLayout::Nested => "model.visual",
        }
    }

    /// Prefix of the language model's tensors (all but `lm_head`).
    pub fn text_prefix(self) -> &'static str {
        match self {
            CheckpointLayout::Flat => "model",
            CheckpointLayout::Nested => "model.language_model",
        }
    }
}

/// The normalisation layers of a vision tower (its blocks and mergers).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum VisionNorm {
    /// LayerNorm with weight and bias (Qwen2-VL, Qwen3-VL).
    LayerNorm,
    /// RMSNorm, weight only (Qwen2.5-VL).
    RmsNorm,
}

/// The MLP of a vision block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum VisionMlp {
    /// `fc1` → QuickGELU → `fc2` (Qwen2-VL).
    Fc,
    /// `down_proj(silu(gate_proj) · up_proj)` (Qwen2.5-VL).
    Gated,
    /// `linear_fc1` → tanh GELU → `linear_fc2` (Qwen3-VL).
    LinearFc,
}

impl VisionMlp {
    /// Projections from the tower's width up to the MLP width (2 when gated, else 1).
    pub fn up_projections(self) -> usize {
        match self {
            VisionMlp::Gated => 2,
            VisionMlp::Fc | VisionMlp::LinearFc => 1,
        }
    }
}

/// The naming of the patch merger (its shape is the same in every family).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum VisionMerger {
    /// `ln_q`, `mlp.0`, `mlp.2` (Qwen2-VL, Qwen2.5-VL).
    Sequential,
    /// `norm`, `linear_fc1`, `linear_fc2` (Qwen3-VL, also its deepstack mergers).
    LinearFc,
}

/// Element type of weights, activations or the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// 32-bit float.
    F32,
    /// 16-bit float.
    F16,
    /// bfloat16.
    Bf16,
    /// 8-bit float (KV cache only).
    Fp8,
}

impl DType {
    /// The name vLLM's `--dtype` takes.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::F16 => "float16",
            DType::Bf16 => "bfloat16",
            DType::Fp8 => "fp8",
        }
    }

    /// Bytes per element.
    pub fn size_bytes(self) -> u64 {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::Bf16 => 2,
            DType::Fp8 => 1,
        }
    }

    /// Parses the names Hugging Face configs and vLLM's `--dtype` use.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s.to_ascii_lowercase().as_str() {
            "float32" | "float" | "f32" | "fp32" => DType::F32,
            "float16" | "half" | "f16" | "fp16" => DType::F16,
            "bfloat16" | "bf16" => DType::Bf16,
            "fp8" | "fp8_e4m3" | "fp8_e5m2" | "fp8_inc" => DType::Fp8,
            _ => return None,
        })
    }
}

/// Mixture-of-experts settings of the decoder (Qwen3-VL-MoE, Qwen3.5-MoE). Every layer routes
/// each token to its `num_experts_per_tok` most probable experts and renormalises their weights.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct MoeConfig {
    /// Experts per layer.
    pub num_experts: usize,
    /// Experts used per token.
    pub num_experts_per_tok: usize,
    /// Intermediate width of one expert.
    pub moe_intermediate_size: usize,
    /// Qwen3.5-MoE's shared expert (every token, scaled by a sigmoid gate): its intermediate width.
    pub shared_expert_intermediate_size: Option<usize>,
}

/// What one decoder layer of a hybrid model computes (`layer_types`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerKind {
    /// Softmax attention over the paged KV cache.
    FullAttention,
    /// Gated DeltaNet: a causal conv1d and a gated delta-rule recurrent state per request.
    LinearAttention,
}

/// Qwen3.5's Gated DeltaNet layers (transformers' `Qwen3_5GatedDeltaNet`).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct LinearAttention {
    /// What each decoder layer is, in order.
    pub layer_types: Vec<LayerKind>,
    /// Width of the causal conv1d (`linear_conv_kernel_dim`).
    pub conv_kernel: usize,
    /// Query/key heads (`linear_num_key_heads`).
    pub num_key_heads: usize,
    /// Value heads (`linear_num_value_heads`), a multiple of the key heads.
    pub num_value_heads: usize,
    /// Per-head query/key width (`linear_key_head_dim`).
    pub key_head_dim: usize,
    /// Per-head value width (`linear_value_head_dim`).
    pub value_head_dim: usize,
    /// The recurrent state's dtype on vLLM (`mamba_ssm_dtype`: float32 in every published
    /// Qwen3.5); None keeps it in the model's dtype, as the conv window always is.
    pub ssm_dtype: Option<DType>,
}

impl LinearAttention {
    /// Query and key width: `num_key_heads · key_head_dim`.
    pub fn key_dim(&self) -> usize {
        self.num_key_heads * self.key_head_dim
    }

    /// Value width: `num_value_heads · value_head_dim`.
    pub fn value_dim(&self) -> usize {
        self.num_value_heads * self.value_head_dim
    }

    /// Channels of the conv1d: q, k and v side by side.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }

    /// Gated DeltaNet layers.
    pub fn layers(&self) -> usize {
        self.layer_types
            .iter()
            .filter(|k| **k == LayerKind::LinearAttention)
            .count()
    }
}

/// The language model half.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct TextConfig {
    /// Hidden width `H`.
    pub hidden_size: usize,
    /// Dense MLP width `I`.
    pub intermediate_size: usize,
    /// Decoder layers `L`.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// KV heads `Hkv`.
    pub num_key_value_heads: usize,
    /// Per-head width.
    pub head_dim: usize,
    /// Vocabulary size `V`.
    pub vocab_size: usize,
    /// Longest position the model was trained for (vLLM's default `max_model_len`).
    pub max_position_embeddings: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// M-RoPE sections over `head_dim / 2` frequencies (t, h, w).
    pub mrope_section: Vec<usize>,
    /// Qwen3-VL interleaves the sections instead of chunking them.
    pub mrope_interleaved: bool,
    /// q/k/v projections carry biases (Qwen2 decoder).
    pub attention_bias: bool,
    /// Per-head RMSNorm on q and k (Qwen3 decoder).
    pub qk_norm: bool,
    /// Set for Qwen3-VL-MoE.
    pub moe: Option<MoeConfig>,
    /// Rotated width of each head (`head_dim · partial_rotary_factor`; Qwen3.5 rotates a quarter).
    pub rotary_dim: usize,
    /// Qwen3.5's Gated DeltaNet layers; None where every layer is full attention.
    pub linear: Option<LinearAttention>,
}

impl TextConfig {
    /// What decoder layer `i` computes.
    pub fn layer_kind(&self, i: usize) -> LayerKind {
        self.linear
            .as_ref()
            .and_then(|l| l.layer_types.get(i).copied())
            .unwrap_or(LayerKind::FullAttention)
    }

    /// Layers with a KV cache: all of them but the Gated DeltaNet ones.
    pub fn attention_layers(&self) -> usize {
        self.num_hidden_layers - self.linear.as_ref().map_or(0, LinearAttention::layers)
    }
}

/// Why a text model alone (no vision tower) refuses a request with images.
pub const NO_VISION_TOWER: &str =
    "this model was loaded without its vision tower (a text GGUF without its projector, --mmproj): it takes no images";

/// The vision tower half.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct VisionConfig {
    /// Blocks.
    pub depth: usize,
    /// Width `E`.
    pub hidden_size: usize,
    /// MLP width.
    pub intermediate_size: usize,
    /// Attention heads.
    pub num_heads: usize,
    /// Merger output width (= text hidden size).
    pub out_hidden_size: usize,
    /// Patch side `P` in pixels.
    pub patch_size: usize,
    /// Frames per temporal patch (2).
    pub temporal_patch_size: usize,
    /// Merge window side `m` (2).
    pub spatial_merge_size: usize,
    /// Input channels (3).
    pub in_channels: usize,
    /// Qwen2.5-VL attention window in pixels (112), 0 otherwise.
    pub window_size: usize,
    /// Qwen2.5-VL blocks with full attention.
    pub fullatt_block_indexes: Vec<usize>,
    /// Qwen3-VL blocks whose outputs feed the deepstack mergers.
    pub deepstack_visual_indexes: Vec<usize>,
    /// Rows of the learned position table (Qwen3-VL: 2304 = 48²); 0 for towers without one.
    pub num_position_embeddings: usize,
    /// Qwen2.5-VL video time scale.
    pub tokens_per_second: usize,
    /// Normalisation of blocks and mergers.
    pub norm: VisionNorm,
    /// MLP of each block.
    pub mlp: VisionMlp,
    /// Naming of the patch merger.
    pub merger: VisionMerger,
    /// The patch embedding has a bias (Qwen3-VL).
    pub patch_bias: bool,
}

/// Special token ids the model needs.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct TokenIds {
    /// `<|image_pad|>`
    pub image: u32,
    /// `<|video_pad|>`
    pub video: u32,
    /// `<|vision_start|>`
    pub vision_start: u32,
    /// `<|vision_end|>`
    pub vision_end: u32,
    /// End-of-sequence ids from the config.
    pub eos: Vec<u32>,
}

/// A parsed Qwen-VL `config.json`.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ModelConfig {
    /// Which family.
    pub family: Family,
    /// Where its checkpoint keeps each tower's tensors.
    pub layout: CheckpointLayout,
    /// Language model settings.
    pub text: TextConfig,
    /// Vision tower settings; None for a text model alone (a text GGUF given without its
    /// projector, `"vision_config": null`), which refuses images as vLLM does with
    /// `--limit-mm-per-prompt '{"image": 0}'`.
    pub vision: Option<VisionConfig>,
    /// `lm_head` shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// Checkpoint dtype (`torch_dtype` / `dtype`).
    pub dtype: DType,
    /// Special tokens.
    pub tokens: TokenIds,
}

/// Why a config could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// Not JSON.
    #[error("config.json is not valid JSON: {0}")]
    Json(#[from] serde_json::Error),
    /// A model type kvlens does not know.
    #[error("model_type {0:?} is not a Qwen-VL model (expected qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_vl_moe, qwen3_5 or qwen3_5_moe)")]
    UnknownModelType(String),
    /// A required field is missing or has the wrong type.
    #[error("config.json: field {0} is missing or not a {1}")]
    Field(String, &'static str),
    /// Values that cannot describe a working model.
    #[error("config.json: {0}")]
    Invalid(String),
    /// A `--mm-processor-kwargs` value that cannot be applied.
    #[error("invalid --mm-processor-kwargs: {0}")]
    ProcessorKwargs(String),
    /// An unknown bundled model name.
    #[error("unknown model {name:?}; known models: {known}")]
    UnknownModel {
        /// What was asked for.
        name: String,
        /// Comma-separated bundled names.
        known: String,
    },
}

/// Bundled `config.json` of every published Qwen-VL size: (name, JSON text).
pub const BUNDLED_CONFIGS: &[(&str, &str)] = &[
    (
        "Qwen2-VL-2B-Instruct",
        include_str!("../../configs/Qwen2-VL-2B-Instruct.json"),
    ),
    (
        "Qwen2-VL-7B-Instruct",
        include_str!("../../configs/Qwen2-VL-7B-Instruct.json"),
    ),
    (
        "Qwen2-VL-72B-Instruct",
        include_str!("../../configs/Qwen2-VL-72B-Instruct.json"),
    ),
    (
        "Qwen2.5-VL-3B-Instruct",
        include_str!("../../configs/Qwen2.5-VL-3B-Instruct.json"),
    ),
    (
        "Qwen2.5-VL-7B-Instruct",
        include_str!("../../configs/Qwen2.5-VL-7B-Instruct.json"),
    ),
    (
        "Qwen2.5-VL-32B-Instruct",
        include_str!("../../configs/Qwen2.5-VL-32B-Instruct.json"),
    ),
    (
        "Qwen2.5-VL-72B-Instruct",
        include_str!("../../configs/Qwen2.5-VL-72B-Instruct.json"),
    ),
    (
        "Qwen3-VL-2B-Instruct",
        include_str!("../../configs/Qwen3-VL-2B-Instruct.json"),
    ),
    (
        "Qwen3-VL-4B-Instruct",
        include_str!("../../configs/Qwen3-VL-4B-Instruct.json"),
    ),
    (
        "Qwen3-VL-8B-Instruct",
        include_str!("../../configs/Qwen3-VL-8B-Instruct.json"),
    ),
    (
        "Qwen3-VL-32B-Instruct",
        include_str!("../../configs/Qwen3-VL-32B-Instruct.json"),
    ),
    (
        "Qwen3-VL-30B-A3B-Instruct",
        include_str!("../../configs/Qwen3-VL-30B-A3B-Instruct.json"),
    ),
    (
        "Qwen3-VL-235B-A22B-Instruct",
        include_str!("../../configs/Qwen3-VL-235B-A22B-Instruct.json"),
    ),
    // 0.8B and 2B as published; 4B, 9B and 27B rebuilt from their published per-size values on
    // the 0.8B file's template (engine/configs/README.md).
    ("Qwen3.5-0.8B", include_str!("../../configs/Qwen3.5-0.8B.json")),
    ("Qwen3.5-2B", include_str!("../../configs/Qwen3.5-2B.json")),
    ("Qwen3.5-4B", include_str!("../../configs/Qwen3.5-4B.json")),
    ("Qwen3.5-9B", include_str!("../../configs/Qwen3.5-9B.json")),
    ("Qwen3.5-27B", include_str!("../../configs/Qwen3.5-27B.json")),
    // The mixtures of experts, rebuilt the same way.
    ("Qwen3.5-35B-A3B", include_str!("../../configs/Qwen3.5-35B-A3B.json")),
    (
        "Qwen3.5-122B-A10B",
        include_str!("../../configs/Qwen3.5-122B-A10B.json"),
    ),
    (
        "Qwen3.5-397B-A17B",
        include_str!("../../configs/Qwen3.5-397B-A17B.json"),
    ),
];

/// Looks up a bundled config by name, case-insensitively, with or without the `Qwen/` prefix.
pub fn bundled_config(name: &str) -> Result<ModelConfig, ConfigError> {
    let wanted = name.rsplit('/').next().unwrap_or(name);
    match BUNDLED_CONFIGS.iter().find(|(n, _)| n.eq_ignore_ascii_case(wanted)) {
        Some((_, json)) => ModelConfig::from_json(json),
        None => Err(ConfigError::UnknownModel {
            name: name.to_string(),
            known: BUNDLED_CONFIGS.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", "),
        }),
    }
}

/// Reads fields from one JSON object, falling back to a second one (the top level).
struct Fields<'a> {
    primary: &'a Value,
    fallback: &'a Value,
    prefix: &'static str,
}

impl Fields<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.primary
            .get(key)
            .filter(|v| !v.is_null())
            .or_else(|| self.fallback.get(key).filter(|v| !v.is_null()))
    }

    fn opt_usize(&self, key: &str) -> Result<Option<usize>, ConfigError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .map(Some)
                .ok_or_else(|| ConfigError::Field(format!("{}{key}", self.prefix), "non-negative integer")),
        }
    }

    fn usize(&self, key: &str) -> Result<usize, ConfigError> {
        self.opt_usize(key)?
            .ok_or_else(|| ConfigError::Field(format!("{}{key}", self.prefix), "non-negative integer"))
    }

    fn usize_or(&self, key: &str, default: usize) -> Result<usize, ConfigError> {
        Ok(self.opt_usize(key)?.unwrap_or(default))
    }

    fn f64_or(&self, key: &str, default: f64) -> Result<f64, ConfigError> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_f64()
                .ok_or_else(|| ConfigError::Field(format!("{}{key}", self.prefix), "number")),
        }
    }

    fn bool_or(&self, key: &str, default: bool) -> Result<bool, ConfigError> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| ConfigError::Field(format!("{}{key}", self.prefix), "boolean")),
        }
    }

    fn usize_list_or(&self, key: &str, default: &[usize]) -> Result<Vec<usize>, ConfigError> {
        match self.get(key) {
            None => Ok(default.to_vec()),
            Some(v) => {
                usize_list(v).ok_or_else(|| ConfigError::Field(format!("{}{key}", self.prefix), "list of integers"))
            }
        }
    }
}

fn usize_list(v: &Value) -> Option<Vec<usize>> {
    v.as_array()?
        .iter()
        .map(|x| x.as_u64().and_then(|n| usize::try_from(n).ok()))
        .collect()
}

fn token_ids(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n.as_u64().and_then(|n| u32::try_from(n).ok()).into_iter().collect(),
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(|x| x.as_u64().and_then(|n| u32::try_from(n).ok()))
            .collect(),
        _ => Vec::new(),
    }
}

impl VisionConfig {
    /// Values per patch row of `pixel_values`: `C · T · P · P`.
    pub fn patch_dim(&self) -> usize {
        self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size
    }

    /// Output width per image token as the encoder cache stores it (Qwen3-VL concatenates the
    /// main merger with its deepstack mergers).
    pub fn output_dim(&self) -> usize {
        self.out_hidden_size * (1 + self.deepstack_visual_indexes.len())
    }

    /// Pixels per LLM token side: `patch_size × spatial_merge_size` (28 or 32).
    pub fn image_factor(&self) -> usize {
        self.patch_size * self.spatial_merge_size
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let v = self;
        must_be_positive(&[
            ("vision depth", v.depth),
            ("vision hidden_size", v.hidden_size),
            ("vision num_heads", v.num_heads),
            ("patch_size", v.patch_size),
            ("spatial_merge_size", v.spatial_merge_size),
            ("temporal_patch_size", v.temporal_patch_size),
        ])?;
        if !v.hidden_size.is_multiple_of(v.num_heads) {
            return Err(ConfigError::Invalid(format!(
                "vision hidden_size ({}) is not a multiple of num_heads ({})",
                v.hidden_size, v.num_heads
            )));
        }
        // What the preprocessing and the encoder derive from the vision sizes must be representable:
        // the pixels per token side squared, the values per patch row and the encoder output width.
        let derived: [(&str, &[usize]); 3] = [
            (
                "(patch_size × spatial_merge_size)²",
                &[v.patch_size, v.spatial_merge_size, v.patch_size, v.spatial_merge_size],
            ),
            (
                "values per patch",
                &[v.in_channels.max(3), v.temporal_patch_size, v.patch_size, v.patch_size],
            ),
            (
                "encoder output width",
                &[v.out_hidden_size, 1 + v.deepstack_visual_indexes.len()],
            ),
        ];
        for (what, factors) in derived {
            if factors
                .iter()
                .try_fold(1usize, |product, &f| product.checked_mul(f))
                .is_none()
            {
                return Err(ConfigError::Invalid(format!(
                    "vision sizes too large: {what} overflows"
                )));
            }
        }
        Ok(())
    }
}

fn must_be_positive(sizes: &[(&str, usize)]) -> Result<(), ConfigError> {
    match sizes.iter().find(|(_, n)| *n == 0) {
        Some((name, _)) => Err(ConfigError::Invalid(format!("{name} must be positive"))),
        None => Ok(()),
    }
}

impl ModelConfig {
    /// Parses the text of a `config.json`.
    pub fn from_json(text: &str) -> Result<Self, ConfigError> {
        let root: Value = serde_json::from_str(text)?;
        Self::from_value(&root)
    }

    /// Parses an already decoded `config.json`.
    pub fn from_value(root: &Value) -> Result<Self, ConfigError> {
        let model_type = root
            .get("model_type")
            .and_then(Value::as_str)
            .ok_or_else(|| ConfigError::Field("model_type".into(), "string"))?;
        let family =
            Family::from_model_type(model_type).ok_or_else(|| ConfigError::UnknownModelType(model_type.to_string()))?;
        let empty = Value::Object(Default::default());
        let text_obj = root.get("text_config").unwrap_or(&empty);
        let vision_obj = root.get("vision_config").unwrap_or(&empty);
        let t = Fields {
            primary: text_obj,
            fallback: root,
            prefix: "text_config.",
        };
        let text = parse_text(family, &t)?;
        let v = Fields {
            primary: vision_obj,
            fallback: &empty,
            prefix: "vision_config.",
        };
        let vision = match vision_obj {
            Value::Null => None,
            _ => Some(parse_vision(family, &v, text.hidden_size)?),
        };
        let tie_word_embeddings = match root.get("tie_word_embeddings").and_then(Value::as_bool) {
            Some(b) => b,
            None => t.bool_or("tie_word_embeddings", false)?,
        };
        let dtype_name = ["torch_dtype", "dtype"]
            .iter()
            .find_map(|k| t.get(k).and_then(Value::as_str))
            .unwrap_or("bfloat16");
        let dtype = DType::parse(dtype_name)
            .filter(|d| *d != DType::Fp8)
            .ok_or_else(|| ConfigError::Invalid(format!("unsupported dtype {dtype_name:?}")))?;
        let id = |key: &str, default: u32| -> u32 {
            t.get(key)
                .and_then(Value::as_u64)
                .and_then(|n| u32::try_from(n).ok())
                .unwrap_or(default)
        };
        let mut eos = token_ids(t.get("eos_token_id"));
        if eos.is_empty() {
            eos.push(151645);
        }
        // Qwen3.5's tokenizer numbers its special tokens after a larger vocabulary.
        let base = if family.is_qwen35() { 248053 } else { 151652 };
        let tokens = TokenIds {
            image: id("image_token_id", base + 3),
            video: id("video_token_id", base + 4),
            vision_start: id("vision_start_token_id", base),
            vision_end: id("vision_end_token_id", base + 1),
            eos,
        };
        let layout = if family.is_qwen3() {
            CheckpointLayout::Nested
        } else {
            CheckpointLayout::Flat
        };
        let cfg = ModelConfig {
            family,
            layout,
            text,
            vision,
            tie_word_embeddings,
            dtype,
            tokens,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Output width per image token as the encoder cache stores it; 0 without a vision tower.
    pub fn encoder_output_dim(&self) -> usize {
        self.vision.as_ref().map_or(0, VisionConfig::output_dim)
    }

    /// Deepstack levels the decoder adds image features at (Qwen3-VL); 0 for the others and
    /// without a vision tower.
    pub fn deepstack_levels(&self) -> usize {
        self.vision.as_ref().map_or(0, |v| v.deepstack_visual_indexes.len())
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let t = &self.text;
        let positive = [
            ("text hidden_size", t.hidden_size),
            ("num_hidden_layers", t.num_hidden_layers),
            ("num_attention_heads", t.num_attention_heads),
            ("num_key_value_heads", t.num_key_value_heads),
            ("head_dim", t.head_dim),
            ("vocab_size", t.vocab_size),
            ("max_position_embeddings", t.max_position_embeddings),
        ];
        must_be_positive(&positive)?;
        if !t.num_attention_heads.is_multiple_of(t.num_key_value_heads) {
            return Err(ConfigError::Invalid(format!(
                "num_attention_heads ({}) is not a multiple of num_key_value_heads ({})",
                t.num_attention_heads, t.num_key_value_heads
            )));
        }
        if t.rotary_dim == 0 || !t.rotary_dim.is_multiple_of(2) || t.rotary_dim > t.head_dim {
            return Err(ConfigError::Invalid(format!(
                "the rotary width {} (head_dim × partial_rotary_factor) must be even and in 2..=head_dim ({})",
                t.rotary_dim, t.head_dim
            )));
        }
        let half = t.rotary_dim / 2;
        let sum = t.mrope_section.iter().try_fold(0usize, |sum, &s| sum.checked_add(s));
        let longest = t.mrope_section.iter().copied().max().unwrap_or(0);
        if longest > half || (sum != Some(half) && !t.mrope_interleaved) {
            return Err(ConfigError::Invalid(format!(
                "mrope_section {:?} does not sum to rotary_dim/2 = {half}",
                t.mrope_section
            )));
        }
        if let Some(l) = &t.linear {
            must_be_positive(&[
                ("linear_conv_kernel_dim", l.conv_kernel),
                ("linear_num_key_heads", l.num_key_heads),
                ("linear_num_value_heads", l.num_value_heads),
                ("linear_key_head_dim", l.key_head_dim),
                ("linear_value_head_dim", l.value_head_dim),
            ])?;
            if !l.num_value_heads.is_multiple_of(l.num_key_heads) {
                return Err(ConfigError::Invalid(format!(
                    "linear_num_value_heads ({}) is not a multiple of linear_num_key_heads ({})",
                    l.num_value_heads, l.num_key_heads
                )));
            }
        }
        self.vision.as_ref().map_or(Ok(()), VisionConfig::validate)
    }
}

/// M-RoPE settings of a decoder.
struct Rope {
    theta: f64,
    section: Vec<usize>,
    interleaved: bool,
    partial_rotary_factor: f64,
}

/// Reads the M-RoPE settings from `rope_scaling` (published) or `rope_parameters` (transformers 5).
fn rope_settings(t: &Fields<'_>, family: Family) -> Result<Rope, ConfigError> {
    let rope = t.get("rope_parameters").or_else(|| t.get("rope_scaling"));
    let (default_section, default_theta): (&[usize], f64) = match family {
        f if f.is_qwen35() => (&[11, 11, 10], 10_000_000.0),
        f if f.is_qwen3() => (&[24, 20, 20], 5_000_000.0),
        _ => (&[16, 24, 24], 1_000_000.0),
    };
    let mut r = Rope {
        theta: t.f64_or("rope_theta", default_theta)?,
        section: default_section.to_vec(),
        interleaved: family.is_qwen3(),
        partial_rotary_factor: t.f64_or("partial_rotary_factor", if family.is_qwen35() { 0.25 } else { 1.0 })?,
    };
    if let Some(p) = rope {
        if let Some(th) = p.get("rope_theta").and_then(Value::as_f64) {
            r.theta = th;
        }
        if let Some(s) = p.get("mrope_section") {
            r.section =
                usize_list(s).ok_or_else(|| ConfigError::Field("rope mrope_section".into(), "list of integers"))?;
        }
        if let Some(b) = p.get("mrope_interleaved").and_then(Value::as_bool) {
            r.interleaved = b;
        }
        if let Some(f) = p.get("partial_rotary_factor").and_then(Value::as_f64) {
            r.partial_rotary_factor = f;
        }
    }
    Ok(r)
}

/// Qwen3.5's `layer_types` (or, without them, every `full_attention_interval`-th layer full
/// attention, as transformers fills them in) and Gated DeltaNet sizes.
fn linear_attention(t: &Fields<'_>, layers: usize) -> Result<LinearAttention, ConfigError> {
    let layer_types = match t.get("layer_types") {
        Some(Value::Array(kinds)) => kinds
            .iter()
            .map(|k| match k.as_str() {
                Some("full_attention") => Ok(LayerKind::FullAttention),
                Some("linear_attention") => Ok(LayerKind::LinearAttention),
                _ => Err(ConfigError::Field(
                    "text_config.layer_types".into(),
                    "list of \"full_attention\" / \"linear_attention\"",
                )),
            })
            .collect::<Result<Vec<_>, _>>()?,
        Some(_) => return Err(ConfigError::Field("text_config.layer_types".into(), "list of strings")),
        None => {
            let interval = t.usize_or("full_attention_interval", 4)?.max(1);
            (0..layers)
                .map(|i| match (i + 1) % interval {
                    0 => LayerKind::FullAttention,
                    _ => LayerKind::LinearAttention,
                })
                .collect()
        }
    };
    if layer_types.len() != layers {
        return Err(ConfigError::Invalid(format!(
            "layer_types lists {} layers, num_hidden_layers is {layers}",
            layer_types.len()
        )));
    }
    Ok(LinearAttention {
        layer_types,
        conv_kernel: t.usize_or("linear_conv_kernel_dim", 4)?,
        num_key_heads: t.usize_or("linear_num_key_heads", 16)?,
        num_value_heads: t.usize_or("linear_num_value_heads", 32)?,
        key_head_dim: t.usize_or("linear_key_head_dim", 128)?,
        value_head_dim: t.usize_or("linear_value_head_dim", 128)?,
        ssm_dtype: t.get("mamba_ssm_dtype").and_then(Value::as_str).and_then(DType::parse),
    })
}

fn parse_text(family: Family, t: &Fields<'_>) -> Result<TextConfig, ConfigError> {
    let hidden_size = t.usize("hidden_size")?;
    let num_attention_heads = t.usize("num_attention_heads")?;
    let num_key_value_heads = t.usize_or("num_key_value_heads", num_attention_heads)?;
    let head_dim = match t.opt_usize("head_dim")? {
        Some(d) => d,
        None if num_attention_heads > 0 => hidden_size / num_attention_heads,
        None => 0,
    };
    let rope = rope_settings(t, family)?;
    if !(rope.partial_rotary_factor > 0.0 && rope.partial_rotary_factor <= 1.0) {
        return Err(ConfigError::Invalid(format!(
            "partial_rotary_factor {} is not in (0, 1]",
            rope.partial_rotary_factor
        )));
    }
    let moe = match family {
        Family::Qwen3VlMoe | Family::Qwen35Moe => {
            let m = MoeConfig {
                num_experts: t.usize("num_experts")?,
                num_experts_per_tok: t.usize("num_experts_per_tok")?,
                moe_intermediate_size: t.usize("moe_intermediate_size")?,
                shared_expert_intermediate_size: match family {
                    Family::Qwen35Moe => Some(t.usize("shared_expert_intermediate_size")?),
                    _ => None,
                },
            };
            // Qwen3-VL-MoE can keep dense MLPs in some layers; every published size routes all.
            let sparse_step = t.usize_or("decoder_sparse_step", 1)?;
            let dense_layers = t.usize_list_or("mlp_only_layers", &[])?;
            if sparse_step != 1 || !dense_layers.is_empty() {
                return Err(ConfigError::Invalid(format!(
                    "decoder_sparse_step {sparse_step} and mlp_only_layers {dense_layers:?}: kvlens reads models \
                     whose every layer is a mixture of experts (decoder_sparse_step 1, no mlp_only_layers)"
                )));
            }
            if m.num_experts_per_tok == 0 || m.num_experts_per_tok > m.num_experts {
                return Err(ConfigError::Invalid(format!(
                    "num_experts_per_tok {} is not in 1..={}",
                    m.num_experts_per_tok, m.num_experts
                )));
            }
            Some(m)
        }
        _ => None,
    };
    let num_hidden_layers = t.usize("num_hidden_layers")?;
    let linear = match family {
        Family::Qwen35 | Family::Qwen35Moe => Some(linear_attention(t, num_hidden_layers)?),
        _ => None,
    };
    Ok(TextConfig {
        hidden_size,
        // Qwen3.5-MoE has no dense MLP, and its config no `intermediate_size`.
        intermediate_size: match family {
            Family::Qwen35Moe => t.usize_or("intermediate_size", 0)?,
            _ => t.usize("intermediate_size")?,
        },
        num_hidden_layers,
        num_attention_heads,
        num_key_value_heads,
        head_dim,
        vocab_size: t.usize("vocab_size")?,
        max_position_embeddings: t.usize("max_position_embeddings")?,
        rms_norm_eps: t.f64_or("rms_norm_eps", 1e-6)?,
        rope_theta: rope.theta,
        mrope_section: rope.section,
        mrope_interleaved: rope.interleaved,
        attention_bias: t.bool_or("attention_bias", !family.is_qwen3())?,
        qk_norm: family.is_qwen3(),
        moe,
        // transformers: `int(head_dim * partial_rotary_factor)`.
        rotary_dim: (head_dim as f64 * rope.partial_rotary_factor) as usize,
        linear,
    })
}

fn parse_vision(family: Family, v: &Fields<'_>, text_hidden: usize) -> Result<VisionConfig, ConfigError> {
    Ok(match family {
        Family::Qwen2Vl => {
            let embed_dim = v.usize_or("embed_dim", 1280)?;
            VisionConfig {
                depth: v.usize_or("depth", 32)?,
                hidden_size: embed_dim,
                intermediate_size: embed_dim * v.usize_or("mlp_ratio", 4)?,
                num_heads: v.usize_or("num_heads", 16)?,
                // Qwen2-VL stores the merger output width as vision_config.hidden_size.
                out_hidden_size: v.usize_or("hidden_size", text_hidden)?,
                patch_size: v.usize_or("patch_size", 14)?,
                temporal_patch_size: v.usize_or("temporal_patch_size", 2)?,
                spatial_merge_size: v.usize_or("spatial_merge_size", 2)?,
                in_channels: v.usize_or("in_chans", 3)?,
                window_size: 0,
                fullatt_block_indexes: Vec::new(),
                deepstack_visual_indexes: Vec::new(),
                num_position_embeddings: 0,
                tokens_per_second: 0,
                norm: VisionNorm::LayerNorm,
                mlp: VisionMlp::Fc,
                merger: VisionMerger::Sequential,
                patch_bias: false,
            }
        }
        Family::Qwen25Vl => VisionConfig {
            depth: v.usize_or("depth", 32)?,
            hidden_size: v.usize_or("hidden_size", 1280)?,
            intermediate_size: v.usize_or("intermediate_size", 3420)?,
            num_heads: v.usize_or("num_heads", 16)?,
            out_hidden_size: v.usize_or("out_hidden_size", text_hidden)?,
            patch_size: v.usize_or("patch_size", 14)?,
            temporal_patch_size: v.usize_or("temporal_patch_size", 2)?,
            spatial_merge_size: v.usize_or("spatial_merge_size", 2)?,
            in_channels: v.usize_or("in_chans", v.usize_or("in_channels", 3)?)?,
            window_size: v.usize_or("window_size", 112)?,
            fullatt_block_indexes: v.usize_list_or("fullatt_block_indexes", &[7, 15, 23, 31])?,
            deepstack_visual_indexes: Vec::new(),
            num_position_embeddings: 0,
            tokens_per_second: v.usize_or("tokens_per_second", 2)?,
            norm: VisionNorm::RmsNorm,
            mlp: VisionMlp::Gated,
            merger: VisionMerger::Sequential,
            patch_bias: false,
        },
        Family::Qwen3Vl | Family::Qwen3VlMoe | Family::Qwen35 | Family::Qwen35Moe => VisionConfig {
            depth: v.usize_or("depth", 27)?,
            hidden_size: v.usize_or("hidden_size", 1152)?,
            intermediate_size: v.usize_or("intermediate_size", 4304)?,
            num_heads: v.usize_or("num_heads", 16)?,
            out_hidden_size: v.usize_or("out_hidden_size", text_hidden)?,
            patch_size: v.usize_or("patch_size", 16)?,
            temporal_patch_size: v.usize_or("temporal_patch_size", 2)?,
            spatial_merge_size: v.usize_or("spatial_merge_size", 2)?,
            in_channels: v.usize_or("in_channels", 3)?,
            window_size: 0,
            fullatt_block_indexes: Vec::new(),
            // Qwen3.5's tower has no deepstack mergers.
            deepstack_visual_indexes: match family {
                f if f.is_qwen35() => Vec::new(),
                _ => v.usize_list_or("deepstack_visual_indexes", &[8, 16, 24])?,
            },
            num_position_embeddings: v.usize_or("num_position_embeddings", 2304)?,
            tokens_per_second: 0,
            norm: VisionNorm::LayerNorm,
            mlp: VisionMlp::LinearFc,
            merger: VisionMerger::LinearFc,
            patch_bias: true,
        },
    })
}

/// Image preprocessing limits from `preprocessor_config.json`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct ImageLimits {
    /// Smallest resized area in pixels (`min_pixels` / `size.shortest_edge`).
    pub min_pixels: u64,
    /// Largest resized area in pixels (`max_pixels` / `size.longest_edge`).
    pub max_pixels: u64,
}

impl ImageLimits {
    /// The shipped `preprocessor_config.json` values of each family.
    pub fn shipped(family: Family) -> Self {
        if family.is_qwen3() {
            ImageLimits {
                min_pixels: 65_536,
                max_pixels: 16_777_216,
            }
        } else {
            ImageLimits {
                min_pixels: 3_136,
                max_pixels: 12_845_056,
            }
        }
    }

    /// Reads `preprocessor_config.json` (old `min_pixels`/`max_pixels` or new `size.shortest_edge`/`longest_edge`);
    /// missing values keep the family's shipped defaults.
    pub fn from_preprocessor_json(text: &str, family: Family) -> Result<Self, ConfigError> {
        let root: Value = serde_json::from_str(text)?;
        Self::shipped(family)
            .overridden_by(&root)
            .map_err(|why| ConfigError::Invalid(format!("preprocessor_config.json: {why}")))
    }

    /// The largest resized area kvlens accepts: 2^32 pixels (65 536 × 65 536), three orders of
    /// magnitude above the shipped bounds, so that token and byte counts derived from it fit.
    pub const MAX_PIXELS: u64 = 1 << 32;

    /// Refuses bounds that cannot hold an image, or exceed [`ImageLimits::MAX_PIXELS`].
    pub fn check(&self) -> Result<(), String> {
        if self.min_pixels > self.max_pixels || self.max_pixels == 0 {
            return Err(format!(
                "min_pixels {} must not exceed max_pixels {}",
                self.min_pixels, self.max_pixels
            ));
        }
        if self.max_pixels > Self::MAX_PIXELS {
            return Err(format!(
                "max_pixels {} is more than {} (65536 x 65536)",
                self.max_pixels,
                Self::MAX_PIXELS
            ));
        }
        Ok(())
    }

    /// These limits with the values a processor JSON object sets (`min_pixels` / `max_pixels`, or
    /// `size.shortest_edge` / `size.longest_edge`), checked (see [`ImageLimits::check`]).
    pub fn overridden_by(mut self, root: &Value) -> Result<Self, String> {
        let size = root.get("size");
        let pick = |old: &str, new: &str| -> Option<u64> {
            root.get(old)
                .and_then(Value::as_u64)
                .or_else(|| size.and_then(|s| s.get(new)).and_then(Value::as_u64))
        };
        if let Some(v) = pick("min_pixels", "shortest_edge") {
            self.min_pixels = v;
        }
        if let Some(v) = pick("max_pixels", "longest_edge") {
            self.max_pixels = v;
        }
        self.check()?;
        Ok(self)
    }
}

/// `--mm-processor-kwargs` as kvlens reads it: a JSON object whose pixel bounds (`min_pixels` /
/// `max_pixels`, or `size.shortest_edge` / `size.longest_edge`) replace a checkpoint's.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ProcessorKwargs {
    overrides: Value,
    /// Keys kvlens does not read, as given (the caller reports them as ignored).
    pub ignored: Vec<String>,
}

impl ProcessorKwargs {
    /// Parses the flag's value: a JSON object whose pixel bounds, when given, are non-negative integers.
    pub fn parse(json: &str) -> Result<Self, ConfigError> {
        let invalid = |why: String| ConfigError::ProcessorKwargs(why);
        let overrides: Value = serde_json::from_str(json).map_err(|e| invalid(format!("not JSON ({e})")))?;
        let obj = overrides
            .as_object()
            .ok_or_else(|| invalid("it must be a JSON object".into()))?;
        let ignored = obj
            .keys()
            .filter(|key| !matches!(key.as_str(), "min_pixels" | "max_pixels" | "size"))
            .cloned()
            .collect();
        let size = obj.get("size");
        for (key, edge) in [("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")] {
            let given = obj.get(key).or_else(|| size.and_then(|s| s.get(edge)));
            if given.is_some_and(|x| x.as_u64().is_none()) {
                return Err(invalid(format!("{key} must be a positive integer")));
            }
        }
        Ok(ProcessorKwargs { overrides, ignored })
    }

    /// `limits` with these overrides (unchanged for the default, empty kwargs).
    pub fn apply(&self, limits: ImageLimits) -> Result<ImageLimits, ConfigError> {
        if self.overrides.is_null() {
            return Ok(limits);
        }
        limits
            .overridden_by(&self.overrides)
            .map_err(ConfigError::ProcessorKwargs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_bundled_config_parses() {
        for (name, _) in BUNDLED_CONFIGS {
            let cfg = bundled_config(name).unwrap_or_else(|e| panic!("{name}: {e}"));
            let head_dim = if cfg.family.is_qwen35() { 256 } else { 128 };
            assert_eq!(cfg.text.head_dim, head_dim, "{name}");
            assert_eq!(cfg.dtype, DType::Bf16, "{name}");
        }
    }

    #[test]
    fn family_specific_fields() {
        let q2 = bundled_config("Qwen2-VL-2B-Instruct").unwrap();
        let v2 = q2.vision.as_ref().unwrap();
        assert_eq!(v2.hidden_size, 1280);
        assert_eq!(v2.out_hidden_size, 1536);
        assert_eq!(v2.intermediate_size, 5120);
        assert!(q2.tie_word_embeddings && q2.text.attention_bias);
        let q3 = bundled_config("qwen/qwen3-vl-8b-instruct").unwrap();
        assert_eq!(q3.family, Family::Qwen3Vl);
        let v3 = q3.vision.as_ref().unwrap();
        assert_eq!(v3.deepstack_visual_indexes, vec![8, 16, 24]);
        assert_eq!(v3.output_dim(), 4096 * 4);
        assert_eq!(q3.text.rope_theta, 5_000_000.0);
        assert!(q3.text.mrope_interleaved && q3.text.qk_norm && !q3.text.attention_bias);
        let moe = bundled_config("Qwen3-VL-30B-A3B-Instruct").unwrap();
        assert_eq!(moe.text.moe.as_ref().map(|m| m.num_experts), Some(128));
    }

    #[test]
    fn transformers5_layout_with_rope_parameters() {
        let json = r#"{"model_type":"qwen2_5_vl","text_config":{"hidden_size":32,"intermediate_size":37,
            "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":152064,
            "max_position_embeddings":512,"dtype":"float32",
            "rope_parameters":{"rope_type":"default","rope_theta":10000.0,"mrope_section":[2,1,1]}},
            "vision_config":{"depth":2,"hidden_size":32,"intermediate_size":24,"num_heads":4,"out_hidden_size":32},
            "tie_word_embeddings":false}"#;
        let cfg = ModelConfig::from_json(json).unwrap();
        assert_eq!(cfg.text.head_dim, 8);
        assert_eq!(cfg.text.rope_theta, 10000.0);
        assert_eq!(cfg.text.mrope_section, vec![2, 1, 1]);
        assert_eq!(cfg.dtype, DType::F32);
        // Omitted vision fields take the Qwen2.5-VL family defaults.
        let v = cfg.vision.as_ref().unwrap();
        assert_eq!(v.fullatt_block_indexes, vec![7, 15, 23, 31]);
        assert_eq!(v.window_size, 112);
    }

    #[test]
    fn bad_configs_are_clear_errors() {
        let unknown = ModelConfig::from_json(r#"{"model_type":"llama"}"#)
            .unwrap_err()
            .to_string();
        assert!(unknown.contains("llama") && unknown.contains("qwen2_vl"), "{unknown}");
        let missing = ModelConfig::from_json(r#"{"model_type":"qwen2_vl","hidden_size":32}"#)
            .unwrap_err()
            .to_string();
        assert!(missing.contains("num_attention_heads"), "{missing}");
        assert!(ModelConfig::from_json("{not json").is_err());
        let err = bundled_config("Qwen9-VL").unwrap_err().to_string();
        assert!(
            err.contains("Qwen3-VL-32B-Instruct") && err.contains("Qwen9-VL"),
            "{err}"
        );
    }

    /// Found by fuzzing the config harness with large numbers: the mrope sum and the vision size
    /// products overflowed (a panic in debug builds).
    #[test]
    fn sizes_whose_products_overflow_are_refused() {
        let tiny: Value =
            serde_json::from_str(include_str!("../../../tools/golden/configs/qwen3_vl_tiny.json")).unwrap();
        let with = |pointer: &str, value: Value| {
            let mut cfg = tiny.clone();
            let (parent, key) = pointer.rsplit_once('/').unwrap();
            let obj = if parent.is_empty() {
                &mut cfg
            } else {
                cfg.pointer_mut(parent).unwrap()
            };
            obj[key] = value;
            ModelConfig::from_value(&cfg).map_err(|e| e.to_string())
        };
        assert!(with("/vision_config/patch_size", 14.into()).is_ok());
        // Interleaved sections need not sum to head_dim/2, but none may exceed it.
        let huge = serde_json::json!(u64::MAX);
        let err = with(
            "/text_config/rope_scaling/mrope_section",
            serde_json::json!([u64::MAX, 2]),
        )
        .unwrap_err();
        assert!(err.contains("does not sum to rotary_dim/2"), "{err}");
        for (pointer, value, needle) in [
            (
                "/vision_config/patch_size",
                serde_json::json!(1u64 << 40),
                "(patch_size × spatial_merge_size)²",
            ),
            (
                "/vision_config/temporal_patch_size",
                serde_json::json!(1u64 << 62),
                "values per patch",
            ),
            ("/vision_config/out_hidden_size", huge, "encoder output width"),
        ] {
            let err = with(pointer, value).unwrap_err();
            assert!(err.contains(needle), "{pointer}: {err}");
        }
    }

    #[test]
    fn processor_kwargs_override_pixel_limits_and_reject_nonsense() {
        let l = ImageLimits {
            min_pixels: 10,
            max_pixels: 100,
        };
        let apply = |json: &str| ProcessorKwargs::parse(json).and_then(|k| k.apply(l));
        assert_eq!(apply(r#"{"max_pixels": 50}"#).unwrap().max_pixels, 50);
        let both = apply(r#"{"size": {"shortest_edge": 20, "longest_edge": 40}}"#).unwrap();
        assert_eq!((both.min_pixels, both.max_pixels), (20, 40));
        assert_eq!(ProcessorKwargs::default().apply(l).unwrap(), l);
        let kwargs = ProcessorKwargs::parse(r#"{"max_pixels": 50, "do_resize": false, "fps": 2}"#).unwrap();
        assert_eq!(kwargs.ignored, ["do_resize", "fps"]);
        assert_eq!(
            apply(r#"{"min_pixels": 101}"#).unwrap_err().to_string(),
            "invalid --mm-processor-kwargs: min_pixels 101 must not exceed max_pixels 100"
        );
        assert_eq!(
            ProcessorKwargs::parse(r#"{"max_pixels": -1}"#).unwrap_err().to_string(),
            "invalid --mm-processor-kwargs: max_pixels must be a positive integer"
        );
        assert!(apply(&format!(r#"{{"max_pixels": {}}}"#, u64::MAX))
            .unwrap_err()
            .to_string()
            .contains("is more than 4294967296"));
        assert!(ProcessorKwargs::parse("[1]").is_err());
        assert!(ProcessorKwargs::parse("{max_pixels").is_err());
    }

    #[test]
    fn preprocessor_both_spellings() {
        let old =
            ImageLimits::from_preprocessor_json(r#"{"min_pixels":1000,"max_pixels":20000}"#, Family::Qwen2Vl).unwrap();
        assert_eq!(
            old,
            ImageLimits {
                min_pixels: 1000,
                max_pixels: 20000
            }
        );
        let new = ImageLimits::from_preprocessor_json(
            r#"{"size":{"shortest_edge":1024,"longest_edge":4096}}"#,
            Family::Qwen3Vl,
        )
        .unwrap();
        assert_eq!(
            new,
            ImageLimits {
                min_pixels: 1024,
                max_pixels: 4096
            }
        );
        let default = ImageLimits::from_preprocessor_json("{}", Family::Qwen3Vl).unwrap();
        assert_eq!(default, ImageLimits::shipped(Family::Qwen3Vl));
        assert!(ImageLimits::from_preprocessor_json(r#"{"min_pixels":9,"max_pixels":1}"#, Family::Qwen2Vl).is_err());
    }
}
