//! `kvlens generate`: one conversation through the engine on the CPU, streamed or as JSON.

use crate::checkpoint::{Checkpoint, WeightFiles};
use crate::runtime::{device_of, load, Cancel, Frontend};
use crate::UsageError;
use anyhow::Result;
use kvlens_engine::arch::config::DType;
use kvlens_engine::arch::config::{ImageLimits, ProcessorKwargs};
use kvlens_engine::arch::weight_format::WeightFormat;
use kvlens_engine::backend::{block_on, BackendKind};
use kvlens_engine::builder::{build_engine, BackendChoice, EngineOptions};
use kvlens_engine::engine::{Engine, FinishReason};
use kvlens_engine::input::chat::{ChatMessage, Content, ContentPart, ImageUrl};
use kvlens_engine::input::tokenizer::IncrementalDecoder;
use kvlens_engine::memory::ledger::Category;
use kvlens_engine::memory::planner::{MmLimits, PlanRequest};
use kvlens_engine::memory::weights::{weight_bytes_per_rank, Part};
use kvlens_engine::sample::SamplingParams;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Flags of `kvlens generate`.
#[derive(Debug, clap::Args)]
#[command(allow_negative_numbers = true)]
pub struct GenerateArgs {
    /// Checkpoint: a Hugging Face directory, a GGUF text model (with --mmproj), or a directory
    /// holding one text GGUF and one mmproj-*.gguf.
    #[arg(long)]
    pub model: PathBuf,
    /// The projector (mmproj-*.gguf) of a GGUF --model file, as llama.cpp's --mmproj.
    #[arg(long)]
    pub mmproj: Option<PathBuf>,
    /// The user message.
    #[arg(long, conflicts_with = "messages", required_unless_present = "messages")]
    pub prompt: Option<String>,
    /// An image for the user message (repeatable).
    #[arg(long)]
    pub image: Vec<PathBuf>,
    /// A JSON file with an OpenAI `messages` array.
    #[arg(long)]
    pub messages: Option<PathBuf>,
    #[arg(long, default_value_t = 64)]
    pub max_tokens: usize,
    /// 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    #[arg(long, default_value_t = 0)]
    pub top_k: i32,
    #[arg(long)]
    pub seed: Option<u64>,
    #[arg(long)]
    pub ignore_eos: bool,
    /// Report the top-K log-probabilities of each generated token.
    #[arg(long)]
    pub logprobs: Option<usize>,
    /// Compute backend: cpu, wgpu or cuda (those this build holds).
    #[arg(long, default_value = "cpu")]
    pub backend: BackendKind,
    /// Weights precision: float32, or half precision for 2-D weights (wgpu: float16; cuda and cpu:
    /// bfloat16, whichever half type is named); activations and the KV cache stay float32.
    #[arg(long, default_value = "float32", value_parser = ["float32", "float16", "bfloat16"])]
    pub dtype: String,
    /// Weight matrices quantized on load (cpu backend): q8_0 or q4_0, GGML's block formats.
    #[arg(long, short = 'q', default_value = "none")]
    pub quantization: WeightFormat,
    /// Print one JSON object (per run).
    #[arg(long)]
    pub json: bool,
    /// Run the conversation this many times on one engine: later runs reuse the prefix cache and the
    /// encoder cache, and `--json` adds each run's work counters.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub repeat: u32,
    /// Turn off prefix caching (as vLLM's flag), so repeats show encoder-cache hits alone.
    #[arg(long)]
    pub no_enable_prefix_caching: bool,
    /// Memory of the CPU "device" in GiB, for the cpu and wgpu backends, as `kvlens serve`
    /// takes it [default: 40% of the machine's RAM]: a 2B model in float32 needs about 10.
    #[arg(long)]
    pub cpu_memory_gib: Option<f64>,
    /// Image processor overrides as JSON, as `kvlens serve` and vLLM take them, e.g.
    /// '{"min_pixels": 3136, "max_pixels": 1003520}'.
    #[arg(long)]
    pub mm_processor_kwargs: Option<String>,
}

/// What one run produced.
#[derive(Debug, Default)]
struct Run {
    tokens: Vec<u32>,
    top: Vec<Vec<serde_json::Value>>,
    finish: Option<FinishReason>,
    first_token_s: Option<f64>,
    total_s: f64,
    /// Host seconds spent recording the decode steps (scheduling, encoding, queueing every
    /// kernel), before each waits for its read.
    decode_record_s: f64,
}

fn messages(a: &GenerateArgs) -> Result<Vec<ChatMessage>> {
    if let Some(path) = &a.messages {
        let text =
            std::fs::read_to_string(path).map_err(|e| UsageError(format!("cannot read {}: {e}", path.display())))?;
        return ChatMessage::parse_list(&text).map_err(|e| UsageError(format!("{}: {e}", path.display())).into());
    }
    let mut parts: Vec<ContentPart> = a
        .image
        .iter()
        .map(|p| ContentPart::ImageUrl {
            image_url: ImageUrl {
                url: p.display().to_string(),
            },
        })
        .collect();
    parts.push(ContentPart::Text {
        text: a.prompt.clone().unwrap_or_default(),
    });
    Ok(vec![ChatMessage {
        role: "user".into(),
        content: Content::Parts(parts),
    }])
}

/// Runs `kvlens generate`.
pub fn run(a: &GenerateArgs) -> Result<()> {
    let msgs = messages(a)?;
    let choice = BackendChoice::new(a.backend, DType::parse(&a.dtype), a.quantization).map_err(UsageError)?;
    let (runner, mut front) = load(&a.model, a.mmproj.as_deref(), choice.clone())?;
    if let Some(json) = &a.mm_processor_kwargs {
        let kwargs = ProcessorKwargs::parse(json).map_err(|e| UsageError(e.to_string()))?;
        front.settings.limits = kwargs
            .apply(front.settings.limits)
            .map_err(|e| UsageError(e.to_string()))?;
    }
    let params = SamplingParams {
        temperature: a.temperature,
        top_p: a.top_p,
        top_k: a.top_k,
        seed: a.seed,
        max_tokens: a.max_tokens,
        ignore_eos: a.ignore_eos,
        logprobs: a.logprobs,
        ..SamplingParams::default()
    };
    params.validate().map_err(UsageError)?;
    let (req, grids) = front.request("generate-0", &msgs, params, true, &Cancel::default())?;
    let template = req.clone();
    let prompt_ids = req.prompt.clone();
    // Sized by the server's start-up code, for this one conversation: one sequence, the whole
    // prompt in one step, its images as the largest the profile runs.
    let cfg = runner.model_config().clone();
    // What one decode step reads: the decoder and the output head (the embedding when tied), as
    // a GGUF file stores them where the CPU keeps them so, else at the bytes per unquantized value
    // the backend keeps (half precision with --dtype).
    let elem_bytes = choice.weights_dtype().size_bytes();
    let as_stored = a.backend == BackendKind::Cpu && a.quantization == WeightFormat::Unquantized;
    let bf16_widened = elem_bytes == 4;
    let stored = as_stored
        .then(|| gguf_decode_read_bytes(&a.model, a.mmproj.as_deref(), bf16_widened))
        .flatten();
    let decode_read_bytes: u64 = match stored {
        Some(bytes) => bytes,
        None => weight_bytes_per_rank(&cfg, 1, elem_bytes, a.quantization)
            .iter()
            .filter(|(part, _)| match part {
                Part::Text | Part::LmHead => true,
                Part::Embedding => cfg.tie_word_embeddings,
                Part::Vision => false,
            })
            .map(|(_, b)| b)
            .sum(),
    };
    let (device, non_torch) = device_of(&*runner, a.cpu_memory_gib)?;
    let mut plan_req = PlanRequest::new("generate", cfg.clone(), device);
    let patch = cfg.vision.as_ref().map_or(1, |v| v.patch_size) as u64;
    let largest = grids.iter().map(|g| u64::from(g[1] * g[2]) * patch * patch).max();
    plan_req.image_limits = ImageLimits {
        min_pixels: front.settings.limits.min_pixels.min(largest.unwrap_or(u64::MAX)),
        max_pixels: largest.unwrap_or(front.settings.limits.max_pixels),
    };
    plan_req.limit_mm_per_prompt = MmLimits {
        image: grids.len(),
        video: 0,
    };
    plan_req.max_model_len = Some((req.prompt.len() + a.max_tokens).min(cfg.text.max_position_embeddings));
    plan_req.max_num_batched_tokens = Some(req.prompt.len().max(1));
    plan_req.max_num_seqs = Some(1);
    plan_req.non_torch_bytes = Some(non_torch);
    let opts = EngineOptions {
        enable_prefix_caching: !a.no_enable_prefix_caching,
        long_prefill_token_threshold: 0,
        max_num_partial_prefills: 1,
        vocab_size: front.tokenizer.vocab_size(),
    };
    let clock = Instant::now();
    let (mut engine, _) = block_on(build_engine(runner, plan_req, opts, &|| clock.elapsed().as_secs_f64()))
        .map_err(|e| UsageError(e.to_string()))?;
    drop(req);
    for k in 0..a.repeat {
        let before = engine.counters();
        let mut req = template.clone();
        req.id = format!("generate-{k}").into();
        engine.add_request(req).map_err(|e| UsageError(e.to_string()))?;
        let run = run_once(&mut engine, &front, a.json)?;
        let after = engine.counters();
        if a.json {
            let text = front.tokenizer.decode(&run.tokens, true)?;
            let mut obj = serde_json::json!({
                "prompt_token_ids": prompt_ids,
                "token_ids": run.tokens,
                "text": text,
                "image_grid_thw": grids,
                "finish_reason": run.finish.unwrap_or(FinishReason::Length),
                // The tokenizer's vocabulary (the sampler's limit): what running the ids elsewhere needs.
                "vocab_size": front.tokenizer.vocab_size(),
            });
            if a.logprobs.is_some() {
                obj["top_logprobs"] = serde_json::json!(run.top);
            }
            let (prefill, decode, decode_tokens) = run.phases();
            obj["timing"] = serde_json::json!({
                "prefill_s": prefill,
                "decode_s": decode,
                "prefill_tokens_per_s": prompt_ids.len() as f64 / prefill.max(1e-9),
                "decode_tokens_per_s": decode_tokens as f64 / decode.max(1e-9),
                // Near 1: the decode steps are bound by the host's recording of them (launches,
                // allocations, metadata), not by the device.
                "decode_record_share": run.decode_record_s / decode.max(1e-9),
            });
            if a.backend == BackendKind::Cpu {
                obj["timing"]["cpu_kernels"] = kvlens_engine::backend::cpu::kernel_paths().into();
            }
            #[cfg(feature = "cuda")]
            if a.backend == BackendKind::Cuda && kvlens_engine::backend::cuda::profile_requested() {
                obj["timing"]["cuda_kernels"] = kvlens_engine::backend::cuda::kernel_profile();
            }
            // Each decode step also reads its sequence's keys and values: on average the prompt
            // and half the generated tokens, at the bytes per position the cache was sized with.
            let kv = engine.kv();
            let slots = (kv.num_blocks() * kv.block_size()).max(1) as u64;
            let kv_per_position = engine.ledger().bytes(Category::KvCache) / slots;
            let mean_context = prompt_ids.len() as u64 + (decode_tokens as u64).div_ceil(2);
            obj["weights"] = serde_json::json!({
                "dtype": a.dtype,
                "quantization": a.quantization,
                "bytes": engine.ledger().bytes(Category::Weights),
                "decode_read_bytes_per_token": decode_read_bytes,
                "decode_kv_read_bytes_per_token": kv_per_position * mean_context,
            });
            if a.repeat > 1 {
                obj["counters"] = serde_json::json!({
                    "vision_runs": after.vision_runs - before.vision_runs,
                    "encoder_hits": after.encoder_hits - before.encoder_hits,
                    "prefix_cached_images": after.prefix_cached_images - before.prefix_cached_images,
                    "prompt_tokens_computed": after.prompt_tokens_computed - before.prompt_tokens_computed,
                    "prompt_tokens_cached": after.prompt_tokens_cached - before.prompt_tokens_cached,
                });
            }
            println!("{obj}");
        } else {
            let (prefill, decode, decode_tokens) = run.phases();
            eprintln!(
                "prefill: {} tokens in {prefill:.3} s ({:.1} tokens/s); decode: {decode_tokens} tokens in {decode:.3} s ({:.1} tokens/s)",
                prompt_ids.len(),
                prompt_ids.len() as f64 / prefill.max(1e-9),
                decode_tokens as f64 / decode.max(1e-9)
            );
        }
    }
    Ok(())
}

/// [`GgufModel::decode_read_bytes`](kvlens_engine::arch::gguf_model::GgufModel::decode_read_bytes)
/// of a GGUF model, None for a Hugging Face checkpoint.
fn gguf_decode_read_bytes(model: &Path, mmproj: Option<&Path>, bf16_widened: bool) -> Option<u64> {
    let ckpt = Checkpoint::open(model, mmproj).ok()?;
    match &ckpt.weights {
        WeightFiles::Gguf(pair) => Some(pair.model().ok()?.decode_read_bytes(bf16_widened)),
        _ => None,
    }
}

impl Run {
    /// (prefill seconds up to the first token, decode seconds after it, decoded tokens).
    fn phases(&self) -> (f64, f64, usize) {
        let prefill = self.first_token_s.unwrap_or(self.total_s);
        (prefill, self.total_s - prefill, self.tokens.len().saturating_sub(1))
    }
}

/// Steps the engine until its one request finishes, streaming text unless `quiet`.
fn run_once(engine: &mut Engine, front: &Frontend, quiet: bool) -> Result<Run> {
    let started = Instant::now();
    let mut run = Run::default();
    let mut decoder = IncrementalDecoder::new(true);
    let mut out = std::io::stdout();
    while engine.has_unfinished() {
        let recording = Instant::now();
        let Some(launched) = engine.launch()? else { continue };
        if run.first_token_s.is_some() {
            run.decode_record_s += recording.elapsed().as_secs_f64();
        }
        let (meta, read) = launched.into_parts();
        let values = read.map(block_on).transpose();
        for e in engine.complete(meta, values)? {
            run.first_token_s.get_or_insert_with(|| started.elapsed().as_secs_f64());
            run.tokens.push(e.token);
            run.top
                .push(e.top_logprobs.iter().map(|&(t, l)| serde_json::json!([t, l])).collect());
            if !quiet {
                if let Some(piece) = decoder.step(&front.tokenizer, e.token)? {
                    print!("{piece}");
                    out.flush()?;
                }
            }
            if e.finish.is_some() {
                run.finish = e.finish;
            }
        }
    }
    if !quiet {
        if let Some(rest) = decoder.finish(&front.tokenizer)? {
            print!("{rest}");
        }
        println!();
    }
    run.total_s = started.elapsed().as_secs_f64();
    Ok(run)
}
