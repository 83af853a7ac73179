//! Weight matrices in GGML's block formats ([`WeightFormat`]) on the CPU, multiplied by candle's
//! quantized kernels (`k_quants::matmul`: the activations quantized to `q8_0` row by row, integer
//! dot products with AVX2, NEON or wasm simd128 chosen at run time, f32 results, the columns
//! spread over candle's thread pool). The blocks are the only copy of the matrix: candle's
//! `QMatMul` would also keep a repacked copy on AVX-512 machines, which the ledger could not see.

use crate::model::weight_format::WeightFormat;
use candle_core::quantized::k_quants::{self, BlockQ4_0, BlockQ8_0, GgmlType};

/// The blocks of one matrix.
#[derive(Debug)]
enum Blocks {
    Q8_0(Vec<BlockQ8_0>),
    Q4_0(Vec<BlockQ4_0>),
}

/// A matrix `[rows, cols]` quantized row by row.
#[derive(Debug)]
pub struct QuantizedMatrix {
    rows: usize,
    cols: usize,
    blocks: Blocks,
}

fn quantize_rows<T: GgmlType>(values: &[f32], cols: usize) -> Vec<T> {
    let per_row = cols / T::BLCK_SIZE;
    let mut out = vec![T::zeros(); values.len() / cols * per_row];
    for (src, dst) in values.chunks_exact(cols).zip(out.chunks_exact_mut(per_row)) {
        T::from_float(src, dst);
    }
    out
}

fn dequantize_rows<T: GgmlType>(blocks: &[T], cols: usize, ids: &[usize]) -> Vec<f32> {
    let per_row = cols / T::BLCK_SIZE;
    let mut out = vec![0f32; ids.len() * cols];
    for (&id, dst) in ids.iter().zip(out.chunks_exact_mut(cols)) {
        T::to_float(&blocks[id * per_row..(id + 1) * per_row], dst);
    }
    out
}

impl QuantizedMatrix {
    /// Quantizes `values` (row-major `[rows, cols]`), or None when `format` keeps this shape.
    pub fn quantize(format: WeightFormat, values: &[f32], rows: usize, cols: usize) -> Option<Self> {
        if !format.quantizes(&[rows, cols]) || values.len() != rows * cols {
            return None;
        }
        let blocks = match format {
            WeightFormat::Q8_0 => Blocks::Q8_0(quantize_rows(values, cols)),
            WeightFormat::Q4_0 => Blocks::Q4_0(quantize_rows(values, cols)),
            WeightFormat::Unquantized => return None,
        };
        Some(QuantizedMatrix { rows, cols, blocks })
    }

    /// `[rows, cols]`.
    pub fn dims(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }

    /// Bytes of the blocks.
    pub fn bytes(&self) -> u64 {
        (match &self.blocks {
            Blocks::Q8_0(b) => std::mem::size_of_val(b.as_slice()),
            Blocks::Q4_0(b) => std::mem::size_of_val(b.as_slice()),
        }) as u64
    }

    /// `x · selfᵀ` for `x [m, cols]` (row-major): `[m, rows]`.
    pub fn matmul(&self, x: &[f32], m: usize) -> candle_core::Result<Vec<f32>> {
        if x.len() != m * self.cols {
            candle_core::bail!("{} values are not {m} rows of {}", x.len(), self.cols);
        }
        let mut out = vec![0f32; m * self.rows];
        let mkn = (m, self.cols, self.rows);
        match &self.blocks {
            Blocks::Q8_0(b) => k_quants::matmul(mkn, x, b, &mut out)?,
            Blocks::Q4_0(b) => k_quants::matmul(mkn, x, b, &mut out)?,
        }
        Ok(out)
    }

    /// The whole matrix in f32 (row-major).
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.rows * self.cols];
        match &self.blocks {
            Blocks::Q8_0(b) => BlockQ8_0::to_float(b, &mut out),
            Blocks::Q4_0(b) => BlockQ4_0::to_float(b, &mut out),
        }
        out
    }

    /// Rows `ids`, dequantized (an embedding lookup); ids must be below `rows`.
    pub fn gather(&self, ids: &[usize]) -> Vec<f32> {
        debug_assert!(ids.iter().all(|&i| i < self.rows));
        match &self.blocks {
            Blocks::Q8_0(b) => dequantize_rows(b, self.cols, ids),
            Blocks::Q4_0(b) => dequantize_rows(b, self.cols, ids),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matrix(rows: usize, cols: usize) -> Vec<f32> {
        (0..rows * cols)
            .map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 0.1)
            .collect()
    }

    #[test]
    fn block_sizes_are_the_planner_s() {
        for format in [WeightFormat::Q8_0, WeightFormat::Q4_0] {
            let q = QuantizedMatrix::quantize(format, &matrix(48, 64), 48, 64).unwrap();
            assert_eq!(q.bytes(), format.tensor_bytes(&[48, 64], 4), "{format}");
        }
        assert!(QuantizedMatrix::quantize(WeightFormat::Q8_0, &matrix(4, 37), 4, 37).is_none());
        assert!(QuantizedMatrix::quantize(WeightFormat::Unquantized, &matrix(4, 64), 4, 64).is_none());
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
            let q = QuantizedMatrix::quantize(format, &w, rows, cols).unwrap();
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
        assert!(QuantizedMatrix::quantize(WeightFormat::Q8_0, &w, rows, cols)
            .unwrap()
            .matmul(&[0.0; 5], 1)
            .is_err());
    }
}
