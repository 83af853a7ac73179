//! `POST /v1/chat/completions` and `POST /v1/completions`: read and check the request, fetch the
//! allowed remote images, preprocess off the async workers (`spawn_blocking`: template, tokenizer,
//! image decoding), queue it on the engine thread, and answer in one piece or as Server-Sent
//! Events. The engine request lives as long as its [`Subscription`]: a client that goes away drops
//! it, which aborts the request.

use super::engine_loop::{Subscription, Update};
use super::errors::ApiError;
use super::listener::Conn;
use super::media::resolve_remote_images;
use super::openai::{ChatRequest, CompletionRequest, Job, Kind, Spec};
use super::{unix_seconds, App, Ready};
use crate::preprocess::{Busy, PreprocessBudget, Reserved};
use crate::runtime::{Cancel, Frontend};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, HeaderMap};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use kvlens_engine::engine::{FinishReason, Request};
use kvlens_engine::input::tokenizer::Tokenizer;
use kvlens_engine::memory::ledger::Category;
use kvlens_engine::output::{Delta, Output, TokenLogprobs};
use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// Largest request body read.
pub const MAX_BODY_BYTES: usize = 64 << 20;

/// Bodies over the limit are still read (and dropped) up to this size, so that the client, which
/// sends its whole body before it reads, sees the 413 rather than a reset connection.
const DRAIN_BYTES: usize = 1 << 30;

/// Whether a request's `Content-Type` is JSON (`application/json`, any parameters).
pub fn is_json(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|mime| mime.trim().eq_ignore_ascii_case("application/json"))
}

/// Reads a JSON body: 415 unless its `Content-Type` is `application/json` (as OpenAI answers; a
/// web page can send text, form and multipart bodies to any server without a CORS preflight),
/// 413 over [`MAX_BODY_BYTES`], 408 when it takes longer than `--body-timeout` (a slow body would
/// otherwise hold its connection for good), 503 when the host-memory budget stays full, 400 when
/// it is not valid JSON of type `T`. The bytes are reserved in `budget` as they arrive; the
/// returned reservation keeps the body's size (about what the parsed request holds) until the
/// caller drops it. While the body is read its connection counts as waiting on its client.
pub async fn read_json<'a, T: serde::de::DeserializeOwned>(
    app: &App,
    budget: &'a PreprocessBudget,
    request: axum::extract::Request,
) -> Result<(T, Reserved<'a>), ApiError> {
    if !is_json(request.headers()) {
        let given = request.headers().get(header::CONTENT_TYPE);
        return Err(ApiError::unsupported_media_type(
            given.map_or("none".into(), |v| String::from_utf8_lossy(v.as_bytes()).into_owned()),
        ));
    }
    let declared = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<usize>().ok());
    let _waiting = request.extensions().get::<Conn>().map(Conn::waiting_on_client);
    let mut held = budget.empty(Category::Requests);
    let read = async {
        let mut stream = request.into_body().into_data_stream();
        let mut buf: Vec<u8> = Vec::new();
        let mut total = 0usize;
        while let Some(chunk) = stream.next().await {
            let chunk: Bytes =
                chunk.map_err(|e| ApiError::bad_request(format!("cannot read the request body: {e}")))?;
            total += chunk.len();
            if total > MAX_BODY_BYTES {
                if total > DRAIN_BYTES {
                    break;
                }
                continue;
            }
            if total > buf.capacity() {
                // Grow as a Vec would, to the declared length at most, with the bytes reserved first.
                let cap = (buf.capacity() * 2)
                    .max(total)
                    .min(declared.unwrap_or(MAX_BODY_BYTES).max(total));
                held.grow_to(cap as u64)
                    .await
                    .map_err(|Busy(why)| ApiError::unavailable(why))?;
                buf.reserve_exact(cap - buf.len());
            }
            buf.extend_from_slice(&chunk);
        }
        if total > MAX_BODY_BYTES {
            return Err(ApiError::too_large(MAX_BODY_BYTES));
        }
        Ok(buf)
    };
    let buf = tokio::time::timeout(app.body_timeout, read)
        .await
        .map_err(|_| ApiError::request_timeout(app.body_timeout))??;
    let parsed =
        serde_json::from_slice(&buf).map_err(|e| ApiError::bad_request(format!("invalid request body: {e}")))?;
    held.shrink_to(buf.len() as u64);
    Ok((parsed, held))
}

/// Cancels its [`Cancel`] when dropped: a handler that holds one stops its request's tokenizing
/// and preprocessing when its client goes away (the handler's future is dropped).
#[derive(Debug, Default)]
pub struct CancelWhenDropped(pub Cancel);

impl Drop for CancelWhenDropped {
    fn drop(&mut self) {
        self.0.cancel();
    }
}

/// A fresh response id: `prefix-` and 32 hex digits.
fn new_id(prefix: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let state = std::collections::hash_map::RandomState::new();
    let a = std::hash::BuildHasher::hash_one(&state, n);
    let b = std::hash::BuildHasher::hash_one(&state, (n, a));
    format!("{prefix}-{a:016x}{b:016x}")
}

/// The model name a request names, checked against the served names, and its token ids checked
/// against the vocabulary (before any preprocessing is paid for).
fn model_name(ready: &Ready, asked: Option<&str>, spec: &Spec) -> Result<String, ApiError> {
    spec.params
        .validate_token_ids(ready.frontend.tokenizer.vocab_size())
        .map_err(ApiError::bad_request)?;
    served_model(ready, asked)
}

/// The model name a request names (the first served name when it names none); 404 for a name
/// that is not served.
pub fn served_model(ready: &Ready, asked: Option<&str>) -> Result<String, ApiError> {
    match asked {
        None => Ok(ready.served_model_names[0].clone()),
        Some(m) if ready.served_model_names.iter().any(|n| n == m) => Ok(m.to_string()),
        Some(m) => Err(ApiError::unknown_model(m)),
    }
}

/// A generation request between its arrival and the engine. While open it is counted in
/// [`App::before_engine`] (a shutdown drain waits for it); dropped open (its client left, the
/// handler was dropped) it is counted as cancelled before the queue. From the engine on, its
/// [`Subscription`] takes over.
struct BeforeEngine<'a> {
    app: &'a App,
    /// When the request arrived.
    arrived: Instant,
    open: AtomicBool,
}

impl<'a> BeforeEngine<'a> {
    fn new(app: &'a App) -> Self {
        app.before_engine.fetch_add(1, Ordering::Relaxed);
        BeforeEngine {
            app,
            arrived: Instant::now(),
            open: AtomicBool::new(true),
        }
    }

    /// The engine has the request, or it was answered without it; true if it was still open.
    fn close(&self) -> bool {
        let was_open = self.open.swap(false, Ordering::Relaxed);
        if was_open {
            self.app.before_engine.fetch_sub(1, Ordering::Relaxed);
        }
        was_open
    }
}

impl Drop for BeforeEngine<'_> {
    fn drop(&mut self) {
        if self.close() {
            if let Ok(ready) = self.app.ready() {
                ready.metrics.cancelled_before_queue();
            }
        }
    }
}

/// Why a conversation could not be preprocessed: 503 when the preprocessing budget stayed full
/// (the server is busy), else 400 (the request is wrong).
pub fn preprocessing_error(e: anyhow::Error) -> ApiError {
    match e.downcast_ref::<Busy>() {
        Some(busy) => ApiError::unavailable(busy.0.clone()),
        None => ApiError::bad_request(format!("{e:#}")),
    }
}

/// `POST /v1/chat/completions`.
pub async fn chat_completions(State(app): State<Arc<App>>, request: axum::extract::Request) -> Response {
    let arrival = BeforeEngine::new(&app);
    let cancel = CancelWhenDropped::default();
    let answer = async {
        let ready = app.accepting()?;
        let (req, mut held): (ChatRequest, _) = read_json(&app, &ready.frontend.preprocess_budget, request).await?;
        let spec = req.spec()?;
        let model = model_name(ready, req.common.model.as_deref(), &spec)?;
        let mut messages = req.messages;
        resolve_remote_images(&mut messages, &app.media, &mut held).await?;
        let id = new_id("chatcmpl");
        let frontend = ready.frontend.clone();
        let (engine_id, params, cancel) = (id.clone(), spec.params.clone(), cancel.0.clone());
        let request =
            tokio::task::spawn_blocking(move || frontend.request(&engine_id, &messages, params, false, &cancel))
                .await
                .map_err(|e| ApiError::internal(format!("preprocessing failed: {e}")))?
                .map_err(preprocessing_error)?
                .0;
        drop(held);
        run(ready, Kind::Chat, id, model, request, spec, &arrival).await
    };
    let response = answer.await.unwrap_or_else(IntoResponse::into_response);
    arrival.close();
    response
}

/// `POST /v1/completions`.
pub async fn completions(State(app): State<Arc<App>>, request: axum::extract::Request) -> Response {
    let arrival = BeforeEngine::new(&app);
    let cancel = CancelWhenDropped::default();
    let answer = async {
        let ready = app.accepting()?;
        let (req, held): (CompletionRequest, _) = read_json(&app, &ready.frontend.preprocess_budget, request).await?;
        let spec = req.spec()?;
        let model = model_name(ready, req.common.model.as_deref(), &spec)?;
        let prompt = req.prompt.into_text()?;
        let id = new_id("cmpl");
        let frontend = ready.frontend.clone();
        let (engine_id, params, cancel) = (id.clone(), spec.params.clone(), cancel.0.clone());
        let request =
            tokio::task::spawn_blocking(move || frontend.completion_request(&engine_id, &prompt, params, &cancel))
                .await
                .map_err(|e| ApiError::internal(format!("tokenizing failed: {e}")))?
                .map_err(preprocessing_error)?;
        drop(held);
        run(ready, Kind::Completion, id, model, request, spec, &arrival).await
    };
    let response = answer.await.unwrap_or_else(IntoResponse::into_response);
    arrival.close();
    response
}

/// Queues the request (closing its `arrival` once the engine has it) and answers it.
async fn run(
    ready: &Ready,
    kind: Kind,
    id: String,
    model: String,
    mut request: Request,
    spec: Spec,
    arrival: &BeforeEngine<'_>,
) -> Result<Response, ApiError> {
    // vLLM's default: whatever the context has left.
    request.params.max_tokens = spec
        .max_tokens
        .unwrap_or_else(|| ready.max_model_len.saturating_sub(request.prompt.len()).max(1));
    let job = Job {
        id,
        created: unix_seconds(),
        model,
        kind,
        prompt_ids: request.prompt.clone(),
        logprobs: spec.logprobs,
        return_token_ids: spec.return_token_ids,
    };
    let sub = ready
        .engine
        .add(request, Output::new(spec.stop, spec.include_stop), arrival.arrived)
        .await;
    arrival.close();
    let sub = sub?;
    if spec.stream {
        Ok(stream(job, sub, ready.frontend.clone(), spec.include_usage).into_response())
    } else {
        whole(job, sub, &ready.frontend.tokenizer).await
    }
}

/// The next delta of a request, or why there is none (with the request's last delta, which ends
/// it with `finish_reason: "error"`).
async fn next_delta(sub: &mut Subscription) -> Result<Delta, (ApiError, Delta)> {
    match sub.updates.recv().await {
        Some(Update::Delta(delta)) => {
            if delta.finish.is_some() {
                sub.finished();
            }
            Ok(delta)
        }
        Some(Update::Failed(e, last)) => {
            sub.finished();
            Err((e, last))
        }
        None => {
            sub.finished();
            let last = Delta {
                finish: Some(FinishReason::Error),
                ..Delta::default()
            };
            Err((ApiError::unavailable("the engine has stopped"), last))
        }
    }
}

/// Collects the whole answer.
async fn whole(job: Job, mut sub: Subscription, tok: &Tokenizer) -> Result<Response, ApiError> {
    let mut text = String::new();
    let mut tokens: Vec<TokenLogprobs> = Vec::new();
    let finish = loop {
        let delta = next_delta(&mut sub).await.map_err(|(e, _)| e)?;
        text.push_str(&delta.text);
        tokens.extend(delta.token);
        if let Some(reason) = delta.finish {
            break reason;
        }
    };
    let body = job.response(tok, &text, &tokens, finish);
    Ok(super::errors::json_response(axum::http::StatusCode::OK, &body))
}

/// The state of one SSE answer.
struct Streamer {
    job: Job,
    sub: Subscription,
    frontend: Arc<Frontend>,
    include_usage: bool,
    /// Tokens in the answer so far.
    num_tokens: usize,
    /// Events ready to send.
    pending: VecDeque<String>,
    first: bool,
    done: bool,
}

impl Streamer {
    /// Waits for the next token and turns it into events.
    async fn fill(&mut self) {
        let delta = match next_delta(&mut self.sub).await {
            Ok(d) => d,
            Err((e, last)) => {
                // The stream ends as a finished one does, with `finish_reason: "error"`, then the
                // error itself (vLLM's error event) and `[DONE]`.
                let chunk = self.job.chunk(&self.frontend.tokenizer, &last, self.first);
                self.pending.push_back(chunk.to_string());
                self.pending.push_back(e.body().to_string());
                self.pending.push_back("[DONE]".into());
                self.done = true;
                return;
            }
        };
        self.num_tokens += usize::from(delta.token.is_some());
        // Chunks with no text are sent only when they carry token ids or log-probabilities.
        let carries = self.job.return_token_ids || self.job.logprobs.is_some();
        if self.first || carries || !delta.text.is_empty() || delta.finish.is_some() {
            let chunk = self.job.chunk(&self.frontend.tokenizer, &delta, self.first);
            self.pending.push_back(chunk.to_string());
            self.first = false;
        }
        if delta.finish.is_some() {
            if self.include_usage {
                self.pending
                    .push_back(self.job.usage_chunk(self.num_tokens).to_string());
            }
            self.pending.push_back("[DONE]".into());
            self.done = true;
        }
    }
}

/// The SSE answer: one chunk per token, the usage chunk when asked for, then `[DONE]`.
fn stream(job: Job, sub: Subscription, frontend: Arc<Frontend>, include_usage: bool) -> impl IntoResponse {
    let state = Streamer {
        job,
        sub,
        frontend,
        include_usage,
        num_tokens: 0,
        pending: VecDeque::new(),
        first: true,
        done: false,
    };
    let events = futures_util::stream::unfold(state, |mut s| async move {
        loop {
            if let Some(data) = s.pending.pop_front() {
                return Some((Ok::<_, Infallible>(Event::default().data(data)), s));
            }
            if s.done {
                return None;
            }
            s.fill().await;
        }
    });
    Sse::new(events)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_unique() {
        let a = new_id("chatcmpl");
        assert!(a.starts_with("chatcmpl-") && a.len() == "chatcmpl-".len() + 32);
        assert_ne!(a, new_id("chatcmpl"));
    }
}
