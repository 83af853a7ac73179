//! Token counts of the requests: the prompt alone (vLLM's `prompt_len`) and the text tokens the
//! server sees around the images, which the server's `usage.prompt_tokens` exceeds by exactly the
//! image tokens. Counted on the client side from a checkpoint directory's tokenizer and chat
//! template, or, when there is none, by the server's `/tokenize` (vLLM's and kvlens's).

use super::client::Http;
use super::synth::jpeg_data_url;
use crate::checkpoint::TemplateFiles;
use crate::UsageError;
use anyhow::{bail, Result};
use kvlens_engine::input::chat::{select_chat_template, ChatMessage, ChatTemplate, Content, ContentPart, ImageUrl};
use kvlens_engine::input::tokenizer::Tokenizer;
use serde_json::{json, Value};
use std::path::Path;
use tokio::runtime::Handle;

/// Where tokens are counted.
#[derive(Debug)]
pub enum Counter {
    /// A checkpoint directory's tokenizer and chat template (`--tokenizer`).
    Local(Box<TextCounter>),
    /// The server's `/tokenize`.
    Server(Box<ServerCounter>),
}

impl Counter {
    /// Tokens of `text` alone, no special tokens added.
    pub fn count(&self, text: &str) -> Result<usize> {
        match self {
            Counter::Local(c) => c.count(text),
            Counter::Server(c) => c.count(text),
        }
    }

    /// Tokens of the templated conversation `[user: prompt (+ image)]` with the generation prompt,
    /// the image placeholder tokens left out.
    pub fn chat_text_len(&self, prompt: &str, with_image: bool) -> Result<usize> {
        match self {
            Counter::Local(c) => c.chat_text_len(prompt, with_image),
            Counter::Server(c) => c.chat_text_len(prompt, with_image),
        }
    }

    /// The tokenizer itself, when it is local.
    pub fn tokenizer(&self) -> Option<&Tokenizer> {
        match self {
            Counter::Local(c) => Some(&c.tokenizer),
            Counter::Server(_) => None,
        }
    }
}

/// The text of `<|image_pad|>`, the placeholder the server expands to an image's tokens.
const IMAGE_PAD: &str = "<|image_pad|>";

/// Counts through a server's `/tokenize` (blocking on the benchmark's runtime).
#[derive(Debug)]
pub struct ServerCounter {
    http: Http,
    model: String,
    runtime: Handle,
    /// A small image sent with the chats whose text is counted: which image does not matter, only
    /// its placeholder tokens are left out.
    probe_image: String,
}

impl ServerCounter {
    /// A counter for `model` when the server answers `/tokenize`; otherwise why not.
    pub async fn connect(http: &Http, model: &str, runtime: Handle) -> Result<Self> {
        let counter = ServerCounter {
            http: http.clone(),
            model: model.to_string(),
            runtime,
            probe_image: jpeg_data_url(&image::RgbImage::from_pixel(64, 64, image::Rgb([128, 128, 128])))?,
        };
        counter.tokenize(json!({"prompt": "Hello"})).await?;
        Ok(counter)
    }

    /// POSTs `/tokenize` with the model added; the answer's token strings when asked, else its
    /// tokens.
    async fn tokenize(&self, mut body: Value) -> Result<Vec<Value>> {
        body["model"] = json!(self.model);
        let (status, answer) = self.http.post_json("/tokenize", &body).await?;
        let answer: Value = serde_json::from_slice(&answer).unwrap_or(Value::Null);
        let key = if body["return_token_strs"] == true {
            "token_strs"
        } else {
            "tokens"
        };
        match answer.get(key).and_then(Value::as_array) {
            Some(list) if status.is_success() => Ok(list.clone()),
            _ => bail!("{} answered {status}", self.http.url("/tokenize")),
        }
    }

    fn count(&self, text: &str) -> Result<usize> {
        let body = json!({"prompt": text, "add_special_tokens": false});
        Ok(self.runtime.block_on(self.tokenize(body))?.len())
    }

    fn chat_text_len(&self, prompt: &str, with_image: bool) -> Result<usize> {
        let mut content = vec![json!({"type": "text", "text": prompt})];
        if with_image {
            content.push(json!({"type": "image_url", "image_url": {"url": self.probe_image}}));
        }
        let body = json!({"messages": [{"role": "user", "content": content}], "return_token_strs": true});
        let strs = self.runtime.block_on(self.tokenize(body))?;
        Ok(strs.iter().filter(|s| s.as_str() != Some(IMAGE_PAD)).count())
    }
}

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
        let image_pad = tokenizer.token_to_id(IMAGE_PAD);
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
