//! The engine: requests in, tokens out, one step at a time. A step has two halves around its one
//! asynchronous point (vLLM's `schedule` / `update_from_output`):
//!
//! 1. [`Engine::launch`] asks the [scheduler](crate::sched) which requests get how many tokens
//!    (running ones first, preempting under KV pressure, then waiting ones; chunked prefill;
//!    prefix-cache and encoder-cache reuse), has the [model runner](crate::runner) encode the images
//!    it names and record one batched decoder pass, and queues the read of the logits rows (or,
//!    when every sampling request allows it, of the tokens sampled from them on the device).
//! 2. [`Engine::complete`] takes what was read: samples (unless the device did), applies stop
//!    rules, releases what finished.
//!
//! [`Engine::step_async`] awaits the read between the two (the browser); [`Engine::step`] blocks on
//! it (native callers). The engine spawns no threads: its caller drives the steps.

use crate::backend::{block_on, BResult, BackendError, DeviceSamplingSupport, TableShape};
use crate::cache::{
    CacheError, EncoderCacheManager, EncoderCacheSnapshot, KvCacheManager, KvSummary, MmHash, MmSpan, RequestId,
};
use crate::fault::{FaultKind, FaultPlan, Faults};
use crate::memory::ledger::{Category, LedgerEntry, MemoryLedger};
use crate::model::rope::{mrope_positions, ImageSpan};
use crate::model::ModelError;
use crate::runner::{BatchSeq, ImageRows, StepBatch, StepOutput, StepRead, StepRunner};
use crate::sample::{sample, DeviceSampling, Rng, Sampled, SamplingParams};
use crate::sched::{SchedError, ScheduledSeq, Scheduler, SchedulerConfig};

/// A preprocessed image placed in a prompt.
#[derive(Debug, Clone)]
pub struct ImageInput {
    /// Patch rows `[patches, C·T·P·P]`, flattened.
    pub pixel_values: std::sync::Arc<Vec<f32>>,
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
    /// The request failed (its engine step failed, or its tokens could not be detokenized), as
    /// vLLM's `error`.
    Error,
}

impl FinishReason {
    /// The name OpenAI's `finish_reason` and vLLM's metrics use.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
            FinishReason::Error => "error",
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
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct EngineCounters {
    /// Images that went through the vision tower.
    pub vision_runs: u64,
    /// Encoder-cache hits (an image's output was reused), including images whose start the
    /// prefix cache held and whose rest the decoder computed from the cached output.
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
    /// Positions the decoder computed, prompt and output, recomputation after preemption
    /// included (prefix-cache hits excluded).
    #[serde(default)]
    pub tokens_computed: u64,
    /// Decoder passes.
    pub steps: u64,
    /// Running requests preempted (their KV freed, to be recomputed) for lack of KV blocks.
    pub num_preemptions: u64,
}

/// The engine's occupancy at one moment: what `/v1/memory` and the playground show.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
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
    /// A hybrid model's state slots and the running requests holding them.
    #[serde(default)]
    pub states: Option<crate::runner::StateSlots>,
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
    /// The engine cannot be resized while requests are unfinished.
    #[error("the engine has unfinished requests; resize it when they are done")]
    Busy,
}

impl From<BackendError> for EngineError {
    fn from(e: BackendError) -> Self {
        EngineError::Model(e.into())
    }
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
    /// Blocks of its KV block table the runner has (0 after a preemption).
    blocks_sent: usize,
}

impl SeqData {
    fn position(&self, i: usize) -> [i64; 3] {
        self.positions.get(i).copied().unwrap_or([i as i64 + self.delta; 3])
    }
}

/// The engine, over a model runner on any backend.
#[derive(Debug)]
pub struct Engine {
    runner: Box<dyn StepRunner>,
    cfg: EngineConfig,
    sched: Scheduler<SeqData>,
    counters: EngineCounters,
    faults: Faults,
    next_seed: u64,
    /// Requests that left the running set since the last batch, whose block-table rows the runner
    /// frees.
    released: Vec<RequestId>,
}

/// A step recorded on the device whose read has not completed: [`Engine::complete`] takes it with
/// the read's result.
#[derive(Debug)]
pub struct LaunchedStep {
    scheduled: Vec<ScheduledSeq>,
    read: StepRead,
}

impl LaunchedStep {
    /// Splits the step into what [`Engine::complete`] needs and the pending read.
    pub fn into_parts(self) -> (StepMeta, Option<crate::backend::Readback>) {
        let meta = StepMeta {
            scheduled: self.scheduled,
            rows: self.read.rows,
            output: self.read.output,
        };
        (meta, self.read.read)
    }
}

/// What a launched step scheduled, by request id, whose logits rows it reads, and whether it reads
/// the logits or the tokens the device sampled from them.
#[derive(Debug)]
pub struct StepMeta {
    scheduled: Vec<ScheduledSeq>,
    rows: Vec<RequestId>,
    output: StepOutput,
}

impl Engine {
    /// An engine over a model runner (a [`crate::runner::ModelRunner`] on some backend); allocates
    /// the runner's KV cache for `cfg`.
    pub fn new(mut runner: Box<dyn StepRunner>, cfg: EngineConfig) -> Result<Self, EngineError> {
        let sched = Self::scheduler(&mut *runner, cfg)?;
        Ok(Engine {
            runner,
            cfg,
            sched,
            counters: EngineCounters::default(),
            faults: Faults::default(),
            next_seed: 0,
            released: Vec::new(),
        })
    }

    /// Allocates the runner's KV cache for `cfg` and a scheduler over it.
    fn scheduler(runner: &mut dyn StepRunner, cfg: EngineConfig) -> Result<Scheduler<SeqData>, EngineError> {
        let tables = TableShape {
            rows: cfg.max_num_seqs,
            max_blocks: cfg.max_model_len.div_ceil(cfg.block_size.max(1)),
        };
        runner.allocate_kv(cfg.num_blocks, cfg.block_size, tables)?;
        // A prefix hit skips computing tokens whose Gated DeltaNet state kvlens does not keep
        // (vLLM keeps states at block boundaries only in its "align" mode), so hybrid models
        // run without prefix caching, as vLLM 0.17 runs them by default.
        let hybrid = runner.model_config().text.linear.is_some();
        let kv = KvCacheManager::new(
            cfg.num_blocks,
            cfg.block_size,
            cfg.max_model_len,
            cfg.enable_prefix_caching && !hybrid,
        )?;
        let mut enc = EncoderCacheManager::new(cfg.encoder_cache_tokens);
        enc.set_bytes_per_token(runner.encoder_bytes_per_token());
        let sched_cfg = SchedulerConfig {
            max_num_seqs: cfg.max_num_seqs,
            max_num_batched_tokens: cfg.max_num_batched_tokens,
            max_num_encoder_input_tokens: cfg.encoder_cache_tokens,
            long_prefill_token_threshold: cfg.long_prefill_token_threshold,
        };
        Ok(Scheduler::new(sched_cfg, kv, enc))
    }

    /// Resizes an idle engine to `cfg` on the model it holds (the lessons' scaled-down budgets):
    /// the KV cache is allocated anew, empty, and the encoder cache emptied. The engine's counters
    /// carry on; the caches' own statistics (evictions, prefix and encoder hits) start again at 0,
    /// and KV event recording and block residency start over, off. Refused while requests are
    /// unfinished. When the new KV cache cannot be allocated, the old sizes are allocated again
    /// and the error returned.
    pub fn reconfigure(&mut self, cfg: EngineConfig) -> Result<(), EngineError> {
        if self.has_unfinished() {
            return Err(EngineError::Busy);
        }
        self.reset_encoder_cache();
        self.released.clear();
        match Self::scheduler(&mut *self.runner, cfg) {
            Ok(sched) => {
                self.sched = sched;
                self.cfg = cfg;
                Ok(())
            }
            Err(e) => {
                self.sched = Self::scheduler(&mut *self.runner, self.cfg)?;
                Err(e)
            }
        }
    }

    /// The ledger the backend records every allocation in.
    pub fn ledger(&self) -> &MemoryLedger {
        self.runner.ledger()
    }

    /// The backend's short name (`cpu`, `wgpu`, `cuda`).
    pub fn backend_name(&self) -> &'static str {
        self.runner.backend_name()
    }

    /// The model's config.
    pub fn model_config(&self) -> &crate::arch::config::ModelConfig {
        self.runner.model_config()
    }

    /// The sizes the engine runs with.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
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
            ledger: self.ledger().entries(),
            kv: self.kv().summary(),
            encoder_cache: self.encoder_cache().snapshot(),
            num_running: self.num_running(),
            num_waiting: self.num_waiting(),
            counters: self.counters,
            // Rows of requests that left are freed with the next step: they hold no state now.
            states: self.runner.state_slots().map(|mut s| {
                s.held_by.retain(|(_, id)| !self.released.contains(id));
                s
            }),
        }
    }

    /// Whether any request is waiting or running.
    pub fn has_unfinished(&self) -> bool {
        self.sched.has_unfinished()
    }

    /// Queues a request after checking it can ever run.
    pub fn add_request(&mut self, req: Request) -> Result<(), EngineError> {
        req.params.validate().map_err(EngineError::BadRequest)?;
        let cfg = self.runner.model_config();
        let image_token = cfg.tokens.image;
        if !req.images.is_empty() && cfg.vision.is_none() {
            return Err(EngineError::BadRequest(crate::arch::config::NO_VISION_TOWER.into()));
        }
        let merge = cfg.vision.as_ref().map_or(1, |v| v.spatial_merge_size);
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
            blocks_sent: 0,
        };
        Ok(self.sched.add(req.id, req.prompt, spans, max_tokens, data)?)
    }

    /// Drops a request wherever it is, returning its KV blocks and encoder references at once.
    /// Safe while a step is in flight: [`Self::complete`] skips requests no longer running.
    pub fn abort(&mut self, id: &RequestId) -> Result<bool, EngineError> {
        let found = self.sched.abort(id)?.is_some();
        if found {
            self.released.push(id.clone());
        }
        Ok(found)
    }

    /// Drops every encoder output not in use; returns the bytes released.
    pub fn reset_encoder_cache(&mut self) -> u64 {
        let ledger = self.runner.ledger().clone();
        let before = ledger.bytes(Category::EncoderCache);
        for h in self.sched.reset_encoder_cache() {
            self.runner.forget(&h);
        }
        before.saturating_sub(ledger.bytes(Category::EncoderCache))
    }

    /// Forgets every cached prefix block; refuses while requests hold blocks.
    pub fn reset_prefix_cache(&mut self) -> Result<(), EngineError> {
        Ok(self.sched.reset_prefix_cache()?)
    }

    /// Starts or stops recording the KV cache's events (blocks stored, removed, all cleared), which
    /// a publisher drains with [`Self::take_kv_events`] (vLLM `--kv-events-config`).
    pub fn record_kv_events(&mut self, on: bool) {
        self.sched.kv_mut().record_events(on);
    }

    /// The KV cache events recorded since the last call, oldest first.
    pub fn take_kv_events(&mut self) -> Vec<crate::cache::KvCacheEvent> {
        self.sched.kv_mut().take_events()
    }

    /// Follows a sample of KV blocks from allocation to eviction (vLLM `--kv-cache-metrics`);
    /// `None` stops. Their evictions come out of [`Self::take_kv_block_evictions`].
    pub fn follow_kv_block_residency(&mut self, residency: Option<crate::cache::BlockResidency>) {
        self.sched.kv_mut().follow_residency(residency);
    }

    /// The followed KV blocks evicted since the last call.
    pub fn take_kv_block_evictions(&mut self) -> Vec<crate::cache::BlockEviction> {
        self.sched.kv_mut().take_evictions()
    }

    /// Runs one step to its end, blocking on the read (native callers).
    pub fn step(&mut self) -> Result<Vec<TokenEvent>, EngineError> {
        block_on(self.step_async())
    }

    /// Runs one step, awaiting the read of its logits or samples: the step's only asynchronous
    /// point.
    pub async fn step_async(&mut self) -> Result<Vec<TokenEvent>, EngineError> {
        let Some(launched) = self.launch()? else {
            return Ok(Vec::new());
        };
        let (meta, read) = launched.into_parts();
        let values = match read {
            Some(read) => Some(read.await),
            None => None,
        };
        self.complete(meta, values.transpose())
    }

    /// The first half of a step: schedules, encodes the images the scheduler named, records the
    /// decoder pass and queues the read of the logits rows, or of the tokens sampled from them on
    /// the device when every request that samples allows it (their uniforms drawn from their
    /// generators now, in place of the host sampler's draws). None when nothing was scheduled.
    /// When the model fails, every request is dropped and both caches are emptied (the step may
    /// have hashed blocks it never wrote and reserved encoder entries it never filled) before the
    /// error is returned.
    pub fn launch(&mut self) -> Result<Option<LaunchedStep>, EngineError> {
        let out = self.sched.schedule()?;
        for h in &out.freed_mm_hashes {
            self.runner.forget(h);
        }
        self.counters.num_preemptions += out.preempted.len() as u64;
        for id in &out.preempted {
            if let Some(seq) = self.sched.get_mut(id) {
                seq.data.blocks_sent = 0;
            }
            self.released.push(id.clone());
        }
        if out.scheduled.is_empty() {
            return Ok(None);
        }
        let recorded = self.encode_images(&out.scheduled).and_then(|()| {
            self.faults.check(FaultKind::Decoder, 0, self.runner.ledger())?;
            let batch = self.batch(&out.scheduled);
            let batch = self.sample_on_device(batch);
            Ok(self.runner.execute(batch)?)
        });
        match recorded {
            Ok(read) => {
                self.counters.steps += 1;
                Ok(Some(LaunchedStep {
                    scheduled: out.scheduled,
                    read,
                }))
            }
            Err(e) => {
                self.drop_everything()?;
                Err(e)
            }
        }
    }

    /// The second half of a step: counts its work, takes the tokens the device sampled or samples
    /// from the logits that were read (None when it asked for none), appends the tokens, applies
    /// stop rules and lets the scheduler release what finished. A failed read drops everything, as
    /// a failed launch does.
    pub fn complete(
        &mut self,
        meta: StepMeta,
        values: BResult<Option<Vec<f32>>>,
    ) -> Result<Vec<TokenEvent>, EngineError> {
        let values = match values {
            Ok(v) => v.unwrap_or_default(),
            Err(e) => {
                self.drop_everything()?;
                return Err(e.into());
            }
        };
        for s in &meta.scheduled {
            let Some(seq) = self.sched.get(&s.id) else { continue };
            let prompt_len = seq.prompt().len();
            self.counters.prompt_tokens_computed += (s.end().min(prompt_len) - s.start.min(prompt_len)) as u64;
            self.counters.tokens_computed += (s.end() - s.start) as u64;
            self.counters.prompt_tokens_cached += s.num_cached as u64;
        }
        let width = values.len() / meta.rows.len().max(1);
        let eos = self.runner.model_config().tokens.eos.clone();
        let mut finished = Vec::new();
        let mut events = Vec::with_capacity(meta.rows.len());
        for (k, id) in meta.rows.iter().enumerate() {
            // Aborted while the step was in flight: nothing to sample for.
            let Some(s) = self.take_sample(id, &values[k * width..(k + 1) * width], meta.output) else {
                continue;
            };
            self.sched.push_token(id, s.token)?;
            self.counters.generated_tokens += 1;
            let seq = self.sched.get(id).expect("pushed above");
            let p = &seq.data.params;
            let stop = (!p.ignore_eos && eos.contains(&s.token)) || p.stop_token_ids.contains(&s.token);
            let length = seq.output().len() >= p.max_tokens || seq.len() >= self.cfg.max_model_len;
            let finish = (stop || length).then_some(if stop { FinishReason::Stop } else { FinishReason::Length });
            if finish.is_some() {
                finished.push(id.clone());
            }
            events.push(TokenEvent {
                id: id.clone(),
                token: s.token,
                logprob: s.logprob,
                top_logprobs: s.top,
                finish,
            });
        }
        self.sched.finish(&finished)?;
        self.released.extend(finished);
        Ok(events)
    }

    /// Request `id`'s token from its row of the read: the device's choice, or sampled here from the
    /// logits. None when the request is no longer running (aborted while the step was in flight).
    fn take_sample(&mut self, id: &RequestId, row: &[f32], output: StepOutput) -> Option<Sampled> {
        let allowed = self.allowed(row.len());
        let seq = self.sched.get_mut(id)?;
        Some(match output {
            StepOutput::Sampled => Sampled {
                token: row[0] as u32,
                logprob: row[1],
                top: Vec::new(),
            },
            StepOutput::Logits => {
                let (prompt, output, data) = seq.split_data_mut();
                sample(row, allowed, prompt, output, &data.params, &mut data.rng)
            }
        })
    }

    /// Ids the sampler may return from a logits row of `width`: the tokenizer's vocabulary when
    /// configured (the lm_head's rows past it are padding).
    fn allowed(&self, width: usize) -> usize {
        match self.cfg.vocab_size {
            0 => width,
            n => n,
        }
    }

    /// Aborts every request and empties the encoder and prefix caches.
    fn drop_everything(&mut self) -> Result<(), EngineError> {
        let ids: Vec<RequestId> = self
            .sched
            .running()
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
            let seq = self.sched.get(&s.id).expect("scheduled requests are running");
            if s.num_cached > 0 {
                let covered = seq
                    .data
                    .images
                    .iter()
                    .filter(|img| img.offset + img.num_tokens <= s.start);
                self.counters.prefix_cached_images += covered.count() as u64;
            }
            for i in seq.images_in(s.start, s.end()) {
                let img = &seq.data.images[i];
                if !s.encode.contains(&i) {
                    // Once per use: in the step that reaches the image's first placeholder, or in
                    // the admitting step when the prefix cache held the image's start.
                    if img.offset >= s.start || s.num_cached > 0 {
                        self.counters.encoder_hits += 1;
                    }
                    continue;
                }
                let ledger = self.runner.ledger();
                let bytes = img.pixel_values.len() as u64 * self.runner.elem_bytes();
                self.faults
                    .check(FaultKind::Alloc, bytes, ledger)
                    .and_then(|()| self.faults.check(FaultKind::VisionTower, 0, ledger))?;
                self.runner.encode(&img.mm_hash, &img.pixel_values, img.grid_thw)?;
                self.counters.vision_runs += 1;
            }
        }
        Ok(())
    }

    /// The step's work by request id: tokens, positions, the blocks each block table gained since
    /// the runner last saw it, image rows and which requests sample (those whose scheduled tokens
    /// reach their end); with the requests that left since the last batch.
    fn batch(&mut self, plan: &[ScheduledSeq]) -> StepBatch {
        let kv = self.sched.kv();
        let seqs: Vec<BatchSeq> = plan
            .iter()
            .map(|s| {
                let seq = self.sched.get(&s.id).expect("scheduled requests are running");
                let table = kv.block_table(seq.id());
                // A table shorter than what was sent was rebuilt: send all of it.
                let table_start = Some(seq.data.blocks_sent).filter(|&n| n <= table.len()).unwrap_or(0);
                let images = seq
                    .images_in(s.start, s.end())
                    .map(|i| {
                        let img = &seq.data.images[i];
                        let from = s.start.max(img.offset);
                        let to = s.end().min(img.offset + img.num_tokens);
                        ImageRows {
                            mm_hash: img.mm_hash.clone(),
                            rows: from - img.offset..to - img.offset,
                            at: from - s.start,
                        }
                    })
                    .collect();
                BatchSeq {
                    id: s.id.clone(),
                    tokens: (s.start..s.end()).map(|i| seq.token_at(i)).collect(),
                    positions: (s.start..s.end()).map(|i| seq.data.position(i)).collect(),
                    context_len: s.end(),
                    new_blocks: table[table_start..].to_vec(),
                    table_start,
                    images,
                    logit_rows: usize::from(s.end() == seq.len()),
                    sampling: None,
                }
            })
            .collect();
        for s in &seqs {
            let seq = self.sched.get_mut(&s.id).expect("scheduled requests are running");
            seq.data.blocks_sent = s.table_start + s.new_blocks.len();
        }
        StepBatch {
            seqs,
            released: std::mem::take(&mut self.released),
        }
    }

    /// `batch` with every sampling request's [`BatchSeq::sampling`] set, each drawing its uniform
    /// from its own generator, when all of them allow device sampling; unchanged (the logits are
    /// read for the host, which draws when it samples) when any does not.
    fn sample_on_device(&mut self, mut batch: StepBatch) -> StepBatch {
        let caps = self.runner.capabilities();
        // Any width: the sampler clamps it to the logits row.
        let allowed = self.allowed(usize::MAX);
        let all_allow = batch.seqs.iter().filter(|s| s.logit_rows > 0).all(|s| {
            let params = &self.sched.get(&s.id).expect("batched requests are running").data.params;
            params.samples_on_device() && (caps.sampling == DeviceSamplingSupport::Full || params.is_greedy())
        });
        if !all_allow {
            return batch;
        }
        for s in batch.seqs.iter_mut().filter(|s| s.logit_rows > 0) {
            let data = &mut self.sched.get_mut(&s.id).expect("batched requests are running").data;
            let row = DeviceSampling::new(&data.params, allowed, &mut data.rng);
            debug_assert!(caps.samples(&row));
            s.sampling = Some(row);
        }
        batch
    }
}
