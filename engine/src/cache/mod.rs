//! Cache managers with vLLM v1 semantics: KV blocks with prefix caching, encoder outputs,
//! preprocessed images. Pure bookkeeping: no tensors live here.

pub mod block_hash;
pub mod block_pool;
pub mod block_residency;
pub mod encoder_cache;
pub mod kv_events;
pub mod kv_manager;
pub mod kv_watch;
pub mod processor_cache;

use std::borrow::Borrow;
use std::fmt;

use serde::{Deserialize, Serialize};

pub use block_hash::{extend_block_hashes, hash_request_blocks, BlockHash, MmSpan, TokenId};
pub use block_pool::{BlockId, BlockPool, FreeQueueIter, NULL_BLOCK};
pub use block_residency::{BlockEviction, BlockResidency};
pub use encoder_cache::{
    EncoderCacheEntrySnapshot, EncoderCacheManager, EncoderCacheReset, EncoderCacheSnapshot, EncoderCacheStats,
};
pub use kv_events::{BlockKeys, KvCacheEvent};
pub use kv_manager::{ComputedBlocks, KvBlockState, KvCacheManager, KvSummary, PrefixCacheStats};
pub use kv_watch::{KvWatch, KvWatchSnapshot, WatchEvent, WatchedBlock};
pub use processor_cache::{
    ProcessorCache, ProcessorCacheEntrySnapshot, ProcessorCacheSnapshot, ProcessorCacheStats,
    DEFAULT_PROCESSOR_CACHE_BYTES,
};

#[cfg(test)]
thread_local! {
    /// Identifier comparisons made on this thread (tests of how bookkeeping scales).
    pub(crate) static ID_COMPARISONS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Defines a string newtype usable as a map key and looked up by `&str`.
macro_rules! string_id {
    ($(#[$meta:meta])* $name:ident) => {
        $(#[$meta])*
        // Equality is the string's, as the derived Hash assumes; the tests count comparisons.
        #[allow(clippy::derived_hash_with_manual_eq)]
        #[derive(Clone, Debug, Default, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(pub String);

        impl PartialEq for $name {
            fn eq(&self, other: &Self) -> bool {
                #[cfg(test)]
                ID_COMPARISONS.with(|c| c.set(c.get() + 1));
                self.0 == other.0
            }
        }

        impl $name {
            /// The identifier as a string slice.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl From<&str> for $name {
            fn from(s: &str) -> Self {
                Self(s.to_owned())
            }
        }

        impl From<String> for $name {
            fn from(s: String) -> Self {
                Self(s)
            }
        }

        impl Borrow<str> for $name {
            fn borrow(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }
    };
}

string_id!(
    /// Identifier of a request (unique among live requests).
    RequestId
);

string_id!(
    /// Content hash (or user-supplied UUID) identifying one multimodal item, as vLLM's `mm_hash`.
    MmHash
);

/// Errors reported by the cache managers. Messages say what was wrong and, where useful, what to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CacheError {
    /// A constructor argument is out of range.
    #[error("invalid cache configuration: {0}")]
    InvalidConfig(String),
    /// More blocks were requested than the free queue holds.
    #[error("cannot allocate {requested} KV blocks: only {free} are free")]
    NotEnoughFreeBlocks {
        /// Blocks asked for.
        requested: usize,
        /// Blocks in the free queue.
        free: usize,
    },
    /// A block id that the operation cannot accept.
    #[error("invalid KV block {block}: {reason}")]
    InvalidBlock {
        /// The offending block id.
        block: BlockId,
        /// Why it was rejected.
        reason: &'static str,
    },
    /// `cache_full_blocks` with different numbers of blocks and hashes.
    #[error("cannot cache {blocks} KV blocks with {hashes} block hashes: the counts must match")]
    BlockHashCountMismatch {
        /// Blocks passed.
        blocks: usize,
        /// Hashes passed.
        hashes: usize,
    },
    /// `reset_prefix_cache` while requests still hold blocks.
    #[error(
        "cannot reset the prefix cache: {in_use} KV blocks are still in use by running requests \
         (free or preempt them first)"
    )]
    BlocksInUse {
        /// Blocks (besides the null block) with a reference count above zero.
        in_use: usize,
    },
    /// `allocate_slots` with nothing to schedule.
    #[error("num_new_tokens must be greater than 0")]
    ZeroNewTokens,
    /// Prefix-cache hits may only be attached to a request that holds no blocks yet.
    #[error("request {0} already holds KV blocks; prefix-cache hits are only accepted for new requests")]
    ComputedBlocksForRunningRequest(RequestId),
    /// A prefix-cache hit whose block no longer carries the expected hash.
    #[error(
        "prefix-cache hit on KV block {block} (position {position}) is stale: the block was evicted \
         or re-hashed since get_computed_blocks; look the request up again"
    )]
    StaleComputedBlock {
        /// The block id of the hit.
        block: BlockId,
        /// Its position in the request's block table.
        position: usize,
    },
    /// `allocate` on an encoder-cache entry that already exists.
    #[error("encoder cache already holds {0}; use check_and_update_cache to reference an existing entry")]
    EncoderEntryExists(MmHash),
    /// `allocate` without enough free encoder-cache slots.
    #[error(
        "encoder cache cannot hold {mm_hash} ({needed} tokens): only {free} slots are free \
         (call can_allocate first; it evicts unreferenced entries)"
    )]
    EncoderCacheFull {
        /// The item that did not fit.
        mm_hash: MmHash,
        /// Its size in encoder tokens.
        needed: usize,
        /// Free slots at the time of the call.
        free: usize,
    },
}
