//! The ZeroMQ publisher, vLLM's `ZmqEventPublisher`: each engine step's events go out on a PUB
//! socket as `[topic, seq (8 bytes, big-endian), msgpack batch]`; the last `buffer_steps` batches
//! are kept, and a ROUTER socket answers a replay request (`[start_seq]`, 8 bytes big-endian)
//! with `[seq, batch]` for every kept batch from `start_seq` on, then `[-1, ""]`.

use std::collections::VecDeque;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use bytes::Bytes;
use kvlens_engine::cache::KvCacheEvent;
use tokio::sync::mpsc;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use super::{wire, KvEventsConfig};

/// Messages the PUB socket queues per subscriber before dropping (fixed in zeromq.rs; vLLM's
/// default `hwm`).
pub const PUB_QUEUE: usize = 100_000;

/// The replay stream's end marker: sequence −1 with an empty payload.
const END_SEQ: i64 = -1;

/// Longest a replay waits for its client to take one message.
const REPLAY_SEND_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1);

/// The engine's side: hands each step's events to the publisher task.
#[derive(Clone, Debug)]
pub struct KvEventSink {
    tx: mpsc::Sender<(f64, Vec<KvCacheEvent>)>,
}

impl KvEventSink {
    /// Queues one step's events as one batch (nothing when there are none); waits while the
    /// queue holds `max_queue_size` batches, as vLLM's publisher does. Call from a non-async thread.
    pub fn send(&self, events: Vec<KvCacheEvent>) {
        if events.is_empty() {
            return;
        }
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        if self.tx.blocking_send((ts, events)).is_err() {
            tracing::warn!("the KV event publisher has stopped; dropping events");
        }
    }
}

/// Where the sockets ended up (ports resolved when 0 was asked for).
#[derive(Clone, Debug)]
pub struct Bound {
    /// The PUB socket's endpoint.
    pub endpoint: String,
    /// The ROUTER socket's endpoint, if any.
    pub replay_endpoint: Option<String>,
}

/// zeromq.rs resolves `*` as a host name; vLLM's `tcp://*:5557` means every interface.
fn bindable(endpoint: &str) -> String {
    endpoint.replacen("://*:", "://0.0.0.0:", 1)
}

/// Opens the sockets and starts the publisher task on the current tokio runtime.
pub async fn start(config: &KvEventsConfig) -> Result<(KvEventSink, Bound)> {
    if config.hwm != PUB_QUEUE {
        tracing::warn!(
            "--kv-events-config: hwm is fixed at {PUB_QUEUE} here; ignoring {}",
            config.hwm
        );
    }
    let mut publisher = PubSocket::new();
    // vLLM's rule: bind a wildcard address, connect to a named one.
    let endpoint = if config.endpoint.contains('*') || config.endpoint.contains("::") {
        publisher
            .bind(&bindable(&config.endpoint))
            .await
            .with_context(|| format!("cannot bind the KV event socket to {}", config.endpoint))?
            .to_string()
    } else {
        publisher
            .connect(&config.endpoint)
            .await
            .with_context(|| format!("cannot connect the KV event socket to {}", config.endpoint))?;
        config.endpoint.clone()
    };
    let (replay, replay_endpoint) = match &config.replay_endpoint {
        Some(e) => {
            let mut router = RouterSocket::new();
            let bound = router
                .bind(&bindable(e))
                .await
                .with_context(|| format!("cannot bind the KV event replay socket to {e}"))?;
            (Some(router), Some(bound.to_string()))
        }
        None => (None, None),
    };
    let (tx, rx) = mpsc::channel(config.max_queue_size);
    let task = Publisher {
        publisher,
        replay,
        topic: Bytes::from(config.topic.clone().into_bytes()),
        kept: VecDeque::new(),
        keep: config.buffer_steps,
        next_seq: 0,
    };
    tokio::spawn(task.run(rx));
    Ok((
        KvEventSink { tx },
        Bound {
            endpoint,
            replay_endpoint,
        },
    ))
}

struct Publisher {
    publisher: PubSocket,
    replay: Option<RouterSocket>,
    topic: Bytes,
    kept: VecDeque<(i64, Bytes)>,
    keep: usize,
    next_seq: i64,
}

impl Publisher {
    async fn run(mut self, mut rx: mpsc::Receiver<(f64, Vec<KvCacheEvent>)>) {
        loop {
            let request = async {
                match &mut self.replay {
                    Some(r) => r.recv().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                batch = rx.recv() => match batch {
                    Some((ts, events)) => self.publish(ts, &events).await,
                    None => break,
                },
                request = request => match request {
                    Ok(request) => self.replay(request).await,
                    Err(e) => tracing::warn!("KV event replay socket: {e}"),
                },
            }
        }
    }

    async fn publish(&mut self, ts: f64, events: &[KvCacheEvent]) {
        let seq = self.next_seq;
        self.next_seq += 1;
        let payload = Bytes::from(wire::encode_batch(ts, events, 0));
        let frames = vec![
            self.topic.clone(),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            payload.clone(),
        ];
        let message = ZmqMessage::try_from(frames).expect("three frames");
        if let Err(e) = self.publisher.send(message).await {
            tracing::warn!("cannot publish KV events batch {seq}: {e}");
        }
        if self.kept.len() == self.keep {
            self.kept.pop_front();
        }
        self.kept.push_back((seq, payload));
    }

    /// `[identity, "", start_seq]` from a REQ (or DEALER) client; the start is read as vLLM reads
    /// it, an unsigned big-endian integer. A client that stops reading gets no more than
    /// [`REPLAY_SEND_TIMEOUT`] per message: publishing must not wait for it.
    async fn replay(&mut self, request: ZmqMessage) {
        let frames = request.into_vec();
        let [identity, _, start] = frames.as_slice() else {
            tracing::warn!("Invalid replay request: {} frames", frames.len());
            return;
        };
        if start.len() > 8 {
            tracing::warn!("Invalid replay request: a start of {} bytes", start.len());
            return;
        }
        let start = start.iter().fold(0u64, |n, &b| (n << 8) | u64::from(b));
        let Some(router) = &mut self.replay else { return };
        let reply = |seq: i64, payload: Bytes| {
            ZmqMessage::try_from(vec![
                identity.clone(),
                Bytes::new(),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                payload,
            ])
            .expect("four frames")
        };
        let kept = self.kept.iter().filter(|(seq, _)| *seq as u64 >= start);
        for (seq, payload) in kept.map(|(s, p)| (*s, p.clone())).chain([(END_SEQ, Bytes::new())]) {
            match tokio::time::timeout(REPLAY_SEND_TIMEOUT, router.send(reply(seq, payload))).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tracing::warn!("KV event replay: {e}");
                    return;
                }
                Err(_) => {
                    tracing::warn!("a KV event replay client stopped reading; its replay is cut short");
                    return;
                }
            }
        }
    }
}
