//! `kvlens serve` driven by the official `openai` Python package (tools/serve_tests/openai_suite.py):
//! usage numbers, batching-invariant greedy tokens on the golden checkpoints, 64 concurrent requests
//! sharing 4 images, disconnects and bad input, and `/reset_encoder_cache`. `cargo xtask test`
//! installs the client venv and exports `KVLENS_CLIENT_PYTHON`.

mod common;

use common::{root, scratch};
use std::path::PathBuf;
use std::process::Command;

fn client_python() -> PathBuf {
    let path = std::env::var_os("KVLENS_CLIENT_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_default();
            home.join(".cache/kvlens/client-venv/bin/python")
        });
    assert!(
        path.is_file(),
        "{} not found: run `cargo xtask test` (it installs the openai client venv) or set KVLENS_CLIENT_PYTHON",
        path.display()
    );
    path
}

fn suite(check: &str) {
    suite_on(check, "cpu");
}

/// Runs one check of the suite with every server on `backend`.
fn suite_on(check: &str, backend: &str) {
    let work = scratch(&format!("serve-openai-{check}-{backend}"));
    let out = Command::new(client_python())
        .arg(root().join("tools/serve_tests/openai_suite.py"))
        .args(["--kvlens", env!("CARGO_BIN_EXE_kvlens"), "--work"])
        .arg(&work)
        .args(["--serve-arg=--backend", &format!("--serve-arg={backend}")])
        .args(["--only", check])
        .output()
        .expect("python runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert!(
        out.status.success() && stdout.contains(&format!("ok {check}")),
        "{check}:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn openai_client_chat_stream_and_usage() {
    suite("basics");
}

#[test]
fn golden_tokens_with_1_and_16_concurrent_requests() {
    suite("golden");
}

#[test]
fn sixty_four_concurrent_requests_share_four_images() {
    suite("concurrency");
}

#[test]
fn disconnects_and_bad_input_leave_nothing_behind() {
    suite("faults");
}

#[test]
fn reset_encoder_cache_returns_bytes() {
    suite("reset");
}

#[test]
fn sixty_four_concurrent_requests_share_four_images_on_wgpu() {
    suite_on("concurrency", "wgpu");
}
