//! Helpers shared by the integration tests that run the `kvlens` binary: running it, the tiny
//! checkpoint, `kvlens serve` as a child process and raw HTTP/1.1 requests to it.

// Every file under tests/ is its own crate and uses only some of these helpers; the rest would
// be dead code there.
#![allow(dead_code)]

use serde_json::Value;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

/// The client venv's Python (`KVLENS_CLIENT_PYTHON`, else `~/.cache/kvlens/client-venv`), which
/// `cargo xtask test` fills with the openai client, Pillow, msgspec, pyzmq and prometheus_client.
pub fn client_python() -> PathBuf {
    let path = std::env::var_os("KVLENS_CLIENT_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_default();
            home.join(".cache/kvlens/client-venv/bin/python")
        });
    assert!(
        path.is_file(),
        "{} not found: run `cargo xtask test` (it installs the client venv) or set KVLENS_CLIENT_PYTHON",
        path.display()
    );
    path
}

/// Runs one check of a Python suite under tools/serve_tests (`--kvlens BIN --work DIR --only
/// CHECK ARGS`), which prints `ok CHECK` when it passes.
pub fn python_suite(script: &str, check: &str, args: &[&str]) {
    // Its own directory per check and arguments: tests run in parallel.
    let tag: String = args.concat().chars().filter(char::is_ascii_alphanumeric).collect();
    let work = scratch(&format!("{}-{check}-{tag}", script.trim_end_matches(".py")));
    let out = Command::new(client_python())
        .arg(root().join("tools/serve_tests").join(script))
        .args(["--kvlens", env!("CARGO_BIN_EXE_kvlens"), "--work"])
        .arg(&work)
        .args(args)
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

/// Standard base64 with padding.
pub fn base64(data: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(data)
}

/// The `kvlens` binary under test, as a command to add arguments to.
pub fn kvlens_command() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvlens"))
}

/// Runs `kvlens ARGS` to completion.
pub fn kvlens(args: &[&str]) -> Output {
    kvlens_command().args(args).output().expect("kvlens runs")
}

/// The repository root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A file under engine/tests/fixtures, as a path string.
pub fn fixture(path: &str) -> String {
    root().join("engine/tests/fixtures").join(path).display().to_string()
}

/// `name` in Cargo's per-target scratch directory for the integration tests.
pub fn scratch(name: &str) -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join(name)
}

/// Writes the tiny Qwen3-VL checkpoint (f32, images of 1024 to 65536 pixels) into the scratch
/// directory under `name` (overwritten by every run) and returns its path.
pub fn tiny_checkpoint(name: &str) -> PathBuf {
    tiny_checkpoint_in(name, "f32")
}

/// [`tiny_checkpoint`] with its tensors stored as `dtype` (`f32`, `bf16` or `f16`).
pub fn tiny_checkpoint_in(name: &str, dtype: &str) -> PathBuf {
    tiny_checkpoint_with(name, &["--dtype", dtype])
}

/// [`tiny_checkpoint`] written with these extra `random-checkpoint` arguments.
pub fn tiny_checkpoint_with(name: &str, args: &[&str]) -> PathBuf {
    checkpoint_of(&root().join("tools/golden/configs/qwen3_vl_tiny.json"), name, args)
}

/// A random checkpoint of `config` (images of 1024 to 65536 pixels) written into the scratch
/// directory under `name` with these extra `random-checkpoint` arguments.
pub fn checkpoint_of(config: &Path, name: &str, args: &[&str]) -> PathBuf {
    let dir = scratch(name);
    let out = kvlens(
        &[
            "random-checkpoint",
            "--config",
            config.to_str().unwrap(),
            "--out",
            dir.to_str().unwrap(),
            "--image-limits",
            "1024,65536",
            "--force",
        ]
        .iter()
        .chain(args)
        .copied()
        .collect::<Vec<_>>(),
    );
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    dir
}

/// An HTTP answer.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    /// The status line and the headers.
    pub head: String,
    /// The body, de-chunked.
    pub body: Vec<u8>,
}

impl Reply {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| panic!("{e}: {} {}", self.status, self.text()))
    }

    /// The `data:` payloads of a Server-Sent Events body.
    pub fn events(&self) -> Vec<String> {
        self.text()
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .map(str::to_string)
            .collect()
    }

    /// Asserts OpenAI's error shape with this status.
    pub fn assert_error(&self, status: u16, what: &str) {
        assert_eq!(self.status, status, "{what}: {}", self.text());
        let e = &self.json()["error"];
        assert_eq!(e["code"], status, "{what}: {e}");
        assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{what}: {e}");
        assert!(e["type"].as_str().is_some_and(|t| !t.is_empty()), "{what}: {e}");
    }
}

/// Decodes a chunked transfer-encoded body.
fn dechunk(mut data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(eol) = data.windows(2).position(|w| w == b"\r\n") {
        let size = std::str::from_utf8(&data[..eol])
            .unwrap()
            .split(';')
            .next()
            .unwrap()
            .trim();
        let size = usize::from_str_radix(size, 16).unwrap();
        data = &data[eol + 2..];
        if size == 0 {
            break;
        }
        out.extend_from_slice(&data[..size]);
        data = &data[size + 2..];
    }
    out
}

/// Opens a connection to 127.0.0.1:`port` and writes one request (`Connection: close`, a JSON
/// content type when there is a body); the answer is left to read.
pub fn send(port: u16, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> TcpStream {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("the port accepts connections");
    s.set_read_timeout(Some(Duration::from_secs(300))).unwrap();
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    if !body.is_empty() {
        head.push_str("Content-Type: application/json\r\n");
    }
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body).unwrap();
    s
}

/// One request, read to the end of the answer.
pub fn http(port: u16, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Reply {
    let mut raw = Vec::new();
    send(port, method, path, headers, body).read_to_end(&mut raw).unwrap();
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no complete head in {:?}", String::from_utf8_lossy(&raw)));
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    let mut body = raw[split + 4..].to_vec();
    if head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        body = dechunk(&body);
    }
    Reply { status, head, body }
}

/// `kvlens serve` as a child process, killed on drop.
pub struct Server {
    child: Mutex<Child>,
    port: u16,
    log: Arc<Mutex<Vec<String>>>,
}

impl Server {
    /// Starts `kvlens serve --model MODEL --served-model-name tiny --port 0 --cpu-memory-gib 1 EXTRA`
    /// and returns once it has printed its port (the model may still be loading).
    pub fn start(model: &Path, extra: &[&str]) -> Server {
        Self::start_with_env(model, extra, &[])
    }

    /// [`Server::start`] with extra environment variables.
    pub fn start_with_env(model: &Path, extra: &[&str], env: &[(&str, &str)]) -> Server {
        let mut child = kvlens_command()
            .arg("serve")
            .arg("--model")
            .arg(model)
            .args(["--served-model-name", "tiny", "--port", "0", "--cpu-memory-gib", "1"])
            .args(extra)
            .env_remove("KVLENS_API_KEY")
            // The port is read from an INFO line that a stricter filter would hide.
            .env_remove("RUST_LOG")
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("kvlens serve starts");
        let stderr = child.stderr.take().unwrap();
        let log = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = mpsc::channel();
        let lines = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(rest) = line.split("Starting vLLM API server on http://").nth(1) {
                    let _ = tx.send(rest.rsplit(':').next().and_then(|p| p.trim().parse::<u16>().ok()));
                }
                lines.lock().unwrap().push(line);
            }
        });
        let mut server = Server {
            child: Mutex::new(child),
            port: 0,
            log,
        };
        match rx.recv_timeout(Duration::from_secs(300)) {
            Ok(Some(port)) => server.port = port,
            _ => panic!("the server did not report its port:\n{}", server.log()),
        }
        server
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn pid(&self) -> u32 {
        self.child.lock().unwrap().id()
    }

    /// The lines the server has written to stderr so far.
    pub fn log(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }

    fn running(&self) -> bool {
        self.child.lock().unwrap().try_wait().unwrap().is_none()
    }

    /// Waits until `/health` answers 200 and the log holds every start-up line (the server logs
    /// `Application startup complete.` just after it turns healthy, and the log is read by
    /// another thread).
    pub fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(300);
        while self.get("/health").status != 200 || !self.log().contains("Application startup complete.") {
            assert!(Instant::now() < deadline, "never healthy:\n{}", self.log());
            assert!(self.running(), "the server exited:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn get(&self, path: &str) -> Reply {
        http(self.port, "GET", path, &[], b"")
    }

    pub fn post(&self, path: &str, body: &Value) -> Reply {
        http(self.port, "POST", path, &[], body.to_string().as_bytes())
    }

    /// Sends `signal` ("INT", "TERM") and waits for the exit.
    pub fn stop(self, signal: &str) -> ExitStatus {
        let pid = self.child.lock().unwrap().id().to_string();
        assert!(Command::new("kill")
            .args([&format!("-{signal}"), &pid])
            .status()
            .unwrap()
            .success());
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = self.child.lock().unwrap().try_wait().unwrap() {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "no exit 30 s after SIG{signal}:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let child = self.child.get_mut().unwrap_or_else(|e| e.into_inner());
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// `kvlens to-gguf --outtype T` of a checkpoint: the (text, projector) paths.
pub fn to_gguf(ckpt: &Path, outtype: &str, out: &Path) -> (PathBuf, PathBuf) {
    let o = kvlens(&[
        "to-gguf",
        "--model",
        ckpt.to_str().unwrap(),
        "--outtype",
        outtype,
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let paths: Vec<PathBuf> = String::from_utf8_lossy(&o.stdout).lines().map(PathBuf::from).collect();
    (paths[0].clone(), paths[1].clone())
}
