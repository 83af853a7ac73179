//! The model runner: it owns the loaded model, the paged KV cache tensors with their block tables
//! ([`block_tables`]) and the kept encoder outputs, and executes one step batch whose sequences are
//! named by request id (vLLM's `GPUModelRunner`). The engine decides what a step computes; the
//! runner records it on the backend and queues the one read the step needs. The start-up profile
//! is a dummy batch through the same path ([`crate::profile`]).

mod block_tables;

use crate::arch::config::{ModelConfig, NO_VISION_TOWER};
use crate::backend::{
    Backend, BackendError, Capabilities, DeviceMemory, KvLayout, PagedBatch, PagedSeq, Readback, StateLayout, StateSeq,
    TableShape,
};
use crate::cache::{MmHash, RequestId};
use crate::memory::ledger::{Category, MemoryLedger};
use crate::model::rope::mrope_tables;
use crate::model::text::DecoderInput;
use crate::model::vision::VisionOutput;
use crate::model::{ModelError, QwenVl};
use crate::profile::{ProfileResult, ProfileSpec};
use crate::sample::DeviceSampling;
use std::collections::HashMap;
use std::ops::Range;

/// Rows of a kept encoder output that one step merges into its token embeddings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageRows {
    /// The encoder output's content hash.
    pub mm_hash: MmHash,
    /// Rows of the encoder output (placeholder positions relative to the image's first one).
    pub rows: Range<usize>,
    /// Index, among the sequence's tokens this step, of the first of those rows.
    pub at: usize,
}

/// One request's share of a step.
#[derive(Debug, Clone, PartialEq)]
pub struct BatchSeq {
    /// The request.
    pub id: RequestId,
    /// Token ids computed this step.
    pub tokens: Vec<u32>,
    /// Their M-RoPE positions.
    pub positions: Vec<[i64; 3]>,
    /// Tokens in the KV cache after this step (this step's included).
    pub context_len: usize,
    /// Blocks the request's KV block table gained since the step before (all of them when
    /// `table_start` is 0).
    pub new_blocks: Vec<usize>,
    /// Index in the request's table of the first of `new_blocks` (0: the table starts afresh).
    pub table_start: usize,
    /// Image features that replace placeholder embeddings.
    pub images: Vec<ImageRows>,
    /// How many of its last rows the step returns logits for (1 where the request samples).
    pub logit_rows: usize,
    /// How those rows are sampled on the device, when the request allows it. The step samples on
    /// the device only when every sequence with logits rows has this; otherwise it reads the
    /// logits back for the host.
    pub sampling: Option<DeviceSampling>,
}

/// A hybrid model's state cache: one slot per block-table row, held by the request in that row.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StateSlots {
    /// Slots in all (`max_num_seqs`).
    pub total: usize,
    /// Bytes of one slot: every Gated DeltaNet layer's conv window and recurrent state.
    pub bytes_per_slot: u64,
    /// The requests holding a slot, by slot.
    pub held_by: Vec<(usize, RequestId)>,
}

/// What one step computes, in batch order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepBatch {
    /// The scheduled requests.
    pub seqs: Vec<BatchSeq>,
    /// Requests that finished, were aborted or were preempted since the step before: their
    /// block-table rows are free (before this step's requests take rows).
    pub released: Vec<RequestId>,
}

/// What a step's read brings back per logits row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepOutput {
    /// The row's logits, `vocab` floats, for the host to sample from.
    Logits,
    /// The token the device sampled (as f32) and its log-probability: 2 floats
    /// ([`crate::backend::Backend::sample`]).
    Sampled,
}

/// A step recorded on the device: the ids whose logits rows it reads back, in row order, and the
/// read itself.
pub struct StepRead {
    /// One entry per logits row (a request appears `logit_rows` times).
    pub rows: Vec<RequestId>,
    /// What the read holds per row.
    pub output: StepOutput,
    /// `[rows, vocab]` logits or `[rows, 2]` samples (see [`Self::output`]) once the device has
    /// produced them; None when no row was asked for.
    pub read: Option<Readback>,
}

impl std::fmt::Debug for StepRead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepRead")
            .field("rows", &self.rows)
            .field("output", &self.output)
            .field("read", &self.read.as_ref().map(|_| "pending read"))
            .finish()
    }
}

/// The model, its KV cache and the encoder outputs it keeps, on one backend.
#[derive(Debug)]
pub struct ModelRunner<B: Backend> {
    be: B,
    model: QwenVl<B>,
    kv: Option<KvState<B>>,
    encoder_outputs: HashMap<MmHash, VisionOutput<B>>,
}

/// The KV cache, the block tables beside it on the device and their rows on the host, and a
/// hybrid model's state cache with one slot per block-table row.
#[derive(Debug)]
pub(crate) struct KvState<B: Backend> {
    layout: KvLayout,
    cache: B::KvCache,
    states: Option<B::StateCache>,
    tables: B::BlockTables,
    rows: block_tables::BlockTables,
}

impl<B: Backend> ModelRunner<B> {
    /// A runner over a loaded model, with no KV cache yet ([`Self::allocate_kv`]).
    pub fn new(be: B, model: QwenVl<B>) -> Self {
        ModelRunner {
            be,
            model,
            kv: None,
            encoder_outputs: HashMap::new(),
        }
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.be
    }

    /// The model.
    pub fn model(&self) -> &QwenVl<B> {
        &self.model
    }

    /// The KV cache's geometry for `num_blocks` blocks of `block_size` tokens, with block tables
    /// of `tables`.
    pub fn kv_layout(&self, num_blocks: usize, block_size: usize, tables: TableShape) -> KvLayout {
        let t = &self.model.cfg.text;
        KvLayout {
            layers: t.attention_layers(),
            num_blocks,
            block_size,
            kv_heads: t.num_key_value_heads,
            head_dim: t.head_dim,
            tables,
        }
    }

    /// Hands the KV cache to the caller (the profile swaps in a scratch one).
    pub(crate) fn take_kv(&mut self) -> Option<KvState<B>> {
        self.kv.take()
    }

    /// Puts back a KV cache taken with [`Self::take_kv`].
    pub(crate) fn restore_kv(&mut self, kv: Option<KvState<B>>) {
        self.kv = kv;
    }
}

/// What the engine needs of a model runner, without the backend's types: the engine holds its
/// runner as `Box<dyn StepRunner>`, so callers choose the backend at run time.
pub trait StepRunner: std::fmt::Debug {
    /// The ledger the backend records every allocation in.
    fn ledger(&self) -> &MemoryLedger;
    /// The backend's short name.
    fn backend_name(&self) -> &'static str;
    /// What the backend can do.
    fn capabilities(&self) -> Capabilities;
    /// The device's free and total memory now, where it has memory of its own.
    fn device_memory(&self) -> Option<Result<DeviceMemory, BackendError>>;
    /// The backend and its device in one line, for the start-up log.
    fn describe(&self) -> String;
    /// The largest buffer one kernel can bind, where the backend has such a limit.
    fn max_binding_bytes(&self) -> Option<u64>;
    /// The state slots and who holds them (None for a model without Gated DeltaNet layers).
    fn state_slots(&self) -> Option<StateSlots>;
    /// Runs the profile pass and queues its read (see [`ModelRunner::profile`]).
    fn profile(&mut self, spec: ProfileSpec) -> Result<(ProfileResult, Option<Readback>), ModelError>;
    /// Bytes per element of the backend's activations and KV cache.
    fn elem_bytes(&self) -> u64;
    /// The model's config.
    fn model_config(&self) -> &ModelConfig;
    /// Replaces the KV cache with a zeroed one of `num_blocks` blocks and its block tables with
    /// empty ones of `tables` (the old ones are freed first).
    fn allocate_kv(&mut self, num_blocks: usize, block_size: usize, tables: TableShape)
        -> Result<KvLayout, ModelError>;
    /// Bytes per encoder-output token as kept (main features and deepstack levels).
    fn encoder_bytes_per_token(&self) -> u64;
    /// Runs the vision tower on one image and keeps its output under `mm_hash`, recorded as
    /// encoder cache.
    fn encode(&mut self, mm_hash: &MmHash, pixel_values: &[f32], grid_thw: [usize; 3]) -> Result<(), ModelError>;
    /// Drops a kept encoder output.
    fn forget(&mut self, mm_hash: &MmHash);
    /// Records one decoder pass over the batch (image rows merged in, deepstack added, K/V written
    /// into the cache) and queues the read of the logits rows the batch asks for, or of the tokens
    /// sampled from them on the device when every such row has its [`BatchSeq::sampling`].
    fn execute(&mut self, batch: StepBatch) -> Result<StepRead, ModelError>;
}

impl<B: Backend> StepRunner for ModelRunner<B> {
    fn ledger(&self) -> &MemoryLedger {
        self.be.ledger()
    }

    fn backend_name(&self) -> &'static str {
        self.be.name()
    }

    fn capabilities(&self) -> Capabilities {
        B::CAPABILITIES
    }

    fn device_memory(&self) -> Option<Result<DeviceMemory, BackendError>> {
        self.be.device_memory()
    }

    fn describe(&self) -> String {
        self.be.describe()
    }

    fn max_binding_bytes(&self) -> Option<u64> {
        self.be.max_binding_bytes()
    }

    fn state_slots(&self) -> Option<StateSlots> {
        let linear = self.model.cfg.text.linear.as_ref()?;
        let kv = self.kv.as_ref()?;
        let layout = StateLayout::of(linear, kv.layout.tables.rows);
        let mut held_by = kv.rows.holders();
        held_by.sort();
        Some(StateSlots {
            total: layout.slots,
            bytes_per_slot: layout.bytes(self.be.elem_bytes()) / layout.slots.max(1) as u64,
            held_by,
        })
    }

    fn profile(&mut self, spec: ProfileSpec) -> Result<(ProfileResult, Option<Readback>), ModelError> {
        ModelRunner::profile(self, spec)
    }

    fn elem_bytes(&self) -> u64 {
        self.be.elem_bytes()
    }

    fn model_config(&self) -> &ModelConfig {
        &self.model.cfg
    }

    fn allocate_kv(
        &mut self,
        num_blocks: usize,
        block_size: usize,
        tables: TableShape,
    ) -> Result<KvLayout, ModelError> {
        self.kv = None;
        let layout = self.kv_layout(num_blocks, block_size, tables);
        let states = match &self.model.cfg.text.linear {
            Some(linear) => Some(self.be.alloc_states(StateLayout::of(linear, tables.rows))?),
            None => None,
        };
        self.kv = Some(KvState {
            layout,
            cache: self.be.alloc_kv(layout)?,
            states,
            tables: self.be.alloc_block_tables(layout)?,
            rows: block_tables::BlockTables::new(tables),
        });
        Ok(layout)
    }

    fn encoder_bytes_per_token(&self) -> u64 {
        self.model.cfg.encoder_output_dim() as u64 * self.be.elem_bytes()
    }

    fn encode(&mut self, mm_hash: &MmHash, pixel_values: &[f32], grid_thw: [usize; 3]) -> Result<(), ModelError> {
        let patches: usize = grid_thw.iter().product();
        let cols = pixel_values.len() / patches.max(1);
        let px = self.be.upload(pixel_values.to_vec(), &[patches, cols])?;
        let tower = self
            .model
            .vision
            .as_ref()
            .ok_or_else(|| ModelError::Input(NO_VISION_TOWER.into()))?;
        let out = tower.forward(&self.be, &px, &[grid_thw])?;
        // Kept outputs are encoder cache from now on, not transient activations.
        let kept = VisionOutput {
            main: self.be.keep(&out.main, Category::EncoderCache),
            deepstack: out
                .deepstack
                .iter()
                .map(|d| self.be.keep(d, Category::EncoderCache))
                .collect(),
        };
        self.encoder_outputs.insert(mm_hash.clone(), kept);
        Ok(())
    }

    fn forget(&mut self, mm_hash: &MmHash) {
        self.encoder_outputs.remove(mm_hash);
    }

    fn execute(&mut self, batch: StepBatch) -> Result<StepRead, ModelError> {
        let be = &self.be;
        let kv = self
            .kv
            .as_mut()
            .ok_or_else(|| ModelError::Input("the runner has no KV cache".into()))?;
        let (layout, bs) = (kv.layout, kv.layout.block_size);
        for id in &batch.released {
            kv.rows.release(id);
        }
        let mut writes = Vec::new();
        let deep_levels = self.model.cfg.deepstack_levels();
        let mut paged = PagedBatch {
            layout,
            ..PagedBatch::default()
        };
        let (mut ids, mut positions) = (Vec::new(), Vec::new());
        let (mut image_rows, mut image_parts) = (Vec::new(), Vec::new());
        let mut deep_parts: Vec<Vec<B::Tensor>> = vec![Vec::new(); deep_levels];
        let (mut logit_rows, mut row_ids, mut sampling) = (Vec::new(), Vec::new(), Vec::new());
        let mut state_seqs = Vec::new();
        for s in batch.seqs {
            let row0 = ids.len();
            let n = s.tokens.len();
            let start = s.context_len.checked_sub(n).filter(|_| s.positions.len() == n);
            let Some(start) = start else {
                return Err(ModelError::Input(format!("request {}: inconsistent step batch", s.id)));
            };
            ids.extend_from_slice(&s.tokens);
            positions.extend_from_slice(&s.positions);
            let (write, row) = kv.rows.extend(&s.id, s.table_start, &s.new_blocks)?;
            writes.push(write);
            let table = kv.rows.row(row);
            for p in start..s.context_len {
                let block = table.get(p / bs).ok_or_else(|| {
                    ModelError::Input(format!("request {}: position {p} outside its block table", s.id))
                })?;
                paged.slots.push(block * bs + p % bs);
            }
            for img in &s.images {
                let entry = self
                    .encoder_outputs
                    .get(&img.mm_hash)
                    .ok_or_else(|| ModelError::Input(format!("encoder output for {} is missing", img.mm_hash)))?;
                let rows: Vec<usize> = img.rows.clone().collect();
                image_parts.push(be.gather_rows(&entry.main, &rows)?);
                for (k, d) in entry.deepstack.iter().enumerate().take(deep_levels) {
                    deep_parts[k].push(be.gather_rows(d, &rows)?);
                }
                image_rows.extend((0..rows.len()).map(|r| row0 + img.at + r));
            }
            let k = s.logit_rows.min(n);
            logit_rows.extend(row0 + n - k..row0 + n);
            row_ids.extend(std::iter::repeat_n(s.id.clone(), k));
            sampling.extend(std::iter::repeat_n(s.sampling, k));
            // A request's state lives in the slot of its block-table row; a request that starts
            // at position 0 (new, or recomputed after preemption) starts from a zeroed state.
            state_seqs.push(StateSeq {
                start: row0,
                len: n,
                slot: row,
                fresh: start == 0,
            });
            paged.seqs.push(PagedSeq {
                query_start: row0,
                query_len: n,
                context_len: s.context_len,
                table_row: row,
                table_len: table.len(),
            });
        }
        let mut embeds = self.model.text.embed(be, &ids)?;
        let mut deep = Vec::new();
        if !image_rows.is_empty() {
            // Each image's rows are freed once they are in the batch's tensor.
            let feats = be.concat_rows(&std::mem::take(&mut image_parts))?;
            embeds = be.scatter_rows(&embeds, &image_rows, &feats, false)?;
            for parts in deep_parts.drain(..) {
                deep.push(be.concat_rows(&parts)?);
            }
        }
        let t = &self.model.cfg.text;
        let (cos, sin) = mrope_tables(t, &positions);
        let cos = be.upload(cos, &[ids.len(), t.rotary_dim])?;
        let sin = be.upload(sin, &[ids.len(), t.rotary_dim])?;
        writes.retain(|w| !w.blocks.is_empty());
        be.write_block_tables(&mut kv.tables, &writes)?;
        let paged = be.upload_paged(paged, &kv.tables)?;
        let hidden = self.model.text.forward(
            be,
            &mut kv.cache,
            kv.states.as_mut(),
            DecoderInput {
                embeds,
                cos,
                sin,
                paged: &paged,
                deepstack: (!deep.is_empty()).then_some((&deep[..], &image_rows[..])),
                state_seqs: &state_seqs,
            },
        )?;
        let device: Option<Vec<DeviceSampling>> = sampling.into_iter().collect();
        let output = match device {
            Some(_) => StepOutput::Sampled,
            None => StepOutput::Logits,
        };
        let read = if logit_rows.is_empty() {
            None
        } else {
            let logits = self.model.text.logits(be, &be.gather_rows(&hidden, &logit_rows)?)?;
            Some(match device {
                Some(rows) => be.read(&be.sample(&logits, &rows)?),
                None => be.read(&logits),
            })
        };
        Ok(StepRead {
            rows: row_ids,
            output,
            read,
        })
    }
}
