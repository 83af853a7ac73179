//! `kvlens watch` reading `kvlens serve`'s KV cache events (the same wire format vLLM publishes):
//! a late start caught up through replay, the resident set equal to the server's own blocks, a
//! publisher restart noticed and followed, the server's /metrics passed through, the plan beside.

mod common;

use common::{base64, fixture, http, kvlens_command, tiny_checkpoint, Server};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::process::{Child, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// `kvlens watch` as a child process, killed on drop.
struct Watcher {
    child: Child,
    port: u16,
}

impl Watcher {
    fn start(args: &[&str]) -> Watcher {
        let mut child = kvlens_command()
            .args([
                "watch",
                "--port",
                "0",
                "--playground-dir",
                "no-playground",
                "--topic",
                "kv-events",
            ])
            .args(args)
            .env_remove("RUST_LOG")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("kvlens watch starts");
        let (tx, rx) = mpsc::channel();
        let stderr = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(port) = line.split("Watch page on http://").nth(1) {
                    let _ = tx.send(port.rsplit(':').next().and_then(|p| p.trim().parse::<u16>().ok()));
                }
            }
        });
        let port = rx
            .recv_timeout(Duration::from_secs(60))
            .ok()
            .flatten()
            .expect("the watch page's port");
        Watcher { child, port }
    }

    fn get(&self, path: &str) -> Value {
        let r = http(self.port, "GET", path, &[], b"");
        assert_eq!(r.status, 200, "{path}: {}", r.text());
        r.json()
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The PUB and ROUTER ports the server's log names.
fn event_ports(server: &Server) -> (u16, u16) {
    let log = server.log();
    let line = log
        .lines()
        .find_map(|l| l.split("KV cache events published on tcp://").nth(1))
        .unwrap_or_else(|| panic!("no KV events line:\n{log}"));
    let port = |s: &str| {
        s.split(':')
            .nth(1)
            .unwrap()
            .trim_end_matches(')')
            .parse::<u16>()
            .unwrap()
    };
    let (pub_part, replay_part) = line.split_once(" (replay on tcp://").unwrap();
    (port(pub_part), port(replay_part))
}

fn serve(model: &std::path::Path, pub_port: u16, replay_port: u16) -> Server {
    let config = format!(
        r#"{{"enable_kv_cache_events": true, "endpoint": "tcp://*:{pub_port}", "replay_endpoint": "tcp://*:{replay_port}", "topic": "kv-events"}}"#
    );
    let server = Server::start(
        model,
        &[
            "--max-model-len",
            "1024",
            "--kv-cache-memory-bytes",
            "800000",
            "--kv-events-config",
            &config,
        ],
    );
    server.wait_ready();
    server
}

fn chat(server: &Server, i: usize, image: bool) {
    let png = std::fs::read(fixture("golden/images/c_150x150.png")).unwrap();
    let mut content = vec![json!({"type": "text", "text": format!("Question {i}: describe the caches.")})];
    if image {
        content.insert(
            0,
            json!({"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{}", base64(&png))}}),
        );
    }
    let body = json!({"model": "tiny", "messages": [{"role": "user", "content": content}],
        "max_tokens": 60, "temperature": 0, "ignore_eos": true});
    let r = server.post("/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
}

/// Hash -> copies, as the server's /v1/memory shows its blocks.
fn server_blocks(server: &Server) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for h in server.get("/v1/memory").json()["kv"]["hashes"]
        .as_object()
        .unwrap()
        .values()
    {
        *out.entry(h.as_str().unwrap().to_string()).or_default() += 1;
    }
    out
}

fn watched_blocks(snapshot: &Value) -> BTreeMap<String, u64> {
    snapshot["blocks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| (b["hash"].as_str().unwrap().to_string(), b["copies"].as_u64().unwrap()))
        .collect()
}

/// Polls the watcher until `ok` holds for its snapshot.
fn wait_for(w: &Watcher, what: &str, ok: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let snap = w.get("/v1/watch");
        if ok(&snap) {
            return snap;
        }
        assert!(Instant::now() < deadline, "{what}: {snap:#}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn the_watch_rebuilds_the_servers_blocks_through_replay_gaps_and_a_restart() {
    let model = tiny_checkpoint("watch");
    let first = Server::start(
        &model,
        &[
            "--max-model-len",
            "1024",
            "--kv-cache-memory-bytes",
            "800000",
            "--kv-events-config",
            r#"{"enable_kv_cache_events": true, "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0", "topic": "kv-events"}"#,
        ],
    );
    first.wait_ready();
    let (pub_port, replay_port) = event_ports(&first);
    // Requests before the watch starts: it catches up through the replay socket.
    for i in 0..3 {
        chat(&first, i, i % 2 == 0);
    }
    let metrics = format!("http://127.0.0.1:{}", first.port());
    let events = format!("tcp://127.0.0.1:{pub_port}");
    let replay = format!("tcp://127.0.0.1:{replay_port}");
    let w = Watcher::start(&[
        "--events",
        &events,
        "--replay",
        &replay,
        "--metrics",
        &metrics,
        "--model",
        "Qwen3-VL-2B-Instruct",
    ]);
    // Both sides are read again each time: the server's /v1/memory can trail its events by one
    // snapshot.
    let snap = wait_for(&w, "caught up", |s| watched_blocks(s) == server_blocks(&first));
    assert!(snap["replayed"].as_u64().unwrap() > 0 && snap["lost"] == 0, "{snap:#}");
    assert!(
        snap["num_with_keys"].as_u64().unwrap() > 0,
        "the image's blocks carry its hash"
    );
    // Live, through evictions (65 blocks, 20 requests).
    for i in 3..23 {
        chat(&first, i, i % 3 == 0);
    }
    let snap = wait_for(&w, "live", |s| watched_blocks(s) == server_blocks(&first));
    assert!(snap["removed"].as_u64().unwrap() > 0, "evictions seen: {snap:#}");
    assert_eq!(snap["unknown_removals"], 0);

    // The page's other sources: the plan and the server's metrics.
    let info = w.get("/server_info");
    assert_eq!(info["planned"]["model"], "Qwen3-VL-2B-Instruct");
    assert!(info["planned"]["num_gpu_blocks"].as_u64().unwrap() > 0);
    let m = http(w.port, "GET", "/v1/watch/metrics", &[], b"");
    assert!(
        m.status == 200 && m.text().contains("vllm:cache_config_info{"),
        "{}",
        m.text()
    );

    // The publisher restarts on the same ports: the watch starts over from its first batch.
    drop(first);
    let second = serve(&model, pub_port, replay_port);
    chat(&second, 100, true);
    let snap = wait_for(&w, "restart", |s| {
        s["restarts"] == 1 && watched_blocks(s) == server_blocks(&second)
    });
    // The new publisher's numbering (one request: a few batches; the first ran past 30).
    assert!(snap["last_seq"].as_u64().unwrap() < 10, "{snap:#}");
}

#[test]
fn a_malformed_endpoint_is_a_one_line_error() {
    for bad in [
        &["--events", "nonsense"][..],
        &["--events", "tcp://h:5557", "--replay", "tcp://h"],
    ] {
        let out = kvlens_command().arg("watch").args(bad).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{bad:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("not a tcp://HOST:PORT endpoint"), "{err}");
    }
}
