//! What the CPU kernels' ignored benches share.

/// `pass(i)` for each of `n` variants, alternated (this machine's speed drifts by the minute),
/// `times` times: each one's median of `amount` per second.
pub(super) fn alternated_medians(n: usize, times: usize, amount: f64, mut pass: impl FnMut(usize)) -> Vec<f64> {
    let mut rates = vec![vec![]; n];
    for _ in 0..times {
        for (i, rates) in rates.iter_mut().enumerate() {
            let start = std::time::Instant::now();
            pass(i);
            rates.push(amount / start.elapsed().as_secs_f64());
        }
    }
    rates
        .into_iter()
        .map(|mut r| {
            r.sort_by(f64::total_cmp);
            r[times / 2]
        })
        .collect()
}
