//! A Hugging Face checkpoint directory on disk: config, memory-mapped safetensors shards, tokenizer,
//! chat template, preprocessor and generation settings. The engine gets bytes; files stay here.

use crate::usage;
use anyhow::{Context, Result};
use kvlens_engine::arch::config::ModelConfig;
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
    /// `(file name, mapping)` of every safetensors shard.
    pub shards: Vec<(String, Mmap)>,
    /// tokenizer.json text.
    pub tokenizer_json: Vec<u8>,
    /// chat_template.jinja, chat_template.json or tokenizer_config.json text, whichever exists.
    pub template_files: TemplateFiles,
    /// preprocessor_config.json text, if any.
    pub preprocessor_json: Option<String>,
    /// End-of-sequence ids from generation_config.json (falls back to the config's).
    pub eos_token_ids: Vec<u32>,
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
    /// Opens a checkpoint directory.
    pub fn open(dir: &Path) -> Result<Self> {
        if !dir.is_dir() {
            return Err(usage(format!("{} is not a directory", dir.display())));
        }
        let cfg_path = dir.join("config.json");
        let text = read_opt(&cfg_path)?.ok_or_else(|| usage(format!("{} has no config.json", dir.display())))?;
        let config = ModelConfig::from_json(&text).map_err(|e| usage(format!("{}: {e}", cfg_path.display())))?;
        let mut shards = Vec::new();
        for name in shard_names(dir)? {
            let path = dir.join(&name);
            let file = File::open(&path).map_err(|e| usage(format!("cannot open {}: {e}", path.display())))?;
            // Safety is not an issue here: the mapping is read-only and the file is not modified while we run.
            let map = map_file(&file).with_context(|| format!("cannot map {}", path.display()))?;
            shards.push((name, map));
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
            shards,
            tokenizer_json,
            template_files,
            preprocessor_json: read_opt(&dir.join("preprocessor_config.json"))?,
            eos_token_ids,
        })
    }

    /// Total bytes of the weight files.
    pub fn weight_bytes(&self) -> u64 {
        self.shards.iter().map(|(_, m)| m.len() as u64).sum()
    }
}

#[allow(unsafe_code)]
fn map_file(file: &File) -> std::io::Result<Mmap> {
    // SAFETY: the mapping is read-only; a checkpoint file changed underneath a running process is
    // outside what kvlens supports (as with every engine that maps weights).
    unsafe { Mmap::map(file) }
}
