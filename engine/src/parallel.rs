//! Work split over candle's thread pool (the one its own kernels use, so ours never compete with
//! them for the cores).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// Runs `f(i, piece)` for each `len`-long piece `i` of `out` (the last may be shorter), the pieces
/// shared out over the pool's threads.
pub(crate) fn for_each_piece<T: Send>(out: &mut [T], len: usize, f: impl Fn(usize, &mut [T]) + Sync) {
    let len = len.max(1);
    let ends: Vec<usize> = (1..=out.len().div_ceil(len))
        .map(|i| (i * len).min(out.len()))
        .collect();
    for_each_part(out, &ends, f);
}

/// `f(range)` for each `len`-long range of `0..n` (the last may be shorter), the ranges shared
/// out over the pool's threads; the results in order.
pub(crate) fn map_ranges<T: Send>(n: usize, len: usize, f: impl Fn(std::ops::Range<usize>) -> T + Sync) -> Vec<T> {
    let len = len.max(1);
    let mut out: Vec<Option<T>> = (0..n.div_ceil(len)).map(|_| None).collect();
    for_each_piece(&mut out, 1, |i, slot| {
        slot[0] = Some(f(i * len..((i + 1) * len).min(n)))
    });
    out.into_iter().flatten().collect()
}

/// Runs `f(i, part)` for each part `i` of `out` that ends before `ends[i]` (ascending, the last
/// `out.len()`), the parts shared out over the pool's threads.
pub(crate) fn for_each_part<T: Send>(out: &mut [T], ends: &[usize], f: impl Fn(usize, &mut [T]) + Sync) {
    let mut parts: Vec<Mutex<&mut [T]>> = Vec::with_capacity(ends.len());
    let (mut rest, mut start) = (out, 0);
    for &end in ends {
        let (part, tail) = std::mem::take(&mut rest).split_at_mut(end - start);
        parts.push(Mutex::new(part));
        (rest, start) = (tail, end);
    }
    let run = |i: usize| {
        let mut part = parts[i].lock().unwrap_or_else(|e| e.into_inner());
        f(i, &mut part);
    };
    if IN_POOL.get() || parts.len() < 2 {
        // Called from inside a task (the pool's lock is held): run here.
        (0..parts.len()).for_each(run);
        return;
    }
    // One part per grab: the callers size their parts, and the pool's own chunking (eight grabs
    // per thread) would join the small last parts a caller made to even out the threads' ends.
    let cursor = AtomicUsize::new(0);
    candle_core::utils::barrier_pool().execute(|_| {
        IN_POOL.set(true);
        loop {
            let i = cursor.fetch_add(1, Ordering::Relaxed);
            if i >= parts.len() {
                break;
            }
            run(i);
        }
        IN_POOL.set(false);
    });
}

thread_local! {
    /// Whether this thread is running a task of [`for_each_part`].
    static IN_POOL: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_map_in_order() {
        assert_eq!(map_ranges(10, 4, |r| (r.start, r.end)), [(0, 4), (4, 8), (8, 10)]);
        assert!(map_ranges(0, 4, |r| r.len()).is_empty());
    }

    #[test]
    fn every_piece_once_with_its_index() {
        let mut v = vec![0usize; 1001];
        for_each_piece(&mut v, 100, |i, piece| piece.iter_mut().for_each(|x| *x += i + 1));
        assert!(v.iter().enumerate().all(|(j, &x)| x == j / 100 + 1));
        for_each_piece(&mut [] as &mut [u8], 0, |_, _| unreachable!());
    }

    #[test]
    fn a_task_may_share_out_parts_of_its_own() {
        let mut v = vec![0usize; 64];
        for_each_piece(&mut v, 16, |i, piece| {
            for_each_piece(piece, 4, |j, inner| inner.iter_mut().for_each(|x| *x = 10 * i + j))
        });
        assert!(v.iter().enumerate().all(|(k, &x)| x == 10 * (k / 16) + (k % 16) / 4));
    }

    #[test]
    fn parts_end_where_asked() {
        let mut v = vec![0usize; 10];
        for_each_part(&mut v, &[3, 3, 9, 10], |i, part| part.iter_mut().for_each(|x| *x = i));
        assert_eq!(v, [0, 0, 0, 2, 2, 2, 2, 2, 2, 3]);
    }
}
