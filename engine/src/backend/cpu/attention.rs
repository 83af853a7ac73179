//! Causal attention over the paged KV cache in tiles: queries in chunks, keys in tiles gathered
//! from their blocks one tile at a time, with an online softmax (running max and sum) across the
//! tiles. Memory stays at one tile's scores however long the context, and every buffer a tile
//! holds is recorded in the ledger as activations while it lives. A few query rows (decode) instead
//! read the keys and values where they sit in the cache, in tasks of positions: gathering them
//! into tiles would copy the whole context for every token.

use super::isa::fastest;
use super::segment_attention::{matmul, Operand};
use super::vector_math::exp_shifted_by_max;
use crate::memory::ledger::{Category, MemoryLedger};
use crate::parallel::for_each_piece;
use candle_core::{Device, Tensor};

/// Tile sizes: query rows per task and context positions per key tile; up to `in_place` query
/// rows, no tiles: the cache is read in place.
#[derive(Debug, Clone, Copy)]
pub(super) struct Tiles {
    pub queries: usize,
    pub keys: usize,
    pub in_place: usize,
}

/// The tiles the backend uses: a task's scores (64 query rows times the heads sharing a KV head,
/// by 512 positions) stay in a core's L2 cache, and a 519-token prompt makes nine tasks for the
/// pool (causal rows cost more the later they sit, so a few large tasks would leave a thread idle).
pub(super) const TILES: Tiles = Tiles {
    queries: 64,
    keys: 512,
    in_place: 16,
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
    let (n, cols) = s.q.dims2()?;
    let scale = 1.0 / (s.head_dim as f32).sqrt();
    // The queries' copy and the output, while both exist.
    let _held = ledger.hold(Category::Activations, (2 * n * cols * 4) as u64);
    let q = s.q.flatten_all()?.to_vec1::<f32>()?;
    let out = if n <= tiles.in_place {
        attend_in_place(s, &q, n, scale, ledger)
    } else {
        attend_tiled(s, &q, n, scale, ledger, tiles)
    };
    Tensor::from_vec(out, (n, cols), &Device::Cpu)
}

/// What the tasks of [`attend_tiled`] read: the sequence as [`attend_in_place`]'s read it, and
/// the tile sizes.
struct Tiled<'a> {
    seq: Resolved<'a>,
    tiles: Tiles,
}

impl Tiled<'_> {
    /// Query rows `first..` (as many as `out` holds, `[rows, heads · d]`), per KV head: the heads
    /// sharing it gathered as one matrix of rows, the context in key tiles gathered from their
    /// slots, each tile's scores by one product, their exponentials shifted by a running max, and
    /// the values' weighted sum by another product into the running output.
    fn run(&self, first: usize, out: &mut [f32]) {
        let seq = &self.seq;
        let (kvh, d, ctx) = (seq.kv_heads, seq.head_dim, seq.context_len);
        let cols = seq.q.len() / seq.n;
        let (qn, group, width) = (out.len() / cols, seq.group, kvh * d);
        let rows = group * qn;
        // Query row i sits at position first_pos + i; row r of a head's matrix is (head r / qn, i = r % qn).
        let first_pos = ctx - seq.n + first;
        let last_pos = first_pos + qn - 1;
        let keys = self.tiles.keys.max(1);
        let (mut qs, mut o) = (vec![0f32; rows * d], vec![0f32; rows * d]);
        let (mut kt, mut vt) = (vec![0f32; keys * d], vec![0f32; keys * d]);
        let mut scores = vec![0f32; rows * keys];
        let (mut max, mut sum) = (vec![0f32; rows], vec![0f32; rows]);
        for h in 0..kvh {
            for (r, row) in qs.chunks_exact_mut(d).enumerate() {
                let (g, i) = (r / qn, r % qn);
                row.copy_from_slice(&seq.q[(first + i) * cols + (h * group + g) * d..][..d]);
            }
            o.fill(0.0);
            max.fill(f32::NEG_INFINITY);
            sum.fill(0.0);
            for k0 in (0..=last_pos).step_by(keys) {
                let kl = keys.min(last_pos + 1 - k0);
                for j in 0..kl {
                    let at = seq.slots[k0 + j] * width + h * d;
                    kt[j * d..][..d].copy_from_slice(&seq.keys[at..][..d]);
                    vt[j * d..][..d].copy_from_slice(&seq.values[at..][..d]);
                }
                // Keys transposed by their strides: element (c, j) is key j's column c.
                let (a, b) = (
                    Operand {
                        data: &qs,
                        rows: d,
                        cols: 1,
                    },
                    Operand {
                        data: &kt,
                        rows: 1,
                        cols: d,
                    },
                );
                matmul([rows, kl, d], &mut scores, kl, (a, b), seq.scale, false);
                for (r, row) in scores.chunks_exact_mut(kl).take(rows).enumerate() {
                    // Keys past the query's own position are masked.
                    let visible = (first_pos + r % qn + 1).saturating_sub(k0).min(kl);
                    row[visible..].fill(0.0);
                    if visible == 0 {
                        continue;
                    }
                    let (tile_max, tile_sum) = exp_shifted_by_max(&mut row[..visible]);
                    let new_max = max[r].max(tile_max);
                    let (old, this) = ((max[r] - new_max).exp(), (tile_max - new_max).exp());
                    if this != 1.0 {
                        row[..visible].iter_mut().for_each(|p| *p *= this);
                    }
                    if old != 1.0 {
                        o[r * d..][..d].iter_mut().for_each(|x| *x *= old);
                    }
                    sum[r] = sum[r] * old + tile_sum * this;
                    max[r] = new_max;
                }
                let (p, v) = (
                    Operand {
                        data: &scores,
                        rows: kl,
                        cols: 1,
                    },
                    Operand {
                        data: &vt,
                        rows: d,
                        cols: 1,
                    },
                );
                matmul([rows, d, kl], &mut o, d, (p, v), 1.0, true);
            }
            for (r, row) in o.chunks_exact(d).enumerate() {
                let (g, i) = (r / qn, r % qn);
                let inv = 1.0 / sum[r];
                let dst = &mut out[i * cols + (h * group + g) * d..][..d];
                dst.iter_mut().zip(row).for_each(|(y, x)| *y = x * inv);
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    fn run_avx2(&self, first: usize, out: &mut [f32]) {
        self.run(first, out)
    }

    /// [`Tiled::run`] compiled for the widest instructions this CPU has.
    fn run_fastest(&self, first: usize, out: &mut [f32]) {
        fastest!(avx2_fma => self.run_avx2(first, out), _ => self.run(first, out))
    }
}

/// Attention of many query rows: tasks of [`Tiles::queries`] rows (all heads) shared out over
/// the pool, each taking the context in tiles of [`Tiles::keys`] positions with an online softmax
/// (running max and sum) across the tiles. Memory stays at one task's tiles per thread however
/// long the context; they are recorded in `ledger` while they live.
fn attend_tiled(
    s: &SeqAttention<'_>,
    q: &[f32],
    n: usize,
    scale: f32,
    ledger: &MemoryLedger,
    tiles: Tiles,
) -> Vec<f32> {
    let cols = q.len() / n.max(1);
    let qn = tiles.queries.clamp(1, n.max(1));
    let rows = cols / s.head_dim.max(1) / s.kv_heads.max(1) * qn;
    let keys = tiles.keys.max(1);
    let threads = candle_core::utils::barrier_pool().n_workers() + 1;
    let slots: Vec<usize> = (0..s.context_len).map(s.slot_of).collect();
    let _tiles = ledger.hold(
        Category::Activations,
        (threads * (2 * rows * s.head_dim + 2 * keys * s.head_dim + rows * keys + 2 * rows) * 4
            + slots.len() * std::mem::size_of::<usize>()) as u64,
    );
    let task = Tiled {
        seq: Resolved::new(s, q, n, scale, &slots),
        tiles,
    };
    let mut out = vec![0f32; n * cols];
    for_each_piece(&mut out, qn * cols, |p, piece| task.run_fastest(p * qn, piece));
    out
}

/// Lanes of the dot products' accumulators (vectorised by the compiler).
const LANES: usize = 8;

#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let (ac, bc) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = ac.remainder().iter().zip(bc.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ac.zip(bc) {
        for l in 0..LANES {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `out += p · v`.
#[inline(always)]
fn add_scaled(out: &mut [f32], p: f32, v: &[f32]) {
    for (o, &x) in out.iter_mut().zip(v) {
        *o += p * x;
    }
}

/// Context positions per task of [`attend_in_place`].
const POSITIONS_PER_TASK: usize = 64;

/// One sequence's attention as its tasks read it: the cache, the slot of each context position
/// and the queries. [`attend_in_place`] numbers rows `(kv_head · n + i) · group + g` for query row
/// `i` and head `kv_head · group + g`.
struct Resolved<'a> {
    keys: &'a [f32],
    values: &'a [f32],
    kv_heads: usize,
    head_dim: usize,
    context_len: usize,
    q: &'a [f32],
    slots: &'a [usize],
    n: usize,
    group: usize,
    scale: f32,
}

/// One task's share of the softmax: per row the largest score of its positions, the sum of their
/// exponentials shifted by it, and their values weighted by those (`[rows, d]`). A row that sees
/// none of the positions has max −∞ and sums 0.
struct Partial {
    max: Vec<f32>,
    sum: Vec<f32>,
    values: Vec<f32>,
}

impl<'a> Resolved<'a> {
    /// `s` with its slots resolved to `slots` and its queries `q` (`n` rows).
    fn new(s: &SeqAttention<'a>, q: &'a [f32], n: usize, scale: f32, slots: &'a [usize]) -> Self {
        let cols = q.len() / n.max(1);
        Resolved {
            keys: s.keys,
            values: s.values,
            kv_heads: s.kv_heads,
            head_dim: s.head_dim,
            context_len: s.context_len,
            q,
            slots,
            n,
            group: cols / s.head_dim.max(1) / s.kv_heads.max(1),
            scale,
        }
    }

    fn rows(&self) -> usize {
        self.kv_heads * self.n * self.group
    }

    /// Query row `i` sees positions `0..visible(i)`.
    fn visible(&self, i: usize) -> usize {
        self.context_len - self.n + i + 1
    }

    /// Positions `first..first + len`, all heads, in one pass: the scores against each slot's
    /// keys, their exponentials, the values weighted by them (each slot's keys and values are one
    /// contiguous row of the cache).
    #[inline(always)]
    fn run(&self, first: usize, len: usize) -> Partial {
        let (d, n, group) = (self.head_dim, self.n, self.group);
        let width = self.kv_heads * d;
        let cols = width * group;
        let rows = self.rows();
        let mut scores = vec![0f32; rows * len];
        for pos in first..first + len {
            let at = self.slots[pos] * width;
            for kh in 0..self.kv_heads {
                let k = &self.keys[at + kh * d..][..d];
                for i in (0..n).filter(|&i| pos < self.visible(i)) {
                    for g in 0..group {
                        let r = (kh * n + i) * group + g;
                        let q = &self.q[i * cols + (kh * group + g) * d..][..d];
                        scores[r * len + pos - first] = dot(q, k) * self.scale;
                    }
                }
            }
        }
        let mut part = Partial {
            max: vec![f32::NEG_INFINITY; rows],
            sum: vec![0f32; rows],
            values: vec![0f32; rows * d],
        };
        for (r, row) in scores.chunks_exact_mut(len.max(1)).enumerate() {
            let seen = self.visible(r / group % n).saturating_sub(first).min(len);
            if seen > 0 {
                (part.max[r], part.sum[r]) = exp_shifted_by_max(&mut row[..seen]);
            }
        }
        for pos in first..first + len {
            let at = self.slots[pos] * width;
            for kh in 0..self.kv_heads {
                let v = &self.values[at + kh * d..][..d];
                for i in (0..n).filter(|&i| pos < self.visible(i)) {
                    for g in 0..group {
                        let r = (kh * n + i) * group + g;
                        add_scaled(&mut part.values[r * d..(r + 1) * d], scores[r * len + pos - first], v);
                    }
                }
            }
        }
        part
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    fn run_avx2(&self, first: usize, len: usize) -> Partial {
        self.run(first, len)
    }

    /// [`Resolved::run`] compiled for the widest instructions this CPU has.
    fn run_fastest(&self, first: usize, len: usize) -> Partial {
        fastest!(avx2_fma => self.run_avx2(first, len), _ => self.run(first, len))
    }
}

/// Attention of `n` query rows (`q`, `[n, heads · d]`) over the cache in place, in one pass over
/// the context split into tasks of [`POSITIONS_PER_TASK`] positions on candle's thread pool (each
/// task's scores, softmax share and weighted values, see [`Partial`]), the shares then combined
/// per row. Holds (and records) each task's scores and share.
fn attend_in_place(s: &SeqAttention<'_>, q: &[f32], n: usize, scale: f32, ledger: &MemoryLedger) -> Vec<f32> {
    let (d, ctx, cols) = (s.head_dim, s.context_len, q.len() / n.max(1));
    let slots: Vec<usize> = (0..ctx).map(s.slot_of).collect();
    let job = Resolved::new(s, q, n, scale, &slots);
    let rows = job.rows();
    let tasks = ctx.div_ceil(POSITIONS_PER_TASK);
    let _held = ledger.hold(
        Category::Activations,
        ((tasks * rows * (d + 2 + POSITIONS_PER_TASK)) * 4 + ctx * std::mem::size_of::<usize>()) as u64,
    );
    let mut parts: Vec<Option<Partial>> = (0..tasks).map(|_| None).collect();
    for_each_piece(&mut parts, 1, |t, part| {
        let first = t * POSITIONS_PER_TASK;
        part[0] = Some(job.run_fastest(first, POSITIONS_PER_TASK.min(ctx - first)));
    });
    let parts: Vec<Partial> = parts.into_iter().flatten().collect();
    let mut sums = vec![0f32; rows * d];
    for (r, out) in sums.chunks_exact_mut(d).enumerate() {
        let max = parts.iter().fold(f32::NEG_INFINITY, |m, p| m.max(p.max[r]));
        let mut total = 0f32;
        for p in parts.iter().filter(|p| p.sum[r] > 0.0) {
            let w = (p.max[r] - max).exp();
            total += w * p.sum[r];
            add_scaled(out, w, &p.values[r * d..(r + 1) * d]);
        }
        out.iter_mut().for_each(|x| *x /= total);
    }
    // Rows `[kv_head, n, group, d]` to `[n, heads · d]`.
    let mut out = vec![0f32; n * cols];
    for (r, o) in sums.chunks_exact(d).enumerate() {
        let (kh, i, g) = (r / (n * job.group), r / job.group % n, r % job.group);
        out[i * cols + (kh * job.group + g) * d..][..d].copy_from_slice(o);
    }
    out
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
        let (heads, kvh, d, ctx) = (4, 2, 3, 150);
        let k: Vec<f32> = (0..ctx * kvh * d).map(|i| (i as f32 * 0.37).sin()).collect();
        let v: Vec<f32> = (0..ctx * kvh * d).map(|i| (i as f32 * 0.11).cos()).collect();
        // Slots reversed, so the gather is exercised.
        let slot_of = |p: usize| ctx - 1 - p;
        let (mut kr, mut vr) = (vec![0.0; k.len()], vec![0.0; v.len()]);
        for p in 0..ctx {
            let w = kvh * d;
            kr[slot_of(p) * w..][..w].copy_from_slice(&k[p * w..][..w]);
            vr[slot_of(p) * w..][..w].copy_from_slice(&v[p * w..][..w]);
        }
        let ledger = MemoryLedger::new();
        // 80 query rows in place: the first rows see none of the last task's positions.
        for (n, queries, keys, in_place) in [
            (9, 512, 1024, 0),
            (9, 2, 3, 0),
            (9, 4, 5, 0),
            (9, 1, 1, 0),
            (9, 9, 23, 0),
            (9, 1, 1, 9),
            (80, 7, 33, 0),
            (80, 1, 1, 80),
        ] {
            let q: Vec<f32> = (0..n * heads * d).map(|i| (i as f32 * 0.23).sin()).collect();
            let want = dense(&q, &k, &v, (n, ctx, heads, kvh, d));
            let s = SeqAttention {
                q: Tensor::from_vec(q.clone(), (n, heads * d), &Device::Cpu).unwrap(),
                keys: &kr,
                values: &vr,
                slot_of: &slot_of,
                context_len: ctx,
                kv_heads: kvh,
                head_dim: d,
            };
            let got = attend(
                &s,
                &ledger,
                Tiles {
                    queries,
                    keys,
                    in_place,
                },
            )
            .unwrap();
            let got = got.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            for (a, b) in got.iter().zip(&want) {
                assert!(
                    (a - b).abs() < 1e-5,
                    "{n} rows, tiles {queries}×{keys}, in place {in_place}: {a} vs {b}"
                );
            }
            assert_eq!(ledger.bytes(Category::Activations), 0);
            assert!(ledger.peak(Category::Activations) > 0);
        }
    }
}
