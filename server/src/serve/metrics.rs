//! `/metrics`: Prometheus text written by hand, with vLLM's metric names and buckets (label
//! `model_name`) plus `kvlens:` figures for what vLLM does not expose: the encoder cache, the
//! available and free KV bytes, the processor cache's bytes and the ledger.

use kvlens_engine::cache::{BlockEviction, ProcessorCacheStats};
use kvlens_engine::engine::FinishReason;
use kvlens_engine::memory::ledger::Category;
use kvlens_engine::occupancy::Occupancy;
use std::fmt::Write;
use std::sync::Mutex;

/// vLLM's time-to-first-token buckets (seconds).
const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
];

/// vLLM's inter-token latency buckets (seconds).
const ITL_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
];

/// vLLM's request latency buckets (seconds).
const E2E_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
    1920.0, 7680.0,
];

/// vLLM's KV block residency buckets (seconds), `--kv-cache-metrics`.
const KV_BLOCK_BUCKETS: &[f64] = &[
    0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0,
    1200.0, 1800.0,
];

/// A histogram with fixed upper bounds.
#[derive(Debug, Clone)]
struct Histogram {
    bounds: &'static [f64],
    /// Observations per bucket (not cumulative); the last one is `+Inf`.
    counts: Vec<u64>,
    sum: f64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: vec![0; bounds.len() + 1],
            sum: 0.0,
        }
    }

    fn observe(&mut self, x: f64) {
        let i = self.bounds.iter().position(|&b| x <= b).unwrap_or(self.bounds.len());
        self.counts[i] += 1;
        self.sum += x;
    }

    fn write(&self, out: &mut String, name: &str, help: &str, labels: &str) {
        header(out, name, help, "histogram");
        let mut cumulative = 0;
        for (i, count) in self.counts.iter().enumerate() {
            cumulative += count;
            let le = self.bounds.get(i).map_or("+Inf".to_string(), |b| b.to_string());
            let _ = writeln!(out, "{name}_bucket{{le=\"{le}\",{labels}}} {cumulative}");
        }
        let _ = writeln!(out, "{name}_count{{{labels}}} {cumulative}");
        let _ = writeln!(out, "{name}_sum{{{labels}}} {}", self.sum);
    }
}

#[derive(Debug)]
struct Inner {
    ttft: Histogram,
    itl: Histogram,
    e2e: Histogram,
    prompt_tokens: u64,
    generation_tokens: u64,
    /// Finished requests: stop, length, abort, error.
    finished: [u64; REASONS.len()],
    /// Requests whose client left before they reached the engine.
    cancelled_before_queue: u64,
    /// Sampled KV blocks' lifetime, idle time before eviction and reuse gaps (with
    /// `--kv-cache-metrics` only, as in vLLM).
    kv_blocks: Option<[Histogram; 3]>,
}

/// Request-level figures the engine thread records, and the fixed facts shown beside them.
#[derive(Debug)]
pub struct Metrics {
    inner: Mutex<Inner>,
    /// `vllm:cache_config_info`'s labels but `num_gpu_blocks` (read from the engine).
    cache_config: Vec<(&'static str, String)>,
}

/// Figures read at scrape time.
#[derive(Debug)]
pub struct Gauges<'a> {
    /// The engine's latest published occupancy.
    pub occupancy: &'a Occupancy,
    /// Bytes the processor cache holds.
    pub processor_cache_bytes: u64,
    /// Items the processor cache holds.
    pub processor_cache_entries: usize,
    /// The processor cache's lookups and hits.
    pub processor_cache_stats: ProcessorCacheStats,
}

const REASONS: [&str; 4] = ["stop", "length", "abort", "error"];

fn reason_index(reason: FinishReason) -> usize {
    match reason {
        FinishReason::Stop => 0,
        FinishReason::Length => 1,
        FinishReason::Abort => 2,
        FinishReason::Error => 3,
    }
}

fn header(out: &mut String, name: &str, help: &str, kind: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

/// One sample (`name` is the family; counters get `_total` as prometheus_client writes them).
fn sample(out: &mut String, name: &str, help: &str, kind: &str, labels: &str, value: impl std::fmt::Display) {
    header(out, name, help, kind);
    let suffix = if kind == "counter" { "_total" } else { "" };
    let _ = writeln!(out, "{name}{suffix}{{{labels}}} {value}");
}

/// A family of one sample per value of `label` (`name{label="value",labels}`).
fn by_label<V: std::fmt::Display>(
    out: &mut String,
    (name, help, kind): (&str, &str, &str),
    label: &str,
    values: impl IntoIterator<Item = (impl std::fmt::Display, V)>,
    labels: &str,
) {
    header(out, name, help, kind);
    let suffix = if kind == "counter" { "_total" } else { "" };
    for (value_of_label, value) in values {
        let value_of_label = escape(&value_of_label.to_string());
        let _ = writeln!(out, "{name}{suffix}{{{label}=\"{value_of_label}\",{labels}}} {value}");
    }
}

/// A label value with `\`, `"` and newlines escaped.
fn escape(value: &str) -> String {
    value.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

impl Metrics {
    /// Empty figures; `kv_block_metrics` adds vLLM's sampled KV block histograms;
    /// `cache_config` labels `vllm:cache_config_info`.
    pub fn new(kv_block_metrics: bool, cache_config: Vec<(&'static str, String)>) -> Self {
        Metrics {
            inner: Mutex::new(Inner {
                ttft: Histogram::new(TTFT_BUCKETS),
                itl: Histogram::new(ITL_BUCKETS),
                e2e: Histogram::new(E2E_BUCKETS),
                prompt_tokens: 0,
                generation_tokens: 0,
                finished: [0; REASONS.len()],
                cancelled_before_queue: 0,
                kv_blocks: kv_block_metrics.then(|| [0; 3].map(|_| Histogram::new(KV_BLOCK_BUCKETS))),
            }),
            cache_config,
        }
    }

    /// Sampled KV blocks were evicted.
    pub fn kv_blocks_evicted(&self, evictions: &[BlockEviction]) {
        if evictions.is_empty() {
            return;
        }
        self.with(|m| {
            if let Some([lifetime, idle, gaps]) = &mut m.kv_blocks {
                for e in evictions {
                    lifetime.observe(e.lifetime);
                    idle.observe(e.idle);
                    e.reuse_gaps.iter().for_each(|&g| gaps.observe(g));
                }
            }
        });
    }

    fn with<R>(&self, f: impl FnOnce(&mut Inner) -> R) -> R {
        f(&mut self.inner.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// A request whose client left before it reached the engine (while it was read or
    /// preprocessed).
    pub fn cancelled_before_queue(&self) {
        self.with(|m| m.cancelled_before_queue += 1);
    }

    /// A request's first token, `ttft` seconds after it arrived.
    pub fn first_token(&self, ttft: f64, prompt_tokens: usize) {
        self.with(|m| {
            m.ttft.observe(ttft);
            m.prompt_tokens += prompt_tokens as u64;
            m.generation_tokens += 1;
        });
    }

    /// A later token, `gap` seconds after the one before.
    pub fn next_token(&self, gap: f64) {
        self.with(|m| {
            m.itl.observe(gap);
            m.generation_tokens += 1;
        });
    }

    /// A request ended, `e2e` seconds after it arrived.
    pub fn finished(&self, reason: FinishReason, e2e: f64) {
        self.with(|m| {
            m.e2e.observe(e2e);
            m.finished[reason_index(reason)] += 1;
        });
    }

    /// The Prometheus text exposition.
    pub fn render(&self, model_name: &str, g: &Gauges<'_>) -> String {
        let labels = format!("model_name=\"{}\"", escape(model_name));
        let l = labels.as_str();
        let snap = &g.occupancy.engine;
        let prefix = &g.occupancy.prefix_cache;
        let enc = &snap.encoder_cache;
        let mut out = String::new();
        let o = &mut out;
        #[rustfmt::skip]
        let engine: [(&str, &str, &str, f64); 6] = [
            ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", snap.num_running as f64),
            ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", snap.num_waiting as f64),
            ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", snap.kv.usage),
            ("vllm:prefix_cache_queries", "counter", "Prefix cache queries, in queried tokens.", prefix.queries as f64),
            ("vllm:prefix_cache_hits", "counter", "Prefix cache hits, in cached tokens.", prefix.hits as f64),
            ("vllm:num_preemptions", "counter", "Cumulative number of preemptions.", snap.counters.num_preemptions as f64),
        ];
        for (name, kind, help, value) in engine {
            sample(o, name, help, kind, l, value);
        }
        let waiting = (
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling capacity; \
             'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked status). Sum of all \
             reasons equals vllm:num_requests_waiting.",
            "gauge",
        );
        by_label(
            o,
            waiting,
            "reason",
            [("capacity", snap.num_waiting), ("deferred", 0)],
            l,
        );
        let c = &snap.counters;
        let by_source = (
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            "counter",
        );
        let sources = [
            ("local_compute", c.prompt_tokens_computed),
            ("local_cache_hit", c.prompt_tokens_cached),
            ("external_kv_transfer", 0),
        ];
        by_label(o, by_source, "source", sources, l);
        let help = "Number of cached prompt tokens (local + external).";
        sample(
            o,
            "vllm:prompt_tokens_cached",
            help,
            "counter",
            l,
            c.prompt_tokens_cached,
        );
        let p = g.processor_cache_stats;
        let help = "Multi-modal cache queries, in terms of number of queried items.";
        sample(o, "vllm:mm_cache_queries", help, "counter", l, p.queries);
        let help = "Multi-modal cache hits, in terms of number of cached items.";
        sample(o, "vllm:mm_cache_hits", help, "counter", l, p.hits);
        let bytes = |c: Category| snap.ledger.iter().find(|e| e.category == c).map_or(0, |e| e.bytes);
        let help = "GPU memory used by model weights in bytes (static after load).";
        sample(
            o,
            "vllm:model_weights_memory_bytes",
            help,
            "gauge",
            l,
            bytes(Category::Weights),
        );
        header(
            o,
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            "gauge",
        );
        let mut info: Vec<(&str, String)> = self.cache_config.clone();
        info.push(("num_gpu_blocks", snap.kv.num_blocks.to_string()));
        info.push(("engine", "0".into()));
        info.sort();
        let info: Vec<String> = info.iter().map(|(k, v)| format!("{k}=\"{}\"", escape(v))).collect();
        let _ = writeln!(o, "vllm:cache_config_info{{{}}} 1.0", info.join(","));
        let kv_bytes = bytes(Category::KvCache);
        let free_bytes = kv_bytes * snap.kv.num_free as u64 / snap.kv.num_blocks.max(1) as u64;
        let help = "KV cache memory allocated at start-up (vLLM's 'Available KV cache memory').";
        sample(o, "kvlens:kv_cache_memory_bytes", help, "gauge", l, kv_bytes);
        let help = "KV cache bytes in free blocks (cached-but-unreferenced blocks count as free).";
        sample(o, "kvlens:kv_cache_free_bytes", help, "gauge", l, free_bytes);
        self.with(|m| {
            sample(
                o,
                "vllm:prompt_tokens",
                "Number of prefill tokens processed.",
                "counter",
                l,
                m.prompt_tokens,
            );
            let help = "Number of generation tokens processed.";
            sample(o, "vllm:generation_tokens", help, "counter", l, m.generation_tokens);
            let success = ("vllm:request_success", "Count of finished requests.", "counter");
            by_label(o, success, "finished_reason", REASONS.iter().zip(m.finished), l);
            let help = "Requests whose client left before they reached the engine.";
            sample(
                o,
                "kvlens:requests_cancelled_before_queue",
                help,
                "counter",
                l,
                m.cancelled_before_queue,
            );
            let help = "Histogram of time to first token in seconds.";
            m.ttft.write(o, "vllm:time_to_first_token_seconds", help, l);
            let help = "Histogram of inter-token latency in seconds.";
            m.itl.write(o, "vllm:inter_token_latency_seconds", help, l);
            let help = "Histogram of e2e request latency in seconds.";
            m.e2e.write(o, "vllm:e2e_request_latency_seconds", help, l);
            if let Some([lifetime, idle, gaps]) = &m.kv_blocks {
                let sampled = "Sampled metrics (controlled by --kv-cache-metrics-sample).";
                let help = format!("Histogram of KV cache block lifetime from allocation to eviction. {sampled}");
                lifetime.write(o, "vllm:kv_block_lifetime_seconds", &help, l);
                let help = format!("Histogram of idle time before KV cache block eviction. {sampled}");
                idle.write(o, "vllm:kv_block_idle_before_evict_seconds", &help, l);
                let help = format!(
                    "Histogram of time gaps between consecutive KV cache block accesses. Only the most recent \
                     accesses are recorded (ring buffer). {sampled}"
                );
                gaps.write(o, "vllm:kv_block_reuse_gap_seconds", &help, l);
            }
        });
        #[rustfmt::skip]
        let kvlens: [(&str, &str, &str, u64); 8] = [
            ("kvlens:encoder_cache_used_tokens", "gauge", "Encoder-cache tokens held.", enc.used_tokens as u64),
            ("kvlens:encoder_cache_used_bytes", "gauge", "Encoder-cache bytes held.", enc.used_bytes),
            ("kvlens:encoder_cache_entries", "gauge", "Encoder-cache entries.", enc.entries.len() as u64),
            ("kvlens:vision_tower_runs", "counter", "Images encoded by the vision tower.", snap.counters.vision_runs),
            ("kvlens:encoder_cache_hits", "counter", "Images whose encoder output was reused.", snap.counters.encoder_hits),
            ("kvlens:prefix_cached_images", "counter", "Images the prefix cache already held (no encoder needed).", snap.counters.prefix_cached_images),
            ("kvlens:processor_cache_bytes", "gauge", "Host bytes of preprocessed images.", g.processor_cache_bytes),
            ("kvlens:processor_cache_entries", "gauge", "Preprocessed images held.", g.processor_cache_entries as u64),
        ];
        for (name, kind, help, value) in kvlens {
            sample(o, name, help, kind, l, value);
        }
        let memory = (
            "kvlens:memory_bytes",
            "Bytes the backend holds, by ledger category.",
            "gauge",
        );
        let categories = snap.ledger.iter().map(|e| {
            let category = serde_json::to_value(e.category).ok();
            let name = category
                .as_ref()
                .and_then(|c| c.as_str())
                .unwrap_or("unknown")
                .to_owned();
            (name, e.bytes)
        });
        by_label(o, memory, "category", categories, l);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative_with_inf() {
        let mut h = Histogram::new(&[0.1, 1.0]);
        for x in [0.05, 0.1, 0.5, 3.0] {
            h.observe(x);
        }
        let mut out = String::new();
        h.write(&mut out, "x", "help", "model_name=\"m\"");
        assert!(out.contains("x_bucket{le=\"0.1\",model_name=\"m\"} 2\n"), "{out}");
        assert!(out.contains("x_bucket{le=\"1\",model_name=\"m\"} 3\n"), "{out}");
        assert!(out.contains("x_bucket{le=\"+Inf\",model_name=\"m\"} 4\n"), "{out}");
        assert!(out.contains("x_count{model_name=\"m\"} 4\n"), "{out}");
        assert!(out.contains("x_sum{model_name=\"m\"} 3.65\n"), "{out}");
        assert!(out.starts_with("# HELP x help\n# TYPE x histogram\n"));
    }

    #[test]
    fn counters_get_total_and_labels_are_escaped() {
        let mut out = String::new();
        sample(
            &mut out,
            "vllm:prompt_tokens",
            "h",
            "counter",
            &format!("model_name=\"{}\"", escape("a\"b")),
            7,
        );
        assert!(
            out.ends_with("vllm:prompt_tokens_total{model_name=\"a\\\"b\"} 7\n"),
            "{out}"
        );
    }
}
