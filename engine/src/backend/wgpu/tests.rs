//! The wgpu backend against the shared suite and, op by op, against the CPU backend on random
//! inputs at awkward shapes. These run on whatever adapter the machine has (lavapipe in CI) and
//! fail, never skip, when there is none.

use super::{WgpuBackend, WgpuOptions};
use crate::backend::suite::{block_tables, host, max_err, noise, Reference as CpuBackend};
use crate::backend::{
    block_on, Activation, Backend, KvLayout, MatrixUse, PagedBatch, PagedSeq, RawDType, RawTensor, TableShape,
};
use crate::memory::ledger::MemoryLedger;

/// A backend on this machine's adapter (`KVLENS_WGPU_ADAPTER` picks one, as in the server);
/// panics with the reason when there is none.
pub(crate) fn backend_with(opts: WgpuOptions) -> WgpuBackend {
    let adapter = opts
        .adapter
        .clone()
        .or_else(|| std::env::var("KVLENS_WGPU_ADAPTER").ok());
    WgpuBackend::new_blocking(MemoryLedger::new(), WgpuOptions { adapter, ..opts })
        .unwrap_or_else(|e| panic!("the wgpu tests need an adapter (`cargo xtask test` installs lavapipe): {e}"))
}

fn backend() -> WgpuBackend {
    backend_with(WgpuOptions::default())
}

crate::backend_suite!(backend());
crate::backend_suite!(hybrid; backend());
crate::golden_suite!(backend(), hybrid);

/// Both kernel sets on this adapter: the barrier-free one and the workgroup-reduction one.
fn both() -> [WgpuBackend; 2] {
    [true, false].map(|barrier_free| {
        backend_with(WgpuOptions {
            barrier_free: Some(barrier_free),
            ..Default::default()
        })
    })
}

/// The suite again with the kernels the adapter does not default to.
mod other_kernels {
    use super::*;

    fn backend() -> WgpuBackend {
        let cpu_adapter = super::backend().inner.cpu_adapter;
        backend_with(WgpuOptions {
            barrier_free: Some(!cpu_adapter),
            ..Default::default()
        })
    }

    crate::backend_suite!(backend());
}

#[test]
fn every_kernel_compiles() {
    let compiled = block_on(backend().check_kernels()).unwrap_or_else(|e| panic!("kernels that do not compile:\n{e}"));
    assert!(compiled >= 10, "{compiled} pipelines");
}

fn raw(data: &[f32], shape: &[usize]) -> (Vec<u8>, Vec<usize>) {
    (bytemuck::cast_slice(data).to_vec(), shape.to_vec())
}

fn weight<B: Backend>(b: &B, bytes: &(Vec<u8>, Vec<usize>)) -> B::Weight {
    b.load_weight(
        RawTensor {
            dtype: RawDType::F32,
            shape: bytes.1.clone(),
            data: bytes.0.as_slice().into(),
        },
        MatrixUse::Products,
    )
    .unwrap()
}

#[test]
fn linear_matches_the_cpu_at_awkward_shapes_and_with_a_split_weight() {
    let cpu = CpuBackend::default();
    // Shapes around every kernel choice: one row and up to 16 (GEMV in chunks of 8 rows, k a
    // multiple of 8, columns not a multiple of 4), more rows or any k (GEMM, 128×128 tiles).
    // A 40 KiB binding cap splits a 300×67 f32 weight (80 KiB) into parts of 152 rows and a
    // 301×64 one into parts of 160.
    let awkward = vec![
        (1, 67, 300),
        (3, 64, 130),
        (1, 8, 5),
        (8, 64, 131),
        (9, 64, 130),
        (16, 136, 67),
        (17, 64, 33),
        (4097, 33, 17),
        (70, 128, 257),
        (130, 40, 200),
    ];
    // (200, 67, 100): an output over the cap, made in parts of 64 rows.
    let split = vec![(1, 67, 300), (30, 67, 300), (1, 64, 301), (12, 64, 301), (200, 67, 100)];
    let mut cases = Vec::new();
    // Both kernel sets: the GEMV/GEMM kernels and the barrier-free one of CPU adapters.
    for barrier_free in [false, true] {
        let opts = WgpuOptions {
            barrier_free: Some(barrier_free),
            ..Default::default()
        };
        cases.push((opts.clone(), awkward.clone()));
        let capped = WgpuOptions {
            max_binding_bytes: Some(40 << 10),
            ..opts
        };
        cases.push((capped, split.clone()));
    }
    for (opts, shapes) in cases {
        let g = backend_with(opts);
        for (n, k, out) in shapes {
            let x = noise(n * k, 1);
            let w = raw(&noise(out * k, 2), &[out, k]);
            let bias = noise(out, 3);
            let want = {
                let (x, w) = (cpu.upload(x.clone(), &[n, k]).unwrap(), weight(&cpu, &w));
                let b = cpu.upload(bias.clone(), &[out]).unwrap();
                host(&cpu, &cpu.linear(&x, &w, Some(&b)).unwrap())
            };
            let got = {
                let (x, w) = (g.upload(x.clone(), &[n, k]).unwrap(), weight(&g, &w));
                let b = g.upload(bias.clone(), &[out]).unwrap();
                host(&g, &g.linear(&x, &w, Some(&b)).unwrap())
            };
            let err = max_err(&got, &want);
            assert!(err < 1e-4, "linear {n}×{k}·{out}ᵀ: max error {err}");
        }
    }
}

#[test]
fn f16_weights_round_like_half_precision() {
    let g = backend_with(WgpuOptions {
        f16_weights: true,
        barrier_free: Some(false),
        ..Default::default()
    });
    let cpu = CpuBackend::default();
    // 20 rows take the GEMM path.
    let (n, k, out) = (20, 96, 77);
    let x = noise(n * k, 4);
    let w = raw(&noise(out * k, 5), &[out, k]);
    let want = host(
        &cpu,
        &cpu.linear(&cpu.upload(x.clone(), &[n, k]).unwrap(), &weight(&cpu, &w), None)
            .unwrap(),
    );
    let got = host(
        &g,
        &g.linear(&g.upload(x.clone(), &[n, k]).unwrap(), &weight(&g, &w), None)
            .unwrap(),
    );
    // f16 keeps 11 significant bits: |Δw| ≤ 2⁻¹² per weight, summed over k = 96 products of |x| < 1.
    let err = max_err(&got, &want);
    assert!(err > 0.0 && err < 96.0 / 4096.0, "f16 weights: max error {err}");
    // Decode-sized rows take the GEMV paths (one row; up to 8); they must agree with the GEMM path.
    for rows in [1, 5] {
        let gemv = host(
            &g,
            &g.linear(
                &g.upload(x[..rows * k].to_vec(), &[rows, k]).unwrap(),
                &weight(&g, &w),
                None,
            )
            .unwrap(),
        );
        assert!(max_err(&gemv, &got[..rows * out]) < 1e-5, "{rows} rows");
    }
}

/// `wg`'s products with `rows` rows of noise (each count in turn) equal the f32 CPU backend's with
/// `dequantized`, the values `wg` holds, within 1e-5.
fn products_match_the_f32_cpu(
    g: &WgpuBackend,
    wg: &super::WgpuWeight,
    dequantized: &<CpuBackend as Backend>::Weight,
    k: usize,
    rows: &[usize],
    what: &str,
) {
    let f32_cpu = CpuBackend::default();
    for &n in rows {
        let x = noise(n * k, 8);
        let want = host(
            &f32_cpu,
            &f32_cpu
                .linear(&f32_cpu.upload(x.clone(), &[n, k]).unwrap(), dequantized, None)
                .unwrap(),
        );
        let got = host(g, &g.linear(&g.upload(x, &[n, k]).unwrap(), wg, None).unwrap());
        let err = max_err(&got, &want);
        assert!(err < 1e-5, "{what}, {n} rows: {err}");
    }
}

/// q8_0 / q4_0 weights hold the CPU backend's dequantized values (every row gathered), and every
/// matmul kernel multiplies by exactly those: the f32 product with the dequantized matrix.
#[test]
fn quantized_weights_hold_the_cpu_values_in_every_kernel() {
    use crate::arch::weight_format::WeightFormat;
    // k = 96: three blocks a row, so parts of odd row counts end in a half pair of blocks.
    let (k, out) = (96, 77);
    let w = raw(&noise(out * k, 7), &[out, k]);
    for format in [WeightFormat::Q8_0, WeightFormat::Q4_0] {
        let cpu = CpuBackend::with_weights(MemoryLedger::new(), format);
        let ids: Vec<u32> = (0..out as u32).collect();
        let values = host(&cpu, &cpu.embedding(&weight(&cpu, &w), &ids).unwrap());
        let f32_cpu = CpuBackend::default();
        let dequantized = weight(&f32_cpu, &raw(&values, &[out, k]));
        // A binding cap of 3,000 bytes splits the matrix (102 bytes a row in q8_0, 54 in q4_0)
        // into parts of 29 and 55 rows, whose block counts are odd; both kernel sets. Under the
        // cap only a few rows fit in one activation.
        for (barrier_free, cap) in [(false, None), (true, None), (false, Some(3000)), (true, Some(3000))] {
            let g = backend_with(WgpuOptions {
                quantization: format,
                barrier_free: Some(barrier_free),
                max_binding_bytes: cap,
                ..Default::default()
            });
            let wg = weight(&g, &w);
            assert_eq!(wg.parts.len() > 1, cap.is_some(), "{format}");
            if cap.is_none() {
                assert_eq!(
                    host(&g, &g.embedding(&wg, &ids).unwrap()),
                    values,
                    "{format}: every row"
                );
            }
            let gathered = host(&g, &g.embedding(&wg, &[76, 0, 31]).unwrap());
            assert_eq!(gathered[..k], values[76 * k..77 * k], "{format}: gathered row");
            assert_eq!(gathered[2 * k..], values[31 * k..32 * k], "{format}: gathered row");
            // One row and a few (GEMV paths), twenty (GEMM).
            let rows: &[usize] = if cap.is_some() { &[1, 3] } else { &[1, 5, 20] };
            let what = format!("{format}, barrier-free {barrier_free}, cap {cap:?}");
            products_match_the_f32_cpu(&g, &wg, &dequantized, k, rows, &what);
        }
    }
}

/// `blocks` blocks of GGML type `t`, values within about ±0.25: q8_0 and q4_0 quantized from noise
/// (the backend quantizes
/// their values again, which gives a quantizer's blocks back); the other types (which kvlens does
/// not write) random bytes, every quant and scale bit pattern, with small f16 scales and minimums
/// and the first block's d a subnormal.
fn gguf_blocks(t: crate::arch::ggml::GgmlType, blocks: usize, seed: u64) -> Vec<u8> {
    use crate::arch::ggml::GgmlType;
    let (values, bytes) = t.block();
    let small: Vec<f32> = noise(blocks * values, seed).iter().map(|v| v / 4.0).collect();
    if let Some(data) = t.quantize(&small) {
        return data;
    }
    let mut data: Vec<u8> = noise(blocks * bytes, seed)
        .iter()
        .map(|v| ((v + 1.0) * 128.0) as u8)
        .collect();
    // (byte, largest magnitude) of each f16 field.
    let halves: &[(usize, f32)] = match t {
        GgmlType::Q4_1 => &[(0, 0.01), (2, 0.1)],
        GgmlType::Q5_0 => &[(0, 0.01)],
        GgmlType::Q5_1 => &[(0, 0.005), (2, 0.1)],
        GgmlType::Q4K => &[(0, 2e-4), (2, 2e-3)],
        GgmlType::Q5K => &[(0, 1e-4), (2, 2e-3)],
        GgmlType::Q6K => &[(208, 5e-5)],
        other => panic!("{other} is quantized above"),
    };
    let scales = noise(blocks * halves.len(), seed + 1);
    for (b, block) in data.chunks_exact_mut(bytes).enumerate() {
        for (f, &(at, max)) in halves.iter().enumerate() {
            let h = half::f16::from_f32(scales[b * halves.len() + f] * max);
            block[at..at + 2].copy_from_slice(&h.to_le_bytes());
        }
    }
    let (at, _) = halves[0];
    data[at..at + 2].copy_from_slice(&0x01ffu16.to_le_bytes());
    data
}

/// GGUF block types: q4_1, q5_0, q5_1 and the K-quants kept as the file stores them (q8_0 and q4_0
/// in the kernels' layout) gather to the CPU's dequantization of the same bytes, and every matmul
/// kernel multiplies by exactly those values (the f32 product with the dequantized matrix); split
/// by a binding cap into parts of an odd count of rows, whose ends fall inside a word for q5_0 and
/// q6_K; the ledger counts each part's stored bytes padded to a whole word.
#[test]
fn gguf_block_types_hold_the_cpu_values_in_every_kernel() {
    use crate::arch::ggml::GgmlType;
    use crate::memory::ledger::Category;
    let f32_cpu = CpuBackend::default();
    let out = 37;
    // Every block type (the float types are not blocks).
    let block_types = GgmlType::ALL.into_iter().filter(|t| t.block().0 > 1);
    for (seed, t) in block_types.enumerate() {
        let (block, block_bytes) = t.block();
        // An odd count of blocks a row: 25 of 32 values, 3 super-blocks of 256.
        let k = if block == 32 { 800 } else { 768 };
        let data = gguf_blocks(t, out * k / block, 10 * seed as u64);
        let mut values = vec![0f32; out * k];
        t.dequantize(&data, &mut values);
        let stored = RawTensor {
            dtype: RawDType::Blocks(t),
            shape: vec![out, k],
            data: data.as_slice().into(),
        };
        let dequantized = weight(&f32_cpu, &raw(&values, &[out, k]));
        // Parts of the smallest odd count of rows that fills 4 KiB (one row of activations and
        // twenty rows of output fit under the cap).
        let row_bytes = k / block * block_bytes;
        let per_part = 4096usize.div_ceil(row_bytes) | 1;
        if matches!(t, GgmlType::Q5_0 | GgmlType::Q6K) {
            assert_ne!(per_part * row_bytes % 4, 0, "{t}: a part ends inside a word");
        }
        let cap = (per_part * row_bytes + 4) as u64;
        for (barrier_free, cap) in [(false, None), (true, None), (false, Some(cap)), (true, Some(cap))] {
            let what = format!("{t}, barrier-free {barrier_free}, cap {cap:?}");
            let g = backend_with(WgpuOptions {
                barrier_free: Some(barrier_free),
                max_binding_bytes: cap,
                ..Default::default()
            });
            let before = g.ledger().bytes(Category::Weights);
            let wg = g.load_weight(stored.clone(), MatrixUse::Products).unwrap();
            let rows = if cap.is_some() { per_part } else { out };
            assert_eq!(wg.parts.len(), out.div_ceil(rows), "{what}");
            let held: u64 = wg
                .parts
                .iter()
                .map(|p| match wg.elem.block_kind() {
                    Some(kind) => super::quantized::device_bytes(kind, p.rows * k / block),
                    None => (p.rows * row_bytes).next_multiple_of(4) as u64,
                })
                .sum();
            assert_eq!(g.ledger().bytes(Category::Weights) - before, held, "{what}: ledger");
            // Every row (one at a time under the cap, where a row of activations is what fits).
            let ids: Vec<u32> = (0..out as u32).collect();
            let gathered: Vec<f32> = match cap {
                None => host(&g, &g.embedding(&wg, &ids).unwrap()),
                Some(_) => ids
                    .iter()
                    .flat_map(|&id| host(&g, &g.embedding(&wg, &[id]).unwrap()))
                    .collect(),
            };
            assert_eq!(gathered, values, "{what}: every row");
            // One row and a few (GEMV paths), twenty (GEMM); columns8 for the barrier-free set.
            products_match_the_f32_cpu(&g, &wg, &dequantized, k, &[1, 5, 20], &what);
        }
    }
}

/// The tiny checkpoints on this backend hold, per format, the weight bytes the planner counts,
/// plus the two bytes that round a quantized matrix with an odd count of blocks to whole words
/// (the tiny MLPs' 37 rows of one block; every published Qwen-VL matrix has an even count).
#[test]
fn the_backend_allocates_what_the_planner_counts() {
    use crate::arch::spec::tensor_specs;
    use crate::backend::plan_check::{assert_the_ledger_is_the_plan, tiny_checkpoints};
    for (cfg, bytes) in tiny_checkpoints() {
        let open = |ledger, quantization| {
            let opts = WgpuOptions {
                quantization,
                ..Default::default()
            };
            WgpuBackend::new_blocking(ledger, opts).unwrap()
        };
        let padding = |format: crate::arch::weight_format::WeightFormat| -> u64 {
            let specs = tensor_specs(&cfg);
            let odd = specs
                .iter()
                .filter(|t| !t.host && format.quantizes(&t.shape) && t.numel() / 32 % 2 == 1);
            odd.count() as u64 * 2
        };
        assert_the_ledger_is_the_plan(&cfg, &bytes, open, padding);
    }
}

#[test]
fn embedding_reads_every_part_of_a_split_table() {
    let g = backend_with(WgpuOptions {
        max_binding_bytes: Some(1 << 10),
        ..Default::default()
    });
    let (vocab, dim) = (1000, 24);
    let table = noise(vocab * dim, 6);
    let t = weight(&g, &raw(&table, &[vocab, dim]));
    assert!(t.parts.len() > 50, "{} parts", t.parts.len());
    let ids = [0u32, 999, 10, 11, 500, 10];
    let got = host(&g, &g.embedding(&t, &ids).unwrap());
    for (r, &id) in ids.iter().enumerate() {
        let id = id as usize;
        assert_eq!(&got[r * dim..(r + 1) * dim], &table[id * dim..(id + 1) * dim]);
    }
    assert!(g.embedding(&t, &[1000]).is_err());
}

#[test]
fn norms_activations_and_rope_match_the_cpu() {
    for g in both() {
        norms_activations_and_rope_on(g);
    }
}

fn norms_activations_and_rope_on(g: WgpuBackend) {
    let cpu = CpuBackend::default();
    for (rows, cols) in [(1, 3), (7, 300), (4097, 64)] {
        let x = noise(rows * cols, 7);
        let w = noise(cols, 8);
        let b = noise(cols, 9);
        let cx = cpu.upload(x.clone(), &[rows, cols]).unwrap();
        let gx = g.upload(x.clone(), &[rows, cols]).unwrap();
        let (cw, gw) = (
            cpu.upload(w.clone(), &[cols]).unwrap(),
            g.upload(w.clone(), &[cols]).unwrap(),
        );
        let (cb, gb) = (
            cpu.upload(b.clone(), &[cols]).unwrap(),
            g.upload(b.clone(), &[cols]).unwrap(),
        );
        let e = max_err(
            &host(&g, &g.rms_norm(&gx, &gw, 1e-6).unwrap()),
            &host(&cpu, &cpu.rms_norm(&cx, &cw, 1e-6).unwrap()),
        );
        assert!(e < 1e-5, "rms_norm {rows}×{cols}: {e}");
        let e = max_err(
            &host(&g, &g.layer_norm(&gx, &gw, &gb, 1e-6).unwrap()),
            &host(&cpu, &cpu.layer_norm(&cx, &cw, &cb, 1e-6).unwrap()),
        );
        assert!(e < 1e-4, "layer_norm {rows}×{cols}: {e}");
        for act in [
            Activation::Silu,
            Activation::GeluTanh,
            Activation::GeluErf,
            Activation::QuickGelu,
        ] {
            let e = max_err(
                &host(&g, &g.activate(&gx, act).unwrap()),
                &host(&cpu, &cpu.activate(&cx, act).unwrap()),
            );
            assert!(e < 1e-6, "{act:?}: {e}");
        }
        let e = max_err(
            &host(&g, &g.silu_mul(&gx, &gx).unwrap()),
            &host(&cpu, &cpu.silu_mul(&cx, &cx).unwrap()),
        );
        assert!(e < 1e-6, "silu_mul: {e}");
    }
    let (n, heads, d) = (9, 3, 8);
    let x = noise(n * heads * d, 10);
    let cos = noise(n * d, 11);
    let sin = noise(n * d, 12);
    let c = cpu.rope(
        &cpu.upload(x.clone(), &[n, heads * d]).unwrap(),
        &cpu.upload(cos.clone(), &[n, d]).unwrap(),
        &cpu.upload(sin.clone(), &[n, d]).unwrap(),
    );
    let w = g.rope(
        &g.upload(x, &[n, heads * d]).unwrap(),
        &g.upload(cos, &[n, d]).unwrap(),
        &g.upload(sin, &[n, d]).unwrap(),
    );
    assert!(max_err(&host(&g, &w.unwrap()), &host(&cpu, &c.unwrap())) < 1e-6);
}

/// Two sequences, 16 query heads over 4 KV heads (or 1 over 1), block tables with holes and a
/// block shared by both sequences (a prefix-cache hit), one sequence in prefill and one decoding.
#[test]
fn paged_attention_matches_the_cpu_with_shared_blocks_and_holes() {
    for g in both() {
        paged_attention_on(g);
    }
}

fn paged_attention_on(g: WgpuBackend) {
    let cpu = CpuBackend::default();
    for (heads, kv_heads, d) in [(16, 4, 32), (1, 1, 64)] {
        let layout = KvLayout {
            layers: 2,
            num_blocks: 12,
            block_size: 4,
            kv_heads,
            head_dim: d,
            tables: TableShape { rows: 2, max_blocks: 3 },
        };
        let width = kv_heads * d;
        // Sequence A: 11 tokens in blocks [7, 2, 9]; sequence B shares block 7 (its first 4 tokens)
        // and continues in block 5: a decode step at position 5 (context 6).
        let tables = [vec![7, 2, 9], vec![7, 5]];
        let slot = |t: &Vec<usize>, p: usize| t[p / 4] * 4 + p % 4;
        // Fill the cache: A's 11 positions, then B's own positions 4 and 5 (block 5).
        let mut slots: Vec<usize> = (0..11).map(|p| slot(&tables[0], p)).collect();
        slots.extend([4, 5].map(|p| slot(&tables[1], p)));
        // The fill is a prefill of A's 11 positions and B's positions 4 and 5.
        let fill = PagedBatch {
            layout,
            slots: slots.clone(),
            seqs: vec![
                PagedSeq {
                    query_start: 0,
                    query_len: 11,
                    context_len: 11,
                    table_row: 0,
                    table_len: 3,
                },
                PagedSeq {
                    query_start: 11,
                    query_len: 2,
                    context_len: 6,
                    table_row: 1,
                    table_len: 2,
                },
            ],
        };
        let kv_k = noise(slots.len() * width, 20);
        let kv_v = noise(slots.len() * width, 21);
        // A's last 7 positions in prefill and B decoding at position 5.
        let step = PagedBatch {
            layout,
            slots: (4..11)
                .map(|p| slot(&tables[0], p))
                .chain([slot(&tables[1], 5)])
                .collect(),
            seqs: vec![
                PagedSeq {
                    query_start: 0,
                    query_len: 7,
                    context_len: 11,
                    table_row: 0,
                    table_len: 3,
                },
                PagedSeq {
                    query_start: 7,
                    query_len: 1,
                    context_len: 6,
                    table_row: 1,
                    table_len: 2,
                },
            ],
        };
        let q = noise(8 * heads * d, 22);
        let run = |be: &dyn Fn() -> Vec<f32>| be();
        let want = run(&|| {
            let mut c = cpu.alloc_kv(layout).unwrap();
            let t = block_tables(&cpu, layout, &tables);
            let meta = cpu.upload_paged(fill.clone(), &t).unwrap();
            let (k, v) = (
                cpu.upload(kv_k.clone(), &[slots.len(), width]).unwrap(),
                cpu.upload(kv_v.clone(), &[slots.len(), width]).unwrap(),
            );
            cpu.write_kv(&mut c, 1, &k, &v, &meta).unwrap();
            let meta = cpu.upload_paged(step.clone(), &t).unwrap();
            host(
                &cpu,
                &cpu.paged_attention(&c, 1, &cpu.upload(q.clone(), &[8, heads * d]).unwrap(), heads, &meta)
                    .unwrap(),
            )
        });
        let got = run(&|| {
            let mut c = g.alloc_kv(layout).unwrap();
            let t = block_tables(&g, layout, &tables);
            let meta = g.upload_paged(fill.clone(), &t).unwrap();
            let (k, v) = (
                g.upload(kv_k.clone(), &[slots.len(), width]).unwrap(),
                g.upload(kv_v.clone(), &[slots.len(), width]).unwrap(),
            );
            g.write_kv(&mut c, 1, &k, &v, &meta).unwrap();
            let meta = g.upload_paged(step.clone(), &t).unwrap();
            host(
                &g,
                &g.paged_attention(&c, 1, &g.upload(q.clone(), &[8, heads * d]).unwrap(), heads, &meta)
                    .unwrap(),
            )
        });
        let e = max_err(&got, &want);
        assert!(e < 1e-5, "paged attention {heads}/{kv_heads} heads: {e}");
    }
}

#[test]
fn segment_attention_matches_the_cpu_over_uneven_segments() {
    for g in both() {
        segment_attention_on(g);
    }
}

fn segment_attention_on(g: WgpuBackend) {
    let cpu = CpuBackend::default();
    let (n, heads, d) = (300, 16, 16);
    let segs = [(0, 1), (1, 130), (131, 169)];
    let (q, k, v) = (
        noise(n * heads * d, 30),
        noise(n * heads * d, 31),
        noise(n * heads * d, 32),
    );
    let want = host(
        &cpu,
        &cpu.segment_attention(
            &cpu.upload(q.clone(), &[n, heads * d]).unwrap(),
            &cpu.upload(k.clone(), &[n, heads * d]).unwrap(),
            &cpu.upload(v.clone(), &[n, heads * d]).unwrap(),
            heads,
            &cpu.upload_segments(&segs).unwrap(),
        )
        .unwrap(),
    );
    let got = host(
        &g,
        &g.segment_attention(
            &g.upload(q, &[n, heads * d]).unwrap(),
            &g.upload(k, &[n, heads * d]).unwrap(),
            &g.upload(v, &[n, heads * d]).unwrap(),
            heads,
            &g.upload_segments(&segs).unwrap(),
        )
        .unwrap(),
    );
    let e = max_err(&got, &want);
    assert!(e < 1e-5, "segment attention: {e}");
}

#[test]
fn the_ledger_equals_the_live_buffers_and_the_pool_reaches_a_steady_state() {
    let g = backend();
    let ledger = g.ledger().clone();
    let w = weight(&g, &raw(&noise(64 * 32, 40), &[64, 32]));
    let mut pooled = Vec::new();
    for step in 0..50 {
        let n = 1 + step % 7;
        {
            let x = g.upload(noise(n * 32, step as u64), &[n, 32]).unwrap();
            let y = g.activate(&g.linear(&x, &w, None).unwrap(), Activation::Silu).unwrap();
            let out = host(&g, &g.add(&y, &y).unwrap());
            assert_eq!(out.len(), n * 64);
            assert_eq!(
                ledger.total(),
                g.device_bytes(),
                "step {step}: ledger against live buffers"
            );
        }
        pooled.push(g.pooled());
    }
    // After the first round of sizes the pool stops growing.
    assert_eq!(pooled[20], pooled[49], "pool: {pooled:?}");
    drop(w);
    assert_eq!(ledger.total(), g.device_bytes());
}

#[test]
fn an_allocation_the_device_refuses_is_an_out_of_memory_error_with_the_ledger() {
    let g = backend();
    let _w = weight(&g, &raw(&noise(256, 50), &[16, 16]));
    // More than the device's largest buffer: refused before wgpu sees it.
    let too_big = g.inner.gpu.limits.max_buffer_size + 4;
    match g.create(too_big, super::STORAGE, None) {
        Err(crate::backend::BackendError::OutOfMemory { bytes, ledger }) => {
            assert_eq!(bytes, too_big);
            assert!(ledger.contains("weights"), "{ledger}");
        }
        other => panic!("expected an out-of-memory error, got {other:?}"),
    }
    // An activation above the binding limit is refused with the limit named, and nothing leaks.
    let small = backend_with(WgpuOptions {
        max_binding_bytes: Some(1 << 10),
        ..Default::default()
    });
    let err = small
        .upload(vec![0.0; 1024], &[1, 1024])
        .and_then(|x| small.add(&x, &x))
        .unwrap_err();
    assert!(err.to_string().contains("storage-binding limit"), "{err}");
    assert_eq!(small.ledger().total(), small.device_bytes());
    // The backend keeps working after both.
    assert_eq!(host(&g, &g.upload(vec![1.5], &[1]).unwrap()), vec![1.5]);
}
