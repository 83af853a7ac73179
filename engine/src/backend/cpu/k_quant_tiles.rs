//! `q4_K` matrices stored for integer tiles on AVX2 CPUs ([`available`]): groups of 8 weight rows
//! interleaved so that one 256-bit register holds the same four nibble bytes of all 8 rows (as
//! llama.cpp repacks `q4_K` eight rows at a time for its AVX2 GEMV and GEMM), multiplied by each
//! activation row's four matching bytes broadcast. Every i32 lane sums a whole 32-value sub-block
//! of one (weight row, activation row) pair, and the scaling by the sub-block's scale and minimum
//! is done in f32 once per 8 products instead of once per lane group of one product.
//!
//! The interleaving is done once, at load, into as many bytes as the file's: per super-block of
//! the group, the 8 rows' `d` and `dmin`, their sub-blocks' 6-bit scales (one byte each, the top
//! two bits holding the minimum's top two), the minimums' low nibbles, and the quants in runs
//! of four bytes. A decode, a batch of decodes and a prefill read the weights as one stream.

use super::isa::fastest;
use super::k_quant_dot::{self, scale_min_bytes, KActivations, KQuant, KRows, Q4K_BYTES};
use crate::arch::ggml::GgmlType;

/// Weight rows in one group: one i32 lane per row of a 256-bit register.
pub const GROUP_ROWS: usize = 8;

/// Activation rows one kernel call takes: they share each unpacked register of weights.
const TILE: usize = 4;

/// Bytes of one super-block of a group: as many as its 8 rows' blocks in the file.
const GROUP_BLOCK: usize = GROUP_ROWS * Q4K_BYTES;

/// Where each part of a group's super-block starts: 8 f16 `d`, 8 f16 `dmin`, 64 scale bytes
/// `[sub-block][row]`, 32 bytes of minimums' low nibbles `[pair of sub-blocks][row]` (even
/// sub-block low), then 1024 bytes of quants `[32-byte chunk][run of 4][row]`.
const D: usize = 0;
const DMIN: usize = 16;
const SCALES: usize = 32;
const MIN_LOW: usize = 96;
const QUANTS: usize = 128;

/// Products of one group with up to [`TILE`] activation rows, `[activation row][weight row]`.
type Sums = [[f32; GROUP_ROWS]; TILE];

/// Whether this CPU multiplies `q4_K` by tiles: with AVX2 and no AVX-512 VNNI, whose row product
/// (64 weights per `vpdpbusd`) stays where it was measured ahead of llama.cpp.
pub fn available() -> bool {
    let isa = super::isa::isa();
    isa.avx2_fma && !isa.avx512_vnni
}

/// A `q4_K` matrix in groups of [`GROUP_ROWS`] rows (see the module's description).
#[derive(Debug)]
pub struct KTiles {
    blocks_per_row: usize,
    data: Vec<u8>,
}

impl KTiles {
    /// `rows` interleaved, or None when they are not `q4_K` or not whole groups.
    pub fn from_rows(rows: &KRows) -> Option<Self> {
        let n = rows.rows();
        if rows.kind() != KQuant::Q4K || n == 0 || !n.is_multiple_of(GROUP_ROWS) {
            return None;
        }
        let nb = rows.row(0).len() / Q4K_BYTES;
        let mut data = vec![0u8; n * nb * Q4K_BYTES];
        for row in 0..n {
            let (group, lane) = (row / GROUP_ROWS, row % GROUP_ROWS);
            for (b, src) in rows.row(row).chunks_exact(Q4K_BYTES).enumerate() {
                let dst = &mut data[(group * nb + b) * GROUP_BLOCK..][..GROUP_BLOCK];
                dst[D + 2 * lane..][..2].copy_from_slice(&src[0..2]);
                dst[DMIN + 2 * lane..][..2].copy_from_slice(&src[2..4]);
                let sm = scale_min_bytes(&src[4..16]);
                for sub in 0..8 {
                    let (scale, min) = (sm[sub], sm[8 + sub]);
                    dst[SCALES + 8 * sub + lane] = scale | (min >> 4) << 6;
                    dst[MIN_LOW + 8 * (sub / 2) + lane] |= (min & 0x0F) << (4 * (sub % 2));
                }
                for chunk in 0..4 {
                    for run in 0..8 {
                        let at = QUANTS + 256 * chunk + 32 * run + 4 * lane;
                        dst[at..at + 4].copy_from_slice(&src[16 + 32 * chunk + 4 * run..][..4]);
                    }
                }
            }
        }
        Some(KTiles {
            blocks_per_row: nb,
            data,
        })
    }

    /// Bytes of the stored blocks (as many as row by row).
    pub fn bytes(&self) -> usize {
        self.data.len()
    }

    /// Group `group`'s super-blocks.
    fn group(&self, group: usize) -> &[u8] {
        &self.data[group * self.blocks_per_row * GROUP_BLOCK..][..self.blocks_per_row * GROUP_BLOCK]
    }

    /// Row `row`'s super-blocks as the file stores them.
    fn row(&self, row: usize) -> Vec<u8> {
        let lane = row % GROUP_ROWS;
        let mut out = vec![0u8; self.blocks_per_row * Q4K_BYTES];
        for (src, dst) in self
            .group(row / GROUP_ROWS)
            .chunks_exact(GROUP_BLOCK)
            .zip(out.chunks_exact_mut(Q4K_BYTES))
        {
            dst[0..2].copy_from_slice(&src[D + 2 * lane..][..2]);
            dst[2..4].copy_from_slice(&src[DMIN + 2 * lane..][..2]);
            let (mut scale, mut min) = ([0u8; 8], [0u8; 8]);
            for sub in 0..8 {
                let packed = src[SCALES + 8 * sub + lane];
                let low = (src[MIN_LOW + 8 * (sub / 2) + lane] >> (4 * (sub % 2))) & 0x0F;
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
            for chunk in 0..4 {
                for run in 0..8 {
                    let at = QUANTS + 256 * chunk + 32 * run + 4 * lane;
                    dst[16 + 32 * chunk + 4 * run..][..4].copy_from_slice(&src[at..at + 4]);
                }
            }
        }
        out
    }

    /// Row `row`'s values in f32, by GGML's dequantization.
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        GgmlType::Q4K.dequantize(&self.row(row), out);
    }

    /// The products of weight rows `row..row + n` with every activation row of `acts`, into
    /// `out` `[n, acts' rows]`.
    pub fn products(&self, row: usize, n: usize, acts: &KActivations, out: &mut [f32]) {
        let m = acts.rows();
        let mut r = row;
        while r < row + n {
            let (group, lane) = (r / GROUP_ROWS, r % GROUP_ROWS);
            let take = (GROUP_ROWS - lane).min(row + n - r);
            let mut first = 0;
            while first < m {
                // Whole tiles of activation rows, then the rest one at a time.
                let t = if m - first >= TILE { TILE } else { 1 };
                let sums = self.tile(group, acts, first, t);
                for (k, sums) in sums.iter().enumerate().take(t) {
                    for (i, &v) in sums[lane..lane + take].iter().enumerate() {
                        out[(r - row + i) * m + first + k] = v;
                    }
                }
                first += t;
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
        fastest!(
            avx2_fma => if t == TILE {
                tile_avx2::<TILE>(data, &std::array::from_fn(rows))
            } else {
                let sums = tile_avx2::<1>(data, &[rows(0)]);
                std::array::from_fn(|k| if k == 0 { sums[0] } else { [0.0; GROUP_ROWS] })
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
                sums[lane] = k_quant_dot::dot_portable(KQuant::Q4K, &row, &acts.row(first + k));
            }
        }
        sums
    }
}

/// The products of one group's super-blocks (`data`) with the activation rows `xs`: per
/// sub-block and run of four weight bytes, one `vpmaddubsw` per activation row against its four
/// matching bytes broadcast, summed in i16 pairs (each at most 8 · 2 · 15 · 128 = 30,720 over
/// the sub-block's eight runs) and widened by one `vpmaddwd`; per sub-block each row's sums
/// scaled by `d · scale · d_x` and its minimum's term `dmin · min · d_x Σ q_x` subtracted. A
/// chunk's 32 bytes hold two sub-blocks (low and high nibbles); the second is read from the
/// first level cache.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(unsafe_code)]
fn tile_avx2<const T: usize>(data: &[u8], xs: &[k_quant_dot::KRow<'_>; T]) -> [[f32; GROUP_ROWS]; T] {
    use super::packed::PREFETCH_BYTES;
    use crate::arch::ggml::QK_K;
    use std::arch::x86_64::*;
    let nb = data.len() / GROUP_BLOCK;
    // The reads below stay inside these lengths.
    assert_eq!(data.len(), nb * GROUP_BLOCK);
    for x in xs {
        assert!(x.quants.len() >= nb * QK_K && x.scales.len() >= 8 * nb && x.sums.len() >= 16 * nb);
    }
    let (ones, low) = (_mm256_set1_epi16(1), _mm256_set1_epi8(0x0F));
    let (six_bits, low_nibble, top_two) = (_mm_set1_epi8(0x3F), _mm_set1_epi8(0x0F), _mm_set1_epi8(0x30));
    let widen = |v: __m128i| _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
    let mut acc = [_mm256_setzero_ps(); T];
    for b in 0..nb {
        // SAFETY: every read below is inside super-block `b` of the group (asserted above) or
        // inside the activation rows' lengths (asserted above); a prefetch never faults.
        unsafe {
            let block = data.as_ptr().add(b * GROUP_BLOCK);
            let ahead = block.wrapping_add(PREFETCH_BYTES);
            for line in (0..GROUP_BLOCK).step_by(64) {
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(line) as *const i8);
            }
            let d = _mm256_cvtph_ps(_mm_loadu_si128(block.add(D) as *const __m128i));
            let dmin = _mm256_cvtph_ps(_mm_loadu_si128(block.add(DMIN) as *const __m128i));
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
                            *pairs = _mm256_add_epi16(*pairs, _mm256_maddubs_epi16(w, word));
                        }
                    }
                    let packed = _mm_loadl_epi64(block.add(SCALES + 8 * sub) as *const __m128i);
                    let lows = _mm_loadl_epi64(block.add(MIN_LOW + 8 * chunk) as *const __m128i);
                    let lows = if high { _mm_srli_epi16(lows, 4) } else { lows };
                    let min = _mm_or_si128(
                        _mm_and_si128(lows, low_nibble),
                        _mm_and_si128(_mm_srli_epi16(packed, 2), top_two),
                    );
                    let scale = _mm256_mul_ps(d, widen(_mm_and_si128(packed, six_bits)));
                    let offset = _mm256_mul_ps(dmin, widen(min));
                    let at = 8 * b + sub;
                    for ((acc, pairs), x) in acc.iter_mut().zip(pairs).zip(xs) {
                        let sum = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
                        *acc = _mm256_fmadd_ps(sum, _mm256_mul_ps(scale, _mm256_set1_ps(x.scales[at])), *acc);
                        let xsum = x.sums[2 * at] + x.sums[2 * at + 1];
                        *acc = _mm256_fnmadd_ps(offset, _mm256_set1_ps(xsum), *acc);
                    }
                }};
            }
            for chunk in 0..4 {
                sub_block!(chunk, false);
                sub_block!(chunk, true);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::blocks::tests::values;
    use crate::arch::ggml::QK_K;
    use crate::backend::cpu::k_quant_dot::tests::random_rows;

    /// Interleaving keeps every byte: each row comes back as the file stores it, in as many bytes;
    /// rows not in whole groups and `q6_K` are refused.
    #[test]
    fn tiles_hold_the_rows_bytes() {
        let cols = 3 * QK_K;
        let data = random_rows(KQuant::Q4K, 2 * GROUP_ROWS, cols, 7);
        let rows = KRows::new(KQuant::Q4K, &data, 2 * GROUP_ROWS, cols).unwrap();
        let tiles = KTiles::from_rows(&rows).unwrap();
        assert_eq!(tiles.bytes() as u64, rows.bytes());
        let (mut want, mut got) = (vec![0f32; cols], vec![0f32; cols]);
        for r in 0..2 * GROUP_ROWS {
            assert_eq!(tiles.row(r), rows.row(r), "row {r}");
            rows.dequantize_row(r, &mut want);
            tiles.dequantize_row(r, &mut got);
            assert_eq!(got, want, "row {r}");
        }
        let odd = KRows::new(
            KQuant::Q4K,
            &data[..(GROUP_ROWS + 3) * 3 * Q4K_BYTES],
            GROUP_ROWS + 3,
            cols,
        )
        .unwrap();
        assert!(KTiles::from_rows(&odd).is_none());
        let q6 = random_rows(KQuant::Q6K, GROUP_ROWS, QK_K, 7);
        assert!(KTiles::from_rows(&KRows::new(KQuant::Q6K, &q6, GROUP_ROWS, QK_K).unwrap()).is_none());
    }

    /// Every path's products of any span of rows are each row's product, for activation counts
    /// off the tile size and spans that start, end and cross inside groups.
    #[test]
    fn products_are_every_row_s_product() {
        for cols in [QK_K, 5 * QK_K] {
            let n = 3 * GROUP_ROWS;
            let data = random_rows(KQuant::Q4K, n, cols, 3);
            let rows = KRows::new(KQuant::Q4K, &data, n, cols).unwrap();
            let tiles = KTiles::from_rows(&rows).unwrap();
            for m in [1, TILE + 3, 9] {
                let acts = KActivations::quantize(&values(m * cols, 11), cols);
                for (row, count) in [(0, n), (GROUP_ROWS + 3, 7), (n - 1, 1), (2, 4)] {
                    let mut got = vec![0f32; count * m];
                    tiles.products(row, count, &acts, &mut got);
                    for r in 0..count {
                        for i in 0..m {
                            let want = k_quant_dot::dot_portable(KQuant::Q4K, rows.row(row + r), &acts.row(i));
                            let g = got[r * m + i];
                            assert!(
                                (g - want).abs() <= 1e-4 * want.abs().max(1.0),
                                "{cols} m={m} ({i}, {}): {g} vs {want}",
                                row + r
                            );
                        }
                    }
                    let portable = tiles.tile_portable(row / GROUP_ROWS, &acts, 0, 1);
                    let want = k_quant_dot::dot_portable(KQuant::Q4K, rows.row(row), &acts.row(0));
                    assert_eq!(portable[0][row % GROUP_ROWS], want, "portable {cols}");
                }
            }
        }
    }
}
