//! `kvlens bench bandwidth`: the host's sustained memory read bandwidth, the bound of a decode step
//! that reads every weight once. A read-only sweep over a buffer much larger than the caches, split
//! across all cores; copy bandwidth (read + write) is printed beside it because it is what simpler
//! tools measure and it understates what a GEMV can read.

use anyhow::{bail, Result};
use std::time::Instant;

/// Flags of `kvlens bench bandwidth`.
#[derive(Debug, clap::Args)]
pub struct BandwidthArgs {
    /// Buffer size in MiB (far above the last-level cache).
    #[arg(long, default_value_t = 1024)]
    mib: usize,
    /// Sweeps; the best is reported.
    #[arg(long, default_value_t = 5)]
    repeats: usize,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

/// Sums a slice with eight independent lanes, so the loop vectorizes and is bound by loads.
fn sum(words: &[u64]) -> u64 {
    let mut lanes = [0u64; 8];
    let chunks = words.chunks_exact(8);
    let tail: u64 = chunks.remainder().iter().fold(0, |a, &w| a.wrapping_add(w));
    for c in chunks {
        for (l, &w) in lanes.iter_mut().zip(c) {
            *l = l.wrapping_add(w);
        }
    }
    lanes.iter().fold(tail, |a, &l| a.wrapping_add(l))
}

/// Best GB/s of `repeats` runs of `work` over `bytes` bytes moved.
fn best_gb_s(repeats: usize, bytes: usize, mut work: impl FnMut()) -> f64 {
    (0..repeats.max(1))
        .map(|_| {
            let t = Instant::now();
            work();
            bytes as f64 / t.elapsed().as_secs_f64() / 1e9
        })
        .fold(0.0, f64::max)
}

/// Read and copy bandwidth in GB/s over `words` with `threads` threads.
fn measure(words: &[u64], scratch: &mut [u64], threads: usize, repeats: usize) -> (f64, f64) {
    let per = words.len().div_ceil(threads);
    let bytes = std::mem::size_of_val(words);
    let mut checksum = 0u64;
    let read = best_gb_s(repeats, bytes, || {
        checksum = std::thread::scope(|s| {
            let handles: Vec<_> = words.chunks(per).map(|c| s.spawn(move || sum(c))).collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or(0))
                .fold(0u64, u64::wrapping_add)
        });
    });
    // Keeps the sums observable, so the reads cannot be optimised away.
    std::hint::black_box(checksum);
    let copy = best_gb_s(repeats, 2 * bytes, || {
        std::thread::scope(|s| {
            for (src, dst) in words.chunks(per).zip(scratch.chunks_mut(per)) {
                s.spawn(move || dst.copy_from_slice(src));
            }
        });
    });
    (read, copy)
}

/// Runs `kvlens bench bandwidth`.
pub fn run(a: &BandwidthArgs) -> Result<()> {
    if a.mib == 0 {
        bail!(crate::UsageError("--mib must be positive".into()));
    }
    let n = a.mib * (1 << 20) / 8;
    // Written first, so every page is resident before the clock starts.
    let words: Vec<u64> = (0..n as u64).collect();
    let mut scratch = vec![1u64; n];
    let threads = std::thread::available_parallelism().map_or(1, |t| t.get());
    let (read, copy) = measure(&words, &mut scratch, threads, a.repeats);
    if a.json {
        println!(
            "{}",
            serde_json::json!({"read_gb_s": read, "copy_gb_s": copy, "threads": threads, "mib": a.mib})
        );
    } else {
        println!(
            "memory bandwidth over {} MiB with {threads} threads: read {read:.1} GB/s, copy {copy:.1} GB/s (read + write)",
            a.mib
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sweep_reads_every_word() {
        let words: Vec<u64> = (1..=1003).collect();
        assert_eq!(sum(&words), 1003 * 1004 / 2);
        let mut s = vec![0u64; words.len()];
        let (read, copy) = measure(&words, &mut s, 3, 1);
        assert!(read > 0.0 && copy > 0.0);
        assert_eq!(s, words, "the copy sweep copies every word");
    }
}
