//! Chained SHA-256 hashes of full KV blocks (vLLM `hash_block_tokens` / `get_request_block_hasher`).
//!
//! `hash(block i) = SHA-256(parent, tokens, extra keys)` where `parent` is the hash of block `i − 1`
//! (or a fixed seed for block 0) and the extra keys are the mm hashes of every multimodal item whose
//! placeholder range overlaps the block, plus the cache salt for block 0. Every field is length-prefixed,
//! so two different inputs never produce the same byte string.

use std::fmt;

use serde::{Serialize, Serializer};
use sha2::{Digest, Sha256};

use super::{CacheError, MmHash};

/// A token id as fed to the model.
pub type TokenId = u32;

/// Domain tag hashed in place of a parent for block 0 (vLLM's `NONE_HASH`, fixed for reproducibility).
const NONE_HASH_SEED: &[u8] = b"kvlens/kv-block-hash/none/v1";
/// Tag of an mm-hash extra key.
const KEY_MM: u8 = 0;
/// Tag of the cache-salt extra key.
const KEY_SALT: u8 = 1;

/// SHA-256 hash identifying a full block together with its whole prefix.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub [u8; 32]);

impl BlockHash {
    /// The seed used as the parent of the first block.
    pub fn none_hash() -> Self {
        Self(Sha256::digest(NONE_HASH_SEED).into())
    }
}

impl fmt::Display for BlockHash {
    /// Lowercase hex.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl Serialize for BlockHash {
    /// Serialized as a lowercase hex string.
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

/// Placeholder range of one multimodal item in a request's token sequence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MmSpan {
    /// The item's mm hash.
    pub hash: MmHash,
    /// Index of the first placeholder token.
    pub offset: usize,
    /// Number of placeholder tokens.
    pub length: usize,
}

fn put_len(h: &mut Sha256, n: usize) {
    h.update((n as u64).to_le_bytes());
}

fn put_key(h: &mut Sha256, tag: u8, bytes: &[u8]) {
    h.update([tag]);
    put_len(h, bytes.len());
    h.update(bytes);
}

/// Hash of one block given its parent, tokens and extra keys (items overlapping the block, salt).
fn hash_block(parent: &BlockHash, tokens: &[TokenId], mm: &[&MmHash], salt: Option<&str>) -> BlockHash {
    let mut h = Sha256::new();
    h.update(parent.0);
    put_len(&mut h, tokens.len());
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    put_len(&mut h, mm.len() + usize::from(salt.is_some()));
    for m in mm {
        put_key(&mut h, KEY_MM, m.as_str().as_bytes());
    }
    if let Some(s) = salt {
        put_key(&mut h, KEY_SALT, s.as_bytes());
    }
    BlockHash(h.finalize().into())
}

/// Hashes of every full block of `token_ids` (a trailing partial block is not hashed).
///
/// `mm_items` may be in any order; overlapping items enter each block's key in placeholder order.
/// `cache_salt` enters the first block only, so requests with different salts never share blocks.
pub fn hash_request_blocks(
    token_ids: &[TokenId],
    block_size: usize,
    mm_items: &[MmSpan],
    cache_salt: Option<&str>,
) -> Result<Vec<BlockHash>, CacheError> {
    let mut hashes = Vec::new();
    extend_block_hashes(&mut hashes, token_ids, block_size, mm_items, cache_salt)?;
    Ok(hashes)
}

/// Appends the hashes of blocks that became full since `hashes` was computed (e.g. after decode
/// tokens were appended to `token_ids`) and returns how many were added. `hashes` must be the hashes
/// of the leading blocks of the same request (same items and salt).
pub fn extend_block_hashes(
    hashes: &mut Vec<BlockHash>,
    token_ids: &[TokenId],
    block_size: usize,
    mm_items: &[MmSpan],
    cache_salt: Option<&str>,
) -> Result<usize, CacheError> {
    if block_size == 0 {
        return Err(CacheError::InvalidConfig("block_size must be at least 1".into()));
    }
    let mut items: Vec<&MmSpan> = mm_items.iter().filter(|m| m.length > 0).collect();
    items.sort_by_key(|m| (m.offset, m.length));

    let before = hashes.len();
    let mut parent = hashes.last().copied().unwrap_or_else(BlockHash::none_hash);
    for (i, tokens) in token_ids.chunks_exact(block_size).enumerate().skip(before) {
        let start = i * block_size;
        let end = start + block_size;
        let overlapping: Vec<&MmHash> = items
            .iter()
            .filter(|m| m.offset < end && m.offset.saturating_add(m.length) > start)
            .map(|m| &m.hash)
            .collect();
        let salt = if i == 0 { cache_salt } else { None };
        parent = hash_block(&parent, tokens, &overlapping, salt);
        hashes.push(parent);
    }
    Ok(hashes.len() - before)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(hash: &str, offset: usize, length: usize) -> MmSpan {
        MmSpan {
            hash: hash.into(),
            offset,
            length,
        }
    }

    #[test]
    fn only_full_blocks_are_hashed() {
        let toks: Vec<TokenId> = (0..40).collect();
        assert_eq!(hash_request_blocks(&toks, 16, &[], None).unwrap().len(), 2);
        assert_eq!(hash_request_blocks(&toks[..15], 16, &[], None).unwrap().len(), 0);
        assert!(hash_request_blocks(&toks, 0, &[], None).is_err());
    }

    #[test]
    fn chained_and_deterministic() {
        let a: Vec<TokenId> = (0..48).collect();
        let mut b = a.clone();
        b[0] = 999;
        let ha = hash_request_blocks(&a, 16, &[], None).unwrap();
        let hb = hash_request_blocks(&b, 16, &[], None).unwrap();
        assert_eq!(ha, hash_request_blocks(&a, 16, &[], None).unwrap());
        // A change in block 0 changes every later hash (the chain), although blocks 1 and 2 are equal.
        assert!(ha.iter().zip(&hb).all(|(x, y)| x != y));
        // Same tokens at a different position (different parent) hash differently.
        let same = hash_request_blocks(&[5; 32], 16, &[], None).unwrap();
        assert_ne!(same[0], same[1]);
    }

    #[test]
    fn mm_hash_enters_every_overlapping_block() {
        let toks = vec![7; 64];
        let base = hash_request_blocks(&toks, 16, &[], None).unwrap();
        // Item covering tokens 10..40 overlaps blocks 0, 1 and 2 but not 3.
        let a = hash_request_blocks(&toks, 16, &[span("imgA", 10, 30)], None).unwrap();
        let b = hash_request_blocks(&toks, 16, &[span("imgB", 10, 30)], None).unwrap();
        for i in 0..3 {
            assert_ne!(a[i], base[i]);
            assert_ne!(a[i], b[i]);
        }
        // Block 3 differs only through the chain; with an item limited to block 3 it differs directly.
        let late = hash_request_blocks(&toks, 16, &[span("imgA", 48, 16)], None).unwrap();
        assert_eq!(late[..3], base[..3]);
        assert_ne!(late[3], base[3]);
        // Order of the item list does not matter.
        let two = [span("x", 0, 4), span("y", 8, 4)];
        let rev = [two[1].clone(), two[0].clone()];
        assert_eq!(
            hash_request_blocks(&toks, 16, &two, None).unwrap(),
            hash_request_blocks(&toks, 16, &rev, None).unwrap()
        );
    }

    #[test]
    fn salt_only_first_block_but_chains() {
        let toks = vec![1; 32];
        let plain = hash_request_blocks(&toks, 16, &[], None).unwrap();
        let salted = hash_request_blocks(&toks, 16, &[], Some("s")).unwrap();
        assert_ne!(plain[0], salted[0]);
        assert_ne!(plain[1], salted[1]);
        // A salt is not confused with an mm hash of the same text.
        let mm = hash_request_blocks(&toks, 16, &[span("s", 0, 1)], None).unwrap();
        assert_ne!(mm[0], salted[0]);
    }

    #[test]
    fn field_boundaries_are_unambiguous() {
        let toks = vec![3; 16];
        let ab = hash_request_blocks(&toks, 16, &[span("ab", 0, 1), span("c", 1, 1)], None).unwrap();
        let a_bc = hash_request_blocks(&toks, 16, &[span("a", 0, 1), span("bc", 1, 1)], None).unwrap();
        assert_ne!(ab, a_bc);
    }

    #[test]
    fn incremental_matches_full() {
        let mut toks: Vec<TokenId> = (0..20).collect();
        let items = [span("img", 4, 30)];
        let mut hashes = hash_request_blocks(&toks, 16, &items, Some("salt")).unwrap();
        assert_eq!(hashes.len(), 1);
        toks.extend(20..50);
        assert_eq!(
            extend_block_hashes(&mut hashes, &toks, 16, &items, Some("salt")).unwrap(),
            2
        );
        assert_eq!(hashes, hash_request_blocks(&toks, 16, &items, Some("salt")).unwrap());
        assert_eq!(
            extend_block_hashes(&mut hashes, &toks, 16, &items, Some("salt")).unwrap(),
            0
        );
    }

    #[test]
    fn hex_display_and_serde() {
        let h = BlockHash([0xab; 32]);
        assert_eq!(h.to_string(), "ab".repeat(32));
        assert_eq!(serde_json::to_string(&h).unwrap(), format!("\"{}\"", "ab".repeat(32)));
    }
}
