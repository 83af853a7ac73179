//! `kvlens serve`: the OpenAI-compatible API (vLLM's flags, endpoints, log lines and metrics), the
//! memory endpoints and the playground's static files.
//!
//! The port is bound first and answers 503 while a thread loads, profiles and sizes the engine;
//! that thread then becomes the engine thread ([`engine_loop`]), which owns the engine and talks to
//! the HTTP handlers over channels.

mod args;
mod engine_loop;
pub(crate) mod errors;
mod generate;
mod listener;
mod media;
mod memory;
mod metrics;
mod openai;
mod site;
mod subscribers;
mod tokenize;

pub use args::{strip_ignored_vllm_flags, ServeArgs};
pub(crate) use engine_loop::occupancy_of;

use crate::kv_events;
use crate::runtime::Frontend;
use crate::startup::{self, EngineArgs, Started};
use crate::UsageError;
use anyhow::{Context, Result};
use axum::extract::State;
use axum::handler::HandlerWithoutStateExt;
use axum::http::{header, HeaderName, HeaderValue, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, get_service, post};
use axum::Router;
use engine_loop::{EngineHandle, EngineLoop, Observe};
use errors::{json_response, ApiError};
use kvlens_engine::occupancy::Occupancy;
use listener::ConnectionLimits;
use metrics::{Gauges, Metrics};
use serde_json::json;
use site::SiteRules;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use subscribers::Subscribers;
use tokio::sync::{oneshot, watch};
use tower_http::services::{ServeDir, ServeFile};
use tower_http::set_header::SetResponseHeaderLayer;

/// How often a shutdown drain looks whether the requests in flight have finished.
const DRAIN_POLL: Duration = Duration::from_millis(50);
/// Longest value the duration flags take.
const MAX_FLAG_DURATION: Duration = Duration::from_secs(24 * 3600);
/// Largest `--max-connections` (tokio's semaphore holds at most this many permits).
const MAX_CONNECTIONS: usize = tokio::sync::Semaphore::MAX_PERMITS;

/// How long in-flight connections get to close after SIGINT/SIGTERM.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// Shared by every handler.
#[derive(Debug)]
pub struct App {
    /// Set once the engine has started.
    ready: OnceLock<Ready>,
    /// `--api-key`.
    api_key: Option<String>,
    /// Fetches the image URLs of `--allowed-media-domains`.
    media: media::MediaFetcher,
    /// Set on SIGINT/SIGTERM: new requests are refused while those in flight finish.
    draining: AtomicBool,
    /// Generation requests received and not yet in the engine (read, fetched, preprocessed).
    before_engine: AtomicUsize,
    /// `--body-timeout`.
    body_timeout: Duration,
    /// The memory stream's subscribers (`--max-stream-subscribers`).
    subscribers: Arc<Subscribers>,
    /// The `Host` check (`--allowed-hosts`).
    site: SiteRules,
}

/// The running engine as the handlers see it.
#[derive(Debug)]
pub struct Ready {
    /// Commands for the engine thread.
    engine: EngineHandle,
    /// Template, tokenizer, image processing.
    frontend: Arc<Frontend>,
    /// The latest published occupancy.
    occupancy: watch::Receiver<Arc<Occupancy>>,
    /// Request latencies and counts.
    metrics: Arc<Metrics>,
    /// `--served-model-name` (or the model path).
    served_model_names: Vec<String>,
    /// The effective max_model_len.
    max_model_len: usize,
    /// The checkpoint directory.
    model_root: String,
    /// `/server_info`.
    info: serde_json::Value,
    /// Unix seconds when the engine became ready.
    created: u64,
}

impl App {
    /// The engine, or 503 while it loads.
    fn ready(&self) -> Result<&Ready, ApiError> {
        self.ready
            .get()
            .ok_or_else(|| ApiError::unavailable("the model is still loading"))
    }

    /// The engine for a new generation request: 503 while loading or shutting down.
    fn accepting(&self) -> Result<&Ready, ApiError> {
        if self.draining.load(Ordering::Relaxed) {
            return Err(ApiError::unavailable("the server is shutting down"));
        }
        self.ready()
    }
}

/// Seconds since the Unix epoch (OpenAI's `created`).
fn unix_seconds() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// Runs the server until SIGINT or SIGTERM.
pub fn run(args: &ServeArgs) -> Result<()> {
    let mut engine_args = args.engine.clone();
    if let Some(model) = &args.model_tag {
        engine_args.model = Some(model.clone());
    }
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(serve(args, engine_args))
}

async fn serve(args: &ServeArgs, engine_args: EngineArgs) -> Result<()> {
    let media = media::MediaFetcher::new(args.allowed_media_domains.clone(), args.media_ca_file.as_deref())?;
    let cors = args.cors()?;
    let listener = listener::listen(&args.host, args.port)
        .await
        .map_err(|e| UsageError(format!("cannot listen on {}:{}: {e}", args.host, args.port)))?;
    let local = listener.local_addr()?;
    if !local.ip().is_loopback() && args.api_key.is_none() {
        tracing::warn!(
            "listening on {} without --api-key: anyone who can reach this address can use the API",
            local.ip()
        );
    }
    let seconds = |flag: &str, value: f64, zero_ok: bool| {
        Duration::try_from_secs_f64(value)
            .ok()
            .filter(|t| (zero_ok || !t.is_zero()) && *t <= MAX_FLAG_DURATION)
            .ok_or_else(|| {
                UsageError(format!(
                    "{flag} must be {} seconds up to one day, got {value}",
                    if zero_ok { "0 or more" } else { "positive" }
                ))
            })
    };
    if !(1..=MAX_CONNECTIONS).contains(&args.max_connections) {
        return Err(UsageError(format!(
            "--max-connections must be 1 to {MAX_CONNECTIONS}, got {}",
            args.max_connections
        ))
        .into());
    }
    let limits = ConnectionLimits {
        max_connections: args.max_connections,
        header_timeout: seconds("--header-timeout", args.header_timeout, false)?,
        shutdown_grace: SHUTDOWN_GRACE,
    };
    let shutdown_timeout = seconds("--shutdown-timeout", args.shutdown_timeout, true)?;
    let body_timeout = seconds("--body-timeout", args.body_timeout, false)?;
    if args.max_stream_subscribers == 0 {
        return Err(UsageError("--max-stream-subscribers must be at least 1".into()).into());
    }
    listener::raise_open_file_limit(args.max_connections);
    let app = Arc::new(App {
        ready: OnceLock::new(),
        api_key: args.api_key.clone(),
        media,
        draining: AtomicBool::new(false),
        before_engine: AtomicUsize::new(0),
        body_timeout,
        subscribers: Arc::new(Subscribers::new(args.max_stream_subscribers)),
        site: SiteRules::new(local.ip().is_loopback(), &args.allowed_hosts.0),
    });
    let (stop_server, stopped) = oneshot::channel::<()>();
    let server = tokio::spawn(listener::serve(
        listener,
        router(app.clone(), &args.playground_dir).layer(cors),
        limits,
        async {
            let _ = stopped.await;
        },
    ));
    tracing::info!("Starting vLLM API server on http://{local}");
    let mut flags = serde_json::to_value(args)?;
    flags["api_key"] = json!(args.api_key.as_ref().map(|_| "<set>"));
    let kv_events = match args.kv_events_config.as_ref().filter(|c| c.publishes()) {
        Some(config) => {
            if args.engine.no_enable_prefix_caching {
                tracing::warn!(
                    "--kv-events-config with --no-enable-prefix-caching: blocks get no hashes, so no events are published"
                );
            }
            tracing::info!("Starting ZMQ publisher thread");
            let (sink, bound) = kv_events::publisher::start(config).await?;
            tracing::info!(
                "KV cache events published on {}{}",
                bound.endpoint,
                bound
                    .replay_endpoint
                    .map(|r| format!(" (replay on {r})"))
                    .unwrap_or_default()
            );
            Some(sink)
        }
        None => None,
    };
    let observe = Observe {
        kv_events,
        kv_cache_metrics_sample: args.kv_cache_metrics.then_some(args.kv_cache_metrics_sample),
    };
    let loading = spawn_engine(engine_args, flags, observe)?;
    let signal = shutdown_signal();
    tokio::pin!(signal);
    let loaded = tokio::select! {
        loaded = loading => loaded.unwrap_or_else(|_| Err(anyhow::anyhow!("the engine thread ended during start-up"))),
        () = &mut signal => {
            tracing::info!("Shutting down while the model loads");
            return Ok(());
        }
    };
    match loaded {
        Ok(ready) => {
            let _ = app.ready.set(ready);
            tracing::info!("Application startup complete.");
        }
        Err(e) => {
            let _ = stop_server.send(());
            return Err(e);
        }
    }
    signal.await;
    app.draining.store(true, Ordering::Relaxed);
    if let Ok(ready) = app.ready() {
        drain(&app, ready, shutdown_timeout).await;
        ready.engine.shutdown();
    }
    let _ = stop_server.send(());
    if let Err(e) = server.await {
        tracing::warn!("the HTTP server task failed: {e}");
    }
    Ok(())
}

/// Waits up to `timeout` (`--shutdown-timeout`) for the requests in flight to finish: those in
/// the engine and those still being read, fetched or preprocessed. A second signal stops waiting.
async fn drain(app: &App, ready: &Ready, timeout: Duration) {
    // A fresh snapshot each time: the published one may be up to one interval old.
    let idle = || async {
        app.before_engine.load(Ordering::Relaxed) == 0
            && ready
                .engine
                .snapshot()
                .await
                .map_or(true, |o| o.engine.num_running == 0 && o.engine.num_waiting == 0)
    };
    if idle().await {
        return;
    }
    if !timeout.is_zero() {
        tracing::info!(
            "Shutting down: waiting up to {} s for the requests in flight (--shutdown-timeout)",
            timeout.as_secs_f64()
        );
        let finished = async {
            while !idle().await {
                tokio::time::sleep(DRAIN_POLL).await;
            }
        };
        tokio::select! {
            done = tokio::time::timeout(timeout, finished) => if done.is_ok() {
                return;
            },
            () = shutdown_signal() => tracing::info!("Second signal: not waiting any longer"),
        }
    }
    tracing::info!("Shutting down: aborting the requests in flight");
}

/// Starts the engine on its own thread; the receiver gets the ready engine or the start-up error.
fn spawn_engine(
    args: EngineArgs,
    flags: serde_json::Value,
    observe: Observe,
) -> Result<oneshot::Receiver<Result<Ready>>> {
    let (tx, rx) = oneshot::channel();
    std::thread::Builder::new()
        .name("engine".into())
        .spawn(move || {
            let started = match startup::start(&args) {
                Ok(s) => s,
                Err(e) => {
                    let _ = tx.send(Err(e));
                    return;
                }
            };
            let Started {
                engine,
                frontend,
                served_model_names,
                model_dir,
                plan,
                profile,
                log_lines,
            } = started;
            let info = json!({
                "version": env!("CARGO_PKG_VERSION"),
                "model": model_dir,
                "served_model_names": served_model_names,
                "flags": flags,
                "plan": plan,
                "profile": profile,
                "log_lines": log_lines,
            });
            let frontend = Arc::new(frontend);
            let cache_config = vec![
                ("block_size", plan.block_size.to_string()),
                ("cache_dtype", args.vllm.kv_cache_dtype.clone()),
                (
                    "enable_prefix_caching",
                    python_bool(engine.config().enable_prefix_caching),
                ),
                ("gpu_memory_utilization", plan.gpu_memory_utilization.to_string()),
                ("kv_cache_size_tokens", plan.kv_cache_tokens.to_string()),
                (
                    "kv_cache_memory_bytes",
                    args.kv_cache_memory_bytes.map_or("None".into(), |b| b.to_string()),
                ),
                ("num_cpu_blocks", "None".into()),
            ];
            let metrics = Arc::new(Metrics::new(observe.kv_cache_metrics_sample.is_some(), cache_config));
            let (engine_loop, engine, occupancy) = EngineLoop::new(engine, frontend.clone(), metrics.clone(), observe);
            let ready = Ready {
                engine,
                frontend,
                occupancy,
                metrics,
                served_model_names,
                max_model_len: plan.max_model_len,
                model_root: model_dir.display().to_string(),
                info,
                created: unix_seconds(),
            };
            if tx.send(Ok(ready)).is_ok() {
                engine_loop.run();
            }
        })
        .context("cannot start the engine thread")?;
    Ok(rx)
}

/// A boolean as Python's `str()` writes it (vLLM's info labels).
fn python_bool(b: bool) -> String {
    if b { "True" } else { "False" }.into()
}

/// Resolves on SIGINT (Ctrl-C) or SIGTERM.
async fn shutdown_signal() {
    let interrupt = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = interrupt => {}
        () = terminate => {}
    }
}

/// Every route; the playground (or a short text page) at / and its planner page at /planner, JSON
/// 404 for anything else.
fn router(app: Arc<App>, playground: &Path) -> Router {
    let routes = Router::new()
        .route("/health", get(health))
        .route("/version", get(version))
        .route("/metrics", get(prometheus))
        .route("/server_info", get(memory::server_info))
        .route("/v1/models", get(models))
        .route("/v1/chat/completions", post(generate::chat_completions))
        .route("/v1/completions", post(generate::completions))
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .route("/v1/memory", get(memory::memory))
        .route("/v1/memory/stream", get(memory::memory_stream))
        .route("/reset_prefix_cache", post(memory::reset_prefix_cache))
        .route("/reset_mm_cache", post(memory::reset_mm_cache))
        .route("/reset_encoder_cache", post(memory::reset_encoder_cache));
    let routes = if playground.is_dir() {
        // The playground is one page that picks its view from the path.
        let page = get_service(ServeFile::new(playground.join("index.html")));
        routes
            .route("/planner", page.clone())
            .route("/planner/", page.clone())
            .route("/lessons", page.clone())
            .route("/lessons/", page.clone())
            .route("/lessons/{name}", page)
            .fallback_service(ServeDir::new(playground).not_found_service(not_found.into_service()))
            // Cross-origin isolated, so that the tab's CPU backend may share memory with its
            // helper workers (`SharedArrayBuffer`).
            .layer(SetResponseHeaderLayer::if_not_present(
                HeaderName::from_static("cross-origin-opener-policy"),
                HeaderValue::from_static("same-origin"),
            ))
            .layer(SetResponseHeaderLayer::if_not_present(
                HeaderName::from_static("cross-origin-embedder-policy"),
                HeaderValue::from_static("require-corp"),
            ))
    } else {
        routes.route("/", get(no_playground)).fallback(not_found)
    };
    // Last: it applies to the routes added before it.
    routes
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(app.clone(), auth))
        .layer(middleware::from_fn_with_state(app.clone(), site_checks))
        .with_state(app)
}

/// Byte strings compared in time that does not depend on where they differ.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Paths that stay open with `--api-key`: `/health`, `/metrics`, `/version` and the playground's
/// files. Stricter than vLLM, which guards only `/v1/*`: the resets, `/server_info` and
/// `/tokenize` change state or reveal the setup.
fn open_path(path: &str) -> bool {
    !(path.starts_with("/v1")
        || path.starts_with("/reset_")
        || ["/server_info", "/tokenize", "/detokenize"].contains(&path))
}

/// With `--api-key`: 401 on /v1/*, the resets, /server_info and the tokenizer routes without
/// `Authorization: Bearer KEY`.
async fn auth(State(app): State<Arc<App>>, req: axum::extract::Request, next: Next) -> Response {
    if let Some(key) = &app.api_key {
        if !open_path(req.uri().path()) {
            let given = req
                .headers()
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "));
            if !given.is_some_and(|g| same_secret(g.as_bytes(), key.as_bytes())) {
                return ApiError::unauthorized().into_response();
            }
        }
    }
    next.run(req).await
}

/// 403 for a `Host` this server does not answer to and for a cross-origin POST a browser sent
/// without a preflight ([`site`]).
async fn site_checks(State(app): State<Arc<App>>, req: axum::extract::Request, next: Next) -> Response {
    let host = req.headers().get(header::HOST).and_then(|v| v.to_str().ok());
    if !app.site.host_allowed(host) {
        return ApiError::forbidden(format!(
            "this server does not answer to the host {:?}: it listens on a loopback address (a page whose domain \
             points at this machine must not reach it); add the name to --allowed-hosts to allow it",
            host.unwrap_or_default()
        ))
        .into_response();
    }
    if site::unasked_cross_site_post(req.method(), req.headers()) {
        return ApiError::forbidden(
            "a POST from another origin must be sent as Content-Type: application/json, so that the browser \
             asks first under --allowed-origins",
        )
        .into_response();
    }
    next.run(req).await
}

async fn not_found(uri: Uri) -> ApiError {
    ApiError::not_found(uri.path())
}

async fn method_not_allowed(method: axum::http::Method, uri: Uri) -> ApiError {
    ApiError::method_not_allowed(&method, uri.path())
}

async fn no_playground() -> &'static str {
    "kvlens serve: the OpenAI-compatible API is at /v1 (chat/completions, completions, models, memory), \
     with /health, /metrics, /server_info, /tokenize, /detokenize and /v1/memory/stream beside it. The playground is not built: \
     `cargo xtask demo` builds it into dist/ (or pass --playground-dir).\n"
}

/// `GET /health`: 200 while the engine runs, 503 before it starts, while shutting down and after its
/// thread ended.
async fn health(State(app): State<Arc<App>>) -> Response {
    match app.accepting() {
        // The engine thread owns the snapshot sender: a closed channel means it has stopped.
        Ok(ready) if ready.occupancy.has_changed().is_err() => {
            ApiError::unavailable("the engine has stopped").into_response()
        }
        Ok(_) => StatusCode::OK.into_response(),
        Err(e) => e.into_response(),
    }
}

/// `GET /version`.
async fn version() -> Response {
    json_response(StatusCode::OK, &json!({"version": env!("CARGO_PKG_VERSION")}))
}

/// `GET /v1/models`: the served names, with vLLM's `max_model_len`.
async fn models(State(app): State<Arc<App>>) -> Response {
    let ready = match app.ready() {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let data: Vec<serde_json::Value> = ready
        .served_model_names
        .iter()
        .map(|name| {
            json!({
                "id": name,
                "object": "model",
                "created": ready.created,
                "owned_by": "kvlens",
                "root": ready.model_root,
                "parent": null,
                "max_model_len": ready.max_model_len,
                "permission": [],
            })
        })
        .collect();
    json_response(StatusCode::OK, &json!({"object": "list", "data": data}))
}

/// `GET /metrics`: Prometheus text.
async fn prometheus(State(app): State<Arc<App>>) -> Response {
    let ready = match app.ready() {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let occupancy = ready.occupancy.borrow().clone();
    let (processor_cache_bytes, processor_cache_entries, processor_cache_stats) = {
        let cache = ready.frontend.processor_cache.lock().unwrap_or_else(|p| p.into_inner());
        (cache.bytes_used(), cache.len(), cache.stats())
    };
    let text = ready.metrics.render(
        &ready.served_model_names[0],
        &Gauges {
            occupancy: &occupancy,
            processor_cache_bytes,
            processor_cache_entries,
            processor_cache_stats,
        },
    );
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
        text,
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_compare_whole() {
        assert!(same_secret(b"key", b"key"));
        assert!(!same_secret(b"key", b"kez"));
        assert!(!same_secret(b"key", b"key2"));
    }
}
