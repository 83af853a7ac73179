//! Checkpoint tensors: safetensors files handed in as bytes (memory-mapped by the caller) or tensors
//! already converted as a checkpoint streamed in ([`super::stream`]), looked up under either
//! [`CheckpointLayout`]'s prefixes whatever the family (transformers has saved both), checked
//! against the shapes of the model's [`TensorSpec`]s.

use super::ModelError;
use crate::arch::config::CheckpointLayout;
use crate::arch::spec::{ExpertLayout, MatrixUse, TensorSpec};
use crate::backend::{Backend, RawDType, RawTensor};
use std::collections::HashMap;

/// A checkpoint tensor as a [`TensorSource`] hands it to the [`Loader`].
#[derive(Debug)]
pub enum Stored<'a, B: Backend> {
    /// Its bytes as stored; the loader converts them.
    Raw(RawTensor<'a>),
    /// Converted already, as the checkpoint streamed in.
    Loaded(Loaded<B>),
}

/// A tensor converted as the checkpoint streamed in.
#[derive(Debug)]
pub struct Loaded<B: Backend> {
    /// Its shape in the checkpoint.
    pub shape: Vec<usize>,
    /// Its bytes in the checkpoint.
    pub bytes: u64,
    /// What it was converted to.
    pub value: Converted<B>,
}

/// What a tensor was converted to, by how the model reads it.
#[derive(Debug)]
pub enum Converted<B: Backend> {
    /// A weight matrix on the backend ([`TensorSpec::is_matrix`], [`Backend::load_weight`]).
    Matrix(B::Weight),
    /// One weight matrix `[out, in]` per expert of a stacked expert tensor ([`TensorSpec::experts`]).
    Experts(Vec<B::Weight>),
    /// A vector on the backend ([`Backend::load_tensor`]).
    Tensor(B::Tensor),
    /// Host floats, for the tensors the model reads on the host ([`TensorSpec::host`]).
    Host(Vec<f32>),
}

impl<B: Backend> Converted<B> {
    /// Converts `raw` as the model reads `spec`.
    pub(super) fn of(backend: &B, spec: &TensorSpec, raw: RawTensor<'_>) -> Result<Self, ModelError> {
        Ok(if let Some(layout) = spec.experts {
            Converted::Experts(expert_matrices(&raw, layout, |m| {
                Ok(backend.load_weight(m, MatrixUse::Products)?)
            })?)
        } else if spec.host {
            Converted::Host(host_f32(&raw))
        } else if spec.is_matrix() {
            Converted::Matrix(backend.load_weight(raw, spec.matrix_use)?)
        } else {
            Converted::Tensor(backend.load_tensor(raw)?)
        })
    }

    fn kind(&self) -> &'static str {
        match self {
            Converted::Matrix(_) => "a weight matrix",
            Converted::Experts(_) => "one weight matrix per expert",
            Converted::Tensor(_) => "a tensor on the backend",
            Converted::Host(_) => "host floats",
        }
    }
}

/// Where checkpoint tensors come from.
pub trait TensorSource<B: Backend> {
    /// Whether a tensor is stored under exactly `name`.
    fn contains(&self, name: &str) -> bool;
    /// The tensor stored under exactly `name`, if any. A source may hand each tensor out only once.
    fn fetch(&self, name: &str) -> Result<Option<Stored<'_, B>>, ModelError>;
}

/// One or more safetensors files (shards) parsed in place.
#[derive(Debug)]
pub struct SafetensorsFiles<'a> {
    files: Vec<safetensors::SafeTensors<'a>>,
    index: HashMap<String, usize>,
}

impl<'a> SafetensorsFiles<'a> {
    /// Parses every shard; `names[i]` names shard `i` in errors.
    pub fn parse(shards: &'a [(String, &'a [u8])]) -> Result<Self, ModelError> {
        let mut files = Vec::with_capacity(shards.len());
        let mut index = HashMap::new();
        for (i, (name, bytes)) in shards.iter().enumerate() {
            let st = safetensors::SafeTensors::deserialize(bytes)
                .map_err(|e| ModelError::Checkpoint(format!("{name} is not a valid safetensors file: {e}")))?;
            for tensor in st.names() {
                index.insert(tensor.to_string(), i);
            }
            files.push(st);
        }
        Ok(SafetensorsFiles { files, index })
    }

    /// The name of every tensor in the shards.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.index.keys().map(String::as_str)
    }

    /// The bytes stored under exactly `name`, if any.
    pub fn raw(&self, name: &str) -> Result<Option<RawTensor<'_>>, ModelError> {
        let Some(&i) = self.index.get(name) else {
            return Ok(None);
        };
        let view = self.files[i]
            .tensor(name)
            .map_err(|e| ModelError::Checkpoint(format!("{name}: {e}")))?;
        Ok(Some(RawTensor {
            dtype: raw_dtype(name, view.dtype())?,
            shape: view.shape().to_vec(),
            data: view.data().into(),
        }))
    }
}

impl<B: Backend> TensorSource<B> for SafetensorsFiles<'_> {
    fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    fn fetch(&self, name: &str) -> Result<Option<Stored<'_, B>>, ModelError> {
        Ok(self.raw(name)?.map(Stored::Raw))
    }
}

/// The dtype of checkpoint tensor `name`, if the engine reads it.
pub(super) fn raw_dtype(name: &str, dtype: safetensors::Dtype) -> Result<RawDType, ModelError> {
    match dtype {
        safetensors::Dtype::F32 => Ok(RawDType::F32),
        safetensors::Dtype::F16 => Ok(RawDType::F16),
        safetensors::Dtype::BF16 => Ok(RawDType::Bf16),
        other => Err(ModelError::Checkpoint(format!(
            "{name}: dtype {other:?} is not supported (f32, f16, bf16)"
        ))),
    }
}

/// The spellings a tensor name may have: as given, and under the other [`CheckpointLayout`]'s
/// prefix (the longest matching prefix decides the tower, so `model.visual.x` is a vision tensor).
pub(super) fn spellings(name: &str) -> Vec<String> {
    let mut out = vec![name.to_string()];
    let towers: [fn(CheckpointLayout) -> &'static str; 2] =
        [CheckpointLayout::vision_prefix, CheckpointLayout::text_prefix];
    let matched = towers
        .iter()
        .flat_map(|prefix| CheckpointLayout::ALL.map(|layout| (prefix, layout)))
        .filter_map(|(prefix, layout)| {
            let rest = name.strip_prefix(prefix(layout))?.strip_prefix('.')?;
            Some((prefix, layout, rest))
        })
        .max_by_key(|(prefix, layout, _)| prefix(*layout).len());
    if let Some((prefix, layout, rest)) = matched {
        for other in CheckpointLayout::ALL.into_iter().filter(|l| *l != layout) {
            out.push(format!("{}.{rest}", prefix(other)));
        }
    }
    out
}

/// Checks that checkpoint tensor `name` has the shape the config implies.
pub(super) fn check_shape(name: &str, found: &[usize], want: &[usize]) -> Result<(), ModelError> {
    if found == want {
        return Ok(());
    }
    Err(ModelError::Checkpoint(format!(
        "tensor {name} has shape {found:?}, the config implies {want:?}"
    )))
}

/// Each expert's matrix `[out, in]` of a stacked expert tensor `[experts, …]`, handed to `load`
/// in expert order: a slice of the stored bytes, or a transposed copy for
/// [`ExpertLayout::InputMajor`].
fn expert_matrices<W>(
    raw: &RawTensor<'_>,
    layout: ExpertLayout,
    mut load: impl FnMut(RawTensor<'_>) -> Result<W, ModelError>,
) -> Result<Vec<W>, ModelError> {
    let [experts, rows, cols] = raw.shape[..] else {
        return Err(ModelError::Checkpoint(format!(
            "stacked expert weights of shape {:?} are not [experts, rows, cols]",
            raw.shape
        )));
    };
    let elem = match raw.dtype {
        RawDType::F32 => 4,
        RawDType::F16 | RawDType::Bf16 => 2,
        RawDType::Blocks(t) => {
            return Err(ModelError::Unsupported(format!(
                "stacked expert weights in {t:?} blocks (f32, f16 and bf16 are read)"
            )))
        }
    };
    let size = rows * cols * elem;
    if raw.data.len() != experts * size {
        return Err(ModelError::Checkpoint(format!(
            "stacked expert weights of shape {:?} have {} bytes",
            raw.shape,
            raw.data.len()
        )));
    }
    raw.data
        .chunks_exact(size.max(1))
        .take(experts)
        .map(|m| {
            let (shape, data) = match layout {
                ExpertLayout::OutputMajor => (vec![rows, cols], std::borrow::Cow::Borrowed(m)),
                ExpertLayout::InputMajor => {
                    // Stored [in = rows, out = cols]: out row o takes column o.
                    let mut t = Vec::with_capacity(m.len());
                    for o in 0..cols {
                        for i in 0..rows {
                            let at = (i * cols + o) * elem;
                            t.extend_from_slice(&m[at..at + elem]);
                        }
                    }
                    (vec![cols, rows], std::borrow::Cow::Owned(t))
                }
            };
            load(RawTensor {
                dtype: raw.dtype,
                shape,
                data,
            })
        })
        .collect()
}

/// Converts checkpoint bytes to host floats (f16 and bf16 widen exactly, GGML blocks dequantize
/// to GGML's values).
pub(crate) fn host_f32(raw: &RawTensor<'_>) -> Vec<f32> {
    host_f32_range(raw, 0..raw.shape.iter().product())
}

/// [`host_f32`] of values `range` (whole blocks of the tensor's type).
pub(crate) fn host_f32_range(raw: &RawTensor<'_>, range: std::ops::Range<usize>) -> Vec<f32> {
    let dtype = raw.dtype;
    let at = |n: usize| dtype.bytes_of(n).unwrap_or(raw.data.len());
    let mut out = vec![0f32; range.len()];
    dtype
        .ggml()
        .dequantize(&raw.data[at(range.start)..at(range.end)], &mut out);
    out
}

/// Loads the tensors of a [`TensorSpec`] list onto a backend, checking their shapes.
#[derive(Debug)]
pub struct Loader<'s, 'b, S, B> {
    source: &'s S,
    backend: &'b B,
    /// Tensors and bytes loaded so far.
    loaded: std::cell::Cell<(usize, u64)>,
}

impl<'s, 'b, S: TensorSource<B>, B: Backend> Loader<'s, 'b, S, B> {
    /// A loader reading from `source` onto `backend`.
    pub fn new(source: &'s S, backend: &'b B) -> Self {
        Loader {
            source,
            backend,
            loaded: std::cell::Cell::new((0, 0)),
        }
    }

    /// Tensors and bytes loaded so far.
    pub fn progress(&self) -> (usize, u64) {
        self.loaded.get()
    }

    /// Whether the checkpoint has `spec` under any spelling.
    pub fn has(&self, spec: &TensorSpec) -> bool {
        spellings(&spec.name).iter().any(|n| self.source.contains(n))
    }

    /// Converts `spec` (any spelling) as the model reads it ([`Converted::of`]).
    fn convert(&self, spec: &TensorSpec) -> Result<Converted<B>, ModelError> {
        match self.fetch(&spec.name, &spec.shape)? {
            Stored::Raw(raw) => Converted::of(self.backend, spec, raw),
            Stored::Loaded(loaded) => Ok(loaded.value),
        }
    }

    /// Loads vector `spec` (a norm, a bias; any spelling) onto the backend.
    pub fn load(&self, spec: &TensorSpec) -> Result<B::Tensor, ModelError> {
        match self.convert(spec)? {
            Converted::Tensor(t) => Ok(t),
            other => Err(misplaced(&spec.name, other.kind(), "a tensor on the backend")),
        }
    }

    /// Loads weight matrix `spec` (any spelling) onto the backend.
    pub fn matrix(&self, spec: &TensorSpec) -> Result<B::Weight, ModelError> {
        match self.convert(spec)? {
            Converted::Matrix(w) => Ok(w),
            other => Err(misplaced(&spec.name, other.kind(), "a weight matrix")),
        }
    }

    /// Loads stacked expert tensor `spec` (any spelling) as one weight matrix per expert.
    pub fn experts(&self, spec: &TensorSpec) -> Result<Vec<B::Weight>, ModelError> {
        match self.convert(spec)? {
            Converted::Experts(w) => Ok(w),
            other => Err(misplaced(&spec.name, other.kind(), "one weight matrix per expert")),
        }
    }

    /// Reads `spec` (any spelling) into host floats, without the backend.
    pub fn host(&self, spec: &TensorSpec) -> Result<Vec<f32>, ModelError> {
        match self.convert(spec)? {
            Converted::Host(v) => Ok(v),
            other => Err(misplaced(&spec.name, other.kind(), "host floats")),
        }
    }

    /// The tensor `name` under its first spelling present, checked against `shape` and counted as
    /// loaded.
    fn fetch(&self, name: &str, shape: &[usize]) -> Result<Stored<'s, B>, ModelError> {
        for n in spellings(name) {
            let Some(stored) = self.source.fetch(&n)? else {
                continue;
            };
            let bytes = match &stored {
                Stored::Raw(raw) => {
                    check_shape(&n, &raw.shape, shape)?;
                    if Some(raw.data.len()) != raw.dtype.bytes_of(shape.iter().product()) {
                        return Err(ModelError::Checkpoint(format!(
                            "tensor {n} has {} bytes for shape {shape:?} in {}",
                            raw.data.len(),
                            raw.dtype.name()
                        )));
                    }
                    raw.data.len() as u64
                }
                Stored::Loaded(l) => {
                    check_shape(&n, &l.shape, shape)?;
                    l.bytes
                }
            };
            let (count, total) = self.loaded.get();
            self.loaded.set((count + 1, total + bytes));
            return Ok(stored);
        }
        Err(ModelError::Checkpoint(format!(
            "tensor {name} is missing from the checkpoint"
        )))
    }
}

/// A streamed tensor converted for the other place than the one the model reads it from: the
/// model's loading code and [`TensorSpec::host`] disagree.
fn misplaced(name: &str, converted: &str, read: &str) -> ModelError {
    ModelError::Checkpoint(format!(
        "tensor {name} was converted to {converted}, but the model reads it as {read}"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_spellings_are_tried() {
        assert_eq!(
            spellings("visual.blocks.0.norm1.weight")[1],
            "model.visual.blocks.0.norm1.weight"
        );
        assert_eq!(
            spellings("model.layers.3.mlp.up_proj.weight")[1],
            "model.language_model.layers.3.mlp.up_proj.weight"
        );
        assert_eq!(spellings("model.language_model.norm.weight")[1], "model.norm.weight");
        assert_eq!(spellings("lm_head.weight"), vec!["lm_head.weight"]);
    }

    /// A checkpoint written from the specs, with one tensor dropped or reshaped.
    fn load_error(edit: impl Fn(&mut Vec<TensorSpec>)) -> String {
        use crate::arch::spec::tensor_specs;
        use crate::backend::suite::Reference as CpuBackend;
        use crate::memory::ledger::MemoryLedger;
        use crate::model::{random_weights::RandomInit, QwenVl};
        let cfg = crate::arch::config::ModelConfig::from_json(include_str!(
            "../../../tools/golden/configs/qwen2_vl_tiny.json"
        ))
        .unwrap();
        let mut specs = tensor_specs(&cfg);
        edit(&mut specs);
        let mut bytes = Vec::new();
        RandomInit::new(0, 0.5)
            .write_safetensors(&mut bytes, &specs, |_| {})
            .unwrap();
        let shards = [("model.safetensors".to_string(), bytes.as_slice())];
        let source = SafetensorsFiles::parse(&shards).unwrap();
        let be = CpuBackend::new(MemoryLedger::new());
        QwenVl::load(cfg, &source, &be, |_, _| {}).unwrap_err().to_string()
    }

    #[test]
    fn stacked_experts_split_into_output_major_matrices() {
        let values: Vec<f32> = (0..12).map(|v| v as f32).collect();
        let raw = RawTensor {
            dtype: RawDType::F32,
            shape: vec![2, 2, 3],
            data: bytemuck::cast_slice(&values).to_vec().into(),
        };
        let split = |layout| expert_matrices(&raw, layout, |m| Ok((m.shape.clone(), host_f32(&m)))).unwrap();
        assert_eq!(
            split(ExpertLayout::OutputMajor),
            vec![
                (vec![2, 3], vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0]),
                (vec![2, 3], vec![6.0, 7.0, 8.0, 9.0, 10.0, 11.0])
            ]
        );
        assert_eq!(
            split(ExpertLayout::InputMajor),
            vec![
                (vec![3, 2], vec![0.0, 3.0, 1.0, 4.0, 2.0, 5.0]),
                (vec![3, 2], vec![6.0, 9.0, 7.0, 10.0, 8.0, 11.0])
            ]
        );
        let flat = RawTensor { shape: vec![12], ..raw };
        assert!(expert_matrices(&flat, ExpertLayout::OutputMajor, |_| Ok(())).is_err());
    }

    #[test]
    fn a_missing_or_misshapen_tensor_is_named() {
        let missing = load_error(|s| s.retain(|t| t.name != "visual.blocks.1.mlp.fc2.bias"));
        assert_eq!(
            missing,
            "checkpoint: tensor visual.blocks.1.mlp.fc2.bias is missing from the checkpoint"
        );
        let reshaped = load_error(|s| {
            let t = s
                .iter_mut()
                .find(|t| t.name == "model.layers.0.self_attn.k_proj.weight")
                .unwrap();
            t.shape = vec![8, 32];
        });
        assert_eq!(
            reshaped,
            "checkpoint: tensor model.layers.0.self_attn.k_proj.weight has shape [8, 32], the config implies [16, 32]"
        );
    }
}
