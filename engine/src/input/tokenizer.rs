//! The Qwen tokenizer: a thin wrapper over the `tokenizers` crate that loads `tokenizer.json` from
//! bytes, encodes rendered chat prompts (special tokens such as `<|im_start|>` are matched as added
//! tokens; nothing such as a BOS is added) and decodes, in one go or incrementally while streaming.

use super::InputError;

/// A loaded `tokenizer.json`.
#[derive(Debug, Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
}

impl Tokenizer {
    /// Loads a tokenizer from the bytes of `tokenizer.json`.
    pub fn from_bytes(json: &[u8]) -> Result<Self, InputError> {
        tokenizers::Tokenizer::from_bytes(json)
            .map(|inner| Tokenizer { inner })
            .map_err(|e| InputError::TokenizerJson(e.to_string()))
    }

    /// Token ids of `text`, with special tokens written in the text parsed as themselves and no
    /// BOS/EOS added (what transformers gives for a rendered chat template).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, InputError> {
        self.encode_with(text, false)
    }

    /// [`Tokenizer::encode`], with the special tokens the tokenizer's post-processor adds (such as
    /// a BOS) when `add_special_tokens` is set, as transformers' `tokenizer(text)` does.
    pub fn encode_with(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, InputError> {
        self.inner
            .encode_fast(text, add_special_tokens)
            .map(|encoding| encoding.get_ids().to_vec())
            .map_err(|e| InputError::Tokenize(e.to_string()))
    }

    /// The text of `ids`; with `skip_special_tokens` special tokens (such as `<|im_end|>`) are left out.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, InputError> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| InputError::Tokenize(e.to_string()))
    }

    /// The id of a token string (`"<|image_pad|>"` → 151655), `None` if it is not in the vocabulary.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The token string of an id as the vocabulary spells it (`"Ġcache"`), as transformers'
    /// `convert_ids_to_tokens`; `None` outside the vocabulary.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The most bytes of text one token stands for (each id decoded on its own; a lone byte of
    /// a multi-byte character decodes to U+FFFD, 3 bytes, so this never undercounts). A text of
    /// `n` bytes has at least `n / max_token_bytes()` tokens, known before encoding it.
    pub fn max_token_bytes(&self) -> usize {
        self.inner
            .get_vocab(true)
            .values()
            .filter_map(|&id| self.inner.decode(&[id], false).ok())
            .map(|text| text.len())
            .max()
            .unwrap_or(1)
            .max(1)
    }
}

/// Turns a stream of generated ids into text pieces, holding text back while it ends in an
/// incomplete UTF-8 sequence (byte-level BPE splits multi-byte characters across tokens).
/// The concatenation of every [`IncrementalDecoder::step`] and the final
/// [`IncrementalDecoder::finish`] equals [`Tokenizer::decode`] of all ids.
#[derive(Debug, Clone, Default)]
pub struct IncrementalDecoder {
    ids: Vec<u32>,
    /// Start of the window that is decoded again for context.
    prefix_offset: usize,
    /// End of the ids whose text has been emitted.
    read_offset: usize,
    skip_special_tokens: bool,
}

impl IncrementalDecoder {
    /// A decoder for a new sequence.
    pub fn new(skip_special_tokens: bool) -> Self {
        IncrementalDecoder {
            skip_special_tokens,
            ..IncrementalDecoder::default()
        }
    }

    /// Adds one id; returns the text it completes, if any.
    pub fn step(&mut self, tokenizer: &Tokenizer, id: u32) -> Result<Option<String>, InputError> {
        self.ids.push(id);
        let prefix = tokenizer.decode(
            &self.ids[self.prefix_offset..self.read_offset],
            self.skip_special_tokens,
        )?;
        let full = tokenizer.decode(&self.ids[self.prefix_offset..], self.skip_special_tokens)?;
        if full.len() <= prefix.len() || full.ends_with(char::REPLACEMENT_CHARACTER) {
            return Ok(None);
        }
        let Some(new_text) = full.get(prefix.len()..).filter(|_| full.starts_with(prefix.as_str())) else {
            // The context decoded differently with the new id; emit nothing until it settles.
            return Ok(None);
        };
        let new_text = new_text.to_string();
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        Ok(Some(new_text))
    }

    /// How many ids the next step decodes again besides the new one (the work per token).
    #[cfg(test)]
    pub(crate) fn window(&self) -> usize {
        self.ids.len() - self.prefix_offset
    }

    /// Text still held back at the end of the sequence (an incomplete character decodes as U+FFFD,
    /// as in a full decode).
    pub fn finish(&mut self, tokenizer: &Tokenizer) -> Result<Option<String>, InputError> {
        let prefix = tokenizer.decode(
            &self.ids[self.prefix_offset..self.read_offset],
            self.skip_special_tokens,
        )?;
        let full = tokenizer.decode(&self.ids[self.prefix_offset..], self.skip_special_tokens)?;
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        Ok(full
            .get(prefix.len()..)
            .filter(|rest| !rest.is_empty())
            .map(str::to_string))
    }
}
