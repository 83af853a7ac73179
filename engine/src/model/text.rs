//! The Qwen2 and Qwen3 decoders with paged attention over the KV cache's block tables, as
//! transformers writes them: `Qwen2_5_VLTextModel` in
//! <https://github.com/huggingface/transformers/blob/main/src/transformers/models/qwen2_5_vl/modeling_qwen2_5_vl.py>
//! and `Qwen3VLTextModel` in
//! <https://github.com/huggingface/transformers/blob/main/src/transformers/models/qwen3_vl/modeling_qwen3_vl.py>.

use super::weights::{Loader, TensorSource};
use super::ModelError;
use crate::arch::config::{ModelConfig, TextConfig};
use crate::arch::spec::{Projection, TextMlpSpec, TextSpec};
use crate::backend::{Backend, BackendError};

#[derive(Debug)]
struct Layer<B: Backend> {
    input_norm: B::Tensor,
    post_norm: B::Tensor,
    q: (B::Weight, Option<B::Tensor>),
    k: (B::Weight, Option<B::Tensor>),
    v: (B::Weight, Option<B::Tensor>),
    o: B::Weight,
    qk_norm: Option<(B::Tensor, B::Tensor)>,
    gate: B::Weight,
    up: B::Weight,
    down: B::Weight,
}

/// What one forward pass over the decoder needs besides the weights.
#[derive(Debug)]
pub struct DecoderInput<'a, B: Backend> {
    /// Input embeddings `[tokens, H]` (token embeddings with image rows merged in).
    pub embeds: B::Tensor,
    /// cos/sin `[tokens, head_dim]` from the M-RoPE positions.
    pub cos: B::Tensor,
    /// See `cos`.
    pub sin: B::Tensor,
    /// The step's slots and block tables, uploaded once for every layer.
    pub paged: &'a B::Paged,
    /// Qwen3-VL deepstack features with the rows they are added to (prefill only).
    pub deepstack: Option<(&'a [B::Tensor], &'a [usize])>,
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
    pub fn load<S: TensorSource<B>>(cfg: &ModelConfig, l: &Loader<'_, '_, S, B>) -> Result<Self, ModelError> {
        let spec = TextSpec::new(cfg);
        let proj = |p: &Projection| -> Result<(B::Weight, Option<B::Tensor>), ModelError> {
            Ok((l.matrix(&p.weight)?, p.bias.as_ref().map(|b| l.load(b)).transpose()?))
        };
        let mut layers = Vec::with_capacity(spec.layers.len());
        for s in &spec.layers {
            let TextMlpSpec::Dense { gate, up, down } = &s.mlp else {
                return Err(ModelError::Unsupported(
                    "mixture-of-experts decoders are not supported yet".into(),
                ));
            };
            let qk_norm = match &s.qk_norm {
                Some((q, k)) => Some((l.load(q)?, l.load(k)?)),
                None => None,
            };
            layers.push(Layer {
                input_norm: l.load(&s.input_layernorm)?,
                post_norm: l.load(&s.post_attention_layernorm)?,
                q: proj(&s.q)?,
                k: proj(&s.k)?,
                v: proj(&s.v)?,
                o: l.matrix(&s.o)?,
                qk_norm,
                gate: l.matrix(gate)?,
                up: l.matrix(up)?,
                down: l.matrix(down)?,
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
            norm: l.load(&spec.norm)?,
            lm_head,
        })
    }

    /// Token embeddings `[ids, H]`.
    pub fn embed(&self, be: &B, ids: &[u32]) -> Result<B::Tensor, ModelError> {
        Ok(be.embedding(&self.embed, ids)?)
    }

    /// Runs every layer, writing K/V into `cache`; returns the final hidden states `[tokens, H]`.
    pub fn forward(&self, be: &B, cache: &mut B::KvCache, inp: DecoderInput<'_, B>) -> Result<B::Tensor, ModelError> {
        let t = &self.cfg;
        let (hd, nq, nkv) = (t.head_dim, t.num_attention_heads, t.num_key_value_heads);
        let eps = t.rms_norm_eps;
        let mut x = inp.embeds;
        let rows = be.shape(&x).first().copied().unwrap_or(0);
        for (i, layer) in self.layers.iter().enumerate() {
            let h = be.rms_norm(&x, &layer.input_norm, eps)?;
            let [mut q, mut k, v] = products(be.linears(
                &h,
                &[
                    (&layer.q.0, layer.q.1.as_ref()),
                    (&layer.k.0, layer.k.1.as_ref()),
                    (&layer.v.0, layer.v.1.as_ref()),
                ],
            )?)?;
            if let Some((qn, kn)) = &layer.qk_norm {
                q = be.reshape(&be.rms_norm(&be.reshape(&q, rows * nq, hd)?, qn, eps)?, rows, nq * hd)?;
                k = be.reshape(&be.rms_norm(&be.reshape(&k, rows * nkv, hd)?, kn, eps)?, rows, nkv * hd)?;
            }
            let q = be.rope(&q, &inp.cos, &inp.sin)?;
            let k = be.rope(&k, &inp.cos, &inp.sin)?;
            be.write_kv(cache, i, &k, &v, inp.paged)?;
            let a = be.paged_attention(cache, i, &q, nq, inp.paged)?;
            x = be.add(&x, &be.linear(&a, &layer.o, None)?)?;
            let h = be.rms_norm(&x, &layer.post_norm, eps)?;
            let [gate, up] = products(be.linears(&h, &[(&layer.gate, None), (&layer.up, None)])?)?;
            let m = be.silu_mul(&gate, &up)?;
            x = be.add(&x, &be.linear(&m, &layer.down, None)?)?;
            if let Some((features, rows_at)) = inp.deepstack {
                if let Some(f) = features.get(i) {
                    x = be.scatter_rows(&x, rows_at, f, true)?;
                }
            }
        }
        Ok(be.rms_norm(&x, &self.norm, eps)?)
    }

    /// Logits `[rows, vocab]` of the given hidden rows.
    pub fn logits(&self, be: &B, hidden: &B::Tensor) -> Result<B::Tensor, ModelError> {
        Ok(be.linear(hidden, self.lm_head.as_ref().unwrap_or(&self.embed), None)?)
    }
}

/// The `N` products [`Backend::linears`] returned, as an array.
fn products<T, const N: usize>(ys: Vec<T>) -> Result<[T; N], ModelError> {
    ys.try_into()
        .map_err(|ys: Vec<T>| BackendError::Shape(format!("{} products where {N} were asked for", ys.len())).into())
}
