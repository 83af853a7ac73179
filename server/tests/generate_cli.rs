//! `kvlens generate` end to end on a tiny random checkpoint: cache reuse on a warm engine and every
//! kind of bad input (one-line error, exit code 2, no panic).

mod common;

use common::{fixture, kvlens, root, scratch, tiny_checkpoint, tiny_checkpoint_in, tiny_checkpoint_with};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::OnceLock;

/// A tiny Qwen3-VL checkpoint shared by the tests of this file.
fn checkpoint() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| tiny_checkpoint("generate-cli"))
}

/// A copy of the checkpoint with one file replaced (or removed with `None`).
fn altered(name: &str, file: &str, contents: Option<Vec<u8>>) -> PathBuf {
    let dir = scratch(&format!("generate-cli-{name}"));
    std::fs::create_dir_all(&dir).unwrap();
    for entry in std::fs::read_dir(checkpoint()).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.join(entry.file_name())).unwrap();
    }
    match contents {
        Some(c) => std::fs::write(dir.join(file), c).unwrap(),
        None => std::fs::remove_file(dir.join(file)).unwrap(),
    }
    dir
}

fn generate(model: &Path, extra: &[&str]) -> Output {
    let mut args = vec![
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--max-tokens",
        "4",
        "--json",
    ];
    args.extend_from_slice(extra);
    kvlens(&args)
}

fn assert_usage_error(out: &Output, needle: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    let last = err.trim_end().lines().last().unwrap_or_default();
    assert!(
        last.starts_with("error: ") && last.contains(needle),
        "expected {needle:?} in: {err}"
    );
}

#[test]
fn a_warm_engine_reuses_prefix_and_encoder_caches() {
    let image = fixture("golden/images/c_150x150.png");
    let args = [
        "--prompt",
        "What is in this picture?",
        "--image",
        &image,
        "--ignore-eos",
        "--repeat",
        "2",
    ];
    let parse = |out: &Output| -> Vec<Value> {
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    // Prefix caching on: the second run computes only the tail of the prompt and no image.
    let runs = parse(&generate(checkpoint(), &args));
    assert_eq!(runs.len(), 2);
    assert_eq!(runs[0]["token_ids"], runs[1]["token_ids"]);
    let prompt_len = runs[0]["prompt_token_ids"].as_array().unwrap().len() as u64;
    let (first, second) = (&runs[0]["counters"], &runs[1]["counters"]);
    assert_eq!(first["vision_runs"], 1);
    assert_eq!(first["prompt_tokens_computed"].as_u64(), Some(prompt_len));
    assert_eq!(second["vision_runs"], 0);
    assert!(second["prompt_tokens_cached"].as_u64().unwrap() > 0);
    assert!(second["prompt_tokens_computed"].as_u64().unwrap() < prompt_len);
    // Prefix caching off: the whole prompt is recomputed, but the image comes from the encoder cache.
    let mut no_prefix = args.to_vec();
    no_prefix.push("--no-enable-prefix-caching");
    let runs = parse(&generate(checkpoint(), &no_prefix));
    assert_eq!(runs[0]["token_ids"], runs[1]["token_ids"]);
    assert_eq!(runs[1]["counters"]["prompt_tokens_computed"].as_u64(), Some(prompt_len));
    assert_eq!(runs[1]["counters"]["vision_runs"], 0);
    assert_eq!(runs[1]["counters"]["encoder_hits"], 1);
}

/// `generate --json` of 4 greedy tokens about the fixture's picture, with the top 3
/// log-probabilities of each step and `extra` arguments.
fn describe_the_picture(ckpt: &Path, extra: &[&str]) -> Value {
    let image = fixture("golden/images/c_150x150.png");
    let mut args = vec![
        "--prompt",
        "Describe the picture.",
        "--image",
        &image,
        "--ignore-eos",
        "--logprobs",
        "3",
    ];
    args.extend(extra);
    let out = generate(ckpt, &args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// A bfloat16 checkpoint kept in bfloat16 on the CPU gives the tokens widening it to f32 gives, in
/// half the bytes. Decode's products widen the weights exactly; prefill's, on CPUs with AVX-512
/// BF16, round the activations to bfloat16 as a bfloat16 model does, which moved a
/// log-probability of this checkpoint by 0.021 (without that instruction set, by under 1e-3).
#[test]
fn bf16_matrices_on_the_cpu_give_the_f32_path_s_tokens_in_half_the_bytes() {
    let ckpt = tiny_checkpoint_in("generate-cli-bf16", "bf16");
    let run = |dtype: &str| describe_the_picture(&ckpt, &["--dtype", dtype]);
    let (wide, kept) = (run("float32"), run("bfloat16"));
    assert_eq!(wide["token_ids"], kept["token_ids"]);
    assert_eq!(wide["token_ids"].as_array().unwrap().len(), 4);
    let (a, b) = (top_logprobs(&wide), top_logprobs(&kept));
    assert_eq!(a.len(), 4 * 3);
    let worst = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
    assert!(worst < 0.05, "largest log-probability difference {worst}");
    let bytes = |v: &Value| v["weights"]["bytes"].as_u64().unwrap();
    let (wide_bytes, kept_bytes) = (bytes(&wide), bytes(&kept));
    assert!(
        kept_bytes * 10 < wide_bytes * 6 && kept_bytes * 2 > wide_bytes,
        "bf16 {kept_bytes} vs f32 {wide_bytes}"
    );
    assert_eq!(kept["weights"]["dtype"], "bfloat16");
    // A decode step also reads the keys and values of its context: f32 on the CPU, on average
    // the prompt and half of the 3 tokens decoded after the first.
    let config: Value = serde_json::from_slice(&std::fs::read(ckpt.join("config.json")).unwrap()).unwrap();
    let t = &config["text_config"];
    let dim = |k: &str| t[k].as_u64().unwrap();
    let per_position = 2 * dim("num_hidden_layers") * dim("num_key_value_heads") * dim("head_dim") * 4;
    let prompt = kept["prompt_token_ids"].as_array().unwrap().len() as u64;
    assert_eq!(
        kept["weights"]["decode_kv_read_bytes_per_token"].as_u64(),
        Some(per_position * (prompt + 2))
    );
}

/// The log-probabilities of a `--json --logprobs` run, step after step.
fn top_logprobs(v: &Value) -> Vec<f64> {
    let steps = v["top_logprobs"].as_array().unwrap();
    steps
        .iter()
        .flat_map(|s| s.as_array().unwrap().iter().map(|p| p[1].as_f64().unwrap()))
        .collect()
}

/// Matrices holding values that `q8_0` / `q4_0` store exactly (`random-checkpoint --exact-in`)
/// lose nothing when quantized on load: on wgpu, whose kernels multiply f32 activations by the
/// dequantized weights, the quantized checkpoint gives the f32 path's tokens and log-probabilities
/// (within f32 rounding, as wgpu's f32 path does) from a fraction of the bytes. This checks the
/// quantization, the device layout and every kernel that reads it end to end. The CPU's products
/// also round the activations (to q8 in decode, to bfloat16 in prefill on AVX-512 BF16 CPUs):
/// its log-probabilities stay within 0.3 while its tokens agree (0.08 / 0.13 measured over 8
/// tokens, all agreeing), far closer than on the golden fixtures, whose weights the formats round.
#[test]
fn weights_exact_in_a_block_format_lose_nothing_when_quantized_on_load() {
    for format in ["q8_0", "q4_0"] {
        let ckpt = tiny_checkpoint_with(
            &format!("generate-cli-exact-{format}"),
            &["--dtype", "f32", "--exact-in", format],
        );
        let run = |backend: &[&str]| describe_the_picture(&ckpt, backend);
        let reference = run(&["--backend", "cpu"]);
        let quantized = run(&["--backend", "wgpu", "--quantization", format]);
        assert_eq!(reference["token_ids"], quantized["token_ids"], "{format}");
        let (a, b) = (top_logprobs(&reference), top_logprobs(&quantized));
        assert_eq!(a.len(), 4 * 3);
        let worst = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
        assert!(worst < 1e-3, "{format}: largest log-probability difference {worst}");
        assert_eq!(quantized["weights"]["quantization"], format);
        let cpu = run(&["--backend", "cpu", "--quantization", format]);
        let agreeing = reference["token_ids"]
            .as_array()
            .unwrap()
            .iter()
            .zip(cpu["token_ids"].as_array().unwrap())
            .take_while(|(x, y)| x == y)
            .count();
        let c = top_logprobs(&cpu);
        let worst = a
            .iter()
            .zip(&c)
            .take(3 * (agreeing + 1).min(4))
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f64::max);
        assert!(
            worst < 0.3,
            "{format} on the CPU: largest log-probability difference {worst}"
        );
        let bytes = |v: &Value| v["weights"]["bytes"].as_u64().unwrap();
        assert!(
            bytes(&quantized) * 3 < bytes(&reference),
            "{format}: {} vs f32 {}",
            bytes(&quantized),
            bytes(&reference)
        );
    }
    let refused = kvlens(&[
        "random-checkpoint",
        "--config",
        "demo",
        "--dry-run",
        "--exact-in",
        "q4_0",
    ]);
    assert_usage_error(&refused, "exact only in f32 (--dtype f32)");
}

#[test]
fn the_cpu_device_takes_its_size_from_cpu_memory_gib() {
    assert_usage_error(
        &generate(checkpoint(), &["--prompt", "hi", "--cpu-memory-gib", "0"]),
        "--cpu-memory-gib must be positive",
    );
    // A few MiB hold the tiny model's weights but not its KV cache (the default, 40% of the
    // machine's RAM, holds both).
    assert_usage_error(
        &generate(checkpoint(), &["--prompt", "hi", "--cpu-memory-gib", "0.002"]),
        "memory",
    );
    assert!(generate(checkpoint(), &["--prompt", "hi", "--cpu-memory-gib", "1"])
        .status
        .success());
}

#[test]
fn a_backend_that_cannot_run_here_and_tensor_parallelism_are_one_line_errors() {
    // Without `--features cuda` the build says it has no CUDA backend; with it, a machine without
    // an NVIDIA driver says what is missing. Neither panics.
    let out = generate(checkpoint(), &["--prompt", "hi", "--backend", "cuda"]);
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(!err.contains("panicked"), "{err}");
        assert!(err.contains("cuda") || err.contains("CUDA"), "{err}");
    }
    let serve = kvlens(&[
        "serve",
        "--model",
        checkpoint().to_str().unwrap(),
        "-tp",
        "2",
        "--port",
        "0",
    ]);
    assert_usage_error(&serve, "kvlens runs a model on one device");
}

#[test]
fn bad_checkpoints_are_one_line_errors() {
    let empty = scratch("generate-cli-empty");
    std::fs::create_dir_all(&empty).unwrap();
    assert_usage_error(&generate(&empty, &["--prompt", "hi"]), "no config.json");

    let config = std::fs::read_to_string(checkpoint().join("config.json")).unwrap();
    let llama = altered(
        "llama",
        "config.json",
        Some(config.replace("\"qwen3_vl\"", "\"llama\"").into_bytes()),
    );
    assert_usage_error(&generate(&llama, &["--prompt", "hi"]), "is not a Qwen-VL model");

    let weights = std::fs::read(checkpoint().join("model.safetensors")).unwrap();
    let cut = altered(
        "truncated",
        "model.safetensors",
        Some(weights[..weights.len() / 2].to_vec()),
    );
    assert_usage_error(&generate(&cut, &["--prompt", "hi"]), "not a valid safetensors file");

    let wider = config.replacen("\"intermediate_size\": 37", "\"intermediate_size\": 38", 1);
    assert_ne!(wider, config, "the tiny config names intermediate_size 37");
    let shape = altered("shape", "config.json", Some(wider.into_bytes()));
    assert_usage_error(&generate(&shape, &["--prompt", "hi"]), "the config implies");
}

#[test]
fn bad_images_and_prompts_are_one_line_errors() {
    let ckpt = checkpoint();
    let text_file = root().join("README.md");
    let text_file = text_file.to_str().unwrap();
    assert_usage_error(
        &generate(ckpt, &["--prompt", "hi", "--image", text_file]),
        "not a PNG, JPEG, WebP, GIF, BMP or TIFF file",
    );
    let empty = scratch("generate-cli-empty.png");
    std::fs::write(&empty, b"").unwrap();
    assert_usage_error(
        &generate(ckpt, &["--prompt", "hi", "--image", empty.to_str().unwrap()]),
        "empty",
    );
    let huge = fixture("input/header_30000x30000.png");
    assert_usage_error(&generate(ckpt, &["--prompt", "hi", "--image", &huge]), "30000x30000");
    let thin = fixture("input/aspect_300x1.png");
    assert_usage_error(&generate(ckpt, &["--prompt", "hi", "--image", &thin]), "aspect ratio");
    assert_usage_error(
        &generate(ckpt, &["--prompt", "hi", "--image", "/nonexistent.png"]),
        "cannot read image",
    );
    // The tiny config allows 4096 positions.
    let long = "word ".repeat(5000);
    assert_usage_error(&generate(ckpt, &["--prompt", &long]), "maximum context length");
    assert_usage_error(
        &generate(ckpt, &["--prompt", "hi", "--temperature", "-1"]),
        "temperature",
    );
}
