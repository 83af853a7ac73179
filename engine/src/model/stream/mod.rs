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
//! model reads) bytes of the checkpoint ([`StreamLoader::peak_held`]). A header or tensor that lies
//! whole in a chunk is converted straight from it; one that straddles chunks is gathered in a buffer
//! of exactly its size, freed once converted. Headers are capped at [`MAX_HEADER_BYTES`] and a
//! tensor the model reads must have the shape its config implies before any of its bytes are
//! gathered, so a corrupt file cannot make it allocate more.

mod shard;
#[cfg(test)]
mod tests;

pub use shard::MAX_HEADER_BYTES;

use super::weights::{check_shape, raw_dtype, spellings, Converted, Loaded, Stored, TensorSource};
use super::{check_supported, ModelError, QwenVl};
use crate::arch::config::ModelConfig;
use crate::arch::spec::{tensor_specs, TensorSpec};
use crate::backend::{Backend, RawTensor};
use safetensors::Dtype;
use shard::{ShardReader, Sink};
use std::cell::RefCell;
use std::collections::HashMap;

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
    /// The shard being fed.
    shard: Option<ShardReader>,
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
            peak: 0,
            failed: false,
        })
    }

    /// Starts the next shard, `name` naming it in errors; the previous one must be complete.
    pub fn begin_shard(&mut self, name: impl Into<String>) -> Result<(), ModelError> {
        self.guard(|s| {
            s.end_shard()?;
            s.shard = Some(ShardReader::new(name.into()));
            Ok(())
        })
    }

    /// The next bytes of the current shard, in file order, of any length.
    pub fn push(&mut self, chunk: &[u8]) -> Result<(), ModelError> {
        self.guard(|s| match &mut s.shard {
            Some(shard) => shard.push(chunk, &mut s.convert),
            None => Err(ModelError::Checkpoint(
                "checkpoint bytes pushed before begin_shard named their file".into(),
            )),
        })
    }

    /// Checks that the last shard is complete and builds the model from the converted tensors.
    pub fn finish(mut self) -> Result<QwenVl<B>, ModelError> {
        self.guard(Self::end_shard)?;
        let source = Streamed(RefCell::new(self.convert.loaded));
        QwenVl::load(self.cfg, &source, self.convert.backend, |_, _| {})
    }

    /// The most checkpoint bytes the loader has held at once, besides the chunk being pushed.
    pub fn peak_held(&self) -> usize {
        self.shard.as_ref().map_or(0, ShardReader::peak_held).max(self.peak)
    }

    /// Ends the current shard, if any, checking it is complete.
    fn end_shard(&mut self) -> Result<(), ModelError> {
        if let Some(shard) = self.shard.take() {
            self.peak = self.peak.max(shard.peak_held());
            shard.end()?;
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
        let Some(spec) = self.wanted.get(name) else {
            return Ok(());
        };
        let raw = RawTensor {
            dtype: raw_dtype(name, dtype)?,
            shape: shape.to_vec(),
            data: data.into(),
        };
        let value = Converted::of(self.backend, spec, raw)?;
        let bytes = data.len() as u64;
        let loaded = Loaded {
            shape: shape.to_vec(),
            bytes,
            value,
        };
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
