//! The accept loop and connection admission. Each connection is an HTTP/1 connection of hyper's
//! with a header-read timeout (a client that sends part of its headers, or keeps an idle
//! keep-alive connection, is closed after it) and counts against `--max-connections`.
//!
//! A connection is *waiting on its client* while it has no request in flight (headers not yet
//! complete, or idle between keep-alive requests) and while a handler reads a request body
//! ([`Conn::waiting_on_client`]). At the limit, each new connection closes the connection that has
//! waited on its client longest, so connections that hold a slot without sending (half-sent
//! headers, stalled bodies, idle keep-alive) cannot lock out `/health` or a chat: a new client gets
//! in at once, and an honest request, which sends at once, is never the longest waiting. Only when
//! every connection is busy serving do new ones wait in the listen backlog, with a log line.
//! Long-lived answers that are not generation (the memory stream) have a cap of their own
//! ([`super::subscribers`]).

use axum::body::Body;
use axum::Router;
use hyper::body::{Frame, Incoming, SizeHint};
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tokio::sync::{Notify, Semaphore};

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

/// One connection's admission state.
#[derive(Debug, Default)]
struct ConnState {
    /// Set when the connection is to be closed now.
    closed: AtomicBool,
    /// Wakes the connection's task to close it.
    close: Notify,
}

/// Where each connection stands, under one lock.
#[derive(Debug, Default)]
struct Table {
    /// Connections waiting on their client, by when they started waiting (oldest first).
    waiting: BTreeMap<u64, Arc<ConnState>>,
    /// Each connection's requests in flight and, while it waits, its key in `waiting`.
    by_conn: std::collections::HashMap<usize, (usize, Option<u64>)>,
    next_stamp: u64,
}

/// Every open connection's admission state.
#[derive(Debug, Default)]
pub struct Admission {
    table: Mutex<Table>,
    /// Connections closed for waiting on their client longest while the server was full.
    evicted: AtomicU64,
}

fn key(state: &Arc<ConnState>) -> usize {
    Arc::as_ptr(state) as usize
}

impl Admission {
    fn table(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A new connection: waiting for its first request's headers.
    fn open(&self, state: &Arc<ConnState>) {
        let mut t = self.table();
        t.by_conn.insert(key(state), (0, None));
        Self::set_busy(&mut t, state, 0);
    }

    /// Sets a connection's count of requests in flight: at 0 it waits on its client.
    fn set_busy(t: &mut Table, state: &Arc<ConnState>, busy: usize) {
        let Some(&(_, stamp)) = t.by_conn.get(&key(state)) else {
            return;
        };
        if let Some(stamp) = stamp {
            t.waiting.remove(&stamp);
        }
        // A connection being closed is no longer a candidate for closing.
        let stamp = (busy == 0 && !state.closed.load(Ordering::Relaxed)).then(|| {
            t.next_stamp += 1;
            t.waiting.insert(t.next_stamp, state.clone());
            t.next_stamp
        });
        t.by_conn.insert(key(state), (busy, stamp));
    }

    /// Adds `delta` (+1 or -1) to a connection's requests in flight.
    fn add_busy(&self, state: &Arc<ConnState>, delta: isize) {
        let mut t = self.table();
        if let Some(&(busy, _)) = t.by_conn.get(&key(state)) {
            Self::set_busy(&mut t, state, busy.saturating_add_signed(delta));
        }
    }

    /// A connection has closed.
    fn forget(&self, state: &Arc<ConnState>) {
        let mut t = self.table();
        if let Some((_, Some(stamp))) = t.by_conn.remove(&key(state)) {
            t.waiting.remove(&stamp);
        }
    }

    /// Closes the connection that has waited on its client longest; false if none waits.
    fn evict_oldest(&self) -> bool {
        let Some((_, state)) = self.table().waiting.pop_first() else {
            return false;
        };
        close(&state);
        self.evicted.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// Connections closed so far to make room.
    pub fn evicted(&self) -> u64 {
        self.evicted.load(Ordering::Relaxed)
    }
}

fn close(state: &ConnState) {
    state.closed.store(true, Ordering::Relaxed);
    state.close.notify_one();
}

/// A connection as its requests see it (a request extension).
#[derive(Debug, Clone)]
pub struct Conn {
    state: Arc<ConnState>,
    admission: Arc<Admission>,
}

/// While alive, the connection counts as waiting on its client (see the module doc).
#[derive(Debug)]
pub struct WaitingOnClient(Conn);

impl Drop for WaitingOnClient {
    fn drop(&mut self) {
        self.0.admission.add_busy(&self.0.state, 1);
    }
}

/// A request in flight on its connection, until its answer has been sent (or dropped).
#[derive(Debug)]
struct InFlight(Conn);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.admission.add_busy(&self.0.state, -1);
    }
}

impl Conn {
    /// Marks the connection as waiting on its client (reading a request body) until the guard
    /// drops: if the server fills up meanwhile, the connection that has waited longest is closed.
    pub fn waiting_on_client(&self) -> WaitingOnClient {
        self.admission.add_busy(&self.state, -1);
        WaitingOnClient(self.clone())
    }

    /// Closes the connection now, cutting any answer in progress.
    pub fn close(&self) {
        close(&self.state);
    }
}

/// An answer's body that keeps its request counted as in flight until it is sent.
struct Tracked {
    inner: Body,
    _in_flight: InFlight,
}

impl hyper::body::Body for Tracked {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The router behind one connection: each request carries the [`Conn`] and counts as in flight.
#[derive(Clone)]
struct Service {
    router: TowerToHyperService<Router>,
    conn: Conn,
}

impl hyper::service::Service<hyper::Request<Incoming>> for Service {
    type Response = axum::response::Response;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn call(&self, mut req: hyper::Request<Incoming>) -> Self::Future {
        self.conn.admission.add_busy(&self.conn.state, 1);
        let in_flight = InFlight(self.conn.clone());
        req.extensions_mut().insert(self.conn.clone());
        let answer = self.router.call(req);
        Box::pin(async move {
            let resp = answer.await?;
            Ok(resp.map(|inner| {
                Body::new(Tracked {
                    inner,
                    _in_flight: in_flight,
                })
            }))
        })
    }
}

/// Serves `app` on `listener` until `shutdown` resolves, then lets open connections finish for
/// the grace period.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnectionLimits,
    admission: Arc<Admission>,
    shutdown: impl Future<Output = ()>,
) {
    let permits = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let timed_out = Arc::new(AtomicU64::new(0));
    let graceful = GracefulShutdown::new();
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    tokio::pin!(shutdown);
    let mut warned: Option<Instant> = None;
    let router = TowerToHyperService::new(app);
    loop {
        let permit = match permits.clone().try_acquire_owned() {
            Ok(permit) => permit,
            Err(_) => {
                let evicted = admission.evict_oldest();
                if warned.is_none_or(|t| t.elapsed() >= WARN_INTERVAL) {
                    warned = Some(Instant::now());
                    tracing::warn!(
                        "{} connections open (--max-connections): {}; so far {} closed to make room, {} for sending \
                         no complete request within {} s (--header-timeout)",
                        limits.max_connections,
                        if evicted {
                            "each new connection closes the one that has waited on its client longest"
                        } else {
                            "every one is being served, new connections wait until one closes"
                        },
                        admission.evicted(),
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
        let state = Arc::new(ConnState::default());
        admission.open(&state);
        let conn = Conn {
            state: state.clone(),
            admission: admission.clone(),
        };
        let service = Service {
            router: router.clone(),
            conn,
        };
        let connection = graceful.watch(builder.serve_connection(TokioIo::new(stream), service));
        let timed_out = timed_out.clone();
        let admission = admission.clone();
        tokio::spawn(async move {
            tokio::pin!(connection);
            let closed = async {
                while !state.closed.load(Ordering::Relaxed) {
                    state.close.notified().await;
                }
            };
            tokio::select! {
                result = &mut connection => if let Err(e) = result {
                    if e.is_timeout() {
                        timed_out.fetch_add(1, Ordering::Relaxed);
                    }
                },
                // Dropping the connection closes its socket and drops its handler's future.
                () = closed => {}
            }
            admission.forget(&state);
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
