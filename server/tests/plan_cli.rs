//! `kvlens plan` end to end: the acceptance figures of the planner and its bad-input handling.

use std::process::{Command, Output};

fn kvlens(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvlens"))
        .args(args)
        .output()
        .expect("kvlens runs")
}

fn plan_json(args: &[&str]) -> serde_json::Value {
    let mut all = vec!["plan", "--json"];
    all.extend_from_slice(args);
    let out = kvlens(&all);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("one JSON object")
}

const ASCEND_8B: &[&str] = &[
    "--model",
    "Qwen3-VL-8B-Instruct",
    "--tensor-parallel-size",
    "2",
    "--block-size",
    "128",
    "--total-memory-gib",
    "60.96",
    "--gpu-memory-utilization",
    "0.95",
    "--weights-gib",
    "9.19",
    "--activation-peak-gib",
    "3.86",
    "--non-torch-gib",
    "0.56",
];

#[test]
fn qwen3_vl_8b_tp2_ascend_gives_645120_tokens() {
    let p = plan_json(ASCEND_8B);
    let gib = |k: &str| p[k].as_f64().unwrap() / (1u64 << 30) as f64;
    assert_eq!(format!("{:.2}", gib("available_kv_bytes")), "44.30");
    assert_eq!(p["kv_cache_tokens"], 645_120);
    assert_eq!(p["num_gpu_blocks"], 5_040);
    assert_eq!(p["fits"], true);
    for key in [
        "weights_bytes",
        "activation_peak_bytes",
        "non_torch_bytes",
        "requested_bytes",
        "available_kv_bytes",
        "num_gpu_blocks",
        "kv_cache_tokens",
        "max_concurrency",
        "encoder_budget_tokens",
        "encoder_profile_items",
        "max_tokens_per_image",
        "fits",
    ] {
        assert!(!p[key].is_null(), "missing {key}");
    }
    let table = kvlens(&[&["plan"], ASCEND_8B].concat());
    let text = String::from_utf8_lossy(&table.stdout);
    assert!(text.contains("Available KV cache memory: 44.30 GiB"), "{text}");
    assert!(text.contains("GPU KV cache size: 645,120 tokens"), "{text}");
    assert!(text.contains("Loading model weights took 9.1900 GiB"), "{text}");
}

#[test]
fn qwen3_vl_32b_at_262144_does_not_fit() {
    let args = [
        "--model",
        "Qwen3-VL-32B-Instruct",
        "--tensor-parallel-size",
        "2",
        "--block-size",
        "128",
        "--kv-cache-memory-gib",
        "20.06",
        "--max-model-len",
        "262144",
    ];
    let p = plan_json(&args);
    assert_eq!(p["fits"], false);
    assert_eq!(p["estimated_max_model_len"], 164_224);
    let err = p["error"].as_str().unwrap();
    assert!(
        err.contains("32.00 GiB KV cache is needed") && err.contains("164224"),
        "{err}"
    );
    let mut shorter = args.to_vec();
    shorter[9] = "160000";
    let p = plan_json(&shorter);
    assert_eq!(p["fits"], true);
    assert!(p["error"].is_null() && p["estimated_max_model_len"].is_null());
}

#[test]
fn encoder_budget_and_items() {
    let base = [
        "--model",
        "Qwen3-VL-8B-Instruct",
        "--limit-mm-per-prompt",
        "image=4,video=0",
    ];
    let p = plan_json(&[&base[..], &["--max-num-batched-tokens", "32768"]].concat());
    assert_eq!(
        (p["encoder_budget_tokens"].as_u64(), p["encoder_profile_items"].as_u64()),
        (Some(32_768), Some(2))
    );
    let p = plan_json(&[&base[..], &["--max-num-batched-tokens", "8192"]].concat());
    assert_eq!(
        (p["encoder_budget_tokens"].as_u64(), p["encoder_profile_items"].as_u64()),
        (Some(16_384), Some(1))
    );
    let p = plan_json(&[
        "--model",
        "Qwen3-VL-8B-Instruct",
        "--limit-mm-per-prompt",
        r#"{"image": 4, "video": 0}"#,
    ]);
    assert_eq!(p["max_tokens_per_image"], 16_384);
}

#[test]
fn qwen2_vl_2b_weights_and_a_checkpoint_directory() {
    let p = plan_json(&["--model", "Qwen2-VL-2B-Instruct", "--dtype", "bfloat16"]);
    assert_eq!(p["weights_bytes"], 2 * 2_208_985_600u64);
    // A directory is read from its config.json (and preprocessor_config.json when present).
    let dir = std::env::temp_dir().join(format!("kvlens-plan-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = include_str!("../../engine/configs/Qwen2-VL-2B-Instruct.json");
    std::fs::write(dir.join("config.json"), cfg).unwrap();
    std::fs::write(
        dir.join("preprocessor_config.json"),
        r#"{"min_pixels": 3136, "max_pixels": 1003520}"#,
    )
    .unwrap();
    let p = plan_json(&["--model", dir.to_str().unwrap()]);
    assert_eq!(p["weights_bytes"], 2 * 2_208_985_600u64);
    assert_eq!(p["max_tokens_per_image"], 1_280);
    std::fs::write(dir.join("config.json"), "{\"model_type\": \"qwen2_vl\"").unwrap();
    let out = kvlens(&["plan", "--model", dir.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("config.json"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_input_is_one_line_and_exit_code_2() {
    let cases: &[(&[&str], &str)] = &[
        (&["--model", "Qwen9-VL"], "Qwen3-VL-32B-Instruct"),
        (&["--gpu-memory-utilization", "0"], "(0, 1]"),
        (&["--gpu-memory-utilization", "1.01"], "(0, 1]"),
        (&["--weights-gib", "-1"], "non-negative"),
        (&["--total-memory-gib", "-80"], "non-negative"),
        (&["--tensor-parallel-size", "3"], "divisible"),
        (&["--limit-mm-per-prompt", "image"], "limit-mm-per-prompt"),
        (&["--limit-mm-per-prompt", "{\"image\": "], "limit-mm-per-prompt"),
        (&["--device", "tpu-v9"], "h100-80g"),
        (&["--kv-cache-dtype", "int3"], "kv-cache-dtype"),
    ];
    for (args, needle) in cases {
        let out = kvlens(&[&["plan"], *args].concat());
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        // The message is one line (clap adds a hint line after its own errors).
        let first = err.lines().next().unwrap_or_default();
        assert!(
            first.starts_with("error: ") && first.contains(needle),
            "{args:?}: {err}"
        );
    }
}

/// `--quantization` takes the weight formats the loader quantizes to: the 2B in q4_0 (its
/// matrices at 18 bytes per 32 weights, plus the deepstack buffers) fits a 4 GiB WebGPU laptop
/// that the bf16 weights leave no KV cache on; an unknown format is a usage error.
#[test]
fn quantization_shrinks_the_weights_to_the_formats_blocks() {
    let q4 = plan_json(&[
        "--model",
        "Qwen3-VL-2B-Instruct",
        "--device",
        "webgpu-4g",
        "--quantization",
        "q4_0",
    ]);
    assert_eq!(q4["quantization"], "q4_0");
    assert_eq!(
        q4["weights_bytes"].as_u64().unwrap() - q4["deepstack_buffer_bytes"].as_u64().unwrap(),
        1_203_101_696
    );
    assert_eq!(q4["estimated_max_model_len"], 6720);
    let bf16 = plan_json(&["--model", "Qwen3-VL-2B-Instruct", "--device", "webgpu-4g"]);
    assert_eq!(bf16["quantization"], "none");
    assert!(bf16["available_kv_bytes"].as_i64().unwrap() <= 0);
    let out = kvlens(&["plan", "--model", "Qwen3-VL-2B-Instruct", "-q", "awq"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--quantization: unknown format \"awq\""), "{err}");
}
