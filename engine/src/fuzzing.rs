//! Fuzz harnesses: one function per parser, taking arbitrary bytes through the engine's real
//! parsing code. The cargo-fuzz targets in `fuzz/` call them, and `tests/fuzz_corpus_replay.rs`
//! replays the committed seed corpus through them in every `cargo test`. Any input may be refused
//! with an error; a panic, a hang or an allocation beyond the target's limit is a bug.

use std::sync::OnceLock;

use crate::arch::config::{bundled_config, Family, ImageLimits, ModelConfig, ProcessorKwargs};
use crate::arch::gguf::Gguf;
use crate::backend::cpu::CpuBackend;
use crate::backend::{Backend, MatrixUse};
use crate::input::chat::{default_template, image_sources, ChatMessage, ChatTemplate, RenderOptions};
use crate::input::image::{decode_image, ProcessorSettings};
use crate::memory::ledger::MemoryLedger;
use crate::memory::log_budget::{header_settings, rebuild, what_if, DeviceTotal};
use crate::memory::vllm_log::parse_vllm_log;
use crate::memory::{device_preset, plan, MmLimits, PlanRequest};
use crate::model::stream::StreamLoader;
use crate::model::weights::SafetensorsFiles;

/// A harness: returns on every input, panics on a bug.
pub type Harness = fn(&[u8]);

/// Every harness under its target's name (also the name of its seed corpus directory).
pub const TARGETS: &[(&str, Harness)] = &[
    ("image", image),
    ("safetensors", safetensors),
    ("config", config),
    ("chat", chat),
    ("vllm_log", vllm_log),
    ("mm_flags", mm_flags),
    ("gguf", gguf),
];

/// The image harness's pixel limit: 1 megapixel, so that no decoder may allocate more than the
/// decoded-image budget of that size (about 24 MiB) and the fuzzer's malloc limit catches one that does.
pub const IMAGE_MAX_DECODED_PIXELS: u64 = 1 << 20;

/// The shipped Qwen2-VL and Qwen3-VL 2B configs: "the checkpoint" where a harness needs one.
fn shipped() -> &'static [ModelConfig; 2] {
    static CONFIGS: OnceLock<[ModelConfig; 2]> = OnceLock::new();
    CONFIGS.get_or_init(|| {
        ["Qwen2-VL-2B-Instruct", "Qwen3-VL-2B-Instruct"]
            .map(|n| bundled_config(n).unwrap_or_else(|e| panic!("bundled config {n}: {e}")))
    })
}

/// Image bytes: decoded, hashed, resized, normalized and patchified (`decode_image` then
/// `process`) under a 1-megapixel limit and a small resize target.
pub fn image(data: &[u8]) {
    let limits = ImageLimits {
        min_pixels: 3_136,
        max_pixels: 28 * 28 * 64,
    };
    let settings = ProcessorSettings {
        max_decoded_pixels: IMAGE_MAX_DECODED_PIXELS,
        ..ProcessorSettings::for_family(Family::Qwen2Vl, limits)
    };
    let Ok(processed) = decode_image(data, &settings).and_then(|d| d.process(&settings)) else {
        return;
    };
    let [t, h, w] = processed.grid_thw.map(|v| v as usize);
    assert_eq!(processed.pixel_values.len(), t * h * w * settings.row_len());
    assert_eq!(processed.num_tokens * settings.merge_size.pow(2), t * h * w);
}

/// A safetensors file: header and tensor table parsed, then every tensor loaded onto the CPU
/// backend at its stored shape, as a weight matrix where it has two axes or more; then the same
/// bytes streamed in 7-byte chunks as the one shard of the tiny Qwen2-VL test model, whose largest
/// tensor (19 MiB) is the most a stream may gather.
pub fn safetensors(data: &[u8]) {
    let shards = [("model.safetensors".to_string(), data)];
    let backend = CpuBackend::new(MemoryLedger::new());
    if let Ok(files) = SafetensorsFiles::parse(&shards) {
        for name in files.names() {
            if let Ok(Some(raw)) = files.raw(name) {
                let _ = match raw.matrix_dims() {
                    Some(_) => backend.load_weight(raw, MatrixUse::Products).map(drop),
                    None => backend.load_tensor(raw).map(drop),
                };
            }
        }
    }
    static TINY: OnceLock<ModelConfig> = OnceLock::new();
    let tiny = TINY.get_or_init(|| {
        ModelConfig::from_json(include_str!("../../tools/golden/configs/qwen2_vl_tiny.json"))
            .unwrap_or_else(|e| panic!("tiny Qwen2-VL config: {e}"))
    });
    let Ok(mut stream) = StreamLoader::new(tiny.clone(), &backend, |_, _| {}) else {
        return;
    };
    let fed = stream
        .begin_shard("model.safetensors")
        .and_then(|()| data.chunks(7).try_for_each(|c| stream.push(c)));
    if fed.is_ok() {
        let _ = stream.finish();
    }
}

/// A `config.json` (parsed, then the figures the server derives from it) and the same text as the
/// `preprocessor_config.json` of that model and of each family's shipped model.
pub fn config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let parsed = ModelConfig::from_json(text).ok();
    if let Some(cfg) = &parsed {
        if let Some(v) = &cfg.vision {
            let _ = (v.output_dim(), v.image_factor(), v.patch_dim());
        }
    }
    for cfg in parsed.iter().chain(shipped()) {
        if let Ok(settings) = ProcessorSettings::new(cfg, Some(text)) {
            let _ = (settings.factor(), settings.row_len());
        }
    }
}

/// OpenAI chat messages: parsed, their image parts resolved (`data:` URLs decoded) and rendered
/// with both families' chat templates.
pub fn chat(data: &[u8]) {
    static TEMPLATES: OnceLock<Vec<ChatTemplate>> = OnceLock::new();
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(messages) = ChatMessage::parse_list(text) else {
        return;
    };
    let _ = image_sources(&messages);
    let templates = TEMPLATES.get_or_init(|| {
        [Family::Qwen2Vl, Family::Qwen3Vl]
            .map(|f| ChatTemplate::new(default_template(f)).unwrap_or_else(|e| panic!("{f:?} template: {e}")))
            .into()
    });
    for template in templates {
        let options = RenderOptions {
            add_generation_prompt: true,
            add_vision_id: true,
            continue_final_message: false,
        };
        let _ = template.render_with(&messages, options);
    }
}

/// A vLLM start-up log: parsed, its header's settings put into a plan request as
/// `kvlens plan --from-log` does, the budget rebuilt, rendered and asked the what-if questions.
pub fn vllm_log(data: &[u8]) {
    let log = parse_vllm_log(&String::from_utf8_lossy(data));
    let header = header_settings(&log);
    let model = header.model.as_deref().unwrap_or("Qwen3-VL-8B-Instruct");
    let Ok(cfg) = bundled_config(model) else {
        return;
    };
    let Some(mut device) = device_preset(header.device.as_deref().unwrap_or("h100-80g")) else {
        return;
    };
    let mut total = DeviceTotal::Preset;
    if let Some(gib) = header.total_memory_gib {
        device = device.with_total_bytes(crate::memory::device::gib_to_bytes(gib));
        total = DeviceTotal::Given;
    }
    let mut req = PlanRequest::new(model, cfg, device);
    req.tensor_parallel_size = header.tensor_parallel_size.unwrap_or(1);
    req.max_model_len = header.max_model_len;
    req.gpu_memory_utilization = header.gpu_memory_utilization.unwrap_or(0.9);
    req.max_num_batched_tokens = header.max_num_batched_tokens;
    req.max_num_seqs = header.max_num_seqs;
    req.block_size = header.block_size;
    if let Some(limits) = header.limit_mm_per_prompt.as_deref().map(MmLimits::parse) {
        let Ok(limits) = limits else {
            return;
        };
        req.limit_mm_per_prompt = limits;
    }
    let Ok(budget) = rebuild(&log, req.clone(), total) else {
        return;
    };
    let _ = (budget.plan.vllm_log_lines(), budget.plan.table());
    for target in [budget.plan.max_model_len, 2 * budget.plan.max_model_len + 1] {
        let _ = what_if(&budget, &req, target);
    }
}

/// A `--limit-mm-per-prompt` or `--mm-processor-kwargs` value: parsed, applied to each family's
/// shipped image limits and planned with, as `kvlens serve` does at start-up.
pub fn mm_flags(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let mm_limits = MmLimits::parse(text).ok();
    let kwargs = ProcessorKwargs::parse(text).ok();
    if mm_limits.is_none() && kwargs.is_none() {
        return;
    }
    let Some(device) = device_preset("h100-80g") else {
        return;
    };
    for cfg in shipped() {
        let mut req = PlanRequest::new("fuzz", cfg.clone(), device.clone());
        if let Some(limits) = mm_limits {
            req.limit_mm_per_prompt = limits;
        }
        let image_limits = kwargs.as_ref().map(|k| k.apply(ImageLimits::shipped(cfg.family)));
        if let Some(Ok(limits)) = image_limits {
            req.image_limits = limits;
        }
        if let Ok(p) = plan(&req) {
            let _ = p.vllm_log_lines();
        }
    }
}

/// Values a tensor of the GGUF harness may have to be dequantized (larger ones are only parsed).
const GGUF_MAX_DEQUANTIZED: u64 = 1 << 16;

/// A GGUF file: its header parsed and checked against the input's length, then every tensor
/// small enough dequantized from the bytes the header says it has. Then the input split in two
/// where its first two bytes say, read as a text model and its projector (a text model alone when
/// the second part is not a GGUF): the config, the tokenizer, the tensor map and every tensor it
/// names made from whatever the two hold.
pub fn gguf(data: &[u8]) {
    if let Ok(file) = Gguf::parse(data, data.len() as u64) {
        for t in file.tensors.iter().filter(|t| t.numel() <= GGUF_MAX_DEQUANTIZED) {
            let bytes = &data[t.start as usize..(t.start + t.bytes) as usize];
            let mut out = vec![0f32; t.numel() as usize];
            t.ggml_type.dequantize(bytes, &mut out);
        }
    }
    let [a, b, rest @ ..] = data else { return };
    let (text_bytes, mmproj_bytes) = rest.split_at(usize::from(u16::from_le_bytes([*a, *b])).min(rest.len()));
    let Ok(text) = Gguf::parse(text_bytes, text_bytes.len() as u64) else {
        return;
    };
    let mmproj = Gguf::parse(mmproj_bytes, mmproj_bytes.len() as u64).ok();
    let Ok(pair) = crate::arch::gguf_model::GgufModel::new(&text, mmproj.as_ref()) else {
        return;
    };
    if let Ok(json) = pair.config_json() {
        let _ = ModelConfig::from_value(&json);
    }
    if let Ok(tokenizer) = pair.tokenizer_json() {
        let _ = crate::input::tokenizer::Tokenizer::from_bytes(tokenizer.as_bytes());
    }
    let _ = (pair.preprocessor_json(), pair.eos_token_ids());
    // Every tensor the map names, put together from the files' bytes (q/k/v, the patch kernel).
    use crate::model::weights::TensorSource;
    let (Ok(names), Ok(source)) = (
        pair.tensors(),
        crate::model::gguf_tensors::GgufTensors::new(&pair, text_bytes, mmproj_bytes),
    ) else {
        return;
    };
    for name in names.keys() {
        let _ = TensorSource::<crate::backend::cpu::CpuBackend>::fetch(&source, name);
    }
}
