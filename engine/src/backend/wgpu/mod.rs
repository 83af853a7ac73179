//! The wgpu backend: our own WGSL kernels on Vulkan, Metal, DX12 natively (lavapipe in CI) and on
//! WebGPU in the browser. Every operation records a dispatch into the step's one command encoder;
//! only [`Backend::read`] submits it and waits, as a future, for the copy to come back.
//!
//! Activations and the KV cache are f32; 2-D weights are f32, f16 packed two per `u32`
//! ([`WgpuOptions::f16_weights`]), GGML's `q8_0` / `q4_0` ([`WgpuOptions::quantization`] or a GGUF
//! file's, laid out by [`quantized`]) or a GGUF file's `q4_1`, `q5_0`, `q5_1`, `q4_K`, `q5_K` and
//! `q6_K` blocks in the file's bytes (`kernels/weights_ggml.wgsl`), which the kernels dequantize as
//! they read; 1-D weights (norms, biases) stay f32. A weight larger than the device's
//! storage-binding limit is split by rows across buffers (each padded to whole words), and the
//! kernels that read weights (matmul, embedding) run once per part.

// On the web wgpu's handles are neither Send nor Sync (the page has one thread); the Arcs that
// share them serve native threads.
#![cfg_attr(target_arch = "wasm32", allow(clippy::arc_with_non_send_sync))]

mod device;
mod kernels;
mod quantized;
mod readback;
mod storage;

pub use device::WgpuOptions;

use super::{
    fused, Activation, BResult, Backend, BackendError, DeltaNetInput, KvLayout, PagedBatch, RawDType, RawTensor,
    Readback, StateLayout, StateSeq, TableWrite,
};
use crate::arch::blocks::BlockKind;
use crate::arch::ggml::GgmlType;
use crate::arch::weight_format::WeightFormat;
use crate::fault::ledger_summary;
use crate::memory::ledger::{Category, MemoryLedger};
use crate::sample::DeviceSampling;
use device::Gpu;
use kernels::{grid, params, Kernel, Pipelines, WeightElem};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use storage::{size_class, Buf, Pool, STORAGE};
use wgpu::util::DeviceExt;

/// Output columns per workgroup of the `gemv` kernels (`GEMV_COLS` in `kernels/matmul.wgsl`).
const GEMV_COLS: usize = 4;
/// Most rows of x one `gemv_rows` dispatch takes (`GEMV_ROWS` in `kernels/matmul.wgsl`).
const GEMV_CHUNK: usize = 8;
/// Up to this many rows a linear runs as GEMVs of `GEMV_CHUNK` rows (the weights read once per
/// chunk) rather than as one GEMM, whose 128-row tiles would mostly compute padding.
const GEMV_MAX_ROWS: usize = 16;
/// Rows and columns of a `gemm` workgroup's output tile.
const GEMM_TILE: usize = 128;

/// One buffer of a tensor: rows `[row0, row0 + rows)` of its first axis.
#[derive(Debug)]
struct Part {
    buf: Buf,
    row0: usize,
    rows: usize,
}

/// An f32 tensor on the device: one buffer, or row ranges where it is larger than one storage
/// binding (the logits of many rows), which only [`Backend::read`] takes.
#[derive(Debug, Clone)]
pub struct WgpuTensor {
    parts: Arc<Vec<Part>>,
    shape: Vec<usize>,
}

impl WgpuTensor {
    fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The tensor's one buffer, as every kernel binds it.
    fn buffer(&self) -> BResult<&wgpu::Buffer> {
        match &self.parts[..] {
            [p] => Ok(&p.buf.buffer),
            parts => Err(shape_err(format!(
                "a tensor of shape {:?} in {} buffers (larger than one storage binding) can only be read",
                self.shape,
                parts.len()
            ))),
        }
    }
}

/// A weight matrix `[rows, cols]` on the device in its stored format ([`WeightElem`]), in row
/// ranges that each fit one storage binding.
#[derive(Debug, Clone)]
pub struct WgpuWeight {
    parts: Arc<Vec<Part>>,
    elem: WeightElem,
    rows: usize,
    cols: usize,
}

/// The paged KV cache: per layer, a K and a V buffer of `[slots, kv_heads · head_dim]` f32.
#[derive(Debug)]
pub struct WgpuKvCache {
    layout: KvLayout,
    keys: Vec<Buf>,
    values: Vec<Buf>,
}

/// A hybrid model's states: per Gated DeltaNet layer, the conv windows `[slots, conv_len,
/// conv_dim]` and the recurrent states `[slots, heads, key_dim, value_dim]`, f32.
#[derive(Debug)]
pub struct WgpuStates {
    layout: StateLayout,
    conv: Vec<Buf>,
    recurrent: Vec<Buf>,
}

/// The block tables on the device: `rows × max_blocks` u32 block ids.
#[derive(Debug)]
pub struct WgpuBlockTables {
    layout: KvLayout,
    buf: Arc<Buf>,
}

/// A step's paged-attention metadata on the device, with the host copy its checks read.
#[derive(Debug)]
pub struct WgpuPaged {
    host: PagedBatch,
    slots: Buf,
    /// Per query row: offset of its row in `tables`, and its key count (causal).
    rows: Buf,
    tables: Arc<Buf>,
}

/// The vision tower's segments on the device: per row, its segment's first row and length.
#[derive(Debug)]
pub struct WgpuSegments {
    rows: usize,
    meta: Buf,
}

struct Inner {
    gpu: Gpu,
    ledger: MemoryLedger,
    pipelines: Pipelines,
    pool: Arc<Pool>,
    encoder: Mutex<Option<wgpu::CommandEncoder>>,
    /// Parameter blocks of the recorded dispatches, held until the encoder is submitted.
    uniforms: Mutex<Vec<Buf>>,
    /// The first error the device reported outside an error scope (or its loss).
    error: Arc<Mutex<Option<String>>>,
    f16_weights: bool,
    quantization: WeightFormat,
    /// A CPU adapter (lavapipe, SwiftShader): matmul, norms and attention use barrier-free kernels.
    cpu_adapter: bool,
    /// Bound where a kernel declares a buffer the operation does not use.
    dummy: wgpu::Buffer,
    /// Bytes of every buffer created and not yet destroyed, counted at the wgpu calls.
    device_bytes: Arc<AtomicU64>,
}

/// The wgpu backend.
#[derive(Clone)]
pub struct WgpuBackend {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for WgpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WgpuBackend")
            .field("adapter", &self.inner.gpu.info.name)
            .finish()
    }
}

fn shape_err(msg: String) -> BackendError {
    BackendError::Shape(msg)
}

fn dims2(t: &WgpuTensor) -> BResult<(usize, usize)> {
    match t.shape[..] {
        [r, c] => Ok((r, c)),
        _ => Err(shape_err(format!("expected a 2-D tensor, got {:?}", t.shape))),
    }
}

/// x's rows and columns for a norm with one weight (and bias) a column.
fn norm_dims(x: &WgpuTensor, w: &WgpuTensor, b: Option<&WgpuTensor>) -> BResult<(usize, usize)> {
    let (rows, cols) = dims2(x)?;
    if w.numel() != cols || b.is_some_and(|b| b.numel() != cols) {
        return Err(shape_err(format!(
            "norm of {cols} columns with a weight of {:?}",
            w.shape
        )));
    }
    Ok((rows, cols))
}

/// x's rows and columns and the values `d` of each head of `head` that turn (cos/sin `[n, d]`).
fn rope_dims(x: &WgpuTensor, cos: &WgpuTensor, sin: &WgpuTensor, head: usize) -> BResult<(usize, usize, usize)> {
    let (n, cols) = dims2(x)?;
    let (cn, d) = dims2(cos)?;
    if d == 0 || head < d || cols % head != 0 || d % 2 != 0 || cn != n || sin.shape != cos.shape {
        return Err(shape_err(format!(
            "rope: {cols} columns are not whole heads of {head} with {d} rotated (cos {cn}×{d}, {n} rows)"
        )));
    }
    Ok((n, cols, d))
}

/// The widest head `norm_rope` in rope.wgsl stages in workgroup memory.
const NORM_ROPE_MAX_HEAD: usize = 256;

fn u32s(v: impl IntoIterator<Item = usize>) -> Vec<u8> {
    let mut out: Vec<u8> = v.into_iter().flat_map(|x| (x as u32).to_le_bytes()).collect();
    if out.is_empty() {
        out.resize(4, 0);
    }
    out
}

impl WgpuBackend {
    /// Opens a device (see [`WgpuOptions`]) whose buffers are recorded in `ledger`.
    pub async fn new(ledger: MemoryLedger, opts: WgpuOptions) -> BResult<Self> {
        let gpu = device::open(&opts).await?;
        let cpu_adapter = opts
            .barrier_free
            .unwrap_or(gpu.info.device_type == wgpu::DeviceType::Cpu);
        let error: Arc<Mutex<Option<String>>> = Arc::default();
        let sink = error.clone();
        gpu.device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            sink.lock()
                .unwrap_or_else(|p| p.into_inner())
                .get_or_insert(e.to_string());
        }));
        let sink = error.clone();
        gpu.device.set_device_lost_callback(move |reason, msg| {
            let mut slot = sink.lock().unwrap_or_else(|p| p.into_inner());
            slot.get_or_insert(format!("the wgpu device was lost ({reason:?}): {msg}"));
        });
        let dummy = gpu.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("unused binding"),
            size: 16,
            usage: STORAGE,
            mapped_at_creation: false,
        });
        Ok(WgpuBackend {
            inner: Arc::new(Inner {
                gpu,
                ledger,
                pipelines: Pipelines::default(),
                pool: Arc::default(),
                encoder: Mutex::default(),
                uniforms: Mutex::default(),
                error,
                f16_weights: opts.f16_weights,
                quantization: opts.quantization,
                cpu_adapter,
                dummy,
                device_bytes: Arc::default(),
            }),
        })
    }

    /// Opens a device natively, blocking until it is ready.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn new_blocking(ledger: MemoryLedger, opts: WgpuOptions) -> BResult<Self> {
        super::block_on(Self::new(ledger, opts))
    }

    /// The adapter, its limits and the features used, for the start-up log.
    pub fn describe(&self) -> String {
        let kept = if self.inner.f16_weights { "f16" } else { "f32" };
        let weights = match self.inner.quantization {
            WeightFormat::Unquantized => kept.to_string(),
            q => format!("{q} (other matrices {kept})"),
        };
        format!(
            "{}; weights {weights}, activations and KV cache f32",
            self.inner.gpu.describe()
        )
    }

    /// The adapter the device was opened on (in the browser its backend is `BrowserWebGpu`).
    pub fn adapter_info(&self) -> &wgpu::AdapterInfo {
        &self.inner.gpu.info
    }

    /// Compiles every kernel (each entry point, for each weight format it reads) on this device and
    /// returns how many pipelines that made; an error lists each compiler or pipeline error. The
    /// backend otherwise compiles a kernel at its first dispatch and reports a failure only at the
    /// next read; in the browser this runs the browser's own WGSL compiler (Tint in Chrome), so a
    /// kernel it rejects shows up here even where the adapter would pick another matmul.
    pub async fn check_kernels(&self) -> BResult<usize> {
        kernels::check_all(&self.inner.gpu.device)
            .await
            .map_err(|errors| BackendError::Library(errors.join("\n").into()))
    }

    /// Bytes of every device buffer that exists now (the ledger's total must equal it).
    pub fn device_bytes(&self) -> u64 {
        self.inner.device_bytes.load(Ordering::Relaxed)
    }

    /// Free activation buffers the pool keeps, and their bytes.
    pub fn pooled(&self) -> (usize, u64) {
        self.inner.pool.free_buffers()
    }

    /// Destroys the free activation buffers the pool keeps (a device that stays open while
    /// another one runs the model).
    pub fn release_pooled(&self) {
        self.inner.pool.clear();
    }

    fn oom(&self, bytes: u64) -> BackendError {
        BackendError::OutOfMemory {
            bytes,
            ledger: ledger_summary(&self.inner.ledger),
        }
    }

    /// The device's first asynchronous error, if any, with the ledger at this moment.
    fn device_error(&self) -> BResult<()> {
        let err = self.inner.error.lock().unwrap_or_else(|p| p.into_inner()).clone();
        match err {
            Some(e) if e.to_lowercase().contains("out of memory") => Err(self.oom(0)),
            Some(e) => Err(BackendError::Library(
                format!("{e} (ledger: {})", ledger_summary(&self.inner.ledger)).into(),
            )),
            None => Ok(()),
        }
    }

    /// Creates a buffer of `size` bytes; an allocation the device refuses is an out-of-memory
    /// error carrying the ledger (natively checked at once in an error scope).
    fn create(&self, size: u64, usage: wgpu::BufferUsages, contents: Option<&[u8]>) -> BResult<wgpu::Buffer> {
        let l = &self.inner.gpu.limits;
        if size > l.max_buffer_size {
            return Err(self.oom(size));
        }
        let device = &self.inner.gpu.device;
        #[cfg(not(target_arch = "wasm32"))]
        let scope = device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let buffer = match contents {
            Some(contents) => device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: None,
                contents,
                usage,
            }),
            None => device.create_buffer(&wgpu::BufferDescriptor {
                label: None,
                size,
                usage,
                mapped_at_creation: false,
            }),
        };
        #[cfg(not(target_arch = "wasm32"))]
        if super::block_on(scope.pop()).is_some() {
            return Err(self.oom(size));
        }
        self.inner.device_bytes.fetch_add(buffer.size(), Ordering::Relaxed);
        Ok(buffer)
    }

    /// A buffer outside the pool, recorded under `category`.
    fn owned(&self, size: u64, category: Category, contents: Option<&[u8]>) -> BResult<Buf> {
        let buffer = self.create(size, STORAGE, contents)?;
        Ok(Buf::new(
            buffer,
            &self.inner.ledger,
            category,
            self.inner.device_bytes.clone(),
        ))
    }

    /// An activation buffer for `elems` floats, from the pool when it has one of the size.
    fn scratch(&self, elems: usize) -> BResult<Buf> {
        let size = size_class(elems as u64 * 4);
        if size > self.inner.gpu.max_binding {
            return Err(shape_err(format!(
                "an activation of {elems} floats ({size} bytes) exceeds the device's storage-binding \
                 limit of {} bytes",
                self.inner.gpu.max_binding
            )));
        }
        if let Some(buf) = self.inner.pool.take(size) {
            return Ok(buf);
        }
        let buffer = match self.create(size, STORAGE, None) {
            Err(BackendError::OutOfMemory { .. }) => {
                // Free buffers of other sizes may be what stands in the way.
                self.inner.pool.clear();
                self.create(size, STORAGE, None)?
            }
            other => other?,
        };
        Ok(self
            .inner
            .pool
            .adopt(buffer, &self.inner.ledger, self.inner.device_bytes.clone()))
    }

    fn tensor(&self, buf: Buf, shape: Vec<usize>) -> WgpuTensor {
        let rows = shape.first().copied().unwrap_or(1);
        WgpuTensor {
            parts: Arc::new(vec![Part { buf, row0: 0, rows }]),
            shape,
        }
    }

    fn with_encoder<R>(&self, f: impl FnOnce(&mut wgpu::CommandEncoder) -> R) -> R {
        let mut slot = self.inner.encoder.lock().unwrap_or_else(|p| p.into_inner());
        let encoder = slot.get_or_insert_with(|| {
            self.inner
                .gpu
                .device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("step") })
        });
        f(encoder)
    }

    /// Submits everything recorded so far.
    fn submit(&self) {
        let encoder = self.inner.encoder.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(encoder) = encoder {
            self.inner.gpu.queue.submit(Some(encoder.finish()));
        }
        self.inner.uniforms.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }

    /// Records one dispatch of `entry` with its parameter block at binding 0 and `binds`.
    fn dispatch(
        &self,
        kernel: Kernel,
        weights: Option<WeightElem>,
        entry: &'static str,
        words: &[u32],
        binds: &[(u32, &wgpu::Buffer)],
        groups: (u32, u32, u32),
    ) -> BResult<()> {
        let entries = binds.iter().map(|(i, b)| (*i, b.as_entire_binding())).collect();
        self.dispatch_entries(kernel, weights, entry, words, entries, groups)
    }

    /// [`Self::dispatch`] with bindings that may be slices of buffers.
    fn dispatch_entries(
        &self,
        kernel: Kernel,
        weights: Option<WeightElem>,
        entry: &'static str,
        words: &[u32],
        binds: Vec<(u32, wgpu::BindingResource<'_>)>,
        groups: (u32, u32, u32),
    ) -> BResult<()> {
        let pipeline = self.inner.pipelines.get(&self.inner.gpu.device, kernel, weights, entry);
        // A few dozen bytes per dispatch: created without the out-of-memory scope of `create`.
        let uniform = self
            .inner
            .gpu
            .device
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some(entry),
                contents: &params(words),
                usage: wgpu::BufferUsages::UNIFORM,
            });
        self.inner.device_bytes.fetch_add(uniform.size(), Ordering::Relaxed);
        let mut entries = vec![wgpu::BindGroupEntry {
            binding: 0,
            resource: uniform.as_entire_binding(),
        }];
        entries.extend(
            binds
                .into_iter()
                .map(|(binding, resource)| wgpu::BindGroupEntry { binding, resource }),
        );
        let group = self.inner.gpu.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some(entry),
            layout: &pipeline.get_bind_group_layout(0),
            entries: &entries,
        });
        self.with_encoder(|enc| {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some(entry),
                timestamp_writes: None,
            });
            pass.set_pipeline(&pipeline);
            pass.set_bind_group(0, &group, &[]);
            pass.dispatch_workgroups(groups.0, groups.1, groups.2);
        });
        let held = Buf::new(
            uniform,
            &self.inner.ledger,
            Category::Staging,
            self.inner.device_bytes.clone(),
        );
        self.inner.uniforms.lock().unwrap_or_else(|p| p.into_inner()).push(held);
        Ok(())
    }

    /// Records an element-wise kernel over `n` elements.
    fn elementwise(&self, kernel: Kernel, words: &[u32], binds: &[(u32, &wgpu::Buffer)], n: usize) -> BResult<()> {
        self.dispatch(kernel, None, "main", words, binds, grid((n as u64).div_ceil(256)))
    }

    fn upload_u32(&self, values: impl IntoIterator<Item = usize>) -> BResult<Buf> {
        let bytes = u32s(values);
        self.owned(bytes.len() as u64, Category::Activations, Some(&bytes))
    }

    /// Rows `rows × cols` from `src` to `dst` (see `kernels/rows.wgsl`).
    #[allow(clippy::too_many_arguments)]
    fn copy_rows(
        &self,
        src: &wgpu::Buffer,
        dst: &wgpu::Buffer,
        idx: Option<&wgpu::Buffer>,
        rows: usize,
        cols: usize,
        strides: [usize; 4],
        mode: u32,
        add: bool,
    ) -> BResult<()> {
        let [src_stride, src_col0, dst_stride, dst_col0] = strides;
        let words = [
            rows as u32,
            cols as u32,
            src_stride as u32,
            src_col0 as u32,
            dst_stride as u32,
            dst_col0 as u32,
            mode,
            add as u32,
        ];
        let binds = [(1, src), (2, idx.unwrap_or(&self.inner.dummy)), (3, dst)];
        self.elementwise(Kernel::Rows, &words, &binds, rows * cols)
    }

    /// Quantizes a stored matrix's `rows` (of `cols` values) into the device bytes of one part, a
    /// few rows at a time (an even count, so that the pieces line up) to bound the f32 copy.
    fn quantize(raw: &RawTensor<'_>, kind: BlockKind, rows: std::ops::Range<usize>, cols: usize) -> Vec<u8> {
        const ROWS_AT_ONCE: usize = 256;
        let mut out = Vec::new();
        for r in rows.clone().step_by(ROWS_AT_ONCE) {
            let n = ROWS_AT_ONCE.min(rows.end - r);
            let values = crate::model::weights::host_f32_range(raw, r * cols..(r + n) * cols);
            out.extend(quantized::device_blocks(kind, &values, cols));
        }
        out
    }

    /// Converts a stored tensor's values `[from, to)` (whole blocks of its type) to f32 bytes, or
    /// f16 when `to_f16`.
    fn convert(raw: &RawTensor<'_>, to_f16: bool, from: usize, to: usize) -> Vec<u8> {
        let mut out: Vec<u8> = match (raw.dtype, to_f16) {
            (RawDType::F16, true) => raw.data[from * 2..to * 2].to_vec(),
            (RawDType::F32, false) => raw.data[from * 4..to * 4].to_vec(),
            (_, to_f16) => {
                let values = crate::model::weights::host_f32_range(raw, from..to);
                match to_f16 {
                    false => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
                    true => values
                        .iter()
                        .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
                        .collect(),
                }
            }
        };
        out.resize(out.len().div_ceil(4).max(1) * 4, 0);
        out
    }
}

impl Backend for WgpuBackend {
    type Tensor = WgpuTensor;
    type Weight = WgpuWeight;
    type KvCache = WgpuKvCache;
    type BlockTables = WgpuBlockTables;
    type Paged = WgpuPaged;
    type Segments = WgpuSegments;
    type StateCache = WgpuStates;

    const CAPABILITIES: super::Capabilities = super::Capabilities {
        compute: crate::arch::config::DType::F32,
        quantized: &[WeightFormat::Q8_0, WeightFormat::Q4_0],
        half_weights: Some(crate::arch::config::DType::F16),
        sampling: super::DeviceSamplingSupport::Full,
    };

    fn describe(&self) -> String {
        WgpuBackend::describe(self)
    }

    fn name(&self) -> &'static str {
        "wgpu"
    }

    fn ledger(&self) -> &MemoryLedger {
        &self.inner.ledger
    }

    fn max_binding_bytes(&self) -> Option<u64> {
        Some(self.inner.gpu.max_binding)
    }

    fn load_weight(&self, raw: RawTensor<'_>, _usage: super::MatrixUse) -> BResult<WgpuWeight> {
        let Some((rows, cols)) = raw.matrix_dims() else {
            return Err(shape_err(format!("a weight matrix of shape {:?}", raw.shape)));
        };
        let elem = match (raw.dtype, self.inner.quantization) {
            // A GGUF file's q8_0 and q4_0 blocks keep their values in the kernels' layout, the
            // other block types their bytes.
            (RawDType::Blocks(GgmlType::Q8_0), _) => WeightElem::Q8_0,
            (RawDType::Blocks(GgmlType::Q4_0), _) => WeightElem::Q4_0,
            (RawDType::Blocks(t), _) => WeightElem::stored(t).ok_or(BackendError::Unsupported {
                backend: "wgpu",
                dtype: t.name(),
                what: "no WGSL reader; the cpu backend reads every GGUF type",
            })?,
            (_, WeightFormat::Q8_0) if WeightFormat::Q8_0.quantizes(&raw.shape) => WeightElem::Q8_0,
            (_, WeightFormat::Q4_0) if WeightFormat::Q4_0.quantizes(&raw.shape) => WeightElem::Q4_0,
            // f16 weights stay as stored (a GGUF file's, an f16 checkpoint's; the patch kernel too).
            (RawDType::F16, _) => WeightElem::F16,
            _ if self.inner.f16_weights && raw.shape.len() == 2 => WeightElem::F16,
            _ => WeightElem::F32,
        };
        if let RawDType::Blocks(t) = raw.dtype {
            if !cols.is_multiple_of(t.block().0) || t.bytes_of((rows * cols) as u64) != Some(raw.data.len() as u64) {
                return Err(shape_err(format!(
                    "{} bytes of {t} as a {rows}×{cols} matrix (whole blocks a row)",
                    raw.data.len()
                )));
            }
        }
        let row_bytes = elem.row_bytes(cols).max(1);
        // Less a word: what padding adds to a part (an odd count of f16 values or of q8_0/q4_0
        // blocks, stored bytes to a whole word); and the kernels index a part's elements with u32.
        let per_part =
            ((self.inner.gpu.max_binding.saturating_sub(4) / row_bytes) as usize).min(u32::MAX as usize / cols.max(1));
        if per_part == 0 {
            return Err(self.oom(row_bytes));
        }
        let mut parts = Vec::new();
        for row0 in (0..rows.max(1)).step_by(per_part) {
            let n = per_part.min(rows.max(1) - row0);
            let bytes = match (elem, elem.block_kind()) {
                (WeightElem::Ggml(_), _) => {
                    let row = row_bytes as usize;
                    let mut bytes = raw.data[row0 * row..(row0 + n) * row].to_vec();
                    bytes.resize(bytes.len().div_ceil(4).max(1) * 4, 0);
                    bytes
                }
                (_, None) => Self::convert(&raw, elem == WeightElem::F16, row0 * cols, (row0 + n) * cols),
                (_, Some(kind)) => Self::quantize(&raw, kind, row0..row0 + n, cols),
            };
            let buf = self.owned(bytes.len() as u64, Category::Weights, Some(&bytes))?;
            parts.push(Part { buf, row0, rows: n });
        }
        Ok(WgpuWeight {
            parts: Arc::new(parts),
            elem,
            rows,
            cols,
        })
    }

    fn load_tensor(&self, raw: RawTensor<'_>) -> BResult<WgpuTensor> {
        let numel = raw.shape.iter().product();
        let bytes = Self::convert(&raw, false, 0, numel);
        let buf = self.owned(bytes.len() as u64, Category::Weights, Some(&bytes))?;
        Ok(self.tensor(buf, raw.shape.clone()))
    }

    fn upload(&self, data: Vec<f32>, shape: &[usize]) -> BResult<WgpuTensor> {
        let numel: usize = shape.iter().product();
        if numel != data.len() {
            return Err(shape_err(format!("upload of {} floats as {shape:?}", data.len())));
        }
        let mut bytes: Vec<u8> = bytemuck::cast_slice(&data).to_vec();
        bytes.resize(bytes.len().max(4), 0);
        let buf = self.owned(bytes.len() as u64, Category::Activations, Some(&bytes))?;
        Ok(self.tensor(buf, shape.to_vec()))
    }

    fn keep(&self, t: &WgpuTensor, category: Category) -> WgpuTensor {
        // A kept tensor gets its own buffer, so that the pooled one it came from can be reused.
        let copy = (|| -> BResult<WgpuTensor> {
            let from = t.buffer()?;
            let bytes = (t.numel() as u64 * 4).max(4);
            let buf = self.owned(bytes, category, None)?;
            self.with_encoder(|enc| enc.copy_buffer_to_buffer(from, 0, &buf.buffer, 0, bytes));
            Ok(self.tensor(buf, t.shape.clone()))
        })();
        // The trait cannot fail here; an allocation failure keeps the original storage instead.
        copy.unwrap_or_else(|_| t.clone())
    }

    fn read(&self, t: &WgpuTensor) -> Readback {
        let run = || -> BResult<readback::Pending> {
            self.device_error()?;
            // Each part is copied where its rows go.
            let bytes = (t.numel() as u64 * 4).max(4);
            let row_bytes = bytes / t.shape.first().copied().unwrap_or(1).max(1) as u64;
            let staging = self.create(bytes, wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST, None)?;
            let staging = Buf::new(
                staging,
                &self.inner.ledger,
                Category::Staging,
                self.inner.device_bytes.clone(),
            );
            self.with_encoder(|enc| {
                for p in t.parts.iter() {
                    let size = (p.rows as u64 * row_bytes).min(bytes);
                    enc.copy_buffer_to_buffer(&p.buf.buffer, 0, &staging.buffer, p.row0 as u64 * row_bytes, size);
                }
            });
            self.submit();
            Ok(readback::Pending::start(staging, t.numel(), self.clone()))
        };
        match run() {
            Ok(pending) => Box::pin(pending),
            Err(e) => super::ready(Err(e)),
        }
    }

    fn alloc_block_tables(&self, layout: KvLayout) -> BResult<WgpuBlockTables> {
        let bytes = (4 * layout.tables.rows * layout.tables.max_blocks).max(4) as u64;
        if bytes > self.inner.gpu.max_binding {
            return Err(shape_err(format!(
                "block tables of {bytes} bytes exceed the device's storage-binding limit of {} bytes: \
                 lower --max-num-seqs or --max-model-len",
                self.inner.gpu.max_binding
            )));
        }
        let zeros = vec![0u8; bytes as usize];
        let buf = self.owned(bytes, Category::Activations, Some(&zeros))?;
        Ok(WgpuBlockTables {
            layout,
            buf: Arc::new(buf),
        })
    }

    fn write_block_tables(&self, tables: &mut WgpuBlockTables, writes: &[TableWrite]) -> BResult<()> {
        let writes = super::paged::check_writes(&tables.layout, writes)?;
        if writes.is_empty() {
            return Ok(());
        }
        // Copied inside the command stream, so that the steps recorded before it read the tables
        // as they were.
        let ids: Vec<u8> = writes
            .iter()
            .flat_map(|(_, b)| b.iter().flat_map(|id| id.to_le_bytes()))
            .collect();
        let staging = self.owned(ids.len() as u64, Category::Staging, Some(&ids))?;
        self.with_encoder(|enc| {
            let mut from = 0;
            for (at, blocks) in &writes {
                let len = 4 * blocks.len() as u64;
                enc.copy_buffer_to_buffer(&staging.buffer, from, &tables.buf.buffer, 4 * *at as u64, len);
                from += len;
            }
        });
        Ok(())
    }

    fn upload_paged(&self, batch: PagedBatch, tables: &WgpuBlockTables) -> BResult<WgpuPaged> {
        if batch.layout != tables.layout {
            return Err(shape_err("a step's batch for other block tables".into()));
        }
        let flat = batch.flatten()?;
        Ok(WgpuPaged {
            slots: self.upload_u32(flat.slots.iter().map(|&s| s as usize))?,
            rows: self.upload_u32(flat.meta.iter().map(|&m| m as usize))?,
            tables: tables.buf.clone(),
            host: batch,
        })
    }

    fn upload_segments(&self, segments: &[(usize, usize)]) -> BResult<WgpuSegments> {
        let meta = super::paged::segment_rows(segments)?;
        Ok(WgpuSegments {
            rows: meta.len() / 2,
            meta: self.upload_u32(meta.iter().map(|&m| m as usize))?,
        })
    }

    fn shape(&self, t: &WgpuTensor) -> Vec<usize> {
        t.shape.clone()
    }

    fn linear(&self, x: &WgpuTensor, w: &WgpuWeight, b: Option<&WgpuTensor>) -> BResult<WgpuTensor> {
        let (n, k) = dims2(x)?;
        let (out, wk) = (w.rows, w.cols);
        if wk != k || b.is_some_and(|b| b.numel() != out) {
            return Err(shape_err(format!(
                "linear: x {n}×{k}, w {out}×{wk}, bias {:?}",
                b.map(|b| b.shape.clone())
            )));
        }
        let xb = x.buffer()?;
        let bb = b.map(WgpuTensor::buffer).transpose()?.unwrap_or(&self.inner.dummy);
        // An output larger than one binding (logits of many rows) is made in parts of whole rows;
        // a part's rows start at a multiple of 64 so its slice of x is aligned to 256 bytes.
        let row_bytes = (out * 4).max(1) as u64;
        let rows_per = if (n as u64) * row_bytes <= self.inner.gpu.max_binding {
            n.max(1)
        } else {
            (self.inner.gpu.max_binding / row_bytes) as usize / 64 * 64
        };
        if rows_per == 0 {
            return Err(shape_err(format!(
                "linear: a row of {out} outputs exceeds the device's storage-binding limit"
            )));
        }
        let mut parts = Vec::new();
        for row0 in (0..n.max(1)).step_by(rows_per) {
            let rows = rows_per.min(n - row0.min(n));
            let y = self.scratch(rows * out)?;
            let x_slice = wgpu::BufferBinding {
                buffer: xb,
                offset: (row0 * k * 4) as u64,
                size: std::num::NonZeroU64::new((rows * k * 4) as u64),
            };
            for part in w.parts.iter() {
                let words = |n: usize, first: usize| {
                    [
                        n as u32,
                        k as u32,
                        part.rows as u32,
                        out as u32,
                        part.row0 as u32,
                        b.is_some() as u32,
                        first as u32,
                    ]
                };
                let entries = || {
                    vec![
                        (1, wgpu::BindingResource::Buffer(x_slice.clone())),
                        (2, bb.as_entire_binding()),
                        (3, y.buffer.as_entire_binding()),
                        (9, part.buf.buffer.as_entire_binding()),
                    ]
                };
                let elem = Some(w.elem);
                if self.inner.cpu_adapter {
                    let (gx, gy, _) = grid(part.rows.div_ceil(64) as u64);
                    let groups = (gx, gy, rows.div_ceil(4) as u32);
                    let entry = if k % 8 == 0 { "columns8" } else { "columns" };
                    self.dispatch_entries(Kernel::Matmul, elem, entry, &words(rows, 0), entries(), groups)?;
                } else if rows <= GEMV_MAX_ROWS && k % 8 == 0 {
                    // Rows in chunks of GEMV_CHUNK, each chunk reading the weights once.
                    let groups = grid(part.rows.div_ceil(GEMV_COLS) as u64);
                    for first in (0..rows).step_by(GEMV_CHUNK) {
                        let chunk = GEMV_CHUNK.min(rows - first);
                        let entry = if chunk == 1 { "gemv" } else { "gemv_rows" };
                        self.dispatch_entries(Kernel::Matmul, elem, entry, &words(chunk, first), entries(), groups)?;
                    }
                } else {
                    let groups = (part.rows.div_ceil(GEMM_TILE) as u32, rows.div_ceil(GEMM_TILE) as u32, 1);
                    self.dispatch_entries(Kernel::Matmul, elem, "gemm", &words(rows, 0), entries(), groups)?;
                }
            }
            parts.push(Part { buf: y, row0, rows });
        }
        Ok(WgpuTensor {
            parts: Arc::new(parts),
            shape: vec![n, out],
        })
    }

    fn embedding(&self, table: &WgpuWeight, ids: &[u32]) -> BResult<WgpuTensor> {
        let (vocab, cols) = (table.rows, table.cols);
        if let Some(bad) = ids.iter().find(|&&i| i as usize >= vocab) {
            return Err(shape_err(format!(
                "token id {bad} is outside the vocabulary of {vocab}"
            )));
        }
        let idb = self.upload_u32(ids.iter().map(|&i| i as usize))?;
        let out = self.scratch(ids.len() * cols)?;
        for part in table.parts.iter() {
            let words = [ids.len() as u32, cols as u32, part.row0 as u32, part.rows as u32];
            let binds = [(1, &idb.buffer), (2, &out.buffer), (9, &part.buf.buffer)];
            let groups = grid(((ids.len() * cols) as u64).div_ceil(256));
            self.dispatch(Kernel::Embedding, Some(table.elem), "gather", &words, &binds, groups)?;
        }
        Ok(self.tensor(out, vec![ids.len(), cols]))
    }

    fn rms_norm(&self, x: &WgpuTensor, w: &WgpuTensor, eps: f64) -> BResult<WgpuTensor> {
        self.norm(x, w, None, eps)
    }

    fn layer_norm(&self, x: &WgpuTensor, w: &WgpuTensor, b: &WgpuTensor, eps: f64) -> BResult<WgpuTensor> {
        self.norm(x, w, Some(b), eps)
    }

    fn activate(&self, x: &WgpuTensor, act: Activation) -> BResult<WgpuTensor> {
        let op = match act {
            Activation::Silu => 0,
            Activation::GeluTanh => 1,
            Activation::GeluErf => 2,
            Activation::QuickGelu => 3,
        };
        self.binary(x, x, op)
    }

    fn silu_mul(&self, gate: &WgpuTensor, up: &WgpuTensor) -> BResult<WgpuTensor> {
        self.binary(gate, up, 4)
    }

    fn sigmoid_mul(&self, gate: &WgpuTensor, x: &WgpuTensor) -> BResult<WgpuTensor> {
        self.binary(gate, x, 6)
    }

    fn alloc_states(&self, layout: StateLayout) -> BResult<WgpuStates> {
        let (conv, rec) = layout.slot_values();
        let [conv_bytes, rec_bytes] = [conv, rec].map(|v| (layout.slots * v * 4) as u64);
        if rec_bytes > self.inner.gpu.max_binding {
            return Err(shape_err(format!(
                "one layer's Gated DeltaNet states take {rec_bytes} bytes, more than the device's \
                 storage-binding limit of {} bytes: lower --max-num-seqs",
                self.inner.gpu.max_binding
            )));
        }
        let make = |bytes: u64| -> BResult<Vec<Buf>> {
            (0..layout.layers)
                .map(|_| self.owned(bytes.max(4), Category::StateCache, None))
                .collect()
        };
        Ok(WgpuStates {
            layout,
            conv: make(conv_bytes)?,
            recurrent: make(rec_bytes)?,
        })
    }

    fn gated_delta_net(
        &self,
        states: &mut WgpuStates,
        layer: usize,
        input: DeltaNetInput<'_, WgpuTensor>,
        seqs: &[StateSeq],
    ) -> BResult<WgpuTensor> {
        let l = states.layout;
        let shapes = [input.qkv, input.a, input.b, input.conv, input.a_log, input.dt_bias].map(|t| t.shape.as_slice());
        let rows = l.check_input(layer, shapes, seqs)?;
        let conv_dim = l.conv_dim;
        let meta = self.upload_u32(seqs.iter().flat_map(|s| [s.start, s.len, s.slot, usize::from(s.fresh)]))?;
        let words = [
            seqs.len() as u32,
            l.conv_dim as u32,
            l.conv_len as u32,
            l.heads as u32,
            l.key_heads as u32,
            l.key_dim as u32,
            l.value_dim as u32,
            0,
        ];
        let mixed = self.scratch(rows * conv_dim)?;
        let conv_binds = [
            (1, &meta.buffer),
            (2, input.qkv.buffer()?),
            (3, input.conv.buffer()?),
            (4, &states.conv[layer].buffer),
            (5, &mixed.buffer),
        ];
        let threads = (seqs.len() * conv_dim) as u64;
        self.dispatch(
            Kernel::DeltaNet,
            None,
            "conv",
            &words,
            &conv_binds,
            grid(threads.div_ceil(256)),
        )?;
        let out = self.scratch(rows * l.heads * l.value_dim)?;
        let delta_binds = [
            (1, &meta.buffer),
            (2, &mixed.buffer),
            (3, input.a.buffer()?),
            (4, &states.recurrent[layer].buffer),
            (5, &out.buffer),
            (6, input.b.buffer()?),
            (7, input.a_log.buffer()?),
            (8, input.dt_bias.buffer()?),
        ];
        self.dispatch(
            Kernel::DeltaNet,
            None,
            "delta",
            &words,
            &delta_binds,
            grid((seqs.len() * l.heads) as u64),
        )?;
        Ok(self.tensor(out, vec![rows, l.heads * l.value_dim]))
    }

    fn add(&self, a: &WgpuTensor, b: &WgpuTensor) -> BResult<WgpuTensor> {
        self.binary(a, b, 5)
    }

    /// By `add_rms` in norm.wgsl: one dispatch.
    fn add_rms_norm(
        &self,
        x: &WgpuTensor,
        y: &WgpuTensor,
        w: &WgpuTensor,
        eps: f64,
    ) -> BResult<(WgpuTensor, WgpuTensor)> {
        if x.shape != y.shape {
            return Err(shape_err(format!("add_rms_norm of {:?} and {:?}", x.shape, y.shape)));
        }
        let (rows, cols) = norm_dims(x, w, None)?;
        let (sum, out) = (self.scratch(rows * cols)?, self.scratch(rows * cols)?);
        let words = [rows as u32, cols as u32, (eps as f32).to_bits(), 0];
        let binds = [
            (1, x.buffer()?),
            (2, w.buffer()?),
            (4, &out.buffer),
            (5, y.buffer()?),
            (6, &sum.buffer),
        ];
        let (entry, groups) = self.per_row(rows, ("add_rms", "add_rms_per_row"));
        self.dispatch(Kernel::Norm, None, entry, &words, &binds, groups)?;
        Ok((self.tensor(sum, vec![rows, cols]), self.tensor(out, vec![rows, cols])))
    }

    /// By `norm_rope` in rope.wgsl (one dispatch) for heads of up to 256 values.
    fn norm_rope(
        &self,
        x: &WgpuTensor,
        w: Option<&WgpuTensor>,
        eps: f64,
        cos: &WgpuTensor,
        sin: &WgpuTensor,
        head_dim: usize,
    ) -> BResult<WgpuTensor> {
        if head_dim > NORM_ROPE_MAX_HEAD {
            return fused::norm_rope(self, x, w, eps, cos, sin, head_dim);
        }
        let (n, cols, d) = rope_dims(x, cos, sin, head_dim)?;
        if let Some(w) = w.filter(|w| w.numel() != head_dim) {
            return Err(shape_err(format!(
                "norm_rope: heads of {head_dim}, norm weights {:?}",
                w.shape
            )));
        }
        let out = self.scratch(n * cols)?;
        let words = [
            n as u32,
            cols as u32,
            d as u32,
            head_dim as u32,
            (eps as f32).to_bits(),
            w.is_some() as u32,
        ];
        let binds = [
            (1, x.buffer()?),
            (2, cos.buffer()?),
            (3, sin.buffer()?),
            (4, &out.buffer),
            (5, w.unwrap_or(x).buffer()?),
        ];
        let (entry, groups) = self.per_row(n * (cols / head_dim), ("norm_rope", "norm_rope_per_head"));
        self.dispatch(Kernel::Rope, None, entry, &words, &binds, groups)?;
        Ok(self.tensor(out, vec![n, cols]))
    }

    fn rope(&self, x: &WgpuTensor, cos: &WgpuTensor, sin: &WgpuTensor) -> BResult<WgpuTensor> {
        let d = dims2(cos)?.1;
        self.rope_partial(x, cos, sin, d)
    }

    fn rope_partial(&self, x: &WgpuTensor, cos: &WgpuTensor, sin: &WgpuTensor, head: usize) -> BResult<WgpuTensor> {
        let (n, cols, d) = rope_dims(x, cos, sin, head)?;
        let out = self.scratch(n * cols)?;
        let words = [n as u32, cols as u32, d as u32, head as u32, 0, 0];
        let binds = [
            (1, x.buffer()?),
            (2, cos.buffer()?),
            (3, sin.buffer()?),
            (4, &out.buffer),
        ];
        self.elementwise(Kernel::Rope, &words, &binds, n * cols)?;
        Ok(self.tensor(out, vec![n, cols]))
    }

    fn narrow_cols(&self, x: &WgpuTensor, start: usize, len: usize) -> BResult<WgpuTensor> {
        let (n, cols) = dims2(x)?;
        if start + len > cols {
            return Err(shape_err(format!("narrow of columns {start}+{len} of {cols}")));
        }
        let out = self.scratch(n * len)?;
        let src = x.buffer()?;
        self.copy_rows(src, &out.buffer, None, n, len, [cols, start, len, 0], 0, false)?;
        Ok(self.tensor(out, vec![n, len]))
    }

    fn reshape(&self, x: &WgpuTensor, rows: usize, cols: usize) -> BResult<WgpuTensor> {
        if rows * cols != x.numel() {
            return Err(shape_err(format!("reshape of {:?} to {rows}×{cols}", x.shape)));
        }
        x.buffer()?;
        Ok(WgpuTensor {
            parts: x.parts.clone(),
            shape: vec![rows, cols],
        })
    }

    fn gather_rows(&self, x: &WgpuTensor, idx: &[usize]) -> BResult<WgpuTensor> {
        let (rows, cols) = dims2(x)?;
        if let Some(bad) = idx.iter().find(|&&i| i >= rows) {
            return Err(shape_err(format!("gather of row {bad} from {rows} rows")));
        }
        let ib = self.upload_u32(idx.iter().copied())?;
        let out = self.scratch(idx.len() * cols)?;
        let src = x.buffer()?;
        self.copy_rows(
            src,
            &out.buffer,
            Some(&ib.buffer),
            idx.len(),
            cols,
            [cols, 0, cols, 0],
            1,
            false,
        )?;
        Ok(self.tensor(out, vec![idx.len(), cols]))
    }

    fn scale_rows(&self, x: &WgpuTensor, scales: &[f32]) -> BResult<WgpuTensor> {
        let (rows, cols) = dims2(x)?;
        if scales.len() != rows {
            return Err(shape_err(format!("{} scales for {rows} rows", scales.len())));
        }
        let s = self.upload(scales.to_vec(), &[rows])?;
        let n = rows * cols;
        let out = self.scratch(n)?;
        let binds = [(1, x.buffer()?), (2, s.buffer()?), (3, &out.buffer)];
        self.elementwise(Kernel::Elementwise, &[n as u32, 7, cols as u32], &binds, n)?;
        Ok(self.tensor(out, vec![rows, cols]))
    }

    fn scatter_rows(&self, x: &WgpuTensor, idx: &[usize], src: &WgpuTensor, add: bool) -> BResult<WgpuTensor> {
        let (rows, cols) = dims2(x)?;
        let (srows, scols) = dims2(src)?;
        if scols != cols || srows != idx.len() || idx.iter().any(|&i| i >= rows) {
            return Err(shape_err(format!(
                "scatter of {srows}×{scols} rows into {rows}×{cols} at {} positions",
                idx.len()
            )));
        }
        let out = self.scratch(rows * cols)?;
        let bytes = (rows * cols * 4) as u64;
        if bytes > 0 {
            let from = x.buffer()?;
            self.with_encoder(|enc| enc.copy_buffer_to_buffer(from, 0, &out.buffer, 0, bytes));
        }
        let ib = self.upload_u32(idx.iter().copied())?;
        let s = src.buffer()?;
        self.copy_rows(
            s,
            &out.buffer,
            Some(&ib.buffer),
            srows,
            cols,
            [cols, 0, cols, 0],
            2,
            add,
        )?;
        Ok(self.tensor(out, vec![rows, cols]))
    }

    fn concat_rows(&self, parts: &[WgpuTensor]) -> BResult<WgpuTensor> {
        let cols = match parts.first() {
            Some(p) => dims2(p)?.1,
            None => return Err(shape_err("concat of no tensors".into())),
        };
        let mut rows = 0;
        for p in parts {
            let (r, c) = dims2(p)?;
            if c != cols {
                return Err(shape_err(format!("concat of {c} columns onto {cols}")));
            }
            rows += r;
        }
        let out = self.scratch(rows * cols)?;
        let mut at = 0u64;
        for p in parts {
            let bytes = (p.numel() * 4) as u64;
            if bytes > 0 {
                let from = p.buffer()?;
                self.with_encoder(|enc| enc.copy_buffer_to_buffer(from, 0, &out.buffer, at, bytes));
            }
            at += bytes;
        }
        Ok(self.tensor(out, vec![rows, cols]))
    }

    fn segment_attention(
        &self,
        q: &WgpuTensor,
        k: &WgpuTensor,
        v: &WgpuTensor,
        heads: usize,
        segments: &WgpuSegments,
    ) -> BResult<WgpuTensor> {
        let (n, cols) = dims2(q)?;
        if heads == 0 || cols % heads != 0 || k.shape != q.shape || v.shape != q.shape || segments.rows != n {
            return Err(shape_err(format!(
                "segment attention: q {n}×{cols}, {heads} heads, segments over {} rows",
                segments.rows
            )));
        }
        let d = cols / heads;
        self.attention(
            q,
            k.buffer()?,
            v.buffer()?,
            heads,
            d,
            1,
            cols,
            0,
            0,
            &segments.meta.buffer,
            &self.inner.dummy,
            n,
        )
    }

    fn alloc_kv(&self, layout: KvLayout) -> BResult<WgpuKvCache> {
        let per_layer = (layout.num_blocks * layout.block_size * layout.kv_heads * layout.head_dim * 4) as u64;
        if per_layer > self.inner.gpu.max_binding {
            return Err(shape_err(format!(
                "one layer's keys take {per_layer} bytes, more than the device's storage-binding limit \
                 of {} bytes: lower --max-model-len or the KV cache size",
                self.inner.gpu.max_binding
            )));
        }
        let make = || {
            (0..layout.layers)
                .map(|_| self.owned(per_layer.max(4), Category::KvCache, None))
                .collect()
        };
        let keys: BResult<Vec<Buf>> = make();
        let values: BResult<Vec<Buf>> = make();
        Ok(WgpuKvCache {
            layout,
            keys: keys?,
            values: values?,
        })
    }

    fn write_kv(
        &self,
        cache: &mut WgpuKvCache,
        layer: usize,
        k: &WgpuTensor,
        v: &WgpuTensor,
        batch: &WgpuPaged,
    ) -> BResult<()> {
        let width = cache.layout.kv_heads * cache.layout.head_dim;
        let rows = batch.host.slots.len();
        if k.numel() != rows * width || v.shape != k.shape || layer >= cache.layout.layers {
            return Err(shape_err(format!("write_kv: {rows} slots for {:?}", k.shape)));
        }
        if batch.host.layout != cache.layout {
            return Err(shape_err("write_kv: a batch checked for another cache".into()));
        }
        let words = [rows as u32, width as u32];
        let binds = [
            (1, k.buffer()?),
            (2, v.buffer()?),
            (3, &batch.slots.buffer),
            (4, &cache.keys[layer].buffer),
            (5, &cache.values[layer].buffer),
        ];
        self.elementwise(Kernel::KvWrite, &words, &binds, rows * width)
    }

    fn paged_attention(
        &self,
        cache: &WgpuKvCache,
        layer: usize,
        q: &WgpuTensor,
        heads: usize,
        batch: &WgpuPaged,
    ) -> BResult<WgpuTensor> {
        let KvLayout {
            block_size,
            kv_heads,
            head_dim: d,
            ..
        } = cache.layout;
        let (rows, cols) = dims2(q)?;
        if cols != heads * d || !heads.is_multiple_of(kv_heads.max(1)) || layer >= cache.layout.layers {
            return Err(shape_err(format!(
                "paged_attention: q {rows}×{cols}, {heads} heads of {d}"
            )));
        }
        // The batch was checked against its layout when it was uploaded.
        if batch.host.layout != cache.layout || batch.host.slots.len() != rows {
            return Err(shape_err(format!(
                "paged_attention: a batch of {} rows for another cache, or not {rows} rows",
                batch.host.slots.len()
            )));
        }
        self.attention(
            q,
            &cache.keys[layer].buffer,
            &cache.values[layer].buffer,
            heads,
            d,
            heads / kv_heads,
            kv_heads * d,
            1,
            block_size,
            &batch.rows.buffer,
            &batch.tables.buffer,
            rows,
        )
    }

    fn sample(&self, logits: &WgpuTensor, rows: &[DeviceSampling]) -> BResult<WgpuTensor> {
        let (n, width) = dims2(logits)?;
        if n != rows.len() || width == 0 {
            return Err(shape_err(format!(
                "sample: {} settings for {n} rows of {width} logits",
                rows.len()
            )));
        }
        let settings = sample_settings(rows);
        let settings = self.owned(settings.len() as u64, Category::Activations, Some(&settings))?;
        let out = self.scratch(n * 2)?;
        let binds = [(1, logits.buffer()?), (2, &settings.buffer), (3, &out.buffer)];
        let words = [n as u32, width as u32];
        self.dispatch(Kernel::Sample, None, "main", &words, &binds, grid(n as u64))?;
        Ok(self.tensor(out, vec![n, 2]))
    }
}

/// The per-row settings `kernels/sample.wgsl` reads: mode (0 greedy, 1 temperature alone, 2 with
/// cut-offs), top-k, allowed ids, temperature, top-p, min-p, the uniform (below 1 in f32 too), pad.
fn sample_settings(rows: &[DeviceSampling]) -> Vec<u8> {
    let below_one = 1.0 - f32::EPSILON / 2.0;
    let words = rows.iter().flat_map(|s| {
        let mode = match (s.is_greedy(), s.has_cutoffs()) {
            (true, _) => 0,
            (false, false) => 1,
            (false, true) => 2,
        };
        let clamp = |v: usize| v.min(u32::MAX as usize) as u32;
        [
            mode,
            clamp(s.top_k),
            clamp(s.allowed),
            s.temperature.to_bits(),
            s.top_p.to_bits(),
            s.min_p.to_bits(),
            (s.u as f32).min(below_one).to_bits(),
            0,
        ]
    });
    words.flat_map(u32::to_le_bytes).collect()
}

impl WgpuBackend {
    fn norm(&self, x: &WgpuTensor, w: &WgpuTensor, b: Option<&WgpuTensor>, eps: f64) -> BResult<WgpuTensor> {
        let (rows, cols) = norm_dims(x, w, b)?;
        let out = self.scratch(rows * cols)?;
        let wb = w.buffer()?;
        let words = [rows as u32, cols as u32, (eps as f32).to_bits(), b.is_some() as u32];
        let binds = [
            (1, x.buffer()?),
            (2, wb),
            (3, b.map(WgpuTensor::buffer).transpose()?.unwrap_or(wb)),
            (4, &out.buffer),
        ];
        let (entry, groups) = self.per_row(rows, ("main", "per_row"));
        self.dispatch(Kernel::Norm, None, entry, &words, &binds, groups)?;
        Ok(self.tensor(out, vec![rows, cols]))
    }

    /// The entry and workgroups of a kernel over `items` rows (or heads) that has two entries
    /// `(one workgroup an item, one thread an item)`: the second, barrier-free, on CPU adapters.
    fn per_row(&self, items: usize, (group, thread): (&'static str, &'static str)) -> (&'static str, (u32, u32, u32)) {
        if self.inner.cpu_adapter {
            (thread, grid(items.div_ceil(64) as u64))
        } else {
            (group, grid(items as u64))
        }
    }

    fn binary(&self, a: &WgpuTensor, b: &WgpuTensor, op: u32) -> BResult<WgpuTensor> {
        if a.shape != b.shape {
            return Err(shape_err(format!("element-wise op on {:?} and {:?}", a.shape, b.shape)));
        }
        let n = a.numel();
        let out = self.scratch(n)?;
        let words = [n as u32, op];
        let binds = [(1, a.buffer()?), (2, b.buffer()?), (3, &out.buffer)];
        self.elementwise(Kernel::Elementwise, &words, &binds, n)?;
        Ok(self.tensor(out, a.shape.clone()))
    }

    /// Attention of `rows` query rows (see `kernels/attention.wgsl`).
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        q: &WgpuTensor,
        k: &wgpu::Buffer,
        v: &wgpu::Buffer,
        heads: usize,
        d: usize,
        group: usize,
        kv_stride: usize,
        mode: u32,
        block_size: usize,
        meta: &wgpu::Buffer,
        tables: &wgpu::Buffer,
        rows: usize,
    ) -> BResult<WgpuTensor> {
        if d > 256 {
            return Err(shape_err(format!("attention heads of {d} (at most 256)")));
        }
        let out = self.scratch(rows * heads * d)?;
        let scale = (1.0 / (d as f64).sqrt()) as f32;
        let words = [
            rows as u32,
            heads as u32,
            d as u32,
            group as u32,
            kv_stride as u32,
            mode,
            block_size as u32,
            scale.to_bits(),
        ];
        let binds = [
            (1, q.buffer()?),
            (2, k),
            (3, v),
            (4, meta),
            (5, tables),
            (6, &out.buffer),
        ];
        let (entry, groups) = if self.inner.cpu_adapter {
            ("per_thread", grid((rows * heads).div_ceil(64) as u64))
        } else {
            ("main", grid((rows * heads) as u64))
        };
        self.dispatch(Kernel::Attention, None, entry, &words, &binds, groups)?;
        Ok(self.tensor(out, vec![rows, heads * d]))
    }
}

#[cfg(all(test, not(target_arch = "wasm32")))]
pub(crate) mod tests;
