//! Causal attention over the paged KV cache in tiles: queries in chunks, keys in tiles gathered
//! from their blocks one tile at a time, with an online softmax (running max and sum) across the
//! tiles. Memory stays at one tile's scores however long the context, and every buffer a tile
//! holds is recorded in the ledger as activations while it lives.

use crate::memory::ledger::{Category, MemoryLedger};
use candle_core::{Device, Tensor, D};

/// Tile sizes: query rows per chunk and context positions per key tile.
#[derive(Debug, Clone, Copy)]
pub(super) struct Tiles {
    pub queries: usize,
    pub keys: usize,
}

/// The tiles the backend uses.
pub(super) const TILES: Tiles = Tiles {
    queries: 512,
    keys: 1024,
};

/// One sequence's attention input.
pub(super) struct SeqAttention<'a> {
    /// This sequence's queries, `[n, heads · d]`.
    pub q: Tensor,
    /// Keys and values of the layer, `[slots, kv_heads · d]` flattened.
    pub keys: &'a [f32],
    pub values: &'a [f32],
    /// Slot of each context position.
    pub slot_of: &'a dyn Fn(usize) -> usize,
    /// Positions in the cache, the last `n` being the queries'.
    pub context_len: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// Attention output `[n, heads · d]` of one sequence.
pub(super) fn attend(s: &SeqAttention<'_>, ledger: &MemoryLedger, tiles: Tiles) -> candle_core::Result<Tensor> {
    let dev = &Device::Cpu;
    let (n, cols) = s.q.dims2()?;
    let (kvh, d, ctx) = (s.kv_heads, s.head_dim, s.context_len);
    let heads = cols / d;
    let group = heads / kvh;
    let width = kvh * d;
    let scale = 1.0 / (d as f64).sqrt();
    let mut outs = Vec::new();
    for q0 in (0..n).step_by(tiles.queries) {
        let qn = tiles.queries.min(n - q0);
        // Query row i of this chunk sits at position ctx − n + q0 + i.
        let first_pos = ctx - n + q0;
        let last_pos = first_pos + qn - 1;
        let rows = group * qn;
        let qs =
            s.q.narrow(0, q0, qn)?
                .reshape((qn, kvh, group, d))?
                .permute((1, 2, 0, 3))?
                .contiguous()?
                .reshape((kvh, rows, d))?;
        let _acc = ledger.hold(Category::Activations, (kvh * rows * (d + 2) * 4) as u64);
        let mut m = Tensor::full(f32::NEG_INFINITY, (kvh, rows, 1), dev)?;
        let mut l = Tensor::zeros((kvh, rows, 1), candle_core::DType::F32, dev)?;
        let mut o = Tensor::zeros((kvh, rows, d), candle_core::DType::F32, dev)?;
        for k0 in (0..=last_pos).step_by(tiles.keys) {
            let kl = tiles.keys.min(last_pos + 1 - k0);
            // Gathered keys and values, the scores and their exponentials.
            let _tile = ledger.hold(
                Category::Activations,
                ((2 * kl * width + 3 * kvh * rows * kl + rows * kl) * 4) as u64,
            );
            let mut kc = Vec::with_capacity(kl * width);
            let mut vc = Vec::with_capacity(kl * width);
            for pos in k0..k0 + kl {
                let slot = (s.slot_of)(pos);
                kc.extend_from_slice(&s.keys[slot * width..(slot + 1) * width]);
                vc.extend_from_slice(&s.values[slot * width..(slot + 1) * width]);
            }
            let k = Tensor::from_vec(kc, (kl, kvh, d), dev)?.transpose(0, 1)?.contiguous()?;
            let v = Tensor::from_vec(vc, (kl, kvh, d), dev)?.transpose(0, 1)?.contiguous()?;
            let mut scores = (qs.matmul(&k.t()?)? * scale)?;
            if k0 + kl - 1 > first_pos {
                // Keys past a query's own position are masked (the first tile always leaves
                // position 0 visible, so every row's running max is finite after it).
                let mut mask = vec![0.0f32; rows * kl];
                for g in 0..group {
                    for i in 0..qn {
                        let visible = (first_pos + i + 1).saturating_sub(k0).min(kl);
                        let row = &mut mask[(g * qn + i) * kl..(g * qn + i + 1) * kl];
                        row[visible..].iter_mut().for_each(|x| *x = f32::NEG_INFINITY);
                    }
                }
                scores = scores.broadcast_add(&Tensor::from_vec(mask, (rows, kl), dev)?)?;
            }
            let m_new = m.maximum(&scores.max_keepdim(D::Minus1)?)?;
            let p = scores.broadcast_sub(&m_new)?.exp()?;
            let alpha = (m - &m_new)?.exp()?;
            l = (l.broadcast_mul(&alpha)? + p.sum_keepdim(D::Minus1)?)?;
            o = (o.broadcast_mul(&alpha)? + p.matmul(&v)?)?;
            m = m_new;
        }
        let out = o.broadcast_div(&l)?;
        outs.push(
            out.reshape((kvh, group, qn, d))?
                .permute((2, 0, 1, 3))?
                .contiguous()?
                .reshape((qn, heads * d))?,
        );
    }
    Tensor::cat(&outs, 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Dense causal attention with one softmax per row, as the reference; `dims` is
    /// (query rows, context, heads, KV heads, head size).
    fn dense(q: &[f32], k: &[f32], v: &[f32], dims: (usize, usize, usize, usize, usize)) -> Vec<f32> {
        let (n, ctx, heads, kvh, d) = dims;
        let group = heads / kvh;
        let mut out = vec![0.0; n * heads * d];
        for i in 0..n {
            let pos = ctx - n + i;
            for h in 0..heads {
                let kh = h / group;
                let qh = &q[i * heads * d + h * d..][..d];
                let s: Vec<f32> = (0..=pos)
                    .map(|j| (0..d).map(|c| qh[c] * k[j * kvh * d + kh * d + c]).sum::<f32>() / (d as f32).sqrt())
                    .collect();
                let m = s.iter().cloned().fold(f32::MIN, f32::max);
                let e: Vec<f32> = s.iter().map(|x| (x - m).exp()).collect();
                let z: f32 = e.iter().sum();
                for c in 0..d {
                    out[i * heads * d + h * d + c] = (0..=pos).map(|j| e[j] / z * v[j * kvh * d + kh * d + c]).sum();
                }
            }
        }
        out
    }

    #[test]
    fn tiles_of_any_size_give_dense_causal_attention_and_release_their_bytes() {
        let (heads, kvh, d, ctx, n) = (4, 2, 3, 23, 9);
        let k: Vec<f32> = (0..ctx * kvh * d).map(|i| (i as f32 * 0.37).sin()).collect();
        let v: Vec<f32> = (0..ctx * kvh * d).map(|i| (i as f32 * 0.11).cos()).collect();
        let q: Vec<f32> = (0..n * heads * d).map(|i| (i as f32 * 0.23).sin()).collect();
        let want = dense(&q, &k, &v, (n, ctx, heads, kvh, d));
        // Slots reversed, so the gather is exercised.
        let slot_of = |p: usize| ctx - 1 - p;
        let (mut kr, mut vr) = (vec![0.0; k.len()], vec![0.0; v.len()]);
        for p in 0..ctx {
            let w = kvh * d;
            kr[slot_of(p) * w..][..w].copy_from_slice(&k[p * w..][..w]);
            vr[slot_of(p) * w..][..w].copy_from_slice(&v[p * w..][..w]);
        }
        let ledger = MemoryLedger::new();
        for (queries, keys) in [(512, 1024), (2, 3), (4, 5), (1, 1), (9, 23)] {
            let s = SeqAttention {
                q: Tensor::from_vec(q.clone(), (n, heads * d), &Device::Cpu).unwrap(),
                keys: &kr,
                values: &vr,
                slot_of: &slot_of,
                context_len: ctx,
                kv_heads: kvh,
                head_dim: d,
            };
            let got = attend(&s, &ledger, Tiles { queries, keys }).unwrap();
            let got = got.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            for (a, b) in got.iter().zip(&want) {
                assert!((a - b).abs() < 1e-5, "tiles {queries}×{keys}: {a} vs {b}");
            }
            assert_eq!(ledger.bytes(Category::Activations), 0);
            assert!(ledger.peak(Category::Activations) > 0);
        }
    }
}
