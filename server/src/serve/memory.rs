//! Memory endpoints: `/v1/memory` (a snapshot taken now), `/v1/memory/stream` (the engine's
//! published snapshots as Server-Sent Events), the three resets and `/server_info`.

use super::errors::{json_response, ApiError};
use super::listener::Conn;
use super::App;
use axum::extract::{Extension, State};
use axum::http::StatusCode;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use std::convert::Infallible;
use std::sync::Arc;

fn answer(result: Result<impl serde::Serialize, ApiError>) -> Response {
    match result {
        Ok(value) => json_response(StatusCode::OK, &value),
        Err(e) => e.into_response(),
    }
}

/// `GET /v1/memory`: ledger by category, KV summary, encoder cache, processor cache, queue lengths,
/// counters, taken between two engine steps.
pub async fn memory(State(app): State<Arc<App>>) -> Response {
    let snapshot = async { app.ready()?.engine.snapshot().await };
    answer(snapshot.await)
}

/// `GET /v1/memory/stream`: the latest snapshot at once, then each one the engine publishes. Past
/// `--max-stream-subscribers` the oldest subscriber's connection is closed.
pub async fn memory_stream(State(app): State<Arc<App>>, conn: Option<Extension<Conn>>) -> Response {
    let mut rx = match app.ready() {
        Ok(ready) => ready.occupancy.clone(),
        Err(e) => return e.into_response(),
    };
    rx.mark_changed();
    let subscription = conn.map(|Extension(conn)| app.subscribers.join(conn));
    let events = futures_util::stream::unfold((rx, subscription), |(mut rx, subscription)| async move {
        rx.changed().await.ok()?;
        let data = serde_json::to_string(&**rx.borrow_and_update()).unwrap_or_default();
        Some((Ok::<_, Infallible>(Event::default().data(data)), (rx, subscription)))
    });
    Sse::new(events).keep_alive(KeepAlive::default()).into_response()
}

/// `POST /reset_prefix_cache`: 409 while requests hold blocks.
pub async fn reset_prefix_cache(State(app): State<Arc<App>>) -> Response {
    let reset = async {
        app.ready()?.engine.reset_prefix_cache().await?;
        Ok(serde_json::json!({"reset": true}))
    };
    answer(reset.await)
}

/// `POST /reset_mm_cache`: the processor cache only, as vLLM (the encoder cache keeps its bytes).
pub async fn reset_mm_cache(State(app): State<Arc<App>>) -> Response {
    let reset = async { app.ready()?.engine.reset_processor_cache().await };
    answer(reset.await)
}

/// `POST /reset_encoder_cache`: drops every encoder output no running request references.
pub async fn reset_encoder_cache(State(app): State<Arc<App>>) -> Response {
    let reset = async { app.ready()?.engine.reset_encoder_cache().await };
    answer(reset.await)
}

/// `GET /server_info`: the resolved flags, the start-up budget, the profile and the log lines.
pub async fn server_info(State(app): State<Arc<App>>) -> Response {
    answer(app.ready().map(|r| r.info.clone()))
}
