//! How the weight matrices are stored: as the checkpoint's dtype, or quantized on load into one of
//! GGML's block formats. Defined once here for the loader and the planner: which tensors a format
//! quantizes ([`WeightFormat::quantizes`]) and what each costs ([`WeightFormat::tensor_bytes`]).
//!
//! The quantized formats are GGML's `q8_0` (32 values: an f16 scale and 32 `i8`, 34 bytes) and
//! `q4_0` (32 values: an f16 scale and 16 bytes of 4-bit values offset by 8, 18 bytes), the layouts
//! llama.cpp and candle's quantized kernels use. A format quantizes every 2-D matrix the model
//! multiplies by, embedding and output head included, whose rows split into whole blocks
//! (`in % 32 == 0`); it keeps norms, biases, the 5-D patch embedding and the host-side position
//! table in the compute dtype. The activations stay f32 and the matmuls accumulate in f32.

/// The storage of the weight matrices, as `--quantization` names it (`None`: unquantized).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum WeightFormat {
    /// The compute dtype (f32 on the CPU), or half precision where the backend keeps it.
    #[default]
    #[serde(rename = "none")]
    Unquantized,
    /// GGML `q8_0`: 8.5 bits per weight.
    Q8_0,
    /// GGML `q4_0`: 4.5 bits per weight.
    Q4_0,
}

impl WeightFormat {
    /// Every format, in order of size.
    pub const ALL: [WeightFormat; 3] = [WeightFormat::Unquantized, WeightFormat::Q8_0, WeightFormat::Q4_0];

    /// The name `--quantization` takes (`none` for unquantized).
    pub fn name(self) -> &'static str {
        match self {
            WeightFormat::Unquantized => "none",
            WeightFormat::Q8_0 => "q8_0",
            WeightFormat::Q4_0 => "q4_0",
        }
    }

    /// `(values, bytes)` per block, or None when unquantized.
    pub fn block(self) -> Option<(usize, u64)> {
        match self {
            WeightFormat::Unquantized => None,
            WeightFormat::Q8_0 => Some((32, 34)),
            WeightFormat::Q4_0 => Some((32, 18)),
        }
    }

    /// Whether this format quantizes a loaded tensor of `shape`: a matrix `[out, in]` whose rows
    /// split into whole blocks.
    pub fn quantizes(self, shape: &[usize]) -> bool {
        match (self.block(), shape) {
            (Some((values, _)), &[rows, cols]) => rows > 0 && cols > 0 && cols % values == 0,
            _ => false,
        }
    }

    /// Replaces `values` (whole blocks of 32, a matrix's rows in order) by what this format
    /// stores for them: GGML's quantization, dequantized (the numbers the CPU and wgpu backends
    /// multiply by). Unquantized leaves them.
    pub fn round_trip(self, values: &mut [f32]) {
        use crate::backend::cpu::blocks::{BlockKind, BlockRows, BLOCK};
        let kind = match self {
            WeightFormat::Unquantized => return,
            WeightFormat::Q8_0 => BlockKind::Q8_0,
            WeightFormat::Q4_0 => BlockKind::Q4_0,
        };
        debug_assert!(values.len().is_multiple_of(BLOCK));
        let blocks = BlockRows::quantize(kind, values, BLOCK);
        for (b, block) in values.chunks_exact_mut(BLOCK).enumerate() {
            blocks.dequantize_row(b, block);
        }
    }

    /// Bytes a loaded tensor of `shape` takes: quantized blocks, or `elem_bytes` per value.
    pub fn tensor_bytes(self, shape: &[usize], elem_bytes: u64) -> u64 {
        let numel: u64 = shape.iter().map(|&d| d as u64).product();
        match self.block() {
            Some((values, bytes)) if self.quantizes(shape) => numel / values as u64 * bytes,
            _ => numel * elem_bytes,
        }
    }
}

impl std::str::FromStr for WeightFormat {
    type Err = String;

    /// `q8_0`, `q4_0`, or `none` / `auto` / empty for unquantized (case-insensitive).
    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim().to_ascii_lowercase();
        if s.is_empty() || s == "auto" {
            return Ok(WeightFormat::Unquantized);
        }
        Self::ALL.into_iter().find(|f| f.name() == s).ok_or_else(|| {
            format!("--quantization: unknown format {s:?} (q8_0 or q4_0, GGML's block formats quantized on load; none for the checkpoint's dtype)")
        })
    }
}

impl std::fmt::Display for WeightFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::WeightFormat::{self, *};

    #[test]
    fn names_parse_and_unknown_formats_say_what_is_known() {
        for f in WeightFormat::ALL {
            assert_eq!(f.name().parse::<WeightFormat>(), Ok(f));
        }
        assert_eq!("Q8_0".parse::<WeightFormat>(), Ok(Q8_0));
        assert_eq!("auto".parse::<WeightFormat>(), Ok(Unquantized));
        let err = "awq".parse::<WeightFormat>().unwrap_err();
        assert!(
            err.contains("unknown format \"awq\"") && err.contains("q8_0 or q4_0"),
            "{err}"
        );
    }

    /// A value the format stores is stored exactly: a second round trip changes nothing.
    #[test]
    fn round_trips_are_exact_the_second_time() {
        let values: Vec<f32> = (0..256).map(|i| ((i * 7919 % 257) as f32 - 128.0) * 3e-3).collect();
        for format in [Q8_0, Q4_0] {
            let mut once = values.clone();
            format.round_trip(&mut once);
            assert_ne!(once, values, "{format} rounds these values");
            let mut twice = once.clone();
            format.round_trip(&mut twice);
            assert_eq!(twice, once, "{format}");
        }
        let mut same = values.clone();
        Unquantized.round_trip(&mut same);
        assert_eq!(same, values);
    }

    #[test]
    fn only_whole_blocks_of_matrices_are_quantized() {
        assert!(Q8_0.quantizes(&[37, 64]));
        assert!(!Q8_0.quantizes(&[64, 37]), "rows of 37 do not split into blocks of 32");
        assert!(!Q4_0.quantizes(&[64]), "vectors stay");
        assert!(!Q4_0.quantizes(&[8, 3, 2, 14, 14]), "the patch embedding stays");
        assert!(!Unquantized.quantizes(&[64, 64]));
        assert_eq!(Q8_0.tensor_bytes(&[64, 64], 4), 64 * 2 * 34);
        assert_eq!(Q4_0.tensor_bytes(&[64, 64], 4), 64 * 2 * 18);
        assert_eq!(Q4_0.tensor_bytes(&[64, 37], 4), 64 * 37 * 4);
        assert_eq!(Unquantized.tensor_bytes(&[64, 64], 2), 64 * 64 * 2);
    }

    /// The tiny test checkpoints (random weights): each config and its safetensors bytes.
    pub(crate) fn tiny_checkpoints() -> Vec<(crate::config::ModelConfig, Vec<u8>)> {
        use crate::model::{random_weights::RandomInit, spec::tensor_specs};
        [
            include_str!("../../../tools/golden/configs/qwen2_vl_tiny.json"),
            include_str!("../../../tools/golden/configs/qwen3_vl_tiny.json"),
        ]
        .into_iter()
        .map(|config| {
            let cfg = crate::config::ModelConfig::from_json(config).unwrap();
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
        cfg: &crate::config::ModelConfig,
        checkpoint: &[u8],
        open: impl Fn(crate::memory::ledger::MemoryLedger, WeightFormat) -> B,
        padding: impl Fn(WeightFormat) -> u64,
    ) -> Vec<u64> {
        use crate::memory::ledger::{Category, MemoryLedger};
        use crate::memory::weights::weight_bytes_per_rank;
        use crate::model::{spec::tensor_specs, weights::SafetensorsFiles, QwenVl};
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
        use crate::backend::cpu::CpuBackend;
        use crate::memory::ledger::{Category, MemoryLedger};
        use crate::model::{spec::tensor_specs, weights::SafetensorsFiles, QwenVl};
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
                .map(|t| t.numel() * if t.shape.len() == 2 { 2 } else { 4 })
                .sum();
            assert_eq!(ledger.bytes(Category::Weights), want);
            assert!(want * 10 < (totals[0] - host) * 6, "{want} vs f32 {}", totals[0] - host);
            drop(model);
        }
    }
}
