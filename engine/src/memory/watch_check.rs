//! The planner meets a running server: what `kvlens plan` expects of a vLLM deployment (KV blocks,
//! block size, memory share) beside what its `/metrics` reports, and why they may differ.

use serde::{Deserialize, Serialize};

use super::planner::Plan;
use super::vllm_metrics::VllmMetrics;

/// Planned blocks within this share of the reported ones agree.
const TOLERANCE: f64 = 0.02;

/// The planned figures a watched server is compared with.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlannedKv {
    /// Model planned for.
    pub model: String,
    /// Device preset.
    pub device: String,
    /// Tensor-parallel degree (blocks are per rank).
    pub tensor_parallel_size: usize,
    /// Share of device memory planned.
    pub gpu_memory_utilization: f64,
    /// Tokens per block.
    pub block_size: usize,
    /// KV blocks of one rank.
    pub num_gpu_blocks: u64,
    /// KV bytes of one rank.
    pub available_kv_bytes: i64,
    /// Longest request.
    pub max_model_len: usize,
    /// Weights bytes of one rank.
    pub weights_bytes: u64,
}

impl From<&Plan> for PlannedKv {
    fn from(p: &Plan) -> Self {
        Self {
            model: p.model.clone(),
            device: p.device.clone(),
            tensor_parallel_size: p.tensor_parallel_size,
            gpu_memory_utilization: p.gpu_memory_utilization,
            block_size: p.block_size,
            num_gpu_blocks: p.num_gpu_blocks,
            available_kv_bytes: p.available_kv_bytes,
            max_model_len: p.max_model_len,
            weights_bytes: p.weights_bytes,
        }
    }
}

/// One comparison: what was compared, whether plan and server agree, and what explains it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Finding {
    /// What is compared, e.g. "KV blocks per engine".
    pub what: String,
    /// The planned figure.
    pub planned: String,
    /// The server's figure.
    pub reported: String,
    /// Whether they agree.
    pub agrees: bool,
    /// Why they may differ and what to do, when they do.
    pub note: String,
}

fn finding(what: &str, planned: String, reported: String, agrees: bool, note: &str) -> Finding {
    Finding {
        what: what.into(),
        planned,
        reported,
        agrees,
        note: if agrees { String::new() } else { note.into() },
    }
}

/// Compares the plan with a scrape: memory share, block size, KV blocks per engine, and whether
/// the usage gauge can be trusted. A figure the scrape lacks is not compared.
pub fn compare(plan: &PlannedKv, m: &VllmMetrics) -> Vec<Finding> {
    let mut out = Vec::new();
    if let Some(util) = m.gpu_memory_utilization {
        let agrees = (util - plan.gpu_memory_utilization).abs() < 1e-9;
        out.push(finding(
            "--gpu-memory-utilization",
            format!("{}", plan.gpu_memory_utilization),
            format!("{util}"),
            agrees,
            if (util - 0.92).abs() < 1e-9 {
                "the server runs at 0.92, the default of recent vLLM versions (0.9 in older ones); plan with the server's value"
            } else {
                "the server was started with another share; plan with its value"
            },
        ));
    }
    if let Some(bs) = m.block_size {
        out.push(finding(
            "tokens per block",
            plan.block_size.to_string(),
            bs.to_string(),
            bs == plan.block_size as u64,
            "the server's --block-size differs (vllm-ascend uses 128): plan with it",
        ));
    }
    if let Some(total) = m.num_gpu_blocks {
        let engines = m.engines.max(1) as u64;
        let reported = total / engines;
        let planned = plan.num_gpu_blocks;
        let agrees = (reported as f64 - planned as f64).abs() <= TOLERANCE * planned.max(1) as f64;
        let note = if reported < planned {
            "the server found less KV memory than planned: since v0.21 vLLM's profile counts CUDA-graph \
             memory, and other processes on the device count against it; read the server's start-up \
             log with `kvlens plan --from-log` for the measured figures"
        } else {
            "the server found more KV memory than planned: its activation peak was below the estimate \
             (a smaller --max-num-batched-tokens, fewer images profiled); `kvlens plan --from-log` \
             takes the measured figures"
        };
        out.push(finding(
            "KV blocks per engine",
            planned.to_string(),
            reported.to_string(),
            agrees,
            note,
        ));
    }
    if let Some(total) = m.model_weights_bytes {
        let reported = total / m.engines.max(1) as u64;
        let gib = |b: u64| format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64);
        out.push(finding(
            "weights per engine",
            gib(plan.weights_bytes),
            gib(reported),
            (reported as f64 - plan.weights_bytes as f64).abs() <= TOLERANCE * plan.weights_bytes.max(1) as f64,
            "the server loads other weights than planned: another checkpoint, dtype or quantization",
        ));
    }
    if let Some(negative) = m.negative_usage {
        out.push(finding(
            "vllm:kv_cache_usage_perc",
            "0 to 1".into(),
            format!("{negative}"),
            false,
            "a negative usage is a known vllm-ascend bug (issue 10048): read the blocks from the KV events \
             instead, which count what the server holds",
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn planned() -> PlannedKv {
        PlannedKv {
            model: "Qwen3-VL-8B-Instruct".into(),
            device: "h100-80g".into(),
            tensor_parallel_size: 1,
            gpu_memory_utilization: 0.9,
            block_size: 16,
            num_gpu_blocks: 30_000,
            available_kv_bytes: 30_000 * 16 * 147_456,
            max_model_len: 32_768,
            weights_bytes: 16 << 30,
        }
    }

    #[test]
    fn the_default_share_fewer_blocks_and_a_negative_usage_are_flagged() {
        let m = VllmMetrics::parse(
            "vllm:cache_config_info{block_size=\"16\",engine=\"0\",gpu_memory_utilization=\"0.92\",num_gpu_blocks=\"27000\"} 1.0\n\
             vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} -0.39\n\
             vllm:model_weights_memory_bytes{engine=\"0\",model_name=\"m\"} 1.7179869184e+10\n",
        );
        let f = compare(&planned(), &m);
        let by = |w: &str| f.iter().find(|x| x.what == w).unwrap_or_else(|| panic!("{w}: {f:?}"));
        assert!(!by("--gpu-memory-utilization").agrees);
        assert!(by("--gpu-memory-utilization").note.contains("0.92"));
        assert!(by("tokens per block").agrees);
        let blocks = by("KV blocks per engine");
        assert!(!blocks.agrees && blocks.note.contains("CUDA-graph"), "{blocks:?}");
        assert_eq!((blocks.planned.as_str(), blocks.reported.as_str()), ("30000", "27000"));
        assert!(by("vllm:kv_cache_usage_perc").note.contains("10048"));
        assert!(by("weights per engine").agrees, "{f:?}");
    }

    #[test]
    fn blocks_are_per_engine_and_a_close_count_agrees() {
        let m = VllmMetrics::parse(
            "vllm:cache_config_info{block_size=\"16\",engine=\"0\",gpu_memory_utilization=\"0.9\",num_gpu_blocks=\"29700\"} 1.0\n\
             vllm:cache_config_info{block_size=\"16\",engine=\"1\",gpu_memory_utilization=\"0.9\",num_gpu_blocks=\"29700\"} 1.0\n",
        );
        let f = compare(&planned(), &m);
        assert_eq!(f.len(), 3, "{f:?}");
        assert!(f.iter().all(|x| x.agrees && x.note.is_empty()), "{f:?}");
        // A scrape without these figures compares nothing.
        assert!(compare(&planned(), &VllmMetrics::parse("")).is_empty());
    }
}
