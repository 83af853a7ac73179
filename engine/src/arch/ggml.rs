//! GGML's tensor types as a GGUF file stores them: each type's id, block of values, bytes per
//! block and dequantization, defined once (llama.cpp's `ggml-quants.c` and gguf-py's `quants.py`
//! are the references; a test checks every type against gguf-py's values on a file gguf-py wrote).
//!
//! A block is stored as GGML lays it out: the scales first (f16), then the quants. The K-quants
//! (`q4_k`, `q5_k`, `q6_k`) group 256 values in sub-blocks of 32 or 16 with 6- or 8-bit scales.
//! The arithmetic is GGML's in f32, in its order, so the values are GGML's to the bit.

use half::{bf16, f16};

/// Values per K-quant super-block.
pub(crate) const QK_K: usize = 256;

/// A tensor type this reader supports, by GGML's id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Bf16,
    Q8_0,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q4K,
    Q5K,
    Q6K,
}

impl GgmlType {
    /// Every supported type.
    pub const ALL: [GgmlType; 11] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Bf16,
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
    ];

    /// The type of GGML id `id`, or its name when this reader does not support it.
    pub fn from_id(id: u32) -> Result<Self, String> {
        Ok(match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            6 => GgmlType::Q5_0,
            7 => GgmlType::Q5_1,
            8 => GgmlType::Q8_0,
            12 => GgmlType::Q4K,
            13 => GgmlType::Q5K,
            14 => GgmlType::Q6K,
            30 => GgmlType::Bf16,
            other => {
                let name = match other {
                    9 => "Q8_1",
                    10 => "Q2_K",
                    11 => "Q3_K",
                    15 => "Q8_K",
                    16..=23 | 29 => "an IQ type",
                    24 => "I8",
                    25 => "I16",
                    26 => "I32",
                    27 => "I64",
                    28 => "F64",
                    34 | 35 => "a ternary type",
                    39 => "MXFP4",
                    _ => "an unknown type",
                };
                return Err(format!(
                    "tensor type {name} (GGML id {other}) is not supported (F32, F16, BF16, Q8_0, Q4_0, Q4_1, \
                     Q5_0, Q5_1, Q4_K, Q5_K, Q6_K)"
                ));
            }
        })
    }

    /// GGML's id.
    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q5_0 => 6,
            GgmlType::Q5_1 => 7,
            GgmlType::Q8_0 => 8,
            GgmlType::Q4K => 12,
            GgmlType::Q5K => 13,
            GgmlType::Q6K => 14,
            GgmlType::Bf16 => 30,
        }
    }

    /// GGML's name (`Q4_K`, …).
    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::Bf16 => "BF16",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4_1 => "Q4_1",
            GgmlType::Q5_0 => "Q5_0",
            GgmlType::Q5_1 => "Q5_1",
            GgmlType::Q4K => "Q4_K",
            GgmlType::Q5K => "Q5_K",
            GgmlType::Q6K => "Q6_K",
        }
    }

    /// Values per block and bytes per block.
    pub fn block(self) -> (usize, usize) {
        match self {
            GgmlType::F32 => (1, 4),
            GgmlType::F16 | GgmlType::Bf16 => (1, 2),
            GgmlType::Q8_0 => (32, 34),
            GgmlType::Q4_0 => (32, 18),
            GgmlType::Q4_1 => (32, 20),
            GgmlType::Q5_0 => (32, 22),
            GgmlType::Q5_1 => (32, 24),
            GgmlType::Q4K => (QK_K, 144),
            GgmlType::Q5K => (QK_K, 176),
            GgmlType::Q6K => (QK_K, 210),
        }
    }

    /// Bytes of `n` values (a whole number of blocks), or None when `n` does not split into
    /// blocks or the count overflows.
    pub fn bytes_of(self, n: u64) -> Option<u64> {
        let (values, bytes) = self.block();
        n.is_multiple_of(values as u64)
            .then(|| (n / values as u64).checked_mul(bytes as u64))?
    }

    /// `values` (whole blocks) stored as this type, as llama.cpp's converter (gguf-py) and
    /// `ggml-quants.c`'s reference functions store them: f16 and bf16 rounded to nearest even,
    /// `q8_0` rounded half away from zero. None for the types kvlens does not write (the
    /// K-quants and the `_1`/`q5` types, which `llama-quantize` makes).
    pub fn quantize(self, values: &[f32]) -> Option<Vec<u8>> {
        let (block, bytes) = self.block();
        if !values.len().is_multiple_of(block) {
            return None;
        }
        let mut out = Vec::with_capacity(values.len() / block * bytes);
        match self {
            GgmlType::F32 => values.iter().for_each(|v| out.extend(v.to_le_bytes())),
            GgmlType::F16 => values.iter().for_each(|&v| out.extend(f16::from_f32(v).to_le_bytes())),
            GgmlType::Bf16 => values.iter().for_each(|&v| out.extend(bf16::from_f32(v).to_le_bytes())),
            GgmlType::Q8_0 => {
                let mut q = [0i8; 32];
                for chunk in values.chunks_exact(32) {
                    let d = super::blocks::quantize_q8(chunk, &mut q, f32::round);
                    out.extend(f16::from_f32(d).to_le_bytes());
                    out.extend(q.iter().map(|&q| q as u8));
                }
            }
            GgmlType::Q4_0 => {
                let mut q = [0u8; 16];
                for chunk in values.chunks_exact(32) {
                    let d = super::blocks::quantize_block(super::blocks::BlockKind::Q4_0, chunk, &mut q);
                    out.extend(f16::from_f32(d).to_le_bytes());
                    out.extend(q);
                }
            }
            _ => return None,
        }
        Some(out)
    }

    /// Dequantizes whole blocks: `data` holds `out.len()` values' blocks.
    pub fn dequantize(self, data: &[u8], out: &mut [f32]) {
        let (values, bytes) = self.block();
        debug_assert_eq!(data.len() / bytes * values, out.len());
        for (block, out) in data.chunks_exact(bytes).zip(out.chunks_exact_mut(values)) {
            match self {
                GgmlType::F32 => out[0] = f32::from_le_bytes([block[0], block[1], block[2], block[3]]),
                GgmlType::F16 => out[0] = f16::from_le_bytes([block[0], block[1]]).to_f32(),
                GgmlType::Bf16 => out[0] = bf16::from_le_bytes([block[0], block[1]]).to_f32(),
                GgmlType::Q8_0 => {
                    let d = half_at(block, 0);
                    for (o, &q) in out.iter_mut().zip(&block[2..]) {
                        *o = d * q as i8 as f32;
                    }
                }
                GgmlType::Q4_0 => {
                    let d = half_at(block, 0);
                    nibbles(&block[2..], out, |q| d * (q as f32 - 8.0));
                }
                GgmlType::Q4_1 => {
                    let (d, m) = (half_at(block, 0), half_at(block, 2));
                    nibbles(&block[4..], out, |q| d * q as f32 + m);
                }
                GgmlType::Q5_0 => {
                    let d = half_at(block, 0);
                    five_bits(&block[2..6], &block[6..], out, |q| d * (q as f32 - 16.0));
                }
                GgmlType::Q5_1 => {
                    let (d, m) = (half_at(block, 0), half_at(block, 2));
                    five_bits(&block[4..8], &block[8..], out, |q| d * q as f32 + m);
                }
                GgmlType::Q4K => k_quant(block, None, out),
                GgmlType::Q5K => k_quant(block, Some(&block[16..48]), out),
                GgmlType::Q6K => q6_k(block, out),
            }
        }
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The f16 at byte `at`, widened.
#[inline(always)]
pub(crate) fn half_at(block: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([block[at], block[at + 1]]).to_f32()
}

/// 32 values from 16 bytes of nibbles: value `j` in the low half of byte `j`, `j + 16` in the high
/// (`q4_0` and `q4_1` here, and [`super::blocks::BlockRows`]' `q4_0` quants).
pub(crate) fn nibbles(qs: &[u8], out: &mut [f32], value: impl Fn(u8) -> f32) {
    let (lo, hi) = out.split_at_mut(16);
    for ((l, h), &q) in lo.iter_mut().zip(hi).zip(qs) {
        *l = value(q & 0x0F);
        *h = value(q >> 4);
    }
}

/// 32 five-bit values: the nibbles of `qs` as in [`nibbles`], bit `j` of the little-endian `qh`
/// the fifth bit of value `j`.
fn five_bits(qh: &[u8], qs: &[u8], out: &mut [f32], value: impl Fn(u8) -> f32) {
    let qh = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
    let high = |j: usize| (((qh >> j) & 1) as u8) << 4;
    for (j, &q) in qs.iter().enumerate() {
        out[j] = value((q & 0x0F) | high(j));
        out[j + 16] = value((q >> 4) | high(j + 16));
    }
}

/// Sub-block `j`'s 6-bit scale and minimum from a K-quant's 12 packed bytes.
fn scale_min(scales: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (scales[j] & 63, scales[j + 4] & 63)
    } else {
        (
            (scales[j + 4] & 0x0F) | ((scales[j - 4] >> 6) << 4),
            (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4),
        )
    }
}

/// `q4_k` (`qh` None) or `q5_k`: d and dmin (f16), 12 bytes of scales and minimums, the fifth
/// bits (`q5_k`: bit `s` of byte `l` for value `l` of sub-block `s`), then 128 bytes of nibbles,
/// each 32 bytes holding two sub-blocks of 32 (low nibbles first).
fn k_quant(block: &[u8], qh: Option<&[u8]>, out: &mut [f32]) {
    let (d, dmin) = (half_at(block, 0), half_at(block, 2));
    let scales = &block[4..16];
    let qs = &block[if qh.is_some() { 48 } else { 16 }..];
    for sub in 0..8 {
        let (sc, m) = scale_min(scales, sub);
        let (d1, m1) = (d * sc as f32, dmin * m as f32);
        let bytes = &qs[sub / 2 * 32..][..32];
        for (l, o) in out[sub * 32..][..32].iter_mut().enumerate() {
            let low = if sub % 2 == 0 { bytes[l] & 0x0F } else { bytes[l] >> 4 };
            let high = qh.map_or(0, |qh| ((qh[l] >> sub) & 1) << 4);
            *o = d1 * (low | high) as f32 - m1;
        }
    }
}

/// `q6_k`: 128 bytes of low nibbles, 64 of high bit pairs, 16 signed 8-bit scales (one per 16
/// values), d (f16); each half of 128 values reads 64 low bytes and 32 high bytes.
fn q6_k(block: &[u8], out: &mut [f32]) {
    let (ql, qh, scales) = (&block[..128], &block[128..192], &block[192..208]);
    let d = half_at(block, 208);
    for (e, o) in out.iter_mut().enumerate() {
        let (half, within) = (e / 128, e % 128);
        let (shift, lane) = (within / 32, within % 32);
        let low = (ql[half * 64 + within % 64] >> (4 * (within / 64))) & 0x0F;
        let high = (qh[half * 32 + lane] >> (2 * shift)) & 3;
        let q = (low | (high << 4)) as i32 - 32;
        *o = d * scales[e / 16] as i8 as f32 * q as f32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_unsupported_types_are_named() {
        for t in GgmlType::ALL {
            assert_eq!(GgmlType::from_id(t.id()), Ok(t));
        }
        assert!(GgmlType::from_id(11).unwrap_err().contains("Q3_K"));
        assert!(GgmlType::from_id(99).unwrap_err().contains("unknown"));
        assert_eq!(GgmlType::Q4K.bytes_of(512), Some(288));
        assert_eq!(GgmlType::Q4K.bytes_of(100), None, "not whole super-blocks");
        assert_eq!(GgmlType::F32.bytes_of(u64::MAX), None, "overflow");
    }
}
