//! Device presets: the memory the runtime reports as total, bandwidth and peak half-precision
//! throughput (for roofline figures), plus the platform defaults vLLM derives from them.

use super::GIB;

/// Which runtime family a device belongs to; decides vLLM's platform defaults.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Platform {
    /// NVIDIA GPU under vLLM.
    Cuda,
    /// Huawei Ascend NPU under vllm-ascend (block size 128).
    Ascend,
    /// Apple unified memory.
    Metal,
    /// A browser's WebGPU adapter.
    WebGpu,
    /// Host memory (the CPU backend).
    Cpu,
}

/// One device preset.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct DeviceProfile {
    /// Preset name as `--device` spells it.
    pub name: String,
    /// What it is.
    pub description: String,
    /// Runtime family.
    pub platform: Platform,
    /// Total memory as the runtime reports it (`torch.cuda.mem_get_info()[1]` and friends).
    pub total_bytes: u64,
    /// Peak memory bandwidth, bytes per second.
    pub bandwidth_bytes_per_s: f64,
    /// Peak dense bf16/fp16 tensor throughput, FLOP per second.
    pub peak_flops: f64,
    /// Non-torch memory a worker typically adds (driver context, communication buffers), bytes.
    pub non_torch_bytes: u64,
}

impl DeviceProfile {
    /// vLLM's default KV block size on this platform (CUDA 16, Ascend 128).
    pub fn default_block_size(&self) -> usize {
        if self.platform == Platform::Ascend {
            128
        } else {
            16
        }
    }

    /// vLLM's `EngineArgs` defaults for the API server: (`max_num_batched_tokens`, `max_num_seqs`).
    /// Devices with at least 70 GiB that are not an A100 get 8192 / 1024, the rest 2048 / 256.
    pub fn default_scheduler_limits(&self) -> (usize, usize) {
        let big = self.total_bytes as f64 >= 70.0 * GIB && !self.name.starts_with("a100");
        if big {
            (8192, 1024)
        } else {
            (2048, 256)
        }
    }

    /// A profile with a custom total, keeping the rest.
    pub fn with_total_bytes(mut self, total: u64) -> Self {
        self.total_bytes = total;
        self
    }
}

struct Preset {
    name: &'static str,
    description: &'static str,
    platform: Platform,
    total_gib: f64,
    bandwidth_gb_s: f64,
    tflops: f64,
    non_torch_gib: f64,
}

/// Totals are what the runtime reports (a few GiB under the marketing size); bandwidth and
/// TFLOP/s are the vendors' dense peak figures.
const PRESETS: &[Preset] = &[
    Preset {
        name: "h100-80g",
        description: "NVIDIA H100 SXM 80 GB HBM3",
        platform: Platform::Cuda,
        total_gib: 79.19,
        bandwidth_gb_s: 3350.0,
        tflops: 989.0,
        non_torch_gib: 0.5,
    },
    Preset {
        name: "h200-141g",
        description: "NVIDIA H200 SXM 141 GB HBM3e",
        platform: Platform::Cuda,
        total_gib: 139.81,
        bandwidth_gb_s: 4800.0,
        tflops: 989.0,
        non_torch_gib: 0.5,
    },
    Preset {
        name: "a100-40g",
        description: "NVIDIA A100 40 GB",
        platform: Platform::Cuda,
        total_gib: 39.39,
        bandwidth_gb_s: 1555.0,
        tflops: 312.0,
        non_torch_gib: 0.5,
    },
    Preset {
        name: "a100-80g",
        description: "NVIDIA A100 80 GB",
        platform: Platform::Cuda,
        total_gib: 79.15,
        bandwidth_gb_s: 2039.0,
        tflops: 312.0,
        non_torch_gib: 0.5,
    },
    Preset {
        name: "l40s-48g",
        description: "NVIDIA L40S 48 GB",
        platform: Platform::Cuda,
        total_gib: 44.39,
        bandwidth_gb_s: 864.0,
        tflops: 362.0,
        non_torch_gib: 0.5,
    },
    Preset {
        name: "rtx4090-24g",
        description: "NVIDIA GeForce RTX 4090 24 GB",
        platform: Platform::Cuda,
        total_gib: 23.64,
        bandwidth_gb_s: 1008.0,
        tflops: 165.0,
        non_torch_gib: 0.5,
    },
    Preset {
        name: "ascend-910b-64g",
        description: "Huawei Ascend 910B 64 GB",
        platform: Platform::Ascend,
        total_gib: 60.96,
        bandwidth_gb_s: 1600.0,
        tflops: 313.0,
        non_torch_gib: 0.56,
    },
    Preset {
        name: "apple-m2-max-32g",
        description: "Apple M2 Max, 32 GB unified memory",
        platform: Platform::Metal,
        total_gib: 32.0,
        bandwidth_gb_s: 400.0,
        tflops: 13.6,
        non_torch_gib: 0.3,
    },
    Preset {
        name: "cpu",
        description: "Host memory of kvlens's CPU backend (set the size with --total-memory-gib)",
        platform: Platform::Cpu,
        total_gib: 16.0,
        bandwidth_gb_s: 25.0,
        tflops: 1.0,
        non_torch_gib: 0.0,
    },
    Preset {
        name: "webgpu-4g",
        description: "WebGPU laptop adapter, 4 GiB budget",
        platform: Platform::WebGpu,
        total_gib: 4.0,
        bandwidth_gb_s: 100.0,
        tflops: 4.0,
        non_torch_gib: 0.05,
    },
    Preset {
        name: "webgpu-8g",
        description: "WebGPU laptop adapter, 8 GiB budget",
        platform: Platform::WebGpu,
        total_gib: 8.0,
        bandwidth_gb_s: 200.0,
        tflops: 8.0,
        non_torch_gib: 0.05,
    },
];

/// Bytes of `gib` GiB, rounded to the nearest byte.
pub fn gib_to_bytes(gib: f64) -> u64 {
    (gib * GIB).round() as u64
}

/// Every preset.
pub fn device_presets() -> Vec<DeviceProfile> {
    PRESETS
        .iter()
        .map(|p| DeviceProfile {
            name: p.name.to_string(),
            description: p.description.to_string(),
            platform: p.platform,
            total_bytes: if p.platform == Platform::Ascend {
                // What a 64 GB 910B reports (vllm-ascend logs "total memory: 65452113920").
                65_452_113_920
            } else {
                gib_to_bytes(p.total_gib)
            },
            bandwidth_bytes_per_s: p.bandwidth_gb_s * 1e9,
            peak_flops: p.tflops * 1e12,
            non_torch_bytes: gib_to_bytes(p.non_torch_gib),
        })
        .collect()
}

/// Finds a preset by name (case-insensitive).
pub fn device_preset(name: &str) -> Option<DeviceProfile> {
    device_presets().into_iter().find(|d| d.name.eq_ignore_ascii_case(name))
}

/// A CUDA device seen at run time: the preset its name matches (bandwidth, peak FLOP/s, vLLM's
/// defaults), the H100's when none does, with its name as the description and the measured total.
pub fn cuda_device(device_name: &str, total_bytes: u64) -> DeviceProfile {
    let n = device_name.to_ascii_lowercase();
    let preset = if n.contains("h200") {
        "h200-141g"
    } else if n.contains("a100") && total_bytes as f64 > 50.0 * GIB {
        "a100-80g"
    } else if n.contains("a100") {
        "a100-40g"
    } else if n.contains("l40s") {
        "l40s-48g"
    } else if n.contains("4090") {
        "rtx4090-24g"
    } else {
        "h100-80g"
    };
    let mut d = device_preset(preset)
        .expect("the CUDA presets exist")
        .with_total_bytes(total_bytes);
    d.description = device_name.to_string();
    d
}

/// Comma-separated preset names, for error messages.
pub fn device_preset_names() -> String {
    PRESETS.iter().map(|p| p.name).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cuda_device_takes_the_preset_its_name_matches_and_its_measured_total() {
        let d = cuda_device("NVIDIA A100-SXM4-80GB", 85_100_000_000);
        assert_eq!((d.name.as_str(), d.total_bytes), ("a100-80g", 85_100_000_000));
        assert_eq!(d.description, "NVIDIA A100-SXM4-80GB");
        assert_eq!(cuda_device("NVIDIA A100-PCIE-40GB", 42_000_000_000).name, "a100-40g");
        assert_eq!(cuda_device("NVIDIA H100 80GB HBM3", 85_000_000_000).name, "h100-80g");
        assert_eq!(cuda_device("Tesla T4", 15_000_000_000).platform, Platform::Cuda);
    }

    #[test]
    fn presets_and_platform_defaults() {
        assert_eq!(device_presets().len(), 11);
        let ascend = device_preset("Ascend-910B-64G").unwrap();
        assert_eq!(ascend.default_block_size(), 128);
        assert_eq!(format!("{:.2}", ascend.total_bytes as f64 / GIB), "60.96");
        assert_eq!(ascend.default_scheduler_limits(), (2048, 256));
        let h100 = device_preset("h100-80g").unwrap();
        assert_eq!(
            (h100.default_block_size(), h100.default_scheduler_limits()),
            (16, (8192, 1024))
        );
        assert_eq!(
            device_preset("a100-80g").unwrap().default_scheduler_limits(),
            (2048, 256)
        );
        assert!(device_preset("tpu").is_none());
        assert!(device_preset_names().contains("webgpu-8g"));
    }
}
