//! The engine running in this tab's Web Worker ([`crate::worker`]): the checkpoint streamed onto
//! the wgpu backend over the worker's WebGPU (or, without WebGPU, the CPU backend in wasm), sized
//! by the same start-up code as `kvlens serve`, and stepped by one task that awaits each step's
//! read and yields between steps, so that aborts and new requests land in between.

use crate::checkpoint::{gguf_model, CheckpointInfo, GgufFile, Source, Weights};
use crate::memory_view::{size, Budget, ResetKind};
use kvlens_engine::arch::config::{DType, ImageLimits};
use kvlens_engine::arch::gguf_model::Part;
use kvlens_engine::arch::weight_format::WeightFormat;
use kvlens_engine::backend::wgpu::{WgpuBackend, WgpuOptions};
use kvlens_engine::backend::{Backend, BackendKind};
use kvlens_engine::builder::{build_engine, open, BackendChoice, EngineOptions, ModelSource, StartupReport};
use kvlens_engine::cache::RequestId;
use kvlens_engine::engine::{Engine, Request, TokenEvent};
use kvlens_engine::input::image::ProcessorSettings;
use kvlens_engine::input::processor::InputProcessor;
use kvlens_engine::lessons::{run_live, Bench, Lesson, Step, Watch};
use kvlens_engine::memory::device::{device_preset, DeviceProfile};
use kvlens_engine::memory::ledger::MemoryLedger;
use kvlens_engine::memory::planner::{plan, MmLimits, Plan, PlanRequest};
use kvlens_engine::model::stream::StreamLoader;
use kvlens_engine::occupancy::{Occupancy, ProcessMemory};
use kvlens_engine::runner::{ModelRunner, StepRunner};
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;

/// The tiny model's settings: a small KV cache so its blocks can be watched one by one.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Settings {
    /// KV blocks to allocate (vLLM's `--kv-cache-memory` is set to this many pages).
    pub kv_blocks: u64,
    /// The longest context (`--max-model-len`); None: the model's.
    pub max_model_len: Option<usize>,
    /// Sequences at once (`--max-num-seqs`).
    pub max_num_seqs: usize,
    /// Tokens per step (`--max-num-batched-tokens`).
    pub max_num_batched_tokens: usize,
    /// Images per prompt (`--limit-mm-per-prompt image=N`).
    pub images_per_prompt: usize,
    /// The most tokens an image becomes (`--mm-processor-kwargs max_pixels`, in tokens): the
    /// checkpoint's limit when smaller. Start-up profiles an image this large, so a tab keeps it
    /// small; a GGUF pair carries no limit, and its family's (16,384 tokens for Qwen3-VL) would
    /// take minutes to profile in a tab.
    pub max_image_tokens: u64,
    /// Weight matrices quantized on load (`--quantization`).
    pub quantization: WeightFormat,
}

impl Settings {
    /// Tokens per step on the CPU fallback: start-up profiles a step this large, which at the
    /// default of 2048 took minutes in a tab (357 s for the 2B `Q4_0` file on a 2-core machine);
    /// still a whole image of the default [`max_image_tokens`](Self::max_image_tokens) per step.
    pub const CPU_FALLBACK_TOKENS_PER_STEP: usize = 256;

    /// The defaults for a tab without WebGPU: fewer tokens per step, unless already changed.
    pub fn for_cpu_fallback(&mut self) {
        if self.max_num_batched_tokens == Settings::default().max_num_batched_tokens {
            self.max_num_batched_tokens = Self::CPU_FALLBACK_TOKENS_PER_STEP;
        }
    }
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            kv_blocks: 256,
            max_model_len: None,
            max_num_seqs: 4,
            max_num_batched_tokens: 2048,
            images_per_prompt: 4,
            max_image_tokens: 256,
            quantization: WeightFormat::Unquantized,
        }
    }
}

/// The backend a model goes onto.
#[derive(Debug, Clone)]
pub enum Device {
    /// The page's WebGPU adapter.
    WebGpu(WgpuBackend),
    /// No WebGPU: the CPU backend in wasm, and why.
    Cpu(String),
}

impl Device {
    /// The WebGPU backend when the worker has an adapter, else the CPU one with the reason.
    pub async fn open() -> Device {
        match WgpuBackend::new(MemoryLedger::new(), WgpuOptions::default()).await {
            Ok(b) => Device::WebGpu(b),
            Err(e) => Device::Cpu(e.to_string()),
        }
    }

    /// The device the planner sizes for: a WebGPU laptop, or the wasm heap (wasm32's 4 GiB).
    pub fn profile(&self) -> DeviceProfile {
        let (name, total) = match self {
            Device::WebGpu(_) => ("webgpu-4g", None),
            Device::Cpu(_) => ("cpu", Some(4u64 << 30)),
        };
        let p = device_preset(name).expect("a bundled device preset");
        match total {
            Some(t) => p.with_total_bytes(t),
            None => p,
        }
    }

    /// One line naming the backend and adapter.
    pub fn describe(&self) -> String {
        match self {
            Device::WebGpu(b) => format!("WebGPU: {} ({})", b.adapter_info().name, b.describe()),
            Device::Cpu(why) => format!(
                "CPU backend in wasm, {} (no WebGPU: {why})",
                crate::row_helper::threads()
            ),
        }
    }
}

/// The format weights are loaded in: the chosen one, or for a GGUF pair its files' own types
/// (nothing is quantized again).
pub fn weight_format(info: &CheckpointInfo, s: Settings) -> WeightFormat {
    match info.weights {
        Weights::Gguf { .. } => WeightFormat::Unquantized,
        Weights::Safetensors(_) => s.quantization,
    }
}

/// The image sizes the tab accepts: the checkpoint's (its preprocessor file's, else its family's),
/// at most `s.max_image_tokens` tokens an image.
pub fn image_limits(info: &CheckpointInfo, s: Settings) -> Result<ImageLimits, String> {
    let settings =
        ProcessorSettings::new(&info.config, info.preprocessor_json.as_deref()).map_err(|e| e.to_string())?;
    let token_pixels = (settings.patch_size * settings.merge_size).pow(2) as u64;
    let max_pixels = settings.limits.max_pixels.min(s.max_image_tokens.max(1) * token_pixels);
    Ok(ImageLimits {
        min_pixels: settings.limits.min_pixels.min(max_pixels),
        max_pixels,
    })
}

/// The start-up request for a checkpoint on a device: f32 weights (or the chosen block format,
/// or a GGUF pair's tensors as stored) and KV (what the backends store), this page's settings,
/// vLLM's defaults for the rest.
pub fn plan_request(info: &CheckpointInfo, limits: ImageLimits, device: &Device, s: Settings) -> PlanRequest {
    let mut req = PlanRequest::new("playground", info.config.clone(), device.profile());
    req.image_limits = limits;
    req.dtype = Some(DType::F32);
    req.kv_cache_dtype = Some(DType::F32);
    req.quantization = weight_format(info, s);
    req.weights_bytes = info.weights.stored_bytes();
    req.limit_mm_per_prompt = MmLimits {
        image: s.images_per_prompt,
        video: 0,
    };
    req.max_model_len = s.max_model_len;
    req.max_num_seqs = Some(s.max_num_seqs);
    req.max_num_batched_tokens = Some(s.max_num_batched_tokens);
    req.mm_processor_cache_gb = 0.25;
    req.non_torch_bytes = Some(0);
    // One plan to learn the page size, then the KV cache is set to the blocks asked for.
    if let Ok(p) = plan(&req) {
        req.kv_cache_memory_bytes = Some(s.kv_blocks * p.page_size_bytes * p.num_layers as u64);
    }
    req
}

/// The planner's verdict before loading: the plan, or why the model cannot run here: one request
/// of the longest context does not fit the KV blocks (vLLM's refusal), or the weights, the
/// activation peak and the KV blocks together exceed what the device may use (vLLM checks no such
/// sum when `--kv-cache-memory` is given; a tab would fail while loading instead).
pub fn verdict(info: &CheckpointInfo, device: &Device, s: Settings) -> Result<Plan, String> {
    let p = plan(&plan_request(info, image_limits(info, s)?, device, s)).map_err(|e| e.to_string())?;
    let kv = p.available_kv_bytes.max(0) as u64;
    let total = p.non_kv_bytes.saturating_add(kv);
    if !p.fits {
        Err(format!(
            "{} (a tiny model's KV cache in MiB: {} needed, {} available)",
            p.verdict(),
            size(p.needed_kv_bytes),
            size(kv)
        ))
    } else if total > p.requested_bytes {
        Err(format!(
            "Does not fit on {}: weights {} + activations {} + KV cache {} = {}, more than the {} it may use ({} of {}). Try fewer KV blocks, a smaller context or a smaller checkpoint.",
            p.device,
            size(p.weights_bytes),
            size(p.activation_peak_bytes + p.non_torch_bytes),
            size(kv),
            size(total),
            size(p.requested_bytes),
            p.gpu_memory_utilization,
            size(p.total_bytes)
        ))
    } else {
        Ok(p)
    }
}

/// Loading progress: tensors and bytes converted so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Progress {
    /// Tensors on the device.
    pub tensors: usize,
    /// Checkpoint bytes read.
    pub bytes: u64,
    /// Checkpoint bytes in all, when known.
    pub total_bytes: Option<u64>,
}

/// Called with each request's tokens as they come.
type TokenSink = Box<dyn FnMut(&TokenEvent)>;

/// A loaded model, its input processor and its engine, shared by the page's handlers.
pub struct Local {
    engine: RefCell<Engine>,
    /// The checkpoint's tokenizer, template and image settings.
    pub input: InputProcessor,
    /// How start-up sized the engine.
    pub report: StartupReport,
    /// The backend, in words.
    pub device: String,
    sinks: RefCell<HashMap<RequestId, TokenSink>>,
    stepping: Cell<bool>,
    /// A lesson holds the engine: requests, aborts, resets and loads are turned away until it ends.
    in_lesson: Cell<bool>,
    seq: Cell<u64>,
    on_step: Box<dyn Fn(Occupancy)>,
    on_error: Box<dyn Fn(String)>,
}

impl std::fmt::Debug for Local {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Local")
            .field("device", &self.device)
            .finish_non_exhaustive()
    }
}

fn now_s() -> f64 {
    js_sys::Date::now() / 1e3
}

/// This tab's side of [`ProcessMemory`]: the engine's wasm memory (the browser tells no RSS).
fn tab_memory() -> ProcessMemory {
    let memory: js_sys::WebAssembly::Memory = wasm_bindgen::JsCast::unchecked_into(wasm_bindgen::memory());
    let buffer: js_sys::ArrayBuffer = wasm_bindgen::JsCast::unchecked_into(memory.buffer());
    ProcessMemory {
        resident_bytes: None,
        wasm_memory_bytes: Some(buffer.byte_length() as u64),
    }
}

/// What `ledger` holds, for an error message: the memory at the moment something failed.
fn held(ledger: &MemoryLedger) -> String {
    let entries = ledger
        .entries()
        .iter()
        .filter(|l| l.bytes > 0)
        .map(|l| format!("{:?} {}", l.category, size(l.bytes)))
        .collect::<Vec<_>>();
    format!("Ledger at that moment: {}", entries.join(", "))
}

/// A checkpoint streamed from its source onto whichever backend [`open`] made: each tensor
/// converted as soon as its bytes are in.
struct Streamed<'a> {
    source: &'a Source,
    info: &'a CheckpointInfo,
    progress: &'a dyn Fn(Progress),
}

impl ModelSource for Streamed<'_> {
    async fn load_onto<B: Backend + 'static>(self, backend: B) -> Result<Box<dyn StepRunner>, String> {
        let (info, progress) = (self.info, self.progress);
        let files: Vec<(String, Option<u64>)> = match &info.weights {
            Weights::Safetensors(shards) => shards.clone(),
            Weights::Gguf { text, mmproj } => std::iter::once(text)
                .chain(mmproj)
                .map(|f| (f.name.clone(), Some(f.len)))
                .collect(),
        };
        let known: Option<u64> = files.iter().map(|(_, s)| *s).sum();
        let total = Rc::new(Cell::new(known.unwrap_or(0)));
        // Unknown as soon as one file's size is (a response without Content-Length).
        let total_known = Rc::new(Cell::new(true));
        let read = Rc::new(Cell::new(0u64));
        let report = |tensors: usize| {
            progress(Progress {
                tensors,
                bytes: read.get(),
                total_bytes: total_known.get().then(|| total.get()),
            })
        };
        let mut stream = StreamLoader::new(info.config.clone(), &backend, |tensors, _| report(tensors))
            .map_err(|e| e.to_string())?;
        let gguf = match &info.weights {
            Weights::Gguf { text, mmproj } => {
                let tensors = gguf_model(text, mmproj.as_ref())?
                    .tensors()
                    .map_err(|e| e.to_string())?;
                let parts: Vec<(&GgufFile, Part)> = std::iter::once((text, Part::Text))
                    .chain(mmproj.iter().map(|m| (m, Part::Mmproj)))
                    .collect();
                Some((tensors, parts))
            }
            Weights::Safetensors(_) => None,
        };
        for (i, (name, size)) in files.iter().enumerate() {
            match &gguf {
                Some((tensors, parts)) => {
                    let (file, part) = parts[i];
                    stream.begin_gguf(name.clone(), &file.header, part, tensors)
                }
                None => stream.begin_shard(name.clone()),
            }
            .map_err(|e| e.to_string())?;
            let length = |l: Option<u64>| match (size, l) {
                (Some(_), _) => {}
                (None, Some(l)) => total.set(total.get() + l),
                (None, None) => total_known.set(false),
            };
            self.source
                .stream(name, length, |chunk| {
                    read.set(read.get() + chunk.len() as u64);
                    stream.push(chunk).map_err(|e| e.to_string())
                })
                .await
                .map_err(|e| {
                    format!(
                        "{e}. {}. Try a smaller checkpoint or fewer KV blocks.",
                        held(backend.ledger())
                    )
                })?;
        }
        let model = stream
            .finish()
            .map_err(|e| format!("{e}. {}", held(backend.ledger())))?;
        Ok(Box::new(ModelRunner::new(backend, model)))
    }
}

impl Local {
    /// Loads the checkpoint from `source` onto `device` and starts the engine; `on_step` gets the
    /// occupancy after every step (and after resets), `on_error` a failed step's error.
    pub async fn load(
        source: &Source,
        info: &CheckpointInfo,
        device: &Device,
        s: Settings,
        progress: &dyn Fn(Progress),
        on_step: Box<dyn Fn(Occupancy)>,
        on_error: Box<dyn Fn(String)>,
    ) -> Result<Rc<Local>, String> {
        let mut input = InputProcessor::new(
            &info.tokenizer_json,
            &info.chat_template,
            &info.config,
            info.preprocessor_json.as_deref(),
            info.eos.clone(),
        )
        .map_err(|e| e.to_string())?;
        input.settings.limits = image_limits(info, s)?;
        let kind = match device {
            Device::WebGpu(page_device) => {
                // The model gets a device of its own; the page's gives back the buffers an
                // earlier model left in its pool.
                page_device.release_pooled();
                BackendKind::Wgpu
            }
            Device::Cpu(_) => BackendKind::Cpu,
        };
        let choice = BackendChoice::new(kind, None, weight_format(info, s))?;
        let streamed = Streamed { source, info, progress };
        let runner = open(&choice, MemoryLedger::new(), streamed).await?;
        // What the model runs on, for the status line.
        let described = match device {
            Device::WebGpu(_) => format!("WebGPU: {}", runner.describe()),
            Device::Cpu(_) => device.describe(),
        };
        let req = plan_request(info, input.settings.limits, device, s);
        let opts = EngineOptions {
            enable_prefix_caching: true,
            long_prefill_token_threshold: 0,
            max_num_partial_prefills: 1,
            vocab_size: input.tokenizer.vocab_size(),
        };
        let (engine, report) = build_engine(runner, req, opts, &now_s)
            .await
            .map_err(|e| e.to_string())?;
        report.size_input(&mut input);
        input.limit_images = s.images_per_prompt;
        let local = Rc::new(Local {
            engine: RefCell::new(engine),
            input,
            report,
            device: described,
            sinks: RefCell::new(HashMap::new()),
            stepping: Cell::new(false),
            in_lesson: Cell::new(false),
            seq: Cell::new(0),
            on_step,
            on_error,
        });
        local.publish();
        Ok(local)
    }

    /// The budget the memory view draws against.
    pub fn budget(&self) -> Budget {
        let p = &self.report.plan;
        Budget {
            total_bytes: p.total_bytes,
            requested_bytes: p.requested_bytes,
            kv_cache_bytes: p.available_kv_bytes.max(0) as u64,
        }
    }

    fn publish(&self) {
        self.seq.set(self.seq.get() + 1);
        let occupancy = Occupancy::of(
            &self.engine.borrow(),
            &self.input,
            self.seq.get(),
            now_s(),
            tab_memory(),
        );
        (self.on_step)(occupancy);
    }

    /// Queues a request; `sink` gets its tokens. Steps run until every request has finished.
    pub fn submit(self: &Rc<Self>, request: Request, sink: TokenSink) -> Result<(), String> {
        if self.in_lesson.get() {
            return Err(BUSY_WITH_LESSON.into());
        }
        let id = request.id.clone();
        self.engine
            .borrow_mut()
            .add_request(request)
            .map_err(|e| e.to_string())?;
        self.sinks.borrow_mut().insert(id, sink);
        self.publish();
        if !self.stepping.replace(true) {
            let this = Rc::clone(self);
            wasm_bindgen_futures::spawn_local(async move { this.drive().await });
        }
        Ok(())
    }

    /// Steps while anything is unfinished, awaiting each read with the engine free, so aborts and
    /// resets land between the halves of a step.
    async fn drive(self: Rc<Self>) {
        loop {
            let launched = {
                let mut engine = self.engine.borrow_mut();
                if !engine.has_unfinished() {
                    break;
                }
                engine.launch()
            };
            let events = match launched {
                Ok(None) => Ok(Vec::new()),
                Ok(Some(step)) => {
                    let (meta, read) = step.into_parts();
                    let values = match read {
                        Some(read) => Some(read.await),
                        None => None,
                    };
                    self.engine.borrow_mut().complete(meta, values.transpose())
                }
                Err(e) => Err(e),
            };
            match events {
                Ok(events) => {
                    for e in &events {
                        let mut sinks = self.sinks.borrow_mut();
                        if let Some(sink) = sinks.get_mut(&e.id) {
                            sink(e);
                        }
                        if e.finish.is_some() {
                            sinks.remove(&e.id);
                        }
                    }
                }
                Err(e) => {
                    // The engine has dropped every request and emptied its caches.
                    self.sinks.borrow_mut().clear();
                    let held = held(self.engine.borrow().ledger());
                    (self.on_error)(format!("{e}. {held}. Try a shorter context or fewer images."));
                }
            }
            self.publish();
            // Let the page draw between steps even when a read resolved at once (CPU backend).
            yield_to_browser().await;
        }
        self.stepping.set(false);
    }

    /// Stops a request (its blocks and encoder references are returned at once).
    pub fn abort(&self, id: &RequestId) {
        if self.in_lesson.get() {
            return;
        }
        let _ = self.engine.borrow_mut().abort(id);
        self.sinks.borrow_mut().remove(id);
        self.publish();
    }

    /// Runs `lesson`'s live steps on this engine; `on_setting` hears what it runs on, `on_step` each
    /// finished step. Refused while
    /// requests are unfinished.
    // The engine stays borrowed across the lesson's awaits: `in_lesson` turns every other borrower
    // (submit, abort, reset) away until it ends, and `drive` runs only while requests are unfinished.
    #[allow(clippy::await_holding_refcell_ref)]
    pub async fn lesson(
        &self,
        lesson: &Lesson,
        on_setting: &dyn Fn(&str),
        on_step: &dyn Fn(usize, &Step),
    ) -> Result<(), String> {
        if self.in_lesson.get() || self.stepping.get() {
            return Err("the engine is busy: wait until the replies (or the lesson) end".into());
        }
        self.in_lesson.set(true);
        let ran = {
            let mut engine = self.engine.borrow_mut();
            let mut watch = |w: Watch<'_>| match w {
                Watch::Stepped(e) => {
                    self.seq.set(self.seq.get() + 1);
                    (self.on_step)(Occupancy::of(e, &self.input, self.seq.get(), now_s(), tab_memory()));
                }
                Watch::Done(i, step) => on_step(i, step),
                Watch::Setting(said) => on_setting(said),
            };
            let bench = Bench {
                engine: &mut engine,
                input: &self.input,
                profile: &self.report.profile,
                profiled_images: self.report.plan.encoder_profile_items,
            };
            run_live(lesson, bench, &mut watch).await
        };
        self.in_lesson.set(false);
        ran.map(drop).map_err(|e| e.to_string())
    }

    /// Whether a lesson holds the engine.
    pub fn in_lesson(&self) -> bool {
        self.in_lesson.get()
    }

    /// Empties one cache; says what it freed.
    pub fn reset(&self, kind: ResetKind) -> String {
        if self.in_lesson.get() {
            return BUSY_WITH_LESSON.into();
        }
        let said = match kind {
            ResetKind::Prefix => match self.engine.borrow_mut().reset_prefix_cache() {
                Ok(()) => "prefix cache reset: cached blocks are free blocks now".to_string(),
                Err(e) => format!("prefix cache not reset: {e}"),
            },
            ResetKind::Encoder => {
                let freed = self.engine.borrow_mut().reset_encoder_cache();
                format!("encoder cache reset: {} freed on the device", size(freed))
            }
            ResetKind::Processor => {
                let mut cache = self.input.processor_cache.lock().unwrap_or_else(|p| p.into_inner());
                let entries = cache.len();
                let freed = cache.clear();
                format!(
                    "processor cache reset (what vLLM's /reset_mm_cache does): {entries} preprocessed images, {} of host memory; the encoder cache on the device is untouched",
                    size(freed)
                )
            }
        };
        self.publish();
        said
    }
}

/// What a request, an abort or a reset gets while a lesson runs.
const BUSY_WITH_LESSON: &str = "a lesson is running; try again when it ends";

/// Gives the worker's event loop a turn, for the page's messages (a resolved promise is a
/// microtask: a zero timeout is not).
async fn yield_to_browser() {
    let promise = js_sys::Promise::new(&mut |resolve, _| {
        let scope: web_sys::WorkerGlobalScope = wasm_bindgen::JsCast::unchecked_into(js_sys::global());
        let _ = scope.set_timeout_with_callback_and_timeout_and_arguments_0(&resolve, 0);
    });
    let _ = wasm_bindgen_futures::JsFuture::from(promise).await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvlens_engine::arch::config::ModelConfig;

    fn demo_info() -> CheckpointInfo {
        let config = ModelConfig::from_json(include_str!("../../tools/golden/configs/qwen3_vl_tiny.json")).unwrap();
        CheckpointInfo {
            eos: config.tokens.eos.clone(),
            config,
            tokenizer_json: Vec::new(),
            chat_template: String::new(),
            preprocessor_json: None,
            weights: Weights::Safetensors(Vec::new()),
        }
    }

    #[test]
    fn the_kv_blocks_setting_gives_that_many_blocks() {
        let device = Device::Cpu("test".into());
        let p = verdict(&demo_info(), &device, Settings::default()).unwrap();
        assert_eq!(p.num_gpu_blocks, 256);
        assert_eq!(
            p.max_model_len, 4096,
            "256 blocks of 16 tokens hold the demo model's whole length"
        );
        let small = Settings {
            kv_blocks: 64,
            ..Settings::default()
        };
        let too_many = Settings {
            kv_blocks: 1 << 20,
            ..Settings::default()
        };
        let over = verdict(&demo_info(), &device, too_many).unwrap_err();
        assert!(over.contains("more than the") && over.contains("KV cache"), "{over}");
        let refused = verdict(&demo_info(), &device, small).unwrap_err();
        assert!(
            refused.contains("Does not fit") && refused.contains("1,024"),
            "{refused}"
        );
    }

    /// A tab without WebGPU profiles a smaller step (a smaller activation peak, still room for a
    /// whole image), unless the user already chose the step's size.
    #[test]
    fn the_cpu_fallback_profiles_a_smaller_step() {
        let device = Device::Cpu("test".into());
        let mut cpu = Settings::default();
        cpu.for_cpu_fallback();
        assert_eq!(cpu.max_num_batched_tokens, Settings::CPU_FALLBACK_TOKENS_PER_STEP);
        assert!(cpu.max_num_batched_tokens as u64 >= cpu.max_image_tokens);
        let peak = |s| verdict(&demo_info(), &device, s).unwrap().activation_peak_bytes;
        assert!(
            peak(cpu) < peak(Settings::default()),
            "{} vs {}",
            peak(cpu),
            peak(Settings::default())
        );
        let mut chosen = Settings {
            max_num_batched_tokens: 4096,
            ..Settings::default()
        };
        chosen.for_cpu_fallback();
        assert_eq!(chosen.max_num_batched_tokens, 4096);
    }
}
