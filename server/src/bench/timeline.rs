//! The memory timeline: `GET /v1/memory` sampled while the benchmark runs, reduced to bytes per
//! category and the scheduler's queue lengths. The reader is tolerant (missing keys read as 0); a
//! server without the endpoint (vLLM) gives no samples and a note.

use super::client::Http;
use hyper::StatusCode;
use serde::{Deserialize, Serialize};
use serde_json::Value;

pub use kvlens_engine::timeline::Sample;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{oneshot, Mutex};

/// `/v1/memory` readings over a run.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Timeline {
    /// The URL sampled.
    pub source: String,
    /// Time between readings.
    pub interval_ms: u64,
    /// Why there are no samples, when there are none.
    pub note: Option<String>,
    /// The readings.
    pub samples: Vec<Sample>,
    /// What the benchmark did to the server while sampling (after the run).
    #[serde(default)]
    pub events: Vec<Event>,
}

/// A request the benchmark sent while the timeline was recorded, e.g. `POST /reset_encoder_cache`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    /// Seconds after the benchmark's start.
    pub t: f64,
    /// The request.
    pub what: String,
    /// Its HTTP status (0 when the server could not be reached).
    pub status: u16,
}

/// One reading of `/v1/memory` at `t0.elapsed()`: the sample, or why there is none.
enum Reading {
    Sample(Sample),
    /// The answer is not kvlens's memory JSON (status and all).
    NotKvlens(StatusCode),
    /// No answer within ten seconds, or a transport error.
    Failed,
}

async fn read_memory(http: &Http, t0: Instant) -> Reading {
    let t = t0.elapsed().as_secs_f64();
    match tokio::time::timeout(Duration::from_secs(10), http.get("/v1/memory")).await {
        Ok(Ok((status, body))) => match serde_json::from_slice::<Value>(&body) {
            Ok(v) if status.is_success() && v.is_object() => Reading::Sample(Sample::from_memory(t, &v)),
            _ => Reading::NotKvlens(status),
        },
        _ => Reading::Failed,
    }
}

/// One sample taken now, for the moments the timeline must show whatever the interval (right
/// before and after a request the benchmark sends).
pub async fn sample_now(http: &Http, t0: Instant) -> Option<Sample> {
    match read_memory(http, t0).await {
        Reading::Sample(s) => Some(s),
        _ => None,
    }
}

/// Samples `/v1/memory` every `interval` from now until `stop` fires, then once more. Stops early
/// with a note when the first answer is not a JSON object (no such endpoint); a reading that fails
/// later is skipped. Each reading holds `quiet`: whoever holds it (the benchmark sending a reset)
/// knows no reading is in flight, so none sent before a request can be answered after it.
pub async fn record(
    http: Http,
    interval: Duration,
    t0: Instant,
    quiet: Arc<Mutex<()>>,
    mut stop: oneshot::Receiver<()>,
) -> Timeline {
    let mut timeline = Timeline {
        source: http.url("/v1/memory"),
        interval_ms: interval.as_millis() as u64,
        ..Timeline::default()
    };
    let mut stopping = false;
    loop {
        let reading = {
            let _quiet = quiet.lock().await;
            read_memory(&http, t0).await
        };
        match reading {
            Reading::Sample(s) => timeline.samples.push(s),
            Reading::NotKvlens(status) if timeline.samples.is_empty() => {
                timeline.note = Some(format!(
                    "{} answered {status}, not kvlens's memory JSON: no memory timeline (not a kvlens server?)",
                    timeline.source
                ));
                return timeline;
            }
            _ => {}
        }
        if stopping {
            return timeline;
        }
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = &mut stop => stopping = true,
        }
    }
}

impl Timeline {
    /// Adds samples taken outside the sampler, keeping the timeline in time order.
    pub fn merge(&mut self, samples: Vec<Sample>) {
        self.samples.extend(samples);
        self.samples.sort_by(|a, b| a.t.total_cmp(&b.t));
    }
}
