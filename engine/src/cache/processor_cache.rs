//! `ProcessorCache`: byte-sized LRU of preprocessed multimodal items keyed by mm hash
//! (vLLM's multimodal processor cache, `--mm-processor-cache-gb`, default 4 GiB, 0 disables).

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};

use super::MmHash;

/// Default capacity: 4 GiB (vLLM `--mm-processor-cache-gb 4`).
pub const DEFAULT_PROCESSOR_CACHE_BYTES: u64 = 4 << 30;

/// Lookup and eviction counters of a [`ProcessorCache`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessorCacheStats {
    /// `get` calls.
    pub queries: u64,
    /// Of which found the item.
    pub hits: u64,
    /// Items evicted to make room.
    pub evictions: u64,
}

/// One entry in a [`ProcessorCacheSnapshot`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessorCacheEntrySnapshot {
    /// The item's mm hash.
    pub mm_hash: MmHash,
    /// Its size in bytes.
    pub size_bytes: u64,
}

/// Serializable picture of a [`ProcessorCache`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessorCacheSnapshot {
    /// Capacity in bytes (0 = disabled).
    pub capacity_bytes: u64,
    /// Bytes held.
    pub bytes_used: u64,
    /// Counters.
    pub stats: ProcessorCacheStats,
    /// Entries from least to most recently used (first = next eviction victim).
    pub entries: Vec<ProcessorCacheEntrySnapshot>,
}

#[derive(Clone, Debug)]
struct Entry<V> {
    value: V,
    size_bytes: u64,
    /// Recency stamp: key in `ProcessorCache::recency`.
    stamp: u64,
}

/// Byte-sized LRU cache of preprocessed items `V` keyed by mm hash.
#[derive(Clone, Debug)]
pub struct ProcessorCache<V> {
    capacity_bytes: u64,
    bytes_used: u64,
    entries: HashMap<MmHash, Entry<V>>,
    /// Stamp → key; the smallest stamp is the least recently used entry.
    recency: BTreeMap<u64, MmHash>,
    next_stamp: u64,
    stats: ProcessorCacheStats,
}

impl<V> Default for ProcessorCache<V> {
    /// A cache of [`DEFAULT_PROCESSOR_CACHE_BYTES`].
    fn default() -> Self {
        Self::new(DEFAULT_PROCESSOR_CACHE_BYTES)
    }
}

impl<V> ProcessorCache<V> {
    /// Empty cache of `capacity_bytes` (0 disables it: nothing is stored).
    pub fn new(capacity_bytes: u64) -> Self {
        Self {
            capacity_bytes,
            bytes_used: 0,
            entries: HashMap::new(),
            recency: BTreeMap::new(),
            next_stamp: 0,
            stats: ProcessorCacheStats::default(),
        }
    }

    /// Capacity in bytes.
    pub fn capacity_bytes(&self) -> u64 {
        self.capacity_bytes
    }

    /// Bytes held by the stored items.
    pub fn bytes_used(&self) -> u64 {
        self.bytes_used
    }

    /// Number of stored items.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether nothing is stored.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Lookup counters.
    pub fn stats(&self) -> ProcessorCacheStats {
        self.stats
    }

    fn take_stamp(&mut self) -> u64 {
        let s = self.next_stamp;
        self.next_stamp += 1;
        s
    }

    fn remove_entry(&mut self, key: &str) -> Option<Entry<V>> {
        let entry = self.entries.remove(key)?;
        self.recency.remove(&entry.stamp);
        self.bytes_used -= entry.size_bytes;
        Some(entry)
    }

    /// Stores `value` as the most recently used item, replacing any item under `key` and evicting
    /// least-recently-used items until it fits. Returns false (storing nothing, changing nothing)
    /// when the cache is disabled or the item alone exceeds the capacity.
    pub fn insert(&mut self, key: MmHash, value: V, size_bytes: u64) -> bool {
        if self.capacity_bytes == 0 || size_bytes > self.capacity_bytes {
            return false;
        }
        self.remove_entry(key.as_str());
        while self.bytes_used.saturating_add(size_bytes) > self.capacity_bytes {
            let Some((_, victim)) = self.recency.pop_first() else {
                break;
            };
            if let Some(e) = self.entries.remove(&victim) {
                self.bytes_used -= e.size_bytes;
                self.stats.evictions += 1;
            }
        }
        let stamp = self.take_stamp();
        self.recency.insert(stamp, key.clone());
        self.entries.insert(
            key,
            Entry {
                value,
                size_bytes,
                stamp,
            },
        );
        self.bytes_used += size_bytes;
        true
    }

    /// The item under `key`, marking it most recently used; counts a query and, if found, a hit.
    pub fn get(&mut self, key: &str) -> Option<&V> {
        self.stats.queries += 1;
        let stamp = self.take_stamp();
        let entry = self.entries.get_mut(key)?;
        self.stats.hits += 1;
        if let Some(k) = self.recency.remove(&entry.stamp) {
            self.recency.insert(stamp, k);
        }
        entry.stamp = stamp;
        Some(&entry.value)
    }

    /// Whether `key` is stored, without touching recency or counters.
    pub fn contains(&self, key: &str) -> bool {
        self.entries.contains_key(key)
    }

    /// Drops every item and returns the bytes released (counters are kept).
    pub fn clear(&mut self) -> u64 {
        let freed = self.bytes_used;
        self.entries.clear();
        self.recency.clear();
        self.bytes_used = 0;
        freed
    }

    /// Entries from least to most recently used, with totals.
    pub fn snapshot(&self) -> ProcessorCacheSnapshot {
        let entries = self
            .recency
            .values()
            .filter_map(|k| {
                self.entries.get(k).map(|e| ProcessorCacheEntrySnapshot {
                    mm_hash: k.clone(),
                    size_bytes: e.size_bytes,
                })
            })
            .collect();
        ProcessorCacheSnapshot {
            capacity_bytes: self.capacity_bytes,
            bytes_used: self.bytes_used,
            stats: self.stats,
            entries,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys<V>(c: &ProcessorCache<V>) -> Vec<String> {
        c.snapshot().entries.into_iter().map(|e| e.mm_hash.0).collect()
    }

    #[test]
    fn lru_eviction_by_bytes() {
        let mut c = ProcessorCache::new(100);
        assert!(c.insert("a".into(), 1, 40));
        assert!(c.insert("b".into(), 2, 40));
        assert_eq!(c.get("a"), Some(&1)); // a becomes most recent
        assert!(c.contains("b")); // does not touch recency
        assert!(c.insert("c".into(), 3, 40)); // evicts b, the LRU
        assert_eq!(keys(&c), ["a", "c"]);
        assert_eq!(c.bytes_used(), 80);
        assert_eq!(c.get("b"), None);
        assert_eq!(
            c.stats(),
            ProcessorCacheStats {
                queries: 2,
                hits: 1,
                evictions: 1
            }
        );
        // Replacing a key updates size and recency without double counting.
        assert!(c.insert("a".into(), 10, 60));
        assert_eq!(keys(&c), ["c", "a"]);
        assert_eq!(c.bytes_used(), 100);
        assert!(c.insert("a".into(), 11, 70));
        assert_eq!(keys(&c), ["a"], "c had to go to fit the larger a");
        assert_eq!(c.bytes_used(), 70);
        assert_eq!(c.len(), 1);
    }

    #[test]
    fn capacity_zero_disables() {
        let mut c = ProcessorCache::new(0);
        assert!(!c.insert("a".into(), (), 0));
        assert!(!c.insert("b".into(), (), 1));
        assert!(c.is_empty());
        assert_eq!(c.get("a"), None);
        assert_eq!(c.stats().queries, 1);
    }

    #[test]
    fn oversize_item_is_not_stored() {
        let mut c = ProcessorCache::new(100);
        c.insert("a".into(), 'a', 50);
        assert!(!c.insert("big".into(), 'b', 101));
        assert!(!c.contains("big"));
        assert_eq!(keys(&c), ["a"], "nothing evicted for an item that cannot fit");
        assert!(c.insert("full".into(), 'f', 100));
        assert_eq!(keys(&c), ["full"]);
    }

    #[test]
    fn clear_returns_bytes_and_keeps_counters() {
        let mut c = ProcessorCache::default();
        assert_eq!(c.capacity_bytes(), 4 * 1024 * 1024 * 1024);
        c.insert("a".into(), vec![0u8; 3], 3 << 30);
        c.get("a");
        assert_eq!(c.clear(), 3 << 30);
        assert_eq!((c.len(), c.bytes_used()), (0, 0));
        assert_eq!(c.stats().hits, 1);
        assert_eq!(c.get("a"), None);
    }

    mod proptests {
        use super::*;
        use proptest::prelude::*;

        #[derive(Clone, Debug)]
        enum Op {
            Insert(u8, u64),
            Get(u8),
            Clear,
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]
            #[test]
            fn bytes_never_exceed_capacity_and_lru_matches_model(
                cap in prop::sample::select(vec![0u64, 1, 100, 1000]),
                ops in prop::collection::vec(prop_oneof![
                    6 => (0..8u8, 0..1200u64).prop_map(|(k, s)| Op::Insert(k, s)),
                    4 => (0..8u8).prop_map(Op::Get),
                    1 => Just(Op::Clear),
                ], 1..100),
            ) {
                let mut c: ProcessorCache<u8> = ProcessorCache::new(cap);
                // Reference model: (key, size) from least to most recently used.
                let mut model: Vec<(String, u64)> = Vec::new();
                for op in ops {
                    match op {
                        Op::Insert(k, size) => {
                            let key = format!("k{k}");
                            let stored = c.insert(key.as_str().into(), k, size);
                            prop_assert_eq!(stored, cap > 0 && size <= cap);
                            if stored {
                                model.retain(|(m, _)| *m != key);
                                while model.iter().map(|(_, s)| s).sum::<u64>() + size > cap {
                                    model.remove(0);
                                }
                                model.push((key, size));
                            }
                        }
                        Op::Get(k) => {
                            let key = format!("k{k}");
                            let got = c.get(&key).copied();
                            match model.iter().position(|(m, _)| *m == key) {
                                Some(i) => {
                                    prop_assert_eq!(got, Some(k));
                                    let e = model.remove(i);
                                    model.push(e);
                                }
                                None => prop_assert_eq!(got, None),
                            }
                        }
                        Op::Clear => {
                            let used: u64 = model.iter().map(|(_, s)| s).sum();
                            prop_assert_eq!(c.clear(), used);
                            model.clear();
                        }
                    }
                    prop_assert!(c.bytes_used() <= cap);
                    prop_assert_eq!(c.bytes_used(), model.iter().map(|(_, s)| s).sum::<u64>());
                    let snap: Vec<(String, u64)> =
                        c.snapshot().entries.into_iter().map(|e| (e.mm_hash.0, e.size_bytes)).collect();
                    prop_assert_eq!(&snap, &model);
                    prop_assert_eq!(c.len(), model.len());
                }
            }
        }
    }
}
