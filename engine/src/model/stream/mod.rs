//! Loading a checkpoint that arrives as a stream of chunks (a `fetch` response body, a `File` read
//! in slices) without ever holding a whole file: the shards are fed one after the other, each in
//! file order ([`StreamLoader::begin_shard`], [`StreamLoader::push`]); every tensor the model reads
//! is converted as soon as its bytes are complete (onto the backend, or to host floats for the few
//! the model reads on the host) and its bytes dropped; tensors the model does not read are skipped.
//! [`StreamLoader::finish`] then builds the model from the converted tensors with [`QwenVl::load`],
//! the same code as from whole files, so names (either checkpoint prefix), shapes and missing
//! tensors are checked as there.
//!
//! Memory: besides the chunk being pushed, the loader holds at most max(header, largest tensor the
//! model reads) bytes of the checkpoint ([`StreamLoader::peak_held`]); a GGUF pair's split tensors
//! (q/k/v, the patch kernel's time steps; a few MiB) are also held until all their pieces are in.
//! A header or tensor that lies whole in a chunk is converted straight from it; one that straddles chunks is gathered in a buffer
//! of exactly its size, freed once converted. Headers are capped at [`MAX_HEADER_BYTES`] and a
//! tensor the model reads must have the shape its config implies before any of its bytes are
//! gathered, so a corrupt file cannot make it allocate more.

mod gguf;
mod shard;
#[cfg(test)]
mod tests;

pub use shard::MAX_HEADER_BYTES;

use super::gguf_tensors::{join_rows, join_time_steps};
use super::weights::{check_shape, raw_dtype, spellings, Converted, Loaded, Stored, TensorSource};
use super::{check_supported, ModelError, QwenVl};
use crate::arch::config::ModelConfig;
use crate::arch::gguf::Gguf;
use crate::arch::gguf_model::{Assembly, Part};
use crate::arch::spec::{tensor_specs, TensorSpec};
use crate::backend::{Backend, RawTensor};
use gguf::{GgufReader, Target, Want};
use safetensors::Dtype;
use shard::{ShardReader, Sink};
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};

/// Loads a model from safetensors shards pushed chunk by chunk.
///
/// ```text
/// let mut stream = StreamLoader::new(cfg, &backend, |tensors, bytes| ..)?;
/// for each shard { stream.begin_shard(name)?; for each chunk { stream.push(&chunk)?; } }
/// let model = stream.finish()?;
/// ```
///
/// After an error every later call fails: the stream must be started again.
pub struct StreamLoader<'b, B: Backend, P> {
    cfg: ModelConfig,
    convert: Convert<'b, B, P>,
    /// The file being fed.
    shard: Option<File>,
    /// The pieces of GGUF tensors put together from several (q, k, v; the patch kernel's time
    /// steps), by transformers name: how, and the pieces arrived so far.
    pieces: HashMap<String, (Assembly, Vec<Option<RawTensor<'static>>>)>,
    /// The most bytes held at once by the shards already ended.
    peak: usize,
    failed: bool,
}

impl<B: Backend, P> std::fmt::Debug for StreamLoader<'_, B, P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamLoader")
            .field("shard", &self.shard)
            .field("converted", &self.convert.done)
            .field("peak", &self.peak)
            .field("failed", &self.failed)
            .finish_non_exhaustive()
    }
}

impl<'b, B: Backend, P: FnMut(usize, u64)> StreamLoader<'b, B, P> {
    /// A loader of a model of `cfg` onto `backend`; `progress` is called after each tensor
    /// converted with (tensors, bytes) converted so far. Fails at once for a model the engine
    /// cannot run.
    pub fn new(cfg: ModelConfig, backend: &'b B, progress: P) -> Result<Self, ModelError> {
        check_supported(&cfg)?;
        let mut wanted = HashMap::new();
        for spec in tensor_specs(&cfg) {
            for name in spellings(&spec.name) {
                wanted.insert(name, spec.clone());
            }
        }
        Ok(StreamLoader {
            cfg,
            convert: Convert {
                backend,
                wanted,
                loaded: HashMap::new(),
                progress,
                done: (0, 0),
            },
            shard: None,
            pieces: HashMap::new(),
            peak: 0,
            failed: false,
        })
    }

    /// Starts the next shard, `name` naming it in errors; the previous one must be complete.
    pub fn begin_shard(&mut self, name: impl Into<String>) -> Result<(), ModelError> {
        self.guard(|s| {
            s.end_shard()?;
            s.shard = Some(File::Safetensors(ShardReader::new(name.into())));
            Ok(())
        })
    }

    /// Starts `part` of a GGUF pair, `label` naming it in errors: `file` is its header (read
    /// first, from the file's first bytes), `tensors` the pair's [`GgufModel::tensors`]. Its
    /// bytes are then pushed from the file's start.
    ///
    /// [`GgufModel::tensors`]: crate::arch::gguf_model::GgufModel::tensors
    pub fn begin_gguf(
        &mut self,
        label: impl Into<String>,
        file: &Gguf,
        part: Part,
        tensors: &BTreeMap<String, Assembly>,
    ) -> Result<(), ModelError> {
        self.guard(|s| {
            s.end_shard()?;
            let mut wants = Vec::new();
            for (name, how) in tensors {
                let Some(spec) = s.convert.wanted.get(name) else {
                    continue;
                };
                let pieces = match how {
                    Assembly::One(p) => vec![*p],
                    Assembly::Rows(ps) => ps.clone(),
                    Assembly::Temporal(ps) => ps.to_vec(),
                };
                for (slot, p) in pieces.iter().enumerate().filter(|(_, p)| p.part == part) {
                    let t = file.tensors.get(p.index).ok_or_else(|| {
                        ModelError::Checkpoint(format!("{name}: the tensor map is not of this file's header"))
                    })?;
                    let target = match how {
                        Assembly::One(_) => {
                            check_shape(name, &t.shape(), &spec.shape)?;
                            Target::Whole(name.clone())
                        }
                        _ => {
                            check_shape(&t.name, &t.shape(), &piece_shape(how, &spec.shape, pieces.len()))?;
                            s.pieces
                                .entry(name.clone())
                                .or_insert_with(|| (how.clone(), vec![None; pieces.len()]));
                            Target::Piece {
                                name: name.clone(),
                                slot,
                            }
                        }
                    };
                    wants.push(Want {
                        start: t.start,
                        bytes: t.bytes,
                        dtype: crate::backend::RawDType::of_ggml(t.ggml_type),
                        shape: t.shape(),
                        target,
                    });
                }
            }
            s.shard = Some(File::Gguf(GgufReader::new(label.into(), wants)));
            Ok(())
        })
    }

    /// The next bytes of the current shard, in file order, of any length.
    pub fn push(&mut self, chunk: &[u8]) -> Result<(), ModelError> {
        self.guard(|s| match &mut s.shard {
            Some(File::Safetensors(shard)) => shard.push(chunk, &mut s.convert),
            Some(File::Gguf(file)) => {
                let (convert, pieces) = (&mut s.convert, &mut s.pieces);
                file.push(chunk, &mut |target, raw| match target {
                    Target::Whole(name) => convert.convert(name, raw),
                    Target::Piece { name, slot } => {
                        let Some((how, got)) = pieces.get_mut(name) else {
                            return Ok(());
                        };
                        got[*slot] = Some(RawTensor {
                            data: std::borrow::Cow::Owned(raw.data.into_owned()),
                            ..raw
                        });
                        if got.iter().any(Option::is_none) {
                            return Ok(());
                        }
                        let parts: Vec<RawTensor<'static>> = got.drain(..).flatten().collect();
                        let whole = match how {
                            Assembly::Temporal(_) => {
                                let mut it = parts.into_iter();
                                let (a, b) = (it.next(), it.next());
                                match (a, b) {
                                    (Some(a), Some(b)) => join_time_steps(name, a, b)?,
                                    _ => return Err(ModelError::Checkpoint(format!("{name}: a time step is missing"))),
                                }
                            }
                            _ => join_rows(name, parts)?,
                        };
                        let name = name.clone();
                        pieces.remove(&name);
                        convert.convert(&name, whole)
                    }
                })
            }
            None => Err(ModelError::Checkpoint(
                "checkpoint bytes pushed before begin_shard named their file".into(),
            )),
        })
    }

    /// Checks that the last shard is complete and builds the model from the converted tensors.
    pub fn finish(mut self) -> Result<QwenVl<B>, ModelError> {
        self.guard(Self::end_shard)?;
        if let Some(name) = self.pieces.keys().next() {
            return Err(ModelError::Checkpoint(format!(
                "{name}: some of its pieces never arrived"
            )));
        }
        let source = Streamed(RefCell::new(self.convert.loaded));
        QwenVl::load(self.cfg, &source, self.convert.backend, |_, _| {})
    }

    /// The most checkpoint bytes the loader has held at once, besides the chunk being pushed.
    pub fn peak_held(&self) -> usize {
        self.shard.as_ref().map_or(0, File::peak_held).max(self.peak)
    }

    /// Ends the current shard, if any, checking it is complete.
    fn end_shard(&mut self) -> Result<(), ModelError> {
        if let Some(shard) = self.shard.take() {
            self.peak = self.peak.max(shard.peak_held());
            match &shard {
                File::Safetensors(f) => f.end()?,
                File::Gguf(f) => f.end()?,
            }
        }
        Ok(())
    }

    /// Runs `f` unless an earlier call failed; remembers whether it fails.
    fn guard(&mut self, f: impl FnOnce(&mut Self) -> Result<(), ModelError>) -> Result<(), ModelError> {
        if self.failed {
            return Err(ModelError::Checkpoint(
                "the checkpoint stream already failed; start it again".into(),
            ));
        }
        let result = f(self);
        self.failed = result.is_err();
        result
    }
}

/// The shape each of `n` pieces of a tensor of `shape` has: equal runs of rows, or a Conv3D
/// kernel's time step (`[out, in, 2, p, p]` → `[out, in, p, p]`).
fn piece_shape(how: &Assembly, shape: &[usize], n: usize) -> Vec<usize> {
    match (how, shape) {
        (Assembly::Temporal(_), &[o, i, _, h, w]) => vec![o, i, h, w],
        (_, [rows, rest @ ..]) => [&[rows / n.max(1)], rest].concat(),
        _ => Vec::new(),
    }
}

/// The file being fed.
#[derive(Debug)]
enum File {
    Safetensors(ShardReader),
    Gguf(GgufReader),
}

impl File {
    fn peak_held(&self) -> usize {
        match self {
            File::Safetensors(f) => f.peak_held(),
            File::Gguf(f) => f.peak_held(),
        }
    }
}

/// Converts the tensors the model reads as they complete.
struct Convert<'b, B: Backend, P> {
    backend: &'b B,
    /// The model's tensors under every spelling.
    wanted: HashMap<String, TensorSpec>,
    /// Converted tensors by the name they were stored under.
    loaded: HashMap<String, Loaded<B>>,
    progress: P,
    /// Tensors and bytes converted so far.
    done: (usize, u64),
}

impl<B: Backend, P: FnMut(usize, u64)> Sink for Convert<'_, B, P> {
    fn wants(&mut self, name: &str, dtype: Dtype, shape: &[usize]) -> Result<bool, ModelError> {
        let Some(spec) = self.wanted.get(name) else {
            return Ok(false);
        };
        raw_dtype(name, dtype)?;
        check_shape(name, shape, &spec.shape)?;
        Ok(true)
    }

    fn tensor(&mut self, name: &str, dtype: Dtype, shape: &[usize], data: &[u8]) -> Result<(), ModelError> {
        let raw = RawTensor {
            dtype: raw_dtype(name, dtype)?,
            shape: shape.to_vec(),
            data: data.into(),
        };
        self.convert(name, raw)
    }
}

impl<B: Backend, P: FnMut(usize, u64)> Convert<'_, B, P> {
    /// Converts tensor `name` (checked against the model's shape), if the model reads it.
    fn convert(&mut self, name: &str, raw: RawTensor<'_>) -> Result<(), ModelError> {
        let Some(spec) = self.wanted.get(name) else {
            return Ok(());
        };
        check_shape(name, &raw.shape, &spec.shape)?;
        let (shape, bytes) = (raw.shape.clone(), raw.data.len() as u64);
        let value = Converted::of(self.backend, spec, raw)?;
        let loaded = Loaded { shape, bytes, value };
        self.loaded.insert(name.to_string(), loaded);
        self.done = (self.done.0 + 1, self.done.1 + bytes);
        (self.progress)(self.done.0, self.done.1);
        Ok(())
    }
}

/// The converted tensors, handed to the [`super::weights::Loader`] by name, each once.
struct Streamed<B: Backend>(RefCell<HashMap<String, Loaded<B>>>);

impl<B: Backend> TensorSource<B> for Streamed<B> {
    fn contains(&self, name: &str) -> bool {
        self.0.borrow().contains_key(name)
    }

    fn fetch(&self, name: &str) -> Result<Option<Stored<'_, B>>, ModelError> {
        Ok(self.0.borrow_mut().remove(name).map(Stored::Loaded))
    }
}
