//! Turning user input into model input: chat messages and templates, tokenization, image
//! preprocessing (sizing, Pillow-exact resampling, patchify), prompt expansion, and the
//! [`InputProcessor`] that chains them from messages to an engine request.

pub mod chat;
mod error;
pub mod image;
pub mod image_budget;
pub mod processor;
pub mod prompt;
pub mod resize;
pub mod tokenizer;

pub use chat::{
    default_template, image_sources, select_chat_template, ChatMessage, ChatTemplate, Content, ImageSource,
};
pub use error::InputError;
pub use image::{process_image, ProcessedImage, ProcessorSettings};
pub use processor::{InlineImages, InputHost, InputProcessor, Prompt, PromptOptions};
pub use prompt::{expand_image_pads, ExpandedPrompt, ImagePlaceholder};
pub use tokenizer::{IncrementalDecoder, Tokenizer};
