//! Checkpoint tensors: safetensors files handed in as bytes (memory-mapped by the caller), looked
//! up under either spelling transformers has used (`visual.*` / `model.layers.*` as published, or
//! `model.visual.*` / `model.language_model.*`), checked against the shapes the config implies.

use super::ModelError;
use crate::backend::{Backend, RawDType, RawTensor};
use std::collections::HashMap;

/// Where checkpoint tensors come from.
pub trait TensorSource {
    /// The tensor stored under exactly `name`, if any.
    fn raw(&self, name: &str) -> Result<Option<RawTensor<'_>>, ModelError>;
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
}

impl TensorSource for SafetensorsFiles<'_> {
    fn raw(&self, name: &str) -> Result<Option<RawTensor<'_>>, ModelError> {
        let Some(&i) = self.index.get(name) else {
            return Ok(None);
        };
        let view = self.files[i]
            .tensor(name)
            .map_err(|e| ModelError::Checkpoint(format!("{name}: {e}")))?;
        let dtype = match view.dtype() {
            safetensors::Dtype::F32 => RawDType::F32,
            safetensors::Dtype::F16 => RawDType::F16,
            safetensors::Dtype::BF16 => RawDType::Bf16,
            other => {
                return Err(ModelError::Checkpoint(format!(
                    "{name}: dtype {other:?} is not supported (f32, f16, bf16)"
                )))
            }
        };
        Ok(Some(RawTensor {
            dtype,
            shape: view.shape().to_vec(),
            data: view.data(),
        }))
    }
}

/// The other spellings a published tensor name may have.
fn spellings(name: &str) -> Vec<String> {
    let mut out = vec![name.to_string()];
    if let Some(rest) = name.strip_prefix("visual.") {
        out.push(format!("model.visual.{rest}"));
    } else if let Some(rest) = name.strip_prefix("model.visual.") {
        out.push(format!("visual.{rest}"));
    } else if let Some(rest) = name.strip_prefix("model.language_model.") {
        out.push(format!("model.{rest}"));
    } else if let Some(rest) = name.strip_prefix("model.") {
        out.push(format!("model.language_model.{rest}"));
    }
    out
}

/// Loads named tensors onto a backend, checking their shapes.
#[derive(Debug)]
pub struct Loader<'s, 'b, S, B> {
    source: &'s S,
    backend: &'b B,
    /// Called after each tensor with (tensors loaded so far, bytes loaded so far).
    loaded: std::cell::Cell<(usize, u64)>,
}

impl<'s, 'b, S: TensorSource, B: Backend> Loader<'s, 'b, S, B> {
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

    /// Whether a tensor exists under any spelling.
    pub fn has(&self, name: &str) -> Result<bool, ModelError> {
        for n in spellings(name) {
            if self.source.raw(&n)?.is_some() {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Loads `name` (any spelling), requiring exactly `shape`.
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<B::Tensor, ModelError> {
        for n in spellings(name) {
            if let Some(raw) = self.source.raw(&n)? {
                if raw.shape != shape {
                    return Err(ModelError::Checkpoint(format!(
                        "tensor {n} has shape {:?}, the config implies {shape:?}",
                        raw.shape
                    )));
                }
                let elem = match raw.dtype {
                    RawDType::F32 => 4,
                    RawDType::F16 | RawDType::Bf16 => 2,
                };
                if raw.data.len() != shape.iter().product::<usize>() * elem {
                    return Err(ModelError::Checkpoint(format!(
                        "tensor {n} has {} bytes for shape {shape:?}",
                        raw.data.len()
                    )));
                }
                let bytes = raw.data.len() as u64;
                let t = self.backend.load_weight(raw)?;
                let (count, total) = self.loaded.get();
                self.loaded.set((count + 1, total + bytes));
                return Ok(t);
            }
        }
        Err(ModelError::Checkpoint(format!(
            "tensor {name} is missing from the checkpoint"
        )))
    }

    /// Loads a 1-D tensor of `len` elements.
    pub fn vector(&self, name: &str, len: usize) -> Result<B::Tensor, ModelError> {
        self.get(name, &[len])
    }

    /// Loads a `[out, in]` matrix.
    pub fn matrix(&self, name: &str, out: usize, inp: usize) -> Result<B::Tensor, ModelError> {
        self.get(name, &[out, inp])
    }
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
}
