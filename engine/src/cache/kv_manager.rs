//! `KvCacheManager`: per-request block tables over a [`BlockPool`] with prefix caching
//! (vLLM `vllm/v1/core/kv_cache_manager.py`, full attention, one KV cache group).
//!
//! The caller (the scheduler) owns each request's token ids and block hashes (see
//! [`super::block_hash`]) and knows how many tokens of it are computed; this manager keeps the block
//! tables, reference counts and prefix-cache statistics.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::block_hash::BlockHash;
use super::block_pool::{BlockId, BlockPool, NULL_BLOCK};
use super::block_residency::{BlockEviction, BlockResidency};
use super::kv_events::{BlockKeys, KvCacheEvent};
use super::{CacheError, RequestId};

/// Result of a prefix-cache lookup: the hit blocks (in prefix order) and the tokens they cover.
/// Only [`KvCacheManager::get_computed_blocks`] produces hits; [`ComputedBlocks::default`] is "none".
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ComputedBlocks {
    blocks: Vec<BlockId>,
    num_tokens: usize,
}

impl ComputedBlocks {
    /// The hit blocks, leading blocks of the request first.
    pub fn blocks(&self) -> &[BlockId] {
        &self.blocks
    }

    /// Tokens covered by the hit (`blocks().len() × block_size`).
    pub fn num_tokens(&self) -> usize {
        self.num_tokens
    }

    /// Whether the lookup found nothing.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }
}

/// Prefix-cache counters (vLLM `PrefixCacheStats`): lookups, tokens looked up, tokens hit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefixCacheStats {
    /// The prefix cache was reset since these counters started.
    pub reset: bool,
    /// Number of lookups (`get_computed_blocks` calls with caching on).
    pub requests: u64,
    /// Tokens looked up (the whole prompt of each lookup).
    pub queries: u64,
    /// Tokens found in the cache.
    pub hits: u64,
}

impl PrefixCacheStats {
    /// `hits / queries`, 0 when nothing was queried.
    pub fn hit_rate(&self) -> f64 {
        if self.queries == 0 {
            0.0
        } else {
            self.hits as f64 / self.queries as f64
        }
    }
}

/// State of one block as shown to a UI.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KvBlockState {
    /// Block 0, the placeholder that never holds data.
    Null,
    /// In the free queue without a hash.
    Free,
    /// In the free queue with a hash: reusable by a prefix hit until it is reallocated.
    CachedFree,
    /// Referenced by at least one request.
    InUse,
}

/// One block in a [`KvSnapshot`].
#[cfg(test)]
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct KvBlockSnapshot {
    /// Block id.
    pub id: BlockId,
    /// Free / cached-free / in use / null.
    pub state: KvBlockState,
    /// Reference count.
    pub ref_cnt: u32,
    /// Requests whose block table holds this block, sorted.
    pub owners: Vec<RequestId>,
    /// Whether the block carries a hash (is in the prefix cache).
    pub has_hash: bool,
    /// The hash, hex-encoded when serialized.
    pub hash: Option<BlockHash>,
}

/// Every block of the KV cache, for the tests' assertions ([`KvSummary`] is what a UI is sent).
#[cfg(test)]
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct KvSnapshot {
    /// Total blocks, the null block included.
    pub num_blocks: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Whether prefix caching is on.
    pub enable_caching: bool,
    /// Blocks in the free queue (hashed or not).
    pub num_free: usize,
    /// Free blocks that still carry a hash.
    pub num_cached_free: usize,
    /// Referenced blocks.
    pub num_in_use: usize,
    /// `1 − free / (num_blocks − 1)`.
    pub usage: f64,
    /// Requests holding blocks.
    pub num_requests: usize,
    /// Cached blocks evicted by reallocation so far.
    pub num_evictions: u64,
    /// Prefix-cache counters since the last take.
    pub prefix_cache_stats: PrefixCacheStats,
    /// Free queue from next victim to most recently freed.
    pub free_queue: Vec<BlockId>,
    /// Every block, by id.
    pub blocks: Vec<KvBlockSnapshot>,
}

/// A compact picture of the KV cache: counts, block states as runs, and each request's blocks.
/// Cheap enough to send after every engine step.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KvSummary {
    /// Total blocks, the null block included.
    pub num_blocks: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Blocks in the free queue (hashed or not).
    pub num_free: usize,
    /// Free blocks that still carry a hash.
    pub num_cached_free: usize,
    /// Referenced blocks.
    pub num_in_use: usize,
    /// `1 − free / (num_blocks − 1)`.
    pub usage: f64,
    /// Cached blocks evicted by reallocation so far.
    pub num_evictions: u64,
    /// Block states by id as `(state, run length)` pairs.
    pub runs: Vec<(KvBlockState, usize)>,
    /// Each request's block table.
    pub tables: BTreeMap<RequestId, Vec<BlockId>>,
    /// The first 16 hex digits of each hashed block's hash, by block id; empty for caches of
    /// more than [`KvSummary::MAX_HASHED_BLOCKS`] blocks, which a UI draws grouped.
    #[serde(default, deserialize_with = "block_keyed")]
    pub hashes: BTreeMap<BlockId, String>,
}

/// A map by block id read from a JSON object, whose keys are strings: also where serde buffers
/// them before they reach the map (under a `#[serde(flatten)]` parent such as
/// [`crate::occupancy::Occupancy`], which would refuse a string where it wants a number).
fn block_keyed<'de, D: serde::Deserializer<'de>>(d: D) -> Result<BTreeMap<BlockId, String>, D::Error> {
    BTreeMap::<String, String>::deserialize(d)?
        .into_iter()
        .map(|(k, v)| k.parse().map(|k| (k, v)).map_err(serde::de::Error::custom))
        .collect()
}

impl KvSummary {
    /// The largest cache whose block hashes a summary carries (a UI draws one cell per block up
    /// to this size; sending tens of thousands of hashes at every step would cost more than it shows).
    pub const MAX_HASHED_BLOCKS: usize = 2048;
}

/// Blocks held by one request.
#[derive(Clone, Debug, Default)]
struct RequestBlocks {
    blocks: Vec<BlockId>,
    /// Leading blocks already hashed into the prefix cache.
    num_cached_blocks: usize,
}

/// Per-request KV block tables with prefix caching over a [`BlockPool`].
#[derive(Clone, Debug)]
pub struct KvCacheManager {
    pool: BlockPool,
    max_model_len: usize,
    requests: BTreeMap<RequestId, RequestBlocks>,
    stats: PrefixCacheStats,
}

impl KvCacheManager {
    /// Manager over `num_blocks` blocks (null block included) of `block_size` tokens.
    pub fn new(
        num_blocks: usize,
        block_size: usize,
        max_model_len: usize,
        enable_caching: bool,
    ) -> Result<Self, CacheError> {
        if max_model_len == 0 {
            return Err(CacheError::InvalidConfig("max_model_len must be at least 1".into()));
        }
        Ok(Self {
            pool: BlockPool::new(num_blocks, block_size, enable_caching)?,
            max_model_len,
            requests: BTreeMap::new(),
            stats: PrefixCacheStats::default(),
        })
    }

    /// The underlying pool (read-only).
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// Total blocks, the null block included.
    pub fn num_blocks(&self) -> usize {
        self.pool.num_blocks()
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.pool.block_size()
    }

    /// Longest sequence a request may reach; allocations are capped to it.
    pub fn max_model_len(&self) -> usize {
        self.max_model_len
    }

    /// Whether prefix caching is on.
    pub fn enable_caching(&self) -> bool {
        self.pool.enable_caching()
    }

    /// Blocks in the free queue.
    pub fn num_free_blocks(&self) -> usize {
        self.pool.num_free_blocks()
    }

    /// KV cache usage in `[0, 1]` (cached-but-unreferenced blocks count as free).
    pub fn usage(&self) -> f64 {
        self.pool.usage()
    }

    /// Number of requests holding blocks.
    pub fn num_requests(&self) -> usize {
        self.requests.len()
    }

    /// The block table of `req_id` (empty for an unknown request).
    pub fn block_table(&self, req_id: &RequestId) -> &[BlockId] {
        self.requests.get(req_id).map_or(&[], |r| &r.blocks)
    }

    /// Prefix-cache counters since the last [`Self::take_prefix_cache_stats`].
    pub fn prefix_cache_stats(&self) -> PrefixCacheStats {
        self.stats
    }

    /// Returns the counters and starts new ones (vLLM `make_prefix_cache_stats`).
    pub fn take_prefix_cache_stats(&mut self) -> PrefixCacheStats {
        std::mem::take(&mut self.stats)
    }

    /// Longest cached prefix of a request with `num_tokens` tokens and these full-block hashes.
    /// At most `num_tokens − 1` tokens can hit: the last token is always recomputed. Counts one
    /// lookup in the stats; with caching disabled returns nothing and counts nothing.
    pub fn get_computed_blocks(&mut self, block_hashes: &[BlockHash], num_tokens: usize) -> ComputedBlocks {
        if !self.pool.enable_caching() {
            return ComputedBlocks::default();
        }
        let max_blocks = num_tokens.saturating_sub(1) / self.block_size();
        let blocks: Vec<BlockId> = block_hashes
            .iter()
            .take(max_blocks)
            .map_while(|h| self.pool.get_cached_block(h))
            .collect();
        let num_hit = blocks.len() * self.block_size();
        self.stats.requests += 1;
        self.stats.queries += num_tokens as u64;
        self.stats.hits += num_hit as u64;
        ComputedBlocks {
            blocks,
            num_tokens: num_hit,
        }
    }

    /// Reserves blocks so `req_id` can hold `num_computed_tokens + computed.num_tokens() +
    /// num_new_tokens` tokens (capped at `max_model_len`), vLLM `allocate_slots`:
    ///
    /// * `num_computed_tokens`: tokens of the request already computed before this step (0 for a new
    ///   or resumed request);
    /// * `computed`: prefix-cache hits from [`Self::get_computed_blocks`] (new requests only; pass
    ///   `&ComputedBlocks::default()` otherwise);
    /// * `keys`: the request's full-block hashes so far (newly full blocks are cached with them),
    ///   with the tokens and image spans a recorded [`KvCacheEvent::BlockStored`] reports.
    ///
    /// Returns `Ok(Some(new blocks))`, or `Ok(None)` without changing anything when the free queue
    /// is too short (the caller preempts or waits). Hits sitting in the free queue count against it.
    pub fn allocate_slots(
        &mut self,
        req_id: &RequestId,
        num_new_tokens: usize,
        num_computed_tokens: usize,
        computed: &ComputedBlocks,
        keys: &BlockKeys<'_>,
    ) -> Result<Option<Vec<BlockId>>, CacheError> {
        let block_hashes = keys.hashes;
        if num_new_tokens == 0 {
            return Err(CacheError::ZeroNewTokens);
        }
        let existing = self.requests.contains_key(req_id);
        if !computed.is_empty() && existing {
            return Err(CacheError::ComputedBlocksForRunningRequest(req_id.clone()));
        }
        for (position, &block) in computed.blocks.iter().enumerate() {
            let expected = block_hashes.get(position).copied();
            if expected.is_none() || self.pool.block_hash(block) != expected {
                return Err(CacheError::StaleComputedBlock { block, position });
            }
        }

        let bs = self.block_size();
        let num_computed = num_computed_tokens.saturating_add(computed.num_tokens);
        let num_tokens_after = num_computed.saturating_add(num_new_tokens);
        let need_tokens = num_tokens_after.min(self.max_model_len);
        let held = self.block_table(req_id).len();
        let num_new_blocks = need_tokens.div_ceil(bs).saturating_sub(held + computed.blocks.len());
        let num_evictable_hits = computed
            .blocks
            .iter()
            .filter(|&&b| self.pool.ref_cnt(b) == Some(0))
            .count();
        if num_new_blocks + num_evictable_hits > self.pool.num_free_blocks() {
            return Ok(None);
        }

        // Hits first, so the allocation below cannot pop them from the free queue.
        self.pool.touch(&computed.blocks)?;
        let req = self.requests.entry(req_id.clone()).or_default();
        if !existing {
            req.blocks.extend_from_slice(&computed.blocks);
            req.num_cached_blocks = computed.blocks.len();
        }
        let new_blocks = self.pool.get_new_blocks(num_new_blocks)?;
        req.blocks.extend_from_slice(&new_blocks);

        if self.pool.enable_caching() {
            let num_full = (num_tokens_after / bs).min(block_hashes.len()).min(req.blocks.len());
            if num_full > req.num_cached_blocks {
                let range = req.num_cached_blocks..num_full;
                self.pool
                    .cache_full_blocks(&req.blocks[range.clone()], &block_hashes[range.clone()])?;
                req.num_cached_blocks = num_full;
                if self.pool.records_events() {
                    self.pool.record(keys.stored(range.start, range.end, bs));
                }
            }
        }
        Ok(Some(new_blocks))
    }

    /// Releases every block of `req_id` (finish, abort or preemption) in reverse table order, so the
    /// tail of a cached chain is evicted before its prefix. Unknown requests are ignored. Cached
    /// blocks keep their hashes. Errors only if the pool disagrees with the table (a bug).
    pub fn free(&mut self, req_id: &RequestId) -> Result<(), CacheError> {
        if let Some(req) = self.requests.remove(req_id) {
            let mut blocks = req.blocks;
            blocks.reverse();
            self.pool.free_blocks(&blocks)?;
        }
        Ok(())
    }

    /// Starts or stops recording [`KvCacheEvent`]s.
    pub fn record_events(&mut self, on: bool) {
        self.pool.record_events(on);
    }

    /// The events recorded since the last call, oldest first.
    pub fn take_events(&mut self) -> Vec<KvCacheEvent> {
        self.pool.take_events()
    }

    /// Follows a sample of blocks from allocation to eviction (`None` stops).
    pub fn follow_residency(&mut self, residency: Option<BlockResidency>) {
        self.pool.follow_residency(residency);
    }

    /// The followed blocks evicted since the last call.
    pub fn take_evictions(&mut self) -> Vec<BlockEviction> {
        self.pool.take_evictions()
    }

    /// Drops all prefix-cache content; refused with [`CacheError::BlocksInUse`] while any request
    /// holds blocks. Marks the stats as reset.
    pub fn reset_prefix_cache(&mut self) -> Result<(), CacheError> {
        self.pool.reset_prefix_cache()?;
        self.stats.reset = true;
        Ok(())
    }

    /// State of one block.
    fn block_state(&self, id: BlockId) -> KvBlockState {
        if id == NULL_BLOCK {
            KvBlockState::Null
        } else if self.pool.ref_cnt(id).unwrap_or(0) > 0 {
            KvBlockState::InUse
        } else if self.pool.block_hash(id).is_some() {
            KvBlockState::CachedFree
        } else {
            KvBlockState::Free
        }
    }

    /// Counts, run-length block states and block tables (one pass over the blocks).
    pub fn summary(&self) -> KvSummary {
        let mut runs: Vec<(KvBlockState, usize)> = Vec::new();
        let (mut cached_free, mut in_use) = (0, 0);
        let mut hashes = BTreeMap::new();
        let with_hashes = self.num_blocks() <= KvSummary::MAX_HASHED_BLOCKS;
        for id in 0..self.num_blocks() {
            let state = self.block_state(id);
            if let Some(h) = self.pool.block_hash(id).filter(|_| with_hashes) {
                hashes.insert(id, h.to_string()[..16].to_string());
            }
            match state {
                KvBlockState::CachedFree => cached_free += 1,
                KvBlockState::InUse => in_use += 1,
                _ => {}
            }
            match runs.last_mut() {
                Some((s, n)) if *s == state => *n += 1,
                _ => runs.push((state, 1)),
            }
        }
        KvSummary {
            num_blocks: self.num_blocks(),
            block_size: self.block_size(),
            num_free: self.num_free_blocks(),
            num_cached_free: cached_free,
            num_in_use: in_use,
            usage: self.usage(),
            num_evictions: self.pool.num_evictions(),
            runs,
            tables: self
                .requests
                .iter()
                .map(|(id, r)| (id.clone(), r.blocks.clone()))
                .collect(),
            hashes,
        }
    }

    /// Every block, the free queue and the totals.
    #[cfg(test)]
    pub(crate) fn snapshot(&self) -> KvSnapshot {
        let n = self.num_blocks();
        let mut owners: Vec<Vec<RequestId>> = vec![Vec::new(); n];
        for (id, req) in &self.requests {
            for &b in &req.blocks {
                if let Some(o) = owners.get_mut(b) {
                    o.push(id.clone());
                }
            }
        }
        let blocks: Vec<KvBlockSnapshot> = owners
            .into_iter()
            .enumerate()
            .map(|(id, owners)| {
                let hash = self.pool.block_hash(id);
                let ref_cnt = self.pool.ref_cnt(id).unwrap_or(0);
                let state = self.block_state(id);
                KvBlockSnapshot {
                    id,
                    state,
                    ref_cnt,
                    owners,
                    has_hash: hash.is_some(),
                    hash,
                }
            })
            .collect();
        let count = |s: KvBlockState| blocks.iter().filter(|b| b.state == s).count();
        KvSnapshot {
            num_blocks: n,
            block_size: self.block_size(),
            enable_caching: self.enable_caching(),
            num_free: self.num_free_blocks(),
            num_cached_free: count(KvBlockState::CachedFree),
            num_in_use: count(KvBlockState::InUse),
            usage: self.usage(),
            num_requests: self.requests.len(),
            num_evictions: self.pool.num_evictions(),
            prefix_cache_stats: self.stats,
            free_queue: self.pool.free_queue().collect(),
            blocks,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::block_hash::{extend_block_hashes, hash_request_blocks, MmSpan, TokenId};

    fn rid(s: &str) -> RequestId {
        s.into()
    }

    /// The keys of a request whose tokens are all prompt.
    fn keys<'a>(hashes: &'a [BlockHash], tokens: &'a [TokenId], mm: &'a [MmSpan]) -> BlockKeys<'a> {
        BlockKeys {
            hashes,
            tokens: [tokens, &[]],
            spans: mm,
        }
    }

    fn toks(n: usize, seed: u32) -> Vec<TokenId> {
        (0..n as u32).map(|i| i.wrapping_mul(31).wrapping_add(seed)).collect()
    }

    /// Looks up and allocates a whole prompt as one new request; returns the hit.
    fn admit(
        m: &mut KvCacheManager,
        id: &str,
        prompt: &[TokenId],
        mm: &[MmSpan],
    ) -> (ComputedBlocks, Option<Vec<BlockId>>) {
        let hashes = hash_request_blocks(prompt, m.block_size(), mm, None).unwrap();
        let hit = m.get_computed_blocks(&hashes, prompt.len());
        let new = m
            .allocate_slots(
                &rid(id),
                prompt.len() - hit.num_tokens(),
                0,
                &hit,
                &keys(&hashes, prompt, mm),
            )
            .unwrap();
        (hit, new)
    }

    #[test]
    fn second_request_hits_the_shared_prefix() {
        let mut m = KvCacheManager::new(16, 16, 1024, true).unwrap();
        let prompt = toks(40, 1);
        let (hit, new) = admit(&mut m, "a", &prompt, &[]);
        assert!(hit.is_empty());
        assert_eq!(new.unwrap(), vec![1, 2, 3]);
        let (hit, new) = admit(&mut m, "b", &prompt, &[]);
        assert_eq!(hit.blocks(), &[1, 2]);
        assert_eq!(hit.num_tokens(), 32);
        assert_eq!(new.unwrap(), vec![4]);
        assert_eq!(m.block_table(&rid("b")), &[1, 2, 4]);
        assert_eq!(m.pool().ref_cnt(1), Some(2));
        assert_eq!(m.pool().ref_cnt(3), Some(1));
        let s = m.take_prefix_cache_stats();
        assert_eq!((s.requests, s.queries, s.hits), (2, 80, 32));
        assert_eq!(s.hit_rate(), 0.4);
        assert_eq!(m.prefix_cache_stats(), PrefixCacheStats::default());
    }

    #[test]
    fn summary_names_the_hash_of_each_full_block_in_a_small_cache_only() {
        let mut m = KvCacheManager::new(16, 16, 1024, true).unwrap();
        let prompt = toks(40, 1);
        admit(&mut m, "a", &prompt, &[]);
        let hashes = hash_request_blocks(&prompt, 16, &[], None).unwrap();
        let s = m.summary();
        assert_eq!(
            s.hashes.keys().copied().collect::<Vec<_>>(),
            [1, 2],
            "block 3 is not full"
        );
        assert_eq!(s.hashes[&1], hashes[0].to_string()[..16]);
        let mut big = KvCacheManager::new(KvSummary::MAX_HASHED_BLOCKS + 1, 16, 1024, true).unwrap();
        admit(&mut big, "a", &prompt, &[]);
        assert!(big.summary().hashes.is_empty());
        assert_eq!(big.summary().num_in_use, 3);
    }

    /// The playground's worker sends the summary inside a flattened snapshot: its block ids, JSON
    /// object keys, come back as numbers there too.
    #[test]
    fn a_summary_with_hashes_reads_back_from_json_under_a_flattened_parent() {
        #[derive(Serialize, Deserialize)]
        struct Parent {
            #[serde(flatten)]
            child: Child,
        }
        #[derive(Serialize, Deserialize)]
        struct Child {
            kv: KvSummary,
        }
        let mut m = KvCacheManager::new(16, 16, 1024, true).unwrap();
        admit(&mut m, "a", &toks(40, 1), &[]);
        let kv = m.summary();
        assert_eq!(kv.hashes.len(), 2);
        let json = serde_json::to_string(&Parent {
            child: Child { kv: kv.clone() },
        })
        .unwrap();
        let back: Parent = serde_json::from_str(&json).unwrap();
        assert_eq!(back.child.kv, kv);
    }

    #[test]
    fn image_hash_matters() {
        let mut m = KvCacheManager::new(32, 16, 1024, true).unwrap();
        let prompt = toks(50, 2);
        let img = |h: &str| {
            [MmSpan {
                hash: h.into(),
                offset: 20,
                length: 10,
            }]
        };
        admit(&mut m, "a", &prompt, &img("cat"));
        // Same tokens, different image inside block 1: block 0 hits, block 1 does not.
        let (hit, _) = admit(&mut m, "b", &prompt, &img("dog"));
        assert_eq!(hit.num_tokens(), 16);
        // Same image: blocks 0..3 hit (49 / 16 = 3).
        let (hit, _) = admit(&mut m, "c", &prompt, &img("cat"));
        assert_eq!(hit.num_tokens(), 48);
        // Image in block 0 changes every block through the chain.
        let early = [MmSpan {
            hash: "dog".into(),
            offset: 0,
            length: 4,
        }];
        let (hit, _) = admit(&mut m, "d", &prompt, &early);
        assert!(hit.is_empty());
    }

    #[test]
    fn last_token_is_always_recomputed() {
        let mut m = KvCacheManager::new(16, 16, 1024, true).unwrap();
        let prompt = toks(32, 3);
        admit(&mut m, "a", &prompt, &[]);
        let (hit, new) = admit(&mut m, "b", &prompt, &[]);
        assert_eq!(hit.num_tokens(), 16, "32 tokens: at most 31 may hit, so 1 block");
        assert_eq!(new.unwrap().len(), 1);
        let mut longer = prompt.clone();
        longer.push(7);
        let (hit, _) = admit(&mut m, "c", &longer, &[]);
        assert_eq!(hit.num_tokens(), 32);
    }

    #[test]
    fn freed_blocks_stay_cached_until_reallocated() {
        let mut m = KvCacheManager::new(6, 16, 1024, true).unwrap();
        let prompt = toks(33, 4);
        admit(&mut m, "a", &prompt, &[]);
        m.free(&rid("a")).unwrap();
        assert_eq!(m.num_free_blocks(), 5);
        assert_eq!(m.usage(), 0.0);
        assert_eq!(m.snapshot().num_cached_free, 2);
        // Reusable while free; the hit blocks count against the free queue.
        let (hit, _) = admit(&mut m, "b", &prompt, &[]);
        assert_eq!(hit.num_tokens(), 32);
        m.free(&rid("b")).unwrap();
        // Fill the pool with other content: the cached blocks are popped and lazily evicted.
        let (_, new) = admit(&mut m, "c", &toks(80, 99), &[]);
        assert_eq!(new.unwrap().len(), 5);
        assert!(m.pool().num_evictions() >= 2);
        m.free(&rid("c")).unwrap();
        let (hit, _) = admit(&mut m, "d", &prompt, &[]);
        assert!(hit.is_empty());
    }

    #[test]
    fn reverse_free_evicts_the_chain_tail_first() {
        let mut m = KvCacheManager::new(6, 16, 1024, true).unwrap();
        let prompt = toks(49, 5); // 3 full blocks + 1 token: blocks 1..=4
        admit(&mut m, "a", &prompt, &[]);
        m.free(&rid("a")).unwrap();
        // Untouched block 5 first, then a's blocks tail-first.
        assert_eq!(m.pool().free_queue().collect::<Vec<_>>(), vec![5, 4, 3, 2, 1]);
        // Two new blocks take 5 and 4 (4 had no hash); one more takes 3, the last full block.
        let (_, new) = admit(&mut m, "x", &toks(40, 77), &[]);
        assert_eq!(new.unwrap(), vec![5, 4, 3]);
        let (hit, _) = admit(&mut m, "b", &prompt, &[]);
        assert_eq!(hit.blocks(), &[1, 2], "prefix survives, tail evicted");
    }

    #[test]
    fn reset_prefix_cache_refuses_while_in_use() {
        let mut m = KvCacheManager::new(8, 16, 1024, true).unwrap();
        let prompt = toks(40, 6);
        admit(&mut m, "a", &prompt, &[]);
        let err = m.reset_prefix_cache().unwrap_err();
        assert_eq!(err, CacheError::BlocksInUse { in_use: 3 });
        assert!(!m.prefix_cache_stats().reset);
        m.free(&rid("a")).unwrap();
        m.reset_prefix_cache().unwrap();
        assert!(m.prefix_cache_stats().reset);
        let (hit, _) = admit(&mut m, "b", &prompt, &[]);
        assert!(hit.is_empty());
    }

    #[test]
    fn block_size_128() {
        let mut m = KvCacheManager::new(10, 128, 4096, true).unwrap();
        let prompt = toks(300, 7);
        let (_, new) = admit(&mut m, "a", &prompt, &[]);
        assert_eq!(new.unwrap().len(), 3);
        let (hit, new) = admit(&mut m, "b", &prompt, &[]);
        assert_eq!(hit.num_tokens(), 256);
        assert_eq!(new.unwrap().len(), 1);
        assert_eq!(m.usage(), 4.0 / 9.0);
    }

    #[test]
    fn not_enough_blocks_changes_nothing() {
        let mut m = KvCacheManager::new(4, 16, 1024, true).unwrap();
        let prompt = toks(40, 8);
        admit(&mut m, "a", &prompt, &[]);
        m.free(&rid("a")).unwrap();
        admit(&mut m, "x", &toks(10, 50), &[]); // takes block 3, a's unhashed tail
        let before = m.snapshot();
        // b hits 2 free cached blocks and needs 1 more: 3 > 2 free.
        let hashes = hash_request_blocks(&prompt, 16, &[], None).unwrap();
        let hit = m.get_computed_blocks(&hashes, prompt.len());
        assert_eq!(hit.num_tokens(), 32);
        let got = m
            .allocate_slots(&rid("b"), 8, 0, &hit, &keys(&hashes, &prompt, &[]))
            .unwrap();
        assert_eq!(got, None);
        let after = m.snapshot();
        assert_eq!(before.blocks, after.blocks);
        assert_eq!(before.free_queue, after.free_queue);
        assert_eq!(m.block_table(&rid("b")), &[] as &[BlockId]);
    }

    #[test]
    fn decode_fills_and_caches_blocks() {
        let mut m = KvCacheManager::new(16, 16, 1024, true).unwrap();
        let mut tokens = toks(20, 9);
        let id = rid("a");
        let mut hashes = hash_request_blocks(&tokens, 16, &[], None).unwrap();
        let hit = m.get_computed_blocks(&hashes, tokens.len());
        m.allocate_slots(&id, 20, 0, &hit, &keys(&hashes, &tokens, &[]))
            .unwrap()
            .unwrap();
        for t in 0..13u32 {
            let computed = tokens.len();
            tokens.push(1000 + t);
            extend_block_hashes(&mut hashes, &tokens, 16, &[], None).unwrap();
            m.allocate_slots(
                &id,
                1,
                computed,
                &ComputedBlocks::default(),
                &keys(&hashes, &tokens, &[]),
            )
            .unwrap()
            .unwrap();
        }
        // 33 tokens computed: 3 blocks, 2 full and cached.
        assert_eq!(m.block_table(&id).len(), 3);
        assert!(m.pool().block_hash(m.block_table(&id)[1]).is_some());
        assert!(m.pool().block_hash(m.block_table(&id)[2]).is_none());
        // A follow-up turn that starts with the whole conversation hits both blocks.
        let mut next = tokens.clone();
        next.extend([5, 6, 7]);
        let (hit, _) = admit(&mut m, "b", &next, &[]);
        assert_eq!(hit.num_tokens(), 32);
    }

    #[test]
    fn misuse_is_reported() {
        let mut m = KvCacheManager::new(8, 16, 1024, true).unwrap();
        let prompt = toks(40, 10);
        let hashes = hash_request_blocks(&prompt, 16, &[], None).unwrap();
        let none = ComputedBlocks::default();
        assert_eq!(
            m.allocate_slots(&rid("a"), 0, 0, &none, &keys(&hashes, &prompt, &[])),
            Err(CacheError::ZeroNewTokens)
        );
        admit(&mut m, "a", &prompt, &[]);
        let hit = m.get_computed_blocks(&hashes, 40);
        assert!(matches!(
            m.allocate_slots(&rid("a"), 1, 40, &hit, &keys(&hashes, &prompt, &[])),
            Err(CacheError::ComputedBlocksForRunningRequest(_))
        ));
        // A hit that went stale (evicted between lookup and allocation) is refused.
        m.free(&rid("a")).unwrap();
        let hit = m.get_computed_blocks(&hashes, 40);
        assert_eq!(hit.num_tokens(), 32);
        admit(&mut m, "x", &toks(112, 11), &[]); // takes all 7 blocks, evicting a's
        m.free(&rid("x")).unwrap();
        assert!(matches!(
            m.allocate_slots(&rid("b"), 8, 0, &hit, &keys(&hashes, &prompt, &[])),
            Err(CacheError::StaleComputedBlock { position: 0, .. })
        ));
        assert!(KvCacheManager::new(8, 16, 0, true).is_err());
        assert!(KvCacheManager::new(1, 16, 10, true).is_err());
    }

    #[test]
    fn caching_disabled() {
        let mut m = KvCacheManager::new(8, 16, 1024, false).unwrap();
        let prompt = toks(40, 12);
        admit(&mut m, "a", &prompt, &[]);
        let (hit, _) = admit(&mut m, "b", &prompt, &[]);
        assert!(hit.is_empty());
        assert_eq!(m.prefix_cache_stats().requests, 0);
        assert!(m.snapshot().blocks.iter().all(|b| !b.has_hash));
    }

    #[test]
    fn max_model_len_caps_allocation() {
        let mut m = KvCacheManager::new(16, 16, 40, true).unwrap();
        let none = ComputedBlocks::default();
        let got = m
            .allocate_slots(&rid("a"), 100, 0, &none, &keys(&[], &[], &[]))
            .unwrap()
            .unwrap();
        assert_eq!(got.len(), 3);
    }

    #[test]
    fn snapshot_shows_states_and_owners() {
        let mut m = KvCacheManager::new(6, 16, 1024, true).unwrap();
        let prompt = toks(20, 13);
        admit(&mut m, "a", &prompt, &[]);
        admit(&mut m, "b", &prompt, &[]);
        admit(&mut m, "c", &toks(17, 14), &[]);
        m.free(&rid("c")).unwrap();
        let s = m.snapshot();
        assert_eq!(s.blocks[0].state, KvBlockState::Null);
        assert_eq!(s.blocks[1].state, KvBlockState::InUse);
        assert_eq!(s.blocks[1].owners, vec![rid("a"), rid("b")]);
        assert_eq!(s.blocks[1].ref_cnt, 2);
        assert!(s.blocks[1].has_hash);
        assert_eq!(s.blocks[3].owners, vec![rid("b")]);
        // c's first block was full (hashed) so it stays cached-free; its partial block is plain free.
        assert_eq!(s.blocks[4].state, KvBlockState::CachedFree);
        assert_eq!(s.blocks[5].state, KvBlockState::Free);
        assert_eq!((s.num_free, s.num_cached_free, s.num_in_use), (2, 1, 3));
        assert_eq!(s.free_queue, vec![5, 4]);
        let json = serde_json::to_value(&s).unwrap();
        assert_eq!(json["blocks"][4]["state"], "cached_free");
        assert_eq!(json["blocks"][1]["hash"].as_str().map(str::len), Some(64));
    }

    mod proptests {
        use super::*;
        use proptest::prelude::*;

        #[derive(Clone, Debug)]
        enum Op {
            New {
                prefix: usize,
                tail: Vec<TokenId>,
                image: Option<u8>,
                chunk: usize,
            },
            Step {
                idx: usize,
                chunk: usize,
                token: TokenId,
            },
            Free {
                idx: usize,
            },
            Reset,
        }

        fn op() -> impl Strategy<Value = Op> {
            prop_oneof![
                4 => (0..3usize, prop::collection::vec(0..3u32, 0..20), prop::option::of(0..2u8), 1..64usize)
                    .prop_map(|(prefix, tail, image, chunk)| Op::New { prefix, tail, image, chunk }),
                6 => (any::<usize>(), 1..32usize, 0..3u32)
                    .prop_map(|(idx, chunk, token)| Op::Step { idx, chunk, token }),
                2 => any::<usize>().prop_map(|idx| Op::Free { idx }),
                1 => Just(Op::Reset),
            ]
        }

        struct Live {
            id: RequestId,
            tokens: Vec<TokenId>,
            mm: Vec<MmSpan>,
            hashes: Vec<BlockHash>,
            num_computed: usize,
        }

        const PREFIXES: [usize; 3] = [9, 24, 41];

        /// Applies events as a subscriber would; a removal of a hash not resident is an error.
        fn apply_events(
            resident: &mut BTreeMap<u64, usize>,
            events: Vec<KvCacheEvent>,
            bs: usize,
        ) -> Result<(), TestCaseError> {
            for e in events {
                match e {
                    KvCacheEvent::BlockStored {
                        block_hashes,
                        token_ids,
                        extra_keys,
                        block_size,
                        ..
                    } => {
                        prop_assert_eq!(block_size, bs);
                        prop_assert_eq!(token_ids.len(), block_hashes.len() * bs);
                        prop_assert_eq!(extra_keys.len(), block_hashes.len());
                        for h in block_hashes {
                            *resident.entry(h).or_default() += 1;
                        }
                    }
                    KvCacheEvent::BlockRemoved { block_hashes } => {
                        for h in block_hashes {
                            let n = resident.get_mut(&h).filter(|n| **n > 0);
                            prop_assert!(n.is_some(), "removed {:016x}, never stored", h);
                            let n = n.unwrap();
                            *n -= 1;
                            if *n == 0 {
                                resident.remove(&h);
                            }
                        }
                    }
                    KvCacheEvent::AllBlocksCleared => resident.clear(),
                }
            }
            Ok(())
        }

        fn check(m: &KvCacheManager, live: &[Live]) -> Result<(), TestCaseError> {
            let pool = m.pool();
            pool.check_invariants().map_err(TestCaseError::fail)?;
            prop_assert_eq!(m.num_requests(), live.len());
            let n = m.num_blocks();
            let mut in_use = 0;
            for b in 1..n {
                let holders = live.iter().filter(|r| m.block_table(&r.id).contains(&b)).count();
                let rc = pool.ref_cnt(b).unwrap_or(u32::MAX) as usize;
                prop_assert_eq!(rc, holders, "ref count of block {}", b);
                prop_assert!(!(pool.is_free(b) && rc > 0), "block {} free and referenced", b);
                prop_assert_eq!(pool.is_free(b), rc == 0);
                in_use += usize::from(rc > 0);
            }
            prop_assert_eq!(pool.num_free_blocks() + in_use, n - 1);
            prop_assert_eq!(pool.free_queue().count(), pool.num_free_blocks());
            let bs = m.block_size();
            for r in live {
                let table = m.block_table(&r.id);
                prop_assert_eq!(table.len(), r.num_computed.min(m.max_model_len()).div_ceil(bs));
                prop_assert!(table.iter().all(|&b| b != NULL_BLOCK));
                let must_be_cached = if m.enable_caching() {
                    (r.num_computed / bs).min(r.hashes.len())
                } else {
                    0
                };
                for (i, &b) in table.iter().enumerate() {
                    match pool.block_hash(b) {
                        Some(h) => {
                            prop_assert_eq!(Some(&h), r.hashes.get(i), "block {} at {} has a foreign hash", b, i)
                        }
                        None => prop_assert!(i >= must_be_cached, "full block {} at {} not cached", b, i),
                    }
                }
            }
            let u = m.usage();
            prop_assert!((0.0..=1.0).contains(&u));
            Ok(())
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]
            #[test]
            fn kv_manager_invariants(
                bs in prop::sample::select(vec![4usize, 16]),
                num_blocks in 4usize..40,
                caching in prop::bool::weighted(0.85),
                ops in prop::collection::vec(op(), 1..70),
            ) {
                let max_len = 256;
                let mut m = KvCacheManager::new(num_blocks, bs, max_len, caching).unwrap();
                m.record_events(true);
                // The cached blocks as a subscriber to the events sees them: hash -> copies.
                let mut resident: BTreeMap<u64, usize> = BTreeMap::new();
                let prefixes: Vec<Vec<TokenId>> =
                    PREFIXES.iter().enumerate().map(|(i, &n)| toks(n, 100 * i as u32)).collect();
                let mut live: Vec<Live> = Vec::new();
                let mut next_id = 0;
                let mut total_hits = 0u64;
                for op in ops {
                    match op {
                        Op::New { prefix, tail, image, chunk } => {
                            let mut tokens = prefixes[prefix].clone();
                            tokens.extend(tail);
                            let mm: Vec<MmSpan> = image
                                .map(|i| MmSpan { hash: format!("img{i}").into(), offset: 2, length: 6 })
                                .into_iter()
                                .collect();
                            let hashes = hash_request_blocks(&tokens, bs, &mm, None).unwrap();
                            let hit = m.get_computed_blocks(&hashes, tokens.len());
                            prop_assert!(hit.num_tokens() < tokens.len());
                            prop_assert_eq!(hit.num_tokens(), hit.blocks().len() * bs);
                            for (i, &b) in hit.blocks().iter().enumerate() {
                                prop_assert_eq!(m.pool().block_hash(b), Some(hashes[i]));
                            }
                            total_hits += hit.num_tokens() as u64;
                            let id: RequestId = format!("r{next_id}").into();
                            next_id += 1;
                            let num_new = (tokens.len() - hit.num_tokens()).min(chunk);
                            let free_before = m.num_free_blocks();
                            match m.allocate_slots(&id, num_new, 0, &hit, &keys(&hashes, &tokens, &mm)).unwrap() {
                                Some(_) => live.push(Live {
                                    id, tokens, mm, hashes, num_computed: hit.num_tokens() + num_new,
                                }),
                                None => {
                                    prop_assert_eq!(m.num_free_blocks(), free_before);
                                    prop_assert!(m.block_table(&id).is_empty());
                                }
                            }
                        }
                        Op::Step { idx, chunk, token } => {
                            if live.is_empty() { continue; }
                            let i = idx % live.len();
                            let r = &mut live[i];
                            if r.num_computed == r.tokens.len() {
                                if r.tokens.len() >= max_len { continue; }
                                r.tokens.push(token); // the sampled token
                                extend_block_hashes(&mut r.hashes, &r.tokens, bs, &r.mm, None).unwrap();
                            }
                            let num_new = (r.tokens.len() - r.num_computed).min(chunk);
                            let res = m.allocate_slots(&r.id, num_new, r.num_computed, &ComputedBlocks::default(), &keys(&r.hashes, &r.tokens, &r.mm)).unwrap();
                            match res {
                                Some(_) => r.num_computed += num_new,
                                None => {
                                    // Preempt: free everything, drop the request.
                                    m.free(&r.id).unwrap();
                                    live.remove(i);
                                }
                            }
                        }
                        Op::Free { idx } => {
                            if live.is_empty() { continue; }
                            let r = live.remove(idx % live.len());
                            m.free(&r.id).unwrap();
                            prop_assert!(m.block_table(&r.id).is_empty());
                        }
                        Op::Reset => {
                            let idle = m.num_free_blocks() == m.num_blocks() - 1;
                            let res = m.reset_prefix_cache();
                            prop_assert_eq!(res.is_ok(), idle);
                            prop_assert_eq!(idle, live.is_empty());
                            if idle {
                                prop_assert!(m.snapshot().blocks.iter().all(|b| !b.has_hash));
                            }
                        }
                    }
                    check(&m, &live)?;
                    apply_events(&mut resident, m.take_events(), bs)?;
                    let mut cached: BTreeMap<u64, usize> = BTreeMap::new();
                    for b in 0..m.num_blocks() {
                        if let Some(h) = m.pool().block_hash(b) {
                            *cached.entry(h.external()).or_default() += 1;
                        }
                    }
                    prop_assert_eq!(&resident, &cached, "the events' resident set is the cached blocks");
                }
                prop_assert!(m.prefix_cache_stats().hits <= m.prefix_cache_stats().queries);
                if !m.prefix_cache_stats().reset {
                    prop_assert_eq!(m.prefix_cache_stats().hits, total_hits);
                }
                for r in live.drain(..) {
                    m.free(&r.id).unwrap();
                }
                check(&m, &live)?;
                prop_assert_eq!(m.usage(), 0.0);
                prop_assert_eq!(m.num_free_blocks(), num_blocks - 1);
            }
        }
    }
}
