//! The engine: requests in, tokens out, one [`Engine::step`] at a time. Each step schedules running
//! requests first, then waiting ones, within the token budget (chunked prefill), reuses prefix-cached
//! KV blocks (keyed with the images' mm hashes) and encoder outputs (keyed by mm hash), runs the
//! vision tower only for images not in the encoder cache, runs one batched decoder pass, samples,
//! and frees what finished. The engine spawns no threads: its caller drives `step`.

use crate::backend::{Backend, KvLayout, PagedSeq};
use crate::cache::{
    extend_block_hashes, BlockHash, CacheError, ComputedBlocks, EncoderCacheManager, EncoderCacheSnapshot,
    KvCacheManager, KvSummary, MmHash, MmSpan, RequestId,
};
use crate::memory::ledger::{Category, LedgerEntry};
use crate::model::rope::{mrope_positions, mrope_tables, ImageSpan};
use crate::model::text::DecoderInput;
use crate::model::vision::VisionOutput;
use crate::model::{ModelError, QwenVl};
use crate::sample::{sample, Rng, SamplingParams};
use std::collections::{HashMap, VecDeque};

/// A preprocessed image placed in a prompt.
#[derive(Debug, Clone)]
pub struct ImageInput {
    /// Patch rows `[patches, C·T·P·P]`, flattened.
    pub pixel_values: Vec<f32>,
    /// `(t, h, w)` in patches.
    pub grid_thw: [usize; 3],
    /// Content hash (keys the encoder and prefix caches).
    pub mm_hash: MmHash,
    /// Index of its first `<|image_pad|>` in the prompt.
    pub offset: usize,
    /// Number of `<|image_pad|>` tokens (`t·h·w / merge²`).
    pub num_tokens: usize,
}

/// One generation request.
#[derive(Debug, Clone)]
pub struct Request {
    /// Caller-chosen id.
    pub id: RequestId,
    /// Prompt token ids with image placeholders expanded.
    pub prompt: Vec<u32>,
    /// Images in prompt order.
    pub images: Vec<ImageInput>,
    /// Sampling settings.
    pub params: SamplingParams,
}

/// Sizes the engine runs with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineConfig {
    /// KV blocks including the null block.
    pub num_blocks: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Longest prompt plus output.
    pub max_model_len: usize,
    /// Reuse KV blocks across requests.
    pub enable_prefix_caching: bool,
    /// Encoder cache and per-step encoder budget in tokens.
    pub encoder_cache_tokens: usize,
    /// Most running requests.
    pub max_num_seqs: usize,
    /// Most tokens per step.
    pub max_num_batched_tokens: usize,
}

/// Why a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// An end-of-sequence or stop token.
    Stop,
    /// `max_tokens` or `max_model_len` reached.
    Length,
    /// Aborted by the caller.
    Abort,
}

/// A generated token.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenEvent {
    /// The request.
    pub id: RequestId,
    /// The token.
    pub token: u32,
    /// Its log-probability.
    pub logprob: f32,
    /// Top log-probabilities when asked for.
    pub top_logprobs: Vec<(u32, f32)>,
    /// Set on the request's last token.
    pub finish: Option<FinishReason>,
}

/// Work counters, for tests and metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct EngineCounters {
    /// Images that went through the vision tower.
    pub vision_runs: u64,
    /// Encoder-cache hits (an image's output was reused).
    pub encoder_hits: u64,
    /// Prompt tokens computed by the decoder (prefix-cache hits excluded).
    pub prompt_tokens_computed: u64,
    /// Prompt tokens served from the prefix cache.
    pub prompt_tokens_cached: u64,
    /// Tokens generated.
    pub generated_tokens: u64,
    /// Decoder passes.
    pub steps: u64,
}

/// The engine's occupancy at one moment: what `/v1/memory` and the playground show.
#[derive(Debug, Clone, serde::Serialize)]
pub struct EngineSnapshot {
    /// Bytes the backend holds, by category.
    pub ledger: Vec<LedgerEntry>,
    /// KV blocks: counts, states and block tables.
    pub kv: KvSummary,
    /// Encoder-cache entries and their references.
    pub encoder_cache: EncoderCacheSnapshot,
    /// Requests scheduled at least once and not finished.
    pub num_running: usize,
    /// Requests queued (new or preempted).
    pub num_waiting: usize,
    /// Work counters so far.
    pub counters: EngineCounters,
}

/// Why the engine refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A request that cannot run (too long, bad parameters, duplicate id).
    #[error("{0}")]
    BadRequest(String),
    /// Cache bookkeeping failed (a bug).
    #[error(transparent)]
    Cache(#[from] CacheError),
    /// The model failed.
    #[error(transparent)]
    Model(#[from] ModelError),
}

#[derive(Debug)]
struct Seq {
    req: Request,
    positions: Vec<[i64; 3]>,
    delta: i64,
    hashes: Vec<BlockHash>,
    spans: Vec<MmSpan>,
    output: Vec<u32>,
    computed: usize,
    rng: Rng,
}

impl Seq {
    fn tokens(&self) -> Vec<u32> {
        let mut all = self.req.prompt.clone();
        all.extend_from_slice(&self.output);
        all
    }

    fn len(&self) -> usize {
        self.req.prompt.len() + self.output.len()
    }

    fn token_at(&self, i: usize) -> u32 {
        if i < self.req.prompt.len() {
            self.req.prompt[i]
        } else {
            self.output[i - self.req.prompt.len()]
        }
    }

    fn position(&self, i: usize) -> [i64; 3] {
        self.positions.get(i).copied().unwrap_or([i as i64 + self.delta; 3])
    }
}

/// The engine.
#[derive(Debug)]
pub struct Engine<B: Backend> {
    be: B,
    model: QwenVl<B>,
    cfg: EngineConfig,
    kv: KvCacheManager,
    cache: B::KvCache,
    enc: EncoderCacheManager,
    enc_store: HashMap<MmHash, VisionOutput<B>>,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    counters: EngineCounters,
    next_seed: u64,
}

/// What one step schedules for one sequence.
#[derive(Debug)]
struct Scheduled {
    index: usize,
    num_new: usize,
}

impl<B: Backend> Engine<B> {
    /// An engine over a loaded model; allocates the KV cache.
    pub fn new(be: B, model: QwenVl<B>, cfg: EngineConfig) -> Result<Self, EngineError> {
        let t = &model.cfg.text;
        let layout = KvLayout {
            layers: t.num_hidden_layers,
            num_blocks: cfg.num_blocks,
            block_size: cfg.block_size,
            kv_heads: t.num_key_value_heads,
            head_dim: t.head_dim,
        };
        let cache = be.alloc_kv(layout).map_err(ModelError::from)?;
        let kv = KvCacheManager::new(
            cfg.num_blocks,
            cfg.block_size,
            cfg.max_model_len,
            cfg.enable_prefix_caching,
        )?;
        let mut enc = EncoderCacheManager::new(cfg.encoder_cache_tokens);
        enc.set_bytes_per_token((model.cfg.encoder_output_dim() * 4) as u64);
        Ok(Engine {
            be,
            model,
            cfg,
            kv,
            cache,
            enc,
            enc_store: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            counters: EngineCounters::default(),
            next_seed: 0,
        })
    }

    /// The backend (for its ledger).
    pub fn backend(&self) -> &B {
        &self.be
    }

    /// The model's config.
    pub fn model_config(&self) -> &crate::config::ModelConfig {
        &self.model.cfg
    }

    /// Work counters so far.
    pub fn counters(&self) -> EngineCounters {
        self.counters
    }

    /// The KV cache manager (for snapshots).
    pub fn kv(&self) -> &KvCacheManager {
        &self.kv
    }

    /// The encoder cache manager (for snapshots).
    pub fn encoder_cache(&self) -> &EncoderCacheManager {
        &self.enc
    }

    /// Requests scheduled at least once and not finished.
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Requests queued (new or preempted).
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Occupancy now: ledger, KV summary, encoder-cache entries, queue lengths, counters.
    pub fn snapshot(&self) -> EngineSnapshot {
        EngineSnapshot {
            ledger: self.be.ledger().entries(),
            kv: self.kv.summary(),
            encoder_cache: self.enc.snapshot(),
            num_running: self.running.len(),
            num_waiting: self.waiting.len(),
            counters: self.counters,
        }
    }

    /// Whether any request is waiting or running.
    pub fn has_unfinished(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// Queues a request after checking it can ever run.
    pub fn add_request(&mut self, req: Request) -> Result<(), EngineError> {
        req.params.validate().map_err(EngineError::BadRequest)?;
        if req.prompt.is_empty() {
            return Err(EngineError::BadRequest("the prompt is empty".into()));
        }
        let total = req.prompt.len() + req.params.max_tokens;
        if req.prompt.len() >= self.cfg.max_model_len {
            return Err(EngineError::BadRequest(format!(
                "the prompt has {} tokens; this model's maximum context length is {} tokens",
                req.prompt.len(),
                self.cfg.max_model_len
            )));
        }
        if total > self.cfg.max_model_len {
            return Err(EngineError::BadRequest(format!(
                "the prompt ({} tokens) plus max_tokens ({}) exceeds the maximum context length of {} tokens",
                req.prompt.len(),
                req.params.max_tokens,
                self.cfg.max_model_len
            )));
        }
        if self.waiting.iter().chain(&self.running).any(|s| s.req.id == req.id) {
            return Err(EngineError::BadRequest(format!(
                "request id {} is already in use",
                req.id
            )));
        }
        let image_token = self.model.cfg.tokens.image;
        let merge = self.model.cfg.vision.spatial_merge_size;
        let mut spans = Vec::new();
        let mut images = Vec::new();
        for img in &req.images {
            let [t, h, w] = img.grid_thw;
            let end = img.offset + img.num_tokens;
            if img.num_tokens != t * h * w / (merge * merge)
                || end > req.prompt.len()
                || req.prompt[img.offset..end].iter().any(|&id| id != image_token)
            {
                return Err(EngineError::BadRequest(
                    "image placeholders do not match the image grid".into(),
                ));
            }
            if img.num_tokens > self.cfg.encoder_cache_tokens {
                return Err(EngineError::BadRequest(format!(
                    "The decoder prompt contains an image item with length {}, which exceeds the pre-allocated encoder cache size {}",
                    img.num_tokens, self.cfg.encoder_cache_tokens
                )));
            }
            spans.push(MmSpan {
                hash: img.mm_hash.clone(),
                offset: img.offset,
                length: img.num_tokens,
            });
            images.push(ImageSpan {
                offset: img.offset,
                grid: [t, h / merge, w / merge],
            });
        }
        let (positions, delta) = mrope_positions(req.prompt.len(), &images);
        let mut hashes = Vec::new();
        extend_block_hashes(&mut hashes, &req.prompt, self.cfg.block_size, &spans, None)?;
        let seed = req.params.seed.unwrap_or_else(|| {
            self.next_seed += 1;
            self.next_seed
        });
        self.waiting.push_back(Seq {
            rng: Rng::new(seed),
            req,
            positions,
            delta,
            hashes,
            spans,
            output: Vec::new(),
            computed: 0,
        });
        Ok(())
    }

    /// Drops a request wherever it is, returning its KV blocks and encoder references at once.
    pub fn abort(&mut self, id: &RequestId) -> Result<bool, EngineError> {
        if let Some(i) = self.waiting.iter().position(|s| &s.req.id == id) {
            self.waiting.remove(i);
            // A waiting request holds no KV blocks, but a scheduling attempt that stopped short may
            // already have referenced cached encoder outputs.
            self.enc.free(id);
            self.drop_freed_encoder_outputs();
            return Ok(true);
        }
        if let Some(i) = self.running.iter().position(|s| &s.req.id == id) {
            let seq = self.running.remove(i);
            self.release(&seq)?;
            return Ok(true);
        }
        Ok(false)
    }

    fn release(&mut self, seq: &Seq) -> Result<(), EngineError> {
        self.kv.free(&seq.req.id)?;
        self.enc.free(&seq.req.id);
        self.drop_freed_encoder_outputs();
        Ok(())
    }

    fn drop_freed_encoder_outputs(&mut self) {
        for h in self.enc.get_freed_mm_hashes() {
            self.enc_store.remove(&h);
        }
    }

    /// Drops every encoder output not in use; returns the bytes released.
    pub fn reset_encoder_cache(&mut self) -> u64 {
        let before = self.be.ledger().bytes(Category::EncoderCache);
        self.enc.reset();
        self.drop_freed_encoder_outputs();
        before.saturating_sub(self.be.ledger().bytes(Category::EncoderCache))
    }

    /// Forgets every cached prefix block; refuses while requests hold blocks.
    pub fn reset_prefix_cache(&mut self) -> Result<(), EngineError> {
        Ok(self.kv.reset_prefix_cache()?)
    }

    /// Images of `seq` whose placeholders overlap `[from, to)`.
    fn images_in(seq: &Seq, from: usize, to: usize) -> Vec<usize> {
        (0..seq.req.images.len())
            .filter(|&i| {
                let img = &seq.req.images[i];
                img.offset < to && img.offset + img.num_tokens > from
            })
            .collect()
    }

    /// Tries to reserve encoder room and KV blocks for `num_new` tokens of `seq`; returns the
    /// (possibly reduced) token count, or 0 when nothing can run.
    fn reserve(&mut self, seq: &Seq, computed: &ComputedBlocks, mut num_new: usize) -> Result<usize, EngineError> {
        let start = seq.computed + computed.num_tokens();
        let mut pending = 0;
        for i in Self::images_in(seq, start, start + num_new) {
            let img = &seq.req.images[i];
            if self.enc.check_and_update_cache(&seq.req.id, &img.mm_hash) {
                continue;
            }
            if !self
                .enc
                .can_allocate(img.num_tokens, self.cfg.encoder_cache_tokens, pending)
            {
                // Schedule only the text before the image.
                num_new = img.offset.saturating_sub(start);
                break;
            }
            pending += img.num_tokens;
        }
        if num_new == 0 {
            return Ok(0);
        }
        let allocated = self
            .kv
            .allocate_slots(&seq.req.id, num_new, seq.computed, computed, &seq.hashes)?
            .is_some();
        if !allocated {
            return Ok(0);
        }
        for i in Self::images_in(seq, start, start + num_new) {
            let img = &seq.req.images[i];
            if !self.enc.is_cached(&img.mm_hash) {
                self.enc.allocate(&seq.req.id, &img.mm_hash, img.num_tokens)?;
            } else {
                self.enc.check_and_update_cache(&seq.req.id, &img.mm_hash);
            }
        }
        Ok(num_new)
    }

    /// Runs one step; returns the tokens generated in it.
    pub fn step(&mut self) -> Result<Vec<TokenEvent>, EngineError> {
        let mut budget = self.cfg.max_num_batched_tokens;
        let mut plan: Vec<Scheduled> = Vec::new();
        // Running requests first.
        let running = std::mem::take(&mut self.running);
        let mut kept = Vec::with_capacity(running.len());
        for seq in running {
            if budget == 0 {
                kept.push(seq);
                continue;
            }
            let want = (seq.len() - seq.computed).min(budget);
            let n = self.reserve(&seq, &ComputedBlocks::default(), want)?;
            if n > 0 {
                plan.push(Scheduled {
                    index: kept.len(),
                    num_new: n,
                });
                budget -= n;
            }
            kept.push(seq);
        }
        self.running = kept;
        // Then waiting ones, in order, while there is room.
        while budget > 0 && self.running.len() < self.cfg.max_num_seqs {
            let Some(mut seq) = self.waiting.pop_front() else { break };
            let hit = self.kv.get_computed_blocks(&seq.hashes, seq.req.prompt.len());
            let want = (seq.len() - hit.num_tokens()).min(budget);
            let n = self.reserve(&seq, &hit, want)?;
            if n == 0 {
                self.waiting.push_front(seq);
                break;
            }
            seq.computed = hit.num_tokens();
            self.counters.prompt_tokens_cached += hit.num_tokens() as u64;
            plan.push(Scheduled {
                index: self.running.len(),
                num_new: n,
            });
            budget -= n;
            self.running.push(seq);
        }
        if plan.is_empty() {
            return Ok(Vec::new());
        }
        self.encode_images(&plan)?;
        let mut events = self.forward(&plan)?;
        self.finish_step(&plan, &mut events)?;
        Ok(events)
    }

    /// Runs the vision tower for scheduled images not yet in the encoder cache.
    fn encode_images(&mut self, plan: &[Scheduled]) -> Result<(), EngineError> {
        for s in plan {
            let seq = &self.running[s.index];
            for i in Self::images_in(seq, seq.computed, seq.computed + s.num_new) {
                let img = &seq.req.images[i];
                if self.enc_store.contains_key(&img.mm_hash) {
                    self.counters.encoder_hits += 1;
                    continue;
                }
                let patches: usize = img.grid_thw.iter().product();
                let cols = img.pixel_values.len() / patches.max(1);
                let px = self
                    .be
                    .upload(img.pixel_values.clone(), &[patches, cols])
                    .map_err(ModelError::from)?;
                let out = self.model.vision.forward(&self.be, &px, &[img.grid_thw])?;
                // Kept outputs are encoder cache from now on, not transient activations.
                let out = VisionOutput {
                    main: self.be.keep(&out.main, Category::EncoderCache),
                    deepstack: out
                        .deepstack
                        .iter()
                        .map(|d| self.be.keep(d, Category::EncoderCache))
                        .collect(),
                };
                self.counters.vision_runs += 1;
                self.enc_store.insert(img.mm_hash.clone(), out);
            }
        }
        Ok(())
    }

    /// One batched decoder pass over every scheduled token; samples where a sequence reached its end.
    fn forward(&mut self, plan: &[Scheduled]) -> Result<Vec<TokenEvent>, EngineError> {
        let be = &self.be;
        let bs = self.cfg.block_size;
        let mut ids = Vec::new();
        let mut positions = Vec::new();
        let mut slots = Vec::new();
        let mut image_rows = Vec::new();
        let mut image_parts = Vec::new();
        let deep_levels = self.model.cfg.vision.deepstack_visual_indexes.len();
        let mut deep_parts: Vec<Vec<B::Tensor>> = vec![Vec::new(); deep_levels];
        let mut last_rows = Vec::new();
        for s in plan {
            let seq = &self.running[s.index];
            let table = self.kv.block_table(&seq.req.id);
            let row0 = ids.len();
            for i in seq.computed..seq.computed + s.num_new {
                ids.push(seq.token_at(i));
                positions.push(seq.position(i));
                slots.push(table[i / bs] * bs + i % bs);
            }
            for i in Self::images_in(seq, seq.computed, seq.computed + s.num_new) {
                let img = &seq.req.images[i];
                let entry = self
                    .enc_store
                    .get(&img.mm_hash)
                    .ok_or_else(|| ModelError::Input(format!("encoder output for {} is missing", img.mm_hash)))?;
                let from = seq.computed.max(img.offset);
                let to = (seq.computed + s.num_new).min(img.offset + img.num_tokens);
                let rows: Vec<usize> = (from - img.offset..to - img.offset).collect();
                image_parts.push(be.gather_rows(&entry.main, &rows).map_err(ModelError::from)?);
                for (k, d) in entry.deepstack.iter().enumerate().take(deep_levels) {
                    deep_parts[k].push(be.gather_rows(d, &rows).map_err(ModelError::from)?);
                }
                image_rows.extend((from..to).map(|p| row0 + p - seq.computed));
            }
            if seq.computed + s.num_new == seq.len() {
                last_rows.push((s.index, ids.len() - 1));
            }
        }
        let mut embeds = self.model.text.embed(be, &ids)?;
        let mut deep = Vec::new();
        if !image_rows.is_empty() {
            let feats = be.concat_rows(&image_parts).map_err(ModelError::from)?;
            embeds = be
                .scatter_rows(&embeds, &image_rows, &feats, false)
                .map_err(ModelError::from)?;
            for parts in &deep_parts {
                deep.push(be.concat_rows(parts).map_err(ModelError::from)?);
            }
        }
        let (cos, sin) = mrope_tables(&self.model.cfg.text, &positions);
        let hd = self.model.cfg.text.head_dim;
        let cos = be.upload(cos, &[ids.len(), hd]).map_err(ModelError::from)?;
        let sin = be.upload(sin, &[ids.len(), hd]).map_err(ModelError::from)?;
        let tables: Vec<Vec<usize>> = plan
            .iter()
            .map(|s| self.kv.block_table(&self.running[s.index].req.id).to_vec())
            .collect();
        let mut seqs = Vec::with_capacity(plan.len());
        let mut start = 0;
        for (s, table) in plan.iter().zip(&tables) {
            let seq = &self.running[s.index];
            seqs.push(PagedSeq {
                query_start: start,
                query_len: s.num_new,
                context_len: seq.computed + s.num_new,
                block_table: table,
            });
            start += s.num_new;
        }
        let hidden = self.model.text.forward(
            be,
            &mut self.cache,
            DecoderInput {
                embeds,
                cos,
                sin,
                slots: &slots,
                seqs: &seqs,
                deepstack: if deep.is_empty() {
                    None
                } else {
                    Some((&deep, &image_rows))
                },
            },
        )?;
        self.counters.steps += 1;
        let mut events = Vec::new();
        if last_rows.is_empty() {
            return Ok(events);
        }
        let rows: Vec<usize> = last_rows.iter().map(|r| r.1).collect();
        let logits = self
            .model
            .text
            .logits(be, &be.gather_rows(&hidden, &rows).map_err(ModelError::from)?)?;
        let logits = be.download(&logits).map_err(ModelError::from)?;
        let vocab = logits.len() / rows.len();
        for (k, &(index, _)) in last_rows.iter().enumerate() {
            let seq = &mut self.running[index];
            let l = &logits[k * vocab..(k + 1) * vocab];
            let s = sample(l, &seq.req.prompt, &seq.output, &seq.req.params, &mut seq.rng);
            events.push(TokenEvent {
                id: seq.req.id.clone(),
                token: s.token,
                logprob: s.logprob,
                top_logprobs: s.top,
                finish: None,
            });
        }
        Ok(events)
    }

    /// Advances computed counts, appends sampled tokens, applies stop rules and frees what finished.
    fn finish_step(&mut self, plan: &[Scheduled], events: &mut [TokenEvent]) -> Result<(), EngineError> {
        let eos = self.model.cfg.tokens.eos.clone();
        for s in plan {
            let seq = &mut self.running[s.index];
            if seq.computed < seq.req.prompt.len() {
                let prompt_part = (seq.computed + s.num_new).min(seq.req.prompt.len()) - seq.computed;
                self.counters.prompt_tokens_computed += prompt_part as u64;
            }
            seq.computed += s.num_new;
            // Encoder outputs whose placeholders are now all in the KV cache are no longer needed.
            let done: Vec<MmHash> = seq
                .req
                .images
                .iter()
                .filter(|img| img.offset + img.num_tokens <= seq.computed)
                .map(|img| img.mm_hash.clone())
                .collect();
            for h in done {
                self.enc.free_encoder_input(&seq.req.id, &h);
            }
        }
        let mut finished = Vec::new();
        for e in events.iter_mut() {
            let Some(i) = self.running.iter().position(|s| s.req.id == e.id) else {
                continue;
            };
            let seq = &mut self.running[i];
            seq.output.push(e.token);
            self.counters.generated_tokens += 1;
            let p = &seq.req.params;
            let stop = (!p.ignore_eos && eos.contains(&e.token)) || p.stop_token_ids.contains(&e.token);
            let length = seq.output.len() >= p.max_tokens || seq.len() >= self.cfg.max_model_len;
            if stop || length {
                e.finish = Some(if stop { FinishReason::Stop } else { FinishReason::Length });
                finished.push(i);
            } else {
                let tokens = seq.tokens();
                extend_block_hashes(&mut seq.hashes, &tokens, self.cfg.block_size, &seq.spans, None)?;
            }
        }
        finished.sort_by_key(|&i| std::cmp::Reverse(i));
        for i in finished {
            let seq = self.running.remove(i);
            self.release(&seq)?;
        }
        self.drop_freed_encoder_outputs();
        Ok(())
    }
}
