//! Weight matrices in GGML's `q8_0` / `q4_0` on the device: quantized on load by the CPU backend's
//! code (one definition of each format, so the dequantized values are the same), then laid out as
//! `kernels/weights_blocks.wgsl` reads them: pairs of blocks, a word of their two f16 scales, then
//! their quants (`q8_0`: the CPU's bytes, `q + 128`; `q4_0`: eight nibbles per word in element
//! order). The bytes are the format's, plus two when a part has an odd count of blocks.

use crate::arch::blocks::{BlockKind, BlockRows, BLOCK};

/// Words of one block's quants.
fn quant_words(kind: BlockKind) -> usize {
    kind.quant_bytes() / 4
}

/// Bytes `blocks` blocks take on the device.
pub(super) fn device_bytes(kind: BlockKind, blocks: usize) -> u64 {
    let pair = 1 + 2 * quant_words(kind);
    let words = blocks / 2 * pair + (blocks % 2) * (1 + quant_words(kind));
    words as u64 * 4
}

/// Quantizes `values` (rows of `cols`, a multiple of 32) and lays the blocks out for the device.
/// Concatenated outputs form one part when every output but the last has an even count of blocks.
pub(super) fn device_blocks(kind: BlockKind, values: &[f32], cols: usize) -> Vec<u8> {
    let rows = BlockRows::quantize(kind, values, cols);
    let (qb, qw) = (kind.quant_bytes(), quant_words(kind));
    let blocks = values.len() / BLOCK;
    let mut out = vec![0u32; device_bytes(kind, blocks) as usize / 4];
    for (b, (&d, q)) in rows.scales().iter().zip(rows.quants().chunks_exact(qb)).enumerate() {
        let (base, second) = (b / 2 * (1 + 2 * qw), b % 2);
        out[base] |= u32::from(d) << (16 * second);
        let words = &mut out[base + 1 + second * qw..][..qw];
        match kind {
            BlockKind::Q8_0 => {
                for (w, c) in words.iter_mut().zip(q.chunks_exact(4)) {
                    *w = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
            BlockKind::Q4_0 => {
                // Value j is the low nibble of byte j, value j + 16 its high nibble.
                let nibble = |e: usize| {
                    u32::from(if e < BLOCK / 2 {
                        q[e] & 0x0F
                    } else {
                        q[e - BLOCK / 2] >> 4
                    })
                };
                for (t, w) in words.iter_mut().enumerate() {
                    *w = (0..8).fold(0, |acc, n| acc | nibble(8 * t + n) << (4 * n));
                }
            }
        }
    }
    bytemuck::cast_slice(&out).to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Dequantizes the device layout on the host, as the WGSL readers do.
    fn dequantize(kind: BlockKind, words: &[u32], n: usize) -> Vec<f32> {
        let qw = quant_words(kind);
        (0..n)
            .map(|i| {
                let (b, e) = (i / BLOCK, i % BLOCK);
                let base = b / 2 * (1 + 2 * qw);
                let d = half::f16::from_bits((words[base] >> (16 * (b % 2))) as u16).to_f32();
                let q = &words[base + 1 + (b % 2) * qw..];
                match kind {
                    BlockKind::Q8_0 => d * (((q[e / 4] >> (8 * (e % 4))) & 0xFF) as f32 - 128.0),
                    BlockKind::Q4_0 => d * (((q[e / 8] >> (4 * (e % 8))) & 0x0F) as f32 - 8.0),
                }
            })
            .collect()
    }

    /// The device layout holds the CPU backend's values, in the format's bytes (+2 for an odd
    /// count of blocks), and parts made of several calls line up.
    #[test]
    fn the_layout_holds_the_cpu_values_in_the_formats_bytes() {
        let cols = 96;
        for kind in [BlockKind::Q8_0, BlockKind::Q4_0] {
            for rows in [1usize, 2, 5] {
                let values: Vec<f32> = (0..rows * cols)
                    .map(|i| ((i * 37 % 101) as f32 - 50.0) * 1e-3)
                    .collect();
                let bytes = device_blocks(kind, &values, cols);
                let blocks = rows * cols / BLOCK;
                let format_bytes = blocks * (2 + kind.quant_bytes());
                assert_eq!(bytes.len(), format_bytes + 2 * (blocks % 2), "{kind:?} {rows}");
                assert_eq!(bytes.len() as u64, device_bytes(kind, blocks));
                let cpu = BlockRows::quantize(kind, &values, cols);
                let mut want = vec![0f32; values.len()];
                for (r, row) in want.chunks_exact_mut(cols).enumerate() {
                    cpu.dequantize_row(r, row);
                }
                let got = dequantize(kind, bytemuck::cast_slice(&bytes), values.len());
                assert_eq!(got, want, "{kind:?} {rows}");
            }
            // Two rows (an even count of blocks) then three: the same bytes as five at once.
            let values: Vec<f32> = (0..5 * 64).map(|i| (i as f32).sin()).collect();
            let mut parts = device_blocks(kind, &values[..128], 64);
            parts.extend(device_blocks(kind, &values[128..], 64));
            assert_eq!(parts, device_blocks(kind, &values, 64), "{kind:?}");
        }
    }
}
