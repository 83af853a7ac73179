//! KV cache events: what the prefix cache stored, removed and cleared, in the shape of vLLM's
//! `vllm/distributed/kv_events.py` (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`), recorded by
//! the [`super::BlockPool`] when asked and drained after each step by whoever publishes them.

use serde::Serialize;

use super::block_hash::{BlockHash, MmSpan, TokenId};

impl BlockHash {
    /// The 64-bit form published in events (vLLM's `ExternalBlockHash` as an int): the first 8
    /// bytes, big-endian, so it reads as the first 16 hex digits of the full hash (vLLM takes the
    /// last 8 bytes of its own hash; the two hashes differ anyway).
    pub fn external(&self) -> u64 {
        u64::from_be_bytes(self.0[..8].try_into().expect("32-byte hash"))
    }
}

/// One change to the set of cached (hashed) KV blocks.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "type")]
pub enum KvCacheEvent {
    /// Full blocks of one request got their hashes (joined the prefix cache), in chain order.
    BlockStored {
        /// External hashes of the stored blocks.
        block_hashes: Vec<u64>,
        /// Hash of the block before the first stored one (`None` when it is the request's first).
        parent_block_hash: Option<u64>,
        /// The tokens of the stored blocks, `block_size` per block.
        token_ids: Vec<TokenId>,
        /// Tokens per block.
        block_size: usize,
        /// Per block, the mm hashes of the images whose placeholders overlap it (`None`: no image).
        extra_keys: Vec<Option<Vec<String>>>,
    },
    /// Blocks whose hash was dropped (a cached block reallocated: an eviction).
    BlockRemoved {
        /// External hashes of the removed blocks.
        block_hashes: Vec<u64>,
    },
    /// Every hash was dropped (`/reset_prefix_cache`).
    AllBlocksCleared,
}

/// A request's full-block hashes with the tokens and image spans they were computed from: what a
/// [`KvCacheEvent::BlockStored`] reports about the blocks it names.
#[derive(Clone, Copy, Debug)]
pub struct BlockKeys<'a> {
    /// Full-block hashes of prompt + output, in order.
    pub hashes: &'a [BlockHash],
    /// Prompt tokens, then output tokens.
    pub tokens: [&'a [TokenId]; 2],
    /// Image placeholder ranges.
    pub spans: &'a [MmSpan],
}

impl BlockKeys<'_> {
    /// The event for blocks `first..end` of the request (indices into `hashes`).
    pub(super) fn stored(&self, first: usize, end: usize, block_size: usize) -> KvCacheEvent {
        let (from, to) = (first * block_size, end * block_size);
        let token_ids = self.tokens[0]
            .iter()
            .chain(self.tokens[1])
            .skip(from)
            .take(to - from)
            .copied()
            .collect();
        let extra_keys = (first..end)
            .map(|i| {
                let (start, stop) = (i * block_size, (i + 1) * block_size);
                let images: Vec<String> = self
                    .spans
                    .iter()
                    .filter(|s| s.length > 0 && s.offset < stop && s.offset + s.length > start)
                    .map(|s| s.hash.as_str().to_owned())
                    .collect();
                (!images.is_empty()).then_some(images)
            })
            .collect();
        KvCacheEvent::BlockStored {
            block_hashes: self.hashes[first..end].iter().map(BlockHash::external).collect(),
            parent_block_hash: first.checked_sub(1).map(|p| self.hashes[p].external()),
            token_ids,
            block_size,
            extra_keys,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::hash_request_blocks;

    #[test]
    fn external_hash_is_the_leading_hex_digits() {
        let h = BlockHash([
            0x12, 0x34, 0x56, 0x78, 0x9a, 0xbc, 0xde, 0xf0, 0xff, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
            0, 0, 0, 0, 1,
        ]);
        assert_eq!(h.external(), 0x1234_5678_9abc_def0);
        assert_eq!(format!("{:016x}", h.external()), h.to_string()[..16]);
    }

    #[test]
    fn a_stored_run_names_its_parent_tokens_and_images() {
        let prompt: Vec<TokenId> = (0..40).collect();
        let output: Vec<TokenId> = (100..108).collect();
        let spans = [MmSpan {
            hash: "img".into(),
            offset: 20,
            length: 6,
        }];
        let all: Vec<TokenId> = prompt.iter().chain(&output).copied().collect();
        let hashes = hash_request_blocks(&all, 16, &spans, None).unwrap();
        let keys = BlockKeys {
            hashes: &hashes,
            tokens: [&prompt, &output],
            spans: &spans,
        };
        let KvCacheEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            extra_keys,
            ..
        } = keys.stored(1, 3, 16)
        else {
            panic!("a store")
        };
        assert_eq!(block_hashes, vec![hashes[1].external(), hashes[2].external()]);
        assert_eq!(parent_block_hash, Some(hashes[0].external()));
        // Block 2 runs over the prompt's end into the output.
        assert_eq!(token_ids, all[16..48]);
        assert_eq!(extra_keys, vec![Some(vec!["img".to_owned()]), None]);
        let KvCacheEvent::BlockStored { parent_block_hash, .. } = keys.stored(0, 1, 16) else {
            panic!("a store")
        };
        assert_eq!(parent_block_hash, None);
    }
}
