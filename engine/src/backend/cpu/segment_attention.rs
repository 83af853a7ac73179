//! The vision tower's attention on the CPU: bidirectional within each segment (an image, or one
//! of Qwen2.5-VL's windows), fused per block of query rows and head. A task computes its rows'
//! scores against the segment's keys into a buffer its thread reuses for all its tasks, the
//! softmax's exponentials, and the weighted values. Nothing larger than one block's scores exists, so the memory is
//! threads × rows × segment length however large the image, and q, k and v are read where they are
//! (strided views, no transposed copies).

use super::isa::fastest;
use super::vector_math::exp_shifted_by_max;
use crate::memory::ledger::{Category, MemoryLedger};
use std::sync::Mutex;

/// Query rows per task: the product packs the segment's keys and values once per task, so larger
/// blocks amortise it (Qwen3-VL-2B's 3,072-patch image on the 2-core EPYC: 64 rows 35.3, 256 rows
/// 42.2, 512 rows 42–45 prefill tokens/s).
const ROWS_PER_TASK: usize = 512;

/// Rows of f32 with column stride 1: row `i` starts at `offset + i · row_stride`.
#[derive(Debug, Clone, Copy)]
pub(super) struct RowsView<'a> {
    pub data: &'a [f32],
    pub offset: usize,
    pub row_stride: usize,
}

impl RowsView<'_> {
    /// The values from row `row`, column `col` to the end of the data.
    fn from(&self, row: usize, col: usize) -> &[f32] {
        &self.data[self.offset + row * self.row_stride + col..]
    }
}

/// A matrix operand of [`matmul`]: element (i, j) at `data[i · rows + j · cols]`.
#[derive(Clone, Copy)]
pub(super) struct Operand<'a> {
    pub data: &'a [f32],
    pub rows: usize,
    pub cols: usize,
}

/// `dst = scale · a · b` (or `dst += scale · a · b` with `accumulate`) for `a` m × k and `b`
/// k × n; `dst`'s rows `dst_stride` apart. One thread (the callers run on candle's pool already).
#[allow(unsafe_code)]
pub(super) fn matmul(
    [m, n, k]: [usize; 3],
    dst: &mut [f32],
    dst_stride: usize,
    (a, b): (Operand<'_>, Operand<'_>),
    scale: f32,
    accumulate: bool,
) {
    if m == 0 || n == 0 {
        return;
    }
    let last = |o: Operand<'_>, r: usize, c: usize| (r - 1) * o.rows + (c - 1) * o.cols;
    assert!((m - 1) * dst_stride + n <= dst.len(), "matmul: destination too short");
    if k == 0 {
        if !accumulate {
            (0..m).for_each(|i| dst[i * dst_stride..][..n].fill(0.0));
        }
        return;
    }
    assert!(
        last(a, m, k) < a.data.len() && last(b, k, n) < b.data.len(),
        "matmul: operand too short"
    );
    // SAFETY: every element the product reads or writes lies inside the slices (checked above),
    // `dst` is borrowed mutably and the operands are shared borrows, so none overlaps it.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            dst_stride as isize,
            accumulate,
            a.data.as_ptr(),
            a.cols as isize,
            a.rows as isize,
            b.data.as_ptr(),
            b.cols as isize,
            b.rows as isize,
            if accumulate { 1.0 } else { 0.0 },
            scale,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}

/// One task: rows `first..first + len` of the segment starting at `start`, `seg_len` rows long.
#[derive(Clone, Copy)]
struct Block {
    start: usize,
    seg_len: usize,
    first: usize,
    len: usize,
}

/// What every task reads.
struct Inputs<'a> {
    q: RowsView<'a>,
    k: RowsView<'a>,
    v: RowsView<'a>,
    d: usize,
    scale: f32,
}

impl Inputs<'_> {
    /// Head `h` of the block's rows, `[len, d]`; `scores` a buffer the task reuses.
    #[inline(always)]
    fn run(&self, b: Block, h: usize, scores: &mut Vec<f32>) -> Vec<f32> {
        let (d, n) = (self.d, b.seg_len);
        scores.resize(b.len * n, 0.0);
        let q = Operand {
            data: self.q.from(b.first, h * d),
            rows: self.q.row_stride,
            cols: 1,
        };
        // Keys transposed by their strides: element (j, pos) is key `pos`'s column j.
        let kt = Operand {
            data: self.k.from(b.start, h * d),
            rows: 1,
            cols: self.k.row_stride,
        };
        matmul([b.len, n, d], scores, n, (q, kt), self.scale, false);
        // A loop, not an iterator adapter: a closure would be compiled without `run_avx2`'s features.
        let mut sums = Vec::with_capacity(b.len);
        for row in scores.chunks_exact_mut(n) {
            sums.push(exp_shifted_by_max(row).1);
        }
        let p = Operand {
            data: scores,
            rows: n,
            cols: 1,
        };
        let v = Operand {
            data: self.v.from(b.start, h * d),
            rows: self.v.row_stride,
            cols: 1,
        };
        let mut out = vec![0f32; b.len * d];
        matmul([b.len, d, n], &mut out, d, (p, v), 1.0, false);
        for (row, sum) in out.chunks_exact_mut(d).zip(sums) {
            let inv = 1.0 / sum;
            row.iter_mut().for_each(|x| *x *= inv);
        }
        out
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    fn run_avx2(&self, b: Block, h: usize, scores: &mut Vec<f32>) -> Vec<f32> {
        self.run(b, h, scores)
    }

    /// [`Inputs::run`] compiled for the widest instructions this CPU has.
    fn run_fastest(&self, b: Block, h: usize, scores: &mut Vec<f32>) -> Vec<f32> {
        fastest!(avx2_fma => self.run_avx2(b, h, scores), _ => self.run(b, h, scores))
    }
}

/// Attention of `n` rows (`q, k, v`: `[n, heads · d]` views) within `segments`, which must cover
/// the rows in order: `[n, heads · d]`. Records the tasks' score buffers in `ledger` while they live.
#[allow(clippy::too_many_arguments)]
pub(super) fn segment_attention(
    q: RowsView<'_>,
    k: RowsView<'_>,
    v: RowsView<'_>,
    n: usize,
    heads: usize,
    d: usize,
    segments: &[(usize, usize)],
    ledger: &MemoryLedger,
) -> Result<Vec<f32>, String> {
    let mut next = 0;
    let mut blocks = Vec::new();
    for &(start, seg_len) in segments {
        if start != next {
            return Err(format!(
                "segments must cover the {n} rows in order; one starts at {start}, not {next}"
            ));
        }
        next = match start.checked_add(seg_len) {
            Some(end) if end <= n => end,
            _ => {
                return Err(format!(
                    "a segment of {seg_len} rows from row {start} runs past the {n} rows"
                ))
            }
        };
        for first in (start..next).step_by(ROWS_PER_TASK) {
            let len = ROWS_PER_TASK.min(next - first);
            blocks.push(Block {
                start,
                seg_len,
                first,
                len,
            });
        }
    }
    if next != n {
        return Err(format!("segments cover {next} rows of {n}"));
    }
    let cols = heads * d;
    if cols == 0 {
        return Ok(Vec::new());
    }
    for (name, view) in [("q", &q), ("k", &k), ("v", &v)] {
        if n > 0 && (view.row_stride < cols || view.offset + (n - 1) * view.row_stride + cols > view.data.len()) {
            return Err(format!("{name} does not hold {n} rows of {cols} columns"));
        }
    }
    let longest = segments.iter().map(|s| s.1).max().unwrap_or(0);
    let tasks = blocks.len() * heads;
    let pool = candle_core::utils::barrier_pool();
    let threads = (pool.n_workers() + 1).min(tasks).max(1);
    let block_rows = ROWS_PER_TASK.min(longest);
    // Each thread's scores, the tasks' outputs and the result they are laid into (returned to
    // the caller, which records it as the output).
    let _held = ledger.hold(
        Category::Activations,
        ((threads * block_rows * longest + n * cols) * 4) as u64,
    );
    let inputs = Inputs {
        q,
        k,
        v,
        d,
        scale: 1.0 / (d as f32).sqrt(),
    };
    let parts: Vec<Mutex<Vec<f32>>> = (0..tasks).map(|_| Mutex::new(Vec::new())).collect();
    pool.execute_chunked(tasks, |range| {
        let mut scores = Vec::with_capacity(block_rows * longest);
        for t in range {
            let part = inputs.run_fastest(blocks[t / heads], t % heads, &mut scores);
            *parts[t].lock().unwrap_or_else(|e| e.into_inner()) = part;
        }
    });
    let mut out = vec![0f32; n * cols];
    for (t, part) in parts.into_iter().enumerate() {
        let (b, h) = (blocks[t / heads], t % heads);
        let part = part.into_inner().unwrap_or_else(|e| e.into_inner());
        for (i, row) in part.chunks_exact(d).enumerate() {
            out[(b.first + i) * cols + h * d..][..d].copy_from_slice(row);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Three heads read from a strided, offset buffer (as column slices of a fused qkv are),
    /// segments longer than a task's rows and shorter, against softmax attention in f64.
    #[test]
    fn matches_direct_attention_per_segment_and_head() {
        let (heads, d) = (3, 4);
        let cols = heads * d;
        let segments = [
            (0, ROWS_PER_TASK + 37),
            (ROWS_PER_TASK + 37, 5),
            (ROWS_PER_TASK + 42, 1),
        ];
        let n = ROWS_PER_TASK + 43;
        // q, k and v side by side in rows of 3 · cols + 2 values, after 7 leading values.
        let stride = 3 * cols + 2;
        let data: Vec<f32> = (0..7 + n * stride)
            .map(|i| (i * 7919 % 1000) as f32 / 250.0 - 2.0)
            .collect();
        let view = |part: usize| RowsView {
            data: &data,
            offset: 7 + part * cols,
            row_stride: stride,
        };
        let at = |part: usize, row: usize, col: usize| data[7 + row * stride + part * cols + col] as f64;
        let ledger = MemoryLedger::new();
        let out = segment_attention(view(0), view(1), view(2), n, heads, d, &segments, &ledger).unwrap();
        assert_eq!(ledger.total(), 0);
        for &(start, len) in &segments {
            for i in (start..start + len).step_by(13).chain([start + len - 1]) {
                for h in 0..heads {
                    let s: Vec<f64> = (start..start + len)
                        .map(|j| {
                            (0..d).map(|c| at(0, i, h * d + c) * at(1, j, h * d + c)).sum::<f64>() / (d as f64).sqrt()
                        })
                        .collect();
                    let m = s.iter().cloned().fold(f64::MIN, f64::max);
                    let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
                    for c in 0..d {
                        let want: f64 = s
                            .iter()
                            .enumerate()
                            .map(|(j, x)| (x - m).exp() / z * at(2, start + j, h * d + c))
                            .sum();
                        let got = out[i * cols + h * d + c] as f64;
                        assert!((got - want).abs() < 1e-5, "row {i} head {h} col {c}: {got} vs {want}");
                    }
                }
            }
        }
    }

    #[test]
    fn segments_must_cover_the_rows_in_order() {
        let data = vec![0f32; 40];
        let v = RowsView {
            data: &data,
            offset: 0,
            row_stride: 4,
        };
        let ledger = MemoryLedger::new();
        let run = |segs: &[(usize, usize)]| segment_attention(v, v, v, 10, 2, 2, segs, &ledger);
        assert!(run(&[(0, 10)]).is_ok());
        assert_eq!(
            segment_attention(v, v, v, 10, 2, 0, &[(0, 10)], &ledger),
            Ok(Vec::new())
        );
        assert!(run(&[(0, 4), (5, 5)]).unwrap_err().contains("starts at 5"));
        assert!(run(&[(0, 9)]).unwrap_err().contains("cover 9 rows of 10"));
        assert!(run(&[(0, 4), (4, usize::MAX)])
            .unwrap_err()
            .contains("runs past the 10 rows"));
        let short = RowsView { data: &data[..39], ..v };
        assert!(segment_attention(short, v, v, 10, 2, 2, &[(0, 10)], &ledger)
            .unwrap_err()
            .contains("q does not hold"));
    }
}
