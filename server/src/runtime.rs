//! A model ready to run: the checkpoint loaded onto a backend, its tokenizer, chat template and
//! image processor, and the step from OpenAI messages to an engine request.

use crate::checkpoint::{Checkpoint, WeightFiles};
use crate::preprocess::{Busy, PreprocessBudget};
use crate::usage;
use anyhow::Result;
use kvlens_engine::backend::{block_on, Backend};
use kvlens_engine::builder::{open, BackendChoice, ModelSource};
use kvlens_engine::engine::Request;
use kvlens_engine::input::chat::{select_chat_template, ChatMessage, ChatTemplate};
use kvlens_engine::input::image::ProcessedImage;
use kvlens_engine::input::image_budget::largest_preprocessing_bytes;
pub use kvlens_engine::input::processor::PromptOptions;
use kvlens_engine::input::processor::{InputHost, InputProcessor, Prompt};
use kvlens_engine::input::InputError;
use kvlens_engine::memory::device::{device_preset, gib_to_bytes, DeviceProfile};
use kvlens_engine::memory::ledger::{Category, MemoryLedger};
use kvlens_engine::model::gguf_tensors::GgufTensors;
use kvlens_engine::model::weights::SafetensorsFiles;
use kvlens_engine::model::QwenVl;
use kvlens_engine::runner::{ModelRunner, StepRunner};
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

/// The device start-up sizes the engine for, and the memory on it that is not the engine's (vLLM's
/// non-torch memory): the CPU "device" of `cpu_memory_gib` with nothing else on it, or a device
/// with memory of its own as its driver sees it after loading, less the weights (the CUDA
/// context, cuBLAS's workspace and other processes).
pub fn device_of(runner: &dyn StepRunner, cpu_memory_gib: Option<f64>) -> Result<(DeviceProfile, u64)> {
    match runner.device_memory() {
        Some(memory) => {
            let m = memory.map_err(|e| usage(e.to_string()))?;
            let device = kvlens_engine::memory::device::cuda_device(&runner.describe(), m.total);
            // Called after loading, when the weights are all the backend holds.
            let weights = runner.ledger().bytes(Category::Weights);
            let used = m.total.saturating_sub(m.free);
            Ok((device, used.saturating_sub(weights)))
        }
        None => Ok((cpu_device(cpu_memory_gib)?, 0)),
    }
}

/// Total RAM from /proc/meminfo (None where it cannot be read).
fn machine_ram_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The CPU "device": `--cpu-memory-gib` of memory, or 40% of the machine's RAM.
fn cpu_device(gib: Option<f64>) -> Result<DeviceProfile> {
    let total = match gib {
        Some(g) if g > 0.0 && g.is_finite() => gib_to_bytes(g),
        Some(g) => return Err(usage(format!("--cpu-memory-gib must be positive, got {g}"))),
        None => machine_ram_bytes().unwrap_or(8 << 30) / 5 * 2,
    };
    let preset = device_preset("cpu").ok_or_else(|| anyhow::anyhow!("the cpu device preset is missing"))?;
    Ok(preset.with_total_bytes(total))
}

/// A checkpoint's memory-mapped shards, loaded onto a backend tensor by tensor (each converted as
/// it goes) with a progress bar.
struct ShardFiles<'a> {
    ckpt: &'a Checkpoint,
}

impl ModelSource for ShardFiles<'_> {
    async fn load_onto<B: Backend + 'static>(self, backend: B) -> std::result::Result<Box<dyn StepRunner>, String> {
        let (ckpt, started) = (self.ckpt, Instant::now());
        tracing::info!("{}", backend.describe());
        let bar = indicatif::ProgressBar::new(ckpt.weight_bytes());
        bar.set_style(
            indicatif::ProgressStyle::with_template("loading weights {bar:30} {bytes}/{total_bytes}, {msg}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        let progress = |_, bytes| bar.set_position(bytes);
        let model = match &ckpt.weights {
            WeightFiles::Safetensors(shards) => {
                let shards: Vec<(String, &[u8])> = shards.iter().map(|(n, m)| (n.clone(), &m[..])).collect();
                let source = SafetensorsFiles::parse(&shards).map_err(|e| e.to_string())?;
                QwenVl::load(ckpt.config.clone(), &source, &backend, progress)
            }
            WeightFiles::Gguf(pair) => {
                let model = pair.model().map_err(|e| e.to_string())?;
                let source = GgufTensors::new(&model, &pair.text.0, pair.mmproj_bytes()).map_err(|e| e.to_string())?;
                QwenVl::load(ckpt.config.clone(), &source, &backend, progress)
            }
        }
        .map_err(|e| e.to_string())?;
        bar.finish_and_clear();
        let weights = backend.ledger().bytes(Category::Weights);
        tracing::info!(
            "Loading model weights took {:.4} GiB and {:.2} seconds",
            weights as f64 / (1u64 << 30) as f64,
            started.elapsed().as_secs_f64()
        );
        Ok(Box::new(ModelRunner::new(backend, model)))
    }
}

/// Opens the backend, loads the weights onto it and builds the frontend.
/// `mmproj` is a GGUF model's projector (see [`Checkpoint::open`]).
pub fn load(model: &Path, mmproj: Option<&Path>, mut choice: BackendChoice) -> Result<(Box<dyn StepRunner>, Frontend)> {
    let ckpt = Checkpoint::open(model, mmproj)?;
    let ledger = MemoryLedger::new();
    choice.adapter = std::env::var("KVLENS_WGPU_ADAPTER").ok().filter(|s| !s.is_empty());
    let opened = block_on(open(&choice, ledger.clone(), ShardFiles { ckpt: &ckpt }));
    let runner = opened.map_err(usage)?;
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
