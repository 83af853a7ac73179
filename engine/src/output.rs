//! One request's output as every front end reports it (vLLM's `OutputProcessor` with its
//! `IncrementalDetokenizer`): incremental detokenization, each token decoded once, stop strings
//! (the text ends before the first one, as in vLLM and OpenAI; while streaming, text that could be
//! the start of a stop string is held back), and the tokens with their log-probabilities.

use crate::engine::{FinishReason, TokenEvent};
use crate::input::tokenizer::{IncrementalDecoder, Tokenizer};
use crate::input::InputError;

/// A generated token and its log-probabilities.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    /// The token id.
    pub token: u32,
    /// Its log-probability.
    pub logprob: f32,
    /// The most likely tokens, best first (empty unless asked for).
    pub top: Vec<(u32, f32)>,
    /// Byte offset of its text in the output (completions' `text_offset`).
    pub offset: usize,
}

/// What one token adds to the answer.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Delta {
    /// Text that may be sent now.
    pub text: String,
    /// The token, unless it came after the output had ended.
    pub token: Option<TokenLogprobs>,
    /// Set on the last delta.
    pub finish: Option<FinishReason>,
    /// A stop string ended the output (the engine has not finished the request).
    pub stopped: bool,
}

/// The output of one request so far.
#[derive(Debug)]
pub struct Output {
    decoder: IncrementalDecoder,
    stop: Vec<String>,
    /// Bytes held back while streaming: the longest stop string minus one.
    hold: usize,
    /// The output ends after the stop string instead of before it (vLLM's
    /// `include_stop_str_in_output`).
    include_stop: bool,
    text: String,
    sent: usize,
    /// Tokens counted in the answer (those after a stop string are not).
    pub num_tokens: usize,
    finish: Option<FinishReason>,
}

/// The largest char boundary of `s` at or below `i`.
fn floor_boundary(s: &str, mut i: usize) -> usize {
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

impl Output {
    /// An empty output ending at any of `stop` (empty strings are ignored), before the stop string
    /// or, with `include_stop`, after it.
    pub fn new(stop: Vec<String>, include_stop: bool) -> Self {
        let stop: Vec<String> = stop.into_iter().filter(|s| !s.is_empty()).collect();
        let hold = stop.iter().map(|s| s.len().saturating_sub(1)).max().unwrap_or(0);
        Output {
            decoder: IncrementalDecoder::new(true),
            stop,
            hold,
            include_stop,
            text: String::new(),
            sent: 0,
            num_tokens: 0,
            finish: None,
        }
    }

    /// Adds one token from the engine; fails only when the tokenizer cannot decode it.
    pub fn push(&mut self, tokenizer: &Tokenizer, event: TokenEvent) -> Result<Delta, InputError> {
        if self.finish.is_some() {
            return Ok(Delta::default());
        }
        self.num_tokens += 1;
        let before = self.text.len();
        if let Some(piece) = self.decoder.step(tokenizer, event.token)? {
            self.text.push_str(&piece);
        }
        if event.finish.is_some() {
            if let Some(rest) = self.decoder.finish(tokenizer)? {
                self.text.push_str(&rest);
            }
        }
        let mut stopped = false;
        if let Some((start, len)) = self.find_stop(before) {
            self.text.truncate(if self.include_stop { start + len } else { start });
            self.finish = Some(FinishReason::Stop);
            stopped = event.finish.is_none();
        } else {
            self.finish = event.finish;
        }
        let end = if self.finish.is_some() {
            self.text.len()
        } else {
            floor_boundary(&self.text, self.text.len().saturating_sub(self.hold)).max(self.sent)
        };
        let text = self.text[self.sent..end].to_string();
        self.sent = end;
        Ok(Delta {
            text,
            token: Some(TokenLogprobs {
                token: event.token,
                logprob: event.logprob,
                top: event.top_logprobs,
                offset: before,
            }),
            finish: self.finish,
            stopped,
        })
    }

    /// Ends the output early with `reason` (the request was stopped from outside): the text held
    /// back so far, for stop strings or an unfinished character, is released.
    pub fn cut(&mut self, tokenizer: &Tokenizer, reason: FinishReason) -> Delta {
        if let Ok(Some(rest)) = self.decoder.finish(tokenizer) {
            self.text.push_str(&rest);
        }
        self.finish = Some(reason);
        let text = self.text[self.sent..].to_string();
        self.sent = self.text.len();
        Delta {
            text,
            finish: Some(reason),
            ..Delta::default()
        }
    }

    /// Where the first stop string that ends after `from` begins, and its length.
    fn find_stop(&self, from: usize) -> Option<(usize, usize)> {
        self.stop
            .iter()
            .filter_map(|s| {
                let start = floor_boundary(&self.text, from.saturating_sub(s.len() - 1));
                self.text[start..].find(s.as_str()).map(|i| (start + i, s.len()))
            })
            .min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A byte-level tokenizer: ids 0..=255 are single bytes, 256 is a special end token.
    fn tokenizer() -> Tokenizer {
        let vocab: serde_json::Map<String, serde_json::Value> =
            (0..=255u32).map(|b| (format!("<0x{b:02X}>"), b.into())).collect();
        let json = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": [{"id": 256, "content": "<end>", "single_word": false, "lstrip": false,
                              "rstrip": false, "normalized": false, "special": true}],
            "normalizer": null, "pre_tokenizer": null, "post_processor": null,
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                      "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": true,
                      "vocab": vocab, "merges": []},
            "decoder": {"type": "ByteFallback"},
        });
        Tokenizer::from_bytes(json.to_string().as_bytes()).unwrap()
    }

    fn event(token: u32, finish: Option<FinishReason>) -> TokenEvent {
        TokenEvent {
            id: "r".into(),
            token,
            logprob: -0.5,
            top_logprobs: vec![],
            finish,
        }
    }

    fn feed(out: &mut Output, tok: &Tokenizer, text: &[u8], last: Option<FinishReason>) -> Vec<Delta> {
        text.iter()
            .enumerate()
            .map(|(i, &b)| {
                let finish = if i + 1 == text.len() { last } else { None };
                out.push(tok, event(b as u32, finish)).unwrap()
            })
            .collect()
    }

    fn joined(deltas: &[Delta]) -> String {
        deltas.iter().map(|d| d.text.as_str()).collect()
    }

    /// A 500-token reply is decoded a few tokens at a time: each token decodes again at most the
    /// last character emitted and the unfinished one (the playground re-decoded the whole reply
    /// per token, quadratic in its length).
    #[test]
    fn a_long_reply_is_decoded_a_bounded_window_at_a_time() {
        let tok = tokenizer();
        let mut out = Output::new(vec![], false);
        let mut text = "ab é 漢字 🙂 ".repeat(30);
        text.truncate(floor_boundary(&text, 500));
        text.extend(std::iter::repeat_n('x', 500 - text.len()));
        let bytes = text.as_bytes();
        let mut joined = String::new();
        let mut widest = 0;
        for (i, &b) in bytes.iter().enumerate() {
            let last = (i + 1 == bytes.len()).then_some(FinishReason::Length);
            joined.push_str(&out.push(&tok, event(b as u32, last)).unwrap().text);
            widest = widest.max(out.decoder.window());
        }
        assert_eq!(out.num_tokens, 500);
        assert_eq!(joined, text);
        assert!(widest <= 8, "a step decoded {widest} tokens again");
    }

    #[test]
    fn text_streams_whole_and_multibyte_chars_wait_for_their_last_byte() {
        let tok = tokenizer();
        let mut out = Output::new(vec![], false);
        let deltas = feed(&mut out, &tok, "aé b".as_bytes(), Some(FinishReason::Length));
        assert_eq!(deltas[1].text, "", "first byte of é is held");
        assert_eq!(deltas[2].text, "é");
        assert_eq!(joined(&deltas), "aé b");
        assert_eq!(deltas.last().unwrap().finish, Some(FinishReason::Length));
        assert_eq!(out.num_tokens, 5);
    }

    #[test]
    fn stop_strings_cut_the_text_and_are_never_streamed() {
        let tok = tokenizer();
        let mut out = Output::new(vec!["STOP".into(), String::new()], false);
        let deltas = feed(&mut out, &tok, b"abcSTOPxyz", None);
        assert_eq!(joined(&deltas), "abc");
        let last = deltas.iter().position(|d| d.finish.is_some()).unwrap();
        assert_eq!(last, 6, "the token completing STOP ends the output");
        assert!(deltas[last].stopped);
        assert_eq!(deltas[last].finish, Some(FinishReason::Stop));
        assert!(deltas[last + 1..]
            .iter()
            .all(|d| d.token.is_none() && d.text.is_empty()));
        assert_eq!(out.num_tokens, 7);
        // Held-back text that turns out not to be a stop string is released.
        let mut out = Output::new(vec!["STOP".into()], false);
        let deltas = feed(&mut out, &tok, b"xSTx", Some(FinishReason::Length));
        assert_eq!(deltas[2].text, "", "ST may start STOP");
        assert_eq!(joined(&deltas), "xSTx");
        // vLLM's include_stop_str_in_output keeps the stop string.
        let mut out = Output::new(vec!["STOP".into()], true);
        let deltas = feed(&mut out, &tok, b"abcSTOPxyz", None);
        assert_eq!(joined(&deltas), "abcSTOP");
        assert!(deltas.iter().any(|d| d.finish == Some(FinishReason::Stop)));
    }

    #[test]
    fn a_cut_output_releases_the_text_it_held_back() {
        let tok = tokenizer();
        let mut out = Output::new(vec!["STOP".into()], false);
        let deltas = feed(&mut out, &tok, b"abST", None);
        assert_eq!(joined(&deltas), "a", "the last 3 bytes may start STOP");
        let last = out.cut(&tok, FinishReason::Abort);
        assert_eq!((last.text.as_str(), last.finish), ("bST", Some(FinishReason::Abort)));
        assert!(last.token.is_none());
    }

    #[test]
    fn a_stop_string_in_the_last_allowed_token_is_a_stop() {
        let tok = tokenizer();
        let mut out = Output::new(vec!["cd".into()], false);
        let deltas = feed(&mut out, &tok, b"abcd", Some(FinishReason::Length));
        assert_eq!(joined(&deltas), "ab");
        let last = deltas.last().unwrap();
        assert_eq!(last.finish, Some(FinishReason::Stop));
        assert!(!last.stopped, "the engine has already ended it");
    }

    #[test]
    fn special_tokens_are_skipped_and_an_engine_stop_keeps_its_reason() {
        let tok = tokenizer();
        let mut out = Output::new(vec!["zz".into()], false);
        let mut deltas = feed(&mut out, &tok, b"hi", None);
        deltas.push(out.push(&tok, event(256, Some(FinishReason::Stop))).unwrap());
        assert_eq!(joined(&deltas), "hi");
        assert_eq!(deltas[2].finish, Some(FinishReason::Stop));
        assert!(!deltas[2].stopped, "the engine ended it itself");
        assert_eq!(deltas[1].token.as_ref().unwrap().offset, 1);
    }
}
