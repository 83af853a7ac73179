//! A Hugging Face Qwen-VL checkpoint written as the GGUF pair llama.cpp's converter
//! (`convert_hf_to_gguf.py`, and with `--mmproj` for the projector) writes for it: the same
//! metadata, tensor names, splits and tensor types, so that a test can hold our files against a
//! summary of the converter's (`tools/gguf/converter_summaries.py`) and the rest of the tests can
//! use files made here, without torch. The converter's type rules: vectors, norms, biases and the
//! vision position table in f32; the patch embedding in f16 for an f16 file, else f32; every
//! other matrix in the file's type, or f16 where its rows do not split into blocks.

use super::config::{Family, ModelConfig, VisionConfig};
use super::ggml::GgmlType;
use super::gguf::{GgufError, MetaValue};
use super::gguf_model::{text_gguf_name, vision_gguf_names};
use super::gguf_write::GgufWriter;
use serde_json::Value;

type Result<T> = std::result::Result<T, GgufError>;

fn err<T>(msg: impl Into<String>) -> Result<T> {
    Err(GgufError(msg.into()))
}

/// What a checkpoint folder holds besides its tensors.
#[derive(Debug)]
pub struct CheckpointText<'a> {
    /// `config.json`.
    pub config: &'a Value,
    /// `tokenizer.json`.
    pub tokenizer_json: &'a str,
    /// The chat template.
    pub chat_template: &'a str,
    /// `image_mean` and `image_std` of `preprocessor_config.json`.
    pub mean_std: ([f32; 3], [f32; 3]),
    /// `general.name` (the converter's is made from the folder's name).
    pub name: &'a str,
}

/// The file types a pair can be written in, as `--outtype` names them.
pub const OUT_TYPES: [GgmlType; 5] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::Bf16,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
];

/// llama.cpp's `general.file_type` of a pair written in `t`.
fn file_type(t: GgmlType) -> u32 {
    match t {
        GgmlType::F32 => 0,
        GgmlType::F16 => 1,
        GgmlType::Q4_0 => 2,
        GgmlType::Q8_0 => 7,
        _ => 32,
    }
}

/// A checkpoint's tensors by transformers name: each name and shape, and its values on demand.
pub trait TensorValues {
    /// Every tensor's name and shape, in the checkpoint's order.
    fn names(&self) -> Vec<(String, Vec<usize>)>;
    /// A tensor's values in f32.
    fn values(&mut self, name: &str) -> Result<Vec<f32>>;
}

/// Writes the text model and the projector of a checkpoint in `outtype` (one of [`OUT_TYPES`]).
pub fn export(
    ckpt: &CheckpointText<'_>,
    tensors: &mut dyn TensorValues,
    outtype: GgmlType,
) -> Result<(GgufWriter, GgufWriter)> {
    if !OUT_TYPES.contains(&outtype) {
        return err(format!(
            "{outtype} is not a type kvlens writes (f32, f16, bf16, q8_0, q4_0)"
        ));
    }
    let cfg = ModelConfig::from_value(ckpt.config).map_err(|e| GgufError(format!("config.json: {e}")))?;
    if cfg.text.linear.is_some() || cfg.text.moe.is_some() {
        return err(format!(
            "{} checkpoints are not written as GGUF yet: convert them with llama.cpp's convert_hf_to_gguf.py",
            cfg.family.model_type()
        ));
    }
    let vision = cfg.vision.as_ref().ok_or_else(|| {
        GgufError("config.json has no vision_config: kvlens writes a text model with its projector".into())
    })?;
    let deepstack: Vec<u64> = vision.deepstack_visual_indexes.iter().map(|&l| l as u64).collect();
    let mut text = GgufWriter::default();
    let mut mmproj = GgufWriter::default();
    text_metadata(&mut text, ckpt, &cfg, outtype)?;
    mmproj_metadata(&mut mmproj, ckpt, &cfg, vision, outtype);
    for (name, shape) in tensors.names() {
        let is_vision = name.starts_with("visual.") || name.starts_with("model.visual.");
        if !is_vision {
            let g = text_gguf_name(&name).ok_or_else(|| GgufError(format!("{name} has no GGUF name")))?;
            let values = tensors.values(&name)?;
            add(&mut text, &g, &shape, &values, outtype, false);
            continue;
        }
        let names = vision_gguf_names(cfg.family, &name, &deepstack)
            .ok_or_else(|| GgufError(format!("{name} has no GGUF name")))?;
        let values = tensors.values(&name)?;
        if names[0] == "v.patch_embd.weight" {
            // [out, in, 2, p, p] → two [out, in, p, p], one per time step.
            let [o, i, 2, h, w] = shape[..] else {
                return err(format!(
                    "{name} of shape {shape:?} is not a Conv3D kernel with a temporal patch of 2"
                ));
            };
            for (t, suffix) in ["", ".1"].iter().enumerate() {
                let step: Vec<f32> = values
                    .chunks_exact(2 * h * w)
                    .flat_map(|k| k[t * h * w..(t + 1) * h * w].to_vec())
                    .collect();
                add(
                    &mut mmproj,
                    &format!("{}{suffix}", names[0]),
                    &[o, i, h, w],
                    &step,
                    outtype,
                    true,
                );
            }
            continue;
        }
        // One tensor, or Qwen2/2.5-VL's qkv as its q, k and v: equal runs of rows.
        if values.is_empty() || shape.first().is_none_or(|rows| rows % names.len() != 0) {
            return err(format!(
                "{name} of shape {shape:?} does not split into {} equal parts",
                names.len()
            ));
        }
        let mut part_shape = shape.clone();
        part_shape[0] = shape[0] / names.len();
        let part = values.len() / names.len();
        for (g, values) in names.iter().zip(values.chunks_exact(part.max(1))) {
            add(&mut mmproj, g, &part_shape, values, outtype, true);
        }
    }
    text.meta("general.quantization_version", MetaValue::U32(2));
    mmproj.meta("general.quantization_version", MetaValue::U32(2));
    Ok((text, mmproj))
}

/// Adds one tensor in the type the converter picks for it.
fn add(w: &mut GgufWriter, name: &str, shape: &[usize], values: &[f32], outtype: GgmlType, vision: bool) {
    let wanted = if vision && name.starts_with("v.patch_embd.weight") {
        if outtype == GgmlType::F16 {
            GgmlType::F16
        } else {
            GgmlType::F32
        }
    } else if shape.len() <= 1
        || name.ends_with("_norm.weight")
        || !name.ends_with(".weight")
        || name == "v.position_embd.weight"
    {
        GgmlType::F32
    } else {
        outtype
    };
    let row = shape.last().copied().unwrap_or(1);
    let (t, data) = match (row % wanted.block().0 == 0).then(|| wanted.quantize(values)).flatten() {
        Some(data) => (wanted, data),
        None => (GgmlType::F16, GgmlType::F16.quantize(values).unwrap_or_default()),
    };
    w.tensor(name, shape, t, data);
}

fn s(v: &str) -> MetaValue {
    MetaValue::String(v.to_string())
}

fn u32_of(v: usize) -> MetaValue {
    MetaValue::U32(v as u32)
}

/// The text model's metadata, in the converter's order.
fn text_metadata(w: &mut GgufWriter, ckpt: &CheckpointText<'_>, cfg: &ModelConfig, outtype: GgmlType) -> Result<()> {
    let t = &cfg.text;
    let arch = if cfg.family.is_qwen3() { "qwen3vl" } else { "qwen2vl" };
    let key = |k: &str| format!("{arch}.{k}");
    w.meta("general.architecture", s(arch));
    w.meta("general.type", s("model"));
    w.meta("general.name", s(ckpt.name));
    w.meta(&key("block_count"), u32_of(t.num_hidden_layers));
    w.meta(&key("context_length"), u32_of(t.max_position_embeddings));
    w.meta(&key("embedding_length"), u32_of(t.hidden_size));
    w.meta(&key("feed_forward_length"), u32_of(t.intermediate_size));
    w.meta(&key("attention.head_count"), u32_of(t.num_attention_heads));
    w.meta(&key("attention.head_count_kv"), u32_of(t.num_key_value_heads));
    let mut sections: Vec<MetaValue> = t.mrope_section.iter().map(|&v| MetaValue::I32(v as i32)).collect();
    sections.resize(4, MetaValue::I32(0));
    w.meta(&key("rope.dimension_sections"), MetaValue::Array(sections));
    w.meta(&key("rope.freq_base"), MetaValue::F32(t.rope_theta as f32));
    w.meta(
        &key("attention.layer_norm_rms_epsilon"),
        MetaValue::F32(t.rms_norm_eps as f32),
    );
    if cfg.family.is_qwen3() {
        w.meta(&key("attention.key_length"), u32_of(t.head_dim));
        w.meta(&key("attention.value_length"), u32_of(t.head_dim));
        w.meta(&key("n_deepstack_layers"), u32_of(cfg.deepstack_levels()));
    }
    w.meta("general.file_type", MetaValue::U32(file_type(outtype)));
    vocabulary(w, ckpt, t.vocab_size)?;
    w.meta("tokenizer.chat_template", s(ckpt.chat_template));
    Ok(())
}

/// The projector's metadata, in the converter's order.
fn mmproj_metadata(
    w: &mut GgufWriter,
    ckpt: &CheckpointText<'_>,
    cfg: &ModelConfig,
    v: &VisionConfig,
    outtype: GgmlType,
) {
    let floats = |x: [f32; 3]| MetaValue::Array(x.iter().map(|&f| MetaValue::F32(f)).collect());
    w.meta("general.architecture", s("clip"));
    w.meta("general.type", s("mmproj"));
    w.meta("general.name", s(ckpt.name));
    w.meta("general.file_type", MetaValue::U32(file_type(outtype)));
    w.meta("clip.has_vision_encoder", MetaValue::Bool(true));
    w.meta("clip.vision.projection_dim", u32_of(v.out_hidden_size));
    let image_size = match cfg.family {
        Family::Qwen3Vl | Family::Qwen3VlMoe => (v.num_position_embeddings as f64).sqrt() as usize * v.patch_size,
        _ => 560,
    };
    w.meta("clip.vision.image_size", u32_of(image_size));
    w.meta("clip.vision.patch_size", u32_of(v.patch_size));
    w.meta("clip.vision.embedding_length", u32_of(v.hidden_size));
    // Qwen2-VL's converter writes the vision config's `hidden_size` (the merger's output) here.
    let ffn = if cfg.family == Family::Qwen2Vl {
        v.out_hidden_size
    } else {
        v.intermediate_size
    };
    w.meta("clip.vision.feed_forward_length", u32_of(ffn));
    w.meta("clip.vision.block_count", u32_of(v.depth));
    w.meta("clip.vision.attention.head_count", u32_of(v.num_heads));
    w.meta("clip.vision.image_mean", floats(ckpt.mean_std.0));
    w.meta("clip.vision.image_std", floats(ckpt.mean_std.1));
    let eps = MetaValue::F32(cfg.text.rms_norm_eps as f32);
    match cfg.family {
        Family::Qwen2Vl => {
            w.meta("clip.projector_type", s("qwen2vl_merger"));
            w.meta("clip.vision.attention.layer_norm_epsilon", eps);
        }
        Family::Qwen25Vl => {
            w.meta("clip.projector_type", s("qwen2.5vl_merger"));
            w.meta("clip.use_silu", MetaValue::Bool(true));
            let pattern = v.fullatt_block_indexes.first().map_or(0, |&f| f + 1);
            w.meta("clip.vision.n_wa_pattern", u32_of(pattern));
            w.meta("clip.vision.attention.layer_norm_epsilon", eps);
        }
        Family::Qwen3Vl | Family::Qwen3VlMoe | Family::Qwen35 | Family::Qwen35Moe => {
            w.meta("clip.projector_type", s("qwen3vl_merger"));
            w.meta("clip.use_gelu", MetaValue::Bool(true));
            w.meta("clip.vision.spatial_merge_size", u32_of(v.spatial_merge_size));
            w.meta("clip.vision.attention.layer_norm_epsilon", eps);
            let flags = (0..v.depth)
                .map(|l| MetaValue::Bool(v.deepstack_visual_indexes.contains(&l)))
                .collect();
            w.meta("clip.vision.is_deepstack_layers", MetaValue::Array(flags));
        }
    }
}

/// The converter's `tokenizer.ggml.*` entries from `tokenizer.json`: every id up to the
/// embedding's rows (`[PADn]`, unused, where the tokenizer has none), added tokens as control
/// tokens when special or written `<|…|>`, else user-defined; merges as `"a b"`.
fn vocabulary(w: &mut GgufWriter, ckpt: &CheckpointText<'_>, vocab_size: usize) -> Result<()> {
    let tok: Value =
        serde_json::from_str(ckpt.tokenizer_json).map_err(|e| GgufError(format!("tokenizer.json: {e}")))?;
    let mut tokens: Vec<Option<(String, i32)>> = vec![None; vocab_size];
    let vocab = tok["model"]["vocab"]
        .as_object()
        .ok_or_else(|| GgufError("tokenizer.json has no model.vocab".into()))?;
    for (text, id) in vocab {
        if let Some(slot) = id.as_u64().and_then(|id| tokens.get_mut(id as usize)) {
            *slot = Some((text.clone(), 1));
        }
    }
    for added in tok["added_tokens"].as_array().map(Vec::as_slice).unwrap_or_default() {
        let (Some(id), Some(text)) = (added["id"].as_u64(), added["content"].as_str()) else {
            continue;
        };
        let looks_special = text.starts_with("<|") && text.ends_with("|>");
        let kind = if added["special"] == Value::Bool(true) || looks_special {
            3
        } else {
            4
        };
        if let Some(slot) = tokens.get_mut(id as usize) {
            *slot = Some((text.to_string(), kind));
        }
    }
    let (texts, kinds): (Vec<MetaValue>, Vec<MetaValue>) = tokens
        .into_iter()
        .enumerate()
        .map(|(id, t)| {
            let (text, kind) = t.unwrap_or_else(|| (format!("[PAD{id}]"), 5));
            (MetaValue::String(text), MetaValue::I32(kind))
        })
        .unzip();
    let merges: Vec<MetaValue> = tok["model"]["merges"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .filter_map(|m| match m {
            Value::String(s) => Some(s.clone()),
            Value::Array(pair) => Some(format!("{} {}", pair.first()?.as_str()?, pair.get(1)?.as_str()?)),
            _ => None,
        })
        .map(MetaValue::String)
        .collect();
    let id_of = |text: &str| -> Option<MetaValue> {
        texts
            .iter()
            .position(|t| t.as_str() == Some(text))
            .map(|i| MetaValue::U32(i as u32))
    };
    let cfg = ckpt.config.get("text_config").unwrap_or(ckpt.config);
    let eos = cfg["eos_token_id"].as_u64().or(ckpt.config["eos_token_id"].as_u64());
    let bos = cfg["bos_token_id"].as_u64().or(ckpt.config["bos_token_id"].as_u64());
    w.meta("tokenizer.ggml.model", s("gpt2"));
    w.meta("tokenizer.ggml.pre", s("qwen2"));
    w.meta("tokenizer.ggml.tokens", MetaValue::Array(texts.clone()));
    w.meta("tokenizer.ggml.token_type", MetaValue::Array(kinds));
    w.meta("tokenizer.ggml.merges", MetaValue::Array(merges));
    if let Some(eos) = eos {
        w.meta("tokenizer.ggml.eos_token_id", MetaValue::U32(eos as u32));
    }
    if let Some(pad) = id_of("<|endoftext|>") {
        w.meta("tokenizer.ggml.padding_token_id", pad);
    }
    if let Some(bos) = bos {
        w.meta("tokenizer.ggml.bos_token_id", MetaValue::U32(bos as u32));
    }
    w.meta("tokenizer.ggml.add_bos_token", MetaValue::Bool(false));
    w.meta("tokenizer.ggml.add_eos_token", MetaValue::Bool(false));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::gguf::Gguf;
    use crate::input::tokenizer::Tokenizer;

    /// tokenizer.json → the converter's `tokenizer.ggml.*` → tokenizer.json again: the same ids on
    /// text with special tokens, CJK, emoji, code and long runs of whitespace and newlines.
    #[test]
    fn the_tokenizer_from_gguf_metadata_gives_tokenizer_json_s_ids() {
        let json = String::from_utf8(crate::golden::qwen_tokenizer_json()).unwrap();
        let config = serde_json::json!({ "eos_token_id": 151645, "bos_token_id": 151643 });
        let ckpt = CheckpointText {
            config: &config,
            tokenizer_json: &json,
            chat_template: "",
            mean_std: ([0.5; 3], [0.5; 3]),
            name: "t",
        };
        let mut w = GgufWriter::default();
        vocabulary(&mut w, &ckpt, 151_936).unwrap();
        let mut bytes = Vec::new();
        w.write(&mut bytes).unwrap();
        let gguf = Gguf::parse(&bytes, bytes.len() as u64).unwrap();
        let from_gguf =
            Tokenizer::from_bytes(super::super::gguf_model::tokenizer_json(&gguf).unwrap().as_bytes()).unwrap();
        let original = Tokenizer::from_bytes(json.as_bytes()).unwrap();
        let corpus = [
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is this?<|im_end|>",
            "KV 缓存不够用了：显存 80 GiB，图片 29/60 时 OOM。日本語のテキスト、한국어 텍스트。",
            "emoji 🧠🔥👩‍💻 and flags 🇯🇵 — “quotes” « guillemets »",
            "fn main() {\n\n\n\tlet x = 1;            // spaces\n    \r\n}\n",
            "                                                                            end",
            "\n\n\n\n\n\n\n\n\n\n\n\n  \t \t ",
            "<think>\n</think>\n<tool_call>{\"name\": \"x\"}</tool_call><|endoftext|>",
            "numbers 3.14159 1234567890 and 'll 've 're 'S CAPS",
        ];
        for text in corpus {
            assert_eq!(
                from_gguf.encode(text).unwrap(),
                original.encode(text).unwrap(),
                "{text:?}"
            );
            let ids = original.encode(text).unwrap();
            assert_eq!(
                from_gguf.decode(&ids, false).unwrap(),
                original.decode(&ids, false).unwrap()
            );
        }
        assert_eq!(from_gguf.vocab_size(), original.vocab_size());
    }
}
