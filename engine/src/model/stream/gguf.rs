//! A push reader of one GGUF file of a pair whose header was read first (a range request): fed the
//! file's bytes from its start, in order, chunk by chunk, it hands each tensor the model reads on
//! as soon as its bytes are complete and skips the rest (the header included) without holding it.
//! A tensor that lies whole in a chunk is handed on from the chunk; one that straddles chunks is
//! gathered in a buffer of exactly its size, which the header (checked against the file's length)
//! bounds.

use super::super::ModelError;
use crate::backend::{RawDType, RawTensor};
use std::borrow::Cow;

/// What a tensor of the file becomes.
#[derive(Debug, Clone)]
pub(super) enum Target {
    /// The whole transformers tensor `name`.
    Whole(String),
    /// Piece `slot` of transformers tensor `name` (q, k, v; a time step of the patch kernel).
    Piece { name: String, slot: usize },
}

/// A tensor the model reads, where the file holds it.
#[derive(Debug)]
pub(super) struct Want {
    pub start: u64,
    pub bytes: u64,
    pub dtype: RawDType,
    pub shape: Vec<usize>,
    pub target: Target,
}

/// The reader of one file.
#[derive(Debug)]
pub(super) struct GgufReader {
    label: String,
    /// Bytes of the file pushed so far.
    at: u64,
    /// The tensors the model reads, by start.
    wants: Vec<Want>,
    /// The first of `wants` not yet complete.
    next: usize,
    /// The bytes of `wants[next]` gathered so far, when it straddles chunks.
    gather: Vec<u8>,
    peak: usize,
}

impl GgufReader {
    pub(super) fn new(label: String, mut wants: Vec<Want>) -> Self {
        wants.sort_by_key(|w| w.start);
        GgufReader {
            label,
            at: 0,
            wants,
            next: 0,
            gather: Vec::new(),
            peak: 0,
        }
    }

    /// The most bytes gathered at once.
    pub(super) fn peak_held(&self) -> usize {
        self.peak
    }

    /// The next bytes of the file; `done` gets each wanted tensor once complete.
    pub(super) fn push(
        &mut self,
        chunk: &[u8],
        done: &mut impl FnMut(&Target, RawTensor<'_>) -> Result<(), ModelError>,
    ) -> Result<(), ModelError> {
        let (chunk_start, chunk_end) = (self.at, self.at + chunk.len() as u64);
        while let Some(w) = self.wants.get(self.next) {
            let end = w.start + w.bytes;
            if w.start >= chunk_end {
                break;
            }
            let from = w.start.max(chunk_start);
            let to = end.min(chunk_end);
            let piece = &chunk[(from - chunk_start) as usize..(to - chunk_start) as usize];
            let data: Cow<'_, [u8]> = if self.gather.is_empty() && from == w.start && to == end {
                Cow::Borrowed(piece)
            } else {
                if self.gather.is_empty() {
                    self.gather.reserve_exact(w.bytes as usize);
                }
                self.gather.extend_from_slice(piece);
                self.peak = self.peak.max(self.gather.len());
                if to < end {
                    break;
                }
                Cow::Owned(std::mem::take(&mut self.gather))
            };
            let raw = RawTensor {
                dtype: w.dtype,
                shape: w.shape.clone(),
                data,
            };
            done(&w.target, raw)?;
            self.next += 1;
        }
        self.at = chunk_end;
        Ok(())
    }

    /// Checks that every wanted tensor arrived.
    pub(super) fn end(&self) -> Result<(), ModelError> {
        match self.wants.get(self.next) {
            None => Ok(()),
            Some(w) => Err(ModelError::Checkpoint(format!(
                "{} ended after {} bytes, inside or before a tensor at {}..{}: the file is truncated",
                self.label,
                self.at,
                w.start,
                w.start + w.bytes
            ))),
        }
    }
}
