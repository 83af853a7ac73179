//! Multimodal rotary positions (transformers' `get_rope_index`, <https://github.com/huggingface/transformers/blob/main/src/transformers/models/qwen2_vl/modeling_qwen2_vl.py>
//! and <https://github.com/huggingface/transformers/blob/main/src/transformers/models/qwen3_vl/modeling_qwen3_vl.py>): three position ids per token, and the
//! cos/sin tables built from them (Qwen2/2.5 chunked sections, Qwen3 interleaved).

use crate::arch::config::TextConfig;

/// A placeholder run in the prompt: `offset`, and the image's merged grid `(t, h', w')`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageSpan {
    /// First placeholder token.
    pub offset: usize,
    /// Merged grid: temporal slices, rows and columns of LLM tokens.
    pub grid: [usize; 3],
}

/// Position ids `(t, h, w)` for every prompt token and the `rope_delta` that continues them.
/// Images have a single temporal slice here (τ = 0 for all three families at t = 1).
pub fn mrope_positions(len: usize, images: &[ImageSpan]) -> (Vec<[i64; 3]>, i64) {
    let mut pos = Vec::with_capacity(len);
    let mut next: i64 = 0;
    let mut images = images.iter().peekable();
    let mut i = 0;
    while i < len {
        match images.peek() {
            Some(img) if img.offset == i => {
                let [t, h, w] = img.grid;
                let s = next;
                for k in 0..t {
                    for r in 0..h {
                        for c in 0..w {
                            pos.push([s + k as i64, s + r as i64, s + c as i64]);
                        }
                    }
                }
                i += t * h * w;
                next = s + (t.max(h).max(w) as i64 - 1) + 1;
                images.next();
            }
            _ => {
                pos.push([next; 3]);
                next += 1;
                i += 1;
            }
        }
    }
    pos.truncate(len);
    let max = pos.iter().flat_map(|p| p.iter().copied()).max().unwrap_or(-1);
    (pos, max + 1 - len as i64)
}

/// cos/sin `[tokens, rotary_dim]` for the given position ids (the rotated part of each head:
/// all of it but for Qwen3.5, which rotates a quarter).
pub fn mrope_tables(cfg: &TextConfig, positions: &[[i64; 3]]) -> (Vec<f32>, Vec<f32>) {
    let hd = cfg.rotary_dim;
    let half = hd / 2;
    let inv: Vec<f64> = (0..half)
        .map(|j| 1.0 / cfg.rope_theta.powf((2 * j) as f64 / hd as f64))
        .collect();
    let axis: Vec<usize> = (0..half).map(|j| axis_of(cfg, j)).collect();
    let mut cos = Vec::with_capacity(positions.len() * hd);
    let mut sin = Vec::with_capacity(positions.len() * hd);
    for p in positions {
        // HF computes the angles in float32.
        let phi: Vec<f32> = (0..half).map(|j| p[axis[j]] as f32 * inv[j] as f32).collect();
        for _ in 0..2 {
            cos.extend(phi.iter().map(|a| a.cos()));
            sin.extend(phi.iter().map(|a| a.sin()));
        }
    }
    (cos, sin)
}

/// Which axis (0 t, 1 h, 2 w) frequency `j` follows.
fn axis_of(cfg: &TextConfig, j: usize) -> usize {
    let s = &cfg.mrope_section;
    if cfg.mrope_interleaved {
        let h = s.get(1).copied().unwrap_or(0);
        let w = s.get(2).copied().unwrap_or(0);
        if j % 3 == 1 && j < 3 * h {
            1
        } else if j % 3 == 2 && j < 3 * w {
            2
        } else {
            0
        }
    } else {
        let mut end = 0;
        for (a, len) in s.iter().enumerate() {
            end += len;
            if j < end {
                return a.min(2);
            }
        }
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::config::bundled_config;

    #[test]
    fn positions_match_the_qwen2_vl_worked_example() {
        // [a, b, VS, I×6, VE, c, d] with a 2×3 merged image, as `get_rope_index` numbers it.
        let (pos, delta) = mrope_positions(
            12,
            &[ImageSpan {
                offset: 3,
                grid: [1, 2, 3],
            }],
        );
        let t: Vec<i64> = pos.iter().map(|p| p[0]).collect();
        let h: Vec<i64> = pos.iter().map(|p| p[1]).collect();
        let w: Vec<i64> = pos.iter().map(|p| p[2]).collect();
        assert_eq!(t, vec![0, 1, 2, 3, 3, 3, 3, 3, 3, 6, 7, 8]);
        assert_eq!(h, vec![0, 1, 2, 3, 3, 3, 4, 4, 4, 6, 7, 8]);
        assert_eq!(w, vec![0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7, 8]);
        assert_eq!(delta, -3);
    }

    #[test]
    fn section_assignment_per_family() {
        let q2 = bundled_config("Qwen2-VL-2B-Instruct").unwrap().text;
        assert_eq!(
            (axis_of(&q2, 15), axis_of(&q2, 16), axis_of(&q2, 39), axis_of(&q2, 40)),
            (0, 1, 1, 2)
        );
        let q3 = bundled_config("Qwen3-VL-2B-Instruct").unwrap().text;
        let axes: Vec<usize> = (0..64).map(|j| axis_of(&q3, j)).collect();
        assert_eq!(&axes[..6], &[0, 1, 2, 0, 1, 2]);
        assert_eq!(&axes[58..], &[1, 2, 0, 0, 0, 0]);
        assert_eq!(axes.iter().filter(|&&a| a == 0).count(), 24);
    }
}
