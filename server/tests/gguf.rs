//! GGUF files: `kvlens to-gguf` writes what llama.cpp's converter writes (held against the
//! converter's summaries in engine/tests/fixtures/gguf/, made by tools/gguf/converter_summaries.py),
//! and files that are wrong are one-line errors naming what is wrong.

mod common;

use common::{base64, fixture, kvlens, root, scratch, to_gguf, Server};
use kvlens_engine::arch::gguf::{Gguf, MetaValue};
use serde_json::{json, Value};
use sha2::Digest;
use std::path::{Path, PathBuf};

fn sha256_hex(bytes: &[u8]) -> String {
    sha2::Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// GGUF's name of a value's type, as gguf-py spells it (`ARRAY/STRING` for an array).
fn type_name(v: &MetaValue) -> String {
    let name = match v {
        MetaValue::U8(_) => "UINT8",
        MetaValue::I8(_) => "INT8",
        MetaValue::U16(_) => "UINT16",
        MetaValue::I16(_) => "INT16",
        MetaValue::U32(_) => "UINT32",
        MetaValue::I32(_) => "INT32",
        MetaValue::U64(_) => "UINT64",
        MetaValue::I64(_) => "INT64",
        MetaValue::F32(_) => "FLOAT32",
        MetaValue::F64(_) => "FLOAT64",
        MetaValue::Bool(_) => "BOOL",
        MetaValue::String(_) => "STRING",
        MetaValue::Array(items) => return format!("ARRAY/{}", items.first().map_or("UINT8".into(), type_name)),
    };
    name.to_string()
}

fn value(v: &MetaValue) -> Value {
    match v {
        MetaValue::U8(x) => json!(x),
        MetaValue::I8(x) => json!(x),
        MetaValue::U16(x) => json!(x),
        MetaValue::I16(x) => json!(x),
        MetaValue::U32(x) => json!(x),
        MetaValue::I32(x) => json!(x),
        MetaValue::U64(x) => json!(x),
        MetaValue::I64(x) => json!(x),
        MetaValue::F32(x) => json!(*x as f64),
        MetaValue::F64(x) => json!(x),
        MetaValue::Bool(x) => json!(x),
        MetaValue::String(s) => json!(s),
        MetaValue::Array(items) if items.len() > 16 => {
            let mut h = sha2::Sha256::new();
            for item in items {
                match item {
                    MetaValue::String(s) => {
                        h.update(s.as_bytes());
                        h.update([0]);
                    }
                    MetaValue::I32(x) => h.update(x.to_le_bytes()),
                    MetaValue::U32(x) => h.update(x.to_le_bytes()),
                    MetaValue::F32(x) => h.update(x.to_le_bytes()),
                    MetaValue::Bool(x) => h.update([*x as u8]),
                    other => panic!("no hash rule for {other:?}"),
                }
            }
            let digest: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
            json!({"len": items.len(), "sha256": digest})
        }
        MetaValue::Array(items) => Value::Array(items.iter().map(value).collect()),
    }
}

/// The summary tools/gguf/converter_summaries.py writes for a file.
fn summarize(path: &Path) -> Value {
    let bytes = std::fs::read(path).unwrap();
    let g = Gguf::parse(&bytes, bytes.len() as u64).unwrap();
    let metadata: serde_json::Map<String, Value> = g
        .metadata
        .iter()
        .filter(|(k, _)| !["general.name", "general.size_label", "general.alignment"].contains(&k.as_str()))
        .map(|(k, v)| (k.clone(), json!({"type": type_name(v), "value": value(v)})))
        .collect();
    let tensors: serde_json::Map<String, Value> = g
        .tensors
        .iter()
        .map(|t| {
            let data = &bytes[t.start as usize..(t.start + t.bytes) as usize];
            (
                t.name.clone(),
                json!({"type": t.ggml_type.name(), "ne": t.ne, "sha256": sha256_hex(data)}),
            )
        })
        .collect();
    json!({"metadata": metadata, "tensors": tensors})
}

/// Whether two summary values agree: numbers to 1e-12 relative (serde_json reads a float written
/// by Python to the nearest double or one next to it), the rest exactly.
fn same(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => {
            let (x, y) = (x.as_f64().unwrap_or(f64::NAN), y.as_f64().unwrap_or(f64::NAN));
            (x - y).abs() <= 1e-12 * x.abs().max(y.abs())
        }
        (Value::Array(x), Value::Array(y)) => x.len() == y.len() && x.iter().zip(y).all(|(a, b)| same(a, b)),
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len() && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| same(v, w)))
        }
        _ => a == b,
    }
}

/// The named differences between two summaries (at most a few).
fn differences(want: &Value, got: &Value) -> Vec<String> {
    let mut out = Vec::new();
    for part in ["metadata", "tensors"] {
        let (w, g) = (want[part].as_object().unwrap(), got[part].as_object().unwrap());
        for key in w.keys().chain(g.keys()) {
            let agree = matches!((w.get(key), g.get(key)), (Some(a), Some(b)) if same(a, b));
            if !agree {
                out.push(format!(
                    "{part} {key}: converter {:?}, kvlens {:?}",
                    w.get(key),
                    g.get(key)
                ));
            }
        }
    }
    out.dedup();
    out.truncate(6);
    out
}

/// Writes the summary's checkpoint (the command it records) into the scratch directory.
fn checkpoint_of(summary: &Value, name: &str) -> PathBuf {
    let dir = scratch(name);
    let cmd = summary["checkpoint"].as_str().unwrap();
    let mut args: Vec<&str> = cmd.split_whitespace().skip(1).collect();
    args.extend(["--out", dir.to_str().unwrap(), "--force"]);
    let out = common::kvlens_command()
        .args(&args)
        .current_dir(root())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    dir
}

/// For each family and each type llama.cpp's converter writes (f32, f16, bf16, q8_0): every
/// metadata entry and every tensor's type, dimensions and bytes of `kvlens to-gguf`'s pair equal
/// the converter's for the same checkpoint.
#[test]
fn to_gguf_writes_what_llama_cpp_s_converter_writes() {
    for family in ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"] {
        let path = root().join(format!("engine/tests/fixtures/gguf/{family}.converter.json"));
        let summary: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let ckpt = checkpoint_of(&summary, &format!("gguf-{family}"));
        for (outtype, want) in summary["files"].as_object().unwrap() {
            let (text, mmproj) = to_gguf(&ckpt, outtype, &scratch(&format!("gguf-{family}-{outtype}")));
            for (part, file) in [("text", &text), ("mmproj", &mmproj)] {
                let diff = differences(&want[part], &summarize(file));
                assert!(diff.is_empty(), "{family} {outtype} {part}:\n{}", diff.join("\n"));
            }
        }
    }
}

/// `kvlens generate` on the pair in `dir` (or `--model`/`--mmproj` as given): its stderr and
/// exit code.
fn generate(args: &[&str]) -> (String, Option<i32>) {
    let mut all = vec!["generate", "--prompt", "hi", "--max-tokens", "2"];
    all.extend_from_slice(args);
    let o = kvlens(&all);
    (String::from_utf8_lossy(&o.stderr).into_owned(), o.status.code())
}

/// A wrong file is a one-line error (exit code 2) naming the file and what is wrong with it.
#[test]
fn wrong_gguf_files_are_one_line_errors() {
    let base = root().join("tools/golden/configs");
    // `random-checkpoint --gguf TYPE` writes the pair beside the checkpoint, as to-gguf does.
    let make = |config: &str, name: &str| {
        let dir = scratch(name);
        let o = kvlens(&[
            "random-checkpoint",
            "--config",
            base.join(config).to_str().unwrap(),
            "--dtype",
            "f32",
            "--out",
            dir.to_str().unwrap(),
            "--gguf",
            "q8_0",
            "--force",
        ]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let gguf = dir.join("gguf");
        (
            gguf.join(format!("{name}-Q8_0.gguf")),
            gguf.join(format!("mmproj-{name}-Q8_0.gguf")),
        )
    };
    let (text25, mmproj25) = make("qwen2_5_vl_tiny.json", "gguf-bad-25");
    let (_, mmproj3) = make("qwen3_vl_tiny.json", "gguf-bad-3");
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let one_line = |(err, code): (String, Option<i32>), wants: &[&str]| {
        assert_eq!(code, Some(2), "{err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{err}");
        for w in wants {
            assert!(err.contains(w), "{w:?} not in: {err}");
        }
    };
    // The pair works (the errors below are the files', not the command's).
    let (err, code) = generate(&["--model", &s(&text25), "--mmproj", &s(&mmproj25)]);
    assert_eq!(code, Some(0), "{err}");
    // A Qwen3-VL projector with a Qwen2.5-VL text model.
    one_line(
        generate(&["--model", &s(&text25), "--mmproj", &s(&mmproj3)]),
        &["belongs to a qwen3vl text model, the text model is qwen2vl"],
    );
    // The projector given as the model.
    one_line(
        generate(&["--model", &s(&mmproj25), "--mmproj", &s(&mmproj25)]),
        &["it is a projector (mmproj)"],
    );
    // A truncated text model: the header says where its tensors end.
    let truncated = scratch("gguf-truncated.gguf");
    let bytes = std::fs::read(&text25).unwrap();
    std::fs::write(&truncated, &bytes[..bytes.len() - 1000]).unwrap();
    one_line(
        generate(&["--model", &s(&truncated), "--mmproj", &s(&mmproj25)]),
        &["gguf-truncated.gguf", "ends past the file's", "truncated"],
    );
    // A directory with two text models.
    let two = scratch("gguf-two-texts");
    std::fs::create_dir_all(&two).unwrap();
    for (from, to) in [(&text25, "a.gguf"), (&text25, "b.gguf"), (&mmproj25, "mmproj-a.gguf")] {
        std::fs::copy(from, two.join(to)).unwrap();
    }
    one_line(
        generate(&["--model", &s(&two)]),
        &["one text GGUF and at most one mmproj-*.gguf"],
    );
    // A directory holding only the pair works: tokenizer, template and config from the files.
    std::fs::remove_file(two.join("b.gguf")).unwrap();
    let (err, code) = generate(&["--model", &s(&two)]);
    assert_eq!(code, Some(0), "{err}");
}

/// `kvlens plan` counts a GGUF pair's tensors as stored, and the CPU's ledger after loading holds
/// exactly that (q8_0 blocks and f16 matrices kept as the files store them; the converter writes
/// f16 where a q8_0 matrix's rows do not split into blocks), less Qwen3-VL's position table (read
/// into host memory, not the device's). wgpu's holds that plus at most a word per matrix (a
/// buffer rounded to whole words).
#[test]
fn the_plan_counts_a_gguf_pair_as_stored_and_the_ledger_agrees() {
    let dir = common::tiny_checkpoint("gguf-plan");
    let (text, mmproj) = to_gguf(&dir, "q8_0", &scratch("gguf-plan-q8_0"));
    let (mut stored, mut halves, mut host, mut matrices) = (0u64, 0u64, 0u64, 0u64);
    for file in [&text, &mmproj] {
        let bytes = std::fs::read(file).unwrap();
        let g = Gguf::parse(&bytes, bytes.len() as u64).unwrap();
        for t in &g.tensors {
            stored += t.bytes;
            if t.ggml_type.name() == "F16" && t.ne.len() >= 2 {
                halves += t.bytes;
            }
            if t.name == "v.position_embd.weight" {
                host += t.bytes;
            }
            matrices += u64::from(t.ne.len() >= 2);
        }
    }
    assert!(halves > 0, "the tiny model's 37-wide rows are written in f16");
    assert!(host > 0, "Qwen3-VL has a position table");
    let (s, m) = (text.to_str().unwrap(), mmproj.to_str().unwrap());
    let plan = kvlens(&["plan", "--model", s, "--mmproj", m, "--device", "cpu", "--json"]);
    assert!(plan.status.success(), "{}", String::from_utf8_lossy(&plan.stderr));
    let plan: Value = serde_json::from_slice(&plan.stdout).unwrap();
    assert_eq!(plan["weights_bytes"].as_u64(), Some(stored), "{plan}");
    let held = |backend: &str| {
        let gen = kvlens(&[
            "generate",
            "--backend",
            backend,
            "--model",
            s,
            "--mmproj",
            m,
            "--prompt",
            "hi",
            "--max-tokens",
            "1",
            "--json",
        ]);
        assert!(gen.status.success(), "{}", String::from_utf8_lossy(&gen.stderr));
        let gen: Value = serde_json::from_slice(&gen.stdout).unwrap();
        gen["weights"]["bytes"].as_u64().unwrap()
    };
    assert_eq!(held("cpu"), stored - host);
    let wgpu = held("wgpu");
    assert!(
        (stored - host..=stored - host + 4 * matrices).contains(&wgpu),
        "wgpu holds {wgpu} bytes; the files {stored}, less {host} on the host, {matrices} matrices"
    );
}

/// A text GGUF alone (no projector, as llama.cpp runs without `--mmproj`) is the language model:
/// the pair's greedy tokens on a text prompt, alone in a folder too; a plan and a CPU ledger of
/// the text file's tensors and no encoder cache; images refused with one line that names the
/// missing projector, by `generate` and by the server, which goes on serving.
#[test]
fn a_text_gguf_alone_is_the_language_model() {
    let dir = common::tiny_checkpoint("gguf-text-alone");
    let (text, mmproj) = to_gguf(&dir, "f32", &scratch("gguf-text-alone-f32"));
    let (t, m) = (text.to_str().unwrap(), mmproj.to_str().unwrap());
    let run = |model: &[&str], extra: &[&str]| -> Value {
        let mut args = vec![
            "generate",
            "--prompt",
            "Describe a cat.",
            "--max-tokens",
            "8",
            "--ignore-eos",
            "--json",
        ];
        args.extend_from_slice(model);
        args.extend_from_slice(extra);
        let o = kvlens(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_slice(&o.stdout).unwrap()
    };
    let pair = run(&["--model", t, "--mmproj", m], &[]);
    let alone = run(&["--model", t], &[]);
    assert_eq!(alone["token_ids"], pair["token_ids"]);
    let folder = scratch("gguf-text-alone-folder");
    std::fs::create_dir_all(&folder).unwrap();
    std::fs::copy(&text, folder.join("tiny-F32.gguf")).unwrap();
    let in_folder = run(&["--model", folder.to_str().unwrap()], &[]);
    assert_eq!(in_folder["token_ids"], pair["token_ids"]);

    let bytes = std::fs::read(&text).unwrap();
    let stored: u64 = Gguf::parse(&bytes, bytes.len() as u64)
        .unwrap()
        .tensors
        .iter()
        .map(|t| t.bytes)
        .sum();
    assert_eq!(alone["weights"]["bytes"].as_u64(), Some(stored), "{alone}");
    let plan = kvlens(&["plan", "--model", t, "--device", "cpu", "--json"]);
    assert!(plan.status.success(), "{}", String::from_utf8_lossy(&plan.stderr));
    let plan: Value = serde_json::from_slice(&plan.stdout).unwrap();
    assert_eq!(plan["weights_bytes"].as_u64(), Some(stored), "{plan}");
    assert_eq!(plan["encoder_budget_tokens"], 0, "{plan}");
    assert_eq!(plan["encoder_cache_bytes"], 0, "{plan}");

    let image = fixture("golden/images/c_150x150.png");
    let (err, code) = generate(&["--model", t, "--image", &image]);
    assert_eq!(code, Some(2), "{err}");
    // The log says so at load (a warning), the error at the image.
    assert!(err.contains("WARNING") && err.contains("without a projector"), "{err}");
    let last = err.trim_end().lines().last().unwrap_or_default();
    assert!(
        last.starts_with("error: ") && last.contains("without its vision tower") && last.contains("--mmproj"),
        "{err}"
    );

    let server = Server::start(&text, &[]);
    server.wait_ready();
    let png = std::fs::read(&image).unwrap();
    let chat = |content: Value| {
        server.post(
            "/v1/chat/completions",
            &json!({"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 4}),
        )
    };
    let refused = chat(json!([
        {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{}", base64(&png))}},
        {"type": "text", "text": "Describe this image."},
    ]));
    refused.assert_error(400, "an image for a text model alone");
    assert!(
        refused.text().contains("without its vision tower"),
        "{}",
        refused.text()
    );
    let answered = chat(json!("Describe a cat."));
    assert_eq!(answered.status, 200, "{}", answered.text());
}
