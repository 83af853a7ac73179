//! The Qwen2 and Qwen3 decoders with paged attention over the KV cache's block tables, as
//! transformers writes them: `Qwen2_5_VLTextModel` in
//! <https://github.com/huggingface/transformers/blob/main/src/transformers/models/qwen2_5_vl/modeling_qwen2_5_vl.py>
//! and `Qwen3VLTextModel` in
//! <https://github.com/huggingface/transformers/blob/main/src/transformers/models/qwen3_vl/modeling_qwen3_vl.py>,
//! and Qwen3.5's hybrid decoder (`Qwen3_5TextModel` in
//! <https://github.com/huggingface/transformers/blob/main/src/transformers/models/qwen3_5/modular_qwen3_5.py>):
//! Gated DeltaNet layers with a state per request, and every fourth layer gated full attention.

use super::mlp::Mlp;
use super::weights::{Loader, TensorSource};
use super::ModelError;
use crate::arch::config::{ModelConfig, TextConfig};
use crate::arch::spec::{AttentionSpec, DeltaNetSpec, MixerSpec, Projection, TensorSpec, TextSpec};
use crate::backend::{Backend, BackendError, DeltaNetInput, StateSeq};
use crate::memory::ledger::Category;

/// Softmax attention over the paged KV cache.
#[derive(Debug)]
struct Attention<B: Backend> {
    q: (B::Weight, Option<B::Tensor>),
    k: (B::Weight, Option<B::Tensor>),
    v: (B::Weight, Option<B::Tensor>),
    o: B::Weight,
    qk_norm: Option<(B::Tensor, B::Tensor)>,
    /// Qwen3.5: the query projection also yields a sigmoid gate on each head's output.
    output_gate: bool,
    /// Its layer in the KV cache (attention layers counted alone).
    kv_layer: usize,
}

/// A Gated DeltaNet layer (Qwen3.5's `linear_attn`).
#[derive(Debug)]
struct DeltaNet<B: Backend> {
    in_qkv: B::Weight,
    in_z: B::Weight,
    in_b: B::Weight,
    in_a: B::Weight,
    /// The conv kernel `[conv_dim, kernel]`.
    conv: B::Tensor,
    a_log: B::Tensor,
    dt_bias: B::Tensor,
    norm: B::Tensor,
    out: B::Weight,
    /// Its layer in the state cache (Gated DeltaNet layers counted alone).
    state_layer: usize,
}

#[derive(Debug)]
enum Mixer<B: Backend> {
    Attention(Attention<B>),
    DeltaNet(DeltaNet<B>),
}

#[derive(Debug)]
struct Layer<B: Backend> {
    input_norm: B::Tensor,
    post_norm: B::Tensor,
    mixer: Mixer<B>,
    mlp: Mlp<B>,
}

/// What one forward pass over the decoder needs besides the weights.
#[derive(Debug)]
pub struct DecoderInput<'a, B: Backend> {
    /// Input embeddings `[tokens, H]` (token embeddings with image rows merged in).
    pub embeds: B::Tensor,
    /// cos/sin `[tokens, rotary_dim]` from the M-RoPE positions.
    pub cos: B::Tensor,
    /// See `cos`.
    pub sin: B::Tensor,
    /// The step's slots and block tables, uploaded once for every layer.
    pub paged: &'a B::Paged,
    /// Qwen3-VL deepstack features with the rows they are added to (prefill only).
    pub deepstack: Option<(&'a [B::Tensor], &'a [usize])>,
    /// Each sequence's rows and state slot, for the Gated DeltaNet layers (empty without them).
    pub state_seqs: &'a [StateSeq],
}

/// The language model.
#[derive(Debug)]
pub struct TextModel<B: Backend> {
    cfg: TextConfig,
    embed: B::Weight,
    layers: Vec<Layer<B>>,
    norm: B::Tensor,
    lm_head: Option<B::Weight>,
}

impl<B: Backend> TextModel<B> {
    /// Loads the decoder's weights, named and shaped by its [`TextSpec`].
    pub fn load<S: TensorSource<B>>(cfg: &ModelConfig, l: &Loader<'_, '_, S, B>, be: &B) -> Result<Self, ModelError> {
        let spec = TextSpec::new(cfg);
        let qwen35 = cfg.family.is_qwen35();
        // Qwen3.5's RMSNorms scale by `1 + w` (zero-centred weights).
        let norm = |t: &TensorSpec| -> Result<B::Tensor, ModelError> {
            let w = l.load(t)?;
            if !qwen35 {
                return Ok(w);
            }
            let ones = be.upload(vec![1.0; t.numel() as usize], &t.shape)?;
            Ok(be.keep(&be.add(&w, &ones)?, Category::Weights))
        };
        let (mut kv_layers, mut state_layers) = (0, 0);
        let mut layers = Vec::with_capacity(spec.layers.len());
        for s in &spec.layers {
            let mixer = match &s.mixer {
                MixerSpec::Attention(a) => {
                    kv_layers += 1;
                    Mixer::Attention(Attention::load(a, l, &norm, qwen35, kv_layers - 1)?)
                }
                MixerSpec::DeltaNet(d) => {
                    state_layers += 1;
                    Mixer::DeltaNet(DeltaNet::load(d, l, be, state_layers - 1)?)
                }
            };
            layers.push(Layer {
                input_norm: norm(&s.input_layernorm)?,
                post_norm: norm(&s.post_attention_layernorm)?,
                mixer,
                mlp: Mlp::load(&s.mlp, cfg.text.moe.as_ref(), l)?,
            });
        }
        // Tied models ship no lm_head; a missing lm_head is treated as tied too.
        let lm_head = match &spec.lm_head {
            Some(head) if l.has(head) => Some(l.matrix(head)?),
            _ => None,
        };
        Ok(TextModel {
            cfg: cfg.text.clone(),
            embed: l.matrix(&spec.embed_tokens)?,
            layers,
            norm: norm(&spec.norm)?,
            lm_head,
        })
    }

    /// Token embeddings `[ids, H]`.
    pub fn embed(&self, be: &B, ids: &[u32]) -> Result<B::Tensor, ModelError> {
        Ok(be.embedding(&self.embed, ids)?)
    }

    /// Runs every layer, writing K/V into `cache` and updating the Gated DeltaNet layers'
    /// `states` (None for a model without them); returns the final hidden states `[tokens, H]`.
    pub fn forward(
        &self,
        be: &B,
        cache: &mut B::KvCache,
        mut states: Option<&mut B::StateCache>,
        inp: DecoderInput<'_, B>,
    ) -> Result<B::Tensor, ModelError> {
        let eps = self.cfg.rms_norm_eps;
        // The norm before layer `i`: its input norm, or after the last layer the final norm.
        let norm_before = |i: usize| self.layers.get(i).map_or(&self.norm, |l| &l.input_norm);
        let mut x = inp.embeds.clone();
        let mut h = be.rms_norm(&x, norm_before(0), eps)?;
        for (i, layer) in self.layers.iter().enumerate() {
            let mixed = match &layer.mixer {
                Mixer::Attention(a) => a.forward(be, &self.cfg, cache, &h, &inp)?,
                Mixer::DeltaNet(d) => {
                    let states = states
                        .as_deref_mut()
                        .ok_or_else(|| ModelError::Input("a Gated DeltaNet layer ran without a state cache".into()))?;
                    d.forward(be, &self.cfg, states, &h, inp.state_seqs)?
                }
            };
            let (sum, normed) = be.add_rms_norm(&x, &mixed, &layer.post_norm, eps)?;
            let out = layer.mlp.forward(be, &normed)?;
            // The residual add and the next norm in one pass, unless deepstack features join between.
            let deepstack = inp
                .deepstack
                .and_then(|(features, rows_at)| Some((features.get(i)?, rows_at)));
            (x, h) = match deepstack {
                Some((f, rows_at)) => {
                    let x = be.scatter_rows(&be.add(&sum, &out)?, rows_at, f, true)?;
                    let h = be.rms_norm(&x, norm_before(i + 1), eps)?;
                    (x, h)
                }
                None => be.add_rms_norm(&sum, &out, norm_before(i + 1), eps)?,
            };
        }
        Ok(h)
    }

    /// Logits `[rows, vocab]` of the given hidden rows.
    pub fn logits(&self, be: &B, hidden: &B::Tensor) -> Result<B::Tensor, ModelError> {
        Ok(be.linear(hidden, self.lm_head.as_ref().unwrap_or(&self.embed), None)?)
    }
}

impl<B: Backend> Attention<B> {
    fn load<S: TensorSource<B>>(
        a: &AttentionSpec,
        l: &Loader<'_, '_, S, B>,
        norm: &impl Fn(&TensorSpec) -> Result<B::Tensor, ModelError>,
        output_gate: bool,
        kv_layer: usize,
    ) -> Result<Self, ModelError> {
        let proj = |p: &Projection| -> Result<(B::Weight, Option<B::Tensor>), ModelError> {
            Ok((l.matrix(&p.weight)?, p.bias.as_ref().map(|b| l.load(b)).transpose()?))
        };
        let qk_norm = match &a.qk_norm {
            Some((q, k)) => Some((norm(q)?, norm(k)?)),
            None => None,
        };
        Ok(Attention {
            q: proj(&a.q)?,
            k: proj(&a.k)?,
            v: proj(&a.v)?,
            o: l.matrix(&a.o)?,
            qk_norm,
            output_gate,
            kv_layer,
        })
    }

    /// The attention block's output `[rows, H]` for normed input `h`.
    fn forward(
        &self,
        be: &B,
        t: &TextConfig,
        cache: &mut B::KvCache,
        h: &B::Tensor,
        inp: &DecoderInput<'_, B>,
    ) -> Result<B::Tensor, ModelError> {
        let (hd, nq) = (t.head_dim, t.num_attention_heads);
        let rows = be.shape(h).first().copied().unwrap_or(0);
        let [mut q, k, v] = products(be.linears(
            h,
            &[
                (&self.q.0, self.q.1.as_ref()),
                (&self.k.0, self.k.1.as_ref()),
                (&self.v.0, self.v.1.as_ref()),
            ],
        )?)?;
        // Qwen3.5 lays out each head's query and gate side by side: `[rows·heads, 2·head_dim]`.
        let gate = if self.output_gate {
            let per_head = be.reshape(&q, rows * nq, 2 * hd)?;
            q = be.reshape(&be.narrow_cols(&per_head, 0, hd)?, rows, nq * hd)?;
            Some(be.reshape(&be.narrow_cols(&per_head, hd, hd)?, rows, nq * hd)?)
        } else {
            None
        };
        let (qn, kn) = self.qk_norm.as_ref().map_or((None, None), |(q, k)| (Some(q), Some(k)));
        let eps = t.rms_norm_eps;
        let q = be.norm_rope(&q, qn, eps, &inp.cos, &inp.sin, hd)?;
        let k = be.norm_rope(&k, kn, eps, &inp.cos, &inp.sin, hd)?;
        be.write_kv(cache, self.kv_layer, &k, &v, inp.paged)?;
        let mut a = be.paged_attention(cache, self.kv_layer, &q, nq, inp.paged)?;
        if let Some(gate) = gate {
            a = be.sigmoid_mul(&gate, &a)?;
        }
        Ok(be.linear(&a, &self.o, None)?)
    }
}

impl<B: Backend> DeltaNet<B> {
    fn load<S: TensorSource<B>>(
        d: &DeltaNetSpec,
        l: &Loader<'_, '_, S, B>,
        be: &B,
        state_layer: usize,
    ) -> Result<Self, ModelError> {
        let (channels, width) = (d.conv1d.shape[0], d.conv1d.shape[2]);
        Ok(DeltaNet {
            in_qkv: l.matrix(&d.in_proj_qkv)?,
            in_z: l.matrix(&d.in_proj_z)?,
            in_b: l.matrix(&d.in_proj_b)?,
            in_a: l.matrix(&d.in_proj_a)?,
            conv: be.reshape(&l.load(&d.conv1d)?, channels, width)?,
            a_log: l.load(&d.a_log)?,
            dt_bias: l.load(&d.dt_bias)?,
            norm: l.load(&d.norm)?,
            out: l.matrix(&d.out_proj)?,
            state_layer,
        })
    }

    /// The Gated DeltaNet block's output `[rows, H]` for normed input `h`: the recurrence, each
    /// head's output RMS-normed and gated by `silu(z)`, then `out_proj`.
    fn forward(
        &self,
        be: &B,
        t: &TextConfig,
        states: &mut B::StateCache,
        h: &B::Tensor,
        seqs: &[StateSeq],
    ) -> Result<B::Tensor, ModelError> {
        let lin = t
            .linear
            .as_ref()
            .ok_or_else(|| ModelError::Input("a Gated DeltaNet layer in a model without linear attention".into()))?;
        let (heads, dv) = (lin.num_value_heads, lin.value_head_dim);
        let rows = be.shape(h).first().copied().unwrap_or(0);
        let [qkv, z, b, a] = products(be.linears(
            h,
            &[
                (&self.in_qkv, None),
                (&self.in_z, None),
                (&self.in_b, None),
                (&self.in_a, None),
            ],
        )?)?;
        let input = DeltaNetInput {
            qkv: &qkv,
            a: &a,
            b: &b,
            conv: &self.conv,
            a_log: &self.a_log,
            dt_bias: &self.dt_bias,
        };
        let o = be.gated_delta_net(states, self.state_layer, input, seqs)?;
        let o = be.rms_norm(&be.reshape(&o, rows * heads, dv)?, &self.norm, t.rms_norm_eps)?;
        let gated = be.silu_mul(&be.reshape(&z, rows * heads, dv)?, &o)?;
        Ok(be.linear(&be.reshape(&gated, rows, heads * dv)?, &self.out, None)?)
    }
}

/// The `N` products [`Backend::linears`] returned, as an array.
fn products<T, const N: usize>(ys: Vec<T>) -> Result<[T; N], ModelError> {
    ys.try_into()
        .map_err(|ys: Vec<T>| BackendError::Shape(format!("{} products where {N} were asked for", ys.len())).into())
}
