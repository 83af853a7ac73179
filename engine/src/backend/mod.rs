//! The narrow set of fused operations the Qwen-VL forward pass needs. The model is written once
//! against [`Backend`]; each backend owns its tensor type and its memory and records every
//! allocation in the [`MemoryLedger`](crate::memory::ledger::MemoryLedger).

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod fused;
pub mod instrumented;
pub mod paged;
#[cfg(test)]
pub(crate) mod plan_check;
mod readback;
#[doc(hidden)]
#[cfg(any(test, feature = "testing"))]
pub mod suite;
#[cfg(feature = "wgpu")]
pub mod wgpu;

use crate::arch::ggml::GgmlType;
pub use crate::arch::spec::MatrixUse;
use crate::memory::ledger::MemoryLedger;
use crate::sample::DeviceSampling;
pub use paged::PagedRows;
pub use readback::{block_on, ready, Readback};

/// Why a backend operation failed.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// Shapes that do not fit the operation.
    #[error("shape error: {0}")]
    Shape(String),
    /// A failure inside the backend's library, with the error it came from.
    #[error("backend error: {0}")]
    Library(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// A stored type this backend does not read.
    #[error("{backend} cannot read {dtype} tensors yet ({what})")]
    Unsupported {
        /// The backend's name.
        backend: &'static str,
        /// The type as GGML spells it.
        dtype: &'static str,
        /// What reads it instead.
        what: &'static str,
    },
    /// An operation this backend has no kernel for yet.
    #[error("the {backend} backend has no {op} kernel yet ({what})")]
    Missing {
        /// The backend's name.
        backend: &'static str,
        /// The operation.
        op: &'static str,
        /// What runs it instead.
        what: &'static str,
    },
    /// A failure planted by [`crate::fault`].
    #[error("injected fault: {0}")]
    Injected(String),
    /// An allocation the device cannot hold.
    #[error("out of memory allocating {bytes} bytes (ledger: {ledger})")]
    OutOfMemory {
        /// Bytes asked for.
        bytes: u64,
        /// What the ledger held at that moment.
        ledger: String,
    },
}

/// Result of a backend operation.
pub type BResult<T> = Result<T, BackendError>;

/// Element type of a stored checkpoint tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RawDType {
    /// 32-bit float.
    F32,
    /// 16-bit float.
    F16,
    /// bfloat16.
    Bf16,
    /// One of GGML's block types as a GGUF file stores it (never F32, F16 or BF16, which are the
    /// variants above).
    Blocks(GgmlType),
}

impl RawDType {
    /// The stored type of GGML type `t`.
    pub fn of_ggml(t: GgmlType) -> Self {
        match t {
            GgmlType::F32 => RawDType::F32,
            GgmlType::F16 => RawDType::F16,
            GgmlType::Bf16 => RawDType::Bf16,
            blocks => RawDType::Blocks(blocks),
        }
    }

    /// The GGML type that stores values as this type does.
    pub fn ggml(self) -> GgmlType {
        match self {
            RawDType::F32 => GgmlType::F32,
            RawDType::F16 => GgmlType::F16,
            RawDType::Bf16 => GgmlType::Bf16,
            RawDType::Blocks(t) => t,
        }
    }

    /// Bytes of `n` values, or None when `n` does not split into this type's blocks.
    pub fn bytes_of(self, n: usize) -> Option<usize> {
        self.ggml().bytes_of(n as u64).and_then(|b| usize::try_from(b).ok())
    }

    /// The type's name as GGML spells it (`F32`, `Q4_K`).
    pub fn name(self) -> &'static str {
        self.ggml().name()
    }
}

/// A checkpoint tensor as stored: dtype, shape and little-endian bytes (usually memory-mapped;
/// owned where the file splits what the model reads as one tensor, as GGUF's projector does).
#[derive(Debug, Clone)]
pub struct RawTensor<'a> {
    /// Element type.
    pub dtype: RawDType,
    /// Shape.
    pub shape: Vec<usize>,
    /// Bytes: `numel` values of `dtype`.
    pub data: std::borrow::Cow<'a, [u8]>,
}

impl RawTensor<'_> {
    /// The tensor as the matrix [`Backend::load_weight`] stores: `[shape[0], the rest]`, for a
    /// tensor of rank 2 or more.
    pub fn matrix_dims(&self) -> Option<(usize, usize)> {
        match self.shape[..] {
            [rows, ref rest @ ..] if !rest.is_empty() => Some((rows, rest.iter().product())),
            _ => None,
        }
    }
}

/// Element-wise activations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `x·σ(x)`.
    Silu,
    /// GELU with the tanh approximation.
    GeluTanh,
    /// Exact GELU (erf).
    GeluErf,
    /// `x·σ(1.702x)`.
    QuickGelu,
}

/// One sequence's part of a paged-attention call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PagedSeq {
    /// First row of this sequence in the query tensor.
    pub query_start: usize,
    /// Number of query rows (new tokens this step).
    pub query_len: usize,
    /// Tokens in the KV cache for this sequence after this step's writes (context length).
    pub context_len: usize,
    /// Its row of the block tables ([`Backend::write_block_tables`]).
    pub table_row: usize,
    /// Blocks written into that row.
    pub table_len: usize,
}

/// A decoder step's attention metadata on the host: built once per step and handed to the backend
/// once ([`Backend::upload_paged`], which checks it: [`PagedBatch::flatten`]), then used by every
/// layer's K/V write and paged attention.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PagedBatch {
    /// The KV cache the slots and block tables point into.
    pub layout: KvLayout,
    /// KV slot (`block · block_size + offset`) of every query row.
    pub slots: Vec<usize>,
    /// The sequences, covering the query rows in order.
    pub seqs: Vec<PagedSeq>,
}

/// Geometry of a paged KV cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvLayout {
    /// Decoder layers.
    pub layers: usize,
    /// Blocks per layer (block 0 is the null block).
    pub num_blocks: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Per-head width.
    pub head_dim: usize,
    /// The block tables beside the cache.
    pub tables: TableShape,
}

/// The block tables a runner keeps on the device between steps, as vLLM's model runner does: one
/// row of block ids per request that can run at once, written only where a request's table grows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TableShape {
    /// Rows: requests that can run at once (`--max-num-seqs`).
    pub rows: usize,
    /// Block ids a row holds: the blocks of the longest sequence (`--max-model-len`).
    pub max_blocks: usize,
}

/// Block ids written into row `row` of the block tables from column `col` on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableWrite {
    /// The row.
    pub row: usize,
    /// The first column written.
    pub col: usize,
    /// The block ids.
    pub blocks: Vec<usize>,
}

impl KvLayout {
    /// Bytes of K and V for all layers at `elem_bytes` per element.
    pub fn bytes(&self, elem_bytes: u64) -> u64 {
        2 * (self.layers * self.num_blocks * self.block_size * self.kv_heads * self.head_dim) as u64 * elem_bytes
    }
}

/// Geometry of a hybrid model's state cache: per Gated DeltaNet layer and slot, a conv window
/// `[conv_len, conv_dim]` and a recurrent state `[heads, key_dim, value_dim]` (vLLM's
/// `gated_delta_net_state_shape`, both kept in f32 here).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StateLayout {
    /// Gated DeltaNet layers.
    pub layers: usize,
    /// Slots: requests that can run at once (one per block-table row).
    pub slots: usize,
    /// Conv channels: q, k and v side by side.
    pub conv_dim: usize,
    /// Past inputs the conv keeps: its kernel width less one.
    pub conv_len: usize,
    /// Query/key heads.
    pub key_heads: usize,
    /// Value heads (each key head serves `heads / key_heads` of them).
    pub heads: usize,
    /// Per-head query/key width.
    pub key_dim: usize,
    /// Per-head value width.
    pub value_dim: usize,
}

impl StateLayout {
    /// The layout of `linear` for `slots` requests.
    pub fn of(linear: &crate::arch::config::LinearAttention, slots: usize) -> Self {
        StateLayout {
            layers: linear.layers(),
            slots,
            conv_dim: linear.conv_dim(),
            conv_len: linear.conv_kernel - 1,
            key_heads: linear.num_key_heads,
            heads: linear.num_value_heads,
            key_dim: linear.key_head_dim,
            value_dim: linear.value_head_dim,
        }
    }

    /// Values of one slot in one layer: (conv window, recurrent state).
    pub fn slot_values(&self) -> (usize, usize) {
        (
            self.conv_len * self.conv_dim,
            self.heads * self.key_dim * self.value_dim,
        )
    }

    /// Checks one [`Backend::gated_delta_net`] call's input shapes (`qkv`, `a`, `b`, the conv
    /// kernel, `A_log`, `dt_bias`) and sequences against the layout; returns the rows.
    pub fn check_input(&self, layer: usize, shapes: [&[usize]; 6], seqs: &[StateSeq]) -> BResult<usize> {
        let numel = |s: &[usize]| s.iter().product::<usize>();
        let [qkv, a, b, conv, a_log, dt_bias] = shapes;
        let rows = qkv.first().copied().unwrap_or(0);
        let fits = qkv == [rows, self.conv_dim]
            && a == [rows, self.heads]
            && b == [rows, self.heads]
            && numel(conv) == self.conv_dim * (self.conv_len + 1)
            && numel(a_log) == self.heads
            && numel(dt_bias) == self.heads
            && layer < self.layers
            && self.key_dim <= 256
            && self.heads.is_multiple_of(self.key_heads.max(1))
            && seqs.iter().all(|s| s.slot < self.slots && s.start + s.len <= rows);
        if !fits {
            return Err(BackendError::Shape(format!(
                "gated delta net: inputs {shapes:?} or sequences {seqs:?} do not fit the state layout {self:?} (layer {layer})"
            )));
        }
        Ok(rows)
    }

    /// Bytes of every layer's slots at `elem_bytes` per value.
    pub fn bytes(&self, elem_bytes: u64) -> u64 {
        let (conv, rec) = self.slot_values();
        (self.layers * self.slots * (conv + rec)) as u64 * elem_bytes
    }
}

/// One sequence's rows in a [`Backend::gated_delta_net`] call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StateSeq {
    /// First row of the sequence in the inputs.
    pub start: usize,
    /// Its rows (new tokens this step).
    pub len: usize,
    /// Its slot in the state cache.
    pub slot: usize,
    /// The sequence starts here (its first token is position 0): its slot is zeroed first.
    pub fresh: bool,
}

/// The inputs of one Gated DeltaNet layer, after its projections.
#[derive(Debug, Clone, Copy)]
pub struct DeltaNetInput<'a, T> {
    /// `in_proj_qkv`'s output `[n, conv_dim]`, before the conv.
    pub qkv: &'a T,
    /// `in_proj_a`'s output `[n, heads]`.
    pub a: &'a T,
    /// `in_proj_b`'s output `[n, heads]`.
    pub b: &'a T,
    /// The depthwise conv kernel `[conv_dim, conv_len + 1]`.
    pub conv: &'a T,
    /// `A_log [heads]`.
    pub a_log: &'a T,
    /// `dt_bias [heads]`.
    pub dt_bias: &'a T,
}

/// A compute backend by name, as `--backend` takes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// candle on the CPU.
    Cpu,
    /// Our WGSL kernels on Vulkan, Metal, DX12 or WebGPU.
    Wgpu,
    /// NVIDIA GPUs.
    Cuda,
}

impl BackendKind {
    /// Every backend, built into this binary or not.
    pub const ALL: [BackendKind; 3] = [BackendKind::Cpu, BackendKind::Wgpu, BackendKind::Cuda];

    /// The name `--backend` takes.
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Cpu => "cpu",
            BackendKind::Wgpu => "wgpu",
            BackendKind::Cuda => "cuda",
        }
    }

    /// What the backend can do, when this build holds it.
    pub fn capabilities(self) -> Option<Capabilities> {
        match self {
            BackendKind::Cpu => Some(cpu::CpuBackend::CAPABILITIES),
            #[cfg(feature = "wgpu")]
            BackendKind::Wgpu => Some(wgpu::WgpuBackend::CAPABILITIES),
            #[cfg(feature = "cuda")]
            BackendKind::Cuda => Some(cuda::CudaBackend::CAPABILITIES),
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }

    /// Whether this build holds the backend.
    pub fn is_built(self) -> bool {
        match self {
            BackendKind::Cpu => true,
            BackendKind::Wgpu => cfg!(feature = "wgpu"),
            BackendKind::Cuda => cfg!(feature = "cuda"),
        }
    }

    /// Ok when this build holds the backend, else what the user can do instead.
    pub fn ensure_built(self) -> Result<(), String> {
        if self.is_built() {
            return Ok(());
        }
        let built: Vec<&str> = Self::ALL.iter().filter(|k| k.is_built()).map(|k| k.name()).collect();
        Err(format!(
            "--backend {}: this kvlens build has no {} backend (it has: {}); use --backend cpu",
            self.name(),
            self.name(),
            built.join(", ")
        ))
    }
}

impl std::str::FromStr for BackendKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|k| k.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| format!("unknown backend {s:?} (cpu, wgpu or cuda)"))
    }
}

impl std::fmt::Display for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Which rows [`Backend::sample`] samples on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceSamplingSupport {
    /// Every [`DeviceSampling`]: greedy, temperature, top-k, top-p, min-p.
    Full,
    /// Greedy rows only; a step with any other row reads its logits for the host.
    Greedy,
}

/// What a backend can do. The server, the playground and the engine ask this instead of
/// matching on backend names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capabilities {
    /// The dtype its activations and KV cache are computed and stored in.
    pub compute: crate::arch::config::DType,
    /// The block formats it stores weight matrices in (quantized on load), besides the compute
    /// dtype.
    pub quantized: &'static [crate::arch::weight_format::WeightFormat],
    /// The half-precision dtype it keeps unquantized weight matrices in when asked, if any.
    pub half_weights: Option<crate::arch::config::DType>,
    /// Which rows it samples on the device.
    pub sampling: DeviceSamplingSupport,
}

impl Capabilities {
    /// Whether it stores weight matrices in `format` (the compute dtype always).
    pub fn stores(&self, format: crate::arch::weight_format::WeightFormat) -> bool {
        format == crate::arch::weight_format::WeightFormat::Unquantized || self.quantized.contains(&format)
    }

    /// Whether a step may sample `row` on the device.
    pub fn samples(&self, row: &DeviceSampling) -> bool {
        match self.sampling {
            DeviceSamplingSupport::Full => true,
            DeviceSamplingSupport::Greedy => row.is_greedy(),
        }
    }
}

/// Free and total memory of a device, as its driver reports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceMemory {
    /// Bytes free now.
    pub free: u64,
    /// Bytes in all.
    pub total: u64,
}

/// The operations of a Qwen-VL forward pass. Row-major 2-D tensors `[rows, cols]` unless stated.
pub trait Backend: std::fmt::Debug + 'static {
    /// An f32 tensor on this backend: activations, norms, biases.
    type Tensor: Clone + std::fmt::Debug;
    /// A weight matrix `[out, in]` in the format the backend stores it in (f32, half precision or
    /// GGML blocks), read only by [`Backend::linear`], [`Backend::linears`] and
    /// [`Backend::embedding`].
    type Weight: Clone + std::fmt::Debug;
    /// The paged KV cache on this backend.
    type KvCache: std::fmt::Debug;

    /// The block tables ([`TableShape`]) on this backend.
    type BlockTables: std::fmt::Debug;
    /// A step's [`PagedBatch`] as the backend's kernels read it.
    type Paged: std::fmt::Debug;
    /// The vision tower's attention segments as the backend's kernels read them.
    type Segments: std::fmt::Debug;
    /// Hybrid models' per-request states ([`StateLayout`]).
    type StateCache: std::fmt::Debug;

    /// What this backend can do.
    const CAPABILITIES: Capabilities;

    /// Short name (`cpu`, `wgpu`, `cuda`).
    fn name(&self) -> &'static str;
    /// The backend and its device in one line, for the start-up log.
    fn describe(&self) -> String {
        self.name().to_string()
    }
    /// The device's free and total memory now, where it has memory of its own (None elsewhere).
    fn device_memory(&self) -> Option<BResult<DeviceMemory>> {
        None
    }
    /// Bytes per element of its activations and KV cache ([`Capabilities::compute`]).
    fn elem_bytes(&self) -> u64 {
        Self::CAPABILITIES.compute.size_bytes()
    }
    /// The ledger every allocation is recorded in.
    fn ledger(&self) -> &MemoryLedger;
    /// The largest buffer one kernel can bind, where the backend has such a limit (wgpu): one
    /// layer's keys must fit in it, which caps the KV cache.
    fn max_binding_bytes(&self) -> Option<u64> {
        None
    }

    /// Stores a checkpoint matrix (recorded as weights): `[out, in]`, or a tensor of higher rank
    /// viewed as `[shape[0], the rest]` (the patch embedding), in the format the backend was
    /// opened with for its shape ([`crate::arch::weight_format::WeightFormat::quantizes`]).
    /// `usage`: what the model does with its rows (a backend that spreads rows elsewhere keeps
    /// the rows the model gathers).
    fn load_weight(&self, raw: RawTensor<'_>, usage: MatrixUse) -> BResult<Self::Weight>;
    /// Converts a checkpoint vector (a norm, a bias) to the compute dtype (recorded as weights).
    fn load_tensor(&self, raw: RawTensor<'_>) -> BResult<Self::Tensor>;
    /// Uploads host floats as an activation.
    fn upload(&self, data: Vec<f32>, shape: &[usize]) -> BResult<Self::Tensor>;
    /// The same storage, recorded under `category` from now on (e.g. an encoder output that is kept).
    fn keep(&self, t: &Self::Tensor, category: crate::memory::ledger::Category) -> Self::Tensor;
    /// Queues a copy of a tensor to host floats (row-major). The only operation that waits for the
    /// device: the copy completes when the returned future does (at once on the CPU; in the
    /// browser only after control returns to the event loop).
    fn read(&self, t: &Self::Tensor) -> Readback;
    /// Allocates the zeroed block tables of `layout.tables`, for a cache of `layout`.
    fn alloc_block_tables(&self, layout: KvLayout) -> BResult<Self::BlockTables>;
    /// Writes block ids into the tables, each checked inside its row and the cache
    /// ([`paged::check_writes`]). Steps already recorded read the tables as they were.
    fn write_block_tables(&self, tables: &mut Self::BlockTables, writes: &[TableWrite]) -> BResult<()>;
    /// Checks a step's attention metadata ([`PagedBatch::flatten`]) and hands it to the device,
    /// once per step, with the block tables its sequences' rows are in.
    fn upload_paged(&self, batch: PagedBatch, tables: &Self::BlockTables) -> BResult<Self::Paged>;
    /// Hands the vision tower's attention segments `(start, len)` in rows to the device.
    fn upload_segments(&self, segments: &[(usize, usize)]) -> BResult<Self::Segments>;
    /// The tensor's shape.
    fn shape(&self, t: &Self::Tensor) -> Vec<usize>;

    /// `x · wᵀ (+ b)` for `x [n, in]`, `w [out, in]`.
    fn linear(&self, x: &Self::Tensor, w: &Self::Weight, b: Option<&Self::Tensor>) -> BResult<Self::Tensor>;
    /// [`Backend::linear`] of one `x` with several `(w, b)` (a layer's q/k/v, its gate and up), in
    /// one pass where the backend can share the work.
    fn linears(&self, x: &Self::Tensor, ws: &[(&Self::Weight, Option<&Self::Tensor>)]) -> BResult<Vec<Self::Tensor>> {
        ws.iter().map(|&(w, b)| self.linear(x, w, b)).collect()
    }
    /// Rows `ids` of `table [vocab, dim]`.
    fn embedding(&self, table: &Self::Weight, ids: &[u32]) -> BResult<Self::Tensor>;
    /// RMSNorm over the last axis.
    fn rms_norm(&self, x: &Self::Tensor, w: &Self::Tensor, eps: f64) -> BResult<Self::Tensor>;
    /// LayerNorm over the last axis.
    fn layer_norm(&self, x: &Self::Tensor, w: &Self::Tensor, b: &Self::Tensor, eps: f64) -> BResult<Self::Tensor>;
    /// Element-wise activation.
    fn activate(&self, x: &Self::Tensor, act: Activation) -> BResult<Self::Tensor>;
    /// `silu(gate) ⊙ up`.
    fn silu_mul(&self, gate: &Self::Tensor, up: &Self::Tensor) -> BResult<Self::Tensor>;
    /// `a + b` (same shape).
    fn add(&self, a: &Self::Tensor, b: &Self::Tensor) -> BResult<Self::Tensor>;
    /// `(x + y, rms_norm(x + y, w))`, in one pass where the backend can ([`fused::add_rms_norm`]).
    fn add_rms_norm(
        &self,
        x: &Self::Tensor,
        y: &Self::Tensor,
        w: &Self::Tensor,
        eps: f64,
    ) -> BResult<(Self::Tensor, Self::Tensor)> {
        fused::add_rms_norm(self, x, y, w, eps)
    }
    /// Each head's RMSNorm (where `w` is given) and rotary embedding, in one pass where the
    /// backend can ([`fused::norm_rope`]).
    fn norm_rope(
        &self,
        x: &Self::Tensor,
        w: Option<&Self::Tensor>,
        eps: f64,
        cos: &Self::Tensor,
        sin: &Self::Tensor,
        head_dim: usize,
    ) -> BResult<Self::Tensor> {
        fused::norm_rope(self, x, w, eps, cos, sin, head_dim)
    }
    /// `silu(x · gateᵀ) ⊙ (x · upᵀ)`, in one pass where the backend can ([`fused::swiglu`]).
    fn swiglu(&self, x: &Self::Tensor, gate: &Self::Weight, up: &Self::Weight) -> BResult<Self::Tensor> {
        fused::swiglu(self, x, gate, up)
    }
    /// Rotary embedding, rotate-half convention: `x [n, heads·d]`, `cos`/`sin [n, d]`.
    fn rope(&self, x: &Self::Tensor, cos: &Self::Tensor, sin: &Self::Tensor) -> BResult<Self::Tensor>;
    /// Columns `[start, start+len)`.
    fn narrow_cols(&self, x: &Self::Tensor, start: usize, len: usize) -> BResult<Self::Tensor>;
    /// Reinterprets the row-major data with a new 2-D shape.
    fn reshape(&self, x: &Self::Tensor, rows: usize, cols: usize) -> BResult<Self::Tensor>;
    /// Rows `idx` of `x`, in that order.
    fn gather_rows(&self, x: &Self::Tensor, idx: &[usize]) -> BResult<Self::Tensor>;
    /// `x` with rows `idx[i]` replaced by row `i` of `src` (`add`: added instead).
    fn scatter_rows(&self, x: &Self::Tensor, idx: &[usize], src: &Self::Tensor, add: bool) -> BResult<Self::Tensor>;
    /// `x [rows, cols]` with row `r` multiplied by `scales[r]` (a mixture of experts' routing weights).
    fn scale_rows(&self, x: &Self::Tensor, scales: &[f32]) -> BResult<Self::Tensor>;
    /// Stacks tensors with equal column counts.
    fn concat_rows(&self, parts: &[Self::Tensor]) -> BResult<Self::Tensor>;
    /// Bidirectional attention within segments (`(start, len)` in rows): `q,k,v [n, heads·d]`.
    fn segment_attention(
        &self,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        heads: usize,
        segments: &Self::Segments,
    ) -> BResult<Self::Tensor>;

    /// Allocates a zeroed paged KV cache (recorded as kv_cache).
    fn alloc_kv(&self, layout: KvLayout) -> BResult<Self::KvCache>;
    /// Writes rows of `k`, `v [n, kv_heads·d]` into the batch's slots of one layer.
    fn write_kv(
        &self,
        cache: &mut Self::KvCache,
        layer: usize,
        k: &Self::Tensor,
        v: &Self::Tensor,
        batch: &Self::Paged,
    ) -> BResult<()>;
    /// Causal attention of `q [n, heads·d]` over each sequence's cached keys and values.
    fn paged_attention(
        &self,
        cache: &Self::KvCache,
        layer: usize,
        q: &Self::Tensor,
        heads: usize,
        batch: &Self::Paged,
    ) -> BResult<Self::Tensor>;

    /// Rotary embedding of the first `cos.cols` values of each head of `head_dim` in
    /// `x [n, heads·head_dim]` (rotate-half over those values; the rest pass unchanged), as
    /// Qwen3.5's partial rotary does.
    fn rope_partial(
        &self,
        x: &Self::Tensor,
        cos: &Self::Tensor,
        sin: &Self::Tensor,
        head_dim: usize,
    ) -> BResult<Self::Tensor> {
        match self.shape(cos).get(1) {
            Some(&d) if d == head_dim => self.rope(x, cos, sin),
            _ => Err(self.missing("partial rotary")),
        }
    }
    /// `x ⊙ σ(gate)` (same shape): Qwen3.5's attention output gate.
    fn sigmoid_mul(&self, _gate: &Self::Tensor, _x: &Self::Tensor) -> BResult<Self::Tensor> {
        Err(self.missing("sigmoid gate"))
    }
    /// Allocates a zeroed state cache (recorded as state_cache).
    fn alloc_states(&self, _layout: StateLayout) -> BResult<Self::StateCache> {
        Err(self.missing("Gated DeltaNet state"))
    }
    /// One Gated DeltaNet layer's recurrence over each sequence's rows, continuing from and
    /// updating its slot of `states`: the causal conv1d over the slot's window and the new rows,
    /// SiLU, q/k L2-normalised, the decay `g = −exp(A_log)·softplus(a + dt_bias)` and write strength
    /// `β = σ(b)`, then per value head `S ← exp(g)·S; S ← S + k ⊗ β(v − Sᵀk); o = Sᵀq/√key_dim`
    /// (transformers' `torch_recurrent_gated_delta_rule`). Returns `o [n, heads·value_dim]`.
    fn gated_delta_net(
        &self,
        _states: &mut Self::StateCache,
        _layer: usize,
        _input: DeltaNetInput<'_, Self::Tensor>,
        _seqs: &[StateSeq],
    ) -> BResult<Self::Tensor> {
        Err(self.missing("Gated DeltaNet"))
    }
    /// The error of an operation this backend has no kernel for.
    fn missing(&self, op: &'static str) -> BackendError {
        BackendError::Missing {
            backend: self.name(),
            op,
            what: "Qwen3.5 runs on the CPU backend for now",
        }
    }

    /// Samples one token per row of `logits [rows, vocab]` as `rows[i]` says, where the logits
    /// are: `[rows, 2]` holding the token id (as f32, exact below 2²⁴) and its log-probability
    /// under the model. [`DeviceSampling::pick`] is the definition; a decode step then reads two
    /// floats per sequence instead of a vocabulary's worth.
    fn sample(&self, logits: &Self::Tensor, rows: &[DeviceSampling]) -> BResult<Self::Tensor>;
}

#[cfg(test)]
mod tests {
    use super::BackendKind;

    #[test]
    fn backend_names_parse_and_a_missing_backend_says_what_the_build_has() {
        assert_eq!("CUDA".parse::<BackendKind>(), Ok(BackendKind::Cuda));
        assert!("tpu".parse::<BackendKind>().unwrap_err().contains("cpu, wgpu or cuda"));
        assert_eq!(BackendKind::Cpu.ensure_built(), Ok(()));
        assert_eq!(BackendKind::Wgpu.ensure_built().is_ok(), cfg!(feature = "wgpu"));
        assert_eq!(BackendKind::Cuda.ensure_built().is_ok(), cfg!(feature = "cuda"));
        if !cfg!(feature = "cuda") {
            let err = BackendKind::Cuda.ensure_built().unwrap_err();
            assert!(err.contains("no cuda backend (it has: cpu"), "{err}");
        }
    }
}
