//! Streamed loads against whole-file loads of the same in-memory random checkpoints: the same
//! logits whatever the chunking or sharding, the bytes held within the stated bound, and clear
//! errors for truncated or corrupt files.

use super::*;
use crate::backend::suite::Reference as CpuBackend;
use crate::backend::{block_on, TableShape};
use crate::memory::ledger::MemoryLedger;
use crate::model::random_weights::{safetensors_header, RandomInit};
use crate::model::weights::SafetensorsFiles;
use crate::runner::{BatchSeq, ImageRows, ModelRunner, StepBatch, StepRunner};

/// A tiny test config with a vocabulary of 2,048 (small files, so that 1-byte chunks are quick).
fn config(json: &str) -> ModelConfig {
    let mut cfg = ModelConfig::from_json(json).unwrap();
    cfg.text.vocab_size = 2048;
    cfg
}

fn qwen2_vl() -> ModelConfig {
    config(include_str!("../../../../tools/golden/configs/qwen2_vl_tiny.json"))
}

/// Qwen3-VL: a host-read position table and deepstack mergers.
fn qwen3_vl() -> ModelConfig {
    config(include_str!("../../../../tools/golden/configs/qwen3_vl_tiny.json"))
}

/// A safetensors file of `specs` with random values.
fn file(specs: &[TensorSpec]) -> Vec<u8> {
    let mut bytes = Vec::new();
    RandomInit::new(3, 0.5)
        .write_safetensors(&mut bytes, specs, |_| {})
        .unwrap();
    bytes
}

/// [`logits`] of the model loaded from whole files onto `be`, as the server loads it.
fn file_logits<B: Backend>(cfg: &ModelConfig, shards: &[(String, Vec<u8>)], be: B) -> Vec<f32> {
    let shards: Vec<(String, &[u8])> = shards.iter().map(|(n, b)| (n.clone(), b.as_slice())).collect();
    let source = SafetensorsFiles::parse(&shards).unwrap();
    let model = QwenVl::load(cfg.clone(), &source, &be, |_, _| {}).unwrap();
    logits(be, model)
}

/// A streamed load: the model, the peak of held bytes and every progress report.
type Run<B> = (QwenVl<B>, usize, Vec<(usize, u64)>);

/// Streams `shards` in chunks of `chunk` bytes.
fn stream<B: Backend>(
    cfg: &ModelConfig,
    shards: &[(String, Vec<u8>)],
    chunk: usize,
    be: &B,
) -> Result<Run<B>, ModelError> {
    let mut reports = Vec::new();
    let mut loader = StreamLoader::new(cfg.clone(), be, |n, bytes| reports.push((n, bytes)))?;
    for (name, bytes) in shards {
        loader.begin_shard(name.as_str())?;
        for c in bytes.chunks(chunk) {
            loader.push(c)?;
        }
    }
    let peak = loader.peak_held();
    let model = loader.finish()?;
    Ok((model, peak, reports))
}

/// Logits of every row of an 8-token prompt with a 4-token image (a 4×4 patch grid) at rows 2..6.
fn logits<B: Backend>(be: B, model: QwenVl<B>) -> Vec<f32> {
    let patch_dim = model.cfg.vision.as_ref().unwrap().patch_dim();
    let mut runner = ModelRunner::new(be, model);
    runner.allocate_kv(2, 4, TableShape { rows: 1, max_blocks: 2 }).unwrap();
    let pixels: Vec<f32> = (0..16 * patch_dim)
        .map(|i| ((i * 37) % 101) as f32 / 101.0 - 0.5)
        .collect();
    runner.encode(&"image".into(), &pixels, [1, 4, 4]).unwrap();
    let step = runner
        .execute(StepBatch {
            seqs: vec![BatchSeq {
                id: "r".into(),
                tokens: vec![5, 900, 1, 1, 1, 1, 33, 2047],
                positions: (0..8).map(|i| [i, i + 1, i + 2]).collect(),
                context_len: 8,
                new_blocks: vec![0, 1],
                table_start: 0,
                images: vec![ImageRows {
                    mm_hash: "image".into(),
                    rows: 0..4,
                    at: 2,
                }],
                logit_rows: 8,
                sampling: None,
            }],
            released: Vec::new(),
        })
        .unwrap();
    block_on(step.read.unwrap()).unwrap()
}

/// The bytes of the largest tensor of `specs`.
fn largest(specs: &[TensorSpec]) -> usize {
    specs
        .iter()
        .map(|s| (s.numel() * s.dtype.size_bytes()) as usize)
        .max()
        .unwrap()
}

fn cpu() -> CpuBackend {
    CpuBackend::new(MemoryLedger::new())
}

#[test]
fn any_chunking_gives_the_logits_of_the_whole_file_within_the_held_bound() {
    for cfg in [qwen2_vl(), qwen3_vl()] {
        let specs = tensor_specs(&cfg);
        let shards = vec![("model.safetensors".to_string(), file(&specs))];
        let want = file_logits(&cfg, &shards, cpu());
        let header = safetensors_header(&specs).unwrap().0.len();
        let bound = largest(&specs).max(header);
        let total: u64 = specs.iter().map(|s| s.numel() * s.dtype.size_bytes()).sum();
        let whole = shards[0].1.len();
        for chunk in [1, 7, 64 << 10, whole] {
            let be = cpu();
            let (model, peak, reports) = stream(&cfg, &shards, chunk, &be).unwrap();
            assert_eq!(logits(be, model), want, "{:?}, chunks of {chunk}", cfg.family);
            assert!(peak <= bound, "{chunk}: held {peak} > {bound}");
            // 1-byte chunks gather everything: the bound is reached; a whole file is never copied.
            match chunk {
                1 => assert_eq!(peak, bound),
                c if c == whole => assert_eq!(peak, 0),
                _ => {}
            }
            assert_eq!(reports.len(), specs.len());
            assert_eq!(reports.last(), Some(&(specs.len(), total)));
        }
    }
}

#[test]
fn shards_in_either_prefix_with_extra_tensors_load_like_the_files() {
    let cfg = qwen3_vl();
    let specs = tensor_specs(&cfg);
    let third = specs.len() / 3;
    // The middle shard under the other layout's names.
    let mut renamed = specs[third..2 * third].to_vec();
    for s in &mut renamed {
        s.name = spellings(&s.name).pop().unwrap();
    }
    // A tensor the model does not read, larger than any it reads: skipped, never held.
    let mut extra = specs[0].clone();
    extra.name = "model.visual.unused.weight".into();
    extra.shape = vec![largest(&specs)];
    let mut last = specs[2 * third..].to_vec();
    last.insert(1, extra);
    let shards: Vec<(String, Vec<u8>)> = [&specs[..third], &renamed[..], &last[..]]
        .iter()
        .enumerate()
        .map(|(i, s)| (format!("model-0000{}-of-00003.safetensors", i + 1), file(s)))
        .collect();
    let want = file_logits(&cfg, &shards, cpu());
    for chunk in [7, 64 << 10] {
        let be = cpu();
        let (model, peak, reports) = stream(&cfg, &shards, chunk, &be).unwrap();
        assert_eq!(logits(be, model), want, "chunks of {chunk}");
        assert!(peak <= largest(&specs), "{peak}");
        assert_eq!(reports.len(), specs.len(), "the extra tensor is not converted");
    }
}

/// The error of streaming `bytes` as the only shard in chunks of 5 bytes.
fn stream_error(cfg: &ModelConfig, bytes: Vec<u8>) -> String {
    let shards = [("model.safetensors".to_string(), bytes)];
    match stream(cfg, &shards, 5, &cpu()) {
        Ok(_) => panic!("the stream loaded"),
        Err(e) => e.to_string(),
    }
}

/// A safetensors file of a header written by hand and `data`.
fn raw_file(header: &str, data: &[u8]) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(data);
    out
}

#[test]
fn a_truncated_stream_says_how_far_it_got() {
    let cfg = qwen2_vl();
    let bytes = file(&tensor_specs(&cfg));
    let len = bytes.len();
    let header = safetensors_header(&tensor_specs(&cfg)).unwrap().0.len();
    for (cut, got) in [
        (3, "it ended after 3 bytes".to_string()),
        (100, "it ended after 100 bytes".to_string()),
        (len - 1, format!("it ended after {} of {len} bytes", len - 1)),
        (
            8 + header + 10,
            format!("it ended after {} of {len} bytes", 8 + header + 10),
        ),
    ] {
        let err = stream_error(&cfg, bytes[..cut].to_vec());
        assert_eq!(err, format!("checkpoint: model.safetensors is truncated: {got}"));
    }
    // The next shard may not begin before this one is complete.
    let be = cpu();
    let mut loader = StreamLoader::new(cfg.clone(), &be, |_, _| {}).unwrap();
    loader.begin_shard("a.safetensors").unwrap();
    loader.push(&bytes[..len / 2]).unwrap();
    let err = loader.begin_shard("b.safetensors").unwrap_err().to_string();
    assert!(err.starts_with("checkpoint: a.safetensors is truncated"), "{err}");
    let err = loader.push(&bytes[len / 2..]).unwrap_err().to_string();
    assert_eq!(err, "checkpoint: the checkpoint stream already failed; start it again");
}

#[test]
fn a_corrupt_header_is_refused_before_any_data() {
    let cfg = qwen2_vl();
    let invalid = "checkpoint: model.safetensors is not a valid safetensors file: ";
    let mut huge = u64::MAX.to_le_bytes().to_vec();
    huge.extend_from_slice(b"{}");
    let cases = [
        (
            huge,
            format!("a header of {} bytes (at most 16777216 are accepted)", u64::MAX),
        ),
        (
            raw_file("{not json", &[]),
            "header: key must be a string at line 1 column 2".into(),
        ),
        (
            raw_file(
                r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#,
                &[0; 12],
            ),
            "tensor b at bytes [4, 12) does not follow on from byte 8 (out of order, overlapping or leaving a gap)"
                .into(),
        ),
        (
            raw_file(r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}"#, &[0; 16]),
            "tensor a at bytes [8, 16) does not follow on from byte 0 (out of order, overlapping or leaving a gap)"
                .into(),
        ),
        (
            raw_file(r#"{"a":{"dtype":"BF16","shape":[3],"data_offsets":[0,8]}}"#, &[0; 8]),
            "tensor a has 8 bytes for shape [3] of BF16".into(),
        ),
        (
            raw_file(
                r#"{"a":{"dtype":"U8","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,0]}}"#,
                &[],
            ),
            "tensor a has 0 bytes for shape [4294967296, 4294967296, 4294967296] of U8".into(),
        ),
        (
            raw_file(r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#, &[0; 6]),
            "bytes after the last tensor's data".into(),
        ),
    ];
    for (bytes, why) in cases {
        assert_eq!(stream_error(&cfg, bytes), format!("{invalid}{why}"));
    }
    // A tensor the model reads in a dtype it cannot read, or at a shape the config does not imply,
    // is refused from the header, before its bytes (none here) arrive.
    let norm = "visual.blocks.0.norm1.weight";
    let header = format!(r#"{{"{norm}":{{"dtype":"I32","shape":[32],"data_offsets":[0,128]}}}}"#);
    let err = stream_error(&cfg, raw_file(&header, &[]));
    assert_eq!(
        err,
        format!("checkpoint: {norm}: dtype I32 is not supported (f32, f16, bf16)")
    );
    let header = format!(r#"{{"{norm}":{{"dtype":"F32","shape":[33],"data_offsets":[0,132]}}}}"#);
    let err = stream_error(&cfg, raw_file(&header, &[]));
    assert_eq!(
        err,
        format!("checkpoint: tensor {norm} has shape [33], the config implies [32]")
    );
}

#[test]
fn a_complete_stream_missing_a_tensor_names_it() {
    let cfg = qwen2_vl();
    let mut specs = tensor_specs(&cfg);
    specs.retain(|t| t.name != "model.layers.1.mlp.up_proj.weight");
    let err = stream_error(&cfg, file(&specs));
    assert_eq!(
        err,
        "checkpoint: tensor model.layers.1.mlp.up_proj.weight is missing from the checkpoint"
    );
}

#[cfg(all(feature = "wgpu", not(target_arch = "wasm32")))]
#[test]
fn streamed_onto_wgpu_gives_the_logits_of_the_whole_file() {
    use crate::backend::wgpu::{tests::backend_with, WgpuOptions};
    let gpu = || backend_with(WgpuOptions::default());
    let cfg = qwen3_vl();
    let shards = vec![("model.safetensors".to_string(), file(&tensor_specs(&cfg)))];
    let want = file_logits(&cfg, &shards, gpu());
    let be = gpu();
    let (model, _, _) = stream(&cfg, &shards, 7, &be).unwrap();
    assert_eq!(logits(be, model), want);
}

/// Random edits of a small partial checkpoint, cut anywhere and pushed in any chunk size: never a
/// panic, always a checkpoint error (the model is incomplete), never more held than the bound.
mod proptests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]
        #[test]
        fn edited_or_cut_files_fail_cleanly(
            edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..4),
            cut in any::<prop::sample::Index>(),
            chunk in 1usize..64,
        ) {
            let cfg = qwen2_vl();
            let specs = tensor_specs(&cfg);
            let small: Vec<TensorSpec> = specs.iter().filter(|s| s.numel() <= 64).take(6).cloned().collect();
            let mut bytes = file(&small);
            let header = 8 + safetensors_header(&small).unwrap().0.len();
            // Most edits land in the length and header, where the parsing is.
            for (at, value) in edits {
                let at = at.index(header + 16).min(bytes.len() - 1);
                bytes[at] = value;
            }
            bytes.truncate(bytes.len() - cut.index(bytes.len() / 4));
            let shards = [("model.safetensors".to_string(), bytes)];
            let mut peak = 0;
            let be = cpu();
            let result = StreamLoader::new(cfg.clone(), &be, |_, _| {}).and_then(|mut loader| {
                loader.begin_shard("model.safetensors")?;
                let fed = shards[0].1.chunks(chunk).try_for_each(|c| loader.push(c));
                peak = loader.peak_held();
                fed?;
                loader.finish()
            });
            let err = result.expect_err("a partial model loaded").to_string();
            prop_assert!(err.starts_with("checkpoint: "), "{}", err);
            prop_assert!(peak <= largest(&specs).max(MAX_HEADER_BYTES as usize), "{}", peak);
        }
    }
}

/// A GGUF pair (q8_0, as llama.cpp's converter writes it) of the random checkpoint of `json`
/// (vocabulary 2,048) and the safetensors file it was made from.
fn gguf_pair(json: &str) -> (ModelConfig, Vec<u8>, Vec<u8>, Vec<u8>) {
    use crate::arch::gguf_export::{export, CheckpointText};
    let cfg = config(json);
    let mut raw: serde_json::Value = serde_json::from_str(json).unwrap();
    if raw.get("text_config").is_some() {
        raw["text_config"]["vocab_size"] = 2048.into();
    } else {
        raw["vocab_size"] = 2048.into();
    }
    // A vocabulary of the ids the config names and filler, as tokenizer.json writes it.
    let mut vocab = serde_json::Map::new();
    for id in 0..2040 {
        vocab.insert(format!("t{id}"), id.into());
    }
    let special = [
        "<|image_pad|>",
        "<|video_pad|>",
        "<|vision_start|>",
        "<|vision_end|>",
        "<|endoftext|>",
    ];
    let added: Vec<serde_json::Value> = special
        .iter()
        .enumerate()
        .map(|(i, t)| serde_json::json!({"id": 2040 + i, "content": t, "special": true}))
        .collect();
    let tokenizer = serde_json::json!({"model": {"vocab": vocab, "merges": []}, "added_tokens": added}).to_string();
    let safetensors = file(&tensor_specs(&cfg));
    let shards = [("model.safetensors".to_string(), safetensors.as_slice())];
    let mut values = SafetensorsFiles::parse(&shards).unwrap();
    let ckpt = CheckpointText {
        config: &raw,
        tokenizer_json: &tokenizer,
        chat_template: "",
        mean_std: ([0.5; 3], [0.5; 3]),
        name: "t",
    };
    let (t, m) = export(&ckpt, &mut values, crate::arch::ggml::GgmlType::Q8_0).unwrap();
    let (mut text_bytes, mut mmproj_bytes) = (Vec::new(), Vec::new());
    t.write(&mut text_bytes).unwrap();
    m.write(&mut mmproj_bytes).unwrap();
    (cfg, safetensors, text_bytes, mmproj_bytes)
}

/// The pair loaded from its whole files, as the server loads it.
fn gguf_file_logits(cfg: &ModelConfig, text: &[u8], mmproj: &[u8]) -> Vec<f32> {
    use crate::arch::gguf::Gguf;
    use crate::arch::gguf_model::GgufModel;
    use crate::model::gguf_tensors::GgufTensors;
    let (t, m) = (
        Gguf::parse(text, text.len() as u64).unwrap(),
        Gguf::parse(mmproj, mmproj.len() as u64).unwrap(),
    );
    let pair = GgufModel::new(&t, Some(&m)).unwrap();
    let source = GgufTensors::new(&pair, text, mmproj).unwrap();
    let be = cpu();
    let model = QwenVl::load(cfg.clone(), &source, &be, |_, _| {}).unwrap();
    logits(be, model)
}

/// Streams the pair in chunks of `chunk` bytes, the headers parsed first from the files' starts,
/// the projector's last `cut` bytes left out.
fn gguf_stream(
    cfg: &ModelConfig,
    text: &[u8],
    mmproj: &[u8],
    chunk: usize,
    cut: usize,
) -> Result<(Vec<f32>, usize), ModelError> {
    use crate::arch::gguf::Gguf;
    use crate::arch::gguf_model::{GgufModel, Part};
    let (t, m) = (
        Gguf::parse(text, text.len() as u64).unwrap(),
        Gguf::parse(mmproj, mmproj.len() as u64).unwrap(),
    );
    let tensors = GgufModel::new(&t, Some(&m)).unwrap().tensors().unwrap();
    let be = cpu();
    let mut loader = StreamLoader::new(cfg.clone(), &be, |_, _| {})?;
    let pushed = &mmproj[..mmproj.len() - cut];
    for (label, header, bytes, part) in [
        ("text.gguf", &t, text, Part::Text),
        ("mmproj.gguf", &m, pushed, Part::Mmproj),
    ] {
        loader.begin_gguf(label, header, part, &tensors)?;
        for c in bytes.chunks(chunk) {
            loader.push(c)?;
        }
    }
    let peak = loader.peak_held();
    let model = loader.finish()?;
    Ok((logits(be, model), peak))
}

/// A GGUF pair streamed in any chunks gives the logits of the pair loaded whole (which for a
/// q8_0 pair are the safetensors file's with `q8_0` weights, not compared here), holding at most
/// its largest tensor; a truncated projector says how far it got.
#[test]
fn a_gguf_pair_streams_like_its_whole_files() {
    for json in [
        include_str!("../../../../tools/golden/configs/qwen2_5_vl_tiny.json"),
        include_str!("../../../../tools/golden/configs/qwen3_vl_tiny.json"),
    ] {
        let (cfg, _, text, mmproj) = gguf_pair(json);
        let want = gguf_file_logits(&cfg, &text, &mmproj);
        let largest = [&text, &mmproj]
            .iter()
            .flat_map(|f| crate::arch::gguf::Gguf::parse(f, f.len() as u64).unwrap().tensors)
            .map(|t| t.bytes as usize)
            .max()
            .unwrap();
        for chunk in [1, 1000, 64 << 10, text.len()] {
            let (got, peak) = gguf_stream(&cfg, &text, &mmproj, chunk, 0).unwrap();
            assert_eq!(got, want, "{:?}, chunks of {chunk}", cfg.family);
            assert!(peak <= largest, "{chunk}: held {peak} > {largest}");
            if chunk == 1 {
                assert_eq!(peak, largest, "1-byte chunks gather every tensor");
            }
        }
        let err = gguf_stream(&cfg, &text, &mmproj, 4096, 100).unwrap_err().to_string();
        assert!(
            err.contains("mmproj.gguf ended after") && err.contains("truncated"),
            "{err}"
        );
    }
}
