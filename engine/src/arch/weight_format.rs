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

use super::blocks::{BlockKind, BlockRows, BLOCK};

/// The storage of the weight matrices, as `--quantization` names it (`None`: unquantized).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
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

    /// The GGML block format, or None when unquantized.
    pub fn block_kind(self) -> Option<BlockKind> {
        match self {
            WeightFormat::Unquantized => None,
            WeightFormat::Q8_0 => Some(BlockKind::Q8_0),
            WeightFormat::Q4_0 => Some(BlockKind::Q4_0),
        }
    }

    /// `(values, bytes)` per block, or None when unquantized.
    pub fn block(self) -> Option<(usize, u64)> {
        self.block_kind().map(|kind| (BLOCK, kind.block_bytes() as u64))
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
        let Some(kind) = self.block_kind() else { return };
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
}
