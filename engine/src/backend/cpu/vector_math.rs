//! Element-wise math over f32 slices, written so that the compiler vectorises it: an exponential
//! (Cephes' polynomial, within 2 ulp of libm's over the range that matters) and the gated
//! activations built on it, each `x · σ(z)`: SiLU, GELU in its tanh form
//! (`½x(1 + tanh u) = x · σ(2u)`) and quick GELU. candle's versions call libm once per element
//! and allocate a tensor per step; the vision tower's softmax alone takes billions of exponentials.

use super::isa::fastest;
use crate::backend::Activation;
use crate::parallel::for_each_piece;

/// e^x, with x clamped to [−87, 88] (e^−87 ≈ 1.6e−38 stands in for smaller results).
#[inline(always)]
pub(super) fn exp(x: f32) -> f32 {
    // 1.5 · 2^23: adding it rounds to an integer held in the low mantissa bits.
    const SHIFTER: f32 = 12_582_912.0;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let x = x.clamp(-87.0, 88.0);
    let t = x * std::f32::consts::LOG2_E + SHIFTER;
    let n = t - SHIFTER;
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_2e-4;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    let two_n = ((t.to_bits() as i32 - SHIFTER.to_bits() as i32 + 127) << 23) as u32;
    y * f32::from_bits(two_n)
}

/// `x · σ(z) = x / (1 + e^−z)`.
#[inline(always)]
fn times_sigmoid(x: f32, z: f32) -> f32 {
    x / (1.0 + exp(-z))
}

/// GELU's tanh form as `x · σ(2u)`, `u = √(2/π)(x + 0.044715x³)`.
#[inline(always)]
fn gelu_tanh(x: f32) -> f32 {
    const TWO_SQRT_2_OVER_PI: f32 = 2.0 * std::f32::consts::FRAC_2_SQRT_PI * std::f32::consts::FRAC_1_SQRT_2;
    times_sigmoid(x, TWO_SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x))
}

/// An element-wise step this module computes.
#[derive(Debug, Clone, Copy)]
pub(super) enum Elementwise {
    /// `silu(a)`.
    Silu,
    /// `gelu_tanh(a)`.
    GeluTanh,
    /// `a · σ(1.702a)`.
    QuickGelu,
    /// `silu(a) · b`.
    SiluTimes,
    /// `σ(a) · b`.
    SigmoidTimes,
}

impl Elementwise {
    /// The step that computes `act`; none for exact GELU (this module has no erf).
    pub(super) fn activation(act: Activation) -> Option<Self> {
        match act {
            Activation::Silu => Some(Elementwise::Silu),
            Activation::GeluTanh => Some(Elementwise::GeluTanh),
            Activation::QuickGelu => Some(Elementwise::QuickGelu),
            Activation::GeluErf => None,
        }
    }

    /// `out[i] = self(a[i], b[i])`; `b` is read only by the two-input steps.
    #[inline(always)]
    fn run(self, a: &[f32], b: &[f32], out: &mut [f32]) {
        fn each(a: &[f32], out: &mut [f32], f: impl Fn(f32) -> f32) {
            out.iter_mut().zip(a).for_each(|(o, &x)| *o = f(x));
        }
        match self {
            Elementwise::Silu => each(a, out, |x| times_sigmoid(x, x)),
            Elementwise::GeluTanh => each(a, out, gelu_tanh),
            Elementwise::QuickGelu => each(a, out, |x| times_sigmoid(x, 1.702 * x)),
            Elementwise::SiluTimes => {
                for ((o, &x), &y) in out.iter_mut().zip(a).zip(b) {
                    *o = times_sigmoid(x, x) * y;
                }
            }
            Elementwise::SigmoidTimes => {
                for ((o, &x), &y) in out.iter_mut().zip(a).zip(b) {
                    *o = times_sigmoid(y, x);
                }
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    fn run_avx2(self, a: &[f32], b: &[f32], out: &mut [f32]) {
        self.run(a, b, out)
    }

    /// [`Elementwise::run`] compiled for the widest instructions this CPU has.
    fn run_fastest(self, a: &[f32], b: &[f32], out: &mut [f32]) {
        fastest!(avx2_fma => self.run_avx2(a, b, out), _ => self.run(a, b, out))
    }

    /// The step over all of `a` (and `b`, as long), in pieces on candle's thread pool.
    pub(super) fn apply(self, a: &[f32], b: &[f32]) -> Vec<f32> {
        const PER_TASK: usize = 1 << 16;
        let mut out = vec![0f32; a.len()];
        for_each_piece(&mut out, PER_TASK, |t, part| {
            let from = t * PER_TASK;
            let to = from + part.len();
            let b = if b.is_empty() { &[][..] } else { &b[from..to] };
            self.run_fastest(&a[from..to], b, part);
        });
        out
    }
}

/// `row[i] = e^(row[i] − max(row))`, in place; returns the max and their sum (the softmax's
/// divisor).
#[inline(always)]
pub(super) fn exp_shifted_by_max(row: &mut [f32]) -> (f32, f32) {
    const LANES: usize = 16;
    let mut maxes = [f32::NEG_INFINITY; LANES];
    let chunks = row.chunks_exact(LANES);
    let tail = chunks.remainder().iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    for c in chunks {
        for l in 0..LANES {
            maxes[l] = maxes[l].max(c[l]);
        }
    }
    let max = maxes.iter().fold(tail, |m, &x| m.max(x));
    let mut sums = [0f32; LANES];
    let mut chunks = row.chunks_exact_mut(LANES);
    for c in &mut chunks {
        for l in 0..LANES {
            c[l] = exp(c[l] - max);
            sums[l] += c[l];
        }
    }
    let mut sum = 0f32;
    for x in chunks.into_remainder() {
        *x = exp(*x - max);
        sum += *x;
    }
    (max, sums.iter().sum::<f32>() + sum)
}

/// `ln Σ e^x` over `row` (a logits row's normaliser: a token's log-probability is its logit minus
/// this), the exponentials summed in f32 per 1024 and those sums in f64: a 150k-token vocabulary
/// in a fraction of the time libm's f64 exponential took once per logit per token.
pub(crate) fn log_sum_exp(row: &[f32]) -> f32 {
    fastest!(avx2_fma => log_sum_exp_avx2(row), _ => log_sum_exp_portable(row))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn log_sum_exp_avx2(row: &[f32]) -> f32 {
    log_sum_exp_portable(row)
}

#[inline(always)]
fn log_sum_exp_portable(row: &[f32]) -> f32 {
    const LANES: usize = 16;
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut total = 0f64;
    for block in row.chunks(64 * LANES) {
        let mut sums = [0f32; LANES];
        let chunks = block.chunks_exact(LANES);
        let tail: f32 = chunks.remainder().iter().map(|&x| exp(x - max)).sum();
        for c in chunks {
            for l in 0..LANES {
                sums[l] += exp(c[l] - max);
            }
        }
        total += (sums.iter().sum::<f32>() + tail) as f64;
    }
    total.ln() as f32 + max
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Over the range softmax and the activations use, within 2 ulp of libm (relative 2.4e−7),
    /// and the clamped ends.
    #[test]
    fn exp_is_within_two_ulp_of_libm() {
        let mut worst = 0f64;
        for i in 0..=2_000_000 {
            let x = -87.0 + 175.0 * i as f32 / 2_000_000.0;
            let want = (x as f64).exp();
            worst = worst.max(((exp(x) as f64 - want) / want).abs());
        }
        assert!(worst < 2.4e-7, "worst relative error {worst:e}");
        assert!(exp(f32::NEG_INFINITY) < 2e-38 && exp(-1000.0) > 0.0);
        assert!(exp(f32::INFINITY).is_finite() && exp(f32::INFINITY) > 1e38);
        assert_eq!(exp(0.0), 1.0);
    }

    /// Each step against its textbook formula in f64, through the pool and the tails of chunks.
    #[test]
    fn activations_match_their_formulas() {
        let a: Vec<f32> = (0..70_001).map(|i| (i as f32 * 0.37).sin() * 12.0).collect();
        let b: Vec<f32> = (0..70_001).map(|i| (i as f32 * 0.11).cos()).collect();
        let sigmoid = |z: f64| 1.0 / (1.0 + (-z).exp());
        let gelu = |x: f64| 0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh());
        type Formula = Box<dyn Fn(f64, f64) -> f64>;
        let cases: [(Elementwise, Formula); 4] = [
            (Elementwise::Silu, Box::new(move |x, _| x * sigmoid(x))),
            (Elementwise::GeluTanh, Box::new(move |x, _| gelu(x))),
            (Elementwise::QuickGelu, Box::new(move |x, _| x * sigmoid(1.702 * x))),
            (Elementwise::SiluTimes, Box::new(move |x, y| x * sigmoid(x) * y)),
        ];
        for (op, formula) in cases {
            let got = op.apply(&a, &b);
            assert_eq!(got.len(), a.len());
            for i in 0..a.len() {
                let want = formula(a[i] as f64, b[i] as f64);
                let err = (got[i] as f64 - want).abs();
                assert!(
                    err <= 1e-6 * want.abs().max(1.0),
                    "{op:?} at {}: {} vs {want}",
                    a[i],
                    got[i]
                );
            }
        }
    }

    #[test]
    fn softmax_sum_and_values() {
        let mut row: Vec<f32> = (0..37).map(|i| i as f32 * 0.5 - 3.0).collect();
        let orig = row.clone();
        let (got_max, sum) = exp_shifted_by_max(&mut row);
        let max = orig.iter().cloned().fold(f32::MIN, f32::max);
        assert_eq!(got_max, max);
        let want: f64 = orig.iter().map(|&x| ((x - max) as f64).exp()).sum();
        assert!(((sum as f64) - want).abs() < 1e-5 * want);
        for (x, o) in row.iter().zip(&orig) {
            assert!((x - (o - max).exp()).abs() < 1e-6);
        }
    }

    #[test]
    fn log_sum_exp_of_a_vocabulary_row_is_f64_s() {
        // A head's row: 151,936 logits (not a multiple of 16), one far above the rest.
        let mut row: Vec<f32> = (0..151_936u32)
            .map(|i| ((i.wrapping_mul(2_654_435_761) >> 8) % 2000) as f32 / 100.0 - 10.0)
            .collect();
        row[77] = 40.0;
        for row in [&row[..], &row[..1000], &row[..7], &[f32::NEG_INFINITY, 3.0][..]] {
            let max = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
            let want = row.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln() + max;
            let got = log_sum_exp(row) as f64;
            assert!((got - want).abs() < 1e-5 * want.abs().max(1.0), "{got} against {want}");
        }
    }
}
