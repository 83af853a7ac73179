//! The tensors of a GGUF pair ([`GgufModel`]) handed to the [`Loader`](super::weights::Loader)
//! under their transformers names, each as stored (GGML's block types included) and borrowed
//! from the files' bytes; the two the converter split (the vision attention's `qkv`, the patch
//! embedding's two time steps) are put back together in a copy.

use super::weights::{Stored, TensorSource};
use super::ModelError;
use crate::arch::gguf::GgufTensor;
use crate::arch::gguf_model::{Assembly, GgufModel, Part, Piece};
use crate::backend::{Backend, RawDType, RawTensor};
use std::borrow::Cow;
use std::collections::BTreeMap;

/// A GGUF pair's tensors over the bytes of its two files.
#[derive(Debug)]
pub struct GgufTensors<'a> {
    model: &'a GgufModel<'a>,
    /// The text file's bytes (from its start; memory-mapped natively).
    text: &'a [u8],
    /// The projector file's bytes.
    mmproj: &'a [u8],
    tensors: BTreeMap<String, Assembly>,
}

impl<'a> GgufTensors<'a> {
    /// The tensors of `model`, whose files' bytes are `text` and `mmproj`.
    pub fn new(model: &'a GgufModel<'a>, text: &'a [u8], mmproj: &'a [u8]) -> Result<Self, ModelError> {
        let tensors = model.tensors().map_err(|e| ModelError::Checkpoint(e.to_string()))?;
        Ok(GgufTensors {
            model,
            text,
            mmproj,
            tensors,
        })
    }

    /// The raw tensor of one piece: its bytes as the header places them in the file's bytes.
    fn one(&self, p: Piece) -> Result<RawTensor<'a>, ModelError> {
        let bytes = match p.part {
            Part::Text => self.text,
            Part::Mmproj => self.mmproj,
        };
        let t: Option<&'a GgufTensor> = self.model.file(p.part).and_then(|f| f.tensors.get(p.index));
        let range = |t: &GgufTensor| Some(usize::try_from(t.start).ok()?..usize::try_from(t.start + t.bytes).ok()?);
        match t.and_then(|t| Some((t, bytes.get(range(t)?)?))) {
            Some((t, data)) => Ok(RawTensor {
                dtype: RawDType::of_ggml(t.ggml_type),
                shape: t.shape(),
                data: Cow::Borrowed(data),
            }),
            None => Err(ModelError::Checkpoint(
                "a GGUF tensor lies outside the bytes given for its file".into(),
            )),
        }
    }

    /// `name` made from its pieces.
    fn assemble(&self, name: &str, how: &Assembly) -> Result<RawTensor<'a>, ModelError> {
        match how {
            Assembly::One(p) => self.one(*p),
            Assembly::Rows(pieces) => {
                let parts = pieces.iter().map(|p| self.one(*p)).collect::<Result<_, _>>()?;
                join_rows(name, parts)
            }
            Assembly::Temporal([a, b]) => join_time_steps(name, self.one(*a)?, self.one(*b)?),
        }
    }
}

/// `q`, `k` and `v` (or any tensors of one type and row width) as one tensor, rows in order.
pub(crate) fn join_rows<'a>(name: &str, parts: Vec<RawTensor<'_>>) -> Result<RawTensor<'a>, ModelError> {
    let Some(first) = parts.first() else {
        return Err(ModelError::Checkpoint(format!("{name}: no pieces")));
    };
    if let Some(other) = parts
        .iter()
        .find(|p| p.dtype != first.dtype || p.shape[1..] != first.shape[1..])
    {
        return Err(ModelError::Checkpoint(format!(
            "{name}: its q, k and v differ: {} {:?} and {} {:?}",
            first.dtype.name(),
            first.shape,
            other.dtype.name(),
            other.shape
        )));
    }
    let mut shape = first.shape.clone();
    shape[0] = parts.iter().map(|p| p.shape[0]).sum();
    Ok(RawTensor {
        dtype: first.dtype,
        shape,
        data: Cow::Owned(parts.iter().flat_map(|p| p.data.iter().copied()).collect()),
    })
}

/// A Conv3D kernel `[out, in, 2, p, p]` from its two time steps `[out, in, p, p]`.
pub(crate) fn join_time_steps<'a>(name: &str, a: RawTensor<'_>, b: RawTensor<'_>) -> Result<RawTensor<'a>, ModelError> {
    let bad = |why: String| ModelError::Checkpoint(format!("{name}: {why}"));
    let [out, inp, h, w] = a.shape[..] else {
        return Err(bad(format!("a patch embedding of shape {:?}, not 4-D", a.shape)));
    };
    if a.shape != b.shape || a.dtype != b.dtype {
        return Err(bad("its two time steps differ in shape or type".into()));
    }
    let kernel = a
        .dtype
        .bytes_of(h * w)
        .filter(|&k| k > 0)
        .ok_or_else(|| bad(format!("{h}×{w} kernels do not split into {} blocks", a.dtype.name())))?;
    let data = a
        .data
        .chunks_exact(kernel)
        .zip(b.data.chunks_exact(kernel))
        .flat_map(|(x, y)| x.iter().chain(y).copied())
        .collect();
    Ok(RawTensor {
        dtype: a.dtype,
        shape: vec![out, inp, 2, h, w],
        data: Cow::Owned(data),
    })
}

impl<B: Backend> TensorSource<B> for GgufTensors<'_> {
    fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    fn fetch(&self, name: &str) -> Result<Option<Stored<'_, B>>, ModelError> {
        match self.tensors.get(name) {
            Some(how) => Ok(Some(Stored::Raw(self.assemble(name, how)?))),
            None => Ok(None),
        }
    }
}

impl crate::arch::gguf_export::TensorValues for super::weights::SafetensorsFiles<'_> {
    fn names(&self) -> Vec<(String, Vec<usize>)> {
        let mut out: Vec<(String, Vec<usize>)> = super::weights::SafetensorsFiles::names(self)
            .filter_map(|n| Some((n.to_string(), self.raw(n).ok()??.shape)))
            .collect();
        out.sort();
        out
    }

    fn values(&mut self, name: &str) -> Result<Vec<f32>, crate::arch::gguf::GgufError> {
        match self.raw(name) {
            Ok(Some(raw)) => Ok(super::weights::host_f32(&raw)),
            Ok(None) => Err(crate::arch::gguf::GgufError(format!("{name} is missing"))),
            Err(e) => Err(crate::arch::gguf::GgufError(e.to_string())),
        }
    }
}
