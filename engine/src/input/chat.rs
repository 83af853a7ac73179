//! Chat messages in OpenAI's shape and Hugging Face compatible chat-template rendering.
//!
//! Templates run on minijinja with the settings transformers uses for `apply_chat_template`:
//! `trim_blocks`, `lstrip_blocks`, loop controls, a `tojson` filter that behaves like Python's
//! `json.dumps(ensure_ascii=False)`, a `raise_exception` function, Python string/dict/list methods
//! (`.strip()`, `.startswith()`, `.split()`, `.items()`, …) and `tools = None`. As vLLM does for
//! OpenAI-format templates, each image part is shown to the template as `{"type": "image"}` and
//! each text part as `{"type": "text", "text": …}`.

use std::collections::BTreeMap;

use base64::Engine as _;
use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind};
use serde::Deserialize;

use super::InputError;
use crate::arch::config::Family;

/// One chat message: a role and its content.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`, …
    pub role: String,
    /// A plain string or a list of parts.
    pub content: Content,
}

/// A message's content.
#[derive(Debug, Clone, PartialEq)]
pub enum Content {
    /// `"content": "…"` (a JSON `null` reads as the empty string).
    Text(String),
    /// `"content": [{"type": …}, …]`
    Parts(Vec<ContentPart>),
}

/// One part of a list content.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ContentPart {
    /// `{"type": "text", "text": "…"}`
    Text {
        /// The text.
        text: String,
    },
    /// OpenAI's `{"type": "image_url", "image_url": {"url": "…"}}`.
    ImageUrl {
        /// The URL object.
        image_url: ImageUrl,
    },
    /// Hugging Face's `{"type": "image", "image": "…"}` (or `"url"` / `"path"` instead of `"image"`).
    Image {
        /// A URL, data URL or path.
        #[serde(default)]
        image: Option<String>,
        /// Same, under the key `url`.
        #[serde(default)]
        url: Option<String>,
        /// Same, under the key `path`.
        #[serde(default)]
        path: Option<String>,
    },
}

/// The `image_url` object of an OpenAI image part.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct ImageUrl {
    /// `data:image/png;base64,…`, `file:///…`, `https://…` or a path.
    pub url: String,
}

impl<'de> Deserialize<'de> for Content {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        match serde_json::Value::deserialize(deserializer)? {
            serde_json::Value::Null => Ok(Content::Text(String::new())),
            serde_json::Value::String(s) => Ok(Content::Text(s)),
            parts @ serde_json::Value::Array(_) => serde_json::from_value(parts)
                .map(Content::Parts)
                .map_err(serde::de::Error::custom),
            other => Err(serde::de::Error::custom(format!(
                "content must be a string or a list of parts, got {other}"
            ))),
        }
    }
}

impl ContentPart {
    /// The image reference of an image part, `None` for text parts (or an image part without one).
    fn image_ref(&self) -> Option<&str> {
        match self {
            ContentPart::Text { .. } => None,
            ContentPart::ImageUrl { image_url } => Some(&image_url.url),
            ContentPart::Image { image, url, path } => image.as_deref().or(url.as_deref()).or(path.as_deref()),
        }
    }

    /// The image reference, for a caller that resolves it (e.g. fetches a remote URL).
    pub fn image_ref_mut(&mut self) -> Option<&mut String> {
        match self {
            ContentPart::Text { .. } => None,
            ContentPart::ImageUrl { image_url } => Some(&mut image_url.url),
            ContentPart::Image { image, url, path } => image.as_mut().or(url.as_mut()).or(path.as_mut()),
        }
    }

    fn is_image(&self) -> bool {
        !matches!(self, ContentPart::Text { .. })
    }
}

impl ChatMessage {
    /// Parses OpenAI's `messages` array.
    pub fn parse_list(json: &str) -> Result<Vec<ChatMessage>, InputError> {
        serde_json::from_str(json).map_err(|e| InputError::Messages(e.to_string()))
    }

    /// The image references of this message's image parts, in order, as written.
    pub fn image_urls(&self) -> Vec<&str> {
        match &self.content {
            Content::Text(_) => Vec::new(),
            Content::Parts(parts) => parts.iter().filter_map(ContentPart::image_ref).collect(),
        }
    }

    /// The message's image references, mutable.
    pub fn image_urls_mut(&mut self) -> Vec<&mut String> {
        match &mut self.content {
            Content::Text(_) => Vec::new(),
            Content::Parts(parts) => parts.iter_mut().filter_map(ContentPart::image_ref_mut).collect(),
        }
    }

    /// How the template sees this message (`{"role": …, "content": …}`).
    fn to_template_value(&self) -> Value {
        let content = match &self.content {
            Content::Text(text) => Value::from(text.as_str()),
            Content::Parts(parts) => parts
                .iter()
                .map(|part| {
                    let mut map = BTreeMap::new();
                    match part {
                        ContentPart::Text { text } => {
                            map.insert("type", Value::from("text"));
                            map.insert("text", Value::from(text.as_str()));
                        }
                        _ => {
                            map.insert("type", Value::from("image"));
                        }
                    }
                    Value::from(map)
                })
                .collect(),
        };
        let mut map = BTreeMap::new();
        map.insert("role", Value::from(self.role.as_str()));
        map.insert("content", content);
        Value::from(map)
    }
}

/// Where an image comes from. The engine reads no files and fetches nothing: paths and remote URLs
/// are handed back for the caller to resolve.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImageSource {
    /// The bytes of a base64 `data:` URL.
    Bytes(Vec<u8>),
    /// A local path (`file://` stripped).
    Path(String),
    /// An `http://` or `https://` URL.
    Remote(String),
}

impl ImageSource {
    /// Classifies one image reference, decoding `data:` URLs.
    pub fn parse(reference: &str) -> Result<ImageSource, InputError> {
        let reference = reference.trim();
        if let Some(rest) = strip_prefix_ignore_case(reference, "data:") {
            let Some((header, payload)) = rest.split_once(',') else {
                return Err(InputError::DataUrl("no comma after the media type".into()));
            };
            if !header.to_ascii_lowercase().ends_with(";base64") {
                return Err(InputError::DataUrl(format!(
                    "data:{header} is not base64-encoded (expected data:image/…;base64,…)"
                )));
            }
            // Copied only when it holds whitespace (a data URL can be tens of megabytes).
            let cleaned: std::borrow::Cow<'_, str> = if payload.bytes().any(|b| b.is_ascii_whitespace()) {
                payload
                    .chars()
                    .filter(|c| !c.is_ascii_whitespace())
                    .collect::<String>()
                    .into()
            } else {
                payload.into()
            };
            let engine = base64::engine::GeneralPurpose::new(
                &base64::alphabet::STANDARD,
                base64::engine::GeneralPurposeConfig::new()
                    .with_decode_padding_mode(base64::engine::DecodePaddingMode::Indifferent),
            );
            return engine
                .decode(cleaned.as_bytes())
                .map(ImageSource::Bytes)
                .map_err(|e| InputError::Base64(e.to_string()));
        }
        if reference.is_empty() {
            return Err(InputError::ImageUrl(
                "the URL is empty (expected data:image/…;base64,… or http(s)://…)".into(),
            ));
        }
        if let Some(path) = strip_prefix_ignore_case(reference, "file://") {
            return Ok(ImageSource::Path(path.to_string()));
        }
        if strip_prefix_ignore_case(reference, "http://").is_some()
            || strip_prefix_ignore_case(reference, "https://").is_some()
        {
            return Ok(ImageSource::Remote(reference.to_string()));
        }
        if let Some((scheme, _)) = reference.split_once("://") {
            if !scheme.is_empty() && scheme.chars().all(|c| c.is_ascii_alphanumeric() || "+.-".contains(c)) {
                return Err(InputError::ImageUrl(format!(
                    "{scheme}:// is not a scheme images are read from (use data:, http:// or https://)"
                )));
            }
        }
        Ok(ImageSource::Path(reference.to_string()))
    }
}

fn strip_prefix_ignore_case<'a>(s: &'a str, prefix: &str) -> Option<&'a str> {
    let head = s.get(..prefix.len())?;
    head.eq_ignore_ascii_case(prefix).then(|| &s[prefix.len()..])
}

/// The sources of every image part of `messages`, in the order the template places their
/// `<|image_pad|>` placeholders.
pub fn image_sources(messages: &[ChatMessage]) -> Result<Vec<ImageSource>, InputError> {
    let mut sources = Vec::new();
    for message in messages {
        if let Content::Parts(parts) = &message.content {
            for part in parts.iter().filter(|p| p.is_image()) {
                let reference = part
                    .image_ref()
                    .ok_or_else(|| InputError::Messages("an image part has no image, url or path".into()))?;
                sources.push(ImageSource::parse(reference)?);
            }
        }
    }
    Ok(sources)
}

/// The chat templates of the test checkpoints kvlens generates: Qwen2-VL's (shared by Qwen2.5-VL)
/// or Qwen3-VL's, for checkpoints that ship none.
pub fn default_template(family: Family) -> &'static str {
    if family.is_qwen3() {
        include_str!("templates/qwen3_vl.jinja")
    } else {
        include_str!("templates/qwen2_vl.jinja")
    }
}

/// Picks a checkpoint's chat template from the text of its files, in transformers' order of
/// preference: `chat_template.jinja`, then `chat_template.json` (`{"chat_template": "…"}`), then
/// `tokenizer_config.json` (`chat_template` as a string, or a list of `{name, template}` where
/// `default` wins, else the first). `Ok(None)` when no file carries one.
pub fn select_chat_template(
    chat_template_jinja: Option<&str>,
    chat_template_json: Option<&str>,
    tokenizer_config_json: Option<&str>,
) -> Result<Option<String>, InputError> {
    if let Some(text) = chat_template_jinja {
        return Ok(Some(text.to_string()));
    }
    if let Some(text) = chat_template_json {
        if let Some(found) = template_field(text, "chat_template.json")? {
            return Ok(Some(found));
        }
    }
    match tokenizer_config_json {
        Some(text) => template_field(text, "tokenizer_config.json"),
        None => Ok(None),
    }
}

/// Reads the `chat_template` field of a JSON file.
fn template_field(text: &str, file: &str) -> Result<Option<String>, InputError> {
    let root: serde_json::Value =
        serde_json::from_str(text).map_err(|e| InputError::TemplateSource(format!("{file} is not valid JSON: {e}")))?;
    match root.get("chat_template") {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
        Some(serde_json::Value::Array(list)) => {
            let named = |item: &serde_json::Value| -> Option<(String, String)> {
                let name = item.get("name")?.as_str()?;
                let template = item.get("template")?.as_str()?;
                Some((name.to_string(), template.to_string()))
            };
            let entries = list.iter().map(named).collect::<Option<Vec<_>>>().ok_or_else(|| {
                InputError::TemplateSource(format!(
                    "{file}: chat_template list entries need string name and template"
                ))
            })?;
            Ok(entries
                .iter()
                .find(|(name, _)| name == "default")
                .or(entries.first())
                .map(|(_, template)| template.clone()))
        }
        Some(_) => Err(InputError::TemplateSource(format!(
            "{file}: chat_template must be a string or a list of {{name, template}}"
        ))),
    }
}

/// Settings of one rendering beyond the messages.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RenderOptions {
    /// Append the assistant turn header (`<|im_start|>assistant\n`).
    pub add_generation_prompt: bool,
    /// Prefix images with `Picture k: ` (Qwen templates' `add_vision_id`).
    pub add_vision_id: bool,
    /// End the prompt right after the last message's text, so that the model continues that
    /// message (transformers' `continue_final_message`; not with `add_generation_prompt`).
    pub continue_final_message: bool,
}

/// A compiled chat template.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
}

const TEMPLATE_NAME: &str = "chat_template";

impl ChatTemplate {
    /// Compiles a template with transformers' Jinja settings.
    pub fn new(source: &str) -> Result<Self, InputError> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(template_error)?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(template_error)?;
        Ok(ChatTemplate { env })
    }

    /// Renders `messages`, optionally with the generation prompt.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String, InputError> {
        self.render_with(
            messages,
            RenderOptions {
                add_generation_prompt,
                ..RenderOptions::default()
            },
        )
    }

    /// Renders `messages` with explicit options.
    pub fn render_with(&self, messages: &[ChatMessage], options: RenderOptions) -> Result<String, InputError> {
        let template = self.env.get_template(TEMPLATE_NAME).map_err(template_error)?;
        let values: Vec<Value> = messages.iter().map(ChatMessage::to_template_value).collect();
        let mut ctx = BTreeMap::new();
        ctx.insert("messages", Value::from(values));
        ctx.insert("add_generation_prompt", Value::from(options.add_generation_prompt));
        ctx.insert("add_vision_id", Value::from(options.add_vision_id));
        ctx.insert("tools", Value::from(()));
        let rendered = template.render(Value::from(ctx)).map_err(template_error)?;
        if options.continue_final_message {
            return continue_final_message(rendered, messages, options.add_generation_prompt);
        }
        Ok(rendered)
    }
}

/// Cuts `rendered` right after the last message's (last) text, as transformers does for
/// `continue_final_message`: the whole text when the template kept its spacing, else the text
/// without its surrounding whitespace.
fn continue_final_message(
    mut rendered: String,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
) -> Result<String, InputError> {
    let refuse = |why: &str| Err(InputError::Template(format!("continue_final_message: {why}")));
    if add_generation_prompt {
        return refuse("cannot be combined with add_generation_prompt");
    }
    let last = match messages.last().map(|m| &m.content) {
        None => return refuse("there is no message to continue"),
        Some(Content::Text(text)) => text.as_str(),
        Some(Content::Parts(parts)) => match parts.iter().rev().find_map(|p| match p {
            ContentPart::Text { text } => Some(text.as_str()),
            _ => None,
        }) {
            Some(text) => text,
            None => return refuse("the final message has no text to continue"),
        },
    };
    let Some(at) = rendered.rfind(last.trim()) else {
        return refuse("the template does not show the final message's text");
    };
    let kept = if last.trim_start() == last && rendered[at..].starts_with(last) {
        last.len()
    } else {
        last.trim().len()
    };
    rendered.truncate(at + kept);
    Ok(rendered)
}

fn template_error(err: Error) -> InputError {
    if err.kind() == ErrorKind::InvalidOperation {
        if let Some(detail) = err.detail().and_then(|d| d.strip_prefix(RAISED)) {
            return InputError::Template(format!("template raised: {detail}"));
        }
    }
    InputError::Template(err.to_string())
}

const RAISED: &str = "raise_exception: ";

/// `raise_exception(message)`: templates use it to refuse a conversation.
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, format!("{RAISED}{message}")))
}

/// `tojson` as transformers defines it: `json.dumps(x, ensure_ascii=False, indent=indent)`
/// (no HTML escaping; `separators` is accepted as a two-item list).
fn tojson(value: &Value, indent: Option<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let indent = match indent {
        Some(v) => Some(v),
        None => kwargs.get::<Option<Value>>("indent")?,
    };
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => Some(
            v.as_usize()
                .ok_or_else(|| Error::new(ErrorKind::InvalidOperation, "tojson: indent must be an integer"))?,
        ),
    };
    let separators = match kwargs.get::<Option<Vec<String>>>("separators")? {
        Some(pair) if pair.len() == 2 => Some((pair[0].clone(), pair[1].clone())),
        Some(_) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must have two items",
            ))
        }
        None => None,
    };
    // Accepted for signature compatibility; kvlens maps are already key-sorted and never ASCII-escaped.
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    let _: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let (item_sep, key_sep) = separators.unwrap_or_else(|| {
        let item = if indent.is_some() { "," } else { ", " };
        (item.to_string(), ": ".to_string())
    });
    let mut out = String::new();
    let style = JsonStyle {
        indent,
        item_sep: &item_sep,
        key_sep: &key_sep,
    };
    write_json(&mut out, value, &style, 0)?;
    Ok(Value::from_safe_string(out))
}

struct JsonStyle<'a> {
    indent: Option<usize>,
    item_sep: &'a str,
    key_sep: &'a str,
}

impl JsonStyle<'_> {
    fn newline(&self, out: &mut String, depth: usize) {
        if let Some(width) = self.indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', width * depth));
        }
    }
}

fn write_json(out: &mut String, value: &Value, style: &JsonStyle<'_>, depth: usize) -> Result<(), Error> {
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            let text = value.to_string();
            if text == "NaN" || text.ends_with("inf") {
                out.push_str(if text == "NaN" {
                    "NaN"
                } else if text.starts_with('-') {
                    "-Infinity"
                } else {
                    "Infinity"
                });
            } else {
                out.push_str(&text);
            }
        }
        ValueKind::String => write_json_string(out, value.as_str().unwrap_or_default()),
        ValueKind::Map => {
            let keys: Vec<Value> = value.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(style.item_sep);
                }
                style.newline(out, depth + 1);
                write_json_string(out, &key.to_string());
                out.push_str(style.key_sep);
                write_json(out, &value.get_item(key)?, style, depth + 1)?;
            }
            style.newline(out, depth);
            out.push('}');
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(style.item_sep);
                }
                style.newline(out, depth + 1);
                write_json(out, item, style, depth + 1)?;
            }
            style.newline(out, depth);
            out.push(']');
        }
        kind => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: cannot serialize a {kind}"),
            ))
        }
    }
    Ok(())
}

/// A JSON string literal as Python's `json.dumps(ensure_ascii=False)` writes it.
fn write_json_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    const Q2_SYSTEM: &str = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n";
    const VISION: &str = "<|vision_start|><|image_pad|><|vision_end|>";

    fn messages(json: &str) -> Vec<ChatMessage> {
        ChatMessage::parse_list(json).unwrap()
    }

    fn both() -> (ChatTemplate, ChatTemplate) {
        (
            ChatTemplate::new(default_template(Family::Qwen2Vl)).unwrap(),
            ChatTemplate::new(default_template(Family::Qwen3Vl)).unwrap(),
        )
    }

    #[test]
    fn text_only() {
        let (q2, q3) = both();
        let m = messages(r#"[{"role":"user","content":"hello"}]"#);
        assert_eq!(
            q2.render(&m, true).unwrap(),
            format!("{Q2_SYSTEM}<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n")
        );
        assert_eq!(
            q3.render(&m, true).unwrap(),
            "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(q3.render(&m, false).unwrap(), "<|im_start|>user\nhello<|im_end|>\n");
    }

    #[test]
    fn continue_final_message_ends_at_its_text() {
        let (_, q3) = both();
        let continued = |json: &str, add_generation_prompt: bool| {
            let options = RenderOptions {
                add_generation_prompt,
                continue_final_message: true,
                ..RenderOptions::default()
            };
            q3.render_with(&messages(json), options)
        };
        // The template keeps the trailing space, so the prompt keeps it too (as transformers).
        let m = r#"[{"role":"user","content":"hi"},{"role":"assistant","content":"The cache "}]"#;
        assert_eq!(
            continued(m, false).unwrap(),
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nThe cache "
        );
        let e = continued(m, true).unwrap_err().to_string();
        assert!(e.contains("add_generation_prompt"), "{e}");
        let image_only = r#"[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]"#;
        let e = continued(image_only, false).unwrap_err().to_string();
        assert!(e.contains("no text to continue"), "{e}");
    }

    #[test]
    fn one_image() {
        let (q2, q3) = both();
        let m = messages(
            r#"[{"role":"user","content":[
                {"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA"}},
                {"type":"text","text":"What is this?"}]}]"#,
        );
        assert_eq!(
            q2.render(&m, true).unwrap(),
            format!("{Q2_SYSTEM}<|im_start|>user\n{VISION}What is this?<|im_end|>\n<|im_start|>assistant\n")
        );
        assert_eq!(
            q3.render(&m, true).unwrap(),
            format!("<|im_start|>user\n{VISION}What is this?<|im_end|>\n<|im_start|>assistant\n")
        );
    }

    #[test]
    fn two_images_with_vision_ids() {
        let (q2, q3) = both();
        let m = messages(
            r#"[{"role":"system","content":"Be brief."},{"role":"user","content":[
                {"type":"text","text":"Compare "},
                {"type":"image","image":"/tmp/a.png"},
                {"type":"text","text":" and "},
                {"type":"image_url","image_url":{"url":"file:///tmp/b.jpg"}}]}]"#,
        );
        let expected = format!(
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nCompare {VISION} and {VISION}<|im_end|>\n\
             <|im_start|>assistant\n"
        );
        assert_eq!(q2.render(&m, true).unwrap(), expected);
        assert_eq!(q3.render(&m, true).unwrap(), expected);
        let with_ids = q2
            .render_with(
                &m,
                RenderOptions {
                    add_generation_prompt: false,
                    add_vision_id: true,
                    continue_final_message: false,
                },
            )
            .unwrap();
        assert_eq!(
            with_ids,
            format!(
                "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nCompare Picture 1: {VISION} and \
                 Picture 2: {VISION}<|im_end|>\n"
            )
        );
        assert_eq!(
            image_sources(&m).unwrap(),
            vec![
                ImageSource::Path("/tmp/a.png".into()),
                ImageSource::Path("/tmp/b.jpg".into())
            ]
        );
    }

    #[test]
    fn empty_and_unreadable_image_urls_are_refused_by_name() {
        for (url, says) in [
            ("", "empty"),
            ("  ", "empty"),
            ("ftp://host/a.png", "ftp://"),
            ("s3://b/k", "s3://"),
        ] {
            let e = ImageSource::parse(url).unwrap_err();
            assert!(matches!(e, InputError::ImageUrl(_)), "{url:?}: {e}");
            assert!(e.to_string().contains(says), "{url:?}: {e}");
        }
        assert_eq!(
            ImageSource::parse("FILE:///tmp/a.png").unwrap(),
            ImageSource::Path("/tmp/a.png".into())
        );
    }

    #[test]
    fn multi_turn() {
        let (q2, q3) = both();
        let m = messages(
            r#"[{"role":"user","content":[{"type":"image_url","image_url":{"url":"https://x/y.png"}},
                                          {"type":"text","text":"Describe."}]},
                {"role":"assistant","content":"A cat."},
                {"role":"user","content":[{"type":"text","text":"Colour?"}]}]"#,
        );
        let turns = format!(
            "<|im_start|>user\n{VISION}Describe.<|im_end|>\n<|im_start|>assistant\nA cat.<|im_end|>\n\
             <|im_start|>user\nColour?<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(q2.render(&m, true).unwrap(), format!("{Q2_SYSTEM}{turns}"));
        assert_eq!(q3.render(&m, true).unwrap(), turns);
        assert_eq!(m[0].image_urls(), vec!["https://x/y.png"]);
        assert_eq!(
            image_sources(&m).unwrap(),
            vec![ImageSource::Remote("https://x/y.png".into())]
        );
    }

    #[test]
    fn hf_features() {
        let t = ChatTemplate::new(
            "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}\
             {{ m.role.upper() }}:{{ m.content.strip().split(' ')|tojson }}{{ m.content.startswith(' ') }}|\
             {% endfor %}{{ {'a': [1, 2.5, none, true], 'b': '<\"é\\n'}|tojson }}\
             {{ {'k': 1}|tojson(indent=2) }}{{ tools is none }}",
        )
        .unwrap();
        let m = messages(
            r#"[{"role":"user","content":" a b "},{"role":"assistant","content":"c"},{"role":"user","content":"d"}]"#,
        );
        assert_eq!(
            t.render(&m, false).unwrap(),
            "USER:[\"a\", \"b\"]True|ASSISTANT:[\"c\"]False|{\"a\": [1, 2.5, null, true], \"b\": \"<\\\"é\\n\"}\
             {\n  \"k\": 1\n}True"
        );
    }

    #[test]
    fn raise_exception_is_an_error() {
        let t = ChatTemplate::new("{{ raise_exception('System role not supported') }}").unwrap();
        let err = t.render(&[], true).unwrap_err();
        assert_eq!(
            err,
            InputError::Template("template raised: System role not supported".into())
        );
        assert!(matches!(ChatTemplate::new("{% if %}"), Err(InputError::Template(_))));
    }

    #[test]
    fn template_selection() {
        let list = r#"{"chat_template":[{"name":"tool_use","template":"T"},{"name":"default","template":"D"}]}"#;
        assert_eq!(
            select_chat_template(None, None, Some(list)).unwrap().as_deref(),
            Some("D")
        );
        let only = r#"{"chat_template":[{"name":"rag","template":"R"}]}"#;
        assert_eq!(
            select_chat_template(None, None, Some(only)).unwrap().as_deref(),
            Some("R")
        );
        let string = r#"{"chat_template":"S"}"#;
        assert_eq!(
            select_chat_template(None, None, Some(string)).unwrap().as_deref(),
            Some("S")
        );
        assert_eq!(
            select_chat_template(None, Some(r#"{"chat_template":"J"}"#), Some(string))
                .unwrap()
                .as_deref(),
            Some("J")
        );
        assert_eq!(
            select_chat_template(Some("X"), Some("{}"), Some(string))
                .unwrap()
                .as_deref(),
            Some("X")
        );
        assert_eq!(select_chat_template(None, Some("{}"), Some("{}")).unwrap(), None);
        assert!(matches!(
            select_chat_template(None, None, Some("{nope")),
            Err(InputError::TemplateSource(_))
        ));
    }

    #[test]
    fn image_sources_decode_data_urls() {
        let m = messages(
            r#"[{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:image/png;base64,aGk="}}]}]"#,
        );
        assert_eq!(image_sources(&m).unwrap(), vec![ImageSource::Bytes(b"hi".to_vec())]);
        let err = ImageSource::parse("data:image/png;base64,@@@").unwrap_err();
        assert!(matches!(err, InputError::Base64(_)), "{err}");
        assert!(err.to_string().starts_with("image data URL is not valid base64"));
        assert!(matches!(
            ImageSource::parse("data:image/png,abc"),
            Err(InputError::DataUrl(_))
        ));
    }

    #[test]
    fn bad_messages() {
        let err = ChatMessage::parse_list(r#"[{"role":"user","content":[{"type":"audio"}]}]"#).unwrap_err();
        assert!(matches!(err, InputError::Messages(_)), "{err}");
        assert!(ChatMessage::parse_list(r#"[{"role":"user","content":3}]"#).is_err());
        let null = messages(r#"[{"role":"assistant","content":null}]"#);
        assert_eq!(null[0].content, Content::Text(String::new()));
    }
}
