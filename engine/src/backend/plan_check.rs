//! Test helpers: the tiny checkpoints, and the check that a backend holds exactly the weight
//! bytes the planner counts.

use crate::arch::weight_format::WeightFormat;

/// The tiny test checkpoints (random weights): each config and its safetensors bytes.
pub(crate) fn tiny_checkpoints() -> Vec<(crate::arch::config::ModelConfig, Vec<u8>)> {
    use crate::arch::spec::tensor_specs;
    use crate::model::random_weights::RandomInit;
    [
        include_str!("../../../tools/golden/configs/qwen2_vl_tiny.json"),
        include_str!("../../../tools/golden/configs/qwen3_vl_tiny.json"),
        include_str!("../../../tools/golden/configs/qwen3_5_tiny.json"),
        // Stacked experts, output-major and transposed; their 12-wide down projections keep f32.
        include_str!("../../../tools/golden/configs/qwen3_5_moe_tiny.json"),
        include_str!("../../../tools/golden/configs/qwen3_vl_moe_tiny.json"),
    ]
    .into_iter()
    .map(|config| {
        let cfg = crate::arch::config::ModelConfig::from_json(config).unwrap();
        let mut bytes = Vec::new();
        RandomInit::new(1, 0.02)
            .write_safetensors(&mut bytes, &tensor_specs(&cfg), |_| {})
            .unwrap();
        (cfg, bytes)
    })
    .collect()
}

/// Loads a checkpoint in every format onto the backend `open` makes for the format and
/// asserts its weights in the ledger are what the planner counts with f32 kept tensors (less
/// the host-side position table), plus `padding(format)` bytes, and are freed with the
/// model; returns the planned totals.
pub(crate) fn assert_the_ledger_is_the_plan<B: crate::backend::Backend>(
    cfg: &crate::arch::config::ModelConfig,
    checkpoint: &[u8],
    open: impl Fn(crate::memory::ledger::MemoryLedger, WeightFormat) -> B,
    padding: impl Fn(WeightFormat) -> u64,
) -> Vec<u64> {
    use crate::arch::spec::tensor_specs;
    use crate::memory::ledger::{Category, MemoryLedger};
    use crate::memory::weights::weight_bytes_per_rank;
    use crate::model::{weights::SafetensorsFiles, QwenVl};
    let shards = [("model.safetensors".to_string(), checkpoint)];
    let source = SafetensorsFiles::parse(&shards).unwrap();
    let host: u64 = tensor_specs(cfg).iter().filter(|t| t.host).map(|t| t.numel() * 4).sum();
    let mut totals = Vec::new();
    for format in WeightFormat::ALL {
        let ledger = MemoryLedger::new();
        let model = QwenVl::load(cfg.clone(), &source, &open(ledger.clone(), format), |_, _| {}).unwrap();
        let planned: u64 = weight_bytes_per_rank(cfg, 1, 4, format).iter().map(|(_, b)| b).sum();
        assert_eq!(
            ledger.bytes(Category::Weights),
            planned - host + padding(format),
            "{format}"
        );
        totals.push(planned);
        drop(model);
        assert_eq!(ledger.bytes(Category::Weights), 0, "{format}: freed with the model");
    }
    totals
}

/// A tiny checkpoint loaded onto the CPU backend holds, per format, exactly the bytes the
/// planner counts (less the host-side position table, which the CPU reads on the host).
#[test]
fn the_cpu_backend_allocates_what_the_planner_counts() {
    use crate::arch::spec::tensor_specs;
    use crate::backend::cpu::CpuBackend;
    use crate::memory::ledger::{Category, MemoryLedger};
    use crate::model::{weights::SafetensorsFiles, QwenVl};
    for (cfg, bytes) in tiny_checkpoints() {
        let totals = assert_the_ledger_is_the_plan(&cfg, &bytes, CpuBackend::with_weights, |_| 0);
        let specs = tensor_specs(&cfg);
        let shards = [("model.safetensors".to_string(), bytes.as_slice())];
        let source = SafetensorsFiles::parse(&shards).unwrap();
        let host: u64 = specs.iter().filter(|t| t.host).map(|t| t.numel() * 4).sum();
        assert!(totals[0] > 3 * totals[1] && totals[1] > totals[2], "{totals:?}");
        // bfloat16 matrices: two bytes per matrix value, four per norm, bias and the patch
        // embedding (the planner's `--dtype bfloat16` counts two for those as well).
        let ledger = MemoryLedger::new();
        let be = CpuBackend::new(ledger.clone()).with_bf16_matrices(true);
        let model = QwenVl::load(cfg.clone(), &source, &be, |_, _| {}).unwrap();
        let want: u64 = specs
            .iter()
            .filter(|t| !t.host)
            .map(|t| {
                t.numel()
                    * if t.shape.len() == 2 || t.experts.is_some() {
                        2
                    } else {
                        4
                    }
            })
            .sum();
        assert_eq!(ledger.bytes(Category::Weights), want);
        assert!(want * 10 < (totals[0] - host) * 6, "{want} vs f32 {}", totals[0] - host);
        drop(model);
    }
}
