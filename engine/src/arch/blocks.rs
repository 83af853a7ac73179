//! GGML's `q8_0` and `q4_0` block formats: each block's size, its quantization and its
//! dequantization, defined once for every backend and the planner.
//!
//! Each block of 32 values keeps GGML's scale `d` (an f16) and quantization, so the dequantized
//! numbers are GGML's (and candle's, which a test checks). The bytes are GGML's count, laid out for
//! an integer dot product: the scales of a row in one array, the quants in another and unsigned,
//! `value = d · (q − offset)`: `q8_0` stores GGML's i8 plus 128, `q4_0` GGML's nibbles (value `j`
//! in the low half of byte `j`, value `j + 16` in the high half).

use crate::parallel::for_each_piece;
use half::f16;

/// Values per block.
pub const BLOCK: usize = 32;

/// The two block formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockKind {
    Q8_0,
    Q4_0,
}

impl BlockKind {
    /// Bytes of one block's quants.
    pub fn quant_bytes(self) -> usize {
        match self {
            BlockKind::Q8_0 => BLOCK,
            BlockKind::Q4_0 => BLOCK / 2,
        }
    }

    /// Bytes of one block: its f16 scale and its quants.
    pub fn block_bytes(self) -> usize {
        2 + self.quant_bytes()
    }

    /// What a stored quant is offset by.
    pub fn offset(self) -> f32 {
        match self {
            BlockKind::Q8_0 => 128.0,
            BlockKind::Q4_0 => 8.0,
        }
    }

    /// One block's 32 values in f32 from its scale's f16 bits and its quants (in
    /// [`BlockRows::quants`]' layout).
    pub fn dequantize_block(self, scale: u16, quants: &[u8], out: &mut [f32]) {
        let (d, offset) = (f16::from_bits(scale).to_f32(), self.offset());
        match self {
            BlockKind::Q8_0 => {
                for (o, &q) in out.iter_mut().zip(quants) {
                    *o = d * (q as f32 - offset);
                }
            }
            BlockKind::Q4_0 => super::ggml::nibbles(quants, out, |v| d * (v as f32 - offset)),
        }
    }
}

/// GGML's `q8_0` rounding of one block: its scale and its values in `-127..=127`, each value
/// scaled and rounded by `round` (GGML's reference rounds half away from zero, its x86 SIMD code
/// to even). As in GGML, a block whose largest magnitude is below about 3.7e−37 gets a subnormal
/// scale whose inverse is infinite; its values then saturate to −128..=127.
#[inline(always)]
pub(crate) fn quantize_q8(values: &[f32], out: &mut [i8], round: impl Fn(f32) -> f32) -> f32 {
    let amax = values.iter().fold(0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    for (q, &v) in out.iter_mut().zip(values) {
        *q = round(v * id) as i8;
    }
    d
}

/// Quantizes one block of 32 values into `out` (`kind`'s stored quants); returns its scale.
pub(crate) fn quantize_block(kind: BlockKind, block: &[f32], out: &mut [u8]) -> f32 {
    match kind {
        BlockKind::Q8_0 => {
            let mut q8 = [0i8; BLOCK];
            let d = quantize_q8(block, &mut q8, f32::round);
            for (o, &q) in out.iter_mut().zip(&q8) {
                *o = (q as i16 + 128) as u8;
            }
            d
        }
        BlockKind::Q4_0 => {
            // The value of largest magnitude, with its sign, maps to -8.
            let max = block.iter().fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
            let d = max / -8.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            let nibble = |v: f32| ((v * id + 8.5) as u8).min(15);
            for (j, o) in out.iter_mut().enumerate() {
                *o = nibble(block[j]) | (nibble(block[j + BLOCK / 2]) << 4);
            }
            d
        }
    }
}

/// Rows of a matrix quantized block by block (see the module's documentation for the layout).
#[derive(Debug)]
pub struct BlockRows {
    kind: BlockKind,
    cols: usize,
    /// f16 bit patterns, `cols / 32` per row.
    scales: Vec<u16>,
    /// `quant_bytes` per block.
    quants: Vec<u8>,
}

impl BlockRows {
    /// Quantizes `values`, row-major with `cols` (a multiple of 32) per row, in pieces of rows on
    /// candle's thread pool.
    pub fn quantize(kind: BlockKind, values: &[f32], cols: usize) -> Self {
        debug_assert!(cols.is_multiple_of(BLOCK) && values.len().is_multiple_of(cols));
        const ROWS_PER_TASK: usize = 64;
        let (blocks, qb) = (values.len() / BLOCK, kind.quant_bytes());
        let per_task = ROWS_PER_TASK * cols / BLOCK;
        let mut scales = vec![0u16; blocks];
        let mut quants = vec![0u8; blocks * qb];
        let mut pieces: Vec<(&mut [u16], &mut [u8])> = scales
            .chunks_mut(per_task.max(1))
            .zip(quants.chunks_mut(per_task.max(1) * qb))
            .collect();
        for_each_piece(&mut pieces, 1, |t, piece| {
            let (scales, quants) = &mut piece[0];
            let first = t * per_task * BLOCK;
            for (i, (scale, out)) in scales.iter_mut().zip(quants.chunks_exact_mut(qb)).enumerate() {
                let block = &values[first + i * BLOCK..][..BLOCK];
                *scale = f16::from_f32(quantize_block(kind, block, out)).to_bits();
            }
        });
        BlockRows {
            kind,
            cols,
            scales,
            quants,
        }
    }

    /// The blocks of a GGUF tensor of `kind` as GGML stores them (each block its f16 scale then its
    /// quants), `cols` (a multiple of 32) values per row, split into this layout without changing
    /// a value; None when `data` is not whole blocks.
    pub fn from_ggml(kind: BlockKind, data: &[u8], cols: usize) -> Option<Self> {
        let (bb, qb) = (kind.block_bytes(), kind.quant_bytes());
        if !cols.is_multiple_of(BLOCK)
            || !data.len().is_multiple_of(bb)
            || !(data.len() / bb * BLOCK).is_multiple_of(cols)
        {
            return None;
        }
        let blocks = data.len() / bb;
        let mut scales = Vec::with_capacity(blocks);
        let mut quants = Vec::with_capacity(blocks * qb);
        for block in data.chunks_exact(bb) {
            scales.push(u16::from_le_bytes([block[0], block[1]]));
            match kind {
                BlockKind::Q8_0 => quants.extend(block[2..].iter().map(|&q| (q as i8 as i16 + 128) as u8)),
                BlockKind::Q4_0 => quants.extend_from_slice(&block[2..]),
            }
        }
        Some(BlockRows {
            kind,
            cols,
            scales,
            quants,
        })
    }

    /// Rows `rows` as GGML stores them, [`BlockRows::from_ggml`]'s input.
    pub fn to_ggml(&self, rows: std::ops::Range<usize>) -> Vec<u8> {
        let (nb, qb) = (self.blocks_per_row(), self.kind.quant_bytes());
        let blocks = rows.start * nb..rows.end * nb;
        let mut out = Vec::with_capacity(blocks.len() * self.kind.block_bytes());
        for b in blocks {
            out.extend_from_slice(&self.scales[b].to_le_bytes());
            let quants = &self.quants[b * qb..(b + 1) * qb];
            match self.kind {
                BlockKind::Q8_0 => out.extend(quants.iter().map(|&q| (q as i16 - 128) as i8 as u8)),
                BlockKind::Q4_0 => out.extend_from_slice(quants),
            }
        }
        out
    }

    /// The format.
    pub fn kind(&self) -> BlockKind {
        self.kind
    }

    /// The scales' f16 bit patterns, one per block, row after row.
    pub fn scales(&self) -> &[u16] {
        &self.scales
    }

    /// The quants, `quant_bytes` per block in the order of [`BlockRows::scales`] (see the
    /// module's documentation for the bytes).
    pub fn quants(&self) -> &[u8] {
        &self.quants
    }

    /// Drops every row from `rows` on (their memory too).
    pub fn keep_rows(&mut self, rows: usize) {
        let nb = self.blocks_per_row();
        self.scales.truncate(rows * nb);
        self.scales.shrink_to_fit();
        self.quants.truncate(rows * nb * self.kind.quant_bytes());
        self.quants.shrink_to_fit();
    }

    /// Bytes of scales and quants.
    pub fn bytes(&self) -> usize {
        self.scales.len() * 2 + self.quants.len()
    }

    /// Blocks in one row.
    pub fn blocks_per_row(&self) -> usize {
        self.cols / BLOCK
    }

    /// Row `row`'s scales.
    pub fn row_scales(&self, row: usize) -> &[u16] {
        let nb = self.blocks_per_row();
        &self.scales[row * nb..(row + 1) * nb]
    }

    /// Row `row`'s quants.
    pub fn row_quants(&self, row: usize) -> &[u8] {
        let n = self.blocks_per_row() * self.kind.quant_bytes();
        &self.quants[row * n..(row + 1) * n]
    }

    /// Row `row`'s values in f32.
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        let (nb, qb) = (self.blocks_per_row(), self.kind.quant_bytes());
        let (scales, quants) = (self.row_scales(row), self.row_quants(row));
        for (b, out) in out[..nb * BLOCK].chunks_exact_mut(BLOCK).enumerate() {
            self.kind.dequantize_block(scales[b], &quants[b * qb..][..qb], out);
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use candle_core::quantized::k_quants::{BlockQ4_0, BlockQ8_0, GgmlType};

    /// Deterministic values in [-0.1, 0.1).
    pub(crate) fn values(n: usize, seed: usize) -> Vec<f32> {
        (0..n)
            .map(|i| (((i + seed) * 7919 % 1000) as f32 / 500.0 - 1.0) * 0.1)
            .collect()
    }

    /// The dequantized values are GGML's, as candle's `k_quants` computes them.
    #[test]
    fn blocks_dequantize_to_ggml_s_values() {
        let cols = 96;
        let w = values(5 * cols, 3);
        for kind in [BlockKind::Q8_0, BlockKind::Q4_0] {
            let rows = BlockRows::quantize(kind, &w, cols);
            assert_eq!(rows.bytes(), w.len() / BLOCK * (2 + kind.quant_bytes()));
            let mut want = vec![0f32; w.len()];
            match kind {
                BlockKind::Q8_0 => {
                    let mut b = vec![BlockQ8_0::zeros(); w.len() / BLOCK];
                    BlockQ8_0::from_float(&w, &mut b);
                    BlockQ8_0::to_float(&b, &mut want);
                }
                BlockKind::Q4_0 => {
                    let mut b = vec![BlockQ4_0::zeros(); w.len() / BLOCK];
                    BlockQ4_0::from_float(&w, &mut b);
                    BlockQ4_0::to_float(&b, &mut want);
                }
            }
            let mut got = vec![0f32; w.len()];
            for (r, out) in got.chunks_exact_mut(cols).enumerate() {
                rows.dequantize_row(r, out);
            }
            assert_eq!(got, want, "{kind:?}");
        }
    }

    /// GGML's own block bytes split into this layout hold the same values as GGML dequantizes.
    #[test]
    fn ggml_blocks_split_without_changing_a_value() {
        let cols = 64;
        let w = values(3 * cols, 5);
        for (kind, ggml) in [
            (BlockKind::Q8_0, crate::arch::ggml::GgmlType::Q8_0),
            (BlockKind::Q4_0, crate::arch::ggml::GgmlType::Q4_0),
        ] {
            let ours = BlockRows::quantize(kind, &w, cols);
            // GGML's interleaved bytes of the same blocks.
            let mut bytes = Vec::new();
            for (b, &scale) in ours.scales().iter().enumerate() {
                bytes.extend(scale.to_le_bytes());
                let q = &ours.quants()[b * kind.quant_bytes()..][..kind.quant_bytes()];
                match kind {
                    BlockKind::Q8_0 => bytes.extend(q.iter().map(|&q| (q as i16 - 128) as i8 as u8)),
                    BlockKind::Q4_0 => bytes.extend_from_slice(q),
                }
            }
            let mut want = vec![0f32; w.len()];
            ggml.dequantize(&bytes, &mut want);
            let split = BlockRows::from_ggml(kind, &bytes, cols).unwrap();
            let mut got = vec![0f32; w.len()];
            for (r, out) in got.chunks_exact_mut(cols).enumerate() {
                split.dequantize_row(r, out);
            }
            assert_eq!(got, want, "{kind:?}");
            assert_eq!(split.bytes(), bytes.len());
            assert!(BlockRows::from_ggml(kind, &bytes[1..], cols).is_none());
        }
    }
}
