//! The engine thread: it owns the [`Engine`], blocks on its command channel while idle, and while
//! requests are unfinished alternates between draining commands and running steps. Each request's
//! tokens are detokenized here and checked for stop strings, so the finish reason is decided once,
//! on this thread, before the metrics count it; the deltas go back over the request's own channel.
//! Occupancy snapshots are published on a watch channel after steps, at most ten a second (and
//! always once the engine falls idle).

use super::errors::ApiError;
use super::metrics::Metrics;
use crate::kv_events::publisher::KvEventSink;
use crate::runtime::Frontend;
use kvlens_engine::cache::{BlockResidency, RequestId};
use kvlens_engine::engine::{Engine, EngineError, FinishReason, Request, TokenEvent};
use kvlens_engine::memory::ledger::Category;
use kvlens_engine::occupancy::{Occupancy, ProcessMemory};
use kvlens_engine::output::{Delta, Output};
use std::collections::HashMap;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::{mpsc as tokio_mpsc, oneshot, watch};

/// Shortest gap between two published snapshots.
const PUBLISH_INTERVAL: Duration = Duration::from_millis(100);

/// What a request's channel carries.
#[derive(Debug)]
pub enum Update {
    /// What a generated token adds to the answer (the last delta carries the finish reason).
    Delta(Delta),
    /// The request failed (its step failed, or its tokens could not be detokenized): why, and
    /// its last delta (the text held back so far, `finish_reason: "error"`).
    Failed(ApiError, Delta),
}

/// What `/reset_encoder_cache` reports.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct EncoderReset {
    /// Bytes returned to the ledger.
    pub freed_bytes: u64,
    /// The ledger's encoder-cache bytes afterwards (outputs still referenced by running requests).
    pub encoder_cache_bytes: u64,
}

/// What `/reset_mm_cache` reports.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct ProcessorReset {
    /// Host bytes the processor cache released.
    pub freed_bytes: u64,
    /// Items it dropped.
    pub freed_entries: usize,
}

/// A request for the engine thread to queue.
#[derive(Debug)]
struct NewRequest {
    request: Request,
    arrived: Instant,
    output: Output,
    updates: tokio_mpsc::UnboundedSender<Update>,
    reply: oneshot::Sender<Result<(), EngineError>>,
}

/// A command for the engine thread.
#[derive(Debug)]
enum Command {
    Add(Box<NewRequest>),
    Abort(RequestId),
    ResetPrefixCache(oneshot::Sender<Result<(), EngineError>>),
    ResetEncoderCache(oneshot::Sender<EncoderReset>),
    ResetProcessorCache(oneshot::Sender<ProcessorReset>),
    Snapshot(oneshot::Sender<Occupancy>),
    Shutdown,
}

/// The HTTP side's end of the command channel.
#[derive(Debug, Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Command>,
}

fn stopped() -> ApiError {
    ApiError::unavailable("the engine has stopped")
}

impl EngineHandle {
    fn send(&self, cmd: Command) -> Result<(), ApiError> {
        self.tx.send(cmd).map_err(|_| stopped())
    }

    async fn ask<T>(&self, make: impl FnOnce(oneshot::Sender<T>) -> Command) -> Result<T, ApiError> {
        let (reply, answer) = oneshot::channel();
        self.send(make(reply))?;
        answer.await.map_err(|_| stopped())
    }

    /// Queues a request whose tokens become `output`; the deltas arrive on the returned
    /// subscription, which aborts the request when dropped before the end.
    pub async fn add(&self, request: Request, output: Output, arrived: Instant) -> Result<Subscription, ApiError> {
        let (updates, rx) = tokio_mpsc::unbounded_channel();
        // Armed before the request is queued: a client that leaves while this waits drops it, and
        // its abort follows the request on the same channel.
        let mut sub = Subscription {
            updates: rx,
            id: request.id.clone(),
            engine: self.clone(),
            armed: true,
        };
        let added = self
            .ask(|reply| {
                Command::Add(Box::new(NewRequest {
                    request,
                    arrived,
                    output,
                    updates,
                    reply,
                }))
            })
            .await;
        match added {
            Ok(Ok(())) => Ok(sub),
            Ok(Err(e)) => {
                sub.finished();
                Err(engine_error(e))
            }
            Err(e) => {
                sub.finished();
                Err(e)
            }
        }
    }

    /// Forgets the prefix cache (refused while requests hold blocks).
    pub async fn reset_prefix_cache(&self) -> Result<(), ApiError> {
        self.ask(Command::ResetPrefixCache)
            .await?
            .map_err(|e| ApiError::conflict(format!("cannot reset the prefix cache now: {e}")))
    }

    /// Drops every unreferenced encoder output.
    pub async fn reset_encoder_cache(&self) -> Result<EncoderReset, ApiError> {
        self.ask(Command::ResetEncoderCache).await
    }

    /// Clears the processor cache (on the engine thread, so the memory stream shows it).
    pub async fn reset_processor_cache(&self) -> Result<ProcessorReset, ApiError> {
        self.ask(Command::ResetProcessorCache).await
    }

    /// A snapshot taken now (between steps).
    pub async fn snapshot(&self) -> Result<Occupancy, ApiError> {
        self.ask(Command::Snapshot).await
    }

    /// Aborts every request and ends the engine thread.
    pub fn shutdown(&self) {
        let _ = self.tx.send(Command::Shutdown);
    }
}

/// Maps an engine refusal onto a status code.
fn engine_error(e: EngineError) -> ApiError {
    match e {
        EngineError::BadRequest(msg) => ApiError::bad_request(msg),
        other => ApiError::internal(other.to_string()),
    }
}

/// One request's token channel. Dropping it before the request finished (the client went away)
/// aborts the request, which returns its KV blocks and encoder references at once.
#[derive(Debug)]
pub struct Subscription {
    /// The request's deltas as the engine thread produces them.
    pub updates: tokio_mpsc::UnboundedReceiver<Update>,
    id: RequestId,
    engine: EngineHandle,
    armed: bool,
}

impl Subscription {
    /// The request ended on the engine thread: nothing to abort.
    pub fn finished(&mut self) {
        self.armed = false;
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        if self.armed {
            let _ = self.engine.send(Command::Abort(self.id.clone()));
        }
    }
}

/// A request in flight, as the engine thread tracks it.
#[derive(Debug)]
struct Live {
    output: Output,
    updates: tokio_mpsc::UnboundedSender<Update>,
    arrived: Instant,
    last_token: Option<Instant>,
    prompt_len: usize,
    generated: usize,
}

/// What the engine thread reports besides its snapshots.
#[derive(Debug, Default)]
pub struct Observe {
    /// Where each step's KV cache events go (`--kv-events-config`).
    pub kv_events: Option<KvEventSink>,
    /// The share of KV blocks followed for `--kv-cache-metrics`.
    pub kv_cache_metrics_sample: Option<f64>,
}

/// Seconds on a monotonic clock (since the first call), for the KV block residency sample.
fn monotonic_seconds() -> f64 {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_secs_f64()
}

/// The engine thread's state.
#[derive(Debug)]
pub struct EngineLoop {
    engine: Engine,
    frontend: Arc<Frontend>,
    metrics: Arc<Metrics>,
    rx: mpsc::Receiver<Command>,
    live: HashMap<RequestId, Live>,
    published: watch::Sender<Arc<Occupancy>>,
    last_publish: Instant,
    dirty: bool,
    seq: u64,
    kv_events: Option<KvEventSink>,
}

fn unix_time() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The occupancy of the engine and of the frontend's processor cache now, with this process's RSS.
pub(crate) fn occupancy_of(engine: &Engine, frontend: &Frontend, seq: u64) -> Occupancy {
    Occupancy::of(engine, frontend, seq, unix_time(), process_memory())
}

/// This process's resident set size (Linux `VmRSS`; absent elsewhere).
fn process_memory() -> ProcessMemory {
    let resident_bytes = std::fs::read_to_string("/proc/self/status").ok().and_then(|s| {
        s.lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map(|kib| kib << 10)
    });
    ProcessMemory {
        resident_bytes,
        wasm_memory_bytes: None,
    }
}

impl EngineLoop {
    /// The loop over a started engine, the handle that commands it and the snapshot channel.
    pub fn new(
        engine: Engine,
        frontend: Arc<Frontend>,
        metrics: Arc<Metrics>,
        observe: Observe,
    ) -> (Self, EngineHandle, watch::Receiver<Arc<Occupancy>>) {
        let (tx, rx) = mpsc::channel();
        let mut engine = engine;
        engine.record_kv_events(observe.kv_events.is_some());
        let residency = observe
            .kv_cache_metrics_sample
            .map(|r| BlockResidency::new(r, monotonic_seconds));
        engine.follow_kv_block_residency(residency);
        let kv_events = observe.kv_events;
        let first = occupancy_of(&engine, &frontend, 1);
        let (published, subscriber) = watch::channel(Arc::new(first));
        let this = EngineLoop {
            engine,
            frontend,
            metrics,
            rx,
            live: HashMap::new(),
            published,
            last_publish: Instant::now(),
            dirty: false,
            seq: 1,
            kv_events,
        };
        (this, EngineHandle { tx }, subscriber)
    }

    /// Runs until a shutdown command or until every handle is gone.
    pub fn run(mut self) {
        loop {
            if !self.engine.has_unfinished() {
                self.publish(true);
                match self.rx.recv() {
                    Ok(cmd) => {
                        if !self.handle(cmd) {
                            break;
                        }
                    }
                    Err(_) => break,
                }
            }
            if !self.drain() {
                break;
            }
            if self.engine.has_unfinished() {
                self.step();
                self.publish(false);
            }
        }
        // Shutdown: every stream ends with `finish_reason: "abort"`, as vLLM ends aborted requests.
        let frontend = self.frontend.clone();
        self.end_all(FinishReason::Abort, |live| {
            Update::Delta(live.output.cut(&frontend.tokenizer, FinishReason::Abort))
        });
        self.publish(true);
    }

    /// Handles every queued command; false on shutdown.
    fn drain(&mut self) -> bool {
        while let Ok(cmd) = self.rx.try_recv() {
            if !self.handle(cmd) {
                return false;
            }
        }
        true
    }

    /// Handles one command; false on shutdown.
    fn handle(&mut self, cmd: Command) -> bool {
        match cmd {
            Command::Add(new) => {
                let NewRequest {
                    request,
                    arrived,
                    output,
                    updates,
                    reply,
                } = *new;
                let id = request.id.clone();
                let prompt_len = request.prompt.len();
                let added = self.engine.add_request(request);
                if added.is_ok() {
                    self.live.insert(
                        id,
                        Live {
                            output,
                            updates,
                            arrived,
                            last_token: None,
                            prompt_len,
                            generated: 0,
                        },
                    );
                    self.dirty = true;
                }
                let _ = reply.send(added);
            }
            Command::Abort(id) => self.abort(&id, FinishReason::Abort),
            Command::ResetPrefixCache(reply) => {
                let _ = reply.send(self.engine.reset_prefix_cache());
                self.dirty = true;
            }
            Command::ResetEncoderCache(reply) => {
                let freed_bytes = self.engine.reset_encoder_cache();
                let encoder_cache_bytes = self.engine.ledger().bytes(Category::EncoderCache);
                let _ = reply.send(EncoderReset {
                    freed_bytes,
                    encoder_cache_bytes,
                });
                self.dirty = true;
            }
            Command::ResetProcessorCache(reply) => {
                let mut cache = self.frontend.processor_cache.lock().unwrap_or_else(|p| p.into_inner());
                let freed_entries = cache.len();
                let freed_bytes = cache.clear();
                drop(cache);
                let _ = reply.send(ProcessorReset {
                    freed_bytes,
                    freed_entries,
                });
                self.dirty = true;
            }
            Command::Snapshot(reply) => {
                let _ = reply.send(self.occupancy());
            }
            Command::Shutdown => return false,
        }
        true
    }

    /// Ends a live request early with `reason` (a client that went away, a stop string, a
    /// failure, a shutdown).
    fn abort(&mut self, id: &RequestId, reason: FinishReason) {
        if self.live.contains_key(id) {
            if let Err(e) = self.engine.abort(id) {
                tracing::error!("aborting {id}: {e}");
            }
            self.finish(id, reason);
            self.dirty = true;
        }
    }

    /// Forgets a request that ended, records its metrics and logs one line.
    fn finish(&mut self, id: &RequestId, reason: FinishReason) {
        if let Some(live) = self.live.remove(id) {
            let e2e = live.arrived.elapsed().as_secs_f64();
            self.metrics.finished(reason, e2e);
            tracing::info!(
                "Finished request {id}: {}, {} prompt + {} generated tokens in {e2e:.2} s",
                reason.as_str(),
                live.prompt_len,
                live.generated
            );
        }
    }

    fn step(&mut self) {
        self.dirty = true;
        match self.engine.step() {
            Ok(events) => {
                for event in events {
                    self.deliver(event);
                }
            }
            Err(e) => {
                tracing::error!("engine step failed: {e}");
                // The engine has dropped every request and emptied its caches: tell the clients.
                let why = ApiError::internal(format!("the engine failed: {e}"));
                let frontend = self.frontend.clone();
                self.end_all(FinishReason::Error, |live| {
                    Update::Failed(why.clone(), live.output.cut(&frontend.tokenizer, FinishReason::Error))
                });
            }
        }
    }

    /// Turns a token into its request's next delta and sends it. The finish reason is decided
    /// here: the engine's own, or `stop` where a stop string ends the text (the engine request
    /// is then aborted at once, so no token past it is generated or counted). A request whose
    /// client is gone is aborted.
    fn deliver(&mut self, event: TokenEvent) {
        let Some(live) = self.live.get_mut(&event.id) else {
            return;
        };
        let id = event.id.clone();
        let delta = match live.output.push(&self.frontend.tokenizer, event) {
            Ok(delta) => delta,
            Err(e) => {
                let e = ApiError::internal(format!("detokenizing: {e}"));
                let last = live.output.cut(&self.frontend.tokenizer, FinishReason::Error);
                let _ = live.updates.send(Update::Failed(e, last));
                self.abort(&id, FinishReason::Error);
                return;
            }
        };
        if delta.token.is_some() {
            let now = Instant::now();
            match live.last_token {
                None => self
                    .metrics
                    .first_token(now.duration_since(live.arrived).as_secs_f64(), live.prompt_len),
                Some(last) => self.metrics.next_token(now.duration_since(last).as_secs_f64()),
            }
            live.last_token = Some(now);
            live.generated += 1;
        }
        match delta.finish {
            None => {
                if live.updates.send(Update::Delta(delta)).is_err() {
                    self.abort(&id, FinishReason::Abort);
                }
            }
            Some(reason) => {
                // Counted before the client sees the end, so metrics read after an answer include it.
                let updates = live.updates.clone();
                if delta.stopped {
                    self.abort(&id, reason);
                } else {
                    self.finish(&id, reason);
                }
                let _ = updates.send(Update::Delta(delta));
            }
        }
    }

    /// Ends every live request with `reason`, then sends each its last update (counted before
    /// the client sees the end).
    fn end_all(&mut self, reason: FinishReason, mut last: impl FnMut(&mut Live) -> Update) {
        let ids: Vec<RequestId> = self.live.keys().cloned().collect();
        for id in ids {
            let Some(live) = self.live.get_mut(&id) else { continue };
            let (update, updates) = (last(live), live.updates.clone());
            self.abort(&id, reason);
            let _ = updates.send(update);
        }
    }

    fn occupancy(&self) -> Occupancy {
        occupancy_of(&self.engine, &self.frontend, self.seq)
    }

    /// Publishes a snapshot when something changed and the last one is old enough (or `force`).
    fn publish(&mut self, force: bool) {
        // One batch per step (or per reset), whatever the snapshot rate.
        if let Some(sink) = &self.kv_events {
            sink.send(self.engine.take_kv_events());
        }
        self.metrics.kv_blocks_evicted(&self.engine.take_kv_block_evictions());
        if !self.dirty || (!force && self.last_publish.elapsed() < PUBLISH_INTERVAL) {
            return;
        }
        self.seq += 1;
        let occupancy = self.occupancy();
        self.published.send_replace(Arc::new(occupancy));
        self.last_publish = Instant::now();
        self.dirty = false;
    }
}
