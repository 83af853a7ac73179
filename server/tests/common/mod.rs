//! Helpers shared by the integration tests that run the `kvlens` binary.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Runs `kvlens ARGS` to completion.
pub fn kvlens(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvlens"))
        .args(args)
        .output()
        .expect("kvlens runs")
}

/// The repository root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A file under engine/tests/fixtures, as a path string.
pub fn fixture(path: &str) -> String {
    root().join("engine/tests/fixtures").join(path).display().to_string()
}

/// Writes the tiny Qwen3-VL checkpoint (f32, images of 1024 to 65536 pixels) into Cargo's
/// per-target scratch directory under `name` (overwritten by every run) and returns its path.
pub fn tiny_checkpoint(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let config = root().join("tools/golden/configs/qwen3_vl_tiny.json");
    let out = kvlens(&[
        "random-checkpoint",
        "--config",
        config.to_str().unwrap(),
        "--out",
        dir.to_str().unwrap(),
        "--dtype",
        "f32",
        "--image-limits",
        "1024,65536",
        "--force",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    dir
}
