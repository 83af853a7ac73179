//! Work split over candle's thread pool (the one its own kernels use, so ours never compete with
//! them for the cores).

use std::sync::Mutex;

/// Runs `f(i, piece)` for each `len`-long piece `i` of `out` (the last may be shorter), the pieces
/// shared out over the pool's threads.
pub(crate) fn for_each_piece<T: Send>(out: &mut [T], len: usize, f: impl Fn(usize, &mut [T]) + Sync) {
    let pieces: Vec<Mutex<&mut [T]>> = out.chunks_mut(len.max(1)).map(Mutex::new).collect();
    candle_core::utils::barrier_pool().execute_chunked(pieces.len(), |range| {
        for i in range {
            let mut piece = pieces[i].lock().unwrap_or_else(|e| e.into_inner());
            f(i, &mut piece);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_piece_once_with_its_index() {
        let mut v = vec![0usize; 1001];
        for_each_piece(&mut v, 100, |i, piece| piece.iter_mut().for_each(|x| *x += i + 1));
        assert!(v.iter().enumerate().all(|(j, &x)| x == j / 100 + 1));
        for_each_piece(&mut [] as &mut [u8], 0, |_, _| unreachable!());
    }
}
