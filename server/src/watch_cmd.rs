//! `kvlens watch`: reads a vLLM or vllm-ascend server's KV cache events (`--kv-events-config` on
//! its side) and its `/metrics`, and serves them to the playground, which draws the server's
//! prefix cache block by block beside the planner's figures for the same model and flags.
//!
//! Routes: `/server_info` (what is watched, and the plan), `/v1/watch` (a snapshot),
//! `/v1/watch/stream` (snapshots as server-sent events, at most ten a second), `/v1/watch/metrics`
//! (the server's `/metrics`, fetched here so the page needs no CORS from it), the playground at `/`.

use std::convert::Infallible;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result};
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, get_service};
use axum::Router;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use kvlens_engine::cache::KvWatch;
use kvlens_engine::memory::log_budget::HeaderSettings;
use kvlens_engine::memory::plan_inputs::PlanInputs;
use kvlens_engine::memory::planner::plan;
use kvlens_engine::memory::watch_check::PlannedKv;
use serde_json::json;
use tower_http::cors::CorsLayer;
use tower_http::services::{ServeDir, ServeFile};

use crate::kv_events::subscriber::{self, EventSource, Watched};
use crate::serve::errors::json_response;
use crate::usage;

/// How long the page may wait for the watched server's `/metrics`.
const METRICS_TIMEOUT: Duration = Duration::from_secs(5);

/// Snapshots sent per second at most.
const STREAM_INTERVAL: Duration = Duration::from_millis(100);

/// Flags of `kvlens watch`.
#[derive(Debug, clap::Args)]
pub struct WatchArgs {
    /// The server's KV event endpoint (vLLM's `endpoint`, e.g. tcp://host:5557; `*` reads as the
    /// local machine).
    #[arg(long, default_value = "tcp://127.0.0.1:5557")]
    pub events: String,
    /// Its replay endpoint (vLLM's `replay_endpoint`), to fill gaps and a late start.
    #[arg(long)]
    pub replay: Option<String>,
    /// The topic its events are published on (vLLM's `topic`).
    #[arg(long, default_value = "")]
    pub topic: String,
    /// The server's base URL, whose /metrics is shown beside the events (e.g. http://host:8000).
    #[arg(long)]
    pub metrics: Option<String>,
    /// Address the page is served on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port the page is served on (0 picks a free one; the start-up line names it).
    #[arg(long, default_value_t = 8001)]
    pub port: u16,
    /// Directory with the built playground.
    #[arg(long, default_value = "dist")]
    pub playground_dir: PathBuf,
    /// The deployment to plan for (its model and vLLM flags), shown beside what the server
    /// reports; nothing is planned without --model.
    #[command(flatten)]
    pub plan: PlanInputs,
}

struct Watch {
    watched: Watched,
    info: serde_json::Value,
    metrics_url: Option<String>,
}

/// `*` (bind any interface) as a place to connect to: this machine.
fn reachable(endpoint: &str) -> String {
    endpoint.replacen("://*:", "://127.0.0.1:", 1)
}

/// Runs `kvlens watch`.
pub fn run(a: &WatchArgs) -> Result<()> {
    for e in std::iter::once(&a.events).chain(&a.replay) {
        if !e.starts_with("tcp://") || e.rsplit(':').next().is_none_or(|p| p.parse::<u16>().is_err()) {
            return Err(usage(format!("{e:?} is not a tcp://HOST:PORT endpoint")));
        }
    }
    let planned = match &a.plan.model {
        Some(_) => {
            let req = a
                .plan
                .request(&HeaderSettings::default(), crate::plan_cmd::load_model)
                .map_err(|e| usage(e.to_string()))?;
            Some(PlannedKv::from(&plan(&req).map_err(|e| usage(e.to_string()))?))
        }
        None => None,
    };
    let source = EventSource {
        endpoint: reachable(&a.events),
        replay: a.replay.as_deref().map(reachable),
        topic: a.topic.clone(),
    };
    let metrics_url = a
        .metrics
        .as_ref()
        .map(|m| format!("{}/metrics", m.trim_end_matches('/').trim_end_matches("/metrics")));
    let info = json!({
        "version": env!("CARGO_PKG_VERSION"),
        "watch": {
            "events": source.endpoint,
            "replay": source.replay,
            "topic": source.topic,
            "metrics": metrics_url,
        },
        "planned": planned,
    });
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async move {
        let (changed, _) = tokio::sync::watch::channel(0);
        let watched = Watched {
            state: Arc::new(Mutex::new(KvWatch::default())),
            changed,
        };
        tokio::spawn(subscriber::run(source, watched.clone()));
        let state = Arc::new(Watch {
            watched,
            info,
            metrics_url,
        });
        let listener = tokio::net::TcpListener::bind((a.host.as_str(), a.port))
            .await
            .map_err(|e| usage(format!("cannot listen on {}:{}: {e}", a.host, a.port)))?;
        tracing::info!("Watch page on http://{}", listener.local_addr()?);
        axum::serve(listener, router(state, &a.playground_dir))
            .with_graceful_shutdown(async {
                let _ = tokio::signal::ctrl_c().await;
            })
            .await
            .context("the watch page's server failed")
    })
}

fn router(state: Arc<Watch>, playground: &std::path::Path) -> Router {
    let routes = Router::new()
        .route(
            "/server_info",
            get(|State(w): State<Arc<Watch>>| async move { json_response(StatusCode::OK, &w.info) }),
        )
        .route("/v1/watch", get(snapshot))
        .route("/v1/watch/stream", get(stream))
        .route("/v1/watch/metrics", get(metrics));
    let routes = if playground.is_dir() {
        // The page's other views are there too (its navigation links to them).
        let page = get_service(ServeFile::new(playground.join("index.html")));
        ["/", "/planner", "/lessons", "/lessons/{name}"]
            .into_iter()
            .fold(routes, |r, path| r.route(path, page.clone()))
            .fallback_service(ServeDir::new(playground))
    } else {
        routes.route(
            "/",
            get(|| async { "kvlens watch: the playground is not built here (--playground-dir)" }),
        )
    };
    routes.layer(CorsLayer::permissive()).with_state(state)
}

async fn snapshot(State(w): State<Arc<Watch>>) -> Response {
    let snap = w.watched.state.lock().unwrap_or_else(|p| p.into_inner()).snapshot();
    json_response(StatusCode::OK, &snap)
}

async fn stream(State(w): State<Arc<Watch>>) -> Response {
    let mut rx = w.watched.changed.subscribe();
    rx.mark_changed();
    let events = futures_util::stream::unfold((rx, w, true), |(mut rx, w, first)| async move {
        rx.changed().await.ok()?;
        // At most one snapshot per interval: the changes of the interval go out together.
        if !first {
            tokio::time::sleep(STREAM_INTERVAL).await;
        }
        rx.mark_unchanged();
        let snap = w.watched.state.lock().unwrap_or_else(|p| p.into_inner()).snapshot();
        let data = serde_json::to_string(&snap).unwrap_or_default();
        Some((Ok::<_, Infallible>(Event::default().data(data)), (rx, w, false)))
    });
    Sse::new(events).keep_alive(KeepAlive::default()).into_response()
}

async fn metrics(State(w): State<Arc<Watch>>) -> Response {
    let Some(url) = &w.metrics_url else {
        return (StatusCode::NOT_FOUND, "kvlens watch was started without --metrics").into_response();
    };
    match tokio::time::timeout(METRICS_TIMEOUT, fetch(url)).await {
        Ok(Ok(text)) => (
            [(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
            text,
        )
            .into_response(),
        Ok(Err(e)) => (StatusCode::BAD_GATEWAY, format!("{url}: {e:#}")).into_response(),
        Err(_) => (StatusCode::GATEWAY_TIMEOUT, format!("{url} did not answer within 5 s")).into_response(),
    }
}

/// GET over plain http.
async fn fetch(url: &str) -> Result<String> {
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<bytes::Bytes>>();
    let response = client.get(url.parse().context("not a URL")?).await?;
    let status = response.status();
    let body = response.into_body().collect().await?.to_bytes();
    anyhow::ensure!(status.is_success(), "HTTP {status}");
    Ok(String::from_utf8_lossy(&body).into_owned())
}
