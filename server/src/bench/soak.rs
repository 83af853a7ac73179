//! `kvlens bench soak`: many streaming clients against a kvlens server for a fixed time, with a
//! mix of text and image chats, clients that hang up mid-stream and requests with bad input. It
//! then waits for the server to fall idle and checks what must hold after any load: no KV block
//! in use, no encoder-cache reference held, resident memory no higher than under load after the
//! warm-up (within a tolerance),
//! every good request answered to its end and every bad one refused with a 4xx.

use super::client::{Http, SseLines};
use super::synth;
use anyhow::{bail, Result};
use http_body_util::BodyExt;
use hyper::body::Bytes;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Flags of `kvlens bench soak`.
#[derive(Debug, Clone, clap::Args)]
pub struct SoakArgs {
    /// Server URL (http://HOST:PORT).
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    base_url: String,
    /// Model name [default: the first one /v1/models lists].
    #[arg(long)]
    model: Option<String>,
    /// How long the clients keep sending, in seconds.
    #[arg(long, default_value_t = 600.0)]
    duration_s: f64,
    /// Clients sending at once, each one request after another.
    #[arg(long, default_value_t = 256)]
    concurrency: usize,
    /// Share of good requests whose client hangs up after the first chunk.
    #[arg(long, default_value_t = 0.2)]
    disconnect_ratio: f64,
    /// Share of requests with bad input (each must get a 4xx).
    #[arg(long, default_value_t = 0.05)]
    bad_ratio: f64,
    /// Share of good requests carrying an image.
    #[arg(long, default_value_t = 0.4)]
    image_ratio: f64,
    /// Most tokens a good request asks for.
    #[arg(long, default_value_t = 32)]
    max_tokens: usize,
    /// Seconds of load after which the server's resident memory is taken as the warm level: half
    /// the default run, since KV blocks and cache pages are first written over minutes (a 60 s
    /// warm level read 1,397 MiB where the same load plateaued at 1.6–1.85 GiB).
    #[arg(long, default_value_t = 300.0)]
    warmup_s: f64,
    /// How far resident memory after the run may lie above its level under load after the
    /// warm-up, in percent (more is a leak; less is memory the load no longer holds).
    #[arg(long, default_value_t = 5.0)]
    rss_tolerance_pct: f64,
    /// Seed of the request mix.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

/// What happened to the requests, counted by every client.
#[derive(Debug, Default)]
struct Counts {
    good_answered: AtomicU64,
    good_failed: AtomicU64,
    disconnected: AtomicU64,
    bad_refused: AtomicU64,
    bad_not_refused: AtomicU64,
}

/// Bodies the server must refuse with a 4xx.
fn bad_bodies(model: &str) -> Vec<Bytes> {
    let chat = |extra: Value| {
        let mut body = json!({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4});
        for (k, v) in extra.as_object().into_iter().flatten() {
            body[k] = v.clone();
        }
        Bytes::from(body.to_string())
    };
    vec![
        Bytes::from_static(b"{\"model\": \"x\", \"messages\": ["),
        chat(json!({"model": "no-such-model"})),
        chat(json!({"temperature": -1})),
        chat(json!({"max_tokens": 100_000_000})),
        chat(json!({"frequency_penalty": -3e38})),
        chat(json!({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,!!!"}}]}]})),
        chat(json!({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}}]}]})),
    ]
}

/// A good streamed chat, with one of `images` or without.
fn good_body(model: &str, image: Option<&str>, max_tokens: usize, rng: &mut StdRng) -> Bytes {
    let mut content =
        vec![json!({"type": "text", "text": format!("Request {}: describe what you see.", rng.random::<u32>())})];
    if let Some(url) = image {
        content.push(json!({"type": "image_url", "image_url": {"url": url}}));
    }
    Bytes::from(
        json!({
            "model": model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": rng.random_range(1..=max_tokens.max(1)),
            "temperature": 0.8,
            "stream": true,
        })
        .to_string(),
    )
}

/// Reads an SSE answer: to its end (true when it closed with a finish reason and `[DONE]`), or
/// only to its first data chunk when `hang_up`.
async fn read_stream(mut body: hyper::body::Incoming, hang_up: bool) -> Result<bool> {
    let (mut sse, mut finished) = (SseLines::default(), false);
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame?.into_data() else { continue };
        for payload in sse.push(&data) {
            if hang_up {
                return Ok(true);
            }
            if payload == "[DONE]" {
                return Ok(finished);
            }
            let chunk: Value = serde_json::from_str(&payload).unwrap_or(Value::Null);
            if chunk.get("error").is_some() {
                bail!("error event: {payload}");
            }
            finished |= chunk.pointer("/choices/0/finish_reason").is_some_and(|f| !f.is_null());
        }
    }
    Ok(false)
}

/// One client: requests one after another until the deadline.
async fn client(
    http: Http,
    model: Arc<str>,
    images: Arc<Vec<Arc<str>>>,
    a: SoakArgs,
    seed: u64,
    deadline: Instant,
    counts: Arc<Counts>,
) {
    let mut rng = StdRng::seed_from_u64(seed);
    let bad = bad_bodies(&model);
    while Instant::now() < deadline {
        if rng.random_bool(a.bad_ratio.clamp(0.0, 1.0)) {
            let body = bad[rng.random_range(0..bad.len())].clone();
            let refused = match http.open("/v1/chat/completions", body).await {
                Ok((status, body)) => {
                    let _ = body.collect().await;
                    status.is_client_error()
                }
                Err(_) => false,
            };
            let counter = if refused {
                &counts.bad_refused
            } else {
                &counts.bad_not_refused
            };
            counter.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        let image = (!images.is_empty() && rng.random_bool(a.image_ratio.clamp(0.0, 1.0)))
            .then(|| images[rng.random_range(0..images.len())].clone());
        let hang_up = rng.random_bool(a.disconnect_ratio.clamp(0.0, 1.0));
        let body = good_body(&model, image.as_deref(), a.max_tokens, &mut rng);
        let answered = match http.open("/v1/chat/completions", body).await {
            Ok((status, body)) if status.is_success() => read_stream(body, hang_up).await.unwrap_or(false),
            _ => false,
        };
        let counter = match (answered, hang_up) {
            (true, true) => &counts.disconnected,
            (true, false) => &counts.good_answered,
            (false, _) => &counts.good_failed,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// The figures the soak checks, from one `/v1/memory` reading.
#[derive(Debug, Clone, Copy)]
struct Reading {
    resident: u64,
    kv_in_use: u64,
    encoder_refs: u64,
    busy: bool,
}

async fn read(http: &Http) -> Result<Reading> {
    let (_, body) = http.get("/v1/memory").await?;
    let m: Value = serde_json::from_slice(&body)?;
    let n = |p: &str| m.pointer(p).and_then(Value::as_u64).unwrap_or(0);
    let Some(resident) = m.pointer("/process/resident_bytes").and_then(Value::as_u64) else {
        bail!("/v1/memory has no process.resident_bytes: is this a kvlens server on Linux?");
    };
    let encoder_refs = m
        .pointer("/encoder_cache/entries")
        .and_then(Value::as_array)
        .map_or(0, |e| {
            e.iter().map(|x| x["refs"].as_array().map_or(0, Vec::len) as u64).sum()
        });
    Ok(Reading {
        resident,
        kv_in_use: n("/kv/num_in_use"),
        encoder_refs,
        busy: n("/num_running") + n("/num_waiting") > 0,
    })
}

/// Runs the soak and prints its figures; fails when a check fails.
pub async fn run(a: &SoakArgs) -> Result<()> {
    let http = Http::new(&a.base_url)?;
    let model: Arc<str> = match &a.model {
        Some(m) => m.as_str().into(),
        None => http.first_model().await?.into(),
    };
    let mut rng = StdRng::seed_from_u64(a.seed);
    let images = Arc::new(synth::data_urls(&synth::plan(16, 0.0, &mut rng).images)?);
    let started = Instant::now();
    let deadline = started + Duration::from_secs_f64(a.duration_s);
    let counts = Arc::new(Counts::default());
    println!(
        "soak: {} clients for {} s against {} ({}% hang up, {}% bad input, {}% with an image)",
        a.concurrency,
        a.duration_s,
        a.base_url,
        a.disconnect_ratio * 100.0,
        a.bad_ratio * 100.0,
        a.image_ratio * 100.0
    );
    let clients: Vec<_> = (0..a.concurrency)
        .map(|i| {
            tokio::spawn(client(
                http.clone(),
                model.clone(),
                images.clone(),
                a.clone(),
                a.seed.wrapping_add(i as u64 + 1),
                deadline,
                counts.clone(),
            ))
        })
        .collect();
    tokio::time::sleep(Duration::from_secs_f64(a.warmup_s.min(a.duration_s))).await;
    let warm = read(&http).await?;
    for c in clients {
        c.await?;
    }
    let load_s = started.elapsed().as_secs_f64();
    // Wait for the engine to drain (aborted requests end at its next step).
    let idle_deadline = Instant::now() + Duration::from_secs(300);
    let after = loop {
        let r = read(&http).await?;
        if (!r.busy && r.kv_in_use == 0) || Instant::now() > idle_deadline {
            break r;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let c = |x: &AtomicU64| x.load(Ordering::Relaxed);
    let drift_pct = (after.resident as f64 - warm.resident as f64) / warm.resident.max(1) as f64 * 100.0;
    let checks = [
        (
            "KV blocks in use after the run",
            after.kv_in_use == 0,
            after.kv_in_use.to_string(),
        ),
        (
            "encoder-cache references held",
            after.encoder_refs == 0,
            after.encoder_refs.to_string(),
        ),
        (
            "resident memory after the run vs under load after warm-up",
            drift_pct <= a.rss_tolerance_pct,
            format!(
                "{:.1} MiB vs {:.1} MiB ({drift_pct:+.2} %)",
                after.resident as f64 / 1048576.0,
                warm.resident as f64 / 1048576.0
            ),
        ),
        (
            "good requests not answered",
            c(&counts.good_failed) == 0,
            c(&counts.good_failed).to_string(),
        ),
        (
            "bad requests not refused with a 4xx",
            c(&counts.bad_not_refused) == 0,
            c(&counts.bad_not_refused).to_string(),
        ),
    ];
    println!(
        "requests in {load_s:.0} s: {} answered, {} hung up mid-stream, {} bad refused with a 4xx",
        c(&counts.good_answered),
        c(&counts.disconnected),
        c(&counts.bad_refused)
    );
    let mut failed = 0;
    for (what, ok, figure) in &checks {
        println!("{} {what}: {figure}", if *ok { "ok  " } else { "FAIL" });
        failed += usize::from(!ok);
    }
    if failed > 0 {
        bail!("soak: {failed} check(s) failed");
    }
    println!("soak: every check passed");
    Ok(())
}
