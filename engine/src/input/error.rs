//! [`InputError`]: every way user input (messages, templates, tokenizers, images) can be refused.

use super::resize::ResizeError;

/// Why a request's input cannot be turned into model input. Each message is one line.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum InputError {
    /// The messages JSON does not have the OpenAI chat shape.
    #[error("invalid chat messages: {0}")]
    Messages(String),
    /// A `data:` URL whose payload is not valid base64.
    #[error("image data URL is not valid base64: {0}")]
    Base64(String),
    /// A `data:` URL kvlens cannot read (no `;base64`, no comma).
    #[error("unsupported image data URL: {0}")]
    DataUrl(String),
    /// An image URL that is empty or of a scheme no one can read.
    #[error("unsupported image URL: {0}")]
    ImageUrl(String),
    /// The bytes are not an image in a format kvlens decodes.
    #[error("image is not a PNG, JPEG, WebP, GIF, BMP or TIFF file (first bytes: {0})")]
    NotAnImage(String),
    /// The image header was read but decoding failed.
    #[error("cannot decode image: {0}")]
    Decode(String),
    /// The header announces more pixels than allowed; nothing was decoded.
    #[error(
        "image is {width}x{height} = {pixels} pixels, more than the limit of {max_megapixels} megapixels \
         ({max_pixels} pixels)"
    )]
    TooLarge {
        /// Width from the header.
        width: u32,
        /// Height from the header.
        height: u32,
        /// `width × height`.
        pixels: u64,
        /// The limit in pixels.
        max_pixels: u64,
        /// The limit in megapixels (2^20 pixels), for the message.
        max_megapixels: u64,
    },
    /// An image with a zero side.
    #[error("image is empty ({width}x{height})")]
    EmptyImage {
        /// Width in pixels.
        width: u32,
        /// Height in pixels.
        height: u32,
    },
    /// `smart_resize` refused the size (aspect ratio above 200).
    #[error("{0}")]
    Resize(#[from] ResizeError),
    /// `preprocessor_config.json` is invalid or disagrees with `config.json`.
    #[error("preprocessor settings: {0}")]
    Preprocessor(String),
    /// The chat template does not compile, fails while rendering or calls `raise_exception`.
    #[error("chat template error: {0}")]
    Template(String),
    /// None of the checkpoint's files carries a chat template, or a file holding one is malformed.
    #[error("chat template not found: {0}")]
    TemplateSource(String),
    /// `tokenizer.json` cannot be loaded.
    #[error("tokenizer.json is invalid: {0}")]
    TokenizerJson(String),
    /// Encoding or decoding failed.
    #[error("tokenizer error: {0}")]
    Tokenize(String),
    /// The prompt's `<|image_pad|>` placeholders and the images do not pair up.
    #[error("the prompt has {pads} image placeholders but {images} images were given")]
    PadMismatch {
        /// Placeholders found in the token ids.
        pads: usize,
        /// Images passed in.
        images: usize,
    },
    /// One of the files an [`InputProcessor`](super::InputProcessor) is built from is refused;
    /// `part` names it.
    #[error("{part}: {error}")]
    Loading {
        /// `tokenizer.json`, `chat template` or `preprocessor_config.json`.
        part: &'static str,
        /// What is wrong with it.
        error: Box<InputError>,
    },
    /// The text alone proves the prompt longer than the context: refused before tokenizing.
    #[error(
        "the prompt has at least {at_least} tokens ({bytes} bytes of text, at most {max_token_bytes} bytes per \
         token), more than this model's maximum context length of {max_model_len} tokens"
    )]
    PromptTooLong {
        /// `bytes / max_token_bytes`.
        at_least: usize,
        /// Bytes of text.
        bytes: usize,
        /// See [`Tokenizer::max_token_bytes`](super::Tokenizer::max_token_bytes).
        max_token_bytes: usize,
        /// The longest prompt plus output.
        max_model_len: usize,
    },
    /// Counting a long text's tokens a piece at a time passed the context length before its end:
    /// it was refused without tokenizing the rest.
    #[error(
        "the prompt has more than {counted} tokens in its first {bytes_read} bytes (of {bytes}), more than this \
         model's maximum context length of {max_model_len} tokens"
    )]
    PromptTooLongCounted {
        /// Tokens counted so far (less the most the cuts between pieces can add).
        counted: usize,
        /// Bytes of text counted.
        bytes_read: usize,
        /// Bytes of text.
        bytes: usize,
        /// The longest prompt plus output.
        max_model_len: usize,
    },
    /// The request's client went away: its preprocessing stopped.
    #[error("the request was cancelled: its client went away")]
    Cancelled,
    /// Images for a text model alone.
    #[error("{}", crate::arch::config::NO_VISION_TOWER)]
    NoVisionTower,
    /// More images than one prompt may carry (`--limit-mm-per-prompt`).
    #[error("At most {limit} image(s) may be provided in one prompt, got {got}")]
    TooManyImages {
        /// The limit.
        limit: usize,
        /// Images in the prompt.
        got: usize,
    },
    /// An image with more tokens than the start-up profile measured (it could exceed the
    /// profiled memory peak).
    #[error("an image of {tokens} tokens exceeds the {max} tokens the start-up profile measured")]
    ImageTooManyTokens {
        /// The image's tokens.
        tokens: usize,
        /// The most the profile measured.
        max: usize,
    },
    /// A local image path where the caller does not allow them.
    #[error("local image paths are not allowed here: {0}")]
    LocalImagePath(String),
    /// An `http(s)://` image URL: the engine fetches nothing, the caller fetches the allowed ones
    /// first and passes them as data URLs.
    #[error("fetching remote images is not enabled: {0}")]
    RemoteImage(String),
    /// The caller could not read a local image.
    #[error("cannot read image {path}: {reason}")]
    ReadImage {
        /// The path.
        path: String,
        /// Why, from the caller.
        reason: String,
    },
    /// The caller's image preprocessing budget stayed full: the caller is busy, the request
    /// itself is not wrong (the server answers 503).
    #[error("{0}")]
    Busy(String),
}
