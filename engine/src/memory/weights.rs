//! Parameters per tensor-parallel rank, counted from the model's [`TensorSpec`](crate::arch::spec::TensorSpec)
//! list: how many each part has and how vLLM splits them across ranks (column/row-parallel layers
//! split, norms, patch embedding and row-parallel biases replicated, KV heads replicated when there
//! are fewer than ranks).

use crate::arch::config::ModelConfig;
use crate::arch::spec::{tensor_specs, ExpertLayout, TensorSpec};
pub use crate::arch::spec::{Part, Shard};
use crate::arch::weight_format::WeightFormat;

/// A group of parameters with one sharding rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParamGroup {
    /// Part of the model.
    pub part: Part,
    /// What it is, for display.
    pub name: &'static str,
    /// Parameters in the whole model.
    pub numel: u64,
    /// How ranks share it (its first tensor's layout; a group's tensors are all replicated, all
    /// split, or all K/V heads).
    pub shard: Shard,
}

impl ParamGroup {
    /// Parameters one of `tp` ranks holds: a split group's total is divided as one, `ceil(numel / tp)`.
    pub fn numel_per_rank(&self, tp: usize) -> u64 {
        let tp = tp.max(1) as u64;
        match self.shard {
            Shard::Replicated => self.numel,
            Shard::Split(_) => self.numel.div_ceil(tp),
            Shard::KvHeads(heads) => {
                let heads = heads.max(1) as u64;
                self.numel / heads * (heads / tp).max(1)
            }
        }
    }
}

/// Parameter totals by part.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct ParamCounts {
    /// Vision tower with mergers.
    pub vision: u64,
    /// Language model including embedding and head.
    pub text: u64,
    /// Embedding matrix.
    pub embedding: u64,
    /// Untied output head (0 when tied).
    pub lm_head: u64,
    /// Everything.
    pub total: u64,
}

/// Lists every parameter group of the model: its tensors summed by [`TensorSpec::group`](crate::arch::spec::TensorSpec::group),
/// in order of first appearance.
pub fn param_groups(cfg: &ModelConfig) -> Vec<ParamGroup> {
    groups_of(tensor_specs(cfg))
}

fn groups_of(specs: impl IntoIterator<Item = TensorSpec>) -> Vec<ParamGroup> {
    let mut groups: Vec<ParamGroup> = Vec::new();
    for t in specs {
        match groups.iter_mut().find(|g| g.name == t.group) {
            Some(g) => g.numel += t.numel(),
            None => groups.push(ParamGroup {
                part: t.part,
                name: t.group,
                numel: t.numel(),
                shard: t.shard,
            }),
        }
    }
    groups
}

/// Parameter counts by part.
pub fn param_counts(cfg: &ModelConfig) -> ParamCounts {
    let mut c = ParamCounts::default();
    for grp in param_groups(cfg) {
        match grp.part {
            Part::Vision => c.vision += grp.numel,
            Part::Text => c.text += grp.numel,
            Part::Embedding => {
                c.embedding += grp.numel;
                c.text += grp.numel;
            }
            Part::LmHead => {
                c.lm_head += grp.numel;
                c.text += grp.numel;
            }
        }
    }
    c.total = c.vision + c.text;
    c
}

/// The matrices a backend stores for the slice of `t` one of `tp` ranks holds: how many, and the
/// shape of each. One, or one `[out, in]` per expert of a stacked expert tensor, as the loader
/// splits it.
fn rank_matrices(t: &TensorSpec, tp: usize) -> (u64, Vec<usize>) {
    let shape = rank_shape(t, tp);
    match (t.experts, &shape[..]) {
        (Some(ExpertLayout::OutputMajor), &[n, out, inp]) | (Some(ExpertLayout::InputMajor), &[n, inp, out]) => {
            (n as u64, vec![out, inp])
        }
        _ => (1, shape),
    }
}

/// The shape of the slice of `t` one of `tp` ranks holds.
fn rank_shape(t: &TensorSpec, tp: usize) -> Vec<usize> {
    let mut shape = t.shape.clone();
    match t.shard {
        Shard::Replicated => {}
        Shard::Split(d) => shape[d] = shape[d].div_ceil(tp.max(1)),
        Shard::KvHeads(heads) => {
            let heads = heads.max(1);
            shape[0] = shape[0] / heads * (heads / tp.max(1)).max(1);
        }
    }
    shape
}

/// Bytes of weights one tensor-parallel rank holds, per part, for element size `dtype_bytes`,
/// with the matrices `format` quantizes (on each rank's slice, as a loader quantizing its shard
/// would) in their blocks.
pub fn weight_bytes_per_rank(cfg: &ModelConfig, tp: usize, dtype_bytes: u64, format: WeightFormat) -> Vec<(Part, u64)> {
    let (quantized, kept): (Vec<TensorSpec>, Vec<TensorSpec>) = tensor_specs(cfg)
        .into_iter()
        .partition(|t| !t.host && format.quantizes(&rank_matrices(t, tp).1));
    let kept = groups_of(kept)
        .into_iter()
        .map(|grp| (grp.part, grp.numel_per_rank(tp) * dtype_bytes));
    let quantized = quantized.iter().map(|t| {
        let (n, shape) = rank_matrices(t, tp);
        (t.part, n * format.tensor_bytes(&shape, dtype_bytes))
    });
    let mut out: Vec<(Part, u64)> = Vec::new();
    for (part, bytes) in kept.chain(quantized) {
        match out.iter_mut().find(|(p, _)| *p == part) {
            Some((_, b)) => *b += bytes,
            None => out.push((part, bytes)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::config::{bundled_config, BUNDLED_CONFIGS};

    /// (name, vision, text, embed, lm_head, total) of the published checkpoints; each total is what
    /// the model's safetensors index gives, `metadata.total_size` / 2 (bf16), at
    /// `https://huggingface.co/Qwen/<name>/blob/main/model.safetensors.index.json`.
    const TABLE: &[(&str, u64, u64, u64, u64, u64)] = &[
        (
            "Qwen2-VL-2B-Instruct",
            665_271_296,
            1_543_714_304,
            233_373_696,
            0,
            2_208_985_600,
        ),
        (
            "Qwen2-VL-7B-Instruct",
            675_759_104,
            7_615_616_512,
            544_997_376,
            544_997_376,
            8_291_375_616,
        ),
        (
            "Qwen2-VL-72B-Instruct",
            699_356_672,
            72_706_203_648,
            1_245_708_288,
            1_245_708_288,
            73_405_560_320,
        ),
        (
            "Qwen2.5-VL-3B-Instruct",
            668_684_288,
            3_085_938_688,
            311_164_928,
            0,
            3_754_622_976,
        ),
        (
            "Qwen2.5-VL-7B-Instruct",
            676_550_144,
            7_615_616_512,
            544_997_376,
            544_997_376,
            8_292_166_656,
        ),
        (
            "Qwen2.5-VL-32B-Instruct",
            688_841_984,
            32_763_876_352,
            778_567_680,
            778_567_680,
            33_452_718_336,
        ),
        (
            "Qwen2.5-VL-72B-Instruct",
            704_573_696,
            72_706_203_648,
            1_245_708_288,
            1_245_708_288,
            73_410_777_344,
        ),
        (
            "Qwen3-VL-2B-Instruct",
            406_957_056,
            1_720_574_976,
            311_164_928,
            0,
            2_127_532_032,
        ),
        (
            "Qwen3-VL-4B-Instruct",
            415_347_712,
            4_022_468_096,
            388_956_160,
            0,
            4_437_815_808,
        ),
        (
            "Qwen3-VL-8B-Instruct",
            576_388_336,
            8_190_735_360,
            622_329_856,
            622_329_856,
            8_767_123_696,
        ),
        (
            "Qwen3-VL-32B-Instruct",
            595_266_800,
            32_762_123_264,
            777_912_320,
            777_912_320,
            33_357_390_064,
        ),
        (
            "Qwen3-VL-30B-A3B-Instruct",
            538_631_408,
            30_532_122_624,
            311_164_928,
            311_164_928,
            31_070_754_032,
        ),
        (
            "Qwen3-VL-235B-A22B-Instruct",
            576_388_336,
            235_093_634_560,
            622_329_856,
            622_329_856,
            235_670_022_896,
        ),
        // Qwen3.5: transformers 5.24's `Qwen3_5ForConditionalGeneration` (`…Moe…` for the
        // mixtures of experts) built from each config on
        // the meta device (the checkpoints' multi-token-prediction layer, which vLLM loads only for
        // speculative decoding, is not part of it).
        ("Qwen3.5-0.8B", 100_592_896, 752_393_024, 254_279_680, 0, 852_985_920),
        ("Qwen3.5-2B", 331_416_576, 1_881_825_088, 508_559_360, 0, 2_213_241_664),
        ("Qwen3.5-4B", 333_514_240, 4_205_751_296, 635_699_200, 0, 4_539_265_536),
        (
            "Qwen3.5-9B",
            456_010_480,
            8_953_803_264,
            1_017_118_720,
            1_017_118_720,
            9_409_813_744,
        ),
        (
            "Qwen3.5-27B",
            460_730_096,
            26_895_998_464,
            1_271_398_400,
            1_271_398_400,
            27_356_728_560,
        ),
        (
            "Qwen3.5-35B-A3B",
            446_571_248,
            34_660_610_688,
            508_559_360,
            508_559_360,
            35_107_181_936,
        ),
        (
            "Qwen3.5-122B-A10B",
            451_290_864,
            122_111_526_912,
            762_839_040,
            762_839_040,
            122_562_817_776,
        ),
        (
            "Qwen3.5-397B-A17B",
            456_010_480,
            396_346_350_336,
            1_017_118_720,
            1_017_118_720,
            396_802_360_816,
        ),
    ];

    #[test]
    fn every_bundled_config_matches_the_published_parameter_counts() {
        for &(name, vision, text, embedding, lm_head, total) in TABLE {
            let c = param_counts(&bundled_config(name).unwrap());
            assert_eq!(
                c,
                ParamCounts {
                    vision,
                    text,
                    embedding,
                    lm_head,
                    total
                },
                "{name}"
            );
        }
        assert_eq!(TABLE.len(), crate::arch::config::BUNDLED_CONFIGS.len());
    }

    #[test]
    fn tensor_parallel_split_keeps_replicated_parts_whole() {
        let cfg = bundled_config("Qwen3-VL-8B-Instruct").unwrap();
        let one: u64 = weight_bytes_per_rank(&cfg, 1, 2, WeightFormat::Unquantized)
            .iter()
            .map(|(_, b)| b)
            .sum();
        let two: u64 = weight_bytes_per_rank(&cfg, 2, 2, WeightFormat::Unquantized)
            .iter()
            .map(|(_, b)| b)
            .sum();
        assert_eq!(one, 2 * 8_767_123_696);
        // Each rank holds a bit more than half: norms, patch embedding and biases are replicated.
        assert!(two > one / 2 && two < one / 2 + one / 50, "{two} vs {one}");
        // Eight KV heads over 16 ranks: each rank keeps one whole head.
        let kv = param_groups(&cfg)
            .into_iter()
            .find(|g| g.name == "layers.kv_proj")
            .unwrap();
        assert_eq!(kv.numel_per_rank(16), kv.numel / 8);
        assert_eq!(kv.numel_per_rank(4), kv.numel / 4);
    }

    /// Qwen3-VL-2B in bf16 and in each block format: every matrix of the 2B has rows of a multiple
    /// of 32, so nearly all of it shrinks to 34/32 or 18/32 bytes per weight; norms, biases, the
    /// patch embedding and the position table stay at 2 bytes. `CpuBackend`'s ledger equals these
    /// figures on the tiny checkpoints (`model::weight_format`'s test).
    #[test]
    fn block_formats_shrink_the_matrices_only() {
        let cfg = bundled_config("Qwen3-VL-2B-Instruct").unwrap();
        let total = |tp, f| -> u64 { weight_bytes_per_rank(&cfg, tp, 2, f).iter().map(|(_, b)| b).sum() };
        assert_eq!(total(1, WeightFormat::Unquantized), 4_255_064_064);
        assert_eq!(total(1, WeightFormat::Q8_0), 2_264_653_824);
        assert_eq!(total(1, WeightFormat::Q4_0), 1_203_101_696);
        let all_matrices_q8 = 2_127_532_032u64 * 34 / 32;
        assert!(total(1, WeightFormat::Q8_0) - all_matrices_q8 < 5 << 20);
        // Split across two ranks, each holds a bit more than half (replicated norms and biases).
        let (one, two) = (total(1, WeightFormat::Q4_0), total(2, WeightFormat::Q4_0));
        assert!(two > one / 2 && two < one / 2 + one / 50, "{two} vs {one}");
    }

    /// Where `tp` divides every split dimension, splitting tensor by tensor along its dimension (as
    /// vLLM does) holds exactly what the planner's groups give each rank.
    #[test]
    fn per_tensor_shards_add_up_to_the_planner_s_figures() {
        let mut checked = 0;
        for (name, _) in BUNDLED_CONFIGS {
            let cfg = bundled_config(name).unwrap();
            let specs = tensor_specs(&cfg);
            for tp in [1usize, 2, 4, 8] {
                let divides = |t: &TensorSpec| match t.shard {
                    Shard::Split(d) => t.shape[d].is_multiple_of(tp),
                    Shard::Replicated | Shard::KvHeads(_) => true,
                };
                if !specs.iter().all(divides) {
                    continue;
                }
                let per_tensor: u64 = specs
                    .iter()
                    .map(|t| match t.shard {
                        Shard::Replicated => t.numel(),
                        Shard::Split(_) => t.numel() / tp as u64,
                        Shard::KvHeads(heads) => t.numel() / heads as u64 * (heads / tp).max(1) as u64,
                    })
                    .sum();
                let planner: u64 = weight_bytes_per_rank(&cfg, tp, 1, WeightFormat::Unquantized)
                    .iter()
                    .map(|(_, b)| b)
                    .sum();
                assert_eq!(per_tensor, planner, "{name} at tp {tp}");
                checked += 1;
            }
        }
        assert!(checked >= 2 * BUNDLED_CONFIGS.len(), "{checked}");
    }
}
