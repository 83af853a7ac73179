//! Weight matrices stored in fewer bytes than f32 on the CPU: bfloat16 as the checkpoint holds it,
//! or GGML's block formats ([`WeightFormat`], [`blocks`](super::blocks)).
//!
//! Products with few activation rows (decode) read each weight row once for all of them, in tasks
//! of rows on candle's thread pool. bfloat16 rows are widened to f32 inside the dot product
//! (exactly: a bfloat16 is the upper half of an f32) against f32 activations, so a bfloat16
//! checkpoint gives the f32 path's numbers at half the bytes read; candle's own bf16 kernel would
//! round the activations to bfloat16 as well. Block rows are multiplied by integer dot products
//! against activations quantized once per product.

use super::amx_gemm;
use super::bf16_gemm::{self, round_bf16};
use super::block_dot::{dot_row, Activations};
use super::block_tiles::{self, BlockTiles, TILE_ROWS};
use super::f16_decode::{rounded_rows, DecodeActivations, LONG_ROWS_AT_ONCE};
use super::isa::fastest;
use super::k_quant_dot::{self, KActivations, KQuant, KRows};
use super::k_quant_tiles::{self, KTiles};
use super::row_partners::{self, RowPartner, Shares};
use crate::arch::blocks::{BlockKind, BlockRows, BLOCK};
use crate::arch::ggml::GgmlType;
use crate::arch::spec::MatrixUse;
use crate::arch::weight_format::WeightFormat;
use crate::parallel::{for_each_part, for_each_piece};
use candle_core::quantized::{GgmlDType, QTensor};
use half::f16;
use half::slice::HalfFloatSliceExt;
use std::borrow::Cow;
use std::ops::Range;
use std::rc::Rc;
use std::sync::{Arc, OnceLock};

/// The values of one matrix.
#[derive(Debug)]
enum Packing {
    /// bfloat16 bit patterns, row-major.
    Bf16(Vec<u16>),
    /// IEEE half precision as a GGUF or safetensors file stores it, row-major; each row widened
    /// to f32 for the product. `bf16`: every value is a bfloat16 value too
    /// ([`PackedMatrix::is_bf16_valued_f16`]).
    F16 { values: Vec<f16>, bf16: bool },
    /// `q8_0`/`q4_0` blocks row by row.
    Blocks(BlockRows),
    /// `q8_0`/`q4_0` blocks interleaved for integer tiles, on CPUs that have them.
    Tiled(BlockTiles),
    /// `q4_K` or `q6_K` super-blocks as a GGUF file stores them ([`k_quant_dot`]).
    KQuants(KRows),
    /// `q4_K`/`q6_K` super-blocks interleaved for integer tiles, on CPUs that have them.
    KTiled(KTiles),
    /// Any other GGML block type as a GGUF file stores it (`q5_K`, `q4_1`, `q5_0`, `q5_1`),
    /// multiplied by candle's `k_quants` (the activations quantized to `q8_K` or `q8_0`/`q8_1`
    /// per block, as llama.cpp's CPU code does).
    Ggml(GgmlType, Arc<QTensor>),
}

impl Packing {
    /// `q8_0`/`q4_0` blocks as integer tiles where this CPU has them and the rows make whole
    /// groups, else row by row.
    fn blocks(rows: BlockRows) -> Packing {
        block_tiles::available()
            .then(|| BlockTiles::from_rows(&rows))
            .flatten()
            .map_or(Packing::Blocks(rows), Packing::Tiled)
    }

    /// K-quant super-blocks as integer tiles where this CPU has them and the rows make whole
    /// groups, else as stored.
    fn k_quants(rows: KRows) -> Packing {
        k_quant_tiles::available()
            .then(|| KTiles::from_rows(&rows))
            .flatten()
            .map_or(Packing::KQuants(rows), Packing::KTiled)
    }
}

/// A matrix `[rows, cols]` in bfloat16 or quantized row by row.
#[derive(Debug)]
pub struct PackedMatrix {
    rows: usize,
    cols: usize,
    packing: Packing,
    /// Which rows [`row_partners`] compute, once the first product with partners has shared them
    /// (None: all here).
    shares: OnceLock<Option<Shares>>,
    /// Rows held here: `rows`, or the rows not shared out where the partners' ones were dropped
    /// ([`PackedMatrix::share_rows`]).
    held_rows: usize,
}

/// A bfloat16 bit pattern as the f32 it stands for (exact).
#[inline(always)]
fn widen(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// Whether every one of `values` is exactly a bfloat16 value (its f32 form ends in 16 zero bits).
fn all_bf16(values: &[f16]) -> bool {
    let mut wide = [0f32; 4096];
    values.chunks(wide.len()).all(|chunk| {
        let wide = &mut wide[..chunk.len()];
        chunk.convert_to_f32_slice(wide);
        wide.iter().all(|v| v.to_bits() & 0xFFFF == 0)
    })
}

/// Lanes of the dot product's accumulators: four AVX-512 or eight AVX2 registers, independent
/// chains enough to hide the fused multiply-add's latency (with two AVX2 registers the chains, not
/// the memory, bounded a bfloat16 decode), so the compiler vectorises.
const LANES: usize = 64;

/// A stored weight widened to the f32 it stands for (exact).
trait Widen: Copy {
    fn widen(self) -> f32;
}

/// bfloat16 bit patterns.
impl Widen for u16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        widen(self)
    }
}

/// Rows already widened (an f16 row converted for the product).
impl Widen for f32 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
}

/// `out[i] = x_i · w` for the `out.len()` rows `x_i` of `xs`, `w` one row of weights. `FMA` picks
/// fused multiply-adds, which only a function compiled with the `fma` feature may ask for.
#[inline(always)]
fn dot_rows<const FMA: bool, T: Widen>(w: &[T], xs: &[f32], out: &mut [f32]) {
    let cols = w.len();
    for (x, o) in xs.chunks_exact(cols).zip(out.iter_mut()) {
        let mut acc = [0f32; LANES];
        let (wc, xc) = (w.chunks_exact(LANES), x.chunks_exact(LANES));
        let (w_tail, x_tail) = (wc.remainder(), xc.remainder());
        for (w, x) in wc.zip(xc) {
            for l in 0..LANES {
                acc[l] = if FMA {
                    x[l].mul_add(w[l].widen(), acc[l])
                } else {
                    acc[l] + x[l] * w[l].widen()
                };
            }
        }
        let tail: f32 = w_tail.iter().zip(x_tail).map(|(&w, x)| x * w.widen()).sum();
        *o = acc.iter().sum::<f32>() + tail;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn dot_rows_avx2<T: Widen>(w: &[T], xs: &[f32], out: &mut [f32]) {
    dot_rows::<true, T>(w, xs, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
fn dot_rows_avx512<T: Widen>(w: &[T], xs: &[f32], out: &mut [f32]) {
    dot_rows::<true, T>(w, xs, out)
}

/// [`dot_rows`] with the widest instructions this CPU has.
fn dot_rows_fastest<T: Widen>(w: &[T], xs: &[f32], out: &mut [f32]) {
    fastest!(
        avx512_fma => dot_rows_avx512(w, xs, out),
        avx2_fma => dot_rows_avx2(w, xs, out),
        _ => dot_rows::<false, T>(w, xs, out),
    )
}

/// [`dot_rows`] for a half-precision row `w`: widened in registers with F16C where the CPU has
/// it (256-bit vectors: decode is bound by the bytes read long before the multiplies), else
/// widened into a per-thread row first.
fn dot_rows_f16(w: &[f16], xs: &[f32], out: &mut [f32]) {
    fastest!(
        avx2_fma => dot_rows_f16_avx2(w, xs, out),
        _ => dot_rows_f16_portable(w, xs, out),
    )
}

pub(super) fn dot_rows_f16_portable(w: &[f16], xs: &[f32], out: &mut [f32]) {
    WIDE_ROW.with_borrow_mut(|wide| {
        wide.resize(w.len(), 0.0);
        w.convert_to_f32_slice(wide);
        dot_rows::<false, f32>(wide.as_slice(), xs, out)
    })
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(unsafe_code)]
fn dot_rows_f16_avx2(w: &[f16], xs: &[f32], out: &mut [f32]) {
    use std::arch::x86_64::*;
    /// Values per step: four independent chains of eight.
    const STEP: usize = 32;
    let cols = w.len();
    let whole = cols / STEP * STEP;
    for (x, o) in xs.chunks_exact(cols).zip(out.iter_mut()) {
        let mut acc = [_mm256_setzero_ps(); 4];
        for i in (0..whole).step_by(STEP) {
            for (l, acc) in acc.iter_mut().enumerate() {
                let at = i + 8 * l;
                // SAFETY: `at + 8 <= whole <= cols`, the length of both `w` and `x`.
                let (wv, xv) = unsafe {
                    (
                        _mm256_cvtph_ps(_mm_loadu_si128(w.as_ptr().add(at) as *const __m128i)),
                        _mm256_loadu_ps(x.as_ptr().add(at)),
                    )
                };
                *acc = _mm256_fmadd_ps(wv, xv, *acc);
            }
        }
        let sum = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let mut lanes = [0f32; 8];
        // SAFETY: eight f32 into eight.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), sum) };
        let tail: f32 = w[whole..].iter().zip(&x[whole..]).map(|(w, x)| w.to_f32() * x).sum();
        *o = lanes.iter().sum::<f32>() + tail;
    }
}

/// How far ahead of the weights a product reads it asks the CPU to fetch them (0: it asks for
/// nothing), by the CPU's maker and family, as measured with Qwen3-VL-2B decodes on 2-core VMs
/// (docs/PERFORMANCE-HISTORY.md): on the AMD EPYCs of Zen 3 and Zen 5, `q4_0` decodes 1.3× faster with
/// 8 KiB than with 512 bytes (their hardware prefetchers alone leave a row-by-row GEMV well below
/// the memory's read bandwidth); on the Intel Xeon, 1 KiB decodes 1.2–1.4× faster than 8 KiB
/// (`q4_0`, `q4_K`, f16), as fast as 512 bytes; on the Zen 4 EPYC, no hints at all decode f16
/// 1.3× faster than 8 KiB and `q4_0` as fast as 1 KiB (8 KiB is the slowest there).
#[cfg(target_arch = "x86_64")]
pub(super) fn prefetch_bytes() -> usize {
    static BYTES: std::sync::LazyLock<usize> = std::sync::LazyLock::new(|| {
        if &super::isa::maker() == b"GenuineIntel" {
            1024
        } else if super::isa::zen4() {
            0
        } else {
            8192
        }
    });
    *BYTES
}

/// Asks the CPU to bring `data[range]`'s elements [`prefetch_bytes`] further on into its caches
/// (clamped to `data`); `cold`, the first range of a run, also from `range.start` on, since no
/// earlier range asked for it. A hint, no effect on the results.
#[allow(unsafe_code)]
pub(super) fn prefetch_ahead<T>(data: &[T], range: std::ops::Range<usize>, cold: bool) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        if prefetch_bytes() == 0 {
            return;
        }
        let size = std::mem::size_of::<T>().max(1);
        let ahead = prefetch_bytes() / size;
        let (start, end) = (
            (if cold { range.start } else { range.start + ahead }).min(data.len()),
            (range.end + ahead).min(data.len()),
        );
        let step = (64 / size).max(1);
        for i in (start..end).step_by(step) {
            // SAFETY: SSE is part of x86_64's baseline; a prefetch reads nothing the program sees.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(&data[i] as *const T as *const i8) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (data, range, cold);
}

/// Asks the CPU to fetch the `bytes` at `block` [`prefetch_bytes`] further on: the integer tiles'
/// groups follow one another, so this runs ahead through a matrix as one stream, past a group's
/// end into the next. A hint, with no effect on the results; the addresses may lie past the
/// matrix, which a prefetch never reads.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(unsafe_code)]
pub(super) fn prefetch_past(block: *const u8, bytes: usize) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
    if prefetch_bytes() == 0 {
        return;
    }
    let ahead = block.wrapping_add(prefetch_bytes());
    for line in (0..bytes).step_by(64) {
        // SAFETY: a prefetch reads nothing the program sees and never faults.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(line) as *const i8) };
    }
}

/// Output rows (of the weight matrix) per task of [`PackedMatrix::dequantize`].
const ROWS_PER_TASK: usize = 64;

/// One matrix's products: `dot(row, n, acts, cold, out, stride)` writes the products of weight
/// rows `row..row + n` (never across a group of [`TILE_ROWS`]) with activation rows `acts` into
/// `out`, that of (activation row `i`, weight row `row + r`) at `out[(i − acts.start) · stride +
/// r]`; `cold` marks the first call of a run (nothing prefetched yet).
type RowDot<'a> = dyn Fn(usize, usize, Range<usize>, bool, &mut [f32], usize) + Sync + 'a;

/// The activations of `acts` quantized for `kind`.
fn block_activations(acts: &[Activations], kind: BlockKind) -> candle_core::Result<&Activations> {
    match acts.iter().find(|a| a.kind() == kind) {
        Some(a) => Ok(a),
        None => candle_core::bail!("no {kind:?} activations"),
    }
}

/// The activations quantized for K-quant products, if any matrix asked for them.
fn k_activations(acts: &Option<KActivations>) -> candle_core::Result<&KActivations> {
    match acts {
        Some(a) => Ok(a),
        None => candle_core::bail!("no K-quant activations"),
    }
}

/// A [`RowDot`] from a product of one weight row, `dot(row, first, cold, out)` with activation
/// rows `first..first + out.len()` into `out`.
fn row_by_row<'a>(dot: impl Fn(usize, usize, bool, &mut [f32]) + Sync + 'a) -> Box<RowDot<'a>> {
    Box::new(move |row, n, acts, cold, out, stride| {
        ROW_PRODUCTS.with_borrow_mut(|products| {
            products.resize(acts.len(), 0.0);
            for r in 0..n {
                dot(row + r, acts.start, cold && r == 0, products);
                for (k, &v) in products.iter().enumerate() {
                    out[k * stride + r] = v;
                }
            }
        })
    })
}

thread_local! {
    /// A half-precision row widened for its product, one per pool thread.
    static WIDE_ROW: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    /// One weight row's products for [`row_by_row`], one per pool thread.
    static ROW_PRODUCTS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// One matrix of a product over the pool: its rows, its bytes and its [`RowDot`].
type Part<'a> = (usize, u64, &'a RowDot<'a>);

/// Where each of `runs` runs through the sequence of `parts`' rows ends: the bytes read shared
/// out evenly (a `q6_K` row is 1.46 `q4_K` ones: split by rows, the thread given a `Q4_K_M`
/// file's `q6_K` `v` after `q` and `k` kept the other waiting 11 % of a decode), each end on a
/// group of [`TILE_ROWS`] rows of its part.
fn run_ends(parts: &[Part<'_>], runs: usize) -> Vec<usize> {
    let total_rows: usize = parts.iter().map(|p| p.0).sum();
    let total_bytes: u64 = parts.iter().map(|p| p.1).sum();
    let mut ends: Vec<usize> = Vec::with_capacity(runs);
    for t in 1..runs {
        let target = total_bytes as f64 * t as f64 / runs as f64;
        let (mut first, mut before, mut end) = (0, 0f64, total_rows);
        for &(rows, bytes, _) in parts {
            if before + bytes as f64 >= target && bytes > 0 {
                let groups = (target - before) / bytes as f64 * rows as f64 / TILE_ROWS as f64;
                end = first + (groups.round() as usize * TILE_ROWS).min(rows);
                break;
            }
            first += rows;
            before += bytes as f64;
        }
        ends.push(end.max(ends.last().copied().unwrap_or(0)));
    }
    ends.push(total_rows);
    ends
}

/// The tiles of activation rows `rows` a kernel taking `tile` rows at once is called for, as
/// `(first row, rows)`: whole tiles, then the rest one row at a time.
pub(super) fn tiles_of(rows: Range<usize>, tile: usize) -> impl Iterator<Item = (usize, usize)> {
    let whole = rows.start + (rows.len() / tile) * tile;
    (rows.start..whole)
        .step_by(tile)
        .map(move |first| (first, tile))
        .chain((whole..rows.end).map(|first| (first, 1)))
}

/// Bytes of quantized activations one pass over a thread's weight rows takes (about 1.25 bytes
/// per value): a prefill's hundreds of rows are taken in slices that stay in the core's L2 cache
/// while the weights stream past, rather than all of them read again from L3 for every group of
/// 16 weight rows (a 512-row product with a 6144×2048 `q4_0` matrix on the AVX2 EPYC, best of 8
/// calls, alternated: 85–96 against 82–87 GMAC/s).
const ACTIVATION_SLICE_BYTES: usize = 256 << 10;

/// Activation rows per pass over the weights for `m` rows of `cols` values: whole tiles of four.
fn activation_slice(m: usize, cols: usize) -> usize {
    (ACTIVATION_SLICE_BYTES / (cols + cols / 4).max(1) / 4 * 4).clamp(4, m.max(4))
}

/// Runs of weight rows per thread of a product, taken from the pool's cursor: on a shared VM one
/// core runs slower than the other for a while, and one run per thread left the main thread
/// waiting at the barrier for 5.5 % of a `Q4_K_M` decode and 3–7 % of a 519-token prefill. (On the
/// AVX2 EPYC, alternated with one run per thread: decode `Q4_0` 13.4/14.0 → 15.2/15.5 tokens/s,
/// `Q4_K_M` 11.9/12.7/11.7/12.3/10.8 → 13.2/12.4/13.6/13.4/12.5; prefill `Q4_0` 58.5/59.0/50.9 →
/// 65.5/59.5/60.8, with the activations quantized over the pool.)
const RUNS_PER_THREAD: usize = 8;

/// [`RUNS_PER_THREAD`] for one activation row (a decode step), whose runs are short: the thread
/// that finishes first waits at most one run for the other. On the Zen 4 EPYC, an F16 decode's
/// waits (the worker spinning, the main thread at the barrier) went from 4.6 to 3.7 % of the
/// samples with 32 runs instead of 8.
const DECODE_RUNS_PER_THREAD: usize = 32;

/// The rows of the piece [`by_weight_rows`] hands a [`RowDot`] at `row` (row `local` of its
/// part): as far as the end of the group, the part (`part_end`) or the run (`run_end`).
fn piece_rows(local: usize, part_end: usize, run_end: usize, row: usize) -> usize {
    (TILE_ROWS - local % TILE_ROWS).min(part_end - row).min(run_end - row)
}

/// Activation rows per task of [`by_weight_rows`]' gathering of each matrix's products.
const GATHER_ROWS: usize = 16;

/// The products `[m, rows]` of `m` activation rows (`cols` values each) with each of several
/// matrices. Their rows are shared out as one sequence, in [`RUNS_PER_THREAD`] (for one row
/// [`DECODE_RUNS_PER_THREAD`]) contiguous runs per thread of candle's pool (the one its other
/// kernels use; [`run_ends`]), so each thread reads
/// a few streams, in pieces of whole groups of [`TILE_ROWS`] rows, the first of each run and
/// matrix started cold; once per [`activation_slice`] of the activation rows. Each piece writes
/// its `[slice, piece's rows]` products in sequence after the previous piece's (a tile's sums
/// for one activation row and group are one cache line; written a row of `[m, run's rows]`
/// apart, each missed the caches and held up the kernels: 18 % of the `q4_K` tiles' speed), and
/// each matrix's products are then gathered from the pieces that hold its rows (one activation
/// row's are the runs' outputs in sequence).
fn by_weight_rows(parts: &[Part<'_>], m: usize, cols: usize) -> Vec<Vec<f32>> {
    let total: usize = parts.iter().map(|p| p.0).sum();
    if m == 0 || total == 0 {
        return parts.iter().map(|p| vec![0f32; m * p.0]).collect();
    }
    let threads = candle_core::utils::barrier_pool().n_workers() + 1;
    let per_thread = if m == 1 {
        DECODE_RUNS_PER_THREAD
    } else {
        RUNS_PER_THREAD
    };
    let ends = run_ends(parts, threads * per_thread);
    let starts: Vec<usize> = std::iter::once(0).chain(ends.iter().copied()).collect();
    let value_ends: Vec<usize> = ends.iter().map(|&e| e * m).collect();
    let slice = activation_slice(m, cols);
    let mut runs = vec![0f32; total * m];
    for_each_part(&mut runs, &value_ends, |t, run| {
        let (start, end) = (starts[t], ends[t]);
        for from in (0..m).step_by(slice) {
            let acts = from..(from + slice).min(m);
            let mut row = start;
            // The part holding `row`, and its first row in the sequence.
            let (mut j, mut first) = (0, 0);
            let mut cold = true;
            while row < end {
                while row >= first + parts[j].0 {
                    first += parts[j].0;
                    j += 1;
                    cold = true;
                }
                let n = piece_rows(row - first, first + parts[j].0, end, row);
                let at = from * (end - start) + (row - start) * acts.len();
                (parts[j].2)(row - first, n, acts.clone(), cold, &mut run[at..], n);
                cold = false;
                row += n;
            }
        }
    });
    if m == 1 {
        // One activation row (a decode): the runs' products are the matrices' in sequence.
        let mut rest = runs;
        return parts
            .iter()
            .map(|p| {
                let tail = rest.split_off(p.0);
                std::mem::replace(&mut rest, tail)
            })
            .collect();
    }
    let mut first = 0;
    parts
        .iter()
        .map(|&(rows, _, _)| {
            let mine = first..first + rows;
            first += rows;
            let mut out = vec![0f32; m * rows];
            let task = |p: usize, piece: &mut [f32]| {
                // The pieces of this matrix's rows as the runs took them.
                let (mut row, mut t) = (mine.start, 0);
                while row < mine.end {
                    while ends[t] <= row {
                        t += 1;
                    }
                    let (start, end) = (starts[t], ends[t]);
                    let n = piece_rows(row - mine.start, mine.end, end, row);
                    for (di, o) in piece.chunks_exact_mut(rows).enumerate() {
                        let i = p * GATHER_ROWS + di;
                        let from = i / slice * slice;
                        let at =
                            start * m + from * (end - start) + (row - start) * slice.min(m - from) + (i - from) * n;
                        o[row - mine.start..][..n].copy_from_slice(&runs[at..at + n]);
                    }
                    row += n;
                }
            };
            if m < GATHER_ROWS {
                task(0, &mut out);
            } else {
                for_each_piece(&mut out, GATHER_ROWS * rows, task);
            }
            out
        })
        .collect()
}

impl Drop for PackedMatrix {
    fn drop(&mut self) {
        if let Some(Some(shares)) = self.shares.get() {
            row_partners::forget(shares);
        }
    }
}

impl PackedMatrix {
    fn new(rows: usize, cols: usize, packing: Packing) -> Self {
        PackedMatrix {
            rows,
            cols,
            packing,
            shares: OnceLock::new(),
            held_rows: rows,
        }
    }

    /// Quantizes `values` (row-major `[rows, cols]`), or None when `format` keeps this shape.
    pub fn quantize(format: WeightFormat, values: &[f32], rows: usize, cols: usize) -> Option<Self> {
        if !format.quantizes(&[rows, cols]) || values.len() != rows * cols {
            return None;
        }
        let kind = format.block_kind()?;
        let packing = Packing::blocks(BlockRows::quantize(kind, values, cols));
        Some(PackedMatrix::new(rows, cols, packing))
    }

    /// A matrix of GGML `q8_0` or `q4_0` blocks as a GGUF file stores them (see
    /// [`BlockRows::from_ggml`]), or None for another type or bytes that are not `rows` rows.
    pub fn ggml_blocks(ggml: GgmlType, data: &[u8], rows: usize, cols: usize) -> Option<Self> {
        let kind = match ggml {
            GgmlType::Q8_0 => BlockKind::Q8_0,
            GgmlType::Q4_0 => BlockKind::Q4_0,
            _ => return None,
        };
        let blocks = BlockRows::from_ggml(kind, data, cols)?;
        (blocks.scales().len() * BLOCK == rows * cols).then(|| PackedMatrix::new(rows, cols, Packing::blocks(blocks)))
    }

    /// A matrix of any other GGML block type from a GGUF tensor's bytes: `q4_K` and `q6_K` for
    /// [`k_quant_dot`]'s products, the rest for candle's (`q5_K`, `q4_1`, `q5_0`, `q5_1`). None
    /// for another type, bytes that are not `rows` rows, or `q4_1`/`q5_*` rows of an odd number of
    /// blocks (which candle cannot multiply).
    pub fn ggml(ggml: GgmlType, data: &[u8], rows: usize, cols: usize) -> Option<Self> {
        if let Some(kind) = KQuant::from_ggml(ggml) {
            return KRows::new(kind, data, rows, cols).map(|k| PackedMatrix::new(rows, cols, Packing::k_quants(k)));
        }
        let dtype = match ggml {
            GgmlType::Q4_1 => GgmlDType::Q4_1,
            GgmlType::Q5_0 => GgmlDType::Q5_0,
            GgmlType::Q5_1 => GgmlDType::Q5_1,
            GgmlType::Q5K => GgmlDType::Q5K,
            _ => return None,
        };
        // candle's q4_1/q5_0/q5_1 products take rows of an even number of blocks.
        let pairs = matches!(ggml, GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1);
        let row_values = if pairs { 2 * ggml.block().0 } else { ggml.block().0 };
        if ggml.bytes_of((rows * cols) as u64) != Some(data.len() as u64) || !cols.is_multiple_of(row_values) {
            return None;
        }
        // candle reads the blocks in place, so they must be aligned as its block structs are:
        // a GGUF tensor in a mapping is (32-byte offsets), a reassembled or fixture copy may not be.
        let aligned: Vec<u64>;
        let data = if (data.as_ptr() as usize).is_multiple_of(8) {
            data
        } else {
            let mut words = vec![0u64; data.len().div_ceil(8)];
            bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..data.len()].copy_from_slice(data);
            aligned = words;
            &bytemuck::cast_slice::<u64, u8>(&aligned)[..data.len()]
        };
        let q = candle_core::quantized::ggml_file::qtensor_from_ggml(
            dtype,
            data,
            vec![rows, cols],
            &candle_core::Device::Cpu,
        )
        .ok()?;
        Some(PackedMatrix::new(rows, cols, Packing::Ggml(ggml, Arc::new(q))))
    }

    /// A half-precision matrix from its values (row-major), or None when the count is not
    /// `rows · cols`. Where a bfloat16 GEMM runs the prefill (AMX, AVX-512 BF16), the values are
    /// checked once for being all bfloat16 values too (an F16 file converted from a bfloat16
    /// checkpoint, as Qwen's are): on CPUs with AMX such a matrix is stored as bfloat16 (the same
    /// bytes and values, multiplied by AMX's tiles, [`amx_gemm`]); elsewhere it stays f16 (its
    /// decode rows widen faster: on the Zen 4 EPYC bfloat16 rows decoded 20 % slower) and is marked
    /// for [`bf16_gemm`].
    pub fn f16(values: Vec<f16>, rows: usize, cols: usize) -> Option<Self> {
        if values.len() != rows * cols {
            return None;
        }
        let amx = amx_gemm::fits(rows, cols);
        let bf16 = (amx || bf16_gemm::available()) && all_bf16(&values);
        let packing = if amx && bf16 {
            Packing::Bf16(values.iter().map(|v| (v.to_f32().to_bits() >> 16) as u16).collect())
        } else {
            Packing::F16 { values, bf16 }
        };
        Some(PackedMatrix::new(rows, cols, packing))
    }

    /// Whether the values are f16 that are all bfloat16 values too (checked on CPUs with a
    /// bfloat16 GEMM only), which that GEMM multiplies without rounding them.
    pub fn is_bf16_valued_f16(&self) -> bool {
        matches!(self.packing, Packing::F16 { bf16: true, .. })
    }

    /// Whether the values are IEEE half precision (multiplied in f32, except where
    /// [`Self::is_bf16_valued_f16`] lets a prefill take the bfloat16 GEMM).
    pub fn is_f16(&self) -> bool {
        self.f16_values().is_some()
    }

    /// The values of an f16 matrix, row-major; None for any other packing.
    pub fn f16_values(&self) -> Option<&[f16]> {
        match &self.packing {
            Packing::F16 { values, .. } => Some(values),
            _ => None,
        }
    }

    /// The bit patterns of a bfloat16 matrix, row-major; None for any other packing.
    pub fn bf16_values(&self) -> Option<&[u16]> {
        match &self.packing {
            Packing::Bf16(v) => Some(v),
            _ => None,
        }
    }

    /// A bfloat16 matrix from its bit patterns (row-major), or None when the count is not
    /// `rows · cols`.
    pub fn bf16(bits: Vec<u16>, rows: usize, cols: usize) -> Option<Self> {
        (bits.len() == rows * cols).then(|| PackedMatrix::new(rows, cols, Packing::Bf16(bits)))
    }

    /// `[rows, cols]`.
    pub fn dims(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }

    /// Bytes of the packed values.
    pub fn bytes(&self) -> u64 {
        (match &self.packing {
            Packing::Bf16(v) => std::mem::size_of_val(v.as_slice()),
            Packing::F16 { values, .. } => std::mem::size_of_val(values.as_slice()),
            Packing::Blocks(b) => b.bytes(),
            Packing::Tiled(t) => t.bytes(),
            Packing::KQuants(k) => k.bytes() as usize,
            Packing::KTiled(t) => t.bytes(),
            Packing::Ggml(_, q) => q.storage_size_in_bytes(),
        }) as u64
    }

    /// `x · selfᵀ` for `x [m, cols]` (row-major): `[m, rows]`.
    pub fn matmul(&self, x: &[f32], m: usize) -> candle_core::Result<Vec<f32>> {
        Ok(Self::matmul_many(&[self], x, m)?.pop().unwrap_or_default())
    }

    /// `x · wᵀ` for each matrix `w` of `mats` (all `cols` wide) and `x [m, cols]`, in one pass over
    /// the thread pool, the activations quantized once per block format; where this thread has
    /// [`row_partners`], their shares of the rows computed by them meanwhile.
    pub fn matmul_many(mats: &[&PackedMatrix], x: &[f32], m: usize) -> candle_core::Result<Vec<Vec<f32>>> {
        if let Some(w) = mats.iter().find(|w| x.len() != m * w.cols) {
            candle_core::bail!("{} values are not {m} rows of {}", x.len(), w.cols);
        }
        if m == 0 {
            return Ok(mats.iter().map(|_| Vec::new()).collect());
        }
        let partners = row_partners::partners();
        let shares: Vec<Option<&Shares>> = mats.iter().map(|w| w.share(&partners)).collect();
        if shares.iter().all(Option::is_none) {
            let whole: Vec<_> = mats.iter().map(|&w| (w, w.rows)).collect();
            return Self::products(&whole, x, m);
        }
        let cols = mats[0].cols;
        let widest = (0..partners.len())
            .map(|i| shares.iter().flatten().map(|s| s.of(i).len()).sum::<usize>())
            .max()
            .unwrap_or(0);
        let capacity = partners.iter().map(|p| p.capacity()).min().unwrap_or(0);
        let slice = (capacity / (cols + widest)).max(1);
        let mut outs: Vec<Vec<f32>> = mats.iter().map(|w| Vec::with_capacity(m * w.rows)).collect();
        for from in (0..m).step_by(slice) {
            let n = slice.min(m - from);
            let xs = &x[from * cols..(from + n) * cols];
            let (here, theirs) = Self::with_partners(&partners, &shares, xs, n, |xs| {
                let here: Vec<_> = mats
                    .iter()
                    .zip(&shares)
                    .map(|(&w, s)| (w, s.map_or(w.rows, |s| s.here())))
                    .collect();
                Self::products(&here, xs, n)
            })?;
            let mut k = 0;
            for ((out, mine), s) in outs.iter_mut().zip(&here).zip(&shares) {
                let Some(s) = s else {
                    out.extend_from_slice(mine);
                    continue;
                };
                for r in 0..n {
                    out.extend_from_slice(&mine[r * s.here()..(r + 1) * s.here()]);
                    for (i, products) in theirs.iter().enumerate() {
                        let width = s.of(i).len();
                        out.extend_from_slice(&products[k][r * width..(r + 1) * width]);
                    }
                }
                k += 1;
            }
        }
        Ok(outs)
    }

    /// Starts each partner on its rows of the shared matrices (`x [m, cols]`), runs `here`, then
    /// waits for every partner started: `here`'s products and each partner's, per shared matrix.
    #[allow(clippy::type_complexity)]
    fn with_partners(
        partners: &[Rc<dyn RowPartner>],
        shares: &[Option<&Shares>],
        x: &[f32],
        m: usize,
        here: impl FnOnce(&[f32]) -> candle_core::Result<Vec<Vec<f32>>>,
    ) -> candle_core::Result<(Vec<Vec<f32>>, Vec<Vec<Vec<f32>>>)> {
        let mut started = Ok(0);
        for (i, p) in partners.iter().enumerate() {
            let ids: Vec<u32> = shares.iter().flatten().map(|s| s.ids[i]).collect();
            if let Err(e) = p.start(&ids, x, m) {
                started = Err(e);
                break;
            }
            started = Ok(i + 1);
        }
        let mine = match started {
            Ok(_) => here(x),
            Err(ref e) => Err(candle_core::Error::Msg(format!("a row partner did not start: {e}"))),
        };
        let count = *started.as_ref().unwrap_or(&0);
        let theirs: Result<Vec<_>, String> = partners[..count].iter().map(|p| p.finish()).collect();
        let theirs = theirs.map_err(|e| candle_core::Error::Msg(format!("a row partner failed: {e}")))?;
        Ok((mine?, theirs))
    }

    /// Shares this matrix's rows out to this thread's [`row_partners`], if it has any (else the
    /// first product with partners does it), unless the model only gathers its rows (`usage`).
    /// Where the model never gathers them and every product of the matrix runs by rows
    /// (`q8_0`/`q4_0`/`q4_K`/`q6_K`), the rows the partners hold are dropped here: in the tab, a
    /// 2-thread `Q4_K_M` 2B model kept 0.4 GB of rows twice.
    pub fn share_rows(&mut self, usage: MatrixUse) {
        if usage == MatrixUse::Gathers {
            return;
        }
        let Some(here) = self.share(&row_partners::partners()).map(Shares::here) else {
            return;
        };
        if !usage.gathers() {
            match &mut self.packing {
                Packing::Blocks(b) => b.keep_rows(here),
                Packing::KQuants(k) => k.keep_rows(here),
                _ => return,
            }
            self.held_rows = here;
        }
    }

    /// Whether every row is held here ([`PackedMatrix::share_rows`] drops the partners' ones).
    pub fn holds_every_row(&self) -> bool {
        self.held_rows == self.rows
    }

    /// This matrix's [`Shares`] among `partners`, shared out on the first call that has partners
    /// (None: too few rows, a packing that stays here, or a partner that could not take it).
    fn share(&self, partners: &[Rc<dyn RowPartner>]) -> Option<&Shares> {
        if partners.is_empty() && self.shares.get().is_none() {
            return None;
        }
        self.shares
            .get_or_init(|| {
                if self.rows < row_partners::MIN_SHARED_ROWS || self.ggml_rows(0..0).is_none() {
                    return None;
                }
                let ends = row_partners::share_ends(self.rows, partners.len() + 1, TILE_ROWS);
                let mut shares = Shares {
                    ends,
                    ids: Vec::new(),
                    bytes: 0,
                };
                for (i, p) in partners.iter().enumerate() {
                    let rows = shares.of(i);
                    let (ggml, bytes) = self.ggml_rows(rows.clone())?;
                    match p.adopt(ggml, &bytes, rows.len(), self.cols) {
                        Ok(id) => {
                            shares.ids.push(id);
                            shares.bytes += bytes.len() as u64;
                            row_partners::adopted(bytes.len() as u64);
                        }
                        Err(_) => {
                            row_partners::forget(&shares);
                            return None;
                        }
                    }
                }
                Some(shares)
            })
            .as_ref()
    }

    /// Rows `rows` as a GGUF file stores them; None for a packing a partner does not take
    /// (integer tiles, which wasm has not, and candle's GGML types).
    fn ggml_rows(&self, rows: Range<usize>) -> Option<(GgmlType, Vec<u8>)> {
        let values = rows.start * self.cols..rows.end * self.cols;
        Some(match &self.packing {
            Packing::Bf16(v) => (GgmlType::Bf16, bytemuck::cast_slice(&v[values]).to_vec()),
            Packing::F16 { values: v, .. } => (GgmlType::F16, bytemuck::cast_slice(&v[values]).to_vec()),
            Packing::Blocks(b) => (
                match b.kind() {
                    BlockKind::Q8_0 => GgmlType::Q8_0,
                    BlockKind::Q4_0 => GgmlType::Q4_0,
                },
                b.to_ggml(rows),
            ),
            Packing::KQuants(k) => (k.kind().ggml(), k.rows_bytes(rows).to_vec()),
            Packing::Tiled(_) | Packing::KTiled(_) | Packing::Ggml(..) => return None,
        })
    }

    /// A matrix from a GGUF tensor's bytes in any type [`PackedMatrix`] keeps (`f16`, `bf16` and
    /// the block types of [`PackedMatrix::ggml_blocks`] and [`PackedMatrix::ggml`]), or None.
    pub fn from_gguf(ggml: GgmlType, data: &[u8], rows: usize, cols: usize) -> Option<Self> {
        let halves = || data.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]]));
        match ggml {
            GgmlType::F16 => Self::f16(halves().map(f16::from_bits).collect(), rows, cols),
            GgmlType::Bf16 => Self::bf16(halves().collect(), rows, cols),
            _ => Self::ggml_blocks(ggml, data, rows, cols).or_else(|| Self::ggml(ggml, data, rows, cols)),
        }
    }

    /// The products of `x [m, cols]` with the first `rows` rows of each matrix, `[m, rows]` each.
    fn products(mats: &[(&PackedMatrix, usize)], x: &[f32], m: usize) -> candle_core::Result<Vec<Vec<f32>>> {
        if mats.iter().any(|(w, _)| matches!(w.packing, Packing::Ggml(..))) {
            // candle's products run on their own; the others share a pass over the thread pool.
            return mats
                .iter()
                .map(|&(w, rows)| match &w.packing {
                    Packing::Ggml(_, q) => {
                        let xt = candle_core::Tensor::from_slice(x, (m, w.cols), &candle_core::Device::Cpu)?;
                        xt.apply_op1_no_bwd(q.as_ref())?.flatten_all()?.to_vec1::<f32>()
                    }
                    _ => Ok(Self::products(&[(w, rows)], x, m)?.pop().unwrap_or_default()),
                })
                .collect();
        }
        let (rows, mats): (Vec<usize>, Vec<&PackedMatrix>) = mats.iter().map(|&(w, rows)| (rows, w)).unzip();
        let mats = mats.as_slice();
        let mut acts: Vec<Activations> = Vec::new();
        for w in mats {
            let kind = match &w.packing {
                Packing::Blocks(b) => b.kind(),
                Packing::Tiled(t) => t.kind(),
                _ => continue,
            };
            if !acts.iter().any(|a| a.kind() == kind) {
                acts.push(Activations::quantize(kind, x, w.cols));
            }
        }
        let k_acts = mats
            .iter()
            .find(|w| matches!(w.packing, Packing::KQuants(_) | Packing::KTiled(_)))
            .map(|w| KActivations::quantize(x, w.cols));
        let f16_one = mats
            .iter()
            .find(|w| m == 1 && matches!(w.packing, Packing::F16 { .. }))
            .map(|w| DecodeActivations::new(&x[..w.cols]));
        let f16_rows = mats
            .iter()
            .find(|w| m > 1 && matches!(w.packing, Packing::F16 { .. }))
            .map(|w| rounded_rows(x, w.cols));
        let mut dots: Vec<Box<RowDot<'_>>> = Vec::with_capacity(mats.len());
        for w in mats {
            let cols = w.cols;
            dots.push(match &w.packing {
                Packing::Bf16(bits) => row_by_row(move |row, first, cold, out| {
                    prefetch_ahead(bits, row * cols..(row + 1) * cols, cold);
                    let xs = &x[first * cols..(first + out.len()) * cols];
                    dot_rows_fastest(&bits[row * cols..(row + 1) * cols], xs, out)
                }),
                Packing::F16 { values, .. } if m == 1 => {
                    let Some(acts) = f16_one.as_ref() else {
                        candle_core::bail!("no f16 activations")
                    };
                    Box::new(move |row, n, _, cold, out, _| {
                        // The prefetch hints (where the CPU takes them) stay interleaved with the
                        // reads, a few rows at a time, as when each row was its own call.
                        for (k, o) in out[..n].chunks_mut(LONG_ROWS_AT_ONCE).enumerate() {
                            let rows =
                                (row + k * LONG_ROWS_AT_ONCE) * cols..(row + k * LONG_ROWS_AT_ONCE + o.len()) * cols;
                            prefetch_ahead(values, rows.clone(), cold && k == 0);
                            acts.products(&values[rows], o)
                        }
                    })
                }
                Packing::F16 { values, .. } => {
                    let Some(x) = f16_rows.as_deref() else {
                        candle_core::bail!("no f16 activations")
                    };
                    row_by_row(move |row, first, cold, out| {
                        prefetch_ahead(values, row * cols..(row + 1) * cols, cold);
                        let xs = &x[first * cols..(first + out.len()) * cols];
                        dot_rows_f16(&values[row * cols..(row + 1) * cols], xs, out)
                    })
                }
                Packing::Blocks(b) => {
                    let a = block_activations(&acts, b.kind())?;
                    row_by_row(move |row, first, cold, out| dot_row(b, row, a, first, cold, out))
                }
                Packing::Tiled(t) => {
                    let a = block_activations(&acts, t.kind())?;
                    Box::new(move |row, n, rows, _, out, stride| t.products(row, n, a, rows, out, stride))
                }
                Packing::KQuants(k) => {
                    let a = k_activations(&k_acts)?;
                    row_by_row(move |row, first, cold, out| k_quant_dot::dot_row(k, row, a, first, cold, out))
                }
                Packing::KTiled(t) => {
                    let a = k_activations(&k_acts)?;
                    Box::new(move |row, n, rows, _, out, stride| t.products(row, n, a, rows, out, stride))
                }
                Packing::Ggml(..) => candle_core::bail!("GGML block matrices are multiplied on their own"),
            });
        }
        let parts: Vec<Part<'_>> = mats
            .iter()
            .zip(&rows)
            .zip(&dots)
            .map(|((w, &rows), d)| (rows, w.bytes() * rows as u64 / w.rows.max(1) as u64, d.as_ref()))
            .collect();
        Ok(by_weight_rows(&parts, m, x.len() / m.max(1)))
    }

    /// Whether the values are stored as integer tiles ([`block_tiles`], [`k_quant_tiles`]), whose
    /// products are the fastest for any number of activation rows, a prefill's included.
    pub fn is_tiled(&self) -> bool {
        matches!(self.packing, Packing::Tiled(_) | Packing::KTiled(_))
    }

    /// Whether a prefill's products go row by row too, like decode's, rather than through a GEMM
    /// of the matrix dequantized: integer tiles ([`Self::is_tiled`]), a matrix that holds only
    /// some of its rows ([`Self::holds_every_row`]), and in wasm a
    /// `q8_0`/`q4_0`/`q4_K`/`q6_K` matrix shared with the tab's helper workers. There the GEMM
    /// runs on one thread, and the row products, which unpack each weight row once per activation
    /// row, prefilled a `Q4_K_M` 2B model's 237-token prompt at 6.0 tokens/s on one thread against
    /// the GEMM's 8.2, and at 11.0 on two.
    pub fn prefills_by_rows(&self) -> bool {
        self.is_tiled()
            || !self.holds_every_row()
            || (cfg!(target_arch = "wasm32")
                && matches!(self.packing, Packing::Blocks(_) | Packing::KQuants(_))
                && matches!(self.shares.get(), Some(Some(_))))
    }

    /// The whole matrix in f32 (row-major).
    pub fn dequantize(&self) -> Vec<f32> {
        let cols = self.cols;
        let mut out = vec![0f32; self.rows * cols];
        for_each_piece(&mut out, ROWS_PER_TASK * cols, |t, part| {
            let first = t * ROWS_PER_TASK;
            match &self.packing {
                Packing::Bf16(v) => {
                    let v = &v[first * cols..][..part.len()];
                    part.iter_mut().zip(v).for_each(|(o, &b)| *o = widen(b))
                }
                Packing::F16 { values, .. } => values[first * cols..][..part.len()].convert_to_f32_slice(part),
                Packing::Blocks(_)
                | Packing::Tiled(_)
                | Packing::KQuants(_)
                | Packing::KTiled(_)
                | Packing::Ggml(..) => {
                    for (r, row) in part.chunks_exact_mut(cols).enumerate() {
                        self.row_f32(first + r, row);
                    }
                }
            }
        });
        out
    }

    /// Row `row` of a [`Packing::Ggml`] matrix in f32, by GGML's dequantization.
    fn ggml_row(&self, row: usize, out: &mut [f32]) {
        if let Packing::Ggml(t, q) = &self.packing {
            let bytes = t.bytes_of(self.cols as u64).unwrap_or(0) as usize;
            if let Ok(data) = q.data() {
                t.dequantize(&data[row * bytes..(row + 1) * bytes], out);
            }
        }
    }

    /// Bytes [`PackedMatrix::bf16_rows`] allocates for `count` rows: none for bfloat16 weights,
    /// which it borrows.
    pub fn bf16_rows_scratch_bytes(&self, count: usize) -> usize {
        match &self.packing {
            Packing::Bf16(_) => 0,
            _ => count * self.cols * 2 + self.cols * 4,
        }
    }

    /// Rows `first..first + count` as bfloat16 bits, row-major: as stored, or dequantized and
    /// rounded to the nearest bfloat16.
    pub fn bf16_rows(&self, first: usize, count: usize) -> Cow<'_, [u16]> {
        let cols = self.cols;
        match &self.packing {
            Packing::Bf16(v) => Cow::Borrowed(&v[first * cols..(first + count) * cols]),
            // Any other packing, row by row in f32.
            _ => {
                let mut wide = vec![0f32; cols];
                let mut out = vec![0u16; count * cols];
                for (r, row) in out.chunks_exact_mut(cols).enumerate() {
                    self.row_f32(first + r, &mut wide);
                    row.iter_mut().zip(&wide).for_each(|(o, &v)| *o = round_bf16(v));
                }
                Cow::Owned(out)
            }
        }
    }

    /// Rows `ids` in f32 (an embedding lookup); ids must be below `rows`.
    pub fn gather(&self, ids: &[usize]) -> Vec<f32> {
        debug_assert!(ids.iter().all(|&i| i < self.rows));
        match &self.packing {
            Packing::Bf16(v) => ids
                .iter()
                .flat_map(|&id| v[id * self.cols..(id + 1) * self.cols].iter().map(|&b| widen(b)))
                .collect(),
            // Any other packing, row by row in f32.
            _ => {
                let mut out = vec![0f32; ids.len() * self.cols];
                for (&id, row) in ids.iter().zip(out.chunks_exact_mut(self.cols)) {
                    self.row_f32(id, row);
                }
                out
            }
        }
    }

    /// Row `row` of a block matrix in f32.
    fn row_f32(&self, row: usize, out: &mut [f32]) {
        match &self.packing {
            Packing::Blocks(b) => b.dequantize_row(row, out),
            Packing::Tiled(t) => t.dequantize_row(row, out),
            Packing::KQuants(k) => k.dequantize_row(row, out),
            Packing::KTiled(t) => t.dequantize_row(row, out),
            Packing::Ggml(..) => self.ggml_row(row, out),
            Packing::Bf16(v) => out
                .iter_mut()
                .zip(&v[row * self.cols..(row + 1) * self.cols])
                .for_each(|(o, &b)| *o = widen(b)),
            Packing::F16 { values, .. } => values[row * self.cols..(row + 1) * self.cols].convert_to_f32_slice(out),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A partner on this thread: it keeps its copies as a helper worker would, and computes them
    /// when started.
    #[derive(Default)]
    struct Partner {
        mats: std::cell::RefCell<std::collections::HashMap<u32, PackedMatrix>>,
        next: std::cell::Cell<u32>,
        done: std::cell::RefCell<Vec<Vec<f32>>>,
        capacity: usize,
    }

    impl RowPartner for Partner {
        fn adopt(&self, ggml: GgmlType, bytes: &[u8], rows: usize, cols: usize) -> Result<u32, String> {
            let w = PackedMatrix::from_gguf(ggml, bytes, rows, cols).ok_or("not a matrix")?;
            self.next.set(self.next.get() + 1);
            self.mats.borrow_mut().insert(self.next.get(), w);
            Ok(self.next.get())
        }
        fn start(&self, ids: &[u32], x: &[f32], m: usize) -> Result<(), String> {
            let mats = self.mats.borrow();
            let mine: Vec<_> = ids.iter().map(|id| (&mats[id], mats[id].rows)).collect();
            assert!(m * (mine[0].0.cols + mine.iter().map(|w| w.1).sum::<usize>()) <= self.capacity);
            *self.done.borrow_mut() = PackedMatrix::products(&mine, x, m).map_err(|e| e.to_string())?;
            Ok(())
        }
        fn finish(&self) -> Result<Vec<Vec<f32>>, String> {
            Ok(std::mem::take(&mut *self.done.borrow_mut()))
        }
        fn forget(&self, id: u32) {
            self.mats.borrow_mut().remove(&id);
        }
        fn capacity(&self) -> usize {
            self.capacity
        }
    }

    /// Two partners of `capacity` installed on this thread.
    fn install_partners(capacity: usize) -> Vec<Rc<Partner>> {
        let partners: Vec<Rc<Partner>> = (0..2)
            .map(|_| {
                Rc::new(Partner {
                    capacity,
                    ..Default::default()
                })
            })
            .collect();
        row_partners::install(partners.iter().map(|p| Rc::clone(p) as Rc<dyn RowPartner>).collect());
        partners
    }

    /// Each matrix's products shared out are its products alone, within f32 rounding.
    fn assert_same_products(alone: &[Vec<f32>], shared: &[Vec<f32>]) {
        for (k, (a, b)) in alone.iter().zip(shared).enumerate() {
            assert_eq!(a.len(), b.len());
            let close = a.iter().zip(b).all(|(a, b)| (a - b).abs() <= 1e-5 * a.abs().max(1.0));
            assert!(close, "matrix {k}");
        }
    }

    /// Rows shared out at load are dropped here where the model only multiplies by the matrix
    /// and every product of it runs by rows (a prefill's too, from then on): the products stay
    /// the products alone, and only the rows kept here are counted. A matrix the model gathers
    /// rows from keeps every row (one it only gathers from is not shared at all), and so does a
    /// bfloat16 one, whose prefill is a GEMM over every row.
    #[test]
    fn rows_shared_at_load_are_dropped_here_where_nothing_reads_them() {
        let (rows, cols) = (300, 256);
        let values = matrix(rows, cols);
        let q4k = super::k_quant_dot::tests::random_rows(KQuant::Q4K, rows, cols, 9);
        let k_rows = || Packing::KQuants(KRows::new(KQuant::Q4K, &q4k, rows, cols).unwrap());
        let make = || {
            [
                Packing::Blocks(BlockRows::quantize(BlockKind::Q8_0, &values, cols)),
                Packing::Blocks(BlockRows::quantize(BlockKind::Q4_0, &values, cols)),
                k_rows(),
                Packing::Bf16(values.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect()),
                k_rows(),
                k_rows(),
            ]
            .map(|p| PackedMatrix::new(rows, cols, p))
        };
        use MatrixUse::{Gathers, GathersAndProducts, Products};
        let uses = [Products, Products, Products, Products, GathersAndProducts, Gathers];
        let dropped = [true, true, true, false, false, false];
        let alone = make();
        let products = |mats: &[PackedMatrix; 6], m: usize| {
            PackedMatrix::matmul_many(&mats.each_ref(), &matrix(m, cols), m).unwrap()
        };
        let want = [1, 40].map(|m| products(&alone, m));
        let partners = install_partners(40 * (cols + 6 * 100));
        let mut mats = make();
        for (w, &usage) in mats.iter_mut().zip(&uses) {
            w.share_rows(usage);
        }
        for (k, (w, a)) in mats.iter().zip(&alone).enumerate() {
            assert_eq!(!w.holds_every_row(), dropped[k], "matrix {k}");
            let kept = if dropped[k] { a.bytes() * 96 / 300 } else { a.bytes() };
            assert_eq!(w.bytes(), kept, "matrix {k}");
            assert_eq!(
                w.shares.get().is_some_and(Option::is_some),
                uses[k] != Gathers,
                "matrix {k}"
            );
            if dropped[k] {
                assert!(w.prefills_by_rows(), "matrix {k}");
            }
        }
        assert!(partners.iter().all(|p| p.mats.borrow().len() == 5));
        for (want, got) in want.iter().zip([1, 40].map(|m| products(&mats, m))) {
            assert_same_products(want, &got);
        }
        // The rows the partners hold are still gathered from a matrix the model gathers from.
        assert_eq!(mats[4].gather(&[0, 150, 299]), alone[4].gather(&[0, 150, 299]));
        drop(mats);
        row_partners::install(Vec::new());
    }

    /// With partners, every packing they take gives the products it gives alone (each row's sum
    /// is computed the same way wherever it runs), in slices of activation rows where the
    /// partners' buffers are small; a dropped matrix is dropped by the partners too.
    #[test]
    fn products_shared_with_partners_are_the_products_alone() {
        let (rows, cols) = (300, 256);
        let values = matrix(rows, cols);
        let q4k = super::k_quant_dot::tests::random_rows(KQuant::Q4K, rows, cols, 5);
        let mats = [
            PackedMatrix::bf16(
                values.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect(),
                rows,
                cols,
            ),
            PackedMatrix::f16(values.iter().map(|&v| f16::from_f32(v * 1.001)).collect(), rows, cols),
            Some(PackedMatrix::new(
                rows,
                cols,
                Packing::Blocks(BlockRows::quantize(BlockKind::Q8_0, &values, cols)),
            )),
            Some(PackedMatrix::new(
                rows,
                cols,
                Packing::Blocks(BlockRows::quantize(BlockKind::Q4_0, &values, cols)),
            )),
            Some(PackedMatrix::new(
                rows,
                cols,
                Packing::KQuants(KRows::new(KQuant::Q4K, &q4k, rows, cols).unwrap()),
            )),
            PackedMatrix::bf16(vec![0; 16 * cols], 16, cols),
        ]
        .map(Option::unwrap);
        let alone: Vec<_> = [1, 7]
            .map(|m| PackedMatrix::matmul_many(&mats.each_ref(), &matrix(m, cols), m).unwrap())
            .into();
        let partners = install_partners(3 * (cols + 5 * 100));
        let shared: Vec<_> = [1, 7]
            .map(|m| PackedMatrix::matmul_many(&mats.each_ref(), &matrix(m, cols), m).unwrap())
            .into();
        for (k, w) in mats.iter().enumerate() {
            let want = if k < 5 { Some(vec![96, 192, 300]) } else { None };
            assert_eq!(w.shares.get().cloned().flatten().map(|s| s.ends), want, "matrix {k}");
        }
        for (alone, shared) in alone.iter().zip(&shared) {
            assert_same_products(alone, shared);
        }
        assert!(partners.iter().all(|p| p.mats.borrow().len() == 5));
        // Two thirds of each shared matrix's bytes, the first row of each tile group kept here.
        let shared: u64 = mats[..5].iter().map(|w| w.bytes() * 204 / 300).sum();
        assert_eq!(row_partners::shared_bytes(), shared);
        drop(mats);
        assert!(partners.iter().all(|p| p.mats.borrow().is_empty()));
        assert_eq!(row_partners::shared_bytes(), 0);
        row_partners::install(Vec::new());
    }

    fn matrix(rows: usize, cols: usize) -> Vec<f32> {
        (0..rows * cols)
            .map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 0.1)
            .collect()
    }

    /// Rows read as bfloat16 are the stored values rounded to the nearest bfloat16, from any first
    /// row, and only quantized matrices need scratch for them.
    #[test]
    fn bf16_rows_are_the_values_rounded() {
        let (rows, cols) = (9, 96);
        let values = matrix(rows, cols);
        let bits = values.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
        let mut mats = vec![PackedMatrix::bf16(bits, rows, cols).unwrap()];
        for format in [WeightFormat::Q8_0, WeightFormat::Q4_0] {
            mats.push(PackedMatrix::quantize(format, &values, rows, cols).unwrap());
        }
        for w in &mats {
            let want: Vec<u16> = w.dequantize()[3 * cols..8 * cols]
                .iter()
                .map(|&v| half::bf16::from_f32(v).to_bits())
                .collect();
            assert_eq!(*w.bf16_rows(3, 5), want[..]);
            let borrowed = matches!(w.packing, Packing::Bf16(_));
            assert_eq!(w.bf16_rows_scratch_bytes(5) == 0, borrowed);
        }
    }

    /// A prefill wider than one [`activation_slice`] (taken in several passes over the weights)
    /// gives each activation row the products it gets alone, in every packing that slices, with
    /// the threads' runs crossing from a tiled matrix into one off the group size.
    #[test]
    fn activation_slices_give_each_row_s_products() {
        let cols = 8192;
        let m = activation_slice(usize::MAX, cols) + 6;
        assert!(m > 8 && activation_slice(m, cols) < m);
        let x = matrix(m, cols);
        let bits = matrix(37, cols)
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_bits())
            .collect();
        let mats = [
            PackedMatrix::quantize(WeightFormat::Q4_0, &matrix(3 * TILE_ROWS, cols), 3 * TILE_ROWS, cols).unwrap(),
            PackedMatrix::bf16(bits, 37, cols).unwrap(),
        ];
        let all = PackedMatrix::matmul_many(&mats.each_ref(), &x, m).unwrap();
        for (q, all) in mats.iter().zip(&all) {
            for i in [0, 5, m - 7, m - 1] {
                let alone = q.matmul(&x[i * cols..(i + 1) * cols], 1).unwrap();
                for (r, want) in alone.iter().enumerate() {
                    let got = all[i * q.rows + r];
                    assert!(
                        (got - want).abs() <= 1e-4 * want.abs().max(1.0),
                        "{} rows, row {i}, {r}: {got} vs {want}",
                        q.rows
                    );
                }
            }
        }
    }

    /// Blocks in whole groups of rows are stored as tiles where the CPU has tiles for their format,
    /// and row by row elsewhere; both give the same products for a decode, a batch and a prefill,
    /// and the same rows.
    #[test]
    fn tiles_where_the_cpu_has_them_give_the_rows_products() {
        let (rows, cols) = (2 * TILE_ROWS, 96);
        let w = matrix(rows, cols);
        for format in [WeightFormat::Q8_0, WeightFormat::Q4_0] {
            let q = PackedMatrix::quantize(format, &w, rows, cols).unwrap();
            let kind = format.block_kind().unwrap();
            assert_eq!(q.is_tiled(), block_tiles::available(), "{format}");
            assert!(!PackedMatrix::quantize(format, &w[..9 * cols], 9, cols)
                .unwrap()
                .is_tiled());
            let by_rows = PackedMatrix::new(rows, cols, Packing::Blocks(BlockRows::quantize(kind, &w, cols)));
            assert_eq!(q.bytes(), by_rows.bytes());
            assert_eq!(q.dequantize(), by_rows.dequantize());
            assert_eq!(q.gather(&[17, 3]), by_rows.gather(&[17, 3]));
            for m in [1, 7, 40] {
                let x = matrix(m, cols);
                let (got, want) = (q.matmul(&x, m).unwrap(), by_rows.matmul(&x, m).unwrap());
                assert!(
                    got.iter()
                        .zip(&want)
                        .all(|(a, b)| (a - b).abs() <= 1e-4 * b.abs().max(1.0)),
                    "{format} m={m}"
                );
            }
        }
        let bits = matrix(16, 64)
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_bits())
            .collect();
        assert!(!PackedMatrix::bf16(bits, 16, 64).unwrap().is_tiled());
    }

    #[test]
    fn block_sizes_are_the_planner_s() {
        for format in [WeightFormat::Q8_0, WeightFormat::Q4_0] {
            let q = PackedMatrix::quantize(format, &matrix(48, 64), 48, 64).unwrap();
            assert_eq!(q.bytes(), format.tensor_bytes(&[48, 64], 4), "{format}");
        }
        assert!(PackedMatrix::quantize(WeightFormat::Q8_0, &matrix(4, 37), 4, 37).is_none());
        assert!(PackedMatrix::quantize(WeightFormat::Unquantized, &matrix(4, 64), 4, 64).is_none());
    }

    /// The product is the f32 product within each format's rounding, for one row (decode) and
    /// for many (prefill), and gathered rows are the dequantized values.
    #[test]
    fn matmul_and_gather_stay_close_to_f32() {
        let (rows, cols) = (40, 96);
        let w = matrix(rows, cols);
        // A value is off by at most one step of its block's scale, `max |w| / 127` or `/ 8`.
        let max = w.iter().map(|v| v.abs()).fold(0.0, f32::max);
        for (format, tol, step) in [
            (WeightFormat::Q8_0, 0.01, max / 127.0),
            (WeightFormat::Q4_0, 0.08, max / 8.0),
        ] {
            let q = PackedMatrix::quantize(format, &w, rows, cols).unwrap();
            for m in [1, 5, 33] {
                let x = matrix(m, cols);
                let got = q.matmul(&x, m).unwrap();
                let scale = max * cols as f32 * 0.1;
                for i in 0..m {
                    for j in 0..rows {
                        let want: f32 = (0..cols).map(|c| x[i * cols + c] * w[j * cols + c]).sum();
                        let err = (got[i * rows + j] - want).abs();
                        assert!(err <= tol * scale, "{format} m={m} [{i},{j}]: {err} vs {want}");
                    }
                }
            }
            let whole = q.dequantize();
            assert_eq!(whole.len(), rows * cols);
            assert!(whole.iter().zip(&w).all(|(a, b)| (a - b).abs() <= step * 1.001));
            let rows_back = q.gather(&[3, 0]);
            for (k, &v) in rows_back.iter().enumerate() {
                let src = if k < cols { w[3 * cols + k] } else { w[k - cols] };
                assert!((v - src).abs() <= step * 1.001, "{format} {k}: {v} vs {src}");
            }
        }
        assert!(PackedMatrix::quantize(WeightFormat::Q8_0, &w, rows, cols)
            .unwrap()
            .matmul(&[0.0; 5], 1)
            .is_err());
    }

    /// Half-precision weights keep 2 bytes a value, gather and dequantize to their exact values,
    /// and multiply as the f32 product of those values and of the activations rounded to f16, as
    /// llama.cpp's CPU code rounds them (up to summation order).
    #[test]
    fn f16_weights_multiply_as_their_widened_values() {
        let (rows, cols) = (7, 200);
        let w: Vec<f16> = matrix(rows, cols).iter().map(|&v| f16::from_f32(v)).collect();
        let wide: Vec<f32> = w.iter().map(|v| v.to_f32()).collect();
        let q = PackedMatrix::f16(w, rows, cols).unwrap();
        assert_eq!(q.bytes(), (rows * cols * 2) as u64);
        assert_eq!(q.dequantize(), wide);
        assert_eq!(q.gather(&[6, 1]), [&wide[6 * cols..], &wide[cols..2 * cols]].concat());
        for m in [1, 3] {
            let x = matrix(m, cols);
            let got = q.matmul(&x, m).unwrap();
            let read = |v: f32| f16::from_f32(v).to_f32();
            for i in 0..m {
                for j in 0..rows {
                    let want: f32 = (0..cols).map(|c| read(x[i * cols + c]) * wide[j * cols + c]).sum();
                    assert!(
                        (got[i * rows + j] - want).abs() <= 1e-5,
                        "[{i},{j}] {} vs {want}",
                        got[i * rows + j]
                    );
                }
            }
        }
    }

    /// An f16 matrix whose values are all bfloat16 values is stored as bfloat16 where AMX would
    /// multiply it (the same values, bytes and products), and stays f16 elsewhere or when one
    /// value is not a bfloat16 value.
    #[test]
    fn f16_weights_that_are_bf16_values_are_stored_as_bf16_for_amx_and_marked_for_the_bf16_gemm() {
        let (rows, cols) = (64, 96);
        let bf16_values: Vec<f32> = matrix(rows, cols).iter().map(|&v| widen(round_bf16(v))).collect();
        let w: Vec<f16> = bf16_values.iter().map(|&v| f16::from_f32(v)).collect();
        assert!(w.iter().zip(&bf16_values).all(|(h, &v)| h.to_f32() == v));
        let q = PackedMatrix::f16(w.clone(), rows, cols).unwrap();
        assert_eq!(q.bf16_values().is_some(), amx_gemm::fits(rows, cols));
        assert_eq!(q.is_f16(), !amx_gemm::fits(rows, cols));
        // Kept f16 without AMX, and marked for the bfloat16 GEMM where the CPU has one.
        let gemm = bf16_gemm::available();
        assert_eq!(q.is_bf16_valued_f16(), gemm && !amx_gemm::fits(rows, cols));
        assert_eq!(q.bytes(), (rows * cols * 2) as u64);
        assert_eq!(q.dequantize(), bf16_values);
        let mut off = w;
        off[5] = f16::from_bits(off[5].to_bits() ^ 1);
        let off = PackedMatrix::f16(off, rows, cols).unwrap();
        assert!(off.is_f16() && !off.is_bf16_valued_f16());
        let x = matrix(40, cols);
        let got = q.matmul(&x, 40).unwrap();
        for i in 0..40 {
            for j in 0..rows {
                let want: f32 = (0..cols).map(|c| x[i * cols + c] * bf16_values[j * cols + c]).sum();
                assert!((got[i * rows + j] - want).abs() <= 1e-4, "[{i},{j}]");
            }
        }
    }

    /// Both half-precision row products (widened in registers, and into a row first) give the
    /// f64 product of the widened values, for lengths off the vector step.
    #[test]
    #[allow(unsafe_code)]
    fn f16_row_products_agree() {
        for cols in [8, 32, 200, 2048 + 24] {
            let w: Vec<f16> = matrix(1, cols).iter().map(|&v| f16::from_f32(v)).collect();
            let xs = matrix(3, cols).iter().map(|v| v * 3.0 - 0.1).collect::<Vec<_>>();
            let want: Vec<f64> = xs
                .chunks_exact(cols)
                .map(|x| x.iter().zip(&w).map(|(&x, w)| x as f64 * w.to_f32() as f64).sum())
                .collect();
            let mut got = vec![("portable", vec![0f32; 3])];
            dot_rows_f16_portable(&w, &xs, &mut got[0].1);
            #[cfg(target_arch = "x86_64")]
            if super::super::isa::detected().avx2_fma {
                let mut out = vec![0f32; 3];
                // SAFETY: the CPU has the instructions the function was compiled for.
                unsafe { dot_rows_f16_avx2(&w, &xs, &mut out) };
                got.push(("avx2", out));
            }
            for (name, out) in got {
                for (g, w) in out.iter().zip(&want) {
                    assert!((*g as f64 - w).abs() <= 1e-4, "{name} {cols}: {g} vs {w}");
                }
            }
        }
    }

    /// Every GGML block type of the gguf-py fixture (2 × 512; the K-quants' blocks random) loads as
    /// stored, gathers rows and dequantizes to gguf-py's values exactly, and multiplies within the
    /// activations' own quantization (`q8_K` or `q8_0`/`q8_1` blocks, 1/127 of each block's
    /// largest magnitude) of the f32 product of those values.
    #[test]
    fn ggml_block_types_multiply_as_stored() {
        use crate::arch::gguf::Gguf;
        const TYPES: &[u8] = include_bytes!("../../../tests/fixtures/gguf/types.gguf");
        const VALUES: &[u8] = include_bytes!("../../../tests/fixtures/gguf/types.f32");
        let g = Gguf::parse(TYPES, TYPES.len() as u64).unwrap();
        let (rows, cols) = (2, 512);
        let x = matrix(3, cols);
        let mut checked = 0;
        for (k, t) in g.tensors.iter().enumerate() {
            let want: Vec<f32> = VALUES[k * rows * cols * 4..(k + 1) * rows * cols * 4]
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            let data = &TYPES[t.start as usize..(t.start + t.bytes) as usize];
            let Some(q) = PackedMatrix::ggml_blocks(t.ggml_type, data, rows, cols)
                .or_else(|| PackedMatrix::ggml(t.ggml_type, data, rows, cols))
            else {
                assert!(
                    matches!(t.ggml_type, GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16),
                    "{}",
                    t.ggml_type
                );
                continue;
            };
            assert_eq!(q.bytes(), data.len() as u64, "{}", t.ggml_type);
            assert_eq!(q.dequantize(), want, "{}", t.ggml_type);
            assert_eq!(
                q.gather(&[1, 0]),
                [&want[cols..], &want[..cols]].concat(),
                "{}",
                t.ggml_type
            );
            let got = q.matmul(&x, 3).unwrap();
            let xmax = x.iter().map(|v| v.abs()).fold(0.0, f32::max);
            for i in 0..3 {
                for j in 0..rows {
                    let w = &want[j * cols..(j + 1) * cols];
                    let exact: f32 = x[i * cols..(i + 1) * cols].iter().zip(w).map(|(a, b)| a * b).sum();
                    let bound: f32 = w.iter().map(|v| v.abs()).sum::<f32>() * xmax / 127.0;
                    let err = (got[i * rows + j] - exact).abs();
                    assert!(
                        err <= bound,
                        "{} [{i},{j}]: {} vs {exact} (bound {bound})",
                        t.ggml_type,
                        got[i * rows + j]
                    );
                }
            }
            checked += 1;
        }
        assert_eq!(checked, 8, "q8_0, q4_0, q4_1, q5_0, q5_1, q4_K, q5_K, q6_K");
        assert!(
            PackedMatrix::ggml(GgmlType::Q4K, &[0; 144], 1, 512).is_none(),
            "too few bytes"
        );
    }

    /// The threads' runs read as many bytes each, within a group of rows, and end on groups.
    #[test]
    fn runs_share_out_the_bytes() {
        let dot: Box<RowDot<'_>> = Box::new(|_, _, _, _, _, _| {});
        // A `Q4_K_M` layer's q, k (`q4_K`) and v (`q6_K`), 8 super-blocks a row.
        let parts: [Part<'_>; 3] = [
            (2048, 2048 * 1152, &*dot),
            (1024, 1024 * 1152, &*dot),
            (1024, 1024 * 1680, &*dot),
        ];
        let ends = run_ends(&parts, 2);
        assert_eq!(ends.len(), 2);
        assert_eq!(ends[1], 4096);
        // Half the bytes lie inside k: the first run takes q and part of k, not half the rows.
        assert!(
            ends[0] > 2048 && ends[0] < 3072 && ends[0].is_multiple_of(TILE_ROWS),
            "{ends:?}"
        );
        let total: u64 = parts.iter().map(|p| p.1).sum();
        let first_bytes = ends[0] as u64 * 1152;
        assert!(first_bytes.abs_diff(total / 2) <= (TILE_ROWS * 1152) as u64, "{ends:?}");
        // Equal rows split as before; more threads than groups leave some runs empty.
        assert_eq!(run_ends(&parts[..1], 2), [1024, 2048]);
        let small: [Part<'_>; 1] = [(16, 16 * 34, &*dot)];
        assert_eq!(run_ends(&small, 4), [0, 16, 16, 16]);
    }

    /// Several matrices of different formats and heights in one pass give each matrix's own
    /// product (the runs the threads take cross from one matrix into the next, and reach a tiled
    /// one off its groups), and a matrix of another width is refused.
    #[test]
    fn products_of_several_matrices_are_each_matrix_s_product() {
        let cols = 64;
        let bits = |rows: usize| {
            matrix(rows, cols)
                .iter()
                .map(|&v| half::bf16::from_f32(v).to_bits())
                .collect()
        };
        let mats = [
            PackedMatrix::quantize(WeightFormat::Q4_0, &matrix(5, cols), 5, cols).unwrap(),
            PackedMatrix::quantize(WeightFormat::Q4_0, &matrix(48, cols), 48, cols).unwrap(),
            PackedMatrix::bf16(bits(70), 70, cols).unwrap(),
            PackedMatrix::quantize(WeightFormat::Q8_0, &matrix(3, cols), 3, cols).unwrap(),
            PackedMatrix::quantize(WeightFormat::Q4_0, &matrix(131, cols), 131, cols).unwrap(),
        ];
        let refs: Vec<&PackedMatrix> = mats.iter().collect();
        for m in [1, 3, 9] {
            let x = matrix(m, cols);
            let all = PackedMatrix::matmul_many(&refs, &x, m).unwrap();
            assert_eq!(all.len(), mats.len());
            for (w, got) in mats.iter().zip(&all) {
                assert_eq!(got, &w.matmul(&x, m).unwrap(), "m={m}, {} rows", w.rows);
            }
        }
        let narrow = PackedMatrix::quantize(WeightFormat::Q8_0, &matrix(2, 32), 2, 32).unwrap();
        assert!(PackedMatrix::matmul_many(&[&mats[0], &narrow], &matrix(1, cols), 1).is_err());
    }

    /// bfloat16 weights give the f32 product of the widened values (only the summation order
    /// differs), for one row, a few, and row counts off the lane width and the task size.
    #[test]
    fn bf16_products_are_the_widened_f32_products() {
        for (rows, cols) in [(130, 96), (3, 37)] {
            let w: Vec<u16> = matrix(rows, cols)
                .iter()
                .map(|&v| half::bf16::from_f32(v).to_bits())
                .collect();
            let wide: Vec<f32> = w.iter().map(|&b| widen(b)).collect();
            let want = |x: &[f32], i: usize, j: usize| -> f64 {
                (0..cols)
                    .map(|c| x[i * cols + c] as f64 * wide[j * cols + c] as f64)
                    .sum()
            };
            // The portable dot product (the only one on aarch64 and wasm) and the fused one,
            // whichever this CPU would pick.
            let x = matrix(3, cols);
            for fma in [false, true] {
                let mut out = [0f32; 3];
                if fma {
                    dot_rows::<true, u16>(&w[..cols], &x, &mut out);
                } else {
                    dot_rows::<false, u16>(&w[..cols], &x, &mut out);
                }
                for (i, &o) in out.iter().enumerate() {
                    assert!((o as f64 - want(&x, i, 0)).abs() <= 1e-5, "fma {fma}, row {i}");
                }
            }
            let p = PackedMatrix::bf16(w, rows, cols).unwrap();
            assert_eq!(p.bytes(), (rows * cols * 2) as u64);
            assert_eq!(p.dequantize(), wide);
            assert_eq!(p.gather(&[2, 0]), [&wide[2 * cols..3 * cols], &wide[..cols]].concat());
            for m in [1, 2, 7] {
                let x = matrix(m, cols);
                let got = p.matmul(&x, m).unwrap();
                for i in 0..m {
                    for j in 0..rows {
                        let err = (got[i * rows + j] as f64 - want(&x, i, j)).abs();
                        assert!(err <= 1e-5, "{rows}x{cols} m={m} [{i},{j}]: {err}");
                    }
                }
            }
            assert!(p.matmul(&[], 0).unwrap().is_empty());
        }
        assert!(PackedMatrix::bf16(vec![0; 5], 2, 3).is_none());
    }
}
