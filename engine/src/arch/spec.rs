//! The architecture, written once: every tensor of a Qwen-VL checkpoint from the config alone, with
//! its name, shape, dtype and tensor-parallel layout. The loaders ([`super::vision`], [`super::text`])
//! take names and shapes from [`VisionSpec`] and [`TextSpec`], the planner
//! ([`crate::memory::weights`]) counts each rank's parameters from [`tensor_specs`], and
//! `kvlens random-checkpoint` writes that list ([`super::random_weights`]).
//!
//! Names and shapes are those of transformers' modules (`modeling_qwen2_vl.py`,
//! `modeling_qwen2_5_vl.py`, `modeling_qwen3_vl.py`, `modeling_qwen3_vl_moe.py` under
//! <https://github.com/huggingface/transformers/tree/main/src/transformers/models>); the
//! tensor-parallel layout is vLLM's (<https://github.com/vllm-project/vllm/blob/main/vllm/model_executor/models/qwen2_5_vl.py>
//! and its siblings): column-parallel layers split by output rows with their biases, row-parallel
//! layers split by input columns with their biases replicated, K/V heads replicated when there are
//! fewer than ranks, norms and the patch embedding replicated.

use crate::arch::config::{
    DType, LayerKind, LinearAttention, ModelConfig, VisionConfig, VisionMerger, VisionMlp, VisionNorm,
};

/// Which part of the model a tensor belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Part {
    /// The vision tower, its merger and deepstack mergers.
    Vision,
    /// Decoder layers and the final norm.
    Text,
    /// Token embedding matrix.
    Embedding,
    /// Output head (only when untied).
    LmHead,
}

/// How a tensor is laid out across tensor-parallel ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shard {
    /// Every rank holds all of it.
    Replicated,
    /// Split evenly along this dimension.
    Split(usize),
    /// K/V projections: split along dimension 0 in whole heads of this many, each rank keeping at
    /// least one (heads are replicated when there are fewer than ranks).
    KvHeads(usize),
}

/// How a random checkpoint draws a tensor's values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Init {
    /// `N(0, initializer_range²)`: matrices, embeddings, biases.
    Normal,
    /// `1 + small noise`: norm weights.
    NormWeight,
    /// Small noise around 0: Qwen3.5's zero-centred norm weights, which scale by `1 + w`.
    ZeroCenteredNorm,
    /// `ln U(0.01, 0.5)`: a Gated DeltaNet's `A_log`, so that its state decays slowly enough to
    /// carry a random model's tokens across many positions.
    DecayLog,
}

/// One tensor of the checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    /// On-disk name, in the family's published layout.
    pub name: String,
    /// Shape.
    pub shape: Vec<usize>,
    /// Element type (the config's).
    pub dtype: DType,
    /// Tensor-parallel layout.
    pub shard: Shard,
    /// Part of the model.
    pub part: Part,
    /// The planner's parameter group: the tensors whose parameters it adds up before splitting them
    /// across ranks.
    pub group: &'static str,
    /// How random checkpoints draw it.
    pub init: Init,
    /// The model reads it into host floats instead of loading it onto the backend (Qwen3-VL's
    /// learned position table, which it interpolates per image on the host).
    pub host: bool,
    /// A kernel the model applies element-wise (Qwen3.5's depthwise conv1d `[channels, 1, width]`):
    /// loaded as a tensor on the backend whatever its rank, never as a weight matrix.
    pub kernel: bool,
    /// Every expert's matrix of one projection, stacked `[experts, …]`: loaded as one weight
    /// matrix per expert.
    pub experts: Option<ExpertLayout>,
    /// What the model does with a weight matrix's rows.
    pub matrix_use: MatrixUse,
}

/// What the model does with a weight matrix's rows, which decides where a backend may keep them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MatrixUse {
    /// Products `x · wᵀ` only.
    #[default]
    Products,
    /// Rows gathered by token id only (token embeddings not tied to the lm_head).
    Gathers,
    /// Both (token embeddings tied to the lm_head).
    GathersAndProducts,
}

impl MatrixUse {
    /// Whether the model gathers rows of the matrix.
    pub fn gathers(self) -> bool {
        self != MatrixUse::Products
    }
}

/// How a stacked expert tensor holds each expert's matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertLayout {
    /// `[experts, out, in]`, each matrix as a linear layer stores it (Qwen3.5-MoE).
    OutputMajor,
    /// `[experts, in, out]`, each matrix transposed (Qwen3-VL-MoE as published).
    InputMajor,
}

impl TensorSpec {
    /// Number of elements.
    pub fn numel(&self) -> u64 {
        self.shape.iter().map(|&d| d as u64).product()
    }

    /// Whether the model multiplies by it (a matrix, an embedding, the patch embedding viewed as a
    /// matrix), so that the backend stores it as a weight matrix: every tensor of rank 2 or more
    /// the model does not read on the host.
    pub fn is_matrix(&self) -> bool {
        !self.host && !self.kernel && self.experts.is_none() && self.shape.len() >= 2
    }
}

/// A layer with a weight and a bias.
#[derive(Debug, Clone)]
pub struct Affine {
    /// `weight`.
    pub weight: TensorSpec,
    /// `bias`.
    pub bias: TensorSpec,
}

/// A projection whose bias depends on the config (the decoder's q/k/v).
#[derive(Debug, Clone)]
pub struct Projection {
    /// `weight [out, in]`.
    pub weight: TensorSpec,
    /// `bias [out]`, when the config has one.
    pub bias: Option<TensorSpec>,
}

/// A normalisation layer of the vision tower.
#[derive(Debug, Clone)]
pub enum NormSpec {
    /// LayerNorm: weight and bias.
    Layer(Affine),
    /// RMSNorm: weight only.
    Rms(TensorSpec),
}

/// The MLP of a vision block.
#[derive(Debug, Clone)]
pub enum VisionMlpSpec {
    /// Two layers with an activation between them.
    Plain {
        /// Up projection.
        fc1: Affine,
        /// Down projection.
        fc2: Affine,
    },
    /// `down(silu(gate) · up)`.
    Gated {
        /// Gate projection.
        gate: Affine,
        /// Up projection.
        up: Affine,
        /// Down projection.
        down: Affine,
    },
}

/// One vision block.
#[derive(Debug, Clone)]
pub struct VisionBlockSpec {
    /// Norm before attention.
    pub norm1: NormSpec,
    /// Norm before the MLP.
    pub norm2: NormSpec,
    /// Fused q/k/v projection.
    pub qkv: Affine,
    /// Attention output projection.
    pub proj: Affine,
    /// The MLP.
    pub mlp: VisionMlpSpec,
}

/// A patch merger (the main one or a deepstack one).
#[derive(Debug, Clone)]
pub struct MergerSpec {
    /// Its norm.
    pub norm: NormSpec,
    /// First layer.
    pub fc1: Affine,
    /// Second layer, to the decoder's width.
    pub fc2: Affine,
}

/// The vision tower's tensors.
#[derive(Debug, Clone)]
pub struct VisionSpec {
    /// Patch embedding `[E, C, T, P, P]`.
    pub patch_weight: TensorSpec,
    /// Its bias, when the family has one.
    pub patch_bias: Option<TensorSpec>,
    /// Learned position table `[positions, E]`, when the family has one.
    pub pos_embed: Option<TensorSpec>,
    /// The blocks.
    pub blocks: Vec<VisionBlockSpec>,
    /// The main merger.
    pub merger: MergerSpec,
    /// Deepstack mergers, in the order of `deepstack_visual_indexes`.
    pub deepstack: Vec<MergerSpec>,
}

/// A SwiGLU MLP: `down(silu(gate·x) ⊙ up·x)`.
#[derive(Debug, Clone)]
pub struct SwigluSpec {
    /// `gate_proj [I, H]`.
    pub gate: TensorSpec,
    /// `up_proj [I, H]`.
    pub up: TensorSpec,
    /// `down_proj [H, I]`.
    pub down: TensorSpec,
}

/// The MLP of a decoder layer.
#[derive(Debug, Clone)]
pub enum TextMlpSpec {
    /// One SwiGLU.
    Dense(SwigluSpec),
    /// A mixture of experts: Qwen3-VL-MoE's, or Qwen3.5-MoE's with a shared expert scaled by a
    /// sigmoid gate. The expert weights are stacked, as the published checkpoints store them.
    Experts {
        /// Router `mlp.gate [experts, H]`.
        router: TensorSpec,
        /// Gate and up projections of every expert, gate first (`2·I` outputs each).
        gate_up: TensorSpec,
        /// Down projections of every expert.
        down: TensorSpec,
        /// `mlp.shared_expert` and its gate `mlp.shared_expert_gate [1, H]`.
        shared: Option<Box<(SwigluSpec, TensorSpec)>>,
    },
}

/// Softmax attention of a decoder layer.
#[derive(Debug, Clone)]
pub struct AttentionSpec {
    /// Query projection; Qwen3.5's holds each head's query and its output gate side by side
    /// (`[heads · 2 · head_dim, H]`).
    pub q: Projection,
    /// Key projection.
    pub k: Projection,
    /// Value projection.
    pub v: Projection,
    /// Output projection.
    pub o: TensorSpec,
    /// Per-head RMSNorm weights of q and k, when the decoder has them.
    pub qk_norm: Option<(TensorSpec, TensorSpec)>,
}

/// A Gated DeltaNet layer (Qwen3.5's `linear_attn`).
#[derive(Debug, Clone)]
pub struct DeltaNetSpec {
    /// `in_proj_qkv [2·key_dim + value_dim, H]`.
    pub in_proj_qkv: TensorSpec,
    /// `in_proj_z [value_dim, H]`: the output gate.
    pub in_proj_z: TensorSpec,
    /// `in_proj_b [value_heads, H]`: the write strength β (after a sigmoid).
    pub in_proj_b: TensorSpec,
    /// `in_proj_a [value_heads, H]`: the decay's input.
    pub in_proj_a: TensorSpec,
    /// Depthwise causal conv1d `[conv_dim, 1, kernel]` ([`TensorSpec::kernel`]).
    pub conv1d: TensorSpec,
    /// `dt_bias [value_heads]`.
    pub dt_bias: TensorSpec,
    /// `A_log [value_heads]`.
    pub a_log: TensorSpec,
    /// Gated RMSNorm `[value_head_dim]` over each head's output.
    pub norm: TensorSpec,
    /// `out_proj [H, value_dim]`.
    pub out_proj: TensorSpec,
}

/// What mixes tokens in a decoder layer.
#[derive(Debug, Clone)]
pub enum MixerSpec {
    /// Attention over the KV cache.
    Attention(AttentionSpec),
    /// A Gated DeltaNet with a recurrent state.
    DeltaNet(DeltaNetSpec),
}

/// One decoder layer.
#[derive(Debug, Clone)]
pub struct LayerSpec {
    /// RMSNorm before the mixer.
    pub input_layernorm: TensorSpec,
    /// Attention or Gated DeltaNet.
    pub mixer: MixerSpec,
    /// The MLP.
    pub mlp: TextMlpSpec,
    /// RMSNorm before the MLP.
    pub post_attention_layernorm: TensorSpec,
}

/// The language model's tensors.
#[derive(Debug, Clone)]
pub struct TextSpec {
    /// Token embedding `[V, H]`.
    pub embed_tokens: TensorSpec,
    /// Decoder layers.
    pub layers: Vec<LayerSpec>,
    /// Final RMSNorm.
    pub norm: TensorSpec,
    /// Output head `[V, H]`, unless tied to the embedding.
    pub lm_head: Option<TensorSpec>,
}

/// Every tensor of the checkpoint, in the order `kvlens random-checkpoint` writes them.
pub fn tensor_specs(cfg: &ModelConfig) -> Vec<TensorSpec> {
    let mut out = Vec::new();
    if let Some(v) = &cfg.vision {
        vision(cfg, v, &mut out);
    }
    text(cfg, &mut out);
    out
}

impl VisionSpec {
    /// The vision tower `v` of `cfg`.
    pub fn new(cfg: &ModelConfig, v: &VisionConfig) -> Self {
        vision(cfg, v, &mut Vec::new())
    }
}

impl TextSpec {
    /// The language model of `cfg`.
    pub fn new(cfg: &ModelConfig) -> Self {
        text(cfg, &mut Vec::new())
    }
}

/// Appends every tensor it creates to `out`, in order.
struct Builder<'a> {
    out: &'a mut Vec<TensorSpec>,
    dtype: DType,
    part: Part,
    /// Whether the tensors created now are read to the host ([`TensorSpec::host`]).
    host: bool,
    /// How the decoder's RMSNorm weights are drawn (Qwen3.5's scale by `1 + w`).
    norm_init: Init,
}

impl<'a> Builder<'a> {
    fn new(out: &'a mut Vec<TensorSpec>, cfg: &ModelConfig, part: Part) -> Self {
        Builder {
            out,
            dtype: cfg.dtype,
            part,
            host: false,
            norm_init: match cfg.family {
                f if f.is_qwen35() => Init::ZeroCenteredNorm,
                _ => Init::NormWeight,
            },
        }
    }

    fn tensor(&mut self, name: String, shape: &[usize], shard: Shard, group: &'static str, init: Init) -> TensorSpec {
        let t = TensorSpec {
            name,
            shape: shape.to_vec(),
            dtype: self.dtype,
            shard,
            part: self.part,
            group,
            init,
            host: self.host,
            kernel: false,
            experts: None,
            matrix_use: MatrixUse::Products,
        };
        self.out.push(t.clone());
        t
    }

    /// `{prefix}.weight`, drawn from `N(0, std²)`.
    fn weight(&mut self, prefix: &str, shape: &[usize], shard: Shard, group: &'static str) -> TensorSpec {
        self.tensor(format!("{prefix}.weight"), shape, shard, group, Init::Normal)
    }

    /// `{prefix}.weight` as a [`TensorSpec::kernel`].
    fn kernel(&mut self, prefix: &str, shape: &[usize], shard: Shard, group: &'static str) -> TensorSpec {
        let mut t = self.weight(prefix, shape, shard, group);
        t.kernel = true;
        if let Some(last) = self.out.last_mut() {
            last.kernel = true;
        }
        t
    }

    /// The token embeddings `{prefix}.weight`, split by rows, whose rows the model gathers
    /// ([`TensorSpec::matrix_use`]).
    fn embeddings(&mut self, prefix: &str, shape: &[usize], usage: MatrixUse) -> TensorSpec {
        let mut t = self.weight(prefix, shape, Shard::Split(0), "embed_tokens");
        t.matrix_use = usage;
        if let Some(last) = self.out.last_mut() {
            last.matrix_use = usage;
        }
        t
    }

    /// Stacked expert matrices `name [experts, …]` ([`TensorSpec::experts`]).
    fn experts(&mut self, name: String, shape: &[usize], layout: ExpertLayout, shard: Shard) -> TensorSpec {
        let mut t = self.tensor(name, shape, shard, "layers.experts", Init::Normal);
        t.experts = Some(layout);
        if let Some(last) = self.out.last_mut() {
            last.experts = Some(layout);
        }
        t
    }

    /// A decoder RMSNorm weight `[dim]`, replicated, drawn as the family's norms are.
    fn decoder_norm(&mut self, prefix: &str, dim: usize, group: &'static str) -> TensorSpec {
        let init = self.norm_init;
        self.tensor(format!("{prefix}.weight"), &[dim], Shard::Replicated, group, init)
    }

    fn norm_weight(&mut self, prefix: &str, dim: usize, group: &'static str) -> TensorSpec {
        self.tensor(
            format!("{prefix}.weight"),
            &[dim],
            Shard::Replicated,
            group,
            Init::NormWeight,
        )
    }

    /// `{prefix}.weight [out, in]` and `{prefix}.bias [out]` with their layouts and groups.
    fn affine(
        &mut self,
        prefix: &str,
        out: usize,
        inp: usize,
        shards: [Shard; 2],
        groups: [&'static str; 2],
    ) -> Affine {
        Affine {
            weight: self.weight(prefix, &[out, inp], shards[0], groups[0]),
            bias: self.tensor(format!("{prefix}.bias"), &[out], shards[1], groups[1], Init::Normal),
        }
    }

    /// Column-parallel `[out, in]` with a bias, both split by rows.
    fn column(&mut self, prefix: &str, out: usize, inp: usize, group: &'static str) -> Affine {
        self.affine(prefix, out, inp, [Shard::Split(0); 2], [group; 2])
    }

    /// Row-parallel `[out, in]` split by columns, its bias replicated; `groups` of weight and bias.
    fn row(&mut self, prefix: &str, out: usize, inp: usize, groups: [&'static str; 2]) -> Affine {
        self.affine(prefix, out, inp, [Shard::Split(1), Shard::Replicated], groups)
    }

    /// A vision norm `[dim]`: weight, and a bias for LayerNorm.
    fn norm(&mut self, prefix: &str, dim: usize, kind: VisionNorm, group: &'static str) -> NormSpec {
        let weight = self.norm_weight(prefix, dim, group);
        match kind {
            VisionNorm::RmsNorm => NormSpec::Rms(weight),
            VisionNorm::LayerNorm => NormSpec::Layer(Affine {
                weight,
                bias: self.tensor(format!("{prefix}.bias"), &[dim], Shard::Replicated, group, Init::Normal),
            }),
        }
    }

    /// A merger from `norm_dim` (normalised) through `merged` to `out`, named as `names`.
    fn merger(&mut self, prefix: &str, names: [&str; 3], dims: [usize; 3], norm: VisionNorm) -> MergerSpec {
        let [norm_dim, merged, out] = dims;
        MergerSpec {
            norm: self.norm(&format!("{prefix}.{}", names[0]), norm_dim, norm, "merger.norm"),
            fc1: self.column(&format!("{prefix}.{}", names[1]), merged, merged, "merger.fc1"),
            fc2: self.row(
                &format!("{prefix}.{}", names[2]),
                out,
                merged,
                ["merger.fc2", "merger.fc2.bias"],
            ),
        }
    }

    /// A decoder projection `[out, in]` with the config's optional bias.
    fn projection(
        &mut self,
        prefix: &str,
        out: usize,
        inp: usize,
        bias: bool,
        shard: Shard,
        group: &'static str,
    ) -> Projection {
        Projection {
            weight: self.weight(prefix, &[out, inp], shard, group),
            bias: bias.then(|| self.tensor(format!("{prefix}.bias"), &[out], shard, group, Init::Normal)),
        }
    }
}

/// Names of a merger's norm and two layers.
fn merger_names(kind: VisionMerger) -> [&'static str; 3] {
    match kind {
        VisionMerger::Sequential => ["ln_q", "mlp.0", "mlp.2"],
        VisionMerger::LinearFc => ["norm", "linear_fc1", "linear_fc2"],
    }
}

fn vision(cfg: &ModelConfig, v: &VisionConfig, out: &mut Vec<TensorSpec>) -> VisionSpec {
    let mut b = Builder::new(out, cfg, Part::Vision);
    let p = cfg.layout.vision_prefix();
    let (e, i, o) = (v.hidden_size, v.intermediate_size, v.out_hidden_size);
    let merged = e * v.spatial_merge_size * v.spatial_merge_size;
    let patch = format!("{p}.patch_embed.proj");
    let patch_weight = b.weight(
        &patch,
        &[e, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size],
        Shard::Replicated,
        "patch_embed",
    );
    let patch_bias = v.patch_bias.then(|| {
        b.tensor(
            format!("{patch}.bias"),
            &[e],
            Shard::Replicated,
            "patch_embed",
            Init::Normal,
        )
    });
    b.host = true;
    let pos_embed = (v.num_position_embeddings > 0).then(|| {
        b.weight(
            &format!("{p}.pos_embed"),
            &[v.num_position_embeddings, e],
            Shard::Replicated,
            "pos_embed",
        )
    });
    b.host = false;
    let mut blocks = Vec::with_capacity(v.depth);
    for n in 0..v.depth {
        let k = format!("{p}.blocks.{n}");
        let down = ["blocks.mlp.down", "blocks.mlp.down.bias"];
        blocks.push(VisionBlockSpec {
            norm1: b.norm(&format!("{k}.norm1"), e, v.norm, "blocks.norm"),
            norm2: b.norm(&format!("{k}.norm2"), e, v.norm, "blocks.norm"),
            qkv: b.column(&format!("{k}.attn.qkv"), 3 * e, e, "blocks.attn.qkv"),
            proj: b.row(
                &format!("{k}.attn.proj"),
                e,
                e,
                ["blocks.attn.proj", "blocks.attn.proj.bias"],
            ),
            mlp: match v.mlp {
                VisionMlp::Gated => VisionMlpSpec::Gated {
                    gate: b.column(&format!("{k}.mlp.gate_proj"), i, e, "blocks.mlp.up"),
                    up: b.column(&format!("{k}.mlp.up_proj"), i, e, "blocks.mlp.up"),
                    down: b.row(&format!("{k}.mlp.down_proj"), e, i, down),
                },
                VisionMlp::Fc | VisionMlp::LinearFc => {
                    let (fc1, fc2) = if v.mlp == VisionMlp::Fc {
                        ("fc1", "fc2")
                    } else {
                        ("linear_fc1", "linear_fc2")
                    };
                    VisionMlpSpec::Plain {
                        fc1: b.column(&format!("{k}.mlp.{fc1}"), i, e, "blocks.mlp.up"),
                        fc2: b.row(&format!("{k}.mlp.{fc2}"), e, i, down),
                    }
                }
            },
        });
    }
    // The main merger normalises before the 2×2 shuffle (width E), deepstack mergers after (4E).
    let merger = b.merger(&format!("{p}.merger"), merger_names(v.merger), [e, merged, o], v.norm);
    let deepstack = (0..v.deepstack_visual_indexes.len())
        .map(|k| {
            b.merger(
                &format!("{p}.deepstack_merger_list.{k}"),
                merger_names(VisionMerger::LinearFc),
                [merged, merged, o],
                v.norm,
            )
        })
        .collect();
    VisionSpec {
        patch_weight,
        patch_bias,
        pos_embed,
        blocks,
        merger,
        deepstack,
    }
}

fn text(cfg: &ModelConfig, out: &mut Vec<TensorSpec>) -> TextSpec {
    use Shard::{KvHeads, Replicated, Split};
    let t = &cfg.text;
    let mut b = Builder::new(out, cfg, Part::Embedding);
    let p = cfg.layout.text_prefix();
    let (h, hd, nq, nkv, i) = (
        t.hidden_size,
        t.head_dim,
        t.num_attention_heads,
        t.num_key_value_heads,
        t.intermediate_size,
    );
    let embed_tokens = b.embeddings(
        &format!("{p}.embed_tokens"),
        &[t.vocab_size, h],
        if cfg.tie_word_embeddings {
            MatrixUse::GathersAndProducts
        } else {
            MatrixUse::Gathers
        },
    );
    b.part = Part::Text;
    let mut layers = Vec::with_capacity(t.num_hidden_layers);
    for n in 0..t.num_hidden_layers {
        let k = format!("{p}.layers.{n}");
        let input_layernorm = b.decoder_norm(&format!("{k}.input_layernorm"), h, "layers.norm");
        let mixer = match (t.layer_kind(n), &t.linear) {
            (LayerKind::LinearAttention, Some(l)) => MixerSpec::DeltaNet(delta_net(&mut b, &k, h, l)),
            _ => {
                let a = format!("{k}.self_attn");
                let bias = t.attention_bias;
                // Qwen3.5's query projection also yields each head's output gate.
                let q_rows = if cfg.family.is_qwen35() { 2 * nq * hd } else { nq * hd };
                MixerSpec::Attention(AttentionSpec {
                    q: b.projection(&format!("{a}.q_proj"), q_rows, h, bias, Split(0), "layers.q_proj"),
                    k: b.projection(
                        &format!("{a}.k_proj"),
                        nkv * hd,
                        h,
                        bias,
                        KvHeads(nkv),
                        "layers.kv_proj",
                    ),
                    v: b.projection(
                        &format!("{a}.v_proj"),
                        nkv * hd,
                        h,
                        bias,
                        KvHeads(nkv),
                        "layers.kv_proj",
                    ),
                    o: b.weight(&format!("{a}.o_proj"), &[h, nq * hd], Split(1), "layers.o_proj"),
                    qk_norm: t.qk_norm.then(|| {
                        (
                            b.decoder_norm(&format!("{a}.q_norm"), hd, "layers.qk_norm"),
                            b.decoder_norm(&format!("{a}.k_norm"), hd, "layers.qk_norm"),
                        )
                    }),
                })
            }
        };
        layers.push(LayerSpec {
            input_layernorm,
            mixer,
            mlp: match &t.moe {
                None => TextMlpSpec::Dense(swiglu(&mut b, &format!("{k}.mlp"), h, i, "layers.mlp")),
                Some(m) => {
                    let (n_e, mi) = (m.num_experts, m.moe_intermediate_size);
                    let experts = format!("{k}.mlp.experts");
                    // Qwen3.5-MoE stores each expert as a linear layer does; Qwen3-VL-MoE transposed.
                    let (gate_up, down) = if cfg.family.is_qwen35() {
                        (
                            b.experts(
                                format!("{experts}.gate_up_proj"),
                                &[n_e, 2 * mi, h],
                                ExpertLayout::OutputMajor,
                                Split(1),
                            ),
                            b.experts(
                                format!("{experts}.down_proj"),
                                &[n_e, h, mi],
                                ExpertLayout::OutputMajor,
                                Split(2),
                            ),
                        )
                    } else {
                        (
                            b.experts(
                                format!("{experts}.gate_up_proj"),
                                &[n_e, h, 2 * mi],
                                ExpertLayout::InputMajor,
                                Split(2),
                            ),
                            b.experts(
                                format!("{experts}.down_proj"),
                                &[n_e, mi, h],
                                ExpertLayout::InputMajor,
                                Split(1),
                            ),
                        )
                    };
                    TextMlpSpec::Experts {
                        router: b.weight(&format!("{k}.mlp.gate"), &[n_e, h], Replicated, "layers.router"),
                        gate_up,
                        down,
                        shared: m.shared_expert_intermediate_size.map(|si| {
                            Box::new((
                                swiglu(&mut b, &format!("{k}.mlp.shared_expert"), h, si, "layers.mlp"),
                                b.weight(
                                    &format!("{k}.mlp.shared_expert_gate"),
                                    &[1, h],
                                    Replicated,
                                    "layers.router",
                                ),
                            ))
                        }),
                    }
                }
            },
            post_attention_layernorm: b.decoder_norm(&format!("{k}.post_attention_layernorm"), h, "layers.norm"),
        });
    }
    let norm = b.decoder_norm(&format!("{p}.norm"), h, "norm");
    b.part = Part::LmHead;
    let lm_head = (!cfg.tie_word_embeddings).then(|| b.weight("lm_head", &[t.vocab_size, h], Split(0), "lm_head"));
    TextSpec {
        embed_tokens,
        layers,
        norm,
        lm_head,
    }
}

/// The SwiGLU under `prefix` (`{prefix}.gate_proj` …), `i` wide; vLLM splits gate and up by
/// output rows and down by input columns.
fn swiglu(b: &mut Builder<'_>, prefix: &str, h: usize, i: usize, group: &'static str) -> SwigluSpec {
    use Shard::Split;
    SwigluSpec {
        gate: b.weight(&format!("{prefix}.gate_proj"), &[i, h], Split(0), group),
        up: b.weight(&format!("{prefix}.up_proj"), &[i, h], Split(0), group),
        down: b.weight(&format!("{prefix}.down_proj"), &[h, i], Split(1), group),
    }
}

/// The tensors of Gated DeltaNet layer `k` (vLLM splits its projections by output rows, and
/// `out_proj` by input columns, as it does attention's).
fn delta_net(b: &mut Builder<'_>, k: &str, h: usize, l: &LinearAttention) -> DeltaNetSpec {
    use Shard::Split;
    let a = format!("{k}.linear_attn");
    let (nv, vd) = (l.num_value_heads, l.value_dim());
    let in_proj_qkv = b.weight(
        &format!("{a}.in_proj_qkv"),
        &[l.conv_dim(), h],
        Split(0),
        "layers.gdn_in",
    );
    let in_proj_z = b.weight(&format!("{a}.in_proj_z"), &[vd, h], Split(0), "layers.gdn_in");
    let in_proj_b = b.weight(&format!("{a}.in_proj_b"), &[nv, h], Split(0), "layers.gdn_in");
    let in_proj_a = b.weight(&format!("{a}.in_proj_a"), &[nv, h], Split(0), "layers.gdn_in");
    let conv1d = b.kernel(
        &format!("{a}.conv1d"),
        &[l.conv_dim(), 1, l.conv_kernel],
        Split(0),
        "layers.gdn_in",
    );
    let dt_bias = b.tensor(
        format!("{a}.dt_bias"),
        &[nv],
        Split(0),
        "layers.gdn_heads",
        Init::Normal,
    );
    let a_log = b.tensor(
        format!("{a}.A_log"),
        &[nv],
        Split(0),
        "layers.gdn_heads",
        Init::DecayLog,
    );
    let norm = b.norm_weight(&format!("{a}.norm"), l.value_head_dim, "layers.gdn_norm");
    let out_proj = b.weight(&format!("{a}.out_proj"), &[h, vd], Split(1), "layers.gdn_out");
    DeltaNetSpec {
        in_proj_qkv,
        in_proj_z,
        in_proj_b,
        in_proj_a,
        conv1d,
        dt_bias,
        a_log,
        norm,
        out_proj,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::config::{bundled_config, BUNDLED_CONFIGS};
    use std::collections::HashMap;

    #[test]
    fn names_are_unique_and_groups_keep_one_layout_kind() {
        for (name, _) in BUNDLED_CONFIGS {
            let specs = tensor_specs(&bundled_config(name).unwrap());
            let mut names: Vec<&str> = specs.iter().map(|s| s.name.as_str()).collect();
            names.sort_unstable();
            names.dedup();
            assert_eq!(names.len(), specs.len(), "{name}: duplicate names");
            let mut kinds: HashMap<&str, std::mem::Discriminant<Shard>> = HashMap::new();
            for t in &specs {
                let kind = *kinds.entry(t.group).or_insert(std::mem::discriminant(&t.shard));
                assert_eq!(kind, std::mem::discriminant(&t.shard), "{name}: {}", t.name);
            }
        }
    }

    #[test]
    fn typed_views_hold_the_listed_tensors() {
        let cfg = bundled_config("Qwen3-VL-2B-Instruct").unwrap();
        let (vision, text) = (VisionSpec::new(&cfg, cfg.vision.as_ref().unwrap()), TextSpec::new(&cfg));
        let specs = tensor_specs(&cfg);
        assert_eq!(specs[0], vision.patch_weight);
        assert_eq!(specs[0].name, "model.visual.patch_embed.proj.weight");
        assert_eq!(vision.deepstack.len(), 3);
        let embed = specs.iter().position(|t| *t == text.embed_tokens).unwrap();
        assert_eq!(specs[embed].name, "model.language_model.embed_tokens.weight");
        assert_eq!(specs.last(), Some(&text.norm), "tied: no lm_head");
    }
}
