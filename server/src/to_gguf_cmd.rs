//! `kvlens to-gguf`: a Hugging Face Qwen-VL checkpoint written as the GGUF pair llama.cpp's
//! converter writes for it (a text model and an `mmproj-*.gguf`), in f32, f16, bf16, q8_0 or q4_0,
//! named as the Hub's GGUF repositories name them.

use crate::checkpoint::{Checkpoint, WeightFiles};
use crate::usage;
use anyhow::{Context, Result};
use kvlens_engine::arch::ggml::GgmlType;
use kvlens_engine::arch::gguf_export::{export, CheckpointText, OUT_TYPES};
use kvlens_engine::input::image::ProcessorSettings;
use kvlens_engine::model::weights::SafetensorsFiles;
use std::path::{Path, PathBuf};

/// Flags of `kvlens to-gguf`.
#[derive(Debug, clap::Args)]
pub struct ToGgufArgs {
    /// The Hugging Face checkpoint directory.
    #[arg(long)]
    pub model: PathBuf,
    /// The type of the weight matrices: f32, f16, bf16, q8_0 or q4_0 (norms, biases and the
    /// vision position table stay f32, as llama.cpp's converter keeps them).
    #[arg(long, default_value = "f16", value_parser = parse_type)]
    pub outtype: GgmlType,
    /// Directory to write `NAME-TYPE.gguf` and `mmproj-NAME-TYPE.gguf` into (created when missing).
    #[arg(long)]
    pub out: PathBuf,
}

/// A type `--outtype` names (case-insensitive).
pub fn parse_type(s: &str) -> Result<GgmlType, String> {
    OUT_TYPES
        .into_iter()
        .find(|t| t.name().eq_ignore_ascii_case(s))
        .ok_or_else(|| format!("{s:?} is not one of f32, f16, bf16, q8_0, q4_0"))
}

/// Writes the pair; returns the two paths.
pub fn write_pair(model: &Path, outtype: GgmlType, out: &Path) -> Result<(PathBuf, PathBuf)> {
    if !model.is_dir() {
        return Err(usage(format!(
            "--model {}: to-gguf reads a Hugging Face checkpoint directory",
            model.display()
        )));
    }
    let ckpt = Checkpoint::open(model, None)?;
    let WeightFiles::Safetensors(shards) = &ckpt.weights else {
        return Err(usage(format!("{} is a GGUF model already", model.display())));
    };
    let config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(model.join("config.json"))?)?;
    let settings =
        ProcessorSettings::new(&ckpt.config, ckpt.preprocessor_json.as_deref()).map_err(|e| usage(e.to_string()))?;
    let t = &ckpt.template_files;
    let template = kvlens_engine::input::chat::select_chat_template(
        t.jinja.as_deref(),
        t.json.as_deref(),
        t.tokenizer_config.as_deref(),
    )
    .map_err(|e| usage(e.to_string()))?
    .ok_or_else(|| usage(format!("{} has no chat template", model.display())))?;
    let tokenizer_json = std::str::from_utf8(&ckpt.tokenizer_json).map_err(|_| usage("tokenizer.json is not UTF-8"))?;
    let name = model
        .canonicalize()
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "model".into());
    let text = CheckpointText {
        config: &config,
        tokenizer_json,
        chat_template: &template,
        mean_std: (settings.image_mean, settings.image_std),
        name: &name,
    };
    let shards: Vec<(String, &[u8])> = shards.iter().map(|(n, m)| (n.clone(), &m[..])).collect();
    let mut tensors = SafetensorsFiles::parse(&shards).map_err(|e| usage(e.to_string()))?;
    let (text_file, mmproj_file) =
        export(&text, &mut tensors, outtype).map_err(|e| usage(format!("{}: {e}", model.display())))?;
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    let paths = (
        out.join(format!("{name}-{}.gguf", outtype.name())),
        out.join(format!("mmproj-{name}-{}.gguf", outtype.name())),
    );
    for (file, path) in [(&text_file, &paths.0), (&mmproj_file, &paths.1)] {
        let mut w = std::io::BufWriter::new(
            std::fs::File::create(path).with_context(|| format!("cannot create {}", path.display()))?,
        );
        file.write(&mut w)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(paths)
}

/// Runs `kvlens to-gguf`.
pub fn run(a: &ToGgufArgs) -> Result<()> {
    let (text, mmproj) = write_pair(&a.model, a.outtype, &a.out)?;
    println!("{}\n{}", text.display(), mmproj.display());
    Ok(())
}
