//! Products of many activation rows (prefill, the vision tower) with packed weight matrices on
//! CPUs with AVX-512 BF16, computed in bfloat16 as transformers and vLLM compute a bfloat16 model:
//! the activations rounded to bfloat16 (ties to even) at the product's input, `vdpbf16ps`
//! multiplying pairs and summing them in f32, 32 products per instruction (twice the f32 FMA's).
//! bfloat16 weights are used as stored; `q8_0` and `q4_0` weights are dequantized and rounded to
//! bfloat16 as they are repacked (one rounding of GGML's value `d · q`). Keeping 16 bits of each
//! activation instead (a bfloat16 high part and remainder, two products) ran slower than the f32
//! GEMM (32 vs 41 tokens/s prefill).
//!
//! Layout: the weights, `[n, k]` row-major, are repacked per call into panels of [`NR`] output
//! columns, each k-pair's 32 column pairs together; activations become rows of k-pairs. A task
//! takes [`MR`]-row groups of the output and runs every panel over them, accumulators in registers.

use super::packed::PackedMatrix;
use crate::memory::ledger::{Category, MemoryLedger};
use crate::parallel::for_each_piece;

/// Output columns per panel (two 16-lane vectors).
const NR: usize = 32;
/// Output rows per register tile.
const MR: usize = 12;
/// Register tiles of rows per task.
const TILES_PER_TASK: usize = 2;

/// Whether this CPU runs [`matmul`].
pub(super) fn available() -> bool {
    super::isa::isa().avx512_bf16
}

/// The bfloat16 nearest `x` (ties to even), as bits; NaN stays NaN. `half::bf16::from_f32`'s
/// numbers without its branches, so a row of them vectorises.
#[inline(always)]
pub(super) fn round_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    let rounded = (b.wrapping_add(0x7FFF + ((b >> 16) & 1)) >> 16) as u16;
    if x.is_nan() {
        (b >> 16) as u16 | 0x40
    } else {
        rounded
    }
}

/// Panel rows repacked per pass: `PANEL_BLOCK` k-pairs of a panel's [`NR`] columns (8 KiB, in the
/// first-level cache while the columns' rows are read into it).
const PANEL_BLOCK: usize = 64;

/// Two bfloat16 values in one 32-bit lane, the first in the low half (`vdpbf16ps`'s order).
#[inline(always)]
fn pair(lo: u16, hi: u16) -> u32 {
    lo as u32 | (hi as u32) << 16
}

/// `x` (`[m, k]` f32) times the transpose of `w` (`[n, k]`): `[m, n]`; an error where the shapes
/// disagree or the CPU lacks AVX-512 BF16 ([`available`]). The repacked operands and the result
/// are recorded in `ledger` while this runs, with the rows each pool thread dequantizes at a time
/// for quantized weights.
pub(super) fn matmul(x: &[f32], m: usize, w: &PackedMatrix, ledger: &MemoryLedger) -> Result<Vec<f32>, String> {
    let (n, k) = w.dims();
    if x.len() != m * k {
        return Err(format!("{} activations are not {m} rows of {k}", x.len()));
    }
    if !available() {
        return Err("this CPU has no AVX-512 BF16".into());
    }
    let kp = k.div_ceil(2);
    let rows = m.div_ceil(MR) * MR;
    let panels = n.div_ceil(NR);
    let threads = candle_core::utils::barrier_pool().n_workers() + 1;
    let scratch = threads * w.bf16_rows_scratch_bytes(NR.min(n));
    let _held = ledger.hold(
        Category::Activations,
        (((rows + panels * NR) * kp + m * n) * 4 + scratch) as u64,
    );
    // Activation rows as bfloat16 pairs, padded to whole tiles with zeros.
    let mut xb = vec![0u32; rows * kp];
    for_each_piece(&mut xb[..m * kp], kp, |r, pairs| {
        let (whole, odd) = x[r * k..(r + 1) * k].as_chunks::<2>();
        for (v, &[a, b]) in pairs.iter_mut().zip(whole) {
            *v = pair(round_bf16(a), round_bf16(b));
        }
        if let [a] = odd {
            pairs[kp - 1] = pair(round_bf16(*a), 0);
        }
    });
    // Weight panels: panel j holds columns j·NR.., k-pair by k-pair; written in blocks of
    // PANEL_BLOCK pairs so that the block being filled stays in the first-level cache.
    let mut packed = vec![0u32; panels * kp * NR];
    for_each_piece(&mut packed, kp * NR, |j, panel| {
        let cols = NR.min(n - j * NR);
        let w_rows = w.bf16_rows(j * NR, cols);
        for p0 in (0..kp).step_by(PANEL_BLOCK) {
            let block = &mut panel[p0 * NR..(p0 + PANEL_BLOCK).min(kp) * NR];
            for c in 0..cols {
                let row = &w_rows[c * k..][..k];
                let row = &row[2 * p0..(2 * (p0 + PANEL_BLOCK)).min(k)];
                let (whole, odd) = row.as_chunks::<2>();
                for (p, &[a, b]) in whole.iter().enumerate() {
                    block[p * NR + c] = pair(a, b);
                }
                if let [a] = odd {
                    block[whole.len() * NR + c] = pair(*a, 0);
                }
            }
        }
    });
    let mut out = vec![0f32; m * n];
    let per_task = MR * TILES_PER_TASK;
    for_each_piece(&mut out, per_task * n, |t, part| {
        let first = t * per_task;
        let mut tile = [[0f32; NR]; MR];
        for j in 0..panels {
            let panel = &packed[j * kp * NR..][..kp * NR];
            let cols = NR.min(n - j * NR);
            for r0 in (first..(first + per_task).min(m)).step_by(MR) {
                tile_product(&xb[r0 * kp..][..MR * kp], panel, kp, &mut tile);
                for (i, row) in tile.iter().enumerate().take(m - r0) {
                    part[(r0 - first + i) * n + j * NR..][..cols].copy_from_slice(&row[..cols]);
                }
            }
        }
    });
    Ok(out)
}

/// One register tile: `MR` rows of pairs `a` against one panel (only after [`available`]).
#[allow(unsafe_code)]
fn tile_product(a: &[u32], panel: &[u32], kp: usize, tile: &mut [[f32; NR]; MR]) {
    assert!(a.len() >= MR * kp && panel.len() >= kp * NR);
    debug_assert!(available());
    #[cfg(target_arch = "x86_64")]
    // SAFETY: callers checked `available()`; the slices hold what the kernel reads (above).
    unsafe {
        tile_avx512(a.as_ptr(), panel.as_ptr(), kp, tile)
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("bf16 matmul without AVX-512 BF16 ({a:?}, {panel:?}, {kp}, {tile:?})")
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn tile_avx512(a: *const u32, panel: *const u32, kp: usize, tile: &mut [[f32; NR]; MR]) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_ps(); 2]; MR];
    for p in 0..kp {
        let b0: __m512bh = std::mem::transmute(_mm512_loadu_si512(panel.add(p * NR) as *const _));
        let b1: __m512bh = std::mem::transmute(_mm512_loadu_si512(panel.add(p * NR + 16) as *const _));
        for (r, acc) in acc.iter_mut().enumerate() {
            let x: __m512bh = std::mem::transmute(_mm512_set1_epi32(*a.add(r * kp + p) as i32));
            acc[0] = _mm512_dpbf16_ps(acc[0], x, b0);
            acc[1] = _mm512_dpbf16_ps(acc[1], x, b1);
        }
    }
    for (row, acc) in tile.iter_mut().zip(acc) {
        _mm512_storeu_ps(row.as_mut_ptr(), acc[0]);
        _mm512_storeu_ps(row.as_mut_ptr().add(16), acc[1]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::weight_format::WeightFormat;

    /// The branch-free rounding gives `half`'s bfloat16 for ties, both signs, infinities, NaN,
    /// subnormals and the largest finite values (which round to infinity).
    #[test]
    fn rounding_is_half_s() {
        let mut bits = vec![
            0u32,
            0x8000_0000,
            0x7F80_0000,
            0xFF80_0000,
            0x7FC0_0000,
            0x7F80_0001,
            0xFFFF_FFFF,
        ];
        bits.extend([
            0x7F7F_FFFF,
            0x7F7F_8000,
            0x7F7E_8000,
            0x0000_8000,
            0x0001_8000,
            0x0000_7FFF,
            0x3F80_8000,
        ]);
        bits.extend((0..100_000u32).map(|i| i.wrapping_mul(2_654_435_761)));
        for b in bits {
            let x = f32::from_bits(b);
            let want = half::bf16::from_f32(x).to_bits();
            assert_eq!(round_bf16(x), want, "{b:#010x}");
        }
    }

    /// Shapes with partial tiles, partial panels and an odd k, with bfloat16, `q8_0` and `q4_0`
    /// weights, against the same product in f64 of the activations and the weights' values
    /// rounded to bfloat16.
    #[test]
    fn matches_the_product_of_bf16_rounded_activations() {
        if !available() {
            let ledger = MemoryLedger::new();
            let w = PackedMatrix::bf16(vec![0; 2], 1, 2).unwrap();
            assert!(matmul(&[1.0, 2.0], 1, &w, &ledger)
                .unwrap_err()
                .contains("AVX-512 BF16"));
            eprintln!("this CPU has no AVX-512 BF16: the kernel is not run here");
            return;
        }
        let ledger = MemoryLedger::new();
        let w = PackedMatrix::bf16(vec![0; 4], 2, 2).unwrap();
        assert!(matmul(&[1.0; 3], 1, &w, &ledger)
            .unwrap_err()
            .contains("not 1 rows of 2"));
        let shapes = [
            (1, 1, 1),
            (13, 33, 7),
            (37, 70, 64),
            (MR * TILES_PER_TASK + 1, NR, 130),
            (13, 33, 131),
            (29, 45, 160),
        ];
        for (m, n, k) in shapes {
            let x: Vec<f32> = (0..m * k).map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0).collect();
            let values: Vec<f32> = (0..n * k).map(|i| ((i * 53 % 89) as f32 - 44.0) / 13.0).collect();
            let bits = values.iter().map(|&v| round_bf16(v)).collect();
            let mut mats = vec![("bf16", PackedMatrix::bf16(bits, n, k).unwrap())];
            for format in [WeightFormat::Q8_0, WeightFormat::Q4_0] {
                mats.extend(PackedMatrix::quantize(format, &values, n, k).map(|w| (format.name(), w)));
            }
            for (name, w) in &mats {
                // The weights the product should see: the stored value rounded to bfloat16.
                let w_bf16: Vec<u16> = w.dequantize().into_iter().map(round_bf16).collect();
                let ledger = MemoryLedger::new();
                let got = matmul(&x, m, w, &ledger).unwrap();
                assert_eq!(ledger.total(), 0);
                assert_eq!(got.len(), m * n);
                let wide = |b: u16| f32::from_bits((b as u32) << 16) as f64;
                for i in 0..m {
                    for j in 0..n {
                        let want: f64 = (0..k)
                            .map(|c| wide(round_bf16(x[i * k + c])) * wide(w_bf16[j * k + c]))
                            .sum();
                        let got = got[i * n + j] as f64;
                        assert!(
                            (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                            "{name} {m}x{n}x{k} ({i}, {j}): {got} vs {want}"
                        );
                    }
                }
            }
            assert_eq!(mats.len(), if k % 32 == 0 { 3 } else { 1 }, "{m}x{n}x{k}");
        }
    }
}
