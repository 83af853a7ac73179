//! `kvlens serve` driven by the official `openai` Python package (tools/serve_tests/openai_suite.py):
//! usage numbers, batching-invariant greedy tokens on the golden checkpoints, 64 concurrent requests
//! sharing 4 images, disconnects and bad input, and `/reset_encoder_cache`. `cargo xtask test`
//! installs the client venv and exports `KVLENS_CLIENT_PYTHON`.

mod common;

use common::python_suite;

fn suite(check: &str) {
    suite_on(check, "cpu");
}

/// Runs one check of the suite with every server on `backend`.
fn suite_on(check: &str, backend: &str) {
    let backend = format!("--serve-arg={backend}");
    python_suite("openai_suite.py", check, &["--serve-arg=--backend", &backend]);
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
