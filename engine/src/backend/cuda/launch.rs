//! What the CUDA backend computes on the host before a launch: the kernels' names and NVRTC
//! options, launch geometry, and the per-row metadata of the attention kernels. Nothing here
//! touches a GPU, so it is tested on any machine.

use crate::backend::{Activation, BResult, BackendError};

/// The CUDA C source of every kernel (compiled by NVRTC when the backend starts).
pub const SOURCE: &str = include_str!("kernels.cu");

/// Every `extern "C" __global__` function of [`SOURCE`], loaded once per process.
pub const KERNELS: [&str; 22] = [
    "to_bf16",
    "bf16_to_f32s",
    "add_bias",
    "embedding_f32",
    "embedding_bf16",
    "rms_norm",
    "layer_norm",
    "activate",
    "silu_mul",
    "sigmoid_mul",
    "delta_conv",
    "delta_rule",
    "add",
    "rope",
    "narrow_cols",
    "gather_rows",
    "scatter_rows",
    "scale_rows",
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

/// One block of 64 threads per sequence (x) and value head (y), for `delta_rule`.
pub fn delta_rule(seqs: usize, heads: usize) -> BResult<Geometry> {
    if heads > 65_535 {
        return Err(BackendError::Shape(format!("{heads} value heads: at most 65535")));
    }
    Ok(Geometry {
        grid: (count(seqs, "sequences")?.max(1), heads.max(1) as u32, 1),
        block: (64, 1, 1),
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
}
