//! `kvlens plan --from-log` on the three sample vLLM / vllm-ascend logs, one trimmed of its total,
//! and on `kvlens serve`'s own start-up log.

mod common;

use serde_json::Value;
use std::process::Command;

const GIB: f64 = (1u64 << 30) as f64;

fn fixture(name: &str) -> String {
    format!(
        "{}/../engine/tests/fixtures/vllm-logs/{name}",
        env!("CARGO_MANIFEST_DIR")
    )
}

fn from_log(name: &str, extra: &[&str]) -> Value {
    let path = fixture(name);
    let out = Command::new(env!("CARGO_BIN_EXE_kvlens"))
        .args(["plan", "--json", "--from-log", &path])
        .args(extra)
        .output()
        .expect("kvlens runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("one JSON object")
}

/// Lines of the fixture that carry a number (every one must be recognised).
fn numeric_lines(name: &str) -> usize {
    std::fs::read_to_string(fixture(name))
        .unwrap()
        .lines()
        .filter(|l| !l.starts_with('#') && l.chars().any(|c| c.is_ascii_digit()))
        .count()
}

fn recognised_non_header(v: &Value) -> usize {
    v["recognised"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["kind"] != "header")
        .count()
}

fn gib2(v: &Value) -> String {
    format!("{:.2}", v.as_f64().unwrap() / GIB)
}

fn all_checks_ok(v: &Value) -> bool {
    v["checks"].as_array().unwrap().iter().all(|c| c["ok"] == true)
}

#[test]
fn new_format_8b_log_rebuilds_44_30_gib_and_645120_tokens() {
    let name = "qwen3-vl-8b-tp2-new-profiling.log";
    let v = from_log(name, &[]);
    assert_eq!(recognised_non_header(&v), numeric_lines(name));
    assert_eq!(v["format"], "new");
    let p = &v["plan"];
    assert_eq!(gib2(&p["available_kv_bytes"]), "44.30");
    assert_eq!(gib2(&p["requested_bytes"]), "57.91");
    // The log prints requested memory and utilisation but no total: 57.91 / 0.95.
    assert_eq!(
        (gib2(&p["total_bytes"]).as_str(), p["total_source"].as_str()),
        ("60.96", Some("derived"))
    );
    assert_eq!(p["kv_cache_tokens"], 645_120);
    assert_eq!(p["tensor_parallel_size"], 2);
    assert_eq!(p["block_size"], 128);
    assert_eq!(p["available_kv_source"], "from_log");
    assert_eq!(
        (p["encoder_budget_tokens"].as_u64(), p["encoder_profile_items"].as_u64()),
        (Some(32_768), Some(2))
    );
    assert!(all_checks_ok(&v), "{:#}", v["checks"]);
    assert!(v["checks"].as_array().unwrap().len() >= 5);
}

#[test]
fn old_format_8b_log_is_identified_and_reconciled() {
    let name = "qwen3-vl-8b-tp2-old-profiling.log";
    let v = from_log(name, &[]);
    assert_eq!(
        recognised_non_header(&v),
        numeric_lines(name) + 1,
        "plus the 'results of real profiling:' marker"
    );
    assert_eq!(v["format"], "old");
    let p = &v["plan"];
    // 57.91 GiB requested = 0.95 × 60.96 GiB, and the smaller of the two ranks' figures is used.
    assert_eq!(gib2(&p["requested_bytes"]), "57.91");
    assert_eq!(gib2(&p["available_kv_bytes"]), "43.33");
    let checks = v["checks"].as_array().unwrap();
    let requested = checks
        .iter()
        .find(|c| c["formula"].as_str().unwrap().starts_with("requested"))
        .unwrap();
    assert_eq!(requested["ok"], true);
    // The old formula with the printed peak and non-torch gives 43.54 GiB; the printed 43.40 and
    // 43.33 imply 1.40 and 1.47 GiB of non-torch memory: flagged, with the implied figure.
    let old: Vec<&Value> = checks
        .iter()
        .filter(|c| c["formula"].as_str().unwrap().contains("old formula"))
        .collect();
    assert_eq!(old.len(), 2);
    assert!(old.iter().all(|c| c["ok"] == false));
    assert!(
        old[0]["detail"].as_str().unwrap().contains("43.54") && old[0]["detail"].as_str().unwrap().contains("1.40")
    );
    assert!(old[1]["detail"].as_str().unwrap().contains("1.47"));
}

/// The old-profiling log without its "total memory" line, planned for an H100 preset: the total is
/// requested / utilisation (60.96 GiB, not the preset's), marked derived, and said in a line;
/// `--total-memory-gib` keeps a stated total and checks the log's requested memory against it.
#[test]
fn a_log_without_a_total_infers_it() {
    let text = std::fs::read_to_string(fixture("qwen3-vl-8b-tp2-old-profiling.log")).unwrap();
    let trimmed: String = text
        .lines()
        .filter(|l| !l.contains("total memory"))
        .map(|l| format!("{l}\n"))
        .collect();
    let path = common::scratch("old-profiling-without-total.log");
    std::fs::write(&path, trimmed).unwrap();
    let run = |extra: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_kvlens"))
            .args(["plan", "--from-log", path.to_str().unwrap(), "--device", "h100-80g"])
            .args(extra)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    let v: Value = serde_json::from_str(&run(&["--json"])).unwrap();
    let p = &v["plan"];
    assert_eq!(gib2(&p["total_bytes"]), "60.96");
    assert_eq!(
        (p["total_source"].as_str(), p["requested_source"].as_str()),
        (Some("derived"), Some("from_log"))
    );
    assert_eq!(gib2(&p["requested_bytes"]), "57.91");
    assert_eq!(gib2(&p["available_kv_bytes"]), "43.33");
    let notes = v["notes"].as_array().unwrap();
    assert_eq!(notes.len(), 1);
    assert!(
        notes[0].as_str().unwrap().contains("57.91 GiB / 0.95 = 60.96 GiB"),
        "{notes:?}"
    );

    let text = run(&[]);
    assert!(
        text.contains("The log prints no total memory: total = requested / gpu_memory_utilization"),
        "{text}"
    );
    let row = |label: &str| {
        text.lines()
            .find(|l| l.trim_start().starts_with(label))
            .unwrap()
            .to_string()
    };
    assert!(row("total device memory").ends_with("derived"), "{text}");
    assert!(row("requested").ends_with("from log"), "{text}");

    let v: Value = serde_json::from_str(&run(&["--json", "--total-memory-gib", "64"])).unwrap();
    assert_eq!(
        (
            gib2(&v["plan"]["total_bytes"]).as_str(),
            v["plan"]["total_source"].as_str()
        ),
        ("64.00", Some("given"))
    );
    assert!(v["notes"].as_array().unwrap().is_empty());
    let requested = v["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["formula"].as_str().unwrap().starts_with("requested"))
        .unwrap();
    assert_eq!(
        requested["ok"], false,
        "64 GiB × 0.95 is not the 57.91 GiB the log printed"
    );
}

#[test]
fn qwen3_vl_32b_log_and_what_would_fit_262144() {
    let name = "qwen3-vl-32b-tp2-maxlen262144.log";
    let v = from_log(name, &["--target-max-model-len", "262144"]);
    assert_eq!(recognised_non_header(&v), numeric_lines(name));
    assert_eq!(v["format"], "old");
    let p = &v["plan"];
    assert_eq!(p["model"], "Qwen3-VL-32B-Instruct");
    assert_eq!(p["fits"], false);
    assert_eq!(p["estimated_max_model_len"], 164_224);
    assert_eq!(p["total_bytes"], 65_452_113_920u64);
    assert!(all_checks_ok(&v), "{:#}", v["checks"]);

    // By hand: requested = ceil(0.9 × 65,452,113,920) = 58,906,902,528; non-KV = requested −
    // 21,540,531,712 available = 37,366,370,816; needed at 262,144 = 64 layers × 2,048 blocks ×
    // 262,144 B = 34,359,738,368. Utilization needed = (needed + non-KV) / total = 1.0959 > 1.
    let requested = (0.9f64 * 65_452_113_920.0).ceil() as u64;
    assert_eq!(requested, 58_906_902_528);
    let non_kv = requested - 21_540_531_712;
    let needed = 64u64 * 2_048 * 262_144;
    let util = (needed + non_kv) as f64 / 65_452_113_920.0;
    assert!((util - 1.0959).abs() < 1e-4, "{util}");
    let answers = v["what_if"].as_array().unwrap();
    let knob = |k: &str| {
        answers
            .iter()
            .find(|w| w["knob"] == k)
            .unwrap_or_else(|| panic!("no {k}"))
    };
    let u = knob("gpu-memory-utilization");
    assert!(u["change"].is_null(), "utilization above 1 cannot fit");
    assert!(u["detail"].as_str().unwrap().contains(&format!("{util:.4}")), "{u}");
    // TP 4: 2 KV heads per rank halve the need to 16 GiB; weights per rank halve to ~15.7 GiB.
    let tp = knob("tensor-parallel-size");
    assert_eq!(tp["change"], "--tensor-parallel-size 4");
    assert!(tp["detail"].as_str().unwrap().contains("16.00 GiB needed"), "{tp}");
    // fp8 KV halves the need to 16 GiB < 20.06 GiB.
    assert_eq!(knob("kv-cache-dtype")["change"], "--kv-cache-dtype fp8");
}

#[test]
fn arbitrary_text_is_not_an_error() {
    let dir = std::env::temp_dir().join(format!("kvlens-log-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("noise.log");
    std::fs::write(&path, b"\xff\xfe garbage 12.5 GiB\nAvailable KV cache memory: lots\n\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_kvlens"))
        .args(["plan", "--from-log", path.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("Recognised 0 lines"));
    let missing = Command::new(env!("CARGO_BIN_EXE_kvlens"))
        .args(["plan", "--from-log", dir.join("absent.log").to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(missing.status.code(), Some(2));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_kvlens_serve_log_rebuilds_the_budget_the_server_measured() {
    let ckpt = common::tiny_checkpoint("plan-from-log-ckpt");
    let server = common::Server::start(&ckpt, &["--cpu-memory-gib", "2", "--max-model-len", "2048"]);
    server.wait_ready();
    let info = server.get("/server_info").json();
    let log = server.log();
    assert!(server.stop("INT").success());
    let path = common::scratch("kvlens-serve.log");
    std::fs::write(&path, &log).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_kvlens"))
        .args([
            "plan",
            "--json",
            "--from-log",
            path.to_str().unwrap(),
            "--model",
            ckpt.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["format"], "new");
    assert!(all_checks_ok(&v), "{:#}\n{log}", v["checks"]);
    let (p, served) = (&v["plan"], &info["plan"]);
    assert_eq!(p["device"], "cpu");
    assert_eq!(p["total_bytes"], served["total_bytes"]);
    for key in [
        "max_model_len",
        "max_num_batched_tokens",
        "max_num_seqs",
        "block_size",
        "encoder_budget_tokens",
    ] {
        assert_eq!(p[key], served[key], "{key}");
    }
    assert_eq!(p["weights_source"], "from_log");
    assert_eq!(p["activation_peak_source"], "from_log");
    // The log prints GiB with two decimals: the rebuilt KV cache is within that rounding.
    let (rebuilt, measured) = (
        p["kv_cache_tokens"].as_f64().unwrap(),
        served["kv_cache_tokens"].as_f64().unwrap(),
    );
    assert!((rebuilt - measured).abs() / measured < 0.01, "{rebuilt} vs {measured}");
}
