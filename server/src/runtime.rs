//! A model ready to run: the checkpoint loaded onto a backend, its tokenizer, chat template and
//! image processor, and the step from OpenAI messages to an engine request.

use crate::checkpoint::Checkpoint;
use crate::preprocess::PreprocessBudget;
use crate::UsageError;
use anyhow::Result;
use kvlens_engine::backend::cpu::CpuBackend;
use kvlens_engine::backend::Backend;
use kvlens_engine::cache::ProcessorCache;
use kvlens_engine::cache::{MmHash, RequestId};
use kvlens_engine::engine::{ImageInput, Request};
use kvlens_engine::input::chat::{
    image_sources, select_chat_template, ChatMessage, ChatTemplate, ImageSource, RenderOptions,
};
use kvlens_engine::input::image::{decode_image, ProcessedImage, ProcessorSettings};
use kvlens_engine::input::image_budget::{largest_preprocessing_bytes, preprocessing_bytes};
use kvlens_engine::input::prompt::{expand_image_pads, ImagePlaceholder};
use kvlens_engine::input::tokenizer::Tokenizer;
use kvlens_engine::memory::ledger::MemoryLedger;
use kvlens_engine::model::weights::SafetensorsFiles;
use kvlens_engine::model::QwenVl;
use kvlens_engine::sample::SamplingParams;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Default host-memory budget of image preprocessing (raised to fit the largest allowed image).
pub const DEFAULT_PREPROCESS_BYTES: u64 = 1 << 30;
/// How long an image waits for room in the preprocessing budget before its request is refused.
const PREPROCESS_WAIT: Duration = Duration::from_secs(60);

/// Everything that turns messages into engine requests and tokens into text.
#[derive(Debug)]
pub struct Frontend {
    /// The tokenizer.
    pub tokenizer: Tokenizer,
    /// The chat template.
    pub template: ChatTemplate,
    /// Image preprocessing settings.
    pub settings: ProcessorSettings,
    /// `<|image_pad|>`.
    pub image_pad: u32,
    /// End-of-sequence ids (generation_config.json).
    pub eos: Vec<u32>,
    /// Most images per prompt (`--limit-mm-per-prompt`).
    pub limit_images: usize,
    /// Most tokens one image may have: what the start-up profile measured.
    pub max_image_tokens: usize,
    /// Preprocessed images by mm hash (`--mm-processor-cache-gb`).
    pub processor_cache: Mutex<ProcessorCache<Arc<ProcessedImage>>>,
    /// Longest prompt plus output (`max_model_len`): texts that cannot fit are refused before
    /// they are tokenized.
    pub max_model_len: usize,
    /// See [`Tokenizer::max_token_bytes`].
    max_token_bytes: usize,
    /// Host memory that images being preprocessed may hold at once.
    pub preprocess_budget: PreprocessBudget,
}

/// A conversation as the engine sees it.
#[derive(Debug)]
pub struct Prompt {
    /// Token ids, each image's placeholder expanded to the image's token count.
    pub ids: Vec<u32>,
    /// The preprocessed images and where their placeholders sit, in prompt order.
    pub images: Vec<(Arc<ProcessedImage>, ImagePlaceholder)>,
}

/// How [`Frontend::prompt`] renders and reads a conversation.
#[derive(Debug, Clone, Copy, Default)]
pub struct PromptOptions {
    /// The chat template's settings.
    pub render: RenderOptions,
    /// Add the tokenizer's post-processor tokens (a BOS, …) around the rendered text, which
    /// already holds the template's own special tokens (vLLM's `add_special_tokens`, off for chats).
    pub add_special_tokens: bool,
    /// Read local image paths (the command line); the server refuses them.
    pub allow_files: bool,
    /// Leave the processor cache alone (vLLM's `/tokenize` does not fill it).
    pub skip_processor_cache: bool,
}

fn usage(msg: impl Into<String>) -> anyhow::Error {
    UsageError(msg.into()).into()
}

/// Loads the weights onto the CPU backend and builds the frontend.
pub fn load_cpu(dir: &Path) -> Result<(QwenVl<CpuBackend>, CpuBackend, Frontend)> {
    let ckpt = Checkpoint::open(dir)?;
    let backend = CpuBackend::new(MemoryLedger::new());
    let started = Instant::now();
    let shards: Vec<(String, &[u8])> = ckpt.shards.iter().map(|(n, m)| (n.clone(), &m[..])).collect();
    let source = SafetensorsFiles::parse(&shards).map_err(|e| usage(e.to_string()))?;
    let bar = indicatif::ProgressBar::new(ckpt.weight_bytes());
    bar.set_style(
        indicatif::ProgressStyle::with_template("loading weights {bar:30} {bytes}/{total_bytes}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let model = QwenVl::load(ckpt.config.clone(), &source, &backend, |_, bytes| {
        bar.set_position(bytes)
    })
    .map_err(|e| usage(e.to_string()))?;
    bar.finish_and_clear();
    let weights = backend.ledger().bytes(kvlens_engine::memory::ledger::Category::Weights);
    eprintln!(
        "Loading model weights took {:.4} GiB and {:.2} seconds",
        weights as f64 / (1u64 << 30) as f64,
        started.elapsed().as_secs_f64()
    );
    let frontend = Frontend::new(&ckpt, backend.ledger().clone())?;
    Ok((model, backend, frontend))
}

impl Frontend {
    /// Builds the tokenizer, template and processor settings of a checkpoint; preprocessing
    /// memory is recorded in `ledger`.
    pub fn new(ckpt: &Checkpoint, ledger: MemoryLedger) -> Result<Self> {
        let tokenizer =
            Tokenizer::from_bytes(&ckpt.tokenizer_json).map_err(|e| usage(format!("tokenizer.json: {e}")))?;
        let t = &ckpt.template_files;
        let source = select_chat_template(t.jinja.as_deref(), t.json.as_deref(), t.tokenizer_config.as_deref())
            .map_err(|e| usage(e.to_string()))?
            .ok_or_else(|| usage(format!("{} has no chat template", ckpt.dir.display())))?;
        let template = ChatTemplate::new(&source).map_err(|e| usage(format!("chat template: {e}")))?;
        let settings = ProcessorSettings::new(&ckpt.config, ckpt.preprocessor_json.as_deref())
            .map_err(|e| usage(format!("preprocessor_config.json: {e}")))?;
        Ok(Frontend {
            template,
            settings: settings.clone(),
            image_pad: ckpt.config.tokens.image,
            eos: ckpt.eos_token_ids.clone(),
            limit_images: usize::MAX,
            max_image_tokens: usize::MAX,
            processor_cache: Mutex::new(ProcessorCache::new(0)),
            max_model_len: usize::MAX,
            max_token_bytes: tokenizer.max_token_bytes(),
            tokenizer,
            preprocess_budget: PreprocessBudget::new(
                DEFAULT_PREPROCESS_BYTES.max(largest_preprocessing_bytes(&settings)),
                ledger,
                PREPROCESS_WAIT,
            ),
        })
    }

    /// Replaces the checkpoint's chat template (`--chat-template FILE`).
    pub fn set_chat_template(&mut self, path: &Path) -> Result<()> {
        let source = std::fs::read_to_string(path)
            .map_err(|e| usage(format!("cannot read --chat-template {}: {e}", path.display())))?;
        self.template =
            ChatTemplate::new(&source).map_err(|e| usage(format!("--chat-template {}: {e}", path.display())))?;
        Ok(())
    }

    /// Sets the preprocessing budget to `bytes`, raised to what the largest image the settings
    /// accept needs (so every acceptable image fits alone).
    pub fn set_preprocess_budget(&mut self, bytes: u64) {
        let bytes = bytes.max(largest_preprocessing_bytes(&self.settings));
        self.preprocess_budget = self.preprocess_budget.with_capacity(bytes);
    }

    /// Resizes the processor cache (0 turns it off), dropping what it held.
    pub fn set_processor_cache_bytes(&mut self, bytes: u64) {
        self.processor_cache = Mutex::new(ProcessorCache::new(bytes));
    }

    /// Decodes and preprocesses one image within the preprocessing budget (a
    /// [`crate::preprocess::Busy`] error when it stays full), through the processor cache unless
    /// `skip_cache`.
    fn image(&self, bytes: &[u8], skip_cache: bool) -> Result<Arc<ProcessedImage>> {
        let cost = preprocessing_bytes(bytes, &self.settings).map_err(|e| usage(e.to_string()))?;
        let _reserved = self.preprocess_budget.reserve(cost)?;
        let decoded = decode_image(bytes, &self.settings).map_err(|e| usage(e.to_string()))?;
        let cache = || self.processor_cache.lock().unwrap_or_else(|p| p.into_inner());
        if skip_cache {
            return Ok(Arc::new(
                decoded.process(&self.settings).map_err(|e| usage(e.to_string()))?,
            ));
        }
        if let Some(hit) = cache().get(&decoded.mm_hash).cloned() {
            return Ok(hit);
        }
        let processed = Arc::new(decoded.process(&self.settings).map_err(|e| usage(e.to_string()))?);
        let size = (processed.pixel_values.len() * 4) as u64;
        cache().insert(MmHash::from(processed.mm_hash.clone()), processed.clone(), size);
        Ok(processed)
    }

    /// Renders, tokenizes and preprocesses a conversation: the token ids the engine gets, image
    /// placeholders expanded, and the images. Remote URLs are refused (the server fetches the
    /// allowed ones first).
    pub fn prompt(&self, messages: &[ChatMessage], options: PromptOptions) -> Result<Prompt> {
        let text = self
            .template
            .render_with(messages, options.render)
            .map_err(|e| usage(e.to_string()))?;
        let ids = self.encode_if_it_can_fit(&text, options.add_special_tokens)?;
        let sources = image_sources(messages).map_err(|e| usage(e.to_string()))?;
        if sources.len() > self.limit_images {
            return Err(usage(format!(
                "At most {} image(s) may be provided in one prompt, got {}",
                self.limit_images,
                sources.len()
            )));
        }
        let mut processed = Vec::new();
        for src in sources {
            let bytes = match src {
                ImageSource::Bytes(b) => b,
                ImageSource::Path(p) if options.allow_files => {
                    std::fs::read(&p).map_err(|e| usage(format!("cannot read image {p}: {e}")))?
                }
                ImageSource::Path(p) => return Err(usage(format!("local image paths are not allowed here: {p}"))),
                ImageSource::Remote(u) => return Err(usage(format!("fetching remote images is not enabled: {u}"))),
            };
            let image = self.image(&bytes, options.skip_processor_cache)?;
            if image.num_tokens > self.max_image_tokens {
                return Err(usage(format!(
                    "an image of {} tokens exceeds the {} tokens the start-up profile measured",
                    image.num_tokens, self.max_image_tokens
                )));
            }
            processed.push(image);
        }
        let counts: Vec<usize> = processed.iter().map(|p| p.num_tokens).collect();
        let expanded = expand_image_pads(&ids, self.image_pad, &counts).map_err(|e| usage(e.to_string()))?;
        Ok(Prompt {
            ids: expanded.ids,
            images: processed.into_iter().zip(expanded.images).collect(),
        })
    }

    /// A conversation, with the generation prompt, as an engine request (see [`Frontend::prompt`]);
    /// local image paths are read only when `allow_files`.
    pub fn request(
        &self,
        id: &str,
        messages: &[ChatMessage],
        params: SamplingParams,
        allow_files: bool,
    ) -> Result<(Request, Vec<[u32; 3]>)> {
        let options = PromptOptions {
            render: RenderOptions {
                add_generation_prompt: true,
                ..RenderOptions::default()
            },
            add_special_tokens: false,
            allow_files,
            skip_processor_cache: false,
        };
        let prompt = self.prompt(messages, options)?;
        let grids: Vec<[u32; 3]> = prompt.images.iter().map(|(p, _)| p.grid_thw).collect();
        let images = prompt
            .images
            .into_iter()
            .map(|(p, place)| ImageInput {
                grid_thw: [p.grid_thw[0] as usize, p.grid_thw[1] as usize, p.grid_thw[2] as usize],
                pixel_values: Arc::clone(&p.pixel_values),
                mm_hash: MmHash::from(p.mm_hash.clone()),
                offset: place.offset,
                num_tokens: place.length,
            })
            .collect();
        Ok((
            Request {
                id: RequestId::from(id),
                prompt: prompt.ids,
                images,
                params: self.with_eos(params),
            },
            grids,
        ))
    }

    /// Tokenizes a plain prompt (no chat template, no images) into an engine request.
    pub fn completion_request(&self, id: &str, prompt: &str, params: SamplingParams) -> Result<Request> {
        let ids = self.encode_if_it_can_fit(prompt, false)?;
        Ok(Request {
            id: RequestId::from(id),
            prompt: ids,
            images: Vec::new(),
            params: self.with_eos(params),
        })
    }

    /// Tokenizes `text` (with the post-processor's special tokens when `add_special_tokens`),
    /// unless its length alone proves it longer than `max_model_len` tokens (then it is refused
    /// without paying for the tokenizer).
    pub fn encode_if_it_can_fit(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let at_least = text.len() / self.max_token_bytes;
        if at_least > self.max_model_len {
            return Err(usage(format!(
                "the prompt has at least {at_least} tokens ({} bytes of text, at most {} bytes per token), \
                 more than this model's maximum context length of {} tokens",
                text.len(),
                self.max_token_bytes,
                self.max_model_len
            )));
        }
        self.tokenizer
            .encode_with(text, add_special_tokens)
            .map_err(|e| usage(e.to_string()))
    }

    /// `params` with the checkpoint's end-of-sequence ids as stop tokens (unless `ignore_eos`).
    fn with_eos(&self, mut params: SamplingParams) -> SamplingParams {
        for &e in &self.eos {
            if !params.stop_token_ids.contains(&e) && !params.ignore_eos {
                params.stop_token_ids.push(e);
            }
        }
        params
    }
}
