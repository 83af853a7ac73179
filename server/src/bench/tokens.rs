//! Token counts on the client side, from a checkpoint directory's tokenizer and chat template:
//! the prompt alone (vLLM's `prompt_len`) and the text tokens the server sees around the images,
//! which the server's `usage.prompt_tokens` exceeds by exactly the image tokens.

use crate::checkpoint::TemplateFiles;
use crate::UsageError;
use anyhow::Result;
use kvlens_engine::input::chat::{select_chat_template, ChatMessage, ChatTemplate, Content, ContentPart, ImageUrl};
use kvlens_engine::input::tokenizer::Tokenizer;
use std::path::Path;

/// A tokenizer and chat template.
#[derive(Debug)]
pub struct TextCounter {
    /// The tokenizer.
    pub tokenizer: Tokenizer,
    template: ChatTemplate,
    image_pad: Option<u32>,
}

impl TextCounter {
    /// Loads `tokenizer.json` and the chat template of a checkpoint directory.
    pub fn load(dir: &Path) -> Result<Self> {
        let usage = |m: String| anyhow::Error::from(UsageError(m));
        let tok_path = dir.join("tokenizer.json");
        let bytes = std::fs::read(&tok_path).map_err(|e| {
            usage(format!(
                "--tokenizer {}: cannot read tokenizer.json ({e}); give the model's checkpoint directory",
                dir.display()
            ))
        })?;
        let tokenizer = Tokenizer::from_bytes(&bytes).map_err(|e| usage(format!("{}: {e}", tok_path.display())))?;
        let files = TemplateFiles::read(dir)?;
        let source = select_chat_template(
            files.jinja.as_deref(),
            files.json.as_deref(),
            files.tokenizer_config.as_deref(),
        )
        .map_err(|e| usage(format!("--tokenizer {}: {e}", dir.display())))?
        .ok_or_else(|| usage(format!("--tokenizer {}: no chat template", dir.display())))?;
        let template = ChatTemplate::new(&source).map_err(|e| usage(format!("chat template: {e}")))?;
        let image_pad = tokenizer.token_to_id("<|image_pad|>");
        Ok(TextCounter {
            tokenizer,
            template,
            image_pad,
        })
    }

    /// Tokens of `text` alone, no special tokens added.
    pub fn count(&self, text: &str) -> Result<usize> {
        Ok(self.tokenizer.encode(text)?.len())
    }

    /// Tokens of the templated conversation `[user: prompt (+ image)]` with the generation prompt,
    /// the image placeholder tokens left out: what the server counts besides the image's tokens.
    pub fn chat_text_len(&self, prompt: &str, with_image: bool) -> Result<usize> {
        let mut parts = vec![ContentPart::Text {
            text: prompt.to_string(),
        }];
        if with_image {
            parts.push(ContentPart::ImageUrl {
                image_url: ImageUrl { url: String::new() },
            });
        }
        let messages = [ChatMessage {
            role: "user".into(),
            content: Content::Parts(parts),
        }];
        let ids = self.tokenizer.encode(&self.template.render(&messages, true)?)?;
        Ok(ids.iter().filter(|&&id| Some(id) != self.image_pad).count())
    }
}
