//! The scheduler, with vLLM v1's FCFS semantics (`Scheduler.schedule` in
//! <https://github.com/vllm-project/vllm/blob/main/vllm/v1/core/sched/scheduler.py>, and its
//! `encoder_cache_manager.py` beside it). There are no prefill and decode phases: every request has a
//! count of computed tokens chasing its length, and each step hands out at most
//! `max_num_batched_tokens` tokens (chunked prefill), `max_num_seqs` running requests and
//! `max_num_encoder_input_tokens` encoder tokens to compute.
//!
//! Running requests go first, in order. When the KV cache cannot hold a running request's new
//! tokens, the last running request is preempted: its blocks and encoder references are released
//! (cached block hashes stay, so it may find its own prefix again), its computed count drops to 0
//! and it goes to the front of the waiting queue, to be recomputed later with the tokens it has
//! generated so far. Waiting requests are admitted in order only in steps without preemption,
//! after a prefix-cache lookup, and stop at the first one that does not fit (head of line). Unlike
//! vLLM, a waiting request that does not fit keeps no encoder-cache references (see
//! [`Scheduler::schedule`]).
//!
//! The scheduler owns the request bookkeeping and the two cache managers; it holds no tensors.
//! The engine runs the vision tower and the decoder for a [`SchedulerOutput`], then reports the
//! sampled tokens back with [`Scheduler::push_token`] and [`Scheduler::finish`].

mod encoder_inputs;
mod sequence;
#[cfg(test)]
mod tests;

use std::collections::{HashMap, VecDeque};

use crate::cache::{
    CacheError, ComputedBlocks, EncoderCacheManager, KvCacheManager, MmHash, MmSpan, RequestId, TokenId,
};
use encoder_inputs::{plan_encoder_inputs, EncoderPlan};
pub use sequence::Sequence;

/// The per-step budgets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Most running requests (`max_num_seqs`).
    pub max_num_seqs: usize,
    /// Most tokens per step (`max_num_batched_tokens`).
    pub max_num_batched_tokens: usize,
    /// Most encoder tokens computed per step (vLLM `max_num_encoder_input_tokens`); images whose
    /// output is already cached cost nothing.
    pub max_num_encoder_input_tokens: usize,
    /// Most tokens one request computes per step (vLLM `long_prefill_token_threshold`; 0 = no
    /// cap): a long prompt prefills in chunks and leaves the rest of each step to other requests.
    pub long_prefill_token_threshold: usize,
}

impl SchedulerConfig {
    /// How many of `remaining` tokens one request may compute in a step with `budget` tokens left.
    fn chunk(&self, remaining: usize, budget: usize) -> usize {
        let capped = match self.long_prefill_token_threshold {
            0 => remaining,
            t => remaining.min(t),
        };
        capped.min(budget)
    }
}

/// Why the scheduler refused a request or failed.
#[derive(Debug, thiserror::Error)]
pub enum SchedError {
    /// A request that can never run (too long, badly placed images, duplicate id).
    #[error("{0}")]
    BadRequest(String),
    /// Cache bookkeeping failed (a bug).
    #[error(transparent)]
    Cache(#[from] CacheError),
}

/// One request's share of a step, named by request id (positions in the running list change as
/// requests finish, so a step in flight never holds one).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduledSeq {
    /// The request.
    pub id: RequestId,
    /// First position computed this step (tokens already in the KV cache before it).
    pub start: usize,
    /// Tokens computed this step, positions `start..start + num_new`.
    pub num_new: usize,
    /// Tokens found in the prefix cache when the request was admitted this step (0 otherwise).
    pub num_cached: usize,
    /// Images whose encoder output must be computed this step, before the decoder runs.
    pub encode: Vec<usize>,
}

impl ScheduledSeq {
    /// One past the last position computed this step.
    pub fn end(&self) -> usize {
        self.start + self.num_new
    }
}

/// What one step runs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SchedulerOutput {
    /// Requests running this step, in batch order.
    pub scheduled: Vec<ScheduledSeq>,
    /// Requests preempted this step (now at the front of the waiting queue).
    pub preempted: Vec<RequestId>,
    /// Encoder outputs evicted since the last step: drop them before encoding.
    pub freed_mm_hashes: Vec<MmHash>,
}

impl SchedulerOutput {
    /// Tokens scheduled in all.
    pub fn num_tokens(&self) -> usize {
        self.scheduled.iter().map(|s| s.num_new).sum()
    }
}

/// What is left of one step's budgets.
#[derive(Debug)]
struct Budget {
    tokens: usize,
    encoder: usize,
}

/// Waiting and running requests over a KV cache manager and an encoder cache manager. As in vLLM,
/// the requests live in a map by id and the queues hold ids, so looking one up costs the same
/// whatever the batch.
#[derive(Debug)]
pub struct Scheduler<T> {
    cfg: SchedulerConfig,
    kv: KvCacheManager,
    enc: EncoderCacheManager,
    requests: HashMap<RequestId, Sequence<T>>,
    waiting: VecDeque<RequestId>,
    running: Vec<RequestId>,
}

impl<T> Scheduler<T> {
    /// A scheduler with empty queues over these cache managers.
    pub fn new(cfg: SchedulerConfig, kv: KvCacheManager, enc: EncoderCacheManager) -> Self {
        Scheduler {
            cfg,
            kv,
            enc,
            requests: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
        }
    }

    /// The KV cache manager.
    pub fn kv(&self) -> &KvCacheManager {
        &self.kv
    }

    /// The encoder cache manager.
    pub fn encoder_cache(&self) -> &EncoderCacheManager {
        &self.enc
    }

    /// Requests holding KV blocks, in scheduling order.
    pub fn running(&self) -> impl Iterator<Item = &Sequence<T>> {
        self.running.iter().map(|id| &self.requests[id])
    }

    /// Requests queued, new or preempted, in admission order.
    pub fn waiting(&self) -> impl Iterator<Item = &Sequence<T>> {
        self.waiting.iter().map(|id| &self.requests[id])
    }

    /// Number of running requests.
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Number of waiting requests.
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Whether any request is waiting or running.
    pub fn has_unfinished(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// Queues a request after checking it can ever run: a non-empty prompt shorter than
    /// `max_model_len`, prompt plus `max_tokens` within `max_model_len` and within the whole KV
    /// cache, non-empty image placeholder ranges in order inside the prompt, each image within the
    /// encoder budgets, and an id not in use.
    pub fn add(
        &mut self,
        id: RequestId,
        prompt: Vec<TokenId>,
        spans: Vec<MmSpan>,
        max_tokens: usize,
        data: T,
    ) -> Result<(), SchedError> {
        let bad = |msg: String| Err(SchedError::BadRequest(msg));
        let max_len = self.kv.max_model_len();
        if prompt.is_empty() {
            return bad("the prompt is empty".into());
        }
        if prompt.len() >= max_len {
            return bad(format!(
                "the prompt has {} tokens; this model's maximum context length is {max_len} tokens",
                prompt.len()
            ));
        }
        let total = prompt.len().saturating_add(max_tokens);
        if total > max_len {
            return bad(format!(
                "the prompt ({} tokens) plus max_tokens ({max_tokens}) exceeds the maximum context length of {max_len} tokens",
                prompt.len()
            ));
        }
        let (bs, usable) = (self.kv.block_size(), self.kv.num_blocks().saturating_sub(1));
        if total.div_ceil(bs) > usable {
            return bad(format!(
                "the prompt ({} tokens) plus max_tokens ({max_tokens}) needs {} KV blocks of {bs} tokens; the KV cache has {usable}",
                prompt.len(),
                total.div_ceil(bs)
            ));
        }
        if self.requests.contains_key(&id) {
            return bad(format!("request id {id} is already in use"));
        }
        let mut end = 0;
        for s in &spans {
            if s.length == 0 || s.offset < end || s.offset + s.length > prompt.len() {
                return bad("image placeholders are empty, overlap, are out of order or lie outside the prompt".into());
            }
            end = s.offset + s.length;
            let room = self.enc.cache_size().min(self.cfg.max_num_encoder_input_tokens);
            if s.length > room {
                return bad(format!(
                    "The decoder prompt contains an image item with length {}, which exceeds the pre-allocated encoder cache size {room}",
                    s.length
                ));
            }
        }
        let seq = Sequence::new(id.clone(), prompt, spans, bs, data)?;
        self.requests.insert(id.clone(), seq);
        self.waiting.push_back(id);
        Ok(())
    }

    /// Plans one step: running requests first (preempting from the back when KV blocks run out),
    /// then waiting ones if nothing was preempted. Reserves KV blocks and encoder-cache room for
    /// everything scheduled, advances computed counts as if the step ran, and releases encoder
    /// outputs whose placeholders are then all in the KV cache (vLLM `_update_after_schedule`).
    /// A waiting request that does not fit releases the cached encoder outputs its attempt
    /// referenced (vLLM keeps them, which can deadlock).
    pub fn schedule(&mut self) -> Result<SchedulerOutput, CacheError> {
        let mut out = SchedulerOutput::default();
        let mut budget = Budget {
            tokens: self.cfg.max_num_batched_tokens,
            encoder: self.cfg.max_num_encoder_input_tokens,
        };

        let mut i = 0;
        'running: while i < self.running.len() && budget.tokens > 0 {
            let seq = &self.requests[&self.running[i]];
            let start = seq.computed();
            let want = self.cfg.chunk(seq.len() - start, budget.tokens);
            let plan = plan_encoder_inputs(&mut self.enc, seq, start, want, budget.encoder);
            if plan.num_new == 0 {
                i += 1;
                continue;
            }
            loop {
                let seq = &self.requests[&self.running[i]];
                let blocks = self.kv.allocate_slots(
                    seq.id(),
                    plan.num_new,
                    start,
                    &ComputedBlocks::default(),
                    &seq.block_keys(),
                )?;
                if blocks.is_some() {
                    break;
                }
                let victim = self.running.len() - 1;
                self.preempt(victim, &mut out)?;
                if victim == i {
                    break 'running;
                }
            }
            let id = self.running[i].clone();
            self.commit(&id, start, 0, plan, &mut budget, &mut out)?;
            i += 1;
        }

        while out.preempted.is_empty() && budget.tokens > 0 && self.running.len() < self.cfg.max_num_seqs {
            let Some(seq) = self.waiting.front().map(|id| &self.requests[id]) else {
                break;
            };
            debug_assert_eq!(seq.computed(), 0, "waiting requests hold no KV");
            let hit = self.kv.get_computed_blocks(seq.block_hashes(), seq.len());
            let start = hit.num_tokens();
            let want = self.cfg.chunk(seq.len() - start, budget.tokens);
            let plan = plan_encoder_inputs(&mut self.enc, seq, start, want, budget.encoder);
            if plan.num_new == 0
                || self
                    .kv
                    .allocate_slots(seq.id(), plan.num_new, 0, &hit, &seq.block_keys())?
                    .is_none()
            {
                // vLLM keeps the encoder references this attempt took, and an image held that way can
                // keep a running request from ever encoding its next one: the head waits for KV that
                // request holds, the request waits for encoder room the head holds. A waiting request
                // holds no other references, so drop them all.
                self.enc.free(seq.id());
                break;
            }
            let id = self.waiting.pop_front().expect("front exists");
            self.commit(&id, start, start, plan, &mut budget, &mut out)?;
            self.requests
                .get_mut(&id)
                .expect("queued requests exist")
                .set_running(true);
            self.running.push(id);
        }

        for s in &out.scheduled {
            let seq = self.requests.get_mut(&s.id).expect("scheduled requests exist");
            seq.set_computed(s.end());
            // An image repeated later in the same request keeps its entry until that use is done too.
            let in_kv = |h: &MmHash| {
                seq.spans()
                    .iter()
                    .all(|o| &o.hash != h || o.offset + o.length <= s.end())
            };
            for span in seq.spans() {
                if in_kv(&span.hash) {
                    self.enc.free_encoder_input(seq.id(), &span.hash);
                }
            }
        }
        out.freed_mm_hashes = self.enc.get_freed_mm_hashes();
        Ok(out)
    }

    /// Records a scheduled request: allocates its encoder entries and charges the budgets.
    fn commit(
        &mut self,
        id: &RequestId,
        start: usize,
        num_cached: usize,
        plan: EncoderPlan,
        budget: &mut Budget,
        out: &mut SchedulerOutput,
    ) -> Result<(), CacheError> {
        let seq = &self.requests[id];
        for &img in &plan.encode {
            let span = &seq.spans()[img];
            self.enc.allocate(seq.id(), &span.hash, span.length)?;
        }
        budget.tokens -= plan.num_new;
        budget.encoder -= plan.cost;
        out.scheduled.push(ScheduledSeq {
            id: seq.id().clone(),
            start,
            num_new: plan.num_new,
            num_cached,
            encode: plan.encode,
        });
        Ok(())
    }

    /// Moves running request `index` to the front of the waiting queue with nothing computed.
    fn preempt(&mut self, index: usize, out: &mut SchedulerOutput) -> Result<(), CacheError> {
        let id = self.running.remove(index);
        self.kv.free(&id)?;
        self.enc.free(&id);
        if let Some(seq) = self.requests.get_mut(&id) {
            seq.set_computed(0);
            seq.set_running(false);
        }
        out.preempted.push(id.clone());
        self.waiting.push_front(id);
        Ok(())
    }

    /// The request `id`, running or waiting.
    pub fn get(&self, id: &RequestId) -> Option<&Sequence<T>> {
        self.requests.get(id)
    }

    /// The request `id`, mutably.
    pub fn get_mut(&mut self, id: &RequestId) -> Option<&mut Sequence<T>> {
        self.requests.get_mut(id)
    }

    /// Appends a token sampled for running request `id` (which the step brought to its full
    /// length) and hashes the blocks it filled; false when it is no longer running (aborted while
    /// the step was in flight).
    pub fn push_token(&mut self, id: &RequestId, token: TokenId) -> Result<bool, CacheError> {
        let bs = self.kv.block_size();
        match self.get_mut(id) {
            Some(seq) => seq.push_token(token, bs).map(|()| true),
            None => Ok(false),
        }
    }

    /// Removes finished running requests, releasing their KV blocks (cached ones stay reusable)
    /// and encoder references; ids not running are skipped.
    pub fn finish(&mut self, ids: &[RequestId]) -> Result<Vec<Sequence<T>>, CacheError> {
        let mut done = Vec::with_capacity(ids.len());
        for id in ids {
            if self.requests.get(id).is_some_and(Sequence::is_running) {
                let seq = self.requests.remove(id).expect("looked up above");
                self.release(&seq)?;
                done.push(seq);
            }
        }
        if !done.is_empty() {
            // One pass over the running list for all of them.
            let requests = &self.requests;
            self.running.retain(|id| requests.contains_key(id));
        }
        Ok(done)
    }

    /// Drops a request wherever it is, releasing its KV blocks and encoder references at once;
    /// returns it, or None for an unknown id.
    pub fn abort(&mut self, id: &RequestId) -> Result<Option<Sequence<T>>, CacheError> {
        let seq = self.requests.remove(id);
        match &seq {
            Some(s) if s.is_running() => self.running.retain(|r| r != id),
            Some(_) => self.waiting.retain(|w| w != id),
            None => {}
        }
        if let Some(seq) = &seq {
            self.release(seq)?;
        }
        Ok(seq)
    }

    fn release(&mut self, seq: &Sequence<T>) -> Result<(), CacheError> {
        self.kv.free(seq.id())?;
        self.enc.free(seq.id());
        Ok(())
    }

    /// Drops every unreferenced encoder output; returns the hashes whose tensors can go.
    pub fn reset_encoder_cache(&mut self) -> Vec<MmHash> {
        self.enc.reset();
        self.enc.get_freed_mm_hashes()
    }

    /// Forgets every cached prefix block; refused while requests hold blocks.
    pub fn reset_prefix_cache(&mut self) -> Result<(), CacheError> {
        self.kv.reset_prefix_cache()
    }

    /// The KV cache manager, to change what it records.
    pub(crate) fn kv_mut(&mut self) -> &mut KvCacheManager {
        &mut self.kv
    }
}
