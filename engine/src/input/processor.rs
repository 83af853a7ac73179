//! [`InputProcessor`]: OpenAI chat messages (or a plain prompt) to an engine [`Request`]. It renders
//! the chat template, tokenizes (refusing texts that cannot fit before paying for the tokenizer),
//! preprocesses each image through the processor cache and expands the image placeholders.
//!
//! It reads no files and fetches nothing. Images arrive inline (`data:` URLs); a local path is handed
//! to the caller's [`InputHost`], which also wraps each image's decode and preprocessing and each
//! tokenization (the server holds its host-memory budget there) and says when the request's client
//! has gone (work stops at the next check). The server and the browser playground share this code.

use super::chat::{image_sources, ChatMessage, ChatTemplate, ImageSource, RenderOptions};
use super::image::{decode_image, ProcessedImage, ProcessorSettings};
use super::image_budget::preprocessing_bytes;
use super::prompt::{expand_image_pads, ImagePlaceholder};
use super::tokenizer::Tokenizer;
use super::InputError;
use crate::arch::config::ModelConfig;
use crate::cache::{MmHash, ProcessorCache, RequestId};
use crate::engine::{ImageInput, Request};
use crate::sample::SamplingParams;
use std::sync::{Arc, Mutex};

/// Bytes of text tokenized at a time when counting a long text's tokens.
const COUNT_PIECE_BYTES: usize = 64 << 10;

/// Most tokens a cut between two counted pieces can add to their count: the pre-token (or added
/// token) cut in two, each half rounding up to whole tokens, and the neighbour a regex look-ahead
/// may join.
const TOKENS_PER_CUT: usize = 4;

/// Host memory the tokenizer holds per byte of text while encoding it (its normalized string with
/// byte alignments, the pre-token splits and the encoding's per-token vectors): measured as
/// 268 bytes per byte for a text of digits, rounded up.
pub const TOKENIZE_BYTES_PER_BYTE: u64 = 320;

/// What the caller of [`InputProcessor::prompt`] provides: the bytes of local images (the engine
/// reads no files), a place to hold resources around each image's preprocessing and each
/// tokenization, and whether the request is still wanted. The defaults refuse local paths, hold
/// nothing and never cancel ([`InlineImages`]).
pub trait InputHost {
    /// The bytes of the image at a local `path` (asked only when [`PromptOptions::allow_files`]).
    fn read_path(&mut self, path: &str) -> Result<Vec<u8>, InputError> {
        Err(InputError::LocalImagePath(path.to_string()))
    }

    /// Runs `work` (decoding one image, looking it up in the processor cache and preprocessing it
    /// on a miss), which holds at most `bytes` of host memory at once. A host with a memory budget
    /// reserves `bytes` around it, or returns [`InputError::Busy`] when there is no room.
    fn preprocess(
        &mut self,
        bytes: u64,
        work: &mut dyn FnMut() -> Result<Arc<ProcessedImage>, InputError>,
    ) -> Result<Arc<ProcessedImage>, InputError> {
        let _ = bytes;
        work()
    }

    /// Runs `work` (tokenizing a text), which holds at most `bytes` of host memory at once; like
    /// [`InputHost::preprocess`].
    fn tokenize(
        &mut self,
        bytes: u64,
        work: &mut dyn FnMut() -> Result<Vec<u32>, InputError>,
    ) -> Result<Vec<u32>, InputError> {
        let _ = bytes;
        work()
    }

    /// Whether the request's client has gone: tokenizing and preprocessing stop at the next check
    /// with [`InputError::Cancelled`].
    fn cancelled(&self) -> bool {
        false
    }
}

/// The host of callers that only take images inline: local paths are refused, no budget is held.
#[derive(Debug, Clone, Copy, Default)]
pub struct InlineImages;

impl InputHost for InlineImages {}

/// `text` in pieces of about `max` bytes, each cut before a whitespace character where one lies
/// in its last quarter (where the pre-tokenizer splits anyway), else at a character boundary.
fn pieces(text: &str, max: usize) -> impl Iterator<Item = &str> {
    let mut rest = text;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let mut end = rest.len().min(max);
        while !rest.is_char_boundary(end) {
            end -= 1;
        }
        if end == 0 {
            end = rest.chars().next().map_or(rest.len(), char::len_utf8);
        }
        if end < rest.len() {
            let from = end - end / 4;
            if let Some(space) = rest[from..end].rfind(char::is_whitespace).filter(|&i| from + i > 0) {
                end = from + space;
            }
        }
        let (piece, tail) = rest.split_at(end);
        rest = tail;
        Some(piece)
    })
}

/// A conversation as the engine sees it.
#[derive(Debug)]
pub struct Prompt {
    /// Token ids, each image's placeholder expanded to the image's token count.
    pub ids: Vec<u32>,
    /// The preprocessed images and where their placeholders sit, in prompt order.
    pub images: Vec<(Arc<ProcessedImage>, ImagePlaceholder)>,
}

/// How [`InputProcessor::prompt`] renders and reads a conversation.
#[derive(Debug, Clone, Copy, Default)]
pub struct PromptOptions {
    /// The chat template's settings.
    pub render: RenderOptions,
    /// Add the tokenizer's post-processor tokens (a BOS, …) around the rendered text, which
    /// already holds the template's own special tokens (vLLM's `add_special_tokens`, off for chats).
    pub add_special_tokens: bool,
    /// Read local image paths through [`InputHost::read_path`] (the command line); otherwise they
    /// are refused (the server).
    pub allow_files: bool,
    /// Leave the processor cache alone (vLLM's `/tokenize` does not fill it).
    pub skip_processor_cache: bool,
}

/// Everything that turns messages into engine requests and tokens into text.
#[derive(Debug)]
pub struct InputProcessor {
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
    /// The model has a vision tower (else every image is refused).
    has_vision: bool,
}

impl InputProcessor {
    /// Builds the tokenizer, template and image settings of a checkpoint from its files' contents:
    /// `tokenizer.json`, the chat template source, `config.json` and `preprocessor_config.json`
    /// (when it has one), and its end-of-sequence ids. No limits are set and the processor cache
    /// is off until the `set_*` methods and fields say otherwise.
    pub fn new(
        tokenizer_json: &[u8],
        chat_template: &str,
        config: &ModelConfig,
        preprocessor_json: Option<&str>,
        eos: Vec<u32>,
    ) -> Result<Self, InputError> {
        fn loading(part: &'static str) -> impl FnOnce(InputError) -> InputError {
            move |e| InputError::Loading {
                part,
                error: Box::new(e),
            }
        }
        let tokenizer = Tokenizer::from_bytes(tokenizer_json).map_err(loading("tokenizer.json"))?;
        let template = ChatTemplate::new(chat_template).map_err(loading("chat template"))?;
        let settings =
            ProcessorSettings::new(config, preprocessor_json).map_err(loading("preprocessor_config.json"))?;
        Ok(InputProcessor {
            template,
            settings,
            image_pad: config.tokens.image,
            eos,
            limit_images: usize::MAX,
            max_image_tokens: usize::MAX,
            processor_cache: Mutex::new(ProcessorCache::new(0)),
            max_model_len: usize::MAX,
            max_token_bytes: tokenizer.max_token_bytes(),
            tokenizer,
            has_vision: config.vision.is_some(),
        })
    }

    /// Resizes the processor cache (0 turns it off), dropping what it held.
    pub fn set_processor_cache_bytes(&mut self, bytes: u64) {
        self.processor_cache = Mutex::new(ProcessorCache::new(bytes));
    }

    /// Decodes and preprocesses one image inside `host`'s [`InputHost::preprocess`], through the
    /// processor cache unless `skip_cache` (a hit skips preprocessing, not decoding: the key is
    /// the hash of the decoded pixels).
    fn image(
        &self,
        bytes: &[u8],
        skip_cache: bool,
        host: &mut dyn InputHost,
    ) -> Result<Arc<ProcessedImage>, InputError> {
        let cost = preprocessing_bytes(bytes, &self.settings)?;
        host.preprocess(cost, &mut || {
            let decoded = decode_image(bytes, &self.settings)?;
            let cache = || self.processor_cache.lock().unwrap_or_else(|p| p.into_inner());
            if skip_cache {
                return Ok(Arc::new(decoded.process(&self.settings)?));
            }
            if let Some(hit) = cache().get(&decoded.mm_hash).cloned() {
                return Ok(hit);
            }
            let processed = Arc::new(decoded.process(&self.settings)?);
            let size = (processed.pixel_values.len() * 4) as u64;
            cache().insert(MmHash::from(processed.mm_hash.clone()), processed.clone(), size);
            Ok(processed)
        })
    }

    /// Renders, tokenizes and preprocesses a conversation: the token ids the engine gets, image
    /// placeholders expanded, and the images. Remote URLs are refused (the caller fetches the
    /// allowed ones first and passes them as data URLs); local paths are read by `host` when
    /// `options.allow_files`, else refused.
    pub fn prompt(
        &self,
        messages: &[ChatMessage],
        options: PromptOptions,
        host: &mut dyn InputHost,
    ) -> Result<Prompt, InputError> {
        let text = self.template.render_with(messages, options.render)?;
        let ids = self.encode_if_it_can_fit(&text, options.add_special_tokens, host)?;
        let sources = image_sources(messages)?;
        if !sources.is_empty() && !self.has_vision {
            return Err(InputError::NoVisionTower);
        }
        if sources.len() > self.limit_images {
            return Err(InputError::TooManyImages {
                limit: self.limit_images,
                got: sources.len(),
            });
        }
        let mut processed = Vec::with_capacity(sources.len());
        for src in sources {
            if host.cancelled() {
                return Err(InputError::Cancelled);
            }
            let bytes = match src {
                ImageSource::Bytes(b) => b,
                ImageSource::Path(p) if options.allow_files => host.read_path(&p)?,
                ImageSource::Path(p) => return Err(InputError::LocalImagePath(p)),
                ImageSource::Remote(u) => return Err(InputError::RemoteImage(u)),
            };
            let image = self.image(&bytes, options.skip_processor_cache, host)?;
            if image.num_tokens > self.max_image_tokens {
                return Err(InputError::ImageTooManyTokens {
                    tokens: image.num_tokens,
                    max: self.max_image_tokens,
                });
            }
            processed.push(image);
        }
        let counts: Vec<usize> = processed.iter().map(|p| p.num_tokens).collect();
        let expanded = expand_image_pads(&ids, self.image_pad, &counts)?;
        Ok(Prompt {
            ids: expanded.ids,
            images: processed.into_iter().zip(expanded.images).collect(),
        })
    }

    /// A conversation, with the generation prompt, as an engine request (see
    /// [`InputProcessor::prompt`]). The images' pixels are shared with the processor cache, not
    /// copied.
    pub fn request(
        &self,
        id: &str,
        messages: &[ChatMessage],
        params: SamplingParams,
        allow_files: bool,
        host: &mut dyn InputHost,
    ) -> Result<Request, InputError> {
        let options = PromptOptions {
            render: RenderOptions {
                add_generation_prompt: true,
                ..RenderOptions::default()
            },
            add_special_tokens: false,
            allow_files,
            skip_processor_cache: false,
        };
        let prompt = self.prompt(messages, options, host)?;
        let images = prompt
            .images
            .into_iter()
            .map(|(p, place)| ImageInput {
                grid_thw: p.grid_thw.map(|g| g as usize),
                pixel_values: Arc::clone(&p.pixel_values),
                mm_hash: MmHash::from(p.mm_hash.clone()),
                offset: place.offset,
                num_tokens: place.length,
            })
            .collect();
        Ok(Request {
            id: RequestId::from(id),
            prompt: prompt.ids,
            images,
            params: self.with_eos(params),
        })
    }

    /// Tokenizes a plain prompt (no chat template, no images) into an engine request.
    pub fn completion_request(
        &self,
        id: &str,
        prompt: &str,
        params: SamplingParams,
        host: &mut dyn InputHost,
    ) -> Result<Request, InputError> {
        let ids = self.encode_if_it_can_fit(prompt, false, host)?;
        Ok(Request {
            id: RequestId::from(id),
            prompt: ids,
            images: Vec::new(),
            params: self.with_eos(params),
        })
    }

    /// Tokenizes `text` (with the post-processor's special tokens when `add_special_tokens`) within
    /// the host's memory budget, unless it cannot fit in `max_model_len` tokens: a text whose
    /// length alone proves it too long is refused without tokenizing; a longer text than one piece
    /// ([`COUNT_PIECE_BYTES`]) is first counted a piece at a time, and refused as soon as the count
    /// passes the context length, so the tokenizer never holds more than a piece's memory for a
    /// text that cannot fit. The host's cancellation is checked between pieces.
    pub fn encode_if_it_can_fit(
        &self,
        text: &str,
        add_special_tokens: bool,
        host: &mut dyn InputHost,
    ) -> Result<Vec<u32>, InputError> {
        let at_least = text.len() / self.max_token_bytes;
        if at_least > self.max_model_len {
            return Err(InputError::PromptTooLong {
                at_least,
                bytes: text.len(),
                max_token_bytes: self.max_token_bytes,
                max_model_len: self.max_model_len,
            });
        }
        let cost = |bytes: usize| bytes as u64 * TOKENIZE_BYTES_PER_BYTE;
        if text.len() > COUNT_PIECE_BYTES {
            let (mut counted, mut bytes_read) = (0, 0);
            for (cuts, piece) in pieces(text, COUNT_PIECE_BYTES).enumerate() {
                if host.cancelled() {
                    return Err(InputError::Cancelled);
                }
                counted += host
                    .tokenize(cost(piece.len()), &mut || self.tokenizer.encode_with(piece, false))?
                    .len();
                bytes_read += piece.len();
                let surely = counted.saturating_sub(cuts * TOKENS_PER_CUT);
                if surely > self.max_model_len {
                    return Err(InputError::PromptTooLongCounted {
                        counted: surely,
                        bytes_read,
                        bytes: text.len(),
                        max_model_len: self.max_model_len,
                    });
                }
            }
        }
        if host.cancelled() {
            return Err(InputError::Cancelled);
        }
        host.tokenize(cost(text.len()), &mut || {
            self.tokenizer.encode_with(text, add_special_tokens)
        })
    }

    /// `params` with the checkpoint's end-of-sequence ids as stop tokens (unless `ignore_eos`).
    pub fn with_eos(&self, mut params: SamplingParams) -> SamplingParams {
        for &e in &self.eos {
            if !params.stop_token_ids.contains(&e) && !params.ignore_eos {
                params.stop_token_ids.push(e);
            }
        }
        params
    }
}
