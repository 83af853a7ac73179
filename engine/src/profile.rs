//! The start-up profile run (vLLM's `profile_run`): the model runner encodes the largest allowed
//! images and executes one dummy step batch over a full token budget, measured on the backend's
//! ledger. Its peak is the activation memory every later step stays within, so the KV cache can
//! take the rest. It goes through the same encode and execute path as every real step.

use crate::backend::{Backend, Readback};
use crate::model::ModelError;
use crate::runner::{BatchSeq, ImageRows, ModelRunner, StepBatch, StepRunner};

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

impl<B: Backend> ModelRunner<B> {
    /// Runs the profile pass and returns its measured peak above what was held before it: the
    /// vision tower on every profiled image (outputs kept), then one step of `num_tokens` tokens
    /// whose leading rows are those images' features (deepstack included) with `num_sampled`
    /// logits rows, over a scratch KV cache. Nothing it allocates outlives it; the runner's own KV
    /// cache, if any, is put back. The peak is known once the run is recorded; the read it returns
    /// resolves once the device has run it (a GPU queues the work: awaiting the read is vLLM's
    /// synchronize, without which the first request would wait behind the profile unawares).
    pub fn profile(&mut self, spec: ProfileSpec) -> Result<(ProfileResult, Option<Readback>), ModelError> {
        if spec.num_tokens == 0 || spec.block_size == 0 {
            return Err(ModelError::Input(
                "the profile batch needs tokens and a block size".into(),
            ));
        }
        let base = self.backend().ledger().transient(false);
        self.backend().ledger().reset_peaks();
        let n = spec.num_tokens;
        let mut images = Vec::new();
        let vision = self.model().cfg.vision.clone();
        if let Some((grid, v)) = spec.image_grid.zip(vision) {
            let patches: usize = grid.iter().product();
            let cols = v.patch_dim();
            let merge = v.spatial_merge_size;
            let tokens = patches / (merge * merge);
            let pixels = vec![0.0; patches * cols];
            for k in 0..spec.image_items {
                let hash = format!("profile-{k}").as_str().into();
                self.encode(&hash, &pixels, grid)?;
                // As in a real step, image features replace the leading rows.
                let at = (k * tokens).min(n);
                images.push(ImageRows {
                    mm_hash: hash,
                    rows: 0..tokens.min(n - at),
                    at,
                });
            }
        }
        let vision_peak = self.backend().ledger().transient(true).saturating_sub(base);
        self.backend().ledger().reset_peaks();

        let blocks = n.div_ceil(spec.block_size);
        let own_kv = self.take_kv();
        let hashes: Vec<_> = images.iter().map(|i| i.mm_hash.clone()).collect();
        let batch = StepBatch {
            seqs: vec![BatchSeq {
                id: "profile".into(),
                tokens: vec![0; n],
                positions: (0..n as i64).map(|p| [p; 3]).collect(),
                context_len: n,
                new_blocks: (0..blocks).collect(),
                table_start: 0,
                images: images.into_iter().filter(|i| !i.rows.is_empty()).collect(),
                logit_rows: spec.num_sampled.clamp(1, n),
                // Logits read back, the larger staging of the two ways a step can end.
                sampling: None,
            }],
            released: Vec::new(),
        };
        let tables = crate::backend::TableShape {
            rows: 1,
            max_blocks: blocks,
        };
        let measured = self.allocate_kv(blocks, spec.block_size, tables).and_then(|_| {
            // The read is queued, as in a real step: its staging counts; its values are not
            // needed, only that it arrives.
            let read = self.execute(batch)?.read;
            Ok((self.backend().ledger().transient(true).saturating_sub(base), read))
        });
        for h in &hashes {
            self.forget(h);
        }
        self.restore_kv(own_kv);
        let (decoder_peak, read) = measured?;
        let result = ProfileResult {
            activation_peak_bytes: vision_peak.max(decoder_peak),
            vision_peak_bytes: vision_peak,
            decoder_peak_bytes: decoder_peak,
        };
        Ok((result, read))
    }
}
