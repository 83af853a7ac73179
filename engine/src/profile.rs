//! The start-up profile run (vLLM's `profile_run`): the vision tower on the largest allowed images
//! and one decoder pass over a full token budget, measured on the backend's ledger. Its peak is
//! the activation memory every later step stays within, so the KV cache can take the rest.

use crate::backend::{Backend, KvLayout, PagedSeq};
use crate::memory::ledger::Category;
use crate::model::rope::mrope_tables;
use crate::model::text::DecoderInput;
use crate::model::{ModelError, QwenVl};

/// What to profile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProfileSpec {
    /// Decoder tokens in the dummy batch (`max_num_batched_tokens`).
    pub num_tokens: usize,
    /// Rows sampled at the end (`min(max_num_seqs, max_num_batched_tokens)`).
    pub num_sampled: usize,
    /// Patch grid `(t, h, w)` of the largest allowed image, or None without images.
    pub image_grid: Option<[usize; 3]>,
    /// Images of that size the encoder budget holds at once.
    pub image_items: usize,
    /// KV block size of the scratch cache the dummy batch writes into.
    pub block_size: usize,
}

/// What the profile run measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct ProfileResult {
    /// Most bytes held at once by activations, staging and the kept encoder outputs
    /// (vLLM's "torch peak memory increase").
    pub activation_peak_bytes: u64,
    /// Of which the vision tower's pass peaked at.
    pub vision_peak_bytes: u64,
    /// Of which the decoder pass peaked at (with the encoder outputs still held).
    pub decoder_peak_bytes: u64,
}

/// Transient bytes: everything but weights and the KV cache.
fn transient(be: &impl Backend, peak: bool) -> u64 {
    let l = be.ledger();
    [Category::Activations, Category::Staging, Category::EncoderCache]
        .iter()
        .map(|&c| if peak { l.peak(c) } else { l.bytes(c) })
        .sum()
}

/// Runs the profile pass and returns its measured peak above what was held before it. Nothing it
/// allocates outlives it.
pub fn profile_run<B: Backend>(be: &B, model: &QwenVl<B>, spec: ProfileSpec) -> Result<ProfileResult, ModelError> {
    if spec.num_tokens == 0 || spec.block_size == 0 {
        return Err(ModelError::Input(
            "the profile batch needs tokens and a block size".into(),
        ));
    }
    let base = transient(be, false);
    be.ledger().reset_peaks();
    let mut kept = Vec::new();
    if let Some(grid) = spec.image_grid {
        let patches: usize = grid.iter().product();
        let v = &model.cfg.vision;
        let cols = v.in_channels * v.temporal_patch_size * v.patch_size * v.patch_size;
        for _ in 0..spec.image_items {
            let px = be.upload(vec![0.0; patches * cols], &[patches, cols])?;
            let out = model.vision.forward(be, &px, &[grid])?;
            kept.push(be.keep(&out.main, Category::EncoderCache));
            kept.extend(out.deepstack.iter().map(|d| be.keep(d, Category::EncoderCache)));
        }
    }
    let vision_peak = transient(be, true).saturating_sub(base);
    be.ledger().reset_peaks();

    let t = &model.cfg.text;
    let n = spec.num_tokens;
    let bs = spec.block_size;
    let blocks = n.div_ceil(bs);
    let mut cache = be.alloc_kv(KvLayout {
        layers: t.num_hidden_layers,
        num_blocks: blocks,
        block_size: bs,
        kv_heads: t.num_key_value_heads,
        head_dim: t.head_dim,
    })?;
    let ids = vec![0u32; n];
    let positions: Vec<[i64; 3]> = (0..n as i64).map(|p| [p; 3]).collect();
    let (cos, sin) = mrope_tables(t, &positions);
    let table: Vec<usize> = (0..blocks).collect();
    let slots: Vec<usize> = (0..n).collect();
    let seqs = [PagedSeq {
        query_start: 0,
        query_len: n,
        context_len: n,
        block_table: &table,
    }];
    let hidden = model.text.forward(
        be,
        &mut cache,
        DecoderInput {
            embeds: model.text.embed(be, &ids)?,
            cos: be.upload(cos, &[n, t.head_dim])?,
            sin: be.upload(sin, &[n, t.head_dim])?,
            slots: &slots,
            seqs: &seqs,
            deepstack: None,
        },
    )?;
    let rows: Vec<usize> = (n - spec.num_sampled.clamp(1, n)..n).collect();
    let logits = model.text.logits(be, &be.gather_rows(&hidden, &rows)?)?;
    be.download(&logits)?;
    let decoder_peak = transient(be, true).saturating_sub(base);
    drop((hidden, logits, cache, kept));
    Ok(ProfileResult {
        activation_peak_bytes: vision_peak.max(decoder_peak),
        vision_peak_bytes: vision_peak,
        decoder_peak_bytes: decoder_peak,
    })
}
