//! GGUF files as llama.cpp writes them (versions 2 and 3, little-endian): the header's metadata
//! and tensor table, read from the file's first bytes, checked against the file's length. The
//! tensors' bytes stay where they are (memory-mapped natively, fetched by range in the browser);
//! [`GgufTensor`] says where each one is and what it holds ([`super::ggml::GgmlType`]).
//!
//! Layout (<https://github.com/ggml-org/ggml/blob/master/docs/gguf.md>): magic `GGUF`, version
//! (u32), tensor count and metadata count (u64), the metadata (key, type, value), the tensor table
//! (name, dimension count, dimensions innermost first, type, offset), then padding to
//! `general.alignment` (32 when absent) and the tensors, each at its offset from there.

use super::ggml::GgmlType;
use std::collections::BTreeMap;

/// What is wrong with a GGUF file, in one line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GgufError(pub String);

impl std::fmt::Display for GgufError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for GgufError {}

type Result<T> = std::result::Result<T, GgufError>;

fn err<T>(msg: impl Into<String>) -> Result<T> {
    Err(GgufError(msg.into()))
}

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<MetaValue>),
}

impl MetaValue {
    /// The value as an unsigned integer, when it is a non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetaValue::U8(v) => Some(v.into()),
            MetaValue::U16(v) => Some(v.into()),
            MetaValue::U32(v) => Some(v.into()),
            MetaValue::U64(v) => Some(v),
            MetaValue::I8(v) => u64::try_from(v).ok(),
            MetaValue::I16(v) => u64::try_from(v).ok(),
            MetaValue::I32(v) => u64::try_from(v).ok(),
            MetaValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a float, when it is a number.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::F32(v) => Some(v.into()),
            MetaValue::F64(v) => Some(v),
            MetaValue::I8(v) => Some(v.into()),
            MetaValue::I16(v) => Some(v.into()),
            MetaValue::I32(v) => Some(v.into()),
            MetaValue::I64(v) => Some(v as f64),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    /// The value as text, when it is a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// The elements, when it is an array.
    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array(v) => Some(v),
            _ => None,
        }
    }
}

/// One tensor of the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GgufTensor {
    /// Its name (llama.cpp's: `blk.0.attn_q.weight`, `v.blk.0.attn_qkv.weight`, …).
    pub name: String,
    /// Its dimensions as GGML counts them, innermost (a row's length) first.
    pub ne: Vec<u64>,
    /// How its values are stored.
    pub ggml_type: GgmlType,
    /// Where its bytes start, from the start of the file.
    pub start: u64,
    /// How many bytes it takes.
    pub bytes: u64,
}

impl GgufTensor {
    /// Its shape outermost first, as safetensors and transformers write it.
    pub fn shape(&self) -> Vec<usize> {
        // A dimension past wasm32's usize saturates: no model's shape matches it.
        self.ne
            .iter()
            .rev()
            .map(|&d| usize::try_from(d).unwrap_or(usize::MAX))
            .collect()
    }

    /// Number of values.
    pub fn numel(&self) -> u64 {
        self.ne.iter().product()
    }
}

/// A GGUF file's header: metadata and tensor table.
#[derive(Debug, Clone, PartialEq)]
pub struct Gguf {
    /// The format version (2 or 3).
    pub version: u32,
    /// The metadata by key.
    pub metadata: BTreeMap<String, MetaValue>,
    /// The tensors in file order.
    pub tensors: Vec<GgufTensor>,
    /// Where the tensor data starts.
    pub data_start: u64,
}

/// Arrays nest at most this deep (llama.cpp writes none nested).
const MAX_DEPTH: usize = 3;
/// A tensor has at most this many dimensions (GGML's `GGML_MAX_DIMS`).
const MAX_DIMS: u32 = 4;

/// Reads the header from a byte slice.
struct Cursor<'a> {
    bytes: &'a [u8],
    at: usize,
    /// Set when a read ran past `bytes` (or a count past what they could hold): a prefix of the
    /// file too short for its header.
    short: bool,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        match self.at.checked_add(n).filter(|&end| end <= self.bytes.len()) {
            Some(end) => {
                let out = &self.bytes[self.at..end];
                self.at = end;
                Ok(out)
            }
            None => {
                self.short = true;
                err(format!(
                    "the header ends inside {what} (at byte {}, {n} bytes wanted, {} read)",
                    self.at,
                    self.bytes.len()
                ))
            }
        }
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        Ok(self.take(N, what)?.try_into().expect("took N bytes"))
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A count of items of at least `min_bytes` each, refused when the rest of the header could
    /// not hold them (a lying count would otherwise reserve memory it names).
    fn count(&mut self, what: &str, min_bytes: usize) -> Result<usize> {
        let n = self.u64(what)?;
        let room = (self.bytes.len() - self.at) / min_bytes.max(1);
        match usize::try_from(n) {
            Ok(n) if n <= room => Ok(n),
            _ => {
                self.short = true;
                err(format!(
                    "{what} is {n}, more than the {} bytes left of the header can hold",
                    self.bytes.len() - self.at
                ))
            }
        }
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let n = self.count(what, 1)?;
        let bytes = self.take(n, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| GgufError(format!("{what} is not UTF-8")))
    }

    fn value(&mut self, kind: u32, key: &str, depth: usize) -> Result<MetaValue> {
        Ok(match kind {
            0 => MetaValue::U8(self.array::<1>(key)?[0]),
            1 => MetaValue::I8(self.array::<1>(key)?[0] as i8),
            2 => MetaValue::U16(u16::from_le_bytes(self.array(key)?)),
            3 => MetaValue::I16(i16::from_le_bytes(self.array(key)?)),
            4 => MetaValue::U32(self.u32(key)?),
            5 => MetaValue::I32(i32::from_le_bytes(self.array(key)?)),
            6 => MetaValue::F32(f32::from_le_bytes(self.array(key)?)),
            7 => match self.array::<1>(key)?[0] {
                0 => MetaValue::Bool(false),
                1 => MetaValue::Bool(true),
                b => return err(format!("{key}: {b} is not a boolean")),
            },
            8 => MetaValue::String(self.string(key)?),
            9 => {
                if depth >= MAX_DEPTH {
                    return err(format!("{key}: arrays nested more than {MAX_DEPTH} deep"));
                }
                let elem = self.u32(key)?;
                let n = self.count(key, 1)?;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.value(elem, key, depth + 1)?);
                }
                MetaValue::Array(items)
            }
            10 => MetaValue::U64(self.u64(key)?),
            11 => MetaValue::I64(i64::from_le_bytes(self.array(key)?)),
            12 => MetaValue::F64(f64::from_le_bytes(self.array(key)?)),
            other => return err(format!("{key}: unknown metadata type {other}")),
        })
    }
}

impl Gguf {
    /// Reads the header from the first bytes of a file of `file_len` bytes (`bytes` may be the
    /// whole file or any prefix holding the header) and checks every tensor against the file:
    /// a known type, a whole number of blocks, its bytes inside the file and aligned, no two
    /// tensors overlapping or sharing a name.
    pub fn parse(bytes: &[u8], file_len: u64) -> Result<Self> {
        Self::parse_with(
            &mut Cursor {
                bytes,
                at: 0,
                short: false,
            },
            file_len,
        )
    }

    /// As [`Gguf::parse`], for the first bytes of a file read a piece at a time: `None` when
    /// `bytes` (shorter than the file) ends before the header does, so more must be read.
    pub fn parse_prefix(bytes: &[u8], file_len: u64) -> Result<Option<Self>> {
        let mut c = Cursor {
            bytes,
            at: 0,
            short: false,
        };
        match Self::parse_with(&mut c, file_len) {
            Err(_) if c.short && (bytes.len() as u64) < file_len => Ok(None),
            r => r.map(Some),
        }
    }

    fn parse_with(c: &mut Cursor<'_>, file_len: u64) -> Result<Self> {
        if c.take(4, "the magic")? != b"GGUF" {
            return err("not a GGUF file (it does not start with GGUF)");
        }
        let version = c.u32("the version")?;
        if !(2..=3).contains(&version) {
            return err(format!("GGUF version {version} is not supported (2 or 3)"));
        }
        // A tensor's entry takes at least 8 + 4 + 4 + 8 bytes, a metadata entry 8 + 4 + 1.
        let n_tensors = c.count("the tensor count", 24)?;
        let n_meta = c.count("the metadata count", 13)?;
        let mut metadata = BTreeMap::new();
        for _ in 0..n_meta {
            let key = c.string("a metadata key")?;
            let kind = c.u32(&key)?;
            let value = c.value(kind, &key, 0)?;
            if metadata.insert(key.clone(), value).is_some() {
                return err(format!("metadata key {key} appears twice"));
            }
        }
        let alignment = match metadata.get("general.alignment") {
            None => 32,
            Some(v) => match v.as_u64() {
                Some(a) if a.is_power_of_two() => a,
                _ => return err(format!("general.alignment {v:?} is not a power of two")),
            },
        };
        let mut tensors = Vec::with_capacity(n_tensors);
        for _ in 0..n_tensors {
            let name = c.string("a tensor name")?;
            let n_dims = c.u32(&name)?;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return err(format!("tensor {name} has {n_dims} dimensions (1 to {MAX_DIMS})"));
            }
            let ne = (0..n_dims).map(|_| c.u64(&name)).collect::<Result<Vec<u64>>>()?;
            if ne.contains(&0) {
                return err(format!("tensor {name} has a dimension of 0 ({ne:?})"));
            }
            let ggml_type = GgmlType::from_id(c.u32(&name)?).map_err(|e| GgufError(format!("tensor {name}: {e}")))?;
            let offset = c.u64(&name)?;
            let numel = ne.iter().try_fold(1u64, |n, &d| n.checked_mul(d));
            let (values, _) = ggml_type.block();
            let bytes = match numel.and_then(|n| ggml_type.bytes_of(n)) {
                Some(b) if ne[0] % values as u64 == 0 => b,
                _ => {
                    return err(format!(
                        "tensor {name} of {ne:?} values does not split into {ggml_type} blocks of {values}"
                    ))
                }
            };
            if offset % alignment != 0 {
                return err(format!(
                    "tensor {name} starts at {offset}, not a multiple of {alignment}"
                ));
            }
            tensors.push((name, ne, ggml_type, offset, bytes));
        }
        let data_start = (c.at as u64).div_ceil(alignment) * alignment;
        let mut out = Vec::with_capacity(tensors.len());
        for (name, ne, ggml_type, offset, bytes) in tensors {
            let start = data_start.checked_add(offset);
            match start.and_then(|s| s.checked_add(bytes)) {
                Some(end) if end <= file_len => {}
                _ => {
                    return err(format!(
                        "tensor {name} ({bytes} bytes at data offset {offset}) ends past the file's {file_len} bytes: \
                         the file is truncated or its header lies"
                    ))
                }
            }
            out.push(GgufTensor {
                name,
                ne,
                ggml_type,
                start: start.expect("checked above"),
                bytes,
            });
        }
        let mut by_start: Vec<&GgufTensor> = out.iter().collect();
        by_start.sort_by_key(|t| t.start);
        for pair in by_start.windows(2) {
            if pair[0].start + pair[0].bytes > pair[1].start {
                return err(format!("tensors {} and {} overlap", pair[0].name, pair[1].name));
            }
        }
        let mut names: Vec<&str> = out.iter().map(|t| t.name.as_str()).collect();
        names.sort_unstable();
        if let Some(pair) = names.windows(2).find(|p| p[0] == p[1]) {
            return err(format!("tensor {} appears twice", pair[0]));
        }
        Ok(Gguf {
            version,
            metadata,
            tensors: out,
            data_start,
        })
    }

    /// A metadata value by key.
    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }

    /// A tensor by name.
    pub fn tensor(&self, name: &str) -> Option<&GgufTensor> {
        self.tensors.iter().find(|t| t.name == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TYPES: &[u8] = include_bytes!("../../tests/fixtures/gguf/types.gguf");
    const TYPES_F32: &[u8] = include_bytes!("../../tests/fixtures/gguf/types.f32");

    /// gguf-py wrote the file (tools/gguf/make_fixtures.py): its metadata reads back, and every
    /// tensor dequantizes to the values gguf-py's `dequantize` gave, to the bit.
    #[test]
    fn a_file_gguf_py_wrote_reads_back_with_gguf_py_s_values() {
        let g = Gguf::parse(TYPES, TYPES.len() as u64).unwrap();
        assert_eq!(g.version, 3);
        assert_eq!(
            g.get("general.architecture").and_then(MetaValue::as_str),
            Some("kvlens-fixture")
        );
        let num = |k: &str| g.get(&format!("kvlens.fixture.{k}")).unwrap().clone();
        assert_eq!(num("u8"), MetaValue::U8(200));
        assert_eq!(num("i8"), MetaValue::I8(-100));
        assert_eq!(num("u16"), MetaValue::U16(60000));
        assert_eq!(num("i16"), MetaValue::I16(-30000));
        assert_eq!(num("u32"), MetaValue::U32(4_000_000_000));
        assert_eq!(num("i32"), MetaValue::I32(-2_000_000_000));
        assert_eq!(num("f32"), MetaValue::F32(0.25));
        assert_eq!(num("u64"), MetaValue::U64((1 << 40) + 3));
        assert_eq!(num("i64"), MetaValue::I64(-(1 << 40)));
        assert_eq!(num("f64"), MetaValue::F64(-1.5));
        assert_eq!(num("bool"), MetaValue::Bool(true));
        let strings = num("strings");
        let strings: Vec<&str> = strings
            .as_array()
            .unwrap()
            .iter()
            .filter_map(MetaValue::as_str)
            .collect();
        assert_eq!(strings, ["a", "bé", "漢字 🙂"]);
        let ints: Vec<f64> = num("ints")
            .as_array()
            .unwrap()
            .iter()
            .filter_map(MetaValue::as_f64)
            .collect();
        assert_eq!(ints, [1.0, -2.0, 3.0]);

        let want: Vec<f32> = TYPES_F32
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        assert_eq!(g.tensors.len(), GgmlType::ALL.len());
        let mut at = 0;
        for (t, ty) in g.tensors.iter().zip(GgmlType::ALL) {
            assert_eq!(t.name, format!("t.{}", ty.name().to_lowercase()));
            assert_eq!((t.ggml_type, t.shape()), (ty, vec![2, 512]));
            let data = &TYPES[t.start as usize..(t.start + t.bytes) as usize];
            let mut got = vec![0f32; 1024];
            ty.dequantize(data, &mut got);
            let want = &want[at..at + 1024];
            let differ = got.iter().zip(want).filter(|(g, w)| g.to_bits() != w.to_bits()).count();
            assert_eq!(differ, 0, "{ty}: {differ} of 1024 values differ from gguf-py's");
            at += 1024;
        }
    }

    /// Every prefix of the file short of its header is refused with an error, never a panic (a
    /// prefix that holds the header, without the padding after it, reads as the whole file does);
    /// the whole header against a shorter file is refused too.
    #[test]
    fn truncated_files_are_refused() {
        let whole = Gguf::parse(TYPES, TYPES.len() as u64).unwrap();
        let mut refused = 0;
        for n in 0..whole.data_start as usize {
            match Gguf::parse(&TYPES[..n], TYPES.len() as u64) {
                Ok(g) => assert_eq!(g, whole, "a header of {n} bytes"),
                Err(_) => refused += 1,
            }
        }
        assert!(refused > whole.data_start as usize - 32, "{refused} prefixes refused");
        let end = whole.tensors.iter().map(|t| t.start + t.bytes).max().unwrap();
        let e = Gguf::parse(TYPES, end - 1).unwrap_err();
        assert!(e.0.contains("t.q6_k") && e.0.contains("truncated"), "{e}");
    }

    /// Read a piece at a time (the browser's range requests), every prefix short of the header
    /// asks for more and the first that holds it gives the whole file's header; a lie is an error
    /// however much of the file has been read.
    #[test]
    fn a_prefix_short_of_the_header_asks_for_more() {
        let whole = Gguf::parse(TYPES, TYPES.len() as u64).unwrap();
        let file_len = TYPES.len() as u64;
        let first = (0..=TYPES.len())
            .find(|&n| Gguf::parse_prefix(&TYPES[..n], file_len).unwrap().is_some())
            .unwrap();
        assert!(first <= whole.data_start as usize, "{first}");
        for n in first..=TYPES.len() {
            assert_eq!(
                Gguf::parse_prefix(&TYPES[..n], file_len).unwrap().as_ref(),
                Some(&whole)
            );
        }
        for n in [0, 3, first - 1] {
            assert_eq!(Gguf::parse_prefix(&TYPES[..n], file_len), Ok(None), "{n} bytes");
        }
        let mut bad = TYPES.to_vec();
        bad[0] = b'X';
        assert!(Gguf::parse_prefix(&bad[..100], file_len).is_err());
        // The whole file is not a prefix: a header it cuts short is refused.
        assert!(Gguf::parse_prefix(&TYPES[..first - 1], first as u64 - 1).is_err());
    }

    #[test]
    fn lying_headers_are_refused_in_one_line() {
        let bad = |edit: &dyn Fn(&mut Vec<u8>)| {
            let mut b = TYPES.to_vec();
            edit(&mut b);
            Gguf::parse(&b, b.len() as u64).unwrap_err().0
        };
        assert!(bad(&|b| b[0] = b'X').contains("not a GGUF file"));
        assert!(bad(&|b| b[4] = 1).contains("version 1"));
        // The tensor count: far more than the header holds.
        assert!(bad(&|b| b[8..16].copy_from_slice(&u64::MAX.to_le_bytes())).contains("tensor count"));
        // The first tensor's type (after its name, 1 dimension count and 2 dimensions).
        let g = Gguf::parse(TYPES, TYPES.len() as u64).unwrap();
        let name_at = TYPES.windows(5).position(|w| w == b"t.f32").unwrap();
        let type_at = name_at + 5 + 4 + 16;
        assert!(bad(&|b| b[type_at..type_at + 4].copy_from_slice(&11u32.to_le_bytes())).contains("Q3_K"));
        // Its offset past the end, then misaligned.
        let far = TYPES.len() as u64;
        assert!(bad(&|b| b[type_at + 4..type_at + 12].copy_from_slice(&(far * 32).to_le_bytes())).contains("past"));
        assert!(bad(&|b| b[type_at + 4..type_at + 12].copy_from_slice(&3u64.to_le_bytes())).contains("multiple"));
        // Onto the second tensor.
        let second = g.tensors[1].start - g.data_start;
        assert!(bad(&|b| b[type_at + 4..type_at + 12].copy_from_slice(&second.to_le_bytes())).contains("overlap"));
    }
}
