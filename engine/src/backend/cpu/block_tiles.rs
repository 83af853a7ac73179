//! `q8_0`/`q4_0` matrices stored for integer tiles, on CPUs that have them ([`available`]): groups
//! of 16 weight rows interleaved so that one register holds the same four quant bytes of all 16
//! rows (as llama.cpp repacks these formats for its CPU GEMM), multiplied by each activation row's
//! four matching bytes broadcast. Every i32 lane sums a whole block of one (weight row, activation
//! row) pair, and the f32 scaling is done once per 16 products and block instead of once per
//! lane group of one product.
//!
//! The interleaving is done once, at load, into the same bytes as the row-by-row layout: a decode
//! (one activation row), a batch of decodes and a prefill all read the weights as one stream with
//! nothing repacked per call (repacking per call took 26 % of a 16-sequence decode step).

#[cfg(target_arch = "x86_64")]
use super::block_dot::ActRow;
use super::block_dot::{self, Activations};
use super::isa::fastest;
#[cfg(target_arch = "x86_64")]
use super::packed::prefetch_bytes;
use super::packed::tiles_of;
use crate::arch::blocks::{BlockKind, BlockRows, BLOCK};
use std::ops::Range;

/// Weight rows in one group: one i32 lane per row of a 512-bit register.
pub const TILE_ROWS: usize = 16;

/// Activation rows one kernel call takes: they share each unpacked register of weights.
const TILE: usize = 4;

/// Products of one group with up to [`TILE`] activation rows, `[activation row][weight row]`.
type Sums = [[f32; TILE_ROWS]; TILE];

/// Whether this CPU multiplies `q8_0`/`q4_0` by integer tiles: with AVX-512 VNNI or AVX2. (On the
/// AVX2 EPYC, `q8_0` prefill by tiles ran at 35.0/29.9/32.2 tokens/s against 31.8/30.0/31.0 by
/// the f32 GEMM, alternated, and its decode level; on an AVX-512 CPU the f32 GEMM was faster than
/// this AVX2 tile, but such a CPU has VNNI.)
pub fn available() -> bool {
    let isa = super::isa::isa();
    isa.avx512_vnni || isa.avx2_fma
}

/// A `q8_0`/`q4_0` matrix in groups of [`TILE_ROWS`] rows: per group and block, the 16 rows'
/// f16 scales, then the block's quants in runs of four bytes, each run holding the same four
/// bytes of the 16 rows.
#[derive(Debug)]
pub struct BlockTiles {
    kind: BlockKind,
    blocks_per_row: usize,
    scales: Vec<u16>,
    quants: Vec<u8>,
}

impl BlockTiles {
    /// `rows` interleaved, or None when its row count is not whole groups.
    pub fn from_rows(rows: &BlockRows) -> Option<Self> {
        let (kind, nb) = (rows.kind(), rows.blocks_per_row());
        let qb = kind.quant_bytes();
        let n = rows.scales().len().checked_div(nb)?;
        if n == 0 || !n.is_multiple_of(TILE_ROWS) {
            return None;
        }
        let mut scales = vec![0u16; n * nb];
        let mut quants = vec![0u8; n * nb * qb];
        for row in 0..n {
            let (group, lane) = (row / TILE_ROWS, row % TILE_ROWS);
            let (s, q) = (rows.row_scales(row), rows.row_quants(row));
            for b in 0..nb {
                let block = group * nb + b;
                scales[block * TILE_ROWS + lane] = s[b];
                for k in (0..qb).step_by(4) {
                    let at = (block * qb + k) * TILE_ROWS + 4 * lane;
                    quants[at..at + 4].copy_from_slice(&q[b * qb + k..][..4]);
                }
            }
        }
        Some(BlockTiles {
            kind,
            blocks_per_row: nb,
            scales,
            quants,
        })
    }

    /// The format.
    pub fn kind(&self) -> BlockKind {
        self.kind
    }

    /// Bytes of scales and quants (as many as row by row).
    pub fn bytes(&self) -> usize {
        self.scales.len() * 2 + self.quants.len()
    }

    /// Group `group`'s scales and quants.
    fn group(&self, group: usize) -> (&[u16], &[u8]) {
        let (nb, qb) = (self.blocks_per_row, self.kind.quant_bytes());
        (
            &self.scales[group * nb * TILE_ROWS..][..nb * TILE_ROWS],
            &self.quants[group * nb * qb * TILE_ROWS..][..nb * qb * TILE_ROWS],
        )
    }

    /// Row `row`'s scales and quants in [`BlockRows`]' layout.
    fn row(&self, row: usize) -> (Vec<u16>, Vec<u8>) {
        let (nb, qb) = (self.blocks_per_row, self.kind.quant_bytes());
        let (scales, quants) = self.group(row / TILE_ROWS);
        let lane = row % TILE_ROWS;
        let s = (0..nb).map(|b| scales[b * TILE_ROWS + lane]).collect();
        let mut q = vec![0u8; nb * qb];
        for (k, run) in q.chunks_exact_mut(4).enumerate() {
            run.copy_from_slice(&quants[k * 4 * TILE_ROWS + 4 * lane..][..4]);
        }
        (s, q)
    }

    /// Row `row`'s values in f32.
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        let qb = self.kind.quant_bytes();
        let (scales, quants) = self.row(row);
        for (b, out) in out[..scales.len() * BLOCK].chunks_exact_mut(BLOCK).enumerate() {
            self.kind.dequantize_block(scales[b], &quants[b * qb..][..qb], out);
        }
    }

    /// The products of weight rows `row..row + n` (inside one group) with activation rows `rows`
    /// of `acts`, that of (activation row `i`, weight row `row + r`) into
    /// `out[(i − rows.start) · stride + r]`.
    pub fn products(
        &self,
        row: usize,
        n: usize,
        acts: &Activations,
        rows: Range<usize>,
        out: &mut [f32],
        stride: usize,
    ) {
        debug_assert_eq!(acts.kind(), self.kind);
        let (group, lane) = (row / TILE_ROWS, row % TILE_ROWS);
        assert!(lane + n <= TILE_ROWS, "rows {row}..{} cross a group", row + n);
        for (first, t) in tiles_of(rows.clone(), TILE) {
            let sums = self.tile(group, acts, first, t);
            for (k, sums) in sums.iter().enumerate().take(t) {
                out[(first - rows.start + k) * stride..][..n].copy_from_slice(&sums[lane..lane + n]);
            }
        }
    }

    /// Group `group`'s products with activation rows `first..first + t` (`t` is 1 or [`TILE`]).
    fn tile(&self, group: usize, acts: &Activations, first: usize, t: usize) -> Sums {
        #[cfg(target_arch = "x86_64")]
        let (scales, quants) = self.group(group);
        // One activation row's sums as a tile's.
        #[cfg(target_arch = "x86_64")]
        let one = |sums: [[f32; TILE_ROWS]; 1]| -> Sums {
            std::array::from_fn(|k| if k == 0 { sums[0] } else { [0.0; TILE_ROWS] })
        };
        #[cfg(target_arch = "x86_64")]
        let q4 = self.kind == BlockKind::Q4_0;
        fastest!(
            avx512_vnni => match (q4, t == TILE) {
                (false, true) => tile_vnni::<false, TILE>(scales, quants, acts, first),
                (true, true) => tile_vnni::<true, TILE>(scales, quants, acts, first),
                (false, false) => one(tile_vnni::<false, 1>(scales, quants, acts, first)),
                (true, false) => one(tile_vnni::<true, 1>(scales, quants, acts, first)),
            },
            avx2_fma => match (q4, t == TILE) {
                (false, true) => tile_avx2::<false, TILE>(scales, quants, acts, first),
                (true, true) => tile_avx2::<true, TILE>(scales, quants, acts, first),
                (false, false) => one(tile_avx2::<false, 1>(scales, quants, acts, first)),
                (true, false) => one(tile_avx2::<true, 1>(scales, quants, acts, first)),
            },
            _ => self.tile_portable(group, acts, first, t),
        )
    }

    /// [`Self::tile`] row by row, un-interleaved, in portable code.
    fn tile_portable(&self, group: usize, acts: &Activations, first: usize, t: usize) -> Sums {
        let mut sums = [[0f32; TILE_ROWS]; TILE];
        for lane in 0..TILE_ROWS {
            let (s, q) = self.row(group * TILE_ROWS + lane);
            for (k, sums) in sums.iter_mut().enumerate().take(t) {
                sums[lane] = block_dot::dot_portable(self.kind, &s, &q, &acts.row(first + k));
            }
        }
        sums
    }
}

/// Asks the CPU to fetch the quants [`prefetch_bytes`] past the block of `bytes` at `quants`, and
/// the scales a proportional distance past the block's at `scales`: the groups of a matrix follow
/// one another, so this runs ahead through them as one stream per matrix (the hardware prefetcher
/// alone leaves the reads well below the memory's bandwidth; see [`prefetch_bytes`]). A hint,
/// with no effect on the results; the addresses may lie past the matrix, which a prefetch never
/// reads.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(unsafe_code)]
fn prefetch_block(quants: *const u8, bytes: usize, scales: *const u16) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
    if prefetch_bytes() == 0 {
        return;
    }
    super::packed::prefetch_past(quants, bytes);
    // 32 bytes of scales per block, against `bytes` of quants.
    let scales_ahead = (scales as *const u8).wrapping_add(prefetch_bytes() * 2 * TILE_ROWS / bytes);
    // SAFETY: a prefetch reads nothing the program sees and never faults.
    unsafe { _mm_prefetch::<_MM_HINT_T0>(scales_ahead as *const i8) };
}

/// The products of one group (`scales`, `quants`) with activation rows `first..first + T`: per
/// block and run of four weight bytes, one `vpdpbusd` per activation row (two for `q4_0`: its
/// low and high nibbles) against its four matching bytes broadcast; per block, each row's sums
/// scaled by `d_w · d_x` and its correction subtracted. For `q4_0` a run of four bytes holds
/// elements `4k..4k+4` (low nibbles) and `16+4k..16+4k+4` (high nibbles), which sit in the
/// activations' pair order (see [`Activations`]).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[allow(unsafe_code)]
fn tile_vnni<const Q4: bool, const T: usize>(
    scales: &[u16],
    quants: &[u8],
    acts: &Activations,
    first: usize,
) -> [[f32; TILE_ROWS]; T] {
    use std::arch::x86_64::*;
    let nb = scales.len() / TILE_ROWS;
    let qb = if Q4 { BLOCK / 2 } else { BLOCK };
    let xs: [ActRow<'_>; T] = std::array::from_fn(|t| acts.row(first + t));
    // The reads below stay inside these lengths.
    assert!(scales.len() == nb * TILE_ROWS && quants.len() == nb * qb * TILE_ROWS);
    for x in &xs {
        assert!(x.scales.len() >= nb && x.corrections.len() >= nb && x.quants.len() >= nb * BLOCK);
    }
    let low_nibbles = _mm512_set1_epi8(0x0F);
    let mut acc = [_mm512_setzero_ps(); T];
    let mut corr = [_mm512_setzero_ps(); T];
    // The four activation bytes at `at` of row `t`, in every lane.
    let word = |t: usize, at: usize| -> __m512i {
        // SAFETY: `at + 4` ≤ the row's quants (asserted above for every `at` used below).
        _mm512_set1_epi32(unsafe { (xs[t].quants.as_ptr().add(at) as *const i32).read_unaligned() })
    };
    for b in 0..nb {
        // SAFETY: block `b`'s 16 scales and `qb · 16` quant bytes are inside the group.
        let (dw, wq) = unsafe {
            (
                _mm512_cvtph_ps(_mm256_loadu_si256(scales.as_ptr().add(b * TILE_ROWS) as *const __m256i)),
                quants.as_ptr().add(b * qb * TILE_ROWS),
            )
        };
        prefetch_block(wq, qb * TILE_ROWS, scales[b * TILE_ROWS..].as_ptr());
        // Two sums per activation row, so that each chain of dependent `vpdpbusd`s is half the
        // block (a decode's one row was bound by their latency): `q4_0`'s low nibbles and its
        // high nibbles (kept in place, 16 times their value, the sum shifted back: one
        // instruction less per run), `q8_0`'s even and odd runs.
        let mut sums = [[_mm512_setzero_si512(); 2]; T];
        if Q4 {
            // The block's values in the activations' pair order: low halves, then high halves.
            let base = (b / 2) * 2 * BLOCK + (b % 2) * BLOCK / 2;
            for k in 0..4 {
                // SAFETY: run `k` of block `b`.
                let v = unsafe { _mm512_loadu_si512(wq.add(64 * k) as *const _) };
                let (lo, hi16) = (_mm512_and_si512(v, low_nibbles), _mm512_andnot_si512(low_nibbles, v));
                for (t, [lo_sum, hi_sum]) in sums.iter_mut().enumerate() {
                    *lo_sum = _mm512_dpbusd_epi32(*lo_sum, lo, word(t, base + 4 * k));
                    *hi_sum = _mm512_dpbusd_epi32(*hi_sum, hi16, word(t, base + BLOCK + 4 * k));
                }
            }
            for [lo_sum, hi_sum] in &mut sums {
                *lo_sum = _mm512_add_epi32(*lo_sum, _mm512_srai_epi32::<4>(*hi_sum));
            }
        } else {
            for k in 0..8 {
                // SAFETY: run `k` of block `b`.
                let v = unsafe { _mm512_loadu_si512(wq.add(64 * k) as *const _) };
                for (t, sums) in sums.iter_mut().enumerate() {
                    sums[k % 2] = _mm512_dpbusd_epi32(sums[k % 2], v, word(t, b * BLOCK + 4 * k));
                }
            }
            for [even, odd] in &mut sums {
                *even = _mm512_add_epi32(*even, *odd);
            }
        }
        for t in 0..T {
            let dx = _mm512_set1_ps(xs[t].scales[b]);
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[t][0]), _mm512_mul_ps(dw, dx), acc[t]);
            corr[t] = _mm512_fmadd_ps(dw, _mm512_set1_ps(xs[t].corrections[b]), corr[t]);
        }
    }
    std::array::from_fn(|t| {
        let mut out = [0f32; TILE_ROWS];
        // SAFETY: 16 floats.
        unsafe { _mm512_storeu_ps(out.as_mut_ptr(), _mm512_sub_ps(acc[t], corr[t])) };
        out
    })
}

/// [`tile_vnni`] with AVX2: eight rows per 256-bit register (each run of the group is two
/// registers), `vpmaddubsw` and `vpmaddwd` in place of `vpdpbusd`, and per block
/// `d_w · (d_x · sum − correction)` into one register per activation row and half (AVX2 has
/// sixteen). `q8_0`'s stored quants (i8 + 128) are flipped back to i8 and multiplied by the sign
/// trick of its row product (`|w|` times `x` with `w`'s sign), so no i16 pair can saturate and no
/// correction is left; each run's pairs are widened to i32 at once (two runs could exceed i16).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(unsafe_code)]
fn tile_avx2<const Q4: bool, const T: usize>(
    scales: &[u16],
    quants: &[u8],
    acts: &Activations,
    first: usize,
) -> [[f32; TILE_ROWS]; T] {
    use std::arch::x86_64::*;
    const HALF: usize = TILE_ROWS / 2;
    let nb = scales.len() / TILE_ROWS;
    let qb = if Q4 { BLOCK / 2 } else { BLOCK };
    let xs: [ActRow<'_>; T] = std::array::from_fn(|t| acts.row(first + t));
    // The reads below stay inside these lengths.
    assert!(scales.len() == nb * TILE_ROWS && quants.len() == nb * qb * TILE_ROWS);
    for x in &xs {
        assert!(x.scales.len() >= nb && x.corrections.len() >= nb && x.quants.len() >= nb * BLOCK);
    }
    let (ones, low_nibbles, flip) = (_mm256_set1_epi16(1), _mm256_set1_epi8(0x0F), _mm256_set1_epi8(-128));
    let word = |t: usize, at: usize| -> __m256i {
        // SAFETY: `at + 4` ≤ the row's quants (asserted above for every `at` used below).
        _mm256_set1_epi32(unsafe { (xs[t].quants.as_ptr().add(at) as *const i32).read_unaligned() })
    };
    // A decode (one activation row) takes both halves of each block in one pass, so every cache
    // line is used whole while the stream runs ahead; a tile of rows takes one half per pass,
    // which keeps its accumulators in registers (a second pass over data that left memory already
    // and sits in the caches: prefill is not bound by the reads).
    let halves = if T == 1 { 2 } else { 1 };
    let mut out = [[0f32; TILE_ROWS]; T];
    for pass in 0..2 / halves {
        let mut acc = [[_mm256_setzero_ps(); 2]; T];
        for b in 0..nb {
            if pass == 0 {
                // SAFETY: block `b`'s quants start inside the group.
                let wq = unsafe { quants.as_ptr().add(b * qb * TILE_ROWS) };
                prefetch_block(wq, qb * TILE_ROWS, scales[b * TILE_ROWS..].as_ptr());
            }
            let base = (b / 2) * 2 * BLOCK + (b % 2) * BLOCK / 2;
            for (j, h) in (pass * halves..(pass + 1) * halves).enumerate() {
                // SAFETY: this half's 8 scales of block `b` and its runs are inside the group.
                let (dw, wq) = unsafe {
                    (
                        _mm256_cvtph_ps(_mm_loadu_si128(
                            scales.as_ptr().add(b * TILE_ROWS + h * HALF) as *const __m128i
                        )),
                        quants.as_ptr().add(b * qb * TILE_ROWS + h * 32),
                    )
                };
                let mut sums = [_mm256_setzero_si256(); T];
                if Q4 {
                    // The block's products per pair of i16 lanes: each i16 sums at most 16 · 15 ·
                    // 128 = 30,720 over the block's four runs, so it neither saturates nor needs
                    // widening before the block ends.
                    let mut pairs = [_mm256_setzero_si256(); T];
                    for k in 0..4 {
                        // SAFETY: run `k` of block `b`, this half's 32 bytes.
                        let v = unsafe { _mm256_loadu_si256(wq.add(64 * k) as *const _) };
                        let lo = _mm256_and_si256(v, low_nibbles);
                        let hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low_nibbles);
                        for (t, pairs) in pairs.iter_mut().enumerate() {
                            *pairs = _mm256_add_epi16(
                                *pairs,
                                _mm256_add_epi16(
                                    _mm256_maddubs_epi16(lo, word(t, base + 4 * k)),
                                    _mm256_maddubs_epi16(hi, word(t, base + BLOCK + 4 * k)),
                                ),
                            );
                        }
                    }
                    for t in 0..T {
                        sums[t] = _mm256_madd_epi16(pairs[t], ones);
                    }
                } else {
                    for k in 0..8 {
                        // SAFETY: run `k` of block `b`, this half's 32 bytes.
                        let w = _mm256_xor_si256(unsafe { _mm256_loadu_si256(wq.add(64 * k) as *const _) }, flip);
                        let magnitudes = _mm256_abs_epi8(w);
                        for (t, sum) in sums.iter_mut().enumerate() {
                            let signed = _mm256_sign_epi8(word(t, b * BLOCK + 4 * k), w);
                            let pairs = _mm256_maddubs_epi16(magnitudes, signed);
                            *sum = _mm256_add_epi32(*sum, _mm256_madd_epi16(pairs, ones));
                        }
                    }
                }
                for t in 0..T {
                    let sum = _mm256_cvtepi32_ps(sums[t]);
                    let dx = _mm256_set1_ps(xs[t].scales[b]);
                    let scaled = if Q4 {
                        _mm256_fmsub_ps(sum, dx, _mm256_set1_ps(xs[t].corrections[b]))
                    } else {
                        _mm256_mul_ps(sum, dx)
                    };
                    acc[t][j] = _mm256_fmadd_ps(dw, scaled, acc[t][j]);
                }
            }
        }
        for (t, acc) in acc.iter().enumerate() {
            for (j, h) in (pass * halves..(pass + 1) * halves).enumerate() {
                // SAFETY: 8 floats into half `h` of the row's 16.
                unsafe { _mm256_storeu_ps(out[t].as_mut_ptr().add(h * HALF), acc[j]) };
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::blocks::tests::values;

    /// Interleaving keeps every value and byte count; rows not in whole groups are refused.
    #[test]
    fn tiles_hold_the_rows_values() {
        for kind in [BlockKind::Q8_0, BlockKind::Q4_0] {
            let cols = 17 * BLOCK;
            let rows = BlockRows::quantize(kind, &values(2 * TILE_ROWS * cols, 5), cols);
            let tiles = BlockTiles::from_rows(&rows).unwrap();
            assert_eq!(tiles.bytes(), rows.bytes());
            let (mut want, mut got) = (vec![0f32; cols], vec![0f32; cols]);
            for r in 0..2 * TILE_ROWS {
                rows.dequantize_row(r, &mut want);
                tiles.dequantize_row(r, &mut got);
                assert_eq!(got, want, "{kind:?} row {r}");
            }
            let odd = BlockRows::quantize(kind, &values((TILE_ROWS + 3) * cols, 5), cols);
            assert!(BlockTiles::from_rows(&odd).is_none());
        }
    }

    /// Every path's products of any span of a group's rows are each row's product, for activation
    /// counts off the tile size and rows off the pair and group sizes of the blocks.
    #[test]
    fn products_are_every_row_s_product() {
        for kind in [BlockKind::Q8_0, BlockKind::Q4_0] {
            for cols in [32, 17 * BLOCK] {
                let rows = BlockRows::quantize(kind, &values(2 * TILE_ROWS * cols, 3), cols);
                let tiles = BlockTiles::from_rows(&rows).unwrap();
                for m in [1, TILE + 3, 37] {
                    let acts = Activations::quantize(kind, &values(m * cols, 11), cols);
                    for (row, n) in [(0, TILE_ROWS), (TILE_ROWS + 3, 5), (2 * TILE_ROWS - 1, 1)] {
                        // In two calls, the first ending off the tile size.
                        let mut got = vec![0f32; n * m];
                        for rows in [0..m / 2, m / 2..m] {
                            tiles.products(row, n, &acts, rows.clone(), &mut got[rows.start * n..], n);
                        }
                        for r in 0..n {
                            let (s, q) = (rows.row_scales(row + r), rows.row_quants(row + r));
                            for i in 0..m {
                                let want = block_dot::dot_portable(kind, s, q, &acts.row(i));
                                let g = got[i * n + r];
                                assert!(
                                    (g - want).abs() <= 1e-4 * want.abs().max(1.0),
                                    "{kind:?} {cols} m={m} ({i}, {}): {g} vs {want}",
                                    row + r
                                );
                            }
                        }
                        let portable = tiles.tile_portable(row / TILE_ROWS, &acts, 0, 1);
                        let (s, q) = (rows.row_scales(row), rows.row_quants(row));
                        let want = block_dot::dot_portable(kind, s, q, &acts.row(0));
                        assert_eq!(portable[0][row % TILE_ROWS], want, "portable {kind:?} {cols}");
                    }
                }
            }
        }
    }

    /// `cargo test --release -p kvlens-engine --lib block_tiles_decode_bench -- --ignored
    /// --nocapture`: a decode's products (one activation row) by each kernel this CPU runs, one
    /// thread, over 256 rows of 2048 that stay in the caches: the GB/s of weights the kernel can
    /// take, the median of 15, against which a decode's share of the memory's read rate
    /// (`kvlens bench bandwidth` ÷ threads) says whether it is bound by the reads or the kernel.
    #[cfg(target_arch = "x86_64")]
    #[test]
    #[ignore]
    #[allow(unsafe_code)]
    fn block_tiles_decode_bench() {
        type Kernel = unsafe fn(&[u16], &[u8], &Activations, usize) -> [[f32; TILE_ROWS]; 1];
        let isa = crate::backend::cpu::isa::isa();
        let (n, cols) = (256, 2048);
        for kind in [BlockKind::Q4_0, BlockKind::Q8_0] {
            let tiles = BlockTiles::from_rows(&BlockRows::quantize(kind, &values(n * cols, 3), cols)).unwrap();
            let acts = Activations::quantize(kind, &values(cols, 11), cols);
            let q4 = kind == BlockKind::Q4_0;
            let kernels: [(&str, bool, Kernel); 2] = [
                (
                    "AVX2",
                    isa.avx2_fma,
                    if q4 {
                        tile_avx2::<true, 1>
                    } else {
                        tile_avx2::<false, 1>
                    },
                ),
                (
                    "AVX-512 VNNI",
                    isa.avx512_vnni,
                    if q4 {
                        tile_vnni::<true, 1>
                    } else {
                        tile_vnni::<false, 1>
                    },
                ),
            ];
            let kernels: Vec<_> = kernels.into_iter().filter(|k| k.1).collect();
            let reps = (256 << 20) / tiles.bytes() + 1;
            let amount = (tiles.bytes() * reps) as f64 / 1e9;
            let rates = crate::backend::cpu::kernel_bench::alternated_medians(kernels.len(), 15, amount, |i| {
                let mut sink = 0f32;
                for _ in 0..reps {
                    for group in 0..n / TILE_ROWS {
                        let (scales, quants) = tiles.group(group);
                        // SAFETY: only the kernels of this CPU's instructions are run.
                        sink += unsafe { kernels[i].2(scales, quants, &acts, 0) }[0][0];
                    }
                }
                std::hint::black_box(sink);
            });
            for ((name, _, _), rate) in kernels.iter().zip(rates) {
                eprintln!("{kind:?}, {name}: {rate:.1} GB/s");
            }
        }
    }
}
