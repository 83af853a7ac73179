//! The engine inside headless Chromium, on the CPU backend and on the wgpu backend over the page's
//! WebGPU adapter (SwiftShader in CI), gives exactly the greedy tokens the native `kvlens generate`
//! gives for the same prompt (an image and text) on the same tiny random checkpoint.
//!
//! `cargo xtask test` (its "engine in headless Chromium" step, or `cargo xtask browser-test` alone)
//! writes the checkpoint with `kvlens random-checkpoint`, runs `kvlens generate --json` on it and
//! runs this file under wasm-bindgen-test-runner and chromedriver, with variables naming what to
//! embed (the browser has no filesystem):
//! - `KVLENS_BROWSER_CHECKPOINT`: the checkpoint directory (config.json, model.safetensors,
//!   preprocessor_config.json, tokenizer.json, chat_template.jinja) and the image file `image.png`
//!   beside them;
//! - `KVLENS_BROWSER_PROMPT`: the text of the prompt beside the image;
//! - `KVLENS_BROWSER_EXPECTED`: generate's JSON object (prompt ids with the image's placeholders
//!   expanded, generated ids, image grid, tokenizer vocabulary size, finish reason).
//!
//! The browser must offer WebGPU (Chromium needs `--enable-unsafe-webgpu`, which the xtask passes):
//! without an adapter the wgpu test fails, it never skips.
//!
//! The file compiles to nothing on native targets.
#![cfg(target_arch = "wasm32")]

use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;
use kvlens_engine::arch::config::{ImageLimits, ModelConfig};
use kvlens_engine::arch::ggml::GgmlType;
use kvlens_engine::arch::weight_format::WeightFormat;
use kvlens_engine::backend::cpu::{CpuBackend, PackedMatrix};
#[cfg(feature = "wgpu")]
use kvlens_engine::backend::wgpu::{WgpuBackend, WgpuOptions};
use kvlens_engine::backend::Backend;
use kvlens_engine::builder::{build_engine, EngineOptions};
use kvlens_engine::engine::{Engine, Request};
use kvlens_engine::input::chat::{select_chat_template, ChatMessage, Content, ContentPart, ImageUrl};
use kvlens_engine::input::processor::{InlineImages, InputProcessor};
use kvlens_engine::memory::device::device_preset;
use kvlens_engine::memory::ledger::MemoryLedger;
use kvlens_engine::memory::planner::{MmLimits, PlanRequest};
use kvlens_engine::model::weights::SafetensorsFiles;
use kvlens_engine::model::QwenVl;
use kvlens_engine::runner::ModelRunner;
use kvlens_engine::sample::SamplingParams;
use serde_json::Value;
use wasm_bindgen_test::{console_log, wasm_bindgen_test, wasm_bindgen_test_configure};

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
const TOKENIZER: &[u8] = include_bytes!(checkpoint_file!("tokenizer.json"));
const CHAT_TEMPLATE: &str = include_str!(checkpoint_file!("chat_template.jinja"));
/// The user's text beside the image (the xtask's, as it passed it to `kvlens generate --prompt`).
const PROMPT: &str = env!(
    "KVLENS_BROWSER_PROMPT",
    "KVLENS_BROWSER_PROMPT is set by `cargo xtask browser-test` (or `cargo xtask test`)"
);
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

/// Milliseconds since the epoch, from the browser's clock.
fn now_ms() -> f64 {
    js_sys::Date::now()
}

/// The request `kvlens generate --image image.png --prompt PROMPT` makes, built in the browser by
/// the engine's input processor (chat template, tokenizer, image preprocessing, placeholder
/// expansion) from the embedded checkpoint's files, the image going in as a data URL as the
/// playground sends it; its prompt ids, image grid and vocabulary size are checked against native
/// generate's.
fn browser_request(cfg: &ModelConfig, expected: &Value, max_tokens: usize) -> (Request, InputProcessor) {
    let template = select_chat_template(Some(CHAT_TEMPLATE), None, None)
        .expect("the chat template")
        .expect("chat_template.jinja");
    let input = InputProcessor::new(TOKENIZER, &template, cfg, Some(PREPROCESSOR), cfg.tokens.eos.clone())
        .expect("the input processor");
    let messages = [ChatMessage {
        role: "user".into(),
        content: Content::Parts(vec![
            ContentPart::ImageUrl {
                image_url: ImageUrl {
                    url: format!("data:image/png;base64,{}", STANDARD.encode(IMAGE)),
                },
            },
            ContentPart::Text {
                text: PROMPT.to_string(),
            },
        ]),
    }];
    let params = SamplingParams {
        temperature: 0.0,
        max_tokens,
        ignore_eos: true,
        ..SamplingParams::default()
    };
    let request = input
        .request("browser-0", &messages, params, false, &mut InlineImages)
        .expect("the browser's request");
    assert_eq!(
        request.prompt,
        ids(expected, "prompt_token_ids"),
        "the browser's prompt ids differ from native `kvlens generate`'s"
    );
    let grids: Vec<[usize; 3]> = request.images.iter().map(|i| i.grid_thw).collect();
    assert_eq!(
        serde_json::json!(grids),
        expected["image_grid_thw"],
        "the browser's image grid differs from native generate's"
    );
    assert_eq!(
        Some(input.tokenizer.vocab_size() as u64),
        expected["vocab_size"].as_u64(),
        "tokenizer vocabulary size"
    );
    (request, input)
}

/// Builds the request in the browser (see [`browser_request`]), loads the embedded checkpoint on
/// `backend`, starts the engine as `kvlens generate` does, runs the prompt to the end with the
/// browser's awaited step and checks the greedy tokens and finish reason against native
/// `kvlens generate`. The engine is handed back (its weights and KV cache still allocated) for
/// the caller's own checks.
async fn generate_matches_native<B: Backend + 'static>(backend: B) -> Engine {
    let name = backend.name();
    let expected: Value = serde_json::from_str(EXPECTED).expect("generate's JSON");
    let want = ids(&expected, "token_ids");
    assert!(!want.is_empty(), "native generate produced no token: {expected}");
    let max_tokens = want.len();
    let started = now_ms();
    let cfg = ModelConfig::from_json(CONFIG).expect("config.json");
    let (request, input) = browser_request(&cfg, &expected, max_tokens);
    let prompt_len = request.prompt.len();
    let prompted = now_ms();
    console_log!(
        "{name}: request built (tokenizer loaded) in {:.0} ms",
        prompted - started
    );

    let shards = [("model.safetensors".to_string(), WEIGHTS)];
    let source = SafetensorsFiles::parse(&shards).expect("model.safetensors");
    let model = QwenVl::load(cfg, &source, &backend, |_, _| {})
        .unwrap_or_else(|e| panic!("the model loads on the {name} backend: {e}"));
    let loaded = now_ms();
    console_log!("{name}: model loaded in {:.0} ms", loaded - prompted);

    // Sized by the engine's start-up code as `kvlens generate` sizes it (server/src/generate_cmd.rs):
    // one sequence, the whole prompt in one step, this image as the largest the profile runs. Only
    // the memory differs (generate takes 40% of the machine's), which moves the KV block count,
    // never a result.
    let model_cfg = model.cfg.clone();
    let device = device_preset("cpu")
        .expect("the cpu preset")
        .with_total_bytes(256 << 20);
    let mut plan_req = PlanRequest::new("browser", model_cfg.clone(), device);
    let [_, h, w] = request.images[0].grid_thw;
    let patch = model_cfg.vision.as_ref().expect("a vision tower").patch_size as u64;
    let largest = (h * w) as u64 * patch * patch;
    plan_req.image_limits = ImageLimits {
        min_pixels: input.settings.limits.min_pixels.min(largest),
        max_pixels: largest,
    };
    plan_req.limit_mm_per_prompt = MmLimits { image: 1, video: 0 };
    plan_req.max_model_len = Some((prompt_len + max_tokens).min(model_cfg.text.max_position_embeddings));
    plan_req.max_num_batched_tokens = Some(prompt_len);
    plan_req.max_num_seqs = Some(1);
    plan_req.non_torch_bytes = Some(0);
    let opts = EngineOptions {
        enable_prefix_caching: true,
        long_prefill_token_threshold: 0,
        max_num_partial_prefills: 1,
        vocab_size: input.tokenizer.vocab_size(),
    };
    let (mut engine, _) = build_engine(Box::new(ModelRunner::new(backend, model)), plan_req, opts, &|| {
        now_ms() / 1e3
    })
    .await
    .unwrap_or_else(|e| panic!("the engine starts on the {name} backend: {e}"));
    let built = now_ms();
    console_log!(
        "{name}: engine started (profile run included) in {:.0} ms",
        built - loaded
    );
    engine.add_request(request).expect("the request is accepted");

    let mut got = Vec::new();
    let mut finish = None;
    let mut steps = 0;
    while engine.has_unfinished() {
        // The browser's way: the logits read is awaited, never blocked on.
        let events = engine
            .step_async()
            .await
            .unwrap_or_else(|e| panic!("an engine step on the {name} backend: {e}"));
        steps += 1;
        for e in events {
            got.push(e.token);
            finish = finish.or(e.finish);
        }
    }
    let done = now_ms();
    console_log!(
        "{name}: {} prompt tokens and {} generated in {steps} steps, {:.0} ms",
        prompt_len,
        got.len(),
        done - built
    );
    assert_eq!(
        got, want,
        "greedy tokens on the {name} backend in the browser differ from native `kvlens generate`\n browser: {got:?}\n  native: {want:?}"
    );
    assert_eq!(
        finish.map(|f| f.as_str()),
        expected["finish_reason"].as_str(),
        "finish reason on the {name} backend"
    );
    engine
}

#[wasm_bindgen_test]
async fn cpu_backend_gives_native_greedy_tokens() {
    generate_matches_native(CpuBackend::new(MemoryLedger::new())).await;
}

#[cfg(feature = "wgpu")]
#[wasm_bindgen_test]
async fn wgpu_backend_on_webgpu_gives_native_greedy_tokens() {
    let backend = WgpuBackend::new(MemoryLedger::new(), WgpuOptions::default())
        .await
        .unwrap_or_else(|e| panic!("no WebGPU device (`cargo xtask browser-test` passes Chromium's flags): {e}"));
    let info = backend.adapter_info().clone();
    console_log!("WebGPU adapter {:?}: {}", info.name, backend.describe());
    assert_eq!(
        info.backend,
        wgpu::Backend::BrowserWebGpu,
        "the wgpu backend must run on the browser's WebGPU: {info:?}"
    );
    // Every kernel through the browser's WGSL compiler, also those this adapter's run never
    // dispatches (on a CPU adapter the tiled matmuls give way to the barrier-free one).
    let started = now_ms();
    let pipelines = backend
        .check_kernels()
        .await
        .unwrap_or_else(|e| panic!("kernels the browser's WGSL compiler rejects:\n{e}"));
    console_log!(
        "wgpu: {pipelines} kernel pipelines compiled in {:.0} ms",
        now_ms() - started
    );
    let engine = generate_matches_native(backend.clone()).await;
    let ledger = backend.ledger();
    assert_eq!(
        ledger.total(),
        backend.device_bytes(),
        "after the run, the ledger against the device's live buffers: {:?}",
        ledger.entries()
    );
    drop(engine);
    assert_eq!(
        ledger.total(),
        backend.device_bytes(),
        "with the engine dropped, the ledger against the device's live buffers: {:?}",
        ledger.entries()
    );
}

/// The CPU backend's block products in wasm (its `simd128` kernels) are the products of the
/// dequantized weights with the activations as GGML rounds them (8 bits per value, a scale per
/// 32), to f32 rounding (within 1e-5 of the terms' summed sizes): `q8_0` and `q4_0` for rows of 35
/// blocks (not a multiple of the four the products take at once), also with subnormal and zero
/// f16 scales, and `q4_K` and `q6_K` (a `Q4_K_M` file's formats) as a GGUF file stores them.
#[wasm_bindgen_test]
fn block_products_in_wasm_are_the_dequantized_products() {
    // The build's `+simd128` (.cargo/config.toml) is what puts the kernels under test; a RUSTFLAGS
    // that replaced it would leave the portable loops.
    let paths = kvlens_engine::backend::cpu::kernel_paths();
    assert!(paths.contains("wasm simd128"), "not the simd128 kernels: {paths}");
    let (rows, m) = (16, 3);
    let wave = |i: usize, p: usize, q: usize| (i * p % q) as f32 / q as f32 - 0.5;
    // (a matrix, its name)
    let mut matrices: Vec<(PackedMatrix, String)> = Vec::new();
    let cols = 35 * 32;
    let values: Vec<f32> = (0..rows * cols).map(|i| wave(i, 7919, 1013)).collect();
    // The same values times 1e-4: every block's f16 scale subnormal, each row's first block zeros
    // (a zero scale), which the products widen four at a time in f32 lanes.
    let tiny: Vec<f32> = (values.iter().enumerate())
        .map(|(i, v)| if i % cols < 32 { 0.0 } else { v * 1e-4 })
        .collect();
    for format in [WeightFormat::Q8_0, WeightFormat::Q4_0] {
        for (values, what) in [(&values, ""), (&tiny, ", subnormal scales")] {
            let w = PackedMatrix::quantize(format, values, rows, cols).expect("a quantizable shape");
            matrices.push((w, format!("{format:?}{what}")));
        }
    }
    // K-quant super-blocks of pseudo-random bytes, their f16 scales set to small normal values.
    let cols = 3 * 256;
    for (ggml, block, scales) in [(GgmlType::Q4K, 144, &[0, 2][..]), (GgmlType::Q6K, 210, &[208][..])] {
        let mut data: Vec<u8> = (0..rows * cols / 256 * block)
            .map(|i| ((i as u32).wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        for (b, sb) in data.chunks_exact_mut(block).enumerate() {
            for (k, &at) in scales.iter().enumerate() {
                let d = half::f16::from_f32(0.001 * (1 + (b + k) % 7) as f32);
                sb[at..at + 2].copy_from_slice(&d.to_bits().to_le_bytes());
            }
        }
        let w = PackedMatrix::ggml(ggml, &data, rows, cols).expect("whole super-blocks");
        matrices.push((w, format!("{ggml:?}")));
    }
    for (w, name) in matrices {
        let cols = w.dims().1;
        let x: Vec<f32> = (0..m * cols)
            .map(|i| wave(i, 104_729, 997) * (1 + i / 500) as f32)
            .collect();
        // The activations as the kernels see them: per block of 32, values rounded to d · q (i8 q).
        let rounded: Vec<f64> = x
            .chunks_exact(32)
            .flat_map(|block| {
                let d = block.iter().fold(0f32, |a, v| a.max(v.abs())) / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                block
                    .iter()
                    .map(move |v| ((v * id).round_ties_even() as i8) as f64 * d as f64)
            })
            .collect();
        let got = w.matmul(&x, m).expect("the product");
        let wide = w.dequantize();
        for i in 0..m {
            for r in 0..rows {
                let terms = wide[r * cols..][..cols]
                    .iter()
                    .zip(&rounded[i * cols..][..cols])
                    .map(|(&a, &b)| a as f64 * b);
                let (want, size) = terms.fold((0.0, 0.0), |(sum, size), t| (sum + t, size + t.abs()));
                let g = got[i * rows + r] as f64;
                assert!(
                    size > 0.0 && (g - want).abs() <= 1e-5 * size,
                    "{name} row {r}, x {i}: {g} vs {want} (terms' sizes {size})"
                );
            }
        }
    }
}
