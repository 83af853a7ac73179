//! Random weights for a [`TensorSpec`] list, written as safetensors into any [`Write`]: what
//! `kvlens random-checkpoint` puts on disk and what tests load without files.
//!
//! Values come from a seeded SplitMix64 stream per tensor (so they do not depend on the tensor order
//! or the sharding) and are streamed out: the header first, from the known shapes, then each tensor
//! in turn.

use crate::arch::config::DType;
use crate::arch::spec::{Init, TensorSpec};
use crate::arch::weight_format::WeightFormat;
use std::io::{self, Write};

/// Standard deviation of matrices, embeddings and biases when the config has no `initializer_range`.
pub const INIT_STD: f64 = 0.02;
/// Norm weights are `1 + NORM_NOISE · N(0, 1)` so that they are not the identity.
pub const NORM_NOISE: f64 = 0.1;
/// Elements generated and written per step.
const CHUNK: u64 = 1 << 18;

/// The safetensors name of a weight dtype.
fn safetensors_dtype(dtype: DType) -> io::Result<&'static str> {
    match dtype {
        DType::F32 => Ok("F32"),
        DType::F16 => Ok("F16"),
        DType::Bf16 => Ok("BF16"),
        DType::Fp8 => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "fp8 is not a weight dtype (f32, f16, bf16)",
        )),
    }
}

/// The JSON header of a safetensors file holding `specs` back to back in order, padded with spaces
/// to a multiple of 8, and the bytes of tensor data after it.
pub fn safetensors_header(specs: &[TensorSpec]) -> io::Result<(Vec<u8>, u64)> {
    let mut header = String::from(r#"{"__metadata__":{"format":"pt"}"#);
    let mut offset = 0u64;
    for spec in specs {
        let end = offset + spec.numel() * spec.dtype.size_bytes();
        let shape: Vec<String> = spec.shape.iter().map(usize::to_string).collect();
        header.push_str(&format!(
            r#",{}:{{"data_offsets":[{offset},{end}],"dtype":"{}","shape":[{}]}}"#,
            serde_json::Value::String(spec.name.clone()),
            safetensors_dtype(spec.dtype)?,
            shape.join(",")
        ));
        offset = end;
    }
    header.push('}');
    while !header.len().is_multiple_of(8) {
        header.push(' ');
    }
    Ok((header.into_bytes(), offset))
}

/// How random values are drawn: one seeded stream per tensor name.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RandomInit {
    /// The same seed gives the same bytes.
    pub seed: u64,
    /// Standard deviation of [`Init::Normal`] tensors (the config's `initializer_range`).
    pub std: f64,
    /// The matrices this format quantizes are drawn as values it stores exactly (each value
    /// replaced by its quantized and dequantized self), so that quantizing them on load loses
    /// nothing; exact in an f32 checkpoint only.
    pub exact_in: WeightFormat,
}

impl RandomInit {
    /// Values of `seed`, matrices of standard deviation `std`, nothing snapped to a format.
    pub fn new(seed: u64, std: f64) -> Self {
        RandomInit {
            seed,
            std,
            exact_in: WeightFormat::Unquantized,
        }
    }

    /// Writes a whole safetensors file of `specs`: header length, header, then every tensor.
    pub fn write_safetensors(
        &self,
        w: &mut impl Write,
        specs: &[TensorSpec],
        progress: impl FnMut(u64),
    ) -> io::Result<()> {
        let (header, _) = safetensors_header(specs)?;
        w.write_all(&(header.len() as u64).to_le_bytes())?;
        w.write_all(&header)?;
        self.write_tensors(w, specs, progress)
    }

    /// Writes the data of `specs` in order (the part of a file after its header), little endian in
    /// each spec's dtype; `progress` gets the bytes of each chunk written.
    pub fn write_tensors(
        &self,
        w: &mut impl Write,
        specs: &[TensorSpec],
        mut progress: impl FnMut(u64),
    ) -> io::Result<()> {
        for spec in specs {
            self.write_tensor(w, spec, &mut progress)?;
        }
        Ok(())
    }

    fn write_tensor(&self, w: &mut impl Write, spec: &TensorSpec, progress: &mut impl FnMut(u64)) -> io::Result<()> {
        safetensors_dtype(spec.dtype)?;
        let mut normal = Normal::new(SplitMix64::for_tensor(self.seed, &spec.name));
        let mut uniform = SplitMix64::for_tensor(self.seed ^ 0x5eed, &spec.name);
        let mut buf = Vec::with_capacity((CHUNK * spec.dtype.size_bytes()) as usize);
        let mut values = Vec::with_capacity(CHUNK as usize);
        let snap = self.exact_in.quantizes(&spec.shape);
        let mut left = spec.numel();
        while left > 0 {
            let n = left.min(CHUNK);
            buf.clear();
            values.clear();
            values.extend((0..n).map(|_| {
                (match spec.init {
                    Init::Normal => self.std * normal.sample(),
                    Init::NormWeight => 1.0 + NORM_NOISE * normal.sample(),
                    Init::ZeroCenteredNorm => NORM_NOISE * normal.sample(),
                    Init::DecayLog => (0.01 + 0.49 * uniform.uniform()).ln(),
                }) as f32
            }));
            // Whole blocks: a chunk is a multiple of 32 values and so are the matrices' rows.
            if snap {
                self.exact_in.round_trip(&mut values);
            }
            for &v in &values {
                match spec.dtype {
                    DType::Bf16 => buf.extend_from_slice(&half::bf16::from_f32(v).to_le_bytes()),
                    DType::F16 => buf.extend_from_slice(&half::f16::from_f32(v).to_le_bytes()),
                    DType::F32 | DType::Fp8 => buf.extend_from_slice(&v.to_le_bytes()),
                }
            }
            w.write_all(&buf)?;
            progress(buf.len() as u64);
            left -= n;
        }
        Ok(())
    }
}

/// SplitMix64 (Steele, Lea & Flood 2014): a tiny, fast generator with good statistical quality.
#[derive(Debug, Clone)]
struct SplitMix64(u64);

impl SplitMix64 {
    /// The stream of one tensor: the seed mixed with an FNV-1a hash of its name.
    fn for_tensor(seed: u64, name: &str) -> Self {
        let hash = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        });
        let mut mixer = SplitMix64(seed ^ hash);
        SplitMix64(mixer.next_u64())
    }

    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in the open interval (0, 1).
    fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
}

/// Standard normal samples by the Box–Muller transform (two per pair of uniforms).
#[derive(Debug)]
struct Normal {
    rng: SplitMix64,
    spare: Option<f64>,
}

impl Normal {
    fn new(rng: SplitMix64) -> Self {
        Normal { rng, spare: None }
    }

    fn sample(&mut self) -> f64 {
        if let Some(z) = self.spare.take() {
            return z;
        }
        let r = (-2.0 * self.rng.uniform().ln()).sqrt();
        let (sin, cos) = (std::f64::consts::TAU * self.rng.uniform()).sin_cos();
        self.spare = Some(r * sin);
        r * cos
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::config::ModelConfig;
    use crate::arch::spec::tensor_specs;
    use crate::model::weights::SafetensorsFiles;

    #[test]
    fn normals_have_the_right_moments() {
        let mut n = Normal::new(SplitMix64::for_tensor(7, "x"));
        let xs: Vec<f64> = (0..200_000).map(|_| n.sample()).collect();
        let mean = xs.iter().sum::<f64>() / xs.len() as f64;
        let var = xs.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / xs.len() as f64;
        assert!(mean.abs() < 0.01 && (var - 1.0).abs() < 0.02, "{mean} {var}");
    }

    #[test]
    fn a_written_checkpoint_parses_back_with_every_tensor() {
        let cfg = ModelConfig::from_json(include_str!("../../../tools/golden/configs/qwen3_vl_tiny.json")).unwrap();
        let specs = tensor_specs(&cfg);
        let mut bytes = Vec::new();
        let mut written = 0;
        RandomInit::new(1, 0.5)
            .write_safetensors(&mut bytes, &specs, |n| written += n)
            .unwrap();
        let (header, data) = safetensors_header(&specs).unwrap();
        assert_eq!(written, data);
        assert_eq!(bytes.len() as u64, 8 + header.len() as u64 + data);
        let shards = [("model.safetensors".to_string(), bytes.as_slice())];
        let files = SafetensorsFiles::parse(&shards).unwrap();
        assert_eq!(files.names().count(), specs.len());
    }
}
