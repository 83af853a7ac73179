//! `kvlens plan`: the start-up budget as a table, vLLM-style log lines, or JSON.

use crate::vllm_flags::{non_negative, VllmFlags};
use crate::UsageError;
use anyhow::Result;
use kvlens_engine::config::{bundled_config, ImageLimits, ModelConfig};
use kvlens_engine::memory::device::{device_preset, device_preset_names, gib_to_bytes};
use kvlens_engine::memory::log_budget::{header_settings, rebuild, what_if, DeviceTotal, HeaderSettings};
use kvlens_engine::memory::vllm_log::{parse_vllm_log, ParsedLog, ProfilingFormat};
use kvlens_engine::memory::{plan, Plan, PlanRequest, Source};
use std::path::{Path, PathBuf};

/// Flags as `vllm serve` spells them, plus the device and measured overrides.
#[derive(Debug, clap::Args)]
#[command(allow_negative_numbers = true)]
pub struct PlanArgs {
    /// A bundled model name (e.g. Qwen3-VL-8B-Instruct) or a checkpoint directory with config.json.
    /// [default: the log's model with --from-log, else Qwen3-VL-8B-Instruct]
    #[arg(long)]
    pub model: Option<String>,
    /// Device preset: h100-80g, h200-141g, a100-40g, a100-80g, l40s-48g, rtx4090-24g,
    /// ascend-910b-64g, apple-m2-max-32g, webgpu-4g, webgpu-8g, cpu [default: the log's device, else h100-80g].
    #[arg(long)]
    pub device: Option<String>,
    /// Override the device's total memory (GiB).
    #[arg(long, value_parser = non_negative)]
    pub total_memory_gib: Option<f64>,
    /// [default: 1]
    #[arg(long, short = 't')]
    pub tensor_parallel_size: Option<usize>,
    #[command(flatten)]
    pub vllm: VllmFlags,
    /// Fixed KV cache size (GiB), as vLLM's --kv-cache-memory: the utilization rule is skipped.
    #[arg(long, value_parser = non_negative)]
    pub kv_cache_memory_gib: Option<f64>,
    /// Measured weights memory (GiB) instead of the estimate.
    #[arg(long, value_parser = non_negative)]
    pub weights_gib: Option<f64>,
    /// Measured activation peak (GiB) instead of the estimate.
    #[arg(long, value_parser = non_negative)]
    pub activation_peak_gib: Option<f64>,
    /// Measured non-torch memory (GiB) instead of the device default.
    #[arg(long, value_parser = non_negative)]
    pub non_torch_gib: Option<f64>,
    /// Read a vLLM / vllm-ascend start-up log: its settings and figures rebuild the budget.
    #[arg(long, value_name = "FILE")]
    pub from_log: Option<PathBuf>,
    /// With --from-log: the smallest change of each knob that makes this max_model_len fit.
    #[arg(long, requires = "from_log")]
    pub target_max_model_len: Option<usize>,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
}

fn usage(msg: impl Into<String>) -> anyhow::Error {
    UsageError(msg.into()).into()
}

/// Loads a bundled config by name or a checkpoint directory's config.json (+ preprocessor limits).
pub fn load_model(model: &str) -> Result<(String, ModelConfig, ImageLimits)> {
    let dir = Path::new(model);
    if dir.is_dir() {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| usage(format!("cannot read {}: {e}", path.display())))?;
        let cfg = ModelConfig::from_json(&text).map_err(|e| usage(format!("{}: {e}", path.display())))?;
        let pre = dir.join("preprocessor_config.json");
        let limits = match std::fs::read_to_string(&pre) {
            Ok(t) => ImageLimits::from_preprocessor_json(&t, cfg.family)
                .map_err(|e| usage(format!("{}: {e}", pre.display())))?,
            Err(_) => ImageLimits::shipped(cfg.family),
        };
        let name = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| model.to_string());
        return Ok((name, cfg, limits));
    }
    let cfg = bundled_config(model).map_err(|e| usage(e.to_string()))?;
    let limits = ImageLimits::shipped(cfg.family);
    Ok((model.rsplit('/').next().unwrap_or(model).to_string(), cfg, limits))
}

/// Builds the planner request from the flags; settings a log header names fill in unset flags.
pub fn request_from_args(a: &PlanArgs, header: &HeaderSettings) -> Result<PlanRequest> {
    let model = a
        .model
        .as_deref()
        .or(header.model.as_deref())
        .unwrap_or("Qwen3-VL-8B-Instruct");
    let (name, cfg, limits) = load_model(model)?;
    let device_name = a.device.as_deref().or(header.device.as_deref()).unwrap_or("h100-80g");
    let mut device = device_preset(device_name).ok_or_else(|| {
        usage(format!(
            "unknown device {device_name:?}; known devices: {}",
            device_preset_names()
        ))
    })?;
    if let Some(t) = a.total_memory_gib.or(header.total_memory_gib) {
        device = device.with_total_bytes(gib_to_bytes(t));
    }
    let mut r = PlanRequest::new(name, cfg, device);
    r.image_limits = limits;
    r.tensor_parallel_size = a.tensor_parallel_size.or(header.tensor_parallel_size).unwrap_or(1);
    a.vllm.apply(&mut r, header)?;
    r.kv_cache_memory_bytes = a.kv_cache_memory_gib.map(gib_to_bytes);
    r.weights_bytes = a.weights_gib.map(gib_to_bytes);
    r.activation_peak_bytes = a.activation_peak_gib.map(gib_to_bytes);
    r.non_torch_bytes = a.non_torch_gib.map(gib_to_bytes);
    Ok(r)
}

fn source_label(s: Option<Source>) -> &'static str {
    match s {
        None => "device",
        Some(Source::Estimated) => "estimated",
        Some(Source::Given) => "given",
        Some(Source::Derived) => "derived",
        Some(Source::FromLog) => "from log",
    }
}

/// Renders the plan as an aligned table followed by vLLM's log lines.
pub fn render(p: &Plan) -> String {
    let mut out = format!(
        "{} on {} (TP {}), max_model_len {}, block {}, max_num_batched_tokens {}, max_num_seqs {}, dtype {:?}, KV {:?}\n\n",
        p.model,
        p.device,
        p.tensor_parallel_size,
        p.max_model_len,
        p.block_size,
        p.max_num_batched_tokens,
        p.max_num_seqs,
        p.dtype,
        p.kv_cache_dtype
    );
    let rows = p.table();
    let w0 = rows.iter().map(|r| r.0.len()).max().unwrap_or(0);
    let w1 = rows.iter().map(|r| r.1.len()).max().unwrap_or(0);
    for (label, value, source) in &rows {
        out.push_str(&format!("  {label:<w0$}  {value:>w1$}  {}\n", source_label(*source)));
    }
    out.push('\n');
    for line in p.vllm_log_lines() {
        out.push_str(&line);
        out.push('\n');
    }
    out
}

/// Runs `kvlens plan`.
pub fn run(a: &PlanArgs) -> Result<()> {
    if let Some(path) = &a.from_log {
        let text = std::fs::read(path).map_err(|e| usage(format!("cannot read {}: {e}", path.display())))?;
        return run_from_log(a, &parse_vllm_log(&String::from_utf8_lossy(&text)));
    }
    let req = request_from_args(a, &HeaderSettings::default())?;
    let p = plan(&req).map_err(|e| usage(e.to_string()))?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&p)?);
    } else {
        print!("{}", render(&p));
    }
    Ok(())
}

/// `kvlens plan --from-log`: what was recognised, the rebuilt budget, the checks and the what-ifs.
fn run_from_log(a: &PlanArgs, log: &ParsedLog) -> Result<()> {
    let header = header_settings(log);
    let req = request_from_args(a, &header)?;
    let total = if a.total_memory_gib.or(header.total_memory_gib).is_some() {
        DeviceTotal::Given
    } else {
        DeviceTotal::Preset
    };
    let budget = rebuild(log, req.clone(), total).map_err(|e| usage(e.to_string()))?;
    let answers = a.target_max_model_len.map(|t| what_if(&budget, &req, t));
    if a.json {
        let out = serde_json::json!({
            "recognised": log.recognised,
            "ignored_lines": log.ignored_lines,
            "format": budget.format,
            "plan": budget.plan,
            "checks": budget.checks,
            "notes": budget.notes,
            "target_max_model_len": a.target_max_model_len,
            "what_if": answers,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!(
        "Recognised {} lines ({} ignored):",
        log.recognised.len(),
        log.ignored_lines
    );
    for r in &log.recognised {
        println!("  line {:>3}  {:?}", r.line, r.kind);
    }
    let format = match budget.format {
        Some(ProfilingFormat::Old) => {
            "old vllm-ascend profiling (< v0.15): available = total × util − (torch peak incl. weights + non-torch)"
        }
        Some(ProfilingFormat::New) => {
            "memory_profiling (vLLM, vllm-ascend ≥ v0.15): available = total × util − (weights + torch peak increase + non-torch increase)"
        }
        None => "no profiling lines: the planner estimates what the log does not say",
    };
    println!("Formula: {format}");
    for note in &budget.notes {
        println!("{note}");
    }
    println!();
    print!("{}", render(&budget.plan));
    println!("\nChecks of the log against itself:");
    for c in &budget.checks {
        println!(
            "  [{}] {}\n        {}",
            if c.ok { "ok" } else { "MISMATCH" },
            c.formula,
            c.detail
        );
    }
    if let (Some(t), Some(answers)) = (a.target_max_model_len, answers) {
        println!("\nTo fit max_model_len {t}, changing one knob at a time:");
        for w in answers {
            let change = w.change.as_deref().unwrap_or("cannot on its own");
            println!("  {:<24} {change}\n        {}", w.knob, w.detail);
        }
    }
    Ok(())
}
