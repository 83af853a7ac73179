//! The products of GGML's block formats ([`crate::arch::blocks`]) with activations on the CPU.
//!
//! Products quantize the activations once per call, as GGML does (`q8_0`, but with an f32 scale),
//! and sum `Σ_b d_w · (d_x · Σ q_w q_x − offset · d_x · Σ q_x)` per row: integer dot products with
//! AVX-512 VNNI where the CPU has it (64 weights per instruction), else AVX2 (32 per
//! instruction pair), else NEON, else wasm's `simd128` in the tab ([`super::wasm_dot`]), else a
//! portable loop. These are the products of matrices stored row by row; [`super::block_tiles`]
//! holds those stored for integer tiles, which reuse these quantized activations.

use super::isa::fastest;
use super::packed::prefetch_ahead;
use crate::arch::blocks::{quantize_q8, BlockKind, BlockRows, BLOCK};
use crate::parallel::map_ranges;
use half::f16;

/// Blocks whose scales one step of the vectorised product reads (one 512-bit register of f32).
const SCALE_GROUP: usize = 16;

/// `y` rounded to the nearest integer, ties to even, for |y| < 2²²: adding 1.5 · 2²³ leaves no
/// fraction bits (infinities and NaN pass through, as `f32::round` leaves them). Plain float
/// arithmetic, so a block of them vectorises where `roundf` is a libm call per value on baseline
/// x86_64.
#[inline(always)]
pub(super) fn round_small_to_even(y: f32) -> f32 {
    (y + SHIFTER) - SHIFTER
}

/// 1.5 · 2²³: a float below 2²² plus it holds its value rounded (ties to even) in its low bits.
const SHIFTER: f32 = 12_582_912.0;

/// [`quantize_q8`] with [`round_small_to_even`], the activations' rounding, in a form the
/// compiler vectorises: the largest magnitude as an integer maximum of the values' bits (for
/// finite non-negative floats the same order) and each value's integer read from the bits of
/// `y + 1.5 · 2²³`. Blocks the shortcut does not cover (a NaN or an infinity among the values, or
/// a scale so small that its inverse overflows) take [`quantize_q8`] itself: the same results.
#[inline(always)]
pub(super) fn quantize_q8_to_even(values: &[f32], out: &mut [i8]) -> f32 {
    const LANES: usize = 8;
    let mut lanes = [0u32; LANES];
    let chunks = values.chunks_exact(LANES);
    let tail = chunks
        .remainder()
        .iter()
        .fold(0, |m, v| m.max(v.to_bits() & 0x7fff_ffff));
    for c in chunks {
        for l in 0..LANES {
            lanes[l] = lanes[l].max(c[l].to_bits() & 0x7fff_ffff);
        }
    }
    let amax = lanes.iter().fold(tail, |m, &b| m.max(b));
    let d = f32::from_bits(amax) / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    if amax >= f32::INFINITY.to_bits() || !id.is_finite() {
        return quantize_q8(values, out, round_small_to_even);
    }
    // |v · id| ≤ 127 (to a rounding), so each integer fits an i8 and the bits' difference is it.
    for (q, &v) in out.iter_mut().zip(values) {
        *q = ((v * id + SHIFTER).to_bits() as i32 - SHIFTER.to_bits() as i32) as i8;
    }
    d
}

/// `out[i] = x_{first + i} · row` for `row` of `w` and rows `x` of `acts` (quantized for `w`'s
/// format); `cold`: the first row of a run (see [`prefetch_ahead`]).
pub fn dot_row(w: &BlockRows, row: usize, acts: &Activations, first: usize, cold: bool, out: &mut [f32]) {
    debug_assert_eq!(acts.kind, w.kind());
    let (nb, qb) = (w.blocks_per_row(), w.kind().quant_bytes());
    prefetch_ahead(w.scales(), row * nb..(row + 1) * nb, cold);
    prefetch_ahead(w.quants(), row * nb * qb..(row + 1) * nb * qb, cold);
    let (scales, quants) = (w.row_scales(row), w.row_quants(row));
    for (i, o) in out.iter_mut().enumerate() {
        *o = dot_fastest(w.kind(), scales, quants, &acts.row(first + i));
    }
}

/// Activation rows per task where a prefill's activations are quantized over the pool (the
/// calling thread alone took 2 % of a 519-token `Q4_0` prefill, the pool's other thread idle).
pub(super) const QUANTIZE_ROWS: usize = 16;

/// Activation rows quantized for one product, padded to whole groups of [`SCALE_GROUP`] blocks
/// (zeros): per block the scale `d_x`, the correction `offset · d_x · Σ q_x`, and the i8 values,
/// in the order the vectorised product reads them (for `q4_0`, per pair of blocks A, B:
/// `A[0..16] B[0..16] A[16..32] B[16..32]`, the order its nibbles unpack in).
#[derive(Debug)]
pub struct Activations {
    kind: BlockKind,
    padded_blocks: usize,
    scales: Vec<f32>,
    corrections: Vec<f32>,
    quants: Vec<i8>,
    /// The values in i16, block by block in natural order, each 16's even-indexed first
    /// (`wasm_dot::even_odd`): what wasm's products take.
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    wide: Vec<i16>,
}

/// One quantized activation row.
pub(super) struct ActRow<'a> {
    pub scales: &'a [f32],
    pub corrections: &'a [f32],
    pub quants: &'a [i8],
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    pub wide: &'a [i16],
}

impl Activations {
    /// The block format these activations were quantized for.
    pub fn kind(&self) -> BlockKind {
        self.kind
    }

    /// Quantizes the rows of `x` (`cols`, a multiple of 32, per row) for a `kind` matrix; a
    /// prefill's rows in pieces over the pool.
    pub fn quantize(kind: BlockKind, x: &[f32], cols: usize) -> Self {
        let m = x.len().checked_div(cols).unwrap_or(0);
        if m < 2 * QUANTIZE_ROWS {
            return Self::quantize_rows(kind, x, cols);
        }
        let pieces = map_ranges(m, QUANTIZE_ROWS, |r| {
            Self::quantize_rows(kind, &x[r.start * cols..r.end * cols], cols)
        });
        Activations {
            kind,
            padded_blocks: pieces[0].padded_blocks,
            scales: pieces.iter().map(|p| &p.scales[..]).collect::<Vec<_>>().concat(),
            corrections: pieces.iter().map(|p| &p.corrections[..]).collect::<Vec<_>>().concat(),
            quants: pieces.iter().map(|p| &p.quants[..]).collect::<Vec<_>>().concat(),
            #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
            wide: pieces.iter().map(|p| &p.wide[..]).collect::<Vec<_>>().concat(),
        }
    }

    /// [`Self::quantize`] on the calling thread.
    fn quantize_rows(kind: BlockKind, x: &[f32], cols: usize) -> Self {
        fastest!(avx2_fma => Self::quantize_rows_avx2(kind, x, cols), _ => Self::quantize_rows_portable(kind, x, cols))
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    fn quantize_rows_avx2(kind: BlockKind, x: &[f32], cols: usize) -> Self {
        Self::quantize_rows_portable(kind, x, cols)
    }

    #[inline(always)]
    fn quantize_rows_portable(kind: BlockKind, x: &[f32], cols: usize) -> Self {
        let nb = cols / BLOCK;
        let padded_blocks = nb.div_ceil(SCALE_GROUP) * SCALE_GROUP;
        let m = x.len() / cols;
        let mut acts = Activations {
            kind,
            padded_blocks,
            scales: vec![0.0; m * padded_blocks],
            corrections: vec![0.0; m * padded_blocks],
            quants: vec![0; m * padded_blocks * BLOCK],
            #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
            wide: vec![0; m * padded_blocks * BLOCK],
        };
        let mut q = [0i8; BLOCK];
        for (i, row) in x.chunks_exact(cols).enumerate() {
            for (b, block) in row.chunks_exact(BLOCK).enumerate() {
                let d = quantize_q8_to_even(block, &mut q);
                let sum: i32 = q.iter().map(|&v| v as i32).sum();
                let at = i * padded_blocks + b;
                acts.scales[at] = d;
                acts.corrections[at] = kind.offset() * d * sum as f32;
                let base = at * BLOCK;
                #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
                for (w, v) in acts.wide[base..base + BLOCK]
                    .iter_mut()
                    .zip(super::wasm_dot::even_odd(&q))
                {
                    *w = v;
                }
                match kind {
                    BlockKind::Q8_0 => acts.quants[base..base + BLOCK].copy_from_slice(&q),
                    BlockKind::Q4_0 => {
                        let pair = i * padded_blocks * BLOCK + (b / 2) * 2 * BLOCK;
                        let half = (b % 2) * BLOCK / 2;
                        acts.quants[pair + half..][..BLOCK / 2].copy_from_slice(&q[..BLOCK / 2]);
                        acts.quants[pair + BLOCK + half..][..BLOCK / 2].copy_from_slice(&q[BLOCK / 2..]);
                    }
                }
            }
        }
        acts
    }

    /// Activation row `i`.
    pub(super) fn row(&self, i: usize) -> ActRow<'_> {
        let (s, n) = (i * self.padded_blocks, self.padded_blocks);
        ActRow {
            scales: &self.scales[s..s + n],
            corrections: &self.corrections[s..s + n],
            quants: &self.quants[s * BLOCK..(s + n) * BLOCK],
            #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
            wide: &self.wide[s * BLOCK..(s + n) * BLOCK],
        }
    }
}

/// The dot product of one weight row (`scales`, `quants`) with one activation row, in portable
/// code.
#[inline(always)]
pub(super) fn dot_portable(kind: BlockKind, scales: &[u16], quants: &[u8], x: &ActRow<'_>) -> f32 {
    let mut sum = 0f32;
    for (b, &d) in scales.iter().enumerate() {
        let isum: i32 = match kind {
            BlockKind::Q8_0 => quants[b * BLOCK..][..BLOCK]
                .iter()
                .zip(&x.quants[b * BLOCK..][..BLOCK])
                .map(|(&w, &x)| w as i32 * x as i32)
                .sum(),
            BlockKind::Q4_0 => {
                let pair = &x.quants[(b / 2) * 2 * BLOCK..][..2 * BLOCK];
                let half = (b % 2) * BLOCK / 2;
                let (lo, hi) = (&pair[half..][..BLOCK / 2], &pair[BLOCK + half..][..BLOCK / 2]);
                quants[b * BLOCK / 2..][..BLOCK / 2]
                    .iter()
                    .zip(lo.iter().zip(hi))
                    .map(|(&w, (&l, &h))| (w & 0x0F) as i32 * l as i32 + (w >> 4) as i32 * h as i32)
                    .sum()
            }
        };
        sum += f16::from_bits(d).to_f32() * (x.scales[b] * isum as f32 - x.corrections[b]);
    }
    sum
}

/// The product with AVX2 (no VNNI): per pair of `q4_0` blocks, or per `q8_0` block, 32 byte
/// products summed in pairs by `vpmaddubsw` (unsigned times signed, saturating at ±32,767) and in
/// fours by `vpmaddwd`, then scaled per block in f32. `q4_0`'s nibbles (0..=15) stay unsigned;
/// `q8_0`'s stored quants are flipped back to signed and multiplied as `|w| · (x · sign w)`, as
/// GGML's AVX2 code does, so a pair sums at most 2 · 128 · 127 and cannot saturate. (An activation
/// quant of −128, which only a block of values below about 4e−37 gets, times a negative weight
/// wraps to the wrong sign; that block's product is below 1e−32.) `q8_0` then needs no
/// correction. Scales are widened eight at a time with F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(unsafe_code)]
fn dot_avx2<const Q4: bool>(scales: &[u16], quants: &[u8], x: &ActRow<'_>) -> f32 {
    use std::arch::x86_64::*;
    /// Blocks whose scales one step widens (one 256-bit register of f32).
    const GROUP: usize = 8;
    let nb = scales.len();
    let qb = if Q4 { BLOCK / 2 } else { BLOCK };
    // The reads below stay inside these lengths (the activations are padded to whole groups).
    assert!(quants.len() == nb * qb && x.scales.len() >= nb.div_ceil(SCALE_GROUP) * SCALE_GROUP);
    assert!(x.corrections.len() == x.scales.len() && x.quants.len() == x.scales.len() * BLOCK);
    let ones = _mm256_set1_epi16(1);
    let low_nibbles = _mm256_set1_epi8(0x0F);
    let flip = _mm256_set1_epi8(i8::MIN);
    // Which of the group's scales each lane takes: per pair of `q4_0` blocks (lanes 0–3 the
    // first, 4–7 the second), per `q8_0` block (all lanes).
    let pair_scale: [__m256i; GROUP / 2] = std::array::from_fn(|p| {
        let two = 2 * p as i32;
        _mm256_setr_epi32(two, two, two, two, two + 1, two + 1, two + 1, two + 1)
    });
    let block_scale: [__m256i; GROUP] = std::array::from_fn(|k| _mm256_set1_epi32(k as i32));
    let mut acc = [_mm256_setzero_ps(); 2];
    let mut corr = _mm256_setzero_ps();
    let mut g = 0;
    while g < nb {
        let n = (nb - g).min(GROUP);
        let mut tail = [0u16; GROUP];
        let dw_bits: &[u16] = if n == GROUP {
            &scales[g..g + GROUP]
        } else {
            tail[..n].copy_from_slice(&scales[g..]);
            &tail
        };
        // SAFETY: eight scales in `dw_bits`; the activations hold whole groups of 16 ≥ 8 blocks.
        let (dw, dx) = unsafe {
            (
                _mm256_cvtph_ps(_mm_loadu_si128(dw_bits.as_ptr() as *const __m128i)),
                _mm256_loadu_ps(x.scales.as_ptr().add(g)),
            )
        };
        let s = _mm256_mul_ps(dw, dx);
        if Q4 {
            // SAFETY: as for the scales.
            let cx = unsafe { _mm256_loadu_ps(x.corrections.as_ptr().add(g)) };
            corr = _mm256_fmadd_ps(dw, cx, corr);
            for p in 0..n.div_ceil(2) {
                let b = g + 2 * p;
                // SAFETY: a pair's second block is read only when it exists; the activations hold
                // whole pairs (64 values from `b`).
                let (lo, hi, xl, xh) = unsafe {
                    let at = quants.as_ptr().add(b * qb) as *const __m128i;
                    let v = if b + 1 < nb {
                        _mm256_loadu_si256(at as *const __m256i)
                    } else {
                        _mm256_zextsi128_si256(_mm_loadu_si128(at))
                    };
                    let xq = x.quants.as_ptr().add(b * BLOCK) as *const __m256i;
                    (
                        _mm256_and_si256(v, low_nibbles),
                        _mm256_and_si256(_mm256_srli_epi16(v, 4), low_nibbles),
                        _mm256_loadu_si256(xq),
                        _mm256_loadu_si256(xq.add(1)),
                    )
                };
                // Each i16 sums at most 4 · 15 · 128: no saturation. Lanes 0–3 hold block b,
                // 4–7 block b + 1.
                let pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh));
                let sums = _mm256_madd_epi16(pairs, ones);
                let scale = _mm256_permutevar8x32_ps(s, pair_scale[p]);
                acc[p % 2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc[p % 2]);
            }
        } else {
            for k in 0..n {
                let b = g + k;
                // SAFETY: block `b` exists in both.
                let (w, xq) = unsafe {
                    (
                        _mm256_loadu_si256(quants.as_ptr().add(b * BLOCK) as *const __m256i),
                        _mm256_loadu_si256(x.quants.as_ptr().add(b * BLOCK) as *const __m256i),
                    )
                };
                let w = _mm256_xor_si256(w, flip);
                let pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xq, w));
                let sums = _mm256_madd_epi16(pairs, ones);
                let scale = _mm256_permutevar8x32_ps(s, block_scale[k]);
                acc[k % 2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc[k % 2]);
            }
        }
        g += GROUP;
    }
    let total = _mm256_sub_ps(_mm256_add_ps(acc[0], acc[1]), corr);
    let half = _mm_add_ps(_mm256_castps256_ps128(total), _mm256_extractf128_ps(total, 1));
    let quad = _mm_add_ps(half, _mm_movehl_ps(half, half));
    _mm_cvtss_f32(_mm_add_ss(quad, _mm_shuffle_ps(quad, quad, 1)))
}

/// The product with AVX-512 VNNI: per pair of blocks one 64-byte `vpdpbusd` (unsigned weights
/// times signed activations into 16 i32 sums, 8 per block, or for `q4_0` 4+4 per block in its
/// unpacking order), scaled per block in f32; the scales of 16 blocks are widened at once and the
/// corrections summed apart. Whole groups of 16 blocks run unmasked; the last, partial group is
/// read with masked loads.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[allow(unsafe_code)]
fn dot_vnni<const Q4: bool>(scales: &[u16], quants: &[u8], x: &ActRow<'_>) -> f32 {
    use std::arch::x86_64::*;
    let nb = scales.len();
    let qb = if Q4 { BLOCK / 2 } else { BLOCK };
    // The reads below stay inside these lengths.
    assert!(quants.len() == nb * qb && x.scales.len() >= nb.div_ceil(SCALE_GROUP) * SCALE_GROUP);
    assert!(x.corrections.len() == x.scales.len() && x.quants.len() == x.scales.len() * BLOCK);
    // Which block of a pair each i32 sum belongs to.
    let lanes = if Q4 {
        _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1)
    } else {
        _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1)
    };
    let pair_scale: [__m512i; SCALE_GROUP / 2] =
        std::array::from_fn(|p| _mm512_add_epi32(lanes, _mm512_set1_epi32(2 * p as i32)));
    let low_nibbles = _mm256_set1_epi8(0x0F);
    let mut acc = [_mm512_setzero_ps(); 2];
    let mut corr = _mm512_setzero_ps();
    // One group of `n` blocks from block `g`; `full` groups are read without masks.
    let mut group = |g: usize, n: usize, full: bool| {
        let group_mask = if full { !0 } else { ((1u32 << n) - 1) as __mmask16 };
        // SAFETY: masked to the `n` scales left; the activations are padded to whole groups.
        let (dw, dx, cx) = unsafe {
            (
                _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(
                    group_mask,
                    scales.as_ptr().add(g) as *const i16,
                )),
                _mm512_loadu_ps(x.scales.as_ptr().add(g)),
                _mm512_loadu_ps(x.corrections.as_ptr().add(g)),
            )
        };
        let s = _mm512_mul_ps(dw, dx);
        corr = _mm512_fmadd_ps(dw, cx, corr);
        for (p, idx) in pair_scale.iter().enumerate().take(n.div_ceil(2)) {
            let b = g + 2 * p;
            let both = full || b + 1 < nb;
            // SAFETY: a pair's second block is read only when it exists (masked otherwise); the
            // activations hold whole pairs.
            let (w, xq) = unsafe {
                let at = quants.as_ptr().add(b * qb) as *const i8;
                let w = if Q4 {
                    let v = if both {
                        _mm256_loadu_si256(at as *const _)
                    } else {
                        _mm256_maskz_loadu_epi8(0xFFFF, at)
                    };
                    let lo = _mm256_and_si256(v, low_nibbles);
                    let hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low_nibbles);
                    _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1)
                } else if both {
                    _mm512_loadu_si512(at as *const _)
                } else {
                    _mm512_maskz_loadu_epi8(0xFFFF_FFFF, at)
                };
                (w, _mm512_loadu_si512(x.quants.as_ptr().add(b * BLOCK) as *const _))
            };
            let sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, xq);
            let scale = _mm512_permutexvar_ps(*idx, s);
            acc[p % 2] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), scale, acc[p % 2]);
        }
    };
    let mut g = 0;
    while g + SCALE_GROUP <= nb {
        group(g, SCALE_GROUP, true);
        g += SCALE_GROUP;
    }
    if g < nb {
        group(g, nb - g, false);
    }
    _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1])) - _mm512_reduce_add_ps(corr)
}

/// [`dot_portable`] with the widest instructions this CPU has.
fn dot_fastest(kind: BlockKind, scales: &[u16], quants: &[u8], x: &ActRow<'_>) -> f32 {
    fastest!(
        avx512_vnni => match kind {
            BlockKind::Q8_0 => dot_vnni::<false>(scales, quants, x),
            BlockKind::Q4_0 => dot_vnni::<true>(scales, quants, x),
        },
        avx2_fma => match kind {
            BlockKind::Q8_0 => dot_avx2::<false>(scales, quants, x),
            BlockKind::Q4_0 => dot_avx2::<true>(scales, quants, x),
        },
        @aarch64 {
            neon => match kind {
                BlockKind::Q8_0 => dot_neon::<false>(scales, quants, x),
                BlockKind::Q4_0 => dot_neon::<true>(scales, quants, x),
            },
        }
        _ => {
            #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
            return match kind {
                BlockKind::Q8_0 => super::wasm_dot::blocks::<false>(scales, quants, x),
                BlockKind::Q4_0 => super::wasm_dot::blocks::<true>(scales, quants, x),
            };
            #[allow(unreachable_code)]
            dot_portable(kind, scales, quants, x)
        },
    )
}

/// The product with NEON (every aarch64 CPU has it), per block: byte products widened to i16
/// (`smull`, at most 128 · 128) and summed in pairs into i32 lanes (`sadalp`). `q4_0`'s nibbles
/// (0..=15) go against the activations in their pair order, the offset taken off by the
/// correction; `q8_0`'s stored quants are flipped back to signed, so it needs no correction (as in
/// [`dot_avx2`]).
#[cfg(target_arch = "aarch64")]
#[target_feature(enable = "neon")]
#[allow(unsafe_code)]
fn dot_neon<const Q4: bool>(scales: &[u16], quants: &[u8], x: &ActRow<'_>) -> f32 {
    use std::arch::aarch64::*;
    /// `acc` plus the products of `a` and `b`'s 16 bytes, summed in pairs into the lanes.
    #[target_feature(enable = "neon")]
    #[inline]
    fn add_products(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
        let low = vmull_s8(vget_low_s8(a), vget_low_s8(b));
        vpadalq_s16(vpadalq_s16(acc, low), vmull_high_s8(a, b))
    }
    let nb = scales.len();
    let qb = if Q4 { BLOCK / 2 } else { BLOCK };
    // The reads below stay inside these lengths (the activations hold whole pairs of blocks).
    assert!(quants.len() == nb * qb && x.scales.len() >= nb.next_multiple_of(2));
    assert!(x.corrections.len() == x.scales.len() && x.quants.len() == x.scales.len() * BLOCK);
    let mut sum = 0f32;
    for (b, &d) in scales.iter().enumerate() {
        // SAFETY: `b * qb + qb <= quants.len()`; the activation reads end inside block `b`'s pair.
        let isum = unsafe {
            let w = quants.as_ptr().add(b * qb);
            let zero = vdupq_n_s32(0);
            if Q4 {
                let v = vld1q_u8(w);
                let lo = vreinterpretq_s8_u8(vandq_u8(v, vdupq_n_u8(0x0F)));
                let hi = vreinterpretq_s8_u8(vshrq_n_u8::<4>(v));
                let xs = x.quants.as_ptr().add((b / 2) * 2 * BLOCK + (b % 2) * BLOCK / 2);
                let lo = add_products(zero, lo, vld1q_s8(xs));
                vaddvq_s32(add_products(lo, hi, vld1q_s8(xs.add(BLOCK))))
            } else {
                let flip = vdupq_n_u8(0x80);
                let w0 = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(w), flip));
                let w1 = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(w.add(16)), flip));
                let xs = x.quants.as_ptr().add(b * BLOCK);
                let first = add_products(zero, w0, vld1q_s8(xs));
                vaddvq_s32(add_products(first, w1, vld1q_s8(xs.add(16))))
            }
        };
        let correction = if Q4 { x.corrections[b] } else { 0.0 };
        sum += f16::from_bits(d).to_f32() * (x.scales[b] * isum as f32 - correction);
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::blocks::tests::values;

    /// A prefill's activations, quantized in pieces over the pool, are each row's quantized alone.
    #[test]
    fn rows_quantized_in_pieces_are_each_row_s() {
        let (m, cols) = (3 * QUANTIZE_ROWS + 5, 3 * BLOCK);
        let x = values(m * cols, 5);
        for kind in [BlockKind::Q8_0, BlockKind::Q4_0] {
            let all = Activations::quantize(kind, &x, cols);
            for i in [0, QUANTIZE_ROWS, m - 1] {
                let (one, got) = (
                    Activations::quantize(kind, &x[i * cols..(i + 1) * cols], cols),
                    all.row(i),
                );
                let want = one.row(0);
                assert_eq!(
                    (got.scales, got.corrections, got.quants),
                    (want.scales, want.corrections, want.quants)
                );
            }
        }
    }

    /// The product by every path this CPU can run, named, whatever `KVLENS_CPU_ISA` asks for.
    #[allow(unsafe_code)]
    fn every_path(kind: BlockKind, s: &[u16], q: &[u8], row: &ActRow<'_>) -> Vec<(&'static str, f32)> {
        let mut got = vec![
            ("portable", dot_portable(kind, s, q, row)),
            ("fastest", dot_fastest(kind, s, q, row)),
        ];
        #[cfg(target_arch = "x86_64")]
        {
            /// One block format's product, compiled for some instruction set.
            type Dot = unsafe fn(&[u16], &[u8], &ActRow<'_>) -> f32;
            let found = super::super::isa::detected();
            let paths: [(&str, bool, Dot, Dot); 2] = [
                ("avx2", found.avx2_fma, dot_avx2::<false>, dot_avx2::<true>),
                ("avx512-vnni", found.avx512_vnni, dot_vnni::<false>, dot_vnni::<true>),
            ];
            for (name, _, q8, q4) in paths.into_iter().filter(|p| p.1) {
                let dot = if kind == BlockKind::Q4_0 { q4 } else { q8 };
                // SAFETY: the CPU has the instructions the function was compiled for.
                got.push((name, unsafe { dot(s, q, row) }));
            }
        }
        #[cfg(target_arch = "aarch64")]
        if super::super::isa::detected().neon {
            let dot = if kind == BlockKind::Q4_0 {
                dot_neon::<true>
            } else {
                dot_neon::<false>
            };
            // SAFETY: the CPU has NEON.
            got.push(("neon", unsafe { dot(s, q, row) }));
        }
        got
    }

    /// `q8_0` quants of −128 and 127 (GGML's files may hold −128, though its quantizer never
    /// writes one) against full-scale activations of either sign: no path saturates or flips a
    /// sign.
    #[test]
    fn extreme_q8_0_quants() {
        let cols = 64;
        let mut data = Vec::new();
        for quant in [i8::MIN, i8::MAX] {
            data.extend(f16::from_f32(0.01).to_bits().to_le_bytes());
            data.extend([quant as u8; BLOCK]);
        }
        let w = BlockRows::from_ggml(BlockKind::Q8_0, &data, cols).unwrap();
        let mut wide = vec![0f32; cols];
        w.dequantize_row(0, &mut wide);
        for sign in [1.0f32, -1.0] {
            let x = vec![sign; cols];
            let acts = Activations::quantize(BlockKind::Q8_0, &x, cols);
            let want: f32 = wide.iter().map(|w| w * sign).sum();
            for (name, got) in every_path(BlockKind::Q8_0, w.row_scales(0), w.row_quants(0), &acts.row(0)) {
                assert!((got - want).abs() <= 1e-3, "{name} {sign}: {got} vs {want}");
            }
        }
    }

    /// The activations' rounding is `round_ties_even` over the range the quantization gives it.
    #[test]
    fn activation_rounding_is_ties_to_even() {
        let steps = (-1040..=1040).map(|i| i as f32 / 8.0);
        let odd = (0..10_000).map(|i| ((i * 7919 % 20011) as f32 - 10005.0) / 78.7);
        for y in steps
            .chain(odd)
            .chain([127.000_01, -127.000_01, 0.499_999_97, -0.5, 2.5])
        {
            assert_eq!(round_small_to_even(y), y.round_ties_even(), "{y}");
        }
    }

    /// The vectorised activation quantization gives `quantize_q8`'s scale and values, bit for bit,
    /// on ordinary blocks and on those its shortcut hands back (NaN, infinities, tiny scales).
    #[test]
    fn vectorised_activation_quantization_is_quantize_q8() {
        let mut blocks: Vec<Vec<f32>> = (0..200).map(|i| values(BLOCK, i)).collect();
        let ramp: Vec<f32> = (0..BLOCK).map(|i| i as f32 - 15.5).collect();
        blocks.push(ramp.iter().map(|v| v * 127.0 / 15.5).collect()); // halves: ties
        blocks.push(vec![0.0; BLOCK]);
        blocks.push(vec![-0.0; BLOCK]);
        blocks.push(ramp.iter().map(|v| v * 1e-30).collect());
        blocks.push(ramp.iter().map(|v| v * 1e-42).collect()); // subnormal: an infinite inverse
        for special in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, f32::MAX, -f32::MAX] {
            let mut b = values(BLOCK, 9);
            b[5] = special;
            blocks.push(b);
        }
        for b in &blocks {
            let (mut fast, mut want) = ([0i8; BLOCK], [0i8; BLOCK]);
            let d = quantize_q8_to_even(b, &mut fast);
            let d_want = quantize_q8(b, &mut want, round_small_to_even);
            assert_eq!((d.to_bits(), fast), (d_want.to_bits(), want), "{b:?}");
        }
    }

    /// Every dot product this CPU can run gives the dequantized weights' product with the
    /// quantized activations, for rows whose block count is off the pair and the group size.
    #[test]
    fn dot_products_are_the_dequantized_products() {
        for kind in [BlockKind::Q8_0, BlockKind::Q4_0] {
            for cols in [32, 64, 96, 17 * 32, 35 * 32] {
                let w = BlockRows::quantize(kind, &values(3 * cols, 1), cols);
                let x = values(2 * cols, 7);
                let acts = Activations::quantize(kind, &x, cols);
                for i in 0..2 {
                    // The activations as the product sees them: each block's i8 values times d_x.
                    let mut xq = vec![0i8; cols];
                    let xd: Vec<f32> = x[i * cols..(i + 1) * cols]
                        .chunks_exact(BLOCK)
                        .zip(xq.chunks_exact_mut(BLOCK))
                        .flat_map(|(v, q)| {
                            let d = quantize_q8(v, q, round_small_to_even);
                            q.iter().map(move |&q| q as f32 * d).collect::<Vec<_>>()
                        })
                        .collect();
                    let row = acts.row(i);
                    let mut wide = vec![0f32; cols];
                    for r in 0..3 {
                        w.dequantize_row(r, &mut wide);
                        let want: f64 = wide.iter().zip(&xd).map(|(&a, &b)| a as f64 * b as f64).sum();
                        let (s, q) = (w.row_scales(r), w.row_quants(r));
                        for (name, g) in every_path(kind, s, q, &row) {
                            assert!((g as f64 - want).abs() <= 1e-4, "{kind:?} {cols} {name}: {g} vs {want}");
                        }
                    }
                }
            }
        }
    }
}
