//! The other end: a SUB socket on a vLLM (or kvlens) publisher, the way vLLM's example subscriber
//! reads it, into a [`KvWatch`]. A late start and every gap are filled from the replay socket
//! (a DEALER, which takes the many answers a replay sends); a sequence that goes back with a batch
//! newer than any applied means the publisher restarted, and the resident set starts over from the
//! new publisher's first batch (an older one was already applied through the replay).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use kvlens_engine::cache::KvWatch;
use tokio::sync::watch;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

use super::wire;

/// How long a replay may take to answer before the watcher goes on without it.
const REPLAY_TIMEOUT: Duration = Duration::from_secs(5);

/// Where the events come from.
#[derive(Clone, Debug)]
pub struct EventSource {
    /// The publisher's PUB endpoint, e.g. `tcp://host:5557`.
    pub endpoint: String,
    /// Its replay (ROUTER) endpoint, if it has one.
    pub replay: Option<String>,
    /// The topic to subscribe to (`""`: every topic).
    pub topic: String,
}

/// The watched state, shared with the HTTP side; `changed` ticks after each applied batch.
#[derive(Clone, Debug)]
pub struct Watched {
    /// The resident set and counters.
    pub state: Arc<Mutex<KvWatch>>,
    /// Bumped after every change.
    pub changed: watch::Sender<u64>,
}

impl Watched {
    fn update(&self, f: impl FnOnce(&mut KvWatch)) {
        f(&mut self.state.lock().unwrap_or_else(|p| p.into_inner()));
        self.changed.send_modify(|n| *n += 1);
    }

    /// The sequence the next batch should carry, and the last batch's timestamp.
    fn position(&self) -> (Option<u64>, Option<f64>) {
        let state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        (state.next_seq(), state.last_ts())
    }
}

/// Asks `endpoint` for every kept batch from `from` on: `(seq, payload)` up to the end marker.
async fn replay(endpoint: &str, from: u64) -> Result<Vec<(u64, Bytes)>> {
    let mut dealer = DealerSocket::new();
    dealer
        .connect(endpoint)
        .await
        .with_context(|| format!("replay socket {endpoint}"))?;
    let request = vec![Bytes::new(), Bytes::copy_from_slice(&from.to_be_bytes())];
    dealer.send(ZmqMessage::try_from(request).expect("two frames")).await?;
    let mut got = Vec::new();
    loop {
        let reply = tokio::time::timeout(REPLAY_TIMEOUT, dealer.recv())
            .await
            .context("the replay did not answer")??
            .into_vec();
        let [_, seq, payload] = reply.as_slice() else {
            bail!("a replay answer of {} frames", reply.len())
        };
        let seq = i64::from_be_bytes(
            seq.as_ref()
                .try_into()
                .context("a sequence number that is not 8 bytes")?,
        );
        if payload.is_empty() {
            return Ok(got);
        }
        got.push((
            u64::try_from(seq).context("a negative sequence number")?,
            payload.clone(),
        ));
    }
}

/// The watcher's loop: connects, catches up, then applies every batch as it comes.
pub async fn run(source: EventSource, watched: Watched) {
    let mut sub = SubSocket::new();
    while let Err(e) = sub.connect(&source.endpoint).await {
        tracing::warn!(
            "cannot reach the KV event publisher at {}: {e}; retrying",
            source.endpoint
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    if let Err(e) = sub.subscribe(&source.topic).await {
        tracing::warn!("cannot subscribe to {:?}: {e}", source.topic);
    }
    tracing::info!(
        "Watching KV cache events on {} (topic {:?})",
        source.endpoint,
        source.topic
    );
    let mut reader = Reader { source, watched };
    reader.catch_up(0, None).await;
    loop {
        let frames = match sub.recv().await {
            Ok(m) => m.into_vec(),
            Err(e) => {
                tracing::warn!("KV event stream: {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        let [_, seq, payload] = frames.as_slice() else {
            tracing::warn!("a KV event message of {} frames, not 3; skipped", frames.len());
            continue;
        };
        let Ok(seq) = <[u8; 8]>::try_from(seq.as_ref()).map(u64::from_be_bytes) else {
            tracing::warn!("a KV event message whose sequence is not 8 bytes; skipped");
            continue;
        };
        reader.live(seq, payload).await;
    }
}

struct Reader {
    source: EventSource,
    watched: Watched,
}

impl Reader {
    /// A batch from the PUB socket.
    async fn live(&mut self, seq: u64, payload: &[u8]) {
        let batch = match wire::decode_batch(payload) {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!("KV event batch {seq} does not decode: {e:#}");
                return;
            }
        };
        let (next, last_ts) = self.watched.position();
        match next {
            // A sequence already applied: the replay at the start delivered it first, unless the
            // batch is newer than everything applied, which only a restarted publisher sends.
            Some(next) if seq < next => {
                if last_ts.is_some_and(|t| batch.ts <= t) {
                    return;
                }
                tracing::info!("the KV event publisher restarted (sequence {seq} after {})", next - 1);
                self.watched.update(KvWatch::restarted);
                if seq > 0 {
                    self.catch_up(0, Some(seq)).await;
                }
            }
            Some(next) if seq > next => self.catch_up(next, Some(seq)).await,
            None if seq > 0 => self.catch_up(0, Some(seq)).await,
            _ => {}
        }
        self.watched.update(|w| w.apply(seq, batch.ts, &batch.events, false));
    }

    /// Fills `[from, until)` (to the end of the kept batches without `until`) from the replay
    /// socket; every batch in that range it does not hold is counted lost.
    async fn catch_up(&mut self, from: u64, until: Option<u64>) {
        let got = match &self.source.replay {
            Some(endpoint) => replay(endpoint, from).await.unwrap_or_else(|e| {
                tracing::warn!("KV event replay from {from}: {e:#}");
                Vec::new()
            }),
            None => Vec::new(),
        };
        let mut next = from;
        let mut lost = 0;
        for (seq, payload) in got {
            if seq < next || until.is_some_and(|u| seq >= u) {
                continue;
            }
            match wire::decode_batch(&payload) {
                Ok(batch) => {
                    lost += seq - next;
                    self.watched.update(|w| w.apply(seq, batch.ts, &batch.events, true));
                    next = seq.saturating_add(1);
                }
                Err(e) => tracing::warn!("KV event batch {seq} does not decode: {e:#}"),
            }
        }
        lost += until.map_or(0, |u| u.saturating_sub(next));
        if lost > 0 {
            tracing::warn!("{lost} KV event batches from {from} are lost (not kept for replay)");
            self.watched.update(|w| w.lost(lost));
        }
    }
}
