//! The memory timeline: `GET /v1/memory` sampled while the benchmark runs, reduced to bytes per
//! category and the scheduler's queue lengths. The reader is tolerant (missing keys read as 0); a
//! server without the endpoint (vLLM) gives no samples and a note.

use super::client::Http;
use hyper::StatusCode;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{oneshot, Mutex};

/// One reading of `/v1/memory`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// Seconds after the benchmark's start.
    pub t: f64,
    /// Model weights.
    pub weights_bytes: u64,
    /// KV blocks referenced by requests.
    pub kv_in_use_bytes: u64,
    /// Free KV blocks that still hold a prefix-cache hash.
    pub kv_cached_free_bytes: u64,
    /// Vision-encoder outputs kept for reuse.
    pub encoder_cache_bytes: u64,
    /// Preprocessed images kept in host memory (the multimodal processor cache).
    pub processor_cache_bytes: u64,
    /// Transient activations.
    pub activations_bytes: u64,
    /// Requests running.
    pub num_running: u64,
    /// Requests waiting.
    pub num_waiting: u64,
}

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

fn u64_at(v: &Value, pointer: &str) -> Option<u64> {
    v.pointer(pointer).and_then(Value::as_u64)
}

/// Bytes of one ledger category: `[{"category": c, "bytes": n}, …]` or `{c: n | {"bytes": n}}`.
fn ledger(v: &Value, category: &str) -> Option<u64> {
    match v.get("ledger")? {
        Value::Array(entries) => entries
            .iter()
            .find(|e| e.get("category").and_then(Value::as_str) == Some(category))
            .and_then(|e| u64_at(e, "/bytes")),
        Value::Object(map) => map
            .get(category)
            .and_then(|e| e.as_u64().or_else(|| u64_at(e, "/bytes"))),
        _ => None,
    }
}

impl Sample {
    /// Reads a `/v1/memory` answer taken `t` seconds after the start. KV bytes are the ledger's
    /// KV pool shared out over the usable blocks (all but the null block).
    pub fn from_memory(t: f64, v: &Value) -> Sample {
        let kv_pool = ledger(v, "kv_cache").unwrap_or(0) as u128;
        let usable = u64_at(v, "/kv/num_blocks").unwrap_or(0).saturating_sub(1) as u128;
        let kv_share = |pointer: &str| match usable {
            0 => 0,
            n => (kv_pool * u64_at(v, pointer).unwrap_or(0) as u128 / n) as u64,
        };
        let encoder = ledger(v, "encoder_cache")
            .or_else(|| u64_at(v, "/encoder_cache/used_bytes"))
            .or_else(|| Some(u64_at(v, "/encoder_cache/used_tokens")? * u64_at(v, "/encoder_cache/bytes_per_token")?));
        let processor = u64_at(v, "/processor_cache/bytes_used").or_else(|| u64_at(v, "/processor_cache/used_bytes"));
        Sample {
            t,
            weights_bytes: ledger(v, "weights").unwrap_or(0),
            kv_in_use_bytes: kv_share("/kv/num_in_use"),
            kv_cached_free_bytes: kv_share("/kv/num_cached_free"),
            encoder_cache_bytes: encoder.unwrap_or(0),
            processor_cache_bytes: processor.unwrap_or(0),
            activations_bytes: ledger(v, "activations").unwrap_or(0),
            num_running: u64_at(v, "/num_running").unwrap_or(0),
            num_waiting: u64_at(v, "/num_waiting").unwrap_or(0),
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn reads_kvlens_memory() {
        let v = json!({
            "ledger": [
                {"category": "weights", "bytes": 1000, "peak_bytes": 1000},
                {"category": "kv_cache", "bytes": 4000, "peak_bytes": 4000},
                {"category": "encoder_cache", "bytes": 300, "peak_bytes": 900},
                {"category": "activations", "bytes": 50, "peak_bytes": 70},
                {"category": "staging", "bytes": 0, "peak_bytes": 0}
            ],
            "kv": {"num_blocks": 41, "block_size": 16, "num_free": 30, "num_cached_free": 10,
                   "num_in_use": 10, "usage": 0.25, "runs": [["null", 1], ["in_use", 10]]},
            "encoder_cache": {"used_tokens": 3, "bytes_per_token": 100, "entries": []},
            "processor_cache": {"bytes_used": 777, "capacity_bytes": 4096, "entries": []},
            "num_running": 2, "num_waiting": 5, "counters": {}
        });
        let s = Sample::from_memory(1.5, &v);
        assert_eq!(
            s,
            Sample {
                t: 1.5,
                weights_bytes: 1000,
                kv_in_use_bytes: 1000,
                kv_cached_free_bytes: 1000,
                encoder_cache_bytes: 300,
                processor_cache_bytes: 777,
                activations_bytes: 50,
                num_running: 2,
                num_waiting: 5,
            }
        );
    }

    #[test]
    fn tolerates_other_shapes() {
        let v = json!({"ledger": {"weights": 5, "kv_cache": {"bytes": 8}},
                       "encoder_cache": {"used_tokens": 4, "bytes_per_token": 2}});
        let s = Sample::from_memory(0.0, &v);
        assert_eq!((s.weights_bytes, s.encoder_cache_bytes, s.kv_in_use_bytes), (5, 8, 0));
        assert_eq!(Sample::from_memory(0.0, &json!({})), Sample::default());
    }
}
