//! A model ready to run: the checkpoint loaded onto a backend, its tokenizer, chat template and
//! image processor, and the step from OpenAI messages to an engine request.

use crate::checkpoint::Checkpoint;
use crate::preprocess::{Busy, PreprocessBudget};
use crate::UsageError;
use anyhow::Result;
use kvlens_engine::arch::config::ModelConfig;
use kvlens_engine::arch::weight_format::WeightFormat;
use kvlens_engine::backend::cpu::CpuBackend;
#[cfg(feature = "cuda")]
use kvlens_engine::backend::cuda::{CudaBackend, CudaOptions};
use kvlens_engine::backend::wgpu::{WgpuBackend, WgpuOptions};
use kvlens_engine::backend::{Backend, BackendKind};
use kvlens_engine::builder::{build_engine, BuildError, EngineOptions, StartupReport};
use kvlens_engine::engine::{Engine, Request};
use kvlens_engine::input::chat::{select_chat_template, ChatMessage, ChatTemplate};
use kvlens_engine::input::image::ProcessedImage;
use kvlens_engine::input::image_budget::largest_preprocessing_bytes;
pub use kvlens_engine::input::processor::PromptOptions;
use kvlens_engine::input::processor::{InputHost, InputProcessor, Prompt};
use kvlens_engine::input::InputError;
use kvlens_engine::memory::device::DeviceProfile;
use kvlens_engine::memory::ledger::{Category, MemoryLedger};
use kvlens_engine::memory::planner::PlanRequest;
use kvlens_engine::model::weights::SafetensorsFiles;
use kvlens_engine::model::QwenVl;
use kvlens_engine::runner::ModelRunner;
use kvlens_engine::sample::SamplingParams;
use std::ops::{Deref, DerefMut};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Default host-memory budget of image preprocessing (raised to fit the largest allowed image).
pub const DEFAULT_PREPROCESS_BYTES: u64 = 1 << 30;
/// How long an image waits for room in the preprocessing budget before its request is refused.
const PREPROCESS_WAIT: Duration = Duration::from_secs(60);

/// The engine's [`InputProcessor`] plus what only the server has: the host-memory budget of image
/// preprocessing and local files. It dereferences to the processor, so its settings read and
/// write as fields (`frontend.tokenizer`, `frontend.max_model_len`); its own `prompt`, `request`,
/// `completion_request` and `encode_if_it_can_fit` come first: they hold the budget, read local
/// images and return the server's errors ([`UsageError`], or [`Busy`] when the budget stays full).
#[derive(Debug)]
pub struct Frontend {
    /// Messages to requests, tokens to text.
    pub input: InputProcessor,
    /// Host memory that images being preprocessed may hold at once.
    pub preprocess_budget: PreprocessBudget,
}

impl Deref for Frontend {
    type Target = InputProcessor;

    fn deref(&self) -> &InputProcessor {
        &self.input
    }
}

impl DerefMut for Frontend {
    fn deref_mut(&mut self) -> &mut InputProcessor {
        &mut self.input
    }
}

/// Set when a request's client has gone: its tokenizing and preprocessing stop at the next check.
/// Clones share the flag.
#[derive(Debug, Clone, Default)]
pub struct Cancel(Arc<AtomicBool>);

impl Cancel {
    /// Cancels the work that watches this flag.
    pub fn cancel(&self) {
        self.0.store(true, Ordering::Relaxed);
    }

    /// Whether [`Cancel::cancel`] was called.
    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

/// The server's [`InputHost`]: local images from the filesystem, each image's decode and
/// preprocessing and each tokenization within the preprocessing budget, and the request's
/// cancellation.
struct ServerHost<'a> {
    budget: &'a PreprocessBudget,
    cancel: &'a Cancel,
}

impl InputHost for ServerHost<'_> {
    fn read_path(&mut self, path: &str) -> Result<Vec<u8>, InputError> {
        std::fs::read(path).map_err(|e| InputError::ReadImage {
            path: path.to_string(),
            reason: e.to_string(),
        })
    }

    fn preprocess(
        &mut self,
        bytes: u64,
        work: &mut dyn FnMut() -> Result<Arc<ProcessedImage>, InputError>,
    ) -> Result<Arc<ProcessedImage>, InputError> {
        let _reserved = self
            .budget
            .reserve(Category::Staging, bytes)
            .map_err(|Busy(why)| InputError::Busy(why))?;
        work()
    }

    fn tokenize(
        &mut self,
        bytes: u64,
        work: &mut dyn FnMut() -> Result<Vec<u32>, InputError>,
    ) -> Result<Vec<u32>, InputError> {
        // At most half the budget, so that a request holding its body can always tokenize.
        let _reserved = self
            .budget
            .reserve(Category::Requests, bytes.min(self.budget.capacity() / 2))
            .map_err(|Busy(why)| InputError::Busy(why))?;
        work()
    }

    fn cancelled(&self) -> bool {
        self.cancel.is_cancelled()
    }
}

/// An input error as the server reports it: [`Busy`] (503) when the preprocessing budget stayed
/// full, else a [`UsageError`] (400, exit code 2) with the error's message.
fn input_error(e: InputError) -> anyhow::Error {
    match e {
        InputError::Busy(why) => Busy(why).into(),
        InputError::Cancelled => {
            tracing::info!("Stopped tokenizing and preprocessing a request: its client went away");
            usage(e.to_string())
        }
        e => usage(e.to_string()),
    }
}

fn usage(msg: impl Into<String>) -> anyhow::Error {
    UsageError(msg.into()).into()
}

/// Which backend to load onto and how.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackendChoice {
    /// The backend.
    pub kind: BackendKind,
    /// Keep 2-D weights in half precision (wgpu: f16; cuda and cpu: bf16); activations stay f32.
    pub f16_weights: bool,
    /// Weight matrices quantized on load (`--quantization`; the CPU and wgpu backends).
    pub quantization: WeightFormat,
}

/// A checkpoint's weights on the chosen backend, in its model runner.
#[derive(Debug)]
pub enum LoadedRunner {
    /// On the CPU backend.
    Cpu(ModelRunner<CpuBackend>),
    /// On the wgpu backend.
    Wgpu(ModelRunner<WgpuBackend>),
    /// On the CUDA backend (boxed: its kernel table makes it the largest variant).
    #[cfg(feature = "cuda")]
    Cuda(Box<ModelRunner<CudaBackend>>),
}

impl LoadedRunner {
    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        match self {
            LoadedRunner::Cpu(r) => &r.model().cfg,
            LoadedRunner::Wgpu(r) => &r.model().cfg,
            #[cfg(feature = "cuda")]
            LoadedRunner::Cuda(r) => &r.model().cfg,
        }
    }

    /// The device start-up sizes the engine for, and the memory on it that is not the engine's
    /// (vLLM's non-torch memory): the CPU "device" of `cpu_memory_gib` with nothing else on it,
    /// or the GPU as `cuMemGetInfo` sees it after loading, less the weights (the CUDA context,
    /// cuBLAS's workspace and other processes).
    pub fn device(&self, cpu_memory_gib: Option<f64>) -> Result<(DeviceProfile, u64)> {
        #[cfg(feature = "cuda")]
        if let LoadedRunner::Cuda(r) = self {
            let be = r.backend();
            let m = be.memory().map_err(|e| usage(e.to_string()))?;
            let device = kvlens_engine::memory::device::cuda_device(be.device_name(), m.total);
            // Called after loading, when the weights are all the backend holds.
            let weights = be.ledger().bytes(kvlens_engine::memory::ledger::Category::Weights);
            let used = m.total.saturating_sub(m.free);
            return Ok((device, used.saturating_sub(weights)));
        }
        Ok((crate::startup::cpu_device(cpu_memory_gib)?, 0))
    }

    /// Profiles, sizes and builds the engine (see [`build_engine`]).
    pub fn build(
        self,
        req: PlanRequest,
        opts: EngineOptions,
        seconds: &dyn Fn() -> f64,
    ) -> Result<(Engine, StartupReport), BuildError> {
        match self {
            LoadedRunner::Cpu(r) => build_engine(r, req, opts, seconds),
            LoadedRunner::Wgpu(r) => build_engine(r, req, opts, seconds),
            #[cfg(feature = "cuda")]
            LoadedRunner::Cuda(r) => build_engine(*r, req, opts, seconds),
        }
    }
}

/// Loads a checkpoint's weights onto `backend` tensor by tensor (memory-mapped shards, each
/// tensor converted as it goes) with a progress bar.
fn load_weights<B: Backend>(ckpt: &Checkpoint, backend: &B) -> Result<QwenVl<B>> {
    let started = Instant::now();
    let shards: Vec<(String, &[u8])> = ckpt.shards.iter().map(|(n, m)| (n.clone(), &m[..])).collect();
    let source = SafetensorsFiles::parse(&shards).map_err(|e| usage(e.to_string()))?;
    let bar = indicatif::ProgressBar::new(ckpt.weight_bytes());
    bar.set_style(
        indicatif::ProgressStyle::with_template("loading weights {bar:30} {bytes}/{total_bytes}, {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let model = QwenVl::load(ckpt.config.clone(), &source, backend, |_, bytes| {
        bar.set_position(bytes)
    })
    .map_err(|e| usage(e.to_string()))?;
    bar.finish_and_clear();
    let weights = backend.ledger().bytes(kvlens_engine::memory::ledger::Category::Weights);
    tracing::info!(
        "Loading model weights took {:.4} GiB and {:.2} seconds",
        weights as f64 / (1u64 << 30) as f64,
        started.elapsed().as_secs_f64()
    );
    Ok(model)
}

/// Opens the backend, loads the weights onto it and builds the frontend.
pub fn load(dir: &Path, choice: BackendChoice) -> Result<(LoadedRunner, Frontend)> {
    if choice.quantization != WeightFormat::Unquantized && choice.kind == BackendKind::Cuda {
        return Err(usage(format!(
            "--quantization {}: quantized weights run on the cpu and wgpu backends; the cuda backend keeps float32 or half-precision weights (--dtype)",
            choice.quantization
        )));
    }
    let ckpt = Checkpoint::open(dir)?;
    let ledger = MemoryLedger::new();
    let runner = match choice.kind {
        BackendKind::Wgpu => {
            let opts = WgpuOptions {
                f16_weights: choice.f16_weights,
                quantization: choice.quantization,
                adapter: std::env::var("KVLENS_WGPU_ADAPTER").ok().filter(|s| !s.is_empty()),
                ..WgpuOptions::default()
            };
            let backend = WgpuBackend::new_blocking(ledger.clone(), opts).map_err(|e| usage(e.to_string()))?;
            tracing::info!("{}", backend.describe());
            let model = load_weights(&ckpt, &backend)?;
            LoadedRunner::Wgpu(ModelRunner::new(backend, model))
        }
        BackendKind::Cpu => {
            let backend =
                CpuBackend::with_weights(ledger.clone(), choice.quantization).with_bf16_matrices(choice.f16_weights);
            let model = load_weights(&ckpt, &backend)?;
            LoadedRunner::Cpu(ModelRunner::new(backend, model))
        }
        #[cfg(feature = "cuda")]
        BackendKind::Cuda => {
            let opts = CudaOptions {
                ordinal: 0,
                bf16_weights: choice.f16_weights,
            };
            let backend = CudaBackend::new(ledger.clone(), opts).map_err(|e| usage(e.to_string()))?;
            tracing::info!("{}", backend.describe());
            let model = load_weights(&ckpt, &backend)?;
            LoadedRunner::Cuda(Box::new(ModelRunner::new(backend, model)))
        }
        #[cfg(not(feature = "cuda"))]
        BackendKind::Cuda => return Err(usage(BackendKind::Cuda.ensure_built().err().unwrap_or_default())),
    };
    let frontend = Frontend::new(&ckpt, ledger)?;
    Ok((runner, frontend))
}

impl Frontend {
    /// Builds the tokenizer, template and processor settings of a checkpoint; preprocessing
    /// memory is recorded in `ledger`.
    pub fn new(ckpt: &Checkpoint, ledger: MemoryLedger) -> Result<Self> {
        let t = &ckpt.template_files;
        let source = select_chat_template(t.jinja.as_deref(), t.json.as_deref(), t.tokenizer_config.as_deref())
            .map_err(|e| usage(e.to_string()))?
            .ok_or_else(|| usage(format!("{} has no chat template", ckpt.dir.display())))?;
        let input = InputProcessor::new(
            &ckpt.tokenizer_json,
            &source,
            &ckpt.config,
            ckpt.preprocessor_json.as_deref(),
            ckpt.eos_token_ids.clone(),
        )
        .map_err(input_error)?;
        let preprocess_budget = PreprocessBudget::new(
            DEFAULT_PREPROCESS_BYTES.max(largest_preprocessing_bytes(&input.settings)),
            ledger,
            PREPROCESS_WAIT,
        );
        Ok(Frontend {
            input,
            preprocess_budget,
        })
    }

    /// Replaces the checkpoint's chat template (`--chat-template FILE`).
    pub fn set_chat_template(&mut self, path: &Path) -> Result<()> {
        let source = std::fs::read_to_string(path)
            .map_err(|e| usage(format!("cannot read --chat-template {}: {e}", path.display())))?;
        self.input.template =
            ChatTemplate::new(&source).map_err(|e| usage(format!("--chat-template {}: {e}", path.display())))?;
        Ok(())
    }

    /// Sets the preprocessing budget to `bytes`, raised to what the largest image the settings
    /// accept needs (so every acceptable image fits alone).
    pub fn set_preprocess_budget(&mut self, bytes: u64) {
        let bytes = bytes.max(largest_preprocessing_bytes(&self.input.settings));
        self.preprocess_budget = self.preprocess_budget.with_capacity(bytes);
    }

    /// The server's input host for one request.
    fn host<'a>(&'a self, cancel: &'a Cancel) -> ServerHost<'a> {
        ServerHost {
            budget: &self.preprocess_budget,
            cancel,
        }
    }

    /// [`InputProcessor::prompt`], each image preprocessed and the text tokenized within the
    /// budget (a [`Busy`] error when it stays full), local paths read from the filesystem when
    /// `options.allow_files`, stopped when `cancel` is set.
    pub fn prompt(&self, messages: &[ChatMessage], options: PromptOptions, cancel: &Cancel) -> Result<Prompt> {
        self.input
            .prompt(messages, options, &mut self.host(cancel))
            .map_err(input_error)
    }

    /// [`InputProcessor::request`] (see [`Frontend::prompt`]), and the images' `(t, h, w)` grids.
    pub fn request(
        &self,
        id: &str,
        messages: &[ChatMessage],
        params: SamplingParams,
        allow_files: bool,
        cancel: &Cancel,
    ) -> Result<(Request, Vec<[u32; 3]>)> {
        let request = self
            .input
            .request(id, messages, params, allow_files, &mut self.host(cancel))
            .map_err(input_error)?;
        let grids = request.images.iter().map(|i| i.grid_thw.map(|g| g as u32)).collect();
        Ok((request, grids))
    }

    /// [`InputProcessor::completion_request`] (see [`Frontend::prompt`]).
    pub fn completion_request(
        &self,
        id: &str,
        prompt: &str,
        params: SamplingParams,
        cancel: &Cancel,
    ) -> Result<Request> {
        self.input
            .completion_request(id, prompt, params, &mut self.host(cancel))
            .map_err(input_error)
    }

    /// [`InputProcessor::encode_if_it_can_fit`] (see [`Frontend::prompt`]).
    pub fn encode_if_it_can_fit(&self, text: &str, add_special_tokens: bool, cancel: &Cancel) -> Result<Vec<u32>> {
        self.input
            .encode_if_it_can_fit(text, add_special_tokens, &mut self.host(cancel))
            .map_err(input_error)
    }
}
