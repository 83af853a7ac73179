//! `q4_K` and `q6_K` matrices stored for integer tiles on AVX2 CPUs ([`available`]): groups of 8
//! weight rows interleaved so that one 256-bit register holds the same four quant bytes of all 8
//! rows (as llama.cpp repacks `q4_K` eight rows at a time for its AVX2 GEMV and GEMM), multiplied
//! by each activation row's four matching bytes broadcast. Every i32 lane sums a whole 32-value
//! piece of one (weight row, activation row) pair, and the scaling is done in f32 once per 8
//! products instead of once per lane group of one product.
//!
//! The interleaving is done once, at load, into as many bytes as the file's. Per super-block of
//! a `q4_K` group: the 8 rows' `d` and `dmin`, their sub-blocks' 6-bit scales (one byte each, the
//! top two bits holding the minimum's top two), the minimums' low nibbles, and the quants in runs
//! of four bytes. Per super-block of a `q6_K` group: the 8 rows' `d`, their 16 scales, then the
//! low nibbles' and the high bit pairs' bytes in runs of four. A decode, a batch of decodes and
//! a prefill read the weights as one stream.
//!
//! On CPUs with AVX-512 VNNI the same 256-bit kernels sum each run with `vpdpbusd` ([`q4k_vnni`],
//! [`q6k_vnni`]): the same integers, fewer instructions (on the 2-core Zen 4 EPYC, a `Q4_K_M` decode
//! 1.04–1.05× and a 519-token prefill 1.13× the AVX2 kernels', alternated).

use super::isa::fastest;
use super::k_quant_dot::{self, scale_min_bytes, KActivations, KQuant, KRows};
use super::packed::tiles_of;
use std::ops::Range;

/// Weight rows in one group: one i32 lane per row of a 256-bit register.
pub const GROUP_ROWS: usize = 8;

/// Activation rows one kernel call takes: they share each unpacked register of weights.
const TILE: usize = 4;

/// Where each part of a `q4_K` group's super-block starts: 8 f16 `d`, 8 f16 `dmin`, 64 scale
/// bytes `[sub-block][row]`, 32 bytes of minimums' low nibbles `[sub-block % 4][row]` (sub-blocks
/// 0–3 low, 4–7 high: each half lines up with 32 of the scale bytes), then 1024 bytes of quants
/// `[32-byte chunk][run of 4][row]`.
const D: usize = 0;
const DMIN: usize = 16;
const SCALES: usize = 32;
const MIN_LOW: usize = 96;
const QUANTS: usize = 128;

/// Where each part of a `q6_K` group's super-block starts: 8 f16 `d`, 128 i8 scales
/// `[sub-block of 16][row]`, then 1536 bytes of quants `[half][run of 4 values][part][row]`, a
/// run's three parts being the low nibbles' bytes `4·run..` and `32 + 4·run..` of the half's 64
/// and the high bit pairs' bytes `4·run..` of its 32: a decode reads them in order.
const Q6_D: usize = 0;
const Q6_SCALES: usize = 16;
const Q6_QUANTS: usize = 144;

/// The parts of a super-block that move as runs: `(bytes into the file's block, start in the
/// group's block, bytes per run, runs, stride)`; run `i` of row `lane` goes to `start + stride · i
/// + bytes · lane`. (`q4_K`'s packed scales and minimums are rearranged apart.)
fn runs(kind: KQuant) -> &'static [(usize, usize, usize, usize, usize)] {
    match kind {
        KQuant::Q4K => &[(0, D, 2, 1, 0), (2, DMIN, 2, 1, 0), (16, QUANTS, 4, 32, 32)],
        KQuant::Q6K => &[
            (208, Q6_D, 2, 1, 0),
            (192, Q6_SCALES, 1, 16, 8),
            (0, Q6_QUANTS, 4, 8, 96),
            (32, Q6_QUANTS + 32, 4, 8, 96),
            (128, Q6_QUANTS + 64, 4, 8, 96),
            (64, Q6_QUANTS + 768, 4, 8, 96),
            (96, Q6_QUANTS + 768 + 32, 4, 8, 96),
            (160, Q6_QUANTS + 768 + 64, 4, 8, 96),
        ],
    }
}

/// Products of one group with up to [`TILE`] activation rows, `[activation row][weight row]`.
type Sums = [[f32; GROUP_ROWS]; TILE];

/// Whether this CPU multiplies `q4_K` and `q6_K` by tiles: with AVX2, AVX-512 CPUs included. On
/// the 2-core Xeon (AVX-512 VNNI) these AVX2 tiles prefilled a `Q4_K_M` file at 71 tokens/s
/// against 45 by the bfloat16 GEMM over dequantized rows, and decoded within 4 % of the AVX-512
/// VNNI row products (docs/PERFORMANCE-HISTORY.md).
pub fn available() -> bool {
    super::isa::isa().avx2_fma
}

/// A `q4_K` or `q6_K` matrix in groups of [`GROUP_ROWS`] rows (see the module's description).
#[derive(Debug)]
pub struct KTiles {
    kind: KQuant,
    blocks_per_row: usize,
    data: Vec<u8>,
}

impl KTiles {
    /// `rows` interleaved, or None when they are not whole groups.
    pub fn from_rows(rows: &KRows) -> Option<Self> {
        let (kind, n) = (rows.kind(), rows.rows());
        if n == 0 || !n.is_multiple_of(GROUP_ROWS) {
            return None;
        }
        let bytes = kind.block_bytes();
        let nb = rows.row(0).len() / bytes;
        let mut data = vec![0u8; n * nb * bytes];
        for row in 0..n {
            let (group, lane) = (row / GROUP_ROWS, row % GROUP_ROWS);
            for (b, src) in rows.row(row).chunks_exact(bytes).enumerate() {
                let dst = &mut data[(group * nb + b) * GROUP_ROWS * bytes..][..GROUP_ROWS * bytes];
                for &(from, start, len, count, stride) in runs(kind) {
                    for i in 0..count {
                        dst[start + stride * i + len * lane..][..len].copy_from_slice(&src[from + len * i..][..len]);
                    }
                }
                if kind == KQuant::Q4K {
                    let sm = scale_min_bytes(&src[4..16]);
                    for sub in 0..8 {
                        let (scale, min) = (sm[sub], sm[8 + sub]);
                        dst[SCALES + 8 * sub + lane] = scale | (min >> 4) << 6;
                        dst[MIN_LOW + 8 * (sub % 4) + lane] |= (min & 0x0F) << (4 * (sub / 4));
                    }
                }
            }
        }
        Some(KTiles {
            kind,
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
        GROUP_ROWS * self.kind.block_bytes()
    }

    /// Group `group`'s super-blocks.
    fn group(&self, group: usize) -> &[u8] {
        let len = self.blocks_per_row * self.group_block();
        &self.data[group * len..][..len]
    }

    /// Row `row`'s super-blocks as the file stores them.
    fn row(&self, row: usize) -> Vec<u8> {
        let (lane, bytes) = (row % GROUP_ROWS, self.kind.block_bytes());
        let mut out = vec![0u8; self.blocks_per_row * bytes];
        for (src, dst) in self
            .group(row / GROUP_ROWS)
            .chunks_exact(self.group_block())
            .zip(out.chunks_exact_mut(bytes))
        {
            for &(to, start, len, count, stride) in runs(self.kind) {
                for i in 0..count {
                    dst[to + len * i..][..len].copy_from_slice(&src[start + stride * i + len * lane..][..len]);
                }
            }
            if self.kind == KQuant::Q4K {
                let (mut scale, mut min) = ([0u8; 8], [0u8; 8]);
                for sub in 0..8 {
                    let packed = src[SCALES + 8 * sub + lane];
                    let low = (src[MIN_LOW + 8 * (sub % 4) + lane] >> (4 * (sub / 4))) & 0x0F;
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
    /// (activation row `i`, weight row `row + r`) into `out[i · stride + r]`.
    pub fn products(
        &self,
        row: usize,
        n: usize,
        acts: &KActivations,
        rows: Range<usize>,
        out: &mut [f32],
        stride: usize,
    ) {
        let mut r = row;
        while r < row + n {
            let (group, lane) = (r / GROUP_ROWS, r % GROUP_ROWS);
            let take = (GROUP_ROWS - lane).min(row + n - r);
            for (first, t) in tiles_of(rows.clone(), TILE) {
                let sums = self.tile(group, acts, first, t);
                for (k, sums) in sums.iter().enumerate().take(t) {
                    out[(first + k) * stride + r - row..][..take].copy_from_slice(&sums[lane..lane + take]);
                }
            }
            r += take;
        }
    }

    /// Group `group`'s products with activation rows `first..first + t` (`t` is 1 or [`TILE`]).
    fn tile(&self, group: usize, acts: &KActivations, first: usize, t: usize) -> Sums {
        #[cfg(target_arch = "x86_64")]
        let data = self.group(group);
        #[cfg(target_arch = "x86_64")]
        let rows = |k: usize| acts.row(first + k);
        #[cfg(target_arch = "x86_64")]
        let one = |sums: [[f32; GROUP_ROWS]; 1]| -> Sums {
            std::array::from_fn(|k| if k == 0 { sums[0] } else { [0.0; GROUP_ROWS] })
        };
        fastest!(
            avx512_vnni => match (self.kind, t == TILE) {
                (KQuant::Q4K, true) => q4k_vnni::<TILE>(data, &std::array::from_fn(rows)),
                (KQuant::Q4K, false) => one(q4k_vnni::<1>(data, &[rows(0)])),
                (KQuant::Q6K, true) => q6k_vnni::<TILE>(data, &std::array::from_fn(rows)),
                (KQuant::Q6K, false) => one(q6k_vnni::<1>(data, &[rows(0)])),
            },
            avx2_fma => match (self.kind, t == TILE) {
                (KQuant::Q4K, true) => q4k_avx2::<TILE>(data, &std::array::from_fn(rows)),
                (KQuant::Q4K, false) => one(q4k_avx2::<1>(data, &[rows(0)])),
                (KQuant::Q6K, true) => q6k_avx2::<TILE>(data, &std::array::from_fn(rows)),
                (KQuant::Q6K, false) => one(q6k_avx2::<1>(data, &[rows(0)])),
            },
            _ => self.tile_portable(group, acts, first, t),
        )
    }

    /// [`Self::tile`] row by row, un-interleaved, in portable code.
    fn tile_portable(&self, group: usize, acts: &KActivations, first: usize, t: usize) -> Sums {
        let mut sums = [[0f32; GROUP_ROWS]; TILE];
        for lane in 0..GROUP_ROWS {
            let row = self.row(group * GROUP_ROWS + lane);
            for (k, sums) in sums.iter_mut().enumerate().take(t) {
                sums[lane] = k_quant_dot::dot_portable(self.kind, &row, &acts.row(first + k));
            }
        }
        sums
    }
}

/// The products of one group's super-blocks (`data`) with the activation rows `xs`: per
/// sub-block and run of four weight bytes, one `vpmaddubsw` per activation row against its four
/// matching bytes broadcast, summed in i16 pairs (each at most 8 · 2 · 15 · 128 = 30,720 over
/// the sub-block's eight runs) and widened by one `vpmaddwd`; per sub-block each row's sums
/// scaled by `d · scale · d_x`. The minimums' terms `dmin Σ min · d_x Σ q_x` are taken per
/// super-block: its 64 six-bit minimums unpacked in two registers, each row's eight sums of 32
/// `d_x Σ q_x` in one. A chunk's 32 bytes hold two sub-blocks (low and high nibbles); the second
/// is read from the first level cache.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn q4k_avx2<const T: usize>(data: &[u8], xs: &[k_quant_dot::KRow<'_>; T]) -> [[f32; GROUP_ROWS]; T] {
    // SAFETY: compiled for AVX2, FMA and F16C, which the caller's CPU has.
    #[allow(unsafe_code)]
    unsafe {
        q4k_tiles::<false, T>(data, xs)
    }
}

/// [`q4k_avx2`] with `vpdpbusd` (AVX-512 VNNI on 256-bit registers) in place of each run's
/// `vpmaddubsw` and `vpaddw` and each sub-block's `vpmaddwd`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn q4k_vnni<const T: usize>(data: &[u8], xs: &[k_quant_dot::KRow<'_>; T]) -> [[f32; GROUP_ROWS]; T] {
    // SAFETY: compiled for AVX-512 VNNI and AVX2, which the caller's CPU has.
    #[allow(unsafe_code)]
    unsafe {
        q4k_tiles::<true, T>(data, xs)
    }
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(unsafe_code, unsafe_op_in_unsafe_fn)]
unsafe fn q4k_tiles<const VNNI: bool, const T: usize>(
    data: &[u8],
    xs: &[k_quant_dot::KRow<'_>; T],
) -> [[f32; GROUP_ROWS]; T] {
    use crate::arch::ggml::QK_K;
    use std::arch::x86_64::*;
    const GROUP_BLOCK: usize = GROUP_ROWS * k_quant_dot::Q4K_BYTES;
    // The reads below stay inside the lengths this checks.
    let nb = super_blocks(data, GROUP_BLOCK, xs);
    let (ones, low) = (_mm256_set1_epi16(1), _mm256_set1_epi8(0x0F));
    let (six_bits, top_two) = (_mm256_set1_epi8(0x3F), _mm256_set1_epi8(0x30));
    // The 8 bytes of sub-block `sub` (of 4) of a register of `[sub-block][row]` bytes, widened.
    let widen = |v: __m256i, sub: usize| {
        let half = if sub < 2 {
            _mm256_castsi256_si128(v)
        } else {
            _mm256_extracti128_si256::<1>(v)
        };
        let bytes = if sub % 2 == 1 {
            _mm_unpackhi_epi64(half, half)
        } else {
            half
        };
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes))
    };
    // Sums of 16 in sub-block order `[0, 1, 4, 5, 2, 3, 6, 7]` after `vhaddps`, put back.
    let order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
    let mut acc = [_mm256_setzero_ps(); T];
    for b in 0..nb {
        // SAFETY: every read below is inside super-block `b` of the group (asserted above) or
        // inside the activation rows' lengths (asserted above); a prefetch never faults.
        unsafe {
            let block = data.as_ptr().add(b * GROUP_BLOCK);
            super::packed::prefetch_past(block, GROUP_BLOCK);
            let d = _mm256_cvtph_ps(_mm_loadu_si128(block.add(D) as *const __m128i));
            let dmin = _mm256_cvtph_ps(_mm_loadu_si128(block.add(DMIN) as *const __m128i));
            // Scale bytes of sub-blocks 0–3 and 4–7 (their top two bits the minimums' top two),
            // and the minimums in the same order.
            let packed = [
                _mm256_loadu_si256(block.add(SCALES) as *const __m256i),
                _mm256_loadu_si256(block.add(SCALES + 32) as *const __m256i),
            ];
            let lows = _mm256_loadu_si256(block.add(MIN_LOW) as *const __m256i);
            let lows = [lows, _mm256_srli_epi16(lows, 4)];
            let mins: [__m256i; 2] = std::array::from_fn(|h| {
                _mm256_or_si256(
                    _mm256_and_si256(lows[h], low),
                    _mm256_and_si256(_mm256_srli_epi16(packed[h], 2), top_two),
                )
            });
            let scales = packed.map(|p| _mm256_and_si256(p, six_bits));
            // Each row's `d_x Σ q_x` per sub-block, to broadcast from.
            let xsums: [[f32; 8]; T] = std::array::from_fn(|t| {
                let sums = xs[t].sums.as_ptr().add(16 * b);
                let pairs = _mm256_hadd_ps(_mm256_loadu_ps(sums), _mm256_loadu_ps(sums.add(8)));
                let mut out = [0f32; 8];
                _mm256_storeu_ps(out.as_mut_ptr(), _mm256_permutevar8x32_ps(pairs, order));
                out
            });
            let mut offsets = [_mm256_setzero_ps(); T];
            // Sub-block `2 · chunk + high` (a constant `high`, so that no branch is left in the
            // runs' loop).
            macro_rules! sub_block {
                ($chunk:expr, $high:expr) => {{
                    let (chunk, high) = ($chunk, $high);
                    let sub = 2 * chunk + high as usize;
                    let mut pairs = [_mm256_setzero_si256(); T];
                    for run in 0..8 {
                        let v = _mm256_loadu_si256(block.add(QUANTS + 256 * chunk + 32 * run) as *const __m256i);
                        let w = if high {
                            _mm256_and_si256(_mm256_srli_epi16(v, 4), low)
                        } else {
                            _mm256_and_si256(v, low)
                        };
                        for (pairs, x) in pairs.iter_mut().zip(xs) {
                            let at = b * QK_K + 32 * sub + 4 * run;
                            let word = _mm256_set1_epi32((x.quants.as_ptr().add(at) as *const i32).read_unaligned());
                            *pairs = if VNNI {
                                _mm256_dpbusd_epi32(*pairs, w, word)
                            } else {
                                _mm256_add_epi16(*pairs, _mm256_maddubs_epi16(w, word))
                            };
                        }
                    }
                    let scale = _mm256_mul_ps(d, widen(scales[sub / 4], sub % 4));
                    let min = widen(mins[sub / 4], sub % 4);
                    let rows = acc
                        .iter_mut()
                        .zip(offsets.iter_mut())
                        .zip(pairs)
                        .zip(xs.iter().zip(&xsums));
                    for (((acc, offsets), pairs), (x, xsums)) in rows {
                        let sum = _mm256_cvtepi32_ps(if VNNI {
                            pairs
                        } else {
                            _mm256_madd_epi16(pairs, ones)
                        });
                        let dx = _mm256_set1_ps(x.scales[8 * b + sub]);
                        *acc = _mm256_fmadd_ps(sum, _mm256_mul_ps(scale, dx), *acc);
                        *offsets = _mm256_fmadd_ps(min, _mm256_set1_ps(xsums[sub]), *offsets);
                    }
                }};
            }
            for chunk in 0..4 {
                sub_block!(chunk, false);
                sub_block!(chunk, true);
            }
            for (acc, offsets) in acc.iter_mut().zip(offsets) {
                *acc = _mm256_fnmadd_ps(dmin, offsets, *acc);
            }
        }
    }
    std::array::from_fn(|t| {
        let mut out = [0f32; GROUP_ROWS];
        // SAFETY: 8 floats.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), acc[t]) };
        out
    })
}

/// The super-blocks in a group's `data` of `group_block` bytes each; panics unless `data` is
/// whole super-blocks and every activation row of `xs` holds as many super-blocks' values,
/// scales and sums (the SIMD kernels read within those lengths).
#[cfg(target_arch = "x86_64")]
fn super_blocks(data: &[u8], group_block: usize, xs: &[k_quant_dot::KRow<'_>]) -> usize {
    use crate::arch::ggml::QK_K;
    let nb = data.len() / group_block;
    assert_eq!(data.len(), nb * group_block);
    for x in xs {
        assert!(x.quants.len() >= nb * QK_K && x.scales.len() >= 8 * nb && x.sums.len() >= 16 * nb);
    }
    nb
}

/// [`q4k_avx2`] for `q6_K`: per 32 values (piece `c` of half `h` of the super-block: values
/// `128h + 32c..`, their low four bits in the low (`c` < 2) or high nibbles of the half's bytes
/// `32(c % 2)..`, their top two at bit `2c` of its high bit pairs), one `vpmaddubsw` per run of
/// four weight bytes (the 6-bit quants, 0–63) and activation row, two runs summed in i16 (at
/// most 2 · 2 · 63 · 128 = 32,256) and widened by a `vpmaddwd` with the runs' sub-block
/// scales, so the i32 lanes hold the piece's `Σ scale · q_w q_x`, scaled once by `d · d_x`.
/// GGML's `q6_K` values are `q_w − 32`: the 32s' term `32 · d Σ scale · d_x Σ q_x` is summed
/// apart per sub-block of 16 and subtracted at the end.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn q6k_avx2<const T: usize>(data: &[u8], xs: &[k_quant_dot::KRow<'_>; T]) -> [[f32; GROUP_ROWS]; T] {
    // SAFETY: compiled for AVX2, FMA and F16C, which the caller's CPU has.
    #[allow(unsafe_code)]
    unsafe {
        q6k_tiles::<false, T>(data, xs)
    }
}

/// [`q6k_avx2`] with `vpdpbusd` (AVX-512 VNNI on 256-bit registers): two runs summed in i32 and
/// multiplied by their sub-block's scales with `vpmulld`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn q6k_vnni<const T: usize>(data: &[u8], xs: &[k_quant_dot::KRow<'_>; T]) -> [[f32; GROUP_ROWS]; T] {
    // SAFETY: compiled for AVX-512 VNNI and AVX2, which the caller's CPU has.
    #[allow(unsafe_code)]
    unsafe {
        q6k_tiles::<true, T>(data, xs)
    }
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(unsafe_code, unsafe_op_in_unsafe_fn)]
unsafe fn q6k_tiles<const VNNI: bool, const T: usize>(
    data: &[u8],
    xs: &[k_quant_dot::KRow<'_>; T],
) -> [[f32; GROUP_ROWS]; T] {
    use crate::arch::ggml::QK_K;
    use std::arch::x86_64::*;
    const GROUP_BLOCK: usize = GROUP_ROWS * k_quant_dot::Q6K_BYTES;
    // The reads below stay inside the lengths this checks.
    let nb = super_blocks(data, GROUP_BLOCK, xs);
    let (low, high) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x30));
    let mut acc = [_mm256_setzero_ps(); T];
    let mut offsets = [_mm256_setzero_ps(); T];
    for b in 0..nb {
        // SAFETY: every read below is inside super-block `b` of the group (asserted above) or
        // inside the activation rows' lengths (asserted above); a prefetch never faults.
        unsafe {
            let block = data.as_ptr().add(b * GROUP_BLOCK);
            super::packed::prefetch_past(block, GROUP_BLOCK);
            let d = _mm256_cvtph_ps(_mm_loadu_si128(block.add(Q6_D) as *const __m128i));
            let scales = |sub: usize| _mm_loadl_epi64(block.add(Q6_SCALES + 8 * sub) as *const __m128i);
            for sub in 0..16 {
                let scale = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(scales(sub))));
                for (offsets, x) in offsets.iter_mut().zip(xs) {
                    *offsets = _mm256_fmadd_ps(scale, _mm256_set1_ps(x.sums[16 * b + sub]), *offsets);
                }
            }
            // Run `run` of half `h`: its low nibbles' two registers and its high bit pairs'.
            let run_parts = |h: usize, run: usize| {
                let at = |part: usize| {
                    _mm256_loadu_si256(block.add(Q6_QUANTS + 768 * h + 96 * run + 32 * part) as *const __m256i)
                };
                (at(0), at(1), at(2))
            };
            // The 6-bit quants of piece `c` (a constant, so that the shifts are) from a run's parts.
            macro_rules! quants {
                ($parts:expr, $c:literal) => {{
                    let (a, b, bits) = $parts;
                    let (nibbles, bits) = match $c {
                        0 => (a, _mm256_slli_epi16(bits, 4)),
                        1 => (b, _mm256_slli_epi16(bits, 2)),
                        2 => (_mm256_srli_epi16(a, 4), bits),
                        _ => (_mm256_srli_epi16(b, 4), _mm256_srli_epi16(bits, 2)),
                    };
                    _mm256_or_si256(_mm256_and_si256(nibbles, low), _mm256_and_si256(bits, high))
                }};
            }
            // Two runs' products of four weight bytes with four activation bytes: i16 pairs
            // (`vpmaddubsw`), or i32 lanes with VNNI (`vpdpbusd`).
            let accumulate = |sums: __m256i, w: __m256i, x: __m256i| {
                if VNNI {
                    _mm256_dpbusd_epi32(sums, w, x)
                } else {
                    _mm256_add_epi16(sums, _mm256_maddubs_epi16(w, x))
                }
            };
            // Those sums times each row's scale of sub-block `sub`, as i32 lanes.
            let scaled = |sums: __m256i, sub: usize| {
                if VNNI {
                    _mm256_mullo_epi32(sums, _mm256_cvtepi8_epi32(scales(sub)))
                } else {
                    _mm256_madd_epi16(sums, _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(scales(sub), scales(sub))))
                }
            };
            let word = |x: &k_quant_dot::KRow<'_>, at: usize| {
                _mm256_set1_epi32((x.quants.as_ptr().add(b * QK_K + at) as *const i32).read_unaligned())
            };
            if T == 1 {
                // One activation row: each run's parts are read once, in memory order, and make
                // all four pieces' quants.
                let x = &xs[0];
                for h in 0..2 {
                    let mut sums = [_mm256_setzero_si256(); 4];
                    for pair in 0..4 {
                        let mut pairs = [_mm256_setzero_si256(); 4];
                        for run in 2 * pair..2 * pair + 2 {
                            let parts = run_parts(h, run);
                            let w = [
                                quants!(parts, 0),
                                quants!(parts, 1),
                                quants!(parts, 2),
                                quants!(parts, 3),
                            ];
                            for (c, (pairs, w)) in pairs.iter_mut().zip(w).enumerate() {
                                let xw = word(x, 128 * h + 32 * c + 4 * run);
                                *pairs = accumulate(*pairs, w, xw);
                            }
                        }
                        for (c, (sums, pairs)) in sums.iter_mut().zip(pairs).enumerate() {
                            *sums = _mm256_add_epi32(*sums, scaled(pairs, 8 * h + 2 * c + pair / 2));
                        }
                    }
                    for (c, sums) in sums.into_iter().enumerate() {
                        let dx = _mm256_set1_ps(x.scales[8 * b + 4 * h + c]);
                        acc[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(d, dx), acc[0]);
                    }
                }
            } else {
                // A tile of rows: one piece at a time, so that each row's sums stay in registers
                // (the parts come from the first level cache again for each piece).
                macro_rules! piece {
                    ($h:expr, $c:literal) => {{
                        let (h, c) = ($h, $c);
                        let mut sums = [_mm256_setzero_si256(); T];
                        for pair in 0..4 {
                            let sub = 8 * h + 2 * c + pair / 2;
                            let mut pairs = [_mm256_setzero_si256(); T];
                            for run in 2 * pair..2 * pair + 2 {
                                let w = quants!(run_parts(h, run), $c);
                                for (pairs, x) in pairs.iter_mut().zip(xs) {
                                    let xw = word(x, 128 * h + 32 * c + 4 * run);
                                    *pairs = accumulate(*pairs, w, xw);
                                }
                            }
                            for (sums, pairs) in sums.iter_mut().zip(pairs) {
                                *sums = _mm256_add_epi32(*sums, scaled(pairs, sub));
                            }
                        }
                        for ((acc, sums), x) in acc.iter_mut().zip(sums).zip(xs) {
                            let dx = _mm256_set1_ps(x.scales[8 * b + 4 * h + c]);
                            *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(d, dx), *acc);
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
    }
    std::array::from_fn(|t| {
        let mut out = [0f32; GROUP_ROWS];
        // SAFETY: 8 floats.
        unsafe {
            _mm256_storeu_ps(
                out.as_mut_ptr(),
                _mm256_fnmadd_ps(_mm256_set1_ps(32.0), offsets[t], acc[t]),
            )
        };
        out
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::blocks::tests::values;
    use crate::arch::ggml::QK_K;
    use crate::backend::cpu::k_quant_dot::tests::random_rows;

    /// Interleaving keeps every byte: each row comes back as the file stores it, in as many bytes,
    /// in both formats; rows not in whole groups are refused.
    #[test]
    fn tiles_hold_the_rows_bytes() {
        let cols = 3 * QK_K;
        for kind in [KQuant::Q4K, KQuant::Q6K] {
            let data = random_rows(kind, 2 * GROUP_ROWS, cols, 7);
            let rows = KRows::new(kind, &data, 2 * GROUP_ROWS, cols).unwrap();
            let tiles = KTiles::from_rows(&rows).unwrap();
            assert_eq!(tiles.bytes() as u64, rows.bytes());
            let (mut want, mut got) = (vec![0f32; cols], vec![0f32; cols]);
            for r in 0..2 * GROUP_ROWS {
                assert_eq!(tiles.row(r), rows.row(r), "{kind:?} row {r}");
                rows.dequantize_row(r, &mut want);
                tiles.dequantize_row(r, &mut got);
                assert_eq!(got, want, "{kind:?} row {r}");
            }
            let odd_bytes = (GROUP_ROWS + 3) * 3 * kind.block_bytes();
            let odd = KRows::new(kind, &data[..odd_bytes], GROUP_ROWS + 3, cols).unwrap();
            assert!(KTiles::from_rows(&odd).is_none());
        }
    }

    /// The VNNI kernels sum the same integers as the AVX2 ones: the same products, bit for bit,
    /// for one activation row and a tile (checked where the CPU has AVX-512 VNNI).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vnni_tiles_equal_the_avx2_tiles() {
        if !crate::backend::cpu::isa::isa().avx512_vnni {
            return;
        }
        for kind in [KQuant::Q4K, KQuant::Q6K] {
            let (n, cols) = (2 * GROUP_ROWS, 3 * QK_K);
            let data = random_rows(kind, n, cols, 5);
            let tiles = KTiles::from_rows(&KRows::new(kind, &data, n, cols).unwrap()).unwrap();
            let acts = KActivations::quantize(&values(TILE * cols, 13), cols);
            let xs: [k_quant_dot::KRow<'_>; TILE] = std::array::from_fn(|k| acts.row(k));
            for group in 0..n / GROUP_ROWS {
                let g = tiles.group(group);
                // SAFETY: this CPU has AVX-512 VNNI (checked above), and with it AVX2.
                #[allow(unsafe_code)]
                let (avx2, vnni, one) = unsafe {
                    match kind {
                        KQuant::Q4K => (
                            q4k_avx2(g, &xs),
                            q4k_vnni(g, &xs),
                            (q4k_avx2(g, &[xs[1]]), q4k_vnni(g, &[xs[1]])),
                        ),
                        KQuant::Q6K => (
                            q6k_avx2(g, &xs),
                            q6k_vnni(g, &xs),
                            (q6k_avx2(g, &[xs[1]]), q6k_vnni(g, &[xs[1]])),
                        ),
                    }
                };
                assert_eq!(avx2, vnni, "{kind:?} group {group}, a tile");
                assert_eq!(one.0, one.1, "{kind:?} group {group}, one row");
                assert!(avx2.iter().flatten().any(|&v| v != 0.0));
            }
        }
    }

    /// Every path's products of any span of rows are each row's product, in both formats, for
    /// activation counts off the tile size and spans that start, end and cross inside groups.
    #[test]
    fn products_are_every_row_s_product() {
        for (kind, cols) in [
            (KQuant::Q4K, QK_K),
            (KQuant::Q4K, 5 * QK_K),
            (KQuant::Q6K, QK_K),
            (KQuant::Q6K, 3 * QK_K),
        ] {
            let n = 3 * GROUP_ROWS;
            let data = random_rows(kind, n, cols, 3);
            let rows = KRows::new(kind, &data, n, cols).unwrap();
            let tiles = KTiles::from_rows(&rows).unwrap();
            for m in [1, TILE + 3, 9] {
                let acts = KActivations::quantize(&values(m * cols, 11), cols);
                for (row, count) in [(0, n), (GROUP_ROWS + 3, 7), (n - 1, 1), (2, 4)] {
                    // In two calls, the first ending off the tile size.
                    let mut got = vec![0f32; count * m];
                    for part in [0..m / 2, m / 2..m] {
                        tiles.products(row, count, &acts, part, &mut got, count);
                    }
                    for r in 0..count {
                        for i in 0..m {
                            let want = k_quant_dot::dot_portable(kind, rows.row(row + r), &acts.row(i));
                            let g = got[i * count + r];
                            assert!(
                                (g - want).abs() <= 1e-4 * want.abs().max(1.0),
                                "{kind:?} {cols} m={m} ({i}, {}): {g} vs {want}",
                                row + r
                            );
                        }
                    }
                    let portable = tiles.tile_portable(row / GROUP_ROWS, &acts, 0, 1);
                    let want = k_quant_dot::dot_portable(kind, rows.row(row), &acts.row(0));
                    assert_eq!(portable[0][row % GROUP_ROWS], want, "{kind:?} portable {cols}");
                }
            }
        }
    }
}
