//! `q4_K` and `q6_K` matrices stored for integer tiles on AVX2 CPUs ([`available`]): groups of 8
//! weight rows (16 on AVX-512 VNNI CPUs) interleaved so that one register holds the same four
//! quant bytes of all the group's rows (as llama.cpp repacks `q4_K` eight rows at a time for its
//! AVX2 GEMV and GEMM), multiplied by each activation row's four matching bytes broadcast. Every
//! i32 lane sums a whole 32-value piece of one (weight row, activation row) pair, and the scaling
//! is done in f32 once per 8 (or 16) products instead of once per lane group of one product.
//!
//! The interleaving is done once, at load, into as many bytes as the file's. Per super-block of
//! a `q4_K` group: the rows' `d` and `dmin`, their sub-blocks' 6-bit scales (one byte each, the
//! top two bits holding the minimum's top two), the minimums' low nibbles, and the quants in runs
//! of four bytes. Per super-block of a `q6_K` group: the rows' `d`, their 16 scales, then the
//! low nibbles' and the high bit pairs' bytes in runs of four. A decode, a batch of decodes and
//! a prefill read the weights as one stream.
//!
//! The kernels are written once ([`q4k_tiles`], [`q6k_tiles`]) over a register of one lane per
//! weight row ([`Lanes`]): 256-bit with AVX2 (`vpmaddubsw`), 256-bit with `vpdpbusd` where a CPU
//! runs AVX-512 as two halves (AMD Zen 4: a `Q4_K_M` decode 1.04–1.05× and a 519-token prefill
//! 1.13× the AVX2 kernels', alternated), and 512-bit with `vpdpbusd` on other AVX-512 VNNI CPUs,
//! two sub-blocks at once (on the 2-core Xeon: `q4_K` 1.8–2.0× and `q6_K` 1.3–1.5× the 256-bit
//! kernels' multiply-adds per second in `k_quant_tiles_prefill_bench`, a `Q4_K_M` prefill
//! 1.4–1.5×; docs/PERFORMANCE.md). All three sum the same integers and scale them in the same
//! order: their products are equal, bit for bit.

use super::isa::fastest;
use super::k_quant_dot::{self, scale_min_bytes, KActivations, KQuant, KRows};
use super::packed::tiles_of;
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;
use std::ops::Range;

/// Weight rows in one group of the AVX2 layout: one i32 lane per row of a 256-bit register.
const NARROW: usize = 8;

/// Weight rows in one group of the AVX-512 layout: one i32 lane per row of a 512-bit register.
const WIDE: usize = 16;

/// Activation rows one kernel call takes: they share each unpacked register of weights (four:
/// `kernels_for!` lists them).
const TILE: usize = 4;

/// Where each part of a `q4_K` group's super-block starts, in bytes per row of the group: `d`
/// and `dmin` (f16), the scale bytes `[sub-block][row]`, the minimums' low nibbles `[sub-block %
/// 4][row]` (sub-blocks 0–3 low, 4–7 high), then the quants `[32-byte chunk][run of 4][row]`.
const D: usize = 0;
const DMIN: usize = 2;
const SCALES: usize = 4;
const MIN_LOW: usize = 12;
const QUANTS: usize = 16;

/// Where each part of a `q6_K` group's super-block starts, in bytes per row of the group: `d`
/// (f16), the i8 scales `[sub-block of 16][row]`, then the quants `[half][run of 4 values][part]
/// [row]`, a run's three parts being the low nibbles' bytes `4·run..` and `32 + 4·run..` of the
/// half's 64 and the high bit pairs' bytes `4·run..` of its 32: a decode reads them in order.
const Q6_D: usize = 0;
const Q6_SCALES: usize = 2;
const Q6_QUANTS: usize = 18;

/// The parts of a super-block that move as runs: `(bytes into the file's block, start in the
/// group's block, bytes per run, runs, stride)`, start and stride in bytes per row of the group
/// (`g`); run `i` of row `lane` goes to `g · (start + stride · i) + bytes · lane`. (`q4_K`'s packed
/// scales and minimums are rearranged apart.)
fn runs(kind: KQuant) -> &'static [(usize, usize, usize, usize, usize)] {
    match kind {
        KQuant::Q4K => &[(0, D, 2, 1, 0), (2, DMIN, 2, 1, 0), (16, QUANTS, 4, 32, 4)],
        KQuant::Q6K => &[
            (208, Q6_D, 2, 1, 0),
            (192, Q6_SCALES, 1, 16, 1),
            (0, Q6_QUANTS, 4, 8, 12),
            (32, Q6_QUANTS + 4, 4, 8, 12),
            (128, Q6_QUANTS + 8, 4, 8, 12),
            (64, Q6_QUANTS + 96, 4, 8, 12),
            (96, Q6_QUANTS + 100, 4, 8, 12),
            (160, Q6_QUANTS + 104, 4, 8, 12),
        ],
    }
}

/// Products of one group with up to [`TILE`] activation rows, `[activation row][weight row]`
/// (the first [`NARROW`] of each in the AVX2 layout).
type Sums = [[f32; WIDE]; TILE];

/// Whether this CPU multiplies `q4_K` and `q6_K` by tiles: with AVX2, AVX-512 CPUs included. On
/// the 2-core Xeon (AVX-512 VNNI) the AVX2 tiles prefilled a `Q4_K_M` file at 71 tokens/s
/// against 45 by the bfloat16 GEMM over dequantized rows, and decoded within 4 % of the AVX-512
/// VNNI row products (docs/PERFORMANCE-HISTORY.md).
pub fn available() -> bool {
    super::isa::isa().avx2_fma
}

/// Whether this CPU runs the 512-bit kernels, on groups of [`WIDE`] rows: AVX-512 VNNI, not as
/// two halves (Zen 4 keeps the 256-bit ones, measured there).
pub fn wide() -> bool {
    let isa = super::isa::isa();
    isa.avx512_vnni && !isa.avx512_split
}

/// Rows per group for a matrix of `n` rows on this CPU: [`WIDE`] where the 512-bit kernels run
/// ([`wide`]) and `n` is whole groups of them, else [`NARROW`].
fn group_rows(n: usize) -> usize {
    if wide() && n.is_multiple_of(WIDE) {
        WIDE
    } else {
        NARROW
    }
}

/// A `q4_K` or `q6_K` matrix in groups of 8 or 16 rows (see the module's description).
#[derive(Debug)]
pub struct KTiles {
    kind: KQuant,
    /// Weight rows per group: [`NARROW`] or [`WIDE`].
    group_rows: usize,
    blocks_per_row: usize,
    data: Vec<u8>,
}

impl KTiles {
    /// `rows` interleaved in this CPU's groups, or None when they are not whole groups.
    pub fn from_rows(rows: &KRows) -> Option<Self> {
        Self::grouped(rows, group_rows(rows.rows()))
    }

    /// `rows` interleaved in groups of `g` rows, or None when they are not whole groups.
    fn grouped(rows: &KRows, g: usize) -> Option<Self> {
        let (kind, n) = (rows.kind(), rows.rows());
        if n == 0 || !n.is_multiple_of(g) {
            return None;
        }
        let bytes = kind.block_bytes();
        let nb = rows.row(0).len() / bytes;
        let mut data = vec![0u8; n * nb * bytes];
        for row in 0..n {
            let (group, lane) = (row / g, row % g);
            for (b, src) in rows.row(row).chunks_exact(bytes).enumerate() {
                let dst = &mut data[(group * nb + b) * g * bytes..][..g * bytes];
                for &(from, start, len, count, stride) in runs(kind) {
                    for i in 0..count {
                        dst[g * (start + stride * i) + len * lane..][..len]
                            .copy_from_slice(&src[from + len * i..][..len]);
                    }
                }
                if kind == KQuant::Q4K {
                    let sm = scale_min_bytes(&src[4..16]);
                    for sub in 0..8 {
                        let (scale, min) = (sm[sub], sm[8 + sub]);
                        dst[g * (SCALES + sub) + lane] = scale | (min >> 4) << 6;
                        dst[g * (MIN_LOW + sub % 4) + lane] |= (min & 0x0F) << (4 * (sub / 4));
                    }
                }
            }
        }
        Some(KTiles {
            kind,
            group_rows: g,
            blocks_per_row: nb,
            data,
        })
    }

    /// Bytes of the stored blocks (as many as row by row).
    pub fn bytes(&self) -> usize {
        self.data.len()
    }

    /// Bytes of one super-block of a group.
    fn group_block(&self) -> usize {
        self.group_rows * self.kind.block_bytes()
    }

    /// Group `group`'s super-blocks.
    fn group(&self, group: usize) -> &[u8] {
        let len = self.blocks_per_row * self.group_block();
        &self.data[group * len..][..len]
    }

    /// Row `row`'s super-blocks as the file stores them.
    fn row(&self, row: usize) -> Vec<u8> {
        let g = self.group_rows;
        let (lane, bytes) = (row % g, self.kind.block_bytes());
        let mut out = vec![0u8; self.blocks_per_row * bytes];
        for (src, dst) in self
            .group(row / g)
            .chunks_exact(self.group_block())
            .zip(out.chunks_exact_mut(bytes))
        {
            for &(to, start, len, count, stride) in runs(self.kind) {
                for i in 0..count {
                    dst[to + len * i..][..len].copy_from_slice(&src[g * (start + stride * i) + len * lane..][..len]);
                }
            }
            if self.kind == KQuant::Q4K {
                let (mut scale, mut min) = ([0u8; 8], [0u8; 8]);
                for sub in 0..8 {
                    let packed = src[g * (SCALES + sub) + lane];
                    let low = (src[g * (MIN_LOW + sub % 4) + lane] >> (4 * (sub / 4))) & 0x0F;
                    scale[sub] = packed & 0x3F;
                    min[sub] = (packed >> 6) << 4 | low;
                }
                // GGML's 12 bytes: sub-blocks 0–3 in the low six bits of bytes 0–7, 4–7 in the
                // nibbles of bytes 8–11 and the top two bits of bytes 0–7.
                for j in 0..4 {
                    dst[4 + j] = scale[j] | (scale[j + 4] >> 4) << 6;
                    dst[8 + j] = min[j] | (min[j + 4] >> 4) << 6;
                    dst[12 + j] = (scale[j + 4] & 0x0F) | (min[j + 4] & 0x0F) << 4;
                }
            }
        }
        out
    }

    /// Row `row`'s values in f32, by GGML's dequantization.
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        self.kind.ggml().dequantize(&self.row(row), out);
    }

    /// The products of weight rows `row..row + n` with activation rows `rows` of `acts`, that of
    /// (activation row `i`, weight row `row + r`) into `out[(i − rows.start) · stride + r]`.
    pub fn products(
        &self,
        row: usize,
        n: usize,
        acts: &KActivations,
        rows: Range<usize>,
        out: &mut [f32],
        stride: usize,
    ) {
        let g = self.group_rows;
        let mut r = row;
        while r < row + n {
            let (group, lane) = (r / g, r % g);
            let take = (g - lane).min(row + n - r);
            self.group_products(
                group,
                lane..lane + take,
                acts,
                rows.clone(),
                &mut out[r - row..],
                stride,
            );
            r += take;
        }
    }

    /// Lanes `lanes` of group `group`'s products with activation rows `rows`, that of (activation
    /// row `i`, lane `l`) into `out[(i − rows.start) · stride + l − lanes.start]`. The loop over
    /// the rows' tiles runs in one function per kernel set, each tile's activation rows built in
    /// place: built by a call per tile and read back whole, they waited on every store before
    /// them, the previous tiles' outputs included (11.5 % of a `Q4_K_M` prefill on the Xeon).
    fn group_products(
        &self,
        group: usize,
        lanes: Range<usize>,
        acts: &KActivations,
        rows: Range<usize>,
        out: &mut [f32],
        stride: usize,
    ) {
        #[cfg(target_arch = "x86_64")]
        let data = self.group(group);
        #[cfg(target_arch = "x86_64")]
        let args = (self.kind, data, acts, lanes.clone(), rows.clone());
        let portable = |out: &mut [f32]| {
            for (first, t) in tiles_of(rows.clone(), TILE) {
                let sums = self.tile_portable(group, acts, first, t);
                store_sums(&sums[..t], first - rows.start, lanes.clone(), out, stride);
            }
        };
        if self.group_rows == WIDE {
            return fastest!(avx512_vnni => group_wide(args, out, stride), _ => portable(out));
        }
        fastest!(
            avx512_vnni => group_vnni(args, out, stride),
            avx2_fma => group_avx2(args, out, stride),
            _ => portable(out),
        )
    }

    /// Group `group`'s products with activation rows `first..first + t`, row by row,
    /// un-interleaved, in portable code.
    fn tile_portable(&self, group: usize, acts: &KActivations, first: usize, t: usize) -> Sums {
        let mut sums = [[0f32; WIDE]; TILE];
        for lane in 0..self.group_rows {
            let row = self.row(group * self.group_rows + lane);
            for (k, sums) in sums.iter_mut().enumerate().take(t) {
                sums[lane] = k_quant_dot::dot_portable(self.kind, &row, &acts.row(first + k));
            }
        }
        sums
    }
}

/// One register of a group's lanes, one i32 or f32 lane per weight row, and what the kernels do
/// with it: [`Ymm`] (8 rows, `VNNI` with `vpdpbusd`, else `vpmaddubsw`) or [`Zmm`] (16 rows,
/// AVX-512 VNNI). Only called from functions compiled for the instructions used.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
trait Lanes {
    /// Weight rows (lanes) per register.
    const ROWS: usize;
    /// Whether a `q4_K` chunk's two sub-blocks are summed in one pass (twice the accumulators:
    /// with 32 registers), else one pass each (the chunk read again from the first level cache).
    const BOTH_NIBBLES: bool;
    /// Runs of four `q6_K` values summed by [`Lanes::dot`] before [`Lanes::scaled_less_32`]: a
    /// whole sub-block of 16 (4) in i32 lanes, two in i16 pairs (without VNNI).
    const SCALED_RUNS: usize;
    type I: Copy;
    type F: Copy;
    unsafe fn zero() -> Self::I;
    unsafe fn zero_f() -> Self::F;
    /// `4 · ROWS` bytes at `p`.
    unsafe fn load(p: *const u8) -> Self::I;
    /// `ROWS` bytes at `p`, zero-extended to i32 lanes.
    unsafe fn u8s(p: *const u8) -> Self::I;
    /// `ROWS` f16 values at `p`.
    unsafe fn f16s(p: *const u8) -> Self::F;
    /// `sums` plus each lane's four unsigned weight bytes `w` times the four activation bytes at
    /// `x`: i32 lanes with VNNI, else i16 pairs (each then at most 2 · 255 · 128 more).
    unsafe fn dot(sums: Self::I, w: Self::I, x: *const i8) -> Self::I;
    /// [`Self::dot`]'s sums as i32 lanes.
    unsafe fn widen(sums: Self::I) -> Self::I;
    /// A span of [`Self::SCALED_RUNS`] runs' [`Self::dot`] sums times each lane's i8 scale at
    /// `scales`, as i32 lanes, less `scale · x32` where the span is the `first` of its
    /// sub-block of 16 (`x32`: `32 Σ q_x` over the sub-block's activations): summed over a
    /// sub-block's spans, `scale · Σ (q_w − 32) q_x`.
    unsafe fn scaled_less_32(sums: Self::I, x32: *const i32, first: bool, scales: *const u8) -> Self::I;
    unsafe fn splat(byte: i8) -> Self::I;
    unsafe fn and(a: Self::I, b: Self::I) -> Self::I;
    unsafe fn or(a: Self::I, b: Self::I) -> Self::I;
    unsafe fn add(a: Self::I, b: Self::I) -> Self::I;
    /// Each 16-bit lane shifted right (left) by `N`.
    unsafe fn shr16<const N: u32>(a: Self::I) -> Self::I;
    unsafe fn shl16<const N: u32>(a: Self::I) -> Self::I;
    unsafe fn float(a: Self::I) -> Self::F;
    unsafe fn splat_f(x: f32) -> Self::F;
    unsafe fn mul(a: Self::F, b: Self::F) -> Self::F;
    /// `a · b + c`, and `c − a · b`.
    unsafe fn fmadd(a: Self::F, b: Self::F, c: Self::F) -> Self::F;
    unsafe fn fnmadd(a: Self::F, b: Self::F, c: Self::F) -> Self::F;
    /// The lanes into `out[..ROWS]`.
    unsafe fn store(a: Self::F, out: &mut [f32; WIDE]);
}

/// 256-bit registers: AVX2, with `vpdpbusd` (AVX-512 VNNI on 256 bits) where `VNNI`.
#[cfg(target_arch = "x86_64")]
struct Ymm<const VNNI: bool>;

/// 512-bit registers with AVX-512 VNNI.
#[cfg(target_arch = "x86_64")]
struct Zmm;

/// The [`Lanes`] items that are one intrinsic each, from the register types and the intrinsics'
/// names (in the trait's order).
#[cfg(target_arch = "x86_64")]
macro_rules! register_ops {
    ($i:ty, $f:ty, $zero:ident, $zero_f:ident, $load:ident, $splat:ident, $and:ident, $or:ident, $add:ident,
     $float:ident, $splat_f:ident, $mul:ident, $fmadd:ident, $fnmadd:ident, $store:ident) => {
        type I = $i;
        type F = $f;
        #[inline(always)]
        unsafe fn zero() -> Self::I {
            $zero()
        }
        #[inline(always)]
        unsafe fn zero_f() -> Self::F {
            $zero_f()
        }
        #[inline(always)]
        unsafe fn load(p: *const u8) -> Self::I {
            $load(p.cast())
        }
        #[inline(always)]
        unsafe fn splat(byte: i8) -> Self::I {
            $splat(byte)
        }
        #[inline(always)]
        unsafe fn and(a: Self::I, b: Self::I) -> Self::I {
            $and(a, b)
        }
        #[inline(always)]
        unsafe fn or(a: Self::I, b: Self::I) -> Self::I {
            $or(a, b)
        }
        #[inline(always)]
        unsafe fn add(a: Self::I, b: Self::I) -> Self::I {
            $add(a, b)
        }
        #[inline(always)]
        unsafe fn float(a: Self::I) -> Self::F {
            $float(a)
        }
        #[inline(always)]
        unsafe fn splat_f(x: f32) -> Self::F {
            $splat_f(x)
        }
        #[inline(always)]
        unsafe fn mul(a: Self::F, b: Self::F) -> Self::F {
            $mul(a, b)
        }
        #[inline(always)]
        unsafe fn fmadd(a: Self::F, b: Self::F, c: Self::F) -> Self::F {
            $fmadd(a, b, c)
        }
        #[inline(always)]
        unsafe fn fnmadd(a: Self::F, b: Self::F, c: Self::F) -> Self::F {
            $fnmadd(a, b, c)
        }
        #[inline(always)]
        unsafe fn store(a: Self::F, out: &mut [f32; WIDE]) {
            $store(out.as_mut_ptr(), a)
        }
    };
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code, unsafe_op_in_unsafe_fn)]
impl<const VNNI: bool> Lanes for Ymm<VNNI> {
    const ROWS: usize = NARROW;
    const BOTH_NIBBLES: bool = false;
    const SCALED_RUNS: usize = if VNNI { 4 } else { 2 };
    register_ops!(
        __m256i,
        __m256,
        _mm256_setzero_si256,
        _mm256_setzero_ps,
        _mm256_loadu_si256,
        _mm256_set1_epi8,
        _mm256_and_si256,
        _mm256_or_si256,
        _mm256_add_epi32,
        _mm256_cvtepi32_ps,
        _mm256_set1_ps,
        _mm256_mul_ps,
        _mm256_fmadd_ps,
        _mm256_fnmadd_ps,
        _mm256_storeu_ps
    );
    #[inline(always)]
    unsafe fn u8s(p: *const u8) -> Self::I {
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.cast()))
    }
    #[inline(always)]
    unsafe fn f16s(p: *const u8) -> Self::F {
        _mm256_cvtph_ps(_mm_loadu_si128(p.cast()))
    }
    #[inline(always)]
    unsafe fn dot(sums: Self::I, w: Self::I, x: *const i8) -> Self::I {
        let word = _mm256_set1_epi32((x as *const i32).read_unaligned());
        if VNNI {
            _mm256_dpbusd_epi32(sums, w, word)
        } else {
            _mm256_add_epi16(sums, _mm256_maddubs_epi16(w, word))
        }
    }
    #[inline(always)]
    unsafe fn widen(sums: Self::I) -> Self::I {
        if VNNI {
            sums
        } else {
            _mm256_madd_epi16(sums, _mm256_set1_epi16(1))
        }
    }
    #[inline(always)]
    unsafe fn scaled_less_32(sums: Self::I, x32: *const i32, first: bool, scales: *const u8) -> Self::I {
        let s = _mm_loadl_epi64(scales.cast());
        if VNNI {
            // A span is the whole sub-block: its term comes off before the multiply.
            debug_assert!(first);
            _mm256_mullo_epi32(_mm256_sub_epi32(sums, _mm256_set1_epi32(*x32)), _mm256_cvtepi8_epi32(s))
        } else {
            let pairs = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(s, s));
            let scaled = _mm256_madd_epi16(sums, pairs);
            if first {
                // Both i16 halves of each lane hold `16 Σ q_x` (at most 16 · 16 · 127 = 32,512).
                _mm256_sub_epi32(scaled, _mm256_madd_epi16(_mm256_set1_epi16((*x32 / 2) as i16), pairs))
            } else {
                scaled
            }
        }
    }
    #[inline(always)]
    unsafe fn shr16<const N: u32>(a: Self::I) -> Self::I {
        _mm256_srl_epi16(a, _mm_cvtsi32_si128(N as i32))
    }
    #[inline(always)]
    unsafe fn shl16<const N: u32>(a: Self::I) -> Self::I {
        _mm256_sll_epi16(a, _mm_cvtsi32_si128(N as i32))
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code, unsafe_op_in_unsafe_fn)]
impl Lanes for Zmm {
    const ROWS: usize = WIDE;
    const BOTH_NIBBLES: bool = true;
    const SCALED_RUNS: usize = 4;
    register_ops!(
        __m512i,
        __m512,
        _mm512_setzero_si512,
        _mm512_setzero_ps,
        _mm512_loadu_si512,
        _mm512_set1_epi8,
        _mm512_and_si512,
        _mm512_or_si512,
        _mm512_add_epi32,
        _mm512_cvtepi32_ps,
        _mm512_set1_ps,
        _mm512_mul_ps,
        _mm512_fmadd_ps,
        _mm512_fnmadd_ps,
        _mm512_storeu_ps
    );
    #[inline(always)]
    unsafe fn u8s(p: *const u8) -> Self::I {
        _mm512_cvtepu8_epi32(_mm_loadu_si128(p.cast()))
    }
    #[inline(always)]
    unsafe fn f16s(p: *const u8) -> Self::F {
        _mm512_cvtph_ps(_mm256_loadu_si256(p.cast()))
    }
    #[inline(always)]
    unsafe fn dot(sums: Self::I, w: Self::I, x: *const i8) -> Self::I {
        _mm512_dpbusd_epi32(sums, w, _mm512_set1_epi32((x as *const i32).read_unaligned()))
    }
    #[inline(always)]
    unsafe fn widen(sums: Self::I) -> Self::I {
        sums
    }
    #[inline(always)]
    unsafe fn scaled_less_32(sums: Self::I, x32: *const i32, first: bool, scales: *const u8) -> Self::I {
        debug_assert!(first);
        let less = _mm512_sub_epi32(sums, _mm512_set1_epi32(*x32));
        _mm512_mullo_epi32(less, _mm512_cvtepi8_epi32(_mm_loadu_si128(scales.cast())))
    }
    #[inline(always)]
    unsafe fn shr16<const N: u32>(a: Self::I) -> Self::I {
        _mm512_srli_epi16::<N>(a)
    }
    #[inline(always)]
    unsafe fn shl16<const N: u32>(a: Self::I) -> Self::I {
        _mm512_slli_epi16::<N>(a)
    }
}

/// Lanes `lanes` of the sums `sums[k]` of the `at + k`-th activation row of a call into
/// `out[(at + k) · stride..]`.
#[inline(always)]
fn store_sums(sums: &[[f32; WIDE]], at: usize, lanes: Range<usize>, out: &mut [f32], stride: usize) {
    for (k, sums) in sums.iter().enumerate() {
        out[(at + k) * stride..][..lanes.len()].copy_from_slice(&sums[lanes.clone()]);
    }
}

/// What [`KTiles::group_products`] hands the kernels: the format, the group's super-blocks, the
/// activations, the lanes kept and the activation rows.
#[cfg(target_arch = "x86_64")]
type GroupArgs<'a> = (KQuant, &'a [u8], &'a KActivations, Range<usize>, Range<usize>);

/// `$q4k` and `$q6k`: [`q4k_tiles`] and [`q6k_tiles`] over `$lanes`, compiled for `$features`
/// (functions of their own, as measured, not inlined into the loop); `$group`:
/// [`KTiles::group_products`] by them, tile after tile.
macro_rules! kernels_for {
    ($q4k:ident, $q6k:ident, $group:ident, $lanes:ty, $features:literal) => {
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        #[inline(never)]
        fn $q4k<const T: usize>(data: &[u8], xs: &[k_quant_dot::KRow<'_>; T]) -> [[f32; WIDE]; T] {
            // SAFETY: compiled for the instructions `$lanes` uses, which the caller's CPU has.
            #[allow(unsafe_code)]
            unsafe {
                q4k_tiles::<$lanes, T>(data, xs)
            }
        }

        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        #[inline(never)]
        fn $q6k<const T: usize>(data: &[u8], xs: &[k_quant_dot::KRow<'_>; T]) -> [[f32; WIDE]; T] {
            // SAFETY: as above.
            #[allow(unsafe_code)]
            unsafe {
                q6k_tiles::<$lanes, T>(data, xs)
            }
        }

        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        fn $group((kind, data, acts, lanes, rows): GroupArgs<'_>, out: &mut [f32], stride: usize) {
            let start = rows.start;
            for (first, t) in tiles_of(rows, TILE) {
                if t == TILE {
                    // Written out, not by a closure: one compiled apart left each row in memory
                    // to be read back whole, waiting on the previous tile's output stores.
                    let xs = [
                        acts.row(first),
                        acts.row(first + 1),
                        acts.row(first + 2),
                        acts.row(first + 3),
                    ];
                    let sums = match kind {
                        KQuant::Q4K => $q4k::<TILE>(data, &xs),
                        KQuant::Q6K => $q6k::<TILE>(data, &xs),
                    };
                    store_sums(&sums, first - start, lanes.clone(), out, stride);
                } else {
                    let xs = [acts.row(first)];
                    let sums = match kind {
                        KQuant::Q4K => $q4k::<1>(data, &xs),
                        KQuant::Q6K => $q6k::<1>(data, &xs),
                    };
                    store_sums(&sums, first - start, lanes.clone(), out, stride);
                }
            }
        }
    };
}

kernels_for!(q4k_avx2, q6k_avx2, group_avx2, Ymm<false>, "avx2,fma,f16c");
kernels_for!(
    q4k_vnni,
    q6k_vnni,
    group_vnni,
    Ymm<true>,
    "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni"
);
kernels_for!(
    q4k_wide,
    q6k_wide,
    group_wide,
    Zmm,
    "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni"
);

/// The products of one group's super-blocks (`data`) with the activation rows `xs`: per
/// sub-block and run of four weight bytes, one [`Lanes::dot`] per activation row against its four
/// matching bytes broadcast (without VNNI: i16 pairs, each at most 8 · 2 · 15 · 128 = 30,720 over
/// the sub-block's eight runs, widened once; for one activation row, two chains of four runs,
/// each widened); per sub-block each row's sums scaled by `d · scale · d_x`. The minimums' terms
/// `dmin Σ min · d_x Σ q_x` are summed per sub-block and subtracted per super-block. A chunk's
/// 32 bytes per row hold two sub-blocks (low and high nibbles).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(unsafe_code, unsafe_op_in_unsafe_fn)]
unsafe fn q4k_tiles<L: Lanes, const T: usize>(data: &[u8], xs: &[k_quant_dot::KRow<'_>; T]) -> [[f32; WIDE]; T] {
    use crate::arch::ggml::QK_K;
    let g = L::ROWS;
    let group_block = g * k_quant_dot::Q4K_BYTES;
    // The reads below stay inside the lengths this checks.
    let nb = super_blocks(data, group_block, xs);
    let (low, six_bits) = (L::splat(0x0F), L::splat(0x3F));
    let mut acc = [L::zero_f(); T];
    for b in 0..nb {
        // SAFETY: every read below is inside super-block `b` of the group (asserted above) or
        // inside the activation rows' lengths (asserted above); a prefetch never faults.
        let block = data.as_ptr().add(b * group_block);
        super::packed::prefetch_past(block, group_block);
        let d = L::f16s(block.add(g * D));
        let dmin = L::f16s(block.add(g * DMIN));
        let mut offsets = [L::zero_f(); T];
        // The sub-blocks of chunk `$chunk` whose nibbles are `$highs` (constants, so that no
        // branch is left in the runs' loop): summed over the runs, then scaled into `acc`.
        macro_rules! sub_blocks {
            ($chunk:expr, [$($high:literal),+]) => {{
                let chunk = $chunk;
                // Per activation row and sub-block, the runs' sums; for one row (a decode), in
                // two chains (even and odd runs): one chain of eight dependent `vpdpbusd`s per
                // sub-block bound a decode by their latency (split alone, the 256-bit kernel's
                // decode ran 1.8× as fast in `k_quant_tiles_decode_bench`).
                let mut sums = [[[L::zero(); 2]; 2]; T];
                // An opaque count keeps a tile's runs a loop: unrolled, LLVM hoisted all the
                // chunk's activation broadcasts above the products and spilled them to the stack
                // (the 512-bit kernel ran at half the speed); looped, each folds into `vpdpbusd`.
                // One row's are unrolled (1.2–1.3× a decode's kernel), with no spill.
                for run in 0..if T == 1 { 8 } else { std::hint::black_box(8) } {
                    let v = L::load(block.add(g * (QUANTS + 32 * chunk + 4 * run)));
                    let at = b * QK_K + 64 * chunk + 4 * run;
                    let chain = if T == 1 { run % 2 } else { 0 };
                    $(
                        let w = if $high == 1 { L::and(L::shr16::<4>(v), low) } else { L::and(v, low) };
                        for (sums, x) in sums.iter_mut().zip(xs) {
                            sums[$high][chain] = L::dot(sums[$high][chain], w, x.quants.as_ptr().add(at + 32 * $high));
                        }
                    )+
                }
                $(
                    let sub = 2 * chunk + $high;
                    let packed = L::u8s(block.add(g * (SCALES + sub)));
                    let lows = L::u8s(block.add(g * (MIN_LOW + sub % 4)));
                    let lows = if sub < 4 { lows } else { L::shr16::<4>(lows) };
                    let scale = L::mul(d, L::float(L::and(packed, six_bits)));
                    let min = L::float(L::or(L::and(lows, low), L::shl16::<4>(L::shr16::<6>(packed))));
                    let rows = acc.iter_mut().zip(offsets.iter_mut()).zip(sums.iter().zip(xs));
                    for ((acc, offsets), (sums, x)) in rows {
                        let dx = L::splat_f(x.scales[8 * b + sub]);
                        let [even, odd] = sums[$high];
                        let sums = if T == 1 { L::add(L::widen(even), L::widen(odd)) } else { L::widen(even) };
                        *acc = L::fmadd(L::float(sums), L::mul(scale, dx), *acc);
                        let xsum = x.sums[16 * b + 2 * sub] + x.sums[16 * b + 2 * sub + 1];
                        *offsets = L::fmadd(min, L::splat_f(xsum), *offsets);
                    }
                )+
            }};
        }
        for chunk in 0..4 {
            if L::BOTH_NIBBLES {
                sub_blocks!(chunk, [0, 1]);
            } else {
                sub_blocks!(chunk, [0]);
                sub_blocks!(chunk, [1]);
            }
        }
        for (acc, offsets) in acc.iter_mut().zip(offsets) {
            *acc = L::fnmadd(dmin, offsets, *acc);
        }
    }
    std::array::from_fn(|t| {
        let mut out = [0f32; WIDE];
        L::store(acc[t], &mut out);
        out
    })
}

/// The super-blocks in a group's `data` of `group_block` bytes each; panics unless `data` is
/// whole super-blocks and every activation row of `xs` holds as many super-blocks' values,
/// scales and sums of both kinds (the SIMD kernels read within those lengths).
#[cfg(target_arch = "x86_64")]
fn super_blocks(data: &[u8], group_block: usize, xs: &[k_quant_dot::KRow<'_>]) -> usize {
    use crate::arch::ggml::QK_K;
    let nb = data.len() / group_block;
    assert_eq!(data.len(), nb * group_block);
    for x in xs {
        assert!(x.quants.len() >= nb * QK_K && x.scales.len() >= 8 * nb && x.sums.len() >= 16 * nb);
        assert!(x.x32.len() >= 16 * nb);
    }
    nb
}

/// [`q4k_tiles`] for `q6_K`: per 32 values (piece `c` of half `h` of the super-block: values
/// `128h + 32c..`, their low four bits in the low (`c` < 2) or high nibbles of the half's bytes
/// `32(c % 2)..`, their top two at bit `2c` of its high bit pairs), one [`Lanes::dot`] per run of
/// four weight bytes (the 6-bit quants, 0–63) and activation row, [`Lanes::SCALED_RUNS`] runs
/// summed (a whole sub-block of 16 in i32 with VNNI; two without, in i16, at most 2 · 2 · 63 ·
/// 128 = 32,256). GGML's `q6_K` values are `q_w − 32`: each span's sums lose `32 Σ q_x` and are
/// multiplied by their sub-block's scale in integers ([`Lanes::scaled_less_32`]), so the i32
/// lanes hold the piece's `Σ scale · (q_w − 32) q_x`, scaled once by `d · d_x`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(unsafe_code, unsafe_op_in_unsafe_fn)]
unsafe fn q6k_tiles<L: Lanes, const T: usize>(data: &[u8], xs: &[k_quant_dot::KRow<'_>; T]) -> [[f32; WIDE]; T] {
    use crate::arch::ggml::QK_K;
    let g = L::ROWS;
    let group_block = g * k_quant_dot::Q6K_BYTES;
    // A span of runs scaled at once stays inside one sub-block of 16 (four runs).
    const { assert!(4 % L::SCALED_RUNS == 0) };
    // The reads below stay inside the lengths this checks.
    let nb = super_blocks(data, group_block, xs);
    let (low, high) = (L::splat(0x0F), L::splat(0x30));
    let mut acc = [L::zero_f(); T];
    for b in 0..nb {
        // SAFETY: every read below is inside super-block `b` of the group (asserted above) or
        // inside the activation rows' lengths (asserted above); a prefetch never faults.
        let block = data.as_ptr().add(b * group_block);
        super::packed::prefetch_past(block, group_block);
        let d = L::f16s(block.add(g * Q6_D));
        let scales = |sub: usize| block.add(g * (Q6_SCALES + sub));
        // Run `run` of half `h`: its low nibbles' two registers and its high bit pairs'.
        let run_parts = |h: usize, run: usize| {
            let at = |part: usize| L::load(block.add(g * (Q6_QUANTS + 96 * h + 12 * run + 4 * part)));
            (at(0), at(1), at(2))
        };
        // The 6-bit quants of piece `c` (a constant, so that the shifts are) from a run's parts.
        macro_rules! quants {
            ($parts:expr, $c:literal) => {{
                let (a, b, bits) = $parts;
                let (nibbles, bits) = match $c {
                    0 => (a, L::shl16::<4>(bits)),
                    1 => (b, L::shl16::<2>(bits)),
                    2 => (L::shr16::<4>(a), bits),
                    _ => (L::shr16::<4>(b), L::shr16::<2>(bits)),
                };
                L::or(L::and(nibbles, low), L::and(bits, high))
            }};
        }
        let x_at = |x: &k_quant_dot::KRow<'_>, at: usize| x.quants.as_ptr().add(b * QK_K + at);
        // `32 Σ q_x` of the sub-block of 16 activation values that holds value `at` of the
        // super-block.
        let x32_at = |x: &k_quant_dot::KRow<'_>, at: usize| x.x32.as_ptr().add((b * QK_K + at) / 16);
        if T == 1 {
            // One activation row: each run's parts are read once, in memory order, and make
            // all four pieces' quants.
            let x = &xs[0];
            for h in 0..2 {
                let mut sums = [L::zero(); 4];
                for span in 0..8 / L::SCALED_RUNS {
                    let runs = span * L::SCALED_RUNS..(span + 1) * L::SCALED_RUNS;
                    let mut spans = [L::zero(); 4];
                    for run in runs.clone() {
                        let parts = run_parts(h, run);
                        let w = [
                            quants!(parts, 0),
                            quants!(parts, 1),
                            quants!(parts, 2),
                            quants!(parts, 3),
                        ];
                        for (c, (spans, w)) in spans.iter_mut().zip(w).enumerate() {
                            *spans = L::dot(*spans, w, x_at(x, 128 * h + 32 * c + 4 * run));
                        }
                    }
                    for (c, (sums, spans)) in sums.iter_mut().zip(spans).enumerate() {
                        let (sub, at) = (8 * h + 2 * c + runs.start / 4, 128 * h + 32 * c + 4 * runs.start);
                        let less = L::scaled_less_32(spans, x32_at(x, at), runs.start % 4 == 0, scales(sub));
                        *sums = L::add(*sums, less);
                    }
                }
                for (c, sums) in sums.into_iter().enumerate() {
                    let dx = L::splat_f(x.scales[8 * b + 4 * h + c]);
                    acc[0] = L::fmadd(L::float(sums), L::mul(d, dx), acc[0]);
                }
            }
        } else {
            // A tile of rows: one piece at a time, so that each row's sums stay in registers
            // (the parts come from the first level cache again for each piece).
            macro_rules! piece {
                ($h:expr, $c:literal) => {{
                    let (h, c) = ($h, $c);
                    let mut sums = [L::zero(); T];
                    for span in 0..8 / L::SCALED_RUNS {
                        let runs = span * L::SCALED_RUNS..(span + 1) * L::SCALED_RUNS;
                        let (sub, at) = (8 * h + 2 * c + runs.start / 4, 128 * h + 32 * c + 4 * runs.start);
                        let first = runs.start % 4 == 0;
                        let mut spans = [L::zero(); T];
                        for run in runs {
                            let w = quants!(run_parts(h, run), $c);
                            for (spans, x) in spans.iter_mut().zip(xs) {
                                *spans = L::dot(*spans, w, x_at(x, 128 * h + 32 * c + 4 * run));
                            }
                        }
                        for ((sums, spans), x) in sums.iter_mut().zip(spans).zip(xs) {
                            let less = L::scaled_less_32(spans, x32_at(x, at), first, scales(sub));
                            *sums = L::add(*sums, less);
                        }
                    }
                    for ((acc, sums), x) in acc.iter_mut().zip(sums).zip(xs) {
                        let dx = L::splat_f(x.scales[8 * b + 4 * h + c]);
                        *acc = L::fmadd(L::float(sums), L::mul(d, dx), *acc);
                    }
                }};
            }
            for h in 0..2 {
                piece!(h, 0);
                piece!(h, 1);
                piece!(h, 2);
                piece!(h, 3);
            }
        }
    }
    std::array::from_fn(|t| {
        let mut out = [0f32; WIDE];
        L::store(acc[t], &mut out);
        out
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::blocks::tests::values;
    use crate::arch::ggml::QK_K;
    use crate::backend::cpu::k_quant_dot::tests::random_rows;

    /// Interleaving keeps every byte, in both layouts: each row comes back as the file stores it,
    /// in as many bytes, in both formats; rows not in whole groups are refused.
    #[test]
    fn tiles_hold_the_rows_bytes() {
        let cols = 3 * QK_K;
        for (kind, g) in [
            (KQuant::Q4K, NARROW),
            (KQuant::Q6K, NARROW),
            (KQuant::Q4K, WIDE),
            (KQuant::Q6K, WIDE),
        ] {
            let data = random_rows(kind, 2 * g, cols, 7);
            let rows = KRows::new(kind, &data, 2 * g, cols).unwrap();
            let tiles = KTiles::grouped(&rows, g).unwrap();
            assert_eq!(tiles.bytes() as u64, rows.bytes());
            let (mut want, mut got) = (vec![0f32; cols], vec![0f32; cols]);
            for r in 0..2 * g {
                assert_eq!(tiles.row(r), rows.row(r), "{kind:?} {g} row {r}");
                rows.dequantize_row(r, &mut want);
                tiles.dequantize_row(r, &mut got);
                assert_eq!(got, want, "{kind:?} {g} row {r}");
            }
            let odd_bytes = (g + 3) * 3 * kind.block_bytes();
            let odd = KRows::new(kind, &data[..odd_bytes], g + 3, cols).unwrap();
            assert!(KTiles::grouped(&odd, g).is_none());
        }
        assert_eq!(group_rows(2 * WIDE), if wide() { WIDE } else { NARROW });
        assert_eq!(group_rows(WIDE + NARROW), NARROW);
    }

    /// The VNNI kernels, 256-bit and 512-bit, sum the same integers as the AVX2 ones and scale
    /// them in the same order: the same products, bit for bit, for one activation row and a tile
    /// (checked where the CPU has AVX-512 VNNI).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vnni_tiles_equal_the_avx2_tiles() {
        if !crate::backend::cpu::isa::isa().avx512_vnni {
            eprintln!("vnni_tiles_equal_the_avx2_tiles: skipped, this CPU has no AVX-512 VNNI");
            return;
        }
        for kind in [KQuant::Q4K, KQuant::Q6K] {
            let (n, cols) = (2 * WIDE, 3 * QK_K);
            let data = random_rows(kind, n, cols, 5);
            let rows = KRows::new(kind, &data, n, cols).unwrap();
            let (narrow, wide) = (
                KTiles::grouped(&rows, NARROW).unwrap(),
                KTiles::grouped(&rows, WIDE).unwrap(),
            );
            let acts = KActivations::quantize(&values(TILE * cols, 13), cols);
            let xs: [k_quant_dot::KRow<'_>; TILE] = std::array::from_fn(|k| acts.row(k));
            for group in 0..n / WIDE {
                let g = wide.group(group);
                // SAFETY: this CPU has AVX-512 VNNI (checked above), and with it AVX2.
                #[allow(unsafe_code)]
                let (tile, one) = unsafe {
                    match kind {
                        KQuant::Q4K => (q4k_wide(g, &xs), q4k_wide(g, &[xs[1]])),
                        KQuant::Q6K => (q6k_wide(g, &xs), q6k_wide(g, &[xs[1]])),
                    }
                };
                assert!(tile.iter().flatten().any(|&v| v != 0.0));
                for half in 0..2 {
                    let g = narrow.group(2 * group + half);
                    // SAFETY: as above.
                    #[allow(unsafe_code)]
                    let (avx2, vnni, avx2_one, vnni_one) = unsafe {
                        match kind {
                            KQuant::Q4K => (
                                q4k_avx2(g, &xs),
                                q4k_vnni(g, &xs),
                                q4k_avx2(g, &[xs[1]]),
                                q4k_vnni(g, &[xs[1]]),
                            ),
                            KQuant::Q6K => (
                                q6k_avx2(g, &xs),
                                q6k_vnni(g, &xs),
                                q6k_avx2(g, &[xs[1]]),
                                q6k_vnni(g, &[xs[1]]),
                            ),
                        }
                    };
                    assert_eq!(avx2, vnni, "{kind:?} group {group}, a tile");
                    assert_eq!(avx2_one, vnni_one, "{kind:?} group {group}, one row");
                    let lanes = NARROW * half..NARROW * (half + 1);
                    for t in 0..TILE {
                        assert_eq!(
                            avx2[t][..NARROW],
                            tile[t][lanes.clone()],
                            "{kind:?} {group}.{half}, row {t}"
                        );
                    }
                    assert_eq!(avx2_one[0][..NARROW], one[0][lanes], "{kind:?} {group}.{half}, one row");
                }
            }
        }
    }

    /// Every path's products of any span of rows are each row's product, in both formats and
    /// layouts, for activation counts off the tile size and spans that start, end and cross
    /// inside groups.
    #[test]
    fn products_are_every_row_s_product() {
        for (kind, cols) in [
            (KQuant::Q4K, QK_K),
            (KQuant::Q4K, 5 * QK_K),
            (KQuant::Q6K, QK_K),
            (KQuant::Q6K, 3 * QK_K),
        ] {
            let n = 3 * WIDE;
            let data = random_rows(kind, n, cols, 3);
            let rows = KRows::new(kind, &data, n, cols).unwrap();
            for g in [NARROW, WIDE] {
                let tiles = KTiles::grouped(&rows, g).unwrap();
                for m in [1, TILE + 3, 9] {
                    let acts = KActivations::quantize(&values(m * cols, 11), cols);
                    for (row, count) in [(0, n), (g + 3, 7), (n - 1, 1), (2, 4), (WIDE - 2, 5)] {
                        // In two calls, the first ending off the tile size.
                        let mut got = vec![0f32; count * m];
                        for part in [0..m / 2, m / 2..m] {
                            tiles.products(row, count, &acts, part.clone(), &mut got[part.start * count..], count);
                        }
                        for r in 0..count {
                            for i in 0..m {
                                let want = k_quant_dot::dot_portable(kind, rows.row(row + r), &acts.row(i));
                                let got = got[i * count + r];
                                assert!(
                                    (got - want).abs() <= 1e-4 * want.abs().max(1.0),
                                    "{kind:?} {cols} {g} m={m} ({i}, {}): {got} vs {want}",
                                    row + r
                                );
                            }
                        }
                        let portable = tiles.tile_portable(row / g, &acts, 0, 1);
                        let want = k_quant_dot::dot_portable(kind, rows.row(row), &acts.row(0));
                        assert_eq!(portable[0][row % g], want, "{kind:?} portable {cols} {g}");
                    }
                }
            }
        }
    }

    /// A kernel called directly on one group and `T` activation rows.
    #[cfg(target_arch = "x86_64")]
    type Kernel<const T: usize> = unsafe fn(&[u8], &[k_quant_dot::KRow<'_>; T]) -> [[f32; WIDE]; T];

    /// Each kernel this CPU runs for `rows`' format, named, with `rows` in its groups.
    #[cfg(target_arch = "x86_64")]
    fn kernels_here<const T: usize>(rows: &KRows) -> Vec<(&'static str, KTiles, Kernel<T>)> {
        let isa = crate::backend::cpu::isa::isa();
        let all: [(&str, bool, usize, Kernel<T>, Kernel<T>); 3] = [
            ("AVX2, 8 rows", isa.avx2_fma, NARROW, q4k_avx2::<T>, q6k_avx2::<T>),
            (
                "256-bit VNNI, 8 rows",
                isa.avx512_vnni,
                NARROW,
                q4k_vnni::<T>,
                q6k_vnni::<T>,
            ),
            (
                "512-bit VNNI, 16 rows",
                isa.avx512_vnni,
                WIDE,
                q4k_wide::<T>,
                q6k_wide::<T>,
            ),
        ];
        all.into_iter()
            .filter(|k| k.1)
            .map(|(name, _, g, q4k, q6k)| {
                let kernel = if rows.kind() == KQuant::Q4K { q4k } else { q6k };
                (name, KTiles::grouped(rows, g).unwrap(), kernel)
            })
            .collect()
    }

    /// `cargo test --release -p kvlens-engine --lib k_quant_tiles_prefill_bench -- --ignored
    /// --nocapture`: a prefill's products (2048 × 2048 weights, 128 activation rows, one thread)
    /// by each kernel this CPU runs, called directly, then the fastest through
    /// [`KTiles::products`] (a group at a time, as a prefill calls it), alternated; GMAC/s, the
    /// median of 9.
    #[cfg(target_arch = "x86_64")]
    #[test]
    #[ignore]
    #[allow(unsafe_code)]
    fn k_quant_tiles_prefill_bench() {
        let (n, cols, m) = (2048, 2048, 128);
        let acts = KActivations::quantize(&values(m * cols, 17), cols);
        for kind in [KQuant::Q4K, KQuant::Q6K] {
            let data = random_rows(kind, n, cols, 9);
            let runs = kernels_here::<TILE>(&KRows::new(kind, &data, n, cols).unwrap());
            let mut out = vec![0f32; n * m];
            let rates = crate::backend::cpu::kernel_bench::alternated_medians(
                runs.len() + 1,
                9,
                (n * cols * m) as f64 / 1e9,
                |i| {
                    let Some((_, tiles, kernel)) = runs.get(i) else {
                        // The fastest kernel's layout through the path a prefill takes, each group's
                        // products after the previous group's.
                        let tiles = &runs[runs.len() - 1].1;
                        let g = tiles.group_rows;
                        for group in 0..n / g {
                            tiles.products(group * g, g, &acts, 0..m, &mut out[group * g * m..], g);
                        }
                        return;
                    };
                    let mut sink = 0f32;
                    for group in 0..n / tiles.group_rows {
                        for first in (0..m).step_by(TILE) {
                            let xs = std::array::from_fn(|t| acts.row(first + t));
                            // SAFETY: only the kernels of this CPU's instructions are run.
                            sink += unsafe { kernel(tiles.group(group), &xs) }[0][0];
                        }
                    }
                    std::hint::black_box(sink);
                },
            );
            let names = runs.iter().map(|r| r.0).chain(["the last through KTiles::products"]);
            for (name, rate) in names.zip(rates) {
                eprintln!("{kind:?}, {name}: {rate:.1} GMAC/s");
            }
        }
    }

    /// `cargo test --release -p kvlens-engine --lib k_quant_tiles_decode_bench -- --ignored
    /// --nocapture`: a decode's products (one activation row) by each kernel this CPU runs, one
    /// thread, over 256 rows of 2048 that stay in the caches, alternated: the GB/s of weights
    /// each kernel can take (the median of 15), to set beside a thread's share of the memory's
    /// read rate (`kvlens bench bandwidth`): below it, a decode is bound by the kernel.
    #[cfg(target_arch = "x86_64")]
    #[test]
    #[ignore]
    #[allow(unsafe_code)]
    fn k_quant_tiles_decode_bench() {
        let (n, cols) = (256, 2048);
        let acts = KActivations::quantize(&values(cols, 17), cols);
        for kind in [KQuant::Q4K, KQuant::Q6K] {
            let data = random_rows(kind, n, cols, 9);
            let runs = kernels_here::<1>(&KRows::new(kind, &data, n, cols).unwrap());
            let reps = (256 << 20) / data.len() + 1;
            let rates = crate::backend::cpu::kernel_bench::alternated_medians(
                runs.len(),
                15,
                (data.len() * reps) as f64 / 1e9,
                |i| {
                    let (_, tiles, kernel) = &runs[i];
                    let mut sink = 0f32;
                    for _ in 0..reps {
                        for group in 0..n / tiles.group_rows {
                            // SAFETY: only the kernels of this CPU's instructions are run.
                            sink += unsafe { kernel(tiles.group(group), &[acts.row(0)]) }[0][0];
                        }
                    }
                    std::hint::black_box(sink);
                },
            );
            for ((name, _, _), rate) in runs.iter().zip(rates) {
                eprintln!("{kind:?}, {name}: {rate:.1} GB/s");
            }
        }
    }
}
