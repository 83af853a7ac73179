//! The golden fixtures (`engine/tests/fixtures/golden/`, written by `tools/golden/golden.py` from
//! Hugging Face transformers in float32 on tiny random checkpoints) and the one comparison every
//! run of them uses: the engine's own suite on each backend ([`golden_suite!`](crate::golden_suite))
//! and `kvlens generate` in `server/tests/golden.rs`. Test helpers (feature `testing`).

use serde_json::Value;

/// How closely a run must follow the reference.
#[derive(Debug, Clone, Copy)]
pub struct Tolerance {
    /// Largest allowed difference of a top log-probability from the reference's.
    pub logprob: f64,
    /// Reference margins (top-1 minus top-2 log-probability) above which tokens must agree.
    pub min_margin: f64,
    /// Largest allowed mean difference over the reference's top-5 tokens found in ours.
    pub mean: f64,
    /// Least share of steps (while the sequences agree) whose greedy token is the reference's.
    pub min_agreement: f64,
    /// Least number of the reference's top-5 tokens found among ours, over all cases.
    pub min_pairs: usize,
}

/// A [`Tolerance::min_margin`] that never asks tokens to agree.
pub const NO_MARGIN_CHECK: f64 = f64::INFINITY;

impl Tolerance {
    /// f32 weights on any backend: the reference precision.
    pub const F32: Tolerance = Tolerance {
        logprob: 1e-3,
        min_margin: 1e-3,
        mean: 1e-3,
        min_agreement: 0.0,
        min_pairs: 50,
    };
}

/// One fixture file: how its checkpoint is made and its cases.
#[derive(Debug, Clone)]
pub struct Fixture {
    /// The family's name (`qwen2_vl`, `qwen2_5_vl`, `qwen3_vl`).
    pub name: String,
    /// `checkpoint`: the `kvlens random-checkpoint` command, its config path (from the workspace
    /// root), seed, image limits and the SHA-256 of its `model.safetensors`.
    pub checkpoint: Value,
    /// The conversations and what the reference generated for each.
    pub cases: Vec<Value>,
}

impl Fixture {
    /// Parses the fixture `name` from its JSON text.
    pub fn parse(name: &str, text: &str) -> Self {
        let mut json: Value = serde_json::from_str(text).expect("a golden fixture is JSON");
        let cases = json["cases"].as_array().cloned().expect("fixture cases");
        Fixture {
            name: name.to_string(),
            checkpoint: json["checkpoint"].take(),
            cases,
        }
    }
}

/// What a run generated for one case, greedily, with the top 5 log-probabilities of each step.
#[derive(Debug, Clone, PartialEq)]
pub struct Generated {
    /// The prompt as token ids.
    pub prompt_token_ids: Vec<u32>,
    /// Each image's `[t, h, w]` patch grid.
    pub image_grid_thw: Vec<[usize; 3]>,
    /// The generated tokens.
    pub token_ids: Vec<u32>,
    /// Per step, `(token, log-probability)` best first.
    pub top_logprobs: Vec<Vec<(u32, f64)>>,
}

fn ids(v: &Value) -> Vec<u64> {
    v.as_array()
        .map_or(Vec::new(), |a| a.iter().filter_map(Value::as_u64).collect())
}

/// Compares each case's run (`generated`, in the fixture's case order) with the reference, within
/// `tol`; `label` names the run in messages. Prints what it measured.
pub fn compare(fixture: &Fixture, generated: &[Generated], tol: &Tolerance, label: &str) {
    let name = &fixture.name;
    assert_eq!(generated.len(), fixture.cases.len(), "{name}: one run per case");
    let (mut compared_tokens, mut worst) = (0, 0f64);
    // Over the steps whose prefix equals the reference's: top-1 agreement, and the differences of
    // the reference's top-5 log-probabilities found among ours.
    let (mut steps_seen, mut top1_agree, mut pairs, mut diff_sum) = (0usize, 0usize, 0usize, 0f64);
    for (case, got) in fixture.cases.iter().zip(generated) {
        let case_name = case["name"].as_str().unwrap_or("?");
        let want_prompt: Vec<u64> = ids(&case["prompt_token_ids"]);
        let got_prompt: Vec<u64> = got.prompt_token_ids.iter().map(|&t| t as u64).collect();
        assert_eq!(got_prompt, want_prompt, "{name}/{case_name}: prompt ids");
        let want_grids: Vec<Vec<u64>> = case["image_grid_thw"]
            .as_array()
            .map_or(Vec::new(), |a| a.iter().map(ids).collect());
        let got_grids: Vec<Vec<u64>> = got
            .image_grid_thw
            .iter()
            .map(|g| g.iter().map(|&d| d as u64).collect())
            .collect();
        assert_eq!(got_grids, want_grids, "{name}/{case_name}: grids");
        let want_tokens = ids(&case["token_ids"]);
        let steps = case["steps"].as_array().expect("fixture steps");
        for (i, step) in steps.iter().enumerate() {
            let (Some(&got_token), Some(got_top)) = (got.token_ids.get(i), got.top_logprobs.get(i)) else {
                panic!("{name}/{case_name}: {label} generated {} tokens", got.token_ids.len());
            };
            steps_seen += 1;
            top1_agree += usize::from(got_token as u64 == want_tokens[i]);
            for w in step["top"].as_array().expect("top log-probabilities") {
                let (id, lp) = (w[0].as_u64().unwrap_or(u64::MAX), w[1].as_f64().unwrap_or(f64::NAN));
                if let Some((_, g)) = got_top.iter().find(|(gid, _)| *gid as u64 == id) {
                    worst = worst.max((g - lp).abs());
                    pairs += 1;
                    diff_sum += (g - lp).abs();
                    assert!(
                        (g - lp).abs() < tol.logprob,
                        "{name}/{case_name} step {i} ({label}): token {id} logprob {g} vs {lp}"
                    );
                }
            }
            let margin = step["margin"].as_f64().unwrap_or(0.0);
            if margin > tol.min_margin {
                assert_eq!(
                    got_token as u64, want_tokens[i],
                    "{name}/{case_name} ({label}): token {i} (margin {margin})"
                );
                compared_tokens += 1;
            }
            if got_token as u64 != want_tokens[i] {
                break;
            }
        }
    }
    let mean = diff_sum / pairs.max(1) as f64;
    let agreement = top1_agree as f64 / steps_seen.max(1) as f64;
    eprintln!(
        "{name} {label}: {compared_tokens} tokens compared; top-1 agreement {top1_agree}/{steps_seen}; {pairs} top-5 \
         log-probabilities found, largest difference {worst:.2e}, mean {mean:.2e}"
    );
    assert!(
        pairs >= tol.min_pairs,
        "{name} ({label}): only {pairs} of the reference's top-5 tokens were among ours"
    );
    assert!(
        mean <= tol.mean,
        "{name} ({label}): mean logprob difference {mean} above {}",
        tol.mean
    );
    assert!(
        agreement >= tol.min_agreement,
        "{name} ({label}): top-1 agreement {agreement} below {}",
        tol.min_agreement
    );
    assert!(
        compared_tokens >= 10 || tol.min_margin == NO_MARGIN_CHECK,
        "{name} ({label}): only {compared_tokens} tokens had a clear reference margin"
    );
}

/// The real Qwen tokenizer.json, where `cargo xtask test` puts it (`KVLENS_TOKENIZER` overrides).
#[cfg(not(target_arch = "wasm32"))]
pub fn qwen_tokenizer_json() -> Vec<u8> {
    let path = std::env::var("KVLENS_TOKENIZER").unwrap_or_else(|_| {
        let home = std::env::var("HOME").unwrap_or_default();
        format!("{home}/.cache/kvlens/tokenizer/package/models/tokenizer.json")
    });
    std::fs::read(&path).unwrap_or_else(|e| panic!("the Qwen tokenizer at {path} ({e}): run `cargo xtask test` once"))
}

/// Runs the golden fixture `name` inside the engine on backend `be` (f32 weights): the checkpoint
/// is made in memory with the fixture's seed (its bytes checked against the fixture's hash), each
/// case goes through the input processor with the real Qwen tokenizer (`KVLENS_TOKENIZER`, else
/// where `cargo xtask test` puts it) and the engine, greedily, and [`compare`] holds it to
/// [`Tolerance::F32`].
#[cfg(not(target_arch = "wasm32"))]
pub fn run_family<B: crate::backend::Backend + 'static>(name: &str, be: B) {
    use crate::arch::config::{DType, ImageLimits, ModelConfig};
    use crate::arch::spec::tensor_specs;
    use crate::engine::{Engine, EngineConfig};
    use crate::input::{default_template, ChatMessage, InlineImages, InputProcessor};
    use crate::model::random_weights::{RandomInit, INIT_STD};
    use crate::model::weights::SafetensorsFiles;
    use crate::model::QwenVl;
    use crate::runner::ModelRunner;
    use crate::sample::SamplingParams;
    use base64::Engine as _;
    use sha2::Digest;
    use std::path::Path;

    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let fixtures = root.join("tests/fixtures/golden");
    let text = std::fs::read_to_string(fixtures.join(format!("{name}.json"))).expect("the fixture");
    let fixture = Fixture::parse(name, &text);
    let ck = &fixture.checkpoint;
    let config_path = root.join("..").join(ck["config"].as_str().expect("config path"));
    let raw: Value = serde_json::from_str(&std::fs::read_to_string(&config_path).expect("the config")).unwrap();
    let cfg = ModelConfig {
        dtype: DType::F32,
        ..ModelConfig::from_value(&raw).expect("a valid config")
    };
    let std = raw
        .pointer("/text_config/initializer_range")
        .or_else(|| raw.get("initializer_range"))
        .and_then(Value::as_f64)
        .unwrap_or(INIT_STD);
    let mut weights = Vec::new();
    RandomInit::new(ck["seed"].as_u64().unwrap_or(0), std)
        .write_safetensors(&mut weights, &tensor_specs(&cfg), |_| {})
        .unwrap();
    let sha: String = sha2::Sha256::digest(&weights)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(
        sha,
        ck["model_safetensors_sha256"].as_str().unwrap_or(""),
        "{name}: checkpoint bytes"
    );

    let tokenizer = qwen_tokenizer_json();
    let mut input = InputProcessor::new(&tokenizer, default_template(cfg.family), &cfg, None, Vec::new()).unwrap();
    let limits = ids(&ck["image_limits"]);
    input.settings.limits = ImageLimits {
        min_pixels: limits[0],
        max_pixels: limits[1],
    };
    input.set_processor_cache_bytes(64 << 20);

    let shards = [("model.safetensors".to_string(), weights.as_slice())];
    let source = SafetensorsFiles::parse(&shards).unwrap();
    let model = QwenVl::load(cfg.clone(), &source, &be, |_, _| {}).unwrap();
    let engine_cfg = EngineConfig {
        num_blocks: 257,
        block_size: 16,
        max_model_len: 4096,
        enable_prefix_caching: false,
        encoder_cache_tokens: 8192,
        max_num_seqs: 1,
        max_num_batched_tokens: 8192,
        vocab_size: input.tokenizer.vocab_size(),
        long_prefill_token_threshold: 0,
    };
    let label = be.name();
    let mut engine = Engine::new(Box::new(ModelRunner::new(be, model)), engine_cfg).unwrap();
    let mut generated = Vec::new();
    for (k, case) in fixture.cases.iter().enumerate() {
        // Images in the fixture are files next to it; they go in as data URLs.
        let mut messages = case["messages"].clone();
        for m in messages.as_array_mut().into_iter().flatten() {
            for part in m["content"].as_array_mut().into_iter().flatten() {
                if let Some(url) = part.pointer_mut("/image_url/url") {
                    let bytes = std::fs::read(fixtures.join(url.as_str().unwrap_or(""))).expect("a fixture image");
                    let data = base64::engine::general_purpose::STANDARD.encode(bytes);
                    *url = Value::from(format!("data:image/png;base64,{data}"));
                }
            }
        }
        let messages = ChatMessage::parse_list(&messages.to_string()).unwrap();
        let params = SamplingParams {
            temperature: 0.0,
            max_tokens: ids(&case["token_ids"]).len(),
            ignore_eos: true,
            logprobs: Some(5),
            ..SamplingParams::default()
        };
        let req = input
            .request(&format!("golden-{k}"), &messages, params, false, &mut InlineImages)
            .unwrap();
        let mut run = Generated {
            prompt_token_ids: req.prompt.clone(),
            image_grid_thw: req.images.iter().map(|i| i.grid_thw).collect(),
            token_ids: Vec::new(),
            top_logprobs: Vec::new(),
        };
        engine.add_request(req).unwrap();
        while engine.has_unfinished() {
            for e in engine.step().unwrap() {
                run.token_ids.push(e.token);
                run.top_logprobs
                    .push(e.top_logprobs.iter().map(|&(t, l)| (t, l as f64)).collect());
            }
        }
        generated.push(run);
    }
    compare(&fixture, &generated, &Tolerance::F32, label);
}

/// Declares the golden tests (every fixture family, f32 weights, [`Tolerance::F32`]) for the
/// backend `$make` builds: one line in a backend's test module, beside
/// [`backend_suite!`](crate::backend_suite).
#[macro_export]
macro_rules! golden_suite {
    ($make:expr) => {
        $crate::golden_suite!(@tests $make; qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_vl_moe);
    };
    // Backends with Gated DeltaNet kernels also run Qwen3.5, dense and MoE.
    ($make:expr, hybrid) => {
        $crate::golden_suite!(@tests $make; qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_vl_moe, qwen3_5, qwen3_5_moe);
    };
    (@tests $make:expr; $($family:ident),*) => {
        mod golden {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[test]
                fn $family() {
                    $crate::golden::run_family(stringify!($family), $make);
                }
            )*
        }
    };
}
