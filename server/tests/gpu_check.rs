//! tools/gpu_check/check.py, the script a GPU machine runs (issue 32), in its dry run: no GPU, so
//! the CUDA steps must say "no device", while the wgpu steps run on this machine's adapter
//! (lavapipe in CI) and serve runs on the CPU backend, on the tiny Qwen3-VL checkpoint. It keeps
//! the script from rotting while no GPU is available: every step's code and every parser of a
//! kvlens output runs here.

mod common;

use common::{root, scratch};
use serde_json::Value;
use std::process::Command;

#[test]
fn the_gpu_check_script_runs_every_step_without_a_gpu() {
    let out = scratch("gpu-check-out");
    let work = scratch("gpu-check-work");
    let _ = std::fs::remove_dir_all(&out);
    let _ = std::fs::remove_dir_all(&work);
    let config = root().join("tools/golden/configs/qwen3_vl_tiny.json");
    let run = Command::new("python3")
        .arg(root().join("tools/gpu_check/check.py"))
        .args(["--dry-run", "--wgpu-adapter", "", "--fixtures-only", "qwen3_vl"])
        .args([
            "--max-tokens",
            "4",
            "--prompts-rate2",
            "2",
            "--prompts-rate8",
            "4",
            "--bench-output-len",
            "8",
        ])
        .args(["--max-model-len", "4096", "--deadline-s", "3000"])
        .arg("--out")
        .arg(&out)
        .arg("--work")
        .arg(&work)
        .arg("--kvlens")
        .arg(env!("CARGO_BIN_EXE_kvlens"))
        .arg("--root")
        .arg(root())
        .arg("--fixtures")
        .arg(root().join("engine/tests/fixtures/golden"))
        .arg("--configs")
        .arg(&config)
        .output()
        .expect("python3 runs");
    let log = format!(
        "{}{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(run.status.success(), "{log}");
    let summary: Value = serde_json::from_slice(&std::fs::read(out.join("summary.json")).unwrap()).unwrap();
    let steps = &summary["steps"];
    let result = |name: &str| -> &Value {
        let step = &steps[name];
        assert!(
            step.get("error").is_none() && step.get("skipped").is_none(),
            "{name}: {step}\n{log}"
        );
        &step["result"]
    };
    assert_eq!(result("device")["device"], "no device");
    for cuda in [
        "suite",
        "golden/cuda",
        "golden/cuda-plain-decode",
        "golden/cuda-tiled",
        "anchor/qwen3_vl_tiny",
    ] {
        assert_eq!(result(cuda)["skipped"], "no device", "{cuda}");
    }

    let golden = result("vulkan/golden");
    assert_eq!(golden["all_ok"], true, "{golden}");
    assert!(golden["runs"]["qwen3_vl/bfloat16"]["tokens_compared"].as_u64().unwrap() >= 10);

    let kernels = result("vulkan/kernels");
    let rows = kernels["rows"].as_array().unwrap();
    assert!(!rows.is_empty(), "{kernels}");
    assert!(
        rows.iter().all(|r| r
            .as_object()
            .unwrap()
            .values()
            .any(|v| v.as_str().is_some_and(|s| s.contains(" GB/s")))),
        "{kernels}"
    );

    let wgpu = result("wgpu/qwen3_vl_tiny");
    assert_eq!(wgpu["token_ids"].as_array().unwrap().len(), 4, "{wgpu}");
    assert!(wgpu["decode_tokens_per_s"].as_f64().unwrap() > 0.0, "{wgpu}");
    // The host's share of the decode time: recording the steps, before each waits for its read.
    let share = wgpu["decode_record_share"].as_f64().unwrap();
    assert!(share > 0.0 && share <= 1.0, "{wgpu}");

    let serve = result("serve/qwen3_vl_tiny");
    assert_eq!(serve["backend"], "cpu");
    for key in ["weights_gib", "available_kv_gib"] {
        assert!(serve["measured"][key].as_f64().is_some(), "{key}: {serve}");
        assert!(serve["planned_over_measured"][key].as_f64().is_some(), "{key}: {serve}");
    }
    for (rate, prompts) in [("bench_rate2", 2), ("bench_rate8", 4)] {
        assert_eq!(serve[rate]["completed"], prompts, "{rate}: {serve}");
        assert!(serve[rate]["median_ttft_ms"].as_f64().unwrap() > 0.0, "{rate}: {serve}");
    }
    assert!(out.join("details.tar.gz").metadata().unwrap().len() > 0);
}
