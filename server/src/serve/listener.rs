//! The accept loop. Each connection is an HTTP/1 connection of hyper's with a header-read timeout
//! (a client that sends part of its headers, or keeps an idle keep-alive connection, is closed
//! after it) and counts against a connection limit: at the limit new connections wait in the
//! listen backlog, with one log line, until one closes. A client that holds many half-open
//! connections therefore slows new clients down for at most the timeout, never stops the server.

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

/// How connections are bounded.
#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    /// Most connections open at once.
    pub max_connections: usize,
    /// A request's headers (and the wait for the next request on a kept-alive connection) must
    /// arrive within this.
    pub header_timeout: Duration,
    /// How long open connections get to finish after shutdown begins.
    pub shutdown_grace: Duration,
}

/// Least time between two "limit reached" log lines.
const WARN_INTERVAL: Duration = Duration::from_secs(10);

/// Serves `app` on `listener` until `shutdown` resolves, then lets open connections finish for
/// the grace period.
pub async fn serve(listener: TcpListener, app: Router, limits: ConnectionLimits, shutdown: impl Future<Output = ()>) {
    let permits = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let timed_out = Arc::new(AtomicU64::new(0));
    let graceful = GracefulShutdown::new();
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    tokio::pin!(shutdown);
    let mut warned: Option<Instant> = None;
    loop {
        let permit = match permits.clone().try_acquire_owned() {
            Ok(permit) => permit,
            Err(_) => {
                if warned.is_none_or(|t| t.elapsed() >= WARN_INTERVAL) {
                    warned = Some(Instant::now());
                    tracing::warn!(
                        "{} connections open (--max-connections): new connections wait until one closes; \
                     {} closed so far for sending no complete request within {} s (--header-timeout)",
                        limits.max_connections,
                        timed_out.load(Ordering::Relaxed),
                        limits.header_timeout.as_secs_f64()
                    );
                }
                tokio::select! {
                    permit = permits.clone().acquire_owned() => match permit {
                        Ok(permit) => permit,
                        Err(_) => break,
                    },
                    () = &mut shutdown => break,
                }
            }
        };
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of file descriptors and the like: wait a little instead of spinning.
                    tracing::warn!("cannot accept a connection: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let service = TowerToHyperService::new(app.clone());
        let conn = graceful.watch(builder.serve_connection(TokioIo::new(stream), service));
        let timed_out = timed_out.clone();
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                if e.is_timeout() {
                    timed_out.fetch_add(1, Ordering::Relaxed);
                }
            }
            drop(permit);
        });
    }
    drop(listener);
    if tokio::time::timeout(limits.shutdown_grace, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(
            "connections still open {} s after the signal; closing them",
            limits.shutdown_grace.as_secs()
        );
    }
}
