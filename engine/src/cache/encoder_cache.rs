//! `EncoderCacheManager`: scheduler-side bookkeeping of vision-encoder outputs
//! (vLLM `vllm/v1/core/encoder_cache_manager.py`).
//!
//! Capacity is counted in encoder tokens (placeholder positions). An entry stays after its last
//! request releases it ("freeable") and can be hit again; it is evicted lazily, oldest-freeable first,
//! only when [`EncoderCacheManager::can_allocate`] needs room. Evicted hashes are queued for the model
//! side, which drops its tensors when it receives [`EncoderCacheManager::get_freed_mm_hashes`].

use std::collections::{BTreeMap, BTreeSet, HashMap};

use serde::{Deserialize, Serialize};

use super::{CacheError, MmHash, RequestId};

/// Insertion-ordered set of hashes (oldest first) with O(log n) removal from the middle.
#[derive(Clone, Debug, Default)]
struct FifoSet {
    order: BTreeMap<u64, MmHash>,
    seq_of: HashMap<MmHash, u64>,
    next_seq: u64,
}

impl FifoSet {
    fn push_back(&mut self, hash: MmHash) {
        if self.seq_of.contains_key(&hash) {
            return;
        }
        self.order.insert(self.next_seq, hash.clone());
        self.seq_of.insert(hash, self.next_seq);
        self.next_seq += 1;
    }

    fn remove(&mut self, hash: &MmHash) -> bool {
        match self.seq_of.remove(hash) {
            Some(seq) => self.order.remove(&seq).is_some(),
            None => false,
        }
    }

    fn pop_front(&mut self) -> Option<MmHash> {
        let (_, hash) = self.order.pop_first()?;
        self.seq_of.remove(&hash);
        Some(hash)
    }

    fn contains(&self, hash: &MmHash) -> bool {
        self.seq_of.contains_key(hash)
    }
}

/// One cached encoder output.
#[derive(Clone, Debug)]
struct Entry {
    num_tokens: usize,
    refs: BTreeSet<RequestId>,
    /// Creation order, for stable snapshots.
    created: u64,
}

/// Counters of an [`EncoderCacheManager`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EncoderCacheStats {
    /// `check_and_update_cache` calls.
    pub queries: u64,
    /// Of which found the entry.
    pub hits: u64,
    /// Entries evicted by `can_allocate`.
    pub evictions: u64,
    /// Encoder tokens those evictions released.
    pub evicted_tokens: u64,
}

/// What [`EncoderCacheManager::reset`] dropped.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct EncoderCacheReset {
    /// Entries dropped (all unreferenced ones).
    pub num_entries: usize,
    /// Encoder tokens they held.
    pub num_tokens: usize,
    /// Device bytes they held (`num_tokens × bytes_per_token`).
    pub num_bytes: u64,
}

/// One entry in an [`EncoderCacheSnapshot`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EncoderCacheEntrySnapshot {
    /// The item's mm hash.
    pub mm_hash: MmHash,
    /// Encoder tokens (placeholder length).
    pub num_tokens: usize,
    /// Device bytes of the output.
    pub bytes: u64,
    /// Requests referencing it, sorted.
    pub refs: Vec<RequestId>,
    /// Unreferenced: kept for reuse, evictable.
    pub freeable: bool,
}

/// Serializable picture of the encoder cache for a UI.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EncoderCacheSnapshot {
    /// Capacity in encoder tokens.
    pub capacity_tokens: usize,
    /// Tokens held by entries, referenced or not (`capacity − num_free_slots`).
    pub used_tokens: usize,
    /// Tokens held by referenced entries (`capacity − num_freeable_slots`).
    pub referenced_tokens: usize,
    /// Tokens held by unreferenced entries, reclaimable on demand.
    pub freeable_tokens: usize,
    /// vLLM `num_free_slots`.
    pub num_free_slots: usize,
    /// vLLM `num_freeable_slots`.
    pub num_freeable_slots: usize,
    /// Device bytes per encoder token.
    pub bytes_per_token: u64,
    /// `capacity_tokens × bytes_per_token`.
    pub capacity_bytes: u64,
    /// `used_tokens × bytes_per_token`.
    pub used_bytes: u64,
    /// Evicted hashes not yet collected by `get_freed_mm_hashes`.
    pub pending_freed: Vec<MmHash>,
    /// Counters.
    pub stats: EncoderCacheStats,
    /// Entries in creation order.
    pub entries: Vec<EncoderCacheEntrySnapshot>,
}

/// Encoder-output cache bookkeeping with lazy FIFO eviction of unreferenced entries.
///
/// Invariant: `num_free_slots ≤ num_freeable_slots ≤ cache_size`.
#[derive(Clone, Debug)]
pub struct EncoderCacheManager {
    cache_size: usize,
    num_free_slots: usize,
    num_freeable_slots: usize,
    cached: HashMap<MmHash, Entry>,
    freeable: FifoSet,
    freed: Vec<MmHash>,
    /// Hashes each request references, in the order it first referenced them.
    request_inputs: HashMap<RequestId, Vec<MmHash>>,
    bytes_per_token: u64,
    next_created: u64,
    stats: EncoderCacheStats,
}

impl EncoderCacheManager {
    /// Empty cache of `cache_size` encoder tokens (0 = no multimodal input can be cached).
    pub fn new(cache_size: usize) -> Self {
        Self {
            cache_size,
            num_free_slots: cache_size,
            num_freeable_slots: cache_size,
            cached: HashMap::new(),
            freeable: FifoSet::default(),
            freed: Vec::new(),
            request_inputs: HashMap::new(),
            bytes_per_token: 0,
            next_created: 0,
            stats: EncoderCacheStats::default(),
        }
    }

    /// Sets the device bytes per encoder token (output dim × dtype bytes), used for byte figures.
    pub fn set_bytes_per_token(&mut self, bytes_per_token: u64) {
        self.bytes_per_token = bytes_per_token;
    }

    /// Device bytes per encoder token.
    pub fn bytes_per_token(&self) -> u64 {
        self.bytes_per_token
    }

    /// Capacity in encoder tokens.
    pub fn cache_size(&self) -> usize {
        self.cache_size
    }

    /// Capacity not held by any entry.
    pub fn num_free_slots(&self) -> usize {
        self.num_free_slots
    }

    /// Free capacity plus capacity held by unreferenced entries.
    pub fn num_freeable_slots(&self) -> usize {
        self.num_freeable_slots
    }

    /// Entries present (referenced or not).
    pub fn num_entries(&self) -> usize {
        self.cached.len()
    }

    /// Whether `mm_hash` is present, referenced or not (vLLM `get_cached_input_ids` membership).
    pub fn is_cached(&self, mm_hash: &MmHash) -> bool {
        self.cached.contains_key(mm_hash)
    }

    /// Counters.
    pub fn stats(&self) -> EncoderCacheStats {
        self.stats
    }

    fn bytes(&self, tokens: usize) -> u64 {
        (tokens as u64).saturating_mul(self.bytes_per_token)
    }

    fn add_ref(&mut self, req: &RequestId, mm_hash: &MmHash) {
        if let Some(entry) = self.cached.get_mut(mm_hash) {
            entry.refs.insert(req.clone());
            let inputs = self.request_inputs.entry(req.clone()).or_default();
            if !inputs.contains(mm_hash) {
                inputs.push(mm_hash.clone());
            }
        }
    }

    /// If `mm_hash` is cached, makes `req` reference it (resurrecting an unreferenced entry from the
    /// freeable queue) and returns true. Never changes `num_free_slots`.
    pub fn check_and_update_cache(&mut self, req: &RequestId, mm_hash: &MmHash) -> bool {
        self.stats.queries += 1;
        let Some(entry) = self.cached.get(mm_hash) else {
            return false;
        };
        if entry.refs.is_empty() {
            let tokens = entry.num_tokens;
            self.freeable.remove(mm_hash);
            self.num_freeable_slots -= tokens;
        }
        self.add_ref(req, mm_hash);
        self.stats.hits += 1;
        true
    }

    /// Whether an item of `num_tokens` fits this step, given the per-step `compute_budget` and the
    /// tokens already scheduled for the same request this step. Evicts the oldest unreferenced
    /// entries (moving their hashes to the freed list) when that makes it fit.
    pub fn can_allocate(
        &mut self,
        num_tokens: usize,
        compute_budget: usize,
        num_tokens_already_scheduled: usize,
    ) -> bool {
        if num_tokens > compute_budget {
            return false;
        }
        let need = num_tokens.saturating_add(num_tokens_already_scheduled);
        if need <= self.num_free_slots {
            return true;
        }
        if need > self.num_freeable_slots {
            return false;
        }
        while need > self.num_free_slots {
            let Some(hash) = self.freeable.pop_front() else {
                return false;
            };
            if let Some(entry) = self.cached.remove(&hash) {
                self.num_free_slots += entry.num_tokens;
                self.stats.evictions += 1;
                self.stats.evicted_tokens += entry.num_tokens as u64;
                self.freed.push(hash);
            }
        }
        true
    }

    /// Adds a new entry of `num_tokens` referenced by `req` (call after `can_allocate` said yes and
    /// `check_and_update_cache` missed).
    pub fn allocate(&mut self, req: &RequestId, mm_hash: &MmHash, num_tokens: usize) -> Result<(), CacheError> {
        if self.cached.contains_key(mm_hash) {
            return Err(CacheError::EncoderEntryExists(mm_hash.clone()));
        }
        if num_tokens > self.num_free_slots {
            return Err(CacheError::EncoderCacheFull {
                mm_hash: mm_hash.clone(),
                needed: num_tokens,
                free: self.num_free_slots,
            });
        }
        let entry = Entry {
            num_tokens,
            refs: BTreeSet::new(),
            created: self.next_created,
        };
        self.next_created += 1;
        self.cached.insert(mm_hash.clone(), entry);
        self.add_ref(req, mm_hash);
        self.num_free_slots -= num_tokens;
        self.num_freeable_slots -= num_tokens;
        Ok(())
    }

    /// Drops `req`'s reference to `mm_hash`; an entry left unreferenced joins the back of the
    /// freeable queue (its data stays until evicted).
    fn release(&mut self, req: &RequestId, mm_hash: &MmHash) {
        let Some(entry) = self.cached.get_mut(mm_hash) else {
            return;
        };
        if !entry.refs.remove(req) || !entry.refs.is_empty() {
            return;
        }
        let tokens = entry.num_tokens;
        self.freeable.push_back(mm_hash.clone());
        self.num_freeable_slots += tokens;
    }

    /// `req` no longer needs `mm_hash` (its embeddings are in the KV cache).
    pub fn free_encoder_input(&mut self, req: &RequestId, mm_hash: &MmHash) {
        if let Some(inputs) = self.request_inputs.get_mut(req) {
            inputs.retain(|h| h != mm_hash);
            if inputs.is_empty() {
                self.request_inputs.remove(req);
            }
        }
        self.release(req, mm_hash);
    }

    /// Releases every input `req` references (finish, abort, preemption), in reference order.
    pub fn free(&mut self, req: &RequestId) {
        for hash in self.request_inputs.remove(req).unwrap_or_default() {
            self.release(req, &hash);
        }
    }

    /// Hashes evicted since the last call (the model side drops their tensors); drains the list.
    pub fn get_freed_mm_hashes(&mut self) -> Vec<MmHash> {
        std::mem::take(&mut self.freed)
    }

    /// Drops every unreferenced entry now (oldest first) and queues their hashes on the freed list;
    /// entries referenced by requests stay. Slot counters are recomputed from the remaining entries.
    pub fn reset(&mut self) -> EncoderCacheReset {
        let mut report = EncoderCacheReset::default();
        while let Some(hash) = self.freeable.pop_front() {
            if let Some(entry) = self.cached.remove(&hash) {
                report.num_entries += 1;
                report.num_tokens += entry.num_tokens;
                self.freed.push(hash);
            }
        }
        report.num_bytes = self.bytes(report.num_tokens);
        let used: usize = self.cached.values().map(|e| e.num_tokens).sum();
        self.num_free_slots = self.cache_size.saturating_sub(used);
        self.num_freeable_slots = self.num_free_slots;
        report
    }

    /// Serializable picture of the entries and totals.
    pub fn snapshot(&self) -> EncoderCacheSnapshot {
        let mut entries: Vec<(&MmHash, &Entry)> = self.cached.iter().collect();
        entries.sort_by_key(|(_, e)| e.created);
        let entries = entries
            .into_iter()
            .map(|(hash, e)| EncoderCacheEntrySnapshot {
                mm_hash: hash.clone(),
                num_tokens: e.num_tokens,
                bytes: self.bytes(e.num_tokens),
                refs: e.refs.iter().cloned().collect(),
                freeable: self.freeable.contains(hash),
            })
            .collect();
        let used_tokens = self.cache_size - self.num_free_slots;
        EncoderCacheSnapshot {
            capacity_tokens: self.cache_size,
            used_tokens,
            referenced_tokens: self.cache_size - self.num_freeable_slots,
            freeable_tokens: self.num_freeable_slots - self.num_free_slots,
            num_free_slots: self.num_free_slots,
            num_freeable_slots: self.num_freeable_slots,
            bytes_per_token: self.bytes_per_token,
            capacity_bytes: self.bytes(self.cache_size),
            used_bytes: self.bytes(used_tokens),
            pending_freed: self.freed.clone(),
            stats: self.stats,
            entries,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(s: &str) -> RequestId {
        s.into()
    }

    fn h(s: &str) -> MmHash {
        s.into()
    }

    /// Schedules item `hash` of `tokens` for `req` the way the scheduler does.
    fn schedule(c: &mut EncoderCacheManager, req: &str, hash: &str, tokens: usize) -> bool {
        if c.check_and_update_cache(&r(req), &h(hash)) {
            return true;
        }
        if !c.can_allocate(tokens, usize::MAX, 0) {
            return false;
        }
        c.allocate(&r(req), &h(hash), tokens).unwrap();
        true
    }

    fn check_invariants(c: &EncoderCacheManager) -> Result<(), String> {
        if !(c.num_free_slots <= c.num_freeable_slots && c.num_freeable_slots <= c.cache_size) {
            return Err(format!(
                "free {} freeable {} size {}",
                c.num_free_slots, c.num_freeable_slots, c.cache_size
            ));
        }
        let used: usize = c.cached.values().map(|e| e.num_tokens).sum();
        let unref: usize = c
            .cached
            .values()
            .filter(|e| e.refs.is_empty())
            .map(|e| e.num_tokens)
            .sum();
        if used != c.cache_size - c.num_free_slots || unref != c.num_freeable_slots - c.num_free_slots {
            return Err(format!(
                "slot counters disagree with entries: used {used}, unreferenced {unref}"
            ));
        }
        for (hash, e) in &c.cached {
            if e.refs.is_empty() != c.freeable.contains(hash) {
                return Err(format!("{hash}: freeable flag disagrees with refs"));
            }
            for req in &e.refs {
                if !c.request_inputs.get(req).is_some_and(|v| v.contains(hash)) {
                    return Err(format!("{req} references {hash} but does not list it"));
                }
            }
        }
        for (req, hashes) in &c.request_inputs {
            if hashes.is_empty()
                || hashes
                    .iter()
                    .any(|x| !c.cached.get(x).is_some_and(|e| e.refs.contains(req)))
            {
                return Err(format!("{req}: input list disagrees with refs"));
            }
        }
        if c.freeable.order.len() != c.freeable.seq_of.len() {
            return Err("freeable fifo index out of sync".into());
        }
        Ok(())
    }

    #[test]
    fn hit_resurrects_a_freeable_entry() {
        let mut c = EncoderCacheManager::new(100);
        assert!(schedule(&mut c, "a", "img", 40));
        assert_eq!((c.num_free_slots(), c.num_freeable_slots()), (60, 60));
        c.free(&r("a"));
        assert_eq!((c.num_free_slots(), c.num_freeable_slots()), (60, 100));
        assert!(c.is_cached(&h("img")));
        assert!(c.check_and_update_cache(&r("b"), &h("img")));
        assert_eq!((c.num_free_slots(), c.num_freeable_slots()), (60, 60));
        assert!(!c.snapshot().entries[0].freeable);
        assert!(!c.check_and_update_cache(&r("b"), &h("other")));
        assert_eq!(
            c.stats(),
            EncoderCacheStats {
                queries: 3,
                hits: 1,
                evictions: 0,
                evicted_tokens: 0
            }
        );
        check_invariants(&c).unwrap();
    }

    #[test]
    fn eviction_is_fifo_in_release_order_and_lazy() {
        let mut c = EncoderCacheManager::new(100);
        schedule(&mut c, "a", "x", 30);
        schedule(&mut c, "b", "y", 30);
        schedule(&mut c, "c", "z", 30);
        // Release order y, z, x: that is the eviction order.
        c.free_encoder_input(&r("b"), &h("y"));
        c.free(&r("c"));
        c.free(&r("a"));
        assert!(
            c.get_freed_mm_hashes().is_empty(),
            "nothing is evicted until space is needed"
        );
        assert!(c.can_allocate(10, 100, 0), "fits in the 10 free slots");
        assert!(c.get_freed_mm_hashes().is_empty());
        assert!(c.can_allocate(50, 100, 0));
        assert_eq!(c.get_freed_mm_hashes(), vec![h("y"), h("z")]);
        assert!(c.get_freed_mm_hashes().is_empty(), "drained");
        assert!(c.is_cached(&h("x")) && !c.is_cached(&h("y")));
        assert_eq!(c.stats().evicted_tokens, 60);
        check_invariants(&c).unwrap();
    }

    #[test]
    fn can_allocate_limits() {
        let mut c = EncoderCacheManager::new(100);
        schedule(&mut c, "a", "x", 60);
        assert!(!c.can_allocate(50, 40, 0), "larger than the compute budget");
        assert!(!c.can_allocate(41, 100, 0), "more than free + freeable");
        assert!(!c.can_allocate(30, 100, 20), "already-scheduled tokens count");
        assert!(c.can_allocate(30, 100, 10));
        c.free(&r("a"));
        assert!(c.can_allocate(100, 100, 0));
        assert_eq!(c.get_freed_mm_hashes(), vec![h("x")]);
        assert_eq!(c.num_free_slots(), 100);
        check_invariants(&c).unwrap();
    }

    #[test]
    fn allocate_errors() {
        let mut c = EncoderCacheManager::new(50);
        c.allocate(&r("a"), &h("x"), 30).unwrap();
        assert_eq!(
            c.allocate(&r("b"), &h("x"), 30),
            Err(CacheError::EncoderEntryExists(h("x")))
        );
        assert_eq!(
            c.allocate(&r("b"), &h("y"), 30),
            Err(CacheError::EncoderCacheFull {
                mm_hash: h("y"),
                needed: 30,
                free: 20
            })
        );
        check_invariants(&c).unwrap();
    }

    #[test]
    fn reset_drops_only_unreferenced_entries() {
        let mut c = EncoderCacheManager::new(100);
        c.set_bytes_per_token(32 * 1024);
        schedule(&mut c, "a", "kept", 20);
        schedule(&mut c, "b", "old1", 30);
        schedule(&mut c, "b", "old2", 10);
        schedule(&mut c, "c", "kept", 20);
        c.free(&r("b"));
        c.free(&r("c"));
        let rep = c.reset();
        assert_eq!(
            rep,
            EncoderCacheReset {
                num_entries: 2,
                num_tokens: 40,
                num_bytes: 40 * 32 * 1024
            }
        );
        assert_eq!(c.get_freed_mm_hashes(), vec![h("old1"), h("old2")]);
        assert!(c.is_cached(&h("kept")));
        assert_eq!((c.num_free_slots(), c.num_freeable_slots()), (80, 80));
        let s = c.snapshot();
        assert_eq!(s.entries.len(), 1);
        assert_eq!(s.entries[0].refs, vec![r("a")]);
        assert_eq!(s.used_bytes, 20 * 32 * 1024);
        check_invariants(&c).unwrap();
        c.free(&r("a"));
        assert_eq!(c.reset().num_entries, 1);
        assert_eq!(c.num_entries(), 0);
        assert_eq!(c.num_free_slots(), 100);
    }

    #[test]
    fn snapshot_totals() {
        let mut c = EncoderCacheManager::new(100);
        c.set_bytes_per_token(2);
        schedule(&mut c, "a", "x", 30);
        schedule(&mut c, "b", "y", 20);
        c.free(&r("b"));
        let s = c.snapshot();
        assert_eq!((s.used_tokens, s.referenced_tokens, s.freeable_tokens), (50, 30, 20));
        assert_eq!((s.capacity_bytes, s.used_bytes), (200, 100));
        assert_eq!(
            s.entries.iter().map(|e| e.mm_hash.as_str()).collect::<Vec<_>>(),
            ["x", "y"]
        );
        assert!(s.entries[1].freeable);
        assert_eq!(serde_json::to_value(&s).unwrap()["entries"][0]["refs"][0], "a");
    }

    mod proptests {
        use super::*;
        use proptest::prelude::*;
        use std::collections::BTreeSet;

        const ITEMS: [usize; 6] = [8, 16, 24, 40, 64, 100];

        #[derive(Clone, Debug)]
        enum Op {
            Schedule {
                req: u8,
                item: usize,
                budget: usize,
                already: usize,
            },
            FreeInput {
                req: u8,
                item: usize,
            },
            FreeReq {
                req: u8,
            },
            Reset,
            Step,
        }

        fn op() -> impl Strategy<Value = Op> {
            prop_oneof![
                6 => (0..5u8, 0..ITEMS.len(), 0..160usize, 0..40usize)
                    .prop_map(|(req, item, budget, already)| Op::Schedule { req, item, budget, already }),
                3 => (0..5u8, 0..ITEMS.len()).prop_map(|(req, item)| Op::FreeInput { req, item }),
                2 => (0..5u8).prop_map(|req| Op::FreeReq { req }),
                1 => Just(Op::Reset),
                2 => Just(Op::Step),
            ]
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]
            #[test]
            fn encoder_cache_invariants(size in 0usize..200, ops in prop::collection::vec(op(), 1..80)) {
                let mut c = EncoderCacheManager::new(size);
                // What the model side holds, updated once per step like vLLM's worker:
                // drop freed hashes first, then store the outputs computed this step.
                let mut worker: BTreeSet<MmHash> = BTreeSet::new();
                let mut computed_this_step: Vec<MmHash> = Vec::new();
                let mut refs: BTreeSet<(u8, usize)> = BTreeSet::new();
                for op in ops {
                    match op {
                        Op::Schedule { req, item, budget, already } => {
                            let (id, hash, t) = (r(&format!("r{req}")), h(&format!("i{item}")), ITEMS[item]);
                            if c.check_and_update_cache(&id, &hash) {
                                refs.insert((req, item));
                            } else if c.can_allocate(t, budget, already) {
                                prop_assert!(t <= budget && t + already <= c.num_free_slots());
                                c.allocate(&id, &hash, t).unwrap();
                                refs.insert((req, item));
                                computed_this_step.push(hash);
                            } else {
                                prop_assert!(t > budget || t + already > c.num_freeable_slots()
                                    || t + already > c.num_free_slots());
                            }
                        }
                        Op::FreeInput { req, item } => {
                            c.free_encoder_input(&r(&format!("r{req}")), &h(&format!("i{item}")));
                            refs.remove(&(req, item));
                        }
                        Op::FreeReq { req } => {
                            c.free(&r(&format!("r{req}")));
                            refs.retain(|&(q, _)| q != req);
                        }
                        Op::Reset => {
                            let before = c.num_entries();
                            let rep = c.reset();
                            prop_assert_eq!(c.num_entries(), before - rep.num_entries);
                            prop_assert_eq!(c.num_free_slots(), c.num_freeable_slots());
                        }
                        Op::Step => {
                            for x in c.get_freed_mm_hashes() {
                                prop_assert!(worker.remove(&x) || computed_this_step.contains(&x));
                            }
                            // An output evicted in the same step it was scheduled is not kept.
                            worker.extend(computed_this_step.drain(..).filter(|x| c.is_cached(x)));
                            let cached: BTreeSet<MmHash> = c.cached.keys().cloned().collect();
                            prop_assert_eq!(&worker, &cached);
                        }
                    }
                    check_invariants(&c).map_err(TestCaseError::fail)?;
                    let used: usize = c.snapshot().entries.iter().map(|e| e.num_tokens).sum();
                    prop_assert!(used <= size);
                    // Every reference the model expects is recorded, and nothing else.
                    for (q, i) in &refs {
                        let (req, hash) = (format!("r{q}"), format!("i{i}"));
                        let recorded = c.cached.get(hash.as_str()).is_some_and(|e| e.refs.contains(req.as_str()));
                        prop_assert!(recorded, "{} should reference {}", req, hash);
                    }
                    let total: usize = c.cached.values().map(|e| e.refs.len()).sum();
                    prop_assert_eq!(total, refs.len());
                }
                for q in 0..5u8 {
                    c.free(&r(&format!("r{q}")));
                }
                check_invariants(&c).map_err(TestCaseError::fail)?;
                prop_assert_eq!(c.num_freeable_slots(), size);
                prop_assert!(c.snapshot().entries.iter().all(|e| e.freeable && e.refs.is_empty()));
            }
        }
    }
}
