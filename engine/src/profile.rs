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

/// Runs the profile pass and returns its measured peak above what was held before it: the vision
/// tower on every profiled image (outputs kept), then one decoder pass over `num_tokens` tokens
/// whose leading rows are those images' features (deepstack included), then the sampler's logits.
/// Nothing it allocates outlives it.
pub fn profile_run<B: Backend>(be: &B, model: &QwenVl<B>, spec: ProfileSpec) -> Result<ProfileResult, ModelError> {
    if spec.num_tokens == 0 || spec.block_size == 0 {
        return Err(ModelError::Input(
            "the profile batch needs tokens and a block size".into(),
        ));
    }
    let base = transient(be, false);
    be.ledger().reset_peaks();
    // Encoder outputs kept as the encoder cache keeps them: main features and deepstack levels.
    let levels = model.cfg.vision.deepstack_visual_indexes.len();
    let (mut mains, mut deeps) = (Vec::new(), vec![Vec::new(); levels]);
    if let Some(grid) = spec.image_grid {
        let patches: usize = grid.iter().product();
        let v = &model.cfg.vision;
        let cols = v.patch_dim();
        for _ in 0..spec.image_items {
            let px = be.upload(vec![0.0; patches * cols], &[patches, cols])?;
            let out = model.vision.forward(be, &px, &[grid])?;
            mains.push(be.keep(&out.main, Category::EncoderCache));
            for (level, d) in deeps.iter_mut().zip(&out.deepstack) {
                level.push(be.keep(d, Category::EncoderCache));
            }
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
    // As in a real step, image features replace the leading rows and feed the deepstack levels.
    let mut embeds = model.text.embed(be, &ids)?;
    let mut image_rows = Vec::new();
    let mut deep = Vec::new();
    if !mains.is_empty() {
        let main = be.concat_rows(&mains)?;
        image_rows = (0..n.min(be.shape(&main)[0])).collect();
        embeds = be.scatter_rows(&embeds, &image_rows, &be.gather_rows(&main, &image_rows)?, false)?;
        for level in &deeps {
            deep.push(be.gather_rows(&be.concat_rows(level)?, &image_rows)?);
        }
    }
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
            embeds,
            cos: be.upload(cos, &[n, t.head_dim])?,
            sin: be.upload(sin, &[n, t.head_dim])?,
            slots: &slots,
            seqs: &seqs,
            deepstack: (!deep.is_empty()).then_some((&deep[..], &image_rows[..])),
        },
    )?;
    let rows: Vec<usize> = (n - spec.num_sampled.clamp(1, n)..n).collect();
    let logits = model.text.logits(be, &be.gather_rows(&hidden, &rows)?)?;
    be.download(&logits)?;
    let decoder_peak = transient(be, true).saturating_sub(base);
    drop((hidden, logits, cache, deep, mains, deeps));
    Ok(ProfileResult {
        activation_peak_bytes: vision_peak.max(decoder_peak),
        vision_peak_bytes: vision_peak,
        decoder_peak_bytes: decoder_peak,
    })
}
