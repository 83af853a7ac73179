//! `kvlens bench serve` end to end.
//!
//! * Against `kvlens serve` on a tiny random checkpoint: 24 synthetic-vision prompts at 8 requests/s
//!   all succeed, the result block has every line vLLM prints, TTFT ≤ E2EL for every request, the
//!   generated tokens add up to the server's `vllm:generation_tokens_total` delta, and the memory
//!   timeline shows the encoder cache holding something.
//! * Against a vLLM-like mock (what kvlens serve cannot show): no `/v1/memory` means no timeline and
//!   a note, SSE comments and several tokens per chunk are read as vLLM reads them, and the initial
//!   single-prompt test run is one more request. A mock whose `/v1/memory` answers late: the
//!   after-run reset splits the timeline where it happened.
//! * Without `--tokenizer`: prompt tokens counted by kvlens serve's `/tokenize` equal the local
//!   tokenizer's; a server without `/tokenize` stops the run with the reason.
//! * Against nothing: one line on stderr, exit code 1.

mod common;

use common::{kvlens_command as kvlens, scratch, tiny_checkpoint, Server};
use serde_json::Value;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

fn work_dir(name: &str) -> PathBuf {
    let dir = scratch(&format!("bench-serve-{name}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The tiny Qwen3-VL checkpoint of the golden tests, with image limits that keep its vision tower
/// fast (big photos are resized down to at most 65536 pixels by the server); shared by the tests.
fn checkpoint() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| tiny_checkpoint("bench-serve-ckpt"))
}

/// `vllm:generation_tokens_total`, summed over its label sets.
fn generation_tokens(server: &Server) -> f64 {
    let r = server.get("/metrics");
    assert_eq!(r.status, 200);
    r.text()
        .lines()
        .filter(|l| l.starts_with("vllm:generation_tokens_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// `--percentile-metrics` and `--metric-percentiles` as [`assert_result_block`] expects them.
const PERCENTILES: [&str; 4] = [
    "--percentile-metrics",
    "ttft,tpot,itl,e2el",
    "--metric-percentiles",
    "50,90,99",
];

/// Runs `cmd`, asserts that it succeeds and returns its stdout.
fn succeed(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// Every line vLLM's result block prints for `--percentile-metrics ttft,tpot,itl,e2el
/// --metric-percentiles 50,90,99` at a finite rate, and kvlens's image-token line.
fn assert_result_block(stdout: &str) {
    let mut want = vec![
        "============ Serving Benchmark Result ============".to_string(),
        "Successful requests:".into(),
        "Failed requests:".into(),
        "Request rate configured (RPS):".into(),
        "Benchmark duration (s):".into(),
        "Total input tokens:".into(),
        "Total input image tokens:".into(),
        "Total generated tokens:".into(),
        "Request throughput (req/s):".into(),
        "Output token throughput (tok/s):".into(),
        "Peak output token throughput (tok/s):".into(),
        "Peak concurrent requests:".into(),
        "Total Token throughput (tok/s):".into(),
        "---------------Time to First Token----------------".into(),
        "-----Time per Output Token (excl. 1st token)------".into(),
        "---------------Inter-token Latency----------------".into(),
        "----------------End-to-end Latency----------------".into(),
    ];
    for name in ["TTFT", "TPOT", "ITL", "E2EL"] {
        for stat in ["Mean", "Median", "P50", "P90", "P99"] {
            want.push(format!("{stat} {name} (ms):"));
        }
    }
    let block = stdout
        .split("============ Serving Benchmark Result")
        .nth(1)
        .unwrap_or_else(|| panic!("no result block:\n{stdout}"));
    for line in &want {
        assert!(
            stdout.lines().any(|l| l.starts_with(line.as_str())),
            "missing {line:?}:\n{stdout}"
        );
    }
    assert!(block.lines().any(|l| l == "=".repeat(50)), "no closing rule:\n{stdout}");
}

fn value_after<'a>(stdout: &'a str, label: &str) -> &'a str {
    let line = stdout.lines().find(|l| l.starts_with(label)).unwrap();
    line[label.len()..].trim()
}

fn read_json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn numbers(v: &Value, key: &str) -> Vec<f64> {
    v[key].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
}

#[test]
fn synthetic_vision_against_kvlens_serve() {
    let dir = work_dir("kvlens");
    let ckpt = checkpoint();
    let server = Server::start(ckpt, &[]);
    server.wait_ready();
    let before = generation_tokens(&server);
    let (result, plot) = (dir.join("result.json"), dir.join("memory.png"));
    let out = kvlens()
        .args([
            "bench",
            "serve",
            "--base-url",
            &format!("http://127.0.0.1:{}", server.port()),
        ])
        .args(["--model", "tiny", "--tokenizer"])
        .arg(ckpt)
        .args([
            "--dataset-name",
            "synthetic-vision",
            "--num-prompts",
            "24",
            "--request-rate",
            "8",
        ])
        .args(["--output-len", "16", "--ignore-eos", "--seed", "0"])
        .args(PERCENTILES)
        // The initial test request would add its own tokens to the server's counter.
        .args(["--ready-check-timeout-sec", "0", "--memory-interval-ms", "100"])
        .args(["--after-run-s", "1", "--reset-encoder-cache-after-run"])
        .args(["--save-result", "--result-filename"])
        .arg(&result)
        .arg("--plot")
        .arg(&plot)
        .arg("--disable-tqdm")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}\nserver:\n{}", server.log());
    println!("{stdout}");
    assert_result_block(&stdout);
    assert_eq!(value_after(&stdout, "Successful requests:"), "24");
    assert_eq!(value_after(&stdout, "Failed requests:"), "0");
    let after = generation_tokens(&server);

    let r = read_json(&result);
    assert_eq!(r["completed"], 24);
    assert!(
        r["errors"].as_array().unwrap().iter().all(|e| e == ""),
        "{}",
        r["errors"]
    );
    let (ttfts, e2els) = (numbers(&r, "ttfts"), numbers(&r, "e2els"));
    assert_eq!((ttfts.len(), e2els.len()), (24, 24));
    for (i, (ttft, e2el)) in ttfts.iter().zip(&e2els).enumerate() {
        assert!(*ttft > 0.0 && ttft <= e2el, "request {i}: TTFT {ttft} E2EL {e2el}");
    }
    let output: f64 = numbers(&r, "output_lens").iter().sum();
    assert_eq!(output, r["total_output_tokens"].as_f64().unwrap());
    assert_eq!(output, after - before, "generated tokens vs the server's counter");
    assert!(
        numbers(&r, "input_image_lens").iter().all(|&n| n > 0.0),
        "{}",
        r["input_image_lens"]
    );
    assert!(r["total_input_image_tokens"].as_u64().unwrap() > 0);
    for key in [
        "p90_ttft_ms",
        "median_e2el_ms",
        "mean_itl_ms",
        "std_tpot_ms",
        "max_concurrent_requests",
    ] {
        assert!(r[key].is_number(), "{key}");
    }
    let samples = r["timeline"]["samples"].as_array().unwrap();
    assert!(
        samples.iter().any(|s| s["encoder_cache_bytes"].as_u64() > Some(0)),
        "no sample with the encoder cache in use: {}",
        r["timeline"]
    );
    assert!(samples.iter().all(|s| s["weights_bytes"].as_u64() > Some(0)));
    assert!(std::fs::metadata(&plot).unwrap().len() > 1000);

    // After the run the encoder cache stays full until the benchmark resets it.
    let events = r["timeline"]["events"].as_array().unwrap();
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(
        (events[0]["what"].as_str(), events[0]["status"].as_u64()),
        (Some("POST /reset_encoder_cache"), Some(200))
    );
    let reset_at = events[0]["t"].as_f64().unwrap();
    let at = |before: bool| {
        samples
            .iter()
            .filter(|s| (s["t"].as_f64().unwrap() < reset_at) == before)
            .map(|s| s["encoder_cache_bytes"].as_u64().unwrap())
            .collect::<Vec<_>>()
    };
    assert!(at(true).last() > Some(&0), "full after the run");
    assert_eq!(at(false).last(), Some(&0), "empty after the reset");

    // `bench plot` redraws the saved timeline.
    let svg = dir.join("again.svg");
    let replot = kvlens()
        .args(["bench", "plot"])
        .arg(&result)
        .arg("--plot")
        .arg(&svg)
        .output()
        .unwrap();
    assert!(replot.status.success(), "{}", String::from_utf8_lossy(&replot.stderr));
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(text.contains("POST /reset_encoder_cache") && text.contains("encoder cache"));
}

/// A `/v1/memory` reading sent before the after-run reset but answered after it must not show the
/// reset under a time before the event: against a server that answers readings late (200 ms, the
/// sampler asking every 10 ms), every sample before the reset shows the encoder cache full and
/// every one after it empty.
#[test]
fn a_reset_splits_the_timeline_where_it_happened() {
    let dir = work_dir("slow-memory");
    let mock = Mock::with_slow_memory();
    let result = dir.join("result.json");
    succeed(
        mock.bench(checkpoint())
            .args([
                "--num-prompts",
                "2",
                "--output-len",
                "2",
                "--ready-check-timeout-sec",
                "0",
            ])
            .args([
                "--memory-interval-ms",
                "10",
                "--after-run-s",
                "2",
                "--reset-encoder-cache-after-run",
            ])
            .args(["--disable-tqdm", "--save-result", "--result-filename"])
            .arg(&result),
    );
    let r = read_json(&result);
    let reset_at = r["timeline"]["events"][0]["t"].as_f64().unwrap();
    let samples = r["timeline"]["samples"].as_array().unwrap();
    let after_chats: Vec<(f64, u64)> = samples
        .iter()
        .map(|s| (s["t"].as_f64().unwrap(), s["encoder_cache_bytes"].as_u64().unwrap()))
        .skip_while(|&(_, bytes)| bytes == 0)
        .collect();
    let (before, after): (Vec<_>, Vec<_>) = after_chats.iter().partition(|(t, _)| *t < reset_at);
    assert!(!before.is_empty() && !after.is_empty(), "{}", r["timeline"]);
    assert!(
        before.iter().all(|&(_, b)| b == 4096),
        "reset_at {reset_at}: {before:?}"
    );
    assert!(after.iter().all(|&(_, b)| b == 0), "reset_at {reset_at}: {after:?}");
}

/// Without `--tokenizer`, against a server whose model name is not a directory, the prompt tokens
/// are counted by the server's `/tokenize`, to the same figures the checkpoint's tokenizer gives;
/// against a server without `/tokenize` the benchmark stops and says why.
#[test]
fn tokens_are_counted_by_the_server_without_a_tokenizer() {
    let dir = work_dir("server-tokens");
    let ckpt = checkpoint();
    let server = Server::start(ckpt, &[]);
    server.wait_ready();
    let run = |tokenizer: Option<&Path>, name: &str| {
        let result = dir.join(name);
        let mut cmd = kvlens();
        cmd.args([
            "bench",
            "serve",
            "--port",
            &server.port().to_string(),
            "--model",
            "tiny",
        ]);
        if let Some(t) = tokenizer {
            cmd.arg("--tokenizer").arg(t);
        }
        cmd.args(["--num-prompts", "4", "--output-len", "2", "--ignore-eos", "--seed", "3"])
            .args([
                "--ready-check-timeout-sec",
                "0",
                "--disable-tqdm",
                "--save-result",
                "--result-filename",
            ])
            .arg(&result);
        let stdout = succeed(&mut cmd);
        (stdout, read_json(&result))
    };
    let (local_out, local) = run(Some(ckpt), "local.json");
    let (served_out, served) = run(None, "served.json");
    let says = "Counting prompt tokens with the server's /tokenize";
    assert!(!local_out.contains(says), "{local_out}");
    assert_eq!(served_out.matches(says).count(), 1, "{served_out}");
    assert_eq!(served["completed"], 4);
    for key in [
        "input_lens",
        "input_image_lens",
        "total_input_tokens",
        "total_input_image_tokens",
    ] {
        assert_eq!(served[key], local[key], "{key}");
    }
    assert!(numbers(&served, "input_lens").iter().all(|&n| n > 0.0));
    assert!(numbers(&served, "input_image_lens").iter().all(|&n| n > 0.0));
    assert_eq!(
        served["tokenizer_id"],
        format!("http://127.0.0.1:{}/tokenize", server.port())
    );

    let mock = Mock::start();
    let out = kvlens()
        .args(["bench", "serve", "--port", &mock.port.to_string(), "--model", "m"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("--tokenizer DIR is needed") && stderr.contains("/tokenize answered 404"),
        "{stderr}"
    );
}

/// A vLLM-like server on a raw socket: `/v1/models`, streaming chat completions (a ping comment,
/// then a role chunk after 20 ms, two tokens per content chunk, a finish chunk and a usage chunk),
/// and 404 for everything else, `/v1/memory` included. [`Mock::with_slow_memory`] adds a
/// `/v1/memory` that answers late and `POST /reset_encoder_cache`.
struct Mock {
    port: u16,
    chats: Arc<AtomicUsize>,
}

const MOCK_PROMPT_TOKENS: usize = 1000;

/// What the mock's `/v1/memory` reports: encoder-cache bytes, filled by every chat, emptied by the
/// reset, read only when the answer is written.
#[derive(Default)]
struct MockMemory {
    encoder_cache_bytes: AtomicUsize,
}

/// How long the mock's `/v1/memory` waits before it reads its state and answers.
const MOCK_MEMORY_DELAY: Duration = Duration::from_millis(200);

impl Mock {
    fn start() -> Mock {
        Mock::serve(None)
    }

    fn with_slow_memory() -> Mock {
        Mock::serve(Some(Arc::default()))
    }

    /// `kvlens bench serve` against this mock, model `m`, prompts counted with `tokenizer`'s.
    fn bench(&self, tokenizer: &Path) -> Command {
        let mut cmd = kvlens();
        cmd.args([
            "bench",
            "serve",
            "--port",
            &self.port.to_string(),
            "--model",
            "m",
            "--tokenizer",
        ])
        .arg(tokenizer);
        cmd
    }

    fn serve(memory: Option<Arc<MockMemory>>) -> Mock {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let chats = Arc::new(AtomicUsize::new(0));
        let counter = chats.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming().map_while(Result::ok) {
                let (counter, memory) = (counter.clone(), memory.clone());
                std::thread::spawn(move || Mock::answer(stream, &counter, memory.as_deref()));
            }
        });
        Mock { port, chats }
    }

    fn answer(mut stream: TcpStream, chats: &AtomicUsize, memory: Option<&MockMemory>) -> std::io::Result<()> {
        let mut reader = BufReader::new(stream.try_clone()?);
        let mut request_line = String::new();
        reader.read_line(&mut request_line)?;
        let mut length = 0;
        loop {
            let mut header = String::new();
            reader.read_line(&mut header)?;
            if header.trim().is_empty() {
                break;
            }
            if let Some((name, value)) = header.split_once(':') {
                if name.eq_ignore_ascii_case("content-length") {
                    length = value.trim().parse().unwrap_or(0);
                }
            }
        }
        let mut body = vec![0; length];
        reader.read_exact(&mut body)?;
        let reply = |stream: &mut TcpStream, status: &str, body: &str| {
            write!(
                stream,
                "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            )
        };
        let mut parts = request_line.split_whitespace();
        match (parts.next(), parts.next()) {
            (Some("GET"), Some("/v1/models")) => reply(&mut stream, "200 OK", r#"{"data": [{"id": "mock-model"}]}"#),
            (Some("GET"), Some("/v1/memory")) if memory.is_some() => {
                std::thread::sleep(MOCK_MEMORY_DELAY);
                let bytes = memory.unwrap().encoder_cache_bytes.load(Ordering::SeqCst);
                reply(
                    &mut stream,
                    "200 OK",
                    &format!(r#"{{"ledger": {{"encoder_cache": {bytes}}}}}"#),
                )
            }
            (Some("POST"), Some("/reset_encoder_cache")) if memory.is_some() => {
                memory.unwrap().encoder_cache_bytes.store(0, Ordering::SeqCst);
                reply(&mut stream, "200 OK", "{}")
            }
            (Some("POST"), Some("/v1/chat/completions")) => {
                chats.fetch_add(1, Ordering::SeqCst);
                if let Some(m) = memory {
                    m.encoder_cache_bytes.store(4096, Ordering::SeqCst);
                }
                let req: Value = serde_json::from_slice(&body).unwrap();
                assert_eq!(req["stream"], true);
                let n = req["max_completion_tokens"].as_u64().unwrap() as usize;
                write!(
                    stream,
                    "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
                )?;
                let mut send = |text: String| -> std::io::Result<()> {
                    stream.write_all(text.as_bytes())?;
                    stream.flush()?;
                    std::thread::sleep(Duration::from_millis(5));
                    Ok(())
                };
                send(": ping\n\n".into())?;
                std::thread::sleep(Duration::from_millis(20));
                let chunk = |delta: Value| format!("data: {}\n\n", serde_json::json!({"choices": [{"delta": delta}]}));
                send(chunk(serde_json::json!({"role": "assistant", "content": ""})))?;
                for _ in 0..n / 2 {
                    send(chunk(serde_json::json!({"content": "to ken "})))?;
                }
                send(chunk(serde_json::json!({})))?;
                let usage = serde_json::json!({"choices": [],
                    "usage": {"prompt_tokens": MOCK_PROMPT_TOKENS, "completion_tokens": n}});
                send(format!("data: {usage}\n\ndata: [DONE]\n\n"))
            }
            _ => reply(&mut stream, "404 Not Found", r#"{"detail": "Not Found"}"#),
        }
    }
}

#[test]
fn jsonl_against_a_server_without_v1_memory() {
    let dir = work_dir("mock");
    let ckpt = checkpoint();
    image::RgbImage::from_pixel(64, 48, image::Rgb([200, 30, 30]))
        .save(dir.join("red.png"))
        .unwrap();
    let lines = "{\"prompt\": \"What colour is this?\", \"image\": \"red.png\", \"output_len\": 6}\n\
                 {\"prompt\": \"Say something.\", \"image\": null}\n";
    std::fs::write(dir.join("requests.jsonl"), lines).unwrap();
    let mock = Mock::start();
    let (result, plot) = (dir.join("result.json"), dir.join("memory.svg"));
    let stdout = succeed(
        kvlens()
            .args(["bench", "serve", "--port", &mock.port.to_string(), "--tokenizer"])
            .arg(ckpt)
            .args(["--dataset-name", "jsonl", "--dataset-path"])
            .arg(dir.join("requests.jsonl"))
            .args(["--num-prompts", "5", "--request-rate", "50", "--max-concurrency", "2"])
            .args(PERCENTILES)
            .args([
                "--goodput",
                "ttft:10000",
                "e2el:10000",
                "--save-result",
                "--result-filename",
            ])
            .arg(&result)
            .arg("--plot")
            .arg(&plot),
    );
    println!("{stdout}");
    assert!(stdout.contains("Model not specified, fetching first model from server..."));
    assert!(stdout.contains("Initial test run completed. Starting main benchmark run..."));
    assert!(stdout.contains("Traffic request rate: 50.0\nBurstiness factor: 1.0 (Poisson process)\n"));
    assert!(stdout.contains("Maximum request concurrency: 2\n"));
    assert_result_block(&stdout);
    assert_eq!(value_after(&stdout, "Maximum request concurrency:"), "2");
    assert_eq!(
        value_after(&stdout, "Request goodput (req/s):"),
        value_after(&stdout, "Request throughput (req/s):")
    );
    assert!(stdout.contains("answered 404 Not Found, not kvlens's memory JSON: no memory timeline"));
    assert!(stdout.contains(&format!("No memory samples: {} not drawn", plot.display())));
    assert!(!plot.exists());
    assert_eq!(
        mock.chats.load(Ordering::SeqCst),
        6,
        "5 requests and the initial test run"
    );

    let r = read_json(&result);
    assert_eq!(
        (r["completed"].as_u64(), r["model_id"].as_str()),
        (Some(5), Some("mock-model"))
    );
    assert_eq!(numbers(&r, "output_lens"), [6.0, 128.0, 6.0, 128.0, 6.0]);
    // Chunks with choices: the role chunk, one per two tokens, the finish chunk; the first is TTFT.
    let itls = r["itls"].as_array().unwrap();
    let chunks: Vec<usize> = itls.iter().map(|l| l.as_array().unwrap().len() + 1).collect();
    assert_eq!(chunks, [5, 66, 5, 66, 5]);
    for (ttft, e2el) in numbers(&r, "ttfts").iter().zip(numbers(&r, "e2els")) {
        // Equal when the whole answer arrives in one read (a busy machine): the client stamps
        // each read, as vLLM's does.
        assert!(*ttft >= 0.02 && *ttft <= e2el, "{ttft} {e2el}");
    }
    // The mock's prompt tokens less the templated text for the image requests, 0 for the others.
    let image_lens = numbers(&r, "input_image_lens");
    assert!(image_lens
        .iter()
        .step_by(2)
        .all(|&n| n > 0.0 && n < MOCK_PROMPT_TOKENS as f64));
    assert_eq!((image_lens[1], image_lens[3]), (0.0, 0.0));
    assert!(r["timeline"]["samples"].as_array().unwrap().is_empty());
    assert!(r["timeline"]["note"].is_string());
    assert_eq!(r["request_rate"], 50.0);
    assert_eq!(r["max_concurrency"], 2);

    // vLLM's random dataset: prompts of --random-input-len tokens, sent all at once.
    let stdout = succeed(
        mock.bench(ckpt)
            .args([
                "--dataset-name",
                "random",
                "--random-input-len",
                "40",
                "--num-prompts",
                "3",
            ])
            .args([
                "--output-len",
                "4",
                "--ready-check-timeout-sec",
                "0",
                "--save-result",
                "--result-filename",
            ])
            .arg(&result),
    );
    assert!(stdout.contains("Traffic request rate: inf\n"));
    assert!(!stdout.contains("Request rate configured"));
    assert_eq!(value_after(&stdout, "Total input image tokens:"), "0");
    let r = read_json(&result);
    assert_eq!(numbers(&r, "input_lens"), [40.0; 3]);
    assert_eq!(numbers(&r, "output_lens"), [4.0; 3]);
    assert_eq!(r["request_rate"], "inf");
    assert_eq!(mock.chats.load(Ordering::SeqCst), 9);
}

#[test]
fn unreachable_server_is_one_line_and_exit_1() {
    // A port held by a socket that is bound but not listening: connections are refused, and no
    // other test can take the port meanwhile.
    let held = tokio::net::TcpSocket::new_v4().unwrap();
    held.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let port = held.local_addr().unwrap().port();
    let out = kvlens()
        .args([
            "bench",
            "serve",
            "--port",
            &port.to_string(),
            "--model",
            "m",
            "--tokenizer",
            "/nonexistent",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.starts_with(&format!("error: cannot reach http://127.0.0.1:{port}/v1/models")),
        "{stderr}"
    );
}
