//! `kvlens serve` end to end over raw HTTP/1.1 on a tiny random checkpoint: 503 while loading,
//! `/v1/models`, chat completions with an image (whole and streamed, with token ids and usage),
//! completions with stop strings, bad input answered in OpenAI's error shape while the server
//! keeps serving, a client that hangs up mid-stream leaving no KV block in use, the resets, the
//! metrics, the memory stream, `--api-key`, ignored vLLM flags, a clean exit on SIGTERM, images
//! resized down to the size the start-up profile measured, http and https image URLs, and
//! `/tokenize` / `/detokenize`.

mod common;

use common::{base64, fixture, http, scratch, send, tiny_checkpoint, Server};
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

fn checkpoint() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| tiny_checkpoint("serve-http"))
}

/// `<|image_pad|>` of the Qwen tokenizer.
const IMAGE_PAD: u64 = 151_655;

/// `kvlens serve` on the tiny checkpoint (served as `tiny`) without a playground directory.
fn serve(extra: &[&str]) -> Server {
    serve_with_env(extra, &[])
}

fn serve_with_env(extra: &[&str], env: &[(&str, &str)]) -> Server {
    let no_playground = scratch("serve-http-no-playground");
    let mut args = vec!["--playground-dir", no_playground.to_str().unwrap()];
    args.extend_from_slice(extra);
    Server::start_with_env(checkpoint(), &args, env)
}

fn memory(server: &Server) -> Value {
    let r = server.get("/v1/memory");
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()
}

fn image_url() -> String {
    let png = std::fs::read(fixture("golden/images/c_150x150.png")).unwrap();
    format!("data:image/png;base64,{}", base64(&png))
}

fn image_chat(url: &str, extra: Value) -> Value {
    let mut body = json!({
        "model": "tiny",
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": "Describe this image."},
        ]}],
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": true,
        "return_token_ids": true,
    });
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

fn ids(v: &Value) -> Vec<u64> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect()
}

/// The whole chat answer with an image: returns (prompt ids, token ids, text).
fn chat_with_image(server: &Server) -> (Vec<u64>, Vec<u64>, String) {
    let r = server.post("/v1/chat/completions", &image_chat(&image_url(), json!({})));
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.head.to_ascii_lowercase().contains("content-type: application/json"));
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(v["model"], "tiny");
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "length");
    assert_eq!(choice["message"]["role"], "assistant");
    let prompt = ids(&v["prompt_token_ids"]);
    let tokens = ids(&choice["token_ids"]);
    assert_eq!(tokens.len(), 6);
    assert!(prompt.iter().filter(|&&t| t == IMAGE_PAD).count() >= 4, "{prompt:?}");
    let usage = &v["usage"];
    assert_eq!(
        usage["prompt_tokens"],
        prompt.len(),
        "image placeholders count as prompt tokens"
    );
    assert_eq!(usage["completion_tokens"], 6);
    assert_eq!(usage["total_tokens"], prompt.len() + 6);
    (
        prompt,
        tokens,
        choice["message"]["content"].as_str().unwrap().to_string(),
    )
}

/// The same request streamed gives the same tokens and text, one usage chunk and `[DONE]`.
fn streamed_chat(server: &Server, prompt: &[u64], tokens: &[u64], text: &str) {
    let body = image_chat(
        &image_url(),
        json!({"stream": true, "stream_options": {"include_usage": true}}),
    );
    let r = server.post("/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.head.to_ascii_lowercase().contains("text/event-stream"), "{}", r.head);
    let events = r.events();
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let (usage, content) = chunks.split_last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 6);
    assert_eq!(usage["usage"]["prompt_tokens"], prompt.len());
    assert_eq!(content[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(ids(&content[0]["prompt_token_ids"]), prompt);
    let streamed: Vec<u64> = content
        .iter()
        .flat_map(|c| ids(&c["choices"][0]["token_ids"]))
        .collect();
    assert_eq!(streamed, tokens, "greedy: the streamed tokens are the whole answer's");
    let streamed_text: String = content
        .iter()
        .map(|c| c["choices"][0]["delta"]["content"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(streamed_text, text);
    let finishes: Vec<&Value> = content.iter().map(|c| &c["choices"][0]["finish_reason"]).collect();
    assert_eq!(finishes.last().unwrap().as_str(), Some("length"));
    assert!(finishes[..finishes.len() - 1].iter().all(|f| f.is_null()));
    for c in content {
        assert_eq!(c["object"], "chat.completion.chunk");
    }
}

/// Completions: a stop string taken from the greedy answer ends it just before, whole or streamed.
fn completions_with_stop_strings(server: &Server) {
    let base = json!({"model": "tiny", "prompt": "The KV cache holds", "max_tokens": 8, "temperature": 0,
                      "ignore_eos": true, "return_token_ids": true});
    let r = server.post("/v1/completions", &base);
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(
        v["usage"]["prompt_tokens"],
        v["prompt_token_ids"].as_array().unwrap().len()
    );
    assert_eq!(v["choices"][0]["token_ids"].as_array().unwrap().len(), 8);
    let full = v["choices"][0]["text"].as_str().unwrap().to_string();
    let chars: Vec<char> = full.chars().collect();
    assert!(chars.len() >= 3, "the greedy answer {full:?} is too short to cut");
    let stop: String = chars[chars.len() / 2..].iter().take(2).collect();
    let expected = &full[..full.find(&stop).unwrap()];
    let mut with_stop = base.clone();
    with_stop["stop"] = json!([stop]);
    let v = server.post("/v1/completions", &with_stop).json();
    assert_eq!(v["choices"][0]["text"], expected, "stop {stop:?} in {full:?}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert!(v["usage"]["completion_tokens"].as_u64().unwrap() <= 8);
    with_stop["stream"] = json!(true);
    let events = server.post("/v1/completions", &with_stop).events();
    let chunks: Vec<Value> = events
        .iter()
        .filter(|e| *e != "[DONE]")
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let text: String = chunks
        .iter()
        .map(|c| c["choices"][0]["text"].as_str().unwrap())
        .collect();
    assert_eq!(text, expected, "streamed text never shows the stop string");
    assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "stop");
}

/// Every bad input gets its status in OpenAI's error shape; the server keeps answering.
fn bad_inputs(server: &Server) {
    let good = json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                      "temperature": 0});
    let with = |k: &str, v: Value| {
        let mut b = good.clone();
        b[k] = v;
        b.to_string().into_bytes()
    };
    let image = |url: &str| json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]);
    let not_png = format!("data:image/png;base64,{}", base64(b"plain text, not pixels"));
    let url = image_url();
    let three = json!([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "image_url", "image_url": {"url": url}},
    ]}]);
    let cases: Vec<(&str, u16, Vec<u8>)> = vec![
        ("malformed JSON", 400, b"{\"model\": \"tiny\", \"messages\": [".to_vec()),
        ("no messages", 400, br#"{"model": "tiny"}"#.to_vec()),
        ("unknown model", 404, with("model", json!("nope"))),
        (
            "bad base64",
            400,
            with("messages", image("data:image/png;base64,!!!notbase64")),
        ),
        ("not an image", 400, with("messages", image(&not_png))),
        (
            "remote image",
            400,
            with("messages", image("https://example.com/cat.png")),
        ),
        ("ftp image", 400, with("messages", image("ftp://example.com/cat.png"))),
        ("empty image URL", 400, with("messages", image(""))),
        ("too many images", 400, with("messages", three)),
        (
            "prompt + max_tokens over max_model_len",
            400,
            with("max_tokens", json!(5000)),
        ),
        ("negative temperature", 400, with("temperature", json!(-1))),
        ("n > 1", 400, with("n", json!(2))),
        (
            "huge negative frequency_penalty",
            400,
            with("frequency_penalty", json!(-3e38)),
        ),
        ("presence_penalty over 2", 400, with("presence_penalty", json!(2.5))),
        ("zero repetition_penalty", 400, with("repetition_penalty", json!(0))),
        ("logit_bias over 100", 400, with("logit_bias", json!({"11": 101}))),
        (
            "logit_bias outside the vocabulary",
            400,
            with("logit_bias", json!({"999999": 1})),
        ),
        ("logit_bias key not an id", 400, with("logit_bias", json!({"hello": 1}))),
        (
            "stop_token_ids outside the vocabulary",
            400,
            with("stop_token_ids", json!([999999])),
        ),
        (
            "tools",
            400,
            with("tools", json!([{"type": "function", "function": {"name": "f"}}])),
        ),
        ("tool_choice", 400, with("tool_choice", json!("required"))),
        (
            "response_format",
            400,
            with("response_format", json!({"type": "json_object"})),
        ),
        (
            "7 MB of text",
            400,
            with(
                "messages",
                json!([{"role": "user", "content": "word ".repeat(1_400_000)}]),
            ),
        ),
    ];
    for (what, status, body) in cases {
        let r = http(server.port(), "POST", "/v1/chat/completions", &[], &body);
        r.assert_error(status, what);
        let message = r.json()["error"]["message"].as_str().unwrap().to_string();
        for (case, says) in [
            ("ftp image", "ftp://"),
            ("empty image URL", "empty"),
            ("tools", "tools"),
            ("tool_choice", "tool_choice"),
            ("response_format", "response_format"),
            ("huge negative frequency_penalty", "frequency_penalty"),
            ("7 MB of text", "has at least"),
        ] {
            assert!(what != case || message.contains(says), "{what}: {message}");
        }
        let ok = server.post("/v1/chat/completions", &good);
        assert_eq!(ok.status, 200, "after {what}: {}", ok.text());
    }
    // Accepted as vLLM accepts them: no tools, plain text.
    let mut plain = good.clone();
    plain["tool_choice"] = json!("none");
    plain["response_format"] = json!({"type": "text"});
    plain["tools"] = json!([]);
    assert_eq!(server.post("/v1/chat/completions", &plain).status, 200);
    let long = json!({"model": "tiny", "prompt": "word ".repeat(1_400_000), "max_tokens": 1});
    let r = server.post("/v1/completions", &long);
    r.assert_error(400, "a 7 MB completion prompt");
    assert!(
        r.text().contains("has at least"),
        "refused before tokenizing: {}",
        r.text()
    );
    http(server.port(), "GET", "/v1/chat/completions", &[], b"").assert_error(405, "GET on a POST route");
    http(server.port(), "POST", "/v1/models", &[], b"").assert_error(405, "POST on a GET route");
    let mut huge = b"{\"pad\": \"".to_vec();
    huge.resize(65 << 20, b'x');
    huge.extend_from_slice(b"\"}");
    http(server.port(), "POST", "/v1/chat/completions", &[], &huge).assert_error(413, "oversized body");
    server.get("/v1/no-such-route").assert_error(404, "unknown route");
    assert_eq!(server.post("/v1/chat/completions", &good).status, 200);
}

/// `logit_bias` moves greedy decoding onto the biased token.
fn logit_bias_is_applied(server: &Server) {
    let body = json!({"model": "tiny", "prompt": "Blocks", "max_tokens": 4, "temperature": 0,
                      "ignore_eos": true, "return_token_ids": true, "logit_bias": {"1234": 100}});
    let r = server.post("/v1/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(ids(&r.json()["choices"][0]["token_ids"]), vec![1234; 4]);
}

/// A repeated image whose placeholders the prefix cache holds runs no vision tower and is counted
/// as reused.
fn repeated_image_is_counted_as_reused(server: &Server) {
    let body = image_chat(&image_url(), json!({"max_tokens": 1}));
    let counters = |m: Value| m["counters"].clone();
    assert_eq!(server.post("/v1/chat/completions", &body).status, 200);
    let before = counters(memory(server));
    assert_eq!(server.post("/v1/chat/completions", &body).status, 200);
    let after = counters(memory(server));
    let delta = |k: &str| after[k].as_u64().unwrap() - before[k].as_u64().unwrap();
    assert_eq!(delta("vision_runs"), 0, "{after}");
    assert_eq!(delta("encoder_hits") + delta("prefix_cached_images"), 1, "{after}");
    assert!(delta("prompt_tokens_cached") > 0, "{after}");
}

/// A client that hangs up after the first chunk: its KV blocks are free soon after.
fn disconnect_frees_blocks(server: &Server) {
    let body = json!({"model": "tiny", "messages": [{"role": "user", "content": "Tell me a long story."}],
                      "max_tokens": 2000, "temperature": 0, "ignore_eos": true, "stream": true});
    let (s, _) = open_stream(server, "/v1/chat/completions", &body);
    let during = memory(server);
    assert!(during["kv"]["num_in_use"].as_u64().unwrap() > 0, "{}", during["kv"]);
    drop(s);
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let m = memory(server);
        if m["kv"]["num_in_use"] == 0 && m["num_running"] == 0 && m["num_waiting"] == 0 {
            let generated = m["counters"]["generated_tokens"].as_u64().unwrap()
                - during["counters"]["generated_tokens"].as_u64().unwrap();
            assert!(generated < 1000, "the request ran on for {generated} tokens");
            break;
        }
        assert!(Instant::now() < deadline, "blocks still in use: {}", m["kv"]);
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn ledger(m: &Value, category: &str) -> u64 {
    ledger_figure(m, category, "bytes")
}

/// One figure (`bytes`, `peak_bytes`) of a ledger category in a `/v1/memory` answer.
fn ledger_figure(m: &Value, category: &str, figure: &str) -> u64 {
    m["ledger"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["category"] == category)
        .and_then(|e| e[figure].as_u64())
        .unwrap_or_else(|| panic!("no {category} {figure} in {}", m["ledger"]))
}

/// Posts each of `bodies` to `path` at once, one thread each: their statuses and texts.
fn post_all(server: &Server, path: &str, bodies: &[&Value]) -> Vec<(u16, String)> {
    std::thread::scope(|s| {
        let sent: Vec<_> = bodies
            .iter()
            .map(|b| {
                s.spawn(|| {
                    let r = server.post(path, b);
                    (r.status, r.text())
                })
            })
            .collect();
        sent.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// `/reset_mm_cache` clears the processor cache only; `/reset_encoder_cache` returns the bytes.
fn resets(server: &Server) {
    let before = memory(server);
    let encoder = ledger(&before, "encoder_cache");
    assert!(
        encoder > 0,
        "the image's encoder output stays cached: {}",
        before["ledger"]
    );
    let r = server.post("/reset_mm_cache", &json!({}));
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.json()["freed_bytes"].as_u64().unwrap() > 0);
    let after = memory(server);
    assert_eq!(after["processor_cache"]["bytes_used"], 0);
    assert_eq!(ledger(&after, "encoder_cache"), encoder);
    let r = server.post("/reset_encoder_cache", &json!({}));
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["freed_bytes"].as_u64(), Some(encoder));
    assert_eq!(v["encoder_cache_bytes"], 0);
    assert_eq!(ledger(&memory(server), "encoder_cache"), 0);
    assert_eq!(server.post("/reset_prefix_cache", &json!({})).status, 200);
}

/// A metric's value from the Prometheus text.
fn metric(text: &str, sample: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(sample)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("{sample} missing from:\n{text}"))
        .parse()
        .unwrap()
}

fn metrics(server: &Server) {
    let r = server.get("/metrics");
    assert_eq!(r.status, 200);
    let t = r.text();
    let m = |name: &str| metric(&t, &format!("{name}{{model_name=\"tiny\"}}"));
    let reason = |r: &str| {
        metric(
            &t,
            &format!("vllm:request_success_total{{finished_reason=\"{r}\",model_name=\"tiny\"}}"),
        )
    };
    assert_eq!(m("vllm:num_requests_running"), 0.0);
    assert_eq!(m("vllm:num_requests_waiting"), 0.0);
    assert!(
        reason("length") >= 2.0 && reason("stop") >= 1.0 && reason("abort") >= 1.0,
        "{t}"
    );
    assert!(m("vllm:time_to_first_token_seconds_count") >= 4.0);
    assert!(m("vllm:generation_tokens_total") >= 12.0);
    assert!(m("vllm:prompt_tokens_total") > 0.0);
    assert!(m("vllm:prefix_cache_queries_total") > 0.0);
    assert!(m("kvlens:vision_tower_runs_total") >= 1.0);
    assert!(metric(&t, "kvlens:memory_bytes{category=\"kv_cache\",model_name=\"tiny\"}") > 0.0);
    assert!(t.contains("# TYPE vllm:e2e_request_latency_seconds histogram"));
    assert!(t.contains("vllm:inter_token_latency_seconds_bucket{le=\"+Inf\",model_name=\"tiny\"}"));
}

/// The memory stream sends a snapshot as soon as it connects.
fn memory_stream(server: &Server) {
    let mut s = send(server.port(), "GET", "/v1/memory/stream", &[], b"");
    let mut seen = String::new();
    let mut buf = [0u8; 65536];
    let event = loop {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "the stream closed: {seen}");
        seen.push_str(&String::from_utf8_lossy(&buf[..n]));
        if let Some(line) = seen.lines().find(|l| l.starts_with("data: {") && seen.contains("\n\n")) {
            break line.to_string();
        }
    };
    let data = &event["data: ".len()..];
    // The playground's server mode reads these events back into the engine's own type.
    let occupancy: kvlens_engine::occupancy::Occupancy =
        serde_json::from_str(data).unwrap_or_else(|e| panic!("the event is not an Occupancy: {e}\n{data}"));
    assert_eq!(
        occupancy.engine.kv.num_blocks as u64,
        occupancy.engine.kv.runs.iter().map(|r| r.1 as u64).sum::<u64>()
    );
    let v: Value = serde_json::from_str(data).unwrap();
    assert!(v["kv"]["num_blocks"].as_u64().unwrap() > 1);
    assert!(v["ledger"]
        .as_array()
        .is_some_and(|l| l.len() == kvlens_engine::memory::ledger::Category::ALL.len()));
    assert!(v["processor_cache"].is_object() && v["encoder_cache"].is_object());
}

#[test]
fn serves_the_openai_api_and_frees_memory() {
    // The port answers at once; the model loads only once `hold` exists.
    let hold = scratch("serve-http-hold-load");
    let _ = std::fs::remove_file(&hold);
    let server = serve_with_env(
        &["--limit-mm-per-prompt", "image=2"],
        &[("KVLENS_HOLD_LOAD", hold.to_str().unwrap())],
    );
    server.get("/health").assert_error(503, "health while loading");
    std::fs::write(&hold, b"").unwrap();
    server.wait_ready();

    let models = server.get("/v1/models").json();
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], "tiny");
    assert_eq!(models["data"][0]["max_model_len"], 4096);
    assert!(server.get("/version").json()["version"].is_string());
    let info = server.get("/server_info").json();
    assert!(info["plan"]["page_size_bytes"].as_u64().unwrap() > 0);
    assert_eq!(info["flags"]["engine"]["served_model_name"], json!(["tiny"]));
    assert!(!info["log_lines"].as_array().unwrap().is_empty());
    let page = server.get("/");
    assert_eq!(page.status, 200);
    assert!(page.text().contains("/v1"), "a short text page without a playground");

    let (prompt, tokens, text) = chat_with_image(&server);
    streamed_chat(&server, &prompt, &tokens, &text);
    completions_with_stop_strings(&server);
    logit_bias_is_applied(&server);
    repeated_image_is_counted_as_reused(&server);
    bad_inputs(&server);
    disconnect_frees_blocks(&server);
    resets(&server);
    metrics(&server);
    memory_stream(&server);

    let log = server.log();
    let status = server.stop("TERM");
    assert_eq!(status.code(), Some(0), "{log}");
}

/// 50 streamed completions (10 clients at once) ended by a stop string: `/metrics` counts exactly
/// 50 more `stop` finishes, no `abort`, and as many generated tokens as the answers' usage says.
#[test]
fn stop_string_finishes_are_counted_as_stop() {
    let server = serve(&[]);
    server.wait_ready();
    let base = json!({"model": "tiny", "prompt": "Paged attention", "max_tokens": 12, "temperature": 0,
                      "ignore_eos": true});
    let full = server.post("/v1/completions", &base).json()["choices"][0]["text"]
        .as_str()
        .unwrap()
        .to_string();
    let chars: Vec<char> = full.chars().collect();
    assert!(chars.len() >= 4, "the greedy answer {full:?} is too short to cut");
    let stop: String = chars[chars.len() / 2..].iter().take(1).collect();
    let mut body = base.clone();
    body["stop"] = json!([stop]);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let counts = |t: &str| {
        let reason = |r: &str| {
            metric(
                t,
                &format!("vllm:request_success_total{{finished_reason=\"{r}\",model_name=\"tiny\"}}"),
            )
        };
        let generated = metric(t, "vllm:generation_tokens_total{model_name=\"tiny\"}");
        (reason("stop"), reason("abort"), reason("length"), generated)
    };
    let before = counts(&server.get("/metrics").text());
    let generated: u64 = std::thread::scope(|s| {
        let clients: Vec<_> = (0..10)
            .map(|_| {
                s.spawn(|| {
                    (0..5)
                        .map(|_| {
                            let events = server.post("/v1/completions", &body).events();
                            assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
                            let chunks: Vec<Value> = events[..events.len() - 1]
                                .iter()
                                .map(|e| serde_json::from_str(e).unwrap())
                                .collect();
                            let (usage, content) = chunks.split_last().unwrap();
                            assert_eq!(content.last().unwrap()["choices"][0]["finish_reason"], "stop");
                            usage["usage"]["completion_tokens"].as_u64().unwrap()
                        })
                        .sum::<u64>()
                })
            })
            .collect();
        clients.into_iter().map(|c| c.join().unwrap()).sum()
    });
    let after = counts(&server.get("/metrics").text());
    assert_eq!(after.0 - before.0, 50.0, "stop finishes");
    assert_eq!(after.1 - before.1, 0.0, "abort finishes");
    assert_eq!(after.2 - before.2, 0.0, "length finishes");
    assert_eq!(
        after.3 - before.3,
        generated as f64,
        "generated tokens vs the answers' usage"
    );
}

#[test]
fn api_key_guards_the_api_and_vllm_only_flags_are_ignored() {
    let server = serve(&[
        "--api-key",
        "sesame",
        "--tensor-parallel-size",
        "1",
        "--enforce-eager",
        "--swap-space=4",
    ]);
    server.wait_ready();
    let log = server.log();
    for flag in ["--tensor-parallel-size 1", "--enforce-eager", "--swap-space=4"] {
        assert!(log.contains(&format!("WARNING {flag}: a vLLM flag")), "{flag}:\n{log}");
    }
    let port = server.port();
    let chat = json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                      "temperature": 0})
    .to_string();
    http(port, "GET", "/v1/models", &[], b"").assert_error(401, "no key");
    http(port, "GET", "/v1/models", &[("Authorization", "Bearer sesam")], b"").assert_error(401, "wrong key");
    http(port, "POST", "/v1/chat/completions", &[], chat.as_bytes()).assert_error(401, "chat without key");
    http(port, "POST", "/reset_prefix_cache", &[], b"").assert_error(401, "reset without key");
    http(port, "GET", "/server_info", &[], b"").assert_error(401, "server_info without key");
    http(port, "GET", "/v1/memory", &[], b"").assert_error(401, "memory without key");
    http(port, "GET", "/v1/memory/stream", &[], b"").assert_error(401, "memory stream without key");
    let tokenize = json!({"model": "tiny", "prompt": "hi"}).to_string();
    http(port, "POST", "/tokenize", &[], tokenize.as_bytes()).assert_error(401, "tokenize without key");
    http(port, "POST", "/detokenize", &[], br#"{"tokens": [1]}"#).assert_error(401, "detokenize without key");
    for open in ["/health", "/metrics", "/version"] {
        assert_eq!(http(port, "GET", open, &[], b"").status, 200, "{open} stays open");
    }
    let key = [("Authorization", "Bearer sesame")];
    assert_eq!(http(port, "GET", "/v1/models", &key, b"").status, 200);
    assert_eq!(
        http(port, "POST", "/v1/chat/completions", &key, chat.as_bytes()).status,
        200
    );
    assert_eq!(http(port, "POST", "/reset_prefix_cache", &key, b"").status, 200);
    assert_eq!(http(port, "GET", "/server_info", &key, b"").status, 200);
    assert_eq!(http(port, "POST", "/tokenize", &key, tokenize.as_bytes()).status, 200);
    assert_eq!(server.get("/health").status, 200, "health needs no key");
    assert_eq!(server.get("/metrics").status, 200, "metrics need no key");
    assert_eq!(server.stop("TERM").code(), Some(0));
}

#[test]
fn images_are_resized_down_to_the_profiled_maximum() {
    // 150×150 would be 25 tokens under the checkpoint's limits; 4,096 pixels allow 2×2 merged patches.
    let server = serve(&["--mm-processor-kwargs", r#"{"max_pixels": 4096}"#]);
    server.wait_ready();
    let info = server.get("/server_info").json();
    assert_eq!(info["plan"]["max_tokens_per_image"], 4, "{:#}", info["plan"]);
    let r = server.post("/v1/chat/completions", &image_chat(&image_url(), json!({})));
    assert_eq!(r.status, 200, "{}", r.text());
    let prompt = ids(&r.json()["prompt_token_ids"]);
    assert_eq!(prompt.iter().filter(|&&t| t == IMAGE_PAD).count(), 4);
}

/// Answers one HTTP/1.1 request on `stream`: the PNG at `/c.png`, a redirect to it at `/moved`, a
/// redirect to a host that is not allowed at `/away`, text that is not an image at `/secret`, 404
/// elsewhere.
fn answer_image_request(stream: &mut (impl Read + Write), png: &[u8]) {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        match stream.read(&mut byte) {
            Ok(1) => head.push(byte[0]),
            _ => return,
        }
    }
    let head = String::from_utf8_lossy(&head).into_owned();
    let (status, location, payload) = match head.split_whitespace().nth(1).unwrap_or("") {
        "/c.png" => ("200 OK", "", png),
        "/moved" => ("302 Found", "Location: /c.png\r\n", &b""[..]),
        "/away" => ("302 Found", "Location: http://example.com/c.png\r\n", &b""[..]),
        "/secret" => ("200 OK", "", &b"SECRETS: an internal service's answer"[..]),
        _ => ("404 Not Found", "", &b""[..]),
    };
    let head = format!(
        "HTTP/1.1 {status}\r\n{location}Content-Length: {}\r\nConnection: close\r\n\r\n",
        payload.len()
    );
    let _ = stream
        .write_all(head.as_bytes())
        .and_then(|_| stream.write_all(payload))
        .and_then(|_| stream.flush());
}

/// Serves [`answer_image_request`] over HTTP/1.1 on a free port; one thread per client.
fn image_host(png: Vec<u8>) -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let png = Arc::new(png);
    std::thread::spawn(move || {
        for mut stream in listener.incoming().map_while(Result::ok) {
            let png = png.clone();
            std::thread::spawn(move || answer_image_request(&mut stream, &png));
        }
    });
    port
}

/// A self-signed certificate for 127.0.0.1 whose subject is `name`.
fn self_signed(name: &str) -> rcgen::CertifiedKey<rcgen::KeyPair> {
    let mut params = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()]).unwrap();
    params.distinguished_name.push(rcgen::DnType::CommonName, name);
    let signing_key = rcgen::KeyPair::generate().unwrap();
    let cert = params.self_signed(&signing_key).unwrap();
    rcgen::CertifiedKey { cert, signing_key }
}

/// Serves [`answer_image_request`] over HTTPS with `cert` on a free port of 127.0.0.1.
fn tls_image_host(png: Vec<u8>, cert: &rcgen::CertifiedKey<rcgen::KeyPair>) -> u16 {
    let key = rustls::pki_types::PrivateKeyDer::Pkcs8(cert.signing_key.serialize_der().into());
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = Arc::new(
        rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![cert.cert.der().clone()], key)
            .unwrap(),
    );
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for tcp in listener.incoming().map_while(Result::ok) {
            let _ = tcp.set_read_timeout(Some(Duration::from_secs(30)));
            let conn = rustls::ServerConnection::new(config.clone()).unwrap();
            let mut tls = rustls::StreamOwned::new(conn, tcp);
            answer_image_request(&mut tls, &png);
            tls.conn.send_close_notify();
            let _ = tls.flush();
        }
    });
    port
}

#[test]
fn http_images_from_allowed_domains_are_fetched() {
    let png = std::fs::read(fixture("golden/images/c_150x150.png")).unwrap();
    let other_port = image_host(png.clone());
    let port = image_host(png);
    let allowed = format!("127.0.0.1:{port}");
    let server = serve(&["--allowed-media-domains", &allowed]);
    server.wait_ready();
    let inline = server.post("/v1/chat/completions", &image_chat(&image_url(), json!({})));
    let fetched = server.post(
        "/v1/chat/completions",
        &image_chat(&format!("http://127.0.0.1:{port}/c.png"), json!({})),
    );
    assert_eq!(fetched.status, 200, "{}", fetched.text());
    // The same pixels: the same prompt (image placeholders included) and the same greedy tokens.
    assert_eq!(fetched.json()["prompt_token_ids"], inline.json()["prompt_token_ids"]);
    assert_eq!(
        fetched.json()["choices"][0]["token_ids"],
        inline.json()["choices"][0]["token_ids"]
    );
    let missing = server.post(
        "/v1/chat/completions",
        &image_chat(&format!("http://127.0.0.1:{port}/missing.png"), json!({})),
    );
    missing.assert_error(400, "a missing remote image");
    assert!(missing.text().contains("404"), "{}", missing.text());
    let elsewhere = server.post(
        "/v1/chat/completions",
        &image_chat("http://example.com/c.png", json!({})),
    );
    elsewhere.assert_error(400, "a domain that is not allowed");
    // The allowlist is per host and port: another service on the same host is not reached.
    let other = server.post(
        "/v1/chat/completions",
        &image_chat(&format!("http://127.0.0.1:{other_port}/c.png"), json!({})),
    );
    other.assert_error(400, "another port of an allowed host");
    assert!(
        other.text().contains("not in --allowed-media-domains"),
        "{}",
        other.text()
    );
    // An answer that is not an image is refused without quoting it.
    let secret = server.post(
        "/v1/chat/completions",
        &image_chat(&format!("http://127.0.0.1:{port}/secret"), json!({})),
    );
    secret.assert_error(400, "an answer that is not an image");
    assert!(secret.text().contains("is not a PNG"), "{}", secret.text());
    assert!(!secret.text().contains("SECRET"), "{}", secret.text());
}

/// https image URLs are fetched from allowed hosts whose certificate is trusted (here through
/// `--media-ca-file`), redirects to allowed hosts are followed; a redirect to a host that is not
/// allowed, a host that is not allowed and an untrusted certificate are 400s that say why.
#[test]
fn https_images_from_allowed_domains_are_fetched() {
    let png = std::fs::read(fixture("golden/images/c_150x150.png")).unwrap();
    let trusted = self_signed("kvlens test image host");
    let ca_file = scratch("serve-http-media-ca.pem");
    let port = tls_image_host(png.clone(), &trusted);
    let untrusted_port = tls_image_host(png.clone(), &self_signed("someone else"));
    // openssl req -x509's default: a self-signed certificate that says CA:TRUE.
    let ca_cert = {
        let mut params = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()]).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let signing_key = rcgen::KeyPair::generate().unwrap();
        let cert = params.self_signed(&signing_key).unwrap();
        rcgen::CertifiedKey { cert, signing_key }
    };
    std::fs::write(&ca_file, format!("{}{}", trusted.cert.pem(), ca_cert.cert.pem())).unwrap();
    let ca_port = tls_image_host(png, &ca_cert);
    let allowed = [port, untrusted_port, ca_port].map(|p| format!("127.0.0.1:{p}"));
    let server = serve(&[
        "--allowed-media-domains",
        &allowed[0],
        &allowed[1],
        &allowed[2],
        "--media-ca-file",
        ca_file.to_str().unwrap(),
    ]);
    server.wait_ready();
    let chat = |url: String| server.post("/v1/chat/completions", &image_chat(&url, json!({})));
    let inline = chat(image_url());
    assert_eq!(inline.status, 200, "{}", inline.text());
    for path in ["/c.png", "/moved"] {
        let fetched = chat(format!("https://127.0.0.1:{port}{path}"));
        assert_eq!(fetched.status, 200, "{path}: {}", fetched.text());
        assert_eq!(
            fetched.json()["prompt_token_ids"],
            inline.json()["prompt_token_ids"],
            "{path}"
        );
        assert_eq!(
            fetched.json()["choices"][0]["token_ids"],
            inline.json()["choices"][0]["token_ids"],
            "{path}"
        );
    }
    let refused = |url: String, says: &[&str]| {
        let r = chat(url.clone());
        r.assert_error(400, &url);
        for s in says {
            assert!(r.text().contains(s), "{url}: {}", r.text());
        }
    };
    refused(
        format!("https://127.0.0.1:{port}/away"),
        &[
            "redirected",
            "http://example.com/c.png",
            "not in --allowed-media-domains",
        ],
    );
    refused("https://example.com/c.png".into(), &["not in --allowed-media-domains"]);
    refused(
        format!("https://127.0.0.1:{untrusted_port}/c.png"),
        &["cannot fetch the image", "invalid peer certificate", "UnknownIssuer"],
    );
    refused(
        format!("https://127.0.0.1:{ca_port}/c.png"),
        &["CaUsedAsEndEntity", "basicConstraints=critical,CA:FALSE"],
    );
    assert_eq!(server.get("/health").status, 200);
}

/// `/tokenize` counts what the generation endpoints count (a prompt, and a chat with an image whose
/// placeholders are expanded), without filling the processor cache; `/detokenize` turns the ids
/// back into the text; both answer in vLLM's shapes and errors.
#[test]
fn tokenize_and_detokenize_count_what_generation_counts() {
    let server = serve(&[]);
    server.wait_ready();
    let tokenize = |body: Value| {
        let r = server.post("/tokenize", &body);
        assert_eq!(r.status, 200, "{body}: {}", r.text());
        r.json()
    };
    let detokenize = |tokens: &Value| {
        let r = server.post("/detokenize", &json!({"model": "tiny", "tokens": tokens}));
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()["prompt"].as_str().unwrap().to_string()
    };

    // A chat with an image, tokenized before anything else: the processor cache stays empty.
    let chat = image_chat(&image_url(), json!({"max_tokens": 1}));
    let t = tokenize(json!({"model": "tiny", "messages": chat["messages"], "return_token_strs": true}));
    assert_eq!(memory(&server)["processor_cache"]["bytes_used"], 0);
    let tokens = ids(&t["tokens"]);
    assert_eq!(t["count"], tokens.len());
    assert_eq!(t["max_model_len"], 4096);
    assert!(tokens.iter().filter(|&&id| id == IMAGE_PAD).count() >= 4, "{tokens:?}");
    let strs = t["token_strs"].as_array().unwrap();
    assert_eq!(strs.len(), tokens.len());
    assert_eq!(
        strs[tokens.iter().position(|&id| id == IMAGE_PAD).unwrap()],
        "<|image_pad|>"
    );
    let generated = server.post("/v1/chat/completions", &chat).json();
    assert_eq!(ids(&generated["prompt_token_ids"]), tokens);
    assert_eq!(generated["usage"]["prompt_tokens"], t["count"]);
    assert!(detokenize(&t["tokens"]).contains("<|im_start|>user\n<|vision_start|><|image_pad|>"));

    // Without the generation prompt: a strict prefix. Continuing the final message: its text last.
    let bare = tokenize(json!({"messages": chat["messages"], "add_generation_prompt": false}));
    assert!(bare["count"].as_u64() < t["count"].as_u64());
    assert!(tokens.starts_with(&ids(&bare["tokens"])));
    let started = json!([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The KV cache"}]);
    let cont = tokenize(json!({"messages": started, "add_generation_prompt": false,
                               "continue_final_message": true}));
    assert!(detokenize(&cont["tokens"]).ends_with("<|im_start|>assistant\nThe KV cache"));

    // A prompt: the completions endpoint's tokens; the text comes back whole.
    let prompt = "The KV cache holds keys and values, ünïcode and all.";
    let t = tokenize(json!({"model": "tiny", "prompt": prompt, "return_token_strs": null}));
    assert!(t["token_strs"].is_null());
    let generated = server
        .post(
            "/v1/completions",
            &json!({"model": "tiny", "prompt": prompt, "max_tokens": 1, "return_token_ids": true}),
        )
        .json();
    assert_eq!(generated["prompt_token_ids"], t["tokens"]);
    assert_eq!(generated["usage"]["prompt_tokens"], t["count"]);
    assert_eq!(detokenize(&t["tokens"]), prompt);

    for (path, body, status, says) in [
        ("/tokenize", json!({"model": "nope", "prompt": "x"}), 404, "nope"),
        ("/detokenize", json!({"model": "nope", "tokens": [1]}), 404, "nope"),
        (
            "/tokenize",
            json!({"prompt": "x", "messages": []}),
            400,
            "either prompt",
        ),
        ("/tokenize", json!({"model": "tiny"}), 400, "either prompt"),
        (
            "/tokenize",
            json!({"messages": started, "tools": [{"type": "function"}]}),
            400,
            "tools",
        ),
        (
            "/tokenize",
            json!({"messages": started, "continue_final_message": true}),
            400,
            "add_generation_prompt",
        ),
        ("/detokenize", json!({"tokens": [999_999]}), 400, "999999"),
        (
            "/tokenize",
            json!({"prompt": "cache ".repeat(100_000)}),
            400,
            "maximum context length",
        ),
    ] {
        let r = server.post(path, &body);
        r.assert_error(status, &format!("{path} {body}"));
        assert!(r.text().contains(says), "{path} {body}: {}", r.text());
    }
    http(server.port(), "GET", "/tokenize", &[], b"").assert_error(405, "GET /tokenize");
}

/// Starts a long streamed completion and returns the connection once its first chunk arrived.
fn long_stream(server: &Server) -> (std::net::TcpStream, Vec<u8>) {
    let body = json!({"model": "tiny", "prompt": "Memory", "max_tokens": 1500, "temperature": 0,
                      "ignore_eos": true, "stream": true});
    open_stream(server, "/v1/completions", &body)
}

/// POSTs a streamed request and returns the connection and what it read, once the first data
/// chunk arrived.
fn open_stream(server: &Server, path: &str, body: &Value) -> (std::net::TcpStream, Vec<u8>) {
    let mut s = send(server.port(), "POST", path, &[], body.to_string().as_bytes());
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("data: {") {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "the stream ended early: {}", String::from_utf8_lossy(&seen));
        seen.extend_from_slice(&buf[..n]);
    }
    (s, seen)
}

/// The finish reasons of the chunks of an SSE answer read to its end, and whether `[DONE]` closed it.
fn finish_reasons(mut s: std::net::TcpStream, mut seen: Vec<u8>) -> (Vec<String>, bool) {
    s.read_to_end(&mut seen).unwrap();
    let text = String::from_utf8_lossy(&seen).into_owned();
    let events: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    let reasons = events
        .iter()
        .filter(|e| **e != "[DONE]")
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .filter_map(|c| c["choices"][0]["finish_reason"].as_str().map(str::to_string))
        .collect();
    (reasons, events.last() == Some(&"[DONE]"))
}

/// On SIGTERM a stream in flight ends with `finish_reason: "abort"` and `[DONE]` (vLLM's default
/// `--shutdown-timeout 0`); with a timeout it runs to its end while new requests are refused.
#[test]
fn sigterm_ends_streams_with_abort_or_drains_them() {
    let server = serve(&[]);
    server.wait_ready();
    let (s, seen) = long_stream(&server);
    let status = server.stop("TERM");
    assert_eq!(status.code(), Some(0));
    assert_eq!(finish_reasons(s, seen), (vec!["abort".to_string()], true));

    let server = serve(&["--shutdown-timeout", "600"]);
    server.wait_ready();
    let (s, seen) = long_stream(&server);
    let pid = server.pid();
    assert!(std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap()
        .success());
    // Wait for the drain to begin (health turns 503), then new work is refused.
    let deadline = Instant::now() + Duration::from_secs(300);
    while server.get("/health").status != 503 {
        assert!(Instant::now() < deadline, "/health never turned 503:\n{}", server.log());
        std::thread::sleep(Duration::from_millis(20));
    }
    let chat = json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    server
        .post("/v1/chat/completions", &chat)
        .assert_error(503, "a new request while draining");
    assert_eq!(finish_reasons(s, seen), (vec!["length".to_string()], true));
    let log = server.log();
    assert_eq!(server.stop("TERM").code(), Some(0), "{log}");
}

/// A vision-tower failure, a decoder failure and an out-of-memory in the middle of 8 concurrent
/// image chats (`KVLENS_FAULT`): the requests in that step get a 500 naming the failure, the
/// server stays healthy and serves the next requests, and no KV block or encoder reference leaks.
#[test]
fn a_failed_step_fails_its_requests_and_nothing_else() {
    let png = std::fs::read(fixture("golden/images/c_150x150.png")).unwrap();
    let image = image::load_from_memory(&png).unwrap().to_rgb8();
    for (plan, says) in [
        ("vision:3", "injected fault"),
        ("decoder:4", "injected fault"),
        ("alloc:2", "out of memory"),
    ] {
        let no_playground = scratch("serve-http-no-playground");
        let server = Server::start_with_env(
            checkpoint(),
            &["--playground-dir", no_playground.to_str().unwrap()],
            &[("KVLENS_FAULT", plan)],
        );
        server.wait_ready();
        // Eight different images (one pixel changed each), so each needs the vision tower.
        let bodies: Vec<Value> = (0..8u8)
            .map(|i| {
                let mut img = image.clone();
                img.put_pixel(0, 0, image::Rgb([i, i, i]));
                let mut bytes = Vec::new();
                img.write_to(&mut std::io::Cursor::new(&mut bytes), image::ImageFormat::Png)
                    .unwrap();
                image_chat(
                    &format!("data:image/png;base64,{}", base64(&bytes)),
                    json!({"max_tokens": 4}),
                )
            })
            .collect();
        let replies = post_all(&server, "/v1/chat/completions", &bodies.iter().collect::<Vec<_>>());
        let failed: Vec<&(u16, String)> = replies.iter().filter(|r| r.0 != 200).collect();
        assert!(!failed.is_empty(), "{plan}: nothing failed: {replies:?}");
        for (status, text) in &failed {
            assert_eq!(*status, 500, "{plan}: {text}");
            assert!(text.contains(says), "{plan}: {text}");
        }
        assert_eq!(server.get("/health").status, 200, "{plan}");
        let after = server.post("/v1/chat/completions", &bodies[0]);
        assert_eq!(after.status, 200, "{plan}: the next request: {}", after.text());
        let m = memory(&server);
        assert_eq!(m["kv"]["num_in_use"], 0, "{plan}: {}", m["kv"]);
        assert_eq!(
            (m["num_running"].as_u64(), m["num_waiting"].as_u64()),
            (Some(0), Some(0))
        );
        let entries = m["encoder_cache"]["entries"].as_array().unwrap();
        assert!(entries.iter().all(|e| e["freeable"] == true), "{plan}: {entries:?}");
        assert!(server.log().contains("ERROR engine step failed"), "{plan}");
    }
}

/// Hundreds of connections that send part of their headers and then nothing: each is closed after
/// `--header-timeout`, the connection limit keeps the server's descriptors bounded with a log
/// line, `/health` is answered all along, and an idle keep-alive connection is closed too.
#[test]
fn slow_header_floods_are_timed_out_and_limited() {
    let server = serve(&[
        "--max-connections",
        "64",
        "--header-timeout",
        "1",
        "--body-timeout",
        "1",
    ]);
    server.wait_ready();
    let port = server.port();
    // A body that stops short of its Content-Length gets a 408 once the body deadline passes.
    let mut slow = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    slow.set_read_timeout(Some(Duration::from_secs(300))).unwrap();
    slow.write_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
          Content-Length: 100\r\n\r\n{\"model\": ",
    )
    .unwrap();
    let mut answer = Vec::new();
    let mut buf = [0u8; 1024];
    while !String::from_utf8_lossy(&answer).contains("\r\n\r\n") {
        let n = slow.read(&mut buf).unwrap();
        assert!(
            n > 0,
            "closed without an answer: {:?}",
            String::from_utf8_lossy(&answer)
        );
        answer.extend_from_slice(&buf[..n]);
    }
    assert!(
        String::from_utf8_lossy(&answer).starts_with("HTTP/1.1 408"),
        "{:?}",
        String::from_utf8_lossy(&answer)
    );
    let flood: Vec<std::net::TcpStream> = (0..300)
        .map(|_| {
            let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
            s.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le")
                .unwrap();
            s
        })
        .collect();
    // Queued behind the flood, answered once its connections time out.
    assert_eq!(server.get("/health").status, 200);
    for mut s in flood {
        s.set_read_timeout(Some(Duration::from_secs(300))).unwrap();
        let mut buf = [0u8; 256];
        // The server closes it (end of stream, a reset, or a 408 then the end).
        loop {
            match s.read(&mut buf) {
                Ok(0) => break,
                Ok(_) => continue,
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                    panic!("a half-sent request was never closed")
                }
                Err(_) => break,
            }
        }
    }
    let log = server.log();
    assert!(log.contains("64 connections open (--max-connections)"), "{log}");
    // A kept-alive connection that goes quiet after its answer is closed as well.
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(300))).unwrap();
    s.write_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n").unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 256];
    loop {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => seen.extend_from_slice(&buf[..n]),
        }
    }
    assert!(String::from_utf8_lossy(&seen).starts_with("HTTP/1.1 200"), "{seen:?}");
    assert_eq!(server.get("/health").status, 200);
}

/// The request path's host-memory budget in bytes, as the server's start-up line states it.
fn preprocess_budget(server: &Server) -> u64 {
    let log = server.log();
    let line = log
        .lines()
        .find(|l| l.contains("image preprocessing) may hold"))
        .unwrap_or_else(|| panic!("{log}"));
    let gib: f64 = line
        .split("hold ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|g| g.parse().ok())
        .unwrap_or_else(|| panic!("{line}"));
    (gib * f64::from(1u32 << 30)) as u64
}

/// Runs `work` and returns what it returned and how far the server's peak resident memory rose
/// above its resident memory before it (the peak is reset first).
fn peak_growth<T>(server: &Server, work: impl FnOnce() -> T) -> (T, u64) {
    let pid = server.pid();
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").unwrap();
    let before = proc_status_bytes(pid, "VmRSS");
    let out = work();
    (out, proc_status_bytes(pid, "VmHWM").saturating_sub(before))
}

/// This process's resident memory figure `field` (`VmRSS`, `VmHWM`) of `pid`, in bytes.
fn proc_status_bytes(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no {field} in {status}"));
    kib << 10
}

/// 8 chats at once, each with the same 36-megapixel PNG that compresses to a few hundred KB (about
/// 110 MB of pixels to decode each, 0.9 GB together): the preprocessing budget holds the server's
/// peak resident growth near the budget, every chat is answered (200, or 503 naming the budget),
/// and the ledger shows no staging bytes afterwards.
#[test]
fn a_burst_of_large_images_stays_within_the_preprocessing_budget() {
    let server = serve(&[
        "--preprocess-memory-gib",
        "0.1",
        "--mm-processor-kwargs",
        r#"{"max_pixels": 65536}"#,
    ]);
    server.wait_ready();
    let budget = preprocess_budget(&server);
    let img = image::RgbImage::from_fn(6000, 6000, |x, y| {
        image::Rgb([(x / 1000) as u8 * 40, (y / 1000) as u8 * 40, 90])
    });
    let mut png = Vec::new();
    img.write_to(&mut std::io::Cursor::new(&mut png), image::ImageFormat::Png)
        .unwrap();
    assert!(png.len() < 2 << 20, "{} bytes", png.len());
    let body = image_chat(
        &format!("data:image/png;base64,{}", base64(&png)),
        json!({"max_tokens": 1}),
    );
    // Warm up once, then measure the peak from here.
    assert_eq!(server.post("/v1/chat/completions", &body).status, 200);
    let (replies, growth) = peak_growth(&server, || post_all(&server, "/v1/chat/completions", &[&body; 8]));
    for (status, text) in &replies {
        assert!(
            *status == 200 || (*status == 503 && text.contains("memory budget")),
            "{status} {text}"
        );
    }
    println!(
        "peak resident growth {} MiB with a budget of {} MiB",
        growth >> 20,
        budget >> 20
    );
    assert!(
        growth < budget + (100 << 20),
        "peak resident growth {} MiB, budget {} MiB",
        growth >> 20,
        budget >> 20
    );
    assert_eq!(ledger(&memory(&server), "staging"), 0);
}

/// A client that sends a chat with a large image and leaves while it is preprocessed: the request
/// never reaches the engine (counted as cancelled before the queue), no token is generated for it,
/// and nothing is left in use.
#[test]
fn a_client_that_leaves_before_its_request_is_queued_costs_no_engine_work() {
    let server = serve(&[]);
    server.wait_ready();
    let img = image::RgbImage::from_fn(3000, 3000, |x, y| image::Rgb([(x % 256) as u8, (y % 256) as u8, 7]));
    let mut png = Vec::new();
    img.write_to(&mut std::io::Cursor::new(&mut png), image::ImageFormat::Png)
        .unwrap();
    let mut body = image_chat(
        &format!("data:image/png;base64,{}", base64(&png)),
        json!({"max_tokens": 500}),
    );
    body["ignore_eos"] = json!(true);
    let metrics = |s: &Server| s.get("/metrics").text();
    let cancelled = |t: &str| metric(t, "kvlens:requests_cancelled_before_queue_total{model_name=\"tiny\"}");
    let generated = |t: &str| metric(t, "vllm:generation_tokens_total{model_name=\"tiny\"}");
    let before = metrics(&server);
    drop(send(
        server.port(),
        "POST",
        "/v1/chat/completions",
        &[],
        body.to_string().as_bytes(),
    ));
    let deadline = Instant::now() + Duration::from_secs(300);
    let after = loop {
        let t = metrics(&server);
        if cancelled(&t) > cancelled(&before) {
            break t;
        }
        assert!(Instant::now() < deadline, "never counted as cancelled:\n{t}");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(cancelled(&after) - cancelled(&before), 1.0);
    assert_eq!(
        generated(&after),
        generated(&before),
        "no token for a request nobody waits for"
    );
    let m = memory(&server);
    assert_eq!(m["kv"]["num_in_use"], 0, "{}", m["kv"]);
    assert_eq!(
        (m["num_running"].as_u64(), m["num_waiting"].as_u64()),
        (Some(0), Some(0))
    );
    assert!(!server.log().contains("Finished request chatcmpl"), "{}", server.log());
}

/// Connection and shutdown flags out of range stop the server at once with one line and exit 2.
#[test]
fn out_of_range_guard_flags_are_one_line_errors() {
    for (flag, value) in [
        ("--max-connections", "0"),
        ("--header-timeout", "0"),
        ("--header-timeout", "1e15"),
        ("--body-timeout", "NaN"),
        ("--shutdown-timeout", "inf"),
        ("--shutdown-timeout", "-1"),
        ("--max-stream-subscribers", "0"),
        ("--preprocess-memory-gib", "1e30"),
        ("--allowed-media-domains", "http://x/y"),
    ] {
        let out = common::kvlens(&["serve", "--port", "0", &format!("{flag}={value}")]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flag} {value}: {err}");
        assert!(err.contains(flag), "{flag} {value}: {err}");
    }
}

/// The value of header `name` in an answer's head (names compared case-insensitively).
fn header_value(head: &str, name: &str) -> Option<String> {
    head.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.trim().eq_ignore_ascii_case(name).then(|| v.trim().to_string())
    })
}

/// A playground directory with a recognisable index.html.
fn fake_playground() -> PathBuf {
    let dir = scratch("serve-http-playground");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("index.html"),
        "<!doctype html><title>kvlens playground</title>",
    )
    .unwrap();
    dir
}

/// As vLLM's default `--allowed-origins ["*"]`: a page on another origin (the playground on a static
/// server) may preflight the resets, read `/server_info`, `/metrics` and the memory stream. The
/// playground's one page answers `/planner` too, while unknown paths stay JSON 404s.
#[test]
fn any_origin_may_read_the_api_and_the_planner_is_the_playground_page() {
    let playground = fake_playground();
    let server = Server::start(checkpoint(), &["--playground-dir", playground.to_str().unwrap()]);
    server.wait_ready();
    let port = server.port();
    let origin = [("Origin", "http://127.0.0.1:9999")];
    let preflight = http(
        port,
        "OPTIONS",
        "/reset_encoder_cache",
        &[
            ("Origin", "http://127.0.0.1:9999"),
            ("Access-Control-Request-Method", "POST"),
            ("Access-Control-Request-Headers", "content-type"),
        ],
        b"",
    );
    assert_eq!(preflight.status, 200, "{}", preflight.head);
    assert_eq!(
        header_value(&preflight.head, "access-control-allow-origin").as_deref(),
        Some("*")
    );
    let methods = header_value(&preflight.head, "access-control-allow-methods").unwrap_or_default();
    assert!(methods.contains("POST"), "{}", preflight.head);
    let headers = header_value(&preflight.head, "access-control-allow-headers").unwrap_or_default();
    assert!(headers.contains("content-type"), "{}", preflight.head);
    assert_eq!(
        header_value(&preflight.head, "access-control-max-age").as_deref(),
        Some("600")
    );
    for path in ["/server_info", "/metrics", "/v1/memory"] {
        let r = http(port, "GET", path, &origin, b"");
        assert_eq!(r.status, 200, "{path}: {}", r.text());
        assert_eq!(
            header_value(&r.head, "access-control-allow-origin").as_deref(),
            Some("*"),
            "{path}: {}",
            r.head
        );
    }
    // As the playground posts it: saying JSON, which a browser sends cross-origin only after the
    // preflight above (without it the server refuses a cross-origin POST: see
    // `pages_of_other_sites_cannot_drive_a_local_server`).
    let json_origin = [origin[0], ("Content-Type", "application/json")];
    let reset = http(port, "POST", "/reset_encoder_cache", &json_origin, b"");
    assert_eq!(reset.status, 200, "{}", reset.text());
    assert_eq!(
        header_value(&reset.head, "access-control-allow-origin").as_deref(),
        Some("*")
    );
    // The memory stream's head carries the header before any event.
    let mut stream = send(port, "GET", "/v1/memory/stream", &origin, b"");
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        assert_eq!(stream.read(&mut byte).unwrap(), 1, "the stream closed in its head");
        head.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&head);
    assert!(head.to_ascii_lowercase().contains("text/event-stream"), "{head}");
    assert_eq!(header_value(&head, "access-control-allow-origin").as_deref(), Some("*"));
    drop(stream);

    for path in ["/planner", "/planner/", "/planner?model=Qwen3-VL-8B-Instruct&tp=2"] {
        let r = server.get(path);
        assert_eq!(r.status, 200, "{path}");
        assert!(r.text().contains("kvlens playground"), "{path}: {}", r.text());
        assert!(header_value(&r.head, "content-type")
            .unwrap_or_default()
            .starts_with("text/html"));
    }
    // Cross-origin isolated, so that the tab's CPU backend may share memory with helper workers.
    let page = server.get("/");
    assert_eq!(page.status, 200);
    assert_eq!(
        header_value(&page.head, "cross-origin-opener-policy").as_deref(),
        Some("same-origin")
    );
    assert_eq!(
        header_value(&page.head, "cross-origin-embedder-policy").as_deref(),
        Some("require-corp")
    );
    server.get("/planner/x").assert_error(404, "below /planner");
    server.get("/v1/nothing").assert_error(404, "an unknown API path");
    http(port, "POST", "/planner", &[], b"").assert_error(405, "POST /planner");
    assert_eq!(server.stop("TERM").code(), Some(0));
}

/// `--allowed-origins` restricts CORS to the listed origins (echoed back, with credentials when
/// `--allow-credentials` is given); other origins get no `Access-Control-Allow-Origin`, so their
/// pages cannot read the answers. Bad JSON is a one-line usage error, as vLLM's argparse makes it.
#[test]
fn a_restricted_allowed_origins_refuses_other_origins() {
    let server = serve(&[
        "--allowed-origins",
        r#"["http://playground.test:8080"]"#,
        "--allowed-methods",
        r#"["GET", "POST"]"#,
        "--allowed-headers",
        r#"["Content-Type"]"#,
        "--allow-credentials",
    ]);
    let port = server.port();
    let preflight = |origin: &str, method: &str| {
        http(
            port,
            "OPTIONS",
            "/reset_prefix_cache",
            &[("Origin", origin), ("Access-Control-Request-Method", method)],
            b"",
        )
    };
    let ok = preflight("http://playground.test:8080", "POST");
    assert_eq!(
        header_value(&ok.head, "access-control-allow-origin").as_deref(),
        Some("http://playground.test:8080"),
        "{}",
        ok.head
    );
    assert_eq!(
        header_value(&ok.head, "access-control-allow-credentials").as_deref(),
        Some("true")
    );
    assert_eq!(
        header_value(&ok.head, "access-control-allow-methods").as_deref(),
        Some("GET,POST")
    );
    assert_eq!(
        header_value(&ok.head, "access-control-allow-headers").as_deref(),
        Some("content-type")
    );
    let other = preflight("http://elsewhere.test", "POST");
    assert_eq!(
        header_value(&other.head, "access-control-allow-origin"),
        None,
        "{}",
        other.head
    );
    // /health answers (503 while loading, then 200) with the same rules.
    let allowed = http(
        port,
        "GET",
        "/health",
        &[("Origin", "http://playground.test:8080")],
        b"",
    );
    assert_eq!(
        header_value(&allowed.head, "access-control-allow-origin").as_deref(),
        Some("http://playground.test:8080")
    );
    assert!(header_value(&allowed.head, "vary")
        .unwrap_or_default()
        .contains("origin"));
    let refused = http(port, "GET", "/health", &[("Origin", "http://elsewhere.test")], b"");
    assert_eq!(header_value(&refused.head, "access-control-allow-origin"), None);
    drop(server);

    let out = common::kvlens(&["serve", "--allowed-origins", "http://a.test", "--port", "0"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--allowed-origins") && err.contains("JSON list"), "{err}");
}

/// kvlens's `/metrics` carries vLLM's names, so the playground's vLLM view can read it too: what
/// `kvlens_engine::memory::vllm_metrics` reads there agrees with `/v1/memory` once the engine is
/// idle.
#[test]
fn the_vllm_metrics_reader_agrees_with_the_memory_endpoint() {
    use kvlens_engine::memory::vllm_metrics::VllmMetrics;
    let server = serve(&[]);
    server.wait_ready();
    chat_with_image(&server);
    chat_with_image(&server);
    let deadline = Instant::now() + Duration::from_secs(30);
    let (m, mem) = loop {
        let m = VllmMetrics::parse(&server.get("/metrics").text());
        let mem = memory(&server);
        let agree = m.kv_cache_usage == mem["kv"]["usage"].as_f64()
            && m.prefix_cache_queries == mem["prefix_cache"]["queries"].as_u64();
        if agree || Instant::now() > deadline {
            break (m, mem);
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(m.is_vllm());
    assert_eq!(m.engines, 1);
    assert_eq!(m.model_names, ["tiny"]);
    assert_eq!(m.kv_cache_usage, mem["kv"]["usage"].as_f64(), "{mem:#}");
    assert_eq!(m.num_requests_running, Some(0));
    assert_eq!(m.num_requests_waiting, Some(0));
    assert_eq!(m.prefix_cache_queries, mem["prefix_cache"]["queries"].as_u64());
    assert_eq!(m.prefix_cache_hits, mem["prefix_cache"]["hits"].as_u64());
    assert!(
        m.prefix_cache_hits.unwrap() > 0,
        "the second chat reuses the first's prefix"
    );
    assert_eq!(m.num_preemptions, mem["counters"]["num_preemptions"].as_u64());
    // Where kvlens adds vLLM's cache_config_info, its blocks are the engine's.
    if let Some(blocks) = m.num_gpu_blocks {
        assert_eq!(Some(blocks), mem["kv"]["num_blocks"].as_u64());
        assert_eq!(m.blocks_in_use(), mem["kv"]["num_in_use"].as_u64());
    }
    drop(server);
}

/// Opens a connection to the server and writes `request` (whole or partial); the answer is left
/// unread.
fn raw_open(port: u16, request: &str) -> std::net::TcpStream {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.write_all(request.as_bytes()).unwrap();
    s
}

/// Sends a whole raw request (which should say `Connection: close`) and reads the answer: the
/// status and the body's text.
fn raw(port: u16, request: &str) -> (u16, String) {
    let mut s = raw_open(port, request);
    s.set_read_timeout(Some(Duration::from_secs(300))).unwrap();
    let mut answer = Vec::new();
    s.read_to_end(&mut answer).unwrap();
    let text = String::from_utf8_lossy(&answer).into_owned();
    let status = text.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (status, text)
}

/// 1,100 memory-stream subscribers that never read and then 1,100 POSTs with complete headers
/// whose body never comes, against the default `--max-connections 1024` and `--body-timeout 60`:
/// `/health` answers at once and a chat completes (before, every probe timed out until the bodies'
/// deadline), and the subscribers past `--max-stream-subscribers` (32) have been closed.
#[test]
fn idle_subscribers_and_stalled_bodies_cannot_lock_the_server_out() {
    let server = serve(&[]);
    server.wait_ready();
    let port = server.port();
    let subscribers: Vec<std::net::TcpStream> = (0..1100)
        .map(|_| raw_open(port, "GET /v1/memory/stream HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"))
        .collect();
    let stalled: Vec<std::net::TcpStream> = (0..1100)
        .map(|_| {
            raw_open(
                port,
                "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
                 Content-Length: 1000\r\n\r\n",
            )
        })
        .collect();
    let mut slowest = Duration::ZERO;
    for _ in 0..5 {
        let asked = Instant::now();
        assert_eq!(server.get("/health").status, 200);
        slowest = slowest.max(asked.elapsed());
    }
    let asked = Instant::now();
    let chat = json!({"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2});
    let r = server.post("/v1/chat/completions", &chat);
    assert_eq!(r.status, 200, "{}", r.text());
    println!(
        "slowest of 5 /health probes {:.3} s, a chat {:.3} s, under 1,100 idle subscribers and 1,100 stalled bodies",
        slowest.as_secs_f64(),
        asked.elapsed().as_secs_f64()
    );
    assert!(slowest < Duration::from_secs(5), "{slowest:?}");
    // Every subscriber but the newest 32 has been closed by the server.
    let deadline = Instant::now() + Duration::from_secs(300);
    let mut open: Vec<std::net::TcpStream> = subscribers;
    let mut buf = [0u8; 4096];
    while open.len() > 32 {
        assert!(Instant::now() < deadline, "{} subscribers still open", open.len());
        open.retain_mut(|s| {
            s.set_nonblocking(true).unwrap();
            loop {
                match s.read(&mut buf) {
                    Ok(0) => return false,
                    Ok(_) => continue,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return true,
                    Err(_) => return false,
                }
            }
        });
        std::thread::sleep(Duration::from_millis(20));
    }
    let log = server.log();
    assert!(log.contains("1024 connections open (--max-connections)"), "{log}");
    drop(stalled);
    assert_eq!(server.get("/health").status, 200);
}

/// What a page on another site can make a browser send: a chat as `text/plain`, a form or
/// multipart (no CORS preflight needed) gets a 415 and generates nothing; a body-less reset with
/// a foreign `Origin` gets a 403 unless it says JSON; a request naming a foreign `Host` (DNS
/// rebinding) gets a 403 from a loopback-bound server. Clients without an `Origin` are unaffected.
#[test]
fn pages_of_other_sites_cannot_drive_a_local_server() {
    let server = serve(&[]);
    server.wait_ready();
    let port = server.port();
    let generated = |s: &Server| {
        metric(
            &s.get("/metrics").text(),
            "vllm:generation_tokens_total{model_name=\"tiny\"}",
        )
    };
    let before = generated(&server);
    let chat =
        json!({"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}).to_string();
    for content_type in [
        Some("text/plain"),
        Some("application/x-www-form-urlencoded"),
        Some("multipart/form-data; boundary=x"),
        None,
    ] {
        let header = content_type.map_or(String::new(), |t| format!("Content-Type: {t}\r\n"));
        let (status, answer) = raw(
            port,
            &format!(
                "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nOrigin: https://evil.example\r\n\
                 {header}Content-Length: {}\r\nConnection: close\r\n\r\n{chat}",
                chat.len()
            ),
        );
        // Refused before the body is read: a cross-origin POST that is not JSON.
        assert_eq!(status, 403, "{content_type:?}: {answer}");
        // Without an Origin (curl, the SDKs), a non-JSON body is still refused.
        let (status, answer) = raw(
            port,
            &format!(
                "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n{header}Content-Length: 2\r\nConnection: close\r\n\r\n{{}}"
            ),
        );
        assert_eq!(status, 415, "{content_type:?}: {answer}");
        assert!(answer.contains("application/json"), "{answer}");
    }
    assert_eq!(generated(&server), before, "nothing was generated");
    let reset = |headers: &str| {
        raw(
            port,
            &format!("POST /reset_prefix_cache HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{headers}Content-Length: 0\r\nConnection: close\r\n\r\n"),
        )
    };
    let (status, answer) = reset("Origin: https://evil.example\r\n");
    assert_eq!(status, 403, "{answer}");
    assert!(answer.contains("application/json"), "{answer}");
    assert_eq!(reset("").0, 200, "curl's reset");
    assert_eq!(
        reset(&format!("Origin: http://127.0.0.1:{port}\r\n")).0,
        200,
        "the server's own page"
    );
    assert_eq!(
        reset("Origin: https://evil.example\r\nContent-Type: application/json\r\n").0,
        200,
        "a request the browser preflighted under --allowed-origins"
    );
    for (host, expected) in [
        ("evil.example", 403),
        ("evil.example:8000", 403),
        ("localhost", 200),
        ("127.0.0.1", 200),
        ("[::1]", 200),
    ] {
        let (status, answer) = raw(
            port,
            &format!("GET /v1/models HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"),
        );
        assert_eq!(status, expected, "{host}: {answer}");
    }
}

/// The tiny checkpoint with a 262,144-token context (as Qwen3-VL has), so that the length of a long
/// text alone does not prove it too long.
fn long_context_checkpoint() -> PathBuf {
    let mut config: Value = serde_json::from_str(
        &std::fs::read_to_string(common::root().join("tools/golden/configs/qwen3_vl_tiny.json")).unwrap(),
    )
    .unwrap();
    config["text_config"]["max_position_embeddings"] = json!(262_144);
    let path = scratch("serve-http-long-context.json");
    std::fs::write(&path, config.to_string()).unwrap();
    common::checkpoint_of(&path, "serve-http-long-context", &["--dtype", "f32"])
}

/// Four 4.2 MB prompts of digits (one token per byte, 4.2 million tokens) at once against a
/// 262,144-token context: each is refused after counting a few 64 KiB pieces, the request path's
/// host memory shows in the ledger's `requests` category and stays far below what tokenizing them
/// whole took (4.5 GB); a long text whose client hangs up stops being tokenized.
#[test]
fn a_huge_prompt_is_refused_after_a_few_pieces_within_the_budget() {
    let no_playground = scratch("serve-http-no-playground");
    let server = Server::start(
        &long_context_checkpoint(),
        &[
            "--playground-dir",
            no_playground.to_str().unwrap(),
            "--cpu-memory-gib",
            "2",
        ],
    );
    server.wait_ready();
    let body = json!({"model": "tiny", "prompt": "7".repeat(4_200_000), "max_tokens": 1});
    let (replies, growth) = peak_growth(&server, || post_all(&server, "/v1/completions", &[&body; 4]));
    for (status, text) in &replies {
        assert_eq!(*status, 400, "{text}");
        assert!(text.contains("tokens in its first"), "{text}");
    }
    let m = memory(&server);
    let peak = ledger_figure(&m, "requests", "peak_bytes");
    println!(
        "4 x 4.2 MB prompts of digits: peak resident growth {} MiB, ledger requests peak {} MiB",
        growth >> 20,
        peak >> 20
    );
    assert_eq!(ledger(&m, "requests"), 0, "{}", m["ledger"]);
    assert!(peak > 4_200_000 && peak < 256 << 20, "{}", m["ledger"]);
    assert!(growth < 768 << 20, "peak resident growth {} MiB", growth >> 20);
    // A text of about 350,000 tokens, counted 11,000 tokens a piece; its client leaves once the
    // server counts pieces: the ledger's `requests` then holds a piece's 20 MiB beside the body.
    // (Leaving at once raced: a busy server could read the body's end and the hang-up in one go
    // and drop the handler before it tokenized. Without `Connection: close`: hyper watches a
    // kept-alive connection for the client's hang-up.)
    let words = json!({"model": "tiny", "prompt": "hello ".repeat(350_000), "max_tokens": 1}).to_string();
    let client = raw_open(
        server.port(),
        &format!(
            "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n{words}",
            words.len()
        ),
    );
    let deadline = Instant::now() + Duration::from_secs(300);
    while ledger(&memory(&server), "requests") < 2 * words.len() as u64 {
        assert!(
            Instant::now() < deadline,
            "tokenizing never started: {}",
            memory(&server)["ledger"]
        );
    }
    drop(client);
    let deadline = Instant::now() + Duration::from_secs(300);
    while !server
        .log()
        .contains("Stopped tokenizing and preprocessing a request: its client went away")
    {
        assert!(Instant::now() < deadline, "tokenizing never stopped:\n{}", server.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    let deadline = Instant::now() + Duration::from_secs(300);
    while ledger(&memory(&server), "requests") != 0 {
        assert!(Instant::now() < deadline, "{}", memory(&server)["ledger"]);
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// 8 chats at once, each with a 63 MiB image fetched from an allowed host: the fetched bytes and
/// their data URLs are reserved in the request path's budget as they arrive, so the peak resident
/// growth stays near the budget (before: +1.3 GB) and the ledger's `requests` peak within it.
#[test]
fn fetched_images_stay_within_the_preprocessing_budget() {
    // A PNG signature then 63 MiB of bytes: fetched whole, refused by the decoder.
    let mut big = b"\x89PNG\r\n\x1a\n".to_vec();
    big.resize(63 << 20, 0x5a);
    let port = image_host(big);
    let allowed = format!("127.0.0.1:{port}");
    let server = serve(&[
        "--allowed-media-domains",
        &allowed,
        "--preprocess-memory-gib",
        "0.1",
        "--mm-processor-kwargs",
        r#"{"max_pixels": 65536}"#,
    ]);
    server.wait_ready();
    let budget = preprocess_budget(&server);
    let body = image_chat(&format!("http://127.0.0.1:{port}/c.png"), json!({"max_tokens": 1}));
    let (replies, growth) = peak_growth(&server, || post_all(&server, "/v1/chat/completions", &[&body; 8]));
    for (status, text) in &replies {
        assert!(
            (*status == 400 && text.contains("decode")) || (*status == 503 && text.contains("memory budget")),
            "{status} {text}"
        );
    }
    let m = memory(&server);
    let peak = ledger_figure(&m, "requests", "peak_bytes");
    println!(
        "8 x 63 MiB fetched images: peak resident growth {} MiB, ledger requests peak {} MiB, budget {} MiB",
        growth >> 20,
        peak >> 20,
        budget >> 20
    );
    assert!(
        peak >= 63 << 20 && peak <= budget,
        "requests peak {peak}, budget {budget}"
    );
    assert!(
        growth < budget + (200 << 20),
        "peak resident growth {} MiB, budget {} MiB",
        growth >> 20,
        budget >> 20
    );
    assert_eq!(ledger(&m, "requests"), 0);
}

/// A failed engine step counts its requests as `error` (not `abort`), and a stream cut by it ends
/// with a chunk whose `finish_reason` is `"error"`, the error event and `[DONE]`.
#[test]
fn a_failed_step_is_counted_as_an_error_and_its_stream_says_so() {
    let no_playground = scratch("serve-http-no-playground");
    let server = Server::start_with_env(
        checkpoint(),
        &["--playground-dir", no_playground.to_str().unwrap()],
        &[("KVLENS_FAULT", "decoder:3")],
    );
    server.wait_ready();
    let count = |reason: &str| {
        metric(
            &server.get("/metrics").text(),
            &format!("vllm:request_success_total{{finished_reason=\"{reason}\",model_name=\"tiny\"}}"),
        )
    };
    let body = json!({"model": "tiny", "prompt": "Blocks", "max_tokens": 20, "ignore_eos": true, "stream": true});
    let r = server.post("/v1/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    let events = r.events();
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{events:?}");
    let error: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(error["error"]["code"], 500, "{error}\n{events:?}\n{}", server.log());
    let last: Value = serde_json::from_str(&events[events.len() - 3]).unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "error", "{events:?}");
    assert_eq!((count("error"), count("abort")), (1.0, 0.0));
    assert_eq!(server.get("/health").status, 200);
}

/// An attacker that holds 3,000 connections with half-sent headers on default flags and re-opens
/// each one the server closes, for 10 seconds: 16 `/health` probes made meanwhile are all answered
/// (before: 11 of 16 timed out), because at the connection limit each new connection closes the
/// one that has waited longest, and the listen backlog holds the flood's new connections.
#[test]
fn a_slow_header_attacker_who_reopens_connections_cannot_lock_the_server_out() {
    let server = serve(&[]);
    server.wait_ready();
    let port = server.port();
    const HALF: &str = "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ";
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reopened = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let attacker = {
        let (stop, reopened) = (stop.clone(), reopened.clone());
        std::thread::spawn(move || {
            let open = || {
                let s = raw_open(port, HALF);
                s.set_nonblocking(true).unwrap();
                s
            };
            let mut conns: Vec<std::net::TcpStream> = (0..3000).map(|_| open()).collect();
            let mut buf = [0u8; 512];
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                for c in &mut conns {
                    let closed = match c.read(&mut buf) {
                        Ok(0) => true,
                        Ok(_) => false,
                        Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
                    };
                    if closed {
                        *c = open();
                        reopened.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                }
                // A round every 100 ms: each re-opened connection evicts another, so a faster loop
                // only churns more loopback ports (tests run side by side).
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    };
    let flood_until = Instant::now() + Duration::from_secs(10);
    let mut probes = Vec::new();
    while probes.len() < 16 {
        let asked = Instant::now();
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        s.write_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            .unwrap();
        let mut answer = Vec::new();
        let answered = s.read_to_end(&mut answer).is_ok() && answer.starts_with(b"HTTP/1.1 200");
        probes.push((answered, asked.elapsed()));
        let pause = flood_until.saturating_duration_since(Instant::now()) / 16;
        std::thread::sleep(pause);
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    attacker.join().unwrap();
    let slowest = probes.iter().map(|p| p.1).max().unwrap();
    println!(
        "16 /health probes under 3,000 re-opened half-sent headers ({} re-opened): {} answered, slowest {:.3} s",
        reopened.load(std::sync::atomic::Ordering::Relaxed),
        probes.iter().filter(|p| p.0).count(),
        slowest.as_secs_f64()
    );
    assert!(probes.iter().all(|p| p.0), "{probes:?}");
    assert!(slowest < Duration::from_secs(5), "{probes:?}");
}
