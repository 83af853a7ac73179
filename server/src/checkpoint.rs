//! A checkpoint on disk: a Hugging Face directory (config, memory-mapped safetensors shards,
//! tokenizer, chat template, preprocessor and generation settings) or a llama.cpp GGUF pair (a text
//! model and its `mmproj-*.gguf`, memory-mapped, everything else read from their metadata). The
//! engine gets bytes; files stay here.

use crate::usage;
use anyhow::{Context, Result};
use kvlens_engine::arch::config::ModelConfig;
use kvlens_engine::arch::gguf::Gguf;
use kvlens_engine::arch::gguf_model::GgufModel;
use kvlens_engine::model::checkpoint_files;
use memmap2::Mmap;
use std::fs::File;
use std::path::{Path, PathBuf};

/// The files of a checkpoint, read and mapped.
#[derive(Debug)]
pub struct Checkpoint {
    /// The directory.
    pub dir: PathBuf,
    /// Parsed config.json.
    pub config: ModelConfig,
    /// The weights' files.
    pub weights: WeightFiles,
    /// tokenizer.json text.
    pub tokenizer_json: Vec<u8>,
    /// chat_template.jinja, chat_template.json or tokenizer_config.json text, whichever exists.
    pub template_files: TemplateFiles,
    /// preprocessor_config.json text, if any.
    pub preprocessor_json: Option<String>,
    /// End-of-sequence ids from generation_config.json (falls back to the config's).
    pub eos_token_ids: Vec<u32>,
}

/// Where the weights are.
#[derive(Debug)]
pub enum WeightFiles {
    /// `(file name, mapping)` of every safetensors shard.
    Safetensors(Vec<(String, Mmap)>),
    /// A GGUF text model and its projector (or the text model alone).
    Gguf(GgufPair),
}

/// A GGUF text model and its projector, mapped, with their headers.
#[derive(Debug)]
pub struct GgufPair {
    /// The text model's mapping and header.
    pub text: (Mmap, Gguf),
    /// The projector's mapping and header; None for a text model alone.
    pub mmproj: Option<(Mmap, Gguf)>,
}

impl GgufPair {
    /// The pair read as a checkpoint (checked when it was opened).
    pub fn model(&self) -> Result<GgufModel<'_>> {
        GgufModel::new(&self.text.1, self.mmproj.as_ref().map(|m| &m.1)).map_err(|e| usage(e.to_string()))
    }

    /// The projector's bytes (empty for a text model alone).
    pub fn mmproj_bytes(&self) -> &[u8] {
        self.mmproj.as_ref().map_or(&[], |m| &m.0[..])
    }
}

/// The files a chat template may come from.
#[derive(Debug, Default)]
pub struct TemplateFiles {
    /// chat_template.jinja.
    pub jinja: Option<String>,
    /// chat_template.json.
    pub json: Option<String>,
    /// tokenizer_config.json.
    pub tokenizer_config: Option<String>,
}

impl TemplateFiles {
    /// Reads whichever of the three files a directory has.
    pub fn read(dir: &Path) -> Result<Self> {
        Ok(TemplateFiles {
            jinja: read_opt(&dir.join("chat_template.jinja"))?,
            json: read_opt(&dir.join("chat_template.json"))?,
            tokenizer_config: read_opt(&dir.join("tokenizer_config.json"))?,
        })
    }
}

fn read_opt(path: &Path) -> Result<Option<String>> {
    match std::fs::read_to_string(path) {
        Ok(s) => Ok(Some(s)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(usage(format!("cannot read {}: {e}", path.display()))),
    }
}

/// Safetensors shard file names: from model.safetensors.index.json, else model.safetensors.
fn shard_names(dir: &Path) -> Result<Vec<String>> {
    let index = dir.join("model.safetensors.index.json");
    if let Some(text) = read_opt(&index)? {
        return checkpoint_files::shard_names(&text).map_err(|e| usage(format!("{}: {e}", index.display())));
    }
    if dir.join("model.safetensors").is_file() {
        return Ok(vec!["model.safetensors".into()]);
    }
    Err(usage(format!(
        "{} has neither model.safetensors nor model.safetensors.index.json",
        dir.display()
    )))
}

impl Checkpoint {
    /// Opens a checkpoint: a Hugging Face directory; a GGUF text model with its projector
    /// (`mmproj`, as llama.cpp's `--mmproj`) or without one (a language model alone, which
    /// refuses images); or a directory holding one text GGUF and at most one `mmproj-*.gguf`, as
    /// the Hub's GGUF repositories do.
    pub fn open(model: &Path, mmproj: Option<&Path>) -> Result<Self> {
        if model.is_file() {
            return Self::open_gguf(model, mmproj);
        }
        if !model.is_dir() {
            return Err(usage(format!("{} is neither a directory nor a file", model.display())));
        }
        if !model.join("config.json").is_file() {
            if let Some((text, found)) = gguf_files(model)? {
                return Self::open_gguf(&text, mmproj.or(found.as_deref()));
            }
        }
        if let Some(m) = mmproj {
            return Err(usage(format!(
                "--mmproj {} goes with a GGUF model; {} is a Hugging Face checkpoint",
                m.display(),
                model.display()
            )));
        }
        Self::open_dir(model)
    }

    /// Opens a Hugging Face checkpoint directory.
    fn open_dir(dir: &Path) -> Result<Self> {
        let cfg_path = dir.join("config.json");
        let text = read_opt(&cfg_path)?.ok_or_else(|| usage(format!("{} has no config.json", dir.display())))?;
        let config = ModelConfig::from_json(&text).map_err(|e| usage(format!("{}: {e}", cfg_path.display())))?;
        let mut shards = Vec::new();
        for name in shard_names(dir)? {
            let path = dir.join(&name);
            shards.push((name, map_path(&path)?));
        }
        let tok_path = dir.join("tokenizer.json");
        let tokenizer_json =
            std::fs::read(&tok_path).map_err(|e| usage(format!("cannot read {}: {e}", tok_path.display())))?;
        let template_files = TemplateFiles::read(dir)?;
        let gen_path = dir.join("generation_config.json");
        let eos_token_ids = checkpoint_files::eos_token_ids(&config, read_opt(&gen_path)?.as_deref())
            .map_err(|e| usage(format!("{}: {e}", gen_path.display())))?;
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            config,
            weights: WeightFiles::Safetensors(shards),
            tokenizer_json,
            template_files,
            preprocessor_json: read_opt(&dir.join("preprocessor_config.json"))?,
            eos_token_ids,
        })
    }

    /// Opens a GGUF text model and its projector, if given.
    fn open_gguf(text: &Path, mmproj: Option<&Path>) -> Result<Self> {
        let header = |path: &Path| -> Result<(Mmap, Gguf)> {
            let map = map_path(path)?;
            let gguf = Gguf::parse(&map, map.len() as u64).map_err(|e| usage(format!("{}: {e}", path.display())))?;
            Ok((map, gguf))
        };
        let pair = GgufPair {
            text: header(text)?,
            mmproj: mmproj.map(header).transpose()?,
        };
        let files = GgufModel::new(&pair.text.1, pair.mmproj.as_ref().map(|m| &m.1))
            .and_then(|m| m.small_files())
            .map_err(|e| match mmproj {
                Some(m) => usage(format!("{} with {}: {e}", text.display(), m.display())),
                None => usage(format!("{}: {e}", text.display())),
            })?;
        if files.config.vision.is_none() {
            tracing::warn!(
                "{} without a projector (--mmproj mmproj-*.gguf): a language model alone, requests with images are refused",
                text.display()
            );
        }
        Ok(Checkpoint {
            dir: text.parent().unwrap_or(Path::new(".")).to_path_buf(),
            config: files.config,
            weights: WeightFiles::Gguf(pair),
            tokenizer_json: files.tokenizer_json.into_bytes(),
            template_files: TemplateFiles {
                jinja: files.chat_template,
                ..TemplateFiles::default()
            },
            preprocessor_json: files.preprocessor_json,
            eos_token_ids: files.eos_token_ids,
        })
    }

    /// Total bytes of the weight files.
    pub fn weight_bytes(&self) -> u64 {
        match &self.weights {
            WeightFiles::Safetensors(shards) => shards.iter().map(|(_, m)| m.len() as u64).sum(),
            WeightFiles::Gguf(p) => (p.text.0.len() + p.mmproj_bytes().len()) as u64,
        }
    }
}

/// The text GGUF and the projector (`mmproj*.gguf`) of a directory, if it holds any GGUF.
fn gguf_files(dir: &Path) -> Result<Option<(PathBuf, Option<PathBuf>)>> {
    let listing = std::fs::read_dir(dir).map_err(|e| usage(format!("cannot list {}: {e}", dir.display())))?;
    let names: Vec<String> = listing.filter_map(|e| e.ok()?.file_name().into_string().ok()).collect();
    match checkpoint_files::gguf_pair(&names) {
        Ok(pair) => Ok(pair.map(|(text, mmproj)| (dir.join(text), mmproj.map(|m| dir.join(m))))),
        Err(e) => Err(usage(format!(
            "{}: {e}; name the files with --model FILE.gguf --mmproj FILE.gguf",
            dir.display()
        ))),
    }
}

/// A file mapped read-only.
fn map_path(path: &Path) -> Result<Mmap> {
    let file = File::open(path).map_err(|e| usage(format!("cannot open {}: {e}", path.display())))?;
    map_file(&file).with_context(|| format!("cannot map {}", path.display()))
}

#[allow(unsafe_code)]
fn map_file(file: &File) -> std::io::Result<Mmap> {
    // SAFETY: the mapping is read-only; a checkpoint file changed underneath a running process is
    // outside what kvlens supports (as with every engine that maps weights).
    unsafe { Mmap::map(file) }
}
