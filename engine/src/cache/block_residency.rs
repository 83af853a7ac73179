//! How long KV blocks stay, for a sample of them (vLLM `KVCacheMetricsCollector`,
//! `--kv-cache-metrics`): a block drawn at allocation is followed until its hash is evicted, which
//! yields its lifetime (allocation to eviction), its idle time before eviction (last prefix-cache
//! hit, or allocation, to eviction) and the gaps between its last four hits.

use std::collections::{HashMap, VecDeque};

use super::block_pool::BlockId;

/// Hits remembered per block (vLLM's ring buffer of 4).
const ACCESSES: usize = 4;

/// One followed block's eviction, in seconds.
#[derive(Clone, Debug, PartialEq)]
pub struct BlockEviction {
    /// From allocation to eviction.
    pub lifetime: f64,
    /// From the last hit (or the allocation) to eviction.
    pub idle: f64,
    /// Gaps between consecutive remembered hits.
    pub reuse_gaps: Vec<f64>,
}

#[derive(Clone, Debug)]
struct Followed {
    born: f64,
    accesses: VecDeque<f64>,
}

/// The sampler and the blocks it follows. The clock is the caller's (seconds, monotonic), so the
/// engine stays free of a time source on targets without one.
#[derive(Clone, Debug)]
pub struct BlockResidency {
    sample_rate: f64,
    clock: fn() -> f64,
    rng: u64,
    followed: HashMap<BlockId, Followed>,
    evictions: Vec<BlockEviction>,
}

impl BlockResidency {
    /// Follows each allocated block with probability `sample_rate` (in (0, 1]).
    pub fn new(sample_rate: f64, clock: fn() -> f64) -> Self {
        Self {
            sample_rate,
            clock,
            rng: 0x9E37_79B9_7F4A_7C15,
            followed: HashMap::new(),
            evictions: Vec::new(),
        }
    }

    /// A uniform draw in [0, 1) (xorshift64*; the sample need not be cryptographic).
    fn draw(&mut self) -> f64 {
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        (self.rng.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
    }

    /// `block` was handed out.
    pub(super) fn allocated(&mut self, block: BlockId) {
        if self.draw() < self.sample_rate {
            let born = (self.clock)();
            self.followed.insert(
                block,
                Followed {
                    born,
                    accesses: VecDeque::new(),
                },
            );
        } else {
            self.followed.remove(&block);
        }
    }

    /// `block` was hit by a prefix-cache lookup.
    pub(super) fn accessed(&mut self, block: BlockId) {
        if let Some(f) = self.followed.get_mut(&block) {
            if f.accesses.len() == ACCESSES {
                f.accesses.pop_front();
            }
            f.accesses.push_back((self.clock)());
        }
    }

    /// `block`'s hash was evicted.
    pub(super) fn evicted(&mut self, block: BlockId) {
        if let Some(f) = self.followed.remove(&block) {
            let now = (self.clock)();
            let last = f.accesses.back().copied().unwrap_or(f.born);
            self.evictions.push(BlockEviction {
                lifetime: now - f.born,
                idle: now - last,
                reuse_gaps: f
                    .accesses
                    .iter()
                    .zip(f.accesses.iter().skip(1))
                    .map(|(a, b)| b - a)
                    .collect(),
            });
        }
    }

    /// Forgets every followed block (the prefix cache was reset).
    pub(super) fn clear(&mut self) {
        self.followed.clear();
    }

    /// The evictions since the last call.
    pub fn take_evictions(&mut self) -> Vec<BlockEviction> {
        std::mem::take(&mut self.evictions)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    thread_local! {
        static NOW: Cell<f64> = const { Cell::new(0.0) };
    }

    fn now() -> f64 {
        NOW.with(Cell::get)
    }

    fn at(t: f64) {
        NOW.with(|c| c.set(t));
    }

    #[test]
    fn lifetime_idle_and_the_last_four_gaps() {
        let mut r = BlockResidency::new(1.0, now);
        at(1.0);
        r.allocated(3);
        for t in [2.0, 4.0, 7.0, 11.0, 16.0] {
            at(t);
            r.accessed(3);
        }
        at(20.0);
        r.evicted(3);
        r.evicted(3); // no longer followed
        assert_eq!(
            r.take_evictions(),
            vec![BlockEviction {
                lifetime: 19.0,
                idle: 4.0,
                reuse_gaps: vec![3.0, 4.0, 5.0],
            }]
        );
        assert!(r.take_evictions().is_empty());
    }

    #[test]
    fn the_sample_rate_is_kept() {
        let mut r = BlockResidency::new(0.25, now);
        for b in 0..4000 {
            r.allocated(b);
        }
        let n = r.followed.len();
        assert!((800..1200).contains(&n), "{n} of 4000 followed at 0.25");
        // A block never hit is idle for its whole life.
        at(5.0);
        let b = *r.followed.keys().next().unwrap();
        r.evicted(b);
        let e = &r.take_evictions()[0];
        assert_eq!(e.lifetime, e.idle);
        assert!(e.reuse_gaps.is_empty());
    }
}
