//! Products of many activation rows (prefill, the vision tower) with f16 weight matrices on CPUs
//! with AVX2, FMA and F16C but no AVX-512, shaped as llamafile's tinyBLAS computes them for
//! llama.cpp: no packing and no widened copy of the weights. Each tile of 4 activation rows × 3
//! weight rows runs 8-wide dot products along k, the f32 activations against the f16 weights as
//! stored, widened in registers; a task takes [`TASK_COLS`] weight rows (in the second-level
//! cache) over every activation row, and writes its outputs column by column.
//!
//! Measured on the 2-core EPYC (Zen 3) against the gemm crate over a widened copy, the path it
//! replaces there: docs/PERFORMANCE.md.

use crate::memory::ledger::{Category, MemoryLedger};
use crate::parallel::for_each_piece;
use half::f16;

/// Activation rows per tile.
const TILE_ROWS: usize = 4;
/// Weight rows per tile.
const TILE_COLS: usize = 3;
/// Weight rows per task.
const TASK_COLS: usize = 8 * TILE_COLS;

/// Whether [`matmul`] runs here (after `KVLENS_CPU_ISA`): AVX2, FMA and F16C, and no AVX-512,
/// where the gemm crate's AVX-512 kernels are faster (on the Intel Xeon), or AVX-512 in two
/// halves (on the Zen 4 EPYC these tiles prefill an F16 file 1.1–1.2× faster than the gemm crate).
pub(super) fn available() -> bool {
    let isa = super::isa::isa();
    isa.avx2_fma && (!isa.avx512_fma || isa.avx512_split)
}

/// `x` (`[m, k]` f32) times the transpose of `w` (`[n, k]` f16, row-major): `[m, n]`; an error
/// where the shapes disagree or the CPU lacks AVX2, FMA and F16C. The result and its transposed
/// first form are recorded in `ledger` while this runs.
pub(super) fn matmul(x: &[f32], m: usize, w: &[f16], n: usize, ledger: &MemoryLedger) -> Result<Vec<f32>, String> {
    let k = w.len() / n.max(1);
    if w.len() != n * k || x.len() != m * k {
        return Err(format!("{} activations are not {m} rows of {k}", x.len()));
    }
    if !super::isa::isa().avx2_fma {
        return Err("this CPU has no AVX2, FMA and F16C".into());
    }
    let _held = ledger.hold(Category::Activations, (2 * m * n * 4) as u64);
    // The last activation rows padded with zeros to a whole tile.
    let whole = m / TILE_ROWS * TILE_ROWS;
    let mut last = vec![0f32; TILE_ROWS * k];
    last[..(m - whole) * k].copy_from_slice(&x[whole * k..]);
    // Each task's outputs, weight row by weight row: the transpose of the result.
    let mut transposed = vec![0f32; n * m];
    for_each_piece(&mut transposed, TASK_COLS * m, |t, part| {
        let cols = part.len() / m.max(1);
        let first = t * TASK_COLS;
        // The task's weight rows three by three, the last three padded with zero rows.
        let tail = cols % TILE_COLS;
        let mut padded = vec![f16::ZERO; TILE_COLS * k];
        padded[..tail * k].copy_from_slice(&w[(first + cols - tail) * k..(first + cols) * k]);
        let triples: Vec<&[f16]> = (0..cols)
            .step_by(TILE_COLS)
            .map(|j| match j + TILE_COLS <= cols {
                true => &w[(first + j) * k..(first + j + TILE_COLS) * k],
                false => &padded[..],
            })
            .collect();
        for i0 in (0..m).step_by(TILE_ROWS) {
            let rows = if i0 < whole {
                &x[i0 * k..(i0 + TILE_ROWS) * k]
            } else {
                &last[..]
            };
            for (jt, &triple) in triples.iter().enumerate() {
                let tile = run_tile(rows, triple, k);
                for q in 0..TILE_COLS.min(cols - jt * TILE_COLS) {
                    let column = &mut part[(jt * TILE_COLS + q) * m..][..m];
                    for (i, out) in column[i0..(i0 + TILE_ROWS).min(m)].iter_mut().enumerate() {
                        *out = tile[i][q];
                    }
                }
            }
        }
    });
    let mut out = vec![0f32; m * n];
    for_each_piece(&mut out, n, |i, row| {
        for (j, o) in row.iter_mut().enumerate() {
            *o = transposed[j * m + i];
        }
    });
    Ok(out)
}

/// One tile: `rows` (`TILE_ROWS × k`) against `weights` (`TILE_COLS × k`).
#[allow(unsafe_code)]
fn run_tile(rows: &[f32], weights: &[f16], k: usize) -> [[f32; TILE_COLS]; TILE_ROWS] {
    assert!(rows.len() == TILE_ROWS * k && weights.len() == TILE_COLS * k);
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `matmul` checked AVX2, FMA and F16C; the lengths are asserted above.
    unsafe {
        tile_avx2(rows.as_ptr(), weights.as_ptr(), k)
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("the f16 GEMM without AVX2 ({rows:?}, {weights:?}, {k})")
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_avx2(a: *const f32, b: *const f16, k: usize) -> [[f32; TILE_COLS]; TILE_ROWS] {
    use std::arch::x86_64::*;
    let mut acc = [[_mm256_setzero_ps(); TILE_COLS]; TILE_ROWS];
    let whole = k / 8 * 8;
    for p in (0..whole).step_by(8) {
        let w: [__m256; TILE_COLS] =
            std::array::from_fn(|q| _mm256_cvtph_ps(_mm_loadu_si128(b.add(q * k + p) as *const __m128i)));
        for (i, acc) in acc.iter_mut().enumerate() {
            let x = _mm256_loadu_ps(a.add(i * k + p));
            for (acc, &w) in acc.iter_mut().zip(&w) {
                *acc = _mm256_fmadd_ps(x, w, *acc);
            }
        }
    }
    let mut tile = [[0f32; TILE_COLS]; TILE_ROWS];
    for (i, (row, acc)) in tile.iter_mut().zip(acc).enumerate() {
        for (q, (out, acc)) in row.iter_mut().zip(acc).enumerate() {
            let mut lanes = [0f32; 8];
            _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
            let tail: f32 = (whole..k)
                .map(|p| *a.add(i * k + p) * (*b.add(q * k + p)).to_f32())
                .sum();
            *out = lanes.iter().sum::<f32>() + tail;
        }
    }
    tile
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Shapes with partial tiles of rows and of weight rows, a partial task, k below and past a
    /// multiple of 8, against the product in f64.
    #[test]
    fn matches_the_product_in_f64() {
        let ledger = MemoryLedger::new();
        if !super::super::isa::isa().avx2_fma {
            let err = matmul(&[1.0, 2.0], 1, &[f16::ZERO; 2], 1, &ledger).unwrap_err();
            assert!(err.contains("AVX2"));
            eprintln!("this CPU has no AVX2, FMA and F16C: the kernel is not run here");
            return;
        }
        let err = matmul(&[1.0; 3], 1, &[f16::ZERO; 4], 2, &ledger).unwrap_err();
        assert!(err.contains("not 1 rows of 2"));
        let shapes = [
            (1, 1, 1),
            (5, 7, 13),
            (33, TASK_COLS + 4, 64),
            (8, 2 * TASK_COLS, 300),
            (37, 50, 517),
        ];
        for (m, n, k) in shapes {
            let x: Vec<f32> = (0..m * k).map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0).collect();
            let w: Vec<f16> = (0..n * k)
                .map(|i| f16::from_f32(((i * 53 % 89) as f32 - 44.0) / 13.0))
                .collect();
            let got = matmul(&x, m, &w, n, &ledger).unwrap();
            assert_eq!(ledger.total(), 0);
            assert_eq!(got.len(), m * n);
            for i in 0..m {
                for j in 0..n {
                    let terms = (0..k).map(|c| x[i * k + c] as f64 * w[j * k + c].to_f64());
                    let (want, size) = terms.fold((0.0, 0.0), |(s, a), t| (s + t, a + t.abs()));
                    let got = got[i * n + j] as f64;
                    assert!(
                        (got - want).abs() <= 1e-6 * size,
                        "{m}x{n}x{k} ({i}, {j}): {got} vs {want}"
                    );
                }
            }
        }
    }
}
