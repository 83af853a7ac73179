//! vLLM's budget for hybrid models (Qwen3.5: Gated DeltaNet layers beside full attention), as
//! vLLM 0.17 computes it: `HybridAttentionMambaModelConfig.verify_and_update_config` in
//! <https://github.com/vllm-project/vllm/blob/v0.17.1/vllm/model_executor/models/config.py> and
//! `_get_kv_cache_groups_uniform_page_size` / `get_max_concurrency_for_kv_cache_config` in
//! <https://github.com/vllm-project/vllm/blob/v0.17.1/vllm/v1/core/kv_cache_utils.py>.
//!
//! Each Gated DeltaNet layer keeps one state per request: a conv window of `kernel − 1` inputs in
//! the model's dtype and a recurrent state `[value_heads, value_dim, key_dim]` in `mamba_ssm_dtype`
//! (float32 for Qwen3.5). vLLM stores both kinds of memory in one block pool: it raises the
//! attention block size until one attention page (one layer, one block) holds a state, pads the
//! state to that page, and deals the layers into KV cache groups of equal size (for Qwen3.5 one
//! group of the full-attention layers and three of the Gated DeltaNet layers). A block id then
//! addresses one page in every layer of a group; a request takes blocks for its tokens in the
//! attention group and, without prefix caching, one block in each state group.

use crate::arch::config::{DType, LayerKind, LinearAttention, TextConfig};

/// The block size kernels take a multiple of (vLLM's `kernel_block_alignment_size` on every
/// device but Blackwell with FlashInfer).
const KERNEL_BLOCK_ALIGNMENT: u64 = 16;

/// How vLLM lays out a hybrid model's KV cache and states.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct HybridLayout {
    /// Full-attention layers.
    pub attention_layers: usize,
    /// Gated DeltaNet layers.
    pub state_layers: usize,
    /// One request's conv window in one layer, bytes.
    pub conv_state_bytes: u64,
    /// One request's recurrent state in one layer, bytes.
    pub ssm_state_bytes: u64,
    /// The smallest attention block whose page holds a state ("Setting attention block size").
    pub min_block_size: usize,
    /// KV cache groups: the attention group and the state groups.
    pub groups: usize,
    /// Layers per group: one block id addresses one page in each.
    pub layers_per_group: usize,
}

impl HybridLayout {
    /// The layout of `t` on one of `tp` ranks, with the KV cache in `kv_dtype` and the conv
    /// window in the model's `dtype`; None for a model without Gated DeltaNet layers.
    pub fn of(t: &TextConfig, tp: usize, dtype: DType, kv_dtype: DType) -> Option<Self> {
        let l: &LinearAttention = t.linear.as_ref()?;
        let tp = tp.max(1) as u64;
        let conv_state_bytes = (l.conv_kernel as u64 - 1) * (l.conv_dim() as u64 / tp) * dtype.size_bytes();
        let ssm = l.ssm_dtype.unwrap_or(dtype);
        let ssm_state_bytes =
            (l.num_value_heads as u64 / tp) * l.key_head_dim as u64 * l.value_head_dim as u64 * ssm.size_bytes();
        let kv_heads = (t.num_key_value_heads as u64 / tp).max(1);
        let token_page = 2 * kv_heads * t.head_dim as u64 * kv_dtype.size_bytes();
        let state = conv_state_bytes + ssm_state_bytes;
        let min_block_size = KERNEL_BLOCK_ALIGNMENT * state.div_ceil(KERNEL_BLOCK_ALIGNMENT * token_page);
        let attention_layers = (0..t.num_hidden_layers)
            .filter(|&i| t.layer_kind(i) == LayerKind::FullAttention)
            .count();
        let state_layers = t.num_hidden_layers - attention_layers;
        // Buckets of equal layers are dealt into groups of the smaller bucket's size, or of the
        // larger's when it is less than 1.5 times the smaller.
        let (small, large) = (
            attention_layers.min(state_layers).max(1),
            attention_layers.max(state_layers),
        );
        let layers_per_group = if (large as f64) < small as f64 * 1.5 {
            large
        } else {
            small
        };
        let groups = [attention_layers, state_layers]
            .iter()
            .map(|&n| n.div_ceil(layers_per_group))
            .sum();
        Some(HybridLayout {
            attention_layers,
            state_layers,
            conv_state_bytes,
            ssm_state_bytes,
            min_block_size: min_block_size as usize,
            groups,
            layers_per_group,
        })
    }

    /// One request's state in one layer, before padding.
    pub fn state_bytes(&self) -> u64 {
        self.conv_state_bytes + self.ssm_state_bytes
    }

    /// State groups: every group but the attention one.
    pub fn state_groups(&self) -> usize {
        self.groups - self.attention_layers.div_ceil(self.layers_per_group)
    }

    /// The block size vLLM runs with when the user asked for `requested` (None: the default):
    /// raised to [`Self::min_block_size`] when smaller.
    pub fn block_size(&self, requested: Option<usize>) -> usize {
        requested.map_or(self.min_block_size, |b| b.max(self.min_block_size))
    }

    /// The start-up lines vLLM logs for a page of `page_bytes` at `block_size`, in its wording.
    pub fn log_lines(&self, block_size: usize, requested: Option<usize>, page_bytes: u64) -> Vec<String> {
        let mut lines = Vec::new();
        if requested.is_none_or(|b| b < self.min_block_size) {
            lines.push(format!(
                "Setting attention block size to {block_size} tokens to ensure that attention page size is >= mamba page size."
            ));
        }
        let state = self.state_bytes();
        if page_bytes > state {
            lines.push(format!(
                "Padding mamba page size by {:.2}% to ensure that mamba page size and attention page size are exactly equal.",
                100.0 * (page_bytes - state) as f64 / state as f64
            ));
        }
        lines
    }

    /// Bytes of the states of `requests` running requests in every Gated DeltaNet layer, unpadded
    /// (kvlens keeps them in a pool of their own, `max_num_seqs` slots, where vLLM takes a block
    /// per request and state group from the KV pool).
    pub fn state_pool_bytes(&self, requests: usize) -> u64 {
        requests as u64 * self.state_layers as u64 * self.state_bytes()
    }

    /// KV blocks (a page in each layer of a group) whose memory holds [`Self::state_pool_bytes`].
    pub fn blocks_for_states(&self, requests: usize, page_bytes: u64) -> u64 {
        self.state_pool_bytes(requests)
            .div_ceil((page_bytes * self.layers_per_group as u64).max(1))
    }

    /// Blocks one request of `max_model_len` tokens takes: its tokens' blocks in the attention
    /// group and one block in each state group.
    pub fn blocks_per_request(&self, max_model_len: usize, block_size: usize) -> u64 {
        (max_model_len as u64).div_ceil(block_size.max(1) as u64) + self.state_groups() as u64
    }

    /// Bytes one request of `max_model_len` tokens needs at `page_bytes` per page: every attention
    /// layer's blocks and every state layer's one (padded) page (vLLM's `max_memory_usage_bytes`
    /// summed over layers).
    pub fn bytes_per_request(&self, max_model_len: usize, block_size: usize, page_bytes: u64) -> u64 {
        let blocks = (max_model_len as u64).div_ceil(block_size.max(1) as u64);
        (self.attention_layers as u64 * blocks + self.state_layers as u64) * page_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::config::bundled_config;

    #[test]
    fn qwen3_5_sizes_get_the_block_sizes_vllm_logs() {
        // vLLM 0.17 logs "Setting attention block size to 784 tokens" and "Padding mamba page size
        // by 0.13%" for Qwen3.5-27B, 1056 and 0.76% for 35B-A3B (its KV heads: 2 of 256).
        let cfg = bundled_config("Qwen3.5-27B").unwrap();
        let h = HybridLayout::of(&cfg.text, 1, DType::Bf16, DType::Bf16).unwrap();
        assert_eq!((h.conv_state_bytes, h.ssm_state_bytes), (61_440, 3_145_728));
        assert_eq!(h.min_block_size, 784);
        assert_eq!(
            (h.attention_layers, h.state_layers, h.groups, h.layers_per_group),
            (16, 48, 4, 16)
        );
        let page = 784 * 4096;
        assert_eq!(
            h.log_lines(784, None, page)[1],
            "Padding mamba page size by 0.13% to ensure that mamba page size and attention page size are exactly equal."
        );
        // A larger --block-size is kept and logs no "Setting" line.
        assert_eq!(h.block_size(Some(800)), 800);
        assert_eq!(h.log_lines(800, Some(800), 800 * 4096).len(), 1);
        let small = bundled_config("Qwen3.5-0.8B").unwrap();
        let h = HybridLayout::of(&small.text, 1, DType::Bf16, DType::Bf16).unwrap();
        assert_eq!((h.min_block_size, h.groups, h.layers_per_group), (544, 4, 6));
        // An fp8 KV cache halves the token page and doubles the block.
        let four = bundled_config("Qwen3.5-4B").unwrap();
        let fp8 = HybridLayout::of(&four.text, 1, DType::Bf16, DType::Fp8).unwrap();
        assert_eq!(fp8.min_block_size, 1056);
    }
}
