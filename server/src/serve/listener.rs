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
//! every connection is busy serving does a new one wait (the next ones in the listen backlog), with
//! a log line.
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
struct Admission {
    table: Mutex<Table>,
    /// Wakes an accept loop waiting at the limit when a connection starts waiting on its client.
    became_waiting: Notify,
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
            let busy = busy.saturating_add_signed(delta);
            Self::set_busy(&mut t, state, busy);
            if busy == 0 {
                self.became_waiting.notify_waiters();
            }
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
    fn evicted(&self) -> u64 {
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

/// An answer's body that keeps its request counted as in flight until hyper has taken all of it
/// (hyper queues a whole body for writing and drops it, so an answer a client never reads does
/// not keep its connection busy; a stream is polled only as the client reads).
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

/// Connections the kernel queues for `accept` (Linux caps it at `net.core.somaxconn`, 4096 by
/// default): a flood of connections waits there rather than having its SYNs dropped and retried
/// a second later, which would delay honest clients caught among them.
const LISTEN_BACKLOG: u32 = 4096;

/// A listener on the first address `host:port` resolves to, with [`LISTEN_BACKLOG`].
pub async fn listen(host: &str, port: u16) -> std::io::Result<tokio::net::TcpListener> {
    let addr = tokio::net::lookup_host((host, port))
        .await?
        .next()
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::NotFound, "the host resolves to no address"))?;
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

/// Raises the soft limit of open files to the hard limit (as vLLM does), so that
/// `--max-connections` connections plus the server's own files fit; warns when they cannot.
#[allow(unsafe_code)]
pub fn raise_open_file_limit(max_connections: usize) {
    #[cfg(unix)]
    {
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit and setrlimit only read and write the struct passed to them.
        let raised = unsafe {
            libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 && {
                limit.rlim_cur = limit.rlim_max;
                libc::setrlimit(libc::RLIMIT_NOFILE, &limit) == 0
            }
        };
        let room = usize::try_from(limit.rlim_cur).unwrap_or(usize::MAX);
        if !raised || room < max_connections.saturating_add(64) {
            tracing::warn!(
                "at most {room} open files (ulimit -n): fewer than --max-connections {max_connections} plus the \
                 server's own; raise the limit or lower --max-connections"
            );
        }
    }
}

/// Serves `app` on `listener` until `shutdown` resolves, then lets open connections finish for
/// the grace period.
pub async fn serve(listener: TcpListener, app: Router, limits: ConnectionLimits, shutdown: impl Future<Output = ()>) {
    let admission = Arc::new(Admission::default());
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
        // A connection has come. At the limit: close the connection that has waited on its client
        // longest and take its slot; with none waiting, wait for a slot or for a connection to
        // start waiting. (Only for a connection that has come: a slot is never freed in advance.)
        let permit = loop {
            if let Ok(permit) = permits.clone().try_acquire_owned() {
                break Some(permit);
            }
            let became_waiting = admission.became_waiting.notified();
            tokio::pin!(became_waiting);
            became_waiting.as_mut().enable();
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
                permit = permits.clone().acquire_owned() => break permit.ok(),
                () = &mut became_waiting, if !evicted => continue,
                () = &mut shutdown => break None,
            }
        };
        let Some(permit) = permit else { break };
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

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Two clients ask for a 64 MiB answer and never read it, on a server of two connections: hyper
    /// has taken each whole answer, so their connections wait on their clients and a third client
    /// is answered.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn clients_that_never_read_their_answers_make_room() {
        let app = Router::new()
            .route("/big", axum::routing::get(|| async { vec![7u8; 64 << 20] }))
            .route("/small", axum::routing::get(|| async { "ok" }));
        let listener = listen("127.0.0.1", 0).await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let limits = ConnectionLimits {
            max_connections: 2,
            header_timeout: Duration::from_secs(300),
            shutdown_grace: Duration::from_secs(1),
        };
        let server = tokio::spawn(serve(listener, app, limits, std::future::pending()));
        let mut never_read = Vec::new();
        for _ in 0..2 {
            let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.unwrap();
            s.write_all(b"GET /big HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                .await
                .unwrap();
            // The answer has started (the request is being served), and is then never read.
            let mut status = [0u8; 12];
            s.read_exact(&mut status).await.unwrap();
            assert_eq!(&status, b"HTTP/1.1 200");
            never_read.push(s);
        }
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        s.write_all(b"GET /small HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut answer = Vec::new();
        tokio::time::timeout(Duration::from_secs(300), s.read_to_end(&mut answer))
            .await
            .expect("the third client was answered")
            .unwrap();
        assert!(
            answer.starts_with(b"HTTP/1.1 200"),
            "{}",
            String::from_utf8_lossy(&answer)
        );
        server.abort();
    }
}
