//! A server's prefix cache rebuilt from its KV cache events (vLLM's `BlockStored`,
//! `BlockRemoved`, `AllBlocksCleared`), as `kvlens watch` keeps it and the playground draws it:
//! the resident blocks (stored and not yet removed), with their copies and image keys, and the
//! stream's health (batches, replays, restarts, removals of blocks never seen stored).

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

/// One event as a watcher reads it; hashes are text (16 hex digits of an int hash, or the hex of
/// a bytes hash) so every publisher's hashes fit.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type")]
pub enum WatchEvent {
    /// Blocks joined the prefix cache.
    BlockStored {
        /// The stored blocks' hashes, in chain order.
        block_hashes: Vec<String>,
        /// The hash of the block before the first one.
        parent_block_hash: Option<String>,
        /// Tokens per block.
        block_size: u64,
        /// The stored blocks' tokens.
        token_ids: Vec<u32>,
        /// The medium (`GPU`, `CPU`…) when given.
        medium: Option<String>,
        /// Per block, its extra keys as text (image hashes, LoRA, salt), if any.
        extra_keys: Vec<Option<Vec<String>>>,
    },
    /// Blocks left the prefix cache.
    BlockRemoved {
        /// Their hashes.
        block_hashes: Vec<String>,
        /// The medium when given.
        medium: Option<String>,
    },
    /// Everything left the prefix cache.
    AllBlocksCleared,
}

impl WatchEvent {
    /// The medium the event names (`GPU` for the device's cache), if any.
    pub fn medium(&self) -> Option<&str> {
        match self {
            WatchEvent::BlockStored { medium, .. } | WatchEvent::BlockRemoved { medium, .. } => medium.as_deref(),
            WatchEvent::AllBlocksCleared => None,
        }
    }
}

/// One resident block.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WatchedBlock {
    /// Its hash.
    pub hash: String,
    /// How many blocks hold it (one hash can be stored by several blocks).
    pub copies: u32,
    /// The extra keys it was stored with (image hashes…), empty when none.
    pub keys: Vec<String>,
    /// The batch that stored its first copy.
    pub since: u64,
}

/// What a watcher shows: counts, the stream's health and the resident blocks in storing order.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct KvWatchSnapshot {
    /// Batches applied.
    pub batches: u64,
    /// The last batch's sequence number.
    pub last_seq: Option<u64>,
    /// The last batch's timestamp (the publisher's Unix seconds).
    pub last_ts: Option<f64>,
    /// Blocks stored, over the whole watch.
    pub stored: u64,
    /// Blocks removed.
    pub removed: u64,
    /// `AllBlocksCleared` events.
    pub cleared: u64,
    /// Removals of hashes never seen stored (a batch was lost for good, or the watch started late
    /// without a replay).
    pub unknown_removals: u64,
    /// Batches recovered through the replay socket after a gap or a late start.
    pub replayed: u64,
    /// Batches known lost (a gap the replay could not fill).
    pub lost: u64,
    /// Times the publisher restarted (its sequence went back); the resident set starts over.
    pub restarts: u64,
    /// Block events for another medium than the device's (vLLM's CPU offloading tier), not drawn.
    pub other_medium: u64,
    /// Tokens per block, from the last store.
    pub block_size: Option<u64>,
    /// Resident block copies.
    pub num_resident: u64,
    /// Resident blocks holding image tokens (extra keys present).
    pub num_with_keys: u64,
    /// The resident blocks, oldest first, at most [`KvWatchSnapshot::MAX_BLOCKS`] of them.
    pub blocks: Vec<WatchedBlock>,
}

impl KvWatchSnapshot {
    /// Most blocks a snapshot lists one by one (the counts cover the rest).
    pub const MAX_BLOCKS: usize = 4096;
}

#[derive(Clone, Debug)]
struct Resident {
    copies: u32,
    keys: Vec<String>,
    since: u64,
    order: u64,
}

/// The resident set and the stream's counters.
#[derive(Clone, Debug, Default)]
pub struct KvWatch {
    resident: HashMap<String, Resident>,
    next_order: u64,
    counts: KvWatchSnapshot,
}

impl KvWatch {
    /// Applies batch `seq`'s events in order; `replayed` when it came through the replay socket.
    pub fn apply(&mut self, seq: u64, ts: f64, events: &[WatchEvent], replayed: bool) {
        let c = &mut self.counts;
        c.batches += 1;
        c.replayed += u64::from(replayed);
        c.last_seq = Some(seq);
        c.last_ts = Some(ts);
        for event in events {
            if event.medium().is_some_and(|m| m != "GPU") {
                self.counts.other_medium += 1;
                continue;
            }
            match event {
                WatchEvent::BlockStored {
                    block_hashes,
                    block_size,
                    extra_keys,
                    ..
                } => {
                    self.counts.block_size = Some(*block_size);
                    for (i, hash) in block_hashes.iter().enumerate() {
                        self.counts.stored += 1;
                        let keys = extra_keys.get(i).cloned().flatten().unwrap_or_default();
                        let order = self.next_order;
                        self.next_order += 1;
                        self.resident
                            .entry(hash.clone())
                            .or_insert(Resident {
                                copies: 0,
                                keys,
                                since: seq,
                                order,
                            })
                            .copies += 1;
                    }
                }
                WatchEvent::BlockRemoved { block_hashes, .. } => {
                    for hash in block_hashes {
                        match self.resident.get_mut(hash) {
                            Some(r) => {
                                self.counts.removed += 1;
                                r.copies -= 1;
                                if r.copies == 0 {
                                    self.resident.remove(hash);
                                }
                            }
                            None => self.counts.unknown_removals += 1,
                        }
                    }
                }
                WatchEvent::AllBlocksCleared => {
                    self.counts.cleared += 1;
                    self.resident.clear();
                }
            }
        }
    }

    /// Counts batches that a gap lost for good.
    pub fn lost(&mut self, batches: u64) {
        self.counts.lost += batches;
    }

    /// The publisher restarted: its blocks are gone with it.
    pub fn restarted(&mut self) {
        self.counts.restarts += 1;
        self.counts.last_seq = None;
        self.resident.clear();
    }

    /// The sequence number the next batch should carry.
    pub fn next_seq(&self) -> Option<u64> {
        self.counts.last_seq.and_then(|s| s.checked_add(1))
    }

    /// The last applied batch's timestamp.
    pub fn last_ts(&self) -> Option<f64> {
        self.counts.last_ts
    }

    /// What the watcher shows now.
    pub fn snapshot(&self) -> KvWatchSnapshot {
        let mut blocks: Vec<(&String, &Resident)> = self.resident.iter().collect();
        blocks.sort_by_key(|(_, r)| r.order);
        KvWatchSnapshot {
            num_resident: self.resident.values().map(|r| u64::from(r.copies)).sum(),
            num_with_keys: self
                .resident
                .values()
                .filter(|r| !r.keys.is_empty())
                .map(|r| u64::from(r.copies))
                .sum(),
            blocks: blocks
                .into_iter()
                .take(KvWatchSnapshot::MAX_BLOCKS)
                .map(|(hash, r)| WatchedBlock {
                    hash: hash.clone(),
                    copies: r.copies,
                    keys: r.keys.clone(),
                    since: r.since,
                })
                .collect(),
            ..self.counts.clone()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(hashes: &[&str], keys: Vec<Option<Vec<String>>>) -> WatchEvent {
        WatchEvent::BlockStored {
            block_hashes: hashes.iter().map(|h| h.to_string()).collect(),
            parent_block_hash: None,
            block_size: 16,
            token_ids: Vec::new(),
            medium: Some("GPU".into()),
            extra_keys: keys,
        }
    }

    fn removed(hashes: &[&str]) -> WatchEvent {
        WatchEvent::BlockRemoved {
            block_hashes: hashes.iter().map(|h| h.to_string()).collect(),
            medium: None,
        }
    }

    #[test]
    fn copies_removals_clears_and_restarts() {
        let mut w = KvWatch::default();
        w.apply(
            0,
            1.0,
            &[stored(&["a", "b"], vec![None, Some(vec!["img".into()])])],
            false,
        );
        w.apply(1, 2.0, &[stored(&["a"], vec![]), removed(&["b", "zz"])], true);
        let s = w.snapshot();
        assert_eq!((s.stored, s.removed, s.unknown_removals, s.replayed), (3, 1, 1, 1));
        assert_eq!(s.num_resident, 2);
        assert_eq!(s.blocks.len(), 1);
        assert_eq!((s.blocks[0].hash.as_str(), s.blocks[0].copies), ("a", 2));
        assert_eq!(w.next_seq(), Some(2));
        w.apply(2, 3.0, &[stored(&["c"], vec![Some(vec!["img".into()])])], false);
        assert_eq!(w.snapshot().num_with_keys, 1);
        assert_eq!(
            w.snapshot().blocks.iter().map(|b| b.hash.as_str()).collect::<Vec<_>>(),
            ["a", "c"]
        );
        w.apply(3, 4.0, &[WatchEvent::AllBlocksCleared], false);
        assert_eq!(w.snapshot().num_resident, 0);
        let mut offloaded = stored(&["e"], vec![]);
        if let WatchEvent::BlockStored { medium, .. } = &mut offloaded {
            *medium = Some("CPU".into());
        }
        w.apply(4, 5.0, &[stored(&["d"], vec![]), offloaded], false);
        assert_eq!((w.snapshot().num_resident, w.snapshot().other_medium), (1, 1));
        w.restarted();
        let s = w.snapshot();
        assert_eq!((s.restarts, s.num_resident, s.last_seq, s.cleared), (1, 0, None, 1));
    }
}
