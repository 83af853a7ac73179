//! Writing GGUF files (version 3, little-endian, 32-byte alignment) as gguf-py's `GGUFWriter`
//! lays them out: header, metadata in the order given, the tensor table, then each tensor's bytes
//! at its aligned offset. [`super::gguf::Gguf::parse`] reads them back.

use super::ggml::GgmlType;
use super::gguf::MetaValue;
use std::io::Write;

/// Tensor data alignment (gguf-py's and llama.cpp's default).
const ALIGNMENT: usize = 32;

/// A GGUF file being assembled in memory.
#[derive(Debug, Default)]
pub struct GgufWriter {
    metadata: Vec<(String, MetaValue)>,
    tensors: Vec<(String, Vec<u64>, GgmlType, Vec<u8>)>,
}

impl GgufWriter {
    /// Adds a metadata entry.
    pub fn meta(&mut self, key: &str, value: MetaValue) {
        self.metadata.push((key.to_string(), value));
    }

    /// Adds a tensor of `shape` (outermost first, as transformers writes it) whose `data` is
    /// already stored as `ggml_type`.
    pub fn tensor(&mut self, name: &str, shape: &[usize], ggml_type: GgmlType, data: Vec<u8>) {
        let ne = shape.iter().rev().map(|&d| d as u64).collect();
        self.tensors.push((name.to_string(), ne, ggml_type, data));
    }

    /// Writes the file.
    pub fn write(&self, out: &mut impl Write) -> std::io::Result<()> {
        let mut head = Vec::new();
        head.extend(b"GGUF");
        head.extend(3u32.to_le_bytes());
        head.extend((self.tensors.len() as u64).to_le_bytes());
        head.extend((self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            string(&mut head, key);
            head.extend(type_id(value).to_le_bytes());
            encode(&mut head, value);
        }
        let mut offset = 0usize;
        for (name, ne, ggml_type, data) in &self.tensors {
            string(&mut head, name);
            head.extend((ne.len() as u32).to_le_bytes());
            ne.iter().for_each(|d| head.extend(d.to_le_bytes()));
            head.extend(ggml_type.id().to_le_bytes());
            head.extend((offset as u64).to_le_bytes());
            offset += data.len().div_ceil(ALIGNMENT) * ALIGNMENT;
        }
        head.resize(head.len().div_ceil(ALIGNMENT) * ALIGNMENT, 0);
        out.write_all(&head)?;
        for (_, _, _, data) in &self.tensors {
            out.write_all(data)?;
            out.write_all(&[0; ALIGNMENT][..data.len().div_ceil(ALIGNMENT) * ALIGNMENT - data.len()])?;
        }
        Ok(())
    }
}

fn string(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

/// GGUF's id of a value's type.
fn type_id(v: &MetaValue) -> u32 {
    match v {
        MetaValue::U8(_) => 0,
        MetaValue::I8(_) => 1,
        MetaValue::U16(_) => 2,
        MetaValue::I16(_) => 3,
        MetaValue::U32(_) => 4,
        MetaValue::I32(_) => 5,
        MetaValue::F32(_) => 6,
        MetaValue::Bool(_) => 7,
        MetaValue::String(_) => 8,
        MetaValue::Array(_) => 9,
        MetaValue::U64(_) => 10,
        MetaValue::I64(_) => 11,
        MetaValue::F64(_) => 12,
    }
}

/// A value's bytes (an array's element type is its first element's; an empty one is of u8).
fn encode(out: &mut Vec<u8>, v: &MetaValue) {
    match v {
        MetaValue::U8(x) => out.push(*x),
        MetaValue::I8(x) => out.push(*x as u8),
        MetaValue::U16(x) => out.extend(x.to_le_bytes()),
        MetaValue::I16(x) => out.extend(x.to_le_bytes()),
        MetaValue::U32(x) => out.extend(x.to_le_bytes()),
        MetaValue::I32(x) => out.extend(x.to_le_bytes()),
        MetaValue::F32(x) => out.extend(x.to_le_bytes()),
        MetaValue::Bool(x) => out.push(*x as u8),
        MetaValue::String(s) => string(out, s),
        MetaValue::Array(items) => {
            out.extend(items.first().map_or(0, type_id).to_le_bytes());
            out.extend((items.len() as u64).to_le_bytes());
            items.iter().for_each(|item| encode(out, item));
        }
        MetaValue::U64(x) => out.extend(x.to_le_bytes()),
        MetaValue::I64(x) => out.extend(x.to_le_bytes()),
        MetaValue::F64(x) => out.extend(x.to_le_bytes()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::gguf::Gguf;

    #[test]
    fn what_is_written_reads_back() {
        let mut w = GgufWriter::default();
        w.meta("general.architecture", MetaValue::String("qwen2vl".into()));
        w.meta(
            "a.sections",
            MetaValue::Array(vec![MetaValue::I32(2), MetaValue::I32(-1)]),
        );
        w.meta("a.eps", MetaValue::F32(1e-6));
        let values: Vec<f32> = (0..64).map(|i| i as f32 / 7.0 - 3.0).collect();
        w.tensor("q", &[2, 32], GgmlType::Q8_0, GgmlType::Q8_0.quantize(&values).unwrap());
        w.tensor("f", &[3], GgmlType::F32, GgmlType::F32.quantize(&values[..3]).unwrap());
        let mut bytes = Vec::new();
        w.write(&mut bytes).unwrap();
        let g = Gguf::parse(&bytes, bytes.len() as u64).unwrap();
        assert_eq!(g.get("general.architecture").unwrap().as_str(), Some("qwen2vl"));
        assert_eq!(
            g.get("a.sections"),
            Some(&MetaValue::Array(vec![MetaValue::I32(2), MetaValue::I32(-1)]))
        );
        assert_eq!(g.get("a.eps"), Some(&MetaValue::F32(1e-6)));
        let q = g.tensor("q").unwrap();
        assert_eq!((q.shape(), q.ggml_type, q.start % 32), (vec![2, 32], GgmlType::Q8_0, 0));
        let mut back = vec![0f32; 64];
        GgmlType::Q8_0.dequantize(&bytes[q.start as usize..][..q.bytes as usize], &mut back);
        // q8_0 rounds each value to within half a step: max |v| / 127 / 2 per block (6 / 254).
        assert!(
            back.iter().zip(&values).all(|(a, b)| (a - b).abs() <= 6.0 / 254.0),
            "{back:?}"
        );
        let f = g.tensor("f").unwrap();
        assert_eq!(
            &bytes[f.start as usize..][..12],
            &GgmlType::F32.quantize(&values[..3]).unwrap()[..]
        );
    }

    /// A tensor with a dimension of 0 is refused: nothing downstream sizes anything by it.
    #[test]
    fn a_tensor_with_a_zero_dimension_is_refused() {
        let mut w = GgufWriter::default();
        w.tensor("empty", &[0, 32], GgmlType::F32, Vec::new());
        let mut bytes = Vec::new();
        w.write(&mut bytes).unwrap();
        let err = Gguf::parse(&bytes, bytes.len() as u64).unwrap_err().to_string();
        assert!(err.contains("tensor empty has a dimension of 0"), "{err}");
    }
}
