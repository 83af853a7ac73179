//! Every tensor of a Qwen-VL checkpoint with its official name and shape (qwen-vl.md §6), from the
//! config alone: what `kvlens random-checkpoint` writes and what tests load without files.

use crate::config::{Family, ModelConfig};

/// How a tensor's values are drawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Init {
    /// `N(0, initializer_range²)`: matrices, embeddings, biases.
    Normal,
    /// `1 + small noise`: norm weights.
    NormWeight,
}

/// One tensor of the checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    /// On-disk name (official checkpoints).
    pub name: String,
    /// Shape.
    pub shape: Vec<usize>,
    /// How random checkpoints draw it.
    pub init: Init,
}

impl TensorSpec {
    /// Number of elements.
    pub fn numel(&self) -> u64 {
        self.shape.iter().map(|&d| d as u64).product()
    }
}

#[derive(Debug, Default)]
struct Specs(Vec<TensorSpec>);

impl Specs {
    fn push(&mut self, name: String, shape: &[usize], init: Init) {
        self.0.push(TensorSpec {
            name,
            shape: shape.to_vec(),
            init,
        });
    }

    fn linear(&mut self, prefix: &str, out: usize, inp: usize, bias: bool) {
        self.push(format!("{prefix}.weight"), &[out, inp], Init::Normal);
        if bias {
            self.push(format!("{prefix}.bias"), &[out], Init::Normal);
        }
    }

    fn norm(&mut self, prefix: &str, dim: usize, bias: bool) {
        self.push(format!("{prefix}.weight"), &[dim], Init::NormWeight);
        if bias {
            self.push(format!("{prefix}.bias"), &[dim], Init::Normal);
        }
    }
}

/// Every tensor of the checkpoint with its on-disk name (official checkpoints) and shape (docs/qwen-vl.md §6).
pub fn tensor_specs(cfg: &ModelConfig) -> Vec<TensorSpec> {
    let mut s = Specs::default();
    vision_specs(cfg, &mut s);
    text_specs(cfg, &mut s);
    s.0
}

fn vision_specs(cfg: &ModelConfig, s: &mut Specs) {
    let v = &cfg.vision;
    let family = cfg.family;
    let qwen3 = family.is_qwen3();
    // Qwen2.5-VL's ViT uses RMSNorm (weight only); Qwen2-VL and Qwen3-VL use LayerNorm.
    let layer_norm = family != Family::Qwen25Vl;
    let vp = if qwen3 { "model.visual" } else { "visual" };
    let (e, i, out) = (v.hidden_size, v.intermediate_size, v.out_hidden_size);
    let merged = e * v.spatial_merge_size * v.spatial_merge_size;

    s.push(
        format!("{vp}.patch_embed.proj.weight"),
        &[e, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size],
        Init::Normal,
    );
    if qwen3 {
        s.push(format!("{vp}.patch_embed.proj.bias"), &[e], Init::Normal);
        s.push(
            format!("{vp}.pos_embed.weight"),
            &[v.num_position_embeddings, e],
            Init::Normal,
        );
    }
    for n in 0..v.depth {
        let b = format!("{vp}.blocks.{n}");
        s.norm(&format!("{b}.norm1"), e, layer_norm);
        s.norm(&format!("{b}.norm2"), e, layer_norm);
        s.linear(&format!("{b}.attn.qkv"), 3 * e, e, true);
        s.linear(&format!("{b}.attn.proj"), e, e, true);
        match family {
            Family::Qwen2Vl => {
                s.linear(&format!("{b}.mlp.fc1"), i, e, true);
                s.linear(&format!("{b}.mlp.fc2"), e, i, true);
            }
            Family::Qwen25Vl => {
                s.linear(&format!("{b}.mlp.gate_proj"), i, e, true);
                s.linear(&format!("{b}.mlp.up_proj"), i, e, true);
                s.linear(&format!("{b}.mlp.down_proj"), e, i, true);
            }
            Family::Qwen3Vl | Family::Qwen3VlMoe => {
                s.linear(&format!("{b}.mlp.linear_fc1"), i, e, true);
                s.linear(&format!("{b}.mlp.linear_fc2"), e, i, true);
            }
        }
    }
    if qwen3 {
        s.norm(&format!("{vp}.merger.norm"), e, true);
        s.linear(&format!("{vp}.merger.linear_fc1"), merged, merged, true);
        s.linear(&format!("{vp}.merger.linear_fc2"), out, merged, true);
        for k in 0..v.deepstack_visual_indexes.len() {
            let d = format!("{vp}.deepstack_merger_list.{k}");
            s.norm(&format!("{d}.norm"), merged, true);
            s.linear(&format!("{d}.linear_fc1"), merged, merged, true);
            s.linear(&format!("{d}.linear_fc2"), out, merged, true);
        }
    } else {
        s.norm(&format!("{vp}.merger.ln_q"), e, layer_norm);
        s.linear(&format!("{vp}.merger.mlp.0"), merged, merged, true);
        s.linear(&format!("{vp}.merger.mlp.2"), out, merged, true);
    }
}

fn text_specs(cfg: &ModelConfig, s: &mut Specs) {
    let t = &cfg.text;
    let tp = if cfg.family.is_qwen3() {
        "model.language_model"
    } else {
        "model"
    };
    let (h, hd, nq, nkv, i) = (
        t.hidden_size,
        t.head_dim,
        t.num_attention_heads,
        t.num_key_value_heads,
        t.intermediate_size,
    );
    s.push(format!("{tp}.embed_tokens.weight"), &[t.vocab_size, h], Init::Normal);
    for n in 0..t.num_hidden_layers {
        let l = format!("{tp}.layers.{n}");
        s.norm(&format!("{l}.input_layernorm"), h, false);
        s.linear(&format!("{l}.self_attn.q_proj"), nq * hd, h, t.attention_bias);
        s.linear(&format!("{l}.self_attn.k_proj"), nkv * hd, h, t.attention_bias);
        s.linear(&format!("{l}.self_attn.v_proj"), nkv * hd, h, t.attention_bias);
        s.linear(&format!("{l}.self_attn.o_proj"), h, nq * hd, false);
        if t.qk_norm {
            s.norm(&format!("{l}.self_attn.q_norm"), hd, false);
            s.norm(&format!("{l}.self_attn.k_norm"), hd, false);
        }
        s.linear(&format!("{l}.mlp.gate_proj"), i, h, false);
        s.linear(&format!("{l}.mlp.up_proj"), i, h, false);
        s.linear(&format!("{l}.mlp.down_proj"), h, i, false);
        s.norm(&format!("{l}.post_attention_layernorm"), h, false);
    }
    s.norm(&format!("{tp}.norm"), h, false);
    if !cfg.tie_word_embeddings {
        s.push("lm_head.weight".into(), &[t.vocab_size, h], Init::Normal);
    }
}
