//! `kvlens serve --kv-events-config` read by vLLM's own event classes (msgspec and pyzmq from
//! PyPI), and the 2026 metrics read by prometheus_client's parser
//! (tools/serve_tests/kv_events_suite.py; `cargo xtask test` installs the client venv).

mod common;

use common::python_suite;

#[test]
fn vllm_subscribers_read_every_block_event_and_replay_what_they_missed() {
    python_suite("kv_events_suite.py", "events", &[]);
}

#[test]
fn each_2026_metric_moves_with_what_it_counts() {
    python_suite("kv_events_suite.py", "metrics", &[]);
}
