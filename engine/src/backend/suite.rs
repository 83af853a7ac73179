//! The operation tests every backend must pass, written once over [`Backend`]. A backend runs the
//! whole suite with one line in its test module: `crate::backend_suite!(MyBackend::new());`.
//! Tolerances are those of f32 accumulation.

use super::{block_on, Activation, Backend, KvLayout, PagedBatch, PagedSeq, TableShape, TableWrite};
use crate::memory::ledger::Category;
use crate::sample::{DeviceSampling, Rng};

/// The backend the others are checked against and the model's tests load onto: the CPU backend
/// (no device, candle's f32 products and ours). Tests elsewhere name it through here, so that only
/// the suite and the CPU backend itself depend on which backend that is.
pub type Reference = crate::backend::cpu::CpuBackend;

/// Declares one `#[test]` per suite function for the backend `$make` builds; with
/// `ignored "why";` first, each test is `#[ignore]`d with that reason (a backend that needs
/// hardware the test machine may lack, run with `--ignored` where it is present).
#[macro_export]
macro_rules! backend_suite {
    (ignored $why:literal; $make:expr) => {
        $crate::backend_suite!(@list [$why] $make);
    };
    (@list [$($why:literal)?] $make:expr) => {
        $crate::backend_suite!(@tests [$($why)?] $make;
            linear_norms_and_activations,
            paged_attention_matches_dense_causal_attention,
            chunked_segment_attention_matches_a_direct_softmax,
            rope_rotates_halves_and_segments_stay_apart,
            fused_operations_match_host_references,
            rows_gather_scatter_and_concat,
            sampling_matches_the_host_definition);
    };
    (@tests [] $make:expr; $($name:ident),*) => {
        $(
            #[test]
            fn $name() {
                $crate::backend::suite::$name(&$make);
            }
        )*
    };
    (@tests [$why:literal] $make:expr; $($name:ident),*) => {
        $(
            #[test]
            #[ignore = $why]
            fn $name() {
                $crate::backend::suite::$name(&$make);
            }
        )*
    };
    ($make:expr) => {
        $crate::backend_suite!(@list [] $make);
    };
    // The operations of hybrid models (Qwen3.5).
    (hybrid; $make:expr) => {
        $crate::backend_suite!(@hybrid [] $make);
    };
    (hybrid ignored $why:literal; $make:expr) => {
        $crate::backend_suite!(@hybrid [$why] $make);
    };
    (@hybrid [$($why:literal)?] $make:expr) => {
        mod hybrid {
            #[allow(unused_imports)]
            use super::*;
            $crate::backend_suite!(@tests [$($why)?] $make;
                gated_delta_net_matches_the_reference,
                partial_rope_and_sigmoid_gate);
        }
    };
}

fn t<B: Backend>(b: &B, data: &[f32], rows: usize, cols: usize) -> B::Tensor {
    b.upload(data.to_vec(), &[rows, cols]).unwrap()
}

/// A weight matrix `[rows, cols]` of f32 values, stored as the backend stores checkpoint matrices.
pub fn weight<B: Backend>(b: &B, data: &[f32], rows: usize, cols: usize) -> B::Weight {
    let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
    b.load_weight(
        crate::backend::RawTensor {
            dtype: crate::backend::RawDType::F32,
            shape: vec![rows, cols],
            data: bytes.into(),
        },
        crate::backend::MatrixUse::Products,
    )
    .unwrap()
}

/// Block tables holding `rows` (row `i` of the tables is `rows[i]`), for a cache of `layout`.
pub fn block_tables<B: Backend>(b: &B, layout: KvLayout, rows: &[Vec<usize>]) -> B::BlockTables {
    let mut tables = b.alloc_block_tables(layout).unwrap();
    let writes: Vec<TableWrite> = rows
        .iter()
        .enumerate()
        .map(|(row, blocks)| TableWrite {
            row,
            col: 0,
            blocks: blocks.clone(),
        })
        .collect();
    b.write_block_tables(&mut tables, &writes).unwrap();
    tables
}

/// The tensor's values on the host.
pub fn host<B: Backend>(b: &B, t: &B::Tensor) -> Vec<f32> {
    block_on(b.read(t)).unwrap()
}

/// Deterministic values in [-1, 1).
pub fn noise(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// The largest element-wise difference of two equally long slices.
pub fn max_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

fn close(got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tol, "element {i}: {g} vs {w}");
    }
}

/// Linear with bias, RMSNorm, LayerNorm and an activation against hand-computed values.
pub fn linear_norms_and_activations<B: Backend>(b: &B) {
    let x = t(b, &[1.0, 2.0, 3.0, 4.0], 2, 2);
    let w = weight(b, &[1.0, 0.0, 1.0, 1.0, 0.0, 2.0], 3, 2);
    let bias = b.upload(vec![0.5, 0.0, -1.0], &[3]).unwrap();
    close(
        &host(b, &b.linear(&x, &w, Some(&bias)).unwrap()),
        &[1.5, 3.0, 3.0, 3.5, 7.0, 7.0],
        1e-6,
    );
    let ones = b.upload(vec![1.0, 1.0], &[2]).unwrap();
    let rms = host(b, &b.rms_norm(&x, &ones, 0.0).unwrap());
    let r0 = (2.5f32).sqrt();
    close(&rms[..2], &[1.0 / r0, 2.0 / r0], 1e-6);
    let zeros = b.upload(vec![0.0, 0.0], &[2]).unwrap();
    let ln = host(b, &b.layer_norm(&x, &ones, &zeros, 0.0).unwrap());
    close(&ln[..2], &[-1.0, 1.0], 1e-5);
    let q = host(b, &b.activate(&t(b, &[1.0], 1, 1), Activation::QuickGelu).unwrap());
    close(&q, &[1.0 / (1.0 + (-1.702f32).exp())], 1e-6);
}

/// Two heads sharing one KV head, 5 tokens spread over blocks 3 and 1 of size 4 (row 1 of the
/// block tables, written in two steps), against a dense causal softmax; a step recorded before a
/// write to its row reads the row as it was; a context past the blocks written is refused.
pub fn paged_attention_matches_dense_causal_attention<B: Backend>(b: &B) {
    let layout = KvLayout {
        layers: 1,
        num_blocks: 5,
        block_size: 4,
        kv_heads: 1,
        head_dim: 2,
        tables: TableShape { rows: 2, max_blocks: 3 },
    };
    let mut cache = b.alloc_kv(layout).unwrap();
    let mut tables = b.alloc_block_tables(layout).unwrap();
    let write = |row, col, blocks: &[usize]| TableWrite {
        row,
        col,
        blocks: blocks.to_vec(),
    };
    b.write_block_tables(&mut tables, &[write(1, 0, &[3]), write(0, 0, &[2, 2])])
        .unwrap();
    b.write_block_tables(&mut tables, &[write(1, 1, &[1])]).unwrap();
    assert!(
        b.write_block_tables(&mut tables, &[write(1, 2, &[5])]).is_err(),
        "no block 5"
    );
    assert_eq!(b.ledger().bytes(Category::KvCache), layout.bytes(b.elem_bytes()));
    let n = 5;
    let kv: Vec<f32> = (0..n * 2).map(|i| (i as f32 * 0.37).sin()).collect();
    let vv: Vec<f32> = (0..n * 2).map(|i| (i as f32 * 0.11).cos()).collect();
    let q: Vec<f32> = (0..n * 4).map(|i| (i as f32 * 0.23).sin()).collect();
    let table = [3usize, 1];
    let batch = |context_len| PagedBatch {
        layout,
        slots: (0..n).map(|p| table[p / 4] * 4 + p % 4).collect(),
        seqs: vec![PagedSeq {
            query_start: 0,
            query_len: n,
            context_len,
            table_row: 1,
            table_len: 2,
        }],
    };
    let meta = b.upload_paged(batch(n), &tables).unwrap();
    b.write_kv(&mut cache, 0, &t(b, &kv, n, 2), &t(b, &vv, n, 2), &meta)
        .unwrap();
    let paged = b.paged_attention(&cache, 0, &t(b, &q, n, 4), 2, &meta).unwrap();
    // Written after the step was recorded: the step reads block 1, not 4.
    b.write_block_tables(&mut tables, &[write(1, 1, &[4])]).unwrap();
    let paged = host(b, &paged);
    for i in 0..n {
        for h in 0..2 {
            let qh = &q[i * 4 + h * 2..i * 4 + h * 2 + 2];
            let s: Vec<f32> = (0..=i)
                .map(|j| (qh[0] * kv[j * 2] + qh[1] * kv[j * 2 + 1]) / 2f32.sqrt())
                .collect();
            let m = s.iter().cloned().fold(f32::MIN, f32::max);
            let e: Vec<f32> = s.iter().map(|x| (x - m).exp()).collect();
            let z: f32 = e.iter().sum();
            for c in 0..2 {
                let want: f32 = (0..=i).map(|j| e[j] / z * vv[j * 2 + c]).sum();
                assert!((paged[i * 4 + h * 2 + c] - want).abs() < 1e-5);
            }
        }
    }
    assert!(
        b.upload_paged(batch(9), &tables).is_err(),
        "a context past the blocks written is refused"
    );
}

/// 700 rows, more than one query chunk in the first segment, against a direct softmax.
pub fn chunked_segment_attention_matches_a_direct_softmax<B: Backend>(b: &B) {
    let n = 700;
    let q: Vec<f32> = (0..n * 2).map(|i| (i as f32 * 0.013).sin()).collect();
    let k: Vec<f32> = (0..n * 2).map(|i| (i as f32 * 0.029).cos()).collect();
    let v: Vec<f32> = (0..n * 2).map(|i| (i as f32 * 0.07).sin()).collect();
    let segs = [(0, 650), (650, 50)];
    let meta = b.upload_segments(&segs).unwrap();
    let out = host(
        b,
        &b.segment_attention(&t(b, &q, n, 2), &t(b, &k, n, 2), &t(b, &v, n, 2), 1, &meta)
            .unwrap(),
    );
    for &(start, len) in &segs {
        for i in (start..start + len).step_by(37) {
            let s: Vec<f32> = (start..start + len)
                .map(|j| (q[i * 2] * k[j * 2] + q[i * 2 + 1] * k[j * 2 + 1]) / 2f32.sqrt())
                .collect();
            let m = s.iter().cloned().fold(f32::MIN, f32::max);
            let z: f32 = s.iter().map(|x| (x - m).exp()).sum();
            let want: f32 = s
                .iter()
                .enumerate()
                .map(|(j, x)| (x - m).exp() / z * v[(start + j) * 2])
                .sum();
            assert!((out[i * 2] - want).abs() < 1e-4, "row {i}: {} vs {want}", out[i * 2]);
        }
    }
}

/// Rotate-half rotary embedding per head, and segments that do not see each other.
pub fn rope_rotates_halves_and_segments_stay_apart<B: Backend>(b: &B) {
    let x = t(b, &[1.0, 2.0, 3.0, 4.0], 1, 4);
    let cos = t(b, &[0.0, 0.0], 1, 2);
    let sin = t(b, &[1.0, 1.0], 1, 2);
    // Two heads of width 2; rotate_half([a, b]) = [-b, a].
    close(
        &host(b, &b.rope(&x, &cos, &sin).unwrap()),
        &[-2.0, 1.0, -4.0, 3.0],
        1e-6,
    );
    let q = t(b, &[1.0, 1.0, 1.0], 3, 1);
    let v = t(b, &[1.0, 2.0, 10.0], 3, 1);
    let segs = b.upload_segments(&[(0, 2), (2, 1)]).unwrap();
    let out = host(b, &b.segment_attention(&q, &q, &v, 1, &segs).unwrap());
    close(&out, &[1.5, 1.5, 10.0], 1e-6);
}

/// The fused operations against host references: a residual add and the RMSNorm after it (rows
/// wider than a GPU workgroup); each head's RMSNorm (or none) and rotary embedding, of the whole
/// head and of its first half (heads wider than a workgroup too); SwiGLU's products.
pub fn fused_operations_match_host_references<B: Backend>(b: &B) {
    let (rows, cols, eps) = (3, 300, 1e-6);
    let (x, y, w) = (noise(rows * cols, 1), noise(rows * cols, 2), noise(cols, 3));
    let (sum, normed) = b
        .add_rms_norm(&t(b, &x, rows, cols), &t(b, &y, rows, cols), &t(b, &w, 1, cols), eps)
        .unwrap();
    let want_sum: Vec<f32> = x.iter().zip(&y).map(|(a, b)| a + b).collect();
    let want: Vec<f32> = want_sum
        .chunks(cols)
        .flat_map(|row| {
            let inv = 1.0 / (row.iter().map(|v| v * v).sum::<f32>() / cols as f32 + eps as f32).sqrt();
            row.iter().zip(&w).map(move |(v, w)| v * inv * w)
        })
        .collect();
    close(&host(b, &sum), &want_sum, 1e-6);
    close(&host(b, &normed), &want, 1e-5);

    // Two rows of three heads of 80: cos/sin of 80 (whole heads) or 40 (the first half turns).
    let (rows, heads, head) = (2, 3, 80);
    let x = noise(rows * heads * head, 4);
    let w = noise(head, 5);
    for (d, norm) in [(80, true), (80, false), (40, true)] {
        let (cos, sin) = (noise(rows * d, 6), noise(rows * d, 7));
        let wt = t(b, &w, 1, head);
        let got = b
            .norm_rope(
                &t(b, &x, rows, heads * head),
                norm.then_some(&wt),
                eps,
                &t(b, &cos, rows, d),
                &t(b, &sin, rows, d),
                head,
            )
            .unwrap();
        let mut want = Vec::new();
        for (i, h) in x.chunks(head).enumerate() {
            let r = i / heads;
            let inv = 1.0 / (h.iter().map(|v| v * v).sum::<f32>() / head as f32 + eps as f32).sqrt();
            let v: Vec<f32> = h
                .iter()
                .zip(&w)
                .map(|(x, w)| if norm { x * inv * w } else { *x })
                .collect();
            want.extend((0..head).map(|j| match j {
                j if j < d / 2 => v[j] * cos[r * d + j] - v[j + d / 2] * sin[r * d + j],
                j if j < d => v[j] * cos[r * d + j] + v[j - d / 2] * sin[r * d + j],
                j => v[j],
            }));
        }
        close(&host(b, &got), &want, 1e-5);
    }

    // SwiGLU's products: x [2, 16], gate and up [6, 16].
    let (rows, k, m) = (2, 16, 6);
    let (x, gate, up) = (noise(rows * k, 8), noise(m * k, 9), noise(m * k, 10));
    let got = b
        .swiglu(&t(b, &x, rows, k), &weight(b, &gate, m, k), &weight(b, &up, m, k))
        .unwrap();
    let dot = |w: &[f32], r: usize, o: usize| -> f32 { (0..k).map(|c| x[r * k + c] * w[o * k + c]).sum() };
    let want: Vec<f32> = (0..rows * m)
        .map(|i| {
            let (g, u) = (dot(&gate, i / m, i % m), dot(&up, i / m, i % m));
            g / (1.0 + (-g).exp()) * u
        })
        .collect();
    close(&host(b, &got), &want, 1e-5);
}

/// Partial rotary (the first 2 of each head of 4 turn) and the sigmoid gate against
/// hand-computed values.
pub fn partial_rope_and_sigmoid_gate<B: Backend>(b: &B) {
    let x = t(b, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0], 1, 8);
    let cos = t(b, &[0.0, 0.0], 1, 2);
    let sin = t(b, &[1.0, 1.0], 1, 2);
    close(
        &host(b, &b.rope_partial(&x, &cos, &sin, 4).unwrap()),
        &[-2.0, 1.0, 3.0, 4.0, -6.0, 5.0, 7.0, 8.0],
        1e-6,
    );
    let gate = t(b, &[0.0, 2.0], 1, 2);
    let y = t(b, &[4.0, -1.0], 1, 2);
    close(
        &host(b, &b.sigmoid_mul(&gate, &y).unwrap()),
        &[2.0, -1.0 / (1.0 + (-2.0f32).exp())],
        1e-6,
    );
}

/// Gated DeltaNet over three sequences in two calls (one continuing its slot across both, one
/// fresh in a used slot), against the reference backend on the same inputs.
pub fn gated_delta_net_matches_the_reference<B: Backend>(b: &B) {
    use super::{DeltaNetInput, StateLayout, StateSeq};
    let l = StateLayout {
        layers: 2,
        slots: 3,
        conv_dim: 2 * 2 * 8 + 4 * 6,
        conv_len: 3,
        key_heads: 2,
        heads: 4,
        key_dim: 8,
        value_dim: 6,
    };
    fn run<C: Backend>(c: &C, l: StateLayout) -> Vec<f32> {
        let mut states = c.alloc_states(l).unwrap();
        let weights = [
            c.upload(noise(l.conv_dim * (l.conv_len + 1), 1), &[l.conv_dim, l.conv_len + 1])
                .unwrap(),
            c.upload(noise(l.heads, 2), &[l.heads]).unwrap(),
            c.upload(noise(l.heads, 3), &[l.heads]).unwrap(),
        ];
        let mut out = Vec::new();
        for (call, seqs) in [[(0, 5, 1, true), (5, 2, 0, true)], [(0, 3, 1, false), (3, 4, 0, true)]]
            .iter()
            .enumerate()
        {
            let rows = 7;
            let seed = 10 * call as u64;
            let qkv = c
                .upload(noise(rows * l.conv_dim, seed + 4), &[rows, l.conv_dim])
                .unwrap();
            let a = c.upload(noise(rows * l.heads, seed + 5), &[rows, l.heads]).unwrap();
            let bb = c.upload(noise(rows * l.heads, seed + 6), &[rows, l.heads]).unwrap();
            let seqs: Vec<StateSeq> = seqs
                .iter()
                .map(|&(start, len, slot, fresh)| StateSeq {
                    start,
                    len,
                    slot,
                    fresh,
                })
                .collect();
            let input = DeltaNetInput {
                qkv: &qkv,
                a: &a,
                b: &bb,
                conv: &weights[0],
                a_log: &weights[1],
                dt_bias: &weights[2],
            };
            let o = c.gated_delta_net(&mut states, 1, input, &seqs).unwrap();
            assert_eq!(c.shape(&o), [rows, l.heads * l.value_dim]);
            out.extend(host(c, &o));
        }
        out
    }
    let want = run(&Reference::default(), l);
    assert!(want.iter().any(|v| v.abs() > 1e-3));
    let got = run(b, l);
    assert!(max_err(&got, &want) < 1e-5, "{}", max_err(&got, &want));
}

/// Row gathers, scatters (replacing and adding), concatenation, column slices, embeddings and
/// row scaling.
pub fn rows_gather_scatter_and_concat<B: Backend>(b: &B) {
    let x = t(b, &[0.0, 1.0, 2.0, 3.0, 4.0, 5.0], 3, 2);
    close(
        &host(b, &b.gather_rows(&x, &[2, 0]).unwrap()),
        &[4.0, 5.0, 0.0, 1.0],
        0.0,
    );
    let src = t(b, &[10.0, 20.0], 1, 2);
    close(
        &host(b, &b.scatter_rows(&x, &[1], &src, false).unwrap()),
        &[0.0, 1.0, 10.0, 20.0, 4.0, 5.0],
        0.0,
    );
    close(
        &host(b, &b.scatter_rows(&x, &[1], &src, true).unwrap()),
        &[0.0, 1.0, 12.0, 23.0, 4.0, 5.0],
        0.0,
    );
    close(
        &host(b, &b.concat_rows(&[src.clone(), x.clone()]).unwrap()),
        &[10.0, 20.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0],
        0.0,
    );
    close(&host(b, &b.narrow_cols(&x, 1, 1).unwrap()), &[1.0, 3.0, 5.0], 0.0);
    close(
        &host(
            b,
            &b.embedding(&weight(b, &[0.0, 1.0, 2.0, 3.0, 4.0, 5.0], 3, 2), &[2, 2, 1])
                .unwrap(),
        ),
        &[4.0, 5.0, 4.0, 5.0, 2.0, 3.0],
        0.0,
    );
    assert_eq!(b.shape(&b.reshape(&x, 2, 3).unwrap()), vec![2, 3]);
    close(
        &host(b, &b.scale_rows(&x, &[2.0, -1.0, 0.5]).unwrap()),
        &[0.0, 2.0, -2.0, -3.0, 2.0, 2.5],
        0.0,
    );
    assert!(b.scale_rows(&x, &[1.0]).is_err(), "a scale per row");
}

/// `(temperature, top_k, top_p, min_p)`: greedy, temperature alone, and the cut-offs alone and
/// together (top-k 1, top-k past the vocabulary, Qwen's defaults).
const SAMPLING_GRID: [(f32, usize, f32, f32); 9] = [
    (0.0, 0, 1.0, 0.0),
    (1.0, 0, 1.0, 0.0),
    (0.7, 20, 0.8, 0.0),
    (1.0, 50, 1.0, 0.0),
    (0.8, 0, 0.9, 0.0),
    (1.0, 0, 1.0, 0.05),
    (1.3, 5, 0.95, 0.02),
    (0.5, 1 << 20, 1.0, 0.0),
    (1.0, 1, 1.0, 0.0),
];

/// A logits row of `width`: spread values, or (`ties`) values on a coarse grid so that many are
/// equal and the cut-offs fall inside runs of equal logits.
fn logits_row(width: usize, ties: bool, rng: &mut Rng) -> Vec<f32> {
    (0..width)
        .map(|_| {
            let v = (rng.uniform() * 2.0 - 1.0) as f32 * 6.0;
            if ties {
                (v * 2.0).round() / 4.0
            } else {
                v
            }
        })
        .collect()
}

/// Whether the host's choice for `row` moves when the uniform, temperature, top-p or min-p moves
/// by a relative 1e-5: a near-tie that f32 on a device may resolve the other way.
fn near_tie(row: &[f32], s: &DeviceSampling) -> bool {
    let token = s.pick(row).0;
    [1.0 - 1e-5, 1.0 + 1e-5].iter().any(|&f| {
        let moved = [
            DeviceSampling {
                u: (s.u * f).min(1.0 - 1e-12),
                ..*s
            },
            DeviceSampling {
                temperature: s.temperature * f as f32,
                ..*s
            },
            DeviceSampling {
                top_p: (s.top_p * f as f32).min(1.0),
                ..*s
            },
            DeviceSampling {
                min_p: s.min_p * f as f32,
                ..*s
            },
        ];
        moved.iter().any(|m| m.pick(row).0 != token)
    })
}

/// Samples `row` once per setting of [`SAMPLING_GRID`] the backend samples (its
/// [`Capabilities`](super::Capabilities)) with seeded uniforms and checks each
/// against [`DeviceSampling::pick`]: the log-probability within 1e-4, the token the same or, on a
/// near-tie, the other side of it. Returns how many tokens differ.
fn sample_grid<B: Backend>(b: &B, row: &[f32], allowed: usize, rng: &mut Rng) -> usize {
    let width = row.len();
    let settings: Vec<DeviceSampling> = SAMPLING_GRID
        .iter()
        .map(|&(temperature, top_k, top_p, min_p)| DeviceSampling {
            temperature,
            top_k,
            top_p,
            min_p,
            allowed,
            u: rng.uniform(),
        })
        .filter(|s| B::CAPABILITIES.samples(s))
        .collect();
    let rows = row.repeat(settings.len());
    let got = host(b, &b.sample(&t(b, &rows, settings.len(), width), &settings).unwrap());
    assert_eq!(got.len(), settings.len() * 2);
    let mut differ = 0;
    for (s, got) in settings.iter().zip(got.chunks_exact(2)) {
        let (token, logprob) = s.pick(row);
        let got_token = got[0] as usize;
        assert!(
            got_token < allowed.min(width),
            "width {width}: token {got_token} past {allowed}"
        );
        // The host's normaliser is its token's logit minus its log-probability.
        let want = row[got_token] - (row[token as usize] - logprob);
        assert!(
            (got[1] - want).abs() < 1e-4,
            "width {width}, {s:?}: logprob {} vs {want}",
            got[1]
        );
        if got_token != token as usize {
            assert!(
                near_tie(row, s),
                "width {width}, {s:?}: token {got_token}, host {token}"
            );
            differ += 1;
        }
    }
    differ
}

/// [`Backend::sample`] against the host's definition on random rows at awkward widths (ids past
/// `allowed` never chosen), spread or with runs of equal logits (where a top-p share can equal the
/// cut-off exactly), over `SAMPLING_GRID`: see `sample_grid`; at most 5 % of tokens differ.
pub fn sampling_matches_the_host_definition<B: Backend>(b: &B) {
    let mut rng = Rng::new(11);
    let (mut draws, mut differ) = (0, [0; 2]);
    for (width, allowed, rows) in [(1, 1, 2), (7, 5, 4), (1000, 1000, 6), (151_936, 151_643, 2)] {
        for r in 0..rows {
            let ties = r % 2 == 1;
            let row = logits_row(width, ties, &mut rng);
            differ[ties as usize] += sample_grid(b, &row, allowed, &mut rng);
            draws += SAMPLING_GRID.len();
        }
    }
    println!(
        "sample: of {draws} tokens, {} differ from the host's on spread rows, {} on rows with ties",
        differ[0], differ[1]
    );
    assert!(
        (differ[0] + differ[1]) * 20 <= draws,
        "{differ:?} of {draws} tokens differ"
    );
    assert!(b.sample(&t(b, &[0.0; 4], 2, 2), &[]).is_err());
    if B::CAPABILITIES.sampling == super::DeviceSamplingSupport::Greedy {
        let top_k = DeviceSampling {
            temperature: 1.0,
            top_k: 2,
            top_p: 1.0,
            min_p: 0.0,
            allowed: 2,
            u: 0.5,
        };
        let refused = b.sample(&t(b, &[0.0; 2], 1, 2), &[top_k]);
        assert!(
            refused.is_err(),
            "a greedy-only backend refuses other rows, without reading"
        );
    }
}
