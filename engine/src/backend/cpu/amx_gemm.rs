//! Products of many activation rows (prefill, the vision tower) with bfloat16 weight matrices on
//! CPUs with AMX (Intel Xeon since Sapphire Rapids): `tdpbf16ps` multiplies a 16 × 32 tile of
//! weights by a 32 × 16 tile of activations into 16 × 16 f32 sums, 16 384 products per
//! instruction, some 30 times what the f32 FMA units do on the same core.
//!
//! Each activation is split into two bfloat16 values, its nearest `hi` and the nearest `lo` to
//! what remains, and both are multiplied: 16 bits of every activation are kept (llama.cpp's F16
//! products keep 11, a bfloat16 model's 8), the weights are exact, and the sums are f32. The
//! second product costs far less than the f32 GEMM it replaces.
//!
//! Layout: the weights are used as stored (`[n, k]` row-major), each tile 16 weight rows by 32
//! values; activations are repacked per call into tiles of 16 rows by 16 k-pairs (the `hi` tiles
//! and `lo` tiles of each 16 rows apart). A task takes a chunk of activation rows that stays in the
//! second-level cache and, weight panel by weight panel, runs 32 × 32 register tiles over it (four
//! accumulators, two weight tiles, two activation tiles: the eight tile registers) along k, each
//! stored weight row by weight row into the first-level cache and transposed into the result.

use crate::memory::ledger::{Category, MemoryLedger};
use crate::parallel::for_each_piece;

/// Rows of a tile, and activation rows (or weight rows) per tile.
const TILE: usize = 16;
/// Weight values (and k-pairs × 2) per tile row: 64 bytes of bfloat16.
const TILE_K: usize = 32;
/// Activation rows (and weight rows) per register tile: two tiles.
const BLOCK: usize = 2 * TILE;
/// Bytes of repacked activations (both halves) per activation-row chunk of a task: they are
/// reread for every weight tile of the band, so they stay in the second-level cache.
const CHUNK_BYTES: usize = 512 << 10;

/// Whether this CPU runs [`matmul`]: AMX-BF16, granted by the OS, after `KVLENS_CPU_ISA`.
pub(super) fn available() -> bool {
    super::isa::isa().amx_bf16
}

/// Whether [`matmul`] takes an `[n, k]` matrix: on this CPU, whole tiles of weight rows and values.
pub(super) fn fits(n: usize, k: usize) -> bool {
    available() && n.is_multiple_of(BLOCK) && k.is_multiple_of(TILE_K) && n > 0 && k > 0
}

/// The nearest bfloat16 to `x` and the nearest to what remains, as `(hi, lo)` bits.
#[inline(always)]
fn split(x: f32) -> (u16, u16) {
    let hi = super::bf16_gemm::round_bf16(x);
    let rest = x - f32::from_bits((hi as u32) << 16);
    (hi, super::bf16_gemm::round_bf16(rest))
}

/// `x` (`[m, k]` f32) times the transpose of `w` (`[n, k]` bfloat16 bits, row-major): `[m, n]`;
/// an error where the shapes disagree or the matrix does not [`fits`]. The repacked activations
/// and the result are recorded in `ledger` while this runs.
pub(super) fn matmul(x: &[f32], m: usize, w: &[u16], n: usize, ledger: &MemoryLedger) -> Result<Vec<f32>, String> {
    let k = w.len() / n.max(1);
    if w.len() != n * k || x.len() != m * k {
        return Err(format!("{} activations are not {m} rows of {k}", x.len()));
    }
    if !fits(n, k) {
        return Err(format!(
            "a {n} × {k} matrix on this CPU does not take AMX bfloat16 tiles (AMX: {})",
            available()
        ));
    }
    let kp = k / 2;
    let rows = m.div_ceil(BLOCK) * BLOCK;
    let _held = ledger.hold(Category::Activations, ((rows * kp * 2 + m * n) * 4) as u64);
    // Per 16 activation rows: the `hi` tile rows for every k-pair, then the `lo` ones; each tile
    // row holds the 16 rows' pair (`tdpbf16ps`'s order: the first value in the low half).
    let mut xb = vec![0u32; rows * kp * 2];
    for_each_piece(&mut xb[..m.div_ceil(TILE) * TILE * kp * 2], TILE * kp * 2, |b, part| {
        let (his, los) = part.split_at_mut(TILE * kp);
        for r in 0..TILE.min(m - b * TILE) {
            let row = &x[(b * TILE + r) * k..][..k];
            for (p, &[a, c]) in row.as_chunks::<2>().0.iter().enumerate() {
                let ((ah, al), (ch, cl)) = (split(a), split(c));
                his[p * TILE + r] = ah as u32 | (ch as u32) << 16;
                los[p * TILE + r] = al as u32 | (cl as u32) << 16;
            }
        }
    });
    // Tasks of activation rows that stay in the second-level cache, at least two per thread
    // where there are rows enough; each runs every weight panel over its rows.
    let threads = candle_core::utils::barrier_pool().n_workers() + 1;
    let chunk = (CHUNK_BYTES / (k * 4) / BLOCK).clamp(1, m.div_ceil(2 * threads * BLOCK).max(1)) * BLOCK;
    let mut y = vec![0f32; m * n];
    for_each_piece(&mut y, chunk * n, |t, part| {
        let first = t * chunk;
        let count = part.len() / n;
        let _tiles = TileConfig::load();
        let mut sums = Sums([0.0; BLOCK * BLOCK]);
        for j in (0..n).step_by(BLOCK) {
            let w_rows = &w[j * k..][..BLOCK * k];
            for i in (0..count).step_by(BLOCK) {
                block_product(w_rows, &xb[(first + i) * kp * 2..][..BLOCK * k], k, &mut sums);
                for r in 0..BLOCK.min(count - i) {
                    let row = &mut part[(i + r) * n + j..][..BLOCK];
                    for (c, v) in row.iter_mut().enumerate() {
                        *v = sums.0[c * BLOCK + r];
                    }
                }
            }
        }
    });
    Ok(y)
}

/// The tile registers configured for this thread (16 rows of 64 bytes each) while it lives;
/// released when dropped.
struct TileConfig;

impl TileConfig {
    #[allow(unsafe_code)]
    fn load() -> TileConfig {
        assert!(available());
        let mut config = Palette([0; 64]);
        config.0[0] = 1;
        for t in 0..8 {
            config.0[16 + 2 * t] = 64;
            config.0[48 + t] = TILE as u8;
        }
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AMX is available (asserted); the configuration is 64 readable bytes.
        unsafe {
            std::arch::asm!("ldtilecfg [{c}]", c = in(reg) config.0.as_ptr(), options(nostack, readonly));
        }
        TileConfig
    }
}

impl Drop for TileConfig {
    #[allow(unsafe_code)]
    fn drop(&mut self) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: only built by `load`, after which the tiles are configured.
        unsafe {
            std::arch::asm!("tilerelease", options(nostack, nomem));
        }
    }
}

/// `ldtilecfg`'s 64-byte operand: palette 1, then each tile's bytes per row and rows.
#[repr(C, align(64))]
struct Palette([u8; 64]);

/// A register tile's sums, weight row by weight row (the transpose of the result's block).
#[repr(C, align(64))]
struct Sums([f32; BLOCK * BLOCK]);

/// One register tile: weight rows `w` (`BLOCK` rows of `k`) against two 16-row blocks of repacked
/// activations `acts` (each the `hi` then the `lo` tiles over `k / 2` pairs), into `sums`. Only
/// inside a [`TileConfig`].
#[allow(unsafe_code)]
fn block_product(w: &[u16], acts: &[u32], k: usize, sums: &mut Sums) {
    assert!(w.len() >= BLOCK * k && acts.len() >= BLOCK * k && k.is_multiple_of(TILE_K));
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the tiles read lie in `w` (rows 0..32, k values each) and `acts` (four blocks of
    // k / 2 pairs × 16 lanes), as asserted, and the tiles written in `sums`; the caller
    // configured the tiles (16 rows of 64 bytes).
    unsafe {
        let kp = k / 2;
        let w_stride = k * 2;
        let lane_bytes = TILE * 4;
        let (x0h, x0l) = (acts.as_ptr(), acts.as_ptr().add(TILE * kp));
        let (x1h, x1l) = (acts.as_ptr().add(2 * TILE * kp), acts.as_ptr().add(3 * TILE * kp));
        let o = sums.0.as_mut_ptr();
        let o_stride = BLOCK * 4;
        std::arch::asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            "2:",
            "tileloadd tmm4, [{w0} + {ws}*1]",
            "tileloadd tmm5, [{w1} + {ws}*1]",
            "tileloadd tmm6, [{x0h} + {ls}*1]",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tdpbf16ps tmm2, tmm5, tmm6",
            "tileloadd tmm7, [{x0l} + {ls}*1]",
            "tdpbf16ps tmm0, tmm4, tmm7",
            "tdpbf16ps tmm2, tmm5, tmm7",
            "tileloadd tmm6, [{x1h} + {ls}*1]",
            "tdpbf16ps tmm1, tmm4, tmm6",
            "tdpbf16ps tmm3, tmm5, tmm6",
            "tileloadd tmm7, [{x1l} + {ls}*1]",
            "tdpbf16ps tmm1, tmm4, tmm7",
            "tdpbf16ps tmm3, tmm5, tmm7",
            "add {w0}, 64",
            "add {w1}, 64",
            "add {x0h}, 1024",
            "add {x0l}, 1024",
            "add {x1h}, 1024",
            "add {x1l}, 1024",
            "dec {chunks}",
            "jnz 2b",
            "tilestored [{o} + {os}*1], tmm0",
            "tilestored [{o} + {os}*1 + 64], tmm1",
            "tilestored [{o1} + {os}*1], tmm2",
            "tilestored [{o1} + {os}*1 + 64], tmm3",
            w0 = inout(reg) w.as_ptr() => _,
            w1 = inout(reg) w.as_ptr().add(TILE * k) => _,
            x0h = inout(reg) x0h => _,
            x0l = inout(reg) x0l => _,
            x1h = inout(reg) x1h => _,
            x1l = inout(reg) x1l => _,
            chunks = inout(reg) k / TILE_K => _,
            ws = in(reg) w_stride,
            ls = in(reg) lane_bytes,
            o = in(reg) o,
            o1 = in(reg) o.add(TILE * BLOCK),
            os = in(reg) o_stride,
            options(nostack)
        );
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("AMX products off x86_64 ({w:?}, {acts:?}, {k}, {:?})", sums.0)
}

#[cfg(test)]
mod tests {
    use super::super::bf16_gemm::round_bf16;
    use super::*;

    /// Whole and partial row blocks, one and several bands and chunks, against the product in
    /// f64 of the f32 activations and the bfloat16 weights: within what 16 bits of each
    /// activation allow.
    #[test]
    fn matches_the_f32_product() {
        let ledger = MemoryLedger::new();
        if !available() {
            assert!(matmul(&[1.0; 32], 1, &[0; 32 * 32], 32, &ledger)
                .unwrap_err()
                .contains("AMX: false"));
            eprintln!("this CPU (or the OS) offers no AMX bfloat16 tiles: the kernel is not run here");
            return;
        }
        assert!(matmul(&[1.0; 3], 1, &[0; 32 * 32], 32, &ledger)
            .unwrap_err()
            .contains("not 1 rows of 32"));
        assert!(!fits(48, 32) && !fits(32, 48) && fits(64, 96));
        for (m, n, k) in [
            (1, 32, 32),
            (17, 64, 96),
            (40, 96, 64),
            (33, 32 * 20, 4096),
            (130, 64, 1024),
        ] {
            let x: Vec<f32> = (0..m * k).map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.3).collect();
            let w: Vec<u16> = (0..n * k)
                .map(|i| round_bf16(((i * 53 % 89) as f32 - 44.0) / 13.0))
                .collect();
            let got = matmul(&x, m, &w, n, &ledger).unwrap();
            assert_eq!(ledger.total(), 0);
            assert_eq!(got.len(), m * n);
            let wide = |b: u16| f32::from_bits((b as u32) << 16) as f64;
            for i in 0..m {
                for j in 0..n {
                    let terms = (0..k).map(|c| x[i * k + c] as f64 * wide(w[j * k + c]));
                    let (want, size) = terms.fold((0.0, 0.0), |(s, a), t| (s + t, a + t.abs()));
                    let got = got[i * n + j] as f64;
                    assert!(
                        (got - want).abs() <= 2e-5 * size,
                        "{m}x{n}x{k} ({i}, {j}): {got} vs {want}"
                    );
                }
            }
        }
    }
}
