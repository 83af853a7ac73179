//! The engine on the CPU backend inside headless Chromium gives exactly the greedy tokens the native
//! `kvlens generate` gives for the same prompt (an image and text) on the same tiny random checkpoint.
//!
//! `cargo xtask test` (its "engine in headless Chromium" step, or `cargo xtask browser-test` alone)
//! writes the checkpoint with `kvlens random-checkpoint`, runs `kvlens generate --json` on it and
//! runs this file under wasm-bindgen-test-runner and chromedriver, with two variables naming what
//! to embed (the browser has no filesystem):
//! - `KVLENS_BROWSER_CHECKPOINT`: the checkpoint directory (config.json, model.safetensors,
//!   preprocessor_config.json) and the image file `image.png` beside them;
//! - `KVLENS_BROWSER_EXPECTED`: generate's JSON object (prompt ids with the image's placeholders
//!   expanded, generated ids, image grid, tokenizer vocabulary size, finish reason).
//!
//! The file compiles to nothing on native targets.
#![cfg(target_arch = "wasm32")]

use kvlens_engine::backend::cpu::CpuBackend;
use kvlens_engine::builder::{build_engine, EngineOptions};
use kvlens_engine::cache::{MmHash, RequestId};
use kvlens_engine::config::{ImageLimits, ModelConfig};
use kvlens_engine::engine::{ImageInput, Request};
use kvlens_engine::input::image::{process_image, ProcessorSettings};
use kvlens_engine::memory::device::device_preset;
use kvlens_engine::memory::ledger::MemoryLedger;
use kvlens_engine::memory::planner::{MmLimits, PlanRequest};
use kvlens_engine::model::weights::SafetensorsFiles;
use kvlens_engine::model::QwenVl;
use kvlens_engine::runner::ModelRunner;
use kvlens_engine::sample::SamplingParams;
use serde_json::Value;
use wasm_bindgen_test::{wasm_bindgen_test, wasm_bindgen_test_configure};

wasm_bindgen_test_configure!(run_in_browser);

/// The path of a file the xtask put in the checkpoint directory.
macro_rules! checkpoint_file {
    ($name:literal) => {
        concat!(
            env!(
                "KVLENS_BROWSER_CHECKPOINT",
                "KVLENS_BROWSER_CHECKPOINT is set by `cargo xtask browser-test` (or `cargo xtask test`)"
            ),
            "/",
            $name
        )
    };
}

const CONFIG: &str = include_str!(checkpoint_file!("config.json"));
const PREPROCESSOR: &str = include_str!(checkpoint_file!("preprocessor_config.json"));
const WEIGHTS: &[u8] = include_bytes!(checkpoint_file!("model.safetensors"));
const IMAGE: &[u8] = include_bytes!(checkpoint_file!("image.png"));
const EXPECTED: &str = include_str!(env!(
    "KVLENS_BROWSER_EXPECTED",
    "KVLENS_BROWSER_EXPECTED is set by `cargo xtask browser-test` (or `cargo xtask test`)"
));

/// A list of ids from generate's JSON.
fn ids(v: &Value, key: &str) -> Vec<u32> {
    v[key]
        .as_array()
        .unwrap_or_else(|| panic!("generate's JSON has no {key}: {v}"))
        .iter()
        .map(|x| x.as_u64().expect("an id") as u32)
        .collect()
}

#[wasm_bindgen_test]
async fn greedy_tokens_match_native_generate() {
    let expected: Value = serde_json::from_str(EXPECTED).expect("generate's JSON");
    let prompt = ids(&expected, "prompt_token_ids");
    let want = ids(&expected, "token_ids");
    let vocab_size = expected["vocab_size"].as_u64().expect("vocab_size") as usize;
    assert!(!want.is_empty(), "native generate produced no token: {expected}");

    let cfg = ModelConfig::from_json(CONFIG).expect("config.json");
    let settings = ProcessorSettings::new(&cfg, Some(PREPROCESSOR)).expect("preprocessor_config.json");
    let image = process_image(IMAGE, &settings).expect("the image");
    assert_eq!(
        serde_json::json!([image.grid_thw]),
        expected["image_grid_thw"],
        "the browser's image grid differs from native generate's"
    );
    let offset = prompt
        .iter()
        .position(|&t| t == cfg.tokens.image)
        .expect("an <|image_pad|> in the prompt");

    let backend = CpuBackend::new(MemoryLedger::new());
    let shards = [("model.safetensors".to_string(), WEIGHTS)];
    let source = SafetensorsFiles::parse(&shards).expect("model.safetensors");
    let model = QwenVl::load(cfg, &source, &backend, |_, _| {}).expect("the model loads");

    // Sized by the engine's start-up code as `kvlens generate` sizes it (server/src/generate_cmd.rs):
    // one sequence, the whole prompt in one step, this image as the largest the profile runs. Only
    // the memory differs (generate takes 40% of the machine's), which moves the KV block count,
    // never a result.
    let max_tokens = want.len();
    let model_cfg = model.cfg.clone();
    let device = device_preset("cpu")
        .expect("the cpu preset")
        .with_total_bytes(256 << 20);
    let mut plan_req = PlanRequest::new("browser", model_cfg.clone(), device);
    let [_, h, w] = image.grid_thw;
    let patch = model_cfg.vision.patch_size as u64;
    let largest = u64::from(h * w) * patch * patch;
    plan_req.image_limits = ImageLimits {
        min_pixels: settings.limits.min_pixels.min(largest),
        max_pixels: largest,
    };
    plan_req.limit_mm_per_prompt = MmLimits { image: 1, video: 0 };
    plan_req.max_model_len = Some((prompt.len() + max_tokens).min(model_cfg.text.max_position_embeddings));
    plan_req.max_num_batched_tokens = Some(prompt.len());
    plan_req.max_num_seqs = Some(1);
    plan_req.non_torch_bytes = Some(0);
    let opts = EngineOptions {
        enable_prefix_caching: true,
        long_prefill_token_threshold: 0,
        max_num_partial_prefills: 1,
        vocab_size,
    };
    let (mut engine, _) =
        build_engine(ModelRunner::new(backend, model), plan_req, opts, &|| 0.0).expect("the engine starts");
    let request = Request {
        id: RequestId::from("browser-0"),
        images: vec![ImageInput {
            grid_thw: image.grid_thw.map(|x| x as usize),
            pixel_values: image.pixel_values,
            mm_hash: MmHash::from(image.mm_hash),
            offset,
            num_tokens: image.num_tokens,
        }],
        prompt,
        params: SamplingParams {
            temperature: 0.0,
            max_tokens,
            ignore_eos: true,
            ..SamplingParams::default()
        },
    };
    engine.add_request(request).expect("the request is accepted");

    let mut got = Vec::new();
    let mut finish = None;
    while engine.has_unfinished() {
        // The browser's way: the logits read is awaited, never blocked on.
        let events = engine.step_async().await.expect("an engine step");
        for e in events {
            got.push(e.token);
            finish = finish.or(e.finish);
        }
    }
    assert_eq!(
        got, want,
        "greedy tokens in the browser differ from native `kvlens generate`\n browser: {got:?}\n  native: {want:?}"
    );
    assert_eq!(
        finish.map(|f| f.as_str()),
        expected["finish_reason"].as_str(),
        "finish reason"
    );
}
