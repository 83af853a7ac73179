//! The CPU backend: candle-core tensors in f32 for dense math, a paged KV cache in host memory with
//! attention written out over the block tables.

mod attention;

use super::{Activation, BResult, Backend, BackendError, KvLayout, PagedSeq, RawDType, RawTensor};
use crate::memory::ledger::{Category, Held, MemoryLedger};
use attention::SeqAttention;
use candle_core::{DType, Device, Tensor, D};
use std::sync::Arc;

fn lib(e: candle_core::Error) -> BackendError {
    BackendError::Library(e.to_string())
}

/// A CPU tensor: an f32 candle tensor plus the ledger entry of the storage it owns.
#[derive(Debug, Clone)]
pub struct CpuTensor {
    t: Tensor,
    _held: Option<Arc<Held>>,
}

/// The paged KV cache: per layer, keys and values as `[num_blocks · block_size, kv_heads · head_dim]`.
#[derive(Debug)]
pub struct CpuKvCache {
    layout: KvLayout,
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
    _held: Held,
}

/// The CPU backend.
#[derive(Debug, Clone, Default)]
pub struct CpuBackend {
    ledger: MemoryLedger,
}

impl CpuBackend {
    /// A CPU backend recording into `ledger`.
    pub fn new(ledger: MemoryLedger) -> Self {
        CpuBackend { ledger }
    }

    fn wrap(&self, t: Tensor, category: Category) -> CpuTensor {
        let bytes = (t.elem_count() * 4) as u64;
        CpuTensor {
            t,
            _held: Some(Arc::new(self.ledger.hold(category, bytes))),
        }
    }

    fn act(&self, t: candle_core::Result<Tensor>) -> BResult<CpuTensor> {
        Ok(self.wrap(t.map_err(lib)?, Category::Activations))
    }

    /// A view sharing its parent's storage (no new ledger entry).
    fn view(parent: &CpuTensor, t: candle_core::Result<Tensor>) -> BResult<CpuTensor> {
        Ok(CpuTensor {
            t: t.map_err(lib)?,
            _held: parent._held.clone(),
        })
    }
}

/// Query rows per block of the vision tower's attention.
const ATTENTION_CHUNK: usize = 512;

fn softmax_last(x: &Tensor) -> candle_core::Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?;
    let e = x.broadcast_sub(&max)?.exp()?;
    let sum = e.sum_keepdim(D::Minus1)?;
    e.broadcast_div(&sum)
}

fn rotate_half(x: &Tensor) -> candle_core::Result<Tensor> {
    let d = x.dim(D::Minus1)?;
    let a = x.narrow(D::Minus1, 0, d / 2)?;
    let b = x.narrow(D::Minus1, d / 2, d / 2)?;
    Tensor::cat(&[&b.neg()?, &a], D::Minus1)
}

fn dims2(t: &Tensor) -> BResult<(usize, usize)> {
    t.dims2().map_err(lib)
}

impl Backend for CpuBackend {
    type Tensor = CpuTensor;
    type KvCache = CpuKvCache;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn ledger(&self) -> &MemoryLedger {
        &self.ledger
    }

    fn load_weight(&self, raw: RawTensor<'_>) -> BResult<CpuTensor> {
        let dtype = match raw.dtype {
            RawDType::F32 => DType::F32,
            RawDType::F16 => DType::F16,
            RawDType::Bf16 => DType::BF16,
        };
        let t = Tensor::from_raw_buffer(raw.data, dtype, &raw.shape, &Device::Cpu).map_err(lib)?;
        let t = t.to_dtype(DType::F32).map_err(lib)?;
        Ok(self.wrap(t, Category::Weights))
    }

    fn upload(&self, data: Vec<f32>, shape: &[usize]) -> BResult<CpuTensor> {
        self.act(Tensor::from_vec(data, shape, &Device::Cpu))
    }

    fn keep(&self, t: &CpuTensor, category: Category) -> CpuTensor {
        self.wrap(t.t.clone(), category)
    }

    fn download(&self, t: &CpuTensor) -> BResult<Vec<f32>> {
        t.t.flatten_all().and_then(|f| f.to_vec1::<f32>()).map_err(lib)
    }

    fn shape(&self, t: &CpuTensor) -> Vec<usize> {
        t.t.dims().to_vec()
    }

    fn linear(&self, x: &CpuTensor, w: &CpuTensor, b: Option<&CpuTensor>) -> BResult<CpuTensor> {
        let y = x.t.matmul(&w.t.t().map_err(lib)?).map_err(lib)?;
        self.act(match b {
            Some(b) => y.broadcast_add(&b.t),
            None => Ok(y),
        })
    }

    fn embedding(&self, table: &CpuTensor, ids: &[u32]) -> BResult<CpuTensor> {
        let vocab = table.t.dim(0).map_err(lib)?;
        if let Some(bad) = ids.iter().find(|&&i| i as usize >= vocab) {
            return Err(BackendError::Shape(format!(
                "token id {bad} is outside the vocabulary of {vocab}"
            )));
        }
        let idx = Tensor::new(ids, &Device::Cpu).map_err(lib)?;
        self.act(table.t.index_select(&idx, 0))
    }

    fn rms_norm(&self, x: &CpuTensor, w: &CpuTensor, eps: f64) -> BResult<CpuTensor> {
        let f = || -> candle_core::Result<Tensor> {
            let ms = x.t.sqr()?.mean_keepdim(D::Minus1)?;
            let inv = (ms + eps)?.sqrt()?.recip()?;
            x.t.broadcast_mul(&inv)?.broadcast_mul(&w.t)
        };
        self.act(f())
    }

    fn layer_norm(&self, x: &CpuTensor, w: &CpuTensor, b: &CpuTensor, eps: f64) -> BResult<CpuTensor> {
        let f = || -> candle_core::Result<Tensor> {
            let mean = x.t.mean_keepdim(D::Minus1)?;
            let centered = x.t.broadcast_sub(&mean)?;
            let var = centered.sqr()?.mean_keepdim(D::Minus1)?;
            let inv = (var + eps)?.sqrt()?.recip()?;
            centered.broadcast_mul(&inv)?.broadcast_mul(&w.t)?.broadcast_add(&b.t)
        };
        self.act(f())
    }

    fn activate(&self, x: &CpuTensor, act: Activation) -> BResult<CpuTensor> {
        self.act(match act {
            Activation::Silu => x.t.silu(),
            Activation::GeluTanh => x.t.gelu(),
            Activation::GeluErf => x.t.gelu_erf(),
            Activation::QuickGelu => (|| x.t.mul(&((x.t.affine(-1.702, 0.0)?.exp()? + 1.0)?.recip()?)))(),
        })
    }

    fn silu_mul(&self, gate: &CpuTensor, up: &CpuTensor) -> BResult<CpuTensor> {
        self.act(gate.t.silu().and_then(|g| g.mul(&up.t)))
    }

    fn add(&self, a: &CpuTensor, b: &CpuTensor) -> BResult<CpuTensor> {
        self.act(a.t.add(&b.t))
    }

    fn rope(&self, x: &CpuTensor, cos: &CpuTensor, sin: &CpuTensor) -> BResult<CpuTensor> {
        let (n, cols) = dims2(&x.t)?;
        let (_, d) = dims2(&cos.t)?;
        if d == 0 || cols % d != 0 {
            return Err(BackendError::Shape(format!(
                "rope: {cols} columns are not whole heads of {d}"
            )));
        }
        let f = || -> candle_core::Result<Tensor> {
            let x3 = x.t.reshape((n, cols / d, d))?;
            let c = cos.t.unsqueeze(1)?;
            let s = sin.t.unsqueeze(1)?;
            let y = x3.broadcast_mul(&c)?.add(&rotate_half(&x3)?.broadcast_mul(&s)?)?;
            y.reshape((n, cols))
        };
        self.act(f())
    }

    fn narrow_cols(&self, x: &CpuTensor, start: usize, len: usize) -> BResult<CpuTensor> {
        self.act(x.t.narrow(1, start, len).and_then(|t| t.contiguous()))
    }

    fn reshape(&self, x: &CpuTensor, rows: usize, cols: usize) -> BResult<CpuTensor> {
        Self::view(x, x.t.reshape((rows, cols)))
    }

    fn gather_rows(&self, x: &CpuTensor, idx: &[usize]) -> BResult<CpuTensor> {
        let ids: Vec<u32> = idx.iter().map(|&i| i as u32).collect();
        let idx = Tensor::new(ids.as_slice(), &Device::Cpu).map_err(lib)?;
        self.act(x.t.index_select(&idx, 0))
    }

    fn scatter_rows(&self, x: &CpuTensor, idx: &[usize], src: &CpuTensor, add: bool) -> BResult<CpuTensor> {
        let (rows, cols) = dims2(&x.t)?;
        let (srows, scols) = dims2(&src.t)?;
        if scols != cols || srows != idx.len() || idx.iter().any(|&i| i >= rows) {
            return Err(BackendError::Shape(format!(
                "scatter of {srows}×{scols} rows into {rows}×{cols} at {} positions",
                idx.len()
            )));
        }
        let mut data = self.download(x)?;
        let s = self.download(src)?;
        for (i, &r) in idx.iter().enumerate() {
            let dst = &mut data[r * cols..(r + 1) * cols];
            let row = &s[i * cols..(i + 1) * cols];
            if add {
                dst.iter_mut().zip(row).for_each(|(d, v)| *d += v);
            } else {
                dst.copy_from_slice(row);
            }
        }
        self.upload(data, &[rows, cols])
    }

    fn concat_rows(&self, parts: &[CpuTensor]) -> BResult<CpuTensor> {
        let ts: Vec<&Tensor> = parts.iter().map(|p| &p.t).collect();
        self.act(Tensor::cat(&ts, 0))
    }

    fn segment_attention(
        &self,
        q: &CpuTensor,
        k: &CpuTensor,
        v: &CpuTensor,
        heads: usize,
        segments: &[(usize, usize)],
    ) -> BResult<CpuTensor> {
        let (_, cols) = dims2(&q.t)?;
        let d = cols / heads.max(1);
        let scale = 1.0 / (d as f64).sqrt();
        let f = || -> candle_core::Result<Tensor> {
            let mut outs = Vec::with_capacity(segments.len());
            for &(start, len) in segments {
                let split = |t: &Tensor, from: usize, n: usize| {
                    t.narrow(0, from, n)?
                        .reshape((n, heads, d))?
                        .transpose(0, 1)?
                        .contiguous()
                };
                let kt = split(&k.t, start, len)?.t()?.contiguous()?;
                let vs = split(&v.t, start, len)?;
                // Queries in chunks bound the score matrix to heads × chunk × len.
                for from in (start..start + len).step_by(ATTENTION_CHUNK) {
                    let n = ATTENTION_CHUNK.min(start + len - from);
                    let scores = (split(&q.t, from, n)?.matmul(&kt)? * scale)?;
                    let out = softmax_last(&scores)?.matmul(&vs)?;
                    outs.push(out.transpose(0, 1)?.reshape((n, cols))?);
                }
            }
            Tensor::cat(&outs, 0)
        };
        self.act(f())
    }

    fn alloc_kv(&self, layout: KvLayout) -> BResult<CpuKvCache> {
        let per_layer = layout.num_blocks * layout.block_size * layout.kv_heads * layout.head_dim;
        Ok(CpuKvCache {
            layout,
            keys: (0..layout.layers).map(|_| vec![0.0; per_layer]).collect(),
            values: (0..layout.layers).map(|_| vec![0.0; per_layer]).collect(),
            _held: self.ledger.hold(Category::KvCache, layout.bytes(4)),
        })
    }

    fn write_kv(
        &self,
        cache: &mut CpuKvCache,
        layer: usize,
        k: &CpuTensor,
        v: &CpuTensor,
        slots: &[usize],
    ) -> BResult<()> {
        let width = cache.layout.kv_heads * cache.layout.head_dim;
        let capacity = cache.layout.num_blocks * cache.layout.block_size;
        let (kd, vd) = (self.download(k)?, self.download(v)?);
        if kd.len() != slots.len() * width || vd.len() != kd.len() || layer >= cache.layout.layers {
            return Err(BackendError::Shape(format!(
                "write_kv: {} slots for {} values",
                slots.len(),
                kd.len()
            )));
        }
        for (i, &slot) in slots.iter().enumerate() {
            if slot >= capacity {
                return Err(BackendError::Shape(format!("write_kv: slot {slot} outside {capacity}")));
            }
            cache.keys[layer][slot * width..(slot + 1) * width].copy_from_slice(&kd[i * width..(i + 1) * width]);
            cache.values[layer][slot * width..(slot + 1) * width].copy_from_slice(&vd[i * width..(i + 1) * width]);
        }
        Ok(())
    }

    fn paged_attention(
        &self,
        cache: &CpuKvCache,
        layer: usize,
        q: &CpuTensor,
        heads: usize,
        seqs: &[PagedSeq<'_>],
    ) -> BResult<CpuTensor> {
        let KvLayout {
            block_size,
            kv_heads,
            head_dim: d,
            ..
        } = cache.layout;
        let (rows, cols) = dims2(&q.t)?;
        if cols != heads * d || !heads.is_multiple_of(kv_heads.max(1)) || layer >= cache.layout.layers {
            return Err(BackendError::Shape(format!(
                "paged_attention: q {rows}×{cols}, {heads} heads of {d}"
            )));
        }
        let mut next = 0;
        for s in seqs {
            if s.query_start != next {
                return Err(BackendError::Shape(
                    "paged_attention: sequences must cover the query rows in order".into(),
                ));
            }
            next += s.query_len;
        }
        if next != rows {
            return Err(BackendError::Shape(format!(
                "paged_attention: sequences cover {next} of {rows} query rows"
            )));
        }
        let mut outs = Vec::with_capacity(seqs.len());
        for s in seqs {
            if s.query_start + s.query_len > rows
                || s.query_len > s.context_len
                || s.context_len.div_ceil(block_size) > s.block_table.len()
            {
                return Err(BackendError::Shape(
                    "paged_attention: sequence outside its block table".into(),
                ));
            }
            let slot_of = |pos: usize| s.block_table[pos / block_size] * block_size + pos % block_size;
            let seq = SeqAttention {
                q: q.t.narrow(0, s.query_start, s.query_len).map_err(lib)?,
                keys: &cache.keys[layer],
                values: &cache.values[layer],
                slot_of: &slot_of,
                context_len: s.context_len,
                kv_heads,
                head_dim: d,
            };
            outs.push(attention::attend(&seq, &self.ledger, attention::TILES).map_err(lib)?);
        }
        self.act(Tensor::cat(&outs, 0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(b: &CpuBackend, data: &[f32], rows: usize, cols: usize) -> CpuTensor {
        b.upload(data.to_vec(), &[rows, cols]).unwrap()
    }

    #[test]
    fn linear_norms_and_activations() {
        let b = CpuBackend::default();
        let x = t(&b, &[1.0, 2.0, 3.0, 4.0], 2, 2);
        let w = t(&b, &[1.0, 0.0, 1.0, 1.0, 0.0, 2.0], 3, 2);
        let bias = b.upload(vec![0.5, 0.0, -1.0], &[3]).unwrap();
        assert_eq!(
            b.download(&b.linear(&x, &w, Some(&bias)).unwrap()).unwrap(),
            vec![1.5, 3.0, 3.0, 3.5, 7.0, 7.0]
        );
        let ones = b.upload(vec![1.0, 1.0], &[2]).unwrap();
        let rms = b.download(&b.rms_norm(&x, &ones, 0.0).unwrap()).unwrap();
        let r0 = (2.5f32).sqrt();
        assert!((rms[0] - 1.0 / r0).abs() < 1e-6 && (rms[1] - 2.0 / r0).abs() < 1e-6);
        let zeros = b.upload(vec![0.0, 0.0], &[2]).unwrap();
        let ln = b.download(&b.layer_norm(&x, &ones, &zeros, 0.0).unwrap()).unwrap();
        assert!((ln[0] + 1.0).abs() < 1e-6 && (ln[1] - 1.0).abs() < 1e-6);
        let q = b
            .download(&b.activate(&t(&b, &[1.0], 1, 1), Activation::QuickGelu).unwrap())
            .unwrap();
        assert!((q[0] - 1.0 / (1.0 + (-1.702f32).exp())).abs() < 1e-6);
    }

    #[test]
    fn paged_attention_matches_dense_causal_attention() {
        // Two heads sharing one KV head, 5 tokens spread over blocks 3 and 1 of size 4.
        let b = CpuBackend::default();
        let layout = KvLayout {
            layers: 1,
            num_blocks: 5,
            block_size: 4,
            kv_heads: 1,
            head_dim: 2,
        };
        let mut cache = b.alloc_kv(layout).unwrap();
        assert_eq!(b.ledger().bytes(Category::KvCache), layout.bytes(4));
        let n = 5;
        let kv: Vec<f32> = (0..n * 2).map(|i| (i as f32 * 0.37).sin()).collect();
        let vv: Vec<f32> = (0..n * 2).map(|i| (i as f32 * 0.11).cos()).collect();
        let q: Vec<f32> = (0..n * 4).map(|i| (i as f32 * 0.23).sin()).collect();
        let table = [3usize, 1];
        let slots: Vec<usize> = (0..n).map(|p| table[p / 4] * 4 + p % 4).collect();
        b.write_kv(&mut cache, 0, &t(&b, &kv, n, 2), &t(&b, &vv, n, 2), &slots)
            .unwrap();
        let seq = PagedSeq {
            query_start: 0,
            query_len: n,
            context_len: n,
            block_table: &table,
        };
        let paged = b
            .download(&b.paged_attention(&cache, 0, &t(&b, &q, n, 4), 2, &[seq]).unwrap())
            .unwrap();
        for i in 0..n {
            for h in 0..2 {
                let qh = &q[i * 4 + h * 2..i * 4 + h * 2 + 2];
                let s: Vec<f32> = (0..=i)
                    .map(|j| (qh[0] * kv[j * 2] + qh[1] * kv[j * 2 + 1]) / 2f32.sqrt())
                    .collect();
                let m = s.iter().cloned().fold(f32::MIN, f32::max);
                let e: Vec<f32> = s.iter().map(|x| (x - m).exp()).collect();
                let z: f32 = e.iter().sum();
                for c in 0..2 {
                    let want: f32 = (0..=i).map(|j| e[j] / z * vv[j * 2 + c]).sum();
                    assert!((paged[i * 4 + h * 2 + c] - want).abs() < 1e-5);
                }
            }
        }
        let bad = PagedSeq {
            query_start: 0,
            query_len: 5,
            context_len: 9,
            block_table: &table,
        };
        assert!(b.paged_attention(&cache, 0, &t(&b, &q, n, 4), 2, &[bad]).is_err());
    }

    #[test]
    fn chunked_segment_attention_matches_a_direct_softmax() {
        // 700 rows: more than one query chunk in the first segment.
        let b = CpuBackend::default();
        let n = 700;
        let q: Vec<f32> = (0..n * 2).map(|i| (i as f32 * 0.013).sin()).collect();
        let k: Vec<f32> = (0..n * 2).map(|i| (i as f32 * 0.029).cos()).collect();
        let v: Vec<f32> = (0..n * 2).map(|i| (i as f32 * 0.07).sin()).collect();
        let segs = [(0, 650), (650, 50)];
        let out = b
            .download(
                &b.segment_attention(&t(&b, &q, n, 2), &t(&b, &k, n, 2), &t(&b, &v, n, 2), 1, &segs)
                    .unwrap(),
            )
            .unwrap();
        for &(start, len) in &segs {
            for i in (start..start + len).step_by(37) {
                let s: Vec<f32> = (start..start + len)
                    .map(|j| (q[i * 2] * k[j * 2] + q[i * 2 + 1] * k[j * 2 + 1]) / 2f32.sqrt())
                    .collect();
                let m = s.iter().cloned().fold(f32::MIN, f32::max);
                let z: f32 = s.iter().map(|x| (x - m).exp()).sum();
                let want: f32 = s
                    .iter()
                    .enumerate()
                    .map(|(j, x)| (x - m).exp() / z * v[(start + j) * 2])
                    .sum();
                assert!((out[i * 2] - want).abs() < 1e-4, "row {i}: {} vs {want}", out[i * 2]);
            }
        }
    }

    #[test]
    fn rope_rotates_halves_and_segments_stay_apart() {
        let b = CpuBackend::default();
        let x = t(&b, &[1.0, 2.0, 3.0, 4.0], 1, 4);
        let cos = t(&b, &[0.0, 0.0], 1, 2);
        let sin = t(&b, &[1.0, 1.0], 1, 2);
        // Two heads of width 2; rotate_half([a, b]) = [-b, a].
        assert_eq!(
            b.download(&b.rope(&x, &cos, &sin).unwrap()).unwrap(),
            vec![-2.0, 1.0, -4.0, 3.0]
        );
        let q = t(&b, &[1.0, 1.0, 1.0], 3, 1);
        let v = t(&b, &[1.0, 2.0, 10.0], 3, 1);
        let out = b
            .download(&b.segment_attention(&q, &q, &v, 1, &[(0, 2), (2, 1)]).unwrap())
            .unwrap();
        assert_eq!(out, vec![1.5, 1.5, 10.0]);
    }
}
