//! Engine start-up as vLLM does it: load the weights, profile one full batch plus the largest
//! images on the backend, size the KV cache from what is left (the planner's formulas with the
//! measured figures), allocate it, and log the same lines as vLLM.

use crate::random_checkpoint_cmd;
use crate::runtime::{device_of, load, Frontend};
use crate::usage;
use anyhow::Result;
use kvlens_engine::arch::config::ProcessorKwargs;
use kvlens_engine::backend::{block_on, BackendKind};
use kvlens_engine::builder::{build_engine, BackendChoice, BuildError, EngineOptions};
use kvlens_engine::engine::Engine;
use kvlens_engine::memory::device::gib_to_bytes;
use kvlens_engine::memory::log_budget::HeaderSettings;
use kvlens_engine::memory::plan_inputs::{parse_dtype, VllmFlags};
use kvlens_engine::memory::planner::{MmLimits, Plan, PlanRequest};
use kvlens_engine::memory::GIB;
use kvlens_engine::profile::ProfileResult;
use std::path::PathBuf;
use std::time::Instant;

/// Largest `--preprocess-memory-gib`.
const MAX_PREPROCESS_GIB: f64 = 1024.0;

/// The engine flags of `kvlens serve`, spelled as `vllm serve` spells them.
#[derive(Debug, Clone, clap::Args, serde::Serialize)]
pub struct EngineArgs {
    /// Checkpoint: a Hugging Face directory, a GGUF text model (with --mmproj), or a directory
    /// holding one text GGUF and one mmproj-*.gguf [default: the bundled tiny demo checkpoint,
    /// generated under ~/.cache/kvlens on first use].
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// The projector (mmproj-*.gguf) of a GGUF --model file, as llama.cpp's --mmproj.
    #[arg(long)]
    pub mmproj: Option<PathBuf>,
    /// Model name(s) the API answers to [default: the --model argument].
    #[arg(long, num_args = 1..)]
    pub served_model_name: Vec<String>,
    #[command(flatten)]
    #[serde(flatten)]
    pub vllm: VllmFlags,
    /// Memory of the CPU "device" in GiB, for the cpu and wgpu backends [default: 40% of the
    /// machine's RAM]; the cuda backend sizes for the GPU's memory.
    #[arg(long)]
    pub cpu_memory_gib: Option<f64>,
    /// A fixed KV cache size in bytes, as vLLM's --kv-cache-memory-bytes: the utilization rule
    /// is skipped (a small cache shows eviction and preemption on a small machine).
    #[arg(long)]
    pub kv_cache_memory_bytes: Option<u64>,
    /// Most tokens one request computes per step, so one long prompt cannot hold every step
    /// [default: 0, no cap; 4% of max_model_len when --max-num-partial-prefills is over 1].
    #[arg(long, default_value_t = 0)]
    pub long_prefill_token_threshold: usize,
    /// vLLM's count of prompts prefilled at once; kvlens (like vLLM v1) prefills any number, and
    /// a value over 1 only sets the default --long-prefill-token-threshold as vLLM does.
    #[arg(long, default_value_t = 1)]
    pub max_num_partial_prefills: usize,
    /// Host memory, in GiB, that requests on their way to the engine may hold at once (bodies,
    /// fetched images, tokenization, images being decoded and preprocessed); past it they wait
    /// (then get a 503) [default: 1, raised to fit the largest allowed image; at most 1024].
    #[arg(long)]
    pub preprocess_memory_gib: Option<f64>,
    /// Reuse KV blocks across requests (on by default).
    #[arg(long, overrides_with = "no_enable_prefix_caching")]
    pub enable_prefix_caching: bool,
    /// Turn prefix caching off.
    #[arg(long)]
    pub no_enable_prefix_caching: bool,
    /// Seed of requests that give none.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// A Jinja chat template file replacing the checkpoint's.
    #[arg(long)]
    pub chat_template: Option<PathBuf>,
    /// Compute backend: cpu, wgpu or cuda (those this build holds).
    #[arg(long, default_value = "cpu")]
    pub backend: BackendKind,
    /// vLLM's tensor parallelism: kvlens runs on one device, so only 1 is accepted (`kvlens plan`
    /// plans larger degrees).
    #[arg(long, default_value_t = 1)]
    pub tensor_parallel_size: usize,
}

/// A started engine and everything the server reports about how it was sized.
#[derive(Debug)]
pub struct Started {
    /// The engine, KV cache allocated.
    pub engine: Engine,
    /// Tokenizer, template and image processing.
    pub frontend: Frontend,
    /// Names the API answers to (the first is reported).
    pub served_model_names: Vec<String>,
    /// The checkpoint directory.
    pub model_dir: PathBuf,
    /// The start-up budget with measured weights and activation peak.
    pub plan: Plan,
    /// What the profile run measured.
    pub profile: ProfileResult,
    /// The start-up lines as logged.
    pub log_lines: Vec<String>,
}

/// The demo checkpoint directory, written on first use.
pub fn demo_checkpoint() -> Result<PathBuf> {
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .ok_or_else(|| usage("HOME is not set: pass --model DIR"))?;
    let root = home.join(".cache/kvlens");
    let dir = root.join("demo-model");
    if dir.join("config.json").is_file() && dir.join("model.safetensors").is_file() {
        return Ok(dir);
    }
    std::fs::create_dir_all(&root)?;
    tracing::info!("writing the tiny demo checkpoint to {} (first use)", dir.display());
    random_checkpoint_cmd::write_demo(&dir)?;
    Ok(dir)
}

/// Loads, profiles and sizes the engine; prints vLLM's start-up lines to stderr.
pub fn start(a: &EngineArgs) -> Result<Started> {
    let dtype = parse_dtype("dtype", &a.vllm.dtype).map_err(|e| usage(e.to_string()))?;
    let kv_dtype = parse_dtype("kv-cache-dtype", &a.vllm.kv_cache_dtype).map_err(|e| usage(e.to_string()))?;
    let choice = BackendChoice::new(a.backend, dtype, a.vllm.quantization.parse().map_err(usage)?).map_err(usage)?;
    let caps = a
        .backend
        .capabilities()
        .ok_or_else(|| usage(format!("no {} backend", a.backend)))?;
    // The weight matrices' dtype, for the replay line below.
    let weights_dtype = choice.weights_dtype();
    for (flag, d, given) in [
        ("--dtype", dtype, &a.vllm.dtype),
        ("--kv-cache-dtype", kv_dtype, &a.vllm.kv_cache_dtype),
    ] {
        if d.is_some_and(|d| d != caps.compute) {
            let weights = if flag == "--dtype" && choice.half_weights {
                format!(" (its weight matrices in {})", weights_dtype.name())
            } else {
                String::new()
            };
            tracing::warn!(
                "{flag} {given}: the {} backend computes and stores activations and the KV cache in {}{weights}",
                a.backend,
                caps.compute.name()
            );
        }
    }
    let limits = match &a.vllm.limit_mm_per_prompt {
        Some(s) => MmLimits::parse(s).map_err(|e| usage(e.to_string()))?,
        None => MmLimits::default(),
    };
    let model_dir = match &a.model {
        Some(dir) => dir.clone(),
        None => demo_checkpoint()?,
    };
    let served_model_names = if a.served_model_name.is_empty() {
        vec![a
            .model
            .as_ref()
            .map_or("kvlens-demo".to_string(), |m| m.display().to_string())]
    } else {
        a.served_model_name.clone()
    };
    if a.tensor_parallel_size > 1 {
        return Err(usage(format!(
            "--tensor-parallel-size {}: kvlens runs a model on one device. `kvlens plan --tensor-parallel-size {}` \
             plans the per-rank budget vLLM would use; serve with --tensor-parallel-size 1",
            a.tensor_parallel_size, a.tensor_parallel_size
        )));
    }
    // Parsed before the (possibly long) load; checked against the checkpoint's limits after it.
    let pixels = match &a.vllm.mm_processor_kwargs {
        Some(json) => ProcessorKwargs::parse(json).map_err(|e| usage(e.to_string()))?,
        None => ProcessorKwargs::default(),
    };
    for key in &pixels.ignored {
        tracing::warn!("--mm-processor-kwargs: {key} is ignored (kvlens reads min_pixels and max_pixels)");
    }
    // A test hook: `KVLENS_HOLD_LOAD=FILE` keeps the server loading until FILE exists, so that a
    // test sees the loading state (`/health` 503) for as long as it needs.
    if let Some(path) = std::env::var_os("KVLENS_HOLD_LOAD").map(PathBuf::from) {
        tracing::warn!("KVLENS_HOLD_LOAD: loading waits for {} to exist", path.display());
        while !path.exists() {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
    let (runner, mut frontend) = load(&model_dir, a.mmproj.as_deref(), choice)?;
    let (device, non_torch) = device_of(&*runner, a.cpu_memory_gib)?;
    let total = device.total_bytes;
    if let Some(path) = &a.chat_template {
        frontend.set_chat_template(path)?;
    }
    frontend.settings.limits = pixels
        .apply(frontend.settings.limits)
        .map_err(|e| usage(e.to_string()))?;
    frontend.limit_images = limits.image;
    let preprocess_bytes = match a.preprocess_memory_gib {
        Some(g) if g > 0.0 && g <= MAX_PREPROCESS_GIB => gib_to_bytes(g),
        Some(g) => {
            return Err(usage(format!(
                "--preprocess-memory-gib must be more than 0 and at most {MAX_PREPROCESS_GIB} GiB (a budget larger \
                 than any host's memory bounds nothing), got {g}"
            )))
        }
        None => crate::runtime::DEFAULT_PREPROCESS_BYTES,
    };
    frontend.set_preprocess_budget(preprocess_bytes);
    tracing::info!(
        "The request path (bodies, fetched images, tokenization, image preprocessing) may hold {:.2} GiB of host \
         memory at once (--preprocess-memory-gib)",
        frontend.preprocess_budget.capacity() as f64 / GIB
    );
    let mut req = PlanRequest::new(served_model_names[0].clone(), runner.model_config().clone(), device);
    req.image_limits = frontend.settings.limits;
    a.vllm
        .apply(&mut req, &HeaderSettings::default())
        .map_err(|e| usage(e.to_string()))?;
    req.limit_mm_per_prompt = MmLimits { video: 0, ..limits };
    // Nothing else shares the CPU "device"; on a GPU, what the driver holds beyond our allocations.
    req.non_torch_bytes = Some(non_torch);
    req.kv_cache_memory_bytes = a.kv_cache_memory_bytes;
    let opts = EngineOptions {
        enable_prefix_caching: !a.no_enable_prefix_caching,
        long_prefill_token_threshold: a.long_prefill_token_threshold,
        max_num_partial_prefills: a.max_num_partial_prefills,
        vocab_size: frontend.tokenizer.vocab_size(),
    };
    let clock = Instant::now();
    let built = block_on(build_engine(runner, req, opts, &|| clock.elapsed().as_secs_f64()));
    let (mut engine, report) = match built {
        Ok(built) => built,
        Err(BuildError::Budget { error, log_lines }) => {
            for line in &log_lines {
                tracing::info!("{line}");
            }
            return Err(usage(error));
        }
        Err(e @ BuildError::Plan(_)) => return Err(usage(e.to_string())),
        Err(e) => return Err(e.into()),
    };
    report.size_input(&mut frontend);
    let p = report.plan;
    // The resolved settings as a command line, so `kvlens plan --from-log` can rebuild this budget.
    let mut log_lines = vec![format!(
        "kvlens serve {} --max-model-len {} --max-num-batched-tokens {} --max-num-seqs {} --block-size {} \
         --gpu-memory-utilization {} --cpu-memory-gib {:.6} --dtype {} --kv-cache-dtype {} \
         --limit-mm-per-prompt image={},video=0",
        model_dir.display(),
        p.max_model_len,
        p.max_num_batched_tokens,
        p.max_num_seqs,
        p.block_size,
        p.gpu_memory_utilization,
        total as f64 / GIB,
        weights_dtype.name(),
        caps.compute.name(),
        limits.image
    )];
    log_lines.extend(report.log_lines);
    for line in &log_lines {
        tracing::info!("{line}");
    }
    let profile = report.profile;
    // A test hook: `KVLENS_FAULT=decoder:3` makes the third decoder pass fail (see engine::fault).
    if let Some(plan) = std::env::var_os("KVLENS_FAULT") {
        let plan = plan.to_string_lossy().parse().map_err(usage)?;
        tracing::warn!("KVLENS_FAULT: {plan:?} will fail on purpose");
        engine.inject_fault(Some(plan));
    }
    Ok(Started {
        engine,
        frontend,
        served_model_names,
        model_dir,
        plan: p,
        profile,
        log_lines,
    })
}
