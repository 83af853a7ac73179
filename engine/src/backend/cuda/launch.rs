//! What the CUDA backend computes on the host before a launch: the kernels' names and NVRTC
//! options, launch geometry, and the per-row metadata of the attention kernels. Nothing here
//! touches a GPU, so it is tested on any machine.

use crate::backend::{Activation, BResult, BackendError};

/// The CUDA C source of every kernel (compiled by NVRTC when the backend starts).
pub const SOURCE: &str = include_str!("kernels.cu");

/// Every `extern "C" __global__` function of [`SOURCE`], loaded once per process.
pub const KERNELS: [&str; 31] = [
    "hold",
    "to_bf16",
    "gemv_bf16",
    "gemv_bf16_glu",
    "bf16_to_f32s",
    "add_bias",
    "embedding_f32",
    "embedding_bf16",
    "rms_norm",
    "add_rms_norm",
    "layer_norm",
    "activate",
    "silu_mul",
    "sigmoid_mul",
    "delta_conv",
    "delta_rule",
    "add",
    "rope",
    "norm_rope",
    "narrow_cols",
    "gather_rows",
    "scatter_rows",
    "scale_rows",
    "write_kv",
    "segment_attention",
    "segment_attention_tiled",
    "paged_attention",
    "paged_attention_tiled",
    "paged_attention_split",
    "paged_attention_merge",
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
/// Warps per block of `segment_attention_tiled` (`ATTN_TILE_WARPS` in the source).
pub const TILE_WARPS: u32 = 8;
/// Query rows a warp of `segment_attention_tiled` holds, at most (`ATTN_TILE_ROWS`).
pub const TILE_ROWS_PER_WARP: u32 = 4;
/// Keys per shared-memory tile of `segment_attention_tiled` (`ATTN_TILE_KEYS`).
pub const TILE_KEYS: usize = 32;
/// The dynamic shared memory a tiled attention block takes at most: the 48 KiB a block may hold
/// without opting in to more (every GPU since 2012), less room for its static shared variables.
pub const MAX_DYNAMIC_SHARED_BYTES: usize = (48 << 10) - 64;

/// Weight rows per `gemv_bf16` block, one a warp (`GEMV_WARPS` in the source).
pub const GEMV_WARPS: u32 = 8;
/// Rows of x a `gemv_bf16` launch takes at most (`GEMV_MAX_ROWS`); more go to cuBLAS.
pub const GEMV_MAX_ROWS: usize = 4;
/// Weight matrices a `gemv_bf16` launch takes at most (`GEMV_JOBS`).
pub const GEMV_JOBS: usize = 4;
/// Heads per `norm_rope` block, one a warp (`HEAD_WARPS` in the source).
pub const HEAD_WARPS: u32 = 8;
/// Keys per part of a split attention, about (a part for every `SPLIT_KEYS` keys of the longest
/// row): smaller parts would cost more in merging than they save.
pub const SPLIT_KEYS: usize = 32;
/// Parts of one row and head a split attention takes at most.
pub const MAX_SPLITS: usize = 32;
/// Blocks (rows × heads × parts) up to which a split attention adds parts: about 30 per
/// multiprocessor of an H100, enough to keep every one busy without a large scratch.
pub const SPLIT_BLOCKS: usize = 4096;

/// A launch's grid and block sizes (what `cudarc::driver::LaunchConfig` takes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    /// Blocks in x, y, z.
    pub grid: (u32, u32, u32),
    /// Threads per block in x, y, z.
    pub block: (u32, u32, u32),
    /// Dynamic shared memory per block, in bytes.
    pub shared_bytes: u32,
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
        shared_bytes: 0,
    })
}

/// One block per row.
pub fn per_row(rows: usize) -> BResult<Geometry> {
    Ok(Geometry {
        grid: (count(rows, "rows")?.max(1), 1, 1),
        block: (ROW_THREADS, 1, 1),
        shared_bytes: 0,
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
        shared_bytes: 0,
    })
}

/// Query rows per warp of the tiled attention kernels for heads of `head_dim`: the most (up to
/// [`TILE_ROWS_PER_WARP`]) whose queries, with one tile of keys and values, fit in
/// [`MAX_DYNAMIC_SHARED_BYTES`]. None where not even one row per warp fits (heads wider than 170
/// values): those take the row kernels.
pub fn tile_rows_per_warp(head_dim: usize) -> Option<u32> {
    (1..=TILE_ROWS_PER_WARP)
        .rev()
        .find(|&r| tile_shared_bytes(head_dim, r) <= MAX_DYNAMIC_SHARED_BYTES)
}

/// A tiled attention block's dynamic shared memory: its queries and one tile of keys (padded by
/// one value) and values.
fn tile_shared_bytes(head_dim: usize, rows_per_warp: u32) -> usize {
    4 * ((TILE_WARPS * rows_per_warp) as usize * head_dim + TILE_KEYS * (2 * head_dim + 1))
}

/// A tiled attention launch over `tiles` blocks of rows and `heads` heads, with its rows per warp.
fn tiled(tiles: usize, heads: usize, head_dim: usize, rows_per_warp: u32) -> BResult<Geometry> {
    attention(1, heads, head_dim)?;
    Ok(Geometry {
        grid: (count(tiles, "row tiles")?.max(1), heads as u32, 1),
        block: (32 * TILE_WARPS, 1, 1),
        shared_bytes: tile_shared_bytes(head_dim, rows_per_warp) as u32,
    })
}

/// `segment_attention_tiled`'s launch and its rows per warp (None: the head is too wide to tile).
pub fn segment_tiles(rows: usize, heads: usize, head_dim: usize) -> BResult<Option<(Geometry, u32)>> {
    attention(rows, heads, head_dim)?;
    let Some(per_warp) = tile_rows_per_warp(head_dim) else {
        return Ok(None);
    };
    let block_rows = (TILE_WARPS * per_warp) as usize;
    Ok(Some((
        tiled(rows.div_ceil(block_rows), heads, head_dim, per_warp)?,
        per_warp,
    )))
}

/// `paged_attention_tiled`'s tiles: each sequence's query rows (`(first row, rows)`) cut into
/// blocks of at most `TILE_WARPS · rows_per_warp`, as `[first row, rows]` pairs, so that a
/// block's rows share one block table.
pub fn causal_tiles(seqs: &[(usize, usize)], rows_per_warp: u32) -> BResult<Vec<u32>> {
    let block_rows = (TILE_WARPS * rows_per_warp) as usize;
    let mut tiles = Vec::new();
    for &(start, len) in seqs {
        for at in (0..len).step_by(block_rows) {
            tiles.push(count(start + at, "rows")?);
            tiles.push(count(block_rows.min(len - at), "rows")?);
        }
    }
    Ok(tiles)
}

/// How many parts `paged_attention_split` cuts each row's keys into, for `rows` query rows of
/// `heads` heads over at most `max_keys` keys: 1 (the one-block kernel) unless the rows and heads
/// leave blocks to spare and the keys are many: a part for every [`SPLIT_KEYS`] keys.
pub fn attention_parts(rows: usize, heads: usize, max_keys: usize) -> usize {
    let by_blocks = SPLIT_BLOCKS / (rows * heads).max(1);
    max_keys.div_ceil(SPLIT_KEYS).min(by_blocks).clamp(1, MAX_SPLITS)
}

/// `paged_attention_split`'s launch: one block of [`ATTENTION_WARPS`] warps per row, head and part.
pub fn split_attention(rows: usize, heads: usize, head_dim: usize, parts: usize) -> BResult<Geometry> {
    let mut g = attention(rows, heads, head_dim)?;
    g.grid.2 = count(parts, "parts")?;
    Ok(g)
}

/// `paged_attention_merge`'s launch: one block of 128 threads per row and head.
pub fn attention_merge(rows: usize, heads: usize, head_dim: usize) -> BResult<Geometry> {
    let mut g = attention(rows, heads, head_dim)?;
    g.block = (128, 1, 1);
    Ok(g)
}

/// `gemv_bf16`'s launch over `blocks` blocks ([`GEMV_WARPS`] weight rows each).
pub fn gemv(blocks: usize) -> BResult<Geometry> {
    Ok(Geometry {
        grid: (count(blocks, "weight row blocks")?.max(1), 1, 1),
        block: (32 * GEMV_WARPS, 1, 1),
        shared_bytes: 0,
    })
}

/// `norm_rope`'s launch over `heads` heads (all rows' together), [`HEAD_WARPS`] a block; heads of
/// at most [`MAX_HEAD_DIM`] values.
pub fn per_head(heads: usize, head_dim: usize) -> BResult<Geometry> {
    if head_dim == 0 || head_dim > MAX_HEAD_DIM {
        return Err(BackendError::Shape(format!(
            "heads of {head_dim} values: norm_rope takes 1 to {MAX_HEAD_DIM}"
        )));
    }
    Ok(Geometry {
        grid: (count(heads, "heads")?.div_ceil(HEAD_WARPS).max(1), 1, 1),
        block: (32 * HEAD_WARPS, 1, 1),
        shared_bytes: 0,
    })
}

/// `paged_attention_tiled`'s launch over `tiles` tiles ([`causal_tiles`] pairs).
pub fn paged_tiles(tiles: usize, heads: usize, head_dim: usize, rows_per_warp: u32) -> BResult<Geometry> {
    tiled(tiles, heads, head_dim, rows_per_warp)
}

/// One block of 64 threads per sequence (x) and value head (y), for `delta_rule`.
pub fn delta_rule(seqs: usize, heads: usize) -> BResult<Geometry> {
    if heads > 65_535 {
        return Err(BackendError::Shape(format!("{heads} value heads: at most 65535")));
    }
    Ok(Geometry {
        grid: (count(seqs, "sequences")?.max(1), heads.max(1) as u32, 1),
        block: (64, 1, 1),
        shared_bytes: 0,
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

#[cfg(test)]
mod tests {
    use super::*;

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
    fn split_attention_takes_parts_only_where_blocks_are_few_and_keys_many() {
        // One decode row of 16 heads over 850 keys: 27 parts (of 32 keys, the last of 18).
        assert_eq!(attention_parts(1, 16, 850), 27);
        // Few keys, or as many rows and heads as the GPU holds: the one-block kernel.
        assert_eq!(attention_parts(1, 16, 32), 1);
        assert_eq!(attention_parts(784, 16, 784), 1);
        // Sixteen decode rows of 32 heads over 4000 keys: bounded by the blocks (4096 / 512).
        assert_eq!(attention_parts(16, 32, 4000), 8);
        // Very long rows: at most MAX_SPLITS parts.
        assert_eq!(attention_parts(1, 2, 1 << 20), MAX_SPLITS);
        assert_eq!(attention_parts(0, 16, 10), 1);
        let g = split_attention(2, 16, 128, 14).unwrap();
        assert_eq!((g.grid, g.block), ((2, 16, 14), (128, 1, 1)));
        assert_eq!(gemv(0).unwrap().grid.0, 1);
    }

    #[test]
    fn the_constants_are_the_kernels_own() {
        for (name, value) in [
            ("GEMV_WARPS", GEMV_WARPS as usize),
            ("GEMV_MAX_ROWS", GEMV_MAX_ROWS),
            ("GEMV_JOBS", GEMV_JOBS),
            ("HEAD_WARPS", HEAD_WARPS as usize),
            ("ATTN_WARPS", ATTENTION_WARPS as usize),
            ("ATTN_TILE_WARPS", TILE_WARPS as usize),
            ("ATTN_TILE_ROWS", TILE_ROWS_PER_WARP as usize),
            ("ATTN_TILE_KEYS", TILE_KEYS),
        ] {
            let value = value.to_string();
            assert!(
                SOURCE
                    .lines()
                    .any(|l| l.split_whitespace().take(3).eq(["#define", name, &value])),
                "{name} is not {value} in kernels.cu"
            );
        }
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
        let h = per_head(17, 128).unwrap();
        assert_eq!((h.grid, h.block), ((3, 1, 1), (256, 1, 1)));
        assert!(per_head(4, 512).is_err());
    }

    #[test]
    fn attention_tiles_take_as_many_rows_as_shared_memory_holds() {
        // Qwen3-VL's vision heads (64), Qwen2/2.5-VL's (80), the text heads (128).
        for (d, per_warp) in [(64, 4), (80, 4), (128, 3), (160, 1)] {
            let (g, r) = segment_tiles(1000, 16, d).unwrap().unwrap();
            assert_eq!(r, per_warp, "head of {d}");
            let block_rows = (TILE_WARPS * r) as usize;
            assert_eq!(g.grid, (1000usize.div_ceil(block_rows) as u32, 16, 1));
            assert_eq!(g.block, (256, 1, 1));
            assert!(g.shared_bytes as usize <= MAX_DYNAMIC_SHARED_BYTES);
            assert_eq!(g.shared_bytes as usize, 4 * (block_rows * d + TILE_KEYS * (2 * d + 1)));
        }
        assert!(
            segment_tiles(10, 16, 256).unwrap().is_none(),
            "wide heads take the row kernel"
        );
        assert!(segment_tiles(10, 16, 512).is_err());
    }

    #[test]
    fn causal_tiles_never_mix_sequences() {
        // 3 rows per warp: blocks of 24 rows. A 50-row prefill, a decode row, a 24-row chunk.
        let tiles = causal_tiles(&[(0, 50), (50, 1), (51, 24)], 3).unwrap();
        assert_eq!(tiles, [0, 24, 24, 24, 48, 2, 50, 1, 51, 24]);
        let g = paged_tiles(tiles.len() / 2, 16, 128, 3).unwrap();
        assert_eq!((g.grid, g.block), ((5, 16, 1), (256, 1, 1)));
        assert!(causal_tiles(&[], 4).unwrap().is_empty());
    }

    #[test]
    fn compile_options_name_the_device_architecture() {
        let o = compile_options(9, 0);
        assert_eq!(o[0], "--gpu-architecture=compute_90");
        assert!(o.contains(&"--fmad=false".to_string()));
    }
}
