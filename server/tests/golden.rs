//! `kvlens generate` against Hugging Face transformers (float32, eager) on the same tiny random
//! checkpoints: the fixtures in engine/tests/fixtures/golden/ were written by tools/golden/golden.py
//! (`cargo xtask golden`); here the checkpoint is regenerated with `kvlens random-checkpoint` from
//! the recorded command (same seed → same bytes) and every case is replayed without Python.

mod common;

use kvlens_engine::golden::{self, Fixture, Generated, Tolerance, NO_MARGIN_CHECK};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../engine/tests/fixtures/golden")
}

fn kvlens() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvlens"))
}

/// Regenerates the fixture's checkpoint and checks it is byte-identical to the reference's.
fn checkpoint(fixture: &Value, dir: &Path) {
    let cmd = fixture["checkpoint"]["command"].as_str().expect("recorded command");
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let args: Vec<String> = cmd
        .split_whitespace()
        .skip(1)
        .map(|a| {
            if a == "DIR" {
                dir.display().to_string()
            } else {
                a.to_string()
            }
        })
        .collect();
    let out = kvlens()
        .args(&args)
        .current_dir(&root)
        .output()
        .expect("random-checkpoint runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let sha = sha256_hex(&bytes);
    assert_eq!(
        sha,
        fixture["checkpoint"]["model_safetensors_sha256"].as_str().unwrap(),
        "checkpoint bytes differ"
    );
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// How a family is run and how closely it must follow the reference.
struct Run {
    /// Extra `kvlens generate` arguments (the backend and its weights precision).
    args: &'static [&'static str],
    tol: Tolerance,
    /// Run from the GGUF pair `kvlens to-gguf --outtype` writes for the checkpoint (in a folder of
    /// its own: tokenizer, template and config from the files' metadata).
    gguf: Option<&'static str>,
}

/// The CPU backend (f32), the reference precision.
const CPU: Run = Run {
    args: &["--backend", "cpu"],
    tol: Tolerance::F32,
    gguf: None,
};

/// The wgpu backend with f32 weights: the same tolerances as the CPU.
const WGPU_F32: Run = Run {
    args: &["--backend", "wgpu"],
    tol: Tolerance::F32,
    gguf: None,
};

/// The wgpu backend with f16 weights: each weight rounded to 11 significant bits. Measured on
/// these checkpoints (the test prints it): largest log-probability difference 0.112 (Qwen2-VL),
/// 0.135 (Qwen2.5-VL), 0.021 (Qwen3-VL); tokens must agree where the reference's margin exceeds
/// twice the bound.
const WGPU_F16: Run = Run {
    args: &["--backend", "wgpu", "--dtype", "float16"],
    tol: Tolerance {
        logprob: 0.15,
        min_margin: 0.3,
        mean: 0.15,
        min_agreement: 0.0,
        min_pairs: 50,
    },
    gguf: None,
};

/// The CPU backend with bfloat16 weight matrices: each weight of these f32 checkpoints rounded to
/// 8 significant bits (a bfloat16 checkpoint would lose nothing: `generate_cli` checks that).
/// Measured here (the test prints it): top-1 agreement 43/45, 20/25, 55/56; reference top-5 tokens
/// found among ours 215, 111, 274; mean log-probability difference 0.055, 0.095, 0.027; largest
/// 0.47, 1.20, 0.12 (Qwen2-VL, Qwen2.5-VL, Qwen3-VL). Few
/// reference margins exceed the 2.4 such a difference could overturn, so tokens are held to the
/// agreement share, as for the quantized formats below.
const CPU_BF16: Run = Run {
    args: &["--backend", "cpu", "--dtype", "bfloat16"],
    tol: Tolerance {
        logprob: 1.5,
        min_margin: NO_MARGIN_CHECK,
        mean: 0.2,
        min_agreement: 0.7,
        min_pairs: 80,
    },
    gguf: None,
};

/// Quantized weights move the logits of these random checkpoints far more than of a trained
/// model: their large random weights amplify any perturbation layer after layer (f16 weights
/// already move a log-probability by 0.1), so tokens are not required to agree. Measured here
/// (docs/PERFORMANCE.md, CPU and wgpu): `q8_0` top-1 agreement 71–86 %, mean difference
/// 0.06–0.18, largest 1.35; `q4_0` leaves the reference at the first token (0/5), its few shared
/// top-5 tokens (0–3 per family) differing by 0.5–1.5. The bounds sit above those (`NO_MARGIN_CHECK`: tokens held to
/// the agreement share only); `PackedMatrix`'s own test bounds the kernels against f32.
///
/// The CPU backend with `q8_0` weight matrices (8.5 bits per weight).
const CPU_Q8_0: Run = Run {
    args: &["--backend", "cpu", "--quantization", "q8_0"],
    tol: Tolerance {
        logprob: 3.0,
        min_margin: NO_MARGIN_CHECK,
        mean: 0.3,
        min_agreement: 0.5,
        min_pairs: 30,
    },
    gguf: None,
};

/// The CPU backend with `q4_0` weight matrices (4.5 bits per weight).
const CPU_Q4_0: Run = Run {
    args: &["--backend", "cpu", "--quantization", "q4_0"],
    tol: Tolerance {
        logprob: 2.5,
        min_margin: NO_MARGIN_CHECK,
        mean: 2.0,
        min_agreement: 0.0,
        min_pairs: 0,
    },
    gguf: None,
};

/// The CPU backend on the GGUF pair of the f32 checkpoint (f32 text and projector): the same
/// numbers as the safetensors path, so the same bounds.
const GGUF_F32: Run = Run {
    gguf: Some("f32"),
    ..CPU
};

/// The CPU on the f16 pair: each matrix rounded to f16 as the converter rounds it, embedding and
/// output head included (norms, biases and the position table stay f32), and a decode's
/// activations rounded to f16 for those matrices, as llama.cpp rounds them. Measured here (the
/// test prints it): top-1 agreement 60/60, 58/59, 60/60; largest log-probability difference
/// 0.099, 0.202, 0.028, mean 0.008, 0.014, 0.004 (Qwen2-VL, Qwen2.5-VL, Qwen3-VL). Tokens must
/// agree where the reference's margin exceeds twice the bound.
const GGUF_F16: Run = Run {
    args: &["--backend", "cpu"],
    gguf: Some("f16"),
    tol: Tolerance {
        logprob: 0.3,
        min_margin: 0.6,
        mean: 0.05,
        min_agreement: 0.9,
        min_pairs: 250,
    },
};

/// The CPU on the bf16 pair, its matrices kept in bfloat16, held to the bounds of bfloat16 weight
/// matrices (measured: the same figures as `CPU_BF16`, the converter rounding as kvlens does).
const GGUF_BF16: Run = Run {
    gguf: Some("bf16"),
    ..CPU_BF16
};

/// The CPU on the q8_0 pair: GGML's blocks multiplied as stored, embedding and output head
/// included, as `--quantization q8_0` quantizes them; held to its bounds (measured: top-1
/// agreement 31/35, 18/22, 24/28; mean difference 0.16, 0.18, 0.06; largest 0.83, 1.51, 0.30).
const GGUF_Q8_0: Run = Run {
    args: &["--backend", "cpu"],
    gguf: Some("q8_0"),
    ..CPU_Q8_0
};

/// wgpu on the q8_0 pair: the file's blocks in the kernels' layout, held to `q8_0`'s bounds.
const GGUF_Q8_0_WGPU: Run = Run {
    args: &["--backend", "wgpu"],
    gguf: Some("q8_0"),
    ..CPU_Q8_0
};

/// The wgpu backend with `q8_0` weight matrices: the kernels multiply f32 activations by the
/// dequantized weights (the CPU quantizes the activations too), held to the CPU's `q8_0` bounds.
const WGPU_Q8_0: Run = Run {
    args: &["--backend", "wgpu", "--quantization", "q8_0"],
    ..CPU_Q8_0
};

/// The wgpu backend with `q4_0` weight matrices, held to the CPU's `q4_0` bounds.
const WGPU_Q4_0: Run = Run {
    args: &["--backend", "wgpu", "--quantization", "q4_0"],
    ..CPU_Q4_0
};

fn run_family(name: &str, run: &Run) {
    let text = std::fs::read_to_string(fixtures().join(format!("{name}.json"))).unwrap();
    let fixture: Value = serde_json::from_str(&text).unwrap();
    let tag = run.args.join("").replace("--", "-") + run.gguf.unwrap_or("");
    let tmp = std::env::temp_dir().join(format!("kvlens-golden-{name}{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let mut ckpt = tmp.join("ckpt");
    checkpoint(&fixture, &ckpt);
    let mut limits = Vec::new();
    if let Some(outtype) = run.gguf {
        let gguf = tmp.join("gguf");
        common::to_gguf(&ckpt, outtype, &gguf);
        std::fs::remove_dir_all(&ckpt).unwrap();
        ckpt = gguf;
        // GGUF files do not carry the image limits; the checkpoint's are given as vLLM takes them.
        let l = &fixture["checkpoint"]["image_limits"];
        limits = vec![
            "--mm-processor-kwargs".to_string(),
            format!("{{\"min_pixels\": {}, \"max_pixels\": {}}}", l[0], l[1]),
        ];
    }
    let mut generated = Vec::new();
    for case in fixture["cases"].as_array().unwrap() {
        let case_name = case["name"].as_str().unwrap();
        // Image paths in the fixture are relative to the fixtures directory.
        let mut messages = case["messages"].clone();
        for m in messages.as_array_mut().unwrap() {
            if let Some(parts) = m["content"].as_array_mut() {
                for p in parts {
                    if let Some(url) = p.pointer_mut("/image_url/url") {
                        *url = Value::from(fixtures().join(url.as_str().unwrap()).display().to_string());
                    }
                }
            }
        }
        let mpath = tmp.join(format!("{case_name}.json"));
        std::fs::write(&mpath, messages.to_string()).unwrap();
        let max_tokens = case["token_ids"].as_array().unwrap().len();
        let out = kvlens()
            .args([
                "generate",
                "--model",
                ckpt.to_str().unwrap(),
                "--messages",
                mpath.to_str().unwrap(),
            ])
            .args(run.args)
            .args(&limits)
            .args([
                "--max-tokens",
                &max_tokens.to_string(),
                "--ignore-eos",
                "--logprobs",
                "5",
                "--json",
            ])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{name}/{case_name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let got: Value = serde_json::from_slice(&out.stdout).unwrap();
        let ids = |v: &Value| -> Vec<u32> {
            v.as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap() as u32)
                .collect()
        };
        generated.push(Generated {
            prompt_token_ids: ids(&got["prompt_token_ids"]),
            image_grid_thw: serde_json::from_value(got["image_grid_thw"].clone()).unwrap(),
            token_ids: ids(&got["token_ids"]),
            top_logprobs: serde_json::from_value(got["top_logprobs"].clone()).unwrap(),
        });
    }
    let label = format!(
        "kvlens generate {} {}",
        run.args.join(" "),
        run.gguf.map_or(String::new(), |t| format!("(GGUF {t})"))
    );
    golden::compare(&Fixture::parse(name, &text), &generated, &run.tol, &label);
    std::fs::remove_dir_all(&tmp).unwrap();
}

#[test]
fn qwen2_vl_matches_transformers() {
    run_family("qwen2_vl", &CPU);
}

#[test]
fn qwen2_5_vl_matches_transformers() {
    run_family("qwen2_5_vl", &CPU);
}

#[test]
fn qwen3_vl_matches_transformers() {
    run_family("qwen3_vl", &CPU);
}

#[test]
fn qwen2_vl_on_wgpu_matches_transformers() {
    run_family("qwen2_vl", &WGPU_F32);
}

#[test]
fn qwen2_5_vl_on_wgpu_matches_transformers() {
    run_family("qwen2_5_vl", &WGPU_F32);
}

#[test]
fn qwen3_vl_on_wgpu_matches_transformers() {
    run_family("qwen3_vl", &WGPU_F32);
}

#[test]
fn qwen2_vl_on_wgpu_f16_matches_transformers_where_margins_allow() {
    run_family("qwen2_vl", &WGPU_F16);
}

#[test]
fn qwen2_5_vl_on_wgpu_f16_matches_transformers_where_margins_allow() {
    run_family("qwen2_5_vl", &WGPU_F16);
}

#[test]
fn qwen3_vl_on_wgpu_f16_matches_transformers_where_margins_allow() {
    run_family("qwen3_vl", &WGPU_F16);
}

#[test]
fn qwen2_vl_with_q8_0_weights_stays_within_the_stated_bounds() {
    run_family("qwen2_vl", &CPU_Q8_0);
}

#[test]
fn qwen2_5_vl_with_q8_0_weights_stays_within_the_stated_bounds() {
    run_family("qwen2_5_vl", &CPU_Q8_0);
}

#[test]
fn qwen3_vl_with_q8_0_weights_stays_within_the_stated_bounds() {
    run_family("qwen3_vl", &CPU_Q8_0);
}

#[test]
fn qwen2_vl_with_q4_0_weights_stays_within_the_stated_bounds() {
    run_family("qwen2_vl", &CPU_Q4_0);
}

#[test]
fn qwen2_5_vl_with_q4_0_weights_stays_within_the_stated_bounds() {
    run_family("qwen2_5_vl", &CPU_Q4_0);
}

#[test]
fn qwen3_vl_with_q4_0_weights_stays_within_the_stated_bounds() {
    run_family("qwen3_vl", &CPU_Q4_0);
}

#[test]
fn qwen2_vl_with_bf16_weights_stays_within_the_stated_bounds() {
    run_family("qwen2_vl", &CPU_BF16);
}

#[test]
fn qwen2_5_vl_with_bf16_weights_stays_within_the_stated_bounds() {
    run_family("qwen2_5_vl", &CPU_BF16);
}

#[test]
fn qwen3_vl_with_bf16_weights_stays_within_the_stated_bounds() {
    run_family("qwen3_vl", &CPU_BF16);
}

#[test]
fn qwen2_vl_on_wgpu_with_q8_0_weights_stays_within_the_stated_bounds() {
    run_family("qwen2_vl", &WGPU_Q8_0);
}

#[test]
fn qwen2_5_vl_on_wgpu_with_q8_0_weights_stays_within_the_stated_bounds() {
    run_family("qwen2_5_vl", &WGPU_Q8_0);
}

#[test]
fn qwen3_vl_on_wgpu_with_q8_0_weights_stays_within_the_stated_bounds() {
    run_family("qwen3_vl", &WGPU_Q8_0);
}

#[test]
fn qwen2_vl_on_wgpu_with_q4_0_weights_stays_within_the_stated_bounds() {
    run_family("qwen2_vl", &WGPU_Q4_0);
}

#[test]
fn qwen2_5_vl_on_wgpu_with_q4_0_weights_stays_within_the_stated_bounds() {
    run_family("qwen2_5_vl", &WGPU_Q4_0);
}

#[test]
fn qwen3_vl_on_wgpu_with_q4_0_weights_stays_within_the_stated_bounds() {
    run_family("qwen3_vl", &WGPU_Q4_0);
}

#[test]
fn gguf_f32_pairs_match_transformers_as_safetensors_do() {
    for family in ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"] {
        run_family(family, &GGUF_F32);
    }
}

#[test]
fn gguf_f16_bf16_and_q8_0_pairs_stay_within_their_formats_bounds() {
    for family in ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"] {
        for run in [&GGUF_F16, &GGUF_BF16, &GGUF_Q8_0] {
            run_family(family, run);
        }
    }
}

/// One family on wgpu (lavapipe in CI is slow): the q8_0 pair's blocks in the kernels' layout.
#[test]
fn a_gguf_q8_0_pair_runs_on_wgpu() {
    run_family("qwen2_5_vl", &GGUF_Q8_0_WGPU);
}
