//! `BlockPool`: fixed KV blocks, reference counts, LRU free queue and the hash → block map of the
//! prefix cache (vLLM `vllm/v1/core/block_pool.py`).
//!
//! Block 0 is the null block: never handed out, freed, cached or queued. Free blocks sit in a
//! doubly linked LRU queue (head = next to allocate = eviction victim). A freed block keeps its hash
//! ("cached free") and can be reused by a prefix hit until `get_new_blocks` pops it and lazily drops
//! the hash.

use std::collections::HashMap;

use super::block_hash::BlockHash;
use super::block_residency::{BlockEviction, BlockResidency};
use super::kv_events::KvCacheEvent;
use super::CacheError;

/// Index of a KV block in the pool.
pub type BlockId = usize;

/// The null block: a placeholder id that never holds data.
pub const NULL_BLOCK: BlockId = 0;

/// "No neighbour" marker of the free queue links.
const NIL: usize = usize::MAX;

/// Intrusive doubly linked list over block ids, stored as index arrays: O(1) push_back, pop_front and
/// removal from the middle.
#[derive(Clone, Debug)]
struct FreeBlockQueue {
    prev: Vec<usize>,
    next: Vec<usize>,
    queued: Vec<bool>,
    head: usize,
    tail: usize,
    len: usize,
}

impl FreeBlockQueue {
    /// Queue holding blocks `1..num_blocks` in id order.
    fn new(num_blocks: usize) -> Self {
        let mut q = Self {
            prev: vec![NIL; num_blocks],
            next: vec![NIL; num_blocks],
            queued: vec![false; num_blocks],
            head: NIL,
            tail: NIL,
            len: 0,
        };
        for id in 1..num_blocks {
            q.push_back(id);
        }
        q
    }

    fn contains(&self, id: BlockId) -> bool {
        self.queued.get(id).copied().unwrap_or(false)
    }

    fn push_back(&mut self, id: BlockId) {
        self.prev[id] = self.tail;
        self.next[id] = NIL;
        if self.tail == NIL {
            self.head = id;
        } else {
            self.next[self.tail] = id;
        }
        self.tail = id;
        self.queued[id] = true;
        self.len += 1;
    }

    /// Unlinks `id`; returns false (and changes nothing) if it is not queued.
    fn remove(&mut self, id: BlockId) -> bool {
        if !self.contains(id) {
            return false;
        }
        let (p, n) = (self.prev[id], self.next[id]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n] = p;
        }
        self.prev[id] = NIL;
        self.next[id] = NIL;
        self.queued[id] = false;
        self.len -= 1;
        true
    }

    fn pop_front(&mut self) -> Option<BlockId> {
        let id = self.head;
        (id != NIL && self.remove(id)).then_some(id)
    }
}

/// Iterator over the free queue from head (next eviction victim) to tail (most recently freed).
#[derive(Clone, Debug)]
pub struct FreeQueueIter<'a> {
    queue: &'a FreeBlockQueue,
    cur: usize,
    left: usize,
}

impl Iterator for FreeQueueIter<'_> {
    type Item = BlockId;

    fn next(&mut self) -> Option<BlockId> {
        if self.cur == NIL || self.left == 0 {
            return None;
        }
        let id = self.cur;
        self.cur = self.queue.next[id];
        self.left -= 1;
        Some(id)
    }
}

/// Fixed set of KV blocks with reference counts, an LRU free queue and the prefix-cache hash map.
#[derive(Clone, Debug)]
pub struct BlockPool {
    block_size: usize,
    enable_caching: bool,
    ref_cnt: Vec<u32>,
    block_hash: Vec<Option<BlockHash>>,
    free_queue: FreeBlockQueue,
    cached_block_hash_to_block: HashMap<BlockHash, Vec<BlockId>>,
    num_evictions: u64,
    /// Events since the last [`Self::take_events`], while recording (vLLM `kv_event_queue`).
    events: Option<Vec<KvCacheEvent>>,
    /// The sampled blocks' residency, when followed (vLLM `--kv-cache-metrics`).
    residency: Option<BlockResidency>,
}

impl BlockPool {
    /// Pool of `num_blocks` blocks (block 0 is the null block, so at least 2) of `block_size` tokens.
    pub fn new(num_blocks: usize, block_size: usize, enable_caching: bool) -> Result<Self, CacheError> {
        if num_blocks < 2 {
            return Err(CacheError::InvalidConfig(format!(
                "num_blocks is {num_blocks}; need at least 2 (the null block and one usable block)"
            )));
        }
        if block_size == 0 {
            return Err(CacheError::InvalidConfig("block_size must be at least 1".into()));
        }
        Ok(Self {
            block_size,
            enable_caching,
            ref_cnt: vec![0; num_blocks],
            block_hash: vec![None; num_blocks],
            free_queue: FreeBlockQueue::new(num_blocks),
            cached_block_hash_to_block: HashMap::new(),
            num_evictions: 0,
            events: None,
            residency: None,
        })
    }

    /// Follows a sample of blocks from allocation to eviction (`None` stops).
    pub fn follow_residency(&mut self, residency: Option<BlockResidency>) {
        self.residency = residency;
    }

    /// The followed blocks evicted since the last call.
    pub fn take_evictions(&mut self) -> Vec<BlockEviction> {
        self.residency
            .as_mut()
            .map(BlockResidency::take_evictions)
            .unwrap_or_default()
    }

    /// Starts or stops recording [`KvCacheEvent`]s (stopping drops those not taken).
    pub fn record_events(&mut self, on: bool) {
        self.events = on.then(Vec::new);
    }

    /// Whether events are being recorded.
    pub fn records_events(&self) -> bool {
        self.events.is_some()
    }

    /// The events recorded since the last call, oldest first.
    pub fn take_events(&mut self) -> Vec<KvCacheEvent> {
        self.events.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Records `event` when recording.
    pub(super) fn record(&mut self, event: KvCacheEvent) {
        if let Some(events) = &mut self.events {
            events.push(event);
        }
    }

    /// Total blocks, the null block included.
    pub fn num_blocks(&self) -> usize {
        self.ref_cnt.len()
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Whether prefix caching is on (blocks get hashes and can be hit).
    pub fn enable_caching(&self) -> bool {
        self.enable_caching
    }

    /// Blocks in the free queue (cached-but-unreferenced blocks count as free).
    pub fn num_free_blocks(&self) -> usize {
        self.free_queue.len
    }

    /// Fraction of usable blocks in use: `1 − free / (num_blocks − 1)` (vLLM `kv_cache_usage`).
    pub fn usage(&self) -> f64 {
        1.0 - self.num_free_blocks() as f64 / (self.num_blocks() - 1) as f64
    }

    /// Reference count of `block`, `None` for an id outside the pool.
    pub fn ref_cnt(&self, block: BlockId) -> Option<u32> {
        self.ref_cnt.get(block).copied()
    }

    /// Hash carried by `block` (set once it was cached as a full block), if any.
    pub fn block_hash(&self, block: BlockId) -> Option<BlockHash> {
        self.block_hash.get(block).copied().flatten()
    }

    /// Whether `block` is in the free queue.
    pub fn is_free(&self, block: BlockId) -> bool {
        self.free_queue.contains(block)
    }

    /// The free queue in eviction order: first = next block handed out, last = most recently freed.
    pub fn free_queue(&self) -> FreeQueueIter<'_> {
        FreeQueueIter {
            queue: &self.free_queue,
            cur: self.free_queue.head,
            left: self.free_queue.len,
        }
    }

    /// Number of cached blocks whose hash was dropped because the block was reallocated.
    pub fn num_evictions(&self) -> u64 {
        self.num_evictions
    }

    /// A block holding `hash` (any one, if several do).
    pub fn get_cached_block(&self, hash: &BlockHash) -> Option<BlockId> {
        self.cached_block_hash_to_block
            .get(hash)
            .and_then(|ids| ids.first().copied())
    }

    /// Pops `n` blocks from the head of the free queue, drops the hash of each popped cached block
    /// (lazy eviction) and gives each a reference count of 1.
    pub fn get_new_blocks(&mut self, n: usize) -> Result<Vec<BlockId>, CacheError> {
        if n > self.num_free_blocks() {
            return Err(CacheError::NotEnoughFreeBlocks {
                requested: n,
                free: self.num_free_blocks(),
            });
        }
        let out: Vec<BlockId> = std::iter::from_fn(|| self.free_queue.pop_front()).take(n).collect();
        for &id in &out {
            self.evict_hash(id);
            self.ref_cnt[id] = 1;
            if let Some(r) = &mut self.residency {
                r.allocated(id);
            }
        }
        Ok(out)
    }

    /// Drops the hash of `id` from the block and the map; counts an eviction if it had one.
    fn evict_hash(&mut self, id: BlockId) {
        let Some(hash) = self.block_hash[id].take() else { return };
        if let Some(ids) = self.cached_block_hash_to_block.get_mut(&hash) {
            ids.retain(|&b| b != id);
            if ids.is_empty() {
                self.cached_block_hash_to_block.remove(&hash);
            }
        }
        self.num_evictions += 1;
        if let Some(r) = &mut self.residency {
            r.evicted(id);
        }
        self.record(KvCacheEvent::BlockRemoved {
            block_hashes: vec![hash.external()],
        });
    }

    /// Checks that `block` is a real, non-null block.
    fn check_usable(&self, block: BlockId) -> Result<(), CacheError> {
        if block == NULL_BLOCK {
            return Err(CacheError::InvalidBlock {
                block,
                reason: "the null block cannot be used",
            });
        }
        if block >= self.num_blocks() {
            return Err(CacheError::InvalidBlock {
                block,
                reason: "block id outside the pool",
            });
        }
        Ok(())
    }

    /// Takes a reference on each block (prefix-cache hits): a block at reference 0 leaves the free
    /// queue. Validates every id before changing anything.
    pub fn touch(&mut self, blocks: &[BlockId]) -> Result<(), CacheError> {
        blocks.iter().try_for_each(|&b| self.check_usable(b))?;
        for &b in blocks {
            if self.ref_cnt[b] == 0 {
                self.free_queue.remove(b);
            }
            self.ref_cnt[b] += 1;
            if let Some(r) = &mut self.residency {
                r.accessed(b);
            }
        }
        Ok(())
    }

    /// Drops one reference per listed block; blocks reaching 0 are appended to the tail of the free
    /// queue in the given order (pass a request's blocks reversed so its tail is evicted first).
    /// Validates every id (and that no count would go below 0) before changing anything.
    pub fn free_blocks(&mut self, ordered: &[BlockId]) -> Result<(), CacheError> {
        let mut drops: HashMap<BlockId, u32> = HashMap::new();
        for &b in ordered {
            self.check_usable(b)?;
            let d = drops.entry(b).or_insert(0);
            *d += 1;
            if *d > self.ref_cnt[b] {
                return Err(CacheError::InvalidBlock {
                    block: b,
                    reason: "freed more often than referenced",
                });
            }
        }
        for &b in ordered {
            self.ref_cnt[b] -= 1;
            if self.ref_cnt[b] == 0 {
                self.free_queue.push_back(b);
            }
        }
        Ok(())
    }

    /// Marks newly full blocks as cached: `blocks[i]` gets `hashes[i]` and joins the hash map (one
    /// hash may map to several blocks). No-op when caching is disabled. Validates before changing
    /// anything: equal lengths, blocks referenced and not yet hashed.
    pub fn cache_full_blocks(&mut self, blocks: &[BlockId], hashes: &[BlockHash]) -> Result<(), CacheError> {
        if !self.enable_caching {
            return Ok(());
        }
        if blocks.len() != hashes.len() {
            return Err(CacheError::BlockHashCountMismatch {
                blocks: blocks.len(),
                hashes: hashes.len(),
            });
        }
        for &b in blocks {
            self.check_usable(b)?;
            if self.ref_cnt[b] == 0 {
                return Err(CacheError::InvalidBlock {
                    block: b,
                    reason: "only referenced blocks can be cached",
                });
            }
            if self.block_hash[b].is_some() {
                return Err(CacheError::InvalidBlock {
                    block: b,
                    reason: "block already carries a hash",
                });
            }
        }
        for (&b, &h) in blocks.iter().zip(hashes) {
            self.block_hash[b] = Some(h);
            let ids = self.cached_block_hash_to_block.entry(h).or_default();
            if !ids.contains(&b) {
                ids.push(b);
            }
        }
        Ok(())
    }

    /// Drops every hash (all prefix-cache content). Refused while any block besides the null block is
    /// referenced. Frees no memory: the blocks were already free.
    pub fn reset_prefix_cache(&mut self) -> Result<(), CacheError> {
        let in_use = self.num_blocks() - 1 - self.num_free_blocks();
        if in_use > 0 {
            return Err(CacheError::BlocksInUse { in_use });
        }
        self.cached_block_hash_to_block.clear();
        self.block_hash.iter_mut().for_each(|h| *h = None);
        if let Some(r) = &mut self.residency {
            r.clear();
        }
        self.record(KvCacheEvent::AllBlocksCleared);
        Ok(())
    }

    /// Structural invariants, for tests: queue links, queue ⇔ ref 0, hash map ⇔ block hashes.
    #[cfg(test)]
    pub(crate) fn check_invariants(&self) -> Result<(), String> {
        let n = self.num_blocks();
        if self.ref_cnt[NULL_BLOCK] != 0
            || self.free_queue.contains(NULL_BLOCK)
            || self.block_hash[NULL_BLOCK].is_some()
        {
            return Err("null block was referenced, queued or hashed".into());
        }
        // Walk forward with a bound (detects cycles), check back links.
        let mut seen = vec![false; n];
        let (mut cur, mut prev, mut count) = (self.free_queue.head, NIL, 0);
        while cur != NIL {
            if count > n || seen[cur] {
                return Err(format!("free queue revisits block {cur}"));
            }
            if self.free_queue.prev[cur] != prev {
                return Err(format!("bad prev link at block {cur}"));
            }
            seen[cur] = true;
            count += 1;
            prev = cur;
            cur = self.free_queue.next[cur];
        }
        if prev != self.free_queue.tail || count != self.free_queue.len {
            return Err(format!(
                "queue tail/len mismatch: walked {count}, len {}",
                self.free_queue.len
            ));
        }
        for (b, (&rc, &walked)) in self.ref_cnt.iter().zip(&seen).enumerate().skip(1) {
            let free = rc == 0;
            if walked != free || self.free_queue.queued[b] != free {
                return Err(format!("block {b}: ref {rc} but queued {walked}"));
            }
            if let Some(h) = self.block_hash[b] {
                if !self
                    .cached_block_hash_to_block
                    .get(&h)
                    .is_some_and(|ids| ids.contains(&b))
                {
                    return Err(format!("block {b} has a hash missing from the map"));
                }
            }
        }
        for (h, ids) in &self.cached_block_hash_to_block {
            if ids.is_empty()
                || ids
                    .iter()
                    .any(|&b| self.block_hash.get(b).copied().flatten() != Some(*h))
            {
                return Err("hash map entry disagrees with block hashes".into());
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(x: u8) -> BlockHash {
        BlockHash([x; 32])
    }

    fn queue(p: &BlockPool) -> Vec<BlockId> {
        p.free_queue().collect()
    }

    #[test]
    fn construction_and_null_block() {
        assert!(BlockPool::new(1, 16, true).is_err());
        assert!(BlockPool::new(8, 0, true).is_err());
        let mut p = BlockPool::new(5, 16, true).unwrap();
        assert_eq!(queue(&p), vec![1, 2, 3, 4]);
        assert_eq!(p.num_free_blocks(), 4);
        assert_eq!(p.usage(), 0.0);
        assert!(p.touch(&[NULL_BLOCK]).is_err());
        assert!(p.free_blocks(&[NULL_BLOCK]).is_err());
        assert!(p.touch(&[5]).is_err());
        assert_eq!(p.get_new_blocks(4).unwrap(), vec![1, 2, 3, 4]);
        assert_eq!(p.usage(), 1.0);
        assert_eq!(
            p.get_new_blocks(1),
            Err(CacheError::NotEnoughFreeBlocks { requested: 1, free: 0 })
        );
        p.check_invariants().unwrap();
    }

    #[test]
    fn free_appends_in_given_order_and_rejects_double_free() {
        let mut p = BlockPool::new(6, 16, true).unwrap();
        let b = p.get_new_blocks(3).unwrap();
        assert_eq!(queue(&p), vec![4, 5]);
        let rev: Vec<_> = b.iter().rev().copied().collect();
        p.free_blocks(&rev).unwrap();
        assert_eq!(queue(&p), vec![4, 5, 3, 2, 1]);
        // Atomic validation: nothing changes when one entry is bad.
        let c = p.get_new_blocks(1).unwrap();
        assert_eq!(
            p.free_blocks(&[c[0], c[0]]).unwrap_err(),
            CacheError::InvalidBlock {
                block: c[0],
                reason: "freed more often than referenced"
            }
        );
        assert_eq!(p.ref_cnt(c[0]), Some(1));
        p.check_invariants().unwrap();
    }

    #[test]
    fn cached_free_block_is_hit_then_lazily_evicted() {
        let mut p = BlockPool::new(4, 16, true).unwrap();
        let b = p.get_new_blocks(2).unwrap();
        p.cache_full_blocks(&b, &[h(1), h(2)]).unwrap();
        assert!(
            p.cache_full_blocks(&b[..1], &[h(9)]).is_err(),
            "re-hashing must be refused"
        );
        p.free_blocks(&[b[1], b[0]]).unwrap();
        assert_eq!(queue(&p), vec![3, 2, 1]);
        // Still cached while free.
        assert_eq!(p.get_cached_block(&h(1)), Some(1));
        // A hit takes it out of the middle of the queue.
        p.touch(&[1]).unwrap();
        assert_eq!(queue(&p), vec![3, 2]);
        assert_eq!(p.ref_cnt(1), Some(1));
        // Allocating pops 3 (no hash) then 2 (hash dropped lazily, eviction counted).
        assert_eq!(p.get_new_blocks(2).unwrap(), vec![3, 2]);
        assert_eq!(p.get_cached_block(&h(2)), None);
        assert_eq!(p.block_hash(2), None);
        assert_eq!(p.num_evictions(), 1);
        assert_eq!(p.get_cached_block(&h(1)), Some(1));
        p.check_invariants().unwrap();
    }

    #[test]
    fn one_hash_several_blocks() {
        let mut p = BlockPool::new(4, 16, true).unwrap();
        let a = p.get_new_blocks(1).unwrap();
        let b = p.get_new_blocks(1).unwrap();
        p.cache_full_blocks(&a, &[h(7)]).unwrap();
        p.cache_full_blocks(&b, &[h(7)]).unwrap();
        p.free_blocks(&a).unwrap();
        p.free_blocks(&b).unwrap();
        // Queue: 3, 1, 2. Popping 3 and 1 evicts one copy; block 2 still answers the hash.
        p.get_new_blocks(2).unwrap();
        assert_eq!(p.get_cached_block(&h(7)), Some(2));
        p.check_invariants().unwrap();
    }

    #[test]
    fn reset_prefix_cache_refuses_while_in_use() {
        let mut p = BlockPool::new(4, 128, true).unwrap();
        let b = p.get_new_blocks(2).unwrap();
        p.cache_full_blocks(&b, &[h(1), h(2)]).unwrap();
        let err = p.reset_prefix_cache().unwrap_err();
        assert_eq!(err, CacheError::BlocksInUse { in_use: 2 });
        assert!(err.to_string().contains("2 KV blocks are still in use"));
        assert_eq!(p.get_cached_block(&h(1)), Some(b[0]));
        p.free_blocks(&b).unwrap();
        p.reset_prefix_cache().unwrap();
        assert_eq!(p.get_cached_block(&h(1)), None);
        assert_eq!(p.block_hash(b[0]), None);
        assert_eq!(p.num_free_blocks(), 3);
        p.check_invariants().unwrap();
    }

    #[test]
    fn caching_disabled_never_hashes() {
        let mut p = BlockPool::new(4, 16, false).unwrap();
        let b = p.get_new_blocks(1).unwrap();
        p.cache_full_blocks(&b, &[h(1)]).unwrap();
        assert_eq!(p.get_cached_block(&h(1)), None);
        assert_eq!(p.block_hash(b[0]), None);
    }
}
