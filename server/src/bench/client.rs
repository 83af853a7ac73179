//! The HTTP side of `kvlens bench serve`: a plain HTTP/1.1 client (hyper, pooled connections) and
//! vLLM's streaming `openai-chat` request function (`async_request_openai_chat_completions`): time
//! to the first chunk with choices, the gap before every later chunk, the usage chunk's counts.

use super::dataset::BenchRequest;
use crate::UsageError;
use anyhow::{bail, Context, Result};
use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode, Uri};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// What one request measured (vLLM's `RequestFuncOutput`); times in seconds.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RequestOutput {
    /// The server answered 200 and the stream was read to its end.
    pub success: bool,
    /// Why it failed ("" on success).
    pub error: String,
    /// When it was sent, after the benchmark's start.
    pub start_time: f64,
    /// Time to the first chunk with choices.
    pub ttft: f64,
    /// Gaps before each later chunk (a chunk may carry several tokens).
    pub itl: Vec<f64>,
    /// Time to the last data chunk (normally the usage chunk).
    pub latency: f64,
    /// `usage.completion_tokens`.
    pub output_tokens: Option<usize>,
    /// `usage.prompt_tokens` (chat template and image tokens included).
    pub prompt_tokens: Option<usize>,
    /// The streamed text.
    pub generated_text: String,
}

/// A server's base URL and a pooled HTTP/1.1 client for it.
#[derive(Debug, Clone)]
pub struct Http {
    client: Client<HttpConnector, Full<Bytes>>,
    base: String,
    /// `Authorization` value from `OPENAI_API_KEY`, read once.
    auth: Option<String>,
}

impl Http {
    /// A client for `http://host:port[/prefix]`.
    pub fn new(base_url: &str) -> Result<Self> {
        let base = base_url.trim_end_matches('/').to_string();
        let uri: Uri = base
            .parse()
            .map_err(|e| UsageError(format!("bad server URL {base:?}: {e}")))?;
        if uri.scheme_str() != Some("http") || uri.authority().is_none() {
            return Err(UsageError(format!(
                "bad server URL {base:?}: kvlens bench speaks plain HTTP, give http://HOST:PORT"
            ))
            .into());
        }
        Ok(Http {
            client: Client::builder(TokioExecutor::new()).build_http(),
            base,
            auth: std::env::var("OPENAI_API_KEY").ok().map(|key| format!("Bearer {key}")),
        })
    }

    /// The base URL joined with `path`.
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    fn request(
        &self,
        method: Method,
        path: &str,
        body: Bytes,
        request_id: Option<&str>,
    ) -> Result<Request<Full<Bytes>>> {
        let mut req = Request::builder()
            .method(method)
            .uri(self.url(path))
            .header("content-type", "application/json");
        if let Some(auth) = &self.auth {
            req = req.header("authorization", auth);
        }
        if let Some(id) = request_id {
            req = req.header("x-request-id", id);
        }
        Ok(req.body(Full::new(body))?)
    }

    /// Sends one request. A connection the server closed before any byte of the answer is tried
    /// once more on a new one, as browsers do on a reused connection: llama-server closes its
    /// connection after every streamed answer while it announces keep-alive, and the pooled
    /// connection can be handed out before the close is seen.
    async fn send(
        &self,
        method: Method,
        path: &str,
        body: Bytes,
        request_id: Option<&str>,
    ) -> Result<Response<Incoming>> {
        let first = self
            .client
            .request(self.request(method.clone(), path, body.clone(), request_id)?)
            .await;
        let resp = match first {
            Err(e) if closed_before_answer(&e) => {
                self.client.request(self.request(method, path, body, request_id)?).await
            }
            other => other,
        };
        resp.with_context(|| format!("cannot reach {}", self.url(path)))
    }

    /// `GET path`: the status and the whole body. Fails only when the server cannot be reached.
    pub async fn get(&self, path: &str) -> Result<(StatusCode, Bytes)> {
        self.call(Method::GET, path, Bytes::new()).await
    }

    /// `POST path` without a body (the reset endpoints), like [`Http::get`].
    pub async fn post(&self, path: &str) -> Result<(StatusCode, Bytes)> {
        self.call(Method::POST, path, Bytes::new()).await
    }

    /// `POST path` with a JSON body, like [`Http::get`].
    pub async fn post_json(&self, path: &str, body: &Value) -> Result<(StatusCode, Bytes)> {
        self.call(Method::POST, path, Bytes::from(body.to_string())).await
    }

    async fn call(&self, method: Method, path: &str, body: Bytes) -> Result<(StatusCode, Bytes)> {
        let resp = self.send(method, path, body, None).await?;
        let status = resp.status();
        let body = resp.into_body().collect().await?.to_bytes();
        Ok((status, body))
    }

    /// `POST path` with a JSON body: the status and the body, unread, to read as far as wanted.
    pub async fn open(&self, path: &str, body: Bytes) -> Result<(StatusCode, Incoming)> {
        let resp = self.send(Method::POST, path, body, None).await?;
        Ok((resp.status(), resp.into_body()))
    }

    /// The first model `/v1/models` lists (what vLLM does without `--model`).
    pub async fn first_model(&self) -> Result<String> {
        let (status, body) = self.get("/v1/models").await?;
        let models: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        match models.pointer("/data/0/id").and_then(Value::as_str) {
            Some(id) if status.is_success() => Ok(id.to_string()),
            _ => bail!("{} lists no model ({status}): pass --model", self.url("/v1/models")),
        }
    }

    /// Sends one streaming chat completion and measures it; `t0` is the benchmark's start. Never
    /// fails: a failure is an output with `success: false`, as in vLLM.
    pub async fn chat(&self, endpoint: &str, payload: Bytes, request_id: &str, t0: Instant) -> RequestOutput {
        let st = Instant::now();
        let mut rec = Recorder::new(st.duration_since(t0).as_secs_f64());
        match self.stream(endpoint, payload, request_id, st, &mut rec).await {
            Ok(()) => rec.out.success = true,
            Err(e) => rec.out.error = format!("{e:#}"),
        }
        rec.out
    }

    async fn stream(
        &self,
        endpoint: &str,
        payload: Bytes,
        request_id: &str,
        st: Instant,
        rec: &mut Recorder,
    ) -> Result<()> {
        let resp = self.send(Method::POST, endpoint, payload, Some(request_id)).await?;
        let status = resp.status();
        let mut body = resp.into_body();
        if status != StatusCode::OK {
            let text = body.collect().await.map(|b| b.to_bytes()).unwrap_or_default();
            let text = String::from_utf8_lossy(&text[..text.len().min(300)]).into_owned();
            bail!("{status}: {}", text.trim());
        }
        let mut sse = SseLines::default();
        while let Some(frame) = body.frame().await {
            let Ok(data) = frame?.into_data() else { continue };
            let now = st.elapsed().as_secs_f64();
            for payload in sse.push(&data) {
                rec.on_data(&payload, now)?;
            }
        }
        Ok(())
    }
}

/// Whether a request failed because the connection closed before any byte of the answer came.
fn closed_before_answer(e: &hyper_util::client::legacy::Error) -> bool {
    std::error::Error::source(e)
        .and_then(|s| s.downcast_ref::<hyper::Error>())
        .is_some_and(hyper::Error::is_incomplete_message)
}

/// vLLM's openai-chat payload: the text then the image, greedy, `max_completion_tokens`, streamed
/// with a usage chunk.
pub fn chat_payload(model: &str, req: &BenchRequest, ignore_eos: bool) -> Bytes {
    let mut content = vec![json!({"type": "text", "text": req.prompt})];
    if let Some(url) = &req.image {
        content.push(json!({"type": "image_url", "image_url": {"url": &**url}}));
    }
    let mut payload = json!({
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "temperature": 0.0,
        "max_completion_tokens": req.output_len,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    if ignore_eos {
        payload["ignore_eos"] = json!(true);
    }
    Bytes::from(payload.to_string())
}

/// vLLM's `wait_for_endpoint`: sends the first request until it succeeds (every 5 s) or the
/// timeout passes; returns the last output.
pub async fn wait_for_endpoint(http: &Http, endpoint: &str, payload: Bytes, timeout: Duration) -> RequestOutput {
    let deadline = Instant::now() + timeout;
    loop {
        let out = http
            .chat(endpoint, payload.clone(), "benchmark-serving-ready", Instant::now())
            .await;
        let left = deadline.saturating_duration_since(Instant::now());
        if out.success || left.is_zero() {
            return out;
        }
        tokio::time::sleep(left.min(Duration::from_secs(5))).await;
    }
}

/// Splits a server-sent-event byte stream into the payloads of its `data:` lines; comments
/// (`:` lines, often pings) and other fields are skipped.
#[derive(Debug, Default)]
pub struct SseLines {
    pending: Vec<u8>,
}

impl SseLines {
    /// Adds received bytes; returns the payloads of the `data:` lines they completed.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        self.pending.extend_from_slice(bytes);
        let mut payloads = Vec::new();
        while let Some(end) = self.pending.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.pending.drain(..=end).collect();
            let line = String::from_utf8_lossy(&line);
            if let Some(data) = line.trim_end_matches(['\r', '\n']).strip_prefix("data:") {
                payloads.push(data.strip_prefix(' ').unwrap_or(data).to_string());
            }
        }
        payloads
    }
}

/// Folds a stream's data payloads into a [`RequestOutput`], timed in seconds since the send.
#[derive(Debug)]
struct Recorder {
    out: RequestOutput,
    first_seen: bool,
    last: f64,
}

impl Recorder {
    fn new(start_time: f64) -> Self {
        Recorder {
            out: RequestOutput {
                start_time,
                ..RequestOutput::default()
            },
            first_seen: false,
            last: 0.0,
        }
    }

    fn on_data(&mut self, payload: &str, now: f64) -> Result<()> {
        if payload == "[DONE]" {
            return Ok(());
        }
        let chunk: Value = serde_json::from_str(payload).with_context(|| format!("bad stream chunk {payload:.200}"))?;
        let choices = chunk.get("choices").and_then(Value::as_array).filter(|c| !c.is_empty());
        if let Some(choices) = choices {
            if self.first_seen {
                self.out.itl.push(now - self.last);
            } else {
                self.first_seen = true;
                self.out.ttft = now;
            }
            let text = choices[0].pointer("/delta/content").and_then(Value::as_str);
            self.out.generated_text.push_str(text.unwrap_or_default());
        } else if let Some(usage) = chunk.get("usage").filter(|u| u.is_object()) {
            let count = |k: &str| usage.get(k).and_then(Value::as_u64).map(|n| n as usize);
            self.out.output_tokens = count("completion_tokens");
            self.out.prompt_tokens = count("prompt_tokens");
        }
        self.last = now;
        self.out.latency = now;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reads one request's head (the requests here have no body).
    async fn read_head(conn: &mut tokio::net::TcpStream) {
        use tokio::io::AsyncReadExt;
        let mut head = Vec::new();
        while !head.ends_with(b"\r\n\r\n") {
            let mut byte = [0];
            assert_eq!(conn.read(&mut byte).await.unwrap(), 1, "the client closed early");
            head.push(byte[0]);
        }
    }

    #[tokio::test]
    async fn a_connection_closed_before_the_answer_is_tried_once_on_a_new_one() {
        use tokio::io::AsyncWriteExt;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let http = Http::new(&format!("http://{}", listener.local_addr().unwrap())).unwrap();
        let server = tokio::spawn(async move {
            // As llama-server after a stream: keep-alive announced, the next request read and
            // the connection closed without an answer.
            let (mut first, _) = listener.accept().await.unwrap();
            read_head(&mut first).await;
            first
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nkeep-alive: timeout=5\r\n\r\nok")
                .await
                .unwrap();
            read_head(&mut first).await;
            drop(first);
            let (mut second, _) = listener.accept().await.unwrap();
            read_head(&mut second).await;
            second
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\nconnection: close\r\n\r\nagain")
                .await
                .unwrap();
            // A third connection that reads and closes, twice: the client gives up after one retry.
            for _ in 0..2 {
                let (mut conn, _) = listener.accept().await.unwrap();
                read_head(&mut conn).await;
            }
        });
        assert_eq!(http.get("/a").await.unwrap(), (StatusCode::OK, Bytes::from("ok")));
        assert_eq!(http.get("/b").await.unwrap(), (StatusCode::OK, Bytes::from("again")));
        let err = http.get("/c").await.unwrap_err();
        assert!(format!("{err:#}").contains("cannot reach"), "{err:#}");
        server.await.unwrap();
    }

    #[test]
    fn sse_lines_across_frames_skip_comments() {
        let mut sse = SseLines::default();
        assert!(sse.push(b": ping\n\nda").is_empty());
        assert_eq!(
            sse.push(b"ta: {\"a\":1}\r\n\r\ndata:[DONE]\n"),
            vec!["{\"a\":1}", "[DONE]"]
        );
        assert_eq!(sse.push(b"event: x\ndata: {}\n\n"), vec!["{}"]);
    }

    fn chunk(text: &str) -> String {
        json!({"choices": [{"index": 0, "delta": {"content": text}}]}).to_string()
    }

    #[test]
    fn recorder_times_chunks_like_vllm() {
        let mut rec = Recorder::new(2.5);
        rec.on_data(
            &json!({"choices": [{"delta": {"role": "assistant"}}]}).to_string(),
            0.25,
        )
        .unwrap();
        rec.on_data(&chunk("Hel"), 0.3).unwrap();
        rec.on_data(&chunk("lo"), 0.45).unwrap();
        let finish = json!({"choices": [{"delta": {}, "finish_reason": "length"}]});
        rec.on_data(&finish.to_string(), 0.5).unwrap();
        let usage = json!({"choices": [], "usage": {"prompt_tokens": 80, "completion_tokens": 3}});
        rec.on_data(&usage.to_string(), 0.55).unwrap();
        rec.on_data("[DONE]", 0.9).unwrap();
        let out = rec.out;
        assert_eq!(out.start_time, 2.5);
        assert_eq!(out.ttft, 0.25, "the role-only first chunk counts, as in vLLM");
        let want = [0.05, 0.15, 0.05];
        assert!(
            out.itl.iter().zip(want).all(|(a, b)| (a - b).abs() < 1e-12),
            "{:?}",
            out.itl
        );
        assert_eq!(out.latency, 0.55, "the usage chunk ends the request, [DONE] does not");
        assert_eq!((out.output_tokens, out.prompt_tokens), (Some(3), Some(80)));
        assert_eq!(out.generated_text, "Hello");
        assert!(Recorder::new(0.0).on_data("{not json", 0.1).is_err());
    }

    #[test]
    fn payload_is_vllms_openai_chat() {
        let req = BenchRequest {
            prompt: "What is this?".into(),
            prompt_len: 4,
            chat_text_len: 12,
            output_len: 32,
            image: Some("data:image/jpeg;base64,AAAA".into()),
        };
        let v: Value = serde_json::from_slice(&chat_payload("tiny", &req, true)).unwrap();
        assert_eq!(v["model"], "tiny");
        assert_eq!(v["messages"][0]["content"][0]["text"], "What is this?");
        assert_eq!(
            v["messages"][0]["content"][1]["image_url"]["url"],
            "data:image/jpeg;base64,AAAA"
        );
        assert_eq!(v["max_completion_tokens"], 32);
        assert_eq!(v["stream_options"]["include_usage"], true);
        assert_eq!(
            (v["temperature"].as_f64(), v["ignore_eos"].as_bool()),
            (Some(0.0), Some(true))
        );
        let plain: Value = serde_json::from_slice(&chat_payload("m", &req, false)).unwrap();
        assert!(plain.get("ignore_eos").is_none());
    }

    #[test]
    fn only_plain_http_urls() {
        assert!(Http::new("https://example.com").is_err());
        assert!(Http::new("localhost:8000").is_err());
        assert_eq!(
            Http::new("http://127.0.0.1:8000/").unwrap().url("/v1/memory"),
            "http://127.0.0.1:8000/v1/memory"
        );
    }
}
