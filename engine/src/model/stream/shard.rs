//! A push parser of one safetensors file: fed its bytes in file order, chunk by chunk, it parses
//! the 8-byte header length and the JSON header, then hands each tensor the [`Sink`] wants to it
//! as soon as the tensor's bytes are complete, and skips the others without holding them.
//!
//! Offsets are u64, so that a shard over 4 GiB streams on wasm32 too (the safetensors crate reads
//! them as `usize`). The header is validated as that crate validates a whole file: tensors ordered
//! by offset from 0 with neither gap nor overlap, each `numel × dtype size` bytes.

use super::super::ModelError;
use safetensors::Dtype;
use std::borrow::Cow;
use std::collections::HashMap;

/// The largest header accepted. A Qwen-VL checkpoint's header is about 200 KB (1,500 tensors);
/// safetensors allows 100 MB, too much to take on trust from a corrupt length in a browser tab.
pub const MAX_HEADER_BYTES: u64 = 16 << 20;

/// What the parser hands tensors to.
pub(super) trait Sink {
    /// Called for every tensor of a header just parsed: whether its bytes are wanted (an error
    /// stops the stream, e.g. a wanted tensor of the wrong shape).
    fn wants(&mut self, name: &str, dtype: Dtype, shape: &[usize]) -> Result<bool, ModelError>;
    /// A wanted tensor, complete.
    fn tensor(&mut self, name: &str, dtype: Dtype, shape: &[usize], data: &[u8]) -> Result<(), ModelError>;
}

/// One tensor of a header, in data order.
#[derive(Debug)]
struct Entry {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    /// Bytes of data.
    len: u64,
    /// Whether the sink wants it.
    wanted: bool,
}

/// Where the parser is in the file.
#[derive(Debug)]
enum Stage {
    /// Reading the header's length.
    Length,
    /// Reading a header of this many bytes.
    Header(usize),
    /// Reading tensor data: the header's tensors, the next one's index and the bytes of it
    /// skipped so far (unwanted tensors).
    Data {
        tensors: Vec<Entry>,
        next: usize,
        skipped: u64,
    },
    /// Every byte the header announced has arrived.
    Done,
}

/// The bytes of one item (header length, header, tensor) that may straddle chunks.
#[derive(Debug, Default)]
struct Gather {
    buf: Vec<u8>,
    /// The most bytes `buf` has held at once.
    peak: usize,
}

impl Gather {
    /// Takes the item's bytes (`want` in all) from the front of `chunk`; the item once complete:
    /// borrowed from the chunk when it lies there whole, else gathered in a buffer of exactly `want`
    /// bytes, allocated when its first bytes arrive.
    fn take<'c>(&mut self, want: usize, chunk: &mut &'c [u8]) -> Option<Cow<'c, [u8]>> {
        if self.buf.is_empty() && chunk.len() >= want {
            let (item, rest) = chunk.split_at(want);
            *chunk = rest;
            return Some(Cow::Borrowed(item));
        }
        if chunk.is_empty() {
            return None;
        }
        if self.buf.is_empty() {
            self.buf.reserve_exact(want);
            self.peak = self.peak.max(self.buf.capacity());
        }
        let n = (want - self.buf.len()).min(chunk.len());
        let (part, rest) = chunk.split_at(n);
        self.buf.extend_from_slice(part);
        *chunk = rest;
        (self.buf.len() == want).then(|| Cow::Owned(std::mem::take(&mut self.buf)))
    }
}

/// One safetensors file being streamed.
#[derive(Debug)]
pub(super) struct ShardReader {
    name: String,
    stage: Stage,
    gather: Gather,
    /// Bytes pushed so far.
    received: u64,
    /// The file's size, once its header is known.
    size: Option<u64>,
}

impl ShardReader {
    /// A reader of the file `name` (named in errors).
    pub(super) fn new(name: String) -> Self {
        ShardReader {
            name,
            stage: Stage::Length,
            gather: Gather::default(),
            received: 0,
            size: None,
        }
    }

    /// The most bytes of the file held at once (the header, or one tensor straddling chunks).
    pub(super) fn peak_held(&self) -> usize {
        self.gather.peak
    }

    /// Takes the next bytes of the file, handing `sink` every wanted tensor they complete.
    pub(super) fn push(&mut self, mut chunk: &[u8], sink: &mut impl Sink) -> Result<(), ModelError> {
        self.received += chunk.len() as u64;
        loop {
            match &mut self.stage {
                Stage::Length => {
                    let Some(bytes) = self.gather.take(8, &mut chunk) else {
                        break;
                    };
                    let mut len = [0u8; 8];
                    len.copy_from_slice(&bytes);
                    let len = u64::from_le_bytes(len);
                    if len > MAX_HEADER_BYTES {
                        return Err(invalid(
                            &self.name,
                            format!("a header of {len} bytes (at most {MAX_HEADER_BYTES} are accepted)"),
                        ));
                    }
                    self.stage = Stage::Header(len as usize);
                }
                Stage::Header(len) => {
                    let len = *len;
                    let Some(bytes) = self.gather.take(len, &mut chunk) else {
                        break;
                    };
                    let (mut tensors, data) = parse_header(&bytes).map_err(|e| invalid(&self.name, e))?;
                    for t in &mut tensors {
                        t.wanted = sink.wants(&t.name, t.dtype, &t.shape)?;
                        if t.wanted && usize::try_from(t.len).is_err() {
                            return Err(invalid(
                                &self.name,
                                format!(
                                    "tensor {} of {} bytes, more than this platform addresses",
                                    t.name, t.len
                                ),
                            ));
                        }
                    }
                    self.size = Some((8 + len as u64).saturating_add(data));
                    self.stage = Stage::Data {
                        tensors,
                        next: 0,
                        skipped: 0,
                    };
                }
                Stage::Data { tensors, next, skipped } => {
                    let Some(t) = tensors.get(*next) else {
                        self.stage = Stage::Done;
                        continue;
                    };
                    if t.wanted {
                        let Some(bytes) = self.gather.take(t.len as usize, &mut chunk) else {
                            break;
                        };
                        sink.tensor(&t.name, t.dtype, &t.shape, &bytes)?;
                    } else {
                        let n = (t.len - *skipped).min(chunk.len() as u64);
                        chunk = &chunk[n as usize..];
                        *skipped += n;
                        if *skipped < t.len {
                            break;
                        }
                        *skipped = 0;
                    }
                    *next += 1;
                }
                Stage::Done => {
                    if !chunk.is_empty() {
                        return Err(invalid(&self.name, "bytes after the last tensor's data"));
                    }
                    break;
                }
            }
        }
        Ok(())
    }

    /// Checks that the whole file has arrived.
    pub(super) fn end(&self) -> Result<(), ModelError> {
        if matches!(self.stage, Stage::Done) {
            return Ok(());
        }
        let of = self.size.map(|s| format!(" of {s}")).unwrap_or_default();
        Err(ModelError::Checkpoint(format!(
            "{} is truncated: it ended after {}{of} bytes",
            self.name, self.received
        )))
    }
}

/// The error for a file that is not safetensors.
fn invalid(name: &str, why: impl std::fmt::Display) -> ModelError {
    ModelError::Checkpoint(format!("{name} is not a valid safetensors file: {why}"))
}

/// A header's tensors in data order, and the bytes of data they span.
fn parse_header(bytes: &[u8]) -> Result<(Vec<Entry>, u64), String> {
    #[derive(serde::Deserialize)]
    struct Header {
        #[serde(rename = "__metadata__")]
        _metadata: Option<serde::de::IgnoredAny>,
        #[serde(flatten)]
        tensors: HashMap<String, Info>,
    }
    #[derive(serde::Deserialize)]
    struct Info {
        dtype: Dtype,
        shape: Vec<usize>,
        data_offsets: (u64, u64),
    }
    let header: Header = serde_json::from_slice(bytes).map_err(|e| format!("header: {e}"))?;
    let mut tensors: Vec<(String, Info)> = header.tensors.into_iter().collect();
    tensors.sort_by_key(|(_, t)| t.data_offsets);
    let mut end = 0;
    let mut out = Vec::with_capacity(tensors.len());
    for (name, t) in tensors {
        let (start, stop) = t.data_offsets;
        if start != end || stop < start {
            return Err(format!(
                "tensor {name} at bytes [{start}, {stop}) does not follow on from byte {end} (out of order, overlapping or leaving a gap)"
            ));
        }
        let bits = t
            .shape
            .iter()
            .try_fold(t.dtype.bitsize() as u64, |acc, &d| acc.checked_mul(d as u64));
        let size = bits.filter(|b| b % 8 == 0).map(|b| b / 8);
        if size != Some(stop - start) {
            return Err(format!(
                "tensor {name} has {} bytes for shape {:?} of {:?}",
                stop - start,
                t.shape,
                t.dtype
            ));
        }
        end = stop;
        out.push(Entry {
            name,
            dtype: t.dtype,
            shape: t.shape,
            len: stop - start,
            wanted: false,
        });
    }
    Ok((out, end))
}
