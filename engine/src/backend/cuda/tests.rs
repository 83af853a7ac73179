//! The CUDA backend against the shared suite and, op by op, against the CPU backend. They need an
//! NVIDIA GPU, so they are `#[ignore]`d: `cargo xtask gpu-check` runs them with `--ignored` on the
//! GPU machine. Without a GPU only the opening of the backend is tested: it must fail with a
//! message, never panic.

use super::{CudaBackend, CudaOptions};
use crate::backend::cpu::CpuBackend;
use crate::backend::suite::{block_tables, host, max_err, noise};
use crate::backend::{block_on, Backend, KvLayout, MatrixUse, PagedBatch, PagedSeq, RawDType, RawTensor, TableShape};
use crate::memory::ledger::{Category, MemoryLedger};

fn open(options: CudaOptions) -> CudaBackend {
    CudaBackend::new(MemoryLedger::new(), options).unwrap_or_else(|e| panic!("no CUDA device: {e}"))
}

fn backend_with(bf16_weights: bool) -> CudaBackend {
    open(CudaOptions {
        bf16_weights,
        ..CudaOptions::default()
    })
}

fn backend() -> CudaBackend {
    backend_with(false)
}

crate::backend_suite!(ignored "needs an NVIDIA GPU: cargo xtask gpu-check runs it there"; backend());
crate::backend_suite!(hybrid ignored "needs an NVIDIA GPU: cargo xtask gpu-check runs it there"; backend());

/// NVRTC compiles every kernel for the H100 (9.0) and the oldest architecture CUDA 13 targets
/// (7.5). Needs only the NVRTC library: `cargo xtask test` installs PyPI's `nvidia-cuda-nvrtc`
/// and puts it on the library path.
#[test]
fn every_kernel_compiles_under_nvrtc() {
    // SAFETY: only opens the library.
    #[allow(unsafe_code)]
    let present = unsafe { cudarc::nvrtc::sys::is_culib_present() };
    assert!(
        present,
        "NVRTC (libnvrtc.so.13) is not on the library path: run through `cargo xtask test`, which installs it"
    );
    for (major, minor) in [(9, 0), (7, 5)] {
        let ptx = super::compile(major, minor).unwrap_or_else(|e| panic!("compute_{major}{minor}: {e}"));
        let text = ptx.to_src();
        for name in super::KERNELS {
            assert!(text.contains(&format!(".entry {name}(")), "{name} missing from the PTX");
        }
        assert!(
            text.contains(&format!(".target sm_{major}{minor}")),
            "PTX for another target"
        );
    }
}

/// The kernels run on the CPU (`emulate/cuda_on_cpu.h`: a thread per CUDA thread, barriers for
/// `__syncthreads` and the warp shuffles) against plain C++ references, so that what a kernel
/// computes is checked on machines without a GPU: the C++ compiler builds
/// `emulate/kernel_checks.cpp` with kernels.cu, and the test runs it.
#[test]
fn kernels_match_references_on_the_cpu() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/backend/cuda/emulate");
    let exe = std::env::temp_dir().join(format!("kvlens-kernel-checks-{}", std::process::id()));
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let built = std::process::Command::new(&cxx)
        .args(["-std=c++20", "-O1", "-pthread", "-Wno-unknown-pragmas"])
        .arg(dir.join("kernel_checks.cpp"))
        .arg("-o")
        .arg(&exe)
        .output()
        .unwrap_or_else(|e| panic!("no C++ compiler ({cxx}: {e}): `cargo xtask test` installs g++"));
    assert!(
        built.status.success(),
        "kernel_checks.cpp does not build:\n{}",
        String::from_utf8_lossy(&built.stderr)
    );
    let ran = std::process::Command::new(&exe).output().expect("kernel_checks runs");
    let _ = std::fs::remove_file(&exe);
    let report = String::from_utf8_lossy(&ran.stdout);
    assert!(ran.status.success() && report.contains("\n0 failed"), "{report}");
}

#[test]
fn opening_without_a_usable_gpu_is_an_error_not_a_panic() {
    let opened = std::panic::catch_unwind(|| CudaBackend::new(MemoryLedger::new(), CudaOptions::default()).map(|_| ()));
    let result = opened.expect("opening the CUDA backend panicked");
    if let Err(e) = result {
        assert!(!e.to_string().is_empty());
    }
}

fn bf16_bytes(data: &[f32]) -> Vec<u8> {
    data.iter()
        .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
        .collect()
}

#[test]
#[ignore = "needs an NVIDIA GPU: cargo xtask gpu-check runs it there"]
fn bf16_linear_matches_the_cpu_on_the_same_rounded_inputs() {
    for gemv in [true, false] {
        bf16_linear_on(CudaOptions {
            bf16_weights: true,
            gemv,
            ..CudaOptions::default()
        });
    }
}

/// Decode's shapes (1 and 4 rows: `gemv_bf16` where it is on) and prefill's (cuBLAS), k a
/// multiple of 8 and not.
fn bf16_linear_on(options: CudaOptions) {
    let cpu = CpuBackend::default();
    let gpu = open(options);
    for (n, k, m) in [
        (1, 64, 300),
        (4, 2048, 1000),
        (7, 130, 33),
        (1, 130, 9),
        (300, 256, 512),
    ] {
        let w = noise(m * k, 1);
        let bytes = bf16_bytes(&w);
        let raw = || RawTensor {
            dtype: RawDType::Bf16,
            shape: vec![m, k],
            data: bytes.as_slice().into(),
        };
        // The GPU rounds x to bf16 before the GEMM; give the CPU the same rounded x.
        let x: Vec<f32> = noise(n * k, 2)
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_f32())
            .collect();
        let want = host(
            &cpu,
            &cpu.linear(
                &cpu.upload(x.clone(), &[n, k]).unwrap(),
                &cpu.load_weight(raw(), MatrixUse::Products).unwrap(),
                None,
            )
            .unwrap(),
        );
        let wg = gpu.load_weight(raw(), MatrixUse::Products).unwrap();
        assert_eq!(
            gpu.ledger().bytes(Category::Weights),
            (2 * m * k) as u64,
            "bf16 weights are kept as stored"
        );
        let got = host(&gpu, &gpu.linear(&gpu.upload(x, &[n, k]).unwrap(), &wg, None).unwrap());
        assert!(
            max_err(&got, &want) < 1e-3 * k as f32,
            "{n}×{k}·{m} ({options:?}): {}",
            max_err(&got, &want)
        );
        drop(wg);
    }
}

/// A layer's q/k/v (biased, as Qwen2's) of one decode row in one `linears` call, on both paths:
/// each product equals its own `linear`, and the CPU's.
#[test]
#[ignore = "needs an NVIDIA GPU: cargo xtask gpu-check runs it there"]
fn bf16_linears_of_one_row_match_their_single_products() {
    let k = 256;
    // Five matrices: two launches of gemv_bf16 (GEMV_JOBS a launch).
    let weights: Vec<(Vec<u8>, Vec<f32>)> = [128, 64, 64, 40, 24]
        .iter()
        .enumerate()
        .map(|(i, &m)| (bf16_bytes(&noise(m * k, 10 + i as u64)), noise(m, 20 + i as u64)))
        .collect();
    let x: Vec<f32> = noise(k, 3).iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect();
    fn all<B: Backend>(b: &B, x: &[f32], weights: &[(Vec<u8>, Vec<f32>)]) -> Vec<Vec<f32>> {
        let k = x.len();
        let ws: Vec<_> = weights
            .iter()
            .map(|(bits, bias)| {
                let raw = RawTensor {
                    dtype: RawDType::Bf16,
                    shape: vec![bias.len(), k],
                    data: bits.as_slice().into(),
                };
                (
                    b.load_weight(raw, MatrixUse::Products).unwrap(),
                    b.upload(bias.clone(), &[bias.len()]).unwrap(),
                )
            })
            .collect();
        let pairs: Vec<_> = ws.iter().map(|(w, bias)| (w, Some(bias))).collect();
        let xt = b.upload(x.to_vec(), &[1, k]).unwrap();
        b.linears(&xt, &pairs).unwrap().iter().map(|t| host(b, t)).collect()
    }
    let want = all(&CpuBackend::default(), &x, &weights);
    for gemv in [true, false] {
        let options = CudaOptions {
            bf16_weights: true,
            gemv,
            ..CudaOptions::default()
        };
        let gpu = open(options);
        for (i, (got, want)) in all(&gpu, &x, &weights).iter().zip(&want).enumerate() {
            assert!(
                max_err(got, want) < 1e-3 * k as f32,
                "matrix {i} (gemv {gemv}): {}",
                max_err(got, want)
            );
        }
    }
}

/// Decode's fused kernels (`KVLENS_CUDA_FUSED`, on by default) against the same operations
/// unfused and on the CPU, with bf16 weights so that SwiGLU takes `gemv_bf16_glu`: the fused
/// SwiGLU is the unfused one to the bit (the same sums in the same order).
#[test]
#[ignore = "needs an NVIDIA GPU: cargo xtask gpu-check runs it there"]
fn fused_kernels_equal_their_parts_and_the_cpu() {
    // x of K columns, gate and up [M, K], HEADS heads of HEAD values.
    const K: usize = 256;
    const M: usize = 72;
    const HEAD: usize = 128;
    const HEADS: usize = 3;
    let (gate, up) = (bf16_bytes(&noise(M * K, 30)), bf16_bytes(&noise(M * K, 31)));
    fn all<B: Backend>(b: &B, rows: usize, gate: &[u8], up: &[u8]) -> Vec<Vec<f32>> {
        let t = |data: Vec<f32>, shape: &[usize]| b.upload(data, shape).unwrap();
        let w = |bits: &[u8]| {
            let raw = RawTensor {
                dtype: RawDType::Bf16,
                shape: vec![M, K],
                data: bits.into(),
            };
            b.load_weight(raw, MatrixUse::Products).unwrap()
        };
        let x = t(noise(rows * K, 32), &[rows, K]);
        let glu = b.swiglu(&x, &w(gate), &w(up)).unwrap();
        let (sum, normed) = b
            .add_rms_norm(&x, &t(noise(rows * K, 33), &[rows, K]), &t(noise(K, 34), &[K]), 1e-6)
            .unwrap();
        let (cos, sin) = (
            t(noise(rows * HEAD, 35), &[rows, HEAD]),
            t(noise(rows * HEAD, 36), &[rows, HEAD]),
        );
        let qk = t(noise(rows * HEADS * HEAD, 37), &[rows, HEADS * HEAD]);
        let norm = t(noise(HEAD, 38), &[HEAD]);
        let roped = b.norm_rope(&qk, Some(&norm), 1e-6, &cos, &sin, HEAD).unwrap();
        [glu, sum, normed, roped].iter().map(|t| host(b, t)).collect()
    }
    for rows in [1, 3] {
        let cpu = all(&CpuBackend::default(), rows, &gate, &up);
        let open_fused = |fused| {
            open(CudaOptions {
                bf16_weights: true,
                fused,
                ..CudaOptions::default()
            })
        };
        let (fused, unfused) = (
            all(&open_fused(true), rows, &gate, &up),
            all(&open_fused(false), rows, &gate, &up),
        );
        assert_eq!(fused[0], unfused[0], "SwiGLU of {rows} rows, fused and not");
        for (i, (what, tol)) in [
            ("SwiGLU", 1e-3 * K as f32),
            ("sum", 1e-6),
            ("normed", 1e-5),
            ("norm_rope", 1e-5),
        ]
        .into_iter()
        .enumerate()
        {
            for (got, kernels) in [(&fused[i], "fused"), (&unfused[i], "unfused")] {
                let err = max_err(got, &cpu[i]);
                assert!(err <= tol, "{what} of {rows} rows, {kernels}: {err} from the CPU");
            }
        }
    }
}

/// `KVLENS_CUDA_PROFILE=1`: a decode step's launches are counted by kernel, with time on the GPU.
#[test]
#[ignore = "needs an NVIDIA GPU: cargo xtask gpu-check runs it there"]
fn the_kernel_profile_counts_a_decode_steps_launches() {
    std::env::set_var("KVLENS_CUDA_PROFILE", "1");
    let gpu = backend_with(true);
    let (k, m) = (512, 256);
    let raw = RawTensor {
        dtype: RawDType::Bf16,
        shape: vec![m, k],
        data: bf16_bytes(&noise(m * k, 40)).into(),
    };
    let w = gpu.load_weight(raw, MatrixUse::Products).unwrap();
    super::profile::step(1, super::launch::GEMV_MAX_ROWS);
    let x = gpu.upload(noise(k, 41), &[1, k]).unwrap();
    host(&gpu, &gpu.linear(&x, &w, None).unwrap());
    let p = super::kernel_profile();
    std::env::remove_var("KVLENS_CUDA_PROFILE");
    let gemv = &p["decode"]["gemv_bf16"];
    assert!(
        gemv["launches"].as_u64() >= Some(1) && gemv["gpu_ms"].as_f64().is_some_and(|ms| ms > 0.0),
        "{p}"
    );
}

/// The tiled segment attention (`KVLENS_CUDA_ATTENTION=tiled`) against the CPU: the vision heads
/// (64: Qwen3-VL, 80: Qwen2/2.5-VL), the widest heads that tile (128 at 3 rows a warp, 160 at 1),
/// and segments that start and end inside key tiles and row blocks, a one-row segment among them
/// (Qwen2.5-VL's windows are 64 rows; an image's full attention is thousands).
#[test]
#[ignore = "needs an NVIDIA GPU: cargo xtask gpu-check runs it there"]
fn tiled_segment_attention_matches_the_cpu() {
    let cpu = CpuBackend::default();
    let gpu = tiled_backend();
    assert!(gpu.describe().contains("tiles"));
    let segs = [(0, 1), (1, 36), (37, 64), (101, 499), (600, 100)];
    for (heads, d) in [(3, 64), (2, 80), (2, 128), (1, 160)] {
        let err = segment_error(&cpu, &gpu, heads, d, &segs);
        assert!(err < 1e-4, "heads of {d}: {err}");
    }
}

/// The largest difference between the CPU's and `gpu`'s segment attention over random q, k, v of
/// the rows the segments cover.
fn segment_error(cpu: &CpuBackend, gpu: &CudaBackend, heads: usize, d: usize, segs: &[(usize, usize)]) -> f32 {
    let rows = segs.iter().map(|&(_, n)| n).sum::<usize>();
    let [q, k, v] = [1, 2, 3].map(|s| noise(rows * heads * d, s));
    fn on<B: Backend>(
        b: &B,
        qkv: [&Vec<f32>; 3],
        shape: [usize; 2],
        heads: usize,
        segs: &[(usize, usize)],
    ) -> Vec<f32> {
        let [q, k, v] = qkv.map(|x| b.upload(x.clone(), &shape).unwrap());
        let out = b
            .segment_attention(&q, &k, &v, heads, &b.upload_segments(segs).unwrap())
            .unwrap();
        block_on(b.read(&out)).unwrap()
    }
    let shape = [rows, heads * d];
    max_err(
        &on(gpu, [&q, &k, &v], shape, heads, segs),
        &on(cpu, [&q, &k, &v], shape, heads, segs),
    )
}

fn tiled_backend() -> CudaBackend {
    open(CudaOptions {
        tiled_attention: true,
        ..CudaOptions::default()
    })
}

/// The vision tower's segments, a 300-token prefill and a decode row after it: with split
/// attention for the few rows (the default), without it (`KVLENS_CUDA_DECODE_ATTENTION=rows`),
/// and with the tiled kernels for the many (`KVLENS_CUDA_ATTENTION=tiled`).
#[test]
#[ignore = "needs an NVIDIA GPU: cargo xtask gpu-check runs it there"]
fn long_attention_matches_the_cpu() {
    long_attention_on(&backend());
    long_attention_on(&open(CudaOptions {
        split_attention: false,
        ..CudaOptions::default()
    }));
    long_attention_on(&tiled_backend());
}

fn long_attention_on(gpu: &CudaBackend) {
    let cpu = CpuBackend::default();
    // The vision tower: two segments, one longer than the CPU's query chunk; heads of 80.
    let err = segment_error(&cpu, gpu, 3, 80, &[(0, 600), (600, 100)]);
    assert!(err < 1e-4, "segments ({}): {err}", gpu.describe());

    // The decoder: GQA (4 heads over 2 KV heads of 128), 300 tokens over shuffled blocks of 16,
    // prefilled in one step, then one decode row over all 301 keys.
    let layout = KvLayout {
        layers: 1,
        num_blocks: 40,
        block_size: 16,
        kv_heads: 2,
        head_dim: 128,
        tables: TableShape {
            rows: 1,
            max_blocks: 19,
        },
    };
    let table: Vec<usize> = (1..=19).rev().collect();
    let tokens = 300;
    let slots: Vec<usize> = (0..tokens).map(|p| table[p / 16] * 16 + p % 16).collect();
    let batch = PagedBatch {
        layout,
        slots,
        seqs: vec![PagedSeq {
            query_start: 0,
            query_len: tokens,
            context_len: tokens,
            table_row: 0,
            table_len: table.len(),
        }],
    };
    let [kq, kk, kv] = [4, 5, 6].map(|s| noise(tokens * 4 * 128, s));
    fn prefill_on<B: Backend>(b: &B, table: &[usize], batch: &PagedBatch, q: &[f32], k: &[f32], v: &[f32]) -> Vec<f32> {
        let (rows, layout) = (batch.slots.len(), batch.layout);
        let mut cache = b.alloc_kv(layout).unwrap();
        let tables = block_tables(b, layout, &[table.to_vec()]);
        let p = b.upload_paged(batch.clone(), &tables).unwrap();
        let kt = b.upload(k[..rows * 256].to_vec(), &[rows, 256]).unwrap();
        let vt = b.upload(v[..rows * 256].to_vec(), &[rows, 256]).unwrap();
        b.write_kv(&mut cache, 0, &kt, &vt, &p).unwrap();
        let qt = b.upload(q.to_vec(), &[rows, 512]).unwrap();
        let mut out = block_on(b.read(&b.paged_attention(&cache, 0, &qt, 4, &p).unwrap())).unwrap();
        let decode = PagedBatch {
            layout,
            slots: vec![table[rows / 16] * 16 + rows % 16],
            seqs: vec![PagedSeq {
                query_start: 0,
                query_len: 1,
                context_len: rows + 1,
                table_row: 0,
                table_len: table.len(),
            }],
        };
        let p = b.upload_paged(decode, &tables).unwrap();
        let kt = b.upload(k[rows * 256..(rows + 1) * 256].to_vec(), &[1, 256]).unwrap();
        let vt = b.upload(v[rows * 256..(rows + 1) * 256].to_vec(), &[1, 256]).unwrap();
        b.write_kv(&mut cache, 0, &kt, &vt, &p).unwrap();
        let qt = b.upload(q[..512].to_vec(), &[1, 512]).unwrap();
        out.extend(block_on(b.read(&b.paged_attention(&cache, 0, &qt, 4, &p).unwrap())).unwrap());
        out
    }
    let want = prefill_on(&cpu, &table, &batch, &kq, &kk, &kv);
    let got = prefill_on(gpu, &table, &batch, &kq, &kk, &kv);
    assert!(
        max_err(&got, &want) < 1e-4,
        "paged ({}): {}",
        gpu.describe(),
        max_err(&got, &want)
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU: cargo xtask gpu-check runs it there"]
fn a_metadata_slot_outside_the_cache_is_refused_before_any_kernel() {
    let gpu = backend();
    let layout = KvLayout {
        layers: 1,
        num_blocks: 2,
        block_size: 4,
        kv_heads: 1,
        head_dim: 8,
        tables: TableShape { rows: 1, max_blocks: 1 },
    };
    let _cache = gpu.alloc_kv(layout).unwrap();
    let tables = block_tables(&gpu, layout, &[vec![1]]);
    let batch = PagedBatch {
        layout,
        slots: vec![9],
        seqs: vec![PagedSeq {
            query_start: 0,
            query_len: 1,
            context_len: 1,
            table_row: 0,
            table_len: 1,
        }],
    };
    assert!(gpu.upload_paged(batch, &tables).is_err());
}
