//! `kvlens plan`: the start-up budget as a table, vLLM-style log lines, or JSON.

use crate::checkpoint::{Checkpoint, WeightFiles};
use crate::usage;
use anyhow::Result;
use kvlens_engine::arch::config::{ImageLimits, ModelConfig};
use kvlens_engine::memory::log_budget::HeaderSettings;
use kvlens_engine::memory::plan_inputs::{bundled_model, PlanInputs, PlanModel};
use kvlens_engine::memory::vllm_log::{parse_vllm_log, ParsedLog};
use kvlens_engine::memory::{plan, Plan, PlanError, Source};
use std::path::{Path, PathBuf};

/// Flags as `vllm serve` spells them, plus the device and measured overrides.
#[derive(Debug, clap::Args)]
#[command(allow_negative_numbers = true)]
pub struct PlanArgs {
    #[command(flatten)]
    pub inputs: PlanInputs,
    /// Read a vLLM / vllm-ascend start-up log: its settings and figures rebuild the budget.
    #[arg(long, value_name = "FILE")]
    pub from_log: Option<PathBuf>,
    /// With --from-log: the smallest change of each knob that makes this max_model_len fit.
    #[arg(long, requires = "from_log")]
    pub target_max_model_len: Option<usize>,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
    /// The projector (mmproj-*.gguf) of a GGUF --model file: the weights are then the two files'
    /// tensors as stored.
    #[arg(long)]
    pub mmproj: Option<PathBuf>,
}

/// Loads a bundled config by name or a checkpoint directory's config.json (+ preprocessor limits).
pub(crate) fn load_model(model: &str) -> Result<PlanModel, PlanError> {
    let dir = Path::new(model);
    if !dir.is_dir() {
        return bundled_model(model);
    }
    if !dir.join("config.json").is_file() {
        return Ok(open_gguf(dir, None)?.0);
    }
    let bad = PlanError::Invalid;
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| bad(format!("cannot read {}: {e}", path.display())))?;
    let cfg = ModelConfig::from_json(&text).map_err(|e| bad(format!("{}: {e}", path.display())))?;
    let pre = dir.join("preprocessor_config.json");
    let limits = match std::fs::read_to_string(&pre) {
        Ok(t) => {
            ImageLimits::from_preprocessor_json(&t, cfg.family).map_err(|e| bad(format!("{}: {e}", pre.display())))?
        }
        Err(_) => ImageLimits::shipped(cfg.family),
    };
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| model.to_string());
    Ok((name, cfg, limits))
}

/// A GGUF model (a file with or without its projector, or a directory holding them): its config, the
/// family's shipped image limits (the files carry none) and the bytes of its tensors as stored.
fn open_gguf(model: &Path, mmproj: Option<&Path>) -> Result<(PlanModel, u64), PlanError> {
    let ckpt = Checkpoint::open(model, mmproj).map_err(|e| PlanError::Invalid(format!("{e:#}")))?;
    let WeightFiles::Gguf(pair) = &ckpt.weights else {
        return Err(PlanError::Invalid(format!("{} is not a GGUF model", model.display())));
    };
    let stored = pair
        .model()
        .map_err(|e| PlanError::Invalid(format!("{e:#}")))?
        .stored_bytes();
    let name = model
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let limits = ImageLimits::shipped(ckpt.config.family);
    Ok(((name, ckpt.config, limits), stored))
}

/// Renders the plan as an aligned table followed by vLLM's log lines.
pub fn render(p: &Plan) -> String {
    let mut out = format!("{}\n\n{}\n\n", p.summary(), p.verdict());
    let rows = p.table();
    let w0 = rows.iter().map(|r| r.0.len()).max().unwrap_or(0);
    let w1 = rows.iter().map(|r| r.1.len()).max().unwrap_or(0);
    for (label, value, source) in &rows {
        out.push_str(&format!("  {label:<w0$}  {value:>w1$}  {}\n", Source::label(*source)));
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
    // A GGUF model's weights are its tensors' bytes as stored, not a count from its config.
    let stored = std::cell::Cell::new(None);
    let load = |model: &str| -> Result<PlanModel, PlanError> {
        let path = Path::new(model);
        let gguf = a.mmproj.is_some()
            || (path.is_dir() && !path.join("config.json").is_file())
            || (path.is_file() && path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf")));
        if !gguf {
            return load_model(model);
        }
        let (m, bytes) = open_gguf(path, a.mmproj.as_deref())?;
        stored.set(Some(bytes));
        Ok(m)
    };
    let mut req = a
        .inputs
        .request(&HeaderSettings::default(), load)
        .map_err(|e| usage(e.to_string()))?;
    if req.weights_bytes.is_none() {
        req.weights_bytes = stored.get();
    }
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
    let (budget, answers) = a
        .inputs
        .explain_log(log, a.target_max_model_len, load_model)
        .map_err(|e| usage(e.to_string()))?;
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
    println!("Formula: {}", budget.formula());
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
