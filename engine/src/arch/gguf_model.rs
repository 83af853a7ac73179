//! A llama.cpp Qwen-VL GGUF pair read as the Hugging Face checkpoint it was converted from: the
//! text model (`general.architecture` `qwen2vl` or `qwen3vl`) and its projector (`clip`, the Hub's
//! `mmproj-*.gguf`, projector type `qwen2vl_merger`, `qwen2.5vl_merger` or `qwen3vl_merger`).
//!
//! [`GgufModel`] gives what the rest of the engine reads from a checkpoint folder: `config.json`
//! ([`GgufModel::config_json`]), `tokenizer.json` ([`GgufModel::tokenizer_json`], from
//! `tokenizer.ggml.*`), the chat template, and for each tensor the model reads under its
//! transformers name the GGUF tensors that hold it ([`GgufModel::tensors`]). llama.cpp's converter
//! (`convert_hf_to_gguf.py`, `conversion/qwenvl.py`, `conversion/qwen3vl.py`) renames every tensor,
//! splits the vision attention's `qkv` into `q`, `k`, `v` (Qwen2/2.5-VL) and the 3-D patch
//! embedding into two 2-D ones along time; [`Assembly`] undoes both.

use super::config::{Family, ModelConfig};
use super::ggml::GgmlType;
use super::gguf::{Gguf, GgufError, GgufTensor, MetaValue};
use serde_json::{json, Value};
use std::collections::BTreeMap;

type Result<T> = std::result::Result<T, GgufError>;

fn err<T>(msg: impl Into<String>) -> Result<T> {
    Err(GgufError(msg.into()))
}

/// Which file of the pair a tensor is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// The text model.
    Text,
    /// The projector (vision tower and merger).
    Mmproj,
}

/// A GGUF tensor of the pair: its file and its index in that file's tensor table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// The file.
    pub part: Part,
    /// Index into [`Gguf::tensors`].
    pub index: usize,
}

/// How a transformers tensor is made from the file's tensors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Assembly {
    /// One tensor as stored.
    One(Piece),
    /// The rows of several tensors one after another (`q`, `k`, `v` into `qkv`).
    Rows(Vec<Piece>),
    /// A Conv3D kernel `[out, in, 2, p, p]` from its two time steps `[out, in, p, p]`.
    Temporal([Piece; 2]),
}

/// A pair's equivalents of a checkpoint folder's small files ([`GgufModel::small_files`]).
#[derive(Debug, Clone)]
pub struct GgufSmallFiles {
    /// config.json, parsed.
    pub config: ModelConfig,
    /// tokenizer.json.
    pub tokenizer_json: String,
    /// The chat template, when the file has one.
    pub chat_template: Option<String>,
    /// preprocessor_config.json (the image mean and std); None for a text model alone.
    pub preprocessor_json: Option<String>,
    /// The ids that end a generation.
    pub eos_token_ids: Vec<u32>,
}

/// A text GGUF and its projector, checked to belong together; or a text GGUF alone, a language
/// model that takes no images (what llama.cpp runs without `--mmproj`).
#[derive(Debug)]
pub struct GgufModel<'a> {
    text: &'a Gguf,
    mmproj: Option<&'a Gguf>,
    family: Family,
}

/// The metadata key `key` as an unsigned integer.
fn u64_of(g: &Gguf, key: &str) -> Result<u64> {
    match g.get(key) {
        Some(v) => v
            .as_u64()
            .ok_or_else(|| GgufError(format!("{key} is {v:?}, not an integer"))),
        None => err(format!("{key} is missing")),
    }
}

fn f64_of(g: &Gguf, key: &str) -> Result<f64> {
    match g.get(key) {
        Some(v) => v
            .as_f64()
            .ok_or_else(|| GgufError(format!("{key} is {v:?}, not a number"))),
        None => err(format!("{key} is missing")),
    }
}

fn str_of<'g>(g: &'g Gguf, key: &str) -> Result<&'g str> {
    match g.get(key) {
        Some(v) => v
            .as_str()
            .ok_or_else(|| GgufError(format!("{key} is {v:?}, not a string"))),
        None => err(format!("{key} is missing")),
    }
}

fn array_of<'g>(g: &'g Gguf, key: &str) -> Result<&'g [MetaValue]> {
    match g.get(key) {
        Some(v) => v.as_array().ok_or_else(|| GgufError(format!("{key} is not an array"))),
        None => err(format!("{key} is missing")),
    }
}

/// The text architectures llama.cpp writes for the Qwen-VL families.
const TEXT_ARCHITECTURES: [&str; 2] = ["qwen2vl", "qwen3vl"];

impl<'a> GgufModel<'a> {
    /// Checks that `text` is a Qwen-VL text model and `mmproj`, when given, its projector: the
    /// architectures, the projector type and the projector's output width against the text
    /// model's width. A text model alone reads as Qwen2-VL or Qwen3-VL (Qwen2.5-VL's language
    /// model is Qwen2-VL's; only the projectors differ).
    pub fn new(text: &'a Gguf, mmproj: Option<&'a Gguf>) -> Result<Self> {
        let arch = str_of(text, "general.architecture")?;
        if !TEXT_ARCHITECTURES.contains(&arch) {
            let hint = if arch == "clip" {
                ": it is a projector (mmproj), give it as the projector"
            } else {
                ""
            };
            return err(format!(
                "the text model's architecture is {arch:?}, not one of {TEXT_ARCHITECTURES:?} (Qwen2-VL, Qwen2.5-VL, Qwen3-VL){hint}"
            ));
        }
        let Some(mmproj) = mmproj else {
            let family = if arch == "qwen3vl" {
                Family::Qwen3Vl
            } else {
                Family::Qwen2Vl
            };
            return Ok(GgufModel {
                text,
                mmproj: None,
                family,
            });
        };
        let projector_arch = str_of(mmproj, "general.architecture")?;
        if projector_arch != "clip" {
            return err(format!(
                "the projector's architecture is {projector_arch:?}, not \"clip\" (an mmproj-*.gguf file)"
            ));
        }
        let projector = str_of(mmproj, "clip.projector_type")?;
        let family = match projector {
            "qwen2vl_merger" => Family::Qwen2Vl,
            "qwen2.5vl_merger" => Family::Qwen25Vl,
            "qwen3vl_merger" => Family::Qwen3Vl,
            other => {
                return err(format!(
                    "projector type {other:?} is not a Qwen-VL one (qwen2vl_merger, qwen2.5vl_merger, qwen3vl_merger)"
                ))
            }
        };
        let want = if family.is_qwen3() { "qwen3vl" } else { "qwen2vl" };
        if arch != want {
            return err(format!(
                "the projector ({projector}) belongs to a {want} text model, the text model is {arch}"
            ));
        }
        let model = GgufModel {
            text,
            mmproj: Some(mmproj),
            family,
        };
        let (width, projected) = (
            model.text_u64("embedding_length")?,
            u64_of(mmproj, "clip.vision.projection_dim")?,
        );
        if width != projected {
            return err(format!(
                "the projector gives {projected}-wide image features, the text model is {width} wide: the files are of different models"
            ));
        }
        Ok(model)
    }

    /// The text file's `general.architecture`.
    fn arch(&self) -> &str {
        if self.family.is_qwen3() {
            "qwen3vl"
        } else {
            "qwen2vl"
        }
    }

    fn text_u64(&self, key: &str) -> Result<u64> {
        u64_of(self.text, &format!("{}.{key}", self.arch()))
    }

    fn vision_shape(m: &Gguf, name: &str) -> Result<Vec<usize>> {
        m.tensor(name)
            .map(GgufTensor::shape)
            .ok_or_else(|| GgufError(format!("the projector has no tensor {name}")))
    }

    /// The id of token `text` in the file's vocabulary.
    fn token_id(&self, text: &str) -> Result<u64> {
        let tokens = array_of(self.text, "tokenizer.ggml.tokens")?;
        tokens
            .iter()
            .position(|t| t.as_str() == Some(text))
            .map(|i| i as u64)
            .ok_or_else(|| GgufError(format!("the vocabulary has no {text} token")))
    }

    /// The dtype the weights were published in, as `config.json` names it: the file's type for
    /// f32/f16/bf16 files, bfloat16 (what Qwen publishes) for quantized ones.
    fn dtype(&self) -> &'static str {
        match self.text.tensor("token_embd.weight").map(|t| t.ggml_type) {
            Some(super::ggml::GgmlType::F32) => "float32",
            Some(super::ggml::GgmlType::F16) => "float16",
            _ => "bfloat16",
        }
    }

    /// The `config.json` the pair was converted from, as far as the engine reads it (what the
    /// files do not hold is what llama.cpp assumes too: a temporal patch of 2, a merge of 2×2,
    /// Qwen2.5-VL's 112-pixel windows and 2 tokens per second). A text model alone has
    /// `"vision_config": null`.
    pub fn config_json(&self) -> Result<Value> {
        let layers = self.text_u64("block_count")?;
        check_blocks(
            self.text,
            "qwen2vl/qwen3vl block_count",
            layers,
            "blk.",
            "attn_norm.weight",
        )?;
        let hidden = self.text_u64("embedding_length")?;
        let heads = self.text_u64("attention.head_count")?;
        let sections: Vec<u64> = array_of(self.text, &format!("{}.rope.dimension_sections", self.arch()))?
            .iter()
            .map(|v| {
                v.as_u64()
                    .ok_or_else(|| GgufError("rope.dimension_sections holds a non-integer".into()))
            })
            .collect::<Result<_>>()?;
        let mrope_section: Vec<u64> = sections.into_iter().take(3).collect();
        let vocab = array_of(self.text, "tokenizer.ggml.tokens")?.len();
        let eos = u64_of(self.text, "tokenizer.ggml.eos_token_id")?;
        let mut text = json!({
            "hidden_size": hidden,
            "intermediate_size": self.text_u64("feed_forward_length")?,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": self.text_u64("attention.head_count_kv")?,
            "max_position_embeddings": self.text_u64("context_length")?,
            "rms_norm_eps": f64_of(self.text, &format!("{}.attention.layer_norm_rms_epsilon", self.arch()))?,
            "rope_theta": f64_of(self.text, &format!("{}.rope.freq_base", self.arch()))?,
            "vocab_size": vocab,
            "tie_word_embeddings": self.text.tensor("output.weight").is_none(),
            "torch_dtype": self.dtype(),
            "eos_token_id": eos,
            "bos_token_id": u64_of(self.text, "tokenizer.ggml.bos_token_id").ok(),
        });
        let vision = match self.mmproj {
            Some(m) => self.vision_config_json(m)?,
            None => Value::Null,
        };
        let ids = json!({
            "image_token_id": self.token_id("<|image_pad|>")?,
            "video_token_id": self.token_id("<|video_pad|>")?,
            "vision_start_token_id": self.token_id("<|vision_start|>")?,
            "vision_end_token_id": self.token_id("<|vision_end|>")?,
        });
        let mut root = json!({ "model_type": self.family.model_type(), "vision_config": vision });
        if self.family.is_qwen3() {
            text["head_dim"] = json!(self.text_u64("attention.key_length")?);
            text["rope_scaling"] =
                json!({ "rope_type": "default", "mrope_section": mrope_section, "mrope_interleaved": true });
            root["text_config"] = text;
        } else {
            text["rope_scaling"] = json!({ "type": "mrope", "mrope_section": mrope_section });
            merge_into(&mut root, text);
        }
        merge_into(&mut root, ids);
        Ok(root)
    }

    /// The `vision_config` of projector `m`.
    fn vision_config_json(&self, m: &Gguf) -> Result<Value> {
        let depth = u64_of(m, "clip.vision.block_count")?;
        check_blocks(m, "clip.vision.block_count", depth, "v.blk.", "ln1.weight")?;
        let width = u64_of(m, "clip.vision.embedding_length")?;
        let vision_heads = u64_of(m, "clip.vision.attention.head_count")?;
        let patch = u64_of(m, "clip.vision.patch_size")?;
        let projected = u64_of(m, "clip.vision.projection_dim")?;
        let merge = u64_of(m, "clip.vision.spatial_merge_size").unwrap_or(2);
        let ffn = Self::vision_shape(m, "v.blk.0.ffn_up.weight")?[0] as u64;
        Ok(match self.family {
            Family::Qwen2Vl => json!({
                "depth": depth, "embed_dim": width, "mlp_ratio": ffn / width.max(1), "num_heads": vision_heads,
                "hidden_size": projected, "patch_size": patch, "spatial_merge_size": merge, "temporal_patch_size": 2,
            }),
            Family::Qwen25Vl => {
                let pattern = u64_of(m, "clip.vision.n_wa_pattern")?;
                let full: Vec<u64> = (1..=depth)
                    .filter(|l| pattern > 0 && l % pattern == 0)
                    .map(|l| l - 1)
                    .collect();
                json!({
                    "depth": depth, "hidden_size": width, "intermediate_size": ffn, "num_heads": vision_heads,
                    "out_hidden_size": projected, "patch_size": patch, "spatial_merge_size": merge,
                    "temporal_patch_size": 2, "window_size": 112, "fullatt_block_indexes": full, "tokens_per_second": 2,
                })
            }
            Family::Qwen3Vl | Family::Qwen3VlMoe | Family::Qwen35 | Family::Qwen35Moe => {
                let deepstack = deepstack_layers(m);
                let positions = Self::vision_shape(m, "v.position_embd.weight")?[0];
                json!({
                    "depth": depth, "hidden_size": width, "intermediate_size": ffn, "num_heads": vision_heads,
                    "out_hidden_size": projected, "patch_size": patch, "spatial_merge_size": merge,
                    "temporal_patch_size": 2, "deepstack_visual_indexes": deepstack,
                    "num_position_embeddings": positions,
                })
            }
        })
    }

    /// The ids that end a generation: the file's end-of-sequence token and `<|endoftext|>` (both
    /// are in Qwen's `generation_config.json`; llama.cpp ends on both too).
    pub fn eos_token_ids(&self) -> Result<Vec<u32>> {
        let mut ids = vec![u64_of(self.text, "tokenizer.ggml.eos_token_id")?];
        if let Ok(end) = self.token_id("<|endoftext|>") {
            if !ids.contains(&end) {
                ids.push(end);
            }
        }
        ids.into_iter()
            .map(|id| u32::try_from(id).map_err(|_| GgufError(format!("end-of-sequence id {id} is not a token id"))))
            .collect()
    }

    /// What a checkpoint folder's small files say, read from the pair's metadata: the server and
    /// the playground open a pair through this.
    pub fn small_files(&self) -> Result<GgufSmallFiles> {
        let config = ModelConfig::from_value(&self.config_json()?).map_err(|e| GgufError(e.to_string()))?;
        Ok(GgufSmallFiles {
            config,
            tokenizer_json: self.tokenizer_json()?,
            chat_template: self.chat_template().map(str::to_string),
            preprocessor_json: self.preprocessor_json()?,
            eos_token_ids: self.eos_token_ids()?,
        })
    }

    /// The `preprocessor_config.json` the projector implies: its `image_mean` and `image_std` (the
    /// image limits are not in the files; the family's shipped ones apply, as in vLLM). None for a
    /// text model alone.
    pub fn preprocessor_json(&self) -> Result<Option<String>> {
        let Some(m) = self.mmproj else { return Ok(None) };
        let triple = |key: &str| -> Result<Vec<f64>> {
            let v: Vec<f64> = array_of(m, key)?.iter().filter_map(MetaValue::as_f64).collect();
            match v.len() {
                3 => Ok(v),
                n => err(format!("{key} has {n} numbers, not 3")),
            }
        };
        let json = json!({
            "image_mean": triple("clip.vision.image_mean")?,
            "image_std": triple("clip.vision.image_std")?,
        });
        Ok(Some(json.to_string()))
    }

    /// The chat template (`tokenizer.chat_template`), if the file has one.
    pub fn chat_template(&self) -> Option<&'a str> {
        self.text.get("tokenizer.chat_template").and_then(MetaValue::as_str)
    }

    /// The `tokenizer.json` of the vocabulary, merges and token types: byte-level BPE with the
    /// `qwen2` pre-tokenizer's split, NFC, and the control and user-defined tokens as added
    /// tokens (control ones special). The `[PADn]` fillers llama.cpp writes up to the embedding's
    /// row count (unused tokens) are left out, as transformers' tokenizer has no such tokens.
    pub fn tokenizer_json(&self) -> Result<String> {
        tokenizer_json(self.text)
    }

    /// Every tensor the model reads, by its transformers name (the flat layout: `model.layers.…`,
    /// `visual.…`), and how it is made from the files' tensors. Tensors the mapping does not know
    /// are an error naming them.
    pub fn tensors(&self) -> Result<BTreeMap<String, Assembly>> {
        let mut out: BTreeMap<String, Assembly> = BTreeMap::new();
        for (index, t) in self.text.tensors.iter().enumerate() {
            let name = text_name(&t.name)
                .ok_or_else(|| GgufError(format!("the text model's tensor {} is not one kvlens knows", t.name)))?;
            out.insert(
                name,
                Assembly::One(Piece {
                    part: Part::Text,
                    index,
                }),
            );
        }
        let Some(mmproj) = self.mmproj else { return Ok(out) };
        let deepstack: Vec<u64> = match self.family.is_qwen3() {
            true => deepstack_layers(mmproj).into_iter().map(|l| l as u64).collect(),
            false => Vec::new(),
        };
        let mut qkv: BTreeMap<String, [Option<Piece>; 3]> = BTreeMap::new();
        let mut temporal: [Option<Piece>; 2] = [None, None];
        for (index, t) in mmproj.tensors.iter().enumerate() {
            let piece = Piece {
                part: Part::Mmproj,
                index,
            };
            let unknown = || GgufError(format!("the projector's tensor {} is not one kvlens knows", t.name));
            match t.name.as_str() {
                "v.patch_embd.weight" => temporal[0] = Some(piece),
                "v.patch_embd.weight.1" => temporal[1] = Some(piece),
                name => match vision_name(self.family, name, &deepstack).ok_or_else(unknown)? {
                    VisionName::Whole(n) => {
                        out.insert(n, Assembly::One(piece));
                    }
                    VisionName::Qkv(n, i) => qkv.entry(n).or_default()[i] = Some(piece),
                },
            }
        }
        for (name, parts) in qkv {
            match parts {
                [Some(q), Some(k), Some(v)] => {
                    out.insert(name, Assembly::Rows(vec![q, k, v]));
                }
                _ => return err(format!("the projector holds only some of {name}'s q, k and v")),
            }
        }
        match temporal {
            [Some(a), Some(b)] => {
                out.insert("visual.patch_embed.proj.weight".into(), Assembly::Temporal([a, b]));
            }
            _ => {
                return err("the projector lacks v.patch_embd.weight or v.patch_embd.weight.1 (a temporal patch of 2)")
            }
        }
        Ok(out)
    }

    /// Bytes of every tensor of both files as stored: what a backend that keeps each tensor in
    /// its file's type holds.
    pub fn stored_bytes(&self) -> u64 {
        self.text
            .tensors
            .iter()
            .chain(self.mmproj.iter().flat_map(|m| &m.tensors))
            .map(|t| t.bytes)
            .sum()
    }

    /// Bytes one decode step reads: every tensor of the text file as stored (BF16 ones twice over
    /// when `bf16_widened`, as a backend computing in f32 keeps them), less the token embedding
    /// when a separate `output.weight` is the head (a lookup reads one row of it).
    pub fn decode_read_bytes(&self, bf16_widened: bool) -> u64 {
        let tensors = &self.text.tensors;
        let untied = tensors.iter().any(|t| t.name == "output.weight");
        tensors
            .iter()
            .filter(|t| !(untied && t.name == "token_embd.weight"))
            .map(|t| match t.ggml_type {
                GgmlType::Bf16 if bf16_widened => 2 * t.bytes,
                _ => t.bytes,
            })
            .sum()
    }

    /// The file a piece is in (None: the projector of a text model alone).
    pub fn file(&self, part: Part) -> Option<&'a Gguf> {
        match part {
            Part::Text => Some(self.text),
            Part::Mmproj => self.mmproj,
        }
    }
}

/// The vision blocks a Qwen3-VL projector feeds to its deepstack mergers
/// (`clip.vision.is_deepstack_layers`).
fn deepstack_layers(m: &Gguf) -> Vec<usize> {
    match m.get("clip.vision.is_deepstack_layers") {
        Some(MetaValue::Array(flags)) => flags
            .iter()
            .enumerate()
            .filter(|(_, f)| **f == MetaValue::Bool(true))
            .map(|(i, _)| i)
            .collect(),
        _ => Vec::new(),
    }
}

/// Checks a block count against the file's tensors: block `n − 1` exists (`{stem}{n-1}.{tensor}`),
/// so a count a file lies about cannot size anything before the tensors are read.
fn check_blocks(g: &Gguf, key: &str, n: u64, stem: &str, tensor: &str) -> Result<()> {
    let last = n.checked_sub(1).map(|l| format!("{stem}{l}.{tensor}"));
    match last {
        Some(name) if g.tensor(&name).is_some() => Ok(()),
        Some(name) => err(format!("{key} is {n}, but the file has no {name}")),
        None => err(format!("{key} is 0")),
    }
}

/// Adds `extra`'s keys to the object `root`.
fn merge_into(root: &mut Value, extra: Value) {
    if let (Value::Object(root), Value::Object(extra)) = (root, extra) {
        root.extend(extra);
    }
}

/// `(GGUF, transformers)` names of the text model's tensors outside the layers.
const TEXT_GLOBAL: [(&str, &str); 3] = [
    ("token_embd", "model.embed_tokens"),
    ("output", "lm_head"),
    ("output_norm", "model.norm"),
];

/// `(GGUF, transformers)` names of a decoder layer's tensors (`blk.N.` / `model.layers.N.`).
const TEXT_LAYER: [(&str, &str); 11] = [
    ("attn_norm", "input_layernorm"),
    ("ffn_norm", "post_attention_layernorm"),
    ("attn_q", "self_attn.q_proj"),
    ("attn_k", "self_attn.k_proj"),
    ("attn_v", "self_attn.v_proj"),
    ("attn_output", "self_attn.o_proj"),
    ("attn_q_norm", "self_attn.q_norm"),
    ("attn_k_norm", "self_attn.k_norm"),
    ("ffn_gate", "mlp.gate_proj"),
    ("ffn_up", "mlp.up_proj"),
    ("ffn_down", "mlp.down_proj"),
];

/// `(GGUF, transformers)` names of the projector's tensors outside the blocks (the patch
/// embedding's kernel is split in two, [`Assembly::Temporal`]; its bias is not).
fn vision_global(family: Family) -> [(&'static str, &'static str); 5] {
    let qwen3 = family.is_qwen3();
    [
        ("v.patch_embd", "visual.patch_embed.proj"),
        ("v.position_embd", "visual.pos_embed"),
        (
            "v.post_ln",
            if qwen3 {
                "visual.merger.norm"
            } else {
                "visual.merger.ln_q"
            },
        ),
        (
            "mm.0",
            if qwen3 {
                "visual.merger.linear_fc1"
            } else {
                "visual.merger.mlp.0"
            },
        ),
        (
            "mm.2",
            if qwen3 {
                "visual.merger.linear_fc2"
            } else {
                "visual.merger.mlp.2"
            },
        ),
    ]
}

/// `(GGUF, transformers)` names of a vision block's tensors (`v.blk.N.` / `visual.blocks.N.`),
/// but for Qwen2/2.5-VL's `qkv`, which GGUF splits ([`QKV_PARTS`]).
fn vision_layer(family: Family) -> Vec<(&'static str, &'static str)> {
    let mut out = vec![("attn_out", "attn.proj"), ("ln1", "norm1"), ("ln2", "norm2")];
    out.extend_from_slice(match family {
        Family::Qwen2Vl => &[("ffn_up", "mlp.fc1"), ("ffn_down", "mlp.fc2")][..],
        Family::Qwen25Vl => &[
            ("ffn_up", "mlp.up_proj"),
            ("ffn_gate", "mlp.gate_proj"),
            ("ffn_down", "mlp.down_proj"),
        ],
        Family::Qwen3Vl | Family::Qwen3VlMoe | Family::Qwen35 | Family::Qwen35Moe => &[
            ("attn_qkv", "attn.qkv"),
            ("ffn_up", "mlp.linear_fc1"),
            ("ffn_down", "mlp.linear_fc2"),
        ],
    });
    out
}

/// The GGUF names of a Qwen2/2.5-VL vision block's `attn.qkv` parts, in row order.
pub const QKV_PARTS: [&str; 3] = ["attn_q", "attn_k", "attn_v"];

/// `(GGUF, transformers)` names of a Qwen3-VL deepstack merger's tensors (`v.deepstack.L.` with
/// `L` the vision layer / `visual.deepstack_merger_list.K.` with `K` its place in the list).
const DEEPSTACK: [(&str, &str); 3] = [("norm", "norm"), ("fc1", "linear_fc1"), ("fc2", "linear_fc2")];

/// A tensor name under `stem` as `(layer, tensor, kind)`: `blk.3.attn_q.weight` under stem
/// `blk.` is `(3, "attn_q", "weight")`.
fn layered<'n>(name: &'n str, stem: &str) -> Option<(u64, &'n str, &'n str)> {
    let rest = name.strip_prefix(stem)?;
    let (layer, rest) = rest.split_once('.')?;
    let (tensor, kind) = rest.rsplit_once('.')?;
    Some((layer.parse().ok()?, tensor, kind))
}

/// Looks `key` up on one side of a `(GGUF, transformers)` table and gives the other side.
fn lookup<'t>(table: &[(&'t str, &'t str)], key: &str, from_gguf: bool) -> Option<&'t str> {
    table
        .iter()
        .find(|(g, h)| if from_gguf { *g == key } else { *h == key })
        .map(|(g, h)| if from_gguf { *h } else { *g })
}

/// The transformers name of a text tensor.
fn text_name(gguf: &str) -> Option<String> {
    if let Some((tensor, kind)) = gguf.rsplit_once('.') {
        if let Some(hf) = lookup(&TEXT_GLOBAL, tensor, true) {
            return Some(format!("{hf}.{kind}"));
        }
    }
    let (layer, tensor, kind) = layered(gguf, "blk.")?;
    Some(format!(
        "model.layers.{layer}.{}.{kind}",
        lookup(&TEXT_LAYER, tensor, true)?
    ))
}

/// The GGUF name of a text tensor, from its transformers name (either layout).
pub(crate) fn text_gguf_name(hf: &str) -> Option<String> {
    let hf = hf
        .strip_prefix("model.language_model.")
        .map_or(hf.to_string(), |r| format!("model.{r}"));
    if let Some((tensor, kind)) = hf.rsplit_once('.') {
        if let Some(g) = lookup(&TEXT_GLOBAL, tensor, false) {
            return Some(format!("{g}.{kind}"));
        }
    }
    let (layer, tensor, kind) = layered(&hf, "model.layers.")?;
    Some(format!("blk.{layer}.{}.{kind}", lookup(&TEXT_LAYER, tensor, false)?))
}

/// A projector tensor's transformers name.
enum VisionName {
    /// The whole tensor.
    Whole(String),
    /// Part `i` (q, k, v) of a `qkv` tensor.
    Qkv(String, usize),
}

/// The transformers name of a projector tensor (all but the patch embedding's two halves).
fn vision_name(family: Family, gguf: &str, deepstack: &[u64]) -> Option<VisionName> {
    let (tensor, kind) = gguf.rsplit_once('.')?;
    if let Some(hf) = lookup(&vision_global(family), tensor, true) {
        return Some(VisionName::Whole(format!("{hf}.{kind}")));
    }
    if let Some((layer, what, kind)) = layered(gguf, "v.deepstack.") {
        let k = deepstack.iter().position(|&l| l == layer)?;
        let hf = lookup(&DEEPSTACK, what, true)?;
        return Some(VisionName::Whole(format!(
            "visual.deepstack_merger_list.{k}.{hf}.{kind}"
        )));
    }
    let (layer, what, kind) = layered(gguf, "v.blk.")?;
    if !family.is_qwen3() {
        if let Some(i) = QKV_PARTS.iter().position(|p| *p == what) {
            return Some(VisionName::Qkv(format!("visual.blocks.{layer}.attn.qkv.{kind}"), i));
        }
    }
    let hf = lookup(&vision_layer(family), what, true)?;
    Some(VisionName::Whole(format!("visual.blocks.{layer}.{hf}.{kind}")))
}

/// The GGUF names holding a projector tensor, from its transformers name (either layout): one,
/// or Qwen2/2.5-VL's `attn.qkv` as its `q`, `k` and `v` ([`QKV_PARTS`], rows in that order).
pub(crate) fn vision_gguf_names(family: Family, hf: &str, deepstack: &[u64]) -> Option<Vec<String>> {
    let hf = hf.strip_prefix("model.").unwrap_or(hf);
    let (tensor, kind) = hf.rsplit_once('.')?;
    if let Some(g) = lookup(&vision_global(family), tensor, false) {
        return Some(vec![format!("{g}.{kind}")]);
    }
    if let Some((k, what, kind)) = layered(hf, "visual.deepstack_merger_list.") {
        let layer = deepstack.get(k as usize)?;
        return Some(vec![format!(
            "v.deepstack.{layer}.{}.{kind}",
            lookup(&DEEPSTACK, what, false)?
        )]);
    }
    let (layer, what, kind) = layered(hf, "visual.blocks.")?;
    if what == "attn.qkv" && !family.is_qwen3() {
        return Some(QKV_PARTS.iter().map(|p| format!("v.blk.{layer}.{p}.{kind}")).collect());
    }
    Some(vec![format!(
        "v.blk.{layer}.{}.{kind}",
        lookup(&vision_layer(family), what, false)?
    )])
}

/// GGUF's token types (llama.cpp's `llama_token_type`).
const NORMAL: u64 = 1;
const CONTROL: u64 = 3;
const USER_DEFINED: u64 = 4;
const UNUSED: u64 = 5;

/// The Split regex of llama.cpp's `qwen2` pre-tokenizer, as Qwen's `tokenizer.json` writes it.
const QWEN2_SPLIT: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

pub(crate) fn tokenizer_json(g: &Gguf) -> Result<String> {
    let model = str_of(g, "tokenizer.ggml.model")?;
    let pre = str_of(g, "tokenizer.ggml.pre")?;
    if model != "gpt2" || pre != "qwen2" {
        return err(format!(
            "tokenizer {model:?} with pre-tokenizer {pre:?} is not Qwen's (gpt2 with qwen2)"
        ));
    }
    let tokens = array_of(g, "tokenizer.ggml.tokens")?;
    let types = array_of(g, "tokenizer.ggml.token_type")?;
    if types.len() != tokens.len() {
        return err(format!(
            "tokenizer.ggml.token_type has {} entries for {} tokens",
            types.len(),
            tokens.len()
        ));
    }
    let mut vocab = serde_json::Map::new();
    let mut added = Vec::new();
    for (id, (token, kind)) in tokens.iter().zip(types).enumerate() {
        let token = token
            .as_str()
            .ok_or_else(|| GgufError(format!("token {id} is not a string")))?;
        match kind.as_u64() {
            Some(NORMAL) => {
                vocab.insert(token.to_string(), json!(id));
            }
            Some(UNUSED) => {}
            Some(USER_DEFINED) if token == format!("[PAD{id}]") => {}
            Some(t @ (CONTROL | USER_DEFINED)) => added.push(json!({
                "id": id, "content": token, "single_word": false, "lstrip": false, "rstrip": false,
                "normalized": false, "special": t == CONTROL,
            })),
            other => {
                return err(format!(
                    "token {id} ({token:?}) has type {other:?}, not normal, control, user-defined or unused"
                ))
            }
        }
    }
    let merges: Vec<&str> = array_of(g, "tokenizer.ggml.merges")?
        .iter()
        .map(|m| {
            m.as_str()
                .ok_or_else(|| GgufError("tokenizer.ggml.merges holds a non-string".into()))
        })
        .collect::<Result<_>>()?;
    let byte_level =
        json!({ "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false });
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": { "type": "NFC" },
        "pre_tokenizer": { "type": "Sequence", "pretokenizers": [
            { "type": "Split", "pattern": { "Regex": QWEN2_SPLIT }, "behavior": "Isolated", "invert": false },
            byte_level,
        ]},
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": "",
            "end_of_word_suffix": "", "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": merges,
        },
    });
    Ok(tokenizer.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::gguf_write::GgufWriter;

    fn parsed(w: &GgufWriter) -> Gguf {
        let mut bytes = Vec::new();
        w.write(&mut bytes).unwrap();
        Gguf::parse(&bytes, bytes.len() as u64).unwrap()
    }

    /// A Qwen2.5-VL pair of headers whose block counts are `text_blocks` and `vision_blocks`,
    /// holding only the first block's tensors.
    fn pair(text_blocks: u64, vision_blocks: u64) -> (Gguf, Gguf) {
        let (t, m) = writers(text_blocks, vision_blocks);
        (parsed(&t), parsed(&m))
    }

    /// [`pair`]'s files before they are written.
    fn writers(text_blocks: u64, vision_blocks: u64) -> (GgufWriter, GgufWriter) {
        let mut t = GgufWriter::default();
        t.meta("general.architecture", MetaValue::String("qwen2vl".into()));
        for (k, v) in [
            ("embedding_length", 32),
            ("feed_forward_length", 64),
            ("context_length", 64),
        ] {
            t.meta(&format!("qwen2vl.{k}"), MetaValue::U32(v));
        }
        t.meta("qwen2vl.block_count", MetaValue::U64(text_blocks));
        t.meta("qwen2vl.attention.head_count", MetaValue::U32(2));
        t.meta("qwen2vl.attention.head_count_kv", MetaValue::U32(1));
        t.meta(
            "qwen2vl.rope.dimension_sections",
            MetaValue::Array([4, 2, 2, 0].map(MetaValue::I32).to_vec()),
        );
        t.meta("qwen2vl.rope.freq_base", MetaValue::F32(1e4));
        t.meta("qwen2vl.attention.layer_norm_rms_epsilon", MetaValue::F32(1e-6));
        let tokens = [
            "a",
            "<|image_pad|>",
            "<|video_pad|>",
            "<|vision_start|>",
            "<|vision_end|>",
        ];
        t.meta(
            "tokenizer.ggml.tokens",
            MetaValue::Array(tokens.map(|s| MetaValue::String(s.into())).to_vec()),
        );
        t.meta("tokenizer.ggml.eos_token_id", MetaValue::U32(0));
        let norm = GgmlType::F32.quantize(&[1.0; 32]).unwrap();
        t.tensor("blk.0.attn_norm.weight", &[32], GgmlType::F32, norm.clone());
        let mut m = GgufWriter::default();
        m.meta("general.architecture", MetaValue::String("clip".into()));
        m.meta("clip.projector_type", MetaValue::String("qwen2.5vl_merger".into()));
        for (k, v) in [
            ("projection_dim", 32),
            ("embedding_length", 32),
            ("attention.head_count", 2),
            ("patch_size", 14),
            ("n_wa_pattern", 1),
        ] {
            m.meta(&format!("clip.vision.{k}"), MetaValue::U32(v));
        }
        m.meta("clip.vision.block_count", MetaValue::U64(vision_blocks));
        m.tensor("v.blk.0.ln1.weight", &[32], GgmlType::F32, norm);
        let up = GgmlType::F32.quantize(&[0.0; 64 * 32]).unwrap();
        m.tensor("v.blk.0.ffn_up.weight", &[64, 32], GgmlType::F32, up);
        (t, m)
    }

    /// A decode step reads the whole text file, less the token embedding when a separate head
    /// (`output.weight`) is stored; the projector is not read.
    #[test]
    fn decode_reads_the_text_file_less_an_untied_embedding() {
        let (mut t, m) = writers(1, 1);
        let embedding = GgmlType::Q8_0.quantize(&[0.5; 32 * 8]).unwrap();
        t.tensor("token_embd.weight", &[8, 32], GgmlType::Q8_0, embedding.clone());
        let (text, mmproj) = (parsed(&t), parsed(&m));
        let tied = GgufModel::new(&text, Some(&mmproj)).unwrap().decode_read_bytes(false);
        // The norm (32 f32) and the embedding (8 rows of one q8_0 block, 34 bytes each).
        assert_eq!(tied, 32 * 4 + 8 * 34);
        t.tensor("output.weight", &[8, 32], GgmlType::Q8_0, embedding);
        let text = parsed(&t);
        let untied = GgufModel::new(&text, Some(&mmproj)).unwrap().decode_read_bytes(false);
        assert_eq!(untied, tied);
        let (mut t, _) = writers(1, 1);
        t.tensor("blk.0.ffn_up.weight", &[2, 32], GgmlType::Bf16, vec![0; 2 * 32 * 2]);
        let model_bf16 = parsed(&t);
        let bf16 = GgufModel::new(&model_bf16, Some(&mmproj)).unwrap();
        assert_eq!(bf16.decode_read_bytes(false), 32 * 4 + 128);
        assert_eq!(bf16.decode_read_bytes(true), 32 * 4 + 256);
        assert!(GgufModel::new(&text, Some(&mmproj)).unwrap().stored_bytes() > untied + 8 * 34);
    }

    /// Block counts a file lies about are refused before anything is sized by them (a count of
    /// 2^40 once built a list of 2^40 full-attention layers).
    #[test]
    fn block_counts_must_match_the_files_tensors() {
        let (t, m) = pair(1, 1);
        let model = GgufModel::new(&t, Some(&m)).unwrap();
        let cfg = model.config_json().unwrap();
        assert_eq!(cfg["vision_config"]["fullatt_block_indexes"], serde_json::json!([0]));
        for (text, vision, key) in [
            (1 << 40, 1, "qwen2vl/qwen3vl block_count is 1099511627776"),
            (1, 1 << 40, "clip.vision.block_count is 1099511627776"),
            (0, 1, "block_count is 0"),
        ] {
            let (t, m) = pair(text, vision);
            let err = GgufModel::new(&t, Some(&m))
                .unwrap()
                .config_json()
                .unwrap_err()
                .to_string();
            assert!(err.contains(key), "{err}");
        }
    }
}
