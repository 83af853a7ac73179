//! `kvlens bench kernels`: the wgpu backend's matmul kernels against the CPU backend in one run, at
//! Qwen3-VL-2B's shapes — the decode GEMV (one row of x) in GB/s and the prefill GEMM in GFLOP/s,
//! for wgpu with f32, f16, `q8_0` and `q4_0` weights and for the CPU backend (candle, f32).
//!
//! Timing: every sample records its `linear` calls, then reads back one column of the last result,
//! which submits the recorded work and waits until the device has finished it; the first sample
//! (pipeline compile, activation pool, first touch of the weights) is not counted, and the median
//! of the timed samples is reported. A GEMV sample goes once through enough copies of the weight to
//! read `--gemv-mib` MiB, so weights come from memory and not from the caches, as in a decode step
//! where every layer reads different weights.

use anyhow::{bail, Context, Result};
use kvlens_engine::arch::weight_format::WeightFormat;
use kvlens_engine::backend::cpu::CpuBackend;
use kvlens_engine::backend::wgpu::{WgpuBackend, WgpuOptions};
use kvlens_engine::backend::{block_on, Backend, MatrixUse, RawDType, RawTensor};
use kvlens_engine::memory::ledger::MemoryLedger;
use std::time::{Duration, Instant};

/// Flags of `kvlens bench kernels`.
#[derive(Debug, clap::Args)]
pub struct KernelsArgs {
    /// Timed samples per case (the median is reported) [default: 5; 3 with --quick].
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=1000))]
    reps: Option<u64>,
    /// A short run: 3 samples, no lm_head GEMV, 128-row GEMMs.
    #[arg(long)]
    quick: bool,
    /// Rows of x in the prefill GEMMs [default: 512; 128 with --quick].
    #[arg(long, value_parser = clap::value_parser!(u64).range(5..=65_536))]
    gemm_rows: Option<u64>,
    /// MiB of weights a GEMV sample reads: small weights are rotated through copies up to this.
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u64).range(1..=4096))]
    gemv_mib: u64,
    /// Only the cases whose name contains this (e.g. gemv, lm_head, gemm).
    #[arg(long)]
    only: Option<String>,
    /// The wgpu adapter by name (a substring) [default: the best one].
    #[arg(long, env = "KVLENS_WGPU_ADAPTER")]
    adapter: Option<String>,
    /// Seconds of timed samples per case and backend: no sample starts that would end later.
    #[arg(long, default_value_t = 10.0)]
    max_case_s: f64,
    /// No CPU backend (wgpu figures only, no ratios).
    #[arg(long)]
    no_cpu: bool,
}

/// One matmul: y[n×out] = x[n×k] · w[out×k]ᵀ.
#[derive(Debug, Clone, Copy)]
struct Case {
    name: &'static str,
    n: usize,
    k: usize,
    out: usize,
}

impl Case {
    fn is_gemv(&self) -> bool {
        self.n == 1
    }

    fn flops(&self) -> f64 {
        2.0 * (self.n * self.k * self.out) as f64
    }

    /// Bytes one call moves: the weights at `weight_bytes` per element, x read, y written.
    fn bytes(&self, weight_bytes: f64) -> f64 {
        (self.out * self.k) as f64 * weight_bytes + ((self.n * self.k + self.n * self.out) * 4) as f64
    }
}

/// Qwen3-VL-2B's text decoder: hidden 2048, 16 query and 8 KV heads of 128, MLP 6144, vocabulary
/// 151,936 (the lm_head, tied to the embedding).
fn cases(gemm_rows: usize, lm_head: bool) -> Vec<Case> {
    let mut all = vec![
        Case {
            name: "gemv q_proj, o_proj",
            n: 1,
            k: 2048,
            out: 2048,
        },
        Case {
            name: "gemv k_proj, v_proj",
            n: 1,
            k: 2048,
            out: 1024,
        },
        Case {
            name: "gemv gate_proj, up_proj",
            n: 1,
            k: 2048,
            out: 6144,
        },
        Case {
            name: "gemv down_proj",
            n: 1,
            k: 6144,
            out: 2048,
        },
    ];
    if lm_head {
        all.push(Case {
            name: "gemv lm_head",
            n: 1,
            k: 2048,
            out: 151_936,
        });
    }
    all.push(Case {
        name: "gemm gate_proj, up_proj",
        n: gemm_rows,
        k: 2048,
        out: 6144,
    });
    all
}

/// A deterministic stream of integers.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) as u32
    }

    /// Uniform in [-1, 1) on a grid of 1/1024.
    fn unit(&mut self) -> f32 {
        (self.next() % 2048) as f32 / 1024.0 - 1.0
    }
}

/// The f16 bits of `v`, a multiple of 1/1024 in [-1, 1] (exact in f16: at most 11 significant bits).
fn f16_bits(v: f32) -> u16 {
    if v == 0.0 {
        return 0;
    }
    let b = v.to_bits();
    let sign = ((b >> 31) as u16) << 15;
    let exp = (((b >> 23) & 0xff) as i32 - 127 + 15) as u16;
    sign | (exp << 10) | ((b >> 13) & 0x3ff) as u16
}

/// Random weights `out × k` stored as f16, exact in f16 and f32 alike, so that every backend
/// multiplies the same numbers.
fn weight_bytes(out: usize, k: usize, seed: u64) -> Vec<u8> {
    let mut rng = Lcg(seed);
    (0..out * k).flat_map(|_| f16_bits(rng.unit()).to_le_bytes()).collect()
}

/// What one backend measured for one case.
#[derive(Debug, Clone)]
struct Measured {
    /// Median seconds of one `linear` call.
    secs: f64,
    /// Timed samples taken.
    samples: usize,
    /// CPU seconds (all threads of this process) per call over the timed samples: with a CPU
    /// adapter such as lavapipe, the work done whatever else the machine runs.
    cpu_secs: f64,
    y: Vec<f32>,
}

/// CPU seconds used so far by every thread of this process (clock ticks of /proc/self/stat).
fn process_cpu_secs() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return f64::NAN;
    };
    // Fields after the command name (which ends with the last ')'): utime and stime are 12 and 13.
    let fields: Vec<&str> = stat.rsplit(')').next().unwrap_or("").split_whitespace().collect();
    let ticks: f64 = fields
        .get(11..13)
        .map_or(f64::NAN, |f| f.iter().filter_map(|v| v.parse::<f64>().ok()).sum());
    ticks / 100.0
}

/// Rows of x in a GEMM's untimed sample: enough to take the GEMM path (more than 4), few enough
/// to cost a fraction of a timed one on a slow adapter.
const WARM_ROWS: usize = 8;

/// Times `linear(x, w)` on `be`: one untimed sample (for a GEMM on the first `WARM_ROWS` rows of x:
/// the same pipeline), then `reps` timed ones, or fewer where another would end past `budget` (at
/// least one); reports the median. A sample records a pass over `copies` copies of the weight and waits
/// for it once.
#[allow(clippy::too_many_arguments)]
fn measure<B: Backend>(
    be: &B,
    case: Case,
    raw: &RawTensor<'_>,
    x: &[f32],
    copies: usize,
    reps: usize,
    budget: Duration,
) -> Result<Measured> {
    let weights = (0..copies)
        .map(|_| be.load_weight(raw.clone(), MatrixUse::Products))
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("{}: loading the weights", case.name))?;
    let sample = |xt: &B::Tensor| -> Result<(Duration, B::Tensor)> {
        let start = Instant::now();
        let mut last = None;
        for w in &weights {
            last = Some(be.linear(xt, w, None)?);
        }
        let y = last.expect("at least one copy");
        // Reading a small tensor submits everything recorded and waits for the device.
        let probe = be.narrow_cols(&y, 0, 1)?;
        block_on(be.read(&probe))?;
        Ok((start.elapsed(), y))
    };
    let warm_rows = if case.is_gemv() { case.n } else { WARM_ROWS.min(case.n) };
    let (_, y) = sample(&be.upload(x[..warm_rows * case.k].to_vec(), &[warm_rows, case.k])?)?;
    let y = block_on(be.read(&y))?;
    let xt = be.upload(x.to_vec(), &[case.n, case.k])?;
    let mut times = Vec::with_capacity(reps);
    let (cpu0, start) = (process_cpu_secs(), Instant::now());
    let mut last = Duration::ZERO;
    while times.len() < reps && (times.is_empty() || start.elapsed() + last <= budget) {
        last = sample(&xt)?.0;
        times.push(last.as_secs_f64() / copies as f64);
    }
    let cpu_secs = (process_cpu_secs() - cpu0) / (times.len() * copies) as f64;
    times.sort_by(f64::total_cmp);
    Ok(Measured {
        secs: times[times.len() / 2],
        samples: times.len(),
        cpu_secs,
        y,
    })
}

/// Largest |a − b| over the largest |b|.
fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(f32::MIN_POSITIVE);
    let diff = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    f64::from(diff / scale)
}

/// The CPU's model name from /proc/cpuinfo, with the threads this process may use.
fn cpu_model() -> String {
    let name = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string());
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    format!("{name} ({threads} threads)")
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

/// Throughput of a case in its unit: GB/s for a GEMV, GFLOP/s for a GEMM.
fn rate(case: Case, secs: f64, weight_bytes: f64) -> f64 {
    if case.is_gemv() {
        case.bytes(weight_bytes) / secs / 1e9
    } else {
        case.flops() / secs / 1e9
    }
}

/// A weight format the wgpu backend is timed with.
struct Format {
    name: &'static str,
    f16_weights: bool,
    quantization: WeightFormat,
    /// Bytes per weight.
    bytes: f64,
    /// Largest allowed difference from the CPU's f32 result, over its largest value: f32 rounding
    /// for f32 and f16 (the weights are exact in f16), the format's rounding of the weights for
    /// the block formats (measured: about 0.3 % for q8_0 and 5 % for q4_0 on these weights).
    tolerance: f64,
}

const FORMATS: [Format; 4] = [
    Format {
        name: "f32",
        f16_weights: false,
        quantization: WeightFormat::Unquantized,
        bytes: 4.0,
        tolerance: 1e-4,
    },
    Format {
        name: "f16",
        f16_weights: true,
        quantization: WeightFormat::Unquantized,
        bytes: 2.0,
        tolerance: 1e-4,
    },
    Format {
        name: "q8_0",
        f16_weights: false,
        quantization: WeightFormat::Q8_0,
        bytes: 34.0 / 32.0,
        tolerance: 2e-2,
    },
    Format {
        name: "q4_0",
        f16_weights: false,
        quantization: WeightFormat::Q4_0,
        bytes: 18.0 / 32.0,
        tolerance: 2e-1,
    },
];

/// Runs `kvlens bench kernels`.
pub fn run(a: &KernelsArgs) -> Result<()> {
    let reps = a.reps.unwrap_or(if a.quick { 3 } else { 5 }) as usize;
    let gemm_rows = a.gemm_rows.unwrap_or(if a.quick { 128 } else { 512 }) as usize;
    let chosen: Vec<Case> = cases(gemm_rows, !a.quick)
        .into_iter()
        .filter(|c| a.only.as_ref().is_none_or(|o| c.name.contains(o.as_str())))
        .collect();
    if chosen.is_empty() {
        bail!(crate::UsageError(format!("--only {:?} matches no case", a.only)));
    }
    let gpus = FORMATS
        .iter()
        .map(|f| {
            let opts = WgpuOptions {
                adapter: a.adapter.clone(),
                f16_weights: f.f16_weights,
                quantization: f.quantization,
                ..Default::default()
            };
            WgpuBackend::new_blocking(MemoryLedger::new(), opts).context("opening the wgpu adapter")
        })
        .collect::<Result<Vec<_>>>()?;
    let cpu = CpuBackend::new(MemoryLedger::new());
    let load_before = load_average();
    println!("kvlens bench kernels: wgpu matmul kernels against the CPU backend, Qwen3-VL-2B shapes");
    println!("CPU: {}", cpu_model());
    for g in &gpus {
        println!("wgpu: {}", g.describe());
    }
    println!(
        "{reps} timed samples per case (median; fewer, as marked, where more would take over {} s) after one untimed; \
         a GEMV sample reads ≥{} MiB of weights (copies rotated); GB/s = weight bytes (f32 4 B, f16 2 B, q8_0 \
         34/32 B, q4_0 18/32 B per weight) + x + y; GFLOP/s = 2·n·k·out",
        a.max_case_s, a.gemv_mib
    );
    println!("load average before: {load_before}");
    println!();
    let budget = Duration::from_secs_f64(a.max_case_s.max(0.0));
    let started = Instant::now();
    let mut rows = Vec::new();
    for (i, &case) in chosen.iter().enumerate() {
        let raw_bytes = weight_bytes(case.out, case.k, 1 + i as u64);
        let raw = RawTensor {
            dtype: RawDType::F16,
            shape: vec![case.out, case.k],
            data: raw_bytes.as_slice().into(),
        };
        let mut rng = Lcg(100 + i as u64);
        let x: Vec<f32> = (0..case.n * case.k).map(|_| rng.unit()).collect();
        let copies = |elem: f64| {
            if case.is_gemv() {
                ((a.gemv_mib << 20) as f64 / ((case.out * case.k) as f64 * elem))
                    .ceil()
                    .max(1.0) as usize
            } else {
                1
            }
        };
        let measured = gpus
            .iter()
            .zip(&FORMATS)
            .map(|(g, f)| measure(g, case, &raw, &x, copies(f.bytes), reps, budget))
            .collect::<Result<Vec<_>>>()?;
        let c = if a.no_cpu {
            None
        } else {
            Some(measure(&cpu, case, &raw, &x, copies(4.0), reps, budget)?)
        };
        // f16 weights here are exact, so every backend computes the same sums up to f32 rounding
        // (and the block formats' rounding of the weights).
        let reference = c.as_ref().map_or(&measured[0].y, |c| &c.y);
        let errs: Vec<f64> = measured.iter().map(|m| rel_err(&m.y, reference)).collect();
        for (e, f) in errs.iter().zip(&FORMATS) {
            if e.is_nan() || *e >= f.tolerance {
                bail!(
                    "{}: the wgpu result with {} weights differs from the CPU's by {e:.2e} of its largest value",
                    case.name,
                    f.name
                );
            }
        }
        let unit = if case.is_gemv() { "GB/s" } else { "GFLOP/s" };
        let cell = |m: &Measured, elem| {
            let fewer = match m.samples {
                s if s >= reps => String::new(),
                1 => ", 1 sample".to_string(),
                s => format!(", {s} samples"),
            };
            format!("{:.1} {unit} ({:.2} ms{fewer})", rate(case, m.secs, elem), m.secs * 1e3)
        };
        let ratio = |m: &Measured| c.as_ref().map_or("–".into(), |c| format!("{:.2}×", c.secs / m.secs));
        let cpu_ms = |m: &Measured| format!("{:.1}", m.cpu_secs * 1e3);
        let mut cells = vec![case.name.to_string(), format!("{}×{} → {}", case.n, case.k, case.out)];
        cells.extend(measured.iter().zip(&FORMATS).map(|(m, f)| cell(m, f.bytes)));
        cells.push(c.as_ref().map_or("–".into(), |c| cell(c, 4.0)));
        cells.extend(measured.iter().map(ratio));
        let mut ms: Vec<String> = measured.iter().map(cpu_ms).collect();
        ms.push(c.as_ref().map_or("–".into(), cpu_ms));
        cells.push(ms.join(" / "));
        cells.push(errs.iter().map(|e| format!("{e:.0e}")).collect::<Vec<_>>().join(" / "));
        let row = format!("| {} |", cells.join(" | "));
        eprintln!("{row}");
        rows.push(row);
    }
    let names: Vec<&str> = FORMATS.iter().map(|f| f.name).collect();
    let mut header = vec!["kernel".to_string(), "x rows×k → out".to_string()];
    header.extend(names.iter().map(|n| format!("wgpu {n} weights")));
    header.push("CPU (candle f32)".into());
    header.extend(names.iter().map(|n| format!("wgpu {n} vs CPU")));
    header.push(format!("CPU ms per call ({} / CPU)", names.join(" / ")));
    header.push(format!("max rel. diff ({})", names.join(" / ")));
    println!("| {} |", header.join(" | "));
    println!("|{}", "---|".repeat(header.len()));
    for row in &rows {
        println!("{row}");
    }
    println!();
    println!(
        "\"vs CPU\" = CPU backend time / wgpu time (above 1: wgpu faster). \"CPU ms per call\": processor \
         time of every thread of this process (10 ms ticks) over the timed samples — with a CPU adapter \
         such as lavapipe the work done, whatever else the machine runs. Took {:.0} s; load average after: {}",
        started.elapsed().as_secs_f64(),
        load_average()
    );
    Ok(())
}
