//! A decode's products with f16 weight rows: one activation row against each weight row.
//!
//! Products by rows of f16 weights read the activations rounded to f16, as llama.cpp's CPU code
//! rounds them for its f16 weights, wherever an activation row fits f16's range (a row with a
//! value beyond 65504 keeps f32): a decode's, at half the bytes, stays in L1 beside the weights
//! streaming through it, and the products read the weights faster (`f16_decode_rows_bench`,
//! below); several rows ([`rounded_rows`]) are rounded alike, so that a product gives the same
//! sums however its activation rows are sliced (between row partners). The prefill GEMMs keep f32.

use half::f16;
use std::borrow::Cow;

use super::isa::fastest;
use super::packed::dot_rows_f16_portable;

/// Whether every value of an activation row is one f16 can hold (or an infinity or NaN, which it
/// holds too).
fn fits_f16(row: &[f32]) -> bool {
    row.iter().all(|v| v.abs() <= f16::MAX.to_f32() || !v.is_finite())
}

/// Activation rows `[m, cols]` as products by rows of f16 weights read them: each row that fits
/// f16's range rounded to f16 values.
pub(super) fn rounded_rows(x: &[f32], cols: usize) -> Vec<f32> {
    let mut rounded = x.to_vec();
    for row in rounded.chunks_exact_mut(cols).filter(|row| fits_f16(row)) {
        row.iter_mut().for_each(|v| *v = f16::from_f32(*v).to_f32());
    }
    rounded
}

/// The activation row of a decode's f16 products, as they read it.
pub(super) enum DecodeActivations<'x> {
    /// Rounded to f16, every value within f16's range; `widened`, the same values as f32 once
    /// for all the product's calls where the CPU has no F16C to widen them in registers (else
    /// empty).
    Half { values: Vec<f16>, widened: Vec<f32> },
    /// As computed, where some value lies beyond f16's range.
    Full(&'x [f32]),
}

impl<'x> DecodeActivations<'x> {
    /// `x` rounded to f16 where it fits, else `x` itself.
    pub(super) fn new(x: &'x [f32]) -> Self {
        if !fits_f16(x) {
            return Self::Full(x);
        }
        let values: Vec<f16> = x.iter().map(|&v| f16::from_f32(v)).collect();
        let widened = if super::isa::isa().avx2_fma {
            Vec::new()
        } else {
            values.iter().map(|v| v.to_f32()).collect()
        };
        Self::Half { values, widened }
    }

    /// `out[r] = w_r · x` for the `out.len()` rows `w_r` of `w`, each as long as the activations.
    pub(super) fn products(&self, w: &[f16], out: &mut [f32]) {
        match self {
            Self::Half { widened, .. } if !widened.is_empty() => dot_f16_rows_one(w, widened.as_slice(), out),
            Self::Half { values, .. } => dot_f16_rows_one(w, values.as_slice(), out),
            Self::Full(x) => dot_f16_rows_one(w, x, out),
        }
    }
}

/// An activation value as a decode's f16 product reads it.
trait Activation: Copy + Sync {
    fn widen(self) -> f32;

    /// `x` as f32: itself where it already is, else widened.
    fn widened(x: &[Self]) -> Cow<'_, [f32]> {
        Cow::Owned(x.iter().map(|v| v.widen()).collect())
    }

    /// Eight values from `p` on, as f32.
    ///
    /// # Safety
    /// Eight values from `p` on must be readable, and the CPU must have AVX and F16C.
    #[cfg(target_arch = "x86_64")]
    #[allow(unsafe_code)]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
}

impl Activation for f32 {
    fn widen(self) -> f32 {
        self
    }

    fn widened(x: &[f32]) -> Cow<'_, [f32]> {
        Cow::Borrowed(x)
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    #[allow(unsafe_code)]
    unsafe fn load8(p: *const f32) -> std::arch::x86_64::__m256 {
        // SAFETY: eight readable f32 (the caller's promise).
        unsafe { std::arch::x86_64::_mm256_loadu_ps(p) }
    }
}

impl Activation for f16 {
    fn widen(self) -> f32 {
        self.to_f32()
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    #[allow(unsafe_code)]
    unsafe fn load8(p: *const f16) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: eight readable halves (the caller's promise), and F16C.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
    }
}

/// Bytes of activations past which a decode's f16 product takes [`LONG_ROWS_AT_ONCE`] weight rows
/// per pass over them. Measured on the Zen 4 VM (`f16_decode_rows_bench`, 2 threads, 700 MB of
/// rows, variants alternated 30 times): one row per pass streams 34 GB/s with 16 kB of f32
/// activations (4096 columns) and 40 with 12 kB of f16 (6144), but 21–25 with 24 kB and more of
/// f32 and 26–27 of f16 (they no longer stay in the 32 kB L1 beside the weights streaming through
/// it); four rows per pass, sharing the activation loads, 35–39 there.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const LONG_ROW_BYTES: usize = 16 << 10;

/// Weight rows per pass over activations longer than [`LONG_ROW_BYTES`].
pub(super) const LONG_ROWS_AT_ONCE: usize = 4;

/// `out[r] = w_r · x` for the `out.len()` rows `w_r` of `w` (each `x.len()` long).
fn dot_f16_rows_one<X: Activation>(w: &[f16], x: &[X], out: &mut [f32]) {
    fastest!(
        avx2_fma => if std::mem::size_of_val(x) > LONG_ROW_BYTES {
            dot_f16_rows_one_avx2::<LONG_ROWS_AT_ONCE, X>(w, x, out)
        } else {
            dot_f16_rows_one_avx2::<1, X>(w, x, out)
        },
        // Without F16C `DecodeActivations` passes f32 (widened once per product), read as it is.
        _ => {
            let x = X::widened(x);
            for (row, o) in w.chunks_exact(x.len()).zip(out.iter_mut()) {
                dot_rows_f16_portable(row, &x, std::slice::from_mut(o));
            }
        },
    )
}

/// [`dot_f16_rows_one`] with `R` rows per pass over `x` (its loads shared by them), two chains of
/// eight per row.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(unsafe_code)]
fn dot_f16_rows_one_avx2<const R: usize, X: Activation>(w: &[f16], x: &[X], out: &mut [f32]) {
    use std::arch::x86_64::*;
    const STEP: usize = 16;
    let cols = x.len();
    let whole = cols / STEP * STEP;
    let tail = |row: &[f16]| -> f32 {
        row[whole..]
            .iter()
            .zip(&x[whole..])
            .map(|(w, x)| w.to_f32() * x.widen())
            .sum()
    };
    let sum = |acc: &[__m256; 2]| -> f32 {
        let mut lanes = [0f32; 8];
        // SAFETY: eight f32 into eight.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), _mm256_add_ps(acc[0], acc[1])) };
        lanes.iter().sum()
    };
    let mut groups = out.chunks_mut(R);
    for (g, o) in (&mut groups).enumerate() {
        let rows = &w[g * R * cols..(g * R + o.len()) * cols];
        if o.len() < R {
            // The last rows, one at a time.
            for (k, o) in o.iter_mut().enumerate() {
                let row = &rows[k * cols..(k + 1) * cols];
                let mut acc = [_mm256_setzero_ps(); 2];
                for i in (0..whole).step_by(STEP) {
                    for (l, acc) in acc.iter_mut().enumerate() {
                        // SAFETY: `i + 16 <= whole <= cols`, the length of `x` and of `row`.
                        let (wv, xv) = unsafe {
                            (
                                _mm256_cvtph_ps(_mm_loadu_si128(row.as_ptr().add(i + 8 * l).cast())),
                                X::load8(x.as_ptr().add(i + 8 * l)),
                            )
                        };
                        *acc = _mm256_fmadd_ps(wv, xv, *acc);
                    }
                }
                *o = sum(&acc) + tail(row);
            }
            continue;
        }
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        for i in (0..whole).step_by(STEP) {
            // SAFETY: `i + 16 <= whole <= cols`, the length of `x`.
            let xv = unsafe { [X::load8(x.as_ptr().add(i)), X::load8(x.as_ptr().add(i + 8))] };
            for (k, acc) in acc.iter_mut().enumerate() {
                for (l, acc) in acc.iter_mut().enumerate() {
                    // SAFETY: columns `i + 8l..i + 8l + 8` of row `k < R` of `rows`.
                    let wv =
                        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(rows.as_ptr().add(k * cols + i + 8 * l).cast())) };
                    *acc = _mm256_fmadd_ps(wv, xv[l], *acc);
                }
            }
        }
        for (k, (o, acc)) in o.iter_mut().zip(&acc).enumerate() {
            *o = sum(acc) + tail(&rows[k * cols..(k + 1) * cols]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each row's product against the activations as the product reads them (rounded to f16 where
    /// they fit), within f32 rounding, by every path: dispatched, and one and several rows per
    /// pass over f32 and f16 activations; short rows and long ones (past [`LONG_ROW_BYTES`] in
    /// both widths), widths off the step and row counts off the group.
    #[test]
    fn decode_products_are_each_row_s() {
        for cols in [8, 40, 2048 + 5, 8192 + 24] {
            let rows = 2 * LONG_ROWS_AT_ONCE + 3;
            let w: Vec<f16> = crate::arch::blocks::tests::values(rows * cols, 3)
                .into_iter()
                .map(|v| f16::from_f32(v * 10.0))
                .collect();
            let x = crate::arch::blocks::tests::values(cols, 5);
            let acts = DecodeActivations::new(&x);
            let DecodeActivations::Half { values: half, .. } = &acts else {
                panic!("{cols}: activations within range kept f32")
            };
            let want: Vec<f64> = w
                .chunks_exact(cols)
                .map(|r| r.iter().zip(half).map(|(w, x)| w.to_f64() * x.to_f64()).sum())
                .collect();
            let mut got = vec![0f32; rows];
            acts.products(&w, &mut got);
            #[allow(unused_mut)]
            let mut all = vec![("dispatched", got)];
            #[cfg(target_arch = "x86_64")]
            if crate::backend::cpu::isa::isa().avx2_fma {
                let half_x: Vec<f32> = half.iter().map(|v| v.to_f32()).collect();
                let mut run = |name, f: &dyn Fn(&mut [f32])| {
                    let mut out = vec![0f32; rows];
                    f(&mut out);
                    all.push((name, out));
                };
                // SAFETY (all four): this CPU has AVX2, FMA and F16C (`avx2_fma` checks all three).
                #[allow(unsafe_code)]
                {
                    run("f32, one row", &|o| unsafe {
                        dot_f16_rows_one_avx2::<1, f32>(&w, &half_x, o)
                    });
                    run("f32, rows at once", &|o| unsafe {
                        dot_f16_rows_one_avx2::<LONG_ROWS_AT_ONCE, f32>(&w, &half_x, o)
                    });
                    run("f16, one row", &|o| unsafe {
                        dot_f16_rows_one_avx2::<1, f16>(&w, half, o)
                    });
                    run("f16, rows at once", &|o| unsafe {
                        dot_f16_rows_one_avx2::<LONG_ROWS_AT_ONCE, f16>(&w, half, o)
                    });
                }
            }
            for (name, got) in all {
                for (r, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (*g as f64 - w).abs() <= 1e-4 * w.abs().max(1.0),
                        "{name} {cols} row {r}: {g} vs {w}"
                    );
                }
            }
        }
    }

    /// Activations with a value past f16's largest (an outlier of the residual stream) keep f32:
    /// the product is the f32 one, finite; infinities and NaN alone do not prevent the rounding.
    #[test]
    fn activations_beyond_f16_range_keep_f32() {
        let cols = 64;
        let mut x = crate::arch::blocks::tests::values(cols, 7);
        x[3] = 70_000.0;
        let w: Vec<f16> = crate::arch::blocks::tests::values(2 * cols, 8)
            .into_iter()
            .map(f16::from_f32)
            .collect();
        let acts = DecodeActivations::new(&x);
        assert!(matches!(acts, DecodeActivations::Full(_)));
        let mut got = [0f32; 2];
        acts.products(&w, &mut got);
        for (g, row) in got.iter().zip(w.chunks_exact(cols)) {
            let want: f64 = row.iter().zip(&x).map(|(w, x)| w.to_f64() * *x as f64).sum();
            assert!((*g as f64 - want).abs() <= 1e-4 * want.abs().max(1.0), "{g} vs {want}");
        }
        x[3] = f32::INFINITY;
        x[4] = f32::NAN;
        assert!(matches!(DecodeActivations::new(&x), DecodeActivations::Half { .. }));
    }

    /// `cargo test --release -p kvlens-engine --lib -- --ignored f16_decode_rows_bench --nocapture`
    /// (with `RAYON_NUM_THREADS`): a decode's f16 products over 700 MB of rows of each width, the
    /// activations f32 or f16, one or [`LONG_ROWS_AT_ONCE`] rows per pass, the variants
    /// alternated; GB/s read. x86-64 only: the variants are the AVX2 kernel's.
    #[cfg(target_arch = "x86_64")]
    #[test]
    #[ignore]
    fn f16_decode_rows_bench() {
        for (rows, cols, count) in [
            (2048, 2048, 84),
            (1024, 4096, 84),
            (2048, 6144, 28),
            (2048, 12288, 14),
            (1024, 18944, 18),
        ] {
            let mats: Vec<Vec<f16>> = (0..count)
                .map(|i| {
                    crate::arch::blocks::tests::values(rows * cols, i)
                        .into_iter()
                        .map(f16::from_f32)
                        .collect()
                })
                .collect();
            let x = crate::arch::blocks::tests::values(cols, 99);
            let half: Vec<f16> = x.iter().map(|&v| f16::from_f32(v)).collect();
            let mut rates: [Vec<f64>; 4] = Default::default();
            for _ in 0..30 {
                for (v, rate) in rates.iter_mut().enumerate() {
                    let start = std::time::Instant::now();
                    for w in &mats {
                        let mut out = vec![0f32; rows];
                        crate::parallel::for_each_piece(&mut out, 64, |p, o| {
                            let w = &w[p * 64 * cols..][..o.len() * cols];
                            fastest!(
                                avx2_fma => match v {
                                    0 => dot_f16_rows_one_avx2::<1, f32>(w, &x, o),
                                    1 => dot_f16_rows_one_avx2::<LONG_ROWS_AT_ONCE, f32>(w, &x, o),
                                    2 => dot_f16_rows_one_avx2::<1, f16>(w, &half, o),
                                    _ => dot_f16_rows_one_avx2::<LONG_ROWS_AT_ONCE, f16>(w, &half, o),
                                },
                                _ => dot_f16_rows_one(w, &x, o),
                            )
                        });
                        std::hint::black_box(out);
                    }
                    rate.push((rows * cols * 2 * count) as f64 / start.elapsed().as_secs_f64() / 1e9);
                }
            }
            for (v, mut r) in rates.into_iter().enumerate() {
                r.sort_by(f64::total_cmp);
                let (x, at_once) = [
                    ("f32", 1),
                    ("f32", LONG_ROWS_AT_ONCE),
                    ("f16", 1),
                    ("f16", LONG_ROWS_AT_ONCE),
                ][v];
                eprintln!(
                    "{cols} columns, {x} activations, {at_once} row(s) per pass: median {:.1} GB/s",
                    r[r.len() / 2]
                );
            }
        }
    }
}
