//! The engine: requests in, tokens out, one [`Engine::step`] at a time. Each step asks the
//! [scheduler](crate::sched) which requests get how many tokens (running ones first, preempting
//! under KV pressure, then waiting ones; chunked prefill; prefix-cache and encoder-cache reuse),
//! runs the vision tower for the images it names, runs one batched decoder pass over every
//! scheduled token, samples where a request reached its end, and reports back what finished. The
//! engine spawns no threads: its caller drives `step`.

use crate::backend::{Backend, KvLayout, PagedSeq};
use crate::cache::{
    CacheError, EncoderCacheManager, EncoderCacheSnapshot, KvCacheManager, KvSummary, MmHash, MmSpan, RequestId,
};
use crate::fault::{FaultKind, FaultPlan, Faults};
use crate::memory::ledger::{Category, LedgerEntry};
use crate::model::rope::{mrope_positions, mrope_tables, ImageSpan};
use crate::model::text::DecoderInput;
use crate::model::vision::VisionOutput;
use crate::model::{ModelError, QwenVl};
use crate::sample::{sample, Rng, SamplingParams};
use crate::sched::{SchedError, ScheduledSeq, Scheduler, SchedulerConfig};
use std::collections::HashMap;

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
    /// Most tokens one request computes per step (0 = no cap), see
    /// [`SchedulerConfig::long_prefill_token_threshold`].
    pub long_prefill_token_threshold: usize,
    /// Tokens the sampler may return: the tokenizer's vocabulary (the lm_head's rows past it are
    /// padding, never a token). 0 means every row.
    pub vocab_size: usize,
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

impl FinishReason {
    /// The name OpenAI's `finish_reason` and vLLM's metrics use.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        }
    }
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
    /// Images whose placeholders the prefix cache already held when their request was admitted:
    /// neither the vision tower nor the encoder cache was needed.
    pub prefix_cached_images: u64,
    /// Prompt tokens computed by the decoder (prefix-cache hits excluded, recomputation after
    /// preemption included).
    pub prompt_tokens_computed: u64,
    /// Tokens served from the prefix cache when a request was admitted (a resumed request may
    /// also find its own generated tokens there).
    pub prompt_tokens_cached: u64,
    /// Tokens generated.
    pub generated_tokens: u64,
    /// Decoder passes.
    pub steps: u64,
    /// Running requests preempted (their KV freed, to be recomputed) for lack of KV blocks.
    pub num_preemptions: u64,
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
    /// Requests holding KV blocks (admitted, not finished or preempted).
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

impl From<SchedError> for EngineError {
    fn from(e: SchedError) -> Self {
        match e {
            SchedError::BadRequest(msg) => EngineError::BadRequest(msg),
            SchedError::Cache(e) => EngineError::Cache(e),
        }
    }
}

/// What the engine keeps per request beside the scheduler's bookkeeping; it survives preemption.
#[derive(Debug)]
struct SeqData {
    images: Vec<ImageInput>,
    params: SamplingParams,
    rng: Rng,
    /// M-RoPE positions of the prompt tokens.
    positions: Vec<[i64; 3]>,
    /// Offset of the positions after the prompt.
    delta: i64,
}

impl SeqData {
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
    cache: B::KvCache,
    sched: Scheduler<SeqData>,
    enc_store: HashMap<MmHash, VisionOutput<B>>,
    counters: EngineCounters,
    faults: Faults,
    next_seed: u64,
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
        let sched_cfg = SchedulerConfig {
            max_num_seqs: cfg.max_num_seqs,
            max_num_batched_tokens: cfg.max_num_batched_tokens,
            max_num_encoder_input_tokens: cfg.encoder_cache_tokens,
            long_prefill_token_threshold: cfg.long_prefill_token_threshold,
        };
        Ok(Engine {
            be,
            model,
            cfg,
            cache,
            sched: Scheduler::new(sched_cfg, kv, enc),
            enc_store: HashMap::new(),
            counters: EngineCounters::default(),
            faults: Faults::default(),
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

    /// Makes the planned operation fail when it comes (see [`crate::fault`]); counting starts now.
    pub fn inject_fault(&mut self, plan: Option<FaultPlan>) {
        self.faults = Faults::new(plan);
    }

    /// Work counters so far.
    pub fn counters(&self) -> EngineCounters {
        self.counters
    }

    /// The KV cache manager (for snapshots).
    pub fn kv(&self) -> &KvCacheManager {
        self.sched.kv()
    }

    /// The encoder cache manager (for snapshots).
    pub fn encoder_cache(&self) -> &EncoderCacheManager {
        self.sched.encoder_cache()
    }

    /// Requests holding KV blocks (admitted, not finished or preempted).
    pub fn num_running(&self) -> usize {
        self.sched.num_running()
    }

    /// Requests queued (new or preempted).
    pub fn num_waiting(&self) -> usize {
        self.sched.num_waiting()
    }

    /// Occupancy now: ledger, KV summary, encoder-cache entries, queue lengths, counters.
    pub fn snapshot(&self) -> EngineSnapshot {
        EngineSnapshot {
            ledger: self.be.ledger().entries(),
            kv: self.kv().summary(),
            encoder_cache: self.encoder_cache().snapshot(),
            num_running: self.num_running(),
            num_waiting: self.num_waiting(),
            counters: self.counters,
        }
    }

    /// Whether any request is waiting or running.
    pub fn has_unfinished(&self) -> bool {
        self.sched.has_unfinished()
    }

    /// Queues a request after checking it can ever run.
    pub fn add_request(&mut self, req: Request) -> Result<(), EngineError> {
        req.params.validate().map_err(EngineError::BadRequest)?;
        let image_token = self.model.cfg.tokens.image;
        let merge = self.model.cfg.vision.spatial_merge_size;
        let mut spans = Vec::new();
        let mut placed = Vec::new();
        for img in &req.images {
            let [t, h, w] = img.grid_thw;
            let placeholders = req.prompt.get(img.offset..img.offset + img.num_tokens);
            if img.num_tokens != t * h * w / (merge * merge)
                || placeholders.is_none_or(|p| p.iter().any(|&id| id != image_token))
            {
                return Err(EngineError::BadRequest(
                    "image placeholders do not match the image grid".into(),
                ));
            }
            spans.push(MmSpan {
                hash: img.mm_hash.clone(),
                offset: img.offset,
                length: img.num_tokens,
            });
            placed.push(ImageSpan {
                offset: img.offset,
                grid: [t, h / merge, w / merge],
            });
        }
        let (positions, delta) = mrope_positions(req.prompt.len(), &placed);
        let seed = req.params.seed.unwrap_or_else(|| {
            self.next_seed += 1;
            self.next_seed
        });
        let max_tokens = req.params.max_tokens;
        let data = SeqData {
            images: req.images,
            rng: Rng::new(seed),
            params: req.params,
            positions,
            delta,
        };
        Ok(self.sched.add(req.id, req.prompt, spans, max_tokens, data)?)
    }

    /// Drops a request wherever it is, returning its KV blocks and encoder references at once.
    pub fn abort(&mut self, id: &RequestId) -> Result<bool, EngineError> {
        Ok(self.sched.abort(id)?.is_some())
    }

    /// Drops every encoder output not in use; returns the bytes released.
    pub fn reset_encoder_cache(&mut self) -> u64 {
        let before = self.be.ledger().bytes(Category::EncoderCache);
        for h in self.sched.reset_encoder_cache() {
            self.enc_store.remove(&h);
        }
        before.saturating_sub(self.be.ledger().bytes(Category::EncoderCache))
    }

    /// Forgets every cached prefix block; refuses while requests hold blocks.
    pub fn reset_prefix_cache(&mut self) -> Result<(), EngineError> {
        Ok(self.sched.reset_prefix_cache()?)
    }

    /// Runs one step; returns the tokens generated in it. When the model fails mid-step, every
    /// request is dropped and both caches are emptied (the step may have hashed blocks it never
    /// wrote and reserved encoder entries it never filled) before the error is returned.
    pub fn step(&mut self) -> Result<Vec<TokenEvent>, EngineError> {
        let out = self.sched.schedule()?;
        for h in &out.freed_mm_hashes {
            self.enc_store.remove(h);
        }
        self.counters.num_preemptions += out.preempted.len() as u64;
        if out.scheduled.is_empty() {
            return Ok(Vec::new());
        }
        let computed = self
            .encode_images(&out.scheduled)
            .and_then(|()| self.forward(&out.scheduled));
        match computed {
            Ok(sampled) => self.finish_step(&out.scheduled, sampled),
            Err(e) => {
                self.drop_everything()?;
                Err(e)
            }
        }
    }

    /// Aborts every request and empties the encoder and prefix caches.
    fn drop_everything(&mut self) -> Result<(), EngineError> {
        let ids: Vec<RequestId> = self
            .sched
            .running()
            .iter()
            .chain(self.sched.waiting())
            .map(|s| s.id().clone())
            .collect();
        for id in &ids {
            self.abort(id)?;
        }
        self.reset_encoder_cache();
        self.reset_prefix_cache()
    }

    /// Runs the vision tower for the images the scheduler named; counts reused outputs as hits.
    fn encode_images(&mut self, plan: &[ScheduledSeq]) -> Result<(), EngineError> {
        for s in plan {
            let seq = &self.sched.running()[s.index];
            if s.num_cached > 0 {
                let covered = seq
                    .data
                    .images
                    .iter()
                    .filter(|img| img.offset + img.num_tokens <= s.start);
                self.counters.prefix_cached_images += covered.count() as u64;
            }
            for i in seq.images_in(s.start, s.end()) {
                if !s.encode.contains(&i) {
                    // Once per use: in the step that reaches the image's first placeholder.
                    if seq.data.images[i].offset >= s.start {
                        self.counters.encoder_hits += 1;
                    }
                    continue;
                }
                let img = &seq.data.images[i];
                let patches: usize = img.grid_thw.iter().product();
                let cols = img.pixel_values.len() / patches.max(1);
                let ledger = self.be.ledger();
                let bytes = (img.pixel_values.len() * 4) as u64;
                self.faults
                    .check(FaultKind::Alloc, bytes, ledger)
                    .and_then(|()| self.faults.check(FaultKind::VisionTower, 0, ledger))
                    .map_err(ModelError::from)?;
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

    /// One batched decoder pass over every scheduled token; samples for each request whose
    /// scheduled tokens reach its end, returning `(index in running, event)`.
    fn forward(&mut self, plan: &[ScheduledSeq]) -> Result<Vec<(usize, TokenEvent)>, EngineError> {
        self.faults
            .check(FaultKind::Decoder, 0, self.be.ledger())
            .map_err(ModelError::from)?;
        let be = &self.be;
        let bs = self.cfg.block_size;
        let running = self.sched.running();
        let kv = self.sched.kv();
        let mut ids = Vec::new();
        let mut positions = Vec::new();
        let mut slots = Vec::new();
        let mut image_rows = Vec::new();
        let mut image_parts = Vec::new();
        let deep_levels = self.model.cfg.vision.deepstack_visual_indexes.len();
        let mut deep_parts: Vec<Vec<B::Tensor>> = vec![Vec::new(); deep_levels];
        let mut last_rows = Vec::new();
        let mut seqs = Vec::with_capacity(plan.len());
        for s in plan {
            let seq = &running[s.index];
            let table = kv.block_table(seq.id());
            let row0 = ids.len();
            for i in s.start..s.end() {
                ids.push(seq.token_at(i));
                positions.push(seq.data.position(i));
                slots.push(table[i / bs] * bs + i % bs);
            }
            for i in seq.images_in(s.start, s.end()) {
                let img = &seq.data.images[i];
                let entry = self
                    .enc_store
                    .get(&img.mm_hash)
                    .ok_or_else(|| ModelError::Input(format!("encoder output for {} is missing", img.mm_hash)))?;
                let from = s.start.max(img.offset);
                let to = s.end().min(img.offset + img.num_tokens);
                let rows: Vec<usize> = (from - img.offset..to - img.offset).collect();
                image_parts.push(be.gather_rows(&entry.main, &rows).map_err(ModelError::from)?);
                for (k, d) in entry.deepstack.iter().enumerate().take(deep_levels) {
                    deep_parts[k].push(be.gather_rows(d, &rows).map_err(ModelError::from)?);
                }
                image_rows.extend((from..to).map(|p| row0 + p - s.start));
            }
            if s.end() == seq.len() {
                last_rows.push((s.index, ids.len() - 1));
            }
            seqs.push(PagedSeq {
                query_start: row0,
                query_len: s.num_new,
                context_len: s.end(),
                block_table: table,
            });
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
        if last_rows.is_empty() {
            return Ok(Vec::new());
        }
        let rows: Vec<usize> = last_rows.iter().map(|r| r.1).collect();
        let logits = self
            .model
            .text
            .logits(be, &be.gather_rows(&hidden, &rows).map_err(ModelError::from)?)?;
        let logits = be.download(&logits).map_err(ModelError::from)?;
        let vocab = logits.len() / rows.len();
        let mut sampled = Vec::with_capacity(last_rows.len());
        for (k, &(index, _)) in last_rows.iter().enumerate() {
            let seq = &mut self.sched.running_mut()[index];
            let id = seq.id().clone();
            let (prompt, output, data) = seq.split_data_mut();
            let row = &logits[k * vocab..(k + 1) * vocab];
            let allowed = match self.cfg.vocab_size {
                0 => vocab,
                n => n,
            };
            let s = sample(row, allowed, prompt, output, &data.params, &mut data.rng);
            let event = TokenEvent {
                id,
                token: s.token,
                logprob: s.logprob,
                top_logprobs: s.top,
                finish: None,
            };
            sampled.push((index, event));
        }
        Ok(sampled)
    }

    /// Counts the step's work, appends the sampled tokens, applies stop rules and lets the
    /// scheduler release what finished.
    fn finish_step(
        &mut self,
        plan: &[ScheduledSeq],
        sampled: Vec<(usize, TokenEvent)>,
    ) -> Result<Vec<TokenEvent>, EngineError> {
        for s in plan {
            let prompt_len = self.sched.running()[s.index].prompt().len();
            self.counters.prompt_tokens_computed += (s.end().min(prompt_len) - s.start.min(prompt_len)) as u64;
            self.counters.prompt_tokens_cached += s.num_cached as u64;
        }
        let eos = &self.model.cfg.tokens.eos;
        let mut finished = Vec::new();
        let mut events = Vec::with_capacity(sampled.len());
        for (index, mut e) in sampled {
            self.sched.push_token(index, e.token)?;
            self.counters.generated_tokens += 1;
            let seq = &self.sched.running()[index];
            let p = &seq.data.params;
            let stop = (!p.ignore_eos && eos.contains(&e.token)) || p.stop_token_ids.contains(&e.token);
            let length = seq.output().len() >= p.max_tokens || seq.len() >= self.cfg.max_model_len;
            if stop || length {
                e.finish = Some(if stop { FinishReason::Stop } else { FinishReason::Length });
                finished.push(index);
            }
            events.push(e);
        }
        self.sched.finish(&finished)?;
        Ok(events)
    }
}
