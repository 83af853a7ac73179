//! One request as the scheduler sees it: its tokens, image placeholders, block hashes and how far
//! the KV cache holds it, plus whatever the caller carries along.

use crate::cache::{extend_block_hashes, BlockHash, BlockKeys, CacheError, MmSpan, RequestId, TokenId};

/// A request waiting or running: prompt plus generated tokens, of which the first
/// [`Sequence::computed`] are in the KV cache. `data` is the caller's (the engine keeps pixels and
/// sampling state there), carried through preemption untouched.
#[derive(Debug)]
pub struct Sequence<T> {
    id: RequestId,
    prompt: Vec<TokenId>,
    output: Vec<TokenId>,
    spans: Vec<MmSpan>,
    hashes: Vec<BlockHash>,
    computed: usize,
    running: bool,
    /// The caller's per-request state.
    pub data: T,
}

impl<T> Sequence<T> {
    /// A sequence with nothing computed; `spans` must be sorted and inside the prompt (checked by
    /// [`super::Scheduler::add`]).
    pub(super) fn new(
        id: RequestId,
        prompt: Vec<TokenId>,
        spans: Vec<MmSpan>,
        block_size: usize,
        data: T,
    ) -> Result<Self, CacheError> {
        let mut hashes = Vec::new();
        extend_block_hashes(&mut hashes, &prompt, block_size, &spans, None)?;
        Ok(Sequence {
            id,
            prompt,
            output: Vec::new(),
            spans,
            hashes,
            computed: 0,
            running: false,
            data,
        })
    }

    /// Whether the request holds KV blocks (is in the running list).
    pub fn is_running(&self) -> bool {
        self.running
    }

    /// Marks the request running or waiting.
    pub(super) fn set_running(&mut self, running: bool) {
        self.running = running;
    }

    /// The request id.
    pub fn id(&self) -> &RequestId {
        &self.id
    }

    /// Prompt token ids (image placeholders expanded).
    pub fn prompt(&self) -> &[TokenId] {
        &self.prompt
    }

    /// Tokens generated so far.
    pub fn output(&self) -> &[TokenId] {
        &self.output
    }

    /// Prompt plus output length.
    pub fn len(&self) -> usize {
        self.prompt.len() + self.output.len()
    }

    /// Whether the sequence has no tokens (never true for a scheduled request).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Tokens whose KV is computed (or scheduled to be computed in the step just planned).
    pub fn computed(&self) -> usize {
        self.computed
    }

    /// The token at position `i` of prompt + output.
    pub fn token_at(&self, i: usize) -> TokenId {
        match i.checked_sub(self.prompt.len()) {
            Some(j) => self.output[j],
            None => self.prompt[i],
        }
    }

    /// Image placeholder ranges in prompt order.
    pub fn spans(&self) -> &[MmSpan] {
        &self.spans
    }

    /// Full-block hashes of prompt + output.
    pub fn block_hashes(&self) -> &[BlockHash] {
        &self.hashes
    }

    /// Block hashes with the tokens and spans they cover (what the KV cache's events report).
    pub fn block_keys(&self) -> BlockKeys<'_> {
        BlockKeys {
            hashes: &self.hashes,
            tokens: [&self.prompt, &self.output],
            spans: &self.spans,
        }
    }

    /// Indices of the images whose placeholders overlap positions `[from, to)`.
    pub fn images_in(&self, from: usize, to: usize) -> impl Iterator<Item = usize> + '_ {
        self.spans
            .iter()
            .enumerate()
            .filter(move |(_, s)| s.offset < to && s.offset + s.length > from)
            .map(|(i, _)| i)
    }

    /// Prompt, output and the caller's data at once (sampling reads the tokens and advances the
    /// generator kept in `data`).
    pub fn split_data_mut(&mut self) -> (&[TokenId], &[TokenId], &mut T) {
        (&self.prompt, &self.output, &mut self.data)
    }

    pub(super) fn set_computed(&mut self, computed: usize) {
        self.computed = computed;
    }

    /// Appends a generated token and hashes the blocks it filled.
    pub(super) fn push_token(&mut self, token: TokenId, block_size: usize) -> Result<(), CacheError> {
        self.output.push(token);
        if self.len() >= (self.hashes.len() + 1) * block_size {
            let all: Vec<TokenId> = [&self.prompt[..], &self.output[..]].concat();
            extend_block_hashes(&mut self.hashes, &all, block_size, &self.spans, None)?;
        }
        Ok(())
    }
}
