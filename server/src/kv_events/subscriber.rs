//! The other end: a SUB socket on a vLLM (or kvlens) publisher, the way vLLM's example subscriber
//! reads it, into a [`KvWatch`]. A late start and every gap are filled from the replay socket
//! (a DEALER, which takes the many answers a replay sends); a sequence that goes back means the
//! publisher restarted, and the resident set starts over from the new publisher's first batch.

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

    fn next_seq(&self) -> Option<u64> {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).next_seq()
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
    let mut reader = Reader {
        source,
        watched,
        floor: 0,
    };
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
    /// Sequences below `next` but at least this are duplicates of a replay, not a restart.
    floor: u64,
}

impl Reader {
    /// A batch from the PUB socket.
    async fn live(&mut self, seq: u64, payload: &[u8]) {
        match self.watched.next_seq() {
            Some(next) if seq < next && seq >= self.floor => return, // already replayed
            Some(next) if seq < next => {
                tracing::info!("the KV event publisher restarted (sequence {seq} after {})", next - 1);
                self.watched.update(KvWatch::restarted);
                self.catch_up(0, Some(seq)).await;
            }
            Some(next) if seq > next => self.catch_up(next, Some(seq)).await,
            None if seq > 0 => self.catch_up(0, Some(seq)).await,
            _ => {}
        }
        self.apply(seq, payload, false);
        self.floor = seq + 1;
    }

    /// Fills `[from, until)` (to the end of the kept batches without `until`) from the replay
    /// socket; whatever it cannot fill is counted lost.
    async fn catch_up(&mut self, from: u64, until: Option<u64>) {
        let got = match &self.source.replay {
            Some(endpoint) => replay(endpoint, from).await.unwrap_or_else(|e| {
                tracing::warn!("KV event replay from {from}: {e:#}");
                Vec::new()
            }),
            None => Vec::new(),
        };
        let mut next = from;
        for (seq, payload) in got {
            if seq >= next && until.is_none_or(|u| seq < u) {
                self.apply(seq, &payload, true);
                next = seq + 1;
            }
        }
        if let Some(until) = until.filter(|&u| u > next) {
            let lost = until - next;
            tracing::warn!("{lost} KV event batches before {until} are lost (not kept for replay)");
            self.watched.update(|w| w.lost(lost));
        }
        self.floor = from;
    }

    fn apply(&self, seq: u64, payload: &[u8], replayed: bool) {
        match wire::decode_batch(payload) {
            Ok(batch) => self.watched.update(|w| w.apply(seq, batch.ts, &batch.events, replayed)),
            Err(e) => tracing::warn!("KV event batch {seq} does not decode: {e:#}"),
        }
    }
}
