//! The requests of a run: `synthetic-vision` (seeded VisionArena-like chats, see `synth`),
//! `random` (token-ish text of `--random-input-len` tokens, as vLLM's random dataset) and `jsonl`
//! (`{"prompt": …, "image": path|URL|null, "output_len": …}` per line).

use super::synth;
use super::tokens::Counter;
use crate::UsageError;
use anyhow::{Context, Result};
use base64::Engine as _;
use rand::rngs::StdRng;
use rand::Rng;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Output length when neither `--output-len` nor the dataset gives one (vLLM's VisionArena and
/// random defaults).
pub const DEFAULT_OUTPUT_LEN: usize = 128;

/// One request to send.
#[derive(Debug, Clone, PartialEq)]
pub struct BenchRequest {
    /// The user's text.
    pub prompt: String,
    /// Tokens of the text alone (vLLM's `prompt_len`: no chat template, no image).
    pub prompt_len: usize,
    /// Tokens of the templated conversation without the image's placeholder tokens.
    pub chat_text_len: usize,
    /// `max_completion_tokens`.
    pub output_len: usize,
    /// The image's URL (usually a data URL), shared by the requests that reuse it.
    pub image: Option<Arc<str>>,
}

/// `--dataset-name`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DatasetName {
    /// Seeded VisionArena-like chat requests with one image each.
    SyntheticVision,
    /// Random token text.
    Random,
    /// A JSON-lines file.
    Jsonl,
}

/// What a dataset is built from.
#[derive(Debug, Clone)]
pub struct DatasetSpec {
    /// Which dataset.
    pub name: DatasetName,
    /// The JSON-lines file of `jsonl`.
    pub path: Option<PathBuf>,
    /// How many requests.
    pub num_prompts: usize,
    /// `--output-len`: overrides every request's output length.
    pub output_len: Option<usize>,
    /// `--random-input-len`.
    pub random_input_len: usize,
    /// `--image-reuse-ratio`.
    pub image_reuse_ratio: f64,
}

/// A request before its tokens are counted.
struct Draft {
    prompt: String,
    image: Option<Arc<str>>,
    output_len: Option<usize>,
}

/// Builds the requests, drawing from `rng`.
pub fn build(spec: &DatasetSpec, counter: &Counter, rng: &mut StdRng) -> Result<Vec<BenchRequest>> {
    let drafts = match spec.name {
        DatasetName::SyntheticVision => synthetic_vision(spec, rng)?,
        DatasetName::Random => random(spec, counter, rng)?,
        DatasetName::Jsonl => {
            let path = spec
                .path
                .as_deref()
                .ok_or_else(|| UsageError("--dataset-name jsonl needs --dataset-path FILE".into()))?;
            jsonl(path, spec.num_prompts)?
        }
    };
    drafts
        .into_iter()
        .map(|d| {
            Ok(BenchRequest {
                prompt_len: counter.count(&d.prompt)?,
                chat_text_len: counter.chat_text_len(&d.prompt, d.image.is_some())?,
                output_len: spec.output_len.or(d.output_len).unwrap_or(DEFAULT_OUTPUT_LEN),
                prompt: d.prompt,
                image: d.image,
            })
        })
        .collect()
}

fn synthetic_vision(spec: &DatasetSpec, rng: &mut StdRng) -> Result<Vec<Draft>> {
    if !(0.0..=1.0).contains(&spec.image_reuse_ratio) {
        return Err(UsageError(format!(
            "--image-reuse-ratio {} is outside 0..1",
            spec.image_reuse_ratio
        ))
        .into());
    }
    let plan = synth::plan(spec.num_prompts, spec.image_reuse_ratio, rng);
    let mix: Vec<String> = synth::SIZE_MIX
        .iter()
        .enumerate()
        .map(|(i, c)| (plan.images.iter().filter(|s| s.class == i).count(), c))
        .filter(|(n, _)| *n > 0)
        .map(|(n, c)| format!("{n} {} ({}×{})", c.name, c.width, c.height))
        .collect();
    eprintln!(
        "Drawing {} synthetic-vision images for {} requests: {}",
        plan.images.len(),
        spec.num_prompts,
        mix.join(", ")
    );
    let urls = synth::data_urls(&plan.images)?;
    Ok(plan
        .prompts
        .iter()
        .zip(&plan.image_of)
        .map(|(prompt, &img)| Draft {
            prompt: prompt.to_string(),
            image: Some(urls[img].clone()),
            output_len: None,
        })
        .collect())
}

/// vLLM's random dataset: `input_len` consecutive token ids from a random offset (shifted by the
/// request's index), decoded to text and re-encoded until the text has `input_len` tokens: cut
/// when longer, topped up with random ids when shorter, at most 10 times
/// (`gen_prompt_decode_to_target_len`).
fn random(spec: &DatasetSpec, counter: &Counter, rng: &mut StdRng) -> Result<Vec<Draft>> {
    let tok = counter.tokenizer().ok_or_else(|| {
        UsageError(
            "--dataset-name random needs --tokenizer DIR: it draws token ids from the tokenizer's vocabulary".into(),
        )
    })?;
    let vocab = tok.vocab_size() as u32;
    let target = spec.random_input_len;
    (0..spec.num_prompts)
        .map(|i| {
            let offset = rng.random_range(0..vocab);
            let mut ids: Vec<u32> = (0..target as u32).map(|j| (offset + i as u32 + j) % vocab).collect();
            let mut prompt = tok.decode(&ids, true)?;
            for _ in 0..10 {
                ids = tok.encode(&prompt)?;
                if ids.len() == target {
                    break;
                }
                if ids.len() > target {
                    ids.truncate(target);
                } else {
                    let missing = target - ids.len();
                    ids.extend((0..missing).map(|_| rng.random_range(0..vocab)));
                }
                prompt = tok.decode(&ids, true)?;
            }
            Ok(Draft {
                prompt,
                image: None,
                output_len: None,
            })
        })
        .collect()
}

/// Reads up to `num_prompts` lines, repeating the file when it has fewer (vLLM's oversampling).
/// Image paths are relative to the file's directory; files are sent as data URLs, URLs as given.
fn jsonl(path: &Path, num_prompts: usize) -> Result<Vec<Draft>> {
    let usage = |m: String| anyhow::Error::from(UsageError(m));
    let text = std::fs::read_to_string(path).map_err(|e| usage(format!("cannot read {}: {e}", path.display())))?;
    let dir = path.parent().unwrap_or(Path::new("."));
    let mut images: HashMap<String, Arc<str>> = HashMap::new();
    let mut lines = Vec::new();
    for (n, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let at = || format!("{}:{}", path.display(), n + 1);
        let v: serde_json::Value = serde_json::from_str(line).map_err(|e| usage(format!("{}: {e}", at())))?;
        let prompt = v
            .get("prompt")
            .and_then(|p| p.as_str())
            .ok_or_else(|| usage(format!("{}: no \"prompt\" string", at())))?;
        let image = match v.get("image").and_then(|i| i.as_str()) {
            None => None,
            Some(reference) => Some(match images.get(reference) {
                Some(url) => url.clone(),
                None => {
                    let url: Arc<str> = image_url(reference, dir).with_context(at)?.into();
                    images.insert(reference.to_string(), url.clone());
                    url
                }
            }),
        };
        let output_len = v.get("output_len").and_then(|o| o.as_u64()).map(|o| o as usize);
        lines.push((prompt.to_string(), image, output_len));
    }
    if lines.is_empty() {
        return Err(usage(format!("{} has no requests", path.display())));
    }
    Ok(lines
        .iter()
        .cycle()
        .take(num_prompts)
        .map(|(prompt, image, output_len)| Draft {
            prompt: prompt.clone(),
            image: image.clone(),
            output_len: *output_len,
        })
        .collect())
}

/// An image reference of a JSON line as the URL to send.
fn image_url(reference: &str, dir: &Path) -> Result<String> {
    if ["data:", "http://", "https://", "file://"]
        .iter()
        .any(|p| reference.starts_with(p))
    {
        return Ok(reference.to_string());
    }
    let path = dir.join(reference);
    let bytes = std::fs::read(&path).map_err(|e| UsageError(format!("cannot read image {}: {e}", path.display())))?;
    let mime = match image::guess_format(&bytes) {
        Ok(format) => format.to_mime_type(),
        Err(_) => return Err(UsageError(format!("{} is not an image", path.display())).into()),
    };
    Ok(format!(
        "data:{mime};base64,{}",
        base64::engine::general_purpose::STANDARD.encode(bytes)
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jsonl_lines_images_and_oversampling() {
        let dir = tempfile::tempdir().unwrap();
        let png = dir.path().join("a.png");
        image::RgbImage::new(4, 3).save(&png).unwrap();
        let file = dir.path().join("reqs.jsonl");
        std::fs::write(
            &file,
            "{\"prompt\": \"one\", \"image\": \"a.png\", \"output_len\": 7}\n\n\
             {\"prompt\": \"two\", \"image\": null}\n\
             {\"prompt\": \"three\", \"image\": \"https://x/y.jpg\"}\n",
        )
        .unwrap();
        let d = jsonl(&file, 5).unwrap();
        let prompts: Vec<&str> = d.iter().map(|d| d.prompt.as_str()).collect();
        assert_eq!(prompts, ["one", "two", "three", "one", "two"]);
        assert!(d[0].image.as_deref().unwrap().starts_with("data:image/png;base64,"));
        assert!(Arc::ptr_eq(d[0].image.as_ref().unwrap(), d[3].image.as_ref().unwrap()));
        assert_eq!((d[0].output_len, d[1].output_len), (Some(7), None));
        assert_eq!(d[1].image, None);
        assert_eq!(d[2].image.as_deref(), Some("https://x/y.jpg"));

        std::fs::write(&file, "{\"prompt\": \"x\", \"image\": \"missing.png\"}\n").unwrap();
        let err = format!("{:#}", jsonl(&file, 1).err().unwrap());
        assert!(err.contains("reqs.jsonl:1") && err.contains("missing.png"), "{err}");
        std::fs::write(&file, "{\"text\": \"x\"}\n").unwrap();
        assert!(format!("{:#}", jsonl(&file, 1).err().unwrap()).contains("no \"prompt\""));
    }
}
