//! What the CUDA backend computes on the host before a launch: the kernels' names and NVRTC
//! options, launch geometry, and the per-row metadata of the attention kernels. Nothing here
//! touches a GPU, so it is tested on any machine.

use crate::backend::{Activation, BResult, BackendError, PagedBatch};

/// The CUDA C source of every kernel (compiled by NVRTC when the backend starts).
pub const SOURCE: &str = include_str!("kernels.cu");

/// Every `extern "C" __global__` function of [`SOURCE`], loaded once per process.
pub const KERNELS: [&str; 18] = [
    "to_bf16",
    "bf16_to_f32s",
    "add_bias",
    "embedding_f32",
    "embedding_bf16",
    "rms_norm",
    "layer_norm",
    "activate",
    "silu_mul",
    "add",
    "rope",
    "narrow_cols",
    "gather_rows",
    "scatter_rows",
    "write_kv",
    "segment_attention",
    "paged_attention",
    "greedy",
];

/// Threads per block of the element-wise kernels.
pub const ELEMENTWISE_THREADS: u32 = 256;
/// Threads per block of the row kernels (norms, sampling): at most 1024 (the kernels' shared arrays).
pub const ROW_THREADS: u32 = 256;
/// Warps per attention block (`ATTN_WARPS` in the source).
pub const ATTENTION_WARPS: u32 = 4;
/// The widest attention head the kernels hold in registers (`32 × MAX_LANE_DIMS`).
pub const MAX_HEAD_DIM: usize = 256;

/// A launch's grid and block sizes (what `cudarc::driver::LaunchConfig` takes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    /// Blocks in x, y, z.
    pub grid: (u32, u32, u32),
    /// Threads per block in x, y, z.
    pub block: (u32, u32, u32),
}

fn count(n: usize, what: &str) -> BResult<u32> {
    u32::try_from(n).map_err(|_| BackendError::Shape(format!("{what}: {n} is more than a launch can index")))
}

/// One thread per element of `n`.
pub fn elementwise(n: usize) -> BResult<Geometry> {
    let n = count(n, "elements")?;
    Ok(Geometry {
        grid: (n.div_ceil(ELEMENTWISE_THREADS).max(1), 1, 1),
        block: (ELEMENTWISE_THREADS, 1, 1),
    })
}

/// One block per row.
pub fn per_row(rows: usize) -> BResult<Geometry> {
    Ok(Geometry {
        grid: (count(rows, "rows")?.max(1), 1, 1),
        block: (ROW_THREADS, 1, 1),
    })
}

/// One block of [`ATTENTION_WARPS`] warps per query row and head.
pub fn attention(rows: usize, heads: usize, head_dim: usize) -> BResult<Geometry> {
    if head_dim == 0 || head_dim > MAX_HEAD_DIM {
        return Err(BackendError::Shape(format!(
            "attention heads of {head_dim} values: the CUDA kernels take 1 to {MAX_HEAD_DIM}"
        )));
    }
    if heads > 65_535 {
        return Err(BackendError::Shape(format!("{heads} attention heads: at most 65535")));
    }
    Ok(Geometry {
        grid: (count(rows, "rows")?.max(1), heads as u32, 1),
        block: (32 * ATTENTION_WARPS, 1, 1),
    })
}

/// The `activate` kernel's number for an activation.
pub fn activation_kind(act: Activation) -> u32 {
    match act {
        Activation::Silu => 0,
        Activation::GeluTanh => 1,
        Activation::GeluErf => 2,
        Activation::QuickGelu => 3,
    }
}

/// NVRTC's options for a device of compute capability `major.minor`: virtual architecture of the
/// device (the driver finishes the PTX for it), precise division and square root as the CPU.
pub fn compile_options(major: i32, minor: i32) -> Vec<String> {
    vec![
        format!("--gpu-architecture=compute_{major}{minor}"),
        "--prec-div=true".into(),
        "--prec-sqrt=true".into(),
        "--fmad=false".into(),
        "--std=c++17".into(),
    ]
}

/// The vision tower's segments as the kernel reads them: `(start, len)` of each row's segment.
pub fn segment_rows(segments: &[(usize, usize)]) -> BResult<Vec<u32>> {
    let mut rows = Vec::new();
    let mut next = 0;
    for &(start, len) in segments {
        if start != next {
            return Err(BackendError::Shape(format!(
                "segments must cover the rows in order: one starts at {start}, expected {next}"
            )));
        }
        next += len;
        for _ in 0..len {
            rows.push(count(start, "segment start")?);
            rows.push(count(len, "segment length")?);
        }
    }
    Ok(rows)
}

/// A step's paged-attention metadata as the kernels read it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PagedRows {
    /// KV slot of each query row.
    pub slots: Vec<u32>,
    /// Per query row: the number of keys it sees (its position + 1), and the offset of its
    /// sequence's block table in [`Self::tables`].
    pub meta: Vec<u32>,
    /// Every sequence's block table, one after another.
    pub tables: Vec<u32>,
    /// Query rows.
    pub rows: usize,
}

/// Checks `batch` as the CPU backend does, and every slot and block against a cache of
/// `num_blocks` blocks of `block_size` (a kernel would write or read outside it), and flattens it.
pub fn paged_rows(batch: &PagedBatch, block_size: usize, num_blocks: usize) -> BResult<PagedRows> {
    let capacity = num_blocks * block_size;
    if let Some(bad) = batch.slots.iter().find(|&&s| s >= capacity) {
        return Err(BackendError::Shape(format!(
            "KV slot {bad} outside the cache's {capacity}"
        )));
    }
    if let Some(bad) = batch
        .seqs
        .iter()
        .flat_map(|s| &s.block_table)
        .find(|&&b| b >= num_blocks)
    {
        return Err(BackendError::Shape(format!(
            "block {bad} outside the cache's {num_blocks}"
        )));
    }
    let mut out = PagedRows {
        slots: batch.slots.iter().map(|&s| count(s, "slot")).collect::<BResult<_>>()?,
        meta: Vec::new(),
        tables: Vec::new(),
        rows: 0,
    };
    for s in &batch.seqs {
        if s.query_start != out.rows {
            return Err(BackendError::Shape(
                "paged_attention: sequences must cover the query rows in order".into(),
            ));
        }
        if s.query_len > s.context_len || s.context_len.div_ceil(block_size.max(1)) > s.block_table.len() {
            return Err(BackendError::Shape(
                "paged_attention: sequence outside its block table".into(),
            ));
        }
        let offset = count(out.tables.len(), "block tables")?;
        out.tables.extend(
            s.block_table
                .iter()
                .map(|&b| count(b, "block"))
                .collect::<BResult<Vec<_>>>()?,
        );
        for i in 0..s.query_len {
            out.meta.push(count(s.context_len - s.query_len + i + 1, "context")?);
            out.meta.push(offset);
        }
        out.rows += s.query_len;
    }
    if out.slots.len() != out.rows {
        return Err(BackendError::Shape(format!(
            "{} KV slots for {} query rows",
            out.slots.len(),
            out.rows
        )));
    }
    // The kernels index an empty table array with nothing; keep one element so it can be uploaded.
    if out.tables.is_empty() {
        out.tables.push(0);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::PagedSeq;

    #[test]
    fn every_kernel_in_the_source_is_listed_and_every_listed_one_exists() {
        let declared: std::collections::BTreeSet<&str> = SOURCE
            .split("extern \"C\" __global__ void ")
            .skip(1)
            .map(|rest| rest.split('(').next().unwrap().trim())
            .collect();
        let listed: std::collections::BTreeSet<&str> = KERNELS.iter().copied().collect();
        assert_eq!(declared, listed);
        assert!(
            !SOURCE.contains("#include"),
            "NVRTC here has no CUDA headers to include"
        );
    }

    #[test]
    fn geometry_covers_every_element_and_refuses_what_cannot_launch() {
        let g = elementwise(1000).unwrap();
        assert_eq!(g.grid.0 * g.block.0, 1024);
        assert_eq!(elementwise(0).unwrap().grid.0, 1, "an empty launch still has one block");
        assert!(elementwise(1 << 33).is_err());
        let a = attention(7, 16, 128).unwrap();
        assert_eq!((a.grid, a.block), ((7, 16, 1), (128, 1, 1)));
        assert!(attention(1, 16, 512).is_err());
        assert!(attention(1, 16, 0).is_err());
        assert_eq!(per_row(3).unwrap().grid.0, 3);
    }

    #[test]
    fn compile_options_name_the_device_architecture() {
        let o = compile_options(9, 0);
        assert_eq!(o[0], "--gpu-architecture=compute_90");
        assert!(o.contains(&"--fmad=false".to_string()));
    }

    #[test]
    fn segments_give_each_row_its_segment() {
        assert_eq!(segment_rows(&[(0, 2), (2, 1)]).unwrap(), [0, 2, 0, 2, 2, 1]);
        assert!(segment_rows(&[(1, 2)]).is_err());
    }

    #[test]
    fn paged_rows_give_each_query_its_context_and_table() {
        let batch = PagedBatch {
            slots: vec![12, 13, 5],
            seqs: vec![
                PagedSeq {
                    query_start: 0,
                    query_len: 2,
                    context_len: 6,
                    block_table: vec![2, 3],
                },
                PagedSeq {
                    query_start: 2,
                    query_len: 1,
                    context_len: 2,
                    block_table: vec![1],
                },
            ],
        };
        let p = paged_rows(&batch, 4, 4).unwrap();
        assert_eq!(p.rows, 3);
        assert_eq!(p.slots, [12, 13, 5]);
        assert_eq!(p.tables, [2, 3, 1]);
        // Rows 0 and 1 are positions 4 and 5 of a context of 6; row 2 is position 1.
        assert_eq!(p.meta, [5, 0, 6, 0, 2, 2]);
        let mut bad = batch.clone();
        bad.seqs[1].context_len = 5;
        assert!(paged_rows(&bad, 4, 4).is_err(), "5 tokens need 2 blocks of 4");
        bad = batch.clone();
        bad.seqs[1].query_start = 3;
        assert!(paged_rows(&bad, 4, 4).is_err());
        assert!(
            paged_rows(&batch, 4, 3).is_err(),
            "block 3 and slots 12, 13 are outside 3 blocks"
        );
        bad = batch;
        bad.slots.pop();
        assert!(paged_rows(&bad, 4, 4).is_err(), "every query row needs its slot");
    }
}
