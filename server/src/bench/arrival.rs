//! The arrival process of `vllm bench serve` (`get_request`): gaps drawn from
//! `Gamma(shape = burstiness, scale = 1 / (rate × burstiness))` (burstiness 1 is a Poisson process),
//! summed, and the whole schedule rescaled so that the last arrival is exactly `N / rate`.

use anyhow::{ensure, Result};
use rand::rngs::StdRng;
use rand_distr::{Distribution, Gamma};

/// Send times in seconds after the benchmark's start, one per request, non-decreasing. An infinite
/// rate sends everything at once.
pub fn schedule(num_requests: usize, rate: f64, burstiness: f64, rng: &mut StdRng) -> Result<Vec<f64>> {
    ensure!(rate > 0.0, "--request-rate must be positive, got {rate}");
    ensure!(
        burstiness > 0.0 && burstiness.is_finite(),
        "--burstiness must be a positive number, got {burstiness}"
    );
    if rate.is_infinite() {
        return Ok(vec![0.0; num_requests]);
    }
    let gamma = Gamma::new(burstiness, 1.0 / (rate * burstiness))?;
    let mut total = 0.0;
    let mut delays: Vec<f64> = (0..num_requests)
        .map(|_| {
            total += gamma.sample(rng);
            total
        })
        .collect();
    if total > 0.0 {
        // vLLM closes the 1–2 % gap between the summed draws and N / rate, so throughput figures
        // from different seeds compare.
        let factor = num_requests as f64 / rate / total;
        delays.iter_mut().for_each(|d| *d *= factor);
    }
    Ok(delays)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn draw(n: usize, rate: f64, burstiness: f64, seed: u64) -> Vec<f64> {
        schedule(n, rate, burstiness, &mut StdRng::seed_from_u64(seed)).unwrap()
    }

    #[test]
    fn last_arrival_is_n_over_rate() {
        for (n, rate, b) in [(24, 8.0, 1.0), (100, 2.5, 0.5), (7, 100.0, 4.0), (1, 3.0, 1.0)] {
            let d = draw(n, rate, b, 0);
            assert_eq!(d.len(), n);
            assert!(
                (d[n - 1] - n as f64 / rate).abs() < 1e-9,
                "{n} {rate} {b}: {}",
                d[n - 1]
            );
            assert!(d.windows(2).all(|w| w[0] <= w[1]));
            assert!(d[0] > 0.0, "the first request waits for its own gap, as in vLLM");
        }
    }

    #[test]
    fn seeded_and_reproducible() {
        assert_eq!(draw(50, 8.0, 1.0, 7), draw(50, 8.0, 1.0, 7));
        assert_ne!(draw(50, 8.0, 1.0, 7), draw(50, 8.0, 1.0, 8));
    }

    #[test]
    fn infinite_rate_sends_at_once() {
        assert_eq!(draw(5, f64::INFINITY, 1.0, 0), vec![0.0; 5]);
    }

    #[test]
    fn burstiness_shapes_the_gaps() {
        // Coefficient of variation of Gamma(k) gaps is 1/sqrt(k): bursty traffic (k < 1) has more
        // uneven gaps than a Poisson process, k > 1 more even ones.
        let cv = |b: f64| {
            let d = draw(4000, 10.0, b, 1);
            let gaps: Vec<f64> = std::iter::once(d[0]).chain(d.windows(2).map(|w| w[1] - w[0])).collect();
            let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
            let var = gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / gaps.len() as f64;
            var.sqrt() / mean
        };
        let (bursty, poisson, even) = (cv(0.25), cv(1.0), cv(4.0));
        assert!((poisson - 1.0).abs() < 0.1, "{poisson}");
        assert!((bursty - 2.0).abs() < 0.25, "{bursty}");
        assert!((even - 0.5).abs() < 0.1, "{even}");
    }

    #[test]
    fn rejects_bad_rates() {
        let mut rng = StdRng::seed_from_u64(0);
        assert!(schedule(3, 0.0, 1.0, &mut rng).is_err());
        assert!(schedule(3, 1.0, 0.0, &mut rng).is_err());
    }
}
