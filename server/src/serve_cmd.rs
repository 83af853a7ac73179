//! `kvlens serve`: at this stage it serves the playground's static files (the OpenAI-compatible
//! API joins it with the engine loop).

use anyhow::{Context, Result};
use std::net::SocketAddr;
use std::path::PathBuf;

/// Where to listen and what to serve.
#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Directory with the built playground (index.html, wasm, styles).
    #[arg(long, default_value = "dist")]
    pub playground_dir: PathBuf,
}

/// Runs the HTTP server until Ctrl-C.
pub fn run(a: &ServeArgs) -> Result<()> {
    let index = a.playground_dir.join("index.html");
    if !index.is_file() {
        return Err(crate::UsageError(format!(
            "{} not found: build the playground first (cargo xtask demo does it)",
            index.display()
        ))
        .into());
    }
    let addr: SocketAddr = format!("{}:{}", a.host, a.port)
        .parse()
        .map_err(|e| crate::UsageError(format!("bad --host/--port: {e}")))?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let app = axum::Router::new().fallback_service(tower_http::services::ServeDir::new(&a.playground_dir));
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("cannot listen on {addr}"))?;
        eprintln!("kvlens playground on http://{addr}/ (Ctrl-C stops)");
        axum::serve(listener, app)
            .with_graceful_shutdown(async {
                let _ = tokio::signal::ctrl_c().await;
            })
            .await
            .context("server stopped")
    })
}
