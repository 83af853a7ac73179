//! The small per-layer steps between the products, each one pass over the rows into one new
//! buffer: RMSNorm, the rotary embedding and the residual sum. candle composes them of five to
//! seven tensor ops, each allocating its result and its shape; in a decode, where the products
//! take microseconds, those ops were a tenth of the main thread's time while the pool's other
//! threads waited.

use super::isa::fastest;
use crate::parallel::for_each_piece;

/// Elements a pool task takes at least: a decode's few rows run on the calling thread.
const PER_TASK: usize = 1 << 16;

/// Runs `f(first_row, rows_out)` over `out`'s `width`-wide rows, in pieces over the pool when
/// there are many.
fn by_rows(out: &mut [f32], width: usize, f: impl Fn(usize, &mut [f32]) + Sync) {
    let rows_per_task = (PER_TASK / width.max(1)).max(1);
    for_each_piece(out, rows_per_task * width, |t, piece| f(t * rows_per_task, piece));
}

/// RMSNorm of each `w.len()`-wide row of `x`: `x · (mean(x²) + eps)^−½ · w`, in candle's order
/// (the mean as the sum times `1/n`; the product by the inverse, then by the weight).
pub(super) fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let width = w.len();
    let mut out = vec![0f32; x.len()];
    by_rows(&mut out, width, |first, piece| {
        let x = &x[first * width..][..piece.len()];
        fastest!(avx2_fma => rms_norm_avx2(x, w, eps, piece), _ => rms_norm_rows(x, w, eps, piece))
    });
    out
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn rms_norm_avx2(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    rms_norm_rows(x, w, eps, out)
}

#[inline(always)]
fn rms_norm_rows(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    const LANES: usize = 16;
    let width = w.len();
    for (row, o) in x.chunks_exact(width).zip(out.chunks_exact_mut(width)) {
        let mut sums = [0f32; LANES];
        let chunks = row.chunks_exact(LANES);
        let tail: f32 = chunks.remainder().iter().map(|v| v * v).sum();
        for c in chunks {
            for l in 0..LANES {
                sums[l] += c[l] * c[l];
            }
        }
        let mean = (sums.iter().sum::<f32>() + tail) * (1.0 / width as f32);
        let inv = 1.0 / (mean + eps).sqrt();
        for ((o, &v), &g) in o.iter_mut().zip(row).zip(w) {
            *o = v * inv * g;
        }
    }
}

/// The rotary embedding, rotate-half convention, of `x`'s `cols`-wide rows (whole heads of
/// `d = cos.len() / rows`): `x·cos + rotate_half(x)·sin` per head, `cos`/`sin` one `d`-wide row
/// per row of `x`. Each value is rounded as candle's ops round it (no fused multiply-add).
pub(super) fn rope(x: &[f32], cols: usize, cos: &[f32], sin: &[f32], d: usize) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    let half = d / 2;
    by_rows(&mut out, cols, |first, piece| {
        for (i, o) in piece.chunks_exact_mut(cols).enumerate() {
            let r = first + i;
            let (c, s) = (&cos[r * d..][..d], &sin[r * d..][..d]);
            for (head, oh) in x[r * cols..][..cols].chunks_exact(d).zip(o.chunks_exact_mut(d)) {
                let (a, b) = head.split_at(half);
                let (oa, ob) = oh.split_at_mut(half);
                for j in 0..half {
                    oa[j] = a[j] * c[j] + -b[j] * s[j];
                    ob[j] = b[j] * c[half + j] + a[j] * s[half + j];
                }
            }
        }
    });
    out
}

/// `a + b`, element by element (same length).
pub(super) fn sum(a: &[f32], b: &[f32]) -> Vec<f32> {
    let mut out = vec![0f32; a.len()];
    for_each_piece(&mut out, PER_TASK, |t, piece| {
        let at = t * PER_TASK;
        for ((o, &x), &y) in piece.iter_mut().zip(&a[at..]).zip(&b[at..]) {
            *o = x + y;
        }
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor, D};

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 8) as f32 / (1 << 23) as f32 - 1.0)
            .collect()
    }

    /// The same values as candle's composition of ops that the CPU backend used before, to
    /// float rounding (the sum of squares is added in another order); over many rows, so that
    /// the pieces on the pool are checked too.
    #[test]
    fn rms_norm_is_candles_composition() {
        for (rows, width) in [(1, 2048), (3, 128), (200, 1000), (5, 7)] {
            let (x, w) = (values(rows * width, 1), values(width, 2));
            let ours = rms_norm(&x, &w, 1e-6);
            let xt = Tensor::from_vec(x, (rows, width), &Device::Cpu).unwrap();
            let wt = Tensor::from_vec(w, width, &Device::Cpu).unwrap();
            let ms = xt.sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
            let inv = (ms + 1e-6).unwrap().sqrt().unwrap().recip().unwrap();
            let want: Vec<f32> = xt
                .broadcast_mul(&inv)
                .unwrap()
                .broadcast_mul(&wt)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            for (i, (a, b)) in ours.iter().zip(&want).enumerate() {
                assert!(
                    (a - b).abs() <= 2e-6 * b.abs().max(1e-3),
                    "{rows}×{width} at {i}: {a} against {b}"
                );
            }
        }
    }

    /// Bit for bit what candle's `x·cos + rotate_half(x)·sin` gives, over several heads and rows.
    #[test]
    fn rope_is_candles_composition_bit_for_bit() {
        for (rows, heads, d) in [(1, 16, 128), (70, 4, 64), (2, 1, 2)] {
            let cols = heads * d;
            let (x, cos, sin) = (values(rows * cols, 3), values(rows * d, 4), values(rows * d, 5));
            let ours = rope(&x, cols, &cos, &sin, d);
            let x3 = Tensor::from_vec(x, (rows, heads, d), &Device::Cpu).unwrap();
            let c = Tensor::from_vec(cos, (rows, 1, d), &Device::Cpu).unwrap();
            let s = Tensor::from_vec(sin, (rows, 1, d), &Device::Cpu).unwrap();
            let a = x3.narrow(D::Minus1, 0, d / 2).unwrap();
            let b = x3.narrow(D::Minus1, d / 2, d / 2).unwrap();
            let rotated = Tensor::cat(&[&b.neg().unwrap(), &a], D::Minus1).unwrap();
            let want = x3
                .broadcast_mul(&c)
                .unwrap()
                .add(&rotated.broadcast_mul(&s).unwrap())
                .unwrap();
            let want: Vec<f32> = want.flatten_all().unwrap().to_vec1().unwrap();
            assert_eq!(ours, want, "{rows} rows of {heads} heads of {d}");
        }
    }

    #[test]
    fn sums_every_element_across_pieces() {
        let n = 3 * PER_TASK + 17;
        let (a, b) = (values(n, 6), values(n, 7));
        let s = sum(&a, &b);
        assert!(s.iter().zip(a.iter().zip(&b)).all(|(s, (x, y))| *s == x + y));
        assert!(sum(&[], &[]).is_empty());
    }
}
