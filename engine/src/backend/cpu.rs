//! The CPU backend: candle-core tensors in f32 for dense math, weight matrices in f32, bfloat16 or
//! quantized on load ([`WeightFormat`]), a paged KV cache in host memory with attention written out
//! over the block tables.

mod amx_gemm;
mod attention;
mod bf16_gemm;
mod block_dot;
mod block_tiles;
mod delta_net;
mod f16_decode;
mod f16_gemm;
mod isa;
mod k_quant_dot;
mod k_quant_tiles;
#[cfg(all(test, target_arch = "x86_64"))]
mod kernel_bench;
mod packed;
mod row_ops;
pub mod row_partners;
mod segment_attention;
pub(crate) mod vector_math;
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
mod wasm_dot;

use super::{
    ready, Activation, BResult, Backend, BackendError, DeltaNetInput, KvLayout, MatrixUse, PagedBatch, RawDType,
    RawTensor, Readback, StateLayout, StateSeq, TableWrite,
};
use crate::arch::weight_format::WeightFormat;
use crate::memory::ledger::{Category, Held, MemoryLedger};
use crate::sample::DeviceSampling;
use attention::SeqAttention;
use candle_core::{DType, Device, Tensor, D};
/// Weight matrices in the formats our CPU kernels multiply (public for the browser test, which
/// checks the wasm kernels).
pub use packed::PackedMatrix;
use segment_attention::RowsView;
use std::sync::Arc;
use vector_math::Elementwise;

fn lib(e: candle_core::Error) -> BackendError {
    BackendError::Library(Box::new(e))
}

/// A CPU tensor: an f32 candle tensor plus the ledger entry of the storage it owns.
#[derive(Debug, Clone)]
pub struct CpuTensor {
    t: Tensor,
    _held: Option<Arc<Held>>,
}

/// A CPU weight matrix `[out, in]` and its ledger entry.
#[derive(Debug, Clone)]
pub struct CpuWeight {
    m: Matrix,
    _held: Arc<Held>,
}

/// How a [`CpuWeight`] is stored.
#[derive(Debug, Clone)]
enum Matrix {
    /// f32, multiplied by candle's GEMM.
    Dense(Tensor),
    /// bfloat16 or GGML blocks, multiplied by our kernels ([`PackedMatrix`]).
    Packed(Arc<PackedMatrix>),
}

impl CpuWeight {
    /// Rows and columns.
    fn dims(&self) -> (usize, usize) {
        match &self.m {
            Matrix::Dense(t) => t.dims2().unwrap_or_default(),
            Matrix::Packed(q) => q.dims(),
        }
    }
}

/// The paged KV cache: per layer, keys and values as `[num_blocks · block_size, kv_heads · head_dim]`.
#[derive(Debug)]
pub struct CpuKvCache {
    layout: KvLayout,
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
    _held: Held,
}

/// The block tables in host memory, shared with the steps recorded over them (a write while one
/// still holds them copies them first).
#[derive(Debug)]
pub struct CpuBlockTables {
    layout: KvLayout,
    ids: Arc<Vec<u32>>,
    _held: Held,
}

/// A step's checked metadata and the block tables as they were when it was uploaded.
#[derive(Debug)]
pub struct CpuPaged {
    batch: PagedBatch,
    tables: Arc<Vec<u32>>,
}

/// The instructions our CPU kernels run on this machine (after `KVLENS_CPU_ISA`), one phrase per
/// kind of product, for benchmarks to print beside their figures. candle's kernels (`q5_K`, the
/// `_1` and `q5_0` types) and the gemm crate's pick their own at run time.
pub fn kernel_paths() -> String {
    let isa = isa::isa();
    let pick = |sets: &[(bool, &'static str)]| sets.iter().find(|s| s.0).map_or("portable", |s| s.1);
    let blocks = pick(&[
        (isa.avx512_vnni, "avx512-vnni"),
        (isa.avx2_fma, "avx2"),
        (isa.neon, "neon for q8_0/q4_0, portable for the K-quants"),
        (
            cfg!(all(target_arch = "wasm32", target_feature = "simd128")),
            "wasm simd128",
        ),
    ]);
    let bf16 = pick(&[(isa.avx512_fma, "avx512"), (isa.avx2_fma, "avx2")]);
    let f16 = pick(&[(isa.avx2_fma, "avx2+f16c")]);
    let gemm = if bf16_gemm::available() {
        "bfloat16 GEMM (AVX-512 BF16)"
    } else {
        gemm_crate_kernels()
    };
    let gemm = match amx_gemm::available() {
        true => format!("of bf16 weights (and f16 ones that are all bf16 values): AMX bf16 tiles, the activations in two bf16 halves; of others: {gemm}"),
        false => gemm.to_string(),
    };
    let gemm = match (f16_gemm::available(), bf16_gemm::available()) {
        (true, true) => {
            format!("{gemm}, f16 weights too where all are bf16 values; of other f16 weights: f16 tiles (AVX2+F16C)")
        }
        (true, false) => format!("{gemm}; of f16 weights: f16 tiles (AVX2+F16C)"),
        _ => gemm,
    };
    let tiles = pick(&[
        (
            k_quant_tiles::wide(),
            "q8_0/q4_0/q4_K/q6_K stored as integer tiles (AVX-512 VNNI), for every product",
        ),
        (
            isa.avx512_vnni,
            "q8_0/q4_0 stored as integer tiles (AVX-512 VNNI), q4_K/q6_K (AVX2 with 256-bit VNNI), for every product",
        ),
        (
            isa.avx2_fma,
            "q8_0/q4_0/q4_K/q6_K stored as integer tiles (AVX2) for every product",
        ),
        (true, "no integer tiles"),
    ]);
    format!(
        "q8_0/q4_0/q4_K/q6_K rows: {blocks}; {tiles}; bf16 rows: {bf16}; f16 rows: {f16}; prefill of other packed \
         weights: {gemm}"
    )
}

/// The f32 GEMM the gemm crate runs here: it detects the CPU on its own, so `KVLENS_CPU_ISA`
/// does not narrow it (an `avx2` run on an AVX-512 CPU still prefills with its AVX-512 kernels);
/// a build without the `gemm-avx512` feature stops it at AVX2.
fn gemm_crate_kernels() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        if cfg!(feature = "gemm-avx512") && std::arch::is_x86_feature_detected!("avx512f") {
            return "f32 GEMM (the gemm crate's AVX-512 kernels, which KVLENS_CPU_ISA does not narrow)";
        }
        if std::arch::is_x86_feature_detected!("fma") {
            return "f32 GEMM (the gemm crate's AVX2+FMA kernels)";
        }
    }
    "f32 GEMM (the gemm crate's)"
}

/// The CPU backend.
#[derive(Debug, Clone, Default)]
pub struct CpuBackend {
    ledger: MemoryLedger,
    weights: WeightFormat,
    bf16_matrices: bool,
}

impl CpuBackend {
    /// A CPU backend with f32 weights, recording into `ledger`.
    pub fn new(ledger: MemoryLedger) -> Self {
        Self::with_weights(ledger, WeightFormat::Unquantized)
    }

    /// A CPU backend that stores the weight matrices `weights` quantizes in that format.
    pub fn with_weights(ledger: MemoryLedger, weights: WeightFormat) -> Self {
        CpuBackend {
            ledger,
            weights,
            bf16_matrices: false,
        }
    }

    /// Keeps the weight matrices the format leaves unquantized in bfloat16 (as Qwen checkpoints
    /// store them: copied, not widened; other dtypes rounded) instead of f32. Norms, biases and
    /// the patch embedding stay f32. Products accumulate in f32, against f32 activations in decode
    /// and, on CPUs with AVX-512 BF16, against activations rounded to bfloat16 from 32 rows on.
    pub fn with_bf16_matrices(mut self, on: bool) -> Self {
        self.bf16_matrices = on;
        self
    }

    fn wrap(&self, t: Tensor, category: Category) -> CpuTensor {
        let bytes = (t.elem_count() * 4) as u64;
        CpuTensor {
            t,
            _held: Some(Arc::new(self.ledger.hold(category, bytes))),
        }
    }

    /// A packed weight matrix, its rows shared out now where this thread has row partners (not in
    /// the first decode), recorded as weights.
    fn packed(&self, mut q: PackedMatrix, usage: MatrixUse) -> CpuWeight {
        q.share_rows(usage);
        self.weight(Matrix::Packed(Arc::new(q)))
    }

    /// A weight matrix, recorded as weights.
    fn weight(&self, m: Matrix) -> CpuWeight {
        let bytes = match &m {
            Matrix::Dense(t) => t.elem_count() as u64 * 4,
            Matrix::Packed(q) => q.bytes(),
        };
        CpuWeight {
            m,
            _held: Arc::new(self.ledger.hold(Category::Weights, bytes)),
        }
    }

    /// A checkpoint tensor's values as an f32 candle tensor of its shape.
    fn f32_tensor(raw: &RawTensor<'_>) -> BResult<Tensor> {
        let dtype = match raw.dtype {
            RawDType::F32 => DType::F32,
            RawDType::F16 => DType::F16,
            RawDType::Bf16 => DType::BF16,
            RawDType::Blocks(_) => {
                let values = crate::model::weights::host_f32(raw);
                return Tensor::from_vec(values, raw.shape.as_slice(), &Device::Cpu).map_err(lib);
            }
        };
        let t = Tensor::from_raw_buffer(&raw.data, dtype, &raw.shape, &Device::Cpu).map_err(lib)?;
        t.to_dtype(DType::F32).map_err(lib)
    }

    fn act(&self, t: candle_core::Result<Tensor>) -> BResult<CpuTensor> {
        Ok(self.wrap(t.map_err(lib)?, Category::Activations))
    }

    /// A product `y` plus its bias row, if any, as activations.
    fn with_bias(&self, y: Tensor, b: Option<&CpuTensor>) -> BResult<CpuTensor> {
        self.act(match b {
            Some(b) => y.broadcast_add(&b.t),
            None => Ok(y),
        })
    }

    /// The tensor's values on the host.
    fn host(t: &CpuTensor) -> BResult<Vec<f32>> {
        t.t.flatten_all().and_then(|f| f.to_vec1::<f32>()).map_err(lib)
    }

    /// `step` over `a` (and `b`, of `a`'s shape), one new tensor.
    fn elementwise(&self, step: Elementwise, a: &CpuTensor, b: Option<&CpuTensor>) -> BResult<CpuTensor> {
        let a = a.t.contiguous().map_err(lib)?;
        let b = match b {
            Some(b) if b.t.dims() != a.dims() => {
                return Err(BackendError::Shape(format!(
                    "{:?} and {:?} differ",
                    a.dims(),
                    b.t.dims()
                )))
            }
            Some(b) => Some(b.t.contiguous().map_err(lib)?),
            None => None,
        };
        let (sa, la) = a.storage_and_layout();
        let x = contiguous_values(&sa, la)?;
        let out = match &b {
            Some(b) => {
                let (sb, lb) = b.storage_and_layout();
                step.apply(x, contiguous_values(&sb, lb)?)
            }
            None => step.apply(x, &[]),
        };
        self.act(Tensor::from_vec(out, a.shape(), &Device::Cpu))
    }

    /// A view sharing its parent's storage (no new ledger entry).
    fn view(parent: &CpuTensor, t: candle_core::Result<Tensor>) -> BResult<CpuTensor> {
        Ok(CpuTensor {
            t: t.map_err(lib)?,
            _held: parent._held.clone(),
        })
    }
}

/// Rows of activations from which a packed matrix goes through a GEMM (the bfloat16 one where the
/// CPU has AVX-512 BF16, else widened to f32 for the f32 GEMM) instead of being multiplied row
/// by row; matrices stored as integer tiles ([`PackedMatrix::is_tiled`]: `q8_0`/`q4_0`, and `q4_K`
/// on AVX2) and quantized matrices in wasm ([`PackedMatrix::prefills_by_rows`]) never are.
/// Measured on Qwen3-VL-2B, 2-core EPYC: `q8_0`'s row-by-row kernel
/// prefilled at 17.3 tokens/s against 20.7 through the f32 GEMM with AVX2 kernels, 27.3 with its
/// AVX-512 ones; decode's few rows are bound by the bytes read.
const DEQUANTIZE_FROM_ROWS: usize = 32;

fn dims2(t: &Tensor) -> BResult<(usize, usize)> {
    t.dims2().map_err(lib)
}

/// `t` itself when its rows have unit column stride (a column slice does), else a contiguous copy.
fn unit_column_stride(t: &Tensor) -> BResult<Tensor> {
    match t.stride() {
        [_, 1] => Ok(t.clone()),
        _ => t.contiguous().map_err(lib),
    }
}

/// An f32 CPU tensor's whole storage.
fn storage_values(storage: &candle_core::Storage) -> BResult<&[f32]> {
    match storage {
        candle_core::Storage::Cpu(cpu) => cpu.as_slice::<f32>().map_err(lib),
        _ => Err(BackendError::Shape("not a CPU tensor".into())),
    }
}

/// The values of a contiguous f32 CPU tensor, where they lie in its storage.
fn contiguous_values<'a>(storage: &'a candle_core::Storage, layout: &candle_core::Layout) -> BResult<&'a [f32]> {
    if !layout.is_contiguous() {
        return Err(BackendError::Shape("not a contiguous tensor".into()));
    }
    Ok(&storage_values(storage)?[layout.start_offset()..][..layout.shape().elem_count()])
}

/// `f` of an f32 CPU tensor's values where they lie, or of a contiguous copy when they are not
/// contiguous (a prefill's activations are megabytes: not copied again for each product).
fn with_values<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> BResult<R>) -> BResult<R> {
    let t = t.contiguous().map_err(lib)?;
    let (storage, layout) = t.storage_and_layout();
    f(contiguous_values(&storage, layout)?)
}

/// The rows of a 2-D f32 CPU tensor with unit column stride, where they lie in its storage.
fn rows_view<'a>(storage: &'a candle_core::Storage, layout: &candle_core::Layout) -> BResult<RowsView<'a>> {
    match layout.stride() {
        [row_stride, 1] => Ok(RowsView {
            data: storage_values(storage)?,
            offset: layout.start_offset(),
            row_stride: *row_stride,
        }),
        s => Err(BackendError::Shape(format!(
            "rows with strides {s:?}, not unit column stride"
        ))),
    }
}

impl Backend for CpuBackend {
    type Tensor = CpuTensor;
    type Weight = CpuWeight;
    type KvCache = CpuKvCache;
    type BlockTables = CpuBlockTables;
    type Paged = CpuPaged;
    type Segments = Vec<(usize, usize)>;
    type StateCache = delta_net::CpuStates;

    const CAPABILITIES: super::Capabilities = super::Capabilities {
        compute: crate::arch::config::DType::F32,
        quantized: &[WeightFormat::Q8_0, WeightFormat::Q4_0],
        half_weights: Some(crate::arch::config::DType::Bf16),
        sampling: super::DeviceSamplingSupport::Full,
    };

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn ledger(&self) -> &MemoryLedger {
        &self.ledger
    }

    fn load_weight(&self, raw: RawTensor<'_>, usage: MatrixUse) -> BResult<CpuWeight> {
        let Some((rows, cols)) = raw.matrix_dims() else {
            return Err(BackendError::Shape(format!("a weight matrix of shape {:?}", raw.shape)));
        };
        if let RawDType::Blocks(t) = raw.dtype {
            // As stored: q8_0 and q4_0 are the packed formats' own blocks; candle multiplies
            // the K-quants and the other block types. Rows candle cannot multiply (q4_1/q5_*
            // rows of one block, in tiny models only) are widened to f32 below.
            if let Some(m) = PackedMatrix::from_gguf(t, &raw.data, rows, cols) {
                return Ok(self.packed(m, usage));
            }
        }
        if raw.dtype == RawDType::F16 && !self.weights.quantizes(&raw.shape) {
            // Half precision kept as stored, widened row by row inside the products.
            let values = raw
                .data
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]))
                .collect();
            if let Some(m) = PackedMatrix::f16(values, rows, cols) {
                return Ok(self.packed(m, usage));
            }
        }
        if raw.shape.len() == 2 {
            if self.weights.quantizes(&raw.shape) {
                let values = crate::model::weights::host_f32(&raw);
                if let Some(q) = PackedMatrix::quantize(self.weights, &values, rows, cols) {
                    return Ok(self.packed(q, usage));
                }
            } else if self.bf16_matrices {
                let bits = match raw.dtype {
                    RawDType::Bf16 => raw
                        .data
                        .chunks_exact(2)
                        .map(|b| u16::from_le_bytes([b[0], b[1]]))
                        .collect(),
                    _ => crate::model::weights::host_f32(&raw)
                        .into_iter()
                        .map(|v| half::bf16::from_f32(v).to_bits())
                        .collect(),
                };
                if let Some(m) = PackedMatrix::bf16(bits, rows, cols) {
                    return Ok(self.packed(m, usage));
                }
            }
        }
        let t = Self::f32_tensor(&raw)?.reshape((rows, cols)).map_err(lib)?;
        Ok(self.weight(Matrix::Dense(t)))
    }

    fn load_tensor(&self, raw: RawTensor<'_>) -> BResult<CpuTensor> {
        Ok(self.wrap(Self::f32_tensor(&raw)?, Category::Weights))
    }

    fn upload(&self, data: Vec<f32>, shape: &[usize]) -> BResult<CpuTensor> {
        self.act(Tensor::from_vec(data, shape, &Device::Cpu))
    }

    fn keep(&self, t: &CpuTensor, category: Category) -> CpuTensor {
        self.wrap(t.t.clone(), category)
    }

    fn read(&self, t: &CpuTensor) -> Readback {
        ready(Self::host(t))
    }

    fn alloc_block_tables(&self, layout: KvLayout) -> BResult<CpuBlockTables> {
        let len = layout.tables.rows * layout.tables.max_blocks;
        Ok(CpuBlockTables {
            layout,
            ids: Arc::new(vec![0; len]),
            _held: self.ledger.hold(Category::Activations, 4 * len as u64),
        })
    }

    fn write_block_tables(&self, tables: &mut CpuBlockTables, writes: &[TableWrite]) -> BResult<()> {
        let writes = super::paged::check_writes(&tables.layout, writes)?;
        let ids = Arc::make_mut(&mut tables.ids);
        for (at, blocks) in writes {
            ids[at..at + blocks.len()].copy_from_slice(&blocks);
        }
        Ok(())
    }

    fn upload_paged(&self, batch: PagedBatch, tables: &CpuBlockTables) -> BResult<CpuPaged> {
        if batch.layout != tables.layout {
            return Err(BackendError::Shape("a step's batch for other block tables".into()));
        }
        batch.check()?;
        Ok(CpuPaged {
            batch,
            tables: tables.ids.clone(),
        })
    }

    fn upload_segments(&self, segments: &[(usize, usize)]) -> BResult<Vec<(usize, usize)>> {
        Ok(segments.to_vec())
    }

    fn shape(&self, t: &CpuTensor) -> Vec<usize> {
        t.t.dims().to_vec()
    }

    fn linear(&self, x: &CpuTensor, w: &CpuWeight, b: Option<&CpuTensor>) -> BResult<CpuTensor> {
        let y = match &w.m {
            Matrix::Dense(w) => x.t.matmul(&w.t().map_err(lib)?).map_err(lib)?,
            Matrix::Packed(q) => {
                let (m, _) = dims2(&x.t)?;
                let (rows, cols) = q.dims();
                if q.prefills_by_rows() || m < DEQUANTIZE_FROM_ROWS {
                    // A matrix stored as integer tiles (any number of rows), or few rows
                    // (decode): the stored values read once, the activations quantized once.
                    let y = with_values(&x.t, |x| q.matmul(x, m).map_err(lib))?;
                    Tensor::from_vec(y, (m, rows), &Device::Cpu).map_err(lib)?
                } else if let Some(bits) = q.bf16_values().filter(|_| amx_gemm::fits(rows, cols)) {
                    // Many rows of a bfloat16 matrix on a CPU with AMX: tiles of the weights as
                    // stored against the activations in two bfloat16 halves.
                    let y = with_values(&x.t, |x| {
                        amx_gemm::matmul(x, m, bits, rows, &self.ledger).map_err(BackendError::Shape)
                    })?;
                    Tensor::from_vec(y, (m, rows), &Device::Cpu).map_err(lib)?
                } else if bf16_gemm::available() && (!q.is_f16() || q.is_bf16_valued_f16()) {
                    // Many rows on a CPU with AVX-512 BF16: computed in bfloat16, bfloat16
                    // weights read as stored, f16 ones whose values are all bfloat16 values
                    // converted exactly, quantized ones dequantized to bfloat16 (other f16
                    // weights, which bfloat16 would round, take the f16 tiles or the f32 GEMM).
                    let y = with_values(&x.t, |x| {
                        bf16_gemm::matmul(x, m, q, &self.ledger).map_err(BackendError::Shape)
                    })?;
                    Tensor::from_vec(y, (m, rows), &Device::Cpu).map_err(lib)?
                } else if let Some(values) = q.f16_values().filter(|_| f16_gemm::available()) {
                    // Many rows of an f16 matrix on an AVX2 CPU: the weights as stored, widened
                    // in registers (no f32 copy of the matrix).
                    let y = with_values(&x.t, |x| {
                        f16_gemm::matmul(x, m, values, rows, &self.ledger).map_err(BackendError::Shape)
                    })?;
                    Tensor::from_vec(y, (m, rows), &Device::Cpu).map_err(lib)?
                } else {
                    // Many rows (prefill, the vision tower): the matrix dequantized once, one
                    // transient f32 copy recorded as activations, and the f32 GEMM, which reuses
                    // each weight across rows far better than the quantized kernel's row tiles.
                    let dense = self.wrap(
                        Tensor::from_vec(q.dequantize(), (rows, cols), &Device::Cpu).map_err(lib)?,
                        Category::Activations,
                    );
                    x.t.matmul(&dense.t.t().map_err(lib)?).map_err(lib)?
                }
            }
        };
        self.with_bias(y, b)
    }

    /// Few rows (decode), or matrices all stored as integer tiles: every product in one pass over
    /// the pool, the activations quantized once; otherwise (a prefill through a GEMM) one
    /// [`Backend::linear`] each.
    fn linears(&self, x: &CpuTensor, ws: &[(&CpuWeight, Option<&CpuTensor>)]) -> BResult<Vec<CpuTensor>> {
        let (m, _) = dims2(&x.t)?;
        let packed: Option<Vec<&PackedMatrix>> = ws
            .iter()
            .map(|(w, _)| match &w.m {
                Matrix::Packed(q) => Some(&**q),
                Matrix::Dense(_) => None,
            })
            .collect();
        let Some(packed) = packed.filter(|p| m < DEQUANTIZE_FROM_ROWS || p.iter().all(|w| w.prefills_by_rows())) else {
            return ws.iter().map(|&(w, b)| self.linear(x, w, b)).collect();
        };
        let ys = with_values(&x.t, |x| PackedMatrix::matmul_many(&packed, x, m).map_err(lib))?;
        ys.into_iter()
            .zip(packed.iter().zip(ws))
            .map(|(y, (w, &(_, b)))| {
                let y = Tensor::from_vec(y, (m, w.dims().0), &Device::Cpu).map_err(lib)?;
                self.with_bias(y, b)
            })
            .collect()
    }

    fn embedding(&self, table: &CpuWeight, ids: &[u32]) -> BResult<CpuTensor> {
        let (vocab, dim) = table.dims();
        if let Some(bad) = ids.iter().find(|&&i| i as usize >= vocab) {
            return Err(BackendError::Shape(format!(
                "token id {bad} is outside the vocabulary of {vocab}"
            )));
        }
        match &table.m {
            Matrix::Packed(q) if !q.holds_every_row() => Err(BackendError::Shape(
                "rows gathered from a matrix loaded for products only, whose rows are partly elsewhere".into(),
            )),
            Matrix::Packed(q) => {
                let rows: Vec<usize> = ids.iter().map(|&i| i as usize).collect();
                self.upload(q.gather(&rows), &[ids.len(), dim])
            }
            Matrix::Dense(t) => {
                let idx = Tensor::new(ids, &Device::Cpu).map_err(lib)?;
                self.act(t.index_select(&idx, 0))
            }
        }
    }

    fn rms_norm(&self, x: &CpuTensor, w: &CpuTensor, eps: f64) -> BResult<CpuTensor> {
        let width = w.t.elem_count();
        if x.t.dims().last() != Some(&width) {
            return Err(BackendError::Shape(format!(
                "rms_norm: rows of {:?} against a weight of {width}",
                x.t.dims()
            )));
        }
        let y = with_values(&x.t, |x| with_values(&w.t, |w| Ok(row_ops::rms_norm(x, w, eps as f32))))?;
        self.upload(y, x.t.dims())
    }

    fn layer_norm(&self, x: &CpuTensor, w: &CpuTensor, b: &CpuTensor, eps: f64) -> BResult<CpuTensor> {
        let f = || -> candle_core::Result<Tensor> {
            let mean = x.t.mean_keepdim(D::Minus1)?;
            let centered = x.t.broadcast_sub(&mean)?;
            let var = centered.sqr()?.mean_keepdim(D::Minus1)?;
            let inv = (var + eps)?.sqrt()?.recip()?;
            centered.broadcast_mul(&inv)?.broadcast_mul(&w.t)?.broadcast_add(&b.t)
        };
        self.act(f())
    }

    fn activate(&self, x: &CpuTensor, act: Activation) -> BResult<CpuTensor> {
        match Elementwise::activation(act) {
            Some(step) => self.elementwise(step, x, None),
            None => self.act(x.t.gelu_erf()),
        }
    }

    fn silu_mul(&self, gate: &CpuTensor, up: &CpuTensor) -> BResult<CpuTensor> {
        self.elementwise(Elementwise::SiluTimes, gate, Some(up))
    }

    fn add(&self, a: &CpuTensor, b: &CpuTensor) -> BResult<CpuTensor> {
        if a.t.dims() != b.t.dims() {
            return Err(BackendError::Shape(format!(
                "add: {:?} and {:?} differ",
                a.t.dims(),
                b.t.dims()
            )));
        }
        let y = with_values(&a.t, |a| with_values(&b.t, |b| Ok(row_ops::sum(a, b))))?;
        self.upload(y, a.t.dims())
    }

    fn rope(&self, x: &CpuTensor, cos: &CpuTensor, sin: &CpuTensor) -> BResult<CpuTensor> {
        let (n, cols) = dims2(&x.t)?;
        let (rows, d) = dims2(&cos.t)?;
        if d == 0 || d % 2 != 0 || cols % d != 0 || rows != n || dims2(&sin.t)? != (rows, d) {
            return Err(BackendError::Shape(format!(
                "rope: {n}×{cols} in heads of {d} against {rows} rows of cos/sin"
            )));
        }
        let y = with_values(&x.t, |x| {
            with_values(&cos.t, |c| with_values(&sin.t, |s| Ok(row_ops::rope(x, cols, c, s, d))))
        })?;
        self.upload(y, &[n, cols])
    }

    fn rope_partial(&self, x: &CpuTensor, cos: &CpuTensor, sin: &CpuTensor, head_dim: usize) -> BResult<CpuTensor> {
        let (n, cols) = dims2(&x.t)?;
        let (rows, r) = dims2(&cos.t)?;
        if rows != n
            || dims2(&sin.t)? != (rows, r)
            || r % 2 != 0
            || r > head_dim
            || head_dim == 0
            || cols % head_dim != 0
        {
            return Err(BackendError::Shape(format!(
                "partial rotary of width {r} over {n}×{cols} in heads of {head_dim}"
            )));
        }
        let mut values = Self::host(x)?;
        delta_net::rope_partial(&mut values, &Self::host(cos)?, &Self::host(sin)?, n, head_dim);
        self.upload(values, &[n, cols])
    }

    fn sigmoid_mul(&self, gate: &CpuTensor, x: &CpuTensor) -> BResult<CpuTensor> {
        self.elementwise(Elementwise::SigmoidTimes, gate, Some(x))
    }

    fn alloc_states(&self, layout: StateLayout) -> BResult<delta_net::CpuStates> {
        Ok(delta_net::CpuStates::new(layout, &self.ledger))
    }

    fn gated_delta_net(
        &self,
        states: &mut delta_net::CpuStates,
        layer: usize,
        input: DeltaNetInput<'_, CpuTensor>,
        seqs: &[StateSeq],
    ) -> BResult<CpuTensor> {
        let [qkv, a, b, conv, a_log, dt_bias] =
            [input.qkv, input.a, input.b, input.conv, input.a_log, input.dt_bias].map(Self::host);
        let (qkv, a, b, conv, a_log, dt_bias) = (qkv?, a?, b?, conv?, a_log?, dt_bias?);
        let inputs = delta_net::Inputs {
            qkv: &qkv,
            a: &a,
            b: &b,
            conv: &conv,
            a_log: &a_log,
            dt_bias: &dt_bias,
        };
        let rows = qkv.len() / states.layout.conv_dim.max(1);
        let width = states.layout.heads * states.layout.value_dim;
        let out = delta_net::run(states, layer, &inputs, seqs).map_err(BackendError::Shape)?;
        self.upload(out, &[rows, width])
    }

    fn narrow_cols(&self, x: &CpuTensor, start: usize, len: usize) -> BResult<CpuTensor> {
        self.act(x.t.narrow(1, start, len).and_then(|t| t.contiguous()))
    }

    fn reshape(&self, x: &CpuTensor, rows: usize, cols: usize) -> BResult<CpuTensor> {
        Self::view(x, x.t.reshape((rows, cols)))
    }

    fn gather_rows(&self, x: &CpuTensor, idx: &[usize]) -> BResult<CpuTensor> {
        let ids: Vec<u32> = idx.iter().map(|&i| i as u32).collect();
        let idx = Tensor::new(ids.as_slice(), &Device::Cpu).map_err(lib)?;
        self.act(x.t.index_select(&idx, 0))
    }

    fn scale_rows(&self, x: &CpuTensor, scales: &[f32]) -> BResult<CpuTensor> {
        let (rows, cols) = dims2(&x.t)?;
        if scales.len() != rows {
            return Err(BackendError::Shape(format!("{} scales for {rows} rows", scales.len())));
        }
        let mut data = Self::host(x)?;
        for (row, s) in data.chunks_mut(cols.max(1)).zip(scales) {
            row.iter_mut().for_each(|v| *v *= s);
        }
        self.upload(data, &[rows, cols])
    }

    fn scatter_rows(&self, x: &CpuTensor, idx: &[usize], src: &CpuTensor, add: bool) -> BResult<CpuTensor> {
        let (rows, cols) = dims2(&x.t)?;
        let (srows, scols) = dims2(&src.t)?;
        if scols != cols || srows != idx.len() || idx.iter().any(|&i| i >= rows) {
            return Err(BackendError::Shape(format!(
                "scatter of {srows}×{scols} rows into {rows}×{cols} at {} positions",
                idx.len()
            )));
        }
        let mut data = Self::host(x)?;
        let s = Self::host(src)?;
        for (i, &r) in idx.iter().enumerate() {
            let dst = &mut data[r * cols..(r + 1) * cols];
            let row = &s[i * cols..(i + 1) * cols];
            if add {
                dst.iter_mut().zip(row).for_each(|(d, v)| *d += v);
            } else {
                dst.copy_from_slice(row);
            }
        }
        self.upload(data, &[rows, cols])
    }

    fn concat_rows(&self, parts: &[CpuTensor]) -> BResult<CpuTensor> {
        let ts: Vec<&Tensor> = parts.iter().map(|p| &p.t).collect();
        self.act(Tensor::cat(&ts, 0))
    }

    fn segment_attention(
        &self,
        q: &CpuTensor,
        k: &CpuTensor,
        v: &CpuTensor,
        heads: usize,
        segments: &Vec<(usize, usize)>,
    ) -> BResult<CpuTensor> {
        let (n, cols) = dims2(&q.t)?;
        let d = cols / heads.max(1);
        if d * heads != cols || dims2(&k.t)? != (n, cols) || dims2(&v.t)? != (n, cols) {
            return Err(BackendError::Shape(format!(
                "segment attention: q, k and v must all be [{n}, {heads} heads · d]"
            )));
        }
        let [q, k, v] = [q, k, v].map(|t| unit_column_stride(&t.t));
        let (q, k, v) = (q?, k?, v?);
        let [(qs, ql), (ks, kl), (vs, vl)] = [&q, &k, &v].map(|t| t.storage_and_layout());
        let out = segment_attention::segment_attention(
            rows_view(&qs, ql)?,
            rows_view(&ks, kl)?,
            rows_view(&vs, vl)?,
            n,
            heads,
            d,
            segments,
            &self.ledger,
        )
        .map_err(BackendError::Shape)?;
        self.act(Tensor::from_vec(out, (n, cols), &Device::Cpu))
    }

    fn alloc_kv(&self, layout: KvLayout) -> BResult<CpuKvCache> {
        let per_layer = layout.num_blocks * layout.block_size * layout.kv_heads * layout.head_dim;
        Ok(CpuKvCache {
            layout,
            keys: (0..layout.layers).map(|_| vec![0.0; per_layer]).collect(),
            values: (0..layout.layers).map(|_| vec![0.0; per_layer]).collect(),
            _held: self.ledger.hold(Category::KvCache, layout.bytes(4)),
        })
    }

    fn write_kv(
        &self,
        cache: &mut CpuKvCache,
        layer: usize,
        k: &CpuTensor,
        v: &CpuTensor,
        batch: &CpuPaged,
    ) -> BResult<()> {
        let slots = &batch.batch.slots;
        let width = cache.layout.kv_heads * cache.layout.head_dim;
        let capacity = cache.layout.num_blocks * cache.layout.block_size;
        let (kd, vd) = (Self::host(k)?, Self::host(v)?);
        if kd.len() != slots.len() * width || vd.len() != kd.len() || layer >= cache.layout.layers {
            return Err(BackendError::Shape(format!(
                "write_kv: {} slots for {} values",
                slots.len(),
                kd.len()
            )));
        }
        for (i, &slot) in slots.iter().enumerate() {
            if slot >= capacity {
                return Err(BackendError::Shape(format!("write_kv: slot {slot} outside {capacity}")));
            }
            cache.keys[layer][slot * width..(slot + 1) * width].copy_from_slice(&kd[i * width..(i + 1) * width]);
            cache.values[layer][slot * width..(slot + 1) * width].copy_from_slice(&vd[i * width..(i + 1) * width]);
        }
        Ok(())
    }

    fn paged_attention(
        &self,
        cache: &CpuKvCache,
        layer: usize,
        q: &CpuTensor,
        heads: usize,
        batch: &CpuPaged,
    ) -> BResult<CpuTensor> {
        let KvLayout {
            block_size,
            kv_heads,
            head_dim: d,
            ..
        } = cache.layout;
        let (rows, cols) = dims2(&q.t)?;
        if cols != heads * d || !heads.is_multiple_of(kv_heads.max(1)) || layer >= cache.layout.layers {
            return Err(BackendError::Shape(format!(
                "paged_attention: q {rows}×{cols}, {heads} heads of {d}"
            )));
        }
        // The batch was checked against its layout when it was uploaded.
        if batch.batch.layout != cache.layout || batch.batch.slots.len() != rows {
            return Err(BackendError::Shape(format!(
                "paged_attention: a batch of {} rows for another cache, or not {rows} rows",
                batch.batch.slots.len()
            )));
        }
        let max_blocks = cache.layout.tables.max_blocks;
        let mut outs = Vec::with_capacity(batch.batch.seqs.len());
        for s in &batch.batch.seqs {
            let table = &batch.tables[s.table_row * max_blocks..][..s.table_len];
            let slot_of = |pos: usize| table[pos / block_size] as usize * block_size + pos % block_size;
            let seq = SeqAttention {
                q: q.t.narrow(0, s.query_start, s.query_len).map_err(lib)?,
                keys: &cache.keys[layer],
                values: &cache.values[layer],
                slot_of: &slot_of,
                context_len: s.context_len,
                kv_heads,
                head_dim: d,
            };
            outs.push(attention::attend(&seq, &self.ledger, attention::TILES).map_err(lib)?);
        }
        self.act(Tensor::cat(&outs, 0))
    }

    fn sample(&self, logits: &CpuTensor, rows: &[DeviceSampling]) -> BResult<CpuTensor> {
        let (n, width) = dims2(&logits.t)?;
        if n != rows.len() || width == 0 {
            return Err(BackendError::Shape(format!(
                "sample: {} settings for {n} rows of {width} logits",
                rows.len()
            )));
        }
        // Read where they lie: a vocabulary row is 600 kB, copied once per token before.
        let picked = with_values(&logits.t, |data| {
            Ok(rows
                .iter()
                .zip(data.chunks_exact(width))
                .flat_map(|(s, row)| {
                    let (token, logprob) = s.pick(row);
                    [token as f32, logprob]
                })
                .collect())
        })?;
        self.upload(picked, &[n, 2])
    }
}

#[cfg(test)]
mod tests {
    crate::backend_suite!(super::CpuBackend::default());
    crate::backend_suite!(hybrid; crate::backend::cpu::CpuBackend::default());
    crate::golden_suite!(crate::backend::cpu::CpuBackend::default(), hybrid);
}
